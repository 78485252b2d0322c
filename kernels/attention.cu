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
// Fused (plan.rs): the inverse RoPE of head h's tail, then the head's Q8_0 quantization for the
// output projection, as rope_tail and quantize_q8_0 would compute them. The whole block calls it
// once the head's output is written.
template <class A> __device__ __forceinline__ void attention_head_tail(const StepParams* P, const A& a, u32 h) {
    const u32 head_dim = a.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
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
    attention_head_tail(P, a, h);
}

#if DS4_CHUNK_ROWS
// attention's chunk form (backends/cuda/mod.rs: build_chunk): a block per (token row, group of
// ATTN_CHUNK_HEADS heads) instead of per (head, row), so a block reads each visible KV row from
// L2 once for its heads rather than once per head. Every (row, head) gets `attention`'s bits:
// the same dot (chunk_dot_f32's lane order, the butterfly, + onto 0), max, exp, chunk sums and
// their order; only which thread computes what differs. K == V: the rows are staged in shared
// memory in tiles of ATTN_TILE_ROWS twice, for the scores and (once the weights are known) for
// the weighted sum; the next tile is loaded into registers while the current one is used.
//   Scores: warp w owns heads 2w and 2w + 1 of the group, their q in registers.
//   Softmax: the same warp: max, exp, a lane per chunk sums its weights, the sums in order.
//   Weighted sum: a thread per (8 heads, 4 dims) walks the rows in order: p += w * v inside a
//   chunk, acc += p at its end.
// build_chunk picks it for head_dim <= 512 (one DS4_CHUNK of the dot; a multiple of 4, as
// `attention` needs) and launches blockDim == ATTN_CHUNK_THREADS (128, 256 or 512, which it also
// defines in the source): a group of blockDim / 16 heads.
#ifndef ATTN_CHUNK_THREADS
#define ATTN_CHUNK_THREADS 256
#endif
#define ATTN_CHUNK_HEADS (ATTN_CHUNK_THREADS / 16)
// Rows per tile: four float4 loads per thread fill a tile of 512-wide rows.
#define ATTN_TILE_ROWS (ATTN_CHUNK_THREADS / 32)
#define ATTN_TILE_DIM 512
#define ATTN_TILE_LOADS (ATTN_TILE_ROWS * ATTN_TILE_DIM / 4 / ATTN_CHUNK_THREADS)
// At most 128 registers a thread, so that 512 threads of the kernel fit an SM's 64K registers.
#define ATTN_CHUNK_MIN_BLOCKS (512 / ATTN_CHUNK_THREADS)
// A tile's weights are at most one per thread.
static_assert(ATTN_TILE_ROWS * ATTN_CHUNK_HEADS <= ATTN_CHUNK_THREADS, "a weight per thread");
static_assert(ATTN_CHUNK_HEADS % 8 == 0, "whole octets of heads");

