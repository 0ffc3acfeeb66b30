#!/bin/bash
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt 2>&1
cd .out/head
export PYTHONPATH=.:/tmp/site
timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT/head > $OUT/head.txt 2>&1; echo "bench rc=$?"; grep -E "^fp8 sync|^bound" $OUT/head.txt | head -3
(cd ../base && timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT/base > $OUT/base.txt 2>&1; echo "base rc=$?"; grep -E "^fp8 sync|^bound" $OUT/base.txt | head -3)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py tests/test_step_parts.py -rs > $OUT/test_fusing.txt 2>&1; echo "fusing rc=$?"; grep -E "passed|failed|Error |assert" $OUT/test_fusing.txt | head -12
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_quant_gpu.py tests/test_sync_quantized.py tests/test_sync_fp8.py tests/test_copy_host.py > $OUT/tests_gpu.txt 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/tests_gpu.txt
