"""``topk_fsdp``: FSDP2 inside the node, the top-k exchange (or local SGD) across nodes, on real gloo processes
(2 simulated nodes x 2 processes unless named). The references are torch's and Lightning's own: Lightning's
ModelParallelStrategy with torch's HSDP (``fully_shard`` on the 2-D mesh), and per-shard parameter averaging
with ``torch.distributed.all_reduce``."""
import shutil

import pytest
import torch

from tests.helpers.procs import run_nodes

SCRIPT = "tests/scripts/fsdp_train.py"
pytestmark = pytest.mark.timeout(600)


def train(tmp_path, tag, *args, nodes=2, devices=2):
    out = tmp_path / f"{tag}.pt"
    run_nodes([SCRIPT, "--out", out, "--nodes", nodes, "--devices", devices, *args], num_nodes=nodes, timeout=400)
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(nodes * devices)]
    return torch.load(out), ranks


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_density_one_with_fp32_values_equals_torch_hsdp(tmp_path):
    ref, _ = train(tmp_path, "hsdp", "--strategy", "hsdp", "--steps", "8")
    ours, ranks = train(tmp_path, "topk", "--density", "1", "--value-dtype", "fp32", "--exchange", "allgather",
                        "--steps", "8")
    assert ranks[0]["exchange_step"] == 8
    assert max_diff(ref, ours) <= 1e-6
    sparse, _ = train(tmp_path, "sparse", "--density", "0.05", "--exchange", "allgather", "--steps", "8")
    assert max_diff(ref, sparse) > 1e-4  # the exchange is in the loop: sparse steps differ


def test_user_sharded_blocks_and_a_bad_mesh(tmp_path):
    _, ranks = train(tmp_path, "user", "--user-shard", "--density", "0.05", "--exchange", "allgather", "--steps", "2")
    assert ranks[0]["exchange_step"] == 2 and ranks[0]["residual_abs"] > 0
    with pytest.raises(AssertionError, match=r"device_mesh\['shard'\]"):
        train(tmp_path, "bad", "--bad-mesh", "--steps", "1")


def test_resume_is_exact_and_a_reshard_keeps_the_pending_update(tmp_path):
    ck = tmp_path / "ck"
    full, fr = train(tmp_path, "full", "--density", "0.05", "--exchange", "allgather", "--steps", "9")
    _, saved = train(tmp_path, "a", "--density", "0.05", "--exchange", "allgather", "--steps", "8", "--save", ck)
    resumed, rr = train(tmp_path, "b", "--density", "0.05", "--exchange", "allgather", "--steps", "9",
                        "--resume", ck)
    assert max_diff(full, resumed) == 0.0
    assert [r["residual_sum"] for r in rr] == [r["residual_sum"] for r in fr]

    def pending(ranks, replicas):  # (1/R) sum over replicas of each parameter's residual, summed over the shards
        return sum(r["residual_sum"] for r in ranks) / replicas

    before = pending(saved, 2)
    assert abs(before) > 0 and saved[0]["residual_abs"] > 0
    for nodes, devices in ((1, 2), (4, 1)):
        _, after = train(tmp_path, f"re{nodes}", "--density", "0.05", "--exchange", "allgather", "--steps", "8",
                         "--resume", ck, nodes=nodes, devices=devices)
        assert after[0]["exchange_step"] == 8
        assert pending(after, nodes) == pytest.approx(before, rel=1e-5, abs=1e-7)
    shutil.rmtree(ck)


def test_a_skipped_step_rolls_back_the_shard_residuals(tmp_path):
    _, three = train(tmp_path, "three", "--density", "0.05", "--exchange", "allgather", "--steps", "3")
    p3, _ = train(tmp_path, "three_again", "--density", "0.05", "--exchange", "allgather", "--steps", "3")
    p4, skip = train(tmp_path, "skip", "--density", "0.05", "--exchange", "allgather", "--steps", "4",
                     "--inject-step", "3")
    assert [r["skipped"] for r in skip] == [1] * 4
    assert [r["exchange_step"] for r in skip] == [3] * 4
    for a, b in zip(three, skip):
        assert a["residuals"].keys() == b["residuals"].keys()
        assert all(torch.equal(a["residuals"][k], b["residuals"][k]) for k in a["residuals"])
    assert max_diff(p3, p4) == 0.0


def test_local_sgd_with_dense_outer_values_equals_per_shard_averaging(tmp_path):
    ref, _ = train(tmp_path, "avg", "--strategy", "avg", "--local-steps", "4", "--steps", "8")
    ours, ranks = train(tmp_path, "local", "--local-steps", "4", "--outer-value-bits", "32", "--outer-density", "1",
                        "--steps", "8")
    assert ranks[0]["rounds"] == 2
    assert max_diff(ref, ours) <= 2e-6
    low, _ = train(tmp_path, "local4", "--local-steps", "4", "--steps", "8")
    assert max_diff(ref, low) > 1e-5  # the compressed outer round is in the loop


