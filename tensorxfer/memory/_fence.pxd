# The copy lane's fence word (tensorxfer.transport.ipc.delegate): its encoding and its cross-process atomics, as
# inline C shared by _fence.pyx (the Python-callable Fence) and _copy.pyx (StridedCopy.serve_lane's nogil loop), so
# both ends and both host paths run one definition of the protocol.
from libc.stdint cimport uint64_t

cdef extern from *:
    """
    #include <stdint.h>
    /* One 64-bit word in a page the follower owns and both processes map MAP_SHARED: (seq << 2) | state.
       REVOKED is 0, so a fresh (zero) page grants nothing. */
    enum { TX_FENCE_REVOKED = 0, TX_FENCE_GRANTED = 1, TX_FENCE_RUNNING = 2, TX_FENCE_DONE = 3 };
    static inline uint64_t tx_fence_word(uint64_t seq, unsigned int state) {
        return ((seq & ((((uint64_t)1) << 62) - 1)) << 2) | (uint64_t)(state & 3u);
    }
    /* seq_cst throughout: a process on another core must see the bytes copied before it sees DONE, and the
       host's claim (RUNNING) before any byte it writes. */
    static inline uint64_t tx_fence_load(uint64_t *word) { return __atomic_load_n(word, __ATOMIC_SEQ_CST); }
    static inline void tx_fence_store(uint64_t *word, uint64_t value) {
        __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    }
    /* Replace ``expected`` by ``desired`` if the word holds it; return what the word held (``expected``: replaced). */
    static inline uint64_t tx_fence_cas(uint64_t *word, uint64_t expected, uint64_t desired) {
        __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        return expected;
    }
    /* The host takes step ``seq`` (granted -> running) before it touches a byte; 0: not granted (given up). */
    static inline int tx_fence_take(uint64_t *word, uint64_t seq) {
        uint64_t want = tx_fence_word(seq, TX_FENCE_GRANTED);
        return tx_fence_cas(word, want, tx_fence_word(seq, TX_FENCE_RUNNING)) == want;
    }
    """
    enum:
        TX_FENCE_REVOKED
        TX_FENCE_GRANTED
        TX_FENCE_RUNNING
        TX_FENCE_DONE
    uint64_t tx_fence_word(uint64_t seq, unsigned int state) noexcept nogil
    uint64_t tx_fence_load(uint64_t* word) noexcept nogil
    void tx_fence_store(uint64_t* word, uint64_t value) noexcept nogil
    uint64_t tx_fence_cas(uint64_t* word, uint64_t expected, uint64_t desired) noexcept nogil
    int tx_fence_take(uint64_t* word, uint64_t seq) noexcept nogil
