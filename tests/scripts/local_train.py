"""Sparse local SGD (strategy topk_local) with a Trainer on sklearn digits, as simulated nodes (one process
per node: start with tests.helpers.procs.run_nodes). Every rank writes OUT/<tag>_rank<r>.pt: its final
flat weights, test accuracy, samples trained, and the outer round count.

  --strategy ddp | local      plain DDPStrategy, or TopKDDPStrategy(local_steps=H, ...)
  --epochs E                  max_epochs
  --save PATH                 trainer.save_checkpoint(PATH) at the end (a resume point)
  --resume PATH               ckpt_path=PATH
  --inject-step S             rank 0's loss is inf at global step S (with --nonfinite skip: skipped on every rank)
  --dense-steps N             the first N steps synchronous (post-local SGD)
  --fabric                    the same with Fabric(strategy=TopKDDPStrategy(...)) and a hand-written loop
  --no-train-end              (with --fabric) the loop does not call strategy.on_train_end(), only teardown()
  --bn                        a BatchNorm1d after the first layer (buffers: running statistics)
  --cnn                       issue 31's small CNN; --outer-lr/--outer-momentum none: from outer_recipe

Each rank also records the collectives it issued inside training batches whose group spans more than one
node (torch.distributed's functions wrapped), apart from those of the outer rounds, and how many steps its
step controller skipped, and, once training ended (after fit; with --fabric after teardown), whether any
collective of the exchange is still in flight, how many process groups are alive and which lightning_topk
threads are.
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


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor", "barrier",
               "all_to_all_single", "broadcast_object_list", "all_gather_object", "gather", "scatter", "reduce")
WATCH = {"in_batch": False, "in_round": False, "per_node": 1, "inner": [], "outer": 0, "model": None,
         "round_buffers": []}


def float_buffers(module) -> torch.Tensor:
    """The module's floating-point buffers as one fp32 vector, read from the module itself."""
    bufs = [b.detach().reshape(-1).float() for _, b in module.named_buffers() if b.is_floating_point()]
    return torch.cat(bufs) if bufs else torch.zeros(0)


def watch_collectives(per_node: int) -> None:
    """Count the collectives whose group spans nodes: inside a batch outside an outer round (``inner``: none
    expected under local SGD) and inside outer rounds (``outer``)."""
    import torch.distributed as dist

    from lightning_topk.comm.local import OuterState

    WATCH["per_node"] = per_node

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if WATCH["in_batch"]:
                group = kwargs.get("group")
                ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
                if len({r // WATCH["per_node"] for r in ranks}) > 1:
                    if WATCH["in_round"]:
                        WATCH["outer"] += 1
                    else:
                        WATCH["inner"].append(name)
            return fn(*args, **kwargs)
        return counted

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))
    round_ = OuterState.outer_round

    def outer_round(self):
        WATCH["in_round"] = True
        m = WATCH["model"]
        before = float_buffers(m).clone() if m is not None else None
        try:
            return round_(self)
        finally:
            WATCH["in_round"] = False
            if m is not None:  # the module's buffers just before and just after each outer round
                WATCH["round_buffers"].append((before, float_buffers(m).clone()))

    OuterState.outer_round = outer_round


