"""The ipc transport between real processes: copy and share modes, uid and key checks, auto choice, CUDA.

Senders run in child processes (``python -c``), so fds really cross a
process boundary with SCM_RIGHTS; each child reports its own leftover
tensorxfer fds, and the autouse fixture checks this process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorxfer as tx
from tensorxfer import HostRegion, Manifest, Receiver, Sender, TensorRegion
from tensorxfer.transport import ipc
from tensorxfer.transport.base import TransferContext

from .helpers import GPU_REASON, ROOT, Background, child, finish, needs_gpu, region_of, wait_until

SENDER = r"""
import hashlib, json, os, sys
import numpy as np
from tensorxfer import Sender, TensorRegion

addr, nbytes, chunk, device, transport, seed = sys.argv[1:7]
nbytes, chunk, seed = int(nbytes), int(chunk) or None, int(seed)

def model(seed):
    rng = np.random.default_rng(seed)
    return {"bytes": rng.integers(0, 256, nbytes, dtype=np.uint8),
            "f32": rng.standard_normal(1001).astype(np.float32), "tiny": np.arange(3, dtype=np.int16)}

def sha(r):
    if r.is_cuda:
        t = r.tensors("torch")
        data = b"".join(t[k].cpu().numpy().tobytes() for k in sorted(t))
    else:
        t = r.tensors()
        data = b"".join(t[k].tobytes() for k in sorted(t))
    del t
    return hashlib.sha256(data).hexdigest()

def fds():
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.startswith(("/memfd:tensorxfer", "socket:", "anon_inode:dmabuf", "/dmabuf:")):
            out.append(target)
    return out

if device != "cpu":      # the CUDA driver and runtime keep sockets of their own from init on
    import torch
    torch.cuda.init()
baseline = set(fds())
region = TensorRegion.from_tensors(model(seed), device=device, chunk_size=chunk)
with Sender(addr, transport=transport) as s:
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "send":
            st = s.send(region, verify=not region.is_cuda)
            print(json.dumps({"sha": sha(region), "transport": st.transport, "bytes": st.bytes}), flush=True)
        elif cmd == "update":
            seed += 1
            region.update_from(model(seed))
            print(json.dumps({"sha": sha(region)}), flush=True)
        elif cmd == "renew":            # free the region, build a new one (new memory, same layout)
            region.close()
            seed += 1
            region = TensorRegion.from_tensors(model(seed), device=device, chunk_size=chunk)
            print(json.dumps({"sha": sha(region)}), flush=True)
        elif cmd == "exit":
            break
