"""Top-k selection with no host synchronisation (:func:`topk_select_sync_free`, the default on CUDA): histograms
of the magnitudes' bit patterns locate the k-th magnitude, and a compaction into fixed-size outputs packs exactly
k entries, so every shape is fixed by ``(n, k)`` and nothing is read back. The host-reading path, the shared
argument checks and the workspace are :mod:`lightning_topk.comm.selection`'s.
"""
from __future__ import annotations

import os
from typing import Tuple

import torch
from torch import Tensor

from lightning_topk.comm.selection import _WS, _all_or_nothing, _kernel_path, check_topk_args
from lightning_topk.ops import cuda as cuda_ops


def sync_free_enabled(device: torch.device) -> bool:
    """The sync-free path is the default on CUDA; ``LIGHTNING_TOPK_SYNC_FREE=1`` forces it anywhere
    (``=0`` turns it off everywhere)."""
    env = os.environ.get("LIGHTNING_TOPK_SYNC_FREE", "").strip()
    if env in ("1", "true", "yes"):
        return True
    if env in ("0", "false", "no"):
        return False
    return torch.device(device).type == "cuda"


def topk_select_sync_free(x: Tensor, k: int, method: str = "exact") -> Tuple[Tensor, Tensor]:
    """Exactly k (value, int64 index) pairs of the largest |x|, with no host synchronisation.

    Same contract as :func:`topk_select` (values are ``x[idx]``, indices unordered, NaN and inf rank
    above every finite magnitude), but every shape is fixed by ``(x.numel(), k)`` and nothing is read
    back to the host, so it can run inside an asynchronous exchange on CUDA. ``method``:

    * ``"exact"``: the index set of ``torch.topk(x.abs(), k)`` up to ties. On CPU: a radix select on
      the fp32 bit patterns of |x| (two histogram passes find the k-th largest magnitude T exactly),
      then every entry above T and the first ties at T by position. On CUDA and for fp64:
      ``torch.topk``, whose CUDA kernel is itself a sync-free radix select;
    * ``"mstopk"``: MSTopK's bracket, found on the whole tensor in one pass: the count above every
      threshold of a fixed grid of 2**-7 relative resolution (the top 15 bits of the fp32 magnitude),
      which is the binary search of Shi et al. evaluated at all its thresholds at once. Output: every
      entry above the grid cell that holds the k-th magnitude, then the first entries of that cell
      by position (all within 0.8% of the k-th magnitude);
    * ``"torch"``: ``torch.topk``.

    Tensors under ``_SYNC_FREE_MIN_NUMEL`` entries use ``torch.topk`` for every method. No
    :class:`ThresholdHint` here: checking that a reused threshold leaves at least k candidates is a count
    that the host would have to read.
    """
    check_topk_args(x, k, method)
    n = x.numel()
    if k in (0, n):
        return _all_or_nothing(x, k)
    if method == "torch" or n < _SYNC_FREE_MIN_NUMEL or (method == "exact" and (x.is_cuda or x.dtype == torch.float64)):
        _, idx = torch.topk(x.abs(), k, sorted=False)
        return x.index_select(0, idx), idx
    keys = _magnitude_keys(x)
    scratch = _buf(n, x.device, torch.int32, 1)
    b, above = _kth_bucket(keys, k, scratch, _kernel_path(x))
    if method == "mstopk":
        lo = b << _PREFIX_SHIFT
        hi = lo + (1 << _PREFIX_SHIFT)
    else:
        lo = _kth_key_in_bucket(keys, k, b, above, scratch)
        hi = lo + 1
    thresholds = torch.stack([hi, lo]).to(torch.int32).view(torch.float32)
    masks = (_buf(n, x.device, torch.bool, 0), _buf(n, x.device, torch.bool, 1)) if x.device.type == "cpu" else None
    idx = cuda_ops.compact_indices(keys.view(torch.float32), thresholds, k, masks)
    return x.index_select(0, idx), idx


# Sync-free selection works on keys: the fp32 bit pattern of |x| read as int32, which orders like the
# magnitude; NaN keys are clamped to the key of +inf (NaN ranks with inf, above every finite value).
_KEY_INF = 0x7F800000
_PREFIX_SHIFT = 16                              # grid cell = top 15 bits: exponent + 7 mantissa bits
_CELLS = (_KEY_INF >> _PREFIX_SHIFT) + 1        # cells 0 .. 0x7f80 (the last one holds inf)
# Below this size torch.topk is as fast on CPU (measured: benchmarks/bench_select.py) and exact.
_SYNC_FREE_MIN_NUMEL = 1 << 21


