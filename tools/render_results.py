"""Render every figure the documentation shows from the recorded results, so none of them is copied by hand:
BENCHMARKS.md's, docs/local_sgd.md's and docs/convergence.md's result tables (from ``benchmarks/results/``), the
README's default-job block (from ``docs/main_job.json``) and the plots of ``docs/plots/`` (from ``benchmarks/results/``).

    .venv/bin/python tools/render_results.py            # rewrite every block and plot
    .venv/bin/python tools/render_results.py --check    # exit 1 if a block or plot differs from what its data renders

Each table block sits between ``<!-- results:NAME:begin (...) -->`` and ``<!-- results:NAME:end -->`` and is
rendered from the JSON file(s) named in :data:`BLOCKS`; where a benchmark script already renders its own table
(cluster_compare.py, local_accuracy.py, convergence.py, scale_sim.py), the block uses that function. The README's block is tools/main_job_figures.py's
rendering of docs/main_job.json (that tool runs the job and records it; this one only renders). Each plot of
:data:`PLOTS` is drawn from the data its function returns; ``docs/plots.json`` records a hash of that data (and
of the code that draws it) per plot, and ``--check`` compares those hashes with the current data (a PNG's bytes depend on the matplotlib
version, its data does not), so a plot left behind by newer results fails the check.
``tests/app/test_render_results.py`` runs the check. The prose around the blocks (what was run, why, what it
means) stays hand-written.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import re
import sys
from typing import Any, Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
README = os.path.join(ROOT, "README.md")
MAIN_JOB = os.path.join(ROOT, "docs", "main_job.json")
PLOTS_DIR = os.path.join(ROOT, "docs", "plots")
PLOTS_JSON = os.path.join(ROOT, "docs", "plots.json")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _load(name: str) -> Any:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        return json.load(f)


CLUSTER_DEFAULTS = "cluster_defaults_2026-11-27.json"
CONVERGENCE = "convergence_sgd_nesterov.json"
CLUSTER_ORDER = [(lay, rate) for rate in ("1gbit", "100mbit") for lay in ("4x1", "2x2")]
RATE_NAMES = {"1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}


def _others_reached(e: Dict[str, Any]) -> List[float]:
    """Times to the target of ``ddp_fp16`` and PowerSGD, those that reached it."""
    return [e[n]["time_to_target_s"] for n in ("ddp_fp16", "ddp_powersgd") if e[n]["time_to_target_s"] is not None]


def _topk_first(e: Dict[str, Any]) -> bool:
    """Whether ``topk_0.01`` reached the target before ``ddp_fp16`` and PowerSGD (those that reached it)."""
    topk = e["topk_0.01"]["time_to_target_s"]
    return topk is not None and all(topk < t for t in _others_reached(e))


def _share_of_bound(e: Dict[str, Any]) -> int:
    """``topk_0.01``'s samples/s as a percentage of the no-communication bound (``local``)."""
    return round(100 * e["topk_0.01"]["samples_per_s"] / e["local"]["samples_per_s"])


def cluster_defaults() -> str:
    """Time to the target accuracy per layout and rate: ``cluster_compare.py`` at the defaults."""
    data = _load(CLUSTER_DEFAULTS)
    target = None
    rows = ["| layout, rate | `ddp_fp16` | PowerSGD r4 | `topk_ddp` ρ = 0.01, defaults | `local` (bound) "
            "| `topk_ddp` % of bound |", "|---|---|---|---|---|---|"]
    first = 0
    ahead: Dict[str, List[str]] = {}
    for lay, rate in CLUSTER_ORDER:
        e = data[f"{lay} {rate}"]
        target = e["topk_0.01"]["target_acc"]

        def cell(name: str, bold: bool = False, e: Dict[str, Any] = e) -> str:
            t, s = e[name]["time_to_target_s"], e[name]["steps_to_target"]
            text = "–" if t is None else f"{t:.1f} ({s})"
            return f"**{text}**" if bold else text

        topk = e["topk_0.01"]["time_to_target_s"]
        reached = _others_reached(e)
        is_first = _topk_first(e)
        first += is_first
        if topk is not None and reached:
            ahead.setdefault(rate, []).append(f"{min(reached) / topk:.1f}x")
        rows.append(f"| {lay}, {RATE_NAMES[rate]} | {cell('ddp_fp16')} | {cell('ddp_powersgd')} | "
                    f"{cell('topk_0.01', bold=is_first)} | {e['local']['time_to_target_s']:.1f} | "
                    f"{_share_of_bound(e)} |")
    head = (f"Time to {100 * (target or 0):.0f}% test accuracy, s (steps to it; evaluations every 8 steps; "
            f"from `benchmarks/results/{CLUSTER_DEFAULTS}`):")
    tail = (f"`topk_ddp` at its defaults was first to the target in {first} of {len(CLUSTER_ORDER)}; its lead over "
            f"the faster of `ddp_fp16` and PowerSGD (4x1 / 2x2): {' / '.join(ahead.get('1gbit', []))} at 1 Gbit/s, "
            f"{' / '.join(ahead.get('100mbit', []))} at 100 Mbit/s.")
    return "\n".join([head, "", *rows, "", tail])


def adamw_cnn() -> str:
    """``benchmarks/adamw_cnn.py``: a user's AdamW CNN on the digits, ``ddp`` against ``topk_ddp`` at 0.01 with the
    AdamW recipe (``recipe="auto"``) and with plain error feedback (``recipe="none"``)."""
    rows = _load("adamw_cnn.json")
    labels = {"ddp": "Lightning `ddp`", "topk_auto": "`topk_ddp` ρ 0.01, all-gather, `recipe=\"auto\"` (the default)",
              "topk_none": "`topk_ddp` ρ 0.01, all-gather, `recipe=\"none\"` (plain error feedback)"}
    seeds = sorted({r["seed"] for r in rows})
    out = ["| epochs (steps) | configuration | test accuracy, mean | per seed | vs `ddp`, points |", "|---|---|---|---|---|"]
    for ep in sorted({r["epochs"] for r in rows}):
        mean = {}
        for c in labels:
            got = [r for r in rows if r["epochs"] == ep and r["config"] == c]
            if not got:
                continue
            mean[c] = sum(r["acc"] for r in got) / len(got)
            per = ", ".join(f"{r['acc']:.3f}" for r in sorted(got, key=lambda r: r["seed"]))
            diff = "" if c == "ddp" or "ddp" not in mean else f"{100 * (mean[c] - mean['ddp']):+.1f}"
            out.append(f"| {ep} ({got[0]['steps']}) | {labels[c]} | {mean[c]:.4f} | {per} | {diff} |")
    return f"Seeds {', '.join(map(str, seeds))} (`benchmarks/results/adamw_cnn.json`):\n\n" + "\n".join(out)


