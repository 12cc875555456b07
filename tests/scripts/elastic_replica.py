"""One replica group (one process) of a ``fault_tolerance="torchft"`` run on the digits; tests/lightning/test_elastic.py
starts several against one lighthouse, kills and restarts them.

Writes ``<out>/replica<R>.jsonl`` (one line per training batch: Lightning's step, torchft's committed step, the
quorum size, whether the step committed, heals) and, at the end, ``<out>/replica<R>.pt`` (parameters, metrics).
Stops once the replicas' committed step count reaches ``--steps``, or the step written in ``--stop-file``.

``--refuse-at K``: at committed step K this replica reports an error to its torchft Manager after the backward,
so ``should_commit`` says no; the line of that batch records whether parameters, optimizer state and residuals
are bitwise what they were before the batch.

``--fsdp``: ``topk_fsdp`` (the model sharded over the group's ``--devices`` processes, FSDP2); the parameters and
optimizer state in the final file are this rank's shards.

``--local-steps H``: sparse local SGD under torchft (torchft's step is then the committed outer rounds); the lines
and the final file also hold the outer state. ``--positioned-data``: a loader that follows the trainer's position
(epoch, batch index), as the project's WebLoader does, with a per-replica, per-epoch order; each line records the
(epoch, batch index) of the batch it trained on.
"""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_topk  # noqa: F401  (registers topk_ddp)
from lightning_topk import TopKDDPStrategy
from lightning_topk.lightning.fsdp import TopKFSDPStrategy
from tests.helpers.digits import accuracy, digits


def _rank_suffix():
    """'' with one process per replica group, '.rank<L>' with several (devices > 1)."""
    return f".rank{os.environ.get('LOCAL_RANK', '0')}" if os.environ.get("ELASTIC_DEVICES", "1") != "1" else ""


