"""Telemetry of the exchange on one rank: :class:`StepStats` (per step and running totals, on
``TopKState.current`` / ``last`` / ``totals``), the start marks of timings (:func:`clock`) and the names of the
per-exchange bucket counters."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Tuple

import torch

from lightning_topk.comm.exchanges import registry


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
    out = list(registry.names())
    return out + [n for n in extra if n not in out]
