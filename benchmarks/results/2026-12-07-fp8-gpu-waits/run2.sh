#!/usr/bin/env bash
# Device call: how the copy host waits for the GPU (TENSORXFER_GPU_WAIT spin / block / poll), quiet and with 8
# CPU-bound processes beside the sync (as a trainer's data loaders or an engine's own threads would be).
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r) ; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } > $R/env.txt 2>&1; cat $R/env.txt
bench() {  # mode label
  (cd .out/tN && TENSORXFER_GPU_WAIT=$1 PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 \
     --sources 4 --targets 2 --transport ipc --repeat 5 --out $R/$1-$2 > $R/$1-$2.txt 2>&1)
  pkill -9 -f bench_fp8.py; sleep 1
  echo "== $1 $2"; grep -E "fp8 sync|target[01]|bound" $R/$1-$2.txt | cut -c1-300; save
}
hogs() { for i in $(seq 8); do python3 -c "while True: pass" & done; }
for m in spin poll; do bench $m quiet1; done
hogs; for m in spin block poll; do bench $m loaded1; done; pkill -f "while True: pass"
