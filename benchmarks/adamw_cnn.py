"""A user's AdamW recipe on a small CNN, as a user would switch it: Lightning's ``ddp`` against ``topk_ddp`` at
density 0.01 with the all-gather exchange pinned and ``recipe="auto"`` (the default, the AdamW recipe) or
``recipe="none"`` (plain error feedback, the behaviour before the recipe).

The model and optimizer are not this project's: a two-convolution CNN on scikit-learn's digits (8x8, the 1437/360
split of ``convergence.py``), ``torch.optim.AdamW(lr=2e-3, weight_decay=0.01)``, 2 processes of 32 samples, the
test accuracy after 4 and 12 epochs. Each configuration runs as its own 2-process Lightning job (``--worker``).

Usage::

    python benchmarks/adamw_cnn.py --seeds 0 1 2 --json benchmarks/results/adamw_cnn.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

CONFIGS = {  # name -> strategy spec
    "ddp": "ddp",
    "topk_auto": "topk:auto",
    "topk_none": "topk:none",
}
EPOCHS = (4, 12)


def worker(strategy: str, seed: int, epochs: int, out: str) -> None:
    import pytorch_lightning as pl
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8)
    g = lambda a: torch.tensor(a, dtype=torch.long)
    train, test = TensorDataset(f(xtr), g(ytr)), TensorDataset(f(xte), g(yte))

    class CNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                                     nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(),
                                     nn.Linear(128, 10))
            self.correct = 0

        def training_step(self, batch, _):
            xb, yb = batch
            return nn.functional.cross_entropy(self.net(xb), yb)

        def test_step(self, batch, _):
            xb, yb = batch
            self.log("test_acc", (self.net(xb).argmax(1) == yb).float().mean(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.01)

        def train_dataloader(self):
            return DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed + 1))

        def test_dataloader(self):
            return DataLoader(test, batch_size=90)

    if strategy == "ddp":
        strat = pl.strategies.DDPStrategy(process_group_backend="gloo")
    else:
        from lightning_topk import TopKDDPStrategy

        strat = TopKDDPStrategy(density=0.01, exchange="allgather", recipe=strategy.split(":")[1],
                                process_group_backend="gloo", log_telemetry=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strat, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = CNN()
    trainer.fit(model)
    res = trainer.test(model, verbose=False)
    if trainer.global_rank == 0:
        with open(out, "w") as fh:
            json.dump({"acc": res[0]["test_acc"], "steps": trainer.global_step}, fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", nargs="+", type=int, default=list(EPOCHS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json")
    ap.add_argument("--worker", nargs=4, metavar=("STRATEGY", "SEED", "EPOCHS", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]), a.worker[3])
        return
    rows: List[Dict] = []
    for epochs in a.epochs:
        for name in a.configs:
            for seed in a.seeds:
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "r.json")
                    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
                    p = subprocess.run([sys.executable, __file__, "--worker", CONFIGS[name], str(seed), str(epochs),
                                        out], env=env, capture_output=True, text=True, cwd=d)
                    if p.returncode != 0:
                        raise SystemExit(f"adamw_cnn: {name} seed {seed} failed:\n{p.stderr[-3000:]}")
                    with open(out) as fh:
                        r = json.load(fh)
                rows.append(dict(config=name, seed=seed, epochs=epochs, **r))
                print(f"{name:10s} epochs={epochs:2d} seed={seed} acc={r['acc']:.4f} steps={r['steps']}", flush=True)
    for epochs in a.epochs:
        for name in a.configs:
            accs = [r["acc"] for r in rows if r["config"] == name and r["epochs"] == epochs]
            print(f"| {epochs} | {name} | {sum(accs) / len(accs):.4f} | {min(accs):.4f}-{max(accs):.4f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
