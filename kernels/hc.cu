// Hyper-connections: the token embedding into the HC streams, the Sinkhorn split, the weighted
// sum of streams, the post mix, and the output head's weights. Each output sums at most n_hc = 4
// terms, sequentially, in ds4's order (the canonical order for these ops).

// out[h*n_embd + d] = table[token][d] for each of the n_hc streams.
extern "C" __global__ void embed_hc(DS4_ARGS, const EmbedHcArgs a) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= a.n_embd) return;
    const float v = wload(a.table, a.is_f16, (u64)P->token * a.n_embd + d);
    for (u32 h = 0; h < a.n_hc; h++) a.out[h * a.n_embd + d] = v;
}

// One thread: 4 pre gates, 4 post gates and the 4x4 combine matrix, in ds4's exact order.
// The model config guarantees 4 streams; fixed sizes keep everything in registers.
extern "C" __global__ void hc_split(DS4_ARGS, const HcSplitArgs a) {
    DS4_GUARD;
    if (threadIdx.x != 0 || blockIdx.x != 0 || a.n_hc != 4) return;
    const int n = 4;
    const float* mix = a.mix;
    const float* scale = a.scale;
    const float* base = a.base;
    const float eps = a.eps;
    float c[16];
#pragma unroll
    for (int i = 0; i < n; i++) {
        a.split[i] = 1.0f / (1.0f + ds4_expf(-(mix[i] * scale[0] + base[i]))) + eps;
        a.split[n + i] = 2.0f / (1.0f + ds4_expf(-(mix[n + i] * scale[1] + base[n + i])));
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
    for (u32 it = 0; it < a.iters; it++) {
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
    for (int i = 0; i < n * n; i++) a.split[2 * n + i] = c[i];
}

// out[d] = sum_h weights[h] * hc[h*n + d]
extern "C" __global__ void hc_weighted_sum(DS4_ARGS, const HcWeightedSumArgs a) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= a.n) return;
    float acc = 0.0f;
    for (u32 h = 0; h < a.n_hc; h++) acc += a.hc[h * a.n + d] * a.weights[h];
    a.out[d] = acc;
}

// out[dst][d] = post[dst]*block[d] + sum_src comb[dst + src*n_hc] * residual[src][d]
extern "C" __global__ void hc_post(DS4_ARGS, const HcPostArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n * a.n_hc) return;
    const u32 dst = i / a.n, d = i % a.n;
    const float* post = a.split + a.n_hc;
    const float* comb = a.split + 2 * a.n_hc;
    float acc = a.block[d] * post[dst];
    for (u32 src = 0; src < a.n_hc; src++) acc += comb[dst + src * a.n_hc] * a.residual[src * a.n + d];
    a.out[i] = acc;
}

// w = sigmoid(pre*scale + base) + eps, no Sinkhorn.
extern "C" __global__ void hc_head_weights(DS4_ARGS, const HcHeadWeightsArgs a) {
    DS4_GUARD;
    const u32 i = threadIdx.x;
    if (i < a.n) a.out[i] = sigmoid_stable(a.pre[i] * a.scale[0] + a.base[i]) + a.eps;
}
