"""Per-rank state of the top-k exchange: options, residuals (error feedback), momentum-correction
buffers, the step counter, per-step fault flags, the undo copies of a step, and telemetry.

Residuals are stored per DDP bucket as one flat fp32 buffer that the hooks update in place, keyed by
*parameter names*, so they survive DDP's bucket rebuild after the first iteration and can be saved
and restored per parameter.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lightning_topk.comm.schedule import DensitySchedule
from lightning_topk.comm.selection import METHODS, ThresholdHint
from lightning_topk.comm.wire import value_dtype_of

SCOPE_CHOICES = ("bucket", "parameter")
NONFINITE_CHOICES = ("raise", "skip", "propagate")
# Exchanges that shard buckets within a node (intra-node reduce-scatter first).
HIERARCHICAL_EXCHANGES = ("hierarchical", "hierarchical_scatter")
OUTER_BITS = (32, 16, 8, 4, 2)  # outer_value_bits (sparse local SGD)
OUTER_EXCHANGES = ("auto", "allgather", "scatter")  # outer_exchange (sparse local SGD)
# outer_recipe (sparse local SGD): where unset outer_lr / outer_momentum / outer_nesterov come from
# (lightning_topk/comm/outer.py: OUTER_RECIPE_TABLE, outer_step_for).
OUTER_RECIPES = ("auto", "diloco", "average")
# Where exchange="auto" gets its cost model (see comm/exchanges/auto.py).
AUTO_MODEL_CHOICES = ("auto", "probe", "constants")
# recipe="auto": the convergence recipe for the user's optimizer (lightning_topk/comm/recipe.py).
RECIPE_CHOICES = ("auto", "none")
Scale = Union[float, Tensor]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class TopKConfig:
    """Options of the top-k exchange: the one definition that ``TopKDDPStrategy``, the Hydra config
    (``conf/strategy/topk_ddp.yaml``) and the README option table follow. Every check, including the
    ones between options, runs when the object is built and names the option and what is allowed.

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
            passes through the momentum; for anything else (AdamW, Adam, LARS) plain error feedback.
            ``"none"``: the options as given.
        dense_steps: exchanges run dense at the start (int >= 0). DDP rebuilds its buckets after the
            first iteration; residuals are keyed by parameter name and survive the rebuild either way. With
            ``local_steps`` > 0 (post-local SGD): the first ``dense_steps`` optimizer-step attempts are
            synchronous, their gradients all-reduced densely in fp32 over every rank as DDP does, and after
            them θ_outer is re-anchored at the (identical) weights and the local rounds start.
        warmup_steps: after ``dense_steps``, the density decays geometrically from ``warmup_start`` to
            ``density`` over this many steps (int >= 0; DGC's 25% -> 6.25% -> ... warm-up).
        warmup_start: density at the start of the warm-up, in (0, 1].
        min_sparse_numel: buckets with fewer entries go dense (int >= 0); so does any bucket whose
            packed sparse buffer would not be smaller than the dense one.
        hierarchical: ``"auto"``, ``True`` or ``False``, the older switch of the hierarchical exchange
            (intra-node reduce-scatter, top-k on the owned shard, inter-node all-gather): ``True`` means
            ``exchange="hierarchical"`` (with another pinned exchange, ``momentum_correction`` or
            ``selection_scope="parameter"`` it is an error, and so is one process per node, checked when
            the strategy knows the layout); ``False`` keeps ``exchange="auto"`` from choosing it or
            ``"hierarchical_scatter"``; ``"auto"`` leaves it to ``exchange``.
        nonfinite: a NaN/inf gradient on any rank (seen in what entered or what came out of the
            exchange): ``"raise"`` raises ``FloatingPointError`` on every rank, ``"skip"`` skips the
            optimizer step on every rank and rolls the residuals back, ``"propagate"`` passes it through
            as plain DDP would. With a loss scaler (fp16), the scaler's skip decides instead.
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
        local_steps: sparse local SGD (:mod:`lightning_topk.comm.outer`, ``docs/local_sgd.md``): H > 0 inner
            optimizer steps per outer round (int >= 0). 0 is the per-step exchange above. With H > 0 the comm
            hook only all-reduces gradients densely inside a node (one process per node: no collective at
            all), ``exchange`` must be ``"auto"`` or ``"local"`` (it becomes ``"local"``), and every H
            optimizer steps that happened the outer round exchanges the top-k of the error-feedback buffer of
            the pseudo-gradient θ_outer − θ_local among the nodes and takes an outer SGD step. ``density``,
            ``selector``, ``value_dtype`` and the residual options then do not apply; ``nonfinite`` applies
            to the inner steps and to the pseudo-gradient (``"skip"``: the round is skipped and θ_local reset
            to θ_outer). Needs ``momentum_correction=False`` and ``hierarchical`` not ``True``.
        outer_recipe: where the outer step's ``outer_lr``, ``outer_momentum`` and ``outer_nesterov`` come from when
            they are unset (``None``): ``"auto"`` (default) picks them from the inner optimizer by a measured
            table (:data:`~lightning_topk.comm.outer.OUTER_RECIPE_TABLE`, ``docs/local_sgd.md``; plain averaging,
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
            same on every rank: :func:`~lightning_topk.comm.outer.outer_exchange_for`).
            ``"scatter"`` does not stream: with ``outer_streaming`` it is an error, and ``"auto"`` picks
            ``"allgather"``.
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
    nonfinite: str = "raise"
    selection_scope: str = "bucket"
    log_telemetry: bool = True
    exchange: str = "auto"
    auto_sparse_penalty: Optional[float] = None
    auto_model: str = "auto"
    auto_link_gbps: float = 10.0
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
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"topk_ddp: {name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("density", "warmup_start"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 < v <= 1.0:
                raise bad(name, "a number in (0, 1]")
            setattr(self, name, float(v))
        if self.selector not in METHODS:
            raise bad("selector", f"one of {list(METHODS)}")
        try:
            value_dtype_of(self.value_dtype)
        except ValueError as e:
            raise ValueError(f"topk_ddp: {e}") from None
        for name in ("error_feedback", "momentum_correction", "momentum_masking", "log_telemetry", "outer_nesterov",
                     "outer_streaming"):
            if not isinstance(getattr(self, name), bool) and not (name == "outer_nesterov" and self.outer_nesterov is None):
                raise bad(name, "true or false" + (", or null (from outer_recipe)" if name == "outer_nesterov" else ""))
        if not _is_number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise bad("momentum", "a number in [0, 1)")
        if not _is_number(self.momentum_lookahead) or not 0.0 <= self.momentum_lookahead <= 10.0:
            raise bad("momentum_lookahead", "a number in [0, 10]")
        self.momentum_lookahead = float(self.momentum_lookahead)
        for name in ("dense_steps", "warmup_steps", "min_sparse_numel", "local_steps", "outer_chunk"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "an int >= 0")
        if self.outer_recipe not in OUTER_RECIPES:
            raise bad("outer_recipe", f"one of {list(OUTER_RECIPES)}")
        if self.outer_lr is not None and (not _is_number(self.outer_lr) or self.outer_lr <= 0):
            raise bad("outer_lr", "a number > 0, or null (from outer_recipe)")
        if self.outer_momentum is not None and (not _is_number(self.outer_momentum)
                                                or not 0.0 <= self.outer_momentum < 1.0):
            raise bad("outer_momentum", "a number in [0, 1), or null (from outer_recipe)")
        if not _is_number(self.outer_density) or not 0.0 < self.outer_density <= 1.0:
            raise bad("outer_density", "a number in (0, 1]")
        if not _is_number(self.outer_ef_decay) or not 0.0 <= self.outer_ef_decay <= 1.0:
            raise bad("outer_ef_decay", "a number in [0, 1]")
        for name in ("outer_lr", "outer_momentum", "outer_density", "outer_ef_decay"):
            if getattr(self, name) is not None:
                setattr(self, name, float(getattr(self, name)))
        if not _is_int(self.outer_value_bits) or self.outer_value_bits not in OUTER_BITS:
            raise bad("outer_value_bits", f"one of {list(OUTER_BITS)}")
        if self.outer_exchange not in OUTER_EXCHANGES:
            raise bad("outer_exchange", f"one of {list(OUTER_EXCHANGES)}")
        if self.outer_exchange == "scatter" and self.outer_streaming:
            raise ValueError("topk_ddp: outer_exchange='scatter' does not stream (its owners re-select between two "
                             "collectives); set outer_streaming=false, or outer_exchange='allgather' (or 'auto')")
        if self.auto_sparse_penalty is not None:
            if not _is_number(self.auto_sparse_penalty) or self.auto_sparse_penalty < 1.0:
                raise bad("auto_sparse_penalty", "null (the measured table) or a number >= 1")
            self.auto_sparse_penalty = float(self.auto_sparse_penalty)
        if self.recipe not in RECIPE_CHOICES:
            raise bad("recipe", f"one of {list(RECIPE_CHOICES)}")
        if self.auto_model not in AUTO_MODEL_CHOICES:
            raise bad("auto_model", f"one of {list(AUTO_MODEL_CHOICES)}")
        if not _is_number(self.auto_link_gbps) or self.auto_link_gbps <= 0:
            raise bad("auto_link_gbps", "a number > 0 (Gbit/s)")
        self.auto_link_gbps = float(self.auto_link_gbps)
        if not (self.hierarchical == "auto" or isinstance(self.hierarchical, bool)):
            raise bad("hierarchical", "'auto', true or false")
        if self.nonfinite not in NONFINITE_CHOICES:
            raise bad("nonfinite", f"one of {list(NONFINITE_CHOICES)}")
        if self.selection_scope not in SCOPE_CHOICES:
            raise bad("selection_scope", f"one of {list(SCOPE_CHOICES)}")
        # Between options.
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
        from lightning_topk.comm.exchanges import registry  # imports no exchange module itself

        if self.exchange not in registry.choices():
            raise bad("exchange", f"one of {list(registry.choices())}")
        if self.hierarchical is True and self.exchange not in ("auto", "hierarchical"):
            raise ValueError(f"topk_ddp: hierarchical=true contradicts exchange={self.exchange!r}; set "
                             "exchange='hierarchical' (or 'auto') or leave hierarchical='auto'")
        if self.hierarchical is False and self.exchange in HIERARCHICAL_EXCHANGES:
            raise ValueError(f"topk_ddp: hierarchical=false contradicts exchange={self.exchange!r}; leave "
                             "hierarchical='auto'")
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
        if self.exchange != "auto":
            registry.get(self.exchange).check(self)  # the pinned exchange's declared requirements

    @classmethod
    def option_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def schedule(self) -> DensitySchedule:
        return DensitySchedule(self.density, self.dense_steps, self.warmup_steps, self.warmup_start)

    @property
    def sparse_penalty(self) -> float:
        """The factor ``exchange="auto"`` weighs sparse exchanges by: ``auto_sparse_penalty`` when set, else
        the measured table's value for ``density`` and the recipe (see :func:`lightning_topk.comm.cost.sparse_penalty`)."""
        if self.auto_sparse_penalty is not None:
            return self.auto_sparse_penalty
        from lightning_topk.comm.cost import sparse_penalty

        return sparse_penalty(self.density, self.recipe_in_use)

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


# ---- telemetry -------------------------------------------------------------------------------------
def clock(device: torch.device) -> Any:
    """A start mark: a recorded CUDA event on CUDA (host wall time would measure stalls), else perf_counter."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


@dataclass
class StepStats:
    """Telemetry of one exchange step on this rank.

    Payload (what this rank hands to the collectives): ``bytes_sent``, ``bytes_dense`` (the all-reduce
    payload it replaced), ``bytes_intra`` / ``bytes_inter``. Wire (what leaves this rank for the algorithm
    actually used: ring all-reduce ``2(P-1)/P`` x payload, ring all-gather ``(P-1)`` x payload,
    all-to-all ``(P-1)`` blocks): ``bytes_wire``, and ``bytes_dense_wire`` for a dense fp32 ring all-reduce
    of the same buckets (a bf16 one sends half of that). ``buckets_by``: buckets per exchange name, logged as
    ``topk/buckets_<name>`` for every registered exchange (0 where none went that way), a newly registered
    one included.

    On CUDA the times are CUDA-event pairs that are read only by :meth:`resolve` (called by
    :meth:`as_metrics`, at logging time), never in the hot path.
    """

    step: int = 0
    bytes_sent: int = 0
    bytes_dense: int = 0
    bytes_intra: int = 0
    bytes_inter: int = 0
    bytes_wire: int = 0
    bytes_dense_wire: int = 0
    numel: int = 0
    numel_sent: int = 0
    select_time_s: float = 0.0
    comm_time_s: float = 0.0
    predicted_s: float = 0.0  # exchange="auto": the cost model's select + comm time for this step's buckets
    buckets: int = 0
    nonfinite_buckets: int = 0
    # sparse local SGD (local_steps > 0): the last outer round on this rank
    outer_bytes: float = 0.0  # wire bytes this rank sent in it (ring all-gather: (replicas - 1) packets)
    outer_bytes_per_step: float = 0.0  # outer_bytes / local_steps
    outer_density: float = 0.0
    outer_time_s: float = 0.0  # host time blocked in it
    outer_hidden_frac: float = 0.0  # outer_streaming: share of the exchange's flight behind compute
    # buckets by the exchange that moved them (its registry name; a sparse exchange's dense steps and
    # unshardable buckets count under "dense" / the exchange it fell back to): ``topk/buckets_<name>``
    buckets_by: Dict[str, int] = field(default_factory=dict)
    _events: List[Tuple[str, Any, Any]] = field(default_factory=list, repr=False, compare=False)

    @property
    def density(self) -> float:
        return self.numel_sent / self.numel if self.numel else 0.0

    @property
    def compression(self) -> float:
        """Wire bytes of a dense fp32 ring all-reduce / wire bytes actually sent."""
        return self.bytes_dense_wire / self.bytes_wire if self.bytes_wire else 0.0

    @property
    def compression_bf16(self) -> float:
        """Wire bytes of a dense bf16 ring all-reduce / wire bytes actually sent."""
        return 0.5 * self.compression

    @property
    def payload_compression(self) -> float:
        """All-reduce payload / payload handed to the collectives (not what the wire carries)."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else 0.0

    def resolve(self, ready_only: bool = False) -> "StepStats":
        """Fold pending CUDA-event times into ``select_time_s``/``comm_time_s`` (waits for them unless
        ``ready_only``)."""
        keep = []
        for name, start, end in self._events:
            if ready_only and not end.query():
                keep.append((name, start, end))
                continue
            end.synchronize()
            setattr(self, name, getattr(self, name) + start.elapsed_time(end) / 1e3)
        self._events = keep
        return self

    def as_metrics(self) -> Dict[str, float]:
        self.resolve()
        return {
            "topk/bytes_sent": float(self.bytes_sent),
            "topk/bytes_dense": float(self.bytes_dense),
            "topk/bytes_intra": float(self.bytes_intra),
            "topk/bytes_inter": float(self.bytes_inter),
            "topk/bytes_wire": float(self.bytes_wire),
            "topk/bytes_dense_wire": float(self.bytes_dense_wire),
            "topk/density": self.density,
            "topk/compression": self.compression,
            "topk/compression_bf16": self.compression_bf16,
            "topk/payload_compression": self.payload_compression,
            "topk/select_ms": 1e3 * self.select_time_s,
            "topk/comm_ms": 1e3 * self.comm_time_s,
            "topk/predicted_ms": 1e3 * self.predicted_s,
            "topk/measured_ms": 1e3 * (self.select_time_s + self.comm_time_s),
            **{f"topk/buckets_{n}": float(self.buckets_by.get(n, 0)) for n in bucket_counters(self.buckets_by)},
            "topk/outer_bytes": float(self.outer_bytes),
            "topk/outer_bytes_per_step": float(self.outer_bytes_per_step),
            "topk/outer_density": float(self.outer_density),
            "topk/outer_time_s": float(self.outer_time_s),
            "topk/outer_hidden_frac": float(self.outer_hidden_frac),
        }

    def buckets_via(self, *names: str) -> int:
        """Buckets moved by any of the exchanges ``names``."""
        return sum(self.buckets_by.get(n, 0) for n in names)


def bucket_counters(extra: Iterable[str] = ()) -> List[str]:
    """The exchange names that have a ``topk/buckets_<name>`` counter: every registered one (the same list
    on every rank, so telemetry can reduce them in one all-reduce), then any other name in ``extra``."""
    from lightning_topk.comm.exchanges import registry  # imports no exchange module itself

    out = list(registry.names())
    return out + [n for n in extra if n not in out]


# ---- per-bucket storage, fault flags, undo copies, debug record -----------------------------------
@dataclass
class _BucketBuffers:
    names: Tuple[str, ...]
    numels: Tuple[int, ...]
    residual: Tensor  # fp32, sum(numels) entries, zero-padded for the hierarchical exchange's shards
    velocity: Optional[Tensor]
    owned: set = field(default_factory=set)


def nonfinite(x: Tensor) -> Tensor:
    """A 0-dim bool tensor on x's device: does x hold a NaN or inf? One read pass, no host sync
    (aminmax propagates NaN; ``isfinite(x).all()`` would allocate n bools and is ~20x slower on CPU)."""
    return bounds_nonfinite(torch.aminmax(x))


def bounds_nonfinite(bounds: Sequence[Tensor]) -> Tensor:
    """:func:`nonfinite` of a tensor from the (min, max) pairs of its parts, as 0-dim tensors in any order."""
    return torch.isfinite(torch.stack(tuple(bounds))).all().logical_not()


def _grown(t: Tensor, n: int) -> Tensor:
    out = t.new_zeros(n)
    out[:t.numel()].copy_(t)
    return out


class FaultFlags:
    """Device-side flags the hooks raise during a step; :class:`~lightning_topk.comm.controller.StepController`
    reads them once per step. ``inputs``: per bucket (keyed by parameter names), non-finite values in what
    this rank put into the exchange; ``result``: non-finite values in any rebuilt bucket."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # results arrive on communication threads
        self.inputs: Dict[Tuple[str, ...], Tensor] = {}
        self.result: Optional[Tensor] = None

    def note_input(self, names: Tuple[str, ...], x: Optional[Tensor], bad: Optional[Tensor] = None) -> Tensor:
        """Flag non-finite values in ``x`` (``bad``: its flag, when already known); returns the flag (a result
        that *is* ``x``, unchanged, can reuse it)."""
        if bad is None:
            assert x is not None, "note_input needs the values or their flag"
            bad = nonfinite(x)
        with self._lock:
            cur = self.inputs.get(names)
            self.inputs[names] = bad if cur is None else cur | bad
        return bad

    def note_result(self, x: Tensor, bad: Optional[Tensor] = None) -> None:
        """Flag non-finite values in a rebuilt bucket ``x`` (``bad``: its flag, when already known)."""
        bad = nonfinite(x) if bad is None else bad
        with self._lock:
            self.result = bad if self.result is None else self.result | bad

    def clear(self) -> None:
        with self._lock:
            self.inputs = {}
            self.result = None


def owner_undo_key(key: str) -> str:
    """The undo log's key of the owner residual ``key``."""
    return f"owner:{key}"


class UndoLog:
    """What a skipped step must restore: a copy of each bucket's residual (and velocity) taken just before
    the step's first in-place update of it, the exchange step counter at the start of the step, and the
    out-of-place changes of the step (owner residuals folded into the rank residuals). Active only while
    ``enabled`` (``nonfinite="skip"`` or a loss scaler); the copies are reused from step to step (4 B/param,
    8 with momentum correction).

    Why not only the O(k) sent entries: in-place error feedback adds ``grad/scale`` to every residual entry,
    and the local gradient is gone once the bucket buffer holds the average, so undoing the dense part
    needs a dense record of either the old residual or the gradient (see README, "Memory").
    """

    def __init__(self) -> None:
        self.enabled = False
        # The step counter a rollback restores; set by the step controller and by TopKState.load_state_dict.
        self.step = 0
        self._copies: Dict[Tuple[str, ...], Tuple[Tensor, Optional[Tensor]]] = {}
        self._saved: Dict[int, _BucketBuffers] = {}
        # Other per-rank state updated in place during a step (the scale-free exchange's owner residuals).
        self._tensor_copies: Dict[str, Tensor] = {}
        self._saved_tensors: Dict[str, Tensor] = {}
        self._undo: List[Callable[[], None]] = []

    def save_tensor(self, key: str, t: Tensor) -> None:
        """Copy ``t`` before the step's first in-place update of it (restored by :meth:`rollback`)."""
        if not self.enabled or key in self._saved_tensors:
            return
        copy = self._tensor_copies.get(key)
        if copy is None or copy.shape != t.shape or copy.device != t.device:
            copy = self._tensor_copies[key] = torch.empty_like(t)
        copy.copy_(t)
        self._saved_tensors[key] = t

    def save(self, b: _BucketBuffers) -> None:
        if not self.enabled or id(b) in self._saved:
            return
        res, vel = self._copies.get(b.names, (None, None))
        if (res is None or res.shape != b.residual.shape or res.device != b.residual.device
                or (vel is None) != (b.velocity is None)):  # a velocity started mid-run (recipe="auto" engaging)
            res = torch.empty_like(b.residual)
            vel = None if b.velocity is None else torch.empty_like(b.velocity)
            self._copies[b.names] = (res, vel)
        res.copy_(b.residual)
        if vel is not None and b.velocity is not None:
            vel.copy_(b.velocity)
        self._saved[id(b)] = b

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Register ``undo``, which reverts an out-of-place change of this step (run by :meth:`rollback`,
        latest first, after the copies are restored; dropped by :meth:`commit`)."""
        if self.enabled:
            self._undo.append(undo)

    def rollback(self) -> None:
        for b in self._saved.values():
            res, vel = self._copies[b.names]
            b.residual.copy_(res)
            if vel is not None and b.velocity is not None:
                b.velocity.copy_(vel)
        self._saved.clear()
        for key, t in self._saved_tensors.items():
            t.copy_(self._tensor_copies[key])
        self._saved_tensors.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def commit(self, live: Iterable[Tuple[str, ...]], live_tensors: Optional[Iterable[str]] = None) -> None:
        """The step stands. Copies of buckets not in ``live`` (DDP rebuilt them away) are freed, and so are
        tensor copies whose key is not in ``live_tensors`` (when given: owner residuals folded away)."""
        self._saved.clear()
        self._saved_tensors.clear()
        self._undo.clear()
        keep = set(live)
        for names in [n for n in self._copies if n not in keep]:
            del self._copies[names]
        if live_tensors is not None:
            keep_t = set(live_tensors)
            for key in [k for k in self._tensor_copies if k not in keep_t]:
                del self._tensor_copies[key]

    def clear(self) -> None:
        self._saved.clear()
        self._copies.clear()
        self._saved_tensors.clear()
        self._tensor_copies.clear()
        self._undo.clear()


@dataclass
class DebugRecord:
    """Test/debug aid (``enabled=True``): what this rank sent and the gradient it got, per parameter,
    in unscaled units. Costs copies and host syncs; off by default."""

    enabled: bool = False
    sent: Dict[str, Tensor] = field(default_factory=dict)
    grads_in: Dict[str, Tensor] = field(default_factory=dict)


class TopKState:
    """Explicit state object passed to the top-k comm hooks (as torch's PowerSGDState is).

    Args:
        config: the options.
        process_group: group of the flat exchange (default: the world).
        hier: the process groups of a nodes x local layout (:func:`~lightning_topk.comm.exchanges.hierarchical.make_groups`),
            for the exchanges that need them (hierarchical ones).
        num_nodes: nodes of the job (telemetry: which link the flat exchange's bytes cross).

    Exchange-specific state (process groups in use, collectives in flight, owner residuals, ``auto``'s
    plan) lives in the exchange objects (:mod:`lightning_topk.comm.exchanges`): ``exchange`` is the one
    the comm hook drives, ``exchanges`` every one built for this state by name (``auto``'s children too),
    each made on first use by :meth:`exchange_for`. Their checkpoint sections are saved under
    ``state_dict()["exchanges"]``.
    """

    def __init__(self, config: TopKConfig, process_group: Any = None, hier: Any = None,
                 num_nodes: int = 1) -> None:
        self.config = config
        self.schedule = config.schedule
        self.process_group = process_group
        self.groups: Any = hier
        self.num_nodes = num_nodes
        self.exchange: Any = None
        self.exchanges: Dict[str, Any] = {}
        self._sections: Dict[str, Dict[str, Any]] = {}  # loaded sections waiting for their exchange
        self.step = 0
        # Loss scale of the current backward: a float, or the scaler's scale as a device tensor (no host read).
        self.grad_scale: Scale = 1.0
        self.flags = FaultFlags()
        self.undo = UndoLog()
        self.debug = DebugRecord()
        self._names: Dict[int, str] = {}
        self._unbound: Dict[int, str] = {}
        self._buckets: Dict[Tuple[str, ...], _BucketBuffers] = {}
        self._owner: Dict[str, Tuple[str, ...]] = {}
        self._pending_load: Optional[Dict[Tuple[str, str], Tensor]] = None
        self.current = StepStats()
        self.last = StepStats()
        self.bucket_sizes: List[int] = []  # entries of each bucket of the last complete step, in launch order
        self._step_sizes: List[int] = []
        self.totals = StepStats()
        # Selection thresholds reused between steps (a speed hint; results do not depend on it, so it is
        # never saved or rolled back), by what was selected from: see kit.select.
        self.select_hints: Dict[Tuple[str, ...], ThresholdHint] = {}

    # ---- binding parameters to names -------------------------------------------------------
    @property
    def flat_group(self) -> Any:
        """The flat exchange's process group: ``process_group``, or the world by default."""
        import torch.distributed as dist

        return self.process_group if self.process_group is not None else dist.group.WORLD

    def bind(self, named_parameters: Iterable[Tuple[str, Tensor]]) -> None:
        """Tell the state the names of the model's parameters (keys of residuals in checkpoints)."""
        self._names = {id(p): n for n, p in named_parameters}

    def named_bound(self) -> List[Tuple[str, int]]:
        """(name, ``id`` of the parameter) of every bound parameter, as :meth:`bind` got them (ids only: the
        state holds no reference to the model)."""
        return [(n, i) for i, n in self._names.items()]

    def name_of(self, p: Tensor) -> str:
        """The bound name; an unbound parameter gets ``param<i>``, i in the order parameters are first seen
        (unique per parameter, and the same in every run of the same model)."""
        name = self._names.get(id(p))
        if name is None:
            name = self._unbound.setdefault(id(p), f"param{len(self._unbound)}")
        return name

    def names_of(self, params: Sequence[Tensor]) -> Tuple[str, ...]:
        return tuple(self.name_of(p) for p in params)

    def threshold_hint(self, key: Tuple[str, ...]) -> ThresholdHint:
        """The selection threshold hint kept under ``key`` (made on first use)."""
        h = self.select_hints.get(key)
        if h is None:
            h = self.select_hints[key] = ThresholdHint()
        return h

    # ---- residual storage -------------------------------------------------------------------
    def buffers(self, params: Sequence[Tensor], device: torch.device, multiple: int = 1) -> _BucketBuffers:
        """Flat residual (and velocity) buffers for a bucket holding ``params``, in bucket order, padded
        with zeros to a multiple of ``multiple`` entries."""
        names = self.names_of(params)
        numels = tuple(p.numel() for p in params)
        total = -(-sum(numels) // multiple) * multiple
        buf = self._buckets.get(names)
        if buf is not None:
            if buf.residual.numel() % multiple:  # first seen by the flat path (dense steps): pad it now
                buf.residual = _grown(buf.residual, total)
                buf.velocity = None if buf.velocity is None else _grown(buf.velocity, total)
            return buf
        residual = torch.zeros(total, dtype=torch.float32, device=device)
        velocity = torch.zeros_like(residual) if self.config.momentum_correction else None
        # Migrate what other buckets (before DDP's rebuild) or a loaded checkpoint held for these params.
        off = 0
        pending = self._pending_load or {}
        for name, n in zip(names, numels):
            old = pending.pop(("residual", name), None)
            old = self._param_view(name, "residual") if old is None else old
            if old is not None:
                residual[off:off + n].copy_(old.reshape(-1))
            if velocity is not None:
                oldv = pending.pop(("velocity", name), None)
                oldv = self._param_view(name, "velocity") if oldv is None else oldv
                if oldv is not None:
                    velocity[off:off + n].copy_(oldv.reshape(-1))
            off += n
        for name in names:
            prev = self._owner.get(name)
            if prev is not None and prev in self._buckets:
                self._buckets[prev].owned.discard(name)
                if not self._buckets[prev].owned:
                    del self._buckets[prev]
            self._owner[name] = names
        buf = _BucketBuffers(names, numels, residual, velocity, set(names))
        self._buckets[names] = buf
        return buf

    def start_velocity(self, config: TopKConfig, seeds: Dict[str, Tensor]) -> None:
        """Turn momentum correction on mid-run (``recipe="auto"`` engaging, :mod:`~lightning_topk.comm.recipe`):
        run with ``config`` from now on, every bucket that has buffers gets a velocity, started from ``seeds``
        (per parameter name; zero where none), and buckets made later take theirs from ``seeds`` too."""
        self.config = config
        seeds = dict(seeds)
        for b in self._buckets.values():
            if b.velocity is None:
                b.velocity = torch.zeros_like(b.residual)
                off = 0
                for name, n in zip(b.names, b.numels):
                    t = seeds.pop(name, None)
                    if t is not None:
                        b.velocity[off:off + n].copy_(t.reshape(-1))
                    off += n
        if seeds:
            pending = self._pending_load if self._pending_load is not None else {}
            for name, t in seeds.items():
                pending[("velocity", name)] = t
            self._pending_load = pending

    def holds_state(self, params: Sequence[Tensor]) -> bool:
        """Whether any of these parameters has a residual or velocity (live, or pending from a checkpoint).
        A dense step needs no buffers for parameters that have none: everything is sent, the residual
        stays zero. (Allocating them on DDP's first-iteration layout would double the residual memory
        at DDP's bucket rebuild, when old and new buffers live side by side.)"""
        pending = self._pending_load or {}
        for name in self.names_of(params):
            if self._owner.get(name) in self._buckets or ("residual", name) in pending or ("velocity", name) in pending:
                return True
        return False

    def _param_view(self, name: str, kind: str) -> Optional[Tensor]:
        sig = self._owner.get(name)
        if sig is None or sig not in self._buckets:
            return None
        b = self._buckets[sig]
        flat = b.residual if kind == "residual" else b.velocity
        if flat is None:
            return None
        off = 0
        for nm, n in zip(b.names, b.numels):
            if nm == name:
                return flat[off:off + n]
            off += n
        return None

    def undo_keys(self) -> List[str]:
        """The undo log's keys of tensors the exchanges still keep (see :meth:`UndoLog.commit`)."""
        return [k for ex in self.exchanges.values() for k in ex.undo_keys()]

    # ---- exchanges ----------------------------------------------------------------------------
    def layout(self) -> Any:
        """The :class:`~lightning_topk.comm.exchanges.base.Layout` of this state's group (the groups' when
        given, else one node of the whole group, or ``num_nodes`` nodes of it)."""
        import torch.distributed as dist

        from lightning_topk.comm.exchanges.base import Layout

        g = self.groups
        if g is not None:
            return Layout(g.num_nodes, g.local_world, g.node_rank * g.local_world + g.local_rank)
        group = self.flat_group
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank(group) if world > 1 else 0
        nodes = self.num_nodes if self.num_nodes > 0 and world % self.num_nodes == 0 else 1
        return Layout(nodes, world // nodes, rank)

    def exchange_for(self, name: str, layout: Any = None, **kwargs: Any) -> Any:
        """The exchange ``name`` of this state, built from the registry on first use (``kwargs``: what it
        needs, e.g. ``groups``), with its loaded checkpoint section applied."""
        ex = self.exchanges.get(name)
        if ex is None:
            from lightning_topk.comm.exchanges import registry

            kwargs.setdefault("groups", self.groups)
            ex = registry.get(name)(self, layout if layout is not None else self.layout(), **kwargs)
            self.exchanges[name] = ex
            ex.load_state_dict(self._sections.pop(name, None))
        return ex

    def take_section(self, name: str) -> Optional[Dict[str, Any]]:
        """The loaded checkpoint section of exchange ``name`` (removed: its exchange now holds it)."""
        return self._sections.pop(name, None)

    def release_orphans(self) -> None:
        """Loaded sections of exchanges this run does not use: each exchange class decides what to keep
        (the scale-free ones fold their owner residuals into the rank residuals). Call once the exchange
        is built and the state loaded."""
        from lightning_topk.comm.exchanges import registry

        for name in [n for n in self._sections if n not in self.exchanges and n in registry.choices()]:
            registry.get(name).orphan(self, self._sections.pop(name))

    @property
    def in_flight(self) -> bool:
        """Whether any exchange of this state has a collective launched and not waited for yet."""
        return any(ex.in_flight for ex in self.exchanges.values())

    def finish_in_flight(self) -> None:
        """Wait for every collective the exchanges still have in flight (a streamed outer round keeps its result
        as pending, as before a checkpoint; a pipelined bucket completes its future). Call on every rank when
        training ends: a collective left in flight at interpreter exit, with a Python callback on its future,
        aborts the process ("terminate called without an active exception")."""
        for ex in list(self.exchanges.values()):
            ex.flush(self)

    def bucket_names(self) -> List[Tuple[str, ...]]:
        """The parameter names of each live bucket."""
        return list(self._buckets)

    def take_pending(self, kind: str) -> Dict[str, Tensor]:
        """Remove and return the loaded per-parameter ``kind`` (``"residual"``/``"velocity"``) not applied to any
        bucket yet (local SGD has no buckets: it folds a per-step checkpoint's residuals into its own state)."""
        pending = self._pending_load or {}
        out = {n: t for (k, n), t in pending.items() if k == kind}
        for n in out:
            del pending[(kind, n)]
        return out

    def residuals(self) -> Dict[str, Tensor]:
        """Per-parameter flat views of this rank's residuals (a parameter that has none yet holds zero: dense
        steps allocate nothing)."""
        return self._per_param("residual")

    def velocities(self) -> Dict[str, Tensor]:
        """Per-parameter flat views of the momentum-correction velocities (empty when off)."""
        return self._per_param("velocity")

    def _per_param(self, kind: str) -> Dict[str, Tensor]:
        out = {}
        for b in self._buckets.values():
            flat = b.residual if kind == "residual" else b.velocity
            if flat is None:
                continue
            off = 0
            for nm, n in zip(b.names, b.numels):
                if nm in b.owned:
                    out[nm] = flat[off:off + n]
                off += n
        return out

    # ---- step bookkeeping -------------------------------------------------------------------
    def density_now(self) -> float:
        return self.schedule.density_at(self.step)

    def note_bucket(self, n: int) -> None:
        """A bucket of ``n`` entries is being exchanged (see :attr:`bucket_sizes`)."""
        self._step_sizes.append(n)

    def end_exchange(self) -> None:
        """Called when the last bucket of a backward pass has been launched."""
        self.bucket_sizes, self._step_sizes = self._step_sizes, []
        self.last = self.current
        self.step += 1
        self.current = StepStats(step=self.step)
        self.totals.resolve(ready_only=True)

    def add_stats(self, stats: StepStats, via: Optional[str] = None, /, **kw: int) -> None:
        """Add the counters ``kw`` to ``stats`` and the totals; ``via``: one bucket moved by that exchange."""
        for k, v in kw.items():
            setattr(stats, k, getattr(stats, k) + v)
            setattr(self.totals, k, getattr(self.totals, k) + v)
        if via is not None:
            for s in (stats, self.totals):
                s.buckets_by[via] = s.buckets_by.get(via, 0) + 1

    def add_time(self, stats: StepStats, name: str, start: Any) -> None:
        """Add the time since ``start`` (from :func:`clock`) to ``stats.<name>`` and the totals."""
        if isinstance(start, float):
            dt = time.perf_counter() - start
            setattr(stats, name, getattr(stats, name) + dt)
            setattr(self.totals, name, getattr(self.totals, name) + dt)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        stats._events.append((name, start, end))
        self.totals._events.append((name, start, end))

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's compression state; residuals keyed by parameter name, on CPU."""
        pending = self._pending_load or {}
        out: Dict[str, Any] = {"version": STATE_VERSION, "step": self.step, "config": asdict(self.config)}
        for kind, live in (("residual", self.residuals()), ("velocity", self.velocities())):
            d = {n: t.clone() for (k, n), t in pending.items() if k == kind}
            d.update({n: t.detach().cpu().clone() for n, t in live.items()})
            out[kind] = d
        sections = {n: dict(sd) for n, sd in self._sections.items()}
        sections.update({n: ex.state_dict() for n, ex in self.exchanges.items()})
        out["exchanges"] = {n: sd for n, sd in sections.items() if sd}
        return out

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (this version's or version 1's); residuals are applied as
        buckets appear, exchange sections as their exchanges exist (see :meth:`exchange_for`)."""
        self.step = int(sd["step"])
        pending: Dict[Tuple[str, str], Tensor] = {}
        for kind in ("residual", "velocity"):
            for name, t in dict(sd.get(kind, {})).items():
                pending[(kind, name)] = t
        self._buckets.clear()
        self._owner.clear()
        self.undo.clear()
        self.undo.step = self.step  # a skip right after the load goes back to the loaded step
        self._pending_load = pending
        sections = upgrade_sections(sd)
        for name, ex in self.exchanges.items():
            ex.load_state_dict(sections.pop(name, None))
        self._sections = sections


STATE_VERSION = 2


def upgrade_sections(sd: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The per-exchange sections of a state dict. Version 1 kept owner residuals at the top level (keys
    with a ``shard<l>of<L>/`` part are the hierarchical scale-free exchange's) and ``auto``'s plan as
    ``auto`` or (older) a per-rank ``plan`` keyed by bucket and k, which no longer applies."""
    sections = {n: dict(v) for n, v in dict(sd.get("exchanges", {}) or {}).items()}
    owner = dict(sd.get("owner_residual", {}) or {})
    if owner:
        for key, t in owner.items():
            name = "hierarchical_scatter" if "/shard" in key else "scatter"
            sections.setdefault(name, {}).setdefault("owner_residual", {})[key] = t
    if sd.get("auto"):
        sections.setdefault("auto", dict(sd["auto"]))
    return sections
