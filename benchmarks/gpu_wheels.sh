#!/usr/bin/env bash
# Companion of benchmarks/gpu_check.sh: downloads, on a machine with network, the wheels that the GPU
# machine lacks into benchmarks/wheels/ (ignored by git; carry it to the GPU machine with the tree).
#
#   bash benchmarks/gpu_wheels.sh            # for CPython 3.12 on manylinux x86-64 (the device image)
#   GPU_PY=3.11 bash benchmarks/gpu_wheels.sh
#
# The device image has torch, CuPy, pytorch-lightning and lightning but not hydra-core or webdataset
# (and their pure-Python needs). All of these are pure Python: antlr4-python3-runtime 4.9.3 has no wheel
# on PyPI, so it is built here from its sdist (a py3-none-any wheel, the same on any machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_PY=${GPU_PY:-3.12}
DEST=benchmarks/wheels
mkdir -p "$DEST"
# name==version: hydra-core's and webdataset's closure minus what the device image already holds
# (PyYAML, numpy, packaging). Versions as in the CI environment (.ci/setup).
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 webdataset==1.0.2 braceexpand==0.1.7)
SDISTS=(antlr4-python3-runtime==4.9.3)
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do PLAT+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" --implementation cp \
  "${PLAT[@]}" -d "$DEST" "${WHEELS[@]}"
"$PY" -m pip wheel -q --no-deps -w "$DEST" "${SDISTS[@]}"
# keep one version of each project: two would stop `pip install --no-index`
ls "$DEST"/*.whl | sed 's#.*/##; s/-[0-9].*//' | sort | uniq -d | while read -r dup; do
  echo "gpu_wheels: several versions of $dup in $DEST; remove all but one" >&2; exit 1
done
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
