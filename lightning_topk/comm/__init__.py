"""The torch-only core: selection, wire format, density schedule, per-rank state and the exchanges
(DDP communication hooks). Nothing here imports Lightning."""
from lightning_topk.comm.allgather import topk_allgather_hook
from lightning_topk.comm.hierarchical import hierarchical_topk_hook
from lightning_topk.comm.scatter import scatter_topk_hook
from lightning_topk.comm.schedule import DensitySchedule
from lightning_topk.comm.selection import topk_select
from lightning_topk.comm.state import StepStats, TopKConfig, TopKState

__all__ = [
    "DensitySchedule", "StepStats", "TopKConfig", "TopKState", "hierarchical_topk_hook", "scatter_topk_hook",
    "topk_allgather_hook", "topk_select",
]
