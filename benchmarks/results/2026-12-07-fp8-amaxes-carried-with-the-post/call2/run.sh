#!/usr/bin/env bash
# 2026-12-07 (eighteenth session), call 2: H fixed (b928080 + the chunk table's bins up to the message) against
# main (tM = ffbb090), interleaved; the GPU tests and memcheck of the changed kernel on H; one traced step of H
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r37; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run37.sh $R/run.sh
save() { tar czf "$OUT/r37.tgz" -C /tmp r37; }
ROOTD=$PWD
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  pkill -9 -f bench_fp8.py 2>/dev/null; sleep 0.5
  (cd $ROOTD/.out/$tree && PYTHONPATH=.:/tmp/site timeout 90 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt"; grep -m3 -E "Error" "$R/$name.txt")
}
bench tH tH-1 --repeat 5; save; bench tM tM-1 --repeat 5; save
pkill -9 -f bench_fp8.py 2>/dev/null
(cd .out/tH && PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/test_fusing.py \
   tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py \
   tests/test_copy_host.py > $R/tests-tH.txt 2>&1; echo "tests rc=$?"; tail -3 $R/tests-tH.txt); save
bench tH tH-2 --repeat 5; save; bench tM tM-2 --repeat 5; save
(cd .out/tH && PYTHONPATH=.:/tmp/site timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
   -m cuda -p no:cacheprovider tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128)" \
   > $R/memcheck-tH.txt 2>&1; echo "memcheck rc=$?"; tail -3 $R/memcheck-tH.txt); save
bench tH tH-3 --repeat 5; save; bench tM tM-3 --repeat 5; save
bench tH tH-traced --repeat 5 --trace $R/trace-tH; (cd .out/tH && python3 benchmarks/trace_sync.py --last $R/trace-tH > $R/trace-tH-last.txt 2>&1); save
