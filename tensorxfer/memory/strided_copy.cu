// One launch copies a whole static list of strided tiles between two device allocations.
//
// Why a kernel: a weight sync's row-parallel shards (o_proj, down_proj cut along dim 1) are thousands of
// rows a few KB wide.  The copy engines move such pitched copies (cuMemcpy2DAsync) at a fraction of the
// memory's bandwidth; warps reading 16-byte words move them at full speed, and a sync's schedule is static,
// so the tile list is built and uploaded once and every step is one launch.
//
// Built by setup.py into strided_copy.fatbin (SASS for sm_80 / sm_90, PTX for newer GPUs) and loaded with
// cuModuleLoadData by tensorxfer.memory._copy.StridedCopy; without nvcc the package falls back to
// cuMemcpy2DAsync and says so in its log.
//
// A tile: `rows` rows of `width` bytes from src_base + src_off + r * src_pitch to
// dst_base + dst_off + r * dst_pitch.  One block per tile; each warp takes every 8th row.
#include <stdint.h>

// Knobs, for benchmarks/probe_strided_kernel.py (which compiles variants with -D); the defaults are what
// setup.py builds.  TX_UNROLL: 16-byte words in flight per lane before its first store.  TX_STREAMING: 1
// marks loads and stores evict-first (__ldcs / __stcs): a copy's bytes are touched once.
#ifndef TX_UNROLL
#define TX_UNROLL 4
#endif
#ifndef TX_STREAMING
#define TX_STREAMING 0
#endif

struct Tile {
    uint64_t src_off, dst_off, width, rows, src_pitch, dst_pitch;
};

template <typename T>
__device__ __forceinline__ T load(const T* p) {
#if TX_STREAMING
    return __ldcs(p);
#else
    return *p;
#endif
}

template <typename T>
__device__ __forceinline__ void store(T* p, T v) {
#if TX_STREAMING
    __stcs(p, v);
#else
    *p = v;
#endif
}

template <typename T>
__device__ __forceinline__ void copy_rows(const char* src, char* dst, uint64_t width, uint64_t rows,
                                          uint64_t src_pitch, uint64_t dst_pitch) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const uint64_t words = width / sizeof(T);
    for (uint64_t r = warp; r < rows; r += warps) {
        const T* s = reinterpret_cast<const T*>(src + r * src_pitch);
        T* d = reinterpret_cast<T*>(dst + r * dst_pitch);
        uint64_t c = lane;
        // TX_UNROLL loads in flight per lane before the first store
        for (; c + 32 * (TX_UNROLL - 1) < words; c += 32 * TX_UNROLL) {
            T v[TX_UNROLL];
#pragma unroll
            for (int i = 0; i < TX_UNROLL; ++i) v[i] = load(s + c + 32 * i);
#pragma unroll
            for (int i = 0; i < TX_UNROLL; ++i) store(d + c + 32 * i, v[i]);
        }
        for (; c < words; c += 32) store(d + c, load(s + c));
    }
}

extern "C" __global__ void __launch_bounds__(256) strided_copy(const Tile* __restrict__ tiles,
                                                               uint64_t src_base, uint64_t dst_base) {
    const Tile t = tiles[blockIdx.x];
    const char* src = reinterpret_cast<const char*>(src_base + t.src_off);
    char* dst = reinterpret_cast<char*>(dst_base + t.dst_off);
    const uint64_t all = (src_base + t.src_off) | (dst_base + t.dst_off) | t.width | t.src_pitch | t.dst_pitch;
    if ((all & 15) == 0)
        copy_rows<uint4>(src, dst, t.width, t.rows, t.src_pitch, t.dst_pitch);
    else if ((all & 7) == 0)
        copy_rows<uint2>(src, dst, t.width, t.rows, t.src_pitch, t.dst_pitch);
    else if ((all & 3) == 0)
        copy_rows<uint32_t>(src, dst, t.width, t.rows, t.src_pitch, t.dst_pitch);
    else
        copy_rows<uint8_t>(src, dst, t.width, t.rows, t.src_pitch, t.dst_pitch);
}
