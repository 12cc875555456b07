"""A parameter used on one rank of a replica group only, on some steps (tests/lightning/test_elastic_unused.py).

``--replica R --devices 2``: replica group R of a ``fault_tolerance="torchft"`` run (``TORCHFT_LIGHTHOUSE`` set);
``--reference``: Lightning's own ``ddp`` on ``2 * devices`` processes of one Trainer, global rank g playing replica
``g // devices``'s local rank ``g % devices``. Each process trains on batches fixed by (its place, step); a side
layer runs only on local rank 0 at odd steps. Writes ``<out>/<tag>.rank<g>.pt``: the parameters after ``--steps``.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_topk  # noqa: F401  (registers topk_ddp)
from lightning_topk import TopKDDPStrategy
from tests.helpers.digits import digits


class Net(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        torch.manual_seed(0)
        self.args = args
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.side = nn.Linear(64, 10)
        self.x, self.y = digits()[0].tensors

    def place(self):
        """(group, local rank) this process plays."""
        if self.args.reference:
            return divmod(self.global_rank, self.args.devices)
        return self.args.replica, self.local_rank

    def training_step(self, batch, _):
        step = int(batch[0])
        group, local = self.place()
        g = torch.Generator().manual_seed(1000 * (group * self.args.devices + local) + step)
        idx = torch.randint(0, len(self.x), (16,), generator=g)
        x, y = self.x[idx], self.y[idx]
        out = self.body(x)
        if local == 0 and step % 2 == 1:  # used on this rank only, at odd steps
            out = out + self.side(x)
        return nn.functional.cross_entropy(out, y)

    def on_train_end(self):
        group, local = self.place()
        tag = self.args.tag
        torch.save({k: v.detach().clone() for k, v in self.state_dict().items()},
                   Path(self.args.out) / f"{tag}.rank{group * self.args.devices + local}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.arange(self.args.steps), batch_size=1)  # every rank: steps 0, 1, ...


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="ft")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--exchange", default="allgather")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--ref-strategy", default="ddp_find_unused_parameters_true")
    args = ap.parse_args()
    if args.reference:
        strategy = args.ref_strategy
        if strategy == "topk_ddp":
            strategy = TopKDDPStrategy(exchange=args.exchange, value_dtype="fp32", find_unused_parameters=True)
        devices = 2 * args.devices
    else:
        strategy = TopKDDPStrategy(fault_tolerance="torchft", density=0.05, min_sparse_numel=64,
                                   exchange=args.exchange, value_dtype="fp32", min_replicas=2, ft_timeout=30.0, ft_quorum_timeout=60.0,
                                   ft_connect_timeout=5.0, log_telemetry=False)
        devices = args.devices
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False)
    if args.reference:
        os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    trainer.fit(Net(args))


if __name__ == "__main__":
    main()
