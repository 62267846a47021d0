#!/usr/bin/env bash
# The GPU half of the benchmark suite in three commands of under 10 minutes each, for a lent GPU
# machine (see ../shared/device/README.md): the carried wheels installed, the kernels built, the
# CUDA tests, then the GPU benchmarks. $OUT receives three files, since the device tool brings
# back at most 8: environment.txt, summary_part<N>.txt (each piece's exit status and time) and
# part<N>.tar.gz, which holds logs/<piece>.log and results/ (the *_cuda.* results files) and is
# rewritten after every piece, so a piece stopped at its time limit still leaves what it wrote
# (levels.py and accuracy.py write after every cell/run). Unpack it and commit the results files.
#
#   bash benchmarks/gpu_suite.sh 1   # kernels build, CUDA tests, kernels.py, overhead.py,
#                                    # levels.py eager rows for resnet18, resnet50 (fp8 included)
#   bash benchmarks/gpu_suite.sh 2   # kernels build, levels.py eager rows for the ViT
#                                    # (vit_b_16), densenet161 and vgg16_bn, merged
#   bash benchmarks/gpu_suite.sh 3   # kernels build, levels.py compiled rows (o0, o1_bf16,
#                                    # o2_bf16, o1_fp8, o2_fp8 +compile) for the ViT and resnet50,
#                                    # merged; accuracy.py (3 seeds, 8 levels) in what is left
#   bash benchmarks/gpu_suite.sh 4   # kernels build, levels.py rows for GPT-2 small (the runner's
#                                    # gpt2_small: 12 layers, width 768, 1024-token sequences,
#                                    # GPT-2's vocabulary padded to 50304): O0, bf16 presets,
#                                    # o3_bf16_sr, fp8 and compiled rows, merged; lm_parity.py
#                                    # at 2000 steps a run
#   bash benchmarks/gpu_suite.sh 5   # a 15-minute lease's first call: kernels build, CUDA tests,
#                                    # Apex's own amp tests on the GPU (APEX_GIT, or .apex/ when
#                                    # carried), kernels.py, levels.py eager rows for resnet50,
#                                    # peers.py (Lightning, hand loop) on resnet50
#   bash benchmarks/gpu_suite.sh 6   # its second call, on the same warm machine: the ViT's eager
#                                    # and compiled rows (fp8 among them) into levels_vit_cuda.*
#   bash benchmarks/gpu_suite.sh 7   # the next 15-minute lease's first call, after the fixes of
#                                    # the first GPU run: kernels build, CUDA tests (4 workers),
#                                    # the C++ kernels' tests, kernels.py, ResNet-50's eager rows
#                                    # (levels_rn50_cuda.*), peers.py on ResNet-50
#   bash benchmarks/gpu_suite.sh 8   # its second call: GPT-2 small's rows (eager, compiled, fp8)
#                                    # into levels_gpt_cuda.*, peers.py on GPT-2 small against
#                                    # torchtitan's float8 recipe (peers_gpt_cuda.*), the ViT's
#                                    # compiled o1_bf16/o1_fp8 again (levels_vit_cuda.*)
#   bash benchmarks/gpu_suite.sh 9   # the logged time, one call of ~6 minutes: kernels build,
#                                    # the step timer's GPU tests (no host sync between logging
#                                    # steps), then steady.py: the mission's command at O0 and O2
#                                    # on densenet161 (224 px, batch 64, 60 steps, 8 workers) as a
#                                    # user types it, its logged steady samples_per_s ratio
#                                    # against levels.py's for the same model and batch (target:
#                                    # within 10%; steady_cuda.*), and whether NVML is there for
#                                    # the GPU utilisation metrics
#   bash benchmarks/gpu_suite.sh 10  # trainer.cuda_graphs, one call of ~5 minutes: kernels build,
#                                    # the captured step's GPU tests, then ResNet-50's steady
#                                    # throughput at O2 and o2_bf16 with the optimizer step
#                                    # captured in a CUDA graph and without
#                                    # (graphs_{false,true}_rn50_cuda.*)
#   bash benchmarks/gpu_suite.sh 11  # trainer.tune, one call of ~9 minutes: peers.py --tuned on
#                                    # ResNet-50 (batch 128) and densenet161 (batch 64) at 224
#                                    # px, the runner at its defaults tuned for a run of 20000
#                                    # steps against Lightning 16-mixed and bf16-mixed at their
#                                    # defaults (target >= 1.2x; peers_tuned_*_cuda.*)
#
# Parts 7 and 8 write their own levels files, so the committed levels_cuda.* (measured before the
# device fix) are not overwritten; merge afterwards, each later file winning per cell:
#   python benchmarks/levels.py --from-json benchmarks/results/levels_cuda.json \
#     part7/results/levels_rn50_cuda.json part8/results/levels_vit_cuda.json \
#     part8/results/levels_gpt_cuda.json --out benchmarks/results/levels_cuda.md
# Each is sized from the first run's piece times on an H200 (kernels build 68 s, CUDA tests with
# 4 workers 108 s, kernels.py 9 s, ResNet-50's eager rows 84 s, peers 49 s, the ViT's two
# compiled rows 84 s): give them GPU_SUITE_BUDGET_S=400 so that both calls and the machine's
# start fit 15 minutes.
#
# Parts 5 and 6 are the suite cut to a lease of 15 minutes of device time (a machine's start, two
# calls): the correctness pieces and the judged GPU figures first (ResNet-50's targets, the
# peers), the ViT's rows in what is left. Carry [".whl", ".apex"] where .apex holds a git repo of
# Apex's tests/L0/run_amp (then APEX_COMMIT=HEAD is used).
#
# Part 3 is new with the fp8/compile rows: compiling a 224-px model takes tens of
# seconds per cell, so the compiled rows got a part of their own, and accuracy.py moved there
# from part 2 to make room for the ViT's eager rows. No part has run on a GPU yet: the pieces'
# limits are estimates, every part stops at GPU_SUITE_BUDGET_S, and the pieces run in order of
# priority (in part 3 the ViT's compiled rows before ResNet-50's, where fp8 has Linear layers to
# convert; ResNet-50's only Linear layer has 10 outputs here and stays bf16). The ViT is
# `model=torchvision model.arch=vit_b_16` (levels.py `--models torchvision:vit_b_16`); where
# that option does not exist yet its pieces stop at once with "unknown model" (exit 2).
#
# Before part 1, once: `../shared/device/make-wheels.sh .whl` (with /.whl/ in .git/info/exclude)
# and give the device call carry [".whl"]; each part is one call, e.g. the command
# `bash benchmarks/gpu_suite.sh 1` (its three files in $OUT come back with the call).
# Between the parts, copy the previous part's results/levels_cuda.json (from its archive:
# `tar -xzf part1.tar.gz -C /tmp/part1`) into benchmarks/results/ so that the next part's
# `levels.py --merge` completes the same table; otherwise combine them afterwards with
#   python benchmarks/levels.py --from-json part1/levels_cuda.json part2/levels_cuda.json \
#     part3/levels_cuda.json
# (also the way to draw the figure where the GPU machine has no matplotlib).
# Environment: OUT (required: where the three files go), GPU_SUITE_WORK (default
# /tmp/gpu_suite_part<N>: the logs and results before they are packed), PYTHON (default python3),
# GPU_SUITE_BUDGET_S (default 560: no piece runs past this many seconds after the start),
# CUDA_HOME (found from nvcc when unset), AMP_RUNNER_KERNEL_CACHE (default /tmp/amp-runner-kernels).
set -uo pipefail

