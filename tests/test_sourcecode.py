"""Lint and type checks run as part of the test suite (asyncpg's test__sourcecode pattern)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    r = run(ruff, "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy():
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    r = run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout + r.stderr
