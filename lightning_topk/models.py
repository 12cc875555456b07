"""Small models used by the default run, the tests and the examples."""
from __future__ import annotations

from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics


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


class Classifier(pl.LightningModule):
    """Image classifier: cross-entropy (optional label smoothing), accuracy on val/test.

    ``optimizer`` is a callable ``params -> torch.optim.Optimizer`` (e.g. a Hydra ``_partial_``), or
    None for SGD(lr, momentum=0.9). ``scheduler`` likewise takes the optimizer.
    """

    def __init__(self, net: nn.Module, optimizer: Optional[Callable[..., Any]] = None, lr: float = 0.05,
                 scheduler: Optional[Callable[..., Any]] = None, label_smoothing: float = 0.0,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.lr = lr
        self.label_smoothing = label_smoothing
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x):
        return self.net(x)

    def _batch(self, batch):
        if isinstance(batch, dict):
            return batch["image"], batch["label"]
        return batch[0], batch[1]

    def training_step(self, batch, batch_idx):
        x, y = self._batch(batch)
        loss = F.cross_entropy(self(x), y, label_smoothing=self.label_smoothing)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = self._batch(batch)
        self.val_acc(self(x).argmax(1), y)
        self.log("val/acc", self.val_acc, prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = self._batch(batch)
        self.test_acc(self(x).argmax(1), y)
        self.log("test/acc", self.test_acc, sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}
