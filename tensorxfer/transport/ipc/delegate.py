"""A weight sync's targets that share a GPU copy in ONE process: a copy host, and the lanes that feed it.

Why: without MPS a GPU time-slices the kernels of different processes' contexts.  On one H100, two target
processes each copying their half of ``bench_sync``'s 16 GB 4-to-2 plan kept the GPU ~12.4 ms from the first
launch to the last copy's end; the same kernels launched from one process took 11.2 ms
(``benchmarks/results/2026-12-05-h100-sync``).  With this, the sync went from 0.78 to 0.85 of a torch copy
on an H100 and from 0.75 to 0.80-0.82 on an H200 (``2026-12-05-copy-host``).  So the targets of a sync on one
GPU elect one of them
(:mod:`tensorxfer.sync.copy_host`); it runs a :class:`CopyHost`, and each other target (a follower) hands
each of its pairs' copies to it over a :class:`CopyLane`, one per pair:

- a lane is a Unix ``SOCK_SEQPACKET`` connection to a socket in the host's fresh 0700 directory; each end
  checks the other's uid (``SO_PEERCRED``), and each proves the group's token key by an HMAC over the
  other's nonce before the follower passes any handle;
- setup (``S``, then ``F`` handle batches with their fds, then ``T`` batches of the segment columns): the
  source's memory handles as the follower got them, the follower's own region's handles, the pair's
  segments; the host maps both regions and builds the pair's copy, and answers ``K`` (or ``E`` + why);
- a step is ``G`` + seq, answered ``K`` + seq once the bytes are in the follower's memory (the host's
  stream synchronized), or ``E`` + why; on a GPU the host serves a lane's steps in one loop without the GIL
  (``StridedCopy.serve_lane``), so a step does not wait behind the host's own feeds for it.

The follower still maps the source itself: a lane whose host refused or went away (``E``, or the connection
closed: the host closed, or its process died and its CUDA context with it) makes the follower copy the pair
locally, that step included -- redoing the whole pair's copy is safe, both copies write the same bytes (the
source holds its region until the pair is acked).  A host that stalls past the stall timeout fails the pair's
step instead: it may still be copying, so copying here and reporting the version would not make it whole.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import socket
import tempfile
import threading
from typing import Any

import msgpack
import numpy as np

from tensorxfer.connections import Gate, listen
from tensorxfer.errors import (
    AuthError,
    PeerLost,
    ProtocolError,
    TensorXferError,
    TransferError,
)
from tensorxfer.protocol import field, mac, nonce
from tensorxfer.transport.ipc.identity import check_peer
from tensorxfer.transport.ipc.messages import (
    HEADER_TIMEOUT,
    MAX_CHUNKS,
    MAX_MESSAGE,
    U64,
    close_fds,
    receive_handles,
    recv_message,
    send_handles,
    send_message,
    unpack,
)
from tensorxfer.transport.ipc.pairs import DeviceSegments, copy_segments_in_host_memory
from tensorxfer.transport.ipc.receiving import map_handles
from tensorxfer.transport.ipc.sender import export_handles
from tensorxfer.transport.segments import Segments

log = logging.getLogger(__name__)

_NO_TOKEN = b"tensorxfer-copy-host-without-token"    # a tokenless group: the uid check is the guard
_COLUMNS = 6                                         # src_off, dst_off, nbytes, count, src_stride, dst_stride
_T_BYTES = (MAX_MESSAGE - 64) // (8 * _COLUMNS) * (8 * _COLUMNS)     # segment bytes per "T" message
MAX_GROUPS = 1 << 20                                 # 48 MiB of columns: past any plan's pair


def _proof(key: bytes | None, who: bytes, challenge: bytes) -> bytes:
    return mac(key or _NO_TOKEN, b"copy-host", who, challenge)


class CopyHost:
    """The elected target's side: a listener, and a thread per lane copying into a follower's memory.

    ``device`` is this process's index of the GPU (None: host memory); ``key`` the group's token key.
    """

    def __init__(self, key: bytes | None, device: int | None, stall_timeout: float, threads: int = 2) -> None:
        self.device, self.stall_timeout, self.threads = device, float(stall_timeout), threads
        self._key = key
        self._closed = False
        self._lock = threading.Lock()
        self._lanes: dict[socket.socket, threading.Thread] = {}
        self._dir = tempfile.mkdtemp(prefix="tensorxfer-copyhost-")     # mode 0700: only our uid gets in
        self.path = os.path.join(self._dir, "s")
        try:
            self._gate = Gate(listen(self.path, socket.AF_UNIX, socket.SOCK_SEQPACKET), self._authenticate,
                              HEADER_TIMEOUT, "copy host")
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.lanes_served = 0       # lanes that connected, in all
        self.copies = 0             # pair copies made for followers, in all (a lane's run counts when it ends)
        self._acceptor = threading.Thread(target=self._accept, name="tensorxfer-copy-host", daemon=True)
        self._acceptor.start()

    def _authenticate(self, conn: socket.socket) -> int | None:
        """Both ends prove the group's key: the lane over this host's nonce (``A`` + its proof + its own
        nonce), then this host over the lane's (``K`` + proof), before the lane passes any handle."""
        challenge = nonce()
        try:
            pid = check_peer(conn)
            conn.send(b"N" + challenge)
            answer = recv_message(conn, "the lane's proof", HEADER_TIMEOUT)
            theirs, lane_nonce = answer[1:33], answer[33:]
            ok = answer[:1] == b"A" and len(lane_nonce) >= 16 and \
                hmac.compare_digest(theirs, _proof(self._key, b"lane", challenge))
            conn.send(b"K" + _proof(self._key, b"host", lane_nonce) if ok else
                      b"E" + b"the lane failed authentication (another group's token?)")
        except (AuthError, TensorXferError, OSError) as e:
            log.warning("copy host: refused a lane: %s", f"{type(e).__name__}: {e}")
            return None
        return pid if ok else None

    def _accept(self) -> None:
        while not self._closed:
            try:
                [(conn, _)] = self._gate.admit(1, abort=lambda: "closed" if self._closed else None)
            except TensorXferError:
                return      # closed
            lane = threading.Thread(target=self._serve, args=(conn,), name="tensorxfer-copy-lane", daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._lanes[conn] = lane
                self.lanes_served += 1
                lane.start()        # under the lock: close() joins only started lanes

    def _serve(self, conn: socket.socket) -> None:
        """One lane: set up, then copy each step, until the follower closes (or this host does).  Any failure
        (a bad setup, a copy, the socket) is told to the follower (``E``) and ends the lane: the rest of a
        failed setup's messages would read as nonsense."""
        pair: _HostedPair | None = None
        try:
            while True:
                conn.settimeout(None)       # blocking (a setup's reads leave a timeout on the socket)
                try:
                    # a device pair with the kernel serves its steps without the GIL, up to the next other message
                    served = pair.serve(conn) if pair is not None else None
                    if served is not None:
                        with self._lock:
                            self.copies += served[0]
                    msg = served[1] if served is not None else conn.recv(MAX_MESSAGE)
                    if not msg:
                        return
                    if msg[:1] == b"S":
                        old, pair = pair, None
                        try:
                            pair = _HostedPair.receive(conn, msg[1:], self.device, self.stall_timeout, old)
                        finally:
                            if old is not None:
                                old.close()     # what the new pair did not take over
                        conn.send(b"K")
                    elif msg[:1] == b"G" and len(msg) == 9 and pair is not None:
                        pair.copy(self.threads)
                        with self._lock:
                            self.copies += 1
                        conn.send(b"K" + msg[1:])
                    else:
                        raise ProtocolError(f"copy host: unexpected lane message {msg[:8]!r}"
                                            f"{' (a step before the setup)' if pair is None else ''}")
                except Exception as e:
                    log.warning("copy host: a lane failed: %s", f"{type(e).__name__}: {e}")
                    try:
                        conn.send(b"E" + str(e).encode()[:4000])
                    except OSError:
                        pass    # the follower is gone
                    return
        finally:
            if pair is not None:
                pair.close()
            with self._lock:
                self._lanes.pop(conn, None)
            conn.close()

    def close(self) -> None:
        """Stop taking lanes, end the open ones (each finishes the copy it runs and answers it, then unmaps),
        remove the socket's directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lanes = dict(self._lanes)
        self._gate.close()
        for conn in lanes:
            try:
                conn.shutdown(socket.SHUT_RD)   # the lane's next read ends it; a copy in flight still answers
            except OSError:
                pass        # already gone
        for lane in lanes.values():
            lane.join(self.stall_timeout)
        self._acceptor.join(self.stall_timeout)
        shutil.rmtree(self._dir, ignore_errors=True)


class _HostedPair:
    """One lane's pair on the host: the source's and the follower's memory mapped here, and their copy."""

    def __init__(self, src: tuple[Any, int], dst: tuple[Any, int], segments: Segments, device: int | None) -> None:
        (self.src, self.src_nbytes), (self.dst, self.dst_nbytes) = src, dst
        self.segments, self.device = segments, device
        self._copier: Any = None
        self._device_copy: DeviceSegments | None = None
        if device is not None:
            from tensorxfer.memory._copy import Copier

            self._copier = Copier(device)
            try:
                self._device_copy = DeviceSegments(segments, device)
            except BaseException:
                self._copier.close()
                raise

    @classmethod
    def receive(cls, conn: socket.socket, header: bytes, device: int | None, timeout: float,
                old: _HostedPair | None) -> _HostedPair:
        """The setup after its ``S`` header: both regions' handles, the segments; mapped and checked.  A region
        passed with no handles is ``old``'s mapping of it, taken over (a new plan for the same memory)."""
        head = unpack(header, "the lane's setup")
        if not isinstance(head, dict):
            raise ProtocolError("copy host: the lane's setup is not a map")
        kind, groups = field(head, "kind", str), field(head, "groups", int)
        src_nbytes, src_count, dst_nbytes, dst_count = (field(head, k, int) for k in (
            "src_nbytes", "src_count", "dst_nbytes", "dst_count"))
        if kind not in ("host", "cuda") or (kind == "cuda") != (device is not None) or not 0 <= groups <= MAX_GROUPS \
                or min(src_nbytes, dst_nbytes) <= 0 or not 0 <= min(src_count, dst_count) <= MAX_CHUNKS \
                or max(src_count, dst_count) > MAX_CHUNKS:
            raise ProtocolError(f"copy host: a lane's setup out of range ({kind!r} memory, {groups} groups, "
                                f"{src_count} chunks of {src_nbytes} bytes to {dst_count} of {dst_nbytes}) for a "
                                f"host of {'host' if device is None else 'cuda'} memory")
        fds: list[int] = []
        try:
            src_chunks = receive_handles(conn, src_count, src_nbytes, fds, timeout)
            dst_chunks = receive_handles(conn, dst_count, dst_nbytes, fds, timeout)
            raw = bytearray()
            while len(raw) < groups * _COLUMNS * 8:
                msg = recv_message(conn, "the lane's segments", timeout)
                if msg[:1] != b"T" or len(raw) + len(msg) - 1 > groups * _COLUMNS * 8:
                    raise ProtocolError(f"copy host: bad segments message {msg[:8]!r}")
                raw += msg[1:]
            cols = np.frombuffer(bytes(raw), dtype=">u8").astype(np.uint64).reshape(_COLUMNS, groups)
            segments = Segments(*(np.ascontiguousarray(c) for c in cols))
            check_lane_segments(segments, src_nbytes, dst_nbytes)
            if (src_count == 0 or dst_count == 0) and (old is None or (src_count == 0 and old.src_nbytes != src_nbytes)
                                                       or (dst_count == 0 and old.dst_nbytes != dst_nbytes)):
                raise ProtocolError("copy host: a lane's setup without handles, but this lane maps no such region")
            src = dst = None
            try:
                src = old.take("src") if old is not None and src_count == 0 else map_handles(src_chunks, device)
                dst = (old.take("dst") if old is not None and dst_count == 0 else
                       map_handles(dst_chunks, device, writable=True))
                return cls((src, src_nbytes), (dst, dst_nbytes), segments, device)
            except BaseException:
                for region in (src, dst):
                    if region is not None:
                        region.close()
                raise
        finally:
            close_fds(fds)

    def serve(self, conn: socket.socket) -> tuple[int, bytes] | None:
        """Serve the lane's steps without the GIL where this is a device pair with the kernel: ``(steps served,
        the next other message)``; else None."""
        if self._device_copy is None:
            return None
        return self._device_copy.serve_lane(self._copier, self.dst.ptr, self.src.ptr, conn.fileno())

    def copy(self, threads: int) -> None:
        if self._device_copy is not None:
            self._device_copy.launch(self._copier, self.dst.ptr, self.src.ptr)
            self._copier.synchronize()
        else:
            copy_segments_in_host_memory(self.src, self.dst, self.segments, threads)

    def take(self, which: str) -> Any:
        """Hand this pair's mapping of ``which`` ("src" or "dst") over to a new pair of the lane."""
        if self._copier is not None:
            self._copier.synchronize()
        region = getattr(self, which)
        setattr(self, which, None)
        return region

    def close(self) -> None:
        if self._copier is not None:
            self._copier.synchronize()      # nothing of ours may still run on memory we unmap
        if self._device_copy is not None:
            self._device_copy.close()
        if self._copier is not None:
            self._copier.close()
        for region in (self.src, self.dst):
            if region is not None:
                region.close()
        self.src = self.dst = None


def check_lane_segments(segments: Segments, src_nbytes: int, dst_nbytes: int) -> None:
    """Refuse segments a lane passed unless every run lies inside both regions and they write at most the
    follower's region's size in all.  Exact, in uint64 without overflow (a peer's columns are hostile input:
    a wrapped end would point a device copy outside the mappings, a huge count would copy for ever).

    Raises
    ------
    ProtocolError
        Naming the first group that does not fit.
    """
    so, do, w, h, ss, ds = (segments.src_off, segments.dst_off, segments.nbytes, segments.count,
                            segments.src_stride, segments.dst_stride)
    bad = np.zeros(len(w), bool)
    for off, stride, size in ((so, ss, src_nbytes), (do, ds, dst_nbytes)):
        n = np.uint64(size)
        fits = (h >= 1) & (off <= n) & (w <= n - np.minimum(off, n))
        room = n - np.minimum(off + np.minimum(w, n), n)            # bytes left after the first run
        steps = np.maximum(h, 1) - np.uint64(1)
        fits &= (steps == 0) | (stride <= room // np.maximum(steps, np.uint64(1)))
        bad |= ~fits
    # rows of a group do not overlap in the follower's region, so each group writes <= dst_nbytes ...
    bad |= (h > 1) & (ds < w)
    if bad.any():
        i = int(np.argmax(bad))
        raise ProtocolError(f"copy host: segments reach past the regions (group {i}: {int(h[i])} runs of {int(w[i])} "
                            f"bytes from {int(so[i])} step {int(ss[i])} to {int(do[i])} step {int(ds[i])}; regions "
                            f"of {src_nbytes} and {dst_nbytes} bytes)")
    # ... and all groups together at most that much
    if sum(int(x) for x in w * h) > dst_nbytes:
        raise ProtocolError(f"copy host: segments write {sum(int(x) for x in w * h)} bytes into a region of "
                            f"{dst_nbytes}: a plan writes each byte once")


class CopyLane:
    """A follower's lane for one pair (see the module docstring).

    Raises (each call)
    ------
    PeerLost, TransferTimeout, TransferError, ProtocolError
        The host is gone, stalled or refused: the caller copies locally instead.
    """

    def __init__(self, path: str, key: bytes | None, timeout: float) -> None:
        self.timeout = float(timeout)
        self.ready_for: Any = None      # what the host set up, as the caller names it
        self._dst: Any = None           # the follower's region whose handles the host holds
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
            check_peer(sock)
            mine = nonce()
            send_message(sock, b"A" + _proof(key, b"lane", challenge[1:]) + mine, "the lane's proof")
            self._expect(sock, b"K" + _proof(key, b"host", mine), "the copy host's proof", HEADER_TIMEOUT)
        except BaseException:
            sock.close()
            raise
        self._sock: socket.socket | None = sock

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
                {"kind": kind, "groups": len(segments), "src_nbytes": src_nbytes, "src_count": len(src_chunks),
                 "dst_nbytes": dst.nbytes, "dst_count": len(dst_chunks)}), "the lane's setup")
            send_handles(sock, src_chunks)
            send_handles(sock, dst_chunks)
        finally:
            close_fds([fd for *_, fd in dst_chunks])
        cols = np.stack([segments.src_off, segments.dst_off, segments.nbytes, segments.count, segments.src_stride,
                         segments.dst_stride]).astype(">u8").tobytes()
        for i in range(0, len(cols), _T_BYTES):
            send_message(sock, b"T" + cols[i:i + _T_BYTES], "the lane's segments")
        self._expect(sock, b"K", "the copy host's setup", self.timeout)
        self.ready_for, self._dst = ready_for, dst

    def copy(self, seq: int) -> None:
        """Have the host copy the pair (for step ``seq``); return once the bytes are in the follower's memory."""
        sock = self._live()
        send_message(sock, b"G" + U64.pack(seq), "the lane's step")
        self._expect(sock, b"K" + U64.pack(seq), "the copy host's copy", self.timeout)

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
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

