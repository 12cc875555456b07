"""Fault handling for ``topk_ddp``: checks before the process group starts, a heartbeat that names the
rank that was lost when a collective fails, and SLURM requeue at a step boundary.

* :func:`check_before_setup` rejects option combinations that would fail or lose data later
  (non-timedelta ``timeout``, bad ``bucket_cap_mb``, ``hierarchical=True`` with one process per node,
  ``value_dtype='fp16'`` with a bf16 model), before any process group or collective exists.
* :class:`Heartbeat`: every rank bumps a counter in the rendezvous store (a second client connection
  to the c10d store) every ``HEARTBEAT_S`` seconds. When a collective fails (gloo's "Connection closed
  by peer", a timeout), :func:`explain_exception` compares the counters over ``DIAGNOSE_S`` seconds:
  a rank whose counter stopped and that did not report a failure itself is *lost*; if the store does
  not answer, rank 0 (which hosts it) is. The exception message is prefixed with that diagnosis.
* :class:`RequeueSync`: Lightning runs its SLURM requeue handler (save ``hpc_ckpt_N.ckpt``, ``scontrol
  requeue``) inside the signal handler, i.e. at a different point of the step on each rank, and its
  ``barrier`` then meets another rank's gradient collective. This callback only records the signal
  and runs Lightning's handler on all ranks together after the next optimizer step (one 1-element
  all-reduce per step, only when SLURM auto-requeue is active), once per ``fit``: later signals (a rank
  that got it one step later, or SLURM delivering it twice) are ignored. ``topk_ddp`` adds it by itself.
* :class:`AgreedHpcPath`: Lightning's handler names the requeue checkpoint ``hpc_ckpt_<N+1>.ckpt`` on
  each rank by listing ``default_root_dir`` (``hpc_ckpt_<N>`` being the highest there), so a rank that
  lists after rank 0 wrote its file picks ``N+2`` and its residual shard lands under another name.
  When the process group starts, rank 0 picks ``N+1`` and broadcasts it; every rank's requeue save
  then uses that name (and ``N+2``, ... for later saves of the same run).
* SLURM signals every process of the job step, DataLoader workers included. Lightning's handler is
  installed before the training DataLoader forks its workers (``fit_loop.setup_data`` creates the
  iterator before ``on_train_start``), so a forked worker ran it: it saved a stale checkpoint (the
  worker's copy of the model, from before the first step) over the real one's name and called
  ``scontrol requeue`` a second time. Under SLURM auto-requeue a process forked from a training process
  ignores the requeue signal (:func:`ignore_requeue_signal_in_children`); workers started with
  forkserver get it ignored from the fork server (see ``lightning_topk.data.datamodule``).
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
DIAGNOSE_S = 2.0
STORE_TIMEOUT_S = 3.0
_PREFIX = "lightning_topk/"
# gloo says e.g. "Connection closed by peer", "Connection reset by peer", "Application timeout caused
# pair closure", "Timed out waiting ... for recv operation".
_COMM_PATTERNS = ("connection closed", "connection reset", "timed out", "timeout", "pair closure", "broken pipe",
                  "connection refused", "no route to host", "gloo", "nccl")


# ---- validation before the process group -------------------------------------------------------
def check_before_setup(strategy) -> None:
    """Raise ``ValueError`` naming the option for combinations that cannot work; runs before init."""
    t = getattr(strategy, "_timeout", None)
    if t is not None and (not isinstance(t, timedelta) or t.total_seconds() <= 0):
        raise ValueError(f"topk_ddp: timeout must be a datetime.timedelta > 0, got {t!r}")
    cap = getattr(strategy, "_ddp_kwargs", {}).get("bucket_cap_mb")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ValueError(f"topk_ddp: bucket_cap_mb must be a number > 0, got {cap!r}")
    strategy._use_hierarchical()  # raises for a hierarchical exchange with one process per node
    cfg = strategy.topk_config
    if cfg.value_dtype == "fp16" and _is_bf16_model(strategy):
        raise ValueError(
            "topk_ddp: value_dtype='fp16' with a bf16 model loses range: bf16 gradients reach 3e38 but fp16 "
            "overflows to inf above 65504 (and poisons the residuals). Use value_dtype='bf16' or 'fp32'"
        )


def _is_bf16_model(strategy) -> bool:
    plugin = getattr(strategy, "precision_plugin", None)
    if getattr(plugin, "precision", None) == "bf16-true":
        return True
    module = strategy.lightning_module
    return module is not None and any(p.dtype == torch.bfloat16 for p in module.parameters())


# ---- heartbeat and diagnosis -------------------------------------------------------------------
def _store_client():
    """A separate client connection to the job's c10d store (not shared with the main thread)."""
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store


