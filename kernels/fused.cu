// Fused launches: runs of small ops of one layer in one kernel. Each op's arithmetic is its own
// kernel's (the same device functions, the same order), so fusing changes no bit; only the
// launches between them go. backends/cuda/plan.rs decides which runs fuse.

// One q head after the q projection, in place at x (global or shared memory): RMS-normalized
// (no weight), then its tail rotated at the token's position (trow).
__device__ __forceinline__ void qkv_q_head_block(float* x, u32 hd, u32 n_rot, float eps, const float* trow) {
    const float scale = rms_scale_block(x, hd, eps);
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) x[i] = x[i] * scale;
    __syncthreads();
    rope_tail_block(x + (hd - n_rot), trow, n_rot / 2, false);
}

// The kv row after the kv projection: RMS-normalized with its weight, rotated, fp8 round-tripped
// and stored into the raw ring at pos % raw_cap.
__device__ __forceinline__ void qkv_kv_row_block(const StepParams* P, const float* kv_raw, const float* kv_norm,
                                                 float* kv, float* cache, const float* trow, u32 hd, u32 n_rot,
                                                 u32 raw_cap, float eps) {
    const float scale = rms_scale_block(kv_raw, hd, eps);
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        const float v = kv_raw[i] * scale;
        kv[i] = v * kv_norm[i];
    }
    __syncthreads();
    rope_tail_block(kv + (hd - n_rot), trow, n_rot / 2, false);
    __syncthreads();
    fp8_round_trip_block(kv, hd - n_rot);
    __syncthreads();
    float* dst = cache + (u64)(P->pos % raw_cap) * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = round_f16(kv[i]);
}

// The (cos, sin) row of the token's position in a RoPE table of n_rot / 2 pairs per position.
__device__ __forceinline__ const float* qkv_rope_row(const StepParams* P, const float* table, u32 n_rot) {
    return table + (u64)P->pos * (n_rot / 2) * 2;
}

// After the q and kv projections: blocks 0..n_head take a q head each, block n_head the kv row.
extern "C" __global__ void qkv_finish(DS4_ARGS, QkvFinishArgs a) {
    DS4_GUARD;
    const u32 hd = a.head_dim, h = blockIdx.x;
    const float* trow = qkv_rope_row(P, a.table, a.n_rot);
    if (h < a.n_head) {
        qkv_q_head_block(a.q + (u64)h * hd, hd, a.n_rot, a.eps_q, trow);
        return;
    }
    qkv_kv_row_block(P, a.kv_raw, a.kv_norm, a.kv, a.cache, trow, hd, a.n_rot, a.raw_cap, a.eps_kv);
}

// One compressor lane of a token, one block: the window state update (compressor_store), then,
// on an emit token (`emit_cond`), the pool, the RMS norm with weight, the RoPE of the row's tail
// at its first position, the fp8 (quant 0) or Hadamard + FP4 (quant 1) round trip, the f16 store
// as compressed row (pos+1)/ratio - 1, and for ratio 4 the window shift.
__device__ __forceinline__ void compressor_update_row(const StepParams* P, const CompressorUpdateArgs& a) {
    const u32 width = a.width, ratio = a.ratio, hd = a.head_dim, pos = P->pos;
    const u32 pos_mod = pos % ratio;
    const u32 srow = ratio == 4 ? 4 + pos_mod : pos_mod;
    for (u32 j = threadIdx.x; j < width; j += blockDim.x) {
        a.state_kv[(u64)srow * width + j] = a.kv[j];
        a.state_score[(u64)srow * width + j] = a.score[j] + wload(a.ape, a.ape_f16, (u64)pos_mod * width + j);
    }
    if (!ds4_cond(P, a.emit_cond)) return;
    __syncthreads();
    for (u32 j = threadIdx.x; j < hd; j += blockDim.x)
        a.pooled[j] = compressor_pool_value(a.state_kv, a.state_score, hd, ratio, j);
    __syncthreads();
    const float scale = rms_scale_block(a.pooled, hd, a.eps);
    for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
        const float v = a.pooled[j] * scale;
        a.row[j] = v * a.norm_w[j];
    }
    __syncthreads();
    const u32 pairs = a.n_rot / 2;
    const u32 rpos = pos + 1 >= ratio ? pos + 1 - ratio : 0;
    rope_tail_block(a.row + (hd - a.n_rot), a.table + (u64)rpos * pairs * 2, pairs, false);
    __syncthreads();
    if (a.quant == 0) fp8_round_trip_block(a.row, hd - a.n_rot);
    else indexer_qat_block(a.row);
    __syncthreads();
    const u32 n = (pos + 1) / ratio;
    if (n > 0)
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) a.cache[(u64)(n - 1) * hd + j] = round_f16(a.row[j]);
    if (ratio == 4) {
        const u32 ns = ratio * width;
        for (u32 i = threadIdx.x; i < ns; i += blockDim.x) {
            a.state_kv[i] = a.state_kv[ns + i];
            a.state_score[i] = a.state_score[ns + i];
        }
    }
}

extern "C" __global__ void compressor_update(DS4_ARGS, CompressorUpdateArgs a) {
#if DS4_CHUNK_ROWS
    // One launch for a chunk's whole row loop (the row count in cond bits 50..62): the rows in
    // order in this block, each with its own step parameters and pointers; the barrier after a
    // row makes its state writes visible to the next.
    ds4_wait_predecessor(cond);
    const u32 n_rows = (u32)(cond >> 50) & 0x1fff;
    for (u32 y = 0; y < n_rows; y++) {
        if (ds4_cond(P + y, cond)) {
            CompressorUpdateArgs ay = a;
            ds4_row(ay, R, y);
            compressor_update_row(P + y, ay);
        }
        __syncthreads();
    }
#else
    DS4_GUARD;
    compressor_update_row(P, a);
#endif
}

