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

// One warp: lanes 0..7 make the 4 pre and 4 post gates; lane k < 16 holds the combine matrix's
// element k = src + dst*4 through the softmax and the 20 Sinkhorn iterations. Every row and column
// sum reads its four elements by shuffles and adds them in ds4's order (dst, or src, ascending),
// so each lane computes exactly what the serial reference does. Called by all 32 lanes of a warp.
__device__ void hc_split_warp(const float* mix, const float* scale, const float* base, float* split, u32 iters,
                              float eps) {
    const u32 lane = threadIdx.x & 31;
    const int n = 4;
    if (lane < 4) split[lane] = 1.0f / (1.0f + ds4_expf(-(mix[lane] * scale[0] + base[lane]))) + eps;
    else if (lane < 8) split[lane] = 2.0f / (1.0f + ds4_expf(-(mix[lane] * scale[1] + base[lane])));
    const u32 k = lane & 15, src = k & 3, dst = k >> 2;
    float c = mix[2 * n + k] * scale[2] + base[2 * n + k];
    // Softmax over src for each dst row, then + eps.
    float mx = -1.0e30f;
    for (u32 s = 0; s < 4; s++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, c, dst * 4 + s));
    c = ds4_expf(c - mx);
    float sum = 0.0f;
    for (u32 s = 0; s < 4; s++) sum += __shfl_sync(0xffffffffu, c, dst * 4 + s);
    c = c * (1.0f / sum) + eps;
    for (u32 it = 0; it < iters; it++) {
        if (it > 0) {
            float t = 0.0f;  // this dst row, over src
            for (u32 s = 0; s < 4; s++) t += __shfl_sync(0xffffffffu, c, dst * 4 + s);
            c *= 1.0f / (t + eps);
        }
        float t = 0.0f;  // this src column, over dst
        for (u32 d = 0; d < 4; d++) t += __shfl_sync(0xffffffffu, c, d * 4 + src);
        c *= 1.0f / (t + eps);
    }
    if (lane < 16) split[2 * n + k] = c;
}

extern "C" __global__ void hc_split(DS4_ARGS, const HcSplitArgs a) {
    DS4_GUARD;
    if (blockIdx.x != 0 || a.n_hc != 4) return;
    hc_split_warp(a.mix, a.scale, a.base, a.split, a.iters, a.eps);
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
// With `block_b` (an Add fused in front), block = block[d] + block_b[d], also stored to `sum_out`.
extern "C" __global__ void hc_post(DS4_ARGS, const HcPostArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n * a.n_hc) return;
    const u32 dst = i / a.n, d = i % a.n;
    const float* post = a.split + a.n_hc;
    const float* comb = a.split + 2 * a.n_hc;
    float blk = a.block[d];
    if (a.block_b) {
        blk = blk + a.block_b[d];
        if (dst == 0) a.sum_out[d] = blk;
    }
    float acc = blk * post[dst];
    for (u32 src = 0; src < a.n_hc; src++) acc += comb[dst + src * a.n_hc] * a.residual[src * a.n + d];
    a.out[i] = acc;
}

// w = sigmoid(pre*scale + base) + eps, no Sinkhorn.
extern "C" __global__ void hc_head_weights(DS4_ARGS, const HcHeadWeightsArgs a) {
    DS4_GUARD;
    const u32 i = threadIdx.x;
    if (i < a.n) a.out[i] = sigmoid_stable(a.pre[i] * a.scale[0] + a.base[i]) + a.eps;
}
