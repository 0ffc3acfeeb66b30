"""Build the Cython extensions.

Core modules always build.  Optional native parts build only where their
headers are found, and can be forced off:

- ``TENSORXFER_NO_CUDA=1``  skips the CUDA modules, ``tensorxfer.memory._cuda``
  (CudaRegion), ``._copy`` (Stager, Copier) and ``._driver`` (what both share);
  they build together or not at all (need cuda.h and the cuda-bindings .pxd
  files; they do not link libcuda: cuda.bindings loads the driver at run
  time, so they import on machines without a GPU and report that CUDA is
  unusable there).
  With them, ``nvcc`` (``$CUDA_HOME/bin``, ``/usr/local/cuda/bin`` or ``PATH``)
  compiles ``tensorxfer/memory/strided_copy.cu`` into ``strided_copy.fatbin``
  beside them (the weight sync's strided device copies) and
  ``tensorxfer/quant/fp8_quantize.cu`` into ``quant/fp8_quantize.fatbin`` (FP8
  quantization of sync sources' shards); without it the package falls back
  to the copy engines' pitched copies and torch's operations.
- ``TENSORXFER_NO_VERBS=1`` skips ``tensorxfer.transport._verbs`` (needs
  infiniband/verbs.h, from Debian's libibverbs-dev, at build time only: it does
  not link libibverbs but loads libibverbs.so.1 when first used, see
  ``tensorxfer/_lib/includes/verbs_dl.h``, so it imports without rdma-core).
  ``TENSORXFER_VERBS_INCLUDE`` names a directory holding ``infiniband/verbs.h``
  (tools/build_wheels.py passes a copy of just those headers to its cross compiler).

Set ``TENSORXFER_REQUIRE_OPTIONAL=1`` (CI does) to make a missing optional
part a build error instead of a silent skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DIRECTIVES = {"language_level": "3", "embedsignature": True}


def env_on(var: str) -> bool:
    return os.environ.get(var, "").lower() in ("1", "true", "yes", "on")


def ext(name: str, **kw) -> Extension:
    return Extension(name, [name.replace(".", "/") + ".pyx"], **kw)


def find_cuda_include() -> str | None:
    candidates = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda.h").exists():
            return str(Path(root) / "include")
    try:  # pip's cuda-toolkit / nvidia-cuda-runtime wheels
        import nvidia.cuda_runtime  # type: ignore[import-not-found]

        inc = Path(nvidia.cuda_runtime.__path__[0]) / "include"
        if (inc / "cuda.h").exists():
            return str(inc)
    except ImportError:
        pass
    return None


def have_cuda_bindings_pxd() -> bool:
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return False
    return True


def find_verbs() -> str | None:
    """The include directory holding infiniband/verbs.h, or None."""
    for root in (os.environ.get("TENSORXFER_VERBS_INCLUDE", ""), "/usr/include", "/usr/local/include"):
        if root and Path(root, "infiniband", "verbs.h").exists():
            return root
    return None


def optional(name: str, reason: str | None) -> bool:
    if reason is None:
        return True
    msg = f"tensorxfer: not building {name}: {reason}"
    if env_on("TENSORXFER_REQUIRE_OPTIONAL"):
        sys.exit(msg + " (TENSORXFER_REQUIRE_OPTIONAL is set)")
    print(msg, file=sys.stderr)
    return False


extensions = [
    ext("tensorxfer.memory._extent"),
    ext("tensorxfer.memory._host"),
    ext("tensorxfer.memory._hostcopy"),
    ext("tensorxfer.memory._fence"),
]

# _cuda and _copy cimport _driver, so the three build (and ship) together.
CUDA_MODULES = ("tensorxfer.memory._driver", "tensorxfer.memory._cuda", "tensorxfer.memory._copy")
cuda_include = find_cuda_include()
if Path("tensorxfer/memory/_cuda.pyx").exists() and optional(", ".join(CUDA_MODULES),
            "TENSORXFER_NO_CUDA is set" if env_on("TENSORXFER_NO_CUDA")
            else "cuda.h not found (set CUDA_HOME)" if cuda_include is None
            else "cuda-bindings is not installed" if not have_cuda_bindings_pxd()
            else None):
    # C++: cydriver.pxd names anonymous struct members through C++ type traits
    extensions += [ext(name, include_dirs=[cuda_include], language="c++") for name in CUDA_MODULES]

verbs_include = find_verbs()
if Path("tensorxfer/transport/_verbs.pyx").exists() and optional("tensorxfer.transport._verbs",
            "TENSORXFER_NO_VERBS is set" if env_on("TENSORXFER_NO_VERBS")
            else "infiniband/verbs.h not found (apt-get install libibverbs-dev)" if verbs_include is None
            else None):
    # no libibverbs link: verbs_dl.h dlopens it (libdl: glibc < 2.34 keeps dlopen there). Hidden
    # visibility keeps its ibv_* trampolines inside the module.
    extensions.append(ext("tensorxfer.transport._verbs", libraries=["dl"],
                          include_dirs=["tensorxfer/_lib/includes",
                                        *([verbs_include] if verbs_include not in ("/usr/include",) else [])],
                          extra_compile_args=["-fvisibility=hidden"]))


# the device kernels: source -> its image beside the package's CUDA modules (built where those are)
KERNELS = {Path("tensorxfer/memory/strided_copy.cu"): "memory/strided_copy.fatbin",
           Path("tensorxfer/quant/fp8_quantize.cu"): "quant/fp8_quantize.fatbin"}
# SASS for Ampere (sm_80; runs on 8.6/8.9 too), Hopper (sm_90), Blackwell (sm_100: B200/GB200, and 10.3;
# sm_120: RTX/workstation Blackwell), and PTX of the newest, which a newer driver compiles for GPUs after them.
KERNEL_TARGETS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
                  "-gencode", "arch=compute_100,code=sm_100", "-gencode", "arch=compute_120,code=sm_120",
                  "-gencode", "arch=compute_120,code=compute_120"]


def find_nvcc() -> str | None:
    for root in (os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").exists():
            return str(Path(root, "bin", "nvcc"))
    return shutil.which("nvcc")


class BuildWithKernels(build_ext):
    """Cython extensions, then the device kernels beside the CUDA modules (where those were built)."""

    def run(self) -> None:
        super().run()
        if not any(e.name == "tensorxfer.memory._copy" for e in self.extensions):
            return
        nvcc = find_nvcc()
        package = Path(self.get_ext_fullpath("tensorxfer.memory._copy")).parent.parent
        for source, image in KERNELS.items():
            if not optional(f"tensorxfer/{image}", None if nvcc else "nvcc not found (set CUDA_HOME)"):
                return
            out = package / image
            out.parent.mkdir(parents=True, exist_ok=True)
            # stale when the kernel or this file (its targets) changed since the image was built
            if out.exists() and out.stat().st_mtime >= max(source.stat().st_mtime, Path(__file__).stat().st_mtime):
                continue
            subprocess.run([nvcc, "-fatbin", "-O3", *KERNEL_TARGETS, "-o", str(out), str(source)], check=True)


setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=2),
      cmdclass={"build_ext": BuildWithKernels})
