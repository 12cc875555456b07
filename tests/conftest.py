import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def run_script(args, timeout=420, env=None, cwd=None):
    """Run a Python script in a fresh process (Lightning's popen launcher re-runs sys.argv)."""
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    # In-process Trainers of other tests may have exported these; a stale MASTER_PORT makes the child
    # rendezvous with whatever else listens there, and hang.
    for k in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "GROUP_RANK",
              "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS"):
        e.pop(k, None)
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=e, cwd=cwd or ROOT)
    if p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on a shared 2-core machine: OpenMP waits would dominate. Restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
