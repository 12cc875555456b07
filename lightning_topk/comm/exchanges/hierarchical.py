"""Hierarchical top-k exchange (HiTopKComm of Shi et al., MLSys'21) as a DDP communication hook.

Per bucket, with L processes per node and N nodes:

1. intra-node reduce-scatter of the dense ``residual + grad/scale`` (rank with local rank l gets shard
   l of its node's sum);
2. top-k of that shard; the residual keeps what was not sent, on the shard this rank owns;
3. inter-node all-gather of packed values/indices among the N ranks with the same local rank;
4. rebuild the shard with ``index_add_`` (nodes that picked the same entry add up), then intra-node
   all-gather of the shards rebuilds the whole bucket on every rank.

The slow inter-node links carry k/L entries per rank instead of k per rank (flat), so L times fewer
bytes cross nodes. Buckets are zero-padded to a multiple of L; buckets below ``min_sparse_numel``
and dense-schedule steps use a flat all-reduce.

``exchange="hierarchical_scatter"`` replaces step 3 by the scale-free exchange
(:mod:`lightning_topk.comm.exchanges.scatter`) among the same N ranks, run on the shard: slots of about
``k/(L N)`` entries to each node's owner in one all-to-all (what does not fit stays in the shard's
residual), an owner step on ``s/N`` positions with an owner residual (keyed by bucket and local rank,
checkpointed, rolled back on a skipped step), an all-gather of ``k/(L N)`` forwards per rank. Inter-node
wire bytes per rank are then about ``2 (k/L) b (N-1)/N``: independent of N. Its collectives form a
two-deep pipeline: at a bucket's hook the bucket two back finishes (intra-node all-gather) and the
previous one moves from its all-to-all to its all-gather.
"""
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.cost import BOOKKEEPING_PASSES
from lightning_topk.comm.exchanges.allgather import topk_allgather_hook
from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.kit import (
    Gather,
    Hold,
    _all_gather,
    accumulate,
    bucket_k,
    clip_spans,
    deliver,
    factor,
    future_on,
    gather_entries,
    rebuild,
    record_grads,
    record_sent,
    select,
    send_values,
    unused_spans,
)
from lightning_topk.comm.exchanges.registry import register
from lightning_topk.comm.exchanges.scatter import (
    OwnerResiduals,
    OwnerResidualsMixin,
    ScatterJob,
    ScatterOptions,
    bucket_key,
    scatter_forward,
    scatter_launch,
    scatter_send,
    scatter_wire,
    slot_plan,
)
from lightning_topk.comm.state import Scale, TopKState
from lightning_topk.comm.telemetry import StepStats, clock
from lightning_topk.comm.wire import (
    index_code,
    pack,
    packed_nbytes,
    ring_allgather_wire,
    ring_allreduce_wire,
    ring_reduce_scatter_wire,
    sparse_nbytes,
)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class HierGroups:
    """Process groups of a (num_nodes x local_world) layout; global rank = node * local_world + local."""

    num_nodes: int
    local_world: int
    node_rank: int
    local_rank: int
    intra: Any  # the ranks of this node
    inter: Any  # the ranks with this local rank, one per node
    intra_ranks: List[int]
    inter_ranks: List[int]


