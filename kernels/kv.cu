// KV cache and compressor ops: fp8 / FP4 round trips, the raw ring, the compressor window state
// and the compressed-row caches. Rows are f16-rounded on store, as ds4's CPU path does.

__device__ float e4m3_value(int i) {
    const int e = (i >> 3) & 15;
    const float mant = (float)(i & 7);
    return e == 0 ? mant * 0.001953125f : (1.0f + mant * 0.125f) * ldexpf(1.0f, e - 7);
}

// Nearest E4M3 value (ties to the even code), saturating at 448.
__device__ float e4m3_round(float x) {
    const float sign = x < 0.0f ? -1.0f : 1.0f;
    const float ax = fminf(fabsf(x), 448.0f);
    int lo = 0, hi = 126;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (e4m3_value(mid) <= ax) lo = mid; else hi = mid - 1;
    }
    int best = lo;
    if (best < 126) {
        const float d0 = fabsf(ax - e4m3_value(best)), d1 = fabsf(ax - e4m3_value(best + 1));
        if (d1 < d0 || (d1 == d0 && ((best + 1) & 1) == 0 && (best & 1) != 0)) best++;
    }
    return sign * e4m3_value(best);
}

// One 64-dim group by one warp (lane i holds dims i and 32 + i): a power-of-two scale from the
// group's amax (a maximum, so the same whatever the grouping of the comparisons).
__device__ __forceinline__ void fp8_group_warp(float* x, u32 lane) {
    const float v0 = x[lane], v1 = x[32 + lane];
    const float amax = fmaxf(warp_max(fmaxf(fabsf(v0), fabsf(v1))), 1.0e-4f);
    const float scale = ds4_pow2_ceil(amax / 448.0f);
    x[lane] = e4m3_round(fminf(fmaxf(v0 / scale, -448.0f), 448.0f)) * scale;
    x[32 + lane] = e4m3_round(fminf(fmaxf(v1 / scale, -448.0f), 448.0f)) * scale;
}

// The first n dims (a multiple of 64) of x, a warp per group, by the threads of a block.
__device__ __forceinline__ void fp8_round_trip_block(float* x, u32 n) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 g = warp; g < n / 64; g += nw) fp8_group_warp(x + g * 64, lane);
}

// One warp per 64 non-RoPE dims.
extern "C" __global__ void fp8_round_trip(DS4_ARGS, Fp8RoundTripArgs a) {
    DS4_GUARD;
    fp8_group_warp(a.x + blockIdx.x * 64, threadIdx.x & 31);
}

__device__ float e2m1_round(float x) {
    const float vals[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float sign = x < 0.0f ? -1.0f : 1.0f;
    const float ax = fminf(fabsf(x), 6.0f);
    int best = 0;
    float best_diff = ax;
    for (int i = 1; i < 8; i++) {
        const float d = fabsf(ax - vals[i]);
        if (d < best_diff || (d == best_diff && (i & 1) == 0 && (best & 1) != 0)) {
            best = i;
            best_diff = d;
        }
    }
    return sign * vals[best];
}

// One row of 128: Hadamard-128, then FP4 E2M1 per 32 (one warp each), by threads 0..127 of a
// block (every thread of the block must call it).
__device__ void indexer_qat_block(float* row) {
    __shared__ float s[128];
    const u32 t = threadIdx.x;
    const bool on = t < 128;
    if (on) s[t] = row[t];
    __syncthreads();
    for (u32 stride = 1; stride < 128; stride <<= 1) {
        float v = 0.0f;
        if (on) {
            const u32 base = t & ~(2 * stride - 1), off = t & (2 * stride - 1);
            if (off < stride) v = s[base + off] + s[base + off + stride];
            else v = s[base + off - stride] - s[base + off];
        }
        __syncthreads();
        if (on) s[t] = v;
        __syncthreads();
    }
    if (on) {
        const float v = s[t] * DS4_HADAMARD_SCALE;
        const float amax = fmaxf(warp_max(fabsf(v)), 7.052966104933725e-38f);
        const float scale = ds4_pow2_ceil(amax / 6.0f);
        row[t] = e2m1_round(fminf(fmaxf(v / scale, -6.0f), 6.0f)) * scale;
    }
}

// One block of 128 threads per row.
extern "C" __global__ void indexer_qat(DS4_ARGS, IndexerQatArgs a) {
    DS4_GUARD;
    indexer_qat_block(a.x + (u64)blockIdx.x * 128);
}

// The indexer query's two ops in one launch, a block of 128 threads per head of 128: the RoPE of
// its last n_rot dims at the token's position (rope_tail's), then indexer_qat's round trip.
extern "C" __global__ void indexer_query_finish(DS4_ARGS, IndexerQueryFinishArgs a) {
    DS4_GUARD;
    float* row = a.x + (u64)blockIdx.x * 128;
    const u32 pairs = a.n_rot / 2;
    rope_tail_block(row + (128 - a.n_rot), a.table + (u64)P->pos * pairs * 2, pairs, false);
    __syncthreads();
    indexer_qat_block(row);
}

// The token's KV row, f16-rounded, into ring row pos % raw_cap.
extern "C" __global__ void store_raw(DS4_ARGS, StoreRawArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.dim) return;
    a.cache[(u64)(P->pos % a.raw_cap) * a.dim + i] = round_f16(a.kv[i]);
}