region.close()
print(json.dumps({"fds_left": [f for f in fds() if f not in baseline]}), flush=True)
"""


class Peer:
    """A sender child process driven line by line over stdin/stdout."""

    def __init__(self, address: tuple[str, int], nbytes: int = 8 << 20, chunk: int = 0, device: str = "cpu",
                 transport: str = "auto", seed: int = 1, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SENDER, "{}:{}".format(*address), str(nbytes), str(chunk), device, transport,
             str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"sender child died: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return json.loads(line)

    def finish(self) -> dict:
        out = self.ask("exit")
        assert self.proc.wait(timeout=30) == 0
        self.close()
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def digest(region: TensorRegion) -> str:
    t = region.tensors()
    data = b"".join(t[k].tobytes() for k in sorted(t))
    del t
    return hashlib.sha256(data).hexdigest()


def addr(rx: Receiver) -> str:
    return "{}:{}".format(*rx.address)


# ---------------------------------------------------------------- copy mode
@pytest.mark.parametrize("chunk", [0, 1 << 16], ids=["default-chunks", "600-chunks"])
@pytest.mark.slow
def test_copy_between_processes_is_byte_exact_and_leaves_no_fds(chunk):
    # 1<<16 chunks: ~600 memfds, more than one SCM_RIGHTS batch, laid out unlike the receiver's chunks
    with Receiver() as rx:
        peer = Peer(rx.address, nbytes=(37 << 20) + 123, chunk=chunk)
        try:
            for step in range(3):
                job = Background(rx.receive, timeout=30)
                if step:
                    peer.ask("update")
                sent = peer.ask("send")
                got = job.result()
                assert sent["transport"] == "ipc" and rx.last_stats is not None and rx.last_stats.transport == "ipc"
                assert digest(got) == sent["sha"] and sent["bytes"] == got.nbytes
                assert not got.region.readonly, "copy mode lands in the receiver's own, writable region"
                del got
            assert peer.finish() == {"fds_left": []}
        finally:
            peer.close()


@pytest.mark.slow
def test_copy_ignores_later_sender_writes_and_the_sender_may_free_after_send():
    with Receiver() as rx:
        peer = Peer(rx.address)
        try:
            job = Background(rx.receive, timeout=30)
            sent = peer.ask("send")
            got = job.result()
            peer.ask("update")
            assert peer.finish() == {"fds_left": []}     # the sender closed (freed) its region
            assert digest(got) == sent["sha"]
            del got
        finally:
            peer.close()


# ---------------------------------------------------------------- share mode
@pytest.mark.slow
def test_share_maps_the_senders_memory_read_only_and_sees_updates_in_place():
    with Receiver(share=True) as rx:
        peer = Peer(rx.address, nbytes=16 << 20)
        try:
            job = Background(rx.receive, timeout=30)
            sent = peer.ask("send")
            got = job.result()
            assert digest(got) == sent["sha"] and got.region.readonly
            view = got.tensors()["bytes"]
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view[0] = 1
            del view
            with memoryview(got.region) as mv:
                assert mv.readonly
            updated = peer.ask("update")          # the trainer writes its next step in place
            assert digest(got) == updated["sha"]
            # sending the same memory again maps nothing new: the receiver gets the same region back
            job = Background(rx.receive, timeout=30)
            assert peer.ask("send")["sha"] == updated["sha"]
            assert job.result() is got and not got.closed
            assert rx.last_stats is not None and not rx.last_stats.reallocated
            # new memory on the sender (same layout): a new mapping, the old region is released
            renewed = peer.ask("renew")
            job = Background(rx.receive, timeout=30)
            assert peer.ask("send")["sha"] == renewed["sha"]
            second = job.result()
            assert second is not got and got.closed and digest(second) == renewed["sha"]
            assert rx.last_stats is not None and rx.last_stats.reallocated
            assert peer.finish() == {"fds_left": []}
            assert digest(second) == renewed["sha"], "the mapping keeps the memory alive after the sender freed it"
            del got, second
        finally:
            peer.close()
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if "memfd:tensorxfer" in line]


@pytest.mark.slow
def test_share_refuses_a_forced_tcp_sender():
    with Receiver(share=True) as rx:
        job = Background(rx.receive, timeout=3)
        with pytest.raises(tx.TransportUnavailable, match="does not support"):
            Sender(addr(rx), transport="tcp")
        with Sender(addr(rx)) as s:
            assert s.transport == "ipc"
        with pytest.raises(tx.TransferTimeout):
            job.result()


# ---------------------------------------------------------------- peer checks
def _receiver_transport(key: bytes = b"k" * 32, stall: float = 10.0) -> ipc.IpcReceiver:
    ctx = TransferContext(local_host="", peer_host="", session_key=key, stall_timeout=stall)
    return ipc.IpcReceiver(ctx)


def _sender_transport(key: bytes = b"k" * 32, stall: float = 10.0) -> ipc.IpcSender:
    ctx = TransferContext(local_host="", peer_host="", session_key=key, stall_timeout=stall)
    return ipc.IpcSender(ctx)


FOREIGN = r"""
import os, socket, struct, sys
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    s.sendall(struct.pack(">4sQ32s", b"TXI1", 1, bytes(32)))
except OSError:
    pass    # the receiver may refuse (and close) before reading anything