#if !DS4_CHUNK_ROWS
// A decode compressor lane in one launch: its kv and score projections (mat_vec_f16_split's
// rows, ticket and sums) and, in the block that adds the chunk sums, the window update
// (compressor_update_row) on the rows that block has just stored.
extern "C" __global__ void mat_vec_f16_split_comp(DS4_ARGS, MatVecF16SplitCompArgs a) {
    DS4_GUARD_EARLY;
    MatVecF16SplitArgs s;
    s.w = a.w;
    s.x = a.x;
    s.partial = a.partial;
    s.tickets = a.tickets;
    s.out = a.out;
    s.w2 = a.w2;
    s.out2 = a.out2;
    s.in_dim = a.in_dim;
    s.rows = a.rows;
    s.rows_per_group = a.rows_per_group;
    s.n_chunks = a.n_chunks;
    s.ticket = a.ticket;
    s.rows2 = a.rows2;
    if (!f16_split_rows(cond, s)) return;
    __syncthreads();
    CompressorUpdateArgs c;
    c.kv = a.out;
    c.score = a.out2;
    c.ape = a.ape;
    c.state_kv = a.state_kv;
    c.state_score = a.state_score;
    c.pooled = a.pooled;
    c.norm_w = a.norm_w;
    c.row = a.row;
    c.table = a.table;
    c.cache = a.cache;
    c.tickets = a.tickets;
    c.emit_cond = a.emit_cond;
    c.ape_f16 = a.ape_f16;
    c.width = a.width;
    c.ratio = a.ratio;
    c.head_dim = a.head_dim;
    c.n_rot = a.n_rot;
    c.quant = a.quant;
    c.eps = a.eps;
    c.ticket = 0;
    compressor_update_row(P, c);
}
#endif

#if DS4_CHUNK_ROWS
// compressor_update_chunk: the same chunk row loop with the rows in parallel (a block per chunk
// row; only emit rows do work). A window's state rows come from the chunk's own kv / score rows or
// from the state carried into the chunk, so an emit block finds for each state row its source as
// the serial loop would have left it at that row, pools from the sources, and does the emit as
// compressor_update_row (same device functions, same order). The last block to finish (a
// ticket) writes the state left after the chunk, once no block still reads the carried state.
#define COMP_MAX_STATE_ROWS 256
#define COMP_MAX_HEAD_DIM 512
#define COMP_CHUNK_THREADS 512

// Source of window state row s: chunk row src >= 0 (its kv, and its score + ape at its
// pos % ratio), or carried state row -1 - src.
struct CompSources {
    int src[COMP_MAX_STATE_ROWS];
    const float* kv[COMP_MAX_STATE_ROWS];
    const float* score[COMP_MAX_STATE_ROWS];
    int ape[COMP_MAX_STATE_ROWS];  // element offset of the ape row, -1 for carried rows
    int emit_before;               // the last emit row before (or up to) y, -1 if none
    int emit_after;                // an emit row after y exists
};

// The state rows after row y's store (and, with `through`, after its shift): state row s of the
// serial loop holds the latest active row y' <= y that stored into it, else the carried row. For
// ratio 4, rows 4..8 take stores (4 + pos % 4); rows 0..4 are rows 4..8 as they were at the last
// emit e (< y, or <= y with `through`), else the carried rows 0..4. Every thread must call it.
__device__ void comp_sources(const StepParams* P, u64 cond, const CompressorUpdateArgs& a, const RowStrides& R,
                             u32 n_rows, u32 y, bool through, CompSources* S) {
    const u32 ratio = a.ratio, ns = ratio == 4 ? 8 : ratio;
    for (u32 s = threadIdx.x; s < ns; s += blockDim.x) S->src[s] = -1 - (int)s;
    if (threadIdx.x == 0) {
        S->emit_before = -1;
        S->emit_after = 0;
    }
    __syncthreads();
    for (u32 t = threadIdx.x; t < n_rows; t += blockDim.x) {
        if (!ds4_cond(P + t, cond)) continue;
        const u32 m = P[t].pos % ratio;
        const bool em = ds4_cond(P + t, a.emit_cond);
        if (t <= y) atomicMax(&S->src[ratio == 4 ? 4 + m : m], (int)t);
        if (em && (t < y || (through && t == y))) atomicMax(&S->emit_before, (int)t);
        if (em && t > y) S->emit_after = 1;
    }
    __syncthreads();
    const int e = S->emit_before;
    if (ratio == 4 && e >= 0) {
        // Rows 0..4 as rows 4..8 were after row e's store: its chunk rows, else carried rows 4..8.
        if (threadIdx.x < 4) S->src[threadIdx.x] = -5 - (int)threadIdx.x;
        __syncthreads();
        for (u32 t = threadIdx.x; t <= (u32)e; t += blockDim.x)
            if (ds4_cond(P + t, cond)) atomicMax(&S->src[P[t].pos % 4], (int)t);
        __syncthreads();
    }
    for (u32 s = threadIdx.x; s < ns; s += blockDim.x) {
        const int src = S->src[s];
        if (src >= 0) {
            CompressorUpdateArgs at = a;
            ds4_row(at, R, (u32)src);
            S->kv[s] = at.kv;
            S->score[s] = at.score;
            S->ape[s] = (int)((P[src].pos % ratio) * a.width);
        } else {
            const u64 k = (u64)(-1 - src);
            S->kv[s] = a.state_kv + k * a.width;
            S->score[s] = a.state_score + k * a.width;
            S->ape[s] = -1;
        }
    }
    __syncthreads();
}

// Window state row s, column c, as the serial loop's state holds it.
__device__ __forceinline__ float comp_score(const CompSources* S, const CompressorUpdateArgs& a, u32 s, u32 c) {
    const float v = S->score[s][c];
    const int o = S->ape[s];
    return o >= 0 ? v + wload(a.ape, a.ape_f16, (u64)o + c) : v;
}