# Threads of this module that call into the c10d store (C++, GIL released). One that is still inside such a call
# when the interpreter finalizes aborts the process as the call returns ("terminate called without an active
# exception": the thread may not retake the GIL, and unwinding it passes a noexcept C++ frame). A timed-out store
# call (_timed) or a heartbeat join that ran past its bound leaves such a thread behind: _exit_cleanly deals with it.
_STORE_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
EXIT_JOIN_S = STORE_TIMEOUT_S + 1.0


def _store_thread(target, name: str) -> threading.Thread:
    t = threading.Thread(target=target, name=name, daemon=True)
    _STORE_THREADS.add(t)
    t.start()
    return t


def _exit_cleanly() -> None:
    """At interpreter exit (atexit, before finalization): wait for this module's store threads (bounded); if one is
    still inside a store call after that (its host hung), end the process now with ``os._exit`` (stdio and logging
    flushed; exit code 1 if an uncaught exception ended the script, else 0) instead of letting finalization abort."""
    deadline = time.monotonic() + EXIT_JOIN_S
    for t in list(_STORE_THREADS):
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in list(_STORE_THREADS) if t.is_alive()]
    if not stuck:
        return
    log.warning("lightning_topk: %s still inside a store call at exit (store host hung?); exiting without "
                "interpreter finalization, which would abort the process", ", ".join(stuck))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)


atexit.register(_exit_cleanly)


def _timed(fn, timeout: float = STORE_TIMEOUT_S):
    """``fn()`` in a daemon thread: a store whose host is stopped blocks ``add``/``check`` forever."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = _store_thread(run, "lightning_topk-store")
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:.0f}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Heartbeat:
    """Background counter per rank in the rendezvous store; see the module docstring."""

    def __init__(self, rank: int, world: int, interval: float = HEARTBEAT_S) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        self._beat_store = _timed(_store_client)  # used only by the heartbeat thread
        self._store = _timed(_store_client)  # used only by diagnose(), through _timed
        self._stop = threading.Event()
        self._key = f"{_PREFIX}hb/{rank}"
        _timed(lambda: self._store.set(f"{_PREFIX}who/{rank}", f"{socket.gethostname()} pid {os.getpid()}"))
        self._beat_store.add(self._key, 1)
        self._thread = _store_thread(self._run, "lightning_topk-heartbeat")
        # A script that ends without the strategy's teardown (Fabric never calls it) must not exit with the
        # thread inside a C++ store call: that aborts the process ("terminate called without an active
        # exception"). atexit handlers run before the interpreter stops its threads.
        ref = weakref.ref(self)
        self._at_exit = lambda: (lambda hb: hb.stop() if hb is not None else None)(ref())
        atexit.register(self._at_exit)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat_store.add(self._key, 1)
            except Exception:  # store gone (rank 0 died or the job ended): nothing left to report to
                return

    def stop(self) -> None:
        """Stop and join the thread (bounded: one store call can take up to ``STORE_TIMEOUT_S``), so that no
        store call is in flight when the process group is destroyed or the interpreter exits (a thread still in
        one after the bound is waited for at exit: :func:`_exit_cleanly`)."""
        self._stop.set()
        atexit.unregister(self._at_exit)
        if self._thread is not threading.current_thread():
            self._thread.join(self.interval + STORE_TIMEOUT_S + 1.0)

    def _get(self, key: str) -> Optional[str]:
        v = _timed(lambda: self._store.get(key).decode() if self._store.check([key]) else None)
        return v

    def _set(self, key: str) -> None:
        _timed(lambda: self._store.set(key, "1"))

    def _counts(self, ranks) -> dict:
        return _timed(lambda: {r: int(self._store.add(f"{_PREFIX}hb/{r}", 0)) for r in ranks})

    def diagnose(self, wait: float = DIAGNOSE_S) -> str:
        """One sentence naming the lost rank(s), or saying that none stopped."""
        others = [r for r in range(self.world) if r != self.rank]
        try:
            self._set(f"{_PREFIX}failed/{self.rank}")
            before = self._counts(others)
            time.sleep(wait)
            after = self._counts(others)
            failed = {r for r in others if self._get(f"{_PREFIX}failed/{r}") is not None}
            lost = [r for r in others if after[r] == before[r] and r not in failed]
            who = {r: self._get(f"{_PREFIX}who/{r}") for r in lost}
            self._set(f"{_PREFIX}done/{self.rank}")
            if self.rank == 0:  # the store lives in this process: stay until the others have read it
                self._linger(set(lost), wait)
        except Exception as e:
            if self.rank == 0:
                return f"the rendezvous store does not answer ({type(e).__name__}: {e})"
            addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return (f"lost rank 0: the rendezvous store it hosts at {addr} does not answer "
                    f"({type(e).__name__}: {e}); rank 0 died, hangs or is unreachable")
        if lost:
            names = ", ".join(f"rank {r} ({who[r] or 'unknown host'})" for r in lost)
            return (f"lost {names}: heartbeat stopped (process killed, stopped or its host unreachable); "
                    f"seen from rank {self.rank}")
        alive = [r for r in others if r not in failed]
        if alive:
            return (f"no rank was lost, but rank(s) {alive} are alive and did not join the failed collective "
                    f"(stuck or out of step); seen from rank {self.rank}")
        return f"no rank was lost; all ranks report the same failure; seen from rank {self.rank}"

    def _linger(self, lost: set, wait: float) -> None:
        deadline = time.monotonic() + 2 * wait
        while time.monotonic() < deadline:
            if all(r in lost or self._get(f"{_PREFIX}done/{r}") is not None for r in range(1, self.world)):
                return
            time.sleep(0.1)


def is_comm_error(exc: BaseException) -> bool:
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, getattr(dist, "DistError", ())):
            return True
        if isinstance(e, RuntimeError) and any(p in str(e).lower() for p in _COMM_PATTERNS):
            return True
        e = e.__cause__ or e.__context__
    return False


def explain_exception(hb: Optional[Heartbeat], exc: BaseException) -> Optional[str]:
    """Prefix a failed collective's message with the lost-rank diagnosis (and log it)."""
    if hb is None or not is_comm_error(exc):
        return None
    hb.stop()
    note = "lightning_topk: " + hb.diagnose()
    log.error(note)
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{note}\n{exc.args[0]}",) + tuple(exc.args[1:])
    else:
        exc.args = (note,) + tuple(exc.args)
    return note


