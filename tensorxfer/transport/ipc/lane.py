"""The follower's side of a copy lane (:mod:`.delegate` holds the host's side and the whole design): the lane
(:class:`CopyLane`), the fence word's resolution when a step is given up, the host's process watched through a
pidfd (:class:`HostProcess`), and the process's memory in doubt (:data:`IN_DOUBT`).
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import threading
import time
from typing import Any

import msgpack
import numpy as np

from tensorxfer.errors import AuthError, PeerLost, ProtocolError, QuantizationError, TransferError, TransferTimeout
from tensorxfer.memory._fence import DONE, REVOKED, RUNNING, STATE_NAMES, Fence, word
from tensorxfer.protocol import mac, nonce
from tensorxfer.quant.tiles import WIDTH
from tensorxfer.transport.ipc.identity import check_peer
from tensorxfer.transport.ipc.messages import (
    HEADER_TIMEOUT,
    MAX_MESSAGE,
    U64,
    close_fds,
    recv_message,
    send_handles,
    send_message,
)
from tensorxfer.transport.ipc.sender import export_handles
from tensorxfer.transport.segments import Segments

log = logging.getLogger(__name__)

_NO_TOKEN = b"tensorxfer-copy-host-without-token"    # a tokenless group: the uid check is the guard
COLUMNS = 6                                          # src_off, dst_off, nbytes, count, src_stride, dst_stride
_T_BYTES = (MAX_MESSAGE - 64) // (8 * COLUMNS) * (8 * COLUMNS)       # segment bytes per "T" message
_Q_BYTES = (MAX_MESSAGE - 64) // (8 * WIDTH) * (8 * WIDTH)           # tile bytes per "Q" message


def proof(key: bytes | None, who: bytes, challenge: bytes) -> bytes:
    """One end's proof of the group's token key over the other end's nonce (``who``: b"lane" or b"host")."""
    return mac(key or _NO_TOKEN, b"copy-host", who, challenge)


class HostProcess:
    """The copy host's process, watched through a pidfd: readable once it exited, whatever runs under its pid
    later.  Where the kernel has no ``pidfd_open`` (before Linux 5.3) the pid is probed with ``kill(pid, 0)``: a
    pid reused meanwhile reads as alive (a doubt then waits longer, never clears too early)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._fd = -1

    def fileno(self) -> int:
        return self._fd

    def gone(self) -> bool:
        """Whether the process exited (it writes nothing any more: its memory and its CUDA context are gone)."""
        if self._fd >= 0:
            return _readable([self._fd], 0)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _readable(fds: list[int], timeout: float) -> bool:
    """Whether one of ``fds`` is readable within ``timeout`` seconds (poll: any fd number, unlike select)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _span(region: Any) -> tuple[Any, int, int]:
    """The memory a follower's TensorRegion payload occupies: (device, first address, end address)."""
    where = ("cuda", int(region.region.device_index)) if region.is_cuda else ("host", 0)
    lo = int(region.region.ptr)
    return where, lo, lo + max(int(region.nbytes), 1)


class _Doubt:
    """A step a copy host took (the fence read RUNNING when its follower gave up) and has not finished."""

    def __init__(self, span: tuple[Any, int, int], fence: Fence, seq: int, host: HostProcess, path: str) -> None:
        self.span, self.fence, self.seq, self.host, self.path = span, fence, seq, host, path
        self.since = time.monotonic()

    def overlaps(self, span: tuple[Any, int, int]) -> bool:
        return span[0] == self.span[0] and span[1] < self.span[2] and self.span[1] < span[2]

    def settled(self) -> str | None:
        """Why the doubt is over (the host finished the step, or its process is gone); None: still in doubt."""
        seen = self.fence.load()
        if seen != word(self.seq, RUNNING):
            return f"the fence reads {STATE_NAMES[seen & 3]}"
        if self.host.gone():
            return "its process is gone"
        return None

    def close(self) -> None:
        self.fence.close()
        self.host.close()


