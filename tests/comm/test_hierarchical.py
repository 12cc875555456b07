"""Hierarchical exchanges on 4 real gloo processes laid out as 2 nodes x 2, against their definitions: the
all-gather inter-node tier and the scale-free one (exchange="hierarchical_scatter")."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState, topk_select
from lightning_topk.comm.exchanges.hierarchical import hierarchical_topk_hook, make_groups
from tests.helpers.dist import run_distributed

L, N = 2, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 300), nn.ReLU(), nn.Linear(300, 90), nn.ReLU(), nn.Linear(90, 7))


def _expected(all_acc, density):
    """node sum -> per-shard exact top-k -> sum over nodes -> / world."""
    n = all_acc[0].numel()
    s = -(-n // L)
    out = torch.zeros(s * L)
    for node in range(N):
        node_sum = sum(all_acc[node * L + i] for i in range(L))
        node_sum = torch.cat([node_sum, node_sum.new_zeros(s * L - n)])
        for li in range(L):
            shard = node_sum[li * s:(li + 1) * s]
            k = max(1, math.ceil(density * s))
            v, i = topk_select(shard, k, "exact")
            out[li * s:(li + 1) * s].index_add_(0, i, v)
    return out[:n] / (L * N)


def _run(rank, world, density, h):
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)  # several buckets: collectives of consecutive buckets interleave
    st = TopKState(TopKConfig(density=density, min_sparse_numel=0, dense_steps=0, hierarchical=True, value_dtype="fp32"), hier=h)
    st.bind(m.named_parameters())
    layouts = {}

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        layouts[bucket.index()] = list(state.names_of(bucket.parameters()))
        return hierarchical_topk_hook(state, bucket)

    ddp.register_comm_hook(st, hook)
    params = dict(m.named_parameters())
    g = torch.Generator().manual_seed(rank)
    errors = []
    for _step in range(3):
        x, y = torch.randn(8, 40, generator=g), torch.randint(0, 7, (8,), generator=g)
        old = {k: v.clone() for k, v in st.residuals().items()}
        m.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        avg = {nm: p.grad.clone() for nm, p in params.items()}
        # what this rank's hooks saw: residual + local grad (recomputed without DDP, same params)
        m.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        err = 0.0
        for _, names in sorted(layouts.items()):
            got = torch.cat([avg[nm].reshape(-1) for nm in names])
            local = torch.cat([params[nm].grad.reshape(-1) for nm in names])
            res = torch.cat([old.get(nm, torch.zeros(params[nm].numel())) for nm in names])
            acc = res + local
            gathered = [torch.empty_like(acc) for _ in range(world)]
            dist.all_gather(gathered, acc)
            err = max(err, float((got - _expected(gathered, density)).abs().max()))
        errors.append(err)
        with torch.no_grad():
            for nm, p in params.items():
                p -= 0.1 * avg[nm]
    owned = {k: int(v.count_nonzero()) for k, v in st.residuals().items()}
    return errors, owned, st.totals, len(layouts)


def test_hierarchical_equals_definition_and_sends_fewer_inter_node_bytes(hs_runs):
    results = hs_runs["hier"]
    for errors, _owned, totals, nbuckets in results:
        assert nbuckets >= 2
        assert max(errors) < 1e-5, errors
        assert totals.bytes_inter > 0 and totals.bytes_intra > 0
    # residuals live on the shard each rank owns: disjoint supports between local ranks 0 and 1
    total_nnz = sum(sum(o.values()) for o, in [(r[1],) for r in results[:2]])
    assert total_nnz > 0


# ---- 2 "nodes" x 2 processes through Lightning's own multi-node launcher, on loopback -----------
import json  # noqa: E402
import os  # noqa: E402

from tests.helpers.procs import run_nodes  # noqa: E402


def _two_nodes(out, exchange, epochs=3):
    # recipe none: the same algorithm for every exchange (recipe='auto' gives the flat exchange momentum
    # correction, which the hierarchical ones do not support), so the runs differ by the exchange only
    run_nodes(["tests/scripts/train_probe.py", "--strategy", "topk", "--density", "0.01", "--num-nodes", "2",
               "--exchange", exchange, "--epochs", str(epochs), "--recipe", "none", "--value-dtype", "fp32",
               "--out", str(out)])
    return json.loads((out / "result.json").read_text()), [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """``exchange -> (result, per-launcher probes)`` of 2-node runs, each exchange run once for the module
    (the hierarchical one serves both the flat and the hierarchical_scatter comparison)."""
    runs = {}

    def get(exchange):
        if exchange not in runs:
            runs[exchange] = _two_nodes(tmp_path_factory.mktemp(exchange), exchange)
        return runs[exchange]

    return get


def test_two_nodes_hierarchical_converges_like_flat(two_nodes):
    hier, hranks = two_nodes("hierarchical")
    flat, franks = two_nodes("allgather")
    assert hranks[0]["hier"] == [[0, 1], [0, 2]] and hranks[1]["hier"] == [[0, 1], [1, 3]]
    assert franks[0]["hier"] is None
    for k in hranks[0]["params"]:
        assert torch.equal(hranks[0]["params"][k], hranks[1]["params"][k])
    # 3 epochs at density 0.01 are far from converged: over seeds 0-1 (native and ATEN_CPU_CAPABILITY=default) hier
    # reached 304..353 of the 398 samples, flat 299..346, hier - flat +5..+7 (issue 41)
    assert hier["val_acc"] > 0.7 and hier["val_acc"] >= flat["val_acc"] - 0.03, (hier, flat)
    # the slow link carries ~L = 2 times fewer bytes
    ratio = franks[0]["last"]["bytes_inter"] / hranks[0]["last"]["bytes_inter"]
    assert 1.7 < ratio < 2.3, ratio


# ---- SLURM: node/local ranks from the environment, and the groups built from them -------------

from lightning_topk import TopKDDPStrategy  # noqa: E402
from lightning_topk.comm.exchanges.hierarchical import layout  # noqa: E402


def _slurm_env(monkeypatch, procid, ntasks=4, per_node=2, nodes=2):
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % per_node), "SLURM_NODEID": str(procid // per_node),
        "SLURM_NNODES": str(nodes), "SLURM_NODELIST": "node[001-002]",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("procid", [0, 1, 2, 3])
def test_slurm_environment_gives_ranks_and_groups(monkeypatch, procid):
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.environments import SLURMEnvironment

    _slurm_env(monkeypatch, procid)
    t = pl.Trainer(strategy=TopKDDPStrategy(density=0.01, exchange="hierarchical"), accelerator="cpu", devices=2,
                   num_nodes=2, logger=False)
    s = t.strategy
    assert isinstance(s.cluster_environment, SLURMEnvironment)
    assert (s.node_rank, s.local_rank, s.global_rank, s.world_size) == (procid // 2, procid % 2, procid, 4)
    assert s._use_hierarchical()
    intra, inter = layout(s.num_nodes, s.num_processes, s.world_size)
    assert s.global_rank in intra[s.node_rank] and s.global_rank in inter[s.local_rank]
    assert intra == [[0, 1], [2, 3]] and inter == [[0, 2], [1, 3]]


def test_slurm_allocation_disagreeing_with_devices_fails_before_training(monkeypatch):
    import pytorch_lightning as pl
    from pytorch_lightning.demos.boring_classes import BoringModel

    _slurm_env(monkeypatch, 0, ntasks=4, per_node=2)
    for strategy in (TopKDDPStrategy(), TopKDDPStrategy(start_method="spawn")):
        with pytest.raises(ValueError, match="ntasks-per-node=2"):  # at construction, before any process starts
            t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, num_nodes=1, logger=False, max_steps=1)
            t.fit(BoringModel())


# ---- exchange="hierarchical_scatter": the scale-free exchange as the inter-node tier ---------------
from lightning_topk.comm import cost  # noqa: E402
from lightning_topk.comm.exchanges.auto import auto_topk_hook  # noqa: E402
from lightning_topk.comm.exchanges.hierarchical import hierarchical_scatter_topk_hook  # noqa: E402
from lightning_topk.comm.exchanges.scatter import (  # noqa: E402
    bucket_key,
    fold_owner_residual,
    global_index,
    regions,
    scatter_wire,
    slot_plan,
)
from lightning_topk.comm.wire import packed_nbytes, ring_allgather_wire, ring_reduce_scatter_wire  # noqa: E402
from tests.helpers.exchanges import make_auto  # noqa: E402

HS = dict(density=0.05, min_sparse_numel=0, exchange="hierarchical_scatter", value_dtype="fp32")  # exact sums


def _snap(d):
    return {k: v.detach().clone() for k, v in d.items()}


def _hs_state(h, m, **kw):
    st = TopKState(TopKConfig(**dict(HS, **kw)), hier=h)
    st.bind(m.named_parameters())
    return st


def _hs_step(ddp, m, st, x, y, scale=1.0):
    old, old_owner = _snap(st.residuals()), _snap(_owners(st).live)
    for p in m.parameters():
        p.grad = None
    (nn.functional.cross_entropy(ddp(x), y) * scale).backward()
    return dict(old=old, new=_snap(st.residuals()), sent=_snap(st.debug.sent), grad=_snap(st.debug.grads_in),
                after={nm: p.grad.detach().reshape(-1).clone() for nm, p in m.named_parameters()},
                old_owner=old_owner, new_owner=_snap(_owners(st).live))


def _hs_train(rank, h, steps=3):
    """Pinned hierarchical_scatter: per step, residuals and owner residuals before/after, what this rank
    sent, its gradient, the result, and each bucket's (names, numel)."""
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)
    st = _hs_state(h, m)
    st.debug.enabled = True
    layouts = {}

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        layouts.setdefault(state.step, []).append((list(state.names_of(bucket.parameters())), bucket.buffer().numel()))
        return hierarchical_scatter_topk_hook(state, bucket)

    ddp.register_comm_hook(st, hook)
    g = torch.Generator().manual_seed(rank)
    hist = []
    for _ in range(steps):
        x, y = torch.randn(8, 40, generator=g), torch.randint(0, 7, (8,), generator=g)
        rec = _hs_step(ddp, m, st, x, y)
        rec["stats"] = st.last
        hist.append(rec)
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    return dict(hist=hist, layouts=layouts)




