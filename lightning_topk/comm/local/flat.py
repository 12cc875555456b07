"""The flat vectors of sparse local SGD (torch only): the parameters as the fp32 vector this rank owns a shard
of (:class:`ShardView`), the module's buffers (:class:`BufferSet`), and the round's one all-reduce that decides a
fault and averages the buffers (:func:`decide`).

With several processes per node the flat parameter vector's chunks are split among the node's local ranks
(shard l to local rank l): each rank runs the round on its shard. A view of another shard (a parameter shard
of FSDP) is another :class:`ShardView`: the round reads only ``shard``, ``lo``, ``mine`` and the flat vectors.

Buffers (``named_buffers``): DDP does not sync them under local SGD (no per-forward broadcast), so each process
keeps its own between rounds. At every round end the floating-point ones are averaged over *every* rank,
carried in the same fp32 all-reduce as the fault flag: ``b := b_anchor + (1/W) Σ_r (b_r − b_anchor)``, where
``b_anchor`` is their value at the start of the round (the same on every rank). Averaging the change keeps
buffers that no rank changed (constant tables) bit for bit. Integer buffers (``num_batches_tracked``) are left
alone: every rank runs the same number of forward passes.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm import elastic
from lightning_topk.comm.faults import nonfinite
from lightning_topk.comm.local.codec import shard_layout


class ShardView:
    """The parameters ``named`` (in a fixed order) as one fp32 vector zero-padded to ``local * shard``, and the
    range [lo, lo + shard) of it that local rank ``local_rank`` of ``local`` owns (``layout``: its packets)."""

    def __init__(self, config: Any, named: Sequence[Tuple[str, Tensor]], local: int = 1, local_rank: int = 0) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.numels = [p.numel() for p in self.params]
        self.n = sum(self.numels)
        self.local, self.local_rank = local, local_rank
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.layout = shard_layout(config, self.n, local)
        self.shard = self.layout.C * self.layout.c  # entries per rank's shard
        self.lo = local_rank * self.shard

    def flat_params(self) -> Tensor:
        """θ_local as one fp32 vector, zero-padded to ``local * shard``."""
        out = torch.empty(self.local * self.shard, dtype=torch.float32, device=self.device)
        off = 0
        with torch.no_grad():
            for p, k in zip(self.params, self.numels):
                out[off:off + k].copy_(p.detach().reshape(-1))
                off += k
            out[off:].zero_()
        return out

    def write_params(self, flat: Tensor) -> None:
        off = 0
        with torch.no_grad():
            for p, k in zip(self.params, self.numels):
                p.copy_(flat[off:off + k].view_as(p))
                off += k

    def mine(self, flat: Tensor) -> Tensor:
        """This rank's shard of a full flat vector (a view)."""
        return flat[self.lo:self.lo + self.shard]

    def per_name(self, flat: Tensor, full: bool = True) -> Dict[str, Tensor]:
        """Per-parameter CPU copies of a full flat vector (``full``) or of this rank's shard (zeros elsewhere)."""
        if not full:
            whole = torch.zeros(self.local * self.shard, dtype=torch.float32, device=flat.device)
            whole[self.lo:self.lo + self.shard] = flat
            flat = whole
        out, off = {}, 0
        for name, k in zip(self.names, self.numels):
            out[name] = flat[off:off + k].detach().cpu().clone()
            off += k
        return out

    def from_names(self, d: Dict[str, Tensor], full: bool, like: Tensor) -> Tensor:
        """Inverse of :meth:`per_name` (on ``like``'s device)."""
        whole = torch.zeros(self.local * self.shard, dtype=torch.float32, device=like.device)
        off = 0
        for name, k in zip(self.names, self.numels):
            t = d.get(name)
            if t is None or t.numel() != k:
                raise ValueError(f"topk_local: saved outer state has no entry of size {k} for parameter {name!r}")
            whole[off:off + k].copy_(t.reshape(-1))
            off += k
        return whole if full else whole[self.lo:self.lo + self.shard].clone()


