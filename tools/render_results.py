"""Render BENCHMARKS.md's result tables from the raw results in ``benchmarks/results/``, so no figure in them is
copied by hand.

    .venv/bin/python tools/render_results.py            # rewrite every block (BENCHMARKS.md, docs/local_sgd.md)
    .venv/bin/python tools/render_results.py --check    # exit 1 if a block differs from what its data renders

Each block sits between ``<!-- results:NAME:begin (...) -->`` and ``<!-- results:NAME:end -->`` and is rendered
from the JSON file(s) named in :data:`BLOCKS`. ``tests/app/test_render_results.py`` runs the check. The prose
around the blocks (what was run, why, what it means) stays hand-written; tools/main_job_figures.py does the same
for the README's default-job figures.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any, Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _load(name: str) -> Any:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        return json.load(f)


def cluster_defaults() -> str:
    """Time to the target accuracy per layout and rate: ``cluster_compare.py`` at the defaults."""
    data = _load("cluster_defaults_2026-11-27.json")
    target = None
    rows = ["| layout, rate | `ddp_fp16` | PowerSGD r4 | `topk_ddp` ρ = 0.01, defaults | `local` (bound) "
            "| `topk_ddp` % of bound |", "|---|---|---|---|---|---|"]
    first = 0
    ahead: Dict[str, List[str]] = {}
    order = [(lay, rate) for rate in ("1gbit", "100mbit") for lay in ("4x1", "2x2")]
    for lay, rate in order:
        e = data[f"{lay} {rate}"]
        target = e["topk_0.01"]["target_acc"]

        def cell(name: str, bold: bool = False, e: Dict[str, Any] = e) -> str:
            t, s = e[name]["time_to_target_s"], e[name]["steps_to_target"]
            text = "–" if t is None else f"{t:.1f} ({s})"
            return f"**{text}**" if bold else text

        topk = e["topk_0.01"]["time_to_target_s"]
        others = {n: e[n]["time_to_target_s"] for n in ("ddp_fp16", "ddp_powersgd")}
        reached = {n: t for n, t in others.items() if t is not None}
        is_first = topk is not None and all(topk < t for t in reached.values())
        first += is_first
        if topk is not None and reached:
            ahead.setdefault(rate, []).append(f"{min(reached.values()) / topk:.1f}x")
        bound = round(100 * e["topk_0.01"]["samples_per_s"] / e["local"]["samples_per_s"])
        nice_rate = {"1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}[rate]
        rows.append(f"| {lay}, {nice_rate} | {cell('ddp_fp16')} | {cell('ddp_powersgd')} | "
                    f"{cell('topk_0.01', bold=is_first)} | {e['local']['time_to_target_s']:.1f} | {bound} |")
    head = (f"Time to {100 * (target or 0):.0f}% test accuracy, s (steps to it; evaluations every 8 steps; "
            "from `benchmarks/results/cluster_defaults_2026-11-27.json`):")
    tail = (f"`topk_ddp` at its defaults was first to the target in {first} of {len(order)}; its lead over the "
            f"faster of `ddp_fp16` and PowerSGD (4x1 / 2x2): {' / '.join(ahead.get('1gbit', []))} at 1 Gbit/s, "
            f"{' / '.join(ahead.get('100mbit', []))} at 100 Mbit/s.")
    return "\n".join([head, "", *rows, "", tail])


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


# name: (the file the block is in, the data it is rendered from, the renderer)
BLOCKS: Dict[str, Tuple[str, str, Callable[[], str]]] = {
    "cluster-defaults": ("BENCHMARKS.md", "benchmarks/results/cluster_defaults_2026-11-27.json", cluster_defaults),
    "clean-exit": ("BENCHMARKS.md", "benchmarks/results/clean_exit_*.json", clean_exit),
    "outer-recipe": ("BENCHMARKS.md", "benchmarks/results/outer_recipe_lightning.json", outer_recipe),
    "outer-recipe-table": ("docs/local_sgd.md", "benchmarks/results/outer_recipe_digits.json", outer_recipe_table),
}


def begin(name: str) -> str:
    return f"<!-- results:{name}:begin (written by tools/render_results.py from {BLOCKS[name][1]}; do not edit) -->"


def end(name: str) -> str:
    return f"<!-- results:{name}:end -->"


def block(name: str) -> str:
    return f"{begin(name)}\n{BLOCKS[name][2]()}\n{end(name)}"


def files() -> List[str]:
    """The files that hold blocks, relative to the repository root."""
    return list(dict.fromkeys(v[0] for v in BLOCKS.values()))


def render(text: str, path: str = "BENCHMARKS.md") -> str:
    """``text`` (the file ``path``) with each of its blocks replaced by its rendering; each must be there once."""
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
        path = BENCHMARKS if rel == "BENCHMARKS.md" else os.path.join(ROOT, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render(text, rel)
        if new == text:
            continue
        bad.append(rel)
        if not a.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    if a.check:
        print("render_results: " + (f"{', '.join(bad)} differ(s) from benchmarks/results/ (run tools/render_results.py)"
                                    if bad else f"{', '.join(files())} match benchmarks/results/"))
        return 1 if bad else 0
    print(f"render_results: {len(BLOCKS)} blocks in {', '.join(files())}; rewrote {', '.join(bad) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
