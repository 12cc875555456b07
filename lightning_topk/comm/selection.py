"""Top-k selection by magnitude over a 1-D tensor: exact, MSTopK (approximate) and a torch.topk fallback.

`torch.topk` is slow on large tensors. :func:`topk_select` estimates a threshold from a small random
sample of |x|, checks it with one full count, and then works only on the few candidates above it;
the counts it reads back make it fast on CPU. :func:`~lightning_topk.comm.sync_free.topk_select_sync_free` never reads anything back
(for CUDA): histograms of the magnitudes' bit patterns locate the k-th magnitude, and a compaction into
fixed-size outputs packs exactly k entries. Large CPU temporaries come from a reusable workspace: a
fresh 100 MB tensor costs more in page faults (~150 ms for 25M floats here) than the arithmetic on it
(~7 ms).

Threshold reuse (Ok-Topk's idea, with an exactness check): a :class:`ThresholdHint` passed to
:func:`topk_select` remembers where the last exact selection of the same bucket put its k-th magnitude.
Gradients and residuals drift slowly step to step, so one pass at a little below that magnitude usually
yields between k and 3k+1024 candidates; then every entry at or above the true k-th magnitude is among
them and the exact top k is picked from them alone. Otherwise the sampled search runs as without a hint.
The hint only saves time: results are the same with or without it, whatever it holds.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from lightning_topk.ops import cuda as cuda_ops

METHODS = ("exact", "mstopk", "torch")

_SMALL_NUMEL = 1 << 15   # below this, torch.topk is as fast as anything
_DENSE_SHARE = 0.2       # k above this share of n: torch.topk
_SAMPLE = 1 << 16        # sample size for the threshold estimate
_MSTOPK_ROUNDS = 24      # binary-search rounds of MSTopK (on the sample)

# Intra-op threads of topk_select's CPU work. None: torch's setting (what the launcher or ``run.threads``
# gave every other op of the process: Lightning's launcher sets OMP_NUM_THREADS to cores / processes, torchrun
# and the test helpers to 1), capped at this process's share of the usable cores (cores / LOCAL_WORLD_SIZE),
# so that several processes on one host that kept one thread per core do not oversubscribe it in selection.
# 1 was the default until 2026-11-27: on a quiet 2-core Xeon it made exact selection at 25M entries 1.6x
# slower than torch's 2 threads (8.5x against 13-15x torch.topk); on an oversubscribed CPU 1 is faster
# (BENCHMARKS.md, "Top-k selection on another host").
CPU_THREADS: Optional[int] = None

# "auto": MSTopK (both entry points) uses the CuPy kernels (multi-threshold count + compaction) for
# CUDA tensors when CuPy sees a device; "always": that code path everywhere (off CUDA the kernels'
# torch references run, which is how it is tested here); "never": the torch path.
KERNEL_PATH = "auto"

# Threshold reuse for method "exact" when the caller passes a ThresholdHint (False: hints are ignored; for
# benchmarks). Speed only: the selection is the same either way.
THRESHOLD_REUSE = True


class ThresholdHint:
    """Where the last exact selection of one bucket (or slice) ended: a speed hint for the next one.

    ``key``: the fp32 bit pattern (read as int32) of the k-th largest magnitude last time (None: no hint
    yet). ``slack``: how far below it, in the same units (2**23 per factor of 2 in magnitude), the next
    pass looks, adapted to the count found: doubled after too few candidates, shrunk after many.
    ``hits`` / ``misses``: selections that took the one pass / that fell back to the sampled search.
    Holds no state that a result depends on, so it is never checkpointed; any content is safe.
    """

    __slots__ = ("key", "slack", "hits", "misses")

    def __init__(self) -> None:
        self.key: Optional[int] = None
        self.slack = _SLACK_START
        self.hits = 0
        self.misses = 0


_SLACK_START = 1 << 18   # about 2% in magnitude
_SLACK_MIN = 1 << 16     # about 0.5%: below it, training runs missed more often (BENCHMARKS.md)
_SLACK_MAX = 1 << 23     # a factor of 2


def _kernel_path(x: Tensor) -> bool:
    if KERNEL_PATH == "always":
        return True
    if KERNEL_PATH == "never" or not x.is_cuda:
        return False
    return cuda_ops.cupy_available()


class _Workspace:
    """Grow-only scratch buffers, one per (device, dtype, slot)."""

    def __init__(self) -> None:
        self._bufs: Dict[Tuple[str, torch.dtype, int], Tensor] = {}

    def get(self, n: int, device: torch.device, dtype: torch.dtype, slot: int = 0) -> Tensor:
        key = (str(device), dtype, slot)
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
    _SAMPLE_POS.clear()


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


def _all_or_nothing(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """k == 0 or k == n: nothing to select."""
    if k == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.long, device=x.device)
    return x.clone(), torch.arange(x.numel(), device=x.device)


def topk_select(x: Tensor, k: int, method: str = "exact",
                hint: Optional[ThresholdHint] = None) -> Tuple[Tensor, Tensor]:
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

    ``"exact"`` breaks ties at the k-th magnitude by position (the lowest positions are kept) and returns
    the indices above that magnitude in ascending order, then the tied ones: the output depends on x and k
    only (the ``torch.topk`` fallbacks above keep torch's own order and ties). ``hint`` (a :class:`ThresholdHint`, "exact" only; ignored by the other methods): threshold reuse
    between steps, see the module docstring; it changes the time taken, never the output.

    The one full pass over ``x`` (per threshold tried) compares the magnitudes' fp32 bit patterns with
    the threshold's in cache-sized chunks, so no full-size |x| is written; the candidates come from a
    scan of the mask eight flags at a time (:func:`_flagged`).
    """
    check_topk_args(x, k, method)
    n = x.numel()
    if k in (0, n):
        return _all_or_nothing(x, k)
    if method == "torch" or n <= _SMALL_NUMEL or k > _DENSE_SHARE * n:
        return _torch_topk(x, k)
    if method == "mstopk" and _kernel_path(x):
        out = _mstopk_kernels(x, k)
        return out if out is not None else _torch_topk(x, k)
    if hint is not None and not THRESHOLD_REUSE:
        hint = None
    with _cpu_threads(x):
        out = _exact(x, k, hint) if method == "exact" else _mstopk(x, k)
    return out if out is not None else _torch_topk(x, k)


