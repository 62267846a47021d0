#!/usr/bin/env bash
# Apex's own amp unit tests (tests/L0/run_amp of NVIDIA/apex at the release 25.04, commit
# e13873de, the last with amp) run against this runner's facade, `runner.precision.amp`, on the
# CPU. Apex's code is not carried here: the tests are taken from a git mirror or clone of
# NVIDIA/apex that APEX_GIT names, into a temporary folder, adapted only by
#   from apex import amp       -> from runner.precision import amp
#   apex.amp                   -> runner.precision.amp      (for _amp_state)
#   device='cuda', .cuda(), .to('cuda')  -> the CPU
#   torch.cuda.XTensor         -> torch.XTensor
# and one seed: test_checkpointing's test_loss_scale_decrease builds its model unseeded, and when
# the random weight keeps its input (x * 2**17) inside fp16's range nothing overflows and the
# loss scale stays put (about one run of this script in six on the CPU); it is seeded as
# test_restoring is (its own `self.seed()` before each model), on the CPU and on CUDA,
# and run with `python -m unittest`. The in-scope files (41 tests) leave out what needs Apex's
# compiled extensions (multi-tensor apply, fused SGD, LARC, the scaler's hysteresis kernel).
#
#   APEX_GIT=/path/to/apex bash tests/helpers/apex_l0.sh            # prints "passed P of N"
#   APEX_GIT=... APEX_COMMIT=<rev> bash tests/helpers/apex_l0.sh -v  # unittest's own flags pass through
#   APEX_GIT=... APEX_DEVICE=cuda bash tests/helpers/apex_l0.sh      # on a GPU: the tests as Apex wrote
#                                                             # them (no device rewrite; the seed above), fp16 real
#
# Exit status: 0 when every test passed, 1 when some failed, 2 for a missing mirror or commit.
set -uo pipefail

if [[ -z "${APEX_GIT:-}" ]]; then
  echo "APEX_GIT is not set: point it at a git mirror or clone of NVIDIA/apex" >&2
  exit 2
fi
COMMIT=${APEX_COMMIT:-e13873de}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
FILES=(test_basic_casts test_promotion test_rnn test_cache test_add_param_group
       test_checkpointing test_multiple_models_optimizers_losses)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if ! git -C "$APEX_GIT" archive "$COMMIT" tests/L0/run_amp | tar -x -C "$WORK"; then
  echo "cannot read tests/L0/run_amp at $COMMIT from $APEX_GIT" >&2
  exit 2
fi
cd "$WORK/tests/L0/run_amp" || exit 2
sed -i \
  -e 's/from apex import amp/from runner.precision import amp/' \
  -e 's/apex\.amp/runner.precision.amp/g' \
  ./*.py
sed -i -e '/def test_loss_scale_decrease/,/^    def test_/ s/^\( *\)\(model = MyModel()\)/\1self.seed()\n\1\2/' \
  test_checkpointing.py
if ! sed -n '/def test_loss_scale_decrease/,/^    def test_/p' test_checkpointing.py |
    grep -q 'self\.seed()'; then
  echo "warning: test_loss_scale_decrease was not seeded (not found at $COMMIT)" >&2
fi
if [[ "${APEX_DEVICE:-cpu}" == cpu ]]; then
  sed -i \
    -e "s/device='cuda'/device='cpu'/g; s/device=\"cuda\"/device=\"cpu\"/g" \
    -e "s/\.to('cuda')/.to('cpu')/g; s/\.cuda()//g" \
    -e 's/torch\.cuda\.\([A-Za-z]*Tensor\)/torch.\1/g' \
    ./*.py
elif [[ "${APEX_DEVICE}" != cuda ]]; then
  echo "APEX_DEVICE must be cpu or cuda, not ${APEX_DEVICE}" >&2
  exit 2
fi

OUTPUT=$(PYTHONPATH="$REPO:${PYTHONPATH:-}" "$PY" -m unittest "$@" "${FILES[@]}" 2>&1)
STATUS=$?
echo "$OUTPUT"
RAN=$(echo "$OUTPUT" | sed -n 's/^Ran \([0-9]*\) tests\{0,1\}.*/\1/p' | tail -n 1)
FAILED=$(echo "$OUTPUT" | sed -n 's/.*failures=\([0-9]*\).*/\1/p' | tail -n 1)
ERRORS=$(echo "$OUTPUT" | sed -n 's/.*errors=\([0-9]*\).*/\1/p' | tail -n 1)
SKIPPED=$(echo "$OUTPUT" | sed -n 's/.*skipped=\([0-9]*\).*/\1/p' | tail -n 1)
RAN=${RAN:-0}
PASSED=$(( RAN - ${FAILED:-0} - ${ERRORS:-0} - ${SKIPPED:-0} ))
echo "Apex's amp tests ($COMMIT, ${FILES[*]}): passed $PASSED of $RAN"
[[ $STATUS == 0 ]] && exit 0 || exit 1
