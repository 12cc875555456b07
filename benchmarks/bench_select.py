"""Top-k selection speed, side by side: torch.topk, the CPU fast path (``topk_select``) and the sync-free
path (``topk_select_sync_free``), each for exact and MSTopK, plus the L2 mass MSTopK captures; then the
exact selector's threshold reuse between steps on a drifting input.

    python benchmarks/bench_select.py [--sizes 1000000 25000000] [--densities 0.01 0.001] [--repeats 3]
                                      [--device cpu|cuda] [--select-threads N] [--reuse-steps 8]

Gradient-like data (Gaussian with a log-normal scale), fp32. Every time is the median of --repeats rounds
after one warm-up; in each round all columns take turns (the machine may be shared: a burst of load
hits them alike). `x.abs()` is the copy floor (one read and one fresh write of the tensor). On CUDA the times come from CUDA events around each call, so
they include the kernels, not only the launches.
250M entries (``--sizes 250000000``) needs about 10 GB of host memory on CPU.

Reuse table (largest size, each density; ``--reuse-steps 0`` skips it): x drifts as a residual does,
x <- 0.9 x + sqrt(0.19) noise, each entry keeping its own log-normal scale (stationary). At every step
x.abs(), torch.topk, ``topk_select(x, k, "exact")`` and the same with a ThresholdHint kept across steps
take turns on the same x; the table gives the median over steps after one warm-up step (the hint's first
call has nothing to reuse), the ratios to torch.topk, and the hint's hit rate (steps that took the one
pass). The two exact columns are checked to return the same indices.

Both tables' rows go to ``benchmarks/results/<--json>.json`` with the date, host and command (``--json ''``: not
written).
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

from lightning_topk import topk_select
from lightning_topk.comm import selection
from lightning_topk.comm.sync_free import topk_select_sync_free

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_results


def once(fn, device):
    """(seconds, output) of one call; CUDA: from events around it."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def timed(fns, repeats, device):
    """Median time of each function over ``repeats`` rounds; the functions take turns in every round, so
    that a burst of load from elsewhere on a shared machine hits them alike. Returns (times, outputs)."""
    outs = [fn() for fn in fns]  # warm-up (fills the selection workspace, compiles kernels)
    runs = [[] for _ in fns]
    for _ in range(repeats):
        for j, fn in enumerate(fns):
            t, outs[j] = once(fn, device)
            runs[j].append(t)
    return [statistics.median(r) for r in runs], outs


def mass(v, ref_v):
    return float((v.double() ** 2).sum() / (ref_v.double() ** 2).sum())


CASES = (  # column label, call
    ("topk_select exact", lambda x, k: topk_select(x, k, "exact")),
    ("topk_select mstopk", lambda x, k: topk_select(x, k, "mstopk")),
    ("sync-free exact", lambda x, k: topk_select_sync_free(x, k, "exact")),
    ("sync-free mstopk", lambda x, k: topk_select_sync_free(x, k, "mstopk")),
)


