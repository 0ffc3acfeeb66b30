"""The examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_trainer_pushes_weights(transport):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "trainer_pushes_weights.py"), "--steps", "2",
                        "--transport", transport], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    steps = [line for line in p.stdout.splitlines() if line.startswith("trainer: step")]
    assert len(steps) == 2 and all("re-allocated: False" in s for s in steps)
    assert ("over tcp" in steps[0]) if transport == "tcp" else ("over ipc" in steps[0])
