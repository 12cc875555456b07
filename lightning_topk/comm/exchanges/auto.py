"""``exchange="auto"``: each bucket travels the way the cost model (:mod:`lightning_topk.comm.cost`)
predicts fastest, among the registered exchanges whose requirements the options and the layout meet.

**One plan, the same on every rank and in every run that asks for it.** The plan maps a bucket *size*
(its number of entries) to an exchange, decided once for the configured ``density`` (not per warm-up k),
so it holds one entry per distinct bucket size and does not depend on DDP's bucket layout. Near ties
never depend on timing noise (:func:`~lightning_topk.comm.cost.tie_break`). Where the model comes from
(``auto_model``):

* ``"constants"`` (and ``"auto"`` under ``Trainer(deterministic=True)`` /
  ``torch.use_deterministic_algorithms(True)``): no timing at all. The model is built from
  :data:`~lightning_topk.comm.cost.CONSTANTS` and ``auto_link_gbps``, so the plan is a pure function of
  the bucket sizes, the layout and the options, and it is never refreshed;
* ``"probe"`` (and ``"auto"`` otherwise): probed at setup (the slowest rank's figures, one all-reduce, so
  every rank holds the same model). Every ``REFRESH_STEPS`` exchanges the model is refreshed from
  telemetry (selection cost per entry, a link-time scale from measured over predicted exchange time),
  the mean over ranks carried by the step controller's one all-reduce per step, so the hooks read nothing
  on the host (without a controller, the slowest rank's, by an all-reduce of its own); a bucket size
  switches exchange only when the new choice's score is at least ``SWITCH_GAIN`` better.

The plan and the model are this exchange's checkpoint section, which is the same on every rank: it is
saved in the main checkpoint file (rank 0 writes it, every rank reads it), so a resumed run restores one
plan on every rank whatever each rank's residual shard holds, and does not probe again.

Its children are the candidate exchanges, built from the registry. A bucket that moves to another
exchange first lets the old one finish what it has in flight and give back the bucket's extra state
(``flush`` and ``release``: the scale-free exchanges fold its owner residual into the rank residuals).
"""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration.
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lightning_topk.comm import cost
from lightning_topk.comm.cost import CostModel, target_k
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.kit import bucket_k
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.wire import packed_nbytes

log = logging.getLogger(__name__)

REFRESH_STEPS = 100
SWITCH_GAIN = 0.9


