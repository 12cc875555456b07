// MSTopK compaction: from x, pack every entry with |x| >= hi, then the first (k - count_hi) entries,
// in index order, with lo <= |x| < hi, into values (dtype of x) and int32 indices. Output order:
// the `hi` entries in index order, followed by the band entries in index order.
//
// The thresholds come from device memory (thr[0] = hi, thr[1] = lo) and so does count_hi, so the
// caller never has to read anything back: the whole selection can stay on the GPU.
//
// Two launches over tiles of TILE = 256 * 16 consecutive entries, one tile per block:
//   compact_count_*: per-tile counts (hi, band) -> counts[2*b], counts[2*b+1];
//   (the caller turns them into exclusive offsets across tiles with a cumsum on the device; the
//   inclusive sum of the last tile, totals[0] = count_hi, totals[1] = count_band, stays there too)
//   compact_write_*: each tile walks its 16 rows of 256 entries in index order; a block-wide
//   exclusive scan of a packed flag (hi in the low 16 bits, band in the high 16 bits) gives each
//   selected entry its rank, so positions are tile offset + running row carry + rank in the row.
// blockDim.x must be 256.
#include "common.cuh"

#define LT_CBLOCK 256
#define LT_CITEMS 16
#define LT_TILE (LT_CBLOCK * LT_CITEMS)

// 1 = |v| >= hi, 1 << 16 = lo <= |v| < hi, 0 otherwise (NaN: 0)
__device__ __forceinline__ unsigned int lt_flag(float v, float hi, float lo) {
    const float a = fabsf(v);
    return a >= hi ? 1u : (a >= lo ? 65536u : 0u);
}

template <int CODE>
__device__ __forceinline__ void compact_count_body(const void* x, long long n, const float* thr,
                                                   long long* counts) {
    __shared__ unsigned int s_scan[33];
    const float hi = thr[0], lo = thr[1];
    const long long base = (long long)blockIdx.x * LT_TILE;
    unsigned int f = 0u;  // at most 16 per field per thread
#pragma unroll
    for (int r = 0; r < LT_CITEMS; ++r) {
        const long long i = base + (long long)r * LT_CBLOCK + threadIdx.x;
        if (i < n) f += lt_flag(lt_load(x, i, CODE), hi, lo);
    }
    unsigned int total;
    lt_block_exclusive_scan(f, s_scan, &total);  // total <= 4096 per field: no carry between fields
    if (threadIdx.x == 0) {
        counts[2 * (long long)blockIdx.x] = (long long)(total & 0xffffu);
        counts[2 * (long long)blockIdx.x + 1] = (long long)(total >> 16);
    }
}

template <int CODE, typename T>
__device__ __forceinline__ void compact_write_body(const T* x, long long n, const float* thr,
                                                   const long long* offsets, const long long* totals,
                                                   long long k, T* out_values, int* out_indices) {
    __shared__ unsigned int s_scan[33];
    const float hi = thr[0], lo = thr[1];
    long long hi_pos = offsets[2 * (long long)blockIdx.x];
    long long band_pos = totals[0] + offsets[2 * (long long)blockIdx.x + 1];
    if (hi_pos >= k && band_pos >= k) return;  // uniform over the block: nothing of this tile is kept
    const long long base = (long long)blockIdx.x * LT_TILE;
    for (int r = 0; r < LT_CITEMS; ++r) {
        const long long i = base + (long long)r * LT_CBLOCK + threadIdx.x;
        T raw;
        unsigned int f = 0u;
        if (i < n) {
            raw = x[i];
            f = lt_flag(lt_load(x, i, CODE), hi, lo);
        }
        unsigned int total;
        const unsigned int rank = lt_block_exclusive_scan(f, s_scan, &total);
        long long pos = -1;
        if (f == 1u) pos = hi_pos + (rank & 0xffffu);
        else if (f == 65536u) pos = band_pos + (rank >> 16);
        if (pos >= 0 && pos < k) {
            out_values[pos] = raw;
            out_indices[pos] = (int)i;
        }
        hi_pos += total & 0xffffu;
        band_pos += total >> 16;
    }
}

#define LT_COMPACT_KERNELS(SUFFIX, CODE, T)                                                        \
    extern "C" __global__ void compact_count_##SUFFIX(const T* x, long long n, const float* thr,    \
                                                      long long* counts) {                        \
        compact_count_body<CODE>(x, n, thr, counts);                                              \
    }                                                                                              \
    extern "C" __global__ void compact_write_##SUFFIX(const T* x, long long n, const float* thr,    \
                                                      const long long* offsets,                   \
                                                      const long long* totals, long long k,       \
                                                      T* out_values, int* out_indices) {          \
        compact_write_body<CODE, T>(x, n, thr, offsets, totals, k, out_values, out_indices);      \
    }

LT_COMPACT_KERNELS(f32, LT_F32, float)
LT_COMPACT_KERNELS(f16, LT_F16, unsigned short)
LT_COMPACT_KERNELS(bf16, LT_BF16, unsigned short)
