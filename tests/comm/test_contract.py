"""The contract every registered exchange meets, checked over ``registry.names()`` (and a tiny exchange
that exists only here, registered the way a user would): conservation of the gradient mass, a skipped
step rolled back bit for bit, resume from a state dict bit for bit, a state-dict round trip, bad options
named, and no host sync inside the hook on the sync-free path. One spawn of 4 real gloo processes (2 nodes
x 2, so the hierarchical exchanges run too) serves every exchange. What is specific to one exchange stays
in its own file (test_exchange.py, test_scatter.py, test_hierarchical.py, test_cost.py)."""
import io
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState
from lightning_topk.comm.controller import Decision, StepController
from lightning_topk.comm.exchanges import Exchange, Layout, exchange_hook, registry
from lightning_topk.comm.exchanges.auto import candidates_for
from lightning_topk.comm.exchanges.dense import DenseExchange
from lightning_topk.comm.exchanges.hierarchical import make_groups
from lightning_topk.comm.exchanges.scatter import fold_owner_residual
from lightning_topk.lightning.telemetry import reduced_metrics
from tests.helpers.dist import run_distributed
from tests.helpers.exchanges import make_auto, owner_residuals
from tests.helpers.syncs import SyncCounter

N, L = 2, 2
WORLD = N * L
STEPS, SKIP = 4, 2


class HalfDense(DenseExchange):
    """A user's exchange: dense fp16 all-reduce (DenseExchange's hook with this dtype, counted under this
    exchange's name), predicted at 0.4 of fp32's link time (so that ``auto``, given the choice, takes it)."""

    dtype = torch.float16

    @classmethod
    def predict(cls, model, n, k, value_bytes=4):
        comp, comm = DenseExchange.predict(model, n, k, value_bytes)
        return comp, 0.4 * comm


class _Ranks:
    """The part of a Lightning strategy that telemetry's reduction uses, over the default process group."""

    root_device = torch.device("cpu")

    @property
    def world_size(self):
        return dist.get_world_size()

    def reduce(self, t, reduce_op="sum"):
        dist.all_reduce(t)
        return t


def _register_example():
    if "half_dense" not in registry.names():
        registry.register("half_dense")(HalfDense)


def _names():
    # sparse local SGD ("local") hands DDP the node's gradient, not the world's average: tests/comm/test_outer.py
    # and tests/lightning/test_local.py check it
    return [*(n for n in registry.names() if not registry.get(n).local_sgd), "half_dense"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(2 * STEPS)]


def _snap(d):
    return {k: v.detach().clone() for k, v in d.items()}


def _mass(st):
    """Per-parameter pending error feedback of this rank: its residuals plus its owner residuals folded."""
    out = _snap(st.residuals())
    for key, t in owner_residuals(st).items():
        for name, v in fold_owner_residual(key, t).items():
            out[name] = out[name] + v if name in out else v.clone()
    return out


def _state(name, groups, **kw):
    cfg = TopKConfig(density=0.05, min_sparse_numel=0, nonfinite="skip", **kw)
    st = TopKState(cfg, hier=groups, num_nodes=N)
    st.exchange = st.exchange_for(name, layout=Layout(N, L, dist.get_rank()))
    return st


def _run(rank, name, groups):
    """STEPS steps (one skipped by a NaN on rank 0), then a state-dict round trip into a fresh state and
    STEPS more, against the same 2*STEPS steps in one state."""
    torch.manual_seed(0)
    out = {}
    for mode in ("straight", "resumed"):
        m = _model()
        ddp = DDP(m, bucket_cap_mb=0.05)
        holder = [_state(name, groups)]
        holder[0].bind(m.named_parameters())
        holder[0].debug.enabled = True

        def hook(_s, bucket: dist.GradBucket, holder=holder) -> torch.futures.Future[torch.Tensor]:
            return exchange_hook(holder[0], bucket)

        ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        steps = []
        for t, (x, y) in enumerate(_batches(rank)):
            if mode == "resumed" and t == STEPS:
                buf = io.BytesIO()
                torch.save(holder[0].state_dict(), buf)
                buf.seek(0)
                holder[0] = _state(name, groups)
                holder[0].bind(m.named_parameters())
                holder[0].debug.enabled = True
                holder[0].load_state_dict(torch.load(buf, weights_only=True))
                holder[0].release_orphans()
            st = holder[0]
            ctl = StepController(st)
            before = _mass(st)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            if t == SKIP and rank == 0:
                loss = loss * float("nan")
            loss.backward()
            decision = ctl.finish_step(m.named_parameters())
            if decision is Decision.SKIP:
                opt.zero_grad()
            else:
                opt.step()
            steps.append(dict(before=before, after=_mass(st), skipped=decision is Decision.SKIP,
                              grad=_snap(st.debug.grads_in), avg={n: p.grad.reshape(-1).clone() if p.grad is not None
                                                                  else None for n, p in m.named_parameters()},
                              step=st.step))
        out[mode] = dict(steps=steps, params=_snap(m.state_dict()), mass=_mass(holder[0]),
                         sd_keys=sorted(holder[0].state_dict()["exchanges"]))
    return out


