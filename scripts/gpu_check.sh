#!/usr/bin/env bash
# The one script for a GPU machine: build (the CUDA extension for sm_90), the whole
# test suite (GPU tests included), the benchmarks. Everything it prints is also written
# under $OUT (default ./gpu_check_out).
#   bash scripts/gpu_check.sh            # under 8 minutes on one H200
# Uses the machine's python3 and its torch/triton; needs no network.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
  echo "commit ${DFLASH2_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
} 2>&1 | tee "$OUT/env.txt"

export MAX_JOBS="${MAX_JOBS:-16}"
start=$(date +%s)
"$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
"$PY" -c "from dflash2_kernels._extension import has_kernel as h; print('CUDA kernels registered:', h('selector_scores', 'cuda'))" | tee -a "$OUT/env.txt"

timeout 180 "$PY" -m pytest -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" || status=1
timeout 120 "$PY" benchmarks/bench_conv.py --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench_conv.txt" || status=1
timeout 100 "$PY" benchmarks/bench_selector.py --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench_selector.txt" || status=1
timeout 80 "$PY" benchmarks/bench_serving.py --no-compile --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench_serving.txt" || status=1
exit $status
