// FP8 block quantization of many 2-D shards in two launches: per block, its amax, its scale and its FP8 values.
//
// Why a kernel: torch's operations take the amax, widen to float32, expand the scales, multiply, clamp and
// cast in separate passes over the shard (~45 bytes of memory traffic per bf16 weight); these read the
// shard once for the amaxes and again (from L2, the block just read) for the values, and write its FP8
// bytes once.  Why a table of shards: a source holds hundreds of them, and a launch per shard cost more
// than the arithmetic (measured on the H100: ~550 shards a source, two launches each, ~1 s a step with six
// processes sharing the GPU); a table is two launches a step however many shards there are.
//
// Built by setup.py into fp8_quantize.fatbin beside the strided-copy kernel and launched by
// tensorxfer.quant.kernel (cuda-bindings' driver API, on torch's current stream).  The arithmetic is the
// formulas of tensorxfer/quant/layout.py exactly (IEEE division and reciprocal: no fast math; the cast
// rounds to nearest even after a clamp to +-448), so its bytes equal torch's: tests/test_quant_gpu.py.
//
// The table: one row of WIDTH int64 per shard (columns below).  A shard is rows x cols (C-contiguous, bf16 or
// float32) at global offsets (row0, col0) of a global_r x global_c tensor with blocks of bm x bn; it touches
// cells_r x cells_c cells of the block grid from cell (first_r, first_c), numbered row-major from the row's
// cell0 in one flat amax array shared by the whole table (rows sorted by cell0; no row without cells).
// Cell (i, j) covers global rows [(first_r + i) * bm, (first_r + i + 1) * bm) and the columns alike,
// clipped to the shard; it is *whole* when the shard holds all of its block (the block clipped to the
// tensor's end), and then the cell's amax is the block's.  One thread block per cell.
//
// amax_cells: each listed cell's (all: cells NULL) amax over the shard's part of it (a NaN where it holds
//   one: the caller checks, before anything is offered); with quantize_whole, a whole cell with a finite
//   amax is also quantized (scale and values) at once.
// quantize_cells: given each listed cell's amax over its WHOLE block (the sources agreed on the shared
//   ones), its stored scale (float32, or e8m0 bytes) and its FP8 values.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define THREADS 256
#define FP8_MAX 448.0f

enum Formula { TRANSFORMERS = 0, DEEPGEMM = 1, DEEPGEMM_E8M0 = 2 };
enum Dtype { BF16 = 0, F32 = 1 };
enum Column { X, VALUES, SCALES, ROWS, COLS, ROW0, COL0, FIRST_R, FIRST_C, CELLS_C, BM, BN, GLOBAL_R, GLOBAL_C,
              DTYPE, FORMULA, CELL0, WIDTH };

// One cell of one shard: the shard's table row, the cell's index among the shard's cells, its rows
// [r_lo, r_hi) and columns [c_lo, c_hi) of the shard, and whether the shard holds its whole block.
struct Cell {
    const int64_t* s;
    int64_t local, r_lo, r_hi, c_lo, c_hi;
    bool whole;
};

__device__ __forceinline__ Cell locate(const int64_t* __restrict__ table, int64_t shards, int64_t g) {
    int64_t lo = 0, hi = shards - 1;        // the last row whose cell0 <= g
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (table[mid * WIDTH + CELL0] <= g) lo = mid;
        else hi = mid - 1;
    }
    Cell c;
    c.s = table + lo * WIDTH;
    const int64_t* s = c.s;
    c.local = g - s[CELL0];
    const int64_t gr = s[FIRST_R] + c.local / s[CELLS_C], gc = s[FIRST_C] + c.local % s[CELLS_C];
    const int64_t top = gr * s[BM], bottom = min((gr + 1) * s[BM], s[GLOBAL_R]);
    const int64_t left = gc * s[BN], right = min((gc + 1) * s[BN], s[GLOBAL_C]);
    c.r_lo = max(top - s[ROW0], (int64_t)0);
    c.r_hi = min(bottom - s[ROW0], s[ROWS]);
    c.c_lo = max(left - s[COL0], (int64_t)0);
    c.c_hi = min(right - s[COL0], s[COLS]);
    c.whole = top >= s[ROW0] && bottom <= s[ROW0] + s[ROWS] && left >= s[COL0] && right <= s[COL0] + s[COLS];
    return c;
}

