"""Two tiny models whose parameters go unused in some backward passes, trained by several strategies in one
launch (Lightning's popen launcher re-runs this script for rank 1); every rank dumps, per run, what the
conservation checks of tests/lightning/test_unused.py need.

* ``gan``: manual optimization, two optimizers, ``toggle_optimizer``/``untoggle_optimizer`` (the other network's
  parameters get ``requires_grad=False``, so DDP marks them unused in each backward);
* ``branch``: automatic optimization, a branch used by both ranks on even steps, by rank 0 alone at
  ``step % 4 == 1`` and by no rank at ``step % 4 == 3``.

Both use ``find_unused_parameters=True`` and plain SGD. Per run and rank: the weights at the start and the end,
the sum of this rank's local gradients (tensor hooks on the parameters, before DDP), the sum of what the
optimizers applied (``.grad`` in ``on_before_optimizer_step``; None: nothing) and the pending error feedback
(residuals plus owner residuals folded).

    python tests/scripts/unused_train.py --out DIR
"""
import argparse
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_topk  # noqa: F401  (registers topk_ddp)
from lightning_topk import TopKDDPStrategy
from lightning_topk.comm.exchanges.scatter import fold_owner_residual

LR = 0.5  # a power of two: lr * grad is exact, so the weights' change converts back to gradient units closely
STEPS = 8
SPARSE = dict(density=0.05, min_sparse_numel=0)
STRATEGIES = {
    "ddp": lambda: pl.strategies.DDPStrategy(find_unused_parameters=True),
    "dense1": lambda: TopKDDPStrategy(density=1.0, exchange="allgather", find_unused_parameters=True),
    "allgather": lambda: TopKDDPStrategy(exchange="allgather", find_unused_parameters=True, **SPARSE),
    "scatter": lambda: TopKDDPStrategy(exchange="scatter", find_unused_parameters=True, **SPARSE),
    "local": lambda: TopKDDPStrategy(local_steps=2, outer_lr=1.0, outer_momentum=0.0, find_unused_parameters=True),
}


class GAN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))
        self.d = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        real, z = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        g_loss = F.softplus(-self.d(self.g(z))).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = F.softplus(-self.d(real)).mean() + F.softplus(self.d(self.g(z).detach())).mean()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=LR), torch.optim.SGD(self.d.parameters(), lr=LR)


class Branch(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.branch = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        t = self.global_step
        if t % 2 == 0 or (t % 4 == 1 and self.global_rank == 0):
            out = out + self.branch(h)
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def data(kind):
    g = torch.Generator().manual_seed(1)
    n = 2 * 4 * STEPS  # both ranks, batches of 4
    if kind == "gan":
        return TensorDataset(torch.randn(n, 6, generator=g) * 0.5 + 1.0, torch.randn(n, 4, generator=g))
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


class Record(pl.Callback):
    """Start/end weights, summed local gradients and summed applied gradients, in float64."""

    def on_train_start(self, trainer, pl_module):
        self.names = {id(p): n for n, p in pl_module.named_parameters()}
        self.start = {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}
        self.local = {n: torch.zeros_like(v) for n, v in self.start.items()}
        self.applied = {n: torch.zeros_like(v) for n, v in self.start.items()}
        for n, p in pl_module.named_parameters():
            p.register_hook(self._adder(n))

    def _adder(self, name):
        def add(g):
            self.local[name].add_(g.detach().double())  # returns None: the gradient is left as it is
        return add

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.applied[self.names[id(p)]].add_(p.grad.detach().double())


def pending(strategy):
    st = getattr(strategy, "topk_state", None)
    if st is None:
        return {}
    out = {n: v.detach().double().clone() for n, v in st.residuals().items()}
    for ex in st.exchanges.values():
        for key, t in getattr(getattr(ex, "owners", None), "live", {}).items():
            for n, v in fold_owner_residual(key, t).items():
                out[n] = out[n] + v.double() if n in out else v.double()
    return out


def run(kind, name, out):
    pl.seed_everything(0)
    model = GAN() if kind == "gan" else Branch()
    rec = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[name](), max_steps=STEPS * (2 if kind == "gan" else 1),
                         max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[rec], deterministic=True)
    trainer.fit(model, DataLoader(data(kind), batch_size=4, shuffle=False))
    st = getattr(trainer.strategy, "topk_state", None)
    dump = dict(start=rec.start, end={n: p.detach().double().clone() for n, p in model.named_parameters()},
                local=rec.local, applied=rec.applied, pending=pending(trainer.strategy),
                exchanges=None if st is None else st.step, global_step=trainer.global_step)
    torch.save(dump, os.path.join(out, f"{kind}_{name}_rank{trainer.global_rank}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default=",".join(STRATEGIES))
    a = ap.parse_args()
    torch.set_num_threads(1)
    for kind in ("gan", "branch"):
        for name in a.runs.split(","):
            run(kind, name, a.out)


if __name__ == "__main__":
    main()
