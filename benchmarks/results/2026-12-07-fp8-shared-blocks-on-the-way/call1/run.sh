#!/usr/bin/env bash
# 2026-12-07 (fifteenth session): a (shared blocks on the way, agreed amaxes from the source's region, whole-block
# tiles offered before the round) bench, memcheck of the tiles kernel (agreed tiles), GPU tests in a, then head (main)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
bench() {
  (cd ".out/$1" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$OUT/$2" > "$OUT/$2.txt" 2>&1
   echo "$2 rc=$?"; grep -E "^fp8 sync|^  source|^bound" "$OUT/$2.txt")
}
bench a a
(cd .out/a && PYTHONPATH=.:/tmp/site timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider -m cuda tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128)" > "$OUT/memcheck.txt" 2>&1
 echo "memcheck rc=$?"; tail -2 "$OUT/memcheck.txt")
(cd .out/a && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
  tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py tests/test_copy_host.py \
  -rs > "$OUT/tests_gpu.txt" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/tests_gpu.txt")
bench head head
