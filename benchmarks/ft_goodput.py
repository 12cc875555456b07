"""Elastic replicas under preemption (issue 34): goodput of ``fault_tolerance="torchft"`` against today's restart of
the whole job from ``ckpt_path="last"``, and final accuracy with one replica killed and healed.

    python benchmarks/ft_goodput.py goodput --duration 300 --modes ft,restart,ddp,ft_steady --out ft_goodput
    python benchmarks/ft_goodput.py accuracy --data digits --seeds 0,1,2 --steps 300 --out ft_accuracy_digits
    python benchmarks/ft_goodput.py table benchmarks/results/ft_goodput.json

**goodput**: the namespace cluster of ``benchmarks/cluster.py`` (``--nodes`` x 1 process, ``--rate`` per link),
each node one ``benchmarks/ft_goodput_worker.py`` on MNIST-5k (the cluster benchmark's 11.3M-parameter model, SGD,
``topk_ddp`` at density 0.01, exchange ``allgather``). For ``--duration`` seconds of wall time, from the launch of
the first process: every ``--kill-every`` seconds a node drawn by a seeded RNG is killed with SIGKILL and comes back
``--down`` seconds later (the schedule is recorded). Modes:

- ``ft``: ``fault_tolerance="torchft"``: a torchft lighthouse in the hub namespace; the survivors keep stepping; the
  killed node's process is started again when it comes back and heals from a live peer;
- ``restart``: today's recovery: a plain multi-node ``topk_ddp`` job writing ``last.ckpt`` every ``--ckpt-every``
  steps; when a node dies the whole job is killed (at once: kinder to it than a collective timeout), and when the
  node is back every process is started again with ``ckpt_path="last"``;
- ``ddp`` and ``ft_steady``: the same two without kills (``ddp`` keeps checkpointing).

Committed samples: for torchft the sum over committed steps of (replicas in that step's quorum x batch); for the
job, its step count at the end x nodes x batch (work redone after a restart counts once). The test accuracy is
pooled over the nodes' slices of the test set at every ``--eval-every``-th committed step (evaluation time is in
the wall time, alike for every mode).

**accuracy**: ``--replicas`` replica groups on loopback (no namespaces, no rate limit), ``--steps`` committed steps,
final test accuracy on the whole test set; per seed one undisturbed run and one run where a replica is killed at
committed step ``--kill-at`` and started again once the others have stepped ``--down`` seconds without it.

``--local-steps H`` is passed to the workers: sparse local SGD under torchft (the strategy's default outer settings);
``--steps`` and ``--kill-at`` then count committed outer rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cluster import MASTER_PORT, NetnsCluster, _free_port, namespaces_available, parse_rate

WORKER = os.path.join(HERE, "ft_goodput_worker.py")
LIGHTHOUSE_PORT = 29510
LH_ADDR_SUFFIX = "254"  # the lighthouse's address on the hub's bridge: 10.77.0.254
MODES = ("ft", "restart", "ddp", "ft_steady")


def lighthouse_binary() -> str:
    sys.path.insert(0, ROOT)
    from lightning_topk.app.elastic_launch import lighthouse_binary as find

    return find()


def read_rows(path: str) -> List[Dict[str, Any]]:
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the line a SIGKILL cut
                pass
    return rows


def schedule(duration: float, every: float, down: float, nodes: int, seed: int) -> List[Dict[str, float]]:
    rng = random.Random(seed)
    out, t = [], every
    while t < duration:
        out.append({"kill_at_s": t, "node": rng.randrange(nodes), "back_at_s": min(t + down, duration)})
        t += every
    return out


class Proc:
    def __init__(self, popen: subprocess.Popen, node: int, inc: int, started: float) -> None:
        self.p, self.node, self.inc, self.started = popen, node, inc, started

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_goodput_mode(mode: str, a: argparse.Namespace, run_dir: str) -> Dict[str, Any]:
    """One mode on a fresh namespace cluster; returns its summary and event log."""
    ft = mode in ("ft", "ft_steady")
    kills = mode in ("ft", "restart")
    sched = schedule(a.duration, a.kill_every, a.down, a.nodes, a.seed) if kills else []
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    ok, reason = namespaces_available()
    if not ok:
        raise SystemExit(f"ft_goodput: needs network namespaces ({reason})")
    events: List[Dict[str, Any]] = []
    procs: Dict[int, Proc] = {}
    incs = [0] * a.nodes
    lh: Optional[subprocess.Popen] = None
    with NetnsCluster(a.nodes, parse_rate(a.rate)) as cl:
        lh_host = f"{cl.addr(0).rsplit('.', 1)[0]}.{LH_ADDR_SUFFIX}"
        if ft:
            hub = ["ip", "netns", "exec", cl.hub]
            subprocess.run(hub + ["ip", "addr", "add", f"{lh_host}/24", "dev", f"{cl.prefix}br"], check=True)
            lh = subprocess.Popen(hub + [lighthouse_binary(), "--bind", f"{lh_host}:{LIGHTHOUSE_PORT}",
                                         "--min_replicas", str(a.min_replicas), "--join_timeout_ms",
                                         str(a.join_timeout_ms), "--heartbeat_timeout_ms", str(a.heartbeat_timeout_ms)],
                                  stdout=open(os.path.join(run_dir, "lighthouse.log"), "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
            time.sleep(1.0)
        master_port = [MASTER_PORT]

        def start(node: int, t0: float) -> None:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME=cl.ifname(node),
                       PYTHONPATH=ROOT)
            for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK"):
                env.pop(k, None)
            cmd = [*cl.exec_prefix(node), sys.executable, WORKER, "--mode", "ft" if ft else "ddp", "--node", str(node),
                   "--nodes", str(a.nodes), "--incarnation", str(incs[node]), "--out", run_dir, "--seed", str(a.seed),
                   "--eval-every", str(a.eval_every), "--density", str(a.density), "--hidden", str(a.hidden),
                   "--start-gate"]
            if a.local_steps:
                cmd += ["--local-steps", str(a.local_steps)]
            if ft:
                env.update(TORCHFT_LIGHTHOUSE=f"http://{lh_host}:{LIGHTHOUSE_PORT}", REPLICA_GROUP_ID=f"node{node}",
                           LIGHTNING_TOPK_FT_HOST=cl.addr(node))
                cmd += ["--min-replicas", str(a.min_replicas)]
            else:
                env.update(MASTER_ADDR=cl.addr(0), MASTER_PORT=str(master_port[0]), NODE_RANK=str(node),
                           LOCAL_RANK="0", WORLD_SIZE=str(a.nodes))
                cmd += ["--ckpt-every", str(a.ckpt_every), "--ckpt-dir", os.path.join(run_dir, "ckpt")]
            log = open(os.path.join(run_dir, f"node{node}.{incs[node]}.log"), "w")
            p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            procs[node] = Proc(p, node, incs[node], time.time() - t0)
            events.append({"t_s": round(time.time() - t0, 2), "event": "start", "node": node, "inc": incs[node]})
            incs[node] += 1

        def start_all(t0: float) -> None:
            master_port[0] += 1  # a fresh rendezvous port for each start of the job
            for n in range(a.nodes):
                start(n, t0)

        t0 = time.time()
        start_all(t0)
        gated = False
        pending = sorted([(e["kill_at_s"], "kill", e["node"]) for e in sched]
                         + [(e["back_at_s"], "back", e["node"]) for e in sched if e["back_at_s"] < a.duration])
        down: set = set()
        job_down = False
        try:
            while True:
                now = time.time() - t0
                if now >= a.duration:
                    break
                if not gated and all(os.path.exists(os.path.join(run_dir, f"node{i}.ready")) for i in range(a.nodes)):
                    open(os.path.join(run_dir, "go"), "w").close()
                    gated = True
                while pending and pending[0][0] <= now:
                    _, what, node = pending.pop(0)
                    events.append({"t_s": round(now, 2), "event": what, "node": node})
                    if what == "kill":
                        down.add(node)
                        if ft:
                            procs[node].kill()
                        else:  # the job dies with any of its nodes
                            for q in procs.values():
                                q.kill()
                            job_down = True
                    else:
                        down.discard(node)
                        if ft:
                            start(node, t0)
                        elif job_down and not down:
                            start_all(t0)
                            job_down = False
                            events.append({"t_s": round(time.time() - t0, 2), "event": "job_restart"})
                # a process that exits by itself (a crash): restart it, or the whole job
                for n, q in list(procs.items()):
                    rc = q.p.poll()
                    if rc is None or n in down or (not ft and job_down):
                        continue
                    events.append({"t_s": round(time.time() - t0, 2), "event": "exited", "node": n, "rc": rc})
                    if ft:
                        start(n, t0)
                    else:
                        for qq in procs.values():
                            qq.kill()
                        start_all(t0)
                        events.append({"t_s": round(time.time() - t0, 2), "event": "job_restart"})
                    break
                time.sleep(0.2)
        finally:
            for q in procs.values():
                q.kill()
            if lh is not None:
                try:
                    os.killpg(lh.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                lh.wait(timeout=10)
    rows = {n: read_rows(os.path.join(run_dir, f"node{n}.jsonl")) for n in range(a.nodes)}
    summary = summarize_goodput(mode, rows, t0, a, events)
    summary["schedule"] = sched
    summary["events"] = events
    summary["starts"] = sum(incs)
    return summary


def summarize_goodput(mode: str, rows: Dict[int, List[Dict[str, Any]]], t0: float, a: argparse.Namespace,
                      events: List[Dict[str, Any]]) -> Dict[str, Any]:
    end = t0 + a.duration
    allrows = [dict(r, node=n) for n, rs in rows.items() for r in rs if r["t"] <= end]
    batch = 32
    ft = mode in ("ft", "ft_steady")
    if ft:
        per_step: Dict[int, int] = {}
        for r in allrows:
            if r["committed"]:
                per_step[r["step"]] = max(per_step.get(r["step"], 0), r["quorum"])
        steps = max(per_step) if per_step else 0
        samples = batch * sum(per_step.values())
    else:
        last = max(allrows, key=lambda r: r["t"]) if allrows else None
        steps = last["step"] if last else 0
        samples = batch * a.nodes * steps
    first = min((r["t"] for r in allrows), default=end)
    # the accuracy of each evaluated step: the nodes' slices pooled (per start of the job for `restart`)
    evals: Dict[Any, List[Dict[str, Any]]] = {}
    for r in allrows:
        if "correct" in r:
            key = (r["step"],) if ft else (r["step"], r["inc"])
            evals.setdefault(key, []).append(r)
    curve = sorted(({"step": k[0], "t_s": round(max(x["t"] for x in v) - t0, 2),
                     "acc": sum(x["correct"] for x in v) / sum(x["n"] for x in v), "slices": len(v)}
                    for k, v in evals.items()), key=lambda e: e["t_s"])
    reached = [e for e in curve if e["acc"] >= a.target_acc]
    # heals, from the rows' counters: at a process's first quorum of the run (torchft's init_sync), a restarted
    # process's rejoin, and a survivor that fell one step behind (its step was rolled back) and healed
    heal_kinds: Dict[str, List[float]] = {"start": [], "rejoin": [], "survivor": []}
    for rs in rows.values():
        seen: Dict[int, int] = {}
        for r in rs:
            if not ft or r["t"] > end:
                continue
            before = seen.get(r["inc"], 0)
            if r.get("heals", 0) > before:
                first_of_inc = before == 0 and all(x["inc"] != r["inc"] or x is r for x in rs[:rs.index(r) + 1])
                kind = ("rejoin" if r["inc"] > 0 else "start") if first_of_inc else "survivor"
                heal_kinds[kind].append(round(r["heal_time_s"], 2))
                seen[r["inc"]] = r["heals"]
    # restart: the steps done twice (between the checkpoint a restart resumed from and the step the job died at)
    redone = 0
    if not ft and rows:
        rs = [r for r in rows[0] if r["t"] <= end]
        for inc in sorted({r["inc"] for r in rs if r["inc"] > 0}):
            before = [r["step"] for r in rs if r["inc"] < inc]
            after = [r["step"] for r in rs if r["inc"] == inc]
            if before and after:
                redone += max(0, max(before) - (min(after) - 1))
    # from a restarted process's launch (the node is back) to its first committed step: start-up, rendezvous or
    # quorum, heal or checkpoint load
    rejoin = []
    for e in events:
        if e["event"] == "start" and e["inc"] > 0:
            mine = [r for r in rows[e["node"]] if r["inc"] == e["inc"] and r["committed"] and r["t"] <= end]
            if mine:
                rejoin.append(round(mine[0]["t"] - t0 - e["t_s"], 1))
    gaps = []
    commits = sorted({r["t"] for r in allrows if r["committed"]})
    for x, y in zip(commits, commits[1:]):
        gaps.append(y - x)
    # the run's own pace: the median time between consecutive committed steps with every node in, and the samples
    # that pace would have committed from the first step to the end (evaluation and checkpoint steps are in
    # the median's tails); the ratio is less sensitive than samples/s to the load the machine's other jobs add
    commit_t: Dict[Any, float] = {}
    for r in allrows:
        if r["committed"] and r["quorum"] == a.nodes:
            key = (r["step"],) if ft else (r["inc"], r["step"])
            commit_t[key] = min(commit_t.get(key, r["t"]), r["t"])
    paces = [t - commit_t[k[:-1] + (k[-1] - 1,)] for k, t in commit_t.items() if k[:-1] + (k[-1] - 1,) in commit_t]
    pace = statistics.median(paces) if paces else None
    at_pace = a.nodes * batch * (end - first) / pace if pace else None
    return {
        "mode": mode, "duration_s": a.duration, "median_step_s": pace,
        "share_of_own_pace": samples / at_pace if at_pace else None, "first_step_s": round(first - t0, 2), "steps_committed": steps,
        "samples_committed": samples, "samples_per_s": samples / a.duration,
        "samples_per_s_after_first_step": samples / max(1e-9, end - first),
        "time_to_target_s": reached[0]["t_s"] if reached else None, "target_acc": a.target_acc,
        "final_acc": curve[-1]["acc"] if curve else None, "best_acc": max((e["acc"] for e in curve), default=None),
        "heal_times_s": heal_kinds["rejoin"], "heals_at_start_s": heal_kinds["start"],
        "heals_of_survivors_s": heal_kinds["survivor"], "steps_redone": redone,
        "start_to_first_commit_s": rejoin if ft else rejoin[::a.nodes],
        "uncommitted_steps": sum(1 for r in allrows if ft and not r["committed"]),
        "longest_gap_between_commits_s": round(max(gaps), 2) if gaps else None,
        "quorum_sizes": sorted({r["quorum"] for r in allrows}), "curve": curve,
    }


def goodput(a: argparse.Namespace) -> Dict[str, Any]:
    base = a.run_dir or tempfile.mkdtemp(prefix="ltk_ftgoodput_")
    results: List[Dict[str, Any]] = []
    setup = {k: v for k, v in vars(a).items() if k not in ("func", "out", "run_dir")}
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {MODES}")
        t = time.time()
        print(f"[ft_goodput] {mode}: {a.duration:g} s", flush=True)
        s = run_goodput_mode(mode, a, os.path.join(base, mode))
        s["load_avg_after"] = os.getloadavg()[0]
        results.append(s)
        print(f"[ft_goodput] {mode}: {s['steps_committed']} steps, {s['samples_per_s']:.1f} samples/s, "
              f"target {s['time_to_target_s']}, final acc {s['final_acc']}, heals {s['heal_times_s']} "
              f"({time.time() - t:.0f} s)", flush=True)
        if a.out:  # after each mode: a later failure keeps what was measured
            from _results import write_results

            write_results(a.out, {"setup": setup, "results": results, "run_dir": base}, sys.argv)
    return {"setup": setup, "results": results, "run_dir": base}


def open_gate(run_dir: str, n: int, procs: Dict[int, "Proc"], deadline: float) -> None:
    """Once every node's first process is ready to train, let them all start (one first quorum)."""
    while not all(os.path.exists(os.path.join(run_dir, f"node{i}.ready")) for i in range(n)):
        dead = [i for i, q in procs.items() if q.p.poll() is not None]
        if dead or time.time() > deadline:
            raise RuntimeError(f"node(s) {dead} exited before training started ({run_dir})")
        time.sleep(0.1)
    open(os.path.join(run_dir, "go"), "w").close()


