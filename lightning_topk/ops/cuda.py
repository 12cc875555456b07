"""CuPy kernels for CUDA tensors, with torch reference implementations of the same semantics.

Each public function dispatches: CUDA tensor of a supported dtype + CuPy importable with a device
-> the CUDA C kernel in ``lightning_topk.kernels`` (compiled by CuPy's ``RawModule``, tensors shared
zero-copy through DLPack, launched on torch's current stream); anything else -> the torch reference
(``*_torch``), which is what the CPU tests check. Importing this module does not import CuPy.

Set ``LIGHTNING_TOPK_DISABLE_CUPY=1`` to force the torch path everywhere.

Status: the CUDA sources are compiled (nvcc and NVRTC) in the tests here, but have not been run on a
GPU in this project's CI; the torch references are the tested semantics.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from lightning_topk.ops.cupy_launch import (  # noqa: F401  (re-exported: the kernels' loading lives there)
    _BLOCK,
    KERNEL_FILES,
    NVRTC_OPTIONS,
    _check_float,
    _compute_dtype,
    _cupy_problem,
    _disabled,
    _dlpack_view,
    _grid_for,
    _launch,
    _module,
    _scalar,
    _sm_count,
    _use_cupy,
    _warn_torch_fallback_on_cuda,
    cupy_available,
    kernel_source,
)

__all__ = [
    "cupy_available",
    "multi_threshold_count",
    "compact_selected",
    "compact_indices",
    "scatter_add_dense",
    "fused_lars_step",
    "multi_threshold_count_torch",
    "compact_selected_torch",
    "compact_indices_torch",
    "scatter_add_dense_torch",
    "fused_lars_step_torch",
    "kernel_source",
    "KERNEL_FILES",
    "NVRTC_OPTIONS",
]


_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # common.cuh LT_F32/F16/BF16
_MTC_MAX_THRESHOLDS = 4096      # per launch (shared memory: 8 bytes per threshold)
_COMPACT_TILE = 256 * 16        # compact.cu LT_TILE
_LARS_CHUNK = 16384             # fused_lars.cu LT_CHUNK
_LARS_FLAG_ADAPT, _LARS_FLAG_FIRST = 1, 2
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- multi-threshold count
def multi_threshold_count(absx: Tensor, thresholds: Tensor) -> Tensor:
    """Count, for each threshold, the entries of ``absx`` that are ``>= threshold``, in one read.

    ``absx``: floating tensor of any shape (normally magnitudes); ``thresholds``: 1-D, any order, may
    repeat. Returns int64 counts shaped like ``thresholds``, on ``absx``'s device. Comparisons are in
    fp32 (fp64 for fp64 input) after rounding the thresholds to that dtype; NaN entries and NaN
    thresholds count nothing. On CUDA (fp32/fp16/bf16): one kernel pass per 4096 thresholds.
    """
    _check_mtc(absx, thresholds)
    if absx.dtype in _DTYPE_CODE and _use_cupy(absx):
        return _multi_threshold_count_cupy(absx, thresholds)
    return multi_threshold_count_torch(absx, thresholds)


def _check_mtc(absx: Tensor, thresholds: Tensor) -> None:
    _check_float("multi_threshold_count", "absx", absx)
    if not isinstance(thresholds, Tensor) or thresholds.dim() != 1:
        raise ValueError("multi_threshold_count: thresholds must be a 1-D tensor")


def _sorted_thresholds(absx: Tensor, thresholds: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Ascending thresholds in the compute dtype with NaN replaced by +inf (their counts are zeroed
    afterwards by :func:`_unsort`), the sort order, and the NaN mask. No host read."""
    t = thresholds.to(device=absx.device, dtype=_compute_dtype(absx))
    nan = torch.isnan(t)
    ts, pos = torch.sort(torch.where(nan, torch.full_like(t, float("inf")), t))
    return ts, pos, nan


