"""mode="auto" (issue 42): the decision function by link rate, its purity, and the options' checks."""
import pytest
import torch

from lightning_topk.comm.config import MODE_OPTIONS, TopKConfig
from lightning_topk.comm.cost import CONSTANTS, constant_model
from lightning_topk.comm.exchanges.auto import candidates_for
from lightning_topk.comm.mode import LOCAL_CANDIDATES, LOCAL_MAX_GBPS, MODE_PENALTY, choose_mode, estimate_compute
from lightning_topk.comm.wire import packed_nbytes
from lightning_topk.lightning.mode import decide, resolve

CLUSTER_NUMEL = 11_326_410  # the namespace cluster's model (benchmarks/cluster_worker.py --hidden 2560)


def _choose(gbps, nodes=4, local=1, numel=CLUSTER_NUMEL, device="cpu", allowed=("per_step", "local")):
    cfg = TopKConfig()
    model = constant_model(nodes, local, device, gbps)
    return choose_mode(model, numel, estimate_compute(numel, CONSTANTS[device]["pass_per_elem"]), density=cfg.density,
                       candidates=candidates_for(cfg, nodes, local, nodes > 1 and local > 1),
                       value_bytes=packed_nbytes(1, cfg.wire_dtype) - 4, sparse_penalty=cfg.sparse_penalty,
                       min_sparse_numel=cfg.min_sparse_numel, allowed=allowed)


# The measured crossover (4 nodes x 1, the 11.3M-parameter cluster model, time to 80% on MNIST-5k; BENCHMARKS.md
# "Sparse local SGD", docs/local_sgd.md "When to use which mode"): at 10 Mbit/s topk_local_wan first (6.9-8.1 s; the
# per-step exchange never reached the target), at 100 Mbit/s topk_local first (8.7 s against per-step's 10.1 s,
# cluster_local_2026-11-27_100mbit_rounds.md), at 1 Gbit/s and above the per-step exchange (first to the target
# among the per-step modes, cluster_defaults_2026-11-27.md; local SGD not measured there).
@pytest.mark.parametrize("gbps,expected", [(0.01, "topk_local_wan"), (0.1, "topk_local"), (1.0, "per_step"),
                                           (10.0, "per_step")])
def test_choice_by_link_rate_matches_the_measured_crossover(gbps, expected):
    c = _choose(gbps)
    assert (c.preset or c.mode) == expected, c.describe()
    if expected != "per_step":
        assert c.mode == "local" and c.options == LOCAL_CANDIDATES[expected]
    assert set(c.scores) == {"per_step", *LOCAL_CANDIDATES}
    assert c.inputs["link_gbps"] == pytest.approx(gbps)


def test_small_models_and_fast_links_stay_per_step():
    # what the existing tests run: small models, the constants model at its default 10 Gbit/s
    for nodes, local in ((2, 1), (2, 2), (4, 1), (3, 1)):
        for numel in (1_000, 100_000, 5_000_000):
            assert _choose(10.0, nodes, local, numel).mode == "per_step"
    assert TopKConfig().auto_link_gbps >= LOCAL_MAX_GBPS


def test_pure_function_and_penalties_cited():
    assert _choose(0.1) == _choose(0.1)
    assert MODE_PENALTY["per_step"] == 1.0
    assert MODE_PENALTY["topk_local"] == pytest.approx(32 / 24)
    assert MODE_PENALTY["topk_local_wan"] == pytest.approx(56 / 24)
    # a penalty large enough makes local SGD lose where it won
    c = choose_mode(constant_model(4, 1, "cpu", 0.1), CLUSTER_NUMEL, 0.113, density=0.01,
                    candidates=["dense", "allgather", "scatter"], value_bytes=2, sparse_penalty=1.09,
                    penalties={"topk_local": 10.0, "topk_local_wan": 10.0})
    assert c.mode == "per_step"


def test_local_only_picks_settings_at_any_rate():
    assert _choose(10.0, allowed=("local",)).mode == "local"
    assert _choose(0.01, allowed=("local",)).preset == "topk_local_wan"


def test_local_candidates_are_the_registered_presets():
    from lightning_topk.lightning.registry import PRESETS

    for name, opts in LOCAL_CANDIDATES.items():
        assert {k: PRESETS[name][k] for k in opts} == opts


def test_bad_mode_names_the_option_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"mode must be one of \['auto', 'per_step', 'local'\], got 'fast'"):
        TopKConfig(mode="fast")
    with pytest.raises(ValueError, match="mode='per_step' contradicts local_steps=4"):
        TopKConfig(mode="per_step", local_steps=4)
    with pytest.raises(ValueError, match="mode='local' runs sparse local SGD"):
        TopKConfig(mode="local", exchange="scatter")


