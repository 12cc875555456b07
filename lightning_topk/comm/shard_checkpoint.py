"""Sharded checkpoints of :class:`~lightning_topk.comm.sharded.ShardedTopK` (torch only), in a ``topk/`` folder
inside the model's distributed checkpoint folder (Lightning's and Fabric's alike):

* a ``torch.distributed.checkpoint`` of the residuals: ``_topk.residual.<replica>.<name>`` (and ``_topk.velocity.``),
  each replica's residual of a parameter as a ``DTensor`` sharded as the parameter is (each rank writes its shard:
  4 B per parameter / processes per node);
* ``rank<r>.pt`` (the checkpoint writer saves plain tensors and objects from the coordinator only, so these are
  files of their own, written atomically): rank r's layout (:func:`meta`), step counter, whether that step sent
  sparse (``recipe="auto"`` engages after one) and exchange sections
  (``exchange="auto"``'s plan, owner residuals) or its local SGD outer state (θ_outer, momentum, error feedback of
  its shard, θ_local) and its inner optimizers' state (:func:`~lightning_topk.comm.sharded.local_optimizer_state`:
  inside a round each replica's differ, and the model's checkpoint keeps one copy of each replicated shard, picked
  per tensor), with the save's key, so a stale file (a rank that died before overwriting it) is detected.

Loading at the saved layout restores every rank exactly. Per step, another number of nodes or of processes per node
gives every new replica the average of the saved replicas' residuals, re-sharded by the checkpoint reader (the
pending update, ``(1/R) Σ_r residual_r``, is unchanged); the exchange sections are dropped. On one node (no cross-node
exchange) the residuals are sent, densely, with the next step's gradient.

Local SGD's outer state is in both places: the rank files (exact at the saved layout) and, per parameter and replica,
``_topk.outer.<kind>.<replica>.<name>`` ``DTensor`` entries, from which another layout's ranks read their new shards
by the rules of :func:`lightning_topk.comm.local.checkpoint.reshard` (:data:`OUTER_RULES`): θ_outer, momentum and a
pending streamed update from replica 0 (they are the same on every replica), the error feedback averaged over the
saved replicas (the pending update ``(1/R) Σ_r e_r`` is unchanged; owner error feedback is added to it), θ_local from
saved replica ``new replica mod R``, and with it, when the processes per node are the saved ones, that replica's inner
optimizer state (else the model checkpoint's). The position, step and round counts and the module's buffers are rank
0's.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_topk.files as files
from lightning_topk.comm.sharded import load_local_optimizer_state, local_optimizer_state

PREFIX = "_topk"
# how a new replica's per-parameter outer tensor comes from the saved replicas' (local SGD, another layout)
OUTER_RULES = {"theta_outer": "first", "anchor": "first", "momentum": "first", "pending": "first", "ef": "mean",
               "owner_ef": "sum", "theta_local": "own"}
log = logging.getLogger(__name__)


def meta(top: Any) -> Dict[str, Any]:
    """The layout that a load compares with (the same on every rank)."""
    return {"version": 1, "replicas": top.replicas, "local": top.local, "local_steps": top.config.local_steps,
            "residuals": top.state is not None, "velocity": bool(top.state is not None
                                                                and top.state.config.momentum_correction),
            "outer_tensors": top.outer is not None}


def _views(top: Any) -> List[Tuple[str, str, Any, Tensor]]:
    """(kind, name, FSDPParam, view of this rank's buffer shaped as the parameter's local shard)."""
    st = top.state
    out = []
    for (_, g), slots, (names, _) in zip(top.groups, top.hooks.slots, top.specs):
        b = st.buffers(slots, top.device)
        for kind, flat in (("residual", b.residual), ("velocity", b.velocity)):
            if flat is None:
                continue
            off = 0
            for fp, name, slot in zip(g.fsdp_params, names, slots):
                n = fp.sharded_size.numel()
                out.append((kind, name, fp, flat[off:off + n].view(fp.sharded_size)))
                off += slot.numel()
    return out


def _fsdp_params(top: Any) -> Dict[str, Any]:
    """Parameter name -> its FSDPParam (which makes a ``DTensor`` of a local shard)."""
    return {name: fp for (_, g), (names, _) in zip(top.groups, top.specs) for fp, name in zip(g.fsdp_params, names)}


def outer_tensors(top: Any, section: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's local SGD outer ``section`` (:meth:`OuterState.state_dict`: per-parameter local shards) as
    ``DTensor`` entries ``_topk.outer.<kind>.<replica>.<name>``."""
    fps = _fsdp_params(top)
    out: Dict[str, Any] = {}
    for kind in OUTER_RULES:
        for name, t in section.get(kind, {}).items():
            fp = fps[name]
            out[f"{PREFIX}.outer.{kind}.{top.replica}.{name}"] = fp.to_sharded_dtensor(
                t.to(top.device, torch.float32).view(fp.sharded_size))
    return out


