"""The streams of the tcp transport: one thread per socket moving its share of an update, and the
byte-moving loops they run (straight from and into region memory, or through a GPU region's stagers).

A resumable update (:mod:`tensorxfer.session.recovery`) counts, per stream, the bytes of its share that
moved -- on a receiver they are in region memory, in wire order, so the count is exactly where the stream
resumes -- and a stream whose connection breaks then breaks alone: the others finish.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tensorxfer.errors import LinkDropped, PeerLost, ProtocolError, TransferTimeout
from tensorxfer.staging import read_pieces, write_pieces
from tensorxfer.transport.base import Progress

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.segments import Segments

IOV_BATCH = 512               # buffers per sendmsg / recvmsg_into call (the kernel's IOV_MAX is 1024)


def move_part(sock: socket.socket, region: TensorRegion, part: Segments, index: int, stager: Any, timeout: float,
              report: Progress, receive: bool, start: int = 0, piece_bytes: int = 8 << 20,
              on_piece: Callable[[int, int], None] | None = None) -> None:
    """Send (gather) or receive (scatter) one stream's part of a weight sync's segments.

    Host regions: the runs' region slices go straight to ``sendmsg`` / ``recvmsg_into``, hundreds per call,
    so a row-parallel shard's thousands of rows cost a few system calls.  GPU regions: run by run through
    the stream's pinned buffers (correct, not fast: a GPU weight sync belongs on ipc or rdma).
    ``start``: the first ``start`` bytes of this part (in wire order) landed before (a resumed stream; host
    regions only: a GPU region's stream resumes from its start).  ``on_piece(offset, length)``: a received
    host range landed (the receiver's hook: tensorxfer-recv writes and journals it).
    """
    sock.settimeout(timeout)
    what = "receive" if receive else "send"
    try:
        if region.is_cuda:
            if start:
                raise ProtocolError(f"tcp stream {index}: a GPU region's segments resume from their start only")
            for src, dst, n in part.runs():
                pieces = (write_pieces(region, dst, n, piece_bytes, stager=stager) if receive else
                          read_pieces(region, src, n, piece_bytes, stager=stager))
                with pieces as it:
                    for _, piece in it:
                        _scatter_gather(sock, [piece], receive, index, report)
            return
        with memoryview(region.region) as whole, whole.cast("B") as mem:
            views: list[memoryview] = []
            offsets: list[int] = []
            landed = (lambda i: on_piece(offsets[i], len(views[i]))) if on_piece is not None and receive else None
            for off, n in skip_bytes(_extents(part, receive), start):
                for p in range(off, off + n, piece_bytes):
                    views.append(mem[p:min(p + piece_bytes, off + n)])
                    offsets.append(p)
                if len(views) >= IOV_BATCH:
                    _scatter_gather(sock, views, receive, index, report, landed)
                    views, offsets = [], []
            if views:
                _scatter_gather(sock, views, receive, index, report, landed)
    except TimeoutError:
        raise TransferTimeout(f"tcp stream {index}: no progress for {timeout} s during a segmented "
                              f"{what}") from None
    except ConnectionError as e:
        if isinstance(e, PeerLost):
            raise
        raise PeerLost(f"tcp stream {index}: connection lost during a segmented {what}: {e}") from None


def _extents(part: Segments, receive: bool) -> list[tuple[int, int]]:
    """This side's byte ranges of ``part``, in wire order, with ranges that touch merged into one: the rows of
    a row-parallel shard are scattered on the source but one block on the target, which receives it with
    one buffer instead of one per row."""
    src, dst, n = part.flat()
    off = dst if receive else src
    if not len(n):
        return []
    starts = np.flatnonzero(np.concatenate(([True], off[1:] != off[:-1] + n[:-1])))
    ends = np.concatenate((starts[1:], [len(n)]))
    sizes = np.add.reduceat(n, starts)
    return list(zip(off[starts].tolist(), sizes.tolist())) if len(ends) else []


def skip_bytes(extents: list[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    """``extents`` (in wire order) without their first ``start`` bytes: what a resumed stream still moves."""
    out = []
    for off, n in extents:
        if start >= n:
            start -= n
            continue
        out.append((off + start, n - start))
        start = 0
    return out


def _scatter_gather(sock: socket.socket, views: list[memoryview], receive: bool, index: int,
                    report: Progress, landed: Callable[[int], None] | None = None) -> None:
    """Fill (``receive``) or send every view, in order, with as few system calls as the kernel allows;
    ``landed(i)`` once view ``i`` is complete."""
    i, skip = 0, 0
    while i < len(views):
        batch = [views[i][skip:], *views[i + 1:i + IOV_BATCH]]
        k = sock.recvmsg_into(batch)[0] if receive else sock.sendmsg(batch)
        if k == 0:
            raise PeerLost(f"tcp stream {index}: the peer closed the connection; the transfer is incomplete")
        report(k)
        while k:
            room = len(views[i]) - skip
            if k >= room:
                k -= room
                if landed is not None:
                    landed(i)
                i, skip = i + 1, 0
            else:
                skip, k = skip + k, 0
    for v in views:
        v.release()


def send_counted(sock: socket.socket, piece: memoryview, count: Progress) -> None:
    """``sendall`` that counts what the kernel took, so a broken stream knows how far it got."""
    with memoryview(piece) as view, view.cast("B") as rest:
        done = 0
        while done < len(rest):
            k = sock.send(rest[done:])
            done += k
            count(k)


def close_stagers(stagers: list[Any]) -> None:
    while stagers:
        stager = stagers.pop()
        if stager is not None:
            stager.close()




class Streams:
    """Threads moving slices, one per socket; the first error aborts all of them."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        self.broken: dict[int, BaseException] = {}     # resumable updates: a stream's lost connection, by index
        self.tolerate = False       # resumable: a stream that loses its connection breaks alone
        self.moved: list[int] = []      # bytes of its share each stream moved this update (its landed mark)
        self._lock = threading.Lock()
        self._progress: Progress | None = None

    def begin(self, tolerate: bool) -> None:
        """A new update: nothing broken, nothing moved."""
        self.tolerate, self.error = tolerate, None
        self.broken.clear()
        self.moved = [0] * len(self.socks)

    def counter(self, index: int) -> Progress:
        """The progress report of stream ``index``: counts its share's bytes, then reports them."""
        def count(n: int) -> None:
            self.moved[index] += n
            self.report(n)
        return count

    def start(self, sock: socket.socket, target: Any, *args: Any, index: int = -1) -> None:
        def run() -> None:
            try:
                target(sock, *args)
            except (PeerLost, TransferTimeout) as e:
                if not self.tolerate or index < 0:
                    self._fail(e)
                    return
                with self._lock:
                    self.broken[index] = e
                try:
                    sock.shutdown(socket.SHUT_RDWR)     # the peer's half of this stream fails now, not later
                except OSError:
                    pass    # already disconnected
            except BaseException as e:
                self._fail(e)
        t = threading.Thread(target=run, name=f"tensorxfer-{self.what}-{len(self.threads)}", daemon=True)
        self.threads.append(t)
        t.start()

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e
        self.abort()

    def replace(self, index: int, sock: socket.socket) -> None:
        """A replacement connection for stream ``index`` (the broken one is closed)."""
        old, self.socks[index] = self.socks[index], sock
        old.close()

    def dropped(self, nbytes: int, landed_ok: bool = True) -> LinkDropped | None:
        """The update's broken streams (with their moved marks; 0 where ``landed_ok`` is false), or None."""
        if not self.broken:
            return None
        return LinkDropped(dict(self.broken), {i: self.moved[i] if landed_ok else 0 for i in self.broken}, nbytes)

    def report(self, n: int) -> None:
        if self._progress is not None:
            self._progress(n)

    def abort(self) -> None:
        """Wake every thread blocked in a socket call (safe from any thread)."""
        for s in list(self.socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass   # already disconnected: nothing to wake

    def join(self) -> None:
        for t in self.threads:
            t.join()
        self.threads.clear()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.abort()
        for t in self.threads:
            t.join()
        self.threads.clear()
        socks, self.socks = self.socks, []
        for s in socks:
            s.close()
