"""The byte-level text shipped in the package (data=bytes_text): it loads, is bytes, splits deterministically,
and the preset experiment=transformer_lm_bytes learns from it with topk_local at 2 nodes through the CLI."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from lightning_topk.data import byte_sequences, ensure_text_shards, load_text
from lightning_topk.data.text import VOCAB_SIZE
from tests.helpers.dist import free_port
from tests.helpers.procs import ROOT, load_tool, python_for


def test_packaged_text_loads_as_bytes_with_a_deterministic_split():
    text = load_text()
    assert 700_000 < len(text) <= 768 * 1024
    assert text.decode("utf-8").startswith("# __future__\n")  # real UTF-8 text, as the tool writes it
    assert len(set(text)) > 64  # prose: many distinct byte values, all < VOCAB_SIZE by construction
    assert VOCAB_SIZE == 256
    train, val = byte_sequences(seq_len=65, val_fraction=0.05, seed=0)
    n = len(text) // 65
    assert train.dtype == np.uint8 and train.shape[1] == 65 and len(train) + len(val) == n
    assert len(val) == round(n * 0.05)
    # every sequence is a 65-byte slice of the text at a multiple of 65, each exactly once
    starts = sorted(text.find(bytes(s)) for s in np.concatenate([train, val])[:200])
    assert all(s >= 0 for s in starts)
    t2, v2 = byte_sequences(seq_len=65, val_fraction=0.05, seed=0)
    assert np.array_equal(train, t2) and np.array_equal(val, v2)  # deterministic
    t3, _ = byte_sequences(seq_len=65, val_fraction=0.05, seed=1)
    assert not np.array_equal(train, t3)  # the seed shuffles
    whole = np.frombuffer(text[: n * 65], dtype=np.uint8).reshape(n, 65)
    assert np.array_equal(np.sort(np.concatenate([train, val]).view("S65").ravel()), np.sort(whole.view("S65").ravel()))
    with pytest.raises(ValueError, match="seq_len"):
        byte_sequences(seq_len=1)
    with pytest.raises(ValueError, match="val_fraction"):
        byte_sequences(val_fraction=1.0)


def test_text_shards_and_the_tool_check(tmp_path, capsys):
    shards = ensure_text_shards(str(tmp_path), seq_len=129, num_shards=2)
    assert len(shards["train"]) == 2 and len(shards["val"]) == 1 and all(os.path.isfile(p) for p in shards["train"])
    assert ensure_text_shards(str(tmp_path), seq_len=129, num_shards=2) == shards  # written once
    tool = load_tool("make_packaged_text")
    if sys.version.split()[0] == tool.SOURCE_VERSION:
        assert tool.main(["--check"]) == 0 and "matches" in capsys.readouterr().out
    else:
        assert tool.main(["--check"]) == 2 and "not compared" in capsys.readouterr().out


def test_lm_bytes_preset_with_topk_local_at_two_nodes_learns(tmp_path):
    """python -m lightning_topk experiment=transformer_lm_bytes strategy=topk_local, 2 nodes x 1 process (real
    gloo processes, NODE_RANK per process), 48 steps = 3 outer rounds of H=16: the held-out loss falls from
    ln(256) toward what the text allows, and the summary names the mode."""
    port = str(free_port())
    args = ["experiment=transformer_lm_bytes", "strategy=topk_local", "trainer.accelerator=cpu", "trainer.devices=1",
            "trainer.num_nodes=2", "trainer.max_steps=48", "trainer.log_every_n_steps=1",
            "trainer.num_sanity_val_steps=0", "trainer.enable_model_summary=false", "data.num_workers=0",
            "callbacks.progress_bar=null", "callbacks.checkpoint=null", "run.threads=1", "run.resume=never",
            "model.net.d_model=64"]
    procs = []
    for node in range(2):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK")}
        env.update(LIGHTNING_TOPK_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, NODE_RANK=str(node))
        exe, env = python_for(env)  # a zygote's child (torch, Lightning imported once), as in test_cli
        procs.append(subprocess.Popen([exe, "-m", "lightning_topk", *args,
                                       f"hydra.run.dir={tmp_path / f'node{node}'}"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    s = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert s["world_size"] == 2 and s["num_nodes"] == 2 and s["global_step"] == 48
    assert "local" in s["mode"] and "16" in s["mode"]
    first = _first_train_loss(tmp_path / "node0")
    assert first > math.log(256) - 0.3  # an untrained byte model: about uniform over 256 values
    assert s["metrics"]["test/loss"] < first - 1.0  # 3 outer rounds later, on held-out sequences


def _first_train_loss(run_dir) -> float:
    import csv

    (path,) = run_dir.glob("csv/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("train/loss")]
    return float(min(rows, key=lambda r: int(r["step"]))["train/loss"])


def test_every_packaged_file_is_package_data():
    """A file under lightning_topk/data/packaged that pyproject.toml does not list is missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p.name for p in (ROOT / "lightning_topk" / "data" / "packaged").iterdir() if p.is_file()}
    assert {"stdlib_docs.txt.gz", "stdlib_docs.LICENSE.txt"} <= shipped
    assert shipped <= set(listed["lightning_topk.data.packaged"])


def test_packaged_datamodule_text_options_fail_fast(tmp_path):
    from lightning_topk.app.factories import packaged_datamodule

    with pytest.raises(ValueError, match="seq_len"):
        packaged_datamodule("bytes_text", cache_dir=str(tmp_path))  # no seq_len
    with pytest.raises(ValueError, match="image_size"):
        packaged_datamodule("bytes_text", cache_dir=str(tmp_path), seq_len=65, image_size=8)
    with pytest.raises(ValueError, match="seq_len applies to dataset='bytes_text' only"):
        packaged_datamodule("digits", cache_dir=str(tmp_path), seq_len=65)
    dm = packaged_datamodule("bytes_text", cache_dir=str(tmp_path), seq_len=65, keys=["npy"], num_workers=0)
    assert len(dm.train_shards) == 4 and len(dm.val_shards) == 1