// chunk_dot_f32's lane sum with q in registers (q4[u] = q[u * 128 + lane * 4 ..]) and the row
// in shared memory.
__device__ __forceinline__ float attn_tile_dot(const float4* q4, const float* k, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = u * 128 + lane * 4;
        if (i < n) {
            const float4 x = q4[u], y = *(const float4*)(k + i);
            acc += x.x * y.x;
            acc += x.y * y.y;
            acc += x.z * y.z;
            acc += x.w * y.w;
        }
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(ATTN_CHUNK_THREADS, ATTN_CHUNK_MIN_BLOCKS) attention_chunk(DS4_ARGS, AttentionArgs a) {
    DS4_GUARD;
    __shared__ __align__(16) float tile[ATTN_TILE_ROWS * ATTN_TILE_DIM];
    // The tile's weights, [row][head of the group].
    __shared__ __align__(16) float wtile[ATTN_TILE_ROWS * ATTN_CHUNK_HEADS];
    __shared__ float inv_sh[ATTN_CHUNK_HEADS];
    const u32 head_dim = a.head_dim, quads = head_dim / 4;
    const u32 h0 = blockIdx.x * ATTN_CHUNK_HEADS;
    const u32 n_group = min((u32)ATTN_CHUNK_HEADS, a.n_head - h0);  // heads of this block
    const u32 n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    const bool indexed = a.selected != 0 && n_comp > a.top_k;
    const u32 n_vis = indexed ? a.top_k : n_comp;
    const u32 n_rows = n_raw + n_vis;
    const u32 first = P->pos + 1 - n_raw;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n_chunks = (n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;

    // Row r: raw rows oldest first, then compressed rows in ascending order (as `attention`);
    // raw row r is at ring index (first + r) % raw_cap, found from the first row's.
    const u32 ring0 = first % a.raw_cap;
    auto row_ptr = [&](u32 r) -> const float* {
        if (r < n_raw) return a.raw + (u64)(ring0 + r < a.raw_cap ? ring0 + r : ring0 + r - a.raw_cap) * head_dim;
        return a.comp + (u64)(indexed ? a.selected[r - n_raw] : (int)(r - n_raw)) * head_dim;
    };
    // Tile t0's rows into registers (rows past n_rows are not read), then into shared memory:
    // thread (tj, tc) moves the float4 tc of rows tj, tj + step, ...
    const u32 step = ATTN_CHUNK_THREADS / quads, tj = threadIdx.x / quads, tc = threadIdx.x % quads;
    float4 pf[ATTN_TILE_LOADS];
    auto load_tile = [&](u32 t0) {
#pragma unroll
        for (u32 k = 0; k < ATTN_TILE_LOADS; k++) {
            const u32 j = tj + k * step;
            if (tj < step && j < ATTN_TILE_ROWS && t0 + j < n_rows) pf[k] = *(const float4*)(row_ptr(t0 + j) + 4 * tc);
        }
    };
    auto store_tile = [&](u32 t0) {
#pragma unroll
        for (u32 k = 0; k < ATTN_TILE_LOADS; k++) {
            const u32 j = tj + k * step;
            if (tj < step && j < ATTN_TILE_ROWS && t0 + j < n_rows) *(float4*)(tile + j * head_dim + 4 * tc) = pf[k];
        }
    };

    // Scores: this warp's two heads against every row.
    const u32 ha = 2 * warp, hb = 2 * warp + 1;  // within the group
    float4 qa[4], qb[4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = u * 128 + lane * 4;
        qa[u] = qb[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < head_dim && ha < n_group) qa[u] = *(const float4*)(a.q + (u64)(h0 + ha) * head_dim + i);
        if (i < head_dim && hb < n_group) qb[u] = *(const float4*)(a.q + (u64)(h0 + hb) * head_dim + i);
    }
    float* sca = a.scores + (u64)(h0 + ha) * a.max_rows;
    float* scb = a.scores + (u64)(h0 + hb) * a.max_rows;
    load_tile(0);
    for (u32 t0 = 0; t0 < n_rows; t0 += ATTN_TILE_ROWS) {
        __syncthreads();
        store_tile(t0);
        __syncthreads();
        if (t0 + ATTN_TILE_ROWS < n_rows) load_tile(t0 + ATTN_TILE_ROWS);
        const u32 nj = min((u32)ATTN_TILE_ROWS, n_rows - t0);
        for (u32 j = 0; j < nj; j++) {
            const float* k = tile + j * head_dim;
            if (ha < n_group) {
                float d = 0.0f;
                d += warp_sum(attn_tile_dot(qa, k, head_dim, lane));
                if (lane == 0) sca[t0 + j] = d * a.kq_scale;
            }
            if (hb < n_group) {
                float d = 0.0f;
                d += warp_sum(attn_tile_dot(qb, k, head_dim, lane));
                if (lane == 0) scb[t0 + j] = d * a.kq_scale;
            }
        }
    }
    __syncwarp();
    // Softmax of this warp's heads: scores become weights; 1 / denom per head.
    for (u32 hh = ha; hh <= hb; hh++) {
        if (hh >= n_group) break;
        float* sc = a.scores + (u64)(h0 + hh) * a.max_rows;
        const float sink = a.sinks[h0 + hh];
        float m = sink;
        for (u32 r = lane; r < n_rows; r += 32) m = fmaxf(m, sc[r]);
        m = warp_max(m);
        for (u32 r = lane; r < n_rows; r += 32) sc[r] = ds4_expf(sc[r] - m);
        __syncwarp();
        // Each chunk's weight sum from +0, sequentially; then the sink's weight and the chunk
        // sums in order.
        float denom = ds4_expf(sink - m);
        for (u32 c0 = 0; c0 < n_chunks; c0 += 32) {
            const u32 c = c0 + lane;
            float s = 0.0f;
            if (c < n_chunks) {
                const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
                for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) s += sc[r];
            }
            for (u32 l = 0; l < 32; l++) {
                const float cs = __shfl_sync(0xffffffffu, s, l);
                if (c0 + l < n_chunks) denom += cs;
            }
        }
        if (lane == 0) inv_sh[hh] = 1.0f / denom;
    }
    __syncthreads();

    // Weighted sum: thread (oct, dq) owns heads 8 oct .. 8 oct + 7 and dims 4 dq .. 4 dq + 3.
    const u32 oct = threadIdx.x / quads, dq = threadIdx.x % quads;
    const bool owns = oct < ATTN_CHUNK_HEADS / 8;
    const u32 wj = threadIdx.x / ATTN_CHUNK_HEADS, wh = threadIdx.x % ATTN_CHUNK_HEADS;
    float wpf = 0.0f;
    auto load_weight = [&](u32 t0) {
        if (wj < ATTN_TILE_ROWS && t0 + wj < n_rows && wh < n_group)
            wpf = a.scores[(u64)(h0 + wh) * a.max_rows + t0 + wj];
    };
    float4 acc[8], p[8];
#pragma unroll
    for (u32 k = 0; k < 8; k++) acc[k] = p[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    load_tile(0);
    load_weight(0);
    for (u32 t0 = 0; t0 < n_rows; t0 += ATTN_TILE_ROWS) {
        __syncthreads();
        store_tile(t0);
        if (wj < ATTN_TILE_ROWS) wtile[threadIdx.x] = wpf;
        __syncthreads();
        if (t0 + ATTN_TILE_ROWS < n_rows) {
            load_tile(t0 + ATTN_TILE_ROWS);
            load_weight(t0 + ATTN_TILE_ROWS);
        }
        if (!owns) continue;
        const u32 nj = min((u32)ATTN_TILE_ROWS, n_rows - t0);
        for (u32 j = 0; j < nj; j++) {
            if (j + t0 > 0 && (j + t0) % DS4_ATTN_ROW_CHUNK == 0) {
                // A chunk ends: its sums join the total in order.
#pragma unroll
                for (u32 k = 0; k < 8; k++) {
                    acc[k].x += p[k].x;
                    acc[k].y += p[k].y;
                    acc[k].z += p[k].z;
                    acc[k].w += p[k].w;
                    p[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            const float4 v = *(const float4*)(tile + j * head_dim + 4 * dq);
            const float4 w0 = *(const float4*)(wtile + j * ATTN_CHUNK_HEADS + 8 * oct);
            const float4 w1 = *(const float4*)(wtile + j * ATTN_CHUNK_HEADS + 8 * oct + 4);
            const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                p[k].x += w[k] * v.x;
                p[k].y += w[k] * v.y;
                p[k].z += w[k] * v.z;
                p[k].w += w[k] * v.w;
            }
        }
    }
    if (owns) {
#pragma unroll
        for (u32 k = 0; k < 8; k++) {
            const u32 hh = 8 * oct + k;
            if (hh >= n_group) break;
            const float inv = inv_sh[hh];
            float4 o;
            o.x = (acc[k].x + p[k].x) * inv;
            o.y = (acc[k].y + p[k].y) * inv;
            o.z = (acc[k].z + p[k].z) * inv;
            o.w = (acc[k].w + p[k].w) * inv;
            *(float4*)(a.out + (u64)(h0 + hh) * head_dim + 4 * dq) = o;
        }
    }
    // Fused (plan.rs): the inverse RoPE of each head's tail, then the heads' Q8_0 quantization,
    // as `attention` computes them.
    float* og = a.out + (u64)h0 * head_dim;
    if (a.rope) {
        __syncthreads();
        const u32 pairs = a.n_rot / 2;
        const float* trow = a.rope + (u64)P->pos * pairs * 2;
        for (u32 t = threadIdx.x; t < n_group * pairs; t += blockDim.x)
            rope_pair(og + (t / pairs) * head_dim + (head_dim - a.n_rot), trow, t % pairs, true);
    }
    if (a.xq) {
        __syncthreads();
        const u32 nw = blockDim.x >> 5;
        for (u32 b = warp; b < n_group * head_dim / 32; b += nw)
            quantize_q8_0_warp(og[b * 32 + lane], a.xq, a.xd, h0 * (head_dim / 32) + b, lane);
    }
}
#endif

#if DS4_CHUNK_ROWS
// attention's chunk form over two token rows and 16 heads a block (mod.rs: build_chunk; the
// default; DS4_CUDA_ATTN_CHUNK=1 keeps attention_chunk, =0 `attention`): each staged KV row feeds
// 32 (row, head) pairs instead of 16. Neighbouring token rows see nearly the same KV rows, so the
// block walks a "universe" of rows that covers both: the raw rows of both windows by ascending
// position, then the compressed rows by ascending index; vis[i][u] is token row i's own index of
// universe row u in `attention`'s order (raw rows oldest first, then its visible compressed rows,
// or its `selected` list), or none. Both orders ascend, so each row meets its rows in its own
// order and skips the rest. The indexer's list is ascending (indexer_top_k); a block checks it
// (strictly ascending, each entry visible) and otherwise, or when the universe overflows the
// table, runs its rows one at a time with the universe = that row's own rows (no sharing).
// Every (row, head) gets `attention`'s bits:
//   Scores: warp w owns token row w / 4 and heads 4 (w % 4) .. + 3, q of its lane's dims in
//     registers; per KV row a lane forms chunk_dot_f32's lane sums of its 4 heads and the
//     butterfly's first level (l + (l ^ 16)) by one shuffle; then lane (row, head) of the warp
//     adds the 16 level-one sums in the butterfly's tree, d = 0 + that, times kq_scale.
//     The lane sum's first product enters without `0 +` (the sum feeds d = 0 + ..., which
//     absorbs a zero's sign).
//   Softmax: a warp per (row, head) as attention_chunk; the chunk sums read the weights from
//     shared memory when they fit (1024 floats a warp).
//   Weighted sum: thread (row, 8 heads, 8 dims) walks its row's rows in order: p += w * v inside
//     a chunk of the row's own index, acc += p at its end; out = (acc + p) * inv.
// The KV rows are staged in tiles of ATTN_ROWS_TILE rows twice (scores, then the weighted sum),
// the next tile in registers while the current one is used. head_dim <= 512 and a multiple of 4
// (plan.rs, mod.rs). The token row count is in cond bits 50..62; blockIdx.y picks the row pair.
#define ATTN_ROWS_THREADS 256
#define ATTN_ROWS_HEADS 16
#define ATTN_ROWS_TILE 8
#define ATTN_ROWS_VIS 3072  // universe rows vis holds
#define ATTN_ROWS_NONE 0xffffu
#define ATTN_ROWS_LOADS (ATTN_ROWS_TILE * 128 / ATTN_ROWS_THREADS)

// One token row of a block.
struct AttnRowsY {
    AttentionArgs a;  // its pointers
    u32 pos, n_raw, n_comp, n_rows, first;
    bool indexed, on;
};

// Pieces the chunk attention kernels over staged KV rows (attention_rows, attention_rows2,
// attention_row_wide) share, each in `attention`'s float order.

// One staged KV row (this lane's float4s at kr, kr + 128, + 256, + 384) against q of a warp's 4
// heads: each head's lane sum, then the butterfly's first level (l + (l ^ 16)). A lane sum's
// first product enters without `0 +`: the sum feeds d = 0 + ..., which absorbs a zero's sign.
__device__ __forceinline__ float4 attn_rows_level_one(const float4 (&q)[4][4], const float* kr) {
    float acc[4];
    const float4 y0 = *(const float4*)kr;
#pragma unroll
    for (u32 k = 0; k < 4; k++) {
        acc[k] = q[k][0].x * y0.x;
        acc[k] += q[k][0].y * y0.y;
        acc[k] += q[k][0].z * y0.z;
        acc[k] += q[k][0].w * y0.w;
    }
#pragma unroll
    for (u32 u = 1; u < 4; u++) {
        const float4 y = *(const float4*)(kr + u * 128);
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            acc[k] += q[k][u].x * y.x;
            acc[k] += q[k][u].y * y.y;
            acc[k] += q[k][u].z * y.z;
            acc[k] += q[k][u].w * y.w;
        }
    }
    float4 s1;
    s1.x = acc[0] + __shfl_xor_sync(0xffffffffu, acc[0], 16);
    s1.y = acc[1] + __shfl_xor_sync(0xffffffffu, acc[1], 16);
    s1.z = acc[2] + __shfl_xor_sync(0xffffffffu, acc[2], 16);
    s1.w = acc[3] + __shfl_xor_sync(0xffffffffu, acc[3], 16);
    return s1;
}

// The butterfly's levels 8, 4, 2, 1 over a head's 16 level-one sums (lanes 0..15), then d = 0 +
// that.
__device__ __forceinline__ float attn_rows_dot(float (&s)[16]) {
#pragma unroll
    for (u32 l = 0; l < 8; l++) s[l] = s[l] + s[l + 8];
#pragma unroll
    for (u32 l = 0; l < 4; l++) s[l] = s[l] + s[l + 4];
#pragma unroll
    for (u32 l = 0; l < 2; l++) s[l] = s[l] + s[l + 2];
    float d = 0.0f;
    d += s[0] + s[1];
    return d;
}

// One head's softmax by a warp: its n_rows scores at sc become the weights exp(score - m), m the
// max with the sink, also copied to the warp's buffer wbuf (1024 floats; chunk c's row r at r +
// c, so that the lanes' chunk sums read distinct banks) when they fit. Returns the denominator:
// the sink's weight, then each chunk's weight sum (from +0, sequentially) in chunk order.
__device__ __forceinline__ float attn_rows_softmax(float* sc, float sink, u32 n_rows, float* wbuf, u32 lane) {
    const u32 n_chunks = (n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;
    const bool inbuf = n_rows + n_chunks <= 1024;
    float m = sink;
    for (u32 r = lane; r < n_rows; r += 32) m = fmaxf(m, sc[r]);
    m = warp_max(m);
    for (u32 r = lane; r < n_rows; r += 32) {
        const float e = ds4_expf(sc[r] - m);
        sc[r] = e;
        if (inbuf) wbuf[r + r / DS4_ATTN_ROW_CHUNK] = e;
    }
    __syncwarp();
    float denom = ds4_expf(sink - m);
    for (u32 c0 = 0; c0 < n_chunks; c0 += 32) {
        const u32 c = c0 + lane;
        float s = 0.0f;
        if (c < n_chunks) {
            const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
            for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) s += inbuf ? wbuf[r + c] : sc[r];
        }
        for (u32 l = 0; l < 32; l++) {
            const float cs = __shfl_sync(0xffffffffu, s, l);
            if (c0 + l < n_chunks) denom += cs;
        }
    }
    return denom;
}

// The weighted sum's step for one KV row: p[k][hf] += w[k] * v, 8 heads' weights at wr, the
// thread's dims at vr and vr + 256.
__device__ __forceinline__ void attn_rows_mac(float4 (&p)[8][2], const float* vr, const float* wr) {
    const float4 v[2] = {*(const float4*)vr, *(const float4*)(vr + 256)};
    const float4 w0 = *(const float4*)wr;
    const float4 w1 = *(const float4*)(wr + 4);
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (u32 k = 0; k < 8; k++)
#pragma unroll
        for (u32 hf = 0; hf < 2; hf++) {
            p[k][hf].x += w[k] * v[hf].x;
            p[k][hf].y += w[k] * v[hf].y;
            p[k][hf].z += w[k] * v[hf].z;
            p[k][hf].w += w[k] * v[hf].w;
        }
}

// A chunk of KV rows ended: its sums p join the totals in shared memory (acc[(2 k + hf) *
// stride]) in order, and p restarts from +0.
__device__ __forceinline__ void attn_rows_flush(float4* acc, u32 stride, float4 (&p)[8][2]) {
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (u32 k = 0; k < 8; k++)
#pragma unroll
        for (u32 hf = 0; hf < 2; hf++) {
            float4& a = acc[(2 * k + hf) * stride];
            float4 t = a;
            t.x += p[k][hf].x;
            t.y += p[k][hf].y;
            t.z += p[k][hf].z;
            t.w += p[k][hf].w;
            a = t;
            p[k][hf] = zero4;
        }
}

extern "C" __global__ void __launch_bounds__(ATTN_ROWS_THREADS, 1) attention_rows(DS4_ARGS, AttentionArgs a0) {
    ds4_wait_predecessor(cond);
    // The KV tile, then per warp the level-one sums of [tile row][lane ^ tile row][head] (the xor
    // spreads the banks); during the softmax, 1024 floats a warp for its weights.
    __shared__ __align__(16) float smem[ATTN_ROWS_TILE * 512 + 8 * ATTN_ROWS_TILE * 64];
    float* const tile = smem;
    float* const part = smem + ATTN_ROWS_TILE * 512;
    __shared__ __align__(16) float wt[ATTN_ROWS_TILE][2][ATTN_ROWS_HEADS];  // weights [row][token row][head]
    __shared__ u16 vis[2][ATTN_ROWS_VIS];
    __shared__ float inv_sh[2][ATTN_ROWS_HEADS];
    __shared__ u32 flag_sh;
    const u32 rows = (u32)(cond >> 50) & 0x1fff;
    const u32 head_dim = a0.head_dim, quads = head_dim / 4;
    const u32 h0 = blockIdx.x * ATTN_ROWS_HEADS, n_group = min((u32)ATTN_ROWS_HEADS, a0.n_head - h0);
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    AttnRowsY Y[2];
#pragma unroll
    for (u32 i = 0; i < 2; i++) {
        const u32 y = blockIdx.y * 2 + i;
        AttnRowsY& v = Y[i];
        v.a = a0;
        ds4_row(v.a, R, y);
        v.on = y < rows && ds4_cond(P + y, cond);
        v.pos = v.on ? P[y].pos : 0;
        v.n_raw = v.on ? ds4_raw_rows(P + y, a0.window, a0.raw_cap) : 0;
        v.n_comp = v.on ? ds4_comp_rows(P + y, a0.ratio, a0.comp_cap) : 0;
        v.indexed = a0.selected != 0 && v.n_comp > a0.top_k;
        v.n_rows = v.n_raw + (v.indexed ? a0.top_k : v.n_comp);
        v.first = v.pos + 1 - v.n_raw;
    }
    if (!Y[0].on && !Y[1].on) return;

    // The shared universe when both rows run: raw positions lo..hi, then compressed rows 0..n_comp.
    const u32 lo = min(Y[0].first, Y[1].first), hi = max(Y[0].pos, Y[1].pos);
    const u32 u_raw = hi + 1 - lo, u_all = u_raw + max(Y[0].n_comp, Y[1].n_comp);
    bool shared = Y[0].on && Y[1].on && hi - lo < ATTN_ROWS_VIS && u_all <= ATTN_ROWS_VIS;
    if (shared) {
        for (u32 u = tid; u < u_all; u += ATTN_ROWS_THREADS)
#pragma unroll
            for (u32 i = 0; i < 2; i++) {
                const AttnRowsY& v = Y[i];
                u32 r = ATTN_ROWS_NONE;
                if (u < u_raw) {
                    const u32 p = lo + u;
                    if (p >= v.first && p <= v.pos) r = p - v.first;
                } else if (!v.indexed && u - u_raw < v.n_comp) {
                    r = v.n_raw + (u - u_raw);
                }
                vis[i][u] = (u16)r;
            }
        if (tid == 0) flag_sh = 0;
        __syncthreads();
#pragma unroll
        for (u32 i = 0; i < 2; i++) {
            const AttnRowsY& v = Y[i];
            if (!v.indexed) continue;
            for (u32 e = tid; e < a0.top_k; e += ATTN_ROWS_THREADS) {
                const int c = v.a.selected[e];
                const bool ok = c >= 0 && (u32)c < v.n_comp && (e == 0 || v.a.selected[e - 1] < c);
                if (ok)
                    vis[i][u_raw + c] = (u16)(v.n_raw + e);
                else
                    flag_sh = 1;
            }
        }
        __syncthreads();
        shared = flag_sh == 0;
    }

    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // One pass of the block over a universe: `single` 2 is the shared one; 0 or 1 is that token
    // row alone, its own rows in order (universe row u = its row u).
    auto run = [&](u32 single) {
        const u32 n_univ = single < 2 ? Y[single].n_rows : u_all;
        auto mine = [&](u32 i) { return single < 2 ? i == single : Y[i].on; };
        auto visof = [&](u32 i, u32 u) -> u32 {
            if (single < 2) return i == single ? u : ATTN_ROWS_NONE;
            return vis[i][u];
        };
        auto kv_row = [&](u32 u) -> const float* {
            if (single < 2) {
                const AttnRowsY& v = Y[single];
                if (u < v.n_raw) return a0.raw + (u64)((v.first + u) % a0.raw_cap) * head_dim;
                return a0.comp + (u64)(v.indexed ? v.a.selected[u - v.n_raw] : (int)(u - v.n_raw)) * head_dim;
            }
            if (u < u_raw) return a0.raw + (u64)((lo + u) % a0.raw_cap) * head_dim;
            return a0.comp + (u64)(u - u_raw) * head_dim;
        };
        float4 pf[ATTN_ROWS_LOADS];
        auto load_tile = [&](u32 t0) {
#pragma unroll
            for (u32 k = 0; k < ATTN_ROWS_LOADS; k++) {
                const u32 f = tid + k * ATTN_ROWS_THREADS, j = f / quads;
                if (j < ATTN_ROWS_TILE && t0 + j < n_univ) pf[k] = *(const float4*)(kv_row(t0 + j) + 4 * (f % quads));
            }
        };
        auto store_tile = [&](u32 t0) {
#pragma unroll
            for (u32 k = 0; k < ATTN_ROWS_LOADS; k++) {
                const u32 f = tid + k * ATTN_ROWS_THREADS, j = f / quads;
                if (j < ATTN_ROWS_TILE && t0 + j < n_univ) *(float4*)(tile + j * 512 + 4 * (f % quads)) = pf[k];
            }
        };
        __syncthreads();
        // The tile's dims past head_dim are +0 for the scores (staging writes the first head_dim).
        for (u32 f = tid; f < ATTN_ROWS_TILE * 128; f += ATTN_ROWS_THREADS) *(float4*)(tile + 4 * f) = zero4;

        // Scores: this warp's token row and 4 heads.
        const u32 si = warp >> 2, hq0 = (warp & 3) * 4;
        const AttnRowsY ys = si ? Y[1] : Y[0];
        const bool on = mine(si);
        float4 q[4][4];
#pragma unroll
        for (u32 k = 0; k < 4; k++)
#pragma unroll
            for (u32 u = 0; u < 4; u++) {
                const u32 d = u * 128 + lane * 4;
                q[k][u] = zero4;
                if (on && d < head_dim && hq0 + k < n_group)
                    q[k][u] = *(const float4*)(ys.a.q + (u64)(h0 + hq0 + k) * head_dim + d);
            }
        load_tile(0);
        for (u32 t0 = 0; t0 < n_univ; t0 += ATTN_ROWS_TILE) {
            __syncthreads();
            store_tile(t0);
            __syncthreads();
            if (t0 + ATTN_ROWS_TILE < n_univ) load_tile(t0 + ATTN_ROWS_TILE);
            if (!on) continue;
            const u32 nj = min((u32)ATTN_ROWS_TILE, n_univ - t0);
            for (u32 jj = 0; jj < nj; jj++) {
                if (visof(si, t0 + jj) == ATTN_ROWS_NONE) continue;
                // Dims past head_dim hold +0 in q and in the tile: their products and sums are
                // +0, as the lane sums that skip them (no branch per float4).
                const float* kr = tile + jj * 512 + lane * 4;
                const float4 s1 = attn_rows_level_one(q, kr);
                if (lane < 16) *(float4*)(part + ((warp * ATTN_ROWS_TILE + jj) * 16 + (lane ^ jj)) * 4) = s1;
            }
            __syncwarp();
            // Lane (tile row lane / 4, head lane % 4): the butterfly's levels 8, 4, 2, 1 of the
            // level-one sums of lanes 0..15.
            const u32 mj = lane >> 2, mk = lane & 3;
            if (mj < nj && hq0 + mk < n_group) {
                const u32 r = visof(si, t0 + mj);
                if (r != ATTN_ROWS_NONE) {
                    float s[16];
#pragma unroll
                    for (u32 l = 0; l < 16; l++) s[l] = part[((warp * ATTN_ROWS_TILE + mj) * 16 + (l ^ mj)) * 4 + mk];
                    const float d = attn_rows_dot(s);
                    ys.a.scores[(u64)(h0 + hq0 + mk) * a0.max_rows + r] = d * a0.kq_scale;
                }
            }
        }
        __syncthreads();
        // Softmax: warp w takes (token row w / 4, head 4 (w % 4) + k) for k = 0..3, its buffer for
        // the weights at smem + 1024 w (attn_rows_softmax).
        float* const wbuf = smem + warp * 1024;
        for (u32 k = 0; k < 4; k++) {
            const u32 hh = hq0 + k;
            if (!on || hh >= n_group) break;
            float* sc = ys.a.scores + (u64)(h0 + hh) * a0.max_rows;
            const float sink = a0.sinks[h0 + hh];
            const float denom = attn_rows_softmax(sc, sink, ys.n_rows, wbuf, lane);
            if (lane == 0) inv_sh[si][hh] = 1.0f / denom;
            __syncwarp();
        }
        __syncthreads();

        // Weighted sum: thread (token row tid / 128, heads 8 oct .. + 7, dims 4 dq .. + 3 and
        // 256 + 4 dq .. + 3); the same token row as the warp's scores.
        const u32 oct = (tid >> 6) & 1, dq = tid & 63;
        // Staging the weights: thread (tile row, token row, head).
        const u32 wj = tid >> 5, wi = (tid >> 4) & 1, wh = tid & 15;
        const float* wsc = (wi ? Y[1].a.scores : Y[0].a.scores) + (u64)(h0 + wh) * a0.max_rows;
        float wpf = 0.0f;
        auto load_weight = [&](u32 t0) {
            wpf = 0.0f;
            if (t0 + wj < n_univ && mine(wi) && wh < n_group) {
                const u32 r = visof(wi, t0 + wj);
                if (r != ATTN_ROWS_NONE) wpf = wsc[r];
            }
        };
        float4 acc[8][2], p[8][2];
#pragma unroll
        for (u32 k = 0; k < 8; k++) acc[k][0] = acc[k][1] = p[k][0] = p[k][1] = zero4;
        load_tile(0);
        load_weight(0);
        for (u32 t0 = 0; t0 < n_univ; t0 += ATTN_ROWS_TILE) {
            __syncthreads();
            store_tile(t0);
            (&wt[0][0][0])[tid] = wpf;
            __syncthreads();
            if (t0 + ATTN_ROWS_TILE < n_univ) {
                load_tile(t0 + ATTN_ROWS_TILE);
                load_weight(t0 + ATTN_ROWS_TILE);
            }
            if (!on) continue;
            const u32 nj = min((u32)ATTN_ROWS_TILE, n_univ - t0);
            for (u32 j = 0; j < nj; j++) {
                const u32 r = visof(si, t0 + j);
                if (r == ATTN_ROWS_NONE) continue;
                if (r > 0 && r % DS4_ATTN_ROW_CHUNK == 0) {
                    // A chunk of this token row's rows ends: its sums join the total in order.
#pragma unroll
                    for (u32 k = 0; k < 8; k++)
#pragma unroll
                        for (u32 hf = 0; hf < 2; hf++) {
                            acc[k][hf].x += p[k][hf].x;
                            acc[k][hf].y += p[k][hf].y;
                            acc[k][hf].z += p[k][hf].z;
                            acc[k][hf].w += p[k][hf].w;
                            p[k][hf] = zero4;
                        }
                }
                attn_rows_mac(p, tile + j * 512 + 4 * dq, &wt[j][si][8 * oct]);
            }
        }
        if (on) {
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                const u32 hh = 8 * oct + k;
                if (hh >= n_group) break;
                const float inv = inv_sh[si][hh];
#pragma unroll
                for (u32 hf = 0; hf < 2; hf++) {
                    const u32 d = hf * 256 + 4 * dq;
                    if (d >= head_dim) break;
                    float4 o;
                    o.x = (acc[k][hf].x + p[k][hf].x) * inv;
                    o.y = (acc[k][hf].y + p[k][hf].y) * inv;
                    o.z = (acc[k][hf].z + p[k][hf].z) * inv;
                    o.w = (acc[k][hf].w + p[k][hf].w) * inv;
                    *(float4*)(ys.a.out + (u64)(h0 + hh) * head_dim + d) = o;
                }
            }
        }
    };
    if (shared) {
        run(2);
    } else {
        if (Y[0].on) run(0);
        if (Y[1].on) run(1);
    }
    // Fused (plan.rs): the inverse RoPE of each head's tail, then the heads' Q8_0 quantization,
    // as `attention` computes them, for both token rows.
    if (a0.rope) {
        __syncthreads();
        const u32 pairs = a0.n_rot / 2, per = n_group * pairs;
        for (u32 t = tid; t < 2 * per; t += ATTN_ROWS_THREADS) {
            const u32 i = t / per, tt = t % per;
            const AttnRowsY& v = Y[i];
            if (!v.on) continue;
            float* og = v.a.out + (u64)h0 * head_dim;
            rope_pair(og + (tt / pairs) * head_dim + (head_dim - a0.n_rot), a0.rope + (u64)v.pos * pairs * 2, tt % pairs, true);
        }
    }
    if (a0.xq) {
        __syncthreads();
        const u32 nb = n_group * head_dim / 32;
        for (u32 b = warp; b < 2 * nb; b += ATTN_ROWS_THREADS / 32) {
            const u32 i = b / nb, bb = b % nb;
            const AttnRowsY& v = Y[i];
            if (!v.on) continue;
            quantize_q8_0_warp(v.a.out[(u64)h0 * head_dim + bb * 32 + lane], v.a.xq, v.a.xd, h0 * (head_dim / 32) + bb, lane);
        }
    }
}
#endif

#if DS4_CHUNK_ROWS
// attention_rows with two blocks per SM (mod.rs picks it with DS4_CUDA_ATTN_ROWS=rows2): the same
// blocks, universe, warps' roles and float order as attention_rows, so every (row, head) gets
// `attention`'s bits; what differs is where values live:
//   - the weighted sum's running totals (acc, 64 floats a thread) live in shared memory, read
//     and written only at a chunk's end, so a thread needs <= 128 registers (231 before) and
//     two blocks of 256 threads share an SM;
//   - the KV tiles are copied by cp.async into two buffers (the next tile's copies run during
//     the current tile's math), one barrier a tile instead of two, no staging registers;
//   - a KV row's address is found without a division (the ring wraps at most once: the
//     universe's raw rows are at most raw_cap, else the rows run alone), and a thread copies
//     the same float4 of its rows every tile;
//   - the universe's compressed rows are the union of the rows' own (two indexer picks, or
//     every visible row), not every compressed row up to the larger count: past ~2k positions
//     two picks of 512 from thousands share the block instead of staging them all (at 8k, 2,048
//     staged rows for 512 used) or, past attention_rows' 3,072-row table, running the rows one
//     at a time with half the warps idle. A shared pass costs the union's rows, never more than
//     the two rows alone.
// Dynamic shared memory, ATTN_R2_SMEM bytes (mod.rs: attn_rows2_smem), in floats:
//   [0, 8192)         two KV tiles of ATTN_ROWS_TILE rows x 512
//   [8192, 24576)     acc [16 float4][256 threads]; before the weighted sum: the softmax's
//                     buffers (8 warps x 1024); during the scores, the level-one sums (8
//                     warps x ATTN_ROWS_TILE x ATTN_R2_PROW) at 8192 floats in
//   [24576, 25088)    the weights of two tiles [tile][row][token row][head]
//   [25088, 27136)    vis, u16 [2][ATTN_R2_VIS_ROWS]
//   [27136, 28160)    ucomp, u16 [ATTN_R2_VIS_ROWS]: the compressed row of each universe row past
//                     the raw ones
//   [28160, 28192)    1 / denom [token row][head]; then the shared flag and the universe count
//   While the universe is built, the acc area holds a bitmap of the compressed rows either token
//   row sees and each bitmap word's count of set bits before it.
// Universe rows of a shared pass: the raw window and the union of the two rows' compressed rows
// (two indexer picks of top_k are at most 2 top_k).
#define ATTN_R2_VIS_ROWS 2048
// Bitmap words (32 compressed rows each) the universe's build can hold: ucomp is u16.
#define ATTN_R2_BM_WORDS 2048
#define ATTN_R2_TILES 0
#define ATTN_R2_ACC (2 * ATTN_ROWS_TILE * 512)
#define ATTN_R2_PART (ATTN_R2_ACC + 8 * 1024)
#define ATTN_R2_WT (ATTN_R2_ACC + 16 * 4 * ATTN_ROWS_THREADS)
#define ATTN_R2_VIS (ATTN_R2_WT + 2 * ATTN_ROWS_TILE * 2 * ATTN_ROWS_HEADS)
#define ATTN_R2_UC (ATTN_R2_VIS + ATTN_R2_VIS_ROWS)
#define ATTN_R2_INV (ATTN_R2_UC + ATTN_R2_VIS_ROWS / 2)
#define ATTN_R2_FLAG (ATTN_R2_INV + 2 * ATTN_ROWS_HEADS)
#define ATTN_R2_SMEM (4 * (ATTN_R2_FLAG + 4))
static_assert(ATTN_ROWS_TILE == 8 && ATTN_ROWS_THREADS == 256, "the layout above; a warp per tile row");
static_assert(2 * ATTN_R2_BM_WORDS <= 16 * 4 * ATTN_ROWS_THREADS, "the bitmap and its counts fit in the acc area");
// A tile row's level-one sums [lane][head] padded to 68 floats, so that the butterfly's lanes
// (tile row, head) read distinct banks and the row's float4s stay 16-byte aligned.
#define ATTN_R2_PROW 68
static_assert(8 * ATTN_ROWS_TILE * ATTN_R2_PROW <= 8 * 1024, "the level-one sums fit beside the softmax buffers");

extern "C" __global__ void __launch_bounds__(ATTN_ROWS_THREADS, 2) attention_rows2(DS4_ARGS, AttentionArgs a0) {
    ds4_wait_predecessor(cond);
    extern __shared__ __align__(16) float attn_r2_smem[];
    ds4_check_dynamic_smem(ATTN_R2_SMEM);  // mod.rs: attn_rows2_smem
    float* const tiles = attn_r2_smem + ATTN_R2_TILES;
    float4* const acc_sh = (float4*)(attn_r2_smem + ATTN_R2_ACC);
    float* const part = attn_r2_smem + ATTN_R2_PART;
    float* const wt = attn_r2_smem + ATTN_R2_WT;
    u16* const vis = (u16*)(attn_r2_smem + ATTN_R2_VIS);
    float* const inv_sh = attn_r2_smem + ATTN_R2_INV;
    u32* const flag_sh = (u32*)(attn_r2_smem + ATTN_R2_FLAG);
    const u32 rows = (u32)(cond >> 50) & 0x1fff;
    const u32 head_dim = a0.head_dim;
    const u32 h0 = blockIdx.x * ATTN_ROWS_HEADS, n_group = min((u32)ATTN_ROWS_HEADS, a0.n_head - h0);
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    AttnRowsY Y[2];
#pragma unroll
    for (u32 i = 0; i < 2; i++) {
        const u32 y = blockIdx.y * 2 + i;
        AttnRowsY& v = Y[i];
        v.a = a0;
        ds4_row(v.a, R, y);
        v.on = y < rows && ds4_cond(P + y, cond);
        v.pos = v.on ? P[y].pos : 0;
        v.n_raw = v.on ? ds4_raw_rows(P + y, a0.window, a0.raw_cap) : 0;
        v.n_comp = v.on ? ds4_comp_rows(P + y, a0.ratio, a0.comp_cap) : 0;
        v.indexed = a0.selected != 0 && v.n_comp > a0.top_k;
        v.n_rows = v.n_raw + (v.indexed ? a0.top_k : v.n_comp);
        v.first = v.pos + 1 - v.n_raw;
    }
    if (!Y[0].on && !Y[1].on) return;

    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The tiles' dims past head_dim stay +0 for the scores (the copies write the first head_dim).
    for (u32 f = tid; f < 2 * ATTN_ROWS_TILE * 128; f += ATTN_ROWS_THREADS) *(float4*)(tiles + 4 * f) = zero4;
    // The shared universe when both rows run: raw positions lo..hi, then the compressed rows
    // either row sees, ascending (the union of two indexer picks, or every visible row). Its raw
    // rows are at most raw_cap, so that their ring indices wrap at most once. The compressed rows
    // are found through a bitmap: rank(c), the set bits before bit c, is c's place in the union.
    u16* const ucomp = (u16*)(attn_r2_smem + ATTN_R2_UC);
    const u32 lo = min(Y[0].first, Y[1].first), hi = max(Y[0].pos, Y[1].pos);
    const u32 u_raw = hi + 1 - lo, n_words = (max(Y[0].n_comp, Y[1].n_comp) + 31) / 32;
    u32 u_all = 0;
    bool shared = Y[0].on && Y[1].on && u_raw <= ATTN_R2_VIS_ROWS && u_raw <= a0.raw_cap &&
                  n_words <= ATTN_R2_BM_WORDS;
    if (shared) {
        u32* const bm = (u32*)(attn_r2_smem + ATTN_R2_ACC);
        u32* const before = bm + ATTN_R2_BM_WORDS;
        for (u32 w = tid; w < n_words; w += ATTN_ROWS_THREADS) bm[w] = 0;
        if (tid == 0) flag_sh[0] = 0;
        __syncthreads();
#pragma unroll
        for (u32 i = 0; i < 2; i++) {
            const AttnRowsY& v = Y[i];
            if (v.indexed) {
                for (u32 e = tid; e < a0.top_k; e += ATTN_ROWS_THREADS) {
                    const int c = v.a.selected[e];
                    const bool ok = c >= 0 && (u32)c < v.n_comp && (e == 0 || v.a.selected[e - 1] < c);
                    if (ok)
                        atomicOr(bm + c / 32, 1u << (c % 32));
                    else
                        flag_sh[0] = 1;
                }
            } else {
                for (u32 w = tid; w < (v.n_comp + 31) / 32; w += ATTN_ROWS_THREADS)
                    atomicOr(bm + w, 32 * (w + 1) <= v.n_comp ? ~0u : (1u << (v.n_comp % 32)) - 1);
            }
        }
        __syncthreads();
        if (warp == 0) {
            // before[w]: the set bits of words 0..w - 1 (an inclusive warp scan per 32 words).
            u32 carry = 0;
            for (u32 w0 = 0; w0 < n_words; w0 += 32) {
                const u32 n = w0 + lane < n_words ? (u32)__popc(bm[w0 + lane]) : 0;
                u32 x = n;
#pragma unroll
                for (u32 o = 1; o < 32; o *= 2) {
                    const u32 y = __shfl_up_sync(0xffffffffu, x, o);
                    if (lane >= o) x += y;
                }
                if (w0 + lane < n_words) before[w0 + lane] = carry + x - n;
                carry += __shfl_sync(0xffffffffu, x, 31);
            }
            if (lane == 0) flag_sh[1] = carry;
        }
        __syncthreads();
        u_all = u_raw + flag_sh[1];
        shared = flag_sh[0] == 0 && u_all <= ATTN_R2_VIS_ROWS;
        if (shared) {
            for (u32 u = tid; u < u_all; u += ATTN_ROWS_THREADS)
#pragma unroll
                for (u32 i = 0; i < 2; i++) {
                    const AttnRowsY& v = Y[i];
                    u32 r = ATTN_ROWS_NONE;
                    const u32 p = lo + u;
                    if (u < u_raw && p >= v.first && p <= v.pos) r = p - v.first;
                    vis[i * ATTN_R2_VIS_ROWS + u] = (u16)r;
                }
            for (u32 w = tid; w < n_words; w += ATTN_ROWS_THREADS) {
                const u32 bits = bm[w];
                u32 k = before[w];
                for (u32 b = 0; b < 32; b++)
                    if ((bits >> b) & 1) ucomp[k++] = (u16)(32 * w + b);
            }
            __syncthreads();
            // Each row's own index of its compressed rows, at their places in the union.
            auto rank = [&](u32 c) { return before[c / 32] + (u32)__popc(bm[c / 32] & ((1u << (c % 32)) - 1)); };
#pragma unroll
            for (u32 i = 0; i < 2; i++) {
                const AttnRowsY& v = Y[i];
                const u32 n = v.indexed ? a0.top_k : v.n_comp;
                for (u32 e = tid; e < n; e += ATTN_ROWS_THREADS) {
                    const u32 c = v.indexed ? (u32)v.a.selected[e] : e;
                    vis[i * ATTN_R2_VIS_ROWS + u_raw + rank(c)] = (u16)(v.n_raw + e);
                }
            }
        }
        // The bitmap's area is the acc area: every read of it is done before the passes.
        __syncthreads();
    }

    // Pass 0 is the shared universe, or token row 0 alone; pass 1 token row 1 alone.
    for (u32 pass = 0; pass < 2; pass++) {
        if (shared && pass == 1) break;
        // single 2: the shared universe; 0 or 1: that token row alone, its own rows in order
        // (universe row u = its row u).
        const u32 single = shared ? 2 : pass;
        if (single < 2 && !Y[single].on) continue;
        const AttnRowsY& yo = single == 1 ? Y[1] : Y[0];
        const u32 n_univ = single < 2 ? yo.n_rows : u_all;
        auto mine = [&](u32 i) { return single < 2 ? i == single : (i ? Y[1].on : Y[0].on); };
        auto visof = [&](u32 i, u32 u) -> u32 {
            if (single < 2) return i == single ? u : ATTN_ROWS_NONE;
            return vis[i * ATTN_R2_VIS_ROWS + u];
        };
        // visof(si, u) for this warp's token row si (below).
        const u16* const vis_si = vis + (warp >> 2) * ATTN_R2_VIS_ROWS;
        const bool single_si = single < 2, mine_si = (warp >> 2) == single;
        auto visof_si = [&](u32 u) -> u32 {
            if (single_si) return mine_si ? u : ATTN_ROWS_NONE;
            return vis_si[u];
        };
        // Universe row u's address: the first nr rows are raw rows from ring index ring0 on
        // (wrapping at most once), then compressed rows (through `sel` when the row alone is
        // indexed, through ucomp in the shared universe).
        const u32 nr = single < 2 ? yo.n_raw : u_raw;
        const u32 ring0 = (single < 2 ? yo.first : lo) % a0.raw_cap;
        const int* const sel = single < 2 && yo.indexed ? yo.a.selected : nullptr;
        auto kv_row = [&](u32 u) -> const float* {
            const bool raw = u < nr;
            u32 i = raw ? ring0 + u : u - nr;
            if (raw && i >= a0.raw_cap) i -= a0.raw_cap;
            if (!raw) i = sel ? (u32)sel[i] : single == 2 ? ucomp[i] : i;
            // A selected index is a non-negative int (the shared universe checks it; the row
            // alone reads it as `attention` does).
            return (raw ? a0.raw : a0.comp) + (u64)i * head_dim;
        };
        // Warp w copies tile row w: lane l the float4s l, l + 32, l + 64, l + 96 (one address a
        // tile per thread).
        auto issue_tile = [&](u32 t0, u32 b) {
            if (t0 + warp >= n_univ) return;
            const float* const src = kv_row(t0 + warp) + 4 * lane;
            float* const dst = tiles + (b * ATTN_ROWS_TILE + warp) * 512 + 4 * lane;
#pragma unroll
            for (u32 k = 0; k < 4; k++)
                if (4 * lane + 128 * k < head_dim) cp_async16(dst + 128 * k, src + 128 * k);
        };
        // The previous pass's last reads of the tiles and acc are done.
        __syncthreads();

        // Scores: this warp's token row and 4 heads.
        const u32 si = warp >> 2, hq0 = (warp & 3) * 4;
        const AttnRowsY& ys = si ? Y[1] : Y[0];
        const bool on = mine(si);
        float4 q[4][4];
#pragma unroll
        for (u32 k = 0; k < 4; k++)
#pragma unroll
            for (u32 u = 0; u < 4; u++) {
                const u32 d = u * 128 + lane * 4;
                q[k][u] = zero4;
                if (on && d < head_dim && hq0 + k < n_group)
                    q[k][u] = *(const float4*)(ys.a.q + (u64)(h0 + hq0 + k) * head_dim + d);
            }
        float* const wpart = part + warp * ATTN_ROWS_TILE * ATTN_R2_PROW;
        issue_tile(0, 0);
        for (u32 t0 = 0, it = 0; t0 < n_univ; t0 += ATTN_ROWS_TILE, it++) {
            // This tile's copies are done (each thread's own), then everyone's; the other buffer
            // is free (its tile's math is done).
            cp_async_wait();
            __syncthreads();
            if (t0 + ATTN_ROWS_TILE < n_univ) issue_tile(t0 + ATTN_ROWS_TILE, (it + 1) & 1);
            if (!on) continue;
            const float* kr = tiles + (it & 1) * ATTN_ROWS_TILE * 512 + lane * 4;
            float* pw = wpart + lane * 4;
            const u32 nj = min((u32)ATTN_ROWS_TILE, n_univ - t0);
            for (u32 jj = 0; jj < nj; jj++, kr += 512, pw += ATTN_R2_PROW) {
                if (visof_si(t0 + jj) == ATTN_ROWS_NONE) continue;
                // Dims past head_dim hold +0 in q and in the tile: their products and sums are
                // +0, as the lane sums that skip them (no branch per float4).
                const float4 s1 = attn_rows_level_one(q, kr);
                if (lane < 16) *(float4*)pw = s1;
            }
            __syncwarp();
            // Lane (tile row lane / 4, head lane % 4): the butterfly's levels 8, 4, 2, 1 of the
            // level-one sums of lanes 0..15.
            const u32 mj = lane >> 2, mk = lane & 3;
            if (mj < nj && hq0 + mk < n_group) {
                const u32 r = visof_si(t0 + mj);
                if (r != ATTN_ROWS_NONE) {
                    const float* const pp = wpart + mj * ATTN_R2_PROW + mk;
                    float s[16];
#pragma unroll
                    for (u32 l = 0; l < 16; l++) s[l] = pp[l * 4];
                    const float d = attn_rows_dot(s);
                    ys.a.scores[(u64)(h0 + hq0 + mk) * a0.max_rows + r] = d * a0.kq_scale;
                }
            }
            __syncwarp();
        }
        __syncthreads();
        // Softmax: warp w takes (token row w / 4, head 4 (w % 4) + k) for k = 0..3, as
        // attention_rows (its buffer in the acc area).
        float* const wbuf = attn_r2_smem + ATTN_R2_ACC + warp * 1024;
        for (u32 k = 0; k < 4; k++) {
            const u32 hh = hq0 + k;
            if (!on || hh >= n_group) break;
            float* sc = ys.a.scores + (u64)(h0 + hh) * a0.max_rows;
            const float sink = a0.sinks[h0 + hh];
            const float denom = attn_rows_softmax(sc, sink, ys.n_rows, wbuf, lane);
            if (lane == 0) inv_sh[si * ATTN_ROWS_HEADS + hh] = 1.0f / denom;
            __syncwarp();
        }
        __syncthreads();

        // Weighted sum: thread (token row tid / 128, heads 8 oct .. + 7, dims 4 dq .. + 3 and
        // 256 + 4 dq .. + 3); the same token row as the warp's scores. Its totals acc[k][hf] in
        // shared memory at acc_sh[(2 k + hf) * 256 + tid], from +0.
        const u32 oct = (tid >> 6) & 1, dq = tid & 63;
#pragma unroll
        for (u32 s = 0; s < 16; s++) acc_sh[s * ATTN_ROWS_THREADS + tid] = zero4;
        // Staging the weights: thread (tile row, token row, head).
        const u32 wj = tid >> 5, wi = (tid >> 4) & 1, wh = tid & 15;
        const float* wsc = (wi ? Y[1].a.scores : Y[0].a.scores) + (u64)(h0 + wh) * a0.max_rows;
        float wpf = 0.0f;
        auto load_weight = [&](u32 t0) {
            wpf = 0.0f;
            if (t0 + wj < n_univ && mine(wi) && wh < n_group) {
                const u32 r = visof(wi, t0 + wj);
                if (r != ATTN_ROWS_NONE) wpf = wsc[r];
            }
        };
        float4 p[8][2];
#pragma unroll
        for (u32 k = 0; k < 8; k++) p[k][0] = p[k][1] = zero4;
        // This thread's float4s of a tile row (dims 4 dq.., 256 + 4 dq..), its token row's
        // weights of its heads, its totals.
        const float* const vbase = tiles + 4 * dq;
        const float* const wbase = wt + si * ATTN_ROWS_HEADS + 8 * oct;
        float4* const accp = acc_sh + tid;
        issue_tile(0, 0);
        load_weight(0);
        for (u32 t0 = 0, it = 0; t0 < n_univ; t0 += ATTN_ROWS_TILE, it++) {
            const u32 b = it & 1;
            cp_async_wait();
            wt[b * ATTN_ROWS_TILE * 2 * ATTN_ROWS_HEADS + tid] = wpf;
            __syncthreads();
            if (t0 + ATTN_ROWS_TILE < n_univ) {
                issue_tile(t0 + ATTN_ROWS_TILE, b ^ 1);
                load_weight(t0 + ATTN_ROWS_TILE);
            }
            if (!on) continue;
            const float* vr = vbase + b * ATTN_ROWS_TILE * 512;
            const float* wr = wbase + b * ATTN_ROWS_TILE * 2 * ATTN_ROWS_HEADS;
            const u32 nj = min((u32)ATTN_ROWS_TILE, n_univ - t0);
            for (u32 j = 0; j < nj; j++, vr += 512, wr += 2 * ATTN_ROWS_HEADS) {
                const u32 r = visof_si(t0 + j);
                if (r == ATTN_ROWS_NONE) continue;
                if (r > 0 && r % DS4_ATTN_ROW_CHUNK == 0) {
                    // A chunk of this token row's rows ends: its sums join the total in order.
                    attn_rows_flush(accp, ATTN_ROWS_THREADS, p);
                }
                attn_rows_mac(p, vr, wr);
            }
        }
        if (on) {
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                const u32 hh = 8 * oct + k;
                if (hh >= n_group) break;
                const float inv = inv_sh[si * ATTN_ROWS_HEADS + hh];
#pragma unroll
                for (u32 hf = 0; hf < 2; hf++) {
                    const u32 d = hf * 256 + 4 * dq;
                    if (d >= head_dim) break;
                    const float4 acc = acc_sh[(2 * k + hf) * ATTN_ROWS_THREADS + tid];
                    float4 o;
                    o.x = (acc.x + p[k][hf].x) * inv;
                    o.y = (acc.y + p[k][hf].y) * inv;
                    o.z = (acc.z + p[k][hf].z) * inv;
                    o.w = (acc.w + p[k][hf].w) * inv;
                    *(float4*)(ys.a.out + (u64)(h0 + hh) * head_dim + d) = o;
                }
            }
        }
    }
    // Fused (plan.rs): the inverse RoPE of each head's tail, then the heads' Q8_0 quantization,
    // as `attention` computes them, for both token rows.
    if (a0.rope) {
        __syncthreads();
        const u32 pairs = a0.n_rot / 2, per = n_group * pairs;
        for (u32 t = tid; t < 2 * per; t += ATTN_ROWS_THREADS) {
            const u32 i = t / per, tt = t % per;
            const AttnRowsY& v = i ? Y[1] : Y[0];
            if (!v.on) continue;
            float* og = v.a.out + (u64)h0 * head_dim;
            rope_pair(og + (tt / pairs) * head_dim + (head_dim - a0.n_rot), a0.rope + (u64)v.pos * pairs * 2, tt % pairs, true);
        }
    }
    if (a0.xq) {
        __syncthreads();
        const u32 nb = n_group * head_dim / 32;
        for (u32 b = warp; b < 2 * nb; b += ATTN_ROWS_THREADS / 32) {
            const u32 i = b / nb, bb = b % nb;
            const AttnRowsY& v = i ? Y[1] : Y[0];
            if (!v.on) continue;
            quantize_q8_0_warp(v.a.out[(u64)h0 * head_dim + bb * 32 + lane], v.a.xq, v.a.xd, h0 * (head_dim / 32) + bb, lane);
        }
    }
}
#endif

#if DS4_CHUNK_ROWS
// attention_row_wide (the default; DS4_CUDA_ATTN_ROWS=rows2 or old picks the pair kernels): a
// block per (token row, group of 32 heads), 256 threads, two blocks per SM. Past ~2k positions two rows' indexer
// picks overlap little, so attention_rows2's pair shares few KV rows while every warp walks the
// union and skips what is not its own; here the universe is the row's own rows in `attention`'s
// order (raw window rows oldest first, then the selected list or every visible compressed row),
// so every staged row feeds all 32 heads and nothing is skipped. Every (row, head) gets
// `attention`'s bits by attention_rows2's float order:
//   Scores: warp w takes heads 4w..4w + 3 (q in registers) over every staged row: lane sums,
//     the xor-16 level, then a lane per (tile row, head) the butterfly's other levels; d = 0 +
//     that, times kq_scale. The lane sum's first product enters without `0 +` (it feeds d = 0 +
//     ..., which absorbs a zero's sign; attention_rows).
//   Softmax: warp w its 4 heads, as attention_rows2.
//   Weighted sum: thread (heads 8 (tid / 64) .. + 7, dims 4 dq .. + 3 and 256 + 4 dq .. + 3,
//     dq = tid % 64) walks the rows in order: p += w * v inside a chunk of DS4_ATTN_ROW_CHUNK
//     rows, the totals in shared memory += p at its end; out = (acc + p) * inv.
// KV tiles of ATTN_WIDE_TILE rows by cp.async, double buffered, one barrier a tile, staged twice
// (scores, then the weighted sum). Heads past n_head compute zeros and store nothing; the
// barriers stay uniform. head_dim <= 512 and a multiple of 4 (mod.rs). blockIdx.y is the token
// row (DS4_GUARD), so it is not an ALL_ROWS_KERNELS kernel.
// Dynamic shared memory, ATTN_W_SMEM bytes (mod.rs: attn_wide_smem), in floats:
//   [0, 8192)         two KV tiles of ATTN_WIDE_TILE rows x 512
//   [8192, 24576)     acc [16 float4][256 threads]; before the weighted sum the softmax's
//                     buffers (8 warps x 1024); during the scores the level-one sums (8 warps x
//                     ATTN_WIDE_TILE x ATTN_R2_PROW) at 8192 floats in
//   [24576, 25088)    the weights of two tiles [tile][row][head]
//   [25088, 25120)    1 / denom [head]
#define ATTN_WIDE_THREADS 256
#define ATTN_WIDE_HEADS 32
#define ATTN_WIDE_TILE 8
#define ATTN_W_TILES 0
#define ATTN_W_ACC (2 * ATTN_WIDE_TILE * 512)
#define ATTN_W_PART (ATTN_W_ACC + 8 * 1024)
#define ATTN_W_WT (ATTN_W_ACC + 16 * 4 * ATTN_WIDE_THREADS)
#define ATTN_W_INV (ATTN_W_WT + 2 * ATTN_WIDE_TILE * ATTN_WIDE_HEADS)
#define ATTN_W_SMEM (4 * (ATTN_W_INV + ATTN_WIDE_HEADS))
static_assert(ATTN_WIDE_TILE == 8 && ATTN_WIDE_THREADS == 256 && ATTN_WIDE_HEADS == 32,
              "the layout above: a warp per tile row, 4 heads a warp, 8 heads a weighted-sum thread");
static_assert(DS4_ATTN_ROW_CHUNK % ATTN_WIDE_TILE == 0, "a chunk of rows starts at a tile's start");
static_assert(8 * ATTN_WIDE_TILE * ATTN_R2_PROW <= 8 * 1024, "the level-one sums fit beside the softmax buffers");

extern "C" __global__ void __launch_bounds__(ATTN_WIDE_THREADS, 2) attention_row_wide(DS4_ARGS, AttentionArgs a) {
    DS4_GUARD;
    extern __shared__ __align__(16) float attn_w_smem[];
    ds4_check_dynamic_smem(ATTN_W_SMEM);  // mod.rs: attn_wide_smem
    float* const tiles = attn_w_smem + ATTN_W_TILES;
    float4* const acc_sh = (float4*)(attn_w_smem + ATTN_W_ACC);
    float* const part = attn_w_smem + ATTN_W_PART;
    float* const wt = attn_w_smem + ATTN_W_WT;
    float* const inv_sh = attn_w_smem + ATTN_W_INV;
    const u32 head_dim = a.head_dim;
    const u32 h0 = blockIdx.x * ATTN_WIDE_HEADS, n_group = min((u32)ATTN_WIDE_HEADS, a.n_head - h0);
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    const bool indexed = a.selected != 0 && n_comp > a.top_k;
    const u32 n_rows = n_raw + (indexed ? a.top_k : n_comp);
    // The raw rows' ring indices from ring0 on wrap at most once (n_raw <= raw_cap).
    const u32 ring0 = (P->pos + 1 - n_raw) % a.raw_cap;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The tiles' dims past head_dim stay +0 for the scores (the copies write the first head_dim).
    for (u32 f = tid; f < 2 * ATTN_WIDE_TILE * 128; f += ATTN_WIDE_THREADS) *(float4*)(tiles + 4 * f) = zero4;

    // Rows in `attention`'s order: raw rows oldest first, then compressed rows (the selected
    // list's order when indexed; a selected index is read as `attention` reads it). Row r's
    // compressed index, read a tile before its copies so that they wait on no load:
    auto comp_index = [&](u32 r) -> int {
        if (r < n_raw || r >= n_rows) return 0;
        return indexed ? a.selected[r - n_raw] : (int)(r - n_raw);
    };
    // Warp w copies tile row w (ci: its comp_index): lane l the float4s l, l + 32, l + 64, l + 96.
    auto issue_tile = [&](u32 t0, u32 b, int ci) {
        const u32 r = t0 + warp;
        if (r >= n_rows) return;
        const float* src = a.comp + (u64)ci * head_dim;
        if (r < n_raw) {
            u32 i = ring0 + r;
            if (i >= a.raw_cap) i -= a.raw_cap;
            src = a.raw + (u64)i * head_dim;
        }
        src += 4 * lane;
        float* const dst = tiles + (b * ATTN_WIDE_TILE + warp) * 512 + 4 * lane;
#pragma unroll
        for (u32 k = 0; k < 4; k++)
            if (4 * lane + 128 * k < head_dim) cp_async16(dst + 128 * k, src + 128 * k);
    };
    // The tiles' zeros are written before any copy lands beside them.
    __syncthreads();

    // Scores: this warp's 4 heads (warps past n_group only keep the barriers).
    const u32 hq0 = warp * 4;
    const bool busy = hq0 < n_group;
    float4 q[4][4];
#pragma unroll
    for (u32 k = 0; k < 4; k++)
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 d = u * 128 + lane * 4;
            q[k][u] = zero4;
            if (d < head_dim && hq0 + k < n_group) q[k][u] = *(const float4*)(a.q + (u64)(h0 + hq0 + k) * head_dim + d);
        }
    float* const wpart = part + warp * ATTN_WIDE_TILE * ATTN_R2_PROW;
    issue_tile(0, 0, comp_index(warp));
    int ci = comp_index(ATTN_WIDE_TILE + warp);
    for (u32 t0 = 0, it = 0; t0 < n_rows; t0 += ATTN_WIDE_TILE, it++) {
        // This tile's copies are done (each thread's own), then everyone's; the other buffer is
        // free (its tile's math is done).
        cp_async_wait();
        __syncthreads();
        if (t0 + ATTN_WIDE_TILE < n_rows) {
            issue_tile(t0 + ATTN_WIDE_TILE, (it + 1) & 1, ci);
            ci = comp_index(t0 + 2 * ATTN_WIDE_TILE + warp);
        }
        if (!busy) continue;
        const float* kr = tiles + (it & 1) * ATTN_WIDE_TILE * 512 + lane * 4;
        float* pw = wpart + lane * 4;
        const u32 nj = min((u32)ATTN_WIDE_TILE, n_rows - t0);
        for (u32 jj = 0; jj < nj; jj++, kr += 512, pw += ATTN_R2_PROW) {
            // Dims past head_dim hold +0 in q and in the tile: their products and sums are +0,
            // as the lane sums that skip them.
            const float4 s1 = attn_rows_level_one(q, kr);
            if (lane < 16) *(float4*)pw = s1;
        }
        __syncwarp();
        // Lane (tile row lane / 4, head lane % 4): the butterfly's levels 8, 4, 2, 1 of the
        // level-one sums of lanes 0..15.
        const u32 mj = lane >> 2, mk = lane & 3;
        if (mj < nj && hq0 + mk < n_group) {
            const float* const pp = wpart + mj * ATTN_R2_PROW + mk;
            float s[16];
#pragma unroll
            for (u32 l = 0; l < 16; l++) s[l] = pp[l * 4];
            const float d = attn_rows_dot(s);
            a.scores[(u64)(h0 + hq0 + mk) * a.max_rows + t0 + mj] = d * a.kq_scale;
        }
        __syncwarp();
    }
    __syncthreads();
    // Softmax: warp w its heads 4w + k, k = 0..3, as attention_rows2 (its buffer in the acc area).
    float* const wbuf = attn_w_smem + ATTN_W_ACC + warp * 1024;
    for (u32 k = 0; k < 4; k++) {
        const u32 hh = hq0 + k;
        if (hh >= n_group) break;
        float* sc = a.scores + (u64)(h0 + hh) * a.max_rows;
        const float sink = a.sinks[h0 + hh];
        const float denom = attn_rows_softmax(sc, sink, n_rows, wbuf, lane);
        if (lane == 0) inv_sh[hh] = 1.0f / denom;
        __syncwarp();
    }
    __syncthreads();

    // Weighted sum: thread (heads 8 oct .. + 7, dims 4 dq .. + 3 and 256 + 4 dq .. + 3). Its
    // totals acc[k][hf] in shared memory at acc_sh[(2 k + hf) * 256 + tid], from +0.
    const u32 oct = tid >> 6, dq = tid & 63;
    const bool busy_sum = 8 * oct < n_group;
#pragma unroll
    for (u32 s = 0; s < 16; s++) acc_sh[s * ATTN_WIDE_THREADS + tid] = zero4;
    // Staging the weights: thread (tile row, head).
    const u32 wj = tid >> 5, wh = tid & 31;
    const float* const wsc = a.scores + (u64)(h0 + wh) * a.max_rows;
    float wpf = 0.0f;
    auto load_weight = [&](u32 t0) {
        wpf = 0.0f;
        if (t0 + wj < n_rows && wh < n_group) wpf = wsc[t0 + wj];
    };
    float4 p[8][2];
#pragma unroll
    for (u32 k = 0; k < 8; k++) p[k][0] = p[k][1] = zero4;
    const float* const vbase = tiles + 4 * dq;
    const float* const wbase = wt + 8 * oct;
    float4* const accp = acc_sh + tid;
    issue_tile(0, 0, comp_index(warp));
    ci = comp_index(ATTN_WIDE_TILE + warp);
    load_weight(0);
    for (u32 t0 = 0, it = 0; t0 < n_rows; t0 += ATTN_WIDE_TILE, it++) {
        const u32 b = it & 1;
        cp_async_wait();
        wt[b * ATTN_WIDE_TILE * ATTN_WIDE_HEADS + tid] = wpf;
        __syncthreads();
        if (t0 + ATTN_WIDE_TILE < n_rows) {
            issue_tile(t0 + ATTN_WIDE_TILE, b ^ 1, ci);
            ci = comp_index(t0 + 2 * ATTN_WIDE_TILE + warp);
            load_weight(t0 + ATTN_WIDE_TILE);
        }
        if (!busy_sum) continue;
        if (t0 > 0 && t0 % DS4_ATTN_ROW_CHUNK == 0) {
            // A chunk of rows ended with the last tile: its sums join the totals in order.
            attn_rows_flush(accp, ATTN_WIDE_THREADS, p);
        }
        const float* vr = vbase + b * ATTN_WIDE_TILE * 512;
        const float* wr = wbase + b * ATTN_WIDE_TILE * ATTN_WIDE_HEADS;
        const u32 nj = min((u32)ATTN_WIDE_TILE, n_rows - t0);
        for (u32 j = 0; j < nj; j++, vr += 512, wr += ATTN_WIDE_HEADS) {
            attn_rows_mac(p, vr, wr);
        }
    }
    if (busy_sum) {
#pragma unroll
        for (u32 k = 0; k < 8; k++) {
            const u32 hh = 8 * oct + k;
            if (hh >= n_group) break;
            const float inv = inv_sh[hh];
#pragma unroll
            for (u32 hf = 0; hf < 2; hf++) {
                const u32 d = hf * 256 + 4 * dq;
                if (d >= head_dim) break;
                const float4 acc = acc_sh[(2 * k + hf) * ATTN_WIDE_THREADS + tid];
                float4 o;
                o.x = (acc.x + p[k][hf].x) * inv;
                o.y = (acc.y + p[k][hf].y) * inv;
                o.z = (acc.z + p[k][hf].z) * inv;
                o.w = (acc.w + p[k][hf].w) * inv;
                *(float4*)(a.out + (u64)(h0 + hh) * head_dim + d) = o;
            }
        }
    }
    // Fused (plan.rs): the inverse RoPE of each head's tail, then the heads' Q8_0 quantization,
    // as `attention` computes them.
    if (a.rope) {
        __syncthreads();
        const u32 pairs = a.n_rot / 2, per = n_group * pairs;
        float* const og = a.out + (u64)h0 * head_dim + (head_dim - a.n_rot);
        for (u32 t = tid; t < per; t += ATTN_WIDE_THREADS)
            rope_pair(og + (t / pairs) * head_dim, a.rope + (u64)P->pos * pairs * 2, t % pairs, true);
    }
    if (a.xq) {
        __syncthreads();
        const u32 nb = n_group * head_dim / 32;
        for (u32 b = warp; b < nb; b += ATTN_WIDE_THREADS / 32)
            quantize_q8_0_warp(a.out[(u64)h0 * head_dim + b * 32 + lane], a.xq, a.xd, h0 * (head_dim / 32) + b, lane);
    }
}
#endif

