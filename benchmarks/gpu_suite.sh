#!/usr/bin/env bash
# The GPU half of the benchmark suite in two commands of under 10 minutes each, for a lent GPU
# machine (see ../shared/device/README.md): the carried wheels installed, the kernels built, the
# CUDA tests, then the GPU benchmarks. Every log goes to $OUT/<piece>.log and the results files
# (benchmarks/results/*) are copied to $OUT/results/ after every piece, so a piece stopped at its
# time limit still leaves what it wrote. Commit those files from $OUT/results/ afterwards.
#
#   bash benchmarks/gpu_suite.sh 1   # kernels build, CUDA tests, kernels.py, overhead.py,
#                                    # levels.py for resnet18 and resnet50      (~8-9 minutes)
#   bash benchmarks/gpu_suite.sh 2   # kernels build, accuracy.py (3 seeds, 7 levels),
#                                    # levels.py for densenet161 and vgg16_bn, merged (~8-9 min)
#
# Before part 1, once: `../shared/device/make-wheels.sh .whl` (with /.whl/ in .git/info/exclude)
# and give the device call carry [".whl"]; each part is one call, e.g. the command
# `bash benchmarks/gpu_suite.sh 1` (its $OUT/results/ come back with the call's files).
# Between the parts, copy part 1's results/levels_cuda.json into benchmarks/results/ so that part
# 2's `levels.py --merge` completes the same table; otherwise combine the two afterwards with
#   python benchmarks/levels.py --from-json part1/levels_cuda.json part2/levels_cuda.json
# (also the way to draw the figure where the GPU machine has no matplotlib).
# Environment: OUT (required: where logs and results go), PYTHON (default python3),
# GPU_SUITE_BUDGET_S (default 560: no piece runs past this many seconds after the start),
# CUDA_HOME (found from nvcc when unset), AMP_RUNNER_KERNEL_CACHE (default /tmp/amp-runner-kernels).
set -uo pipefail

PART=${1:-}
if [[ "$PART" != 1 && "$PART" != 2 ]]; then
  echo "usage: bash benchmarks/gpu_suite.sh 1|2   (PART 1 or 2, two commands under 10 minutes)" >&2
  exit 2
fi
if [[ -z "${OUT:-}" ]]; then
  echo "OUT is not set: point it at the folder for logs and results (the device tool sets it)" >&2
  exit 2
fi
mkdir -p "$OUT/results"
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
BUDGET=${GPU_SUITE_BUDGET_S:-560}
T0=$SECONDS
SUMMARY=()
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export AMP_RUNNER_KERNEL_CACHE=${AMP_RUNNER_KERNEL_CACHE:-/tmp/amp-runner-kernels}

# piece NAME CAP COMMAND...: run COMMAND for at most CAP seconds (less when the budget is
# nearly spent; SIGINT first, so Python stops cleanly), log to $OUT/NAME.log, show its tail,
# copy the results files to $OUT/results/.
piece() {
  local name=$1 cap=$2
  shift 2
  local left=$(( BUDGET - (SECONDS - T0) ))
  if (( left < 20 )); then
    echo "== $name: not run, ${left}s of the ${BUDGET}s budget left"
    SUMMARY+=("$name: not run (budget spent)")
    return
  fi
  local limit=$(( cap < left ? cap : left ))
  local started=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/$name.log"
  local note=""
  (( rc == 124 )) && note=" (stopped at its time limit)"
  SUMMARY+=("$name: exit $rc in $(( SECONDS - started ))s$note")
  cp -f benchmarks/results/* "$OUT/results/" 2>/dev/null
}

echo "== part $PART on $(hostname), budget ${BUDGET}s"
# 1. The packages the image lacks, from the carried wheels (../shared/device/README.md).
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import hydra, omegaconf, mlflow, torch, torchvision" || {
  echo "missing packages: carry their wheels in .whl/ (../shared/device/make-wheels.sh .whl)" >&2
  exit 1
}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA device here: this suite is for a GPU machine (see benchmarks/README.md)" >&2
  exit 1
}
# 2. The CUDA toolkit for the kernels' build.
if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc > /dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  else
    for d in /usr/local/cuda /usr/local/cuda-*; do
      [[ -x "$d/bin/nvcc" ]] && CUDA_HOME=$d && break
    done
  fi
  [[ -n "${CUDA_HOME:-}" ]] && export CUDA_HOME
fi
{
  nvidia-smi
  "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(0))"
  echo "CUDA_HOME=${CUDA_HOME:-unset}"
  "$PY" -m pip list 2>/dev/null \
    | grep -i -E "^(torch|torchvision|mlflow|hydra|omegaconf|matplotlib) "
} > "$OUT/environment.txt" 2>&1
head -n 40 "$OUT/environment.txt" | grep -E "torch|CUDA_HOME|NVIDIA|H100|H200" | head -n 8
"$PY" -c "import matplotlib" 2> /dev/null \
  || echo "note: no matplotlib here: levels.py writes no PNG (draw it later with --from-json)"

# 3. The kernels (C++ and CUDA), into the cache the runner loads them from.
piece kernels_build 300 "$PY" -m runner.csrc build -v

if [[ "$PART" == 1 ]]; then
  piece tests_gpu 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
  piece tests_kernels 120 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_kernels.py
  piece bench_kernels 120 "$PY" benchmarks/kernels.py --device cuda
  piece bench_overhead 120 "$PY" benchmarks/overhead.py --device cuda
  piece bench_levels_1 300 "$PY" benchmarks/levels.py --device cuda --models resnet18,resnet50
else
  piece bench_accuracy 270 "$PY" benchmarks/accuracy.py --device cuda \
    --extra trainer.num_workers=8
  piece bench_levels_2 360 "$PY" benchmarks/levels.py --device cuda \
    --models densenet161,vgg16_bn --merge
fi

echo
echo "== part $PART done in $(( SECONDS - T0 ))s; logs and results in $OUT"
printf '  %s\n' "${SUMMARY[@]}" | tee "$OUT/summary_part$PART.txt"
ls "$OUT/results"
