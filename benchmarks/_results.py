"""Where benchmarks write what they measured: ``benchmarks/results/NAME.json``, one record with the rows and
when, where and how they were made (date, host, command), so ``tools/render_results.py`` can render the tables
and plots from it and nobody copies a figure by hand.

    from _results import write_results
    write_results("hier_bytes", rows, sys.argv)
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def provenance(argv: List[str]) -> Dict[str, Any]:
    """The date (UTC), the host and the command line of this run."""
    try:
        import torch

        torch_version: Optional[str] = torch.__version__
        cuda = bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - every benchmark has torch
        torch_version, cuda = None, False
    args = list(argv)
    if args and os.path.isabs(args[0]):
        args[0] = os.path.relpath(args[0], ROOT)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"name": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
                 "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch_version,
                 "cuda": cuda},
        "command": "python " + " ".join(shlex.quote(a) for a in args),
    }


def write_results(name: str, rows: Any, argv: List[str], directory: str = RESULTS, **extra: Any) -> str:
    """Write ``{"date", "host", "command", **extra, "rows": rows}`` to ``directory/NAME.json`` (atomically);
    return the path."""
    record = {**provenance(argv), **extra, "rows": rows}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path
