"""The torch-only core in a plain ``torch.multiprocessing.spawn`` harness ends cleanly (issue 41, defect 11):
the default gloo group is destroyed by an exit handler while the interpreter is whole, not torn down during its
finalization, where torch aborts now and then ("terminate called without an active exception")."""
import subprocess
import sys

import pytest

from tests.helpers.dist import free_port
from tests.helpers.procs import ROOT, SCRIPTS

RUNS = 10  # 30 measured by hand (issue 41): 0 aborts; the plain harness without the project: 5 of 30


def _harness(*args, timeout=180):
    return subprocess.run([sys.executable, str(SCRIPTS / "spawn_exit.py"), str(free_port()), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(240)
def test_the_core_destroys_the_gloo_group_before_finalization(tmp_path):
    p = _harness("--report", tmp_path)
    # The abort is not gone: a CI run on 2026-11-28 saw one here (rank 1, SIGABRT) with the handler in place, so
    # defect 11 stays open; what this test holds is the handler's part: the group is gone before finalization on
    # every rank that got to its exit handlers.
    assert p.returncode in (0, 1), p.stderr[-3000:]
    reports = [(tmp_path / f"{r}.txt").read_text() for r in range(2) if (tmp_path / f"{r}.txt").exists()]
    assert reports and set(reports) == {"destroyed"}, (reports, p.stderr[-3000:])
    for r in range(2):
        (tmp_path / f"{r}.txt").unlink(missing_ok=True)
    # the same harness without the project leaves the group to finalization (what the handler prevents)
    q = _harness("--plain", "--report", tmp_path)
    assert q.returncode in (0, 1), q.stderr[-3000:]  # 1: torch's own abort at exit, now and then
    assert [(tmp_path / f"{r}.txt").read_text() for r in range(2)] == ["alive", "alive"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.xfail(reason="torch's finalization abort still shows now and then with the exit handler (1 in a CI run, "
                          "0 in 30 by hand); issue 41, defect 11, is open", strict=False)
def test_no_abort_at_exit_in_repeated_spawn_runs():
    bad = []
    for i in range(RUNS):
        p = _harness()
        if p.returncode != 0 or "terminate called" in p.stderr:
            bad.append((i, p.returncode, p.stderr[-500:]))
    assert bad == []
