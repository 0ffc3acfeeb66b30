#!/bin/bash
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt 2>&1
cd .out/head
export PYTHONPATH=$PWD:/tmp/site
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py -x -rs > $OUT/test_fusing.txt 2>&1; echo "fusing rc=$?"; tail -5 $OUT/test_fusing.txt
timeout 170 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT/head-1 > $OUT/head-1.txt 2>&1; echo "bench rc=$?"; grep -E "^fp8 sync|^today|^bound" $OUT/head-1.txt | head; tail -3 $OUT/head-1.txt
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_fusing.py -k "kernel and bf16-128 and transformers" > $OUT/memcheck.txt 2>&1; echo "memcheck rc=$?"; tail -3 $OUT/memcheck.txt
timeout 130 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_quant_gpu.py tests/test_sync_quantized.py tests/test_sync_fp8.py tests/test_copy_host.py > $OUT/tests_gpu.txt 2>&1; echo "gpu tests rc=$?"; tail -4 $OUT/tests_gpu.txt