def _syncs(rank, name, groups):
    """Host syncs inside the hook on the sync-free path."""
    os.environ["LIGHTNING_TOPK_SYNC_FREE"] = "1"
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)
    st = _state(name, groups)
    st.bind(m.named_parameters())
    counter = SyncCounter()
    ddp.register_comm_hook(st, counter.wrap_hook(exchange_hook))
    ctl = StepController(st)
    with counter:
        for x, y in _batches(rank)[:3]:
            m.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            ctl.finish_step()
    os.environ.pop("LIGHTNING_TOPK_SYNC_FREE")
    return sum(counter.inside.values()), counter.hook_calls


def _auto_with_example(rank, groups):
    """auto, offered the example exchange, takes it through its own predict and trains with it."""
    from lightning_topk.comm.cost import CostModel, Link

    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)
    cfg = TopKConfig(density=0.05, min_sparse_numel=0)
    st = TopKState(cfg, hier=groups, num_nodes=N)
    st.bind(m.named_parameters())
    model = CostModel(N, L, Link(5e-6, 1e10), Link(5e-5, 1e9), 2e-9, 1e-4, 0.5e-9, 20e-9)
    cands = candidates_for(cfg, N, L, True)
    make_auto(st, model, cands, rank, groups)
    ddp.register_comm_hook(st, exchange_hook)
    for x, y in _batches(rank)[:2]:
        m.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    metrics = reduced_metrics(st.last, _Ranks())  # the Lightning strategy's telemetry, reduced over the ranks
    return cands, dict(st.exchange.plan), {n: p.grad.clone() for n, p in m.named_parameters()}, metrics, st.last.buckets


def _scenarios(rank, world):
    _register_example()
    groups = make_groups(N, L, rank)
    out = {name: _run(rank, name, groups) for name in _names()}
    out["syncs"] = {name: _syncs(rank, name, groups) for name in _names()}
    out["auto"] = _auto_with_example(rank, groups)
    return out


@pytest.fixture(scope="module")
def runs():
    res = run_distributed(_scenarios, WORLD)
    return res


def _close(a, b, tol):
    return all(torch.allclose(a[k], b[k], atol=tol, rtol=0) for k in a)


@pytest.mark.parametrize("name", _names())
def test_conservation_the_gradient_mass_is_applied_or_pending(runs, name):
    """Summed over ranks: pending after + P x applied = pending before + the local gradients, per step
    (bf16/fp16 wires lose their cast error where parameters hold no residual: a looser bound)."""
    tol = {"dense_bf16": 2e-2, "dense": 2e-2, "half_dense": 2e-3}.get(name, 1e-4)  # dense: value_dtype bf16
    for t in range(STEPS):
        ranks = [r[name]["straight"]["steps"][t] for r in runs]
        if ranks[0]["skipped"]:
            continue
        for p in ranks[0]["grad"]:
            lhs = sum(r["after"].get(p, 0) for r in ranks) + WORLD * ranks[0]["avg"][p]
            rhs = sum(r["before"].get(p, 0) + r["grad"][p] for r in ranks)
            scale = max(1.0, float(rhs.abs().max()))
            assert torch.allclose(lhs, rhs, atol=tol * scale, rtol=0), (name, t, p)
        for r in ranks[1:]:  # every rank applies the same average
            assert _close(r["avg"], ranks[0]["avg"], 0.0), (name, t)


