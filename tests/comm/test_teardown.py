"""The torch-only core in a plain ``torch.multiprocessing.spawn`` harness ends cleanly (issue 41, defect 11):
the default gloo group is destroyed by an exit handler while the interpreter is whole, and gloo workers that
something still holds get the GIL before finalization, where torch aborts now and then ("terminate called without
an active exception": a worker dropping a finished work's tensor takes the GIL during finalization; a core dump's
stack is in lightning_topk/comm/teardown.py)."""
import subprocess
import sys

import pytest

from tests.helpers.dist import free_port
from tests.helpers.procs import ROOT, SCRIPTS

RUNS = 10  # by hand, under a load of 5-13 on 2 cores (issue 41): see test_no_abort_at_exit_in_repeated_spawn_runs


def _harness(*args, timeout=180):
    return subprocess.run([sys.executable, str(SCRIPTS / "spawn_exit.py"), str(free_port()), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(240)
def test_the_core_destroys_the_gloo_group_before_finalization(tmp_path):
    p = _harness("--report", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
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
def test_no_abort_at_exit_in_repeated_spawn_runs():
    """The stress harness: 20 collectives on temporaries right before the end, the world group held in a global
    (so ``destroy_process_group`` cannot free it and its workers outlive the destroy). Measured by hand on
    2026-11-28, the harness without the project aborted 2 of 20 and 1 of 10 runs; with the handler's destroy alone
    (nothing held) 0 of 20; held and drained 0 of 20 (see the module docstring for what the drain does)."""
    # RUNS spawns of 2 fresh processes each, from one launcher (a launcher per run was another interpreter
    # importing torch per run, about a tenth of the test's time, and no part of what can abort: the spawned
    # processes' exit). A failed run is named on stderr; an abort also prints "terminate called".
    p = _harness("--stress", "--runs", RUNS, timeout=1100)
    assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-3000:])
    assert "failed" not in p.stderr, p.stderr[-3000:]
