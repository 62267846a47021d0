#!/usr/bin/env bash
# The GPU half of the benchmark suite, for a lent GPU machine (../shared/device/README.md): the
# carried wheels installed, the kernels built, then pieces that each run under their own time
# limit and within the call's budget, packed after every piece so a call stopped early keeps
# what ran.
#
#   bash benchmarks/gpu_suite.sh lease    # the next lease's first call, 9 minutes on an H100
#                                         # after the machine's start, the kernels' build
#                                         # included: the CUDA tests (the no-sync and
#                                         # captured-step ones among them), graphs.py (the
#                                         # whole step as one CUDA graph on densenet161, 32 and
#                                         # 224 px, O2 and O0, beside the hand loop and
#                                         # Lightning 16-mixed), Apex's tests on CUDA,
#                                         # fused_step.py, the mission's command at O0 and O2
#                                         # on densenet161 (steady.py: 224 px, 60 steps),
#                                         # peers.py on ResNet-50 tuned by trainer.tune
#                                         # against Lightning 16-mixed / bf16-mixed
#   bash benchmarks/gpu_suite.sh lease2   # its second call on the same warm machine, in the
#                                         # ~300 s a 15-minute lease has left (budget 280 s):
#                                         # densenet161's profile (224 px, and 32 px as the
#                                         # mission's command trains) and levels, GPT-2 small
#                                         # eager / fp8, torchtitan's float8 peer, then fp16
#                                         # accuracy parity, GPT-2 compiled, the ViT's
#                                         # compiled fp8 rows, the layer-plan cost,
#                                         # densenet161 tuned, as time allows
#                                         # (both parts skip what earlier leases measured on
#                                         # unchanged code: GPU_SUITE_SKIP below)
#   bash benchmarks/gpu_suite.sh 1|2|3|4  # the whole GPU table in four calls of under 10
#                                         # minutes (levels of five models, compiled rows,
#                                         # accuracy, GPT-2 small, lm_parity, FSDP)
#
# Options after the part: --dry runs every piece on this machine's CPU at tiny sizes (the same
# scripts, flags and levels, smaller images, batches and step counts, results into $OUT as
# *_cpu_dry.*), a check that nothing fails on the GPU for want of a key or an import; --list
# prints each piece (name, limit in seconds, command) and runs nothing.
#
# Once, here: `../shared/device/make-wheels.sh .whl` (with /.whl/ in .git/info/exclude); then one
# device call per part with carry [".whl"] (and ".apex", a git repo of Apex's tests/L0/run_amp,
# for Apex's tests on CUDA), e.g. `bash benchmarks/gpu_suite.sh lease`. $OUT receives three
# files: environment.txt, summary_<part>.txt (each piece's exit status and time) and
# <part>.tar.gz with logs/<piece>.log and results/ (the lease parts write their results there
# directly, named *_cuda.*; parts 1-4 copy benchmarks/results/<gpu>/*_cuda.*). Unpack it,
# rename the files for the GPU (e.g. kernels_h100.md) and commit them in
# benchmarks/results/<gpu>/ with the command, commit and versions (gpu_run_<gpu>.md), and list
# each in benchmarks/results/README.md.
#
# Environment: OUT (required: where the three files go), GPU_SUITE_WORK (default
# /tmp/gpu_suite_<part>), PYTHON (default python3), GPU_SUITE_BUDGET_S (default 540 for lease,
# 280 for lease2, 560 for parts 1-4: no piece runs past this many seconds after the start),
# GPU_SUITE_SKIP (pieces by name, comma-separated, not to run: e.g. rows an earlier lease measured;
# unset, the lease parts skip what the H200 of 2026-11-29 or 11-28 measured on code unchanged
# since, named in the call's first lines; GPU_SUITE_SKIP= runs every piece),
# GPU_SUITE_XDIST (the CUDA tests' pytest-xdist workers, default 4),
# CUDA_HOME (found from nvcc when unset), AMP_RUNNER_KERNEL_CACHE (default /tmp/amp-runner-kernels).
# The lease's pieces add up to more than its budget (on the H200 of 2026-11-28 the build took
# 125 s, the CUDA tests 174 s, Apex's 33 s, fused_step.py 17 s of a 505 s budget, which left 126 s
# for graphs.py, stopped at its 90 s, and the tuned peers, at 35 s; graphs.py now follows the
# tests, with the ~240 s they leave): skip the pieces an earlier lease ran on code that has not
# changed since, to reach the later ones, e.g. GPU_SUITE_SKIP=tests_apex_l0_cuda,bench_kernels.
#
# Parts 1-4 (sizes from the first runs on an H200: kernels build 68 s, CUDA tests with 4 workers
# 108 s, fused_step.py 9 s, ResNet-50's eager rows 84 s, peers 49 s, the ViT's two compiled rows
# 84 s): part 3 holds the compiled rows, since compiling a 224-px model takes tens of seconds per
# cell. Between them, copy the previous part's results/levels_cuda.json into
# benchmarks/results/<gpu>/ so that the next part's `levels --merge` completes the same table, or
# combine them later with
# `python -m benchmarks.levels --from-json part1/levels_cuda.json part2/... part3/...`
# (also the way to draw the figure where the GPU machine has no matplotlib).
set -uo pipefail

