"""A user's first run: a fresh virtual environment, ``pip install torch==2.13.0 <repo>`` with no extras and
not editable, then ``lightning-topk-train`` for one epoch (``.ci/plain_install_check``). About 3 minutes on
the 2-core build machine, most of it pip."""
import subprocess

import pytest

from tests.helpers.procs import ROOT


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_job_runs_from_a_plain_install():
    p = subprocess.run(["bash", str(ROOT / ".ci" / "plain_install_check")], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "plain_install_check: OK" in p.stdout
