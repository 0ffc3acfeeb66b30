#!/bin/bash
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
cd .out/head && export PYTHONPATH=$PWD:/tmp/site PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt; cat $OUT/env.txt
I=../img
timeout 150 python3 benchmarks/bench_quant_kernel.py --size 4.5e9 --image $I/v0.fatbin:0 --image $I/v1.fatbin:2 --image $I/v2.fatbin:3 --image $I/v3.fatbin:2 --image $I/v4.fatbin:0 --image $I/v0.fatbin:0 --out $OUT/bf16 2>&1 | tail -8
timeout 100 python3 benchmarks/bench_quant_kernel.py --size 4.5e9 --dtype float32 --image $I/v0.fatbin:0 --image $I/v2.fatbin:3 --out $OUT/f32 2>&1 | tail -4
timeout 150 python3 -m pytest -p no:cacheprovider -q tests/test_quant_gpu.py > $OUT/tests.txt 2>&1; echo tests rc=$?; tail -2 $OUT/tests.txt
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -p no:cacheprovider -q tests/test_quant_gpu.py -k "table or huge" > $OUT/memcheck.txt 2>&1; echo memcheck rc=$?; tail -3 $OUT/memcheck.txt
