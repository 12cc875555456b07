"""Flat top-k exchange as a DDP communication hook: error feedback, top-k, one allgather per bucket.

Usage without Lightning::

    state = TopKState(TopKConfig(density=0.01))
    state.bind(model.named_parameters())
    ddp_model.register_comm_hook(state, topk_allgather_hook)

Per bucket: ``acc = residual + grad / scale``; pick k = ceil(density * n) entries of ``acc``; the
residual keeps everything not sent (including the rounding error of fp16/bf16 wire values); values
and int32 indices are packed into one fixed-size buffer and all-gathered; every rank rebuilds the
average with ``index_add_`` (entries picked by several ranks add up) and returns it in the scaled
units the optimizer/GradScaler expect.
"""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration
# and rejects a string "dist.GradBucket".
import math
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.selection import topk_select
from lightning_topk.comm.state import StepStats, TopKState, _BucketBuffers
from lightning_topk.comm.wire import pack, packed_nbytes, ring_allgather_wire, ring_allreduce_wire, unpack

# torch >= 2.13 renames all_gather_into_tensor (deprecated) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _link(state: TopKState, nbytes: int) -> dict:
    # A flat exchange over several nodes sends everything across nodes; on one node, nothing.
    return {"bytes_inter": nbytes} if state.num_nodes > 1 else {"bytes_intra": nbytes}


def bucket_k(state: TopKState, n: int) -> int:
    """Entries to send for a bucket of n elements now; 0 means 'send dense'."""
    density = state.density_now()
    if density >= 1.0 or n < state.config.min_sparse_numel:
        return 0
    k = max(1, math.ceil(density * n))
    # Sparse only pays when the packed buffer is smaller than the dense one.
    if packed_nbytes(k, state.config.wire_dtype) >= 4 * n:
        return 0
    return k