class Net(pl.LightningModule):
    def __init__(self, opt: str, lr: float, inject_step=None, bn: bool = False, cnn: bool = False,
                 seed: int = 0) -> None:
        super().__init__()
        self.inject_step = inject_step
        torch.manual_seed(seed)
        norm = [nn.BatchNorm1d(128)] if bn else []
        self.net = nn.Sequential(nn.Linear(64, 128), *norm, nn.ReLU(), nn.Linear(128, 10))
        if cnn:  # issue 31's small CNN (benchmarks/outer_recipe.py's)
            self.net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                                     nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                     nn.Flatten(), nn.Linear(128, 10))
        self.opt, self.lr = opt, lr

    def setup(self, stage):
        torch.set_num_threads(1)

    def on_train_start(self):
        self.grad_views = getattr(self.trainer.strategy.model, "gradient_as_bucket_view", None)
        self.buffer_sync = getattr(self.trainer.strategy.model, "broadcast_buffers", None)  # per-forward buffer sync
        # the outer state as the first step finds it (a resumed run: as loaded)
        ex = getattr(getattr(self.trainer.strategy, "topk_state", None), "exchange", None)
        o = getattr(ex, "outer", None)
        if o is not None:
            self.start = {"theta_outer": o.theta.clone(), "momentum": o.mom.clone(), "ef": o.ef.clone(),
                          "position": o.position, "steps": o.steps, "rounds": o.stats.rounds, "lo": o.lo,
                          "shard": o.shard, "buffers": {k: b.clone() for k, b in self.named_buffers()},
                          "buffer_anchor": getattr(o, "buffer_anchor", None),
                          "flat": torch.cat([p.detach().reshape(-1) for p in self.parameters()])}

    def on_train_batch_start(self, batch, batch_idx):
        WATCH["in_batch"] = True

    def on_train_batch_end(self, outputs, batch, batch_idx):
        WATCH["in_batch"] = False

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.global_step == self.inject_step and self.global_rank == 0:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        if self.opt == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def after_training(state) -> dict:
    """What a finished run leaves behind: collectives in flight, live process groups, lightning_topk threads."""
    import threading

    import torch.distributed as dist

    return {"in_flight": state.in_flight if state is not None else None,
            "process_groups": len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0,
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_topk"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--strategy", default="local")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=120)
    ap.add_argument("--opt", default="adamw")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024)
    opt_float = (lambda v: None if v == "none" else float(v))
    ap.add_argument("--outer-lr", type=opt_float, default=1.0)
    ap.add_argument("--outer-momentum", type=opt_float, default=0.0)
    ap.add_argument("--cnn", action="store_true", help="issue 31's small CNN instead of the MLP")
    ap.add_argument("--ef-decay", type=float, default=1.0)
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--outer-exchange", default="auto")
    ap.add_argument("--dense-steps", type=int, default=0, help="synchronous first steps (post-local SGD)")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--devices", type=int, default=1, help="processes per node")
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes (run_nodes' num_nodes)")
    ap.add_argument("--inject-step", type=int)
    ap.add_argument("--nonfinite", default="raise")
    ap.add_argument("--fabric", action="store_true")
    ap.add_argument("--no-train-end", action="store_true")
    ap.add_argument("--bn", action="store_true")
    ap.add_argument("--save")
    ap.add_argument("--resume")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and shuffling")
    a = ap.parse_args()

    train, test = digits()
    watch_collectives(a.devices)
    if a.strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(process_group_backend="gloo")
    else:
        strategy = TopKDDPStrategy(local_steps=a.H, outer_density=a.density, outer_value_bits=a.bits,
                                   outer_chunk=a.chunk, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
                                   outer_ef_decay=a.ef_decay, outer_streaming=a.streaming, nonfinite=a.nonfinite,
                                   dense_steps=a.dense_steps, outer_exchange=a.outer_exchange,
                                   process_group_backend="gloo")
    if a.fabric:
        return fabric_main(a, train, test)
    pl.seed_everything(a.seed, workers=True)
    model = Net(a.opt, a.lr, a.inject_step, bn=a.bn, cnn=a.cnn, seed=a.seed)
    WATCH["model"] = model
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, num_nodes=a.nodes, strategy=strategy, max_epochs=a.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=a.accumulate, deterministic=True,
                         log_every_n_steps=1)
    trainer.fit(model, DataLoader(train, batch_size=a.batch, shuffle=True), ckpt_path=a.resume)
    if a.save:
        trainer.save_checkpoint(a.save)
    x, y = test.tensors
    model.eval()  # BatchNorm: the running statistics, left as training ended
    with torch.no_grad():
        acc = (model.net(x).argmax(1) == y).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    st = getattr(trainer.strategy, "topk_state", None)
    ex = st.exchange if st is not None else None
    outer = getattr(ex, "outer", None)
    ctl = getattr(trainer.strategy, "topk_controller", None)
    torch.save({"flat": flat, "acc": acc, "steps": trainer.global_step,
                "rounds": outer.stats.rounds if outer is not None else 0,
                "position": outer.position if outer is not None else -1,
                "outer_exchange": outer.exchange if outer is not None else None,
                "owner_ef": outer.owner_ef.clone() if outer is not None else None,
                "skips": ctl.skipped_steps if ctl is not None else -1, "start": getattr(model, "start", None),
                "grad_views": getattr(model, "grad_views", None), "bypass": getattr(ex, "bypass", None),
                "buffer_sync": getattr(model, "buffer_sync", None),
                "theta_outer": outer.theta.clone() if outer is not None else None,
                "momentum": outer.mom.clone() if outer is not None else None,
                "ef": outer.ef.clone() if outer is not None else None,
                "section": outer.state_dict() if outer is not None else None,  # after a streamed fit: before its end
                "inner_collectives": list(WATCH["inner"]), "outer_collectives": WATCH["outer"],
                "buffers": {k: b.clone() for k, b in model.named_buffers()},
                "round_buffers": list(WATCH["round_buffers"]),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("topk/")},
                "rule": None if outer is None else (outer.rule.lr, outer.rule.momentum, outer.rule.identity),
                "norm": float(flat.norm()),
                "after": after_training(st)},
               os.path.join(a.out, f"{a.tag}_rank{trainer.global_rank}.pt"))


def fabric_main(a, train, test) -> None:
    from lightning.fabric import Fabric

    from lightning_topk.lightning.fabric import fabric_strategy_class

    strategy = fabric_strategy_class("lightning.fabric")(
        local_steps=a.H, outer_density=a.density, outer_value_bits=a.bits, outer_chunk=a.chunk, outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum, outer_streaming=a.streaming, process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr)
    net, opt = fabric.setup(net, opt)
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(train, num_replicas=2, rank=fabric.global_rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=a.batch, sampler=sampler)
    steps = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            fabric.backward(nn.functional.cross_entropy(net(x), y))
            opt.step()
            steps += 1
    if not a.no_train_end:
        fabric.strategy.on_train_end()  # Fabric has no end-of-training hook: a streamed last round is applied here
    x, y = test.tensors
    with torch.no_grad():
        acc = (net(x).argmax(1) == y).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    state = fabric.strategy.topk_state
    outer = state.exchange.outer
    out = {"flat": flat, "acc": acc, "steps": steps, "rounds": outer.stats.rounds, "position": outer.position,
           "metrics": fabric.strategy.topk_metrics(), "in_flight_at_end": state.in_flight}
    # Known issue (docs/fabric.md): without teardown a Fabric script can abort at interpreter exit
    fabric.barrier()
    fabric.strategy.teardown()
    out.update(after=after_training(state), pending=outer.pending is not None)
    torch.save(out, os.path.join(a.out, f"{a.tag}_rank{fabric.global_rank}.pt"))


if __name__ == "__main__":
    main()
