"""The test zygote (tests/helpers/zygote.py) runs a script as a fresh ``python script.py`` would: same argv,
environment, working directory, streams, exit code, signals; the ranks it starts come from it too, and
talking ranks differ in their string hash seed."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import zygote
from tests.helpers.procs import python_for

PROBE = r'''
import json, os, sys
import lightning_topk.lightning.strategy  # preloaded in the zygote: no import here
out = {"argv": sys.argv, "cwd": os.getcwd(), "flag": os.environ.get("ZYG_FLAG"), "hash": hash("lightning_topk"),
       "path0": sys.path[0], "main": __name__, "exe": sys.executable, "rank": os.environ.get("LOCAL_RANK")}
if os.environ.get("LOCAL_RANK") is None:  # start "rank 1" as Lightning's launcher does: sys.executable, same script
    import subprocess
    kid = subprocess.run([sys.executable, os.path.abspath(sys.argv[0]), "child"], capture_output=True, text=True,
                         env=dict(os.environ, LOCAL_RANK="1"))
    out["child"] = json.loads(kid.stdout)
    out["child_code"] = kid.returncode
print(json.dumps(out))
sys.stderr.write("to stderr\n")
sys.exit(int(os.environ.get("ZYG_EXIT", "0")))
'''


def _env(**kw):
    e = dict(os.environ, OMP_NUM_THREADS="1", **kw)
    for k in ("LOCAL_RANK", "NODE_RANK"):
        e.pop(k, None)
    return e


def test_a_script_runs_as_in_a_fresh_interpreter(tmp_path):
    import json

    (tmp_path / "probe.py").write_text(PROBE)
    exe, env = python_for(_env(ZYG_FLAG="yes", ZYG_EXIT="3"))
    if exe == sys.executable:
        pytest.skip("the zygote could not start here")
    p = subprocess.run([exe, "probe.py", "a", "b"], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert p.returncode == 3 and p.stderr.endswith("to stderr\n"), p.stderr
    out = json.loads(p.stdout)
    assert out["argv"] == ["probe.py", "a", "b"] and out["cwd"] == str(tmp_path) and out["flag"] == "yes"
    assert out["main"] == "__main__" and out["path0"] == str(tmp_path) and out["exe"] == zygote.shim()
    child = out["child"]
    assert out["child_code"] == 3 and child["rank"] == "1" and child["argv"][1:] == ["child"]
    assert child["exe"] == zygote.shim()  # rank 1 came from a zygote too...
    assert child["hash"] != out["hash"]  # ...the other one: different hash seeds, as separate interpreters


def test_signals_reach_the_script_and_a_killed_client_ends_it(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, signal, sys, time\n"
                      "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(42))\n"
                      "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    exe, env = python_for(_env())
    if exe == sys.executable:
        pytest.skip("the zygote could not start here")
    for sig, code in ((signal.SIGUSR1, 42), (signal.SIGKILL, -signal.SIGKILL)):
        pid_file = tmp_path / f"pid{sig}"
        p = subprocess.Popen([exe, str(script), str(pid_file)], env=env)
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pid_file.read_text())
        p.send_signal(sig)
        assert p.wait(timeout=30) == code
        if sig == signal.SIGKILL:  # the client died: its script does not linger
            deadline = time.monotonic() + 10
            while _alive(child):
                assert time.monotonic() < deadline, "the forked script outlived its killed client"
                time.sleep(0.05)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_runs_that_change_interpreter_start_up_get_a_fresh_one():
    assert python_for(_env(PYTHONPATH="/elsewhere"))[0] == sys.executable
    assert python_for(dict(_env(), OMP_NUM_THREADS="4"))[0] == sys.executable
    assert python_for(_env(PYTHONUNBUFFERED=""))[0] == sys.executable  # set but empty: not -u; not handled


def test_pythonunbuffered_is_honoured_as_python_u_would(tmp_path):
    """PYTHONUNBUFFERED=1 (tests/scripts/fault_launch.py sets it): the zygote's child writes a partial line
    straight to its file, as ``python -u`` does, so a log shows what a rank killed mid-run had printed."""
    script = tmp_path / "partial.py"
    script.write_text("import sys, time\n"
                      "sys.stdout.write('partial out')\n"
                      "sys.stderr.write('partial err')\n"
                      "open(sys.argv[1], 'w').close()\n"
                      "time.sleep(60)\n")
    exe, env = python_for(_env(PYTHONUNBUFFERED="1"))
    if exe == sys.executable:
        pytest.skip("the zygote could not start here")
    for stream in ("out", "err"):
        log, flag = tmp_path / f"{stream}.log", tmp_path / f"{stream}.flag"
        with open(log, "w") as f:
            p = subprocess.Popen([exe, str(script), str(flag)], env=env, stdout=f if stream == "out" else None,
                                 stderr=f if stream == "err" else None)
        try:
            deadline = time.monotonic() + 60
            while not flag.exists():
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.05)
            assert log.read_text() == f"partial {stream}"
        finally:
            p.kill()
            p.wait()
