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
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.allgather import (
    _all_gather,
    accumulate,
    bucket_k,
    deliver,
    factor,
    rebuild,
    record_grads,
    record_sent,
    select,
    send_values,
    topk_allgather_hook,
)
from lightning_topk.comm.state import HierExchange, Scale, StepStats, TopKState, clock
from lightning_topk.comm.wire import (
    index_dtype_for,
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


def future_on(device: torch.device) -> torch.futures.Future:
    """A hand-made future that carries its device, so that DDP waits on the right CUDA stream."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def hierarchical_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: intra-node reduce-scatter, top-k on the shard, inter-node all-gather, rebuild."""
    hx = _exchange(state)
    h = hx.groups
    L = h.local_world
    grad = bucket.buffer()
    n = grad.numel()
    s = math.ceil(n / L)  # shard size
    if bucket_k(state, n) == 0 or L == 1:
        flush_pending(state)
        return topk_allgather_hook(state, bucket)  # dense (flat all-reduce) or nothing to shard
    k = max(1, math.ceil(state.density_now() * s))
    cfg = state.config
    params = bucket.parameters()
    names = state.names_of(params)
    device = grad.device
    stats = state.current
    world = L * h.num_nodes
    state.add_stats(stats, buckets=1, numel=n, bytes_dense=n * grad.element_size(), bytes_intra=s * L * 4,
                    bytes_dense_wire=ring_allreduce_wire(4 * n, world), hierarchical_buckets=1)
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
    idx = select(state, shard, k)
    wire = send_values(state, shard, idx, None)  # shard now holds what this rank did not send
    lo = h.local_rank * s
    if b is not None:
        b.residual.zero_()  # what this rank held went into the node sum; it now owns only its shard
        b.residual[lo:lo + s].copy_(shard)
    if state.debug.enabled:
        full = torch.zeros(s * L, dtype=torch.float32, device=device)
        full[lo:lo + s].index_copy_(0, idx, wire.float())
        record_sent(state, names, [p.numel() for p in params], full[:n])
    state.add_time(stats, "select_time_s", t1)

    idt = index_dtype_for(s)
    packed = pack(wire, idx, idt)
    out = torch.empty(h.num_nodes * packed.numel(), dtype=torch.uint8, device=device)
    state.add_stats(stats, numel_sent=k, bytes_sent=packed.numel() + s * 4, bytes_inter=packed.numel(),
                    bytes_intra=s * 4, bytes_wire=ring_reduce_scatter_wire(4 * s * L, L)
                    + ring_allgather_wire(packed.numel(), h.num_nodes) + ring_allgather_wire(4 * s, L))
    # Every collective is issued from this (backward) thread, in bucket order, so all ranks issue the
    # same sequence on each group. The previous bucket's intra-node all-gather goes out now, after
    # its inter-node all-gather had the time between two hooks to run.
    flush_pending(state)
    result = future_on(device)
    t_launch = clock(device)
    work = _all_gather(out, packed, group=h.inter, async_op=True)
    hx.pending = _Pending(result, work, out, k, s, grad, factor(state.grad_scale, world), stats, t_launch,
                          cfg.wire_dtype, idt)
    if bucket.is_last():
        flush_pending(state)
        state.end_exchange()
    return result


def _exchange(state: TopKState) -> HierExchange:
    if state.hier is None:
        raise ValueError("hierarchical_topk_hook: the state has no groups; build it with "
                         "TopKState(config, hier=make_groups(num_nodes, local_world, rank))")
    return state.hier


@dataclass
class _Pending:
    result: torch.futures.Future
    work: Any
    out: Tensor
    k: int
    s: int
    grad: Tensor
    factor: Scale
    stats: StepStats
    t_launch: Any
    wire_dtype: torch.dtype
    index_dtype: torch.dtype


def flush_pending(state: TopKState) -> None:
    """Finish the pending bucket: wait for its inter-node gather, rebuild the shard, launch the intra-node
    all-gather, and complete the bucket's future when that arrives. Only device work is queued."""
    hx = _exchange(state)
    p = hx.pending
    if p is None:
        return
    hx.pending = None
    h = hx.groups
    p.work.wait()
    vals, ids = unpack(p.out, p.k, p.wire_dtype, h.num_nodes, p.index_dtype)
    shard_sum = rebuild(torch.empty(p.s, dtype=torch.float32, device=p.out.device), vals.mul_(p.factor), ids)
    n = p.grad.numel()
    direct = p.grad.dtype == torch.float32 and n == p.s * h.local_world
    full = p.grad if direct else torch.empty(p.s * h.local_world, dtype=torch.float32, device=p.out.device)
    fut = _all_gather(full, shard_sum, group=h.intra, async_op=True).get_future()

    def done(f: torch.futures.Future) -> None:
        try:
            f.wait()
            state.add_time(p.stats, "comm_time_s", p.t_launch)
            p.result.set_result(deliver(state, p.grad, full))
        except Exception as e:  # surface comm errors to DDP rather than hanging
            p.result.set_exception(e)

    fut.then(done)