// compressor_pool_value over the sources (the same order: maxima, then the sums in row order).
__device__ float comp_pool_value(const CompSources* S, const CompressorUpdateArgs& a, u32 j) {
    const u32 hd = a.head_dim, ratio = a.ratio;
    float mx = -1.0e30f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            mx = fmaxf(mx, comp_score(S, a, r, j));
            mx = fmaxf(mx, comp_score(S, a, 4 + r, hd + j));
        }
    } else {
#pragma unroll 4
        for (u32 r = 0; r < ratio; r++) mx = fmaxf(mx, comp_score(S, a, r, j));
    }
    if (mx <= -1.0e30f * 0.5f) return 0.0f;
    float denom = 0.0f, sum = 0.0f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            const float wp = ds4_expf(comp_score(S, a, r, j) - mx), wc = ds4_expf(comp_score(S, a, 4 + r, hd + j) - mx);
            denom += wp + wc;
            sum += wp * S->kv[r][j];
            sum += wc * S->kv[4 + r][hd + j];
        }
    } else {
#pragma unroll 4
        for (u32 r = 0; r < ratio; r++) {
            const float w = ds4_expf(comp_score(S, a, r, j) - mx);
            denom += w;
            sum += w * S->kv[r][j];
        }
    }
    return denom > 0.0f ? sum / denom : 0.0f;
}

// State rows first..end (all `width` columns) from their sources, where that is not the row
// itself: 4-column pieces, each thread's loads of four pieces issued before their stores.
__device__ void comp_write_state(const CompSources* S, const CompressorUpdateArgs& a, u32 first, u32 end) {
    const u32 w4 = a.width / 4, n = (end - first) * w4;
    for (u32 i0 = 0; i0 < n; i0 += 4 * blockDim.x) {
        float4 kv[4], sc[4];
        u64 at[4];
        bool on[4];
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 i = i0 + u * blockDim.x + threadIdx.x;
            const u32 s = first + i / w4, c = (i % w4) * 4;
            on[u] = i < n && S->src[s] != -1 - (int)s;
            at[u] = (u64)s * a.width + c;
            if (on[u]) {
                kv[u] = *(const float4*)(S->kv[s] + c);
                const float4 v = *(const float4*)(S->score[s] + c);
                const int o = S->ape[s];
                sc[u] = v;
                if (o >= 0) {
                    sc[u].x = v.x + wload(a.ape, a.ape_f16, (u64)o + c);
                    sc[u].y = v.y + wload(a.ape, a.ape_f16, (u64)o + c + 1);
                    sc[u].z = v.z + wload(a.ape, a.ape_f16, (u64)o + c + 2);
                    sc[u].w = v.w + wload(a.ape, a.ape_f16, (u64)o + c + 3);
                }
            }
        }
#pragma unroll
        for (u32 u = 0; u < 4; u++)
            if (on[u]) {
                *(float4*)(a.state_kv + at[u]) = kv[u];
                *(float4*)(a.state_score + at[u]) = sc[u];
            }
    }
}

extern "C" __global__ void __launch_bounds__(COMP_CHUNK_THREADS) compressor_update_chunk(DS4_ARGS, CompressorUpdateArgs a) {
    ds4_wait_predecessor(cond);
    __shared__ CompSources S;
    __shared__ __align__(16) float pooled[COMP_MAX_HEAD_DIM];
    __shared__ __align__(16) float row[COMP_MAX_HEAD_DIM];
    __shared__ bool last;
    const u32 n_rows = (u32)(cond >> 50) & 0x1fff, y = blockIdx.x;
    const u32 hd = a.head_dim, ratio = a.ratio;
    if (y < n_rows && ds4_cond(P + y, cond) && ds4_cond(P + y, a.emit_cond)) {
        const u32 pos = P[y].pos;
        comp_sources(P, cond, a, R, n_rows, y, false, &S);
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) pooled[j] = comp_pool_value(&S, a, j);
        __syncthreads();
        const float scale = rms_scale_block(pooled, hd, a.eps);
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
            const float v = pooled[j] * scale;
            row[j] = v * a.norm_w[j];
        }
        __syncthreads();
        const u32 pairs = a.n_rot / 2;
        const u32 rpos = pos + 1 >= ratio ? pos + 1 - ratio : 0;
        rope_tail_block(row + (hd - a.n_rot), a.table + (u64)rpos * pairs * 2, pairs, false);
        __syncthreads();
        if (a.quant == 0) fp8_round_trip_block(row, hd - a.n_rot);
        else indexer_qat_block(row);
        __syncthreads();
        const u32 n = (pos + 1) / ratio;
        // The row's pooled and row outputs, as the loop leaves them (a shared buffer: the last emit's).
        CompressorUpdateArgs ay = a, an = a;
        ds4_row(ay, R, y);
        ds4_row(an, R, y + 1);
        const bool later = S.emit_after != 0;
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
            if (n > 0) a.cache[(u64)(n - 1) * hd + j] = round_f16(row[j]);
            if (!later || an.pooled != ay.pooled) ay.pooled[j] = pooled[j];
            if (!later || an.row != ay.row) ay.row[j] = row[j];
        }
    }
    // Every read of the carried state is done before this block takes its ticket.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(a.tickets + a.ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    comp_sources(P, cond, a, R, n_rows, n_rows - 1, true, &S);
    // Ratio 4's rows 0..4 may copy the carried rows 4..8: before those are overwritten.
    if (ratio == 4) {
        comp_write_state(&S, a, 0, 4);
        __syncthreads();
        comp_write_state(&S, a, 4, 8);
    } else {
        comp_write_state(&S, a, 0, ratio);
    }
    if (threadIdx.x == 0) a.tickets[a.ticket] = 0;
}
#endif

