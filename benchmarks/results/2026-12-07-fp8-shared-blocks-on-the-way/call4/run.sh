#!/usr/bin/env bash
# 2026-12-07 (fifteenth session), call 4: a3 traced (trace_sync: every rank's phases per step)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r14; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
(cd .out/a3 && PYTHONPATH=.:/tmp/site timeout 200 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
   --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/a3-traced" --trace $R/trace > "$R/a3-traced.txt" 2>&1
 echo "rc=$?"; grep -E "^fp8 sync|^bound" "$R/a3-traced.txt")
tar czf "$OUT/r14.tgz" -C /tmp r14
