#!/bin/bash
# One GPU lease, run THERE from the repository root (see README.md beside this file):
#   bash benchmarks/gpu/run.sh            with .whl/ carried (benchmarks/gpu/prepare.sh, here)
# Writes at most 8 files under $OUT: gpu.txt pytest.txt bench.log peers.json train.log train.json
# summary.txt results.json. Every step runs under its own `timeout`, inside one overall budget
# (FLOWCTL_GPU_BUDGET seconds, default 240): a step that would start with under 15 s left is
# skipped, a failing step never stops the next. results.json and summary.txt are rewritten after
# every step, so a run cut short still brings back what it measured. The last lines printed are
# the summary.
#
# Dry run on a machine without a GPU (checks the plumbing, not the card):
#   FLOWCTL_GPU_DRY=1 FLOWCTL_GPU_PY=.venv/bin/python bash benchmarks/gpu/run.sh
# (no wheel install, no nvidia-smi, every flowctl command on cpu:0; OUT defaults to
# /tmp/flowctl-gpu-out).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.." || exit 1
t0=$SECONDS
DRY=${FLOWCTL_GPU_DRY:-0}
BUDGET=${FLOWCTL_GPU_BUDGET:-240}
PY=${FLOWCTL_GPU_PY:-python3}
WORK=${FLOWCTL_GPU_WORK:-/tmp/flowctl-gpu}
if [ -z "${OUT:-}" ]; then OUT=/tmp/flowctl-gpu-out; rm -rf "$OUT"; fi
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK" || exit 1
DEV=gpu:0
[ "$DRY" = 1 ] && DEV=cpu:0
export FLOWCTL_GPU_DRY=$DRY FLOWCTL_GPU_DEVICE=$DEV
COLLECT=(timeout 60 "$PY" benchmarks/gpu/collect.py)
FC=("$PY" -c 'from flowctl.cli.main import main; main()')

say() { echo "[t=$((SECONDS - t0))s] $*"; }
finish() { "${COLLECT[@]}" finish "$WORK" "$OUT" "$((SECONDS - t0))" "$@" 2>>"$WORK/collect.err"; }

# step NAME CAP STDOUT STDERR CMD...: CMD under `timeout` of min(CAP, what the budget leaves - 10 s),
# its stdout to STDOUT, a header and its stderr appended to STDERR; NAME rc seconds limit -> steps.tsv
step() {
  local name=$1 cap=$2 so=$3 se=$4; shift 4
  local to=$((BUDGET - (SECONDS - t0) - 10)) why=
  [ "$to" -gt "$cap" ] && to=$cap
  [ "$to" -lt 15 ] && why="${to}s of the ${BUDGET}s budget left"
  [[ " ${FLOWCTL_GPU_SKIP:-} " == *" $name "* ]] && why="FLOWCTL_GPU_SKIP"
  if [ -n "$why" ]; then
    echo "===== $name: skipped ($why)" >>"$se"
    printf '%s\tskipped\t0\t%s\t%s\n' "$name" "$cap" "$why" >>"$WORK/steps.tsv"
    say "$name skipped ($why)"
    return 0
  fi
  echo "===== $name (limit ${to}s, t=$((SECONDS - t0))s): $*" >>"$se"
  local s=$SECONDS rc err="$WORK/step-$name.err"
  timeout -k 5 "$to" "$@" >>"$so" 2>"$err" </dev/null
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "===== $name: TIMED OUT after ${to}s" >>"$err"
  cat "$err" >>"$se"
  # the last line it printed on stderr, for the summary of a failed step
  local last
  last=$(grep -v '^[[:space:]]*$' "$err" | tail -n1 | tr '\t' ' ' | cut -c1-240)
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - s))" "$to" "$last" >>"$WORK/steps.tsv"
  say "$name rc=$rc ($((SECONDS - s))s)"
  return 0
}

# ---- setup: the carried wheels -> /tmp/site (typing_extensions only where the machine's is older)
{
  echo "===== setup (dry=$DRY device=$DEV python=$PY budget=${BUDGET}s)"
  if [ "$DRY" != 1 ]; then
    whls=()
    for f in .whl/*.whl; do
      [ -e "$f" ] || continue
      b=$(basename "$f")
      if [[ $b == typing_extensions-* ]] && "$PY" - "$(echo "$b" | cut -d- -f2)" <<'PY'
import importlib.metadata as m, sys
v = lambda s: tuple(int(x) for x in s.split(".")[:3] if x.isdigit())
try:
    have = m.version("typing_extensions")
except m.PackageNotFoundError:
    print("typing_extensions: none on the machine"); sys.exit(1)
print(f"typing_extensions: machine {have}, carried {sys.argv[1]}")
sys.exit(0 if v(have) >= v(sys.argv[1]) else 1)
PY
      then echo "keeping the machine's typing_extensions"; continue; fi
      whls+=("$f")
    done
    echo "installing ${#whls[@]} wheels: ${whls[*]##*/}"
    s=$SECONDS
    timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${whls[@]}" 2>&1
    rc=$?
    printf 'install\t%s\t%s\t90\t\n' "$rc" "$((SECONDS - s))" >>"$WORK/steps.tsv"
    echo "install rc=$rc"
  fi
} >"$WORK/setup.txt" 2>&1
if [ "$DRY" = 1 ]; then export PYTHONPATH=$PWD; else export PYTHONPATH=/tmp/site:$PWD; fi
say "setup done: $(tail -n1 "$WORK/setup.txt")"

