"""The examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    server = subprocess.Popen([sys.executable, str(ROOT / "examples" / "live_weights_server.py"),
                               "--listen", "127.0.0.1:0", "--steps", str(steps), "--timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert server.stdout is not None
        first = server.stdout.readline()         # printed once it listens
        assert first.startswith("server: listening on "), first + server.stderr.read()
        address = first.split()[-1]
        trainer = subprocess.run([sys.executable, str(ROOT / "examples" / "live_weights_trainer.py"),
                                  "--to", address, "--steps", str(steps), "--transport", transport],
                                 capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert trainer.returncode == 0, trainer.stderr
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, err
    expected = "ipc" if transport == "auto" else "tcp"      # one host, one user: auto picks ipc
    assert f"transport {expected} (asked for {transport})" in trainer.stdout
    if transport == "auto":
        assert "chose 'ipc'" in trainer.stderr           # auto's pick is logged at INFO
    sent = [line.split("weights ")[1] for line in _lines(trainer.stdout, "trainer: step")]
    got = _lines(out, "server: version")
    assert len(sent) == len(got) == steps
    for step, (digest, line) in enumerate(zip(sent, got), start=1):
        assert line.startswith(f"server: version {step} ") and f" over {expected}:" in line, line
        assert f"weights {digest}," in line, (line, digest)       # the server held exactly that step's weights
    assert len(set(sent)) == steps                               # and each step changed them
