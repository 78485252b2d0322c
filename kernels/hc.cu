// Hyper-connections: the token embedding into the HC streams, the Sinkhorn split, the weighted
// sum of streams, the post mix, and the output head's weights. Each output sums at most n_hc = 4
// terms, sequentially, in ds4's order (the canonical order for these ops).

// out[h*n_embd + d] = table[token][d] for each of the n_hc streams.
extern "C" __global__ void embed_hc(DS4_ARGS, EmbedHcArgs a) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= a.n_embd) return;
    const float v = wload(a.table, a.is_f16, (u64)P->token * a.n_embd + d);
    for (u32 h = 0; h < a.n_hc; h++) a.out[h * a.n_embd + d] = v;
}

// A pre gate: sigmoid(mix * scale + base) + eps, in ds4's form.
__device__ __forceinline__ float hc_pre_gate(float mix, const float* scale, float base, float eps) {
    return 1.0f / (1.0f + ds4_expf(-(mix * scale[0] + base))) + eps;
}

// One warp: lanes 0..7 make the 4 pre and 4 post gates; lane k < 16 holds the combine matrix's
// element k = src + dst*4 through the softmax and the 20 Sinkhorn iterations. Every row and column
// sum reads its four elements by shuffles and adds them in ds4's order (dst, or src, ascending),
// so each lane computes exactly what the serial reference does. Called by all 32 lanes of a warp.
// Without `with_pre` the 4 pre gates (which read mix[0..4]) are left to the caller.
__device__ void hc_split_warp(const float* mix, const float* scale, const float* base, float* split, u32 iters,
                              float eps, bool with_pre) {
    const u32 lane = threadIdx.x & 31;
    const int n = 4;
    if (lane < 4) {
        if (with_pre) split[lane] = hc_pre_gate(mix[lane], scale, base[lane], eps);
    }
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

extern "C" __global__ void hc_split(DS4_ARGS, HcSplitArgs a) {
    DS4_GUARD;
    if (blockIdx.x != 0 || a.n_hc != 4) return;
    hc_split_warp(a.mix, a.scale, a.base, a.split, a.iters, a.eps, true);
}

// out[d] = sum_h weights[h] * hc[h*n + d]
extern "C" __global__ void hc_weighted_sum(DS4_ARGS, HcWeightedSumArgs a) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= a.n) return;
    float acc = 0.0f;
    for (u32 h = 0; h < a.n_hc; h++) acc += a.hc[h * a.n + d] * a.weights[h];
    a.out[d] = acc;
}

// out[dst][d] = post[dst]*block[d] + sum_src comb[dst + src*n_hc] * residual[src][d]
// With `block_b` (an Add fused in front), block = block[d] + block_b[d], also stored to `sum_out`.
// A warp per 512 outputs, lane l taking 4 consecutive ones per 128: the lanes of the canonical
// sum of squares, so with `ss` it also stores each 512-chunk's sum of squares of `out`, from which
// the next hc_pre takes the RMS norm of the streams without reading them again. n % 4 == 0,
// n_hc <= 4.
// One warp's 512-output chunk of the HC post: lane l computes outputs chunk*512 + 128u + 4l + j
// (the lanes of the canonical sum of squares), stores them to `out` (and the Add's sum) when
// `store`, and to xs[128u + 4l + j] when xs is set. Returns the chunk's sum of squares (every
// lane), 0 for a chunk past the outputs.
__device__ __forceinline__ float hc_post_chunk(const HcPostArgs& a, u32 chunk, u32 lane, bool store, float* xs) {
    const u32 total = a.n * a.n_hc, c0 = chunk * DS4_CHUNK;
    if (c0 >= total) return 0.0f;
    const float* post = a.split + a.n_hc;
    const float* comb = a.split + 2 * a.n_hc;
    // Every load first (out may not alias the inputs, but the compiler cannot know that).
    float4 bl[4], bb[4], res[4][4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = c0 + u * 128 + lane * 4, d = i % a.n;
        const bool ok = i < total;
        bl[u] = ok ? *(const float4*)(a.block + d) : make_float4(0, 0, 0, 0);
        bb[u] = ok && a.block_b ? *(const float4*)(a.block_b + d) : make_float4(0, 0, 0, 0);
#pragma unroll
        for (u32 src = 0; src < 4; src++)
            res[u][src] = ok && src < a.n_hc ? *(const float4*)(a.residual + src * a.n + d) : make_float4(0, 0, 0, 0);
    }
    float sq = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = c0 + u * 128 + lane * 4, dst = i / a.n, d = i % a.n;
        if (i >= total) break;
        float v[4] = {bl[u].x, bl[u].y, bl[u].z, bl[u].w};
        if (a.block_b) {
            v[0] = v[0] + bb[u].x, v[1] = v[1] + bb[u].y, v[2] = v[2] + bb[u].z, v[3] = v[3] + bb[u].w;
            if (store && dst == 0) *(float4*)(a.sum_out + d) = make_float4(v[0], v[1], v[2], v[3]);
        }
        float o[4];
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            float acc = v[j] * post[dst];
#pragma unroll
            for (u32 src = 0; src < 4; src++) {
                const float r = j == 0 ? res[u][src].x : j == 1 ? res[u][src].y : j == 2 ? res[u][src].z : res[u][src].w;
                if (src < a.n_hc) acc += comb[dst + src * a.n_hc] * r;
            }
            o[j] = acc;
            sq += acc * acc;
        }
        if (store) *(float4*)(a.out + i) = make_float4(o[0], o[1], o[2], o[3]);
        if (xs) *(float4*)(xs + u * 128 + lane * 4) = make_float4(o[0], o[1], o[2], o[3]);
    }
    return warp_sum(sq);
}

