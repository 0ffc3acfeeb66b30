#!/bin/bash
# device call 3 (2026-12-06, issue 39): shared amaxes first, capped registers; 16 GB FP8 sync; GPU sync tests
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt 2>&1
IMG=$PWD/.out/img
cd .out/head
export PYTHONPATH=$PWD:/tmp/site
s=$SECONDS
timeout 120 python3 -m pytest -p no:cacheprovider -q -x -rs tests/test_quant_gpu.py > $OUT/tests-quant-gpu.txt 2>&1
echo "quant-gpu rc=$? $((SECONDS-s)) s"; tail -1 $OUT/tests-quant-gpu.txt; s=$SECONDS
timeout 120 python3 benchmarks/bench_quant_kernel.py --size 4.5e9 --image $IMG/nocap.fatbin --out $OUT > $OUT/kernel-bf16.txt 2>&1
echo "kernel bf16 rc=$? $((SECONDS-s)) s"; cat $OUT/kernel-bf16.txt | tail -5; s=$SECONDS
timeout 100 python3 benchmarks/bench_quant_kernel.py --size 4.5e9 --dtype float32 --image $IMG/nocap.fatbin --out $OUT > $OUT/kernel-f32.txt 2>&1
echo "kernel f32 rc=$? $((SECONDS-s)) s"; cat $OUT/kernel-f32.txt | tail -2; s=$SECONDS
timeout 200 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT > $OUT/bench-fp8.txt 2>&1
echo "bench rc=$? $((SECONDS-s)) s"; tail -3 $OUT/bench-fp8.txt; s=$SECONDS
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs -m cuda tests/test_sync_quantized.py tests/test_sync_fp8.py tests/test_quant_gpu.py > $OUT/tests-sync-fp8.txt 2>&1
echo "sync tests rc=$? $((SECONDS-s)) s"; tail -2 $OUT/tests-sync-fp8.txt; s=$SECONDS
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -p no:cacheprovider -q tests/test_quant_gpu.py -k "table or huge" > $OUT/memcheck.txt 2>&1
echo "memcheck rc=$? $((SECONDS-s)) s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.txt | tail -3
