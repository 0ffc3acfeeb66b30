from libc.stdint cimport uintptr_t


cdef class AllocationMap:
    """A virtual range backed by several physical allocations (handles).

    The base of every region.  Subclasses answer ``lookup`` (which mapped
    allocation holds this address) and ``_release`` (free everything, never
    raise).  Extent resolution and the lifetime protocol (``close`` with
    views alive, ``defer``, ``with``) are written once, here.
    """
    cdef uintptr_t _va_base   # start of the whole reservation
    cdef size_t _va_size      # whole reservation, unmapped parts included
    cdef size_t _size         # usable bytes from _va_base (mapped chunks, holes aside)
    cdef bint _owner          # tensorxfer allocated (or imported) it and frees it
    cdef bint _closed
    cdef Py_ssize_t _exports        # live views (buffer exports, device views)
    cdef bint _close_pending        # closed while views were alive: _release() when the last goes

    cdef void _release(self) noexcept
    cdef int _view_released(self) except -1

    # 1: mapped, *base/*size set to the allocation holding addr
    # 0: addr is not mapped (hole, unmapped tail, or outside the reservation)
    cdef int lookup(self, uintptr_t addr, uintptr_t* base, size_t* size) except -1 nogil
    cdef int _check_open(self) except -1
