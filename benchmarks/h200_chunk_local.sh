#!/usr/bin/env bash
# The chunk-local kernels (`--chunk-local pallas`, docs/models.md) on one GPU, in one call:
#   bash benchmarks/h200_chunk_local.sh            # the timings below
#   bash benchmarks/h200_chunk_local.sh profile    # Nsight Compute of the three kernels
# 1. benchmarks/chunk_local_speed.py: the chunk-local stage alone, XLA against the kernels.
#    benchmarks/recurrence_speed.py at the 569m GDN layer's shape, C = 64, gated-norm loss:
#    the pallas state pass (VARIANTS, default: with o in the chunk layout, then token-major,
#    then token-major with the chunk-local kernels); every row checked against the first.
# 2. 569m training at T = 4096, `matched`, unrolled: --chunk-local xla then pallas
#    (batch 8 on a 141 GB H200, 4 on an 80 GB H100: 8 x 4096 unrolled peaks at 92 GB).
# Summaries and logs to $OUT; ARMS="cudnn_bf16" (say) adds that arm's run first. All of it
# takes 9-10 minutes: over one call's limit, so run it twice, STAGE_ALONE=0 in one call.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
R=/tmp/runs
mkdir -p "$OUT" "$R"
if [ "${1:-}" = profile ]; then  # Nsight Compute: the three kernels, one launch each
  nvidia-smi --query-gpu=name --format=csv
  timeout 300 ncu --clock-control none -k regex:chunk_local --launch-skip 3 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    -f -o "$OUT/chunk_local" python3 benchmarks/profile_chunk_local.py > "$OUT/ncu.log" 2>&1
  echo "ncu exit $?"
  ncu --import "$OUT/chunk_local.ncu-rep" > "$OUT/chunk_local.details.txt" 2>&1
  grep -E "^  [a-z_]+|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit Shared|Registers Per|Stall|Warp Cycles Per Issued" \
    "$OUT/chunk_local.details.txt" | cut -c1-120 | head -80
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
BATCH=8
[ "$MEM" -lt 100000 ] && BATCH=4
if [ "${STAGE_ALONE:-1}" = 1 ]; then  # about 3 minutes (STAGE_ALONE=0 skips it: then 6-7)
  timeout 200 python3 benchmarks/chunk_local_speed.py --iters 5 --reps 3 --out "$OUT" \
    > "$OUT/chunk_local_speed.log" 2>&1
  echo "chunk_local_speed exit $?"
  tail -6 "$OUT/chunk_local_speed.log"
fi
timeout "${LAYER_TIMEOUT:-200}" python3 benchmarks/recurrence_speed.py --shape 569m --chunks 64 \
  --loss gated_norm --variants ${VARIANTS:-pallas_chunk_outputs,pallas,pallas_chunk_local} --iters 5 --reps 3 \
  --out "$OUT" > "$OUT/recurrence_speed.log" 2>&1
echo "recurrence_speed exit $?"
tail -6 "$OUT/recurrence_speed.log"
for arm in ${ARMS:-} matched matched-pallas; do
  attention=${arm%-pallas}
  local_form=xla
  [ "$arm" != "$attention" ] && local_form=pallas
  name="569m-4096-$arm"
  rm -rf "$R/$name"
  start=$SECONDS
  timeout "${RUN_TIMEOUT:-200}" python3 -m train --preset 569m --seq-len 4096 --batch-size $BATCH \
    --steps 24 --log-every 4 --eval-every 0 --probe-every 0 --ckpt-every 0 --compile-cache off \
    --scan-layers off --skip-memory-check --attention "$attention" --chunk-local $local_form \
    --run-dir "$R/$name" > "$OUT/$name.log" 2>&1
  echo "$name (batch $BATCH, chunk-local $local_form): exit $?, wall $((SECONDS - start)) s"
  tail -1 "$OUT/$name.log"
  cp "$R/$name/summary.json" "$OUT/$name.summary.json" 2>/dev/null && python3 -c "
import json, sys
s = json.load(open(sys.argv[1]))
mfu = 'n/a' if s['mfu'] is None else f\"{s['mfu']:.1%}\"
print(f\"  {s['tokens_per_s']:,.0f} tok/s, MFU {mfu}, compile {s['compile_seconds']:.1f} s\")
" "$OUT/$name.summary.json"
done
