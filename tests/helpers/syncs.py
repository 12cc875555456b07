"""Count host synchronisations, inside DDP comm hooks (and the callbacks of the futures they chain) and outside.

What counts as a sync (on CPU nothing blocks, so this is what *would* make the host wait for a GPU):

* ops seen by a ``TorchDispatchMode``: ``aten._local_scalar_dense`` (item/float/int/bool of a tensor),
  ``aten.nonzero``, ``aten.masked_select``, ``aten.unique*``/``aten._unique*``, and ``aten.index`` with a
  bool/uint8 index (boolean-mask indexing);
* calls of ``Tensor.item/__bool__/__int__/__float__/__index__/tolist/cpu/numpy`` (patched on the class,
  so they are seen on every thread).

Dispatch modes are per thread, and gloo runs future callbacks on its own threads; ``torch.Future.then`` is
patched so that a callback chained inside a hook runs under the counter as "inside" on whichever thread.

    counter = SyncCounter()
    ddp.register_comm_hook(state, counter.wrap_hook(topk_allgather_hook))
    with counter:
        ...  # steps
    counter.inside, counter.outside  # Counters by kind
"""
from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_OPS = {"_local_scalar_dense", "nonzero", "masked_select"}
_METHODS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy")


def _kind(func: Any, args: tuple) -> str | None:
    name = func._overloadpacket.__name__
    if name in _OPS or "unique" in name:
        return name
    if name == "index" and len(args) > 1:
        idx = args[1]
        if any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx or ()):
            return "index(bool)"
    return None


class _Mode(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _kind(func, args)
        if kind is not None:
            self.counter._count(kind)
        return func(*args, **(kwargs or {}))


class SyncCounter:
    def __init__(self) -> None:
        self.inside: collections.Counter = collections.Counter()
        self.outside: collections.Counter = collections.Counter()
        self.hook_calls = 0
        self._tls = threading.local()
        self._saved: Dict[str, Any] = {}
        self._mode: _Mode | None = None

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _count(self, kind: str) -> None:
        if getattr(self._tls, "in_method", False):  # already counted by the patched method
            return
        (self.inside if getattr(self._tls, "inside", False) else self.outside)[kind] += 1

    def _inside(self, fn: Callable, *args: Any) -> Any:
        prev, moded = getattr(self._tls, "inside", False), getattr(self._tls, "mode", False)
        self._tls.inside = self._tls.mode = True
        try:
            if moded:  # this thread already runs under the counter's mode
                return fn(*args)
            with _Mode(self):
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

    # ---- patches -------------------------------------------------------------------------------------
    def __enter__(self) -> "SyncCounter":
        counter = self
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def patched(t, *a, __orig=orig, __name=name, **k):
                counter._count(__name)
                counter._tls.in_method = True
                try:
                    return __orig(t, *a, **k)
                finally:
                    counter._tls.in_method = False

            setattr(torch.Tensor, name, patched)
        then = torch._C.Future.then
        self._saved["then"] = then

        def then_patched(fut, callback):
            if getattr(counter._tls, "inside", False):
                return then(fut, lambda f: counter._inside(callback, f))
            return then(fut, callback)

        torch._C.Future.then = then_patched
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._tls.mode = True
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._tls.mode = False
        torch._C.Future.then = self._saved.pop("then")
        for name in _METHODS:
            setattr(torch.Tensor, name, self._saved.pop(name))
