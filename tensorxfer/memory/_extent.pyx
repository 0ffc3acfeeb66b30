# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Extent resolution: which physical allocations cover a byte range.

``cuMemGetAddressRange`` answers only for the allocation (handle) that holds
one address.  A region built from many handles therefore needs a *walk*: ask
for the allocation at the start of the request, jump to its end, ask again,
until the request is covered.  UCX asked once and registered an MR over the
first handle only; every RDMA write crossing into the second handle then
failed with ``IBV_WC_LOC_PROT_ERR``.

The rules this module enforces, whatever the memory kind:

- never shrink: the registration extent always covers the whole request;
- ``whole_alloc=True`` widens to the bounds of the first and last covering
  allocations, which are mapped by construction, and never into an unmapped
  part of the reservation (``CU_POINTER_ATTRIBUTE_RANGE_SIZE`` would);
- a hole, or a request past the end of the reservation, is an
  :class:`~tensorxfer.errors.ExtentError` naming the offending address.
"""

from libc.stdint cimport uintptr_t
from libc.stdlib cimport malloc, realloc, free

from tensorxfer.errors import ExtentError, RegionClosed


cdef class Extent:
    """The answer of :meth:`AllocationMap.resolve_extent`.

    Attributes
    ----------
    ptr, length : int
        The registration extent (absolute address and byte length).  It
        always covers the request.
    offset : int
        ``ptr`` relative to the start of the region.
    request_ptr, request_length : int
        What was asked for.
    segments : tuple of (base, size)
        The covering allocations in address order, each mapped, each
        starting where the previous one ends.
    """
    cdef readonly object ptr
    cdef readonly object length
    cdef readonly object offset
    cdef readonly object request_ptr
    cdef readonly object request_length
    cdef readonly tuple segments

    def __repr__(self):
        return (f"Extent(ptr={self.ptr:#x}, length={self.length}, offset={self.offset}, "
                f"segments={len(self.segments)})")

    def covers(self, ptr, length):
        """True if ``[ptr, ptr+length)`` lies inside this extent."""
        return self.ptr <= ptr and ptr + length <= self.ptr + self.length


cdef struct Segment:
    uintptr_t base
    size_t size


cdef class AllocationMap:
    def __cinit__(self):
        self._closed = True
        self._exports = 0
        self._close_pending = False

    cdef int lookup(self, uintptr_t addr, uintptr_t* base, size_t* size) except -1 nogil:
        return 0

    cdef int _check_open(self) except -1:
        if self._closed:
            raise RegionClosed(f"this {type(self).__name__} is closed: it hands out no new views, pointers or "
                               f"handles (views taken before close() stay valid until dropped)")
        return 0

    cdef void _release(self) noexcept:
        self._closed = True

    cdef int _view_released(self) except -1:
        self._exports -= 1
        if self._exports == 0 and self._close_pending:
            self._close_pending = False
            self._release()
        return 0

    def close(self, defer=None):
        """Close the region; never raises because views are alive; idempotent.

        The region is closed at once: it hands out no new views, pointers or
        handles.  Its memory is released now if no view of it remains
        (memoryviews, numpy arrays, tensors, device views, an MR's buffer
        export), otherwise when the last one is dropped, so no view ever
        outlives the memory under it.

        Parameters
        ----------
        defer : object, optional
            Ignored; accepted for compatibility (releasing after the last
            view is now what every close does).
        """
        if self._closed:
            return
        self._closed = True
        if self._exports:
            self._close_pending = True
        else:
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    @property
    def closed(self):
        """True once :meth:`close` was called (the memory may still wait for views to go)."""
        return self._closed

    @property
    def released(self):
        """True once the memory itself is gone: closed and no view left."""
        return self._closed and not self._close_pending

    @property
    def views(self):
        """How many views (buffer exports, device views) of the region are alive."""
        return self._exports

    @property
    def ptr(self):
        """Address of the first byte."""
        self._check_open()
        return self._va_base

    @property
    def size(self):
        """Usable bytes (the reservation may extend past them, unmapped)."""
        return self._size

    @property
    def reserved_size(self):
        """Bytes reserved, unmapped tail included."""
        return self._va_size

    @property
    def owner(self):
        """True if tensorxfer allocated this memory (False for adopted memory)."""
        return self._owner

    def __len__(self):
        return self._size

    def allocation_at(self, size_t offset):
        """The one allocation holding ``base + offset`` as ``(base, size)``, or None.

        This is the single answer ``cuMemGetAddressRange`` gives; it is here
        for diagnostics and tests.  Never register from it alone: use
        :meth:`resolve_extent`.
        """
        cdef uintptr_t base = 0
        cdef size_t size = 0
        self._check_open()
        if offset >= self._va_size:
            return None
        if self.lookup(self._va_base + offset, &base, &size) == 0:
            return None
        return (base, size)

    def resolve_extent(self, size_t offset, size_t length, bint whole_alloc=False):
        """Resolve ``[offset, offset+length)`` of this region to mapped allocations.

        Parameters
        ----------
        offset, length : int
            The byte range, relative to the region's start.  ``length`` must
            be positive.
        whole_alloc : bool
            Widen the extent to the bounds of the first and last covering
            allocations (never into unmapped reservation).

        Returns
        -------
        Extent

        Raises
        ------
        ExtentError
            The range is empty, runs past the end of the region, or crosses
            a hole; ``err.address`` names the first unusable address.
        """
        self._check_open()
        cdef uintptr_t va = self._va_base
        if length == 0:
            raise ExtentError(f"empty extent requested at offset {offset}: pass a positive length",
                              va + offset)
        if offset > self._va_size or length > self._va_size - offset:
            raise ExtentError(
                f"range [{offset}, {offset + length}) runs past the end of the region "
                f"({self._va_size} bytes, address {va + self._va_size:#x}); "
                f"request a range inside the region", va + self._va_size)

        cdef uintptr_t start = va + offset
        cdef uintptr_t end = start + length
        cdef uintptr_t addr = start
        cdef uintptr_t base = 0
        cdef size_t size = 0
        cdef size_t n = 0, cap = 16
        cdef int found = 1
        cdef Segment* segs = <Segment*>malloc(cap * sizeof(Segment))
        cdef Segment* grown
        cdef Extent result
        if segs == NULL:
            raise MemoryError()
        try:
            with nogil:
                while addr < end:
                    found = self.lookup(addr, &base, &size)
                    if found == 0 or not (base <= addr and addr - base < size):
                        found = 0
                        break
                    if n == cap:
                        cap *= 2
                        grown = <Segment*>realloc(segs, cap * sizeof(Segment))
                        if grown == NULL:
                            break
                        segs = grown
                    segs[n].base = base
                    segs[n].size = size
                    n += 1
                    addr = base + size
            if found == 0:
                raise ExtentError(
                    f"hole at address {addr:#x} (offset {addr - va} of the region): range "
                    f"[{offset}, {offset + length}) is not fully mapped; the mapped part ends "
                    f"there. Map that part first, or request a range that stops before it",
                    addr)
            if addr < end:
                raise MemoryError("out of memory while resolving an extent")
            result = Extent.__new__(Extent)
            if whole_alloc:
                result.ptr = segs[0].base
                result.length = segs[n - 1].base + segs[n - 1].size - segs[0].base
            else:
                result.ptr = start
                result.length = length
            result.offset = result.ptr - va
            result.request_ptr = start
            result.request_length = length
            result.segments = tuple([(segs[i].base, segs[i].size) for i in range(n)])
            return result
        finally:
            free(segs)