// VEC elements at p as floats: 16-byte loads where the caller found the cell aligned for them
template <typename T, int VEC>
struct Load;
template <>
struct Load<__nv_bfloat16, 8> {
    static __device__ __forceinline__ void at(const __nv_bfloat16* p, float* f) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 t = __bfloat1622float2(h[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    }
};
template <>
struct Load<float, 4> {
    static __device__ __forceinline__ void at(const float* p, float* f) {
        const float4 u = *reinterpret_cast<const float4*>(p);
        f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w;
    }
};
template <>
struct Load<__nv_bfloat16, 1> {
    static __device__ __forceinline__ void at(const __nv_bfloat16* p, float* f) { f[0] = __bfloat162float(*p); }
};
template <>
struct Load<float, 1> {
    static __device__ __forceinline__ void at(const float* p, float* f) { f[0] = *p; }
};

// VEC FP8 bytes to q (aligned alike)
template <int VEC>
__device__ __forceinline__ void store(uint8_t* q, const uint8_t* b) {
    if constexpr (VEC == 1) {
        q[0] = b[0];
    } else {
        uint32_t w[VEC / 4];
#pragma unroll
        for (int i = 0; i < VEC / 4; i++)
            w[i] = (uint32_t)b[4 * i] | (uint32_t)b[4 * i + 1] << 8 | (uint32_t)b[4 * i + 2] << 16 |
                   (uint32_t)b[4 * i + 3] << 24;
        if constexpr (VEC == 8) *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
        else *reinterpret_cast<uint32_t*>(q) = w[0];
    }
}

// The cell's elements VEC at a time: each thread's share, walked a row of threads at a time
template <typename T, int VEC, typename F>
__device__ __forceinline__ void each(const Cell& c, F f) {
    const int64_t cols = c.s[COLS];
    const int lanes = (int)((c.c_hi - c.c_lo) / VEC), tw = lanes < THREADS ? lanes : THREADS, per = THREADS / tw;
    const int tr = threadIdx.x / tw, tc = threadIdx.x % tw;
    if (tr >= per) return;
    const T* x = reinterpret_cast<const T*>(c.s[X]);
    for (int64_t r = c.r_lo + tr; r < c.r_hi; r += per)
        for (int64_t k = c.c_lo + (int64_t)tc * VEC; k < c.c_hi; k += (int64_t)tw * VEC) {
            float v[VEC];
            Load<T, VEC>::at(x + r * cols + k, v);
            f(r * cols + k, v);
        }
}

template <typename T, int VEC>
__device__ __forceinline__ void amax_of(const Cell& c, float* m, int* nan) {
    each<T, VEC>(c, [&](int64_t, const float* v) {
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            *nan |= v[i] != v[i];
            *m = fmaxf(*m, fabsf(v[i]));
        }
    });
}

__device__ __forceinline__ uint8_t to_fp8(float v, float s) {
    return (uint8_t)__nv_cvt_float_to_fp8(fminf(fmaxf(v * s, -FP8_MAX), FP8_MAX), __NV_SATFINITE, __NV_E4M3);
}

// Two values at once (one conversion instruction for the pair): saturating to the largest finite E4M3 is the
// clamp to +-448 above, for the finite values a tile converts (its amax is finite); measured on the H100 over
// 4 GiB of 128 x 128 tiles, 1.125x torch's cast against 1.144x one at a time
__device__ __forceinline__ uint16_t to_fp8_pair(float a, float b, float s) {
    return (uint16_t)__nv_cvt_float2_to_fp8x2(make_float2(a * s, b * s), __NV_SATFINITE, __NV_E4M3);
}

