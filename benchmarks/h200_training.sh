#!/usr/bin/env bash
# GPU training runs behind docs/training.md and docs/experiments/ (one call of a 2-GPU machine).
#   bash benchmarks/h200_training.sh compare   # GPU 0: arm comparison; GPU 1: 1-GPU scaling baseline
#   bash benchmarks/h200_training.sh scaling   # both GPUs: data parallel, heads split, cuDNN FP8 probe
# Results go under $OUT (tarred, since the device tool returns at most 8 files).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
R=/tmp/runs
mkdir -p "$OUT" "$R"
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
SCALE_FLAGS="--preset small --attention matched --steps 50 --log-every 1 --eval-every 0 --probe-every 0 --ckpt-every 0"

case "${1:-}" in
compare)
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -m train $SCALE_FLAGS --run-dir $R/dp1 > "$OUT/dp1.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout "${COMPARE_SECONDS:-500}" python3 -m train.experiments.compare --preset small \
    --arms matched,reference,stale,do_matched,cudnn_fp8 --minutes-per-arm "${MINUTES_PER_ARM:-1.5}" \
    --calibrate first --eval-minutes 0.4 --no-generate --ruler-lengths 2048 --ruler-examples 4 \
    --no-progress --out "$R/compare" --runs-dir "$R/compare-runs" > "$OUT/compare.log" 2>&1
  echo "compare exit $?"
  wait
  tar czf "$OUT/compare.tgz" -C "$R" compare
  cp "$R/dp1/metrics.jsonl" "$OUT/dp1_metrics.jsonl" 2>/dev/null
  tail -5 "$OUT/dp1.log"; tail -40 "$OUT/compare.log"
  ;;
scaling)
  timeout 200 python3 -m train $SCALE_FLAGS --run-dir $R/dp2 > "$OUT/dp2.log" 2>&1; echo "dp2 exit $?"
  cp "$R/dp2/metrics.jsonl" "$OUT/dp2_metrics.jsonl" 2>/dev/null
  timeout 150 python3 -m train $SCALE_FLAGS --steps 20 --model-parallel 2 --run-dir $R/mp2 > "$OUT/mp2.log" 2>&1
  echo "mp2 exit $?"
  cp "$R/mp2/metrics.jsonl" "$OUT/mp2_metrics.jsonl" 2>/dev/null
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/cudnn_fp8_probe.py --out "$OUT" > "$OUT/probe.log" 2>&1
  echo "probe exit $?"
  tail -4 "$OUT/dp2.log" "$OUT/mp2.log"; tail -60 "$OUT/probe.log"
  ;;
*) echo "usage: $0 compare|scaling" >&2; exit 2 ;;
esac
