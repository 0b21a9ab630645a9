#!/usr/bin/env bash
# The Mosaic GPU backend on one H200, behind docs/mosaic_gpu.md (each mode is one call of
# under 9 minutes). A call returns at most 8 files, so each mode's outputs are tarred into
# one: $OUT/mosaic_<mode>.tgz (unpack into docs/data/).
#   bash benchmarks/h200_mosaic.sh check   # correctness of every delta mode (D=128 causal and
#                                          # not, D=64 causal, GQA + segments; LONG=1 adds
#                                          # T=16384) and the NaN pattern of implementation="pallas"
#   bash benchmarks/h200_mosaic.sh passes  # the backward passes alone, ping-pong off and on
#   bash benchmarks/h200_mosaic.sh step    # fwd+bwd end to end from bf16 beside cuDNN BF16
#                                          # and FP8, causal and not; D=256's passes with the
#                                          # fused and the XLA quantize pre-pass
#   bash benchmarks/h200_mosaic.sh levers  # the quantize kernel with 4, 8, 16 warps per program;
#                                          # ptxas' registers and spills of D=256's forward
#   bash benchmarks/h200_mosaic.sh wide    # head dims 256 and 192/128 in the Mosaic backward
#                                          # (one launch per 128 columns): correctness, then
#                                          # fwd+bwd against the Triton backward and cuDNN BF16
#   bash benchmarks/h200_mosaic.sh headline # correctness at D=128 (causal and not), 256 and
#                                          # 192/128; the backward passes; fwd+bwd of every
#                                          # head dim beside cuDNN BF16, causal D=128 + cuDNN FP8
#   bash benchmarks/h200_mosaic.sh dqkeys  # dQ from the dK/dV pass (backward_dq="key_pass"):
#                                          # against the dQ pass at every head dim, causal and
#                                          # not; fwd+bwd at D=128 beside the dQ pass, cuDNN BF16
#   bash benchmarks/h200_mosaic.sh dqwide  # the same fwd+bwd at D=64, 256 and 192/128
#   bash benchmarks/h200_mosaic.sh profile # Nsight Compute's per-instruction stall samples of
#                                          # the dK/dV and dQ passes (SASS, hottest first;
#                                          # PASSES=forward_kernel: the forward's;
#                                          # SHAPE=h569m_t4096_docs CAUSAL=1: the whole
#                                          # call with documents, see profile_mosaic.py)
#   bash benchmarks/h200_mosaic.sh gaps    # every delta mode at D=256 and 192/128 with GQA,
#                                          # segments and a ragged length; fwd+bwd causal with
#                                          # stale beside matched and cuDNN BF16
#   bash benchmarks/h200_mosaic.sh order   # causal launch order: the forward and the query
#                                          # passes in the grid's order and longest first
#                                          # (bitwise check + times) at the main, d256 and
#                                          # the training presets' attention shapes; then
#                                          # fwd+bwd of the causal main and d256 shapes
#   bash benchmarks/h200_mosaic.sh dq128   # dS scale tiles of 64 x 128 (the dQ pass in 128-key
#                                          # steps): correctness, passes, spills, fwd+bwd
#   bash benchmarks/h200_mosaic.sh dq128causal # its causal spills and kernel split, the
#                                          # correctness rows left, MLA 192/128 fwd+bwd
#   bash benchmarks/h200_mosaic.sh dq128e2e # fwd+bwd end to end on both dS tiles, both
#                                          # backends, causal and not, D=64; the causal key
#                                          # pass with 64-column dots
#   bash benchmarks/h200_mosaic.sh dq128triton # the Triton backward's passes and fwd+bwd on
#                                          # 64 x 128 dS tiles; Mosaic correctness at D=64
#   bash benchmarks/h200_mosaic.sh unmasked # the column poison on masked steps only: NaN
#                                          # masking, fwd+bwd beside cuDNN BF16, GPU
#                                          # correctness with segments and GQA
#   bash benchmarks/h200_mosaic.sh docs    # packed documents: document tiles bit for bit
#                                          # against every tile visited and masked (forward
#                                          # first, then the gradients); the 569m layer at
#                                          # 8 x 4096 with and without segment ids, Mosaic FP8
#                                          # matched (with and without document tiles) against
#                                          # cuDNN BF16 through a dense mask and its packed
#                                          # sequences (docs/training.md, "Pairs 6 and 7")
#   bash benchmarks/h200_mosaic.sh kernels # one fwd+bwd under jax's profiler, kernel by kernel
#                                          # (benchmarks/layer_kernels.py): the 569m layer and
#                                          # small at 8 x 8192 with documents against cuDNN's
#                                          # packed path, the main shape against cuDNN BF16
#   bash benchmarks/h200_mosaic.sh variants # the layers with documents under the backward's
#                                          # variants (benchmarks/key_pass_variants.py:
#                                          # ptxas spills, kernel split, bits) and the
#                                          # CTA fixed-cost fit (benchmarks/cta_overhead.py);
#                                          # shared_quantize's launches and time
#   bash benchmarks/h200_mosaic.sh early  # the backward's schedules (early_p: P while the
#                                          # dP^ dot runs; ds_tile: dS^ scaled per tile):
#                                          # kernel split, spills, bits; fwd+bwd with errors
#                                          # (CAUSAL=1: causal); shared_quantize's launches
#   bash benchmarks/h200_mosaic.sh rows   # dS^ scaled per tile row (the default): both
#                                          # backends against the emulation and f32, then
#                                          # fwd+bwd beside per-tile scales and cuDNN BF16
#   bash benchmarks/h200_mosaic.sh rowsheads # the same for head dims 64, 256 and 192/128
#                                          # (GQA + segments), then causal stale beside matched
#   bash benchmarks/h200_mosaic.sh regs   # consumers at 240 registers / producer 24 (the
#                                          # default) against 232 / 40 at D=128, 256 and with
#                                          # documents (spills, kernel split, bits), then
#                                          # fwd+bwd end to end beside cuDNN BF16
#   bash benchmarks/h200_mosaic.sh qprofile # Nsight Compute on the quantize pre-pass kernel
#                                          # (memory throughput, registers, stalls, SASS hotspots;
#                                          # QWARPS=8: at 8 warps per program)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
MODE=${1:-}
OUT=${OUT:-/tmp/out}
W=/tmp/h200_mosaic/$MODE
mkdir -p "$OUT" "$W"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

