import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def run_script(args, timeout=600, env=None, cwd=None):
    """Run a Python script in a fresh process (Lightning's popen launcher re-runs sys.argv)."""
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("LOCAL_RANK", None)
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
