"""Trains SmallCNN on sklearn digits through Lightning Fabric with ``strategy="topk_ddp"`` on 2 CPU processes,
with the same seed, data, model, optimizer and batches as ``train_probe.py --strategy topk_ddp``; then
checks ``fabric.save``/``fabric.load`` of the per-rank residuals. Every rank dumps what it saw.
With ``--nonfinite MODE --inject-step N`` rank 0's loss is NaN at step N instead (no checkpoint part).

    python tests/scripts/fabric_train.py --epochs 6 --out DIR
    python tests/scripts/fabric_train.py --epochs 1 --nonfinite skip --inject-step 3 --out DIR
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_probe import digits

import lightning_topk  # noqa: F401  (registers topk_ddp in Fabric's registry too)
from lightning_topk.lightning.checkpoint import shard_path
from lightning_topk.lightning.fabric import FabricTopKDDPStrategy
from lightning_topk.models import ImageClassifier, SmallCNN


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--nonfinite", default=None, help="raise | skip: strategy option, with --inject-step")
    ap.add_argument("--inject-step", type=int, default=-1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    seed_everything(0, workers=True)
    train, val = digits()
    model = ImageClassifier(SmallCNN(width=16), lr=0.05)
    # The flat all-gather, as train_probe.py's top-k runs (auto may send dense on loopback); the registered
    # name "topk_ddp" resolving in Fabric's registry is tested in tests/lightning/test_strategy.py.
    strategy = FabricTopKDDPStrategy(exchange="allgather", **({} if a.nonfinite is None else {"nonfinite": a.nonfinite}))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=32, shuffle=True))
    strategy = fabric.strategy
    metrics = {}
    step = 0
    injected = {}
    for epoch in range(a.epochs):
        loader.sampler.set_epoch(epoch)  # as the Trainer does
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            if step == a.inject_step and fabric.global_rank == 0:
                loss = loss * float("nan")
            optimizer.zero_grad()
            fabric.backward(loss)
            before = {k: v.detach().clone() for k, v in model.state_dict().items()} if step == a.inject_step else {}
            try:
                optimizer.step()
            except FloatingPointError as e:
                injected["raised"] = str(e)
                break
            if step == a.inject_step:
                injected["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            step += 1
        if "raised" in injected:
            break
        metrics = strategy.topk_metrics()  # a collective: every rank, same point
        fabric.log_dict(metrics, step=step)
    model.eval()
    with torch.no_grad():
        xs, ys = val.tensors
        acc = (model(xs).argmax(1) == ys).float().mean().item()

    if a.nonfinite is not None:
        injected.update(acc=acc, steps=step, residuals_finite=all(
            bool(torch.isfinite(t).all()) for t in strategy.topk_state.state_dict()["residual"].values()),
            params={k: v.detach().clone() for k, v in model.state_dict().items()})
        torch.save(injected, os.path.join(a.out, f"nonfinite_rank{fabric.global_rank}.pt"))
        return

    ckpt = os.path.join(a.out, "fabric.ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": step})
    fabric.barrier()
    state = strategy.topk_state
    saved = {k: v.clone() for k, v in state.state_dict()["residual"].items()}
    # One more step changes the residuals; loading must bring back exactly the saved ones.
    x, y = next(iter(loader))
    optimizer.zero_grad()
    fabric.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    changed = any(not torch.equal(saved[k], v) for k, v in state.state_dict()["residual"].items())
    rest = fabric.load(ckpt, {"model": model, "optimizer": optimizer})
    loaded = state.state_dict()
    rank = fabric.global_rank
    torch.save({
        "saved": saved, "loaded": loaded["residual"], "loaded_step": loaded["step"], "changed": changed,
        "rest": sorted(rest), "metrics": metrics, "shard_exists": os.path.isfile(shard_path(ckpt, rank)),
        "strategy": type(strategy).__module__ + "." + type(strategy).__name__, "steps": state.step,
    }, os.path.join(a.out, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"val_acc": acc, "steps": step}, f)


if __name__ == "__main__":
    main()
