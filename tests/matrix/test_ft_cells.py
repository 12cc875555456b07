"""The support matrix's torchft cells run in the torchft harness (tests/lightning/test_elastic*.py): every test
tests/matrix/cells.py names for a cell exists there, and the matrix supports each such cell."""
import ast

import pytest

from lightning_topk import support
from tests.helpers.procs import ROOT
from tests.matrix.cells import FT_CELLS


@pytest.mark.parametrize("c,test", FT_CELLS, ids=[f"{t.split('::')[1]}-{c['id']}" for c, t in FT_CELLS])
def test_each_torchft_cell_names_a_test_that_exists(c, test):
    path, name = test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert name in names, f"{test} does not exist"
    assert support.status(c)[0] == "supported", (c["id"], support.status(c))
