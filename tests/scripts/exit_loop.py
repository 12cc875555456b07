"""Runs tests/scripts/exit_probe.py (2 ranks: fit, test, exit) N times in a row and prints every exit code.

An intermittent abort after a successful run ("terminate called without an active exception", exit 134)
came from the heartbeat thread still inside a C++ store call at interpreter exit. Not a CI test (slow):

    python tests/scripts/exit_loop.py --runs 20
"""
import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK",
                                                             "WORLD_SIZE", "NODE_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    codes = []
    t0 = time.time()
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            p = subprocess.run([sys.executable, "tests/scripts/exit_probe.py", "--out", d], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
        codes.append(p.returncode)
        print(f"run {i + 1}: exit {p.returncode}", flush=True)
        if p.returncode != 0:
            print(p.stderr[-2000:], flush=True)
    print(f"{a.runs} runs in {time.time() - t0:.0f} s; exit codes: {dict(collections.Counter(codes))}")
    return 0 if set(codes) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
