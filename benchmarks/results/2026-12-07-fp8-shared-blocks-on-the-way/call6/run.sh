#!/usr/bin/env bash
# 2026-12-07 (fifteenth session), call 6: GPU tests in a5 (quantizing lanes served without the GIL) and in main
# (595981b), then bench a5, main, a5 again
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r16; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
gputests() {
  (cd "$1" && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
    tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py \
    tests/test_copy_host.py -rs > "$R/tests_gpu-$2.txt" 2>&1; echo "gpu tests $2 rc=$?"; tail -1 "$R/tests_gpu-$2.txt")
}
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=.:/tmp/site timeout 180 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
gputests .out/a5 a5
gputests .out/main main
bench .out/a5 a5
bench .out/main main
bench .out/a5 a5-again
tar czf "$OUT/r16.tgz" -C /tmp r16
