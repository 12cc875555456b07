"""Alpha-beta cost model of the exchanges and the automatic per-bucket choice (``exchange="auto"``).

Each link tier (intra-node, inter-node) is a latency ``alpha`` (s per message) and a bandwidth ``beta``
(bytes/s), fitted at setup from timed all-reduces of two sizes; selection (on synthetic gradient-like
data of two sizes), one dense pass and a random-place ``index_add_`` (rebuilds) are timed too. Every rank measures, the slowest figure
wins (one all-reduce), so every rank holds the same model and takes the same decisions.

Per bucket of ``n`` entries with ``k`` to send, on ``P = N x L`` ranks (N nodes, L per node), the
model predicts compute + link time of

* ``dense``: ring all-reduce of the fp32 accumulator, ``2(P-1) alpha + 2(P-1)/P 4n / beta``;
* ``dense_bf16``: the same in bf16 (half the bytes; the cast error stays in the residual), its time the
  fp32 one's times the measured bf16/fp32 ratio (0.5 where the link limits; gloo sums bf16 slowly on CPU);
* ``allgather``: selection + ring all-gather of k entries, ``(P-1)(alpha + k b / beta)``;
* ``hierarchical``: intra-node reduce-scatter and all-gather of the fp32 shard, selection on ``n/L``, an
  inter-node all-gather of ``k/L`` entries per rank that all L ranks of a node run at once;
* ``scatter``: selection, an all-to-all of ``P-1`` slots (a node's link carries ``L (P-L)`` of them)
  and a ring all-gather of the owners' forwards (:mod:`lightning_topk.comm.scatter`);
* ``hierarchical_scatter``: the intra-node part of ``hierarchical``, then the scale-free exchange among
  the N ranks with the same local rank on ``k/L`` entries (all L ranks of a node at once).

Flat collectives across nodes are limited by the inter-node tier (a node-major ring crosses each
node's link once per step). The choice is the lowest prediction, a sparse one's times
``auto_sparse_penalty`` (top-k needs more steps to an accuracy); ``density`` stays the user's: only how
the entries travel changes (``dense`` sends them all). Predictions and measured times are logged as
``topk/predicted_ms`` and ``topk/measured_ms``. Every ``REFRESH_STEPS`` exchanges the model is refreshed
from telemetry: selection cost per entry from the measured selection time, and a link-time scale from
measured over predicted exchange time (the mean over ranks, carried by the step controller's one
all-reduce per step, so the hooks read nothing on the host; without a controller, the slowest rank's,
by an all-reduce of its own); a bucket switches algorithm only when the new choice's score is at least
``SWITCH_GAIN`` better.
"""
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lightning_topk.comm.allgather import (
    bucket_k,
    dense_hook,
    topk_allgather_hook,
)
from lightning_topk.comm.hierarchical import flush_pending, hierarchical_scatter_topk_hook, hierarchical_topk_hook
from lightning_topk.comm.scatter import (
    bucket_key,
    flush_scatter,
    fold_live_owner,
    fold_pending_owner,
    scatter_topk_hook,
    scatter_wire,
    slot_plan,
)
from lightning_topk.comm.selection import sync_free_enabled, topk_select, topk_select_sync_free
from lightning_topk.comm.state import HIERARCHICAL_EXCHANGES, TopKState
from lightning_topk.comm.wire import packed_nbytes, ring_allreduce_wire

log = logging.getLogger(__name__)

CHOICES = ("dense", "dense_bf16", "allgather", "hierarchical", "hierarchical_scatter", "scatter")
SPARSE = ("allgather", "hierarchical", "hierarchical_scatter", "scatter")
REFRESH_STEPS = 100
SWITCH_GAIN = 0.9
SCATTER_TIE = 0.1
_PROBE_BYTES = (1024, 1 << 20, 8 << 20)  # the largest only where 1 MiB takes < 50 ms (beats a shaper's burst)
_PROBE_NUMELS = (1 << 18, 1 << 22)  # the larger beyond CPU caches, as real buckets are
BOOKKEEPING_PASSES = 4  # every exchange: accumulate, feedback/finite check, rebuild or scale, copy back


