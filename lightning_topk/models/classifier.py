"""``ImageClassifier``: the image-classification LightningModule of the presets, tests and examples."""
from __future__ import annotations

from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from typing_extensions import override


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classifier around ``net``; accuracy on val/test.

    Args:
        net: the network (``nn.Module`` mapping images to logits).
        optimizer: ``callable(module) -> Optimizer`` (a Hydra ``_partial_`` of
            :func:`lightning_topk.app.factories.optimizer`, which excludes biases and norm parameters
            from decay when given the module); ``None``: SGD(lr, momentum=0.9).
        lr: learning rate of the default SGD.
        scheduler: ``callable(optimizer, total_steps=N) -> LRScheduler`` stepped every optimizer step
            (e.g. :func:`lightning_topk.app.factories.warmup_cosine`), or ``None``.
        label_smoothing: cross-entropy label smoothing.
        num_classes: classes (for the accuracy metrics).
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

    @override
    def forward(self, x):
        return self.net(x)

    def _batch(self, batch):
        if isinstance(batch, dict):
            return batch["image"], batch["label"]
        return batch[0], batch[1]

    @override
    def training_step(self, batch, batch_idx):
        x, y = self._batch(batch)
        loss = F.cross_entropy(self(x), y, label_smoothing=self.label_smoothing)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx):
        x, y = self._batch(batch)
        self.val_acc(self(x).argmax(1), y)
        self.log("val/acc", self.val_acc, prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch, batch_idx):
        x, y = self._batch(batch)
        self.test_acc(self(x).argmax(1), y)
        self.log("test/acc", self.test_acc, sync_dist=True)

    @override
    def configure_optimizers(self):
        if self.optimizer_factory is None:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = self.optimizer_factory(self)
        if self.scheduler_factory is None:
            return opt
        sched = self.scheduler_factory(opt, total_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
