"""Pack an image folder (one sub-folder per class) or arrays into WebDataset tar shards.

Console command ``lightning-topk-shards SOURCE OUTPUT_DIR [--max-count N | --max-size 256MB | --num-shards N]``.
Each shard is written to a temporary file and renamed into place; an ``index.json`` beside the shards
records sample counts so the DataModule does not have to scan them.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from webdataset import TarWriter

from lightning_topk.files import atomic_write, publish, temp_path

from .decode import IMAGE_EXTS
from .index import INDEX_FORMAT, INDEX_NAME

_TAR_OVERHEAD = 2048  # pax + ustar headers and padding per member (tar also pads the end to 10 KiB)


def _atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def encode_image(array: np.ndarray, fmt: str = "png") -> bytes:
    """uint8 array [H, W] or [H, W, C] -> encoded bytes (png/jpg) or npy bytes."""
    array = np.asarray(array)
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        return buf.getvalue()
    if array.dtype != np.uint8:
        raise ValueError(f"images must be uint8 to encode as {fmt}, got {array.dtype}")
    buf = io.BytesIO()
    Image.fromarray(array.squeeze(-1) if array.ndim == 3 and array.shape[-1] == 1 else array).save(
        buf, format="JPEG" if fmt == "jpg" else fmt.upper())
    return buf.getvalue()


def array_samples(images, labels, image_format: str = "png", key_prefix: str = "") -> Iterator[dict]:
    """Samples ``{__key__, <format>, cls}`` from an image array ``[N, H, W(, C)]`` and integer labels."""
    if image_format not in ("png", "jpg", "npy"):
        raise ValueError(f"image_format must be png, jpg or npy, got {image_format!r}")
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    for i, (img, lab) in enumerate(zip(images, labels)):
        yield {"__key__": f"{key_prefix}{i:08d}", image_format: encode_image(img, image_format), "cls": int(lab)}


def folder_samples(root: str) -> Tuple[Iterator[dict], int, List[str]]:
    """Samples from ``root/<class>/<image>``, classes numbered in sorted order; returns (samples, count, classes)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder not found: {root}")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise ValueError(f"{root} has no class sub-folders")
    files = []
    for ci, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(root, c))):
            ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
            if ext in IMAGE_EXTS:
                files.append((os.path.join(root, c, name), "jpg" if ext == "jpeg" else ext, ci))
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) under {root}")

    def gen():
        for i, (path, ext, ci) in enumerate(files):
            with open(path, "rb") as f:
                yield {"__key__": f"{i:08d}", ext: f.read(), "cls": ci}

    return gen(), len(files), classes


