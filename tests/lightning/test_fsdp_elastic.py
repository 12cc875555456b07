"""``topk_fsdp`` with ``fault_tolerance="torchft"`` on real processes (gloo on loopback, a real torchft lighthouse):
replica groups of 2 processes, each a Trainer with the model sharded over its processes (FSDP2), each rank
exchanging its gradient shard with the same rank of the other groups on its torchft process group. Without a
failure it is torch's own HSDP; a killed group heals shard by shard from a peer and rejoins; an uncommitted step
changes nothing."""
import pytest
import torch

from tests.helpers.procs import ROOT
from tests.lightning.test_elastic import Cluster, _logs

FSDP_SCRIPT = ROOT / "tests" / "scripts" / "fsdp_train.py"
pytestmark = pytest.mark.timeout(420)


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_groups_at_density_one_equal_torch_hsdp(tmp_path):
    """2 replica groups x 2 processes under torchft, no failure, density 1 with fp32 values: the same 8 steps as
    torch's HSDP (fully_shard on the 2-D mesh (replicate=2, shard=2)) on the same data and initial weights."""
    pytest.importorskip("torchft")
    from tests.lightning.test_fsdp import train

    ref, _ = train(tmp_path, "hsdp", "--strategy", "hsdp", "--steps", "8")
    c = Cluster(tmp_path, min_replicas=2)
    opts = ("--density", "1", "--value-dtype", "fp32", "--exchange", "allgather", "--steps", "8", "--nodes", "1")
    try:
        procs = [c.start(r, "--out", tmp_path / f"ft{r}.pt", "--torchft", r, *opts, script=FSDP_SCRIPT)
                 for r in (0, 1)]
        for p in procs:
            assert p.wait(timeout=300) == 0, _logs(tmp_path)
    finally:
        c.close()
    groups = [torch.load(tmp_path / f"ft{r}.pt") for r in (0, 1)]
    ranks = [torch.load(tmp_path / f"ft{r}.pt.rank{k}", weights_only=False) for r in (0, 1) for k in (0, 1)]
    assert all(r["exchange_step"] == 8 and r["step"] == 8 and r["ft"]["ft/step"] == 8 for r in ranks), ranks
    assert all(r["quorum_sizes"] == [2] * 8 for r in ranks), [r["quorum_sizes"] for r in ranks]
    assert max_diff(groups[0], groups[1]) == 0.0
    diff = max_diff(ref, groups[0])
    assert diff <= 1e-6, diff
    print("FSDP_FT_HSDP", diff)
