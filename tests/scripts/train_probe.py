"""Trains SmallCNN on sklearn digits with a chosen strategy; every rank dumps its final state.

Run directly (Lightning's popen launcher re-runs this script for rank 1):
    python tests/scripts/train_probe.py --strategy topk_ddp --density 0.01 --out DIR
"""
import argparse
import json
import os

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import lightning_topk  # noqa: F401  (registers topk_ddp)
from lightning_topk import TopKDDPStrategy
from lightning_topk.models import ImageClassifier, SmallCNN


def digits():
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    x = (x - 0.3) / 0.35
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


class Manual(ImageClassifier):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train/loss", loss)


class WithUnused(ImageClassifier):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.unused = torch.nn.Linear(10, 10)


class DumpAtEpoch(pl.Callback):
    """Saves rank{r}_epoch{n}.pt (the parameters) when epoch ``n`` ends: a longer run serves a shorter one's
    checks (SGD with a constant lr and seeded shuffling: its first n epochs are the n-epoch run)."""

    def __init__(self, epochs, out):
        self.epochs, self.out = epochs, out

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 == self.epochs:
            params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"params": params, "global_step": trainer.global_step},
                       os.path.join(self.out, f"rank{trainer.global_rank}_epoch{self.epochs}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="topk_ddp")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--selector", default="exact")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--static-graph", action="store_true")
    ap.add_argument("--manual", action="store_true")
    ap.add_argument("--unused", action="store_true")
    ap.add_argument("--error-feedback", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--hierarchical", default="auto")
    ap.add_argument("--exchange", default="allgather")  # auto may send dense on loopback
    ap.add_argument("--recipe", default="auto", choices=("auto", "none"))
    ap.add_argument("--value-dtype", default=None, choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--dump-epoch", type=int, default=0, help="also save the parameters after this many epochs")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and shuffling (the split stays)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(a.seed, workers=True)
    train, val = digits()
    cls = Manual if a.manual else WithUnused if a.unused else ImageClassifier
    model = cls(SmallCNN(width=16), lr=a.lr)
    ddp_kw = dict(static_graph=a.static_graph, find_unused_parameters=a.unused)
    if a.strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(**ddp_kw)
    elif a.strategy == "topk_ddp" and not any(ddp_kw.values()) and a.density == 0.01 and a.error_feedback \
            and a.exchange == "auto":
        strategy = "topk_ddp"  # by registered name
    else:
        hier = {"true": True, "false": False}.get(a.hierarchical, a.hierarchical)
        strategy = TopKDDPStrategy(density=a.density, selector=a.selector, error_feedback=bool(a.error_feedback),
                                   hierarchical=hier, exchange=a.exchange, recipe=a.recipe,
                                   **({} if a.value_dtype is None else {"value_dtype": a.value_dtype}), **ddp_kw)
    callbacks = [DumpAtEpoch(a.dump_epoch, a.out)] if a.dump_epoch else []
    trainer = pl.Trainer(
        callbacks=callbacks, accelerator="cpu", devices=2, num_nodes=a.num_nodes, strategy=strategy, max_epochs=a.epochs, max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate, logger=pl.loggers.CSVLogger(a.out, name="logs"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, log_every_n_steps=5,
    )
    trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=100))
    callback_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    progress_bar = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
    res = trainer.validate(model, DataLoader(val, batch_size=100), verbose=False)
    rank = trainer.global_rank
    st = getattr(trainer.strategy, "topk_state", None)
    dump = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "residuals": {k: v.clone() for k, v in st.residuals().items()} if st else {},
        "steps": st.step if st else None,
        "totals": vars(st.totals) if st else None,
        "last": vars(st.last) if st else None,
        "callback_metrics": callback_metrics,
        "progress_bar": progress_bar,
        "hier": None if not st or st.groups is None else [st.groups.intra_ranks, st.groups.inter_ranks],
    }
    torch.save(dump, os.path.join(a.out, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"val_acc": res[0]["val/acc"], "global_step": trainer.global_step,
                       "strategy": type(trainer.strategy).__name__}, f)


if __name__ == "__main__":
    main()
