#!/usr/bin/env bash
# The prepared GPU check (issue 13): layout equality on nccl in bf16 (every layout the GPU count allows), the
# throughput benchmark (tokens/s, MFU against the device's bf16 peak) and the device-memory bound, as one JSON.
# Without CUDA it writes {"skipped": true, ...} and exits 0. All logic is in benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh            # writes benchmarks/results/gpu_check.json (or $OUT/gpu_check.json)
#   QUICK=1 bash benchmarks/gpu_check.sh    # qwen3_moe layouts only, one throughput run
#   ONLY=long_rows bash benchmarks/gpu_check.sh   # one check (or several: ONLY="layouts long_rows")
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT_JSON="${OUT:+$OUT/gpu_check.json}"
OUT_JSON="${OUT_JSON:-benchmarks/results/gpu_check.json}"
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT_JSON" ${QUICK:+--quick} ${ONLY:+--only $ONLY}
