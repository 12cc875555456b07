"""The torch-only core: selection, wire format, density schedule, per-rank state, the exchanges
(DDP communication hooks) and the per-step fault controller. Nothing here imports Lightning."""
from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.controller import Decision, StepController
from lightning_topk.comm.exchanges.allgather import topk_allgather_hook
from lightning_topk.comm.exchanges.hierarchical import hierarchical_topk_hook, make_groups
from lightning_topk.comm.exchanges.scatter import scatter_topk_hook
from lightning_topk.comm.schedule import DensitySchedule
from lightning_topk.comm.selection import topk_select
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.telemetry import StepStats

__all__ = [
    "Decision", "DensitySchedule", "StepController", "StepStats", "TopKConfig", "TopKState",
    "hierarchical_topk_hook", "make_groups", "scatter_topk_hook", "topk_allgather_hook", "topk_select",
]
