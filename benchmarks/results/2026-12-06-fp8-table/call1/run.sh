#!/bin/bash
# device call 1 (2026-12-06, issue 39): the table kernels' tests, memcheck, the 16 GB FP8 benchmark
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt 2>&1
python3 -c "import torch,sys; print(sys.version, torch.__version__)" >> $OUT/env.txt 2>&1
cd .out/head
export PYTHONPATH=$PWD:/tmp/site
s=$SECONDS
timeout 150 python3 -m pytest -p no:cacheprovider -q -x -rs tests/test_quant_gpu.py > $OUT/tests-quant-gpu.txt 2>&1
echo "quant-gpu rc=$? $((SECONDS-s)) s"; s=$SECONDS
timeout 240 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 3 --out $OUT > $OUT/bench-new.txt 2>&1
echo "bench rc=$? $((SECONDS-s)) s"; s=$SECONDS
tail -4 $OUT/bench-new.txt
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -p no:cacheprovider -q tests/test_quant_gpu.py -k "table or (shard_by_shard and 300)" > $OUT/memcheck.txt 2>&1
echo "memcheck rc=$? $((SECONDS-s)) s"; s=$SECONDS
grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
tail -3 $OUT/tests-quant-gpu.txt