template <typename T, int VEC>
__device__ __forceinline__ void values_of(const Cell& c, float s) {
    uint8_t* values = reinterpret_cast<uint8_t*>(c.s[VALUES]);
    each<T, VEC>(c, [&](int64_t at, const float* v) {
        uint8_t b[VEC];
#pragma unroll
        for (int i = 0; i < VEC; i++)
            b[i] = to_fp8(v[i], s);
        store<VEC>(values + at, b);
    });
}

// Whether the cell can be walked 16 bytes of input at a time (and its FP8 bytes stored VEC at a time)
template <int VEC, int SIZE>
__device__ __forceinline__ bool wide(const Cell& c) {
    const int64_t cols = c.s[COLS];
    return c.s[X] % 16 == 0 && c.s[VALUES] % VEC == 0 && cols % VEC == 0 && c.c_lo % VEC == 0 &&
           (c.c_hi - c.c_lo) % VEC == 0 && VEC * SIZE == 16;
}

// DeepGEMM's ceil_to_ue8m0 on float32 bits: the power of two at or above x; its biased exponent in *byte
__device__ __forceinline__ float ceil_pow2(float x, uint8_t* byte) {
    uint32_t bits = __float_as_uint(x);
    int exponent = (int)((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
    exponent = exponent < 1 ? 1 : exponent > 254 ? 254 : exponent;
    *byte = (uint8_t)exponent;
    return __uint_as_float((uint32_t)exponent << 23);
}

// The factor a cell's values are multiplied by, from its block's amax; thread 0 stores the cell's scale
__device__ __forceinline__ float scale_of(const Cell& c, float amax) {
    const int formula = (int)c.s[FORMULA];
    float mult, stored;
    uint8_t byte = 0;
    if (formula == TRANSFORMERS) {      // s = 448 * fl(1 / amax) (torch's number-over-tensor), 1 for zero
        mult = amax > 0.0f ? FP8_MAX * (1.0f / amax) : 1.0f;
        stored = 1.0f / mult;
    } else {                            // sf = max(amax, 1e-4) / 448, values * fl(1 / sf)
        float sf = fmaxf(amax, 1e-4f) / FP8_MAX;
        if (formula == DEEPGEMM_E8M0) sf = ceil_pow2(sf, &byte);
        mult = 1.0f / sf;
        stored = sf;
    }
    if (threadIdx.x == 0) {
        if (formula == DEEPGEMM_E8M0) reinterpret_cast<uint8_t*>(c.s[SCALES])[c.local] = byte;
        else reinterpret_cast<float*>(c.s[SCALES])[c.local] = stored;
    }
    return mult;
}

// The cell's scale and FP8 values, from its block's amax (a second read of its elements)
__device__ void quantize_cell(const Cell& c, float amax) {
    const float mult = scale_of(c, amax);
    if (c.s[DTYPE] == BF16) {
        if (wide<8, 2>(c)) values_of<__nv_bfloat16, 8>(c, mult);
        else values_of<__nv_bfloat16, 1>(c, mult);
    } else {
        if (wide<4, 4>(c)) values_of<float, 4>(c, mult);
        else values_of<float, 1>(c, mult);
    }
}

// The block's amax and NaN flag over every thread's (m, nan), returned to every thread
__device__ __forceinline__ float block_max(float m, int* nan) {
    __shared__ float warp_max[THREADS / 32];
    __shared__ int warp_nan[THREADS / 32];
    for (int off = 16; off; off >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
        *nan |= __shfl_xor_sync(0xffffffff, *nan, off);
    }
    if ((threadIdx.x & 31) == 0) {
        warp_max[threadIdx.x / 32] = m;
        warp_nan[threadIdx.x / 32] = *nan;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < THREADS / 32; i++) {
        m = fmaxf(m, warp_max[i]);
        *nan |= warp_nan[i];
    }
    return m;
}

// A cell 128 columns wide and at most 128 rows high, aligned for 16-byte loads (a 128 x 128 block, the
// layout FP8 checkpoints use): every thread loads its share into registers at once (all loads in flight
// together), takes the amax, and a whole cell's values come from the registers: one read, one write.
template <typename T>
__device__ __forceinline__ bool tiles(const Cell& c) {
    return c.c_hi - c.c_lo == 128 && c.r_hi - c.r_lo <= 128 && wide<16 / sizeof(T), sizeof(T)>(c);
}

template <typename T>
__device__ void tile_cell(const Cell& c, float* amax_at, int quantize_whole) {
    constexpr int VEC = 16 / sizeof(T), LANES = 128 / VEC, ROWS = THREADS / LANES, PASSES = 128 / ROWS;
    const int tr = threadIdx.x / LANES, tc = threadIdx.x % LANES;
    const int64_t cols = c.s[COLS];
    const T* x = reinterpret_cast<const T*>(c.s[X]) + c.c_lo + tc * VEC;
    uint4 raw[PASSES];
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int64_t r = c.r_lo + tr + p * ROWS;
        if (r < c.r_hi) raw[p] = *reinterpret_cast<const uint4*>(x + r * cols);
    }
    float m = 0.0f;
    int nan = 0;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        if (c.r_lo + tr + p * ROWS >= c.r_hi) continue;
        float v[VEC];
        Load<T, VEC>::at(reinterpret_cast<const T*>(&raw[p]), v);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            nan |= v[i] != v[i];
            m = fmaxf(m, fabsf(v[i]));
        }
    }
    m = block_max(m, &nan);
    if (threadIdx.x == 0) *amax_at = nan ? __int_as_float(0x7fc00000) : m;
    if (!(quantize_whole && c.whole && !nan && isfinite(m))) return;
    const float s = scale_of(c, m);
    uint8_t* values = reinterpret_cast<uint8_t*>(c.s[VALUES]) + c.c_lo + tc * VEC;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int64_t r = c.r_lo + tr + p * ROWS;
        if (r >= c.r_hi) continue;
        float v[VEC];
        uint8_t b[VEC];
        Load<T, VEC>::at(reinterpret_cast<const T*>(&raw[p]), v);
