"""LARS/LAMB match per-parameter references; parameter groups; option validation; factory."""
import copy

import pytest
import torch
from torch import nn

from lightning_topk.optim import LAMB, LARS, build_optimizer, param_groups
from lightning_topk.optim.reference import LoopLamb, LoopLars

pytestmark = pytest.mark.usefixtures("one_thread")


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                        nn.Linear(8 * 6 * 6, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return net.to(dtype)


def _run(net, opt, steps, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 3, 8, 8, generator=gen).to(dtype)
        y = torch.randint(0, 4, (5,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x).float(), y)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _pair(opt_cls, ref_cls, dtype=torch.float32, wd=1e-2, steps=60, **kw):
    a, b = _net(dtype), _net(dtype)
    pa = _run(a, opt_cls(param_groups(a, weight_decay=wd), **kw), steps, dtype)
    pb = _run(b, ref_cls(param_groups(b, weight_decay=wd), **kw), steps, dtype)
    return pa, pb, [p.detach().clone() for p in _net(dtype).parameters()]


@pytest.mark.parametrize("momentum,nesterov", [(0.9, False), (0.9, True), (0.0, False)])
def test_lars_matches_timm_style_loop(momentum, nesterov):
    pa, pb, p0 = _pair(LARS, LoopLars, lr=0.5, momentum=momentum, nesterov=nesterov, trust_coeff=0.02)
    for a, b, _z in zip(pa, pb, p0):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    assert any((a - z).abs().max() > 1e-3 for a, z in zip(pa, p0)), "parameters did not move"


def test_lamb_matches_loop():
    pa, pb, p0 = _pair(LAMB, LoopLamb, lr=0.01)
    for a, b in zip(pa, pb):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    assert any((a - z).abs().max() > 1e-3 for a, z in zip(pa, p0))


def test_lamb_without_bias_correction_matches_loop():
    pa, pb, _ = _pair(LAMB, LoopLamb, lr=0.01, bias_correction=False, betas=(0.8, 0.99))
    for a, b in zip(pa, pb):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("opt_cls,ref_cls,kw", [(LARS, LoopLars, dict(lr=0.5, trust_coeff=0.02)),
                                                (LAMB, LoopLamb, dict(lr=0.01))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_use_fp32_math(opt_cls, ref_cls, kw, dtype):
    pa, pb, p0 = _pair(opt_cls, ref_cls, dtype=dtype, steps=20, **kw)
    for a, b in zip(pa, pb):
        assert a.dtype == dtype
        # identical fp32 math; at most a rare one-ulp difference from a differently rounded fp32 value
        ulp = torch.finfo(dtype).eps * b.float().abs().clamp_min(1e-3)
        assert ((a.float() - b.float()).abs() <= ulp).all()
        assert (a == b).float().mean() > 0.99
    state = next(iter(opt_cls(_net(dtype).parameters(), **kw).state.values()), None)
    assert state is None  # no state before a step


def test_low_precision_state_is_fp32():
    net = _net(torch.float16)
    opt = LARS(param_groups(net, 1e-4), lr=0.1)
    _run(net, opt, 2, torch.float16)
    bufs = [s["momentum_buffer"] for s in opt.state.values()]
    assert bufs and all(b.dtype == torch.float32 for b in bufs)
    opt = LAMB(net.parameters(), lr=0.1)
    _run(net, opt, 2, torch.float16)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_param_groups_exclusions():
    net = _net()
    groups = param_groups(net, weight_decay=5e-4)
    decay, excl = groups
    names = {id(p): n for n, p in net.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["0.weight", "4.weight", "6.weight"]
    assert sorted(names[id(p)] for p in excl["params"]) == ["1.bias", "1.weight", "4.bias", "5.bias",
                                                             "5.weight", "6.bias"]
    assert decay["weight_decay"] == 5e-4 and "lars_adapt" not in decay
    assert excl["weight_decay"] == 0.0 and excl["lars_adapt"] is False
    net[0].weight.requires_grad_(False)
    assert len(param_groups(net)[0]["params"]) == 2
    # torch's own optimizers accept the groups (they ignore lars_adapt)
    torch.optim.SGD(param_groups(_net(), 1e-4), lr=0.1)


def test_excluded_group_is_plain_sgd():
    """lars_adapt=False: d = g, no trust ratio, no decay."""
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    p.grad = torch.tensor([0.5, 0.25])
    opt = LARS([{"params": [p], "lars_adapt": False}], lr=0.1, momentum=0.0)
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([0.95, -2.025]))


def test_trust_ratio_is_one_for_zero_weight():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    LARS([p], lr=0.1, momentum=0.0, weight_decay=0.1).step()
    assert torch.allclose(p.detach(), torch.full((3,), -0.1))


@pytest.mark.parametrize("cls,kw,opt", [
    (LARS, dict(lr=-0.1), "lr"), (LARS, dict(lr=0.1, momentum=1.0), "momentum"),
    (LARS, dict(lr=0.1, weight_decay=-1), "weight_decay"), (LARS, dict(lr=0.1, trust_coeff=0), "trust_coeff"),
    (LARS, dict(lr=0.1, eps=-1e-8), "eps"), (LARS, dict(lr=0.1, momentum=0.0, nesterov=True), "nesterov"),
    (LARS, dict(lr="0.1"), "lr"), (LARS, dict(lr=0.1, lars_adapt=1), "lars_adapt"),
    (LARS, dict(lr=0.1, weight_decay=1e-4, lars_adapt=False), "weight_decay"),
    (LAMB, dict(lr=-1.0), "lr"), (LAMB, dict(lr=0.1, betas=(0.9, 1.0)), "betas[1]"),
    (LAMB, dict(lr=0.1, betas=(0.9,)), "betas"), (LAMB, dict(lr=0.1, eps=-1.0), "eps"),
    (LAMB, dict(lr=0.1, weight_decay=-0.1), "weight_decay"), (LAMB, dict(lr=float("nan")), "lr"),
])
def test_bad_options_raise_naming_the_option(cls, kw, opt):
    with pytest.raises(ValueError, match=f"'{opt.replace('[', '.').replace(']', '.')}'"):
        cls([nn.Parameter(torch.ones(2))], **kw)


def test_bad_option_in_later_group_raises():
    with pytest.raises(ValueError, match="'lr'"):
        LARS([{"params": [nn.Parameter(torch.ones(2))]}, {"params": [nn.Parameter(torch.ones(2))], "lr": -1}],
             lr=0.1)


def test_param_groups_bad_options():
    with pytest.raises(ValueError, match="'weight_decay'"):
        param_groups(_net(), weight_decay=-1)
    with pytest.raises(ValueError, match="'lars_adapt'"):
        param_groups(_net(), lars_adapt=True)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_factory_impls_agree(name):
    results = {}
    for impl in ("fused", "foreach", "loop"):
        net = _net()
        kw = dict(momentum=0.9) if name == "sgd" else {}
        opt = build_optimizer(name, param_groups(net, 1e-3), lr=0.01, impl=impl, **kw)
        assert opt.param_groups[0]["fused"] is (impl == "fused")
        assert opt.param_groups[0]["foreach"] is (impl == "foreach")
        results[impl] = _run(net, opt, 10, torch.float32)
    for a, b, c in zip(results["fused"], results["foreach"], results["loop"]):
        assert torch.allclose(a, c, atol=1e-5) and torch.allclose(b, c, atol=1e-5)


def test_factory_bad_options():
    with pytest.raises(ValueError, match="'name'"):
        build_optimizer("rmsprop", _net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'impl'"):
        build_optimizer("sgd", _net().parameters(), lr=0.1, impl="cuda")
    assert isinstance(build_optimizer("lars", _net().parameters(), lr=0.1), LARS)
    assert isinstance(build_optimizer("lamb", _net().parameters(), lr=0.1), LAMB)


def test_state_dict_roundtrip_continues_identically():
    a = _net()
    opt = LARS(param_groups(a, 1e-4), lr=0.2)
    _run(a, opt, 5, torch.float32)
    b = copy.deepcopy(a)
    opt_b = LARS(param_groups(b, 1e-4), lr=0.2)
    opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))
    pa = _run(a, opt, 5, torch.float32, seed=7)
    pb = _run(b, opt_b, 5, torch.float32, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_kernel_path_matches_foreach_path(nesterov):
    """kernel=True routes through lightning_topk.ops.cuda.fused_lars_step (its torch reference off CUDA): same result."""
    a, b = _net(), _net()
    kw = dict(lr=0.5, trust_coeff=0.02, nesterov=nesterov)
    pa = _run(a, LARS(param_groups(a, 1e-2), kernel=False, **kw), 30, torch.float32)
    pb = _run(b, LARS(param_groups(b, 1e-2), kernel=True, **kw), 30, torch.float32)
    for x, y in zip(pa, pb):
        assert torch.allclose(x, y, rtol=0, atol=1e-6), (x - y).abs().max()
    with pytest.raises(ValueError, match="'kernel'"):
        LARS(a.parameters(), lr=0.1, kernel="yes")


@pytest.mark.gpu
def test_lars_on_cuda_matches_reference():
    a, b = _net().cuda(), _net().cuda()
    opt_a = LARS(param_groups(a, 1e-2), lr=0.5, trust_coeff=0.02)
    opt_b = LoopLars(param_groups(b, 1e-2), lr=0.5, trust_coeff=0.02)
    for _ in range(20):
        x = torch.randn(5, 3, 8, 8, device="cuda")
        for net, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_cache_blocks_split_large_tensors(dtype, nesterov):
    """Tensors larger than the CPU cache block are updated slice by slice: same result as the loop."""
    torch.manual_seed(3)
    shapes = [(600, 700), (5,), (70000,), (3, 3)]  # 420000 > one block: sliced
    pa = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    pb = [nn.Parameter(p.detach().clone()) for p in pa]
    kw = dict(lr=0.3, trust_coeff=0.05, weight_decay=1e-2, nesterov=nesterov)
    oa, ob = LARS(pa, **kw), LoopLars(pb, **kw)
    for _ in range(5):
        for a, b in zip(pa, pb):
            g = torch.randn(a.shape).to(dtype)
            a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for a, b in zip(pa, pb):
        if dtype == torch.float32:
            assert torch.allclose(a, b, rtol=0, atol=1e-6)
        else:  # same fp32 math; an fp32 rounding difference can flip an fp16 rounding now and then
            assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-4)
            assert (a == b).float().mean() > 0.99
