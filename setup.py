"""Build the Cython extensions.

Core modules always build.  Optional native parts build only where their
headers are found and can be forced off:

- ``TENSORXFER_NO_CUDA=1``  skips ``tensorxfer.memory._cuda`` (needs cuda.h
  and the cuda-bindings .pxd files; no link to libcuda, it is loaded at run
  time by cuda.bindings).
- ``TENSORXFER_NO_VERBS=1`` skips ``tensorxfer.transport._verbs`` (needs
  infiniband/verbs.h and libibverbs).
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DIRECTIVES = {"language_level": "3", "embedsignature": True}


def ext(name: str, **kw) -> Extension:
    return Extension(name, [name.replace(".", "/") + ".pyx"], **kw)


def env_off(var: str) -> bool:
    return os.environ.get(var, "").lower() in ("1", "true", "yes", "on")


extensions = [
    ext("tensorxfer.memory._extent"),
    ext("tensorxfer.memory._host"),
]

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=2))
