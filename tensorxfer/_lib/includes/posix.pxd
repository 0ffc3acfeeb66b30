# Declarations from Linux/glibc headers that Cython's own posix/*.pxd lack.
from libc.stdint cimport uint32_t

# _GNU_SOURCE is defined by Python.h (pyconfig.h), which exposes memfd_create.

cdef extern from "<sys/mman.h>" nogil:
    int memfd_create(const char* name, unsigned int flags)
    enum:
        MFD_CLOEXEC
        MFD_ALLOW_SEALING
        MAP_NORESERVE
        MAP_POPULATE
        MAP_FIXED_NOREPLACE

cdef extern from "<arpa/inet.h>" nogil:
    uint32_t htonl(uint32_t hostlong)
    uint32_t ntohl(uint32_t netlong)

cdef extern from "<fcntl.h>" nogil:
    # memfd seals (Linux 3.17+): a sealed chunk can be neither shrunk nor
    # grown, so a peer that imports it can never fault on a truncated page.
    enum:
        F_ADD_SEALS
        F_GET_SEALS
        F_SEAL_SHRINK
        F_SEAL_GROW

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    enum:
        POLLIN
    int poll(pollfd* fds, unsigned long nfds, int timeout)
