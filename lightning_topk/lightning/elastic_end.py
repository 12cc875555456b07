"""How a per-step run under torchft ends together, under ``max_epochs`` as under ``max_steps`` (docs/elastic.md,
"How a run ends"). Used by :class:`~lightning_topk.lightning.elastic.ElasticMixin`.

- **A heal mid-run takes the peers' place in the epoch.** A group that was late for a quorum heals at the next
  one with the peers' step count, but its own loader is a batch (or more) behind theirs: its epochs would end
  after theirs (under ``max_epochs`` it ran one step more, alone). The batches it owes are counted as run
  (:func:`owed_batches`, :func:`skip_batches`), so its epochs end at the peers' step.
- **The farewell.** A group that finished its last step forms one more quorum (:meth:`Farewell.leave`) and
  exchanges one flag in it (:meth:`Farewell.barrier`), so that a group late for the last quorum heals there to the
  final step and ends with it instead of waiting alone for a quorum that no one else will join.
- **The last batch without a quorum.** A group whose quorum for its final step fails (its peers finished without
  it and left) ends without that step (:class:`RunEnded`), one committed step behind, with a warning, instead of
  failing.
"""
from __future__ import annotations

import logging
import math
from datetime import timedelta
from typing import Any, Dict, Optional

import torch

from lightning_topk.lightning.elastic_position import loop_position

log = logging.getLogger(__name__)


class RunEnded(StopIteration):
    """Raised from the strategy's ``on_train_batch_start``: Lightning's epoch loop ends the epoch on a
    ``StopIteration`` without running the batch, and ``trainer.should_stop`` ends the fit."""


def steps_left(trainer: Any) -> float:
    """Optimizer steps this fit still has to run (``max_steps``, or ``max_epochs`` x the steps of an epoch)."""
    total = trainer.estimated_stepping_batches
    return float(total) - trainer.global_step if total is not None and not math.isinf(total) else math.inf


def owed_batches(trainer: Any, peer_loop: Optional[Dict[str, Any]]) -> int:
    """Batches the peer's fit loop (its data position, :func:`~lightning_topk.lightning.elastic_position.data_position`)
    is ahead of this one's, across epochs; 0 without a finite epoch length."""
    pos = loop_position(peer_loop) if peer_loop else {}
    n = trainer.num_training_batches
    if not pos or not isinstance(n, int) or n <= 0:
        return 0
    own = trainer.current_epoch * n + trainer.fit_loop.epoch_loop.batch_progress.current.completed
    return max(0, pos["epoch"] * n + pos["batch"] - own)


def skip_batches(trainer: Any, owed: int) -> int:
    """Skip up to ``owed`` batches of the current epoch after the one starting now: the loader's (fetched and
    dropped, so a loader that follows the position stays on it) and the loop's count (the epoch then ends when the
    peers' does). Returns the batches still owed, which the next epoch's first batch takes."""
    if owed <= 0:
        return 0
    loop = trainer.fit_loop.epoch_loop
    bp = loop.batch_progress
    k = max(0, min(owed, trainer.num_training_batches - bp.current.ready))
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    for _ in range(k if fetcher is not None else 0):
        try:
            next(fetcher)
        except StopIteration:
            break
    for c in (bp.current, bp.total):
        for f in ("ready", "started", "processed", "completed"):
            setattr(c, f, getattr(c, f) + k)
    if fetcher is not None:
        bp.is_last_batch = bool(getattr(fetcher, "done", False))
    return owed - k


class Farewell:
    """How one replica (a ``TorchFTReplica``) ends its run (see the module docstring): the batches it owes after a
    heal, the farewell quorum, the last step without a quorum. ``trainer``: None under Fabric (nothing to do)."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.ended: Optional[str] = None  # why this group ended before its last step, if it did
        self.done = False  # this group took part in a farewell quorum already
        self.heals = False  # a member of the last quorum was behind (it heals in it): set by the quorum's tap
        self.owed = 0  # batches the peers ran while this group was late (set by a heal mid-run)

    def after_quorum(self, trainer: Any, healed: bool) -> None:
        """After the step's quorum: count the owed batches as run; healed to the run's end (in the peers' farewell
        quorum), take part in its barrier and end the fit without this batch."""
        if trainer is None:
            return
        self.owed = skip_batches(trainer, self.owed)
        if healed and steps_left(trainer) <= 0:
            self.barrier()
            self.done = True
            trainer.should_stop = True
            note = f"healed to the final step {self.replica.step} in the peers' farewell quorum: the run ends here"
            log.warning("%s: %s", self.replica.name, note)
            raise RunEnded(note)

    def quorum_failed(self, trainer: Any, e: BaseException) -> None:
        """The step's quorum failed: on the run's last step, end without it (:meth:`end_behind`); else return (the
        caller raises)."""
        if trainer is not None and steps_left(trainer) <= 1:  # the peers finished the run without this group
            trainer.should_stop = True
            self.end_behind(e)

    def barrier(self) -> None:
        """One flag summed over the farewell quorum just formed, when a member of it healed there (every member sees
        that alike): the finished groups stay until the laggard has healed from them. Without a heal there is no
        collective, so a group that is still training (it stops later by its own rule) meets no stray one. A failure
        is the group's (no raise)."""
        group = self.replica.group
        if group is not None and self.heals and self.replica.manager.num_participants() > 1:
            group.all_reduce(torch.ones(1)).wait()

    def leave(self, trainer: Any) -> None:
        """After this group's last step: one more quorum (a laggard heals in it), then the barrier. Bounded by
        ``ft_timeout``; no quorum (fewer than ``min_replicas`` groups left) is not an error here."""
        r = self.replica
        if trainer is None or r.manager is None or self.ended is not None or self.done:
            return
        self.done = True
        try:
            r.manager.start_quorum(timeout=timedelta(seconds=r.config.ft_timeout))
        except Exception as e:  # the peers are gone: nothing to wait for
            log.info("%s: no farewell quorum at step %d (%s)", r.name, r.step, e)
            return
        self.barrier()

    def end_behind(self, e: BaseException) -> None:
        """The quorum of this group's last step failed: end the fit without it (one committed step behind)."""
        r = self.replica
        self.ended = (f"the quorum of the last step failed ({e}): the other replica groups finished the run without "
                      f"this one, which ends one committed step behind them (ft/step {r.step})")
        log.warning("%s: %s", r.name, self.ended)
        raise RunEnded(self.ended) from e
