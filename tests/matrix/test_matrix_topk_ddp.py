"""The support matrix's topk_ddp cells on real gloo processes (lightning_topk.support; tests/matrix/cells.py)."""
import pytest

from tests.matrix.cells import REFUSED, SUPPORTED, Launches, check_refused, check_supported

OURS = [c for c in SUPPORTED if c["strategy"] == "topk_ddp"]
OURS_REFUSED = [c for c in REFUSED if c["strategy"] == "topk_ddp"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    base = tmp_path_factory.mktemp("matrix_ddp")
    ours = Launches(OURS + OURS_REFUSED, base)
    return ours, Launches([c for c in OURS if c["api"] == "trainer"], base, "ddp")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("c", OURS, ids=[c["id"] for c in OURS])
def test_supported_cell(c, launches):
    ours, ref = launches
    check_supported(c, ours, ref if c["api"] == "trainer" and c["strategy"] == "topk_ddp" else None)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("c", OURS_REFUSED, ids=[c["id"] for c in OURS_REFUSED])
def test_refused_cell(c, launches):
    check_refused(c, launches[0])