print(s.recv(4096).decode(errors="replace"))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a child as another uid")
def test_a_process_of_another_uid_is_refused_and_the_real_sender_still_gets_through():
    with region_of(3 << 20, fill=5) as src, region_of(3 << 20) as dst, _receiver_transport() as rt:
        d = rt.prepare(dst, 1, True)
        assert stat.S_IMODE(os.stat(os.path.dirname(d["path"])).st_mode) == 0o700
        # open the private directory so that SO_PEERCRED, not the file system, has to refuse the stranger
        os.chmod(os.path.dirname(d["path"]), 0o755)
        os.chmod(d["path"], 0o777)
        job = Background(rt.wait)
        rc, out, err = finish(child(FOREIGN, d["path"]), timeout=20)
        assert rc == 0, err
        assert out.startswith("E") and "uid 65534" in out and f"uid {os.getuid()}" in out
        with _sender_transport() as st:
            st.connect(src, 1, d)
            assert st.send(src) == src.nbytes
        assert job.result() == src.nbytes
        assert bytes(memoryview(dst.region)[:16]) == bytes([5]) * 16


def test_check_peer_accepts_our_own_uid():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        assert ipc.check_peer(a) == os.getpid()
        assert ipc.peer_credentials(b)[1] == os.getuid()


def test_wrong_session_key_is_refused_with_a_clear_error():
    with region_of(1 << 20) as src, region_of(1 << 20) as dst, _receiver_transport() as rt:
        d = rt.prepare(dst, 1, True)
        job = Background(rt.wait)
        with _sender_transport(b"x" * 32) as bad, pytest.raises(tx.AuthError, match="authentication"):
            bad.connect(src, 1, d)
        with _sender_transport() as good:
            good.connect(src, 1, d)
            good.send(src)
        assert job.result() == src.nbytes


def _memfd(size: int) -> int:
    fd = os.memfd_create("tensorxfer-test")
    os.ftruncate(fd, size)
    return fd


def _send_raw(dst_nbytes: int, count: int, chunks: list, sizes: list[int]) -> tuple[bytes, bytes]:
    """Start a receiving transport, send a hand-made chunk table and one handle message; return the answers."""
    import msgpack

    with region_of(dst_nbytes) as dst, _receiver_transport() as rt:
        d = rt.prepare(dst, 1, True)
        job = Background(rt.wait)
        fds = [_memfd(n) for n in sizes]
        try:
            with _sender_transport() as st:
                st.connect(dst, 1, d)
                assert st._sock is not None
                st._sock.sendall(msgpack.packb({"kind": "host", "device": 0, "nbytes": dst.nbytes,
                                                "token": bytes(16), "count": count, "cached": False,
                                                "seq": 1}))
                socket.send_fds(st._sock, [b"F" + msgpack.packb(chunks)], fds)
                answer = st._sock.recv(4096)     # refused before anything is mapped
        finally:
            for fd in fds:
                os.close(fd)
        try:
            job.result()
        except tx.ProtocolError as e:
            return answer, str(e).encode()
        raise AssertionError("the receiver accepted a hostile chunk table")


def test_chunk_table_that_does_not_tile_the_payload_is_a_protocol_error():
    answer, error = _send_raw(1 << 20, 2, [[0, 4096], [8192, 4096]], [4096, 4096])
    assert answer.startswith(b"E") and b"tiling" in answer and b"tiling" in error


def test_handle_message_whose_fd_count_differs_from_its_chunks_is_a_protocol_error():
    answer, error = _send_raw(1 << 20, 2, [[0, 1 << 19]], [1 << 19, 1 << 19])
    assert answer.startswith(b"E") and b"carries 2 fds" in error


def test_a_memfd_shorter_than_its_chunk_is_refused_before_mapping():
    answer, error = _send_raw(1 << 20, 1, [[0, 1 << 20]], [4096])
    assert answer.startswith(b"E") and b"less than its 1048576-byte chunk" in error


def test_an_unsealed_memfd_is_refused_before_mapping():
    """A sender could truncate an unsealed memfd during the copy and kill the receiver with SIGBUS."""
    answer, error = _send_raw(1 << 20, 1, [[0, 1 << 20]], [1 << 20])
    assert answer.startswith(b"E") and b"F_SEAL_SHRINK" in error


def test_a_chunk_far_larger_than_the_payload_is_refused_before_mapping():
    """A small update must not make the receiver map and populate a huge (sparse) file."""
    answer, error = _send_raw(1 << 20, 1, [[0, 1 << 30]], [1 << 30])
    assert answer.startswith(b"E") and b"end by 2097152" in error