def write_shards(samples: Iterable[dict], out_dir: str, *, prefix: str = "shard", max_count: Optional[int] = None,
                 max_bytes: Optional[int] = None, num_shards: Optional[int] = None, total: Optional[int] = None,
                 progress: bool = True, metadata: Optional[dict] = None) -> List[str]:
    """Write samples (dicts with ``__key__`` and one entry per member extension) into tar shards.

    Give at most one of ``max_count`` (samples per shard), ``max_bytes`` (approximate shard size) or
    ``num_shards`` (needs ``total`` or a sized ``samples``). Returns the shard paths in order.
    """
    if sum(x is not None for x in (max_count, max_bytes, num_shards)) > 1:
        raise ValueError("give only one of max_count, max_bytes, num_shards")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
        raise ValueError(f"prefix must be letters, digits, '_', '-', '.', got {prefix!r}")
    if total is None and hasattr(samples, "__len__"):
        total = len(samples)
    if num_shards is not None:
        if num_shards < 1 or total is None:
            raise ValueError("num_shards needs num_shards >= 1 and a known total")
        max_count = max(1, math.ceil(total / num_shards))
    if max_count is None and max_bytes is None:
        max_count = 10000
    os.makedirs(out_dir, exist_ok=True)
    written: List[str] = []
    entries = {}
    state = {"writer": None, "tmp": None, "count": 0, "bytes": 0, "est": 0}

    def close():
        if state["writer"] is None:
            return
        state["writer"].close()
        path = os.path.join(out_dir, f"{prefix}-{len(written):06d}.tar")
        publish(state["tmp"], path)
        entries[os.path.basename(path)] = {"samples": state["count"], "bytes": state["bytes"], "size": os.path.getsize(path)}
        written.append(path)
        state.update(writer=None, tmp=None, count=0, bytes=0, est=0)

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(f"writing {prefix} shards", total=total)
        for sample in samples:
            if "__key__" not in sample:
                raise ValueError("every sample needs a '__key__'")
            members = [v for k, v in sample.items() if not k.startswith("__")]
            size = sum(len(v) if isinstance(v, (bytes, bytearray)) else len(str(v)) for v in members)
            est = size + _TAR_OVERHEAD * len(members)
            if state["writer"] is not None:
                state["est"] = state["writer"].tarstream.fileobj.tell()
            if state["writer"] is not None and (
                    (max_count is not None and state["count"] >= max_count)
                    or (max_bytes is not None and state["est"] + est > max_bytes)):
                close()
            if state["writer"] is None:
                tmp = temp_path(os.path.join(out_dir, prefix), suffix=".tar")
                state.update(writer=TarWriter(tmp), tmp=tmp)
            state["writer"].write(sample)
            state["count"] += 1
            state["bytes"] += size
            state["est"] += est
            bar.advance(task)
        close()
    if not written:
        raise ValueError("no samples to write")
    index_path = os.path.join(out_dir, INDEX_NAME)
    index = {"format": INDEX_FORMAT, "shards": {}}
    if os.path.isfile(index_path):
        with open(index_path) as f:
            old = json.load(f)
        if old.get("format") == INDEX_FORMAT:
            index = old
    index["shards"].update(entries)
    if metadata:
        index.setdefault("metadata", {}).update(metadata)
    _atomic_write_bytes(index_path, json.dumps(index, indent=1, sort_keys=True).encode())
    return written


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?i?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"size like 256MB or 1G expected, got {text!r}")
    unit = m.group(2).rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


def _npz_arrays(path: str, images_key: Optional[str], labels_key: Optional[str]):
    data = np.load(path, allow_pickle=False)

    def pick(given, options, what):
        if given is not None:
            if given not in data:
                raise ValueError(f"{path} has no array {given!r} (arrays: {list(data.keys())})")
            return data[given]
        for k in options:
            if k in data:
                return data[k]
        raise ValueError(f"{path}: no {what} array among {options}; name it with --{what}-key (arrays: {list(data.keys())})")

    return pick(images_key, ("images", "x", "X", "data"), "images"), pick(labels_key, ("labels", "y", "Y", "targets"), "labels")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lightning-topk-shards", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="image folder with one sub-folder per class, or an .npz with images and labels arrays")
    p.add_argument("output", help="directory for the shards and index.json")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--max-count", type=int, help="samples per shard (default 10000)")
    g.add_argument("--max-size", type=_parse_size, help="approximate bytes per shard, e.g. 256MB")
    g.add_argument("--num-shards", type=int, help="number of shards")
    p.add_argument("--prefix", default="shard", help="shard names are <prefix>-000000.tar ...")
    p.add_argument("--format", default="png", choices=("png", "jpg", "npy"), help="image encoding for array input")
    p.add_argument("--images-key", help="array name of the images in the .npz")
    p.add_argument("--labels-key", help="array name of the labels in the .npz")
    p.add_argument("--shuffle", action="store_true", help="shuffle samples before packing")
    p.add_argument("--seed", type=int, default=0, help="seed for --shuffle")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    a = p.parse_args(argv)
    if os.path.isdir(a.source):
        samples, total, classes = folder_samples(a.source)
        if a.shuffle:
            samples = list(samples)
            np.random.default_rng(a.seed).shuffle(samples)
        meta = {"classes": classes}
    elif a.source.endswith(".npz") and os.path.isfile(a.source):
        images, labels = _npz_arrays(a.source, a.images_key, a.labels_key)
        order = np.random.default_rng(a.seed).permutation(len(images)) if a.shuffle else np.arange(len(images))
        samples, total, meta = array_samples(images[order], labels[order], a.format), len(images), {}
    else:
        p.error(f"source must be an existing folder or .npz file: {a.source}")
    paths = write_shards(samples, a.output, prefix=a.prefix, max_count=a.max_count, max_bytes=a.max_size,
                         num_shards=a.num_shards, total=total, progress=not a.no_progress, metadata=meta)
    print(f"wrote {len(paths)} shards with {total} samples to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
