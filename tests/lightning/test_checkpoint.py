"""Checkpoint/resume of the top-k compression state: 2-process Trainer runs (real gloo processes, real
SIGUSR1 for SLURM requeue) and the shard format/redistribution rules on their own."""
import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_topk.lightning.checkpoint import shard_dir, shard_path
from tests.helpers.procs import SCRIPTS, fake_scontrol, run_script

sys.path.insert(0, str(SCRIPTS))
from fault_launch import Ranks, progress, requeue_after, run_to_end

SCRIPT = "tests/scripts/ckpt_train.py"


def load(d, phase, rank):
    return torch.load(Path(d) / f"{phase}_rank{rank}.pt")


def assert_same_state(a, b):
    assert a["global_step"] == b["global_step"] and a["step"] == b["step"]
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for kind in ("residuals", "velocities"):
        assert a[kind] and a[kind].keys() == b[kind].keys()
        for k in a[kind]:
            assert torch.equal(a[kind][k], b[kind][k]), (kind, k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process launch: straight, stop, ddp_from_topk, topk_from_ddp, resume (see the script)."""
    d = tmp_path_factory.mktemp("ckpt")
    run_script([SCRIPT, "--out", d])
    return d


def test_resume_from_last_is_bit_exact(runs):
    for r in range(2):
        straight, resumed = load(runs, "straight", r), load(runs, "resume", r)
        assert resumed["ckpt_path"].endswith("last.ckpt")
        assert resumed["restored"]["step"] == 22 and resumed["restored"]["residual"]
        assert_same_state(straight, resumed)
        assert resumed["warnings"] == []
    # the ranks keep their own residuals (not one rank's copy for all)
    a, b = load(runs, "resume", 0)["residuals"], load(runs, "resume", 1)["residuals"]
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_resume_is_bit_exact_across_several_buckets_with_parameter_scope(tmp_path):
    # DDP's first iteration after a resume uses its pre-rebuild bucket layout; per-parameter selection
    # does not depend on the layout, so the resumed run matches the straight one bit for bit.
    run_script([SCRIPT, "--out", tmp_path, "--phases", "straight,stop,resume", "--bucket-cap-mb", "0.05",
                "--scope", "parameter"])
    for r in range(2):
        straight, resumed = load(tmp_path, "straight", r), load(tmp_path, "resume", r)
        assert straight["buckets"] >= 2 * straight["step"] - 1  # several buckets per exchange
        assert_same_state(straight, resumed)


def test_resume_with_defaults_under_deterministic_is_bit_exact(tmp_path):
    # Only density set (exchange="auto"): under deterministic=True the plan comes from documented constants,
    # not from timings, so the interrupted run and the straight one take the same plan and end bit-exactly.
    run_script([SCRIPT, "--out", tmp_path, "--phases", "straight,stop,resume", "--defaults"])
    for r in range(2):
        straight, resumed = load(tmp_path, "straight", r), load(tmp_path, "resume", r)
        assert straight["auto"]["timed"] is False and straight["auto"]["plan"]
        assert resumed["restored"]["exchanges"]["auto"]["plan"] == straight["auto"]["plan"]  # from the checkpoint
        assert straight["global_step"] == resumed["global_step"] and straight["step"] == resumed["step"]
        for k in straight["params"]:
            assert torch.equal(straight["params"][k], resumed["params"][k]), k
        assert straight["residuals"].keys() == resumed["residuals"].keys()
        for k in straight["residuals"]:
            assert torch.equal(straight["residuals"][k], resumed["residuals"][k]), k
        # exchange="auto" sends this model dense on one node, so recipe="auto" stays dormant: the momentum
        # stays in the user's SGD (Lightning checkpoints it), nothing in the hook
        assert straight["masking"] is None and resumed["masking"] is None
        assert straight["velocities"] == {} and resumed["velocities"] == {}
    assert load(tmp_path, "straight", 0)["auto"] == load(tmp_path, "straight", 1)["auto"]


def test_resume_of_an_engaged_sgd_recipe_is_bit_exact(tmp_path):
    """Sparse from the first step: recipe="auto" engages at step 1 (the momentum moves into the hook) and a
    resume restores the hook's velocities and the optimizer as they were, bit for bit."""
    run_script([SCRIPT, "--out", tmp_path, "--phases", "straight,stop,resume", "--defaults", "--exchange", "allgather"])
    for r in range(2):
        straight, resumed = load(tmp_path, "straight", r), load(tmp_path, "resume", r)
        assert straight["global_step"] == resumed["global_step"] and straight["step"] == resumed["step"]
        for k in straight["params"]:
            assert torch.equal(straight["params"][k], resumed["params"][k]), k
        # unmasked, with the Nesterov lookahead (whose lead lives in the residual)
        assert straight["masking"] is False and resumed["masking"] is False
        assert straight["lookahead"] == resumed["lookahead"] == 0.9
        assert straight["velocities"] and straight["velocities"].keys() == resumed["velocities"].keys()
        assert resumed["restored"]["velocity"].keys() == straight["velocities"].keys()  # from the checkpoint
        for k in straight["velocities"]:
            assert torch.equal(straight["velocities"][k], resumed["velocities"][k]), k
        for k in straight["residuals"]:
            assert torch.equal(straight["residuals"][k], resumed["residuals"][k]), k


def test_a_lost_shard_does_not_change_the_plan_of_any_rank(tmp_path):
    # A probed (timed) model: before, the rank without its shard probed again and could issue other
    # collectives than the rest. The plan and the model live in the main file, the same for every rank.
    run_script([SCRIPT, "--out", tmp_path, "--phases", "stop,lost_shard", "--defaults", "--auto-model", "probe"])
    stop = [load(tmp_path, "stop", r) for r in range(2)]
    lost = [load(tmp_path, "lost_shard", r) for r in range(2)]
    saved = stop[0]["auto"]
    assert saved["timed"] is True and saved["plan"] and stop[1]["auto"] == saved
    for r in lost:
        assert r["restored"]["exchanges"]["auto"]["plan"] == saved["plan"]
        assert r["restored"]["exchanges"]["auto"]["model"] == saved["model"]  # not probed again
        assert r["global_step"] > stop[0]["global_step"]  # training went on, on every rank
    assert lost[0]["auto"]["plan"] == lost[1]["auto"]["plan"]
    assert any("rank 1: missing" in w for w in lost[0]["warnings"]), lost[0]["warnings"]


def test_resume_is_bit_exact_on_the_sync_free_path(tmp_path):
    # LIGHTNING_TOPK_SYNC_FREE=1: the GPU path's selection and flags, forced on CPU.
    run_script([SCRIPT, "--out", tmp_path, "--phases", "straight,stop,resume"],
               env={"LIGHTNING_TOPK_SYNC_FREE": "1"})
    for r in range(2):
        straight, resumed = load(tmp_path, "straight", r), load(tmp_path, "resume", r)
        assert resumed["restored"]["residual"]
        assert_same_state(straight, resumed)


@pytest.mark.slow
def test_resume_from_file_url_checkpoint_is_bit_exact(tmp_path):
    # Shards go through the same URL handling as Lightning's checkpoint I/O (fsspec), not plain paths.
    run_script([SCRIPT, "--out", tmp_path, "--phases", "straight,url_stop,url_resume"])
    assert sorted(os.listdir(shard_dir(tmp_path / "url" / "e1.ckpt"))) == ["rank0.pt", "rank1.pt"]
    for r in range(2):
        straight, resumed = load(tmp_path, "straight", r), load(tmp_path, "url_resume", r)
        assert resumed["ckpt_path"].startswith("file://")
        assert resumed["restored"]["step"] == 22 and resumed["restored"]["residual"]
        assert resumed["warnings"] == []
        assert_same_state(straight, resumed)


def test_shards_written_per_rank_and_pruned_with_their_checkpoint(runs):
    ck = runs / "ckpt"
    # resume used save_top_k=1: ModelCheckpoint removed epoch 0's file, and its shards went with it
    assert not (ck / "epoch=0-step=22.ckpt").exists() and not os.path.exists(shard_dir(ck / "epoch=0-step=22.ckpt"))
    for name in ("epoch=1-step=44.ckpt", "last.ckpt"):
        assert sorted(os.listdir(shard_dir(ck / name))) == ["rank0.pt", "rank1.pt"]
    meta = torch.load(ck / "last.ckpt", weights_only=True)["lightning_topk"]
    assert meta["world_size"] == 2 and meta["num_nodes"] == 1 and meta["local_world_size"] == 2
    assert meta["step"] == 44 and meta["version"] == 2 and meta["numels"]["net.head.3.weight"] == 1280
    shard = torch.load(shard_path(ck / "last.ckpt", 1), weights_only=True)
    assert shard["rank"] == 1 and shard["save_key"] == meta["save_key"]
    assert set(shard["residual"]) == set(meta["numels"])
    assert not any(f.startswith(".tmp") for f in os.listdir(shard_dir(ck / "last.ckpt")))
    assert sorted(os.listdir(ck)) == [".topk-shards", "epoch=1-step=44.ckpt", "last.ckpt"]


def test_plain_ddp_resumes_from_topk_checkpoint(runs):
    for r in range(2):
        x = load(runs, "ddp_from_topk", r)
        assert x["global_step"] == 44 and x["step"] is None and x["warnings"] == []
    assert "lightning_topk" not in torch.load(runs / "ddp" / "last.ckpt", weights_only=True)


def test_topk_resumes_from_ddp_checkpoint_with_one_warning(runs):
    r0, r1 = load(runs, "topk_from_ddp", 0), load(runs, "topk_from_ddp", 1)
    assert len(r0["warnings"]) == 1 and r1["warnings"] == []  # one warning, from rank 0
    assert "no top-k state" in r0["warnings"][0] and "start at zero" in r0["warnings"][0]
    assert r0["restored"]["step"] == 44 and r0["restored"]["residual"] == {}
    assert r0["global_step"] == 66 and r0["step"] == 66  # the schedule continued at global_step
    for k in r0["params"]:
        if "running_" not in k:  # BatchNorm running stats are per rank under DDP
            assert torch.equal(r0["params"][k], r1["params"][k]), k


def test_single_process_inference_load(runs):
    from lightning_topk.models import ImageClassifier, SmallCNN

    model = ImageClassifier.load_from_checkpoint(runs / "ckpt" / "last.ckpt", net=SmallCNN(width=16),
                                            map_location="cpu", weights_only=True)
    ref = load(runs, "resume", 0)["params"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_world_size_change_averages_residuals(runs):
    """2 -> 1 process: the rank starts from the mean of both shards, with one warning."""
    run_script([SCRIPT, "--out", runs, "--phases", "shrink", "--devices", "1"])
    x = load(runs, "shrink", 0)
    assert len(x["warnings"]) == 1 and "world size changed from 2 to 1" in x["warnings"][0]
    shards = [torch.load(shard_path(runs / "ckpt" / "last.ckpt", r), weights_only=True) for r in range(2)]
    for kind in ("residual", "velocity"):
        assert x["restored"][kind].keys() == shards[0][kind].keys()
        for k, got in x["restored"][kind].items():
            mean = ((shards[0][kind][k].double() + shards[1][kind][k].double()) / 2).float()
            assert torch.equal(got, mean), (kind, k)
    assert x["restored"]["step"] == 44 and x["global_step"] == 88 and x["step"] == 88


def test_slurm_requeue_signal_then_resume_is_bit_exact(runs, tmp_path):
    """Real SIGUSR1 to both running ranks (as SLURM sends it), Lightning writes hpc_ckpt_1.ckpt and calls
    scontrol (a fake one on PATH); both ranks are then killed and the requeued job resumes exactly."""
    env, scontrol_log = fake_scontrol(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    args = [SCRIPT, "--out", out, "--phases", "slurm", "--slow", "0.1"]

    job = Ranks(args[0], args[1:], 2, tmp_path / "logs1", slurm_job=4242, extra_env=env, zygote=True)
    requeue_after(job, out, 5, scontrol_log, check=lambda: progress(out, 0) < 15)  # mid-epoch (22 steps per epoch)
    assert scontrol_log.read_text().split() == ["requeue", "4242"]
    hpc = out / "slurm" / "hpc_ckpt_1.ckpt"
    assert hpc.exists() and sorted(os.listdir(shard_dir(hpc))) == ["rank0.pt", "rank1.pt"]
    saved_at = torch.load(hpc, weights_only=True)["global_step"]
    assert 5 <= saved_at < 22

    args[-1] = 0  # no need to go slowly after the resume
    run_to_end(Ranks(args[0], args[1:], 2, tmp_path / "logs2", slurm_job=4242, extra_env=env, zygote=True))
    for r in range(2):
        resumed = load(out, "slurm", r)
        assert resumed["ckpt_path"].endswith("hpc_ckpt_1.ckpt")
        assert resumed["restored"]["step"] == saved_at
        assert resumed["warnings"] == []
        assert_same_state(load(runs, "straight", r), resumed)


def test_slurm_requeue_under_local_sgd_waits_for_the_outer_round_end(tmp_path):
    """Sparse local SGD (H=8): the requeue decision is a collective across all nodes, so it is taken at outer
    round ends only (none between rounds). The signal at step >= 5 is acted on at step 8 (the old code: at the
    next step, 5-7), and the requeued job resumes from there."""
    env, scontrol_log = fake_scontrol(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    args = [SCRIPT, "--out", out, "--phases", "slurm", "--defaults", "--local-steps", "8", "--slow", "0.1"]
    job = Ranks(args[0], args[1:], 2, tmp_path / "logs1", slurm_job=4545, extra_env=env, zygote=True)
    requeue_after(job, out, 5, scontrol_log, check=lambda: progress(out, 0) < 8)
    hpc = out / "slurm" / "hpc_ckpt_1.ckpt"
    saved_at = torch.load(hpc, weights_only=True)["global_step"]
    assert saved_at % 8 == 0 and saved_at >= 8, saved_at
    args[args.index("--slow") + 1] = "0"
    run_to_end(Ranks(args[0], args[1:], 2, tmp_path / "logs2", slurm_job=4545, extra_env=env, zygote=True))
    for r in range(2):
        resumed = load(out, "slurm", r)
        assert resumed["ckpt_path"].endswith("hpc_ckpt_1.ckpt") and resumed["global_step"] == 2 * 22


def test_slurm_requeue_every_rank_saves_under_rank_zeros_name(tmp_path):
    """Rank 1 names its requeue checkpoint 2 s after rank 0 wrote hpc_ckpt_1.ckpt (its logger is slow to
    finalize, which Lightning's handler does first). Each rank used to list the folder itself and rank 1
    picked hpc_ckpt_2: its residual shard was lost to the resumed job. Now all shards are under rank 0's
    name, and a leftover shard folder of a save that never completed does not shift the next number."""
    from lightning_topk.lightning import checkpoint as ckmod

    env, scontrol_log = fake_scontrol(tmp_path)
    out = tmp_path / "run"
    (out / "slurm").mkdir(parents=True)
    # Shards of a hpc_ckpt_5 whose main file was never written (rank 0 died): not a checkpoint.
    os.makedirs(shard_dir(out / "slurm" / "hpc_ckpt_5.ckpt"))
    job = Ranks(SCRIPT, ["--out", out, "--phases", "slurm", "--slow", "0.1", "--slow-finalize-rank", "1"], 2,
                tmp_path / "logs", slurm_job=4343, extra_env=env, zygote=True)
    requeue_after(job, out, 3, scontrol_log, ranks=(0,))  # RequeueSync runs the handler on both ranks after the next step
    names = sorted(f for f in os.listdir(out / "slurm") if "hpc_ckpt" in f)
    assert names == ["hpc_ckpt_1.ckpt"], names
    assert sorted(os.listdir(out / "slurm" / ".topk-shards")) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_5.ckpt"]
    hpc = out / "slurm" / "hpc_ckpt_1.ckpt"
    meta = torch.load(hpc, weights_only=True)["lightning_topk"]
    for r in range(2):
        shard, why = ckmod.read_shard(shard_path(hpc, r), meta, r)
        assert why == "" and shard["residual"], (r, why)
