"""docs/compatibility.md's support-matrix block, rendered from lightning_topk/support.py (the matrix the strategies
refuse from) and tests/matrix/cells.py (the cells CI runs). tools/render_results.py writes it as its
``support-matrix`` block; ``--check`` fails when the docs differ from the data."""
from __future__ import annotations

import os
import sys
from collections import Counter
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cells():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.matrix import cells

    return cells


def _when(rule) -> str:
    parts = [f"{d} ∈ {{{', '.join(v)}}}" if len(v) > 1 else f"{d} = {v[0]}" for d, v in rule.when.items()]
    if rule.condition:
        parts.append(rule.condition)
    return "; ".join(parts) or "—"


def markdown() -> str:
    from lightning_topk import support

    cells = _cells()
    n = support.counts()
    total = sum(n.values())
    ran_sup, ran_ref = len(cells.SUPPORTED), len(cells.REFUSED)
    by_rule = Counter()
    for c in support.cells():
        st, rule = support.status(c)
        if rule is not None:
            by_rule[rule.name] += 1
    out: List[str] = [
        f"**{total} combinations** of {len(support.DIMENSIONS)} dimensions: **{n['supported']} supported**, "
        f"**{n['refused']} refused**, {n['n/a']} without a meaning (not cells). CI runs **{ran_sup} supported "
        f"cells** (every pair of dimension values that a supported, gloo-run cell has, plus the cells of issue 41's "
        f"defects) and **{ran_ref} refused cells** (each setup-time rule under each strategy and API), on real gloo "
        "processes (`tests/matrix/`).",
        "",
        "| dimension | values |",
        "|---|---|",
    ]
    for d, vals in support.DIMENSIONS.items():
        out.append(f"| {d} | {', '.join(f'`{v}`' for v in vals)} |")
    out += ["", "Rules, first match decides (a cell no rule matches is supported):", "",
            "| rule | status | cells | when | fires | message |", "|---|---|---:|---|---|---|"]
    for r in support.RULES:
        fires = r.at if r.status == "refused" else "—"
        msg = r.message.replace("|", "\\|")
        out.append(f"| `{r.name}` | {r.status} | {by_rule[r.name]} | {_when(r)} | {fires} | {msg} |")
    out += ["", "The cells CI runs (`tests/matrix/test_matrix_topk_*.py`):", "",
            "| strategy | api | mode | exchange | layout | optimization | feature | end | checks |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in cells.SUPPORTED:
        checks = "agree, resume" + (", = `ddp`" if cells.dense_reference(c) else "")
        out.append(f"| {c['strategy']} | {c['api']} | {c['mode']} | {c['exchange']} | {c['layout']} | "
                   f"{c['optimization']} | {c['feature']} | {c['end']} | {checks} |")
    for c in cells.REFUSED:
        rule = support.status(c)[1]
        out.append(f"| {c['strategy']} | {c['api']} | {c['mode']} | {c['exchange']} | {c['layout']} "
                   f"({c['fault_tolerance']}) | {c['optimization']} | {c['feature']} | {c['end']} | refused: "
                   f"`{rule.name}` |")
    out += ["", "The torchft cells CI runs, each in the torchft harness (a lighthouse, replica groups started, "
            "killed with SIGKILL and restarted; `tests/matrix/test_ft_cells.py` checks each test exists):", "",
            "| strategy | api | mode | exchange | groups x processes | end | test |", "|---|---|---|---|---|---|---|"]
    for c, test in cells.FT_CELLS:
        out.append(f"| {c['strategy']} | {c['api']} | {c['mode']} | {c['exchange']} | {c['layout']} | {c['end']} | "
                   f"`{test.split('::')[1]}` |")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())