def clean_exit() -> str:
    """Aborted runs out of the finished fit + test runs (``clean_exit.py``), every clean-exit result file."""
    rows = ["| result file | runs | aborted (\"terminate called\" or a non-zero exit) | load average | run time, s "
            "| commit |", "|---|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(RESULTS, "clean_exit_*.json"))):
        d = _load(os.path.basename(path))
        runs = d["per_run"]
        aborted = sum(1 for r in runs if r["exit"] != 0 or r["terminate_called"])
        if aborted != d["aborts"] or len(runs) != d["runs"]:
            raise SystemExit(f"render_results: {path}: the per-run records disagree with its totals")
        load = [r["load1"] for r in runs]
        secs = [r["seconds"] for r in runs]
        rows.append(f"| `{os.path.basename(path)}` | {len(runs)} | **{aborted}** | {min(load):.2f}-{max(load):.2f} "
                    f"| {min(secs):.1f}-{max(secs):.1f} | {d['commit']} |")
    return "\n".join(rows)


def _outer_step(rule: Any) -> str:
    if rule is None:
        return "–"
    lr, momentum, identity = rule
    if identity:
        return "identity (one replica)"
    if momentum == 0:
        return f"averaging ({lr:g}, {momentum:g})" if lr == 1 else f"lr {lr:g}, no momentum"
    return f"lr {lr:g}, momentum {momentum:g}"


def outer_recipe() -> str:
    """Test accuracy of local SGD at its defaults against ddp per layout (``outer_recipe.py --lightning``)."""
    d = _load("outer_recipe_lightning.json")
    by: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in d["rows"]:
        by.setdefault(r["layout"], {})[r["strategy"]] = r
    rows = ["| nodes x procs | ddp | local SGD, defaults | outer step |", "|---|---|---|---|"]
    for layout, e in by.items():
        ddp, local = e["ddp"], e["local"]
        same = " (same weight norm as ddp)" if local["norm"] == ddp["norm"] and local["acc"] == ddp["acc"] else ""
        rows.append(f"| {layout} | {ddp['acc']:.4f} | {local['acc']:.4f}{same} | {_outer_step(local['rule'])} |")
    return f"{d['header']}; test accuracy (`benchmarks/results/outer_recipe_lightning.json`):\n\n" + "\n".join(rows)


# the inner optimizers of benchmarks/outer_recipe.py, as its OPTIMIZERS builds them
OPT_LABELS = {"sgd": "SGD 0.1", "sgd_momentum": "SGD 0.05, momentum 0.9", "sgd_nesterov": "SGD 0.05, Nesterov 0.9",
              "lars": "LARS 1.0 (trust 0.02), momentum 0.9", "adam": "Adam 1e-3", "adamw": "AdamW 1e-3 (wd 0.01)"}


def _rule(label: str) -> Tuple[float, float, bool]:
    m = re.search(r"\(([\d.]+), ([\d.]+)( N)?\)", label)
    if m is None:
        raise SystemExit(f"render_results: cannot read the outer step {label!r}")
    return float(m.group(1)), float(m.group(2)), bool(m.group(3))


def _points(x: float) -> str:
    text = f"{x:+.1f}"
    return text.replace("-", "\u2212")


def outer_recipe_table() -> str:
    """Points of test accuracy against DDP per inner optimizer, replica count and outer step (``outer_recipe.py``);
    in bold the step ``outer_recipe="auto"`` takes for that optimizer (``comm.local.OUTER_RECIPE_TABLE``)."""
    sys.path.insert(0, ROOT)
    from lightning_topk.comm.local import OUTER_RECIPE_TABLE

    d = _load("outer_recipe_digits.json")
    cells: Dict[Tuple[str, int], Dict[str, float]] = {}
    for r in d["rows"]:
        cells.setdefault((r["opt"], r["replicas"]), {})[r["outer"]] = r["acc"]
    outers = [o for o in dict.fromkeys(r["outer"] for r in d["rows"]) if o != "ddp"]
    rows = ["| inner optimizer (lr) | R | ddp | " + " | ".join(outers) + " |", "|---" * (len(outers) + 3) + "|"]
    for (opt, replicas), accs in cells.items():
        if replicas < 2:
            continue
        ddp = accs["ddp"]
        chosen = OUTER_RECIPE_TABLE[opt]
        row = [OPT_LABELS[opt], str(replicas), f"{ddp:.3f}"]
        for o in outers:
            text = _points(100 * (accs[o] - ddp))
            row.append(f"**{text}**" if _rule(o) == chosen else text)
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def hier_bytes() -> str:
    """Inter- and intra-node payload bytes per step, flat against hierarchical (``bench_hier_bytes.py``)."""
    d = _load("hier_bytes.json")
    rows = ["| exchange | inter-node bytes / rank / step | inter-node bytes / node / step | intra-node bytes / rank "
            "/ step |", "|---|---:|---:|---:|"]
    for r in d["rows"]:
        rows.append(f"| {r['exchange']} | {r['inter_bytes_per_rank'][0]:,} | {r['inter_bytes_per_node']:,} | "
                    f"{r['intra_bytes_per_rank'][0]:,} |")
    head = (f"`{d['command']}`, {d['date'][:10]}: {d['nodes']} nodes x {d['local']} processes, density "
            f"{d['density']:g}, {d['params']:,} parameters (`benchmarks/results/hier_bytes.json`):")
    tail = f"flat / hierarchical inter-node bytes: {d['flat_over_hierarchical']:.2f}x (expected about L = {d['local']})"
    return "\n".join([head, "", *rows, "", tail])


def _preset_label(r: Dict[str, Any]) -> str:
    return f"{r['preset']} ({r['outer_density']:g}, {r['outer_value_bits']}-bit)"


def outer_exchange_bytes() -> str:
    """Bytes one replica sends per outer round, all-gather / scale-free, and auto's pick (``outer_packet_bytes.py``,
    pure arithmetic)."""
    d = _load("outer_packet_bytes.json")
    bits = {(r["preset"], r["params"]): r for r in d["rows"] if r["table"] == "packet"}
    cells: Dict[Tuple[str, int], Dict[int, Dict[str, Any]]] = {}
    for r in d["rows"]:
        if r["table"] == "outer_exchange":
            cells.setdefault((r["preset"], r["params"]), {})[r["replicas"]] = r
    replicas = sorted({rr for c in cells.values() for rr in c})
    rows = ["| preset | params | packet | unit | " + " | ".join(f"R = {r}" for r in replicas) + " |",
            "|---|---|---|---|" + "---|" * len(replicas)]
    for (preset, n), c in cells.items():
        nbytes = next(iter(c.values()))["packet_bytes"]
        unit, label = (1e6, "MB") if nbytes >= 1e5 else (1e3, "kB")
        row = []
        for rep in replicas:
            e = c[rep]
            ag, sc = e["allgather_bytes"], e["scatter_bytes"]
            row.append(f"{ag / unit:.2f} / {sc / unit:.2f} ({sc / ag:.2f}×, auto "
                       f"{'sc' if e['auto'] == 'scatter' else 'ag'})")
        rows.append(f"| {_preset_label(bits[(preset, n)])} | {n:,} | {nbytes / unit:.2f} | {label} | "
                    + " | ".join(row) + " |")
    return (f"`{d['command']}`, {d['date'][:10]} (`benchmarks/results/outer_packet_bytes.json`):\n\n"
            + "\n".join(rows))


def outer_bytes_per_param() -> str:
    """Bytes per parameter of one outer packet per density and value width (``outer_packet_bytes.py``)."""
    d = _load("outer_packet_bytes.json")
    grid = [r for r in d["rows"] if r["table"] == "bytes_per_param"]
    bits = list(grid[0]["bytes_per_param"])
    rows = ["| outer_density | " + " | ".join(f"{b}-bit" for b in bits) + " |", "|---|" + "---|" * len(bits)]
    for r in grid:
        rows.append(f"| {r['outer_density']:g} | " + " | ".join(f"{r['bytes_per_param'][b]:.3f}" for b in bits) + " |")
    return "\n".join(rows)


def _host_line(d: Dict[str, Any]) -> str:
    """``command``, date, host (cores, torch) of a result record, for the line above a rendered table."""
    h = d["host"]
    return (f"`{d['command']}`, {d['date'][:10]}, {h['cpus']}-core {h['machine']}, torch {h['torch']}, "
            f"{'CUDA' if h['cuda'] else 'no GPU'}")


def elastic_local_accuracy(name: str = "elastic_local_accuracy.json") -> str:
    """Local SGD under torchft: test accuracy with one replica group killed and healed against the undisturbed run
    (``elastic_accuracy.py``; results file ``name``)."""
    d = _load(name)
    base = {r["rounds"]: r["accuracy"][0] for r in d["rows"] if not r["killed"]}
    rows = ["| committed rounds (inner steps) | run | test accuracy | vs undisturbed | rounds the survivors committed "
            "before it rejoined | heal (s) | rounds rolled back (survivors) | replicas bit-identical at the end |",
            "|---|---|---:|---:|---:|---:|---|---|"]
    for r in d["rows"]:
        acc = r["accuracy"][0]
        if r["killed"]:
            run = f"group 1 killed at round {r['killed_at_round']}, restarted, healed at round {r['rejoined_at_round']}"
            extra = (f"{100 * (acc - base[r['rounds']]):+.1f} points | {r['rejoined_at_round'] - r['killed_at_round']} | "
                     f"{r['heal_time_s']:.2f} | {', '.join(map(str, r['rolled_back']))}")
        else:
            run, extra = "undisturbed", "– | – | – | –"
        rows.append(f"| {r['rounds']} ({r['inner_steps']}) | {run} | {100 * acc:.1f}% | {extra} | "
                    f"{'yes' if r['identical'] else '**no**'} |")
    killed = [r for r in d["rows"] if r["killed"]]
    tail = []
    if len(killed) > 1:
        deltas = [100 * (r["accuracy"][0] - base[r["rounds"]]) for r in killed]
        tail = ["", f"Killed runs against the undisturbed one: mean {sum(deltas) / len(deltas):+.1f} points "
                    f"(from {min(deltas):+.1f} to {max(deltas):+.1f}, {len(deltas)} runs)."]
    head = f"{_host_line(d)}: {d['setup']} (`benchmarks/results/{name}`):"
    return "\n".join([head, "", *rows, *tail])


def data_pipeline() -> str:
    """Samples/s per pipeline, cold epoch against the warm ones (``bench_data.py``)."""
    d = _load("data.json")
    rows = ["| pipeline | epoch 1 (cold) | epochs 2+ (mean) | epochs 2+ / own epoch 1 "
            "| epochs 2+ / DataModule streaming cold |", "|---|---:|---:|---:|---:|"]
    cold = next(r for r in d["rows"] if r["pipeline"] == "WebDataModule, streaming")["samples_per_s"][0]
    for r in d["rows"]:
        rates = r["samples_per_s"]
        warm = sum(rates[1:]) / max(len(rates) - 1, 1)
        rows.append(f"| {r['pipeline']} | {rates[0]:,.0f} | {warm:,.0f} | {warm / rates[0]:.1f}x | {warm / cold:.1f}x |")
    head = (f"{_host_line(d)}: {d['samples']} samples, {d['epochs']} epochs, {d['workers']} workers, batch "
            f"{d['batch']}, {d['seconds']:.0f} s in all (`benchmarks/results/data.json`):")
    tail = f"1-minute load average at the end of the run: {d['load_after']:.1f}."
    counters = [f"- {r['pipeline']}: {({k: v for k, v in r['cache_stats'].items() if v}) or 'no cache activity'}"
                for r in d["rows"] if r["cache_stats"] is not None]
    return "\n".join([head, "", *rows, "", tail, "", "Cache counters after the run (this process is rank 0 of 1):",
                      "", *counters])


def optim_step() -> str:
    """Milliseconds per ``step()`` over ResNet-50's shapes, per optimizer and form (``bench_optim.py``)."""
    d = _load("optim.json")
    rows = ["| optimizer | ms / step | speed-up vs per-parameter loop |", "|---|---:|---:|"]
    for r in d["rows"]:
        x = r["speedup_vs_loop"]
        rows.append(f"| {r['optimizer']} | {1e3 * r['step_s']:.1f} | {'–' if x is None else f'{x:.2f}x'} |")
    head = (f"{_host_line(d)}, {d['threads']} threads: {d['tensors']} tensors, {d['values']:,} values, fastest of "
            f"{d['repeats']} steps (`benchmarks/results/optim.json`):")
    return "\n".join([head, "", *rows])


def memory() -> str:
    """Peak RSS per rank above plain DDP per model size and configuration (``bench_memory.py``)."""
    d = _load("memory.json")
    rows = ["| params | config | peak RSS / rank (MB) | above `ddp` (B/param) | step (s) |", "|---:|---|---:|---:|---:|"]
    for r in d["rows"]:
        rows.append(f"| {r['params'] / 1e6:.0f}M | `{r['config']}` | {r['peak_rss_bytes_per_rank'] / 2**20:,.0f} | "
                    f"{r['above_ddp_bytes_per_param']:.1f} | {r['step_s']:.2f} |")
    head = (f"{_host_line(d)}, {d['ranks']} ranks; load average {d['load_before']:.1f} before, "
            f"{d['load_after']:.1f} after (`benchmarks/results/memory.json`):")
    return "\n".join([head, "", *rows])


def select() -> str:
    """Top-k selection time against ``torch.topk`` per size and density (``bench_select.py``)."""
    d = _load("select.json")
    recs = [r for r in d["rows"] if r.get("table") == "select"]
    labels = [k[:-2] for k in recs[0] if k.endswith(" s") and k != "torch_topk_s"]
    rows = ["| n | density | k | torch.topk ms | " + " | ".join(f"{lab} ms | x" for lab in labels)
            + " | " + " | ".join(f"{k[:-9]} L2 mass" for k in recs[0] if k.endswith(" l2_share")) + " |",
            "|---:|---:|---:|---:|" + "---:|---:|" * len(labels) + "---:|" * sum(k.endswith(" l2_share") for k in recs[0])]
    for r in recs:
        t = r["torch_topk_s"]
        cells = [f"{1e3 * r[lab + ' s']:.1f} | {t / r[lab + ' s']:.1f}x" for lab in labels]
        cells += [f"{100 * r[k]:.3f}%" for k in r if k.endswith(" l2_share")]
        rows.append(f"| {r['n']:,} | {r['density']:g} | {r['k']:,} | {1e3 * t:.1f} | " + " | ".join(cells) + " |")
    head = (f"{_host_line(d)}, {d['device']} (topk_select: {d['select_threads']}), best of {d['repeats']}; load "
            f"average {d['load_before']:.1f} before, {d['load_after']:.1f} after (`benchmarks/results/select.json`):")
    reuse = [r for r in d["rows"] if r.get("table") == "reuse"]
    if not reuse:
        return "\n".join([head, "", *rows])
    more = ["| n | density | k | torch.topk ms | exact ms | x | exact + hint ms | x | hint / exact | hint hits |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reuse:
        t, e, h = r["torch_topk_s"], r["exact_s"], r["exact_hint_s"]
        more.append(f"| {r['n']:,} | {r['density']:g} | {r['k']:,} | {1e3 * t:.1f} | {1e3 * e:.1f} | {t / e:.1f}x | "
                    f"{1e3 * h:.1f} | {t / h:.1f}x | {h / e:.2f} | {r['hint_hits']}/{r['hint_steps']} |")
    return "\n".join([head, "", *rows, "", f"Threshold reuse in the same run, x <- 0.9 x + noise, "
                       f"{reuse[0]['hint_steps']} timed steps after one warm-up step:", "", *more])


def convergence_table(name: str) -> Callable[[], str]:
    """The renderer of one ``convergence.py --json`` result: steps to 80% / 90% against dense per density and
    recipe, that script's own table."""
    def render() -> str:
        conv = _module("benchmarks/convergence.py")
        runs = conv.from_json(_load(name))
        seeds = sum(r.density == 1.0 for r in runs)
        return f"Mean over {seeds} seeds (`benchmarks/results/{name}`):\n\n" + conv.table(runs)
    render.__doc__ = f"The table of ``{name}`` (``convergence.py``)."
    return render


def cluster_tables(name: str, heading: str) -> Callable[[], str]:
    """The renderer of one ``cluster_compare.py`` result's tables, through that script's own ``sections``; its
    layouts and rates get ``heading``."""
    def render() -> str:
        data = _load(name)
        if isinstance(data.get("rows"), dict) and "command" in data:  # written through _results.write_results
            data = data["rows"]
        tables = _module("benchmarks/cluster_compare.py").sections(data, heading)
        return f"From `benchmarks/results/{name}`:\n\n{tables.rstrip()}"
    render.__doc__ = f"The tables of ``{name}`` (``cluster_compare.py``)."
    return render


def local_accuracy_table(name: str) -> Callable[[], str]:
    """The renderer of one ``local_accuracy.py`` result: its header line and that script's own table."""
    def render() -> str:
        d = _load(name)
        return f"{d['header']} (`benchmarks/results/{name}`)\n\n" + _module("benchmarks/local_accuracy.py").table(
            d["results"])
    render.__doc__ = f"The table of ``{name}`` (``local_accuracy.py``)."
    return render


def scale_sim_tables() -> str:
    """The first model's wire bytes, then each model's exchange time at 10 Gbit/s per node (``scale_sim.py``'s own
    tables, from its JSON)."""
    mod = _module("benchmarks/scale_sim.py")
    lines = []
    for i, (name, s) in enumerate(mod.from_json(_load("scale_sim.json")).items()):
        lines += [f"{name}, {s['params']:,} parameters in {s['buckets']} buckets (`benchmarks/results/scale_sim.json`):",
                  "", *mod.model_tables(s, (10,), wire=i == 0), ""]
    return "\n".join(lines).rstrip()


def local_accuracy_explore() -> str:
    """The one-knob exploration (``local_accuracy.py --variant`` runs): mean final metric per entry and its verdict
    against ddp at the same seeds (the LM's ddp from ``local_accuracy_lm.json``), with ``local_accuracy.py``'s rule."""
    la = _module("benchmarks/local_accuracy.py")
    d = _load("local_accuracy_explore.json")
    ddp_lm = {r["seed"]: r["final"] for r in _load("local_accuracy_lm.json")["results"]["lm"]["ddp"]}
    rows = ["| task | entry | overrides (of the registered defaults) | seeds | final, mean | vs ddp |",
            "|---|---|---|---|---|---|"]
    for task, runs in d["runs"].items():
        for name, r in runs.items():
            mean = sum(r["final"]) / len(r["final"])
            ref = (sum(ddp_lm[s] for s in r["seeds"]) / len(r["seeds"]) if task == "lm"
                   else sum(runs["ddp"]["final"]) / len(runs["ddp"]["final"]))
            over = ", ".join(f"`{o.removeprefix('strategy.')}`" for o in r["overrides"]) or "–"
            vs = "" if name == "ddp" else la.verdict(task, mean, ref)
            rows.append(f"| {task} | {name} | {over} | {', '.join(map(str, r['seeds']))} | {mean:.4f} | {vs} |")
    return f"{d['header']} (`benchmarks/results/local_accuracy_explore.json`):\n\n" + "\n".join(rows)


def _met(ok: bool, why_not: str = "") -> str:
    return "yes" if ok else f"**no**{why_not}"


def _summary_rows() -> List[Tuple[str, str, str, str, str]]:
    """(claim, target, measured, met?, results file) per row of the summary, each from its section's data."""
    rows = []
    sel = {(r["n"], r["density"]): r for r in _load("select.json")["rows"] if r.get("table") == "select"}
    big = [sel[(25_000_000, rho)] for rho in (0.01, 0.001)]
    for algo in ("exact", "mstopk"):
        x = [r["torch_topk_s"] / r[f"topk_select {algo} s"] for r in big]
        rows.append((f"`{algo}` top-k vs `torch.topk`, 25M fp32, ρ = 0.01 and 0.001", "≥ 10x",
                     f"{x[0]:.1f}x and {x[1]:.1f}x", _met(min(x) >= 10), "select.json"))
    for label, key in (("`mstopk`", "topk_select mstopk l2_share"), ("sync-free `mstopk`", "sync-free mstopk l2_share")):
        share = [r[key] for r in big]
        rows.append((f"{label} share of the exact top-k's L2 mass, 25M", "≥ 99%",
                     f"{100 * share[0]:.3f}% (ρ = 0.01), {100 * share[1]:.3f}% (ρ = 0.001)", _met(min(share) >= 0.99),
                     "select.json"))
    h = _load("hier_bytes.json")
    rows.append((f"hierarchical vs flat inter-node bytes, {h['nodes']} nodes × {h['local']}",
                 f"about L = {h['local']}x fewer", f"{h['flat_over_hierarchical']:.2f}x (telemetry)",
                 _met(abs(h["flat_over_hierarchical"] - h["local"]) <= 0.1 * h["local"]), "hier_bytes.json"))
    lars = {r["family"]: r["speedup_vs_loop"] for r in _load("optim.json")["rows"]
            if r["family"] in ("lars", "lars16") and r["speedup_vs_loop"] != 1.0}
    rows.append(("fused LARS vs per-parameter (timm-style) loop, ResNet-50 shapes", "≥ 3x",
                 f"{lars['lars']:.2f}x (fp32), {lars['lars16']:.2f}x (fp16 params)",
                 _met(min(lars.values()) >= 3, ": see the optimizer section"), "optim.json"))
    rates = {r["pipeline"]: r["samples_per_s"] for r in _load("data.json")["rows"]}
    for label, pipe, want in (("RAM cache (decoded)", "WebDataModule, RAM decoded", 3),
                              ("device cache level (run on CPU)", "WebDataModule, device level (CPU)", 5)):
        r = rates[pipe]
        x = sum(r[1:]) / max(len(r) - 1, 1) / r[0]
        rows.append((f"{label}, epochs 2+ vs its cold epoch", f"≥ {want}x", f"{x:.0f}x", _met(x >= want), "data.json"))
    data = _load(CLUSTER_DEFAULTS)
    slow = [data[f"{lay} 100mbit"] for lay in ("4x1", "2x2")]

    def both(f: Callable[[Dict[str, Any]], float], fmt: str, unit: str = "x") -> Tuple[List[float], str]:
        v = [f(e) for e in slow]
        return v, " / ".join(format(x, fmt) + unit for x in v) + " (4x1 / 2x2)"

    def sps(e: Dict[str, Any], name: str) -> float:
        return float(e["topk_0.01"]["samples_per_s"] / e[name]["samples_per_s"])

    v, text = both(lambda e: sps(e, "ddp_fp16"), ".1f")
    rows.append(("`topk_ddp` ρ = 0.01 at its defaults vs `ddp_fp16` at 100 Mbit/s, samples/s", "≥ 5x", text,
                 _met(min(v) >= 5), CLUSTER_DEFAULTS))
    v, text = both(lambda e: sps(e, "ddp_powersgd"), ".2f")
    tt, tt_text = both(lambda e: e["ddp_powersgd"]["time_to_target_s"] / e["topk_0.01"]["time_to_target_s"], ".1f")
    rows.append(("`topk_ddp` ρ = 0.01 vs PowerSGD at 100 Mbit/s, samples/s", "≥ 1.5x",
                 f"{text}; to the target accuracy {tt_text} faster", _met(min(v) >= 1.5, " in samples/s")
                 + ("; yes in time to target" if min(v) < 1.5 and min(tt) >= 1.5 else ""), CLUSTER_DEFAULTS))
    v, text = both(_share_of_bound, "d", "%")
    sel_ms = [1e3 * e["topk_0.01"]["telemetry_mean"]["select_time_s"] for e in slow]
    step_ms = [1e3 * e["topk_0.01"]["step_time_s"] for e in slow]
    rows.append(("`topk_ddp` ρ = 0.01 vs the no-communication bound at 100 Mbit/s", "≥ 85%",
                 f"{text}; selection {min(sel_ms):.0f}-{max(sel_ms):.0f} ms of a "
                 f"{min(step_ms):.0f}-{max(step_ms):.0f} ms step", _met(min(v) >= 85, ": see the cluster section"),
                 CLUSTER_DEFAULTS))
    conv = _module("benchmarks/convergence.py")
    runs: Dict[Tuple[float, str], List[Any]] = {}
    for r in conv.from_json(_load(CONVERGENCE)):
        runs.setdefault((r.density, r.recipe), []).append(r)
    dense = runs[(1.0, "dense")]
    for rho, want in ((0.01, 1.1), (0.001, 1.25)):
        x = [conv.mean_steps_to(runs[(rho, "auto")], t) / conv.mean_steps_to(dense, t) for t in (0.8, 0.9)]
        rows.append((f"steps to 80% / 90% on MNIST-5k, sparse / dense, SGD momentum + `recipe=\"auto\"`, ρ = {rho:g} "
                     f"({len(dense)} seeds)", f"≤ {want:g}x", f"{x[0]:.2f}x / {x[1]:.2f}x", _met(x[1] <= want),
                     CONVERGENCE))
    mem = {r["params"]: r["above_ddp_bytes_per_param"] for r in _load("memory.json")["rows"] if r["config"] == "topk"}
    rows.append(("peak host memory of `topk_ddp` above plain `ddp`, CPU, 2 ranks", "≤ 6 B/param",
                 ", ".join(f"{b:.1f} B/param ({n / 1e6:.0f}M)" for n, b in sorted(mem.items())),
                 _met(max(mem.values()) <= 6, ": see the memory section"), "memory.json"))
    fm = {r["config"]: r for r in _load("fsdp_memory.json")["rows"]}
    ratio = fm["topk_fsdp"]["ratio_to_topk_ddp"]
    rows.append(("state per rank of `topk_fsdp` against `topk_ddp`, AdamW Transformer, 2 x 2", "≤ 0.6",
                 f"{ratio:.3f}", _met(ratio <= 0.6), "fsdp_memory.json"))
    fa = {r["config"]: r["val_ratio_to_hsdp"] for r in _load("fsdp_accuracy.json")["rows"]}
    best = {r["config"]: r for r in _load(ADAM_PRESET)["rows"]}[ADAM_BEST]
    rows.append(("held-out loss at equal tokens against dense HSDP, byte-level LM, 2 x 2", "≤ 1.03x",
                 f"`topk_fsdp` ρ 0.01: {fa['topk_fsdp']:.3f}x (`topk_ddp`: {fa['topk_ddp']:.3f}x); per step with the "
                 f"preset's AdamW recipe ({best['dense_steps']} dense steps, frozen v, beta1 "
                 f"{best['beta1_after_freeze']:g} after them, top-k of the update, one top-k per shard) "
                 f"**{best['val_ratio_to_hsdp']:.3f}x**; local SGD with the preset's LM recipe "
                 f"**{fa['topk_fsdp_local_lm']:.3f}x** (the registered `topk_fsdp_local` defaults "
                 f"{fa['topk_fsdp_local']:.3f}x)",
                 _met(max(best["val_ratio_to_hsdp"], fa["topk_fsdp_local_lm"]) <= 1.03,
                      ": see the section"),
                 f"fsdp_accuracy.json, {ADAM_PRESET}"))
    first = [_topk_first(data[f"{lay} {rate}"]) for lay, rate in CLUSTER_ORDER]
    first_slow = [_topk_first(e) for e in slow]
    rows.append(("fastest to the target accuracy at 100 Mbit/s", "topk first",
                 f"`topk_ddp` at its defaults first in {sum(first_slow)} of {len(slow)} at 100 Mbit/s "
                 f"({sum(first)} of {len(first)} with 1 Gbit/s)", _met(all(first_slow)), CLUSTER_DEFAULTS))
    return rows


FSDP_LABELS = {"topk_ddp": "`topk_ddp` ρ 0.01", "hsdp": "dense HSDP (torch)", "topk_fsdp": "`topk_fsdp` ρ 0.01",
               "topk_local": "`topk_local` (DDP local SGD)", "topk_fsdp_local": "`topk_fsdp_local` (preset)",
               "topk_fsdp_warmup": "`topk_fsdp` ρ 0.01, `warmup_steps=100`",
               "topk_fsdp_local_lm": "`topk_fsdp_local`, the LM recipe (160 dense steps, H 4, outer density 1)",
               "topk_fsdp_update": "top-k of the AdamW update, not the gradient (`local_steps=1`, outer density 0.01, "
                                   "fp32; `fsdp_accuracy_update.json`)",
               "topk_fsdp_dense": "`topk_fsdp` ρ 0.01, `dense_steps={d}`",
               "topk_fsdp_frozen": "`topk_fsdp` ρ 0.01, `dense_steps={d}`, AdamW's v frozen at step {d}",
               "topk_fsdp_update_dense": "top-k of the AdamW update (`local_steps=1`), `dense_steps={d}`",
               "topk_fsdp_update_frozen": "top-k of the AdamW update (`local_steps=1`), `dense_steps={d}`, v frozen at "
                                          "step {d}",
               "hsdp_frozen": "dense HSDP, AdamW's v frozen at step {d} (the optimizer alone)",
               "topk_ddp_update_frozen": "`topk_ddp`, top-k of the AdamW update (`local_steps=1`), `dense_steps={d}`, v "
                                         "frozen at step {d}"}
ADAM = "fsdp_accuracy_adam.json"  # issue 33's AdamW variants (bench_fsdp.py's *_dense, *_frozen configs)
# the same configs at other --dense-steps or --outer-chunk
ADAM_FILES = [ADAM, "fsdp_accuracy_adam_dense160.json", "fsdp_accuracy_adam_chunk0.json",
              "fsdp_accuracy_adam_beta1.json", "fsdp_accuracy_adam_beta1_ddp.json", "fsdp_accuracy_adam_beta1_grad.json",
              "fsdp_accuracy_adam_beta1_dense50.json", "fsdp_accuracy_adam_beta1_grad03.json"]
ADAM_BEST = "topk_fsdp_update_frozen"  # the transformer_lm_fsdp preset's per-step recipe ...
ADAM_PRESET = "fsdp_accuracy_adam_beta1.json"  # ... at the preset's outer_chunk (0) and beta1_after_freeze (0.5)


def _adam_rows() -> List[Dict[str, Any]]:
    """The AdamW variants' rows (not their HSDP reference), each with the name of its results file."""
    return [dict(r, file=f) for f in ADAM_FILES for r in _load(f)["rows"] if r["config"] != "hsdp"]


def fsdp_adam_table() -> str:
    """docs/convergence.md, "AdamW per step on the LM": the per-step variants against dense HSDP (issue 33)."""
    base = {r["config"]: dict(r, file="fsdp_accuracy.json") for r in _load("fsdp_accuracy.json")["rows"]}
    upd = [dict(r, file="fsdp_accuracy_update.json") for r in _load("fsdp_accuracy_update.json")["rows"]
           if r["config"] != "hsdp"]
    rows = [base["topk_fsdp"], base["topk_ddp"], base["topk_fsdp_warmup"], *upd, *_adam_rows()]
    lines = ["| variant | held-out loss | / HSDP | results |", "|---|---:|---:|---|"]
    lines += [f"| {_fsdp_label(r)} | {r['val_loss']:.4f} | {r['val_ratio_to_hsdp']:.3f} | `{r['file']}` |" for r in rows]
    return "\n".join(lines)


def _fsdp_label(r: Dict[str, Any]) -> str:
    d = r.get("dense_steps", (r.get("cross_node") or {}).get("dense_steps", ""))
    if r["config"] == "hsdp_frozen":
        d = r.get("freeze_variance_after", r.get("optimizer", "").split("=")[-1].rstrip(")"))
    label = FSDP_LABELS.get(r["config"], r["config"]).format(d=d)
    if r.get("beta1_after_freeze") is not None:
        label += f", AdamW's beta1 {r['beta1_after_freeze']:g} after step {d} (`beta1_after_freeze`)"
    if "outer_chunk" in r:
        whole = " (one top-k of each rank's shard)" if r["outer_chunk"] == 0 else ""
        label += f", `outer_chunk={r['outer_chunk']}`{whole}"
    if r.get("file") == ADAM_PRESET and r["config"] == ADAM_BEST:
        label = f"**{label}** (the `transformer_lm_fsdp` preset)"
    return label


def fsdp_tables() -> str:
    """Sharded models (issue 33): state per rank (fsdp_memory.json) and loss at equal tokens with the cross-node bytes
    per step (fsdp_accuracy.json), 2 nodes x 2 processes."""
    mem, acc = _load("fsdp_memory.json"), _load("fsdp_accuracy.json")
    mb = 1e6
    r0 = mem["rows"][0]
    lines = [f"State per rank, TransformerLM d_model {r0['d_model']}, {r0['layers']} layers, "
             f"{r0['params'] / 1e6:.2f}M parameters, AdamW, fp32 ({mem['date'][:10]}, `{mem['command']}`):", "",
             "| config | params | grads | AdamW state | residuals | outer state | total MB | B/param | / `topk_ddp` |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mem["rows"]:
        m = r["per_rank_mean"]
        lines.append(f"| {FSDP_LABELS.get(r['config'], r['config'])} | {m['param_bytes'] / mb:.2f} | "
                     f"{m['grad_bytes'] / mb:.2f} | {m['optim_bytes'] / mb:.2f} | {m['residual_bytes'] / mb:.2f} | "
                     f"{m['outer_bytes'] / mb:.2f} | {m['total_bytes'] / mb:.2f} | {m['total_bytes'] / r['params']:.1f} | "
                     f"{r['ratio_to_topk_ddp']:.3f} |")
    a0 = acc["rows"][0]
    lines += ["", f"Loss at equal tokens ({a0['steps']} steps, {a0['tokens']:,} tokens, d_model {a0['d_model']}, "
              f"{a0['layers']} layers, the shipped byte-level text; {acc['date'][:10]}, `{acc['command']}`), and the "
              "cross-node bytes per rank per step:", "",
              "| config | held-out loss | / HSDP | cross-node wire bytes per step per rank | source |", "|---|---:|---:|---:|---|"]
    extra = [r for r in _load("fsdp_accuracy_update.json")["rows"] if r["config"] != "hsdp"] + _adam_rows()
    for r in acc["rows"] + extra:
        x = r.get("cross_node") or {}
        b = x.get("bytes_wire_per_step", x.get("bytes_inter_per_step"))
        src = x.get("source", "")
        if "amortized_bytes_per_step_computed" in x:
            src += (f"; {x['amortized_bytes_per_step_computed']:,.0f} per step over the run with the "
                    f"{x['dense_steps']} dense steps (computed)")
        where = f" (`{r['file']}`)" if "file" in r else ""
        lines.append(f"| {_fsdp_label(r)}{where} | {r['val_loss']:.4f} | {r['val_ratio_to_hsdp']:.3f} | "
                     f"{'' if b is None else f'{b:,.0f}'} | {src} |")
    return "\n".join(lines)


def summary() -> str:
    """BENCHMARKS.md's summary against the issues' targets, each row from the results its section renders."""
    lines = ["| claim | target | measured | met? | from `benchmarks/results/` |", "|---|---|---|---|---|"]
    lines += [f"| {c} | {t} | {m} | {ok} | `{src}` |" for c, t, m, ok, src in _summary_rows()]
    return "\n".join(lines)


# name: (the file the block is in, the data it is rendered from, the renderer)
def ft_table(name: str) -> Callable[[], str]:
    """The renderer of one ``ft_goodput.py`` result (goodput under preemption, or accuracy with a replica killed and
    healed): its header line and that script's own table."""
    def render() -> str:
        d = _load(name)
        mod = _module("benchmarks/ft_goodput.py")
        table = mod.goodput_table(d) if "results" in d["rows"] else mod.accuracy_table(d)
        return f"{mod.header(d)} (`benchmarks/results/{name}`)\n\n{table}"
    render.__doc__ = f"The table of ``{name}`` (``ft_goodput.py``)."
    return render


BLOCKS: Dict[str, Tuple[str, str, Callable[[], str]]] = {
    "summary": ("BENCHMARKS.md", "benchmarks/results/{select,hier_bytes,optim,data,memory,cluster_defaults_2026-11-27,"
                "convergence_sgd_nesterov,fsdp_memory,fsdp_accuracy,fsdp_accuracy_adam}.json", summary),
    "cluster-defaults": ("BENCHMARKS.md", "benchmarks/results/cluster_defaults_2026-11-27.json", cluster_defaults),
    "clean-exit": ("BENCHMARKS.md", "benchmarks/results/clean_exit_*.json", clean_exit),
    "adamw-cnn": ("BENCHMARKS.md", "benchmarks/results/adamw_cnn.json", adamw_cnn),
    "adamw-lm-constant": ("BENCHMARKS.md", "benchmarks/results/convergence_adamw_lm_constant.json",
                          convergence_table("convergence_adamw_lm_constant.json")),
    "adamw-lm-warmup-cosine": ("BENCHMARKS.md", "benchmarks/results/convergence_adamw_lm_warmup_cosine.json",
                               convergence_table("convergence_adamw_lm_warmup_cosine.json")),
    "outer-recipe": ("BENCHMARKS.md", "benchmarks/results/outer_recipe_lightning.json", outer_recipe),
    "hier-bytes": ("BENCHMARKS.md", "benchmarks/results/hier_bytes.json", hier_bytes),
    "outer-exchange-bytes": ("BENCHMARKS.md", "benchmarks/results/outer_packet_bytes.json", outer_exchange_bytes),
    "outer-bytes-per-param": ("docs/local_sgd.md", "benchmarks/results/outer_packet_bytes.json",
                              outer_bytes_per_param),
    "outer-recipe-table": ("docs/local_sgd.md", "benchmarks/results/outer_recipe_digits.json", outer_recipe_table),
    "local-accuracy-explore": ("BENCHMARKS.md", "benchmarks/results/local_accuracy_{explore,lm}.json",
                               local_accuracy_explore),
    "scale-sim": ("BENCHMARKS.md", "benchmarks/results/scale_sim.json", scale_sim_tables),
    "convergence": ("BENCHMARKS.md", f"benchmarks/results/{CONVERGENCE}", convergence_table(CONVERGENCE)),
    "convergence-lookahead": ("BENCHMARKS.md", "benchmarks/results/convergence_sgd_lookahead.json",
                              convergence_table("convergence_sgd_lookahead.json")),
    "convergence-before": ("BENCHMARKS.md", "benchmarks/results/convergence_sgd_auto.json",
                           convergence_table("convergence_sgd_auto.json")),
    "select": ("BENCHMARKS.md", "benchmarks/results/select.json", select),
    "memory": ("BENCHMARKS.md", "benchmarks/results/memory.json", memory),
    "optim": ("BENCHMARKS.md", "benchmarks/results/optim.json", optim_step),
    "data": ("BENCHMARKS.md", "benchmarks/results/data.json", data_pipeline),
    "elastic-local-accuracy": ("BENCHMARKS.md", "benchmarks/results/elastic_local_accuracy.json",
                               elastic_local_accuracy),
    "elastic-local-accuracy-r3": ("BENCHMARKS.md", "benchmarks/results/elastic_local_accuracy_r3.json",
                                  lambda: elastic_local_accuracy("elastic_local_accuracy_r3.json")),
    "fsdp": ("BENCHMARKS.md", "benchmarks/results/fsdp_{memory,accuracy,accuracy_update,accuracy_adam*}.json",
             fsdp_tables),
    "frontier": ("BENCHMARKS.md", "benchmarks/results/frontier_*.json", lambda: frontier_tables()),
    "frontier-summary": ("docs/modes.md", "benchmarks/results/frontier_*.json", lambda: frontier_summary()),
    "fsdp-adam": ("docs/convergence.md", "benchmarks/results/fsdp_accuracy{,_update,_adam*}.json", fsdp_adam_table),
}

# the runs rendered through their benchmark script's own table, named after their results file: cluster_compare.py's
# sections (at the heading level of their place in BENCHMARKS.md) and local_accuracy.py's table
CLUSTER_RUNS = [("cluster", "###"), ("cluster_1gbit_2026-11-25", "####"), ("cluster_local_2026-11-25_100mbit", "####"),
                ("cluster_local_2026-11-25_10mbit", "####"), ("cluster_local_compare", "####"),
                ("cluster_local_2026-11-27_100mbit_rounds", "####"), ("cluster_local_2026-11-27_2x2_100mbit", "####"),
                ("cluster_local_2026-11-27_2x2_ceiling", "####"), ("cluster_local_2026-11-27_outer_exchange", "####"),
                ("cluster_local_2026-11-27_wan_outer_exchange", "####"), ("cluster_local_2026-11-27_wan_owner4bit", "####"),
                ("cluster_fsdp_2026-11-27_100mbit", "####"), ("cluster_fsdp_2026-11-27_1gbit", "####"),
                ("cluster_fsdp_2026-11-27_100mbit_long", "####"), ("cluster_fsdp_2026-11-27_flat_100mbit", "####"),
                ("cluster_fsdp_2026-11-28_100mbit_adamw", "####"), ("cluster_fsdp_2026-11-28_100mbit_adamw_b09", "####"),
                ("cluster_fsdp_2026-11-28_100mbit_hsdp_frozen", "####"), ("cluster_defaults_2026-11-28_10mbit", "####")]
LOCAL_ACCURACY_RUNS = ["local_accuracy", "local_accuracy_lm", "local_accuracy_lm_seed2", "local_accuracy_lm_variants",
                       "local_accuracy_sparseloco", "local_accuracy_lm_outer_exchange", *(f"local_accuracy_outer_exchange_{tag}" for tag in (
                           "owner1x", "owner2x", "owner4x", "issue21", "issue21_factors", "issue21_wan_owner4x_xp",
                           "issue21_wan_owner4bit_xp", "issue21_wan_owner4bit"))]
for _name, _heading in CLUSTER_RUNS:
    BLOCKS[_name.replace("_", "-")] = ("BENCHMARKS.md", f"benchmarks/results/{_name}.json",
                                       cluster_tables(f"{_name}.json", _heading))
FT_RUNS = ["ft_goodput_2026-11-27", "ft_goodput_2026-11-27_repeat", "ft_goodput_2026-11-27_join5s",
           "ft_accuracy_digits_2026-11-27", "ft_accuracy_mnist_2026-11-27", "ft_accuracy_mnist_local_2026-11-27",
           "ft_accuracy_mnist_600_2026-11-27",
           "ft_accuracy_mnist_600_2026-11-27_seeds345"]
for _name in FT_RUNS:
    BLOCKS[_name.replace("_", "-")] = ("BENCHMARKS.md", f"benchmarks/results/{_name}.json", ft_table(f"{_name}.json"))
BLOCKS["support-matrix"] = ("docs/compatibility.md", "lightning_topk/support.py and tests/matrix/cells.py",
                             lambda: str(_module("tools/render_support.py").markdown()))
for _name in LOCAL_ACCURACY_RUNS:
    BLOCKS[_name.replace("_", "-")] = ("BENCHMARKS.md", f"benchmarks/results/{_name}.json",
                                       local_accuracy_table(f"{_name}.json"))


def begin(name: str) -> str:
    return f"<!-- results:{name}:begin (written by tools/render_results.py from {BLOCKS[name][1]}; do not edit) -->"


def end(name: str) -> str:
    return f"<!-- results:{name}:end -->"


def block(name: str) -> str:
    return f"{begin(name)}\n{BLOCKS[name][2]()}\n{end(name)}"


def _module(rel: str) -> Any:
    """The repository's script ``rel`` (e.g. ``tools/main_job_figures.py``) as a module, to reuse its functions."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # they import lightning_topk
    name = "_repo_" + os.path.splitext(rel)[0].replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    assert spec is not None and spec.loader is not None
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)  # registered first, as dataclasses need
    spec.loader.exec_module(mod)
    return mod


def render_readme(text: str) -> str:
    """README.md's ``text`` with its default-job block rendered from docs/main_job.json."""
    tool = _module("tools/main_job_figures.py")  # it runs the default job; its rendering serves both
    with open(MAIN_JOB, encoding="utf-8") as f:
        record = json.load(f)
    return str(text.replace(tool.readme_block(text), tool.block(record)))


# ---- plots: each from the data its function returns; docs/plots.json holds a hash of that data ----------------
def _runs_mean(runs: List[Dict[str, Any]], x: str, y: str) -> List[List[float]]:
    """(mean x, mean y) per evaluation over the seeds of one entry (the evaluations every seed reached)."""
    n = min(len(r["rows"]) for r in runs)
    return [[round(sum(r["rows"][i][x] for r in runs) / len(runs), 6), round(sum(r["rows"][i][y] for r in runs)
             / len(runs), 6)] for i in range(n)]


def _accuracy_over_time(name: str) -> Dict[str, Any]:
    """Test accuracy against training time per entry of a ``cluster_compare.py`` result, per layout and rate, with
    the target (entries that failed have no evaluations and are left out)."""
    data = _load(name)
    panels: Dict[str, Dict[str, List[List[float]]]] = {}
    targets = set()
    for key in sorted(data):
        for entry in sorted(data[key]):
            e = data[key][entry]
            if e.get("target_acc") is not None:
                targets.add(e["target_acc"])
            if e.get("evals"):
                panels.setdefault(key, {})[entry] = [[round(v["time"], 4), v["acc"]] for v in e["evals"]]
    if len(targets) > 1:
        raise SystemExit(f"render_results: {name} has several targets {sorted(targets)}")
    return {"source": f"benchmarks/results/{name}", "target": targets.pop() if targets else None, "panels": panels}


def time_to_accuracy_data() -> Dict[str, Any]:
    """``cluster_compare.py`` at the defaults: 4x1 and 2x2 at 1 Gbit/s and 100 Mbit/s."""
    return _accuracy_over_time("cluster_defaults_2026-11-27.json")


def time_to_accuracy_local_data() -> Dict[str, Any]:
    """``cluster_compare.py`` with the local-SGD entries: 4x1 at 100 and 10 Mbit/s."""
    return _accuracy_over_time("cluster_local_compare.json")


def draw_time_to_accuracy(d: Dict[str, Any], ax_grid: Any) -> None:
    rate = {"1gbit": 0, "100mbit": 1, "10mbit": 2}
    keys = sorted(d["panels"], key=lambda k: (rate.get(k.split()[1], 3), k.split()[0]))
    names = sorted({n for p in d["panels"].values() for n in p})  # one colour per entry in every panel
    for ax, key in zip(ax_grid.flat, keys):
        for name, pts in sorted(d["panels"][key].items()):
            ax.plot(*zip(*pts), marker="o", ms=3, label=name, color=f"C{names.index(name) % 10}")
        if d["target"] is not None:
            ax.axhline(d["target"], color="grey", ls="--", lw=0.8, label=f"target {d['target']:g}")
        ax.set_title(key)
        ax.set_xlabel("training time, s")
        ax.set_ylabel("test accuracy")
        ax.grid(True, lw=0.3)
        ax.legend(fontsize=7)


def _wire_bytes(key: str, x: str, min_nodes: int) -> Dict[str, Dict[str, List[List[float]]]]:
    """Modelled bytes per step (``key``: ``bytes_rank`` or ``bytes_node``) against ``x`` (``P`` or ``nodes``) per
    model and exchange, the layouts of ``min_nodes`` nodes or more (``scale_sim.json``)."""
    d = _load("scale_sim.json")
    out: Dict[str, Dict[str, List[List[float]]]] = {}
    for r in sorted(d["rows"], key=lambda r: (r["model"], r["P"])):
        if r["nodes"] < min_nodes:
            continue
        for meth, b in sorted(r[key].items()):
            if b is not None and b > 0:
                out.setdefault(r["model"], {}).setdefault(meth, []).append([r[x], round(b)])
    return out


def bytes_per_step_data() -> Dict[str, Any]:
    """Modelled bytes per step one node puts on its inter-node link against the node count (``scale_sim.py``,
    8 ranks per node, from 2 nodes)."""
    return {"source": "benchmarks/results/scale_sim.json", "xlabel": "nodes (8 ranks each)",
            "ylabel": "MB per step on one node's inter-node link", "models": _wire_bytes("bytes_node", "nodes", 2)}


def scale_sim_data() -> Dict[str, Any]:
    """Modelled wire bytes per step per rank (any link) and per node (inter-node link) against the rank count,
    every layout (``scale_sim.py``; the plot its section of BENCHMARKS.md shows, which it no longer draws itself)."""
    panels: Dict[str, Dict[str, List[List[float]]]] = {}
    for key, label in (("bytes_rank", "per rank, any link"), ("bytes_node", "per node, inter-node link")):
        for model, lines in _wire_bytes(key, "P", 1).items():
            panels[f"{model}: {label}"] = lines
    return {"source": "benchmarks/results/scale_sim.json", "xlabel": "ranks P (8 per node)", "ylabel": "MB per step",
            "models": panels}


def draw_bytes_per_step(d: Dict[str, Any], ax_grid: Any) -> None:
    """One panel per entry of ``d["models"]`` (in name order, row by row): MB per step of each exchange, log-log."""
    for ax, model in zip(ax_grid.flat, sorted(d["models"])):
        for meth, pts in sorted(d["models"][model].items()):
            ax.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], marker="o", ms=3, label=meth)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(d["xlabel"])
        ax.set_ylabel(d["ylabel"])
        ax.set_title(f"{model} (cost model, density 0.01)")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)


