// Dense rebuild from gathered sparse buffers: out[indices[i]] += values[i] * scale, with atomics so
// that an index picked by several ranks adds up (never overwrites). The product is rounded to the
// dtype of out before the add, like torch's out.index_add_(0, indices, values * scale).
// Out-of-range indices are skipped and flagged in *bad (the caller may check it).
//
// Launch: grid-stride, any blockDim.x.
#include "common.cuh"

// 16-bit float add through a CAS on the aligned 32-bit word that holds it.
template <int CODE>
__device__ __forceinline__ void lt_atomic_add_16(unsigned short* addr, float v) {
    unsigned int* word = (unsigned int*)((unsigned long long)addr & ~3ull);
    const unsigned int shift = ((unsigned long long)addr & 2ull) ? 16u : 0u;
    unsigned int old = *word, assumed;
    do {
        assumed = old;
        const unsigned short h = (unsigned short)((assumed >> shift) & 0xffffu);
        const float sum = (CODE == LT_F16 ? lt_h2f(h) : lt_bf2f(h)) + v;
        const unsigned short r = CODE == LT_F16 ? lt_f2h(sum) : lt_f2bf(sum);
        const unsigned int repl = (assumed & ~(0xffffu << shift)) | ((unsigned int)r << shift);
        old = atomicCAS(word, assumed, repl);
    } while (assumed != old);
}

#define LT_SCATTER_LOOP(BODY)                                                                      \
    const long long stride = (long long)gridDim.x * blockDim.x;                                   \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nnz; i += stride) {  \
        const long long j = indices[i];                                                           \
        if (j < 0 || j >= n_out) { *bad = 1; continue; }                                          \
        BODY;                                                                                     \
    }

extern "C" __global__ void scatter_add_f32(float* out, long long n_out, const float* values,
                                           const int* indices, long long nnz, float scale,
                                           int* bad) {
    LT_SCATTER_LOOP(atomicAdd(out + j, __fmul_rn(values[i], scale)))
}

extern "C" __global__ void scatter_add_f64(double* out, long long n_out, const double* values,
                                           const int* indices, long long nnz, double scale,
                                           int* bad) {
    LT_SCATTER_LOOP(atomicAdd(out + j, __dmul_rn(values[i], scale)))
}

extern "C" __global__ void scatter_add_f16(unsigned short* out, long long n_out,
                                           const unsigned short* values, const int* indices,
                                           long long nnz, float scale, int* bad) {
    LT_SCATTER_LOOP(lt_atomic_add_16<LT_F16>(out + j,
                                             lt_h2f(lt_f2h(__fmul_rn(lt_h2f(values[i]), scale)))))
}

extern "C" __global__ void scatter_add_bf16(unsigned short* out, long long n_out,
                                            const unsigned short* values, const int* indices,
                                            long long nnz, float scale, int* bad) {
    LT_SCATTER_LOOP(lt_atomic_add_16<LT_BF16>(
        out + j, lt_bf2f(lt_f2bf(__fmul_rn(lt_bf2f(values[i]), scale)))))
}
