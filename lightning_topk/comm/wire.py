"""Packing of selected (value, index) pairs into one fixed-size byte buffer per bucket.

Every rank sends exactly k entries per bucket, so a single ``all_gather_into_tensor`` moves values and
indices together with no size exchange and no uneven shapes (gloo's all_gather needs equal sizes).
Layout: ``[k values as value_dtype][indices as the bucket's IndexCode]``, viewed as uint8.

Indices (:func:`index_code`, a function of n and k that every rank knows):

* ``"blocks"`` (whenever it is smaller): the bucket is cut into blocks of 2**16 entries; the packet holds
  each block's entry count (int32) and, per entry, its position inside the block (16 bits). The entries
  go sorted by index, so 2 bytes per entry instead of 4, plus ``4 * ceil(n / 2**16)`` bytes of counts;
* ``"int32"``, or ``"int64"`` for buckets of more than 2**31 entries (never wrap silently).

The receiver gets the same (value, index) pairs; only their order within a rank's packet changes, and
``index_add_`` sums each index over the ranks in rank order either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
_LOW_OFFSET = 1 << (BLOCK_BITS - 1)  # positions 0..65535 are stored as int16 -32768..32767


def value_dtype_of(name: str) -> torch.dtype:
    if name not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {name!r}")
    return VALUE_DTYPES[name]


def index_dtype_for(n: int) -> torch.dtype:
    """int32 addresses buckets of up to 2**31 entries; larger buckets need int64 (never wrap silently)."""
    return torch.int32 if n <= 2**31 else torch.int64


@dataclass(frozen=True)
class IndexCode:
    """How one rank's indices into a bucket go on the wire (see the module docstring)."""

    kind: str            # "blocks", "int32" or "int64"
    blocks: int = 0      # "blocks": ceil(n / 2**16)
    out: torch.dtype = torch.int32  # the dtype :func:`unpack` returns the indices in

    def nbytes(self, k: int) -> int:
        """Index bytes for k entries."""
        if self.kind == "blocks":
            return 2 * k + 4 * self.blocks
        return k * (8 if self.kind == "int64" else 4)


INT32 = IndexCode("int32")


