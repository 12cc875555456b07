"""How the replicas exchange their outer packets (torch only): the all-gather and the scale-free owners, as small
units registered by name (:data:`OUTER_EXCHANGES`, chosen by :func:`outer_exchange_for`).

6. one all-gather of the fixed-size packets among the replicas; every rank decodes the same sum and averages it
   over the replicas (:class:`AllgatherOuter`, the one that streams). Or the scale-free exchange
   (:class:`ScatterOuter`): every replica owns a range of chunks; one all-to-all sends each owner the replicas'
   packets of its range, the owner averages them, adds its own error feedback and re-selects the top-k at twice
   the density (``OWNER_K_FACTOR``), and one all-gather of the owners' ranges gives every rank the same update:
   about 3 (R − 1)/R packets out per replica, against R − 1.

Every unit takes the group of the replicas as an argument of each call (its size is the replica count).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm import elastic
from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.local.codec import PacketLayout, compress, decode_into, sum_packets
from lightning_topk.comm.local.flat import world
from lightning_topk.comm.teardown import destroy_gloo_at_exit

# torch's all-gather, or an :class:`~lightning_topk.comm.elastic.ElasticGroup`'s (fault_tolerance="torchft": the
# replicas of the round's quorum; a failed collective is reported to torchft, not raised)
_all_gather = elastic.all_gather


replica_count = world  # the number of replicas in a group (flat.world)


def decode_average(gathered: Tensor, layout: PacketLayout, shard: int) -> Tensor:
    """The replicas' average (``shard`` entries) of the packets of layout ``layout`` gathered end to end."""
    return sum_packets(gathered, layout, shard).div_(gathered.numel() // layout.nbytes)


# ---- how the replicas exchange ---------------------------------------------------------------------
# The scale-free exchange's owners re-select the averaged sum of R replicas' top-k (up to R k entries per chunk)
# at this many times the density: at 1x the owners' error feedback held back most of it and 4-node accuracy fell
# (digits -4.1 points against ddp, all-gather -2.4; MNIST-5k -1.7 against -0.7); at 2x it matched the
# all-gather's (-2.4, -0.4), at 4x too (BENCHMARKS.md, "Scale-free outer exchange").
OWNER_K_FACTOR = 2
# ... and at no fewer bits than this: an owner's chunk holds the average of R replicas' quantized values, and a
# ternary code (2 bits: -s, 0, s with s = the chunk's max) of it zeroed all but its largest entries, whatever the
# density (4x the density sent the same update). At topk_local_wan's settings (2%, 2-bit, H 64) MNIST-5k fell
# 1.93 points behind the all-gather; with the owners at 4 bits, 0.40 (3 seeds; BENCHMARKS.md). 8 bits and more
# are kept as they are.
OWNER_MIN_BITS = 4
# ``outer_exchange="auto"`` takes the scale-free exchange only where all of these hold:
# - at least this many replicas: its accuracy was measured at 4 (BENCHMARKS.md, "Scale-free outer exchange");
SCATTER_MIN_REPLICAS = 4
# - it sends at most this share of the all-gather's bytes (:func:`round_bytes_out`). It pays two collectives and
#   a second selection for them: on the namespace cluster at 4 replicas it was faster at 0.57 of the bytes
#   (topk_local: 1.17x / 1.28x samples/s at 100 / 10 Mbit/s) and not at 0.75 (topk_local_wan: 0.96x / 0.97x).
#   A shard with too few chunks to split among the owners (``outer_chunk=0``: one chunk) would send 3x;
SCATTER_MAX_BYTE_SHARE = 0.6
# - the replicas' values have at least this many bits. With 2-bit values the owners' re-quantization lost
#   accuracy on the namespace cluster (topk_local_wan's settings at 4 nodes, 128 steps: 0.699 test accuracy with
#   2-bit owners, 0.883 with owners at OWNER_MIN_BITS, against the all-gather's 0.917), and beyond 4 replicas it is
#   unmeasured; pinned, it runs with the owners at OWNER_MIN_BITS.
SCATTER_MIN_BITS = 4


# The options besides the layout (outer_chunk) and outer_exchange itself that outer_exchange_for reads: a resume
# under another value of one of them may resolve "auto" differently (the checkpoint loader then reshards).
AUTO_EXCHANGE_INPUTS = ("outer_value_bits", "outer_density", "outer_streaming")


def outer_exchange_for(config: TopKConfig, replicas: int, layout: PacketLayout) -> str:
    """``"allgather"`` or ``"scatter"``: what ``config.outer_exchange`` means among ``replicas`` replicas for a
    shard of packet layout ``layout``. Decided from the option, the number of replicas and the layout alone (the
    same on every rank: the shards are the same size; no timing), so every rank agrees and every run decides the
    same: one replica has nothing to exchange (all-gather, a no-op); ``"auto"`` is ``"scatter"`` where the three
    conditions above hold (``SCATTER_MIN_REPLICAS``, ``SCATTER_MAX_BYTE_SHARE``, ``SCATTER_MIN_BITS``), and never
    with ``outer_streaming`` (the scale-free exchange does not stream)."""
    choice = getattr(config, "outer_exchange", "auto")
    if replicas <= 1:
        return "allgather"
    if choice == "auto":
        if (replicas < SCATTER_MIN_REPLICAS or config.outer_streaming
                or config.outer_value_bits < SCATTER_MIN_BITS):
            return "allgather"
        share = round_bytes_out(layout, replicas, "scatter") / round_bytes_out(layout, replicas, "allgather")
        return "scatter" if share <= SCATTER_MAX_BYTE_SHARE else "allgather"
    return choice



def owner_chunks(C: int, replicas: int) -> int:
    """Chunks each replica owns in the scale-free exchange (the last owner's range is zero-padded)."""
    return max(1, -(-C // replicas))


def owner_layouts(lay: PacketLayout, replicas: int) -> Tuple[PacketLayout, PacketLayout]:
    """The scale-free exchange's two segment layouts for a shard of layout ``lay`` among ``replicas`` replicas:
    (what a replica sends each owner: ``owner_chunks`` chunks at the replicas' ``k`` and bits; what an owner
    sends every replica: the same chunks at ``OWNER_K_FACTOR`` times ``k``, at most dense, and at
    ``max(bits, OWNER_MIN_BITS)`` bits)."""
    per = owner_chunks(lay.C, replicas)
    return (PacketLayout(per, lay.c, lay.k, lay.bits, lay.indices),
            PacketLayout(per, lay.c, min(lay.c, math.ceil(OWNER_K_FACTOR * lay.k)), max(lay.bits, OWNER_MIN_BITS),
                         lay.indices))


def round_bytes_out(lay: PacketLayout, replicas: int, exchange: str) -> int:
    """Bytes of outer packets that leave one rank per round among ``replicas`` replicas (pure arithmetic; what
    :attr:`OuterStats.bytes` counts, the buffers' all-reduce aside). ``"allgather"``: R − 1 packets (ring
    all-gather). ``"scatter"``: R − 1 segments in the all-to-all (its own stays) plus R − 1 owner segments in
    the ring all-gather. The bytes a rank receives are the same."""
    if replicas <= 1:
        return 0
    if exchange == "scatter":
        seg, out = owner_layouts(lay, replicas)
        return (replicas - 1) * (seg.nbytes + out.nbytes)
    return (replicas - 1) * lay.nbytes



class OuterExchange:
    """One way of averaging the replicas' error-feedback buffers. Every unit knows the owner plan of the
    scale-free exchange (the checkpoint names it); only :class:`ScatterOuter` owns a range."""

    name = ""
    streams = False  # whether it can be launched and applied a round late (outer_streaming)

    def __init__(self, layout: PacketLayout, group: Any, device: torch.device) -> None:
        self.layout = layout
        self.owner = 0
        self.owner_layout, self.owner_out_layout = owner_layouts(layout, replica_count(group))
        self.per = self.owner_layout.C  # chunks per owner (owner_chunks)
        self.owner_ef = torch.zeros(0, device=device)

    def payload_bytes(self, group: Any) -> int:
        """The bytes of packets this rank makes in one round."""
        return self.layout.nbytes

    def average(self, ef: Tensor, group: Any, decay: float, shard: int) -> Tensor:
        """The replicas' average update (``shard`` entries, the same on every replica) from this rank's error
        feedback ``ef`` (in place: it keeps what was not sent); ``decay``: ``outer_ef_decay``."""
        raise NotImplementedError

    def owner_range(self, shard: int) -> Tuple[int, int]:
        """Entries of this rank's shard (of ``shard`` entries) that its owner error feedback covers: [lo, hi)."""
        lo = min(self.owner * self.per * self.layout.c, shard)
        return lo, min(lo + self.per * self.layout.c, shard)


class AllgatherOuter(OuterExchange):
    """Every replica's packet to every replica (one ring all-gather); every rank decodes the same sum."""

    name = "allgather"
    streams = True

    def launch(self, ef: Tensor, group: Any) -> Tuple[Tensor, Any]:
        """Compress ``ef`` (in place: it keeps what was not sent) and launch the all-gather of the packets:
        (gathered bytes, the collective's work or None with one replica)."""
        packet, _ = compress(ef, self.layout, want_sent=False)
        R = replica_count(group)
        if R == 1:
            return packet, None
        out = torch.empty(R * packet.numel(), dtype=torch.uint8, device=packet.device)
        work = _all_gather(out, packet, group=group, async_op=True)
        return out, work

    def average(self, ef: Tensor, group: Any, decay: float, shard: int) -> Tensor:
        gathered, work = self.launch(ef, group)
        if work is not None:
            work.wait()
        return decode_average(gathered, self.layout, shard)


class ScatterOuter(OuterExchange):
    """The scale-free exchange: this replica owns chunks [owner * per, (owner + 1) * per) of the shard and keeps
    the error feedback of their averaged, re-selected sum (mean units) in ``owner_ef``. Never streamed."""

    name = "scatter"

    def __init__(self, layout: PacketLayout, group: Any, device: torch.device) -> None:
        super().__init__(layout, group, device)
        self.owner = dist.get_rank(group)
        self.owner_ef = torch.zeros(self.per * layout.c, device=device)

    def payload_bytes(self, group: Any) -> int:
        """Its R owner segments plus its owner's re-selected segment."""
        return replica_count(group) * self.owner_layout.nbytes + self.owner_out_layout.nbytes

    def average(self, ef: Tensor, group: Any, decay: float, shard: int) -> Tensor:
        """The scale-free exchange of this round's error-feedback buffer; returns the averaged update (this
        rank's shard, the same on every replica). Each replica compresses each owner's chunk range into a
        segment (``owner_layout``: the same size for every owner, the last range zero-padded) and sends it to
        that owner (one all-to-all); each owner decodes the R segments in rank order, averages them, adds its
        owner error feedback, re-selects the top-k per chunk at ``OWNER_K_FACTOR`` times the density and
        quantizes it at ``max(bits, OWNER_MIN_BITS)`` bits (``owner_out_layout``; the owner buffer keeps what
        was not sent, rounding error included, as ``ef`` does), and the owners' segments are all-gathered and
        decoded by every replica. Conservation: what the replicas send plus their ``ef`` is what went in, and
        the owners' sent values plus ``owner_ef`` are the mean of what the replicas sent plus the old
        ``owner_ef``."""
        lay, R, per, c = self.owner_layout, replica_count(group), self.per, self.layout.c
        C = self.layout.C
        x = ef.view(C, c)
        segments = []
        for r in range(R):
            lo, hi = min(r * per, C), min((r + 1) * per, C)
            if hi - lo == per:
                seg, _ = compress(x[lo:hi].reshape(-1), lay, want_sent=False)  # a view: keeps its residual in ef
            else:
                pad = torch.zeros(per * c, dtype=x.dtype, device=x.device)
                pad[:(hi - lo) * c] = x[lo:hi].reshape(-1)
                seg, _ = compress(pad, lay, want_sent=False)
                x[lo:hi] = pad[:(hi - lo) * c].view(hi - lo, c)
            segments.append(seg)
        send = torch.cat(segments)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        if decay != 1.0:  # the owner buffer decays as ``ef`` does (0: no owner error feedback)
            self.owner_ef.mul_(decay)
        acc = sum_packets(recv, lay, per * c).div_(R).add_(self.owner_ef)
        out_lay = self.owner_out_layout
        mine, _ = compress(acc, out_lay, want_sent=False)
        self.owner_ef = acc
        So = out_lay.nbytes
        gathered = torch.empty(R * So, dtype=torch.uint8, device=send.device)
        _all_gather(gathered, mine, group=group)
        g = torch.zeros(R * per * c, dtype=torch.float32, device=send.device)
        for r in range(R):
            decode_into(g[r * per * c:(r + 1) * per * c], gathered[r * So:(r + 1) * So], out_lay)
        return g[:shard]


OUTER_EXCHANGES: Dict[str, Type[OuterExchange]] = {"allgather": AllgatherOuter, "scatter": ScatterOuter}


def build_outer_exchange(name: str, layout: PacketLayout, group: Any, device: torch.device,
                         registry: Optional[Dict[str, Type[OuterExchange]]] = None) -> OuterExchange:
    """The outer exchange ``name`` (a key of :data:`OUTER_EXCHANGES`) for a shard of layout ``layout``. Registers
    :func:`~lightning_topk.comm.teardown.destroy_gloo_at_exit`: a plain spawn harness then ends without an abort."""
    destroy_gloo_at_exit()
    return (registry or OUTER_EXCHANGES)[name](layout, group, device)
