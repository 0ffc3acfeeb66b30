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
  other's nonce before the follower passes anything (a host whose proof is wrong is refused: :class:`AuthError`);
- ``L`` + one fd, once: the lane's **fence page** (below), a sealed memfd the follower made;
- setup (``S``, then ``F`` handle batches with their fds, then ``T`` batches of the segment columns): the
  source's memory handles as the follower got them, the follower's own region's handles, the pair's
  segments; the host maps both regions and builds the pair's copy, and answers ``K`` (or ``E`` + why);
- a step is ``G`` + seq, answered ``K`` + seq once the bytes are in the follower's memory (the host's
  stream synchronized), or ``E`` + why; on a GPU the host serves a lane's steps in one loop without the GIL
  (``StridedCopy.serve_lane``), so a step does not wait behind the host's own feeds for it.

The fence: who may write into the follower's memory, and when
--------------------------------------------------------------
A host's late write is silent corruption: a follower that stopped waiting for a step and moved on (copied the
pair itself, reported the version, started the next) must never find the host's bytes of that step landing in
its live weights afterwards -- and a host that was stopped (SIGSTOP, a swapped-out or preempted process) still
reads the queued ``G`` when it resumes.  Closing the lane does not stop that, and no message can: the host may be
mid-copy when the follower gives up.  So each lane has one 64-bit word, ``(seq << 2) | state``, in a page the
follower owns and both map ``MAP_SHARED`` (:class:`~tensorxfer.memory._fence.Fence`), changed only atomically:

- the follower stores (seq, GRANTED) before it sends ``G`` + seq;
- the host compare-and-swaps (seq, GRANTED) -> (seq, RUNNING) before it touches a byte; if that fails it copies
  nothing and answers ``E`` ("revoked"); once no byte of the step can still be written (the stream synchronized,
  the copy threads joined) it stores (seq, DONE) and answers ``K`` -- or, when its copy failed, (seq, REVOKED);
- the follower waits half the stall timeout for the answer (so that a copy of its own still fits in its
  sender's wait), then compare-and-swaps (seq, GRANTED) -> (seq, REVOKED).  Won: the host will never copy that
  step; the follower closes the lane and copies the pair itself, and the step succeeds.  Lost to DONE: the bytes
  are whole.  Lost to REVOKED: the host's copy failed and stopped; copy locally.  Lost to RUNNING: the host took
  the step and is copying, and only it can finish -- the follower waits for it (its answer, or its process's
  end, watched through a pidfd) up to the lane's whole stall timeout, then fails the step with
  :class:`TransferTimeout` naming the host's pid and the step.  (Improving on giving up at the half: a merely
  slow copy that the host took still succeeds, and a local copy is impossible either way.)

A step lost to RUNNING leaves the follower's region **in doubt** (:data:`IN_DOUBT`) until the fence reads
otherwise or the host's process is gone (a pidfd: a pid reused later is not it; an exited process writes no
more).  While it is, no copy into that memory may start and no step into it may succeed -- local or through any
lane, any pair, any later session of this process, since a new plan may route those bytes to another source's
pair: the copying receiver waits for it (half the stall timeout) at the start of every update and checks it
again at the end of every pair.  The registry keeps the fence page mapped after the lane and its session closed,
and releases it once the doubt clears.  The fast path costs the host one compare-and-swap and one store per step
and the follower one store and one load: no round trip.  The fence guards against a slow or stopped host, not a
hostile one (a host is trusted with the follower's memory, as any group member proving the token is).

Resources: the host maps a lane's regions lazily (no ``MAP_POPULATE``: a lane's sparse 3 GiB memfd took a host to
3.1 GiB RSS and froze its other lanes 3.5 s), refuses regions over :attr:`CopyHost.limit_bytes`, and no lane's
setup or copy holds the GIL for long (host copies run without it; device steps run in ``serve_lane``).  A host's
socket directory records its process (``owner``: pid, start time, boot); the next election on the machine
removes the directories of hosts whose process is gone (:func:`remove_dead_host_dirs`: a SIGKILLed host
cannot remove its own).

