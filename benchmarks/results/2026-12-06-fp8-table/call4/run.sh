#!/bin/bash
# device call 4 (2026-12-06, issue 39): order A/B -- head (big launch while the neighbours' amaxes come) vs variant (after them)
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt 2>&1
for round in 1 2; do for tree in head variant; do
  s=$SECONDS
  (cd .out/$tree && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $OUT/$tree-$round > $OUT/bench-$tree-$round.txt 2>&1)
  echo "$tree $round rc=$? $((SECONDS-s)) s: $(grep -E '^fp8 sync' $OUT/bench-$tree-$round.txt) | $(grep -E '^bound' $OUT/bench-$tree-$round.txt)"
done; done
