"""Run a function in N real processes on gloo, collect return values.

The processes are forked from multiprocessing's fork server (the one the data module starts for its
workers: torch and lightning_topk imported once, Lightning's strategies registered), not spawned: a spawned
process imports torch and Lightning again (several seconds of CPU each, most of a small test's time on a
2-core machine). Each one gets this process's environment and ``sys.path`` at the call, as under spawn.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str, env: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # nobody tears down its groups while a peer's last callback still runs
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world: int = 2, args: tuple = ()) -> List[Any]:
    """``fn(rank, world, *args)`` in ``world`` spawned processes; returns the per-rank results."""
    from lightning_topk.data.datamodule import start_forkserver

    start_forkserver()  # (no-op when it runs)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, d, dict(os.environ)), nprocs=world,
                           join=True, start_method="forkserver")
        out = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
