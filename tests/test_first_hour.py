"""The first hour of a new user, session side: argument errors that leave the session usable, a mapping of
tensors sent as is, a sender that waits for a receiver still starting, one address form, and a receiver
that demands checksums."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import tensorxfer as tx
from tests.helpers import Background, finish
from tests.test_cli import cli, start_recv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sending_something_that_is_not_a_region_is_a_type_error_and_the_session_goes_on() -> None:
    with tx.Receiver() as rx, tx.TensorRegion.from_tensors({"x": np.arange(4, dtype=np.int32)}) as region:
        got = Background(rx.receive, timeout=20)
        with tx.Sender(rx.address) as s:                    # the (host, port) tuple Receiver.address gives
            for wrong in (object(), [1, 2], "weights.safetensors"):
                with pytest.raises(TypeError, match="TensorRegion or a mapping"):
                    s.send(wrong)                           # type: ignore[arg-type]
            assert s.send(region).bytes == region.nbytes    # nothing was broken
        assert np.array_equal(got.result().tensors()["x"], np.arange(4, dtype=np.int32))


def test_a_module_is_refused_with_the_way_to_adopt_it() -> None:
    torch = pytest.importorskip("torch")
    with tx.Receiver() as rx, tx.Sender(rx.address) as s:
        with pytest.raises(TypeError, match="from_module"):
            s.send(torch.nn.Linear(2, 2))                   # type: ignore[arg-type]


def test_a_mapping_of_tensors_is_packed_and_sent_and_later_updates_reuse_the_packing() -> None:
    weights = {"w": np.random.rand(64, 8).astype(np.float32), "b": np.ones(8, np.float32)}
    with tx.Receiver() as rx, tx.Sender(rx.address) as s:
        for step in range(3):
            weights["b"] = np.full(8, step, np.float32)
            got = Background(rx.receive, timeout=20)
            stats = s.send(weights)
            landed = got.result().tensors()
            assert np.array_equal(landed["w"], weights["w"]) and np.array_equal(landed["b"], weights["b"])
            assert stats.update == step + 1 and (stats.setup == (step == 0))
        got = Background(rx.receive, timeout=20)
        assert s.send({"other": np.zeros(3, np.int64)}).reallocated          # another layout: packed anew
        assert list(got.result().tensors()) == ["other"]


def test_a_sender_waits_for_a_receiver_that_is_still_starting() -> None:
    port = free_port()
    holder: dict[str, tx.Receiver] = {}

    def late_receiver() -> None:
        time.sleep(1.0)
        holder["rx"] = tx.Receiver(f"127.0.0.1:{port}")
        holder["rx"].receive(timeout=20)
    t = threading.Thread(target=late_receiver)
    t.start()
    try:
        with tx.TensorRegion.from_tensors({"x": np.ones(3, np.float32)}) as region, \
                tx.Sender(("127.0.0.1", port), connect_timeout=10) as s:
            assert s.send(region).bytes == region.nbytes
    finally:
        t.join(20)
        holder["rx"].close()


def test_nobody_listening_is_a_clear_peer_lost_after_the_connect_timeout() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(tx.PeerLost, match="no receiver is listening"):
        tx.Sender(f"127.0.0.1:{port}", connect_timeout=0.8)
    assert 0.7 < time.monotonic() - t0 < 5


def test_a_receiver_that_demands_checksums_refuses_an_unverified_offer_before_bytes_move() -> None:
    with tx.Receiver(require_verify=True) as rx, tx.TensorRegion.from_tensors({"x": np.ones(5)}) as region:
        got = Background(rx.receive, timeout=20)
        with tx.Sender(rx.address) as s, pytest.raises(tx.ManifestError, match="only verified"):
            s.send(region)
        with pytest.raises(tx.ManifestError, match="only verified"):
            got.result()
        assert rx.region is None
        got = Background(rx.receive, timeout=20)
        with tx.Sender(rx.address) as s:
            assert s.send(region, verify=True).verified
        got.result()


@pytest.mark.slow
def test_cli_recv_verify_refuses_a_send_without_verify_and_send_waits_for_recv(tmp_path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": np.ones((4, 4), np.float32)}, str(src / "model.safetensors"))
    recv, where = start_recv(tmp_path / "out", "--verify")
    try:
        rc, _, err = finish(cli("send", str(src), "--to", where), timeout=60)
        assert rc == 1 and "only verified" in err, err
        rc, _, err = finish(cli("send", str(src), "--to", where, "--verify"), timeout=60)
        assert rc == 0, err
    finally:
        recv.kill()
        finish(recv)
    rc, _, err = finish(cli("send", str(src), "--to", f"127.0.0.1:{free_port()}", "--connect-timeout", "0.5"),
                        timeout=60)
    assert rc == 1 and "no receiver is listening" in err, err
