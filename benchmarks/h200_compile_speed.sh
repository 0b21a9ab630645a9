#!/usr/bin/env bash
# Compile time, second-start time, throughput/MFU and the step profile behind
# docs/training.md's "Step efficiency" (one H200; each mode is one call of under 9 minutes).
#   bash benchmarks/h200_compile_speed.sh compile ARM   # 569m: first start with a fresh
#                                                       # compilation cache, then a second start
#   bash benchmarks/h200_compile_speed.sh fold ARM      # names what XLA constant-folds slowly
#   bash benchmarks/h200_compile_speed.sh profile ARM   # 569m step profile (profile.json, .md);
#                                                       # profile_step skips the memory check (so
#                                                       # auto is unrolled; --scan-layers on scans):
#                                                       # SIZE="... --remat dots" at batch 8
#   bash benchmarks/h200_compile_speed.sh unscanned ARM # 569m with --scan-layers off
#   bash benchmarks/h200_compile_speed.sh remat ARM     # 569m scanned with --remat dots, full
#   bash benchmarks/h200_compile_speed.sh long          # small at T=8192: cudnn_bf16, matched
#   bash benchmarks/h200_compile_speed.sh gemm ARM      # 569m with XLA's Triton GEMMs, then cuBLAS
#   bash benchmarks/h200_compile_speed.sh families ARM  # mamba2_gqa-569m and kda_gqa-569m
#                                                       # (batch FB, default 4: 8 does not fit)
#   bash benchmarks/h200_compile_speed.sh scan ARM      # small, 16 x 2048, scan on then off
#   bash benchmarks/h200_compile_speed.sh memory small|569m  # estimate against measured peak
#   bash benchmarks/h200_compile_speed.sh pairs T       # cudnn_bf16 then matched, unrolled, at
#                                                       # 32k tokens per step (569m, then small at
#                                                       # twice the tokens), peaks for the estimate
#                                                       # (PRESETS="569m" for one of them;
#                                                       # LAYOUT=" " lets --scan-layers auto pick;
#                                                       # DOCS=mask|packed: cudnn_bf16's
#                                                       # --cudnn-documents, named in the run;
#                                                       # unset: the default, packed sequences)
#                                                       # small runs SMALL_STEPS (default 96)
#   bash benchmarks/h200_compile_speed.sh fused ARM     # 569m unrolled, --fused-projections off
#                                                       # then on (the GDN input projections as
#                                                       # one matmul, the convs as one)
#   bash benchmarks/h200_compile_speed.sh ffn ARM       # 569m unrolled, --ffn fp8 then bf16
#   bash benchmarks/h200_compile_speed.sh statepass     # small, 300 steps, matched: sequential
#                                                       # against pallas (loss and val curves)
#   bash benchmarks/h200_compile_speed.sh ab ARM        # 569m unrolled at $SIZE: a base tree
#                                                       # (this one with the files under .ab/
#                                                       # put back, paths as in the repo), then
#                                                       # this tree, then the base again
# ARM: matched or cudnn_bf16. Summaries (summary.json, profile.json/.md) and logs go to $OUT.
# Each run is stopped after RUN_TIMEOUT seconds (default 250: two runs fit one 9-minute call).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
R=/tmp/runs
mkdir -p "$OUT" "$R"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
SIZE=${SIZE:-"--preset 569m --seq-len 4096 --batch-size 8"}
QUIET="--steps ${STEPS:-24} --log-every 4 --eval-every 0 --probe-every 0 --ckpt-every 0"
# small's 24 steps last under 3 s after compilation, too few for a steady tokens/s (a
# 24-step pair read 0.91x where 96 steps read 0.97x): pairs runs it for SMALL_STEPS
SMALL_QUIET="${QUIET/--steps ${STEPS:-24}/--steps ${SMALL_STEPS:-96}}"
ARM=${2:-matched}

