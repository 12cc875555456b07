"""The torch-only pieces of topk_fsdp (:mod:`lightning_topk.comm.sharded`, :mod:`lightning_topk.comm.shard`) on real
gloo processes: the mesh's layout check, the sharding rule, and the per-step exchange on FSDP2 gradient shards
against torch's own HSDP without Lightning."""
import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l1, self.l2, self.n = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(self.n(x))))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Linear(8, d), nn.ModuleList([Block(d), Block(d)]), nn.Linear(d, 3)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class Holder(nn.Module):  # a LightningModule-like holder: FSDP's roots are its children
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(d)


def _bad_layout(rank, world):
    from lightning_topk.comm.sharded import make_mesh

    with pytest.raises(ValueError, match=r"num_nodes=3 x devices=1 .* world size \(2\)"):
        make_mesh("cpu", 3, 1)
    return True


def test_a_layout_that_does_not_make_the_world_is_refused():
    assert run_distributed(_bad_layout, 2) == [True, True]


def _train(rank, world, mode, density, nodes=2):
    from torch.distributed.fsdp import fully_shard

    from lightning_topk.comm.config import TopKConfig
    from lightning_topk.comm.sharded import ShardedTopK, make_mesh, shard_model

    h = Holder()
    mesh = make_mesh("cpu", nodes, world // nodes)
    if mode == "hsdp":
        for b in h.net.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(h.net, mesh=mesh)
        top = None
    else:
        with pytest.raises(ValueError, match="shard_modules names"):
            shard_model(Holder(), mesh, ["Nope"])
        shard_model(h, mesh)
        top = ShardedTopK(TopKConfig(density=density, exchange="allgather", value_dtype="fp32", min_sparse_numel=0),
                          h, mesh)
        assert len(top.groups) == 3  # two blocks, then the rest
    opt = torch.optim.SGD(h.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        nn.functional.cross_entropy(h.net(x), y).backward()
        if top is not None:
            top.before_optimizer_step()
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor().detach().clone() for n, p in h.named_parameters()}
    return full, (top.state.step if top is not None else None)


def test_density_one_equals_torch_hsdp_and_the_replicas_agree_when_sparse():
    ref = run_distributed(_train, 4, ("hsdp", 1.0))
    dense = run_distributed(_train, 4, ("topk", 1.0))
    sparse = run_distributed(_train, 4, ("topk", 0.1))
    assert dense[0][1] == 6
    for k in ref[0][0]:
        assert torch.equal(ref[0][0][k], dense[0][0][k]), k
        assert all(torch.equal(sparse[0][0][k], s[0][k]) for s in sparse[1:]), k
    assert max(float((ref[0][0][k] - sparse[0][0][k]).abs().max()) for k in ref[0][0]) > 1e-4


def _pending(st, specs):
    """Per FSDP group: this rank's unsent mass in the group's flat layout (its residuals plus the owner residuals
    of the scale-free exchanges, folded to the coordinates they stand for)."""
    from lightning_topk.comm.exchanges.scatter import fold_owner_residual

    per = {n: t.detach().clone().reshape(-1) for n, t in st.residuals().items()}
    for ex in st.exchanges.values():  # (exchange="auto"'s children are there too)
        for key, t in getattr(getattr(ex, "owners", None), "live", {}).items():
            for n, v in fold_owner_residual(key, t).items():
                per[n] = per[n] + v
    return [torch.cat([per.get(n, torch.zeros(k)) for n, k in zip(names, numels)]) for names, numels in specs]


def _conserve(rank, world, nodes, exchange, density, d, cfg=None, steps=3):
    """Train ``steps`` steps on a (nodes, world/nodes) mesh, recording per step and FSDP group what the exchange got
    (the node's average shard), what it handed back, and this rank's unsent mass before and after."""
    from lightning_topk.comm.config import TopKConfig
    from lightning_topk.comm.sharded import ShardedTopK, make_mesh, shard_model

    h = Holder(d)
    mesh = make_mesh("cpu", nodes, world // nodes)
    shard_model(h, mesh)
    top = ShardedTopK(TopKConfig(density=density, exchange=exchange, value_dtype="fp32", min_sparse_numel=0,
                                 **(cfg or {})), h, mesh)
    seen = {}
    real = top.hooks._exchange_hook

    def spy(state, bucket):  # the hook's input and output, around the real exchange
        i, g = bucket.index(), bucket.buffer().clone()

        def keep(f):
            seen[i] = (g, f.value().clone())
            return f.value()

        return real(state, bucket).then(keep)

    top.hooks._exchange_hook = spy
    opt = torch.optim.SGD(h.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    records = []
    for _ in range(steps):
        before = _pending(top.state, top.specs)
        seen.clear()
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        nn.functional.cross_entropy(h.net(x), y).backward()
        top.before_optimizer_step()
        records.append([(*seen[i], before[i], a) for i, a in enumerate(_pending(top.state, top.specs))])
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor().detach().clone() for n, p in h.named_parameters()}
    plan = dict(getattr(top.state.exchange, "plan", {}))
    return records, full, top.state.step, plan


def _check_conserved(out, nodes):
    """Every replica applies the same average, and nothing is lost: over the ranks that hold the same shard,
    sum(got + unsent before) = nodes * applied + sum(unsent after) (fp32 values: exact but for the sums' rounding)."""
    world, worst = len(out), 0.0
    local = world // nodes
    for step in range(len(out[0][0])):
        for lr in range(local):
            peers = [out[node * local + lr][0][step] for node in range(nodes)]
            for i in range(len(peers[0])):
                applied = peers[0][i][1]
                assert all(torch.equal(applied, p[i][1]) for p in peers), (step, lr, i)
                lhs = sum(p[i][0] + p[i][2] for p in peers)
                rhs = nodes * applied + sum(p[i][3] for p in peers)
                worst = max(worst, float((lhs - rhs).abs().max()) / float(lhs.abs().max()))
    return worst


@pytest.mark.timeout(120)
def test_the_scale_free_exchange_on_shards_conserves_the_update():
    """exchange="scatter" on FSDP2's per-group hooks, which run one at a time and each wait for their own result
    (under DDP a bucket's owner step runs in the next bucket's hook: here the first backward hung): every group's
    exchange completes in its own hook, the replicas apply the same update and nothing is lost."""
    out = run_distributed(_conserve, 4, (2, "scatter", 0.1, 16))
    assert all(o[2] == 3 and len(o[0][0]) == 3 for o in out)  # 3 steps, 3 groups each
    worst = _check_conserved(out, 2)
    assert worst < 1e-5, worst
    sent = [float((p[0] - p[1]).abs().max()) for p in out[0][0][0]]
    assert min(sent) > 1e-4  # sparse: what was applied is not the node's average
    for k in out[0][1]:
        assert all(torch.equal(out[0][1][k], o[1][k]) for o in out[1:]), k
    print("SHARD_SCATTER conserved", worst)


@pytest.mark.timeout(120)
def test_auto_planning_the_scale_free_exchange_for_shards_trains():
    """exchange="auto" with the constants model at 0.1 Gbit/s on 4 nodes plans the scale-free exchange for the
    blocks' shards (and another for the rest's): each group completes in its own hook, and nothing is lost."""
    out = run_distributed(_conserve, 4, (4, "auto", 0.1, 64, dict(auto_model="constants", auto_link_gbps=0.1)))
    plan = out[0][3]
    assert "scatter" in plan.values() and len(set(plan.values())) > 1, plan
    worst = _check_conserved(out, 4)
    assert worst < 1e-5, worst
    for k in out[0][1]:
        assert all(torch.equal(out[0][1][k], o[1][k]) for o in out[1:]), k
    print("SHARD_AUTO", plan, "conserved", worst)
def test_density_one_equals_torch_hsdp_at_three_replicas():
    """3 nodes x 1: torch's HSDP on gloo sums the replicas' shards, then divides (ReduceOp.AVG); a DDP bucket is
    divided before the sum (torch's reducer). The sharded dense exchange follows HSDP (comm/shard.py)."""
    ref = run_distributed(_train, 3, ("hsdp", 1.0, 3))
    dense = run_distributed(_train, 3, ("topk", 1.0, 3))
    assert all(torch.equal(ref[0][0][k], dense[0][0][k]) for k in ref[0][0])
