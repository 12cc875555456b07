"""``mode="auto"``: per-step top-k or sparse local SGD, chosen from the inter-node link and a step's compute.

A pure function (:func:`choose_mode`) of the layout, the parameter count, the link (a :class:`~lightning_topk.comm.cost.CostModel`
whose inter-node tier is the measured or assumed link) and a step's compute seconds: the same inputs give the same
choice on every rank and in every run. Each candidate's score is its predicted time to a target accuracy, relative:

    score = penalty(candidate) x (compute_s + communication seconds per step)

* per-step top-k (``density`` as configured): what ``exchange="auto"`` would send each DDP bucket by, predicted
  by the cost model; penalty 1 (the reference);
* sparse local SGD with the settings of a registered preset (:data:`LOCAL_CANDIDATES`): the outer round's
  all-gather of each node's packet over the inter-node link, plus the outer selection, over ``local_steps``
  inner steps, plus the node's dense all-reduce every inner step where a node has several processes.

The penalties (:data:`MODE_PENALTY`) are steps to the target of each mode over the per-step exchange's, measured
on the namespace cluster. Local SGD is chosen only where its score beats the per-step one by ``TIE_MARGIN``
(near ties stay per-step, the mode with the better accuracy per sample).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_topk.comm.cost import BOOKKEEPING_PASSES, DDP_DEFAULT_BUCKET_CAP_MB, TIE_MARGIN, CostModel
from lightning_topk.comm.local.codec import wire_bytes_per_param
from lightning_topk.comm.schedule import DensitySchedule

# The sparse local SGD settings the rule chooses between: the registered presets (lightning/registry.py's
# LOCAL_DEFAULTS and WAN_DEFAULTS; a test checks they agree), the only ones whose time to accuracy was measured
# against the per-step exchange.
LOCAL_CANDIDATES: Dict[str, Dict[str, float]] = {
    "topk_local": dict(local_steps=16, outer_density=0.1, outer_value_bits=4),
    "topk_local_wan": dict(local_steps=64, outer_density=0.02, outer_value_bits=2),
}
# Steps to 80% test accuracy over the per-step exchange's (rho = 0.01, exchange="auto", recipe="auto" for SGD
# momentum 0.9), the same 11.3M-parameter MNIST-5k model, data and seeds, 4x1 and 2x2 on the namespace cluster
# (BENCHMARKS.md, "Sparse local SGD"; evaluation every 8 steps). The per-step exchange took 24 steps
# (benchmarks/results/cluster_local_2026-11-27_100mbit_rounds.md 4x1, cluster_local_2026-11-27_2x2_100mbit.md
# 2x2); topk_local 32 at 4x1 and 2x2 (the same files; cluster_local_2026-11-27_outer_exchange.md 4x1): 32/24;
# topk_local_wan 56 at 4x1 (cluster_local_2026-11-27_outer_exchange.md, 100 and 10 Mbit/s;
# cluster_local_2026-11-27_wan_owner4bit.md) and 32 at 2x2: the worse, 56/24.
MODE_PENALTY: Dict[str, float] = {"per_step": 1.0, "topk_local": 32 / 24, "topk_local_wan": 56 / 24}
# With Adam/AdamW (the frontier LM: a 7.2M-parameter byte-level decoder, AdamW lr 0.002 under warm-up + cosine, 2x2,
# evaluation every 8 steps; BENCHMARKS.md, "A longer run past the plateau"): topk_local reached held-out loss 3.0 in
# 40 steps against the per-step exchange's 48 (100 Mbit/s) and 56 (1 Gbit/s, where exchange="auto" sent more
# buckets dense), and 2.8 in 72 steps against 72: no penalty, and 1 (not the 0.71-0.83 of the 3.0 target) is the
# reading that does not favour local SGD. topk_local_wan was not measured past the byte-unigram plateau with AdamW:
# SGD's figure stands.
ADAM_MODE_PENALTY: Dict[str, float] = {"per_step": 1.0, "topk_local": 1.0, "topk_local_wan": 56 / 24}
# A step's compute (forward, backward, optimizer) estimated from a dense pass over the parameters:
# STEP_COMPUTE_FIXED + STEP_COMPUTE_PASSES x numel x pass_per_elem. Calibrated on the cluster model: its
# no-communication steps took 0.102-0.142 s (11.3M parameters, batch 32; BENCHMARKS.md, the `local` entries of
# 2026-11-27), and 20 passes at the CPU constant's 0.5 ns per entry are 0.113 s. The fixed part is the
# framework's per-step overhead (a Lightning step of a tiny model).
STEP_COMPUTE_PASSES = 20.0
STEP_COMPUTE_FIXED = 5e-3
# Local SGD is a candidate only on links below this (Gbit/s) unless mode="local": it was measured ahead of the
# per-step exchange at 100 and 10 Mbit/s (the files above) and not measured at 1 Gbit/s or more, where the per-step
# exchange was first to the target among the per-step modes (cluster_defaults_2026-11-27.md, cluster_1gbit_2026-11-25.md)
# and loses less accuracy per sample (docs/local_sgd.md, "When to use which mode"). The penalties are not
# extrapolated past the measurements.
LOCAL_MAX_GBPS = 1.0
# With Adam/AdamW local SGD was measured first at 1 Gbit/s too (the frontier LM's 2x2 cell past the plateau:
# topk_local 96 s to loss 3.0, dense HSDP 111 s, per step 162 s). A nominal 1 Gbit/s tbf link measures 0.99-1.01
# Gbit/s at setup, so the bound sits a tie margin above the rate measured, not on it.
ADAM_LOCAL_MAX_GBPS = 1.0 * (1 + TIE_MARGIN)


def estimate_compute(numel: int, pass_per_elem: float) -> float:
    """Seconds of one training step's compute, estimated from the parameter count (see :data:`STEP_COMPUTE_PASSES`)."""
    return STEP_COMPUTE_FIXED + STEP_COMPUTE_PASSES * numel * pass_per_elem


