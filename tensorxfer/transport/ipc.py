"""The same-host data path: memory handles passed over a Unix socket.

When sender and receiver run on one machine as one user, nothing needs to
cross a network stack: the sender passes the *handles* of its region — one
memfd per ``HostRegion`` chunk, one POSIX-fd shareable handle per
``CudaRegion`` chunk — over a Unix domain socket with ``SCM_RIGHTS``, and the
receiver maps them and copies (one memcpy / device-to-device copy), or, with
``share=True``, keeps the mapping as its region without copying.

Security
--------
- The socket lives in a fresh private directory (``mkdtemp``, mode 0700), so
  only our uid (and root) can even connect.
- Both ends check the peer's credentials (``SO_PEERCRED``): the peer's uid
  must be ours, otherwise the connection is refused with an ``E`` message
  naming both uids (:func:`check_peer`).
- The sender proves it holds the session key: its first message is an HMAC
  over the accept descriptors' nonce and the transfer id, as the TCP stream
  header does.  A connection that fails either check is dropped and the
  receiver keeps waiting for the real sender (until ``stall_timeout``);
  strangers are identified concurrently (:class:`~tensorxfer.connections.Gate`),
  so idle ones cannot hold the real sender up.
- The receiver maps only sealed memfds (``F_SEAL_SHRINK | F_SEAL_GROW``,
  set by ``HostRegion.allocate``) at least as long as their chunk, checked
  before anything is mapped (``HostRegion.import_handles``): the sender can
  never shrink a file under the receiver's mapping, which would turn a read
  into ``SIGBUS``.  No chunk may end past the payload rounded up to
  ``CHUNK_TAIL``, so a small update cannot make the receiver map a huge file.

Same host
---------
Both ends advertise :func:`host_identity` (boot id, uid, hostname, mount
namespace) in ``hello``; a sender uses ipc only when the receiver's identity
equals its own (:meth:`IpcSender.peer_reason`), so ``auto`` never picks ipc
across machines or containers, and a forced ``ipc`` raises
:class:`TransportUnavailable` saying which part differs.  Set
``TENSORXFER_DISABLE_IPC=1`` to take ipc out of this process's capabilities
(``auto`` then picks the next transport, and says so).

Messages (``SOCK_SEQPACKET``: boundaries are kept, fds travel with one message)
----------------------------------------------------------------------------
The Unix socket is connected once per session (the setup update) and
carries every later update; the private directory is removed as soon as the
sender is connected.  Handles are exported and passed once per region: a
later update of the same region says ``cached`` and passes nothing, and the
receiver copies from the mapping it kept. ::

    setup:
    sender -> receiver  "TXI1" u64be(seq) proof(32)    proof = M(S, "ipc", nonce, u64be(seq))
    receiver -> sender  "K"  |  "E" utf-8 reason       (then the receiver closes)
    every update:
    sender -> receiver  msgpack {kind: "host"|"cuda", device: int, nbytes: int, token: bin16, count: int,
                                 cached: bool, seq: int, ready: int}
    sender -> receiver  "F" msgpack [[offset, size], ...] + as many fds (SCM_RIGHTS, at most 250),
                        in chunk order, until ``count`` chunks have arrived (none when cached)
    sender -> receiver  "W" u64be(ready)  ... while ready < nbytes: the watermark grew ...
                        |  "E" utf-8 reason  (the sender gives up: a relay whose upstream failed)
    receiver -> sender  "P" u64be(bytes)  ... progress while copying ...
    receiver -> sender  "D" u64be(nbytes)  |  "E" utf-8 reason

``send()`` returns only after ``D``: the receiver has finished copying (or,
sharing, has mapped the memory), so the sender may reuse or free its region.

Watermark (fan-out relays)
--------------------------
The receiver copies (pulls) from the sender's memory, so a fan-out relay
(:mod:`tensorxfer.fanout`) that forwards an update while its own copy is
still landing must say how far its region is ready: ``ready`` in the chunk
table is the payload prefix the receiver may copy now, and each ``W`` raises
it (strictly growing, at most ``nbytes``; anything else is a
:class:`ProtocolError`).  The receiver copies a piece only once the
watermark covers it; if it stands still for ``stall_timeout`` the update
fails with :class:`TransferTimeout`.  A plain sender says ``ready = nbytes``
in the chunk table: no extra message, no wait (an absent ``ready`` means the
same).  A relay sends ``ready = 0`` and raises it as its own copy lands; a
relay's receiver reports a piece as landed only once its bytes are there
(device copies: once the stream finished them, seen through stream marks
while the next piece copies).  Relayed copies use smaller pieces
(``RELAY_PIECE_BYTES`` host, ``RELAY_CUDA_PIECE_BYTES`` device), the same
on both ends of a hop: a piece is the chain's delay per hop.  The receiver
advertises that it reads ``W`` (``watermark: true`` in its accept
descriptors); to a receiver that does not, or to a share-mode one, a relay
sends only complete regions.

Share mode (``Receiver(share=True)``)
-------------------------------------
The received :class:`TensorRegion` *is* the sender's memory: host chunks are
mapped ``PROT_READ`` (numpy views are read-only; a write faults instead of
corrupting the sender), CUDA chunks are imported read-write (the driver's
import has no read-only mode) and the receiver must not write them.  The
sender's later writes to its region (e.g. ``update_from`` for the next
training step) are visible in place; sending the same region again is then
only a notification: the receiver gets the same region object back, nothing
is mapped again (memfds are recognised by inode, CUDA handles by the
sender's pid and region token).  New memory on the sender gives a new
mapping, and the previous region is released.  The mapping keeps the memory alive by
itself: if the sender frees its region, the receiver still reads the last
contents.  The region lives where the sender's does (host memory, or the
sender's GPU imported on the receiver's device index), whatever the
receiver's ``device``.  The receiver owns the mapping and releases it when it
closes the region (``Receiver.close()`` or the next ``receive``); the passed
fds are closed as soon as they are mapped.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import numpy as np

from tensorxfer.connections import Gate, listen
from tensorxfer.errors import (
    AuthError,
    CudaError,
    HandleError,
    PeerLost,
    ProtocolError,
    RegionError,
    TensorXferError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    UpstreamFailed,
)
from tensorxfer.memory import HostRegion
from tensorxfer.protocol import MAX_FRAME_DEPTH, MAX_FRAME_OBJECTS, NONCE_BYTES, field, mac, nonce, scan_msgpack
from tensorxfer.transport.base import (
    PrefixFollower,
    Progress,
    ReceiverTransport,
    SenderTransport,
    TransferContext,
    setup_flag,
)

if TYPE_CHECKING:
    from tensorxfer.manifest import Manifest
    from tensorxfer.region import TensorRegion

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DISABLE_ENV = "TENSORXFER_DISABLE_IPC"
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


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


# A relayed copy (the receiver is a fan-out relay, or its sender is one) goes in smaller pieces: each is
# reported as landed when its bytes are there, and the next hop waits for it, so the piece is the chain's
# delay per hop (tensorxfer.fanout).  Both ends of a hop use the same size, so the pieces line up.
RELAY_PIECE_BYTES = _env_int("TENSORXFER_IPC_FORWARD_PIECE", 16 << 20)
# Device pieces are large: measured on one H200 (8 GB, 3 relayed receivers on the same GPU), 256 MiB pieces
# took 4.0x one receiver's time, 1 GiB 3.2x, the whole region at once 3.05x -- every hop there shares one
# memory, so overlap gains nothing and each piece's mark and watermark message costs.  1 GiB keeps hops on
# different GPUs pipelined (a 31 GB region is 30 pieces) at almost no cost where they share one.
RELAY_CUDA_PIECE_BYTES = _env_int("TENSORXFER_IPC_CUDA_FORWARD_PIECE", 1 << 30)


#: Threads copying host memory (each copy releases the GIL); measured in benchmarks/bench_ipc.py.
COPY_THREADS = _env_int("TENSORXFER_IPC_THREADS", min(4, os.cpu_count() or 1))


# ---------------------------------------------------------------- identity and credentials
def host_identity() -> dict[str, Any]:
    """What a peer must share with us for ipc: machine (boot id, hostname), user and mount namespace.

    Raises
    ------
    OSError
        The boot id cannot be read (not Linux, or ``/proc`` is missing).
    """
    with open(BOOT_ID_PATH) as f:
        boot_id = f.read().strip()
    try:
        mnt_ns = os.readlink("/proc/self/ns/mnt")
    except OSError:
        mnt_ns = ""
    return {"boot_id": boot_id, "uid": os.getuid(), "hostname": socket.gethostname(), "mnt_ns": mnt_ns}


def identity_mismatch(peer: Any) -> str | None:
    """Why a peer advertising ``peer`` (its :func:`host_identity`) is not on our host as our user; None if it is."""
    if not isinstance(peer, dict):
        return "the receiver did not advertise a host identity"
    try:
        mine = host_identity()
    except OSError as e:
        return f"cannot read this host's identity: {e}"
    labels = {"boot_id": "another machine (boot id differs)", "hostname": "another host (hostname differs)",
              "uid": "another user", "mnt_ns": "another mount namespace (container)"}
    for key, what in labels.items():
        if peer.get(key) != mine[key]:
            return f"the receiver runs on {what}: {key} {peer.get(key)!r} != ours {mine[key]!r}"
    return None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    fmt = struct.Struct("3i")
    pid, uid, gid = fmt.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, fmt.size))
    return pid, uid, gid


def check_peer(sock: socket.socket) -> int:
    """Refuse a peer of another uid; return its pid.

    Raises
    ------
    AuthError
        The peer process runs as another user (the message names both uids).
    """
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():
        raise AuthError(f"ipc: the peer process (pid {pid}) runs as uid {uid}, this process as uid "
                        f"{os.getuid()}; ipc only connects processes of the same user — run both as one user "
                        f"or use transport='tcp'")
    return pid


def _proof(ctx: TransferContext, ipc_nonce: bytes, seq: int) -> bytes:
    return mac(ctx.session_key, b"ipc", ipc_nonce, U64.pack(seq))


def _recv(sock: socket.socket, what: str, timeout: float) -> bytes:
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


def _send(sock: socket.socket, data: bytes, what: str, fds: list[int] | None = None) -> None:
    try:
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout(f"ipc: the peer did not take {what} in time") from None
    except OSError as e:
        raise PeerLost(f"ipc: connection lost sending {what}: {e}") from None


def _unavailable() -> str | None:
    if os.environ.get(DISABLE_ENV, "").lower() in ("1", "true", "yes", "on"):
        return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if not sys.platform.startswith("linux"):
        return f"needs Linux (memfd, SO_PEERCRED), this is {sys.platform}"
    if not hasattr(socket, "send_fds") or not hasattr(socket, "SO_PEERCRED"):
        return "this Python lacks socket.send_fds / SO_PEERCRED"
    try:
        host_identity()
    except OSError as e:
        return f"cannot read the host identity ({e})"
    return None


def _unpack(data: bytes, what: str) -> Any:
    scan_msgpack(data, MAX_FRAME_OBJECTS, MAX_FRAME_DEPTH, what=f"ipc: {what}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=64, max_ext_len=0)
    except Exception as e:
        raise ProtocolError(f"ipc: {what} is not valid msgpack: {e}") from None


def _parse_header(data: bytes) -> tuple[str, int, int, bytes, int, bool, int, int]:
    """The update's chunk table header; the last item is ``ready`` (absent: ``nbytes``, everything ready)."""
    table = _unpack(data, "the chunk table header")
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
    if kind not in ("host", "cuda") or device < 0 or nbytes < 0 or not 0 <= count <= MAX_CHUNKS \
            or (count == 0) != (nbytes == 0 or cached) or (cached and nbytes == 0) or len(token) != 16:
        raise ProtocolError(f"ipc: chunk table out of range: kind {kind!r}, device {device}, {nbytes} bytes, "
                            f"{count} chunks, cached {cached}, {len(token)}-byte token")
    return kind, device, nbytes, token, count, cached, seq, ready


