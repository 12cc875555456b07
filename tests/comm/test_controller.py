"""Wire-value safety and parameter naming of the hooks, on real gloo processes without a Trainer."""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState, topk_allgather_hook
from lightning_topk.comm.controller import Decision, StepController
from tests.helpers.dist import run_distributed

SPIKE_STEP = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def _steps(rank, world, cfg, steps, bind=True, spike=None):
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)
    st = TopKState(TopKConfig(**cfg))
    if bind:
        st.bind(m.named_parameters())
    st.debug.enabled = True
    ddp.register_comm_hook(st, topk_allgather_hook)
    ctl = StepController(st)
    step = [0]

    def poison(g):
        if spike is None or rank != 0 or step[0] != SPIKE_STEP:
            return g
        g = g.clone()
        g[5, 3] = spike
        return g

    next(m.parameters()).register_hook(poison)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    history, decisions = [], []
    for step[0] in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        old = {k: v.clone() for k, v in st.residuals().items()}
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        decisions.append(ctl.finish_step(m.named_parameters()))
        history.append((old, {k: v.clone() for k, v in st.residuals().items()},
                        {k: v.clone() for k, v in st.debug.sent.items()},
                        {k: v.clone() for k, v in st.debug.grads_in.items()}))
        opt.step()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    return params, history, decisions, [p.numel() for p in m.parameters()]


def _scenarios(rank, world):
    sparse = dict(density=0.02, min_sparse_numel=0, dense_steps=1)
    return {
        "spike": _steps(rank, world, dict(sparse, value_dtype="fp16"), 5, spike=1e6),
        "unbound": _steps(rank, world, sparse, 3, bind=False),
    }


@pytest.fixture(scope="module")
def runs():
    res = run_distributed(_scenarios, 2)
    return {key: [r[key] for r in res] for key in res[0]}


def _conserved(history, rtol=1e-6, atol=1e-6):
    for old, new, sent, grad in history:
        for name, g in grad.items():
            o = old.get(name, torch.zeros_like(g))
            assert torch.allclose(sent[name] + new.get(name, torch.zeros_like(g)), o + g, rtol=rtol, atol=atol), name


def test_fp16_wire_survives_a_finite_spike_and_conserves(runs):
    """A finite 1e6 gradient entry is far beyond fp16's 65504: it is sent clamped, the rest stays in the residual,
    and nothing non-finite appears anywhere (the old code put inf on the wire and -inf in the residual)."""
    for params, history, decisions, _ in runs["spike"]:
        assert decisions == [Decision.COMMIT] * 5  # no fault: nonfinite="raise" never fired
        assert all(torch.isfinite(v).all() for v in params.values())
        for _old, new, sent, _grad in history:
            assert all(torch.isfinite(v).all() for v in new.values())
            assert all(v.abs().max() <= 65504 for v in sent.values())
        _conserved(history)
    # the spiking rank sent 65504 for that entry and kept the other ~934k in its residual
    old, new, sent, grad = runs["spike"][0][1][SPIKE_STEP]
    name = "0.weight"
    assert float(grad[name].view(256, 32)[5, 3]) == 1e6
    assert float(sent[name].view(256, 32)[5, 3]) == 65504.0
    assert float(new[name].view(256, 32)[5, 3]) == pytest.approx(1e6 - 65504, rel=1e-6)


def test_unbound_parameters_get_unique_names_per_parameter(runs):
    """The raw hook without state.bind(): every parameter gets its own residual (names do not repeat from
    bucket to bucket), and conservation holds per parameter."""
    for _params, history, _decisions, numels in runs["unbound"]:
        _old, new, _sent, _grad = history[-1]
        assert sorted(new) == sorted(f"param{i}" for i in range(len(numels)))
        assert sorted(v.numel() for v in new.values()) == sorted(numels)
        _conserved(history)


def test_a_skip_after_load_state_dict_returns_to_the_loaded_step():
    """A controller built before a load (Fabric: setup, then fabric.load) rolls a skipped step back to the
    loaded exchange step, not to the step it had before the load."""
    st = TopKState(TopKConfig(nonfinite="skip"))
    ctl = StepController(st)
    sd = TopKState(TopKConfig()).state_dict()
    sd["step"] = 7
    st.load_state_dict(sd)
    ctl.begin_step(scaler=True)
    st.end_exchange()  # what the hooks do at the last bucket
    assert ctl.finish_step(found_inf=[torch.ones(())]) is Decision.SKIP and st.step == 7
    st.end_exchange()
    assert ctl.finish_step(found_inf=[torch.zeros(())]) is Decision.COMMIT and st.step == 8