class InDoubt:
    """The memory of this process that a copy host may still write into: steps it took and did not finish
    (process-wide: a later session, lane or plan writing into the same memory must wait too).

    Each entry owns the lane's fence page and the host's pidfd; it is released once the fence reads done or
    revoked, or the host's process is gone (looked at whenever a copy into memory asks).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: list[_Doubt] = []

    def add(self, region: Any, fence: Fence, seq: int, host: HostProcess, path: str) -> None:
        """Take ``fence`` and ``host`` over: ``region``'s memory is in doubt until step ``seq`` settles."""
        with self._lock:
            self._steps.append(_Doubt(_span(region), fence, seq, host, path))

    def pending(self, region: Any = None) -> list[tuple[int, int, int]]:
        """``(host pid, step, fence state)`` of each step in doubt (over ``region``'s memory, when given), after
        releasing those that settled."""
        self._settle()
        span = _span(region) if region is not None else None
        with self._lock:
            return [(d.host.pid, d.seq, d.fence.load() & 3) for d in self._steps if span is None or d.overlaps(span)]

    def wait_clear(self, region: Any, timeout: float) -> None:
        """Return once no step in doubt can write into ``region``'s memory, waiting up to ``timeout`` seconds.

        Raises
        ------
        TransferTimeout
            A copy host still holds a step into this memory (naming its pid and the step): nothing may be copied
            into it until that host finishes or its process ends.
        """
        if not self._steps:         # the fast path: one read, no lock
            return
        span = _span(region)
        deadline = time.monotonic() + timeout
        while True:
            self._settle()
            with self._lock:
                blocking = [d for d in self._steps if d.overlaps(span)]
            if not blocking:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                d = blocking[0]
                raise TransferTimeout(
                    f"ipc: this target's region is in doubt: the copy host (pid {d.host.pid}, {d.path}) took step "
                    f"{d.seq} of a pair's copy into it {time.monotonic() - d.since:.1f} s ago and has not finished it "
                    f"(stopped or stalled mid-copy), so nothing may be copied into the region and no step may "
                    f"succeed until it finishes or its process ends (waited {timeout} s); resume that process "
                    f"(kill -CONT {d.host.pid}) or end it (kill {d.host.pid})")
            # the fence changes wake nothing: look again soon; a host's end wakes this at once (its pidfd)
            _readable([d.host.fileno() for d in blocking if d.host.fileno() >= 0], min(left, 0.02))

    def _settle(self) -> None:
        with self._lock:
            settled = [(d, why) for d in self._steps for why in [d.settled()] if why is not None]
            done = {id(d) for d, _ in settled}
            self._steps = [d for d in self._steps if id(d) not in done]
        for d, why in settled:
            log.warning("ipc: the copy host (pid %d) is through with step %d (%s): its follower's memory is no "
                        "longer in doubt", d.host.pid, d.seq, why)
            d.close()


#: The process's memory in doubt (see :class:`InDoubt` and the module docstring).
IN_DOUBT = InDoubt()


def _send_batches(sock: socket.socket, tag: bytes, data: bytes, batch: int, what: str) -> None:
    """A setup's table as messages ``tag`` + at most ``batch`` bytes (whole rows: ``batch`` is a row multiple)."""
    for i in range(0, len(data), batch):
        send_message(sock, tag + data[i:i + batch], f"the lane's {what}")


