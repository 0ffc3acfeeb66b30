#!/usr/bin/env bash
# 2026-12-07 (sixteenth session), call 3: staged4 (the register tile staged in shared memory, 4 blocks a
# multiprocessor; 0.985x torch's cast alone in call 2) in the 16 GB sync interleaved with main (m1), then its
# GPU tests and memcheck
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r22; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1
cp .out/run22.sh $R/run.sh
save() { tar czf "$OUT/r22.tgz" -C /tmp r22; }
rm -rf /tmp/s4 && cp -r .out/m1 /tmp/s4 && cp .out/kv/staged4.fatbin /tmp/s4/tensorxfer/quant/fp8_quantize.fatbin \
  && cmp .out/kv/staged4.fatbin /tmp/s4/tensorxfer/quant/fp8_quantize.fatbin && echo "s4 = m1 + staged4.fatbin"
bench() {   # TREE NAME
  (cd "$1" && PYTHONPATH=.:/tmp/site timeout 100 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$2" > "$R/$2.txt" 2>&1
   echo "$2 rc=$?"; grep -E "^fp8 sync|^bound" "$R/$2.txt")
}
bench /tmp/s4 staged4; save
bench .out/m1 main; save
bench /tmp/s4 staged4-again; save
bench .out/m1 main-again; save
(cd /tmp/s4 && PYTHONPATH=.:/tmp/site timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
   tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py \
   tests/test_copy_host.py > "$R/tests_gpu-staged4.txt" 2>&1; echo "gpu tests staged4 rc=$?"; tail -1 "$R/tests_gpu-staged4.txt")
save
(cd /tmp/s4 && PYTHONPATH=.:/tmp/site timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider -m cuda tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128)" > "$R/memcheck-staged4.txt" 2>&1
 echo "memcheck rc=$?"; tail -2 "$R/memcheck-staged4.txt")
save
