"""The README's figures for the default job are what the job printed: ``tools/main_job_figures.py`` wrote them
from one run, and nobody edited them by hand since."""
import json

from tests.helpers.procs import ROOT, load_tool


def _tool():
    return load_tool("main_job_figures")


def test_readme_block_is_the_rendering_of_the_recorded_run():
    tool = _tool()
    record = json.loads((ROOT / "docs" / "main_job.json").read_text())
    assert tool.readme_block((ROOT / "README.md").read_text()) == tool.block(record)
    assert tool.main(["--check"]) == 0


def test_the_recorded_default_run_shows_the_sparse_exchange_at_work():
    s = json.loads((ROOT / "docs" / "main_job.json").read_text())["summary"]
    assert s["strategy"] == "topk_ddp" and s["world_size"] == 2
    assert 0 < s["bytes"]["density"] < 1 and s["bytes"]["ratio"] > 1
    ex = s["exchange"]
    assert ex["configured"] == "allgather" and ex["buckets_per_step"].get("allgather", 0) >= 1
    assert ex["auto_would"]["buckets"], "a pinned run says what exchange='auto' would have sent"
    assert s["metrics"]["test/acc"] > 0.9


def test_check_fails_on_a_hand_edited_readme(tmp_path, monkeypatch):
    tool = _tool()
    readme = (ROOT / "README.md").read_text()
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace("test/acc", "test/acc ", 1))
    monkeypatch.setattr(tool, "README", str(edited))
    assert tool.main(["--check"]) == 1