def cluster_data() -> Dict[str, Any]:
    """``cluster_compare.py`` with every entry (2026-11-23): 2x2 and 4x1 at 1 Gbit/s and 100 Mbit/s."""
    return _accuracy_over_time("cluster.json")


def loss_curves_data() -> Dict[str, Any]:
    """Held-out loss against training time and against tokens per entry, mean over seeds (``local_accuracy.py
    --task lm``)."""
    d = _load("local_accuracy_lm.json")
    runs = sorted(d["results"]["lm"].items())
    panels = [{"xlabel": xlabel, "scale": scale, "curves": {name: _runs_mean(r, x, "val/loss") for name, r in runs}}
              for x, xlabel, scale in (("train_s", "training time, s (4 processes on one 2-core machine)", 1.0),
                                       ("tokens", "tokens seen, millions", 1e6))]
    return {"source": "benchmarks/results/local_accuracy_lm.json", "header": d["header"].split(";")[0],
            "panels": panels}


def draw_loss_curves(d: Dict[str, Any], ax_grid: Any) -> None:
    """One panel per entry of ``d["panels"]``: held-out loss of each entry against that panel's x."""
    for ax, panel in zip(ax_grid.flat, d["panels"]):
        for name, pts in sorted(panel["curves"].items()):
            ax.plot([p[0] / panel["scale"] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel("held-out loss, nats/byte (mean over seeds)")
        ax.set_title(f"byte-level LM, {d['header']}", fontsize=8, wrap=True)
        ax.grid(True, lw=0.3)
        ax.legend(fontsize=7)


FRONTIER_CELLS = [("2x2", "100mbit"), ("2x2", "10mbit"), ("2x2", "1gbit"), ("4x1", "100mbit")]


def _frontier_files() -> List[str]:
    """``benchmarks/frontier.py``'s results, by date, then in the issue's order of cells."""
    order = {f"{lay}_{rate}": i for i, (lay, rate) in enumerate(FRONTIER_CELLS)}
    names = [os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "frontier_*.json"))]
    return sorted(names, key=lambda n: (n.split("_")[1], order.get("_".join(n[:-5].split("_")[2:]), 99), n))


