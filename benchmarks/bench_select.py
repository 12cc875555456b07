"""Top-k selection speed: torch.topk vs exact vs mstopk, and the L2 mass mstopk captures.

    python benchmarks/bench_select.py [--sizes 1000000 25000000] [--densities 0.01 0.001] [--repeats 3]

Gradient-like data (Gaussian with a heavy-tailed scale). Prints a Markdown table; best of --repeats runs (the machine is shared: the minimum is the least disturbed).
"""
import argparse
import platform
import time

import torch

from lightning_topk import topk_select


def timed(fn, repeats):
    fn()  # warm-up (also fills the selection workspace)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return min(ts), out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"# top-k selection, {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| n | density | k | torch.topk ms | exact ms | speedup | mstopk ms | speedup | mstopk L2 mass |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.sizes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
        for rho in a.densities:
            k = max(1, int(rho * n))
            t_ref, (ref_v, _) = timed(lambda x=x, k=k: torch.topk(x.abs(), k, sorted=False), a.repeats)
            t_ex, (ex_v, ex_i) = timed(lambda x=x, k=k: topk_select(x, k, "exact"), a.repeats)
            t_ms, (ms_v, ms_i) = timed(lambda x=x, k=k: topk_select(x, k, "mstopk"), a.repeats)
            assert ex_i.numel() == k and ms_i.numel() == k
            mass = float((ms_v.double() ** 2).sum() / (ref_v.double() ** 2).sum())
            print(f"| {n:,} | {rho} | {k:,} | {1e3 * t_ref:.1f} | {1e3 * t_ex:.1f} | {t_ref / t_ex:.1f}x "
                  f"| {1e3 * t_ms:.1f} | {t_ref / t_ms:.1f}x | {100 * mass:.3f}% |")


if __name__ == "__main__":
    main()
