"""A clean end for processes that use the torch-only core directly (no Lightning teardown).

Why a process can abort at exit (a core dump of torch's own harness, issue 41): a gloo worker thread drops its
reference to a finished collective's work after the caller's ``wait()`` has returned. When that reference is the
last one to a tensor whose Python object the tensor now owns, the drop takes the GIL. If the main thread is
already finalizing the interpreter, the worker's ``take_gil`` ends the thread (``pthread_exit``), whose forced
unwind meets a ``noexcept`` frame: "terminate called without an active exception", SIGABRT
(``ProcessGroupGloo::runLoop`` → ``~AsyncWork`` → ``TensorImpl::decref_pyobject`` → ``take_gil``). It shows in a
plain ``torch.multiprocessing.spawn`` harness without this project as well.

:func:`destroy_gloo_at_exit` registers, once per process, an exit handler that runs while the interpreter is still
whole. It destroys a default gloo group that is still there, collects garbage (so a group nothing else holds is
freed and its destructor joins the worker threads), and then, while gloo worker threads remain (something still
holds the group), yields the GIL in short sleeps for up to :data:`DRAIN_S` so a worker with a pending drop can
take the GIL and finish. A group the user destroyed, or one on another backend (NCCL's destruction is collective),
is left alone; the drain runs either way.
"""
from __future__ import annotations

import atexit
import gc
import os
import time

import torch.distributed as dist

DRAIN_S = 0.25   # the most an exit waits for gloo workers that are still alive
_POLL_S = 0.002
_registered = False


def gloo_workers() -> int:
    """The gloo worker threads alive in this process (threads named ``pt_gloo*``; 0 where /proc is absent)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("pt_gloo")
        except OSError:  # the thread ended meanwhile
            pass
    return n


def release_gloo() -> None:
    """Destroy a default gloo group that is still there and drain its workers now (what the exit handler does):
    for a script that ends after a Lightning fit, which leaves the group alive."""
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # exiting anyway: nothing to report to
        pass
    gc.collect()
    end = time.monotonic() + DRAIN_S
    while gloo_workers() and time.monotonic() < end:
        time.sleep(_POLL_S)  # releases the GIL: a worker waiting for it finishes its drop now, not in finalization


def destroy_gloo_at_exit() -> None:
    """Register :func:`release_gloo` with :mod:`atexit` (once per process)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(release_gloo)