# ---- a. the card and the libraries -> gpu.txt
if [ "$DRY" != 1 ]; then
  timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,clocks.max.mem,power.limit \
    --format=csv,noheader,nounits >"$WORK/smi.csv" 2>"$WORK/smi.err"
  echo "nvidia-smi rc=$?" >>"$WORK/smi.err"
  timeout 20 nvidia-smi >"$WORK/smi.txt" 2>&1
fi
step env 60 "$WORK/env.txt" "$WORK/env.txt" "${COLLECT[@]}" env "$WORK"
{ cat "$WORK/setup.txt"; echo "===== nvidia-smi"; cat "$WORK/smi.csv" "$WORK/smi.err" "$WORK/smi.txt" 2>/dev/null
  echo; cat "$WORK/env.txt"; } >"$OUT/gpu.txt"
finish

# ---- b. bench peers, fp32 (TF32), then c. train + exact resume, then d. the tests, then bf16 peers
peers() {  # PRECISION ROW CAP [extra args]
  local prec=$1 row=$2 cap=$3; shift 3
  local extra=()
  [ "$prec" != fp32 ] && extra=(--precision "$prec")
  step "peers-$prec-$row" "$cap" "$WORK/peers-$prec-$row.stdout" "$OUT/bench.log" \
    "${FC[@]}" bench peers --device "$DEV" --rows "$row" --steps ${FLOWCTL_GPU_STEPS:-5} --rounds ${FLOWCTL_GPU_ROUNDS:-3} --json \
    --out "$WORK/peers-$prec-$row.json" "${extra[@]}" "$@"
  finish
}
peers fp32 lstm_lm 90 ${FLOWCTL_GPU_PROFILE:+--profile}
peers fp32 inception_v3_b32 120 ${FLOWCTL_GPU_PROFILE:+--profile}

step train-20 60 "$WORK/train-a.json" "$OUT/train.log" \
  "${FC[@]}" train specs/lstm_lm.yaml --steps 20 --set "devices=[$DEV]" --run-dir "$WORK/a" --json
step train-10 45 "$WORK/train-b.json" "$OUT/train.log" \
  "${FC[@]}" train specs/lstm_lm.yaml --steps 10 --set "devices=[$DEV]" --run-dir "$WORK/b" --json
step resume-20 45 "$WORK/resume-b.json" "$OUT/train.log" "${FC[@]}" resume "$WORK/b" --steps 20 --json
"${COLLECT[@]}" train "$WORK" "$OUT" >>"$OUT/train.log" 2>&1
finish

# ---- d. the gpu-marked tests (all of tests/), and beside them the CPU tests of the GPU machinery
pt_timeout=()
"$PY" -c "import pytest_timeout" 2>/dev/null && pt_timeout=(--timeout=90)
cpu_files=()
for f in ${FLOWCTL_GPU_CPU_TESTS:-tests/test_ledger.py tests/test_cuda_kernels.py tests/test_capture.py tests/test_cuda_blas.py tests/test_cudnn.py tests/test_late_read.py tests/test_multi_apply.py tests/test_multi_l2.py tests/test_fused_gpu.py tests/test_collective.py}; do
  [ -e "$f" ] && cpu_files+=("$f")
done
if [ ${#cpu_files[@]} -gt 0 ]; then
  # CPU-only tests: they run while the GPU tests run (no timing is read from either)
  step pytest-cpu 120 "$WORK/pytest-cpu.txt" "$WORK/pytest-cpu.txt" \
    "$PY" -m pytest -q -m "not slow and not gpu" -p no:cacheprovider "${pt_timeout[@]}" "${cpu_files[@]}" &
  cpu_pid=$!
else
  echo "none of the CPU test files is there" >"$WORK/pytest-cpu.txt"; cpu_pid=
fi
step pytest-gpu ${FLOWCTL_GPU_PYTEST_CAP:-150} "$WORK/pytest-gpu.txt" "$WORK/pytest-gpu.txt" \
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors "${pt_timeout[@]}" tests/
[ -n "$cpu_pid" ] && wait "$cpu_pid"
{ echo "##### pytest -m gpu tests/"; cat "$WORK/pytest-gpu.txt"
  echo; echo "##### pytest -m 'not slow and not gpu' ${cpu_files[*]}"; cat "$WORK/pytest-cpu.txt"; } >"$OUT/pytest.txt"
finish


P2=${FLOWCTL_GPU_PRECISION2:-bf16}
peers "$P2" lstm_lm 60
peers "$P2" inception_v3_b32 90

# ---- e. the summary: the last lines printed
if [ -s "$WORK/collect.err" ]; then { echo "===== collect.py errors"; cat "$WORK/collect.err"; } >>"$OUT/gpu.txt"; fi
echo
echo "===== summary (total $((SECONDS - t0)) s; files under \$OUT: $(cd "$OUT" && ls | tr '\n' ' '))"
finish --print || cat "$OUT/summary.txt" 2>/dev/null
