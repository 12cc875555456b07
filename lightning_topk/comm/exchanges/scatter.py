"""Scale-free top-k exchange as a DDP communication hook: a sparse reduce-scatter (one all-to-all into
fixed-capacity slots) followed by a fixed-size all-gather.

A flat top-k all-gather makes every rank receive ``(P-1) k`` entries. Here, per bucket of ``n`` entries
on ``P`` ranks with ``k = ceil(density n)``:

1. ``acc = residual + grad/scale``; select the top k of acc (error feedback as in the flat exchange).
2. Coordinates are split into ``P`` regions of ``s = ceil(n/P)`` *permuted* positions: ``pi(i) = a i mod
   n`` with ``a`` about ``0.618 n`` and coprime with ``n`` (a golden-ratio stride). Neighbouring
   coordinates (a row, a bias) land in different regions, so each region gets about ``k/P`` of a rank's
   entries with no rebalancing round. Region ``r`` is owned by rank ``r``.
3. Each rank puts each region's entries, largest first, into a slot of ``c = k/P + 4 sqrt(k/P)``
   entries (a region's share of a rank's k entries is about binomial; see :class:`ScatterOptions`);
   what does not fit goes back into the sender's residual. One ``all_to_all_single`` moves the ``P``
   slots (values + int32 positions in the region): fixed shapes, no size exchange.
4. The owner adds what it received to its *owner residual* (region sums not forwarded yet) and sends
   its top ``c_out = k/P`` (``owner="select"``, the default; the rest stays in the owner residual), or
   everything (``owner="forward"``: ``c_out = min(s, P c)``, nothing kept, but ``O(P k)`` bytes).
5. One ``all_gather`` of ``c_out`` entries per rank; every rank rebuilds the sum with ``index_add_``
   and divides by ``P``. Like gTop-k and Ok-Topk, about k entries of the summed gradient are applied
   per step (a flat all-gather applies up to ``P k``); the rest waits in the residuals.

Wire bytes per rank: ``(P-1) c b + (P-1) c_out b``, about ``2 k b (P-1)/P (1 + 2/sqrt(k/P))`` with
the defaults: independent of ``P`` but for the slots' margin (``b`` = bytes per entry). Conservation is exact: what a rank selected is
either in a slot or back in its residual; what an owner received is either forwarded or in its owner
residual, which is updated in place (the undo log copies it first when the step may be skipped, so the
step controller's rollback covers it as it covers the rank residuals) and is saved with
:meth:`TopKState.state_dict`. Non-finite values reach the controller through the same device flags as
in the flat exchange (``state.flags``: the input, and the whole rebuilt result). An owner residual that no longer has its bucket (DDP rebuilt its
buckets, the world size or the exchange changed) is folded into this rank's per-parameter residual:
``M`` in the owner residual and ``M`` in a rank residual both reach the average as ``M/P``.

The sender's slot assignment, the owner step and the rebuild use fixed shapes and no host reads (with
the sync-free selection, the whole hook only queues device work).
Collectives are issued from the backward thread in bucket order: a bucket's all-to-all runs while
backward computes the next bucket, whose hook then finishes the previous one (owner step, all-gather).

The core runs on any flat fp32 tensor over any process group: :func:`scatter_send` (slots, what does not
fit back into the tensor), :func:`scatter_launch` (the all-to-all), :func:`scatter_forward` (owner step,
all-gather of the forwards), with owner residuals from :class:`OwnerResiduals`. The flat hook here
runs it on each bucket over the world; the hierarchical exchange
(:func:`~lightning_topk.comm.exchanges.hierarchical.hierarchical_scatter_topk_hook`) on each rank's node-summed
shard among the ranks with the same local rank.
"""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration.
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_topk.comm.elastic as elastic
from lightning_topk.comm.cost import BOOKKEEPING_PASSES
from lightning_topk.comm.exchanges.allgather import topk_allgather_hook
from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.kit import (
    Gather,
    _link,
    deliver_sum,
    factor,
    flat_group,
    future_on,
    gather_entries,
    open_bucket,
    record_sent,
    select,
    send_values,
    sparse_k,
    take_bucket,
    zeroed_result,
)
from lightning_topk.comm.exchanges.registry import register
from lightning_topk.comm.faults import owner_undo_key
from lightning_topk.comm.state import Scale, TopKState
from lightning_topk.comm.telemetry import StepStats, clock
from lightning_topk.comm.wire import (
    all_to_all_wire,
    pack,
    packed_nbytes,
    ring_allgather_wire,
    ring_allreduce_wire,
    to_wire,
    unpack,
)

