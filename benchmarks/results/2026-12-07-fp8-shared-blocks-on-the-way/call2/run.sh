#!/usr/bin/env bash
# 2026-12-07 (fifteenth session), call 2: a2 (a + shared amaxes queued after the pack, cheap table refresh) bench;
# the tiles kernel alone with each variant image; a2 with the best variant; head (main)
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
bench() {
  (cd "$1" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$OUT/$2" > "$OUT/$2.txt" 2>&1
   echo "$2 rc=$?"; grep -E "^fp8 sync|^  source|^bound" "$OUT/$2.txt")
}
bench .out/a2 a2
root=$PWD
for v in base cs cvt2 cscvt2 lb4 lb4cs; do
  (cd .out/a2 && PYTHONPATH=.:/tmp/site timeout 60 python3 benchmarks/probe_tiles.py --gib 4 --repeat 20 \
     --image "$root/.out/variants/$v.fatbin" > "$OUT/probe-$v.json" 2>"$OUT/probe-$v.err"; echo "probe $v rc=$?"; cat "$OUT/probe-$v.json")
done
best=$(python3 - "$OUT" <<'PY'
import glob, json, sys
r = {}
for f in glob.glob(sys.argv[1] + "/probe-*.json"):
    try:
        d = json.load(open(f)); r[f.split("probe-")[1][:-5]] = d["tiles_over_cast"]
    except Exception:
        pass
print(min(r, key=r.get) if r else "base")
PY
)
echo "best variant: $best"
if [ "$best" != base ]; then
  rm -rf /tmp/a2v && cp -r .out/a2 /tmp/a2v && cp ".out/variants/$best.fatbin" /tmp/a2v/tensorxfer/quant/fp8_quantize.fatbin
  bench /tmp/a2v "a2-$best"
fi
bench .out/head head
