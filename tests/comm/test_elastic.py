"""``comm.elastic`` without torchft: an :class:`ElasticGroup` over a plain torch process group (torchft's
``ProcessGroupGloo`` has the same ``allreduce`` signature), on real gloo processes."""
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _grid(rank, world):
    from lightning_topk.comm.elastic import ElasticGrid, ElasticGroup, group_rank, group_size

    # 2 "replica groups" of 2 processes: intra = {0, 1}, {2, 3}; per local rank across groups = {0, 2}, {1, 3}
    intras = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    inters = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, local = divmod(rank, 2)
    errors = []
    group = ElasticGroup(inters[local], size=lambda: 2, rank=lambda: replica, on_error=errors.append,
                         errored=lambda: None)
    grid = ElasticGrid(group, intras[replica])
    t = torch.tensor([float(rank + 1), 10.0 ** rank])
    grid.all_reduce(t).wait()
    return t.tolist(), group_size(grid), group_rank(grid), group_size(group), errors


def test_elastic_grid_sums_over_every_process_of_every_replica_group():
    out = run_distributed(_grid, world=4)
    for rank, (t, size, r, inter_size, errors) in enumerate(out):
        assert t == [10.0, 1111.0]  # 1+2+3+4 and each process's own digit: every process counted once
        assert (size, r, inter_size, errors) == (4, rank, 2, [])  # process rank = replica x 2 + local rank

