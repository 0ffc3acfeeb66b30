#!/usr/bin/env bash
# 2026-12-07: es (shared blocks on the way + settle) then GPU tests in es, then memcheck of the tiles kernel, then head
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
bench() {
  (cd ".out/$1" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$OUT/$1" > "$OUT/$1.txt" 2>&1
   echo "$1 rc=$?"; grep -E "^fp8 sync|^bound|^today" "$OUT/$1.txt")
}
bench es
(cd .out/es && PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
  tests/test_step_parts.py -rs -x > "$OUT/tests_gpu.txt" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/tests_gpu.txt")
(cd .out/es && PYTHONPATH=.:/tmp/site timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  -m cuda tests/test_fusing.py -k "kernel_writes and bf16-small-odd" > "$OUT/memcheck.txt" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.txt")
bench head
