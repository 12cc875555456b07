"""``outer_streaming`` (torch only): the round's all-gather is launched asynchronously and its result applied one
round late (at the end of the next round, before that round's exchange is launched): compute goes on while it
travels. The next round then starts from the ``θ_outer`` that does not yet include it, and its Δ is taken from
that start (``θ_anchor``). At the end of training the last one is applied
(:meth:`~lightning_topk.comm.local.round.OuterState.apply_in_flight`).
"""
from __future__ import annotations

import time
from typing import Any, Optional, Tuple

from torch import Tensor


class Flight:
    """At most one streamed all-gather in flight: its work, the gathered bytes, when it was launched and when it
    was first seen completed (for the share of its flight hidden behind compute)."""

    def __init__(self) -> None:
        self._flight: Optional[Tuple[Any, Tensor, float]] = None  # (work, gathered bytes, launch time)
        self._done_at: Optional[float] = None

    @property
    def active(self) -> bool:
        """Whether an exchange was launched and not waited for yet."""
        return self._flight is not None

    def launch(self, work: Any, gathered: Tensor) -> None:
        self._flight = (work, gathered, time.perf_counter())
        self._done_at = None

    def poll(self) -> None:
        """After an inner step: note when the exchange is first seen completed."""
        if self._flight is not None and self._done_at is None and self._flight[0].is_completed():
            self._done_at = time.perf_counter()

    def land(self) -> Tuple[Tensor, float]:
        """Wait for the exchange in flight (there must be one): (its gathered bytes, the share of its flight that
        was hidden behind compute)."""
        assert self._flight is not None
        work, gathered, t_launch = self._flight
        t_wait = time.perf_counter()
        if work is not None:
            work.wait()
        t_end = time.perf_counter()
        done = self._done_at if self._done_at is not None else t_end
        flight = max(done, t_wait) - t_launch
        hidden = (t_wait - t_launch) / flight if flight > 0 else 1.0
        hidden = min(1.0, hidden if self._done_at is None else 1.0)
        self.clear()
        return gathered, hidden

    def finish(self) -> Optional[Tensor]:
        """Wait for the exchange in flight, if any: its gathered bytes (None without one)."""
        if self._flight is None:
            return None
        work, gathered, _ = self._flight
        if work is not None:
            work.wait()
        self.clear()
        return gathered

    def clear(self) -> None:
        self._flight = None
        self._done_at = None