def _owners(st):
    """The owner residuals of the hierarchical scale-free exchange of ``st``."""
    return st.exchange_for("hierarchical_scatter").owners


def _hs_auto_switch(rank, h):
    """exchange="auto" running hierarchical_scatter for 3 steps, then every bucket switched to the flat
    all-gather: the owner residuals must come back into the rank residuals."""
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)
    st = _hs_state(h, m, exchange="auto")
    st.debug.enabled = True
    model = cost.CostModel(N, L, cost.Link(5e-6, 1e10), cost.Link(5e-5, 1e6), 2e-9, 1e-4, 0.5e-9, 20e-9)
    auto = make_auto(st, model, ["hierarchical_scatter"], rank)
    ddp.register_comm_hook(st, auto_topk_hook)
    g = torch.Generator().manual_seed(rank)
    hist = []
    for t in range(4):
        if t == 3:
            auto.candidates, auto.plan = ["allgather"], {}
        x, y = torch.randn(8, 40, generator=g), torch.randint(0, 7, (8,), generator=g)
        rec = _hs_step(ddp, m, st, x, y)
        rec["stats"] = st.last
        hist.append(rec)
    return hist


def _scenarios(rank, world):
    h = make_groups(N, L, rank)  # one set of groups (and one spawn) for every scenario
    return {"hier": _run(rank, world, 0.05, h), "train": _hs_train(rank, h), "auto": _hs_auto_switch(rank, h)}


