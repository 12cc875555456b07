"""Writes the v1 checkpoint fixture (tests/lightning/fixtures/v1/) that the v2 loader must still read.

Run from a checkout of the v1 code (commit 6cbf092) with 2 CPU processes::

    python tests/scripts/make_v1_checkpoint.py --out tests/lightning/fixtures/v1

A 2-process Trainer trains a tiny MLP for 3 steps with the scale-free exchange (owner residuals and
rank residuals both non-zero) and saves ``OUT/v1.ckpt`` plus its shards; ``OUT/expected_rank<r>.pt``
holds what each rank's state was, to compare with what a v2 build restores.
"""
import argparse
import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_topk import TopKDDPStrategy


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 96), nn.ReLU(), nn.Linear(96, 4))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 16, generator=g), torch.randint(0, 4, (48,), generator=g))
    strategy = TopKDDPStrategy(density=0.05, min_sparse_numel=0, exchange="scatter")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=True)
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    trainer.save_checkpoint(os.path.join(a.out, "v1.ckpt"))
    st = trainer.strategy.topk_state
    torch.save({"step": st.step, "residual": {k: v.clone() for k, v in st.residuals().items()},
                "owner_residual": {k: v.clone() for k, v in st.owner_residuals.items()}},
               os.path.join(a.out, f"expected_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