def _unsort(counts_sorted: Tensor, pos: Tensor, nan: Tensor) -> Tensor:
    out = torch.empty_like(counts_sorted).index_copy_(0, pos, counts_sorted)
    return out.masked_fill_(nan, 0)


def _suffix_sum(hist: Tensor) -> Tensor:
    """hist[j] = #entries with exactly j+1 sorted thresholds <= them -> count(x >= t[j]) = sum(hist[j:])."""
    return hist.flip(0).cumsum(0).flip(0)


def multi_threshold_count_torch(absx: Tensor, thresholds: Tensor) -> Tensor:
    """Torch reference of :func:`multi_threshold_count` (chunked bucketize + histogram; no host read)."""
    _check_mtc(absx, thresholds)
    ts, pos, nan = _sorted_thresholds(absx, thresholds)
    mv = ts.numel()
    hist = torch.zeros(mv + 1, dtype=torch.int64, device=absx.device)
    if mv:
        for chunk in absx.reshape(-1).split(1 << 22):
            c = chunk.to(ts.dtype)
            j = torch.bucketize(c, ts, right=True)        # number of sorted thresholds <= c
            j.masked_fill_(torch.isnan(c), 0)
            hist.index_add_(0, j, torch.ones((), dtype=torch.int64, device=j.device).expand(j.numel()))
    return _unsort(_suffix_sum(hist[1:]), pos, nan)


def _multi_threshold_count_cupy(absx: Tensor, thresholds: Tensor) -> Tensor:
    x = absx.reshape(-1).contiguous()
    ts, pos, nan = _sorted_thresholds(x, thresholds)
    counts = torch.zeros(ts.numel(), dtype=torch.int64, device=x.device)
    n = x.numel()
    if n and ts.numel():
        grid = max(_grid_for(n, x.device), (n + (1 << 30) - 1) >> 30)   # < 2^32 hits per block counter
        kernel = f"multi_threshold_count_{_SUFFIX[x.dtype]}"
        # More thresholds than fit in shared memory: one pass per slice; each slice's last bin counts
        # everything above its last threshold, so its suffix sums are exact counts on their own.
        for s in range(0, ts.numel(), _MTC_MAX_THRESHOLDS):
            tc = ts[s:s + _MTC_MAX_THRESHOLDS].contiguous()
            m = tc.numel()
            hist = torch.zeros(m, dtype=torch.int64, device=x.device)
            _launch(x.device, "threshold_count", kernel, grid,
                    (x, np.int64(n), tc, np.int32(m), hist), shared_mem=8 * m)
            counts[s:s + m] = _suffix_sum(hist)
    return _unsort(counts, pos, nan)


# -------------------------------------------------------------------------------------- compaction
def compact_selected(x: Tensor, threshold_hi, threshold_lo, k: int) -> Tuple[Tensor, Tensor]:
    """MSTopK output rule: pack exactly ``k`` entries of 1-D ``x`` into ``(values, int32 indices)``.

    Selected: every entry with ``|x| >= threshold_hi``, then the first ``k - count_hi`` entries in
    index order with ``threshold_lo <= |x| < threshold_hi``. Output order: the ``hi`` entries in index
    order, then the band entries in index order (same order on every path). Comparisons in fp32 (fp64
    for fp64 ``x``); NaN entries are never selected. Requires ``count_hi <= k <= count_hi +
    count_band`` (else ``ValueError``) and ``x.numel() < 2**31``. The CUDA path reads the two totals
    back to the host once to check this.
    """
    hi, lo, k = _check_compact(x, threshold_hi, threshold_lo, k)
    if x.dtype in _DTYPE_CODE and _use_cupy(x):
        return _compact_selected_cupy(x, hi, lo, k)
    return compact_selected_torch(x, hi, lo, k)


