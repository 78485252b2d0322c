// The indexer: score every visible compressed row, then pick the top_k rows (ties to the lower
// row), written in ascending row order.

// One block of 128 threads (4 warps) per row, grid-stride over rows. Warp w takes heads w, w+4,
// ...: dot(q_h, k) in the canonical f32 order; then one thread adds the head terms
// max(dot, 0) * (w_h * scale) sequentially, as the canonical profile defines.
#define INDEXER_MAX_HEADS 128
extern "C" __global__ void indexer_scores(DS4_ARGS, IndexerScoresArgs a) {
    DS4_GUARD;
    __shared__ float term[INDEXER_MAX_HEADS];
    const u32 n = ds4_comp_rows(P, a.ratio, a.cap);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 c = blockIdx.x; c < n; c += gridDim.x) {
        const float* k = a.cache + (u64)c * a.head_dim;
        __syncthreads();
        for (u32 h = warp; h < a.n_head; h += nw) {
            const float d = warp_dot_f32(k, a.q + (u64)h * a.head_dim, a.head_dim, lane);
            if (lane == 0) term[h] = fmaxf(d, 0.0f) * (a.weights[h] * a.scale);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0.0f;
            for (u32 h = 0; h < a.n_head; h++) t += term[h];
            a.out[c] = t;
        }
    }
}

// One block of 1024 threads. `taken` is scratch with one int per row of capacity.
extern "C" __global__ void indexer_top_k(DS4_ARGS, IndexerTopKArgs a) {
    DS4_GUARD;
    const float* scores = a.scores;
    int* out = a.out;
    int* taken = a.taken;
    const u32 top_k = a.top_k, ratio = a.ratio, cap = a.cap;
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ int picked[1024];
    const u32 n = ds4_comp_rows(P, ratio, cap);
    const u32 t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
    for (u32 c = t; c < n; c += blockDim.x) taken[c] = 0;
    __syncthreads();
    const u32 k = min(top_k, n);
    for (u32 pick = 0; pick < k; pick++) {
        float v = -1.0e30f;
        int idx = 0x7fffffff;
        for (u32 c = t; c < n; c += blockDim.x) {
            if (!taken[c] && scores[c] > v) {
                v = scores[c];
                idx = (int)c;
            }
        }
        warp_argmax(&v, &idx);
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = idx;
        }
        __syncthreads();
        if (t == 0) {
            float bv = best_v[0];
            int bi = best_i[0];
            for (u32 w = 1; w < nw; w++) {
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) {
                    bv = best_v[w];
                    bi = best_i[w];
                }
            }
            if (bi == 0x7fffffff) bi = 0;  // nothing above -1e30: ds4 falls back to row 0
            taken[bi] = 1;
            picked[pick] = bi;
        }
        __syncthreads();
    }
    // Ascending order: each pick's rank is the number of smaller picks.
    for (u32 i = t; i < k; i += blockDim.x) {
        u32 rank = 0;
        for (u32 j = 0; j < k; j++) rank += picked[j] < picked[i];
        out[rank] = picked[i];
    }
}