def _reshard_outer(top: Any, path: Any, first: Dict[str, Any], replicas: int) -> Dict[str, Any]:
    """This rank's outer section in this run's layout, read from the saved ``DTensor`` entries (a collective)."""
    from torch.distributed.checkpoint import load as dcp_load

    sec0, fps = first["outer"], _fsdp_params(top)
    which = {"first": [0], "own": [top.replica % replicas], "mean": list(range(replicas)),
             "sum": list(range(replicas))}
    plan = {kind: which[rule] for kind, rule in OUTER_RULES.items() if sec0.get(kind)}
    box = {f"{PREFIX}.outer.{kind}.{r}.{name}": fp.to_sharded_dtensor(torch.zeros(fp.sharded_size, device=top.device))
           for kind, reps in plan.items() for name, fp in fps.items() for r in reps}
    dcp_load(box, checkpoint_id=folder(path))
    out = {k: v for k, v in sec0.items() if k not in OUTER_RULES and k not in ("owner", "shard")}
    out["resharded"] = True
    for kind, reps in plan.items():
        per = {}
        for name in fps:
            parts = torch.stack([box[f"{PREFIX}.outer.{kind}.{r}.{name}"].to_local() for r in reps])
            rule = OUTER_RULES[kind]
            per[name] = (parts.mean(0) if rule == "mean" else parts.sum(0) if rule == "sum" else parts[0]).cpu()
        out[kind] = per
    owner = out.pop("owner_ef", None)
    if owner is not None:  # the owners' pending mass (already in mean units) joins every replica's
        out["ef"] = {n: e + owner[n] for n, e in out["ef"].items()}
    return out


def folder(path: Any) -> str:
    """Where the top-k state of the checkpoint folder ``path`` lives."""
    return files.join(path, "topk")


def rank_path(path: Any, rank: int) -> str:
    return files.join(folder(path), f"rank{rank}.pt")


def tensors(top: Any) -> Dict[str, Any]:
    """This rank's ``DTensor`` entries of the distributed checkpoint (see the module docstring)."""
    out: Dict[str, Any] = {}
    if top.state is not None:
        top.state.finish_in_flight()
        for kind, name, fp, view in _views(top):
            out[f"{PREFIX}.{kind}.{top.replica}.{name}"] = fp.to_sharded_dtensor(view)
    return out


def save(top: Any, path: Any) -> None:
    """Save ``top``'s state into the checkpoint folder ``path`` (a collective: every rank, after the model's
    checkpoint was written there)."""
    from torch.distributed.checkpoint import save as dcp_save

    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    sd: Dict[str, Any] = {"key": box[0], "meta": meta(top)}
    dtensors = tensors(top)
    if top.outer is not None:
        sd["outer"] = top.outer.state_dict()
        sd["inner_optimizers"] = [local_optimizer_state(o) for o in top.optimizers]
        dtensors.update(outer_tensors(top, sd["outer"]))
    if dtensors:
        dcp_save(dtensors, checkpoint_id=folder(path))
    if top.state is not None:
        sections = {n: ex.state_dict() for n, ex in top.state.exchanges.items()}
        sd.update(step=top.state.step, exchanges={n: s for n, s in sections.items() if s},
                  last_sparse=top.state.last_sent_sparse())  # recipe="auto" engages after a step that sent sparse
    files.atomic_torch_save(sd, rank_path(path, dist.get_rank()))
    dist.barrier()  # every rank's file is written before anyone reads the checkpoint


def _read_rank(path: Any, rank: int, key: Any = None) -> Dict[str, Any]:
    where = rank_path(path, rank)
    if not files.isfile(where):
        raise ValueError(f"topk_fsdp: {where} is missing; the checkpoint's top-k state cannot be restored")
    with files.open_read(where) as f:
        sd = torch.load(f, map_location="cpu", weights_only=True)
    if key is not None and sd.get("key") != key:
        raise ValueError(f"topk_fsdp: {where} belongs to another save ({sd.get('key')!r}, the checkpoint is {key!r}): "
                         "a rank died before overwriting it")
    return sd


def saved_engaged(path: Any) -> bool:
    """Whether the checkpoint folder ``path`` was saved with velocities (``recipe="auto"`` engaged or
    ``momentum_correction``): its optimizer state then has no momentum buffers (:meth:`ShardedTopK.restoring`)."""
    return files.isfile(rank_path(path, 0)) and bool(_read_rank(path, 0)["meta"].get("velocity"))


