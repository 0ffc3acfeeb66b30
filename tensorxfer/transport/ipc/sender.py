"""The sending half of ipc: passes a region's memory handles once per session, then waits for each copy."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack

from tensorxfer.errors import (
    AuthError,
    CudaError,
    PeerLost,
    ProtocolError,
    RegionError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    UpstreamFailed,
)
from tensorxfer.protocol import NONCE_BYTES, field
from tensorxfer.transport.base import PrefixFollower, Progress, SenderTransport, TransferContext, setup_flag
from tensorxfer.transport.ipc import messages
from tensorxfer.transport.ipc.identity import check_peer, host_identity, identity_mismatch, unavailable
from tensorxfer.transport.ipc.messages import (
    AUTH,
    AUTH_MAGIC,
    FORWARD_POLL_S,
    U64,
    close_fds,
    proof,
    recv_message,
    send_handles,
    send_message,
)
from tensorxfer.transport.segments import Segments

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

_TOKENS: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()   # region -> its random token


class IpcSender(SenderTransport):
    """Passes a region's memory handles (once per session) to a receiver on the same host; waits for each copy."""

    name: ClassVar[str] = "ipc"
    follows_landing: ClassVar[bool] = True     # the receiver copies up to the landed prefix (watermark)
    posts_early: ClassVar[bool] = True         # a warm update's table needs nothing from the accept

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._passed: bytes | None = None       # token of the region whose handles the receiver holds
        self._seq = 0
        self.share = False
        self._watermarks = False                # the receiver waits for "W" messages (accept descriptors)
        self._moving: int | None = None         # a weight sync's bytes (the receiver copies only its runs)
        self._posted: tuple[int, PrefixFollower | None] | None = None    # sent, its copy not yet collected

    @classmethod
    def available(cls) -> str | None:
        return unavailable()

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        # "files": this end's receiver takes a sender's files (chunk table kind "files"), so a sender whose
        # region is its files mapped may pass them (tensorxfer-send checks it before mapping them)
        return {"identity": host_identity(), "files": True}

    @classmethod
    def peer_reason(cls, peer_caps: dict[str, Any] | None) -> str | None:
        return identity_mismatch((peer_caps or {}).get("identity"))

    @classmethod
    def forward_piece_bytes(cls, region: TensorRegion, streams: int | None = None) -> int:
        """The piece a relay's copy reports as landed and its next hop waits for (receivers whose regions are
        on the same kind of memory as ``region``)."""
        return min(region.nbytes, messages.RELAY_CUDA_PIECE_BYTES if region.is_cuda else messages.RELAY_PIECE_BYTES)

    def needs_setup(self, region: TensorRegion) -> bool:
        return self._sock is None

    def connect(self, region: TensorRegion, seq: int, descriptors: dict[str, Any],
                segments: Segments | None = None) -> None:
        """On setup connect to the receiver's socket, check its uid, authenticate; else reuse the connection.

        Raises
        ------
        ProtocolError
            Malformed descriptors.
        TransportUnavailable
            The receiver is not on this host as this user, or its socket is not reachable from here.
        AuthError
            The receiver runs as another user, or refused our proof.
        """
        self._seq = seq
        # A weight sync's receiver copies only these runs out of this region (it plans the same ones).
        self._moving = segments.total_bytes if segments is not None else None
        self.share = field(descriptors, "share", bool)
        self._watermarks = descriptors.get("watermark") is True
        if not setup_flag(descriptors):
            if self._sock is None:
                raise ProtocolError("ipc: the receiver reuses a connection this sender does not have")
            return
        path = field(descriptors, "path", str)
        ipc_nonce = field(descriptors, "nonce", bytes)
        if len(ipc_nonce) != NONCE_BYTES or not path or len(path.encode()) > 107:
            raise ProtocolError(f"ipc accept descriptors out of range: path {path!r}, {len(ipc_nonce)}-byte nonce")
        reason = identity_mismatch(descriptors.get("identity"))
        if reason:
            raise TransportUnavailable(f"ipc: {reason}")
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self._lock:
            self._sock = sock
        sock.settimeout(self.ctx.stall_timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as e:
            raise TransportUnavailable(f"ipc: cannot reach the receiver's socket {path}: {e} (same host, but "
                                       f"another filesystem view?) — use transport='tcp'") from None
        except OSError as e:
            raise PeerLost(f"ipc: cannot connect to the receiver's socket {path}: {e}") from None
        check_peer(sock)
        send_message(sock, AUTH.pack(AUTH_MAGIC, seq, proof(self.ctx, ipc_nonce, seq)), "authentication")
        answer = recv_message(sock, "the authentication answer", self.ctx.stall_timeout)
        if answer != b"K":
            raise AuthError(f"ipc: the receiver refused the connection: "
                            f"{answer[1:].decode(errors='replace') if answer[:1] == b'E' else repr(answer[:16])}")
        self.counters.connects += 1

    def send(self, region: TensorRegion, progress: Progress | None = None) -> int:
        """Pass the handles of ``region``'s payload (or say the receiver has them); return once it copied (or
        mapped) them.

        Raises
        ------
        TransportUnavailable
            The region's memory has no handles to pass (adopted memory).
        PeerLost, TransferTimeout
            The receiver died or stopped answering.
        TransferError
            The receiver failed (its reason is in the message).
        UpstreamFailed
            Relaying (``landing`` set): this relay's own update failed; the receiver was told.
        """
        self._post(region)
        return self.collect(progress)

    def post_early(self, region: TensorRegion, seq: int, segments: Segments | None = None) -> int:
        """Pass update ``seq``'s chunk table now, before the receiver's accept (the session is warm: the
        receiver reads it once it accepted); :meth:`collect` waits for the copy.  Returns the byte count."""
        self._seq = seq
        self._moving = segments.total_bytes if segments is not None else None
        self._post(region)
        return region.nbytes if self._moving is None else self._moving

    def _post(self, region: TensorRegion) -> None:
        """Send the chunk table (and the handles when the receiver lacks them); a relay's watermarks follow."""
        sock = self._sock
        if sock is None:
            raise ProtocolError("IpcSender.send() before connect()")
        nbytes = region.nbytes
        kind, device = ("cuda", int(region.region.device_index)) if region.is_cuda else ("host", 0)
        # setdefault: a source's first step posts to every target from a thread each, and a token drawn twice
        # would make one of them pass the handles again next step
        token = _TOKENS.setdefault(region, os.urandom(16))
        ready = self._ready_now(nbytes)
        files = region.source_files
        if files is not None:
            if self.share:
                raise TransportUnavailable("ipc: this region is files mapped read-only, and the receiver shares "
                                           "(maps) the sender's memory, which only memory handles allow; send "
                                           "it over tcp, or read the files into a region first")
            kind = messages.FILES
        # files are passed again with every update: nothing on the receiver keeps them between updates
        cached = nbytes > 0 and token == self._passed and files is None
        if not nbytes or cached:
            chunks = []
        elif files is not None:
            chunks = _dup_files(files, nbytes)
        else:
            chunks = export_handles(region)
        owned = [fd for _, _, fd in chunks]     # exported handles are ours to close once passed
        try:
            table = msgpack.packb({"kind": kind, "device": device, "nbytes": nbytes, "token": token,
                                   "count": len(chunks), "cached": cached, "seq": self._seq, "ready": ready},
                                  use_bin_type=True)
            send_message(sock, table, "the chunk table")
            send_handles(sock, chunks)
        finally:
            close_fds(owned)
        if chunks:
            self._passed = token if files is None else None
            self.counters.registrations += 1
        forward = None
        if ready < nbytes and self.landing is not None:
            # Relaying: each new end of this relay's landed prefix goes out as a "W" watermark; when the
            # relay's upstream fails, the receiver is told with an "E" message (and this send raises).
            def tell_failed(e: BaseException) -> None:
                if isinstance(e, UpstreamFailed):
                    try:
                        sock.send(b"E" + str(e).encode()[:4000])
                    except OSError:
                        pass    # the receiver is gone: _wait_copied finds that out itself
            forward = PrefixFollower(ready, nbytes, self.landing.wait_prefix,
                                     lambda end: send_message(sock, b"W" + U64.pack(end), "the watermark"),
                                     "tensorxfer-ipc-forward", tell_failed)
        self._posted = (nbytes, forward)

    def collect(self, progress: Progress | None = None) -> int:
        """Wait for the receiver to copy (or map) what was posted; return the byte count (raises as
        :meth:`send`)."""
        posted, self._posted = self._posted, None
        sock = self._sock
        if posted is None or sock is None:
            raise ProtocolError("IpcSender.collect() without a posted update")
        nbytes, forward = posted
        try:
            self._wait_copied(sock, nbytes, progress, forward)
        except BaseException:
            if forward is not None:
                forward.stop()
                if isinstance(forward.error, UpstreamFailed):
                    raise forward.error from None     # the relay's upstream failed, not this receiver
            raise
        if forward is not None:
            forward.join()
        self.counters.updates += 1
        return nbytes if self._moving is None else self._moving

    def _ready_now(self, nbytes: int) -> int:
        """How much of the region the receiver may copy at once: all of it, unless this is a relay whose own
        copy is still landing (then 0, and a forwarder sends the rest as it lands)."""
        if self.landing is None or nbytes == 0:
            return nbytes
        if self._watermarks and not self.share:
            return 0
        # A receiver that does not wait for watermarks, or one that maps the region instead of copying it
        # (share mode: it needs all of it at once), gets the region once it is complete.
        pos = 0
        while pos < nbytes:
            pos = self.landing.wait_prefix(pos)
        return nbytes

    def _wait_copied(self, sock: socket.socket, nbytes: int, progress: Progress | None,
                     forward: PrefixFollower | None) -> None:
        """Read the receiver's ``P`` messages until its ``D``.

        Stall timing: no message for ``stall_timeout`` fails the update, except (relaying) while the
        receiver has copied all the watermark allows short of the whole region: then it waits for this
        relay, not the other way round.  Once the whole region was allowed and copied, only its ``D`` is
        missing, and that is the receiver's to send within ``stall_timeout`` (a receiver stuck finishing
        its copy would otherwise hold this relay, and its ack to the origin, forever).
        """
        reported = 0
        poller = None
        if forward is not None:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
        moved = time.monotonic()        # the receiver's last progress, or when it last had all it may copy
        while True:
            if poller is not None and forward is not None and not poller.poll(FORWARD_POLL_S * 1000):
                if forward.error is not None:
                    raise forward.error
                now = time.monotonic()
                if reported >= forward.sent and forward.sent < nbytes:
                    moved = now     # it copied all it may so far: it waits for this relay's own copy
                elif now - max(moved, forward.since) > self.ctx.stall_timeout:
                    if reported >= nbytes:
                        raise TransferTimeout(f"ipc: the receiver copied all {nbytes} bytes but did not finish "
                                              f"(no done) for {self.ctx.stall_timeout} s")
                    raise TransferTimeout(f"ipc: the receiver copied {reported} of the {forward.sent} bytes it "
                                          f"may and made no progress for {self.ctx.stall_timeout} s")
                continue
            msg = recv_message(sock, "the receiver's copy to finish", self.ctx.stall_timeout)
            if msg[:1] == b"P" and len(msg) == 9:
                done = U64.unpack(msg[1:])[0]
                if progress is not None and done > reported:
                    progress(done - reported)
                reported = max(reported, done)
                moved = time.monotonic()
            elif msg[:1] == b"D" and len(msg) == 9 and U64.unpack(msg[1:])[0] == nbytes:
                if progress is not None and nbytes > reported:
                    progress(nbytes - reported)
                return
            elif msg[:1] == b"E":
                raise TransferError(f"ipc: the receiver failed: {msg[1:].decode(errors='replace')}")
            else:
                raise ProtocolError(f"ipc: unexpected message from the receiver: {msg[:16]!r}")

    def close(self) -> None:
        """Close the socket; idempotent, callable from another thread."""
        with self._lock:
            sock, self._sock = self._sock, None
        self._passed = None
        self._posted = None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass    # never connected: closing is enough
            sock.close()


def _dup_files(files: Any, nbytes: int) -> list[tuple[int, int, int]]:
    """``(offset, length, fd)`` of the files holding ``[0, nbytes)`` of a region of files, each fd a new
    duplicate (the caller closes them; the region keeps its own)."""
    out: list[tuple[int, int, int]] = []
    try:
        for off, length, fd in files:
            if off < nbytes:
                out.append((off, length, os.dup(fd)))
    except BaseException:
        close_fds([fd for _, _, fd in out])
        raise
    return out


def export_handles(region: TensorRegion) -> list[tuple[int, int, int]]:
    """``(offset, size, fd)`` of the chunks holding ``region``'s payload; the fds are new (the caller closes them).

    Raises
    ------
    TransportUnavailable
        The region's memory has no handles to pass (adopted memory) or they cannot be exported.
    """
    try:
        chunks = region.region.export_handles()
    except (CudaError, RegionError) as e:
        raise TransportUnavailable(f"ipc: the region's memory handles cannot be exported ({e}); "
                                   f"use transport='tcp'") from None
    inside = [c for c in chunks if c[0] < region.nbytes]
    close_fds([fd for off, _, fd in chunks if off >= region.nbytes])
    if not inside or any(fd < 0 for _, _, fd in inside):
        close_fds([fd for _, _, fd in inside if fd >= 0])
        raise TransportUnavailable("ipc: the region's memory was adopted, not allocated by tensorxfer, so "
                                   "there are no memory handles to pass; copy it into a TensorRegion "
                                   "(from_tensors) or use transport='tcp'")
    return inside
