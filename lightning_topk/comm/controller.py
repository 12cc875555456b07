"""One decision per step for gradient faults, identical on every rank of the decision group.

The hooks only raise device-side flags (:class:`~lightning_topk.comm.faults.FaultFlags`): non-finite values
in what a rank put into the exchange, and in each bucket's whole rebuilt result. :meth:`StepController.finish_step`
gathers them, together with a loss scaler's ``found_inf``, into one tiny tensor, reduces it across ranks
with **one** all-reduce, reads it to the host (the one host sync per step, outside the hooks) and decides.
The all-reduce spans the exchange's :meth:`decision_group <lightning_topk.comm.exchanges.base.Exchange.decision_group>`:
every rank, except under sparse local SGD (``exchange="local"``), where a node is one replica and decides its
inner steps alone (its ranks; no collective at all with one process per node), so that no inner step waits
for another node. The decision on the pseudo-gradient at the outer round stays global
(:mod:`lightning_topk.comm.local`). The policy:

* no fault: commit (the residual updates of the step stand);
* a loss scaler is in charge (fp16): the scaler's skip applies on every rank alike (its ``found_inf`` is
  replaced by the global verdict) and the residuals are rolled back;
* otherwise by ``nonfinite``: ``"raise"`` raises ``FloatingPointError`` on every rank of the group, ``"skip"`` rolls the
  residuals back and tells the caller to skip the optimizer step, ``"propagate"`` commits.

Use without Lightning::

    ctl = StepController(state)
    loss.backward()                      # the comm hooks run
    if ctl.finish_step(model.named_parameters()) is Decision.SKIP:
        optimizer.zero_grad()            # skip this step
    else:
        optimizer.step()
"""
from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_topk.comm.elastic as elastic
from lightning_topk.comm.state import Scale, TopKState

log = logging.getLogger(__name__)

_RESULT, _FOUND_INF, _INPUTS = 0, 1, 2  # slots of the reduced vector; inputs: one slot per rank


class Decision(enum.Enum):
    COMMIT = "commit"
    SKIP = "skip"


