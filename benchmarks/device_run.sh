#!/usr/bin/env bash
# One device-machine session: build the extensions there, run the CUDA-marked
# tests and the full suite, then the GPU benchmark; everything lands in $OUT.
# Usage (on the GPU machine, from the repo root): bash benchmarks/device_run.sh [bench_cuda args]
# Options (environment): SKIP_BENCH=1 (tests only), TCP_BENCH=1 (loopback TCP, host vs GPU regions),
# IPC_BENCH=1 (tests/test_ipc.py and benchmarks/bench_ipc.py --device cuda:0).
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# cuda-bindings pinned to the 13.0 line (the headers' version) when carried as a wheel in .whl/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import sys, torch, cupy, numpy, Cython, cuda.bindings as cb; print(sys.version.split()[0], 'torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'Cython', Cython.__version__, 'cuda-bindings', cb.__version__)"; } 2>&1 | tee "$OUT/env.txt"
python3 setup.py build_ext --inplace -q 2>&1 | tail -5 | tee "$OUT/build.txt"
python3 -m pytest -p no:cacheprovider -v -s -rs tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.txt" | tail -40
python3 -m pytest -p no:cacheprovider -q -x --ignore=tests/test_cuda.py 2>&1 | tail -5 | tee "$OUT/test_rest.txt"
[ "${SKIP_BENCH:-0}" = 1 ] || python3 benchmarks/bench_cuda.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_cuda.txt"
if [ "${TCP_BENCH:-0}" = 1 ]; then
  # loopback TCP on the GPU machine: host regions, then GPU regions staged through pinned buffers
  for dev in cpu cuda:0; do
    python3 -c "import sys; from tensorxfer.cli.bench import main; sys.exit(main(sys.argv[1:]))" \
      --size "${TCP_SIZE:-8e9}" --repeat 3 --no-iperf --device "$dev" --json 2>&1 | tee "$OUT/tcp-${dev/:/}.json"
  done
fi
if [ "${IPC_BENCH:-0}" = 1 ]; then
  # same-host ipc between two processes on the GPU: copy and share against torch's copy of the same bytes
  python3 -m pytest -p no:cacheprovider -v -rs tests/test_ipc.py 2>&1 | tee "$OUT/test_ipc.txt" | tail -5
  python3 benchmarks/bench_ipc.py --device cuda:0 --size "${IPC_SIZE:-31.2e9}" --repeat 5 --out "$OUT/ipc" 2>&1 |
    tee "$OUT/bench_ipc_cuda.txt"
fi
