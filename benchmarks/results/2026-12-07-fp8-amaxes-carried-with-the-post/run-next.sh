#!/usr/bin/env bash
# Device call 2 (2026-12-08): variant H (the agreed amaxes carried with the post; the copier copies them in on its own
# stream) against main, interleaved on one machine; then H's GPU tests and memcheck of its kernel.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r) ; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } > $R/env.txt 2>&1; cat $R/env.txt
bench() {  # tree label
  (cd .out/$1 && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 \
     --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $R/$1-$2 > $R/$1-$2.txt 2>&1)
  pkill -9 -f bench_fp8.py; sleep 1
  echo "== $1 $2 $SECONDS"; grep -E "fp8 sync|target[01]|bound|Error" $R/$1-$2.txt | cut -c1-200; save
}
bench tH 1; bench tM 1; bench tH 2; bench tM 2
cd .out/tH
PYTHONPATH=.:/tmp/site timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m cuda \
  tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128)" > $R/memcheck-tH.txt 2>&1; echo "memcheck rc $?"
tail -3 $R/memcheck-tH.txt; save
PYTHONPATH=.:/tmp/site timeout 120 python3 -m pytest -q -m cuda tests/test_fusing.py tests/test_step_parts.py \
  tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py tests/test_copy_host.py > $R/tests-tH.txt 2>&1
tail -3 $R/tests-tH.txt; save
