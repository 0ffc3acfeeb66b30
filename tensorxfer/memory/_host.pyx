# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""HostRegion: one virtual range backed by many memfd chunks.

This is the host twin of a CUDA VMM reservation: ``mmap(PROT_NONE)``
reserves the range (``cuMemAddressReserve``), one ``memfd_create`` +
``ftruncate`` per chunk creates a physical handle (``cuMemCreate``), and
``mmap(MAP_FIXED|MAP_SHARED)`` maps each at its offset (``cuMemMap``).
Every multi-handle code path (extent resolution, one MR over many handles,
handle passing over IPC) therefore runs and is tested on CPU-only machines.
"""

import os
import stat
import threading
import warnings

from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release, PyBuffer_FillInfo
from libc.errno cimport errno
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport strerror
from posix.mman cimport (mmap, munmap, madvise, PROT_NONE, PROT_READ, PROT_WRITE, MAP_PRIVATE,
                         MAP_ANONYMOUS, MAP_SHARED, MAP_FIXED, MAP_FAILED)
from posix.fcntl cimport fcntl, F_DUPFD_CLOEXEC
from posix.unistd cimport close, ftruncate, sysconf, _SC_PAGESIZE

from tensorxfer._lib.includes.posix cimport (memfd_create, MFD_CLOEXEC, MFD_ALLOW_SEALING, MAP_NORESERVE,
                                             MAP_POPULATE, F_ADD_SEALS, F_GET_SEALS, F_SEAL_SHRINK, F_SEAL_GROW)
from tensorxfer.memory._extent cimport AllocationMap

from tensorxfer.errors import ExtentError, HandleError, RegionError

#: Seals every chunk memfd carries once sized: nobody holding the fd (this
#: process or an importer) can shrink it under a mapping, which would turn
#: the next read of the cut pages into SIGBUS, or grow it.  Writes stay allowed.
REQUIRED_SEALS = F_SEAL_SHRINK | F_SEAL_GROW

cdef size_t PAGE_SIZE = <size_t>sysconf(_SC_PAGESIZE)
cdef size_t HUGE_PAGE = 2 << 20         # x86-64 / arm64 (4 KiB pages) transparent huge page
cdef int MADV_POPULATE_WRITE = 23       # Linux 5.14+; older kernels answer EINVAL
cdef int MADV_HUGEPAGE_ = 14
cdef int EINVAL_ = 22

#: Threads that commit a new region's pages.  Committing shmem pages is
#: kernel work (allocate + zero each page) that scales with cores: measured
#: on the 2-core development VM, 2 GB took 3.6 s with one thread and 2.6 s
#: with two.
POPULATE_THREADS = max(1, min(8, os.cpu_count() or 1))

#: Default chunk size.  64 MiB keeps the handle count of a 31 GB region
#: (~480 memfds) well under common fd limits while still giving several
#: chunks to any region bigger than one; ``_default_chunk_size`` grows it so
#: that no region needs more than ``MAX_DEFAULT_CHUNKS`` chunks.
DEFAULT_CHUNK_SIZE = 64 << 20
MAX_DEFAULT_CHUNKS = 512


cdef int check_errno(int rc, const char* what) except -1 nogil:
    """Raise RegionError for a failed libc call; the GIL is taken only on failure."""
    cdef int err
    if rc == -1:
        err = errno
        with gil:
            raise RegionError(err, f"{what.decode()} failed: {strerror(err).decode()}")
    return 0


def check_handle(Py_ssize_t index, size_t size, int fd):
    """Refuse an fd that could fault under a mapping: not a regular file, short, or unsealed.

    Raises :class:`HandleError` naming ``index`` and what is missing.
    """
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise HandleError(f"handle {index}: fd {fd} cannot be inspected ({e.strerror}); pass an open memfd",
                          index) from None
    if not stat.S_ISREG(st.st_mode):
        raise HandleError(f"handle {index}: fd {fd} is not a memory file (mode {st.st_mode:#o}); only memfds "
                          f"from HostRegion.export_handles can be imported", index)
    if <size_t>st.st_size < size:
        raise HandleError(f"handle {index}: fd {fd} holds {st.st_size} bytes, less than its {size}-byte chunk; "
                          f"mapping it would fault (SIGBUS) on the missing pages", index)
    cdef int seals = fcntl(fd, F_GET_SEALS)
    if seals == -1:
        raise HandleError(f"handle {index}: fd {fd} cannot be sealed (not a memfd created with "
                          f"MFD_ALLOW_SEALING); its owner could truncate it under the mapping", index)
    missing = [name for bit, name in ((F_SEAL_SHRINK, "F_SEAL_SHRINK"), (F_SEAL_GROW, "F_SEAL_GROW"))
               if not seals & bit]
    if missing:
        raise HandleError(f"handle {index}: fd {fd} lacks {' and '.join(missing)}; its owner could resize it "
                          f"under the mapping (a shrink makes reads fault with SIGBUS). Seal it with "
                          f"fcntl(F_ADD_SEALS) or allocate with HostRegion.allocate", index)
    return 0


def page_size():
    """The system page size, which every host chunk is a multiple of."""
    return PAGE_SIZE


def _default_chunk_size(size_t size):
    cdef size_t chunk = DEFAULT_CHUNK_SIZE
    while size > chunk * MAX_DEFAULT_CHUNKS:
        chunk *= 2
    return chunk


cdef inline size_t _round_up(size_t n, size_t align) nogil:
    return (n + align - 1) // align * align


cdef struct Chunk:
    size_t offset
    size_t size
    int fd          # the memfd, -1 for adopted memory or an unmapped hole
    bint mapped


cdef class HostRegion(AllocationMap):
    """One contiguous virtual range of host memory backed by several handles.

    Create one with :meth:`allocate` (tensorxfer owns the memory) or
    :meth:`adopt` (the caller owns it).  The region supports the buffer
    protocol: ``memoryview(region)`` and ``numpy.frombuffer(region, ...)``
    give zero-copy, writable access.  :meth:`close` never refuses: it marks
    the region closed at once (no new views) and unmaps the memory when the
    last view is dropped, so no view can outlive the mapping.

    A view counts while it holds a buffer export.  ``torch.frombuffer`` does
    not (it releases the export at once and keeps only a reference), so a
    tensor made that way is not protected: use
    ``torch.from_dlpack(numpy.frombuffer(region, ...))``, or
    ``TensorRegion.tensors(framework="torch")``, which does.
    """
    cdef char* _base
    cdef Chunk* _chunks
    cdef Py_ssize_t _nchunks
    cdef bint _readonly
    cdef bint _has_view
    cdef bint _private          # anonymous memory of this process: no fds to pass
    cdef bint _files            # mapped from files (map_files): no fds to pass
    cdef Py_buffer _adopted     # export held on an adopted object until close()

    def __cinit__(self):
        self._base = NULL
        self._chunks = NULL
        self._nchunks = 0
        self._has_view = False
        self._private = False
        self._files = False

    # ---------------------------------------------------------------- factories
    @staticmethod
    def allocate(size, chunk_size=None, bint commit=True, bint private=False):
        """Reserve ``size`` bytes and back them with memfd chunks (or, ``private``, this process's own memory).

        Parameters
        ----------
        size : int
            Bytes wanted; rounded up to the page size.
        chunk_size : int, optional
            Bytes per chunk (rounded up to the page size).  Defaults to
            64 MiB, grown so that no region has more than 512 chunks.
        commit : bool
            Commit every page now (default: a receiver learns at once that
            the memory is there, and the copy into it does not fault page by
            page).  ``False`` leaves pages to be committed as they are first
            written: what adopting a model wants, so that memory grows only as
            fast as the tensors moving in free theirs.
        private : bool
            Back the chunks with anonymous memory of this process, on transparent huge pages where the
            system allows them (``madvise`` mode), instead of memfds: filling and freeing gigabytes cost a
            fraction (measured on the H200 machine, 2 GB: filled from the page cache 0.8 s vs 1.8 s, freed
            in 5 ms vs 0.35 s).  Such a region has no handles to pass to another process
            (:meth:`export_handles` refuses, so ipc cannot send it); tcp and rdma send it as any other.

        Returns
        -------
        HostRegion
            Owned by the caller; release it with :meth:`close` (or ``with``).

        Raises
        ------
        ValueError
            ``size`` or ``chunk_size`` is not positive.
        RegionError
            A system call failed (``errno`` says which).  Nothing stays
            allocated: every fd and mapping made so far is released.
        """
        size = int(size)
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        size = _round_up(size, PAGE_SIZE)
        if chunk_size is None:
            chunk_size = _default_chunk_size(size)
        chunk_size = int(chunk_size)
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        chunk_size = _round_up(chunk_size, PAGE_SIZE)
        sizes = [chunk_size] * (size // chunk_size)
        if size % chunk_size:
            sizes.append(size % chunk_size)
        return HostRegion._from_chunks(sizes, commit=commit, private=private)

    @staticmethod
    def _from_chunks(sizes, size_t unmapped_tail=0, holes=(), bint commit=True, bint private=False):
        """Build a region from explicit chunk sizes (page multiples).

        ``unmapped_tail`` reserves that many extra bytes past the last chunk
        without mapping them, and the chunk indexes in ``holes`` are
        reserved but left unmapped: the shapes a VMM reservation can have,
        used by tests to prove extents never widen into unmapped memory.
        """
        cdef HostRegion self = HostRegion.__new__(HostRegion)
        cdef size_t total = 0, s
        sizes = [int(x) for x in sizes]
        if not sizes:
            raise ValueError("a region needs at least one chunk")
        for x in sizes:
            if x <= 0 or x % PAGE_SIZE:
                raise ValueError(f"chunk sizes must be positive multiples of {PAGE_SIZE}, got {x}")
            total += x
        if unmapped_tail % PAGE_SIZE:
            raise ValueError(f"unmapped_tail must be a multiple of {PAGE_SIZE}")
        hole_set = frozenset(int(h) for h in holes)
        self._owner = True
        self._closed = False
        self._private = private
        try:
            self._map_all(sizes, total, unmapped_tail, hole_set, None, True, commit)
        except BaseException:
            self._release()
            raise
        return self

    @classmethod
    def import_handles(cls, handles, bint writable=False, bint populate=True, bint copy_on_write=False):
        """Map another process's chunk memfds contiguously, for IPC.

        Every fd is checked before anything is mapped: a regular file (a memfd)
        at least as long as its chunk, sealed ``F_SEAL_SHRINK | F_SEAL_GROW``
        (:meth:`allocate`'s), so no truncation under the mapping (SIGBUS).

        Parameters
        ----------
        handles : iterable of (size, fd)
            Chunk sizes (page multiples) and their fds, e.g. from
            :meth:`export_handles` on the other side, received over a Unix
            socket with SCM_RIGHTS, each mapped at the next offset.  The fds
            stay the caller's (the mappings keep the memory alive).
        writable : bool
            ``PROT_READ|PROT_WRITE`` instead of ``PROT_READ`` (read-only: its
            buffers are read-only, a stray write faults).
        populate : bool
            ``MAP_POPULATE``: build the page tables now, in one pass, rather
            than one fault per page during the first read.
        copy_on_write : bool
            ``MAP_PRIVATE`` with write permission (exported buffers stay
            read-only): a write through a raw pointer copies its page here.

        Returns
        -------
        HostRegion
            Owns the mappings (not the fds); :meth:`close` unmaps them.  The
            memory is the other process's: its later writes are visible.
            It has no fds of its own, so it cannot export handles again.

        Raises
        ------
        ValueError
            An empty list, a size that is not a positive page multiple, or
            a negative fd.
        HandleError
            An fd is not a regular file, is shorter than its chunk, or lacks
            a seal; ``err.index`` names the handle.  Nothing was mapped.
        RegionError
            A mapping failed; nothing stays mapped.
        """
        cdef HostRegion self = HostRegion.__new__(HostRegion)
        cdef size_t total = 0
        handles = [(int(s), int(fd)) for s, fd in handles]
        if not handles:
            raise ValueError("import_handles needs at least one (size, fd)")
        for s, fd in handles:
            if s <= 0 or s % PAGE_SIZE:
                raise ValueError(f"chunk sizes must be positive multiples of {PAGE_SIZE}, got {s}")
            if fd < 0:
                raise ValueError(f"invalid fd {fd}")
            total += s
        for i, (s, fd) in enumerate(handles):
            check_handle(i, s, fd)
        self._owner = True
        self._closed = False
        self._readonly = not writable
        try:
            self._map_all([s for s, _ in handles], total, 0, frozenset(), [fd for _, fd in handles],
                          writable, populate, copy_on_write)
        except BaseException:
            self._release()
            raise
        return self

    @staticmethod
    def map_files(files, size, bint writable=False, bint populate=False):
        """One region whose memory is regular files, each mapped ``MAP_SHARED`` at its offset, zero pages between.

        A sender's region can then be the files it sends (``tensorxfer-send`` over tcp): no copy in memory.
        ``files``: ``(offset, length, fd)`` in increasing offset order, each offset a page multiple past the
        previous file's pages; the first ``length`` bytes of ``fd`` are mapped there (the rest of the last
        page reads zero, and writes to it reach no file).  The fds stay the caller's.  ``size``: the region's
        bytes (rounded up to a page), holding every file's pages.  ``writable``: writes go to the files, and
        the caller must have allocated their blocks (``fallocate``: a write the disk has no room for faults
        with SIGBUS); else the region is read-only.  ``populate``: ``MAP_POPULATE`` (cached pages map in one
        pass).  The region owns the mappings and has no memory handles to pass: over ipc a sender passes the
        files themselves instead (``transport/ipc/sourcefiles.py``).

        Raises ValueError (no files, misplaced or overlapping files, a file past ``size``), HandleError (an
        fd that is not a regular file or holds fewer than ``length`` bytes: its pages past the end would
        fault; ``err.index`` names it; nothing mapped) or RegionError (a mapping failed, e.g. ``EACCES`` for a
        writable mapping of an fd not open for writing; nothing stays mapped).
        """
        cdef HostRegion self = HostRegion.__new__(HostRegion)
        files = [(int(o), int(n), int(fd)) for o, n, fd in files]
        size = _round_up(int(size), PAGE_SIZE) if int(size) > 0 else 0
        if not files:
            raise ValueError("map_files needs at least one (offset, length, fd)")
        sizes, fds, end = [], [], 0
        for i, (offset, length, fd) in enumerate(files):
            if offset % PAGE_SIZE or offset < end:
                raise ValueError(f"file {i}: offset {offset} must be a multiple of {PAGE_SIZE} past the previous "
                                 f"file's pages (which end at {end})")
            if length <= 0 or fd < 0:
                raise ValueError(f"file {i}: length {length} and fd {fd} must be positive")
            if offset > end:        # zero pages between files
                sizes, fds = sizes + [offset - end], fds + [-1]
            end = offset + _round_up(length, PAGE_SIZE)
            if end > size:
                raise ValueError(f"file {i}: its pages end at {end}, past the region's {size} bytes")
            sizes.append(end - offset)
            fds.append(fd)
        if end < size:
            sizes.append(size - end)
            fds.append(-1)
        for i, (_, length, fd) in enumerate(files):
            try:
                st = os.fstat(fd)
            except OSError as e:
                raise HandleError(f"file {i}: fd {fd} cannot be inspected ({e.strerror})", i) from None
            if not stat.S_ISREG(st.st_mode):
                raise HandleError(f"file {i}: fd {fd} is not a regular file (mode {st.st_mode:#o})", i)
            if st.st_size < length:
                raise HandleError(f"file {i}: fd {fd} holds {st.st_size} bytes, less than the {length} to map; "
                                  f"reading the pages past its end would fault (SIGBUS)", i)
        self._owner = True
        self._closed = False
        self._files = True
        self._readonly = not writable
        try:
            self._map_all(sizes, size, 0, frozenset(), fds, writable, populate)
        except BaseException:
            self._release()
            raise
        return self

    @classmethod
    def import_fds(cls, handles, bint writable=False, bint populate=True):
        """Alias of :meth:`import_handles`, kept for callers written before it."""
        return cls.import_handles(handles, writable, populate)

    cdef _map_all(self, list sizes, size_t total, size_t tail, frozenset holes, list import_fds=None,
                  bint writable=True, bint populate=True, bint copy_on_write=False):
        cdef void* p
        cdef size_t off = 0
        cdef Py_ssize_t i, n = len(sizes)
        cdef Chunk* c
        cdef int prot = PROT_READ | PROT_WRITE if writable or copy_on_write else PROT_READ
        # copy-on-write: never populated (that copies every page), no commit charge (31 GB refused on 24 GB)
        cdef int flags = ((MAP_PRIVATE | MAP_NORESERVE if copy_on_write else MAP_SHARED) | MAP_FIXED
                          | (MAP_POPULATE if populate and not copy_on_write else 0))
        self._chunks = <Chunk*>calloc(n, sizeof(Chunk))
        if self._chunks == NULL:
            raise MemoryError()
        # MAP_NORESERVE: the reservation itself commits no memory, like
        # cuMemAddressReserve; only mapped chunks are backed.
        cdef size_t slack = HUGE_PAGE - PAGE_SIZE if self._private else 0
        cdef size_t head
        p = mmap(NULL, total + tail + slack, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if p == MAP_FAILED:
            check_errno(-1, b"mmap(PROT_NONE) reserving the region")
        if slack:
            # huge pages back only 2 MiB-aligned stretches: start the region on one, give the rest back
            head = _round_up(<size_t>p, HUGE_PAGE) - <size_t>p
            if head:
                munmap(p, head)
            if slack - head:
                munmap(<char*>p + head + total + tail, slack - head)
            p = <char*>p + head
        self._base = <char*>p
        self._va_base = <uintptr_t>p
        self._va_size = total + tail
        self._size = total
        for i in range(n):
            c = &self._chunks[i]
            c.offset = off
            c.size = sizes[i]
            c.fd = -1
            c.mapped = False
            self._nchunks = i + 1           # _release() sees every chunk begun
            off += c.size
            if i in holes:
                continue
            if import_fds is not None and import_fds[i] >= 0:
                # the caller keeps the fd; the mapping holds its own reference to the memory
                p = mmap(self._base + c.offset, c.size, prot, flags, <int>import_fds[i], 0)
                if p == MAP_FAILED:
                    check_errno(-1, b"mmap(MAP_FIXED) of an imported chunk fd")
                c.mapped = True
                continue
            if self._private or import_fds is not None:    # between mapped files: zero pages
                p = mmap(self._base + c.offset, c.size, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                if p == MAP_FAILED:
                    check_errno(-1, b"mmap(MAP_FIXED) of a private chunk")
                if self._private:
                    madvise(p, c.size, MADV_HUGEPAGE_)    # a hint: where the system allows no huge pages, 4 KiB
                c.mapped = True
                continue
            c.fd = memfd_create(b"tensorxfer", MFD_CLOEXEC | MFD_ALLOW_SEALING)
            check_errno(c.fd, b"memfd_create")
            check_errno(ftruncate(c.fd, c.size), b"ftruncate(memfd)")
            check_errno(fcntl(c.fd, F_ADD_SEALS, <int>REQUIRED_SEALS), b"fcntl(F_ADD_SEALS) sealing a chunk memfd")
            p = mmap(self._base + c.offset, c.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, c.fd, 0)
            if p == MAP_FAILED:
                check_errno(-1, b"mmap(MAP_FIXED) of a chunk")
            c.mapped = True
        if import_fds is None and populate:
            self._populate()     # imported chunks are the other process's pages: map, never commit

    cdef _populate(self):
        """Commit every chunk's pages now, as cuMemCreate does, in parallel threads.

        Later copies into the region then pay no page fault per page.
        """
        cdef Py_ssize_t n = self._nchunks
        threads = min(POPULATE_THREADS, n)
        if threads <= 1:
            self._populate_chunks(0, n, 1)
            return
        errors = []

        def work(start):
            try:
                self._populate_chunks(start, n, threads)
            except BaseException as e:
                errors.append(e)

        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]

    def _populate_chunks(self, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t step):
        cdef Py_ssize_t i
        cdef size_t off
        cdef int rc = 0
        cdef Chunk* c
        with nogil:
            i = start
            while i < stop:
                c = &self._chunks[i]
                if c.mapped:
                    rc = madvise(self._base + c.offset, c.size, MADV_POPULATE_WRITE)
                    if rc == -1 and errno == EINVAL_:
                        # an older kernel: touch one byte per page (the memory
                        # is zero, so writing zero changes nothing)
                        off = 0
                        while off < c.size:
                            (<volatile char*>(self._base + c.offset + off))[0] = 0
                            off += PAGE_SIZE
                        rc = 0
                    check_errno(rc, b"madvise(MADV_POPULATE_WRITE) committing a chunk")
                i += step

    @staticmethod
    def adopt(obj, bint writable=True):
        """Wrap memory tensorxfer did not allocate, without copying or owning it.

        ``obj`` is any object with the buffer protocol (a bytearray, a numpy
        array, an ``mmap``, a CPU tensor's numpy view).  The region holds a
        buffer export on ``obj`` until :meth:`close`, so ``obj`` cannot be
        resized meanwhile; tensorxfer never frees adopted memory.  The caller
        keeps ``obj`` alive and must not free it by other means (for example
        ``mmap.close()`` fails while the export is held).

        Raises
        ------
        BufferError / TypeError
            ``obj`` does not export a contiguous (writable, if asked) buffer.
        """
        cdef HostRegion self = HostRegion.__new__(HostRegion)
        flags = PyBUF_WRITABLE if writable else PyBUF_SIMPLE
        PyObject_GetBuffer(obj, &self._adopted, flags)
        self._has_view = True
        self._closed = False
        self._owner = False
        self._readonly = self._adopted.readonly
        if self._adopted.len == 0:
            self._release()
            raise ValueError("cannot adopt an empty buffer")
        self._chunks = <Chunk*>calloc(1, sizeof(Chunk))
        if self._chunks == NULL:
            self._release()
            raise MemoryError()
        self._nchunks = 1
        self._chunks[0].offset = 0
        self._chunks[0].size = self._adopted.len
        self._chunks[0].fd = -1
        self._chunks[0].mapped = True
        self._base = <char*>self._adopted.buf
        self._va_base = <uintptr_t>self._adopted.buf
        self._va_size = self._adopted.len
        self._size = self._adopted.len
        return self

    # ---------------------------------------------------------------- lifetime
    cdef void _release(self) noexcept:
        cdef Py_ssize_t i
        if self._chunks != NULL:
            for i in range(self._nchunks):
                if self._chunks[i].fd >= 0:
                    close(self._chunks[i].fd)
                    self._chunks[i].fd = -1
            free(self._chunks)
            self._chunks = NULL
        if self._owner and self._base != NULL:
            # one munmap over the reservation removes every chunk mapping too
            munmap(self._base, self._va_size)
        self._base = NULL
        if self._has_view:
            PyBuffer_Release(&self._adopted)
            self._has_view = False
        self._nchunks = 0
        self._size = 0
        self._va_size = 0
        self._closed = True

    def __dealloc__(self):
        if not self._closed:
            try:
                warnings.warn(f"unclosed HostRegion of {self._size} bytes; call close() or use "
                              f"'with'", ResourceWarning)
            except BaseException:
                pass
        self._release()          # idempotent; views hold a reference, so none can be alive here

    # ---------------------------------------------------------------- queries
    cdef int lookup(self, uintptr_t addr, uintptr_t* base, size_t* size) except -1 nogil:
        cdef Py_ssize_t lo = 0, hi = self._nchunks - 1, mid
        cdef size_t off
        if addr < self._va_base or addr - self._va_base >= self._size:
            return 0
        off = addr - self._va_base
        while lo < hi:                   # last chunk whose offset <= off
            mid = (lo + hi + 1) // 2
            if self._chunks[mid].offset <= off:
                lo = mid
            else:
                hi = mid - 1
        if not self._chunks[lo].mapped:
            return 0
        base[0] = self._va_base + self._chunks[lo].offset
        size[0] = self._chunks[lo].size
        return 1

    @property
    def readonly(self):
        return self._readonly

    @property
    def private(self):
        """Whether the memory is this process's own anonymous memory (no handles to pass; see :meth:`allocate`)."""
        return self._private

    @property
    def device(self):
        return "cpu"

    @property
    def chunks(self):
        """``(offset, size, fd)`` per chunk, for diagnostics; same shape on ``CudaRegion``.

        ``fd`` is the region's own descriptor for the chunk, *borrowed*: do
        not close it, and do not use it after :meth:`close`.  It is -1 where
        the region holds none (adopted memory, holes, imported chunks).  To
        pass chunks to another process use :meth:`export_handles`, which
        returns fds the caller owns.
        """
        self._check_open()
        return [(self._chunks[i].offset, self._chunks[i].size, self._chunks[i].fd)
                for i in range(self._nchunks)]

    def export_handles(self):
        """One fresh fd per chunk, for another process to :meth:`import_handles`.

        Returns
        -------
        list of (offset, size, fd)
            In chunk order.  Each fd is a new ``F_DUPFD_CLOEXEC`` duplicate
            of the chunk's sealed memfd, owned by the caller: close it (after
            sending it) with ``os.close``.  It keeps the chunk's memory alive
            on its own, even after :meth:`close`.

        Raises
        ------
        RegionClosed
            The region is closed.
        RegionError
            The memory is adopted or imported (the region holds no fds), or
            ``fcntl`` failed; every fd duplicated so far is closed.
        ExtentError
            A chunk is unmapped (a hole).
        """
        cdef Py_ssize_t i
        cdef int fd
        self._check_open()
        if not self._owner or self._nchunks == 0:
            raise RegionError("only regions tensorxfer allocated have handles to export (this one adopted its "
                              "memory); use HostRegion.allocate or TensorRegion.from_tensors")
        if self._files:
            raise RegionError("this region's memory is files mapped into it (HostRegion.map_files): it has no "
                              "handles to pass; send it over tcp, or read the files into an allocated region "
                              "for ipc")
        if self._private:
            raise RegionError("this region's memory is private to its process (allocated with private=True): it "
                              "has no handles to pass; allocate it shareable (private=False) to send it over ipc")
        out = []
        try:
            for i in range(self._nchunks):
                if not self._chunks[i].mapped:
                    raise ExtentError(f"chunk {i} is not mapped", self._va_base + self._chunks[i].offset)
                if self._chunks[i].fd < 0:
                    raise RegionError(f"chunk {i} has no fd to export (an imported region cannot export "
                                      f"its handles again)")
                fd = fcntl(self._chunks[i].fd, F_DUPFD_CLOEXEC, 0)
                check_errno(fd, b"fcntl(F_DUPFD_CLOEXEC) exporting a chunk fd")
                out.append((self._chunks[i].offset, self._chunks[i].size, fd))
        except BaseException:
            for _, _, fd in out:
                close(fd)
            raise
        return out

    def __repr__(self):
        if self._closed:
            return "<HostRegion closed>"
        kind = ("files" if self._files else "private" if self._private else "owned") if self._owner else "adopted"
        return (f"<HostRegion {kind} {self._size} bytes at {<uintptr_t>self._base:#x}, "
                f"{self._nchunks} chunk(s)>")

    # ---------------------------------------------------------------- buffer
    def __getbuffer__(self, Py_buffer* buffer, int flags):
        self._check_open()
        if self._size == 0:
            raise BufferError("region has no mapped bytes")
        PyBuffer_FillInfo(buffer, self, self._base, self._size, self._readonly, flags)
        self._exports += 1

    def __releasebuffer__(self, Py_buffer* buffer):
        self._view_released()

    # ---------------------------------------------------------------- test hooks
    def _unmap_chunk(self, Py_ssize_t index):
        """Unmap one chunk, leaving a PROT_NONE hole (what ``cuMemUnmap`` does).

        For tests and diagnostics of extent resolution; views over the hole
        would fault, so this refuses while views exist.
        """
        cdef void* p
        cdef Chunk* c
        self._check_open()
        if not self._owner:
            raise ValueError("cannot unmap chunks of adopted memory")
        if self._exports:
            raise BufferError("cannot unmap a chunk while views of the region exist")
        if index < 0 or index >= self._nchunks:
            raise IndexError(index)
        c = &self._chunks[index]
        if not c.mapped:
            return
        p = mmap(self._base + c.offset, c.size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        if p == MAP_FAILED:
            check_errno(-1, b"mmap(PROT_NONE) over a chunk")
        close(c.fd)
        c.fd = -1
        c.mapped = False
