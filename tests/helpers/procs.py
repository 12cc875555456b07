"""Run helper scripts in fresh processes, with the environment cleaned of stale rendezvous variables."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"


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


def blocking_env(tmp_dir, modules, env=None):
    """Environment whose Python processes (children too) cannot import ``modules``, as if not installed."""
    d = Path(tmp_dir) / "block_imports"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(
        "import sys\nfor _m in %r:\n    sys.modules[_m] = None  # import raises ImportError\n" % (list(modules),))
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = os.pathsep.join([str(d), *filter(None, [e.get("PYTHONPATH")])])
    return e
