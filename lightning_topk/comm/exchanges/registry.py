"""The catalogue of exchanges: names, their classes, the checks of options against a layout, and building.

It imports no exchange: the built-in ones are listed by module path and imported on first use, and
:func:`register` adds more (a new exchange is one module and one line, here or in user code)::

    @register("my_exchange")
    class MyExchange(Exchange): ...

``exchange="auto"`` considers every registered exchange whose requirements the options and the layout
meet (see :meth:`~lightning_topk.comm.exchanges.base.Exchange.check`), through its ``predict``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Tuple, Type

# name -> "module:Class" of the built-in exchanges, in the order auto lists its candidates
_BUILTIN: Dict[str, str] = {
    "dense": "lightning_topk.comm.exchanges.dense:DenseExchange",
    "dense_bf16": "lightning_topk.comm.exchanges.dense:DenseBf16Exchange",
    "allgather": "lightning_topk.comm.exchanges.allgather:AllgatherExchange",
    "hierarchical": "lightning_topk.comm.exchanges.hierarchical:HierarchicalExchange",
    "hierarchical_scatter": "lightning_topk.comm.exchanges.hierarchical:HierarchicalScatterExchange",
    "scatter": "lightning_topk.comm.exchanges.scatter:ScatterExchange",
    "local": "lightning_topk.comm.local.exchange:LocalExchange",
}
# Not a per-bucket exchange but a choice between them; a valid ``exchange`` option all the same.
_META: Dict[str, str] = {"auto": "lightning_topk.comm.exchanges.auto:AutoExchange"}
META = tuple(_META)
_extra: Dict[str, Type[Any]] = {}
_loaded: Dict[str, Type[Any]] = {}


def register(name: str) -> Callable[[Type[Any]], Type[Any]]:
    """Class decorator: make ``name`` an exchange (``exchange=name`` pins it; ``auto`` may choose it)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"exchange registry: a name must be an identifier, got {name!r}")

    def deco(cls: Type[Any]) -> Type[Any]:
        if name in META or (name in _BUILTIN and _BUILTIN[name] != f"{cls.__module__}:{cls.__name__}"):
            raise ValueError(f"exchange registry: {name!r} is taken")
        cls.name = name
        if name not in _BUILTIN:
            _extra[name] = cls
        _loaded[name] = cls
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove an exchange added by :func:`register` (built-in ones stay)."""
    if name in _BUILTIN:
        raise ValueError(f"exchange registry: {name!r} is built in")
    _extra.pop(name, None)
    _loaded.pop(name, None)


def names() -> Tuple[str, ...]:
    """Every registered exchange, built-in ones first."""
    return (*_BUILTIN, *_extra)


def choices() -> Tuple[str, ...]:
    """The values of the ``exchange`` option."""
    return (*META, *names())


def get(name: str) -> Type[Any]:
    """The class registered as ``name``."""
    cls = _loaded.get(name) or _extra.get(name)
    if cls is None:
        path = _BUILTIN.get(name) or _META.get(name)
        if path is None:
            raise ValueError(f"topk_ddp: exchange must be one of {list(choices())}, got {name!r}")
        module, _, attr = path.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        _loaded[name] = cls
    return cls


def check(config: Any, layout: Any, name: str) -> None:
    """Raise ``ValueError`` naming the options when ``name`` cannot run under ``config`` on ``layout``."""
    get(name).check(config, layout)


def available(config: Any, layout: Any) -> List[str]:
    """The registered exchanges that can run under ``config`` on ``layout`` (auto's candidates; sparse local
    SGD's ``local_sgd`` exchanges are not per-bucket choices and never listed)."""
    out = []
    for n in names():
        if getattr(get(n), "local_sgd", False):
            continue
        try:
            get(n).check(config, layout)
        except ValueError:
            continue
        out.append(n)
    return out


def build(name: str, state: Any, layout: Any, **kwargs: Any) -> Any:
    """A new exchange ``name`` for ``state`` on ``layout`` (``kwargs``: process groups and the like)."""
    cls = get(name)
    cls.check(state.config, layout)
    return cls(state, layout, **kwargs)
