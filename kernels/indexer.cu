// The indexer: score every visible compressed row, then pick the top_k rows (ties to the lower
// row), written in ascending row order.

// One block of 128 threads (4 warps) per row, grid-stride over rows. Warp w takes heads w, w+4,
// ...: dot(q_h, k) in the canonical f32 order; then one thread adds the head terms
// max(dot, 0) * (w_h * scale) sequentially, as the canonical profile defines. The chunk build
// uses indexer_scores_chunk below instead (same bits), unless DS4_CUDA_INDEXER_CHUNK=0.
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

#if DS4_CHUNK_ROWS
// The chunk build's scores: a block per tile of IDX_BT token rows x IDX_BC compressed rows, a thread
// per IDX_MT x IDX_MC (t, c) pairs computing each pair's head dots itself, so a staged k row and
// q head feed several pairs. Same bits as indexer_scores per row: each dot's lane sums (lane l:
// its 4 products added in order) merged in warp_sum's tree (leaves in bit-reversed lane order,
// pairs merged as they come), added to +0, then the terms max(dot, 0) * (w_h * scale) added in
// head order from +0. A lane sum starts at its first product, not at +0 + it: the two differ only
// in the sign of a zero, which the tree keeps only in a zero total, and +0 + total drops it.
// The launch covers the chunk's rows without blockIdx.y moving P (row count in cond bits 50..62);
// tiles past a row's visible count do no work and are not written.
#ifndef IDX_MT
#define IDX_MT 2
#endif
#ifndef IDX_MC
#define IDX_MC 4
#endif
#define IDX_THREADS 128
#define IDX_DIM 128
// Threads lie 8 along t by 16 along c (a warp: 4 t by 8 c, so a shared load reads 4 or 8 rows).
#define IDX_BT (8 * IDX_MT)
#define IDX_BC (16 * IDX_MC)
// A staged row: 32 float4 plus one, so that 8 consecutive rows' same column fall in distinct banks.
#define IDX_ROW4 33
// float4 loads per thread to stage one head of the tile's q rows.
#define IDX_QLOADS (IDX_BT * 32 / IDX_THREADS)
static_assert(IDX_BT * 32 % IDX_THREADS == 0, "whole q loads per thread");
static_assert((IDX_BT + IDX_BC) * IDX_ROW4 * 16 + IDX_BT * 4 <= 48 * 1024, "static shared memory");

// Visible compressed rows of chunk row t; 0 when the row runs nothing (past the chunk's rows, past
// its tokens or its indexer inactive).
__device__ __forceinline__ u32 idx_row_count(const StepParams* P, u64 cond, const IndexerScoresArgs& a, u32 rows,
                                             u32 t) {
    return t < rows && ds4_cond(P + t, cond) ? ds4_comp_rows(P + t, a.ratio, a.cap) : 0;
}

// s[i][j] = the tree over leaves [I, I + N) (leaf order: lane bit_reverse5(leaf)) of the lane sums
// of q row qr[i] and k row kr[j] (staged, IDX_ROW4 float4 a row).
template <u32 I, u32 N>
__device__ __forceinline__ void idx_tree(float (&s)[IDX_MT][IDX_MC], const float4* const (&qr)[IDX_MT],
                                         const float4* const (&kr)[IDX_MC]) {
    if constexpr (N == 1) {
        constexpr u32 l = bit_reverse5(I);
        float4 qv[IDX_MT], kv[IDX_MC];
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++) qv[i] = qr[i][l];
#pragma unroll
        for (u32 j = 0; j < IDX_MC; j++) kv[j] = kr[j][l];
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++)
#pragma unroll
            for (u32 j = 0; j < IDX_MC; j++) {
                float acc = kv[j].x * qv[i].x;
                acc += kv[j].y * qv[i].y;
                acc += kv[j].z * qv[i].z;
                acc += kv[j].w * qv[i].w;
                s[i][j] = acc;
            }
    } else {
        float b[IDX_MT][IDX_MC];
        idx_tree<I, N / 2>(s, qr, kr);
        idx_tree<I + N / 2, N / 2>(b, qr, kr);
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++)
#pragma unroll
            for (u32 j = 0; j < IDX_MC; j++) s[i][j] += b[i][j];
    }
}

