"""Staging: any region's bytes as host-visible pieces, the same way for host and GPU memory.

Transports, checksums and readers/writers of files need region bytes in host
memory (a socket sends from it, a hash reads it).  Host regions are host
memory already: their pieces are zero-copy slices.  CUDA regions move
through two pinned buffers on one CUDA stream (a :class:`Stager`), double
buffered so the copy engine fills (or drains) one buffer while the caller
works on the other.  That loop exists once, here; callers iterate pieces
and never branch on the region kind::

    with read_pieces(region, 0, region.nbytes, 8 << 20) as pieces:
        for offset, view in pieces:          # view: valid until the next piece
            sock.sendall(view)

    with write_pieces(region, 0, region.nbytes, 8 << 20) as pieces:
        for offset, view in pieces:          # fill view completely, then ask for the next
            recv_exactly(sock, view)

The pinned-buffer machinery (``Stager``, and ``Copier`` on it) lives in
``memory/_copy.pyx``, beside ``CudaRegion`` in ``memory/_cuda.pyx``: both
reach the driver through ``memory/_driver.pyx`` (the per-process
primary-context cache, ``check_cu``), and the three build together or not at
all.  This module is the one place that *uses* it to stage bytes: regions
(:func:`read_pieces`, :func:`write_pieces`, :func:`write_from`,
:func:`read_into`) and raw device addresses (:func:`htod`, :func:`dtoh`) run
the same loop.

Lifetime: while pieces are being produced the region is pinned by a view
(a buffer export, or a device view), so a concurrent ``close()`` releases
the memory only after the last copy finished.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from tensorxfer import memory as _memory
from tensorxfer.errors import ExtentError, RegionClosed
from tensorxfer.memory import AllocationMap, HostRegion
from tensorxfer.memory._hostcopy import stream_copy

#: Piece size of :func:`write_from` / :func:`read_into` (and the pinned
#: buffers they allocate): large enough that the per-piece Python work is
#: noise next to a 54 GB/s host<->device copy, small enough to pin cheaply.
COPY_PIECE_BYTES = 64 << 20

Piece = tuple[int, memoryview]

_log = logging.getLogger(__name__)


def memory_of(region: Any) -> AllocationMap:
    """The HostRegion or CudaRegion behind ``region`` (a TensorRegion, or a region itself)."""
    if isinstance(region, AllocationMap):
        return region
    mem = getattr(region, "region", None)
    if isinstance(mem, AllocationMap):
        return mem
    raise TypeError(f"expected a TensorRegion, HostRegion or CudaRegion, got {type(region).__name__}")


def is_device(region: Any) -> bool:
    """True if ``region``'s memory is on a GPU (a CudaRegion), False for host memory."""
    mem = memory_of(region)
    return not isinstance(mem, HostRegion)


def open_stager(region: Any, buffer_bytes: int) -> Any:
    """Pinned buffers and a stream for staging ``region``, to reuse across calls; None for host regions.

    A transport session opens one per connection and passes it as
    ``stager=`` to every :func:`read_pieces` / :func:`write_pieces`, so the
    pinned allocation (milliseconds for tens of MiB) is paid once.  Host
    regions need none (their pieces are zero-copy), and ``stager=None`` is
    what they get, so the caller never branches on the region kind.

    Returns
    -------
    Stager or None
        Owned by the caller: ``close()`` it (or use ``with``) when done, after
        the last staged call returned.
    """
    mem = memory_of(region)
    if isinstance(mem, HostRegion):
        return None
    if _memory.CudaRegion is None or not isinstance(mem, _memory.CudaRegion):
        raise TypeError(f"cannot stage a {type(mem).__name__}")
    from tensorxfer.memory._copy import Stager

    return Stager(mem.device_index, int(buffer_bytes))


