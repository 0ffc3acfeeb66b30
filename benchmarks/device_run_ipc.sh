#!/usr/bin/env bash
# The ipc transport on the GPU machine: build the extensions, run tests/test_ipc.py (CUDA-marked tests
# included), then benchmarks/bench_ipc.py --device cuda:0.  Everything lands in $OUT.
# Usage (on the GPU machine, from the repo root): bash benchmarks/device_run_ipc.sh [bench_ipc args]
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import sys, torch, numpy, Cython, cuda.bindings as cb; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'Cython', Cython.__version__, 'cuda-bindings', cb.__version__)"; } 2>&1 | tee "$OUT/env.txt"
python3 setup.py build_ext --inplace -q 2>&1 | tail -5 | tee "$OUT/build.txt"
timeout 300 python3 -m pytest -p no:cacheprovider -v -rs tests/test_ipc.py 2>&1 | tee "$OUT/test_ipc.txt" | tail -40
[ "${SKIP_BENCH:-0}" = 1 ] || timeout 400 python3 benchmarks/bench_ipc.py --device cuda:0 --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_ipc_cuda.txt"