class BufferSet:
    """The module's buffers by name, held by reference (updated in place, as BatchNorm does); the floating-point
    ones as one fp32 vector."""

    def __init__(self, buffers: Sequence[Tuple[str, Tensor]] = ()) -> None:
        self.names = [n for n, _ in buffers]
        self.tensors = [b for _, b in buffers]
        self.floating = [i for i, b in enumerate(self.tensors) if b.is_floating_point()]
        self.nbuf = sum(self.tensors[i].numel() for i in self.floating)

    def flat(self) -> Tensor:
        """The floating-point buffers as one fp32 vector (empty without any)."""
        dev = self.tensors[0].device if self.tensors else torch.device("cpu")
        if not self.nbuf:
            return torch.zeros(0, dtype=torch.float32, device=dev)
        return torch.cat([self.tensors[i].detach().reshape(-1).float() for i in self.floating])

    def write(self, flat: Tensor) -> None:
        off = 0
        with torch.no_grad():
            for i in self.floating:
                b = self.tensors[i]
                k = b.numel()
                b.copy_(flat[off:off + k].view_as(b))
                off += k

    def by_name(self, flat: Tensor) -> Dict[str, Tensor]:
        """Per-buffer CPU copies of a flat vector of the floating-point buffers."""
        out, off = {}, 0
        for i in self.floating:
            k = self.tensors[i].numel()
            out[self.names[i]] = flat[off:off + k].detach().cpu().clone()
            off += k
        return out


def world(group: Any) -> int:
    """The number of ranks (replicas) in ``group``: 1 without an initialized process group; an elastic group's
    quorum, which may change from one round to the next."""
    if elastic.is_elastic(group):
        return elastic.group_size(group)
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def decide(delta: Optional[Tensor], buffers: BufferSet, anchor: Tensor, group: Any,
           mode: str) -> Tuple[bool, Optional[Tensor]]:
    """One all-reduce over ``group`` (every rank that trains the model) of the fault flag (a non-finite Δ or
    buffer on this rank; none with ``mode="propagate"`` or ``delta`` None) and of the float buffers' change
    since ``anchor``. Returns (whether any rank flagged, the averaged buffers or None without float buffers)."""
    fault, bufs, _ = decide_counted(delta, buffers, anchor, group, mode)
    return fault, bufs


def decide_counted(delta: Optional[Tensor], buffers: BufferSet, anchor: Tensor, group: Any, mode: str,
                   contributes: Optional[bool] = None) -> Tuple[bool, Optional[Tensor], Optional[float]]:
    """:func:`decide`, and with ``contributes`` (True/False: whether this replica's round counts) the number of
    replicas that contribute, summed in the same all-reduce; a replica that does not contribute adds no buffer
    change, and the buffers' change is averaged over the contributing ones (none: the anchor). ``group`` may
    be an :class:`~lightning_topk.comm.elastic.ElasticGroup` (the round's quorum)."""
    check = delta is not None and mode != "propagate"
    bufs = buffers.flat() if buffers.nbuf else None
    counted = contributes is not None
    if not elastic.is_elastic(group) and not (dist.is_available() and dist.is_initialized()):
        # one process: its own buffers are the average (and nothing to decide)
        return False, bufs, (1.0 if contributes else 0.0) if counted else None
    parts = []
    if check:
        assert delta is not None
        bad = nonfinite(delta)
        if bufs is not None:
            bad = bad | nonfinite(bufs)
        parts.append(bad.float().reshape(1).to(delta.device))
    dev = parts[0].device if parts else (bufs.device if bufs is not None else anchor.device)
    if counted:
        parts.append(torch.full((1,), 1.0 if contributes else 0.0, device=dev))
    if bufs is not None:
        change = (bufs - anchor).to(dev)
        parts.append(change if contributes is not False else torch.zeros_like(change))
    if not parts:
        return False, None, None
    vec = torch.cat(parts) if len(parts) > 1 else parts[0]
    elastic.all_reduce(vec, group)
    fault = bool(vec[0].item() > 0) if check else False
    off = 1 if check else 0
    count = float(vec[off].item()) if counted else None
    off += 1 if counted else 0
    if bufs is None:
        return fault, None, count
    div = world(group) if count is None else count
    if div <= 0:
        return fault, anchor.clone(), count
    return fault, anchor + vec[off:].to(bufs.device).div_(div), count