def _buf(n: int, device: torch.device, dtype: torch.dtype, slot: int) -> Tensor:
    # CPU: reused buffers (fresh ones cost page faults); CUDA: the caching allocator already reuses.
    return _WS.get(n, device, dtype, slot=slot + 1) if device.type == "cpu" else torch.empty(n, dtype=dtype, device=device)


def _magnitude_keys(x: Tensor) -> Tensor:
    keys = _buf(x.numel(), x.device, torch.int32, 0)
    if x.dtype == torch.float32 and x.stride(0) == 1:
        torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=keys)
    else:
        keys.view(torch.float32).copy_(x)
        keys.bitwise_and_(0x7FFFFFFF)
    return keys.clamp_(max=_KEY_INF)


def _kth_from_counts(counts: Tensor, k: int, tail: Tensor) -> Tuple[Tensor, Tensor]:
    """``counts[j]`` = entries at or above edge j (non-increasing, ``counts[0] >= k``), ``tail`` = entries
    above the last edge's cell. Returns (j, entries above cell j) for the last edge j with >= k."""
    j = (counts >= k).sum() - 1
    above = torch.cat([counts[1:], tail.reshape(1)]).index_select(0, j.reshape(1))[0]
    return j, above


def _suffix_counts(hist: Tensor) -> Tensor:
    return hist.flip(0).cumsum(0).flip(0)


def _kth_bucket(keys: Tensor, k: int, scratch: Tensor, kernels: bool) -> Tuple[Tensor, Tensor]:
    """(grid cell of the k-th largest key, number of keys in higher cells), as 0-dim device tensors."""
    zero = torch.zeros((), dtype=torch.int64, device=keys.device)
    if kernels:
        return _kth_bucket_by_thresholds(keys.view(torch.float32), k, zero)
    cells = torch.bitwise_right_shift(keys, _PREFIX_SHIFT, out=scratch)
    hist = torch.zeros(_CELLS, dtype=torch.int64, device=keys.device)
    hist.index_add_(0, cells, torch.ones((), dtype=torch.int64, device=keys.device).expand(keys.numel()))
    return _kth_from_counts(_suffix_counts(hist), k, zero)


def _kth_bucket_by_thresholds(a: Tensor, k: int, zero: Tensor) -> Tuple[Tensor, Tensor]:
    """Same result as the histogram in :func:`_kth_bucket`, from two multi-threshold counts (the CUDA
    kernel reads the tensor once per call): 256 exponent edges, then the 128 cells of that exponent."""
    mant = 23 - _PREFIX_SHIFT
    edges = torch.arange(256, dtype=torch.int32, device=a.device) << 23
    e, above_e = _kth_from_counts(cuda_ops.multi_threshold_count(a, edges.view(torch.float32)), k, zero)
    cells = (e << mant) + torch.arange(1 << mant, dtype=torch.int64, device=a.device)
    edges = (cells << _PREFIX_SHIFT).to(torch.int32)   # above the key of inf: NaN thresholds, which count 0
    j, above = _kth_from_counts(cuda_ops.multi_threshold_count(a, edges.view(torch.float32)), k, above_e)
    return (e << mant) + j, above


def _kth_key_in_bucket(keys: Tensor, k: int, cell: Tensor, above: Tensor, scratch: Tensor) -> Tensor:
    """The k-th largest key, given its grid cell: a histogram of the low 16 bits of that cell's keys."""
    width = 1 << _PREFIX_SHIFT
    base = cell << _PREFIX_SHIFT
    d = torch.sub(keys, base - 1, out=scratch).clamp_(0, width + 1)   # 1 + low bits; 0 and width+1: other cells
    hist = torch.zeros(width + 2, dtype=torch.int64, device=keys.device)
    hist.index_add_(0, d, torch.ones((), dtype=torch.int64, device=keys.device).expand(keys.numel()))
    low, _ = _kth_from_counts(_suffix_counts(hist[1:width + 1]) + above, k, above)
    return base + low
