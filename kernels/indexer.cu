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

// The order-preserving key of a score: larger scores, larger keys; 0 for a row that is never
// picked (at or below -1e30, or NaN: the canonical pick takes only scores above -1e30). -0 takes
// +0's key (as integers), as the float comparison ranks them equal.
__device__ __forceinline__ u32 top_k_key(float s) {
    if (!(s > -1.0e30f)) return 0;
    u32 u = __float_as_uint(s);
    if (u == 0x80000000u) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix count of `flag` over the block's threads in thread order; *total gets the
// block's count. `counts` is shared scratch of one word per warp.
__device__ __forceinline__ u32 block_count_before(bool flag, u32* total, u32* counts) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    __syncthreads();
    if (lane == 0) counts[warp] = __popc(ballot);
    __syncthreads();
    u32 before = 0, all = 0;
    for (u32 w = 0; w < nw; w++) {
        before += w < warp ? counts[w] : 0;
        all += counts[w];
    }
    *total = all;
    return before + __popc(ballot & ((1u << lane) - 1));
}

// One block of 1024 threads. The canonical pick (recorder: IndexerTopK; the CPU's
// top_k_ascending) takes k = min(top_k, rows) times the best untaken row above -1e30, ties to the
// lower row, row 0 when none is left; the result is written in ascending row order, zeros after.
// That set is found without k rounds: a radix select (four 8-bit passes over the keys) finds the
// key T of the last row taken from the pickable rows and how many rows of key T are taken (the
// lowest ones); a block-wide prefix count then writes the set in row order.
extern "C" __global__ void __launch_bounds__(1024) indexer_top_k(DS4_ARGS, IndexerTopKArgs a) {
    DS4_GUARD;
    __shared__ u32 hist[256];
    __shared__ u32 counts[32];
    __shared__ u32 pickable, digit, left;
    const u32 n = ds4_comp_rows(P, a.ratio, a.cap);
    const u32 k = min(a.top_k, n);
    const u32 t = threadIdx.x;
    if (t == 0) pickable = 0;
    __syncthreads();
    u32 mine = 0;
    for (u32 c = t; c < n; c += blockDim.x) mine += top_k_key(a.scores[c]) != 0;
    atomicAdd(&pickable, mine);
    __syncthreads();
    const u32 want = min(k, pickable);
    u32 prefix = 0, mask = 0, need = want;
    if (want > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (u32 i = t; i < 256; i += blockDim.x) hist[i] = 0;
            __syncthreads();
            for (u32 c = t; c < n; c += blockDim.x) {
                const u32 key = top_k_key(a.scores[c]);
                if (key != 0 && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
            }
            __syncthreads();
            if (t == 0) {
                // The digit holding the need-th largest key among those matching the prefix.
                u32 above = 0, d = 255;
                while (above + hist[d] < need) above += hist[d--];
                digit = d;
                left = need - above;
            }
            __syncthreads();
            prefix |= digit << shift;
            mask |= 255u << shift;
            need = left;
            __syncthreads();
        }
    }
    // Rows with a key above T, and the first `need` rows of key T, in row order; row 0 as well
    // when fewer than k rows are pickable.
    const bool fallback = pickable < k;
    u32 written = 0, ties_seen = 0;
    for (u32 base = 0; base < n; base += blockDim.x) {
        const u32 c = base + t;
        const u32 key = c < n ? top_k_key(a.scores[c]) : 0;
        const bool tie = want > 0 && key != 0 && key == prefix;
        u32 tie_total;
        const u32 tie_rank = ties_seen + block_count_before(tie, &tie_total, counts);
        const bool sel = (want > 0 && key != 0 && (key > prefix || (tie && tie_rank < need))) || (fallback && c == 0);
        u32 total;
        const u32 at = written + block_count_before(sel, &total, counts);
        if (sel) a.out[at] = (int)c;
        written += total;
        ties_seen += tie_total;
    }
    for (u32 i = written + t; i < a.top_k; i += blockDim.x) a.out[i] = 0;
}
