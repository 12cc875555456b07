"""Byte-level token shards for the Transformer LM preset: text files -> fixed-length uint8 sequences in
WebDataset shards (one ``.npy`` per sample). Nothing is downloaded.

    python examples/transformer_lm/make_shards.py corpus.txt more_text/ /data/lm-wds --seq-len 257
    # a quick real corpus that every Python install has: the standard library's source
    python examples/transformer_lm/make_shards.py "$(python -c 'import json,os;print(os.path.dirname(os.path.dirname(json.__file__)))')" /tmp/lm-wds

Sequences are ``seq_len`` bytes (the model sees ``seq_len - 1`` inputs and predicts the next byte).
"""
import argparse
import os
import sys

import numpy as np

from lightning_topk.data import write_shards
from lightning_topk.data.writer import encode_image

TEXT_EXT = (".txt", ".md", ".rst", ".py", ".json", ".html", ".tex")


def read_corpus(paths, limit_bytes):
    chunks, total = [], 0
    for path in paths:
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(TEXT_EXT))
        if not files:
            sys.exit(f"make_shards: no text files under {path!r} (looked for {TEXT_EXT})")
        for f in files:
            with open(f, "rb") as fh:
                data = fh.read()
            chunks.append(data + b"\n")
            total += len(data) + 1
            if limit_bytes and total >= limit_bytes:
                return b"".join(chunks)[:limit_bytes]
    return b"".join(chunks)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="text files or folders, then the output folder")
    ap.add_argument("--seq-len", type=int, default=257)
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--num-shards", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=200_000_000, help="stop reading after this many bytes")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if len(a.inputs) < 2:
        ap.error("give at least one input and the output folder")
    *inputs, out = a.inputs
    text = read_corpus(inputs, a.max_bytes)
    n = len(text) // a.seq_len
    if n < 2:
        sys.exit(f"make_shards: corpus has {len(text)} bytes, fewer than two sequences of {a.seq_len}")
    seqs = np.frombuffer(text[: n * a.seq_len], dtype=np.uint8).reshape(n, a.seq_len)
    seqs = seqs[np.random.default_rng(a.seed).permutation(n)]
    n_val = max(1, int(n * a.val_fraction))
    for split, part, shards in (("val", seqs[:n_val], 1), ("train", seqs[n_val:], a.num_shards)):
        samples = ({"__key__": f"{split}{i:09d}", "npy": encode_image(s, "npy")} for i, s in enumerate(part))
        paths = write_shards(samples, out, prefix=split, num_shards=shards, total=len(part))
        print(f"{split}: {len(part)} sequences of {a.seq_len} bytes in {len(paths)} shards, e.g. {paths[0]}")


if __name__ == "__main__":
    main()