key_pass_variants() {  # key_pass_variants SECONDS NAME:CAUSAL:VARIANT,...:
  # benchmarks/key_pass_variants.py per shape under ptxas' dump (MOSAIC_GPU_DUMP_PTXAS=1):
  # spills, the kernel split, bits
  local limit=$1 spec name causal names
  shift
  for spec in "$@"; do
    IFS=: read -r name causal names <<< "$spec"
    mkdir -p "$W/$name"
    MOSAIC_GPU_DUMP_PTXAS=1 timeout "$limit" python3 benchmarks/key_pass_variants.py \
      --shape "$name" --causal "$causal" --variants "$names" --out "$W/$name" > "$W/$name/log" 2>&1
    echo "$name: exit $?"
    grep "=== variant\|spill stores" "$W/$name/log" | grep -v "^    " | cut -c1-150
    grep "^|" "$W/$name/log"
  done
}

logged() {  # logged SECONDS NAME CMD...: CMD under a timeout into $W/NAME.log, its exit
  # status and its table rows
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  echo "$name: exit $?"
  grep "^|" "$W/$name.log"
}

dq128_correctness() {  # dq128_correctness SECONDS CASES: the Mosaic backend on 64 x 128 dS
  # scale tiles against the emulation and f32 (benchmarks/correctness.py --bwd-block-k 128)
  mkdir -p "$W/correctness"
  logged "$1" correctness python3 benchmarks/correctness.py --implementation mosaic \
    --budget $(($1 - 30)) --bwd-block-k 128 --only "$2" --out "$W/correctness"
}

