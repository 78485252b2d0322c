// Sink attention for one token in the canonical order: per head, softmax over {sink} ∪ raw
// window rows ∪ visible compressed rows (K == V), the sink in the denominator only. One block
// per head; `scores` is scratch with `max_rows` floats per head.
//   s_r = dot(q, k_r) * kq_scale (the canonical f32 dot, one warp per row)
//   w_r = exp(s_r - max(sink, s...))
//   rows in chunks of DS4_ATTN_ROW_CHUNK: inside a chunk the weights and each output dim add
//   sequentially from +0; denom = exp(sink - m) + chunk sums in order; out = (sum of chunk sums) * (1/denom).
// Parallel shape: a block of up to 1024 threads per head. Scores: a warp per row. Denominator:
// a thread per chunk sums its weights, then one thread adds the chunk sums in order. Output:
// a thread per (chunk, dim) sums the chunk's rows, batches of chunks held in shared memory, and
// the thread that owns a dim adds them in order (head_dim <= blockDim, plan.rs checks it).
#define ATTN_PART 4096
extern "C" __global__ void __launch_bounds__(1024) attention(DS4_ARGS, AttentionArgs a) {
    DS4_GUARD;
    __shared__ float denom_sh;
    __shared__ float part[ATTN_PART];
    const u32 h = blockIdx.x;
    const u32 head_dim = a.head_dim;
    const u32 n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    const bool indexed = a.selected != 0 && n_comp > a.top_k;
    const u32 n_vis = indexed ? a.top_k : n_comp;
    const u32 n_rows = n_raw + n_vis;
    const u32 first = P->pos + 1 - n_raw;
    const float* qh = a.q + (u64)h * head_dim;
    float* sc = a.scores + (u64)h * a.max_rows;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 n_chunks = (n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;

    // Row r: raw rows oldest first, then compressed rows in ascending order.
#define ROW_PTR(r) ((r) < n_raw ? a.raw + (u64)((first + (r)) % a.raw_cap) * head_dim \
                                : a.comp + (u64)(indexed ? a.selected[(r) - n_raw] : (int)((r) - n_raw)) * head_dim)
    for (u32 r = warp; r < n_rows; r += nw) {
        const float d = warp_dot_f32(qh, ROW_PTR(r), head_dim, lane);
        if (lane == 0) sc[r] = d * a.kq_scale;
    }
    __syncthreads();
    const float sink = a.sinks[h];
    float m = sink;
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) m = fmaxf(m, sc[r]);
    m = block_max(m);
    __syncthreads();
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) sc[r] = ds4_expf(sc[r] - m);
    __syncthreads();
    // Each chunk's weight sum from +0, sequentially; then the sink's weight and the chunk sums
    // in order (plan.rs: n_chunks <= ATTN_PART).
    for (u32 c = threadIdx.x; c < n_chunks; c += blockDim.x) {
        float s = 0.0f;
        const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
        for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) s += sc[r];
        part[c] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float denom = ds4_expf(sink - m);
        for (u32 c = 0; c < n_chunks; c++) denom += part[c];
        denom_sh = denom;
    }
    __syncthreads();
    const float inv = 1.0f / denom_sh;
    const u32 batch = ATTN_PART / head_dim;
    float acc = 0.0f;
    for (u32 c0 = 0; c0 < n_chunks; c0 += batch) {
        const u32 nc = min(batch, n_chunks - c0);
        for (u32 task = threadIdx.x; task < nc * head_dim; task += blockDim.x) {
            const u32 c = c0 + task / head_dim, i = task % head_dim;
            const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
            float p = 0.0f;
#pragma unroll 8
            for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) p += sc[r] * ROW_PTR(r)[i];
            part[task] = p;
        }
        __syncthreads();
        if (threadIdx.x < head_dim)
            for (u32 c = 0; c < nc; c++) acc += part[c * head_dim + threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.x < head_dim) a.out[(u64)h * head_dim + threadIdx.x] = acc * inv;
#undef ROW_PTR
    // Fused (plan.rs): the inverse RoPE of the head's tail, then the head's Q8_0 quantization for
    // the output projection, as rope_tail and quantize_q8_0 would compute them.
    float* oh = a.out + (u64)h * head_dim;
    if (a.rope) {
        __syncthreads();
        const u32 pairs = a.n_rot / 2;
        rope_tail_block(oh + (head_dim - a.n_rot), a.rope + (u64)P->pos * pairs * 2, pairs, true);
    }
    if (a.xq) {
        __syncthreads();
        for (u32 b = warp; b < head_dim / 32; b += nw) {
            const u32 blk = h * (head_dim / 32) + b;
            quantize_q8_0_warp(oh[b * 32 + lane], a.xq, a.xd, blk, lane);
        }
    }
}
