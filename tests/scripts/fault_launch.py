"""Start each rank of a Lightning script as its own process (as SLURM/torchrun do), for fault tests.

Lightning sees ``LOCAL_RANK`` (or SLURM variables) and does not launch processes itself, so there is
no launcher process watching the others: what a surviving rank does on its own is observable.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, slurm_job=None, extra=None) -> dict:
    e = dict(os.environ)
    for k in [k for k in e if k.startswith("SLURM_")] + ["LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"]:
        e.pop(k, None)
    e.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    if slurm_job is None:
        e.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    else:
        e.update(SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(world), SLURM_NNODES="1",
                 SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                 SLURM_JOB_ID=str(slurm_job), SLURM_JOB_NAME="topk-test", SLURM_NODELIST="127.0.0.1")
    e.update(extra or {})
    return e


class Ranks:
    """``world`` processes of ``python script args``; logs in ``logdir/rank{r}.log``.

    ``zygote=True``: each rank is a child of the test zygote (tests/helpers/zygote.py: torch and Lightning
    imported once, several seconds of CPU saved per rank) where it can be one. Only for jobs that get no signal
    but the ones the zygote's client forwards (SIGTERM, SIGINT, SIGHUP, SIGUSR1/2, SIGQUIT) and SIGKILL through
    :meth:`kill_all`, which then also waits for the forked rank processes themselves to be gone (SIGSTOP, for
    one, would stop the client and not the rank: those tests keep fresh interpreters)."""

    def __init__(self, script, args, world, logdir, slurm_job=None, extra_env=None, zygote=False):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs = []
        self.zygote = zygote
        for r in range(world):
            log = open(self.logdir / f"rank{r}.log", "w")
            env = rank_env(r, world, port, slurm_job, extra_env)
            exe = sys.executable
            if zygote:
                from tests.helpers.procs import python_for

                exe, env = python_for(env)
            self.procs.append(subprocess.Popen([exe, str(script), *map(str, args)], env=env, cwd=ROOT,
                                               stdout=log, stderr=subprocess.STDOUT))

    def log(self, r) -> str:
        return (self.logdir / f"rank{r}.log").read_text(errors="replace")

    def signal(self, r, sig) -> None:
        os.kill(self.procs[r].pid, sig)

    def wait(self, r, timeout):
        return self.procs[r].wait(timeout=timeout)

    def wait_all(self, timeout):
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]

    def kill_all(self) -> None:
        forked = self._forked() if self.zygote else []
        for p in self.procs:
            if p.poll() is None:
                with _suppress():
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
        # A zygote's child ends itself once its client is gone; kill it outright and wait, as for a fresh process.
        deadline = time.monotonic() + 30
        for pid in forked:
            with _suppress():
                os.kill(pid, signal.SIGKILL)
            while _running(pid):
                assert time.monotonic() < deadline, f"rank process {pid} outlived SIGKILL"
                time.sleep(0.02)

    def _forked(self) -> list:
        """The pids of the zygote children running this job's ranks: children of a zygote whose standard output
        is one of this job's logs."""
        from tests.helpers import zygote

        servers = {p.pid for p in zygote._servers}
        logs = {os.path.realpath(self.logdir / f"rank{r}.log") for r in range(len(self.procs))}
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid in servers and os.path.realpath(f"/proc/{pid}/fd/1") in logs:
                    found.append(int(pid))
            except (OSError, ValueError, IndexError):
                continue
        return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def wait_for(pred, timeout, what, procs=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if procs is not None and any(p.poll() is not None for p in procs.procs):
            raise AssertionError(f"a rank exited while waiting for {what}:\n" + procs.log(0)[-3000:])
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def progress(out, rank) -> int:
    try:
        return int(Path(out, f"progress_rank{rank}.txt").read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def requeue_after(job, out, steps, scontrol_log, ranks=(0, 1), check=None) -> None:
    """SLURM's requeue of a running job: once every rank made ``steps`` steps (``check()`` then runs), SIGUSR1 to
    ``ranks``; wait for the handler's ``scontrol requeue``; then kill every rank, as SLURM ends the old
    allocation."""
    try:
        wait_for(lambda: min(progress(out, r) for r in range(len(job.procs))) >= steps, 120,
                 f"{steps} training steps", job)
        if check is not None:
            check()
        for r in ranks:
            job.signal(r, signal.SIGUSR1)
        wait_for(lambda: scontrol_log.exists(), 60, "scontrol requeue", job)
    finally:
        job.kill_all()


def run_to_end(job, timeout=240) -> None:
    """Every rank of ``job`` exits 0 within ``timeout`` seconds (rank 0's log tail otherwise); none is left."""
    try:
        codes = job.wait_all(timeout)
        assert codes == [0] * len(job.procs), job.log(0)[-3000:]
    finally:
        job.kill_all()
