"""Sparse local SGD, the functional core (torch only): the outer round of ``local_steps`` > 0.

Every replica (a node: its processes all-reduce gradients densely every inner step, so they hold the same
weights) runs H inner optimizer steps alone. Then, on every rank:

1. the pseudo-gradient ``Δ = θ_anchor − θ_local`` (``θ_anchor`` = where this round started: ``θ_outer``);
2. a non-finite Δ (or float module buffer) on any rank is decided once on every rank (one all-reduce of a
   flag, before anything changes): the round is skipped (``θ_local := θ_outer``, error feedback and momentum
   untouched, module buffers back to the round's start) or raises;
3. error feedback: ``e = outer_ef_decay · e + Δ`` (SparseLoCo);
4. top-k of ``|e|`` in each chunk of ``outer_chunk`` entries at ``outer_density`` (``outer_chunk=0``: one
   top-k over the rank's whole shard);
5. the selected values are quantized to ``outer_value_bits`` (32: fp32; 16: bf16; 8/4/2: integer codes
   ``round(v / s)`` clamped to ``±(2^(b-1) − 1)`` with one fp32 scale ``s = max|v| / (2^(b-1) − 1)`` per chunk;
   2 bits is ternary); ``e`` keeps what was not sent, rounding error included
   (``sent + e_new = decay · e_old + Δ``);
6. one all-gather of the fixed-size packets (codes, scales, in-chunk positions: int16 for chunks up to
   32768, or a bitmap of the chunk where smaller, :class:`PacketLayout`) among the replicas; every rank
   decodes the same sum and averages it over the replicas. Or (``outer_exchange``, :func:`outer_exchange_for`)
   the scale-free exchange: every replica owns a range of chunks; one all-to-all sends each owner the
   replicas' packets of its range, the owner averages them, adds its own error feedback and re-selects the
   top-k at twice the density (``OWNER_K_FACTOR``), and one all-gather of the owners' ranges gives every rank
   the same update (:meth:`OuterState._scatter_round`): about 3 (R − 1)/R packets out per replica, against R − 1;
7. the outer optimizer: SGD on the averaged pseudo-gradient ``g``: ``m = μ m + g``; step ``g + μ m``
   (Nesterov, DiLoCo) or ``m``; ``θ_outer −= outer_lr · step``. ``μ = 0`` with error feedback is SparseLoCo;
8. ``θ_local := θ_outer`` on every replica, and the module's floating-point buffers (BatchNorm's running
   statistics) are averaged over every rank (below).

With several processes per node the flat parameter vector's chunks are split among the node's local ranks
(shard l to local rank l): each rank runs 3-7 on its shard over the group of the ranks with its local rank
(one per node), and an intra-node all-gather of the updated shards rebuilds ``θ_outer``. So the inter-node
link carries each node's packet once, split over its processes.

``outer_streaming``: the all-gather of step 6 is launched asynchronously and its result applied one round
late (at the end of the next round, before that round's exchange is launched): compute goes on while it
travels. The next round then starts from the ``θ_outer`` that does not yet include it, and its Δ is taken
from that start (``θ_anchor``). At the end of training the last one is applied
(:meth:`OuterState.apply_in_flight`).

Buffers (``buffers``: the module's ``named_buffers``): DDP does not sync them under local SGD (no per-forward
broadcast), so each process keeps its own between rounds. At every round end the floating-point ones are
averaged over *every* rank (all processes of all nodes: each process saw its own batches), carried in the same
fp32 all-reduce as step 2's flag: ``b := b_anchor + (1/W) Σ_r (b_r − b_anchor)``, where ``b_anchor`` is their
value at the start of the round (the same on every rank). Averaging the change keeps buffers that no rank
changed (constant tables) bit for bit. A non-finite buffer on any rank counts as a non-finite pseudo-gradient,
and a skipped round puts the buffers back to ``b_anchor``, as it puts θ_local back to θ_outer. With
``outer_streaming`` they are averaged at the round end, when the round's exchange is launched (the all-reduce is
blocking: it carries the flag, which is). Integer buffers (``num_batches_tracked``) are left alone: every rank
runs the same number of forward passes. Between rounds nothing is synchronized, not even inside a node.

``dense_steps`` = N > 0 (post-local SGD, Lin et al. 2020): the first N inner steps are synchronous (the
exchange all-reduces the gradients over every rank); after the N-th, ``θ_outer`` is re-anchored at the
(identical) weights, the buffers are averaged over every rank, and the rounds start.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.state import TopKConfig, nonfinite
from lightning_topk.comm.wire import ring_allreduce_wire

log = logging.getLogger(__name__)
VALUE_BITS = (32, 16, 8, 4, 2)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---- chunks, selection, quantization ---------------------------------------------------------------
def chunk_size(n: int, chunk: int) -> int:
    """Entries per chunk for a shard of ``n`` entries (``chunk=0``: the whole shard is one chunk)."""
    return max(1, n) if chunk <= 0 else chunk


def chunk_k(c: int, density: float) -> int:
    """Entries sent per chunk of ``c``."""
    return c if density >= 1.0 else max(1, min(c, math.ceil(density * c)))


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def quantize(values: Tensor, bits: int) -> Tuple[Tensor, Optional[Tensor]]:
    """Wire form of ``values`` [C, k] (fp32): (codes, per-chunk fp32 scales or None). 32: fp32 values; 16:
    bf16; 8/4/2: int8 codes in ``[-q, q]``, ``q = 2^(bits-1) - 1`` (round half to even: deterministic)."""
    if bits == 32:
        return values, None
    if bits == 16:
        return values.to(torch.bfloat16), None
    q = qmax(bits)
    scale = values.abs().amax(dim=1) / q
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(values / safe.unsqueeze(1)).clamp_(-q, q).to(torch.int8)
    return codes, scale


def dequantize(codes: Tensor, scale: Optional[Tensor], bits: int) -> Tensor:
    """fp32 values of a wire form (the sender computes its error feedback with this too: bit-identical)."""
    if bits >= 16 or scale is None:
        return codes.float()
    return codes.float() * scale.unsqueeze(1)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """int8 codes in ``[-q, q]`` -> uint8, ``8 // bits`` codes per byte (zero-padded)."""
    u = (codes.reshape(-1).to(torch.int16) + qmax(bits)).to(torch.uint8)
    if bits == 8:
        return u
    per = 8 // bits
    pad = (-u.numel()) % per
    if pad:
        u = torch.cat([u, u.new_zeros(pad)])
    u = u.view(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=u.device) * bits
    return (u << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(b: Tensor, count: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``count`` int8 codes."""
    if bits == 8:
        u = b[:count].to(torch.int16)
    else:
        per = 8 // bits
        shifts = torch.arange(per, dtype=torch.int32, device=b.device) * bits
        u = ((b.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count].to(torch.int16)
    return (u - qmax(bits)).to(torch.int8)


INDEX_CODES = ("auto", "int", "bitmap")


@dataclass(frozen=True)
class PacketLayout:
    """Byte layout of one rank's packet: ``C`` chunks of ``c`` entries, ``k`` sent per chunk.

    The in-chunk positions of the sent entries go either as ``k`` integers per chunk (int16 for chunks up to
    32768 entries, else int32; values in the order top-k returned them) or as a bitmap of ``c`` bits per chunk
    (``ceil(c / 8)`` bytes, exactly ``k`` bits set; values in increasing position within the chunk).
    ``indices="auto"`` picks the smaller, from ``(c, k)`` alone (every rank knows them, so every rank agrees:
    the bitmap when ``density > 1/16`` with int16, ``> 1/32`` with int32; integers on a tie); ``"int"`` and
    ``"bitmap"`` force one (tests). Dense chunks (``k == c``) send no positions."""

    C: int
    c: int
    k: int
    bits: int
    indices: str = "auto"

    def __post_init__(self) -> None:
        if self.indices not in INDEX_CODES:
            raise ValueError(f"PacketLayout: indices must be one of {INDEX_CODES}, got {self.indices!r}")

    @property
    def dense(self) -> bool:
        return self.k >= self.c

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.c <= 32768 else torch.int32

    @property
    def bitmap_chunk_bytes(self) -> int:
        """Bytes of one chunk's bitmap (each chunk's starts on a byte)."""
        return -(-self.c // 8)

    @property
    def bitmap(self) -> bool:
        """Whether the positions go as a bitmap (else as integers; neither when dense)."""
        if self.dense:
            return False
        if self.indices != "auto":
            return self.indices == "bitmap"
        return self.bitmap_chunk_bytes < self.k * (2 if self.index_dtype == torch.int16 else 4)

    @property
    def index_code(self) -> str:
        """``"none"`` (dense), ``"bitmap"``, ``"int16"`` or ``"int32"``."""
        if self.dense:
            return "none"
        if self.bitmap:
            return "bitmap"
        return "int16" if self.index_dtype == torch.int16 else "int32"

    @property
    def value_bytes(self) -> int:
        n = self.C * self.k
        raw = 4 * n if self.bits == 32 else 2 * n if self.bits == 16 else -(-n * self.bits // 8)
        return -(-raw // 4) * 4  # padded: the next field (and the next rank's packet) stays 4-byte aligned

    @property
    def scale_bytes(self) -> int:
        return 4 * self.C if self.bits <= 8 else 0

    @property
    def index_bytes(self) -> int:
        if self.dense:
            raw = 0
        elif self.bitmap:
            raw = self.C * self.bitmap_chunk_bytes
        else:
            raw = self.C * self.k * (2 if self.index_dtype == torch.int16 else 4)
        return -(-raw // 4) * 4

    @property
    def nbytes(self) -> int:
        return self.value_bytes + self.scale_bytes + self.index_bytes


_BYTE_BITS: Dict[torch.device, Tensor] = {}  # byte value -> its 8 bits (bool [256, 8], bit 0 first), per device


def _byte_bits(device: torch.device) -> Tensor:
    t = _BYTE_BITS.get(device)
    if t is None:
        t = ((torch.arange(256, dtype=torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1).bool()
        t = _BYTE_BITS[device] = t.to(device)
    return t


def mask_positions(mask: Tensor, lay: PacketLayout, static: Optional[bool] = None) -> Tensor:
    """In-chunk positions [C, k] (int64, increasing in each chunk) of a bool mask [C, c] with exactly ``k``
    entries set per chunk. Fixed-size on an accelerator (``nonzero_static``: no host sync); ``nonzero`` on
    the CPU (faster there; it fails on a mask with another count). ``static`` forces one (tests)."""
    flat = mask.reshape(-1)
    if not (flat.device.type != "cpu" if static is None else static):
        pos = torch.nonzero(flat).view(lay.C, lay.k)
    else:
        pos = torch.nonzero_static(flat, size=lay.C * lay.k).view(lay.C, lay.k)
    return pos - torch.arange(lay.C, device=pos.device).unsqueeze(1) * lay.c


def sorted_positions(idx: Tensor, lay: PacketLayout) -> Tensor:
    """The in-chunk positions ``idx`` [C, k] (distinct per chunk) in increasing order within each chunk."""
    return idx.sort(dim=1).values


def pack_bitmap(idx: Tensor, lay: PacketLayout) -> Tensor:
    """In-chunk positions [C, k] (distinct per chunk) -> the chunks' bitmaps, ``C * ceil(c / 8)`` uint8 (bit
    ``j % 8`` of byte ``j // 8`` of a chunk's bytes is position ``j``)."""
    b = torch.zeros(lay.C, lay.bitmap_chunk_bytes, dtype=torch.int32, device=idx.device)
    b.scatter_add_(1, idx >> 3, torch.ones_like(idx, dtype=torch.int32) << (idx & 7).to(torch.int32))
    return b.to(torch.uint8).reshape(-1)


def unpack_bitmap(b: Tensor, lay: PacketLayout) -> Tensor:
    """Inverse of :func:`pack_bitmap` for bitmaps of exactly ``k`` set bits per chunk: the positions [C, k]
    (int64), increasing within each chunk (:func:`mask_positions`: no host sync on an accelerator)."""
    nb = lay.bitmap_chunk_bytes
    bits = _byte_bits(b.device).index_select(0, b.to(torch.int32)).view(lay.C, nb * 8)
    return mask_positions(bits[:, :lay.c] if nb * 8 != lay.c else bits, lay)


def select_chunks(e: Tensor, lay: PacketLayout) -> Tensor:
    """In-chunk indices [C, k] (int64) of the largest ``|e|`` of each chunk (``e`` has ``C*c`` entries)."""
    x = e.view(lay.C, lay.c)
    if lay.dense:
        return torch.arange(lay.c, device=e.device).expand(lay.C, lay.c)
    return torch.topk(x.abs(), lay.k, dim=1, sorted=False).indices


def compress(e: Tensor, lay: PacketLayout, want_sent: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Select and quantize from the error buffer ``e`` (changed in place: it keeps what was not sent).
    Returns (packet bytes, the dense fp32 vector that was sent: what the receivers decode; None unless
    ``want_sent``)."""
    idx = select_chunks(e, lay)
    if lay.bitmap:  # the bitmap says which positions: the values go in increasing position per chunk
        idx = sorted_positions(idx, lay)
    x = e.view(lay.C, lay.c)
    values = torch.gather(x, 1, idx)
    codes, scale = quantize(values, lay.bits)
    deq = dequantize(codes, scale, lay.bits)
    sent = None
    if want_sent:
        sent = torch.zeros_like(x)
        sent.scatter_(1, idx, deq)
    x.scatter_(1, idx, values - deq)  # EF keeps the rounding error (0 for fp32)
    vb = pack_codes(codes, lay.bits) if lay.bits <= 8 else codes.contiguous().reshape(-1).view(torch.uint8)
    parts = [vb, vb.new_zeros(lay.value_bytes - vb.numel())]
    if scale is not None:
        parts.append(scale.float().contiguous().view(torch.uint8))
    if not lay.dense:
        if lay.bitmap:
            ib = pack_bitmap(idx, lay)
        else:
            ib = idx.to(lay.index_dtype).contiguous().reshape(-1).view(torch.uint8)
        parts += [ib, ib.new_zeros(lay.index_bytes - ib.numel())]
    return torch.cat(parts), None if sent is None else sent.view(-1)


def decode_into(out: Tensor, packet: Tensor, lay: PacketLayout) -> Tensor:
    """``out`` (fp32, ``C*c``) += the dense vector one packet carries."""
    nv, off = lay.C * lay.k, 0
    vb = packet[:lay.value_bytes]
    off += lay.value_bytes
    if lay.bits == 16:
        vb = vb[:2 * nv]
    if lay.bits == 32:
        codes = vb.view(torch.float32).view(lay.C, lay.k)
    elif lay.bits == 16:
        codes = vb.view(torch.bfloat16).view(lay.C, lay.k)
    else:
        codes = unpack_codes(vb, nv, lay.bits).view(lay.C, lay.k)
    scale = None
    if lay.scale_bytes:
        scale = packet[off:off + lay.scale_bytes].view(torch.float32)
        off += lay.scale_bytes
    vals = dequantize(codes, scale, lay.bits)
    x = out.view(lay.C, lay.c)
    if lay.dense:
        x.add_(vals)
        return out
    if lay.bitmap:
        idx = unpack_bitmap(packet[off:off + lay.C * lay.bitmap_chunk_bytes], lay)
    else:
        ni = nv * (2 if lay.index_dtype == torch.int16 else 4)
        idx = packet[off:off + ni].view(lay.index_dtype).view(lay.C, lay.k).long()
    x.scatter_add_(1, idx, vals)
    return out


def sum_packets(buf: Tensor, lay: PacketLayout, n: int) -> Tensor:
    """The fp32 sum (``n`` entries) of the fixed-size packets of layout ``lay`` laid end to end in ``buf``, decoded in
    their order (every rank that decodes the same bytes gets the same sum, bit for bit)."""
    out = torch.zeros(n, dtype=torch.float32, device=buf.device)
    S = lay.nbytes
    for r in range(buf.numel() // S):
        decode_into(out, buf[r * S:(r + 1) * S], lay)
    return out


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


def shard_layout(config: Any, n: int, local: int) -> PacketLayout:
    """The packet layout of one rank's shard of a flat vector of ``n`` entries split over ``local`` processes."""
    c = chunk_size(-(-n // local), config.outer_chunk)
    C_all = -(-n // c)
    return PacketLayout(-(-C_all // local), c, chunk_k(c, config.outer_density), config.outer_value_bits)


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


# ---- which outer step (outer_recipe) -------------------------------------------------------------------
# outer_recipe="auto": (outer_lr, outer_momentum, outer_nesterov) per kind of inner optimizer, measured on
# scikit-learn digits, a small CNN, H 4, 10% at 4 bits, 2 and 4 replicas, 2 seeds (benchmarks/outer_recipe.py,
# docs/local_sgd.md "Which outer step"). DiLoCo's (0.7, Nesterov 0.9) was tuned with AdamW inner steps at large H;
# with heavy-ball SGD inner steps it compounds the inner momentum and diverged (issue 31: 0.14 test accuracy at 2
# replicas); plain averaging (post-local SGD, torch's PeriodicModelAverager) stayed within 0.5 points of DDP with
# SGD (momentum or Nesterov) and LARS, and was the closest to DDP with Adam and AdamW (-1.3 to -1.8 points; DiLoCo
# -8.5 to -20). Plain SGD without momentum is the one that gains from outer momentum (+5.7 / +26 points over DDP at
# 2 / 4 replicas with DiLoCo's step: the outer momentum stands in for the missing inner one).
OUTER_RECIPE_TABLE: Dict[str, Tuple[float, float, bool]] = {
    "sgd": (0.7, 0.9, True),
    "sgd_momentum": (1.0, 0.0, False),
    "sgd_nesterov": (1.0, 0.0, False),
    "lars": (1.0, 0.0, False),
    "adam": (1.0, 0.0, False),
    "adamw": (1.0, 0.0, False),
}
NAMED_RECIPES: Dict[str, Tuple[float, float, bool]] = {"diloco": (0.7, 0.9, True), "average": (1.0, 0.0, False)}
UNKNOWN_RECIPE = (1.0, 0.0, False)  # an optimizer the table does not know: plain averaging cannot amplify


@dataclass(frozen=True)
class OuterStep:
    """The outer step a run takes: ``identity`` (one replica under ``outer_recipe="auto"``: θ_outer := θ_local,
    nothing sent) or SGD with ``lr``, ``momentum``, ``nesterov``; ``why`` says where they came from."""

    lr: float
    momentum: float
    nesterov: bool
    identity: bool = False
    why: str = ""


def inner_kind(optimizers: Optional[Sequence[Any]]) -> Optional[str]:
    """The table's key for the inner optimizer(s) (duck-typed by class and ``param_groups``), or None."""
    if not optimizers or len(optimizers) != 1:
        return None
    opt = optimizers[0]
    name = type(opt).__name__
    groups = getattr(opt, "param_groups", [])
    if name == "SGD":
        if any(g.get("nesterov", False) for g in groups):
            return "sgd_nesterov"
        return "sgd_momentum" if any(float(g.get("momentum", 0.0)) > 0 for g in groups) else "sgd"
    return {"LARS": "lars", "Adam": "adam", "AdamW": "adamw"}.get(name)


def outer_step_for(config: TopKConfig, optimizers: Optional[Sequence[Any]], replicas: int) -> OuterStep:
    """The outer step for ``config`` among ``replicas`` replicas with these inner ``optimizers`` (None: unknown).
    ``outer_lr`` / ``outer_momentum`` / ``outer_nesterov`` set in the config win one by one; the unset ones come
    from ``outer_recipe``: ``"auto"`` reads :data:`OUTER_RECIPE_TABLE` (plain averaging for an optimizer it does
    not know, outer momentum 0 with ``outer_streaming``), and with one replica, none of the three set, the round
    is the identity; ``"diloco"`` / ``"average"`` are :data:`NAMED_RECIPES`."""
    pinned = {k: getattr(config, k, None) for k in ("outer_lr", "outer_momentum", "outer_nesterov")}
    recipe = getattr(config, "outer_recipe", "auto")
    if recipe == "auto":
        kind = inner_kind(optimizers)
        lr, mu, nest = OUTER_RECIPE_TABLE.get(kind, UNKNOWN_RECIPE) if kind else UNKNOWN_RECIPE
        why = f"outer_recipe='auto' for {kind or 'an inner optimizer not in the table'}"
        if config.outer_streaming and mu > 0:
            mu, why = 0.0, why + " (momentum 0: outer_streaming)"
    else:
        (lr, mu, nest), why = NAMED_RECIPES[recipe], f"outer_recipe={recipe!r}"
    if all(v is None for v in pinned.values()) and recipe == "auto" and replicas <= 1:
        return OuterStep(1.0, 0.0, False, identity=True,
                         why="one replica under outer_recipe='auto': the outer round is the identity "
                             "(theta_outer := theta_local; set outer_lr/outer_momentum to take an outer step)")
    lr = pinned["outer_lr"] if pinned["outer_lr"] is not None else lr
    mu = pinned["outer_momentum"] if pinned["outer_momentum"] is not None else mu
    if pinned["outer_nesterov"] is not None:
        nest = pinned["outer_nesterov"]
    elif pinned["outer_momentum"] is not None:
        nest = True  # an outer momentum set without outer_nesterov: DiLoCo's Nesterov, as before outer_recipe
    set_ = [k for k, v in pinned.items() if v is not None]
    if set_:
        why += f"; {', '.join(set_)} as set"
    return OuterStep(float(lr), float(mu), bool(nest) and mu > 0, why=why)


# The amplification guard (said once, naming the options): AMPLIFY_ROUNDS rounds in a row whose outer step moved
# θ_outer more than AMPLIFY_RATIO times as far as this replica's own pseudo-gradient while θ_outer's norm has grown
# beyond AMPLIFY_NORM_GROWTH times its norm at the first round. The ratio alone does not tell a diverging run (SGD
# momentum with DiLoCo's step: ratio 2-4, weights' norm 4.5 -> 45-185) from a healthy one (plain SGD with DiLoCo's
# step: ratio up to 9-23, norm -> 15, +5.7 points over DDP); the growth does (healthy runs measured: at most 5.6x,
# diverging ones: 8.6x and more; benchmarks/outer_recipe.py).
AMPLIFY_RATIO = 2.0
AMPLIFY_NORM_GROWTH = 6.0
AMPLIFY_ROUNDS = 3


# ---- the outer optimizer -------------------------------------------------------------------------
def outer_sgd_(theta: Tensor, mom: Tensor, g: Tensor, lr: float, momentum: float, nesterov: bool) -> None:
    """``θ -= lr · step`` (torch SGD's update, dampening 0): ``m = μ m + g``; step = ``g + μ m`` (Nesterov) or
    ``m``; with ``μ = 0`` the step is ``g``."""
    if momentum == 0.0:
        theta.sub_(g, alpha=lr)
        return
    mom.mul_(momentum).add_(g)
    step = g.add(mom, alpha=momentum) if nesterov else mom
    theta.sub_(step, alpha=lr)


# ---- the outer state --------------------------------------------------------------------------------
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
    """

    def __init__(self, config: TopKConfig, named: Sequence[Tuple[str, Tensor]], inter: Any = None,
                 intra: Any = None, local: int = 1, local_rank: int = 0, flag_group: Any = None,
                 buffers: Sequence[Tuple[str, Tensor]] = (), optimizers: Optional[Sequence[Any]] = None) -> None:
        self.config = config
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.numels = [p.numel() for p in self.params]
        self.n = sum(self.numels)
        self.inter, self.intra, self.local, self.local_rank = inter, intra, local, local_rank
        self.flag_group = flag_group
        self.buffer_names = [n for n, _ in buffers]
        self.buffers = [b for _, b in buffers]
        self.float_buffers = [i for i, b in enumerate(self.buffers) if b.is_floating_point()]
        self.nbuf = sum(self.buffers[i].numel() for i in self.float_buffers)
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.layout = shard_layout(config, self.n, local)
        c = self.layout.c
        self.shard = self.layout.C * c  # entries per rank's shard (the flat vector is zero-padded to local * shard)
        self.lo = local_rank * self.shard
        R = self._replicas()
        self.exchange = outer_exchange_for(config, R, self.layout)
        # scale-free exchange: this replica owns chunks [owner * per, (owner + 1) * per) of the shard and keeps
        # the error feedback of their averaged, re-selected sum (mean units)
        self.owner = dist.get_rank(self.inter) if self.exchange == "scatter" else 0
        self.owner_layout, self.owner_out_layout = owner_layouts(self.layout, R)
        self.per = self.owner_layout.C  # chunks per owner (owner_chunks)
        self.owner_ef = torch.zeros(self.per * c if self.exchange == "scatter" else 0, device=dev)
        self.theta = self.flat_params()  # θ_outer
        self.buffer_anchor = self.flat_buffers()  # the float buffers at the start of the round (same on every rank)
        self.anchor: Optional[Tensor] = None  # streaming: where this round started (θ_outer when sent)
        self.mom = torch.zeros(self.shard, device=dev)
        self.ef = torch.zeros(self.shard, device=dev)
        self.position = 0  # inner optimizer steps since the last outer round
        self.steps = 0  # inner optimizer-step attempts since the start (the first ``dense_steps`` are synchronous)
        self.pending: Optional[Tensor] = None  # streaming: an averaged pseudo-gradient not applied yet
        self._flight: Optional[Tuple[Any, Tensor, float]] = None  # (work, gathered bytes, launch time)
        self._done_at: Optional[float] = None
        self._unapplied: Optional[Dict[str, Any]] = None  # the state before apply_in_flight (what a checkpoint keeps)
        self.stats = OuterStats()
        self.rule = outer_step_for(config, optimizers, R)  # the outer step: lr, momentum, Nesterov, or identity
        self.last_ratio = 0.0  # |outer step| / |own pseudo-gradient| of the last round (this rank's shard)
        self.last_growth = 0.0  # |θ_outer| / |θ_outer at the first round| (this rank's shard)
        self._norm0: Optional[float] = None
        self._amplified = 0  # rounds in a row whose outer step amplified the replica's own (AMPLIFY_RATIO)
        self.amplify_warned = False
        if self._first_replica():
            log.info("topk_local: outer step lr=%g momentum=%g nesterov=%s%s (%s)", self.rule.lr, self.rule.momentum,
                     self.rule.nesterov, " identity" if self.rule.identity else "", self.rule.why)
        if config.outer_streaming and self.rule.momentum > 0 and local_rank == 0 and self._first_replica():
            log.warning("topk_local: outer_streaming with outer_momentum=%g: outer momentum applied one round late "
                        "diverged on the namespace cluster (docs/local_sgd.md); use outer_momentum=0 with streaming",
                        self.rule.momentum)

    def _first_replica(self) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    # ---- flat views ------------------------------------------------------------------------------
    def flat_params(self) -> Tensor:
        """θ_local as one fp32 vector, zero-padded to ``local * shard``."""
        dev = self.params[0].device if self.params else torch.device("cpu")
        out = torch.empty(self.local * self.shard, dtype=torch.float32, device=dev)
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

    def flat_buffers(self) -> Tensor:
        """The floating-point buffers as one fp32 vector (empty without any)."""
        dev = self.buffers[0].device if self.buffers else torch.device("cpu")
        if not self.nbuf:
            return torch.zeros(0, dtype=torch.float32, device=dev)
        return torch.cat([self.buffers[i].detach().reshape(-1).float() for i in self.float_buffers])

    def write_buffers(self, flat: Tensor) -> None:
        off = 0
        with torch.no_grad():
            for i in self.float_buffers:
                b = self.buffers[i]
                k = b.numel()
                b.copy_(flat[off:off + k].view_as(b))
                off += k

    def _mine(self, flat: Tensor) -> Tensor:
        return flat[self.lo:self.lo + self.shard]

    # ---- rounds -----------------------------------------------------------------------------------
    @property
    def synchronous(self) -> bool:
        """Whether the next inner step is one of the first ``dense_steps`` (post-local SGD): its gradient is
        all-reduced densely over every rank, and no outer round runs."""
        return self.steps < self.config.dense_steps

    def restart(self) -> None:
        """θ_outer := θ_local (the replicas are identical after the synchronous steps), the buffers averaged over
        every rank (DDP did not sync them during the synchronous steps): local SGD starts here."""
        self.theta = self.flat_params()
        self.anchor = None
        self.position = 0
        if self.nbuf:
            _, avg = self._decide(None)
            if avg is not None:
                self.write_buffers(avg)
            self.buffer_anchor = self.flat_buffers()

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
        if self._flight is not None and self._done_at is None and self._flight[0].is_completed():
            self._done_at = time.perf_counter()
        if self.position < self.config.local_steps:
            return False
        self.position = 0
        self.outer_round()
        return True

    def outer_round(self) -> None:
        t0 = time.perf_counter()
        o = self.config
        local = self.flat_params()
        anchor = self.anchor if self.anchor is not None else self.theta
        delta = self._mine(anchor) - self._mine(local)
        fault, buffers = self._decide(delta)
        hidden = 0.0
        start = anchor.clone() if self.rule.identity else None
        before = self._mine(self.theta).clone()
        if fault and o.nonfinite == "raise":
            raise FloatingPointError("topk_local: non-finite pseudo-gradient (theta_outer - theta_local) or module "
                                     "buffer (e.g. BatchNorm statistics) on some rank at the end of an outer round; "
                                     "set nonfinite='skip' to skip such rounds")
        if self._flight is not None or self.pending is not None:  # streaming: apply the previous round now
            hidden = self._apply_pending()
        if fault and o.nonfinite == "skip":
            self.stats.skipped += 1
            self.write_params(self.theta)  # θ_local := θ_outer; EF, momentum untouched
            self.write_buffers(self.buffer_anchor)  # the module's buffers as at the start of the round
            if o.outer_streaming:
                self.anchor = self.theta.clone()
            self.stats.time_s = time.perf_counter() - t0
            return
        if self.rule.identity:  # one replica: nothing to exchange; θ_outer := θ_local (+ a resharded pending update)
            assert start is not None
            self.theta = local.add_(self.theta - start)
            self.anchor = None
        elif self.exchange == "scatter":  # never streamed (TopKConfig and outer_exchange_for see to it)
            self.ef.mul_(o.outer_ef_decay).add_(delta)
            self._update(self._scatter_round())
        else:
            self.ef.mul_(o.outer_ef_decay).add_(delta)
            packet, _ = compress(self.ef, self.layout, want_sent=False)
            gathered, work = self._launch(packet)
            if o.outer_streaming:
                self._flight = (work, gathered, time.perf_counter())
                self._done_at = None
                self.anchor = self.theta.clone()
            else:
                if work is not None:
                    work.wait()
                self._update(self._decode(gathered))
        self.write_params(self.theta)
        if buffers is not None:
            self.write_buffers(buffers)
            self.buffer_anchor = self.flat_buffers()
        if not self.rule.identity:
            self._guard(float((self._mine(self.theta) - before).norm()), float(delta.norm()))
        R = self._replicas()
        self.stats.rounds += 1
        self.stats.buffer_bytes = self._buffer_wire_bytes()
        self.stats.bytes = round_bytes_out(self.layout, R, self.exchange) + self.stats.buffer_bytes
        self.stats.density = self.layout.k / self.layout.c
        self.stats.time_s = time.perf_counter() - t0
        self.stats.hidden_frac = hidden

    def _guard(self, moved: float, own: float) -> None:
        """Say once when the outer step keeps moving θ_outer (this rank's shard) more than ``AMPLIFY_RATIO`` times
        as far as this replica's own pseudo-gradient while θ_outer's norm has grown ``AMPLIFY_NORM_GROWTH``-fold,
        ``AMPLIFY_ROUNDS`` rounds in a row: outer momentum amplifying the inner steps (how DiLoCo's outer step
        diverged with SGD-momentum inner steps)."""
        self.last_ratio = moved / own if own > 0 else 0.0
        norm = float(self._mine(self.theta).norm())
        if self._norm0 is None:
            self._norm0 = norm
        self.last_growth = norm / self._norm0 if self._norm0 > 0 else 0.0
        grown = self.last_growth > AMPLIFY_NORM_GROWTH
        self._amplified = self._amplified + 1 if self.last_ratio > AMPLIFY_RATIO and grown else 0
        if self._amplified >= AMPLIFY_ROUNDS and not self.amplify_warned:
            self.amplify_warned = True
            if self._first_replica():
                r = self.rule
                log.warning("topk_local: the outer step moved theta_outer %.1fx as far as this replica's own inner "
                            "steps did, %d rounds in a row, and the weights' norm grew %.1fx (outer_lr=%g, "
                            "outer_momentum=%g, outer_nesterov=%s: %s): "
                            "the outer momentum is amplifying the inner steps, which diverged with SGD-momentum "
                            "inner steps (docs/local_sgd.md). Set outer_recipe='auto' with outer_lr, outer_momentum "
                            "and outer_nesterov unset (the measured outer step for the inner optimizer), or "
                            "outer_recipe='average' (outer_lr=1, outer_momentum=0: plain averaging), or lower "
                            "outer_momentum", self.last_ratio, self._amplified, self.last_growth, r.lr, r.momentum,
                            r.nesterov, r.why)

    @property
    def payload_bytes(self) -> int:
        """The bytes of packets this rank makes in one round: its packet (all-gather), or its R owner segments
        plus its owner's re-selected segment (scale-free)."""
        if self.exchange == "scatter":
            return self._replicas() * self.owner_layout.nbytes + self.owner_out_layout.nbytes
        return self.layout.nbytes

    def _scatter_round(self) -> Tensor:
        """The scale-free exchange of this round's error-feedback buffer; returns the averaged update (this
        rank's shard, the same on every replica). Each replica compresses each owner's chunk range into a segment
        (``owner_layout``: the same size for every owner, the last range zero-padded) and sends it to that
        owner (one all-to-all); each owner decodes the R segments in rank order, averages them, adds its owner
        error feedback, re-selects the top-k per chunk at ``OWNER_K_FACTOR`` times the density and quantizes it
        at ``max(bits, OWNER_MIN_BITS)`` bits (``owner_out_layout``; the owner buffer keeps what was not sent,
        rounding error included, as ``ef`` does), and the owners' segments are all-gathered and decoded by every
        replica. Conservation: what the replicas send plus their ``ef`` is what went in, and the owners' sent
        values plus ``owner_ef`` are the mean of what the replicas sent plus the old ``owner_ef``."""
        lay, R, per, c = self.owner_layout, self._replicas(), self.per, self.layout.c
        C = self.layout.C
        x = self.ef.view(C, c)
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
        dist.all_to_all_single(recv, send, group=self.inter)
        if self.config.outer_ef_decay != 1.0:  # the owner buffer decays as ``ef`` does (0: no owner error feedback)
            self.owner_ef.mul_(self.config.outer_ef_decay)
        acc = sum_packets(recv, lay, per * c).div_(R).add_(self.owner_ef)
        out_lay = self.owner_out_layout
        mine, _ = compress(acc, out_lay, want_sent=False)
        self.owner_ef = acc
        So = out_lay.nbytes
        gathered = torch.empty(R * So, dtype=torch.uint8, device=send.device)
        _all_gather(gathered, mine, group=self.inter)
        g = torch.zeros(R * per * c, dtype=torch.float32, device=send.device)
        for r in range(R):
            decode_into(g[r * per * c:(r + 1) * per * c], gathered[r * So:(r + 1) * So], out_lay)
        return g[:self.shard]

    def _owner_range(self) -> Tuple[int, int]:
        """Entries of this rank's shard that its owner error feedback covers: [lo, hi)."""
        lo = min(self.owner * self.per * self.layout.c, self.shard)
        return lo, min(lo + self.per * self.layout.c, self.shard)

    def _replicas(self) -> int:
        return dist.get_world_size(self.inter) if dist.is_available() and dist.is_initialized() else 1

    def _world(self) -> int:
        return dist.get_world_size(self.flag_group) if dist.is_available() and dist.is_initialized() else 1

    def _buffer_wire_bytes(self) -> int:
        return ring_allreduce_wire(4 * self.nbuf, self._world()) if self.nbuf else 0

    def _decide(self, delta: Optional[Tensor]) -> Tuple[bool, Optional[Tensor]]:
        """One all-reduce over ``flag_group`` of the fault flag (a non-finite Δ or buffer on this rank; none with
        ``nonfinite="propagate"`` or ``delta`` None) and of the float buffers' change since ``buffer_anchor``.
        Returns (whether any rank flagged, the averaged buffers or None without float buffers)."""
        check = delta is not None and self.config.nonfinite != "propagate"
        bufs = self.flat_buffers() if self.nbuf else None
        if not (dist.is_available() and dist.is_initialized()):
            return False, bufs  # one process: its own buffers are the average (and nothing to decide)
        parts = []
        if check:
            assert delta is not None
            bad = nonfinite(delta)
            if bufs is not None:
                bad = bad | nonfinite(bufs)
            parts.append(bad.float().reshape(1).to(delta.device))
        if bufs is not None:
            dev = parts[0].device if parts else bufs.device
            parts.append((bufs - self.buffer_anchor).to(dev))
        if not parts:
            return False, None
        vec = torch.cat(parts) if len(parts) > 1 else parts[0]
        dist.all_reduce(vec, group=self.flag_group)
        fault = bool(vec[0].item() > 0) if check else False
        if bufs is None:
            return fault, None
        change = vec[1:] if check else vec
        return fault, self.buffer_anchor + change.to(bufs.device).div_(self._world())

    def _launch(self, packet: Tensor) -> Tuple[Tensor, Any]:
        R = self._replicas()
        if R == 1:
            return packet, None
        out = torch.empty(R * packet.numel(), dtype=torch.uint8, device=packet.device)
        work = _all_gather(out, packet, group=self.inter, async_op=True)
        return out, work

    def _decode(self, gathered: Tensor) -> Tensor:
        return sum_packets(gathered, self.layout, self.shard).div_(gathered.numel() // self.layout.nbytes)

    def _apply_pending(self) -> float:
        """Finish a streamed exchange (wait, decode) and apply it; returns the share of its flight hidden."""
        hidden = 0.0
        if self._flight is not None:
            work, gathered, t_launch = self._flight
            t_wait = time.perf_counter()
            if work is not None:
                work.wait()
            t_end = time.perf_counter()
            done = self._done_at if self._done_at is not None else t_end
            flight = max(done, t_wait) - t_launch
            hidden = (t_wait - t_launch) / flight if flight > 0 else 1.0
            hidden = min(1.0, hidden if self._done_at is None else 1.0)
            self.pending = self._decode(gathered)
            self._flight = None
            self._done_at = None
        if self.pending is not None:
            self._update(self.pending)
            self.pending = None
        return hidden

    @property
    def in_flight(self) -> bool:
        """Whether a streamed exchange was launched and not waited for yet (:meth:`finish_flight` waits)."""
        return self._flight is not None

    def finish_flight(self) -> None:
        """Wait for a streamed exchange and keep its decoded result as ``pending`` (applied at the next round
        end, as without the wait): before a checkpoint."""
        if self._flight is not None:
            work, gathered, _ = self._flight
            if work is not None:
                work.wait()
            self.pending = self._decode(gathered)
            self._flight = None
            self._done_at = None

    def apply_in_flight(self) -> bool:
        """At the end of training (on every rank): apply a streamed exchange that would otherwise only be applied
        at the next round end, so that the final weights include every round. θ_outer takes its outer step
        now; at a round end θ_local becomes the new θ_outer (the same on every replica), inside a round θ_local
        and the streaming start point move by the same change. The state as it was is kept
        (:meth:`state_dict` saves it, :meth:`resume_in_flight` restores it), so a checkpoint saved after the end
        of training, or training on, goes on exactly as a run that never stopped. Returns whether there was one."""
        if self._flight is None and self.pending is None:
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
            self.write_params(self.theta)
        else:
            self.write_params(self.flat_params().add_(change))
        if self.anchor is not None:
            self.anchor.add_(change)
        self._unapplied = unapplied
        return True

    def resume_in_flight(self) -> None:
        """Before training goes on after :meth:`apply_in_flight`: back to the state it kept (θ_local included)."""
        if self._unapplied is not None:
            sd, self._unapplied = self._unapplied, None
            self.load_state_dict(sd)

    def _update(self, g: Tensor) -> None:
        """Outer SGD on this rank's shard, then (several processes per node) the intra-node all-gather."""
        mine = self._mine(self.theta)
        outer_sgd_(mine, self.mom, g, self.rule.lr, self.rule.momentum, self.rule.nesterov)
        if self.local > 1:
            out = torch.empty_like(self.theta)
            _all_gather(out, mine.contiguous(), group=self.intra)
            self.theta = out

    # ---- checkpoint --------------------------------------------------------------------------------
    def _per_name(self, flat: Tensor, lo: int = 0, full: bool = True) -> Dict[str, Tensor]:
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

    def _from_names(self, d: Dict[str, Tensor], full: bool, like: Tensor) -> Tensor:
        whole = torch.zeros(self.local * self.shard, dtype=torch.float32, device=like.device)
        off = 0
        for name, k in zip(self.names, self.numels):
            t = d.get(name)
            if t is None or t.numel() != k:
                raise ValueError(f"topk_local: saved outer state has no entry of size {k} for parameter {name!r}")
            whole[off:off + k].copy_(t.reshape(-1))
            off += k
        return whole if full else whole[self.lo:self.lo + self.shard].clone()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's outer state (a streamed exchange in flight is finished first and kept as pending; after
        :meth:`apply_in_flight`, the state before it)."""
        if self._unapplied is not None:
            return dict(self._unapplied)
        self.finish_flight()
        sd: Dict[str, Any] = {
            "position": self.position, "steps": self.steps, "shard": [self.local, self.local_rank, self.shard],
            "theta_outer": self._per_name(self.theta), "theta_local": self._per_name(self.flat_params()),
            "momentum": self._per_name(self.mom, full=False), "ef": self._per_name(self.ef, full=False),
            "rounds": self.stats.rounds,
        }
        if self.exchange == "scatter":  # the owner error feedback: this rank's owned range of its shard
            lo, hi = self._owner_range()
            owned = torch.zeros_like(self.ef)
            owned[lo:hi] = self.owner_ef[:hi - lo]
            sd["owner_ef"] = self._per_name(owned, full=False)
            sd["owner"] = [self._replicas(), self.owner, self.per]
        if self.anchor is not None:
            sd["anchor"] = self._per_name(self.anchor)
        if self.pending is not None:
            sd["pending"] = self._per_name(self.pending, full=False)
        if self.buffers:  # this rank's own (inside a round, and during dense_steps, they differ per rank)
            sd["buffers"] = {n: b.detach().cpu().clone() for n, b in zip(self.buffer_names, self.buffers)}
            sd["buffer_anchor"] = self._buffers_by_name(self.buffer_anchor)
        return sd

    def _load_owner(self, sd: Dict[str, Any], like: Tensor) -> None:
        """The owner error feedback of a section saved under the scale-free exchange with this rank's owner plan
        (a resharded section has it folded into ``ef``; a section without it starts the owner buffer at zero)."""
        self.owner_ef.zero_()
        if "owner_ef" not in sd:
            return
        plan = [self._replicas(), self.owner, self.per]
        if self.exchange != "scatter" or list(sd.get("owner", [])) != plan:
            raise ValueError(f"topk_local: the saved outer state holds owner error feedback of "
                             f"outer_exchange='scatter' (replicas, owner, chunks per owner: {sd.get('owner')}); this "
                             f"run exchanges by {self.exchange!r} ({plan}). Resume with the saved outer_exchange "
                             "and layout (a change of either is resharded by the checkpoint loader)")
        lo, hi = self._owner_range()
        self.owner_ef[:hi - lo] = self._from_names(sd["owner_ef"], False, like)[lo:hi]

    def _buffers_by_name(self, flat: Tensor) -> Dict[str, Tensor]:
        out, off = {}, 0
        for i in self.float_buffers:
            k = self.buffers[i].numel()
            out[self.buffer_names[i]] = flat[off:off + k].detach().cpu().clone()
            off += k
        return out

    def _load_buffers(self, sd: Dict[str, Any]) -> None:
        """This rank's saved buffers into the module, and the round's buffer anchor; a section saved before
        buffers were kept (or by a model without them) leaves the module's as loaded (rank 0's)."""
        if not self.buffers:
            return
        if "buffers" not in sd:
            if self._first_replica():
                log.warning("topk_local: the saved outer state has no module buffers (saved before they were "
                            "kept per rank): every rank resumes with rank 0's, and the round's buffer average "
                            "starts from them")
            self.buffer_anchor = self.flat_buffers()
            return
        saved, anchor = sd["buffers"], sd.get("buffer_anchor", {})
        for i, (name, b) in enumerate(zip(self.buffer_names, self.buffers)):
            t = saved.get(name)
            if t is None or t.numel() != b.numel() or (i in self.float_buffers and
                                                       (anchor.get(name) is None or anchor[name].numel() != b.numel())):
                raise ValueError(f"topk_local: saved outer state has no entry of size {b.numel()} for buffer {name!r}")
        with torch.no_grad():
            for name, b in zip(self.buffer_names, self.buffers):
                b.copy_(saved[name].reshape(b.shape))
        self.buffer_anchor = torch.cat([anchor[self.buffer_names[i]].reshape(-1).float() for i in self.float_buffers]
                                       ).to(self.buffer_anchor.device) if self.nbuf else self.flat_buffers()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same layout of local ranks), or a section :func:`reshard` made for this
        rank from another layout; θ_local into the parameters included."""
        if not sd.get("resharded") and list(sd.get("shard", [])) != [self.local, self.local_rank, self.shard]:
            raise ValueError(f"topk_local: saved outer state is sharded as {sd.get('shard')} (processes per node, "
                             f"local rank, shard size), this run as {[self.local, self.local_rank, self.shard]}; "
                             "resume with the same devices per node and outer_chunk")
        like = self.theta
        self.theta = self._from_names(sd["theta_outer"], True, like)
        self.mom = self._from_names(sd["momentum"], False, like)
        self.ef = self._from_names(sd["ef"], False, like)
        self._load_owner(sd, like)
        self.anchor = self._from_names(sd["anchor"], True, like) if "anchor" in sd else None
        self.pending = self._from_names(sd["pending"], False, like) if "pending" in sd else None
        self.position = int(sd["position"])
        # a section saved before `steps` existed had no synchronous steps: local SGD had started
        self.steps = int(sd.get("steps", max(self.config.dense_steps, self.position)))
        self.stats.rounds = int(sd.get("rounds", 0))
        self._flight = None
        self.write_params(self._from_names(sd["theta_local"], True, like))
        self._load_buffers(sd)


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


def wire_bytes_per_param(density: float, bits: int, chunk: int = 4096) -> float:
    """Packet bytes per parameter of one outer round (values, scales, indices)."""
    c = chunk if chunk > 0 else 1 << 20
    lay = PacketLayout(1, c, chunk_k(c, density), bits)
    return lay.nbytes / c


def names_of(named: Sequence[Tuple[str, Tensor]]) -> List[str]:
    return [n for n, _ in named]
