#!/usr/bin/env bash
# 2026-12-07 (sixteenth session), call 4: staged4 in the 16 GB sync, three more runs (same warm machine as call 3)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r23; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
cp .out/run23.sh $R/run.sh
save() { tar czf "$OUT/r23.tgz" -C /tmp r23; }
[ -d /tmp/s4 ] || { cp -r .out/m1 /tmp/s4 && cp .out/kv/staged4.fatbin /tmp/s4/tensorxfer/quant/fp8_quantize.fatbin; }
for n in 1 2 3; do
  (cd /tmp/s4 && PYTHONPATH=.:/tmp/site timeout 45 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/staged4-$n" > "$R/staged4-$n.txt" 2>&1
   echo "staged4-$n rc=$?"; grep -E "^fp8 sync|^bound" "$R/staged4-$n.txt"); save
done
