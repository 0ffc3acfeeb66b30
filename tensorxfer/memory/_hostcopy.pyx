# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Host memory copied without the GIL: whole buffers, and a weight sync's strided groups of rows.

A weight sync's pair is a static list of groups (``count`` rows of ``nbytes`` bytes, ``src_stride`` /
``dst_stride`` apart; a contiguous run is a group of one row).  numpy copies a strided 2-D view at a
third of memcpy's speed (measured on the 2-core dev VM: rows of 2 KiB 4.7 GB/s, a contiguous copy 15),
and building ~800 views a step cost more than copying many of them; here every row is copied as it is,
in one call per copy thread.  A row's whole cache lines are stored past the caches (SSE2 streaming
stores, x86-64); a contiguous row prefetches its own bytes 512 ahead, a strided group's row the row ~4 KB
ahead, a line per line copied (rows under 1280 bytes: plain copies).  On the dev VM, one thread, a 2 GB
sync's groups moved 7.6-8.1 GB/s (contiguous, MB-sized) and 6.4-7.0 GB/s (half rows of 0.8-3.3 KB) with a
memcpy per row; 12.1-13.3 and 8.2-8.4 GB/s streamed, 13.0 and 7.5-8.2 with the contiguous read-ahead.
Half rows stay below a contiguous copy (in C, 2 threads, 6.5 KB rows: each thread pulling half of every
row 15 GB/s, whole rows 20-22).