def index_code(n: int, k: int) -> IndexCode:
    """The smallest index encoding for k entries of a bucket of n (every rank computes the same)."""
    out = index_dtype_for(n)
    blocks = -(-n // BLOCK)
    if 4 * blocks < 2 * k:  # the block counts cost less than the two bytes saved per entry
        return IndexCode("blocks", blocks, out)
    return IndexCode("int32" if out == torch.int32 else "int64", 0, out)


def sparse_nbytes(n: int, k: int, value_bytes: int) -> int:
    """Bytes of one rank's packet: k entries of a bucket of n, values of ``value_bytes`` each."""
    return k * value_bytes + index_code(n, k).nbytes(k)


def packed_nbytes(k: int, value_dtype: torch.dtype, code: IndexCode = INT32) -> int:
    """Bytes one rank sends for k entries."""
    return k * value_dtype.itemsize + code.nbytes(k)


def to_wire(values: Tensor, value_dtype: torch.dtype) -> Tensor:
    """fp32 values -> wire dtype. Finite values beyond the dtype's range are clamped to it (a finite
    1e6 must not become inf in fp16); inf/NaN stay what they are, so a real fault is still seen."""
    if value_dtype == values.dtype:
        return values
    if value_dtype == torch.bfloat16:
        return values.to(value_dtype)  # fp32's exponent range: only values within 0.4% of fp32's max round to inf
    big = torch.finfo(value_dtype).max
    return torch.where(torch.isfinite(values), values.clamp(-big, big), values).to(value_dtype)


def pack(values: Tensor, indices: Tensor, code: IndexCode = INT32, host_reads: bool = False) -> Tensor:
    """values (already in the wire dtype) and indices -> one contiguous uint8 buffer.

    ``host_reads``: the caller allows a host read (not on the sync-free path), which lets the 'blocks' code
    skip sorting indices that are already ascending.

    2-D ``[rows, k]`` inputs give one ``[k values][k indices]`` row per destination (what :func:`unpack`
    reads back with ``world=rows``; int32/int64 codes only)."""
    if code.kind == "blocks":
        if values.dim() != 1:
            raise ValueError("pack: the 'blocks' index code packs one row")
        # No host sync: the counts come from searchsorted. With host_reads, one cheap read skips the sort
        # when the selector already gave ascending positions (the CPU "exact" path does, ties aside).
        if not (host_reads and bool((indices[1:] > indices[:-1]).all())):
            indices, order = indices.sort()
            values = values.index_select(0, order)
        edges = torch.arange(code.blocks + 1, device=indices.device, dtype=indices.dtype) * BLOCK
        bounds = torch.searchsorted(indices, edges)
        counts = (bounds[1:] - bounds[:-1]).to(torch.int32)
        low = ((indices & (BLOCK - 1)) - _LOW_OFFSET).to(torch.int16)
        parts = [values.contiguous().view(torch.uint8), counts.view(torch.uint8), low.view(torch.uint8)]
        return torch.cat(parts)
    v = values.contiguous().view(torch.uint8)
    i = indices.to(code.out).contiguous().view(torch.uint8)
    return torch.cat([v, i], dim=-1).reshape(-1)


def unpack(buf: Tensor, k: int, value_dtype: torch.dtype, world: int,
           code: IndexCode = INT32) -> Tuple[Tensor, Tensor]:
    """Gathered ``[world * packed_nbytes]`` uint8 -> (values fp32 [world*k], indices [world*k] in
    ``code.out``, which ``index_add_`` takes as it is)."""
    vbytes = value_dtype.itemsize
    vb = k * vbytes
    rows = buf.view(world, vb + code.nbytes(k))
    values = _view_as(rows[:, :vb], value_dtype).float()
    if code.kind != "blocks":
        return values, _view_as(rows[:, vb:], code.out)
    cb = 4 * code.blocks
    counts = _view_as(rows[:, vb:vb + cb], torch.int32)
    low = _view_as(rows[:, vb + cb:], torch.int16).to(code.out) + _LOW_OFFSET
    block = torch.arange(code.blocks, device=buf.device, dtype=code.out).repeat(world)
    # output_size: no host sync to size the result (the counts of each row add up to k)
    high = torch.repeat_interleave(block, counts, output_size=world * k)
    return values, high.mul_(BLOCK).add_(low)


def _view_as(part: Tensor, dtype: torch.dtype) -> Tensor:
    flat = part.reshape(-1)  # copies when world > 1 (the rows' slices are strided)
    if flat.storage_offset() % dtype.itemsize:  # one row's slice may start where the wider dtype cannot view
        flat = flat.clone()
    return flat.view(dtype)


# ---- bytes on the wire per rank (what leaves this rank), by collective algorithm -----------------------
def ring_allreduce_wire(nbytes: int, world: int) -> int:
    """Ring all-reduce (reduce-scatter + all-gather) of ``nbytes``: ``2 (P-1)/P * nbytes``."""
    return 2 * (world - 1) * nbytes // world


def ring_allgather_wire(nbytes: int, world: int) -> int:
    """Ring all-gather of ``nbytes`` per rank: every rank forwards ``P-1`` blocks."""
    return (world - 1) * nbytes


def all_to_all_wire(nbytes_per_peer: int, world: int) -> int:
    """Direct all-to-all with ``nbytes_per_peer`` per destination (the block to itself stays local)."""
    return (world - 1) * nbytes_per_peer


def ring_reduce_scatter_wire(nbytes: int, world: int) -> int:
    """Ring reduce-scatter of ``nbytes`` into ``P`` shards: ``(P-1)/P * nbytes``."""
    return (world - 1) * nbytes // world
