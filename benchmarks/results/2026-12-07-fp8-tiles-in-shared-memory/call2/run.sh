#!/usr/bin/env bash
# 2026-12-07 (sixteenth session), call 2: the drop-in staged variants (shared memory, 4-6 blocks a
# multiprocessor) and regs2 against the register tile alone, then the best staged one in the 16 GB sync
# interleaved with main (m1 = 1cc9b25), and main traced
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r21; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run21.sh $R/run.sh
save() { tar czf "$OUT/r21.tgz" -C /tmp r21; }
probe() {   # VARIANT
  (cd .out/m1 && PYTHONPATH=.:/tmp/site timeout 90 python3 benchmarks/probe_tiles.py --gib 4 --repeat 20 \
     --image $OLDPWD/.out/kv/$1.fatbin) >> $R/probes.txt 2>&1; echo "$1: $(tail -1 $R/probes.txt)"
}
for v in base staged6 staged4 staged5 regs2 base staged6 staged4 staged5; do probe $v; done; save
best=$(python3 -c "
import json, statistics, collections
r = collections.defaultdict(list)
for line in open('$R/probes.txt'):
    if line.startswith('{'):
        d = json.loads(line); r[d['image'].split('/')[-1][:-8]].append(d['tiles_over_cast'])
print(min((statistics.median(v), k) for k, v in r.items() if k.startswith('staged'))[1])")
echo "best staged: $best"
rm -rf /tmp/ms && cp -r .out/m1 /tmp/ms && cp .out/kv/$best.fatbin /tmp/ms/tensorxfer/quant/fp8_quantize.fatbin
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
bench /tmp/ms $best; save
bench .out/m1 main; save
bench /tmp/ms $best-again; save
bench .out/m1 main-again; save
bench .out/m1 main-traced --trace $R/trace; save
