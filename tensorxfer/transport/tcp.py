"""The TCP data path: several parallel streams, straight from and into region memory.

The payload ``[0, nbytes)`` is cut into one contiguous slice per stream
(:func:`plan_slices`, 64 KiB aligned).  Each stream is its own TCP
connection, opened once per session (and region): the receiver opens a
listener for the setup update, each stream first sends a 52-byte header —
magic, setup update number, stream index, stream count and an HMAC proof
keyed by the session key over the accept frame's nonce — so a stranger who
connects to the port cannot inject bytes (the :class:`~tensorxfer.connections.Gate`
drops it, concurrently with the real streams), and once every stream proved
itself the listener closes.  Every update then sends, on each stream, a
12-byte update header (magic, update number) and its slice: a warm update
connects nothing.

Zero copy for host regions: the sender calls ``socket.sendall`` on
``memoryview`` slices of the region and the receiver ``recv_into`` region
slices, one thread per stream.  Both release the GIL for the whole system
call, so plain Python threads are used, not a Cython loop — decided by
measurement (``benchmarks/bench_tcp.py``, results in
``benchmarks/results/tcp-2026-12-02T1655Z.json``; 2-vCPU VM, loopback,
2 GB / 820 tensors, three rounds): with one stream tensorxfer moved 15.4,
21.5 and 8.7 Gbit/s against iperf3's 11.7, 10.5 and 6.2 with the same
stream count and byte count, i.e. the kernel's copies are the bottleneck and
the Python layer costs nothing measurable.  Writes go out in
``PIECE_BYTES`` pieces so progress can be reported and a stalled peer is
noticed: a piece that makes no progress for ``stall_timeout`` seconds fails
the transfer with :class:`TransferTimeout`.

The default of 4 streams is the measured best-or-tied on that machine
(1/2/3/4/6/8 streams: 4 was within noise of the best in every round; more
streams only add threads on 2 cores).  Socket buffers are left to the
kernel's autotuning: explicit 1 and 4 MiB buffers were not consistently
better (``benchmarks/results/tcp-sockbuf-2026-12-02.txt``: the VM's speed
drifted 3x between rounds, more than any buffer setting changed).  On
other machines ``TENSORXFER_TCP_STREAMS``, ``TENSORXFER_TCP_PIECE`` and
``TENSORXFER_TCP_SOCKBUF`` override the defaults.

GPU regions stage through pinned bounce buffers, the same code as host
regions (:mod:`tensorxfer.staging`: ``read_pieces`` / ``write_pieces``):
each stream owns a stager (two pinned buffers, its own CUDA stream) for the
session.  The sender's device→host copy of piece k+1 is queued before piece
k is sent; the receiver's host→device copy of piece k is queued while piece
k+1 is received into the other buffer.  The copies (~50 GB/s each way on an
H200) thus hide behind the network, and streams copy in parallel.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
from typing import TYPE_CHECKING, Any, ClassVar

from tensorxfer.connections import Gate, listen, recv_exact, send_all
from tensorxfer.errors import LinkDropped, PeerLost, ProtocolError, TransferTimeout
from tensorxfer.protocol import NONCE_BYTES, field, mac, nonce
from tensorxfer.staging import open_stager, read_pieces, write_pieces
from tensorxfer.transport.base import (
    MAX_STREAMS,
    Progress,
    ReceiverTransport,
    SenderTransport,
    TransferContext,
    setup_flag,
)
from tensorxfer.transport.segments import Segments
from tensorxfer.transport.tcp_streams import Streams, close_stagers, move_part, send_counted

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

log = logging.getLogger(__name__)

def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


# Tuning knobs, chosen by measurement (module docstring); the environment overrides them for other networks.
DEFAULT_STREAMS = _env_int("TENSORXFER_TCP_STREAMS", 4)
MIN_SLICE_BYTES = 4 << 20      # below this, another stream costs more than it brings
SLICE_ALIGN = 64 << 10
PIECE_BYTES = _env_int("TENSORXFER_TCP_PIECE", 8 << 20)            # one sendall: progress and stall granularity
# A forwarding sender (a fan-out relay, landing set) waits for each piece to land before sending it, so
# its piece is the chain's delay per hop: smaller than PIECE_BYTES (tensorxfer.fanout; bench_fanout.py).
FORWARD_PIECE_BYTES = _env_int("TENSORXFER_TCP_FORWARD_PIECE", 1 << 20)
SOCKET_BUFFER_BYTES = _env_int("TENSORXFER_TCP_SOCKBUF", 0)         # 0: the kernel's autotuning
HEADER_TIMEOUT = 5.0           # a connected stream must identify itself this fast
STREAM_MAGIC = b"TXS1"
STREAM_HEADER = struct.Struct(">4sQII32s")     # once per stream: magic, setup update, index, count, proof
UPDATE_MAGIC = b"TXU1"
UPDATE_HEADER = struct.Struct(">4sQ")          # every update, on every stream: magic, update number
RESUME_MAGIC = b"TXR1"
RESUME_HEADER = struct.Struct(">4sQQ")         # a replacement stream: magic, update number, where its share resumes


def plan_slices(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """Cut ``[0, nbytes)`` into at most ``streams`` contiguous ``(offset, length)`` slices.

    The receiver plans; the slice size travels in the accept descriptors and
    the sender rebuilds the same list with :func:`slices_of`.  Slices are
    ``SLICE_ALIGN``-aligned and at least ``MIN_SLICE_BYTES`` (so a small
    region uses fewer streams); an empty region has no slices.
    """
    if nbytes <= 0:
        return []
    k = max(1, min(streams, _ceil_div(nbytes, MIN_SLICE_BYTES)))
    return slices_of(nbytes, _ceil_div(_ceil_div(nbytes, k), SLICE_ALIGN) * SLICE_ALIGN)


def stream_parts(segments: Segments, streams: int) -> list[Segments]:
    """The receiver's cut of ``segments`` into one part per stream (at most ``streams``, each at least about
    MIN_SLICE_BYTES); the sender, told the count k, cuts ``segments.split(k)`` and must get the same parts.
    ``split(k)`` cuts between whole runs, so a few large runs (a resumed transfer's ranges) can make fewer
    than k parts, and ``split`` of that smaller count may cut elsewhere: settle on a k that makes k parts."""
    k = max(1, min(streams, _ceil_div(segments.total_bytes, MIN_SLICE_BYTES)))
    parts = segments.split(k)
    while len(parts) != k:
        k = len(parts)
        parts = segments.split(k)
    return parts


def slices_of(nbytes: int, slice_bytes: int) -> list[tuple[int, int]]:
    """``[0, nbytes)`` in consecutive slices of ``slice_bytes`` (the last one shorter)."""
    return [(off, min(slice_bytes, nbytes - off)) for off in range(0, nbytes, slice_bytes)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _stream_proof(ctx: TransferContext, stream_nonce: bytes, seq: int, index: int, count: int) -> bytes:
    return mac(ctx.session_key, b"tcp-stream", stream_nonce, struct.pack(">QII", seq, index, count))


def _tune(sock: socket.socket) -> None:
    # Streams stay open between updates: without TCP_NODELAY the last partial segment of a slice can
    # wait for the receiver's delayed ACK (up to 40 ms) before it leaves, on every update.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


class TcpReceiver(ReceiverTransport):
    """Receives a region over parallel TCP streams into region memory; the streams live for the session."""

    name: ClassVar[str] = "tcp"
    can_resume: ClassVar[bool] = True
    _closing = False

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._gate: Gate | None = None         # open only while a setup waits for its streams
        self._streams = Streams("recv")
        self._slices: list[tuple[int, int]] = []
        self._parts: list[Segments] | None = None     # a weight sync's runs, one part per stream (else slices)
        self._stagers: list[Any] = []          # one per stream for the session (None for host regions)
        self._region: TensorRegion | None = None
        self._nonce = b""
        self._seq = 0
        self._setup_seq = 0
        self._admit: set[int] = set()          # the stream indices the open gate admits
        self._resume_from: dict[int, int] = {}     # a resumed update: broken stream -> bytes of its share landed

    def prepare(self, region: TensorRegion, seq: int, fresh: bool, segments: Segments | None = None) -> dict[str, Any]:
        """Reuse the session's streams, or (first update, new region, ``fresh``) open a listener for new ones.

        Descriptors: ``setup``, ``streams``, ``slice_bytes``; on setup also ``port`` and ``nonce``.  With
        ``segments`` (a weight sync's runs into this region) each stream receives one part of them
        (:meth:`Segments.split`, cut the same way by the sender) and ``parts`` is true.
        """
        self._seq = seq
        requested = min(max(self.ctx.streams or DEFAULT_STREAMS, 1), MAX_STREAMS)
        parts = None
        if segments is not None:
            segments.check_within(1 << 63, region.nbytes)
            parts = stream_parts(segments, requested)
        if not fresh and region is self._region and self._gate is None and self._streams.socks \
                and (parts is None) == (self._parts is None) and (parts is None or len(parts) == len(self._slices)):
            self._parts = parts
            if parts is not None:       # a sync's new epoch: same streams, other runs
                self._slices = [(0, p.total_bytes) for p in parts]
            return self._descriptors(False)
        self._teardown()
        if parts is not None:
            self._parts, self._slices = parts, [(0, p.total_bytes) for p in parts]
        else:
            self._parts, self._slices = None, plan_slices(region.nbytes, requested)
        self._region = region
        self._nonce = nonce()
        self._setup_seq = seq
        self._admit = set(range(len(self._slices)))
        self._gate = Gate(listen(self.ctx.local_host), self._identify, min(HEADER_TIMEOUT, self.ctx.stall_timeout),
                          "tcp data stream")
        return dict(self._descriptors(True), port=self._gate.address[1], nonce=self._nonce)

    def _descriptors(self, setup: bool) -> dict[str, Any]:
        if self._parts is not None:
            return {"setup": setup, "streams": len(self._slices), "slice_bytes": 0, "parts": True}
        return {"setup": setup, "streams": len(self._slices), "slice_bytes": self._slices[0][1] if self._slices else 0}

    def wait(self, progress: Progress | None = None) -> int:
        """(On setup: admit every proven stream.)  Receive every slice; return the byte count.

        Raises
        ------
        PeerLost
            A stream closed or reset before its slice was complete.
        TransferTimeout
            Not every stream connected, or no bytes arrived, for ``stall_timeout`` s.
        """
        if self._region is None:
            raise ProtocolError("TcpReceiver.wait() before prepare()")
        if self._gate is not None:
            gate = self._gate
            try:
                admitted = gate.admit(len(self._slices), timeout=self.ctx.stall_timeout,
                                      abort=self.ctx.setup_abort("tcp", lambda: self._closing))
            finally:
                gate.close()        # every stream is here (or the setup failed): strangers find no listener
                self._gate = None
            # A proof binds its index, so two admitted streams with one index means a replayed header.
            by_index = dict((index, conn) for conn, index in admitted)
            if len(by_index) != len(admitted):
                for conn, _ in admitted:
                    conn.close()
                raise ProtocolError("tcp: two data streams proved the same stream index (a replayed header)")
            for index in range(len(self._slices)):
                _tune(by_index[index])
                self._streams.socks.append(by_index[index])
                self._stagers.append(open_stager(self._region, PIECE_BYTES))
            self.counters.connects += 1
        self._streams._progress = progress
        self._streams.begin(self.resumable)
        for index, sock in enumerate(self._streams.socks):
            self._streams.start(sock, self._recv_update, index, False, index=index)
        if self.meanwhile is not None:
            self.meanwhile()        # the streams receive in their threads meanwhile
        self._streams.join()
        total = sum(length for _, length in self._slices)
        # A GPU region's bytes are landed only once its stager copied them: such a stream resumes from its start.
        dropped = self._streams.dropped(total, landed_ok=not self._region.is_cuda)
        if dropped is not None:
            raise dropped
        self.counters.updates += 1
        return total

    def prepare_resume(self, dropped: LinkDropped) -> dict[str, Any]:
        """Open a listener for replacement streams of the broken ones; the descriptors say, per stream, how
        many bytes of its share landed (the sender sends from there).  Only a new connection that proves
        itself with the new nonce, this update's number and a broken stream's index is admitted."""
        if self._region is None or self._gate is not None:
            raise ProtocolError("TcpReceiver.prepare_resume() outside a broken update")
        self._resume_from = dict(dropped.landed)
        for index, landed in self._resume_from.items():
            self._streams.moved[index] = landed
        self._nonce, self._setup_seq, self._admit = nonce(), self._seq, set(self._resume_from)
        self._gate = Gate(listen(self.ctx.local_host), self._identify, min(HEADER_TIMEOUT, self.ctx.stall_timeout),
                          "tcp data stream (resumed)")
        return {"port": self._gate.address[1], "nonce": self._nonce,
                "streams": [[index, landed] for index, landed in sorted(self._resume_from.items())]}

    def wait_resume(self, progress: Progress | None = None) -> int:
        """Admit the replacement streams, receive the rest of their shares; return the bytes received."""
        gate = self._gate
        if gate is None or self._region is None:
            raise ProtocolError("TcpReceiver.wait_resume() before prepare_resume()")
        try:
            admitted = gate.admit(len(self._resume_from), timeout=self.ctx.stall_timeout,
                                  abort=self.ctx.setup_abort("tcp", lambda: self._closing))
        finally:
            gate.close()
            self._gate = None
        if len({index for _, index in admitted}) != len(admitted):
            for conn, _ in admitted:
                conn.close()
            raise ProtocolError("tcp: two resumed streams proved the same stream index (a replayed header)")
        for conn, index in admitted:
            _tune(conn)
            self._streams.replace(index, conn)
        self.counters.connects += 1
        before = sum(self._streams.moved)
        self._streams._progress = progress
        self._streams.broken.clear()
        for index in sorted(self._resume_from):
            self._streams.start(self._streams.socks[index], self._recv_update, index, True, index=index)
        self._streams.join()
        dropped = self._streams.dropped(sum(length for _, length in self._slices), not self._region.is_cuda)
        if dropped is not None:
            raise dropped
        self.counters.updates += 1
        return sum(self._streams.moved) - before

    def _identify(self, conn: socket.socket) -> int | None:
        """The stream index a new connection proves (None: a stranger, dropped by the gate)."""
        buf = recv_exact(conn, STREAM_HEADER.size, None, "a tcp stream header")
        magic, seq, index, count, proof = STREAM_HEADER.unpack(buf)
        expected = _stream_proof(self.ctx, self._nonce, seq, index, count) if index in self._admit else b""
        if (magic != STREAM_MAGIC or seq != self._setup_seq or count != len(self._slices)
                or not hmac.compare_digest(proof, expected)):
            return None
        return int(index)

    def _recv_update(self, sock: socket.socket, index: int, resumed: bool) -> None:
        start = 0
        if resumed:     # a replacement stream says where it resumes: it must be where this side's share ends
            magic, seq, start = RESUME_HEADER.unpack(recv_exact(sock, RESUME_HEADER.size, self.ctx.stall_timeout,
                                                                f"tcp stream {index}'s resume header"))
            if magic != RESUME_MAGIC or seq != self._seq or start != self._streams.moved[index]:
                raise ProtocolError(f"tcp stream {index}: resume header {magic!r}/{seq}/{start}, expected update "
                                    f"{self._seq} from byte {self._streams.moved[index]}")
        else:
            magic, seq = UPDATE_HEADER.unpack(recv_exact(sock, UPDATE_HEADER.size, self.ctx.stall_timeout,
                                                         f"tcp stream {index}'s update header"))
            if magic != UPDATE_MAGIC or seq != self._seq:
                raise ProtocolError(f"tcp stream {index}: update header {magic!r}/{seq}, expected update {self._seq}")
        if self._parts is not None:
            assert self._region is not None
            # (a host region's landed ranges go to on_piece: a partial update of tensorxfer-recv writes them)
            move_part(sock, self._region, self._parts[index], index, self._stagers[index], self.ctx.stall_timeout,
                       self._streams.counter(index), receive=True, start=start, piece_bytes=PIECE_BYTES,
                       on_piece=None if self._region.is_cuda else self.on_piece)
            return
        self._recv_slice(sock, index, start)

    def _recv_slice(self, sock: socket.socket, index: int, start: int) -> None:
        """Receive stream ``index``'s slice (from byte ``start`` of it) straight into region memory (host) or
        through its stager (GPU)."""
        assert self._region is not None
        offset, length = self._slices[index]
        offset, length = offset + start, length - start
        sock.settimeout(self.ctx.stall_timeout)
        count = self._streams.counter(index)
        pos = offset
        try:
            # A relay (tensorxfer.fanout) forwards host-region bytes as they land; a GPU region's slot is
            # copied to the device after it is yielded back, so a relay forwards those only once all landed.
            on_piece = self.on_piece if not self._region.is_cuda else None
            with write_pieces(self._region, offset, length, PIECE_BYTES, stager=self._stagers[index]) as pieces:
                for pos, piece in pieces:
                    got, n = 0, len(piece)
                    while got < n:
                        k = sock.recv_into(piece[got:])
                        if k == 0:
                            raise PeerLost(f"tcp stream {index}: sender closed the connection at region offset "
                                           f"{pos + got}; the transfer is incomplete")
                        if on_piece is not None:
                            on_piece(pos + got, k)
                        got += k
                        count(k)
        except TimeoutError:
            raise TransferTimeout(f"tcp stream {index}: no data for {self.ctx.stall_timeout} s at region offset "
                                  f"{pos}; the sender stalled") from None
        except ConnectionError as e:
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(f"tcp stream {index}: connection lost at region offset {pos}: {e}") from None

    def _teardown(self) -> None:
        self._streams.close()
        self._region = None
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.close()
        close_stagers(self._stagers)

    def close(self) -> None:
        """Close the listener and every stream; idempotent, callable from another thread."""
        self._closing = True
        self._teardown()


class TcpSender(SenderTransport):
    """Sends a region over parallel TCP streams, straight from region memory; the streams live for the session."""

    name: ClassVar[str] = "tcp"
    follows_landing: ClassVar[bool] = True     # each stream waits for every piece of its slice to land
    can_resume: ClassVar[bool] = True

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._streams = Streams("send")
        self._stagers: list[Any] = []          # one per stream for the session (None for host regions)
        self._count = 0
        self._slice_bytes = 0
        self._parts: list[Segments] | None = None     # a weight sync's runs, one part per stream
        self._region: TensorRegion | None = None
        self._seq = 0

    @classmethod
    def forward_piece_bytes(cls, region: TensorRegion, streams: int | None = None) -> int:
        """A host region is forwarded in FORWARD_PIECE_BYTES pieces; a GPU region's staged slices only once
        they landed whole (see :meth:`_send_update`), so there the relay stores and forwards."""
        return region.nbytes if region.is_cuda else min(region.nbytes, FORWARD_PIECE_BYTES)

    def needs_setup(self, region: TensorRegion) -> bool:
        return region is not self._region or not self._streams.socks

    def connect(self, region: TensorRegion, seq: int, descriptors: dict[str, Any],
                segments: Segments | None = None) -> None:
        """On setup open and authenticate one connection per stream the receiver asked for; else reuse them.
        With ``segments`` each stream sends one part of them (cut as the receiver cut them).

        Raises
        ------
        ProtocolError
            Malformed descriptors, or "reuse" when this side has other streams or none.
        PeerLost
            A stream could not connect.
        """
        self._seq = seq
        count = field(descriptors, "streams", int)
        slice_bytes = field(descriptors, "slice_bytes", int)
        if (descriptors.get("parts") is True) != (segments is not None):
            raise ProtocolError("tcp: the receiver and this sender disagree on whether this update moves segments")
        self._parts = None
        if segments is not None:
            segments.check_within(region.nbytes, 1 << 63)
            self._parts = segments.split(count)
            if not 0 < count <= MAX_STREAMS or len(self._parts) != count:
                raise ProtocolError(f"tcp: the receiver asked for {count} streams; these segments make "
                                    f"{len(self._parts)} parts")
            slice_bytes = 0
        elif not 0 <= count <= MAX_STREAMS or slice_bytes < 0 or (count > 0) != (slice_bytes > 0):
            raise ProtocolError(f"tcp accept descriptors out of range: {count} streams of {slice_bytes} bytes")
        if not setup_flag(descriptors):
            if region is not self._region or (count, slice_bytes) != (self._count, self._slice_bytes):
                raise ProtocolError("tcp: the receiver reuses streams this sender did not set up for this region")
            return
        port = field(descriptors, "port", int)
        stream_nonce = field(descriptors, "nonce", bytes)
        if not 0 < port < 65536 or len(stream_nonce) != NONCE_BYTES:
            raise ProtocolError(f"tcp accept descriptors out of range: port {port}, {len(stream_nonce)}-byte nonce")
        self._streams.close()
        close_stagers(self._stagers)
        self._region = None
        self._count = count
        self._slice_bytes = slice_bytes
        for index in range(count):
            try:
                sock = socket.create_connection((self.ctx.peer_host, port), timeout=self.ctx.stall_timeout)
            except OSError as e:
                raise PeerLost(f"tcp stream {index}: cannot connect to {self.ctx.peer_host}:{port}: {e}") from None
            self._streams.socks.append(sock)
            _tune(sock)
            header = STREAM_HEADER.pack(STREAM_MAGIC, seq, index, count,
                                        _stream_proof(self.ctx, stream_nonce, seq, index, count))
            send_all(sock, header, self.ctx.stall_timeout, f"tcp stream {index}'s header")
            self._stagers.append(open_stager(region, PIECE_BYTES))
        self._region = region
        self.counters.connects += 1

    def send(self, region: TensorRegion, progress: Progress | None = None) -> int:
        """Send every slice on its own stream, in parallel; return the byte count.

        Raises
        ------
        PeerLost
            The receiver closed or reset a stream.
        TransferTimeout
            A stream made no progress for ``stall_timeout`` seconds.
        LinkDropped
            ``resumable``: some streams broke (the others finished); :meth:`resume` may send the rest.
        """
        if self._parts is not None:
            return self._send_parts(region, progress)
        slices = slices_of(region.nbytes, self._slice_bytes) if self._slice_bytes else []
        if len(slices) != self._count or region is not self._region:
            raise ProtocolError(f"receiver asked for {self._count} streams of {self._slice_bytes} bytes; "
                                f"{region.nbytes} bytes make {len(slices)} such slices")
        self._streams.begin(self.resumable)
        self._run_streams(region, progress, {index: None for index in range(self._count)})
        self.counters.updates += 1
        return region.nbytes

    def _run_streams(self, region: TensorRegion, progress: Progress | None, starts: dict[int, int | None]) -> None:
        """Send stream ``i``'s share on its socket for every ``i`` in ``starts`` (``None``: the whole share
        after an update header; else from that byte after a resume header); a broken stream of a resumable
        update raises :class:`LinkDropped` once the others finished (their streams stay), anything else
        closes every stream."""
        self._streams._progress = progress
        target = self._send_part if self._parts is not None else self._send_update
        try:
            for index, start in starts.items():
                self._streams.start(self._streams.socks[index], target, region, index, start, index=index)
            self._streams.join()
        except BaseException:
            self._streams.close()
            self._region = None
            raise
        dropped = self._streams.dropped(self._total(region))
        if dropped is not None:
            raise dropped

    def _total(self, region: TensorRegion) -> int:
        return sum(p.total_bytes for p in self._parts) if self._parts is not None else region.nbytes

    def _share(self, region: TensorRegion, index: int) -> int:
        """Bytes stream ``index`` moves in one update."""
        if self._parts is not None:
            return self._parts[index].total_bytes
        return slices_of(region.nbytes, self._slice_bytes)[index][1]

    def _header(self, sock: socket.socket, index: int, start: int | None) -> None:
        header = (UPDATE_HEADER.pack(UPDATE_MAGIC, self._seq) if start is None else
                  RESUME_HEADER.pack(RESUME_MAGIC, self._seq, start))
        send_all(sock, header, self.ctx.stall_timeout, f"tcp stream {index}'s update header")

    def resume(self, region: TensorRegion, descriptors: dict[str, Any],
               progress: Progress | None = None) -> tuple[int, int]:
        """Reconnect each stream the receiver's ``resume`` descriptors name (proved with their nonce) and send
        its share from where the receiver says it landed; return ``(bytes sent, bytes sent again)``."""
        if region is not self._region:
            raise ProtocolError("tcp: resume() for a region this sender is not sending")
        port = field(descriptors, "port", int)
        stream_nonce = field(descriptors, "nonce", bytes)
        wanted = field(descriptors, "streams", list)
        if not 0 < port < 65536 or len(stream_nonce) != NONCE_BYTES or not 0 < len(wanted) <= self._count:
            raise ProtocolError(f"tcp resume descriptors out of range: port {port}, {len(wanted)} streams")
        starts: dict[int, int] = {}
        for item in wanted:
            if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)
                    and 0 <= item[0] < self._count and item[0] not in starts
                    and 0 <= item[1] <= self._share(region, item[0])):
                raise ProtocolError(f"tcp resume descriptors: {item!r} is no stream of this update and a "
                                    f"byte of its share")
            starts[item[0]] = item[1]
        again = sum(max(0, self._streams.moved[i] - start) for i, start in starts.items())
        for index, start in starts.items():
            try:
                sock = socket.create_connection((self.ctx.peer_host, port), timeout=self.ctx.stall_timeout)
            except OSError as e:
                raise PeerLost(f"tcp stream {index}: cannot reconnect to {self.ctx.peer_host}:{port}: {e}") from None
            self._streams.replace(index, sock)
            _tune(sock)
            send_all(sock, STREAM_HEADER.pack(STREAM_MAGIC, self._seq, index, self._count,
                                              _stream_proof(self.ctx, stream_nonce, self._seq, index, self._count)),
                     self.ctx.stall_timeout, f"tcp stream {index}'s header")
            self._streams.moved[index] = start
        self.counters.connects += 1
        before = sum(self._streams.moved)
        self._streams.broken.clear()
        try:
            self._run_streams(region, progress, dict(starts))
        except LinkDropped as e:
            e.resent = again
            raise
        self.counters.updates += 1
        return sum(self._streams.moved) - before, again

    def _send_parts(self, region: TensorRegion, progress: Progress | None) -> int:
        """A weight sync's update: each stream sends its part of the segments, gathered from region memory."""
        parts = self._parts
        assert parts is not None
        if region is not self._region or len(parts) != len(self._streams.socks):
            raise ProtocolError("tcp: send() of segments before connect() for this region")
        self._streams.begin(self.resumable)
        self._run_streams(region, progress, {index: None for index in range(len(parts))})
        self.counters.updates += 1
        return sum(p.total_bytes for p in parts)

    def _send_part(self, sock: socket.socket, region: TensorRegion, index: int, start: int | None) -> None:
        """One stream's part of a weight sync's segments (from byte ``start`` of it: resumed)."""
        assert self._parts is not None
        self._header(sock, index, start)
        move_part(sock, region, self._parts[index], index, self._stagers[index], self.ctx.stall_timeout,
                   self._streams.counter(index), receive=False, start=start or 0, piece_bytes=PIECE_BYTES)

    def _send_update(self, sock: socket.socket, region: TensorRegion, index: int, start: int | None) -> None:
        """One stream's share of an update: the update header (or, resumed, the resume header), then its slice
        (from byte ``start`` of it) from region memory (or staged)."""
        self._header(sock, index, start)
        offset, length = slices_of(region.nbytes, self._slice_bytes)[index]
        offset, length = offset + (start or 0), length - (start or 0)
        sock.settimeout(self.ctx.stall_timeout)
        count = self._streams.counter(index)
        pos = offset
        # A relay waits for each piece to land before sending it (in FORWARD_PIECE_BYTES pieces: the chain's
        # delay per hop).  Staged (GPU) reads run ahead of the loop, so there it waits for the whole slice.
        wait = self.landing.wait_range if self.landing is not None else None
        piece_bytes = FORWARD_PIECE_BYTES if wait is not None and not region.is_cuda else PIECE_BYTES
        if wait is not None and region.is_cuda:
            wait(offset, length)
            wait = None
        try:
            with read_pieces(region, offset, length, piece_bytes, stager=self._stagers[index]) as pieces:
                for pos, piece in pieces:
                    if wait is not None:
                        wait(pos, len(piece))
                    send_counted(sock, piece, count)
        except TimeoutError:
            raise TransferTimeout(f"tcp stream {index}: receiver stopped reading for {self.ctx.stall_timeout} s "
                                  f"at region offset {pos}") from None
        except OSError as e:
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(f"tcp stream {index}: receiver closed the connection at region offset {pos}: "
                           f"{e}") from None

    def close(self) -> None:
        """Close every stream; idempotent, callable from another thread."""
        self._streams.close()
        close_stagers(self._stagers)
        self._region = None