# ---- accuracy: one replica killed and healed, against undisturbed -----------------------------------------------

def run_accuracy_once(a: argparse.Namespace, seed: int, kill: bool, run_dir: str) -> Dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    port = _free_port()
    lh = subprocess.Popen([lighthouse_binary(), "--bind", f"127.0.0.1:{port}", "--min_replicas", str(a.min_replicas),
                           "--join_timeout_ms", str(a.join_timeout_ms), "--heartbeat_timeout_ms",
                           str(a.heartbeat_timeout_ms)], stdout=open(os.path.join(run_dir, "lighthouse.log"), "w"),
                          stderr=subprocess.STDOUT, start_new_session=True)
    procs: Dict[int, Proc] = {}
    incs = [0] * a.replicas

    def start(r: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT,
                   TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=f"node{r}",
                   LIGHTNING_TOPK_FT_HOST="127.0.0.1")
        for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "GLOO_SOCKET_IFNAME"):
            env.pop(k, None)
        cmd = [sys.executable, WORKER, "--mode", "ft", "--data", a.data, "--node", str(r), "--nodes", str(a.replicas),
               "--incarnation", str(incs[r]), "--out", run_dir, "--seed", str(seed), "--eval-every", "0",
               "--stop-step", str(a.steps), "--min-replicas", str(a.min_replicas), "--density", str(a.density),
               "--delay", str(a.delay), "--start-gate", "--ft-timeout", str(a.ft_timeout)]
        if a.data == "digits":
            cmd += ["--min-sparse-numel", "4096"]
        else:
            cmd += ["--hidden", str(a.hidden)]
        if a.local_steps:
            cmd += ["--local-steps", str(a.local_steps)]
        log = open(os.path.join(run_dir, f"node{r}.{incs[r]}.log"), "w")
        procs[r] = Proc(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=ROOT), r, incs[r], time.time())
        incs[r] += 1

    info: Dict[str, Any] = {"seed": seed, "killed": kill}
    t0 = time.time()
    try:
        time.sleep(0.5)
        for r in range(a.replicas):
            start(r)
        open_gate(run_dir, a.replicas, procs, t0 + a.timeout)
        victim = a.replicas - 1
        if kill:
            while True:
                rs = read_rows(os.path.join(run_dir, f"node{victim}.jsonl"))
                if rs and rs[-1]["step"] >= a.kill_at:
                    break
                if procs[victim].p.poll() is not None or time.time() - t0 > a.timeout:
                    raise RuntimeError(f"replica {victim} ended before step {a.kill_at}")
                time.sleep(0.05)
            procs[victim].kill()
            info["killed_at_step"] = rs[-1]["step"]
            time.sleep(a.down)
            start(victim)
        for q in list(procs.values()):
            q.p.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
    finally:
        for q in procs.values():
            q.kill()
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait(timeout=10)
    finals = []
    for r in range(a.replicas):
        path = os.path.join(run_dir, f"node{r}.final.json")
        if not os.path.exists(path):
            raise RuntimeError(f"replica {r} wrote no final result ({run_dir})")
        with open(path) as f:
            finals.append(json.load(f))
    accs = [f["accuracy"] for f in finals]
    info.update(accuracy=accs[0], accuracies=accs, identical=len({f["params_l1"] for f in finals}) == 1,
                steps=[f["step"] for f in finals], wall_s=round(time.time() - t0, 1))
    if kill:
        back = finals[victim]["metrics"]
        info.update(heal_time_s=back["ft/heal_time_s"], heals=back["ft/heals"],
                    survivor_uncommitted=[finals[r]["metrics"]["ft/uncommitted_steps"] for r in range(a.replicas - 1)])
        rs = read_rows(os.path.join(run_dir, "node0.jsonl"))
        info["steps_with_quorum"] = {str(q): sum(1 for x in rs if x["committed"] and x["quorum"] == q)
                                     for q in sorted({x["quorum"] for x in rs})}
    return info


