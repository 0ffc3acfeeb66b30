#!/usr/bin/env bash
# 2026-12-07 (seventeenth session), call 3: main as landed (64bcf99: the vectorized round + shared amaxes queued
# before the post) against main at the session's start (ccecd00), interleaved; the GPU tests on 64bcf99;
# probe_timeslice at other intervals; the no-source-GPU-work diagnosis (tD) once more
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r33; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run33.sh $R/run.sh
save() { tar czf "$OUT/r33.tgz" -C /tmp r33; }
ROOTD=$PWD
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd $ROOTD/.out/$tree && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
(cd .out/tM && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -m cuda tests/test_fusing.py tests/test_step_parts.py \
   tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py tests/test_copy_host.py > $R/tests-tM.txt 2>&1; tail -2 $R/tests-tM.txt); save
for n in 1 2 3; do bench tM tM-$n --repeat 5; save; bench t0 t0-$n --repeat 5; save; done
DIAG_NO_SOURCE_GPU=1 bench tD tD-1 --repeat 5; save
for i in 0.5 2; do
  (cd .out/tM && PYTHONPATH=.:/tmp/site timeout 120 python3 benchmarks/probe_timeslice.py --gib 4 --casts 10 --repeat 5 \
     --interval-ms $i > $R/timeslice-$i.txt 2>&1; cat $R/timeslice-$i.txt); save
done
