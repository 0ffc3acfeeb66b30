#!/usr/bin/env bash
# 2026-12-07 (fifteenth session), call 3: a3 (shared blocks on the way; shared amaxes queued after the pack; later parts
# taken in while earlier ones land; paired FP8 conversion) bench, then traced; GPU tests + memcheck in a3; head (main)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r13; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=.:/tmp/site timeout 180 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^  source|^bound" "$R/$name.txt")
}
bench .out/a3 a3
bench .out/a3 a3-traced --trace $R/a3-trace
(cd .out/a3 && PYTHONPATH=.:/tmp/site timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider -m cuda tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128)" > "$R/memcheck.txt" 2>&1
 echo "memcheck rc=$?"; tail -2 "$R/memcheck.txt")
(cd .out/a3 && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
  tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py tests/test_copy_host.py \
  -rs > "$R/tests_gpu.txt" 2>&1; echo "gpu tests rc=$?"; tail -3 "$R/tests_gpu.txt")
bench .out/head head
bench .out/a3 a3-again
tar czf "$OUT/r13.tgz" -C /tmp r13
