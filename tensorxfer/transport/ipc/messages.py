"""The ipc wire: the messages of the Unix socket (see the package docstring), their limits and checks.

Shared by both ends: the authentication proof, bounded message reads, the chunk table and handle
batches (checked as hostile input), the watermark a relay raises, and the piece sizes both ends of a
hop agree on.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import struct
import threading
from typing import TYPE_CHECKING, Any

import msgpack

from tensorxfer.errors import PeerLost, ProtocolError, TensorXferError, TransferError, TransferTimeout, UpstreamFailed
from tensorxfer.protocol import MAX_FRAME_DEPTH, MAX_FRAME_OBJECTS, field, mac, scan_msgpack

if TYPE_CHECKING:
    from tensorxfer.transport.base import TransferContext

AUTH_MAGIC = b"TXI1"
AUTH = struct.Struct(">4sQ32s")
U64 = struct.Struct(">Q")
HEADER_TIMEOUT = 5.0           # a connected sender must authenticate this fast
FD_BATCH = 250                 # fds per message: the kernel's SCM_MAX_FD is 253
MAX_CHUNKS = 1 << 20
MAX_MESSAGE = 64 << 10         # every message is small: the chunk list travels in batches with its fds
CHUNK_TAIL = 2 << 20           # a region's last handle ends at most here past its payload (VMM granularity)
PIECE_BYTES = 64 << 20         # host copy granularity: progress, abort checks, work split across threads
CUDA_PIECE_BYTES = 1 << 30     # device copies are queued, not waited for: few large ones, few progress messages
FORWARD_POLL_S = 0.2           # a relaying sender looks at its forwarder this often while the receiver is quiet


#: What a chunk table may describe: host memfds, CUDA handles, or regular files (a sender whose region is
#: its model files mapped, :attr:`TensorRegion.source_files`: the receiver copies from the files with
#: ``copy_file_range``/``pread``, never through a mapping, so a file cut short fails the copy instead of
#: raising SIGBUS; passed anew with every update, never ``cached``).
FILES = "files"
KINDS = ("host", "cuda", FILES)


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


# A relayed copy (the receiver is a fan-out relay, or its sender is one) goes in smaller pieces: each is
# reported as landed when its bytes are there, and the next hop waits for it, so the piece is the chain's
# delay per hop (tensorxfer.fanout).  Both ends of a hop use the same size, so the pieces line up.
RELAY_PIECE_BYTES = env_int("TENSORXFER_IPC_FORWARD_PIECE", 16 << 20)
# Device pieces are large: measured on one H200 (8 GB, 3 relayed receivers on the same GPU), 256 MiB pieces
# took 4.0x one receiver's time, 1 GiB 3.2x, the whole region at once 3.05x -- every hop there shares one
# memory, so overlap gains nothing and each piece's mark and watermark message costs.  1 GiB keeps hops on
# different GPUs pipelined (a 31 GB region is 30 pieces) at almost no cost where they share one.
RELAY_CUDA_PIECE_BYTES = env_int("TENSORXFER_IPC_CUDA_FORWARD_PIECE", 1 << 30)


def proof(ctx: TransferContext, ipc_nonce: bytes, seq: int) -> bytes:
    return mac(ctx.session_key, b"ipc", ipc_nonce, U64.pack(seq))


def recv_message(sock: socket.socket, what: str, timeout: float) -> bytes:
    sock.settimeout(timeout)
    try:
        data = sock.recv(MAX_MESSAGE)
    except TimeoutError:
        raise TransferTimeout(f"ipc: no {what} from the peer within {timeout} s") from None
    except OSError as e:
        raise PeerLost(f"ipc: connection lost waiting for {what}: {e}") from None
    if not data:
        raise PeerLost(f"ipc: the peer closed the connection before {what}")
    return data


def send_message(sock: socket.socket, data: bytes, what: str, fds: list[int] | None = None) -> None:
    try:
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout(f"ipc: the peer did not take {what} in time") from None
    except OSError as e:
        raise PeerLost(f"ipc: connection lost sending {what}: {e}") from None


def unpack(data: bytes, what: str) -> Any:
    scan_msgpack(data, MAX_FRAME_OBJECTS, MAX_FRAME_DEPTH, what=f"ipc: {what}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=64, max_ext_len=0)
    except Exception as e:
        raise ProtocolError(f"ipc: {what} is not valid msgpack: {e}") from None


def parse_header(data: bytes) -> tuple[str, int, int, bytes, int, bool, int, int]:
    """The update's chunk table header; the last item is ``ready`` (absent: ``nbytes``, everything ready)."""
    table = unpack(data, "the chunk table header")
    if not isinstance(table, dict):
        raise ProtocolError("ipc: the chunk table header is not a map")
    kind = field(table, "kind", str)
    device = field(table, "device", int)
    token = field(table, "token", bytes)
    nbytes = field(table, "nbytes", int)
    count = field(table, "count", int)
    cached = field(table, "cached", bool)
    seq = field(table, "seq", int)
    ready = field(table, "ready", int, optional=True)
    ready = nbytes if ready is None else ready
    if not 0 <= ready <= nbytes:
        raise ProtocolError(f"ipc: the chunk table says {ready} of {nbytes} payload bytes are ready")
    if kind not in KINDS or device < 0 or nbytes < 0 or not 0 <= count <= MAX_CHUNKS \
            or (count == 0) != (nbytes == 0 or cached) or (cached and nbytes == 0) or len(token) != 16 \
            or (kind == FILES and cached):
        raise ProtocolError(f"ipc: chunk table out of range: kind {kind!r}, device {device}, {nbytes} bytes, "
                            f"{count} chunks, cached {cached}, {len(token)}-byte token")
    return kind, device, nbytes, token, count, cached, seq, ready


