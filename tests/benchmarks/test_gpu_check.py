"""benchmarks/gpu_check.sh, the one command for every GPU check, on a machine without a GPU: one line, no
report, exit 0. (On a GPU it runs for minutes and writes its report; that is run by hand, not here.)"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.procs import ROOT

SCRIPTS = [ROOT / "benchmarks" / "gpu_check.sh", ROOT / "benchmarks" / "gpu_wheels.sh"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would run every check")
def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    p = subprocess.run(["bash", str(SCRIPTS[0])], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device: nothing checked"), p.stdout
    assert "sees none" in lines[0] and p.stderr == ""
    assert list(tmp_path.iterdir()) == []  # no report, no install


def test_python_steps_refuse_an_unknown_step():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "everything"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "usage:" in p.stderr and "syncs" in p.stderr
    probe = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "probe"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == (0 if torch.cuda.is_available() else 3), probe.stdout


def test_scripts_parse_and_wheels_are_ignored_by_git():
    for s in SCRIPTS:
        p = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert p.returncode == 0, (s, p.stderr)
        if shutil.which("shellcheck"):
            p = subprocess.run(["shellcheck", str(s)], capture_output=True, text=True)
            assert p.returncode == 0, p.stdout
    p = subprocess.run(["git", "check-ignore", "-q", "benchmarks/wheels/x.whl"], cwd=ROOT)
    assert p.returncode == 0  # the carried wheels never get committed
