"""Trains a small model whose largest layer comes first, then four 1M-entry layers, for a few steps
with ``topk_ddp`` on 2 nodes x 1 CPU process (``tests.helpers.procs.run_nodes``) and a 0.1 Gbit/s link
assumed (``auto_link_gbps``); rank r writes rank{r}.json with the bucket rule's plan and DDP's own bucket
layout: ``exchange="auto"`` with the timing-free model records every bucket size it planned for (DDP's
first-iteration bucket, then the rebuilt ones), and the telemetry counts the buckets of the last step.

    python tests/scripts/bucket_probe.py --out DIR [--bucket-cap-mb 25]   (once per node, NODE_RANK set)
"""
import argparse
import json
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_topk import TopKDDPStrategy


def build():
    # backward order: the head (10K entries), four 1M-entry Linears, the first Linear (4.2M), the conv.
    # DDP's default layout puts three of the 1M Linears and the first one in one bucket (the conv's is last).
    lin = torch.nn.Linear
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Flatten(), lin(4 * 32 * 32, 1024),
                               *[lin(1024, 1024) for _ in range(4)], lin(1024, 10))


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = build()

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self):
        strategy = self.trainer.strategy
        plan = strategy.topk_bucket_plan
        logging_data = strategy.model._get_ddp_logging_data()
        out = {"plan": None if plan is None else {"cap_mb": plan.cap_mb, "buckets": list(plan.buckets)},
               "planned_sizes": sorted(int(n) for n in strategy.topk_state.exchange.plan),
               "ddp_cap_bytes": int(logging_data["bucket_cap_bytes"]),
               "rebuilt": int(logging_data["has_rebuilt_buckets"]),
               "buckets_exchanged_last_step": strategy.topk_stats.buckets}
        with open(os.path.join(args.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 1, 32, 32), torch.randint(0, 10, (64,)))
    kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    # fp32 values: at 6 bytes per entry the rule finds a cap that splits DDP's last bucket (bf16 halves the bytes)
    strategy = TopKDDPStrategy(density=0.01, exchange="auto", auto_model="constants", auto_link_gbps=0.1, log_telemetry=False,
                               value_dtype="fp32",
                               process_group_backend="gloo", **kw)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), DataLoader(data, batch_size=8))