PART=${1:-}
shift || true
DRY=0
LIST=0
for arg in "$@"; do
  case "$arg" in
    --dry) DRY=1 ;;
    --list) LIST=1 ;;
    *) echo "unknown option $arg (allowed: --dry, --list)" >&2; exit 2 ;;
  esac
done
if [[ ! "$PART" =~ ^([1-4]|lease|lease2)$ ]]; then
  echo "usage: bash benchmarks/gpu_suite.sh lease|lease2|1|2|3|4 [--dry] [--list]" >&2
  exit 2
fi
if [[ "$DRY" == 1 && "$PART" != lease* ]]; then
  echo "--dry checks the lease parts; parts 1-4 are the whole table, run on a GPU" >&2
  exit 2
fi
if [[ -z "${OUT:-}" && "$LIST" == 0 ]]; then
  echo "OUT is not set: point it at the folder for logs and results (the device tool sets it)" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=${GPU_SUITE_WORK:-/tmp/gpu_suite_$PART}
DEV=cuda
TAG=cuda
if [[ "$DRY" == 1 ]]; then
  DEV=cpu
  TAG=cpu_dry
  WORK=${GPU_SUITE_WORK:-/tmp/gpu_suite_${PART}_dry}
fi
RES=$WORK/results
BUDGET=${GPU_SUITE_BUDGET_S:-560}
[[ "$PART" == lease ]] && BUDGET=${GPU_SUITE_BUDGET_S:-540}
[[ "$PART" == lease2 ]] && BUDGET=${GPU_SUITE_BUDGET_S:-280}
[[ "$DRY" == 1 ]] && BUDGET=${GPU_SUITE_BUDGET_S:-7200}
T0=$SECONDS
SUMMARY=()
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export AMP_RUNNER_KERNEL_CACHE=${AMP_RUNNER_KERNEL_CACHE:-/tmp/amp-runner-kernels}
if [[ "$LIST" == 0 ]]; then
  rm -rf "$WORK/logs" "$RES"  # an earlier run of this part on the same machine
  mkdir -p "$OUT" "$WORK/logs" "$RES" || exit 2
fi

