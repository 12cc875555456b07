"""ResNet-18/50 (He et al. 2016), written out so no torchvision is needed.

``zero_init_residual`` starts each residual branch's last BatchNorm at zero (Goyal et al., large-batch
training); ``small_input`` swaps the 7x7/stride-2 stem and max-pool for a 3x3/stride-1 stem (CIFAR-sized images).
"""
from __future__ import annotations

from typing import List, Sequence, Type, Union

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.last_bn = self.bn2
        self.relu = nn.ReLU(inplace=True)
        self.down = _downsample(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (self.down(x) if self.down is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)  # stride on the 3x3 (ResNet v1.5)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.last_bn = self.bn3
        self.relu = nn.ReLU(inplace=True)
        self.down = _downsample(cin, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (self.down(x) if self.down is not None else x))


def _downsample(cin: int, cout: int, stride: int):
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ResNet with ``layers`` blocks per stage; ``width`` is the first stage's width (64 in the paper)."""

    def __init__(self, block: Union[str, Type[nn.Module]], layers: Sequence[int], num_classes: int = 1000,
                 in_channels: int = 3, width: int = 64, zero_init_residual: bool = True,
                 small_input: bool = False) -> None:
        super().__init__()
        if isinstance(block, str):
            if block not in ("basic", "bottleneck"):
                raise ValueError(f"ResNet: block must be 'basic' or 'bottleneck', got {block!r}")
            block = BasicBlock if block == "basic" else Bottleneck
        if len(layers) != 4 or any(int(n) < 1 for n in layers):
            raise ValueError(f"ResNet: layers must be 4 positive ints, got {list(layers)!r}")
        if small_input:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages: List[nn.Module] = []
        cin = width
        for i, n in enumerate(layers):
            w = width * 2 ** i
            blocks = []
            for j in range(int(n)):
                blocks.append(block(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def resnet18(num_classes: int = 1000, **kwargs) -> ResNet:
    """ResNet-18 (basic blocks 2-2-2-2, 11.7M parameters at width 64 and 1000 classes)."""
    return ResNet("basic", (2, 2, 2, 2), num_classes=num_classes, **kwargs)


def resnet50(num_classes: int = 1000, **kwargs) -> ResNet:
    """ResNet-50 v1.5 (bottleneck blocks 3-4-6-3, 25.6M parameters at width 64 and 1000 classes)."""
    return ResNet("bottleneck", (3, 4, 6, 3), num_classes=num_classes, **kwargs)
