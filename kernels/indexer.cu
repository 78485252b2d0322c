// The indexer: score every visible compressed row, then pick the top_k rows (ties to the lower
// row), written in ascending row order.

// One block of 128 threads per row (grid-stride over rows); thread h < n_head scores head h.
extern "C" __global__ void indexer_scores(DS4_ARGS, const float* __restrict__ q, const float* __restrict__ weights,
                                          const float* __restrict__ cache, float* __restrict__ out, u32 n_head,
                                          u32 head_dim, float scale, u32 ratio, u32 cap) {
    DS4_GUARD;
    __shared__ float k[128];
    __shared__ float part[128];
    const u32 n = ds4_comp_rows(P, ratio, cap);
    for (u32 c = blockIdx.x; c < n; c += gridDim.x) {
        __syncthreads();
        for (u32 i = threadIdx.x; i < head_dim; i += blockDim.x) k[i] = cache[(u64)c * head_dim + i];
        __syncthreads();
        float s = 0.0f;
        for (u32 h = threadIdx.x; h < n_head; h += blockDim.x) {
            const float* qh = q + (u64)h * head_dim;
            float dot = 0.0f;
            for (u32 i = 0; i < head_dim; i++) dot += k[i] * qh[i];
            s += fmaxf(dot, 0.0f) * (weights[h] * scale);
        }
        part[threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0.0f;
            for (u32 i = 0; i < blockDim.x; i++) t += part[i];
            out[c] = t;
        }
    }
}

// One block of 1024 threads. `taken` is scratch with one int per row of capacity.
extern "C" __global__ void indexer_top_k(DS4_ARGS, const float* __restrict__ scores, int* __restrict__ out,
                                         int* __restrict__ taken, u32 top_k, u32 ratio, u32 cap) {
    DS4_GUARD;
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