class StepController:
    """Collects the fault flags of a step, reduces them once across ranks and applies the policy.

    Args:
        state: the hooks' state.
        device: device of the reduced flag tensor (must suit the group's backend); default: the device the
            hooks' flags are on, else CUDA's current device for NCCL groups, else CPU.
        group: the decision's process group, when it is not the exchange's :meth:`decision_group
            <lightning_topk.comm.exchanges.base.Exchange.decision_group>` (sharded models: every rank, while the
            exchange runs among the ranks that hold one shard).
        commit_gate: asked once per step, after the fault decision and whatever it was: may the step commit?
            (``fault_tolerance="torchft"``: torchft's ``should_commit``, with the fault verdict.) A step it
            refuses is rolled back like a skipped one. The undo log is then always on.
    """

    def __init__(self, state: TopKState, device: Optional[torch.device] = None, group: Any = None,
                 commit_gate: Optional[Callable[[bool], bool]] = None) -> None:
        self.state = state
        self.device = device
        self._group = group
        self.commit_gate = commit_gate
        self.uncommitted_steps = 0  # steps the commit gate refused (torchft's should_commit said no)
        self._scaler = False
        self.last_decision: Optional[Decision] = None  # of the last finish_step (the strategy resets it)
        self.skipped_steps = 0  # optimizer steps this rank skipped (nonfinite="skip" or a loss scaler's skip)
        state.undo.step = state.step
        state.undo.enabled = state.config.nonfinite == "skip" or commit_gate is not None
        if state.exchange is not None:
            state.exchange.controlled = True

    @property
    def group(self) -> Any:
        """The group of the per-step decision: the exchange's :meth:`decision_group
        <lightning_topk.comm.exchanges.base.Exchange.decision_group>` (all ranks, except under local SGD:
        the node's ranks, or ``None``, this process alone, with one process per node)."""
        if self._group is not None:
            return self._group
        ex = self.state.exchange
        if ex is not None:
            return ex.decision_group(self.state)
        return self.state.flat_group

    @property
    def node_scope(self) -> bool:
        """Whether the per-step decision is taken by each node alone (local SGD: the node is one replica)."""
        return bool(getattr(self.state.exchange, "local_sgd", False))

    def begin_step(self, grad_scale: Scale = 1.0, scaler: bool = False) -> None:
        """Before a backward that may exchange: the loss scale the gradients carry (a float, or the scaler's
        scale as a device tensor) and whether a loss scaler makes the skip decision."""
        self.state.grad_scale = grad_scale
        self._scaler = scaler
        self.state.undo.enabled = scaler or self.state.config.nonfinite == "skip" or self.commit_gate is not None

    def finish_step(self, named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
                    found_inf: Sequence[Tensor] = ()) -> Decision:
        """After the backward whose exchange this step used, before the optimizer step; on every rank.

        ``found_inf``: a loss scaler's per-device found-inf tensors, after ``unscale_``; they are
        overwritten in place with the global verdict so that the scaler skips on every rank alike.
        ``named_parameters`` only names parameters in the ``FloatingPointError`` message.
        """
        if self.commit_gate is None:
            return self._decide(named_parameters, found_inf)
        try:
            decision = self._decide(named_parameters, found_inf, end=False)
        except FloatingPointError:
            self.commit_gate(False)  # nonfinite="raise": the replica group still answers should_commit
            self._end(commit=False)
            raise
        if self.commit_gate(decision is Decision.COMMIT):
            return self._end(commit=decision is Decision.COMMIT)
        if decision is Decision.COMMIT:
            self.uncommitted_steps += 1
            log.warning("topk_ddp: the replicas did not agree to commit this step (a replica failed or the quorum "
                        "is below min_replicas); rolled back: parameters, optimizer state and residuals unchanged")
        return self._end(commit=False)

    def _decide(self, named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
                found_inf: Sequence[Tensor] = (), end: bool = True) -> Decision:
        """The fault decision; ``end``: apply it (else the caller ends the step with :meth:`_end`)."""
        finish = self._end if end else self._verdict
        st = self.state
        ex = st.exchange
        if ex is not None:
            ex.controlled = True  # the exchange's telemetry refresh rides on this step's all-reduce
            ex.before_decision(st)
        refresh = ex is not None and ex.refresh_due(st)
        if st.config.nonfinite == "propagate" and not self._scaler and not found_inf and not refresh:
            return finish(commit=True)  # nothing could change the outcome: no collective, no sync
        vec = self._local_vector(found_inf)
        world = self._world()
        if refresh:  # e.g. exchange="auto": this rank's telemetry window rides on the same all-reduce
            window = ex.take_window()
            vec = torch.cat([vec, torch.tensor(window, dtype=vec.dtype, device=vec.device)])
        if world > 1:
            elastic.all_reduce(vec, self.group)
        host = vec.tolist()  # the one host sync of the step
        if refresh:
            ex.apply_refresh(st, [v / world for v in host[-len(window):]])  # the mean over ranks
            host = host[:-len(window)]
        fault = any(v > 0 for v in host)
        for t in found_inf:
            t.fill_(float(fault))
        if not fault:
            return finish(commit=True)
        if self._scaler or found_inf:
            return finish(commit=False)
        mode = st.config.nonfinite
        if mode == "propagate":
            return finish(commit=True)
        message = self._describe(host, named_parameters)
        if mode == "raise":
            if end:
                self._end(commit=False)
            raise FloatingPointError(
                f"topk_ddp: {message}. Set nonfinite='skip' to skip such steps on all ranks, or use fp16 loss scaling."
            )
        if self.node_scope:
            log.warning("topk_local: skipping the inner optimizer step on this node's ranks (local SGD: each node "
                        "decides its inner steps; the step still counts toward the outer round): %s", message)
        else:
            log.warning("topk_ddp: skipping the optimizer step on all ranks (residuals rolled back): %s", message)
        return finish(commit=False)

    # ---- internals ---------------------------------------------------------------------------------
    def _verdict(self, commit: bool) -> Decision:
        return Decision.COMMIT if commit else Decision.SKIP

    def _world(self) -> int:
        group = self.group
        if elastic.is_elastic(group):
            return group.size()
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return 1 if group is None else dist.get_world_size(group)

    def _rank(self) -> int:
        group = self.group
        if elastic.is_elastic(group):
            return group.rank()
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return 0 if group is None else dist.get_rank(group)

    def _flag_device(self, found_inf: Sequence[Tensor]) -> torch.device:
        if self.device is not None:
            return self.device
        flags = self.state.flags
        for t in [flags.result, *flags.inputs.values(), *found_inf]:
            if t is not None:
                return t.device
        if self._world() > 1 and not elastic.is_elastic(self.group) and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _local_vector(self, found_inf: Sequence[Tensor]) -> Tensor:
        flags = self.state.flags
        dev = self._flag_device(found_inf)
        vec = torch.zeros(_INPUTS + self._world(), dtype=torch.float32, device=dev)
        if flags.result is not None:
            vec[_RESULT] = flags.result.to(dev)
        for t in found_inf:
            vec[_FOUND_INF] += t.to(dev)
        if flags.inputs:
            vec[_INPUTS + self._rank()] = torch.stack([t.to(dev) for t in flags.inputs.values()]).any()
        return vec

    def _describe(self, host: List[float], named_parameters: Optional[Iterable[Tuple[str, Tensor]]]) -> str:
        """Only on the fault path, so host reads are fine here."""
        after = [n for n, p in (named_parameters or ())
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        origin = [r for r, v in enumerate(host[_INPUTS:]) if v > 0]
        parts = [f"non-finite gradient at exchange step {self.state.undo.step}"]
        if after:
            parts.append(f"after the exchange in parameter(s) {after[:8]}")
        if origin:
            where = " of this node (local ranks)" if self.node_scope else ""
            parts.append(f"it entered the exchange on rank(s) {origin}{where}")
        mine = [names for names, bad in self.state.flags.inputs.items() if bool(bad)]
        if mine:
            local = [n for names in mine for n in names]
            parts.append(f"on this rank ({self._rank()}) in the bucket of {local[:8]}")
        elif host[_RESULT] > 0 and not origin:
            parts.append("the sum of finite values overflowed in the exchange")
        return "; ".join(parts)

    def _end(self, commit: bool) -> Decision:
        st = self.state
        if commit:
            st.undo.commit(st.bucket_names(), st.undo_keys())
        else:
            st.undo.rollback()
            st.step = st.undo.step  # a skipped step did not happen: the density schedule stays put
            self.skipped_steps += 1
        st.flags.clear()
        st.undo.step = st.step
        self.last_decision = Decision.COMMIT if commit else Decision.SKIP
        return self.last_decision
