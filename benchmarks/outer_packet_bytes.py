"""Bytes of sparse local SGD's outer packets, from the packet layout (pure arithmetic, no training).

    python benchmarks/outer_packet_bytes.py [--params 9610 11326410] [--replicas 2 4] [--time 11326410]
        [--exchange-replicas 2 4 8 16 32]

For the registered presets (``topk_local``, ``topk_local_wan``) and models of ``--params`` parameters (one
process per node, ``outer_chunk`` 4096): one rank's packet with the in-chunk positions as int16 (the encoding
before the bitmap existed, ``PacketLayout(indices="int")``) and as chosen now (``indices="auto"``: a bitmap of
the chunk where smaller), and the bytes a rank sends per outer round in a ring all-gather among R replicas
((R - 1) packets; the module buffers' all-reduce, if any, comes on top). Then the bytes-per-parameter grid of
docs/local_sgd.md. Then (issue 21) the bytes one replica sends per outer round under each ``outer_exchange``
among ``--exchange-replicas`` replicas (:func:`outer.round_bytes_out`: the flat all-gather's R - 1 packets
against the scale-free exchange's R - 1 segments in its all-to-all plus R - 1 owner segments, at
``OWNER_K_FACTOR`` times the density, in its all-gather), and what ``outer_exchange="auto"`` picks. The 2-process telemetry (``topk/outer_bytes``) is in BENCHMARKS.md.

``--time N``: also times one packet's ``compress`` and ``decode_into`` at ``topk_local``'s settings for N
parameters, int16 positions against the bitmap, alternating, median of ``--repeats`` (``--threads`` torch threads).

The arithmetic's rows go to ``benchmarks/results/<--json>.json`` with the date, host and command (``--json ''``:
not written; the timing stays printed only).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch

from lightning_topk.comm.local import (
    PacketLayout,
    chunk_k,
    chunk_size,
    compress,
    decode_into,
    outer_exchange_for,
    round_bytes_out,
    wire_bytes_per_param,
)
from lightning_topk.comm.state import TopKConfig
from lightning_topk.lightning.registry import PRESETS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_results


def layout(n: int, density: float, bits: int, chunk: int, indices: str) -> PacketLayout:
    c = chunk_size(n, chunk)
    return PacketLayout(-(-n // c), c, chunk_k(c, density), bits, indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, nargs="+", default=[9610, 11326410],
                    help="parameter counts (default: the digits MLP of tests/scripts/local_train.py and the "
                         "namespace cluster's model, benchmarks/cluster_worker.py --hidden 2560)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--exchange-replicas", type=int, nargs="+", default=[2, 4, 8, 16, 32],
                    help="replica counts of the all-gather against scale-free table (issue 21)")
    ap.add_argument("--time", type=int, default=0, help="parameters for the encode/decode timing (0: none)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="outer_packet_bytes", help="results name under benchmarks/results/ ('': none)")
    a = ap.parse_args()
    records: list = []
    print("| preset | params | positions before -> now | packet before | packet now | now / before | "
          + " | ".join(f"per round, R={r} (before -> now)" for r in a.replicas) + " | per param per inner step, "
          f"R={a.replicas[-1]} (before -> now) |")
    print("|---|---|---|---|---|---|" + "---|" * len(a.replicas) + "---|")
    for name, p in PRESETS.items():
        d, b, ch, H = p["outer_density"], p["outer_value_bits"], p["outer_chunk"], p["local_steps"]
        for n in a.params:
            old, new = layout(n, d, b, ch, "int"), layout(n, d, b, ch, "auto")
            rounds = " | ".join(f"{(r - 1) * old.nbytes:,} -> {(r - 1) * new.nbytes:,}" for r in a.replicas)
            R = a.replicas[-1]
            per_step = f"{(R - 1) * old.nbytes / n / H:.4f} -> {(R - 1) * new.nbytes / n / H:.4f}"
            print(f"| {name} ({d:g}, {b}-bit, H {H}) | {n:,} | {old.index_code} -> {new.index_code} | "
                  f"{old.nbytes:,} | {new.nbytes:,} | {new.nbytes / old.nbytes:.3f} | {rounds} | {per_step} |")
            records.append({"table": "packet", "preset": name, "outer_density": d, "outer_value_bits": b,
                            "local_steps": H, "params": n, "positions_before": old.index_code,
                            "positions_now": new.index_code, "packet_bytes_before": old.nbytes,
                            "packet_bytes_now": new.nbytes,
                            "round_bytes_now": {str(r): (r - 1) * new.nbytes for r in a.replicas}})
    print()
    bits = (32, 16, 8, 4, 2)
    print("| outer_density | " + " | ".join(f"{b}-bit" for b in bits) + " |")
    print("|---|" + "---|" * len(bits))
    for d in (1.0, 0.1, 0.03, 0.01):
        print(f"| {d:g} | " + " | ".join(f"{wire_bytes_per_param(d, b):.3f}" for b in bits) + " |")
        records.append({"table": "bytes_per_param", "outer_density": d,
                        "bytes_per_param": {str(b): wire_bytes_per_param(d, b) for b in bits}})
    records += exchanges(a.params, a.exchange_replicas)
    if a.json:
        print(write_results(a.json, records, sys.argv))
    if a.time:
        timing(a.time, a.repeats, a.threads)


def exchanges(params, replicas) -> list:
    """Bytes per replica per outer round: all-gather / scale-free (ratio), and auto's choice."""
    print("\nBytes one replica sends per outer round: all-gather / scale-free (ratio), auto's pick; one process per "
          "node, the module buffers' all-reduce aside (it receives as many)\n")
    print("| preset | params | packet | unit | " + " | ".join(f"R = {r}" for r in replicas) + " |")
    print("|---|---|---|---|" + "---|" * len(replicas))
    records = []
    for name, p in PRESETS.items():
        cfg = TopKConfig(**p)
        d, b, ch = p["outer_density"], p["outer_value_bits"], p["outer_chunk"]
        for n in params:
            lay = layout(n, d, b, ch, "auto")
            unit, label = (1e6, "MB") if lay.nbytes >= 1e5 else (1e3, "kB")
            cells = []
            for r in replicas:
                ag, sc = round_bytes_out(lay, r, "allgather"), round_bytes_out(lay, r, "scatter")
                pick = "sc" if outer_exchange_for(cfg, r, lay) == "scatter" else "ag"
                cells.append(f"{ag / unit:.2f} / {sc / unit:.2f} ({sc / ag:.2f}×, auto {pick})")
                records.append({"table": "outer_exchange", "preset": name, "params": n, "replicas": r,
                                "packet_bytes": lay.nbytes, "allgather_bytes": ag, "scatter_bytes": sc,
                                "auto": "scatter" if pick == "sc" else "allgather"})
            print(f"| {name} ({d:g}, {b}-bit) | {n:,} | {lay.nbytes / unit:.2f} | {label} | " + " | ".join(cells) + " |")
    return records


