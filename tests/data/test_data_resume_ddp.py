"""Mid-epoch resume of WebDataModule with real processes: 2 gloo ranks under Lightning, checkpointed in the
middle of an epoch (ModelCheckpoint, and a real SIGUSR1 SLURM requeue), resumed in fresh processes, and
compared bit for bit with an uninterrupted run (tests/scripts/data_resume_train.py)."""
import sys
from pathlib import Path

import pytest
import torch

from lightning_topk.data import array_samples, load_arrays, write_shards
from tests.helpers.procs import SCRIPTS, fake_scontrol, run_script

sys.path.insert(0, str(SCRIPTS))
from fault_launch import Ranks, requeue_after, run_to_end

SCRIPT = "tests/scripts/data_resume_train.py"
N = 480  # 240 samples per rank, 15 batches of 16 per epoch
STEPS_PER_EPOCH = 15
CONFIG_A = ["--workers", "2", "--ram-cache", "decoded", "--gpu-cache"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    images, labels = load_arrays("digits")
    out = tmp_path_factory.mktemp("resume_shards")
    return write_shards(array_samples(images[:N], labels[:N]), str(out), prefix="d", num_shards=5, total=N,
                        progress=False)


def load(d, phase, rank):
    return torch.load(Path(d) / f"{phase}_rank{rank}.pt")


def max_delta(a, b):
    return max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"])


def assert_bit_identical(ref, got):
    assert got["global_step"] == ref["global_step"] == 2 * STEPS_PER_EPOCH
    for k in ref["params"]:
        assert torch.equal(ref["params"][k], got["params"][k]), (k, max_delta(ref, got))


@pytest.fixture(scope="module")
def config_a(shards, tmp_path_factory):
    """2 workers per rank, decoded RAM + device levels; checkpoints at step 7 of epoch 0 (15 steps) and at its
    last step."""
    d = tmp_path_factory.mktemp("resume_a")
    run_script([SCRIPT, "--out", d, "--shards", *shards, *CONFIG_A, "--stop-at", f"7,{STEPS_PER_EPOCH}"])
    return d


@pytest.mark.slow
def test_mid_epoch_resume_two_workers_is_bit_exact(config_a):
    for r in range(2):
        straight, resumed, replay = (load(config_a, p, r) for p in ("straight", "resume7", "replay"))
        assert resumed["ckpt_path"].endswith("step7.ckpt") and resumed["warnings"] == []
        assert_bit_identical(straight, resumed)
        # at the last step: Lightning creates the iterator before it moves to epoch 1, which then comes from
        # the device level (the new job decodes the partition first)
        assert_bit_identical(straight, load(config_a, f"resume{STEPS_PER_EPOCH}", r))
        # without the loader state (older checkpoints) the epoch replays from its start, with a warning
        assert max_delta(straight, replay) > 1e-3
        assert any("replaying the epoch from its start" in w for w in replay["warnings"]) == (r == 0)
        print(f"rank {r}: max |dparam| resumed {max_delta(straight, resumed):.3g}, "
              f"without loader state {max_delta(straight, replay):.3g}")


@pytest.mark.slow
def test_mid_epoch_resume_in_cache_served_epoch_no_workers_topk(shards, tmp_path):
    """0 workers; checkpoint at step 7 of epoch 1, which the decoded RAM level serves; top-k exchange."""
    stop = STEPS_PER_EPOCH + 7
    run_script([SCRIPT, "--out", tmp_path, "--shards", *shards, "--workers", "0", "--ram-cache", "decoded",
                "--strategy", "topk", "--stop-at", str(stop), "--phases", "straight,stop,resume"])
    for r in range(2):
        assert_bit_identical(load(tmp_path, "straight", r), load(tmp_path, f"resume{stop}", r))


@pytest.mark.slow
def test_slurm_requeue_mid_epoch_resumes_exactly(shards, config_a, tmp_path):
    """Real SIGUSR1 to both running ranks: Lightning writes hpc_ckpt_1.ckpt mid-epoch and calls scontrol (a
    fake one on PATH); the ranks are killed and the requeued job resumes it in new processes."""
    env, scontrol_log = fake_scontrol(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    args = ["--out", out, "--shards", *shards, *CONFIG_A, "--phases", "slurm", "--slow", "0.15"]

    requeue_after(Ranks(SCRIPT, args, 2, tmp_path / "logs1", slurm_job=777, extra_env=env, zygote=True), out, 4, scontrol_log)
    hpc = out / "slurm" / "hpc_ckpt_1.ckpt"
    ckpt = torch.load(hpc, weights_only=False)
    assert 4 <= ckpt["global_step"] < STEPS_PER_EPOCH - 1  # mid-epoch 0
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] == ckpt["global_step"]

    args[-1] = 0  # no need to go slowly after the resume
    run_to_end(Ranks(SCRIPT, args, 2, tmp_path / "logs2", slurm_job=777, extra_env=env, zygote=True))
    for r in range(2):
        resumed = load(out, "slurm", r)
        assert resumed["ckpt_path"].endswith("hpc_ckpt_1.ckpt") and resumed["warnings"] == []
        assert_bit_identical(load(config_a, "straight", r), resumed)