#if !DS4_CHUNK_ROWS
// attention's decode form split over the KV rows (plan.rs picks it for a decode program with
// head_dim <= 512; DS4_CUDA_ATTN_DECODE=0 keeps `attention`). `attention` runs a block per head
// that reads every visible row twice; here three launches spread the rows over the GPU and read
// each row from L2 once per group of ATTN_SPLIT_HEADS heads per pass:
//   attention_scores: a block per (slice of ATTN_SCORE_ROWS rows, head group) stages the slice's
//     rows in shared memory and stores the group's scores, and each head's max over the slice;
//   attention_partial: a block per (64-row chunk, head group, slice of blockDim dims): m = the
//     head's max over the slices and its sink, the chunk's weights, their sum (slice 0), and the
//     chunk's weighted sum of the rows per (head, dim);
//   attention_combine: a block per head adds the chunk sums in order, scales, then the fused RoPE
//     and Q8_0 tail.
// Every (row, head) gets `attention`'s bits: the same dot (chunk_dot_f32's lane order, the
// butterfly, + onto 0), exp(s - m) with the same m (max is order-free), each chunk's weights and
// weighted rows added sequentially from +0, denom = exp(sink - m) + the chunk sums in order, out =
// (0 + the chunks' sums in order) * (1 / denom). Scratch (plan.rs): `maxes` [slice][head], `sums`
// [1 + chunk][head] (row 0: m), `parts` [chunk][head][dim]. ATTN_SPLIT_HEADS, ATTN_SCORE_ROWS,
// ATTN_SCORE_THREADS and ATTN_SUM_THREADS come from plan.rs, which sizes the grids and scratch
// by them (mod.rs: kernel_source).
#define ATTN_WARP_HEADS 4  // heads per warp in attention_scores, their q in registers
#define ATTN_HEAD_SETS (ATTN_SPLIT_HEADS / ATTN_WARP_HEADS)
#define ATTN_ROW_SETS (ATTN_SCORE_THREADS / 32 / ATTN_HEAD_SETS)
static_assert(ATTN_SPLIT_HEADS % ATTN_WARP_HEADS == 0 && ATTN_ROW_SETS >= 1, "whole head sets per block");
static_assert(ATTN_SPLIT_HEADS % 4 == 0, "the weights of a row as float4s");
static_assert(ATTN_SCORE_ROWS <= ATTN_SCORE_THREADS && ATTN_SUM_THREADS >= DS4_ATTN_ROW_CHUNK, "a thread per row pointer");
static_assert(ATTN_SPLIT_HEADS == 16 && ATTN_SUM_THREADS % 32 == 0, "attention_partial: lanes l and l ^ 16 share a head");