# ---- SLURM requeue at a step boundary ----------------------------------------------------------
class RequeueSync(pl.Callback):
    """Defers Lightning's SLURM requeue handler to the end of the next optimizer step, on all ranks."""

    def __init__(self) -> None:
        self._requested = False
        self._handled = False
        self._handler: Any = None
        self._signum: Optional[int] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._requested = self._handled = False
        env = _slurm_requeue_env(trainer.strategy)
        if env is None:
            return
        signum = env.requeue_signal
        handler = signal.getsignal(signum)
        if callable(handler) and handler != self._on_signal:
            self._handler, self._signum = handler, signum
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._requested = True
        log.info("lightning_topk: requeue signal %s received; checkpointing after the current step", signum)

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any) -> None:
        if self._handler is None or _mid_accumulation(trainer) or _inside_outer_round(trainer):
            return
        if trainer.strategy.reduce_boolean_decision(self._requested, all=False):
            self._requested = False
            if self._handled:
                # A rank whose signal came after the others' (they arrive at different times, and SLURM may
                # deliver it twice: to the step's tasks and through srun), or a second signal: the requeue
                # checkpoint is written and the job requeued already; a second save could be cut off by the
                # requeue's SIGTERM/SIGKILL halfway.
                log.info("lightning_topk: requeue signal again after the requeue checkpoint of this run; ignored")
                return
            self._handled = True
            # SLURM may deliver the signal again while Lightning's handler runs `scontrol requeue`, whose process
            # would die of it ("Requeuing SLURM job 1 failed with error code -10", seen under load). An ignored
            # signal stays ignored across exec; this process has nothing left to do with it.
            signal.signal(self._signum, signal.SIG_IGN)
            self._handler(self._signum, None)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._handler is not None and signal.getsignal(self._signum) in (self._on_signal, signal.SIG_IGN):
            signal.signal(self._signum, self._handler)
        self._handler = None


def _inside_outer_round(trainer: "pl.Trainer") -> bool:
    """Sparse local SGD between outer rounds: the requeue decision (a collective across all nodes) waits for
    the next round end, so inner steps stay free of inter-node collectives. Every rank counts the same
    step attempts, so all of them decide at the same step; the requeue checkpoint then holds agreeing
    replicas. The cost is a delay of up to ``local_steps`` steps after the signal (keep SLURM's
    ``--signal=...@SECONDS`` above that)."""
    ex = getattr(getattr(trainer.strategy, "topk_state", None), "exchange", None)
    outer = getattr(ex, "outer", None) if getattr(ex, "local_sgd", False) else None
    if outer is None:  # topk_fsdp's local SGD (lightning_topk.comm.sharded.ShardedTopK)
        outer = getattr(getattr(trainer.strategy, "topk", None), "outer", None)
    return outer is not None and outer.position != 0


