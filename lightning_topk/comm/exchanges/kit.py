"""The pieces every exchange is built from: k per bucket, error-feedback accumulation, selection, the
values sent, packing, the all-gather of packed entries, the rebuild of a dense sum, delivery into the
bucket buffer, futures and debug records.

Nothing here reads a tensor on the host: finiteness goes into device flags (``state.flags``), times into
CUDA events on CUDA, and with the sync-free selection (default on CUDA, ``LIGHTNING_TOPK_SYNC_FREE=1``
anywhere) only device work is queued.
"""
import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

import lightning_topk.comm.elastic as elastic
from lightning_topk.comm.faults import BucketBuffers, bounds_nonfinite, nonfinite
from lightning_topk.comm.selection import topk_select
from lightning_topk.comm.state import Scale, TopKState
from lightning_topk.comm.sync_free import sync_free_enabled, topk_select_sync_free
from lightning_topk.comm.telemetry import StepStats
from lightning_topk.comm.wire import (
    INT32,
    IndexCode,
    index_code,
    packed_nbytes,
    to_wire,
    unpack,
)
from lightning_topk.ops import cuda as cuda_ops

# torch's all-gather into one tensor (all_gather_single from torch 2.13), or an elastic group's
# (fault_tolerance="torchft": comm/elastic.py).
_all_gather = elastic.all_gather


def _link(state: TopKState, nbytes: int) -> Dict[str, int]:
    # A flat exchange over several nodes sends everything across nodes; on one node, nothing.
    return {"bytes_inter": nbytes} if state.num_nodes > 1 else {"bytes_intra": nbytes}


def bucket_k(state: TopKState, n: int) -> int:
    """Entries to send for a bucket of n elements now; 0 means 'send dense'."""
    density = state.density_now()
    if density >= 1.0 or n < state.config.min_sparse_numel:
        return 0
    k = max(1, math.ceil(density * n))
    # Sparse only pays when the packed buffer is smaller than the dense one.
    if packed_nbytes(k, state.config.wire_dtype, index_code(n, k)) >= 4 * n:
        return 0
    return k


def param_ks(state: TopKState, numels: Sequence[int]) -> List[int]:
    """``selection_scope="parameter"``: k per parameter (small parameters are sent whole)."""
    d = state.density_now()
    return [n if n < state.config.min_sparse_numel else max(1, math.ceil(d * n)) for n in numels]


class BucketView(NamedTuple):
    """What a hook reads off a DDP bucket: its flat buffer and size, its parameters and their names, the
    device, and the stats of this step."""

    grad: Tensor
    n: int
    params: List[Tensor]
    names: Tuple[str, ...]
    device: torch.device
    stats: StepStats


def open_bucket(state: TopKState, bucket: Any) -> BucketView:
    """The :class:`BucketView` of a ``dist.GradBucket``."""
    grad = bucket.buffer()
    params = bucket.parameters()
    return BucketView(grad, grad.numel(), params, state.names_of(params), grad.device, state.current)


def flat_group(state: TopKState) -> Tuple[Any, int]:
    """The flat exchange's process group (the world by default) and its size."""
    group = state.flat_group
    return group, elastic.group_size(group)


def sparse_k(state: TopKState, params: Sequence[Tensor], n: int) -> Tuple[int, Optional[List[int]], Optional[List[int]]]:
    """(k, per-parameter ks, parameter numels) of a bucket of ``n`` entries now: per parameter under
    ``selection_scope="parameter"`` (the last two None otherwise); k = 0 means "send dense"."""
    if state.config.selection_scope == "parameter" and state.density_now() < 1.0:
        numels = [p.numel() for p in params]
        ks = param_ks(state, numels)
        return sum(ks), ks, numels
    return bucket_k(state, n), None, None


def unused_spans(params: Sequence[Tensor], used: Optional[Sequence[bool]] = None) -> List[Tuple[int, int]]:
    """(offset, numel) in the bucket of each parameter without a gradient: one DDP marked unused in this
    backward (``find_unused_parameters=True``, ``static_graph``; Lightning's ``toggle_optimizer`` makes the
    other optimizers' parameters unused). DDP hands the exchange zeros for it and, when no rank used it,
    never writes the result into its ``.grad`` (None: the optimizer skips it), so an entry sent from its
    residual would be lost. Reads no tensor (the hook runs after DDP has set the used parameters' ``.grad``).
    ``used``: per parameter, whether a rank that shares this bucket's result used it (several processes per
    torchft replica group: the group's agreed mask, so that its ranks hold back the same spans)."""
    spans, off = [], 0
    for i, p in enumerate(params):
        n = p.numel()
        if (p.grad is None) if used is None else not used[i]:
            spans.append((off, n))
        off += n
    return spans


