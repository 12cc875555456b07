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
"""
import math
import time
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from lightning_topk.comm.allgather import (
    _all_gather,
    accumulate,
    bucket_k,
    rebuild,
    record_nonfinite,
    record_sent,
    topk_allgather_hook,
)
from lightning_topk.comm.selection import topk_select
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.wire import (
    pack,
    ring_allgather_wire,
    ring_allreduce_wire,
    ring_reduce_scatter_wire,
    unpack,
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


def make_groups(num_nodes: int, local_world: int, rank: int, backend=None, timeout=None) -> HierGroups:
    """Create the intra- and inter-node groups; every rank must call this, in the same order."""
    intra_lists, inter_lists = layout(num_nodes, local_world, dist.get_world_size())
    node, local = divmod(rank, local_world)
    kw = {} if timeout is None else {"timeout": timeout}
    intra = [dist.new_group(r, backend=backend, **kw) for r in intra_lists]  # same order on every rank
    inter = [dist.new_group(r, backend=backend, **kw) for r in inter_lists]
    return HierGroups(num_nodes, local_world, node, local, intra[node], inter[local],
                      intra_lists[node], inter_lists[local])


def build_groups(strategy) -> HierGroups:
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
    if strategy.topk_config.momentum_correction:
        raise ValueError("topk_ddp: momentum_correction is not supported with the hierarchical exchange; "
                         "set hierarchical=false or momentum_correction=false")
    if strategy.topk_config.selection_scope != "bucket":
        raise ValueError("topk_ddp: selection_scope='parameter' is not supported with the hierarchical exchange "
                         "(its shards cut across parameters); set hierarchical=false or selection_scope='bucket'")
    return make_groups(num_nodes, local_world, rank, timeout=getattr(strategy, "_timeout", None))


def hierarchical_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: intra-node reduce-scatter, top-k on the shard, inter-node all-gather, rebuild."""
    h: HierGroups = state.hier
    L = h.local_world
    grad = bucket.buffer()
    n = grad.numel()
    s = math.ceil(n / L)  # shard size
    if bucket_k(state, n) == 0 or L == 1:
        flush_pending(state)
        return topk_allgather_hook(state, bucket)  # dense (flat all-reduce) or nothing to shard
    k = max(1, math.ceil(state.density_now() * s))
    stats = state.current
    scale = state.grad_scale
    world = L * h.num_nodes
    b = state.buffers(bucket.parameters(), grad.device) if state.config.error_feedback else None
    acc, _ = accumulate(state, b, grad)
    if s * L != n:
        acc = torch.cat([acc, acc.new_zeros(s * L - n)])
    state.add_stats(stats, buckets=1, numel=n, bytes_dense=n * grad.element_size(), bytes_intra=acc.numel() * 4,
                    bytes_dense_wire=ring_allreduce_wire(4 * n, world), hierarchical_buckets=1)
    t0 = time.perf_counter()
    shard = acc.new_empty(s)
    _reduce_scatter(shard, acc, group=h.intra)  # node sum of my shard (fast link; blocking)
    stats.comm_time_s += time.perf_counter() - t0

    t1 = time.perf_counter()
    _, idx = topk_select(shard, k, state.config.selector)
    values = shard.index_select(0, idx)
    wire = values.to(state.config.wire_dtype)
    finite = bool(torch.isfinite(values).all())
    lo = h.local_rank * s
    valid = max(0, min(n, lo + s) - lo)  # the last shard may hold padding
    if b is not None and finite:
        state.before_update(b)
        res = b.residual
        res.zero_()  # what this rank held went into the node sum; it now owns only its shard
        rem = shard.clone()
        if wire.dtype == torch.float32:
            rem.index_fill_(0, idx, 0.0)
        else:
            rem.index_copy_(0, idx, values - wire.float())
        res[lo:lo + valid].copy_(rem[:valid])
    if not finite:
        record_nonfinite(state, bucket, stats)
    if state.record_sent:
        full = torch.zeros(s * L, dtype=torch.float32, device=grad.device)
        full[lo:lo + s].index_copy_(0, idx, wire.float())
        record_sent(state, bucket, full[:n])
    stats.select_time_s += time.perf_counter() - t1

    packed = pack(wire, idx.to(torch.int32))
    out = torch.empty(h.num_nodes * packed.numel(), dtype=torch.uint8, device=grad.device)
    state.add_stats(stats, numel_sent=k, bytes_sent=packed.numel() + s * 4, bytes_inter=packed.numel(),
                    bytes_intra=s * 4, bytes_wire=ring_reduce_scatter_wire(4 * s * L, L)
                    + ring_allgather_wire(packed.numel(), h.num_nodes) + ring_allgather_wire(4 * s, L))
    # Every collective is issued from this (backward) thread, in bucket order, so all ranks issue the
    # same sequence on each group. The previous bucket's intra-node all-gather goes out now, after
    # its inter-node all-gather had the time between two hooks to run.
    flush_pending(state)
    result: torch.futures.Future = torch.futures.Future()
    work = _all_gather(out, packed, group=h.inter, async_op=True)
    state.hier_pending = _Pending(result, work, out, k, s, n, scale / world, grad.dtype, stats,
                                  time.perf_counter(), state.config.wire_dtype)
    if bucket.is_last():
        flush_pending(state)
        state.end_exchange()
    return result


@dataclass
class _Pending:
    result: torch.futures.Future
    work: Any
    out: torch.Tensor
    k: int
    s: int
    n: int
    factor: float
    dtype: torch.dtype
    stats: Any
    t_launch: float
    wire_dtype: torch.dtype


def flush_pending(state: TopKState) -> None:
    """Finish the pending bucket: wait for its inter-node gather, rebuild the shard, launch the intra-node
    all-gather, and complete the bucket's future when that arrives."""
    p: _Pending = getattr(state, "hier_pending", None)
    if p is None:
        return
    state.hier_pending = None
    h: HierGroups = state.hier
    p.work.wait()
    vals, ids = unpack(p.out, p.k, p.wire_dtype, h.num_nodes)
    if not bool(torch.isfinite(vals).all()):
        state.nonfinite_seen = True
    shard_sum = rebuild(p.s, vals, ids, p.out.device)
    full = torch.empty(p.s * h.local_world, dtype=torch.float32, device=p.out.device)
    fut = _all_gather(full, shard_sum, group=h.intra, async_op=True).get_future()

    def done(f) -> None:
        try:
            f.wait()
            p.stats.comm_time_s += time.perf_counter() - p.t_launch
            p.result.set_result(full[:p.n].mul_(p.factor).to(p.dtype))
        except Exception as e:  # surface comm errors to DDP rather than hanging
            p.result.set_exception(e)

    fut.then(done)
