#!/usr/bin/env bash
# 2026-12-07 (seventeenth session), call 4: a clean traced step (no CUPTI) of main as landed (64bcf99)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r34; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
cp .out/run34.sh $R/run.sh
save() { tar czf "$OUT/r34.tgz" -C /tmp r34; }
cd .out/tM
PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 \
  --transport ipc --out "$R/traced" --repeat 5 --trace $R/trace > "$R/traced.txt" 2>&1; grep -E "^fp8 sync|^bound" $R/traced.txt
python3 benchmarks/trace_sync.py --last $R/trace > $R/trace-last.txt 2>&1; save