def _slurm_requeue_env(strategy):
    # By class name: lightning_fabric and lightning.fabric each define their own SLURMEnvironment.
    env = getattr(strategy, "cluster_environment", None)
    is_slurm = any(c.__name__ == "SLURMEnvironment" for c in type(env).__mro__)
    if is_slurm and getattr(env, "auto_requeue", False) and getattr(env, "requeue_signal", None) is not None:
        return env
    return None


class AgreedHpcPath:
    """Stands in for ``trainer._checkpoint_connector.hpc_save_path`` (which Lightning's SLURM handler calls
    on every rank): the k-th requeue save of this run is ``hpc_ckpt_<first + k - 1>.ckpt`` on every rank."""

    def __init__(self, first: int) -> None:
        self.next = int(first)

    def __call__(self, folderpath: Any) -> str:
        number, self.next = self.next, self.next + 1
        return os.path.join(folderpath, f"hpc_ckpt_{number}.ckpt")  # as Lightning's own hpc_save_path


_HPC_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt$")


def agree_hpc_path(strategy, trainer) -> Optional[int]:
    """Rank 0 chooses the number of the next requeue checkpoint (Lightning's rule: one more than the highest
    ``hpc_ckpt_<N>`` in ``default_root_dir``) and broadcasts it; every rank then saves under that name.
    Collective: called on every rank right after the process group starts. Returns the number."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    lightning_rule = getattr(type(connector), "hpc_save_path", None)
    number = None
    if strategy.global_rank == 0 and callable(lightning_rule):
        m = _HPC_NAME.search(os.fspath(lightning_rule(trainer.default_root_dir)))
        number = int(m.group(1)) if m else None
    number = strategy.broadcast(number, src=0)
    if number is None:  # Lightning names it differently now: leave its rule alone
        log.warning("lightning_topk: could not read Lightning's hpc checkpoint name; each rank names its requeue "
                    "checkpoint itself")
        return None
    connector.hpc_save_path = AgreedHpcPath(number)
    return number


_IGNORED_IN_CHILDREN: set = set()


def _ignore_in_child() -> None:
    for signum in _IGNORED_IN_CHILDREN:
        try:
            if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                signal.signal(signum, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread of the child: nothing to do
            pass


def ignore_requeue_signal_in_children(signum: int) -> None:
    """Processes forked from this one from now on (DataLoader workers) ignore ``signum``: SLURM sends the
    requeue signal to every process of the step, and only the training process may act on it."""
    if not _IGNORED_IN_CHILDREN and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_ignore_in_child)
    _IGNORED_IN_CHILDREN.add(int(signum))


def requeue_signals() -> tuple:
    """The signals that children of this process must ignore (see :func:`ignore_requeue_signal_in_children`)."""
    return tuple(sorted(_IGNORED_IN_CHILDREN))


def _mid_accumulation(trainer) -> bool:
    loop = trainer.fit_loop.epoch_loop
    try:
        return bool(loop._should_accumulate())
    except Exception:  # private Lightning API changed: assume a step happened
        return False


# ---- strategy glue -----------------------------------------------------------------------------
def start(strategy) -> Optional[Heartbeat]:
    """After the process group exists: add :class:`RequeueSync` under SLURM, and start and return the
    heartbeat (None on one process or without a TCP store)."""
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    env = _slurm_requeue_env(strategy)
    if trainer is not None and env is not None:
        if not any(isinstance(cb, RequeueSync) for cb in trainer.callbacks):
            trainer.callbacks.append(RequeueSync())
        agree_hpc_path(strategy, trainer)
        ignore_requeue_signal_in_children(env.requeue_signal)
    if not (dist.is_available() and dist.is_initialized() and strategy.world_size > 1):
        return None
    try:
        return Heartbeat(strategy.global_rank, strategy.world_size)
    except Exception as e:  # no TCP store (file:// init) or no clone(): diagnosis unavailable
        log.warning("lightning_topk: heartbeat unavailable (%s); failed collectives will not name the lost rank", e)
        return None


def stop(hb: Optional[Heartbeat]) -> None:
    if hb is not None:
        hb.stop()


__all__ = ["Heartbeat", "RequeueSync", "check_before_setup", "explain_exception", "is_comm_error", "start", "stop"]
