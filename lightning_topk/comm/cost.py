"""Alpha-beta cost model of the exchanges: link tiers, the probe that measures them, the timing-free
constants, and the choice between candidates (used by ``exchange="auto"``, :mod:`lightning_topk.comm.exchanges.auto`).

Each link tier (intra-node, inter-node) is a latency ``alpha`` (s per message) and a bandwidth ``beta``
(bytes/s), fitted at setup from timed all-reduces of two sizes; selection (on synthetic gradient-like
data of two sizes), one dense pass and a random-place ``index_add_`` (rebuilds) are timed too. Every
rank measures, the slowest figure wins (one all-reduce), so every rank holds the same model. Without
timing (:func:`constant_model`) the figures are :data:`CONSTANTS` and ``auto_link_gbps``.

Each exchange owns its formula (``Exchange.predict`` in its module, :mod:`lightning_topk.comm.exchanges`):
per bucket of ``n`` entries with ``k`` to send on ``P = N x L`` ranks (N nodes, L per node), compute +
link seconds. Flat collectives across nodes are limited by the inter-node tier (a node-major ring
crosses each node's link once per step). :meth:`CostModel.choose` scores each candidate by its
prediction, a sparse one's times the sparse penalty (top-k needs more steps to an accuracy: ``auto_sparse_penalty``,
or the measured table :data:`SPARSE_PENALTY` by density and recipe), and
breaks near ties (``TIE_MARGIN``) by a fixed order (``TIE_ORDER``), never by timing noise.
"""
import functools
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import lightning_topk.comm.selection as selection
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.selection import topk_select
from lightning_topk.comm.sync_free import sync_free_enabled, topk_select_sync_free
from lightning_topk.comm.wire import sparse_nbytes

log = logging.getLogger(__name__)

