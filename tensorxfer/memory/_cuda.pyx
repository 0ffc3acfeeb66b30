# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""CudaRegion: one CUDA VMM reservation backed by many physical handles.

``cuMemAddressReserve`` reserves one virtual range; one ``cuMemCreate`` per
chunk makes a physical handle; ``cuMemMap`` places each at its offset and
``cuMemSetAccess`` opens the mapped runs to the device.  This is exactly the
shape on which ``cuMemGetAddressRange`` answers with a single handle, the
answer UCX trusted when it registered only the first handle.  Here extents
are resolved by walking the driver (see ``_extent.pyx``).

The driver is reached only through ``cuda.bindings.cydriver`` (cimported,
called without the GIL), and through the helpers of ``_driver.pyx``
(``check_cu``, the primary contexts) that this module shares with
``_copy.pyx`` (Stager, Copier).  Nothing links libcuda: cuda.bindings loads
it at run time, so this module imports on machines without a GPU, and every
call there raises :class:`~tensorxfer.errors.CudaError` saying so.

Contexts: every call runs in the device's *primary* context (the one
PyTorch and CuPy use), made current on the calling thread first.
"""

import warnings

from cuda.bindings cimport cydriver
from libc.stdint cimport uintptr_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from posix.unistd cimport close, sysconf, _SC_PAGESIZE

from tensorxfer.memory._driver cimport _attr, _fill_prop, bind_device, check_cu
from tensorxfer.memory._extent cimport AllocationMap

from tensorxfer.errors import CudaError, ExtentError
# The driver queries stay importable from here (doctor, tests, benchmarks); _driver does not import this
# module, so no circle.
from tensorxfer.memory._driver import device_count, device_info, driver_version, is_vmm, pointer_range

cdef size_t PAGE_SIZE = <size_t>sysconf(_SC_PAGESIZE)

#: Default bytes per physical handle, chosen by measurement on an H200
#: (benchmarks/results/cuda-*.json): creating + mapping 31 GB took 910 ms
#: with 2 MiB handles, 86 ms with 20 MiB, 25 ms with 64 MiB, 3.9 ms with
#: 1 GiB.  At 256 MiB a handle is created faster than the copy engine fills
#: it (~130 us at 2 TB/s), so from_tensors' allocation hides behind its
#: copies, while a 31 GB model still spans ~120 handles.  Grown to keep at
#: most 512 handles, which bounds the fds an IPC export needs.
DEFAULT_CHUNK_SIZE = 256 << 20
MAX_DEFAULT_CHUNKS = 512


def _default_chunk_size(size_t size, size_t granularity):
    cdef size_t chunk = DEFAULT_CHUNK_SIZE
    while size > chunk * MAX_DEFAULT_CHUNKS:
        chunk *= 2
    return _round_up(chunk, granularity)


cdef inline size_t _round_up(size_t n, size_t align) noexcept nogil:
    return (n + align - 1) // align * align


# ------------------------------------------------------------------ the region
cdef struct CuChunk:
    size_t offset
    size_t size
    cydriver.CUmemGenericAllocationHandle handle
    bint created        # the handle exists (created or imported) and must be released
    bint mapped


cdef class CudaRegion(AllocationMap):
    """One contiguous device virtual range backed by several VMM handles.

    Create with :meth:`allocate` (owned), :meth:`import_handles` (owned
    mapping of another process's handles) or :meth:`adopt` (memory the
    caller allocated: never freed here).  Views (:meth:`cuda_array`, and the
    torch/CuPy tensors built on them) keep the mapping alive: :meth:`close`
    never refuses; it marks the region closed at once (no new views) and
    unmaps the memory when the last view is dropped.
    """
    cdef cydriver.CUdeviceptr _base
    cdef CuChunk* _chunks
    cdef Py_ssize_t _nchunks
    cdef int _device
    cdef bint _reserved         # we hold the VA reservation
    cdef bint _shareable
    cdef bint _gdr
    cdef object _keepalive
    cdef Py_ssize_t _next_chunk     # chunks [0, _next_chunk) have been set up by _map_upto
    cdef size_t _granularity
    cdef list _access_devices
    cdef list _import_fds
    cdef frozenset _holes

    def __cinit__(self):
        self._base = 0
        self._chunks = NULL
        self._nchunks = 0
        self._reserved = False

    # ---------------------------------------------------------------- factories
    @staticmethod
    def reserve(size, chunk_size=None, int device=0):
        """Reserve the address range and plan its chunks, mapping none yet.

        Call :meth:`map_next` until ``mapped_size == size``: a caller can
        start copying into the mapped prefix while later chunks are still
        being created (``TensorRegion.from_tensors`` does, overlapping
        allocation with the copy-in).  Same arguments and errors as
        :meth:`allocate`.
        """
        return CudaRegion._plan(size, chunk_size, device, False)

    @staticmethod
    def allocate(size, chunk_size=None, int device=0):
        """Reserve ``size`` bytes of device address space and back it with VMM handles.

        Equivalent to :meth:`reserve` followed by mapping every chunk.

        Chunks are rounded up to the allocation granularity (2 MiB on an
        H200); each is created with a POSIX-fd shareable handle type (for
        IPC) and, where the device supports it, ``gpuDirectRDMACapable``.

        Raises
        ------
        ValueError
            ``size`` or ``chunk_size`` is not positive.
        CudaError
            CUDA is unusable here, or a driver call failed; nothing stays
            allocated (every step is undone in reverse order).
        """
        return CudaRegion._plan(size, chunk_size, device, True)

    @staticmethod
    def _plan(size, chunk_size, int device, bint map_now):
        """Shared by allocate and reserve: granularity, handle types, chunk plan."""
        cdef cydriver.CUmemAllocationProp prop
        cdef size_t gran = 0
        size = int(size)
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        bind_device(device)
        if not _attr(cydriver.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device):
            raise CudaError(f"CUDA device {device} does not support virtual memory management")
        shareable = bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device))
        gdr = bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device))
        _fill_prop(&prop, device, shareable, gdr)
        check_cu(cydriver.cuMemGetAllocationGranularity(&gran, &prop, cydriver.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 b"cuMemGetAllocationGranularity")
        size = _round_up(size, gran)
        chunk = _default_chunk_size(size, gran) if chunk_size is None else int(chunk_size)
        if chunk <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk}")
        chunk = _round_up(chunk, gran)
        sizes = [chunk] * (size // chunk)
        if size % chunk:
            sizes.append(size % chunk)
        return CudaRegion._build(sizes, 0, frozenset(), device, shareable, gdr, None, None, map_now)

    @staticmethod
    def _from_chunks(sizes, size_t unmapped_tail=0, holes=(), int device=0):
        """A region from explicit chunk sizes (granularity multiples), with
        reserved-but-unmapped ``holes`` (chunk indexes) and tail: the VMM
        shapes tests use to prove extents never widen into unmapped memory."""
        bind_device(device)
        shareable = bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device))
        gdr = bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device))
        return CudaRegion._build([int(s) for s in sizes], unmapped_tail, frozenset(int(h) for h in holes),
                                 device, shareable, gdr, None, None, True)

    @classmethod
    def import_handles(cls, handles, int device=0, access_devices=None):
        """Map another process's exported chunk handles contiguously.

        Same shape as :meth:`HostRegion.import_handles`.

        Parameters
        ----------
        handles : iterable of (size, fd)
            As produced by :meth:`export_handles` on the other side (the fds
            arrive over a Unix socket with SCM_RIGHTS, or are inherited).
            The fds stay the caller's: close them after this returns (the
            imported handles keep the memory alive on their own).
        device : int
            The device whose context performs the mapping.
        access_devices : sequence of int, optional
            Devices granted read/write access (default: ``[device]``); a
            device other than the memory's own reaches it over NVLink/P2P.

        Returns
        -------
        CudaRegion
            Owns the mappings and imported handles (not the fds); mapped
            read-write.

        Raises
        ------
        CudaError
            A handle cannot be imported or mapped; nothing stays mapped.
        """
        handles = [(int(s), int(fd)) for s, fd in handles]
        return CudaRegion._build([s for s, _ in handles], 0, frozenset(), device, False, False,
                                 [fd for _, fd in handles], access_devices, True)

    @staticmethod
    def adopt(uintptr_t ptr, size_t size, int device=0, keepalive=None):
        """Wrap device memory the caller allocated (cudaMalloc, a PyTorch
        tensor, an expandable segment), without owning it.

        The extent is resolved now, so memory that is not fully mapped
        raises :class:`ExtentError` here.  ``keepalive`` (e.g. the tensor)
        is referenced until :meth:`close`; otherwise the caller keeps the
        memory alive.  tensorxfer never frees adopted memory.
        """
        cdef CudaRegion self = CudaRegion.__new__(CudaRegion)
        if size == 0:
            raise ValueError("cannot adopt an empty range")
        bind_device(device)
        self._device = device
        self._base = <cydriver.CUdeviceptr>ptr
        self._va_base = ptr
        self._va_size = size
        self._size = size
        self._owner = False
        self._closed = False
        self._keepalive = keepalive
        self.resolve_extent(0, size)
        return self

    @staticmethod
    def from_tensor(tensor):
        """``adopt`` a CUDA torch tensor's bytes (the tensor is kept alive)."""
        if not getattr(tensor, "is_cuda", False):
            raise ValueError("from_tensor needs a CUDA tensor")
        return CudaRegion.adopt(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                tensor.device.index or 0, keepalive=tensor)

    @staticmethod
    cdef CudaRegion _build(list sizes, size_t tail, frozenset holes, int device, bint shareable, bint gdr,
                           list import_fds, access_devices, bint map_now):
        cdef CudaRegion self = CudaRegion.__new__(CudaRegion)
        self._device = device
        self._owner = True
        self._closed = False
        self._shareable = shareable
        self._gdr = gdr
        try:
            self._reserve(sizes, tail, holes, import_fds, access_devices)
            if map_now:
                self._map_upto(self._nchunks)
        except BaseException:
            self._release()
            raise
        return self

    cdef _reserve(self, list sizes, size_t tail, frozenset holes, list import_fds, access_devices):
        cdef cydriver.CUmemAllocationProp prop
        cdef cydriver.CUdeviceptr ptr = 0
        cdef size_t gran = 0, total = 0, off = 0, s
        cdef Py_ssize_t i, n = len(sizes)
        if n == 0:
            raise ValueError("a region needs at least one chunk")
        bind_device(self._device)
        _fill_prop(&prop, self._device, self._shareable, self._gdr)
        check_cu(cydriver.cuMemGetAllocationGranularity(&gran, &prop, cydriver.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 b"cuMemGetAllocationGranularity")
        for s in sizes:
            if s == 0 or s % gran:
                raise ValueError(f"chunk sizes must be positive multiples of the granularity {gran}, got {s}")
            total += s
        if tail % gran:
            raise ValueError(f"unmapped_tail must be a multiple of the granularity {gran}")
        devices = [self._device] if access_devices is None else [int(d) for d in access_devices]
        if not 0 < len(devices) <= 16:
            raise ValueError("access_devices must name 1 to 16 devices")
        if import_fds is not None and len(import_fds) != n:
            raise ValueError("one fd per chunk is needed")
        self._access_devices = devices
        self._import_fds = import_fds
        self._holes = holes
        self._granularity = gran
        self._chunks = <CuChunk*>calloc(n, sizeof(CuChunk))
        if self._chunks == NULL:
            raise MemoryError()
        self._nchunks = n
        for i in range(n):
            self._chunks[i].offset = off
            self._chunks[i].size = sizes[i]
            off += sizes[i]
        with nogil:
            check_cu(cydriver.cuMemAddressReserve(&ptr, total + tail, gran, 0, 0), b"cuMemAddressReserve")
        self._base = ptr
        self._reserved = True
        self._va_base = <uintptr_t>ptr
        self._va_size = total + tail
        self._size = total
        self._next_chunk = 0

    cdef _map_upto(self, Py_ssize_t stop):
        """Create (or import), map and open chunks [_next_chunk, stop) to the access devices."""
        cdef cydriver.CUmemAllocationProp prop
        cdef cydriver.CUmemAccessDesc access[16]
        cdef cydriver.CUdeviceptr ptr = self._base
        cdef size_t run_start, s
        cdef Py_ssize_t i, first = self._next_chunk, naccess = len(self._access_devices)
        cdef CuChunk* c
        cdef int fd
        bind_device(self._device)
        _fill_prop(&prop, self._device, self._shareable, self._gdr)
        for i in range(naccess):
            memset(&access[i], 0, sizeof(cydriver.CUmemAccessDesc))
            access[i].location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
            access[i].location.id = self._access_devices[i]
            access[i].flags = cydriver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for i in range(first, stop):
            c = &self._chunks[i]
            self._next_chunk = i + 1
            if i in self._holes:
                continue
            if self._import_fds is not None:
                fd = self._import_fds[i]
                with nogil:
                    check_cu(cydriver.cuMemImportFromShareableHandle(
                        &c.handle, <void*><uintptr_t>fd, cydriver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                        b"cuMemImportFromShareableHandle")
            else:
                with nogil:
                    check_cu(cydriver.cuMemCreate(&c.handle, c.size, &prop, 0), b"cuMemCreate")
            c.created = True
            with nogil:
                check_cu(cydriver.cuMemMap(ptr + c.offset, c.size, 0, c.handle, 0), b"cuMemMap")
            c.mapped = True
        # Access is set per run of newly mapped chunks: one call for a
        # hole-free region, however many handles it has.
        i = first
        while i < stop:
            if not self._chunks[i].mapped:
                i += 1
                continue
            run_start = self._chunks[i].offset
            while i < stop and self._chunks[i].mapped:
                i += 1
            s = self._chunks[i - 1].offset + self._chunks[i - 1].size - run_start
            with nogil:
                check_cu(cydriver.cuMemSetAccess(ptr + run_start, s, access, naccess), b"cuMemSetAccess")

    def map_next(self, Py_ssize_t count=1):
        """Map the next ``count`` planned chunks (see :meth:`reserve`); returns :attr:`mapped_size`.

        Raises CudaError if the driver refuses; the region stays valid (its
        mapped prefix usable) and :meth:`close` releases everything.
        """
        self._check_open()
        if count < 1:
            raise ValueError("count must be at least 1")
        self._map_upto(min(self._nchunks, self._next_chunk + count))
        return self.mapped_size

    @property
    def mapped_size(self):
        """Bytes from the start that have been mapped (all of :attr:`size` once fully mapped)."""
        if self._next_chunk == 0:
            return 0
        c = &self._chunks[self._next_chunk - 1]
        return c.offset + c.size

    # ---------------------------------------------------------------- lifetime
    cdef void _release(self) noexcept:
        cdef Py_ssize_t i
        cdef CuChunk* c
        if self._owner and (self._chunks != NULL or self._reserved):
            try:
                bind_device(self._device)
            except BaseException:
                pass
            if self._chunks != NULL:
                # The last view may go (a torch tensor's deleter) while kernels
                # that read it are still queued on someone else's stream; the
                # driver documents cuMemUnmap as synchronous only "for most use
                # cases".  Closing is rare: wait for the device before unmapping.
                cydriver.cuCtxSynchronize()
                for i in range(self._nchunks):
                    c = &self._chunks[i]
                    if c.mapped:
                        cydriver.cuMemUnmap(self._base + c.offset, c.size)
                        c.mapped = False
                    if c.created:
                        cydriver.cuMemRelease(c.handle)
                        c.created = False
            if self._reserved:
                cydriver.cuMemAddressFree(self._base, self._va_size)
                self._reserved = False
        if self._chunks != NULL:
            free(self._chunks)
            self._chunks = NULL
        self._nchunks = 0
        self._base = 0
        self._size = 0
        self._va_size = 0
        self._keepalive = None
        self._closed = True

    def __dealloc__(self):
        if not self._closed and self._owner:
            try:
                warnings.warn(f"unclosed CudaRegion of {self._size} bytes; call close() or use 'with'",
                              ResourceWarning)
            except BaseException:
                pass
        self._release()          # idempotent; device views hold a reference, so none can be alive here

    cdef int _check_open(self) except -1:
        # Also makes the device's context current: every method that talks
        # to the driver starts here, and the extent walk runs right after.
        AllocationMap._check_open(self)
        bind_device(self._device)
        return 0

    # ---------------------------------------------------------------- queries
    cdef int lookup(self, uintptr_t addr, uintptr_t* base, size_t* size) except -1 nogil:
        # The driver, not our chunk table, answers: this is what must be
        # right for memory we did not allocate (PyTorch segments), and the
        # same walk proves our own mappings.
        cdef cydriver.CUdeviceptr b = 0
        cdef size_t s = 0
        if cydriver.cuMemGetAddressRange(&b, &s, <cydriver.CUdeviceptr>addr) != cydriver.CUDA_SUCCESS:
            return 0
        base[0] = <uintptr_t>b
        size[0] = s
        return 1

    @property
    def device_index(self):
        return self._device

    @property
    def device(self):
        return f"cuda:{self._device}"

    @property
    def gpudirect_rdma_capable(self):
        """True if the handles were created with ``gpuDirectRDMACapable``."""
        return self._gdr

    @property
    def chunks(self):
        """``(offset, size, fd)`` per chunk, for diagnostics; the same shape as ``HostRegion.chunks``.

        ``fd`` is always -1: a CUDA chunk is a driver handle, and the region
        holds no fd for it (:meth:`export_handles` makes fds the caller
        owns).  Adopted memory has no chunk table: empty (the driver knows
        its handles; see :meth:`resolve_extent`).
        """
        AllocationMap._check_open(self)
        return [(self._chunks[i].offset, self._chunks[i].size, -1) for i in range(self._nchunks)]

    def __repr__(self):
        if self._closed:
            return "<CudaRegion closed>"
        kind = "owned" if self._owner else "adopted"
        return (f"<CudaRegion {kind} {self._size} bytes at {<uintptr_t>self._base:#x} on cuda:{self._device}, "
                f"{self._nchunks} handle(s)>")

    # ---------------------------------------------------------------- exports
    def export_dmabuf(self, size_t offset=0, length=None):
        """One dmabuf fd over ``[offset, offset+length)``, resolved first.

        ``offset`` must be page aligned; ``length`` (default: to the end) is
        rounded up to the page size.  The range is resolved before the
        driver is asked, so a range touching unmapped memory raises
        :class:`ExtentError` naming the address, never a driver error.

        Returns
        -------
        int
            The dmabuf fd, owned by the caller (close it with ``os.close``).
        """
        cdef int fd = -1
        cdef cydriver.CUdeviceptr ptr
        cdef size_t n
        self._check_open()
        if offset % PAGE_SIZE:
            raise ValueError(f"dmabuf offset must be a multiple of the page size {PAGE_SIZE}, got {offset}")
        n = (self._size - offset) if length is None else int(length)
        if offset >= self._size and length is None:
            raise ExtentError(f"offset {offset} is past the end of the region ({self._size} bytes)",
                              <uintptr_t>self._base + self._size)
        n = _round_up(n, PAGE_SIZE)
        ext = self.resolve_extent(offset, n)
        ptr = <cydriver.CUdeviceptr><uintptr_t>ext.ptr
        with nogil:
            check_cu(cydriver.cuMemGetHandleForAddressRange(&fd, ptr, n, cydriver.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                                                            0), b"cuMemGetHandleForAddressRange(DMA_BUF_FD)")
        return fd

    def export_handles(self):
        """One fresh POSIX fd per chunk (``cuMemExportToShareableHandle``), for :meth:`import_handles`.

        The same shape and ownership as :meth:`HostRegion.export_handles`.

        Returns
        -------
        list of (offset, size, fd)
            In chunk order; every fd is the caller's to close (``os.close``).

        Raises
        ------
        RegionClosed
            The region is closed.
        CudaError
            Adopted memory, a device without POSIX-fd handles, or a driver
            failure; every fd exported so far is closed.
        ExtentError
            A chunk is unmapped.
        """
        cdef int fd
        cdef Py_ssize_t i
        self._check_open()
        if not self._owner or self._nchunks == 0:
            raise CudaError("only regions tensorxfer allocated can export their handles")
        if not self._shareable:
            raise CudaError(f"device {self._device} does not support POSIX-fd shareable handles")
        out = []
        try:
            for i in range(self._nchunks):
                if not self._chunks[i].mapped:
                    raise ExtentError(f"chunk {i} is not mapped", <uintptr_t>self._base + self._chunks[i].offset)
                fd = -1
                check_cu(cydriver.cuMemExportToShareableHandle(
                    &fd, self._chunks[i].handle, cydriver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    b"cuMemExportToShareableHandle")
                out.append((self._chunks[i].offset, self._chunks[i].size, fd))
        except BaseException:
            for _, _, fd in out:
                close(fd)
            raise
        return out

    def cuda_array(self, size_t offset=0, length=None):
        """A ``__cuda_array_interface__`` byte view (uint8) of ``[offset, offset+length)``.

        torch.as_tensor / cupy.asarray take it zero-copy.  While it (or
        anything built on it) is alive the mapping stays: :meth:`close`
        then releases the memory when the last such view is dropped.

        Raises
        ------
        RegionClosed
            The region is closed (no new views).
        ExtentError
            The range runs past the region.
        """
        self._check_open()
        n = (self._size - offset) if length is None else int(length)
        if offset + n > self._size:
            raise ExtentError(f"view [{offset}, {offset + n}) runs past the region's {self._size} bytes",
                              <uintptr_t>self._base + self._size)
        return _DeviceBytes._make(self, offset, n)

    # ---------------------------------------------------------------- test hooks
    def _unmap_chunk(self, Py_ssize_t index):
        """``cuMemUnmap`` one chunk, leaving a hole (tests of extent resolution)."""
        cdef CuChunk* c
        self._check_open()
        if not self._owner or index < 0 or index >= self._nchunks:
            raise IndexError(index)
        if self._exports:
            raise BufferError("cannot unmap a chunk while views of the region exist")
        c = &self._chunks[index]
        if c.mapped:
            check_cu(cydriver.cuMemUnmap(self._base + c.offset, c.size), b"cuMemUnmap")
            c.mapped = False


cdef class _DeviceBytes:
    """A uint8 ``__cuda_array_interface__`` over part of a CudaRegion; pins the region while alive."""
    cdef CudaRegion _region
    cdef uintptr_t _ptr
    cdef size_t _n

    @staticmethod
    cdef _DeviceBytes _make(CudaRegion region, size_t offset, size_t n):
        cdef _DeviceBytes self = _DeviceBytes.__new__(_DeviceBytes)
        self._region = region
        self._ptr = <uintptr_t>region._base + offset
        self._n = n
        region._exports += 1
        return self

    def __dealloc__(self):
        if self._region is not None:
            self._region._view_released()

    @property
    def __cuda_array_interface__(self):
        # stream None: the producer makes no stream promise; our copies are
        # synchronous with respect to the host before any view is handed out.
        return {"shape": (self._n,), "typestr": "|u1", "data": (self._ptr, False), "version": 3,
                "strides": None, "stream": None}

    @property
    def device(self):
        return self._region._device
