"""Runs cells of the support matrix (:mod:`lightning_topk.support`) on real gloo processes, for
tests/matrix/test_support_matrix.py. One launch runs the cells of one (strategy, api, layout), in turn, in one
process group (Lightning's launcher re-runs this script for the node's other ranks; start 2+ nodes with
tests.helpers.procs.run_nodes).

    python tests/scripts/cell_probe.py --cells CELLS.json --out DIR

Per cell, phases: ``full`` trains T steps and checkpoints after every step; ``resume<k>``, for each k of the cell's
resume points, resumes the checkpoint taken after step k and trains to T. ``--reference ddp`` (Trainer, topk_ddp
cells) runs the same protocol under Lightning's own ``ddp`` instead (phases ``ddp_full``, ``ddp_resume<k>``). Every rank writes
``DIR/<cell id>/<phase>.rank<r>.pt``: the final parameters (full tensors), the step reached and the decisions.
A refused cell writes ``DIR/<cell id>/refused.rank<r>.json`` with the error instead.

Every rank reads the batch fixed by (global rank, global step), so a resumed run sees the batches an uninterrupted
one does whatever its loader replays.
"""
import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from sklearn.datasets import load_digits

warnings.filterwarnings("ignore")
STEPS, EPOCH, BATCH, H, DENSE = 6, 3, 16, 2, 2


def digits():
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm], torch.tensor(d.target)[perm]


X, Y = digits()


def batch(rank, world, step):
    i = (torch.arange(BATCH) + (step * world + rank) * BATCH) % len(X)
    return X[i], Y[i]


def resume_points(cell):
    """After the first step that sends sparse, and one later (mid-round under local SGD). With BackboneFinetuning,
    before it unfreezes (at epoch 1): Lightning's own ddp does not resume bit for bit after that (6e-4 here)."""
    if cell["feature"] == "unfreeze":
        return [1, 2]
    return {"per_step": [1, 4], "dense_steps": [DENSE + 1, 4], "local_sgd": [1, 3]}[cell["mode"]]


class Net(nn.Module):
    def __init__(self, unused):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(64, 10)
        self.extra = nn.Linear(64, 10) if unused else None

    def forward(self, x, use_extra=False):
        for b in self.blocks:
            x = b(x)
        out = self.head(x)
        return out + self.extra(x) if use_extra else out


def options(cell):
    o = dict(density=0.05, min_sparse_numel=0, value_dtype="fp32")
    if cell["mode"] == "local_sgd":
        o.update(local_steps=H, outer_exchange=cell["exchange"])
    else:
        o.update(exchange=cell["exchange"])
    if cell["mode"] == "dense_steps":
        o.update(dense_steps=DENSE)
    if cell["fault_tolerance"] == "torchft":  # refused cells only (the matrix's torchft cells run elsewhere)
        o.update(fault_tolerance="torchft", lighthouse="http://127.0.0.1:9")
    return o


def refused(out, rank, error):
    """A refusal: its message, and whether a process group existed when it came (it must not)."""
    import torch.distributed as dist

    (out / f"refused.rank{rank}.json").write_text(json.dumps({"error": str(error), "pg": dist.is_initialized()}))


def make_optimizer(params, cell):
    if cell["feature"] == "unfreeze":  # BackboneFinetuning adds the backbone's group: plain error feedback
        return torch.optim.AdamW(params, lr=3e-3, foreach=False)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)


def full_params(module):
    out = {}
    for n, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach().clone()
    return out


def _decisions(strategy):
    st = getattr(strategy, "topk_state", None)
    return {"recipe": getattr(strategy, "topk_recipe", None),
            "residual_sum": float(sum(t.double().sum() for t in st.residuals().values())) if st is not None else 0.0}