def frontier_tables() -> str:
    """Every ``frontier.py`` cell through that script's own table (ranking and ratios against dense)."""
    mod = _module("benchmarks/frontier.py")
    parts = [mod.render({"meta": d["meta"], "rows": d["rows"]}) + f"\nFrom `benchmarks/results/{n}`."
             for n, d in ((n, _load(n)) for n in _frontier_files())]
    return "\n\n".join(parts) if parts else "(no `frontier.py` result yet)"


def frontier_summary() -> str:
    """docs/modes.md's opening tables: each entry's time to the target and bytes per rank per step in every cell, and
    what the defaults (``mode="auto"``) chose there; the longer runs (``--tag long``) first, then the first cells."""
    parts = []
    for tag, title in (("long", "**Past the plateau** (120 steps, warm-up + cosine lr; `--tag long`)"),
                       ("", "**The first cells** (on the byte-unigram plateau; 100 s budget)")):
        suffix = f"_{tag}.json" if tag else ".json"
        cells = [(f"{lay} {rate}", _load(n)) for n in _frontier_files()
                 for lay, rate in FRONTIER_CELLS if n.endswith(f"_{lay}_{rate}{suffix}")]
        if cells:
            parts.append(title + ":\n\n" + _frontier_summary_table(cells))
    return "\n\n".join(parts) if parts else "(no `frontier.py` result yet)"


