// Sink attention for one token: per head, softmax over {sink} ∪ raw window rows ∪ visible
// compressed rows (K == V), the sink in the denominator only. One block per head; `scores` is
// scratch with `max_rows` floats per head. Dots, the denominator and each output element sum
// in the CPU reference's order.
extern "C" __global__ void attention(DS4_ARGS, const float* __restrict__ q, const float* __restrict__ raw,
                                     const float* __restrict__ comp, const int* __restrict__ selected,
                                     const float* __restrict__ sinks, float* __restrict__ out,
                                     float* __restrict__ scores, u32 head_dim, u32 window, u32 raw_cap, u32 ratio,
                                     u32 comp_cap, u32 top_k, u32 max_rows) {
    DS4_GUARD;
    const u32 h = blockIdx.x;
    const u32 n_raw = ds4_raw_rows(P, window, raw_cap);
    const u32 n_comp = ds4_comp_rows(P, ratio, comp_cap);
    const bool indexed = selected != 0 && n_comp > top_k;
    const u32 n_vis = indexed ? top_k : n_comp;
    const u32 n_rows = n_raw + n_vis;
    const u32 first = P->pos + 1 - n_raw;
    const float* qh = q + (u64)h * head_dim;
    float* sc = scores + (u64)h * max_rows;
    const float kq_scale = 1.0f / sqrtf((float)head_dim);

    // Row r: raw rows oldest first, then compressed rows in ascending order.
#define ROW_PTR(r) ((r) < n_raw ? raw + (u64)((first + (r)) % raw_cap) * head_dim \
                                : comp + (u64)(indexed ? selected[(r) - n_raw] : (int)((r) - n_raw)) * head_dim)
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) {
        const float4* k4 = (const float4*)ROW_PTR(r);
        const float4* q4 = (const float4*)qh;
        float dot = 0.0f;
        // head_dim is a multiple of 4 (checked by the plan); the adds stay in order.
        for (u32 i = 0; i < head_dim / 4; i++) {
            const float4 a = q4[i], b = k4[i];
            dot += a.x * b.x;
            dot += a.y * b.y;
            dot += a.z * b.z;
            dot += a.w * b.w;
        }
        sc[r] = dot * kq_scale;
    }
    __syncthreads();
    const float sink = sinks[h];
    float m = sink;
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) m = fmaxf(m, sc[r]);
    m = block_max(m);
    __syncthreads();
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) sc[r] = ds4_expf(sc[r] - m);
    __syncthreads();
    float denom = ds4_expf(sink - m);
    for (u32 r = 0; r < n_rows; r++) denom += sc[r];
    const float inv = 1.0f / denom;
    for (u32 i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float acc = 0.0f;
        for (u32 r = 0; r < n_rows; r++) acc += sc[r] * ROW_PTR(r)[i];
        out[(u64)h * head_dim + i] = acc * inv;
    }
#undef ROW_PTR
}
