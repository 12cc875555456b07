#!/usr/bin/env bash
# One command for every GPU check (single-GPU machine). Run from anywhere:
#
#   bash benchmarks/gpu_check.sh
#
# 1. Without a CUDA device: prints "gpu_check: no CUDA device: nothing checked", writes nothing, exits 0.
# 2. Installs what is missing, offline: the wheels in benchmarks/wheels/ (made by benchmarks/gpu_wheels.sh
#    on a machine with network; hydra-core, webdataset and their pure-Python needs) and this repository
#    (editable, no dependencies).
# 3. Runs each step in its own process, past failures, timing each: the `gpu`-marked tests; the exchange
#    hooks under torch.cuda.set_sync_debug_mode("error") on the sync-free path; the selection, rebuild and
#    LARS kernels against their torch references; the selection benchmark at 25M and 250M entries; a
#    world-size-1 NCCL Trainer step with TopKDDPStrategy; 2 processes on one GPU over gloo on CUDA tensors.
# 4. Writes one markdown report: $OUT/gpu_check.md if OUT is set, else benchmarks/results/gpu_check.md.
#    Exit status: 0 if every step passed (or was skipped), 1 if any failed.
#
# Environment: PYTHON (default python3: the image's Python with torch), STEP_TIMEOUT (seconds per step,
# default 900), GPU_CHECK_STEPS (space-separated subset of: install gpu_tests syncs kernels bench nccl1 gloo2 fsdp).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO" || exit 1
PY=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
STEPS=${GPU_CHECK_STEPS:-install gpu_tests syncs kernels bench nccl1 gloo2 fsdp}

if ! probe=$("$PY" benchmarks/gpu_check.py probe 2>&1); then
  echo "gpu_check: no CUDA device: nothing checked (${probe##*$'\n'})"
  exit 0
fi

if [ -n "${OUT:-}" ]; then REPORT="$OUT/gpu_check.md"; else REPORT="$REPO/benchmarks/results/gpu_check.md"; fi
mkdir -p "$(dirname "$REPORT")"
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
SUMMARY="$LOGS/summary.md"
DETAILS="$LOGS/details.md"
failed=0

# the report as it stands (atomic): written after every step and at the end
write_report() {
  {
    cat "$LOGS/head.md"
    echo
    echo "| step | what | status | seconds |"
    echo "|---|---|---|---:|"
    cat "$SUMMARY" 2>/dev/null
    cat "$DETAILS" 2>/dev/null
  } > "$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
}

# step NAME TITLE COMMAND...: runs it with a timeout, records status and time, keeps its output's tail
step() {
  local name=$1 title=$2 start end rc status
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "gpu_check: $title ..."
  start=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  end=$(date +%s)
  if [ "$rc" -eq 0 ]; then
    status=PASS
    if grep -q '^SKIP' "$LOGS/$name.log"; then status=SKIP; fi
  elif [ "$rc" -eq 124 ]; then
    status="FAIL (timed out after ${STEP_TIMEOUT}s)"; failed=1
  else
    status="FAIL (exit $rc)"; failed=1
  fi
  echo "gpu_check: $title: $status in $((end - start)) s"
  echo "| $name | $title | $status | $((end - start)) |" >> "$SUMMARY"
  {
    echo
    echo "## $name: $status ($((end - start)) s)"
    echo
    echo "\`$*\`"
    echo
    echo '```'
    tail -n 80 "$LOGS/$name.log"
    echo '```'
  } >> "$DETAILS"
  [ -f "$LOGS/head.md" ] && write_report  # after every step: a run cut short keeps what ran
}

install_missing() {
  local missing=()
  "$PY" -c "import hydra" 2>/dev/null || missing+=(hydra-core)
  "$PY" -c "import webdataset" 2>/dev/null || missing+=(webdataset)
  if [ ${#missing[@]} -gt 0 ]; then
    if ! ls benchmarks/wheels/*.whl > /dev/null 2>&1; then
      echo "missing ${missing[*]} and no wheels in benchmarks/wheels/: run benchmarks/gpu_wheels.sh where pip" \
        "has network, and carry benchmarks/wheels/ to this machine"
      return 1
    fi
    "$PY" -m pip install --no-index --find-links benchmarks/wheels "${missing[@]}" || return 1
  else
    echo "hydra-core and webdataset already importable"
  fi
  if ! "$PY" -c "import lightning_topk.conf, sys; sys.exit(not lightning_topk.__file__.startswith('$REPO'))" \
      2>/dev/null; then
    "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . || return 1
  fi
  "$PY" -c "import hydra, webdataset, lightning_topk, lightning_topk.conf; print('lightning_topk from', lightning_topk.__file__)"
}

{
  echo "# GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)'), host $(hostname)"
  echo
  echo "- device: $probe"
  echo "- $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo 'nvidia-smi: not found')"
  echo "- python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  echo "- $("$PY" -c 'import importlib.metadata as m
out = []
for d in ("torch", "pytorch-lightning", "lightning", "cupy-cuda13x", "cupy-cuda12x", "hydra-core", "webdataset"):
    try:
        out.append(f"{d} {m.version(d)}")
    except m.PackageNotFoundError:
        pass
print(", ".join(out))' 2>&1)"
} > "$LOGS/head.md"

# `timeout` runs programs, not shell functions (a bare `install` ran coreutils' install(1) on 2026-11-27)
export -f install_missing
export PY REPO
step install "install missing packages (offline wheels) and this repository" bash -c install_missing
step gpu_tests "pytest -m gpu" "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests
step syncs "exchange hooks under set_sync_debug_mode(\"error\"), sync-free path, NCCL world size 1" \
  "$PY" benchmarks/gpu_check.py syncs
step kernels "selection, rebuild and LARS kernels against the torch references" "$PY" benchmarks/gpu_check.py kernels
step bench "selection benchmark at 25M and 250M entries" \
  "$PY" benchmarks/bench_select.py --device cuda --sizes 25000000 250000000 --densities 0.01 0.001 --repeats 5
step nccl1 "TopKDDPStrategy on NCCL, world size 1" "$PY" benchmarks/gpu_check.py nccl1
step gloo2 "2 processes on one GPU over gloo with CUDA tensors (and 4 for hierarchical)" \
  "$PY" benchmarks/gpu_check.py gloo2
step fsdp "topk_fsdp on CUDA: 2x2 over gloo vs torch HSDP, per-rank memory, NCCL world size 1 (bf16, local SGD)" \
  "$PY" benchmarks/gpu_check.py fsdp

write_report
echo "gpu_check: report in $REPORT ($([ "$failed" -eq 0 ] && echo 'all passed' || echo 'some steps FAILED'))"
exit "$failed"
