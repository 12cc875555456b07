"""The contract every exchange meets (:class:`Exchange`) and the layout it runs on (:class:`Layout`).

An exchange moves one DDP bucket at a time. It owns what is its own: process groups, collectives in
flight, options, extra per-rank state (the scale-free exchange's owner residuals) and the checkpoint
section that holds it, and its cost formula. What every exchange shares (options, step counter,
residual store, fault flags, undo log, telemetry) stays in :class:`~lightning_topk.comm.state.TopKState`.

Life of a step, as the comm hook drives it: ``hook`` for each bucket in DDP's order; before a bucket
that another exchange handled in the previous step, that one is asked to ``flush`` (finish what it has
in flight) and ``release`` the bucket's parameters (give back extra state, e.g. fold owner residuals into
the rank residuals); ``end_step`` once the last bucket is launched. After the optimizer step,
``after_optimizer_step(params)`` (a no-op here; local SGD uses it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from lightning_topk.support import message


@dataclass(frozen=True)
class Layout:
    """``nodes`` x ``local`` processes (node-major global ranks); this process is ``rank``."""

    nodes: int
    local: int
    rank: int = 0

    @property
    def world(self) -> int:
        return self.nodes * self.local


class Exchange:
    """Base class of the exchanges (see the module docstring). Subclasses set ``name`` through
    :func:`~lightning_topk.comm.exchanges.registry.register` and declare their requirements:

    * ``sparse``: sends top-k entries (``auto`` weighs it by ``TopKConfig.sparse_penalty``);
    * ``min_local``: processes per node it needs;
    * ``momentum_correction`` / ``parameter_scope``: whether it supports those options;
    * ``shared_state``: its checkpoint section is the same on every rank (saved once, in the main file);
    * ``bucket_layout``: its state sits at positions in the bucket (shards or owners' ranges), so DDP's bucket
      layout must be the same at every step, straight or resumed (the strategy keeps DDP from rebuilding it);
    * ``local_sgd``: the hook does not hand DDP the average over all ranks; the exchange between nodes
      happens in ``after_optimizer_step`` (sparse local SGD, ``local_steps`` > 0). The per-bucket contract
      (``tests/comm/test_contract.py``) does not apply, and ``auto`` never considers it.
    """

    name: ClassVar[str] = ""
    sparse: ClassVar[bool] = True
    min_local: ClassVar[int] = 1
    momentum_correction: ClassVar[bool] = True
    parameter_scope: ClassVar[bool] = True
    shared_state: ClassVar[bool] = False
    local_sgd: ClassVar[bool] = False
    bucket_layout: ClassVar[bool] = False

    def __init__(self, state: Any, layout: Optional[Layout] = None, **kwargs: Any) -> None:
        self.layout = layout

    # ---- options -------------------------------------------------------------------------------
    @classmethod
    def check(cls, config: Any, layout: Optional[Layout] = None) -> None:
        """Raise ``ValueError`` naming the options when this exchange cannot run under ``config`` (and, if
        given, on ``layout``)."""
        no_mc = config.momentum_correction and not cls.momentum_correction
        no_scope = config.selection_scope != "bucket" and not cls.parameter_scope
        if no_mc and no_scope:
            raise ValueError(f"topk_ddp: exchange={cls.name!r} supports neither momentum_correction nor "
                             "selection_scope='parameter'; use exchange='allgather' (or 'auto')")
        if no_mc:
            raise ValueError(f"topk_ddp: momentum_correction is not supported with exchange={cls.name!r}; "
                             "use exchange='allgather' or momentum_correction=false")
        if no_scope:
            raise ValueError(f"topk_ddp: selection_scope='parameter' is not supported with exchange={cls.name!r} "
                             "(resume would not be exact); use exchange='allgather' or selection_scope='bucket'")
        if layout is not None and layout.local < cls.min_local:
            raise ValueError(message("node_tier_one_process", exchange=cls.name, layout=f"1x{layout.local}"))

    # ---- the step --------------------------------------------------------------------------------
    def hook(self, state: Any, bucket: Any) -> Any:
        """Launch the exchange of ``bucket``; returns the future DDP waits on."""
        raise NotImplementedError

    def flush(self, state: Any) -> None:
        """Finish the collectives in flight (only device work is queued)."""

    @property
    def in_flight(self) -> bool:
        """Whether a collective of this exchange was launched and not waited for yet (:meth:`flush` waits)."""
        return False

    def release(self, state: Any, names: Sequence[str], numels: Sequence[int]) -> None:
        """The bucket of these parameters now travels another way: give back its extra state."""

    def end_step(self, state: Any) -> None:
        """The last bucket of the step has been launched."""

    def after_optimizer_step(self, params: Any) -> None:
        """After every optimizer-step attempt on ``params`` (named parameters): a step the controller
        skipped is reported too (local SGD counts attempts, so that every node reaches its outer round at
        the same step)."""

    def before_decision(self, state: Any) -> None:
        """Called by the step controller before it gathers the step's fault flags (an exchange whose hook
        did not see the step's gradients flags them here)."""

    def decision_group(self, state: Any) -> Any:
        """The process group of the :class:`~lightning_topk.comm.controller.StepController`'s per-step
        fault decision (its one all-reduce): all the ranks of the flat group here, since every rank
        applies the average of every rank's gradient. ``None`` means this process alone (no collective)."""
        return state.flat_group

    # ---- the cost model ----------------------------------------------------------------------------
    @classmethod
    def predict(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> Tuple[float, float]:
        """(compute seconds, link seconds) for a bucket of ``n`` entries sending ``k`` under the
        :class:`~lightning_topk.comm.cost.CostModel` ``model``; ``(inf, inf)`` where it cannot run."""
        return math.inf, math.inf

    @classmethod
    def wire(cls, model: Any, n: int, k: int, value_bytes: int = 4) -> float:
        """Bytes one rank puts on the wire (hierarchical exchanges: their inter-node part)."""
        return math.inf

    # ---- telemetry-driven refresh (``auto``) -------------------------------------------------------
    def refresh_due(self, state: Any) -> bool:
        """Whether this step's controller all-reduce should carry :meth:`take_window`."""
        return False

    def take_window(self) -> List[float]:
        return []

    def apply_refresh(self, state: Any, window: List[float]) -> None:
        """Apply the window reduced (mean) over the ranks."""

    # ---- checkpoint ----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This exchange's checkpoint section (plain CPU tensors and JSON types)."""
        return {}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        """Restore a section from :meth:`state_dict`."""

    @classmethod
    def orphan(cls, state: Any, sd: Dict[str, Any]) -> None:
        """A saved section of this exchange in a run that does not use it: keep what it holds where the
        running exchanges find it (e.g. owner residuals folded into the rank residuals), or drop it."""

    def undo_keys(self) -> List[str]:
        """Undo-log keys of tensors this exchange keeps (copies of others are freed at commit)."""
        return []