extern "C" __global__ void __launch_bounds__(IDX_THREADS) indexer_scores_chunk(DS4_ARGS, IndexerScoresArgs a) {
    ds4_wait_predecessor(cond);
    __shared__ float4 ks[IDX_BC * IDX_ROW4];
    __shared__ float4 qs[IDX_BT * IDX_ROW4];
    __shared__ float ws[IDX_BT];
    const u32 rows = (u32)(cond >> 50) & 0x1fff;
    const u32 t0 = blockIdx.y * IDX_BT, c0 = blockIdx.x * IDX_BC;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ty = (warp >> 1) * 4 + (lane >> 3), tx = (warp & 1) * 8 + (lane & 7);
    u32 n_max = 0;
    for (u32 r = 0; r < IDX_BT; r++) n_max = max(n_max, idx_row_count(P, cond, a, rows, t0 + r));
    if (c0 >= n_max) return;

    // The tile's k rows (zeros past the visible ones), staged once for every head.
    for (u32 i = threadIdx.x; i < IDX_BC * 32; i += IDX_THREADS) {
        const u32 r = i >> 5, c = c0 + r;
        ks[r * IDX_ROW4 + (i & 31)] =
            c < n_max ? ((const float4*)(a.cache + (u64)c * IDX_DIM))[i & 31] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // This thread's share of staging each head: row warp + 4 k, float4 `lane`; null for a row that
    // runs nothing (staged as zeros). Threads below IDX_BT also stage row threadIdx.x's weight.
    const float* qsrc[IDX_QLOADS];
#pragma unroll
    for (u32 k = 0; k < IDX_QLOADS; k++) {
        const u32 t = t0 + warp + 4 * k;
        IndexerScoresArgs ay = a;
        ds4_row(ay, R, t);
        qsrc[k] = idx_row_count(P, cond, a, rows, t) ? ay.q + lane * 4 : nullptr;
    }
    const float* wsrc = nullptr;
    if (threadIdx.x < IDX_BT && idx_row_count(P, cond, a, rows, t0 + threadIdx.x)) {
        IndexerScoresArgs ay = a;
        ds4_row(ay, R, t0 + threadIdx.x);
        wsrc = ay.weights;
    }
    // This thread's pairs: token rows ty + 8 i, compressed rows tx + 16 j of the tile.
    const float4* qr[IDX_MT];
    const float4* kr[IDX_MC];
#pragma unroll
    for (u32 i = 0; i < IDX_MT; i++) qr[i] = qs + (ty + 8 * i) * IDX_ROW4;
#pragma unroll
    for (u32 j = 0; j < IDX_MC; j++) kr[j] = ks + (tx + 16 * j) * IDX_ROW4;
    float acc[IDX_MT][IDX_MC];
#pragma unroll
    for (u32 i = 0; i < IDX_MT; i++)
#pragma unroll
        for (u32 j = 0; j < IDX_MC; j++) acc[i][j] = 0.0f;

    // Head h + 1's q is loaded into registers while head h is computed.
    float4 qnext[IDX_QLOADS];
    float wnext = 0.0f;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (u32 k = 0; k < IDX_QLOADS; k++) qnext[k] = qsrc[k] ? *(const float4*)qsrc[k] : zero;
    if (wsrc) wnext = wsrc[0] * a.scale;
    for (u32 h = 0; h < a.n_head; h++) {
        __syncthreads();
#pragma unroll
        for (u32 k = 0; k < IDX_QLOADS; k++) qs[(warp + 4 * k) * IDX_ROW4 + lane] = qnext[k];
        if (threadIdx.x < IDX_BT) ws[threadIdx.x] = wnext;
        __syncthreads();
        if (h + 1 < a.n_head) {
#pragma unroll
            for (u32 k = 0; k < IDX_QLOADS; k++)
                qnext[k] = qsrc[k] ? *(const float4*)(qsrc[k] + (u64)(h + 1) * IDX_DIM) : zero;
            if (wsrc) wnext = wsrc[h + 1] * a.scale;
        }
        float d[IDX_MT][IDX_MC];
        idx_tree<0, 32>(d, qr, kr);
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++) {
            const float w = ws[ty + 8 * i];
#pragma unroll
            for (u32 j = 0; j < IDX_MC; j++) {
                const float dot = 0.0f + d[i][j];
                acc[i][j] += fmaxf(dot, 0.0f) * w;
            }
        }
    }
#pragma unroll
    for (u32 i = 0; i < IDX_MT; i++) {
        const u32 t = t0 + ty + 8 * i, n = idx_row_count(P, cond, a, rows, t);
        IndexerScoresArgs ay = a;
        ds4_row(ay, R, t);
#pragma unroll
        for (u32 j = 0; j < IDX_MC; j++) {
            const u32 c = c0 + tx + 16 * j;
            if (c < n) ay.out[c] = acc[i][j];
        }
    }
}
#endif