// The visible rows of this token, as `attention` counts them: the raw rows oldest first (raw row
// r at ring index (ring0 + r) % raw_cap), then the visible compressed rows ascending.
struct AttnRows {
    u32 n_raw, n_rows, ring0;
    bool indexed;
};
template <class A> __device__ __forceinline__ AttnRows attn_rows(const StepParams* P, const A& a) {
    AttnRows v;
    v.n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    v.indexed = a.selected != 0 && n_comp > a.top_k;
    v.n_rows = v.n_raw + (v.indexed ? a.top_k : n_comp);
    v.ring0 = (P->pos + 1 - v.n_raw) % a.raw_cap;
    return v;
}
template <class A> __device__ __forceinline__ const float* attn_row(const A& a, const AttnRows& v, u32 r) {
    if (r < v.n_raw) {
        const u32 i = v.ring0 + r;
        return a.raw + (u64)(i < a.raw_cap ? i : i - a.raw_cap) * a.head_dim;
    }
    return a.comp + (u64)(v.indexed ? a.selected[r - v.n_raw] : (int)(r - v.n_raw)) * a.head_dim;
}
// fmaxf's identity: fmaxf(NaN, x) = x, so a max that starts here is the max over a set whatever
// its grouping (NaN only when every value is NaN, as in `attention`).
#define ATTN_MAX_NONE __int_as_float(0x7fc00000)

