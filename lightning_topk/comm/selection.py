"""Top-k selection by magnitude over a 1-D tensor: exact, MSTopK (approximate) and a torch.topk fallback.

`torch.topk` is slow on large tensors. Both fast paths here estimate a threshold from a small random
sample of |x|, check it with one full count, and then work only on the few candidates above it.
Large temporaries come from a reusable workspace: on CPU a fresh 100 MB tensor costs more in page
faults (~150 ms for 25M floats here) than the arithmetic on it (~7 ms).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

METHODS = ("exact", "mstopk", "torch")

_SMALL_NUMEL = 1 << 15   # below this, torch.topk is as fast as anything
_DENSE_SHARE = 0.2       # k above this share of n: torch.topk
_SAMPLE = 1 << 16        # sample size for the threshold estimate
_MSTOPK_ROUNDS = 24      # binary-search rounds of MSTopK (on the sample)

# "auto": MSTopK uses the CuPy kernels (multi-threshold count + compaction) for CUDA tensors when CuPy
# sees a device; "always": that code path everywhere (off CUDA the kernels' torch references run,
# which is how it is tested here); "never": the torch path.
KERNEL_PATH = "auto"


def _cupy_ready() -> bool:
    from lightning_topk.comm import cuda_ops

    return cuda_ops.cupy_available()


class _Workspace:
    """Grow-only |x| (fp32) and mask buffers, one set per device."""

    def __init__(self) -> None:
        self._bufs: Dict[Tuple[str, torch.dtype], Tensor] = {}

    def get(self, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        key = (str(device), dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, device=device, dtype=dtype)
            self._bufs[key] = buf
        return buf[:n]

    def clear(self) -> None:
        self._bufs.clear()


_WS = _Workspace()


def clear_workspace() -> None:
    """Free the cached selection buffers (they are kept to avoid re-allocation per call)."""
    _WS.clear()


def check_topk_args(x: Tensor, k: int, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"topk_select: unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if not isinstance(x, Tensor):
        raise TypeError(f"topk_select: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"topk_select: x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"topk_select: x must be 1-D, got shape {tuple(x.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"topk_select: k must be a non-negative int, got {k!r}")
    if k > x.numel():
        raise ValueError(f"topk_select: k={k} is larger than the number of entries n={x.numel()}")


def topk_select(x: Tensor, k: int, method: str = "exact") -> Tuple[Tensor, Tensor]:
    """Select the k entries of ``x`` with the largest magnitude.

    Returns ``(values, indices)``: ``indices`` (int64) are positions in ``x`` and ``values`` are the
    signed ``x[indices]``; their order is unspecified. ``method``:

    * ``"exact"``: the same index set as ``torch.topk(x.abs(), k)`` (ties aside): a sampled threshold,
      a full count to confirm it, then an exact pick among the candidates;
    * ``"mstopk"``: the approximate multiple-sampling top-k of Shi et al. (MLSys'21): binary search of a
      threshold ratio between mean|x| and max|x| (never sorts); returns exactly k entries: every entry
      above the upper bracket plus a contiguous slice (in index order) of the band between brackets;
    * ``"torch"``: ``torch.topk`` itself.

    Tiny tensors, k close to n, and inputs with non-finite values fall back to ``torch.topk``
    (non-finite entries count as largest, so they are always selected).
    """
    check_topk_args(x, k, method)
    n = x.numel()
    if k == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.long, device=x.device)
    if k == n:
        return x.clone(), torch.arange(n, device=x.device)
    if method == "torch" or n <= _SMALL_NUMEL or k > _DENSE_SHARE * n:
        return _torch_topk(x, k)
    a = _WS.get(n, x.device, torch.float32)
    torch.abs(x, out=a) if x.dtype == torch.float32 else a.copy_(x.abs())
    mask = _WS.get(n, x.device, torch.bool)
    if method == "exact":
        idx = _exact(a, mask, k)
    elif KERNEL_PATH == "always" or (KERNEL_PATH == "auto" and x.is_cuda and _cupy_ready()):
        out = _mstopk_kernels(x, a, k)
        return out if out is not None else _torch_topk(x, k)
    else:
        idx = _mstopk(a, mask, k)
    if idx is None:
        return _torch_topk(x, k)
    return x.index_select(0, idx), idx


def _torch_topk(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    a = x.abs()
    if not bool(torch.isfinite(a).all()):
        a = torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))
    _, idx = torch.topk(a, k, sorted=False)
    return x.index_select(0, idx), idx


def _sample(a: Tensor) -> Tensor:
    # Fixed seed: selection is deterministic run to run (needed for bit-exact resume).
    g = torch.Generator(device=a.device).manual_seed(0x5EED)
    m = min(max(1, a.numel() // 4), _SAMPLE)
    return a[torch.randint(0, a.numel(), (m,), device=a.device, generator=g)]


def _exact(a: Tensor, mask: Tensor, k: int) -> Optional[Tensor]:
    n = a.numel()
    s = _sample(a)
    if not bool(torch.isfinite(s.max())) or not bool(torch.isfinite(a.max())):
        return None
    ratio = 1.15 if k * s.numel() / n >= 1000 else 1.4
    for _ in range(6):
        ks = min(s.numel(), max(1, int(k * s.numel() / n * ratio) + 8))
        t = float(torch.topk(s, ks, sorted=False).values.min())
        torch.ge(a, t, out=mask)
        cand = torch.nonzero(mask).squeeze(1)  # the count comes with the candidates: no extra pass
        c = cand.numel()
        if c >= k:
            if c > 3 * k + 1024:   # threshold far too low: raise it
                ratio = max(1.0, ratio * 0.5 * (3 * k) / c * 1.2)
                continue
            break
        ratio *= 1.5 if c > 0.5 * k else 3.0
    else:
        return None
    return _keep_largest(a, cand, k)


def _keep_largest(a: Tensor, cand: Tensor, k: int) -> Tensor:
    """The k candidates of largest magnitude (exact)."""
    drop = cand.numel() - k
    if drop == 0:
        return cand
    ca = a.index_select(0, cand)
    if drop <= k:  # drop the smallest candidates: a smaller top-k than picking the largest
        _, pos = torch.topk(ca, drop, largest=False, sorted=False)
        keep = torch.ones(cand.numel(), dtype=torch.bool, device=a.device)
        keep[pos] = False
        return cand[keep]
    _, pos = torch.topk(ca, k, sorted=False)
    return cand.index_select(0, pos)


def _mstopk_brackets(a: Tensor, k: int):
    """MSTopK's threshold search on a sorted random sample.

    Returns ``(t1, t2_tight, t2, span)``: upper bracket t1 (about count <= k), the search's own lower
    bracket, a safer lower bracket a few sigmas of sampling noise lower, and a step for widening.
    Returns ``"exact"`` when fewer than k entries exceed the mean, None when it cannot bracket.
    """
    n = a.numel()
    amax = float(a.max())
    mean = float(a.mean())
    if not (amax < float("inf")) or amax <= mean:
        return None
    s = torch.sort(_sample(a)).values
    m = s.numel()
    scale = n / m
    ts = s.new_empty(1)

    def est(t: float) -> float:
        # count(sample >= t) by binary search in the sorted sample: one round costs O(log m)
        ts.fill_(t)
        return float(m - int(torch.searchsorted(s, ts)[0])) * scale

    if est(mean) < k:  # fewer than k entries above the mean (large density): exact is the right tool
        return "exact"
    # Binary search of r in [0, 1], t = mean + r (max - mean); keep the best t1 (count <= k, upper
    # bracket) and t2 (count >= k, lower bracket).
    lo_r, hi_r = 0.0, 1.0
    t1, t2 = amax, mean
    for _ in range(_MSTOPK_ROUNDS):
        r = 0.5 * (lo_r + hi_r)
        t = mean + r * (amax - mean)
        if est(t) > k:
            lo_r, t2 = r, t
        else:
            hi_r, t1 = r, t
        if t1 - t2 <= 1e-7 * (amax - mean):
            break
    # The sample's count has noise ~sqrt(k m / n): aim the lower bracket a few sigmas low so that one
    # full pass usually confirms it.
    ks = k / scale
    margin = int(ks + 4 * ks ** 0.5 + 8)
    t2_tight = t2
    if margin < m:
        t2 = min(t2, float(s[m - margin]))
    return t1, t2_tight, t2, max(t1 - t2, 1e-3 * (amax - mean))


def _mstopk(a: Tensor, mask: Tensor, k: int) -> Optional[Tensor]:
    br = _mstopk_brackets(a, k)
    if br == "exact":
        return _exact(a, mask, k)
    if br is None:
        return None
    t1, t2_tight, t2, span0 = br
    # Confirm the lower bracket with one full pass (widening if the sample misled us); the upper
    # bracket is then checked on the candidates alone, which are few.
    span = span0
    for _ in range(8):
        torch.ge(a, t2, out=mask)
        cand = torch.nonzero(mask).squeeze(1)  # a >= t2, in index order
        if cand.numel() >= k:
            break
        t2 = max(0.0, t2 - span)
        span *= 2
    else:
        return None
    ca = a.index_select(0, cand)
    span = span0
    for _ in range(40):
        upper = ca >= t1
        if int(torch.count_nonzero(upper)) <= k:
            break
        t1 += span
        span *= 2
    else:
        return None
    above = cand[upper]
    in_band = ~upper
    tight = in_band & (ca >= t2_tight)  # the search's own bracket, if it holds enough entries
    if int(torch.count_nonzero(upper)) + int(torch.count_nonzero(tight)) >= k:
        in_band = tight
    band = cand[in_band]
    return torch.cat([above, band[: k - above.numel()]])


def _mstopk_kernels(x: Tensor, a: Tensor, k: int) -> Optional[Tuple[Tensor, Tensor]]:
    """MSTopK through the CUDA kernels: candidate brackets are checked in ONE multi-threshold count
    pass, then the compaction kernel packs exactly k entries (torch references off CUDA)."""
    from lightning_topk.comm import cuda_ops

    br = _mstopk_brackets(a, k)
    if br is None or br == "exact":
        return None
    t1, t2_tight, t2, span = br
    ups = [t1 + span * (2 ** j - 1) for j in range(16)]
    downs = [max(0.0, t2 - span * (2 ** j - 1)) for j in range(16)]
    th = torch.tensor([*ups, t2_tight, *downs], dtype=torch.float32, device=a.device)
    cnt = cuda_ops.multi_threshold_count(a, th).tolist()
    hi = next((t for t, c in zip(ups, cnt[:16]) if c <= k), None)
    lo = t2_tight if cnt[16] >= k else next((t for t, c in zip(downs, cnt[17:]) if c >= k), None)
    if hi is None or lo is None or lo > hi:
        return None
    values, idx = cuda_ops.compact_selected(x, hi, lo, k)
    return values, idx.long()


def sync_free_enabled(device: torch.device) -> bool:
    """The sync-free path is the default on CUDA; ``LIGHTNING_TOPK_SYNC_FREE=1`` forces it anywhere
    (``=0`` turns it off everywhere)."""
    import os

    env = os.environ.get("LIGHTNING_TOPK_SYNC_FREE", "").strip()
    if env in ("1", "true", "yes"):
        return True
    if env in ("0", "false", "no"):
        return False
    return torch.device(device).type == "cuda"


def topk_select_sync_free(x: Tensor, k: int, method: str = "exact") -> Tuple[Tensor, Tensor]:
    """Exactly k (value, int64 index) pairs of the largest |x|, with no host synchronisation.

    Same contract as :func:`topk_select` (values are ``x[idx]``, indices unordered), but every shape is
    fixed by ``(x.numel(), k)`` and nothing is read back to the host. For now every method uses
    ``torch.topk`` on the device (sync-free, exact).
    """
    check_topk_args(x, k, method)
    _, idx = torch.topk(x.abs(), k, sorted=False)
    return x.index_select(0, idx), idx