#pragma unroll
        for (int i = 0; i < VEC; i++) b[i] = to_fp8(v[i], s);
        store<VEC>(values + r * cols, b);
    }
}

// Three blocks a multiprocessor (at most 80 registers a thread): measured on the H100 over a source's 4.5 GB of
// bf16 shards, 2.97 ms against 3.13 ms uncapped (102 registers) and 5.06 ms at four (spills)
extern "C" __global__ void __launch_bounds__(THREADS, 3)
amax_cells(const int64_t* __restrict__ table, int64_t shards, const int64_t* __restrict__ cells,
           float* __restrict__ amax, int quantize_whole) {
    const int64_t g = cells ? cells[blockIdx.x] : (int64_t)blockIdx.x;
    const Cell c = locate(table, shards, g);
    const bool bf16 = c.s[DTYPE] == BF16;
    if (bf16 && tiles<__nv_bfloat16>(c)) {     // float32 tiles would take 64 registers a thread: they loop
        tile_cell<__nv_bfloat16>(c, amax + g, quantize_whole);
        return;
    }
    float m = 0.0f;
    int nan = 0;
    if (bf16) {
        if (wide<8, 2>(c)) amax_of<__nv_bfloat16, 8>(c, &m, &nan);
        else amax_of<__nv_bfloat16, 1>(c, &m, &nan);
    } else {
        if (wide<4, 4>(c)) amax_of<float, 4>(c, &m, &nan);
        else amax_of<float, 1>(c, &m, &nan);
    }
    m = block_max(m, &nan);
    if (threadIdx.x == 0) amax[g] = nan ? __int_as_float(0x7fc00000) : m;
    if (quantize_whole && c.whole && !nan && isfinite(m)) quantize_cell(c, m);
}

