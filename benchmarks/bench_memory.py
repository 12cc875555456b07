"""Peak host memory of the top-k exchange above plain DDP, in bytes per parameter (CPU, 2 gloo processes).

    python benchmarks/bench_memory.py [--params 25e6 100e6] [--configs ddp,topk,topk_sync_free,topk_skip]

Every (config, size) runs in 2 fresh processes (spawn): an MLP of 2048 x 2048 layers (4.2M parameters each,
so DDP's default 25 MB buckets hold one or a few layers, as in real models), plain SGD (no optimizer state),
4 steps (the first dense). Each rank reports its peak RSS (``ru_maxrss``); the figure is the mean over
ranks of (peak - peak of plain ``ddp`` at that size) / parameters. Configs:

  ddp             torch DDP's own all-reduce (the reference)
  topk            topk hook, density 0.01, exact selection, nonfinite="raise" (the defaults)
  topk_sync_free  the same with LIGHTNING_TOPK_SYNC_FREE=1 (the GPU path's selection, on CPU)
  topk_skip       nonfinite="skip": the undo copies of the residuals are kept (see README, "Memory")

Run it with another lightning_topk first on PYTHONPATH to measure an older version side by side. The rows go to
``benchmarks/results/<--json>.json`` with the date, host and command (``--json ''``: not written).
"""
import argparse
import os
import resource
import sys
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # PYTHONPATH may pick the version
import lightning_topk
from lightning_topk import TopKConfig, TopKState, topk_allgather_hook
from tests.helpers.dist import run_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_results

STEPS = 4


def work(rank, world, config, params):
    if config == "topk_sync_free":
        os.environ["LIGHTNING_TOPK_SYNC_FREE"] = "1"
    torch.manual_seed(0)
    width = 2048
    m = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, round(params / width**2)))])
    ddp = DDP(m)
    ctl = None
    if config != "ddp":
        cfg = TopKConfig(density=0.01, nonfinite="skip" if config == "topk_skip" else "raise")
        st = TopKState(cfg)
        st.bind(m.named_parameters())
        ddp.register_comm_hook(st, topk_allgather_hook)
        controller = getattr(lightning_topk, "StepController", None)  # absent in older versions
        ctl = controller(st) if controller is not None else None
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(torch.randn(2, width)).square().mean().backward()
        if ctl is not None:
            ctl.finish_step()
        opt.step()
    step_s = (time.perf_counter() - t0) / STEPS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, sum(p.numel() for p in m.parameters()), step_s


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=float, nargs="+", default=[25e6, 100e6])
    ap.add_argument("--configs", default="ddp,topk,topk_sync_free,topk_skip")
    ap.add_argument("--json", default="memory", help="results name under benchmarks/results/ ('': none)")
    a = ap.parse_args()
    configs = a.configs.split(",")
    if configs[0] != "ddp":
        configs.insert(0, "ddp")
    print(f"# peak RSS above plain ddp, bytes/param (2 ranks, CPU), {lightning_topk.__file__}")
    print(f"# load average before: {os.getloadavg()}\n")
    print("| params | config | peak RSS / rank (MB) | above ddp (B/param) | step (s) |")
    print("|---:|---|---:|---:|---:|")
    records = []
    load_before = os.getloadavg()[0]
    for size in a.params:
        base = None
        for config in configs:
            res = run_distributed(work, 2, (config, int(size)))
            peak = sum(r[0] for r in res) / len(res)
            n, step_s = res[0][1], max(r[2] for r in res)
            base = peak if config == "ddp" else base
            print(f"| {n / 1e6:.0f}M | {config} | {peak / 2**20:,.0f} | {(peak - base) / n:.1f} | {step_s:.2f} |",
                  flush=True)
            records.append({"params": n, "config": config, "peak_rss_bytes_per_rank": peak,
                            "above_ddp_bytes_per_param": (peak - base) / n, "step_s": step_s})
    print(f"\n# load average after: {os.getloadavg()}")
    if a.json:
        print(write_results(a.json, records, sys.argv, ranks=2, library=lightning_topk.__file__,
                            load_before=load_before, load_after=os.getloadavg()[0]))


if __name__ == "__main__":
    main()
