"""Weights live in the region: a trainer's adopted model and a receiver's bound model, as real processes.

The trainer's parameters *are* its region (``TensorRegion.from_module``); every step it sends the region
with no ``update_from``; the receiver's model is bound to what it receives (``receive(into=model)``), so
each update lands in its live weights.  After every step the receiver's logits must equal the trainer's
bit for bit, and on both sides every parameter must still be its region view (no copy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import GPU_REASON, ROOT, finish

torch = pytest.importorskip("torch", reason="live weights need PyTorch")
pytest.importorskip("transformers", reason="the live-weights test uses a Hugging Face model (pip install "
                                           "'tensorxfer[test]')")

CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "tie_word_embeddings": True}


def peer(role: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    full = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "tests.live_peers", role, json.dumps(CONFIG), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full, cwd=ROOT)


def lines(proc: subprocess.Popen, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        line = proc.stdout.readline()
        if not line:
            rc, rest, err = finish(proc)
            raise AssertionError(f"peer ended early (rc {rc}): {rest}\n{err}")
        out.append(json.loads(line))
    return out


def train_and_receive(device: str, transport: str, optimizer: str, share: bool = False,
                      trainer_env: dict[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    rx = peer("receiver", "--device", device, *(["--share"] if share else []))
    try:
        address = lines(rx, 1)[0]["address"]
        tr = peer("trainer", "--device", device, "--to", address, "--transport", transport, "--optimizer",
                  optimizer, *(["--lockstep"] if share else []), env=trainer_env)
        sent, got = [], []
        for _ in range(3):
            # one step at a time: a sharing receiver reads the trainer's own memory, which the next step changes
            sent += lines(tr, 1)
            got += lines(rx, 1)
            if share:
                tr.stdin.write("next\n")
                tr.stdin.flush()
        rc, _, err = finish(tr, 60)
        assert rc == 0, err
        rc, _, err = finish(rx, 60)
        assert rc == 0, err
        return sent, got
    finally:
        rx.kill()
        finish(rx)


def check_steps(sent: list[dict], got: list[dict], transport: str) -> None:
    assert [s["step"] for s in sent] == [1, 2, 3] and [g["version"] for g in got] == [1, 2, 3]
    assert sent[0]["adopted"], "after from_module every parameter must be its region view"
    losses = [s["loss"] for s in sent]
    assert losses[2] < losses[0], f"the model did not train: {losses}"
    for s, g in zip(sent, got):
        assert s["views"], f"step {s['step']}: a trainer parameter is no longer its region view"
        assert g["views"], f"step {g['version']}: a receiver parameter is not its view of the received region"
        assert s["transport"] == g["transport"] == transport
        assert g["logits"] == s["logits"], f"step {s['step']}: the receiver's logits differ from the trainer's"
    assert [g["reallocated"] for g in got[1:]] == [False, False], "later steps must land in the same region"
    assert got[0]["logits"] != got[2]["logits"], "the weights did not change between steps"


@pytest.mark.parametrize("transport, optimizer", [("tcp", "foreach"), ("ipc", "fused"), ("tcp", "plain")])
@pytest.mark.slow
def test_an_adopted_trainer_pushes_each_step_into_a_bound_receiver(transport: str, optimizer: str) -> None:
    sent, got = train_and_receive("cpu", transport, optimizer)
    check_steps(sent, got, transport)


@pytest.mark.slow
def test_a_sharing_receiver_binds_its_model_to_the_trainers_memory() -> None:
    sent, got = train_and_receive("cpu", "ipc", "foreach", share=True)
    check_steps(sent, got, "ipc")


@pytest.mark.cuda
@pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")
@pytest.mark.parametrize("transport, optimizer", [("ipc", "fused"), ("tcp", "foreach")])
def test_on_the_gpu_with_expandable_segments(transport: str, optimizer: str) -> None:
    sent, got = train_and_receive("cuda:0", transport, optimizer,
                                  trainer_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    check_steps(sent, got, transport)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_the_ack_comes_once_the_update_is_in_the_receivers_module(transport: str, monkeypatch) -> None:
    # A trainer that got the ack may use the server's model at once (the README's loop does): the module is
    # re-pointed at the region before the ack, however long that takes (here made slow on purpose).
    import threading
    import time

    import torch

    import tensorxfer as tx
    from tensorxfer.session.targets import RegionSlot

    slow_attach = RegionSlot.attach

    def attach(self: RegionSlot, region: tx.TensorRegion) -> None:
        time.sleep(0.5)
        slow_attach(self, region)
    monkeypatch.setattr(RegionSlot, "attach", attach)
    torch.manual_seed(0)
    trainer, server = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
    region = tx.TensorRegion.from_module(trainer)
    x = torch.randn(3, 16)
    try:
        with tx.Receiver() as rx:
            serving = threading.Thread(target=lambda: [rx.receive(timeout=20, into=server) for _ in range(2)])
            serving.start()
            with tx.Sender(rx.address, transport=transport) as sender:
                for _ in range(2):
                    with torch.no_grad():
                        trainer.weight.add_(1.0)
                    sender.send(region)
                    assert torch.equal(server(x), trainer(x))
            serving.join(timeout=20)
            assert not serving.is_alive()
    finally:
        region.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(
    GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")])])
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_receivers_check_of_its_module_runs_while_the_data_lands(transport: str, device: str,
                                                                   monkeypatch) -> None:
    # The check that the bound module still is the region's views (~a thousand tensors in a real model)
    # runs inside the transport's wait, while the data moves, not after it; a module re-pointed by its
    # owner between updates is still found and attached again before the ack.
    import threading

    import torch

    import tensorxfer as tx
    from tensorxfer.session.targets import RegionSlot
    from tensorxfer.transport.ipc.copy import IpcReceiver
    from tensorxfer.transport.tcp import TcpReceiver

    waiting = threading.local()
    checks: list[bool] = []
    attaches: list[bool] = []
    for cls in (TcpReceiver, IpcReceiver):
        def wait(self: Any, progress: Any = None, _wait: Any = cls.wait) -> int:
            waiting.now = True
            try:
                return _wait(self, progress)
            finally:
                waiting.now = False
        monkeypatch.setattr(cls, "wait", wait)
    attached, attach = RegionSlot.attached, RegionSlot.attach
    monkeypatch.setattr(RegionSlot, "attached", lambda self, r: checks.append(getattr(waiting, "now", False))
                        or attached(self, r))
    monkeypatch.setattr(RegionSlot, "attach", lambda self, r: attaches.append(getattr(waiting, "now", False))
                        or attach(self, r))
    torch.manual_seed(0)
    trainer, server = torch.nn.Linear(64, 32).to(device), torch.nn.Linear(64, 32).to(device)
    region = tx.TensorRegion.from_module(trainer)
    x = torch.randn(3, 64, device=device)
    got: list[Any] = []
    try:
        with tx.Receiver(device=device) as rx:
            def serve() -> None:
                for _ in range(4):
                    rx.receive(timeout=20, into=server)
                    got.append(server.weight.data_ptr())
            serving = threading.Thread(target=serve)
            serving.start()
            with tx.Sender(rx.address, transport=transport) as sender:
                for step in range(4):
                    with torch.no_grad():
                        trainer.weight.add_(1.0)
                        trainer.bias.add_(1.0)
                    st = sender.send(region)
                    assert st.transport == transport
                    assert torch.equal(server(x), trainer(x))
                    if step == 1:       # the owner re-points a tensor: the next update must find it
                        server.bias.data = torch.zeros_like(server.bias)
            serving.join(timeout=20)
            assert not serving.is_alive()
    finally:
        region.close()
    assert checks == [True] * 4             # every update's check ran inside wait(), while the data landed
    # attached (re-pointed) after the data landed, never during it: on the first update, and on the one
    # after the owner re-pointed a tensor
    assert attaches == [False, False]
    assert len(set(got)) == 1


def test_a_failing_module_check_while_landing_waits_for_the_data_and_fails_the_update_after_it(monkeypatch) -> None:
    # The landing-time check runs while copies may still be in flight: an error there must not cut the
    # update short; landed() meets it again once every byte is in, and the update fails cleanly (the
    # sender is told, the receiver serves the next sender).
    import threading

    import torch

    import tensorxfer as tx
    from tensorxfer.binding import ModuleBinding

    calls = []
    real = ModuleBinding.attached_to

    def broken(self: ModuleBinding, region: Any) -> bool:
        calls.append(1)
        if len(calls) <= 2:         # the landing check and landed()'s own, on the first update
            raise RuntimeError("a module that cannot be inspected")
        return real(self, region)
    monkeypatch.setattr(ModuleBinding, "attached_to", broken)
    torch.manual_seed(0)
    trainer, server = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    region = tx.TensorRegion.from_module(trainer)
    errors: list[BaseException] = []
    try:
        with tx.Receiver() as rx:
            def serve() -> None:
                try:
                    rx.receive(timeout=20, into=server)
                except BaseException as e:
                    errors.append(e)
                rx.receive(timeout=20, into=server)
            serving = threading.Thread(target=serve)
            serving.start()
            with tx.Sender(rx.address, transport="ipc") as sender, pytest.raises(tx.TransferError):
                sender.send(region)
            with tx.Sender(rx.address, transport="ipc") as sender:
                sender.send(region)
            serving.join(timeout=20)
            assert not serving.is_alive()
    finally:
        region.close()
    assert len(errors) == 1 and "cannot be inspected" in str(errors[0])
    assert torch.equal(server.weight, trainer.weight)
