"""Top-k selection speed, side by side: torch.topk, the CPU fast path (``topk_select``) and the sync-free
path (``topk_select_sync_free``), each for exact and MSTopK, plus the L2 mass MSTopK captures.

    python benchmarks/bench_select.py [--sizes 1000000 25000000] [--densities 0.01 0.001] [--repeats 3]
                                      [--device cpu|cuda] [--select-threads N]

Gradient-like data (Gaussian with a log-normal scale), fp32. Every time is the median of --repeats rounds
after one warm-up; in each round all columns take turns (the machine may be shared: a burst of load
hits them alike). `x.abs()` is the copy floor (one read and one fresh write of the tensor). On CUDA the times come from CUDA events around each call, so
they include the kernels, not only the launches.
250M entries (``--sizes 250000000``) needs about 10 GB of host memory on CPU.
"""
import argparse
import datetime
import os
import platform
import statistics
import time

import torch

from lightning_topk import topk_select
from lightning_topk.comm import selection
from lightning_topk.comm.selection import topk_select_sync_free


def timed(fns, repeats, device):
    """Median time of each function over ``repeats`` rounds; the functions take turns in every round, so
    that a burst of load from elsewhere on a shared machine hits them alike. Returns (times, outputs)."""
    outs = [fn() for fn in fns]  # warm-up (fills the selection workspace, compiles kernels)
    runs = [[] for _ in fns]
    for _ in range(repeats):
        for j, fn in enumerate(fns):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                outs[j] = fn()
                end.record()
                end.synchronize()
                t = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                outs[j] = fn()
                t = time.perf_counter() - t0
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--select-threads", type=int, default=None,
                    help="topk_select's CPU threads (selection.CPU_THREADS; 0: torch's setting)")
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
            for (label, _), t, (v, i) in zip(CASES, times[1:], outs[1:]):
                assert i.numel() == k, label
                cells.append(f"{1e3 * t:.1f} | {t_ref / t:.1f}x")
                if "mstopk" in label:
                    masses.append(f"{100 * mass(v, ref_v):.3f}%")
            print(f"| {n:,} | {rho} | {k:,} | {1e3 * t_copy:.1f} | {1e3 * t_ref:.1f} | {' | '.join(cells)} | {' | '.join(masses)} |",
                  flush=True)
        del x
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; topk_select CPU threads: "
          f"{selection.CPU_THREADS or torch.get_num_threads()}")


if __name__ == "__main__":
    main()