def _frontier_summary_table(cells: List[Tuple[str, Dict[str, Any]]]) -> str:
    names = [e for e in _module("benchmarks/frontier.py").ORDER if any(e in d["rows"] for _, d in cells)]
    head = "| entry | " + " | ".join(f"{c} s to {d['meta']['target_loss']} / MB per rank per step" for c, d in cells)
    lines = [head + " |", "|---|" + "---|" * len(cells)]
    for e in names:
        row = []
        for _, d in cells:
            r = d["rows"].get(e)
            if r is None or "error" in r:
                row.append("–" if r is None else "failed")
                continue
            t, b = r.get("time_to_target_s"), r.get("bytes_per_rank_per_step")
            row.append(f"{'not reached' if t is None else f'{t:.0f}'} / {'–' if b is None else f'{b / 1e6:.3f}'}")
        lines.append(f"| {e} | " + " | ".join(row) + " |")
    chosen = []
    for c, d in cells:
        m = (d["rows"].get("defaults") or {}).get("mode")
        if m:
            chosen.append(f"{c}: {m['mode']}" + (f" ({m['preset']})" if m.get("preset") else ""))
    if chosen:
        lines += ["", "What `mode=\"auto\"` (the defaults) chose: " + "; ".join(chosen) + "."]
    commits = sorted({d["meta"].get(k) or "?" for _, d in cells for k in ("commit", "rerun_commit")
                      if k == "commit" or d["meta"].get(k)})
    dates = sorted({d["meta"]["date"] for _, d in cells})
    lines += ["", f"From `benchmarks/results/frontier_*.json` ({', '.join(dates)}, commits "
              f"{', '.join(commits)}); the full tables, with the load and the second target, are in BENCHMARKS.md."]
    return "\n".join(lines)