def _add_chunks(chunks: list[tuple[int, int]], raw: Any, nbytes: int) -> None:
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


class _SourceCache:
    """The mapping of the sender's handles, kept for the session's next update (copy mode).

    A training loop sends the same region every step: exporting, passing and
    mapping 31 GB of memfd pages (or a hundred CUDA handles) each time would
    cost as much as the copy.  So the sender passes a region's handles once
    per session and then says ``cached``; the key proves it is the same
    memory: the sender's pid (from ``SO_PEERCRED``), a random token the
    sender keeps per region, and the device it is mapped on.  The transport
    closes it when the session ends; until then it keeps at most one region
    of the sender's memory alive after the sender freed it.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.region: Any = None

    def get(self, key: tuple) -> Any:
        return self.region if self.key == key else None

    def put(self, key: tuple, region: Any) -> None:
        if region is not self.region:
            self.close()
        self.key, self.region = key, region

    def close(self) -> None:
        region, self.region, self.key = self.region, None, None
        if region is not None:
            region.close(defer=True)    # a copy still running in another thread holds views: unmap after it


_TOKENS: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()
_SHARED_KEYS: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()   # shared region -> its memory


def _close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class _Watermark:
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


class _LandedMarks:
    """Device copies queued back to back, each piece reported as landed once the GPU finished it.

    A relay's next hop copies a piece as soon as it is reported, so a report must mean the bytes are
    there, not that the copy was queued.  Waiting for each piece before queueing the next would leave
    the copy engine idle in between, so piece k is waited for (and reported) after piece k+1 was queued:
    two stream marks, alternating.
    """

    def __init__(self, copier: Any, landed: Callable[[int, int], None]) -> None:
        self._copier = copier
        self._landed = landed
        self._pending: tuple[int, int, int] | None = None
        self._count = 0

    def queued(self, off: int, n: int) -> None:
        """Piece ``[off, off+n)`` was just queued: mark it, report the one before it once that finished."""
        slot = self._count & 1
        self._count += 1
        self._copier.mark(slot)
        self.finish()
        self._pending = (off, n, slot)

    def finish(self) -> None:
        """Wait for the last piece queued and report it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            off, n, slot = pending
            self._copier.wait_mark(slot)
            self._landed(off, n)


