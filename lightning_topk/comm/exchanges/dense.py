"""Dense all-reduce transports: ``exchange="dense"`` (all-reduce in ``value_dtype``) and the two that
``auto`` chooses between, dense fp32 and dense bf16. Every exchange sends its dense steps (``dense_steps``,
buckets below ``min_sparse_numel``) through :func:`dense_hook`.
"""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration
# and rejects a string "dist.GradBucket".
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

import lightning_topk.comm.elastic as elastic
from lightning_topk.comm.cost import BOOKKEEPING_PASSES
from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.kit import (
    _link,
    accumulate,
    deliver,
    factor,
    flat_group,
    fp32_view,
    hold_unused,
    open_bucket,
    record_grads,
    record_sent,
)
from lightning_topk.comm.exchanges.registry import register
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.telemetry import clock
from lightning_topk.comm.wire import ring_allreduce_wire, to_wire


def dense_hook(state: TopKState, bucket: dist.GradBucket, wire_dtype: torch.dtype = torch.float32,
               via: Optional[str] = None):
    """Dense all-reduce of ``grad/scale`` in ``wire_dtype``, each rank's values divided by the world size before
    the all-reduce (as torch's reducer: bit for bit DDP in fp32 at any world size; before the cast in low precision;
    an FSDP shard's sum is divided after it, as torch's HSDP on gloo). Where these parameters hold a residual (they travelled sparse before), it is
    added and sent too, and with fp16/bf16 the cast error stays in it (error feedback); with momentum
    correction the velocity is updated, sent and kept; otherwise no buffer is made and the cost is a
    cast and a copy, as DDP's own compression hooks. Parameters unused in this backward keep their residual
    and velocity (:func:`~lightning_topk.comm.exchanges.kit.hold_unused`). The bucket counts under the
    exchange ``via`` (default: ``"dense"``, or ``"dense_bf16"`` for a low-precision wire)."""
    group, world = flat_group(state)
    grad, n, params, names, device, stats = open_bucket(state, bucket)
    if state.debug.enabled:
        record_grads(state, names, [p.numel() for p in params], grad)
    # Momentum correction keeps a velocity for every bucket (the optimizer has no momentum of its own).
    mc = state.config.momentum_correction
    b = state.buffers(params, device) if state.config.error_feedback and (mc or state.holds_state(params)) else None
    hold = hold_unused(params, b, state.bucket_used)  # parameters unused in this backward keep their residual and velocity
    acc, _ = accumulate(state, b, grad)
    acc = acc[:n]
    if hold is not None:
        hold.hide(acc)
    low = wire_dtype != torch.float32
    if low and b is None:
        wire = to_wire(acc.div_(world), wire_dtype)  # acc is the bucket buffer: the result overwrites it
    elif low:
        wire = to_wire(acc / world, wire_dtype)
        acc.sub_(wire.float(), alpha=world)  # the residual keeps the cast error
    # The input check reads the low-precision wire where there is one (half the bytes; the cast keeps
    # NaN/inf, and to_wire clamps finite values, so a non-finite wire value is a non-finite input).
    state.flags.note_input(names, wire if low else acc)
    if not low:
        wire = fp32_view(grad)
        if wire.data_ptr() != acc.data_ptr():
            wire.copy_(acc)
        if b is not None:
            acc.zero_()  # everything is sent
    if hold is not None:
        hold.restore()
    # A dense step sends the whole velocity and keeps it (no masking): heavy-ball momentum, as the
    # optimizer's would be. A sparse step masks what it sent (kit.send_values).
    if state.debug.enabled:
        record_sent(state, names, [p.numel() for p in params], wire.float() * world if low else wire)
    eb = wire.element_size()
    state.add_stats(stats, via or ("dense_bf16" if low else "dense"), buckets=1, numel=n,
                    bytes_dense=n * grad.element_size(), numel_sent=n, bytes_sent=n * eb, **_link(state, n * eb),
                    bytes_wire=ring_allreduce_wire(n * eb, world), bytes_dense_wire=ring_allreduce_wire(4 * n, world))
    # As torch's reducer (no comm hook): each rank's values times 1/world before the all-reduce of the sum
    # (``at::mul_out(bucket, grad, 1/world)``); dividing the sum after it differs for worlds not a power of 2.
    # An FSDP shard (``average_after``) is summed, then divided, as torch's HSDP on gloo (ReduceOp.AVG).
    after = not low and getattr(bucket, "average_after", False)
    if not low and not after and world > 1:
        wire.mul_(1.0 / world)
    f = factor(state.grad_scale, 1)
    t_launch = clock(device)
    fut = elastic.all_reduce(wire, group, async_op=True).get_future()

    def finish(done: torch.futures.Future) -> torch.Tensor:
        done.wait()  # a failed all-reduce raises its own error, before `wire` is read
        state.add_time(stats, "comm_time_s", t_launch)
        if low:
            state.flags.note_result(wire)  # half the bytes of the widened result; widening keeps NaN/inf
            grad.copy_(wire)
            if isinstance(f, torch.Tensor) or f != 1.0:
                grad.mul_(f)
            return grad
        if after and world > 1:
            wire.div_(world)  # the sum divided by the replicas, as gloo's ReduceOp.AVG
        return deliver(state, grad, wire if not isinstance(f, torch.Tensor) and f == 1.0 else wire.mul_(f))

    if bucket.is_last():
        state.end_exchange()
    return fut.then(finish)




def dense_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for ``exchange="dense"``: every bucket all-reduced in ``value_dtype``, or in fp32 while the
    density is 1 (density 1 is DDP: see :class:`~lightning_topk.comm.config.TopKConfig`)."""
    dtype = torch.float32 if state.density_now() >= 1.0 else state.config.wire_dtype
    return dense_hook(state, bucket, dtype)


@register("dense")
class DenseExchange(Exchange):
    """Ring all-reduce of ``residual + grad/scale`` (see :func:`dense_hook`). Pinned (``exchange="dense"``)
    it sends ``value_dtype``; as ``auto``'s choice, fp32."""

    sparse = False
    dtype: Optional[torch.dtype] = None

    def __init__(self, state: Any, layout: Optional[Layout] = None, dtype: Optional[torch.dtype] = None,
                 **kwargs: Any) -> None:
        super().__init__(state, layout)
        if dtype is not None:
            self.dtype = dtype

    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.dtype is None:  # pinned: value_dtype's wire (fp32 at density 1), counted as dense or dense_bf16
            return dense_topk_hook(state, bucket)
        return dense_hook(state, bucket, self.dtype, via=self.name)

    @classmethod
    def predict(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        return BOOKKEEPING_PASSES * model.pass_per_elem * n, model.flat().allreduce(4 * n, model.world)

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        return ring_allreduce_wire(4 * n, model.world)


@register("dense_bf16")
class DenseBf16Exchange(DenseExchange):
    """Ring all-reduce in bf16 (values divided by the world size before the cast; the cast error stays in
    the residual where the parameters hold one). Half the bytes of fp32."""

    dtype = torch.bfloat16

    @classmethod
    def predict(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        comp, comm = DenseExchange.predict(model, n, k, value_bytes)
        # + the casts and the cast error into the residual; the link time scaled by the measured ratio
        return comp + 3 * model.pass_per_elem * n, model.bf16_factor * comm

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        return ring_allreduce_wire(2 * n, model.world)