@contextlib.contextmanager
def _cpu_threads(x: Tensor) -> Iterator[None]:
    """Run the CPU selection on ``CPU_THREADS`` intra-op threads (None: :func:`cpu_share`)."""
    if x.device.type != "cpu":
        yield
        return
    have = torch.get_num_threads()
    want = CPU_THREADS if CPU_THREADS is not None else cpu_share(have)
    if want == have:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(have)


def cpu_share(threads: int) -> int:
    """``threads``, capped at this process's share of the cores it may run on: their count divided by
    ``LOCAL_WORLD_SIZE`` (set by torchrun; 1 when unset), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(threads, cores // local))


def _torch_topk(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    a = x.abs()
    if not bool(torch.isfinite(a).all()):
        a = torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))
    _, idx = torch.topk(a, k, sorted=False)
    return x.index_select(0, idx), idx


def _sample(x: Tensor) -> Tensor:
    """|x| (fp32) at a fixed random sample of positions, in ascending order of position."""
    n = x.numel()
    key = (n, str(x.device))
    pos = _SAMPLE_POS.get(key)
    if pos is None:
        # Fixed seed: selection is deterministic run to run (needed for bit-exact resume). Sorted: the
        # gather then walks memory forwards (half the time of the random order here).
        g = torch.Generator(device=x.device).manual_seed(0x5EED)
        m = min(max(1, n // 4), _SAMPLE)
        pos = torch.sort(torch.randint(0, n, (m,), device=x.device, generator=g)).values
        if len(_SAMPLE_POS) >= 16:
            _SAMPLE_POS.clear()
        _SAMPLE_POS[key] = pos
    return x.index_select(0, pos).abs().float()


_SAMPLE_POS: Dict[Tuple[int, str], Tensor] = {}   # sample positions per (numel, device)


# fp32 magnitudes are compared through their bit patterns read as int32 ("keys"): for |x| >= 0 the
# order is the same, and NaN (whatever its sign) has a key above the key of inf.
_KEY_INF = 0x7F800000
_CHUNK = 1 << 20   # entries per chunk of the CPU mask pass: its 4 MB of keys stay in cache


def _key_of(t: float) -> int:
    """The key of the fp32 rounding of t >= 0 (what ``fp32_tensor >= t`` compares with)."""
    return int(torch.tensor(t, dtype=torch.float32).view(torch.int32))


def _mask_ge(x: Tensor, key: int) -> Tensor:
    """A bool mask, padded with False to a multiple of 8 entries: ``|x| >= t`` for the fp32 t with this
    key, True for NaN as well (see :func:`_key_pass`)."""
    mask, _ = _key_pass(x, key)
    assert mask is not None
    return mask


def _key_pass(x: Tensor, key: Optional[int], stats: bool = False) -> Tuple[Optional[Tensor], Tuple[float, float]]:
    """One read of x through its fp32 keys: the mask of keys >= ``key`` (if given; padded with False to a
    multiple of 8 entries) and, if ``stats``, (max|x|, mean|x|) (a NaN in x gives a NaN maximum).

    On CPU in chunks through a cache-sized key buffer, so x is read once and only the mask is written
    (a full-size |x| costs a 4-byte write and a second read per entry), and the compare writes int32 (a
    compare into bool is not vectorised on CPU: 8x slower here), copied into the bool mask."""
    n = x.numel()
    mask = None
    if key is not None:
        mask = _WS.get(-(-n // 8) * 8, x.device, torch.bool)
        mask[n:].fill_(False)
    chunk = _CHUNK if x.device.type == "cpu" else n
    tmp = _WS.get(min(n, chunk), x.device, torch.int32)
    bits = x.view(torch.int32) if x.dtype == torch.float32 else None
    sums, maxs = [], []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        kc = tmp[: e - s]
        if bits is not None:
            torch.bitwise_and(bits[s:e], 0x7FFFFFFF, out=kc)
        else:   # other dtypes: their fp32 value (as the fallback's |x| in fp32 would be)
            kc.view(torch.float32).copy_(x[s:e])
            kc.bitwise_and_(0x7FFFFFFF)
        if stats:
            maxs.append(kc.max())                       # the largest key is the key of max|x|
            sums.append(kc.view(torch.float32).sum())
        if mask is not None and key is not None:
            torch.ge(kc, key, out=kc)
            mask[s:e].copy_(kc)
    if not stats:
        return mask, (0.0, 0.0)
    amax = float(torch.stack(maxs).max().view(torch.float32))
    return mask, (amax, float(torch.stack(sums).sum()) / n)


def _flagged(mask: Tensor) -> Tensor:
    """``torch.nonzero(mask)`` (ascending int64 positions) for a mask padded to a multiple of 8: the
    8-byte words with any flag set first (an eighth of the elements to scan), then the flags in them."""
    words = mask.view(torch.int64)
    w = torch.nonzero(words).squeeze(1)
    q = torch.nonzero(words.index_select(0, w).view(torch.bool)).squeeze(1)
    return w.index_select(0, q >> 3).mul_(8).add_(q & 7)


def _exact(x: Tensor, k: int, hint: Optional[ThresholdHint] = None) -> Optional[Tuple[Tensor, Tensor]]:
    """The exact top k (ties by position), or None for the torch.topk path (non-finite entries)."""
    cand = _hinted_candidates(x, k, hint) if hint is not None else None
    known: Optional[int] = None
    if cand is None:
        cand, known = _sampled_candidates(x, k)
    if cand is None:
        return None
    xv = x.index_select(0, cand)
    ck = xv.abs().float().view(torch.int32)
    if int(ck.max()) >= _KEY_INF:   # every non-finite entry is a candidate: torch.topk path
        return None
    kth, pos = _keep_largest(ck, k, known)
    if hint is not None:
        hint.key = kth
    if pos is None:
        return xv, cand
    return xv.index_select(0, pos), cand.index_select(0, pos)


def _hinted_candidates(x: Tensor, k: int, hint: ThresholdHint) -> Optional[Tensor]:
    """Positions (ascending) of |x| >= the hint's threshold if there are k to 3k+1024 of them, else None.
    With at least k of them, the k-th largest magnitude is at or above the threshold, so every entry of
    the top k is a candidate: the exactness check."""
    if hint.key is None:
        return None
    t = min(max(int(hint.key) - int(hint.slack), 0), _KEY_INF)   # garbage in: still a valid threshold
    cand = _flagged(_mask_ge(x, t))
    c = cand.numel()
    if c < k:
        hint.misses += 1
        hint.slack = min(2 * int(hint.slack), _SLACK_MAX) if hint.slack > 0 else _SLACK_START
        return None
    if c > 3 * k + 1024:
        hint.misses += 1
        hint.slack = max(int(hint.slack) // 2, _SLACK_MIN)
        return None
    hint.hits += 1
    if c > 2 * k:
        hint.slack = max(int(hint.slack) * 3 // 4, _SLACK_MIN)
    return cand


def _sampled_candidates(x: Tensor, k: int) -> Tuple[Optional[Tensor], Optional[int]]:
    """Positions (ascending) of a set of at least k entries that holds every entry at or above the k-th
    largest magnitude: |x| >= a threshold estimated from the sample and confirmed by one full count
    (retried a few times), and the key of the k-th largest magnitude if it is known (None: to be found).
    (None, None): the sample holds a non-finite value (torch.topk path)."""
    n = x.numel()
    s = _sample(x).view(torch.int32)   # keys of the sample
    if int(s.max()) >= _KEY_INF:       # non-finite entries: torch.topk path
        return None, None
    ratio = 1.15 if k * s.numel() / n >= 1000 else 1.4
    tried = set()
    for _ in range(6):
        ks = min(s.numel(), max(1, int(k * s.numel() / n * ratio) + 8))
        t = int(torch.topk(s, ks, sorted=False).values.min())
        if t in tried:   # ties in the sample: the same threshold again would count the same
            break
        tried.add(t)
        cand = _flagged(_mask_ge(x, t))   # the count comes with the candidates: no extra pass
        c = cand.numel()
        if c >= k:
            if c > 3 * k + 1024:   # threshold far too low: raise it
                ratio = max(1.0, ratio * 0.5 * (3 * k) / c * 1.2)
                continue
            return cand, None
        ratio *= 1.5 if c > 0.5 * k else 3.0
    # The sample misled the search (heavy ties, say: an all-zero bucket): the k-th magnitude from
    # torch.topk, and the entries at or above it.
    a = x.abs().float()
    kth = int(torch.topk(a, k, sorted=False).values.min().view(torch.int32))
    return _flagged(_mask_ge(x, kth)), kth


def _keep_largest(ck: Tensor, k: int, known: Optional[int] = None) -> Tuple[int, Optional[Tensor]]:
    """(the k-th largest of the candidates' keys ``ck``, positions of the k largest; None: all of them).
    Positions: those with a key above the k-th in ascending order, then the first ones equal to it, so
    that the result does not depend on which entries below the k-th are candidates. ``known``: the k-th
    largest key, if already known."""
    c = ck.numel()
    if c == k:
        return int(ck.min()), None
    kth = torch.kthvalue(ck, c - k + 1).values if known is None else torch.tensor(known, dtype=ck.dtype)
    pos = torch.nonzero(ck >= kth).squeeze(1)
    if pos.numel() != k:   # ties at the k-th key: the first ones by position
        above = torch.nonzero(ck > kth).squeeze(1)
        tied = torch.nonzero(ck == kth).squeeze(1)
        pos = torch.cat([above, tied[: k - above.numel()]])
    return int(kth), pos


def _sample_top(x: Tensor, k: int) -> Tuple[Tensor, int, int]:
    """(the sample's `top` largest values in ascending order, m, margin) for MSTopK's search.

    Only the top of the sample can decide a comparison of its count with k: any threshold at or below
    its `top`-th largest value has more than k m / n sampled entries above it. So the search runs on
    the `top` largest, sorted (the same decisions as on the whole sorted sample). ``margin``: a few
    sigmas of sampling noise above k m / n."""
    s = _sample(x)
    m = s.numel()
    ks = k * m / x.numel()
    margin = int(ks + 4 * ks ** 0.5 + 8)
    top = min(m, 2 * margin + 64)
    return torch.topk(s, top, sorted=True).values.flip(0), m, margin


def _safe_lower(st: Tensor, m: int, margin: int) -> Optional[float]:
    """The sample's margin-th largest value: MSTopK's lower bracket unless its search ends lower."""
    return float(st[st.numel() - margin]) if margin < m else None


def _mstopk_brackets(x: Tensor, k: int, stats: Optional[Tuple[float, float]] = None, sample=None):
    """MSTopK's threshold search on a random sample of |x|; ``stats``: (max|x|, mean|x|) if known,
    ``sample``: :func:`_sample_top`'s result if known.

    Returns ``(t1, t2_tight, t2, span)``: upper bracket t1 (about count <= k), the search's own lower
    bracket, a safer lower bracket a few sigmas of sampling noise lower, and a step for widening.
    Returns ``"exact"`` when fewer than k entries exceed the mean, None when it cannot bracket.
    """
    n = x.numel()
    amax, mean = stats if stats is not None else _key_pass(x, None, stats=True)[1]
    if not (amax < float("inf")) or amax <= mean:
        return None
    st, m, margin = sample if sample is not None else _sample_top(x, k)
    top = st.numel()
    scale = n / m
    ts = st.new_empty(1)

    def est(t: float) -> float:
        # count(sample >= t) by binary search in the sorted top of the sample (saturates at `top`)
        ts.fill_(t)
        return float(top - int(torch.searchsorted(st, ts)[0])) * scale

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
    t2_tight = t2
    safe = _safe_lower(st, m, margin)
    if safe is not None:
        t2 = min(t2, safe)
    return t1, t2_tight, t2, max(t1 - t2, 1e-3 * (amax - mean))


def _mstopk(x: Tensor, k: int) -> Optional[Tuple[Tensor, Tensor]]:
    # The lower bracket is almost always the sample's margin-th largest value, known before max|x| and
    # mean|x|: the one pass that reads them also builds the mask at that value.
    sample = _sample_top(x, k)
    pre = _safe_lower(*sample)
    mask, stats = _key_pass(x, None if pre is None else _key_of(pre), stats=True)
    br = _mstopk_brackets(x, k, stats, sample)
    if br == "exact":
        return _exact(x, k)
    if br is None:
        return None
    t1, t2_tight, t2, span0 = br
    # Confirm the lower bracket with one full pass (widening if the sample misled us); the upper
    # bracket is then checked on the candidates alone, which are few.
    span = span0
    for _ in range(8):
        if t2 != pre or mask is None:
            mask = _mask_ge(x, _key_of(t2))
        cand = _flagged(mask)  # |x| >= t2, in index order
        if cand.numel() >= k:
            break
        t2 = max(0.0, t2 - span)
        span *= 2
    else:
        return None
    xv = x.index_select(0, cand)
    ca = xv.abs().float()
    if not bool(torch.isfinite(ca).all()):   # every non-finite entry is a candidate: torch.topk path
        return None
    span = span0
    for _ in range(40):
        upper = ca >= t1
        if int(torch.count_nonzero(upper)) <= k:
            break
        t1 += span
        span *= 2
    else:
        return None
    in_band = ~upper
    tight = in_band & (ca >= t2_tight)  # the search's own bracket, if it holds enough entries
    if int(torch.count_nonzero(upper)) + int(torch.count_nonzero(tight)) >= k:
        in_band = tight
    above = torch.nonzero(upper).squeeze(1)
    band = torch.nonzero(in_band).squeeze(1)
    pos = torch.cat([above, band[: k - above.numel()]])
    return xv.index_select(0, pos), cand.index_select(0, pos)


def _mstopk_kernels(x: Tensor, k: int) -> Optional[Tuple[Tensor, Tensor]]:
    """MSTopK through the CUDA kernels: candidate brackets are checked in ONE multi-threshold count
    pass, then the compaction kernel packs exactly k entries (torch references off CUDA)."""
    br = _mstopk_brackets(x, k)
    if br is None or br == "exact":
        return None
    a = _WS.get(x.numel(), x.device, torch.float32)
    torch.abs(x, out=a) if x.dtype == torch.float32 else a.copy_(x.abs())
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
