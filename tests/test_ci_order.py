"""The order CI hands test modules to its two xdist workers (tests/conftest.py): long modules first."""
from types import SimpleNamespace

from tests.conftest import LONG_FIRST, _module_order
from tests.helpers.procs import ROOT


def test_every_long_first_module_exists():
    # a renamed module would silently lose its place at the front
    assert [p for p in LONG_FIRST if not (ROOT / p).is_file()] == []


def test_long_modules_come_first_and_every_module_stays_in_one_piece():
    ids = ["tests/a.py::t1", "tests/b.py::t1", "tests/b.py::t2", f"{LONG_FIRST[1]}::x", "tests/a.py::t2",
           f"{LONG_FIRST[0]}::y", "tests/c.py::t1", "tests/c.py::t2", "tests/c.py::t3"]
    got = [i.nodeid for i in _module_order([SimpleNamespace(nodeid=n) for n in ids])]
    assert got == [f"{LONG_FIRST[0]}::y", f"{LONG_FIRST[1]}::x", "tests/c.py::t1", "tests/c.py::t2", "tests/c.py::t3",
                   "tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/b.py::t2"]
