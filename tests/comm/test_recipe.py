"""recipe="auto": which optimizers get DGC momentum correction (with the momentum lookahead), what a sparse
step does with the velocity, and what the hook's momentum does at density 1."""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState
from lightning_topk.comm.exchanges import exchange_hook, kit
from lightning_topk.comm.recipe import apply_recipe, recipe_for
from lightning_topk.optim import LARS
from tests.helpers.dist import run_distributed
from tests.helpers.exchanges import dormant_allgather_hook


def _params():
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]


def test_apply_recipe_moves_sgd_momentum_into_the_config_at_once():
    """The static form (the convergence harness's); a Trainer runs the live one (LiveRecipe, below)."""
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.8, weight_decay=1e-4)
    cfg, note = apply_recipe(TopKConfig(density=0.001), [opt])
    assert cfg.momentum_correction and cfg.momentum == 0.8 and "-> momentum_correction" in note
    assert all(g["momentum"] == 0.0 for g in opt.param_groups)
    assert cfg.density == 0.001 and cfg.recipe == "auto"  # the rest as given


@pytest.mark.parametrize("density", [0.05, 0.01, 0.005, 0.003, 0.001, 0.0001])
def test_auto_runs_the_nesterov_lookahead_without_masking_at_every_density(density):
    """With the lookahead, masking measured worse at 0.01 and at 0.001 (docs/convergence.md): auto sets the same
    pair at every density, the lookahead equal to the momentum (Nesterov's update), from the configuration and
    the optimizer alone, so every rank makes it alike."""
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.85)
    cfg, note = apply_recipe(TopKConfig(density=density), [opt])
    assert cfg.momentum_correction and cfg.momentum_masking is False and cfg.momentum_lookahead == 0.85
    assert "without masking, momentum_lookahead 0.85 (Nesterov)" in note
    assert cfg.recipe_in_use == "momentum_lookahead"
    with pytest.raises(ValueError, match="momentum_masking must be true or false"):
        TopKConfig(momentum_masking="no")


@pytest.mark.parametrize("kw, msg", [
    (dict(momentum_lookahead=-1.0, momentum_correction=True), "momentum_lookahead must be a number in \\[0, 10\\]"),
    (dict(momentum_lookahead=11, momentum_correction=True), "momentum_lookahead must be a number in \\[0, 10\\]"),
    (dict(momentum_lookahead="3", momentum_correction=True), "momentum_lookahead must be a number"),
    (dict(momentum_lookahead=float("nan"), momentum_correction=True), "momentum_lookahead must be a number"),
    (dict(momentum_lookahead=3.0), "momentum_lookahead=3 needs momentum_correction=True"),
])
def test_bad_lookahead_is_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TopKConfig(**kw)


@pytest.mark.parametrize("masking", [True, False])
def test_a_sparse_step_zeroes_the_velocity_where_it_sent_only_with_masking(masking):
    cfg = TopKConfig(density=0.25, momentum_correction=True, momentum=0.5, momentum_masking=masking, value_dtype="fp32",
                     min_sparse_numel=0, exchange="allgather", recipe="none")
    st = TopKState(cfg)
    p = nn.Parameter(torch.zeros(8))
    p.grad = torch.zeros(8)  # used in the backward, as DDP leaves it (a parameter without .grad is held back)
    st.bind([("p", p)])
    g = torch.tensor([1.0, -8.0, 2.0, 0.5, 7.0, -1.0, 0.0, 3.0])
    for _ in range(2):
        _b, acc, vel, _hold = kit.take_bucket(st, [p], ("p",), g.clone())
        idx = kit.select(st, acc, kit.bucket_k(st, 8))
        sent = kit.send_values(st, acc, idx, vel)
        st.end_exchange()
    # step 1: u = g, v = g, sends -8 and 7, v keeps the rest. step 2: u = 0.5 u + g, v += u.
    u1 = g.clone()
    if masking:
        u1[[1, 4]] = 0.0
    u2 = 0.5 * u1 + g
    v2 = g.clone()
    v2[[1, 4]] = 0.0
    v2 += u2
    top = v2.abs().topk(2).indices
    assert set(idx.tolist()) == set(top.tolist())
    assert torch.allclose(sent, v2[idx])
    u2[idx] = 0.0 if masking else u2[idx]
    v2[idx] = 0.0
    assert torch.allclose(st.velocities()["p"], u2) and torch.allclose(st.residuals()["p"], v2)
    assert masking or st.velocities()["p"][idx].abs().sum() > 0  # kept where sent


