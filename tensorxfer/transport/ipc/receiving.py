"""What both ipc receivers do: the private socket, the sender's admission, the chunk table and its handles.

:class:`IpcReceiving` runs one update up to the point where the sender's memory is known -- set up (a
socket in a fresh 0700 directory, the sender admitted by uid and session-key proof) or reused, the
chunk table read and checked, the handles received -- and hands over to :meth:`IpcReceiving._land`:
the copy receiver (:mod:`.copy`) copies out of that memory, the share receiver (:mod:`.share`) keeps it
as the region.  Either way the sender gets ``D`` (or ``E`` with the reason) at the end.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import socket
import tempfile
import threading
from abc import abstractmethod
from typing import Any

from tensorxfer.connections import Gate, listen
from tensorxfer.errors import (
    AuthError,
    HandleError,
    ProtocolError,
    TensorXferError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from tensorxfer.memory import HostRegion
from tensorxfer.protocol import nonce
from tensorxfer.transport.base import Progress, TransferContext, _Half
from tensorxfer.transport.ipc.identity import check_peer, host_identity, unavailable
from tensorxfer.transport.ipc.messages import (
    AUTH,
    AUTH_MAGIC,
    FILES,
    HEADER_TIMEOUT,
    U64,
    Watermark,
    close_fds,
    parse_header,
    proof,
    receive_files,
    receive_handles,
    recv_message,
    send_message,
)

log = logging.getLogger(__name__)

Handles = list[tuple[int, int]]       # (size, fd) of each chunk, in order


def map_handles(handles: Handles, on: int | None, writable: bool = False, populate: bool = True,
                copy_on_write: bool = False) -> Any:
    """Map a peer's handles contiguously: host memfds (each checked first: a sealed memory file at least as long as
    its chunk), or CUDA handles on device ``on``.  The fds stay the caller's.  ``populate`` (host memory) builds
    the page tables now, in one pass (faster first copy; but it commits a sparse file's every page, holding the
    GIL meanwhile: a copy host maps its lanes' regions without it).

    Raises
    ------
    ProtocolError
        A host handle is unusable (named).
    """
    if on is None:
        try:
            return HostRegion.import_handles(handles, writable=writable, populate=populate,
                                             copy_on_write=copy_on_write)
        except (HandleError, ValueError) as e:     # ValueError: a chunk size that is not a page multiple
            raise ProtocolError(f"ipc: the sender passed an unusable handle: {e}") from None
    from tensorxfer.memory import CudaRegion

    return CudaRegion.import_handles(handles, device=on)


class Incoming:
    """One update's chunk table, as the sender described it (checked by :func:`parse_header`)."""

    def __init__(self, kind: str, device: int, nbytes: int, token: bytes, peer_pid: int) -> None:
        self.kind, self.device, self.nbytes, self.token, self.peer_pid = kind, device, nbytes, token, peer_pid
        #: kind FILES: ``(region offset, length, fd)`` of the sender's files (the fds are the caller's)
        self.files: list[tuple[int, int, int]] = []

    def key(self, on: int | None = None) -> tuple:
        """Identifies the sender's memory: its pid, its random token for the region, and (device memory)
        the device it is mapped on -- the same key means the same memory, mapped the same way."""
        return ("host", self.peer_pid, self.token) if on is None else ("cuda", self.peer_pid, self.token, on)


class IpcReceiving(_Half):
    """The session's Unix socket to one sender on this host, and each update's handles (see the module)."""

    name = "ipc"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._dir: str | None = None
        self._gate: Gate | None = None          # open only while a setup waits for the sender
        self._conn: socket.socket | None = None
        self._nonce = b""
        self._seq = 0
        self._setup_seq = 0
        self._closing = False
        self._peer_pid = 0
        self._lock = threading.Lock()

    @classmethod
    def available(cls) -> str | None:
        return unavailable()

    # -- setup
    def _begin(self, seq: int, fresh: bool, share: bool) -> dict[str, Any]:
        """Descriptors for ``accept``: ``setup``, ``share``, ``streams``, ``watermark``; on setup ``path``,
        ``nonce``, ``identity`` of a Unix socket in a fresh 0700 directory."""
        self._seq = seq
        # "watermark": this receiver waits for the sender's "W" messages, so a relay may send before its
        # own copy landed (a receiver without it gets only complete regions).
        if self._conn is not None and not fresh:
            return {"setup": False, "share": share, "streams": 1, "watermark": True}
        self._teardown()
        self._nonce = nonce()
        self._setup_seq = seq
        self._dir = tempfile.mkdtemp(prefix="tensorxfer-ipc-")     # mode 0700: only our uid gets in
        path = os.path.join(self._dir, "s")
        self._gate = Gate(listen(path, socket.AF_UNIX, socket.SOCK_SEQPACKET), self._authenticate,
                          min(HEADER_TIMEOUT, self.ctx.stall_timeout), "ipc")
        return {"setup": True, "path": path, "nonce": self._nonce, "share": share, "identity": host_identity(),
                "streams": 1, "watermark": True}

    def _admit(self) -> None:
        gate = self._gate
        assert gate is not None
        try:
            [(conn, pid)] = gate.admit(1, timeout=self.ctx.stall_timeout,
                                       abort=self.ctx.setup_abort("ipc", lambda: self._closing))
        except TransferTimeout:
            raise TransferTimeout(f"ipc: no authenticated sender connected within {self.ctx.stall_timeout} s"
                                  f"{f' ({gate.dropped} refused: {gate.last_drop})' if gate.dropped else ''}") \
                from None
        finally:
            self._close_gate()      # connected (or failed): nobody else may reach this socket
        with self._lock:
            if self._closing:
                conn.close()
                raise TransferError("ipc: the transfer was aborted")
            self._conn, self._peer_pid = conn, pid
        self.counters.connects += 1

    def _authenticate(self, conn: socket.socket) -> int | None:
        """The peer's pid if it is our sender, else None (after telling it why, in an ``E`` message)."""
        # Read the proof first even from a stranger: closing a Unix socket with unread data resets the
        # connection, and the peer would then lose our "E" explanation.
        try:
            data = recv_message(conn, "the authentication message", min(HEADER_TIMEOUT, self.ctx.stall_timeout))
            missing = ""
        except TransferError as e:
            data, missing = b"", f"no authentication message: {e}"
        pid = 0
        try:
            pid = check_peer(conn)
            reason = missing
            if data:
                magic, tid, mac = AUTH.unpack(data) if len(data) == AUTH.size else (b"", 0, b"")
                if len(data) != AUTH.size:
                    reason = f"authentication message of {len(data)} bytes, expected {AUTH.size}"
                elif magic != AUTH_MAGIC or tid != self._setup_seq \
                        or not hmac.compare_digest(mac, proof(self.ctx, self._nonce, tid)):
                    reason = "the connection failed ipc authentication (wrong session key, transfer or magic)"
        except AuthError as e:
            reason = str(e)
        try:
            conn.send(b"E" + reason.encode() if reason else b"K")
        except OSError as e:
            reason = reason or f"it left during authentication: {e}"
        if reason:
            log.warning("ipc: refused a connection: %s", reason)
            return None
        return pid

    # -- one update
    def wait(self, progress: Progress | None = None) -> int:
        """(On setup: admit the authenticated sender.)  Take the sender's memory and land it (copy or share);
        return the byte count.

        Raises
        ------
        TransferTimeout
            No authenticated sender within ``stall_timeout``.
        PeerLost
            The sender went away before passing every handle.
        ProtocolError
            A malformed chunk table, a wrong fd count, an fd smaller than its chunk.
        """
        if self._gate is not None:
            self._admit()
        conn = self._conn
        if conn is None:
            raise ProtocolError("ipc: wait() before prepare()")
        try:
            nbytes = self._receive(conn, progress)
        except TensorXferError as e:
            try:
                conn.send(b"E" + str(e).encode()[:4000])
            except OSError:
                pass    # the sender is gone; it will see the closed connection instead
            raise
        send_message(conn, b"D" + U64.pack(nbytes), "the done message")
        self.counters.updates += 1
        return nbytes

    def _receive(self, conn: socket.socket, progress: Progress | None) -> int:
        timeout = self.ctx.stall_timeout
        kind, device, nbytes, token, count, cached, seq, ready = parse_header(
            recv_message(conn, "the chunk table", timeout))
        expected = self._expected_nbytes()
        if seq != self._seq:
            raise ProtocolError(f"ipc: the sender passes update {seq}, this is update {self._seq}")
        if expected >= 0 and nbytes != expected:
            raise ProtocolError(f"ipc: the sender passes {nbytes} payload bytes, the offer's manifest has "
                                f"{expected}")
        if not nbytes:
            return self._empty()
        fds: list[int] = []
        watermark = Watermark(conn, nbytes, ready, timeout)
        incoming = Incoming(kind, device, nbytes, token, self._peer_pid)
        try:
            if kind == FILES:
                incoming.files = receive_files(conn, count, nbytes, fds, self.ctx.stall_timeout)
                handles: Handles = []
            else:
                handles = [] if cached else receive_handles(conn, count, nbytes, fds, self.ctx.stall_timeout)
            if handles or incoming.files:
                self.counters.registrations += 1
            return self._land(conn, incoming, handles, fds, watermark, progress)
        finally:
            close_fds(fds)

    @abstractmethod
    def _expected_nbytes(self) -> int:
        """The payload size the offer's manifest has (-1: any; the segments of a weight sync are checked
        against the sender's size instead)."""

    @abstractmethod
    def _empty(self) -> int:
        """Land an update of no bytes; return 0."""

    @abstractmethod
    def _land(self, conn: socket.socket, incoming: Incoming, handles: Handles, fds: list[int],
              watermark: Watermark, progress: Progress | None) -> int:
        """Land the update from the sender's memory (``handles``; none when it said ``cached``); return the
        byte count.  ``fds`` are the received handles' fds: closed by the caller, or earlier once mapped."""

    # -- the sender's memory
    @staticmethod
    def _import(incoming: Incoming, handles: Handles, fds: list[int], on: int | None,
                copy_on_write: bool = False) -> Any:
        """Map the sender's handles (``on``: the device for CUDA handles); the fds are closed once mapped."""
        src = map_handles(handles, on, copy_on_write=copy_on_write)
        close_fds(fds)      # the mappings hold the memory now
        return src

    @staticmethod
    def _cuda_device(incoming: Incoming, device: str) -> int:
        """The device the sender's CUDA handles are mapped on: this receiver's GPU, else the sender's index.

        Raises
        ------
        TransportUnavailable
            This process cannot use CUDA.
        """
        from tensorxfer.memory import CUDA_UNAVAILABLE, CudaRegion
        from tensorxfer.region import parse_device

        if CudaRegion is None:
            raise TransportUnavailable(f"ipc: the sender's region is on cuda:{incoming.device} but this receiver "
                                       f"cannot use CUDA: {CUDA_UNAVAILABLE}")
        kind, index = parse_device(device)
        return index if kind == "cuda" else incoming.device

    # -- lifetime
    def _close_gate(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.close()
        d, self._dir = self._dir, None
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    def _teardown(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass    # not connected / already shut: closing is enough
            conn.close()
        self._close_gate()

    def close(self) -> None:
        """Close the socket and remove the private directory; idempotent, callable from another thread."""
        self._closing = True
        self._teardown()
