"""Parameters DDP marks unused in a backward (``find_unused_parameters=True``) keep their error feedback, for
every per-bucket exchange of the registry. DDP hands such a parameter's bucket slice over as zeros and, when no
rank used it, never writes the bucket's result back into its ``.grad`` (it stays None and the optimizer skips
it), so whatever an exchange sent from its residual there would be lost.

One start of 4 real gloo processes (2 nodes x 2, so the hierarchical exchanges run too); on each, a model whose
branch ``a`` is used by every rank, by some ranks or by none depending on the step, ``b`` on even steps only and
``c`` never. The local gradients are read with tensor hooks on the parameters (not the exchanges' debug record)."""
import os

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState
from lightning_topk.comm.controller import StepController
from lightning_topk.comm.cost import CostModel, Link
from lightning_topk.comm.exchanges import Layout, exchange_hook
from lightning_topk.comm.exchanges.auto import candidates_for
from lightning_topk.comm.exchanges.hierarchical import make_groups
from lightning_topk.comm.exchanges.scatter import fold_owner_residual
from tests.helpers.dist import run_distributed
from tests.helpers.exchanges import make_auto, owner_residuals
from tests.helpers.syncs import SyncCounter

N, L = 2, 2
WORLD = N * L
STEPS = 4  # t % 4 runs every usage pattern once
# name -> (exchange of the first steps, exchange after them, TopKConfig options). The dense ones start sparse
# so that their parameters hold residuals when they take over.
SCENARIOS = {
    "allgather": ("allgather", "allgather", {}),
    "allgather_parameter_scope": ("allgather", "allgather", dict(selection_scope="parameter")),
    "allgather_momentum_correction": ("allgather", "allgather", dict(momentum_correction=True)),
    "scatter": ("scatter", "scatter", {}),
    "hierarchical": ("hierarchical", "hierarchical", {}),
    "hierarchical_scatter": ("hierarchical_scatter", "hierarchical_scatter", {}),
    "auto": ("auto", "auto", {}),
    "dense": ("allgather", "dense", dict(value_dtype="fp32")),
    "dense_bf16": ("allgather", "dense_bf16", {}),
}
SWITCH = 3  # steps before the second exchange takes over
FLAT = ("allgather", "allgather_parameter_scope", "allgather_momentum_correction", "scatter", "dense",
        "dense_bf16")


def uses(t, rank):
    """Which branches rank ``rank`` runs at step ``t``: ``a`` by all (t % 4 == 0), by even or odd ranks only
    (1, 2), by none (3); ``b`` by all on even steps, by none on odd ones; ``c`` never."""
    phase = t % 4
    a = phase == 0 or (phase == 1 and rank % 2 == 0) or (phase == 2 and rank % 2 == 1)
    return a, t % 2 == 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 48)
        self.a = nn.Linear(48, 10)
        self.head = nn.Linear(48, 10)
        self.b = nn.Linear(48, 10)
        self.c = nn.Linear(48, 10)

    def forward(self, x, use_a, use_b):
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        if use_a:
            out = out + self.a(h)
        if use_b:
            out = out + 0.5 * self.b(h)
        return out


def _mass(st):
    """This rank's pending error feedback per parameter: its residuals plus its owner residuals folded."""
    out = {k: v.detach().clone().double() for k, v in st.residuals().items()}
    for key, t in owner_residuals(st).items():
        for name, v in fold_owner_residual(key, t).items():
            out[name] = out[name] + v.double() if name in out else v.double()
    return out


def _state(name, groups, rank, **kw):
    cfg = TopKConfig(density=0.05, min_sparse_numel=0, recipe="none", **kw)
    st = TopKState(cfg, hier=groups, num_nodes=N)
    if name == "auto":  # a 1 MB/s inter-node link: the sparse exchanges win
        model = CostModel(N, L, Link(5e-6, 1e10), Link(50e-6, 1e6), 2e-9, 1e-4, 0.5e-9, 20e-9)
        make_auto(st, model, candidates_for(cfg, N, L, True), rank, groups)
    else:
        st.exchange = st.exchange_for(name, layout=Layout(N, L, rank))
    return st


def _run(rank, scenario, groups, sync_free=False):
    first, then, kw = SCENARIOS[scenario]
    torch.manual_seed(0)
    m = Net()
    ddp = DDP(m, bucket_cap_mb=0.004, find_unused_parameters=True)
    st = _state(first, groups, rank, **kw)
    st.bind(m.named_parameters())
    counter = SyncCounter()
    ddp.register_comm_hook(st, counter.wrap_hook(exchange_hook) if sync_free else exchange_hook)
    ctl = StepController(st)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    local = {}
    for n, p in m.named_parameters():
        p.register_hook(lambda g, n=n: local.__setitem__(n, g.detach().double().clone()))
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for t in range(STEPS):
        if t == SWITCH and then != first:
            st.exchange = st.exchange_for(then, layout=Layout(N, L, rank))
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        before = _mass(st)
        raw_before = {k: v.clone() for k, v in st.residuals().items()}
        vel_before = {k: v.clone() for k, v in st.velocities().items()}
        local.clear()
        opt.zero_grad(set_to_none=True)
        if sync_free:
            with counter:
                nn.functional.cross_entropy(ddp(x, *uses(t, rank)), y).backward()
        else:
            nn.functional.cross_entropy(ddp(x, *uses(t, rank)), y).backward()
        ctl.finish_step(m.named_parameters())
        applied = {n: None if p.grad is None else p.grad.detach().double().clone() for n, p in m.named_parameters()}
        opt.step()
        steps.append(dict(before=before, after=_mass(st), grad=dict(local), applied=applied,
                          raw_before=raw_before, raw_after={k: v.clone() for k, v in st.residuals().items()},
                          vel_before=vel_before, vel_after={k: v.clone() for k, v in st.velocities().items()}))
    shapes = {n: p.numel() for n, p in m.named_parameters()}
    return dict(steps=steps, shapes=shapes, syncs=sum(counter.inside.values()) if sync_free else None,
                hook_calls=counter.hook_calls if sync_free else None)


