"""Fixtures and markers shared by every test folder. Markers: ``slow`` (long multi-process runs, still in
CI; ``-m "not slow"`` skips them), ``gpu`` (needs CUDA and CuPy; skipped without them) and ``slurm`` (starts a
real SLURM on this host; needs root and Debian's slurm-wlm/munge, which ``.ci/slurm_setup`` installs)."""
import os

import pytest

from tests.helpers.procs import ROOT

# The modules that take longest on the 2-core CI machine (seconds there: their slowest tests in the CI log's
# --durations), longest first. Under `pytest -n 2 --dist loadscope` each module goes to one worker in collection
# order (pytest_xdist_make_scheduler below), so these start first and the run does not end with one worker
# idle while the other works through a long module that was handed out last. Keep a new module that takes
# more than ~20 s in this list.
LONG_FIRST = (
    "tests/app/test_slurm_real.py",  # ~243 s: one real SLURM, three sbatch jobs in a row
    "tests/app/test_cli.py",  # ~130 s
    "tests/matrix/test_matrix_topk_ddp.py",  # ~110 s: 10 launches of the support matrix's cells
    "tests/lightning/test_elastic.py",  # ~300 s in all, many short tests
    "tests/matrix/test_matrix_topk_fsdp.py",  # ~80 s
    "tests/comm/test_teardown.py",  # ~75 s: 10 spawned pairs in a row (was handed out 65th of 70, near the end)
    "tests/lightning/test_convergence.py",  # ~75 s: two 24-epoch fits on 2 processes
    "tests/app/test_plain_install.py",  # ~60 s: pip into a fresh venv
    "tests/lightning/test_faults.py",  # ~90 s
    "tests/comm/test_scatter.py",  # ~70 s: a 4-process training fixture
    "tests/lightning/test_precision_ddp.py",  # ~70 s
    "tests/data/test_data_resume_ddp.py",  # ~60 s
    "tests/benchmarks/test_cluster_wire.py",  # ~45 s
    "tests/data/test_data_ddp.py",  # ~40 s: a 2-rank, 2-worker fixture
    "tests/lightning/test_mode.py",  # ~40 s
    "tests/benchmarks/test_cluster_smoke.py",  # ~35 s
    "tests/data/test_packaged_text.py",  # ~30 s
    "tests/lightning/test_strategy.py",  # ~25 s
    "tests/comm/test_sharded.py",  # ~20 s
)


def _module_order(items):
    """Modules in LONG_FIRST first, in its order; then the others by number of tests, most first (what
    pytest-xdist's loadscope does by itself). Tests keep their order within a module."""
    count: dict = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        count[path] = count.get(path, 0) + 1
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    first_seen = {path: i for i, path in enumerate(count)}
    key = lambda path: (rank.get(path, len(rank)), -count[path], first_seen[path])
    return sorted(items, key=lambda item: key(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """loadscope, handing modules out in the collection order :func:`_module_order` set (long ones first)
    rather than re-sorting them by number of tests."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False
    return LoadScopeScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    items[:] = _module_order(items)
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
