#!/usr/bin/env bash
# The GPU test suite as BENCHMARKS.md ("GPU test suite") runs it on a host of
# several GPUs: the fast tier, four pytest workers per GPU, and the tests that
# need two GPUs (beside it at the lowest CPU priority on GPUs 1 and 2 of 3 or
# more; after it on a host of two).
#
#   bash benchmarks/gpu_suite.sh [GPUS] [LIMIT_S]     # default 4 GPUs, 430 s
#
# Logs go to $OUT (default ./gpu_suite_logs); the exit status is 1 if either
# run failed or ran past the limit. On a machine without network
# access, put the jax-triton wheel in .whl/ (GPU_NOTES: `pip download
# --no-deps jax-triton==0.3.1`); it is installed into /tmp/site.
set -u
cd "$(dirname "$0")/.."
GPUS=${1:-4}
LIMIT=${2:-430}
OUT=${OUT:-gpu_suite_logs}
mkdir -p "$OUT"
rm -f "$OUT/gpu_fast.log" "$OUT/two_gpus.log"  # Not an earlier run's.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
t0=$(date +%s)
# `--dist load`: test by test, not the CPU run's whole files per worker
# (tests/conftest.py): with 4 workers a GPU and 16+ cores, balance counts
# more than the CPU work that files shared (one H200: 304 s, 414 s whole).
( NVFP4_TEST_GPUS=$GPUS timeout "$LIMIT" python3 -m pytest -q -n $((4 * GPUS)) \
    --dist load -p no:cacheprovider -m "not slow" -rfE --durations=15 tests \
    > "$OUT/gpu_fast.log" 2>&1
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$OUT/gpu_fast.log" ) &
sleep 5
two_gpus() {  # The fast tier's workers see one GPU each: these skip there.
  CUDA_VISIBLE_DEVICES=$1 nice -n 19 timeout "$LIMIT" python3 -m pytest -q \
      -p no:cacheprovider -rfE tests -k "two_gpus or two_devices" \
      > "$OUT/two_gpus.log" 2>&1
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$OUT/two_gpus.log"
}
if [ "$GPUS" -ge 3 ]; then
  two_gpus 1,2 &
  wait
elif [ "$GPUS" -eq 2 ]; then
  wait
  two_gpus 0,1
else
  wait
fi
status=0
for f in two_gpus gpu_fast; do
  [ -f "$OUT/$f.log" ] || continue
  echo "== $f"; tail -40 "$OUT/$f.log"
  grep -q "^rc=0 " "$OUT/$f.log" || status=1  # A failure, or the limit.
done
exit $status