def add_chunks(chunks: list[tuple[int, int]], raw: Any, nbytes: int) -> None:
    """Append one batch of ``[offset, size]`` pairs, checking that they keep tiling ``[0, end)`` from 0.

    No chunk may reach past the payload rounded up to ``CHUNK_TAIL``: a region's last handle is at most
    that much longer than its payload, and a hostile sender must not make the receiver map (and populate)
    a huge sparse file for a small update.
    """
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("ipc: a handle message must carry a non-empty list of [offset, size] pairs")
    end = chunks[-1][0] + chunks[-1][1] if chunks else 0
    limit = -(-nbytes // CHUNK_TAIL) * CHUNK_TAIL
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not all(type(x) is int for x in item)
                or item[0] != end or item[1] <= 0 or end >= nbytes or item[0] + item[1] > limit):
            raise ProtocolError(f"ipc: chunk {len(chunks)} is {item!r}; chunks must be [offset, size] pairs "
                                f"tiling the payload of {nbytes} bytes from 0 (next offset {end}) and end "
                                f"by {limit}")
        chunks.append((item[0], item[1]))
        end += item[1]


def add_files(chunks: list[tuple[int, int]], raw: Any, nbytes: int) -> None:
    """Append one batch of ``[offset, length]`` file placements: increasing, not overlapping, each starting
    inside the payload (a file may hold bytes past it; only the payload's are read).  Unlike memory handles
    they need not tile the payload: what lies between files is no tensor's (headers, alignment)."""
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("ipc: a file message must carry a non-empty list of [offset, length] pairs")
    end = chunks[-1][0] + chunks[-1][1] if chunks else 0
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not all(type(x) is int for x in item)
                or item[0] < end or item[1] <= 0 or item[0] >= nbytes):
            raise ProtocolError(f"ipc: file {len(chunks)} is placed at {item!r}; files must be [offset, length] "
                                f"pairs in increasing order, not overlapping (next offset at least {end}), each "
                                f"starting inside the {nbytes}-byte payload")
        chunks.append((item[0], item[1]))
        end = item[0] + item[1]


def send_handles(sock: socket.socket, chunks: list[tuple[int, int, int]]) -> None:
    """Pass ``(offset, size, fd)`` chunks in ``F`` messages of at most ``FD_BATCH`` fds (the fds stay the
    caller's)."""
    for i in range(0, len(chunks), FD_BATCH):
        batch = chunks[i:i + FD_BATCH]
        send_message(sock, b"F" + msgpack.packb([[off, size] for off, size, _ in batch]), "memory handles",
                     [fd for *_, fd in batch])


def receive_handles(sock: socket.socket, count: int, nbytes: int, fds: list[int],
                    timeout: float) -> list[tuple[int, int]]:
    """``count`` (size, fd) handles tiling ``[0, nbytes)`` from ``F`` messages (none when ``count`` is 0); the
    fds also go into ``fds`` (the caller closes them)."""
    chunks, mine = _receive_batches(sock, count, nbytes, fds, timeout, add_chunks)
    if chunks and chunks[-1][0] + chunks[-1][1] < nbytes:
        raise ProtocolError(f"ipc: {count} chunks end at {chunks[-1][0] + chunks[-1][1]}, before the "
                            f"{nbytes}-byte payload does")
    return [(size, fd) for (_, size), fd in zip(chunks, mine)]


def receive_files(sock: socket.socket, count: int, nbytes: int, fds: list[int],
                  timeout: float) -> list[tuple[int, int, int]]:
    """``count`` ``(offset, length, fd)`` file placements (:func:`add_files`) from ``F`` messages, for a chunk
    table of kind :data:`FILES`; the fds also go into ``fds`` (the caller closes them).  Each fd is checked
    to be a regular file (not a pipe or socket that would block a copy).

    Raises
    ------
    ProtocolError
        A malformed placement list, or an fd that is not a regular file."""
    chunks, mine = _receive_batches(sock, count, nbytes, fds, timeout, add_files)
    for i, fd in enumerate(mine):
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ProtocolError(f"ipc: the sender passed file {i} as an fd that is not a regular file "
                                f"(mode {mode:#o})")
    return [(off, n, fd) for (off, n), fd in zip(chunks, mine)]