PART=${1:-}
if [[ ! "$PART" =~ ^([1-9]|10|11)$ ]]; then
  echo "usage: bash benchmarks/gpu_suite.sh 1|2|...|11   (each under 10 minutes)" >&2
  exit 2
fi
if [[ -z "${OUT:-}" ]]; then
  echo "OUT is not set: point it at the folder for logs and results (the device tool sets it)" >&2
  exit 2
fi
WORK=${GPU_SUITE_WORK:-/tmp/gpu_suite_part$PART}
rm -rf "$WORK/logs" "$WORK/results"  # an earlier run of this part on the same machine
mkdir -p "$OUT" "$WORK/logs" "$WORK/results" || exit 2
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
BUDGET=${GPU_SUITE_BUDGET_S:-560}
T0=$SECONDS
SUMMARY=()
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export AMP_RUNNER_KERNEL_CACHE=${AMP_RUNNER_KERNEL_CACHE:-/tmp/amp-runner-kernels}

# pack: the logs and the GPU results so far into $OUT/part<N>.tar.gz (one file back, not dozens).
pack() {
  cp -f benchmarks/results/*_cuda.* "$WORK/results/" 2>/dev/null
  cp -f "$OUT/environment.txt" "$WORK/" 2>/dev/null
  tar -czf "$OUT/part$PART.tar.gz" -C "$WORK" . || echo "packing $WORK into $OUT failed" >&2
}

# piece NAME CAP COMMAND...: run COMMAND for at most CAP seconds (less when the budget is
# nearly spent; SIGINT first, so Python stops cleanly), log to $WORK/logs/NAME.log, show its
# tail, pack the logs and results.
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
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$WORK/logs/$name.log"
  local note=""
  (( rc == 124 )) && note=" (stopped at its time limit)"
  SUMMARY+=("$name: exit $rc in $(( SECONDS - started ))s$note")
  pack
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

# The levels of the table (levels.py's CUDA defaults, named here so that each piece measures only
# its share): the eager rows, with and without fp8, and the compiled rows.
BASE=o0,o1,o2,o3,o1_bf16,o2_bf16,o3_bf16,torch_amp
EAGER=$BASE,o1_fp8,o2_fp8
COMPILED=o0+compile,o1_bf16+compile,o2_bf16+compile,o1_fp8+compile,o2_fp8+compile
VIT=torchvision:vit_b_16

if [[ "$PART" == 1 ]]; then
  piece tests_gpu 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
  piece tests_kernels 120 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/unit/test_kernels.py
  piece bench_kernels 120 "$PY" benchmarks/kernels.py --device cuda
  piece bench_overhead 120 "$PY" benchmarks/overhead.py --device cuda
  piece bench_levels_1 300 "$PY" benchmarks/levels.py --device cuda --models resnet18,resnet50 \
    --levels "$EAGER"
elif [[ "$PART" == 2 ]]; then
  piece bench_levels_vit 180 "$PY" benchmarks/levels.py --device cuda --models "$VIT" \
    --levels "$EAGER" --merge
  # DenseNet-161 has no Linear layer fp8 could take here (its head has 10 outputs): no fp8 rows;
  # VGG-16-BN's two 4096-wide classifier layers run in fp8
  piece bench_levels_2 200 "$PY" benchmarks/levels.py --device cuda --models densenet161 \
    --levels "$BASE" --merge
  piece bench_levels_2b 200 "$PY" benchmarks/levels.py --device cuda --models vgg16_bn \
    --levels "$EAGER" --merge
elif [[ "$PART" == 5 ]]; then
  piece tests_gpu 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
  if [[ -z "${APEX_GIT:-}" && -d .apex/.git ]]; then
    export APEX_GIT=$ROOT/.apex APEX_COMMIT=${APEX_COMMIT:-HEAD}
  fi
  if [[ -n "${APEX_GIT:-}" ]]; then
    APEX_DEVICE=cuda PYTHON="$PY" piece tests_apex_l0_cuda 90 bash tests/helpers/apex_l0.sh
  fi
  piece bench_kernels 90 "$PY" benchmarks/kernels.py --device cuda
  piece bench_levels_rn50 150 "$PY" benchmarks/levels.py --device cuda --models resnet50 \
    --levels "$BASE"
  piece bench_peers 120 "$PY" benchmarks/peers.py --device cuda
  # the C++ kernels as that machine's compiler builds them (its libstdc++ is linked statically)
  piece tests_kernels_cpp 90 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" \
    tests/unit/test_kernels.py
elif [[ "$PART" == 6 ]]; then
  VOUT=benchmarks/results/levels_vit_cuda.md
  piece bench_levels_vit 100 "$PY" benchmarks/levels.py --device cuda --models "$VIT" \
    --levels o0,o1,o2,o1_bf16,o2_bf16,o1_fp8 --out "$VOUT"
  piece bench_levels_vit_compiled 200 "$PY" benchmarks/levels.py --device cuda --models "$VIT" \
    --levels o1_bf16+compile,o1_fp8+compile --merge --out "$VOUT"
elif [[ "$PART" == 7 ]]; then
  XDIST=()
  "$PY" -c "import xdist" 2> /dev/null && XDIST=(-n 4)  # a crashed worker is restarted
  piece tests_gpu 150 "$PY" -m pytest -q -p no:cacheprovider -rfE -m gpu tests "${XDIST[@]}"
  piece tests_kernels_cpp 60 "$PY" -m pytest -q -p no:cacheprovider -rfE -m "not gpu" \
    tests/unit/test_kernels.py "${XDIST[@]}"
  piece bench_kernels 40 "$PY" benchmarks/kernels.py --device cuda
  piece bench_levels_rn50 110 "$PY" benchmarks/levels.py --device cuda --models resnet50 \
    --levels "$BASE" --out benchmarks/results/levels_rn50_cuda.md
  piece bench_peers 70 "$PY" benchmarks/peers.py --device cuda
elif [[ "$PART" == 8 ]]; then
  GPT=(--image-size 1024 --batch-size 8 --extra model.vocab_size=50304)
  GOUT=benchmarks/results/levels_gpt_cuda.md
  piece bench_levels_gpt 90 "$PY" benchmarks/levels.py --device cuda --models gpt2_small \
    "${GPT[@]}" --levels o0,o1_bf16,o2_bf16,o3_bf16_sr,o1_fp8 --out "$GOUT"
  piece bench_peers_gpt 120 "$PY" benchmarks/peers.py --device cuda --model gpt2_small \
    "${GPT[@]}" --peers titan:float8,hand:o1_bf16,lightning:bf16-mixed \
    --out benchmarks/results/peers_gpt_cuda.md
  piece bench_levels_gpt_compiled 110 "$PY" benchmarks/levels.py --device cuda \
    --models gpt2_small "${GPT[@]}" --levels o1_bf16+compile,o1_fp8+compile --merge --out "$GOUT"
  piece bench_levels_vit_compiled 100 "$PY" benchmarks/levels.py --device cuda \
    --models "$VIT" --levels o1_bf16+compile,o1_fp8+compile --out benchmarks/results/levels_vit_cuda.md
elif [[ "$PART" == 9 ]]; then
  # GPU utilisation in the system metrics needs NVIDIA's management library (nvidia-ml-py)
  "$PY" -c "import pynvml; pynvml.nvmlInit(); print('NVML', pynvml.nvmlSystemGetDriverVersion())" \
    || echo "note: no nvidia-ml-py here: runs log no system/gpu_* metrics (carry its wheel)"
  piece tests_gpu_timing 90 "$PY" -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/gpu/test_timing_cuda.py
  # the mission's command at O0 and O2 (each one process, as a user runs it), then levels.py's
  # two cells for the same model and batch: logged steady ratio within 10% of levels.py's
  piece steady_densenet 420 "$PY" benchmarks/steady.py --device cuda --work "$WORK/steady"
elif [[ "$PART" == 10 ]]; then
  piece tests_gpu_graphs 180 "$PY" -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/gpu/test_cuda_graphs.py
  # the same cells with the step captured and without; scheduler=none in both, since the graphs
  # refuse a schedule that sets a new learning rate at every step (the default cosine)
  for GRAPHS in false true; do
    piece "bench_graphs_${GRAPHS}_rn50" 100 "$PY" benchmarks/levels.py --device cuda \
      --models resnet50 --levels o2,o2_bf16 --extra scheduler=none "trainer.cuda_graphs=$GRAPHS" \
      --out "benchmarks/results/graphs_${GRAPHS}_rn50_cuda.md"
  done
elif [[ "$PART" == 11 ]]; then
  # the runner at its defaults with trainer.tune=on (channels_last, cudnn.benchmark, the fused
  # kernels or torch's ops, compile max-autotune-no-cudagraphs where 20000 steps repay it: about
  # two ImageNet epochs at batch 128) against Lightning at its defaults; its own tuning cache
  export AMP_RUNNER_TUNE_CACHE=$WORK/tune-cache
  TUNED=(--device cuda --tuned --run-steps 20000 --peers lightning:16-mixed,lightning:bf16-mixed)
  piece bench_peers_tuned_rn50 260 "$PY" benchmarks/peers.py "${TUNED[@]}" --model resnet50 \
    --out benchmarks/results/peers_tuned_rn50_cuda.md
  piece bench_peers_tuned_densenet 260 "$PY" benchmarks/peers.py "${TUNED[@]}" \
    --model densenet161 --batch-size 64 --out benchmarks/results/peers_tuned_densenet_cuda.md
elif [[ "$PART" == 4 ]]; then
  # a language model: sizes are tokens per sequence (1024); GPT-2's vocabulary padded to 50304
  # (a multiple of 64, as nanoGPT does) over the synthetic language's ids
  GPT=(--models gpt2_small --image-size 1024 --batch-size 8 --extra model.vocab_size=50304)
  piece bench_levels_gpt 180 "$PY" benchmarks/levels.py --device cuda "${GPT[@]}" \
    --levels o0,o1_bf16,o2_bf16,o3_bf16_sr,o1_fp8,o2_fp8 --merge
  piece bench_levels_gpt_compiled 180 "$PY" benchmarks/levels.py --device cuda "${GPT[@]}" \
    --levels o1_bf16+compile,o2_bf16+compile,o1_fp8+compile --merge
  # language-model parity where a step costs milliseconds: 2000 steps a run (the CPU table's
  # 400 leave the seeds' spread wider than the targets)
  piece bench_lm_parity 180 "$PY" benchmarks/lm_parity.py --device cuda --steps 2000 \
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
  piece bench_layer_plan 60 "$PY" benchmarks/layer_plan_cost.py --device cuda \
    --models resnet50,gpt_tiny --levels o1,o2 --image-size 224 --batch-size 64
else
  piece bench_levels_compiled 330 "$PY" benchmarks/levels.py --device cuda \
    --models "$VIT",resnet50 --levels "$COMPILED" --merge
  # the new presets and the fp16 levels first (a piece stopped early keeps the runs it finished);
  # no fp8 or compiled rows: the tiny CNN has no fp8-able layer, and compiling changes no
  # accuracy that the CPU table does not already show
  piece bench_accuracy 240 "$PY" benchmarks/accuracy.py --device cuda \
    --levels o0,o1,o2,o2_bf16,o3_bf16_sr,o3,o1_bf16,o3_bf16 --extra trainer.num_workers=8
fi

echo
echo "== part $PART done in $(( SECONDS - T0 ))s; logs and results in $OUT/part$PART.tar.gz"
printf '  %s\n' "${SUMMARY[@]}" | tee "$OUT/summary_part$PART.txt"
cp -f "$OUT/summary_part$PART.txt" "$WORK/" && pack
tar -tzf "$OUT/part$PART.tar.gz" | grep -v '/$' 
