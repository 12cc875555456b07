"""Fabric resume across exchanges on 2 CPU processes (digits, SmallCNN): ``--phase save`` trains a few steps
with the scale-free exchange (which keeps owner residuals) and ``fabric.save``s; ``--phase resume`` starts
fresh with a pinned ``exchange="allgather"`` and ``nonfinite="skip"``, ``fabric.load``s, skips a step whose
loss is NaN on rank 0, then trains one step. Every rank dumps its top-k state at each point.

    python tests/scripts/fabric_resume.py --phase save --out DIR
    python tests/scripts/fabric_resume.py --phase resume --out DIR
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_probe import digits

from lightning_topk.lightning.fabric import FabricTopKDDPStrategy
from lightning_topk.models import ImageClassifier, SmallCNN


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    seed_everything(0, workers=True)
    train, _ = digits()
    model = ImageClassifier(SmallCNN(width=16), lr=0.05)
    exchange = "scatter" if a.phase == "save" else "allgather"
    strategy = FabricTopKDDPStrategy(exchange=exchange, density=0.05, min_sparse_numel=0, nonfinite="skip")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=32, shuffle=False))
    batches = iter(loader)
    state = fabric.strategy.topk_state
    ckpt = os.path.join(a.out, "fabric.ckpt")
    out = {}

    def step(nan=False):
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        if nan and fabric.global_rank == 0:
            loss = loss * float("nan")
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    def snap():
        sd = state.state_dict()
        return {"step": sd["step"], "residual": sd["residual"], "owner_residual": sd["owner_residual"]}

    if a.phase == "save":
        for _ in range(a.steps):
            step()
        out["saved"] = snap()
        fabric.save(ckpt, {"model": model, "optimizer": optimizer})
    else:
        fabric.load(ckpt, {"model": model, "optimizer": optimizer})
        out["loaded"] = snap()
        step(nan=True)  # skipped on every rank
        out["skipped"] = snap()
        step()
        out["trained"] = snap()
    torch.save(out, os.path.join(a.out, f"{a.phase}_rank{fabric.global_rank}.pt"))


if __name__ == "__main__":
    main()
