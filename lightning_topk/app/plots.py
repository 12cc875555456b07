"""Side-by-side curves of runs from their Lightning CSV logs: loss, accuracy, bytes per step.

    lightning-topk-plot outputs/run_topk outputs/run_ddp --labels topk_ddp ddp --out compare.png

Each RUN is a ``metrics.csv`` file or a directory searched for them (the newest ``version_*`` wins).
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_topk.files import atomic_write

PANELS = (
    ("train/loss", "training loss"),
    ("val/acc", "validation accuracy"),
    ("topk/bytes_sent", "bytes sent per step (this rank)"),
)


def find_metrics(run: str) -> Path:
    p = Path(run)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"lightning-topk-plot: run {run!r} is neither a metrics.csv file nor a directory")
    found = sorted(p.rglob("metrics.csv"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"lightning-topk-plot: no metrics.csv under {run!r} (is the CSV logger on?)")
    return found[-1]


def read_series(path: Path) -> Dict[str, List[Tuple[float, float]]]:
    """metric name -> [(step, value)] for every non-empty cell of a Lightning CSV log."""
    out: Dict[str, List[Tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, val in row.items():
                if key in ("step", "epoch") or val in (None, ""):
                    continue
                try:
                    v = float(val)
                except ValueError:
                    continue
                if math.isfinite(v):
                    out.setdefault(key, []).append((float(step), v))
    return out


def plot_runs(runs: Sequence[str], labels: Optional[Sequence[str]], out: str) -> str:
    """Draw the panels for all runs into one PNG (written atomically); returns its path."""
    if labels and len(labels) != len(runs):
        raise ValueError(f"lightning-topk-plot: --labels has {len(labels)} names for {len(runs)} runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [read_series(find_metrics(r)) for r in runs]
    names = list(labels) if labels else [Path(r).name or r for r in runs]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes, PANELS):
        for i, (name, s) in enumerate(zip(names, series)):
            pts = s.get(key) or (s.get("train/loss_step") if key == "train/loss" else None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=name, color=colors[i % len(colors)], marker="." if len(xs) < 30 else None)
        dense = next((s["topk/bytes_dense"] for s in series if s.get("topk/bytes_dense")), None)
        if key == "topk/bytes_sent" and dense:
            xs, ys = zip(*dense)  # what a dense all-reduce (plain ddp) would move
            ax.plot(xs, ys, "k--", label="dense all-reduce")
        ax.set_title(title)
        ax.set_xlabel("step")
        if key.startswith("topk/"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_write(out, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="lightning-topk-plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="metrics.csv files or run directories")
    ap.add_argument("--labels", nargs="+", help="one name per run (default: directory names)")
    ap.add_argument("--out", default="compare.png", help="PNG to write (default: compare.png)")
    a = ap.parse_args(argv)
    try:
        path = plot_runs(a.runs, a.labels, a.out)
    except (FileNotFoundError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
