import pytest
import torch

from lightning_topk import topk_select
from lightning_topk.comm.sync_free import topk_select_sync_free
from tests.helpers.syncs import count_syncs


def _ref_set(x, k):
    return set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("n,k", [(200_000, 2_000), (200_000, 200), (1_000_000, 10_000), (100, 7), (50_000, 20_000)])
def test_exact_matches_torch_topk(n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)  # continuous: no ties
    v, i = topk_select(x, k, "exact")
    assert i.numel() == k and v.numel() == k
    assert set(i.tolist()) == _ref_set(x, k)
    assert torch.equal(v, x[i])


@pytest.mark.parametrize("dist", ["normal", "laplace", "sparse_heavy"])
def test_mstopk_exactly_k_unique_and_captures_mass(dist):
    g = torch.Generator().manual_seed(1)
    n, k = 500_000, 5_000
    x = torch.randn(n, generator=g)
    if dist == "laplace":
        x = torch.distributions.Laplace(0.0, 1.0).sample((n,))
    elif dist == "sparse_heavy":
        x = x * (torch.rand(n, generator=g) < 0.05) * 100 + torch.randn(n, generator=g) * 0.01
    v, i = topk_select(x, k, "mstopk")
    assert i.numel() == k and i.unique().numel() == k
    assert torch.equal(v, x[i])
    ref = torch.topk(x.abs(), k).values
    mass = (v.double() ** 2).sum() / (ref.double() ** 2).sum()
    assert mass >= 0.99


def test_large_density_and_half_inputs():
    x = torch.randn(100_000).half()
    for m in ("exact", "mstopk", "torch"):
        v, i = topk_select(x, 30_000, m)  # k close to n -> torch path
        assert set(i.tolist()) == _ref_set(x.float(), 30_000) or m == "mstopk"
        assert v.dtype == torch.float16 and i.numel() == 30_000
    xb = torch.randn(300_000).bfloat16()
    v, i = topk_select(xb, 3_000, "exact")
    ref = torch.topk(xb.float().abs(), 3_000).values.min()
    assert v.float().abs().min() >= ref  # ties in bf16 are common: compare by magnitude


def test_edge_k_values():
    x = torch.randn(1000)
    v, i = topk_select(x, 0)
    assert v.numel() == 0 and i.numel() == 0
    v, i = topk_select(x, 1000)
    assert torch.equal(torch.sort(i).values, torch.arange(1000))
    z = torch.zeros(100_000)
    v, i = topk_select(z, 10, "exact")
    assert i.numel() == 10 and v.abs().sum() == 0


def test_nonfinite_entries_always_selected():
    x = torch.randn(200_000)
    x[123] = float("inf")
    x[456] = float("nan")
    for m in ("exact", "mstopk", "torch"):
        v, i = topk_select(x, 100, m)
        assert {123, 456} <= set(i.tolist())


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(10), 3, "fastest"), "unknown method"),
        ((torch.randn(10), 11, "exact"), "larger than the number of entries"),
        ((torch.arange(10), 3, "exact"), "floating-point"),
        ((torch.randn(2, 5), 3, "exact"), "1-D"),
        ((torch.randn(10), -1, "exact"), "non-negative"),
        (([1.0, 2.0], 1, "exact"), "torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        topk_select(*args)


def test_mstopk_kernel_path_via_references(monkeypatch):
    """The CUDA path of MSTopK (one multi-threshold count, then compaction), run through the kernels'
    torch references: same contract as the torch path."""
    import lightning_topk.comm.selection as sel

    monkeypatch.setattr(sel, "KERNEL_PATH", "always")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400_000, generator=g) * torch.exp(torch.randn(400_000, generator=g))
    for k in (4_000, 400):
        v, i = topk_select(x, k, "mstopk")
        assert i.numel() == k and i.unique().numel() == k and i.dtype == torch.long
        assert torch.equal(v, x[i])
        ref = torch.topk(x.abs(), k).values
        assert (v.double() ** 2).sum() / (ref.double() ** 2).sum() >= 0.99


