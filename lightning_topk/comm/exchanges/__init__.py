"""Exchanges: how a bucket's entries travel. One module per exchange, a registry
(:mod:`~lightning_topk.comm.exchanges.registry`), the contract (:mod:`~lightning_topk.comm.exchanges.base`)
and the shared toolkit (:mod:`~lightning_topk.comm.exchanges.kit`)."""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration.
from typing import Any

import torch
import torch.distributed as dist

from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.registry import available, build, check, get, names, register, unregister

__all__ = ["Exchange", "Layout", "available", "build", "check", "get", "names", "register", "unregister"]


def exchange_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that hands each bucket to ``state.exchange`` (built by the registry)."""
    state.note_bucket(bucket.buffer().numel())
    return state.exchange.hook(state, bucket)


__all__ += ["exchange_hook"]
