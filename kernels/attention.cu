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