def _loc(t):
    """A sharded (--fsdp) tensor's local shard; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(module, strategy):
    opt = strategy.optimizers[0]
    state = strategy.topk_state
    return {
        "params": [_loc(p).detach().clone() for p in module.parameters()],
        "opt": [{k: _loc(v).clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()],
        "res": {} if state is None else {k: v.clone() for k, v in state.residuals().items()},
    }


def same(a, b):
    return (len(a["params"]) == len(b["params"]) and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            and len(a["opt"]) == len(b["opt"])
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a["opt"], b["opt"]))
            and a["res"].keys() == b["res"].keys() and all(torch.equal(a["res"][k], b["res"][k]) for k in a["res"]))


class Net(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        torch.manual_seed(100 + args.replica if args.init_differs else 0)  # init_sync makes them equal
        self.net = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 10))
        self.args = args
        self.log_path = Path(args.out) / f"replica{args.replica}{_rank_suffix()}.jsonl"
        self._before = None
        self._refused = False

    def setup(self, stage):
        torch.set_num_threads(1)

    def training_step(self, batch, _):
        x, y = batch[0], batch[1]
        self._pos = [int(v) for v in batch[2]] if len(batch) > 2 else None
        self._psum_fwd = float(sum(_loc(p).detach().double().abs().sum() for p in self.parameters()))
        opt = self.trainer.strategy.optimizers[0]
        self._osum_fwd = float(sum(_loc(v).double().abs().sum() for s in opt.state.values() for v in s.values()))
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_start(self):
        outer = self.trainer.strategy._elastic_outer()
        if outer is not None and (self.args.refuse_round or self.args.watch_round or self.args.die_in_round):
            self._wrap_gate(outer)

    def _wrap_gate(self, outer):
        """--refuse-round K: in the round that would commit round K, report an error to torchft after the quorum,
        so that this replica's should_commit says no; the next line records whether the outer state and the
        parameters are bitwise what they were before the round (θ_local := θ_outer)."""
        gate, ft = outer.gate, self.trainer.strategy.topk_elastic
        begin, commit = gate.begin, gate.commit

        watch = self.args.refuse_round or self.args.watch_round

        def refusing_begin():
            healed = begin()
            if self.args.die_in_round and ft.step == self.args.die_in_round - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # after the quorum, before the round's collectives
            if watch and ft.step == watch - 1 and not self._refused:
                self._refused = True
                self._before = {"theta": outer.theta.clone(), "mom": outer.mom.clone(), "ef": outer.ef.clone(),
                                "rounds": outer.stats.rounds}
            return healed

        def refusing_commit(ok):
            if self._before is not None and self.args.refuse_round:  # after the round's collectives: the
                ft.manager.report_error(RuntimeError("injected by the test"))  # peers' round goes through
            return commit(ok)

        gate.begin, gate.commit = refusing_begin, refusing_commit

    def on_train_batch_start(self, batch, batch_idx):
        if self.args.delay:
            time.sleep(self.args.delay)
        ft = self.trainer.strategy.topk_elastic
        if self.args.stall_at is not None and ft.step == self.args.stall_at and not getattr(self, "_stalled", False):
            self._stalled = True  # late for the quorums of the next seconds (alive: its heartbeats go on)
            time.sleep(self.args.stall_s)

    def on_after_backward(self):
        ft = self.trainer.strategy.topk_elastic
        if self.args.local_steps:
            return
        if self.args.slow_at is not None and ft.step == self.args.slow_at:
            time.sleep(self.args.slow_s)  # a long step (after its quorum)
        if self.args.refuse_at is not None and ft.step == self.args.refuse_at and not self._refused:
            self._refused = True
            ft.manager.report_error(RuntimeError("injected by the test"))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        s = self.trainer.strategy
        ft = s.topk_elastic
        ctl = s.topk.controller if self.args.fsdp else s.topk_controller
        row = {"global_step": self.trainer.global_step, "ft_step": ft.step, "quorum": ft.quorum_size,
               "uncommitted": ft.uncommitted, "committed": ft.committed, "heals": ft.heals,
               "heal_time_s": ft.heal_time_s, "quorum_changes": ft.quorum_changes, "t": time.time(),
               "skipped": ctl.skipped_steps if ctl is not None else 0,
               "psum_fwd": self._psum_fwd, "osum_fwd": self._osum_fwd,
               "psum": float(sum(_loc(p).detach().double().abs().sum() for p in self.parameters())),
               "gsum": float(sum(_loc(p.grad).detach().double().abs().sum() for p in self.parameters()
                                 if p.grad is not None))}
        row["data_pos"] = self._pos
        row["batch_idx"] = batch_idx
        row["epoch"] = self.trainer.current_epoch
        row["replicas_lost"] = ft.replicas_lost
        row["residual_mass_at_loss"] = ft.residual_mass_at_loss
        row["data_position"] = ft.data_position
        outer = s._elastic_outer()
        if outer is not None:
            row.update(rounds=outer.stats.rounds, round_uncommitted=outer.stats.uncommitted,
                       contributors=outer.stats.contributors, position=outer.position)
        if self.args.local_steps and self._before is not None:
            b, self._before = self._before, None
            params = torch.cat([_loc(p).detach().reshape(-1) for p in self.parameters()])
            row["round_unchanged"] = (torch.equal(b["theta"], outer.theta) and torch.equal(b["mom"], outer.mom)
                                      and torch.equal(b["ef"], outer.ef) and b["rounds"] == outer.stats.rounds
                                      and torch.equal(params, outer.theta[:params.numel()]))
        if self._before is not None:
            row["unchanged"] = same(self._before, snapshot(self, s))
            row["residuals_checked"] = len(self._before["res"])
            self._before = None
        if self.args.refuse_at is not None and ft.step == self.args.refuse_at and not self._refused:
            self._before = snapshot(self, s)  # before the next batch: the one that will be refused
        with open(self.log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        target = self.args.steps
        if self.args.stop_file and os.path.exists(self.args.stop_file):
            text = Path(self.args.stop_file).read_text().strip()
            target = int(text) if text else target
        if ft.step >= target:
            self.trainer.should_stop = True

    def on_train_end(self):
        ft = self.trainer.strategy.topk_elastic
        outer = self.trainer.strategy._elastic_outer()
        out = None if outer is None else {"theta": outer.theta.clone(), "mom": outer.mom.clone(),
                                          "ef": outer.ef.clone(), "rounds": outer.stats.rounds,
                                          "position": outer.position, "steps": outer.steps}
        opt = self.trainer.strategy.optimizers[0]
        torch.save({"params": {k: _loc(v).detach().clone() for k, v in self.net.state_dict().items()}, "outer": out,
                    "opt": {i: {k: _loc(v).clone() for k, v in st.items()}
                            for i, st in opt.state_dict()["state"].items()},
                    "metrics": ft.metrics(), "quorum_sizes": ft.quorum_sizes, "global_step": self.trainer.global_step,
                    "epoch": self.trainer.current_epoch, "ended_behind": getattr(getattr(ft, "farewell", None), "ended", None),
                    "accuracy": None if self.args.fsdp else accuracy(self)},
                   Path(self.args.out) / f"replica{self.args.replica}{_rank_suffix()}.pt")

    def configure_optimizers(self):
        if self.args.optimizer == "sgd":  # recipe="auto": momentum correction in the hook, weight decay beside it
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        train, _ = digits()
        if self.args.positioned_data:
            return PositionedLoader(train, self.args.replica, self._train_position)
        g = torch.Generator().manual_seed(1000 + self.args.replica + 7 * os.getpid())  # each replica its own order
        return DataLoader(train, batch_size=32, shuffle=True, generator=g)

    def _train_position(self):
        """The epoch and batch index the fit loop runs next (after a restore or a heal: where it resumes), as
        lightning_topk.data.WebDataModule tells its WebLoader."""
        t = self.trainer
        return t.current_epoch, t.fit_loop.epoch_loop.batch_progress.current.ready


class PositionedLoader(DataLoader):
    """Batches of 32 in an order fixed by (replica, epoch), starting at the trainer's position when iteration
    starts (WebLoader's ``position_fn``); each batch carries its (epoch, batch index)."""

    def __init__(self, data, replica, position_fn):
        super().__init__(data, batch_size=32)
        self.replica, self.position_fn = replica, position_fn

    def __iter__(self):
        epoch, start = self.position_fn()
        g = torch.Generator().manual_seed(1000 + 7919 * self.replica + epoch)
        order = torch.randperm(len(self.dataset), generator=g)
        n = len(self)
        for b in range(start, n):
            idx = order[b * 32:(b + 1) * 32]
            x, y = self.dataset.tensors
            yield x[idx], y[idx], torch.tensor([epoch, b])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--refuse-at", type=int, default=None)
    ap.add_argument("--init-differs", action="store_true")
    ap.add_argument("--stop-file", default=None, help="once it exists: the committed step to stop at")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--quorum-timeout", type=float, default=60.0)
    ap.add_argument("--devices", type=int, default=1, help="processes per replica group")
    ap.add_argument("--exchange", default="allgather")
    ap.add_argument("--local-steps", type=int, default=0, help="> 0: sparse local SGD, H inner steps per round")
    ap.add_argument("--outer-density", type=float, default=0.05)
    ap.add_argument("--outer-bits", type=int, default=8)
    ap.add_argument("--positioned-data", action="store_true")
    ap.add_argument("--refuse-round", type=int, default=None)
    ap.add_argument("--watch-round", type=int, default=None, help="record whether round K left the state unchanged")
    ap.add_argument("--die-in-round", type=int, default=None, help="SIGKILL itself after round K's quorum")
    ap.add_argument("--outer-recipe", default="diloco")
    ap.add_argument("--fsdp", action="store_true", help="topk_fsdp: the model sharded over the group's processes")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--width", type=int, default=256, help="the hidden layer's width")
    ap.add_argument("--max-epochs", type=int, default=10_000, help="Lightning's max_epochs (with a large --steps)")
    ap.add_argument("--stall-at", type=int, default=None, help="at this committed step, sleep --stall-s before the quorum")
    ap.add_argument("--stall-s", type=float, default=0.0)
    ap.add_argument("--slow-at", type=int, default=None, help="at this committed step, sleep --slow-s after the backward")
    ap.add_argument("--slow-s", type=float, default=0.0)
    args = ap.parse_args()
    os.environ["ELASTIC_DEVICES"] = str(args.devices)  # the launched local ranks inherit it
    (Path(args.out) / f"replica{args.replica}{_rank_suffix()}.pid").write_text(str(os.getpid()))
    local = {} if not args.local_steps else dict(local_steps=args.local_steps, outer_density=args.outer_density,
                                                 outer_value_bits=args.outer_bits, outer_recipe=args.outer_recipe)
    kind = TopKFSDPStrategy if args.fsdp else TopKDDPStrategy
    extra = dict(shard_modules=["Linear"]) if args.fsdp else {}
    strategy = kind(fault_tolerance="torchft", density=0.05, min_sparse_numel=4096,
                    **(local or dict(exchange=args.exchange)), **extra,
                    min_replicas=args.min_replicas, ft_timeout=min(20.0, args.quorum_timeout),
                    ft_quorum_timeout=args.quorum_timeout, ft_connect_timeout=5.0, log_telemetry=False)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.max_epochs, max_steps=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=not args.positioned_data)
    trainer.fit(Net(args))


if __name__ == "__main__":
    main()