def frontier_data() -> Dict[str, Any]:
    """Held-out loss against training time and against tokens per entry of each ``frontier.py`` cell (the latest
    date's)."""
    cells: Dict[str, Any] = {}
    for n in _frontier_files():
        d = _load(n)
        m = d["meta"]
        if m.get("tag"):  # a run beside the cell's main one: frontier_runs_data
            continue
        cells[f"{m['layout']} {m['rate']}"] = _frontier_curves(d)
    return {"source": "benchmarks/results/frontier_*.json",
            "cells": [[f"{lay} {rate}", cells.get(f"{lay} {rate}")] for lay, rate in FRONTIER_CELLS]}


def _frontier_curves(d: Dict[str, Any]) -> Dict[str, Any]:
    """One frontier result's held-out loss against time and against tokens, per entry."""
    m = d["meta"]
    return {"target": m["target_loss"], "budget": m["budget_s"],
            "time": {e: [[round(v["time"], 3), round(v["loss"], 5)] for v in r["evals"]]
                     for e, r in d["rows"].items() if r.get("evals")},
            "tokens": {e: [[v["step"] * m["tokens_per_step"], round(v["loss"], 5)] for v in r["evals"]]
                       for e, r in d["rows"].items() if r.get("evals")}}


def frontier_runs_data() -> Dict[str, Any]:
    """The longer frontier runs (``frontier.py --tag long``), one column per cell in the issue's order."""
    runs: Dict[str, Any] = {}
    for n in _frontier_files():
        d = _load(n)
        m = d["meta"]
        if m.get("tag") == "long":
            runs[f"{m['layout']} {m['rate']}"] = [f"{m['layout']} {m['rate']}, {m['tag']} "
                                                  f"({m.get('lr_schedule', 'constant')} lr)", _frontier_curves(d)]
    return {"source": "benchmarks/results/frontier_*_long.json",
            "cells": [runs.get(f"{lay} {rate}", [f"{lay} {rate}, long", None]) for lay, rate in FRONTIER_CELLS]}


