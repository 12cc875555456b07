"""Run the default job (README command 1: ``lightning-topk-train`` with no overrides) and write what it printed
into the README, so the README's figures for it are never copied by hand.

    .venv/bin/python tools/main_job_figures.py            # run the job (~1-2 min on 2 cores), update both files
    .venv/bin/python tools/main_job_figures.py --check    # exit 1 if the README block is not docs/main_job.json's

Writes ``docs/main_job.json`` (the run's summary.json, the machine, the date and the wall time) and replaces the
block between the ``main-job`` markers of README.md with the summary table rendered from it, as the job prints
it. ``tests/app/test_main_job_figures.py`` checks that the README block is exactly that rendering.
``tools/render_results.py`` renders the same block with :func:`block`, with every other recorded figure (one
command re-renders them all, and its ``--check`` covers this block too); this tool is the one that runs the job.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
JSON = os.path.join(ROOT, "docs", "main_job.json")
BEGIN = "<!-- main-job:begin (written by tools/main_job_figures.py from docs/main_job.json; do not edit) -->"
END = "<!-- main-job:end -->"
SHOWN_RUN_DIR = "outputs/<date>/<time>"  # the run's temporary directory, as a user's run would name it
WIDTH = 100


def run_job() -> Dict[str, Any]:
    """The default job in a temporary run directory and cache; its summary with the run facts."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        env = dict(os.environ, LIGHTNING_TOPK_CACHE=os.path.join(tmp, "cache"))
        exe = os.path.join(os.path.dirname(sys.executable), "lightning-topk-train")
        t0 = time.perf_counter()
        p = subprocess.run([exe, f"hydra.run.dir={run_dir}"], env=env, cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
            raise SystemExit(f"main_job_figures: lightning-topk-train failed (exit {p.returncode})")
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    summary = json.loads(json.dumps(summary).replace(run_dir, SHOWN_RUN_DIR))
    return {"summary": summary, "wall_seconds": round(wall, 1), "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()}-core {platform.machine()}, "
                       f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}, torch {torch.__version__}, "
                       f"Python {platform.python_version()}"}


def block(record: Dict[str, Any]) -> str:
    """The README block for ``record`` (what :func:`run_job` returned)."""
    from rich.console import Console

    from lightning_topk.app.summary import render

    buf = io.StringIO()
    render(record["summary"], console=Console(file=buf, width=WIDTH, color_system=None, force_terminal=False))
    table = "\n".join(line.rstrip() for line in buf.getvalue().rstrip().splitlines())
    return (f"{BEGIN}\nOne default run ({record['machine']}; {record['date']}; {record['wall_seconds']:.0f} s end "
            f"to end, set-up and test included) printed:\n\n```text\n{table}\n```\n{END}")


def readme_block(text: str) -> str:
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.S)
    if m is None:
        raise SystemExit(f"main_job_figures: README.md has no block between {BEGIN!r} and {END!r}")
    return m.group(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that README.md shows docs/main_job.json")
    a = ap.parse_args(argv)
    with open(README) as f:
        text = f.read()
    if a.check:
        with open(JSON) as f:
            ok = readme_block(text) == block(json.load(f))
        print("main_job_figures: README block " + ("matches" if ok else "differs from") + " docs/main_job.json")
        return 0 if ok else 1
    record = run_job()
    new_text = text.replace(readme_block(text), block(record))
    from lightning_topk.files import atomic_write

    with atomic_write(JSON, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    with atomic_write(README, "w") as f:
        f.write(new_text)
    print(block(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