time_shared_quantize() {  # time_shared_quantize SECONDS: Q, K, V quantized once per step when XLA
  # merges the forward's and backward's calls: launches per step (7 quantize launches
  # without) and the time, the small preset's layer with documents
  timeout "$1" python3 benchmarks/layer_kernels.py --shape small_t8192_docs --causal 1 \
    --arms mosaic_fp8_matched_separate_quantize,mosaic_fp8_matched --out "$W" \
    > "$W/shared_quantize.log" 2>&1
  echo "shared_quantize: exit $?"
  grep "^|" "$W/shared_quantize.log"
}

case "$MODE" in
check)
  CASES=T2000_d128_gqa_seg_causal,T4096_d128_128,T4096_d128_128_causal,T4096_d64_64_causal
  [ "${LONG:-0}" = 1 ] && CASES="$CASES,T16384_d128_128_causal"
  logged 330 correctness python3 benchmarks/correctness.py --implementation mosaic \
    --budget 240 --only "$CASES" --out "$W"
  timeout 150 python3 benchmarks/nan_masking.py --implementations pallas --out "$W" \
    > "$W/nan_masking.log" 2>&1
  echo "nan_masking: exit $?"
  tail -12 "$W/nan_masking.log"
  ;;
passes)
  logged 240 mosaic_backward python3 benchmarks/mosaic_backward.py --stages 2 \
    --delta-key-tiles 128 --pingpong 0,1 --causal 0,1 --out "$W"
  ;;
step)
  timeout 420 python3 benchmarks/attention.py --causal both \
    --arms mosaic_fp8_matched,mosaic_fp8_stale,cudnn_bf16,cudnn_fp8 --out "$W" \
    > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  tail -20 "$W/attention.log"
  # D=256: the forward's quantize pre-pass as one kernel against XLA ops (the forward ran
  # at 330 TFLOP/s in the head-dim run, 498 before the fused kernel and the NaN masking)
  logged 120 passes_d256 python3 benchmarks/passes.py --implementation mosaic --shape d256 \
    --modes default,xla_quantize --out "$W"
  ;;
levers)
  # the quantize kernel's warps per program at the main shape
  logged 150 quantize_speed python3 benchmarks/quantize_speed.py --warps 4,8,16 --out "$W"
  # D=256's forward kernel: registers and spills (ptxas' report)
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 benchmarks/profile_mosaic.py --shape d256 \
    > "$W/ptxas_d256_forward.log" 2>&1
  echo "ptxas d256: exit $?"
  grep -i "registers\|spill\|stack" "$W/ptxas_d256_forward.log" | head -8
  ;;
wide)
  logged 300 correctness python3 benchmarks/correctness.py --implementation mosaic \
    --budget 240 --only T4096_d256_256_causal,T4096_d192_128_causal --out "$W"
  timeout 240 python3 benchmarks/attention.py --shapes d256,d192_128 --causal 0 --budget 200 \
    --arms mosaic_fp8_matched,mosaic_fwd_triton_bwd_fp8_matched,cudnn_bf16 --tag _wide \
    --out "$W" > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  tail -8 "$W/attention.log"
  ;;
headline)
  logged 200 correctness python3 benchmarks/correctness.py --implementation mosaic \
    --budget 150 \
    --only T4096_d128_128,T4096_d128_128_causal,T4096_d256_256_causal,T4096_d192_128_causal \
    --out "$W"
  logged 70 mosaic_backward python3 benchmarks/mosaic_backward.py --stages 2 \
    --delta-key-tiles 128 --pingpong 0 --causal 0 --out "$W"
  timeout 150 python3 benchmarks/attention.py --shapes main,d64,d256,d192_128 --causal 0 \
    --budget 130 --iters 5 --reps 3 --arms mosaic_fp8_matched,cudnn_bf16 --tag _heads \
    --out "$W" > "$W/attention_heads.log" 2>&1
  echo "attention heads: exit $?"
  grep "^| [a-z0-9_]* | [a-z]" "$W/attention_heads.log"
  timeout 110 python3 benchmarks/attention.py --shapes main --causal 1 --budget 90 \
    --arms mosaic_fp8_matched,cudnn_bf16,cudnn_fp8,mosaic_fp8_stale --tag _causal \
    --out "$W" > "$W/attention_causal.log" 2>&1
  echo "attention causal: exit $?"
  grep "^| [a-z0-9_]* | [a-z]" "$W/attention_causal.log"
  ;;
