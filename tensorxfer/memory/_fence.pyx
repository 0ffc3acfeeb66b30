# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fence: one 64-bit word in a sealed memfd page that two processes map, changed only by atomic operations.

A copy lane's follower owns the page (:meth:`Fence.create`) and passes its fd to the copy host once; the host maps
it (:meth:`Fence.open`).  The word is ``(seq << 2) | state`` and says who may write into the follower's memory for
step ``seq`` (the protocol, and why, is in :mod:`tensorxfer.transport.ipc.delegate`):

- the follower **grants** a step before asking for it (a plain store: the host only reads grants);
- the host **takes** it (compare-and-swap granted -> running) before it touches a byte, and **finishes** it
  (a store: done, or revoked when its copy failed) once no byte of it can still be written;
- the follower **revokes** a step it stopped waiting for (compare-and-swap granted -> revoked): either the swap
  wins (the host never will take it) or it reads what the host did.

The atomics are inline C (``_fence.pxd``), the same ones ``StridedCopy.serve_lane`` runs without the GIL.  The
page is sealed against shrinking and growing, so neither process can make the other's access fault (SIGBUS).
"""

import os
import warnings

from libc.errno cimport errno
from libc.stdint cimport uint64_t, uintptr_t
from libc.string cimport strerror
from posix.fcntl cimport fcntl
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED
from posix.unistd cimport close, ftruncate, sysconf, _SC_PAGESIZE

from tensorxfer._lib.includes.posix cimport (memfd_create, MFD_CLOEXEC, MFD_ALLOW_SEALING, F_ADD_SEALS,
                                             F_SEAL_SHRINK, F_SEAL_GROW)
from tensorxfer.memory._fence cimport (TX_FENCE_REVOKED, TX_FENCE_GRANTED, TX_FENCE_RUNNING, TX_FENCE_DONE,
                                       tx_fence_word, tx_fence_load, tx_fence_store, tx_fence_cas, tx_fence_take)

from tensorxfer.errors import ProtocolError, RegionError
from tensorxfer.memory._host import check_handle

#: The states of a step in the fence word (``word & 3``).
REVOKED = TX_FENCE_REVOKED
GRANTED = TX_FENCE_GRANTED
RUNNING = TX_FENCE_RUNNING
DONE = TX_FENCE_DONE
STATE_NAMES = {REVOKED: "revoked", GRANTED: "granted", RUNNING: "running", DONE: "done"}

cdef size_t PAGE = <size_t>sysconf(_SC_PAGESIZE)
cdef int F_SEAL_SEAL_ = 0x0001      # no more seals: neither end can seal the page against the other's writes


cdef int _fail(const char* what) except -1:
    cdef int err = errno
    raise RegionError(err, f"fence: {what.decode()} failed: {strerror(err).decode()}")


def word(uint64_t seq, unsigned int state):
    """The fence word for step ``seq`` (its low 62 bits) in ``state``."""
    return tx_fence_word(seq, state)


cdef class Fence:
    """A mapped fence page (see the module docstring).  One owner; ``close()`` is idempotent; a Fence that is
    never closed is released (with a ResourceWarning) when collected."""
    cdef uint64_t* _word
    cdef int _fd            # the page's memfd where this process made it (create), else -1
    cdef bint _closed

    def __cinit__(self):
        self._word = NULL
        self._fd = -1
        self._closed = True

    @staticmethod
    def create():
        """A new zeroed page (a sealed memfd, mapped here): the follower's.  Its word starts as step 0, revoked:
        nothing is granted.

        Raises
        ------
        RegionError
            A system call failed; nothing stays open.
        """
        cdef Fence self = Fence.__new__(Fence)
        cdef void* p
        self._closed = False
        try:
            self._fd = memfd_create(b"tensorxfer-fence", MFD_CLOEXEC | MFD_ALLOW_SEALING)
            if self._fd < 0:
                _fail(b"memfd_create")
            if ftruncate(self._fd, PAGE) != 0:
                _fail(b"ftruncate")
            if fcntl(self._fd, F_ADD_SEALS, <int>(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL_)) != 0:
                _fail(b"fcntl(F_ADD_SEALS)")
            p = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, self._fd, 0)
            if p == MAP_FAILED:
                _fail(b"mmap")
            self._word = <uint64_t*>p
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def open(int fd):
        """Map a peer's fence page from ``fd`` (the fd stays the caller's): the copy host's view of it.

        Raises
        ------
        HandleError
            ``fd`` is not a sealed memory file of at least a page (the peer could truncate it under the mapping).
        RegionError
            The mapping failed.
        """
        cdef Fence self = Fence.__new__(Fence)
        cdef void* p
        check_handle(0, PAGE, fd)
        p = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            _fail(b"mmap of a peer's fence page")
        self._word = <uint64_t*>p
        self._closed = False
        return self

    cdef uint64_t* _live(self) except NULL:
        if self._closed:
            raise ValueError("operation on a closed Fence")
        return self._word

    @property
    def fd(self):
        """The page's memfd (this process made it), borrowed: pass it, do not close it; -1 for a peer's page."""
        self._live()
        return self._fd

    @property
    def address(self):
        """The word's address, for a nogil loop (``StridedCopy.serve_lane``); valid until :meth:`close`."""
        return <uintptr_t>self._live()

    @property
    def closed(self):
        return self._closed

    def load(self):
        """The word as it is now."""
        return tx_fence_load(self._live())

    def grant(self, uint64_t seq):
        """The follower grants step ``seq`` (before it asks the host for it)."""
        tx_fence_store(self._live(), tx_fence_word(seq, TX_FENCE_GRANTED))

    def take(self, uint64_t seq):
        """The host takes step ``seq`` (granted -> running); False: it was not granted (the follower gave it up):
        copy nothing."""
        return bool(tx_fence_take(self._live(), seq))

    def finish(self, uint64_t seq, bint done):
        """The host is through with step ``seq`` it took: every byte copied (``done``), or its copy failed and no
        byte of it can still be written (revoked)."""
        tx_fence_store(self._live(), tx_fence_word(seq, TX_FENCE_DONE if done else TX_FENCE_REVOKED))

    def revoke(self, uint64_t seq):
        """The follower gives step ``seq`` up: granted -> revoked.  Returns the step's state after: REVOKED (the swap
        won, or the host's copy failed: the host will never write for it), DONE (the host copied it whole) or
        RUNNING (the host took it and may still write).

        Raises
        ------
        ProtocolError
            The word names another step (only the host writes it besides this process: a broken host).
        """
        cdef uint64_t* w = self._live()
        cdef uint64_t want = tx_fence_word(seq, TX_FENCE_GRANTED)
        cdef uint64_t seen = tx_fence_cas(w, want, tx_fence_word(seq, TX_FENCE_REVOKED))
        if seen == want:
            return REVOKED
        return self._state_of(seq, seen)

    def state(self, uint64_t seq):
        """Step ``seq``'s state now (raises ProtocolError as :meth:`revoke`)."""
        return self._state_of(seq, tx_fence_load(self._live()))

    cdef int _state_of(self, uint64_t seq, uint64_t seen) except -1:
        if (seen >> 2) != (tx_fence_word(seq, 0) >> 2):
            raise ProtocolError(f"copy lane: the fence names step {seen >> 2} ({STATE_NAMES[seen & 3]}) while step "
                                f"{seq} is under way: the copy host wrote a step it was never given")
        return <int>(seen & 3)

    cdef void _release(self) noexcept:
        if self._word != NULL:
            munmap(self._word, PAGE)
            self._word = NULL
        if self._fd >= 0:
            close(self._fd)
            self._fd = -1
        self._closed = True

    def close(self):
        """Unmap the page (and close its memfd where this process made it); idempotent."""
        self._release()

    def __dealloc__(self):
        if not self._closed:
            try:
                warnings.warn("unclosed Fence; call close()", ResourceWarning)
            except BaseException:
                pass
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