// Lane sum of one 512-term chunk of an F16 row times x * scale (the RMS-normalized input, each
// value rounded as rms_norm stores it), in chunk_dot_f16's order.
__device__ __forceinline__ float chunk_dot_f16_scaled(const F16Chunk& c, const float* x, float scale, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const uint4 q = c.q[u];
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += h2f((u16)(q.x & 0xffff)) * (p.x * scale);
            acc += h2f((u16)(q.x >> 16)) * (p.y * scale);
            acc += h2f((u16)(q.y & 0xffff)) * (p.z * scale);
            acc += h2f((u16)(q.y >> 16)) * (p.w * scale);
            acc += h2f((u16)(q.z & 0xffff)) * (s.x * scale);
            acc += h2f((u16)(q.z >> 16)) * (s.y * scale);
            acc += h2f((u16)(q.w & 0xffff)) * (s.z * scale);
            acc += h2f((u16)(q.w >> 16)) * (s.w * scale);
        }
    }
    return acc;
}

// The HC pre-mix of a half-layer: the plain RMS norm of the streams (`flat`), the F16 control
// projection (`mix`, split-K: a warp per 512-chunk of a row), the Sinkhorn split, the weighted sum
// of the streams (`cur`) and the sublayer's RMS norm with weight (`norm`, with its Q8_0
// quantization when `xq` is set, and its Q8_K when `xk` is).
//
// The norm's scale comes from the streams' chunk sums of squares when the hc_post that wrote them
// stored those (`ss`); otherwise every block sums the streams itself. The blocks form two groups
// with a ticket each: the first `blocks_pre` blocks take mix rows 0..3 (the pre gates), the rest
// rows 4.. (post gates and combine matrix). The last block of the first group does the weighted
// sum and the norm, which need only the pre gates; the last block of the second group runs the
// Sinkhorn split, which only hc_post reads, on another SM at the same time. The tails are chains
// of dependent steps on one SM, so each step issues all its loads before using any.
#define HC_PRE_MAX_PARTIALS 2048
#define HC_PRE_MAX_EMBD 8192
#define HC_PRE_WARPS 16
// The experts' Q8_K on the tail block's otherwise idle warps (0: after the Q8_0 on the same warps).
// In-graph trace, H100 flash-4l: the FFN half's pre-gates tail 5.6 -> 2.7 us from the norm stored to
// its end; decode +0.9% (1177.0 against 1167.4 tok/s), with Q8_NORM_W_EARLY +1.5%.
#ifndef HC_PRE_Q8K_APART
#define HC_PRE_Q8K_APART 1
#endif

// The sum from +0 of v[0..n] in order, where lane k of the warp holds v[k0 + k]; every lane
// gets it.
__device__ __forceinline__ float ordered_sum_lanes(const float* v, u32 n, u32 lane) {
    float total = 0.0f;
    for (u32 k0 = 0; k0 < n; k0 += 32) {
        const float mine = k0 + lane < n ? v[k0 + lane] : 0.0f;
#pragma unroll
        for (u32 k = 0; k < 32; k++) {
            const float t = __shfl_sync(0xffffffffu, mine, k);
            if (k0 + k < n) total += t;
        }
    }
    return total;
}

// A group's last block: the chunk sums of mix rows first .. first+rows, staged in shared memory
// by all threads at once, then each row's added in order by one thread.
__device__ __forceinline__ void hc_pre_mix_rows(const HcPreArgs& a, u32 first, u32 rows, float* mix) {
    __shared__ float sums[HC_PRE_MAX_PARTIALS];
    const u32 nc = a.n_chunks, base = first * nc;
    for (u32 i = threadIdx.x; i < rows * nc; i += blockDim.x) sums[i] = __ldcg(a.partial + base + i);
    __syncthreads();
    if (threadIdx.x < rows) {
        float total = 0.0f;
#pragma unroll 8
        for (u32 k = 0; k < nc; k++) total += sums[threadIdx.x * nc + k];
        mix[first + threadIdx.x] = total;
        a.mix[first + threadIdx.x] = total;
    }
    __syncthreads();
}

// DS4_TRACE_HC_STAGES 1 (a measurement, with DS4_TRACE): the pre gates' tail notes its steps in
// trace slots 5 (gates made), 6 (weighted sum and its sum of squares), 7 (norm stored; the
// quantizations follow), instead of the Sinkhorn tail's and the ticket's.
#ifndef DS4_TRACE_HC_STAGES
#define DS4_TRACE_HC_STAGES 0
#endif
#ifndef DS4_TRACE_HC_TAIL_TWICE
#define DS4_TRACE_HC_TAIL_TWICE 0
#endif
#define HC_STAGE(slot)                     \
    if (DS4_TRACE_HC_STAGES) {             \
        DS4_TRACE_MARK(slot);              \
    }
// The first group's tail for the 512-chunk `ch` of `cur`, by one warp, lane l holding values
// ch*512 + 128u + 4l + j (the lanes of the canonical sum of squares): the weighted sum, then,
// once `s2` is known, the norm and its quantizations. Q8_0: a 32-block is 8 lanes; Q8_K: a
// 256-block is u = 2h, 2h+1, the 16-value sums 4 lanes each. Both as quantize_q8_0 and
// quantize_q8_k make them (the maxima are exact in any order).
struct HcPreChunk {
    float v[4][4];
    bool ok[4];
};
__device__ __forceinline__ float hc_pre_cur_chunk(const HcPreArgs& a, const float* xs, const float* pre, u32 ch, u32 lane,
                                                  HcPreChunk* c, bool store) {
    const u32 ne = a.n_embd;
    float4 xv[4][4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
        c->ok[u] = d < ne;
#pragma unroll
        for (u32 h = 0; h < 4; h++) xv[u][h] = c->ok[u] ? *(const float4*)(xs + h * ne + d) : make_float4(0, 0, 0, 0);
    }
    float sq = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const float x[4][4] = {{xv[u][0].x, xv[u][1].x, xv[u][2].x, xv[u][3].x},
                               {xv[u][0].y, xv[u][1].y, xv[u][2].y, xv[u][3].y},
                               {xv[u][0].z, xv[u][1].z, xv[u][2].z, xv[u][3].z},
                               {xv[u][0].w, xv[u][1].w, xv[u][2].w, xv[u][3].w}};
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            float acc = 0.0f;
            acc += x[j][0] * pre[0];
            acc += x[j][1] * pre[1];
            acc += x[j][2] * pre[2];
            acc += x[j][3] * pre[3];
            c->v[u][j] = acc;
            if (c->ok[u]) sq += acc * acc;
        }
        if (store && c->ok[u]) {
            const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
            *(float4*)(a.cur + d) = make_float4(c->v[u][0], c->v[u][1], c->v[u][2], c->v[u][3]);
        }
    }
    return warp_sum(sq);
}