def reuse_table(n, densities, steps, device):
    """Threshold reuse on a drifting input (see the module docstring)."""
    print(f"\n## Threshold reuse, x <- 0.9 x + noise, {steps} timed steps after one warm-up step\n")
    print("| n | density | k | x.abs() ms | torch.topk ms | exact ms | x | exact + hint ms | x | hint / exact | hint hits |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    records = []
    for rho in densities:
        g = torch.Generator().manual_seed(1)
        scale = torch.exp(torch.randn(n, generator=g)).to(device)
        x = torch.randn(n, generator=g).to(device).mul_(scale)
        k = max(1, int(rho * n))
        hint = selection.ThresholdHint()
        # x drifts in place: the functions see each step's values.
        fns = [lambda x=x: (x.abs(), None), lambda x=x, k=k: torch.topk(x.abs(), k, sorted=False),
               lambda x=x, k=k: topk_select(x, k, "exact"), lambda x=x, k=k, h=hint: topk_select(x, k, "exact", h)]
        runs = [[] for _ in fns]
        hits0 = misses0 = 0
        for step in range(steps + 1):
            if step == 1:
                hits0, misses0 = hint.hits, hint.misses
            outs = []
            for j, fn in enumerate(fns):
                t, out = once(fn, device)
                outs.append(out)
                if step > 0:
                    runs[j].append(t)
            assert torch.equal(outs[2][1], outs[3][1]), "the hint changed the selection"
            noise = torch.randn(n, generator=g).to(device).mul_(scale)
            x.mul_(0.9).add_(noise, alpha=0.19 ** 0.5)
            del noise, outs
        t_abs, t_ref, t_ex, t_hint = (statistics.median(r) for r in runs)
        hits, misses = hint.hits - hits0, hint.misses - misses0
        print(f"| {n:,} | {rho} | {k:,} | {1e3 * t_abs:.1f} | {1e3 * t_ref:.1f} | {1e3 * t_ex:.1f} | {t_ref / t_ex:.1f}x "
              f"| {1e3 * t_hint:.1f} | {t_ref / t_hint:.1f}x | {t_hint / t_ex:.2f} | {hits}/{hits + misses} |", flush=True)
        records.append({"table": "reuse", "n": n, "density": rho, "k": k, "abs_s": t_abs, "torch_topk_s": t_ref,
                        "exact_s": t_ex, "exact_hint_s": t_hint, "hint_hits": hits, "hint_steps": hits + misses})
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--select-threads", type=int, default=None,
                    help="topk_select's CPU threads (selection.CPU_THREADS; 0: torch's setting)")
    ap.add_argument("--reuse-steps", type=int, default=8,
                    help="timed steps of the threshold-reuse table on the largest size (0: skip it)")
    ap.add_argument("--json", default="select", help="results name under benchmarks/results/ ('': none)")
    a = ap.parse_args()
    if a.select_threads is not None:
        selection.CPU_THREADS = a.select_threads or None
    device = torch.device(a.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"# top-k selection: {platform.machine()}, {os.cpu_count()} cores, {where}, torch {torch.__version__}, "
          f"{datetime.date.today()}, load average {os.getloadavg()[0]:.1f}\n")
    head = " | ".join(f"{label} ms | x" for label, _ in CASES)
    print(f"| n | density | k | x.abs() ms | torch.topk ms | {head} | topk_select mstopk L2 | sync-free mstopk L2 |")
    print("|---:|---:|---:|---:|---:|" + "---:|---:|" * len(CASES) + "---:|---:|")
    records = []
    load_before = os.getloadavg()[0]
    for n in a.sizes:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(device)
        for rho in a.densities:
            k = max(1, int(rho * n))
            fns = [lambda x=x: (x.abs(), None), lambda x=x, k=k: torch.topk(x.abs(), k, sorted=False)]
            fns += [lambda x=x, k=k, fn=fn: fn(x, k) for _, fn in CASES]
            times, outs = timed(fns, a.repeats, device)
            t_copy, times, outs = times[0], times[1:], outs[1:]
            t_ref, ref_v = times[0], outs[0][0]
            cells, masses = [], []
            record = {"table": "select", "n": n, "density": rho, "k": k, "abs_s": t_copy, "torch_topk_s": t_ref}
            for (label, _), t, (v, i) in zip(CASES, times[1:], outs[1:]):
                assert i.numel() == k, label
                cells.append(f"{1e3 * t:.1f} | {t_ref / t:.1f}x")
                record[f"{label} s"] = t
                if "mstopk" in label:
                    masses.append(f"{100 * mass(v, ref_v):.3f}%")
                    record[f"{label} l2_share"] = mass(v, ref_v)
            records.append(record)
            print(f"| {n:,} | {rho} | {k:,} | {1e3 * t_copy:.1f} | {1e3 * t_ref:.1f} | {' | '.join(cells)} | {' | '.join(masses)} |",
                  flush=True)
        del x
    if a.reuse_steps > 0:
        records += reuse_table(max(a.sizes), a.densities, a.reuse_steps, device)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; topk_select CPU threads: "
          f"{selection.CPU_THREADS or torch.get_num_threads()}")
    if a.json:
        print(write_results(a.json, records, sys.argv, device=where, repeats=a.repeats,
                            select_threads=selection.CPU_THREADS or torch.get_num_threads(),
                            load_before=load_before, load_after=os.getloadavg()[0]))


if __name__ == "__main__":
    main()
