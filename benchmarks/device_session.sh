#!/usr/bin/env bash
# One phase of a device-machine session (the H200), everything into $OUT.  Run from the repo root:
#   bash benchmarks/device_session.sh build      # build this tree (and .oldtree/, if present) in place; the
#                                                # built modules also into $OUT/built-cp312.tgz
#   bash benchmarks/device_session.sh unpack     # instead of building: .out/built-cp312.tgz (a build's tarball,
#                                                # carried back; only while no .pyx/.cu changed since).  It can
#                                                # be built on the dev VM too, saving device time: pyenv's 3.12
#                                                # venv with Cython, setuptools, numpy and .whl/*.whl, then
#                                                # `setup.py build_ext --inplace` in a `git archive` of the tree
#   bash benchmarks/device_session.sh tests      # the GPU-marked tests, then the whole suite, logs in $OUT
#   bash benchmarks/device_session.sh bench-ipc  # CUDA ipc 31.2 GB: .oldtree/ and this tree, alternating
#   bash benchmarks/device_session.sh bench-live # adoption memory, per-step push of an adopted model
#   bash benchmarks/device_session.sh bench-load # from_safetensors (GPU, host) against safetensors / a plain read
#   bash benchmarks/device_session.sh bench-sync # resharded sync, 4 source to 2 target processes over ipc
#   bash benchmarks/device_session.sh bench-sync-ab  # the same, fixed membership, .oldtree/ and this tree
#                                                    # alternating, every round traced (one tarball per round)
#   bash benchmarks/device_session.sh bench-membership  # the same with fixed and with elastic membership, and
#                                                       # bench_elastic.py at full scale on a TCPStore
#   bash benchmarks/device_session.sh bench-elastic     # bench_elastic.py alone: 6 sampled ranks, then all 384
# .oldtree/ is `git archive <commit> tensorxfer setup.py pyproject.toml benchmarks/bench_ipc.py` of the tree
# to compare against (carried, git-ignored).  cuda-bindings 13.0.x is carried as a wheel in .whl/.
set -uo pipefail
OUT=${OUT:-/tmp/tensorxfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
SITE=/tmp/site
new=$PWD
case "${1:-}" in
  build)
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      PYTHONPATH=$SITE python3 -c "import sys, torch, numpy, Cython, cuda.bindings as cb, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'Cython', Cython.__version__, 'cuda-bindings', cb.__version__, 'transformers', transformers.__version__)"; nproc; } 2>&1 | tee "$OUT/env.txt"
    (PYTHONPATH=$SITE python3 setup.py build_ext --inplace -q -j 8 > "$OUT/build-new.txt" 2>&1; echo "new rc=$?" >> "$OUT/build-new.txt") &
    if [ -d .oldtree ]; then
      (cd .oldtree && PYTHONPATH=$SITE python3 setup.py build_ext --inplace -q -j 8 > "$OUT/build-old.txt" 2>&1; echo "old rc=$?" >> "$OUT/build-old.txt") &
    fi
    wait; tail -2 "$OUT"/build-*.txt
    tar czf "$OUT/built-cp312.tgz" $(find tensorxfer -name "*.cpython-312*.so" -o -name "*.fatbin") ;;
  unpack)
    tar xzf .out/built-cp312.tgz && echo "unpacked $(tar tzf .out/built-cp312.tgz | wc -l) built files" ;;
  tests)
    export PYTHONPATH=$new:$SITE
    python3 -m pytest -p no:cacheprovider -q -rs -m cuda --durations=15 2>&1 | tee "$OUT/gpu-tests-cuda-marked.txt" | tail -25
    python3 -m pytest -p no:cacheprovider -q -rs -n 8 -m "not cuda and not rdma" 2>&1 | tail -6 | tee "$OUT/gpu-machine-rest.txt" ;;
  bench-ipc)
    if [ -d .oldtree ] && ! ls .oldtree/tensorxfer/memory/_extent*.so >/dev/null 2>&1; then
      (cd .oldtree && PYTHONPATH=$SITE python3 setup.py build_ext --inplace -q -j 8 > "$OUT/build-old.txt" 2>&1) ||
        { tail -n 5 "$OUT/build-old.txt"; exit 1; }     # carried anew with each call: build it in this one
    fi
    for round in 1 2; do
      for tree in .oldtree .; do
        name=$([ "$tree" = . ] && echo new || echo old)
        (cd "$tree" && PYTHONPATH=$PWD:$SITE python3 benchmarks/bench_ipc.py --device cuda:0 --size "${IPC_SIZE:-31.2e9}" \
          --repeat 5 --no-share --out "$OUT/ipc-$name-$round" 2>&1 | tail -4 | tee "$OUT/ipc-$name-$round.txt")
      done
    done ;;
  bench-live)
    export PYTHONPATH=$new:$SITE PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    python3 benchmarks/bench_live.py --what memory --device cuda:0 --size "${MEM_SIZE:-16e9}" --out "$OUT" 2>&1 | tail -3
    python3 benchmarks/bench_live.py --what step --device cuda:0 --size "${STEP_SIZE:-31.2e9}" --transport ipc \
      --repeat 5 --out "$OUT" 2>&1 | tail -6 ;;
  bench-load)
    export PYTHONPATH=$new:$SITE
    python3 benchmarks/bench_live.py --what load --device cuda:0 --size "${LOAD_SIZE:-16e9}" --files 8 --repeat 2 \
      --tmp "${LOAD_TMP:-/tmp}" --out "$OUT" 2>&1 | tail -2
    python3 benchmarks/bench_live.py --what load --device cpu --size "${LOAD_SIZE:-16e9}" --files 8 --repeat 2 \
      --tmp "${LOAD_TMP:-/tmp}" --out "$OUT" 2>&1 | tail -2 ;;
  bench-sync)
    export PYTHONPATH=$new:$SITE
    python3 benchmarks/bench_sync.py --device cuda:0 --size "${SYNC_SIZE:-16e9}" --sources 4 --targets 2 \
      --transport ipc --repeat "${SYNC_REPEAT:-5}" --out "$OUT" 2>&1 | tail -5 ;;
  bench-sync-ab)   # .oldtree/ needs benchmarks/bench_sync.py and trace_sync.py of this tree copied in
    for round in ${SYNC_ROUNDS:-1 2}; do      # SYNC_ROUNDS="2": the second round alone (a later call)
      for tree in .oldtree .; do
        name=$([ "$tree" = . ] && echo new || echo old)
        (cd "$tree" && PYTHONPATH=$PWD:$SITE python3 benchmarks/bench_sync.py --device cuda:0 --size "${SYNC_SIZE:-16e9}" \
          --sources 4 --targets 2 --transport ipc --repeat "${SYNC_REPEAT:-7}" --membership fixed --no-baseline \
          --trace "/tmp/trace-$name-$round" --out "$OUT/$name-$round" > "$OUT/sync-$name-$round.txt" 2>&1
         tail -n 4 "$OUT/sync-$name-$round.txt")
        tar czf "$OUT/trace-$name-$round.tgz" -C /tmp "trace-$name-$round"    # a folder of many files does not come back
      done
    done ;;
  bench-membership)
    export PYTHONPATH=$new:$SITE
    for membership in fixed elastic; do
      mkdir -p "$OUT/sync-$membership"
      python3 benchmarks/bench_sync.py --device cuda:0 --size "${SYNC_SIZE:-16e9}" --sources 4 --targets 2 \
        --transport ipc --repeat "${SYNC_REPEAT:-5}" --membership $membership --no-baseline \
        --out "$OUT/sync-$membership" 2>&1 | tail -3
    done
    python3 benchmarks/bench_elastic.py --store tcpstore --plan-ranks 4 > "$OUT/elastic-tcpstore.json" 2>&1
    tail -c 1500 "$OUT/elastic-tcpstore.json" ;;
  bench-elastic)   # the planner and store at Kimi-K2 scale, sampled ranks and then every rank (no GPU used)
    export PYTHONPATH=$new:$SITE
    python3 benchmarks/bench_elastic.py --store tcpstore --plan-ranks 6 > "$OUT/elastic-tcpstore.json" 2>&1
    python3 benchmarks/bench_elastic.py --store tcpstore --plan-ranks 6 --every-rank --jobs 14 \
      > "$OUT/elastic-tcpstore-every-rank.json" 2>&1
    tail -c 700 "$OUT"/elastic-*.json ;;
  *) echo "usage: $0 build|unpack|tests|bench-ipc|bench-live|bench-load|bench-sync|bench-sync-ab|bench-membership|bench-elastic" >&2
     exit 2 ;;
esac
