"""Scale simulator: the exchanges' alpha-beta cost model (lightning_topk.comm.cost) from 2 to 1024 ranks.

    python benchmarks/scale_sim.py             # table -> benchmarks/results/scale_sim.md,
                                               # data -> benchmarks/results/scale_sim.json (tools/render_results.py
                                               # draws docs/plots/scale_sim.png from it)
    python benchmarks/scale_sim.py --json-only # only the data (tools/render_results.py plots it)
    python benchmarks/scale_sim.py --validate  # the model against the namespace cluster, 2 and 4 nodes x 1 process

Simulation: 8 ranks per node (fewer ranks: one node), inter-node links of 10, 25 and 100 Gbit/s per
node, ResNet-50 (25.6M parameters) and a 1B-parameter transformer, DDP's 25 MB buckets, density 0.01
with fp32 values + int32 indices (8 B per entry). Methods: dense fp16 ring all-reduce, PowerSGD rank 4
(P and Q all-reduced in fp32, vectors dense), flat top-k all-gather, hierarchical top-k (intra-node
reduce-scatter, inter-node all-gather of k/L per rank), the scale-free exchange (flat), the two composed
(``hierarchical_scatter``: the scale-free exchange among the N ranks sharing a local rank), and what
``exchange="auto"`` picks among all of these (dense fp32/bf16 for the dense ones).

The link and compute constants are stated in ``ASSUMED`` (no GPU cluster was measured here): the
simulation is the cost model's arithmetic, not a measurement. ``--validate`` checks that arithmetic
where it can be checked: on the namespace cluster (benchmarks/cluster.py, 1 Gbit/s tbf links, one
process per node), with the model probed by ``exchange="auto"`` in the same layout, against measured
step time (compute from a ``local`` run plus the predicted exchange) and veth bytes per node.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _results import write_results

from lightning_topk.comm.cost import CostModel, Link
from lightning_topk.comm.exchanges.scatter import scatter_wire, slot_plan
from lightning_topk.comm.state import TopKConfig

PENALTY = TopKConfig(density=0.01).sparse_penalty  # exchange='auto' as shipped (density 0.01, plain error feedback)

DATE = "2026-11-23"
MACHINE = "2-core x86_64, no GPU, torch 2.13.0 CPU"
RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PER_NODE = 8
RATES_GBIT = (10, 25, 100)
DENSITY = 0.01
BUCKET = 25 * 2**20 // 4  # DDP's bucket_cap_mb=25 in fp32 entries
ASSUMED = dict(
    inter_alpha=15e-6,      # s per message across nodes
    intra_alpha=5e-6,       # s per message inside a node
    intra_beta=100e9,       # B/s per rank inside a node (NVLink class)
    select_per_elem=3e-11,  # ~6 passes over fp32 at ~1.5 TB/s (a sampled-threshold selector)
    select_fixed=50e-6,     # kernel launches per selection
    pass_per_elem=5e-12,    # one read + one write of fp32 at ~1.5 TB/s
    add_per_entry=2e-10,    # one index_add_ at a random place (atomics)
)
METHODS = ("dense fp16", "PowerSGD r4", "all-gather", "hierarchical", "scale-free", "hier. + scale-free")
_CHOICE = {"dense fp16": "dense_bf16", "all-gather": "allgather", "hierarchical": "hierarchical",
           "hier. + scale-free": "hierarchical_scatter",
           "scale-free": "scatter"}


# ---- models: parameter counts and PowerSGD's matrices ------------------------------------------
def resnet50_shapes() -> List[Tuple[int, ...]]:
    """Weight and vector shapes of torchvision's ResNet-50 (25,557,032 parameters)."""
    shapes: List[Tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    c_in = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for b in range(blocks):
            shapes += [(width, c_in, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, c_in, 1, 1), (4 * width,), (4 * width,)]
            c_in = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def transformer_1b_shapes(d: int = 2048, layers: int = 18, vocab: int = 50304) -> List[Tuple[int, ...]]:
    """A GPT-style decoder with tied embeddings: about 1.01B parameters."""
    shapes: List[Tuple[int, ...]] = [(vocab, d), (2048, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


MODELS = {"ResNet-50": resnet50_shapes, "Transformer-1B": transformer_1b_shapes}


def numel(shape: Tuple[int, ...]) -> int:
    return math.prod(shape)


def powersgd_bytes(shapes: List[Tuple[int, ...]], rank: int = 4) -> int:
    """fp32 bytes PowerSGD all-reduces per step: r (m + n) per matrix (P and Q), vectors whole."""
    total = 0
    for s in shapes:
        if len(s) == 1:
            total += 4 * s[0]
        else:
            m, n = s[0], numel(s) // s[0]
            total += 4 * min(m * n, rank * (m + n))
    return total


def buckets(n: int) -> List[int]:
    full, rest = divmod(n, BUCKET)
    return [BUCKET] * full + ([rest] if rest else [])


# ---- simulation --------------------------------------------------------------------------------
def layout(p: int) -> Tuple[int, int]:
    return (1, p) if p <= PER_NODE else (p // PER_NODE, PER_NODE)


def sim_model(p: int, gbit: float) -> CostModel:
    nodes, local = layout(p)
    a = ASSUMED
    intra = Link(a["intra_alpha"], a["intra_beta"]) if local > 1 else None
    inter = Link(a["inter_alpha"], gbit * 1e9 / 8) if nodes > 1 else None
    return CostModel(nodes, local, intra, inter, a["select_per_elem"], a["select_fixed"], a["pass_per_elem"],
                     a["add_per_entry"])


def node_inter_bytes(method: str, p: int, n: int, k: int, psgd: int) -> float:
    """Bytes one node puts on its inter-node link per bucket (node-major rings cross each node once per step)."""
    nodes, local = layout(p)
    if nodes == 1:
        return 0.0
    if method == "dense fp16":
        return 2 * (p - 1) / p * 2 * n
    if method == "PowerSGD r4":
        return 2 * (p - 1) / p * psgd
    if method == "all-gather":
        return (p - 1) * k * 8
    if method == "hierarchical":
        return (nodes - 1) * k * 8
    if method == "hier. + scale-free":  # each of the L ranks: the scale-free exchange among N nodes on n/L
        return local * scatter_wire(slot_plan(math.ceil(n / local), math.ceil(k / local), nodes), 8)
    plan = slot_plan(n, k, p)
    return local * (p - local) * plan.slot * 8 + (p - 1) * plan.out * 8


def rank_wire_bytes(method: str, p: int, n: int, k: int, psgd: int) -> float:
    """Bytes one rank puts on any link per bucket."""
    nodes, local = layout(p)
    m = sim_model(p, 10)
    if method == "PowerSGD r4":
        return 2 * (p - 1) / p * psgd
    if method in ("hierarchical", "hier. + scale-free"):
        if local < 2 or nodes < 2:
            return float("nan")
        s = 4 * n / local
        inter = (nodes - 1) * math.ceil(k / local) * 8 if method == "hierarchical" else \
            scatter_wire(slot_plan(math.ceil(n / local), math.ceil(k / local), nodes), 8)
        return 2 * (local - 1) * s + inter
    return m.wire(_CHOICE[method], n, k)


def simulate() -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for name, shapes_fn in MODELS.items():
        shapes = shapes_fn()
        n_total = sum(numel(s) for s in shapes)
        bks = buckets(n_total)
        psgd_total = powersgd_bytes(shapes)
        rows = []
        for p in RANKS:
            nodes, local = layout(p)
            row = {"P": p, "nodes": nodes, "bytes_rank": {}, "bytes_node": {}, "time": {}, "auto": {}}
            for meth in METHODS:
                br = bn = 0.0
                for b in bks:
                    k = max(1, math.ceil(DENSITY * b))
                    ps = psgd_total * b / n_total
                    br += rank_wire_bytes(meth, p, b, k, ps)
                    bn += node_inter_bytes(meth, p, b, k, ps)
                row["bytes_rank"][meth], row["bytes_node"][meth] = br, bn
            for gbit in RATES_GBIT:
                m = sim_model(p, gbit)
                times, chosen = {}, {}
                for meth in METHODS:
                    t = 0.0
                    for b in bks:
                        k = max(1, math.ceil(DENSITY * b))
                        if meth == "PowerSGD r4":
                            flat = m.inter if nodes > 1 else m.intra
                            t += 2 * flat.allreduce(psgd_total * b / n_total / 2, p)  # P and Q: two all-reduces
                        elif meth in ("hierarchical", "hier. + scale-free") and (nodes < 2 or local < 2):
                            t = float("nan")
                        else:
                            t += m.total(_CHOICE[meth], b, k)
                    times[meth] = t
                cands = ["dense", "dense_bf16", "allgather", "scatter"] + (
                    ["hierarchical", "hierarchical_scatter"] if nodes > 1 and local > 1 else [])
                t_auto = 0.0
                for b in bks:
                    k = max(1, math.ceil(DENSITY * b))
                    c, pred = m.choose(b, k, cands, sparse_penalty=PENALTY)
                    chosen[c] = chosen.get(c, 0) + 1
                    t_auto += pred[c]
                times["auto"] = t_auto
                row["time"][gbit] = times
                row["auto"][gbit] = chosen
            rows.append(row)
        out[name] = {"params": n_total, "buckets": len(bks), "powersgd_bytes": psgd_total, "rows": rows}
    return out


def _finite(x: object) -> object:
    """``x`` with NaN (a method that does not apply to the layout) as None, and dict keys as strings: JSON."""
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, float) and x != x:
        return None
    return x


def write_json(sim: Dict[str, dict], argv: List[str]) -> str:
    """benchmarks/results/scale_sim.json: one row per model and rank count, with the constants assumed."""
    rows = [{"model": name, **_finite(r)} for name, s in sim.items() for r in s["rows"]]  # type: ignore[dict-item]
    models = {name: {k: v for k, v in s.items() if k != "rows"} for name, s in sim.items()}
    return write_results("scale_sim", rows, argv, kind="cost model arithmetic, not a measurement", models=models,
                         assumed=ASSUMED, ranks_per_node=PER_NODE, density=DENSITY, rates_gbit=list(RATES_GBIT))


def _mb(x: float) -> str:
    return "–" if x != x else (f"{x / 1e6:.1f}" if x >= 1e5 else f"{x / 1e6:.3f}")


def _ms(x: float) -> str:
    return "–" if x != x else f"{1e3 * x:.1f}"


def model_tables(s: dict, rates: Sequence[float], wire: bool = True) -> List[str]:
    """One model's tables: wire bytes per step per rank and per node (``wire``), then exchange time per step at
    each rate of ``rates`` (also rendered into BENCHMARKS.md by tools/render_results.py)."""
    lines: List[str] = []
    if wire:
        lines += ["Wire bytes per step, MB: per rank on any link / per node on its inter-node link.", "",
                  "| P | nodes | " + " | ".join(METHODS) + " |", "|---:|---:|" + "---:|" * len(METHODS)]
        for r in s["rows"]:
            lines.append(f"| {r['P']} | {r['nodes']} | " + " | ".join(
                f"{_mb(r['bytes_rank'][m])} / {_mb(r['bytes_node'][m])}" for m in METHODS) + " |")
    for gbit in rates:
        lines += ["", f"Exchange time per step at {gbit} Gbit/s per node, ms (auto: the model's choice per "
                  "bucket, never predicted slower than a dense all-reduce).", "",
                  "| P | " + " | ".join(METHODS) + " | auto | auto picks |", "|---:|" + "---:|" * (len(METHODS) + 1)
                  + "---|"]
        for r in s["rows"]:
            t = r["time"][gbit]
            picks = ", ".join(f"{c} x{v}" for c, v in sorted(r["auto"][gbit].items()))
            lines.append(f"| {r['P']} | " + " | ".join(_ms(t[m]) for m in METHODS) + f" | {_ms(t['auto'])} | "
                         f"{picks} |")
    return lines[1:] if not wire else lines


def from_json(d: dict) -> Dict[str, dict]:
    """The simulation of a ``scale_sim.json`` record, as :func:`simulate` returns it (None back to NaN)."""
    def nan(x: dict) -> dict:
        return {k: float("nan") if v is None else v for k, v in x.items()}

    rates = {str(g): g for g in d["rates_gbit"]}
    sim = {name: {**m, "rows": []} for name, m in d["models"].items()}
    for r in d["rows"]:
        sim[r["model"]]["rows"].append({**r, "bytes_rank": nan(r["bytes_rank"]), "bytes_node": nan(r["bytes_node"]),
                                        "time": {rates[g]: nan(t) for g, t in r["time"].items()},
                                        "auto": {rates[g]: a for g, a in r["auto"].items()}})
    return sim


def render(sim: Dict[str, dict]) -> str:
    a = ASSUMED
    lines = [
        "# Scale simulation: per-rank wire bytes and exchange time from 2 to 1024 ranks",
        "",
        f"`python benchmarks/scale_sim.py` ({DATE}). The cost model of `lightning_topk.comm.cost` evaluated, not "
        "measured: 8 ranks per node, DDP's 25 MB buckets, density 0.01, 8 B per sparse entry (fp32 value + "
        "int32 index). Assumed constants (no GPU cluster was available): inter-node "
        f"alpha {1e6 * a['inter_alpha']:.0f} us and the link rate per node; intra-node alpha "
        f"{1e6 * a['intra_alpha']:.0f} us, {a['intra_beta'] / 1e9:.0f} GB/s; selection "
        f"{1e12 * a['select_per_elem']:.0f} ps/entry + {1e6 * a['select_fixed']:.0f} us; dense pass "
        f"{1e12 * a['pass_per_elem']:.0f} ps/entry; random index_add {1e12 * a['add_per_entry']:.0f} ps/entry. "
        "PowerSGD's time is its two all-reduces only (its matmuls and the top-k methods' other kernels on a "
        "GPU are small next to these links). Flat collectives over several nodes are limited by the "
        "inter-node link (a node-major ring crosses each node's link once per step). The model's own check "
        "against measured runs is in the validation section.",
        "",
    ]
    for name, s in sim.items():
        lines += [f"## {name} ({s['params']:,} parameters, {s['buckets']} buckets)", "", *model_tables(s, RATES_GBIT), ""]
    lines += ["![per-rank and per-node wire bytes vs ranks](../../docs/plots/scale_sim.png)", ""]
    return "\n".join(lines)


def validate(a: argparse.Namespace) -> str:
    import cluster

    ok, reason = cluster.namespaces_available()
    if not ok:
        return f"Validation skipped: {reason}."
    common = ["--hidden", str(a.hidden), "--steps", str(a.steps), "--warmup-steps", "3", "--eval-every", "0",
              "--density", str(DENSITY)]
    if a.validate_from:
        with open(a.validate_from) as f:
            saved = json.load(f)
        return render_validation({int(k): v for k, v in saved["results"].items()}, saved["seconds"], a)
    results: Dict[int, Dict[str, dict]] = {}
    t0 = time.perf_counter()
    for nodes in (2, 4):
        results[nodes] = {}
        for entry in ("local", "auto", "dense", "allgather", "scatter"):
            args = ["--strategy", "local"] if entry == "local" else ["--strategy", "topk_ddp", "--exchange", entry]
            res = cluster.run_cluster(args + common, nodes, 1, a.rate, timeout=600,
                                      run_dir=os.path.join(a.run_dir, f"{nodes}n", entry))
            s = cluster.summarize(res)
            s["loadavg"] = os.getloadavg()[0]
            results[nodes][entry] = s
            print(f"[validate] {nodes} nodes {entry:<9} step {s['step_time_s']:.3f} s  veth/node "
                  f"{_mb(sum(s['inter_node_bytes_per_node'] or [0]) / nodes)} MB", flush=True)
    total = time.perf_counter() - t0
    with open(os.path.join(a.run_dir, "validate.json"), "w") as f:
        json.dump({"results": {str(k): v for k, v in results.items()}, "seconds": total}, f, indent=1)
    return render_validation(results, total, a)


def final_buckets(plan: Dict[str, str]) -> List[Tuple[int, int]]:
    """(n, k) of the buckets in DDP's final layout: the plan also holds the first iteration's buckets,
    which DDP rebuilt after step 1 (later keys win; a key sharing a parameter with a later one is gone)."""
    seen: set = set()
    out = []
    for key in reversed(list(plan)):
        names = set(key.rsplit("#", 2)[0].split("|"))
        if names & seen:
            continue
        seen |= names
        out.append(tuple(int(x) for x in key.rsplit("#", 2)[1:]))
    return out


def render_validation(results: Dict[int, Dict[str, dict]], total: float, a: argparse.Namespace) -> str:
    lines = [
        "## Validation against the namespace cluster",
        "",
        f"`python benchmarks/scale_sim.py --validate` ({DATE}, {MACHINE}; {total:.0f} s; 1-minute load average "
        f"{min(r['loadavg'] for d in results.values() for r in d.values()):.1f}-"
        f"{max(r['loadavg'] for d in results.values() for r in d.values()):.1f} during the runs, the machine "
        f"shared with other jobs). benchmarks/cluster.py, one process per node, {a.rate} tbf links, "
        f"cluster_worker.py `--hidden {a.hidden}` ({results[2]['local']['n_params']:,} parameters), density "
        f"{DENSITY}, {a.steps} steps (3 warm-up steps excluded). Model: the one `exchange=\"auto\"` probed at "
        "setup in the same layout (links, selection, passes), with the buckets and k of that run. Predicted "
        "step = the `local` step (the same processes computing without communication) + the predicted "
        "exchange of every bucket (no overlap with backward assumed). Bytes: veth tx per node per step "
        "(headers and ACKs included) vs the model's wire bytes per rank (one rank per node).",
        "",
        "| nodes | exchange | step s measured | predicted | error | veth MB/node | model MB | error | within ±25% / ±10% |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for nodes, d in results.items():
        model = d["auto"].get("cost_model")
        plan = d["auto"].get("plan") or {}
        cm = CostModel(**{**model, "intra": _link(model["intra"]), "inter": _link(model["inter"])})
        shapes = final_buckets(plan)
        for entry, choice in (("dense", "dense"), ("allgather", "allgather"), ("scatter", "scatter")):
            s = d[entry]
            pred_step = d["local"]["step_time_s"] + sum(cm.total(choice, n, k) for n, k in shapes)
            pred_bytes = sum(cm.wire(choice, n, k) for n, k in shapes)
            veth = sum(s["inter_node_bytes_per_node"]) / nodes
            e_t = pred_step / s["step_time_s"] - 1
            e_b = pred_bytes / veth - 1
            lines.append(f"| {nodes} | {entry} | {s['step_time_s']:.3f} | {pred_step:.3f} | {100 * e_t:+.0f}% | "
                         f"{veth / 1e6:.3f} | {pred_bytes / 1e6:.3f} | {100 * e_b:+.1f}% | "
                         f"{'yes' if abs(e_t) <= 0.25 else 'no'} / {'yes' if abs(e_b) <= 0.10 else 'no'} |")
        auto = d["auto"]
        lines.append(f"| {nodes} | auto (picked {', '.join(sorted(set(plan.values())))}) | {auto['step_time_s']:.3f} | "
                     f"| | {sum(auto['inter_node_bytes_per_node']) / nodes / 1e6:.3f} | | | |")
    b2 = {e: sum(results[2][e]["inter_node_bytes_per_node"]) / 2 for e in ("auto", "allgather", "scatter")}
    b4 = {e: sum(results[4][e]["inter_node_bytes_per_node"]) / 4 for e in ("auto", "allgather", "scatter")}
    lines += ["", "Real wire bytes per node per step, 4 nodes / 2 nodes (veth counters): "
              + ", ".join(f"{e} {b4[e] / b2[e]:.2f}x" for e in b2) + ".", ""]
    return "\n".join(lines)


def _link(d: Optional[dict]) -> Optional[Link]:
    return None if d is None else Link(d["alpha"], d["beta"])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--validate", action="store_true", help="also run the namespace-cluster validation (minutes)")
    p.add_argument("--validate-from", default=None, help="render the validation from a saved validate.json "
                   "(written to --run-dir by --validate) instead of running it")
    p.add_argument("--rate", default="1gbit", help="validation link rate (tc syntax)")
    p.add_argument("--hidden", type=int, default=2048, help="validation model width (2048: 8.5M parameters)")
    p.add_argument("--steps", type=int, default=15, help="validation steps per run")
    p.add_argument("--run-dir", default="/tmp/ltk_scale_sim", help="validation logs and JSON")
    p.add_argument("--md", default=os.path.join(HERE, "results", "scale_sim.md"))
    p.add_argument("--json-only", action="store_true", help="only write benchmarks/results/scale_sim.json")
    a = p.parse_args(argv)
    sim = simulate()
    print(f"[scale_sim] wrote {write_json(sim, sys.argv if argv is None else [sys.argv[0], *argv])}")
    if a.json_only:
        return 0
    text = render(sim)
    if a.validate or a.validate_from:
        os.makedirs(a.run_dir, exist_ok=True)
        text += "\n" + validate(a)
    os.makedirs(os.path.dirname(a.md), exist_ok=True)
    with open(a.md + ".tmp", "w") as f:
        f.write(text)
    os.replace(a.md + ".tmp", a.md)
    print(f"[scale_sim] wrote {a.md}; the plot docs/plots/scale_sim.png is drawn from the JSON by "
          "tools/render_results.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
