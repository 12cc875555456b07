"""Registers ``topk_ddp`` / ``topk_ddp_spawn`` / ``topk_local`` and ``topk_local_wan`` (sparse local SGD presets), and
``topk_fsdp`` / ``topk_fsdp_local`` (FSDP2 inside the node) in
Lightning's strategy registries, idempotently.

``pytorch_lightning`` and ``lightning.pytorch`` keep separate registries with separate DDPStrategy base
classes, so each gets its own subclass; so do Fabric's (``lightning.fabric`` and ``lightning_fabric``). Spawned children re-import this module: registering twice is
a no-op rather than Lightning's duplicate-name error.
"""
from __future__ import annotations

import importlib.util

NAMES = {"topk_ddp": "popen", "topk_ddp_spawn": "spawn", "topk_local": "popen", "topk_local_wan": "popen"}
# Sparse local SGD's registered presets (docs/local_sgd.md says why; conf/strategy/<name>.yaml mirror them).
# The outer step (outer_lr, outer_momentum, outer_nesterov) is left to outer_recipe="auto": measured per inner
# optimizer (DiLoCo's 0.7 / Nesterov 0.9, the default before, diverged with SGD-momentum inner steps: issue 31).
LOCAL_DEFAULTS = dict(local_steps=16, outer_recipe="auto", outer_density=0.1, outer_chunk=4096, outer_value_bits=4,
                      outer_ef_decay=1.0, outer_streaming=False, outer_exchange="auto")
# For links of ~10 Mbit/s and below: 4x longer rounds, 2% of each chunk at 2 bits (one packet: 0.0007 bytes per
# parameter per inner step, against 0.011 for topk_local; outer.wire_bytes_per_param / local_steps).
WAN_DEFAULTS = dict(LOCAL_DEFAULTS, local_steps=64, outer_density=0.02, outer_value_bits=2)
PRESETS = {"topk_local": LOCAL_DEFAULTS, "topk_local_wan": WAN_DEFAULTS}
# FSDP2 inside the node (lightning_topk.lightning.fsdp): per step, and the local SGD preset.
FSDP_PRESETS = {"topk_fsdp": {}, "topk_fsdp_local": LOCAL_DEFAULTS}
DESCRIPTIONS = {
    name: "Sparse local SGD (lightning_topk): {H} local steps, then a top-k outer step of {d:g} at {b} bits".format(
        H=p["local_steps"], d=p["outer_density"], b=p["outer_value_bits"]) for name, p in PRESETS.items()}


def _register(registry, cls) -> None:
    for name, start_method in NAMES.items():
        if name in registry:
            continue
        extra = PRESETS.get(name, {})
        registry.register(
            name, cls, description=DESCRIPTIONS.get(name, "Top-k sparse DDP (lightning_topk)")
            + f", start_method '{start_method}'", start_method=start_method, **extra,
        )


def _register_fsdp(registry, cls) -> None:
    for name, extra in FSDP_PRESETS.items():
        if name not in registry:
            what = "sparse local SGD across nodes" if extra else "the top-k exchange across nodes"
            registry.register(name, cls, description=f"FSDP2 inside the node, {what} (lightning_topk)", **extra)


def register_strategies() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    from lightning_topk.lightning.fsdp import TopKFSDPStrategy, unified_fsdp_class
    from lightning_topk.lightning.strategy import TopKDDPStrategy

    _register(StrategyRegistry, TopKDDPStrategy)
    _register_fsdp(StrategyRegistry, TopKFSDPStrategy)
    if importlib.util.find_spec("lightning") is not None:
        try:
            from lightning.pytorch.strategies import StrategyRegistry as LRegistry
        except ImportError:  # a broken or partial `lightning` install must not break ours
            return
        from lightning_topk.lightning.unified import UnifiedTopKDDPStrategy

        _register(LRegistry, UnifiedTopKDDPStrategy)
        _register_fsdp(LRegistry, unified_fsdp_class())
    _register_fabric()


def _register_fabric() -> None:
    from lightning_topk.lightning.fabric import FABRIC_PACKAGES, fabric_strategy_class
    from lightning_topk.lightning.fsdp_fabric import fabric_fsdp_class

    for package in FABRIC_PACKAGES:
        try:
            if importlib.util.find_spec(package) is None:
                continue
            registry = importlib.import_module(f"{package}.strategies").STRATEGY_REGISTRY
        except ImportError:  # a broken or partial install must not break ours
            continue
        _register(registry, fabric_strategy_class(package))
        _register_fsdp(registry, fabric_fsdp_class(package))