# ---------------------------------------------------------------- receiver
class IpcReceiver(ReceiverTransport):
    """Receives regions from a process on the same host: maps its handles once, copies (or shares) each update."""

    name: ClassVar[str] = "ipc"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._dir: str | None = None
        self._gate: Gate | None = None          # open only while a setup waits for the sender
        self._conn: socket.socket | None = None
        self._nonce = b""
        self._seq = 0
        self._setup_seq = 0
        self._region: TensorRegion | None = None
        self._manifest: Manifest | None = None
        self._device = "cpu"
        self._shared: TensorRegion | None = None
        self._previous: TensorRegion | None = None      # share mode: the region the last transfer returned
        self._cache = _SourceCache()                    # copy mode: the sender's memory, mapped
        self._copiers: dict[int, Any] = {}              # device -> Copier, for the session
        self._closing = False
        self._peer_pid = 0
        self._lock = threading.Lock()
        # Hook for relays (tensorxfer.fanout): called with (region offset, length) of every piece once its
        # bytes are in the region (for device copies: finished on the stream, not queued), so the next hop
        # can copy it before the whole update landed.
        self.on_piece: Callable[[int, int], None] | None = None

    @classmethod
    def available(cls) -> str | None:
        return _unavailable()

    def _release_source(self, key: tuple, src: Any, ok: bool) -> None:
        if self._manifest is None and ok:
            self._cache.put(key, src)
        else:
            if self._cache.region is src:
                self._cache.key = self._cache.region = None
            src.close()

    def prepare(self, region: TensorRegion, seq: int, fresh: bool) -> dict[str, Any]:
        """Copy mode.  Descriptors: ``setup``, ``share`` (false), ``streams``; on setup ``path``, ``nonce``,
        ``identity`` of a Unix socket in a fresh 0700 directory."""
        self._region, self._manifest, self._device = region, None, region.device
        return self._begin(seq, fresh, share=False)

    def prepare_shared(self, manifest: Manifest, device: str, seq: int, fresh: bool,
                       previous: TensorRegion | None = None) -> dict[str, Any]:
        """Like :meth:`prepare`, for share mode: nothing is allocated; :meth:`take_shared` returns the
        sender's memory as a region with ``manifest``'s layout after :meth:`wait`.

        When the sender passes the same memory as the one ``previous`` (the region the last shared
        transfer returned) maps, with the same layout, ``take_shared`` returns ``previous`` itself:
        it already shows the sender's update, and nothing is mapped again.
        """
        self._region, self._manifest, self._device, self._previous = None, manifest, device, previous
        return self._begin(seq, fresh, share=True)

    def _begin(self, seq: int, fresh: bool, share: bool) -> dict[str, Any]:
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

    def wait(self, progress: Progress | None = None) -> int:
        """(On setup: admit the authenticated sender.)  Map its handles or reuse the mapping, copy (or share);
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
            raise ProtocolError("IpcReceiver.wait() before prepare()")
        try:
            nbytes = self._receive(conn, progress)
        except TensorXferError as e:
            try:
                conn.send(b"E" + str(e).encode()[:4000])
            except OSError:
                pass    # the sender is gone; it will see the closed connection instead
            raise
        _send(conn, b"D" + U64.pack(nbytes), "the done message")
        self.counters.updates += 1
        return nbytes

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
            data = _recv(conn, "the authentication message", min(HEADER_TIMEOUT, self.ctx.stall_timeout))
            missing = ""
        except TransferError as e:
            data, missing = b"", f"no authentication message: {e}"
        pid = 0
        try:
            pid = check_peer(conn)
            reason = missing
            if data:
                magic, tid, proof = AUTH.unpack(data) if len(data) == AUTH.size else (b"", 0, b"")
                if len(data) != AUTH.size:
                    reason = f"authentication message of {len(data)} bytes, expected {AUTH.size}"
                elif magic != AUTH_MAGIC or tid != self._setup_seq \
                        or not hmac.compare_digest(proof, _proof(self.ctx, self._nonce, tid)):
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

    def _receive(self, conn: socket.socket, progress: Progress | None) -> int:
        timeout = self.ctx.stall_timeout
        kind, device, nbytes, token, count, cached, seq, ready = _parse_header(_recv(conn, "the chunk table",
                                                                                   timeout))
        expected = self._manifest.nbytes if self._manifest is not None else self._region.nbytes \
            if self._region is not None else -1
        if seq != self._seq:
            raise ProtocolError(f"ipc: the sender passes update {seq}, this is update {self._seq}")
        if nbytes != expected:
            raise ProtocolError(f"ipc: the sender passes {nbytes} payload bytes, the offer's manifest has "
                                f"{expected}")
        if not nbytes:
            return self._empty()
        fds: list[int] = []
        watermark = _Watermark(conn, nbytes, ready, timeout)
        try:
            handles = [] if cached else self._receive_handles(conn, nbytes, count, fds)
            if self._manifest is not None:
                watermark.wait(nbytes)      # share mode: the sender's memory is the region, once all of it is
            if kind == "host":
                return self._from_host(conn, handles, nbytes, progress, fds, token, watermark)
            return self._from_cuda(conn, handles, device, nbytes, progress, fds, token, watermark)
        finally:
            _close_fds(fds)

    def _receive_handles(self, conn: socket.socket, nbytes: int, count: int, fds: list[int]) -> list[tuple[int, int]]:
        """``count`` (size, fd) handles tiling ``[0, nbytes)``; the fds go into ``fds`` (the caller closes them)."""
        chunks: list[tuple[int, int]] = []
        while len(fds) < count:
            conn.settimeout(self.ctx.stall_timeout)
            try:
                data, got, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, FD_BATCH, socket.MSG_CMSG_CLOEXEC)
            except TimeoutError:
                raise TransferTimeout(f"ipc: the sender passed {len(fds)} of {count} handles and "
                                      f"stalled") from None
            except OSError as e:
                raise PeerLost(f"ipc: connection lost after {len(fds)} of {count} handles: {e}") from None
            fds.extend(got)
            if not data:
                raise PeerLost(f"ipc: the sender closed after {len(fds)} of {count} handles")
            if flags & socket.MSG_CTRUNC:
                raise TransferError(f"ipc: handles were dropped in transit after {len(fds)} of {count} (this "
                                    f"process's open-file limit, RLIMIT_NOFILE, may be too low for so many "
                                    f"chunks: raise it, or use larger chunks)")
            if data[:1] != b"F" or not got or flags & socket.MSG_TRUNC:
                raise ProtocolError(f"ipc: bad handle message ({data[:8]!r}, {len(got)} fds, flags {flags:#x}; "
                                    f"{len(fds)} of {count} handles so far)")
            before = len(chunks)
            _add_chunks(chunks, _unpack(data[1:], "a handle message"), nbytes)
            if len(chunks) - before != len(got) or len(chunks) > count:
                raise ProtocolError(f"ipc: a handle message lists {len(chunks) - before} chunks but carries "
                                    f"{len(got)} fds ({len(chunks)} of {count} chunks so far)")
        if chunks[-1][0] + chunks[-1][1] < nbytes:
            raise ProtocolError(f"ipc: {count} chunks end at {chunks[-1][0] + chunks[-1][1]}, before the "
                                f"{nbytes}-byte payload does")
        self.counters.registrations += 1
        return [(size, fd) for (_, size), fd in zip(chunks, fds)]

    def _source(self, key: tuple, handles: list[tuple[int, int]], fds: list[int], import_: Any) -> Any:
        """The sender's memory: the session's mapping when the sender said ``cached``, else ``handles`` imported."""
        if not handles:
            src = self._previous if self._manifest is not None and self._reusable_previous(key) else None
            src = src or self._cache.get(key)
            if src is None:
                raise ProtocolError("ipc: the sender says this region's handles were passed before, but this "
                                    "session holds no mapping of them")
            return src
        src = import_(handles)
        _close_fds(fds)     # the mappings hold the memory now
        return src

    # -- host handles
    def _from_host(self, conn: socket.socket, handles: list[tuple[int, int]], nbytes: int,
                   progress: Progress | None, fds: list[int], token: bytes, watermark: _Watermark) -> int:
        key = ("host", self._peer_pid, token)

        def import_(hs: list[tuple[int, int]]) -> HostRegion:
            try:    # every fd checked first: a sealed memory file at least as long as its chunk
                return HostRegion.import_handles(hs, writable=False, populate=True)
            except (HandleError, ValueError) as e:     # ValueError: a chunk size that is not a page multiple
                raise ProtocolError(f"ipc: the sender passed an unusable handle: {e}") from None
        src = self._source(key, handles, fds, import_)
        if self._manifest is not None:
            return self._adopt(src, "cpu", key)
        ok = False
        try:
            assert self._region is not None
            dst = self._region
            # Both copies below return once the bytes are there: each piece may be reported as landed.
            pieces = self._pieces(watermark, RELAY_PIECE_BYTES, PIECE_BYTES)
            if dst.is_cuda:
                with memoryview(src) as view:
                    self._copy_pieces(nbytes, progress, conn,
                                      lambda off, n: self._host_to_cuda(dst, view, off, n), threads=1,
                                      piece_bytes=pieces, watermark=watermark, landed=self.on_piece)
                    copier = dst._get_copier()
                    copier.synchronize()
            else:
                s = np.frombuffer(memoryview(src), dtype=np.uint8, count=nbytes)
                d = np.frombuffer(memoryview(dst.region), dtype=np.uint8, count=nbytes)
                try:
                    self._copy_pieces(nbytes, progress, conn,
                                      lambda off, n: np.copyto(d[off:off + n], s[off:off + n]), COPY_THREADS,
                                      piece_bytes=pieces, watermark=watermark, landed=self.on_piece)
                finally:
                    del s, d
            ok = True
        finally:
            self._release_source(key, src, ok)
        return nbytes

    @staticmethod
    def _host_to_cuda(dst: TensorRegion, view: memoryview, off: int, n: int) -> None:
        dst._get_copier().htod(dst.region.ptr + off, view[off:off + n])

    # -- cuda handles
    def _from_cuda(self, conn: socket.socket, handles: list[tuple[int, int]], device: int, nbytes: int,
                   progress: Progress | None, fds: list[int], token: bytes, watermark: _Watermark) -> int:
        from tensorxfer.memory import CUDA_UNAVAILABLE, CudaRegion
        from tensorxfer.region import parse_device

        if CudaRegion is None:
            raise TransportUnavailable(f"ipc: the sender's region is on cuda:{device} but this receiver cannot use "
                                       f"CUDA: {CUDA_UNAVAILABLE}")
        kind, index = parse_device(self._device)
        on = index if kind == "cuda" else device
        key = ("cuda", self._peer_pid, token, on)
        src = self._source(key, handles, fds, lambda hs: CudaRegion.import_handles(hs, device=on))
        if self._manifest is not None:
            return self._adopt(src, f"cuda:{on}", key)
        ok = False
        try:
            assert self._region is not None
            dst = self._region
            copier = self._copier(on)
            landed = self.on_piece
            if dst.is_cuda:
                # Device copies are only queued here: a relay reports each piece once the stream finished it.
                marks = _LandedMarks(copier, landed) if landed is not None else None

                def piece(off: int, n: int) -> None:
                    copier.dtod(dst.region.ptr + off, src.ptr + off, n)
                    if marks is not None:
                        marks.queued(off, n)
                sync = marks.finish if marks is not None else copier.synchronize
                self._copy_pieces(nbytes, progress, conn, piece, threads=1, sync=sync,
                                  piece_bytes=self._pieces(watermark, RELAY_CUDA_PIECE_BYTES, CUDA_PIECE_BYTES),
                                  watermark=watermark)
            else:
                d = np.frombuffer(dst.region, dtype=np.uint8, count=nbytes)

                def piece(off: int, n: int) -> None:
                    copier.dtoh(d[off:off + n], src.ptr + off)      # returns once the bytes are in d
                self._copy_pieces(nbytes, progress, conn, piece, threads=1, sync=copier.synchronize,
                                  piece_bytes=self._pieces(watermark, RELAY_PIECE_BYTES, PIECE_BYTES),
                                  watermark=watermark, landed=landed)
            copier.synchronize()
            ok = True
        finally:
            self._release_source(key, src, ok)
        return nbytes

    def _copier(self, device: int) -> Any:
        """The session's copy stream on ``device`` (made once: a stream per update costs time on the GPU)."""
        copier = self._copiers.get(device)
        if copier is None:
            from tensorxfer.memory._cuda import Copier

            copier = self._copiers[device] = Copier(device)
        return copier

    # -- helpers
    def _pieces(self, watermark: _Watermark, relayed: int, plain: int) -> int:
        """The copy's piece size: ``relayed`` when this receiver forwards pieces or its sender still fills its
        region (fan-out), else the plain copy's (larger: fewer messages, nothing waits for a piece)."""
        return relayed if self.on_piece is not None or not watermark.complete else plain

    def _copy_pieces(self, nbytes: int, progress: Progress | None, conn: socket.socket, copy: Any,
                     threads: int, sync: Any = None, piece_bytes: int = PIECE_BYTES,
                     watermark: _Watermark | None = None, landed: Callable[[int, int], None] | None = None) -> None:
        """Run ``copy(offset, n)`` over ``[0, nbytes)`` in ``piece_bytes`` pieces on ``threads`` threads.

        Each piece is copied once the sender's ``watermark`` reached its end, and reported to ``landed``
        once ``copy`` returned (``copy`` must return once the bytes are there when ``landed`` is given).
        Progress goes to the local callback and, as ``P`` messages, to the sender (so its stall timer
        measures a stall, not the length of a long copy).
        """
        pieces = [(off, min(piece_bytes, nbytes - off)) for off in range(0, nbytes, piece_bytes)]
        lock = threading.Lock()
        state: dict[str, Any] = {"next": 0, "done": 0, "error": None}

        def worker() -> None:
            while True:
                with lock:
                    i = state["next"]
                    if i >= len(pieces) or state["error"] is not None or self._closing:
                        return
                    state["next"] = i + 1
                off, n = pieces[i]
                try:
                    if watermark is not None:
                        watermark.wait(off + n)
                    copy(off, n)
                    if landed is not None:
                        landed(off, n)
                    if progress is not None:
                        progress(n)
                    with lock:
                        state["done"] += n
                        conn.send(b"P" + U64.pack(state["done"]))
                except BaseException as e:
                    # close() from another thread tears the socket down under us: say so, not "lost"
                    error = TransferError("ipc: the transfer was aborted during the copy") if self._closing else e
                    with lock:
                        state["error"] = state["error"] or error
                    return

        workers = [threading.Thread(target=worker, name=f"tensorxfer-ipc-copy-{k}", daemon=True)
                   for k in range(max(1, min(threads, len(pieces))) - 1)]
        for t in workers:
            t.start()
        worker()
        for t in workers:
            t.join()
        error = state["error"]
        if isinstance(error, OSError) and not isinstance(error, TensorXferError):
            raise PeerLost(f"ipc: connection to the sender lost during the copy: {error}")
        if error is not None:
            raise error
        if self._closing:
            raise TransferError("ipc: the transfer was aborted during the copy")
        if sync is not None:
            sync()

    def _empty(self) -> int:
        if self._manifest is not None:
            from tensorxfer.region import TensorRegion

            self._shared = TensorRegion.from_manifest(self._manifest, device=self._device)
        return 0

    def _reusable_previous(self, key: tuple) -> bool:
        """Share mode: does the previous shared region map the very memory the sender names?"""
        prev = self._previous
        return (self._manifest is not None and prev is not None and not prev.closed
                and _SHARED_KEYS.get(prev) == key and prev.manifest.same_layout(self._manifest))

    def _adopt(self, src: Any, device: str, key: tuple) -> int:
        from tensorxfer.region import TensorRegion

        assert self._manifest is not None
        if src is self._previous:       # the same memory again: the region is reused as is
            self._shared = src
            return self._manifest.nbytes
        try:
            self._shared = TensorRegion(src, self._manifest, device=device)
        except BaseException:
            src.close()
            raise
        _SHARED_KEYS[self._shared] = key
        return self._manifest.nbytes

    def take_shared(self) -> TensorRegion:
        """Share mode: the region backed by the sender's memory (now the caller's to close)."""
        region, self._shared = self._shared, None
        if region is None:
            raise ProtocolError("ipc: take_shared() before a successful shared wait()")
        return region

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
        self._cache.close()

    def close(self) -> None:
        """Close the socket, remove the private directory, release the session's mappings; idempotent."""
        self._closing = True
        self._teardown()
        shared, self._shared = self._shared, None
        if shared is not None and shared is not self._previous:     # the previous one is its owner's
            shared.close(defer=True)
        self._previous = None
        self._region = None
        copiers, self._copiers = self._copiers, {}
        for copier in copiers.values():
            copier.close()


