"""Per-step time budget of topk_ddp on the namespace cluster: today's packet (bf16 values, 16-bit block indices: 4
bytes per entry) against the packet before 2026-11-25 (fp32 values, int32 indices: 8 bytes per entry).

    python benchmarks/overlap_budget.py --rounds 3 --dir /tmp/overlap      # runs, then prints the tables
    python benchmarks/overlap_budget.py --dir /tmp/overlap --summarize      # tables from an earlier run

2 nodes x 1 process at 100 Mbit/s (benchmarks/cluster.py), the 8.5M-parameter model (cluster_worker.py
``--hidden 2048``), 30 steps (3 warm-up steps excluded), no evaluation. Each round runs every entry once, in
the same order, so slow spells of a shared machine hit all entries; the tables give the median over rounds.
Entries: ``local`` (no communication: the bound), ``ag``/``auto`` = ``topk_ddp`` density 0.01 with
``exchange="allgather"`` / its default ``"auto"``, ``_before`` with the old packet (``--value-dtype fp32
--int32-indices``), ``ag_fp32`` with fp32 values and block indices (6 bytes per entry); ``ddp`` once (10 steps, slow). (The bucket rule's before/after of 2026-11-24 and the gradient copies'
of 2026-11-25 are in BENCHMARKS.md; for this model the rule keeps DDP's default buckets.)

Budget columns (ms per step, mean over steps and ranks): forward; backward = from ``backward()`` to its end,
which includes the hooks' selection and the wait for every bucket's collective; after = from the end of
backward to the optimizer step (the step controller's one all-reduce, which also absorbs the ranks' skew);
optimizer; select and exchange = the hooks' own telemetry (exchange: launch to completion, summed over
buckets, so overlapping buckets count twice); exposed wait = backward - the ``local`` backward of the same
round - select.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--nodes", "2", "--procs-per-node", "1", "--rate", "100mbit", "--steps", "30"]
WORKER = ["--hidden", "2048", "--eval-every", "0"]
TOPK = ["--strategy", "topk_ddp", "--density", "0.01"]
BEFORE = ["--value-dtype", "fp32", "--int32-indices"]  # the packet before 2026-11-25: fp32 values, int32 indices
ENTRIES: Dict[str, List[str]] = {
    "local": ["--strategy", "local"],
    "ag_before": [*TOPK, "--exchange", "allgather", *BEFORE],
    "ag_fp32": [*TOPK, "--exchange", "allgather", "--value-dtype", "fp32"],
    "ag": [*TOPK, "--exchange", "allgather"],
    "auto_before": [*TOPK, *BEFORE],
    "auto": TOPK,
}


def run(directory: str, name: str, worker_args: List[str]) -> None:
    out = os.path.join(directory, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, "cluster.py"), *COMMON, "--out", out, "--", *WORKER, *worker_args]
    with open(os.path.join(directory, f"{name}.log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(directory, "uptime.txt"), "a") as f:
        f.write(f"{name} {os.getloadavg()}\n")


def summarize(directory: str) -> str:
    runs: Dict[str, List[dict]] = {}
    for fn in sorted(os.listdir(directory)):
        if fn.endswith(".json"):
            entry, _, rnd = fn[:-5].rpartition("_")
            with open(os.path.join(directory, fn)) as f:
                runs.setdefault(entry, []).append({"round": rnd, **json.load(f)})
    local = {r["round"]: r for r in runs.get("local", [])}
    rows = ["| entry | bucket cap MiB | step ms | % of bound | forward | backward | after | optimizer | select "
            "| exchange | exposed wait | veth MB/node/step |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in [*ENTRIES, "ddp"]:
        rs = runs.get(entry)
        if not rs:
            continue
        med = statistics.median

        def m(key: str, rs: List[dict] = rs) -> float:
            return statistics.median([r["phases_ms"].get(key, 0.0) for r in rs])

        bound = [100 * r["samples_per_s"] / local[r["round"]]["samples_per_s"] for r in rs if r["round"] in local]
        exposed = [r["phases_ms"]["backward"] - local[r["round"]]["phases_ms"]["backward"]
                   - r["phases_ms"].get("select_in_hooks", 0.0) for r in rs if r["round"] in local]
        veth = med([sum(r["inter_node_bytes_per_node"]) / len(r["inter_node_bytes_per_node"]) / 1e6 for r in rs])
        cap = rs[0].get("bucket_cap_mb") or ("DDP default" if entry != "local" else "-")
        rows.append(f"| {entry} | {cap} | {med([1e3 * r['step_time_s'] for r in rs]):.0f} | "
                    f"{med(bound):.0f} | {m('forward'):.0f} | {m('backward'):.0f} | {m('post_backward'):.0f} | "
                    f"{m('optimizer'):.0f} | {m('select_in_hooks'):.0f} | {m('comm_in_hooks'):.0f} | "
                    f"{med(exposed) if entry != 'local' and exposed else 0:.0f} | {veth:.3f} |")
    per_round = ["", "Per round, % of the bound: " + "; ".join(
        f"{e} " + ", ".join(f"{100 * r['samples_per_s'] / local[r['round']]['samples_per_s']:.0f}"
                            for r in sorted(runs[e], key=lambda r: r["round"]) if r["round"] in local)
        for e in ENTRIES if e != "local" and e in runs)]
    return "\n".join(rows + per_round)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where the per-run JSON and logs go")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--summarize", action="store_true", help="only print the tables of an earlier run")
    p.add_argument("--no-ddp", action="store_true", help="skip the (slow) plain DDP entry")
    p.add_argument("--only", default=",".join(ENTRIES), help="comma-separated entries to run (always with local)")
    p.add_argument("--first-round", type=int, default=1, help="number of the first round (add rounds to a --dir)")
    a = p.parse_args(argv)
    only = ["local"] + [e for e in a.only.split(",") if e != "local"]
    bad = [e for e in only if e not in ENTRIES]
    if bad:
        p.error(f"--only: unknown entries {bad}; choose from {list(ENTRIES)}")
    os.makedirs(a.dir, exist_ok=True)
    if not a.summarize:
        for i in range(a.first_round, a.first_round + a.rounds):
            for name in only:
                run(a.dir, f"{name}_{i}", ENTRIES[name])
        if not a.no_ddp:
            run(a.dir, "ddp_1", ["--strategy", "ddp", "--steps", "10"])
    print(summarize(a.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