docs)
  # MosaicConfig(document_tiles=True) (the default) against False, bit for bit (max abs diff 0)
  timeout 300 python3 benchmarks/document_tiles.py --out "$W" > "$W/document_tiles.log" 2>&1
  echo "document_tiles: exit $?"
  grep "^|" "$W/document_tiles.log" || grep -E "causal=|Error" "$W/document_tiles.log" | tail -4 | cut -c1-300
  timeout 250 python3 benchmarks/attention.py --shapes h569m_t4096_docs,h569m_t4096 --causal 1 \
    --budget 220 --iters 5 --reps 3 --tag _docs --out "$W" \
    --arms cudnn_bf16_packed,cudnn_bf16,mosaic_fp8_matched_every_tile,mosaic_fp8_matched \
    > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  grep "^| [a-z0-9_]* | [a-z]" "$W/attention.log"
  ;;
kernels)
  for shape in h569m_t4096_docs:1:cudnn_bf16_packed small_t8192_docs:1:cudnn_bf16_packed \
      main:0:cudnn_bf16; do
    IFS=: read -r name causal cudnn <<< "$shape"
    mkdir -p "$W/$name"
    timeout 150 python3 benchmarks/layer_kernels.py --shape "$name" --causal "$causal" \
      --arms "mosaic_fp8_matched,$cudnn" --out "$W/$name" > "$W/$name/layer_kernels.log" 2>&1
    echo "$name: exit $?"
    grep "^|" "$W/$name/layer_kernels.log"
  done
  ;;
dqkeys)
  logged 250 dq_key_pass python3 benchmarks/dq_key_pass.py --out "$W"
  timeout 280 python3 benchmarks/attention.py --causal both --shapes main --iters 5 --reps 3 \
    --budget 240 --arms mosaic_fp8_matched,mosaic_fp8_matched_dq_key_pass,cudnn_bf16 \
    --tag _dq_key_pass --out "$W" > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  tail -12 "$W/attention.log"
  ;;
dqwide)
  timeout 420 python3 benchmarks/attention.py --causal 0 --shapes d64,d256,d192_128 --iters 5 \
    --reps 3 --budget 380 --arms mosaic_fp8_matched,mosaic_fp8_matched_dq_key_pass,cudnn_bf16 \
    --tag _dq_key_pass_wide --out "$W" > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  tail -12 "$W/attention.log"
  ;;
profile)
  for pass in ${PASSES:-dkdv_pass dq_pass}; do
    kernel=query_pass
    [ "$pass" = dkdv_pass ] && kernel=key_pass
    [ "$pass" = forward_kernel ] && kernel=forward_mosaic
    # launches 1-2 of the kernel are warm-up (and the dQ plan's own delta launch)
    timeout 200 ncu --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section LaunchStats -f -o "$W/$pass" \
      python3 benchmarks/profile_mosaic.py --pass "$pass" --shape "${SHAPE:-main}" ${CAUSAL:+--causal} \
      > "$W/$pass.ncu.log" 2>&1
    echo "ncu $pass: exit $?"
    ncu --import "$W/$pass.ncu-rep" --page source --csv --print-source sass \
      > "$W/$pass.sass.csv" 2> "$W/$pass.import.err"
    ncu --import "$W/$pass.ncu-rep" > "$W/$pass.details.txt" 2>&1
    python3 benchmarks/ncu_hotspots.py "$W/$pass.sass.csv" --top 25 > "$W/$pass.hot.txt" 2>&1
    grep -A40 "share by opcode" "$W/$pass.hot.txt" | cut -c1-150
  done
  ;;
