"""FrozenVarianceAdamW: torch's AdamW up to the freeze step, then AdamW with exp_avg_sq and its bias correction
held at that step (a hand-written reference); the factory option; checkpoints load into torch's AdamW."""
import copy
import math

import pytest
import torch
from torch import nn

from lightning_topk.optim import FrozenVarianceAdamW, build_optimizer, param_groups

pytestmark = pytest.mark.usefixtures("one_thread")

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.999), 1e-8, 0.05


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _grads(net, step):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()


def _run(net, opt, steps, start=0):
    out = []
    for s in range(start, start + steps):
        _grads(net, s)
        opt.step()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


def _reference(net, steps, freeze, b1_after=None):
    """AdamW by hand: m and v as torch's; after step ``freeze`` v and 1-beta2^t stay as they were at ``freeze``,
    and beta1 is ``b1_after`` (if given)."""
    b2 = BETAS[1]
    m = [torch.zeros_like(p) for p in net.parameters()]
    v = [torch.zeros_like(p) for p in net.parameters()]
    out = []
    for s in range(steps):
        t = s + 1
        b1 = BETAS[0] if b1_after is None or t <= freeze else b1_after
        _grads(net, s)
        with torch.no_grad():
            for p, mi, vi in zip(net.parameters(), m, v):
                p.mul_(1 - LR * WD)
                mi.mul_(b1).add_(p.grad, alpha=1 - b1)
                if t <= freeze:
                    vi.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                bc2 = 1 - b2 ** min(t, freeze)
                p.sub_(LR / (1 - b1 ** t) * mi / (vi.sqrt() / math.sqrt(bc2) + EPS))
        out.append([p.detach().clone() for p in net.parameters()])
    return out


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_equals_adamw_before_freeze_and_frozen_reference_after(impl):
    freeze, steps = 7, 20
    flags = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    a, b, c = _net(), _net(), _net()
    got = _run(a, FrozenVarianceAdamW(a.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                      freeze_variance_after=freeze, **flags), steps)
    torch_adamw = _run(b, torch.optim.AdamW(b.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                            **flags), steps)
    ref = _reference(c, steps, freeze)
    for s in range(freeze):  # torch's own step: bit for bit
        assert all(torch.equal(x, y) for x, y in zip(got[s], torch_adamw[s]))
    for s in range(steps):
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(got[s], ref[s])), s
    # and the freeze changed something: after it the run leaves AdamW's
    assert max((x - y).abs().max().item() for x, y in zip(got[-1], torch_adamw[-1])) > 1e-4


def test_beta1_after_freeze_changes_only_the_frozen_steps():
    freeze, steps = 5, 14
    a, b, c = _net(), _net(), _net()
    got = _run(a, FrozenVarianceAdamW(a.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False,
                                      freeze_variance_after=freeze, beta1_after_freeze=0.5), steps)
    same_beta = _run(b, FrozenVarianceAdamW(b.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                            foreach=False, freeze_variance_after=freeze), steps)
    ref = _reference(c, steps, freeze, b1_after=0.5)
    for s in range(freeze):
        assert all(torch.equal(x, y) for x, y in zip(got[s], same_beta[s]))
    for s in range(steps):
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(got[s], ref[s])), s
    assert max((x - y).abs().max().item() for x, y in zip(got[-1], same_beta[-1])) > 1e-4
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="beta1_after_freeze"):
            FrozenVarianceAdamW(a.parameters(), freeze_variance_after=3, beta1_after_freeze=bad)
    with pytest.raises(ValueError, match="beta1_after_freeze.*freeze_variance_after"):
        FrozenVarianceAdamW(a.parameters(), beta1_after_freeze=0.5)
    with pytest.raises(ValueError, match="beta1_after_freeze"):
        build_optimizer("adamw", a.parameters(), lr=LR, beta1_after_freeze=0.5)
    opt = build_optimizer("adamw", a.parameters(), lr=LR, freeze_variance_after=3, beta1_after_freeze=0.5)
    assert opt.param_groups[0]["beta1_after_freeze"] == 0.5


def test_frozen_update_is_linear_in_the_gradient():
    """With v frozen, two steps' gradients arriving at once as one (sum) move the parameters as m's EMA says."""
    net = _net()
    opt = FrozenVarianceAdamW(net.parameters(), lr=LR, weight_decay=0.0, freeze_variance_after=3)
    _run(net, opt, 3)
    v_before = [opt.state[p]["exp_avg_sq"].clone() for p in net.parameters()]
    _grads(net, 50)
    for p in net.parameters():
        p.grad.mul_(1000.0)  # a burst: AdamW's v would grow; the frozen one must not
    opt.step()
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v) for p, v in zip(net.parameters(), v_before))
    assert all(int(opt.state[p]["step"]) == 4 for p in net.parameters())


def test_factory_option_and_checkpoint_into_torch_adamw():
    net = _net()
    opt = build_optimizer("adamw", param_groups(net, WD), lr=LR, impl="loop", freeze_variance_after=4)
    assert isinstance(opt, FrozenVarianceAdamW) and opt.param_groups[0]["freeze_variance_after"] == 4
    assert type(build_optimizer("adamw", net.parameters(), lr=LR)) is torch.optim.AdamW
    with pytest.raises(ValueError, match="freeze_variance_after"):
        build_optimizer("sgd", net.parameters(), lr=0.1, freeze_variance_after=4)
    with pytest.raises(ValueError, match="freeze_variance_after"):
        FrozenVarianceAdamW(net.parameters(), freeze_variance_after=-1)
    _run(net, opt, 6)
    # resume: a fresh FrozenVarianceAdamW continues identically; torch's AdamW loads the same state
    twin = copy.deepcopy(net)
    opt2 = build_optimizer("adamw", param_groups(twin, WD), lr=LR, impl="loop", freeze_variance_after=4)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    a, b = _run(net, opt, 3, start=6), _run(twin, opt2, 3, start=6)
    assert all(torch.equal(x, y) for x, y in zip(a[-1], b[-1]))
    plain = torch.optim.AdamW(param_groups(copy.deepcopy(net), WD), lr=LR)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert len(plain.state) == len(opt.state)


def _fsdp_batches(rank):
    g = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(8)]


def _fsdp_train(rank, world):
    """FSDP2 (DTensor shards) over 2 gloo processes: the frozen steps run on the local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = _net()
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    opt = FrozenVarianceAdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False,
                              freeze_variance_after=3)
    for x, y in _fsdp_batches(rank):
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def test_fsdp2_shards_match_the_unsharded_optimizer_on_the_mean_gradient():
    from tests.helpers.dist import run_distributed

    got = run_distributed(_fsdp_train, 2)
    net = _net()
    opt = FrozenVarianceAdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False,
                              freeze_variance_after=3)
    for (x0, y0), (x1, y1) in zip(_fsdp_batches(0), _fsdp_batches(1)):
        loss = (nn.functional.cross_entropy(net(x0), y0) + nn.functional.cross_entropy(net(x1), y1)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    for p, a, b in zip(net.parameters(), got[0], got[1]):
        assert torch.equal(a, b)
        assert torch.allclose(a, p.detach(), rtol=1e-5, atol=1e-6)
