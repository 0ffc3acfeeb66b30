"""The copying ipc receiver: copies each update out of the sender's memory into the receiver's region.

The sender's handles are mapped once per session and kept (:class:`SourceCache`); each update is one
host copy (``stream_copy``, split over :data:`COPY_THREADS` threads) or one run of device copies on the
session's stream, in pieces, each reported as progress to the sender (so its stall timer measures a stall, not a
long copy) and, for a fan-out relay, to ``on_piece`` once its bytes are there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tensorxfer.errors import (
    PeerLost,
    ProtocolError,
    QuantizationError,
    TensorXferError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from tensorxfer.memory._hostcopy import stream_copy
from tensorxfer.staging import dtoh, htod
from tensorxfer.transport.base import Progress, ReceiverTransport
from tensorxfer.transport.ipc import messages
from tensorxfer.transport.ipc.lane import IN_DOUBT, CopyLane
from tensorxfer.transport.ipc.messages import (
    FILES,
    U64,
    Watermark,
    env_int,
)
from tensorxfer.transport.ipc.pairs import DeviceSegments, copy_segments_in_host_memory, poisoned
from tensorxfer.transport.ipc.receiving import Handles, Incoming, IpcReceiving
from tensorxfer.transport.ipc.sourcefiles import fill_from_files
from tensorxfer.transport.segments import Segments

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.base import TransferContext

log = logging.getLogger(__name__)

#: Threads copying host memory (each copy releases the GIL); measured in benchmarks/bench_ipc.py.
COPY_THREADS = env_int("TENSORXFER_IPC_THREADS", min(4, os.cpu_count() or 1))


class SourceCache:
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


class LandedMarks:
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


class IpcReceiver(IpcReceiving, ReceiverTransport):
    """Receives regions from a process on the same host: maps its handles once, copies each update."""

    name: ClassVar[str] = "ipc"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._region: TensorRegion | None = None
        self._segments: Segments | None = None          # a weight sync's runs (else the whole region)
        self._cache = SourceCache()                     # the sender's memory, mapped
        self._copiers: dict[int, Any] = {}              # device -> Copier, for the session
        self._strided: DeviceSegments | None = None     # a sync's device copy (its tiles uploaded once)
        #: (socket path, key) of the process that copies for this target's device (a weight sync's copy host),
        #: set by the sync; None: copy here
        self.copy_host: tuple[str, bytes | None] | None = None
        self._copy_lane: CopyLane | None = None

    def prepare(self, region: TensorRegion, seq: int, fresh: bool, segments: Segments | None = None) -> dict[str, Any]:
        """Get ready to copy update ``seq`` into ``region``.  Descriptors: ``setup``, ``share`` (false),
        ``streams``, ``watermark``; on setup ``path``, ``nonce``, ``identity`` of a Unix socket in a fresh
        0700 directory.  With ``segments`` (a weight sync's runs) only those are copied, from wherever they
        are in the sender's region to wherever they go in ``region``."""
        if segments is not None:
            segments.check_within(1 << 63, region.nbytes)
        self._region, self._segments = region, segments
        return self._begin(seq, fresh, share=False)

    def wait(self, progress: Progress | None = None) -> int:
        """As :meth:`IpcReceiving.wait`; with segments, the bytes they moved (the sender's ``D`` names its
        payload)."""
        moved = super().wait(progress)
        return moved if self._segments is None else self._segments.total_bytes

    def _expected_nbytes(self) -> int:
        if self._segments is not None:
            return -1
        return self._region.nbytes if self._region is not None else -1

    def _empty(self) -> int:
        return 0

    def _land(self, conn: socket.socket, incoming: Incoming, handles: Handles, fds: list[int],
              watermark: Watermark, progress: Progress | None) -> int:
        assert self._region is not None
        # a copy host that took a step into this memory and did not finish it may still write there: no copy
        # into it may start meanwhile (half the stall timeout: a copy after it still fits in the sender's wait)
        IN_DOUBT.wait_clear(self._region, self.ctx.stall_timeout / 2)
        if incoming.kind == FILES:
            if self._segments is not None:
                return self._segments_from_files(incoming, watermark, self._segments, progress)
            return self._from_files(conn, incoming, watermark, progress)
        if self._segments is not None:
            self._copy_segments(conn, incoming, handles, fds, self._segments, progress)
            return incoming.nbytes      # "D" names the sender's payload, as for a whole region
        if incoming.kind == "host":
            return self._from_host(conn, incoming, handles, fds, watermark, progress)
        return self._from_cuda(conn, incoming, handles, fds, watermark, progress)

    def _source(self, key: tuple, incoming: Incoming, handles: Handles, fds: list[int], on: int | None) -> Any:
        """The sender's memory: the session's mapping when the sender said ``cached``, else ``handles`` mapped."""
        if handles:
            return self._import(incoming, handles, fds, on)
        src = self._cache.get(key)
        if src is None:
            raise ProtocolError("ipc: the sender says this region's handles were passed before, but this "
                                "session holds no mapping of them")
        return src

    def _release_source(self, key: tuple, src: Any, ok: bool) -> None:
        if ok:
            self._cache.put(key, src)
        else:
            if self._cache.region is src:
                self._cache.key = self._cache.region = None
            src.close()

    # -- a weight sync's segments
    def _copy_segments(self, conn: socket.socket, incoming: Incoming, handles: Handles, fds: list[int],
                       segments: Segments, progress: Progress | None) -> None:
        """Copy only ``segments`` out of the sender's memory: host, every row of every group copied without
        the GIL (``copy_groups``; the groups spread over the copy threads); GPU, one launch of the
        strided-copy kernel over the segments' tiles (uploaded on the first step), or one 2-D copy per
        group where the kernel was not built -- or, where the sync named a copy host for this target's
        device (:attr:`copy_host`), by that process (:mod:`.delegate`)."""
        assert self._region is not None
        dst = self._region
        if (incoming.kind == "cuda") != dst.is_cuda:
            raise TransportUnavailable("ipc: a weight sync copies between regions of one kind (both on the host "
                                       "or both on GPUs); this receiver's and its sender's differ")
        segments.check_within(incoming.nbytes, dst.nbytes)
        on = self._cuda_device(incoming, dst.device) if dst.is_cuda else None
        key = incoming.key(on)
        lane = self._lane(key, incoming, handles, segments) if self.copy_host is not None else None
        src = self._source(key, incoming, handles, fds, on)
        ok = False
        try:
            if lane is not None and self._delegated(lane):
                pass
            elif dst.is_cuda:
                assert on is not None
                copier = self._copier(on)
                work = self._strided_copy(segments, on)
                work.launch(copier, dst.region.ptr, src.ptr)
                copier.synchronize()
                work.check_quantized()
            else:
                segments.without_tiles()
                copy_segments_in_host_memory(src, dst.region, segments, COPY_THREADS)
            # a step of another pair into this region went in doubt meanwhile: the target's step must not succeed
            IN_DOUBT.wait_clear(dst, 0)
            if progress is not None:
                progress(segments.total_bytes)
            # no "P" before the "D" that follows at once: a sender woken by the one would sleep again before
            # the other (a wake-up each, ~0.1 ms on the H200 machine); a copy in one go reports no progress
            ok = True
        finally:
            self._release_source(key, src, ok)

    def _lane(self, key: tuple, incoming: Incoming, handles: Handles, segments: Segments) -> CopyLane | None:
        """The lane to the copy host, set up for this pair's source memory and segments; None where it cannot
        be (the host is unreachable, or the source's handles went by while no lane held them: this pair then
        copies here until the session passes them again)."""
        assert self._region is not None and self.copy_host is not None
        lane = self._copy_lane
        if lane is not None and lane.ready_for == (key, segments):
            return lane
        held = lane is not None and lane.ready_for is not None and lane.ready_for[0] == key
        if not handles and not held:
            return None
        try:
            if lane is None:
                lane = self._copy_lane = CopyLane(self.copy_host[0], self.copy_host[1], self.ctx.stall_timeout)
            lane.setup(handles or None, incoming.nbytes, self._region, segments, incoming.kind, (key, segments))
            return lane
        except Exception as e:      # the host gone or refusing, or a region without handles: copy here
            self._give_up_lane(e)
            return None

    def _delegated(self, lane: CopyLane) -> bool:
        """Whether the copy host copied this step's pair (False: the host never will -- it did not take the step
        in time and the lane revoked it, its copy failed, or it is gone; copy it here, whole).

        Raises
        ------
        TransferTimeout
            The host took the step and stalled: it may still write, so the pair is not copied here, the step
            fails and the region is in doubt until the host finishes or ends (:data:`.lane.IN_DOUBT`)."""
        try:
            copied = lane.copy(self._seq)
        except QuantizationError as e:      # the host copied it but for blocks with a NaN: name the tensor
            assert self._segments is not None
            raise poisoned(self._segments, -1 if e.tile is None else e.tile) from None
        except TransferTimeout as e:
            self._give_up_lane(e)
            raise TransferTimeout(f"ipc: {e}") from None
        except (TensorXferError, OSError) as e:
            self._give_up_lane(e)
            return False
        if not copied:
            self._give_up_lane(TransferError(f"it did not take step {self._seq} in time (the lane revoked it), or "
                                             f"its copy failed"))
        elif lane.closed:
            self._give_up_lane(TransferError(f"it answered step {self._seq} late"))
        return copied

    def _give_up_lane(self, why: BaseException) -> None:
        # the text, not the exception: a handler that keeps records would keep its frames (and the sessions
        # they hold) alive
        log.warning("ipc: the copy host at %s failed (%s); this pair copies in its own process from now on",
                    self.copy_host[0] if self.copy_host else "?", f"{type(why).__name__}: {why}")
        self.copy_host = None
        lane, self._copy_lane = self._copy_lane, None
        if lane is not None:
            lane.close()

    # -- host handles
    def _from_host(self, conn: socket.socket, incoming: Incoming, handles: Handles, fds: list[int],
                   watermark: Watermark, progress: Progress | None) -> int:
        key, nbytes = incoming.key(), incoming.nbytes
        src = self._source(key, incoming, handles, fds, None)
        ok = False
        try:
            assert self._region is not None
            dst = self._region
            # Both copies below return once the bytes are there: each piece may be reported as landed.
            pieces = self._pieces(watermark, messages.RELAY_PIECE_BYTES, messages.PIECE_BYTES)
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
                                      lambda off, n: stream_copy(d[off:off + n], s[off:off + n]), COPY_THREADS,
                                      piece_bytes=pieces, watermark=watermark, landed=self.on_piece)
                finally:
                    del s, d
            ok = True
        finally:
            self._release_source(key, src, ok)
        return nbytes

    # -- the sender's files
    def _from_files(self, conn: socket.socket, incoming: Incoming, watermark: Watermark,
                    progress: Progress | None) -> int:
        """The sender's region is its files: hand them to :attr:`on_files` when the caller takes them (it
        copies them where they go, the region stays unwritten), else read them into the region with
        ``pread`` (:mod:`.sourcefiles`), in pieces reported like a memory copy's."""
        assert self._region is not None
        dst, files, nbytes = self._region, incoming.files, incoming.nbytes
        watermark.wait(nbytes)                  # a region of files is complete when it is offered
        if self.on_files is not None and not dst.is_cuda:
            done = 0

            def report(n: int) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(n)
                try:
                    conn.send(b"P" + U64.pack(done))     # the sender's stall timer measures a stall, not a copy
                except OSError as e:
                    raise PeerLost(f"ipc: connection to the sender lost during the copy: {e}") from None
            self.on_files(files, report)
            if progress is not None and nbytes > done:
                progress(nbytes - done)     # the headers and the gaps between files: the region's, no file's
            return nbytes
        if dst.is_cuda:
            def piece(off: int, n: int) -> None:
                buf = bytearray(n)
                fill_from_files(memoryview(buf), [(o - off, m, fd) for o, m, fd in files], 0, n)
                htod(dst._get_copier(), dst.region.ptr + off, buf)
            self._copy_pieces(nbytes, progress, conn, piece, threads=1, sync=dst._get_copier().synchronize)
            return nbytes
        with memoryview(dst.region) as view:
            self._copy_pieces(nbytes, progress, conn, lambda off, n: fill_from_files(view, files, off, n),
                              COPY_THREADS, landed=self.on_piece)
        return nbytes

    def _segments_from_files(self, incoming: Incoming, watermark: Watermark, segments: Segments,
                             progress: Progress | None) -> int:
        """A partial update (a transfer resumed across restarts: only the runs the receiver lacks) from a
        sender whose region is its files: each run read from the files with ``pread`` where a memory copy's
        would land in the region, and reported landed (the caller writes it out as it does tcp's pieces)."""
        assert self._region is not None
        dst, files = self._region, incoming.files
        if dst.is_cuda:
            raise TransportUnavailable("ipc: a partial update from a sender's files lands in host memory only")
        segments.check_within(incoming.nbytes, dst.nbytes)
        watermark.wait(incoming.nbytes)          # a region of files is complete when it is offered
        with memoryview(dst.region) as view:
            for src_off, dst_off, n in segments.runs():
                # the files placed relative to this run, so that view[dst_off:] receives region bytes src_off..
                fill_from_files(view[dst_off:dst_off + n], [(o - src_off, m, fd) for o, m, fd in files], 0, n)
                if self.on_piece is not None:
                    self.on_piece(dst_off, n)
                if progress is not None:
                    progress(n)
        return incoming.nbytes

    @staticmethod
    def _host_to_cuda(dst: TensorRegion, view: memoryview, off: int, n: int) -> None:
        htod(dst._get_copier(), dst.region.ptr + off, view[off:off + n])

    # -- cuda handles
    def _from_cuda(self, conn: socket.socket, incoming: Incoming, handles: Handles, fds: list[int],
                   watermark: Watermark, progress: Progress | None) -> int:
        on = self._cuda_device(incoming, self._region.device if self._region is not None else "cpu")
        key, nbytes = incoming.key(on), incoming.nbytes
        src = self._source(key, incoming, handles, fds, on)
        ok = False
        try:
            assert self._region is not None
            dst = self._region
            copier = self._copier(on)
            landed = self.on_piece
            if dst.is_cuda:
                # Device copies are only queued here: a relay reports each piece once the stream finished it.
                marks = LandedMarks(copier, landed) if landed is not None else None

                def piece(off: int, n: int) -> None:
                    copier.dtod(dst.region.ptr + off, src.ptr + off, n)
                    if marks is not None:
                        marks.queued(off, n)
                sync = marks.finish if marks is not None else copier.synchronize
                self._copy_pieces(nbytes, progress, conn, piece, threads=1, sync=sync,
                                  piece_bytes=self._pieces(watermark, messages.RELAY_CUDA_PIECE_BYTES,
                                                           messages.CUDA_PIECE_BYTES),
                                  watermark=watermark)
            else:
                d = np.frombuffer(dst.region, dtype=np.uint8, count=nbytes)

                def piece(off: int, n: int) -> None:
                    dtoh(copier, d[off:off + n], src.ptr + off)      # returns once the bytes are in d
                self._copy_pieces(nbytes, progress, conn, piece, threads=1, sync=copier.synchronize,
                                  piece_bytes=self._pieces(watermark, messages.RELAY_PIECE_BYTES, messages.PIECE_BYTES),
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
            from tensorxfer.memory._copy import Copier

            copier = self._copiers[device] = Copier(device)
        return copier

    def _strided_copy(self, segments: Segments, device: int) -> DeviceSegments:
        """The segments' device copy on ``device`` (built and uploaded once per session: the plan is static)."""
        if self._strided is not None and self._strided.segments is segments and self._strided.device == device:
            return self._strided
        old, self._strided = self._strided, None
        if old is not None:
            old.close()
        self._strided = DeviceSegments(segments, device)
        return self._strided

    # -- helpers
    def _pieces(self, watermark: Watermark, relayed: int, plain: int) -> int:
        """The copy's piece size: ``relayed`` when this receiver forwards pieces or its sender still fills its
        region (fan-out), else the plain copy's (larger: fewer messages, nothing waits for a piece)."""
        return relayed if self.on_piece is not None or not watermark.complete else plain

    def _copy_pieces(self, nbytes: int, progress: Progress | None, conn: socket.socket, copy: Any,
                     threads: int, sync: Any = None, piece_bytes: int = messages.PIECE_BYTES,
                     watermark: Watermark | None = None, landed: Callable[[int, int], None] | None = None) -> None:
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
        if self.meanwhile is not None:
            self.meanwhile()        # device copies may still run: the receiver's own work overlaps them
        if sync is not None:
            sync()

    def _teardown(self) -> None:
        super()._teardown()
        self._cache.close()         # a new connection is a new sender process: its old mapping is no use

    def close(self) -> None:
        """Close the socket, remove the private directory, release the session's mappings; idempotent."""
        super().close()
        self._region = None
        kernel, self._strided = self._strided, None
        if kernel is not None:
            kernel.close()
        lane, self._copy_lane = self._copy_lane, None
        if lane is not None:
            lane.close()
        copiers, self._copiers = self._copiers, {}
        for copier in copiers.values():
            copier.close()