def restoring(top: Any, path: Any) -> Any:
    """:meth:`ShardedTopK.restoring` for the checkpoint folder ``path`` (engaged if it was saved with velocities):
    wrap the optimizer's state load in it."""
    return top.restoring(files.isdir(path) and saved_engaged(path))


def _load_inner(top: Any, sd: Dict[str, Any], optimizers: Any) -> None:
    """Local SGD: the inner optimizers' state of the rank file ``sd`` into those of ``optimizers`` (default: every
    one), over what the model's checkpoint loaded."""
    wanted = top.optimizers if optimizers is None else optimizers
    for o, saved in zip(top.optimizers, sd.get("inner_optimizers", [])):
        if any(o is w for w in wanted):
            load_local_optimizer_state(o, saved)


def load(top: Any, path: Any, optimizers: Any = None) -> str:
    """Restore this rank's state from the checkpoint folder ``path`` (a collective). A checkpoint without top-k
    state (plain FSDP) leaves the residuals at zero. ``optimizers``: those whose state the caller restores (local
    SGD's own per rank; default: every one). Returns what was done, in words."""
    from torch.distributed.checkpoint import load as dcp_load

    rank = dist.get_rank()
    if not files.isfile(rank_path(path, 0)):
        return "the checkpoint holds no top-k state: residuals start at zero"
    first = _read_rank(path, 0)
    saved, key = first["meta"], first["key"]
    same = saved["replicas"] == top.replicas and saved["local"] == top.local
    if top.outer is not None or saved.get("local_steps", 0) > 0:
        if top.outer is None or saved.get("local_steps", 0) == 0:
            raise ValueError(
                f"topk_fsdp: the checkpoint was saved with local_steps={saved.get('local_steps', 0)}, this run has "
                f"local_steps={top.config.local_steps}: per-step residuals and local SGD's outer state do not convert "
                "into each other; resume with the saved mode: "
                + (f"mode='local', local_steps={saved.get('local_steps')}" if saved.get("local_steps", 0) > 0
                   else "mode='per_step'") + " (mode='auto' decides from the link again at every start)")
        if same:
            own = _read_rank(path, rank, key)
            top.outer.load_state_dict(own["outer"])
            _load_inner(top, own, optimizers)
            return "local SGD's outer state and this rank's inner optimizer state restored"
        if not saved.get("outer_tensors"):
            raise ValueError(f"topk_fsdp: the checkpoint's local SGD state ({saved['replicas']} nodes x "
                             f"{saved['local']} processes) was saved without its per-parameter tensors; resume it "
                             "with the saved layout")
        top.outer.load_state_dict(_reshard_outer(top, path, first, saved["replicas"]))
        if saved["local"] == top.local:  # θ_local's replica's inner optimizer state, shard for shard
            src = (top.replica % saved["replicas"]) * top.local + top.mesh["shard"].get_local_rank()
            _load_inner(top, _read_rank(path, src, key), optimizers)
        return (f"local SGD's outer state resharded from {saved['replicas']} nodes x {saved['local']} processes: "
                "every replica's error feedback is the saved replicas' average (the pending update is unchanged)")
    if not saved.get("residuals"):
        return "no residuals to restore"
    top.carry_residuals()
    top.restore_recipe(bool(saved.get("velocity")))  # recipe="auto" engaged when saved: its velocity is loaded below
    st = top.state
    views = _views(top)
    kinds = ["residual"] + (["velocity"] if saved.get("velocity") else [])
    replicas = [top.replica] if same else list(range(saved["replicas"]))
    box: Dict[str, Any] = {}
    for kind, name, fp, view in views:
        if kind not in kinds:
            continue
        for r in replicas:
            box[f"{PREFIX}.{kind}.{r}.{name}"] = fp.to_sharded_dtensor(torch.zeros_like(view))
    dcp_load(box, checkpoint_id=folder(path))
    if "velocity" in kinds and not any(kind == "velocity" for kind, *_ in views) and rank == 0:
        log.warning("topk_fsdp: momentum_correction is off in this run (%s): the checkpoint's velocities were "
                    "discarded", top.recipe_note)
    for kind, name, _, view in views:
        if kind not in kinds:
            view.zero_()
            continue
        parts = [box[f"{PREFIX}.{kind}.{r}.{name}"].to_local() for r in replicas]
        view.copy_(parts[0] if same else torch.stack(parts).mean(0))
    own = _read_rank(path, rank, key) if same else first
    st.step = int(own["step"])
    st.undo.step = st.step
    st.loaded_sparse = bool(own.get("last_sparse", False))
    if same:
        for name, ex in st.exchanges.items():
            ex.load_state_dict(own["exchanges"].get(name))
        return "residuals restored"
    return (f"residuals resharded from {saved['replicas']} nodes x {saved['local']} processes: every replica starts "
            "from the saved replicas' average (the pending update is unchanged); exchange plans start afresh")

