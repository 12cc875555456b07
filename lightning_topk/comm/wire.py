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
    """values (already in the wire dtype) and indices (< 2**31) -> one contiguous uint8 buffer."""
    return torch.cat([values.contiguous().view(torch.uint8), indices.to(torch.int32).view(torch.uint8)])


def unpack(buf: Tensor, k: int, value_dtype: torch.dtype, world: int) -> Tuple[Tensor, Tensor]:
    """Gathered ``[world * packed_nbytes]`` uint8 -> (values fp32 [world*k], indices int64 [world*k])."""
    vbytes = torch.finfo(value_dtype).bits // 8
    per = k * (vbytes + _INDEX_BYTES)
    rows = buf.view(world, per)
    values = rows[:, : k * vbytes].contiguous().view(value_dtype).reshape(-1)
    indices = rows[:, k * vbytes:].contiguous().view(torch.int32).reshape(-1)
    return values.float(), indices.long()