def read_pieces(region: Any, offset: int, length: int, piece_bytes: int, *,
                stager: Any = None) -> contextlib.AbstractContextManager[Iterator[Piece]]:
    """Read ``[offset, offset+length)`` of a region as host-visible pieces, in order.

    Parameters
    ----------
    region : TensorRegion, HostRegion or CudaRegion
    offset, length : int
        The byte range, relative to the region's start; it must lie inside
        the region.  ``length`` may be 0 (no pieces).
    piece_bytes : int
        The most bytes per piece (the last one may be shorter).  With a
        caller's ``stager`` it is also capped at ``stager.buffer_bytes``.
    stager : Stager, optional
        CUDA regions: reuse these pinned buffers and stream (from
        :func:`open_stager`; a transport session keeps one per connection)
        instead of allocating a pair for this call.  It must belong to the
        region's device and not be used by another thread meanwhile.  It is
        left idle (no copy in flight) when the context exits; the caller
        closes it.  Ignored for host regions.

    Returns
    -------
    context manager yielding an iterator of ``(region_offset, view)``
        Host region: ``view`` is a zero-copy, read-only-or-writable slice of
        the region.  CUDA region: ``view`` is a pinned buffer holding a copy
        of the piece; the device-to-host copy of the *next* piece is queued
        before this one is handed out.  Either way a view is valid only
        until the next piece is requested or the context exits: copy what
        must outlive that.  Leaving the context early (``break``, an
        exception) waits for queued copies and frees what this call
        allocated; it raises nothing of its own while an exception is in
        flight.

    Raises
    ------
    RegionClosed
        The region was closed.
    ExtentError
        The range does not lie inside the region.
    ValueError
        ``piece_bytes`` is not positive.
    CudaError
        A copy or the pinned allocation failed (CUDA regions).
    """
    return _Staged(region, offset, length, piece_bytes, False, stager)


def write_pieces(region: Any, offset: int, length: int, piece_bytes: int, *,
                 stager: Any = None) -> contextlib.AbstractContextManager[Iterator[Piece]]:
    """Write ``[offset, offset+length)`` of a region through host-visible pieces, in order.

    The consumer fills each ``view`` completely before asking for the next
    piece.  Host region: the views are zero-copy writable slices of the
    region.  CUDA region: each view is a pinned buffer; asking for the next
    piece queues the filled one host-to-device and hands out the other
    buffer once its previous copy has drained, so the consumer fills one
    while the DMA engine empties the other.

    A normal exit queues the last filled piece (if the consumer did not ask
    for another) and waits until every copy has landed: the bytes are in
    the region when the ``with`` block ends.  Pieces never requested are not
    written.  An exception exit does not queue the piece in hand (it may be
    half filled), still waits for the copies already queued and frees
    what this call allocated, and raises nothing of its own (a failure
    while cleaning up is attached to the original exception as a note).

    Parameters and errors are those of :func:`read_pieces`; in addition a
    read-only region (imported without ``writable=True``) raises
    ``ValueError`` up front.
    """
    return _Staged(region, offset, length, piece_bytes, True, stager)


def write_from(region: Any, offset: int, src: Any, *, piece_bytes: int = COPY_PIECE_BYTES,
               stager: Any = None) -> None:
    """Copy a host buffer into ``region`` at ``offset``; returns when the bytes have landed.

    ``src`` is any C-contiguous object with the buffer protocol (bytes,
    numpy array, memoryview).  The copies run without the GIL.  ``stager``
    as in :func:`read_pieces`.
    """
    data = _as_bytes(src)
    with write_pieces(region, offset, data.nbytes, piece_bytes, stager=stager) as pieces:
        _copy_through(pieces, data, offset, True)


def read_into(region: Any, offset: int, dst: Any, *, piece_bytes: int = COPY_PIECE_BYTES,
              stager: Any = None) -> None:
    """Copy ``len(dst)`` bytes of ``region`` from ``offset`` into a writable C-contiguous host buffer."""
    data = _as_bytes(dst)
    if data.flags.writeable is False:
        raise ValueError("read_into needs a writable destination buffer")
    with read_pieces(region, offset, data.nbytes, piece_bytes, stager=stager) as pieces:
        _copy_through(pieces, data, offset, False)


def htod(stager: Any, dptr: int, src: Any) -> None:
    """Copy a C-contiguous host buffer to device address ``dptr`` through ``stager``'s pinned buffers (a
    :class:`~tensorxfer.memory._copy.Stager` or ``Copier``); returns when the bytes have landed.  For raw
    device addresses; with a region, :func:`write_from` does the same."""
    _stage_ptr(stager, dptr, src, True)


def dtoh(stager: Any, dst: Any, dptr: int) -> None:
    """Copy ``len(dst)`` device bytes at ``dptr`` into a writable host buffer through ``stager``'s pinned
    buffers; returns when done (:func:`read_into` for regions)."""
    _stage_ptr(stager, dptr, dst, False)