def draw_frontier(d: Dict[str, Any], ax_grid: Any) -> None:
    """Top row: held-out loss against training time per cell; bottom row: against tokens (cells that did not run are
    blank)."""
    for col, (cell, c) in enumerate(d["cells"]):
        for row, (key, xlabel, scale) in enumerate((("time", "training time, s", 1.0),
                                                    ("tokens", "tokens, thousands (all processes)", 1e3))):
            ax = ax_grid[row][col]
            if not c:
                ax.set_title(f"{cell}: not run" if cell else "", fontsize=8)
                ax.axis("off")
                continue
            for name, pts in sorted(c[key].items()):
                ax.plot([p[0] / scale for p in pts], [p[1] for p in pts], marker="o", ms=2, lw=1, label=name)
            ax.axhline(c["target"], color="grey", ls="--", lw=0.8)
            if key == "time":
                ax.axvline(c["budget"], color="grey", ls=":", lw=0.8)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("held-out loss, nats/byte", fontsize=8)
            ax.set_title(f"frontier {cell}", fontsize=8)
            ax.grid(True, lw=0.3)
            ax.legend(fontsize=6)


# name: (the data function, the drawing function, subplot grid (rows, columns), figure size in inches)
PLOTS: Dict[str, Tuple[Callable[[], Dict[str, Any]], Callable[[Dict[str, Any], Any], None], Tuple[int, int],
                       Tuple[float, float]]] = {
    "time_to_accuracy": (time_to_accuracy_data, draw_time_to_accuracy, (2, 2), (11.0, 8.0)),
    "time_to_accuracy_local": (time_to_accuracy_local_data, draw_time_to_accuracy, (1, 2), (11.0, 4.5)),
    "cluster": (cluster_data, draw_time_to_accuracy, (2, 2), (11.0, 8.0)),
    "bytes_per_step": (bytes_per_step_data, draw_bytes_per_step, (1, 2), (12.0, 5.0)),
    "scale_sim": (scale_sim_data, draw_bytes_per_step, (2, 2), (12.0, 9.0)),
    "loss_curves": (loss_curves_data, draw_loss_curves, (1, 2), (12.0, 5.0)),
    "frontier": (frontier_data, draw_frontier, (2, 4), (18.0, 8.0)),
    "frontier_runs": (frontier_runs_data, draw_frontier, (2, 4), (18.0, 8.0)),
}


