# Declarations from Linux/glibc headers that Cython's own posix/*.pxd lack.
from libc.stdint cimport uint32_t

# _GNU_SOURCE is defined by Python.h (pyconfig.h), which exposes memfd_create.

cdef extern from "<sys/mman.h>" nogil:
    int memfd_create(const char* name, unsigned int flags)
    enum:
        MFD_CLOEXEC
        MAP_NORESERVE
        MAP_POPULATE
        MAP_FIXED_NOREPLACE

cdef extern from "<arpa/inet.h>" nogil:
    uint32_t htonl(uint32_t hostlong)
    uint32_t ntohl(uint32_t netlong)
