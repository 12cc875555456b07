"""The digits shipped in the package equal scikit-learn's, and need no scikit-learn to load."""
import subprocess
import sys

import numpy as np

from lightning_topk.data.datasets import digits_from_sklearn, load_arrays
from tests.helpers.procs import ROOT, blocking_env, load_tool


def test_shipped_digits_equal_what_the_generator_makes_from_sklearn(capsys):
    images, labels = digits_from_sklearn()
    shipped_images, shipped_labels = load_arrays("digits")
    assert shipped_images.dtype == np.uint8 and shipped_labels.dtype == np.int64
    assert shipped_images.shape == (1797, 8, 8)
    assert np.array_equal(shipped_images, images) and np.array_equal(shipped_labels, labels)
    # the tool's own --check, in this process (a fresh interpreter only re-imported numpy and scikit-learn)
    tool = load_tool("make_packaged_data")
    assert tool.main(["--check"]) == 0
    assert "matches" in capsys.readouterr().out


def test_packaged_digits_shards_without_sklearn(tmp_path):
    code = ("from lightning_topk.data import ensure_digits_shards\n"
            f"s = ensure_digits_shards({str(tmp_path / 'c')!r}, image_size=16, num_shards=2)\n"
            "print(len(s['train']), len(s['val']))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=blocking_env(tmp_path, ["sklearn", "mlxtend"]))
    assert p.returncode == 0 and p.stdout.split() == ["2", "1"], p.stdout + p.stderr

