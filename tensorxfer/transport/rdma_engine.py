"""The ``rdma`` transport for the engine: one RDMA WRITE of the region, wired over a small side connection.

The engine's ``accept`` frame only carries receiver → sender, but RC QPs
need both ends' numbers.  So the sender → receiver half travels over a
per-transfer TCP *side connection*, authenticated like tcp.py's streams:

1. receiver :meth:`RdmaReceiver.prepare` creates an
   :class:`~tensorxfer.transport.rdma.RdmaReceiverEndpoint` (one MR over the
   region, REMOTE_WRITE only while this transport is open), opens a listener
   on ``ctx.local_host`` and returns the endpoint's descriptors plus
   ``side_port``, ``nonce`` and ``streams`` (the QP count);
2. sender :meth:`RdmaSender.connect` validates them; :meth:`RdmaSender.send`
   creates its endpoint over the region, connects its QPs, opens the side
   connection and sends ``SIDE_HEADER`` (magic, transfer id, body
   length, HMAC proof keyed by the session key over nonce, transfer id and
   body) followed by its msgpack descriptors (at most
   ``MAX_DESCRIPTOR_BYTES``);
3. the receiver accepts, drops connections that fail the proof (strangers),
   connects its QPs, answers ``READY`` (its QPs are RTR: the sender may
   write), waits for every QP's immediate, and answers ``LANDED``;
4. the sender writes after ``READY`` and returns once ``LANDED`` arrived, then
   both close the side socket and their endpoints.

A closed side socket is :class:`PeerLost` (checked every 50 ms during the
RDMA wait/write), a stall :class:`TransferTimeout`, bad descriptors
:class:`ProtocolError`.  Registration is paid per transfer: the sender's
engine has no per-session state, so QPs cannot be kept paired across
transfers without changing the engine.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack

from tensorxfer.errors import PeerLost, ProtocolError, TransferTimeout, VerbsError
from tensorxfer.protocol import NONCE_BYTES, field, mac, nonce
from tensorxfer.transport.base import Progress, ReceiverTransport, SenderTransport, TransferContext
from tensorxfer.transport.rdma import (
    DEFAULT_QPS,
    RdmaReceiverEndpoint,
    RdmaSenderEndpoint,
    _check_peer,
    rdma_available,
)

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

log = logging.getLogger(__name__)

DEVICE_ENV = "TENSORXFER_RDMA_DEVICE"    # RDMA device to use (default: the first one)
MAX_QPS = 16
MAX_DESCRIPTOR_BYTES = 64 << 10
HEADER_TIMEOUT = 5.0                     # a connected side socket must identify itself this fast
SIDE_MAGIC = b"TXR1"
SIDE_HEADER = struct.Struct(">4sQI32s")  # magic, transfer id, descriptor length, proof
READY = b"R"
LANDED = b"D"
#: The receiver's wait has no per-byte progress (completion is one immediate per QP), so its
#: timeout is ``stall_timeout`` plus the region at this floor rate (Soft-RoCE in a TCG VM: ~20 MB/s).
RATE_FLOOR_BYTES_PER_S = 10e6


def _device() -> str | None:
    return os.environ.get(DEVICE_ENV) or None


def _available() -> str | None:
    ok, reason = rdma_available(_device())
    return None if ok else reason


def _proof(ctx: TransferContext, side_nonce: bytes, body: bytes) -> bytes:
    return mac(ctx.session_key, b"rdma-side", side_nonce, struct.pack(">Q", ctx.transfer_id), body)


def _alive(sock: socket.socket) -> bool:
    """False once the peer closed or reset the side socket (pending data counts as alive)."""
    try:
        poller = select.poll()          # not select(): a process holding many memfd chunks has fds >= 1024
        poller.register(sock, select.POLLIN)
        events = poller.poll(0)
        if not events:
            return True
        if events[0][1] & (select.POLLERR | select.POLLNVAL):
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except (OSError, ValueError):
        return False


def _recv_exact(sock: socket.socket, n: int, timeout: float, what: str) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    try:
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise PeerLost(f"rdma: peer closed the side connection while this side waited for {what}")
            buf += chunk
    except TimeoutError:
        raise TransferTimeout(f"rdma: no {what} from the peer within {timeout:.1f} s") from None
    except OSError as e:
        if isinstance(e, PeerLost):
            raise
        raise PeerLost(f"rdma: side connection lost while waiting for {what}: {e}") from None
    return buf


def _send_all(sock: socket.socket, data: bytes, timeout: float, what: str) -> None:
    sock.settimeout(timeout)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout(f"rdma: could not send {what} within {timeout:.1f} s") from None
    except OSError as e:
        raise PeerLost(f"rdma: side connection lost while sending {what}: {e}") from None


class _Owned:
    """close() from any thread: it wakes the owner, who releases on its way out (one owner per resource)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closing = False
        self._busy = 0
        self._side: socket.socket | None = None

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

    def _peer_alive(self) -> bool:
        side = self._side
        return not self._closing and side is not None and _alive(side)

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
    """Lets the sender RDMA-WRITE the region into its memory; waits for every QP's completion."""

    name: ClassVar[str] = "rdma"

    def __init__(self, ctx: TransferContext) -> None:
        ReceiverTransport.__init__(self, ctx)
        _Owned.__init__(self)
        self._endpoint: RdmaReceiverEndpoint | None = None
        self._listener: socket.socket | None = None
        self._nonce = b""
        self._nbytes = 0

    @classmethod
    def available(cls) -> str | None:
        return _available()

    def prepare(self, region: TensorRegion) -> dict[str, Any]:
        """Register the region (REMOTE_WRITE) and open the side listener; descriptors: the endpoint's + side."""
        self._enter()
        try:
            qps = min(max(self.ctx.streams or DEFAULT_QPS, 1), MAX_QPS)
            self._endpoint = RdmaReceiverEndpoint(region, _device(), qps=qps)
            self._nbytes = region.nbytes
            self._nonce = nonce()
            family = socket.AF_INET6 if ":" in self.ctx.local_host else socket.AF_INET
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            self._listener.bind((self.ctx.local_host, 0))
            self._listener.listen(4)
            return {**self._endpoint.descriptors(), "side_port": self._listener.getsockname()[1],
                    "nonce": self._nonce, "streams": qps}
        finally:
            self._exit()

    def wait(self, progress: Progress | None = None) -> int:
        """Take the sender's descriptors, connect the QPs, say READY, wait for the update, say LANDED.

        Raises
        ------
        PeerLost
            The side connection closed (the sender died) before the update landed.
        TransferTimeout
            No sender connected within ``stall_timeout``, or the update did not land in time.
        ProtocolError
            The authenticated sender's descriptors are malformed or do not match.
        """
        self._enter()
        try:
            endpoint = self._endpoint
            if endpoint is None:
                raise ProtocolError("RdmaReceiver.wait() before prepare()")
            peer = self._accept()
            endpoint.connect(peer)
            assert self._side is not None
            _send_all(self._side, READY, self.ctx.stall_timeout, "READY")
            timeout = self.ctx.stall_timeout + self._nbytes / RATE_FLOOR_BYTES_PER_S
            try:
                endpoint.wait_complete(timeout, peer_alive=self._peer_alive)
            except VerbsError as e:
                raise PeerLost(f"rdma: receive completion failed: {e}") from e
            _send_all(self._side, LANDED, self.ctx.stall_timeout, "LANDED")
        finally:
            self._exit()
        if progress is not None:
            progress(self._nbytes)
        return self._nbytes

    def _accept(self) -> dict[str, Any]:
        """The first side connection that proves itself; its decoded descriptors."""
        listener = self._listener
        assert listener is not None
        # The sender registers its region before it connects: allow for that as for the transfer itself.
        deadline = time.monotonic() + self.ctx.stall_timeout + self._nbytes / RATE_FLOOR_BYTES_PER_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"rdma: the sender did not open its side connection within "
                                      f"{self.ctx.stall_timeout} s")
            if self._closing:
                raise PeerLost("rdma: the transport was closed while waiting for the sender")
            listener.settimeout(min(remaining, 0.2))
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            body = self._identify(conn, addr)
            if body is None:
                conn.close()
                continue
            with self._lock:
                if self._closing:
                    conn.close()
                    raise PeerLost("rdma: the transport was closed while the sender connected")
                self._side = conn
            try:
                peer = msgpack.unpackb(body, raw=False)
            except Exception as e:    # any decoding failure of an authenticated peer
                raise ProtocolError(f"rdma: the sender's descriptors are not valid msgpack: {e}") from None
            return _check_peer(peer, "sender")

    def _identify(self, conn: socket.socket, addr: Any) -> bytes | None:
        """The descriptor body a new side connection proves, or None (logged) for a stranger."""
        timeout = min(HEADER_TIMEOUT, self.ctx.stall_timeout)
        try:
            magic, tid, length, proof = SIDE_HEADER.unpack(_recv_exact(conn, SIDE_HEADER.size, timeout, "header"))
            if magic != SIDE_MAGIC or tid != self.ctx.transfer_id or length > MAX_DESCRIPTOR_BYTES:
                raise ProtocolError("bad side header")
            body = _recv_exact(conn, length, timeout, "descriptors")
        except (PeerLost, TransferTimeout, ProtocolError):
            log.warning("rdma: side connection from %s closed, stalled or sent a bad header; dropped", addr)
            return None
        if not hmac.compare_digest(proof, _proof(self.ctx, self._nonce, body)):
            log.warning("rdma: side connection from %s failed authentication; dropped", addr)
            return None
        return body

    def _release(self) -> None:
        side, self._side = self._side, None
        listener, self._listener = self._listener, None
        endpoint, self._endpoint = self._endpoint, None
        for s in (side, listener):
            if s is not None:
                s.close()
        if endpoint is not None:
            endpoint.close()