#if !DS4_CHUNK_ROWS
// The decode build's scores: a block per IDX1_ROWS compressed rows, lane l of every warp on row
// l; warp w computes the dots of head groups w, w + 4, ... (IDX1_HEADS heads a group, from one
// load of the k row's float4 per leaf) itself in indexer_scores_chunk's order, keeps the terms
// max(dot, 0) * (w_h * scale) in registers, then one lane per row adds them in head order from +0.
// Same bits as indexer_scores; q (at most IDX1_MAX_HEADS heads) and the rows are staged in shared
// memory, the terms in the rows' space once the dots are done.
#define IDX1_ROWS 32
#define IDX1_THREADS 128
#define IDX1_HEADS 4
#define IDX1_MAX_HEADS 64
#define IDX1_GROUPS (IDX1_MAX_HEADS / IDX1_HEADS / (IDX1_THREADS / 32))
// A row's terms, padded so that the 32 rows' same head fall in distinct banks.
#define IDX1_TERMS (IDX1_MAX_HEADS + 1)
static_assert(IDX1_ROWS * IDX1_TERMS <= IDX1_ROWS * 32 * 4, "the terms fit the rows' space");

// s[e] = the tree over leaves [I, I + N) of the lane sums of q head qh + 32 e and the k row kr,
// whose float4 j is staged at j ^ sw.
template <u32 I, u32 N>
__device__ __forceinline__ void idx1_tree(float (&s)[IDX1_HEADS], const float4* qh, const float4* kr, u32 sw) {
    if constexpr (N == 1) {
        constexpr u32 l = bit_reverse5(I);
        const float4 kv = kr[l ^ sw];
#pragma unroll
        for (u32 e = 0; e < IDX1_HEADS; e++) {
            const float4 qv = qh[e * 32 + l];
            float acc = kv.x * qv.x;
            acc += kv.y * qv.y;
            acc += kv.z * qv.z;
            acc += kv.w * qv.w;
            s[e] = acc;
        }
    } else {
        float b[IDX1_HEADS];
        idx1_tree<I, N / 2>(s, qh, kr, sw);
        idx1_tree<I + N / 2, N / 2>(b, qh, kr, sw);
#pragma unroll
        for (u32 e = 0; e < IDX1_HEADS; e++) s[e] += b[e];
    }
}

extern "C" __global__ void __launch_bounds__(IDX1_THREADS) indexer_scores_one(DS4_ARGS, IndexerScoresArgs a) {
    DS4_GUARD;
    __shared__ float4 sm[(IDX1_MAX_HEADS + IDX1_ROWS) * 32];
    float4* qs = sm;
    float4* ks = sm + IDX1_MAX_HEADS * 32;
    float* terms = (float*)ks;
    const u32 n = ds4_comp_rows(P, a.ratio, a.cap), c0 = blockIdx.x * IDX1_ROWS;
    if (c0 >= n) return;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (u32 i = threadIdx.x; i < a.n_head * 32; i += IDX1_THREADS) qs[i] = ((const float4*)a.q)[i];
    // Row r's float4 j at j ^ (r & 7): lanes reading one column of 32 rows spread over all banks.
    for (u32 i = threadIdx.x; i < IDX1_ROWS * 32; i += IDX1_THREADS) {
        const u32 r = i >> 5, j = i & 31, c = c0 + r;
        ks[r * 32 + (j ^ (r & 7))] = c < n ? ((const float4*)(a.cache + (u64)c * 128))[j] : zero;
    }
    __syncthreads();
    float term[IDX1_GROUPS * IDX1_HEADS];
#pragma unroll
    for (u32 m = 0; m < IDX1_GROUPS; m++) {
        const u32 h0 = (warp + 4 * m) * IDX1_HEADS;
        if (h0 < a.n_head) {
            float d[IDX1_HEADS];
            idx1_tree<0, 32>(d, qs + h0 * 32, ks + lane * 32, lane & 7);
#pragma unroll
            for (u32 e = 0; e < IDX1_HEADS; e++) {
                const float dot = 0.0f + d[e];
                term[m * IDX1_HEADS + e] = fmaxf(dot, 0.0f) * (a.weights[h0 + e] * a.scale);
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (u32 m = 0; m < IDX1_GROUPS; m++) {
        const u32 h0 = (warp + 4 * m) * IDX1_HEADS;
        if (h0 < a.n_head)
#pragma unroll
            for (u32 e = 0; e < IDX1_HEADS; e++) terms[lane * IDX1_TERMS + h0 + e] = term[m * IDX1_HEADS + e];
    }
    __syncthreads();
    if (warp == 0 && c0 + lane < n) {
        float t = 0.0f;
        for (u32 h = 0; h < a.n_head; h++) t += terms[lane * IDX1_TERMS + h];
        a.out[c0 + lane] = t;
    }
}
#endif

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