def test_mode_options_are_options_and_count_when_changed():
    assert set(MODE_OPTIONS) <= set(TopKConfig.option_names())
    assert TopKConfig().mode_options_set() == ()
    assert TopKConfig(density=0.01).mode_options_set() == ()  # the default value does not count
    assert TopKConfig(density=0.05, outer_value_bits=8).mode_options_set() == ("density", "outer_value_bits")


CPU = torch.device("cpu")


def _no_timing(device):
    raise AssertionError("the constants model times nothing")


@pytest.mark.parametrize("kw,mode,why", [
    (dict(local_steps=16, outer_density=0.1, outer_value_bits=4), "local", "mode options set (local_steps"),  # topk_local
    (dict(density=0.05), "per_step", "mode options set (density)"),
    (dict(exchange="allgather"), "per_step", "mode options set (exchange)"),
    (dict(mode="per_step"), "per_step", "mode='per_step'"),
    (dict(mode="local", local_steps=8), "local", "mode='local', local_steps=8"),
])
def test_an_explicit_option_wins(kw, mode, why):
    cfg = TopKConfig(auto_model="constants", auto_link_gbps=0.01, **kw)
    c = decide(cfg, 4, 1, CLUSTER_NUMEL, CPU, measure_fn=_no_timing, loopback=False)
    assert c.mode == mode and why in c.reason and not c.inputs and c.preset is None
    assert resolve(cfg, c) is cfg and mode in c.describe()


def test_one_node_loopback_and_default_rate_stay_per_step():
    cfg = TopKConfig(auto_model="constants")
    assert "one node" in decide(cfg, 1, 2, CLUSTER_NUMEL, CPU, measure_fn=_no_timing).reason
    slow = TopKConfig(auto_model="constants", auto_link_gbps=0.01)
    assert "loopback" in decide(slow, 4, 1, CLUSTER_NUMEL, CPU, measure_fn=_no_timing, loopback=True).reason
    assert decide(cfg, 4, 1, CLUSTER_NUMEL, CPU, measure_fn=_no_timing, loopback=False).mode == "per_step"
    assert decide(slow, 4, 1, 0, CPU, measure_fn=_no_timing, loopback=False).mode == "per_step"


def test_constants_decide_without_timing_and_resolve_keeps_what_the_user_set():
    cfg = TopKConfig(auto_model="constants", auto_link_gbps=0.1)
    c = decide(cfg, 4, 1, CLUSTER_NUMEL, CPU, measure_fn=_no_timing, loopback=False)
    assert (c.mode, c.preset) == ("local", "topk_local") and "constants" in c.reason
    r = resolve(cfg, c)
    assert (r.local_steps, r.outer_density, r.outer_value_bits, r.mode) == (16, 0.1, 4, "auto")
    # mode="local": the link picks the settings, the ones set stay
    mine = TopKConfig(auto_model="constants", auto_link_gbps=0.01, mode="local", outer_value_bits=8)
    c = decide(mine, 4, 1, CLUSTER_NUMEL, CPU, measure_fn=_no_timing, loopback=True)
    r = resolve(mine, c)
    assert c.preset == "topk_local_wan" and (r.local_steps, r.outer_density, r.outer_value_bits) == (64, 0.02, 8)


def test_a_given_step_time_replaces_the_estimate():
    """``auto_step_ms``: the frontier LM (7.2M parameters) at 2 x 2 on 10 Mbit/s. Its compute estimated from the
    parameter count (~0.1 s) makes the link the bottleneck (local SGD); at this CPU's real ~2 s step the per-step
    exchange's bytes hide behind the compute and its lower penalty wins. Bad values name the option."""
    numel = 7_221_504
    slow = dict(auto_model="constants", auto_link_gbps=0.01)
    est = decide(TopKConfig(**slow), 2, 2, numel, CPU, measure_fn=_no_timing, loopback=False)
    given = decide(TopKConfig(**slow, auto_step_ms=2000), 2, 2, numel, CPU, measure_fn=_no_timing, loopback=False)
    assert est.mode == "local" and given.mode == "per_step", (est.reason, given.reason)
    assert "auto_step_ms=2000" in given.reason and "auto_step_ms" not in est.reason
    assert "auto_step_ms" not in MODE_OPTIONS  # an input of the decision, not a choice of mode
    for bad in (0, -1.0, "fast", float("nan"), True):
        with pytest.raises(ValueError, match=r"auto_step_ms must be null .* or a number > 0"):
            TopKConfig(auto_step_ms=bad)


def test_the_recipes_warm_up_is_summed_step_by_step():
    from lightning_topk.comm.mode import buckets_of, per_step_seconds, warmup_seconds
    from lightning_topk.comm.schedule import DensitySchedule

    model, sizes = constant_model(2, 2, "cpu", 0.1), buckets_of(CLUSTER_NUMEL)
    kw = dict(candidates=["dense", "allgather", "hierarchical"], value_bytes=2, sparse_penalty=1.09)
    cost = lambda d: per_step_seconds(model, sizes, d, **kw)
    sched = DensitySchedule(0.01, dense_steps=3, warmup_steps=5)
    by_hand = sum(cost(sched.density_at(t)) - cost(0.01) for t in range(8))
    assert warmup_seconds(model, sizes, 0.01, **kw, dense_steps=3, warmup_steps=5) == pytest.approx(by_hand)
    assert by_hand > 3 * (cost(1.0) - cost(0.01)) > 0  # the dense steps, and the warm-up's denser steps on top
    assert warmup_seconds(model, sizes, 0.01, **kw, dense_steps=0, warmup_steps=0) == 0.0