# ----------------------------------------------- topk_select's CPU pass (chunked key mask, word scan)
@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4,096 entries: test-sized tensors cross many chunk boundaries."""
    import lightning_topk.comm.selection as sel

    monkeypatch.setattr(sel, "_CHUNK", 4096)
    return sel


def _adversarial(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if kind == "ties":          # few distinct magnitudes, both signs
        x = torch.randint(-4, 5, (n,), generator=g).float()
    elif kind == "all_equal":
        x = torch.full((n,), -0.5)
    elif kind == "zeros_and_negzero":
        x = torch.zeros(n)
        x[::3] = -0.0
        x[torch.randint(0, n, (n // 100,), generator=g)] = torch.randn(n // 100, generator=g)
    elif kind == "tiny_values":  # subnormals and their neighbours
        x = x * 1e-40
    return x


def _assert_exact(x, k, v, i):
    """Same set as torch.topk where magnitudes are distinct; under ties, the same magnitudes."""
    _check_pairs(x, k, v, i)
    ref = torch.topk(x.abs(), k).values
    assert torch.equal(torch.sort(v.abs()).values, torch.sort(ref).values)


@pytest.mark.parametrize("kind", ["gradient", "ties", "all_equal", "zeros_and_negzero", "tiny_values"])
@pytest.mark.parametrize("n,k", [(100_003, 1), (100_003, 17), (100_003, 1_000), (100_003, 20_000), (65_537, 13_107)])
def test_exact_chunked_pass_matches_torch_topk(small_chunks, kind, n, k):
    x = _adversarial(kind, n, n + k)
    v, i = topk_select(x, k, "exact")
    _assert_exact(x, k, v, i)
    if kind == "gradient":    # continuous: no ties, so the very same index set
        assert set(i.tolist()) == _ref_set(x, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_exact_other_dtypes_through_fp32_keys(small_chunks, dtype):
    x = _gradient_like(100_001, 5, dtype)
    v, i = topk_select(x, 1_000, "exact")
    _check_pairs(x, 1_000, v, i)
    kth = torch.topk(x.float().abs(), 1_000).values.min()
    assert v.float().abs().min() >= kth


@pytest.mark.parametrize("method", ["exact", "mstopk"])
@pytest.mark.parametrize("bad", ["nan", "-nan", "inf", "-inf"])
def test_nonfinite_anywhere_is_selected(small_chunks, method, bad):
    x = _gradient_like(100_001, 6)
    value = {"nan": float("nan"), "-nan": -float("nan"), "inf": float("inf"), "-inf": -float("inf")}[bad]
    x[100_000] = value   # in the last, short chunk
    x[4_095] = value     # at a chunk boundary
    v, i = topk_select(x, 50, method)
    assert {100_000, 4_095} <= set(i.tolist()) and i.numel() == 50


@pytest.mark.parametrize("kind", ["gradient", "ties", "zeros_and_negzero"])
@pytest.mark.parametrize("n,k", [(100_003, 1), (100_003, 1_000), (100_003, 20_000)])
def test_mstopk_chunked_pass_follows_its_rule(small_chunks, kind, n, k):
    x = _adversarial(kind, n, n + 2 * k)
    v, i = topk_select(x, k, "mstopk")
    _check_pairs(x, k, v, i)
    if kind == "gradient":
        assert _mass(v, x, k) >= 0.99


def test_flagged_is_nonzero():
    from lightning_topk.comm.selection import _flagged

    g = torch.Generator().manual_seed(7)
    for n, p in [(8, 0.5), (64, 0.0), (1_000_000, 0.01), (1_000_000, 0.3), (80, 1.0)]:
        mask = torch.rand(n, generator=g) < p
        assert torch.equal(_flagged(mask), torch.nonzero(mask).squeeze(1))


def test_mstopk_search_on_the_top_of_the_sample_matches_the_full_sort():
    """The brackets come from the sample's largest values only; the original search over the whole
    sorted sample gives the same (t1, t2_tight, t2)."""
    import lightning_topk.comm.selection as sel

    for n, k in [(500_000, 5_000), (500_000, 500), (2_000_000, 2_000), (200_000, 1)]:
        x = _gradient_like(n, n + k)
        t1, t2_tight, t2, _ = sel._mstopk_brackets(x, k)
        amax, mean = float(x.abs().max()), float(x.abs().mean())
        s = torch.sort(sel._sample(x)).values
        m = s.numel()

        def est(t, s=s, m=m, n=n):
            return float(m - int(torch.searchsorted(s, torch.tensor([t], dtype=s.dtype))[0])) * n / m

        lo_r, hi_r, r1, r2 = 0.0, 1.0, amax, mean
        for _ in range(sel._MSTOPK_ROUNDS):
            r = 0.5 * (lo_r + hi_r)
            t = mean + r * (amax - mean)
            if est(t) > k:
                lo_r, r2 = r, t
            else:
                hi_r, r1 = r, t
            if r1 - r2 <= 1e-7 * (amax - mean):
                break
        ks = k * m / n
        margin = int(ks + 4 * ks ** 0.5 + 8)
        assert (t1, t2_tight) == pytest.approx((r1, r2), rel=1e-5)
        assert t2 == pytest.approx(min(r2, float(s[m - margin])), rel=1e-5)


def test_selection_threads_follow_torch_capped_at_the_process_share_of_the_cores(monkeypatch):
    import os

    import lightning_topk.comm.selection as sel

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert sel.cpu_share(1) == 1 and sel.cpu_share(cores) == cores and sel.cpu_share(cores + 7) == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more processes than cores: one thread each
    assert sel.cpu_share(cores) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")
    assert sel.cpu_share(cores) == cores
    seen = []
    monkeypatch.setattr(sel, "CPU_THREADS", None)
    monkeypatch.setattr(sel, "cpu_share", lambda t: seen.append(torch.get_num_threads()) or 1)
    x = _gradient_like(200_000, 8)
    before = torch.get_num_threads()
    topk_select(x, 2_000, "exact")
    assert seen == [before] and torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [None, 1, 2])
def test_cpu_threads_setting_is_restored(monkeypatch, threads):
    import lightning_topk.comm.selection as sel

    monkeypatch.setattr(sel, "CPU_THREADS", threads)
    before = torch.get_num_threads()
    x = _gradient_like(200_000, 8)
    for m in ("exact", "mstopk"):
        v, i = topk_select(x, 2_000, m)
        _check_pairs(x, 2_000, v, i)
    assert set(topk_select(x, 2_000, "exact")[1].tolist()) == _ref_set(x, 2_000)
    assert torch.get_num_threads() == before


# ------------------------------------------------------------------------- the host-sync counter
_SYNCS = {   # name -> (code that syncs on CUDA, what count_syncs records)
    "item": (lambda t, m: t[0].item(), "Tensor.item"),
    "bool": (lambda t, m: bool(t[0] > 0), "Tensor.__bool__"),
    "int": (lambda t, m: int(t[0]), "Tensor.__int__"),
    "float": (lambda t, m: float(t[0]), "Tensor.__float__"),
    "index": (lambda t, m: [1, 2, 3][t.argmax() % 3], "Tensor.__index__"),
    "tolist": (lambda t, m: t.tolist(), "Tensor.tolist"),
    "cpu": (lambda t, m: t.cpu(), "Tensor.cpu"),
    "numpy": (lambda t, m: t.numpy(), "Tensor.numpy"),
    "nonzero": (lambda t, m: torch.nonzero(m), "aten.nonzero.default"),
    "where1": (lambda t, m: torch.where(m), "aten.nonzero.default"),
    "mask_get": (lambda t, m: t[m], "aten.index.Tensor"),
    "mask_set": (lambda t, m: t.__setitem__(m, 0.0), "aten.index_put_.default"),
    "masked_select": (lambda t, m: torch.masked_select(t, m), "aten.masked_select.default"),
    "unique": (lambda t, m: torch.unique(t), "aten._unique2.default"),
    "unique_consecutive": (lambda t, m: torch.unique_consecutive(t), "aten.unique_consecutive.default"),
    "equal": (lambda t, m: torch.equal(t, t), "aten.equal.default"),
    "bincount": (lambda t, m: torch.bincount(m.long()), "aten.bincount.default"),
    "repeat_interleave": (lambda t, m: torch.repeat_interleave(m.long()), "aten.repeat_interleave.Tensor"),
}


@pytest.mark.parametrize("kind", sorted(_SYNCS))
def test_count_syncs_catches_each_kind(kind):
    code, name = _SYNCS[kind]
    t = torch.randn(16)
    with count_syncs() as c:
        code(t, t > 0)
    assert c.total == 1 and c.calls == [name], c.calls


def test_count_syncs_ignores_sync_free_ops_and_restores_tensor():
    item = torch.Tensor.item
    t = torch.randn(1000)
    with count_syncs() as c:
        torch.topk(t.abs(), 10, sorted=False)
        torch.nonzero_static(t > 0, size=10)
        torch.where(t > 0, t, 0.0).cumsum(0).index_select(0, torch.arange(5))
        t[torch.arange(3)] = 1.0                       # integer indexing: no sync
        torch.repeat_interleave(torch.ones(3, dtype=torch.long), output_size=3)
    assert c.total == 0, c.calls
    assert torch.Tensor.item is item and "item" not in torch.Tensor.__dict__   # unpatched on exit
    with count_syncs() as c:
        topk_select(torch.randn(200_000), 2_000, "exact")   # reads counts back: fine on CPU, syncs on CUDA
    assert "aten.nonzero.default" in c.calls and any(n.startswith("Tensor.__") for n in c.calls), c.calls


# ------------------------------------------------------------------------------- sync-free selection
@pytest.fixture
def sync_free_small(monkeypatch):
    """Run the sync-free algorithms on test-sized tensors (by default they start at 2M entries)."""
    import lightning_topk.comm.sync_free as sf

    monkeypatch.setattr(sf, "_SYNC_FREE_MIN_NUMEL", 1)
    return sf


def _gradient_like(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(dtype)


def _mass(v, x, k):
    return float((v.double() ** 2).sum() / (torch.topk(x.double().abs(), k).values ** 2).sum())


def _check_pairs(x, k, v, i):
    assert i.dtype == torch.long and i.shape == (k,) and v.shape == (k,) and v.dtype == x.dtype
    assert i.unique().numel() == k
    assert torch.equal(v, x[i])


@pytest.mark.parametrize("method", ["exact", "mstopk", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(200_000, 2_000), (200_001, 20), (60_000, 30_000), (1, 1), (5, 0)])
def test_sync_free_makes_no_host_syncs(sync_free_small, method, dtype, n, k):
    x = _gradient_like(n, n + k, dtype)
    with count_syncs() as c:
        v, i = sync_free_small.topk_select_sync_free(x, k, method)
    assert c.total == 0, c.calls
    _check_pairs(x, k, v, i)


def test_sync_free_default_sizes_make_no_host_syncs():
    """At the default switch-over (2M entries) and above, without the fixture."""
    x = _gradient_like(2_200_000, 9)
    for method in ("exact", "mstopk"):
        with count_syncs() as c:
            v, i = topk_select_sync_free(x, 2_200, method)
        assert c.total == 0, c.calls
        _check_pairs(x, 2_200, v, i)
        assert _mass(v, x, 2_200) >= (1.0 if method == "exact" else 0.999) - 1e-12
    assert set(topk_select_sync_free(x, 2_200, "exact")[1].tolist()) == _ref_set(x, 2_200)


@pytest.mark.parametrize("n,k", [(200_000, 2_000), (200_000, 1), (300_001, 299_999), (100_000, 45_000)])
def test_sync_free_exact_is_torch_topk(sync_free_small, n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(k)) * torch.rand(n, generator=torch.Generator().manual_seed(n))
    v, i = sync_free_small.topk_select_sync_free(x, k, "exact")
    assert set(i.tolist()) == _ref_set(x, k)
    _check_pairs(x, k, v, i)


def test_sync_free_exact_with_ties_takes_the_first_by_position(sync_free_small):
    x = torch.zeros(100_000)
    x[[5, 70_000]] = -3.0                              # above the k-th magnitude
    x[[9, 10, 40_000, 99_999]] = 1.5                   # ties at the k-th magnitude
    v, i = sync_free_small.topk_select_sync_free(x, 4, "exact")
    assert i.tolist() == [5, 70_000, 9, 10]            # above T in index order, then ties in index order
    xb = _gradient_like(300_000, 4, torch.bfloat16)    # bf16: ties everywhere
    v, i = sync_free_small.topk_select_sync_free(xb, 3_000, "exact")
    ref = torch.topk(xb.float().abs(), 3_000).values
    assert torch.equal(torch.sort(v.float().abs(), descending=True).values, ref)


def test_sync_free_mstopk_follows_its_rule(sync_free_small):
    """Every entry in grid cells above the k-th magnitude's cell (top 15 bits of the fp32 pattern), then
    the first entries of that cell by position: checked by brute force. torch.topk would differ."""
    x = _gradient_like(400_000, 5)
    k = 4_000
    cells = (x.abs().view(torch.int32) >> 16).tolist()
    kth = sorted(cells, reverse=True)[k - 1]
    above = [j for j, c in enumerate(cells) if c > kth]
    band = [j for j, c in enumerate(cells) if c == kth]
    v, i = sync_free_small.topk_select_sync_free(x, k, "mstopk")
    assert i.tolist() == above + band[: k - len(above)]
    assert set(i.tolist()) != _ref_set(x, k)           # an approximation, not the exact top-k


@pytest.mark.parametrize("rho", [0.01, 0.001])
def test_sync_free_mstopk_captures_the_mass_of_exact(sync_free_small, rho):
    n = 1_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(int(1 / rho)))
    k = int(rho * n)
    v, i = sync_free_small.topk_select_sync_free(x, k, "mstopk")
    _check_pairs(x, k, v, i)
    assert _mass(v, x, k) >= 0.99
    ve, _ = sync_free_small.topk_select_sync_free(x, k, "exact")
    assert _mass(ve, x, k) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("method", ["exact", "mstopk"])
def test_sync_free_nonfinite_rank_first(sync_free_small, method):
    x = _gradient_like(100_000, 6)
    x[[11, 500, 77_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    v, i = sync_free_small.topk_select_sync_free(x, 10, method)
    assert {11, 500, 77_000} <= set(i.tolist())
    x[::1000] = float("nan")                            # more non-finite entries than k
    v, i = sync_free_small.topk_select_sync_free(x, 10, method)
    assert not torch.isfinite(v).any() and i.unique().numel() == 10


@pytest.mark.parametrize("method", ["exact", "mstopk"])
def test_sync_free_mostly_zeros(sync_free_small, method):
    x = torch.zeros(100_000)
    x[[3, 60_000]] = torch.tensor([1e-30, -2.0])        # fewer non-zeros than k
    v, i = sync_free_small.topk_select_sync_free(x, 5, method)
    assert i.tolist() == [3, 60_000, 0, 1, 2]


@pytest.mark.parametrize("method", ["exact", "mstopk"])
def test_sync_free_kernel_path_through_references(sync_free_small, monkeypatch, method):
    """The CUDA code path (two multi-threshold counts, compact.cu's rule), run through the kernels' torch
    references: same result as the histogram path, and still no host read."""
    x = _gradient_like(300_000, 7)
    x[42] = float("nan")
    want = sync_free_small.topk_select_sync_free(x, 3_000, method)
    import lightning_topk.comm.selection as sel

    monkeypatch.setattr(sel, "KERNEL_PATH", "always")  # the switch of both paths
    with count_syncs() as c:
        got = sync_free_small.topk_select_sync_free(x, 3_000, method)
    assert c.total == 0, c.calls
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].nan_to_num(), want[0].nan_to_num())


def test_sync_free_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="unknown method"):
        topk_select_sync_free(torch.randn(10), 3, "fastest")
    with pytest.raises(ValueError, match="larger than the number of entries"):
        topk_select_sync_free(torch.randn(10), 11)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["exact", "mstopk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sync_free_never_synchronises(method, dtype):
    """CUDA's own sync detector raises on any device-to-host synchronisation."""
    x = _gradient_like(3_000_000, 8, dtype).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        v, i = topk_select_sync_free(x, 30_000, method)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_v, ref_i = topk_select_sync_free(x.cpu(), 30_000, method)
    if method == "exact":
        assert torch.equal(torch.sort(v.abs().float().cpu()).values, torch.sort(ref_v.abs().float()).values)
    else:   # same rule on both devices: same indices in the same order
        assert torch.equal(i.cpu(), ref_i)
