"""A local launcher for ``fault_tolerance="torchft"`` (``docs/elastic.md``): the torchft lighthouse, and optionally
replica groups that are restarted when they die.

    python -m lightning_topk.app.elastic_launch --bind 127.0.0.1:29510 --min_replicas 2
    python -m lightning_topk.app.elastic_launch --bind 127.0.0.1:29510 --min_replicas 2 --replicas 3 \\
        --max_restarts 5 -- python train.py

The lighthouse (torchft's ``torchft_lighthouse``, Rust) binds only to ``--bind``; the launcher waits until it
accepts connections (or fails, naming the address, within ``--start_timeout``) and prints
``TORCHFT_LIGHTHOUSE=http://HOST:PORT``. With a command after ``--``, it starts ``--replicas`` copies of it, each
with ``TORCHFT_LIGHTHOUSE``, ``TORCHFT_LIGHTHOUSE_MIN_REPLICAS`` and ``REPLICA_GROUP_ID=replica<i>`` in its
environment, restarts one that exits non-zero (up to ``--max_restarts`` times in all; a restarted group heals from a
live peer), and exits when every replica has exited with 0 (or with the first failure past the restarts).
``--replicas`` below ``--min_replicas`` is refused at once (no quorum could form). SIGTERM is passed on to the
replicas; once they have exited (``--term_timeout`` seconds, then they are killed) the lighthouse stops and the
launcher exits 0. Without a command it runs the lighthouse until interrupted; SIGTERM then stops it and exits 0
(``examples/slurm/elastic.sbatch`` stops its lighthouse step so).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from typing import Dict, List, Optional

from lightning_topk.lightning.elastic_lighthouse import MIN_REPLICAS_ENV  # the replicas' quorum errors name it


def lighthouse_binary() -> str:
    """``torchft_lighthouse`` from this environment's scripts folder (the venv's), else on ``PATH``; an error names
    the extra."""
    candidates = [os.path.join(d, "torchft_lighthouse") for d in (sysconfig.get_path("scripts"),
                                                                    os.path.dirname(sys.executable))]
    found = next((c for c in candidates if os.path.exists(c)), None) or shutil.which("torchft_lighthouse")
    if found is None:
        raise SystemExit("elastic_launch: torchft_lighthouse not found (it ships with torchft: "
                         "pip install 'lightning-topk[ft]')")
    return found


def split_bind(bind: str) -> tuple:
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"elastic_launch: --bind must be HOST:PORT, got {bind!r}")
    return host.strip("[]"), int(port)


def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"elastic_launch: the lighthouse exited with {proc.returncode} before listening on "
                             f"{host}:{port} (address in use?)")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"elastic_launch: the lighthouse did not listen on {host}:{port} within {timeout:g} s")


def check_free(host: str, port: int) -> None:
    """Fail, naming the address, when something listens there already: the wait below would take that listener (a
    lighthouse left from an earlier run) for the new lighthouse, which then fails to bind."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            pass
    except OSError:
        return
    raise SystemExit(f"elastic_launch: {host}:{port} is in use (an earlier lighthouse still running?); "
                     "choose another --bind")


def start_lighthouse(args: argparse.Namespace) -> subprocess.Popen:
    host, port = split_bind(args.bind)
    check_free(host, port)
    cmd = [lighthouse_binary(), "--bind", args.bind, "--min_replicas", str(args.min_replicas),
           "--join_timeout_ms", str(args.join_timeout_ms), "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
    proc = subprocess.Popen(cmd)
    wait_listening(host, port, proc, args.start_timeout)
    print(f"TORCHFT_LIGHTHOUSE=http://{args.bind}", flush=True)
    return proc


def stop_replicas(live: Dict[int, subprocess.Popen], timeout: float) -> None:
    """SIGTERM to every running replica, then wait up to ``timeout`` seconds in all; kill what is left."""
    for p in live.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_replicas(command: List[str], args: argparse.Namespace, lighthouse: str,
                 live: Dict[int, subprocess.Popen]) -> int:
    """Start ``--replicas`` copies of ``command`` (into ``live``, which the SIGTERM handler stops); restart failed
    ones up to ``--max_restarts`` in all."""
    def start(i: int) -> subprocess.Popen:
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=f"replica{i}",
                   **{MIN_REPLICAS_ENV: str(args.min_replicas)})
        return subprocess.Popen(command, env=env)

    live.update({i: start(i) for i in range(args.replicas)})
    restarts = 0
    while live:
        for i, p in list(live.items()):
            rc = p.poll()
            if rc is None:
                continue
            del live[i]
            if rc != 0 and restarts < args.max_restarts:
                restarts += 1
                print(f"elastic_launch: replica{i} exited with {rc}; restart {restarts}/{args.max_restarts}",
                      flush=True)
                live[i] = start(i)
            elif rc != 0:
                for q in live.values():
                    q.terminate()
                return rc
        time.sleep(0.2)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(prog="python -m lightning_topk.app.elastic_launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bind", default="127.0.0.1:29510", help="HOST:PORT the lighthouse binds to (only this)")
    ap.add_argument("--min_replicas", type=int, default=1, help="fewest replica groups in a quorum")
    ap.add_argument("--join_timeout_ms", type=int, default=2000,
                    help="how long a new quorum waits for heartbeating stragglers")
    ap.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                    help="a replica silent this long is dead (the survivors' outage is about this long)")
    ap.add_argument("--start_timeout", type=float, default=30.0, help="seconds for the lighthouse to listen")
    ap.add_argument("--replicas", type=int, default=1, help="copies of the command after --")
    ap.add_argument("--max_restarts", type=int, default=3, help="restarts of failed replicas, in all")
    ap.add_argument("--term_timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds the replicas have to exit before they are killed")
    args = ap.parse_args(argv)
    if args.min_replicas < 1:
        ap.error(f"--min_replicas must be at least 1, got {args.min_replicas}")
    if command and args.replicas < args.min_replicas:
        ap.error(f"--replicas {args.replicas} is fewer than --min_replicas {args.min_replicas}: no quorum could form "
                 f"(the replicas would wait for ft_quorum_timeout, then fail). Start --replicas {args.min_replicas} "
                 f"or more, or lower --min_replicas to {args.replicas}")
    lh = start_lighthouse(args)
    live: Dict[int, subprocess.Popen] = {}

    def stop(signum: int, _frame: object) -> None:
        # SIGTERM is how a run is stopped (a scheduler's cancel, the SLURM example's lighthouse step), not a
        # failure: the replicas get it too, and the lighthouse outlives them
        stop_replicas(live, args.term_timeout)
        lh.terminate()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        if command:
            return run_replicas(command, args, f"http://{args.bind}", live)
        return lh.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        if lh.poll() is None:
            lh.terminate()
            try:
                lh.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lh.kill()


if __name__ == "__main__":
    sys.exit(main())