def test_local_sgd_outer_state_reshards_with_nothing_lost(tmp_path):
    """Saved mid-round at 2 x 2, resumed at 2 x 2, 1 x 2 and 4 x 1: θ_outer and the outer momentum are the saved
    ones, the replicas' mean error feedback (the pending outer update) is unchanged, and θ_local is the saved
    replica's (replica r takes saved replica r mod 2's)."""
    ck = tmp_path / "ck"
    opts = ("--local-steps", "4", "--outer-recipe", "diloco", "--steps", "6")
    p_saved, saved = train(tmp_path, "a", *opts, "--save", ck)

    def replica(ranks, devices, r, kind):
        return ranks[r * devices]["outer"][kind]

    def mean_ef(ranks, replicas, devices):
        efs = [replica(ranks, devices, r, "ef") for r in range(replicas)]
        return {n: sum(e[n] for e in efs) / replicas for n in efs[0]}

    assert saved[0]["rounds"] == 1
    pending = mean_ef(saved, 2, 2)
    assert sum(float(t.abs().sum()) for t in pending.values()) > 0
    assert sum(float(t.abs().sum()) for t in replica(saved, 2, 0, "momentum").values()) > 0
    assert max_diff(replica(saved, 2, 0, "ef"), replica(saved, 2, 1, "ef")) > 0  # the replicas' buffers differ
    for nodes, devices in ((2, 2), (1, 2), (4, 1)):
        p, after = train(tmp_path, f"re{nodes}x{devices}", *opts, "--resume", ck, nodes=nodes, devices=devices)
        assert after[0]["rounds"] == 1
        assert max_diff(p, p_saved) == 0.0  # replica 0's θ_local (rank 0 writes the parameters)
        for r in range(nodes):
            for kind in ("theta_outer", "momentum"):
                assert max_diff(replica(after, devices, r, kind), replica(saved, 2, 0, kind)) == 0.0, kind
        if (nodes, devices) == (2, 2):
            assert all(max_diff(replica(after, 2, r, "ef"), replica(saved, 2, r, "ef")) == 0.0 for r in range(2))
        got = mean_ef(after, nodes, devices)
        assert all(torch.allclose(got[n], pending[n], rtol=1e-6, atol=1e-9) for n in pending)
    shutil.rmtree(ck)


def _fabric(tmp_path, tag, *args):
    out = tmp_path / f"{tag}.pt"
    run_nodes(["tests/scripts/fsdp_fabric.py", "--out", out, *args], num_nodes=2, timeout=400)
    return torch.load(out), [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(4)]


def test_fabric_density_one_equals_torch_hsdp_and_resumes_exactly(tmp_path):
    ref, _ = train(tmp_path, "hsdp", "--strategy", "hsdp", "--steps", "8")
    dense, ranks = _fabric(tmp_path, "fdense", "--density", "1", "--value-dtype", "fp32", "--steps", "8")
    assert ranks[0]["exchange_step"] == 8
    assert max_diff(ref, dense) <= 1e-6
    ck = tmp_path / "fck"
    full, fr = _fabric(tmp_path, "ffull", "--density", "0.05", "--steps", "8", "--save-at", "4", "--save", ck)
    resumed, rr = _fabric(tmp_path, "fres", "--density", "0.05", "--steps", "8", "--resume", ck)
    assert max_diff(full, resumed) == 0.0
    assert [r["residual_sum"] for r in rr] == [r["residual_sum"] for r in fr] and fr[0]["residual_sum"] != 0.0


def test_bf16_mixed_accumulation_and_last_checkpoint(tmp_path):
    _, ranks = train(tmp_path, "bf16", "--precision", "bf16-mixed", "--density", "0.05", "--exchange", "allgather",
                     "--steps", "3", "--accumulate", "2")
    assert ranks[0]["param_dtype"] == "torch.bfloat16"  # FSDP2's MixedPrecisionPolicy, fp32 reduction
    assert ranks[0]["exchange_step"] == 3  # one exchange per optimizer step, none per micro-batch
    ck = tmp_path / "ckpts"
    full, fr = train(tmp_path, "full", "--density", "0.05", "--exchange", "allgather", "--steps", "9")
    train(tmp_path, "first", "--density", "0.05", "--exchange", "allgather", "--steps", "8", "--ckpt-dir", ck)
    assert (ck / "last.ckpt" / "topk" / "rank3.pt").is_file()
    last, lr = train(tmp_path, "last", "--density", "0.05", "--exchange", "allgather", "--steps", "9",
                     "--ckpt-dir", ck, "--last")
    assert max_diff(full, last) == 0.0 and lr[0]["residual_sum"] == fr[0]["residual_sum"]


def test_topk_precision_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="TopKPrecision with fp16 loss scaling or master_weights is not supported"):
        train(tmp_path, "tp", "--topk-precision", "--steps", "1")


def test_options_that_do_not_apply_are_refused():
    from lightning_topk.lightning.elastic import TorchFTReplica
    from lightning_topk.lightning.fsdp import TopKFSDPStrategy
    from lightning_topk.lightning.fsdp_fabric import fabric_fsdp_class

    s = fabric_fsdp_class("lightning.fabric")(fault_tolerance="torchft")  # torchft: one optimizer, after the model
    s.topk_elastic = TorchFTReplica(s.topk_config, dict, print)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"sets the model up first \(fabric.setup_module\(model\)\)"):
        s.setup_optimizer(torch.optim.SGD(net.parameters(), 0.1))
    with pytest.raises(ValueError, match="takes one optimizer"):
        s.setup_module_and_optimizers(net, [torch.optim.SGD(net.parameters(), 0.1)] * 2)
    plain = fabric_fsdp_class("lightning.fabric")()
    plain._topk_module = torch.nn.Linear(2, 2)  # as after fabric.setup_module: an optimizer of other parameters
    with pytest.raises(ValueError, match="not the sharded model's"):  # (fabric.setup(model, optimizer)) is refused
        plain.setup_optimizer(torch.optim.SGD(net.parameters(), 0.1))
    for cls in (TopKFSDPStrategy, fabric_fsdp_class("lightning.fabric")):
        with pytest.raises(ValueError, match="tensor parallelism is not supported"):
            cls(tensor_parallel_size=2)
        with pytest.raises(ValueError, match="static_graph is an option of DDP"):
            cls(static_graph=True)
        with pytest.raises(ValueError, match="checkpoints are distributed"):
            cls(save_distributed_checkpoint=False)