@dataclass(frozen=True)
class ModeChoice:
    """What ``mode="auto"`` chose and why.

    ``mode``: ``"per_step"`` or ``"local"``; ``preset``: the local SGD settings' preset name (None per step);
    ``options``: the options it sets (empty per step); ``scores``: each candidate's relative time to the target
    (seconds per step x penalty); ``reason``: the choice in words; ``inputs``: the figures it was made from."""

    mode: str
    preset: Optional[str] = None
    options: Dict[str, float] = field(default_factory=dict)
    scores: Dict[str, float] = field(default_factory=dict)
    reason: str = ""
    inputs: Dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log and the run summary."""
        if self.mode == "local":
            o = self.options
            what = (f"sparse local SGD ({self.preset or 'as set'}: {int(o['local_steps'])} local steps, outer density "
                    f"{o['outer_density']:g}, {int(o['outer_value_bits'])}-bit values)")
        else:
            what = "per-step top-k exchange"
        return f"mode={self.mode!r}: {what}; {self.reason}"


def buckets_of(numel: int, cap_mb: float = DDP_DEFAULT_BUCKET_CAP_MB, elem_bytes: int = 4) -> List[int]:
    """``numel`` fp32 entries in DDP-sized buckets (the last one the remainder)."""
    per = max(1, int(cap_mb * (1 << 20)) // elem_bytes)
    return [per] * (numel // per) + ([numel % per] if numel % per else [])


def per_step_seconds(model: CostModel, sizes: Sequence[int], density: float, candidates: Sequence[str],
                     value_bytes: int, sparse_penalty: float, min_sparse_numel: int = 0) -> float:
    """Exchange seconds of one step: each bucket by the exchange ``exchange="auto"`` picks for it (its prediction)."""
    total = 0.0
    for n in sizes:
        if density >= 1.0 or n < min_sparse_numel:
            total += model.total("dense", n, 0)
            continue
        k = max(1, math.ceil(density * n))
        choice, pred = model.choose(n, k, list(candidates), value_bytes, sparse_penalty)
        total += pred[choice]
    return total


def local_seconds(model: CostModel, numel: int, local_steps: int, outer_density: float, outer_value_bits: int,
                  outer_chunk: int = 4096) -> float:
    """Communication seconds per inner step of sparse local SGD: the outer round (each node's packet all-gathered
    over the inter-node link, and the selection over each rank's shard) over ``local_steps``, plus the node's
    dense fp32 all-reduce every inner step where it has several processes."""
    nodes, local = model.nodes, model.local
    packet = wire_bytes_per_param(outer_density, outer_value_bits, outer_chunk) * numel
    inter = model.flat()
    link = (nodes - 1) * (inter.alpha + packet / inter.beta) if nodes > 1 else 0.0
    shard = numel / local
    compute = model.select(shard) + BOOKKEEPING_PASSES * model.pass_per_elem * shard
    intra = model.tier(model.intra).allreduce(4 * numel, local) if local > 1 else 0.0
    return intra + (link * model.comm_scale + compute) / local_steps


def warmup_seconds(model: CostModel, sizes: Sequence[int], density: float, candidates: Sequence[str],
                   value_bytes: int, sparse_penalty: float, min_sparse_numel: int = 0, *, dense_steps: int,
                   warmup_steps: int, warmup_start: float = 0.25) -> float:
    """Exchange seconds the per-step mode spends in its first ``dense_steps`` + ``warmup_steps`` steps (dense, then
    the density warm-up of :class:`~lightning_topk.comm.schedule.DensitySchedule`) beyond what as many steps at
    ``density`` take: a fixed cost of the run (the AdamW recipe's, :data:`lightning_topk.comm.recipe.ADAM_DENSE_STEPS`
    and ``ADAM_WARMUP_STEPS``)."""
    sched = DensitySchedule(density, dense_steps=dense_steps, warmup_steps=warmup_steps, warmup_start=warmup_start)
    at: Dict[float, float] = {}
    for t in range(dense_steps + warmup_steps):
        d = sched.density_at(t)
        if d not in at:
            at[d] = per_step_seconds(model, sizes, d, candidates, value_bytes, sparse_penalty, min_sparse_numel)
    steady = per_step_seconds(model, sizes, density, candidates, value_bytes, sparse_penalty, min_sparse_numel)
    return sum(at[sched.density_at(t)] - steady for t in range(dense_steps + warmup_steps))


def choose_mode(model: CostModel, numel: int, compute_s: float, *, density: float, candidates: Sequence[str],
                value_bytes: int, sparse_penalty: float, min_sparse_numel: int = 0,
                allowed: Tuple[str, ...] = ("per_step", "local"),
                penalties: Optional[Dict[str, float]] = None, per_step_fixed_s: float = 0.0,
                horizon: Optional[int] = None, note: str = "", local_max_gbps: float = LOCAL_MAX_GBPS) -> ModeChoice:
    """Per-step top-k or sparse local SGD (and which preset's settings) for ``numel`` parameters on the layout and
    link of ``model``, with ``compute_s`` seconds of compute per step (see the module docstring). ``allowed``:
    ``("local",)`` chooses among the local SGD settings only. ``penalties``: in place of :data:`MODE_PENALTY`'s
    (:data:`ADAM_MODE_PENALTY` for Adam). ``per_step_fixed_s``: seconds the per-step mode spends once (its recipe's
    dense steps and density warm-up, :func:`warmup_seconds`), spread over ``horizon`` steps (the run's ``max_steps``;
    None: a run long enough that it vanishes). ``note``: added to the reason. ``local_max_gbps``: local SGD is a
    candidate on slower links only (:data:`LOCAL_MAX_GBPS`; :data:`ADAM_LOCAL_MAX_GBPS` for Adam). A pure function of
    its arguments."""
    if numel < 1 or not compute_s >= 0:
        raise ValueError(f"choose_mode: needs numel >= 1 and compute_s >= 0, got {numel!r}, {compute_s!r}")
    pen = dict(MODE_PENALTY, **(penalties or {}))
    per_step = compute_s + per_step_seconds(model, buckets_of(numel), density, candidates, value_bytes,
                                            sparse_penalty, min_sparse_numel)
    if per_step_fixed_s > 0 and horizon:
        per_step += per_step_fixed_s / horizon
    scores: Dict[str, float] = {}
    if "per_step" in allowed:
        scores["per_step"] = pen["per_step"] * per_step
    if "local" in allowed:
        for name, o in LOCAL_CANDIDATES.items():
            step = compute_s + local_seconds(model, numel, int(o["local_steps"]), o["outer_density"],
                                             int(o["outer_value_bits"]))
            scores[name] = pen[name] * step
    link_gbps = model.flat().beta * 8 / 1e9
    inputs = dict(link_gbps=link_gbps, compute_ms=1e3 * compute_s, numel=float(numel), nodes=float(model.nodes),
                  local=float(model.local))
    figures = ", ".join(f"{n} {1e3 * s:.1f}" for n, s in scores.items())
    basis = (f"{link_gbps:.3g} Gbit/s between nodes, {1e3 * compute_s:.1f} ms compute per step; predicted ms per step "
             f"x measured steps-to-target penalty: {figures}{note}")
    if "per_step" in scores and link_gbps >= local_max_gbps:
        return ModeChoice("per_step", None, {}, scores, f"local SGD is a candidate below {local_max_gbps:g} Gbit/s "
                          f"only (not measured ahead on faster links) ({basis})", inputs)
    best_local = min((n for n in scores if n != "per_step"), key=lambda n: scores[n], default=None)
    if best_local is not None and ("per_step" not in scores
                                   or scores[best_local] * (1 + TIE_MARGIN) < scores["per_step"]):
        return ModeChoice("local", best_local, dict(LOCAL_CANDIDATES[best_local]), scores,
                          f"local SGD is predicted first to the target ({basis})", inputs)
    return ModeChoice("per_step", None, {}, scores, f"per-step is predicted first to the target, or within "
                      f"{TIE_MARGIN:.0%} ({basis})", inputs)
