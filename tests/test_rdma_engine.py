"""The ``rdma`` transport through the engine (Sender/Receiver), on a real verbs device (Soft-RoCE in CI).

Both ends live in this process (the receiver in a thread); the control
connection is loopback TCP, the data moves by RDMA WRITE over the device.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import msgpack
import numpy as np
import pytest

from tensorxfer import Manifest, Receiver, Sender, TensorRegion
from tensorxfer.errors import PeerLost, TransferTimeout
from tensorxfer.protocol import mac
from tensorxfer.transport.base import TransferContext
from tensorxfer.transport.rdma import RdmaReceiverEndpoint, RdmaSenderEndpoint, rdma_available
from tensorxfer.transport.rdma_engine import READY, SIDE_HEADER, SIDE_MAGIC, RdmaReceiver, RdmaSender
from tests.helpers import Background, region_of

OK, REASON = rdma_available()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not OK, reason=f"no usable RDMA device: {REASON}")]

KIB = 1 << 10


def addr(rx: Receiver) -> str:
    return "{}:{}".format(*rx.address)


def manifest() -> Manifest:
    # odd sizes so tensors (and RDMA requests) straddle the sender's 64 KiB chunks
    return Manifest.layout([(f"t{i}", "U8", (100_003 + 7919 * i,)) for i in range(20)] + [("tail", "U8", (5,))])


def fill(region: TensorRegion, seed: int) -> bytes:
    mv = memoryview(region.region).cast("B")
    data = np.random.default_rng(seed).integers(0, 256, region.nbytes, dtype=np.uint8).tobytes()
    mv[:region.nbytes] = data
    mv.release()
    return data


def payload(region: TensorRegion) -> bytes:
    mv = memoryview(region.region).cast("B")
    try:
        return bytes(mv[:region.nbytes])
    finally:
        mv.release()


def test_forced_rdma_moves_a_multi_chunk_region_byte_exact_three_times() -> None:
    with TensorRegion.from_manifest(manifest(), chunk_size=64 * KIB) as src, Receiver() as rx:
        assert len(src.region.resolve_extent(0, src.nbytes).segments) > 10
        job = Background(lambda: [payload(rx.receive(timeout=60)) for _ in range(3)])
        sent = []
        with Sender(addr(rx), transport="rdma", streams=3, stall_timeout=60) as s:
            for seed, verify in ((1, False), (2, True), (3, True)):
                sent.append(fill(src, seed))
                st = s.send(src, verify=verify)
                assert st.transport == "rdma" and st.bytes == src.nbytes and st.verified == verify
                assert st.streams == 3 and not st.reallocated
        got = job.result(timeout=120)
        assert got == sent
        assert rx.last_stats is not None and rx.last_stats.verified


def test_auto_picks_rdma_when_ipc_is_disabled(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TENSORXFER_DISABLE_IPC", "1")
    caplog.set_level(logging.INFO, logger="tensorxfer")
    with TensorRegion.from_manifest(manifest(), chunk_size=64 * KIB) as src, Receiver() as rx:
        data = fill(src, 7)
        job = Background(lambda: payload(rx.receive(timeout=60)))
        with Sender(addr(rx), stall_timeout=60) as s:
            assert s.transport == "rdma"
            assert s.send(src, verify=True).transport == "rdma"
        assert job.result(timeout=120) == data
    assert any("chose 'rdma'" in r.message for r in caplog.records)


# ------------------------------------------------------- the transport halves, directly
def ctx(stall: float = 20.0) -> TransferContext:
    return TransferContext(local_host="127.0.0.1", peer_host="127.0.0.1", session_key=os.urandom(32),
                           transfer_id=5, stall_timeout=stall, streams=2)


def test_stranger_on_the_side_port_is_dropped_and_the_real_sender_lands() -> None:
    c = ctx()
    with region_of(300_000) as dst, region_of(300_000) as src:
        data = fill(src, 11)
        with RdmaReceiver(c) as rx, RdmaSender(c) as tx:
            d = msgpack.unpackb(msgpack.packb(rx.prepare(dst)))
            job = Background(rx.wait)
            for junk in (b"hello", SIDE_HEADER.pack(SIDE_MAGIC, 5, 3, bytes(32)) + b"abc"):
                with socket.create_connection(("127.0.0.1", d["side_port"]), timeout=5) as s:
                    s.sendall(junk)
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(10)
                    assert s.recv(1) == b"", "the receiver must close a stranger's connection"
            tx.connect(d)
            assert tx.send(src) == src.nbytes
            assert job.result(timeout=60) == dst.nbytes
        assert payload(dst) == data


def test_sender_that_vanishes_after_ready_is_peer_lost_not_a_hang() -> None:
    c = ctx(stall=30.0)
    with region_of(300_000) as dst, region_of(300_000) as src:
        with RdmaReceiver(c) as rx:
            d = rx.prepare(dst)
            job = Background(rx.wait)
            with RdmaSenderEndpoint(src, qps=len(d["qps"])) as ep:
                ep.connect(d)
                body = msgpack.packb(ep.descriptors())
                proof = mac(c.session_key, b"rdma-side", d["nonce"], (5).to_bytes(8, "big"), body)
                with socket.create_connection(("127.0.0.1", d["side_port"]), timeout=5) as s:
                    s.sendall(SIDE_HEADER.pack(SIDE_MAGIC, 5, len(body), proof) + body)
                    s.settimeout(10)
                    assert s.recv(1) == READY
            t0 = time.monotonic()
            with pytest.raises(PeerLost, match="sender lost"):
                job.result(timeout=20)
            assert time.monotonic() - t0 < 5


def test_receiver_without_a_sender_times_out_and_close_from_another_thread_wakes_it() -> None:
    with region_of(100_000) as dst:
        with RdmaReceiver(ctx(stall=1.0)) as rx:
            rx.prepare(dst)
            with pytest.raises(TransferTimeout, match="side connection"):
                rx.wait()
        rx2 = RdmaReceiver(ctx(stall=60.0))
        rx2.prepare(dst)
        job = Background(rx2.wait)
        time.sleep(0.3)
        rx2.close()
        with pytest.raises(PeerLost, match="closed"):
            job.result(timeout=5)
        rx2.close()  # idempotent


def test_receiver_that_vanishes_is_peer_lost_on_the_sender() -> None:
    c = ctx(stall=30.0)
    with region_of(300_000) as dst, region_of(300_000) as src:
        with RdmaReceiverEndpoint(dst, qps=2) as ep, socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            d = {**ep.descriptors(), "side_port": listener.getsockname()[1], "nonce": os.urandom(32), "streams": 2}
            with RdmaSender(c) as tx:
                tx.connect(d)
                job = Background(tx.send, src)
                listener.settimeout(10)
                conn, _ = listener.accept()
                conn.close()           # hangs up instead of answering READY
                with pytest.raises(PeerLost):
                    job.result(timeout=20)
