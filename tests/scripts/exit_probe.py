"""Fit, test and exit with topk_ddp on 2 processes; every rank records the lightning_topk threads still
alive right after ``trainer.fit`` and after ``trainer.test`` returned (there must be none).

    python tests/scripts/exit_probe.py --out DIR
"""
import argparse
import json
import os
import sys
import threading

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_probe import digits

from lightning_topk import TopKDDPStrategy
from lightning_topk.models import ImageClassifier, SmallCNN


def ours():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_topk"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    train, val = digits()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=TopKDDPStrategy(density=0.01), max_steps=6,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    model = ImageClassifier(SmallCNN(width=8), lr=0.05)
    trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True))
    after_fit = ours()
    trainer.test(model, DataLoader(val, batch_size=100), verbose=False)
    with open(os.path.join(a.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"after_fit": after_fit, "after_test": ours()}, f)


if __name__ == "__main__":
    main()