def test_a_fixed_cost_is_spread_over_the_horizon():
    model = constant_model(2, 2, "cpu", 0.1)
    kw = dict(density=0.01, candidates=["dense", "allgather", "hierarchical"], value_bytes=2, sparse_penalty=1.09)
    plain = choose_mode(model, CLUSTER_NUMEL, 0.1, **kw)
    spread = choose_mode(model, CLUSTER_NUMEL, 0.1, **kw, per_step_fixed_s=12.0, horizon=120)
    assert spread.scores["per_step"] == pytest.approx(plain.scores["per_step"] + 0.1)
    assert spread.scores["topk_local"] == plain.scores["topk_local"]
    assert choose_mode(model, CLUSTER_NUMEL, 0.1, **kw, per_step_fixed_s=12.0).scores == plain.scores  # no horizon


def test_adamw_chooses_with_its_own_penalties_and_the_recipes_warm_up():
    """The frontier LM's 2 x 2 cell at 1 Gbit/s (link 0.994 Gbit/s and 71.9 ms compute, as measured there): SGD's
    penalties keep per step (as the defaults chose there, 1.15x the first entry's time); AdamW's (measured on that
    LM: topk_local no slower than per step in steps) choose topk_local, which was first there; the recipe's 20 dense
    steps and warm-up over a 120-step run weigh on per step. The figures, not a timing, decide: the same every call."""
    from lightning_topk.comm.mode import ADAM_MODE_PENALTY
    from lightning_topk.lightning.mode import Figures, choose

    assert ADAM_MODE_PENALTY == {"per_step": 1.0, "topk_local": 1.0, "topk_local_wan": MODE_PENALTY["topk_local_wan"]}
    figures = Figures(0.994, CONSTANTS["cpu"]["pass_per_elem"], 0.0719, "as measured")
    p = [torch.nn.Parameter(torch.zeros(3))]
    adamw, sgd = [torch.optim.AdamW(p, lr=2e-3, weight_decay=0.01)], [torch.optim.SGD(p, lr=0.1, momentum=0.9)]
    numel, cfg = 7_221_504, TopKConfig()
    assert choose(cfg, 2, 2, numel, "cpu", figures).mode == "per_step"
    assert choose(cfg, 2, 2, numel, "cpu", figures, sgd, True, 120).mode == "per_step"
    long_run = choose(cfg, 2, 2, numel, "cpu", figures, adamw, True)
    run = choose(cfg, 2, 2, numel, "cpu", figures, adamw, True, 120)
    assert (run.mode, run.preset) == ("local", "topk_local") and long_run.mode == "local"
    assert run.scores["per_step"] > long_run.scores["per_step"]  # the warm-up's seconds over 120 steps
    assert "AdamW's penalties" in run.reason and "over 120 steps (max_steps)" in run.reason
    assert run == choose(cfg, 2, 2, numel, "cpu", figures, adamw, True, 120)
    # the recipe's cost counts only where the per-step mode runs it (topk_fsdp, torchft, recipe="none": not)
    no_recipe = choose(cfg, 2, 2, numel, "cpu", figures, adamw, False, 120)
    assert no_recipe.scores["per_step"] == pytest.approx(long_run.scores["per_step"])
    assert choose(TopKConfig(recipe="none"), 2, 2, numel, "cpu", figures, adamw, True, 120).scores == no_recipe.scores
    # the same cell measured a hair above 1 Gbit/s (1.002, as the defaults' run there did): SGD's bound (1 Gbit/s,
    # local SGD not measured there) keeps per step; AdamW's sits a tie margin above the 1 Gbit/s it was measured at
    nominal = Figures(1.002, CONSTANTS["cpu"]["pass_per_elem"], 0.145, "as measured")
    assert choose(cfg, 2, 2, numel, "cpu", nominal, adamw, True, 120).preset == "topk_local"
    assert choose(cfg, 2, 2, numel, "cpu", nominal, sgd, True, 120).mode == "per_step"
    # well above it local SGD is no candidate, whatever the optimizer (not measured there)
    fast = Figures(2.0, CONSTANTS["cpu"]["pass_per_elem"], 0.0719, "as measured")
    run_fast = choose(cfg, 2, 2, numel, "cpu", fast, adamw, True, 120)
    assert run_fast.mode == "per_step" and "below 1.15 Gbit/s only" in run_fast.reason
