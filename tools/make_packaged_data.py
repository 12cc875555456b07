"""Regenerate ``lightning_topk/data/packaged/digits.npz`` from scikit-learn (needs the ``data`` extra).

    python tools/make_packaged_data.py [--check]

``--check`` compares the shipped file with scikit-learn's data instead of writing, and exits 1 on a
difference (``tests/data/test_packaged.py`` asserts the same).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from lightning_topk.data.datasets import DIGITS_NPZ, digits_from_sklearn
from lightning_topk.files import atomic_write


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing")
    a = p.parse_args(argv)
    images, labels = digits_from_sklearn()
    if a.check:
        with np.load(DIGITS_NPZ, allow_pickle=False) as z:
            same = np.array_equal(z["images"], images) and np.array_equal(z["labels"], labels) \
                and z["images"].dtype == images.dtype and z["labels"].dtype == labels.dtype
        print(f"{DIGITS_NPZ}: {'matches' if same else 'DIFFERS FROM'} scikit-learn's digits")
        return 0 if same else 1
    with atomic_write(DIGITS_NPZ) as f:
        np.savez_compressed(f, images=images, labels=labels)
    print(f"wrote {DIGITS_NPZ}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
