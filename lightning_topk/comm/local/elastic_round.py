"""Sparse local SGD's outer round when replicas come and go (``fault_tolerance="torchft"``; torch only).

The round's group is an :class:`~lightning_topk.comm.elastic.ElasticGroup` over the replicas of a torchft quorum,
and :class:`~.round.OuterState` holds a ``gate`` (the strategy's: ``begin()`` forms the quorum and returns whether
this replica healed from a peer in it; ``commit(ok)`` is torchft's ``should_commit``). Inner steps send nothing
between replicas; at the H-th, :func:`elastic_round`:

1. the quorum (``gate.begin()``): a replica whose committed round count is behind (restarted, or a survivor whose
   last round did not commit) heals from a peer, :func:`heal_from` its :func:`heal_section`;
2. the round (:meth:`~.round.OuterState.outer_round` with ``contributes``): the number of replicas that contribute
   is summed in the round's fault/buffer all-reduce, and the average is over them (R' of the quorum's R). A
   replica that does not (it healed in this quorum, or it joins: its first quorum, before any inner step) sends an
   empty packet, keeps its error feedback as it is and adds no buffer change (:func:`contribute`); it still takes
   the round's outer step, so it ends the round with the same θ_outer as the others;
3. ``gate.commit(True)``: a round the quorum does not commit (a replica died during it, a collective failed, a
   timeout) is rolled back (:func:`rollback`): θ_outer, the outer momentum, the error feedback and the round count
   as they were before it, θ_local := θ_outer (the round's inner steps are dropped), the module's float buffers
   back to the round's start.

The error feedback is never copied from a peer: a copy would send the peer's unsent mass twice. A restarted
replica starts it at zero (its own unsent mass died with it); a survivor that fell a round behind keeps its own.
"""
from __future__ import annotations

import logging
from typing import Any, Dict

import torch
from torch import Tensor

from lightning_topk.comm.local.checkpoint import save as save_section
from lightning_topk.comm.local.exchanges import replica_count

log = logging.getLogger("lightning_topk.comm.local.round")


def elastic_round(o: Any, join: bool = False) -> bool:
    """One outer round of ``o`` (an :class:`~.round.OuterState` with a ``gate``) among the replicas of a torchft
    quorum (see the module docstring); ``join``: this replica's first quorum, before any inner step. Returns
    whether the round committed."""
    assert o.gate is not None
    healed = bool(o.gate.begin())
    saved = snapshot(o)
    o.outer_round(contributes=not (healed or join))
    committed = bool(o.gate.commit(True))
    if not committed:
        rollback(o, saved)
    return committed


def contribute(o: Any, ex: Any, group: Any, delta: Tensor, contributes: bool, counted: float) -> None:
    """Step 2's exchange: this replica's packet (its error feedback plus ``delta``, or an empty one), the
    average over the ``counted`` replicas that contribute, and the outer step."""
    c = o.config
    if contributes:
        o.ef.mul_(c.outer_ef_decay).add_(delta)
        send = o.ef
    else:
        send = torch.zeros_like(o.ef)  # an empty packet: this replica's own error feedback waits
    g = ex.average(send, group, c.outer_ef_decay, o.shard)
    # ``counted`` is summed over ``flag_group``: one per contributing replica, or, sharded (every process of a
    # replica group counts; comm.elastic.ElasticGrid), one per contributing process
    per = max(1, replica_count(o.flag_group) // replica_count(group))
    if counted > 0:
        o._update(g.mul_(replica_count(group) * per / counted))
    o.stats.contributors = int(counted) // per


def snapshot(o: Any) -> Dict[str, Any]:
    """What :func:`rollback` restores (taken after the quorum: after a heal, the healed state)."""
    return {"theta": o.theta.clone(), "mom": o.mom.clone(), "ef": o.ef.clone(),
            "buffer_anchor": o.buffer_anchor.clone(), "rounds": o.stats.rounds, "skipped": o.stats.skipped}


def rollback(o: Any, saved: Dict[str, Any]) -> None:
    """Undo a round the quorum did not commit: the state of :func:`snapshot`, θ_local := θ_outer, the module's
    float buffers back to the round's start."""
    o.theta, o.mom, o.ef = saved["theta"], saved["mom"], saved["ef"]
    o.buffer_anchor = saved["buffer_anchor"]
    o.stats.rounds, o.stats.skipped = saved["rounds"], saved["skipped"]
    o.stats.uncommitted += 1
    o.anchor = None
    o.view.write_params(o.theta)
    o.bufs.write(o.buffer_anchor)
    log.warning("topk_local: outer round %d was not committed by the torchft quorum: rolled back (theta_outer, "
                "outer momentum, error feedback; the round's inner steps are dropped)", o.stats.rounds + 1)


def heal_section(o: Any) -> Dict[str, Any]:
    """What a peer that heals from this replica takes (torchft's checkpoint transport): the checkpoint section
    (θ_outer, outer momentum, position, step and round counts, the round's buffer anchor) without this replica's
    own error feedback, θ_local and module buffers (the heal carries the module itself)."""
    sd = save_section(o)
    for key in ("ef", "theta_local", "owner_ef", "owner", "buffers"):
        sd.pop(key, None)
    return sd


def heal_from(o: Any, sd: Dict[str, Any]) -> None:
    """Take a peer's :func:`heal_section`; θ_local := θ_outer (this replica has no inner steps of the peer's
    round); the error feedback stays this replica's own (see the module docstring)."""
    v, like = o.view, o.theta
    o.theta = v.from_names(sd["theta_outer"], True, like)
    o.mom = v.from_names(sd["momentum"], False, like) if sd.get("momentum") else like.new_zeros(0)  # none yet
    o.anchor, o.pending = None, None
    o.flight.clear()
    o.position, o.steps = int(sd["position"]), int(sd["steps"])
    o.stats.rounds = int(sd.get("rounds", 0))
    anchor = sd.get("buffer_anchor") or {}
    b = o.bufs
    if b.nbuf and all(b.names[i] in anchor for i in b.floating):
        o.buffer_anchor = torch.cat([anchor[b.names[i]].reshape(-1).float() for i in b.floating]
                                    ).to(o.buffer_anchor.device)
    v.write_params(o.theta)
