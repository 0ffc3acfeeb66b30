"""The examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import server_and_trainer

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("transport", ["tcp", pytest.param("auto", marks=pytest.mark.slow)])
def test_trainer_pushes_weights(transport):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "trainer_pushes_weights.py"), "--steps", "2",
                        "--transport", transport], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    steps = [line for line in p.stdout.splitlines() if line.startswith("trainer: step")]
    assert len(steps) == 2 and all("re-allocated: False" in s for s in steps)
    assert ("over tcp" in steps[0]) if transport == "tcp" else ("over ipc" in steps[0])


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_live_weights_trainer_and_server_processes(transport):
    """The two-process live-weights example: the server process holds each step's weights, in order."""
    pytest.importorskip("torch", reason="the live-weights example needs PyTorch")
    steps = 3
    first = []

    def trainer(server: subprocess.Popen) -> list[str]:
        assert server.stdout is not None
        first.append(server.stdout.readline())         # printed once it listens
        assert first[0].startswith("server: listening on "), first[0] + server.stderr.read()
        return [str(ROOT / "examples" / "live_weights_trainer.py"), "--to", first[0].split()[-1], "--steps",
                str(steps), "--transport", transport]

    trainer_run, server = server_and_trainer([str(ROOT / "examples" / "live_weights_server.py"), "--listen",
                                              "127.0.0.1:0", "--steps", str(steps), "--timeout", "60"], trainer)
    assert trainer_run.returncode == 0, trainer_run.stderr
    assert server.returncode == 0, server.stderr
    out = server.stdout
    expected = "ipc" if transport == "auto" else "tcp"      # one host, one user: auto picks ipc
    assert f"transport {expected} (asked for {transport})" in trainer_run.stdout
    if transport == "auto":
        assert "chose 'ipc'" in trainer_run.stderr           # auto's pick is logged at INFO
    sent = [line.split("weights ")[1] for line in _lines(trainer_run.stdout, "trainer: step")]
    got = _lines(out, "server: version")
    assert len(sent) == len(got) == steps
    for step, (digest, line) in enumerate(zip(sent, got), start=1):
        assert line.startswith(f"server: version {step} ") and f" over {expected}:" in line, line
        assert f"weights {digest}," in line, (line, digest)       # the server held exactly that step's weights
    assert len(set(sent)) == steps                               # and each step changed them