# ---------------------------------------------------------------- sender
class IpcSender(SenderTransport):
    """Passes a region's memory handles (once per session) to a receiver on the same host; waits for each copy."""

    name: ClassVar[str] = "ipc"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._passed: bytes | None = None       # token of the region whose handles the receiver holds
        self._seq = 0
        self.share = False
        self._watermarks = False                # the receiver waits for "W" messages (accept descriptors)
        # Hook for relays (tensorxfer.fanout): blocks until the region's landed prefix reaches past an
        # offset and returns its end (raises UpstreamFailed); the receiver copies up to it meanwhile.
        self.ready_after: Callable[[int], int] | None = None

    @classmethod
    def available(cls) -> str | None:
        return _unavailable()

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        return {"identity": host_identity()}

    @classmethod
    def peer_reason(cls, peer_caps: dict[str, Any] | None) -> str | None:
        return identity_mismatch((peer_caps or {}).get("identity"))

    @classmethod
    def forward_piece_bytes(cls, region: TensorRegion, streams: int | None = None) -> int:
        """The piece a relay's copy reports as landed and its next hop waits for (receivers whose regions are
        on the same kind of memory as ``region``)."""
        return min(region.nbytes, RELAY_CUDA_PIECE_BYTES if region.is_cuda else RELAY_PIECE_BYTES)

    def needs_setup(self, region: TensorRegion) -> bool:
        return self._sock is None

    def connect(self, region: TensorRegion, seq: int, descriptors: dict[str, Any]) -> None:
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
        _send(sock, AUTH.pack(AUTH_MAGIC, seq, _proof(self.ctx, ipc_nonce, seq)), "authentication")
        answer = _recv(sock, "the authentication answer", self.ctx.stall_timeout)
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
            Relaying (``ready_after`` set): this relay's own update failed; the receiver was told.
        """
        sock = self._sock
        if sock is None:
            raise ProtocolError("IpcSender.send() before connect()")
        nbytes = region.nbytes
        kind, device = ("cuda", int(region.region.device_index)) if region.is_cuda else ("host", 0)
        token = _TOKENS.get(region)
        if token is None:
            token = _TOKENS[region] = os.urandom(16)
        ready = self._ready_now(nbytes)
        cached = nbytes > 0 and token == self._passed
        chunks = [] if cached or not nbytes else self._export(region)
        owned = [fd for _, _, fd in chunks]     # exported handles are ours to close once passed
        try:
            table = msgpack.packb({"kind": kind, "device": device, "nbytes": nbytes, "token": token,
                                   "count": len(chunks), "cached": cached, "seq": self._seq, "ready": ready},
                                  use_bin_type=True)
            _send(sock, table, "the chunk table")
            for i in range(0, len(chunks), FD_BATCH):
                batch = chunks[i:i + FD_BATCH]
                _send(sock, b"F" + msgpack.packb([[off, size] for off, size, _ in batch]), "memory handles",
                      [fd for _, _, fd in batch])
        finally:
            _close_fds(owned)
        if chunks:
            self._passed = token
            self.counters.registrations += 1
        forward = None
        if ready < nbytes and self.ready_after is not None:
            # Relaying: each new end of this relay's landed prefix goes out as a "W" watermark; when the
            # relay's upstream fails, the receiver is told with an "E" message (and this send raises).
            def tell_failed(e: BaseException) -> None:
                if isinstance(e, UpstreamFailed):
                    try:
                        sock.send(b"E" + str(e).encode()[:4000])
                    except OSError:
                        pass    # the receiver is gone: _wait_copied finds that out itself
            forward = PrefixFollower(ready, nbytes, self.ready_after,
                                     lambda end: _send(sock, b"W" + U64.pack(end), "the watermark"),
                                     "tensorxfer-ipc-forward", tell_failed)
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
        return nbytes

    def _ready_now(self, nbytes: int) -> int:
        """How much of the region the receiver may copy at once: all of it, unless this is a relay whose own
        copy is still landing (then 0, and a forwarder sends the rest as it lands)."""
        ready_after = self.ready_after
        if ready_after is None or nbytes == 0:
            return nbytes
        if self._watermarks and not self.share:
            return 0
        # A receiver that does not wait for watermarks, or one that maps the region instead of copying it
        # (share mode: it needs all of it at once), gets the region once it is complete.
        pos = 0
        while pos < nbytes:
            pos = ready_after(pos)
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
            msg = _recv(sock, "the receiver's copy to finish", self.ctx.stall_timeout)
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

    @staticmethod
    def _export(region: TensorRegion) -> list[tuple[int, int, int]]:
        """``(offset, size, fd)`` of the chunks holding the payload; the fds are new (the caller closes them)."""
        try:
            chunks = region.region.export_handles()
        except (CudaError, RegionError) as e:
            raise TransportUnavailable(f"ipc: the region's memory handles cannot be exported ({e}); "
                                       f"use transport='tcp'") from None
        inside = [c for c in chunks if c[0] < region.nbytes]
        _close_fds([fd for off, _, fd in chunks if off >= region.nbytes])
        if not inside or any(fd < 0 for _, _, fd in inside):
            _close_fds([fd for _, _, fd in inside if fd >= 0])
            raise TransportUnavailable("ipc: the region's memory was adopted, not allocated by tensorxfer, so "
                                       "there are no memory handles to pass; copy it into a TensorRegion "
                                       "(from_tensors) or use transport='tcp'")
        return inside

    def close(self) -> None:
        """Close the socket; idempotent, callable from another thread."""
        with self._lock:
            sock, self._sock = self._sock, None
        self._passed = None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass    # never connected: closing is enough
            sock.close()