class Hold:
    """Spans of flat buffers that one exchange step leaves as they are (parameters unused in this backward, see
    :func:`unused_spans`). Made before the step changes them (copies of the spans, O(their entries)); after the
    accumulation :meth:`hide` zeroes them in the tensor selected from, so the selection passes them by (an entry
    picked anyway sends 0); :meth:`restore` puts the copies back once the entries are sent. Whether this rank
    or another used the parameter, nothing sent from its error feedback is lost, and the ranks need not agree:
    the shapes of the exchange do not change."""

    def __init__(self, spans: Sequence[Tuple[int, int]], *buffers: Optional[Tensor]) -> None:
        self.spans = list(spans)
        self._copies = [(t, [t[o:o + n].clone() for o, n in self.spans]) for t in buffers if t is not None]

    def hide(self, acc: Tensor) -> None:
        for o, n in self.spans:
            acc[o:o + n].zero_()

    def restore(self) -> None:
        for t, copies in self._copies:
            for (o, n), c in zip(self.spans, copies):
                t[o:o + n].copy_(c)


def hold_unused(params: Sequence[Tensor], b: Optional[BucketBuffers],
                used: Optional[Sequence[bool]] = None) -> Optional[Hold]:
    """A :class:`Hold` of the residual (and velocity) spans of the bucket's unused parameters (``used``: see
    :func:`unused_spans`); None where there is no residual or every parameter has a gradient (the usual step: no
    tensor work)."""
    if b is None:
        return None
    spans = unused_spans(params, used)
    return Hold(spans, b.residual, b.velocity) if spans else None


def clip_spans(spans: Sequence[Tuple[int, int]], lo: int, size: int) -> List[Tuple[int, int]]:
    """``spans`` of a bucket as spans of its slice ``[lo, lo + size)`` (a hierarchical shard)."""
    out = []
    for o, n in spans:
        a, e = max(o, lo), min(o + n, lo + size)
        if a < e:
            out.append((a - lo, e - a))
    return out


def take_bucket(state: TopKState, params: Sequence[Tensor], names: Tuple[str, ...], grad: Tensor,
                lookahead: bool = True) -> Tuple[Optional[BucketBuffers], Tensor, Optional[Tensor], Optional[Hold]]:
    """A sparse exchange's first steps on a bucket: the debug record of the local gradient, its residual
    buffers (with error feedback), ``acc = residual + grad/scale`` cut to the bucket, and the input check.
    ``lookahead``: a sparse step, so ``momentum_lookahead`` applies (see :func:`accumulate`). The spans of
    parameters unused in this backward are hidden in ``acc``: call the returned :class:`Hold`'s ``restore``
    once the entries are sent. Returns (buffers, acc, velocity, hold or None)."""
    if state.debug.enabled:
        record_grads(state, names, [p.numel() for p in params], grad)
    b = state.buffers(params, grad.device) if state.config.error_feedback else None
    hold = hold_unused(params, b, state.bucket_used)
    acc, vel, bad = accumulate_checked(state, b, grad, lookahead)
    acc = acc[:grad.numel()]
    state.flags.note_input(names, acc, bad=bad)
    if hold is not None:
        hold.hide(acc)
    return b, acc, vel, hold


def factor(scale: Scale, world: int) -> Scale:
    """Turns a sum of unscaled values over ``world`` ranks into the scaled average DDP expects."""
    return scale / world


def _add_scaled_(dst: Tensor, grad: Tensor, scale: Scale) -> None:
    """``dst += grad / scale`` in place (the scale may be a device tensor: no host read)."""
    if isinstance(scale, Tensor):
        dst.addcdiv_(grad, scale)
    elif scale == 1.0:
        dst.add_(grad)
    else:
        dst.add_(grad, alpha=1.0 / scale)