__device__ __forceinline__ void hc_pre_norm_chunk(u64 cond, const HcPreArgs& a, const float* norm_w, float s2, u32 ch,
                                                  u32 lane, HcPreChunk* c, bool store, bool q8k) {
    float4 w[4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
        w[u] = c->ok[u] ? *(const float4*)(norm_w + d) : make_float4(0, 0, 0, 0);
    }
    float o[4][4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const float wv[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            const float v = c->v[u][j] * s2;
            o[u][j] = v * wv[j];
        }
        const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
        if (store && c->ok[u]) *(float4*)(a.norm + d) = make_float4(o[u][0], o[u][1], o[u][2], o[u][3]);
    }
    HC_STAGE(7);
    if (store && a.xq) {
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            float amax = fmaxf(fmaxf(fabsf(o[u][0]), fabsf(o[u][1])), fmaxf(fabsf(o[u][2]), fabsf(o[u][3])));
            for (u32 off = 1; off < 8; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            u32 packed = 0;
#pragma unroll
            for (u32 j = 0; j < 4; j++) packed |= (u32)(u8)(i8)max(-128, min(127, (int)rintf(o[u][j] * id))) << (8 * j);
            const u32 i = ch * DS4_CHUNK + u * 128 + lane * 4;
            if (c->ok[u]) {
                *(u32*)(a.xq + i) = packed;
                if ((lane & 7) == 0) a.xd[i / 32] = d;
            }
        }
    }
    if (q8k && a.xk) {
        // Per 256: the value of largest magnitude, lowest index on ties, sets d.
#pragma unroll
        for (u32 h = 0; h < 2; h++) {
            const u32 blk = ch * 2 + h;
            if (!c->ok[2 * h]) break;  // uniform: the plan asks n_embd % 256 == 0
            float am = -1.0f, mv = 0.0f;
            int idx = 0;
#pragma unroll
            for (u32 k = 0; k < 2; k++)
#pragma unroll
                for (u32 j = 0; j < 4; j++)
                    if (fabsf(o[2 * h + k][j]) > am) {
                        am = fabsf(o[2 * h + k][j]);
                        mv = o[2 * h + k][j];
                        idx = (int)(k * 128 + lane * 4 + j);
                    }
            warp_argmax(&am, &idx);
            // The winner's own lane gives its signed value.
            const float winner = __shfl_sync(0xffffffffu, mv, ((u32)idx % 128) / 4);
            const float maxv = am == 0.0f ? 0.0f : winner;
            BlockQ8K* q8 = a.xk + blk;
            const float iscale = maxv == 0.0f ? 0.0f : -127.0f / maxv;
#pragma unroll
            for (u32 k = 0; k < 2; k++) {
                u32 packed = 0;
                int sum = 0;
#pragma unroll
                for (u32 j = 0; j < 4; j++) {
                    const int q = maxv == 0.0f ? 0 : max(-128, min(127, (int)rintf(iscale * o[2 * h + k][j])));
                    packed |= (u32)(u8)(i8)q << (8 * j);
                    sum += q;
                }
                *(u32*)(q8->qs + k * 128 + lane * 4) = packed;
                for (u32 off = 1; off < 4; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if ((lane & 3) == 0) q8->bsums[k * 8 + lane / 4] = (i16)sum;
            }
            if (lane == 0) q8->d = maxv == 0.0f ? 0.0f : 1.0f / iscale;
        }
    }
}

// The first group's tail from the mix rows 0..4 (in shared memory): the pre gates, the weighted
// sum of the streams `xs` (a.x or this block's copy) and the sublayer norm with its weights
// `norm_w` (a.norm_w or a copy) and its quantizations. All threads of the block.
__device__ __forceinline__ void hc_pre_finish(u64 cond, const HcPreArgs& a, const float* mix, const float* xs,
                                              const float* norm_w) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float pre[4];
    if (threadIdx.x < 4) {
        pre[threadIdx.x] = hc_pre_gate(mix[threadIdx.x], a.scale, a.base[threadIdx.x], a.eps_hc);
        a.split[threadIdx.x] = pre[threadIdx.x];
    }
    __syncthreads();
    HC_STAGE(5);
    // Each warp keeps its chunks of `cur` in registers (the plan asks n_embd <= 16 * 512). With
    // HC_PRE_Q8K_APART and room for it, a second set of warps makes the same chunks again and
    // only their Q8_K, beside the first set's stores and Q8_0.
    __shared__ float cur_ss[HC_PRE_MAX_EMBD / DS4_CHUNK];
    const u32 ne_chunks = (a.n_embd + DS4_CHUNK - 1) / DS4_CHUNK;
    const bool apart = HC_PRE_Q8K_APART && a.xk && 2 * ne_chunks <= HC_PRE_WARPS;
    const bool first = warp < ne_chunks;
    const u32 ch = first ? warp : warp - ne_chunks;
    const bool busy = first || (apart && ch < ne_chunks);
    HcPreChunk cc;
    if (busy) {
        const float sq = hc_pre_cur_chunk(a, xs, pre, ch, lane, &cc, first);
        if (first && lane == 0) cur_ss[ch] = sq;
    }
    __syncthreads();
    HC_STAGE(6);
    if (busy) {
        float ss2 = 0.0f;
        for (u32 k = 0; k < ne_chunks; k++) ss2 += cur_ss[k];
        const float s2 = 1.0f / sqrtf(ss2 / (float)a.n_embd + a.eps_norm);
        hc_pre_norm_chunk(cond, a, norm_w, s2, ch, lane, &cc, first, !apart || !first);
    }
}

