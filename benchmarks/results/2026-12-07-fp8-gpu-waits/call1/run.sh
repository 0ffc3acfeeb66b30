#!/usr/bin/env bash
# Device call: GPU tests of tN, then the FP8 sync bench interleaved tM (main) / tN (blocking waits).
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r) ; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime;
  PYTHONPATH=/tmp/site python3 -c "import sys, torch, cuda.bindings as cb; print(sys.version.split()[0], torch.__version__, cb.__version__)"; } > $R/env.txt 2>&1
cat $R/env.txt
bench() {  # tree name
  (cd .out/$1 && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 \
     --targets 2 --transport ipc --repeat 5 --out $R/$1-$2 > $R/$1-$2.txt 2>&1)
  pkill -9 -f bench_fp8.py; sleep 1
  grep -E "fp8 sync|target[01]|source[0-3]|bound" $R/$1-$2.txt | cut -c1-400; save
}
for i in 1 2; do bench tM $i; bench tN $i; done
(cd .out/tN && PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest -p no:cacheprovider -q -m cuda tests/test_fusing.py tests/test_step_parts.py \
  tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py tests/test_copy_host.py > $R/tests-tN.txt 2>&1); tail -3 $R/tests-tN.txt; save
for i in 3; do bench tN $i; bench tM $i; done