def _stage_ptr(stager: Any, dptr: int, buf: Any, write: bool) -> None:
    """The staging loop on a raw device address and a stager's buffers."""
    data = _as_bytes(buf)
    if not write and data.flags.writeable is False:
        raise ValueError("dtoh needs a writable destination buffer")
    pieces = _DevicePieces(stager, int(dptr), 0, data.nbytes, int(stager.buffer_bytes), write)
    try:
        _copy_through(pieces, data, 0, write)
    except BaseException as e:
        _quietly(lambda: pieces.finish(False), e)
        raise
    pieces.finish(True)


def _copy_through(pieces: Iterator[Piece], data: np.ndarray, offset: int, write: bool) -> None:
    """Fill (``write``) or drain every piece from/into ``data``, whose byte 0 is region offset ``offset``.

    ``stream_copy``, not ``numpy.copyto``: glibc's ``memcpy`` may run a 64 MB piece as ``rep movsb`` (it did
    on the dev VM, at half the speed; see ``memory/_hostcopy.pyx``)."""
    for pos, view in pieces:
        host = data[pos - offset:pos - offset + len(view)]
        if write:
            stream_copy(np.frombuffer(view, np.uint8), host)
        else:
            stream_copy(host, np.frombuffer(view, np.uint8))


def _quietly(step: Callable[[], object], exc: BaseException) -> None:
    """Run a cleanup step while ``exc`` propagates: a failure becomes a note on ``exc``, never a second error."""
    try:
        step()
    except Exception as e:
        note = f"while cleaning up after it: {type(e).__name__}: {e}"
        add_note = getattr(exc, "add_note", None)       # Python 3.11+
        if add_note is not None:
            add_note(note)
        else:
            _log.warning("%s: %s", type(exc).__name__, note)


# ---------------------------------------------------------------- internals
def _as_bytes(buf: Any) -> np.ndarray:
    """A flat uint8 array over ``buf``'s bytes (zero-copy), for ``stream_copy`` (which releases the GIL)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("the host buffer must be C-contiguous (np.ascontiguousarray it first)")
        return buf.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(buf).cast("B"), np.uint8)
    except TypeError as e:
        raise ValueError(f"the host buffer must be C-contiguous with the buffer protocol ({e})") from None


def _drop(view: memoryview | None) -> None:
    """Release a piece view we handed out, so it stops pinning the region or the stager.

    A consumer that built another object on the view (``np.frombuffer``)
    keeps an export and the release is refused; that object stays valid for
    host memory (the export keeps the region mapped) and must not be used
    past the piece for pinned buffers, as documented.
    """
    if view is None:
        return
    with contextlib.suppress(BufferError):   # an export the consumer still holds, see above
        view.release()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _HostPieces:
    """Zero-copy slices of a host region's byte view."""

    def __init__(self, view: memoryview, offset: int, length: int, piece: int) -> None:
        self._view = view
        self._pos = offset
        self._end = offset + length
        self._piece = piece
        self._current: memoryview | None = None

    def __iter__(self) -> _HostPieces:
        return self

    def __next__(self) -> Piece:
        _drop(self._current)
        self._current = None
        if self._pos >= self._end:
            raise StopIteration
        pos, n = self._pos, min(self._piece, self._end - self._pos)
        self._current = self._view[pos:pos + n]
        self._pos += n
        return pos, self._current

    def finish(self, ok: bool) -> None:
        _drop(self._current)
        self._current = None


class _DevicePieces:
    """The double-buffered staging loop, both directions, on one Stager.

    Reading: piece k is copied into buffer ``k & 1``; the copy of piece k+1
    is queued into the other buffer before piece k is handed out (that
    buffer held piece k-1, which the consumer has finished with).

    Writing: the consumer fills buffer ``k & 1``; asking for piece k+1 queues
    that buffer to the device and waits until the other buffer's previous
    copy (piece k-1) has drained before handing it out.
    """

    def __init__(self, stager: Any, base: int, offset: int, length: int, piece: int, write: bool) -> None:
        self._st = stager
        self._base = base                      # device address of the region's byte 0
        self._offset = offset
        self._length = length
        self._piece = piece
        self._count = _ceil_div(length, piece)
        self._write = write
        self._k = 0                            # pieces handed out so far
        self._current: memoryview | None = None
        self._pending: tuple[int, int, int] | None = None    # write: (buffer, offset, n) filled, not yet queued

    def _where(self, k: int) -> tuple[int, int]:
        pos = self._offset + k * self._piece
        return pos, min(self._piece, self._offset + self._length - pos)

    def __iter__(self) -> _DevicePieces:
        return self

    def __next__(self) -> Piece:
        _drop(self._current)
        self._current = None
        if self._write:
            self._queue_pending()
        k = self._k
        if k >= self._count:
            raise StopIteration
        b = k & 1
        if self._write:
            self._st.wait(b)                   # buffer b's copy of piece k-2 has drained
        else:
            if k == 0:
                self._start_read(0, 0)
            if k + 1 < self._count:
                self._start_read(b ^ 1, k + 1)
            self._st.wait(b)                   # piece k has arrived in buffer b
        pos, n = self._where(k)
        self._current = self._st.view(b)[:n]
        self._k = k + 1
        if self._write:
            self._pending = (b, pos, n)
        return pos, self._current

    def _start_read(self, b: int, k: int) -> None:
        pos, n = self._where(k)
        self._st.start_dtoh(b, self._base + pos, n)

    def _queue_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            b, pos, n = pending
            self._st.start_htod(b, self._base + pos, n)

    def finish(self, ok: bool) -> None:
        """Normal exit: queue the last filled piece.  Either way: wait for every queued copy."""
        _drop(self._current)
        self._current = None
        if ok and self._write:
            self._queue_pending()
        self._pending = None
        self._st.wait(0)
        self._st.wait(1)