extern "C" __global__ void __launch_bounds__(HC_PRE_WARPS * 32) hc_pre(DS4_ARGS, HcPreArgs a) {
    DS4_GUARD_EARLY;
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n = a.hc_dim, nc = a.n_chunks;
    const bool group_pre = blockIdx.x < a.blocks_pre;
    const u32 rows = group_pre ? 4 : a.mix_rows - 4;
    const u32 gw = (group_pre ? blockIdx.x : blockIdx.x - a.blocks_pre) * HC_PRE_WARPS + warp;
    const bool live = gw < rows * nc;
    const u32 r = (group_pre ? 0 : 4) + (live ? gw / nc : 0), c = live ? (gw % nc) * DS4_CHUNK : 0;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(a.fn_w + (u64)r * n + c, n - c, lane);
    // The streams and norm weights the tail reads: a.x and a.norm_w, or this block's copies. With
    // the HC post inside and 5 * n_embd floats of dynamic shared memory (mod.rs hc_pre_smem), every
    // block keeps the four streams it computes there for its chunks and the tail (not read back
    // through L1 or L2), and the pre gates' blocks copy the norm weights there before their wait
    // (the tail read them after the ticket). The same values, so the same bits.
    const float* xs = a.x;
    const float* norm_w = a.norm_w;
#if !DS4_CHUNK_ROWS
    extern __shared__ __align__(16) float hc_pre_smem[];
    const bool kept = a.post_block && ds4_dynamic_smem() >= 5 * a.n_embd * 4;
    if (kept) {
        xs = hc_pre_smem;
        norm_w = hc_pre_smem + 4 * a.n_embd;
        if (group_pre)
            for (u32 i = threadIdx.x; i < a.n_embd / 4; i += blockDim.x)
                cp_async16(hc_pre_smem + 4 * a.n_embd + 4 * i, a.norm_w + 4 * i);
    }
#endif
    ds4_wait_predecessor(cond);
    float scale;
    // The streams this warp's chunk reads: `x` itself, or (the HC post fused in front) the
    // post's outputs as this block computes them.
    const float* xc = a.x + c;
#if !DS4_CHUNK_ROWS
    __shared__ __align__(16) float post_x[HC_PRE_WARPS][DS4_CHUNK];
    __shared__ float post_ss[64];
    if (a.post_block) {
        // Every block computes the HC post of every chunk for the sums of squares (a warp per
        // 512 positions of all four streams; block 0 also stores the streams and the Add's sum),
        // then its warps their own chunk again into shared memory (or, kept, find it among the
        // streams there): the same values as hc_post's, so the same bits as the two launches.
        const HcPostArgs pa = {a.post_block, a.post_block_b, a.post_sum, a.post_residual, a.post_split, (float*)a.x,
                               nullptr,      a.n_embd,       4};
        const u32 nd = a.n_embd / DS4_CHUNK;
        for (u32 dr = warp; dr < nd; dr += HC_PRE_WARPS) {
            float sq[4];
            hc_post_range(pa, dr, lane, blockIdx.x == 0, sq, kept ? hc_pre_smem : nullptr);
            if (lane == 0)
                for (u32 dst = 0; dst < 4; dst++) post_ss[dst * nd + dr] = sq[dst];
        }
        if (live && !kept) hc_post_chunk(pa, c / DS4_CHUNK, lane, false, post_x[warp]);
        __syncthreads();
        scale = 1.0f / sqrtf(ordered_sum_lanes(post_ss, nc, lane) / (float)n + a.eps_flat);
        xc = kept ? hc_pre_smem + c : post_x[warp];
    } else
#endif
    if (a.ss) scale = 1.0f / sqrtf(ordered_sum_lanes(a.ss, nc, lane) / (float)n + a.eps_flat);
    else scale = rms_scale_block(a.x, n, a.eps_flat);
    if (live) {
        const float s = warp_sum(chunk_dot_f16_scaled(chunk, xc, scale, n - c, lane));
        if (lane == 0) a.partial[r * nc + c / DS4_CHUNK] = s;
        if (r == 0)
            for (u32 i = lane; i < min((u32)DS4_CHUNK, n - c); i += 32) a.flat[c + i] = xc[i] * scale;
    }
    __threadfence();
    __syncthreads();
    if (!DS4_TRACE_HC_STAGES) DS4_TRACE_MARK(7);  // the last block at its ticket
    const u32 ticket = a.ticket + (group_pre ? 0 : 1);
    const u32 group_blocks = group_pre ? a.blocks_pre : gridDim.x - a.blocks_pre;
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + ticket, 1u) == group_blocks - 1;
    cp_async_wait();  // the norm weights' copies (none issued otherwise), long done by now
    __syncthreads();
    if (!last) return;
    __threadfence();
    __shared__ float mix[32];
    if (group_pre || !DS4_TRACE_HC_STAGES) DS4_TRACE_MARK(group_pre ? 3 : 5);  // a tail starts
    if (!group_pre) {
        hc_pre_mix_rows(a, 4, rows, mix);
        if (warp == 0) hc_split_warp(mix, a.scale, a.base, a.split, a.iters, a.eps_hc, false);
        if (threadIdx.x == 0) a.tickets[ticket] = 0;
        if (!DS4_TRACE_HC_STAGES) DS4_TRACE_MARK(6);
        return;
    }
    hc_pre_mix_rows(a, 0, 4, mix);
    hc_pre_finish(cond, a, mix, xs, norm_w);
#if DS4_TRACE_HC_TAIL_TWICE
    // A measurement (trace build): the tail again, the same stores of the same values; slot 7 notes
    // the first pass's end, slot 4 the second's, so a second pass much shorter than the first
    // would mean the first waits on something other than its data (e.g. fetching its code).
    __syncthreads();
    DS4_TRACE_MARK(7);
    hc_pre_finish(cond, a, mix, xs, norm_w);
    __syncthreads();