This module is the host's side (and the design); the follower's side -- :class:`CopyLane`, the fence's
resolution, :data:`IN_DOUBT` -- is :mod:`.lane` (both names are importable from here).

The follower still maps the source itself: a lane whose host refused or went away (``E``, or the connection
closed: the host closed, or its process died and its CUDA context with it) makes the follower copy the pair
locally, that step included, once the fence shows the host cannot write it -- redoing the whole pair's copy is
safe, both copies write the same bytes (the source holds its region until the pair is acked).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from typing import Any

import numpy as np

from tensorxfer.connections import Gate, listen
from tensorxfer.errors import (
    AuthError,
    HandleError,
    PeerLost,
    ProtocolError,
    QuantizationError,
    TensorXferError,
    TransferTimeout,
)
from tensorxfer.memory._fence import Fence
from tensorxfer.protocol import field, nonce
from tensorxfer.quant.tiles import WIDTH, QuantTiles
from tensorxfer.transport.ipc.identity import BOOT_ID_PATH, check_peer
from tensorxfer.transport.ipc.lane import COLUMNS, IN_DOUBT, CopyLane, HostProcess, InDoubt, proof
from tensorxfer.transport.ipc.messages import (
    FD_BATCH,
    HEADER_TIMEOUT,
    MAX_CHUNKS,
    MAX_MESSAGE,
    U64,
    close_fds,
    receive_handles,
    recv_message,
    unpack,
)
from tensorxfer.transport.ipc.pairs import DeviceSegments, copy_segments_in_host_memory
from tensorxfer.transport.ipc.receiving import map_handles
from tensorxfer.transport.segments import Segments

log = logging.getLogger(__name__)

#: the follower's side lives in :mod:`.lane`; named here too, where the design is
__all__ = ["HOST_DIR_PREFIX", "IN_DOUBT", "CopyHost", "CopyLane", "HostProcess", "InDoubt", "check_lane_segments",
           "remove_dead_host_dirs"]

MAX_GROUPS = 1 << 20                                 # 48 MiB of columns: past any plan's pair
HOST_DIR_PREFIX = "tensorxfer-copyhost-"             # a host's socket directory, in tempfile.gettempdir()
_OWNER = "owner"                                     # in it: the host process (pid, start time, boot)


# -- a host's directory, and what a dead host left
def _boot_id() -> str:
    with open(BOOT_ID_PATH) as f:
        return f.read().strip()


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None: no such process.
    Raises OSError / ValueError where it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(raw[raw.rindex(b")") + 2:].split()[19])    # past the command name, which may hold spaces


def _write_owner(directory: str) -> None:
    """Record this process in a host's fresh directory (written whole, then renamed: never read half-written)."""
    record = json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid()), "boot": _boot_id()})
    tmp = os.path.join(directory, _OWNER + ".tmp")
    with open(tmp, "x") as f:
        f.write(record)
    os.replace(tmp, os.path.join(directory, _OWNER))


