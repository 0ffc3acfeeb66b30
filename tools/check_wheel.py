"""Check a built tensorxfer wheel: every extension and kernel image is in it, and it is true to its tag.

    python tools/check_wheel.py dist/tensorxfer-*.whl [--max-mb 20] [--json]

What is checked, per wheel (exit 1 naming each failure):
- every native module (the host memory modules, the CUDA modules, the verbs module) is there for the
  wheel's own interpreter tag, with the .pyi stubs, py.typed and the .pxd files;
- both kernel images (strided copy, FP8 quantizer) carry SASS for sm_80, sm_90, sm_100 and sm_120 and
  PTX, read from the fatbin headers (no CUDA tools needed);
- each module needs only libraries the manylinux policy guarantees (libc, libdl, libpthread, libm, librt,
  the loader): in particular neither libibverbs nor libcuda, which are loaded at run time and must match
  the machine's kernel and driver; nothing was grafted in (no ``tensorxfer.libs/``);
- no symbol needs a glibc newer than the platform tag says (``manylinux_2_28`` -> GLIBC_2.28);
- the wheel is under ``--max-mb``.

Needs pyelftools (auditwheel depends on it: tools/build_wheels.py runs this in its tools venv).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import struct
import sys
import zipfile
from pathlib import Path

EXTENSIONS = ("tensorxfer/memory/_extent", "tensorxfer/memory/_host", "tensorxfer/memory/_hostcopy",
              "tensorxfer/memory/_fence", "tensorxfer/memory/_driver", "tensorxfer/memory/_cuda",
              "tensorxfer/memory/_copy", "tensorxfer/transport/_verbs")
KERNELS = ("tensorxfer/memory/strided_copy.fatbin", "tensorxfer/quant/fp8_quantize.fatbin")
SASS = {80, 90, 100, 120}
OTHER_FILES = ("tensorxfer/py.typed", "tensorxfer/memory/_host.pyi", "tensorxfer/transport/_verbs.pyi",
               "tensorxfer/memory/_extent.pxd", "tensorxfer/_lib/includes/libibverbs.pxd")
#: what a manylinux system provides (PEP 600 / auditwheel's policy, the libraries we can use)
SYSTEM_LIBRARIES = {"libc.so.6", "libdl.so.2", "libpthread.so.0", "libm.so.6", "librt.so.1",
                    "ld-linux-x86-64.so.2"}
FATBIN_MAGIC = 0xBA55ED50


def fatbin_targets(data: bytes) -> tuple[set[int], set[int]]:
    """(SASS architectures, PTX architectures) in a fatbin: its header, then entries of kind 1 (PTX)
    or 2 (ELF/SASS), each with its header size, payload size and, at byte 28, the architecture."""
    magic, _version, header, size = struct.unpack_from("<IHHQ", data, 0)
    if magic != FATBIN_MAGIC:
        raise ValueError("not a fatbin (bad magic)")
    sass: set[int] = set()
    ptx: set[int] = set()
    off = header
    while off < header + size:
        kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        (ptx if kind == 1 else sass).add(arch)
        off += entry_header + payload
    return sass, ptx


def elf_needs(data: bytes) -> tuple[list[str], str]:
    """(DT_NEEDED libraries, newest GLIBC_x.y version referenced)."""
    # imported here: the fatbin reader above needs nothing beyond the standard library (tests use it)
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    elf = ELFFile(io.BytesIO(data))
    needed: list[str] = []
    newest = (0, 0)
    for sec in elf.iter_sections():
        if isinstance(sec, DynamicSection):
            needed += [t.needed for t in sec.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        if isinstance(sec, GNUVerNeedSection):
            for _verneed, aux in sec.iter_versions():
                for a in aux:
                    m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", a.name)
                    if m:
                        newest = max(newest, (int(m[1]), int(m[2])))
    return needed, f"{newest[0]}.{newest[1]}"


def check(path: Path, max_mb: float) -> dict:
    m = re.match(r"tensorxfer-[^-]+-(cp3\d+)-(cp3\d+)-(.+)\.whl$", path.name)
    if not m:
        return {"wheel": path.name, "failures": ["not a CPython tensorxfer wheel name"]}
    tag, platforms = m[1], m[3].split(".")
    glibc_tag = max((tuple(map(int, p.split("_")[1:3])) for p in platforms if p.startswith("manylinux_")),
                    default=None)
    failures: list[str] = []
    modules: dict[str, dict] = {}
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        for ext in EXTENSIONS:
            so = f"{ext}.{tag.replace('cp', 'cpython-')}-x86_64-linux-gnu.so"
            if so not in names:
                failures.append(f"missing {so}")
                continue
            needed, glibc = elf_needs(z.read(so))
            modules[so] = {"needed": needed, "glibc": glibc}
            extra = set(needed) - SYSTEM_LIBRARIES
            if extra:
                failures.append(f"{so} needs {sorted(extra)} (not guaranteed by manylinux; must be dlopened)")
            if glibc_tag and tuple(map(int, glibc.split("."))) > glibc_tag:
                failures.append(f"{so} needs GLIBC_{glibc}, newer than its tag {platforms}")
        kernels = {}
        for k in KERNELS:
            if k not in names:
                failures.append(f"missing {k}")
                continue
            sass, ptx = fatbin_targets(z.read(k))
            kernels[k] = {"sass": sorted(sass), "ptx": sorted(ptx)}
            if not SASS <= sass or not ptx:
                failures.append(f"{k}: SASS {sorted(sass)} PTX {sorted(ptx)}; want SASS {sorted(SASS)} and PTX")
        failures += [f"missing {f}" for f in OTHER_FILES if f not in names]
        grafted = sorted(n for n in names if n.startswith("tensorxfer.libs/"))
        if grafted:
            failures.append(f"libraries were bundled into the wheel: {grafted}")
    mb = path.stat().st_size / 2**20
    if mb > max_mb:
        failures.append(f"{mb:.1f} MB, over {max_mb} MB")
    if glibc_tag is None or glibc_tag > (2, 28):
        failures.append(f"platform tag {platforms} is not manylinux_2_28 or older")
    return {"wheel": path.name, "mb": round(mb, 2), "platforms": platforms, "modules": modules,
            "kernels": kernels, "failures": failures}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheels", nargs="+", type=Path)
    p.add_argument("--max-mb", type=float, default=20.0)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    a = p.parse_args()
    results = [check(w, a.max_mb) for w in a.wheels]
    if a.json:
        print(json.dumps(results, indent=1))
    for r in results:
        state = "ok" if not r["failures"] else "FAILED"
        print(f"{r['wheel']}: {state}, {r.get('mb', '?')} MB", file=sys.stderr)
        for f in r["failures"]:
            print(f"  - {f}", file=sys.stderr)
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
