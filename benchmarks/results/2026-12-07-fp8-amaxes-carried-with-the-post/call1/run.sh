#!/usr/bin/env bash
# 2026-12-07 (eighteenth session), call 1: H (the shared blocks' agreed amaxes carried with the post, copied in
# by the copying process: no GPU work of a source mid-step but its amaxes kernel before the first post) against
# main (tM = ffbb090), interleaved; the GPU tests and memcheck of the changed kernel on H; one traced step of H
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r36; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run36.sh $R/run.sh
save() { tar czf "$OUT/r36.tgz" -C /tmp r36; }
ROOTD=$PWD
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd $ROOTD/.out/$tree && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
for n in 1 2 3; do bench tH tH-$n --repeat 5; save; bench tM tM-$n --repeat 5; save; done
(cd .out/tH && PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_fusing.py \
   tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py \
   tests/test_copy_host.py > $R/tests-tH.txt 2>&1; echo "tests rc=$?"; tail -3 $R/tests-tH.txt); save
(cd .out/tH && PYTHONPATH=.:/tmp/site timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
   -m cuda -p no:cacheprovider tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128 or f32-128)" \
   > $R/memcheck-tH.txt 2>&1; echo "memcheck rc=$?"; tail -3 $R/memcheck-tH.txt); save
bench tH tH-traced --repeat 5 --trace $R/trace-tH; (cd .out/tH && python3 benchmarks/trace_sync.py --last $R/trace-tH > $R/trace-tH-last.txt 2>&1); save
