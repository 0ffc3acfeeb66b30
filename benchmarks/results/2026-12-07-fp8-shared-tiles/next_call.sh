#!/usr/bin/env bash
# 2026-12-07: a (87572e9: shared blocks on the way, whole-block tiles before the round) first, its GPU tests,
# then head (main 4668544)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
bench() {
  (cd ".out/$1" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$OUT/$2" > "$OUT/$2.txt" 2>&1
   echo "$2 rc=$?"; grep -E "^fp8 sync|^bound" "$OUT/$2.txt")
}
bench a a
(cd .out/a && PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
  tests/test_step_parts.py -rs > "$OUT/tests_gpu.txt" 2>&1; echo "gpu tests rc=$?"; tail -2 "$OUT/tests_gpu.txt")
bench head head
