"""Test accuracy of local SGD under torchft with one replica group killed and healed, against an undisturbed run
(issue 34's criterion: within 1 point), on the digits.

3 replica groups of 1 process on loopback, a real lighthouse (``python -m lightning_topk.app.elastic_launch``), each
group ``tests/scripts/elastic_replica.py`` (MLP 64-256-10, AdamW 3e-3, batch 32; ``local_steps=4``, outer density
0.05 at 8 bits, DiLoCo's outer step; a loader that follows the trainer's position, one order per replica and
epoch). For each number of committed outer rounds N:

* ``undisturbed``: the three groups run N committed rounds;
* ``killed``: group 1 is killed with SIGKILL once the groups committed ``--kill-at`` rounds, restarted
  ``--down`` seconds later (it heals from a peer and rejoins), and the three run to the same N committed rounds.

Each row records the final test accuracy of every group (their parameters are bit-identical at the end, which the
row also checks); for a killed run also the round it was killed at, ``rounds_without_it`` (the rounds the survivors
committed during the ``--down`` seconds before the restart), the round it rejoined at, its heal time and the rounds
the survivors rolled back. Results: ``benchmarks/results/elastic_local_accuracy.json`` (BENCHMARKS.md renders it).

    python benchmarks/elastic_accuracy.py --rounds 50 100 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import ROOT, write_results

SCRIPT = Path(ROOT) / "tests" / "scripts" / "elastic_replica.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**kw: str) -> Dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **kw)
    for k in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "PL_GLOBAL_SEED"):
        e.pop(k, None)
    return e


def _rows(out: Path, r: int) -> List[Dict[str, Any]]:
    p = out / f"replica{r}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _wait(cond: Any, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def run(rounds: int, kill_at: int, down: float, out: Path, delay: float) -> Dict[str, Any]:
    """One run: ``kill_at`` 0 is undisturbed."""
    import torch

    port = _free_port()
    addr = f"http://127.0.0.1:{port}"
    lh = subprocess.Popen([sys.executable, "-m", "lightning_topk.app.elastic_launch", "--bind", f"127.0.0.1:{port}",
                           "--min_replicas", "2", "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500"],
                          cwd=ROOT, env=_env(), stdout=open(out / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
    stop = out / "stop_at"
    stop.write_text(str(rounds))
    args = ["--steps", "100000", "--stop-file", str(stop), "--local-steps", "4", "--min-replicas", "2",
            "--positioned-data", "--quorum-timeout", "120", "--delay", str(delay)]
    procs: Dict[int, subprocess.Popen] = {}

    def start(r: int) -> subprocess.Popen:
        log = open(out / f"replica{r}.{int(time.time() * 1000)}.log", "w")
        p = subprocess.Popen([sys.executable, str(SCRIPT), "--replica", str(r), "--out", str(out), *args], cwd=ROOT,
                             env=_env(TORCHFT_LIGHTHOUSE=addr, REPLICA_GROUP_ID=f"replica{r}"), stdout=log,
                             stderr=subprocess.STDOUT)
        procs[r] = p
        return p

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False

    t0 = time.monotonic()
    info: Dict[str, Any] = {}
    try:
        _wait(listening, 90, "the lighthouse")
        for r in range(3):
            start(r)
        if kill_at:
            _wait(lambda: all(_rows(out, r) and _rows(out, r)[-1]["ft_step"] >= kill_at for r in range(3)), 600,
                  f"{kill_at} rounds")
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
            at = max(_rows(out, r)[-1]["ft_step"] for r in (0, 2))
            time.sleep(down)
            during = min(_rows(out, r)[-1]["ft_step"] for r in (0, 2))
            os.rename(out / "replica1.jsonl", out / "replica1.before.jsonl")
            start(1)
            info = {"killed_at_round": at, "rounds_without_it": during - at}
        for r in range(3):
            if procs[r].wait(timeout=900) != 0:
                raise RuntimeError(f"replica {r} failed; logs in {out}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lh.terminate()
        lh.wait(timeout=10)
    finals = [torch.load(out / f"replica{r}.pt") for r in range(3)]
    same = all(torch.equal(v, f["params"][k]) for f in finals[1:] for k, v in finals[0]["params"].items())
    back = _rows(out, 1)
    if kill_at:
        info.update(heal_time_s=back[-1]["heal_time_s"], rejoined_at_round=back[0]["ft_step"],
                    rolled_back=[_rows(out, r)[-1]["round_uncommitted"] for r in (0, 2)])
    return {"rounds": rounds, "inner_steps": _rows(out, 0)[-1]["global_step"], "killed": bool(kill_at),
            "accuracy": [float(f["accuracy"]) for f in finals], "identical": same,
            "seconds": round(time.monotonic() - t0, 1), **info}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, nargs="+", default=[50, 100])
    ap.add_argument("--repeats", type=int, default=2, help="killed runs per N (the undisturbed run is deterministic)")
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--down", type=float, default=2.0)
    ap.add_argument("--delay", type=float, default=0.05, help="sleep per inner step (s): rounds long enough for a "
                    "restarted process to rejoin")
    ap.add_argument("--name", default="elastic_local_accuracy")
    a = ap.parse_args()
    rows = []
    for n in a.rounds:
        for kill in [0] + [a.kill_at] * a.repeats:
            d = tempfile.mkdtemp(prefix="elastic_accuracy_")
            row = run(n, kill, a.down, Path(d), a.delay)  # a failed run leaves its logs there
            shutil.rmtree(d, ignore_errors=True)
            print(json.dumps(row), flush=True)
            rows.append(row)
    setup = (f"3 x 1 replica groups, loopback, digits MLP, AdamW 3e-3, batch 32, local_steps=4, outer density 0.05 "
             f"at 8 bits, outer_recipe=diloco, a {a.delay:g} s sleep per inner step, lighthouse --min_replicas 2 "
             f"--join_timeout_ms 500 --heartbeat_timeout_ms 1500, kill at round {a.kill_at}, restart {a.down:g} s later")
    print(write_results(a.name, rows, sys.argv, setup=setup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
