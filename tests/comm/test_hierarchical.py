"""Hierarchical exchange on 4 real gloo processes laid out as 2 nodes x 2, against its definition."""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState, topk_select
from lightning_topk.comm.hierarchical import hierarchical_topk_hook, make_groups
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


def _run(rank, world, density):
    h = make_groups(N, L, rank)
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)  # several buckets: collectives of consecutive buckets interleave
    st = TopKState(TopKConfig(density=density, min_sparse_numel=0, dense_steps=0, hierarchical=True), hier=h)
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


def test_hierarchical_equals_definition_and_sends_fewer_inter_node_bytes():
    results = run_distributed(_run, L * N, (0.05,))
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
    run_nodes(["tests/scripts/train_probe.py", "--strategy", "topk", "--density", "0.01", "--num-nodes", "2",
               "--exchange", exchange, "--epochs", str(epochs), "--out", str(out)])
    return json.loads((out / "result.json").read_text()), [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_two_nodes_hierarchical_converges_like_flat(tmp_path):
    hier, hranks = _two_nodes(tmp_path / "hier", "hierarchical")
    flat, franks = _two_nodes(tmp_path / "flat", "allgather")
    assert hranks[0]["hier"] == [[0, 1], [0, 2]] and hranks[1]["hier"] == [[0, 1], [1, 3]]
    assert franks[0]["hier"] is None
    for k in hranks[0]["params"]:
        assert torch.equal(hranks[0]["params"][k], hranks[1]["params"][k])
    assert hier["val_acc"] > 0.8 and hier["val_acc"] >= flat["val_acc"] - 0.03, (hier, flat)
    # the slow link carries ~L = 2 times fewer bytes
    ratio = franks[0]["last"]["bytes_inter"] / hranks[0]["last"]["bytes_inter"]
    assert 1.7 < ratio < 2.3, ratio


# ---- SLURM: node/local ranks from the environment, and the groups built from them -------------
import pytest  # noqa: E402

from lightning_topk import TopKDDPStrategy  # noqa: E402
from lightning_topk.comm.hierarchical import layout  # noqa: E402


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
