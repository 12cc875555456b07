"""``topk/*`` telemetry through Lightning's own logging.

The strategy adds one :func:`TopKTelemetry <telemetry_callback>` callback to ``trainer.callbacks``. Every
``log_every_n_steps`` optimizer steps (the steps on which Lightning writes to its loggers) it reduces this
step's :class:`~lightning_topk.comm.state.StepStats` over all ranks with one all-reduce of a small tensor,
issued on every rank at the same step, and logs the result with ``LightningModule.log``. So the metrics
are in ``trainer.callback_metrics`` on every rank, go to every logger, and ``topk/compression`` and
``topk/density`` are on the progress bar.

Reduced values: bytes and times are means per rank; ``topk/density`` and ``topk/compression`` are ratios of
the sums (all ranks' entries sent / entries, dense bytes / bytes sent).
"""
from __future__ import annotations

import functools
from typing import Dict, Tuple

import torch

from lightning_topk.comm.state import StepStats

PROG_BAR = ("topk/compression", "topk/density")


def compression_bytes(stats: StepStats) -> Tuple[float, float]:
    """(bytes this rank sent, bytes a dense exchange would have sent): the source of ``topk/compression``.

    Payload bytes for now (wire-level counts would replace them here).
    """
    return float(stats.bytes_sent), float(stats.bytes_dense)


def reduced_metrics(stats: StepStats, strategy) -> Dict[str, float]:
    """``topk/*`` of ``stats`` reduced over all ranks (a collective: call on every rank, in the same order)."""
    sent, dense = compression_bytes(stats)
    local = [sent, dense, stats.bytes_intra, stats.bytes_inter, stats.numel_sent, stats.numel,
             stats.select_time_s, stats.comm_time_s]
    world = max(1, int(strategy.world_size))
    t = torch.tensor(local, dtype=torch.float64, device=strategy.root_device)
    if world > 1:
        t = strategy.reduce(t, reduce_op="sum")
    sent, dense, intra, inter, numel_sent, numel, select_s, comm_s = t.tolist()
    return {
        "topk/bytes_sent": sent / world,
        "topk/bytes_dense": dense / world,
        "topk/bytes_intra": intra / world,
        "topk/bytes_inter": inter / world,
        "topk/density": numel_sent / numel if numel else 0.0,
        "topk/compression": dense / sent if sent else 0.0,
        "topk/select_ms": 1e3 * select_s / world,
        "topk/comm_ms": 1e3 * comm_s / world,
    }


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
