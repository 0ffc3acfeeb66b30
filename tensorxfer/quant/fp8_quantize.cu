// FP8 block quantization of one 2-D shard in one launch: per block, its amax and scale, and its FP8 values.
//
// Why a kernel: torch's operations take the amax, widen to float32, expand the scales, multiply, clamp and
// cast in separate passes over the shard (~45 bytes of memory traffic per bf16 weight); these read the
// shard twice (the amaxes, before a step offers anything; then the values) and write its FP8 bytes once.
//
// Built by setup.py into fp8_quantize.fatbin beside the strided-copy kernel and launched by
// tensorxfer.quant.kernel (cuda-bindings' driver API, on torch's current stream).  The arithmetic is the
// formulas of tensorxfer/quant/layout.py exactly (IEEE division and reciprocal: no fast math; the cast
// rounds to nearest even after a clamp to +-448), so its bytes equal torch's: tests/test_quant_gpu.py.
//
// Two kernels per input dtype, one thread block per cell of the shard's part of the block grid (cells_r x
// cells_c, row-major).  The shard is rows x cols (C-contiguous) at global offsets (row0, col0); cell (i, j)
// covers global rows [(first_r + i) * bm, (first_r + i + 1) * bm) and the columns alike, clipped to the
// shard.  amax_*: each cell's amax over the shard's part of it (a NaN where it holds one: the caller checks,
// before anything is offered).  quantize_*: given each cell's amax over its WHOLE block (the sources agreed
// on the shared ones), the stored scale (float32, or e8m0 bytes) and the FP8 values.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define THREADS 256
#define FP8_MAX 448.0f

enum Formula { TRANSFORMERS = 0, DEEPGEMM = 1, DEEPGEMM_E8M0 = 2 };

template <typename T>
__device__ __forceinline__ float widen(T v);
template <>
__device__ __forceinline__ float widen<float>(float v) { return v; }
template <>
__device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// DeepGEMM's ceil_to_ue8m0 on float32 bits: the power of two at or above x; its biased exponent in *byte
__device__ __forceinline__ float ceil_pow2(float x, uint8_t* byte) {
    uint32_t bits = __float_as_uint(x);
    int exponent = (int)((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
    exponent = exponent < 1 ? 1 : exponent > 254 ? 254 : exponent;
    *byte = (uint8_t)exponent;
    return __uint_as_float((uint32_t)exponent << 23);
}

// The cell's rows [r_lo, r_hi) and columns [c_lo, c_hi) of the shard, walked a row of threads at a time
struct Cell {
    int64_t r_lo, r_hi, c_lo, c_hi;
};

__device__ __forceinline__ Cell cell_of(int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t first_r,
                                        int64_t first_c, int64_t cells_c, int64_t bm, int64_t bn) {
    const int64_t cell = (int64_t)blockIdx.x, ci = cell / cells_c, cj = cell % cells_c;
    Cell c;
    c.r_lo = max((first_r + ci) * bm - row0, (int64_t)0);
    c.r_hi = min((first_r + ci + 1) * bm - row0, rows);
    c.c_lo = max((first_c + cj) * bn - col0, (int64_t)0);
    c.c_hi = min((first_c + cj + 1) * bn - col0, cols);
    return c;
}

// Pass 1: each cell's amax over the shard's part of its block (NaN where it holds one).
template <typename T>
__device__ void amax_block(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                           int64_t first_r, int64_t first_c, int64_t cells_c, int64_t bm, int64_t bn,
                           float* __restrict__ amax_out) {
    __shared__ float warp_max[THREADS / 32];
    __shared__ int warp_nan[THREADS / 32];
    const Cell c = cell_of(rows, cols, row0, col0, first_r, first_c, cells_c, bm, bn);
    const int w = (int)(c.c_hi - c.c_lo), tw = w < THREADS ? w : THREADS, per = THREADS / tw;
    const int tr = threadIdx.x / tw, tc = threadIdx.x % tw;
    float m = 0.0f;
    int nan = 0;
    if (tr < per) {
        for (int64_t r = c.r_lo + tr; r < c.r_hi; r += per) {
            const T* row = x + r * cols;
            for (int64_t k = c.c_lo + tc; k < c.c_hi; k += tw) {
                float v = widen<T>(row[k]);
                nan |= v != v;
                m = fmaxf(m, fabsf(v));
            }
        }
    }
    for (int off = 16; off; off >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
        nan |= __shfl_xor_sync(0xffffffff, nan, off);
    }
    if ((threadIdx.x & 31) == 0) {
        warp_max[threadIdx.x / 32] = m;
        warp_nan[threadIdx.x / 32] = nan;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < THREADS / 32; i++) {
            m = fmaxf(m, warp_max[i]);
            nan |= warp_nan[i];
        }
        amax_out[blockIdx.x] = nan ? __int_as_float(0x7fc00000) : m;
    }
}

// Pass 2: given each cell's amax over its WHOLE block, its scale and the shard's FP8 values in it.
template <typename T>
__device__ void quantize_block(const T* __restrict__ x, uint8_t* __restrict__ values, int64_t rows, int64_t cols,
                               int64_t row0, int64_t col0, int64_t first_r, int64_t first_c, int64_t cells_c,
                               int64_t bm, int64_t bn, const float* __restrict__ amax_in, void* __restrict__ scales,
                               int formula) {
    __shared__ float factor;
    const Cell c = cell_of(rows, cols, row0, col0, first_r, first_c, cells_c, bm, bn);
    if (threadIdx.x == 0) {
        const float amax = amax_in[blockIdx.x];
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
        factor = mult;
        if (formula == DEEPGEMM_E8M0) ((uint8_t*)scales)[blockIdx.x] = byte;
        else ((float*)scales)[blockIdx.x] = stored;
    }
    __syncthreads();
    const float s = factor;
    const int w = (int)(c.c_hi - c.c_lo), tw = w < THREADS ? w : THREADS, per = THREADS / tw;
    const int tr = threadIdx.x / tw, tc = threadIdx.x % tw;
    if (tr >= per) return;
    for (int64_t r = c.r_lo + tr; r < c.r_hi; r += per) {
        const T* row = x + r * cols;
        uint8_t* out = values + r * cols;
        for (int64_t k = c.c_lo + tc; k < c.c_hi; k += tw) {
            const float v = fminf(fmaxf(widen<T>(row[k]) * s, -FP8_MAX), FP8_MAX);
            out[k] = (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
        }
    }
}

#define KERNELS(NAME, T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
    amax_##NAME(const T* x, int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t first_r,              \
                int64_t first_c, int64_t cells_c, int64_t bm, int64_t bn, float* amax_out) {                      \
        amax_block<T>(x, rows, cols, row0, col0, first_r, first_c, cells_c, bm, bn, amax_out);                    \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
    quantize_##NAME(const T* x, uint8_t* values, int64_t rows, int64_t cols, int64_t row0, int64_t col0,          \
                    int64_t first_r, int64_t first_c, int64_t cells_c, int64_t bm, int64_t bn,                    \
                    const float* amax_in, void* scales, int formula) {                                            \
        quantize_block<T>(x, values, rows, cols, row0, col0, first_r, first_c, cells_c, bm, bn, amax_in, scales,  \
                          formula);                                                                               \
    }

KERNELS(bf16, __nv_bfloat16)
KERNELS(f32, float)
