"""The ``rdma`` transport for the engine: one MR and one QP set per session, one RDMA WRITE per update.

The engine's ``accept`` frame only carries receiver → sender, but RC QPs
need both ends' numbers.  So on the *setup* update (the session's first, or
the first after the region changed) the sender → receiver half travels over
a TCP *side connection*, authenticated like tcp.py's streams:

1. receiver :meth:`RdmaReceiver.prepare` creates an
   :class:`~tensorxfer.transport.rdma.RdmaReceiverEndpoint` (one MR over the
   region, REMOTE_WRITE only while the session lives), opens a side listener
   on ``ctx.local_host`` and returns the endpoint's descriptors plus
   ``side_port``, ``nonce`` and ``streams`` (the QP count);
2. sender :meth:`RdmaSender.connect` registers its region, connects its QPs,
   opens the side connection and sends ``SIDE_HEADER`` (magic, update
   number, body length, HMAC proof keyed by the session key over nonce,
   update number and body) followed by its msgpack descriptors (at most
   ``MAX_DESCRIPTOR_BYTES``);
3. the receiver's :class:`~tensorxfer.connections.Gate` drops connections
   that fail the proof (strangers, concurrently), the receiver connects its
   QPs, closes the listener and answers ``READY`` (its QPs are RTR).

Every update — the setup one and each later one — is then only the nogil
WRITE loop on the sender, its last request per QP ``RDMA_WRITE_WITH_IMM``
carrying the update number, and the receiver's wait for every QP's
immediate; the engine's ``done``/``ack`` frames close it.  Nothing is
registered or connected again until the region changes or the session ends
(``counters`` prove it).  The side socket stays open for the session: its
closing is how either side notices the other died mid-write (polled every
50 ms), a stall is :class:`TransferTimeout`, bad descriptors
:class:`ProtocolError`, and a failed work completion is
:class:`~tensorxfer.errors.CompletionError` naming the status, QP, offset
and length (``IBV_WC_LOC_PROT_ERR`` is a short local MR, never "peer lost").

Fan-out relays (``tensorxfer.fanout``) are pipelined, not store and forward:

- a relay's receiver (``on_piece`` set by the session before ``prepare``)
  asks in its accept descriptors for piece marks (``marks``: every K-th
  request per QP is a WRITE_WITH_IMM carrying ``0x80000000 | its index on
  the QP``; ``wr_size``: the request size to use, so the marks map to
  bytes).  RC delivers in order per QP, so the marks prove a contiguous
  prefix, passed to ``on_piece`` as it grows; a mark that is not the next
  one expected is a :class:`TransferError`.  Final immediates carry the
  update number mod 2^31, so they never look like marks;
- a relay's sender (``landing`` set) runs a thread that raises a
  one-uint64 gate from ``landing.wait_prefix`` as its own copy lands; the nogil
  write loop posts no request past it and sleeps while only the gate holds
  it back (not counted as the receiver stalling).  When the relay's
  upstream fails, ``wait_prefix`` raises :class:`UpstreamFailed` and the
  write is aborted with it (the session then closes the hop, so the next
  hop sees its sender gone).

Without either hook nothing changes on the wire or in the write loop.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack

from tensorxfer.connections import Gate, listen, recv_exact, send_all
from tensorxfer.errors import (
    LinkDropped,
    PeerLost,
    ProtocolError,
    TransferError,
    TransferTimeout,
    UpstreamFailed,
    VerbsError,
)
from tensorxfer.protocol import MAX_FRAME_DEPTH, MAX_FRAME_OBJECTS, NONCE_BYTES, field, mac, nonce, scan_msgpack
from tensorxfer.transport.base import (
    PrefixFollower,
    Progress,
    ReceiverTransport,
    SenderTransport,
    TransferContext,
    setup_flag,
)
from tensorxfer.transport.rdma import (
    DEFAULT_QPS,
    DEFAULT_WR_SIZE,
    RdmaReceiverEndpoint,
    RdmaSenderEndpoint,
    _check_peer,
    rdma_available,
)
from tensorxfer.transport.rdma_breaks import (
    DRAIN_SECONDS,
    RESUME_MARKS,
    RESUME_WR_SIZE,
    BreakNotices,
    Fault,
    PeerBroke,
    check_resume,
    dropped_at,
    marks_asked,
    requests_bytes,
)
from tensorxfer.transport.segments import Segments

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

log = logging.getLogger(__name__)

DEVICE_ENV = "TENSORXFER_RDMA_DEVICE"    # RDMA device to use (default: the first one)
MAX_QPS = 16
MAX_DESCRIPTOR_BYTES = 64 << 10
HEADER_TIMEOUT = 5.0                     # a connected side socket must identify itself this fast
SIDE_MAGIC = b"TXR1"
SIDE_HEADER = struct.Struct(">4sQI32s")  # magic, setup update number, descriptor length, proof
READY = b"R"
_FIRST_CHUNK_ONLY = False                # test switch: register only the first chunk (the UCX bug, on purpose)
#: The receiver's wait has no per-byte progress (completion is one immediate per QP), so its
#: timeout is ``stall_timeout`` plus the region at this floor rate (Soft-RoCE in a TCG VM: ~20 MB/s).
RATE_FLOOR_BYTES_PER_S = 10e6
#: A relay's piece: its receiver asks for a mark every ``RELAY_PIECE_BYTES // (wr_size * QPs)``-th request
#: per QP (at least every one), so its next hop may be sent up to the landed prefix in steps this big.
RELAY_PIECE_BYTES = 4 << 20
RELAY_WR_SIZE = DEFAULT_WR_SIZE          # the request size a relay asks its sender for (marks count requests)
_FAULT: Fault | None = None     # test switch: break a QP for real mid-update (see Fault)


def relay_marks(qps: int) -> int:
    """Every how many requests per QP a relay's receiver asks for a piece mark."""
    return max(1, RELAY_PIECE_BYTES // (RELAY_WR_SIZE * qps))


def _device() -> str | None:
    return os.environ.get(DEVICE_ENV) or None


def _available() -> str | None:
    ok, reason = rdma_available(_device())
    return None if ok else reason


def _proof(ctx: TransferContext, side_nonce: bytes, seq: int, body: bytes) -> bytes:
    return mac(ctx.session_key, b"rdma-side", side_nonce, struct.pack(">Q", seq), body)


class _Owned(BreakNotices):
    """close() from any thread: it wakes the owner, who releases on its way out (one owner per resource)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closing = False
        self._busy = 0
        self._side: socket.socket | None = None
        self._side_lock = threading.Lock()     # posting threads check the side connection concurrently
        self._seq = 0               # the update under way
        self._attempt = 0           # its resume round (0: the first pass)
        self._peer_broke = False    # the peer's break notice for this round was read

    def _enter(self) -> None:
        with self._lock:
            if self._closing:
                raise PeerLost("rdma: the transport was closed")
            self._busy += 1

    def _exit(self) -> None:
        with self._lock:
            self._busy -= 1
            release = self._closing and self._busy == 0
        if release:
            self._release()

    def close(self) -> None:
        """Release the endpoint and sockets; idempotent, callable from another thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            release = self._busy == 0
        side = self._side
        if side is not None:
            try:
                side.shutdown(socket.SHUT_RDWR)   # wakes a blocked recv; the RDMA polls see _closing
            except OSError:
                pass
        if release:
            self._release()

    def _release(self) -> None:
        raise NotImplementedError


class RdmaReceiver(_Owned, ReceiverTransport):
    """Lets the sender RDMA-WRITE the region into its memory (registered once per session); waits per update."""

    name: ClassVar[str] = "rdma"
    can_resume: ClassVar[bool] = True

    def __init__(self, ctx: TransferContext) -> None:
        ReceiverTransport.__init__(self, ctx)
        _Owned.__init__(self)
        self._resume = False        # this update asked for a mark on every request: it can resume
        self._landed: list[int] = []    # a broken update: per QP, its requests that landed
        self._resume_nonce = b""
        self._endpoint: RdmaReceiverEndpoint | None = None
        self._gate: Gate | None = None
        self._region: TensorRegion | None = None
        self._nonce = b""
        self._nbytes = 0
        self._seq = 0               # the update being received: every QP's immediate carries it
        self._setup_seq = 0
        self._marks = 0             # this update's piece marks: every _marks-th request per QP (0: none)
        self._moving: int | None = None     # a weight sync's bytes (else the whole region)

    @classmethod
    def available(cls) -> str | None:
        return _available()

    def prepare(self, region: TensorRegion, seq: int, fresh: bool, segments: Segments | None = None) -> dict[str, Any]:
        """Reuse the session's MR and QPs, or (first update, new region, ``fresh``) register the region
        (REMOTE_WRITE) and open the side listener.  Descriptors: ``setup``, ``streams``; on setup the
        endpoint's and ``side_port``, ``nonce``; for a relay (``on_piece`` set) ``marks`` and ``wr_size``.
        With ``segments`` (a weight sync) the sender writes just those runs, wherever they go in ``region``:
        nothing changes here but the byte count."""
        self._enter()
        try:
            self._seq, self._attempt, self._peer_broke = seq, 0, False
            if segments is not None:
                segments.check_within(1 << 63, region.nbytes)
            self._moving = segments.total_bytes if segments is not None else None
            # resumable (set by the session before prepare): a plain update, not a relay's or a weight sync's
            self._resume = self.resumable and self.on_piece is None and segments is None
            self._landed, self._resume_nonce = [], b""
            endpoint = self._endpoint
            if not fresh and region is self._region and endpoint is not None and self._side is not None:
                return {"setup": False, **self._ask_marks(endpoint.qp_count)}
            self._teardown()
            qps = min(max(self.ctx.streams or DEFAULT_QPS, 1), MAX_QPS)
            self._endpoint = RdmaReceiverEndpoint(region, _device(), qps=qps)
            self.counters.registrations += 1
            self.registration = self._endpoint.mr_path
            self._region, self._nbytes, self._nonce, self._setup_seq = region, region.nbytes, nonce(), seq
            # The sender registers its region before it connects: allow for that as for the transfer itself.
            self._gate = Gate(listen(self.ctx.local_host), self._identify,
                              min(HEADER_TIMEOUT, self.ctx.stall_timeout), "rdma side")
            return {**self._endpoint.descriptors(), "setup": True, "side_port": self._gate.address[1],
                    "nonce": self._nonce, **self._ask_marks(qps)}
        finally:
            self._exit()

    def _ask_marks(self, qps: int) -> dict[str, Any]:
        """``streams``, and for a relay the marks it asks the sender for: one-sided writes tell a receiver
        nothing until the last immediate per QP, so without marks it could forward only once all landed."""
        if self._resume:
            self._marks = RESUME_MARKS
            return {"streams": qps, "marks": self._marks, "wr_size": RESUME_WR_SIZE, "resume": True}
        self._marks = relay_marks(qps) if self.on_piece is not None else 0
        if not self._marks:
            return {"streams": qps}
        return {"streams": qps, "marks": self._marks, "wr_size": RELAY_WR_SIZE}

    def wait(self, progress: Progress | None = None) -> int:
        """(On setup: take the sender's descriptors, connect the QPs, say READY.)  Wait for the update.

        Raises
        ------
        PeerLost
            The side connection closed (the sender died) before the update landed.
        TransferTimeout
            No sender connected within ``stall_timeout``, or the update did not land in time.
        ProtocolError
            The authenticated sender's descriptors are malformed or do not match.
        CompletionError
            A receive work completion failed (its status, QP named).
        LinkDropped
            A resumable update broke (a QP in the error state here or at the sender, or no mark for
            ``stall_timeout``): every QP was stopped and what landed counted, per QP; see :meth:`prepare_resume`.
        """
        self._enter()
        try:
            endpoint = self._endpoint
            if endpoint is None:
                raise ProtocolError("RdmaReceiver.wait() before prepare()")
            if self._gate is not None:
                endpoint.connect(self._admit())
                assert self._side is not None
                send_all(self._side, READY, self.ctx.stall_timeout, "READY")
                self.counters.connects += 1
            self._land(endpoint, None)
        finally:
            self._exit()
        self.counters.updates += 1
        moved = self._nbytes if self._moving is None else self._moving
        if progress is not None:
            progress(moved)
        return moved

    def _land(self, endpoint: RdmaReceiverEndpoint, starts: list[int] | None) -> None:
        """Wait for the update (resumed: for the rest of it, QP ``q`` from request ``starts[q]``)."""
        # With a mark per request the timeout counts from the last one; without, the whole region must fit.
        timeout = self.ctx.stall_timeout + (0 if self._resume else self._nbytes / RATE_FLOOR_BYTES_PER_S)
        try:
            endpoint.wait_complete(timeout, peer_alive=self._alive, update=self._seq, marks=self._marks,
                                   wr_size=RESUME_WR_SIZE if self._resume else RELAY_WR_SIZE,
                                   on_piece=self.on_piece if self._marks and not self._resume else None,
                                   starts=starts)
        except (VerbsError, TransferError) as e:
            if not self._is_break(e):
                raise
            if not isinstance(e, PeerBroke):
                self._tell_broke()      # the sender's QPs see nothing of a break here: say it
            if not self._resume:
                raise
            raise self._dropped(endpoint, e) from None

    def _alive(self) -> bool:
        if _FAULT is not None and self._endpoint is not None:
            _FAULT.on_receiver(self._endpoint, self._nbytes)
        return self._peer_alive()

    def _dropped(self, endpoint: RdmaReceiverEndpoint, e: BaseException) -> LinkDropped:
        """Stop every QP, count what landed on each (exact: a mark per request, RC in order), keep it for the
        resume; the :class:`LinkDropped` names the broken QP and the landed bytes of each unfinished share."""
        self._landed = endpoint.halt_and_count(DRAIN_SECONDS)
        return dropped_at(endpoint, e, self._landed, self._nbytes, unfinished=True)

    def prepare_resume(self, dropped: LinkDropped) -> dict[str, Any]:
        """New QPs under the same MR (registration is not paid again); descriptors: theirs, ``attempt``, a fresh
        ``nonce`` the sender proves its new QPs' descriptors with, and ``from``: per QP the requests of its share
        that landed (the sender writes the rest)."""
        self._enter()
        try:
            endpoint = self._endpoint
            if endpoint is None or not self._resume or not self._landed:
                raise ProtocolError("RdmaReceiver.prepare_resume() outside a broken resumable update")
            endpoint.renew()
            self._attempt += 1
            self._peer_broke = False
            self._resume_nonce = nonce()
            return {**endpoint.descriptors(), "attempt": self._attempt, "nonce": self._resume_nonce,
                    "from": list(self._landed)}
        finally:
            self._exit()

    def wait_resume(self, progress: Progress | None = None) -> int:
        """Take the sender's new QPs (proved on the side connection), connect, say READY, and wait for the rest;
        return the bytes that landed in this round.  Raises LinkDropped (it broke again: what landed is counted
        on), TransferTimeout / PeerLost (no new QPs from the sender within ``stall_timeout``, or it is gone)."""
        self._enter()
        try:
            endpoint = self._endpoint
            if endpoint is None or not self._resume_nonce:
                raise ProtocolError("RdmaReceiver.wait_resume() before prepare_resume()")
            endpoint.connect(self._resumed_sender())
            assert self._side is not None
            send_all(self._side, READY, self.ctx.stall_timeout, "READY")
            self.counters.connects += 1
            before = requests_bytes(self._landed, self._nbytes)
            self._land(endpoint, self._landed)
        finally:
            self._exit()
        self.counters.updates += 1
        moved = self._nbytes - before
        if progress is not None:
            progress(moved)
        return moved

    def _resumed_sender(self) -> dict[str, Any]:
        """The sender's new descriptors from the side connection, proved with this round's nonce."""
        wait = self.ctx.stall_timeout
        magic, seq, length, proof = SIDE_HEADER.unpack(self._read_side(SIDE_HEADER.size, wait, "the resume header"))
        if magic != SIDE_MAGIC or seq != self._seq or length > MAX_DESCRIPTOR_BYTES:
            raise ProtocolError(f"rdma: resume header {magic!r}/{seq}/{length}, expected update {self._seq}")
        body = self._read_side(length, wait, "the resumed sender's descriptors")
        if not hmac.compare_digest(proof, _proof(self.ctx, self._resume_nonce, seq, body)):
            raise ProtocolError("rdma: the resumed sender's descriptors do not carry this round's proof")
        return self._decode_sender(body)

    def _admit(self) -> dict[str, Any]:
        """The first side connection that proves itself; its decoded descriptors."""
        gate = self._gate
        assert gate is not None
        try:
            [(conn, body)] = gate.admit(1, timeout=self.ctx.stall_timeout + self._nbytes / RATE_FLOOR_BYTES_PER_S,
                                        abort=self.ctx.setup_abort("rdma", lambda: self._closing))
        except TransferTimeout:
            raise TransferTimeout(f"rdma: the sender did not open its side connection within "
                                  f"{self.ctx.stall_timeout} s") from None
        except TransferError as e:
            raise PeerLost(str(e)) from None
        finally:
            self._gate = None
            gate.close()        # connected (or failed): strangers find no listener
        with self._lock:
            if self._closing:
                conn.close()
                raise PeerLost("rdma: the transport was closed while the sender connected")
            self._side = conn
        return self._decode_sender(body)

    @staticmethod
    def _decode_sender(body: bytes) -> dict[str, Any]:
        try:
            scan_msgpack(body, MAX_FRAME_OBJECTS, MAX_FRAME_DEPTH, what="rdma: the sender's descriptors")
            peer = msgpack.unpackb(body, raw=False)
        except ProtocolError:
            raise
        except Exception as e:    # any decoding failure of an authenticated peer
            raise ProtocolError(f"rdma: the sender's descriptors are not valid msgpack: {e}") from None
        return _check_peer(peer, "sender")

    def _identify(self, conn: socket.socket) -> bytes | None:
        """The descriptor body a new side connection proves, or None for a stranger (the gate drops it)."""
        magic, seq, length, proof = SIDE_HEADER.unpack(recv_exact(conn, SIDE_HEADER.size, None, "header"))
        if magic != SIDE_MAGIC or seq != self._setup_seq or length > MAX_DESCRIPTOR_BYTES:
            return None
        body = recv_exact(conn, length, None, "descriptors")
        return body if hmac.compare_digest(proof, _proof(self.ctx, self._nonce, seq, body)) else None

    def _teardown(self) -> None:
        side, self._side = self._side, None
        gate, self._gate = self._gate, None
        endpoint, self._endpoint = self._endpoint, None
        self._region = None
        if side is not None:
            side.close()
        if gate is not None:
            gate.close()
        if endpoint is not None:
            endpoint.close()        # deregisters the MR: remote write ends with the session

    _release = _teardown


class RdmaSender(_Owned, SenderTransport):
    """RDMA-WRITEs the region into the receiver's registered memory; registered and connected once per session."""

    name: ClassVar[str] = "rdma"
    follows_landing: ClassVar[bool] = True     # the write loop posts nothing past the landed prefix
    can_resume: ClassVar[bool] = True

    def __init__(self, ctx: TransferContext) -> None:
        SenderTransport.__init__(self, ctx)
        _Owned.__init__(self)
        self._resume = False        # the receiver asked for resume marks: a break is LinkDropped
        self._posted: list[int] = []    # a broken write: per QP, the requests it had posted
        self._mr_peer: tuple[int, int, int] | None = None    # the receiver's (addr, rkey, length): kept on resume
        self._endpoint: RdmaSenderEndpoint | None = None
        self._region: TensorRegion | None = None
        self._seq = 0               # the update being sent: the immediates carry it
        self._marks = 0             # piece marks the receiver asked for (every _marks-th request per QP)
        self._wr_size: int | None = None
        self._runs: Any = None      # a weight sync's runs: (local offsets, remote offsets, bytes)

    @classmethod
    def available(cls) -> str | None:
        return _available()

    @classmethod
    def forward_piece_bytes(cls, region: TensorRegion, streams: int | None = None) -> int:
        """The piece a relay's receiver marks: ``marks`` requests on each of ``streams`` QPs."""
        qps = min(max(streams or DEFAULT_QPS, 1), MAX_QPS)
        return min(region.nbytes, relay_marks(qps) * RELAY_WR_SIZE * qps)

    def needs_setup(self, region: TensorRegion) -> bool:
        # broken: an update whose QPs broke after every byte landed was acked as it was; its QPs are in the
        # error state and nothing resumes it, so the next update sets up again (rare: the window between the
        # last request landing and its completion)
        return (region is not self._region or self._endpoint is None or self._side is None
                or self._endpoint.broken)

    def connect(self, region: TensorRegion, seq: int, descriptors: dict[str, Any],
                segments: Segments | None = None) -> None:
        """On setup: register the region, connect QPs to the receiver's, send ours over the side connection,
        wait for READY.  Else check the session's endpoint serves ``region``.  With ``segments`` (a weight
        sync) the update writes just those runs, each to its place in the receiver's region.

        Raises
        ------
        ProtocolError
            Malformed descriptors, or "reuse" when this side has nothing to reuse.
        PeerLost, TransferTimeout
            The side connection failed or READY did not come.
        """
        self._enter()
        try:
            self._seq, self._attempt, self._peer_broke = seq, 0, False
            self._runs = segments.flat() if segments is not None else None
            self._marks, self._wr_size = marks_asked(descriptors)
            self._resume = descriptors.get("resume") is True and self._marks == RESUME_MARKS and self._runs is None
            self._posted = []
            if self._runs is not None and self._marks:
                raise ProtocolError("rdma: a weight sync's segments cannot be relayed with piece marks")
            if not setup_flag(descriptors):
                if self.needs_setup(region):
                    raise ProtocolError("rdma: the receiver reuses QPs this sender did not set up for this region")
                self._check_wr_size()
                return
            side_port = field(descriptors, "side_port", int)
            side_nonce = field(descriptors, "nonce", bytes)
            peer = _check_peer(descriptors, "receiver")
            if not 0 < side_port < 65536 or len(side_nonce) != NONCE_BYTES or not 1 <= len(peer["qps"]) <= MAX_QPS:
                raise ProtocolError(f"rdma accept descriptors out of range: side port {side_port}, "
                                    f"{len(side_nonce)}-byte nonce, {len(peer['qps'])} QPs")
            self._teardown()
            self._endpoint = RdmaSenderEndpoint(region, _device(), qps=len(peer["qps"]),
                                                _first_chunk_only=_FIRST_CHUNK_ONLY)
            self.counters.registrations += 1
            self.registration = self._endpoint.mr_path
            self._endpoint.connect(peer, scatter=self._runs is not None)
            self._mr_peer = (peer["addr"], peer["rkey"], peer["length"])
            self._check_wr_size()
            side = self._open_side(side_port)
            body = msgpack.packb(self._endpoint.descriptors())
            header = SIDE_HEADER.pack(SIDE_MAGIC, seq, len(body), _proof(self.ctx, side_nonce, seq, body))
            send_all(side, header + body, self.ctx.stall_timeout, "the rdma descriptors")
            if recv_exact(side, 1, self.ctx.stall_timeout + region.nbytes / RATE_FLOOR_BYTES_PER_S,
                          "READY") != READY:
                raise ProtocolError("rdma: the receiver answered something other than READY")
            self._region = region
            self.counters.connects += 1
        finally:
            self._exit()

    def _check_wr_size(self) -> None:
        endpoint = self._endpoint
        if self._wr_size is not None and endpoint is not None and self._wr_size > endpoint.max_message_bytes:
            raise ProtocolError(f"rdma: the receiver asks for {self._wr_size}-byte requests; this port's largest "
                                f"message is {endpoint.max_message_bytes} bytes")

    def _open_side(self, port: int) -> socket.socket:
        try:
            sock = socket.create_connection((self.ctx.peer_host, port), timeout=self.ctx.stall_timeout)
        except OSError as e:
            raise PeerLost(f"rdma: cannot open the side connection to {self.ctx.peer_host}:{port}: {e}") from None
        with self._lock:
            if self._closing:
                sock.close()
                raise PeerLost("rdma: the transport was closed while connecting")
            self._side = sock
        return sock

    def send(self, region: TensorRegion, progress: Progress | None = None) -> int:
        """RDMA-WRITE the region (the last request per QP with the update number as immediate); return once
        every request completed.

        Raises
        ------
        PeerLost
            The side connection closed (the receiver died) during the write.
        TransferTimeout
            No completion for ``stall_timeout`` seconds.
        CompletionError
            A work completion failed: ``status`` (e.g. ``IBV_WC_LOC_PROT_ERR``), QP, offset, length.
        LinkDropped
            ``resumable`` and the receiver asked for resume marks: a QP broke (error state here or at the
            receiver, a link fault's completion error, no completion for ``stall_timeout``); every QP was
            stopped, and :meth:`resume` sends what the receiver says did not land.
        """
        self._enter()
        try:
            endpoint = self._endpoint
            if endpoint is None or region is not self._region:
                raise ProtocolError("RdmaSender.send() before connect() for this region")
            landing = self.landing
            if landing is None:
                st = self._write(endpoint, None, self.resumable)
                moved = int(st["bytes"])
            else:       # no request reaching past the landed prefix is posted
                self._relay(endpoint, region.nbytes, landing.wait_prefix)
                moved = region.nbytes
        finally:
            self._exit()
        self.counters.updates += 1
        if progress is not None:
            progress(moved)
        return moved

    def _write(self, endpoint: RdmaSenderEndpoint, starts: list[int] | None, resumable: bool) -> dict[str, Any]:
        """The update's write (resumed: QP ``q`` from request ``starts[q]``); a break of a ``resumable`` update
        becomes LinkDropped (the session clears ``resumable`` once send() returned: a resume round passes True)."""
        try:
            if starts is None and not endpoint.ready:
                # a QP broke after the last update had landed (its requests all completed, then it went to the
                # error state): replaced through a resume round, nothing posted yet, or else set up again
                endpoint.clear_state()
                stale = VerbsError(5, "rdma: a QP was left in the error state after the last update",
                                   status="IBV_QPS_ERR")
                if not (resumable and self._resume):
                    endpoint.mark_broken(stale)
                    raise TransferError(f"{stale}; the next update sets the connection up again")
                raise stale
            st = endpoint.write(timeout=self.ctx.stall_timeout, peer_alive=self._peer_alive, update=self._seq,
                                wr_size=self._wr_size, marks=self._marks, runs=self._runs, starts=starts,
                                on_slice=self._fault if _FAULT is not None else None)
            # all posted and completed; kept because the receiver may still ask to resume: its QP can break
            # after its last request landed and before it took that request's immediate (it then asks for
            # nothing, and the resume round only connects new QPs)
            self._posted = [p for p, _ in endpoint.last_state]
            return st
        except (VerbsError, TransferError) as e:
            if not self._is_break(e):
                raise
            endpoint.halt()         # nothing more leaves; the receiver counts what landed
            if not isinstance(e, PeerBroke):
                self._tell_broke()
            if not (resumable and self._resume):
                raise
            raise self._dropped(endpoint, e) from None

    def _fault(self, first: int, count: int) -> None:
        if _FAULT is not None and self._endpoint is not None and self._region is not None:
            _FAULT.on_sender(self._endpoint, first, count, self._region.nbytes)

    def _dropped(self, endpoint: RdmaSenderEndpoint, e: BaseException) -> LinkDropped:
        """What the break left: per QP the requests posted (kept: :meth:`resume` counts what it sends again)."""
        assert self._region is not None
        state, n = endpoint.last_state, self._region.nbytes
        self._posted = [p for p, _ in state]
        in_flight = requests_bytes(self._posted, n) - requests_bytes([c for _, c in state], n)
        log.warning("rdma update %d (round %d): the write broke with %d bytes posted and not known landed "
                    "(in flight): %s", self._seq, self._attempt, in_flight, e,
                    extra={"rdma_break": {"update": self._seq, "attempt": self._attempt, "in_flight": in_flight,
                                          "posted": requests_bytes(self._posted, n)}})
        return dropped_at(endpoint, e, self._posted, n, unfinished=False)

    def resume(self, region: TensorRegion, descriptors: dict[str, Any],
               progress: Progress | None = None) -> tuple[int, int]:
        """New QPs under the same MR, connected to the receiver's new ones (ours proved on the side connection
        with its nonce); then each QP's share from the request the receiver says it landed to.  Return
        ``(bytes sent, bytes sent again)``: the second counts requests posted before the break that did not
        land.  Raises LinkDropped (it broke again; ``resent``: what this round sent again), ProtocolError
        (:func:`~tensorxfer.transport.rdma_breaks.check_resume`)."""
        self._enter()
        try:
            endpoint = self._endpoint
            if endpoint is None or region is not self._region or not self._resume or not self._posted:
                raise ProtocolError("rdma: resume() outside a broken resumable update of this region")
            peer = _check_peer(descriptors, "receiver")
            attempt, side_nonce, starts, again = check_resume(descriptors, peer, self._posted, self._attempt,
                                                              self._mr_peer, region.nbytes)
            self._attempt, self._peer_broke = attempt, False
            endpoint.renew()
            endpoint.connect(peer)
            assert self._side is not None
            body = msgpack.packb(endpoint.descriptors())
            header = SIDE_HEADER.pack(SIDE_MAGIC, self._seq, len(body), _proof(self.ctx, side_nonce, self._seq, body))
            send_all(self._side, header + body, self.ctx.stall_timeout, "the resumed rdma descriptors")
            if self._read_side(1, self.ctx.stall_timeout, "READY") != READY:
                raise ProtocolError("rdma: the receiver answered something other than READY to the resume")
            self.counters.connects += 1
            try:
                self._write(endpoint, starts, True)
            except LinkDropped as e:
                e.resent = again
                raise
        finally:
            self._exit()
        self.counters.updates += 1
        sent = region.nbytes - requests_bytes(starts, region.nbytes)
        if progress is not None:
            progress(sent)
        return sent, again

    def _relay(self, endpoint: RdmaSenderEndpoint, nbytes: int, ready_after: Callable[[int], int]) -> None:
        """Write while this relay's own copy lands: a thread raises the write's gate as the landed prefix
        grows.  When this relay's upstream fails the write stops, and UpstreamFailed (not the next hop's
        fault) is raised."""
        limit = array("Q", [0])     # the landed prefix: one aligned uint64 the nogil loop reads, no lock
        gate = PrefixFollower(0, nbytes, ready_after, lambda end: limit.__setitem__(0, end), "tensorxfer-rdma-forward")

        def alive() -> bool:
            error = gate.error
            if error is not None:       # aborts the write: the next hop is not to blame
                if isinstance(error, UpstreamFailed):
                    raise error
                raise UpstreamFailed(f"relay: waiting for the landed prefix failed: {error!r}") from error
            return self._peer_alive()

        try:
            endpoint.write(timeout=self.ctx.stall_timeout, peer_alive=alive, update=self._seq,
                           wr_size=self._wr_size, marks=self._marks, ready=limit)
        finally:
            gate.stop()

    def _teardown(self) -> None:
        side, self._side = self._side, None
        endpoint, self._endpoint = self._endpoint, None
        self._region = None
        if side is not None:
            side.close()
        if endpoint is not None:
            endpoint.close()

    _release = _teardown
