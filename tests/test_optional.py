"""lightning_topk.optional: one-line errors naming the extra that installs a missing dependency."""
import pytest

from lightning_topk.optional import MissingDependency, find_missing, install_hint, require


def test_require_returns_the_module_or_names_the_extra(monkeypatch):
    assert require("json", "data", "x").dumps([1]) == "[1]"
    modules = __import__("sys").modules
    for name in [m for m in modules if m == "sklearn" or m.startswith("sklearn.")] + ["sklearn"]:
        monkeypatch.setitem(modules, name, None)  # as if not installed, even if another test imported it
    with pytest.raises(MissingDependency, match=r"^mnist needs scikit-learn, which is not installed: "
                       r"pip install 'lightning-topk\[data\]'$"):
        require("sklearn.datasets", "data", "mnist", package="scikit-learn")


def test_require_does_not_hide_a_broken_import_inside_the_module(tmp_path, monkeypatch):
    (tmp_path / "brokenpkg.py").write_text("import not_a_module_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="not_a_module_anywhere_xyz"):
        require("brokenpkg", "data", "x")


def test_find_missing_unwraps_chains_and_rejects_unknown_extras():
    inner = MissingDependency("m")
    try:
        try:
            raise inner
        except MissingDependency as e:
            raise RuntimeError("wrapped, as Hydra's InstantiationException does") from e
    except RuntimeError as outer:
        assert find_missing(outer) is inner
    assert find_missing(ValueError("no")) is None
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        install_hint("gpu")