def plot_hash(name: str) -> str:
    """A hash of the plot's data and of the code that draws it: what ``docs/plots.json`` records."""
    data_fn, draw, grid, size = PLOTS[name]
    import inspect

    blob = json.dumps({"data": data_fn(), "draw": inspect.getsource(draw), "grid": grid, "size": size},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def draw_plot(name: str) -> str:
    """Draw ``docs/plots/NAME.png`` (fixed size and dpi, no date in its metadata); return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data_fn, draw, grid, size = PLOTS[name]
    fig, axes = plt.subplots(*grid, figsize=size, squeeze=False)
    draw(data_fn(), axes)
    fig.tight_layout()
    os.makedirs(PLOTS_DIR, exist_ok=True)
    path = os.path.join(PLOTS_DIR, f"{name}.png")
    fig.savefig(path + ".tmp", format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    os.replace(path + ".tmp", path)
    return path


def plots_record() -> Dict[str, Any]:
    return {name: {"png": f"docs/plots/{name}.png", "from": PLOTS[name][0]()["source"],
                   "sha256": plot_hash(name)} for name in PLOTS}


def stale_plots() -> List[str]:
    """The plots whose recorded hash is not their current data's, or whose PNG is missing."""
    try:
        with open(PLOTS_JSON, encoding="utf-8") as f:
            recorded = json.load(f)
    except FileNotFoundError:
        recorded = {}
    now = plots_record()
    return [n for n in PLOTS if recorded.get(n) != now[n] or not os.path.exists(os.path.join(ROOT, now[n]["png"]))]


def files() -> List[str]:
    """The files that hold blocks, relative to the repository root."""
    return ["README.md", *dict.fromkeys(v[0] for v in BLOCKS.values())]


def _path(rel: str) -> str:
    return {"README.md": README, "BENCHMARKS.md": BENCHMARKS}.get(rel, os.path.join(ROOT, rel))


def render(text: str, path: str = "BENCHMARKS.md") -> str:
    """``text`` (the file ``path``) with each of its blocks replaced by its rendering; each must be there once."""
    if path == "README.md":
        return render_readme(text)
    for name in (n for n, v in BLOCKS.items() if v[0] == path):
        pattern = re.escape(f"<!-- results:{name}:begin") + r".*?" + re.escape(end(name))
        found = re.findall(pattern, text, flags=re.S)
        if len(found) != 1:
            raise SystemExit(f"render_results: {path} has {len(found)} '{name}' blocks (needs one)")
        text = text.replace(found[0], block(name))
    return text


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that the files show what the data renders")
    a = ap.parse_args(argv)
    bad = []
    for rel in files():
        path = _path(rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render(text, rel)
        if new == text:
            continue
        bad.append(rel)
        if not a.check:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(new)
            os.replace(path + ".tmp", path)
    stale = stale_plots()
    if a.check:
        bad += [f"docs/plots/{n}.png" for n in stale]
        print("render_results: " + (f"{', '.join(bad)} differ(s) from the recorded results (run tools/render_results.py)"
                                    if bad else f"{', '.join(files())} and {len(PLOTS)} plots match the results"))
        return 1 if bad else 0
    for name in stale:
        draw_plot(name)
    if stale:
        with open(PLOTS_JSON + ".tmp", "w", encoding="utf-8") as f:
            json.dump(plots_record(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(PLOTS_JSON + ".tmp", PLOTS_JSON)
    print(f"render_results: {len(BLOCKS) + 1} blocks in {', '.join(files())}, {len(PLOTS)} plots in docs/plots/; "
          f"rewrote {', '.join(bad + [f'docs/plots/{n}.png' for n in stale]) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