extern "C" __global__ void __launch_bounds__(THREADS)
quantize_cells(const int64_t* __restrict__ table, int64_t shards, const int64_t* __restrict__ cells,
               const float* __restrict__ amax) {
    const int64_t g = cells ? cells[blockIdx.x] : (int64_t)blockIdx.x;
    quantize_cell(locate(table, shards, g), amax[g]);
}

// ---------------------------------------------------------------------------------------------------------
// quantize_tiles: FP8 made on the way, by the process that copies a weight-sync pair on one GPU
// (tensorxfer.quant.tiles).  A tile is one block that a source shard holds whole: its elements are read from
// the source's region (bf16 or float32, rows of src_pitch bytes), its amax taken, and its FP8 values written
// straight into the target's region -- only the part of the block the target holds (rows [r0, r1), columns
// [c0, c1) of the block, to dst + (r - r0) * dst_pitch + (c - c0)) -- with its scale (at scale, or none:
// -1).  One read of the bf16 and one write of the FP8 bytes, where quantizing at the source and copying the
// FP8 bytes costs a write and a read more.  A block that straddles sources is a tile of each source's part
// of it: its amax is the larger of the part's and the sources' agreed one, a float32 at amax in the source's
// region (-1: a whole block) -- so the agreed one, and the bytes are the source path's.  A block holding a NaN
// or an infinity (or whose agreed amax is one) writes nothing, and the lowest such tile's index lands in
// *status (set to all ones before the launch): the caller fails the step.
enum TileColumn { T_SRC, T_SRC_PITCH, T_ROWS, T_COLS, T_DST, T_DST_PITCH, T_R0, T_R1, T_C0, T_C1, T_SCALE, T_DTYPE,
                  T_FORMULA, T_AMAX, T_WIDTH };

// A tile's amax: its own elements' (m, over every thread), or for a shared block's part the larger of that and
// the agreed one; *nan set where either is no finite number
__device__ __forceinline__ float tile_amax(const int64_t* t, uint64_t src_base, float m, int* nan) {
    if (t[T_AMAX] < 0) return m;
    const float agreed = *reinterpret_cast<const float*>(src_base + t[T_AMAX]);
    *nan |= !isfinite(agreed);
    return fmaxf(m, agreed);
}

// Every element of rows [r_lo, r_hi) x columns [c_lo, c_hi) of a block at src (rows of pitch bytes), VEC at a
// time: a row of threads at a time, as each() does
template <typename T, int VEC, typename F>
__device__ __forceinline__ void walk(const char* src, int64_t pitch, int64_t r_lo, int64_t r_hi, int64_t c_lo,
                                     int64_t c_hi, F f) {
    const int lanes = (int)((c_hi - c_lo) / VEC), tw = lanes < 1 ? 1 : lanes < THREADS ? lanes : THREADS;
    const int per = THREADS / tw, tr = threadIdx.x / tw, tc = threadIdx.x % tw;
    if (tr >= per) return;
    for (int64_t r = r_lo + tr; r < r_hi; r += per)
        for (int64_t k = c_lo + (int64_t)tc * VEC; k < c_hi; k += (int64_t)tw * VEC) {
            float v[VEC];
            Load<T, VEC>::at(reinterpret_cast<const T*>(src + r * pitch) + k, v);
            f(r, k, v);
        }
}

