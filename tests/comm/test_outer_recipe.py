"""Local SGD's outer step (issue 31): ``outer_recipe`` against torch's own post-local SGD averager on real gloo
processes, the measured table and pinned options, the one-replica rule, the amplification guard, the scale-free
owners' ``outer_ef_decay``, per-step residuals carried into the outer error feedback, and a reshard decided by the
resolved outer exchange, not its spelling."""
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from lightning_topk.comm.local import OUTER_RECIPE_TABLE, OuterState, outer_step_for
from lightning_topk.comm.state import TopKConfig, TopKState
from tests.helpers.dist import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _vs_periodic_averager(rank, world):
    """outer_recipe="auto" (the default) with SGD-momentum inner steps, dense fp32 values, H=3: the outer round is
    torch's PeriodicModelAverager (post-local SGD: plain averaging, each replica keeps its own momentum)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    H = 3
    torch.manual_seed(10 + rank)
    data = [(torch.randn(16, 20), torch.randint(0, 5, (16,))) for _ in range(9)]
    m, ref = _model(), _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    st = OuterState(TopKConfig(local_steps=H, outer_density=1.0, outer_value_bits=32), list(m.named_parameters()),
                    optimizers=[opt])
    averager = PeriodicModelAverager(period=H, warmup_steps=H - 1)  # averages after steps H, 2H, ... as ours
    for x, y in data:
        for net, o in ((m, opt), (ref, ropt)):
            o.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            o.step()
        st.step()
        averager.average_parameters(ref.parameters())
    return _flat(m), _flat(ref), (st.rule.lr, st.rule.momentum, st.rule.identity), st.stats.rounds


def test_auto_outer_step_for_sgd_momentum_is_torchs_periodic_model_averaging():
    out = run_distributed(_vs_periodic_averager, world=2)
    for got, ref, rule, rounds in out:
        assert rule == (1.0, 0.0, False) and rounds == 3
        assert torch.allclose(got, ref, rtol=0, atol=2e-6), float((got - ref).abs().max())
    assert not torch.allclose(out[0][1], _flat(_model()))  # it trained


def test_outer_step_for_reads_the_table_and_set_options_win():
    net = _model()
    sgdm = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)]
    adamw = [torch.optim.AdamW(net.parameters())]
    cfg = TopKConfig(local_steps=4)
    assert cfg.outer_lr is None and cfg.outer_momentum is None and cfg.outer_nesterov is None
    lr, mu, nest = OUTER_RECIPE_TABLE["sgd_momentum"]
    assert (lr, mu) == (1.0, 0.0)  # DiLoCo's outer momentum diverged with these inner steps (issue 31)
    s = outer_step_for(cfg, sgdm, 2)
    assert (s.lr, s.momentum, s.nesterov, s.identity) == (lr, mu, nest, False)
    a = outer_step_for(cfg, adamw, 2)
    assert (a.lr, a.momentum) == OUTER_RECIPE_TABLE["adamw"][:2]
    # set options win one by one; the others still come from the recipe
    p = outer_step_for(TopKConfig(local_steps=4, outer_momentum=0.5), sgdm, 2)
    assert (p.lr, p.momentum) == (lr, 0.5) and "outer_momentum as set" in p.why
    # named recipes, an unknown optimizer (plain averaging), streaming (no outer momentum from the recipe)
    d = outer_step_for(TopKConfig(local_steps=4, outer_recipe="diloco"), sgdm, 2)
    assert (d.lr, d.momentum, d.nesterov) == (0.7, 0.9, True)
    u = outer_step_for(cfg, [torch.optim.Adagrad(net.parameters())], 2)
    assert (u.lr, u.momentum) == (1.0, 0.0)
    assert outer_step_for(TopKConfig(local_steps=4, outer_recipe="diloco"), None, 2).momentum == 0.9
    assert outer_step_for(TopKConfig(local_steps=4, outer_streaming=True), [torch.optim.Adam(net.parameters())],
                          2).momentum == 0.0
    with pytest.raises(ValueError, match="outer_recipe"):
        TopKConfig(local_steps=4, outer_recipe="lookahead")


def test_one_replica_under_the_default_recipe_is_plain_training():
    """One node (one replica): the outer round is the identity, so local SGD is the node's own training (DDP
    across its processes), whatever the inner optimizer; a set outer option takes an outer step again."""
    def train(with_outer, **kw):
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        st = OuterState(TopKConfig(local_steps=2, **kw), list(m.named_parameters()), optimizers=[opt]) \
            if with_outer else None
        torch.manual_seed(1)
        for _ in range(8):
            x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            if st is not None:
                st.step()
        return _flat(m), st

    plain, _ = train(False)
    local, st = train(True)
    assert st.rule.identity and st.stats.rounds == 4 and st.stats.bytes == 0
    assert torch.equal(local, plain)
    assert torch.equal(st.theta[:plain.numel()], plain) and float(st.ef.abs().sum()) == 0.0
    pinned, st2 = train(True, outer_lr=0.7, outer_momentum=0.9)
    assert not st2.rule.identity and not torch.equal(pinned, plain)


def test_amplification_guard_warns_once_naming_the_options(caplog):
    """Every round the replica moves by the same vector d; DiLoCo's Nesterov momentum (pinned) then moves
    θ_outer ever further per round (up to 0.7 / (1 - 0.9) = 7x d) and the weights grow: said once. Plain averaging
    (ratio 1) never is, however far the weights go."""
    def rounds(n, **kw):
        m = _model()
        st = OuterState(TopKConfig(local_steps=1, outer_density=1.0, outer_value_bits=32, **kw),
                        list(m.named_parameters()))
        d = torch.randn(_flat(m).numel()) * 0.05
        for _ in range(n):
            with torch.no_grad():
                off = 0
                for p in m.parameters():
                    p.sub_(d[off:off + p.numel()].view_as(p))
                    off += p.numel()
            st.step()
        return st

    caplog.set_level(logging.WARNING, logger="lightning_topk.comm.local.outer_step")
    st = rounds(20, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)
    hits = [r for r in caplog.records if "amplifying" in r.getMessage()]
    assert len(hits) == 1 and st.guard.warned and st.guard.last_ratio > 2 and st.guard.last_growth > 6
    msg = hits[0].getMessage()
    assert "outer_recipe" in msg and "outer_momentum" in msg and "outer_lr=0.7" in msg
    caplog.clear()
    avg = rounds(20, outer_recipe="average")
    assert not avg.guard.warned and avg.guard.last_ratio == pytest.approx(1.0, abs=1e-4) and avg.guard.last_growth > 6
    assert not [r for r in caplog.records if "amplifying" in r.getMessage()]


def _scatter_decay(rank, world):
    """Scale-free exchange pinned, outer_ef_decay=0, 2% at 4 bits: after a round with a pseudo-gradient, a round
    in which no replica moved sends nothing (the owners' buffers decay to zero as the replicas' do)."""
    m = _model()
    st = OuterState(TopKConfig(local_steps=1, outer_density=0.02, outer_chunk=256, outer_value_bits=4,
                               outer_ef_decay=0.0, outer_exchange="scatter", outer_recipe="average"),
                    list(m.named_parameters()))
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    st.step()
    owner = float(st.owner_ef.abs().sum())
    after_first = _flat(m).clone()
    st.step()  # nobody moved: Δ = 0 on every replica
    return st.exchange, owner, torch.equal(_flat(m), after_first)


def test_scatter_owners_honour_outer_ef_decay():
    out = run_distributed(_scatter_decay, world=2)
    for exchange, owner, unchanged in out:
        assert exchange == "scatter" and owner > 0  # the owners kept what they did not send...
        assert unchanged  # ...and with outer_ef_decay=0 do not send it again


def test_per_step_residuals_are_carried_into_the_outer_error_feedback(caplog):
    """A checkpoint of the per-step exchange (local_steps=0) resumed under local SGD: its residuals (gradient
    mass not sent yet) become outer error feedback, times the inner SGD lr; with AdamW they are dropped and the
    warning says how much."""
    from lightning_topk.comm.local.exchange import LocalExchange

    caplog.set_level(logging.WARNING, logger="lightning_topk.comm.local.exchange")
    m = _model()
    res = {n: torch.randn(p.numel()) for n, p in m.named_parameters()}
    sd = {"step": 7, "residual": res, "velocity": {}}
    for opt, lr in ((torch.optim.SGD(m.parameters(), lr=0.05), 0.05), (torch.optim.AdamW(m.parameters()), 0.0)):
        state = TopKState(TopKConfig(local_steps=4))
        state.load_state_dict(sd)
        ex = LocalExchange(state)
        ex.bind(m.named_parameters(), optimizers=[opt])
        want = torch.cat([res[n] for n, _ in m.named_parameters()]) * lr
        assert torch.allclose(ex.outer.ef[:want.numel()], want), type(opt).__name__
    msgs = [r.getMessage() for r in caplog.records]
    assert any("residuals" in x and "times the inner lr" in x for x in msgs)
    assert any("were dropped" in x and "AdamW" in x and "L2 norm" in x for x in msgs)


def test_reshard_is_decided_by_the_resolved_outer_exchange_not_its_spelling():
    """4 nodes x 1: "auto" resolves to the scale-free exchange at topk_local's settings. Resumed with "scatter"
    pinned it is the same exchange: no reshard (the resume stays exact); with "allgather", or 2-bit values under
    "auto" (which then resolves to the all-gather), it is resharded."""
    from dataclasses import asdict

    from lightning_topk.lightning.checkpoint import _local_reshard

    model = nn.Sequential(nn.Linear(300, 100))  # 30,100 entries: 8 chunks of 4096
    strategy = SimpleNamespace(world_size=4, num_nodes=4, num_processes=1, lightning_module=model)
    saved = TopKConfig(local_steps=16)
    meta = {"world_size": 4, "num_nodes": 4, "local_world_size": 1, "config": asdict(saved)}
    assert not _local_reshard(TopKConfig(local_steps=16, outer_exchange="scatter"), meta, strategy)
    assert not _local_reshard(TopKConfig(local_steps=16), meta, strategy)
    assert _local_reshard(TopKConfig(local_steps=16, outer_exchange="allgather"), meta, strategy)
    assert _local_reshard(TopKConfig(local_steps=16, outer_value_bits=2), meta, strategy)
    # and the other way round: a pinned "scatter" saved, "auto" (resolving to it) resumed
    meta["config"] = asdict(TopKConfig(local_steps=16, outer_exchange="scatter"))
    assert not _local_reshard(TopKConfig(local_steps=16), meta, strategy)
