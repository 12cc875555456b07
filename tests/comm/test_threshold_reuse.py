"""Selection threshold reuse between steps (issue 22): a ThresholdHint changes how fast ``topk_select``'s
exact selector runs, never what it returns."""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState, topk_allgather_hook, topk_select
from lightning_topk.comm import selection as sel
from lightning_topk.comm.exchanges.scatter import scatter_topk_hook
from lightning_topk.comm.selection import ThresholdHint
from tests.comm import test_contract as contract
from tests.helpers.dist import run_distributed


def _input(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if kind == "ties":            # few distinct magnitudes, both signs
        x = torch.randint(-4, 5, (n,), generator=g).float()
    elif kind == "ties_at_kth":   # continuous, but a block of equal magnitudes straddles the k-th
        top = torch.topk(x.abs(), n // 50).values[-1]
        x[torch.randint(0, n, (n // 200,), generator=g)] = float(top) * torch.where(
            torch.rand(n // 200, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "zeros":         # fewer non-zeros than k: the k-th magnitude is 0
        x = torch.zeros(n)
        x[torch.randint(0, n, (n // 400,), generator=g)] = torch.randn(n // 400, generator=g)
    elif kind == "all_equal":
        x = torch.full((n,), -0.5)
    elif kind == "half":
        x = x.half()
    return x


def _key(v):
    return sel._key_of(float(v))


def _hints(x, k):
    """Hints of every kind: none yet, exact, a little off both ways, far too high and too low, garbage, a
    stale one from another input, and odd slacks."""
    a = x.float().abs()
    kth = float(torch.topk(a, k).values[-1])
    amax = float(a.max())
    out = []
    for key, slack in [(None, sel._SLACK_START), (_key(kth), sel._SLACK_START), (_key(kth), 0),
                       (_key(kth) + 1, 0), (_key(kth) - 1, 0), (_key(kth * 1.01), 1 << 10),
                       (_key(kth * 0.8), sel._SLACK_START), (_key(amax) + 5, 0), (_key(amax * 4), 1 << 20),
                       (0, 0), (-12345, 7), (sel._KEY_INF, 0), (sel._KEY_INF + 99, -3), (2 ** 31 - 1, 2 ** 40),
                       (_key(0.123), sel._SLACK_START), (_key(kth), -(1 << 20))]:
        h = ThresholdHint()
        h.key, h.slack = key, slack
        out.append(h)
    return out


@pytest.mark.parametrize("kind", ["gradient", "ties", "ties_at_kth", "zeros", "all_equal", "half"])
@pytest.mark.parametrize("n,k", [(100_003, 1), (100_003, 97), (100_003, 2_000), (100_003, 20_000), (65_537, 1_024)])
def test_any_hint_gives_the_selection_without_one(kind, n, k):
    x = _input(kind, n, n + k)
    v0, i0 = topk_select(x, k, "exact")
    a = x.float().abs()
    kth = torch.topk(a, k).values[-1]
    # The rule without a hint: every entry above the k-th magnitude, then the first tied ones by position.
    assert i0.numel() == k and torch.equal(v0, x[i0])
    above = torch.nonzero(a > kth).squeeze(1)
    tied = torch.nonzero(a == kth).squeeze(1)[: k - above.numel()]
    assert torch.equal(torch.sort(i0).values, torch.sort(torch.cat([above, tied])).values)
    for h in _hints(x, k):
        before = (h.key, h.slack)
        for _ in range(2):    # the hint as given, then as the first call left it
            v, i = topk_select(x, k, "exact", h)
            assert torch.equal(i, i0), (kind, before)
            assert torch.equal(v, v0), (kind, before)


def test_a_hint_near_the_kth_magnitude_is_used_and_a_bad_one_is_not():
    x = _input("gradient", 200_000, 3)
    k = 2_000
    kth = float(torch.topk(x.abs(), k).values[-1])
    good, low, high = ThresholdHint(), ThresholdHint(), ThresholdHint()
    good.key, low.key, high.key = _key(kth), _key(kth * 0.1), _key(kth * 1.5)
    for h in (good, low, high):
        topk_select(x, k, "exact", h)
    assert (good.hits, good.misses) == (1, 0)
    assert (low.hits, low.misses) == (0, 1)    # far too many candidates
    assert (high.hits, high.misses) == (0, 1)  # too few candidates
    assert high.slack == 2 * sel._SLACK_START
    for h in (good, low, high):               # each one now holds the k-th magnitude's key
        assert h.key == _key(kth)


@pytest.mark.parametrize("rho", [0.01, 0.001])
def test_drifting_input_hits_every_step_after_the_first(rho):
    """x <- 0.9 x + noise (each entry keeps its scale, as a residual does): the k-th magnitude moves little."""
    g = torch.Generator().manual_seed(7)
    n = 400_000
    k = int(rho * n)
    scale = torch.exp(torch.randn(n, generator=g))
    x = torch.randn(n, generator=g) * scale
    h = ThresholdHint()
    for _ in range(8):
        v, i = topk_select(x, k, "exact", h)
        v0, i0 = topk_select(x, k, "exact")
        assert torch.equal(i, i0) and torch.equal(v, v0)
        assert set(i.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())
        x.mul_(0.9).add_(torch.randn(n, generator=g) * scale, alpha=0.19 ** 0.5)
    assert (h.hits, h.misses) == (7, 0)


def test_other_methods_and_the_switch_leave_the_hint_alone(monkeypatch):
    x = _input("gradient", 200_000, 5)
    h = ThresholdHint()
    for m in ("mstopk", "torch"):
        topk_select(x, 2_000, m, h)
    assert h.key is None and h.hits == h.misses == 0
    monkeypatch.setattr(sel, "THRESHOLD_REUSE", False)
    topk_select(x, 2_000, "exact", h)
    assert h.key is None
    monkeypatch.setattr(sel, "THRESHOLD_REUSE", True)
    topk_select(x, 2_000, "exact", h)
    assert h.key is not None


def test_nonfinite_input_takes_the_torch_path_with_or_without_a_hint():
    x = _input("gradient", 100_000, 9)
    k = 500
    h = ThresholdHint()
    topk_select(x, k, "exact", h)
    x[[5, 77_777]] = torch.tensor([float("nan"), float("-inf")])
    v, i = topk_select(x, k, "exact", h)
    v0, i0 = topk_select(x, k, "exact")
    assert torch.equal(i, i0) and {5, 77_777} <= set(i.tolist())
    assert torch.equal(i, sel._torch_topk(x, k)[1])   # non-finite entries are candidates at any threshold


# ---------------------------------------------------------------- the exchanges on 2 gloo processes
def _model():
    torch.manual_seed(0)
    # Weights of 65,536 entries: above topk_select's small-tensor cut, so the hints are used.
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 10))


def _run(rank, cfg, hook, reuse, steps=6):
    sel.THRESHOLD_REUSE = reuse
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.3)
    state = TopKState(TopKConfig(**cfg))
    state.bind(m.named_parameters())
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    hits = {"/".join(key): (h.hits, h.misses) for key, h in state.select_hints.items()}
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, hits


def _with_and_without(rank, world):
    sparse = dict(density=0.01, min_sparse_numel=1000, exchange="allgather")
    cases = {
        "bucket": (sparse, topk_allgather_hook),
        "parameter": (dict(sparse, selection_scope="parameter"), topk_allgather_hook),
        "scatter": (dict(sparse, exchange="scatter"), scatter_topk_hook),
    }
    return {name: (_run(rank, cfg, hook, True), _run(rank, cfg, hook, False)) for name, (cfg, hook) in cases.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_with_and_without, 2)


@pytest.mark.parametrize("case", ["bucket", "parameter", "scatter"])
def test_gloo_training_is_bit_identical_with_and_without_reuse(runs, case):
    for res in runs:
        (params, hits), (params_off, hits_off) = res[case]
        assert params.keys() == params_off.keys()
        for name in params:
            assert torch.equal(params[name], params_off[name]), (case, name)
        # The hints were used: after the first step most selections took the one pass.
        assert sum(h for h, _ in hits.values()) >= 4, hits
        assert all(h == 0 for h, _ in hits_off.values()), hits_off
    if case == "scatter":
        assert any(key.startswith("owner/") for key in runs[0][case][0][1])
    if case == "parameter":
        assert any(key.endswith("/#0") for key in runs[0][case][0][1])


# ------------------------------------- every sparse exchange: skip, resume, with and without reuse
def _contract_runs(rank, world):
    """tests/comm/test_contract.py's run (4 steps with one skipped, a state-dict round trip into a fresh
    state, 4 more, against 8 steps in one state) for every sparse exchange on 2 nodes x 2, with threshold
    reuse on and off. Its buckets are small: the small-tensor cut is lowered so that they take the CPU
    path with hints (the same cut in both arms)."""
    from lightning_topk.comm.exchanges import registry
    from lightning_topk.comm.exchanges.hierarchical import make_groups
    sel._SMALL_NUMEL = 1024
    hits = [0]
    hinted = sel._hinted_candidates

    def counted(x, k, hint):
        cand = hinted(x, k, hint)
        hits[0] += cand is not None
        return cand

    sel._hinted_candidates = counted
    groups = make_groups(contract.N, contract.L, rank)
    out = {}
    for name in registry.names():
        if not registry.get(name).sparse or registry.get(name).local_sgd:
            continue
        res = {}
        for reuse in (True, False):
            sel.THRESHOLD_REUSE = reuse
            hits[0] = 0
            res[reuse] = (contract._run(rank, name, groups), hits[0])
        out[name] = res
    return out


@pytest.fixture(scope="module")
def contract_runs():
    return run_distributed(_contract_runs, contract.WORLD)


@pytest.mark.parametrize("name", ["allgather", "scatter", "hierarchical", "hierarchical_scatter"])
def test_skip_and_resume_are_bit_exact_with_reuse_and_match_runs_without(contract_runs, name):
    for res in contract_runs:
        (on, hits_on), (off, hits_off) = res[name][True], res[name][False]
        assert hits_on > 0 and hits_off == 0, (name, hits_on, hits_off)
        for mode in ("straight", "resumed"):   # resumed: the fresh state starts with no hints
            for key in ("params", "mass"):
                a, b = on[mode][key], off[mode][key]
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) for k in a), (name, mode, key)
        for key in ("params", "mass"):
            a, b = on["straight"][key], on["resumed"][key]
            assert all(torch.equal(a[k], b[k]) for k in a), (name, key)
        skipped = on["straight"]["steps"][contract.SKIP]
        assert skipped["skipped"] and all(torch.equal(skipped["after"][k], skipped["before"][k]) for k in skipped["before"])


def test_mostly_zero_input_is_not_recounted_at_the_same_threshold(monkeypatch):
    """A bucket of a layer without gradient: the k-th magnitude is 0, every threshold the sample offers is 0.
    One count at it is enough; then the torch.topk fallback's k-th key is used as is (one more pass)."""
    x = torch.zeros(300_000)
    x[torch.arange(0, 300_000, 3_000)] = torch.arange(1, 101).float()
    passes = []
    mask_ge = sel._mask_ge
    monkeypatch.setattr(sel, "_mask_ge", lambda x, key: passes.append(key) or mask_ge(x, key))
    v, i = topk_select(x, 3_000, "exact")
    assert len(passes) == 2 and passes == [0, 0]
    assert torch.equal(i[:100], torch.arange(0, 300_000, 3_000))   # the non-zeros
    assert torch.equal(i[100:], torch.nonzero(x == 0).squeeze(1)[:2_900])            # then the first zeros
