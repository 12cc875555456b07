"""Packing of selected (value, index) pairs into one fixed-size byte buffer per bucket.

Every rank sends exactly k entries per bucket, so a single ``all_gather_into_tensor`` moves values and
indices together with no size exchange and no uneven shapes (gloo's all_gather needs equal sizes).
Layout: ``[k values as value_dtype][k indices as index_dtype]``, viewed as uint8. Indices are int32,
or int64 for buckets of more than 2**31 entries (:func:`index_dtype_for`; every rank knows n).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def value_dtype_of(name: str) -> torch.dtype:
    if name not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {name!r}")
    return VALUE_DTYPES[name]


def index_dtype_for(n: int) -> torch.dtype:
    """int32 addresses buckets of up to 2**31 entries; larger buckets need int64 (never wrap silently)."""
    return torch.int32 if n <= 2**31 else torch.int64


def packed_nbytes(k: int, value_dtype: torch.dtype, index_dtype: torch.dtype = torch.int32) -> int:
    """Bytes one rank sends for k entries."""
    return k * (value_dtype.itemsize + index_dtype.itemsize)


def to_wire(values: Tensor, value_dtype: torch.dtype) -> Tensor:
    """fp32 values -> wire dtype. Finite values beyond the dtype's range are clamped to it (a finite
    1e6 must not become inf in fp16); inf/NaN stay what they are, so a real fault is still seen."""
    if value_dtype == values.dtype:
        return values
    if value_dtype == torch.bfloat16:
        return values.to(value_dtype)  # fp32's exponent range: only values within 0.4% of fp32's max round to inf
    big = torch.finfo(value_dtype).max
    return torch.where(torch.isfinite(values), values.clamp(-big, big), values).to(value_dtype)


def pack(values: Tensor, indices: Tensor, index_dtype: torch.dtype = torch.int32) -> Tensor:
    """values (already in the wire dtype) and indices -> one contiguous uint8 buffer.

    2-D ``[rows, k]`` inputs give one ``[k values][k indices]`` row per destination (what :func:`unpack`
    reads back with ``world=rows``)."""
    v = values.contiguous().view(torch.uint8)
    i = indices.to(index_dtype).contiguous().view(torch.uint8)
    return torch.cat([v, i], dim=-1).reshape(-1)


def unpack(buf: Tensor, k: int, value_dtype: torch.dtype, world: int,
           index_dtype: torch.dtype = torch.int32) -> Tuple[Tensor, Tensor]:
    """Gathered ``[world * packed_nbytes]`` uint8 -> (values fp32 [world*k], indices [world*k] in
    ``index_dtype``, which ``index_add_`` takes as it is)."""
    vbytes = value_dtype.itemsize
    per = k * (vbytes + index_dtype.itemsize)
    rows = buf.view(world, per)
    return _view_as(rows[:, : k * vbytes], value_dtype).float(), _view_as(rows[:, k * vbytes:], index_dtype)


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
