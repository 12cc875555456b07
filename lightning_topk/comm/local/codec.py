"""Sparse local SGD's wire codec (torch only): chunks, per-chunk top-k, quantization, packets, bitmaps.

A rank's shard of the flat vector is cut into ``C`` chunks of ``c`` entries; each chunk sends its ``k`` largest
``|e|`` as ``outer_value_bits`` codes (32: fp32; 16: bf16; 8/4/2: integer codes ``round(v / s)`` clamped to
``±(2^(b-1) − 1)`` with one fp32 scale per chunk; 2 bits is ternary) and their in-chunk positions (int16/int32
or a bitmap of the chunk, :class:`PacketLayout`). :func:`compress` makes one fixed-size packet and leaves what
was not sent (rounding error included) in the error buffer; :func:`sum_packets` decodes packets laid end to
end in their order (bit-identical on every rank).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

VALUE_BITS = (32, 16, 8, 4, 2)

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


def shard_layout(config: Any, n: int, local: int) -> PacketLayout:
    """The packet layout of one rank's shard of a flat vector of ``n`` entries split over ``local`` processes."""
    c = chunk_size(-(-n // local), config.outer_chunk)
    C_all = -(-n // c)
    return PacketLayout(-(-C_all // local), c, chunk_k(c, config.outer_density), config.outer_value_bits)


def wire_bytes_per_param(density: float, bits: int, chunk: int = 4096) -> float:
    """Packet bytes per parameter of one outer round (values, scales, indices)."""
    c = chunk if chunk > 0 else 1 << 20
    lay = PacketLayout(1, c, chunk_k(c, density), bits)
    return lay.nbytes / c