def _scenarios(rank, world):
    groups = make_groups(N, L, rank)
    out = {name: _run(rank, name, groups) for name in SCENARIOS}
    os.environ["LIGHTNING_TOPK_SYNC_FREE"] = "1"
    out["sync_free"] = {name: _run(rank, name, groups, sync_free=True)
                        for name in ("allgather", "hierarchical_scatter")}
    os.environ.pop("LIGHTNING_TOPK_SYNC_FREE")
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, WORLD)


def _flat(d, name, n):
    v = d.get(name)
    return torch.zeros(n, dtype=torch.float64) if v is None else v.reshape(-1).double()


def _globally_unused(t):
    """Parameters no rank used at step ``t``."""
    out = {"c"}
    if not any(uses(t, r)[0] for r in range(WORLD)):
        out.add("a")
    if not any(uses(t, r)[1] for r in range(WORLD)):
        out.add("b")
    return {f"{m}.{k}" for m in out for k in ("weight", "bias")}


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "allgather_momentum_correction"])
def test_error_feedback_mass_is_conserved_with_unused_parameters(runs, name):
    """Per step and parameter, summed over ranks: pending after + P x applied = pending before + local gradients,
    where ``applied`` is the ``.grad`` DDP left (None: nothing reaches the parameter)."""
    shapes = runs[0][name]["shapes"]
    worst = 0.0
    for t in range(STEPS):
        ranks = [r[name]["steps"][t] for r in runs]
        for p, n in shapes.items():
            applied = ranks[0]["applied"][p]
            lhs = sum(_flat(r["after"], p, n) for r in ranks) + WORLD * _flat(ranks[0]["applied"], p, n)
            rhs = sum(_flat(r["before"], p, n) + _flat(r["grad"], p, n) for r in ranks)
            scale = max(float(rhs.abs().max()), 1e-3)
            err = float((lhs - rhs).abs().max()) / scale
            worst = max(worst, err)
            tol = 2e-2 if name == "dense_bf16" else 1e-6  # bf16 all-reduce: the sum of bf16 values is rounded
            assert err <= tol, (name, t, p, err, applied is None)
            for r in ranks[1:]:  # every rank applies the same (or nothing)
                assert (r["applied"][p] is None) == (applied is None), (name, t, p)
    print(f"{name}: worst relative conservation error {worst:.2e}")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_parameter_no_rank_used_keeps_its_residual(runs, name):
    """Where no rank used a parameter, its pending mass is unchanged: bit for bit on each rank for the flat
    exchanges (velocity too, under momentum correction); summed over the node for the hierarchical ones, whose
    intra-node reduce-scatter moves every rank's residual into the shard's owner."""
    shapes = runs[0][name]["shapes"]
    held = 0
    for t in range(STEPS):
        ranks = [r[name]["steps"][t] for r in runs]
        for p in _globally_unused(t):
            assert all(r["applied"][p] is None for r in ranks), (name, t, p)
            if name in FLAT:
                for r in ranks:
                    if p in r["raw_before"]:
                        assert torch.equal(r["raw_after"][p], r["raw_before"][p]), (name, t, p)
                        held += bool(r["raw_before"][p].any())
                    if p in r["vel_before"]:
                        assert torch.equal(r["vel_after"][p], r["vel_before"][p]), (name, t, p)
            else:
                n = shapes[p]
                before = sum(_flat(r["before"], p, n) for r in ranks)
                after = sum(_flat(r["after"], p, n) for r in ranks)
                assert torch.allclose(after, before, rtol=0, atol=1e-7 * max(1e-3, float(before.abs().max()))), \
                    (name, t, p)
                held += bool(before.any())
        for r in ranks:  # never used: never any mass
            for p in ("c.weight", "c.bias"):
                assert not _flat(r["after"], p, shapes[p]).any(), (name, t, p)
    assert held > 0, name  # the check had something to keep


@pytest.mark.parametrize("name", ["allgather", "hierarchical_scatter"])
def test_no_host_sync_inside_the_hook_with_unused_parameters(runs, name):
    for r in runs:
        got = r["sync_free"][name]
        assert got["hook_calls"] > 0 and got["syncs"] == 0, (name, got["syncs"])
