"""A real SLURM on this host (Debian's slurm-wlm and munge: one slurmctld, two slurmd "nodes"): the sbatch
example at 2 nodes x 2 CPU tasks on the digits, requeued in the middle by ``scancel --signal=USR1`` as SLURM
does before a time limit. Checks what the mocked tests in test_slurm.py cannot: the job exits 0 after the
requeue, every rank's residual shard sits under the one checkpoint name rank 0 chose, the requeued job
resumed from it, and the final test ran on the final weights.

Needs root and the packages (``.ci/slurm_setup`` installs them; CI runs it); skips saying why otherwise.
Select it with ``-m slurm``; it is also ``slow``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_topk.lightning import checkpoint as ck
from tests.helpers import slurm_cluster
from tests.helpers.procs import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
EPOCHS = 8
# The flags docs/slurm.md gives for a CPU-only allocation (the script's #SBATCH lines ask for GPUs).
CPU_FLAGS = ["--gpus-per-node=0", "--cpus-per-task=1"]
OVERRIDES = [f"trainer.max_epochs={EPOCHS}", "trainer.accelerator=cpu", "strategy.exchange=allgather",
             "callbacks.progress_bar=null", "run.print_summary=false", "trainer.log_every_n_steps=1",
             "logger.csv.flush_logs_every_n_steps=1"]


@pytest.fixture(scope="module")
def cluster():
    try:
        c = slurm_cluster.start()
    except slurm_cluster.Unavailable as e:
        pytest.skip(f"no real SLURM here: {e}")
    yield c
    c.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(cluster, job: str) -> dict:
    out = cluster.cmd("scontrol", "show", "job", "-o", job).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _wait(cond, timeout: float, what: str, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.5)
    text = log.read_text(errors="replace") if log.exists() else "(no job output)"
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; job output:\n{text[-4000:]}")


def _submit_and_requeue(cluster, tmp_path, overrides):
    """Submit the sbatch example at 2 nodes x 2 CPU tasks, requeue it with ``scancel --signal=USR1`` once the first
    steps are logged, wait for the requeued job to end. Returns (job, run dir, job output, scontrol's job info)."""
    out_root = tmp_path / "outputs"
    env = dict(cluster.env, OUTPUT_ROOT=str(out_root), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    submit = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", *CPU_FLAGS,
                             f"--output={tmp_path}/slurm-%j.out", str(SBATCH), *overrides],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job}.out"
    run_dir = out_root / f"slurm-{job}"
    try:
        # Training has started on every rank (rank 0 logged a step: the ranks met in a gradient collective,
        # so all of them passed on_train_start, where topk_ddp defers Lightning's handler to a step boundary).
        metrics = run_dir / "csv" / "version_0" / "metrics.csv"
        _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 180, "the first steps", log)
        cluster.cmd("scancel", "--signal=USR1", job)
        _wait(lambda: _job(cluster, job).get("Restarts") == "1", 60, "the requeue", log)
        _wait(lambda: _job(cluster, job)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                         "OUT_OF_MEMORY"), 240, "the requeued job to end", log)
    finally:
        if _job(cluster, job).get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            cluster.cmd("scancel", job, check=False)
    return job, run_dir, log.read_text(errors="replace"), _job(cluster, job)


def test_sbatch_example_requeued_in_the_middle_resumes_and_tests_the_final_weights(cluster, tmp_path):
    t0 = time.monotonic()
    job, run_dir, text, info = _submit_and_requeue(cluster, tmp_path, OVERRIDES)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]

    # One requeue checkpoint, every rank's shard under its name (none under another hpc_ckpt number).
    assert sorted(f for f in os.listdir(run_dir) if "hpc_ckpt" in f) == ["hpc_ckpt_1.ckpt"]
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    assert sorted(f for f in os.listdir(run_dir / ".topk-shards") if "hpc_ckpt" in f) == ["hpc_ckpt_1.ckpt"]
    saved = torch.load(hpc, weights_only=True, map_location="cpu")
    meta = saved["lightning_topk"]
    assert meta["world_size"] == 4 and meta["num_nodes"] == 2
    for r in range(4):
        shard, why = ck.read_shard(ck.shard_path(hpc, r), meta, r)
        assert why == "" and shard["residual"], (r, why)
    # Lightning's handler ran once, in rank 0's training process: not again for a second delivery of the
    # signal, and not in a DataLoader worker (SLURM signals those too).
    assert text.count("Handling auto-requeue signal") == 1 and text.count(f"Requeued SLURM job: {job}") == 1
    assert "checkpointing after the current step" in text  # the handler ran at a step boundary

    # The requeued job resumed from it.
    assert text.count(f"run.resume=auto: resuming from {hpc}") == 4, text[-4000:]
    assert f"Restoring states from the checkpoint path at {hpc}" in text

    # The final test ran on the weights fit ended with, not on the hpc checkpoint.
    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary["global_step"]
    assert summary["epochs"] == EPOCHS and 0 < saved["global_step"] < final
    assert text.count(f"run.test: test ran on the final weights (global step {final})") == 4
    after_fit = text[text.rindex("`Trainer.fit` stopped"):]
    assert "Restoring states" not in after_fit
    assert 0.5 < summary["metrics"]["test/acc"] <= 1.0
    print(f"real SLURM requeue test: job {job}, hpc checkpoint at step {saved['global_step']} of {final}, "
          f"{time.monotonic() - t0:.0f} s")
    (tmp_path / "job.log").write_text(text)


def test_sbatch_example_with_topk_fsdp_requeued_in_the_middle_resumes(cluster, tmp_path):
    """The same submission with ``strategy=topk_fsdp``: the requeue checkpoint is a distributed checkpoint folder
    (the model's shards and ``topk/``: every rank's residual shard and file), written by every rank at the same
    step boundary, and the requeued job resumes from it."""
    overrides = [o for o in OVERRIDES if not o.startswith(("strategy.", "trainer.max_epochs"))] + [
        "strategy=topk_fsdp", "strategy.exchange=allgather", "trainer.max_epochs=4"]
    job, run_dir, text, info = _submit_and_requeue(cluster, tmp_path, overrides)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    assert sorted(f for f in os.listdir(run_dir) if "hpc_ckpt" in f) == ["hpc_ckpt_1.ckpt"] and hpc.is_dir()
    assert {f"rank{r}.pt" for r in range(4)} <= set(os.listdir(hpc / "topk")), os.listdir(hpc / "topk")
    assert "checkpointing after the current step" in text
    assert text.count(f"run.resume=auto: resuming from {hpc}") == 4, text[-4000:]
    assert "topk_fsdp: residuals restored" in text, text[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 4 and 0.5 < summary["metrics"]["test/acc"] <= 1.0