OWNER_MODES = ("select", "forward")
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class ScatterOptions:
    """Slot size ``c = capacity k/P + margin sqrt(k/P)`` (a region's count of a rank's k entries is about
    binomial: ``margin`` standard deviations of room); owners forward ``out k/P`` entries (``owner=
    "select"``) or everything they received (``owner="forward"``)."""

    capacity: float = 1.0
    margin: float = 4.0
    out: float = 1.0
    owner: str = "select"

    def __post_init__(self) -> None:
        for name, lo in (("capacity", 1.0), ("margin", 0.0), ("out", 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
                raise ValueError(f"scatter exchange: {name} must be a number >= {lo}, got {v!r}")
        if self.owner not in OWNER_MODES:
            raise ValueError(f"scatter exchange: owner must be one of {list(OWNER_MODES)}, got {self.owner!r}")


@dataclass(frozen=True)
class SlotPlan:
    """Fixed shapes of one bucket's exchange: every field depends only on (n, k, P, options)."""

    n: int
    world: int
    k: int
    region: int  # s: permuted positions per region
    slot: int  # c: entries per (sender, owner) slot
    out: int  # c_out: entries each owner forwards
    mult: int  # a: pi(i) = a*i mod n
    inv: int  # a^-1 mod n


def _multiplier(n: int) -> int:
    if n <= 2:
        return 1
    a = max(1, round(_GOLDEN * n))
    while math.gcd(a, n) != 1:
        a += 1
    return a


def slot_plan(n: int, k: int, world: int, options: Optional[ScatterOptions] = None) -> SlotPlan:
    """Region size, slot capacity and forward count for a bucket of n entries, k selected, P ranks."""
    o = options or ScatterOptions()
    if n < 1 or world < 1 or not 1 <= k <= n:
        raise ValueError(f"scatter exchange: need n >= 1, world >= 1 and 1 <= k <= n, got n={n}, k={k}, world={world}")
    s = math.ceil(n / world)
    share = k / world
    c = min(s, k, max(1, math.ceil(o.capacity * share + o.margin * math.sqrt(share))))
    out = min(s, max(1, math.ceil(o.out * share))) if o.owner == "select" else min(s, world * c)
    a = _multiplier(n)
    return SlotPlan(n, world, k, s, c, out, a, pow(a, -1, n) if n > 1 else 0)


def regions(idx: Tensor, plan: SlotPlan) -> Tuple[Tensor, Tensor]:
    """(owner region, position in the region) of bucket indices."""
    p = idx.long() * plan.mult % plan.n
    r = torch.div(p, plan.region, rounding_mode="floor")
    return r, p - r * plan.region


def global_index(owner: int, pos: Tensor, plan: SlotPlan) -> Tensor:
    """Bucket index of position ``pos`` of region ``owner`` (positions past n map to some index; their
    value is always 0)."""
    return (pos.long() + owner * plan.region) * plan.inv % plan.n


def fill_slots(values: Tensor, idx: Tensor, plan: SlotPlan) -> Tuple[Tensor, Tensor, Tensor]:
    """Put selected entries into ``P`` slots of ``c`` (in the selection's order within a region).

    Returns (slot values ``[P, c]`` in the values' dtype, slot positions ``[P, c]`` int32, ``fits``: fp32
    ``[k]``, 1 where the entry got a slot and 0 where it must go back to the residual). Empty slot
    places hold (0, position 0): adding them changes nothing. Fixed shapes, no host reads. (Ordering
    by magnitude first would cost more than the rest of the exchange's bookkeeping, for the rare entries
    past a margin of 4 standard deviations.)
    """
    P, c, k = plan.world, plan.slot, idx.numel()
    region, pos = regions(idx, plan)
    rs, order = torch.sort(region.to(torch.int32), stable=True)
    rs = rs.long()
    counts = torch.zeros(P, dtype=torch.long, device=idx.device).index_add_(0, rs, torch.ones_like(rs))
    starts = torch.cumsum(counts, 0) - counts
    rank_in = torch.arange(k, device=idx.device) - starts.index_select(0, rs)
    fit = rank_in < c
    # Entries that do not fit go to distinct places past the slots (deterministic, then dropped).
    dest = torch.where(fit, rs * c + rank_in, P * c + torch.arange(k, device=idx.device))
    slot_v = values.new_zeros(P * c + k).index_copy_(0, dest, values.index_select(0, order))
    slot_p = torch.zeros(P * c + k, dtype=torch.int32, device=idx.device)
    slot_p.index_copy_(0, dest, pos.index_select(0, order).to(torch.int32))
    fits = torch.zeros(k, dtype=torch.float32, device=idx.device).index_copy_(0, order, fit.float())
    return slot_v[: P * c].view(P, c), slot_p[: P * c].view(P, c), fits


def owner_step(state: TopKState, received: Tensor, positions: Tensor, owner_residual: Optional[Tensor],
               plan: SlotPlan, key: Optional[str] = None, held: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Add what this owner received to its owner residual (in place), pick what it forwards, keep the rest.

    Returns (wire values ``[c_out]``, their positions in the region). Without an owner residual (no error
    feedback) the region is summed in a fresh buffer and the rest is dropped, as senders drop what they
    do not send. ``key``: the owner residual's key (names the selection's threshold hint). ``held``: bool
    mask of the region's positions that stay in the owner residual this step (parameters unused on this rank,
    :func:`~lightning_topk.comm.exchanges.kit.unused_spans`); picked anyway, they send 0.
    """
    region = torch.zeros(plan.region, dtype=torch.float32, device=received.device) if owner_residual is None \
        else owner_residual
    region.index_add_(0, positions.long(), received.float())
    kept = None
    if held is not None and owner_residual is not None:
        kept = torch.where(held, region, 0.0)
        region.masked_fill_(held, 0.0)
    q = select(state, region, plan.out, hint_key=None if key is None else ("owner", key))
    values = region.index_select(0, q)
    wire = to_wire(values, state.config.wire_dtype)
    region.index_copy_(0, q, values - wire.float())  # fp32: zero; fp16/bf16: the rounding error stays
    if kept is not None:
        region.add_(kept)  # held positions are 0 here: exactly what they held
    return wire, q


def held_positions(spans: Sequence[Tuple[int, int]], rank: int, plan: SlotPlan, device: torch.device) -> Tensor:
    """Bool mask of region ``rank``'s positions that fall in ``spans`` of the flat tensor (no host read)."""
    flat = torch.zeros(plan.n, dtype=torch.bool, device=device)
    for o, n in spans:
        flat[o:o + n] = True
    return flat.index_select(0, global_index(rank, torch.arange(plan.region, device=device), plan))


def bucket_key(world: int, rank: int, names: Sequence[str], numels: Sequence[int], shard: int = 0,
               shards: int = 1) -> str:
    """Owner residual key: world, rank, the shard of the bucket the exchange runs on (hierarchical: this
    rank's local rank of ``shards`` per node) and the bucket's parameters (enough to fold it back, see below)."""
    part = f"shard{shard}of{shards}/" if shards > 1 else ""
    return f"{world}/{rank}/{part}" + "|".join(f"{nm}={n}" for nm, n in zip(names, numels))


def _parse_key(key: str) -> Tuple[int, int, int, int, List[str], List[int]]:
    world, rank, rest = key.split("/", 2)
    shard, shards = 0, 1
    m = re.match(r"shard(\d+)of(\d+)/", rest)
    if m:
        shard, shards, rest = int(m.group(1)), int(m.group(2)), rest[m.end():]
    names, numels = [], []
    for part in rest.split("|"):
        nm, _, n = part.rpartition("=")
        names.append(nm)
        numels.append(int(n))
    return int(world), int(rank), shard, shards, names, numels


def fold_owner_residual(key: str, owner_residual: Tensor) -> Dict[str, Tensor]:
    """Per-parameter dense fp32 tensors holding an owner residual's entries at their bucket coordinates.

    Adding them to this rank's residuals keeps the pending update unchanged (``M`` there reaches the
    average as ``M/P``, exactly as when the owner forwards it; hierarchically, ``M`` in a rank residual
    enters its node's sum and reaches the average as ``M/(N L)``, as the owner's forward does)."""
    world, rank, shard, shards, names, numels = _parse_key(key)
    n = sum(numels)
    s = math.ceil(n / shards)  # the tensor the exchange ran on: the bucket, or its zero-padded shard
    # k only sizes the slots, which folding does not use
    plan = slot_plan(s, 1, world)
    valid = max(0, min(plan.region, s - rank * plan.region))
    dev = owner_residual.device  # stays there: no host copy inside a hook (DDP's rebuild folds during backward)
    dense = torch.zeros(s * shards, dtype=torch.float32, device=dev)
    pos = torch.arange(valid, device=dev)
    dense.index_add_(0, shard * s + global_index(rank, pos, plan), owner_residual[:valid].float())
    return dict(zip(names, dense[:n].split(numels)))


def _add_to_residuals(state: TopKState, per_param: Dict[str, Tensor]) -> None:
    """Add ``per_param`` to the live residuals (their buckets copied by the undo log first), else to the
    residuals pending from a checkpoint (the entries replaced are kept for a rollback)."""
    if not state.config.error_feedback:
        return
    pending = state._pending_load
    created = pending is None
    if pending is None:
        pending = {}
    replaced: Dict[Tuple[str, str], Optional[Tensor]] = {}
    for name, t in per_param.items():
        live = state._param_view(name, "residual")
        if live is not None:
            state.undo.save(state._buckets[state._owner[name]])  # (no-op if this step already saved it)
            live.add_(t.to(live.device))
        else:
            old = replaced[("residual", name)] = pending.get(("residual", name))
            pending[("residual", name)] = t if old is None else old.float() + t
    if pending and created:
        state._pending_load = pending
    if replaced:
        def undo() -> None:
            now = state._pending_load
            if now is None:
                return
            for k, old in replaced.items():
                if old is None:
                    now.pop(k, None)
                else:
                    now[k] = old
            if created and not now:
                state._pending_load = None

        state.undo.on_rollback(undo)


class OwnerResiduals:
    """This rank's owner residuals (region sums not forwarded yet), keyed by :func:`bucket_key`: ``live``
    ones, ``loaded`` ones from a checkpoint not claimed yet, and the keys ``seen`` by this step's buckets.
    Owned by one scale-free exchange (flat, or the hierarchical one's inter-node tier)."""

    def __init__(self) -> None:
        self.live: Dict[str, Tensor] = {}
        self.loaded: Dict[str, Tensor] = {}
        self.seen: set = set()

    def claim(self, key: str, region: int, device: torch.device) -> Tensor:
        """The owner residual for ``key`` (live, loaded from a checkpoint, or new), marked as used by this
        step (see :meth:`fold_unclaimed`)."""
        self.seen.add(key)
        t = self.live.get(key)
        if t is None:
            got = self.loaded.pop(key, None)
            t = torch.zeros(region, dtype=torch.float32, device=device) if got is None else \
                got.to(device, torch.float32, copy=True)
            self.live[key] = t
        return t

    def fold_unclaimed(self, state: TopKState) -> None:
        """Fold every owner residual not claimed by a bucket of this step into this rank's per-parameter
        residuals: ones loaded from a checkpoint, and live ones whose bucket is gone (DDP rebuilt its buckets
        after the first iteration). Called once the last bucket has been launched. A rollback of the step
        undoes the fold (the undo log)."""
        loaded, self.loaded = self.loaded, {}
        live = {k: self.live.pop(k) for k in [k for k in self.live if k not in self.seen]}
        self.seen = set()
        if loaded or live:
            def undo() -> None:
                self.loaded.update(loaded)
                self.live.update(live)

            state.undo.on_rollback(undo)
        for key, t in {**loaded, **live}.items():
            _add_to_residuals(state, fold_owner_residual(key, t))

    def fold(self, state: TopKState, key: str) -> None:
        """Fold a live owner residual into the residuals (its bucket now travels another way)."""
        t = self.live.pop(key, None)
        if t is not None:
            state.undo.on_rollback(lambda: self.live.__setitem__(key, t))
            _add_to_residuals(state, fold_owner_residual(key, t))

    def fold_names(self, state: TopKState, names: Sequence[str], numels: Sequence[int]) -> None:
        """Fold the live owner residuals of the bucket of exactly these parameters (its key ends with them,
        see :func:`bucket_key`; no parsing on the hook's path)."""
        if not self.live:
            return
        tail = "/" + "|".join(f"{nm}={n}" for nm, n in zip(names, numels))
        for key in [k for k in self.live if k.endswith(tail)]:
            self.fold(state, key)

    def state_dict(self) -> Dict[str, Any]:
        owner = {k: t.clone() for k, t in self.loaded.items()}
        owner.update({k: t.detach().cpu().clone() for k, t in self.live.items()})
        return {"owner_residual": owner} if owner else {}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        self.live.clear()
        self.seen = set()
        self.loaded = dict((sd or {}).get("owner_residual", {}))

    def undo_keys(self) -> List[str]:
        return [owner_undo_key(k) for k in self.live]


def fold_section(state: TopKState, sd: Dict[str, Any]) -> None:
    """A saved owner-residual section in a run without its exchange: fold it into the rank residuals now
    (part of the load, not of a step: a skipped step does not undo it)."""
    for key, t in dict(sd.get("owner_residual", {})).items():
        _add_to_residuals(state, fold_owner_residual(key, t))
    state.undo.clear()


def scatter_wire(plan: SlotPlan, value_bytes_per_entry: int) -> int:
    """Bytes one rank puts on the wire: the all-to-all of its slots and the ring all-gather of the forwards."""
    return all_to_all_wire(plan.slot * value_bytes_per_entry, plan.world) + \
        ring_allgather_wire(plan.out * value_bytes_per_entry, plan.world)


def scatter_send(state: TopKState, acc: Tensor, idx: Tensor, wire: Tensor, plan: SlotPlan) -> Tuple[Tensor, Tensor]:
    """Put the selected entries (``wire`` at ``idx`` of the flat fp32 ``acc``) into their owners' slots;
    with error feedback, what does not fit goes back into ``acc`` (it was not sent). Returns (packed slots
    for the all-to-all, ``fits``: 1 where an entry got a slot)."""
    slot_v, slot_p, fits = fill_slots(wire, idx, plan)
    if state.config.error_feedback:
        acc.index_add_(0, idx, wire.float() * (1.0 - fits))
    return pack(slot_v, slot_p), fits


@dataclass
class ScatterJob:
    """One flat tensor's exchange over ``group``, where this rank owns region ``rank``: its all-to-all in
    flight (``work`` into ``recv``), and the owner residual's key (None: no error feedback)."""

    plan: SlotPlan
    group: Any
    rank: int
    key: Optional[str]
    wire_dtype: torch.dtype
    work: Any
    recv: Tensor
    owners: Optional[OwnerResiduals] = None
    unused: Sequence[Tuple[int, int]] = ()  # spans of the flat tensor the owner step holds back


def scatter_launch(packed: Tensor, plan: SlotPlan, group: Any, rank: int, key: Optional[str],
                   wire_dtype: torch.dtype, owners: Optional[OwnerResiduals] = None,
                   unused: Sequence[Tuple[int, int]] = ()) -> ScatterJob:
    """Launch the all-to-all of the packed slots (stage 1); ``owners`` holds the owner residual ``key``;
    ``unused``: spans of the flat tensor (parameters unused on this rank) that the owner step holds back."""
    recv = torch.empty_like(packed)
    work = elastic.all_to_all(recv, packed, group=group, async_op=True)
    return ScatterJob(plan, group, rank, key, wire_dtype, work, recv, owners, list(unused))


def scatter_forward(state: TopKState, job: ScatterJob) -> Gather:
    """Stage 2, once the all-to-all has arrived (``job.work.wait()``): the owner step (the undo log copies
    the owner residual first) and the all-gather of the forwards, whose indices address the flat tensor."""
    plan = job.plan
    vals, pos = unpack(job.recv, plan.slot, job.wire_dtype, plan.world)
    ores = None
    if job.key is not None and job.owners is not None:
        ores = job.owners.live.get(job.key)
        if ores is not None:
            state.undo.save_tensor(owner_undo_key(job.key), ores)
    held = held_positions(job.unused, job.rank, plan, vals.device) if job.unused and ores is not None else None
    wire, q = owner_step(state, vals, pos, ores, plan, job.key, held)
    return gather_entries(pack(wire, global_index(job.rank, q, plan)), plan.out, plan.world, job.group,
                          job.wire_dtype)


@dataclass
class _Pending:
    result: torch.futures.Future
    job: ScatterJob
    grad: Tensor
    factor: Scale
    stats: StepStats
    t_launch: Any


def scatter_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: scale-free top-k exchange (see the module docstring); its own state is
    ``state.exchange_for("scatter")``."""
    ex: ScatterExchange = state.exchange_for("scatter")
    group, world = flat_group(state)
    rank = elastic.group_rank(group)
    grad, n, params, names, device, stats = open_bucket(state, bucket)
    cfg = state.config
    k, ks, numels = sparse_k(state, params, n)
    if k == 0 or world == 1:
        ex.flush(state)
        if bucket.is_last():
            ex.owners.fold_unclaimed(state)
        return topk_allgather_hook(state, bucket)  # dense (ring all-reduce) or nothing to spread
    plan = slot_plan(n, k, world, ex.options)
    state.add_stats(stats, "scatter", buckets=1, numel=n, bytes_dense=n * grad.element_size())
    t0 = clock(device)
    b, acc, _, hold = take_bucket(state, params, names, grad)
    idx = select(state, acc, k, ks, numels, hint_key=("bucket", *names))
    wire = send_values(state, acc, idx, None)
    packed, fits = scatter_send(state, acc, idx, wire, plan)
    if hold is not None:  # unused parameters: their residual as before the step, and the owner holds them too
        hold.restore()
    if state.debug.enabled:
        sent = torch.zeros(n, dtype=torch.float32, device=device)
        sent.index_copy_(0, idx, wire.float() * fits)
        record_sent(state, names, [p.numel() for p in params], sent)
    state.add_time(stats, "select_time_s", t0)
    eb = packed_nbytes(1, cfg.wire_dtype)
    payload = packed.numel() + plan.out * eb
    state.add_stats(stats, numel_sent=k, bytes_sent=payload, **_link(state, payload),
                    bytes_wire=scatter_wire(plan, eb), bytes_dense_wire=ring_allreduce_wire(4 * n, world))
    key = None
    if b is not None:
        key = bucket_key(world, rank, b.names, b.numels)
        ex.owners.claim(key, plan.region, device)
    ex.flush(state)
    result = future_on(device)
    t_launch = clock(device)
    job = scatter_launch(packed, plan, group, rank, key, cfg.wire_dtype, ex.owners, hold.spans if hold else ())
    ex.pending = _Pending(result, job, grad, factor(state.grad_scale, world), stats, t_launch)
    if bucket.is_last():
        ex.flush(state)
        ex.owners.fold_unclaimed(state)  # anything the buckets of this exchange did not claim
        state.end_exchange()
    return result


def flush_scatter(state: TopKState) -> None:
    """Finish the scale-free exchange's pending bucket (see :meth:`ScatterExchange.flush`)."""
    if "scatter" in state.exchanges:
        state.exchanges["scatter"].flush(state)


def _flush(state: TopKState, p: Optional["_Pending"]) -> None:
    """Finish a pending bucket: its owner step and all-gather (:func:`scatter_forward`); the bucket's
    future completes when the all-gather arrives. Only device work is queued."""
    if p is None:
        return
    p.job.work.wait()
    t0 = clock(p.grad.device)
    g = scatter_forward(state, p.job)
    state.add_time(p.stats, "select_time_s", t0)
    out = zeroed_result(p.grad)  # while the all-gather is on the link

    def done(fut: torch.futures.Future) -> None:
        try:
            fut.wait()  # a failed exchange raises its own error, before its buffers are read
            values, indices = g.entries()
            state.add_time(p.stats, "comm_time_s", p.t_launch)
            p.result.set_result(deliver_sum(state, p.grad, out, values.mul_(p.factor), indices))
        except Exception as e:  # surface comm errors to DDP rather than hanging
            p.result.set_exception(e)

    g.work.get_future().then(done)


class OwnerResidualsMixin:
    """The :class:`~lightning_topk.comm.exchanges.base.Exchange` methods of an exchange that keeps owner
    residuals in ``self.owners``: a bucket leaving it and the step's end fold them into the rank residuals,
    they are its checkpoint section, and a saved section without the exchange is folded at load."""

    owners: OwnerResiduals

    def release(self, state: TopKState, names: Sequence[str], numels: Sequence[int]) -> None:
        self.owners.fold_names(state, names, numels)

    def end_step(self, state: TopKState) -> None:
        self.owners.fold_unclaimed(state)

    def state_dict(self) -> Dict[str, Any]:
        return self.owners.state_dict()

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        self.owners.load_state_dict(sd)

    @classmethod
    def orphan(cls, state: TopKState, sd: Dict[str, Any]) -> None:
        fold_section(state, sd)

    def undo_keys(self) -> List[str]:
        return self.owners.undo_keys()


@register("scatter")
class ScatterExchange(OwnerResidualsMixin, Exchange):
    """The scale-free exchange (see the module docstring): its options, the bucket waiting for its owner
    step, and its owner residuals (checkpoint section ``owner_residual``). Not with
    ``momentum_correction`` or ``selection_scope="parameter"``."""

    bucket_layout = True

    momentum_correction = False
    parameter_scope = False
    min_world = 2  # auto considers it only with several ranks

    def __init__(self, state: Any, layout: Optional[Layout] = None, options: Optional[ScatterOptions] = None,
                 **kwargs: Any) -> None:
        super().__init__(state, layout)
        self.options = options
        self.pending: Optional[_Pending] = None
        self.owners = OwnerResiduals()

    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return scatter_topk_hook(state, bucket)

    def flush(self, state: TopKState) -> None:
        p, self.pending = self.pending, None
        _flush(state, p)

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    @classmethod
    def predict(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        P, N, L = model.world, model.nodes, model.local
        eb = value_bytes + 4
        plan = slot_plan(n, k, P)
        comp = model.select(n) + model.select(plan.region) + BOOKKEEPING_PASSES * model.pass_per_elem * n + \
            model.add_per_entry * (k + P * plan.slot + P * plan.out)
        slot = plan.slot * eb
        if N > 1:
            inter = model.tier(model.inter)
            a2a = (P - 1) * inter.alpha + max(L * (P - L) * slot / inter.beta,
                                              (L - 1) * slot / model.tier(model.intra).beta if L > 1 else 0.0)
        else:
            intra = model.tier(model.intra)
            a2a = (P - 1) * (intra.alpha + slot / intra.beta)
        return comp, a2a + model.flat().allgather(plan.out * eb, P)

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        return scatter_wire(slot_plan(n, k, model.world), value_bytes + 4)
