"""Where the Trainer's fit loop is, for a replica group that joins under torchft (:mod:`lightning_topk.lightning.elastic`):
the loop progress and resumable loaders' state a heal carries, and the step count a healed replica takes."""
from __future__ import annotations

from typing import Any, Dict

_PROGRESS_KEYS = ("epoch_loop.batch_progress", "epoch_loop.automatic_optimization.optim_progress",
                  "epoch_loop.manual_optimization.optim_step_progress")


def data_position(trainer: Any, step_done: bool) -> Dict[str, Any]:
    """The fit loop's checkpoint state (Lightning's loop progress: epoch, batch index, optimizer steps; and the
    state of every training loader that implements ``state_dict``), deep-copied, at a batch boundary: the batch
    in flight counts as done with ``step_done`` (local SGD's round-end quorum runs after the batch's optimizer
    step: its progress counters are set to their ``ready`` values), else as not begun (the per-step quorum runs
    before the batch's forward pass: they are set to their ``completed`` values). A loader that follows the
    trainer's position (:class:`~lightning_topk.data.WebLoader` with its ``position_fn``) then starts at the
    batch the peers run next."""
    import copy

    sd = copy.deepcopy(trainer.fit_loop.state_dict())

    def settle(d: Any) -> None:
        if isinstance(d, dict):
            if "ready" in d and "completed" in d:
                v = d["ready"] if step_done else d["completed"]
                for k in ("ready", "started", "processed", "completed"):
                    if k in d:
                        d[k] = v
            for x in d.values():
                settle(x)

    for key in _PROGRESS_KEYS:
        settle(sd.get(key))
    inner = sd.get("epoch_loop.state_dict", {})
    if step_done and "_batches_that_stepped" in inner:
        inner["_batches_that_stepped"] += 1
    return sd


def loop_position(loop: Dict[str, Any]) -> Dict[str, int]:
    """(epoch, batch index in it, optimizer steps) of a :func:`data_position` (telemetry and tests)."""
    try:
        epoch = int(loop["epoch_progress"]["current"]["processed"])
        batch = int(loop["epoch_loop.batch_progress"]["current"]["completed"])
        steps = int(loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"])
    except (KeyError, TypeError):
        return {}
    return {"epoch": epoch, "batch": batch, "steps": steps}


def set_global_step(trainer: Any, step: int) -> None:
    """Give a healed replica its peer's Trainer step count (optimizer-step attempts, committed or not: the same on
    every replica of a quorum), so that ``max_steps``, schedulers stepped by interval and logging stay aligned."""
    loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        progress = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        progress = loop.manual_optimization.optim_step_progress.total
    progress.ready = progress.completed = step
    loop._batches_that_stepped = step
