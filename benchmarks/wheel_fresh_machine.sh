#!/usr/bin/env bash
# A built wheel on a machine as a user has it: no compiler, no CUDA toolkit, no libibverbs-dev, and with
# --no-rdma-core not even libibverbs.so.1.  Without a container engine here, the machine is made so in a
# private mount namespace (root; `unshare -m`): compilers are bind-mounted over with a stub that fails,
# /usr/local/cuda and the rdma-core headers with empty directories, and (--no-rdma-core) libibverbs.so.1
# with /dev/null, so loading it fails as on a machine without rdma-core ("file too short" instead of
# "not found": the same failed dlopen).  Nothing outside the namespace changes.
#
#   bash benchmarks/wheel_fresh_machine.sh dist/tensorxfer-0.1.0-cp311-...whl [--no-rdma-core]
#
# Then, in a fresh venv: the CPU tests against the installed wheel (tools/test_wheel.sh, from a
# directory without the source tree), `tensorxfer demo`, `tensorxfer doctor`.
set -euo pipefail
WHEEL=$(readlink -f "$1")
MODE=${2:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${TX_FRESH_NS:-}" ]; then
  exec unshare --mount --propagation private env TX_FRESH_NS=1 bash "$0" "$@"
fi
log() { echo "[fresh $(date +%T)] $*"; }

STUB=$(mktemp /tmp/no-compiler.XXXXXX)
printf '#!/bin/sh\necho "$0: no compiler on this machine" >&2\nexit 127\n' > "$STUB" && chmod 755 "$STUB"
EMPTY=$(mktemp -d /tmp/empty.XXXXXX)
hidden=()
for tool in gcc g++ cc c++ cpp clang clang++ ld ld.bfd ld.gold as x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ \
            x86_64-linux-gnu-gcc-12 x86_64-linux-gnu-g++-12 x86_64-linux-gnu-cpp-12 gcc-12 g++-12 cpp-12; do
  for dir in /usr/bin /usr/local/bin; do
    if [ -e "$dir/$tool" ]; then mount --bind "$STUB" "$dir/$tool"; hidden+=("$dir/$tool"); fi
  done
done
for dir in /usr/local/cuda /usr/include/infiniband /usr/include/rdma; do
  real=$(readlink -f "$dir" || true)
  if [ -n "$real" ] && [ -d "$real" ]; then mount --bind "$EMPTY" "$real"; hidden+=("$dir"); fi
done
# (libibverbs-dev's libibverbs.so symlink stays: a bind mount would land on the library it points to, the
# run-time libibverbs.so.1, and with no compiler or linker here nothing can link against it anyway)
if [ "$MODE" = --no-rdma-core ]; then
  for lib in /usr/lib/x86_64-linux-gnu/libibverbs.so.1 /usr/lib/x86_64-linux-gnu/librdmacm.so.1; do
    [ -e "$lib" ] && { mount --bind /dev/null "$(readlink -f "$lib")"; hidden+=("$lib"); }
  done
  # not an ldconfig trick: dlopen("libibverbs.so.1") finds the file and cannot load it
fi
log "hidden here: ${hidden[*]}"
log "compiler: $(gcc --version 2>&1 | head -1); cuda.h: $(ls /usr/local/cuda/include/cuda.h 2>&1 | head -1)"
log "verbs.h: $(ls /usr/include/infiniband/verbs.h 2>&1)"

PY=${PYTHON:-python3}
export WHEEL_VENV=${WHEEL_VENV:-/tmp/tensorxfer-fresh-venv}
PYTHON=$PY bash "$ROOT/tools/test_wheel.sh" "$WHEEL" "${@:3}"
cd /tmp
log "tensorxfer demo"
"$WHEEL_VENV/bin/tensorxfer" demo --size $((64 << 20))
log "tensorxfer doctor"
"$WHEEL_VENV/bin/tensorxfer" doctor
