// One-pass multi-threshold count: hist[j] += #{i : j+1 thresholds are <= x[i]} for ascending
// thresholds t[0..m-1] (the caller has replaced NaN thresholds by +inf and zeroes their counts
// afterwards). The caller turns the histogram into counts with a suffix sum:
// count(x >= t[j]) = sum(hist[j:]). Each element is read once, placed by a binary search, and
// counted in a per-block shared-memory histogram that is flushed with one global atomic per bin at
// the end.
//
// Launch: grid-stride, blockDim.x = 256, dynamic shared memory = m * (4 + 4) bytes.
#include "common.cuh"

template <int CODE>
__device__ __forceinline__ void mtc_body(const void* x, long long n, const float* thr, int m,
                                         unsigned long long* hist) {
    extern __shared__ unsigned int s_mem[];
    unsigned int* s_hist = s_mem;
    float* s_thr = (float*)(s_mem + m);
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        s_hist[j] = 0u;
        s_thr[j] = thr[j];
    }
    __syncthreads();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = lt_load(x, i, CODE);
        int lo = 0, hi = m;  // number of thresholds <= v (NaN v: none)
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (s_thr[mid] <= v) lo = mid + 1; else hi = mid;
        }
        if (lo > 0) atomicAdd(&s_hist[lo - 1], 1u);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        const unsigned int c = s_hist[j];
        if (c) atomicAdd(&hist[j], (unsigned long long)c);
    }
}

extern "C" __global__ void multi_threshold_count_f32(const float* x, long long n, const float* thr,
                                                     int m, unsigned long long* hist) {
    mtc_body<LT_F32>(x, n, thr, m, hist);
}
extern "C" __global__ void multi_threshold_count_f16(const unsigned short* x, long long n,
                                                     const float* thr, int m,
                                                     unsigned long long* hist) {
    mtc_body<LT_F16>(x, n, thr, m, hist);
}
extern "C" __global__ void multi_threshold_count_bf16(const unsigned short* x, long long n,
                                                      const float* thr, int m,
                                                      unsigned long long* hist) {
    mtc_body<LT_BF16>(x, n, thr, m, hist);
}