#endif
    if (threadIdx.x == 0) a.tickets[ticket] = 0;
    DS4_TRACE_MARK(4);
}

#if DS4_CHUNK_ROWS
// hc_pre in three launches for a chunk's token rows, the same bits: hc_pre_flat (per token row:
// the streams' RMS scale and `flat`, a warp per 512-chunk as hc_pre's row-0 warps write it),
// hc_pre_mix (the control projection of every token row as a tile product, f16_tile: each weight
// read once per 32 token rows; `flat` is exactly the x * scale hc_pre multiplies the weights by),
// hc_pre_tail (per token row: block 0 the pre gates, weighted sum and norm, block 1 the Sinkhorn
// split, as hc_pre's two last blocks do).
extern "C" __global__ void __launch_bounds__(HC_PRE_WARPS * 32) hc_pre_flat(DS4_ARGS, HcPreArgs a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n = a.hc_dim, nc = a.n_chunks;
    float scale;
    if (a.ss) scale = 1.0f / sqrtf(ordered_sum_lanes(a.ss, nc, lane) / (float)n + a.eps_flat);
    else scale = rms_scale_block(a.x, n, a.eps_flat);
    const u32 c = (blockIdx.x * HC_PRE_WARPS + warp) * DS4_CHUNK;
    if (c < n)
        for (u32 i = lane; i < min((u32)DS4_CHUNK, n - c); i += 32) a.flat[c + i] = a.x[c + i] * scale;
}

// hc_pre_mix's tile: 16 HC_MIX_TR matrix rows x 16 HC_MIX_TT token rows (mod.rs hc_mix_tile
// defines them: 32 x 64, the control projection having 24 rows).
#ifndef HC_MIX_TR
#define HC_MIX_TR F16T_TR
#define HC_MIX_TT F16T_TT
#endif
extern "C" __global__ void __launch_bounds__(256, 2) hc_pre_mix(DS4_ARGS, HcPreArgs a) {
    F16Tile j;
    j.w = a.fn_w, j.w2 = nullptr, j.x = a.flat, j.out = a.mix, j.out2 = nullptr, j.partial = a.partial;
    j.tickets = a.tickets, j.x_stride = R.s[4], j.out_stride = R.s[5], j.out2_stride = 0;
    j.partial_stride = R.s[2], j.tickets_stride = R.s[3];
    j.rows = a.mix_rows, j.rows2 = 0, j.in_dim = a.hc_dim, j.ticket = a.ticket;
    f16_tile<HC_MIX_TR, HC_MIX_TT>(P, cond, j);
}

extern "C" __global__ void __launch_bounds__(HC_PRE_WARPS * 32) hc_pre_tail(DS4_ARGS, HcPreArgs a) {
    DS4_GUARD;
    __shared__ float mix[32];
    if (threadIdx.x < a.mix_rows) mix[threadIdx.x] = a.mix[threadIdx.x];
    __syncthreads();
    if (blockIdx.x == 0) hc_pre_finish(cond, a, mix, a.x, a.norm_w);
    else if (threadIdx.x < 32) hc_split_warp(mix, a.scale, a.base, a.split, a.iters, a.eps_hc, false);
}
#endif

// The router: its F16 projection split over blocks (mat_vec_f16_split), then, in the last block
// once every logit is stored, the expert choice (router_select). The same functions in the same
// order as the two kernels.
extern "C" __global__ void router(DS4_ARGS, RouterArgs a) {
    DS4_GUARD_EARLY;
    const MatVecF16SplitArgs m = {a.w,    a.x,       a.partial, a.tickets,  a.logits, nullptr, nullptr,
                                  a.in_dim, a.rows, a.rows,    a.n_chunks, a.ticket, 0};
    if (!f16_split_rows(cond, m)) return;
    __syncthreads();
    const RouterSelectArgs r = {a.logits, a.bias, a.hash, a.selected, a.weights, a.rows, a.n_used, a.n_vocab, a.scale};
    router_select_block(P, r);
}

#if !DS4_CHUNK_ROWS
// A Q8_0 matvec (q8_0_warp_row: a warp per row, the canonical order) that also does what the
// next op does with its output (plan.rs `Q8Tail`):
// 1 (norm): the last block of the launch (a ticket) RMS-normalizes the first matrix's output and
//   quantizes it, as rms_norm does;
// 2 (quant): a block of 32 warps per 32 output rows quantizes them, as quantize_q8_0 does;
// 3 (swiglu): a block of 32 warps per 32 outputs of two matrices (gate and up; each warp its row
//   of both) stores their SwiGLU and quantizes it, as swiglu does.
// Modes 2 and 3 need no global ordering: each block quantizes its own rows from shared memory,
// into a scratch of its own (other blocks may still read the input's quantization).
#define Q8_TAIL_NORM 1
#define Q8_TAIL_QUANT 2
#define Q8_TAIL_SWIGLU 3
#define Q8_TAIL_MAX_NORM 4096
// Chunks a warp loads before the wait: fewer than mat_vec_q8_0's, to fit 64 registers at 32 warps
// a block (an SM holds as many warps as with mat_vec_q8_0's blocks of 8).
#ifndef Q8_QUANT_EARLY
#define Q8_QUANT_EARLY 2
#endif
// In quant mode (wo_a on Flash: 8192 rows, 256 blocks of 1024 threads at one a block an SM, so two
// waves), block b asks L2 for the rows of block b + half the grid before its wait (q8_0_warp_row's
// PREFETCH: 1 or 2), so that the second wave finds its weights there. 0: none.
#ifndef Q8_QUANT_PREFETCH
#define Q8_QUANT_PREFETCH 0
#endif
extern "C" __global__ void __launch_bounds__(1024, 1) mat_vec_q8_0_quant(DS4_ARGS, MatVecQ80TailArgs a) {
    DS4_GUARD_EARLY;
    const MatVecQ80Args m = {a.w, a.xq, a.xd, a.out, a.w2, a.out2, a.in_dim, a.rows, a.rows_per_group, a.rows2};
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.x * 32 + warp;
    __shared__ float vals[32];
    const u32 half = (gridDim.x + 1) / 2;
    const u32 ahead = a.mode == Q8_TAIL_QUANT && blockIdx.x + half < gridDim.x ? (blockIdx.x + half) * 32 + warp : ~0u;
    // The warp's row, then (swiglu) its row of the second matrix: one copy of the row's code.
    float v = 0.0f, up = 0.0f;
    const u32 n_rows = a.mode == Q8_TAIL_SWIGLU ? 2 : 1;
#pragma unroll 1
    for (u32 k = 0; k < n_rows; k++) {
        const float x = q8_0_warp_row<Q8_QUANT_EARLY, Q8_QUANT_PREFETCH>(cond, m, k * a.rows + r, lane, ahead);
        if (k == 0) v = x;
        else up = x;
    }
    if (a.mode == Q8_TAIL_SWIGLU) v = swiglu_clamped(v, up, a.clamp);
    if (lane == 0) vals[warp] = v;
    __syncthreads();
    if (warp != 0) return;
    const float o = vals[lane];
    if (a.mode == Q8_TAIL_SWIGLU) a.tail_out[blockIdx.x * 32 + lane] = o;
    quantize_q8_0_warp(o, a.tail_xq, a.tail_xd, blockIdx.x, lane);
}

