"""``LanguageModel``: next-token cross-entropy LightningModule around a :class:`TransformerLM`."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override


def _tokens(batch: Any, device: torch.device) -> torch.Tensor:
    """A batch from WebDataModule (tuple whose first field is a tensor or a list of int arrays) -> int64 [B, T]."""
    x = batch[0] if isinstance(batch, (tuple, list)) and not isinstance(batch[0], (int, np.integer)) else batch
    if isinstance(x, (list, tuple)):
        x = torch.from_numpy(np.stack([np.asarray(a) for a in x]))
    return x.to(device=device, dtype=torch.long)


class LanguageModel(pl.LightningModule):
    """Next-token cross-entropy on ``[B, T]`` token batches; logs ``train/loss``, ``val/loss``, ``test/loss``.

    Args:
        net: a :class:`TransformerLM` (or any module ``[B, T] -> [B, T, V]``).
        optimizer: ``callable(module) -> Optimizer`` (Hydra ``_partial_``), ``None``: AdamW(3e-4).
        scheduler: ``callable(optimizer, total_steps=N)``, stepped every optimizer step, or ``None``.
    """

    def __init__(self, net: nn.Module, optimizer: Optional[Callable[..., Any]] = None,
                 scheduler: Optional[Callable[..., Any]] = None) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def _loss(self, batch) -> torch.Tensor:
        tokens = _tokens(batch, self.device)
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    @override
    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True)

    @override
    def configure_optimizers(self):
        opt = (torch.optim.AdamW(self.parameters(), lr=3e-4) if self.optimizer_factory is None
               else self.optimizer_factory(self))
        if self.scheduler_factory is None:
            return opt
        sched = self.scheduler_factory(opt, total_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
