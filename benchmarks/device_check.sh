#!/usr/bin/env bash
# One prepared check for a Hopper (sm90) machine without network.
#
#   bash benchmarks/device_check.sh            # full: under 8 minutes
#   bash benchmarks/device_check.sh --quick    # under 4 minutes
#
# Steps, in order, each under its own hard timeout (`timeout` kills the
# step's whole process group) and each writing under $OUT (default
# ./device_out) as it finishes, so a hang loses only its own step:
#   versions   jax, jaxlib, CUDA runtime/driver, cuDNN, every ptxas, nvidia-smi
#   smoke      one tiny call of each path never run before its first GPU run
#              (pingpong turns, TMA reduce-add, the dS exchange, deterministic,
#              shared tile, d256, 4-warpgroup quantization, FP8) vs golden, each
#              in its own process under its own timeout ("hang" if killed)
#   causal     the causal mask on this exact toolchain (ours and attention_mgpu;
#              JAX avoids causal on CUDA 12.8-12.9.1 for a ptxas miscompile)
#   gpu_tests  tests/test_sm90_gpu.py: configs vs golden, compiled once, several
#              inputs each (--quick: default configs only), 8 pytest workers
#   fp8_tests  tests/test_sm90_fp8_gpu.py (likewise; not in --quick)
#   bench_fwd  bf16 forward, d64/128/256, 16k tokens, causal and not: ours,
#              the blockwise twin, cuDNN, XLA, attention_mgpu side by side
#   bench_bwd  bf16 backward at d128/256 (--quick: d128): the fused kernel
#              (mosaic) and deterministic=True (mosaic-det) beside cuDNN
#   decode     one decode step over a KV cache (`bench --mode decode --tags
#              headline`: batch 64 x 8k, 32/8 heads, d128, contiguous and
#              page 64; batch 1 x 128k split-KV): GB/s and % of the HBM peak
#              of ours (bf16 and e4m3 caches), JAX's Triton
#              decode_attention.gqa / paged_attention, XLA and cuDNN (a time
#              budget cuts the baselines first)
#   decode_modes issue 67's rows (`--tags decode-modes`): q_len 1, 4, 8, 16
#              at batch 64 x 8k and 1 x 128k, batch_invariant=True at both,
#              a flex decode (ALiBi + documents, page 64): ours, GB/s and %
#              of the HBM peak (the e4m3 MLA row is decode_mla's fp8 one)
#   varlen     `bench --mode varlen`: 16 long-tailed sequences, 64k tokens,
#              flash_attention_varlen beside segment ids, padded, jax.nn
#   ragged_decode  benchmarks/ragged_decode.py: one ragged kvcache call
#              (2 prefill chunks, 12 decode tokens, 2 speculative runs of 4)
#              against a call per sequence, ms per step
#   jvp        benchmarks/jvp_cost.py: jax.jvp (the forward and the
#              forward-tangent kernel) against the forward at 8k, d128,
#              TFLOP/s on the primal
#   fp8_speed  FP8 forward at 16k: quantization, kernel, total; Table-3 RMSE
#   grid       the forward's persistent vs per-tile grid, d64/d128 at 16k
#              (not in --quick)
#   headline   $OUT/headline.md: the timing steps' tables (TFLOP/s; decode:
#              GB/s and % of the HBM peak)
# $OUT/steps.tsv has one line per step: name, exit code (124: timed out),
# seconds. Without a GPU (a CPU rehearsal) every GPU step runs its
# rehearsal instead: imports and test collection under this JAX.
# DEVICE_CHECK_SELFTEST=1 adds a step that hangs, to show timeouts fire.

set -u
cd "$(dirname "$0")/.."
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
OUT="${OUT:-$PWD/device_out}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Several processes share the GPU (pytest workers): no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
START=$(date +%s)
printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"

# run_step NAME SECONDS CMD...: CMD's output to $OUT/NAME.txt, its status to
# steps.tsv; a step past SECONDS gets SIGTERM, then SIGKILL 5 s later (the
# whole process group: `timeout` runs CMD in a group of its own).
run_step() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== [$(( t0 - START )) s] $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
  echo "   exit $rc$([ $rc = 124 ] && echo ' (timed out)')"
  tail -n 4 "$OUT/$name.txt" | cut -c1-200
}

if [ "${DEVICE_CHECK_SELFTEST:-0}" = 1 ]; then
  run_step selftest_hang 3 bash -c 'sleep 300 & sleep 300'
fi

run_step versions 20 "$PY" benchmarks/device_smoke.py versions --out "$OUT"
GPU=$(grep -c '"hopper": "yes"' "$OUT/versions.json" 2>/dev/null)

