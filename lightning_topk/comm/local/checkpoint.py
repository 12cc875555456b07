"""Sparse local SGD's checkpoint section (torch only): what one rank's outer state saves and loads
(:func:`save`, :func:`load`: per-parameter tensors, so a section can be :func:`reshard`-ed into another layout
of nodes, processes per node or ``outer_chunk``).

The functions read the state's collaborators (``view``: the flat vectors, ``bufs``: the buffers,
``outer_exchange``: the owner plan) and its tensors (``theta``, ``mom``, ``ef``, ``anchor``, ``pending``,
``buffer_anchor``); they import nothing of the round.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Sequence

import torch
from torch import Tensor

from lightning_topk.comm.local.exchanges import replica_count

log = logging.getLogger(__name__)


def save(o: Any) -> Dict[str, Any]:
    """Rank ``o``'s outer state as per-parameter CPU tensors (a streamed exchange already finished)."""
    v = o.view
    sd: Dict[str, Any] = {
        "position": o.position, "steps": o.steps, "shard": [v.local, v.local_rank, v.shard],
        "theta_outer": v.per_name(o.theta), "theta_local": v.per_name(v.flat_params()),
        "momentum": v.per_name(o.mom, full=False) if o.mom.numel() else {}, "ef": v.per_name(o.ef, full=False),
        "rounds": o.stats.rounds,
    }
    ex = o.outer_exchange
    if o.exchange == "scatter":  # the owner error feedback: this rank's owned range of its shard
        lo, hi = ex.owner_range(v.shard)
        owned = torch.zeros_like(o.ef)
        owned[lo:hi] = ex.owner_ef[:hi - lo]
        sd["owner_ef"] = v.per_name(owned, full=False)
        sd["owner"] = [replica_count(o.inter), ex.owner, ex.per]
    if o.anchor is not None:
        sd["anchor"] = v.per_name(o.anchor)
    if o.pending is not None:
        sd["pending"] = v.per_name(o.pending, full=False)
    b = o.bufs
    if b.tensors:  # this rank's own (inside a round, and during dense_steps, they differ per rank)
        sd["buffers"] = {n: t.detach().cpu().clone() for n, t in zip(b.names, b.tensors)}
        sd["buffer_anchor"] = b.by_name(o.buffer_anchor)
    return sd


def _load_owner(o: Any, sd: Dict[str, Any], like: Tensor) -> None:
    """The owner error feedback of a section saved under the scale-free exchange with this rank's owner plan
    (a resharded section has it folded into ``ef``; a section without it starts the owner buffer at zero)."""
    ex = o.outer_exchange
    ex.owner_ef.zero_()
    if "owner_ef" not in sd:
        return
    plan = [replica_count(o.inter), ex.owner, ex.per]
    if o.exchange != "scatter" or list(sd.get("owner", [])) != plan:
        raise ValueError(f"topk_local: the saved outer state holds owner error feedback of "
                         f"outer_exchange='scatter' (replicas, owner, chunks per owner: {sd.get('owner')}); this "
                         f"run exchanges by {o.exchange!r} ({plan}). Resume with the saved outer_exchange "
                         "and layout (a change of either is resharded by the checkpoint loader)")
    lo, hi = ex.owner_range(o.view.shard)
    ex.owner_ef[:hi - lo] = o.view.from_names(sd["owner_ef"], False, like)[lo:hi]


def _load_buffers(o: Any, sd: Dict[str, Any], first_replica: bool) -> None:
    """This rank's saved buffers into the module, and the round's buffer anchor; a section saved before
    buffers were kept (or by a model without them) leaves the module's as loaded (rank 0's)."""
    b = o.bufs
    if not b.tensors:
        return
    if "buffers" not in sd:
        if first_replica:
            log.warning("topk_local: the saved outer state has no module buffers (saved before they were "
                        "kept per rank): every rank resumes with rank 0's, and the round's buffer average "
                        "starts from them")
        o.buffer_anchor = b.flat()
        return
    saved, anchor = sd["buffers"], sd.get("buffer_anchor", {})
    for i, (name, t) in enumerate(zip(b.names, b.tensors)):
        s = saved.get(name)
        if s is None or s.numel() != t.numel() or (i in b.floating and
                                                   (anchor.get(name) is None or anchor[name].numel() != t.numel())):
            raise ValueError(f"topk_local: saved outer state has no entry of size {t.numel()} for buffer {name!r}")
    with torch.no_grad():
        for name, t in zip(b.names, b.tensors):
            t.copy_(saved[name].reshape(t.shape))
    o.buffer_anchor = torch.cat([anchor[b.names[i]].reshape(-1).float() for i in b.floating]
                                ).to(o.buffer_anchor.device) if b.nbuf else b.flat()


