"""One replica group of a ``fault_tolerance="torchft"`` run through Lightning Fabric on the digits (the loop of
examples/fabric/train_elastic.py); tests/lightning/test_elastic.py starts several against one lighthouse.

The loop reads ``fabric.strategy.topk_elastic_position`` (torchft's committed step; under local SGD, ``--local-steps
H``, the inner-step attempts) at the top of each iteration and takes the batch fixed by (replica, position): a
replica that healed trains at its peers' position, and a step that was not committed replays its batch.

Writes ``<out>/replica<R>.jsonl`` (one line per step: the step it ran at, committed or not, quorum, heals) and at the
end ``<out>/replica<R>.pt`` (parameters, optimizer state, metrics). Stops at committed step ``--steps`` or the one
written in ``--stop-file``. ``--refuse-at K``: reports an error to torchft after the backward of step K, so
``should_commit`` says no; its line records whether parameters, optimizer state and residuals are bitwise unchanged.
``--reference``: Lightning Fabric's own ``"ddp"`` on 2 processes instead (no torchft), rank r taking replica r's
batches. ``--fsdp``: Fabric's ``topk_fsdp`` (the model sharded over the group's ``--devices`` processes, set up with
``fabric.setup_module`` then ``fabric.setup_optimizers``, where the first quorum runs); parameters and optimizer state
are this rank's shards; ``<out>/replica<R>.rank<k>.pid`` names each process.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

from lightning_topk.comm.sharded import local_module_state
from lightning_topk.lightning.fabric import fabric_strategy_class
from lightning_topk.lightning.fsdp_fabric import fabric_fsdp_class
from tests.helpers.digits import digits


def batch_at(x, y, replica, step, bs=32):
    """Replica ``replica``'s batch at committed step ``step``: its own order per epoch, the step's index in it."""
    epoch, b = divmod(step, -(-len(x) // bs))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + 7919 * replica + epoch))
    idx = order[b * bs:(b + 1) * bs]
    return x[idx], y[idx], [epoch, b]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # a sharded parameter: this rank's shard


def snapshot(model, opt, strategy):
    state = getattr(strategy, "topk_state", None)
    return {"params": local_module_state(model),
            "opt": [{k: _local(v).clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()],
            "res": {} if state is None else {k: v.clone() for k, v in state.residuals().items()}}


def same(a, b):
    return (all(torch.equal(v, b["params"][k]) for k, v in a["params"].items()) and len(a["opt"]) == len(b["opt"])
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a["opt"], b["opt"]))
            and a["res"].keys() == b["res"].keys() and all(torch.equal(a["res"][k], b["res"][k]) for k in a["res"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stop-file", default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--init-differs", action="store_true")
    ap.add_argument("--refuse-at", type=int, default=None)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--exchange", default="allgather")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--local-steps", type=int, default=0, help="> 0: sparse local SGD, H inner steps per round")
    ap.add_argument("--package", default="lightning.fabric", choices=["lightning.fabric", "lightning_fabric"])
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--fsdp", action="store_true", help="Fabric's topk_fsdp (each group's model sharded over --devices)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    Fabric = __import__(a.package, fromlist=["Fabric"]).Fabric
    if a.reference:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    else:
        local = dict(local_steps=a.local_steps, outer_density=0.05, outer_value_bits=8) if a.local_steps else {}
        strategy = (fabric_fsdp_class if a.fsdp else fabric_strategy_class)(a.package)(
            fault_tolerance="torchft", density=a.density, min_sparse_numel=4096, min_replicas=a.min_replicas,
            **(local or dict(exchange=a.exchange)),
            ft_timeout=20.0, ft_quorum_timeout=60.0, ft_connect_timeout=5.0)
        fabric = Fabric(accelerator="cpu", devices=a.devices, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank if a.reference else a.replica
    tag = f"replica{rank}" + (f".rank{fabric.local_rank}" if a.devices > 1 else "") + (".ref" if a.reference else "")
    (Path(a.out) / f"{tag}.pid").write_text(str(os.getpid()))
    torch.manual_seed(100 + a.replica if a.init_differs else 0)  # torchft's init_sync makes them equal
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    (Path(a.out) / f"{tag}.setup").write_text(str(time.time()))
    if a.fsdp:  # FSDP2 makes new (sharded) parameters: the optimizer comes after, and its setup runs the quorum
        model = fabric.setup_module(model)
        ptrs = [_local(p).data_ptr() for p in model.parameters()]
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    else:
        ptrs = [p.data_ptr() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = fabric.setup(model, opt)  # torchft: the first quorum (a heal, when behind) runs in here
    strategy = fabric.strategy
    ft = getattr(strategy, "topk_elastic", None)
    outer = strategy._elastic_outer() if ft is not None else None
    x, y = digits()[0].tensors
    who = rank if a.reference else rank * a.devices + fabric.local_rank  # each process its own batches
    log = Path(a.out) / f"{tag}.jsonl"
    n, before = 0, None
    while True:
        # the position every replica of a quorum is at: torchft's committed step (local SGD: inner steps)
        step = strategy.topk_elastic_position if ft is not None else n
        target = a.steps
        if a.stop_file and os.path.exists(a.stop_file):
            text = Path(a.stop_file).read_text().strip()
            target = int(text) if text else target
        if (ft.step if ft is not None else n) >= target:  # committed steps (local SGD: rounds)
            break
        if a.delay:
            time.sleep(a.delay)
        refuse = a.refuse_at is not None and step == a.refuse_at and before is None
        if refuse:
            before = snapshot(model, opt.optimizer, strategy)
        xb, yb, pos = batch_at(x, y, who, step)
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        fabric.backward(loss)
        if refuse:
            ft.manager.report_error(RuntimeError("injected by the test"))
        opt.step()  # torchft: commit (or roll back), then the next step's quorum
        n += 1
        row = {"step": step, "data_pos": pos, "t": time.time(),
               "ptrs_kept": [_local(p).data_ptr() for p in model.parameters()] == ptrs}
        if ft is not None:
            row.update(ft_step=ft.step, quorum=ft.quorum_size, committed=ft.committed, uncommitted=ft.uncommitted,
                       heals=ft.heals, heal_time_s=ft.heal_time_s)
        if outer is not None:
            row.update(rounds=outer.stats.rounds, position=outer.position, contributors=outer.stats.contributors)
        if refuse:
            row["unchanged"] = same(before, snapshot(model, opt.optimizer, strategy))
            row["residuals_checked"] = len(before["res"])
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")
    final = snapshot(model, opt.optimizer, strategy)
    final["metrics"] = ft.metrics() if ft is not None else {}
    final["ptrs_kept"] = [_local(p).data_ptr() for p in model.parameters()] == ptrs
    if outer is not None:
        final["outer"] = {"theta": outer.theta.clone(), "mom": outer.mom.clone(), "rounds": outer.stats.rounds,
                          "position": outer.position, "steps": outer.steps}
    torch.save(final, Path(a.out) / f"{tag}.pt")
    strategy.teardown()


if __name__ == "__main__":
    main()
