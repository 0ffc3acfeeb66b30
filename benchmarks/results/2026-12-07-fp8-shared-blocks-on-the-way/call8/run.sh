#!/usr/bin/env bash
# 2026-12-07 (fifteenth session), call 8: main (595981b) and a6 (a4670d3: quantizing tiles launched in Cython without
# the GIL, lanes and own pairs), interleaved twice on one machine
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r18; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
bench() {   # TREE NAME
  (cd "$1" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$2" > "$R/$2.txt" 2>&1
   echo "$2 rc=$?"; grep -E "^fp8 sync|^bound" "$R/$2.txt")
}
bench .out/main main-1
bench .out/a6 a6-1
bench .out/main main-2
bench .out/a6 a6-2
tar czf "$OUT/r18.tgz" -C /tmp r18
