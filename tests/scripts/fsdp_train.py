"""A small Transformer LM trained with a Trainer on an FSDP2 layout, as simulated nodes (start with
tests.helpers.procs.run_nodes; --devices processes per node). Rank 0 writes OUT: the final full parameters, and
every rank its residual sum and step counters in OUT.rank<r>.

  --strategy topk | hsdp | avg | ddp  TopKFSDPStrategy(...); or Lightning's ModelParallelStrategy with torch's HSDP
                              (fully_shard on the 2-D mesh in configure_model): the per-step reference; or
                              (avg) FSDP on each node's processes and, every --local-steps steps, each parameter
                              shard averaged over the nodes with torch.distributed.all_reduce: local SGD's; or
                              (ddp) TopKDDPStrategy with the same top-k options
  --nesterov                  SGD(nesterov=True) (the reference of recipe="auto" when every entry is sent)
  --selection-scope S --min-sparse-numel N  top-k options (N: 0 unless given)
  --engage                    recipe="auto" engaged before the first step (as after a sparse step)
  --onecycle                  OneCycleLR(cycle_momentum=True) per step: the momentum changes every step
  --weight-decay W            SGD's weight_decay (biases and norms in a group without it)
  --density D --value-dtype V --exchange E --local-steps H --outer-value-bits B  top-k options
  --user-shard                configure_model shards the blocks itself (fully_shard on device_mesh["shard"])
  --steps N                   max_steps; --save PATH saves a checkpoint at the end, --resume PATH resumes
  --data-by-step              every step trains on the batch of its global step, not the loader's (Lightning's
                              loop, resumed from a checkpoint saved at the end of fit, replays a batch: a resume
                              can then be compared over more than one step)
  --inject-step S             rank 0's loss is inf at global step S (nonfinite="skip": skipped on every rank)
  --bad-mesh                  configure_model shards on the 2-D mesh under topk (must be refused)
  --partial-shard             configure_model shards the blocks only (embeddings and head left whole: refused)
  --precision P               Lightning's precision flag (bf16-mixed: FSDP2's MixedPrecisionPolicy)
  --accumulate K              accumulate_grad_batches
  --outer-recipe R            local SGD's outer_recipe (default "average")
  --ckpt-dir D                ModelCheckpoint(dirpath=D, save_last=True) every step; --last: ckpt_path="last"
  --topk-precision            plugins=[TopKPrecision("16-mixed")] (must be refused)
  --torchft R                 fault_tolerance="torchft" (lighthouse: $TORCHFT_LIGHTHOUSE, min_replicas=2): this run is
                              replica group R of 2 (num_nodes=1), reading the batches of node R

Every rank reads its own fixed batches (global rank r: rows r, r + W, ...; no sampler), in both strategies.
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
from lightning_topk.lightning.fsdp import TopKFSDPStrategy
from lightning_topk.models.components.transformer import TransformerLM
from lightning_topk.optim import param_groups

warnings.filterwarnings("ignore")
VOCAB, T = 64, 16


class LM(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.trace = []
        torch.manual_seed(0)
        self.net = TransformerLM(VOCAB, d_model=32, layers=2, heads=2, ff_mult=2, max_len=T, dropout=0.0)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        a = self.args
        if a.strategy == "hsdp" or a.bad_mesh:
            mesh = self.device_mesh
        elif a.strategy == "avg":
            mesh = self.device_mesh["tensor_parallel"]  # ModelParallelStrategy's inner dimension: the node
        elif a.user_shard or a.partial_shard:
            mesh = self.device_mesh["shard"]
        else:
            return  # topk_fsdp shards the blocks, then the root
        for block in self.net.blocks.layers:
            fully_shard(block, mesh=mesh)
        if not a.partial_shard:
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, i):
        (x,) = batch
        if self.args.data_by_step:  # the batch of the global step (Lightning's resumed loop replays a batch)
            rows = self.trainer.train_dataloader.dataset.tensors[0]
            start = (self.global_step * len(x)) % len(rows)
            x = rows[start:start + len(x)]
        logits = self.net(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        if self.args.inject_step == self.global_step and self.global_rank == 0:
            loss = loss * float("inf")
        self.log("loss", loss.detach(), prog_bar=False)
        return loss

    def on_train_batch_end(self, outputs, batch, i):
        if self.args.strategy == "avg" and (self.global_step % self.args.local_steps) == 0:
            import torch.distributed as dist

            group = self.device_mesh["data_parallel"].get_group()
            with torch.no_grad():
                for p in self.parameters():
                    dist.all_reduce(p._local_tensor, group=group)
                    p._local_tensor.div_(dist.get_world_size(group))

    def configure_optimizers(self):
        if self.args.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
        # with weight decay, biases and norms in a group without it (the Hydra optimizers' exclude_from_decay)
        params = param_groups(self, self.args.weight_decay) if self.args.weight_decay else self.parameters()
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=self.args.nesterov,
                              weight_decay=self.args.weight_decay, foreach=False)
        if not self.args.onecycle:
            return opt
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=self.args.steps + 1,
                                                    base_momentum=0.8, max_momentum=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        # (the recipe's momentum, the hook's, the optimizer's own in its step) while the recipe is engaged
        s = self.trainer.strategy
        live, st = getattr(s, "topk_live_recipe", None), getattr(s, "topk_state", None)
        if live is not None and live.engaged:
            self.trace.append((live.momentum(), st.config.momentum, optimizer.param_groups[0]["momentum"]))

    def on_train_start(self):
        if self.args.engage:  # as after a step that sent sparse: the momentum moves into the hook from step 1 on
            s = self.trainer.strategy
            s.topk_live_recipe.engage(s.topk_state)


def data(rank, world, n=256):
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, VOCAB, (n, T + 1), generator=g)
    x[:, 1::2] = (x[:, 0::2][:, : x[:, 1::2].shape[1]] * 3 + 1) % VOCAB  # learnable structure
    return TensorDataset(x[rank::world])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="topk")
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--data-by-step", action="store_true")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--value-dtype", default="bf16")
    p.add_argument("--exchange", default="auto")
    p.add_argument("--local-steps", type=int, default=0)
    p.add_argument("--outer-value-bits", type=int, default=4)
    p.add_argument("--outer-density", type=float, default=0.1)
    p.add_argument("--outer-recipe", default="average")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--user-shard", action="store_true")
    p.add_argument("--bad-mesh", action="store_true")
    p.add_argument("--partial-shard", action="store_true")
    p.add_argument("--save")
    p.add_argument("--resume")
    p.add_argument("--inject-step", type=int, default=-1)
    p.add_argument("--nonfinite", default="skip")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--ckpt-dir")
    p.add_argument("--last", action="store_true")
    p.add_argument("--topk-precision", action="store_true")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--torchft", type=int, default=None)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--selection-scope", default="bucket")
    p.add_argument("--min-sparse-numel", type=int, default=0)
    p.add_argument("--engage", action="store_true")
    p.add_argument("--onecycle", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.strategy in ("hsdp", "avg"):
        strategy = pl.strategies.ModelParallelStrategy()
    else:
        opts = dict(density=a.density, value_dtype=a.value_dtype, exchange=a.exchange, nonfinite=a.nonfinite,
                    min_sparse_numel=a.min_sparse_numel, local_steps=a.local_steps, selection_scope=a.selection_scope)
        if a.torchft is not None:
            opts.update(fault_tolerance="torchft", min_replicas=2, ft_timeout=30.0, ft_quorum_timeout=60.0,
                        ft_connect_timeout=5.0)
        if a.local_steps:
            opts.update(outer_value_bits=a.outer_value_bits, outer_density=a.outer_density, outer_chunk=64,
                        outer_recipe=a.outer_recipe)
        if a.strategy == "ddp":
            from lightning_topk.lightning.strategy import TopKDDPStrategy

            strategy = TopKDDPStrategy(**opts)
        else:
            strategy = TopKFSDPStrategy(**opts)
    callbacks, plugins = [], []
    if a.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=a.ckpt_dir, save_last=True, every_n_train_steps=1))
    if a.topk_precision:
        from lightning_topk import TopKPrecision

        plugins.append(TopKPrecision("16-mixed"))
    trainer = pl.Trainer(accelerator=a.accelerator, devices=a.devices, num_nodes=a.nodes, strategy=strategy,
                         max_steps=a.steps, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=bool(a.ckpt_dir), callbacks=callbacks, plugins=plugins,
                         precision=None if a.topk_precision else a.precision, accumulate_grad_batches=a.accumulate,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    model = LM(a)
    world = a.devices * (a.nodes if a.torchft is None else 2)
    node = int(os.environ.get("NODE_RANK", 0)) if a.torchft is None else a.torchft
    local = int(os.environ.get("LOCAL_RANK", 0))
    rank = node * a.devices + local
    loader = DataLoader(data(rank, world), batch_size=8, shuffle=False)
    trainer.fit(model, loader, ckpt_path="last" if a.last else a.resume)
    if a.save:
        trainer.save_checkpoint(a.save)
    full = {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()}
    st = getattr(trainer.strategy, "topk_state", None)
    info = {"step": trainer.global_step, "loss": float(trainer.callback_metrics.get("loss", float("nan"))),
            "recipe": getattr(trainer.strategy, "topk_recipe", None),
            "momentum": [g.get("momentum") for g in trainer.optimizers[0].param_groups],
            "momentum_buffers": sum("momentum_buffer" in s for s in trainer.optimizers[0].state.values()),
            "wd_momentum": sum("topk_wd_momentum" in s for s in trainer.optimizers[0].state.values()),
            "trace": model.trace}
    if a.strategy != "ddp":
        info["param_dtype"] = str(next(iter(model.net.blocks.layers[0]._get_fsdp_state()._fsdp_param_groups))
                                  .mp_policy.param_dtype)
    if st is not None:
        res = st.residuals()
        info.update(exchange_step=st.step, residual_sum=float(sum(t.double().sum() for t in res.values())),
                    residual_abs=float(sum(t.double().abs().sum() for t in res.values())),
                    residuals={k: v.clone() for k, v in res.items()},
                    velocities={k: v.clone() for k, v in st.velocities().items()},
                    engaged=bool(getattr(getattr(trainer.strategy, "topk_live_recipe", None), "engaged", False)),
                    skipped=(trainer.strategy.topk_controller if a.strategy == "ddp"
                             else trainer.strategy.topk.controller).skipped_steps)
    ft = getattr(trainer.strategy, "topk_elastic", None)
    if ft is not None:
        info.update(ft=ft.metrics(), quorum_sizes=list(ft.quorum_sizes))
    if a.strategy != "ddp":  # this rank's own shards: parameters and the optimizer's state (differ per replica
        from lightning_topk.comm.sharded import local_optimizer_state, local_tensor  # inside a local SGD round)

        info.update(local_params={n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
                    opt_state=local_optimizer_state(trainer.optimizers[0])["state"])
    top = getattr(trainer.strategy, "topk", None)
    if top is not None and top.outer is not None:
        from lightning_topk.comm.shard_checkpoint import outer_tensors

        outer = {}  # kind -> name -> full tensor of this rank's replica (a collective over the node's processes)
        for k, t in outer_tensors(top, top.outer.state_dict()).items():
            _, _, kind, _, name = k.split(".", 4)
            outer.setdefault(kind, {})[name] = t.full_tensor().clone()
        info.update(rounds=top.outer.stats.rounds, outer=outer)
    torch.save(info, f"{a.out}.rank{trainer.global_rank}")
    if trainer.global_rank == 0:
        torch.save(full, a.out)


if __name__ == "__main__":
    main()