def _owner_gone(directory: str) -> int | None:
    """The pid a host's directory records, if that process is provably gone (another boot, no such process, or
    a process started at another time: the pid was reused); None otherwise (alive, or not provable)."""
    try:
        fd = os.open(os.path.join(directory, _OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            record = json.loads(f.read(4096))
        pid, start, boot = int(record["pid"]), record["start"], str(record["boot"])
    except (OSError, ValueError, KeyError, TypeError):
        return None         # no record (yet), or not one of ours: not provably a dead host's
    if pid <= 0:
        return None
    try:
        if boot != _boot_id():
            return pid
        now = _start_time(pid)
    except (OSError, ValueError, IndexError):
        return None         # cannot tell: leave it
    return pid if now is None or now != start else None


def remove_dead_host_dirs(root: str | None = None) -> list[str]:
    """Remove the socket directories that copy hosts killed outright left behind; return them.

    Only a directory this process can prove was a dead host's: in ``root`` (default ``tempfile.gettempdir()``,
    where :class:`CopyHost` makes them), named with :data:`HOST_DIR_PREFIX`, a real directory (not a link) owned
    by this uid, whose ``owner`` record names a process that is gone (another boot, no such pid, or a pid reused
    by a process started later).  A directory without a readable record (a host between ``mkdtemp`` and writing
    it) is left alone.
    """
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError as e:
        log.debug("copy host: cannot list %s for dead hosts' directories: %s", root, e)
        return removed
    for entry in entries:
        if not entry.name.startswith(HOST_DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        pid = _owner_gone(entry.path)
        if pid is None:
            continue
        try:
            shutil.rmtree(entry.path)       # symlink-safe (fd-based) on Linux
        except FileNotFoundError:
            continue                        # another target's election removed it first
        except OSError as e:
            log.warning("copy host: cannot remove %s, left by a copy host (pid %d) that is gone: %s", entry.path, pid,
                        e)
            continue
        log.info("copy host: removed %s, left by a copy host (pid %d) that is gone", entry.path, pid)
        removed.append(entry.path)
    return removed


class CopyHost:
    """The elected target's side: a listener, and a thread per lane copying into a follower's memory.

    ``device`` is this process's index of the GPU (None: host memory); ``key`` the group's token key.

    Attributes
    ----------
    limit_bytes : int or None
        The largest region a lane may make this host map (None: no cap).  Each of a lane's two regions -- the
        source's and the follower's -- is refused (its setup answered ``E``, nothing mapped) when the payload
        size the lane names for it (``src_nbytes`` / ``dst_nbytes``: a ``TensorRegion.nbytes``) is larger than
        ``limit_bytes``.  The handles mapped for a region cover at most that payload rounded up to
        :data:`~tensorxfer.transport.ipc.messages.CHUNK_TAIL` (2 MiB: a region's allocation rounding; every chunk
        past the payload is refused on receipt), so this host maps at most ``limit_bytes`` rounded up to 2 MiB
        per region.  Rule: set it to the largest payload (``nbytes``) of the group's regions -- a payload, never
        an allocation or chunk total, which the comparison already allows for.  Read at each setup: changing it
        affects the next setups, not regions already mapped.
    """

    def __init__(self, key: bytes | None, device: int | None, stall_timeout: float, threads: int = 2,
                 limit_bytes: int | None = None) -> None:
        self.device, self.stall_timeout, self.threads = device, float(stall_timeout), threads
        self.limit_bytes = limit_bytes
        self._key = key
        self._closed = False
        self._lock = threading.Lock()
        self._lanes: dict[socket.socket, threading.Thread] = {}
        self._dir = tempfile.mkdtemp(prefix=HOST_DIR_PREFIX)     # mode 0700: only our uid gets in
        self.path = os.path.join(self._dir, "s")
        try:
            _write_owner(self._dir)
            self._gate = Gate(listen(self.path, socket.AF_UNIX, socket.SOCK_SEQPACKET), self._authenticate,
                              HEADER_TIMEOUT, "copy host")
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.lanes_served = 0       # lanes that connected, in all
        self.copies = 0             # pair copies made for followers, in all (a lane's run counts when it ends)
        self.revoked = 0            # steps a follower gave up before this host took them (answered E, not copied)
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
                hmac.compare_digest(theirs, proof(self._key, b"lane", challenge))
            conn.send(b"K" + proof(self._key, b"host", lane_nonce) if ok else
                      b"E" + b"the lane failed authentication (another group's token?)")
        except (AuthError, TensorXferError, OSError) as e:
            log.warning("copy host: refused a lane: %s", f"{type(e).__name__}: {e}")
            return None
        return pid if ok else None

    def _accept(self) -> None:
        # This thread owns the gate: it alone admits and closes it.  A gate closed by close() in another thread
        # raced its admit (EBADF on the listener, a prover joined before it started) and killed this thread.
        gate = self._gate
        try:
            while not self._closed:
                try:
                    [(conn, _)] = gate.admit(1, abort=lambda: "closed" if self._closed else None)
                except TensorXferError:
                    return      # closed
                except OSError as e:    # the listener failed (no fds left?): lanes wait, the host stays up
                    log.warning("copy host: accepting a lane failed (%s: %s); retrying", type(e).__name__, e)
                    time.sleep(0.1)
                    continue
                lane = threading.Thread(target=self._serve, args=(conn,), name="tensorxfer-copy-lane", daemon=True)
                with self._lock:
                    if self._closed:
                        conn.close()
                        return
                    self._lanes[conn] = lane
                    self.lanes_served += 1
                    lane.start()        # under the lock: close() joins only started lanes
        finally:
            gate.close()

    def _serve(self, conn: socket.socket) -> None:
        """One lane: its fence, then setups and steps until the follower closes (or this host does).  Any failure
        (a bad setup, a copy, the socket) is told to the follower (``E``) and ends the lane: the rest of a failed
        setup's messages would read as nonsense.  A step the follower gave up is refused and the lane serves on."""
        pair: _HostedPair | None = None
        fence: Fence | None = None
        try:
            while True:
                try:
                    if fence is None:
                        fence = _receive_fence(conn)
                    conn.settimeout(None)       # blocking (a setup's reads leave a timeout on the socket)
                    # a device pair with the kernel serves its steps without the GIL, up to the next other message
                    served = pair.serve(conn, fence) if pair is not None else None
                    if served is not None:
                        with self._lock:
                            self.copies += served[0]
                    msg = served[1] if served is not None else conn.recv(MAX_MESSAGE)
                    if not msg:
                        return
                    if msg[:1] == b"S":
                        old, pair = pair, None
                        try:
                            pair = _HostedPair.receive(conn, msg[1:], self.device, self.stall_timeout, old,
                                                       self.limit_bytes)
                        finally:
                            if old is not None:
                                old.close()     # what the new pair did not take over
                        conn.send(b"K")
                    elif msg[:1] == b"G" and len(msg) == 9 and pair is not None:
                        seq = U64.unpack(msg[1:])[0]
                        try:
                            took = pair.step(seq, fence, self.threads)
                        except QuantizationError as e:      # copied but for blocks with a NaN: the follower names it
                            with self._lock:
                                self.copies += 1
                            conn.send(b"Q" + msg[1:] + U64.pack(e.tile or 0))
                            continue
                        if took:
                            with self._lock:
                                self.copies += 1
                            try:
                                conn.send(b"K" + msg[1:])
                            except OSError:
                                return      # the follower gave the lane up while this step ran
                            continue
                        with self._lock:
                            self.revoked += 1
                        log.info("copy host: step %d of a lane was given up by its follower before this host "
                                 "took it: not copied", seq)
                        try:
                            conn.send(b"E" + f"revoked: the follower gave step {seq} up".encode())
                        except OSError:
                            return      # the follower closed the lane when it gave the step up
                    else:
                        raise ProtocolError(f"copy host: unexpected lane message {msg[:8]!r}"
                                            f"{' (a step before the setup)' if pair is None else ''}")
                except Exception as e:
                    log.warning("copy host: a lane failed: %s", f"{type(e).__name__}: {e}")
                    try:
                        conn.send(b"E" + str(e).encode()[:4000])
                        _drain(conn)
                    except OSError:
                        pass    # the follower is gone
                    return
        finally:
            if pair is not None:
                pair.close()
            if fence is not None:
                fence.close()       # after the pair: nothing of this lane runs any more
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
        self._acceptor.join(self.stall_timeout)     # it closes the gate within one admit tick
        for conn in lanes:
            try:
                conn.shutdown(socket.SHUT_RD)   # the lane's next read ends it; a copy in flight still answers
            except OSError:
                pass        # already gone
        for lane in lanes.values():
            lane.join(self.stall_timeout)
        shutil.rmtree(self._dir, ignore_errors=True)


def _receive_tiles(conn: socket.socket, count: int, timeout: float) -> QuantTiles | None:
    """A setup's quantizing tiles (``Q`` messages: ``count`` rows of the table), after its segments."""
    if not count:
        return None
    raw = _receive_batches(conn, b"Q", count * WIDTH * 8, "tiles", timeout)
    table = np.frombuffer(raw, dtype=">i8").astype(np.int64).reshape(count, WIDTH)
    return QuantTiles(table, np.zeros(count, np.int32), ("(a follower's tensor)",))


def _receive_batches(conn: socket.socket, tag: bytes, nbytes: int, what: str, timeout: float) -> bytes:
    """``nbytes`` of a setup's table, sent as messages ``tag`` + bytes (never more than announced)."""
    raw = bytearray()
    while len(raw) < nbytes:
        msg = recv_message(conn, f"the lane's {what}", timeout)
        if msg[:1] != tag or len(raw) + len(msg) - 1 > nbytes:
            raise ProtocolError(f"copy host: bad {what} message {msg[:8]!r}")
        raw += msg[1:]
    return bytes(raw)


def _drain(conn: socket.socket) -> None:
    """Read and drop what the follower still sends (the rest of a refused setup) until it hangs up, at most
    ``HEADER_TIMEOUT``: a Unix socket closed with unread messages resets the connection, and the follower would
    read the reset instead of the ``E`` that says why."""
    deadline = time.monotonic() + HEADER_TIMEOUT
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, FD_BATCH, socket.MSG_CMSG_CLOEXEC)
        except OSError:
            return      # timed out, or reset
        close_fds(list(fds))
        if not data:
            return


def _receive_fence(conn: socket.socket) -> Fence:
    """The lane's first message: ``L`` and the follower's fence page (one fd), mapped here.

    Raises
    ------
    ProtocolError
        Another message, or an fd that is not a sealed memfd page (the follower could truncate it under the
        mapping: this host would fault writing the word).
    TransferTimeout, PeerLost
        The follower stalled or left.
    """
    conn.settimeout(HEADER_TIMEOUT)
    try:
        data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise TransferTimeout(f"copy host: the lane passed no fence page within {HEADER_TIMEOUT} s") from None
    except OSError as e:
        raise PeerLost(f"copy host: the lane left before passing its fence page: {e}") from None
    try:
        if not data:
            raise PeerLost("copy host: the lane left before passing its fence page")
        if data != b"L" or len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise ProtocolError(f"copy host: a lane's first message must be its fence page (L and one fd), not "
                                f"{data[:8]!r} with {len(fds)} fds")
        try:
            return Fence.open(fds[0])
        except HandleError as e:
            raise ProtocolError(f"copy host: the lane's fence page is unusable: {e}") from None
    finally:
        close_fds(list(fds))


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
                old: _HostedPair | None, limit: int | None = None) -> _HostedPair:
        """The setup after its ``S`` header: both regions' handles, the segments; mapped (lazily) and checked.  A
        region passed with no handles is ``old``'s mapping of it, taken over (a new plan for the same memory).
        A region whose payload is over ``limit`` bytes is refused before anything is received or mapped."""
        head = unpack(header, "the lane's setup")
        if not isinstance(head, dict):
            raise ProtocolError("copy host: the lane's setup is not a map")
        kind, groups = field(head, "kind", str), field(head, "groups", int)
        count = field(head, "tiles", int, optional=True) or 0
        src_nbytes, src_count, dst_nbytes, dst_count = (field(head, k, int) for k in (
            "src_nbytes", "src_count", "dst_nbytes", "dst_count"))
        if kind not in ("host", "cuda") or (kind == "cuda") != (device is not None) or not 0 <= groups <= MAX_GROUPS \
                or not 0 <= count <= (MAX_GROUPS if kind == "cuda" else 0) \
                or min(src_nbytes, dst_nbytes) <= 0 or not 0 <= min(src_count, dst_count) <= MAX_CHUNKS \
                or max(src_count, dst_count) > MAX_CHUNKS:
            raise ProtocolError(f"copy host: a lane's setup out of range ({kind!r} memory, {groups} groups, "
                                f"{src_count} chunks of {src_nbytes} bytes to {dst_count} of {dst_nbytes}) for a "
                                f"host of {'host' if device is None else 'cuda'} memory")
        for what, nbytes in (("source", src_nbytes), ("follower's", dst_nbytes)):
            if limit is not None and nbytes > limit:
                raise ProtocolError(f"copy host: a lane's {what} region of {nbytes} bytes is larger than this host's "
                                    f"limit of {limit} bytes (limit_bytes: the largest region of the group's "
                                    f"members); refused before mapping -- a member's region grew without the group "
                                    f"knowing, or the lane is not one of the group's")
        fds: list[int] = []
        try:
            src_chunks = receive_handles(conn, src_count, src_nbytes, fds, timeout)
            dst_chunks = receive_handles(conn, dst_count, dst_nbytes, fds, timeout)
            raw = _receive_batches(conn, b"T", groups * COLUMNS * 8, "segments", timeout)
            cols = np.frombuffer(raw, dtype=">u8").astype(np.uint64).reshape(COLUMNS, groups)
            c = [np.ascontiguousarray(col) for col in cols]
            segments = Segments(c[0], c[1], c[2], c[3], c[4], c[5], tiles=_receive_tiles(conn, count, timeout))
            check_lane_segments(segments, src_nbytes, dst_nbytes)
            if segments.tiles is not None:     # each reads inside the source's region and writes inside the follower's
                segments.tiles.check_within(src_nbytes, dst_nbytes)
            if (src_count == 0 or dst_count == 0) and (old is None or (src_count == 0 and old.src_nbytes != src_nbytes)
                                                       or (dst_count == 0 and old.dst_nbytes != dst_nbytes)):
                raise ProtocolError("copy host: a lane's setup without handles, but this lane maps no such region")
            src = dst = None
            try:
                # lazily (no populate): a page is faulted in when a copy first touches it, so a lane's sparse
                # region costs this host only what its segments read and write, and mapping it is quick
                src = (old.take("src") if old is not None and src_count == 0 else
                       map_handles(src_chunks, device, populate=False))
                dst = (old.take("dst") if old is not None and dst_count == 0 else
                       map_handles(dst_chunks, device, writable=True, populate=False))
                return cls((src, src_nbytes), (dst, dst_nbytes), segments, device)
            except BaseException:
                for region in (src, dst):
                    if region is not None:
                        region.close()
                raise
        finally:
            close_fds(fds)

    def serve(self, conn: socket.socket, fence: Fence) -> tuple[int, bytes] | None:
        """Serve the lane's steps without the GIL where this is a device pair with the kernel (the fence taken
        and finished in the same loop; a pair that quantizes on the way launches its tiles there too):
        ``(steps served, the next other message)``; else None."""
        if self._device_copy is None:
            return None
        return self._device_copy.serve_lane(self._copier, self.dst.ptr, self.src.ptr, conn.fileno(), fence.address)

    def step(self, seq: int, fence: Fence, threads: int) -> bool:
        """Copy step ``seq`` if the follower still grants it (taken on the fence before any byte is written, and
        marked done -- or revoked, when the copy failed -- once no byte of it can still be written); False: the
        follower gave it up, nothing was copied."""
        if not fence.take(seq):
            return False
        done = False
        try:
            self.copy(threads)      # returns (or raises) once every copy thread ended / the stream synchronized
            done = True
        finally:
            fence.finish(seq, done)
        if self._device_copy is not None:
            self._device_copy.check_quantized()     # QuantizationError (.tile): a block held a NaN, not written
        return True

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
    # ... and all groups together at most that much: each product fits (<= dst_nbytes < 2**63); summed in two
    # halves of 32 bits, a million groups cannot wrap, and no Python loop holds the GIL for each
    moved = w * h
    total = (int(np.sum(moved >> np.uint64(32), dtype=np.uint64)) << 32) + \
        int(np.sum(moved & np.uint64(0xFFFFFFFF), dtype=np.uint64))
    if total > dst_nbytes:
        raise ProtocolError(f"copy host: segments write {total} bytes into a region of {dst_nbytes}: a plan writes "
                            f"each byte once")