gaps)
  logged 230 correctness python3 benchmarks/correctness.py --implementation mosaic \
    --budget 190 \
    --only T2000_d256_256_gqa_seg_causal,T2000_d192_128_gqa_seg_causal,T4096_d256_256_causal \
    --out "$W"
  timeout 130 python3 benchmarks/attention.py --shapes main --causal 1 --budget 100 --iters 5 \
    --reps 3 --arms mosaic_fp8_matched,mosaic_fp8_stale,cudnn_bf16 --tag _causal_stale \
    --out "$W" > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  grep "^| [a-z0-9_]* | [a-z]" "$W/attention.log"
  ;;
order)
  for shape in main d256 h569m_t8192 small_t8192; do
    timeout 140 python3 benchmarks/mosaic_backward.py --shape $shape --causal 1 --stages 2 \
      --causal-orders grid,longest_first --iters 10 --reps 3 --out "$W" > "$W/$shape.log" 2>&1
    echo "$shape: exit $?"
    mv "$W/mosaic_backward.json" "$W/$shape.json" 2> /dev/null
    grep "^|" "$W/$shape.log"
  done
  timeout 200 python3 benchmarks/attention.py --shapes main,d256 --causal 1 --budget 170 \
    --iters 5 --reps 3 --arms mosaic_fp8_matched,mosaic_fp8_matched_grid_order,cudnn_bf16 \
    --tag _causal_order --out "$W" > "$W/attention.log" 2>&1
  echo "attention: exit $?"
  grep "^| [a-z0-9_]* [a-z]* | [a-z]" "$W/attention.log"
  ;;
qprofile)
  # launch 1 of each pre-pass is the bitwise check's; profile a timed one of each kind
  timeout 190 ncu --clock-control none -k "regex:quantize" --launch-skip 7 \
    --launch-count 2 --set full -f -o "$W/quantize" \
    python3 benchmarks/quantize_speed.py --warps "${QWARPS:-4}" --iters 2 --reps 1 --out "$W" \
    > "$W/quantize.ncu.log" 2>&1
  echo "ncu quantize: exit $?"
  ncu --import "$W/quantize.ncu-rep" --page source --csv --print-source sass \
    > "$W/quantize.sass.csv" 2> "$W/quantize.import.err"
  ncu --import "$W/quantize.ncu-rep" > "$W/quantize.details.txt" 2>&1
  python3 benchmarks/ncu_hotspots.py "$W/quantize.sass.csv" --top 25 > "$W/quantize.hot.txt" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Local|Block Limit|Theoretical Occ|Grid Size|Block Size|Dynamic Shared|Static Shared" \
    "$W/quantize.details.txt" | head -60
  grep -A22 "share by opcode" "$W/quantize.hot.txt" | cut -c1-150
  gzip -f "$W/quantize.sass.csv"; rm -f "$W/quantize.ncu-rep"
  ;;
variants)
  # ptxas' spills (MOSAIC_GPU_DUMP_PTXAS=1) and the kernel split of the layers with
  # documents under the backward's variants; the equal-work CTA fit
  key_pass_variants 150 small_t8192_docs:1:default,pieces128,masked_documents \
    h569m_t4096_docs:1:default,pieces128 d256:0:pieces128,pieces64
  time_shared_quantize 150
  timeout 150 python3 benchmarks/cta_overhead.py --out "$W" > "$W/cta_overhead.log" 2>&1
  echo "cta_overhead: exit $?"
  tail -6 "$W/cta_overhead.log"
  ;;
early)
  # the backward's schedules: P formed while the dP^ dot runs (early_p, bitwise) and dS^
  # scaled per tile (ds_tile, the numerics until 2026-12-04; the default scales per tile
  # row): kernel split, ptxas spills and bits at the main shape and the small preset's
  # layer with documents, then fwd+bwd end to end from bf16 with errors against f32
  # beside cuDNN BF16; shared_quantize's launches last
  V=${VARIANTS:-ds_tile,default,early_p,early_p_ds_tile}
  key_pass_variants 140 "main:0:$V" "small_t8192_docs:1:$V"
  A=mosaic_fp8_matched_ds_tile,mosaic_fp8_matched,mosaic_fp8_matched_early_p
  A=${ARMS:-$A,mosaic_fp8_matched_separate_quantize,cudnn_bf16}
  logged 170 attention python3 benchmarks/attention.py --shapes main --causal "${CAUSAL:-0}" \
    --iters 5 --reps 3 --budget 150 --arms "$A" --out "$W"
  time_shared_quantize 100
  ;;
