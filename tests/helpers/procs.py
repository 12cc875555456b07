"""Run helper scripts in fresh processes, with the environment cleaned of stale rendezvous variables."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"


def python_for(env):
    """The interpreter to run a script with ``env``: a test zygote's shim (torch and Lightning already
    imported; tests/helpers/zygote.py) where that is the same as a fresh interpreter, else ``sys.executable``."""
    from tests.helpers import zygote

    z = zygote.command_env(env)
    return (sys.executable, env) if z is None else (zygote.shim(), z)


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
    exe, e = python_for(e)
    p = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=e, cwd=cwd or ROOT)
    if p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def run_nodes(args, num_nodes=2, timeout=600, env=None):
    """Run a script as ``num_nodes`` simulated nodes on loopback (NODE_RANK set per process; Lightning's
    launcher then starts each node's local ranks). Returns the logs; fails if any node fails."""
    from tests.helpers.dist import free_port

    port = str(free_port())
    procs = []
    for node in range(num_nodes):
        e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node), OMP_NUM_THREADS="1")
        for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
            e.pop(k, None)
        e.update(env or {})
        exe, e = python_for(e)
        procs.append(subprocess.Popen([exe, *map(str, args)], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        raise AssertionError("\n".join(f"node {i} ({p.returncode}):\n{log[-3000:]}"
                                       for i, (p, log) in enumerate(zip(procs, logs))))
    return logs


def blocking_env(tmp_dir, modules, env=None):
    """Environment whose Python processes (children too) cannot import ``modules``, as if not installed."""
    d = Path(tmp_dir) / "block_imports"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(
        "import sys\nfor _m in %r:\n    sys.modules[_m] = None  # import raises ImportError\n" % (list(modules),))
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = os.pathsep.join([str(d), *filter(None, [e.get("PYTHONPATH")])])
    return e


def fake_scontrol(tmp_path):
    """A fake ``scontrol`` first on PATH (Lightning calls it to requeue on SIGUSR1): (env, log of its calls)."""
    import stat

    fakebin = Path(tmp_path) / "bin"
    fakebin.mkdir(exist_ok=True)
    log = Path(tmp_path) / "scontrol.log"
    scontrol = fakebin / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{fakebin}{os.pathsep}{os.environ['PATH']}"}, log


def load_tool(name):
    """The module ``tools/<name>.py`` (the repository's tools are scripts, not a package), loaded in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
