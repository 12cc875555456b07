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
    averaged gradient, so the same residuals and the same result; the cross-group traffic is per local rank.

    A parameter one rank of the group used and another did not (``find_unused_parameters``) has a ``.grad`` on the
    first only while the hook runs; DDP gives it the group's average on every rank afterwards. So the group agrees on
    which parameters were used (a max over the group of one flag per parameter, beside the bucket's all-reduce, as
    DDP reduces its own unused map) and every rank holds back the same spans (``state.bucket_used``)."""
    intra = state.flat_group.intra
    buf = bucket.buffer()
    params = bucket.parameters()
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=buf.device)
    agree = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=intra, async_op=True)
    buf.mul_(1.0 / dist.get_world_size(intra))  # before the sum, as torch's reducer
    dist.all_reduce(buf, group=intra)
    agree.wait()
    state.bucket_used = [bool(u) for u in used.tolist()]
    try:
        return exchange_hook(state, bucket)
    finally:
        state.bucket_used = None


__all__ += ["elastic_exchange_hook"]
