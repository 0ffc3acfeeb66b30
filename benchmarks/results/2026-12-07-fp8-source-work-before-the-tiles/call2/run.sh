#!/usr/bin/env bash
# 2026-12-07 (seventeenth session), call 2: the sources' GPU work out of the tiles' way.
# t1 = main d18461e (vectorized round); tE = + shared amaxes launched before the post; tF = + the whole round
# before the first posts; tD = diagnosis: no source GPU work at all (shared scales wrong; timing only)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r32; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run32.sh $R/run.sh
save() { tar czf "$OUT/r32.tgz" -C /tmp r32; }
ROOTD=$PWD
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd $ROOTD/.out/$tree && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
bench t1 t1-a --repeat 5; save
bench tE tE-a --repeat 5; save
bench tF tF-a --repeat 5; save
DIAG_NO_SOURCE_GPU=1 bench tD tD-a --repeat 5; save
bench t1 t1-b --repeat 5; save
bench tE tE-b --repeat 5; save
bench tF tF-b --repeat 5; save
(cd .out/tF && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -m cuda tests/test_fusing.py tests/test_step_parts.py \
   tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py tests/test_copy_host.py > $R/tests-tF.txt 2>&1; tail -3 $R/tests-tF.txt); save
for t in t1 tF; do
  BENCH_KINETO=$R/kineto-$t bench $t kineto-$t --repeat 3 --trace $R/trace-$t
  (cd .out/t1 && python3 benchmarks/gpu_timeline.py $R/kineto-$t > $R/kineto-$t-timeline.txt 2>&1; grep -E "^(step|GPU)|gap" $R/kineto-$t-timeline.txt | head -12
   python3 benchmarks/trace_sync.py --last $R/trace-$t > $R/trace-$t-last.txt 2>&1); save
done
