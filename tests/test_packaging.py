"""What a release carries: the sdist's manifest names every build input, and the kernel images carry the
GPU generations the wheels promise (tools/check_wheel.py reads them; here on an in-place build)."""

from __future__ import annotations

import fnmatch
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tensorxfer"
pytestmark = pytest.mark.skipif(not (SOURCE / "memory" / "_host.pyx").exists() or not (ROOT / "tools").is_dir(),
                                reason="needs the source tree (this run is against an installed wheel)")


def check_wheel():
    spec = importlib.util.spec_from_file_location("check_wheel", ROOT / "tools" / "check_wheel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sdist_manifest_names_every_build_input() -> None:
    """setup.py needs the .pyx/.pxd sources, the verbs loader header and the CUDA kernels: a file that
    MANIFEST.in does not name is missing from the sdist, and a source build from PyPI fails."""
    patterns = []
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        words = line.split("#")[0].split()
        if words[:2] == ["recursive-include", "tensorxfer"]:
            patterns += words[2:]
    inputs = [p for p in SOURCE.rglob("*") if p.suffix in (".pyx", ".pxd", ".pyi", ".h", ".cu")]
    assert any(p.name == "verbs_dl.h" for p in inputs)
    missing = [str(p.relative_to(ROOT)) for p in inputs if not any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    assert not missing, f"MANIFEST.in leaves these out of the sdist: {missing}"


@pytest.mark.parametrize("image", ["memory/strided_copy.fatbin", "quant/fp8_quantize.fatbin"])
def test_kernel_images_carry_every_generation(image: str) -> None:
    path = SOURCE / image
    if not path.exists():
        pytest.skip(f"{image} is not built here (no nvcc when the extensions were built)")
    cw = check_wheel()
    sass, ptx = cw.fatbin_targets(path.read_bytes())
    assert cw.SASS <= sass, f"{image} has SASS for {sorted(sass)}, not {sorted(cw.SASS)} (setup.py KERNEL_TARGETS)"
    assert ptx, f"{image} has no PTX for GPUs after sm_{max(sass)}"


def test_fatbin_reader_refuses_other_files() -> None:
    with pytest.raises(ValueError, match="not a fatbin"):
        check_wheel().fatbin_targets(b"\x7fELF" + bytes(60))
