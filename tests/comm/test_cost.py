"""The alpha-beta cost model, the probe, the dense transports and exchange="auto" (real gloo processes)."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState
from lightning_topk.comm import cost
from lightning_topk.comm.cost import SPARSE_PENALTY, CostModel, Link, sparse_penalty
from lightning_topk.comm.exchanges import Layout
from lightning_topk.comm.exchanges.allgather import topk_allgather_hook
from lightning_topk.comm.exchanges.auto import (
    REFRESH_STEPS,
    AutoExchange,
    auto_topk_hook,
    build_auto,
    candidates_for,
    saved_model,
)
from lightning_topk.comm.exchanges.dense import dense_topk_hook
from lightning_topk.comm.exchanges.scatter import slot_plan
from lightning_topk.comm.wire import sparse_nbytes
from tests.helpers.dist import run_distributed
from tests.helpers.exchanges import make_auto, plan

GROUPS = SimpleNamespace(intra=None, inter=None)  # stands for a hierarchical layout's groups (no probe here)


def _model(nodes, local, beta_inter=12.5e6, beta_intra=10e9, select_per_elem=2e-9):
    return CostModel(nodes, local, Link(5e-6, beta_intra) if local > 1 else None,
                     Link(50e-6, beta_inter) if nodes > 1 else None, select_per_elem, 1e-4, 0.5e-9, 20e-9)


def test_link_fit_recovers_alpha_and_beta():
    true = Link(30e-6, 1.25e8)
    sizes = (1024, 1 << 20)
    times = tuple(true.allreduce(s, 4) for s in sizes)
    got = Link.fit(times, sizes, 4)
    assert math.isclose(got.alpha, true.alpha, rel_tol=1e-6) and math.isclose(got.beta, true.beta, rel_tol=1e-6)


def test_scatter_link_time_does_not_grow_with_ranks_but_allgather_does():
    n, k = 25_600_000, 256_000  # ResNet-50 at density 0.01
    m = {p: _model(p, 1, beta_inter=1.25e9) for p in (4, 16, 64, 256)}
    for x in m.values():
        x.inter.alpha = 0.0  # bandwidth terms only: latency grows with P for every ring
    sc = [m[p].predict("scatter", n, k)[1] for p in m]
    ag = [m[p].predict("allgather", n, k)[1] for p in m]
    assert max(sc) < 1.5 * min(sc)
    assert ag[-1] > 50 * ag[0]
    # and the bytes behind it: about 2 k x 8 B x (P-1)/P, plus the slots' margin 4 sqrt(k/P)
    for p in m:
        plan = slot_plan(n, k, p)
        assert (p - 1) * (plan.slot + plan.out) * 8 <= (2 + 4 / math.sqrt(k / p)) * k * 8


def test_choice_follows_the_link():
    n, k = 4_000_000, 40_000
    slow, fast = _model(2, 1, beta_inter=12.5e6), _model(2, 1, beta_inter=50e9)
    c_slow, pred_slow = slow.choose(n, k, ["dense", "dense_bf16", "allgather", "scatter"])
    c_fast, pred_fast = fast.choose(n, k, ["dense", "dense_bf16", "allgather", "scatter"])
    assert c_slow in ("allgather", "scatter") and c_fast in ("dense", "dense_bf16")
    for pred in (pred_slow, pred_fast):  # the choice is never predicted slower than a dense all-reduce
        assert min(pred.values()) <= min(pred["dense"], pred["dense_bf16"])
    # 2 nodes x 8: hierarchical is a candidate and cuts inter-node bytes by L
    m = _model(2, 8, beta_inter=1.25e9)
    assert m.predict("hierarchical", n, k)[1] < m.predict("allgather", n, k)[1]
    assert m.predict("hierarchical", n, k) != (math.inf, math.inf)
    assert _model(2, 1).predict("hierarchical", n, k) == (math.inf, math.inf)
    with pytest.raises(ValueError, match="unknown exchange"):
        m.predict("ring", n, k)


def test_hierarchical_scatter_prediction_and_wire():
    """Intra-node part as "hierarchical"; inter-node: the scale-free exchange among N nodes on k/L entries,
    whose bytes per rank do not grow with N (the hierarchical all-gather's do)."""
    n, k, L = 25_600_000, 256_000, 8
    ks, eb = math.ceil(k / L), 8
    hier_wires = []
    for N in (2, 8, 32, 128):
        m = _model(N, L, beta_inter=1.25e9)
        plan = slot_plan(math.ceil(n / L), ks, N)
        assert m.wire("hierarchical_scatter", n, k) == (N - 1) * (plan.slot + plan.out) * eb
        w = m.wire("hierarchical_scatter", n, k)  # about 2 (k/L) b (N-1)/N, plus the slots' margin
        assert 2 * ks * eb * (N - 1) / N <= w <= (2 + 4 / math.sqrt(ks / N)) * ks * eb * (N - 1) / N + 2 * eb * N
        assert w < 2.3 * ks * eb  # whatever N is
        hier_wires.append(m.wire("hierarchical", n, k))
        intra, inter = m.intra, m.inter
        comp, comm = m.predict("hierarchical_scatter", n, k)
        want = (intra.reduce_scatter(4 * n, L) + intra.allgather(4 * n / L, L)
                + (N - 1) * (2 * inter.alpha + L * (plan.slot + plan.out) * eb / inter.beta))
        assert comm == pytest.approx(want)
        assert comp == pytest.approx(m.select(n / L) + m.select(plan.region) + 4 * m.pass_per_elem * n
                                     + m.add_per_entry * (ks + N * plan.slot + N * plan.out))
        # the intra-node tier is the same as the hierarchical exchange's
        h_comm = m.predict("hierarchical", n, k)[1]
        packet = sparse_nbytes(math.ceil(n / L), ks, 4)  # its all-gather packs indices in 16-bit blocks
        assert packet == ks * 4 + 2 * ks + 4 * math.ceil(n / L / 2**16)
        assert h_comm - (N - 1) * (inter.alpha + L * packet / inter.beta) == pytest.approx(
            intra.reduce_scatter(4 * n, L) + intra.allgather(4 * n / L, L))
    assert hier_wires[-1] > 60 * hier_wires[0]
    m = _model(128, L, beta_inter=1.25e9)
    assert m.predict("hierarchical_scatter", n, k)[1] < m.predict("hierarchical", n, k)[1]
    assert m.choose(n, k, ["hierarchical", "hierarchical_scatter"])[0] == "hierarchical_scatter"
    for nodes, local in ((1, 8), (4, 1)):
        assert _model(nodes, local).predict("hierarchical_scatter", n, k) == (math.inf, math.inf)


def test_sparse_penalty_keeps_dense_where_sparse_is_only_a_little_faster():
    """Time to accuracy, not time per exchange: a sparse exchange predicted 2x faster than dense bf16 is
    not worth the extra steps under the default penalty (the measured table's at density 0.01); at 1 it
    wins; far ahead it wins either way."""
    n, k, cands = 4_000_000, 40_000, ["dense", "dense_bf16", "allgather", "scatter"]
    penalty = TopKConfig().sparse_penalty
    assert penalty > 1
    for beta in (1e8, 1e9, 3e9, 1e10):
        m = _model(4, 1, beta_inter=beta)
        best1, pred = m.choose(n, k, cands, sparse_penalty=1.0)
        best3, _ = m.choose(n, k, cands, sparse_penalty=penalty)
        sparse = min(pred["allgather"], pred["scatter"])
        dense = min(pred["dense"], pred["dense_bf16"])
        assert (best1 in ("allgather", "scatter")) == (sparse < dense), (beta, pred)
        assert (best3 in ("allgather", "scatter")) == (penalty * sparse < dense), (beta, pred)
    # the threshold moves: some link has sparse ahead by less than the penalty (dense under the default)
    m = _model(4, 1, beta_inter=1e9)
    _, pred = m.choose(n, k, cands)
    ratio = min(pred["dense"], pred["dense_bf16"]) / min(pred["allgather"], pred["scatter"])
    assert 1 < ratio < penalty and m.choose(n, k, cands, sparse_penalty=penalty)[0] == "dense_bf16"
    with pytest.raises(ValueError, match="auto_sparse_penalty"):
        TopKConfig(auto_sparse_penalty=0.5)


def test_default_penalty_is_the_measured_table_interpolated_in_log_density():
    """auto_sparse_penalty=None: the steps-to-target ratio of SPARSE_PENALTY for the density and the recipe in
    use (momentum correction or plain error feedback); an explicit number overrides it."""
    for recipe, row in SPARSE_PENALTY.items():
        mc = recipe.startswith("momentum")
        look = 3.0 if recipe == "momentum_lookahead" else 0.0
        for d, p in row.items():
            cfg = TopKConfig(density=d, momentum_correction=mc, momentum_masking=recipe == "momentum_correction",
                             momentum_lookahead=look)
            assert cfg.recipe_in_use == recipe
            assert cfg.sparse_penalty == pytest.approx(max(1.0, p))
        lo, hi = min(row), 0.01
        mid = math.sqrt(lo * hi)  # halfway in log-density
        assert sparse_penalty(mid, recipe) == pytest.approx(0.5 * (row[lo] + row[hi]))
        assert sparse_penalty(lo / 10, recipe) == pytest.approx(row[lo])  # held outside the measured range
    assert TopKConfig(density=0.001).sparse_penalty != TopKConfig(density=0.001, momentum_correction=True).sparse_penalty
    unmasked = TopKConfig(density=0.01, momentum_correction=True, momentum_masking=False)
    assert unmasked.sparse_penalty != TopKConfig(density=0.01, momentum_correction=True).sparse_penalty
    look = TopKConfig(density=0.01, momentum_correction=True, momentum_masking=False, momentum_lookahead=3.0)
    assert look.recipe_in_use == "momentum_lookahead" and look.sparse_penalty < unmasked.sparse_penalty
    assert TopKConfig(density=1.0).sparse_penalty == 1.0
    assert TopKConfig(density=0.001, auto_sparse_penalty=1.5).sparse_penalty == 1.5
    assert TopKConfig().auto_sparse_penalty is None
    with pytest.raises(ValueError, match="recipe"):
        sparse_penalty(0.01, "dgc")


def test_auto_uses_the_table_penalty(monkeypatch):
    """With auto_sparse_penalty unset, auto's plan is CostModel.choose with the table's penalty: the same
    plan for the table's value, and a table that makes sparse hopeless (or free) moves the plan."""
    def plans(table_value=None):
        if table_value is not None:
            monkeypatch.setitem(cost.SPARSE_PENALTY, "error_feedback", {1.0: 1.0, 0.001: table_value})
        cfg = TopKConfig(density=0.001, auto_model="constants", auto_link_gbps=0.1)
        a = build_auto(None, cfg, Layout(4, 1, 0), torch.device("cpu"))
        st = TopKState(cfg)
        out = {}
        for n in (300_000, 2_000_000, 25_000_000):
            k = math.ceil(0.001 * n)
            out[n] = a.decide(st, n, k)[0]
            assert out[n] == a.model.choose(n, k, a.candidates, 4, cfg.sparse_penalty)[0]
        return out

    plans()
    assert set(plans(1000.0).values()) <= {"dense", "dense_bf16"}
    assert plans(1.0)[25_000_000] not in ("dense", "dense_bf16")


def test_candidates_follow_the_options():
    assert candidates_for(TopKConfig(), 2, 2, True) == ["dense", "dense_bf16", "allgather", "hierarchical",
                                                             "hierarchical_scatter", "scatter"]
    for off in (candidates_for(TopKConfig(hierarchical=False), 2, 2, True), candidates_for(TopKConfig(), 2, 1, True),
                candidates_for(TopKConfig(selection_scope="parameter"), 2, 2, True)):
        assert "hierarchical" not in off and "hierarchical_scatter" not in off
    assert candidates_for(TopKConfig(momentum_correction=True), 2, 2, True) == ["dense", "dense_bf16",
                                                                                    "allgather"]
    # per-parameter selection is exact on resume only with the flat all-gather
    assert "scatter" not in candidates_for(TopKConfig(selection_scope="parameter"), 4, 1, False)


def test_near_ties_take_a_fixed_order_not_the_noise():
    """The default job's probe predicted dense 1.52 ms vs dense_bf16 1.37 ms in one run and the reverse
    order in another: within TIE_MARGIN the first of TIE_ORDER wins, whichever way the noise went."""
    for bf16 in (1.37, 1.45, 1.52, 1.60):
        assert cost.tie_break({"dense": 1.52, "dense_bf16": bf16, "allgather": 9.0}) == "dense"
    assert cost.tie_break({"dense": 1.52, "dense_bf16": 1.2, "allgather": 9.0}) == "dense_bf16"  # beyond the margin
    assert cost.tie_break({"allgather": 1.0, "scatter": 1.05}) == "scatter"
    assert cost.tie_break({"allgather": 1.0, "scatter": 1.2}) == "allgather"


def test_constants_model_needs_no_timing_and_is_a_pure_function(monkeypatch):
    """Under deterministic algorithms auto_model="auto" builds the model from CONSTANTS: no probe (which
    would be a collective and a timing), the same plan every time, never refreshed."""
    def no_probe(*a, **k):
        raise AssertionError("probed")

    monkeypatch.setattr(cost, "probe", no_probe)
    cfg = TopKConfig(density=0.01)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not cost.timed_model(cfg)
        plans = []
        for _ in range(2):
            a = build_auto(None, cfg, Layout(4, 1, 0), torch.device("cpu"))
            st = TopKState(cfg)
            for n in (20_000, 1_000_000, 25_000_000):
                a.decide(st, n, math.ceil(0.01 * n))
            plans.append(dict(a.plan))
            st.step = REFRESH_STEPS
            assert not a.refresh_due(st) and not a.timed
        assert plans[0] == plans[1] and len(plans[0]) == 3
    finally:
        torch.use_deterministic_algorithms(before)
    assert cost.timed_model(cfg) == (not before)
    assert not cost.timed_model(TopKConfig(auto_model="constants")) and cost.timed_model(TopKConfig(auto_model="probe"))
    # the link constant decides: a slow link makes the large buckets sparse, a fast one keeps them dense
    slow = build_auto(None, TopKConfig(auto_model="constants", auto_link_gbps=0.1), Layout(4, 1, 0), torch.device("cpu"))
    fast = build_auto(None, TopKConfig(auto_model="constants", auto_link_gbps=100), Layout(4, 1, 0), torch.device("cpu"))
    st = TopKState(cfg)
    assert slow.decide(st, 25_000_000, 250_000)[0] in cost.SPARSE
    assert fast.decide(st, 25_000_000, 250_000)[0] in ("dense", "dense_bf16")


def test_plan_is_decided_per_bucket_size_at_the_configured_density():
    """During a density warm-up k changes every step; the plan holds one entry per bucket size (it grew by
    one entry per bucket and step before: 79 after 40 steps), decided for the final density."""
    cfg = TopKConfig(density=0.001, warmup_steps=40, warmup_start=0.25, auto_model="constants", auto_link_gbps=0.1)
    a = build_auto(None, cfg, Layout(4, 1, 0), torch.device("cpu"))
    st = TopKState(cfg)
    sizes = (2_000_000, 300_000)
    for step in range(41):
        st.step = step
        for n in sizes:
            k = math.ceil(st.density_now() * n)
            choice = a.decide(st, n, k)[0]
            assert choice == a.model.choose(n, math.ceil(0.001 * n), a.candidates, 4, cfg.sparse_penalty)[0]
    assert set(a.plan) == {str(n) for n in sizes}


def test_auto_state_round_trip_keeps_plan_and_model_only_where_they_apply():
    cfg = TopKConfig(auto_model="constants")
    a = build_auto(None, cfg, Layout(2, 2, 0), torch.device("cpu"), groups=GROUPS)
    st = TopKState(cfg)
    a.decide(st, 1_000_000, 10_000)
    a.plan["123"] = "hierarchical"
    a.model.comm_scale = 1.7
    sd = a.state_dict()
    b = build_auto(None, cfg, Layout(2, 2, 1), torch.device("cpu"), groups=GROUPS, saved=sd)
    assert b.plan == a.plan and b.model == a.model
    # the same plan where hierarchical is no candidate now: that entry is dropped, the model stays
    c = build_auto(None, TopKConfig(auto_model="constants", hierarchical=False), Layout(2, 2, 0), torch.device("cpu"),
                   groups=GROUPS, saved=sd)
    assert "123" not in c.plan and c.plan["1000000"] == a.plan["1000000"]
    # another layout or kind of model: the saved model does not apply
    assert saved_model(sd, False, 4, 1) is None and saved_model(sd, True, 2, 2) is None
    # through TopKState: a section loaded before auto exists waits for it, then goes to the auto built
    st.exchange = st.exchanges["auto"] = a
    full = st.state_dict()["exchanges"]["auto"]
    st2 = TopKState(cfg)
    st2.load_state_dict({"step": 3, "exchanges": {"auto": full}})
    assert st2.take_section("auto") == full and st2.take_section("auto") is None


@pytest.mark.parametrize("kw,msg", [(dict(auto_model="fast"), "auto_model must be one of"),
                                    (dict(auto_link_gbps=0), "auto_link_gbps must be a number > 0"),
                                    (dict(exchange="scatter", selection_scope="parameter"),
                                     "selection_scope='parameter' is not supported with exchange='scatter'")])
def test_bad_auto_options_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TopKConfig(**kw)


# ---- real processes -------------------------------------------------------------------------------
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _dense(rank, world, value_dtype):
    """The dense transport on fresh parameters (step 0), then after a sparse step left residuals (steps 2, 3):
    what each rank sent, its residuals and the result."""
    m = _net()
    ddp = DDP(m, bucket_cap_mb=0.05)
    st = TopKState(TopKConfig(density=0.01, min_sparse_numel=0, dense_steps=0, value_dtype=value_dtype))
    st.bind(m.named_parameters())
    st.debug.enabled = True
    sparse = [False]

    def hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return (topk_allgather_hook if sparse[0] else dense_topk_hook)(state, bucket)

    ddp.register_comm_hook(st, hook)
    out = []
    for step in range(4):
        sparse[0] = step == 1
        old = {k: v.clone() for k, v in st.residuals().items()}
        m.zero_grad()
        x, y = _batch(rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
        out.append(dict(old=old, new={k: v.clone() for k, v in st.residuals().items()},
                        sent={k: v.clone() for k, v in st.debug.sent.items()},
                        grad={k: v.clone() for k, v in st.debug.grads_in.items()},
                        after={n: p.grad.reshape(-1).clone() for n, p in m.named_parameters()}))
    return out, st.last


def _auto(rank, world):
    """exchange="auto" with hand-made models: a slow link picks a sparse exchange, a fast one dense; a
    probe gives every rank the same model; a refresh from (different) telemetry gives the same switch."""
    out = {}
    for label, beta in (("slow", 1e6), ("fast", 1e12)):
        m = _net()
        ddp = DDP(m, bucket_cap_mb=0.05)
        st = TopKState(TopKConfig(density=0.01, min_sparse_numel=0, dense_steps=1))
        st.bind(m.named_parameters())
        make_auto(st, _model(world, 1, beta_inter=beta), candidates_for(st.config, world, 1, False), rank)
        ddp.register_comm_hook(st, auto_topk_hook)
        for _ in range(3):
            m.zero_grad()
            x, y = _batch(rank)
            nn.functional.cross_entropy(ddp(x), y).backward()
        out[label] = (plan(st), st.last, {n: p.grad.clone() for n, p in m.named_parameters()})
    # a 40-step density warm-up through DDP: one plan entry per bucket size, not per bucket and step
    m = _net()
    ddp = DDP(m, bucket_cap_mb=0.05)
    cfg = TopKConfig(density=0.01, min_sparse_numel=0, warmup_steps=40)
    st = TopKState(cfg)
    st.bind(m.named_parameters())
    make_auto(st, _model(world, 1, beta_inter=1e6), candidates_for(cfg, world, 1, False), rank)
    sizes = set()

    def hook(state, bucket):
        sizes.add(bucket.buffer().numel())
        return auto_topk_hook(state, bucket)

    ddp.register_comm_hook(st, hook)
    for _ in range(41):
        m.zero_grad()
        x, y = _batch(rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
    out["warmup"] = (plan(st), sorted(sizes), st.totals.buckets)
    out["probe"] = cost.probe(world, 1, rank, 0.01, "exact", torch.device("cpu"))
    # refresh: each rank reports different telemetry; the slowest figures win on every rank
    a = AutoExchange(None, Layout(world, 1, rank), model=_model(world, 1, beta_inter=1e9),
                     candidates=["dense", "allgather"])
    st = TopKState(TopKConfig(density=0.01, auto_sparse_penalty=1.0))  # exchange times alone
    n, k = 200_000, 2_000
    before = a.decide(st, n, k)[0]
    predicted = a.model.predict(before, n, k)[1]
    a._window = [1e-3 * (rank + 1), 1e6, 0.5 * predicted * (rank + 1) / world, predicted]
    a.refresh(st, torch.device("cpu"))
    out["refresh"] = (before, a.plan[str(n)], a.model.comm_scale, a.model.select_per_elem)
    return out


def _scenarios(rank, world):
    return {"auto": _auto(rank, world), "fp32": _dense(rank, world, "fp32"), "bf16": _dense(rank, world, "bf16")}


@pytest.fixture(scope="module")
def runs():
    res = run_distributed(_scenarios, 2)
    return {key: [r[key] for r in res] for key in res[0]}


def test_auto_picks_sparse_on_a_slow_link_and_dense_on_a_fast_one(runs):
    for r in runs["auto"]:
        slow_plan, slow_stats, _ = r["slow"]
        fast_plan, fast_stats, _ = r["fast"]
        assert slow_plan and set(slow_plan.values()) <= {"allgather", "scatter"}
        assert fast_plan and set(fast_plan.values()) <= {"dense", "dense_bf16"}
        assert slow_stats.buckets_via("allgather", "scatter") == slow_stats.buckets
        assert slow_stats.bytes_wire < 0.2 * slow_stats.bytes_dense_wire
        assert fast_stats.buckets_via("dense", "dense_bf16") == fast_stats.buckets
        for s in (slow_stats, fast_stats):
            m = s.as_metrics()
            assert m["topk/predicted_ms"] > 0 and m["topk/measured_ms"] > 0
    a, b = runs["auto"]
    assert a["slow"][0] == b["slow"][0] and a["fast"][0] == b["fast"][0]  # same decisions on every rank
    for k in a["slow"][2]:
        assert torch.equal(a["slow"][2][k], b["slow"][2][k]) and torch.equal(a["fast"][2][k], b["fast"][2][k])


def test_plan_holds_one_entry_per_bucket_size_through_a_warmup(runs):
    a, b = (r["warmup"] for r in runs["auto"])
    plan, sizes, buckets = a
    assert len(sizes) >= 2 and buckets > 41  # several buckets per step
    assert 0 < len(plan) <= len(sizes) and set(plan) <= {str(n) for n in sizes}
    assert a[0] == b[0]


def test_probe_gives_every_rank_the_same_model(runs):
    a, b = (r["probe"] for r in runs["auto"])
    assert a == b
    assert a.inter is not None and a.inter.beta > 0 and a.inter.alpha > 0 and a.select_per_elem > 0


def test_refresh_uses_the_slowest_telemetry_and_switches_with_the_scale(runs):
    r0, r1 = (r["refresh"] for r in runs["auto"])
    assert r0 == r1
    before, after, scale, per = r0
    assert before == "allgather" and after == "dense"  # measured links 2x faster than predicted: dense wins
    assert scale == pytest.approx(0.5)
    assert per == pytest.approx(0.5 * (2e-9 + 2e-9))


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_dense_transport_conserves_and_averages(runs, kind):
    a, b = runs[kind]
    for t in (0, 2, 3):
        for name in a[0][t]["sent"]:
            want = (a[0][t]["sent"][name] + b[0][t]["sent"][name]) / 2
            tol = 1e-6 if kind == "fp32" else 1e-2 * want.abs().max().item()
            for r in (a, b):
                h = r[0][t]
                assert torch.allclose(h["after"][name], want, atol=tol), (t, name)
                if t == 0:  # fresh parameters: no residual is made, the cast costs what DDP's hooks cost
                    assert h["new"] == {} and torch.allclose(h["sent"][name], h["grad"][name], atol=tol)
                    continue
                o = h["old"].get(name, torch.zeros_like(h["grad"][name]))
                assert torch.allclose(h["sent"][name] + h["new"][name], o + h["grad"][name], atol=1e-6), (t, name)
        if t == 0:
            continue
        assert a[0][t]["old"]  # the sparse step left residuals: they are sent with the dense one
        if kind == "fp32":
            assert all(not v.any() for v in a[0][t]["new"].values())  # everything sent
        else:
            assert any(v.any() for v in a[0][t]["new"].values())  # the bf16 cast error stays behind
    last = a[1]
    assert last.buckets_via("dense", "dense_bf16") == last.buckets
    assert last.buckets_via("dense_bf16") == (last.buckets if kind == "bf16" else 0)
    assert last.bytes_wire == last.bytes_dense_wire // (2 if kind == "bf16" else 1)


def test_plan_for_explains_a_pinned_run_without_timing_or_collectives():
    """The run summary's "auto would" row: one machine sends the small model dense, a slow multi-node link
    sends it sparse, and the figures are a pure function of the arguments (same twice, no process group)."""
    from lightning_topk.comm.exchanges import Layout
    from lightning_topk.comm.exchanges.auto import plan_for, predicted_for

    small = TopKConfig(density=0.01, min_sparse_numel=4096)
    one_node = plan_for(small, Layout(1, 2), "cpu", [151_000, 1_000])
    assert {n: c for n, (c, _) in one_node.items()} == {151_000: "dense", 1_000: "dense"}
    assert one_node == plan_for(small, Layout(1, 2), "cpu", [151_000, 1_000])
    slow = TopKConfig(density=0.01, auto_link_gbps=0.1)
    far = plan_for(slow, Layout(4, 1), "cpu", [8_000_000])
    assert far[8_000_000][0] not in ("dense", "dense_bf16")
    dense_s = predicted_for(slow, Layout(4, 1), "cpu", [8_000_000], "dense")
    assert far[8_000_000][1] * slow.sparse_penalty < dense_s


# ---- the bucket rule (cost.choose_bucket_cap) ------------------------------------------------------
# The cluster benchmark's 8.5M-entry model in backward order: last Linear, middle Linear, first Linear, convs.
_MLP = [10, 10240, 1024, 2097152, 2048, 6422528, 16, 2304, 16, 2304, 16, 144]


# A model with four 1M-entry layers in front of the head: DDP's default puts three of them and the first
# Linear in one bucket, which waits for the first Linear's gradient.
_DEEP = [10, 10240] + [1024, 1 << 20] * 4 + [1024, 4194304, 4, 36]


def test_ddp_buckets_fill_to_the_cap_and_never_split_a_parameter():
    mib = 1 << 18  # entries of 1 MiB in fp32
    assert cost.ddp_buckets([mib // 2, mib // 2, 3 * mib, 10], 1) == [mib, 3 * mib, 10]
    assert cost.ddp_buckets([10, 20], 25) == [30]
    assert sum(cost.ddp_buckets(_MLP, 8)) == sum(_MLP)
    # unset: DDP's 1 MiB first bucket, then 25 MiB (the 6.4M-entry last bucket)
    assert cost.ddp_buckets(_MLP, None) == [sum(_MLP[:4]), sum(_MLP[4:])]


def test_bucket_rule_splits_a_large_last_bucket_on_a_slow_link():
    slow = cost.constant_model(2, 1, "cpu", 0.1)
    plans = [cost.choose_bucket_cap(list(_DEEP), 0.01, slow, min_sparse_numel=16384) for _ in range(2)]
    assert plans[0] == plans[1]  # deterministic
    plan = plans[0]
    assert plan.cap_mb in cost.BUCKET_CAP_LADDER_MB and plan.cap_mb < cost.DDP_DEFAULT_BUCKET_CAP_MB
    assert sum(plan.buckets) == sum(_DEEP)
    assert plan.last_bucket == 40  # the conv alone: the only exchange after the backward pass
    assert plan.scores[plan.cap_mb] <= (1 - cost.BUCKET_MIN_GAIN) * plan.scores[None]
    # DDP's default: 7.3M entries in the bucket before the conv's, ready only when the first Linear's is
    assert cost.ddp_buckets(_DEEP, None)[-2] > 7_000_000


def test_bucket_rule_keeps_ddp_default_unless_clearly_better():
    # The cluster benchmark's model: DDP's default already pipelines its two large buckets, and splitting
    # off the convs is predicted to gain less than BUCKET_MIN_GAIN (measured: it does not gain).
    for gbps in (10.0, 0.1):
        plan = cost.choose_bucket_cap(list(_MLP), 0.01, cost.constant_model(2, 1, "cpu", gbps), min_sparse_numel=16384)
        assert plan.cap_mb is None and plan.buckets == tuple(cost.ddp_buckets(_MLP, None))
    # A fast link leaves nothing to hide on the deep model either.
    fast = cost.choose_bucket_cap(list(_DEEP), 0.01, cost.constant_model(2, 1, "cpu", 10.0), min_sparse_numel=16384)
    assert fast.cap_mb is None


@pytest.mark.parametrize("kw, match", [
    (dict(numels=[]), "numels"), (dict(numels=[-1]), "numels"), (dict(density=0.0), "density"),
    (dict(ladder=(0,)), "ladder"), (dict(model=cost.constant_model(1, 1, "cpu", 1.0)), "2 ranks")])
def test_bucket_rule_rejects_bad_input(kw, match):
    args = dict(numels=[10], density=0.01, model=cost.constant_model(2, 1, "cpu", 1.0))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        cost.choose_bucket_cap(**args)


def test_probe_times_exact_selection_with_a_warm_hint_on_a_drifting_input(monkeypatch):
    """The exact selector reuses last step's threshold in training (ThresholdHint); the probe times it that way:
    every call gets the same hint, the input drifts between calls, and the timed calls take the one-pass path."""
    from lightning_topk.comm import selection

    calls = []
    real = selection.topk_select

    def spy(x, k, method="exact", hint=None):
        calls.append((hint, x.clone()))
        return real(x, k, method, hint)

    monkeypatch.setattr(cost, "topk_select", spy)
    g = torch.Generator().manual_seed(0)
    n = 1 << 18
    scale = torch.randn(n, generator=g).exp()
    x = torch.randn(n, generator=g).mul_(scale)
    t = cost._select_time(x, scale, 2621, "exact", torch.device("cpu"), g, reps=2)
    assert math.isfinite(t) and t > 0
    assert len(calls) == 3
    hints = {id(h) for h, _ in calls}
    assert len(hints) == 1 and calls[0][0] is not None
    assert not torch.equal(calls[0][1], calls[1][1]) and not torch.equal(calls[1][1], calls[2][1])
    assert calls[0][0].hits == 2 and calls[0][0].misses == 0  # both timed calls reused the threshold
    # other selectors (and reuse switched off) are timed without a hint
    calls.clear()
    cost._select_time(x, scale, 2621, "mstopk", torch.device("cpu"), g, reps=2)
    assert calls and all(h is None for h, _ in calls)
    monkeypatch.setattr(selection, "THRESHOLD_REUSE", False)
    calls.clear()
    cost._select_time(x, scale, 2621, "exact", torch.device("cpu"), g, reps=2)
    assert calls and all(h is None for h, _ in calls)


def test_a_plan_of_the_other_kind_of_model_is_made_again_on_resume():
    """A checkpoint whose plan a probed model made, resumed with auto_model="constants" (or the other way round):
    the saved plan is not kept; this run's model plans (it used to keep the probed plan, whatever the option)."""
    cfg = TopKConfig(auto_model="constants")
    a = build_auto(None, cfg, Layout(4, 1, 0), torch.device("cpu"))
    st = TopKState(cfg)
    a.decide(st, 1_000_000, 10_000)
    probed = dict(a.state_dict(), timed=True, plan={"1000000": "dense", "123": "allgather"})
    b = build_auto(None, cfg, Layout(4, 1, 0), torch.device("cpu"), saved=probed)
    assert b.plan == {}
    assert b.decide(st, 1_000_000, 10_000)[0] == a.plan["1000000"]  # re-planned by the constants model
    same = build_auto(None, cfg, Layout(4, 1, 0), torch.device("cpu"), saved=a.state_dict())
    assert same.plan == a.plan  # the same kind: kept, as before