// Every block loads the norm weights its warps would use in the tail (up to 4 per lane) before its
// rows, so the last block does not wait for them (0: the tail loads them). H100 flash-4l: the
// launch 11.0 -> 9.7 us on the critical path, decode +0.5% (1172.9 against 1167.4 tok/s).
#ifndef Q8_NORM_W_EARLY
#define Q8_NORM_W_EARLY 1
#endif
extern "C" __global__ void mat_vec_q8_0_norm(DS4_ARGS, MatVecQ80TailArgs a) {
    DS4_GUARD_EARLY;
    const MatVecQ80Args m = {a.w, a.xq, a.xd, a.out, a.w2, a.out2, a.in_dim, a.rows, a.rows_per_group, a.rows2};
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
#if Q8_NORM_W_EARLY
    float w_early[4];
#pragma unroll
    for (u32 k = 0; k < 4; k++) {
        const u32 blk = warp + k * nw;
        w_early[k] = a.norm_w && blk < a.rows / 32 ? __ldg(a.norm_w + blk * 32 + lane) : 1.0f;
    }
#endif
    q8_0_warp_row(cond, m, blockIdx.x * nw + warp, lane);
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    __shared__ __align__(16) float xs[Q8_TAIL_MAX_NORM];
    const u32 n = a.rows;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) xs[i] = __ldcg(a.out + i);
    __syncthreads();
    const float scale = rms_scale_block(xs, n, a.eps);
    // Stores output block blk's normalized value o (lane's) and its Q8_0.
    const auto norm_block = [&](u32 blk, float o) {
        a.tail_out[blk * 32 + lane] = o;
        quantize_q8_0_warp(o, a.tail_xq, a.tail_xd, blk, lane);
    };
#if Q8_NORM_W_EARLY
#pragma unroll
    for (u32 k = 0; k < 4; k++) {
        const u32 blk = warp + k * nw;
        if (blk >= n / 32) break;
        const float v = xs[blk * 32 + lane] * scale;
        norm_block(blk, a.norm_w ? v * w_early[k] : v);
    }
    for (u32 blk = warp + 4 * nw; blk < n / 32; blk += nw) {
#else
    for (u32 blk = warp; blk < n / 32; blk += nw) {
#endif
        const u32 i = blk * 32 + lane;
        const float v = xs[i] * scale;
        norm_block(blk, a.norm_w ? v * a.norm_w[i] : v);
    }
    if (threadIdx.x == 0) a.tickets[a.ticket] = 0;
}

// The q projection (q8_0_warp_row, a warp per row) with qkv_finish in its blocks: block 0 does the
// kv row (the kv projection is the launch before), and of each q head's blocks the last to finish
// (a ticket per head) normalizes and rotates the head once all its rows are stored. The head goes
// through shared memory: its rows were stored by other blocks (read past L1).
#define QKV_MAX_HEAD_DIM 1024
// At 4 blocks of 256 an SM, as mat_vec_q8_0 (64 registers): unbounded, the tail took it to 66, and
// 3 blocks an SM.
#ifndef QKV_MIN_BLOCKS
#define QKV_MIN_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(256, QKV_MIN_BLOCKS) mat_vec_q8_0_qkv(DS4_ARGS, MatVecQ80QkvArgs a) {
    DS4_GUARD_EARLY;
    const u32 hd = a.head_dim, rows = a.n_head * hd;
    const float* trow = qkv_rope_row(P, a.table, a.n_rot);
    if (blockIdx.x == 0) {
        ds4_wait_predecessor(cond);
        qkv_kv_row_block(P, a.kv_raw, a.kv_norm, a.kv, a.cache, trow, hd, a.n_rot, a.raw_cap, a.eps_kv);
        return;
    }
    const MatVecQ80Args m = {a.w, a.xq, a.xd, a.q, nullptr, nullptr, a.in_dim, rows, rows, 0};
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const u32 r0 = (blockIdx.x - 1) * nw, h = r0 / hd;
    q8_0_warp_row(cond, m, r0 + warp, lane);
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket + h, 1u) == hd / nw - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    __shared__ __align__(16) float xs[QKV_MAX_HEAD_DIM];
    float* x = a.q + (u64)h * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) xs[i] = __ldcg(x + i);
    __syncthreads();
    qkv_q_head_block(xs, hd, a.n_rot, a.eps_q, trow);
    __syncthreads();
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) x[i] = xs[i];
    if (threadIdx.x == 0) a.tickets[a.ticket + h] = 0;
}
#endif
