"""Count host synchronisations, on CPU, in code meant to run on CUDA without any.

``with count_syncs() as c: ...; assert c.total == 0, c.calls``; :class:`SyncCounter` splits the
count between DDP comm hooks (with their future callbacks) and the rest of a training step.

A sync is anything that needs a device value on the host, or an output shape that depends on the
data (which CUDA has to read back first). Two nets catch them:

* a ``TorchDispatchMode`` sees the aten ops: ``_local_scalar_dense`` (``item``/``bool``/``int``/
  ``float`` of a tensor), ``nonzero``, ``masked_select``, ``unique*``, ``index``/``index_put_`` with
  bool or uint8 indices (``x[mask]``, ``x[mask] = v``), ``equal`` (returns a Python bool),
  ``bincount`` and ``repeat_interleave`` without ``output_size`` (their CUDA kernels read the
  maximum or the total back), and copies from a non-CPU device to the CPU;
* ``Tensor.item/__bool__/__int__/__float__/__index__/tolist/cpu/numpy`` are patched, because
  ``tolist``, ``cpu`` and ``numpy`` do not dispatch an aten op on CPU tensors.

A call caught by a patched method is counted once (the ops it dispatches inside are not counted
again). The patched methods see every thread; the dispatch mode, like every torch mode, only the
thread that entered the block (on CPU, DDP's comm hooks run there). Not seen: syncs inside an op's
own kernel other than the ops listed (the mode sees the op, not what its kernel calls), and blocking
host-to-device copies (``torch.tensor(..., device="cuda")``, ``.to("cuda")`` from pageable memory),
which wait for the stream on CUDA but are CPU-to-CPU here. ``torch.nonzero_static`` is sync-free on
CUDA (torch >= 2.6) and is not counted. On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the
complete check.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_ALWAYS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten.bincount.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
}
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
              _aten._index_put_impl_.default}
_METHODS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy")


class SyncCount:
    """``calls``: the name of every sync seen, in order (aten op or ``Tensor.<method>``)."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self._depth = 0   # > 0 inside a patched method: its own aten ops are not counted again

    @property
    def total(self) -> int:
        return len(self.calls)

    def __repr__(self) -> str:
        return f"SyncCount(total={self.total}, calls={self.calls})"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _is_sync(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    if func in _INDEX_OPS:
        return _bool_index(args[1])
    if func is _aten.repeat_interleave.Tensor or func is _aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    if func in (_aten._to_copy.default, _aten.copy_.default):
        src = args[0] if func is _aten._to_copy.default else args[1]
        dst = kwargs.get("device") if func is _aten._to_copy.default else args[0].device
        return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, count: SyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.count._depth == 0 and _is_sync(func, args, kwargs):
            self.count.calls.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCount]:
    """Count host syncs made inside the block (see the module docstring for what is seen)."""
    count = SyncCount()
    own = {name: torch.Tensor.__dict__.get(name) for name in _METHODS}  # None: inherited from TensorBase

    def patch(name, original):
        def wrapper(self, *args, **kwargs):
            if count._depth == 0:
                count.calls.append(f"Tensor.{name}")
            count._depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                count._depth -= 1
        return wrapper

    for name in _METHODS:
        setattr(torch.Tensor, name, patch(name, getattr(torch.Tensor, name)))
    try:
        with _Mode(count):
            yield count
    finally:
        for name, original in own.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


class _CounterMode(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.counter._count(str(func))
        return func(*args, **kwargs)


class SyncCounter:
    """Syncs inside DDP comm hooks (and the future callbacks they chain, on whichever thread) and outside.

    ``ddp.register_comm_hook(state, counter.wrap_hook(hook)); with counter: ...`` then
    ``counter.inside`` / ``counter.outside`` (Counters by op) and ``counter.hook_calls``. Same net as
    :func:`count_syncs`; dispatch modes are per thread, so ``torch.Future.then`` is patched to run
    callbacks chained inside a hook under the counter.
    """

    def __init__(self) -> None:
        self.inside: collections.Counter = collections.Counter()
        self.outside: collections.Counter = collections.Counter()
        self.hook_calls = 0
        self._tls = threading.local()
        self._own: Dict[str, Any] = {}
        self._then: Any = None
        self._mode: Optional[_CounterMode] = None

    def _count(self, kind: str) -> None:
        if getattr(self._tls, "in_method", False):  # already counted by the patched method
            return
        (self.inside if getattr(self._tls, "inside", False) else self.outside)[kind] += 1

    def _inside(self, fn: Callable, *args: Any) -> Any:
        prev, moded = getattr(self._tls, "inside", False), getattr(self._tls, "mode", False)
        self._tls.inside = self._tls.mode = True
        try:
            if moded:
                return fn(*args)
            with _CounterMode(self):
                return fn(*args)
        finally:
            self._tls.inside, self._tls.mode = prev, moded

    def wrap_hook(self, hook: Callable) -> Callable:
        """The hook, counted as "inside" (with the callbacks it chains)."""

        @functools.wraps(hook)
        def counted(state, bucket):
            self.hook_calls += 1
            return self._inside(hook, state, bucket)

        return counted

    def __enter__(self) -> "SyncCounter":
        counter = self
        self._own = {name: torch.Tensor.__dict__.get(name) for name in _METHODS}
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)

            def patched(t, *a, __orig=orig, __name=name, **k):
                counter._count(f"Tensor.{__name}")
                counter._tls.in_method = True
                try:
                    return __orig(t, *a, **k)
                finally:
                    counter._tls.in_method = False

            setattr(torch.Tensor, name, patched)
        then = self._then = torch._C.Future.then

        def then_patched(fut, callback):
            if getattr(counter._tls, "inside", False):
                return then(fut, lambda f: counter._inside(callback, f))
            return then(fut, callback)

        torch._C.Future.then = then_patched
        self._mode = _CounterMode(self)
        self._mode.__enter__()
        self._tls.mode = True
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._tls.mode = False
        torch._C.Future.then = self._then
        for name, original in self._own.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
