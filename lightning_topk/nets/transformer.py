"""A causal Transformer language model (pre-norm, learned positions, tied embeddings) and its LightningModule."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class TransformerLM(nn.Module):
    """Decoder-only Transformer: token + position embeddings, ``layers`` pre-norm blocks, tied output head."""

    def __init__(self, vocab_size: int = 256, d_model: int = 512, layers: int = 6, heads: int = 8,
                 ff_mult: int = 4, max_len: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"TransformerLM: d_model ({d_model}) must be divisible by heads ({heads})")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, ff_mult * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"TransformerLM: sequence length {t} exceeds max_len={self.max_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=x.dtype)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def _loss(self, batch) -> torch.Tensor:
        tokens = _tokens(batch, self.device)
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True)

    def configure_optimizers(self):
        opt = (torch.optim.AdamW(self.parameters(), lr=3e-4) if self.optimizer_factory is None
               else self.optimizer_factory(self))
        if self.scheduler_factory is None:
            return opt
        sched = self.scheduler_factory(opt, total_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
