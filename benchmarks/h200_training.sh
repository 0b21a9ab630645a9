#!/usr/bin/env bash
# GPU training runs behind docs/training.md and docs/experiments/ (one call of a 2-GPU machine).
#   bash benchmarks/h200_training.sh all   # arm comparison split over both GPUs, cuDNN FP8 probe,
#                                          # then a 2-GPU data-parallel run
#   bash benchmarks/h200_training.sh arms  # every comparison arm at once, one process per arm
#   (the 1-GPU baseline: CUDA_VISIBLE_DEVICES=1 python3 -m train $SCALE_FLAGS)
# Results go under $OUT (the run directories tarred into one file).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
R=/tmp/runs
mkdir -p "$OUT" "$R"
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
SCALE_FLAGS="--preset small --attention matched --steps 50 --log-every 1 --eval-every 0 --probe-every 0 --ckpt-every 0"

case "${1:-}" in
all)
  # GPU 0 and GPU 1 each train some arms (same seed: same init and data order), then both
  # GPUs run the data-parallel scaling run. Reports are merged afterwards with --report-only.
  CMP="--preset small --steps ${STEPS:-300} --eval-minutes 0.4 --no-generate --ruler-lengths 2048 --ruler-examples 4 --no-progress"
  ( CUDA_VISIBLE_DEVICES=1 timeout 60 python3 benchmarks/cudnn_fp8_probe.py --out "$OUT" > "$OUT/probe.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout "${COMPARE_SECONDS:-400}" python3 -m train.experiments.compare $CMP \
      --arms do_matched,cudnn_fp8 --out "$R/cmp1" --runs-dir "$R/cmp1-runs" > "$OUT/cmp1.log" 2>&1 ) &
  CUDA_VISIBLE_DEVICES=0 timeout "${COMPARE_SECONDS:-400}" python3 -m train.experiments.compare $CMP \
    --arms matched,reference,stale --out "$R/cmp0" --runs-dir "$R/cmp0-runs" > "$OUT/cmp0.log" 2>&1
  echo "cmp0 exit $?"
  wait
  timeout 120 python3 -m train $SCALE_FLAGS --run-dir $R/dp2 > "$OUT/dp2.log" 2>&1; echo "dp2 exit $?"
  cp "$R/dp2/metrics.jsonl" "$OUT/dp2_metrics.jsonl" 2>/dev/null
  tar czf "$OUT/compare.tgz" -C "$R" cmp0 cmp1
  tail -4 "$OUT/dp2.log"; tail -12 "$OUT/cmp0.log" "$OUT/cmp1.log"; tail -40 "$OUT/probe.log"
  ;;
arms)
  # Every arm of the comparison at once, one process per arm (three on GPU 0, two on GPU 1;
  # the model is small, so sharing a GPU changes tokens/s only). Same seed: same init and
  # data order. Merge afterwards with --report-only.
  CMP="--preset small --steps ${STEPS:-300} --eval-minutes 0.4 --no-generate --ruler-lengths 2048 --ruler-examples 4 --no-progress"
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
  i=0
  for arm in ${ARMS:-reference stale do_matched matched cudnn_fp8}; do
    CUDA_VISIBLE_DEVICES=$((i % 2)) timeout "${COMPARE_SECONDS:-480}" python3 -m train.experiments.compare $CMP \
      --arms $arm --out "$R/cmp-$arm" --runs-dir "$R/runs-$arm" > "$OUT/cmp-$arm.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  tar czf "$OUT/compare.tgz" -C "$R" $(cd "$R" && ls -d cmp-*)
  for f in "$OUT"/cmp-*.log; do echo "== $f"; tail -6 "$f"; done
  ;;
*) echo "usage: $0 all|arms" >&2; exit 2 ;;
esac