# pack: the logs and the results so far into $OUT/<part>.tar.gz (one file back, not dozens).
pack() {
  [[ "$PART" == lease* ]] || cp -f benchmarks/results/*/*_cuda.* "$RES/" 2>/dev/null
  cp -f "$OUT/environment.txt" "$WORK/" 2>/dev/null
  tar -czf "$OUT/$PART.tar.gz" -C "$WORK" . || echo "packing $WORK into $OUT failed" >&2
}

# piece NAME CAP COMMAND...: run COMMAND for at most CAP seconds (less when the budget is
# nearly spent; SIGINT first, so Python stops cleanly), log to $WORK/logs/NAME.log, show its
# tail, pack the logs and results. With --list: print NAME, CAP and COMMAND only.
piece() {
  local name=$1 cap=$2
  shift 2
  if [[ "$LIST" == 1 ]]; then
    printf '%s\t%s\t%s\n' "$name" "$cap" "$*"
    return
  fi
  if [[ ",${GPU_SUITE_SKIP:-}," == *",$name,"* ]]; then
    echo "== $name: skipped (GPU_SUITE_SKIP)"
    SUMMARY+=("$name: skipped (GPU_SUITE_SKIP)")
    return
  fi
  (( DRY )) && cap=$(( cap * 10 ))  # a CPU is slower: the dry run checks, it does not time
  local left=$(( BUDGET - (SECONDS - T0) ))
  if (( left < 20 )); then
    echo "== $name: not run, ${left}s of the ${BUDGET}s budget left"
    SUMMARY+=("$name: not run (budget spent)")
    return
  fi
  local limit=$(( cap < left ? cap : left ))
  local started=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$WORK/logs/$name.log"
  local note=""
  (( rc == 124 )) && note=" (stopped at its time limit)"
  SUMMARY+=("$name: exit $rc in $(( SECONDS - started ))s$note")
  pack
}

# small VALUE_ON_GPU VALUE_DRY: the GPU's value, or the dry run's.
small() { if [[ "$DRY" == 1 ]]; then echo "$2"; else echo "$1"; fi; }

# What earlier leases measured on code unchanged since, skipped unless GPU_SUITE_SKIP is set (a
# dry run checks every piece): the tuned ResNet-50 peers, DenseNet-161's profile, fp16 accuracy
# parity and the layer-plan cost (2026-11-29). fused_step.py runs again: its row (f), torch's
# fused AdamW under its GradScaler, is newer than the last lease.
if [[ -z "${GPU_SUITE_SKIP+set}" && "$DRY" == 0 ]]; then
  [[ "$PART" == lease ]] && GPU_SUITE_SKIP=bench_peers_tuned_rn50
  [[ "$PART" == lease2 ]] && GPU_SUITE_SKIP=profile_densenet,bench_accuracy_fp16,bench_layer_plan
fi

[[ "$LIST" == 1 && -n "${GPU_SUITE_SKIP:-}" ]] && echo "# skipped (GPU_SUITE_SKIP): $GPU_SUITE_SKIP"
if [[ "$LIST" == 0 ]]; then
  echo "== $PART on $(hostname), budget ${BUDGET}s$( [[ $DRY == 1 ]] && echo ', dry: CPU, tiny sizes')"
  [[ -n "${GPU_SUITE_SKIP:-}" ]] && echo "== skipping (GPU_SUITE_SKIP): $GPU_SUITE_SKIP"
  # 1. The packages the image lacks, from the carried wheels (../shared/device/README.md); not
  # in a dry run, which uses this machine's packages (the wheels are for the GPU's Python).
  if [[ "$DRY" == 0 ]] && compgen -G ".whl/*.whl" > /dev/null; then
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
  if [[ "$DRY" == 0 ]]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
      echo "no CUDA device here: this suite is for a GPU machine (--dry checks it on a CPU)" >&2
      exit 1
    }
  fi
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
    nvidia-smi 2> /dev/null || echo "no nvidia-smi here"
    "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'cudnn', torch.backends.cudnn.version(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
    echo "CUDA_HOME=${CUDA_HOME:-unset}"
    "$PY" -m pip list 2>/dev/null \
      | grep -i -E "^(torch|torchvision|torchao|lightning|mlflow|hydra-core|omegaconf|matplotlib|nvidia-ml-py) "
  } > "$OUT/environment.txt" 2>&1
  head -n 40 "$OUT/environment.txt" | grep -E "torch|CUDA_HOME|NVIDIA|H100|H200" | head -n 8
  "$PY" -c "import matplotlib" 2> /dev/null \
    || echo "note: no matplotlib here: levels.py writes no PNG (draw it later with --from-json)"
  "$PY" -c "import pynvml; pynvml.nvmlInit()" 2> /dev/null \
    || echo "note: no NVML here: runs log no system/gpu_* metrics (carry nvidia-ml-py's wheel)"
fi

# 3. The kernels (C++ and CUDA), into the cache the runner loads them from (dry: for an H100's
# and H200's 9.0, as this machine has no GPU to build for).
[[ "$DRY" == 1 ]] && export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
piece kernels_build 300 "$PY" -m runner.csrc build -v

# The levels of the table (levels.py's CUDA defaults, named here so that each piece measures only
# its share): the eager rows, with and without fp8, and the compiled rows.
BASE=o0,o1,o2,o3,o1_bf16,o2_bf16,o3_bf16,torch_amp
EAGER=$BASE,o1_fp8,o2_fp8
COMPILED=o0+compile,o1_bf16+compile,o2_bf16+compile,o1_fp8+compile,o2_fp8+compile
VIT=torchvision:vit_b_16
XDIST=()
# a crashed worker restarts; GPU_SUITE_XDIST workers (default 4; 8 on 16 cores takes the tests
# from ~170 s to about the longest test's minute plus the rest spread)
"$PY" -c "import xdist" 2> /dev/null && [[ "$DRY" == 0 ]] && XDIST=(-n "${GPU_SUITE_XDIST:-4}")
# The CUDA tests; dry: collected only (their imports and fixtures), as they skip without CUDA.
GPU_TESTS=(-m pytest -q -p no:cacheprovider -rfE --durations=30 -m gpu tests)
[[ "$DRY" == 1 ]] && GPU_TESTS+=(--collect-only)
# Sizes: the GPU's, or the dry run's (one or two steps on tiny inputs).
LV=(--steps "$(small 30 1)" --warmup "$(small 10 1)")
[[ "$DRY" == 1 ]] && LV+=(--image-size 16 --batch-size 2 --no-prime)
PEER=(--steps "$(small 20 1)" --warmup "$(small 5 1)" --rounds "$(small 3 1)")
[[ "$DRY" == 1 ]] && PEER+=(--image-size 16 --batch-size 2)
GPT=(--image-size "$(small 1024 32)" --batch-size "$(small 8 1)" --extra model.vocab_size=50304)
# the runner at its defaults with trainer.tune=on (channels_last, cudnn.benchmark, the fused
# kernels or torch's ops, compile where 20000 steps repay it: about two ImageNet epochs at batch
# 128) against Lightning at its defaults; its own tuning cache. Tuning is bounded by 60 s a
# level (it runs once for each of the two peers' levels, and overruns by one candidate at most),
# so that tuning and 3 rounds of 20-step blocks a side fit the pieces' limits (about 180 s of
# ResNet-50's 200 and DenseNet-161's): on the H200 timing ResNet-50's defaults took 17-21 s (the
# first step's cuDNN search and the process's first CUDA work), and with room kept to time them
# again, 30 s left no other candidate a chance; a DenseNet-161 candidate takes up to 35 s, a
# compile 40-80 s, which the budget skips, saying so in the table
export AMP_RUNNER_TUNE_CACHE=$WORK/tune-cache
TUNED=(--device "$DEV" --tuned --run-steps "$(small 20000 50)" --tune-budget-s 60)
TUNED+=(--peers lightning:16-mixed,lightning:bf16-mixed "${PEER[@]}")

# trainer.cuda_graphs=step, the whole step replayed as one CUDA graph, against the eager step,
# the hand-written loop and Lightning 16-mixed (graphs.py, issue 72's targets): DenseNet-161 at
# 32 px, batch 128 (the mission's shape) then 224 px, batch 64, O2 then O0, each group's sides
# interleaved, the table written after each group. Its size, estimated from the H200's DenseNet-161
# steps (~100 ms eager at either shape, host-bound; 57-81 ms of device work at 224 px) and the
# cuDNN autotuning of each shape and dtype (tens of seconds at 224 px): about 45 s and 25 s at
# 32 px, 75 s and 65 s at 224 px; a limit that stops the last group keeps the others. Dry: the
# eager sides at 32 px, batch 2 (a CPU refuses the capture in planning, and the table says so)
GRAPHS=(--shapes "$(small 32x128,224x64 32x2)" --steps "$(small 10 1)" --rounds "$(small 3 1)")
GRAPHS+=(--warmup "$(small 5 1)" --busy-steps "$(small 5 2)")

if [[ "$PART" == lease ]]; then
  # correctness first: the CUDA tests (the fused step's no-sync tests, the step timer's, the
  # captured step's), then what changed since the last lease or never ran there, in order of
  # priority (ResNet-50's levels and peers met their targets on an H100 on 2026-11-27: parts 1-4)
  piece tests_gpu 240 "$PY" "${GPU_TESTS[@]}" "${XDIST[@]}"
  # the whole-step graph's benchmark first: every target of issue 72 rests on it
  piece bench_graphs 240 "$PY" -m benchmarks.graphs --device "$DEV" "${GRAPHS[@]}" \
    --out "$RES/graphs_$TAG.md"
  # Apex's own amp tests on CUDA, where .apex/ (a git repo of Apex's tests/L0/run_amp) is carried
  if [[ -z "${APEX_GIT:-}" && -d .apex/.git ]]; then
    export APEX_GIT=$ROOT/.apex APEX_COMMIT=${APEX_COMMIT:-HEAD}
  fi
  if [[ -n "${APEX_GIT:-}" && "$DRY" == 0 ]]; then
    APEX_DEVICE=cuda PYTHON="$PY" piece tests_apex_l0_cuda 60 bash tests/helpers/apex_l0.sh
  fi
  piece bench_kernels 45 "$PY" -m benchmarks.fused_step --device "$DEV" \
    --iters "$(small 50 2)" --warmup "$(small 2 1)" --out "$RES/kernels_$TAG.md"
  # the mission's command as a user types it, O0 and O2, one process each; its logged steady
  # samples_per_s ratio against levels.py's for the same model and batch (within 10%). On the
  # H200 of 2026-11-28 the two runs took 82 s and 66 s, and levels.py's two DenseNet-161 cells
  # about a minute each; steady.py writes the runs' figures before levels.py starts
  STEADY=(--model densenet161 --steps "$(small 60 4)")
  [[ "$DRY" == 1 ]] && STEADY+=(--image-size 32 --batch-size 2 --workers 0 --levels o0,o2)
  piece steady_densenet 300 "$PY" -m benchmarks.steady --device "$DEV" "${STEADY[@]}" \
    --work "$WORK/steady" --out "$RES/steady_$TAG.md"
  piece bench_peers_tuned_rn50 200 "$PY" -m benchmarks.peers "${TUNED[@]}" --model resnet50 \
    --out "$RES/peers_tuned_rn50_$TAG.md"
elif [[ "$PART" == lease2 ]]; then
  # what never ran on a GPU, in what is left of the lease after the first call (about 300 s);
  # sizes from the H200 lease of 2026-11-27: GPT-2 small's o0, o1_bf16 and o2_bf16 cells 46 s
  # with the priming, its eager o1_fp8 cell over 14 s; torchtitan's float8 peer over 90 s;
  # a DenseNet-161 cell about a minute (its first steps' cuDNN search over ~160 shapes)
  # first, why O2 trained DenseNet-161 no faster than O0 on the H200 of 2026-11-28 (103 ms a
  # step each at batch 64, the loader idle): where each level's step spends its time, and
  # whether the GPU waits for the host (profile_step.py), then its levels beside the hand
  # autocast loop (torch_amp)
  PROF=(--model densenet161 --levels o0,o2)
  [[ "$DRY" == 1 ]] && PROF+=(--image-size 16 --batch-size 2 --warmup 1 --steps 1)
  piece profile_densenet 150 "$PY" -m benchmarks.profile_step --device "$DEV" "${PROF[@]}" \
    --out "$RES/profile_step_densenet_$TAG.md"
  # the mission's command at its own size (CIFAR-10's 32 px, the default batch of 128): at
  # 224 px and batch 64 the host bounded O2's step on the H200 of 2026-11-29 (the GPU busy 56%);
  # at 32 px the GPU's share of each step is far smaller, so O2 may gain nothing there at all
  CIFAR=(--model densenet161 --levels o0,o2 --image-size 32 --batch-size "$(small 128 2)")
  [[ "$DRY" == 1 ]] && CIFAR+=(--warmup 1 --steps 1)
  piece profile_densenet_cifar 100 "$PY" -m benchmarks.profile_step --device "$DEV" \
    "${CIFAR[@]}" --out "$RES/profile_step_densenet_cifar_$TAG.md"
  piece bench_levels_densenet 240 "$PY" -m benchmarks.levels --device "$DEV" \
    --models densenet161 --levels o0,o1,o2,torch_amp "${LV[@]}" \
    --out "$RES/levels_densenet_$TAG.md"
  GOUT=$RES/levels_gpt_$TAG.md
  piece bench_levels_gpt 120 "$PY" -m benchmarks.levels --device "$DEV" --models gpt2_small \
    "${GPT[@]}" --levels o0,o1_bf16,o2_bf16,o1_fp8 "${LV[@]:0:4}" --out "$GOUT"
  piece bench_peers_gpt 150 "$PY" -m benchmarks.peers --device "$DEV" --model gpt2_small \
    "${GPT[@]}" --peers titan:float8,hand:o1_bf16,lightning:bf16-mixed "${PEER[@]:0:6}" \
    --out "$RES/peers_gpt_$TAG.md"
  # fp16 accuracy parity: O1 and O2 within 1 point of O0, as many seeds as fit (each run is
  # written when it ends: a piece stopped at its limit keeps the seeds it finished)
  ACC=(--levels o0,o1,o2 --seeds "$(small 0,1,2,3,4 0)" --epochs "$(small 10 1)")
  [[ "$DRY" == 0 ]] && ACC+=(--extra trainer.num_workers=8)
  [[ "$DRY" == 1 ]] && ACC+=(--extra data.num_train=64 data.num_val=32)
  piece bench_accuracy_fp16 270 "$PY" -m benchmarks.accuracy --device "$DEV" "${ACC[@]}" \
    --out "$RES/accuracy_fp16_$TAG.md"
  piece bench_levels_gpt_compiled 90 "$PY" -m benchmarks.levels --device "$DEV" \
    --models gpt2_small "${GPT[@]}" --levels o1_bf16+compile,o1_fp8+compile "${LV[@]:0:4}" \
    --merge --out "$GOUT"
  VIT_SIZE=()
  # (torchvision's ViT-B/16 takes 224-px images only)
  [[ "$DRY" == 1 ]] && VIT_SIZE=(--steps 1 --warmup 1 --image-size 224 --batch-size 1 --no-prime)
  piece bench_levels_vit_compiled 180 "$PY" -m benchmarks.levels --device "$DEV" \
    --models "$VIT" --levels o1_bf16+compile,o1_fp8+compile,o2_fp8+compile "${VIT_SIZE[@]}" \
    --out "$RES/levels_vit_$TAG.md"
  LP=(--models resnet50,gpt_tiny --levels o1,o2)
  [[ "$DRY" == 1 ]] && LP+=(--image-size 16 --batch-size 2 --steps 1 --rounds 1)
  [[ "$DRY" == 0 ]] && LP+=(--image-size 224 --batch-size 64)
  piece bench_layer_plan 80 "$PY" -m benchmarks.layer_plan_cost --device "$DEV" "${LP[@]}" \
    --out "$RES/layer_plan_cost_$TAG.md"
  DENSE=()
  [[ "$DRY" == 0 ]] && DENSE=(--batch-size 64)
  piece bench_peers_tuned_densenet 240 "$PY" -m benchmarks.peers "${TUNED[@]}" "${DENSE[@]}" \
    --model densenet161 --out "$RES/peers_tuned_densenet_$TAG.md"
elif [[ "$PART" == 1 ]]; then
  piece tests_gpu 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
  piece tests_kernels 120 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/unit/test_kernels.py
  piece bench_kernels 120 "$PY" -m benchmarks.fused_step --device "$DEV"
  piece bench_overhead 120 "$PY" -m benchmarks.overhead --device "$DEV"
  piece bench_levels_1 300 "$PY" -m benchmarks.levels --device "$DEV" --models resnet18,resnet50 \
    --levels "$EAGER"
elif [[ "$PART" == 2 ]]; then
  piece bench_levels_vit 180 "$PY" -m benchmarks.levels --device "$DEV" --models "$VIT" \
    --levels "$EAGER" --merge
  # DenseNet-161 has no Linear layer fp8 could take here (its head has 10 outputs): no fp8 rows;
  # VGG-16-BN's two 4096-wide classifier layers run in fp8
  piece bench_levels_2 200 "$PY" -m benchmarks.levels --device "$DEV" --models densenet161 \
    --levels "$BASE" --merge
  piece bench_levels_2b 200 "$PY" -m benchmarks.levels --device "$DEV" --models vgg16_bn \
    --levels "$EAGER" --merge
elif [[ "$PART" == 4 ]]; then
  # a language model: sizes are tokens per sequence (1024); GPT-2's vocabulary padded to 50304
  # (a multiple of 64, as nanoGPT does) over the synthetic language's ids
  GPT=(--models gpt2_small --image-size 1024 --batch-size 8 --extra model.vocab_size=50304)
  piece bench_levels_gpt 180 "$PY" -m benchmarks.levels --device "$DEV" "${GPT[@]}" \
    --levels o0,o1_bf16,o2_bf16,o3_bf16_sr,o1_fp8,o2_fp8 --merge
  piece bench_levels_gpt_compiled 180 "$PY" -m benchmarks.levels --device "$DEV" "${GPT[@]}" \
    --levels o1_bf16+compile,o2_bf16+compile,o1_fp8+compile --merge
  # language-model parity where a step costs milliseconds: 2000 steps a run (the CPU table's
  # 400 leave the seeds' spread wider than the targets)
  piece bench_lm_parity 180 "$PY" -m benchmarks.lm_parity --device "$DEV" --steps 2000 \
    --levels o0,o1_bf16,o2_bf16,o3_bf16_sr,o1_fp8 --overhead-rounds 10
  # sharded runs (FSDP2) where the machine has several GPUs: GPT-2 small over all of them at
  # o2_bf16 and o1_fp8, tokens/s and memory by kind per rank in an MLflow store under results/
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [[ "$NGPU" -ge 2 ]]; then
    for LEVEL in o2_bf16 o1_fp8; do
      piece "bench_fsdp_$LEVEL" 90 "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node="$NGPU" -m runner trainer.strategy=fsdp precision=$LEVEL \
        model=gpt2_small model.vocab_size=50304 data=synthetic_text data.block_size=1024 \
        trainer.batch_size=8 trainer.max_epochs=1 trainer.limit_train_batches=50 \
        trainer.limit_val_batches=5 trainer.progress_bar=false trainer.checkpoint_every_n_epochs=0 \
        "mlflow.tracking_uri=sqlite:///$WORK/results/fsdp_cuda.db"
    done
  fi
  # precision per layer: a head kept in fp32 (input casts on every layer at O2), the audit's step
  piece bench_layer_plan 60 "$PY" -m benchmarks.layer_plan_cost --device "$DEV" \
    --models resnet50,gpt_tiny --levels o1,o2 --image-size 224 --batch-size 64
else
  piece bench_levels_compiled 330 "$PY" -m benchmarks.levels --device "$DEV" \
    --models "$VIT",resnet50 --levels "$COMPILED" --merge
  # the new presets and the fp16 levels first (a piece stopped early keeps the runs it finished);
  # no fp8 or compiled rows: the tiny CNN has no fp8-able layer, and compiling changes no
  # accuracy that the CPU table does not already show
  piece bench_accuracy 240 "$PY" -m benchmarks.accuracy --device "$DEV" \
    --levels o0,o1,o2,o2_bf16,o3_bf16_sr,o3,o1_bf16,o3_bf16 --extra trainer.num_workers=8
fi

[[ "$LIST" == 1 ]] && exit 0
echo
echo "== $PART done in $(( SECONDS - T0 ))s; logs and results in $OUT/$PART.tar.gz"
printf '  %s\n' "${SUMMARY[@]}" | tee "$OUT/summary_$PART.txt"
cp -f "$OUT/summary_$PART.txt" "$WORK/" && pack
tar -tzf "$OUT/$PART.tar.gz" | grep -v '/$'