@pytest.mark.parametrize("masking", [False, True])
def test_a_sparse_step_with_lookahead_sends_c_steps_of_momentum_ahead_and_keeps_the_debt(masking):
    """The residual accumulates u = v + c (v - v_prev) on sparse steps: what a sent entry carries includes c
    times its velocity, and its residual then holds -c v (unmasked), which the next steps repay. Sent plus
    residual stays the sum of the velocities plus the lead c v of the last step."""
    c, m = 2.0, 0.5
    cfg = TopKConfig(density=0.25, momentum_correction=True, momentum=m, momentum_masking=masking, value_dtype="fp32",
                     momentum_lookahead=c, min_sparse_numel=0, exchange="allgather", recipe="none")
    assert cfg.recipe_in_use == ("momentum_correction" if masking else "momentum_lookahead")
    st = TopKState(cfg)
    p = nn.Parameter(torch.zeros(8))
    p.grad = torch.zeros(8)  # used in the backward, as DDP leaves it (a parameter without .grad is held back)
    st.bind([("p", p)])
    gs = [torch.tensor([1.0, -8.0, 2.0, 0.5, 7.0, -1.0, 0.0, 3.0]),
          torch.tensor([-2.0, 1.0, 6.0, 0.5, -1.0, 4.0, 0.0, -3.0]),
          torch.tensor([0.5, 0.5, -9.0, 1.0, 1.0, 2.0, 5.0, 0.0])]
    v, r, v_prev = torch.zeros(8), torch.zeros(8), torch.zeros(8)  # the reference: velocity, residual u-sum
    total_sent, total_v = torch.zeros(8), torch.zeros(8)
    for g in gs:
        _b, acc, vel, _hold = kit.take_bucket(st, [p], ("p",), g.clone())
        idx = kit.select(st, acc, kit.bucket_k(st, 8))
        sent = kit.send_values(st, acc, idx, vel)
        st.end_exchange()
        v_prev = v.clone()
        v = m * v + g
        r += v + c * (v - v_prev)
        assert set(idx.tolist()) == set(r.abs().topk(2).indices.tolist())
        assert torch.allclose(sent, r[idx])
        r[idx] = 0.0
        if masking:
            v[idx] = 0.0
        total_sent[idx] += sent
        total_v += v
        assert torch.allclose(st.residuals()["p"], r) and torch.allclose(st.velocities()["p"], v)
    if not masking:  # mass: what was sent and what waits add up to the velocities plus the last lead
        assert torch.allclose(total_sent + r, total_v + c * v, atol=1e-5)
    # a dense step (dense_hook's accumulate: no lookahead) adds the velocity alone
    before = st.residuals()["p"].clone()
    b = st.buffers([p], torch.device("cpu"))
    kit.accumulate(st, b, gs[0].clone())
    assert torch.allclose(st.residuals()["p"], before + (m * v + gs[0]))


