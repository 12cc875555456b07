"""``ImageClassifier``: :class:`lightning_topk.models.Classifier` whose optimizer factory gets the module
(so biases and norm parameters can be excluded from decay) and whose scheduler gets the total step count."""
from __future__ import annotations

import torch

from lightning_topk.models import Classifier


class ImageClassifier(Classifier):
    """Cross-entropy classifier around ``net``.

    Args:
        net: the network (``nn.Module`` mapping images to logits).
        optimizer: ``callable(module_or_params) -> Optimizer`` (a Hydra ``_partial_`` of
            :func:`lightning_topk.builders.optimizer`); ``None``: SGD(lr, momentum=0.9).
        scheduler: ``callable(optimizer, total_steps=N) -> LRScheduler`` stepped every optimizer step
            (e.g. :func:`lightning_topk.builders.warmup_cosine`), or ``None``.
        label_smoothing: cross-entropy label smoothing.
        num_classes: classes (for the accuracy metrics).
    """

    def __init__(self, net, optimizer=None, scheduler=None, label_smoothing: float = 0.0, num_classes: int = 10,
                 lr: float = 0.05) -> None:
        super().__init__(net, optimizer=optimizer, lr=lr, scheduler=scheduler, label_smoothing=label_smoothing,
                         num_classes=num_classes)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = self.optimizer_factory(self)
        if self.scheduler_factory is None:
            return opt
        total = int(self.trainer.estimated_stepping_batches)
        sched = self.scheduler_factory(opt, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
