"""Shared pieces of the multi-tensor optimizers: option checks and per-(device, dtype) bucketing."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch import Tensor

LOW_PRECISION = (torch.float16, torch.bfloat16)


def run_closure(closure) -> Any:
    """Re-evaluate the loss with gradients on, as torch optimizers do (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_number(opt: str, name: str, value: Any, *, lo: float = None, hi: float = None,
                 lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a real number in the given range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{opt}: option '{name}' must be a number, got {value!r}")
    bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and (value > hi or (hi_open and value == hi)))
    if bad or value != value:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        rng = f"{left}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}{right}"
        raise ValueError(f"{opt}: option '{name}' must be in {rng}, got {value!r}")


def check_bool(opt: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{opt}: option '{name}' must be True or False, got {value!r}")


def bucket_params(params: Iterable[Tensor], opt: str) -> Dict[Tuple[torch.device, torch.dtype], List[Tensor]]:
    """Params that have a gradient, grouped by (device, dtype) so each bucket can use one foreach call."""
    buckets: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{opt} does not support sparse gradients")
        if not p.is_floating_point():
            raise RuntimeError(f"{opt} needs floating-point parameters, got {p.dtype}")
        buckets[(p.device, p.dtype)].append(p)
    return buckets


def fp32_views(params: List[Tensor], dtype: torch.dtype) -> Tuple[List[Tensor], List[Tensor]]:
    """fp32 working copies of params and grads (the tensors themselves for fp32/fp64)."""
    grads = [p.grad for p in params]
    if dtype in LOW_PRECISION:
        return [p.float() for p in params], [g.float() for g in grads]
    return list(params), grads