// Grid: slices of ATTN_SCORE_ROWS rows x head groups (group fastest, so that the groups of a
// slice read its rows from L2 close together). Warp w holds q of ATTN_WARP_HEADS heads (head set
// w % ATTN_HEAD_SETS) in registers and takes every ATTN_ROW_SETS-th row of the slice.
extern "C" __global__ void __launch_bounds__(ATTN_SCORE_THREADS) attention_scores(DS4_ARGS, AttentionScoresArgs a) {
    DS4_GUARD;
    __shared__ __align__(16) float tile[ATTN_SCORE_ROWS * 512];
    __shared__ const float* rowp[ATTN_SCORE_ROWS];
    __shared__ float wmax[ATTN_SCORE_THREADS / 32][ATTN_WARP_HEADS];
    const AttnRows v = attn_rows(P, a);
    const u32 n_groups = (a.n_head + ATTN_SPLIT_HEADS - 1) / ATTN_SPLIT_HEADS;
    const u32 g = blockIdx.x % n_groups, slice = blockIdx.x / n_groups, r0 = slice * ATTN_SCORE_ROWS;
    if (r0 >= v.n_rows) return;
    const u32 nj = min((u32)ATTN_SCORE_ROWS, v.n_rows - r0);
    const u32 head_dim = a.head_dim, quads = head_dim / 4;
    const u32 h0 = g * ATTN_SPLIT_HEADS, n_group = min((u32)ATTN_SPLIT_HEADS, a.n_head - h0);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x < nj) rowp[threadIdx.x] = attn_row(a, v, r0 + threadIdx.x);
    // q of this warp's heads (zeros past the group or head_dim), loaded while the rows are found.
    const u32 hs = warp % ATTN_HEAD_SETS, rs = warp / ATTN_HEAD_SETS;
    float4 q[ATTN_WARP_HEADS][4];
