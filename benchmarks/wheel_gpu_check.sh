#!/usr/bin/env bash
# The built wheel on the GPU machine: installed into that machine's Python (pip, no index: its torch is
# used, and the tests' child processes, which run sys.executable, find the wheel too), then the cuda-marked
# tests run from a directory without the source tree (issue 41: "On the GPU (device), the same wheel installed into the machine's Python:
# the cuda-marked tests pass").
#
# Here (a machine with PyPI), once: build the wheels and fetch the run-time dependencies the GPU machine
# may lack (it reaches no network), for its Python (default 3.12):
#   python3 tools/build_wheels.py --python 3.12 && bash benchmarks/wheel_gpu_check.sh --prepare [3.12]
# On the GPU machine (the device tool: dist/ is git-ignored, so carry it):
#   run(command="bash benchmarks/wheel_gpu_check.sh", carry=["dist"])
# Output: the doctor report and pytest's, and $OUT/wheel-gpu-check.txt when $OUT is set.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEPS="$ROOT/dist/gpu-deps"
PY=${PYTHON:-python3}
# what the wheel imports at run time, and the test tools; the GPU machine brings torch itself
REQUIREMENTS=(numpy msgpack ml_dtypes xxhash "cuda-bindings~=13.0.0" pytest hypothesis psutil safetensors)

if [ "${1:-}" = --prepare ]; then
  ver=${2:-3.12}
  rm -rf "$DEPS" && mkdir -p "$DEPS"
  "$PY" -m pip download -q --only-binary :all: --python-version "$ver" --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEPS" "${REQUIREMENTS[@]}"
  du -sh "$DEPS"
  exit 0
fi
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEEL=$(ls "$ROOT"/dist/tensorxfer-*-"$TAG"-"$TAG"-manylinux*.whl 2>/dev/null | head -1 || true)
[ -n "$WHEEL" ] || { echo "no $TAG wheel in dist/ (python3 tools/build_wheels.py --python ${TAG#cp3}...)"; exit 2; }
WORK=$(mktemp -d /tmp/tensorxfer-gpu-wheel.XXXXXX)
# installed into the machine's Python itself (the issue's words; the device machine is fresh at every start):
# a venv over it (itself a venv there) saw neither its torch nor its packages, and a folder on PYTHONPATH was
# lost in the tests' children, which set PYTHONPATH themselves
VPY="$PY"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "[wheel_gpu_check] $($PY -V) at $(command -v "$PY"); installing $(basename "$WHEEL") into $SITE"
"$VPY" -m pip install -q --no-deps --no-index --force-reinstall "$WHEEL"
# dependencies the machine's Python lacks, from dist/gpu-deps (prepared above)
missing=()
for mod in numpy msgpack ml_dtypes xxhash cuda.bindings pytest hypothesis psutil safetensors; do
  "$VPY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[wheel_gpu_check] not in this Python: ${missing[*]}; installing from dist/gpu-deps"
  # --no-deps with each one's own dependencies named: pip would otherwise bring a second numpy (ml_dtypes
  # wants one) in front of the one the machine's torch was built with
  pkgs=()
  for m in "${missing[@]}"; do
    case $m in
      cuda.bindings) pkgs+=("cuda-bindings~=13.0.0" cuda-pathfinder);;
      pytest) pkgs+=(pytest iniconfig packaging pluggy pygments);;
      hypothesis) pkgs+=(hypothesis sortedcontainers);;
      *) pkgs+=("$m");;
    esac
  done
  "$VPY" -m pip install -q --no-index --no-deps --find-links "$DEPS" "${pkgs[@]}"
fi

# tests and pytest's configuration, no tensorxfer/ beside them
mkdir -p "$WORK/stage" && cp -r "$ROOT/tests" "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/docs" "$ROOT/examples" "$WORK/stage/"
cd "$WORK/stage"
"$VPY" -c 'import sys, tensorxfer; from tensorxfer.memory import _cuda, _copy
assert tensorxfer.__file__.startswith(sys.argv[1]), tensorxfer.__file__
print("tensorxfer from", tensorxfer.__file__)' "$SITE"
"$VPY" -c "import sys; from tensorxfer.cli.main import main; sys.exit(main([\"doctor\"]))" || true
set +e
"$VPY" -m pytest -p no:cacheprovider -q -rs -m cuda tests --deselect tests/test_architecture.py \
    --deselect tests/test_sourcecode.py 2>&1 | tee "$WORK/pytest.txt"
rc=${PIPESTATUS[0]}
set -e
[ -n "${OUT:-}" ] && cp "$WORK/pytest.txt" "$OUT/wheel-gpu-check.txt"
echo "[wheel_gpu_check] pytest -m cuda exit $rc (wheel $(basename "$WHEEL"))"
exit "$rc"