rows)
  # dS^ scaled per tile row (NumericsTiles.ds_scale="rows", the default since 2026-12-04)
  # on the GPU: both backends against the emulation and f32 (matched pre-cast row sums),
  # then fwd+bwd end to end against the per-tile scales and cuDNN BF16, causal and not
  logged 200 mosaic python3 benchmarks/correctness.py --implementation mosaic --budget 170 \
    --only T2000_d128_gqa_seg_causal,T4096_d128_128_causal --out "$W"
  mkdir -p "$W/triton"
  logged 110 triton python3 benchmarks/correctness.py --implementation triton --budget 90 \
    --only T2000_d128_gqa_seg_causal --out "$W/triton"
  logged 200 attention python3 benchmarks/attention.py --shapes main --causal both --iters 5 \
    --reps 3 --budget 180 --arms mosaic_fp8_matched_ds_tile,mosaic_fp8_matched,cudnn_bf16 \
    --out "$W"
  ;;
rowsheads)
  logged 200 mosaic python3 benchmarks/correctness.py --implementation mosaic --budget 170 \
    --only T2000_d256_256_gqa_seg_causal,T2000_d192_128_gqa_seg_causal,T4096_d64_64_causal \
    --out "$W"
  logged 200 attention_heads python3 benchmarks/attention.py --shapes d64,d256,d192_128 \
    --causal 0 --iters 5 --reps 3 --budget 180 \
    --arms mosaic_fp8_matched_ds_tile,mosaic_fp8_matched,cudnn_bf16 --tag _heads --out "$W"
  logged 110 attention_stale python3 benchmarks/attention.py --shapes main --causal 1 \
    --iters 5 --reps 3 --budget 90 --arms mosaic_fp8_matched,mosaic_fp8_stale,cudnn_bf16 \
    --tag _stale --out "$W"
  ;;
dq128)
  # dS scale tiles of 64 x 128 (NumericsTiles(bwd_block_k=128): dQ's dS^ one scale per
  # query over 128 keys, so the dQ pass steps 128 keys; dK's per-key scales stay over 64
  # queries): correctness against the emulation and f32 on the GPU, the passes alone, ptxas'
  # spills and the kernel split (main, and the small preset's layer with documents), then
  # fwd+bwd end to end from bf16 beside the 64 x 64 tiles and cuDNN BF16
  dq128_correctness 130 T2000_d128_gqa_seg_causal,T4096_d128_128_causal
  logged 90 passes python3 benchmarks/mosaic_backward.py --stages 2 --dq-key-tiles 64,128 \
    --causal 0,1 --iters 5 --out "$W"
  key_pass_variants 80 "main:0:default,dq128" "small_t8192_docs:1:default,dq128"
  logged 150 attention python3 benchmarks/attention.py --shapes main --causal both --iters 5 \
    --reps 3 --budget 130 --arms mosaic_fp8_matched,mosaic_fp8_matched_dq128,cudnn_bf16 \
    --out "$W"
  ;;
dq128causal)
  # the causal side of dq128: ptxas' spills and the kernel split of the causal main shape
  # (64 x 64, 64 x 128, 64 x 128 with 64-column dots), the GPU correctness rows dq128's
  # call did not reach, and MLA 192/128 fwd+bwd beside cuDNN BF16 (V padded)
  key_pass_variants 150 "main:1:default,dq128,dq128_pieces64"
  dq128_correctness 200 T4096_d128_128_causal,T2000_d128_gqa_seg_causal
  logged 120 attention_mla python3 benchmarks/attention.py --shapes d192_128 --causal 0 \
    --iters 5 --reps 3 --budget 100 --arms mosaic_fp8_matched,cudnn_bf16 --tag _mla --out "$W"
  ;;