class AutoExchange(Exchange):
    """The cost model, the candidates (built as children), and the plan: the exchange of each bucket size.

    ``timed``: the model came from a probe and is refreshed from telemetry; ``False`` for the constants
    model, which is never refreshed (see the module docstring)."""

    sparse = False
    shared_state = True

    def __init__(self, state: Any, layout: Optional[Layout] = None, model: Optional[CostModel] = None,
                 candidates: Optional[List[str]] = None, timed: bool = True, groups: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(state, layout)
        if model is None:
            raise ValueError("exchange='auto' needs a cost model (see lightning_topk.comm.exchanges.auto.build_auto)")
        self.model = model
        self.candidates = list(candidates if candidates is not None else ["dense", "dense_bf16", "allgather"])
        self.rank = layout.rank if layout is not None else 0
        self.timed = timed
        self.plan: Dict[str, str] = {}  # str(bucket entries) -> exchange
        self.controlled = False  # a StepController carries the refresh on its per-step all-reduce
        self.refreshes = 0
        # telemetry since the last refresh: selection seconds and entries, measured and predicted link seconds
        self._window = [0.0, 0.0, 0.0, 0.0]
        # the step being exchanged: predicted link seconds and entries of sparse buckets
        self._step = [0.0, 0.0]
        self.groups = groups
        self.children: Dict[str, Exchange] = {}
        if state is not None:
            for name in ["dense", *self.candidates]:
                self.child(state, name)

    def child(self, state: TopKState, name: str) -> Exchange:
        """The child exchange ``name``, built from the registry on first use."""
        ex = self.children.get(name)
        if ex is None:
            kw: Dict[str, Any] = {"groups": self.groups}
            if name == "dense":
                kw["dtype"] = torch.float32  # auto's "dense" is fp32; "dense_bf16" is the low-precision one
            ex = self.children[name] = state.exchange_for(name, layout=self.layout, **kw)
        return ex

    def decide(self, state: TopKState, n: int, k: int) -> Tuple[str, float, float]:
        """(choice, predicted seconds, predicted link seconds) for a bucket of ``n`` entries sending ``k``
        now; the choice is the plan's for this size, decided at the configured density when first seen."""
        vb = packed_nbytes(1, state.config.wire_dtype) - 4
        key = str(n)
        choice = self.plan.get(key)
        if choice is None:
            choice, pred = self.model.choose(n, target_k(state.config, n), self.candidates, vb,
                                             state.config.sparse_penalty)
            self.plan[key] = choice
            if self.rank == 0:
                log.info("topk_ddp exchange=auto: buckets of %d entries -> %s; predicted ms: %s", n, choice,
                         ", ".join(f"{c} {1e3 * t:.2f}" for c, t in pred.items()))
        comp, comm = self.model.predict(choice, n, k, vb)
        return choice, comp + comm, comm

    # ---- the step --------------------------------------------------------------------------------
    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        grad = bucket.buffer()
        n = grad.numel()
        stats = state.current
        if stats.buckets == 0:
            self.begin_step(state, grad.device)
        k = bucket_k(state, n)
        params = bucket.parameters()
        names = state.names_of(params)
        if k == 0:  # dense schedule step or small bucket: the flat hook's all-reduce, as ever
            choice = "dense"
            comp, comm = self.model.predict("dense", n, 0)
            predicted = comp + comm
        else:
            choice, predicted, comm = self.decide(state, n, k)
            if registry.get(choice).sparse:
                self._step[1] += n
        stats.predicted_s += predicted
        self._step[0] += comm
        numels = [p.numel() for p in params]
        for name, child in self.children.items():
            if name != choice:
                child.flush(state)
                child.release(state, names, numels)
        fut = self.child(state, choice).hook(state, bucket)
        if bucket.is_last():
            for name, child in self.children.items():
                if name != choice:
                    child.end_step(state)
        return fut

    def flush(self, state: TopKState) -> None:
        for child in self.children.values():
            child.flush(state)

    @property
    def in_flight(self) -> bool:
        return any(child.in_flight for child in self.children.values())

    def undo_keys(self) -> List[str]:
        return [k for child in self.children.values() for k in child.undo_keys()]

    def after_optimizer_step(self, params: Any) -> None:
        for child in self.children.values():
            child.after_optimizer_step(params)

    # ---- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Plain types: the plan, the model and whether it is timed (the rank-independent checkpoint part)."""
        return {"plan": dict(self.plan), "model": self.model.to_dict(), "timed": self.timed,
                "refreshes": self.refreshes}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        """Restore a saved plan (entries whose exchange is no candidate now are dropped) and, for the same
        layout and kind of model, the saved model. A plan saved by the other kind of model (probed against
        constants: ``auto_model`` changed between save and resume) is not restored: this run plans anew."""
        if not sd:
            return
        if bool(sd.get("timed")) != self.timed:  # made by the other kind of model (auto_model changed): re-plan
            if self.rank == 0:
                log.info("topk_ddp exchange=auto: the checkpoint's plan was made by a %s model and this run's "
                         "auto_model gives a %s one: the plan is made again by this run's model",
                         "probed" if sd.get("timed") else "constants", "probed" if self.timed else "constants")
            return
        self.plan = {str(k): v for k, v in dict(sd.get("plan", {})).items() if v in self.candidates}
        m = saved_model(sd, self.timed, self.model.nodes, self.model.local)
        if m is not None:
            self.model = m
            self.refreshes = int(sd.get("refreshes", 0))

    # ---- refresh from telemetry (timed models only) ------------------------------------------------
    def take_window(self) -> List[float]:
        """This rank's telemetry since the last refresh: [selection seconds per entry, measured / predicted
        link time] (0 where unknown); the window starts anew."""
        sel_s, sel_n, meas_comm, pred_comm = self._window
        self._window = [0.0, 0.0, 0.0, 0.0]
        return [sel_s / sel_n if sel_n else 0.0, meas_comm / pred_comm if pred_comm > 0 else 0.0]

    def refresh_due(self, state: TopKState) -> bool:
        return self.timed and bool(state.step) and state.step % REFRESH_STEPS == 0

    def refresh(self, state: TopKState, device: torch.device) -> None:
        """Refresh on its own (no step controller): the slowest rank's window, by one all-reduce read on the
        host inside the hook. With a controller the window rides on its per-step all-reduce instead."""
        vec = torch.tensor(self.take_window(), dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=state.process_group)
        self.apply_refresh(state, vec.cpu().tolist())

    def apply_refresh(self, state: TopKState, window: List[float]) -> None:
        """Re-fit selection cost and link-time scale from ``window`` (the same on every rank, see
        :meth:`take_window`); re-decide every bucket size."""
        per, ratio = window
        m = self.model
        if per > 0:
            m.select_per_elem = 0.5 * (m.select_per_elem + per)
        if ratio > 0:
            m.comm_scale = min(4.0, max(0.25, m.comm_scale * ratio))
        self.refreshes += 1
        vb = packed_nbytes(1, state.config.wire_dtype) - 4
        penalty = state.config.sparse_penalty
        for key, old in list(self.plan.items()):
            n = int(key)
            best, pred = m.choose(n, target_k(state.config, n), self.candidates, vb, penalty)
            score = {c: t * (penalty if registry.get(c).sparse else 1.0) for c, t in pred.items()}
            if best != old and score[best] < SWITCH_GAIN * score[old]:
                self.plan[key] = best
                if self.rank == 0:
                    log.info("topk_ddp exchange=auto: buckets of %d entries switch %s -> %s (predicted ms: %s)",
                             n, old, best, ", ".join(f"{c} {1e3 * t:.2f}" for c, t in pred.items()))

    def begin_step(self, state: TopKState, device: torch.device) -> None:
        """First bucket of an exchange: account the previous one (complete by now); without a step
        controller, refresh here when due."""
        if not self.timed:
            self._step = [0.0, 0.0]
            return
        if state.step:
            last = state.last.resolve(ready_only=True)  # CUDA: only the event pairs already done, no wait
            w = self._window
            w[0] += last.select_time_s
            w[1] += self._step[1]
            w[2] += last.comm_time_s
            w[3] += self._step[0]
        self._step = [0.0, 0.0]
        if not self.controlled and self.refresh_due(state):
            self.refresh(state, device)


AutoExchange.name = "auto"


def auto_topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for ``exchange="auto"``: ``state.exchange`` (an :class:`AutoExchange`) moves the bucket."""
    return state.exchange.hook(state, bucket)


def saved_model(sd: Optional[Dict[str, Any]], timed: bool, nodes: int, local: int) -> Optional[CostModel]:
    """The model saved in ``sd`` (:meth:`AutoExchange.state_dict`) if it is of the same kind and layout."""
    m = (sd or {}).get("model")
    if not isinstance(m, dict) or bool((sd or {}).get("timed")) != timed or (m.get("nodes"), m.get("local")) != (nodes, local):
        return None
    try:
        return CostModel.from_dict(m)
    except (TypeError, ValueError):
        return None


def candidates_for(config: Any, nodes: int, local: int, hierarchical_groups: bool) -> List[str]:
    """The exchanges ``auto`` may use under these options and this layout: every registered one whose
    requirements they meet (the hierarchical ones only with their groups and ``hierarchical`` not false)."""
    layout = Layout(nodes, local)
    out = []
    for name in registry.available(config, layout):
        cls = registry.get(name)
        if cls is AutoExchange:
            continue
        if getattr(cls, "needs_groups", False) and (config.hierarchical is False or not hierarchical_groups
                                                     or nodes < 2):
            continue
        if nodes * local < getattr(cls, "min_world", 1):
            continue
        out.append(name)
    return out


def build_auto(state: Optional[TopKState], config: Any, layout: Layout, device: torch.device, groups: Any = None,
               saved: Optional[Dict[str, Any]] = None) -> AutoExchange:
    """``exchange="auto"`` for this layout: the saved plan and model where ``saved`` (the checkpoint's
    rank-independent section, the same on every rank) has them, else a new model: probed (a collective:
    every rank calls this) or from the constants (see the module docstring)."""
    timed = cost.timed_model(config)
    model = saved_model(saved, timed, layout.nodes, layout.local)
    if model is None:
        intra = getattr(groups, "intra", None)
        inter = getattr(groups, "inter", None)
        model = cost.probe(layout.nodes, layout.local, layout.rank, config.density, config.selector, device,
                           intra, inter) if timed else \
            cost.constant_model(layout.nodes, layout.local, device.type, config.auto_link_gbps)
    auto = AutoExchange(state, layout, model=model,
                        candidates=candidates_for(config, layout.nodes, layout.local, groups is not None),
                        timed=timed, groups=groups)
    auto.load_state_dict(saved)
    return auto


def _constants(config: Any, layout: Layout, device_type: str) -> Tuple[CostModel, int]:
    """The timing-free cost model for ``layout`` and the value bytes per entry on the wire (as ``decide``)."""
    model = cost.constant_model(layout.nodes, layout.local, device_type, config.auto_link_gbps)
    return model, packed_nbytes(1, config.wire_dtype) - 4


def plan_for(config: Any, layout: Layout, device_type: str, sizes: List[int]) -> Dict[int, Tuple[str, float]]:
    """What ``exchange="auto"`` under the constants model would send each bucket size by, with its predicted
    seconds, on ``layout`` (no probe, no collective: a pure function of its arguments). Buckets the flat hook
    sends dense anyway (below ``min_sparse_numel``, or density 1) are ``"dense"``. Used to explain a run that
    pins an exchange (the run summary)."""
    model, vb = _constants(config, layout, device_type)
    cands = candidates_for(config, layout.nodes, layout.local, layout.nodes > 1 and layout.local > 1)
    out: Dict[int, Tuple[str, float]] = {}
    for n in sizes:
        if config.density >= 1.0 or n < config.min_sparse_numel:
            out[n] = ("dense", model.total("dense", n, 0))
            continue
        choice, pred = model.choose(n, target_k(config, n), cands, vb, config.sparse_penalty)
        out[n] = (choice, pred[choice])
    return out


def predicted_for(config: Any, layout: Layout, device_type: str, sizes: List[int], exchange: str) -> float:
    """Seconds the constants model predicts for one step of ``exchange`` over buckets of ``sizes``."""
    model, vb = _constants(config, layout, device_type)
    total = 0.0
    for n in sizes:
        dense = config.density >= 1.0 or n < config.min_sparse_numel
        total += model.total("dense" if dense else exchange, n, 0 if dense else target_k(config, n), vb)
    return total