def _check_compact(x: Tensor, hi, lo, k) -> Tuple[float, float, int]:
    _check_float("compact_selected", "x", x)
    if x.dim() != 1:
        raise ValueError(f"compact_selected: x must be 1-D, got shape {tuple(x.shape)}")
    if x.numel() > _INT32_MAX:
        raise ValueError(f"compact_selected: x has {x.numel()} entries; int32 indices allow at most {_INT32_MAX}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"compact_selected: k must be a non-negative int, got {k!r}")
    return _scalar("compact_selected", "threshold_hi", hi), _scalar("compact_selected", "threshold_lo", lo), k


def _check_totals(count_hi: int, count_band: int, k: int) -> None:
    if not count_hi <= k <= count_hi + count_band:
        raise ValueError(
            f"compact_selected: need count_hi <= k <= count_hi + count_band, got count_hi={count_hi}, "
            f"count_band={count_band}, k={k}: threshold_hi must keep at most k entries and threshold_lo at least k")


def compact_selected_torch(x: Tensor, threshold_hi, threshold_lo, k: int) -> Tuple[Tensor, Tensor]:
    """Torch reference of :func:`compact_selected` (same set and same order)."""
    hi, lo, k = _check_compact(x, threshold_hi, threshold_lo, k)
    cdt = _compute_dtype(x)
    a = x.abs().to(cdt)
    is_hi = a >= torch.tensor(hi, dtype=cdt)
    is_band = (a >= torch.tensor(lo, dtype=cdt)) & ~is_hi
    hi_idx = torch.nonzero(is_hi).squeeze(1)
    band_idx = torch.nonzero(is_band).squeeze(1)
    _check_totals(hi_idx.numel(), band_idx.numel(), k)
    idx = torch.cat([hi_idx, band_idx[: k - hi_idx.numel()]])
    return x.index_select(0, idx), idx.to(torch.int32)


def _compact_offsets(counts: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-tile (hi, band) counts [tiles, 2] -> exclusive offsets across tiles, and the totals
    [count_hi, count_band], both on the device."""
    inclusive = counts.cumsum(0)
    return (inclusive - counts).contiguous(), inclusive[-1].contiguous()


def _compact_cupy(x: Tensor, thr: Tensor, k: int, check: bool) -> Tuple[Tensor, Tensor]:
    """compact.cu on 1-D contiguous ``x``; ``thr`` = [hi, lo] fp32 on the device. Reads the totals back
    (to check them) only when ``check``."""
    n = x.numel()
    sfx = _SUFFIX[x.dtype]
    nb = (n + _COMPACT_TILE - 1) // _COMPACT_TILE
    counts = torch.zeros(max(nb, 1), 2, dtype=torch.int64, device=x.device)
    if nb:
        _launch(x.device, "compact", f"compact_count_{sfx}", nb, (x, np.int64(n), thr, counts))
    offsets, totals = _compact_offsets(counts)
    if check:
        count_hi, count_band = totals.tolist()
        _check_totals(count_hi, count_band, k)
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.zeros(k, dtype=torch.int32, device=x.device)
    if k and nb:
        _launch(x.device, "compact", f"compact_write_{sfx}", nb,
                (x, np.int64(n), thr, offsets, totals, np.int64(k), values, indices))
    return values, indices


def _compact_selected_cupy(x: Tensor, hi: float, lo: float, k: int) -> Tuple[Tensor, Tensor]:
    thr = torch.tensor([hi, lo], dtype=torch.float32).to(x.device)
    return _compact_cupy(x.contiguous(), thr, k, check=True)


def compact_indices(absx: Tensor, thresholds: Tensor, k: int,
                    scratch: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """:func:`compact_selected`'s rule on magnitudes, with no host read: int64 indices of exactly ``k``
    entries of 1-D ``absx``.

    ``thresholds`` = ``[hi, lo]`` (a 2-element float tensor, normally on ``absx``'s device). Selected,
    in this order: the entries ``>= hi`` in index order, then the first ones in index order with
    ``lo <= absx < hi``. Nothing is checked against the data: with more than ``k`` entries ``>= hi``
    the first ``k`` of them are returned, and slots left over when fewer than ``k`` entries are
    ``>= lo`` hold index 0. Comparisons in fp32 (fp64 for fp64 input); NaN entries are never
    selected (callers that want them first map NaN to inf). ``scratch``: two bool buffers of
    ``absx.numel()`` for the torch path (CPU pays page faults for fresh ones). On CUDA (fp32, fp16,
    bf16; fewer than 2**31 entries): compact.cu, reading thresholds and totals from device memory.
    """
    _check_compact_indices(absx, thresholds, k)
    if absx.dtype in _DTYPE_CODE and absx.numel() <= _INT32_MAX and _use_cupy(absx):
        thr = thresholds.to(device=absx.device, dtype=torch.float32).contiguous()
        return _compact_cupy(absx.contiguous(), thr, k, check=False)[1].long()
    return compact_indices_torch(absx, thresholds, k, scratch)


def _check_compact_indices(absx: Tensor, thresholds: Tensor, k: int) -> None:
    _check_float("compact_indices", "absx", absx)
    if absx.dim() != 1:
        raise ValueError(f"compact_indices: absx must be 1-D, got shape {tuple(absx.shape)}")
    if not isinstance(thresholds, Tensor) or thresholds.shape != (2,):
        raise ValueError("compact_indices: thresholds must be a tensor [hi, lo] of 2 elements")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"compact_indices: k must be a non-negative int, got {k!r}")


def compact_indices_torch(absx: Tensor, thresholds: Tensor, k: int,
                          scratch: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """Torch reference of :func:`compact_indices` (fixed shapes throughout: ``nonzero_static``)."""
    _check_compact_indices(absx, thresholds, k)
    cdt = _compute_dtype(absx)
    a = absx if absx.dtype == cdt else absx.to(cdt)
    th = thresholds.to(device=a.device, dtype=cdt)
    if scratch is None:
        scratch = (torch.empty_like(a, dtype=torch.bool), torch.empty_like(a, dtype=torch.bool))
    m_hi, m_band = scratch
    torch.ge(a, th[0], out=m_hi)
    top = torch.nonzero_static(m_hi, size=k, fill_value=-1).squeeze(1)
    count_hi = (top >= 0).sum()
    band_mask = torch.ge(a, th[1], out=m_band).logical_and_(m_hi.logical_not_())
    band = torch.nonzero_static(band_mask, size=k, fill_value=0).squeeze(1)
    slot = torch.arange(k, device=a.device)
    from_band = band.index_select(0, (slot - count_hi).clamp_(min=0))
    return torch.where(slot < count_hi, top, from_band)


# ------------------------------------------------------------------------------------- scatter-add
def scatter_add_dense(out: Tensor, values: Tensor, indices: Tensor, scale: float = 1.0,
                      check: bool = True) -> Tensor:
    """``out[indices[i]] += values[i] * scale`` for all i, duplicates adding up; returns ``out``.

    ``out``: 1-D; ``values``: 1-D of ``out``'s dtype; ``indices``: int32 (int64 accepted), same length.
    Same semantics as ``out.index_add_(0, indices.long(), values * scale)`` (up to the order in which
    duplicates are summed on CUDA). Out-of-range indices raise ``IndexError`` on the torch path. The
    CUDA kernel skips them and flags them; with ``check=True`` the flag fails a device-side assertion
    (``torch._assert_async``), as torch's own ``index_add_`` does on CUDA: the error surfaces at the
    next synchronisation and no host read is made. ``check=False`` ignores bad indices.
    """
    s = _check_scatter(out, values, indices, scale)
    if out.dtype in _SUFFIX and _use_cupy(out, values, indices):
        return _scatter_add_dense_cupy(out, values, indices, s, check)
    return scatter_add_dense_torch(out, values, indices, s)


def _check_scatter(out: Tensor, values: Tensor, indices: Tensor, scale) -> float:
    _check_float("scatter_add_dense", "out", out)
    _check_float("scatter_add_dense", "values", values)
    if out.dim() != 1 or values.dim() != 1:
        raise ValueError("scatter_add_dense: out and values must be 1-D")
    if values.dtype != out.dtype:
        raise TypeError(f"scatter_add_dense: values dtype {values.dtype} must equal out dtype {out.dtype}")
    if not isinstance(indices, Tensor) or indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise TypeError("scatter_add_dense: indices must be a 1-D int32 (or int64) tensor")
    if indices.numel() != values.numel():
        raise ValueError(f"scatter_add_dense: {indices.numel()} indices for {values.numel()} values")
    return _scalar("scatter_add_dense", "scale", scale)


def scatter_add_dense_torch(out: Tensor, values: Tensor, indices: Tensor, scale: float = 1.0) -> Tensor:
    """Torch reference of :func:`scatter_add_dense`: ``out.index_add_(0, indices.long(), values * scale)``."""
    s = _check_scatter(out, values, indices, scale)
    return out.index_add_(0, indices.long(), values * s if s != 1.0 else values)


def _scatter_add_dense_cupy(out: Tensor, values: Tensor, indices: Tensor, scale: float,
                            check: bool) -> Tensor:
    if not out.is_contiguous():
        raise ValueError("scatter_add_dense: out must be contiguous on CUDA")
    if out.numel() > _INT32_MAX:
        raise ValueError(f"scatter_add_dense: out has {out.numel()} entries; int32 indices allow at most {_INT32_MAX}")
    nnz = values.numel()
    if nnz == 0:
        return out
    idx = indices.to(torch.int32).contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=out.device)
    sc = np.float64(scale) if out.dtype == torch.float64 else np.float32(scale)
    _launch(out.device, "scatter_add", f"scatter_add_{_SUFFIX[out.dtype]}", _grid_for(nnz, out.device),
            (out, np.int64(out.numel()), values.contiguous(), idx, np.int64(nnz), sc, bad))
    if check:
        torch._assert_async(bad == 0, f"scatter_add_dense: an index is out of range for out of size {out.numel()}")
    return out


# ---------------------------------------------------------------------------------------- fused LARS
PerTensor = Union[float, Sequence[float]]


def _per_tensor(name: str, v, n: int, kind=float) -> List:
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError(f"fused_lars_step: {name} has {len(v)} entries for {n} tensors")
        return [kind(x) for x in v]
    if isinstance(v, Tensor):
        if v.numel() != n:
            raise ValueError(f"fused_lars_step: {name} has {v.numel()} entries for {n} tensors")
        return [kind(x) for x in v.tolist()]
    return [kind(v)] * n


_LarsArgs = Tuple[List[Tensor], List[Tensor], List[Tensor], List[float], List[float], List[bool], List[bool]]


def _expand_lars(params, grads, bufs, lrs, weight_decays, adapt, first_step) -> _LarsArgs:
    """Lists of tensors and per-tensor options (lengths checked; the tensors themselves are not)."""
    params, grads, bufs = list(params), list(grads), list(bufs)
    n = len(params)
    if len(grads) != n or len(bufs) != n:
        raise ValueError(f"fused_lars_step: {n} params, {len(grads)} grads, {len(bufs)} momentum_bufs")
    return (params, grads, bufs, _per_tensor("lrs", lrs, n), _per_tensor("weight_decays", weight_decays, n),
            _per_tensor("adapt", adapt, n, bool), _per_tensor("first_step", first_step, n, bool))


def _check_lars_tensors(params, grads, bufs) -> None:
    for i, (p, g, b) in enumerate(zip(params, grads, bufs)):
        for what, t in (("params", p), ("grads", g), ("momentum_bufs", b)):
            _check_float("fused_lars_step", f"{what}[{i}]", t)
        if g.shape != p.shape or b.shape != p.shape:
            raise ValueError(f"fused_lars_step: tensor {i}: shapes param {tuple(p.shape)}, grad "
                             f"{tuple(g.shape)}, buf {tuple(b.shape)} differ")


def _check_lars(params, grads, bufs, lrs, weight_decays, adapt, first_step) -> _LarsArgs:
    args = _expand_lars(params, grads, bufs, lrs, weight_decays, adapt, first_step)
    _check_lars_tensors(*args[:3])
    return args


def fused_lars_step(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_bufs: Sequence[Tensor],
                    lrs: PerTensor, weight_decays: PerTensor, adapt: Union[bool, Sequence[bool]],
                    momentum: float, trust_coeff: float, eps: float, nesterov: bool = False,
                    first_step: Union[bool, Sequence[bool]] = False) -> None:
    """One LARS step over all tensors, in place on ``params`` and ``momentum_bufs``.

    ``lrs``, ``weight_decays``, ``adapt`` and ``first_step`` are one value for all tensors or one per
    tensor. All math in fp32 whatever the storage dtypes (fp32/fp16/bf16; each result rounded once):

    * adapted: ``w = ||p||``, ``gn = ||g||``, ``trust = trust_coeff * w / (gn + wd * w + eps)`` (1 where
      ``w == 0`` or ``gn == 0``), ``d = trust * (g + wd * p)``; not adapted: ``d = g`` (no decay);
    * ``buf = d`` on the first step, else ``buf = momentum * buf + d``;
    * ``update = d + momentum * buf`` if ``nesterov`` else ``buf``; ``p -= lr * update``.

    On CUDA (all tensors on one device, contiguous): three launches in total (chunk norms, per-tensor
    trust ratios, update). The device tables are cached by the tensors' addresses; shapes, dtypes,
    devices and contiguity are validated when a new set of addresses is seen, not on every step.
    """
    args = _expand_lars(params, grads, momentum_bufs, lrs, weight_decays, adapt, first_step)
    ps, gs, bs = args[:3]
    hyper = (float(momentum), float(trust_coeff), float(eps), bool(nesterov))
    tables = _lars_device_tables(ps, gs, bs, args[5], args[6]) if ps and _use_cupy(ps[0]) else None
    if tables is not None:
        _fused_lars_step_cupy(tables, ps[0].device, args[3], args[4], *hyper)
    else:
        _check_lars_tensors(ps, gs, bs)
        _fused_lars_step_torch(*args, *hyper)


# (flags, addresses) -> (meta, chunks) on the device, or None where the kernel cannot take the set
_LARS_TABLES: "OrderedDict[tuple, Optional[Tuple[Tensor, Tensor]]]" = OrderedDict()
_LARS_TABLES_KEPT = 8


def _lars_device_tables(ps, gs, bs, adapt, first) -> Optional[Tuple[Tensor, Tensor]]:
    key = (tuple(adapt), tuple(first), tuple((p.data_ptr(), g.data_ptr(), b.data_ptr()) for p, g, b in zip(ps, gs, bs)))
    if key in _LARS_TABLES:
        _LARS_TABLES.move_to_end(key)
        return _LARS_TABLES[key]
    _check_lars_tensors(ps, gs, bs)
    ts = ps + gs + bs
    dev = ts[0].device
    tables = None
    if all(t.device == dev and t.dtype in _DTYPE_CODE and t.is_contiguous() for t in ts):
        meta, chunks = _lars_tables(ps, gs, bs, adapt, first)
        tables = (torch.tensor(meta, dtype=torch.int64).to(dev), torch.tensor(chunks, dtype=torch.int64).to(dev))
    _LARS_TABLES[key] = tables
    while len(_LARS_TABLES) > _LARS_TABLES_KEPT:
        _LARS_TABLES.popitem(last=False)
    return tables


def fused_lars_step_torch(params, grads, momentum_bufs, lrs, weight_decays, adapt, momentum: float,
                          trust_coeff: float, eps: float, nesterov: bool = False, first_step=False) -> None:
    """Torch reference of :func:`fused_lars_step` (same arguments, same math)."""
    args = _check_lars(params, grads, momentum_bufs, lrs, weight_decays, adapt, first_step)
    _fused_lars_step_torch(*(args + (float(momentum), float(trust_coeff), float(eps), bool(nesterov))))


def _fused_lars_step_torch(ps, gs, bs, lrs, wds, adapt, first, momentum, tc, eps, nesterov) -> None:
    if not ps:
        return
    f32 = torch.float32
    p32 = [p if p.dtype == f32 else p.to(f32) for p in ps]
    g32 = [g.to(f32) for g in gs]
    d = list(g32)
    ad = [i for i in range(len(ps)) if adapt[i]]
    if ad:
        w = torch.stack(torch._foreach_norm([p32[i] for i in ad]))
        gn = torch.stack(torch._foreach_norm([g32[i] for i in ad]))
        wd = torch.tensor([wds[i] for i in ad], dtype=f32, device=w.device)
        trust = torch.where((w == 0) | (gn == 0), torch.ones_like(w), tc * w / (gn + wd * w + eps))
        decayed = torch._foreach_add([g32[i] for i in ad], torch._foreach_mul([p32[i] for i in ad], wd.tolist()))
        for i, di in zip(ad, torch._foreach_mul(decayed, trust.tolist())):
            d[i] = di
    b32 = []
    for i, (b, di) in enumerate(zip(bs, d)):
        b32.append(di.clone() if first[i] else b.to(f32) * momentum + di)
    upd = torch._foreach_add(d, torch._foreach_mul(b32, momentum)) if nesterov else b32
    new_p = torch._foreach_sub(p32, torch._foreach_mul(upd, lrs))
    torch._foreach_copy_(ps, new_p)
    torch._foreach_copy_(bs, b32)


def _lars_tables(ps, gs, bs, adapt, first) -> Tuple[List[List[int]], List[Tuple[int, int]]]:
    """Device tables of fused_lars.cu: per-tensor meta rows and the (tensor, start) chunk list."""
    meta: List[List[int]] = []
    chunks: List[Tuple[int, int]] = []
    for t, (p, g, b) in enumerate(zip(ps, gs, bs)):
        n = p.numel()
        c0 = len(chunks)
        chunks.extend((t, s) for s in range(0, n, _LARS_CHUNK))
        flags = (_LARS_FLAG_ADAPT if adapt[t] else 0) | (_LARS_FLAG_FIRST if first[t] else 0)
        codes = _DTYPE_CODE[p.dtype] | _DTYPE_CODE[g.dtype] << 8 | _DTYPE_CODE[b.dtype] << 16 | flags << 24
        meta.append([p.data_ptr(), g.data_ptr(), b.data_ptr(), n, codes, c0, len(chunks), 0])
    return meta, chunks


def _fused_lars_step_cupy(tables: Tuple[Tensor, Tensor], dev: torch.device, lrs, wds, momentum, tc, eps,
                          nesterov) -> None:
    meta_d, chunks_d = tables
    nc, nt = chunks_d.shape[0], meta_d.shape[0]
    if nc == 0:
        return
    # pinned + non_blocking: a pageable host-to-device copy would wait for the stream (a sync every step)
    hyper_d = torch.tensor(list(zip(lrs, wds)), dtype=torch.float32, pin_memory=True).to(dev, non_blocking=True)
    partials = torch.empty(nc, 2, dtype=torch.float64, device=dev)
    trust = torch.empty(nt, dtype=torch.float32, device=dev)
    _launch(dev, "fused_lars", "lars_norms", nc, (meta_d, chunks_d, partials))
    _launch(dev, "fused_lars", "lars_trust", nt, (meta_d, partials, hyper_d, np.float32(tc), np.float32(eps), trust))
    _launch(dev, "fused_lars", "lars_update", nc,
            (meta_d, chunks_d, trust, hyper_d, np.float32(momentum), np.int32(1 if nesterov else 0)))