def accuracy(a: argparse.Namespace) -> Dict[str, Any]:
    base = a.run_dir or tempfile.mkdtemp(prefix="ltk_ftacc_")
    runs = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for kill in (False, True):
            info = run_accuracy_once(a, seed, kill, os.path.join(base, f"s{seed}_{'kill' if kill else 'steady'}"))
            runs.append(info)
            print(f"[ft_goodput] accuracy seed {seed} {'killed' if kill else 'undisturbed'}: {info['accuracy']:.4f} "
                  f"identical={info['identical']} ({info['wall_s']} s)", flush=True)
    steady = [r["accuracy"] for r in runs if not r["killed"]]
    killed = [r["accuracy"] for r in runs if r["killed"]]
    diffs = [k - s for k, s in zip(killed, steady)]
    summary = {"undisturbed_mean": statistics.mean(steady), "killed_mean": statistics.mean(killed),
               "undisturbed_range": [min(steady), max(steady)], "killed_range": [min(killed), max(killed)],
               "diff_points_mean": 100 * statistics.mean(diffs), "diff_points_per_seed": [100 * d for d in diffs],
               "within_1_point": abs(100 * statistics.mean(diffs)) <= 1.0}
    return {"setup": {k: v for k, v in vars(a).items() if k not in ("func", "out", "run_dir")}, "runs": runs,
            "summary": summary, "run_dir": base}