// The factor values are multiplied by, from a block's amax; the scale stored at scale (unless null)
__device__ __forceinline__ float tile_scale(int formula, float amax, char* scale) {
    float mult, stored;
    uint8_t byte = 0;
    if (formula == TRANSFORMERS) {
        mult = amax > 0.0f ? FP8_MAX * (1.0f / amax) : 1.0f;
        stored = 1.0f / mult;
    } else {
        float sf = fmaxf(amax, 1e-4f) / FP8_MAX;
        if (formula == DEEPGEMM_E8M0) sf = ceil_pow2(sf, &byte);
        mult = 1.0f / sf;
        stored = sf;
    }
    if (threadIdx.x == 0 && scale != nullptr) {
        if (formula == DEEPGEMM_E8M0) *reinterpret_cast<uint8_t*>(scale) = byte;
        else *reinterpret_cast<float*>(scale) = stored;
    }
    return mult;
}

// A block 128 columns wide, at most 128 rows high, aligned for 16-byte loads, its values written whole rows
// of 8-byte words (the layout FP8 checkpoints use, TP shards on block edges): one read into shared memory, one
// write
template <typename T>
__device__ __forceinline__ bool tile_fast(const int64_t* t, uint64_t src, uint64_t dst) {
    return t[T_COLS] == 128 && t[T_ROWS] <= 128 && t[T_C0] == 0 && t[T_C1] == 128 && (src + t[T_SRC]) % 16 == 0 &&
           t[T_SRC_PITCH] % 16 == 0 && (dst + t[T_DST]) % 8 == 0 && t[T_DST_PITCH] % 8 == 0;
}

// cp.async (sm_80+): 16 bytes from global to shared memory without passing through registers
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// The block's 32 KiB are staged in shared memory, each thread's 16 bytes of a row at stage[p * THREADS + x] (it
// reads back only what it fetched itself: no barrier but the wait for its own copies).  Why not registers: the
// 32 KiB took 32 registers a thread, so three blocks a multiprocessor, and the tiles ran at 1.125x torch's
// one-pass cast on the H100; four spilled (1.25-1.28x).  Staged, 64 registers a thread and 32 KiB of shared
// memory a block let four run at once: 0.985-0.987x torch's cast (five 0.996-0.997x, six 0.996-1.010x; probe_tiles
// over 4 GiB of 128 x 128 tiles, benchmarks/results/2026-12-07-fp8-tiles-in-shared-memory).
template <typename T>
__device__ void tile_staged(const int64_t* t, uint64_t src_base, uint64_t dst_base, int64_t index,
                            unsigned long long* status) {
    constexpr int VEC = 16 / sizeof(T), LANES = 128 / VEC, ROWS = THREADS / LANES, PASSES = 128 / ROWS;
    __shared__ uint4 stage[PASSES * THREADS];
    const int tr = threadIdx.x / LANES, tc = threadIdx.x % LANES;
    const int64_t rows = t[T_ROWS], pitch = t[T_SRC_PITCH];
    const char* src = reinterpret_cast<const char*>(src_base + t[T_SRC]) + tc * 16;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int64_t r = tr + p * ROWS;
        if (r < rows) copy16_async(&stage[p * THREADS + threadIdx.x], src + r * pitch);
    }
    asm volatile("cp.async.wait_all;\n" ::);
    float m = 0.0f;
    int nan = 0;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        if (tr + p * ROWS >= rows) continue;
        const uint4 raw = stage[p * THREADS + threadIdx.x];
        float v[VEC];
        Load<T, VEC>::at(reinterpret_cast<const T*>(&raw), v);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            nan |= v[i] != v[i];
            m = fmaxf(m, fabsf(v[i]));
        }
    }
    m = tile_amax(t, src_base, block_max(m, &nan), &nan);
    if (nan || !isfinite(m)) {
        if (threadIdx.x == 0) atomicMin(status, (unsigned long long)index);
        return;
    }
    char* scale = t[T_SCALE] >= 0 ? reinterpret_cast<char*>(dst_base + t[T_SCALE]) : nullptr;
    const float s = tile_scale((int)t[T_FORMULA], m, scale);
    const int64_t r0 = t[T_R0], r1 = t[T_R1], dpitch = t[T_DST_PITCH];
    uint8_t* values = reinterpret_cast<uint8_t*>(dst_base + t[T_DST]) + tc * VEC;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int64_t r = tr + p * ROWS;
        if (r < r0 || r >= r1) continue;
        const uint4 raw = stage[p * THREADS + threadIdx.x];
        float v[VEC];
        uint8_t b[VEC];
        Load<T, VEC>::at(reinterpret_cast<const T*>(&raw), v);