dq128e2e)
  # the decision on 64 x 128 dS tiles: fwd+bwd end to end from bf16 with the 64-column
  # dots rule, causal and not, beside stale and cuDNN BF16; the Triton backward on both
  # tiles (they are backend-neutral); D=64; the causal key pass with 64-column dots on the
  # 64 x 64 tiles
  for causal in 0 1; do
    logged 150 "attention_causal$causal" python3 benchmarks/attention.py --shapes main \
      --causal $causal --iters 5 --reps 3 --budget 135 --tag "_causal$causal" --out "$W" \
      --arms cudnn_bf16,mosaic_fp8_matched,mosaic_fp8_matched_dq128,mosaic_fp8_stale,triton_fp8_matched_dq128,triton_fp8_matched
  done
  logged 100 attention_d64 python3 benchmarks/attention.py --shapes d64 --causal 0 --iters 5 \
    --reps 3 --budget 85 --arms cudnn_bf16,mosaic_fp8_matched,mosaic_fp8_matched_dq128 \
    --tag _d64 --out "$W"
  key_pass_variants 80 "main:1:default,pieces64"
  ;;
unmasked)
  # the column poison on masked steps only (2026-12-07): NaN masking, fwd+bwd end to end
  # beside cuDNN BF16 (causal and not), GPU correctness with segments and GQA
  timeout 80 python3 benchmarks/nan_masking.py --implementations pallas --out "$W" \
    > "$W/nan_masking.log" 2>&1
  echo "nan_masking: exit $?"
  tail -5 "$W/nan_masking.log"
  for causal in 0 1; do
    logged 100 "attention_causal$causal" python3 benchmarks/attention.py --shapes main \
      --causal $causal --iters 5 --reps 3 --budget 85 --tag "_causal$causal" --out "$W" \
      --arms cudnn_bf16,mosaic_fp8_matched
  done
  logged 100 correctness python3 benchmarks/correctness.py --implementation mosaic \
    --budget 75 --only T2000_d128_gqa_seg_causal --out "$W"
  ;;
dq128triton)
  # the Triton backward on 64 x 128 dS tiles with the dK/dV pass at 64 keys per program
  # (TritonConfig.dkdv_keys): its passes under warps and stages, fwd+bwd end to end on both
  # tiles; the Mosaic backend's GPU correctness at D=64 on 64 x 128
  logged 170 triton_passes python3 benchmarks/passes.py --implementation triton --modes fast \
    --bwd 64,128,128:8:2,128:4:3,128:8:1 --only delta_matched_kernel,dq_pass,dkdv_pass \
    --bf16 0 --iters 5 --budget 150 --out "$W"
  logged 150 attention python3 benchmarks/attention.py --shapes main --causal both --iters 5 \
    --reps 3 --budget 135 --arms triton_fp8_matched,triton_fp8_matched_dq64 --out "$W"
  dq128_correctness 100 T4096_d64_64_causal
  ;;
regs)
  # the setmaxnreg split of every warp-specialized kernel: 240 / 24 (default) and 232 / 40
  # (regs232), twice interleaved, where 2026-12-07 did not time it; then end to end
  key_pass_variants 110 small_t8192_docs:1:default,regs232,default,regs232 \
    d256:0:default,regs232,default,regs232 main:0:default,regs232
  logged 150 attention python3 benchmarks/attention.py --shapes main --causal "${CAUSAL:-0}" \
    --iters 5 --reps 3 --budget 120 --arms cudnn_bf16,mosaic_fp8_matched --out "$W"
  ;;
*)
  echo "usage: bash benchmarks/h200_mosaic.sh check|passes|step|levers|wide|headline|docs|dqkeys|dqwide|profile|gaps|order|qprofile|variants|early|rows|rowsheads|dq128|dq128causal|dq128e2e|dq128triton|unmasked|regs" >&2
  exit 2
  ;;
esac
tar czf "$OUT/mosaic_$MODE.tgz" -C "$(dirname "$W")" "$MODE"
