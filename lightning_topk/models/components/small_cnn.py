"""A small CNN for 8x8 digits or 28x28 MNIST."""
from __future__ import annotations

import torch
import torch.nn as nn


class SmallCNN(nn.Module):
    """Two 3x3 conv layers, a 2x2 max-pool and a two-layer head; for 8x8 digits or 28x28 MNIST."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, image_size: int = 8,
                 hidden: int = 128) -> None:
        super().__init__()
        if image_size < 2 or image_size % 2:
            raise ValueError(f"SmallCNN: image_size must be an even int >= 2, got {image_size!r}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * (image_size // 2) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
