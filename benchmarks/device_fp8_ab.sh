#!/usr/bin/env bash
# FP8 sync A/B on the device in one call: bench_fp8.py (16 GB, 4 sources -> 2 FP8 targets over ipc) in each
# prebuilt tree, in turn, then the first tree again (drift), then the GPU tests in the first tree.
#   bash benchmarks/device_fp8_ab.sh .out/head .out/quiet .out/base
# Each tree: `git archive <commit>` built in place for cp312 on the dev VM (setup.py build_ext --inplace),
# carried with .whl/ (cuda-bindings).  Results under $OUT/<tree name>[-again]/.
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
root=$PWD
bench() {       # bench TREE NAME
  (cd "$1" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$OUT/$2" > "$OUT/$2.txt" 2>&1
   echo "$2 rc=$?"; grep -E "^fp8 sync|^  source|^bound" "$OUT/$2.txt")
  PYTHONPATH=/tmp/site python3 - "$OUT/$2" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    r = json.load(open(f))["result"]["fp8_sync"]
    print("  runs (ms)", [round(x * 1e3, 2) for x in r["runs_s"]])
    for k, v in sorted(r["ranks"].items()):
        q = v.get("quantized")
        if q:
            print("  ", k, "round", round(q["seconds"] * 1e3, 2), "wait", round(q["wait_seconds"] * 1e3, 2),
                  "pairs", [round(p["seconds"] * 1e3, 2) for p in v["pairs"]])
PY
}
for tree in "$@"; do bench "$tree" "$(basename "$tree")"; done
bench "$1" "$(basename "$1")-again"
cd "$1" && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
  tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_quantized.py tests/test_sync_fp8.py \
  tests/test_copy_host.py -rs > "$OUT/tests_gpu.txt" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/tests_gpu.txt"
cd "$root"
