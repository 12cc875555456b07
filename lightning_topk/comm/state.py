"""Per-rank state of the top-k exchange: options, residuals (error feedback), momentum-correction
buffers, the step counter, and per-step telemetry.

Residuals are stored per DDP bucket as one flat fp32 buffer (no cat/split per step), but keyed by
*parameter names*, so they survive DDP's bucket rebuild after the first iteration and can be saved
and restored per parameter.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_topk.comm.schedule import DensitySchedule
from lightning_topk.comm.selection import METHODS
from lightning_topk.comm.wire import value_dtype_of

SCOPE_CHOICES = ("bucket", "parameter")
NONFINITE_CHOICES = ("propagate", "skip", "raise")
# How entries travel: chosen per bucket by a cost model ("auto"), or one algorithm for every bucket.
EXCHANGE_CHOICES = ("auto", "dense", "allgather", "hierarchical", "scatter")


@dataclass
class TopKConfig:
    """Options of the top-k exchange (documented in the README)."""

    density: float = 0.01
    selector: str = "exact"
    value_dtype: str = "fp32"
    error_feedback: bool = True
    momentum_correction: bool = False
    momentum: float = 0.9
    dense_steps: int = 1
    warmup_steps: int = 0
    warmup_start: float = 0.25
    min_sparse_numel: int = 16384
    hierarchical: object = "auto"
    nonfinite: str = "propagate"
    selection_scope: str = "bucket"
    exchange: str = "auto"

    def __post_init__(self) -> None:
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or not 0.0 < d <= 1.0:
            raise ValueError(f"topk_ddp: density must be a number in (0, 1], got {d!r}")
        self.density = float(d)
        if self.selector not in METHODS:
            raise ValueError(f"topk_ddp: selector must be one of {list(METHODS)}, got {self.selector!r}")
        try:
            value_dtype_of(self.value_dtype)
        except ValueError as e:
            raise ValueError(f"topk_ddp: {e}") from None
        for name in ("error_feedback", "momentum_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"topk_ddp: {name} must be true or false, got {getattr(self, name)!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"topk_ddp: momentum must be in [0, 1), got {self.momentum!r}")
        if self.momentum_correction and not self.error_feedback:
            raise ValueError("topk_ddp: momentum_correction=True needs error_feedback=True (it accumulates velocity)")
        if isinstance(self.min_sparse_numel, bool) or not isinstance(self.min_sparse_numel, int) or self.min_sparse_numel < 0:
            raise ValueError(f"topk_ddp: min_sparse_numel must be an int >= 0, got {self.min_sparse_numel!r}")
        if not (self.hierarchical == "auto" or isinstance(self.hierarchical, bool)):
            raise ValueError(f"topk_ddp: hierarchical must be 'auto', true or false, got {self.hierarchical!r}")
        if self.selection_scope not in SCOPE_CHOICES:
            raise ValueError(
                f"topk_ddp: selection_scope must be one of {list(SCOPE_CHOICES)}, got {self.selection_scope!r}"
            )
        if self.exchange not in EXCHANGE_CHOICES:
            raise ValueError(f"topk_ddp: exchange must be one of {list(EXCHANGE_CHOICES)}, got {self.exchange!r}")
        if self.hierarchical is True and self.exchange not in ("auto", "hierarchical"):
            raise ValueError(f"topk_ddp: hierarchical=true contradicts exchange={self.exchange!r}; set "
                             "exchange='hierarchical' (or 'auto') or leave hierarchical='auto'")
        if self.hierarchical is False and self.exchange == "hierarchical":
            raise ValueError("topk_ddp: hierarchical=false contradicts exchange='hierarchical'; leave "
                             "hierarchical='auto'")
        if self.exchange == "scatter" and self.momentum_correction:
            raise ValueError("topk_ddp: momentum_correction is not supported with exchange='scatter'; "
                             "use exchange='allgather' or momentum_correction=false")
        if self.nonfinite not in NONFINITE_CHOICES:
            raise ValueError(f"topk_ddp: nonfinite must be one of {list(NONFINITE_CHOICES)}, got {self.nonfinite!r}")
        try:
            DensitySchedule(self.density, self.dense_steps, self.warmup_steps, self.warmup_start)
        except ValueError as e:
            raise ValueError(f"topk_ddp: {e}") from None

    @property
    def schedule(self) -> DensitySchedule:
        return DensitySchedule(self.density, self.dense_steps, self.warmup_steps, self.warmup_start)

    @property
    def wire_dtype(self) -> torch.dtype:
        return value_dtype_of(self.value_dtype)


@dataclass
class StepStats:
    """Telemetry of one exchange step on this rank.

    Payload (what this rank hands to the collectives): ``bytes_sent``, ``bytes_dense`` (the all-reduce
    payload it replaced), ``bytes_intra`` / ``bytes_inter``. Wire (what leaves this rank for the algorithm
    actually used: ring all-reduce ``2(P-1)/P`` x payload, ring all-gather ``(P-1)`` x payload,
    all-to-all ``(P-1)`` blocks): ``bytes_wire``, and ``bytes_dense_wire`` for a dense fp32 ring all-reduce
    of the same buckets (a bf16 one sends half of that).
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
    dense_buckets: int = 0
    dense_bf16_buckets: int = 0
    allgather_buckets: int = 0
    hierarchical_buckets: int = 0
    scatter_buckets: int = 0
    nonfinite_buckets: int = 0

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

    def as_metrics(self) -> Dict[str, float]:
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
            "topk/buckets_dense": float(self.dense_buckets - self.dense_bf16_buckets),
            "topk/buckets_dense_bf16": float(self.dense_bf16_buckets),
            "topk/buckets_allgather": float(self.allgather_buckets),
            "topk/buckets_hierarchical": float(self.hierarchical_buckets),
            "topk/buckets_scatter": float(self.scatter_buckets),
        }


