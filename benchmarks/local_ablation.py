"""Sparse local SGD ablation on sklearn digits: 2 simulated nodes x 1 process on loopback (gloo), a Trainer,
AdamW 3e-3, batch 120 per rank, the same samples for every entry; plain DDP beside it.

    python benchmarks/local_ablation.py [--epochs 16] [--opt adamw|sgd --lr LR] [--only NAME,NAME]
                                        [--out benchmarks/results/local_ablation.md]

Each entry runs tests/scripts/local_train.py; accuracy is rank 0's on the held-out 20% after the last outer
round (epochs x 6 steps is a multiple of every H here). Wire bytes are the outer packet one rank sends per
round times (replicas - 1), per parameter and per inner step. The rows also go to OUT's name with .json
(``local_ablation.json`` by default), with the date, host and command.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPARAMS = 64 * 128 + 128 + 128 * 10 + 10
DILOCO = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]
ENTRIES = {
    "ddp": ["--strategy", "ddp"],
    "H=8 ρ=0.1 4-bit": ["--H", "8", "--density", "0.1", "--bits", "4", *DILOCO],
    "H=16 ρ=0.1 4-bit (default)": ["--H", "16", "--density", "0.1", "--bits", "4", *DILOCO],
    "H=16 ρ=0.1 4-bit streaming": ["--H", "16", "--density", "0.1", "--bits", "4", "--streaming", *DILOCO],
    "H=16 dense fp32 (DiLoCo)": ["--H", "16", "--density", "1", "--bits", "32", *DILOCO],
    "H=16 ρ=0.02 2-bit": ["--H", "16", "--density", "0.02", "--bits", "2", *DILOCO],
    "H=16 ρ=0.1 4-bit SparseLoCo (lr 1, μ 0)": ["--H", "16", "--density", "0.1", "--bits", "4", "--outer-lr", "1",
                                               "--outer-momentum", "0"],
    "H=32 ρ=0.1 4-bit": ["--H", "32", "--density", "0.1", "--bits", "4", *DILOCO],
    "H=32 ρ=0.1 4-bit streaming": ["--H", "32", "--density", "0.1", "--bits", "4", "--streaming", *DILOCO],
    # streaming with other outer steps (the DiLoCo one applied one round late diverged once on the cluster)
    "H=16 ρ=0.1 4-bit streaming, outer lr 0.35 μ 0.9": ["--H", "16", "--density", "0.1", "--bits", "4", "--streaming",
                                                       "--outer-lr", "0.35", "--outer-momentum", "0.9"],
    "H=16 ρ=0.1 4-bit streaming, outer lr 0.7 μ 0": ["--H", "16", "--density", "0.1", "--bits", "4", "--streaming",
                                                     "--outer-lr", "0.7", "--outer-momentum", "0"],
    "H=32 ρ=0.02 2-bit (cluster entry topk_local_wan)": ["--H", "32", "--density", "0.02", "--bits", "2", *DILOCO],
}


def run(out: str, tag: str, args, epochs: int):
    sys.path.insert(0, ROOT)
    from tests.helpers.procs import run_nodes

    run_nodes(["tests/scripts/local_train.py", "--out", out, "--tag", tag, "--epochs", str(epochs), "--chunk", "4096",
               *args], num_nodes=2, timeout=1800)
    return torch.load(os.path.join(out, f"{tag}_rank0.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "local_ablation.md"))
    ap.add_argument("--only", default="")
    ap.add_argument("--opt", default="adamw", choices=("adamw", "sgd"), help="inner optimizer (sgd: momentum 0.9)")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner learning rate")
    a = ap.parse_args()
    names = [n for n in ENTRIES if not a.only or n in a.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, name in enumerate(names):
            t0 = time.perf_counter()
            r = run(d, f"e{i}", ["--opt", a.opt, "--lr", str(a.lr), *ENTRIES[name]], a.epochs)
            m = r["metrics"]
            bpp = m.get("topk/outer_bytes", 0.0) / NPARAMS
            bps = m.get("topk/outer_bytes_per_step", 0.0) / NPARAMS
            rows.append((name, r["acc"], r["steps"], r["rounds"], bpp, bps, time.perf_counter() - t0))
            print(rows[-1], flush=True)
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    inner = f"AdamW {a.lr:g}" if a.opt == "adamw" else f"SGD {a.lr:g} momentum 0.9"
    lines = [f"Digits, 2 nodes x 1 process (gloo, loopback), {inner}, batch 120/rank, {a.epochs} epochs; "
             f"{time.strftime('%Y-%m-%d')}, 2-core x86_64, no GPU, torch {torch.__version__}; load: {up}", "",
             "| entry | test acc | steps | outer rounds | outer bytes/param/round | outer bytes/param/step |",
             "|---|---|---|---|---|---|"]
    for name, acc, steps, rounds, bpp, bps, _ in rows:
        lines.append(f"| {name} | {acc:.4f} | {steps} | {rounds} | {bpp:.4f} | {bps:.4f} |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    records = [{"entry": name, "test_acc": acc, "steps": steps, "outer_rounds": rounds,
                "outer_bytes_per_param_per_round": bpp, "outer_bytes_per_param_per_step": bps, "seconds": secs}
               for name, acc, steps, rounds, bpp, bps, secs in rows]
    name = os.path.splitext(os.path.basename(a.out))[0]
    print(write_results(name, records, sys.argv, directory=os.path.dirname(a.out), header=lines[0],
                        entries={n: ENTRIES[n] for n in names}, opt=a.opt, lr=a.lr, epochs=a.epochs))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
