// Shared device helpers for lightning_topk's kernels.
//
// Every .cu file in this directory is compiled on its own by CuPy's RawModule (NVRTC) after the
// loader in lightning_topk/cuda_ops.py has pasted this header in place of its #include line, so
// nothing here may rely on host headers: no <cuda_fp16.h>, no <cstdint>. Kernels are
// `extern "C" __global__` so RawModule.get_function finds them by their plain names.
#pragma once

// dtype codes, shared with cuda_ops.py (_DTYPE_CODE)
#define LT_F32 0
#define LT_F16 1
#define LT_BF16 2
#define LT_F64 3

// fp16 <-> fp32 through PTX cvt (round to nearest even), so that no fp16 header is needed.
__device__ __forceinline__ float lt_h2f(unsigned short h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short lt_f2h(float f) {
    unsigned short h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
// bf16 is the top half of an fp32; fp32 -> bf16 rounds to nearest even like torch (NaN -> 0x7FC0).
__device__ __forceinline__ float lt_bf2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short lt_f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Load element i of a buffer of dtype `code` as fp32 / store an fp32 into it (rounding once).
__device__ __forceinline__ float lt_load(const void* p, long long i, int code) {
    if (code == LT_F16) return lt_h2f(((const unsigned short*)p)[i]);
    if (code == LT_BF16) return lt_bf2f(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}
__device__ __forceinline__ void lt_store(void* p, long long i, int code, float v) {
    if (code == LT_F16) ((unsigned short*)p)[i] = lt_f2h(v);
    else if (code == LT_BF16) ((unsigned short*)p)[i] = lt_f2bf(v);
    else ((float*)p)[i] = v;
}

// Exclusive prefix sum over a block (blockDim.x a multiple of 32, at most 1024) in thread order.
// `s` must hold 33 entries of shared memory; *total receives the block-wide sum. All threads of the
// block must call it (it synchronises).
__device__ __forceinline__ unsigned int lt_block_exclusive_scan(unsigned int v, unsigned int* s,
                                                                unsigned int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    unsigned int x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        unsigned int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned int w = lane < nwarps ? s[lane] : 0u, ws = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned int y = __shfl_up_sync(0xffffffffu, ws, d);
            if (lane >= d) ws += y;
        }
        if (lane < nwarps) s[lane] = ws - w;
        if (lane == 31) s[32] = ws;
    }
    __syncthreads();
    const unsigned int r = s[warp] + x - v;
    *total = s[32];
    __syncthreads();  // s is reused by the next call
    return r;
}

// Block-wide sum of a double (same calling rules; `s` holds 32 doubles). Result valid in all threads.
__device__ __forceinline__ double lt_block_sum(double v, double* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_down_sync(0xffffffffu, v, d);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double w = lane < nwarps ? s[lane] : 0.0;
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) w += __shfl_down_sync(0xffffffffu, w, d);
        if (lane == 0) s[0] = w;
    }
    __syncthreads();
    const double r = s[0];
    __syncthreads();
    return r;
}
