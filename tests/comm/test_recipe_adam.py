"""recipe="auto" with Adam/AdamW (issue 42): :class:`~lightning_topk.comm.recipe.AdamLiveRecipe` on real gloo processes
against a hand-written reference of its update, its decisions, and its errors."""
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk.comm.recipe import ADAM_DENSE_STEPS, ADAM_WARMUP_STEPS, AdamLiveRecipe, adam_recipe_for, live_recipe
from lightning_topk.comm.state import TopKConfig, TopKState
from tests.helpers.dist import run_distributed
from tests.helpers.exchanges import dormant_allgather_hook

B1, B2, EPS, LR, WD, STEPS, ENGAGE = 0.9, 0.999, 1e-8, 1e-2, 0.05, 8, 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _lr(step):
    return min(1.0, (step + 1) / 4) * (0.5 + 0.5 * math.cos(step / STEPS))  # warm-up, then a decay


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _hooked(rank, world):
    """DDP + AdamW under a LambdaLR: the hook at density 1 (dense steps) with the recipe dormant, engaged by hand at
    step ENGAGE (density 1 never engages by itself)."""
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr)
    dormant, st = dormant_allgather_hook(ddp, m)
    rec = AdamLiveRecipe(opt, dormant)
    seen = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        if step == ENGAGE:
            rec.engage(st)
        rec.begin_step(st)
        nn.functional.cross_entropy(ddp(x), y).backward()
        saved = rec.before_step(opt)
        opt.step()
        rec.after_step(opt, saved, committed=True)
        g = opt.param_groups[0]
        seen.append((g["lr"], tuple(g["betas"]), g["weight_decay"], opt.step == rec._step))
        sched.step()
    keys = sorted({k for s in opt.state.values() for k in s})
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, seen, keys, dict(st.recipe_state)


def _reference(world):
    """The recipe's update written out: AdamW on the mean gradient for ENGAGE steps, then each rank's
    v_i = b2 v_i + (1-b2) g_i^2, den_i = max(sqrt(b2^(t-T) vf / (1-b2^t)), sqrt(v_i / ((1-b2^t) W))) + eps,
    vel_i = b1 vel_i + (1-b1) g_i / den_i (seeded with exp_avg / den), and p = p (1 - lr wd) - lr / (1-b1^t) mean_i vel_i."""
    m = _model()
    ps = list(m.parameters())
    mom = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    vel = vloc = vf = None
    for step in range(STEPS):
        t = step + 1
        lr = LR * _lr(step)
        grads = []
        for r in range(world):
            x, y = _batch(r, step)
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            grads.append([p.grad.clone() for p in ps])
        with torch.no_grad():
            if step < ENGAGE:
                for i, p in enumerate(ps):
                    g = sum(gr[i] for gr in grads) / world
                    mom[i].mul_(B1).add_(g, alpha=1 - B1)
                    v[i].mul_(B2).addcmul_(g, g, value=1 - B2)
                    p.mul_(1 - lr * WD)
                    p.addcdiv_(mom[i] / (1 - B1 ** t), (v[i] / (1 - B2 ** t)).sqrt() + EPS, value=-lr)
                continue
            if vf is None:
                vf = [vi.clone() for vi in v]
                vel = [[mi / ((f / (1 - B2 ** ENGAGE)).sqrt() + EPS) for mi, f in zip(mom, vf)] for _ in range(world)]
                vloc = [[vi.clone() for vi in v] for _ in range(world)]
            for i, p in enumerate(ps):
                frozen = (vf[i] * B2 ** (t - ENGAGE) / (1 - B2 ** t)).sqrt()
                for r in range(world):
                    g = grads[r][i]
                    vloc[r][i].mul_(B2).addcmul_(g, g, value=1 - B2)
                    den = torch.maximum(frozen, (vloc[r][i] / ((1 - B2 ** t) * world)).sqrt()) + EPS
                    vel[r][i].mul_(B1).add_(g / den, alpha=1 - B1)
                u = sum(vel[r][i] for r in range(world)) / world
                p.mul_(1 - lr * WD)
                p.add_(u, alpha=-lr / (1 - B1 ** t))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_the_engaged_update_on_dense_exchanges_is_the_hand_written_frozen_variance_adamw():
    """Dormant for 3 steps (the user's AdamW), then engaged: on dense exchanges each step is the reference above to
    fp32 rounding; between steps the optimizer shows the scheduler's lr and the user's betas and weight decay, keeps
    ``step``, the frozen ``exp_avg_sq`` and the freeze step (``exp_avg`` moved into the hook), and has its own
    ``step`` method back."""
    ref = _reference(2)
    for got, seen, keys, local_v in run_distributed(_hooked, 2):
        for k in ref:
            assert torch.allclose(ref[k], got[k], atol=2e-6, rtol=1e-5), (k, (ref[k] - got[k]).abs().max())
        assert [s[0] for s in seen] == [LR * _lr(i) for i in range(STEPS)]  # the scheduler's, every step
        assert all(s[1] == (B1, B2) and s[2] == WD and not s[3] for s in seen)
        assert keys == ["exp_avg_sq", "step", "topk_frozen_step"]
        assert len(local_v) == 4  # this rank's own v, per parameter


