"""The outer round of sparse local SGD (torch only): :class:`OuterState` holds θ_outer, the outer momentum, the
error feedback, the step position and a streamed exchange in flight, and runs the round (the steps of
:mod:`lightning_topk.comm.local`) from its collaborators: the flat vectors (:class:`~.flat.ShardView`,
:class:`~.flat.BufferSet`), the outer exchange (:mod:`.exchanges`), the outer step (:mod:`.outer_step`), the
stream (:mod:`.streaming`) and the checkpoint section (:mod:`.checkpoint`).

The round takes the flat vector this rank holds (θ_local) and the group of the replicas as arguments of
:meth:`OuterState.outer_round` (by default: read from the parameters, and ``inter``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.elastic import is_elastic
from lightning_topk.comm.local.checkpoint import load as load_section
from lightning_topk.comm.local.checkpoint import save as save_section
from lightning_topk.comm.local.elastic_round import contribute, elastic_round
from lightning_topk.comm.local.exchanges import (
    AllgatherOuter,
    _all_gather,
    build_outer_exchange,
    decode_average,
    outer_exchange_for,
    replica_count,
    round_bytes_out,
)
from lightning_topk.comm.local.flat import BufferSet, ShardView, decide, decide_counted, world
from lightning_topk.comm.local.outer_step import AmplifyGuard, outer_sgd_, outer_step_for
from lightning_topk.comm.local.streaming import Flight
from lightning_topk.comm.wire import ring_allreduce_wire

log = logging.getLogger(__name__)


@dataclass
class OuterStats:
    """Telemetry of the last outer round on this rank."""

    rounds: int = 0
    bytes: int = 0           # the outer packets that leave this rank (:func:`round_bytes_out`: R - 1 packets in
    #                          the all-gather; R - 1 segments plus R - 1 owner segments in the scale-free exchange),
    #                          plus ``buffer_bytes``
    buffer_bytes: int = 0    # the fp32 buffer average's ring all-reduce over every rank: 2 (W-1)/W * 4 bytes each
    density: float = 0.0
    time_s: float = 0.0      # host time blocked on the outer exchange (launch, wait, decode, update)
    hidden_frac: float = 0.0  # streaming: share of the exchange's flight time spent behind compute
    skipped: int = 0
    contributors: int = 0     # fault_tolerance="torchft": the replicas whose pseudo-gradients the last round averaged
    uncommitted: int = 0      # fault_tolerance="torchft": rounds the quorum did not commit (rolled back)


def first_replica() -> bool:
    """Whether this process logs (global rank 0, or no process group)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class OuterState:
    """θ_outer, outer momentum, error-feedback buffer, local step position and any streamed exchange in
    flight, for the parameters ``named`` (name -> tensor, in a fixed order).

    Args:
        config: the validated options; this reads ``local_steps``, ``nonfinite`` and the ``outer_*`` fields.
        named: the model's parameters by name (their order defines the flat vector).
        inter: group of the replicas this rank exchanges with (default: the world); ``local``/``local_rank``
            and ``intra``: the node's processes and the group that shares a replica (shards of the vector).
        flag_group: group over which a non-finite pseudo-gradient is decided and the buffers are averaged
            (default: the world; it must hold every rank that trains the model).
        buffers: the module's buffers by name (``named_buffers``): the floating-point ones are averaged over
            ``flag_group`` at every round end; all are kept per rank in :meth:`state_dict`. The tensors are
            held by reference (updated in place, as BatchNorm does).
        optimizers: the inner optimizer(s), for ``outer_recipe="auto"`` (:func:`outer_step_for`; None: unknown).
        view: the flat vector this rank owns a shard of (default: a :class:`~.flat.ShardView` of ``named`` over
            ``local`` processes; another view, e.g. of a parameter shard, replaces it).
    """

    def __init__(self, config: TopKConfig, named: Sequence[Tuple[str, Tensor]], inter: Any = None,
                 intra: Any = None, local: int = 1, local_rank: int = 0, flag_group: Any = None,
                 buffers: Sequence[Tuple[str, Tensor]] = (), optimizers: Optional[Sequence[Any]] = None,
                 view: Optional[ShardView] = None) -> None:
        self.config = config
        self.view = v = view if view is not None else ShardView(config, named, local, local_rank)
        self.bufs = BufferSet(buffers)
        self.inter, self.intra, self.local, self.local_rank = inter, intra, local, local_rank
        self.flag_group = flag_group
        self.layout, self.shard, self.lo, self.nbuf = v.layout, v.shard, v.lo, self.bufs.nbuf
        R = replica_count(inter)
        self.elastic = is_elastic(inter)  # fault_tolerance="torchft": each round's quorum (.elastic_round)
        self.gate: Any = None  # torchft: the round's quorum and commit (.elastic_round.elastic_round)
        self.exchange = "allgather" if self.elastic else outer_exchange_for(config, R, self.layout)
        self.outer_exchange = build_outer_exchange(self.exchange, self.layout, inter, v.device)
        self.theta = v.flat_params()  # θ_outer
        self.buffer_anchor = self.bufs.flat()  # the float buffers at the start of the round (same on every rank)
        self.anchor: Optional[Tensor] = None  # streaming: where this round started (θ_outer when sent)
        self.mom = torch.zeros(0, device=v.device)  # outer momentum: allocated by the first round that uses it
        self.ef = torch.zeros(self.shard, device=v.device)
        self.position = 0  # inner optimizer steps since the last outer round
        self.steps = 0  # inner optimizer-step attempts since the start (the first ``dense_steps`` are synchronous)
        self.pending: Optional[Tensor] = None  # streaming: an averaged pseudo-gradient not applied yet
        self.flight = Flight()
        self._unapplied: Optional[Dict[str, Any]] = None  # the state before apply_in_flight (what a checkpoint keeps)
        self.stats = OuterStats()
        self.use_optimizers(optimizers)
        if first_replica():
            log.info("topk_local: outer step lr=%g momentum=%g nesterov=%s%s (%s)", self.rule.lr, self.rule.momentum,
                     self.rule.nesterov, " identity" if self.rule.identity else "", self.rule.why)
        if config.outer_streaming and self.rule.momentum > 0 and local_rank == 0 and first_replica():
            log.warning("topk_local: outer_streaming with outer_momentum=%g: outer momentum applied one round late "
                        "diverged on the namespace cluster (docs/local_sgd.md); use outer_momentum=0 with streaming",
                        self.rule.momentum)

    def use_optimizers(self, optimizers: Optional[Sequence[Any]]) -> None:
        """The outer step for these inner optimizers (``outer_recipe="auto"``; None: unknown): lr, momentum,
        Nesterov, or the identity (never under torchft, whose quorum may hold one replica for a while). Fabric sets
        the optimizers up after the module, so it is chosen again then."""
        self.rule = outer_step_for(self.config, optimizers, max(replica_count(self.inter), 2 * self.elastic))
        self.guard = AmplifyGuard(self.rule, first_replica)

    @property
    def owner_ef(self) -> Tensor:
        """The scale-free exchange's owner error feedback (empty under the all-gather)."""
        return self.outer_exchange.owner_ef

    # ---- rounds -----------------------------------------------------------------------------------
    @property
    def synchronous(self) -> bool:
        """Whether the next inner step is one of the first ``dense_steps`` (post-local SGD): its gradient is
        all-reduced densely over every rank, and no outer round runs."""
        return self.steps < self.config.dense_steps

    def restart(self) -> None:
        """θ_outer := θ_local (the replicas are identical after the synchronous steps), the buffers averaged over
        every rank (DDP did not sync them during the synchronous steps): local SGD starts here."""
        self.theta = self.view.flat_params()
        self.anchor = None
        self.position = 0
        if self.nbuf:
            _, avg = decide(None, self.bufs, self.buffer_anchor, self.flag_group, self.config.nonfinite)
            if avg is not None:
                self.bufs.write(avg)
            self.buffer_anchor = self.bufs.flat()

    def step(self) -> bool:
        """After an inner optimizer-step attempt (one this replica skipped too: the rounds stay aligned across
        replicas, and a replica that skipped contributes a Δ of fewer steps): counts it; at the H-th runs the
        outer round. During the first ``dense_steps`` attempts (synchronous: the gradients were all-reduced over
        every rank) it only counts them, and after the last of them re-anchors θ_outer at the weights, from
        which local SGD starts. Returns whether an outer round ran."""
        self._unapplied = None  # training went on after apply_in_flight without resume_in_flight: this is the state
        if self.synchronous:
            self.steps += 1
            if not self.synchronous:
                self.restart()
            return False
        self.steps += 1
        self.position += 1
        self.flight.poll()
        if self.position < self.config.local_steps:
            return False
        self.position = 0
        elastic_round(self) if self.gate is not None else self.outer_round()
        return True

    def outer_round(self, local: Optional[Tensor] = None, group: Any = None, contributes: Optional[bool] = None) -> None:
        """One outer round. ``local``: θ_local as the full flat vector of which this rank owns
        ``view.mine`` (default: read from the parameters); ``group``: the replicas (default: ``inter``);
        ``contributes``: torchft's round (:mod:`.elastic_round`: whether this replica's pseudo-gradient counts)."""
        t0 = time.perf_counter()
        o, v = self.config, self.view
        group = self.inter if group is None else group
        local = v.flat_params() if local is None else local
        anchor = self.anchor if self.anchor is not None else self.theta
        delta = v.mine(anchor) - v.mine(local)
        fault, buffers, counted = decide_counted(delta, self.bufs, self.buffer_anchor, self.flag_group, o.nonfinite,
                                                 contributes)
        hidden = 0.0
        start = anchor.clone() if self.rule.identity else None
        before = v.mine(self.theta).clone()
        if fault and o.nonfinite == "raise":
            raise FloatingPointError("topk_local: non-finite pseudo-gradient (theta_outer - theta_local) or module "
                                     "buffer (e.g. BatchNorm statistics) on some rank at the end of an outer round; "
                                     "set nonfinite='skip' to skip such rounds")
        if self.flight.active or self.pending is not None:  # streaming: apply the previous round now
            hidden = self._apply_pending()
        if fault and o.nonfinite == "skip":
            self.stats.skipped += 1
            v.write_params(self.theta)  # θ_local := θ_outer; EF, momentum untouched
            self.bufs.write(self.buffer_anchor)  # the module's buffers as at the start of the round
            if o.outer_streaming:
                self.anchor = self.theta.clone()
            self.stats.time_s = time.perf_counter() - t0
            return
        ex = self.outer_exchange
        if self.rule.identity:  # one replica: nothing to exchange; θ_outer := θ_local (+ a resharded pending update)
            assert start is not None
            self.theta = local.add_(self.theta - start)
            self.anchor = None
        elif o.outer_streaming and isinstance(ex, AllgatherOuter):  # the scale-free exchange never streams
            self.ef.mul_(o.outer_ef_decay).add_(delta)
            gathered, work = ex.launch(self.ef, group)
            self.flight.launch(work, gathered)
            self.anchor = self.theta.clone()
        elif counted is not None:  # torchft: the average over the replicas that contribute
            contribute(self, ex, group, delta, bool(contributes), counted)
        else:
            self.ef.mul_(o.outer_ef_decay).add_(delta)
            self._update(ex.average(self.ef, group, o.outer_ef_decay, self.shard))
        v.write_params(self.theta)
        if buffers is not None:
            self.bufs.write(buffers)
            self.buffer_anchor = self.bufs.flat()
        if not self.rule.identity:
            mine = v.mine(self.theta)
            self.guard(float((mine - before).norm()), float(delta.norm()), float(mine.norm()))
        self.stats.rounds += 1
        self.stats.buffer_bytes = ring_allreduce_wire(4 * self.nbuf, world(self.flag_group)) if self.nbuf else 0
        self.stats.bytes = round_bytes_out(self.layout, replica_count(group), self.exchange) + self.stats.buffer_bytes
        self.stats.density = self.layout.k / self.layout.c
        self.stats.time_s = time.perf_counter() - t0
        self.stats.hidden_frac = hidden

    @property
    def payload_bytes(self) -> int:
        """The bytes of packets this rank makes in one round: its packet (all-gather), or its R owner segments
        plus its owner's re-selected segment (scale-free)."""
        return self.outer_exchange.payload_bytes(self.inter)

    def _update(self, g: Tensor) -> None:
        """Outer SGD on this rank's shard, then (several processes per node) the intra-node all-gather."""
        mine = self.view.mine(self.theta)
        if self.rule.momentum > 0 and self.mom.numel() != self.shard:
            self.mom = torch.zeros(self.shard, device=self.theta.device)
        outer_sgd_(mine, self.mom, g, self.rule.lr, self.rule.momentum, self.rule.nesterov)
        if self.local > 1:
            out = torch.empty_like(self.theta)
            _all_gather(out, mine.contiguous(), group=self.intra)
            self.theta = out

    # ---- streaming --------------------------------------------------------------------------------
    def _apply_pending(self) -> float:
        """Finish a streamed exchange (wait, decode) and apply it; returns the share of its flight hidden."""
        hidden = 0.0
        if self.flight.active:
            gathered, hidden = self.flight.land()
            self.pending = decode_average(gathered, self.layout, self.shard)
        if self.pending is not None:
            self._update(self.pending)
            self.pending = None
        return hidden

    @property
    def in_flight(self) -> bool:
        """Whether a streamed exchange was launched and not waited for yet (:meth:`finish_flight` waits)."""
        return self.flight.active

    def finish_flight(self) -> None:
        """Wait for a streamed exchange and keep its decoded result as ``pending`` (applied at the next round
        end, as without the wait): before a checkpoint."""
        gathered = self.flight.finish()
        if gathered is not None:
            self.pending = decode_average(gathered, self.layout, self.shard)

    def apply_in_flight(self) -> bool:
        """At the end of training (on every rank): apply a streamed exchange that would otherwise only be applied
        at the next round end, so that the final weights include every round. θ_outer takes its outer step
        now; at a round end θ_local becomes the new θ_outer (the same on every replica), inside a round θ_local
        and the streaming start point move by the same change. The state as it was is kept
        (:meth:`state_dict` saves it, :meth:`resume_in_flight` restores it), so a checkpoint saved after the end
        of training, or training on, goes on exactly as a run that never stopped. Returns whether there was one."""
        if not self.flight.active and self.pending is None:
            return False
        self.finish_flight()
        unapplied = self.state_dict()
        before = self.theta.clone()
        g = self.pending
        assert g is not None
        self.pending = None
        self._update(g)
        change = self.theta - before
        if self.position == 0:
            self.view.write_params(self.theta)
        else:
            self.view.write_params(self.view.flat_params().add_(change))
        if self.anchor is not None:
            self.anchor.add_(change)
        self._unapplied = unapplied
        return True

    def resume_in_flight(self) -> None:
        """Before training goes on after :meth:`apply_in_flight`: back to the state it kept (θ_local included)."""
        if self._unapplied is not None:
            sd, self._unapplied = self._unapplied, None
            self.load_state_dict(sd)

    # ---- checkpoint (:mod:`.checkpoint`) ------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's outer state (a streamed exchange in flight is finished first and kept as pending; after
        :meth:`apply_in_flight`, the state before it)."""
        if self._unapplied is not None:
            return dict(self._unapplied)
        self.finish_flight()
        return save_section(self)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same layout of local ranks), or a section :func:`~.checkpoint.reshard`
        made for this rank from another layout; θ_local into the parameters included."""
        load_section(self, sd, first_replica())
