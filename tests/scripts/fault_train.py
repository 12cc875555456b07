"""Fault scenarios on sklearn digits with topk_ddp (2 processes).

--mode nonfinite  (popen launch) phase "skip": rank 1's gradient of net.head.3.weight is NaN at step 3;
                  records whether step 3 left parameters and residuals unchanged on every rank and
                  whether training went on. Phase "raise": +inf at step 2; records the exception.
--mode long       (ranks started by the caller) trains "forever" with a progress file per rank and
                  ``timeout=--timeout`` seconds, so the caller can kill or stop a rank mid-step.
"""
import argparse
import os
import sys
import time
import traceback
from datetime import timedelta

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_probe import digits

from lightning_topk import TopKDDPStrategy
from lightning_topk.models import ImageClassifier, SmallCNN

POISONED = "net.head.3.weight"


class Poison(pl.Callback):
    """Makes rank 1's gradient of POISONED non-finite at one step; snapshots around that step."""

    def __init__(self, step, value):
        self.step, self.value = step, value
        self.report = {}

    def on_train_start(self, trainer, pl_module):
        p = dict(pl_module.named_parameters())[POISONED]
        bad = trainer.global_rank == 1
        p.register_hook(lambda g: g * self.value if bad and trainer.global_step == self.step else g)

    def _snap(self, trainer, pl_module):
        st = trainer.strategy.topk_state
        return ({k: v.detach().clone() for k, v in pl_module.named_parameters()},
                {k: v.clone() for k, v in st.residuals().items()} if st else {})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.before = self._snap(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:  # the poisoned step just ended
            params, res = self._snap(trainer, pl_module)
            self.report["params_unchanged"] = all(torch.equal(params[k], self.before[0][k]) for k in params)
            self.report["residuals_rolled_back"] = bool(res) and all(
                torch.equal(res[k], self.before[1][k]) for k in res)
            self.after_skip = params
        if trainer.global_step == self.step + 2:
            params, _ = self._snap(trainer, pl_module)
            self.report["next_step_trains"] = any(not torch.equal(params[k], self.after_skip[k]) for k in params)


class Progress(pl.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, *args):
        with open(os.path.join(self.out, f"progress_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(str(trainer.global_step))
        time.sleep(0.05)


def trainer_for(strategy, callbacks, max_steps):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, max_epochs=-1,
                      callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)


def nonfinite(out):
    train, _ = digits()
    results = {}
    for mode, value, step in (("skip", float("nan"), 3), ("raise", float("inf"), 2)):
        pl.seed_everything(0)
        model = ImageClassifier(SmallCNN(width=16), lr=0.05)
        poison = Poison(step, value)
        trainer = trainer_for(TopKDDPStrategy(density=0.01, nonfinite=mode, exchange="allgather"), [poison], 8)
        try:
            trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True))
            error = None
        except Exception as e:
            error = {"type": type(e).__name__, "message": str(e), "tb": traceback.format_exc()[-2000:]}
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        results[mode] = dict(report=poison.report, error=error, global_step=trainer.global_step, params=params,
                             finite=all(bool(torch.isfinite(v).all()) for v in params.values()))
    torch.save(results, os.path.join(out, f"nonfinite_rank{trainer.global_rank}.pt"))


def long(out, timeout):
    train, _ = digits()
    pl.seed_everything(0)
    model = ImageClassifier(SmallCNN(width=16), lr=0.05)
    strategy = TopKDDPStrategy(density=0.01, timeout=timedelta(seconds=timeout), exchange="allgather")
    trainer = trainer_for(strategy, [Progress(out)], 100000)
    trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("nonfinite", "long"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=10.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    nonfinite(a.out) if a.mode == "nonfinite" else long(a.out, a.timeout)


if __name__ == "__main__":
    main()