def test_a_sender_that_stalls_after_authenticating_times_out_the_receiver():
    ctx = TransferContext(local_host="", peer_host="", session_key=b"k" * 32, stall_timeout=1.0)
    with region_of(1 << 20) as dst, ipc.IpcReceiver(ctx) as rt:
        d = rt.prepare(dst, 1, True)
        job = Background(rt.wait)
        with _sender_transport() as st:
            st.connect(dst, 1, d)           # authenticated, then passes nothing
            with pytest.raises(tx.TransferTimeout, match="chunk table"):
                job.result(timeout=10)


@pytest.mark.slow
def test_a_sender_killed_between_updates_ends_its_session_cleanly():
    """The receiver keeps the last copy, drops the session's cached mapping, and waits for the next sender."""
    with Receiver(stall_timeout=5) as rx:
        peer = Peer(rx.address, nbytes=8 << 20)
        try:
            job = Background(rx.receive, timeout=30)
            sent = peer.ask("send")
            assert digest(job.result()) == sent["sha"]
            job = Background(rx.receive, timeout=3)
            peer.proc.kill()
            peer.proc.wait()
            with pytest.raises(tx.TransferTimeout):
                job.result()                # the session ended; nobody else connected
        finally:
            peer.close()


def test_adopted_memory_has_no_handles_and_says_so():
    buf = bytearray(8192)
    region = TensorRegion(HostRegion.adopt(buf), Manifest.layout([("x", "U8", (8192,))]))
    try:
        with Receiver() as rx:
            job = Background(rx.receive, timeout=10)
            with Sender(addr(rx), transport="ipc") as s, pytest.raises(tx.TransportUnavailable, match="adopted"):
                s.send(region)
            with pytest.raises(tx.PeerLost):       # the sender gave up after its offer: its session is gone
                job.result()
    finally:
        region.close()


def test_close_is_idempotent_and_removes_the_private_directory():
    with region_of(1 << 20) as dst:
        rt = _receiver_transport()
        d = rt.prepare(dst, 1, True)
        assert os.path.exists(d["path"])
        rt.close()
        rt.close()
        assert not os.path.exists(os.path.dirname(d["path"]))
        st = _sender_transport()
        st.close()
        st.close()


def test_close_from_another_thread_aborts_a_waiting_receiver():
    with region_of(1 << 20) as dst:
        rt = _receiver_transport()
        rt.prepare(dst, 1, True)
        job = Background(rt.wait)
        threading.Timer(0.3, rt.close).start()
        with pytest.raises(tx.TransferError):
            job.result(timeout=5)


# ---------------------------------------------------------------- relayed updates: the sender's watermark
def _filled(nbytes: int, seed: int = 7) -> TensorRegion:
    region = region_of(nbytes)
    np.frombuffer(region.region, dtype=np.uint8, count=nbytes)[:] = \
        np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return region


def _bytes(region: TensorRegion) -> bytes:
    with memoryview(region.region) as mv:
        return bytes(mv[:region.nbytes])


class _Relay:
    """A sender transport relaying ``src`` (its ``landing`` follows a :class:`Landed`) to a receiver transport
    copying into ``dst``, each in a thread; ``copied`` lists the pieces the receiver reported as landed."""

    def __init__(self, src: TensorRegion, dst: TensorRegion, stall: float = 10.0) -> None:
        from tensorxfer.fanout import Landed

        self.landed = Landed(src.nbytes, stall_timeout=60.0)
        self.asked = threading.Event()          # the forwarder runs: header and handles went out
        self.copied: list[tuple[int, int]] = []
        self.rt = _receiver_transport(stall=stall)
        self.st = _sender_transport(stall=stall)
        self.rt.on_piece = lambda off, n: self.copied.append((off, n))
        self.st.landing = self
        d = self.rt.prepare(dst, 1, True)
        self.received = Background(self.rt.wait)
        self.st.connect(src, 1, d)
        assert d["watermark"] is True
        self.sent = Background(self.st.send, src)

    def wait_prefix(self, offset: int) -> int:       # the sender's Landing (a relay's own copy)
        self.asked.set()
        return self.landed.wait_prefix(offset)

    def wait_range(self, offset: int, length: int) -> None:
        self.landed.wait_range(offset, length)

    def close(self) -> None:
        self.landed.abort("test over")          # releases a forwarder still waiting
        self.st.close()
        self.rt.close()


