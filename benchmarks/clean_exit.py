"""Clean exit under load: runs a finished 2-process ``lightning-topk-train`` fit + test (digits, ``TopKPrecision``
fp16, LARS, short) N times in a row while CPU burners load the machine, and counts the runs that aborted at exit
(a non-zero exit code, or "terminate called" on stderr). Writes benchmarks/results/clean_exit_<date>[_<tag>].json
(date, host, CPU count, load average, command, per-run exit codes and times).

    python benchmarks/clean_exit.py --runs 30 --burn 1
    PYTHONPATH=/path/to/old/checkout python benchmarks/clean_exit.py --tag before   # another code version
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = ["optimizer=lars", "precision=16-mixed", "trainer.max_epochs=1", "trainer.limit_train_batches=12",
             "trainer.num_sanity_val_steps=0", "run.print_summary=false"]


def _burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--burn", type=int, default=1, help="CPU-burning background processes during the runs")
    ap.add_argument("--tag", default="", help="suffix of the results file (e.g. before, after)")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    code = env.get("PYTHONPATH", ROOT).split(os.pathsep)[0] or ROOT
    commit = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown (not a git checkout)"
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(a.burn)]
    for b in burners:
        b.start()
    runs = []
    try:
        for i in range(a.runs):
            with tempfile.TemporaryDirectory() as d:
                cmd = [sys.executable, "-m", "lightning_topk", *OVERRIDES, f"hydra.run.dir={d}"]
                t0 = time.monotonic()
                try:
                    p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=a.timeout)
                    rc, err = p.returncode, p.stderr
                except subprocess.TimeoutExpired as e:
                    rc, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            terminate = "terminate called" in err
            runs.append({"run": i + 1, "exit": rc, "terminate_called": terminate,
                         "seconds": round(time.monotonic() - t0, 1), "load1": round(os.getloadavg()[0], 2)})
            print(f"run {i + 1}/{a.runs}: exit {rc}{' terminate called' if terminate else ''} "
                  f"({runs[-1]['seconds']} s, load {runs[-1]['load1']})", flush=True)
            if rc != 0 or terminate:
                print(err[-3000:], flush=True)
    finally:
        stop.set()
        for b in burners:
            b.join(5)
    aborts = sum(1 for r in runs if r["exit"] != 0 or r["terminate_called"])
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "code": code,
           "commit": commit, "burners": a.burn,
           "command": " ".join(["python -m lightning_topk", *OVERRIDES]), "runs": len(runs), "aborts": aborts,
           "per_run": runs}
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = f"clean_exit_{datetime.date.today().isoformat()}{'_' + a.tag if a.tag else ''}.json"
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        json.dump(out, f, indent=1)
    print(f"{len(runs)} runs, {aborts} aborted; results in benchmarks/results/{name}")
    return 0 if aborts == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
