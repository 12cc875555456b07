"""recipe="auto" where it engages (SGD with momentum and weight decay, sparse from the first step), run as 2 simulated
nodes x 1 process (start with tests.helpers.procs.run_nodes); phases run one after another in one launch, each rank
dumps OUT/<phase>_rank<r>.pt (full parameters, recipe engaged, velocities, optimizer state counts, or the error).

  <s>_straight  3 steps, automatic optimization (s = ddp: topk_ddp, fsdp: topk_fsdp)
  <s>_stop      1 step (the first sparse one: the recipe engages from the next), then trainer.save_checkpoint
  <s>_resume    resumes <s>_stop's checkpoint to 3 steps (expected: <s>_straight bit for bit)
  <s>_manual    3 steps, manual optimization (expected: <s>_straight bit for bit)
  tune_ddp      Lightning's ddp + BackboneFinetuning(unfreeze_at_epoch=1): the reference for the two below
  tune_none     topk_ddp recipe="none" + BackboneFinetuning
  tune_auto     topk_ddp recipe="auto" + BackboneFinetuning (expected: refused at setup)
  unfreeze      topk_ddp recipe="auto", a callback of the user's unfreezes the backbone at epoch 1 and adds it to the
                optimizer (expected: refused at that step)

Every epoch is one step (each rank's 8 rows are one batch), so a checkpoint after a step resumes at the same batch
without a resumable loader.
"""
import argparse
import os
import sys
import warnings
from argparse import Namespace

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from fsdp_train import LM, data

from lightning_topk.lightning.fsdp import TopKFSDPStrategy
from lightning_topk.lightning.strategy import TopKDDPStrategy

warnings.filterwarnings("ignore")
SPARSE = dict(density=0.05, exchange="allgather", min_sparse_numel=0)
STEPS = 3


def lm_args():
    return Namespace(strategy="topk", bad_mesh=False, user_shard=False, partial_shard=False, data_by_step=False,
                     inject_step=-1, optimizer="sgd",
                     weight_decay=0.01, nesterov=False, onecycle=False, engage=False, steps=STEPS, local_steps=0)


class ManualLM(LM):
    def __init__(self, args):
        super().__init__(args)
        self.automatic_optimization = False

    def training_step(self, batch, i):
        opt = self.optimizers()
        loss = super().training_step(batch, i)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class Tuned(pl.LightningModule):
    """A backbone and a head; the optimizer gets only what is trainable (as BackboneFinetuning asks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class Freeze(pl.Callback):
    """The user's own fine-tuning: the backbone frozen before setup, unfrozen into a new group at epoch 1."""

    def setup(self, trainer, pl_module, stage):
        pl_module.backbone.requires_grad_(False)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.backbone.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters())})


def trainer_for(strategy, rank, steps, callbacks=()):
    return pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=steps,
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)


def dump(out, phase, trainer, model, **extra):
    full = {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()}
    s = trainer.strategy
    st, live = getattr(s, "topk_state", None), getattr(s, "topk_live_recipe", None)
    opt = trainer.optimizers[0]
    info = dict(params=full, step=trainer.global_step, engaged=bool(live is not None and live.engaged),
                exchange_step=st.step if st is not None else None,
                velocities={k: v.clone() for k, v in st.velocities().items()} if st is not None else {},
                momentum_buffers=sum("momentum_buffer" in v for v in opt.state.values()),
                wd_momentum=sum("topk_wd_momentum" in v for v in opt.state.values()),
                trace=list(getattr(model, "trace", [])), **extra)
    torch.save(info, os.path.join(out, f"{phase}_rank{trainer.global_rank}.pt"))


def lm_phase(a, phase, rank):
    kind, what = phase.split("_")
    strategy = (TopKDDPStrategy if kind == "ddp" else TopKFSDPStrategy)(**SPARSE)
    model = (ManualLM if what == "manual" else LM)(lm_args())
    trainer = trainer_for(strategy, rank, 1 if what == "stop" else STEPS)
    ck = os.path.join(a.out, f"ck_{kind}")
    loader = DataLoader(data(rank, 2, n=16), batch_size=8, shuffle=False)
    trainer.fit(model, loader, ckpt_path=ck if what == "resume" else None)
    if what == "stop":
        trainer.save_checkpoint(ck)
    dump(a.out, phase, trainer, model)


def tune_phase(a, phase, rank):
    from pytorch_lightning.callbacks import BackboneFinetuning

    if phase == "tune_ddp":
        strategy = pl.strategies.DDPStrategy()
    else:
        strategy = TopKDDPStrategy(density=0.05, exchange="allgather", min_sparse_numel=0,
                                   recipe="none" if phase == "tune_none" else "auto")
    cb = Freeze() if phase == "unfreeze" else BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
    g = torch.Generator().manual_seed(rank)
    loader = DataLoader(TensorDataset(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)),
                        batch_size=8)
    model = Tuned()
    trainer = trainer_for(strategy, rank, STEPS, callbacks=[cb])
    try:
        trainer.fit(model, loader)
    except ValueError as e:
        torch.save(dict(error=str(e), step=trainer.global_step, epoch=trainer.current_epoch),
                   os.path.join(a.out, f"{phase}_rank{rank}.pt"))
        return
    backbone = {id(p) for p in model.backbone.parameters()}
    opt = trainer.optimizers[0]
    dump(a.out, phase, trainer, model, error=None, groups=len(opt.param_groups),
         backbone_buffers=sum("momentum_buffer" in opt.state.get(p, {}) for g in opt.param_groups
                              for p in g["params"] if id(p) in backbone))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="ddp_straight,ddp_stop,ddp_resume,ddp_manual")
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("NODE_RANK", 0))
    for phase in a.phases.split(","):
        (lm_phase if phase.split("_")[0] in ("ddp", "fsdp") else tune_phase)(a, phase, rank)


if __name__ == "__main__":
    main()
