"""Simulated bandwidth-limited cluster: N network namespaces ("nodes") x M training processes each.

    python benchmarks/cluster.py --nodes 2 --procs-per-node 2 --rate 100mbit --steps 30 -- --strategy ddp
    python benchmarks/cluster.py --cleanup          # remove namespaces left by killed runs

Topology (all names carry a per-run prefix such as ``ltk3fa9c``, so concurrent runs never collide)::

    hub namespace <p>hub:   bridge <p>br ── <p>h0 ── ... ── <p>h{N-1}      (nothing touches the host's network)
    node namespace <p>n<i>: lo + <p>e<i> (10.77.0.<i+1>/24), the peer of <p>h<i>

Each node's link is limited by a ``tbf`` qdisc on both ends of its veth pair (egress of <p>e<i> is the
node's uplink, egress of <p>h<i> its downlink). Added latency needs ``netem``; when the kernel lacks it
``--latency-ms`` > 0 fails with that reason. Every worker runs as
``ip netns exec <p>n<i> python benchmarks/cluster_worker.py ...`` with MASTER_ADDR (node 0's address),
MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE and GLOO_SOCKET_IFNAME=<p>e<i>: gloo traffic between nodes
crosses the rate-limited veth, traffic between processes of one node uses that namespace's loopback.

Without root or without working namespaces, the harness says why and runs every process on 127.0.0.1
with no rate limit. Everything it created is removed on success, failure, timeout and Ctrl-C/SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cluster_worker.py")
NAME_PREFIX = "ltk"          # every run's prefix starts with this; --cleanup removes all of them
SUBNET = "10.77.0"           # private to each run's namespaces, so runs may reuse it
MASTER_PORT = 29400
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class ClusterError(RuntimeError):
    """Setup or run failure of the simulated cluster."""


def parse_rate(rate: Optional[str]) -> Optional[float]:
    """tc rate string ("100mbit", "1gbit") -> bits/s; None/"none"/"" -> None (unlimited)."""
    if rate is None or rate.lower() in ("", "none", "unlimited"):
        return None
    m = _RATE_RE.match(rate.lower())
    if not m:
        raise ValueError(f"--rate: {rate!r} is not a rate; use <number><bit|kbit|mbit|gbit> (e.g. 100mbit, 1gbit) or none")
    bits = float(m.group(1)) * _RATE_UNIT[m.group(2)]
    if bits <= 0:
        raise ValueError(f"--rate must be positive, got {rate!r}")
    return bits


def _run(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def namespaces_available() -> Tuple[bool, str]:
    """Whether this process can create network namespaces; the reason when it cannot."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is %d)" % os.geteuid()
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (`ip`, `tc`) is not installed"
    probe = f"{NAME_PREFIX}probe{os.getpid() % 100000}"
    p = _run(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return False, f"`ip netns add` failed: {p.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def list_namespaces(prefix: str = NAME_PREFIX) -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0].startswith(prefix)]


def list_links(prefix: str = NAME_PREFIX) -> List[str]:
    """Links with the prefix in the root namespace (there should never be any)."""
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]
    return [n for n in names if n.startswith(prefix)]


def cleanup(prefix: str = NAME_PREFIX) -> List[str]:
    """Delete every namespace and root-namespace link whose name starts with prefix; returns what was removed.

    Deleting a namespace kills nothing by itself, so processes still inside one are killed first.
    """
    removed = []
    for ns in list_namespaces(prefix):
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    for link in list_links(prefix):
        if _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    return removed


def _tbf(rate_bits: float) -> List[str]:
    # burst must cover one timer tick at the rate (or tbf cannot reach it); latency bounds the queue.
    burst = max(int(rate_bits / 8 / 250), 32 * 1024)
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms"]


