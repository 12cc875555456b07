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
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()


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


def test_density_one_equals_torch_hsdp_at_three_replicas():
    """3 nodes x 1: torch's HSDP on gloo sums the replicas' shards, then divides (ReduceOp.AVG); a DDP bucket is
    divided before the sum (torch's reducer). The sharded dense exchange follows HSDP (comm/shard.py)."""
    ref = run_distributed(_train, 3, ("hsdp", 1.0, 3))
    dense = run_distributed(_train, 3, ("topk", 1.0, 3))
    assert all(torch.equal(ref[0][0][k], dense[0][0][k]) for k in ref[0][0])
