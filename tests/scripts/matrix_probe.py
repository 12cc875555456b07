"""The drop-in feature matrix: one small LightningModule per Lightning feature, fitted in turn under one
strategy on 2 CPU processes; every rank dumps, per feature, the final parameters, what a callback saw of the
optimizer each step (lr, momentum, weight decay), the user's RNG streams after the fit, and the hook state.

    python tests/scripts/matrix_probe.py --strategy ddp|topk_default|topk_probe|topk_dense|topk_sparse|topk_local --out DIR \
        [--features onecycle,sgd_wd,dropout,...] [--devices N]

``--strategy`` may list several (``ddp,topk_default``): one launch fits each in turn, into ``DIR/<strategy>``.

``topk_default`` is ``strategy="topk_ddp"`` with every option at its default (``exchange="auto"`` sends this
small model's buckets dense on one node; ``deterministic=True``, so its plan comes from the constants model);
``topk_probe`` the same without ``deterministic`` (the plan comes from a timed probe of the links); ``topk_dense`` pins ``exchange="dense"`` at density 1;
``topk_sparse`` forces the sparse exchange (``exchange="allgather", min_sparse_numel=0``); ``topk_local`` is
sparse local SGD (``local_steps=4``, the rest at its defaults) on one node.
"""
import argparse
import json
import os
import random

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import lightning_topk  # noqa: F401  (registers topk_ddp)
from lightning_topk import TopKDDPStrategy

FEATURES = ("plain", "onecycle", "sgd_wd", "dropout", "accumulate", "clip", "adamw", "manual", "bf16")


def digits():
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return TensorDataset(x[perm][:512], y[perm][:512])


class Net(pl.LightningModule):
    def __init__(self, feature: str, steps: int):
        super().__init__()
        self.feature, self.steps = feature, steps
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.drop = nn.Dropout(0.3) if feature == "dropout" else nn.Identity()
        self.head = nn.Linear(128, 10)
        self.automatic_optimization = feature != "manual"

    def forward(self, x):
        return self.head(self.drop(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        f = self.feature
        if f == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        wd = 1e-2 if f in ("sgd_wd", "onecycle") else 0.0
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=wd)
        if f == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.steps, cycle_momentum=True,
                                                        base_momentum=0.8, max_momentum=0.95)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if f == "sgd_wd":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        return opt


class Watch(pl.Callback):
    """What the user's code sees of the optimizer at each batch end, and the hook's momentum then."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        g = trainer.optimizers[0].param_groups[0]
        st = getattr(trainer.strategy, "topk_state", None)
        self.seen.append({"lr": float(g["lr"]), "momentum": float(g.get("momentum", -1.0)),
                          "weight_decay": float(g.get("weight_decay", 0.0)),
                          "hook_momentum": None if st is None or not st.config.momentum_correction
                          else st.config.momentum})


def strategy_for(name: str):
    if name == "ddp":
        return "ddp"
    if name in ("topk_default", "topk_probe"):
        return "topk_ddp"
    if name == "topk_dense":
        return TopKDDPStrategy(exchange="dense", density=1.0)
    if name == "topk_sparse":
        return TopKDDPStrategy(exchange="allgather", min_sparse_numel=0)
    if name == "topk_local":
        return TopKDDPStrategy(local_steps=4)
    raise SystemExit(f"unknown --strategy {name!r}")


def fit(feature: str, strategy: str, out: str, steps: int, devices: int = 2) -> None:
    pl.seed_everything(0, workers=True)
    np.random.seed(0)
    model = Net(feature, steps)
    watch = Watch()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy_for(strategy), max_steps=steps, callbacks=[watch],
        accumulate_grad_batches=2 if feature == "accumulate" else 1,
        gradient_clip_val=0.5 if feature == "clip" else None,
        precision="bf16-mixed" if feature == "bf16" else "32-true",
        # topk_probe: not deterministic, so exchange="auto" probes the links (auto_model="auto"), as users run it
        deterministic=strategy != "topk_probe",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(digits(), batch_size=32, shuffle=True))
    st = getattr(trainer.strategy, "topk_state", None)
    rank = trainer.global_rank
    dump = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "seen": watch.seen,
        # the user's RNG streams after the fit: what the strategy drew from them shows here
        "rng": {"torch": torch.rand(4), "numpy": np.random.rand(4), "python": [random.random() for _ in range(4)]},
        "hook": None if st is None else {"momentum_correction": st.config.momentum_correction,
                                         "buckets_by": dict(st.totals.buckets_by),
                                         "recipe": trainer.strategy.topk_recipe},
        "optimizer_state_keys": sorted({k for s in trainer.optimizers[0].state.values() for k in s}),
    }
    torch.save(dump, os.path.join(out, f"{feature}_rank{rank}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    strategies = a.strategy.split(",")
    for f in a.features.split(","):
        if f not in FEATURES:
            raise SystemExit(f"unknown feature {f!r}; allowed: {', '.join(FEATURES)}")
    for s in strategies:
        out = a.out if len(strategies) == 1 else os.path.join(a.out, s)
        os.makedirs(out, exist_ok=True)
        for f in a.features.split(","):
            fit(f, s, out, a.steps, a.devices)
    with open(os.path.join(a.out, "done.json"), "w") as fh:
        json.dump({"strategy": a.strategy, "features": a.features, "devices": a.devices}, fh)


if __name__ == "__main__":
    main()
