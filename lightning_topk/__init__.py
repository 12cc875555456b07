"""lightning_topk: top-k sparse gradient exchange with error feedback for PyTorch Lightning DDP.

Layers (imports point down only):

* ``lightning_topk.comm``: torch only. Selection, wire format, density schedule, state, the exchanges.
* ``lightning_topk.lightning``: thin Lightning glue (strategy, precision, checkpoint shards, faults).
* ``lightning_topk.data``, ``lightning_topk.optim``, ``lightning_topk.models``.
* ``lightning_topk.app``: the ``lightning-topk-train`` command, its factories, summary and plots.

``import lightning_topk`` registers the strategies ``topk_ddp`` and ``topk_ddp_spawn`` in every Lightning
package that is installed. The public names below are imported on first use (PEP 562), so
``from lightning_topk.comm import topk_select`` works with no Lightning package importable.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "DensitySchedule": "lightning_topk.comm",
    "StepStats": "lightning_topk.comm",
    "TopKConfig": "lightning_topk.comm",
    "TopKState": "lightning_topk.comm",
    "hierarchical_topk_hook": "lightning_topk.comm",
    "scatter_topk_hook": "lightning_topk.comm",
    "topk_allgather_hook": "lightning_topk.comm",
    "topk_select": "lightning_topk.comm",
    "TopKDDPStrategy": "lightning_topk.lightning.strategy",
    "TopKFSDPStrategy": "lightning_topk.lightning.fsdp",
    "UnifiedTopKDDPStrategy": "lightning_topk.lightning.unified",
    "UnifiedTopKPrecision": "lightning_topk.lightning.unified",
    "StepController": "lightning_topk.comm",
    "TopKPrecision": "lightning_topk.lightning.precision",
    "register_strategies": "lightning_topk.lightning.registry",
    "WebDataModule": "lightning_topk.data",
    "CacheStatsLogger": "lightning_topk.data",
    "write_shards": "lightning_topk.data",
    "FrozenVarianceAdamW": "lightning_topk.optim",
    "LAMB": "lightning_topk.optim",
    "LARS": "lightning_topk.optim",
    "SmallCNN": "lightning_topk.models",
}

__all__ = [
    "CacheStatsLogger",
    "DensitySchedule",
    "FrozenVarianceAdamW",
    "LAMB",
    "LARS",
    "SmallCNN",
    "StepController",
    "StepStats",
    "TopKConfig",
    "TopKDDPStrategy",
    "TopKFSDPStrategy",
    "TopKPrecision",
    "TopKState",
    "UnifiedTopKDDPStrategy",
    "UnifiedTopKPrecision",
    "WebDataModule",
    "hierarchical_topk_hook",
    "register_strategies",
    "scatter_topk_hook",
    "topk_allgather_hook",
    "topk_select",
    "write_shards",
    "__version__",
]

if TYPE_CHECKING:
    from lightning_topk.comm import (
        DensitySchedule,
        StepController,
        StepStats,
        TopKConfig,
        TopKState,
        hierarchical_topk_hook,
        scatter_topk_hook,
        topk_allgather_hook,
        topk_select,
    )
    from lightning_topk.data import CacheStatsLogger, WebDataModule, write_shards
    from lightning_topk.lightning.fsdp import TopKFSDPStrategy
    from lightning_topk.lightning.precision import TopKPrecision
    from lightning_topk.lightning.registry import register_strategies
    from lightning_topk.lightning.strategy import TopKDDPStrategy
    from lightning_topk.lightning.unified import UnifiedTopKDDPStrategy, UnifiedTopKPrecision
    from lightning_topk.models import SmallCNN
    from lightning_topk.optim import LAMB, LARS, FrozenVarianceAdamW


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_topk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))


def _register_if_lightning() -> None:
    try:
        import pytorch_lightning  # noqa: F401
    except ImportError:  # torch-only use: nothing to register
        return
    from lightning_topk.lightning.registry import register_strategies

    register_strategies()


_register_if_lightning()