@dataclass
class _BucketBuffers:
    names: Tuple[str, ...]
    numels: Tuple[int, ...]
    residual: Tensor
    velocity: Optional[Tensor]
    owned: set = field(default_factory=set)
    # Reused scratch buffers (fresh large CPU tensors cost more in page faults than the math on them).
    work: Optional[Tensor] = None
    out: Optional[Tensor] = None

    def scratch(self, kind: str) -> Tensor:
        t = getattr(self, kind)
        if t is None:
            t = torch.empty_like(self.residual)
            setattr(self, kind, t)
        return t


class TopKState:
    """Explicit state object passed to the top-k comm hooks (as torch's PowerSGDState is)."""

    def __init__(self, config: TopKConfig, process_group=None) -> None:
        self.config = config
        self.schedule = config.schedule
        self.process_group = process_group
        # Hierarchical exchange: groups set by the strategy (see exchange_hier.HierGroups).
        self.hier = None
        self.hier_pending = None
        # Scale-free exchange (comm/scatter.py): options, the bucket waiting for its owner step, and the
        # owner-side residuals (this rank's region sums not yet forwarded), keyed by bucket.
        self.scatter = None
        self.scatter_pending = None
        self.owner_residuals: Dict[str, Tensor] = {}
        self._pending_owner: Dict[str, Tensor] = {}
        # exchange="auto": the cost model (comm/cost.py) and its choice per bucket.
        self.auto = None
        self.plan: Dict[str, str] = {}
        self.num_nodes = 1
        self.step = 0
        self.grad_scale = 1.0
        self.snapshot_residuals = False
        self.record_sent = False
        self.sent: Dict[str, Tensor] = {}
        self.grads_in: Dict[str, Tensor] = {}
        self.nonfinite_params: List[str] = []  # this rank's parameters that were non-finite going in
        self.nonfinite_seen = False  # an exchanged result was non-finite (on every rank alike)
        self._names: Dict[int, str] = {}
        self._buckets: Dict[Tuple[str, ...], _BucketBuffers] = {}
        self._owner: Dict[str, Tuple[str, ...]] = {}
        self._snapshots: Dict[Tuple[str, ...], Tuple[Tensor, Optional[Tensor]]] = {}
        self._pending_load: Optional[Dict[str, Tensor]] = None
        self.current = StepStats()
        self.last = StepStats()
        self.totals = StepStats()

    # ---- binding parameters to names -------------------------------------------------------
    def bind(self, named_parameters: Iterable[Tuple[str, Tensor]]) -> None:
        """Tell the state the names of the model's parameters (keys of residuals in checkpoints)."""
        self._names = {id(p): n for n, p in named_parameters}

    def name_of(self, p: Tensor, fallback_index: int) -> str:
        return self._names.get(id(p), f"param{fallback_index}")

    # ---- residual storage -------------------------------------------------------------------
    def buffers(self, params: Sequence[Tensor], device: torch.device) -> _BucketBuffers:
        """Flat residual (and velocity) buffers for a bucket holding ``params``, in bucket order."""
        names = tuple(self.name_of(p, i) for i, p in enumerate(params))
        buf = self._buckets.get(names)
        if buf is not None:
            return buf
        numels = tuple(p.numel() for p in params)
        total = sum(numels)
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

    def residuals(self) -> Dict[str, Tensor]:
        """Per-parameter flat views of this rank's residuals."""
        return self._per_param("residual")

    def velocities(self) -> Dict[str, Tensor]:
        """Per-parameter flat views of the momentum-correction velocities (empty when off)."""
        return self._per_param("velocity")

    def _per_param(self, kind: str) -> Dict[str, Tensor]:
        out = {}
        for b in self._buckets.values():
            flat = getattr(b, kind)
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

    def before_update(self, buf: _BucketBuffers) -> None:
        """Called by a hook just before it overwrites a bucket's residual."""
        if self.snapshot_residuals and buf.names not in self._snapshots:
            self._snapshots[buf.names] = (
                buf.residual.clone(),
                None if buf.velocity is None else buf.velocity.clone(),
            )

    def rollback_step(self) -> None:
        """Undo the residual updates of the last exchange (the optimizer step was skipped)."""
        for names, (res, vel) in self._snapshots.items():
            b = self._buckets.get(names)
            if b is None:
                continue
            b.residual.copy_(res)
            if vel is not None and b.velocity is not None:
                b.velocity.copy_(vel)
        self._snapshots.clear()

    def commit_step(self) -> None:
        """The optimizer step that used the last exchange was applied: drop the undo snapshots."""
        self._snapshots.clear()

    def end_exchange(self) -> None:
        """Called when the last bucket of a backward pass has been launched."""
        self.last = self.current
        self.step += 1
        self.current = StepStats(step=self.step)

    def add_stats(self, stats: StepStats, **kw) -> None:
        for k, v in kw.items():
            setattr(stats, k, getattr(stats, k) + v)
            setattr(self.totals, k, getattr(self.totals, k) + v)

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        """This rank's compression state; residuals keyed by parameter name, on CPU."""
        pending = self._pending_load or {}
        out: Dict[str, object] = {"version": 1, "step": self.step, "config": asdict(self.config)}
        for kind, live in (("residual", self.residuals()), ("velocity", self.velocities())):
            d = {n: t.clone() for (k, n), t in pending.items() if k == kind}
            d.update({n: t.detach().cpu().clone() for n, t in live.items()})
            out[kind] = d
        owner = {k: t.clone() for k, t in self._pending_owner.items()}
        owner.update({k: t.detach().cpu().clone() for k, t in self.owner_residuals.items()})
        out["owner_residual"] = owner
        out["plan"] = dict(self.plan)
        return out

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        """Restore a state from :meth:`state_dict`; residuals are applied as buckets appear."""
        self.step = int(sd["step"])
        pending = {}
        for kind in ("residual", "velocity"):
            for name, t in dict(sd.get(kind, {})).items():
                pending[(kind, name)] = t
        self._buckets.clear()
        self._owner.clear()
        self._snapshots.clear()
        self._pending_load = pending
        self.owner_residuals.clear()
        self._pending_owner = dict(sd.get("owner_residual", {}))
        self.plan = dict(sd.get("plan", {}))
