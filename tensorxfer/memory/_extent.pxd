from libc.stdint cimport uintptr_t


cdef class AllocationMap:
    """A virtual range backed by several physical allocations (handles).

    Subclasses answer one question, in ``lookup``: which mapped allocation
    holds this address.  Everything else about extents is written once, here.
    """
    cdef uintptr_t _va_base   # start of the whole reservation
    cdef size_t _va_size      # whole reservation, unmapped parts included

    # 1: mapped, *base/*size set to the allocation holding addr
    # 0: addr is not mapped (hole, unmapped tail, or outside the reservation)
    cdef int lookup(self, uintptr_t addr, uintptr_t* base, size_t* size) except -1 nogil
    cdef int _check_open(self) except -1