run() {  # run NAME FLAGS...: one training run; prints its summary and any slow folding
  local name=$1
  shift
  local start=$SECONDS
  rm -rf "$R/$name"  # a fresh run each time (a warm machine keeps /tmp between calls)
  timeout "${RUN_TIMEOUT:-250}" python3 -m train "$@" --run-dir "$R/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?, wall $((SECONDS - start)) s (start to exit)"
  tail -1 "$OUT/$name.log"
  cp "$R/$name/summary.json" "$OUT/$name.summary.json" 2>/dev/null && python3 -c "
import json, sys
s = json.load(open(sys.argv[1]))
mfu = 'n/a' if s['mfu'] is None else f\"{s['mfu']:.1%}\"
print(f\"  {s['tokens_per_s']:,.0f} tok/s, MFU {mfu}, compile {s['compile_seconds']:.1f} s ({s['compile_cache']})\")
" "$OUT/$name.summary.json"
  grep -h -A2 "Constant folding an instruction" "$OUT/$name.log" | head -30
}

case "${1:-}" in
compile)
  CACHE=$R/jax-cache-$ARM
  rm -rf "$CACHE" "$R/$ARM-first" "$R/$ARM-second"
  run "$ARM-first" $SIZE $QUIET --attention "$ARM" --compile-cache "$CACHE"
  run "$ARM-second" $SIZE $QUIET --attention "$ARM" --compile-cache "$CACHE"
  ;;
