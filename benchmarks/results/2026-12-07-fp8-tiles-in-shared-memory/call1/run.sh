#!/usr/bin/env bash
# 2026-12-07 (sixteenth session), call 1: tiles-kernel variants alone (probe_tiles --image), GPU tests of the
# persistent tiles (p1 = branch persist fb885af), then the sync: p1 against main (m1 = 1cc9b25) and main + staged6
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; R=/tmp/r20; rm -rf $R; mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d /tmp/site/cuda ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/env.txt" 2>&1; cat "$R/env.txt"
cp .out/run20.sh $R/run.sh
save() { tar czf "$OUT/r20.tgz" -C /tmp r20; }   # after each step: a call cut at its limit still brings back what ran
probe() {   # TREE VARIANT [--persistent N]
  local tree=$1 v=$2; shift 2
  local image=""; [ "$v" = package ] || image="--image $PWD/.out/kv/$v.fatbin"
  (cd $tree && PYTHONPATH=.:/tmp/site timeout 90 python3 $OLDPWD/.out/kv/probe_tiles.py --gib 4 --repeat 20 \
     $image "$@") >> $R/probes.txt 2>&1; echo "$tree $v: $(tail -1 $R/probes.txt)"
}
probe .out/m1 base; probe .out/p1 package; save
(cd .out/p1 && PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_fusing.py \
   tests/test_step_parts.py tests/test_quant_gpu.py tests/test_sync_fp8.py tests/test_sync_quantized.py \
   tests/test_copy_host.py > "$R/tests_gpu-p1.txt" 2>&1; echo "gpu tests p1 rc=$?"; tail -1 "$R/tests_gpu-p1.txt")
(cd .out/p1 && PYTHONPATH=.:/tmp/site timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider -m cuda tests/test_fusing.py -k "kernel_writes and (bf16-small-odd or bf16-128)" > "$R/memcheck-p1.txt" 2>&1
 echo "memcheck rc=$?"; tail -2 "$R/memcheck-p1.txt")
save
bench() {   # TREE NAME [extra args]
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out "$R/$name" "$@" > "$R/$name.txt" 2>&1
   echo "$name rc=$?"; grep -E "^fp8 sync|^bound" "$R/$name.txt")
}
rm -rf /tmp/ms && cp -r .out/m1 /tmp/ms && cp .out/kv/staged6.fatbin /tmp/ms/tensorxfer/quant/fp8_quantize.fatbin
bench .out/p1 p1; save
bench .out/m1 main; save
bench .out/p1 p1-again; save

