"""Selection threshold reuse in real training: the hook's selection time and the hints' hit rate, with
threshold reuse on and off, on 2 local processes (loopback gloo, no network namespaces, no rate limit).

    python benchmarks/select_reuse_train.py [--rounds 2] [--dir /tmp/select_reuse] [-- WORKER ARGS...]

Each round runs reuse on, then off: ``benchmarks/cluster_worker.py`` as 2 nodes x 1 process, by default
``--strategy topk_ddp --density 0.01 --exchange allgather --hidden 2048 --eval-every 0 --steps 30`` (the
8.5M-parameter model of ``overlap_budget.py``, the strategy's defaults otherwise). Per entry: the hooks'
``select_time_s`` (from the accumulation into the residual to the packed buffer, summed over buckets; median
over steps after the 3 warm-up steps, both ranks) and the median step time, plus the hints' hits / misses
(selections that had a hint: the one pass was enough / the sampled search ran). Times are only comparable
within one round on a quiet machine; the hit counts do not depend on the load.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT = ["--strategy", "topk_ddp", "--density", "0.01", "--exchange", "allgather", "--hidden", "2048",
           "--eval-every", "0", "--steps", "30"]

# Run inside each worker process: set the switch, count hits and misses, then run cluster_worker.main.
_WRAP = r"""
import atexit, json, os, sys
sys.path.insert(0, {here!r})
from lightning_topk.comm import selection as sel
sel.THRESHOLD_REUSE = os.environ["SELECT_REUSE"] == "1"
count = {{"hits": 0, "misses": 0}}
hinted = sel._hinted_candidates
def counted(x, k, hint):
    had = hint.key is not None
    cand = hinted(x, k, hint)
    if had:
        count["hits" if cand is not None else "misses"] += 1
    return cand
sel._hinted_candidates = counted
out = os.path.join(os.environ["CLUSTER_RESULT_DIR"], "hints%s.json" % os.environ["NODE_RANK"])
atexit.register(lambda: open(out, "w").write(json.dumps(count)))
import cluster_worker
sys.exit(cluster_worker.main(sys.argv[1:]))
"""


def run(reuse: bool, out: str, worker_args: list) -> None:
    os.makedirs(out, exist_ok=True)
    port = str(random.randint(20000, 40000))
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, SELECT_REUSE="1" if reuse else "0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   NODE_RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", CLUSTER_NUM_NODES="2",
                   CLUSTER_PROCS_PER_NODE="1", CLUSTER_RESULT_DIR=out,
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        procs.append(subprocess.Popen([sys.executable, "-c", _WRAP.format(here=HERE), *worker_args], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"a worker failed: see {out}/log*.txt")


def summary(out: str, warmup: int = 3) -> str:
    sel, steps, hits, misses = [], [], 0, 0
    for rank in (0, 1):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            r = json.load(f)
        sel += [t["select_time_s"] for t in r["telemetry_steps"][warmup:]]
        ends = r["step_end"][warmup:]
        steps += [b - a for a, b in zip(ends, ends[1:])]
        with open(os.path.join(out, f"hints{rank}.json")) as f:
            h = json.load(f)
        hits, misses = hits + h["hits"], misses + h["misses"]
    return (f"{1e3 * statistics.median(sel):.1f} | {1e3 * statistics.median(steps):.1f} | "
            f"{hits}/{hits + misses}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/select_reuse")
    ap.add_argument("worker_args", nargs="*", help="cluster_worker.py arguments (after --)")
    a = ap.parse_args()
    worker_args = a.worker_args or DEFAULT
    print(f"# threshold reuse in training: cluster_worker.py {' '.join(worker_args)}\n")
    print("| round | reuse | select ms (median) | step ms (median) | hint hits | load before |")
    print("|---:|---|---:|---:|---:|---:|")
    for rnd in range(a.rounds):
        for reuse in (True, False):
            load = os.getloadavg()[0]
            out = os.path.join(a.dir, f"round{rnd}_{'on' if reuse else 'off'}")
            run(reuse, out, worker_args)
            print(f"| {rnd} | {'on' if reuse else 'off'} | {summary(out)} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
