"""``topk/*`` telemetry through Lightning's own logging.

The strategy adds one :func:`TopKTelemetry <telemetry_callback>` callback to ``trainer.callbacks``. Every
``log_every_n_steps`` optimizer steps (the steps on which Lightning writes to its loggers) it reduces this
step's :class:`~lightning_topk.comm.telemetry.StepStats` over all ranks with one all-reduce of a small tensor,
issued on every rank at the same step, and logs the result with ``LightningModule.log``. So the metrics
are in ``trainer.callback_metrics`` on every rank, go to every logger, and ``topk/compression`` and
``topk/density`` are on the progress bar.

Under sparse local SGD (``local_steps`` > 0) the reduction spans the node's ranks only (no inter-node
collective between outer rounds): the outer bytes and densities are the same on every node, the times are
this node's.

Reduced values: bytes, times and bucket counts are means per rank; ``topk/density`` and the compression
figures are ratios of the sums (all ranks' entries sent / entries; wire bytes of a dense fp32 ring
all-reduce / wire bytes actually sent).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from lightning_topk.comm.telemetry import StepStats, bucket_counters

PROG_BAR = ("topk/compression", "topk/density")


_RATIOS = ("topk/density", "topk/compression", "topk/compression_bf16", "topk/payload_compression")


def reduced_metrics(stats: StepStats, strategy) -> Dict[str, float]:
    """``topk/*`` of ``stats`` reduced over all ranks (a collective: call on every rank, in the same order).

    Every counter of :class:`StepStats` (and its bucket count of every registered exchange) is summed over
    the ranks in one all-reduce; bytes, times and bucket counts are then reported as means per rank, and the ratios (density, compression) as ratios of the sums.
    """
    stats.resolve()
    names = [f.name for f in dataclasses.fields(StepStats) if not f.name.startswith("_")
             and f.name not in ("step", "buckets_by")]
    via = bucket_counters()  # every registered exchange, in the same order on every rank
    group, world = _scope(strategy)
    t = torch.tensor([float(getattr(stats, n)) for n in names] + [float(stats.buckets_by.get(n, 0)) for n in via],
                     dtype=torch.float64, device=strategy.root_device)
    if world > 1:
        kw = {} if group is None else {"group": group}  # the node's group (local SGD), else the strategy's own
        t = strategy.reduce(t, reduce_op="sum", **kw)
    vals = t.tolist()
    summed = StepStats(step=stats.step, **dict(zip(names, vals)), buckets_by=dict(zip(via, vals[len(names):])))
    return {k: (v if k in _RATIOS else v / world) for k, v in summed.as_metrics().items()}


def _scope(strategy) -> Tuple[Any, int]:
    """(group, size) the metrics are reduced over: every rank, except under sparse local SGD, where nothing may
    cross the node boundary between outer rounds: the node's ranks (its exchange's decision group)."""
    state = getattr(strategy, "topk_state", None)
    ex = getattr(state, "exchange", None)
    if getattr(ex, "local_sgd", False) and dist.is_available() and dist.is_initialized():
        group = ex.decision_group(state)
        return group, 1 if group is None else dist.get_world_size(group)
    return None, max(1, int(strategy.world_size))


@functools.lru_cache(maxsize=None)
def telemetry_callback(base: type) -> type:
    """The telemetry callback class for Lightning's ``Callback`` ``base`` (one per Lightning package)."""

    class TopKTelemetry(base):
        """Logs the strategy's reduced ``topk/*`` metrics every ``log_every_n_steps`` optimizer steps."""

        def __init__(self, strategy) -> None:
            self.strategy = strategy
            self._logged_step = -1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            state = self.strategy.topk_state
            step, every = trainer.global_step, trainer.log_every_n_steps
            # Lightning's own logging steps (it writes to the loggers when this step count is a multiple of
            # log_every_n_steps); a decision from the step counter alone is the same on every rank.
            if state is None or every < 1 or step == self._logged_step or step % every != 0:
                return
            self._logged_step = step
            for name, value in reduced_metrics(state.last, self.strategy).items():
                pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name in PROG_BAR,
                              sync_dist=False, batch_size=1)
            elastic = getattr(self.strategy, "topk_elastic", None)
            if elastic is not None:  # fault_tolerance="torchft": this replica group's view (no collective)
                for name, value in elastic.metrics().items():
                    pl_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)

    TopKTelemetry.__qualname__ = "TopKTelemetry"
    return TopKTelemetry


def attach(strategy, trainer) -> None:
    """Make sure ``trainer.callbacks`` holds exactly one telemetry callback, bound to ``strategy``."""
    cls = telemetry_callback(_callback_base(trainer))
    for c in trainer.callbacks:
        if isinstance(c, cls):
            c.strategy = strategy
            return
    trainer.callbacks.append(cls(strategy))


def _callback_base(trainer) -> type:
    if type(trainer).__module__.startswith("lightning.pytorch"):
        from lightning.pytorch import Callback
    else:
        from pytorch_lightning import Callback
    return Callback


class TelemetryMixin:
    """The strategies' telemetry: ``topk_stats`` / ``topk_totals`` read the hooks' state (``topk_state``), and
    :meth:`_log_topk`, called after each optimizer step, keeps the logging callback in ``trainer.callbacks``."""

    @property
    def log_telemetry(self) -> bool:
        return self.topk_config.log_telemetry

    @property
    def topk_stats(self) -> StepStats:
        """Telemetry of the last completed exchange on this rank (bytes, density, times)."""
        return self.topk_state.last.resolve() if self.topk_state is not None else StepStats()

    @property
    def topk_totals(self) -> StepStats:
        """Telemetry summed over all exchanges since the state was created."""
        return self.topk_state.totals.resolve() if self.topk_state is not None else StepStats()

    def _log_topk(self) -> None:
        """Make sure the telemetry callback is in ``trainer.callbacks`` (it logs ``topk/*`` through
        ``LightningModule.log``). Called after each step."""
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if self.log_telemetry and trainer is not None:
            attach(self, trainer)