def run_trainer(cell, phase, resume, out, reference=None):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BackboneFinetuning, Callback

    from lightning_topk.lightning.fsdp import TopKFSDPStrategy
    from lightning_topk.lightning.strategy import TopKDDPStrategy

    fsdp = cell["strategy"] == "topk_fsdp"
    unused = cell["feature"] == "unused"

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(unused)
            self.automatic_optimization = cell["optimization"] == "automatic"

        @property
        def backbone(self):
            return self.net.blocks

        def configure_model(self):
            if fsdp and cell["feature"] == "partial_shard":
                from torch.distributed.fsdp import fully_shard

                for b in self.net.blocks:
                    fully_shard(b, mesh=self.device_mesh["shard"])

        def training_step(self, _, i):
            world, step = self.trainer.world_size, self.global_step
            x, y = batch(self.global_rank, world, step)
            use = unused and self.global_rank == 0 and step % 2 == 1
            loss = nn.functional.cross_entropy(self.net(x, use), y)
            if not self.automatic_optimization:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                return None
            return loss

        def configure_optimizers(self):
            params = [p for p in self.parameters() if p.requires_grad]
            return make_optimizer(params, cell)

    if reference == "ddp":
        strategy = pl.strategies.DDPStrategy(find_unused_parameters=unused)
    elif fsdp:
        strategy = TopKFSDPStrategy(**options(cell))
    else:
        strategy = TopKDDPStrategy(**options(cell), find_unused_parameters=unused)
    nodes, procs = (int(v) for v in cell["layout"].split("x"))
    if cell["fault_tolerance"] == "torchft":
        nodes = 1  # one Trainer per replica group
    ends = dict(max_steps=STEPS, max_epochs=-1) if cell["end"] == "max_steps" else dict(max_epochs=STEPS // EPOCH)
    class SaveEveryStep(Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.save_checkpoint(out / "ckpt" / f"step={trainer.global_step}.ckpt")

    callbacks = [SaveEveryStep()] if phase.endswith("full") else []
    if cell["feature"] == "unfreeze":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False))
    trainer = pl.Trainer(accelerator="cpu", devices=procs, num_nodes=nodes, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks, **ends)
    module = Module()
    loader = DataLoader(TensorDataset(torch.zeros(EPOCH, 1)), batch_size=1)  # the batch is picked by the step
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    info = {"params": full_params(module.net), "step": trainer.global_step}
    info.update(_decisions(trainer.strategy))
    torch.save(info, out / f"{phase}.rank{trainer.global_rank}.pt")


def run_fabric(cell, phase, resume, out):
    from lightning.fabric import Fabric

    from lightning_topk.lightning.fabric import fabric_strategy_class
    from lightning_topk.lightning.fsdp_fabric import fabric_fsdp_class

    fsdp = cell["strategy"] == "topk_fsdp"
    unused = cell["feature"] == "unused"
    cls = fabric_fsdp_class("lightning.fabric") if fsdp else fabric_strategy_class("lightning.fabric")
    kw = {} if fsdp else dict(find_unused_parameters=unused)
    nodes, procs = (int(v) for v in cell["layout"].split("x"))
    if cell["fault_tolerance"] == "torchft":
        nodes = 1
    fabric = Fabric(accelerator="cpu", devices=procs, num_nodes=nodes, strategy=cls(**options(cell), **kw))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    if fsdp:
        net = Net(unused)
        if cell["feature"] == "partial_shard":
            from torch.distributed.fsdp import fully_shard

            for b in net.blocks:
                fully_shard(b, mesh=fabric.strategy.device_mesh["shard"])
        model = fabric.setup_module(net)
        opt = fabric.setup_optimizers(make_optimizer(model.parameters(), cell))
    else:
        model, opt = fabric.setup(Net(unused), make_optimizer(Net(unused).parameters(), cell))
    state = {"model": model, "optimizer": opt, "step": 0}
    if resume:
        fabric.load(resume, state)
    step = state["step"]
    while step < STEPS:
        x, y = batch(rank, world, step)
        loss = nn.functional.cross_entropy(model(x, unused and rank == 0 and step % 2 == 1), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        if phase == "full":
            state["step"] = step
            fabric.save(out / "ckpt" / f"step={step}.ckpt", state)
    info = {"params": full_params(getattr(model, "module", model)), "step": step}
    info.update(_decisions(fabric.strategy))
    torch.save(info, out / f"{phase}.rank{rank}.pt")


def ckpt(out, k, fsdp):
    return str(out / "ckpt" / f"step={k}.ckpt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", default=None, help="ddp: Lightning's own ddp on each cell's model and data")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for cell in json.loads(Path(a.cells).read_text()):
        out = Path(a.out) / cell["id"]
        out.mkdir(parents=True, exist_ok=True)
        fsdp = cell["strategy"] == "topk_fsdp"
        run = run_fabric if cell["api"] == "fabric" else run_trainer
        if a.reference:  # the same protocol under Lightning's own ddp: straight, then resumed at each point
            run_trainer(cell, f"{a.reference}_full", None, out, reference=a.reference)
            for k in resume_points(cell):
                run_trainer(cell, f"{a.reference}_resume{k}", ckpt(out, k, fsdp), out, reference=a.reference)
            continue
        try:
            run(cell, "full", None, out)
        except ValueError as e:
            if not str(e).startswith("topk_"):
                raise
            procs = int(cell["layout"].split("x")[1])
            refused(out, int(os.environ.get("LOCAL_RANK", 0)) + procs * int(os.environ.get("NODE_RANK", 0)), e)
            continue
        if os.environ.get("PROBE_NO_RESUME"):
            continue
        for k in resume_points(cell):
            run(cell, f"resume{k}", ckpt(out, k, fsdp), out)


if __name__ == "__main__":
    main()
