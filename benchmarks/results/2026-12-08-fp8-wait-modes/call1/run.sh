#!/usr/bin/env bash
# Device call 1 (2026-12-08): how the copy host waits for the GPU -- main (spins) against the wait-modes patch
# (TENSORXFER_GPU_WAIT=poll / block), interleaved, quiet and beside 8 CPU-bound processes.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r) ; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } > $R/env.txt 2>&1; cat $R/env.txt
bench() {  # tree mode label
  (cd .out/$1 && TENSORXFER_GPU_WAIT=$2 PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/bench_fp8.py --device cuda:0 \
     --size 16e9 --sources 4 --targets 2 --transport ipc --repeat 5 --out $R/$1-$2-$3 > $R/$1-$2-$3.txt 2>&1)
  pkill -9 -f bench_fp8.py; sleep 1
  echo "== $1 $2 $3 $SECONDS"; grep -E "fp8 sync|target[01]|bound" $R/$1-$2-$3.txt | cut -c1-200; save
}
hogs() { for i in $(seq 8); do python3 -c "while True: pass" & done; }
bench tM spin quiet1; bench tW poll quiet1; bench tW block quiet1; bench tM spin quiet2; bench tW poll quiet2
hogs; sleep 1; bench tM spin loaded1; bench tW poll loaded1; bench tW block loaded1; pkill -f "while True: pass"
bench tM spin quiet3; bench tW poll quiet3