def accumulate(state: TopKState, b: Optional[BucketBuffers], grad: Tensor,
               lookahead: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """``residual += grad/scale`` in place (momentum correction: ``velocity = m*velocity + grad/scale``,
    ``residual += velocity``); returns (the residual buffer, whole with any padding; the velocity).

    With ``lookahead`` (a sparse step) and ``momentum_lookahead`` c > 0 the residual gets
    ``u = velocity + c*(velocity - old velocity)`` instead: it holds the entries' unsent momentum plus a lead of
    c times their velocity, so that a sent entry carries its next c steps of momentum now, and zeroing the
    residual where it sent leaves the debt (``-c*velocity``) that the next steps repay. One more pass over
    the bucket. Dense steps (``dense_hook``) call this without ``lookahead``: heavy-ball momentum.

    Without error feedback there is no residual: the bucket buffer itself is unscaled in place (it is
    overwritten by the result anyway). The undo log copies the buffers first when the step may be skipped.
    """
    scale = state.grad_scale
    if b is None:
        acc = grad if grad.dtype == torch.float32 else grad.float()
        if isinstance(scale, Tensor):
            acc.div_(scale)
        elif scale != 1.0:
            acc.mul_(1.0 / scale)
        return acc, None
    state.undo.save(b)
    n = grad.numel()
    vel = None if b.velocity is None else b.velocity[:n]
    _accumulate_into(state, b.residual[:n], vel, grad, lookahead)
    return b.residual, vel


def _accumulate_into(state: TopKState, res: Tensor, vel: Optional[Tensor], grad: Tensor, lookahead: bool) -> None:
    """:func:`accumulate`'s arithmetic on aligned slices of the residual, velocity and gradient."""
    scale = state.grad_scale
    if vel is not None:
        c = state.config.momentum_lookahead if lookahead else 0.0
        if c:
            res.add_(vel, alpha=-c)  # the lead of the last sparse step, c * old velocity
        vel.mul_(state.config.momentum)
        _add_scaled_(vel, grad, scale)
        res.add_(vel, alpha=1.0 + c)
        return
    _add_scaled_(res, grad, scale)


_CPU_CHUNK = 1 << 16   # entries per chunk of the CPU accumulate: its residual, velocity and gradient stay in L2


def accumulate_checked(state: TopKState, b: Optional[BucketBuffers], grad: Tensor,
                       lookahead: bool = False) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """:func:`accumulate` and the non-finite flag of the accumulator's first ``grad.numel()`` entries
    (:func:`~lightning_topk.comm.state.nonfinite`). On CPU, with error feedback, both run chunk by chunk,
    so each entry's residual, velocity and gradient are read from memory once instead of once per op (the
    same ops on the same values: bit-identical to the whole-bucket ops). Returns (acc, velocity, flag)."""
    n = grad.numel()
    if b is None or grad.device.type != "cpu" or n <= _CPU_CHUNK:
        acc, vel = accumulate(state, b, grad, lookahead)
        return acc, vel, nonfinite(acc[:n])
    state.undo.save(b)
    vel = None if b.velocity is None else b.velocity[:n]
    bounds: List[Tensor] = []
    for s in range(0, n, _CPU_CHUNK):
        e = min(n, s + _CPU_CHUNK)
        _accumulate_into(state, b.residual[s:e], None if vel is None else vel[s:e], grad[s:e], lookahead)
        bounds.extend(torch.aminmax(b.residual[s:e]))
    return b.residual, vel, bounds_nonfinite(bounds)


def select(state: TopKState, acc: Tensor, k: int, ks: Optional[Sequence[int]] = None,
           numels: Optional[Sequence[int]] = None, hint_key: Optional[Tuple[str, ...]] = None) -> Tensor:
    """Indices (int64) of the entries of ``acc`` to send: k of the bucket, or ``ks[i]`` of each parameter's
    slice (``selection_scope="parameter"``: independent of how DDP groups parameters into buckets, so a
    resumed run, whose first iteration uses DDP's pre-rebuild buckets, selects what an uninterrupted one
    does). Sync-free selection where :func:`sync_free_enabled` says so, else the CPU fast path.

    ``hint_key`` (a name for what ``acc`` holds, e.g. the bucket's parameter names): the CPU path's
    ``"exact"`` selector reuses the threshold of the last selection under this key (a
    :class:`~lightning_topk.comm.selection.ThresholdHint`: speed only, the indices are the same without
    it). The sync-free path takes no hint: checking one reads a count back to the host."""
    method = state.config.selector
    sync_free = sync_free_enabled(acc.device)

    def pick(x: Tensor, kx: int, *part: str) -> Tensor:
        if sync_free:
            return topk_select_sync_free(x, kx, method)[1]
        hint = state.threshold_hint(hint_key + part) if hint_key is not None and method == "exact" else None
        return topk_select(x, kx, method, hint)[1]

    if ks is None or numels is None:
        return pick(acc, k)
    offsets = itertools.accumulate(numels, initial=0)
    return torch.cat([pick(acc[off:off + n], kp, f"#{i}") + off
                      for i, (off, n, kp) in enumerate(zip(offsets, numels, ks))])


def send_values(state: TopKState, acc: Tensor, idx: Tensor, vel: Optional[Tensor]) -> Tensor:
    """Wire values of the selected entries; with error feedback ``acc`` (the residual) keeps what was not
    sent: 0 at the sent entries for fp32 wire, else the rounding error and any clipped part, so that
    ``sent + new residual = old residual + grad/scale`` up to fp32 rounding. With momentum correction the
    velocity is zeroed at the sent entries (``momentum_masking``) or kept (with ``momentum_lookahead``, the
    residual's lead on a sent entry is then repaid by the next steps: see :func:`accumulate`)."""
    values = acc.index_select(0, idx)
    wire = to_wire(values, state.config.wire_dtype)
    if state.config.error_feedback:
        if wire.dtype == torch.float32:
            acc.index_fill_(0, idx, 0.0)
        else:
            acc.index_copy_(0, idx, values - wire.float())
        if vel is not None and state.config.momentum_masking:
            vel.index_fill_(0, idx, 0.0)  # momentum factor masking
    return wire


def rebuild(out: Tensor, values: Tensor, indices: Tensor, zeroed: bool = False) -> Tensor:
    """``out`` (fp32) := dense sum of gathered sparse entries; duplicates add (``index_add_``, never
    ``scatter_``). ``zeroed``: ``out`` is already zero (:func:`zeroed_result`)."""
    if not zeroed:
        out.zero_()
    if out.is_cuda and indices.dtype == torch.int32:
        if cuda_ops.cupy_available():
            cuda_ops.scatter_add_dense(out, values, indices, 1.0)
            return out
    return out.index_add_(0, indices, values)


def fp32_view(grad: Tensor) -> Tensor:
    """Where to build a bucket's fp32 result: the bucket buffer itself when it is fp32 (no extra memory),
    else a transient fp32 buffer copied back by :func:`deliver`."""
    return grad if grad.dtype == torch.float32 else torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)