:func:`stream_copy` is the same streamed copy for one whole buffer (an ipc transfer's pieces, the staging
pieces of a host region's ``update_from`` and reads).  It is not
glibc's ``memcpy`` because of where glibc switches to streaming stores: at ``x86_non_temporal_threshold``,
which it derives from the cache size the CPU reports.  The dev VM's EPYC reports 256 MB of shared cache,
so every copy from 8 KB to 192 MB ran ``rep movsb`` there: 7.0 GB/s a thread, against 12.5 streamed
(2026-12-05, ``ld.so --list-tunables``).
"""

from libc.stdint cimport uint64_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* One row, its whole 64-byte lines stored past the caches (non-temporal): a row copied with plain
       stores first reads every destination line it writes (read for ownership), half again the memory
       traffic; glibc streams only copies larger than most of the cache, never a row of a few KB.  A
       partial line stays a plain store (a streamed partial line costs a bus transaction of its own).
       Each streamed line prefetches the line at the same offset from ``ahead``: for a contiguous row
       its own bytes TX_STREAM_AHEAD on (2 threads on the dev VM: 25.5 GB/s against 22.9 without, flat
       from 384 to 768 bytes ahead, 21 GB/s at 2 KB); for a strided group's row a later row, where the
       hardware prefetcher does not look (one prefetch per line keeps a steady distance: a whole row
       prefetched at once, the first way, was 16 % slower on rows of 3.3 KB).  A prefetch never faults,
       so reading ahead past the end of the buffer is harmless. */
    static inline void tx_stream_row(unsigned char *dst, const unsigned char *src, size_t n,
                                     const unsigned char *ahead) {
    #if defined(__SSE2__)
        size_t k = (64 - ((uintptr_t)dst & 63)) & 63;
        if (n < k + 128) {                      /* no two whole lines to stream: a plain copy */
            memcpy(dst, src, n);
            return;
        }
        memcpy(dst, src, k);                    /* the first partial line, then whole lines only */
        for (; n - k >= 64; k += 64) {
            _mm_prefetch((const char *)(ahead + k), _MM_HINT_NTA);
            __m128i a = _mm_loadu_si128((const __m128i *)(src + k));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + k + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + k + 48));
            _mm_stream_si128((__m128i *)(dst + k), a); _mm_stream_si128((__m128i *)(dst + k + 16), b);
            _mm_stream_si128((__m128i *)(dst + k + 32), c); _mm_stream_si128((__m128i *)(dst + k + 48), d);
        }
        memcpy(dst + k, src + k, n - k);        /* the last partial line */
    #else
        memcpy(dst, src, n);
    #endif
    }
    /* A strided group's rows narrower than this are copied with plain stores and no prefetch: reading half
       of each source row, a row of 0.8 KB moved 6.3 GB/s that way, 5.4 streamed (dev VM, one thread). */
    enum { TX_NARROW_ROW = 1280 };
    /* How far ahead (bytes of rows, rounded up to whole rows) a strided group's reads are prefetched. */
    enum { TX_PREFETCH_BYTES = 4096 };
    /* How far ahead a contiguous row's own bytes are prefetched. */
    enum { TX_STREAM_AHEAD = 512 };
    /* Stores streamed past the caches are ordered before whatever this thread does next. */
    static inline void tx_stream_fence(void) {
    #if defined(__SSE2__)
        _mm_sfence();
    #endif
    }
    """
    void tx_stream_row(unsigned char *dst, const unsigned char *src, size_t n,
                       const unsigned char *ahead) noexcept nogil
    void tx_stream_fence() noexcept nogil
    enum: TX_NARROW_ROW, TX_PREFETCH_BYTES, TX_STREAM_AHEAD


def stream_copy(unsigned char[::1] dst, const unsigned char[::1] src):
    """Copy all of ``src`` into ``dst`` (the same length), streamed past the caches; return the bytes.

    Raises
    ------
    ValueError
        The lengths differ (nothing is copied).
    """
    cdef size_t n = <size_t>src.shape[0]
    if <size_t>dst.shape[0] != n:
        raise ValueError(f"stream_copy: {n} bytes into a buffer of {dst.shape[0]}: the lengths must be equal")
    if n:
        with nogil:
            tx_stream_row(&dst[0], &src[0], n, &src[0] + TX_STREAM_AHEAD)
            tx_stream_fence()
    return n


def copy_groups(const unsigned char[::1] src, unsigned char[::1] dst, const uint64_t[::1] src_off,
                const uint64_t[::1] dst_off, const uint64_t[::1] nbytes, const uint64_t[::1] count,
                const uint64_t[::1] src_stride, const uint64_t[::1] dst_stride, Py_ssize_t start=0,
                Py_ssize_t step=1):
    """Copy groups ``start, start + step, ...`` of the columns from ``src`` to ``dst``; return the bytes.

    Raises
    ------
    ValueError
        The columns differ in length, ``step`` < 1, or a group reaches past either buffer (nothing of
        that group or any later one is copied).
    """
    cdef Py_ssize_t n = src_off.shape[0], i
    cdef uint64_t r, rows, width, so, do_, ss, ds, ahead, moved = 0, bad = 0
    cdef uint64_t slen = <uint64_t>src.shape[0], dlen = <uint64_t>dst.shape[0]
    if step < 1 or start < 0:
        raise ValueError(f"copy_groups: start {start} and step {step} must be >= 0 and >= 1")
    if not (dst_off.shape[0] == nbytes.shape[0] == count.shape[0] == src_stride.shape[0] == dst_stride.shape[0]
            == n):
        raise ValueError("copy_groups: the group columns differ in length")
    with nogil:
        i = start
        while i < n:
            rows, width, so, do_ = count[i], nbytes[i], src_off[i], dst_off[i]
            ss, ds = src_stride[i], dst_stride[i]
            if rows and width:
                if not (_fits(so, rows, ss, width, slen) and _fits(do_, rows, ds, width, dlen)):
                    bad = <uint64_t>i + 1
                    break
                if ss == width or rows == 1:        # contiguous: prefetch the row's own bytes ahead
                    for r in range(rows):
                        tx_stream_row(&dst[do_ + r * ds], &src[so + r * ss], width,
                                      &src[so + r * ss] + TX_STREAM_AHEAD)
                elif width < TX_NARROW_ROW:
                    for r in range(rows):
                        memcpy(&dst[do_ + r * ds], &src[so + r * ss], width)
                else:
                    ahead = (TX_PREFETCH_BYTES + width - 1) // width
                    for r in range(rows):
                        tx_stream_row(&dst[do_ + r * ds], &src[so + r * ss], width,
                                      &src[so + (r + ahead if r + ahead < rows else r) * ss])
                moved += rows * width
            i += step
        tx_stream_fence()
    if bad:
        raise ValueError(f"copy_groups: group {bad - 1} reaches past the source ({slen} bytes) or the "
                         f"destination ({dlen} bytes)")
    return moved


cdef inline bint _fits(uint64_t off, uint64_t rows, uint64_t stride, uint64_t width, uint64_t length) noexcept nogil:
    """Whether rows ``off + r * stride + [0, width)`` for r < ``rows`` (>= 1) all lie in ``[0, length)``, checked
    without overflow."""
    cdef uint64_t last
    if off > length:
        return False
    if stride and rows - 1 > (length - off) // stride:
        return False
    last = off + (rows - 1) * stride
    return width <= length - last
