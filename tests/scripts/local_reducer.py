"""Sparse local SGD with one process per node under DDP options that touch DDP's reducer: run as simulated nodes
(tests.helpers.procs.run_nodes, gloo). Every rank writes OUT/<tag>_rank<r>.pt: its final flat weights, the step
count and the outer round count.

  --case gan        manual optimization, two optimizers, toggle_optimizer (a generator and a discriminator);
                    --zero-grad after|before: each optimizer's zero_grad after its step (gradients None at the
                    next backward) or before its backward
  --case static     static_graph=True
  --case unused     find_unused_parameters=True with a parameter the loss never uses
  --case plain      automatic optimization, nothing else
  --strategy local | ddp | torch_avg
                    TopKDDPStrategy(local_steps=H, dense outer settings: outer lr 1, momentum 0, density 1,
                    fp32 values), Lightning's DDPStrategy, or torch's own post-local SGD: the same inner SGD
                    steps under DDP's ``post_localSGD_hook`` and ``PeriodicModelAverager(period=H)``
  --dense-steps N   post-local SGD's synchronous first N steps (both implementations)
"""
import argparse
import os
import sys
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from lightning_topk import TopKDDPStrategy
from tests.helpers.digits import digits

warnings.filterwarnings("ignore")


class Net(pl.LightningModule):
    def __init__(self, case: str, zero_grad: str = "after", lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case, self.zero_when, self.lr = case, zero_grad, lr
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        if case == "gan":
            self.automatic_optimization = False
            self.disc = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
        if case == "unused":
            self.unused = nn.Linear(4, 4)  # in no forward: no gradient on any rank

    def setup(self, stage):
        torch.set_num_threads(1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        if self.case != "gan":
            return nn.functional.cross_entropy(self(x), y)
        opt_g, opt_d = self.optimizers()
        # Lightning's GAN recipe: the generator (self.net: classify, and fool the discriminator), then the
        # discriminator (real = one-hot labels, fake = the generator's softmax); each under toggle_optimizer
        for opt, loss_fn in ((opt_g, self._g_loss), (opt_d, self._d_loss)):
            self.toggle_optimizer(opt)
            if self.zero_when == "before":
                opt.zero_grad()
            self.manual_backward(loss_fn(x, y))
            opt.step()
            if self.zero_when == "after":  # the gradients are None at the next backward
                opt.zero_grad()
            self.untoggle_optimizer(opt)

    def _g_loss(self, x, y):
        logits = self(x)
        return nn.functional.cross_entropy(logits, y) + 0.1 * nn.functional.softplus(-self.disc(logits.softmax(-1))).mean()

    def _d_loss(self, x, y):
        real, fake = nn.functional.one_hot(y, 10).float(), self(x).softmax(-1).detach()
        return (nn.functional.softplus(-self.disc(real)) + nn.functional.softplus(self.disc(fake))).mean()

    def configure_optimizers(self):
        if self.case == "gan":
            return (torch.optim.SGD(self.net.parameters(), lr=self.lr),
                    torch.optim.SGD(self.disc.parameters(), lr=self.lr))
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class TorchPostLocalSGD(pl.Callback):
    """torch's own post-local SGD on Lightning's DDP: DDP's ``post_localSGD_hook`` (a global all-reduce for the first
    ``warmup`` steps, then each node's own: one process per node, so a group of one) and, after each optimizer step,
    ``PeriodicModelAverager`` (what ``PostLocalSGDOptimizer`` runs). torch averages at the first local step and then
    every ``period`` steps; ``warmup_steps = warmup + period - 1`` puts its averages after steps warmup + k*period,
    where an outer round of ``local_steps = period`` comes."""

    def __init__(self, period: int, warmup: int) -> None:
        self.period, self.warmup = period, warmup

    def on_train_start(self, trainer, pl_module):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        subgroup, _ = dist.new_subgroups(group_size=1)  # one process per node
        trainer.strategy.model.register_comm_hook(
            PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=self.warmup),
            post_localSGD_hook)
        self.averager = PeriodicModelAverager(period=self.period, warmup_steps=self.warmup + self.period - 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.averager.average_parameters(pl_module.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--case", default="plain")
    ap.add_argument("--strategy", default="local")
    ap.add_argument("--zero-grad", default="after", help="gan: each optimizer's zero_grad before or after its step")
    ap.add_argument("--H", type=int, default=3)
    ap.add_argument("--dense-steps", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=120)
    a = ap.parse_args()

    train, _test = digits()
    ddp_kw = dict(process_group_backend="gloo", static_graph=a.case == "static",
                  find_unused_parameters=a.case in ("gan", "unused"))
    callbacks = []
    if a.strategy == "local":
        strategy = TopKDDPStrategy(local_steps=a.H, outer_density=1.0, outer_value_bits=32, outer_lr=1.0,
                                   outer_momentum=0.0, dense_steps=a.dense_steps, **ddp_kw)
    else:
        strategy = pl.strategies.DDPStrategy(**ddp_kw)
        if a.strategy == "torch_avg":
            per_batch = 2 if a.case == "gan" else 1  # optimizer steps per batch: local_steps counts each
            callbacks.append(TorchPostLocalSGD(a.H // per_batch, a.dense_steps // per_batch))
    pl.seed_everything(0, workers=True)
    model = Net(a.case, a.zero_grad)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_epochs=a.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, callbacks=callbacks)
    trainer.fit(model, DataLoader(train, batch_size=a.batch, shuffle=True))
    ex = getattr(getattr(trainer.strategy, "topk_state", None), "exchange", None)
    outer = getattr(ex, "outer", None)
    torch.save({"flat": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "steps": trainer.global_step, "batches": trainer.fit_loop.epoch_loop.batch_progress.current.completed,
                "rounds": outer.stats.rounds if outer is not None else 0},
               os.path.join(a.out, f"{a.tag}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