@dataclass
class Link:
    """One tier: ``alpha`` seconds per message, ``beta`` bytes per second."""

    alpha: float
    beta: float

    def allreduce(self, nbytes: float, p: int) -> float:
        return 0.0 if p < 2 else 2 * (p - 1) * self.alpha + 2 * (p - 1) / p * nbytes / self.beta

    def allgather(self, nbytes: float, p: int) -> float:
        return 0.0 if p < 2 else (p - 1) * (self.alpha + nbytes / self.beta)

    def reduce_scatter(self, nbytes: float, p: int) -> float:
        return 0.0 if p < 2 else (p - 1) * (self.alpha + nbytes / p / self.beta)

    @staticmethod
    def fit(times: Tuple[float, float], sizes: Tuple[int, int], p: int) -> "Link":
        """alpha and beta from ring all-reduce times of two sizes."""
        f = 2 * (p - 1) / p
        dt = max(times[1] - times[0], 1e-9)
        beta = f * (sizes[1] - sizes[0]) / dt
        alpha = max(1e-7, (times[0] - f * sizes[0] / beta) / (2 * (p - 1)))
        return Link(alpha, beta)


@dataclass
class CostModel:
    """Predicted seconds per bucket for each exchange on a ``nodes x local`` layout."""

    nodes: int
    local: int
    intra: Optional[Link]
    inter: Optional[Link]
    select_per_elem: float
    select_fixed: float
    pass_per_elem: float
    add_per_entry: float  # index_add_ of one entry at a random place (rebuilds, owner sums)
    bf16_factor: float = 0.5  # a bf16 all-reduce's time / an fp32 one's of the same entries (gloo: CPU sums)
    comm_scale: float = 1.0

    @property
    def world(self) -> int:
        return self.nodes * self.local

    def _flat(self) -> Link:
        return self._link(self.inter if self.nodes > 1 else self.intra)

    @staticmethod
    def _link(link: Optional[Link]) -> Link:
        if link is None:
            raise ValueError("cost model: no link measured for this tier (one node / one process per node)")
        return link

    def select(self, n: float) -> float:
        return self.select_fixed + self.select_per_elem * n

    def predict(self, choice: str, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        """(compute seconds, link seconds) of one bucket."""
        P, N, L = self.world, self.nodes, self.local
        eb = value_bytes + 4
        dense_pass = BOOKKEEPING_PASSES * self.pass_per_elem * n
        flat = self._flat()
        if choice == "dense":
            comp, comm = dense_pass, flat.allreduce(4 * n, P)
        elif choice == "dense_bf16":
            comp = dense_pass + 3 * self.pass_per_elem * n  # casts and the cast error into the residual
            comm = self.bf16_factor * flat.allreduce(4 * n, P)
        elif choice == "allgather":
            comp = self.select(n) + dense_pass + self.add_per_entry * P * k
            comm = flat.allgather(k * eb, P)
        elif choice == "scatter":
            plan = slot_plan(n, k, P)
            comp = self.select(n) + self.select(plan.region) + dense_pass + self.add_per_entry * (
                k + P * plan.slot + P * plan.out)
            slot = plan.slot * eb
            if N > 1:
                inter = self._link(self.inter)
                a2a = (P - 1) * inter.alpha + max(L * (P - L) * slot / inter.beta,
                                                  (L - 1) * slot / self._link(self.intra).beta if L > 1 else 0.0)
            else:
                intra = self._link(self.intra)
                a2a = (P - 1) * (intra.alpha + slot / intra.beta)
            comm = a2a + flat.allgather(plan.out * eb, P)
        elif choice in ("hierarchical", "hierarchical_scatter"):
            if N < 2 or L < 2:
                return math.inf, math.inf
            ks = math.ceil(k / L)
            intra, inter = self._link(self.intra), self._link(self.inter)
            comp = self.select(n / L) + dense_pass
            comm = intra.reduce_scatter(4 * n, L) + intra.allgather(4 * n / L, L)
            if choice == "hierarchical":
                comp += self.add_per_entry * N * ks
                comm += (N - 1) * (inter.alpha + L * ks * eb / inter.beta)
            else:
                plan = slot_plan(math.ceil(n / L), ks, N)
                comp += self.select(plan.region) + self.add_per_entry * (ks + N * plan.slot + N * plan.out)
                comm += (N - 1) * (2 * inter.alpha + L * (plan.slot + plan.out) * eb / inter.beta)
        else:
            raise ValueError(f"cost model: unknown exchange {choice!r}; allowed: {list(CHOICES)}")
        return comp, comm * self.comm_scale

    def total(self, choice: str, n: int, k: int, value_bytes: int = 4) -> float:
        return sum(self.predict(choice, n, k, value_bytes))

    def choose(self, n: int, k: int, candidates: List[str], value_bytes: int = 4,
               sparse_penalty: float = 1.0) -> Tuple[str, Dict[str, float]]:
        """The candidate with the lowest score and every candidate's predicted seconds.

        A sparse candidate's score is its prediction times ``sparse_penalty`` (top-k needs more steps than
        a dense all-reduce for the same accuracy; see ``TopKConfig.auto_sparse_penalty``), a dense one's is
        its prediction. Ties go to the scale-free exchange: within ``SCATTER_TIE`` of the best sparse
        score, never behind a dense transport, and with fewer wire bytes, it is chosen (its bytes do not
        grow with P)."""
        pred = {c: self.total(c, n, k, value_bytes) for c in candidates}
        score = {c: p * (sparse_penalty if c in SPARSE else 1.0) for c, p in pred.items()}
        best = min(score, key=lambda c: score[c])
        if "scatter" in score and best in SPARSE and best != "scatter" \
                and score["scatter"] <= (1 + SCATTER_TIE) * score[best] \
                and all(score["scatter"] <= score[d] for d in ("dense", "dense_bf16") if d in score) \
                and self.wire("scatter", n, k, value_bytes) < self.wire(best, n, k, value_bytes):
            best = "scatter"
        return best, pred

    def wire(self, choice: str, n: int, k: int, value_bytes: int = 4) -> float:
        """Bytes one rank puts on the wire (flat collectives; hierarchical ones: their inter-node part)."""
        P, N, L, eb = self.world, self.nodes, self.local, value_bytes + 4
        if choice in ("dense", "dense_bf16"):
            return ring_allreduce_wire((4 if choice == "dense" else 2) * n, P)
        if choice == "allgather":
            return (P - 1) * k * eb
        if choice == "scatter":
            return scatter_wire(slot_plan(n, k, P), eb)
        if choice == "hierarchical_scatter":
            return scatter_wire(slot_plan(math.ceil(n / L), math.ceil(k / L), N), eb)
        return (N - 1) * math.ceil(k / L) * eb


# ---- probes ---------------------------------------------------------------------------------------
def _timed(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    best = math.inf
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first run warms up
            best = min(best, time.perf_counter() - t0)
    return best


def _link_times(group, device: torch.device) -> Tuple[float, float, int, float]:
    """(small all-reduce seconds, large all-reduce seconds, large size, bf16/fp32 time of the large one);
    the same sizes on every rank of the group."""
    def timed(nbytes: int, dtype: torch.dtype = torch.float32) -> float:
        x = torch.ones(nbytes // 4, dtype=dtype, device=device)
        return _timed(lambda: dist.all_reduce(x, group=group), device)

    small, mid = timed(_PROBE_BYTES[0]), timed(_PROBE_BYTES[1])
    t = torch.tensor([mid], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # one decision for the group
    size = _PROBE_BYTES[2] if float(t) < 0.05 else _PROBE_BYTES[1]
    large = timed(size) if size != _PROBE_BYTES[1] else mid
    return small, large, size, timed(size, torch.bfloat16) / large


def _compute_times(density: float, selector: str, device: torch.device) -> List[float]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    pick = topk_select_sync_free if sync_free_enabled(device) else topk_select
    for n in _PROBE_NUMELS:
        x = (torch.randn(n, generator=g) * torch.randn(n, generator=g).exp()).to(device)
        k = max(1, math.ceil(density * n))
        out.append(_timed(functools.partial(pick, x, k, selector), device, reps=2))
    x = torch.randn(_PROBE_NUMELS[1], device=device)
    y = torch.empty_like(x)
    out.append(_timed(lambda: torch.add(x, x, alpha=0.5, out=y), device) / _PROBE_NUMELS[1])
    m = _PROBE_NUMELS[0]
    idx = torch.randint(0, x.numel(), (m,), generator=g).to(device)
    out.append(_timed(lambda: y.index_add_(0, idx, x[:m]), device) / m)
    return out


def probe(nodes: int, local: int, rank: int, density: float, selector: str, device: torch.device,
          intra_group=None, inter_group=None) -> CostModel:
    """Measure both link tiers, selection and a dense pass; identical result on every rank.

    Every rank must call this. With several processes per node only local rank 0 probes the inter-node
    tier (the others would share its link); the intra-node groups probe at the same time.
    """
    local_rank = rank % local
    vec = torch.zeros(12, dtype=torch.float64)
    if nodes > 1 and local_rank == 0:
        group = inter_group if local > 1 else None
        t = _link_times(group, device)
        vec[3:6], vec[11] = torch.tensor(t[:3], dtype=torch.float64), t[3]
    if local > 1:
        dist.barrier()
        t = _link_times(intra_group if nodes > 1 else None, device)
        vec[0:3], vec[10] = torch.tensor(t[:3], dtype=torch.float64), t[3]
    vec[6:10] = torch.tensor(_compute_times(density, selector, device), dtype=torch.float64)
    vec = vec.to(device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)  # the slowest rank's figures, identical everywhere
    v = vec.cpu().tolist()
    intra = Link.fit((v[0], v[1]), (_PROBE_BYTES[0], int(v[2])), local) if local > 1 else None
    inter = Link.fit((v[3], v[4]), (_PROBE_BYTES[0], int(v[5])), nodes) if nodes > 1 else None
    per = max(0.0, (v[7] - v[6]) / (_PROBE_NUMELS[1] - _PROBE_NUMELS[0]))
    fixed = max(0.0, v[6] - per * _PROBE_NUMELS[0])
    bf16 = v[11] if nodes > 1 else v[10]  # the tier flat collectives are limited by
    return CostModel(nodes, local, intra, inter, per, fixed, v[8], v[9], bf16_factor=bf16)


# ---- the dense transports -------------------------------------------------------------------------
def dense_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for ``exchange="dense"``: every bucket all-reduced in ``value_dtype``."""
    return dense_hook(state, bucket, state.config.wire_dtype)


# ---- exchange="auto" ------------------------------------------------------------------------------
@dataclass
class AutoExchange:
    """The cost model, the candidates, and the choice made for each bucket (keyed by its parameters and k)."""

    model: CostModel
    candidates: List[str]
    rank: int = 0
    choices: Dict[str, Tuple[str, float]] = field(default_factory=dict)
    # telemetry since the last refresh: selection seconds and entries, measured and predicted link seconds
    _window: List[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    # the step being exchanged: predicted link seconds and entries of sparse buckets
    _step: List[float] = field(default_factory=lambda: [0.0, 0.0])
    # a StepController carries the refresh on its per-step all-reduce (no host read in the hooks)
    controlled: bool = False
    refreshes: int = 0

    def decide(self, state: TopKState, key: str, n: int, k: int) -> Tuple[str, float, float]:
        """(choice, predicted seconds, predicted link seconds) for a bucket, cached per key."""
        vb = packed_nbytes(1, state.config.wire_dtype) - 4
        hit = self.choices.get(key)
        if hit is None:
            saved = state.plan.get(key)
            best, pred = self.model.choose(n, k, self.candidates, vb, state.config.auto_sparse_penalty)
            if saved in self.candidates:
                best = saved  # restored from a checkpoint: same choice as the interrupted run
            self.choices[key] = (best, pred[best])
            state.plan[key] = best
            if self.rank == 0:
                log.info("topk_ddp exchange=auto: bucket of %d entries (k=%d) -> %s; predicted ms: %s", n, k, best,
                         ", ".join(f"{c} {1e3 * t:.2f}" for c, t in pred.items()))
        choice = self.choices[key][0]
        comp, comm = self.model.predict(choice, n, k, vb)
        return choice, comp + comm, comm

    def take_window(self) -> List[float]:
        """This rank's telemetry since the last refresh: [selection seconds per entry, measured / predicted
        link time] (0 where unknown); the window starts anew."""
        sel_s, sel_n, meas_comm, pred_comm = self._window
        self._window = [0.0, 0.0, 0.0, 0.0]
        return [sel_s / sel_n if sel_n else 0.0, meas_comm / pred_comm if pred_comm > 0 else 0.0]

    def refresh_due(self, state: TopKState) -> bool:
        return bool(state.step) and state.step % REFRESH_STEPS == 0

    def refresh(self, state: TopKState, device: torch.device) -> None:
        """Refresh on its own (no step controller): the slowest rank's window, by one all-reduce read on the
        host inside the hook. With a controller the window rides on its per-step all-reduce instead."""
        vec = torch.tensor(self.take_window(), dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=state.process_group)
        self.apply_refresh(state, vec.cpu().tolist())

    def apply_refresh(self, state: TopKState, window: List[float]) -> None:
        """Re-fit selection cost and link-time scale from ``window`` (the same on every rank, see
        :meth:`take_window`); re-decide every bucket."""
        per, ratio = window
        m = self.model
        if per > 0:
            m.select_per_elem = 0.5 * (m.select_per_elem + per)
        if ratio > 0:
            m.comm_scale = min(4.0, max(0.25, m.comm_scale * ratio))
        self.refreshes += 1
        vb = packed_nbytes(1, state.config.wire_dtype) - 4
        for key, (old, _) in list(self.choices.items()):
            n, k = (int(x) for x in key.rsplit("#", 2)[1:])
            penalty = state.config.auto_sparse_penalty
            best, pred = m.choose(n, k, self.candidates, vb, penalty)
            score = {c: t * (penalty if c in SPARSE else 1.0) for c, t in pred.items()}
            if best != old and score[best] < SWITCH_GAIN * score[old]:
                self.choices[key] = (best, pred[best])
                state.plan[key] = best
                if self.rank == 0:
                    log.info("topk_ddp exchange=auto: bucket of %d entries switches %s -> %s (predicted ms: %s)",
                             n, old, best, ", ".join(f"{c} {1e3 * t:.2f}" for c, t in pred.items()))

    def begin_step(self, state: TopKState, device: torch.device) -> None:
        """First bucket of an exchange: account the previous one (complete by now); without a step
        controller, refresh here when due."""
        if state.step:
            last = state.last.resolve(ready_only=True)  # CUDA: only the event pairs already done, no wait
            w = self._window
            w[0] += last.select_time_s
            w[1] += self._step[1]
            w[2] += last.comm_time_s
            w[3] += self._step[0]
        self._step = [0.0, 0.0]
        if not self.controlled and self.refresh_due(state):
            self.refresh(state, device)


def plan_key(names, n: int, k: int) -> str:
    return "|".join(names) + f"#{n}#{k}"


def auto_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for ``exchange="auto"``: each bucket travels the way the cost model predicts fastest."""
    a: AutoExchange = state.auto
    grad = bucket.buffer()
    n = grad.numel()
    stats = state.current
    if stats.buckets == 0:
        a.begin_step(state, grad.device)
    k = bucket_k(state, n)
    params = bucket.parameters()
    names = state.names_of(params)
    if k == 0:  # dense schedule step or small bucket: the flat hook's all-reduce, as ever
        choice = "dense"
        comp, comm = a.model.predict("dense", n, 0)
        predicted = comp + comm
    else:
        choice, predicted, comm = a.decide(state, plan_key(names, n, k), n, k)
        if choice not in ("dense", "dense_bf16"):
            a._step[1] += n
    stats.predicted_s += predicted
    a._step[0] += comm
    # A bucket that leaves an exchange first lets that exchange's collectives finish; its owner residual
    # (scale-free exchanges) goes back into the rank residuals, never lost.
    numels = [p.numel() for p in params]
    if choice != "scatter":
        flush_scatter(state)
        if state.owner_residuals:
            group = state.process_group if state.process_group is not None else dist.group.WORLD
            fold_live_owner(state, bucket_key(dist.get_world_size(group), dist.get_rank(group), names, numels))
    if state.hier is not None:
        if choice not in HIERARCHICAL_EXCHANGES:
            flush_pending(state)
        if choice != "hierarchical_scatter" and state.owner_residuals:
            h = state.hier.groups
            fold_live_owner(state, bucket_key(h.num_nodes, h.node_rank, names, numels, h.local_rank, h.local_world))
    if choice in ("dense", "dense_bf16"):
        fut = dense_hook(state, bucket, torch.bfloat16 if choice == "dense_bf16" else torch.float32)
    elif choice == "allgather":
        fut = topk_allgather_hook(state, bucket)
    elif choice == "hierarchical":
        fut = hierarchical_topk_hook(state, bucket)
    elif choice == "hierarchical_scatter":
        fut = hierarchical_scatter_topk_hook(state, bucket)
    else:
        fut = scatter_topk_hook(state, bucket)
    if bucket.is_last() and choice not in ("scatter", "hierarchical_scatter"):
        fold_pending_owner(state)  # (the scale-free hooks do it themselves; twice would fold what they claimed)
    return fut


def candidates_for(config, nodes: int, local: int, hierarchical_groups: bool) -> List[str]:
    """The exchanges ``auto`` may use under these options (see TopKConfig for the precedence)."""
    out = ["dense", "dense_bf16", "allgather"]
    if config.hierarchical is not False and hierarchical_groups and nodes > 1 and local > 1 \
            and not config.momentum_correction and config.selection_scope == "bucket":
        out += ["hierarchical", "hierarchical_scatter"]
    if not config.momentum_correction and nodes * local > 1:
        out.append("scatter")
    return out
