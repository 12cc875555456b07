"""lightning_topk: top-k sparse gradient exchange with error feedback for PyTorch Lightning DDP.

``import lightning_topk`` registers the strategies ``topk_ddp`` and ``topk_ddp_spawn``.
"""
from lightning_topk.data import WebDataModule, write_shards
from lightning_topk.exchange import topk_allgather_hook
from lightning_topk.exchange_hier import hierarchical_topk_hook
from lightning_topk.precision import TopKPrecision
from lightning_topk.registry import register_strategies
from lightning_topk.schedule import DensitySchedule
from lightning_topk.selection import topk_select
from lightning_topk.state import StepStats, TopKConfig, TopKState
from lightning_topk.strategy import TopKDDPStrategy

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "DensitySchedule",
    "StepStats",
    "TopKConfig",
    "TopKDDPStrategy",
    "TopKPrecision",
    "WebDataModule",
    "hierarchical_topk_hook",
    "write_shards",
    "TopKState",
    "__version__",
    "register_strategies",
    "topk_allgather_hook",
    "topk_select",
]