class _Staged:
    """The context manager behind read_pieces / write_pieces: pins the region, owns what it allocated."""

    def __init__(self, region: Any, offset: int, length: int, piece_bytes: int, write: bool, stager: Any) -> None:
        mem = memory_of(region)
        offset, length, piece_bytes = int(offset), int(length), int(piece_bytes)
        if mem.closed:
            raise RegionClosed(f"this {type(mem).__name__} is closed: it hands out no new views")
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        if offset < 0 or length < 0 or offset + length > mem.size:
            raise ExtentError(f"range [{offset}, {offset + length}) is not inside the region's {mem.size} bytes; "
                              f"stage a range inside the region", None)
        if write and getattr(mem, "readonly", False):
            raise ValueError("this region is read-only (imported without writable=True): it cannot be written")
        self._mem = mem
        self._offset = offset
        self._length = length
        self._piece = piece_bytes
        self._write = write
        self._stager = stager
        self._own_stager: Any = None
        self._pins: list[Any] = []
        self._pieces: _HostPieces | _DevicePieces | None = None

    def __enter__(self) -> Iterator[Piece]:
        if self._pieces is not None:
            raise RuntimeError("a read_pieces/write_pieces context can be entered only once")
        try:
            self._pieces = self._open()
        except BaseException as e:
            self._cleanup(ok=False, exc=e)
            raise
        return self._pieces

    def _open(self) -> _HostPieces | _DevicePieces:
        mem = self._mem
        if self._length == 0:
            return _HostPieces(memoryview(b""), 0, 0, 1)    # nothing to pin, copy or allocate
        if isinstance(mem, HostRegion):
            whole = memoryview(mem)            # the export pins the mapping until _cleanup
            self._pins.append(whole)
            view = whole.cast("B")
            self._pins.append(view)
            return _HostPieces(view, self._offset, self._length, self._piece)
        if _memory.CudaRegion is None or not isinstance(mem, _memory.CudaRegion):
            raise TypeError(f"cannot stage a {type(mem).__name__}")
        self._pins.append(mem.cuda_array(self._offset, self._length))    # keeps the mapping while copies run
        stager = self._stager
        piece = self._piece
        if stager is None:
            from tensorxfer.memory._copy import Stager

            piece = min(piece, self._length)
            stager = self._own_stager = Stager(mem.device_index, piece)
        else:
            piece = min(piece, int(stager.buffer_bytes))
        return _DevicePieces(stager, int(mem.ptr), self._offset, self._length, piece, self._write)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._cleanup(ok=exc_type is None, exc=exc)

    def _cleanup(self, ok: bool, exc: BaseException | None) -> None:
        # With an exception in flight, a second error from cleaning up would
        # replace it; attach it as a note instead.  Without one, it surfaces.
        steps: list[Callable[[], object]] = []
        pieces = self._pieces
        if pieces is not None:
            steps.append(lambda: pieces.finish(ok))
        if self._own_stager is not None:
            steps.append(self._own_stager.close)
        steps += [p.release for p in reversed(self._pins) if isinstance(p, memoryview)]
        first: BaseException | None = None
        for step in steps:
            if exc is not None:
                _quietly(step, exc)
                continue
            try:
                step()
            except Exception as e:
                first = first or e
        self._pins.clear()              # drops the device view: the region may be released now
        self._own_stager = None
        self._pieces = None
        if first is not None:
            raise first