def layout(num_nodes: int, local_world: int, world: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(intra-node rank lists, one per node; inter-node rank lists, one per local rank)."""
    if num_nodes < 1 or local_world < 1 or num_nodes * local_world != world:
        raise ValueError(
            f"hierarchical exchange: world size {world} is not num_nodes ({num_nodes}) x processes per node "
            f"({local_world}); check trainer.num_nodes / devices and the cluster environment"
        )
    intra = [[n * local_world + i for i in range(local_world)] for n in range(num_nodes)]
    inter = [[n * local_world + i for n in range(num_nodes)] for i in range(local_world)]
    return intra, inter


def make_groups(num_nodes: int, local_world: int, rank: int, backend: Optional[str] = None,
                timeout: Any = None) -> HierGroups:
    """Create the intra- and inter-node groups; every rank must call this, in the same order."""
    intra_lists, inter_lists = layout(num_nodes, local_world, dist.get_world_size())
    node, local = divmod(rank, local_world)
    kw = {} if timeout is None else {"timeout": timeout}
    intra = [dist.new_group(r, backend=backend, **kw) for r in intra_lists]  # same order on every rank
    inter = [dist.new_group(r, backend=backend, **kw) for r in inter_lists]
    return HierGroups(num_nodes, local_world, node, local, intra[node], inter[local],
                      intra_lists[node], inter_lists[local])


def destroy_groups(groups: Optional[HierGroups]) -> None:
    """Destroy the process groups :func:`make_groups` made for this rank (local, not collective; their gloo
    threads and connections go away). Nothing of theirs may be in flight: finish the exchanges first
    (:meth:`~lightning_topk.comm.state.TopKState.finish_in_flight`)."""
    if groups is None or not (dist.is_available() and dist.is_initialized()):
        return
    for g in {id(g): g for g in (groups.intra, groups.inter)}.values():
        if g is None or g is dist.GroupMember.NON_GROUP_MEMBER or g is dist.group.WORLD:
            continue
        if g in dist.distributed_c10d._world.pg_map:  # not destroyed already
            dist.destroy_process_group(g)


def build_groups(strategy: Any) -> HierGroups:
    """Groups from a Lightning strategy's cluster environment (node rank, local rank, devices)."""
    env = strategy.cluster_environment
    local_world = strategy.num_processes
    num_nodes = strategy.num_nodes
    rank = strategy.global_rank
    if env is not None and (env.node_rank() * local_world + env.local_rank()) != rank:
        raise ValueError(
            f"hierarchical exchange: global rank {rank} is not node_rank ({env.node_rank()}) x devices "
            f"({local_world}) + local_rank ({env.local_rank()}); the launcher's layout is not node-major"
        )
    return make_groups(num_nodes, local_world, rank, timeout=getattr(strategy, "_timeout", None))


def hierarchical_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: intra-node reduce-scatter, top-k on the shard, inter-node all-gather, rebuild."""
    return _hook(state, bucket, scatter=False)


def hierarchical_scatter_topk_hook(state: TopKState,
                                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: as :func:`hierarchical_topk_hook`, with the scale-free exchange among the inter-node
    group (``exchange="hierarchical_scatter"``)."""
    return _hook(state, bucket, scatter=True)


def _hook(state: TopKState, bucket: dist.GradBucket, scatter: bool) -> torch.futures.Future[torch.Tensor]:
    hx: Any = state.exchange_for("hierarchical_scatter" if scatter else "hierarchical")  # (scatter: with owners)
    h = hx.groups
    L, N = h.local_world, h.num_nodes
    grad = bucket.buffer()
    n = grad.numel()
    s = math.ceil(n / L)  # shard size
    if bucket_k(state, n) == 0 or L == 1:
        hx.flush(state)
        if scatter and bucket.is_last():
            hx.owners.fold_unclaimed(state)
        return topk_allgather_hook(state, bucket)  # dense (flat all-reduce) or nothing to shard
    k = max(1, math.ceil(state.density_now() * s))
    cfg = state.config
    params = bucket.parameters()
    names = state.names_of(params)
    device = grad.device
    stats = state.current
    world = L * N
    state.add_stats(stats, "hierarchical_scatter" if scatter else "hierarchical", buckets=1, numel=n,
                    bytes_dense=n * grad.element_size(), bytes_intra=s * L * 4,
                    bytes_dense_wire=ring_allreduce_wire(4 * n, world))
    if state.debug.enabled:
        record_grads(state, names, [p.numel() for p in params], grad)
    b = state.buffers(params, device, multiple=L) if cfg.error_feedback else None
    acc, _ = accumulate(state, b, grad)
    state.flags.note_input(names, acc[:n])
    if acc.numel() != s * L:  # no error feedback: the bucket buffer, unpadded
        acc = torch.cat([acc, acc.new_zeros(s * L - n)])
    t0 = clock(device)
    shard = acc.new_empty(s)
    # Node sum of my shard (fast link). wait(): on NCCL a stream wait, on gloo the host waits.
    _reduce_scatter(shard, acc, group=h.intra, async_op=True).wait()
    state.add_time(stats, "comm_time_s", t0)

    t1 = clock(device)
    lo = h.local_rank * s
    # Parameters unused on this rank (the shard's owner) stay in its shard's residual this step.
    unused = clip_spans(unused_spans(params), lo, s) if b is not None else []
    hold = Hold(unused, shard) if unused else None
    if hold is not None:
        hold.hide(shard)
    idx = select(state, shard, k, hint_key=("shard", *names))
    wire = send_values(state, shard, idx, None)  # shard now holds what this rank did not send
    plan = slot_plan(s, k, N, hx.options) if scatter else None
    if plan is not None:
        packed, fits = scatter_send(state, shard, idx, wire, plan)  # what does not fit stays in shard
        eb = packed_nbytes(1, cfg.wire_dtype)
        inter_payload, inter_wire = packed.numel() + plan.out * eb, scatter_wire(plan, eb)
    else:
        packed, fits = pack(wire, idx, index_code(s, k)), None
        inter_payload, inter_wire = packed.numel(), ring_allgather_wire(packed.numel(), N)
    if hold is not None:
        hold.restore()
    if b is not None:
        b.residual.zero_()  # what this rank held went into the node sum; it now owns only its shard
        b.residual[lo:lo + s].copy_(shard)
    if state.debug.enabled:
        full = torch.zeros(s * L, dtype=torch.float32, device=device)
        full[lo:lo + s].index_copy_(0, idx, wire.float() if fits is None else wire.float() * fits)
        record_sent(state, names, [p.numel() for p in params], full[:n])
    state.add_time(stats, "select_time_s", t1)
    state.add_stats(stats, numel_sent=k, bytes_sent=inter_payload + s * 4, bytes_inter=inter_payload,
                    bytes_intra=s * 4, bytes_wire=ring_reduce_scatter_wire(4 * s * L, L) + inter_wire
                    + ring_allgather_wire(4 * s, L))
    key = None
    if plan is not None and b is not None:
        key = bucket_key(N, h.node_rank, b.names, b.numels, h.local_rank, L)
        hx.owners.claim(key, plan.region, device)
    # Every collective is issued from this (backward) thread, in bucket order, so all ranks issue the
    # same sequence on each group. The previous bucket's intra-node all-gather goes out now, after
    # its inter-node exchange had the time between two hooks to run (scatter: the bucket before it
    # finishes; the previous one moves from its all-to-all to its all-gather).
    hx.flush(state, drain=not scatter)
    result = future_on(device)
    t_launch = clock(device)
    f = factor(state.grad_scale, world)
    if plan is not None:
        job = scatter_launch(packed, plan, h.inter, h.node_rank, key, cfg.wire_dtype, hx.owners, unused)
        hx.scatter_pending = _Pending(result, job, s, grad, f, stats, t_launch)
    else:
        g = gather_entries(packed, k, N, h.inter, cfg.wire_dtype, index_code(s, k))
        hx.pending = _Pending(result, g, s, grad, f, stats, t_launch)
    if bucket.is_last():
        hx.flush(state)
        if scatter:
            hx.owners.fold_unclaimed(state)  # anything the buckets of this exchange did not claim
        state.end_exchange()
    return result


@dataclass
class _Pending:
    result: torch.futures.Future
    inter: Union[Gather, ScatterJob]  # the inter-node exchange in flight
    s: int
    grad: Tensor
    factor: Scale
    stats: StepStats
    t_launch: Any


def flush_pending(state: TopKState, drain: bool = True) -> None:
    """Finish what the hierarchical exchanges of ``state`` have in flight (see :meth:`HierarchicalExchange.flush`)."""
    for name in ("hierarchical", "hierarchical_scatter"):
        if name in state.exchanges:
            state.exchanges[name].flush(state, drain)


def _flush(state: TopKState, hx: "HierarchicalExchange", drain: bool = True) -> None:
    """Finish the bucket whose inter-node all-gather is in flight (rebuild its shard, launch the intra-node
    all-gather, complete its future when that arrives); move a bucket whose inter-node all-to-all is in
    flight (``hierarchical_scatter``) on to its owner step and all-gather, and with ``drain`` finish it
    too. Only device work is queued."""
    if hx.pending is not None:
        _finish(state, hx)
    q = hx.scatter_pending
    if q is not None:
        hx.scatter_pending = None
        assert isinstance(q.inter, ScatterJob)
        q.inter.work.wait()
        t0 = clock(q.grad.device)
        q.inter = scatter_forward(state, q.inter)
        state.add_time(q.stats, "select_time_s", t0)
        hx.pending = q
        if drain:
            _finish(state, hx)


def _finish(state: TopKState, hx: "HierarchicalExchange") -> None:
    p = hx.pending
    assert p is not None and isinstance(p.inter, Gather)
    hx.pending = None
    h = hx.groups
    p.inter.work.wait()
    vals, ids = p.inter.entries()
    shard_sum = rebuild(torch.empty(p.s, dtype=torch.float32, device=p.grad.device), vals.mul_(p.factor), ids)
    n = p.grad.numel()
    direct = p.grad.dtype == torch.float32 and n == p.s * h.local_world
    full = p.grad if direct else torch.empty(p.s * h.local_world, dtype=torch.float32, device=p.grad.device)
    fut = _all_gather(full, shard_sum, group=h.intra, async_op=True).get_future()

    def done(f: torch.futures.Future) -> None:
        try:
            f.wait()
            state.add_time(p.stats, "comm_time_s", p.t_launch)
            p.result.set_result(deliver(state, p.grad, full))
        except Exception as e:  # surface comm errors to DDP rather than hanging
            p.result.set_exception(e)

    fut.then(done)


@register("hierarchical")
class HierarchicalExchange(Exchange):
    """The hierarchical exchange (see the module docstring): its process groups and the bucket whose
    inter-node collective is in flight. Needs more than one process per node and the groups
    (:func:`make_groups`); not with ``momentum_correction`` or ``selection_scope="parameter"``."""

    min_local = 2
    needs_groups = True
    bucket_layout = True
    momentum_correction = False
    parameter_scope = False

    def __init__(self, state: Any, layout: Optional[Layout] = None, groups: Optional[HierGroups] = None,
                 **kwargs: Any) -> None:
        super().__init__(state, layout)
        if groups is None:
            raise ValueError("hierarchical_topk_hook: the state has no groups; build it with "
                             "TopKState(config, hier=make_groups(num_nodes, local_world, rank))")
        self.groups = groups
        self.pending: Optional[_Pending] = None  # in its inter-node all-gather
        self.scatter_pending: Optional[_Pending] = None  # in its inter-node all-to-all (hierarchical_scatter)

    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _hook(state, bucket, scatter=False)

    def flush(self, state: TopKState, drain: bool = True) -> None:
        _flush(state, self, drain)

    @property
    def in_flight(self) -> bool:
        return self.pending is not None or self.scatter_pending is not None

    @classmethod
    def predict(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        """The intra-node reduce-scatter, selection on the shard and intra-node all-gather, plus the
        inter-node tier (:meth:`_inter`); infinite without several nodes of several processes."""
        N, L = model.nodes, model.local
        if N < 2 or L < 2:
            return math.inf, math.inf
        intra = model.tier(model.intra)
        comp = model.select(n / L) + BOOKKEEPING_PASSES * model.pass_per_elem * n
        comm = intra.reduce_scatter(4 * n, L) + intra.allgather(4 * n / L, L)
        comp_inter, comm_inter = cls._inter(model, n, math.ceil(k / L), value_bytes)
        return comp + comp_inter, comm + comm_inter

    @classmethod
    def _inter(cls, model: Any, n: int, ks: int, value_bytes: int) -> Tuple[float, float]:
        """(compute, link) seconds of the inter-node tier: an all-gather of ``ks`` entries per rank, all L
        ranks of a node at once."""
        N, L, inter = model.nodes, model.local, model.tier(model.inter)
        packet = sparse_nbytes(math.ceil(n / L), ks, value_bytes)
        return model.add_per_entry * N * ks, (N - 1) * (inter.alpha + L * packet / inter.beta)

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        L = model.local
        return (model.nodes - 1) * sparse_nbytes(math.ceil(n / L), math.ceil(k / L), value_bytes)


@register("hierarchical_scatter")
class HierarchicalScatterExchange(OwnerResidualsMixin, HierarchicalExchange):
    """The hierarchical exchange with the scale-free exchange among the ranks with the same local rank:
    also its scatter options and owner residuals (keyed by bucket and local rank; checkpoint section
    ``owner_residual``)."""

    def __init__(self, state: Any, layout: Optional[Layout] = None, groups: Optional[HierGroups] = None,
                 options: Optional[ScatterOptions] = None, **kwargs: Any) -> None:
        super().__init__(state, layout, groups)
        self.options = options
        self.owners = OwnerResiduals()

    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _hook(state, bucket, scatter=True)

    @classmethod
    def _inter(cls, model: Any, n: int, ks: int, value_bytes: int) -> Tuple[float, float]:
        """The scale-free exchange among the N ranks with this local rank, on the shard (all L at once);
        its slots carry int32 positions."""
        N, L, inter = model.nodes, model.local, model.tier(model.inter)
        eb = value_bytes + 4
        plan = slot_plan(math.ceil(n / L), ks, N)
        comp = model.select(plan.region) + model.add_per_entry * (ks + N * plan.slot + N * plan.out)
        return comp, (N - 1) * (2 * inter.alpha + L * (plan.slot + plan.out) * eb / inter.beta)

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        L = model.local
        return scatter_wire(slot_plan(math.ceil(n / L), math.ceil(k / L), model.nodes), value_bytes + 4)
