# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""Stager and Copier: one CUDA stream and two pinned host buffers, for copies in and out of device memory.

Nothing here knows about regions: callers pass device addresses.
``tensorxfer.staging`` drives a :class:`Stager` to move bytes through the
host (the one double-buffered staging loop: ``staging.htod`` / ``staging.dtoh``
for raw device addresses); :class:`Copier` adds device-to-device copies and
memset on the same stream.  The driver helpers
(``check_cu``, the per-process primary-context cache) come from
``_driver.pyx`` through ``_driver.pxd``, as for ``_cuda.pyx`` (CudaRegion),
which this module never imports (``_cuda`` re-exports these classes).
"""

import os

from cpython.buffer cimport PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from cuda.bindings cimport cydriver
from libc.errno cimport ECONNRESET, EINTR, EPIPE, errno
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from tensorxfer.memory._driver cimport bind_device, check_cu
from tensorxfer.memory._fence cimport TX_FENCE_DONE, TX_FENCE_REVOKED, tx_fence_store, tx_fence_take, tx_fence_word


cdef class Stager:
    """One non-blocking stream and two pinned host buffers, for moving bytes through the host.

    A network data path uses one per connection: while the socket sends (or
    receives) one buffer, the DMA engine fills (or drains) the other, so the
    device copy overlaps the network.  :class:`Copier` builds on it.  The
    pinned buffers are allocated on first use; ``view(i)`` is a writable
    memoryview of buffer ``i``, valid until :meth:`close`.  One owner;
    ``close()`` is idempotent.
    """
    cdef int _device
    cdef cydriver.CUstream _stream
    cdef cydriver.CUevent _events[2]
    cdef cydriver.CUevent _marks[2]     # mark(): completion of queued work (made on first use)
    cdef void* _pinned[2]
    cdef size_t _size
    cdef bint _closed
    cdef list _views

    def __cinit__(self, int device=0, size_t buffer_bytes=64 << 20):
        cdef int i
        self._stream = NULL
        self._closed = False
        self._device = device
        self._size = buffer_bytes
        self._views = []
        for i in range(2):
            self._events[i] = NULL
            self._marks[i] = NULL
            self._pinned[i] = NULL
        if buffer_bytes == 0:
            raise ValueError("buffer_bytes must be positive")
        try:
            bind_device(device)
            check_cu(cydriver.cuStreamCreate(&self._stream, cydriver.CU_STREAM_NON_BLOCKING), b"cuStreamCreate")
        except BaseException:
            self.close()
            raise

    cdef int _ensure_pinned(self) except -1:
        cdef int i
        if self._closed:
            raise ValueError("operation on a closed Stager")
        if self._pinned[1] != NULL:
            return 0
        for i in range(2):
            if self._events[i] == NULL:
                check_cu(cydriver.cuEventCreate(&self._events[i], cydriver.CU_EVENT_DISABLE_TIMING),
                         b"cuEventCreate")
            if self._pinned[i] == NULL:
                check_cu(cydriver.cuMemHostAlloc(&self._pinned[i], self._size, 0), b"cuMemHostAlloc")
                self._views.append(PyMemoryView_FromMemory(<char*>self._pinned[i], self._size, PyBUF_WRITE))
        return 0

    cdef int _check(self, int i, size_t n) except -1:
        if i < 0 or i > 1 or n > self._size:
            raise ValueError(f"buffer {i} / {n} bytes out of range (2 buffers of {self._size})")
        bind_device(self._device)
        self._ensure_pinned()
        return 0

    # nogil primitives (the caller has run _check / _ensure_pinned and bound the device)
    cdef int _dtoh_async(self, int i, uintptr_t src, size_t n) except -1 nogil:
        check_cu(cydriver.cuMemcpyDtoHAsync(self._pinned[i], <cydriver.CUdeviceptr>src, n, self._stream),
                 b"cuMemcpyDtoHAsync")
        check_cu(cydriver.cuEventRecord(self._events[i], self._stream), b"cuEventRecord")
        return 0

    cdef int _htod_async(self, int i, uintptr_t dst, size_t n) except -1 nogil:
        check_cu(cydriver.cuMemcpyHtoDAsync(<cydriver.CUdeviceptr>dst, self._pinned[i], n, self._stream),
                 b"cuMemcpyHtoDAsync")
        check_cu(cydriver.cuEventRecord(self._events[i], self._stream), b"cuEventRecord")
        return 0

    cdef int _wait(self, int i) except -1 nogil:
        check_cu(cydriver.cuEventSynchronize(self._events[i]), b"cuEventSynchronize")
        return 0

    @property
    def buffer_bytes(self):
        """Bytes per pinned buffer (the largest piece one copy can stage)."""
        return self._size

    def view(self, int i):
        """Writable memoryview of pinned buffer ``i`` (0 or 1)."""
        self._check(i, 0)
        return self._views[i]

    def start_dtoh(self, int i, uintptr_t src, size_t n):
        """Queue device → buffer ``i`` (``n`` bytes); :meth:`wait` ``(i)`` before reading it."""
        self._check(i, n)
        with nogil:
            self._dtoh_async(i, src, n)

    def start_htod(self, int i, uintptr_t dst, size_t n):
        """Queue buffer ``i`` → device (``n`` bytes); :meth:`wait` ``(i)`` before refilling it."""
        self._check(i, n)
        with nogil:
            self._htod_async(i, dst, n)

    def wait(self, int i):
        """Block (without the GIL) until the last copy queued on buffer ``i`` finished."""
        self._check(i, 0)
        with nogil:
            self._wait(i)

    def mark(self, int i):
        """Record mark ``i`` (0 or 1) on the stream, after everything queued so far.

        :meth:`wait_mark` ``(i)`` then returns once that work finished, while later work keeps the
        stream busy (an ipc relay reports piece k landed while piece k+1 copies).  Recording a mark
        again moves it.
        """
        if i < 0 or i > 1:
            raise ValueError(f"mark {i} out of range (0 or 1)")
        if self._closed:
            raise ValueError("operation on a closed Stager")
        bind_device(self._device)
        if self._marks[i] == NULL:
            check_cu(cydriver.cuEventCreate(&self._marks[i], cydriver.CU_EVENT_DISABLE_TIMING), b"cuEventCreate")
        with nogil:
            check_cu(cydriver.cuEventRecord(self._marks[i], self._stream), b"cuEventRecord")

    def wait_mark(self, int i):
        """Block (without the GIL) until the work queued before :meth:`mark` ``(i)`` finished."""
        if i < 0 or i > 1:
            raise ValueError(f"mark {i} out of range (0 or 1)")
        if self._closed:
            raise ValueError("operation on a closed Stager")
        if self._marks[i] == NULL:
            raise ValueError(f"mark {i} was never recorded")
        bind_device(self._device)
        with nogil:
            check_cu(cydriver.cuEventSynchronize(self._marks[i]), b"cuEventSynchronize")

    def synchronize(self):
        """Block until everything queued on the stream finished."""
        if self._closed:
            raise ValueError("operation on a closed Stager")
        bind_device(self._device)
        with nogil:
            check_cu(cydriver.cuStreamSynchronize(self._stream), b"cuStreamSynchronize")

    @property
    def stream(self):
        """The CUstream handle as an int (for torch.cuda.ExternalStream and the like)."""
        return <uintptr_t>self._stream

    def close(self):
        cdef int i
        if self._closed:
            return
        self._closed = True
        for v in self._views or ():
            v.release()
        self._views = []
        try:
            bind_device(self._device)
        except BaseException:
            pass
        if self._stream != NULL:
            cydriver.cuStreamSynchronize(self._stream)
            cydriver.cuStreamDestroy(self._stream)
            self._stream = NULL
        for i in range(2):
            if self._events[i] != NULL:
                cydriver.cuEventDestroy(self._events[i])
                self._events[i] = NULL
            if self._marks[i] != NULL:
                cydriver.cuEventDestroy(self._marks[i])
                self._marks[i] = NULL
            if self._pinned[i] != NULL:
                cydriver.cuMemFreeHost(self._pinned[i])
                self._pinned[i] = NULL

    def __dealloc__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


cdef class Copier(Stager):
    """Copies into and out of device memory on one non-blocking stream.

    Host data moves through the two pinned staging buffers, double-buffered
    (:func:`tensorxfer.staging.htod` / :func:`~tensorxfer.staging.dtoh`):
    the CPU fills one while the DMA engine drains the other, so pageable
    sources need no registration and the copy overlaps.  Device-to-device
    copies are queued back to back.  Call :meth:`synchronize` before reading
    what was written.
    """

    def __init__(self, int device=0, size_t buffer_bytes=64 << 20):
        pass                      # Stager.__cinit__ took the arguments (staging buffer size)

    def dtod(self, uintptr_t dst, uintptr_t src, size_t n):
        """Queue a device-to-device copy of ``n`` bytes."""
        bind_device(self._device)
        with nogil:
            check_cu(cydriver.cuMemcpyDtoDAsync(<cydriver.CUdeviceptr>dst, <cydriver.CUdeviceptr>src, n,
                                                self._stream), b"cuMemcpyDtoDAsync")

    def dtod_batch(self, dsts, srcs, sizes, bint batch_api=False):
        """Queue many device-to-device copies in one call, without the GIL.

        ``dsts``, ``srcs``, ``sizes``: equal-length C-contiguous uint64
        buffers (numpy arrays).  ``batch_api`` uses ``cuMemcpyBatchAsync``
        (one driver call for all) instead of one ``cuMemcpyDtoDAsync`` each.
        """
        cdef const unsigned long long[::1] d = dsts
        cdef const unsigned long long[::1] s = srcs
        cdef const unsigned long long[::1] n = sizes
        cdef size_t i, count = d.shape[0]
        cdef cydriver.CUmemcpyAttributes attr
        cdef size_t attr_index = 0
        if s.shape[0] != count or n.shape[0] != count:
            raise ValueError("dsts, srcs and sizes must have the same length")
        if count == 0:
            return
        bind_device(self._device)
        if batch_api:
            memset(&attr, 0, sizeof(attr))
            attr.srcAccessOrder = cydriver.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            with nogil:
                check_cu(cydriver.cuMemcpyBatchAsync(<cydriver.CUdeviceptr*>&d[0], <cydriver.CUdeviceptr*>&s[0],
                                                     <size_t*>&n[0], count, &attr, &attr_index, 1, self._stream),
                         b"cuMemcpyBatchAsync")
            return
        with nogil:
            for i in range(count):
                check_cu(cydriver.cuMemcpyDtoDAsync(<cydriver.CUdeviceptr>d[i], <cydriver.CUdeviceptr>s[i], n[i],
                                                    self._stream), b"cuMemcpyDtoDAsync")

    def dtod_groups(self, dsts, srcs, widths, heights, dpitches, spitches):
        """Queue strided groups of device-to-device copies, without the GIL: group ``i`` copies ``heights[i]``
        rows of ``widths[i]`` bytes from ``srcs[i] + j*spitches[i]`` to ``dsts[i] + j*dpitches[i]`` -- one
        ``cuMemcpy2DAsync`` (a block of rows: a row-parallel shard), or one ``cuMemcpyDtoDAsync`` where the
        rows are contiguous on both sides.  Six equal-length C-contiguous uint64 buffers."""
        cdef const unsigned long long[::1] d = dsts
        cdef const unsigned long long[::1] s = srcs
        cdef const unsigned long long[::1] w = widths
        cdef const unsigned long long[::1] h = heights
        cdef const unsigned long long[::1] dp = dpitches
        cdef const unsigned long long[::1] sp = spitches
        cdef size_t i, count = d.shape[0]
        cdef cydriver.CUDA_MEMCPY2D p
        if not (s.shape[0] == w.shape[0] == h.shape[0] == dp.shape[0] == sp.shape[0] == <Py_ssize_t>count):
            raise ValueError("dsts, srcs, widths, heights, dpitches and spitches must have the same length")
        if count == 0:
            return
        bind_device(self._device)
        memset(&p, 0, sizeof(p))
        p.srcMemoryType = cydriver.CU_MEMORYTYPE_DEVICE
        p.dstMemoryType = cydriver.CU_MEMORYTYPE_DEVICE
        with nogil:
            for i in range(count):
                if h[i] == 0 or w[i] == 0:
                    continue
                if h[i] == 1 or (dp[i] == w[i] and sp[i] == w[i]):
                    check_cu(cydriver.cuMemcpyDtoDAsync(<cydriver.CUdeviceptr>d[i], <cydriver.CUdeviceptr>s[i],
                                                        w[i] * h[i], self._stream), b"cuMemcpyDtoDAsync")
                    continue
                p.srcDevice = <cydriver.CUdeviceptr>s[i]
                p.srcPitch = sp[i]
                p.dstDevice = <cydriver.CUdeviceptr>d[i]
                p.dstPitch = dp[i]
                p.WidthInBytes = w[i]
                p.Height = h[i]
                check_cu(cydriver.cuMemcpy2DAsync(&p, self._stream), b"cuMemcpy2DAsync")

    def memset(self, uintptr_t dst, size_t n, unsigned char value=0):
        bind_device(self._device)
        with nogil:
            check_cu(cydriver.cuMemsetD8Async(<cydriver.CUdeviceptr>dst, value, n, self._stream),
                     b"cuMemsetD8Async")


cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    enum: MSG_NOSIGNAL

cdef enum:
    LANE_MESSAGE = 65536        # a lane's largest message (tensorxfer.transport.ipc.messages.MAX_MESSAGE)

cdef uint64_t ALL_ONES = 0xFFFFFFFFFFFFFFFF      # a quantizing launch's failure word: no tile failed


cdef struct Quantizing:
    # a pair's quantizing tiles (tensorxfer.quant.tiles.DeviceTiles.launch_args): none where count is 0
    cydriver.CUfunction fn
    cydriver.CUdeviceptr table
    unsigned int count
    cydriver.CUdeviceptr status     # the lowest failing tile (all ones: none), on the device
    uint64_t* word                  # ... and its pinned copy on the host, read once the stream synchronized


cdef int quantizing_of(tuple given, Quantizing* q) except -1:
    q.count = 0
    if given is None:
        return 0
    fn, table, count, status, word = given
    q.fn = <cydriver.CUfunction><uintptr_t>fn
    q.table = <cydriver.CUdeviceptr><uintptr_t>table
    q.count = <unsigned int>count
    q.status = <cydriver.CUdeviceptr><uintptr_t>status
    q.word = <uint64_t*><uintptr_t>word
    if q.fn == NULL or q.table == 0 or q.status == 0 or q.word == NULL or q.count == 0:
        raise ValueError(f"quantizing tiles without a kernel, table, word or tiles: {given}")
    return 0


cdef cydriver.CUresult launch_tiles(Quantizing* q, cydriver.CUdeviceptr src, cydriver.CUdeviceptr dst,
                                    cydriver.CUstream stream, const char** failed) noexcept nogil:
    """Queue the tiles on ``stream``: the failure word reset, the kernel, the word read back to the host."""
    cdef void* args[4]
    cdef cydriver.CUresult rc
    args[0] = &q.table
    args[1] = &src
    args[2] = &dst
    args[3] = &q.status
    rc = cydriver.cuMemsetD32Async(q.status, 0xFFFFFFFF, 2, stream)
    failed[0] = b"cuMemsetD32Async(the tiles' word)"
    if rc == cydriver.CUDA_SUCCESS:
        rc = cydriver.cuLaunchKernel(q.fn, q.count, 1, 1, 256, 1, 1, 0, stream, args, NULL)
        failed[0] = b"cuLaunchKernel(quantize_tiles)"
    if rc == cydriver.CUDA_SUCCESS:
        rc = cydriver.cuMemcpyDtoHAsync(q.word, q.status, 8, stream)
        failed[0] = b"cuMemcpyDtoHAsync(the tiles' word)"
    return rc


# One loaded strided_copy module per device (per process): modules live as long as the primary context.
cdef dict _kernels = {}


cdef cydriver.CUfunction _strided_kernel(int device, bytes image) except NULL:
    cdef cydriver.CUmodule module
    cdef cydriver.CUfunction fn
    cdef const char* data = image
    if device in _kernels:
        return <cydriver.CUfunction><uintptr_t>_kernels[device]
    bind_device(device)
    with nogil:
        check_cu(cydriver.cuModuleLoadData(&module, data), b"cuModuleLoadData(strided_copy)")
        check_cu(cydriver.cuModuleGetFunction(&fn, module, b"strided_copy"), b"cuModuleGetFunction(strided_copy)")
    _kernels[device] = <uintptr_t>fn
    return fn


cdef class StridedCopy:
    """A static list of strided copy tiles in device memory, run by one kernel launch on a Copier's stream.

    ``tiles`` is a C-contiguous uint64 array of shape (n, 6): per tile (src offset, dst offset, width,
    rows, src pitch, dst pitch), offsets relative to the bases given to :meth:`launch`
    (:func:`tensorxfer.memory.strided.tiles` builds it).  ``image`` is the compiled kernel
    (``strided_copy.fatbin``).  The table is uploaded once; a weight sync's schedule is static, so every
    step is one launch.  One owner; ``close()`` is idempotent.
    """
    cdef int _device
    cdef cydriver.CUdeviceptr _table
    cdef size_t _count
    cdef cydriver.CUfunction _fn
    cdef bint _closed

    def __cinit__(self, int device, tiles, bytes image):
        cdef const unsigned long long[:, ::1] t = tiles
        self._table = 0
        self._closed = False
        self._device = device
        if t.shape[1] != 6:
            raise ValueError(f"tiles must have shape (n, 6), got {tuple(tiles.shape)}")
        if t.shape[0] > 0x7FFFFFFF:
            raise ValueError(f"{t.shape[0]} tiles is more than one launch's grid holds")
        self._count = t.shape[0]
        self._fn = _strided_kernel(device, image)
        if self._count == 0:
            return
        bind_device(device)
        with nogil:
            check_cu(cydriver.cuMemAlloc(&self._table, self._count * 48), b"cuMemAlloc(strided_copy tiles)")
            check_cu(cydriver.cuMemcpyHtoD(self._table, &t[0, 0], self._count * 48), b"cuMemcpyHtoD(tiles)")

    @property
    def tiles(self):
        return self._count

    cdef cydriver.CUresult _queue_step(self, Quantizing* q, cydriver.CUdeviceptr src, cydriver.CUdeviceptr dst,
                                       cydriver.CUstream stream, const char** failed) noexcept nogil:
        """Queue one step on ``stream``: the strided copy of every tile, then the pair's quantizing tiles."""
        cdef void* args[3]
        cdef cydriver.CUresult rc = cydriver.CUDA_SUCCESS
        args[0] = &self._table
        args[1] = &src
        args[2] = &dst
        if self._count:
            rc = cydriver.cuLaunchKernel(self._fn, <unsigned int>self._count, 1, 1, 256, 1, 1, 0, stream, args, NULL)
            failed[0] = b"cuLaunchKernel(strided_copy)"
        if q.count and rc == cydriver.CUDA_SUCCESS:
            rc = launch_tiles(q, src, dst, stream, failed)
        return rc

    def launch(self, Copier copier, uintptr_t dst_base, uintptr_t src_base, tuple quantizing=None):
        """Queue the copy of every tile from ``src_base`` to ``dst_base`` on ``copier``'s stream; and after it a
        pair's ``quantizing`` tiles (as :meth:`serve_lane` takes them: their failure word is on the host once
        the stream synchronized), all without the GIL (launched from Python, a quantizing pair's launch took
        0.2-0.8 ms on the H100, its threads taking turns)."""
        cdef cydriver.CUdeviceptr src = src_base, dst = dst_base
        cdef Quantizing q
        cdef const char* failed = NULL
        cdef cydriver.CUresult rc = cydriver.CUDA_SUCCESS
        if self._closed:
            raise ValueError("operation on a closed StridedCopy")
        if copier._device != self._device:
            raise ValueError(f"the copier is on device {copier._device}, the tiles on {self._device}")
        quantizing_of(quantizing, &q)
        if self._count == 0 and q.count == 0:
            return
        bind_device(self._device)
        with nogil:
            rc = self._queue_step(&q, src, dst, copier._stream, &failed)
        if rc != cydriver.CUDA_SUCCESS:
            check_cu(rc, failed)

    def serve_lane(self, Copier copier, uintptr_t dst_base, uintptr_t src_base, int fd, uintptr_t fence,
                   tuple quantizing=None):
        """Serve a copy lane's steps (``tensorxfer.transport.ipc.delegate``) without the GIL: for each ``G`` +
        8-byte seq read from the blocking ``SOCK_SEQPACKET`` socket ``fd``, take the step on the follower's fence
        word at ``fence`` (granted -> running: before any byte is written), launch the copy, wait for it, mark
        the step done on the fence, and answer ``K`` + the same 8 bytes.  The GIL is not needed from a step's
        arrival to its answer (on the H200 machine a lane thread waited 0.1-0.3 ms for it, behind its process's
        own feeds).  A copy that fails marks its step revoked on the fence (nothing more of it is written)
        before the error is raised.

        ``quantizing``: a pair that quantizes on the way (``tensorxfer.quant.tiles.DeviceTiles.launch_args``,
        as :meth:`launch` takes it) -- each step also launches the tiles after the copy; a step whose lowest
        failing tile (a block with a NaN or an infinity: nothing of it written) is not all ones is answered
        ``Q`` + the 8 bytes + that tile (8 bytes, big-endian), as the host's Python loop answers it.  (Served
        in Python, such a step's launch waited 0.2-0.8 ms on the H100 in a 4-to-2 FP8 sync, the host's
        threads taking turns; an engine's own Python threads would make that worse.)

        Returns ``(steps served, the first message that is not a served step)``: ``b""`` at the end of the stream
        (or where the follower hung up before a step's answer), else a message for the caller -- a new setup, or
        a ``G`` whose step the fence did not grant (the follower gave it up; the caller refuses it).  Raises
        CudaError (a copy failed) or OSError (the socket).
        """
        cdef cydriver.CUdeviceptr src = src_base, dst = dst_base
        cdef cydriver.CUresult rc = cydriver.CUDA_SUCCESS
        cdef const char* failed = NULL
        cdef uint64_t* word = <uint64_t*>fence
        cdef uint64_t seq = 0
        cdef unsigned char* buf
        cdef ssize_t n = 0
        cdef long served = 0
        cdef int err = 0, i
        cdef Quantizing q
        cdef uint64_t tile = 0
        if self._closed:
            raise ValueError("operation on a closed StridedCopy")
        if copier._device != self._device:
            raise ValueError(f"the copier is on device {copier._device}, the tiles on {self._device}")
        if word == NULL:
            raise ValueError("serve_lane needs the lane's fence word")
        quantizing_of(quantizing, &q)
        buf = <unsigned char*>malloc(LANE_MESSAGE)
        if buf == NULL:
            raise MemoryError()
        try:
            bind_device(self._device)
            with nogil:
                while True:
                    n = recv(fd, buf, LANE_MESSAGE, 0)
                    if n < 0 and errno == EINTR:
                        continue
                    if n < 0:
                        err = errno
                        break
                    if n != 9 or buf[0] != b'G':
                        break
                    seq = 0
                    for i in range(1, 9):
                        seq = (seq << 8) | buf[i]
                    if not tx_fence_take(word, seq):
                        break       # given up by the follower: not one byte; the caller answers it
                    rc = self._queue_step(&q, src, dst, copier._stream, &failed)
                    if rc == cydriver.CUDA_SUCCESS:
                        rc = cydriver.cuStreamSynchronize(copier._stream)
                        failed = b"cuStreamSynchronize"
                    if rc != cydriver.CUDA_SUCCESS:
                        # the launch failed or the stream stopped on the error: nothing of this step still runs
                        tx_fence_store(word, tx_fence_word(seq, TX_FENCE_REVOKED))
                        break
                    tx_fence_store(word, tx_fence_word(seq, TX_FENCE_DONE))
                    served += 1
                    n = 9
                    buf[0] = b'K'
                    if q.count and q.word[0] != ALL_ONES:
                        # blocks with a NaN were not written (the rest was): the follower names the tensor
                        buf[0] = b'Q'
                        tile = q.word[0]
                        for i in range(8):
                            buf[16 - i] = <unsigned char>(tile >> (8 * i))
                        n = 17
                    if send(fd, buf, n, MSG_NOSIGNAL) != n:
                        err = errno
                        # the follower hung up (it gave the lane up while this step ran): the lane's end
                        n = 0 if err == EPIPE or err == ECONNRESET else -1
                        break
            if rc != cydriver.CUDA_SUCCESS:
                check_cu(rc, failed)
            if n < 0:
                raise OSError(err, f"copy lane: {os.strerror(err)}")
            return served, bytes(buf[:n])
        finally:
            free(buf)

    def close(self):
        if self._closed:
            return
        self._closed = True
        if self._table != 0:
            try:
                bind_device(self._device)
            except BaseException:
                pass
            cydriver.cuMemFree(self._table)
            self._table = 0

    def __dealloc__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
