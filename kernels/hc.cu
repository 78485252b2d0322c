// Hyper-connections: the token embedding into the HC streams, the Sinkhorn split, the weighted
// sum of streams, the post mix, and the output head's weights.

// out[h*n_embd + d] = table[token][d] for each of the n_hc streams.
extern "C" __global__ void embed_hc(DS4_ARGS, const void* __restrict__ table, u32 is_f16, float* __restrict__ out,
                                    u32 n_embd, u32 n_hc) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= n_embd) return;
    const float v = wload(table, is_f16, (u64)P->token * n_embd + d);
    for (u32 h = 0; h < n_hc; h++) out[h * n_embd + d] = v;
}

// One thread: 4 pre gates, 4 post gates and the 4x4 combine matrix, in ds4's exact order.
// The model config guarantees 4 streams; fixed sizes keep everything in registers.
extern "C" __global__ void hc_split(DS4_ARGS, const float* __restrict__ mix, const float* __restrict__ scale,
                                    const float* __restrict__ base, float* __restrict__ split, u32 n_hc, u32 iters,
                                    float eps) {
    DS4_GUARD;
    if (threadIdx.x != 0 || blockIdx.x != 0 || n_hc != 4) return;
    const int n = 4;
    float c[16];
#pragma unroll
    for (int i = 0; i < n; i++) {
        split[i] = 1.0f / (1.0f + ds4_expf(-(mix[i] * scale[0] + base[i]))) + eps;
        split[n + i] = 2.0f / (1.0f + ds4_expf(-(mix[n + i] * scale[1] + base[n + i])));
    }
#pragma unroll
    for (int dst = 0; dst < n; dst++) {
        float mx = -1.0e30f;
#pragma unroll
        for (int src = 0; src < n; src++) {
            const int k = 2 * n + src + dst * n;
            c[src + dst * n] = mix[k] * scale[2] + base[k];
            mx = fmaxf(mx, c[src + dst * n]);
        }
        float sum = 0.0f;
#pragma unroll
        for (int src = 0; src < n; src++) {
            c[src + dst * n] = ds4_expf(c[src + dst * n] - mx);
            sum += c[src + dst * n];
        }
        const float inv = 1.0f / sum;
#pragma unroll
        for (int src = 0; src < n; src++) c[src + dst * n] = c[src + dst * n] * inv + eps;
    }
    for (u32 it = 0; it < iters; it++) {
        if (it > 0) {
#pragma unroll
            for (int dst = 0; dst < n; dst++) {
                float sum = 0.0f;
#pragma unroll
                for (int src = 0; src < n; src++) sum += c[src + dst * n];
                const float inv = 1.0f / (sum + eps);
#pragma unroll
                for (int src = 0; src < n; src++) c[src + dst * n] *= inv;
            }
        }
#pragma unroll
        for (int src = 0; src < n; src++) {
            float sum = 0.0f;
#pragma unroll
            for (int dst = 0; dst < n; dst++) sum += c[src + dst * n];
            const float inv = 1.0f / (sum + eps);
#pragma unroll
            for (int dst = 0; dst < n; dst++) c[src + dst * n] *= inv;
        }
    }
#pragma unroll
    for (int i = 0; i < n * n; i++) split[2 * n + i] = c[i];
}

// out[d] = sum_h weights[h] * hc[h*n + d]
extern "C" __global__ void hc_weighted_sum(DS4_ARGS, const float* __restrict__ hc, const float* __restrict__ weights,
                                           float* __restrict__ out, u32 n, u32 n_hc) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= n) return;
    float acc = 0.0f;
    for (u32 h = 0; h < n_hc; h++) acc += hc[h * n + d] * weights[h];
    out[d] = acc;
}

// out[dst][d] = post[dst]*block[d] + sum_src comb[dst + src*n_hc] * residual[src][d]
extern "C" __global__ void hc_post(DS4_ARGS, const float* __restrict__ block, const float* __restrict__ residual,
                                   const float* __restrict__ split, float* __restrict__ out, u32 n, u32 n_hc) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * n_hc) return;
    const u32 dst = i / n, d = i % n;
    const float* post = split + n_hc;
    const float* comb = split + 2 * n_hc;
    float acc = block[d] * post[dst];
    for (u32 src = 0; src < n_hc; src++) acc += comb[dst + src * n_hc] * residual[src * n + d];
    out[i] = acc;
}

// w = sigmoid(pre*scale + base) + eps, no Sinkhorn.
extern "C" __global__ void hc_head_weights(DS4_ARGS, const float* __restrict__ pre, const float* __restrict__ scale,
                                           const float* __restrict__ base, float* __restrict__ out, u32 n, float eps) {
    DS4_GUARD;
    const u32 i = threadIdx.x;
    if (i < n) out[i] = sigmoid_stable(pre[i] * scale[0] + base[i]) + eps;
}
