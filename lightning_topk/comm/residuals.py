"""Per-rank storage of the error-feedback residuals and momentum-correction velocities: one flat fp32
buffer per DDP bucket that the hooks update in place, keyed by *parameter names* (bound by
:meth:`ParamBuffers.bind`), so the buffers survive DDP's bucket rebuild after the first iteration and are
saved and restored per parameter. :class:`~lightning_topk.comm.state.TopKState` inherits it."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.faults import BucketBuffers


def _grown(t: Tensor, n: int) -> Tensor:
    out = t.new_zeros(n)
    out[:t.numel()].copy_(t)
    return out


class ParamBuffers:
    """Names of the bound parameters and the residual (and velocity) buffers of each bucket, with what a
    loaded checkpoint holds for buckets not made yet (``_pending_load``)."""

    config: TopKConfig

    def __init__(self) -> None:
        self._names: Dict[int, str] = {}
        self._unbound: Dict[int, str] = {}
        self._buckets: Dict[Tuple[str, ...], BucketBuffers] = {}
        self._owner: Dict[str, Tuple[str, ...]] = {}
        self._pending_load: Optional[Dict[Tuple[str, str], Tensor]] = None

    # ---- binding parameters to names -------------------------------------------------------
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
    # ---- residual storage -------------------------------------------------------------------
    def buffers(self, params: Sequence[Tensor], device: torch.device, multiple: int = 1) -> BucketBuffers:
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
        buf = BucketBuffers(names, numels, residual, velocity, set(names))
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
