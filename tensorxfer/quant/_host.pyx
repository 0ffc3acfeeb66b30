# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""FP8 block quantization of a 2-D host shard in C, without the GIL: the host twin of fp8_quantize.cu.

torch's operations on a CPU take ~10 passes over a shard (the absolute values, the amax, a float32 copy,
the scales expanded, the product, the clamp, the cast); these read the shard twice (the amaxes, then the
values) and write the FP8 bytes once.  Same cells, same formulas, same bytes as torch
(tests/test_quant.py compares them): float32 arithmetic, division and reciprocal as IEEE does them, the
clamp to +-448, then round to nearest even into float8_e4m3fn.

A shard is ``rows x cols`` (C-contiguous, bf16 or fp32) at global offsets ``(row0, col0)``; cell ``(i, j)``
covers global rows ``[(first_r + i) * bm, ...)`` and the columns alike, clipped to the shard.  Pointers are
the caller's tensors' ``data_ptr()``; it keeps them alive and sized (``tensorxfer.quant.quantize``).
"""

from libc.math cimport NAN, fabsf, fmaxf, fminf, nearbyintf
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uintptr_t
from libc.string cimport memcpy

cdef float FP8_MAX = 448.0

cdef enum:      # formulas: as fp8_quantize.cu
    TRANSFORMERS = 0
    DEEPGEMM = 1
    DEEPGEMM_E8M0 = 2


cdef inline float load(const void* x, int f32, int64_t at) noexcept nogil:
    cdef uint32_t bits
    cdef float v
    if f32:
        return (<const float*>x)[at]
    bits = (<uint32_t>(<const uint16_t*>x)[at]) << 16      # bf16: the high half of a float32
    memcpy(&v, &bits, 4)
    return v


cdef inline uint8_t to_e4m3(float v) noexcept nogil:
    """Round to nearest even into float8_e4m3fn; ``v`` finite with |v| <= 448."""
    cdef uint32_t bits, mant, rest, code
    cdef int exponent
    cdef float a = fabsf(v)
    memcpy(&bits, &v, 4)
    cdef uint8_t sign = <uint8_t>((bits >> 24) & 0x80)
    if a < 0.015625:            # below 2**-6: subnormals m * 2**-9 (m = 8 is the smallest normal, code 8)
        return sign | <uint8_t>nearbyintf(a * 512.0)
    memcpy(&bits, &a, 4)
    exponent = <int>(bits >> 23) - 127
    mant = bits & 0x7FFFFF
    code = (<uint32_t>(exponent + 7) << 3) | (mant >> 20)
    rest = mant & 0xFFFFF
    if rest > 0x80000 or (rest == 0x80000 and (code & 1)):
        code += 1               # a carry into the exponent is the next binade, as it should be
    return sign | <uint8_t>code


cdef inline void scale_of(float amax, int formula, float* mult, float* stored, uint8_t* byte) noexcept nogil:
    cdef float sf
    cdef uint32_t bits
    cdef int exponent
    if formula == TRANSFORMERS:
        mult[0] = FP8_MAX * (<float>1.0 / amax) if amax > 0 else <float>1.0
        stored[0] = <float>1.0 / mult[0]
        return
    sf = fmaxf(amax, <float>1e-4) / FP8_MAX
    if formula == DEEPGEMM_E8M0:
        memcpy(&bits, &sf, 4)
        exponent = <int>((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
        exponent = 1 if exponent < 1 else 254 if exponent > 254 else exponent
        byte[0] = <uint8_t>exponent
        bits = (<uint32_t>exponent) << 23
        memcpy(&sf, &bits, 4)
    mult[0] = <float>1.0 / sf
    stored[0] = sf


cdef inline void bounds(int64_t ci, int64_t cj, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                        int64_t first_r, int64_t first_c, int64_t bm, int64_t bn, int64_t* r_lo, int64_t* r_hi,
                        int64_t* c_lo, int64_t* c_hi) noexcept nogil:
    r_lo[0] = max((first_r + ci) * bm - row0, 0)
    r_hi[0] = min((first_r + ci + 1) * bm - row0, rows)
    c_lo[0] = max((first_c + cj) * bn - col0, 0)
    c_hi[0] = min((first_c + cj + 1) * bn - col0, cols)


def block_amax(uintptr_t x, bint f32, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t first_r,
               int64_t first_c, int64_t cells_r, int64_t cells_c, int64_t bm, int64_t bn, uintptr_t out):
    """Each cell's amax over the shard's part of it into float32 ``out`` (a NaN where one is)."""
    cdef const void* src = <const void*>x
    cdef float* amax = <float*>out
    cdef int64_t ci, cj, r, c, r_lo, r_hi, c_lo, c_hi
    cdef float m, v
    cdef bint nan
    with nogil:
        for ci in range(cells_r):
            for cj in range(cells_c):
                amax[ci * cells_c + cj] = 0
        for ci in range(cells_r):
            for cj in range(cells_c):
                bounds(ci, cj, rows, cols, row0, col0, first_r, first_c, bm, bn, &r_lo, &r_hi, &c_lo, &c_hi)
                m = 0
                nan = False
                for r in range(r_lo, r_hi):
                    for c in range(c_lo, c_hi):
                        v = load(src, f32, r * cols + c)
                        nan = nan or v != v
                        m = fmaxf(m, fabsf(v))
                amax[ci * cells_c + cj] = <float>NAN if nan else m


def quantize(uintptr_t x, bint f32, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t first_r,
             int64_t first_c, int64_t cells_r, int64_t cells_c, int64_t bm, int64_t bn, uintptr_t amax_in,
             uintptr_t values, uintptr_t scales, int formula):
    """Given each cell's amax over its whole block, its stored scale (float32, or e8m0 bytes) and the
    shard's FP8 values."""
    cdef const void* src = <const void*>x
    cdef const float* amax = <const float*>amax_in
    cdef uint8_t* out = <uint8_t*>values
    cdef int64_t ci, cj, r, c, r_lo, r_hi, c_lo, c_hi, cell
    cdef float mult, stored, v
    cdef uint8_t byte = 0
    with nogil:
        for ci in range(cells_r):
            for cj in range(cells_c):
                cell = ci * cells_c + cj
                scale_of(amax[cell], formula, &mult, &stored, &byte)
                if formula == DEEPGEMM_E8M0:
                    (<uint8_t*>scales)[cell] = byte
                else:
                    (<float*>scales)[cell] = stored
                bounds(ci, cj, rows, cols, row0, col0, first_r, first_c, bm, bn, &r_lo, &r_hi, &c_lo, &c_hi)
                for r in range(r_lo, r_hi):
                    for c in range(c_lo, c_hi):
                        v = fminf(fmaxf(load(src, f32, r * cols + c) * mult, -FP8_MAX), FP8_MAX)
                        out[r * cols + c] = to_e4m3(v)