if [ "$QUICK" = 1 ]; then
  export PALLAS_FA3_GPU_TIER=quick
  DIMS_FWD="128"; DIMS_BWD="128"; DIMS_FP8="128"
  # Worst case 235 s: the FP8 configs are left to the smoke call. The
  # decode step's 25 s came from smoke (60 -> 50), gpu_tests (45 -> 35)
  # and headline (15 -> 10).
  # The MLA step's 15 s came from smoke (50 -> 45), causal (20 -> 15) and
  # bench_fwd (30 -> 25).
  # The decode_modes step's 15 s came from gpu_tests (35 -> 30), bench_fwd
  # (25 -> 20) and bench_bwd (25 -> 20).
  # The varlen and ragged steps' 10 s each came from smoke (45 -> 40),
  # gpu_tests (30 -> 25), bench_fwd (20 -> 15) and bench_bwd (20 -> 15).
  # The jvp step's 10 s came from smoke (40 -> 35) and causal (15 -> 10).
  T_SMOKE=35; T_CAUSAL=10; T_TESTS=25; T_FP8T=0; T_FWD=15; T_BWD=15; T_FP8=20
  T_GRID=0; T_DEC=25; T_MLA=15; T_MODES=15; T_HEAD=10; T_VARLEN=10
  T_RAGGED=10; T_JVP=10
else
  export PALLAS_FA3_GPU_TIER=full
  DIMS_FWD="64 128 256"; DIMS_BWD="128 256"; DIMS_FP8="128 256"
  # Worst case 480 s (every step at its limit). The decode step's 40 s
  # came from gpu_tests (95 -> 90), bench_fwd (70 -> 60), bench_bwd
  # (60 -> 50), fp8_speed (35 -> 30), grid (35 -> 30), headline (15 -> 10).
  # The MLA step's 20 s came from gpu_tests (90 -> 80) and grid (30 -> 20),
  # its e4m3 cache's 10 s from bench_fwd (60 -> 55) and bench_bwd (50 -> 45).
  # The decode_modes step's 30 s came from gpu_tests (80 -> 70), fp8_tests
  # (45 -> 40), bench_fwd (55 -> 50), bench_bwd (45 -> 40), grid (20 -> 15).
  # The varlen step's 20 s and the ragged step's 10 s came from smoke
  # (70 -> 65), gpu_tests (70 -> 65), bench_fwd (50 -> 40), bench_bwd
  # (40 -> 35) and grid (15 -> 10).
  # The jvp step's 15 s came from gpu_tests (65 -> 60), bench_fwd (40 -> 35)
  # and bench_bwd (35 -> 30).
  T_SMOKE=65; T_CAUSAL=35; T_TESTS=60; T_FP8T=40; T_FWD=35; T_BWD=30; T_FP8=30
  T_GRID=10; T_DEC=40; T_MLA=30; T_MODES=30; T_HEAD=10; T_VARLEN=20
  T_RAGGED=10; T_JVP=15
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -n 8)
BENCH=("$PY" -m pallas_fa3.tools.cli bench --dtype bf16 --seq 16384 --tokens 16384
       --hidden 2048 --runs 10 --warmup 2 --no-progress --no-plots
       --impl mosaic mosaic-det blockwise cudnn xla mgpu)
# The GPU grid's headline points (also on a CPU: --grid gpu), ours first.
DECODE=("$PY" -m pallas_fa3.tools.cli bench --mode decode --grid gpu --tags headline
        --dtype bf16 fp8 --runs 10 --warmup 2 --no-progress --no-plots
        --impl mosaic triton-gqa triton-paged xla cudnn)
# DeepSeek MLA's target point (batch 64 x 8k, 128 heads, page 64): the MLA
# kernel beside its blockwise twin, from a bf16 and an e4m3 cache (the
# issue's >= 1.8x tokens/s from e4m3).
DECODE_MLA=("$PY" -m pallas_fa3.tools.cli bench --mode decode --mla --grid gpu
            --tags headline --dtype bf16 fp8 --runs 10 --warmup 2 --no-progress
            --no-plots --impl mosaic blockwise)
# Issue 67's decode rows: speculative q_len 1/4/8/16, batch-invariant, flex.
DECODE_MODES=("$PY" -m pallas_fa3.tools.cli bench --mode decode --grid gpu
              --tags decode-modes --dtype bf16 --runs 10 --warmup 2
              --no-progress --no-plots --impl mosaic)
# Issue 68: 16 long-tailed sequences through flash_attention_varlen beside
# segment ids, the padded call and jax.nn (64k tokens at d128), and one
# ragged kvcache call (prefill chunks beside decode tokens) against a call
# per sequence.
VARLEN=("$PY" -m pallas_fa3.tools.cli bench --mode varlen --runs 10 --warmup 2
        --no-progress --no-plots)
RAGGED=("$PY" benchmarks/ragged_decode.py --reps 10)
# Issue 69: jax.jvp (forward kernel + forward-tangent kernel) against the
# forward, TFLOP/s on the primal (target: jvp >= 0.45x the forward's).
JVP=("$PY" benchmarks/jvp_cost.py --seq 8192 --head-dims 128)