@pytest.fixture(scope="module")
def hs_runs():
    res = run_distributed(_scenarios, L * N)
    return {key: [r[key] for r in res] for key in res[0]}


def _hs_reference(ranks, t):
    """Step t by hand: node sums of (old residual + gradient), exact top-k of each shard, the picks summed per
    owner region onto the old owner residual, each owner's exact top k/(L N) forwarded, divided by the world."""
    want = {}
    for names, n in ranks[0]["layouts"][t]:
        numels = [ranks[0]["hist"][t]["grad"][nm].numel() for nm in names]
        s = -(-n // L)
        k = max(1, math.ceil(0.05 * s))
        plan = slot_plan(s, k, N)
        acc = [torch.cat([r["hist"][t]["old"].get(nm, torch.zeros(c)) + r["hist"][t]["grad"][nm]
                          for nm, c in zip(names, numels)]) for r in ranks]
        out = torch.zeros(s * L)
        for li in range(L):
            owner = [ranks[node * L + li]["hist"][t]["old_owner"].get(
                bucket_key(N, node, names, numels, li, L), torch.zeros(plan.region)).clone() for node in range(N)]
            for node in range(N):
                node_sum = sum(acc[node * L + j] for j in range(L))
                shard = torch.cat([node_sum, node_sum.new_zeros(s * L - n)])[li * s:(li + 1) * s]
                v, i = topk_select(shard, k, "exact")
                r, pos = regions(i, plan)
                assert int(torch.bincount(r, minlength=N).max()) <= plan.slot  # no slot overflows here
                for o in range(N):
                    owner[o].index_add_(0, pos[r == o], v[r == o])
            for o in range(N):
                fv, q = topk_select(owner[o], plan.out, "exact")
                out[li * s:(li + 1) * s].index_add_(0, global_index(o, q, plan), fv)
        want.update(zip(names, (out[:n] / (L * N)).split(numels)))
    return want


def test_hierarchical_scatter_equals_a_reference_by_hand(hs_runs):
    ranks = hs_runs["train"]
    for t in range(len(ranks[0]["hist"])):
        want = _hs_reference(ranks, t)
        assert want.keys() == ranks[0]["hist"][t]["after"].keys()
        for r in ranks:
            for nm, w in want.items():
                assert torch.allclose(r["hist"][t]["after"][nm], w, atol=1e-6, rtol=1e-5), (t, nm)
    assert any(o.any() for r in ranks for o in r["hist"][-1]["new_owner"].values())  # owners kept some


def _conserved(ranks_hist, atol=1e-5):
    """Over all ranks: old residuals + gradients + old owner residuals = world x the applied average + new
    residuals + new owner residuals (owner residuals at their bucket coordinates)."""
    world = len(ranks_hist)
    names = list(ranks_hist[0]["grad"])
    lhs = {nm: sum(h["old"].get(nm, torch.zeros_like(h["grad"][nm])) + h["grad"][nm] for h in ranks_hist) for nm in names}
    rhs = {nm: world * ranks_hist[0]["after"][nm] + sum(h["new"][nm] for h in ranks_hist) for nm in names}
    for h in ranks_hist:
        for which, side in (("old_owner", lhs), ("new_owner", rhs)):
            for key, ores in h[which].items():
                for nm, v in fold_owner_residual(key, ores).items():
                    side[nm] = side[nm] + v
    for nm in names:
        assert torch.allclose(lhs[nm], rhs[nm], atol=atol, rtol=1e-5), nm


def test_hierarchical_scatter_conserves_what_ranks_and_owners_hold(hs_runs):
    ranks = hs_runs["train"]
    for t in range(len(ranks[0]["hist"])):
        _conserved([r["hist"][t] for r in ranks])
    # step 0: residuals live on the shard each rank owns, and what a rank sent comes from it (later, owner
    # residuals of DDP's first-iteration buckets fold back wherever their coordinates now lie)
    for t in (0,):
        for rank, r in enumerate(ranks):
            h = r["hist"][t]
            for names, n in r["layouts"][t]:
                s = -(-n // L)
                sent = torch.cat([h["sent"][nm] for nm in names])
                res = torch.cat([h["new"][nm] for nm in names])
                mine = torch.zeros(n, dtype=torch.bool)
                mine[(rank % L) * s:(rank % L + 1) * s] = True
                assert not sent[~mine].any() and not res[~mine].any()


def test_hierarchical_scatter_wire_bytes_follow_the_formula(hs_runs):
    eb = packed_nbytes(1, torch.float32)
    for r in hs_runs["train"]:
        stats, layout = r["hist"][-1]["stats"], r["layouts"][len(r["hist"]) - 1]
        wire = inter = 0
        for _names, n in layout:
            s = -(-n // L)
            plan = slot_plan(s, max(1, math.ceil(0.05 * s)), N)
            # intra-node reduce-scatter and all-gather of the fp32 shard, the scale-free exchange among N
            wire += ring_reduce_scatter_wire(4 * s * L, L) + scatter_wire(plan, eb) + ring_allgather_wire(4 * s, L)
            inter += (N * plan.slot + plan.out) * eb
            assert scatter_wire(plan, eb) == (N - 1) * (plan.slot + plan.out) * eb
        assert stats.bytes_wire == wire and stats.bytes_inter == inter
        assert stats.buckets_via("hierarchical_scatter") == stats.buckets == len(layout)
        assert stats.as_metrics()["topk/buckets_hierarchical_scatter"] == len(layout)
    # per-rank inter-node bytes of the scale-free tier do not grow with the node count (the all-gather's do)
    s, ks = 1_000_000, 10_000
    for nodes in (2, 4, 16, 64):
        w = scatter_wire(slot_plan(s, ks, nodes), eb)
        assert 2 * ks * eb * (nodes - 1) / nodes <= w <= (2 + 4 / math.sqrt(ks / nodes)) * ks * eb < 2.4 * ks * eb




def test_auto_switching_away_from_hierarchical_scatter_keeps_owner_residuals(hs_runs):
    ranks = hs_runs["auto"]
    for r in ranks:
        assert r[2]["stats"].buckets_via("hierarchical_scatter") == r[2]["stats"].buckets > 0
        assert r[3]["stats"].buckets_via("allgather") == r[3]["stats"].buckets
        assert any(t.any() for t in r[3]["old_owner"].values()) and not r[3]["new_owner"]
    for t in range(4):
        _conserved([r[t] for r in ranks])


def test_hierarchical_scatter_options_fail_fast_naming_the_option():
    for kw, match in ((dict(momentum_correction=True), "momentum_correction is not supported with exchange='hierarchical_scatter'"),
                      (dict(selection_scope="parameter"),
                       "selection_scope='parameter' is not supported with exchange='hierarchical_scatter'"),
                      (dict(hierarchical=False), "hierarchical=false contradicts exchange='hierarchical_scatter'"),
                      (dict(hierarchical=True), "hierarchical=true contradicts exchange='hierarchical_scatter'")):
        with pytest.raises(ValueError, match=match):
            TopKConfig(exchange="hierarchical_scatter", **kw)
    with pytest.raises(ValueError, match="exchange='hierarchical_scatter' needs more than one process per node"):
        TopKConfig(exchange="hierarchical_scatter").use_hierarchical(2, 1)
    s = TopKDDPStrategy(exchange="hierarchical_scatter")
    s._num_nodes = 2
    s.parallel_devices = [torch.device("cpu")] * 2
    assert s._exchange() == "hierarchical_scatter"
    s = TopKDDPStrategy(hierarchical=True)
    s._num_nodes = 2
    s.parallel_devices = [torch.device("cpu")] * 2
    assert s._exchange() == "hierarchical"


@pytest.mark.slow
def test_two_nodes_hierarchical_scatter_trains_like_hierarchical(two_nodes):
    """Through Lightning's launcher (the strategy picks the hook): digits, 2 nodes x 2, 3 epochs. The margin comes
    from the spread over seeds: hierarchical_scatter minus hierarchical was -0.033, +0.068, +0.028, -0.083 at seeds
    0-3 here and +1..+21 samples of 398 at seeds 0-1 in another run (hierarchical alone 0.76-0.94; 2026-11-28), so
    one run is within 0.12 of the other; a broken exchange (chance: 0.1) is far below 0.7."""
    hs, hsranks = two_nodes("hierarchical_scatter")
    hier, _ = two_nodes("hierarchical")
    assert hsranks[0]["hier"] == [[0, 1], [0, 2]] and hsranks[1]["hier"] == [[0, 1], [1, 3]]
    assert hsranks[0]["last"]["buckets_by"].get("hierarchical_scatter", 0) > 0
    assert hs["val_acc"] > 0.7 and abs(hs["val_acc"] - hier["val_acc"]) <= 0.12, (hs, hier)
