"""Registers ``topk_ddp`` / ``topk_ddp_spawn`` in Lightning's strategy registries, idempotently.

``pytorch_lightning`` and ``lightning.pytorch`` keep separate registries with separate DDPStrategy base
classes, so each gets its own subclass; so do Fabric's (``lightning.fabric`` and ``lightning_fabric``). Spawned children re-import this module: registering twice is
a no-op rather than Lightning's duplicate-name error.
"""
from __future__ import annotations

import importlib.util

NAMES = {"topk_ddp": "popen", "topk_ddp_spawn": "spawn"}


def _register(registry, cls) -> None:
    for name, start_method in NAMES.items():
        if name in registry:
            continue
        registry.register(
            name, cls, description=f"Top-k sparse DDP (lightning_topk), start_method '{start_method}'",
            start_method=start_method,
        )


def register_strategies() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    from lightning_topk.lightning.strategy import TopKDDPStrategy

    _register(StrategyRegistry, TopKDDPStrategy)
    if importlib.util.find_spec("lightning") is not None:
        try:
            from lightning.pytorch.strategies import StrategyRegistry as LRegistry
        except ImportError:  # a broken or partial `lightning` install must not break ours
            return
        from lightning_topk.lightning.unified import UnifiedTopKDDPStrategy

        _register(LRegistry, UnifiedTopKDDPStrategy)
    _register_fabric()


def _register_fabric() -> None:
    from lightning_topk.lightning.fabric import FABRIC_PACKAGES, fabric_strategy_class

    for package in FABRIC_PACKAGES:
        try:
            if importlib.util.find_spec(package) is None:
                continue
            registry = importlib.import_module(f"{package}.strategies").STRATEGY_REGISTRY
        except ImportError:  # a broken or partial install must not break ours
            continue
        _register(registry, fabric_strategy_class(package))