@pytest.mark.parametrize("mc", [False, True])
def test_the_chunked_cpu_accumulate_is_bit_identical_and_flags_a_nan_in_any_chunk(mc):
    """A CPU bucket larger than one chunk is accumulated chunk by chunk (cache reuse): the residual, the
    velocity and the non-finite flag are those of the whole-bucket ops, bit for bit."""
    n = 3 * kit._CPU_CHUNK + 123
    cfg = TopKConfig(density=0.01, momentum_correction=mc, momentum=0.9 if mc else 0.0, momentum_masking=False,
                     momentum_lookahead=0.9 if mc else 0.0, min_sparse_numel=0, exchange="allgather", recipe="none")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp() for _ in range(3)]
    st, ref = TopKState(cfg), TopKState(cfg)
    p = nn.Parameter(torch.zeros(n))
    p.grad = torch.zeros(n)  # used in the backward (a parameter without .grad is held back)
    st.bind([("p", p)])
    ref.bind([("p", p)])
    for i, g in enumerate(grads):
        _b, acc, vel, _hold = kit.take_bucket(st, [p], ("p",), g.clone())
        b = ref.buffers([p], torch.device("cpu"))
        racc, rvel = kit.accumulate(ref, b, g.clone(), lookahead=True)
        assert torch.equal(acc, racc[:n])
        if mc:
            assert torch.equal(vel, rvel)
        assert not bool(st.flags.inputs[("p",)])
        idx = torch.arange(i, n, 97)  # send something so that the lookahead's debt is exercised
        kit.send_values(st, acc, idx, vel)
        kit.send_values(ref, racc[:n], idx, rvel)
        st.end_exchange()
        ref.end_exchange()
        st.flags.clear()
    bad = grads[0].clone()
    bad[2 * kit._CPU_CHUNK + 5] = float("nan")
    kit.take_bucket(st, [p], ("p",), bad)
    assert bool(st.flags.inputs[("p",)])


@pytest.mark.parametrize("make, why", [
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "AdamW is not torch.optim.SGD"),
    (lambda p: torch.optim.Adam(p, lr=1e-3), "Adam is not torch.optim.SGD"),
    (lambda p: LARS(p, lr=0.1, momentum=0.9), "LARS is not torch.optim.SGD"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "SGD momentum [0.0]"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "Nesterov"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
])
def test_other_optimizers_keep_plain_error_feedback_untouched(make, why):
    opt = make(_params())
    before = [dict(g) for g in opt.param_groups]
    cfg, note = apply_recipe(TopKConfig(density=0.001), [opt])
    assert not cfg.momentum_correction and why in note and "-> error_feedback" in note
    assert [dict(g) for g in opt.param_groups] == before


@pytest.mark.parametrize("kw, why", [
    (dict(density=1.0), "density 1"),
    (dict(exchange="scatter"), "does not support momentum correction"),
    (dict(exchange="hierarchical"), "does not support momentum correction"),
    (dict(recipe="none"), "recipe='none'"),
    (dict(momentum_correction=True, momentum=0.5), "already on"),
])
def test_sgd_is_left_alone_where_the_recipe_does_not_apply(kw, why):
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    cfg0 = TopKConfig(**kw)
    cfg, note = apply_recipe(cfg0, [opt])
    assert cfg is cfg0 and why in note and opt.param_groups[0]["momentum"] == 0.9


def test_two_optimizers_and_mixed_momenta_are_left_alone():
    a, b = torch.optim.SGD(_params(), lr=0.1, momentum=0.9), torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    assert recipe_for(TopKConfig(), [a, b]) == (False, "2 optimizers (momentum correction needs one)")
    p, q = _params()
    mixed = torch.optim.SGD([{"params": [p], "momentum": 0.9}, {"params": [q], "momentum": 0.5}], lr=0.1)
    assert not recipe_for(TopKConfig(), [mixed])[0]
    with pytest.raises(ValueError, match="recipe"):
        TopKConfig(recipe="dgc")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _run(rank, world, hook_momentum, lookahead=0.0):
    """Plain DDP with SGD(momentum=0.9), or the top-k hook at density 1 with the momentum in the hook
    (momentum correction, dense steps, with ``momentum_lookahead``) and SGD without momentum."""
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.01)  # several buckets
    if hook_momentum:
        st = TopKState(TopKConfig(density=1.0, momentum_correction=True, momentum=0.9, exchange="allgather",
                                  recipe="none", momentum_lookahead=lookahead))
        st.bind(m.named_parameters())
        st.exchange = st.exchange_for("allgather")
        ddp.register_comm_hook(st, exchange_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.0 if hook_momentum else 0.9)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(8):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    vel = {k: v.clone() for k, v in st.velocities().items()} if hook_momentum else {}
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, vel