def zeroed_result(grad: Tensor) -> Tensor:
    """The bucket's fp32 result buffer (:func:`fp32_view`), zeroed now. A sparse exchange calls it once the
    bucket's gradient is spent (accumulated and packed) and its packets are on the link, so that what follows
    the last bucket's collective (:func:`deliver_sum`) only adds the gathered entries."""
    return fp32_view(grad).zero_()


def deliver_sum(state: TopKState, grad: Tensor, out: Tensor, values: Tensor, indices: Tensor) -> Tensor:
    """:func:`rebuild` the gathered entries into ``out`` (from :func:`zeroed_result`) and :func:`deliver` it,
    checking only the entries it touched."""
    return deliver(state, grad, rebuild(out, values, indices, zeroed=True), touched=indices)


def deliver(state: TopKState, grad: Tensor, result: Tensor, touched: Optional[Tensor] = None) -> Tensor:
    """Put the bucket's result into its buffer (DDP's own allreduce hook returns that buffer too) and flag
    non-finite values in the whole result.

    ``touched``: the only entries of ``result`` that :func:`rebuild` did not leave at zero (its indices).
    When the result is the buffer itself (no cast that could overflow), only they are checked: O(world * k)
    instead of a pass over the bucket, on the critical path after the last bucket's exchange."""
    if result.data_ptr() != grad.data_ptr():
        grad.copy_(result[:grad.numel()])
        touched = None
    state.flags.note_result(grad if touched is None else grad.index_select(0, touched))
    return grad


def future_on(device: torch.device) -> torch.futures.Future:
    """A hand-made future that carries its device, so that DDP waits on the right CUDA stream."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


@dataclass
class Gather:
    """An all-gather of packed entries in flight: ``count`` entries from each of ``world`` ranks land in
    ``buf`` (on gloo the future's value is not the gathered tensor: read ``buf``)."""

    work: Any
    buf: Tensor
    count: int
    world: int
    wire_dtype: torch.dtype
    code: IndexCode = INT32

    def entries(self) -> Tuple[Tensor, Tensor]:
        """(fp32 values, indices) of every rank, once the all-gather has arrived."""
        return unpack(self.buf, self.count, self.wire_dtype, self.world, self.code)


def gather_entries(packed: Tensor, count: int, world: int, group: Any, wire_dtype: torch.dtype,
                   code: IndexCode = INT32) -> Gather:
    """Launch the all-gather of ``packed`` (``count`` entries) over ``group``."""
    out = torch.empty(world * packed.numel(), dtype=torch.uint8, device=packed.device)
    return Gather(_all_gather(out, packed, group=group, async_op=True), out, count, world, wire_dtype, code)


def record_grads(state: TopKState, names: Sequence[str], numels: Sequence[int], grad: Tensor) -> None:
    """Debug aid: the unscaled local gradient per parameter (before the buffer is changed)."""
    g = grad.float() / state.grad_scale
    off = 0
    for name, n in zip(names, numels):
        state.debug.grads_in[name] = g[off:off + n].clone()
        off += n


def record_sent(state: TopKState, names: Sequence[str], numels: Sequence[int], dense_sent: Tensor) -> None:
    """Debug aid: what this rank sent, per parameter (unscaled)."""
    off = 0
    for name, n in zip(names, numels):
        state.debug.sent[name] = dense_sent[off:off + n].clone()
        off += n