#pragma unroll
    for (u32 k = 0; k < ATTN_WARP_HEADS; k++) {
        const u32 hh = hs * ATTN_WARP_HEADS + k;
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 i = u * 128 + lane * 4;
            q[k][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (i < head_dim && hh < n_group) q[k][u] = *(const float4*)(a.q + (u64)(h0 + hh) * head_dim + i);
        }
    }
    __syncthreads();
    // The slice's rows into shared memory: all loads first, then the stores.
    constexpr u32 LOADS = ATTN_SCORE_ROWS * 128 / ATTN_SCORE_THREADS;
    float4 buf[LOADS];
#pragma unroll
    for (u32 k = 0; k < LOADS; k++) {
        const u32 f = threadIdx.x + k * ATTN_SCORE_THREADS;
        if (f < nj * quads) buf[k] = *(const float4*)(rowp[f / quads] + 4 * (f % quads));
    }
#pragma unroll
    for (u32 k = 0; k < LOADS; k++) {
        const u32 f = threadIdx.x + k * ATTN_SCORE_THREADS;
        if (f < nj * quads) *(float4*)(tile + f * 4) = buf[k];
    }
    __syncthreads();
    float mx[ATTN_WARP_HEADS];
#pragma unroll
    for (u32 k = 0; k < ATTN_WARP_HEADS; k++) mx[k] = ATTN_MAX_NONE;
    for (u32 j = rs; j < nj; j += ATTN_ROW_SETS) {
        // chunk_dot_f32's lane sums of the row against each head (the row's float4 read once).
        float acc[ATTN_WARP_HEADS];
#pragma unroll
        for (u32 k = 0; k < ATTN_WARP_HEADS; k++) acc[k] = 0.0f;
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 i = u * 128 + lane * 4;
            if (i < head_dim) {
                const float4 y = *(const float4*)(tile + j * head_dim + i);
#pragma unroll
                for (u32 k = 0; k < ATTN_WARP_HEADS; k++) {
                    acc[k] += q[k][u].x * y.x;
                    acc[k] += q[k][u].y * y.y;
                    acc[k] += q[k][u].z * y.z;
                    acc[k] += q[k][u].w * y.w;
                }
            }
        }
