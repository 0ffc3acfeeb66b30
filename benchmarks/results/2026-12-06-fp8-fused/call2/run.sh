#!/bin/bash
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt 2>&1
cd .out/head
export PYTHONPATH=$PWD:/tmp/site
timeout 110 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT/head-2 > $OUT/head-2.txt 2>&1; echo "bench rc=$?"; grep -E "^fp8 sync|^bound" $OUT/head-2.txt | head -3
timeout 60 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py -rs > $OUT/test_fusing.txt 2>&1; echo "fusing rc=$?"; grep -E "passed|failed|Error |assert" $OUT/test_fusing.txt | head -12
timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_fusing.py -k "kernel and transformers" > $OUT/memcheck.txt 2>&1; echo "memcheck rc=$?"; tail -3 $OUT/memcheck.txt
