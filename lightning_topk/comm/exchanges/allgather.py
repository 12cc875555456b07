"""Flat top-k exchange: error feedback, top-k, one all-gather per bucket (``exchange="allgather"``).

Usage without Lightning (the controller applies the ``nonfinite`` policy once per step)::

    state = TopKState(TopKConfig(density=0.01))
    state.bind(model.named_parameters())
    ddp_model.register_comm_hook(state, topk_allgather_hook)
    ctl = StepController(state)          # lightning_topk.comm.controller

Per bucket: ``residual += grad / scale`` in place; pick k = ceil(density * n) entries of it; zero what was
sent in the residual (for fp16/bf16 wire values it keeps their rounding error and any clipped part); pack
values and indices (16-bit block code, :mod:`..wire`) into one fixed-size buffer and all-gather it; every rank rebuilds the average
straight into the bucket's buffer with ``index_add_`` (entries picked by several ranks add up), in the
scaled units the optimizer/GradScaler expect. Parameters without a ``.grad`` (unused in this backward) keep
their residual out of the step (:class:`~lightning_topk.comm.exchanges.kit.Hold`): DDP would drop what they sent.

Nothing here reads a tensor on the host (see :mod:`lightning_topk.comm.exchanges.kit`). The callbacks do
only device work, so on NCCL (whose futures complete when the collective is enqueued) the backward pass
is not held up.
"""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration
# and rejects a string "dist.GradBucket".
from typing import Any, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.cost import BOOKKEEPING_PASSES
from lightning_topk.comm.exchanges import kit
from lightning_topk.comm.exchanges.base import Exchange
from lightning_topk.comm.exchanges.dense import dense_hook
from lightning_topk.comm.exchanges.registry import register
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.telemetry import clock
from lightning_topk.comm.wire import index_code, pack, ring_allgather_wire, ring_allreduce_wire, sparse_nbytes, unpack


def topk_allgather_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: top-k sparse allgather with error feedback (see module docstring)."""
    group, world = kit.flat_group(state)
    cfg = state.config
    grad, n, params, names, device, stats = kit.open_bucket(state, bucket)
    k, ks, numels = kit.sparse_k(state, params, n)
    if k == 0:  # a dense schedule step or a small bucket
        return dense_hook(state, bucket)
    state.add_stats(stats, buckets=1, numel=n, bytes_dense=n * grad.element_size(),
                    bytes_dense_wire=ring_allreduce_wire(4 * n, world))
    t0 = clock(device)
    _, acc, vel, hold = kit.take_bucket(state, params, names, grad)
    f = kit.factor(state.grad_scale, world)

    idx = kit.select(state, acc, k, ks, numels, hint_key=("bucket", *names))
    wire = kit.send_values(state, acc, idx, vel)
    if hold is not None:  # unused parameters: their residual (and velocity) as before the step
        hold.restore()
    if state.debug.enabled:
        sent = torch.zeros(n, dtype=torch.float32, device=device)
        sent.index_copy_(0, idx, wire.float())
        kit.record_sent(state, names, [p.numel() for p in params], sent)
    code = index_code(n, k)
    packed = pack(wire, idx, code, host_reads=not kit.sync_free_enabled(device))
    out = torch.empty(world * packed.numel(), dtype=torch.uint8, device=device)
    state.add_stats(stats, "allgather", numel_sent=k, bytes_sent=packed.numel(), **kit._link(state, packed.numel()),
                    bytes_wire=ring_allgather_wire(packed.numel(), world))
    state.add_time(stats, "select_time_s", t0)
    t_launch = clock(device)
    fut = kit._all_gather(out, packed, group=group, async_op=True).get_future()
    wire_dtype = cfg.wire_dtype
    result = kit.zeroed_result(grad)  # while the packets are on the link

    def finish(done: torch.futures.Future) -> Tensor:
        done.wait()  # a failed or timed-out all-gather raises its own error here, before `out` is read
        # On gloo the future's value is not the gathered tensor: read `out`.
        state.add_time(stats, "comm_time_s", t_launch)
        values, indices = unpack(out, k, wire_dtype, world, code)
        return kit.deliver_sum(state, grad, result, values.mul_(f), indices)

    if bucket.is_last():
        state.end_exchange()
    return fut.then(finish)


@register("allgather")
class AllgatherExchange(Exchange):
    """The flat top-k all-gather (see the module docstring); supports every option."""

    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return topk_allgather_hook(state, bucket)

    @classmethod
    def predict(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        P = model.world
        comp = model.select(n) + BOOKKEEPING_PASSES * model.pass_per_elem * n + model.add_per_entry * P * k
        return comp, model.flat().allgather(sparse_nbytes(n, k, value_bytes), P)

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        return (model.world - 1) * sparse_nbytes(n, k, value_bytes)
