"""recipe="auto" with AdamW under topk_ddp (issue 42), run as 2 simulated nodes x 1 process (start with
tests.helpers.procs.run_nodes); phases run one after another in one launch, each rank dumps OUT/<phase>_rank<r>.pt
(per-step parameters and optimizer groups, the recipe's state at the end).

  ddp       Lightning's ddp, AdamW(weight_decay) under a per-step LambdaLR that rises for 4 steps, then decays; 8 steps:
            the reference of the dense steps
  straight  topk_ddp density 0.05, dense_steps=2: steps 1-2 dense, 3-4 too (the lr rises), all dormant (ddp bit for
            bit); step 5 the first sparse one (still the user's AdamW); engaged from step 6
  stop      the same to step 6 (engaged), then trainer.save_checkpoint
  resume    stop's checkpoint resumed to 8 steps (expected: straight bit for bit)
  skip      nonfinite="skip", 7 steps, a NaN in one gradient element on rank 0 at step 7 (engaged): the step is
            skipped on every rank (expected: the hook's and the optimizer's state as stop's after step 6)

Every epoch is one step (each rank's 8 rows are one batch), so a checkpoint after a step resumes at the same batch.
"""
import argparse
import os
import sys
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from lightning_topk.lightning.strategy import TopKDDPStrategy

warnings.filterwarnings("ignore")
STEPS = 8


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 4))
        self.trace = []
        self.nan_at = None  # the global step (0-based) whose gradient gets a NaN on rank 0

    def on_train_start(self):
        self.net[0].weight.register_hook(self._poison)  # before the recipe's hook (registered when it engages)

    def _poison(self, g):
        if self.global_step == self.nan_at and self.global_rank == 0:
            g = g.clone()
            g.view(-1)[3] = float("nan")
        return g

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, i):
        g = self.trainer.optimizers[0].param_groups[0]
        self.trace.append(dict(step=self.trainer.global_step, lr=g["lr"], betas=tuple(g["betas"]),
                               weight_decay=g["weight_decay"],
                               params={n: p.detach().clone() for n, p in self.named_parameters()}))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) / (1 + 0.1 * max(0, s - 3)))
        return [opt], [dict(scheduler=sched, interval="step")]


def run(a, phase, rank):
    if phase == "ddp":
        strategy = pl.strategies.DDPStrategy()
    else:
        strategy = TopKDDPStrategy(density=0.05, exchange="allgather", min_sparse_numel=0, dense_steps=2,
                                   nonfinite="skip" if phase == "skip" else "raise")
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy,
                         max_steps={"stop": 6, "skip": 7}.get(phase, STEPS), use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    g = torch.Generator().manual_seed(rank)
    loader = DataLoader(TensorDataset(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)),
                        batch_size=8)
    model = Net()
    model.nan_at = 6 if phase == "skip" else None
    ck = os.path.join(a.out, "ck")
    trainer.fit(model, loader, ckpt_path=ck if phase == "resume" else None)
    if phase == "stop":
        trainer.save_checkpoint(ck)
    s = trainer.strategy
    st, live = getattr(s, "topk_state", None), getattr(s, "topk_live_recipe", None)
    opt = trainer.optimizers[0]
    torch.save(dict(
        trace=model.trace, step=trainer.global_step, recipe=getattr(s, "topk_recipe", None),
        live=type(live).__name__ if live is not None else None, engaged=bool(live is not None and live.engaged),
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        velocities={k: v.clone() for k, v in st.velocities().items()} if st is not None else {},
        residuals={k: v.clone() for k, v in st.residuals().items()} if st is not None else {},
        local_v={k: v.clone() for k, v in st.recipe_state.items()} if st is not None else {},
        optimizer_state_keys=sorted({k for v in opt.state.values() for k in v}),
        optimizer_state={n: {k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()}
                         for n, p in model.named_parameters()},
    ), os.path.join(a.out, f"{phase}_rank{rank}.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="ddp,straight,stop,resume,skip")
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("NODE_RANK", 0))
    for phase in a.phases.split(","):
        run(a, phase, rank)


if __name__ == "__main__":
    main()