def _params():
    return nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))


def test_auto_takes_adamw_and_adam_with_a_dense_warm_up_and_leaves_the_rest():
    a, b = _params()
    live, cfg, note = live_recipe(TopKConfig(density=0.01), [torch.optim.AdamW([a, b], lr=1e-3)], adam=True)
    assert isinstance(live, AdamLiveRecipe) and live.dormant.dense_steps == ADAM_DENSE_STEPS == 20
    assert live.dormant.warmup_steps == cfg.warmup_steps == ADAM_WARMUP_STEPS == 100  # then DGC's density warm-up
    assert [round(cfg.schedule.density_at(s), 4) for s in (19, 20, 70, 120)] == [1.0, 0.25, 0.05, 0.01]
    assert not live.dormant.momentum_correction and cfg.momentum_correction and cfg.dense_steps == 20
    assert cfg.momentum == cfg.momentum_lookahead == 0.9 and not cfg.momentum_masking and "Adam in the hook" in note
    live, cfg, _ = live_recipe(TopKConfig(density=0.01, dense_steps=7, warmup_steps=3), [torch.optim.Adam([a], lr=1e-3)],
                               adam=True)
    assert live.dormant.dense_steps == cfg.dense_steps == 7 and cfg.warmup_steps == 3  # the user's warm-ups win
    # topk_fsdp, torchft and the SGD-only callers pass adam=False: plain error feedback, as before
    assert live_recipe(TopKConfig(density=0.01), [torch.optim.AdamW([a], lr=1e-3)])[0] is None
    for opt, why in [(torch.optim.AdamW([a], amsgrad=True), "amsgrad"),
                     (torch.optim.Adam([a], weight_decay=0.1), "L2 weight decay"),
                     (torch.optim.AdamW([{"params": [a]}, {"params": [b], "betas": (0.8, 0.999)}]), "different betas")]:
        use, reason = adam_recipe_for(TopKConfig(density=0.01), [opt])
        assert not use and why in reason
    assert not adam_recipe_for(TopKConfig(density=1.0), [torch.optim.AdamW([a])])[0]
    assert not adam_recipe_for(TopKConfig(density=0.01, local_steps=4), [torch.optim.AdamW([a])])[0]


def test_groups_given_different_betas_after_setup_are_refused_naming_the_option():
    a, b = _params()
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-3)
    rec = AdamLiveRecipe(opt, TopKConfig(recipe="auto"))
    assert rec.momentum() == 0.9
    opt.param_groups[1]["betas"] = (0.5, 0.999)
    with pytest.raises(ValueError, match="recipe='auto' .* needs one \\(beta1, beta2, eps\\) .* recipe='none'"):
        rec.momentum()


def test_a_skipped_step_keeps_the_local_variance_and_the_optimizer():
    """A step the controller skips (non-finite) commits nothing of the recipe: this rank's v stays, the optimizer's
    state and step method are the user's."""
    m = nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    st = TopKState(TopKConfig(density=0.01, recipe="none"))
    st.bind(m.named_parameters())
    rec = AdamLiveRecipe(opt, st.config, hooks=False)
    rec.engage(st)
    before = {k: v.clone() for k, v in st.recipe_state.items()}
    state_before = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()} for k, s in opt.state.items()}
    for n, p in m.named_parameters():
        rec.precondition(st, n, p, torch.ones_like(p))
    saved = rec.before_step(opt)
    rec.after_step(opt, saved, committed=False)  # the optimizer step never ran
    assert before.keys() == st.recipe_state.keys()
    assert all(torch.equal(before[k], st.recipe_state[k]) for k in before)
    assert "step" not in opt.__dict__
    for p, s in opt.state.items():
        assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(state_before[p][k])) for k in s)


def test_the_dense_warm_up_lasts_while_the_lr_rises_and_a_checkpoint_keeps_it():
    """dense_steps=2, an lr that rises for 5 steps: steps 3-5 are dense too, step 6 (the lr no longer rises) is the
    first that may go sparse; a state loaded from a checkpoint in between continues the same way."""
    m = nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1.0)
    lrs = [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.9]
    cfg = TopKConfig(density=0.01, dense_steps=2, recipe="none")

    def run(st, rec, steps):
        dense = []
        for s in steps:
            for g in opt.param_groups:
                g["lr"] = lrs[s]
            rec.begin_step(st)
            dense.append(st.density_now() >= 1.0)
            st.end_exchange()
            rec.after_step(opt, None, committed=True)
        return dense

    st = TopKState(cfg)
    assert run(st, AdamLiveRecipe(opt, cfg), range(7)) == [True] * 5 + [False] * 2
    half = TopKState(cfg)
    run(half, AdamLiveRecipe(opt, cfg), range(3))
    resumed = TopKState(cfg)
    resumed.load_state_dict(half.state_dict())
    assert resumed.recipe_lr == 0.6 and resumed.schedule.dense_steps == 3
    assert run(resumed, AdamLiveRecipe(opt, cfg), range(3, 7)) == [True] * 2 + [False] * 2
