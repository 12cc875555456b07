"""Exchanges: how a bucket's entries travel. One module per exchange, a registry
(:mod:`~lightning_topk.comm.exchanges.registry`), the contract (:mod:`~lightning_topk.comm.exchanges.base`)
and the shared toolkit (:mod:`~lightning_topk.comm.exchanges.kit`)."""
from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.registry import available, build, check, get, names, register, unregister

__all__ = ["Exchange", "Layout", "available", "build", "check", "get", "names", "register", "unregister"]