fold)
  # Where `compile` logged slow constant folding: one step with the step's HLO dumped before
  # optimization, then the full line (op_name = source) of each instruction an alarm named.
  rm -rf "$R/xla-$ARM" "$R/$ARM-fold"
  XLA_FLAGS="--xla_dump_to=$R/xla-$ARM --xla_dump_hlo_module_re=.*train_step.*" \
    run "$ARM-fold" $SIZE --steps 1 --eval-every 0 --probe-every 0 --ckpt-every 0 \
    --attention "$ARM" --compile-cache off
  grep -h -A2 "Constant folding an instruction" "$OUT/$ARM-fold.log" \
    | grep -o "^  %\?[A-Za-z0-9_.-]*" | tr -d " %" | sort -u | while read -r name; do
      grep -h "^ *%\?$name = " "$R"/xla-"$ARM"/*before_optimizations.txt | cut -c1-800
    done | tee "$OUT/$ARM-folded-instructions.txt"
  ;;
profile)
  rm -rf "$R/profile-$ARM"
  timeout 420 python3 -m train.profile_step $SIZE --attention "$ARM" --compile-cache off \
    --out "$R/profile-$ARM" > "$OUT/profile-$ARM.log" 2>&1
  echo "profile exit $?"
  cp "$R/profile-$ARM/profile.json" "$OUT/profile-$ARM.json" 2>/dev/null
  cp "$R/profile-$ARM/profile.md" "$OUT/profile-$ARM.md" 2>/dev/null
  cp "$R/profile-$ARM/step_hlo.txt.gz" "$OUT/profile-$ARM.step_hlo.txt.gz" 2>/dev/null
  cat "$OUT/profile-$ARM.md" 2>/dev/null || tail -30 "$OUT/profile-$ARM.log"
  ;;
unscanned)
  run "$ARM-unscanned" $SIZE $QUIET --attention "$ARM" --compile-cache off --scan-layers off
  ;;
remat)
  for policy in dots full; do
    run "$ARM-remat-$policy" $SIZE $QUIET --attention "$ARM" --compile-cache off --remat $policy
  done
  ;;
long)
  for arm in cudnn_bf16 matched; do
    run "small-8192-$arm" --preset small --seq-len 8192 --batch-size 8 $QUIET --attention "$arm" \
      --compile-cache off
  done
  ;;
gemm)
  for gemm in triton cublas; do
    run "$ARM-gemm-$gemm" $SIZE $QUIET --attention "$ARM" --compile-cache off --xla-gemm $gemm
  done
  ;;
families)
  for family in mamba2_gqa kda_gqa; do
    run "$family-$ARM" --preset "$family-569m" --seq-len 4096 --batch-size "${FB:-4}" $QUIET \
      --attention "$ARM" --compile-cache off
  done
  ;;
scan)
  for scan in on off; do
    run "small-2048-$ARM-scan-$scan" --preset small $QUIET --attention "$ARM" \
      --compile-cache off --scan-layers $scan
  done
  ;;
memory)
  # the memory estimate against each step's measured peak (benchmarks/memory_calibration.py):
  # ARM here is the size, small or 569m; every run skips the check, so it trains the layout named
  if [ "$ARM" = small ]; then
    LAYOUTS=("--preset small --batch-size 16 --seq-len 2048 --scan-layers off"
      "--preset small --batch-size 16 --seq-len 2048 --scan-layers on"
      "--preset small --batch-size 8 --seq-len 8192 --scan-layers off")
  else
    LAYOUTS=("--preset 569m --batch-size 8 --seq-len 4096 --scan-layers off"
      "--preset 569m --batch-size 8 --seq-len 4096 --scan-layers on --remat dots"
      "--preset 569m --batch-size 4 --seq-len 8192 --scan-layers off")
  fi
  dirs=()
  for i in "${!LAYOUTS[@]}"; do
    run "memory-$ARM-$i" ${LAYOUTS[$i]} --steps 8 --log-every 4 --eval-every 0 --probe-every 0 \
      --ckpt-every 0 --attention matched --compile-cache off --skip-memory-check
    dirs+=("$R/memory-$ARM-$i")
  done
  python3 benchmarks/memory_calibration.py "${dirs[@]}" --out "$OUT" | tee "$OUT/memory-$ARM.md"
  ;;
pairs)
  # ARM here is the sequence length; both arms of both presets with the unrolled step (the
  # check skipped, so the layout is the one named), then the estimate against their peaks
  T=$ARM
  dirs=()
  for preset in ${PRESETS:-569m small}; do
    TOKENS=${TOKENS_569M:-32768}  # 16384 on an 80 GB H100: 8 x 4096 unrolled peaks at 92 GB
    [ "$preset" = small ] && TOKENS=65536
    for arm in cudnn_bf16 matched; do
      name="$preset-$T-$arm-unrolled"
      docs=""
      [ "$arm" = cudnn_bf16 ] && [ -n "${DOCS:-}" ] && docs="--cudnn-documents $DOCS" && name="$name-$DOCS"
      quiet=$QUIET
      [ "$preset" = small ] && quiet=$SMALL_QUIET
      run "$name" --preset $preset --seq-len "$T" --batch-size $((TOKENS / T)) $quiet \
        --attention "$arm" --compile-cache off ${LAYOUT:---scan-layers off --skip-memory-check} $docs
      dirs+=("$R/$name")
    done
  done
  python3 benchmarks/memory_calibration.py "${dirs[@]}" --out "$OUT" | tee "$OUT/pairs-$T.md"
  ;;
ffn)
  # the FFN's matmuls in FP8 (the default) against bf16: the profile's FP8 casts and
  # amaxes (18 ms of a 326 ms step) against the FP8 dots' gain
  for ffn in fp8 bf16; do
    run "$ARM-ffn-$ffn" $SIZE $QUIET --attention "$ARM" --compile-cache off \
      --scan-layers off --skip-memory-check --ffn $ffn
  done
  ;;
fused)
  for fused in off on; do
    run "$ARM-fused-$fused" $SIZE $QUIET --attention "$ARM" --compile-cache off \
      --scan-layers off --skip-memory-check --fused-projections $fused
  done
  ;;
statepass)
  for pass in sequential pallas; do
    run "small-300-matched-$pass" --preset small --steps 300 --log-every 10 --eval-every 100 \
      --probe-every 0 --ckpt-every 0 --compile-cache off --attention matched --state-pass $pass
    cp "$R/small-300-matched-$pass/metrics.jsonl" "$OUT/small-300-matched-$pass.metrics.jsonl"
  done
  ;;
ab)
  # e.g. before and after a library change:
  #   mkdir -p .ab/dm_jax/nn && git show BASE:dm_jax/nn/fp8.py > .ab/dm_jax/nn/fp8.py
  [ -d .ab ] || { echo "ab: put the base's files under .ab/ first" >&2; exit 2; }
  base=/tmp/ab-base
  rm -rf "$base" && mkdir -p "$base" && cp -r . "$base" && cp -r .ab/. "$base"/
  for tree in base new base2; do
    dir=.
    [ "$tree" = new ] || dir=$base
    (cd "$dir" && run "$ARM-ab-$tree" $SIZE $QUIET --attention "$ARM" --compile-cache off \
      --scan-layers off --skip-memory-check)
  done
  ;;
*)
  echo "usage: $0 compile|fold|profile|unscanned|remat|gemm|families|scan|fused|ffn|ab ARM | memory SIZE | pairs T | long | statepass" >&2
  exit 2
  ;;
esac
