"""Session-scoped transports and a receiver that strangers cannot block.

Register once, connect once: every transport is set up on a session's first
update and reused by the next hundred (the counters prove it), a new layout
sets it up again exactly once, and idle, trickling or scanning strangers
never hold a legitimate sender up or end ``receive()``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import tensorxfer as tx
from tensorxfer import Manifest, Receiver, Sender, TensorRegion
from tensorxfer.connections import readable_now
from tensorxfer.transport import ipc as ipc_mod
from tensorxfer.transport import tcp as tcp_mod
from tests.helpers import Background, region_of, wait_until


def addr(rx: Receiver) -> str:
    return "{}:{}".format(*rx.address)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def payload(region: TensorRegion) -> bytes:
    with memoryview(region.region) as mv:
        return bytes(mv.cast("B")[:region.nbytes])


def fill(region: TensorRegion, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, region.nbytes, dtype=np.uint8).tobytes()
    with memoryview(region.region) as mv:
        mv.cast("B")[:region.nbytes] = data
    return data


MANIFEST = Manifest.layout([(f"t{i}", "U8", (100_003 + 7919 * i,)) for i in range(20)])


# ---------------------------------------------------------------- register once, connect once
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_100_updates_set_the_transport_up_once_and_stay_flat(transport: str) -> None:
    with TensorRegion.from_manifest(MANIFEST, chunk_size=256 << 10) as src, Receiver() as rx:
        job = Background(lambda: [rx.receive(timeout=30) and rx.last_stats for _ in range(100)])
        stats = []
        with Sender(addr(rx), transport=transport, streams=3) as s:
            for k in range(100):
                if k == 10:
                    fds0, rss0 = fds(), rss()
                if k in (0, 42, 99):
                    data = fill(src, k)
                stats.append(s.send(src, verify=k in (0, 99)))
                if k in (0, 42, 99):
                    assert payload(rx.region) == data
            assert fds() <= fds0 and rss() < rss0 + (16 << 20)
        received = job.result(timeout=120)
        assert payload(rx.region) == data
    first, last = stats[0], stats[-1]
    assert first.setup and first.setup_seconds > 0 and first.update == 1
    assert all(not st.setup and st.setup_seconds == 0 for st in stats[1:])
    assert last.update == 100 and last.wire_seconds > 0 and last.wire_gbps > 0
    # ipc: the region's handles were exported (sender) and imported (receiver) once; tcp registers nothing
    registrations = 1 if transport == "ipc" else 0
    assert dict(last.counters) == {"registrations": registrations, "connects": 1, "updates": 100}
    assert dict(received[-1].counters) == {"registrations": registrations, "connects": 1, "updates": 100}


def test_a_warm_ipc_update_sends_its_data_with_the_offer_and_a_refused_one_leaves_nothing_behind() -> None:
    # A warm ipc update needs nothing from the accept: its chunk table and done frame go out right behind the
    # offer (one control round trip a step).  So while the receiver still looks at the offer (on_offer, before
    # it accepts), the done frame already waits on the control connection -- not on the first update, which
    # sets the data path up from the accept.
    done_waiting: list[bool] = []

    def look(manifest: Manifest) -> None:
        ch = rx._session.channel if rx._session is not None else None
        assert ch is not None
        if not done_waiting:
            time.sleep(0.3)
            done_waiting.append(readable_now(ch.sock))
        else:
            wait_until(lambda: readable_now(ch.sock), timeout=10, what="the done frame")
            done_waiting.append(True)
        if len(done_waiting) == 3:
            raise ValueError("not this update")

    fds0 = fds()
    with region_of(3 << 20) as a, region_of(3 << 20) as b, Receiver() as rx:
        job = Background(lambda: [payload(rx.receive(timeout=30, on_offer=look)) for _ in range(2)])
        sent = []
        with Sender(addr(rx), transport="ipc") as s:
            for seed in (1, 2):
                sent.append(fill(a, seed))
                s.send(a)
            assert job.result() == sent
            assert done_waiting == [False, True]
            # A refused warm update: its table went out with b's memory handles (a new region), unread.
            job = Background(rx.receive, timeout=30, on_offer=look)
            fill(b, 3)
            with pytest.raises(tx.ManifestError, match="not this update"):
                s.send(b)
            with pytest.raises(ValueError, match="not this update"):
                job.result()
        # The receiver ended that session (and the handles queued on it); the next sender is served as usual.
        job = Background(lambda: payload(rx.receive(timeout=30)))
        with Sender(addr(rx), transport="ipc") as s:
            st = s.send(b)
        assert job.result() == payload(b) and st.update == 1
    wait_until(lambda: fds() <= fds0, what=f"fds back to {fds0} (now {fds()})")


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_new_layout_sets_the_transport_up_again_once_and_says_so(transport: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorxfer")
    with region_of(3 << 20) as a, region_of(5 << 20, name="b") as b, Receiver() as rx:
        job = Background(lambda: [payload(rx.receive(timeout=30)) for _ in range(4)])
        sent = []
        with Sender(addr(rx), transport=transport) as s:
            for region, seed in ((a, 1), (b, 2), (b, 3), (b, 4)):
                sent.append(fill(region, seed))
                st = s.send(region)
                assert st.setup == (seed <= 2) and st.reallocated == (seed == 2)
        assert job.result() == sent
        assert st.counters["updates"] == 4
        if transport == "ipc":      # one connection; handles passed once per region
            assert dict(st.counters) == {"registrations": 2, "connects": 1, "updates": 4}
        else:                       # streams connected once per region
            assert st.counters["connects"] == 2
    assert any("set up again" in r.message and "layout changed" in r.message for r in caplog.records)


# ---------------------------------------------------------------- strangers
def _idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def test_a_sender_gets_through_200_idle_and_trickling_strangers_without_waiting_them_out() -> None:
    with region_of(1 << 20, fill=9) as src, Receiver(handshake_timeout=30) as rx:
        port = rx.address[1]
        strangers = _idle(port, 200)
        trickler = socket.create_connection(("127.0.0.1", port), timeout=5)
        trickler.sendall(struct.pack(">I", 60000))        # a frame header, then one byte at a time
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    trickler.send(b"x")
                except OSError:
                    return
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        try:
            job = Background(rx.receive, timeout=10)
            t0 = time.monotonic()
            with Sender(addr(rx)) as s:
                s.send(src)
            got = job.result()
            # well under the handshake timeout (30 s) a stranger held up would cost, with a loaded machine's slack
            assert time.monotonic() - t0 < 10.0, "strangers held a legitimate sender up"
            assert payload(got) == bytes([9]) * src.nbytes
        finally:
            stop.set()
            t.join()
            for c in [*strangers, trickler]:
                c.close()


@pytest.mark.slow
def test_a_trickling_handshake_is_cut_at_its_overall_deadline() -> None:
    with Receiver(handshake_timeout=1.0) as rx, socket.create_connection(rx.address, timeout=5) as c:
        c.sendall(struct.pack(">I", 60000))
        t0 = time.monotonic()
        with pytest.raises(tx.TransferTimeout):
            rx.receive(timeout=3)
        assert time.monotonic() - t0 < 4, "receive(timeout=3) must end near 3 s"
        dropped = False
        for _ in range(10):         # one byte every 0.3 s: each recv is quick, the handshake is not
            try:
                c.send(b"x")
            except OSError:
                dropped = True
                break
            time.sleep(0.3)
        assert dropped or c.recv(1) == b"", "the trickler must be disconnected at the handshake deadline"
        assert rx.dropped_connections == 1


def test_a_port_scan_is_counted_and_never_ends_receive() -> None:
    with region_of(1 << 20, fill=3) as src, Receiver() as rx:
        job = Background(rx.receive, timeout=10)
        for _ in range(5):
            socket.create_connection(rx.address, timeout=5).close()
        wait_until(lambda: rx.dropped_connections == 5)
        with Sender(addr(rx)) as s:
            s.send(src)
        assert payload(job.result()) == bytes([3]) * src.nbytes


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_idle_strangers_on_the_data_port_do_not_fail_the_transfer(transport: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    strangers: list[socket.socket] = []
    cls = tcp_mod.TcpReceiver if transport == "tcp" else ipc_mod.IpcReceiver
    prepare = cls.prepare

    def prepare_then_crowd(self, region, seq, fresh):  # type: ignore[no-untyped-def]
        d = prepare(self, region, seq, fresh)
        for _ in range(6):          # six idle strangers get there before the real sender
            if transport == "tcp":
                strangers.append(socket.create_connection((self.ctx.local_host, d["port"]), timeout=5))
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(d["path"])
                strangers.append(s)
        return d

    monkeypatch.setattr(cls, "prepare", prepare_then_crowd)
    try:
        with region_of(8 << 20, fill=4) as src, Receiver() as rx:
            job = Background(rx.receive, timeout=20)
            with Sender(addr(rx), transport=transport, streams=4) as s:
                t0 = time.monotonic()
                s.send(src)
                assert time.monotonic() - t0 < 4.5     # a stranger waited out would cost HEADER_TIMEOUT (5 s)
            assert payload(job.result()) == bytes([4]) * src.nbytes
    finally:
        for c in strangers:
            c.close()


# ---------------------------------------------------------------- lifetime
def test_close_from_another_thread_ends_receive_with_a_typed_error() -> None:
    rx = Receiver()
    job = Background(rx.receive)
    time.sleep(0.2)
    rx.close()
    with pytest.raises(tx.TransferError, match="closed"):
        job.result(timeout=5)
    rx.close()


def test_close_from_another_thread_during_a_session_ends_receive_with_a_typed_error() -> None:
    with region_of(1 << 20) as src:
        rx = Receiver()
        job = Background(lambda: [rx.receive(timeout=10) for _ in range(2)])
        with Sender(addr(rx)) as s:
            s.send(src)
            wait_until(lambda: rx.last_stats is not None)
            time.sleep(0.2)         # the receiver now waits for the next offer
            rx.close()
            with pytest.raises(tx.TransferError, match="closed"):
                job.result(timeout=5)


@pytest.mark.slow
def test_close_from_another_thread_ends_a_send_in_flight() -> None:
    """A Sender closed while its send() waits on the receiver (here: for the accept, while the receiver's
    on_offer takes its time) wakes at once with a typed error; closing the socket alone left the waiting
    thread blocked until the receiver answered."""
    with region_of(1 << 20) as src, Receiver(stall_timeout=2) as rx:
        offered = threading.Event()

        def slow(manifest: Manifest) -> None:
            offered.set()
            time.sleep(8)
        job = Background(rx.receive, timeout=20, on_offer=slow)
        s = Sender(addr(rx), transport="tcp")
        sending = Background(s.send, src)
        assert offered.wait(10)
        t0 = time.monotonic()
        s.close()
        with pytest.raises(tx.TransferError):      # PeerLost or TransferError: the session ended here
            sending.result(timeout=3)
        assert time.monotonic() - t0 < 3
        s.close()
        with pytest.raises(tx.PeerLost):
            job.result(timeout=20)      # the receiver finishes its on_offer and finds the sender gone


def _offer_then(rx: Receiver, then: str, **offer: object) -> None:
    """Speak as a sender: handshake, one offer of 16 bytes over tcp, then ``reset`` the connection (RST), wait
    for the ``error`` frame, or read the ``accept`` and leave without connecting any data stream."""
    from tensorxfer import protocol as P

    packed = Manifest.layout([("w", "U8", (16,))]).pack()
    sock = socket.create_connection(rx.address, timeout=10)
    with P.Channel(sock) as ch:
        P.client_handshake(ch, None, {"transports": ["tcp"]}, 10)
        ch.send("offer", **{"seq": 1, "manifest": packed, "transport": "tcp", "streams": None, "verify": False,
                            "fresh": True, **offer})
        if then == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            ch.recv(then, timeout=10)


def test_a_connection_reset_right_after_the_offer_is_peer_lost() -> None:
    """The sender's connection is reset while the receiver looks at its offer (before it sets up a transport):
    receive() raised a bare OSError (ENOTCONN from getpeername), outside its documented errors."""
    with Receiver() as rx:
        job = Background(rx.receive, timeout=10, on_offer=lambda m: time.sleep(0.3))
        _offer_then(rx, "reset")
        with pytest.raises(tx.PeerLost, match="reset"):
            job.result(timeout=10)


def test_a_sender_gone_after_accept_frees_the_receiver_at_once() -> None:
    """The sender's control connection closes after the accept, before any data stream connected: the receiver
    used to wait stall_timeout for the streams (TransferTimeout); now it notices within its 50 ms poll."""
    with Receiver(stall_timeout=20) as rx:
        job = Background(rx.receive, timeout=10)
        t0 = time.monotonic()
        _offer_then(rx, "accept")
        with pytest.raises(tx.PeerLost, match="control connection"):
            job.result(timeout=15)
        assert time.monotonic() - t0 < 3


def test_an_offer_for_too_many_streams_is_refused() -> None:
    with Receiver() as rx:
        job = Background(rx.receive, timeout=10)
        _offer_then(rx, "error", streams=1000)
        with pytest.raises(tx.ProtocolError, match="streams"):
            job.result(timeout=10)


def test_memory_a_vanished_sender_left_behind_is_released() -> None:
    """An offer allocates; the sender dies before any data: the receiver keeps nothing of it."""
    big = 64 << 20
    with region_of(big) as src, Receiver(stall_timeout=2) as rx:
        job = Background(rx.receive, timeout=20)
        s = Sender(addr(rx), transport="tcp", stall_timeout=2)

        def vanish(self, region, progress=None):  # type: ignore[no-untyped-def]
            s._channel.close()      # the control connection drops mid-transfer (the process died)
            raise tx.PeerLost("gone")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tcp_mod.TcpSender, "send", vanish)
            with pytest.raises(tx.TransferError):
                s.send(src)
        s.close()
        with pytest.raises(tx.TransferError):
            job.result()
        assert rx.region is None, "the region allocated for the vanished sender's offer must be released"


# ---------------------------------------------------------------- the receiver's own work
@pytest.mark.slow
def test_a_long_on_landed_keeps_the_sender_waiting_and_a_stalled_one_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorxfer.session import control

    monkeypatch.setattr(control, "CONTROL_TIMEOUT", 1.0)
    monkeypatch.setattr(control, "KEEPALIVE_SECONDS", 0.1)
    with region_of(1 << 20) as src, Receiver() as rx:
        job = Background(rx.receive, timeout=10, on_landed=lambda r: time.sleep(3.0))   # 3x the ack timeout
        with Sender(addr(rx), transport="tcp", stall_timeout=1.0) as s:
            assert s.send(src).bytes == src.nbytes
        job.result()
        monkeypatch.setattr(control, "KEEPALIVE_SECONDS", 5.0)      # a receiver that goes quiet
        job = Background(rx.receive, timeout=10, on_landed=lambda r: time.sleep(3.0))
        with Sender(addr(rx), transport="tcp", stall_timeout=1.0) as s, pytest.raises(tx.TransferTimeout):
            s.send(src)
        job.thread.join(10)     # its ack may or may not reach the closed sender: either way it ends
        assert not job.thread.is_alive(), "the receiver kept working after its sender gave up"


def test_an_on_offer_refusal_reaches_the_sender() -> None:
    def refuse(manifest: Manifest) -> None:
        raise ValueError("no room for this layout")

    with region_of(1 << 20) as src, Receiver() as rx:
        job = Background(rx.receive, timeout=10, on_offer=refuse)
        with Sender(addr(rx)) as s, pytest.raises(tx.ManifestError, match="no room for this layout"):
            s.send(src)
        with pytest.raises(ValueError):
            job.result()


def test_an_idle_token_less_session_yields_to_a_waiting_sender() -> None:
    """Without a token anyone can say hello: an idle session must not lock the receiver for good."""
    from tensorxfer.protocol import Channel, client_handshake

    with region_of(1 << 20, fill=6) as src, Receiver(handshake_timeout=1.0) as rx:
        job = Background(rx.receive, timeout=20)
        idle = Channel(socket.create_connection(rx.address, timeout=5))
        try:
            client_handshake(idle, None, {"transports": ["tcp"]}, 5)     # then says nothing, ever
            time.sleep(0.3)                 # the receiver now serves the idle session
            t0 = time.monotonic()
            with Sender(addr(rx), transport="tcp") as s:
                s.send(src)
            assert payload(job.result()) == bytes([6]) * src.nbytes
            assert time.monotonic() - t0 < 4, "the idle session must yield within about handshake_timeout"
        finally:
            idle.close()


@pytest.mark.slow
def test_a_single_idle_sender_is_never_cut_off() -> None:
    """A trainer between steps keeps its session as long as nobody else waits."""
    with region_of(1 << 20) as src, Receiver(handshake_timeout=0.3) as rx:
        job = Background(lambda: [rx.receive(timeout=10) for _ in range(2)])
        with Sender(addr(rx), transport="tcp") as s:
            first = s.send(src)
            time.sleep(1.5)                 # five times handshake_timeout
            second = s.send(src)
        job.result()
        assert first.setup and not second.setup and second.counters["connects"] == 1


def test_more_strangers_than_the_pending_limit_do_not_lock_out_a_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorxfer import connections

    monkeypatch.setattr(connections, "DEFAULT_MAX_PENDING", 20)
    with region_of(1 << 20, fill=8) as src, Receiver(handshake_timeout=30) as rx:
        job = Background(rx.receive, timeout=15)
        strangers = _idle(rx.address[1], 40)
        try:
            time.sleep(0.5)
            with Sender(addr(rx), transport="tcp") as s:
                s.send(src)
            assert payload(job.result()) == bytes([8]) * src.nbytes
            assert rx.dropped_connections >= 20
        finally:
            for c in strangers:
                c.close()


@pytest.mark.parametrize("how", ["goodbye", "killed"])
@pytest.mark.slow
def test_a_receive_that_times_out_after_a_sender_came_and_went_says_so(how: str) -> None:
    """Not "no sender connected": one did, and left before it offered (its side failed, or it was stopped)."""
    with Receiver() as rx:
        if how == "goodbye":
            got = Background(rx.receive, timeout=2)
            s = Sender("{}:{}".format(*rx.address))
            time.sleep(0.3)
            s.close()
        else:       # a sender process SIGKILLed after its handshake: the connection just drops
            code = ("import os, signal, sys, time, tensorxfer as tx\n"
                    "print('ready', flush=True); sys.stdin.readline()\n"
                    "s = tx.Sender(sys.argv[1]); time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)\n")
            child = subprocess.Popen([sys.executable, "-c", code, "{}:{}".format(*rx.address)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert child.stdout is not None and child.stdin is not None
                assert child.stdout.readline().strip() == "ready"      # started and imported: no part of 2 s
                got = Background(rx.receive, timeout=2)
                child.stdin.write("go\n")
                child.stdin.flush()
                child.wait(30)
            finally:
                child.kill()
                child.communicate()
        with pytest.raises(tx.TransferTimeout, match=r"connected and (said goodbye|left) without an offer"):
            got.result()


@pytest.mark.parametrize("make, name", [
    (lambda: tx.Receiver(stall_timeout=-1), "stall_timeout"),
    (lambda: tx.Receiver(handshake_timeout=0), "handshake_timeout"),
    (lambda: tx.Sender("127.0.0.1:1", stall_timeout=float("nan")), "stall_timeout"),
    (lambda: tx.Sender("127.0.0.1:1", connect_timeout=0), "connect_timeout"),
])
def test_a_timeout_that_is_not_seconds_above_zero_is_refused_before_anything_opens(make, name) -> None:
    """A zero, negative or NaN timeout ended every wait at once, reported as a peer that stalled (a Receiver
    took one; a Sender went on connecting): refused in the constructor, named."""
    with pytest.raises(ValueError, match=f"^{name} is seconds > 0"):
        make()