# ---- tables (tools/render_results.py renders them into BENCHMARKS.md) -------------------------------------------

LABELS = {"ft": "torchft, preempted", "restart": "restart from last.ckpt, preempted", "ddp": "undisturbed job",
          "ft_steady": "torchft, undisturbed"}


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def header(d: Dict[str, Any]) -> str:
    """What was run, where and when: the line above a rendered table."""
    h, st = d["host"], d["rows"]["setup"]
    where = (f"`{d['command']}`, {d['date'][:10]}, {h['cpus']}-core {h['machine']}, torch {h['torch']}, "
             f"{'CUDA' if h['cuda'] else 'no GPU'}")
    if "results" in d["rows"]:
        what = (f"{st['nodes']} nodes x 1 process, {st['rate']} per link, {st['duration']:g} s of wall time per mode "
                f"from the launch; a seeded random node killed with SIGKILL every {st['kill_every']:g} s and back "
                f"{st['down']:g} s later (seed {st['seed']}); MNIST-5k, {st['hidden']}-wide model, topk_ddp density "
                f"{st['density']:g}; restart mode: last.ckpt every {st['ckpt_every']} steps; torchft: min_replicas "
                f"{st['min_replicas']}, lighthouse join/heartbeat timeouts {st['join_timeout_ms']}/"
                f"{st['heartbeat_timeout_ms']} ms; target {100 * st['target_acc']:g}% test accuracy")
    else:
        h = st.get("local_steps", 0)
        unit = "step" if not h else "outer round"
        training = (f"density {st['density']:g}" if not h else
                    f"sparse local SGD under torchft, H = {h} inner steps per round")
        what = (f"{st['replicas']} replica groups x 1 process on loopback, {st['data']}, {st['steps']} committed "
                f"{unit}s, {training}; killed run: replica {st['replicas'] - 1} SIGKILLed at committed {unit} "
                f"{st['kill_at']} and started again {st['down']:g} s later (it heals from a peer)")
    note = f" {st['note']}" if st.get("note") else ""
    return f"{where}. {what}.{note}"