CHOICES = ("dense", "dense_bf16", "allgather", "hierarchical", "hierarchical_scatter", "scatter")
SPARSE = ("allgather", "hierarchical", "hierarchical_scatter", "scatter")
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

    def flat(self) -> Link:
        """The tier that limits flat collectives: inter-node across nodes, else intra-node."""
        return self.tier(self.inter if self.nodes > 1 else self.intra)

    @staticmethod
    def tier(link: Optional[Link]) -> Link:
        if link is None:
            raise ValueError("cost model: no link measured for this tier (one node / one process per node)")
        return link

    def select(self, n: float) -> float:
        return self.select_fixed + self.select_per_elem * n

    def predict(self, choice: str, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        """(compute seconds, link seconds) of one bucket: the registered exchange's own formula."""
        if choice not in registry.names():
            raise ValueError(f"cost model: unknown exchange {choice!r}; allowed: {list(registry.names())}")
        comp, comm = registry.get(choice).predict(self, n, k, value_bytes)
        return comp, comm * self.comm_scale

    def total(self, choice: str, n: int, k: int, value_bytes: int = 4) -> float:
        return sum(self.predict(choice, n, k, value_bytes))

    def choose(self, n: int, k: int, candidates: List[str], value_bytes: int = 4,
               sparse_penalty: float = 1.0) -> Tuple[str, Dict[str, float]]:
        """The chosen candidate and every candidate's predicted seconds.

        A sparse candidate's score is its prediction times ``sparse_penalty`` (top-k needs more steps than
        a dense all-reduce for the same accuracy; see ``TopKConfig.sparse_penalty``), a dense one's is
        its prediction. Every candidate within ``TIE_MARGIN`` of the best score ties, and the first of
        ``TIE_ORDER`` among them is chosen, so measurement noise between near-equal candidates cannot flip
        the choice from run to run."""
        pred = {c: self.total(c, n, k, value_bytes) for c in candidates}
        score = {c: p * (sparse_penalty if c in SPARSE else 1.0) for c, p in pred.items()}
        return tie_break(score), pred

    def wire(self, choice: str, n: int, k: int, value_bytes: int = 4) -> float:
        """Bytes one rank puts on the wire (flat collectives; hierarchical ones: their inter-node part)."""
        return registry.get(choice).wire(self, n, k, value_bytes)

    def to_dict(self) -> Dict[str, Any]:
        """Plain types only (saved in checkpoints; :meth:`from_dict` inverts it)."""
        return asdict(self)

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "CostModel":
        d = dict(d)
        for tier in ("intra", "inter"):
            d[tier] = None if d.get(tier) is None else Link(**d[tier])
        return CostModel(**d)


# Steps to the target of a sparse run over a dense one's (the same seeds), per recipe and density:
# benchmarks/convergence.py on MNIST-5k (MLP, 4 simulated ranks, steps to 90% test accuracy, mean of 3 seeds,
# 5 for the lookahead row; every run reached it within its 500 steps; docs/convergence.md, BENCHMARKS.md).
# "error_feedback": AdamW (what recipe="auto" leaves on plain error feedback; SGD without the recipe measured
# 1.58 and 2.67); "momentum_correction": SGD with its momentum moved into the hook, with momentum-factor
# masking; "momentum_correction_unmasked": the same without the masking; "momentum_lookahead": unmasked, with
# momentum_lookahead = momentum = 0.9 (what recipe="auto" runs for SGD with momentum).
SPARSE_PENALTY: Dict[str, Dict[float, float]] = {
    "error_feedback": {1.0: 1.0, 0.01: 2.20, 0.001: 4.20},
    "momentum_correction": {1.0: 1.0, 0.01: 1.71, 0.001: 1.83},
    "momentum_correction_unmasked": {1.0: 1.0, 0.01: 1.30, 0.001: 2.09},
    "momentum_lookahead": {1.0: 1.0, 0.01: 1.09, 0.001: 1.66},
}


def sparse_penalty(density: float, recipe: str = "error_feedback") -> float:
    """``exchange="auto"``'s factor on sparse exchanges when ``auto_sparse_penalty`` is not set: the measured
    steps-to-target ratio of ``recipe`` (a key of :data:`SPARSE_PENALTY`), interpolated linearly in
    log-density between the measured densities, held at the end values outside them; never below 1. A
    pure function of the configuration: the same on every rank and in every run."""
    if recipe not in SPARSE_PENALTY:
        raise ValueError(f"sparse_penalty: recipe must be one of {list(SPARSE_PENALTY)}, got {recipe!r}")
    pts = sorted(SPARSE_PENALTY[recipe].items())
    d = min(max(density, pts[0][0]), pts[-1][0])
    for (d0, p0), (d1, p1) in zip(pts, pts[1:]):
        if d0 <= d <= d1:
            t = (math.log(d) - math.log(d0)) / (math.log(d1) - math.log(d0))
            return max(1.0, p0 + t * (p1 - p0))
    return max(1.0, pts[-1][1])


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
def _once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _timed(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """The best of ``reps`` timed calls after one warm-up call."""
    _once(fn, device)
    return min(_once(fn, device) for _ in range(reps))


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


def measure_link(device: torch.device, group=None) -> Link:
    """This rank's fit of the link tier of ``group`` (default: the world; a ring across nodes is limited by the
    inter-node link) from timed all-reduces of two sizes (a collective: every rank of the group calls it)."""
    small, large, size, _ = _link_times(group, device)
    return Link.fit((small, large), (_PROBE_BYTES[0], size), dist.get_world_size(group))


def measure_pass(device: torch.device) -> float:
    """Seconds per entry of one dense pass (``y = x + 0.5 x``) on ``device``, timed on this rank alone."""
    x = torch.randn(_PROBE_NUMELS[1], generator=torch.Generator(device="cpu").manual_seed(0)).to(device)
    y = torch.empty_like(x)
    return _timed(lambda: torch.add(x, x, alpha=0.5, out=y), device) / _PROBE_NUMELS[1]


def _select_time(x: torch.Tensor, scale: torch.Tensor, k: int, selector: str, device: torch.device,
                 g: torch.Generator, reps: int = 2) -> float:
    """Seconds of one selection of ``k`` from ``x`` as a training step pays it. The exact selector on the host
    path keeps a threshold hint per bucket between steps (:class:`~lightning_topk.comm.selection.ThresholdHint`),
    so it is timed with a warm hint on an input that drifts between calls as a residual does
    (``x <- 0.9 x + sqrt(0.19) scale * noise``, each entry keeping its ``scale``: ``benchmarks/bench_select.py``'s
    reuse table); timing it without one overstated selection (issue 22)."""
    if sync_free_enabled(device):
        return _timed(functools.partial(topk_select_sync_free, x, k, selector), device, reps=reps)
    if selector != "exact" or not selection.THRESHOLD_REUSE:
        return _timed(functools.partial(topk_select, x, k, selector), device, reps=reps)
    hint = selection.ThresholdHint()
    best = math.inf
    for i in range(reps + 1):
        if i:
            x.mul_(0.9).add_(torch.randn(x.numel(), generator=g).to(device).mul_(scale), alpha=0.19 ** 0.5)
        t = _once(lambda: topk_select(x, k, "exact", hint), device)
        if i:  # the first call only fills the hint
            best = min(best, t)
    return best


def _compute_times(density: float, selector: str, device: torch.device) -> List[float]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for n in _PROBE_NUMELS:
        scale = torch.randn(n, generator=g).exp().to(device)
        x = torch.randn(n, generator=g).to(device).mul_(scale)
        k = max(1, math.ceil(density * n))
        out.append(_select_time(x, scale, k, selector, device, g))
    x = torch.randn(_PROBE_NUMELS[1], generator=g).to(device)  # never the user's RNG streams
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


# ---- bucket size for overlap with the backward pass -------------------------------------------------
# Caps (MiB) the rule chooses from: DDP's own default (25) and powers of two below it, down to DDP's
# 1 MiB first bucket.
BUCKET_CAP_LADDER_MB = (1, 2, 4, 8, 16, 25)
DDP_DEFAULT_BUCKET_CAP_MB = 25
DDP_FIRST_BUCKET_MB = 1  # DDP's first bucket when bucket_cap_mb is not set
BACKWARD_PASSES = 2  # a parameter's backward pass at least writes its gradient and reads its weight
# A cap replaces DDP's default layout only where its predicted end is at least this much earlier: one more
# bucket costs a collective round trip that the model's alpha understates on a loaded CPU (measured:
# BENCHMARKS.md, "Overlap with the backward pass").
BUCKET_MIN_GAIN = 0.15
_MIB = 1 << 20


@dataclass(frozen=True)
class BucketPlan:
    """The bucket cap the rule chose (:func:`choose_bucket_cap`; None: DDP's default layout is kept), the
    buckets it gives (entries, in the order their gradients arrive), and each candidate's predicted end of
    the exchange in seconds (key None: DDP's default layout)."""

    cap_mb: Optional[int]
    buckets: Tuple[int, ...]
    scores: Dict[Optional[int], float]
    exchange: str

    @property
    def last_bucket(self) -> int:
        """Entries of the last bucket to arrive: its exchange starts after the whole backward pass."""
        return self.buckets[-1] if self.buckets else 0


def ddp_buckets(numels: List[int], cap_mb: Optional[float], elem_bytes: int = 4) -> List[int]:
    """Entries per bucket as DDP lays them out after its rebuild: parameters in the order their gradients
    arrive (``numels``, backward order) fill a bucket until it holds at least its limit (a parameter is never
    split, so one larger than the limit makes a bucket of its own). ``cap_mb`` set: every limit is the cap;
    None (DDP's default): 1 MiB for the first bucket, then 25 MiB."""
    limits = [cap_mb * _MIB] if cap_mb is not None else [DDP_FIRST_BUCKET_MB * _MIB, DDP_DEFAULT_BUCKET_CAP_MB * _MIB]
    out: List[int] = []
    cur = 0
    for n in numels:
        cur += n
        if cur * elem_bytes >= limits[min(len(out), len(limits) - 1)]:
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


def choose_bucket_cap(numels: List[int], density: float, model: CostModel, exchange: str = "allgather", *,
                      min_sparse_numel: int = 0, value_bytes: int = 4, elem_bytes: int = 4,
                      ladder: Tuple[int, ...] = BUCKET_CAP_LADDER_MB) -> BucketPlan:
    """The DDP ``bucket_cap_mb`` under which the sparse exchange best overlaps the backward pass, or None
    where DDP's default layout is as good.

    ``numels``: the parameters' entries in the order their gradients arrive (backward order, i.e. the
    reverse of ``module.parameters()`` for a sequential model). For DDP's default layout and for each cap of
    ``ladder`` the buckets are laid out as DDP does (:func:`ddp_buckets`) and one backward pass is simulated:
    the gradients of a bucket take ``BACKWARD_PASSES`` dense passes over its entries (a lower bound), then
    its hook runs the exchange's compute (selection, bookkeeping) on the same thread, and its collective
    (``exchange``'s link time in ``model``; dense below ``min_sparse_numel`` entries or where sparse would
    not be smaller) starts once the link is free. The score is when the last collective ends: the last
    bucket's exchange starts only after the whole backward pass, so a small last bucket and a pipeline of
    selection and link score best, and many small buckets pay their fixed costs. The best cap (the largest
    among equal scores) replaces DDP's default only where it ends at least ``BUCKET_MIN_GAIN`` earlier. A pure
    function: the same sizes, density, model and ladder give the same plan on every rank and in every run.
    """
    if not numels or any(not isinstance(n, int) or n < 0 for n in numels):
        raise ValueError(f"choose_bucket_cap: numels must be a non-empty list of ints >= 0, got {numels!r}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"choose_bucket_cap: density must be in (0, 1], got {density!r}")
    if not ladder or any(c <= 0 for c in ladder):
        raise ValueError(f"choose_bucket_cap: ladder must be caps > 0 (MiB), got {ladder!r}")
    if model.world < 2:
        raise ValueError(f"choose_bucket_cap: needs at least 2 ranks (the model has {model.world}); one process "
                         "exchanges nothing")

    def exchange_times(n: int) -> Tuple[float, float]:
        k = max(1, math.ceil(density * n))
        if density >= 1.0 or n < min_sparse_numel or sparse_nbytes(n, k, value_bytes) >= elem_bytes * n:
            return model.predict("dense", n, 0)
        return model.predict(exchange, n, k, value_bytes)

    def simulate(buckets: List[int]) -> float:
        thread = link = 0.0
        for n in buckets:
            thread += BACKWARD_PASSES * model.pass_per_elem * n
            comp, comm = exchange_times(n)
            thread += comp
            link = max(thread, link) + comm
        return max(thread, link)

    scores: Dict[Optional[int], float] = {}
    layouts: Dict[Optional[int], List[int]] = {}
    for cap in [None, *sorted(set(ladder))]:
        layouts[cap] = ddp_buckets(list(numels), cap, elem_bytes)
        scores[cap] = simulate(layouts[cap])
    caps = [c for c in scores if c is not None]
    best = min(scores[c] for c in caps)
    pick: Optional[int] = max(c for c in caps if scores[c] <= best * (1 + 1e-9))
    if scores[pick] > (1 - BUCKET_MIN_GAIN) * scores[None]:
        pick = None
    return BucketPlan(pick, tuple(layouts[pick]), scores, exchange)
