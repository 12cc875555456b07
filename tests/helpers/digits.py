"""Shared model/data for the precision tests (no tests here). Real data: scikit-learn's digits."""
import json
import math
import os

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_topk.optim import LARS, build_optimizer, param_groups


def digits():
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    g = lambda a: torch.tensor(a, dtype=torch.long)
    return TensorDataset(f(xtr), g(ytr)), TensorDataset(f(xte), g(yte))


class DigitsNet(pl.LightningModule):
    """MLP with a LayerNorm on the digits; optional overflow injection on one rank at one step."""

    def __init__(self, opt="adamw", lr=3e-3, impl="fused", param_dtype=None, inject_step=None, inject_rank=0,
                 inject="loss", out_dir=None, batch_size=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)  # the initialisation; the loader's shuffling is seeded with seed + 1
        self.seed = seed
        self.net = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))
        if param_dtype is not None:
            self.net.to(param_dtype)
        self.opt, self.lr, self.impl = opt, lr, impl
        self.inject_step, self.inject_rank, self.inject = inject_step, inject_rank, inject
        self.out_dir, self.batch_size = out_dir, batch_size
        self.log_rows = []

    def setup(self, stage):
        torch.set_num_threads(1)  # tiny model on a shared 2-core machine: OpenMP waits dominate otherwise

    def _injecting(self):
        return self.inject_step is not None and self.global_step == self.inject_step \
            and self.global_rank == self.inject_rank

    def training_step(self, batch, _):
        x, y = batch
        x = x.to(next(self.net.parameters()).dtype)
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        if self.inject == "loss" and self._injecting():
            loss = loss * float("inf")
        return loss

    def on_after_backward(self):
        if self.inject == "grad" and self._injecting():
            p = next(self.net.parameters())
            p.grad.view(-1)[0] = float("inf")  # after the exchange: only this rank sees it

    def on_train_batch_end(self, outputs, batch, batch_idx):
        plugin = self.trainer.precision_plugin
        state = getattr(self.trainer.strategy, "topk_state", None)
        res_ok = True
        if state is not None:
            res_ok = all(bool(torch.isfinite(r).all()) for r in state.residuals().values())
        scaler = getattr(plugin, "scaler", None)
        self.log_rows.append(dict(step=self.global_step, skipped=bool(getattr(plugin, "last_step_skipped", False)),
                                  scale=scaler.get_scale() if scaler is not None else 1.0, residuals_finite=res_ok,
                                  n_residuals=0 if state is None else len(state.residuals()),
                                  param0=float(next(self.net.parameters()).detach().float().sum())))

    def on_train_end(self):
        if self.out_dir:
            out = dict(rows=self.log_rows, accuracy=accuracy(self))
            path = os.path.join(self.out_dir, f"rank{self.global_rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(path + ".tmp", path)

    def configure_optimizers(self):
        if self.opt == "lars":
            return LARS(param_groups(self.net, 1e-4), lr=self.lr, trust_coeff=0.02)
        if self.impl == "default":  # torch's default implementation choice (the plugin may fuse it)
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return build_optimizer(self.opt, param_groups(self.net, 1e-4), lr=self.lr, impl=self.impl)

    def train_dataloader(self):
        train, _ = digits()
        return DataLoader(train, batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(1 + self.seed))


@torch.no_grad()
def accuracy(model):
    _, test = digits()
    x, y = test.tensors
    net = model.net
    pred = net(x.to(next(net.parameters()).dtype)).float().argmax(1)
    return float((pred == y).float().mean())


def trainer(plugin=None, epochs=8, **kw):
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("devices", 1)
    return pl.Trainer(max_epochs=epochs, plugins=[plugin] if plugin is not None else None, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **kw)


def finite(x):
    return math.isfinite(x)