@dataclass
class NetnsCluster:
    """N namespaces on a bridge in a hub namespace; a context manager that always tears down."""

    nodes: int
    rate_bits: Optional[float] = None
    latency_ms: float = 0.0
    prefix: str = field(default_factory=lambda: f"{NAME_PREFIX}{secrets.token_hex(3)}")
    created: List[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"{self.prefix}hub"

    def ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def ifname(self, i: int) -> str:
        return f"{self.prefix}e{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> List[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def _shape(self, ns: str, dev: str) -> None:
        if self.latency_ms > 0:
            p = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                      "netem", "delay", f"{self.latency_ms}ms"], check=False)
            if p.returncode != 0:
                raise ClusterError(f"--latency-ms needs the netem qdisc, which this kernel lacks ({p.stderr.strip()}); "
                                   "use --latency-ms 0")
            if self.rate_bits:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:",
                      *_tbf(self.rate_bits)])
        elif self.rate_bits:
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *_tbf(self.rate_bits)])

    def setup(self) -> None:
        if len(self.prefix) > 9:
            raise ValueError(f"prefix {self.prefix!r} too long: interface names are limited to 15 characters")
        _run(["ip", "netns", "add", self.hub])
        self.created.append(self.hub)
        hx = ["ip", "netns", "exec", self.hub]
        br = f"{self.prefix}br"
        _run(hx + ["ip", "link", "add", br, "type", "bridge"])
        _run(hx + ["ip", "link", "set", br, "up"])
        _run(hx + ["ip", "link", "set", "lo", "up"])
        for i in range(self.nodes):
            ns, host_end, node_end = self.ns(i), f"{self.prefix}h{i}", self.ifname(i)
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            # Created inside the hub with the peer moved straight into the node: never visible on the host.
            _run(hx + ["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end, "netns", ns])
            _run(hx + ["ip", "link", "set", host_end, "master", br])
            _run(hx + ["ip", "link", "set", host_end, "up"])
            nx = self.exec_prefix(i)
            _run(nx + ["ip", "link", "set", "lo", "up"])
            _run(nx + ["ip", "addr", "add", f"{self.addr(i)}/24", "dev", node_end])
            _run(nx + ["ip", "link", "set", node_end, "up"])
            self._shape(ns, node_end)            # uplink
            self._shape(self.hub, host_end)      # downlink

    def teardown(self) -> None:
        cleanup(self.prefix)
        self.created.clear()

    def __enter__(self) -> "NetnsCluster":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


class _Interrupted(BaseException):
    pass


def _raise_interrupt(signum, _frame):
    raise _Interrupted(signal.Signals(signum).name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class RunResult:
    mode: str                       # "netns" or "loopback"
    reason: str                     # why loopback, if it is
    ranks: List[dict]
    run_dir: str
    wall_time: float
    prefix: str = ""


def run_cluster(worker_args: List[str], nodes: int = 2, procs_per_node: int = 2, rate: Optional[str] = "100mbit",
                latency_ms: float = 0.0, timeout: float = 600.0, run_dir: Optional[str] = None,
                force_loopback: bool = False, quiet: bool = False, stall_timeout: float = 180.0) -> RunResult:
    """Start nodes x procs_per_node workers (in namespaces when possible), wait, collect their JSON results.

    Raises ClusterError when a worker fails, no rank finishes a step for stall_timeout seconds (a hung
    collective), or the run exceeds timeout; namespaces are removed in every case.
    """
    if nodes < 1 or procs_per_node < 1:
        raise ValueError(f"--nodes and --procs-per-node must be >= 1, got {nodes} and {procs_per_node}")
    if latency_ms < 0:
        raise ValueError(f"--latency-ms must be >= 0, got {latency_ms}")
    rate_bits = parse_rate(rate)
    ok, reason = (False, "loopback requested") if force_loopback else namespaces_available()
    if not ok and not quiet:
        print(f"[cluster] no network namespaces: {reason}; falling back to loopback (127.0.0.1, no rate limit)",
              file=sys.stderr)
    run_dir = run_dir or tempfile.mkdtemp(prefix="ltk_cluster_")
    os.makedirs(run_dir, exist_ok=True)
    for f in os.listdir(run_dir):
        if f.startswith("rank") and f.endswith((".json", ".progress")):
            os.remove(os.path.join(run_dir, f))
    world = nodes * procs_per_node
    procs: List[subprocess.Popen] = []
    logs = []
    cluster = NetnsCluster(nodes, rate_bits, latency_ms) if ok else None
    old_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    t0 = time.perf_counter()
    try:
        for s in old_handlers:
            signal.signal(s, _raise_interrupt)
        if cluster is not None:
            cluster.__enter__()
            master, port = cluster.addr(0), MASTER_PORT
        else:
            master, port = "127.0.0.1", _free_port()
        for node in range(nodes):
            for local in range(procs_per_node):
                rank = node * procs_per_node + local
                env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(port), NODE_RANK=str(node),
                           LOCAL_RANK=str(local), WORLD_SIZE=str(world), CLUSTER_NUM_NODES=str(nodes),
                           CLUSTER_PROCS_PER_NODE=str(procs_per_node), CLUSTER_RESULT_DIR=run_dir,
                           OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
                env["CLUSTER_NODE_ADDR"] = cluster.addr(node) if cluster is not None else "127.0.0.1"
                if cluster is not None:
                    env["GLOO_SOCKET_IFNAME"] = cluster.ifname(node)
                else:
                    env.pop("GLOO_SOCKET_IFNAME", None)
                cmd = (cluster.exec_prefix(node) if cluster else []) + [sys.executable, WORKER, *worker_args]
                log = open(os.path.join(run_dir, f"rank{rank}.log"), "w")
                logs.append(log)
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True, cwd=os.path.dirname(HERE)))
        deadline = time.monotonic() + timeout
        last_progress, progress_seen = time.time(), {}
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                tail = _tail(run_dir, i, 40)
                errs = _error_lines(tail)
                raise ClusterError(f"rank {i} exited with code {codes[i]}: {errs[-1] if errs else '(no error line)'}"
                                   f"\nlog tail:\n{tail}")
            if all(c == 0 for c in codes):
                break
            for r in range(world):
                try:
                    m = os.stat(os.path.join(run_dir, f"rank{r}.progress")).st_mtime
                except OSError:
                    continue
                if m != progress_seen.get(r):
                    progress_seen[r], last_progress = m, time.time()
            if stall_timeout and time.time() - last_progress > stall_timeout:
                errs = [f"rank {r}: {e}" for r in range(world) for e in _error_lines(_tail(run_dir, r, 60))[-1:]]
                raise ClusterError(f"stalled: no rank finished a step for {stall_timeout:.0f} s (hung collective?); "
                                   + ("; ".join(errs) if errs else "no error in any rank's log")
                                   + f"\nrank 0 log tail:\n{_tail(run_dir, 0)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f} s; rank 0 log tail:\n{_tail(run_dir, 0)}")
            time.sleep(0.2)
    except _Interrupted as e:
        raise KeyboardInterrupt(f"cluster run interrupted by {e}") from None
    finally:
        for p in procs:
            _kill_group(p)
        for log in logs:
            log.close()
        if cluster is not None:
            cluster.teardown()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    ranks = []
    for r in range(world):
        path = os.path.join(run_dir, f"rank{r}.json")
        if not os.path.exists(path):
            raise ClusterError(f"rank {r} exited cleanly but wrote no result {path}")
        with open(path) as f:
            ranks.append(json.load(f))
    return RunResult("netns" if cluster else "loopback", "" if cluster else reason, ranks, run_dir,
                     time.perf_counter() - t0, cluster.prefix if cluster else "")


def _tail(run_dir: str, rank: int, n: int = 15) -> str:
    try:
        with open(os.path.join(run_dir, f"rank{rank}.log")) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _error_lines(text: str) -> List[str]:
    return [ln.strip() for ln in text.splitlines() if re.search(r"Error:|error:|what\(\)", ln)]


def summarize(res: RunResult) -> Dict[str, object]:
    """Throughput, step time, inter-node bytes per step and time to target from the per-rank results."""
    ranks = res.ranks
    r0 = ranks[0]
    warm = r0["warmup_steps"]
    n_steps = min(len(r["step_end"]) for r in ranks)
    if n_steps <= warm:
        raise ClusterError(f"only {n_steps} steps ran; need more than --warmup-steps={warm}")
    batch = r0["batch_size"]
    def span(r: dict, n: int) -> float:  # time of steps warm..n-1
        return r["step_end"][n - 1] - (r["step_end"][warm - 1] if warm else 0.0)

    if r0["strategy"] == "local":  # independent processes: throughputs add up
        sps = sum(batch * (len(r["step_end"]) - warm) / span(r, len(r["step_end"])) for r in ranks)
    else:  # one synchronous job: the slowest rank sets the pace
        sps = len(ranks) * batch * (n_steps - warm) / max(span(r, n_steps) for r in ranks)
    step_time = len(ranks) * batch / sps
    # Ground truth from the interface counters of each node (local rank 0 reads them every step).
    inter = per_node = None
    counters = [r["if_bytes"] for r in ranks if r["local_rank"] == 0]
    if counters and all(c and all(x is not None for x in c) for c in counters):
        tx = [c[-1][0] - c[warm][0] for c in counters]
        steps_counted = [len(c) - 1 - warm for c in counters]
        per_node = [t / s for t, s in zip(tx, steps_counted)]
        inter = sum(per_node)
    # the strategy's own wire figure per rank and step (topk_ddp), same steps as the counters
    wire = [sum(t.get("bytes_wire", 0) for t in r.get("telemetry_steps", [])[warm:])
            / max(1, len(r.get("telemetry_steps", [])) - warm) for r in ranks] if r0.get("telemetry_steps") else None
    # per-step phases (worker's Clock), ms, mean over the counted steps, then over ranks
    phases: Optional[Dict[str, float]] = None
    if all(r.get("phases") and len(r["phases"]) > warm for r in ranks):
        names = list(ranks[0]["phases"][0])
        phases = {k: 1e3 * sum(sum(p[k] for p in r["phases"][warm:]) / len(r["phases"][warm:]) for r in ranks)
                  / len(ranks) for k in names}
    sel = [t.get("select_time_s", 0.0) for r in ranks for t in r.get("telemetry_steps", [])[warm:]]
    com = [t.get("comm_time_s", 0.0) for r in ranks for t in r.get("telemetry_steps", [])[warm:]]
    if phases is not None and sel:
        phases["select_in_hooks"] = 1e3 * sum(sel) / len(sel)
        phases["comm_in_hooks"] = 1e3 * sum(com) / len(com)
    target_loss = r0.get("target_loss")  # --model lm: the validation loss instead of the accuracy
    reached = [e for e in r0["evals"]
               if (e["loss"] <= target_loss if target_loss is not None else e["acc"] >= r0["target_acc"])]
    tta = reached[0]["time"] if reached else None
    tta_step = reached[0]["step"] if reached else None
    return {
        "strategy": r0["strategy"], "density": r0["density"], "hierarchical": r0["hierarchical"],
        "exchange": r0.get("exchange"), "plan": r0.get("plan"), "inter_node_bytes_per_node": per_node,
        "wire_bytes_per_rank": wire, "cost_model": r0.get("cost_model"),
        "mode": res.mode, "world_size": len(ranks), "n_params": r0["n_params"], "steps": n_steps,
        "samples_per_s": sps, "step_time_s": step_time, "inter_node_bytes_per_step": inter,
        "final_acc": r0["evals"][-1]["acc"] if r0["evals"] else None, "target_acc": r0["target_acc"],
        "final_loss": r0["evals"][-1].get("loss") if r0["evals"] else None, "target_loss": target_loss,
        "time_to_target_s": tta, "steps_to_target": tta_step, "telemetry": r0.get("telemetry"),
        "wall_time_s": res.wall_time, "phases_ms": phases, "bucket_cap_mb": r0.get("bucket_cap_mb"),
    }


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, worker_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] -- [cluster_worker.py options]")
    p.add_argument("--nodes", type=int, default=2, help="number of simulated nodes (namespaces)")
    p.add_argument("--procs-per-node", type=int, default=2, help="training processes per node")
    p.add_argument("--rate", default="100mbit", help="per-node link rate in tc syntax (100mbit, 1gbit) or none")
    p.add_argument("--latency-ms", type=float, default=0.0, help="added one-way latency per link (needs netem)")
    p.add_argument("--steps", type=int, default=None, help="training steps (passed to the worker as --steps)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is killed")
    p.add_argument("--stall-timeout", type=float, default=180.0,
                   help="kill the run when no rank finishes a step for this many seconds (0: never)")
    p.add_argument("--run-dir", default=None, help="directory for per-rank logs and JSON results (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--loopback", action="store_true", help="skip namespaces: all processes on 127.0.0.1")
    p.add_argument("--cleanup", action="store_true", help=f"remove leftover {NAME_PREFIX}* namespaces and links, then exit")
    a = p.parse_args(argv)
    if a.cleanup:
        ok, reason = namespaces_available()
        if not ok:
            print(f"[cluster] nothing to clean: {reason}")
            return 0
        removed = cleanup()
        print(f"[cluster] removed {len(removed)}: {' '.join(removed) if removed else '(nothing left over)'}")
        return 0
    if a.steps is not None:
        worker_args = ["--steps", str(a.steps), *worker_args]
    try:
        parse_rate(a.rate)
        res = run_cluster(worker_args, a.nodes, a.procs_per_node, a.rate, a.latency_ms, a.timeout, a.run_dir,
                          force_loopback=a.loopback, stall_timeout=a.stall_timeout)
    except (ValueError, ClusterError) as e:
        print(f"[cluster] error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"[cluster] {e or 'interrupted'}; torn down", file=sys.stderr)
        return 130
    s = summarize(res)
    s["rate"] = a.rate if res.mode == "netns" else "loopback"
    text = json.dumps(s, indent=2)
    print(text)
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
