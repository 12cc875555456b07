"""The result tables of BENCHMARKS.md (and docs/local_sgd.md's outer-step table, docs/convergence.md's AdamW-per-step
table, docs/modes.md's frontier summary), the README's default-job block and the plots of docs/plots/ are what ``tools/render_results.py`` renders from the recorded results, and the
documentation's build command is the same in the README and in CI."""
import json
import sys

from tests.helpers.procs import ROOT, load_tool


def _tool():
    return load_tool("render_results")


def test_benchmarks_tables_are_the_rendering_of_the_results():
    tool = _tool()
    assert set(tool.files()) == {"README.md", "BENCHMARKS.md", "docs/local_sgd.md", "docs/convergence.md",
                                 "docs/compatibility.md", "docs/modes.md"}
    for name, (rel, _, _) in tool.BLOCKS.items():
        assert tool.block(name) in (ROOT / rel).read_text(), f"{rel}'s {name!r} block is not what its data renders"
    assert tool.main(["--check"]) == 0


def test_outer_step_table_bolds_the_recipe_auto_takes():
    table = _tool().outer_recipe_table()
    assert "| SGD 0.1 | 2 | 0.918 | +1.3 | **+5.7** |" in table  # DiLoCo's step for SGD without momentum
    assert "| Adam 1e-3 | 4 | 0.912 | **\u22121.8** |" in table  # plain averaging for Adam


def test_check_fails_on_a_hand_edited_table(tmp_path, monkeypatch):
    tool = _tool()
    text = (ROOT / "BENCHMARKS.md").read_text()
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(text.replace("| **9.2 (24)** |", "| **9.1 (24)** |", 1))
    assert edited.read_text() != text
    monkeypatch.setattr(tool, "BENCHMARKS", str(edited))
    assert tool.main(["--check"]) == 1


def test_check_fails_on_a_stale_summary_row(tmp_path, monkeypatch):
    tool = _tool()
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert tool.block("summary") in text and "| 19.2x and 26.0x | yes | `select.json` |" in tool.summary()
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(text.replace("| 19.2x and 26.0x |", "| 16.5x and 18.6x |", 1))  # an older host's figures
    monkeypatch.setattr(tool, "BENCHMARKS", str(edited))
    assert tool.main(["--check"]) == 1


def test_one_command_renders_the_readme_block_with_main_job_figures(tmp_path, monkeypatch):
    tool = _tool()
    readme = (ROOT / "README.md").read_text()
    assert tool.render(readme, "README.md") == readme  # the recorded run, as tools/main_job_figures.py renders it
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace("test/acc", "test/acc ", 1))
    monkeypatch.setattr(tool, "README", str(edited))
    assert tool.main(["--check"]) == 1
    monkeypatch.setattr(tool, "files", lambda: ["README.md"])  # write nothing but the copy
    monkeypatch.setattr(tool, "stale_plots", list)
    assert tool.main([]) == 0 and edited.read_text() == readme  # the one command puts it back


def test_plots_record_their_data_and_a_stale_plot_fails(tmp_path, monkeypatch):
    tool = _tool()
    recorded = json.loads((ROOT / "docs" / "plots.json").read_text())
    assert set(recorded) == set(tool.PLOTS) == {"time_to_accuracy", "time_to_accuracy_local", "cluster", "bytes_per_step",
                                                 "scale_sim", "loss_curves", "frontier", "frontier_runs"}
    for name, rec in recorded.items():
        assert (ROOT / rec["png"]).is_file() and rec["sha256"] == tool.plot_hash(name)
        assert f"docs/plots/{name}.png" in (ROOT / "BENCHMARKS.md").read_text()
    assert tool.stale_plots() == []
    # newer data for one plot: its recorded hash no longer matches, and the check fails
    stale = dict(recorded, loss_curves=dict(recorded["loss_curves"], sha256="0" * 64))
    (tmp_path / "plots.json").write_text(json.dumps(stale))
    monkeypatch.setattr(tool, "PLOTS_JSON", str(tmp_path / "plots.json"))
    assert tool.stale_plots() == ["loss_curves"]
    assert tool.main(["--check"]) == 1


def test_plots_are_drawn_the_same_twice_without_a_date(tmp_path, monkeypatch):
    tool = _tool()
    monkeypatch.setattr(tool, "PLOTS_DIR", str(tmp_path))
    first = open(tool.draw_plot("loss_curves"), "rb").read()
    again = open(tool.draw_plot("loss_curves"), "rb").read()
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and first == again
    assert b"Software" not in first and b"Creation" not in first


def test_plot_data_is_what_the_results_hold():
    tool = _tool()
    t = tool.time_to_accuracy_data()
    assert t["target"] == 0.8 and set(t["panels"]) == {"4x1 1gbit", "2x2 1gbit", "4x1 100mbit", "2x2 100mbit"}
    assert t["panels"]["4x1 1gbit"]["topk_0.01"][-1] == [7.6567, 0.803]  # reached 0.8 at the recorded 7.66 s
    local = tool.time_to_accuracy_local_data()["panels"]
    assert "topk_local_stream" not in local["4x1 10mbit"] and "ddp_fp16" not in local["4x1 10mbit"]  # no evals
    assert "topk_local" in local["4x1 10mbit"] and "ddp_fp16" in local["4x1 100mbit"]
    b = tool.bytes_per_step_data()["models"]["ResNet-50"]
    assert b["hierarchical"][0][0] == 2 and b["all-gather"][-1][0] == 128  # 2 to 128 nodes of 8 ranks
    time, tokens = tool.loss_curves_data()["panels"]  # against training time, then against tokens
    assert set(tokens["curves"]) == set(time["curves"]) == {"ddp", "topk_local (transformer_lm_bytes preset)",
                                                            "topk_local (registered defaults)"}
    c = tool.cluster_data()
    assert set(c["panels"]) == {"4x1 1gbit", "2x2 1gbit", "4x1 100mbit", "2x2 100mbit"}
    assert "topk_hier_0.01" in c["panels"]["2x2 100mbit"] and "topk_hier_0.01" not in c["panels"]["4x1 100mbit"]


def test_only_render_results_draws():
    """The benchmark scripts write results; every plot people look at is drawn from them by one tool."""
    drawing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if "matplotlib" in p.read_text()]
    assert drawing == []
    assert sorted(p.name for p in (ROOT / "docs" / "plots").glob("*.png")) == sorted(
        f"{name}.png" for name in _tool().PLOTS)
    assert not list((ROOT / "benchmarks" / "results").glob("*.png"))


def test_benchmarks_write_results_with_date_host_and_command(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _results import write_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = write_results("x", [{"a": 1}], [str(ROOT / "benchmarks" / "x.py"), "--n", "2"], directory=str(tmp_path))
    d = json.loads(open(path).read())
    assert d["rows"] == [{"a": 1}] and d["command"] == "python benchmarks/x.py --n 2"
    assert d["date"].endswith("Z") and d["host"]["name"] and d["host"]["platform"]
    scale = json.loads((ROOT / "benchmarks" / "results" / "scale_sim.json").read_text())
    assert {"date", "host", "command", "rows"} <= set(scale)


def test_ci_runs_exactly_the_readme_command_with_the_docs_build():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("bash .ci/setup && ") and f"\n{ci}\n" in readme
    assert "&& .venv/bin/mkdocs build --strict -q -d site &&" in ci
