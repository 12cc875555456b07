"""Options of the top-k exchange, by concern: the per-step exchange (:class:`StepOptions`), the cost model of
``exchange="auto"`` (:class:`AutoOptions`), sparse local SGD's outer round (:class:`OuterOptions`) and faults
(:class:`FaultOptions`). Each group documents and checks its own options; :class:`TopKConfig` inherits them all
(flat attributes: ``config.density``, ``config.outer_lr``) and checks the rules between groups.

Imports point down: the exchange registry (:mod:`~lightning_topk.comm.exchanges.registry`, which imports no
exchange) and the cost model's table, nothing that imports this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Tuple, Union

import torch

from lightning_topk.comm.cost import sparse_penalty as measured_sparse_penalty
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.schedule import DensitySchedule
from lightning_topk.comm.selection import METHODS
from lightning_topk.comm.wire import value_dtype_of
from lightning_topk.support import ELASTIC_EXCHANGES, NODE_TIER, OUTER_EXCHANGES, message

SCOPE_CHOICES = ("bucket", "parameter")
NONFINITE_CHOICES = ("raise", "skip", "propagate")
# Exchanges that shard buckets within a node (intra-node reduce-scatter first).
HIERARCHICAL_EXCHANGES = NODE_TIER
OUTER_BITS = (32, 16, 8, 4, 2)  # outer_value_bits (sparse local SGD)
# outer_recipe (sparse local SGD): where unset outer_lr / outer_momentum / outer_nesterov come from
# (lightning_topk/comm/local/outer_step.py: OUTER_RECIPE_TABLE, outer_step_for).
OUTER_RECIPES = ("auto", "diloco", "average")
# Where exchange="auto" gets its cost model (see comm/exchanges/auto.py).
AUTO_MODEL_CHOICES = ("auto", "probe", "constants")
# mode: per-step top-k or sparse local SGD ("auto": chosen from the link, lightning_topk/comm/mode.py).
MODE_CHOICES = ("auto", "per_step", "local")
# The mode options: set to anything but its default, any of these is an explicit choice of mode and its settings,
# so mode="auto" decides nothing (the options run as given). A registered preset (topk_local, topk_local_wan,
# topk_fsdp_local) sets local_steps.
MODE_OPTIONS = ("mode", "local_steps", "density", "exchange", "hierarchical", "momentum_correction", "selection_scope",
                "outer_density", "outer_value_bits", "outer_chunk", "outer_exchange", "outer_streaming", "outer_recipe",
                "outer_lr", "outer_momentum", "outer_nesterov", "outer_ef_decay")
# recipe="auto": the convergence recipe for the user's optimizer (lightning_topk/comm/recipe.py).
RECIPE_CHOICES = ("auto", "none")
# fault_tolerance: "torchft" runs the cross-replica exchange on torchft's reconfigurable process group
# (lightning_topk/lightning/elastic.py, docs/elastic.md).
FAULT_TOLERANCE_CHOICES = ("none", "torchft")
# The exchanges that run over a replica count that changes between steps (fault_tolerance="torchft").


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad(self: object, name: str, allowed: str) -> ValueError:
    return ValueError(f"topk_ddp: {name} must be {allowed}, got {getattr(self, name)!r}")


@dataclass
class StepOptions:
    """Options of the per-step exchange (``local_steps=0``): what each step sends, how, and with which
    convergence recipe. Checked when built, each option and the rules among them.

    Args:
        density: share of each bucket's entries sent per step (ρ = k/n), in (0, 1]; 1.0 sends dense.
        selector: top-k method: ``"exact"`` (the same set as ``torch.topk``), ``"mstopk"`` (MSTopK,
            approximate, MLSys'21) or ``"torch"``.
        value_dtype: dtype of the sparse values on the wire: ``"bf16"`` (default), ``"fp16"`` or ``"fp32"``
            (indices: :mod:`~lightning_topk.comm.wire`'s 16-bit block code). Finite values beyond the
            dtype's range are clamped to it; the clipped part and the rounding error stay in the residual,
            so bf16 costs no convergence (MNIST-5k, BENCHMARKS.md). Dense steps, small buckets and
            density 1 send fp32; ``exchange="dense"`` pinned sends this dtype below density 1.
        error_feedback: keep what was not sent and add it to the next step's gradient.
        momentum_correction: DGC momentum correction: accumulate velocity locally and select from it,
            with momentum-factor masking if ``momentum_masking`` (the velocity is zeroed where entries were
            sent by a sparse step; a dense step sends the whole velocity and keeps it, so it acts as
            heavy-ball momentum). Use it with an optimizer without momentum (``recipe="auto"`` sets this up
            for SGD). Needs ``error_feedback``; flat exchange only.
        momentum: momentum used by ``momentum_correction``, in [0, 1).
        momentum_masking: with ``momentum_correction``, DGC's momentum-factor masking: a sparse step zeroes
            the velocity where it sent (``True``), or keeps it (``False``: error feedback on the local
            momentum, which at density 1 is SGD momentum). ``recipe="auto"`` sets ``False``
            (``docs/convergence.md``).
        momentum_lookahead: with ``momentum_correction``, a sparse step's residual accumulates
            ``u = v + c * (v - v_prev)`` instead of the velocity ``v`` (c = this option, a number in [0, 10]):
            the entries it sends carry c steps of their momentum ahead of time, and the residual keeps the
            debt, so what is sent still adds up to the velocities' sum. It offsets the delay of error feedback
            (``docs/convergence.md``). With c = ``momentum`` and every entry sent each step it is exactly
            PyTorch's Nesterov momentum; a larger c extrapolates further and lowers the largest stable
            learning rate (about ``2(1+m)/(1+2c)`` times the inverse curvature against ``2(1+m)`` for heavy
            ball). Dense steps accumulate ``v`` as before, so at density 1 nothing changes. 0 (default): off.
            Needs ``momentum_correction``; ``recipe="auto"`` sets it to ``momentum``.
        recipe: ``"auto"``: the convergence recipe measured best for the user's optimizer
            (:mod:`lightning_topk.comm.recipe`, ``docs/convergence.md``): for ``torch.optim.SGD`` with
            momentum (no Nesterov, no dampening) and ``density < 1`` on a flat exchange, momentum correction
            with the optimizer's momentum, without masking and with ``momentum_lookahead`` = that momentum
            (Nesterov's update), from the step after the first one that sends a bucket sparse (until then,
            and wherever every bucket goes dense, the optimizer is untouched: DDP); the momentum the
            optimizer's groups hold (schedulers may write it) is followed every step, and weight decay still
            passes through the momentum; for ``torch.optim.AdamW`` (or Adam without L2 decay) under
            ``topk_ddp``, 1-bit Adam's frozen variance with Adam's momentum in the hook, after ``dense_steps``
            (20 where 0; longer while the lr rises) of the user's AdamW and then a density warm-up over
            ``warmup_steps`` (100 where 0) (:class:`~lightning_topk.comm.recipe.AdamLiveRecipe`); for anything
            else (LARS, Adam under ``topk_fsdp``) plain error feedback.
            ``"none"``: the options as given.
        dense_steps: exchanges run dense at the start (int >= 0). DDP rebuilds its buckets after the
            first iteration; residuals are keyed by parameter name and survive the rebuild either way. With
            ``local_steps`` > 0 (post-local SGD): the first ``dense_steps`` optimizer-step attempts are
            synchronous, their gradients all-reduced densely in fp32 over every rank as DDP does, and after
            them θ_outer is re-anchored at the (identical) weights and the local rounds start.
        warmup_steps: after ``dense_steps``, the density decays geometrically from ``warmup_start`` to
            ``density`` over this many steps (int >= 0; DGC's 25% -> 6.25% -> ... warm-up). ``recipe="auto"``
            with AdamW makes 0 into 100.
        warmup_start: density at the start of the warm-up, in (0, 1].
        min_sparse_numel: buckets with fewer entries go dense (int >= 0); so does any bucket whose
            packed sparse buffer would not be smaller than the dense one.
        hierarchical: ``"auto"``, ``True`` or ``False``, the older switch of the hierarchical exchange
            (intra-node reduce-scatter, top-k on the owned shard, inter-node all-gather): ``True`` means
            ``exchange="hierarchical"`` (with another pinned exchange, ``momentum_correction`` or
            ``selection_scope="parameter"`` it is an error, and so is one process per node, checked when
            the strategy knows the layout); ``False`` keeps ``exchange="auto"`` from choosing it or
            ``"hierarchical_scatter"``; ``"auto"`` leaves it to ``exchange``.
        selection_scope: ``"bucket"``: one top-k over each DDP bucket (k is shared adaptively between
            its layers). ``"parameter"``: a top-k of each parameter (k_p = ceil(ρ·n_p); parameters below
            ``min_sparse_numel`` are sent whole); independent of DDP's bucket layout, which makes resume
            bit-exact with several buckets. Flat exchange only.
        exchange: how entries travel: ``"auto"`` (a cost model probed at setup picks per bucket), ``"dense"``
            (all-reduce), ``"allgather"`` (flat top-k all-gather), ``"hierarchical"`` (as ``hierarchical=True``)
            ``"scatter"`` (scale-free sparse reduce-scatter + all-gather, :mod:`lightning_topk.comm.exchanges.scatter`;
            no ``momentum_correction``) or ``"hierarchical_scatter"`` (the hierarchical exchange with the
            scale-free exchange among the ranks with the same local rank; conditions as ``"hierarchical"``).
        log_telemetry: log ``topk/*`` metrics to the Trainer's loggers every ``log_every_n_steps``.
    """

    density: float = 0.01
    selector: str = "exact"
    value_dtype: str = "bf16"
    error_feedback: bool = True
    momentum_correction: bool = False
    momentum: float = 0.9
    momentum_masking: bool = True
    momentum_lookahead: float = 0.0
    recipe: str = "auto"
    dense_steps: int = 0
    warmup_steps: int = 0
    warmup_start: float = 0.25
    min_sparse_numel: int = 16384
    hierarchical: Union[str, bool] = "auto"
    selection_scope: str = "bucket"
    log_telemetry: bool = True
    exchange: str = "auto"

    def __post_init__(self) -> None:
        self._check_step()

    def _check_step(self) -> None:
        for name in ("density", "warmup_start"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 < v <= 1.0:
                raise _bad(self, name, "a number in (0, 1]")
            setattr(self, name, float(v))
        if self.selector not in METHODS:
            raise _bad(self, "selector", f"one of {list(METHODS)}")
        try:
            value_dtype_of(self.value_dtype)
        except ValueError as e:
            raise ValueError(f"topk_ddp: {e}") from None
        for name in ("error_feedback", "momentum_correction", "momentum_masking", "log_telemetry"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(self, name, "true or false")
        if not _is_number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise _bad(self, "momentum", "a number in [0, 1)")
        if not _is_number(self.momentum_lookahead) or not 0.0 <= self.momentum_lookahead <= 10.0:
            raise _bad(self, "momentum_lookahead", "a number in [0, 10]")
        self.momentum_lookahead = float(self.momentum_lookahead)
        for name in ("dense_steps", "warmup_steps", "min_sparse_numel"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise _bad(self, name, "an int >= 0")
        if self.recipe not in RECIPE_CHOICES:
            raise _bad(self, "recipe", f"one of {list(RECIPE_CHOICES)}")
        if not (self.hierarchical == "auto" or isinstance(self.hierarchical, bool)):
            raise _bad(self, "hierarchical", "'auto', true or false")
        if self.selection_scope not in SCOPE_CHOICES:
            raise _bad(self, "selection_scope", f"one of {list(SCOPE_CHOICES)}")
        # Between options of the group.
        if self.momentum_correction and not self.error_feedback:
            raise ValueError("topk_ddp: momentum_correction=True needs error_feedback=True (it accumulates velocity)")
        if self.momentum_lookahead > 0 and not self.momentum_correction:
            raise ValueError(f"topk_ddp: momentum_lookahead={self.momentum_lookahead:g} needs momentum_correction=True "
                             "(it looks ahead along the hook's velocity); set momentum_correction=true or "
                             "momentum_lookahead=0 (recipe='auto' sets both for SGD with momentum)")
        if self.hierarchical is True and self.momentum_correction:
            raise ValueError("topk_ddp: momentum_correction is not supported with the hierarchical exchange; "
                             "set hierarchical=false (or 'auto') or momentum_correction=false")
        if self.hierarchical is True and self.selection_scope != "bucket":
            raise ValueError("topk_ddp: selection_scope='parameter' is not supported with the hierarchical exchange "
                             "(its shards cut across parameters); set hierarchical=false (or 'auto') or "
                             "selection_scope='bucket'")
        if self.exchange not in registry.choices():
            raise _bad(self, "exchange", f"one of {list(registry.choices())}")
        if self.hierarchical is True and self.exchange not in ("auto", "hierarchical"):
            raise ValueError(f"topk_ddp: hierarchical=true contradicts exchange={self.exchange!r}; set "
                             "exchange='hierarchical' (or 'auto') or leave hierarchical='auto'")
        if self.hierarchical is False and self.exchange in HIERARCHICAL_EXCHANGES:
            raise ValueError(f"topk_ddp: hierarchical=false contradicts exchange={self.exchange!r}; leave "
                             "hierarchical='auto'")

    @property
    def schedule(self) -> DensitySchedule:
        return DensitySchedule(self.density, self.dense_steps, self.warmup_steps, self.warmup_start)

    @property
    def recipe_in_use(self) -> str:
        """The convergence recipe these options run (a key of :data:`lightning_topk.comm.cost.SPARSE_PENALTY`):
        ``"error_feedback"``, ``"momentum_correction"`` (with masking, with or without lookahead),
        ``"momentum_correction_unmasked"`` or ``"momentum_lookahead"`` (unmasked, ``momentum_lookahead`` > 0;
        measured with c = ``momentum`` = 0.9, as ``recipe="auto"`` sets it)."""
        if not self.momentum_correction:
            return "error_feedback"
        if self.momentum_masking:
            return "momentum_correction"
        return "momentum_lookahead" if self.momentum_lookahead > 0 else "momentum_correction_unmasked"

    @property
    def wire_dtype(self) -> torch.dtype:
        return value_dtype_of(self.value_dtype)

    def use_hierarchical(self, num_nodes: int, procs_per_node: int) -> bool:
        """Whether every bucket takes a hierarchical exchange (``hierarchical=True`` or ``exchange=
        'hierarchical'`` / ``'hierarchical_scatter'``; raises on one process per node). With
        ``exchange='auto'`` the cost model may still pick one per bucket."""
        pinned = self.hierarchical is True or self.exchange in HIERARCHICAL_EXCHANGES
        if pinned and procs_per_node < 2:
            which = "hierarchical=True" if self.hierarchical is True else f"exchange={self.exchange!r}"
            raise ValueError(
                f"topk_ddp: {which} needs more than one process per node (devices={procs_per_node}); use "
                "exchange='auto' or 'scatter' (and hierarchical='auto')"
            )
        return pinned


@dataclass
class AutoOptions:
    """Options of ``exchange="auto"``'s cost model (:mod:`lightning_topk.comm.exchanges.auto`).

    Args:
        auto_sparse_penalty: ``exchange="auto"`` picks a sparse exchange for a bucket only where its
            predicted time times this factor beats the dense transports': top-k may need more steps than a
            dense all-reduce to reach the same accuracy, and forward/backward time is common to both.
            ``None`` (default): the measured steps-to-target ratio for ``density`` and the recipe in use
            (:data:`lightning_topk.comm.cost.SPARSE_PENALTY`, interpolated in log-density; the same on every
            rank, no timing). A number >= 1 overrides it; 1 compares exchange times alone.
        auto_model: where ``exchange="auto"`` gets its cost model: ``"probe"`` (timed at setup, refreshed
            from telemetry), ``"constants"`` (documented constants and ``auto_link_gbps``: no timing, so
            the plan is the same in every run) or ``"auto"``: ``"constants"`` under deterministic
            algorithms (``Trainer(deterministic=True)``), else ``"probe"``.
        auto_link_gbps: inter-node bandwidth in Gbit/s that the ``"constants"`` model assumes (a number > 0).
        auto_step_ms: the compute of one training step (forward, backward, optimizer) in milliseconds, for
            ``mode="auto"``'s decision: a number > 0 (e.g. a one-node run's step time), or ``None`` (default):
            estimated from the parameter count (:func:`lightning_topk.comm.mode.estimate_compute`, calibrated on an
            MLP; it under-counts models with many FLOPs per parameter, such as Transformers on long sequences).
        mode: what crosses the inter-node link: ``"per_step"`` (the per-step top-k exchange), ``"local"`` (sparse
            local SGD; with ``local_steps=0`` the link picks the settings among the registered presets') or
            ``"auto"`` (default): with none of the other mode options set (:data:`MODE_OPTIONS`) and more than
            one node, per-step or local SGD and its settings are chosen at setup from the inter-node link and a
            step's compute (measured, or ``auto_link_gbps`` and the constants under ``auto_model``'s rule), by the
            cost model and the measured convergence penalty of each mode (:func:`lightning_topk.comm.mode.choose_mode`,
            ``docs/modes.md``); otherwise the options run as given.
    """

    auto_sparse_penalty: Optional[float] = None
    auto_model: str = "auto"
    auto_link_gbps: float = 10.0
    auto_step_ms: Optional[float] = None
    mode: str = "auto"

    def __post_init__(self) -> None:
        self._check_auto()

    def _check_auto(self) -> None:
        if self.auto_sparse_penalty is not None:
            if not _is_number(self.auto_sparse_penalty) or self.auto_sparse_penalty < 1.0:
                raise _bad(self, "auto_sparse_penalty", "null (the measured table) or a number >= 1")
            self.auto_sparse_penalty = float(self.auto_sparse_penalty)
        if self.auto_model not in AUTO_MODEL_CHOICES:
            raise _bad(self, "auto_model", f"one of {list(AUTO_MODEL_CHOICES)}")
        if not _is_number(self.auto_link_gbps) or self.auto_link_gbps <= 0:
            raise _bad(self, "auto_link_gbps", "a number > 0 (Gbit/s)")
        self.auto_link_gbps = float(self.auto_link_gbps)
        if self.auto_step_ms is not None:
            if not _is_number(self.auto_step_ms) or self.auto_step_ms <= 0:
                raise _bad(self, "auto_step_ms", "null (estimated from the parameter count) or a number > 0 (ms)")
            self.auto_step_ms = float(self.auto_step_ms)
        if self.mode not in MODE_CHOICES:
            raise _bad(self, "mode", f"one of {list(MODE_CHOICES)}")


@dataclass
class OuterOptions:
    """Options of sparse local SGD (``local_steps`` > 0): the inner steps per round and the outer round's
    step and packets (:mod:`lightning_topk.comm.local`).

    Args:
        local_steps: sparse local SGD (:mod:`lightning_topk.comm.local`, ``docs/local_sgd.md``): H > 0 inner
            optimizer steps per outer round (int >= 0). 0 is the per-step exchange (:class:`StepOptions`). With H > 0 the comm
            hook only all-reduces gradients densely inside a node (one process per node: no collective at
            all), ``exchange`` must be ``"auto"`` or ``"local"`` (it becomes ``"local"``), and every H
            optimizer steps that happened the outer round exchanges the top-k of the error-feedback buffer of
            the pseudo-gradient θ_outer − θ_local among the nodes and takes an outer SGD step. ``density``,
            ``selector``, ``value_dtype`` and the residual options then do not apply; ``nonfinite`` applies
            to the inner steps and to the pseudo-gradient (``"skip"``: the round is skipped and θ_local reset
            to θ_outer). Needs ``momentum_correction=False`` and ``hierarchical`` not ``True``.
        outer_recipe: where the outer step's ``outer_lr``, ``outer_momentum`` and ``outer_nesterov`` come from when
            they are unset (``None``): ``"auto"`` (default) picks them from the inner optimizer by a measured
            table (:data:`~lightning_topk.comm.local.OUTER_RECIPE_TABLE`, ``docs/local_sgd.md``; plain averaging,
            lr 1 and momentum 0, for optimizers it does not know; momentum 0 with ``outer_streaming``), and with one
            replica (one node) makes the outer round the identity (θ_outer := θ_local: the node's processes already
            all-reduce every step, so this is DDP); ``"diloco"``: lr 0.7, Nesterov momentum 0.9; ``"average"``:
            lr 1, momentum 0 (post-local SGD, torch's ``PeriodicModelAverager`` at dense fp32 values).
        outer_lr: outer SGD learning rate (a number > 0), or ``None``: from ``outer_recipe``. A value set wins
            over the recipe (and turns off the one-replica identity).
        outer_momentum: outer SGD momentum in [0, 1), or ``None``: from ``outer_recipe``.
        outer_nesterov: Nesterov momentum for the outer step (with ``outer_momentum`` > 0), or ``None``: from
            ``outer_recipe``, or ``True`` (DiLoCo's) where ``outer_momentum`` is set.
        outer_density: share of each chunk's entries sent per outer round, in (0, 1] (1: dense, no indices).
        outer_chunk: entries per top-k chunk of the flat parameter vector (int >= 0; each chunk sends
            ``ceil(outer_density * outer_chunk)`` entries and, below 16 bits, one fp32 scale; positions are int16
            up to 32768, or a bitmap of the chunk where smaller: above 1/16 density); 0 = one top-k over the
            rank's whole shard.
        outer_value_bits: bits per value sent: 32 (fp32), 16 (bf16), 8, 4 or 2 (integer codes with one
            scale per chunk, round half to even; 2 is ternary). The rounding error stays in the buffer.
        outer_ef_decay: error-feedback decay in [0, 1]: ``e = outer_ef_decay * e + Δ`` (0: no error
            feedback).
        outer_streaming: launch the outer all-gather asynchronously and apply its result one round late,
            so the next round's compute overlaps it. Use it with ``outer_momentum=0``: the DiLoCo outer
            momentum (0.9, Nesterov) applied one round late diverged (docs/local_sgd.md); a warning says so.
        outer_exchange: how the replicas exchange their outer packets: ``"allgather"`` (every replica gets
            every packet: R − 1 packets in per round), ``"scatter"`` (scale-free: each replica owns a range of
            chunks, averages the replicas' packets of it and re-selects it at twice the density, at 4 bits or
            more, with its own error feedback, then the owners' ranges are all-gathered: about 2.3-3.2 (R − 1)/R
            packets per round, whatever R) or ``"auto"`` (``"scatter"`` from 4 replicas on where it sends at most
            0.6 of the all-gather's bytes, decided from the number of replicas and the packet layout alone, the
            same on every rank: :func:`~lightning_topk.comm.local.outer_exchange_for`).
            ``"scatter"`` does not stream: with ``outer_streaming`` it is an error, and ``"auto"`` picks
            ``"allgather"``.
    """

    local_steps: int = 0
    outer_recipe: str = "auto"
    outer_lr: Optional[float] = None
    outer_momentum: Optional[float] = None
    outer_nesterov: Optional[bool] = None
    outer_density: float = 0.1
    outer_chunk: int = 4096
    outer_value_bits: int = 4
    outer_ef_decay: float = 1.0
    outer_streaming: bool = False
    outer_exchange: str = "auto"

    def __post_init__(self) -> None:
        self._check_outer()

    def _check_outer(self) -> None:
        if not isinstance(self.outer_nesterov, bool) and self.outer_nesterov is not None:
            raise _bad(self, "outer_nesterov", "true or false, or null (from outer_recipe)")
        if not isinstance(self.outer_streaming, bool):
            raise _bad(self, "outer_streaming", "true or false")
        for name in ("local_steps", "outer_chunk"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise _bad(self, name, "an int >= 0")
        if self.outer_recipe not in OUTER_RECIPES:
            raise _bad(self, "outer_recipe", f"one of {list(OUTER_RECIPES)}")
        if self.outer_lr is not None and (not _is_number(self.outer_lr) or self.outer_lr <= 0):
            raise _bad(self, "outer_lr", "a number > 0, or null (from outer_recipe)")
        if self.outer_momentum is not None and (not _is_number(self.outer_momentum)
                                                or not 0.0 <= self.outer_momentum < 1.0):
            raise _bad(self, "outer_momentum", "a number in [0, 1), or null (from outer_recipe)")
        if not _is_number(self.outer_density) or not 0.0 < self.outer_density <= 1.0:
            raise _bad(self, "outer_density", "a number in (0, 1]")
        if not _is_number(self.outer_ef_decay) or not 0.0 <= self.outer_ef_decay <= 1.0:
            raise _bad(self, "outer_ef_decay", "a number in [0, 1]")
        for name in ("outer_lr", "outer_momentum", "outer_density", "outer_ef_decay"):
            if getattr(self, name) is not None:
                setattr(self, name, float(getattr(self, name)))
        if not _is_int(self.outer_value_bits) or self.outer_value_bits not in OUTER_BITS:
            raise _bad(self, "outer_value_bits", f"one of {list(OUTER_BITS)}")
        if self.outer_exchange not in OUTER_EXCHANGES:
            raise _bad(self, "outer_exchange", f"one of {list(OUTER_EXCHANGES)}")
        if self.outer_exchange == "scatter" and self.outer_streaming:
            raise ValueError("topk_ddp: outer_exchange='scatter' does not stream (its owners re-select between two "
                             "collectives); set outer_streaming=false, or outer_exchange='allgather' (or 'auto')")


@dataclass
class FaultOptions:
    """What a step does about non-finite gradients (:class:`~lightning_topk.comm.controller.StepController`)
    and about replicas that come and go (``fault_tolerance``, ``docs/elastic.md``).

    Args:
        nonfinite: a NaN/inf gradient on any rank (seen in what entered or what came out of the
            exchange): ``"raise"`` raises ``FloatingPointError`` on every rank, ``"skip"`` skips the
            optimizer step on every rank and rolls the residuals back, ``"propagate"`` passes it through
            as plain DDP would. With a loss scaler (fp16), the scaler's skip decides instead.
        fault_tolerance: ``"none"`` (default): a lost process ends the job. ``"torchft"`` (extra
            ``lightning-topk[ft]``): each Trainer is one replica group, and the exchange between the groups runs
            on torchft's reconfigurable process group over the replicas of the current quorum (a torchft
            ``Manager`` forms it with the lighthouse); a step commits only where the step controller and
            torchft's ``should_commit`` both say so (an uncommitted step is rolled back, residuals included), and
            a restarted group heals from a live peer. One Trainer per replica group (``num_nodes=1``; its
            ``devices`` processes average each bucket among themselves first). Per-step exchange (``local_steps=0``)
            with ``exchange`` ``"auto"`` (= ``"allgather"``), ``"allgather"`` or ``"dense"``; or local SGD
            (``local_steps`` > 0, one process per group): each outer round averages over the round's quorum, with
            the outer all-gather, no ``outer_streaming`` and no ``dense_steps``.
        lighthouse: the torchft lighthouse's address (``http://host:port``), or ``None``: the environment
            variable ``TORCHFT_LIGHTHOUSE``. Checked with a TCP connect within ``ft_connect_timeout`` when the
            strategy sets up: a missing or unreachable lighthouse is an error that names it.
        min_replicas: the fewest replica groups a step may commit with (int >= 1; torchft's
            ``min_replica_size``); start the lighthouse with ``--min_replicas`` at least this. More than half of
            the groups started rules out two quorums at once (docs/elastic.md, "Split quorums").
        ft_timeout: seconds for the collectives of a step, ``should_commit`` and a heal's checkpoint transfer
            (torchft's ``timeout``; a number > 0). A replica that dies mid-step costs the others at most this.
        ft_quorum_timeout: seconds a step waits for the lighthouse's quorum (a number > 0, at least
            ``ft_timeout``); a quorum below ``min_replicas`` for this long is an error.
        ft_connect_timeout: seconds to connect to the lighthouse and to the replica group's manager (a number > 0).
    """

    nonfinite: str = "raise"
    fault_tolerance: str = "none"
    lighthouse: Optional[str] = None
    min_replicas: int = 1
    ft_timeout: float = 30.0
    ft_quorum_timeout: float = 60.0
    ft_connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        self._check_fault()

    def _check_fault(self) -> None:
        if self.nonfinite not in NONFINITE_CHOICES:
            raise _bad(self, "nonfinite", f"one of {list(NONFINITE_CHOICES)}")
        if self.fault_tolerance not in FAULT_TOLERANCE_CHOICES:
            raise _bad(self, "fault_tolerance", f"one of {list(FAULT_TOLERANCE_CHOICES)}")
        if self.lighthouse is not None and (not isinstance(self.lighthouse, str) or not self.lighthouse.strip()):
            raise _bad(self, "lighthouse", "an address such as 'http://host:29510', or null (TORCHFT_LIGHTHOUSE)")
        if not _is_int(self.min_replicas) or self.min_replicas < 1:
            raise _bad(self, "min_replicas", "an int >= 1")
        for name in ("ft_timeout", "ft_quorum_timeout", "ft_connect_timeout"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise _bad(self, name, "a number of seconds > 0")
            setattr(self, name, float(getattr(self, name)))
        if self.ft_quorum_timeout < self.ft_timeout:
            raise ValueError(f"topk_ddp: ft_quorum_timeout={self.ft_quorum_timeout:g} must be at least "
                             f"ft_timeout={self.ft_timeout:g} (a quorum waits out a step of the others; docs/elastic.md)")

    @property
    def elastic(self) -> bool:
        """Whether replicas may come and go (``fault_tolerance`` other than ``"none"``)."""
        return self.fault_tolerance != "none"


@dataclass
class TopKConfig(FaultOptions, OuterOptions, AutoOptions, StepOptions):
    """Options of the top-k exchange: the one definition that ``TopKDDPStrategy``, the Hydra config
    (``conf/strategy/topk_ddp.yaml``) and the README option table follow. Every check, including the
    ones between options, runs when the object is built and names the option and what is allowed.

    The options come by concern, each group with its own documentation and checks: :class:`StepOptions`
    (the per-step exchange), :class:`AutoOptions` (``exchange="auto"``'s cost model), :class:`OuterOptions`
    (sparse local SGD) and :class:`FaultOptions` (non-finite gradients); their fields, in that order, are
    this class's. Here: the rules between groups.
    """

    def __post_init__(self) -> None:
        self._check_step()
        self._check_auto()
        self._check_outer()
        self._check_fault()
        if self.mode == "per_step" and self.local_steps > 0:
            raise ValueError(f"topk_ddp: mode='per_step' contradicts local_steps={self.local_steps} (sparse local SGD); "
                             "set mode='local' (or 'auto') or local_steps=0")
        if self.mode == "local" and self.local_steps == 0:
            if self.exchange not in ("auto", "local") or self.momentum_correction or self.hierarchical is True:
                raise ValueError("topk_ddp: mode='local' runs sparse local SGD; exchange, momentum_correction and "
                                 "hierarchical must stay at their defaults (or set mode='per_step')")
        if self.local_steps > 0:
            if self.exchange not in ("auto", "local"):
                raise ValueError(f"topk_ddp: local_steps={self.local_steps} runs the 'local' exchange; "
                                 f"exchange={self.exchange!r} contradicts it (set exchange='auto' or 'local', or "
                                 "local_steps=0)")
            if self.momentum_correction:
                raise ValueError("topk_ddp: momentum_correction is not supported with local_steps > 0 (no "
                                 "per-step top-k); set momentum_correction=false or local_steps=0")
            if self.hierarchical is True:
                raise ValueError("topk_ddp: hierarchical=true contradicts local_steps > 0; leave hierarchical='auto'")
        elif self.exchange == "local":
            raise ValueError("topk_ddp: exchange='local' needs local_steps > 0 (inner optimizer steps per outer "
                             "round); set local_steps or another exchange")
        if self.elastic:
            self._check_elastic()
        if self.exchange != "auto":
            registry.get(self.exchange).check(self)  # the pinned exchange's declared requirements

    def _check_elastic(self) -> None:
        """``fault_tolerance="torchft"``: what runs over a replica count that changes between steps."""
        if self.local_steps > 0:
            # Local SGD under torchft: the outer all-gather over each round's quorum (docs/elastic.md). The pieces
            # that assume a fixed replica set or a round that outlives its quorum are refused.
            if self.outer_streaming:
                raise ValueError("topk_ddp: fault_tolerance='torchft' with local_steps > 0 does not stream the outer "
                                 "exchange (a round in flight would outlive its quorum); set outer_streaming=false")
            if self.outer_exchange == "scatter":
                raise ValueError(message("ft_outer_scatter"))
            if self.dense_steps > 0:
                raise ValueError("topk_ddp: fault_tolerance='torchft' with local_steps > 0 does not run the "
                                 "synchronous first dense_steps (post-local SGD) between replica groups; set "
                                 "dense_steps=0")
        if self.exchange not in ELASTIC_EXCHANGES:
            raise ValueError(message("ft_exchange", exchange=self.exchange))
        if self.hierarchical is True:
            raise ValueError("topk_ddp: fault_tolerance='torchft' averages each bucket within a replica group, then "
                             "runs the flat exchange between groups; hierarchical=true contradicts it; leave "
                             "hierarchical='auto'")

    @classmethod
    def option_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def mode_options_set(self) -> Tuple[str, ...]:
        """The mode options (:data:`MODE_OPTIONS`) set to anything but their defaults: with any, ``mode="auto"``
        decides nothing."""
        defaults = {f.name: f.default for f in fields(self)}
        return tuple(n for n in MODE_OPTIONS if getattr(self, n) != defaults[n])

    @property
    def sparse_penalty(self) -> float:
        """The factor ``exchange="auto"`` weighs sparse exchanges by: ``auto_sparse_penalty`` when set, else
        the measured table's value for ``density`` and the recipe (see :func:`lightning_topk.comm.cost.sparse_penalty`)."""
        if self.auto_sparse_penalty is not None:
            return self.auto_sparse_penalty
        return measured_sparse_penalty(self.density, self.recipe_in_use)