class RdmaSender(_Owned, SenderTransport):
    """RDMA-WRITEs the region into the receiver's registered memory."""

    name: ClassVar[str] = "rdma"

    def __init__(self, ctx: TransferContext) -> None:
        SenderTransport.__init__(self, ctx)
        _Owned.__init__(self)
        self._endpoint: RdmaSenderEndpoint | None = None
        self._peer: dict[str, Any] | None = None
        self._nonce = b""
        self._side_port = 0

    @classmethod
    def available(cls) -> str | None:
        return _available()

    def connect(self, descriptors: dict[str, Any]) -> None:
        """Validate the receiver's descriptors (the side connection opens in :meth:`send`, once registered).

        Raises
        ------
        ProtocolError
            Malformed descriptors.
        """
        side_port = field(descriptors, "side_port", int)
        side_nonce = field(descriptors, "nonce", bytes)
        peer = _check_peer(descriptors, "receiver")
        if not 0 < side_port < 65536 or len(side_nonce) != NONCE_BYTES or not 1 <= len(peer["qps"]) <= MAX_QPS:
            raise ProtocolError(f"rdma accept descriptors out of range: side port {side_port}, "
                                f"{len(side_nonce)}-byte nonce, {len(peer['qps'])} QPs")
        self._peer, self._nonce, self._side_port = peer, side_nonce, side_port

    def _open_side(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.ctx.peer_host, self._side_port), timeout=self.ctx.stall_timeout)
        except OSError as e:
            raise PeerLost(f"rdma: cannot open the side connection to {self.ctx.peer_host}:{self._side_port}: "
                           f"{e}") from None
        with self._lock:
            if self._closing:
                sock.close()
                raise PeerLost("rdma: the transport was closed while connecting")
            self._side = sock
        return sock

    def send(self, region: TensorRegion, progress: Progress | None = None) -> int:
        """Register the region, exchange QPs, RDMA-WRITE it all; return once the receiver saw it land.

        Raises
        ------
        PeerLost
            The side connection closed, or a work completion failed (receiver gone).
        TransferTimeout
            No completion, READY or LANDED for ``stall_timeout`` seconds.
        ProtocolError
            The receiver's region is smaller than this one.
        """
        self._enter()
        try:
            peer = self._peer
            if peer is None:
                raise ProtocolError("RdmaSender.send() before connect()")
            self._endpoint = RdmaSenderEndpoint(region, _device(), qps=len(peer["qps"]))
            self._endpoint.connect(peer)
            side = self._open_side()
            body = msgpack.packb(self._endpoint.descriptors())
            header = SIDE_HEADER.pack(SIDE_MAGIC, self.ctx.transfer_id, len(body), _proof(self.ctx, self._nonce, body))
            _send_all(side, header + body, self.ctx.stall_timeout, "descriptors")
            if _recv_exact(side, 1, self.ctx.stall_timeout, "READY") != READY:
                raise ProtocolError("rdma: the receiver answered something other than READY")
            try:
                self._endpoint.write(timeout=self.ctx.stall_timeout, peer_alive=self._peer_alive)
            except VerbsError as e:
                raise PeerLost(f"rdma: write failed (receiver gone?): {e}") from e
            if progress is not None:
                progress(region.nbytes)
            if _recv_exact(side, 1, self.ctx.stall_timeout + region.nbytes / RATE_FLOOR_BYTES_PER_S,
                           "LANDED") != LANDED:
                raise ProtocolError("rdma: the receiver answered something other than LANDED")
        finally:
            self._exit()
        return region.nbytes

    def _release(self) -> None:
        side, self._side = self._side, None
        endpoint, self._endpoint = self._endpoint, None
        if side is not None:
            side.close()
        if endpoint is not None:
            endpoint.close()