def _both(rank, world):
    return _run(rank, world, False), _run(rank, world, True), _run(rank, world, True, 0.9)


def test_momentum_in_the_hook_at_density_one_is_sgd_momentum_with_plain_ddp():
    """Dense steps keep the velocity and send it: the hook's momentum is heavy-ball SGD momentum, so
    momentum correction at density 1 trains as plain DDP with SGD(momentum) (no weight decay); the lookahead
    acts on sparse steps only, so it changes nothing there."""
    for (ref, _), *hooked in run_distributed(_both, 2):
        for got, vel in hooked:
            assert vel and all(v.abs().sum() > 0 for v in vel.values())  # the velocity lives in the hook
            for k in ref:
                assert torch.allclose(ref[k], got[k], atol=1e-6, rtol=1e-5), k


def _live(rank, world, live, engage_at=0):
    """SGD(momentum, weight decay) under OneCycleLR(cycle_momentum=True), which writes the optimizer's momentum
    every step: plain DDP, or the hook with recipe="auto"'s LiveRecipe engaged from step ``engage_at``
    (the hook at density 1 with momentum correction sends the dense velocity: heavy-ball in the hook)."""
    from lightning_topk.comm.recipe import LiveRecipe

    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, base_momentum=0.7,
                                                max_momentum=0.95)
    if live:
        dormant, st = dormant_allgather_hook(ddp, m)
        rec = LiveRecipe(opt, dormant)
    g = torch.Generator().manual_seed(10 + rank)
    seen = []
    for step in range(10):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        if live:
            if step == engage_at:
                rec.engage(st)
            rec.begin_step(st)
        nn.functional.cross_entropy(ddp(x), y).backward()
        saved = rec.before_step(opt) if live else None
        opt.step()
        if live:
            rec.after_step(opt, saved, committed=True)
            if rec.engaged:
                seen.append((opt.param_groups[0]["momentum"], st.config.momentum, opt.param_groups[0]["weight_decay"]))
        sched.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, seen, sorted(
        {k for s in opt.state.values() for k in s})


def _live_both(rank, world):
    return _live(rank, world, False), _live(rank, world, True, 0), _live(rank, world, True, 3)


def test_live_recipe_keeps_weight_decay_through_the_momentum_and_follows_the_scheduler():
    """With the velocity in the hook, SGD's weight decay still passes through the momentum (its share is kept per
    parameter: ``topk_wd_momentum``), the hook takes the momentum OneCycleLR writes each step, and the optimizer
    shows the user's values between steps. Engaged from the start or mid-run (the velocity then starts from the
    optimizer's momentum buffers), it trains as torch's DDP + SGD(momentum, weight_decay): the recipe changes
    where the momentum lives, not the update (the old recipe ended 0.32x the update away with weight decay)."""
    for (ref, _, _), *lives in run_distributed(_live_both, 2):
        for got, seen, keys in lives:
            for k in ref:
                assert torch.allclose(ref[k], got[k], atol=2e-6, rtol=1e-5), k
            assert all(user == hook and user > 0 and wd == 0.05 for user, hook, wd in seen)
            assert len(seen) >= 7 and len({user for user, _, _ in seen}) > 3  # OneCycleLR moved it
            assert keys == ["topk_wd_momentum"]  # the optimizer no longer keeps a momentum buffer


def test_live_recipe_refuses_groups_that_a_callback_gives_different_momenta():
    from lightning_topk.comm.recipe import LiveRecipe

    a, b = _params()
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1, momentum=0.9)
    rec = LiveRecipe(opt, TopKConfig(recipe="auto"))
    assert rec.momentum() == 0.9
    opt.param_groups[1]["momentum"] = 0.5
    with pytest.raises(ValueError, match="recipe='auto' .* needs one momentum .* recipe='none'"):
        rec.momentum()
