"""Bytes per step crossing nodes: flat vs hierarchical top-k at the same density (2 nodes x L procs).

    python benchmarks/bench_hier_bytes.py [--local 2] [--density 0.01] [--params 4000000] [--json hier_bytes]

Runs N x L real gloo processes on this machine (the node layout only decides the process groups);
reports each rank's telemetry (payload bytes it put on inter-node and intra-node links per step).
For real link bytes under a rate limit see benchmarks/cluster.py. The rows go to
``benchmarks/results/<--json>.json`` with the date, host and command (``--json ''``: not written).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_results

from lightning_topk import TopKConfig, TopKState, topk_allgather_hook
from lightning_topk.comm.exchanges.hierarchical import hierarchical_topk_hook, make_groups
from tests.helpers.dist import run_distributed


def work(rank, world, nodes, local, density, params, hierarchical):
    torch.manual_seed(0)
    width = int((params / 2) ** 0.5)
    m = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    ddp = DDP(m)
    hier = make_groups(nodes, local, rank) if hierarchical else None
    st = TopKState(TopKConfig(density=density, dense_steps=1, hierarchical=hierarchical), hier=hier, num_nodes=nodes)
    st.bind(m.named_parameters())
    ddp.register_comm_hook(st, hierarchical_topk_hook if hierarchical else topk_allgather_hook)
    for _ in range(3):
        m.zero_grad()
        ddp(torch.randn(4, width)).square().mean().backward()
    return vars(st.last), sum(p.numel() for p in m.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--local", type=int, default=2)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--json", default="hier_bytes", help="results name under benchmarks/results/ ('': none)")
    a = ap.parse_args()
    world = a.nodes * a.local
    rows = {}
    for hier in (False, True):
        res = run_distributed(work, world, (a.nodes, a.local, a.density, a.params, hier))
        rows[hier] = res
    n = rows[False][0][1]
    print(f"# inter-node bytes per step, {a.nodes} nodes x {a.local} procs, density {a.density}, {n:,} params\n")
    print("| exchange | inter-node bytes / rank / step | inter-node bytes / node / step | intra-node bytes / rank / step |")
    print("|---|---:|---:|---:|")
    records = []
    for hier, res in rows.items():
        inter = [r[0]["bytes_inter"] for r in res]
        intra = [r[0]["bytes_intra"] for r in res]
        per_node = sum(inter[: a.local])
        print(f"| {'hierarchical' if hier else 'flat'} | {inter[0]:,} | {per_node:,} | {intra[0]:,} |")
        records.append({"exchange": "hierarchical" if hier else "flat", "inter_bytes_per_rank": inter,
                        "intra_bytes_per_rank": intra, "inter_bytes_per_node": per_node})
    ratio = sum(r[0]["bytes_inter"] for r in rows[False]) / sum(r[0]["bytes_inter"] for r in rows[True])
    print(f"\nflat / hierarchical inter-node bytes: {ratio:.2f}x (expected about L = {a.local})")
    if a.json:
        print(write_results(a.json, records, sys.argv, nodes=a.nodes, local=a.local, density=a.density, params=n,
                            flat_over_hierarchical=ratio))


if __name__ == "__main__":
    main()
