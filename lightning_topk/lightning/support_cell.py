"""The support matrix's cell of a running strategy (:mod:`lightning_topk.support`), and the refusal at setup.

:func:`check` runs at the start of every strategy's set-up (``topk_ddp`` and ``topk_fsdp``, Trainer and Fabric),
before the torchft replica, the process group or any collective exists."""
from __future__ import annotations

from typing import Any, Dict

from lightning_topk.support import refuse


def cell_of(strategy: Any) -> Dict[str, str]:
    """What the matrix knows of ``strategy`` at set-up: its options, layout, and (under the Trainer) the loop's
    optimization, end and callbacks. What shows only later (unused parameters) reads as ``plain``."""
    cfg = strategy.topk_config
    local = cfg.local_steps > 0 or cfg.mode == "local"
    fabric = hasattr(strategy, "_topk_fabric_setup")
    cell = {
        "strategy": "topk_fsdp" if getattr(strategy, "_elastic_sharded", False) else "topk_ddp",
        "api": "fabric" if fabric else "trainer",
        "mode": "local_sgd" if local else ("dense_steps" if cfg.dense_steps > 0 else "per_step"),
        "exchange": cfg.outer_exchange if local else cfg.exchange,
        "fault_tolerance": cfg.fault_tolerance,
        "layout": f"{strategy.num_nodes}x{strategy.num_processes}",
        "optimization": "automatic",
        "feature": "plain",
        "end": "max_steps",
    }
    module = None if fabric else getattr(strategy, "lightning_module", None)
    trainer = getattr(module, "_trainer", None)
    if module is not None and not module.automatic_optimization:
        cell["optimization"] = "manual"
    if trainer is not None:
        if trainer.max_steps == -1:
            cell["end"] = "max_epochs"
        if any(type(c).__name__ == "BackboneFinetuning" or hasattr(c, "unfreeze_and_add_param_group")
               for c in trainer.callbacks):
            cell["feature"] = "unfreeze"
    return cell


def check(strategy: Any) -> None:
    """Refuse the strategy's cell at set-up with the matrix's message, if the matrix refuses it."""
    refuse(cell_of(strategy))
