"""A real SLURM on this host for the tests: munged, one slurmctld and two slurmd ("nodeA", "nodeB").

Everything lives in one temporary directory (config, munge key and socket, state, spool, logs, pid files)
and uses free ports, so it neither reads nor changes /etc/slurm, /etc/munge or /run/munge and can run
beside another SLURM on the same machine. :func:`start` returns a :class:`Cluster` or raises
:class:`Unavailable` with the reason (not root, slurm-wlm/munge not installed, a daemon did not come up);
:meth:`Cluster.stop` stops every daemon it started (by pid). ``.ci/slurm_setup`` installs the packages.

Run ``python -m tests.helpers.slurm_cluster`` to start one by hand and print how to use it (Ctrl-C stops it).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

NODES = ("nodeA", "nodeB")
CPUS_PER_NODE = 2
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")


class Unavailable(RuntimeError):
    """SLURM cannot be started here; the message says why."""


def _free_ports(n: int) -> List[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)


@dataclass
class Cluster:
    root: str
    conf: str
    procs: Dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> Dict[str, str]:
        """Environment for the SLURM client commands (and, exported by sbatch, for the jobs)."""
        return dict(os.environ, SLURM_CONF=self.conf)

    def cmd(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        p = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
        return p

    def log(self, name: str) -> str:
        path = os.path.join(self.root, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Cancel the jobs still in this cluster (their tasks end with them), then stop every daemon it started
        (SIGTERM, then SIGKILL after 10 s), slurmd first."""
        ctl = self.procs.get("slurmctld")
        if ctl is not None and ctl.poll() is None:
            try:
                self.cmd("scancel", "--full", f"--user={os.getuid()}", check=False, timeout=10)
                end = time.monotonic() + 30
                while time.monotonic() < end and self.cmd("squeue", "-h", "-t", "PD,R,CG,S", check=False,
                                                          timeout=10).stdout.strip():
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _write_conf(root: str, ports: List[int]) -> str:
    host = socket.gethostname()
    ctl_port, node_ports = ports[0], ports[1:]
    lines = [
        "ClusterName=ltopk",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctl_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job becomes eligible cred_expire + 1 s after the requeue (default 120)
        f"AuthInfo=socket={root}/munge/munge.sock,cred_expire=10",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        # look at pending jobs every 2 s (default 60): a requeued job starts as soon as it is eligible
        "SchedulerParameters=sched_interval=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "KillWait=5",
        "MinJobAge=600",
        "InactiveLimit=0",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for name, port in zip(NODES, node_ports):
        lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
                     "State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")
    return conf


def start(timeout: float = 60) -> Cluster:
    """Start munged, slurmctld and one slurmd per node in a fresh temporary directory; wait until both nodes
    are idle. Raises :class:`Unavailable` (after stopping what it started) when that is not possible."""
    if os.name != "posix" or os.geteuid() != 0:
        raise Unavailable("a real SLURM needs root (munged runs as user munge, slurmd as root)")
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge; "
                          "or run .ci/slurm_setup)")
    try:
        import pwd

        munge_user = pwd.getpwnam("munge")
    except KeyError:
        raise Unavailable("no 'munge' user (the munge package creates it)") from None
    root = tempfile.mkdtemp(prefix="ltopk-slurm-")
    os.chmod(root, 0o755)
    for d in ("state", "spool", "munge"):
        os.makedirs(os.path.join(root, d))
    mdir = os.path.join(root, "munge")
    os.chmod(mdir, 0o755)  # munged: the socket directory must be searchable by all
    cluster = Cluster(root=root, conf=_write_conf(root, _free_ports(1 + len(NODES))))
    try:
        key = os.path.join(mdir, "munge.key")
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)  # type: ignore[list-item]
        for dirpath, _, files in os.walk(mdir):
            os.chown(dirpath, munge_user.pw_uid, munge_user.pw_gid)
            for f in files:
                os.chown(os.path.join(dirpath, f), munge_user.pw_uid, munge_user.pw_gid)
        sock = os.path.join(mdir, "munge.sock")

        def as_munge() -> None:
            os.setgid(munge_user.pw_gid)
            os.setuid(munge_user.pw_uid)

        log = open(os.path.join(root, "munged.log"), "ab")
        cluster.procs["munged"] = subprocess.Popen(
            [_which("munged"), "-F", f"--socket={sock}", f"--key-file={key}",  # type: ignore[list-item]
             f"--pid-file={mdir}/munged.pid", f"--seed-file={mdir}/munged.seed", f"--log-file={mdir}/munged.log"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=as_munge, start_new_session=True)
        _wait(lambda: os.path.exists(sock), 10, "munged did not create its socket", cluster, "munged")
        devnull = subprocess.DEVNULL
        cluster.procs["slurmctld"] = subprocess.Popen(
            [_which("slurmctld"), "-D", "-i", "-f", cluster.conf], env=cluster.env,  # type: ignore[list-item]
            stdout=devnull, stderr=open(os.path.join(root, "slurmctld.err"), "ab"), start_new_session=True)
        for n in NODES:
            cluster.procs[f"slurmd-{n}"] = subprocess.Popen(
                [_which("slurmd"), "-D", "-N", n, "-f", cluster.conf], env=cluster.env,  # type: ignore[list-item]
                stdout=devnull, stderr=open(os.path.join(root, f"slurmd-{n}.err"), "ab"), start_new_session=True)

        def idle() -> bool:
            for name, p in cluster.procs.items():
                if p.poll() is not None:
                    raise Unavailable(f"{name} exited with {p.returncode}: "
                                      + (cluster.log(name) or cluster.log(name + ".err"))[-1500:])
            out = cluster.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10).stdout.split()
            return sorted(out[0::2]) == sorted(NODES) and all(s == "idle" for s in out[1::2])

        _wait(idle, timeout, "the SLURM nodes did not become idle", cluster, "slurmctld")
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _wait(cond, timeout: float, what: str, cluster: Cluster, logname: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise Unavailable(f"{what} within {timeout:.0f} s; {logname} log: {cluster.log(logname)[-1500:]}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: exit(0))
    c = start()
    print(f"export SLURM_CONF={c.conf}   # logs in {c.root}")
    try:
        signal.pause()
    finally:
        c.stop()
