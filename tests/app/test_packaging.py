"""Install and public names: a wheel builds with no setuptools warning, and every class the docs name imports
as the docs write it (``lightning_topk.Name``, ``from lightning_topk[.x] import Name``, or a bare ``Name(...)``)."""
import importlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_FROM = re.compile(r"from (lightning_topk(?:\.\w+)*) import \(?([\w\s,]+?)\)?\s*(?:#|$)", re.M)


def _classes():
    """Every class defined in the package's source, by name."""
    return {m.group(1) for f in (ROOT / "lightning_topk").rglob("*.py")
            for m in re.finditer(r"^class ([A-Z]\w*)", f.read_text(), re.M)}


def _named(text, classes):
    """(module, name) pairs the text imports or uses: explicit imports as written; ``lightning_topk.Name`` and a
    project class called bare (``Name(``) not imported from a submodule in the same page: from ``lightning_topk``."""
    pairs, imported = set(), set()
    for m in _FROM.finditer(text):
        for name in filter(None, (n.strip() for n in m.group(2).split(","))):
            pairs.add((m.group(1), name))
            imported.add(name)
    pairs |= {("lightning_topk", n) for n in re.findall(r"(?<![\w.])lightning_topk\.([A-Z]\w*)(?![\w/])", text)}
    pairs |= {("lightning_topk", n) for n in re.findall(r"(?<![\w.])([A-Z]\w*)\(", text)
              if n in classes and n not in imported}
    return pairs


def test_every_name_the_docs_use_imports_as_written():
    classes, missing, checked = _classes(), [], 0
    for page in DOCS:
        for module, name in sorted(_named(page.read_text(), classes)):
            checked += 1
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{page.name}: {module}.{name}")
    assert missing == []
    assert checked > 20  # the scan found the docs' names (TopKDDPStrategy, TopKFSDPStrategy, TopKConfig, ...)
    import lightning_topk

    assert set(lightning_topk.__all__) >= set(lightning_topk._EXPORTS)
    assert {"TopKFSDPStrategy", "TopKDDPStrategy", "TopKConfig"} <= set(lightning_topk.__all__)


@pytest.mark.timeout(120)
def test_wheel_builds_without_a_setuptools_warning(tmp_path):
    # a copy of what git sees (no build/ or egg-info left in the checkout), built without isolation (offline)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tmp_path / "src" / rel)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(tmp_path / "src")], capture_output=True, text=True, timeout=110)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert [line for line in out.splitlines() if "warn" in line.lower()] == [], out[-3000:]
    import zipfile

    names = zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist()
    conf = sorted(p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml"))
    assert sorted(n[len("lightning_topk/conf/"):] for n in names if n.startswith("lightning_topk/conf/")
                  and n.endswith(".yaml")) == conf
    assert "lightning_topk/data/packaged/digits.npz" in names and "lightning_topk/kernels/compact.cu" in names