#pragma unroll
        for (u32 k = 0; k < ATTN_WARP_HEADS; k++) {
            float d = 0.0f;
            d += warp_sum(acc[k]);
            const float s = d * a.kq_scale;
            const u32 hh = hs * ATTN_WARP_HEADS + k;
            if (hh < n_group) {
                if (lane == 0) a.scores[(u64)(h0 + hh) * a.max_rows + r0 + j] = s;
                mx[k] = fmaxf(mx[k], s);
            }
        }
    }
    if (lane == 0)
#pragma unroll
        for (u32 k = 0; k < ATTN_WARP_HEADS; k++) wmax[warp][k] = mx[k];
    __syncthreads();
    if (threadIdx.x < n_group) {
        const u32 hs2 = threadIdx.x / ATTN_WARP_HEADS, k = threadIdx.x % ATTN_WARP_HEADS;
        float m = ATTN_MAX_NONE;
        for (u32 r = 0; r < ATTN_ROW_SETS; r++) m = fmaxf(m, wmax[r * ATTN_HEAD_SETS + hs2][k]);
        a.maxes[(u64)slice * a.n_head + h0 + threadIdx.x] = m;
    }
}

// The chunk's weighted sum of dim d per head, sequentially from +0.
template <class A> __device__ __forceinline__ void attention_partial_sum(const A& a, const float (&val)[DS4_ATTN_ROW_CHUNK],
                                                      const float* wsh, u32 nj, u32 c, u32 h0, u32 n_group, u32 d) {
    const u32 head_dim = a.head_dim;
    float p[ATTN_SPLIT_HEADS];
#pragma unroll
    for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++) p[k] = 0.0f;
#pragma unroll
    for (u32 j = 0; j < DS4_ATTN_ROW_CHUNK; j++) {
        if (j < nj) {
#pragma unroll
            for (u32 k4 = 0; k4 < ATTN_SPLIT_HEADS; k4 += 4) {
                const float4 w = *(const float4*)(wsh + j * ATTN_SPLIT_HEADS + k4);
                p[k4 + 0] += w.x * val[j];
                p[k4 + 1] += w.y * val[j];
                p[k4 + 2] += w.z * val[j];
                p[k4 + 3] += w.w * val[j];
            }
        }
    }
#pragma unroll
    for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++)
        if (k < n_group) a.parts[((u64)c * a.n_head + h0 + k) * head_dim + d] = p[k];
}

