"""BENCHMARKS.md's result tables are what ``tools/render_results.py`` renders from ``benchmarks/results/``, and the
documentation's build command is the same in the README and in CI."""
import importlib.util

from tests.helpers.procs import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_tables_are_the_rendering_of_the_results():
    tool = _tool()
    text = (ROOT / "BENCHMARKS.md").read_text()
    for name in tool.BLOCKS:
        assert tool.block(name) in text, f"BENCHMARKS.md's {name!r} block is not what its data renders"
    assert tool.main(["--check"]) == 0


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