def accumulate(state: TopKState, b: Optional[_BucketBuffers], grad: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """fp32 ``acc = residual + grad/scale`` (DGC momentum correction: ``+ m*u + grad/scale``).

    Returns (acc, new_velocity). Nothing in the state is modified yet: a non-finite bucket must leave
    the residual as it was.
    """
    inv = 1.0 / state.grad_scale
    if b is None:
        acc = grad.float() if grad.dtype != torch.float32 else grad.clone()
        return (acc.mul_(inv) if inv != 1.0 else acc), None
    acc = b.scratch("work")
    if b.velocity is not None:
        vel = b.velocity.mul(state.config.momentum).add_(grad, alpha=inv)
        return torch.add(b.residual, vel, out=acc), vel
    return torch.add(b.residual, grad, alpha=inv, out=acc), None


def param_ks(state: TopKState, numels: Sequence[int]) -> List[int]:
    """``selection_scope="parameter"``: k per parameter (small parameters are sent whole)."""
    d = state.density_now()
    return [n if n < state.config.min_sparse_numel else max(1, math.ceil(d * n)) for n in numels]


def select_per_param(acc: Tensor, numels: Sequence[int], ks: Sequence[int], selector: str) -> Tensor:
    """Top-k of each parameter's slice, as indices into the bucket. Independent of how DDP groups
    parameters into buckets, so a resumed run (whose first iteration uses DDP's pre-rebuild buckets)
    selects exactly what an uninterrupted run does."""
    out, off = [], 0
    for n, k in zip(numels, ks):
        _, i = topk_select(acc[off:off + n], k, selector)
        out.append(i + off)
        off += n
    return torch.cat(out)


def select_and_feedback(
    state: TopKState, b: Optional[_BucketBuffers], acc: Tensor, k: int, vel: Optional[Tensor],
    stats: StepStats, offset: int = 0, ks: Optional[Sequence[int]] = None, numels: Optional[Sequence[int]] = None,
) -> Tuple[Tensor, Tensor, bool]:
    """Select k entries of ``acc`` and update the residual slice ``[offset, offset+len(acc))``.

    With ``ks``/``numels`` the selection is per parameter (``selection_scope="parameter"``).
    Returns (wire values, int32 indices into acc, finite). The residual is left untouched when the
    selected values are not finite (an inf/NaN always ranks first, so it is always selected).
    """
    t0 = time.perf_counter()
    if ks is not None:
        idx = select_per_param(acc, numels, ks, state.config.selector)
    else:
        _, idx = topk_select(acc, k, state.config.selector)
    values = acc.index_select(0, idx)
    wire = values.to(state.config.wire_dtype)
    finite = bool(torch.isfinite(values).all())
    if b is not None and finite:
        state.before_update(b)
        # acc becomes the new residual: mark what was sent, then swap buffers (no copy).
        if wire.dtype == torch.float32:
            acc.index_fill_(0, idx, 0.0)
        else:
            acc.index_copy_(0, idx, values - wire.float())
        if acc is b.work:
            b.residual, b.work = acc, b.residual
        else:
            b.residual[offset:offset + acc.numel()].copy_(acc)
        if vel is not None:
            vel.index_fill_(0, idx, 0.0)  # momentum factor masking
            b.velocity[offset:offset + acc.numel()].copy_(vel)
    stats.select_time_s += time.perf_counter() - t0
    return wire, idx.to(torch.int32), finite


def dense_feedback(state: TopKState, b: Optional[_BucketBuffers], acc: Tensor, vel: Optional[Tensor],
                   offset: int = 0) -> bool:
    """Dense step: everything in acc is sent, so the residual (slice) becomes zero."""
    finite = bool(torch.isfinite(acc).all())
    if b is not None and finite:
        state.before_update(b)
        b.residual[offset:offset + acc.numel()].zero_()
        if vel is not None:
            b.velocity[offset:offset + acc.numel()].zero_()
    return finite


def record_nonfinite(state: TopKState, bucket, stats: StepStats) -> None:
    stats.nonfinite_buckets += 1
    for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
        if not bool(torch.isfinite(g).all()):
            state.nonfinite_params.append(state.name_of(p, i))


def record_sent(state: TopKState, bucket, dense_sent: Tensor) -> None:
    """Debug/test aid: keep what this rank sent and the gradient it got, per parameter (unscaled)."""
    grad = bucket.buffer().float() / state.grad_scale
    off = 0
    for i, p in enumerate(bucket.parameters()):
        n = p.numel()
        name = state.name_of(p, i)
        state.sent[name] = dense_sent[off:off + n].clone()
        state.grads_in[name] = grad[off:off + n].clone()
        off += n


def rebuild(n: int, values: Tensor, indices: Tensor, device: torch.device, out: Optional[Tensor] = None) -> Tensor:
    """Dense fp32 sum of gathered sparse entries; duplicates add (``index_add_``, never ``scatter_``)."""
    out = torch.zeros(n, dtype=torch.float32, device=device) if out is None else out.zero_()
    if out.is_cuda:
        from lightning_topk.comm import cuda_ops

        if cuda_ops.cupy_available():
            cuda_ops.scatter_add_dense(out, values, indices.to(torch.int32), 1.0)
            return out
    return out.index_add_(0, indices, values)


def topk_allgather_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: top-k sparse allgather with error feedback (see module docstring)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    grad = bucket.buffer()
    n = grad.numel()
    stats = state.current
    scale = state.grad_scale
    b = state.buffers(bucket.parameters(), grad.device) if state.config.error_feedback else None
    acc, vel = accumulate(state, b, grad)
    ks = numels = None
    if state.config.selection_scope == "parameter" and state.density_now() < 1.0:
        numels = [p.numel() for p in bucket.parameters()]
        ks = param_ks(state, numels)
        k = sum(ks)
    else:
        k = bucket_k(state, n)
    elem = grad.element_size()
    state.add_stats(stats, buckets=1, numel=n, bytes_dense=n * elem, bytes_dense_wire=ring_allreduce_wire(4 * n, world))
    t_launch = time.perf_counter()

    if k == 0:
        finite = dense_feedback(state, b, acc, vel)
        if not finite:
            record_nonfinite(state, bucket, stats)
        if state.record_sent:
            record_sent(state, bucket, acc)
        state.add_stats(stats, dense_buckets=1, numel_sent=n, bytes_sent=n * 4, **_link(state, n * 4),
                        bytes_wire=ring_allreduce_wire(4 * n, world))
        fut = dist.all_reduce(acc, group=group, async_op=True).get_future()

        def finish_dense(_f) -> Tensor:
            stats.comm_time_s += time.perf_counter() - t_launch
            if not bool(torch.isfinite(acc).all()):
                state.nonfinite_seen = True
            return acc.mul_(scale / world).to(grad.dtype)

        if bucket.is_last():
            state.end_exchange()
        return fut.then(finish_dense)

    wire, idx, finite = select_and_feedback(state, b, acc, k, vel, stats, ks=ks, numels=numels)
    if not finite:
        record_nonfinite(state, bucket, stats)
    if state.record_sent:
        sent = torch.zeros(n, dtype=torch.float32, device=grad.device)
        sent.index_copy_(0, idx.long(), wire.float())
        record_sent(state, bucket, sent)
    packed = pack(wire, idx)
    out = torch.empty(world * packed.numel(), dtype=torch.uint8, device=grad.device)
    state.add_stats(stats, numel_sent=k, bytes_sent=packed.numel(), **_link(state, packed.numel()),
                    bytes_wire=ring_allgather_wire(packed.numel(), world), allgather_buckets=1)
    t_launch = time.perf_counter()
    fut = _all_gather(out, packed, group=group, async_op=True).get_future()
    wire_dtype = state.config.wire_dtype

    def finish(_f) -> Tensor:
        # On gloo the future's value is not the gathered tensor: read `out`.
        stats.comm_time_s += time.perf_counter() - t_launch
        values, indices = unpack(out, k, wire_dtype, world)
        if not bool(torch.isfinite(values).all()):  # k entries per rank: cheap, unlike a pass over the grads
            state.nonfinite_seen = True
        dense = rebuild(n, values, indices, grad.device, None if b is None else b.scratch("out"))
        return dense.mul_(scale / world).to(grad.dtype)

    if bucket.is_last():
        state.end_exchange()
    return fut.then(finish)
