#!/usr/bin/env bash
# The RDMA tier against an installed wheel, inside the Soft-RoCE VM (.ci/rxe-vm.sh: Debian's kernel with
# rdma_rxe, the host root read-only): the wheel and the test tools go into a venv under /var/tmp (the guest
# sees /tmp as its own tmpfs), the tests are staged beside it without the source tree, and inside the guest
# the compilers and the rdma-core headers are bind-mounted over, so the wheel runs with no build tools and
# no RDMA headers - only rdma-core's run-time libibverbs.so.1 and the rxe provider.
#
#   bash benchmarks/wheel_rdma_vm.sh dist/tensorxfer-0.1.0-cp311-cp311-manylinux_2_28_x86_64.whl
#
# RXE_DIR (default /var/tmp/rxe-wheel) holds the VM's kernel and initramfs (`rxe-vm.sh setup` runs once).
set -euo pipefail
WHEEL=$(readlink -f "$1")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export RXE_DIR=${RXE_DIR:-/var/tmp/rxe-wheel} VM_TIMEOUT=${VM_TIMEOUT:-1500}
BASE=/var/tmp/tensorxfer-wheel-rdma
PY=${PYTHON:-/usr/bin/python3}        # the guest runs the host's interpreters; Debian's matches the cp311 wheel
log() { echo "[wheel-rdma $(date +%T)] $*"; }

if [ ! -f "$RXE_DIR/initramfs.cpio.gz" ]; then
  log "Soft-RoCE VM setup in $RXE_DIR"
  bash "$ROOT/.ci/rxe-vm.sh" setup > "$RXE_DIR.setup.log" 2>&1 || { tail -30 "$RXE_DIR.setup.log"; exit 1; }
fi
log "venv $BASE/venv: $(basename "$WHEEL") and the test tools (binary wheels only)"
rm -rf "$BASE" && mkdir -p "$BASE/stage"
"$PY" -m venv "$BASE/venv"
"$BASE/venv/bin/pip" install -q --only-binary :all: "$WHEEL" pytest hypothesis psutil
cp -r "$ROOT/tests" "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/docs" "$ROOT/examples" "$BASE/stage/"   # test_docs reads them at collection
find "$BASE/stage" -name __pycache__ -prune -exec rm -rf {} +

GUEST=$(cat <<EOF
empty=\$(mktemp -d); stub=/tmp/no-compiler; printf '#!/bin/sh\nexit 127\n' > \$stub; chmod 755 \$stub
for t in gcc cc g++ c++ x86_64-linux-gnu-gcc-12 x86_64-linux-gnu-g++-12; do
  [ -e /usr/bin/\$t ] && mount --bind \$stub /usr/bin/\$t
done
for d in /usr/include/infiniband /usr/include/rdma /usr/local/cuda; do
  [ -d "\$(readlink -f \$d)" ] && mount --bind \$empty "\$(readlink -f \$d)"
done
echo "[guest] gcc: \$(gcc --version >/dev/null 2>&1 && echo present || echo absent); verbs.h: \$(ls /usr/include/infiniband/verbs.h 2>/dev/null || echo absent)"
cd $BASE/stage || exit 99
export PYTHONDONTWRITEBYTECODE=1 HOME=/tmp PYTHONUNBUFFERED=1 HYPOTHESIS_STORAGE_DIRECTORY=/tmp/hypothesis
$BASE/venv/bin/python -c "import tensorxfer, tensorxfer.transport._verbs as v; print('[guest] tensorxfer from', tensorxfer.__file__, '; libibverbs:', v.library_error() or 'loaded', v.device_names())"
$BASE/venv/bin/tensorxfer doctor
$BASE/venv/bin/python -m pytest -m rdma -p no:cacheprovider -q -rs --durations=5 tests --deselect tests/test_architecture.py --deselect tests/test_sourcecode.py
EOF
)
log "booting the VM: pytest -m rdma against the installed wheel"
bash "$ROOT/.ci/rxe-vm.sh" run "$GUEST"