// This token's compressed row, f16-rounded, as row (pos+1)/ratio - 1.
extern "C" __global__ void store_comp_row(DS4_ARGS, StoreCompRowArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 n = (P->pos + 1) / a.ratio;
    if (i >= a.dim || n == 0) return;
    a.cache[(u64)(n - 1) * a.dim + i] = round_f16(a.row[i]);
}

// Window state row (4 + pos%4 for ratio 4, else pos%ratio) = kv, score + ape[pos % ratio].
extern "C" __global__ void compressor_store(DS4_ARGS, CompressorStoreArgs a) {
    DS4_GUARD;
    const u32 width = a.width, ratio = a.ratio;
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width) return;
    const u32 pos_mod = P->pos % ratio;
    const u32 row = ratio == 4 ? 4 + pos_mod : pos_mod;
    a.state_kv[(u64)row * width + j] = a.kv[j];
    a.state_score[(u64)row * width + j] = a.score[j] + wload(a.ape, a.ape_f16, (u64)pos_mod * width + j);
}

// Softmax pool of dim j over the window; ratio 4 mixes rows 0..4 (first half) with rows 4..8
// (second half), interleaved in the sums as ds4 does.
__device__ float compressor_pool_value(const float* kv, const float* score, u32 head_dim, u32 ratio, u32 j) {
    const u32 width = ratio == 4 ? 2 * head_dim : head_dim;
    float mx = -1.0e30f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            mx = fmaxf(mx, score[(u64)r * width + j]);
            mx = fmaxf(mx, score[(u64)(4 + r) * width + head_dim + j]);
        }
    } else {
        for (u32 r = 0; r < ratio; r++) mx = fmaxf(mx, score[(u64)r * width + j]);
    }
    if (mx <= -1.0e30f * 0.5f) return 0.0f;
    float denom = 0.0f, sum = 0.0f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            const u64 bp = (u64)r * width + j, bc = (u64)(4 + r) * width + head_dim + j;
            const float wp = ds4_expf(score[bp] - mx), wc = ds4_expf(score[bc] - mx);
            denom += wp + wc;
            sum += wp * kv[bp];
            sum += wc * kv[bc];
        }
    } else {
        for (u32 r = 0; r < ratio; r++) {
            const u64 b = (u64)r * width + j;
            const float w = ds4_expf(score[b] - mx);
            denom += w;
            sum += w * kv[b];
        }
    }
    return denom > 0.0f ? sum / denom : 0.0f;
}

extern "C" __global__ void compressor_pool(DS4_ARGS, CompressorPoolArgs a) {
    DS4_GUARD;
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < a.head_dim) a.out[j] = compressor_pool_value(a.kv, a.score, a.head_dim, a.ratio, j);
}

// Ratio 4: rows 4..8 become rows 0..4, for both kv and score.
extern "C" __global__ void compressor_shift(DS4_ARGS, CompressorShiftArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    a.state_kv[i] = a.state_kv[a.n + i];
    a.state_score[i] = a.state_score[a.n + i];
}
