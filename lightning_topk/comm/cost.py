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
the entries travel changes (``dense`` sends them all).

**One plan, the same on every rank and in every run that asks for it.** The plan maps a bucket *size*
(its number of entries) to an exchange, decided once for the configured ``density`` (not per warm-up
k), so it holds one entry per distinct bucket size and does not depend on DDP's bucket layout. Near
ties never depend on timing noise: every candidate whose score is within ``TIE_MARGIN`` of the best
one competes, and the first of ``TIE_ORDER`` among them wins (dense fp32 first: it loses nothing).
Where the model comes from (``auto_model``):

* ``"constants"`` (and ``"auto"`` under ``Trainer(deterministic=True)`` /
  ``torch.use_deterministic_algorithms(True)``): no timing at all. The model is built from
  :data:`CONSTANTS` for the device type and ``auto_link_gbps`` for the inter-node link, so the plan is a
  pure function of the bucket sizes, the layout and the options, and it is never refreshed;
* ``"probe"`` (and ``"auto"`` otherwise): probed at setup, every rank measures and the slowest figure wins
  (one all-reduce), so every rank holds the same model. Every ``REFRESH_STEPS`` exchanges the model is
  refreshed from telemetry: selection cost per entry from the measured selection time, and a link-time
  scale from measured over predicted exchange time (the mean over ranks, carried by the step
  controller's one all-reduce per step, so the hooks read nothing on the host; without a controller, the
  slowest rank's, by an all-reduce of its own); a bucket switches algorithm only when the new choice's
  score is at least ``SWITCH_GAIN`` better.

The plan and the model are saved in the rank-independent part of a checkpoint (rank 0 writes it and
every rank reads it), so a resumed run restores one plan on every rank whatever each rank's residual
shard holds, and does not probe again. Predictions and measured times are logged as
``topk/predicted_ms`` and ``topk/measured_ms``.
"""
import functools
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lightning_topk.comm.allgather import (
    bucket_k,
    dense_hook,
    topk_allgather_hook,
)
from lightning_topk.comm.hierarchical import (
    HierExchange,
    HierGroups,
    flush_pending,
    hierarchical_scatter_topk_hook,
    hierarchical_topk_hook,
)
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
# Candidates within this share of the best score tie; the first of TIE_ORDER among them wins. Dense fp32
# first (exact), then bf16, then the exchanges whose bytes grow least with the number of ranks.
TIE_MARGIN = 0.15
TIE_ORDER = ("dense", "dense_bf16", "scatter", "hierarchical_scatter", "hierarchical", "allgather")
# The timing-free model (auto_model="constants", or "auto" under deterministic algorithms): link tiers as
# (alpha seconds per message, beta bytes per second) and per-entry compute costs per device type, set from
# the figures measured on this project's machines (BENCHMARKS.md: a 2-core x86 CPU with gloo; an H100-class
# GPU for "cuda" from published NCCL/NVLink figures). The inter-node tier is (INTER_ALPHA, auto_link_gbps).
CONSTANTS: Dict[str, Dict[str, Any]] = {
    "cpu": dict(intra=(50e-6, 2e9), select_per_elem=2.6e-9, select_fixed=1e-4, pass_per_elem=0.5e-9,
                add_per_entry=20e-9, bf16_factor=1.0),
    "cuda": dict(intra=(10e-6, 100e9), select_per_elem=0.02e-9, select_fixed=50e-6, pass_per_elem=0.005e-9,
                 add_per_entry=0.2e-9, bf16_factor=0.5),
}
INTER_ALPHA = 50e-6
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
        """The chosen candidate and every candidate's predicted seconds.

        A sparse candidate's score is its prediction times ``sparse_penalty`` (top-k needs more steps than
        a dense all-reduce for the same accuracy; see ``TopKConfig.auto_sparse_penalty``), a dense one's is
        its prediction. Every candidate within ``TIE_MARGIN`` of the best score ties, and the first of
        ``TIE_ORDER`` among them is chosen, so measurement noise between near-equal candidates cannot flip
        the choice from run to run."""
        pred = {c: self.total(c, n, k, value_bytes) for c in candidates}
        score = {c: p * (sparse_penalty if c in SPARSE else 1.0) for c, p in pred.items()}
        return tie_break(score), pred

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


    def to_dict(self) -> Dict[str, Any]:
        """Plain types only (saved in checkpoints; :meth:`from_dict` inverts it)."""
        return asdict(self)

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "CostModel":
        d = dict(d)
        for tier in ("intra", "inter"):
            d[tier] = None if d.get(tier) is None else Link(**d[tier])
        return CostModel(**d)


def tie_break(score: Dict[str, float]) -> str:
    """The first candidate of ``TIE_ORDER`` within ``TIE_MARGIN`` of the lowest score."""
    best = min(score.values())
    for c in (*TIE_ORDER, *sorted(score)):
        if c in score and score[c] <= (1 + TIE_MARGIN) * best:
            return c
    raise AssertionError("unreachable")  # the best candidate itself is within the margin


def timed_model(config) -> bool:
    """Whether ``auto`` measures (``auto_model="probe"``, or ``"auto"`` without deterministic algorithms)."""
    if config.auto_model == "auto":
        return not torch.are_deterministic_algorithms_enabled()
    return config.auto_model == "probe"


def constant_model(nodes: int, local: int, device_type: str, link_gbps: float) -> CostModel:
    """The timing-free model: :data:`CONSTANTS` for ``device_type`` (CPU figures for any other device) and
    an inter-node link of ``link_gbps`` Gbit/s."""
    c = CONSTANTS.get(device_type, CONSTANTS["cpu"])
    intra = Link(*c["intra"]) if local > 1 else None
    inter = Link(INTER_ALPHA, link_gbps * 1e9 / 8) if nodes > 1 else None
    return CostModel(nodes, local, intra, inter, c["select_per_elem"], c["select_fixed"], c["pass_per_elem"],
                     c["add_per_entry"], bf16_factor=c["bf16_factor"])


def target_k(config, n: int) -> int:
    """Entries a bucket of ``n`` sends at the configured density: what ``auto`` decides for (not the
    warm-up's larger k, so the plan does not grow during a warm-up)."""
    return max(1, math.ceil(config.density * n))


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
    """The cost model, the candidates, and the plan: the exchange chosen for each bucket size.

    ``timed``: the model came from a probe and is refreshed from telemetry; ``False`` for the constants
    model, which is never refreshed (see the module docstring)."""

    model: CostModel
    candidates: List[str]
    rank: int = 0
    timed: bool = True
    plan: Dict[str, str] = field(default_factory=dict)  # str(bucket entries) -> exchange
    # telemetry since the last refresh: selection seconds and entries, measured and predicted link seconds
    _window: List[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    # the step being exchanged: predicted link seconds and entries of sparse buckets
    _step: List[float] = field(default_factory=lambda: [0.0, 0.0])
    # a StepController carries the refresh on its per-step all-reduce (no host read in the hooks)
    controlled: bool = False
    refreshes: int = 0

    def decide(self, state: TopKState, n: int, k: int) -> Tuple[str, float, float]:
        """(choice, predicted seconds, predicted link seconds) for a bucket of ``n`` entries sending ``k``
        now; the choice is the plan's for this size, decided at the configured density when first seen."""
        vb = packed_nbytes(1, state.config.wire_dtype) - 4
        key = str(n)
        choice = self.plan.get(key)
        if choice is None:
            choice, pred = self.model.choose(n, target_k(state.config, n), self.candidates, vb,
                                             state.config.auto_sparse_penalty)
            self.plan[key] = choice
            if self.rank == 0:
                log.info("topk_ddp exchange=auto: buckets of %d entries -> %s; predicted ms: %s", n, choice,
                         ", ".join(f"{c} {1e3 * t:.2f}" for c, t in pred.items()))
        comp, comm = self.model.predict(choice, n, k, vb)
        return choice, comp + comm, comm

    # ---- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Plain types: the plan, the model and whether it is timed (the rank-independent checkpoint part)."""
        return {"plan": dict(self.plan), "model": self.model.to_dict(), "timed": self.timed,
                "refreshes": self.refreshes}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        """Restore a saved plan (entries whose exchange is no candidate now are dropped) and, for the same
        layout and kind of model, the saved model."""
        if not sd:
            return
        self.plan = {str(k): v for k, v in dict(sd.get("plan", {})).items() if v in self.candidates}
        m = saved_model(sd, self.timed, self.model.nodes, self.model.local)
        if m is not None:
            self.model = m
            self.refreshes = int(sd.get("refreshes", 0))

    # ---- refresh from telemetry (timed models only) ------------------------------------------------
    def take_window(self) -> List[float]:
        """This rank's telemetry since the last refresh: [selection seconds per entry, measured / predicted
        link time] (0 where unknown); the window starts anew."""
        sel_s, sel_n, meas_comm, pred_comm = self._window
        self._window = [0.0, 0.0, 0.0, 0.0]
        return [sel_s / sel_n if sel_n else 0.0, meas_comm / pred_comm if pred_comm > 0 else 0.0]

    def refresh_due(self, state: TopKState) -> bool:
        return self.timed and bool(state.step) and state.step % REFRESH_STEPS == 0

    def refresh(self, state: TopKState, device: torch.device) -> None:
        """Refresh on its own (no step controller): the slowest rank's window, by one all-reduce read on the
        host inside the hook. With a controller the window rides on its per-step all-reduce instead."""
        vec = torch.tensor(self.take_window(), dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=state.process_group)
        self.apply_refresh(state, vec.cpu().tolist())

    def apply_refresh(self, state: TopKState, window: List[float]) -> None:
        """Re-fit selection cost and link-time scale from ``window`` (the same on every rank, see
        :meth:`take_window`); re-decide every bucket size."""
        per, ratio = window
        m = self.model
        if per > 0:
            m.select_per_elem = 0.5 * (m.select_per_elem + per)
        if ratio > 0:
            m.comm_scale = min(4.0, max(0.25, m.comm_scale * ratio))
        self.refreshes += 1
        vb = packed_nbytes(1, state.config.wire_dtype) - 4
        penalty = state.config.auto_sparse_penalty
        for key, old in list(self.plan.items()):
            n = int(key)
            best, pred = m.choose(n, target_k(state.config, n), self.candidates, vb, penalty)
            score = {c: t * (penalty if c in SPARSE else 1.0) for c, t in pred.items()}
            if best != old and score[best] < SWITCH_GAIN * score[old]:
                self.plan[key] = best
                if self.rank == 0:
                    log.info("topk_ddp exchange=auto: buckets of %d entries switch %s -> %s (predicted ms: %s)",
                             n, old, best, ", ".join(f"{c} {1e3 * t:.2f}" for c, t in pred.items()))

    def begin_step(self, state: TopKState, device: torch.device) -> None:
        """First bucket of an exchange: account the previous one (complete by now); without a step
        controller, refresh here when due."""
        if not self.timed:
            self._step = [0.0, 0.0]
            return
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
        choice, predicted, comm = a.decide(state, n, k)
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
        if isinstance(state.hier, HierGroups):
            state.hier = HierExchange(state.hier)
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


def saved_model(sd: Optional[Dict[str, Any]], timed: bool, nodes: int, local: int) -> Optional[CostModel]:
    """The model saved in ``sd`` (:meth:`AutoExchange.state_dict`) if it is of the same kind and layout."""
    m = (sd or {}).get("model")
    if not isinstance(m, dict) or bool((sd or {}).get("timed")) != timed or (m.get("nodes"), m.get("local")) != (nodes, local):
        return None
    try:
        return CostModel.from_dict(m)
    except (TypeError, ValueError):
        return None


def build_auto(config, nodes: int, local: int, rank: int, device: torch.device, intra_group=None,
               inter_group=None, hierarchical_groups: bool = False,
               saved: Optional[Dict[str, Any]] = None) -> AutoExchange:
    """``exchange="auto"`` for this layout: the saved plan and model where ``saved`` (the checkpoint's
    rank-independent section, the same on every rank) has them, else a new model: probed (a collective:
    every rank calls this) or from :data:`CONSTANTS` (see the module docstring)."""
    timed = timed_model(config)
    model = saved_model(saved, timed, nodes, local)
    if model is None:
        model = probe(nodes, local, rank, config.density, config.selector, device, intra_group, inter_group) \
            if timed else constant_model(nodes, local, device.type, config.auto_link_gbps)
    auto = AutoExchange(model, candidates_for(config, nodes, local, hierarchical_groups), rank, timed=timed)
    auto.load_state_dict(saved)
    return auto


def candidates_for(config, nodes: int, local: int, hierarchical_groups: bool) -> List[str]:
    """The exchanges ``auto`` may use under these options (see TopKConfig for the precedence)."""
    out = ["dense", "dense_bf16", "allgather"]
    if config.hierarchical is not False and hierarchical_groups and nodes > 1 and local > 1 \
            and not config.momentum_correction and config.selection_scope == "bucket":
        out += ["hierarchical", "hierarchical_scatter"]
    if not config.momentum_correction and config.selection_scope == "bucket" and nodes * local > 1:
        out.append("scatter")
    return out
