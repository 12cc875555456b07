"""mode="auto" through a Trainer across 2 simulated nodes (issue 42): rank r writes rank{r}.json with what the
strategy chose and ran.

    python tests/scripts/mode_train.py --out DIR --link-gbps 0.01 [--option name=value]   (once per node)
        [--max-steps N] [--batch-size B] [--opt sgd|adamw] [--ckpt-every N --ckpt-dir DIR] [--resume CKPT]
"""
import argparse
import json
import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_topk import TopKDDPStrategy


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                       torch.nn.ReLU(), torch.nn.Linear(1024, 10))  # 1.1M parameters

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if args.opt == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_end(self):
        s = self.trainer.strategy
        ex = s.topk_state.exchange
        out = {"mode": s.topk_mode.mode, "preset": s.topk_mode.preset, "reason": s.topk_mode.reason,
               "local_steps": s.topk_config.local_steps, "outer_density": s.topk_config.outer_density,
               "outer_value_bits": s.topk_config.outer_value_bits, "local_sgd": bool(getattr(ex, "local_sgd", False)),
               "weights": float(sum(p.double().sum() for p in self.parameters()))}
        with open(os.path.join(args.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--link-gbps", type=float, default=10.0)
    p.add_argument("--option", action="append", default=[])
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--opt", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps into --ckpt-dir")
    p.add_argument("--ckpt-dir")
    p.add_argument("--resume", help="checkpoint to resume from")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(128, 64), torch.randint(0, 10, (128,)))
    strategy = TopKDDPStrategy(auto_link_gbps=args.link_gbps, log_telemetry=False, process_group_backend="gloo",
                               **options)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=args.max_steps,
                         logger=False,
                         deterministic=True, enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ModelCheckpoint(
                             args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1)] if args.ckpt_every
                         else None)
    trainer.fit(Module(), DataLoader(data, batch_size=args.batch_size), ckpt_path=args.resume)