// The HC post's outputs at positions dr*512 .. dr*512 + 511 of every stream, from one load of
// the inputs they share (n a multiple of 512, so each is chunk dst * (n / 512) + dr of the
// outputs): lane l holds positions 128u + 4l + j as hc_post_chunk does, and each value and each
// chunk's sum of squares comes out exactly as there. Stores them (and the Add's sum) when
// `store`, and to keep[dst * n + d] when `keep` is set; sq[dst] is chunk dst's sum of squares
// (every lane).
__device__ __forceinline__ void hc_post_range(const HcPostArgs& a, u32 dr, u32 lane, bool store, float* sq,
                                              float* keep) {
    const float* post = a.split + a.n_hc;
    const float* comb = a.split + 2 * a.n_hc;
    // Each stream's sum adds its values in hc_post_chunk's order (u, then j) from +0.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 d = dr * DS4_CHUNK + u * 128 + lane * 4;
        const float4 bl = *(const float4*)(a.block + d);
        const float4 bb = a.block_b ? *(const float4*)(a.block_b + d) : make_float4(0, 0, 0, 0);
        float4 res[4];
#pragma unroll
        for (u32 src = 0; src < 4; src++)
            res[src] = src < a.n_hc ? *(const float4*)(a.residual + src * a.n + d) : make_float4(0, 0, 0, 0);
        float v[4] = {bl.x, bl.y, bl.z, bl.w};
        if (a.block_b) {
            v[0] = v[0] + bb.x, v[1] = v[1] + bb.y, v[2] = v[2] + bb.z, v[3] = v[3] + bb.w;
            if (store) *(float4*)(a.sum_out + d) = make_float4(v[0], v[1], v[2], v[3]);
        }
#pragma unroll
        for (u32 dst = 0; dst < 4; dst++) {
            if (dst >= a.n_hc) break;
            float o[4];
#pragma unroll
            for (u32 j = 0; j < 4; j++) {
                float acc = v[j] * post[dst];
#pragma unroll
                for (u32 src = 0; src < 4; src++) {
                    const float r = j == 0 ? res[src].x : j == 1 ? res[src].y : j == 2 ? res[src].z : res[src].w;
                    if (src < a.n_hc) acc += comb[dst + src * a.n_hc] * r;
                }
                o[j] = acc;
                s[dst] += acc * acc;
            }
            if (store) *(float4*)(a.out + dst * a.n + d) = make_float4(o[0], o[1], o[2], o[3]);
            if (keep) *(float4*)(keep + dst * a.n + d) = make_float4(o[0], o[1], o[2], o[3]);
        }
    }
#pragma unroll
    for (u32 dst = 0; dst < 4; dst++) sq[dst] = warp_sum(s[dst]);
}

extern "C" __global__ void hc_post(DS4_ARGS, HcPostArgs a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31, chunk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float sq = hc_post_chunk(a, chunk, lane, true, nullptr);
    if (a.ss && lane == 0 && chunk * DS4_CHUNK < a.n * a.n_hc) a.ss[chunk] = sq;
}

// w = sigmoid(pre*scale + base) + eps, no Sinkhorn.
extern "C" __global__ void hc_head_weights(DS4_ARGS, HcHeadWeightsArgs a) {
    DS4_GUARD;
    const u32 i = threadIdx.x;
    if (i < a.n) a.out[i] = sigmoid_stable(a.pre[i] * a.scale[0] + a.base[i]) + a.eps;
}