def _receive_batches(sock: socket.socket, count: int, nbytes: int, fds: list[int], timeout: float,
                     add: Any) -> tuple[list[tuple[int, int]], list[int]]:
    """``count`` chunks and their fds from ``F`` messages, each batch checked by ``add``."""
    chunks: list[tuple[int, int]] = []
    mine: list[int] = []
    while len(mine) < count:
        sock.settimeout(timeout)
        try:
            data, got, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, FD_BATCH, socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise TransferTimeout(f"ipc: the sender passed {len(mine)} of {count} handles and "
                                  f"stalled") from None
        except OSError as e:
            raise PeerLost(f"ipc: connection lost after {len(mine)} of {count} handles: {e}") from None
        fds.extend(got)
        mine.extend(got)
        if not data:
            raise PeerLost(f"ipc: the sender closed after {len(mine)} of {count} handles")
        if flags & socket.MSG_CTRUNC:
            raise TransferError(f"ipc: handles were dropped in transit after {len(mine)} of {count} (this "
                                f"process's open-file limit, RLIMIT_NOFILE, may be too low for so many "
                                f"chunks: raise it, or use larger chunks)")
        if data[:1] != b"F" or not got or flags & socket.MSG_TRUNC:
            raise ProtocolError(f"ipc: bad handle message ({data[:8]!r}, {len(got)} fds, flags {flags:#x}; "
                                f"{len(mine)} of {count} handles so far)")
        before = len(chunks)
        add(chunks, unpack(data[1:], "a handle message"), nbytes)
        if len(chunks) - before != len(got) or len(chunks) > count:
            raise ProtocolError(f"ipc: a handle message lists {len(chunks) - before} chunks but carries "
                                f"{len(got)} fds ({len(chunks)} of {count} chunks so far)")
    return chunks, mine


def close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class Watermark:
    """How far the sender's region may be copied: the header's ``ready``, raised by ``W`` messages.

    A plain sender says everything is ready in the header; then :meth:`wait` is one comparison per
    piece.  A fan-out relay's region is still landing from its own upstream: the copy threads wait here
    before each piece, one of them reading the sender's messages (each wait bounded by ``stall_timeout``)
    while the others wait for it.  Between waits the messages already there are taken without blocking,
    so a receiver busy copying never lets them fill the socket (the relay's sends would block).
    """

    def __init__(self, conn: socket.socket, nbytes: int, ready: int, stall_timeout: float) -> None:
        self.nbytes = nbytes
        self.ready = ready
        self._conn = conn
        self._timeout = stall_timeout
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._poller: Any = None
        if ready < nbytes:
            self._poller = select.poll()
            self._poller.register(conn, select.POLLIN)

    @property
    def complete(self) -> bool:
        return self.ready >= self.nbytes

    def wait(self, end: int) -> None:
        """Return once ``[0, end)`` is ready to copy.

        Raises
        ------
        TransferTimeout
            The watermark did not advance for ``stall_timeout`` seconds (the relay or its upstream stalled).
        ProtocolError
            A watermark that goes backwards or past the payload, or another message.
        PeerLost, TransferError
            The sender closed the connection, or gave up on the update (its upstream failed).
        """
        if self.ready >= end:
            if self.ready < self.nbytes and self._lock.acquire(blocking=False):
                try:
                    self._read(blocking=False)
                finally:
                    self._lock.release()
            return
        with self._lock:
            while self.ready < end:
                self._read(blocking=True)

    def _read(self, blocking: bool) -> None:
        """Take the sender's messages: one at least when ``blocking``, else only those already here."""
        if self._error is not None:
            raise self._error
        try:
            while self.ready < self.nbytes:
                if not self._poller.poll(self._timeout * 1000 if blocking else 0):
                    if not blocking:
                        return
                    raise TransferTimeout(f"ipc: the sender's region was ready up to offset {self.ready} of "
                                          f"{self.nbytes} and did not advance for {self._timeout} s (the relay or "
                                          f"its upstream stalled)")
                self._take(self._conn.recv(MAX_MESSAGE))
                blocking = False
        except BaseException as e:
            if isinstance(e, OSError) and not isinstance(e, TensorXferError):
                e = PeerLost(f"ipc: connection lost waiting for the sender's region to be ready past offset "
                             f"{self.ready}: {e}")
            self._error = e
            raise e from None

    def _take(self, msg: bytes) -> None:
        if not msg:
            raise PeerLost(f"ipc: the sender closed the connection with its region ready up to offset "
                           f"{self.ready} of {self.nbytes}")
        if msg[:1] == b"E":
            raise UpstreamFailed(f"ipc: the relay feeding this receiver gave up on this update: "
                                 f"{msg[1:].decode(errors='replace')}")
        if msg[:1] != b"W" or len(msg) != 1 + U64.size:
            raise ProtocolError(f"ipc: unexpected message from the sender during the copy: {msg[:16]!r}")
        value = U64.unpack(msg[1:])[0]
        if not self.ready < value <= self.nbytes:
            raise ProtocolError(f"ipc: watermark {value} after {self.ready}: it must grow, up to the payload's "
                                f"{self.nbytes} bytes")
        self.ready = value
