// Fused LARS step over a list of tensors: three launches in all, whatever the number of tensors.
//
// The tensors are described by device tables built by lightning_topk/cuda_ops.py:
//   meta[t*8 + 0..7]  = param ptr, grad ptr, momentum-buffer ptr, numel,
//                       codes (param | grad << 8 | buf << 16 | flags << 24; flags: 1 = adapt,
//                       2 = first step), first chunk, end chunk, unused
//   hyper[t*2 + 0..1] = lr, weight decay (fp32)
//   chunks[c*2 + 0..1] = tensor id, start element; a chunk covers LT_CHUNK elements of one tensor
//   partials[c*2 + 0..1] = sum p^2, sum g^2 of chunk c (fp64), written by lars_norms
//   trust[t] = the trust ratio of tensor t (fp32), written by lars_trust
// lars_norms and lars_update run one block of 256 threads per chunk, lars_trust one block per
// tensor, which adds up that tensor's chunk partials once (O(chunks) in all). Norms are reduced in a
// fixed order (chunk partials, then each tensor's partials by a block reduction of fixed shape), so
// the step is deterministic. All math is fp32 (norm accumulation fp64), whatever the storage dtypes;
// results are rounded once when stored. Compile without FMA contraction (--fmad=false) so each
// operation rounds like the torch reference.
#include "common.cuh"

#define LT_CHUNK 16384
#define LT_FLAG_ADAPT 1
#define LT_FLAG_FIRST 2

extern "C" __global__ void lars_norms(const long long* meta, const long long* chunks,
                                      double* partials) {
    __shared__ double s_red[32];
    const long long c = blockIdx.x;
    const long long t = chunks[2 * c], start = chunks[2 * c + 1];
    const long long* mt = meta + 8 * t;
    const int codes = (int)mt[4];
    if (!((codes >> 24) & LT_FLAG_ADAPT)) {  // uniform over the block
        if (threadIdx.x == 0) { partials[2 * c] = 0.0; partials[2 * c + 1] = 0.0; }
        return;
    }
    const void* p = (const void*)mt[0];
    const void* g = (const void*)mt[1];
    const long long end = min(start + (long long)LT_CHUNK, mt[3]);
    float sp = 0.f, sg = 0.f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float pv = lt_load(p, i, codes & 0xff), gv = lt_load(g, i, (codes >> 8) & 0xff);
        sp += pv * pv;
        sg += gv * gv;
    }
    const double tp = lt_block_sum((double)sp, s_red);
    const double tg = lt_block_sum((double)sg, s_red);
    if (threadIdx.x == 0) { partials[2 * c] = tp; partials[2 * c + 1] = tg; }
}

extern "C" __global__ void lars_trust(const long long* meta, const double* partials,
                                      const float* hyper, float trust_coeff, float eps,
                                      float* trust) {
    __shared__ double s_red[32];
    const long long t = blockIdx.x;
    const long long* mt = meta + 8 * t;
    if (!(((int)mt[4] >> 24) & LT_FLAG_ADAPT)) {  // uniform over the block
        if (threadIdx.x == 0) trust[t] = 1.f;
        return;
    }
    double sp = 0.0, sg = 0.0;
    for (long long q = mt[5] + threadIdx.x; q < mt[6]; q += blockDim.x) {
        sp += partials[2 * q];
        sg += partials[2 * q + 1];
    }
    const double tp = lt_block_sum(sp, s_red);
    const double tg = lt_block_sum(sg, s_red);
    if (threadIdx.x == 0) {
        const float w = (float)sqrt(tp), gn = (float)sqrt(tg), wd = hyper[2 * t + 1];
        trust[t] = (w == 0.f || gn == 0.f) ? 1.f : trust_coeff * w / (gn + wd * w + eps);
    }
}

extern "C" __global__ void lars_update(const long long* meta, const long long* chunks,
                                       const float* trust, const float* hyper, float momentum,
                                       int nesterov) {
    const long long c = blockIdx.x;
    const long long t = chunks[2 * c], start = chunks[2 * c + 1];
    const long long* mt = meta + 8 * t;
    const int codes = (int)mt[4];
    const int pc = codes & 0xff, gc = (codes >> 8) & 0xff, bc = (codes >> 16) & 0xff;
    const int flags = (codes >> 24) & 0xff;
    const bool adapt = flags & LT_FLAG_ADAPT, first = flags & LT_FLAG_FIRST;
    const float lr = hyper[2 * t], wd = hyper[2 * t + 1];
    const float tr = trust[t];
    void* p = (void*)mt[0];
    const void* g = (const void*)mt[1];
    void* buf = (void*)mt[2];
    const long long end = min(start + (long long)LT_CHUNK, mt[3]);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float pv = lt_load(p, i, pc), gv = lt_load(g, i, gc);
        const float d = adapt ? tr * (gv + wd * pv) : gv;
        const float b = first ? d : momentum * lt_load(buf, i, bc) + d;
        const float upd = nesterov ? d + momentum * b : b;
        lt_store(p, i, pc, pv - lr * upd);
        lt_store(buf, i, bc, b);
    }
}
