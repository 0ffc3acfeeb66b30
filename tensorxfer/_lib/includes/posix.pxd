# Declarations from Linux/glibc headers that Cython's own posix/*.pxd lack.
# _GNU_SOURCE is defined by Python.h (pyconfig.h), which exposes memfd_create.

cdef extern from "<sys/mman.h>" nogil:
    int memfd_create(const char* name, unsigned int flags)
    enum:
        MFD_CLOEXEC
        MAP_NORESERVE
        MAP_POPULATE
        MAP_FIXED_NOREPLACE
