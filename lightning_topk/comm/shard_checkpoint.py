"""Sharded checkpoints of :class:`~lightning_topk.comm.sharded.ShardedTopK` through ``torch.distributed.checkpoint``
(torch only). The entries go beside the model's in the same distributed checkpoint, under ``_topk.``:

* ``_topk.residual.<replica>.<name>`` (and ``_topk.velocity.``): each replica's residual of a parameter, a
  ``DTensor`` sharded as the parameter is (each rank writes its shard: 4 B per parameter / processes per node);
* ``_topk.rank<r>``: rank r's step counter and exchange sections (``exchange="auto"``'s plan, owner residuals);
* ``_topk.outer.rank<r>``: rank r's local SGD outer state (θ_outer, momentum, error feedback of its shard).

:func:`meta` (the layout) goes in the checkpoint's metadata. Loading at the saved layout restores every rank
exactly. Per step, another number of nodes or of processes per node gives every new replica the average of the
saved replicas' residuals, re-sharded by the checkpoint reader (the pending update, ``(1/R) Σ_r residual_r``,
is unchanged); the exchange sections are dropped. Local SGD's outer state is restored at the saved layout only.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

PREFIX = "_topk"
log = logging.getLogger(__name__)


def meta(top: Any) -> Dict[str, Any]:
    """The layout that a load compares with (the same on every rank)."""
    return {"version": 1, "replicas": top.replicas, "local": top.local, "local_steps": top.config.local_steps,
            "residuals": top.state is not None, "velocity": bool(top.state is not None
                                                                and top.state.config.momentum_correction)}


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


def tensors(top: Any) -> Dict[str, Any]:
    """This rank's entries of the distributed checkpoint (see the module docstring)."""
    out: Dict[str, Any] = {}
    rank = dist.get_rank()
    if top.state is not None:
        st = top.state
        st.finish_in_flight()
        for kind, name, fp, view in _views(top):
            out[f"{PREFIX}.{kind}.{top.replica}.{name}"] = fp.to_sharded_dtensor(view)
        sections = {n: ex.state_dict() for n, ex in st.exchanges.items()}
        out[f"{PREFIX}.rank{rank}"] = {"step": st.step, "exchanges": {n: sd for n, sd in sections.items() if sd}}
    if top.outer is not None:
        out[f"{PREFIX}.outer.rank{rank}"] = top.outer.state_dict()
    return out


def load(top: Any, path: Any, saved: Optional[Dict[str, Any]], wrap: Any = None) -> str:
    """Restore this rank's state from the distributed checkpoint at ``path`` whose metadata ``saved`` is
    :func:`meta`'s (None: a checkpoint without top-k state: residuals start at zero). ``wrap``: how the caller
    nests its entries in the checkpoint (Lightning: under ``state_dict``). Returns what was done, in words."""
    from torch.distributed.checkpoint import load as dcp_load

    wrap = wrap or (lambda d: d)
    rank = dist.get_rank()
    if saved is None:
        return "the checkpoint holds no top-k state: residuals start at zero"
    same = saved["replicas"] == top.replicas and saved["local"] == top.local
    if top.outer is not None or saved.get("local_steps", 0) > 0:
        if not (same and top.outer is not None and saved.get("local_steps", 0) > 0):
            raise ValueError(
                f"topk_fsdp: the checkpoint's local SGD state was saved with {saved['replicas']} nodes x "
                f"{saved['local']} processes, local_steps={saved.get('local_steps', 0)}; this run has "
                f"{top.replicas} x {top.local}, local_steps={top.config.local_steps}. topk_fsdp restores local SGD's "
                "outer state at the saved layout only")
        box = {f"{PREFIX}.outer.rank{rank}": {}}
        dcp_load(wrap(box), checkpoint_id=path)
        top.outer.load_state_dict(box[f"{PREFIX}.outer.rank{rank}"])  # DCP sets loaded objects in place
        return "local SGD's outer state restored"
    if top.state is None or not saved.get("residuals"):
        return "no residuals to restore"
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
    key = f"{PREFIX}.rank{rank if same else 0}"
    box[key] = {}
    dcp_load(wrap(box), checkpoint_id=path)
    got = box
    for kind, name, fp, view in views:
        if kind not in kinds:
            view.zero_()
            continue
        parts = [got[f"{PREFIX}.{kind}.{r}.{name}"].to_local() for r in replicas]
        view.copy_(parts[0] if same else torch.stack(parts).mean(0))
    own = got[key]
    st.step = int(own["step"])
    st.undo.step = st.step
    if same:
        for name, ex in st.exchanges.items():
            ex.load_state_dict(own["exchanges"].get(name))
        return "residuals restored"
    return (f"residuals resharded from {saved['replicas']} nodes x {saved['local']} processes: every replica starts "
            "from the saved replicas' average (the pending update is unchanged); exchange plans start afresh")