// attention_combine for the heads of group g and the dims of slice ds, by the last of the
// group's chunk blocks of that slice: the chunks' sums in order, the denominator, the scale, the
// inverse RoPE (plan.rs fuses only when the rotated dims lie in one slice) and the Q8_0 blocks of
// the slice, each as attention_combine and attention_head_tail compute them.
template <class A> __device__ __forceinline__ void attention_slice_tail(const StepParams* P, const A& a, const AttnRows& v,
                                                     u32 g, u32 ds, u32 h0, u32 n_group) {
    __shared__ bool last;
    __shared__ float inv_sh[ATTN_SPLIT_HEADS];
    __shared__ __align__(16) float o_sh[ATTN_SPLIT_HEADS * ATTN_SUM_THREADS];
    const u32 n_dslices = (a.head_dim + ATTN_SUM_THREADS - 1) / ATTN_SUM_THREADS;
    const u32 n_chunks = (v.n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;
    u32* ticket = a.tickets + a.ticket + g * n_dslices + ds;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == n_chunks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const u32 head_dim = a.head_dim, d0 = ds * ATTN_SUM_THREADS, d = d0 + threadIdx.x;
    const u32 width = min((u32)ATTN_SUM_THREADS, head_dim - d0);
    if (threadIdx.x < n_group) {
        const float* sums = a.sums + (u64)ds * a.sums_slice;
        const u32 h = h0 + threadIdx.x;
        float denom = ds4_expf(a.sinks[h] - __ldcg(sums + h));
#pragma unroll 8
        for (u32 c = 0; c < n_chunks; c++) denom += __ldcg(sums + (u64)(1 + c) * a.n_head + h);
        inv_sh[threadIdx.x] = 1.0f / denom;
    }
    float acc[ATTN_SPLIT_HEADS];
#pragma unroll
    for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++) acc[k] = 0.0f;
    if (d < head_dim)
#pragma unroll 4
        for (u32 c = 0; c < n_chunks; c++)
#pragma unroll
            for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++)
                if (k < n_group) acc[k] += __ldcg(a.parts + ((u64)c * a.n_head + h0 + k) * head_dim + d);
    __syncthreads();
    if (d < head_dim)
#pragma unroll
        for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++) o_sh[k * ATTN_SUM_THREADS + threadIdx.x] = acc[k] * inv_sh[k];
    if (a.rope && a.n_rot && head_dim - a.n_rot >= d0 && head_dim - a.n_rot < d0 + width) {
        // The rotated dims [head_dim - n_rot, head_dim) of each head, all in this slice.
        __syncthreads();
        const u32 pairs = a.n_rot / 2, first = head_dim - a.n_rot - d0;
        const float* trow = a.rope + (u64)P->pos * pairs * 2;
        for (u32 t = threadIdx.x; t < n_group * pairs; t += blockDim.x)
            rope_pair(o_sh + (t / pairs) * ATTN_SUM_THREADS + first, trow, t % pairs, true);
    }
    __syncthreads();
    for (u32 k = 0; k < n_group; k++)
        if (threadIdx.x < width) a.out[(u64)(h0 + k) * head_dim + d] = o_sh[k * ATTN_SUM_THREADS + threadIdx.x];
    if (a.xq) {
        const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nb = width / 32;
        for (u32 b = warp; b < n_group * nb; b += blockDim.x >> 5) {
            const u32 k = b / nb, i = b % nb;
            quantize_q8_0_warp(o_sh[k * ATTN_SUM_THREADS + i * 32 + lane], a.xq, a.xd, (h0 + k) * (head_dim / 32) + d0 / 32 + i, lane);
        }
    }
    if (threadIdx.x == 0) *ticket = 0;
}

// Grid: 64-row chunks x head groups x dim slices (slice fastest); ATTN_SUM_THREADS (>= 64, the
// block size) dims per slice. Thread d owns dim d of the slice for all the group's heads, so each value of a row is
// read by one thread of the block; the chunk's values are loaded into registers first, and
// arrive while the weights are computed.
//
// With COMBINE (attention_partial_combine), attention_combine runs in this launch: every block
// stores its chunk's weight sums (all dim slices compute the same weights) in a copy of `sums` of
// its own slice, and the last block of each (head group, dim slice), by a ticket, adds the chunks
// of its heads and dims in order and runs the tail on them (attention_slice_tail).
template <bool COMBINE, class A> __device__ __forceinline__ void attention_partial_impl(const StepParams* P, const A& a) {
    __shared__ const float* rowp[DS4_ATTN_ROW_CHUNK];
    __shared__ __align__(16) float wsh[DS4_ATTN_ROW_CHUNK * ATTN_SPLIT_HEADS];  // [row][head]
    __shared__ float wmax[ATTN_SUM_THREADS / 32][ATTN_SPLIT_HEADS];
    __shared__ float m_sh[ATTN_SPLIT_HEADS];
    const AttnRows v = attn_rows(P, a);
    const u32 head_dim = a.head_dim;
    const u32 n_groups = (a.n_head + ATTN_SPLIT_HEADS - 1) / ATTN_SPLIT_HEADS;
    const u32 n_dslices = (head_dim + ATTN_SUM_THREADS - 1) / ATTN_SUM_THREADS;
    const u32 ds = blockIdx.x % n_dslices, g = blockIdx.x / n_dslices % n_groups;
    const u32 c = blockIdx.x / n_dslices / n_groups, r0 = c * DS4_ATTN_ROW_CHUNK;
    if (r0 >= v.n_rows) return;
    const u32 nj = min((u32)DS4_ATTN_ROW_CHUNK, v.n_rows - r0);
    const u32 h0 = g * ATTN_SPLIT_HEADS, n_group = min((u32)ATTN_SPLIT_HEADS, a.n_head - h0);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 d = ds * ATTN_SUM_THREADS + threadIdx.x;
    // Everything this block reads that no other load depends on is requested at once: the row
    // addresses (through `selected`), the chunk's scores (thread t: rows t / 16 + k * stride,
    // head t % 16), the slices' maxes and the sinks.
    if (threadIdx.x < nj) rowp[threadIdx.x] = attn_row(a, v, r0 + threadIdx.x);
    constexpr u32 WEIGHTS = DS4_ATTN_ROW_CHUNK * ATTN_SPLIT_HEADS / ATTN_SUM_THREADS;
    const u32 hh = threadIdx.x % ATTN_SPLIT_HEADS, j0 = threadIdx.x / ATTN_SPLIT_HEADS;
    constexpr u32 JSTEP = ATTN_SUM_THREADS / ATTN_SPLIT_HEADS;
    float sc[WEIGHTS];
#pragma unroll
    for (u32 k = 0; k < WEIGHTS; k++) {
        const u32 j = j0 + k * JSTEP;
        sc[k] = hh < n_group && j < nj ? a.scores[(u64)(h0 + hh) * a.max_rows + r0 + j] : 0.0f;
    }
    const float sink = hh < n_group ? a.sinks[h0 + hh] : 0.0f;
    // m per head: the sink and the slices' maxes (attention_scores); thread t takes head t % 16
    // of every JSTEP-th slice.
    const u32 n_slices = (v.n_rows + ATTN_SCORE_ROWS - 1) / ATTN_SCORE_ROWS;
    float mx = ATTN_MAX_NONE;
    if (hh < n_group)
        for (u32 s = j0; s < n_slices; s += JSTEP) mx = fmaxf(mx, a.maxes[(u64)s * a.n_head + h0 + hh]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    if (lane < ATTN_SPLIT_HEADS) wmax[warp][lane] = mx;
    __syncthreads();
    // The chunk's values of dim d into registers; they arrive while the weights are computed.
    float val[DS4_ATTN_ROW_CHUNK];
#pragma unroll
    for (u32 j = 0; j < DS4_ATTN_ROW_CHUNK; j++) val[j] = j < nj && d < head_dim ? rowp[j][d] : 0.0f;
    if (threadIdx.x < ATTN_SPLIT_HEADS) {
        float m = sink;
        for (u32 w = 0; w < ATTN_SUM_THREADS / 32; w++) m = fmaxf(m, wmax[w][threadIdx.x]);
        m_sh[threadIdx.x] = m;
    }
    __syncthreads();
    // The chunk's weights, [row][head]; zero past the rows and the group.
#pragma unroll
    for (u32 k = 0; k < WEIGHTS; k++) {
        const u32 j = j0 + k * JSTEP;
        wsh[j * ATTN_SPLIT_HEADS + hh] = hh < n_group && j < nj ? ds4_expf(sc[k] - m_sh[hh]) : 0.0f;
    }
    __syncthreads();
    // Slice 0: the chunk's weight sum per head, sequentially from +0 (and chunk 0: m per head).
    if ((COMBINE || ds == 0) && threadIdx.x < n_group) {
        const u32 k = threadIdx.x;
        float s = 0.0f;
#pragma unroll 16
        for (u32 j = 0; j < nj; j++) s += wsh[j * ATTN_SPLIT_HEADS + k];
        float* sums = a.sums + (COMBINE ? (u64)ds * a.sums_slice : 0);
        sums[(u64)(1 + c) * a.n_head + h0 + k] = s;
        if (c == 0) sums[h0 + k] = m_sh[k];
    }
    if (d < head_dim) {
        attention_partial_sum(a, val, wsh, nj, c, h0, n_group, d);
    }
    if (COMBINE) attention_slice_tail(P, a, v, g, ds, h0, n_group);
}

extern "C" __global__ void __launch_bounds__(ATTN_SUM_THREADS) attention_partial(DS4_ARGS, AttentionPartialArgs a) {
    DS4_GUARD;
    attention_partial_impl<false>(P, a);
}

extern "C" __global__ void __launch_bounds__(ATTN_SUM_THREADS) attention_partial_combine(DS4_ARGS, AttentionPartialCombineArgs a) {
    DS4_GUARD;
    attention_partial_impl<true>(P, a);
}

// Whether attention_combine lets its successor launch at its first instruction rather than after
// its wait: the successor is the grouped output projection (a 35.6 MB Q8_0 matvec on Flash, two
// waves of blocks), whose blocks load their weights before their own wait. Launched after the
// wait, they had ~3 us for it (the combine is short) and the launch took ~15 us on the H100
// against ~10 for the same bytes in the matvec after it, which had ~7 us (DS4_CUDA_TRACE).
// The successor still waits for this kernel to complete before it reads anything it wrote.
// Measured +0.5% on flash-4l (H100) and exact there; gpu-check's placement_unified, which failed
// once on a build with this and moe_down_q2_k, passed every run since, a loop of unified runs
// among them (BENCHMARKS, 36th to 38th sessions). DS4_CUDA_DEFINES=ATTN_COMBINE_EARLY_TRIGGER=0.
#ifndef ATTN_COMBINE_EARLY_TRIGGER
#define ATTN_COMBINE_EARLY_TRIGGER 1
#endif

// A block per head, a thread per dim (blockDim >= head_dim): the chunks' sums in order, the
// denominator, the scale, then the fused tail as `attention`'s.
extern "C" __global__ void __launch_bounds__(512) attention_combine(DS4_ARGS, AttentionCombineArgs a) {
    if (ATTN_COMBINE_EARLY_TRIGGER) ds4_trigger_successor();
    DS4_GUARD;
    __shared__ float inv_sh;
    const AttnRows v = attn_rows(P, a);
    const u32 h = blockIdx.x, head_dim = a.head_dim;
    const u32 n_chunks = (v.n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;
    if (threadIdx.x == 0) {
        float denom = ds4_expf(a.sinks[h] - a.sums[h]);
#pragma unroll 8
        for (u32 c = 0; c < n_chunks; c++) denom += a.sums[(u64)(1 + c) * a.n_head + h];
        inv_sh = 1.0f / denom;
    }
    float acc = 0.0f;
    const u32 d = threadIdx.x;
    if (d < head_dim)
#pragma unroll 8
        for (u32 c = 0; c < n_chunks; c++) acc += a.parts[((u64)c * a.n_head + h) * head_dim + d];
    __syncthreads();
    if (d < head_dim) a.out[(u64)h * head_dim + d] = acc * inv_sh;
    attention_head_tail(P, a, h);
}
#endif
