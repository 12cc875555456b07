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


SPARSE = ("--density", "0.05", "--exchange", "allgather")
WD = ("--weight-decay", "0.01")
AUTO_MC = "recipe=auto -> momentum_correction without masking, momentum_lookahead"


def test_auto_moves_sgd_momentum_into_the_shard_hook_and_follows_the_scheduler(tmp_path):
    """recipe="auto" (the default) with SGD(momentum) at density 0.05: as under topk_ddp, the momentum moves into
    a velocity per gradient shard from the step after the first sparse one; the optimizer's momentum is 0 only
    during its step (no momentum buffers left) and OneCycleLR's cycled momentum reaches the hook every step."""
    _, ranks = train(tmp_path, "auto", *SPARSE, "--onecycle", "--steps", "6")
    for r in ranks:
        assert r["recipe"].startswith(AUTO_MC) and "(SGD momentum 0.95 moved into the hook; density 0.05)" in r["recipe"]
        assert r["engaged"] and r["momentum_buffers"] == 0 and r["momentum"] == [0.95]
        assert r["velocities"] and sum(float(v.abs().sum()) for v in r["velocities"].values()) > 0
        assert len(r["trace"]) == 5  # engaged after step 1, the first sparse one
        assert all(mine == hook and during == 0.0 for mine, hook, during in r["trace"])
        assert len({m for m, _, _ in r["trace"]}) == 5  # the scheduler's momentum, new at every step


def test_auto_sending_every_entry_is_torch_hsdp_with_nesterov_sgd(tmp_path):
    """Every entry sent through the sparse path (selection_scope="parameter", each parameter below
    min_sparse_numel): engaged, the hook's momentum with the lookahead is torch's HSDP with SGD(nesterov=True);
    left dormant (no step sent sparse, so nothing engages), it is HSDP with the user's SGD(momentum) itself."""
    every = ("--density", "0.5", "--value-dtype", "fp32", "--exchange", "allgather", "--selection-scope", "parameter",
             "--min-sparse-numel", "1000000000", "--steps", "8")
    nesterov, _ = train(tmp_path, "nesterov", "--strategy", "hsdp", "--nesterov", "--steps", "8")
    engaged, ranks = train(tmp_path, "engaged", *every, "--engage")
    assert all(r["engaged"] and r["exchange_step"] == 8 and r["residual_abs"] == 0.0 for r in ranks)
    assert max_diff(nesterov, engaged) <= 1e-6
    heavy_ball, _ = train(tmp_path, "hsdp", "--strategy", "hsdp", "--steps", "8")
    dormant, ranks = train(tmp_path, "dormant", *every)
    assert not any(r["engaged"] for r in ranks) and ranks[0]["momentum_buffers"] > 0
    assert max_diff(heavy_ball, dormant) == 0.0
    assert max_diff(heavy_ball, engaged) > 1e-3  # Nesterov is not heavy ball: the comparison can fail


def test_auto_per_shard_equals_topk_ddp_with_one_process_per_node(tmp_path):
    """2 nodes x 1 process: each shard is the whole parameter, so with a top-k per parameter
    (selection_scope="parameter", independent of DDP's buckets and FSDP's groups) topk_fsdp and topk_ddp select
    the same entries: the same decision, velocities, residuals and parameters, bit for bit. (With several
    processes per node the two take top-k of different vectors, the node's average shard vs each rank's
    gradient, so they differ; the 2 x 2 reduction is the HSDP test above.)"""
    opts = (*SPARSE, "--selection-scope", "parameter", "--steps", "8")
    ddp, dr = train(tmp_path, "ddp", "--strategy", "ddp", *opts, nodes=2, devices=1)
    fsdp, fr = train(tmp_path, "fsdp", *opts, nodes=2, devices=1)
    assert max_diff(ddp, fsdp) == 0.0
    for d, f in zip(dr, fr):
        assert d["recipe"] == f["recipe"] and f["recipe"].startswith(AUTO_MC)
        assert d["engaged"] and f["engaged"] and d["exchange_step"] == f["exchange_step"] == 8
        assert d["velocities"].keys() == f["velocities"].keys()
        for k in d["velocities"]:
            assert torch.equal(d["velocities"][k].reshape(-1), f["velocities"][k].reshape(-1)), k
            assert torch.equal(d["residuals"][k].reshape(-1), f["residuals"][k].reshape(-1)), k


@pytest.mark.parametrize("mode", [SPARSE, ("--local-steps", "2")])
def test_a_partly_sharded_model_is_refused_at_setup(tmp_path, mode):
    """configure_model shards the blocks only: the embeddings and the final norm, which no fully_shard holds, would
    never be reduced (before: 1.0e-2 apart across nodes after 3 steps, no error); refused, naming them."""
    with pytest.raises(AssertionError, match=r"the parameters no fully_shard holds: \['net.tok.weight', 'net.pos.weight',"
                                             r" 'net.norm.weight', 'net.norm.bias'\]"):
        train(tmp_path, "partial", "--partial-shard", *mode, "--steps", "3")


