#!/usr/bin/env bash
# 2026-12-07 (fifteenth session), call 5: a4 (shared amaxes launched after the first post; inline pack wait) bench,
# a4 with a 0.2 ms GIL switch interval in every rank (a diagnosis), a4 traced, a3 again (same machine)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r15; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=.:/tmp/site timeout 180 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
bench .out/a4 a4
BENCH_SWITCH_INTERVAL=0.0002 bench .out/a4 a4-switch
bench .out/a4 a4-traced --trace $R/a4-trace
bench .out/a3 a3
tar czf "$OUT/r15.tgz" -C /tmp r15
