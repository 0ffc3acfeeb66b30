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
                           stall_timeout=stall, streams=2)


def test_stranger_on_the_side_port_is_dropped_and_the_real_sender_lands() -> None:
    c = ctx()
    with region_of(300_000) as dst, region_of(300_000) as src:
        data = fill(src, 11)
        with RdmaReceiver(c) as rx, RdmaSender(c) as tx:
            d = msgpack.unpackb(msgpack.packb(rx.prepare(dst, 5, True)))
            job = Background(rx.wait)
            for junk in (b"hello", SIDE_HEADER.pack(SIDE_MAGIC, 5, 3, bytes(32)) + b"abc"):
                with socket.create_connection(("127.0.0.1", d["side_port"]), timeout=5) as s:
                    s.sendall(junk)
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(10)
                    assert s.recv(1) == b"", "the receiver must close a stranger's connection"
            tx.connect(src, 5, d)
            assert tx.send(src) == src.nbytes
            assert job.result(timeout=60) == dst.nbytes
        assert payload(dst) == data


def test_sender_that_vanishes_after_ready_is_peer_lost_not_a_hang() -> None:
    c = ctx(stall=30.0)
    with region_of(300_000) as dst, region_of(300_000) as src:
        with RdmaReceiver(c) as rx:
            d = rx.prepare(dst, 5, True)
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
            rx.prepare(dst, 1, True)
            with pytest.raises(TransferTimeout, match="side connection"):
                rx.wait()
        rx2 = RdmaReceiver(ctx(stall=60.0))
        rx2.prepare(dst, 1, True)
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
            d = {**ep.descriptors(), "setup": True, "side_port": listener.getsockname()[1], "nonce": os.urandom(32),
                 "streams": 2}
            with RdmaSender(c) as tx:
                job = Background(tx.connect, src, 1, d)
                listener.settimeout(10)
                conn, _ = listener.accept()
                conn.close()           # hangs up instead of answering READY
                with pytest.raises(PeerLost):
                    job.result(timeout=20)


# ------------------------------------------------------- register once, connect once
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_100_updates_register_once_connect_once_and_stay_flat() -> None:
    import psutil

    with TensorRegion.from_manifest(manifest(), chunk_size=64 * KIB) as src, Receiver() as rx:
        job = Background(lambda: [rx.receive(timeout=60) and rx.last_stats for _ in range(100)])
        with Sender(addr(rx), transport="rdma", streams=2, stall_timeout=60) as s:
            stats = []
            for k in range(100):
                if k == 10:
                    fds, rss = _fds(), psutil.Process().memory_info().rss
                if k in (0, 50, 99):
                    data = fill(src, k)
                stats.append(s.send(src, verify=k in (0, 99)))
            assert _fds() <= fds and psutil.Process().memory_info().rss < rss + (16 << 20)
        got = job.result(timeout=300)
        assert payload(rx.region) == data
    first, last = stats[0], stats[-1]
    assert first.setup and first.setup_seconds > 0 and first.registration in ("reg_mr", "reg_dmabuf_mr")
    assert not last.setup and last.setup_seconds == 0 and last.update == 100
    assert dict(last.counters) == {"registrations": 1, "connects": 1, "updates": 100}
    assert dict(got[-1].counters) == {"registrations": 1, "connects": 1, "updates": 100}
    assert all(not st.setup for st in stats[1:])


def test_a_layout_change_registers_again_once_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorxfer")
    small = Manifest.layout([("a", "U8", (300_000,))])
    with TensorRegion.from_manifest(manifest()) as a, TensorRegion.from_manifest(small) as b, Receiver() as rx:
        job = Background(lambda: [payload(rx.receive(timeout=60)) for _ in range(4)])
        with Sender(addr(rx), transport="rdma", stall_timeout=60) as s:
            sent = [fill(a, 1)]
            s.send(a)
            sent.append(fill(b, 2))
            st = s.send(b)
            assert st.setup and st.reallocated and st.counters["registrations"] == 2
            for seed in (3, 4):
                sent.append(fill(b, seed))
                st = s.send(b)
            assert not st.setup and st.counters["registrations"] == 2 and st.counters["updates"] == 4
        assert job.result(timeout=120) == sent
    assert any("set up again" in r.message and "layout changed" in r.message for r in caplog.records)


def test_a_short_mr_fails_with_a_completion_error_naming_loc_prot_err(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's bug on purpose, through the engine: the sender's MR covers its first chunk only."""
    from tensorxfer.errors import CompletionError
    from tensorxfer.transport import rdma_engine

    monkeypatch.setattr(rdma_engine, "_FIRST_CHUNK_ONLY", True)
    with TensorRegion.from_manifest(manifest(), chunk_size=64 * KIB) as src, Receiver(stall_timeout=10) as rx:
        job = Background(rx.receive, timeout=60)
        with Sender(addr(rx), transport="rdma", stall_timeout=10) as s:
            with pytest.raises(CompletionError, match="IBV_WC_LOC_PROT_ERR") as info:
                s.send(src)
        e = info.value
        assert e.status == "IBV_WC_LOC_PROT_ERR" and e.qp_num and e.length and e.offset is not None
        assert e.offset + e.length > 64 * KIB, "the failed request lies past the registered first chunk"
        assert not isinstance(e, PeerLost)
        with pytest.raises(Exception):   # noqa: B017  (the receiver sees the sender give up, whatever its form)
            job.result(timeout=60)