def timing(n: int, repeats: int, threads: int) -> None:
    torch.set_num_threads(threads)
    p = PRESETS["topk_local"]
    e0 = torch.randn(n, generator=torch.Generator().manual_seed(0))
    times: dict = {}
    for _ in range(repeats):
        for code in ("int", "auto"):
            lay = layout(n, p["outer_density"], p["outer_value_bits"], p["outer_chunk"], code)
            e = torch.zeros(lay.C * lay.c)
            e[:n] = e0
            t0 = time.perf_counter()
            packet, _ = compress(e, lay, want_sent=False)
            t1 = time.perf_counter()
            out = torch.zeros(lay.C * lay.c)
            t2 = time.perf_counter()
            decode_into(out, packet, lay)
            t3 = time.perf_counter()
            times.setdefault(lay.index_code, []).append((t1 - t0, t3 - t2))
    print(f"\n{n:,} parameters, topk_local, {threads} thread(s), median of {repeats}:\n")
    print("| positions | compress (ms) | decode_into (ms) |\n|---|---|---|")
    for code, ts in times.items():
        c = statistics.median(t[0] for t in ts) * 1e3
        d = statistics.median(t[1] for t in ts) * 1e3
        print(f"| {code} | {c:.1f} | {d:.1f} |")


if __name__ == "__main__":
    main()