def test_user_sharded_blocks_and_a_bad_mesh(tmp_path):
    _, ranks = train(tmp_path, "user", "--user-shard", "--density", "0.05", "--exchange", "allgather", "--steps", "2")
    assert ranks[0]["exchange_step"] == 2 and ranks[0]["residual_abs"] > 0
    with pytest.raises(AssertionError, match=r"device_mesh\['shard'\]"):
        train(tmp_path, "bad", "--bad-mesh", "--steps", "1")


def test_resume_is_exact_and_a_reshard_keeps_the_pending_update(tmp_path):
    """SGD with momentum and weight decay: recipe="auto" engages, and a resume at the saved layout restores it
    exactly (its velocity, weight decay's momentum share in the optimizer, no momentum buffers)."""
    ck = tmp_path / "ck"
    full, fr = train(tmp_path, "full", *SPARSE, *WD, "--steps", "9")
    _, saved = train(tmp_path, "a", *SPARSE, *WD, "--steps", "8", "--save", ck)
    resumed, rr = train(tmp_path, "b", *SPARSE, *WD, "--steps", "9",
                        "--resume", ck)
    assert max_diff(full, resumed) == 0.0
    assert [r["residual_sum"] for r in rr] == [r["residual_sum"] for r in fr]
    for f, r, s in zip(fr, rr, saved):  # recipe="auto" engaged before the save: engaged again, its velocity exact
        assert s["engaged"] and r["engaged"] and r["momentum_buffers"] == 0 and r["wd_momentum"] == f["wd_momentum"] > 0
        assert r["velocities"].keys() == f["velocities"].keys() and f["velocities"]
        assert all(torch.equal(f["velocities"][k], r["velocities"][k]) for k in f["velocities"])

    def pending(ranks, replicas):  # (1/R) sum over replicas of each parameter's residual, summed over the shards
        return sum(r["residual_sum"] for r in ranks) / replicas

    before = pending(saved, 2)
    assert abs(before) > 0 and saved[0]["residual_abs"] > 0
    for nodes, devices in ((1, 2), (4, 1)):
        _, after = train(tmp_path, f"re{nodes}", *SPARSE, *WD, "--steps", "8",
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
        if devices == 2:  # the processes per node unchanged: each rank's θ_local and inner optimizer state are the
            assert _same_rank_state(after, saved[:len(after)]) == 0.0  # same saved rank's, as a pair
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


def _same_rank_state(a, b):
    """The largest |difference| between two runs' per-rank parameter shards and optimizer states."""
    worst = 0.0
    for x, y in zip(a, b):
        worst = max(worst, max_diff(x["local_params"], y["local_params"]))
        assert x["opt_state"].keys() == y["opt_state"].keys()
        for i in x["opt_state"]:
            worst = max(worst, max_diff(x["opt_state"][i], y["opt_state"][i]))
    return worst


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_local_sgd_resumes_every_replicas_own_inner_state(tmp_path, optimizer):
    """Local SGD saved mid-round (step 8, H=3: 2 steps into the round), resumed at the saved layout: every rank's
    own weights and inner optimizer state (momentum / AdamW's moments differ per replica inside a round) come back,
    so the run equals the uninterrupted one bit for bit, mid-round (step 10) and after the next round (step 12).
    Each step trains on its global step's batch: Lightning's resumed loop replays a batch (NOTES.md), which is
    not what is compared here."""
    ck = tmp_path / "ck"
    opts = ("--local-steps", "3", "--optimizer", optimizer, "--data-by-step")
    _, saved = train(tmp_path, "a", *opts, "--steps", "8", "--save", ck)
    assert max_diff(saved[0]["local_params"], saved[2]["local_params"]) > 0  # the replicas differ mid-round
    for steps in (10, 12):
        full, fr = train(tmp_path, f"full{steps}", *opts, "--steps", str(steps))
        resumed, rr = train(tmp_path, f"b{steps}", *opts, "--steps", str(steps), "--resume", ck)
        assert rr[0]["rounds"] == fr[0]["rounds"] == steps // 3
        assert _same_rank_state(fr, rr) == 0.0
        assert max_diff(full, resumed) == 0.0
    shutil.rmtree(ck)


def test_fabric_local_sgd_resumes_every_replicas_own_inner_state(tmp_path):
    """Fabric: saved mid-round (step 5, H=3), fabric.load restores every rank's own weights and SGD momentum."""
    ck = tmp_path / "fck"
    opts = ("--local-steps", "3", "--exchange", "auto", "--steps", "9")
    full, fr = _fabric(tmp_path, "ffull", *opts, "--save-at", "5", "--save", ck)
    resumed, rr = _fabric(tmp_path, "fres", *opts, "--resume", ck)
    assert _same_rank_state(fr, rr) == 0.0 and max_diff(full, resumed) == 0.0
