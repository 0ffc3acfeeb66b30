#!/bin/bash
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1
rm -rf .out/base && cp -r .out/head .out/base && cp .out/base-quant/kernel.py .out/base-quant/fp8_quantize.fatbin .out/base/tensorxfer/quant/
cp .out/img/v4.fatbin .out/head/tensorxfer/quant/fp8_quantize.fatbin
cd .out/head
export TENSORXFER_QUANT_BLOCKS_PER_SM=0
PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m pytest -p no:cacheprovider -q tests/test_quant_gpu.py > $OUT/tests-v4.txt 2>&1; echo tests rc=$?; tail -1 $OUT/tests-v4.txt
PYTHONPATH=$PWD:/tmp/site timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -p no:cacheprovider -q tests/test_quant_gpu.py -k "table or huge" > $OUT/memcheck-v4.txt 2>&1; echo memcheck rc=$?; tail -1 $OUT/memcheck-v4.txt
for tree in head base; do
  (cd ../$tree && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT/$tree > $OUT/$tree.txt 2>&1; echo "$tree rc=$?"; grep -E "^fp8 sync|^today|^bound" $OUT/$tree.txt | head -4)
done
