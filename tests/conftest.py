"""Fixtures and markers shared by every test folder. Markers: ``slow`` (long multi-process runs, still in
CI; ``-m "not slow"`` skips them), ``gpu`` (needs CUDA and CuPy; skipped without them) and ``slurm`` (starts a
real SLURM on this host; needs root and Debian's slurm-wlm/munge, which ``.ci/slurm_setup`` installs)."""
import os

import pytest

from tests.helpers.procs import ROOT


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        try:
            import cupy  # noqa: F401
            return
        except ImportError:
            pass
    skip = pytest.mark.skip(reason="needs a CUDA device and CuPy (not available on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(autouse=True)
def _restore_environ():
    """Lightning's launchers write MASTER_PORT, LOCAL_RANK, WORLD_SIZE... into os.environ; a later
    subprocess that inherits a stale MASTER_PORT can rendezvous with a stranger and hang."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _restore_rank_zero():
    """A Trainer built in this process under a SLURM environment (tests/app/test_slurm.py) sets Lightning's
    process-wide ``rank_zero_only.rank`` to that task's rank; later tests would then see no rank-zero
    warning at all. Restored after each test."""
    import importlib

    mods = []
    for name in ("lightning_fabric.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        try:
            mods.append(importlib.import_module(name).rank_zero_only)
        except ImportError:
            continue
    saved = [getattr(m, "rank", 0) for m in mods]
    yield
    for m, r in zip(mods, saved):
        m.rank = r


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on a shared 2-core machine: OpenMP waits would dominate. Restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