@pytest.mark.parametrize("name", _names())
def test_a_skipped_step_is_rolled_back_bit_for_bit(runs, name):
    sparse = (HalfDense if name == "half_dense" else registry.get(name)).sparse  # (half_dense: spawned ranks only)
    for r in runs:
        steps = r[name]["straight"]["steps"]
        if sparse:  # the state a rollback must restore does change in a step that stands
            t = SKIP + 1
            assert any(not torch.equal(steps[t]["after"][k], steps[t]["before"].get(k, 0 * steps[t]["after"][k]))
                       for k in steps[t]["after"])
        s = steps[SKIP]
        assert s["skipped"] and s["step"] == r[name]["straight"]["steps"][SKIP - 1]["step"]
        assert s["after"].keys() == s["before"].keys()
        assert all(torch.equal(s["after"][k], s["before"][k]) for k in s["before"])


@pytest.mark.parametrize("name", _names())
def test_resume_from_a_state_dict_is_bit_exact(runs, name):
    for r in runs:
        a, b = r[name]["straight"], r[name]["resumed"]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), name
        assert a["mass"].keys() == b["mass"].keys()
        assert all(torch.equal(a["mass"][k], b["mass"][k]) for k in a["mass"]), name
        assert a["sd_keys"] == b["sd_keys"]
        if name in ("scatter", "hierarchical_scatter"):  # its own section carries its owner residuals
            assert name in a["sd_keys"]


@pytest.mark.parametrize("name", _names())
def test_no_host_sync_inside_the_hook_on_the_sync_free_path(runs, name):
    for r in runs:
        inside, calls = r["syncs"][name]
        assert calls > 0 and inside == 0, (name, inside)


def test_bad_options_are_named_for_every_exchange():
    _register_example()
    for name in _names():
        cls = registry.get(name)
        for kw, supported, opt in ((dict(momentum_correction=True), cls.momentum_correction, "momentum_correction"),
                                   (dict(selection_scope="parameter"), cls.parameter_scope, "selection_scope")):
            if supported:
                registry.check(TopKConfig(**kw), Layout(N, L), name)
                continue
            with pytest.raises(ValueError, match=f"(?s){opt}.*exchange='{name}'|exchange='{name}'.*{opt}"):
                registry.check(TopKConfig(**kw), Layout(N, L), name)
        if cls.min_local > 1:
            with pytest.raises(ValueError, match=f"exchange='{name}' needs more than one process per node"):
                registry.check(TopKConfig(), Layout(4, 1), name)
    with pytest.raises(ValueError, match="exchange must be one of"):
        TopKConfig(exchange="carrier_pigeon")


def test_adding_an_exchange_is_one_class_and_one_register_line(runs):
    """The example exchange, registered in this file only: a valid `exchange` option, one of auto's
    candidates, chosen by auto through its own predict, and it trains like the others."""
    for r in runs:
        cands, plan, grads, _, _ = r["auto"]
        assert "half_dense" in cands
        assert plan and set(plan.values()) == {"half_dense"}
        assert all(torch.isfinite(g).all() for g in grads.values())
    a, b = runs[0]["auto"][2], runs[1]["auto"][2]
    assert all(torch.equal(a[k], b[k]) for k in a)
    _register_example()
    assert TopKConfig(exchange="half_dense").exchange == "half_dense"
    registry.unregister("half_dense")
    assert "half_dense" not in registry.names()
    with pytest.raises(ValueError, match="exchange must be one of"):
        TopKConfig(exchange="half_dense")
    with pytest.raises(ValueError, match="is built in"):
        registry.unregister("allgather")


def test_a_registered_exchange_has_its_bucket_counter_in_telemetry(runs):
    """No telemetry code names the example exchange, yet its buckets are logged as topk/buckets_half_dense
    (reduced over the 4 ranks like the built-ins' counters, which read 0 here)."""
    for r in runs:
        metrics, buckets = r["auto"][3], r["auto"][4]
        assert buckets > 0 and metrics["topk/buckets_half_dense"] == buckets
        for name in (n for n in registry.names() if n != "half_dense"):
            assert metrics[f"topk/buckets_{name}"] == 0, name


def test_state_keeps_no_exchange_specific_attribute():
    """What belongs to one exchange lives in its object (process groups in use, collectives in flight,
    owner residuals, auto's plan), not on the shared TopKState."""
    st = TopKState(TopKConfig())
    gone = {"hier", "scatter", "scatter_pending", "owner_residuals", "_pending_owner", "owner_seen", "auto",
            "plan", "_pending_auto"}
    assert not gone & set(vars(st)) and not any(hasattr(st, a) for a in gone)
    assert math.isfinite(0.0)
    assert issubclass(registry.get("auto"), Exchange)
