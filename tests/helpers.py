"""Test helpers: receivers in threads, peers in child processes, a byte-flipping proxy."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tensorxfer import CudaError, Manifest, TensorRegion
from tensorxfer import memory as mem
from tensorxfer.protocol import HEADER
from tensorxfer.transport.tcp import STREAM_HEADER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_reason() -> str | None:
    if mem.CudaRegion is None:
        return mem.CUDA_UNAVAILABLE
    from tensorxfer.memory import _cuda

    try:
        return None if _cuda.device_count() > 0 else "no CUDA device"
    except CudaError as e:
        return str(e)


GPU_REASON = _gpu_reason()
"""Why the CUDA tests cannot run here (None: a GPU is usable)."""
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")


def region_of(nbytes: int, name: str = "w", fill: int | None = None) -> TensorRegion:
    r = TensorRegion.from_manifest(Manifest.layout([(name, "U8", (nbytes,))]))
    if fill is not None:
        mv = memoryview(r.region)
        mv[:nbytes] = bytes([fill]) * nbytes
        mv.release()
    return r


@contextlib.contextmanager
def sync_pair(nbytes: int, transport: str = "tcp", stall_timeout: float = 5.0,
              src_fill: int | None = None) -> Iterator[tuple[Any, Any, TensorRegion, TensorRegion]]:
    """A real weight-sync TargetPort (target rank 0 of group "g", token "t") and the SourceLink of source rank 3
    to it over ``transport`` (loopback), and their regions of ``nbytes`` (the target's zeroed)."""
    from tensorxfer.sync.link import SourceLink, TargetPort

    with region_of(nbytes, fill=src_fill) as src, region_of(nbytes, fill=0) as dst:
        port = TargetPort("127.0.0.1", "t", "g", 0, stall_timeout, 5.0)
        try:
            port.expect({3})
            admitting = threading.Thread(target=port.admit, args=(5.0,))
            admitting.start()
            link = SourceLink(port.address, "t", "g", 3, 0, transport, 1, stall_timeout, 5.0)
            admitting.join(10)
            assert not admitting.is_alive()
            try:
                yield port, link, src, dst
            finally:
                link.close()
        finally:
            port.close()


class Background:
    """Run ``fn`` in a thread; ``result()`` returns its value or raises its exception."""

    def __init__(self, fn: Any, *args: Any, **kw: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 30) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def wait_until(condition: Any, timeout: float = 5.0, what: str = "the condition") -> None:
    """Poll ``condition()`` until it is true; fail the test after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not become true within {timeout} s"
        time.sleep(0.01)


def child(code: str, *args: str, **kw: Any) -> subprocess.Popen:
    """Start ``python -c code args...`` with the package importable; stdout/stderr piped."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def finish(proc: subprocess.Popen, timeout: float = 20) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def line_within(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The next line of ``proc``'s (text) stdout, or the test fails after ``timeout`` seconds, saying
    ``what`` it waited for and what the process wrote on stderr: a line that never comes (a peer that took
    another path, a relay that never saw the bytes it waits for) must fail the test, not hold the run.  The
    process is killed then -- that ends the blocked read."""
    assert proc.stdout is not None
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if not got:
        proc.kill()
        reader.join(10)
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise AssertionError(f"{what}: no line from pid {proc.pid} within {timeout:g} s; its stderr: {err[-2000:]!r}")
    return got[0]


def server_and_trainer(server: list[str], trainer: Any, timeout: float = 120) -> tuple[subprocess.CompletedProcess,
                                                                                    subprocess.CompletedProcess]:
    """A server process, then a trainer process run to its end against it, then the server's end: the two
    processes users run (examples, the README's tour).  ``server`` and ``trainer`` are argument lists after
    ``python``; ``trainer`` may instead be a function of the running server (``Popen``, stdout piped) that
    returns them, for a trainer that needs what the server printed first (its address).  Whatever fails, the
    server is not left running.  Returns the two processes' results (the server's stdout without what
    ``trainer`` read)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, *server], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        args = trainer(proc) if callable(trainer) else trainer
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)
        out, err = proc.communicate(timeout=60 if done.returncode == 0 else 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the server did not end after its trainer: {err[-2000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return done, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@contextlib.contextmanager
def small_filesystem(where: Path, size: int) -> Iterator[Path]:
    """A real ``size``-byte file system (tmpfs) mounted at ``where``, for disk-full tests; skips the test
    where this process may not mount one (needs root / CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for a real disk-full test: {r.stderr.strip() or r.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _pump(src: socket.socket, dst: socket.socket, transform: Any = None) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(transform(data) if transform else data)
    except OSError:
        pass   # either side closed: the proxy just stops forwarding
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass   # already closed


class FlipProxy:
    """A TCP proxy between a Sender and a Receiver that corrupts one payload byte.

    It forwards the control connection, rewrites the ``accept`` frame so the
    sender's data streams go through the proxy too, and flips the byte at
    ``flip_at`` (an offset inside stream 0's slice) on its way through.
    With ``inject=True`` it first opens a stranger connection to the real
    data port that presents a forged stream header and garbage.
    """

    def __init__(self, target: tuple[str, int], flip_at: int | None, inject: bool = False) -> None:
        self.target = target
        self.flip_at = flip_at
        self.inject = inject
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.injected = False
        self._spawn(self._serve_control)

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def _serve_control(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(self.target)
        self.socks += [client, upstream]
        self._spawn(_pump, client, upstream)
        self._spawn(self._frames, upstream, client)

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        buf = b""
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + HEADER.unpack(buf[:4])[0]:
                    n = HEADER.unpack(buf[:4])[0]
                    body, buf = buf[4:4 + n], buf[4 + n:]
                    frame = msgpack.unpackb(body, raw=False)
                    if frame.get("type") == "accept":
                        frame["descriptors"]["port"] = self._data_proxy(frame["descriptors"]["port"])
                        body = msgpack.packb(frame, use_bin_type=True)
                    dst.sendall(HEADER.pack(len(body)) + body)
        except OSError:
            pass   # a side closed
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass   # already closed

    def _data_proxy(self, real_port: int) -> int:
        lst = socket.create_server(("127.0.0.1", 0))
        self.socks.append(lst)
        if self.inject:
            stranger = socket.create_connection((self.target[0], real_port))
            self.socks.append(stranger)
            stranger.sendall(STREAM_HEADER.pack(b"TXS1", 1, 0, 1, b"\0" * 32) + b"\xff" * 4096)
            self.injected = True

        def serve() -> None:
            while True:
                try:
                    conn, _ = lst.accept()
                except OSError:
                    return
                up = socket.create_connection((self.target[0], real_port))
                self.socks += [conn, up]
                self._spawn(self._flip_stream, conn, up)
                self._spawn(_pump, up, conn)
        self._spawn(serve)
        return int(lst.getsockname()[1])

    def _flip_stream(self, src: socket.socket, dst: socket.socket) -> None:
        seen = -STREAM_HEADER.size
        header = b""

        def transform(data: bytes) -> bytes:
            nonlocal seen, header
            if len(header) < STREAM_HEADER.size:
                header += data[:STREAM_HEADER.size - len(header)]
            start, seen = seen, seen + len(data)
            index = STREAM_HEADER.unpack(header)[2] if len(header) == STREAM_HEADER.size else -1
            if self.flip_at is not None and index == 0 and start <= self.flip_at < seen:
                b = bytearray(data)
                b[self.flip_at - start] ^= 0x01
                return bytes(b)
            return data
        _pump(src, dst, transform)

    def close(self) -> None:
        for s in [self.listener, *self.socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass   # not connected
            s.close()
        for t in self.threads:
            t.join(5)


#: ``SOCK_DESTROY`` over ``NETLINK_SOCK_DIAG`` (linux/sock_diag.h), what ``ss -K`` sends; root only.
_SOCK_DESTROY, _NETLINK_SOCK_DIAG, _NO_COOKIE = 21, 4, 0xFFFFFFFF


def destroy_tcp_sockets(socks: list[socket.socket]) -> list[int]:
    """Have the kernel abort these established IPv4 TCP sockets as ``ss -K`` does (an RST to the peer, the
    local end's next call fails with ECONNABORTED), from this process and within microseconds: ``ss`` in a
    subprocess took longer to start on a loaded CI machine than a 64 MiB pair took to finish.  Returns the
    kernel's answer for each socket (0: destroyed, else a negative errno)."""
    answers = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        for seq, s in enumerate(socks, 1):
            (src, sport), (dst, dport) = s.getsockname(), s.getpeername()
            sockid = (struct.pack("!HH", sport, dport) + socket.inet_aton(src) + bytes(12)
                      + socket.inet_aton(dst) + bytes(12) + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
            req = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
            nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DESTROY, 0x1 | 0x4, seq, 0) + req)   # REQUEST|ACK
            reply = nl.recv(4096)
            answers.append(struct.unpack_from("=i", reply, 16)[0])      # nlmsgerr.error after the header
    return answers
