#!/usr/bin/env bash
# 2026-12-07 (seventeenth session), call 1: where the step's time goes, and the vectorized round.
# t0 = 7ae3a3f-ish main (probe + CUPTI timeline tools), t1 = + the amax round folded with array operations.
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r31; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run31.sh $R/run.sh
save() { tar czf "$OUT/r31.tgz" -C /tmp r31; }
ROOTD=$PWD
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd $ROOTD/.out/$tree && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
(cd .out/t0 && PYTHONPATH=.:/tmp/site timeout 120 python3 benchmarks/probe_timeslice.py --gib 4 --casts 10 --repeat 5 --interval-ms 1 > $R/timeslice.txt 2>&1); cat $R/timeslice.txt; save
BENCH_KINETO=$R/kineto-t0 bench t0 kineto-t0 --repeat 3 --trace $R/trace-t0; save
(cd .out/t0 && python3 benchmarks/gpu_timeline.py $R/kineto-t0 > $R/kineto-t0-timeline.txt 2>&1; grep -E "^(step|GPU|source|target)|gap" $R/kineto-t0-timeline.txt | head -30
 python3 benchmarks/trace_sync.py --last $R/trace-t0 > $R/trace-t0-last.txt 2>&1); save
bench t1 t1-a --repeat 5; save
bench t0 t0-a --repeat 5; save
BENCH_KINETO=$R/kineto-t1 bench t1 kineto-t1 --repeat 3 --trace $R/trace-t1; save
(cd .out/t1 && python3 benchmarks/gpu_timeline.py $R/kineto-t1 > $R/kineto-t1-timeline.txt 2>&1; grep -E "^(step|GPU)|gap" $R/kineto-t1-timeline.txt | head -20
 python3 benchmarks/trace_sync.py --last $R/trace-t1 > $R/trace-t1-last.txt 2>&1); save
bench t1 t1-b --repeat 5; save
bench t0 t0-b --repeat 5; save
