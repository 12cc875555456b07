import pytest
import torch

from lightning_topk import topk_select


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