class CopyLane:
    """A follower's lane for one pair (see the module docstring).

    Raises (each call)
    ------
    PeerLost, TransferTimeout, TransferError, ProtocolError
        Making the lane or a setup: the host is gone, stalled or refused (the caller copies locally instead).
    AuthError
        The host's proof of the group's key is wrong (not the group's copy host): nothing was passed to it.
    """

    def __init__(self, path: str, key: bytes | None, timeout: float) -> None:
        self.timeout = float(timeout)
        self.path = path
        self.ready_for: Any = None      # what the host set up, as the caller names it
        self._dst: Any = None           # the follower's region whose handles the host holds
        self._lock = threading.Lock()   # close() from another thread vs. a step's end
        self._pending: int | None = None    # a step granted and not yet settled
        self._fence: Fence | None = None
        self._host: HostProcess | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(HEADER_TIMEOUT)
            try:
                sock.connect(path)
            except OSError as e:
                raise PeerLost(f"copy host: cannot reach {path}: {e}") from None
            challenge = recv_message(sock, "the copy host's challenge", HEADER_TIMEOUT)
            if challenge[:1] != b"N":
                raise ProtocolError(f"copy host: unexpected challenge {challenge[:8]!r}")
            # watched from before our proof goes out: the host's answer to it proves this is its live process
            self._host = HostProcess(check_peer(sock))
            mine = nonce()
            send_message(sock, b"A" + proof(key, b"lane", challenge[1:]) + mine, "the lane's proof")
            answer = recv_message(sock, "the copy host's proof", HEADER_TIMEOUT)
            if answer[:1] == b"E":
                raise TransferError(f"copy host: {answer[1:].decode(errors='replace')}")
            if answer[:1] != b"K" or not hmac.compare_digest(answer[1:], proof(key, b"host", mine)):
                raise AuthError(f"copy host: the process at {path} (pid {self._host.pid}) failed authentication: its "
                                f"proof of the group's key is wrong (another group's copy host, or not a copy host); "
                                f"nothing was passed to it -- this target copies on its own")
            self._fence = Fence.create()
            send_message(sock, b"L", "the lane's fence page", [self._fence.fd])
        except BaseException:
            sock.close()
            for own in (self._fence, self._host):
                if own is not None:
                    own.close()
            raise
        self._sock: socket.socket | None = sock

    @property
    def closed(self) -> bool:
        return self._sock is None

    def setup(self, src_handles: list[tuple[int, int]] | None, src_nbytes: int, dst: Any, segments: Segments,
              kind: str, ready_for: Any) -> None:
        """Pass the source's handles (``(size, fd)``, still the caller's; None: the host maps them already),
        the follower's region ``dst`` (a TensorRegion: its memory handles exported here, on the lane's first
        setup) and the pair's segments; return once the host mapped them."""
        sock = self._live()
        dst_chunks = [] if dst is self._dst else export_handles(dst)
        try:
            src_chunks, pos = [], 0
            for size, fd in src_handles or ():
                src_chunks.append((pos, size, fd))
                pos += size
            send_message(sock, b"S" + msgpack.packb(
                {"kind": kind, "groups": len(segments), "tiles": len(segments.tiles or ()), "src_nbytes": src_nbytes,
                 "src_count": len(src_chunks),
                 "dst_nbytes": dst.nbytes, "dst_count": len(dst_chunks)}), "the lane's setup")
            send_handles(sock, src_chunks)
            send_handles(sock, dst_chunks)
        finally:
            close_fds([fd for *_, fd in dst_chunks])
        cols = np.stack([segments.src_off, segments.dst_off, segments.nbytes, segments.count, segments.src_stride,
                         segments.dst_stride]).astype(">u8").tobytes()
        _send_batches(sock, b"T", cols, _T_BYTES, "segments")
        table = b"" if segments.tiles is None else np.ascontiguousarray(segments.tiles.table).astype(">i8").tobytes()
        _send_batches(sock, b"Q", table, _Q_BYTES, "quantizing tiles")     # a pair that quantizes on the way
        self._expect(sock, b"K", "the copy host's setup", self.timeout)
        self.ready_for, self._dst = ready_for, dst

    def copy(self, seq: int) -> bool:
        """Have the host copy the pair for step ``seq``: True once the bytes are in the follower's memory; False
        when the host never will copy this step (it did not take it in time and the step is revoked, or its copy
        failed, or it is gone): the caller copies it itself, whole.  After False, or after a True that ended
        with the lane closed (:attr:`closed`: the host answered late), the caller gives the lane up.

        Raises
        ------
        TransferTimeout
            The host took the step and did not finish it within :attr:`timeout`: it may still write.  The
            follower's region is registered in doubt (:data:`IN_DOUBT`) and this lane is closed.
        TransferError
            The lane is closed (before the step was asked for: nothing was granted).
        """
        sock = self._live()
        fence = self._fence
        assert fence is not None and self._host is not None
        start = time.monotonic()
        with self._lock:
            self._pending = seq
            fence.grant(seq)
        answer, why = b"", ""
        try:
            send_message(sock, b"G" + U64.pack(seq), "the lane's step")
            answer = recv_message(sock, "answer to the step", self.timeout / 2)
        except TransferError as e:      # no answer in time, or the host is gone
            why = f"{type(e).__name__}: {e}"
        except BaseException as e:
            self._give_up(seq, f"{type(e).__name__}: {e}")
            raise
        if len(answer) == 17 and answer[:9] == b"Q" + U64.pack(seq) and self._settled(seq, fence.state) == DONE:
            # copied but for the blocks that held a NaN or an infinity: the step fails (the caller names the
            # tensor), and the lane serves on
            tile = U64.unpack(answer[9:])[0]
            poisoned = QuantizationError(f"copy host: step {seq} met a NaN or an infinity in quantizing tile {tile}")
            poisoned.tile = tile
            raise poisoned
        try:
            if answer == b"K" + U64.pack(seq) and self._settled(seq, fence.state) == DONE:
                return True         # the fast path: one load
            if answer[:1] == b"E":
                why = f"the host refused: {answer[1:].decode(errors='replace')}"
            elif answer:
                why = f"unexpected answer {answer[:16]!r}"
            state = self._settled(seq, fence.revoke)
            if state == RUNNING:
                state, late = self._wait_for_host(sock, fence, seq, start + self.timeout)
                if late:
                    answer = late
            if state == DONE:
                if answer != b"K" + U64.pack(seq):
                    self.close()        # its answer may still come, where the next step would read it
                return True
            if state == REVOKED:
                log.warning("copy host: step %d was not copied by the copy host (pid %d; %s): the follower copies it",
                            seq, self._host.pid, why or "its copy failed")
                return False
        except BaseException as e:
            self._give_up(seq, f"{type(e).__name__}: {e}")
            raise
        pid = self._host.pid
        self._give_up(seq, why)     # the step still RUNNING: close() puts the region in doubt
        raise TransferTimeout(f"copy host: the copy host (pid {pid}, {self.path}) took step {seq} of this pair and did "
                              f"not finish it within {self.timeout} s ({why or 'no answer'}); it may still write into "
                              f"this target's region, so the step fails and nothing may be copied into the region "
                              f"until that process finishes the step or ends (resume it, kill -CONT {pid}, or end it)")

    def _settled(self, seq: int, look: Any) -> int:
        """``look(seq)`` (the fence's state, or its revoke) under the lane's lock; the lane closed meanwhile
        (close() settled the step) is a TransferError."""
        with self._lock:
            if self._fence is None:
                raise TransferError(f"copy host: the lane was closed during step {seq}")
            state = int(look(seq))
            if state != RUNNING:
                self._pending = None
            return state

    def _wait_for_host(self, sock: socket.socket, fence: Fence, seq: int, deadline: float) -> tuple[int, bytes]:
        """The host took step ``seq``: wait for its answer, the fence or the end of its process, up to
        ``deadline``; ``(the step's state, the answer read meanwhile)``.  A host whose process ended is REVOKED:
        nothing of it can still write."""
        assert self._host is not None
        answer, watch_sock = b"", True
        while True:
            state = self._settled(seq, fence.state)
            if state != RUNNING:
                return state, answer
            if self._host.gone():
                with self._lock:
                    self._pending = None
                return REVOKED, answer
            left = deadline - time.monotonic()
            if left <= 0:
                return RUNNING, answer
            poller = select.poll()
            if watch_sock:
                poller.register(sock, select.POLLIN)
            if self._host.fileno() >= 0:
                poller.register(self._host.fileno(), select.POLLIN)
            events = poller.poll(min(left, 0.05 if self._host.fileno() < 0 else left) * 1000)
            for fd, _ in events:
                if fd == sock.fileno():
                    try:
                        msg = sock.recv(MAX_MESSAGE)
                    except OSError:
                        msg = b""
                    if msg:
                        answer = msg
                    else:
                        watch_sock = False      # the host closed or died: its pidfd says which

    def _give_up(self, seq: int, why: str) -> None:
        """Close the lane; a step it leaves running puts the follower's region in doubt (see :meth:`close`)."""
        log.warning("copy host: giving up the lane to %s at step %d (%s)", self.path, seq, why)
        self.close()

    def _live(self) -> socket.socket:
        if self._sock is None:
            raise TransferError("copy host: the lane is closed")
        return self._sock

    @staticmethod
    def _expect(sock: socket.socket, want: bytes, what: str, timeout: float) -> None:
        msg = recv_message(sock, what, timeout)
        if msg[:1] == b"E":
            raise TransferError(f"copy host: {msg[1:].decode(errors='replace')}")
        if msg != want:
            raise ProtocolError(f"copy host: {msg[:16]!r} instead of {what}")

    def close(self) -> None:
        """Close the socket and release the fence page and the host's pidfd -- except where a step granted on
        this lane is still RUNNING on the fence and the host lives: then the follower's region goes in doubt
        (:data:`IN_DOUBT` takes both over).  Idempotent, callable from another thread."""
        with self._lock:
            sock, self._sock = self._sock, None
            fence, self._fence = self._fence, None
            host, self._host = self._host, None
            pending, self._pending = self._pending, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)     # wakes a step waiting for the host in another thread
            except OSError:
                pass    # not connected any more
            sock.close()
        if fence is not None and host is not None and pending is not None:
            try:
                state = fence.revoke(pending)
            except ProtocolError:
                state = RUNNING     # a fence that names another step: whatever the host does, it is not done
            if state == RUNNING and not host.gone() and self._dst is not None:
                IN_DOUBT.add(self._dst, fence, pending, host, self.path)
                log.warning("copy host: the copy host (pid %d) still runs step %d: this target's region is in doubt "
                            "until it finishes or ends", host.pid, pending)
                return
        for own in (fence, host):
            if own is not None:
                own.close()
