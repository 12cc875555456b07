"""The result tables of BENCHMARKS.md (and docs/local_sgd.md's outer-step table) are what
``tools/render_results.py`` renders from ``benchmarks/results/``, and the documentation's build command is the same
in the README and in CI."""
import importlib.util

from tests.helpers.procs import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_tables_are_the_rendering_of_the_results():
    tool = _tool()
    assert set(tool.files()) == {"BENCHMARKS.md", "docs/local_sgd.md"}
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


def test_ci_runs_exactly_the_readme_command_with_the_docs_build():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("bash .ci/setup && ") and f"\n{ci}\n" in readme
    assert "&& .venv/bin/mkdocs build --strict -q -d site &&" in ci
