"""Packing of selected (value, index) pairs into one fixed-size byte buffer per bucket.

Every rank sends exactly k entries per bucket, so a single ``all_gather_into_tensor`` moves values and
indices together with no size exchange and no uneven shapes (gloo's all_gather needs equal sizes).
Layout: ``[k values as value_dtype][k indices as int32]``, viewed as uint8.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_INDEX_BYTES = 4


def value_dtype_of(name: str) -> torch.dtype:
    if name not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {name!r}")
    return VALUE_DTYPES[name]


def packed_nbytes(k: int, value_dtype: torch.dtype) -> int:
    """Bytes one rank sends for k entries."""
    return k * (torch.finfo(value_dtype).bits // 8 + _INDEX_BYTES)


def pack(values: Tensor, indices: Tensor) -> Tensor:
    """values (already in the wire dtype) and indices (< 2**31) -> one contiguous uint8 buffer.

    2-D ``[rows, k]`` inputs give one ``[k values][k indices]`` row per destination (what :func:`unpack`
    reads back with ``world=rows``)."""
    v = values.contiguous().view(torch.uint8)
    i = indices.to(torch.int32).contiguous().view(torch.uint8)
    return torch.cat([v, i], dim=-1).reshape(-1)


def unpack(buf: Tensor, k: int, value_dtype: torch.dtype, world: int) -> Tuple[Tensor, Tensor]:
    """Gathered ``[world * packed_nbytes]`` uint8 -> (values fp32 [world*k], indices int64 [world*k])."""
    vbytes = torch.finfo(value_dtype).bits // 8
    per = k * (vbytes + _INDEX_BYTES)
    rows = buf.view(world, per)
    values = rows[:, : k * vbytes].contiguous().view(value_dtype).reshape(-1)
    indices = rows[:, k * vbytes:].contiguous().view(torch.int32).reshape(-1)
    return values.float(), indices.long()


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