if [ "$GPU" = 1 ]; then
  # Every smoke item at once, each in its own process and killed (recorded
  # as "hang") 12 s before the step's own limit.
  run_step smoke "$T_SMOKE" "$PY" benchmarks/device_smoke.py smoke --out "$OUT" \
    --item-timeout $(( T_SMOKE - 12 ))
  run_step causal "$T_CAUSAL" "$PY" benchmarks/device_smoke.py causal --out "$OUT"
  run_step gpu_tests "$T_TESTS" "${PYTEST[@]}" tests/test_sm90_gpu.py
  [ "$T_FP8T" -gt 0 ] && run_step fp8_tests "$T_FP8T" "${PYTEST[@]}" tests/test_sm90_fp8_gpu.py
  run_step bench_fwd "$T_FWD" "${BENCH[@]}" --mode fwd --head-dim $DIMS_FWD \
    --time-budget $(( T_FWD - 25 )) --out "$OUT/bench_fwd"
  run_step bench_bwd "$T_BWD" "${BENCH[@]}" --mode bwd --head-dim $DIMS_BWD \
    --time-budget $(( T_BWD - 20 )) --out "$OUT/bench_bwd"
  # 15 s of margin: start-up (JAX, CUDA) and the last case's compile.
  run_step decode "$T_DEC" "${DECODE[@]}" --time-budget $(( T_DEC - 15 )) \
    --out "$OUT/decode"
  run_step decode_mla "$T_MLA" "${DECODE_MLA[@]}" \
    --time-budget $(( T_MLA - 12 )) --out "$OUT/decode_mla"
  run_step decode_modes "$T_MODES" "${DECODE_MODES[@]}" \
    --time-budget $(( T_MODES - 12 )) --out "$OUT/decode_modes"
  run_step varlen "$T_VARLEN" "${VARLEN[@]}" --out "$OUT/varlen"
  run_step ragged_decode "$T_RAGGED" "${RAGGED[@]}" --impl mosaic
  run_step jvp "$T_JVP" "${JVP[@]}" --implementation mosaic --dtype bfloat16 \
    --runs 5 --json "$OUT/jvp.json"
  run_step fp8_speed "$T_FP8" "$PY" benchmarks/fp8_device_check.py \
    --out "$OUT/fp8" --head-dim $DIMS_FP8 --time-budget $(( T_FP8 - 15 ))
  [ "$T_GRID" -gt 0 ] && run_step grid "$T_GRID" "$PY" benchmarks/grid_check.py \
    --out "$OUT/grid" --time-budget $(( T_GRID - 15 ))
else
  echo "no Hopper GPU: rehearsal (imports and test collection only)"
  run_step smoke 60 "$PY" benchmarks/device_smoke.py smoke --out "$OUT" \
    --item-timeout 5  # only the self-test item runs here: it sleeps
  run_step causal 60 "$PY" benchmarks/device_smoke.py causal --out "$OUT"
  run_step gpu_tests 120 "${PYTEST[@]:0:4}" --collect-only \
    tests/test_sm90_gpu.py tests/test_sm90_fp8_gpu.py
  # The timing steps' own command lines with a zero time budget: every case
  # is listed as skipped, the files are written.
  run_step bench_fwd 120 "${BENCH[@]}" --mode fwd --head-dim $DIMS_FWD \
    --time-budget 0 --out "$OUT/bench_fwd"
  run_step bench_bwd 120 "${BENCH[@]}" --mode bwd --head-dim $DIMS_BWD \
    --time-budget 0 --out "$OUT/bench_bwd"
  run_step decode 120 "${DECODE[@]}" --time-budget 0 --out "$OUT/decode"
  run_step decode_mla 120 "${DECODE_MLA[@]}" --time-budget 0 \
    --out "$OUT/decode_mla"
  run_step decode_modes 120 "${DECODE_MODES[@]}" --time-budget 0 \
    --out "$OUT/decode_modes"
  run_step varlen 120 "${VARLEN[@]}" --runs 1 --warmup 0 --out "$OUT/varlen"
  run_step ragged_decode 120 "${RAGGED[@]}" --reps 1 --impl blockwise
  run_step jvp 120 "$PY" benchmarks/jvp_cost.py --seq 256 --head-dims 64 \
    --runs 1 --json "$OUT/jvp.json"
  run_step fp8_speed 120 "$PY" benchmarks/fp8_device_check.py \
    --out "$OUT/fp8" --head-dim $DIMS_FP8 --time-budget 0
  run_step grid 60 "$PY" benchmarks/grid_check.py --out "$OUT/grid" \
    --time-budget 0
fi
run_step headline "$T_HEAD" "$PY" benchmarks/headline.py "$OUT"
echo "== [$(( $(date +%s) - START )) s] done: $OUT/steps.tsv, $OUT/headline.md"
cat "$OUT/steps.tsv"
