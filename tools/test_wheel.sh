#!/usr/bin/env bash
# Install a built wheel into a fresh venv and run the CPU test tier against it, from a directory that
# holds the tests but not the source tree: `import tensorxfer` can only find the installed wheel, so a
# file missing from the wheel fails here (CI runs this; so do the fresh-machine runs in
# benchmarks/results/2026-12-06-wheels/).
#
#   bash tools/test_wheel.sh dist/tensorxfer-0.1.0-cp311-cp311-manylinux_2_28_x86_64.whl [pytest args]
#
# Environment:
#   PYTHON       the interpreter for the venv (default python3; must match the wheel's cpXY)
#   WHEEL_VENV   the venv to create (default /tmp/tensorxfer-wheel-venv; recreated)
#   WHEEL_TESTS  "fast" (default: one file or more per native module, transport and the CLI, ~a few
#                minutes) or "all" (every CPU test except the ones that read the source tree)
#   WHEEL_TORCH  1: install CPU torch too (pip's find-links / index; the torch and HF tests then run)
#   WHEEL_STAGE  where the tests are staged (default: a fresh temporary directory)
# Dependencies come as binary wheels only (--only-binary :all:): the wheel must install with no compiler.
set -euo pipefail
WHEEL=$(readlink -f "$1"); shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
VENV=${WHEEL_VENV:-/tmp/tensorxfer-wheel-venv}
STAGE=${WHEEL_STAGE:-$(mktemp -d /tmp/tensorxfer-wheel-tests.XXXXXX)}
log() { echo "[test_wheel $(date +%T)] $*"; }

log "fresh venv $VENV ($($PYTHON -V)), installing $(basename "$WHEEL") and the test tools (binary wheels only)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
# the test extra minus transformers/accelerate/etcd3gw (the HF and etcd tests are not in the fast set)
"$VENV/bin/pip" install -q --only-binary :all: "$WHEEL" "cuda-bindings~=13.0.0" pytest hypothesis psutil safetensors
if [ "${WHEEL_TORCH:-0}" = 1 ]; then
  "$VENV/bin/pip" install -q --only-binary :all: torch==2.13.0
fi

# The stage: tests/ and pyproject.toml (pytest's markers and options; tests read its scripts), README.md
# with docs/ and examples/ (their snippets are run against the installed package) - and no tensorxfer/.
rm -rf "$STAGE/tests" "$STAGE/docs" "$STAGE/examples" && mkdir -p "$STAGE"
cp -r "$ROOT/tests" "$STAGE/tests"
cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$STAGE/"
cp -r "$ROOT/examples" "$STAGE/examples"
cp -r "$ROOT/docs" "$STAGE/docs"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
cd "$STAGE"
"$VENV/bin/python" - <<'EOF'
import tensorxfer, sys
from tensorxfer.memory import _cuda, _copy, _driver, _extent, _fence, _host, _hostcopy   # noqa: F401
from tensorxfer.transport import _verbs
assert "site-packages" in tensorxfer.__file__, f"tensorxfer came from {tensorxfer.__file__}, not the wheel"
print(f"tensorxfer from {tensorxfer.__file__}; every native module imports; libibverbs:",
      _verbs.library_error() or "loaded")
EOF

# One file or more for each native module, each transport, the CLI, doctor and the first-hour paths.
FAST=(tests/test_host_region.py tests/test_extent.py tests/test_region.py tests/test_manifest.py
      tests/test_staging.py tests/test_strided.py tests/test_transfer.py tests/test_ipc.py tests/test_cli.py
      tests/test_doctor.py tests/test_rdma_unavailable.py tests/test_bare_machine.py tests/test_first_hour.py
      tests/test_sessions.py tests/test_safetensors_io.py tests/test_docs.py tests/test_cuda.py)
# these read the source tree (the layers, ruff/mypy over the package, the docs' links): the source-tree run has them
SOURCE_ONLY=(--deselect tests/test_architecture.py --deselect tests/test_sourcecode.py
             --deselect tests/test_sync_plan.py::test_planner_modules_do_no_io_imports
             --deselect tests/test_docs.py::test_readme_links_to_every_docs_page)   # links into benchmarks/
if [ "${WHEEL_TESTS:-fast}" = all ]; then SET=(tests); else SET=("${FAST[@]}"); fi
log "pytest (${WHEEL_TESTS:-fast}) in $STAGE against the installed wheel"
set +e
HOME=${HOME:-/tmp} "$VENV/bin/python" -m pytest -p no:cacheprovider -q -rs -x "${SOURCE_ONLY[@]}" "${SET[@]}" "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && rc=0
log "pytest exit $rc"
exit "$rc"