def _heals(xs: List[float]) -> str:
    return f"{len(xs)}, {statistics.median(xs):.1f}" if xs else "0"


def goodput_table(d: Dict[str, Any]) -> str:
    rows = d["rows"]["results"]
    ref = next((r for r in rows if r["mode"] == "ddp"), None)
    lines = ["| mode | steps committed | samples/s (committed) | x undisturbed job | first step s | time to target s "
             "| median step s | share of own pace | final acc | process starts | start to first commit s (median) | steps redone | heals of restarted "
             "nodes (n, median s) | heals of survivors (n, median s) | longest gap between commits s | load avg after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["samples_per_s"] / ref["samples_per_s"] if ref else None
        starts = r["start_to_first_commit_s"]
        lines.append(f"| {LABELS.get(r['mode'], r['mode'])} | {r['steps_committed']} | {r['samples_per_s']:.1f} | "
                     f"{_f(ratio, '{:.2f}')} | {r['first_step_s']:.1f} | {_f(r['time_to_target_s'])} | "
                     f"{_f(r.get('median_step_s'), '{:.3f}')} | {_f(r.get('share_of_own_pace'), '{:.2f}')} | "
                     f"{_f(r['final_acc'], '{:.3f}')} | {r['starts']} | "
                     f"{_f(statistics.median(starts) if starts else None)} | {r.get('steps_redone', 0)} | "
                     f"{_heals(r['heal_times_s'])} | {_heals(r.get('heals_of_survivors_s', []))} | "
                     f"{_f(r['longest_gap_between_commits_s'])} | {_f(r.get('load_avg_after'))} |")
    sched = next((r["schedule"] for r in rows if r["schedule"]), [])
    text = "\n".join(lines)
    if sched:
        text += "\n\nSchedule (seconds from the launch; node killed with SIGKILL, back): " + "; ".join(
            f"{e['kill_at_s']:g} node{e['node']}, {e['back_at_s']:g}" for e in sched) + "."
    return text


def accuracy_table(d: Dict[str, Any]) -> str:
    rows, s = d["rows"]["runs"], d["rows"]["summary"]
    seeds = sorted({r["seed"] for r in rows})
    lines = ["| seed | undisturbed | one replica killed and healed | difference (points) | heal s | replicas identical |",
             "|---|---|---|---|---|---|"]
    for seed in seeds:
        st = next(r for r in rows if r["seed"] == seed and not r["killed"])
        k = next(r for r in rows if r["seed"] == seed and r["killed"])
        lines.append(f"| {seed} | {100 * st['accuracy']:.1f}% | {100 * k['accuracy']:.1f}% | "
                     f"{100 * (k['accuracy'] - st['accuracy']):+.1f} | {k.get('heal_time_s', 0):.2f} | "
                     f"{'yes' if st['identical'] and k['identical'] else 'no'} |")
    lines.append(f"| mean | {100 * s['undisturbed_mean']:.1f}% ({100 * s['undisturbed_range'][0]:.1f}–"
                 f"{100 * s['undisturbed_range'][1]:.1f}) | {100 * s['killed_mean']:.1f}% "
                 f"({100 * s['killed_range'][0]:.1f}–{100 * s['killed_range'][1]:.1f}) | "
                 f"{s['diff_points_mean']:+.1f} | | |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("goodput")
    g.add_argument("--modes", default="ft,restart,ddp,ft_steady")
    g.add_argument("--duration", type=float, default=600.0)
    g.add_argument("--kill-every", type=float, default=60.0)
    g.add_argument("--down", type=float, default=20.0)
    g.add_argument("--nodes", type=int, default=4)
    g.add_argument("--rate", default="100mbit")
    g.add_argument("--ckpt-every", type=int, default=30, help="restart/ddp: last.ckpt every N steps")
    g.add_argument("--target-acc", type=float, default=0.95)
    g.add_argument("--eval-every", type=int, default=25)
    g.add_argument("--hidden", type=int, default=2560)
    g.add_argument("--min-replicas", type=int, default=2)
    g.add_argument("--note", default="")
    c = sub.add_parser("accuracy")
    c.add_argument("--data", choices=("digits", "mnist"), default="digits")
    c.add_argument("--replicas", type=int, default=3)
    c.add_argument("--seeds", default="0,1,2")
    c.add_argument("--steps", type=int, default=300)
    c.add_argument("--kill-at", type=int, default=100)
    c.add_argument("--down", type=float, default=0.0, help="seconds between the kill and the new start")
    c.add_argument("--delay", type=float, default=0.05, help="sleep per step (the kill lands mid-run)")
    c.add_argument("--min-replicas", type=int, default=2)
    c.add_argument("--hidden", type=int, default=2560)
    c.add_argument("--timeout", type=float, default=600.0)
    c.add_argument("--ft-timeout", type=float, default=15.0, help="the workers' ft_timeout (quorum: at least 60 s); "
                   "under local SGD a join waits for the peers' round end, and start-up on a loaded host is slow")
    c.add_argument("--note", default="")
    for p in (g, c):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--density", type=float, default=None)
        p.add_argument("--join-timeout-ms", type=int, default=500)
        p.add_argument("--heartbeat-timeout-ms", type=int, default=1500)
        p.add_argument("--local-steps", type=int, default=0, help="sparse local SGD under torchft (H inner steps)")
        p.add_argument("--run-dir", default=None)
        p.add_argument("--out", default=None, help="NAME: write benchmarks/results/NAME.json")
    r = sub.add_parser("resummarize", help="recompute a goodput result's summaries from its run folder's rows")
    r.add_argument("name", help="NAME of benchmarks/results/NAME.json")
    t = sub.add_parser("table")
    t.add_argument("path")
    a = ap.parse_args(argv)
    if a.cmd == "resummarize":
        from _results import RESULTS

        path = os.path.join(RESULTS, f"{a.name}.json")
        with open(path) as f:
            d = json.load(f)
        setup = argparse.Namespace(**d["rows"]["setup"])
        for i, old in enumerate(d["rows"]["results"]):
            folder = os.path.join(d["rows"]["run_dir"], old["mode"])
            rows = {n: read_rows(os.path.join(folder, f"node{n}.jsonl")) for n in range(setup.nodes)}
            t0 = min(x["t"] for rs in rows.values() for x in rs) - old["first_step_s"]
            new = summarize_goodput(old["mode"], rows, t0, setup, old["events"])
            d["rows"]["results"][i] = {**old, **new}
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(d, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
        print(goodput_table(d))
        return 0
    if a.cmd == "table":
        with open(a.path) as f:
            d = json.load(f)
        print(goodput_table(d) if "results" in d["rows"] else accuracy_table(d))
        return 0
    if a.density is None:
        a.density = 0.01 if a.cmd == "goodput" or a.data == "mnist" else 0.05
    res = goodput(a) if a.cmd == "goodput" else accuracy(a)
    print(json.dumps(res.get("summary", [
        {k: v for k, v in r.items() if k not in ("curve", "events")} for r in res.get("results", [])]), indent=1))
    if a.out:
        from _results import write_results

        print(write_results(a.out, res, sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
