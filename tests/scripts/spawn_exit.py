"""The torch-only core in a plain ``torch.multiprocessing.spawn`` harness (issue 41, defect 11): 2 processes on
gloo, an ``OuterState`` each, one outer round, then the processes end as a user's script would.

    python tests/scripts/spawn_exit.py PORT [--plain] [--destroy] [--report DIR] [--runs N]

``--plain``: the same harness without the project (an all-reduce of the weights instead of the round);
``--stress``: then 20 all-reduces of temporary tensors, with the world group held in a global to the end (a held
group is not freed by ``destroy_process_group``, so its gloo workers outlive the exit handler's destroy: the
case the handler's drain covers);
``--destroy``: ``dist.destroy_process_group()`` before returning. Spawned children end through the interpreter's
own finalization (not ``os._exit``), which is where an abort at exit shows. ``--report``: each rank writes
``DIR/RANK.txt`` from an exit handler registered first (so it runs last): whether the default group was still
there at the end. ``--runs N``: N spawns in a row from this one launcher (each a fresh pair of spawned processes
on a fresh port; the launcher only waits for them), so a stress loop does not pay for a launcher interpreter
importing torch per run; a run whose processes fail is reported on stderr and the launcher exits 1 at the end.
"""
import argparse
import atexit
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def _report(path: str) -> None:
    with open(path, "w") as f:
        f.write("alive" if dist.is_initialized() else "destroyed")


HELD = []


def worker(rank: int, world: int, port: int, plain: bool, destroy: bool, report: str, stress: bool = False) -> None:
    if report:
        atexit.register(_report, os.path.join(report, f"{rank}.txt"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    if plain:
        for p in m.parameters():
            dist.all_reduce(p.data)
    else:
        from lightning_topk.comm import TopKConfig
        from lightning_topk.comm.local import OuterState

        st = OuterState(TopKConfig(local_steps=1), list(m.named_parameters()))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * torch.randn(p.shape))
        assert st.step()  # the round ran
    if stress:
        HELD.append(dist.group.WORLD)
        for _ in range(20):
            dist.all_reduce(torch.ones(1000))  # the worker may drop the last reference after wait() returns
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--destroy", action="store_true")
    ap.add_argument("--report", default="")
    ap.add_argument("--stress", action="store_true")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    failed = []
    for i in range(a.runs):
        if i == 0:
            port = a.port
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        try:
            mp.spawn(worker, args=(2, port, a.plain, a.destroy, a.report, a.stress), nprocs=2)
        except Exception as e:  # a spawned process exited non-zero (an abort at exit: -6)
            if a.runs == 1:
                raise
            print(f"spawn_exit: run {i} failed: {e!r}", file=sys.stderr, flush=True)
            failed.append(i)
    if failed:
        print(f"spawn_exit: {len(failed)} of {a.runs} runs failed: {failed}", file=sys.stderr)
        sys.exit(1)
