#!/usr/bin/env bash
# 2026-12-07 (seventeenth session), call 5: G (shared amaxes queued before the offers: the targets take offers
# only ~0.5 ms in, so the ~0.4 ms of queueing moves off the post's path) against main as landed (tM2 = main
# + the finer trace), interleaved; then one clean traced step of G with the finer trace
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r35; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run35.sh $R/run.sh
save() { tar czf "$OUT/r35.tgz" -C /tmp r35; }
ROOTD=$PWD
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd $ROOTD/.out/$tree && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
for n in 1 2 3; do bench tG tG-$n --repeat 5; save; bench tM2 tM-$n --repeat 5; save; done
bench tG tG-traced --repeat 5 --trace $R/trace-tG; (cd .out/tG && python3 benchmarks/trace_sync.py --last $R/trace-tG > $R/trace-tG-last.txt 2>&1); save
