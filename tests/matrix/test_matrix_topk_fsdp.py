"""The support matrix's topk_fsdp cells on real gloo processes (lightning_topk.support; tests/matrix/cells.py)."""
from tests.matrix.cells import module_tests

launches, test_supported_cell, test_refused_cell = module_tests("topk_fsdp")