def test_a_relayed_copy_takes_only_what_the_watermark_allows_and_lands_byte_exact():
    piece = ipc.RELAY_PIECE_BYTES
    with _filled(4 * piece + 4096) as src, region_of(src.nbytes) as dst:
        relay = _Relay(src, dst)
        try:
            relay.landed.add(0, piece + 100)            # the relay's own copy is 1 piece (and a bit) in
            wait_until(lambda: len(relay.copied) == 1, what="the first piece copied")
            time.sleep(0.3)
            assert relay.copied == [(0, piece)], "the receiver copied past the sender's watermark"
            relay.landed.add(3 * piece, src.nbytes - 3 * piece)    # out of order: nothing new contiguous
            time.sleep(0.3)
            assert len(relay.copied) == 1
            relay.landed.add(piece + 100, 2 * piece - 100)
            assert relay.received.result() == src.nbytes and relay.sent.result() == src.nbytes
            assert sorted(relay.copied) == [(k * piece, min(piece, src.nbytes - k * piece)) for k in range(5)]
            assert _bytes(dst) == _bytes(src)
        finally:
            relay.close()


def test_a_watermark_that_never_advances_times_out_the_receiver():
    with _filled(1 << 20) as src, region_of(1 << 20) as dst:
        relay = _Relay(src, dst, stall=1.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(tx.TransferTimeout, match=r"did not advance for 1\.0 s"):
                relay.received.result(timeout=10)
            assert time.monotonic() - t0 < 5
            with pytest.raises(tx.TransferError, match="did not advance"):
                relay.sent.result(timeout=10)      # the receiver said why; the sender does not hang either
            assert relay.copied == []
        finally:
            relay.close()


@pytest.mark.parametrize("marks, why", [([(2 << 20) + 1], "up to the payload"),
                                        ([1 << 20, 1 << 19], "must grow"),
                                        ([1 << 20, 1 << 20], "must grow"),
                                        ([b"X"], "unexpected message")],
                         ids=["past-the-payload", "backwards", "standing-still", "not-a-watermark"])
def test_a_hostile_watermark_is_a_protocol_error(marks, why):
    with _filled(2 << 20) as src, region_of(2 << 20) as dst:
        relay = _Relay(src, dst)
        try:
            assert relay.asked.wait(10)
            assert relay.st._sock is not None
            for mark in marks:
                relay.st._sock.send(mark if isinstance(mark, bytes) else b"W" + struct.pack(">Q", mark))
            with pytest.raises(tx.ProtocolError, match=why):
                relay.received.result(timeout=10)
            with pytest.raises(tx.TransferError, match=why):
                relay.sent.result(timeout=10)
        finally:
            relay.close()


def test_a_chunk_table_saying_more_is_ready_than_the_payload_is_a_protocol_error():
    import msgpack

    table = {"kind": "host", "device": 0, "nbytes": 100, "token": bytes(16), "count": 1, "cached": False,
             "seq": 1}
    assert ipc.messages.parse_header(msgpack.packb(table))[-1] == 100        # no "ready": everything is
    for ready in (101, -1):
        with pytest.raises(tx.ProtocolError, match="ready"):
            ipc.messages.parse_header(msgpack.packb(dict(table, ready=ready)))


def test_an_upstream_failure_stops_the_forward_and_tells_the_receiver():
    piece = ipc.RELAY_PIECE_BYTES
    with _filled(2 * piece) as src, region_of(2 * piece) as dst:
        relay = _Relay(src, dst)
        try:
            relay.landed.add(0, piece)
            wait_until(lambda: len(relay.copied) == 1, what="the first piece copied")
            relay.landed.abort("the upstream sender died")
            with pytest.raises(tx.TransferError, match=r"gave up on this update.*upstream sender died"):
                relay.received.result(timeout=10)
            with pytest.raises(tx.UpstreamFailed, match="upstream sender died"):
                relay.sent.result(timeout=10)
        finally:
            relay.close()


def test_device_pieces_are_reported_once_the_stream_finished_them():
    """A relay's device copies: piece k is reported after its stream mark was waited for, which happens only
    once piece k+1 was queued behind it (the copy engine never idles between pieces).  A fake copier stands
    in for the GPU (the real one runs in tests/test_fanout.py's GPU test)."""
    calls: list[tuple] = []

    class FakeCopier:
        def mark(self, i: int) -> None:
            calls.append(("mark", i))

        def wait_mark(self, i: int) -> None:
            calls.append(("wait", i))

    marks = ipc.copy.LandedMarks(FakeCopier(), lambda off, n: calls.append(("landed", off, n)))
    for k in range(3):
        calls.append(("queued", k))
        marks.queued(k * 10, 10)
    marks.finish()
    marks.finish()                          # nothing pending: nothing happens
    assert calls == [("queued", 0), ("mark", 0),
                     ("queued", 1), ("mark", 1), ("wait", 0), ("landed", 0, 10),
                     ("queued", 2), ("mark", 0), ("wait", 1), ("landed", 10, 10),
                     ("wait", 0), ("landed", 20, 10)]


# ---------------------------------------------------------------- auto choice
RECEIVER_CHILD = r"""
import sys
import tensorxfer.transport.ipc as ipc
if sys.argv[1] != "-":
    ipc.identity.BOOT_ID_PATH = sys.argv[1]     # pretend to be another machine
from tensorxfer import Receiver
with Receiver() as rx:
    print("{}:{}".format(*rx.address), flush=True)
    r = rx.receive(timeout=20)
    print(r.nbytes, rx.last_stats.transport, flush=True)
"""


def _receiver_child(boot_id_file: str = "-", env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER_CHILD, boot_id_file], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(proc.stderr.read() if proc.stderr else "receiver child died")
    return proc, line


def test_auto_picks_ipc_on_one_host(caplog):
    caplog.set_level(logging.INFO, logger="tensorxfer")
    proc, where = _receiver_child()
    try:
        with region_of(2 << 20) as r, Sender(where) as s:
            assert s.transport == "ipc"
            s.send(r)
        rc, out, err = finish(proc)
        assert rc == 0, err
        assert out.split() == [str(2 << 20), "ipc"]
    finally:
        proc.kill()
        finish(proc)
    assert any("chose 'ipc'" in rec.message and rec.levelno == logging.INFO for rec in caplog.records)


def test_disabled_ipc_makes_auto_pick_tcp_and_say_why(caplog):
    caplog.set_level(logging.INFO, logger="tensorxfer")
    proc, where = _receiver_child(env={ipc.DISABLE_ENV: "1"})
    try:
        with pytest.raises(tx.TransportUnavailable, match="does not support"):
            Sender(where, transport="ipc")
        with region_of(2 << 20) as r, Sender(where) as s:
            assert s.transport == "tcp"
            s.send(r)
        rc, out, err = finish(proc)
        assert rc == 0, err
        assert out.split() == [str(2 << 20), "tcp"]
    finally:
        proc.kill()
        finish(proc)
    warnings = [rec.message for rec in caplog.records if rec.levelno == logging.WARNING]
    assert any("'ipc' not usable" in m and "receiver does not offer it" in m for m in warnings)
    assert any("chose 'tcp'" in rec.message for rec in caplog.records)


def test_disabled_ipc_on_this_side_is_reported(monkeypatch):
    monkeypatch.setenv(ipc.DISABLE_ENV, "1")
    with pytest.raises(tx.TransportUnavailable, match="TENSORXFER_DISABLE_IPC"):
        Sender("127.0.0.1:1", transport="ipc")


def test_forced_ipc_to_another_machine_is_unavailable_and_auto_uses_tcp(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorxfer")
    fake = tmp_path / "boot_id"
    fake.write_text("00000000-0000-0000-0000-000000000000\n")
    proc, where = _receiver_child(str(fake))
    try:
        with pytest.raises(tx.TransportUnavailable, match="another machine"):
            Sender(where, transport="ipc")
        with region_of(1 << 20) as r, Sender(where) as s:
            assert s.transport == "tcp"
            s.send(r)
        rc, out, err = finish(proc)
        assert rc == 0, err
        assert out.split() == [str(1 << 20), "tcp"]
    finally:
        proc.kill()
        finish(proc)
    assert any(rec.levelno == logging.WARNING and "boot id differs" in rec.message for rec in caplog.records)


def test_identity_mismatch_names_what_differs():
    mine = ipc.host_identity()
    assert ipc.identity_mismatch(mine) is None
    assert "another user" in (ipc.identity_mismatch(dict(mine, uid=mine["uid"] + 1)) or "")
    assert "hostname" in (ipc.identity_mismatch(dict(mine, hostname="elsewhere")) or "")
    assert "container" in (ipc.identity_mismatch(dict(mine, mnt_ns="mnt:[1]")) or "")
    assert "did not advertise" in (ipc.identity_mismatch(None) or "")


# ---------------------------------------------------------------- CUDA


def _cuda_digest(region: TensorRegion) -> str:
    t = region.tensors("torch")
    data = b"".join(t[k].cpu().numpy().tobytes() for k in sorted(t))
    del t
    return hashlib.sha256(data).hexdigest()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("receiver_device, share", [("cuda:0", False), ("cpu", False), ("cuda:0", True)],
                         ids=["dtod-copy", "dtoh-copy", "share"])
def test_cuda_ipc_between_processes(receiver_device, share):
    pytest.importorskip("torch")
    with Receiver(device=receiver_device, share=share) as rx:
        # 2 MiB VMM chunks: a ~70 MiB region is ~35 handles, each passed as its own POSIX fd
        peer = Peer(rx.address, nbytes=(70 << 20) + 5, chunk=2 << 20, device="cuda:0", transport="ipc")
        try:
            for step in range(2):
                job = Background(rx.receive, timeout=60)
                if step:
                    peer.ask("update")
                sent = peer.ask("send")
                got = job.result(timeout=60)
                assert sent["transport"] == "ipc"
                if receiver_device == "cpu":
                    assert not got.is_cuda and digest(got) == sent["sha"]
                else:
                    assert got.is_cuda and _cuda_digest(got) == sent["sha"]
                if share:
                    updated = peer.ask("update")
                    assert _cuda_digest(got) == updated["sha"], "shared memory shows the sender's writes"
                del got
            assert peer.finish() == {"fds_left": []}
        finally:
            peer.close()


@pytest.mark.cuda
@needs_gpu
def test_cuda_handles_are_released_after_copy():
    """After many copies the receiver holds no imported mapping: device memory use returns to the baseline."""
    from tensorxfer.memory import _cuda

    pytest.importorskip("torch")
    import torch

    torch.cuda.init()
    free0 = torch.cuda.mem_get_info(0)[0]
    with Receiver(device="cuda:0") as rx:
        peer = Peer(rx.address, nbytes=256 << 20, chunk=0, device="cuda:0", transport="ipc")
        try:
            for _ in range(4):
                job = Background(rx.receive, timeout=60)
                peer.ask("send")
                got = job.result(timeout=60)
                del got
            assert peer.finish() == {"fds_left": []}
        finally:
            peer.close()
    rx_region_gone = torch.cuda.mem_get_info(0)[0]
    # sender exited and the receiver closed its region: nothing of either may stay mapped
    assert rx_region_gone >= free0 - (64 << 20), (free0, rx_region_gone)
    assert _cuda.device_count() > 0


@pytest.mark.cuda
@needs_gpu
def test_copier_marks_wait_for_the_work_queued_before_them():
    """The stream marks an ipc relay reports device pieces with (``Copier.mark`` / ``wait_mark``)."""
    from tensorxfer.memory import CudaRegion
    from tensorxfer.memory._copy import Copier
    from tensorxfer.staging import dtoh

    assert CudaRegion is not None
    n = 64 << 20
    with CudaRegion.allocate(n) as a, CudaRegion.allocate(n) as b:
        copier = Copier(0)
        try:
            with pytest.raises(ValueError, match="never recorded"):
                copier.wait_mark(0)
            with pytest.raises(ValueError, match="out of range"):
                copier.mark(2)
            for slot, value in enumerate((7, 9, 11)):
                copier.memset(a.ptr, n, value)
                copier.dtod(b.ptr, a.ptr, n)
                copier.mark(slot & 1)           # both slots; slot 0 is recorded again in the third round
                copier.wait_mark(slot & 1)
                host = np.empty(n, dtype=np.uint8)
                dtoh(copier, host, b.ptr)
                assert (host == value).all()
        finally:
            copier.close()
            copier.close()
        with pytest.raises(ValueError, match="closed"):
            copier.mark(0)


def test_the_auth_message_is_laid_out_as_the_protocol_doc_says():
    # "TXI1" u64be(seq) proof(32): magic at 0, the update number big-endian at 4, the proof at 12
    data = ipc.messages.AUTH.pack(ipc.messages.AUTH_MAGIC, 0x0102030405060708, bytes(range(32)))
    assert len(data) == 44 and data[:4] == b"TXI1"
    assert data[4:12] == bytes([1, 2, 3, 4, 5, 6, 7, 8]) and data[12:] == bytes(range(32))
    assert ipc.messages.U64.pack(9) == struct.pack(">Q", 9)


def test_host_region_import_fds_maps_read_only_and_rolls_back_on_a_bad_fd():
    with HostRegion.allocate(3 << 16, chunk_size=1 << 16) as owner:
        with memoryview(owner) as mv:
            mv[:4] = b"abcd"
            mv[1 << 16:(1 << 16) + 4] = b"efgh"
        handles = [(size, fd) for _, size, fd in owner.chunks]
        with HostRegion.import_fds(handles) as imported:
            assert imported.readonly and imported.size == 3 << 16 and len(imported.chunks) == 3
            with memoryview(imported) as view:
                assert view.readonly and bytes(view[:4]) == b"abcd"
                assert bytes(view[1 << 16:(1 << 16) + 4]) == b"efgh"
            with memoryview(imported) as view, pytest.raises(TypeError, match="read-only"):
                view[0:1] = b"x"
        r, w = os.pipe()
        try:
            with pytest.raises(tx.RegionError):
                HostRegion.import_fds([handles[0], (1 << 16, r)])
        finally:
            os.close(r)
            os.close(w)
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if "memfd:tensorxfer" in line]


def _two_gpus_reason() -> str | None:
    reason = GPU_REASON
    if reason is not None:
        return reason
    from tensorxfer.memory import _cuda

    n = _cuda.device_count()
    return None if n >= 2 else f"needs 2 GPUs, {n} visible"


@pytest.mark.cuda
@pytest.mark.skipif(_two_gpus_reason() is not None, reason=f"cross-GPU ipc: {_two_gpus_reason()}")
@pytest.mark.parametrize("share", [False, True], ids=["p2p-copy", "p2p-share"])
def test_cuda_ipc_from_gpu0_to_a_receiver_on_gpu1(share):
    # The receiver imports GPU 0's handles, maps them in its own address space
    # with access granted to GPU 1 (cuMemSetAccess), and copies GPU 0 -> GPU 1
    # over NVLink/P2P (or shares the mapping).
    torch = pytest.importorskip("torch")
    with Receiver(device="cuda:1", share=share) as rx:
        peer = Peer(rx.address, nbytes=(70 << 20) + 5, chunk=2 << 20, device="cuda:0", transport="ipc")
        try:
            job = Background(rx.receive, timeout=60)
            sent = peer.ask("send")
            got = job.result(timeout=60)
            assert sent["transport"] == "ipc" and got.is_cuda
            assert got.device == "cuda:1" and _cuda_digest(got) == sent["sha"]
            assert all(t.device == torch.device("cuda:1") for t in got.tensors("torch").values())
            del got
            assert peer.finish() == {"fds_left": []}
        finally:
            peer.close()
