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


def elastic_exchange_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``fault_tolerance="torchft"`` with several processes per replica group: first the dense average of the bucket
    over the group's own ranks (``state.flat_group.intra``, torch's process group), then :func:`exchange_hook` across
    the replica groups on torchft's process group of this local rank. Every rank of a group then holds the same
    averaged gradient, so the same residuals and the same result; the cross-group traffic is per local rank."""
    intra = state.flat_group.intra
    buf = bucket.buffer()
    buf.mul_(1.0 / dist.get_world_size(intra))  # before the sum, as torch's reducer
    dist.all_reduce(buf, group=intra)
    return exchange_hook(state, bucket)


__all__ += ["elastic_exchange_hook"]