#pragma unroll
        for (int i = 0; i < VEC; i += 2) {     // two at a time: the same bytes as to_fp8's (see to_fp8_pair)
            const uint16_t pair = to_fp8_pair(v[i], v[i + 1], s);
            b[i] = (uint8_t)(pair & 0xFF);
            b[i + 1] = (uint8_t)(pair >> 8);
        }
        store<VEC>(values + (r - r0) * dpitch, b);
    }
}

// Any other tile: a pass for the amax, a second (from L2) for the values of the target's part
template <typename T, int VEC>
__device__ void tile_loop(const int64_t* t, uint64_t src_base, uint64_t dst_base, int64_t index,
                          unsigned long long* status) {
    const char* src = reinterpret_cast<const char*>(src_base + t[T_SRC]);
    const int64_t pitch = t[T_SRC_PITCH];
    float m = 0.0f;
    int nan = 0;
    walk<T, VEC>(src, pitch, 0, t[T_ROWS], 0, t[T_COLS], [&](int64_t, int64_t, const float* v) {
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            nan |= v[i] != v[i];
            m = fmaxf(m, fabsf(v[i]));
        }
    });
    m = tile_amax(t, src_base, block_max(m, &nan), &nan);
    if (nan || !isfinite(m)) {
        if (threadIdx.x == 0) atomicMin(status, (unsigned long long)index);
        return;
    }
    char* scale = t[T_SCALE] >= 0 ? reinterpret_cast<char*>(dst_base + t[T_SCALE]) : nullptr;
    const float s = tile_scale((int)t[T_FORMULA], m, scale);
    const int64_t r0 = t[T_R0], c0 = t[T_C0], dpitch = t[T_DST_PITCH];
    uint8_t* values = reinterpret_cast<uint8_t*>(dst_base + t[T_DST]);
    walk<T, 1>(src, pitch, r0, t[T_R1], c0, t[T_C1], [&](int64_t r, int64_t c, const float* v) {
        values[(r - r0) * dpitch + (c - c0)] = to_fp8(v[0], s);
    });
}

// Four blocks a multiprocessor (at most 64 registers a thread; the byte loops' paths do not spill): see tile_staged
extern "C" __global__ void __launch_bounds__(THREADS, 4)
quantize_tiles(const int64_t* __restrict__ tiles, uint64_t src_base, uint64_t dst_base,
               unsigned long long* __restrict__ status) {
    const int64_t index = blockIdx.x;
    const int64_t* t = tiles + index * T_WIDTH;
    if (t[T_DTYPE] == BF16) {
        if (tile_fast<__nv_bfloat16>(t, src_base, dst_base))
            tile_staged<__nv_bfloat16>(t, src_base, dst_base, index, status);
        else if ((src_base + t[T_SRC]) % 16 == 0 && t[T_SRC_PITCH] % 16 == 0 && t[T_COLS] % 8 == 0)
            tile_loop<__nv_bfloat16, 8>(t, src_base, dst_base, index, status);
        else
            tile_loop<__nv_bfloat16, 1>(t, src_base, dst_base, index, status);
    } else {
        if ((src_base + t[T_SRC]) % 16 == 0 && t[T_SRC_PITCH] % 16 == 0 && t[T_COLS] % 4 == 0)
            tile_loop<float, 4>(t, src_base, dst_base, index, status);
        else
            tile_loop<float, 1>(t, src_base, dst_base, index, status);
    }
}