def load(o: Any, sd: Dict[str, Any], first_replica: bool) -> None:
    """Restore :func:`save` (same layout of local ranks), or a section :func:`reshard` made for this rank from
    another layout, into ``o``; θ_local into the parameters included."""
    v = o.view
    if not sd.get("resharded") and list(sd.get("shard", [])) != [v.local, v.local_rank, v.shard]:
        raise ValueError(f"topk_local: saved outer state is sharded as {sd.get('shard')} (processes per node, "
                         f"local rank, shard size), this run as {[v.local, v.local_rank, v.shard]}; "
                         "resume with the same devices per node and outer_chunk")
    like = o.theta
    o.theta = v.from_names(sd["theta_outer"], True, like)
    # no outer momentum yet (a recipe without it): empty, as before the first round that uses it
    o.mom = v.from_names(sd["momentum"], False, like) if sd.get("momentum") else like.new_zeros(0)
    o.ef = v.from_names(sd["ef"], False, like)
    _load_owner(o, sd, like)
    o.anchor = v.from_names(sd["anchor"], True, like) if "anchor" in sd else None
    o.pending = v.from_names(sd["pending"], False, like) if "pending" in sd else None
    o.position = int(sd["position"])
    # a section saved before `steps` existed had no synchronous steps: local SGD had started
    o.steps = int(sd.get("steps", max(o.config.dense_steps, o.position)))
    o.stats.rounds = int(sd.get("rounds", 0))
    o.flight.clear()
    v.write_params(v.from_names(sd["theta_local"], True, like))
    _load_buffers(o, sd, first_replica)


def _sum_names(sections: Sequence[Dict[str, Any]], key: str, floating_only: bool = False) -> Dict[str, Tensor]:
    """Per-parameter sums of ``key`` over ``sections``, in their order (bit-identical on every rank)."""
    out: Dict[str, Tensor] = {}
    for sec in sections:
        for name, t in sec[key].items():
            if floating_only and not t.is_floating_point():
                continue
            t = t.to(torch.float64)
            out[name] = t.clone() if name not in out else out[name].add_(t)
    return out


def reshard(sections: Sequence[Dict[str, Any]], old_local: int, replica: int) -> Dict[str, Any]:
    """The outer state of a rank of replica (node) ``replica`` in a new layout, from the sections of *every*
    saved rank (global rank order, ``old_local`` processes per saved node; per-name tensors, so the new
    layout may have other nodes, processes per node or ``outer_chunk``):

    * θ_outer, the streaming start point, the position, the step count and the round count are the same on
      every saved rank: rank 0's;
    * outer momentum and a streamed update not yet applied are the same on every saved replica, sharded
      over its processes: the sum of replica 0's shards (each holds zeros outside its shard);
    * the error-feedback buffers are per replica: each new replica gets their average ``(1/R) Σ_r e_r``. The
      exchange applies the mean of what the replicas send, so the pending update ``(1/R') Σ e`` is unchanged
      (the residuals' rule, :mod:`lightning_topk.lightning.checkpoint`). Under the scale-free exchange the
      owners' buffers (each over its own range, in mean units: already averaged) are pending too: their sum
      ``O`` is added to every new replica's, so the pending update ``(1/R) Σ_r e_r + O`` is unchanged, whatever
      exchange the new run uses;
    * θ_local and the inner optimizer state (inside a round each replica has its own) come as a pair from
      saved replica ``replica mod R``: with fewer replicas, the current round's progress of the others is
      dropped; with more, some trajectories are duplicated;
    * the module's buffers are per process: every new rank gets the average of every saved rank's float
      buffers (what the round end would make of them), integer ones (``num_batches_tracked``) and the round's
      buffer anchor (the same on every saved rank) are rank 0's.

    Raises ``ValueError`` when the saved ranks disagree on the position (not one checkpoint).
    """
    if not sections or old_local < 1 or len(sections) % old_local:
        raise ValueError(f"topk_local: cannot reshard {len(sections)} saved outer states of {old_local} "
                         "processes per node")
    R = len(sections) // old_local
    positions = sorted({int(s["position"]) for s in sections})
    if len(positions) != 1:
        raise ValueError(f"topk_local: the saved ranks' outer states are at different positions {positions} "
                         "(shards of different checkpoints); cannot reshard")
    node0 = sections[:old_local]
    src = sections[(replica % R) * old_local]
    f32 = (lambda d: {n: t.to(torch.float32) for n, t in d.items()})
    ef = {n: t / R for n, t in _sum_names(sections, "ef").items()}
    if any("owner_ef" in s for s in sections):  # scale-free exchange: the owners' buffers, in mean units
        owners = _sum_names([s for s in sections if "owner_ef" in s], "owner_ef")
        ef = {n: t + owners[n] if n in owners else t for n, t in ef.items()}
    ef = {n: t.to(torch.float32) for n, t in ef.items()}
    out: Dict[str, Any] = {
        "resharded": True, "position": positions[0], "rounds": int(sections[0].get("rounds", 0)),
        **({"steps": int(sections[0]["steps"])} if "steps" in sections[0] else {}),
        "theta_outer": dict(sections[0]["theta_outer"]), "theta_local": dict(src["theta_local"]),
        "momentum": f32(_sum_names(node0, "momentum")), "ef": ef,
    }
    if "anchor" in sections[0]:
        out["anchor"] = dict(sections[0]["anchor"])
    if "pending" in sections[0]:
        out["pending"] = f32(_sum_names(node0, "pending"))
    if "buffers" in sections[0]:
        if not all("buffers" in s for s in sections):
            raise ValueError("topk_local: some saved ranks' outer states hold the module buffers and some do not "
                             "(shards of different versions); cannot reshard")
        avg = _sum_names(sections, "buffers", floating_only=True)
        out["buffers"] = {n: (avg[n] / len(sections)).to(t.dtype) if t.is_floating_point() else t.clone()
                          for n, t in sections[0]["buffers"].items()}
        out["buffer_anchor"] = dict(sections[0].get("buffer_anchor", {}))
    if src.get("inner_optimizer_states") is not None:
        out["inner_optimizer_states"] = src["inner_optimizer_states"]
    return out
