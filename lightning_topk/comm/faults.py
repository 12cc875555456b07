"""What a step records for its fault handling: the per-bucket storage the undo log copies
(:class:`BucketBuffers`), the device-side non-finite flags the hooks raise (:class:`FaultFlags`), and the undo
copies a skipped step restores (:class:`UndoLog`). :class:`~lightning_topk.comm.controller.StepController`
reads the flags and commits or rolls back."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


@dataclass
class BucketBuffers:
    """A bucket's flat residual (and velocity) buffers, keyed by its parameters' names (``owned``: the names
    whose state this bucket holds now)."""


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
        self._saved: Dict[int, BucketBuffers] = {}
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

    def save(self, b: BucketBuffers) -> None:
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

