#!/usr/bin/env bash
# One prepared check for a Hopper (sm90) machine without network: GPU
# correctness tests, then the FA3-paper grid with `pallas-fa3 bench`.
#
# Assumes JAX (with CUDA) is installed and this checkout is the working
# directory. Every result goes under $OUT (default: ./device_out):
#   $OUT/env.txt               nvidia-smi, `pallas-fa3 info`
#   $OUT/pytest_*.txt          GPU correctness tests (every kernel config,
#                              the shared suite on mosaic, the harness)
#   $OUT/bench/                forward grid: results.csv/json, summary.md, plots/
#   $OUT/bench_bwd/            backward and fwd+bwd at head dims 128, 256
#   $OUT/pytest_fp8_gpu.txt, $OUT/fp8/fp8.json   FP8 configs, RMSE, speed
# and a short table (16k-token rows of both sweeps) is printed last.
# Total under 12 minutes (FP8 steps: up to 4): each step has its own `timeout`, and the sweeps
# have a --time-budget after which remaining cases are listed as skipped
# (their files are still written).
#
# Usage (from the repository root):  bash benchmarks/device_check.sh

set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
START=$(date +%s)

step() { echo "== [$(( $(date +%s) - START )) s] $*"; }

step "environment"
{ nvidia-smi || true; timeout 30 "$PY" -m pallas_fa3.cli info --no-run; } \
  > "$OUT/env.txt" 2>&1
tail -n 12 "$OUT/env.txt"

step "GPU correctness: every forward and backward kernel config (tests/test_sm90_gpu.py)"
timeout 150 "$PY" -m pytest tests/test_sm90_gpu.py -q -x -p no:cacheprovider \
  > "$OUT/pytest_sm90_gpu.txt" 2>&1
echo "exit $?"; tail -n 3 "$OUT/pytest_sm90_gpu.txt"

step "GPU correctness: the shared suite, tests/test_attention.py -k mosaic"
timeout 45 "$PY" -m pytest tests/test_attention.py -q -k "mosaic" -x \
  -p no:cacheprovider > "$OUT/pytest_mosaic.txt" 2>&1
echo "exit $?"; tail -n 3 "$OUT/pytest_mosaic.txt"

# FP8 (issue 8): every FP8 kernel config against its blockwise twin and the
# golden, then Table-3 RMSE on the GPU vs the CPU twin, and 16k-token speed
# (quantization pass, FP8 kernel, total, bf16 kernel) into $OUT/fp8/.
step "FP8: every FP8 kernel config (tests/test_sm90_fp8_gpu.py), RMSE and speed"
timeout 100 "$PY" -m pytest tests/test_sm90_fp8_gpu.py -q -x -p no:cacheprovider \
  > "$OUT/pytest_fp8_gpu.txt" 2>&1
echo "exit $?"; tail -n 3 "$OUT/pytest_fp8_gpu.txt"
timeout 120 "$PY" benchmarks/fp8_device_check.py --out "$OUT/fp8" --time-budget 50 \
  > "$OUT/fp8.txt" 2>&1
echo "exit $?"; tail -n 8 "$OUT/fp8.txt"

step "harness tests: tests/test_bench.py"
timeout 25 "$PY" -m pytest tests/test_bench.py -q -p no:cacheprovider \
  > "$OUT/pytest_bench.txt" 2>&1
echo "exit $?"; tail -n 3 "$OUT/pytest_bench.txt"

# Forward over the whole paper grid (d 64/128/256, seq 512..16k, causal and
# not), ours against cuDNN, XLA and attention_mgpu.
step "bench: forward grid"
timeout 170 "$PY" -m pallas_fa3.cli bench --out "$OUT/bench" \
  --impl mosaic cudnn mgpu xla blockwise --mode fwd --dtype bf16 \
  --runs 20 --warmup 3 --time-budget 130 --no-progress \
  > "$OUT/bench.txt" 2>&1
echo "exit $?"

step "bench: bwd and fwd+bwd, head dims 128 and 256"
timeout 75 "$PY" -m pallas_fa3.cli bench --out "$OUT/bench_bwd" \
  --impl mosaic cudnn mgpu xla --mode bwd fwd+bwd --head-dim 128 256 \
  --dtype bf16 --runs 20 --warmup 3 --time-budget 55 --no-progress \
  > "$OUT/bench_bwd.txt" 2>&1
echo "exit $?"

step "summary (16k-token rows; full tables in \$OUT/bench*/summary.md)"
for d in bench bench_bwd; do
  f="$OUT/$d/summary.md"
  [ -f "$f" ] || { echo "$f: missing (see $OUT/$d.txt)"; tail -n 20 "$OUT/$d.txt"; continue; }
  grep -E '^- (matmul peak|sweep wall)' "$f"
  grep -E '^\| mode|^\|---|\| 16384 \|' "$f"
  sed -n "/^Skipped or failed/,\$p" "$f" | cut -c1-220 | head -n 12
done
step "done"
