"""A byte-level text that ships inside the package, cut into fixed-length token sequences (no download).

``bytes_text``: 768 KiB of English prose and code examples, the docstrings of CPython 3.11's standard library
(PSF licence), shipped as ``packaged/stdlib_docs.txt.gz`` (231 KB; see ``packaged/README.md``;
``tools/make_packaged_text.py`` makes it). Tokens are bytes: vocabulary 256.
"""
from __future__ import annotations

import gzip
import os
from typing import Any, Dict, List, Tuple

import numpy as np

from .datasets import publish_split_shards
from .writer import encode_image, write_shards

#: The packaged text, gzip-compressed UTF-8 (``tools/make_packaged_text.py``).
TEXT_GZ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "packaged", "stdlib_docs.txt.gz")
VOCAB_SIZE = 256


def load_text() -> bytes:
    """The packaged text's bytes."""
    with gzip.open(TEXT_GZ, "rb") as f:
        return f.read()


def byte_sequences(seq_len: int = 129, val_fraction: float = 0.05, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """The text as non-overlapping uint8 sequences ``[N, seq_len]``, shuffled with ``seed`` and split into
    ``(train, val)``; the split is a function of the arguments only. The model reads ``seq_len - 1`` bytes
    and predicts the next one at every position."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = load_text()
    n = len(text) // seq_len
    if n < 2:
        raise ValueError(f"seq_len={seq_len}: the packaged text ({len(text)} bytes) holds fewer than 2 sequences")
    seqs = np.frombuffer(text[: n * seq_len], dtype=np.uint8).reshape(n, seq_len)
    seqs = seqs[np.random.default_rng(seed).permutation(n)]
    n_val = max(1, int(round(n * val_fraction)))
    return seqs[n_val:].copy(), seqs[:n_val].copy()


def ensure_text_shards(root: str, seq_len: int = 129, num_shards: int = 4, val_fraction: float = 0.05,
                       seed: int = 0) -> Dict[str, List[str]]:
    """Write the packaged text's train/val sequences as WebDataset ``.npy`` shards under ``root`` unless they
    exist; return ``{"train": [...], "val": [...]}``. Built under a temporary name and renamed into place, as
    :func:`~lightning_topk.data.ensure_digits_shards`."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    train, val = byte_sequences(seq_len, val_fraction, seed)
    name = f"bytes_text-seq{seq_len}-{num_shards}shards-val{val_fraction:g}-seed{seed}"

    def write(tmp: str) -> Dict[str, Any]:
        paths: Dict[str, Any] = {}
        for split, part, shards in (("train", train, num_shards), ("val", val, max(1, num_shards // 4))):
            samples = ({"__key__": f"{split}{i:09d}", "npy": encode_image(s, "npy")} for i, s in enumerate(part))
            paths[split] = write_shards(samples, tmp, prefix=split, num_shards=shards, total=len(part))
        return paths | {"vocab_size": VOCAB_SIZE, "seq_len": seq_len}

    return publish_split_shards(root, name, write)
