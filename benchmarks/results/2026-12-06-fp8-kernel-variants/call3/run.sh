#!/bin/bash
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1
rm -rf .out/base && cp -r .out/head .out/base && cp .out/base-quant/kernel.py .out/base-quant/fp8_quantize.fatbin .out/base/tensorxfer/quant/
cp .out/img/v4.fatbin .out/head/tensorxfer/quant/fp8_quantize.fatbin
export TENSORXFER_QUANT_BLOCKS_PER_SM=0
for round in 1 2; do for tree in base head; do
  (cd .out/$tree && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 7 --out $OUT/$tree-$round > $OUT/$tree-$round.txt 2>&1; echo "$tree $round rc=$?"; grep -E "^fp8 sync" $OUT/$tree-$round.txt)
done; done
