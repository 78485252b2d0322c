// MatVec and MatVecGrouped: dense F16 / F32 / Q8_0 weights, every row in the canonical order
// (src/numerics.rs): chunks of 512 terms (F16: 8 per lane step, F32: 4) or 32 blocks (Q8_0: one
// block per lane), each chunk reduced by the butterfly, chunk sums added in order from +0.
// Rows of group g read x[g*in_dim ..]. One warp per row; narrow matrices split the row's chunks
// over warps (split-K); the last block adds the chunk sums in order, which gives the same bits.

// One warp per 32-block (kernels/norm.cu: quantize_q8_0_warp).
extern "C" __global__ void quantize_q8_0(DS4_ARGS, QuantizeQ80Args a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31;
    const u32 b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b * 32 >= a.n) return;
    quantize_q8_0_warp(a.x[b * 32 + lane], a.xq, a.xd, b, lane);
}

// Block b's term: (f16(d_w) * d_x) * isum, the integer dot exact.
__device__ __forceinline__ float q8_0_term(int4 w0, int4 w1, u16 ws, const int4* x4, const float* dx, u32 b) {
    const int4 x0 = x4[2 * b], x1 = x4[2 * b + 1];
    int isum = 0;
    isum = __dp4a(w0.x, x0.x, isum);
    isum = __dp4a(w0.y, x0.y, isum);
    isum = __dp4a(w0.z, x0.z, isum);
    isum = __dp4a(w0.w, x0.w, isum);
    isum = __dp4a(w1.x, x1.x, isum);
    isum = __dp4a(w1.y, x1.y, isum);
    isum = __dp4a(w1.z, x1.z, isum);
    isum = __dp4a(w1.w, x1.w, isum);
    return h2f(ws) * dx[b] * (float)isum;
}

// Loads block b of row r of a Q8_0 matrix of `rows` rows and nb blocks per row. Split layout
// (gpu_tables.rs: BLOCK_SPLITS): all quants (32 bytes per block), then all f16 scales; a lane
// reads a block as two 16-byte loads. Native layout (DS4_NATIVE_BLOCKS: GGUF's 34-byte blocks,
// read in place from the file): a scale then 32 quants, only 2-byte aligned, so 17 loads of 2.
__device__ __forceinline__ void q8_0_load(const u8* w, u32 rows, u32 nb, u32 r, u32 b, int4* w0, int4* w1, u16* s) {
#if DS4_NATIVE_BLOCKS
    const u16* blk = (const u16*)(w + ((u64)r * nb + b) * 34);
    u32 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = (u32)ds4_wld(blk + 1 + 2 * i) | ((u32)ds4_wld(blk + 2 + 2 * i) << 16);
    *w0 = make_int4((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
    *w1 = make_int4((int)v[4], (int)v[5], (int)v[6], (int)v[7]);
    *s = ds4_wld(blk);
#else
    const int4* wq = (const int4*)(w + (u64)r * nb * 32);
    *w0 = ds4_wld(wq + 2 * b);
    *w1 = ds4_wld(wq + 2 * b + 1);
    *s = ds4_wld((const u16*)(w + (u64)rows * nb * 32) + (u64)r * nb + b);
#endif
}

// Chunks whose weights a lane loads before waiting for the previous kernel.
#define Q8_EARLY_CHUNKS 4

// With `rows2` > 0 a second matrix of the same width (`w2`, `out2`) follows the first in the
// same launch, reading the same input (both ungrouped): two ops, one launch.
#if DS4_CHUNK_ROWS
// The chunk build: a warp computes its matrix row for Q8_TOKEN_ROWS token rows of the chunk,
// loading each weight block once for all of them. blockIdx.x picks the token rows and blockIdx.y
// the matrix rows, so the blocks that read the same weights are scheduled side by side and all
// but the first find them in L2 (with the token rows along y, each group of blocks streamed the
// whole matrix from DRAM again). Each token row's
// sum is the decode kernel's: per chunk a lane's one term from +0, the butterfly, chunk sums
// added in order from +0. Rows past the chunk's tokens (and rows whose predicate is false) are
// neither read nor written.
extern "C" __global__ void mat_vec_q8_0(DS4_ARGS, MatVecQ80Args a) {
    const u32 y0 = blockIdx.x * Q8_TOKEN_ROWS;
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < Q8_TOKEN_ROWS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    ds4_wait_predecessor(cond);
    const u32 lane = threadIdx.x & 31;
    const u32 rr = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr, rows = second ? a.rows2 : a.rows;
    if (!active || r >= rows) return;
    const u8* w = second ? a.w2 : a.w;
    const u32 out_stride = second ? R.s[5] : R.s[3];
    const u32 nb = a.in_dim / 32;
    const u32 g = second ? 0 : r / a.rows_per_group;
    float total[Q8_TOKEN_ROWS];
#pragma unroll
    for (u32 t = 0; t < Q8_TOKEN_ROWS; t++) total[t] = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        const u32 b = c + lane;
        int4 q0 = make_int4(0, 0, 0, 0), q1 = q0;
        u16 sc = 0;
        if (b < nb) q8_0_load(w, rows, nb, r, b, &q0, &q1, &sc);
#pragma unroll
        for (u32 t = 0; t < Q8_TOKEN_ROWS; t++) {
            if (!((active >> t) & 1)) continue;
            const u64 y = y0 + t;
            const int4* x4 = (const int4*)(a.xq + y * R.s[1] + (u64)g * a.in_dim);
            const float* dx = (const float*)((const u8*)a.xd + y * R.s[2]) + (u64)g * nb;
            float acc = 0.0f;
            if (b < nb) acc += q8_0_term(q0, q1, sc, x4, dx, b);
            total[t] += warp_sum(acc);
        }
    }
    if (lane != 0) return;
    float* out = second ? a.out2 : a.out;
#pragma unroll
    for (u32 t = 0; t < Q8_TOKEN_ROWS; t++)
        if ((active >> t) & 1) ((float*)((u8*)out + (u64)(y0 + t) * out_stride))[r] = total[t];
}

#if !DS4_NATIVE_BLOCKS
// The chunk build's Q8_0 matrix product on tensor cores (split block layout only). A warp computes
// 16 matrix rows for Q8_MMA_TOKENS token rows; each weight block is one k = 32 step of an int8
// m16n8k32 MMA per 8 token rows, so the block's integer dot is exact, as __dp4a's is. A lane's
// 8 bytes of a block (words 2 tq and 2 tq + 1) feed both A and B: the MMA's k order inside a block
// does not change an integer sum. Each (row, token) then gets the decode kernel's float terms and
// order: term (f16(d_w) * d_x) * isum added to +0, per 32-block chunk the butterfly's tree (fed
// leaf by leaf in bit-reversed block order, so each level's pairs meet as in warp_sum), chunk sums
// added in order from +0. Token rows past the chunk's tokens (or predicated off) read the first
// active row's data and are not written.
#ifndef Q8_MMA_TOKENS
#define Q8_MMA_TOKENS 16
#endif
#define Q8_MMA_TILES (Q8_MMA_TOKENS / 8)
static_assert(DS4_BLOCK_CHUNK == 32, "the bit-reversed leaf order is 5 bits");

// Token row t of the tile, or the first active one when t is not active.
__device__ __forceinline__ u32 mma_token(u32 active, u32 first, u32 t) { return ((active >> t) & 1) ? t : first; }

#define Q8_MMA_WARPS 4
// A token row's staged quants: 32 blocks of 32 bytes, then 32 bytes of padding so that the 8 token
// rows of one fragment load fall in different banks.
#define Q8_MMA_XS_ROW (32 * 32 + 32)
// 1.5 * 2^23: an MMA started at this bit pattern returns 0x4B400000 + dot, which read as a float
// is 1.5 * 2^23 + dot exactly (|dot| <= 32 * 128 * 127 < 2^22); subtracting 1.5 * 2^23 gives
// (float)dot exactly with one add instead of a conversion.
#define Q8_MMA_BIAS 0x4B400000
#define Q8_MMA_BIAS_F 12582912.0f

// D = bias + A (16 x 32: rows gq and gq + 8 of the warp's 16) * B (32 x 8: token column gq).
__device__ __forceinline__ void mma_s8_m16n8k32(int* d, uint2 wa, uint2 wb, uint2 x) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(wa.x), "r"(wb.x), "r"(wa.y), "r"(wb.y), "r"(x.x), "r"(x.y), "r"(Q8_MMA_BIAS));
}

// A block of 4 warps covers 64 matrix rows (16 per warp) and Q8_MMA_TOKENS token rows. Per chunk
// of 32 weight blocks, the block stages the token rows' quants and scales and its rows' weight
// scales in shared memory (coalesced loads); the weight quants stream from global memory.
extern "C" __global__ void __launch_bounds__(128) mat_mul_q8_0(DS4_ARGS, MatVecQ80Args a) {
    __shared__ __align__(16) u8 xs[Q8_MMA_TOKENS * Q8_MMA_XS_ROW];
    __shared__ float dxs[Q8_MMA_TOKENS][33];
    __shared__ float wss[Q8_MMA_WARPS * 16][33];
    const u32 y0 = blockIdx.x * Q8_MMA_TOKENS;
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < Q8_MMA_TOKENS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    ds4_wait_predecessor(cond);
    if (!active) return;
    const u32 lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3, warp = threadIdx.x >> 5;
    const u32 rr = (blockIdx.y * Q8_MMA_WARPS + warp) * 16;
    const bool second = rr >= a.rows;
    const u32 r0 = second ? rr - a.rows : rr, rows = second ? a.rows2 : a.rows;
    const bool live = r0 < rows;
    const u8* w = second ? a.w2 : a.w;
    const u32 nb = a.in_dim / 32;
    // The host gives a grouped matrix groups of a multiple of 64 rows (and no second matrix), so
    // one group's input serves the whole block.
    const u32 row0 = blockIdx.y * Q8_MMA_WARPS * 16;
    const u32 g = row0 < a.rows ? row0 / a.rows_per_group : 0;
    const u32 first = __ffs(active) - 1;
    const u8* wq_a = w + (u64)(r0 + gq) * nb * 32 + tq * 8;
    const u8* wq_b = wq_a + (u64)8 * nb * 32;
    const u16* ws = (const u16*)(w + (u64)rows * nb * 32) + (u64)r0 * nb;
    // total[j][k]: k = 0, 1: row r0 + gq, tokens 8 j + 2 tq (+1); k = 2, 3: row r0 + gq + 8.
    float total[Q8_MMA_TILES][4];
#pragma unroll
    for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
        for (u32 k = 0; k < 4; k++) total[j][k] = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        const u32 nblk = min((u32)DS4_BLOCK_CHUNK, nb - c);
        __syncthreads();
        for (u32 i = threadIdx.x; i < Q8_MMA_TOKENS * 64; i += blockDim.x) {
            const u32 t = i / 64, q = i % 64;
            if (q < nblk * 2) {
                const u64 y = y0 + mma_token(active, first, t);
                const i8* x = a.xq + y * R.s[1] + (u64)g * a.in_dim + (u64)c * 32;
                *(uint4*)(xs + t * Q8_MMA_XS_ROW + q * 16) = *(const uint4*)(x + q * 16);
            }
        }
        for (u32 i = threadIdx.x; i < Q8_MMA_TOKENS * 32; i += blockDim.x) {
            const u32 t = i / 32, k = i % 32;
            if (k < nblk) {
                const u64 y = y0 + mma_token(active, first, t);
                dxs[t][k] = ((const float*)((const u8*)a.xd + y * R.s[2]))[(u64)g * nb + c + k];
            }
        }
        if (live)
            for (u32 r = 0; r < 16; r++)
                if (lane < nblk) wss[warp * 16 + r][lane] = h2f(__ldg(ws + (u64)r * nb + c + lane));
        __syncthreads();
        if (!live) continue;
        float pend[5][Q8_MMA_TILES][4];
#pragma unroll
        for (u32 i = 0; i < DS4_BLOCK_CHUNK; i++) {
            const u32 bi = bit_reverse5(i), b = c + bi;
            float v[Q8_MMA_TILES][4];
            if (b < nb) {
                const uint2 qa = __ldg((const uint2*)(wq_a + (u64)b * 32));
                const uint2 qb = __ldg((const uint2*)(wq_b + (u64)b * 32));
                const float sa = wss[warp * 16 + gq][bi], sb = wss[warp * 16 + gq + 8][bi];
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++) {
                    int d[4];
                    mma_s8_m16n8k32(d, qa, qb, *(const uint2*)(xs + (8 * j + gq) * Q8_MMA_XS_ROW + bi * 32 + tq * 8));
                    const float d0 = dxs[8 * j + 2 * tq][bi], d1 = dxs[8 * j + 2 * tq + 1][bi];
                    v[j][0] = 0.0f + sa * d0 * (__int_as_float(d[0]) - Q8_MMA_BIAS_F);
                    v[j][1] = 0.0f + sa * d1 * (__int_as_float(d[1]) - Q8_MMA_BIAS_F);
                    v[j][2] = 0.0f + sb * d0 * (__int_as_float(d[2]) - Q8_MMA_BIAS_F);
                    v[j][3] = 0.0f + sb * d1 * (__int_as_float(d[3]) - Q8_MMA_BIAS_F);
                }
            } else {
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) v[j][k] = 0.0f;
            }
            // Leaf i of the bit-reversed order closes level l when bit l of i is set.
#pragma unroll
            for (u32 l = 0; l < 5; l++) {
                if (!((i >> l) & 1)) {
#pragma unroll
                    for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                        for (u32 k = 0; k < 4; k++) pend[l][j][k] = v[j][k];
                    break;
                }
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) v[j][k] = pend[l][j][k] + v[j][k];
            }
            if (i == DS4_BLOCK_CHUNK - 1) {
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) total[j][k] += v[j][k];
            }
        }
    }
    if (!live) return;
    float* out = second ? a.out2 : a.out;
    const u32 out_stride = second ? R.s[5] : R.s[3];
#pragma unroll
    for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            const u32 t = 8 * j + 2 * tq + (k & 1);
            if ((active >> t) & 1)
                ((float*)((u8*)out + (u64)(y0 + t) * out_stride))[r0 + gq + (k >> 1) * 8] = total[j][k];
        }
}

// The chunk's Q8_0 product in big tiles (split block layout only; DS4_CUDA_Q8_TILE=0 keeps
// mat_mul_q8_0 above): a block of Q8T_WM x Q8T_WN warps covers Q8T_BM = 64 matrix rows and
// Q8T_BN token rows, a warp 16 matrix rows x Q8T_NT tiles of 8 token rows, so each A fragment
// (the weights) feeds Q8T_NT MMAs and each weight load from L2 serves Q8T_BN token rows. The
// terms and the float order are mat_mul_q8_0's (the decode kernel's): per (row, token, block)
// (f16(d_w) * d_x) * isum, per 32-block chunk the butterfly's tree fed leaf by leaf in
// bit-reversed block order, chunk sums added in order from +0. The leaf's "0.0f +" is left out:
// a tree's sum feeds only `total`, which starts from +0, so only a zero's sign could differ and
// that add absorbs it (kernels/README.md, the proven freedom).
//
// A chunk of 32 blocks runs as 4 steps of 8; leaf i = 8 s + u of the tree (block bit_reverse5(i))
// is block 4 bit_reverse3(u) + bit_reverse2(s), so step s stages the chunk's blocks = s' (mod 4),
// s' = bit_reverse2(s), 8 per row, and its leaves come in slot order bit_reverse3(u). The steps'
// quants are copied by cp.async into two buffers (the copies of step k + 1 run during the math of
// step k); a chunk's scales are read into registers during step 1 of the chunk before and stored
// converted and reordered during step 2 (two buffers by chunk parity), so each lane reads its
// scale pairs with one 8- or 16-byte load.
#ifndef Q8T_NT
#define Q8T_NT 4
#endif
#ifndef Q8T_WN
#define Q8T_WN 4
#endif
// Blocks per SM the registers are capped for (launch bounds): 1 for the 512-thread shape; the
// 256-thread shape of 64 x 32 (Q8T_NT 2, Q8T_WN 2, DS4_CUDA_Q8_TILE=new) asks for 2, which its
// ~91 KB of shared memory allows, so one block's barriers and prologue overlap the other's math.
#ifndef Q8T_MIN_BLOCKS
#define Q8T_MIN_BLOCKS 1
#endif
#define Q8T_WM 4
#define Q8T_BM (16 * Q8T_WM)
#define Q8T_BN (8 * Q8T_NT * Q8T_WN)
#define Q8T_THREADS (32 * Q8T_WM * Q8T_WN)
// A staged row (a weight row or a token row): 8 blocks of 32 bytes, then 16 bytes of padding so
// that the 8 rows of one ldmatrix matrix (16 bytes each) fall in different banks.
#define Q8T_ROW 272
#define Q8T_QBUF ((Q8T_BM + Q8T_BN) * Q8T_ROW)
// Dynamic shared memory (backends/cuda/mod.rs: q8_tile_smem computes the same size): quants
// [2][BM + BN][ROW]; weight scales [2][32][BM] floats, rows 16 w + g and 16 w + g + 8 side by side;
// token scales [2][32][BN] floats, a lane's 2 Q8T_NT tokens side by side; each thread's 4 Q8T_NT
// chunk totals [4 Q8T_NT][THREADS], then as many first-half sums of the chunk's tree (kept here,
// not in registers, which the tree's other pending sums fill); the active token bits.
#define Q8T_WS_OFF (2 * Q8T_QBUF)
#define Q8T_DX_OFF (Q8T_WS_OFF + 2 * 32 * Q8T_BM * 4)
#define Q8T_TOT_OFF (Q8T_DX_OFF + 2 * 32 * Q8T_BN * 4)
#define Q8T_HALF_OFF (Q8T_TOT_OFF + 4 * Q8T_NT * Q8T_THREADS * 4)
#define Q8T_ACT_OFF (Q8T_HALF_OFF + 4 * Q8T_NT * Q8T_THREADS * 4)
#define Q8T_SMEM (Q8T_ACT_OFF + Q8T_BN / 8)
// Threads per staged weight row and per staged token row (each copies BPW or BPX = 8 / that of
// the step's 8 blocks, and 32 / that of the chunk's 32 scales).
#define Q8T_TPW (Q8T_THREADS / Q8T_BM)
#define Q8T_TPX (Q8T_THREADS / Q8T_BN)
#define Q8T_BPW (8 / Q8T_TPW)
#define Q8T_BPX (8 / Q8T_TPX)
static_assert(Q8T_THREADS % Q8T_BM == 0 && 8 % Q8T_TPW == 0, "whole blocks of a weight row per thread");
static_assert(Q8T_THREADS % Q8T_BN == 0 && 8 % Q8T_TPX == 0, "whole blocks of a token row per thread");
static_assert(Q8T_BN % 32 == 0 && Q8T_BN <= Q8T_THREADS, "a warp's ballot per 32 token rows");
static_assert(Q8T_NT % 2 == 0, "B fragments by pairs of token tiles");

__device__ __forceinline__ constexpr u32 bit_reverse2(u32 s) { return ((s & 1) << 1) | ((s & 2) >> 1); }

// Four 8 x 8 matrices of b16 from shared memory (lanes 8 q .. 8 q + 7 give matrix q's row
// addresses); register q of lane l holds 4 bytes (l % 4) of row l / 4 of matrix q. Volatile so
// that it stays between the barriers around it.
__device__ __forceinline__ void ldmatrix_x4(u32* d, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"((u32)__cvta_generic_to_shared(p)));
}
// D = D + A * B for int8 m16n8k32 fragments (A: 4 registers, B: 2), D started at the bias.
__device__ __forceinline__ void mma_s8_k32_acc(int* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Where a token (0..BN) of the tile keeps its scales: the lane that holds it (t) next to the
// lane's other tokens, 2 per tile j.
__device__ __forceinline__ u32 q8t_token_slot(u32 tok) {
    const u32 wn = tok / (8 * Q8T_NT), rem = tok % (8 * Q8T_NT);
    const u32 j = rem / 8, t = (rem % 8) / 2, k = rem % 2;
    return wn * 8 * Q8T_NT + t * 2 * Q8T_NT + 2 * j + k;
}
// Where a weight row (0..BM) of the tile keeps its scales: rows g and g + 8 of a warp's 16 together.
__device__ __forceinline__ u32 q8t_row_slot(u32 r) { return (r / 16) * 16 + 2 * (r % 8) + (r % 16) / 8; }

// One step (8 blocks) of a warp's 16 x 8 Q8T_NT tile: the MMAs, the terms, the tree's leaves
// 8 s .. 8 s + 7. The fragments come by ldmatrix, in the natural k order of a block (A: rows g,
// g + 8, bytes 4 t.. and 16 + 4 t..; B: token g, the same bytes), so each A fragment lands in
// the MMA's four registers as loaded. `qa`: this lane's ldmatrix row address for A (row
// l % 8 + 8 ((l / 8) & 1), byte 16 (l / 16)); `qb`: for B, a pair of token tiles (token row
// l % 8 of tile l / 16, byte 16 ((l / 8) & 1)). A block past the row's end was staged as zero
// token quants and +0 scales, so its term is (+0 * +0) * +0 = +0, the leaf mat_mul_q8_0 feeds.
template <u32 S>
__device__ __forceinline__ void q8t_step(const u8* qa, const u8* qb, const float* wsp, const float* dxp,
                                         float (&pend)[4][Q8T_NT][4], float* half, float* total) {
#pragma unroll
    for (u32 u = 0; u < 8; u++) {
        const u32 i = 8 * S + u, m = bit_reverse3(u), kb = 4 * m + bit_reverse2(S);
        float v[Q8T_NT][4];
        u32 fa[4];
        ldmatrix_x4(fa, qa + m * 32);
        const float2 sw = *(const float2*)(wsp + kb * Q8T_BM);
        float dd[2 * Q8T_NT];
#pragma unroll
        for (u32 h = 0; h < Q8T_NT / 2; h++) {
            const float4 q = *(const float4*)(dxp + kb * Q8T_BN + 4 * h);
            dd[4 * h] = q.x;
            dd[4 * h + 1] = q.y;
            dd[4 * h + 2] = q.z;
            dd[4 * h + 3] = q.w;
        }
#pragma unroll
        for (u32 h = 0; h < Q8T_NT / 2; h++) {
            u32 fb[4];
            ldmatrix_x4(fb, qb + 16 * h * Q8T_ROW + m * 32);
#pragma unroll
            for (u32 jj = 0; jj < 2; jj++) {
                const u32 j = 2 * h + jj;
                int d[4] = {Q8_MMA_BIAS, Q8_MMA_BIAS, Q8_MMA_BIAS, Q8_MMA_BIAS};
                mma_s8_k32_acc(d, fa, fb + 2 * jj);
                v[j][0] = sw.x * dd[2 * j] * (__int_as_float(d[0]) - Q8_MMA_BIAS_F);
                v[j][1] = sw.x * dd[2 * j + 1] * (__int_as_float(d[1]) - Q8_MMA_BIAS_F);
                v[j][2] = sw.y * dd[2 * j] * (__int_as_float(d[2]) - Q8_MMA_BIAS_F);
                v[j][3] = sw.y * dd[2 * j + 1] * (__int_as_float(d[3]) - Q8_MMA_BIAS_F);
            }
        }
        // Leaf i of the bit-reversed order closes level l when bit l of i is set. Level 4 (the
        // first half's sum, held from leaf 15 to leaf 31) waits in shared memory.
#pragma unroll
        for (u32 l = 0; l < 5; l++) {
            if (!((i >> l) & 1)) {
#pragma unroll
                for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) {
                        if (l < 4) pend[l][j][k] = v[j][k];
                        else half[(4 * j + k) * Q8T_THREADS] = v[j][k];
                    }
                break;
            }
#pragma unroll
            for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
                for (u32 k = 0; k < 4; k++) v[j][k] = (l < 4 ? pend[l][j][k] : half[(4 * j + k) * Q8T_THREADS]) + v[j][k];
        }
        if (i == 31) {
#pragma unroll
            for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
                for (u32 k = 0; k < 4; k++) total[(4 * j + k) * Q8T_THREADS] += v[j][k];
        }
    }
}

extern "C" __global__ void __launch_bounds__(Q8T_THREADS, Q8T_MIN_BLOCKS) mat_mul_q8_0_tile(DS4_ARGS, MatVecQ80Args a) {
    extern __shared__ __align__(16) u8 q8t_smem[];
    float* const wss = (float*)(q8t_smem + Q8T_WS_OFF);
    float* const dxs = (float*)(q8t_smem + Q8T_DX_OFF);
    u32* const act = (u32*)(q8t_smem + Q8T_ACT_OFF);
    ds4_check_dynamic_smem(Q8T_SMEM);  // mod.rs: q8_tile_smem
    const u32 tid = threadIdx.x, lane = tid & 31, gq = lane >> 2, tq = lane & 3, warp = tid >> 5;
    const u32 wm = warp % Q8T_WM, wn = warp / Q8T_WM;
    const u32 y0 = blockIdx.x * Q8T_BN;
    // The tile's token rows that run (count 0 past the chunk's tokens, or a false predicate).
    if (tid < Q8T_BN) {
        const u32 bits = __ballot_sync(0xffffffffu, ds4_cond(P + y0 + tid, cond));
        if (lane == 0) act[warp] = bits;
    }
    __syncthreads();
    u32 first = Q8T_BN;
#pragma unroll
    for (u32 w = Q8T_BN / 32; w-- > 0;)
        if (act[w]) first = 32 * w + __ffs(act[w]) - 1;
    if (first == Q8T_BN) {
        ds4_wait_predecessor(cond);
        return;
    }
    const u32 nb = a.in_dim / 32;
    const u32 row0 = blockIdx.y * Q8T_BM;
    // The host gives a grouped matrix groups of a multiple of 64 rows (and no second matrix), so
    // one group's input serves the whole block.
    const u32 grp = row0 < a.rows ? row0 / a.rows_per_group : 0;

    // This thread's staged weight row (its quants and scales) and token row.
    const u32 wrow = tid / Q8T_TPW, wpart = tid % Q8T_TPW;
    const u32 wrr = row0 + wrow;
    const bool wsecond = wrr >= a.rows;
    const u32 wr = wsecond ? wrr - a.rows : wrr, wrows = wsecond ? a.rows2 : a.rows;
    const bool wlive = wr < wrows;
    const u8* const wmat = wsecond ? a.w2 : a.w;
    const u8* const wq_row = wmat + (u64)wr * nb * 32;
    const u16* const ws_row = (const u16*)(wmat + (u64)wrows * nb * 32) + (u64)wr * nb;
    const u32 xtok = tid / Q8T_TPX, xpart = tid % Q8T_TPX;
    const u32 xt = ((act[xtok / 32] >> (xtok % 32)) & 1) ? xtok : first;
    const u64 xy = y0 + xt;
    const i8* const xq_row = a.xq + xy * R.s[1] + (u64)grp * a.in_dim;
    const float* const xd_row = (const float*)((const u8*)a.xd + xy * R.s[2]) + (u64)grp * nb;

    // Step s of the chunk at block c into buffer `buf`: this thread's slots wm0 .. wm0 + BPW of
    // its weight row and xm0 .. xm0 + BPX of its token row, both 16-byte halves of each (slot m
    // holds block c + 4 m + s'; blocks past the row's end are not read: zero token quants).
    const u32 wm0 = Q8T_BPW * wpart, xm0 = Q8T_BPX * xpart;
    const u8* const wsrc = wq_row + 128 * wm0;
    const i8* const xsrc = xq_row + 128 * xm0;
    u8* const wdst = q8t_smem + wrow * Q8T_ROW + 32 * wm0;
    u8* const xdst = q8t_smem + (Q8T_BM + xtok) * Q8T_ROW + 32 * xm0;
    auto stage_weights = [&](u32 c, u32 s, u32 buf) {
        const u32 bq = c + bit_reverse2(s);
#pragma unroll
        for (u32 k = 0; k < Q8T_BPW; k++)
#pragma unroll
            for (u32 h = 0; h < 2; h++)
                if (wlive && bq + 4 * (wm0 + k) < nb)
                    cp_async16(wdst + buf * Q8T_QBUF + 32 * k + 16 * h, wsrc + (u64)bq * 32 + 128 * k + 16 * h);
    };
    auto stage_tokens = [&](u32 c, u32 s, u32 buf) {
        const u32 bq = c + bit_reverse2(s);
#pragma unroll
        for (u32 k = 0; k < Q8T_BPX; k++)
#pragma unroll
            for (u32 h = 0; h < 2; h++) {
                u8* dst = xdst + buf * Q8T_QBUF + 32 * k + 16 * h;
                if (bq + 4 * (xm0 + k) < nb) cp_async16(dst, xsrc + (u64)bq * 32 + 128 * k + 16 * h);
                else *(uint4*)dst = make_uint4(0, 0, 0, 0);
            }
    };
    // A chunk's scales: this thread's 32 / TPX token scales go by 4-byte copies straight to
    // their slots in the chunk's buffer; its 32 / TPW weight scales are read into registers,
    // then stored there as floats (missing blocks are not read: +0 in their place).
    auto stage_token_scales = [&](u32 c, u32 cbuf) {
#pragma unroll
        for (u32 k = 0; k < 32 / Q8T_TPX; k++) {
            const u32 kb = xpart * (32 / Q8T_TPX) + k;
            float* dst = dxs + (cbuf * 32 + kb) * Q8T_BN + q8t_token_slot(xtok);
            if (c + kb < nb) cp_async4(dst, xd_row + c + kb);
            else *dst = 0.0f;
        }
    };
    u16 wsr[32 / Q8T_TPW];
    auto load_weight_scales = [&](u32 c) {
#pragma unroll
        for (u32 k = 0; k < 32 / Q8T_TPW; k++) {
            const u32 b = c + wpart * (32 / Q8T_TPW) + k;
            wsr[k] = wlive && b < nb ? __ldg(ws_row + b) : (u16)0;
        }
    };
    auto store_weight_scales = [&](u32 cbuf) {
#pragma unroll
        for (u32 k = 0; k < 32 / Q8T_TPW; k++)
            wss[(cbuf * 32 + wpart * (32 / Q8T_TPW) + k) * Q8T_BM + q8t_row_slot(wrow)] = h2f(wsr[k]);
    };

    // Weights never change during a token: their first step is copied before waiting.
    stage_weights(0, 0, 0);
    ds4_wait_predecessor(cond);
    stage_tokens(0, 0, 0);
    stage_token_scales(0, 0);
    load_weight_scales(0);
    store_weight_scales(0);

    // This warp's 16 matrix rows (all in one matrix: the host gives both multiples of 16).
    const u32 rr = row0 + 16 * wm;
    const bool second = rr >= a.rows;
    const u32 r0 = second ? rr - a.rows : rr;
    const bool live = r0 < (second ? a.rows2 : a.rows);
    const u8* const qa0 = q8t_smem + (16 * wm + lane % 8 + 8 * ((lane / 8) & 1)) * Q8T_ROW + 16 * (lane / 16);
    const u8* const qb0 = q8t_smem + (Q8T_BM + 8 * Q8T_NT * wn + 8 * (lane / 16) + lane % 8) * Q8T_ROW + 16 * ((lane / 8) & 1);
    const float* const ws0 = wss + 16 * wm + 2 * gq;
    const float* const dx0 = dxs + 8 * Q8T_NT * wn + 2 * Q8T_NT * tq;
    // total[(4 j + k) THREADS]: k = 0, 1: row r0 + gq, tokens 8 j + 2 tq (+1) of the warp's;
    // k = 2, 3: row r0 + gq + 8.
    float* const total = (float*)(q8t_smem + Q8T_TOT_OFF) + tid;
    float* const half = (float*)(q8t_smem + Q8T_HALF_OFF) + tid;
    float pend[4][Q8T_NT][4];
#pragma unroll
    for (u32 k = 0; k < 4 * Q8T_NT; k++) total[k * Q8T_THREADS] = 0.0f;

    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        const u32 cbuf = (c / DS4_BLOCK_CHUNK) & 1;
        const bool more = c + DS4_BLOCK_CHUNK < nb;
        const float* const wsp = ws0 + cbuf * 32 * Q8T_BM;
        const float* const dxp = dx0 + cbuf * 32 * Q8T_BN;
#define Q8T_STEP(S)                                                                          \
    {                                                                                        \
        cp_async_wait();                                                                     \
        __syncthreads();                                                                     \
        if (S < 3) {                                                                         \
            stage_weights(c, (S + 1) & 3, (S + 1) & 1);                                      \
            stage_tokens(c, (S + 1) & 3, (S + 1) & 1);                                       \
        } else if (more) {                                                                   \
            stage_weights(c + DS4_BLOCK_CHUNK, 0, 0);                                        \
            stage_tokens(c + DS4_BLOCK_CHUNK, 0, 0);                                         \
        }                                                                                    \
        if (S == 1 && more) {                                                                \
            stage_token_scales(c + DS4_BLOCK_CHUNK, cbuf ^ 1);                               \
            load_weight_scales(c + DS4_BLOCK_CHUNK);                                         \
        }                                                                                    \
        if (S == 2 && more) store_weight_scales(cbuf ^ 1);                                   \
        if (live) q8t_step<S>(qa0 + (S & 1) * Q8T_QBUF, qb0 + (S & 1) * Q8T_QBUF, wsp, dxp, pend, half, total); \
    }
        Q8T_STEP(0)
        Q8T_STEP(1)
        Q8T_STEP(2)
        Q8T_STEP(3)
#undef Q8T_STEP
    }
    if (!live) return;
    float* out = second ? a.out2 : a.out;
    const u32 out_stride = second ? R.s[5] : R.s[3];
#pragma unroll
    for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            const u32 t = 8 * Q8T_NT * wn + 8 * j + 2 * tq + (k & 1);
            if ((act[t / 32] >> (t % 32)) & 1)
                ((float*)((u8*)out + (u64)(y0 + t) * out_stride))[r0 + gq + (k >> 1) * 8] = total[(4 * j + k) * Q8T_THREADS];
        }
}
#endif
#else
// Row rr of the launch (the first matrix's rows, then the second's) by one warp: its weights'
// first chunks loaded, then the wait for the previous kernel, then the sums; lane 0 stores it.
// Returns the row's value in every lane (0 past the rows).
// Before the wait, the warp may also ask L2 for another row of the first matrix (`ahead`, ~0u: none)
// that a block of a later wave will read: the bus is idle while the launch waits on a latency
// chain. PREFETCH 1: prefetch.global.L2, 2: with evict_last. Hints only: the same bits.
template <u32 EARLY = Q8_EARLY_CHUNKS, u32 PREFETCH = 0>
__device__ __forceinline__ float q8_0_warp_row(u64 cond, const MatVecQ80Args& a, u32 rr, u32 lane, u32 ahead = ~0u) {
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr, rows = second ? a.rows2 : a.rows;
    const u8* w = second ? a.w2 : a.w;
    float* out = second ? a.out2 : a.out;
    const bool live = r < rows;
    const u32 nb = a.in_dim / 32;
    int4 w0[EARLY], w1[EARLY];
    u16 s[EARLY];
#pragma unroll
    for (u32 u = 0; u < EARLY; u++) {
        const u32 b = u * DS4_BLOCK_CHUNK + lane;
        if (live && b < nb) q8_0_load(w, rows, nb, r, b, &w0[u], &w1[u], &s[u]);
    }
#if !DS4_NATIVE_BLOCKS
    if (PREFETCH && ahead < a.rows) {  // its quants, then its scales
        ds4_prefetch_span_l2<PREFETCH == 2>(a.w + (u64)ahead * nb * 32, nb * 32, lane);
        ds4_prefetch_span_l2<PREFETCH == 2>(a.w + (u64)a.rows * nb * 32 + (u64)ahead * nb * 2, nb * 2, lane);
    }
#endif
    ds4_wait_predecessor(cond);
    if (!live) return 0.0f;
    const u32 g = second ? 0 : r / a.rows_per_group;
    const int4* x4 = (const int4*)(a.xq + (u64)g * a.in_dim);
    const float* dx = a.xd + (u64)g * nb;
    float total = 0.0f;
#pragma unroll
    for (u32 u = 0; u < EARLY; u++) {
        const u32 c = u * DS4_BLOCK_CHUNK;
        if (c < nb) {
            float acc = 0.0f;
            if (c + lane < nb) acc += q8_0_term(w0[u], w1[u], s[u], x4, dx, c + lane);
            total += warp_sum(acc);
        }
    }
    for (u32 c = EARLY * DS4_BLOCK_CHUNK; c < nb; c += DS4_BLOCK_CHUNK) {
        float acc = 0.0f;
        const u32 b = c + lane;
        if (b < nb) {
            int4 q0, q1;
            u16 sc;
            q8_0_load(w, rows, nb, r, b, &q0, &q1, &sc);
            acc += q8_0_term(q0, q1, sc, x4, dx, b);
        }
        total += warp_sum(acc);
    }
    if (lane == 0) out[r] = total;
    return total;
}

extern "C" __global__ void mat_vec_q8_0(DS4_ARGS, MatVecQ80Args a) {
    DS4_GUARD_EARLY;
    q8_0_warp_row(cond, a, blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), threadIdx.x & 31);
}
#endif

// The 16 halves a lane reads of one 512-term chunk of an F16 row (8 consecutive per lane step);
// `n` is the number of terms left (a multiple of 8). Lanes past the row's end read nothing.
struct F16Chunk {
    uint4 q[2];
};
__device__ __forceinline__ F16Chunk load_chunk_f16(const u16* w, u32 n, u32 lane) {
    F16Chunk c;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        c.q[u] = i < n ? ds4_wld((const uint4*)(w + i)) : make_uint4(0, 0, 0, 0);
    }
    return c;
}

// Lane sum of one chunk from its loaded halves, from +0, in the canonical order.
__device__ __forceinline__ float chunk_dot_f16(const F16Chunk& c, const float* x, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const uint4 q = c.q[u];
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += h2f((u16)(q.x & 0xffff)) * p.x;
            acc += h2f((u16)(q.x >> 16)) * p.y;
            acc += h2f((u16)(q.y & 0xffff)) * p.z;
            acc += h2f((u16)(q.y >> 16)) * p.w;
            acc += h2f((u16)(q.z & 0xffff)) * s.x;
            acc += h2f((u16)(q.z >> 16)) * s.y;
            acc += h2f((u16)(q.w & 0xffff)) * s.z;
            acc += h2f((u16)(q.w >> 16)) * s.w;
        }
    }
    return acc;
}

#define F16_EARLY_CHUNKS 2

// One warp per row, all chunks.
extern "C" __global__ void mat_vec_f16(DS4_ARGS, MatVecF16Args a) {
    DS4_GUARD_EARLY;
    const u32 lane = threadIdx.x & 31;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool live = r < a.rows;
    const u16* row = a.w + (u64)r * a.in_dim;
    F16Chunk early[F16_EARLY_CHUNKS];
#pragma unroll
    for (u32 u = 0; u < F16_EARLY_CHUNKS; u++) {
        const u32 c = u * DS4_CHUNK;
        if (live && c < a.in_dim) early[u] = load_chunk_f16(row + c, a.in_dim - c, lane);
    }
    ds4_wait_predecessor(cond);
    if (!live) return;
    const float* xg = a.x + (u64)(r / a.rows_per_group) * a.in_dim;
    float total = 0.0f;
#pragma unroll
    for (u32 u = 0; u < F16_EARLY_CHUNKS; u++) {
        const u32 c = u * DS4_CHUNK;
        if (c < a.in_dim) total += warp_sum(chunk_dot_f16(early[u], xg + c, a.in_dim - c, lane));
    }
    for (u32 c = F16_EARLY_CHUNKS * DS4_CHUNK; c < a.in_dim; c += DS4_CHUNK)
        total += warp_sum(chunk_dot_f16(load_chunk_f16(row + c, a.in_dim - c, lane), xg + c, a.in_dim - c, lane));
    if (lane == 0) a.out[r] = total;
}

// Split-K: one warp per (row, chunk); partial[r * n_chunks + c] is the chunk's sum. The last
// block to finish (a ticket counter, reset by that block for the next launch) adds each row's
// chunk sums in order from +0: the same bits as one warp doing the whole row. With `rows2` > 0 a
// second matrix of the same width (`w2`, `out2`, ungrouped) follows as rows `rows..`.
// The body after the guard; returns true in the last block, once it has stored every row.
__device__ __forceinline__ bool f16_split_rows(u64 cond, const MatVecF16SplitArgs& a) {
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 all_rows = a.rows + a.rows2;
    const bool live = wid < all_rows * a.n_chunks;
    const u32 rr = live ? wid / a.n_chunks : 0, c = live ? (wid % a.n_chunks) * DS4_CHUNK : 0;
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr;
    const u16* row = (second ? a.w2 : a.w) + (u64)r * a.in_dim;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(row + c, a.in_dim - c, lane);
    ds4_wait_predecessor(cond);
    if (live) {
        const float* xg = a.x + (second ? 0 : (u64)(r / a.rows_per_group) * a.in_dim);
        const float s = warp_sum(chunk_dot_f16(chunk, xg + c, a.in_dim - c, lane));
        if (lane == 0) a.partial[wid] = s;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    for (u32 r = threadIdx.x; r < all_rows; r += blockDim.x) {
        float total = 0.0f;
        for (u32 c = 0; c < a.n_chunks; c++) total += __ldcg(a.partial + (u64)r * a.n_chunks + c);
        if (r < a.rows) a.out[r] = total;
        else a.out2[r - a.rows] = total;
    }
    if (threadIdx.x == 0) a.tickets[a.ticket] = 0;
    return true;
}

extern "C" __global__ void mat_vec_f16_split(DS4_ARGS, MatVecF16SplitArgs a) {
    DS4_GUARD_EARLY;
    f16_split_rows(cond, a);
}

#if DS4_CHUNK_ROWS
// The chunk build's F16 products for F16_TOKENS token rows (blockIdx.y's group) from one load of
// each weight chunk: the same warps, terms and sums as the per-row kernels above, so the same bits.
#define F16_TOKENS 8

// The 16 weights a lane holds of a chunk, as floats (converted once for every token row).
struct F16ChunkF {
    float w[16];
};
__device__ __forceinline__ F16ChunkF f16_chunk_floats(const F16Chunk& c) {
    F16ChunkF f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const uint4 q = c.q[u];
        const u32 h[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            f.w[8 * u + 2 * k] = h2f((u16)(h[k] & 0xffff));
            f.w[8 * u + 2 * k + 1] = h2f((u16)(h[k] >> 16));
        }
    }
    return f;
}
// chunk_dot_f16's lane sum from the converted weights: the same products in the same order.
__device__ __forceinline__ float chunk_dot_f16f(const F16ChunkF& c, const float* x, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += c.w[8 * u] * p.x;
            acc += c.w[8 * u + 1] * p.y;
            acc += c.w[8 * u + 2] * p.z;
            acc += c.w[8 * u + 3] * p.w;
            acc += c.w[8 * u + 4] * s.x;
            acc += c.w[8 * u + 5] * s.y;
            acc += c.w[8 * u + 6] * s.z;
            acc += c.w[8 * u + 7] * s.w;
        }
    }
    return acc;
}

// Which of the group's token rows run (count 0 past the chunk's tokens, or a false predicate).
__device__ __forceinline__ u32 f16_active_tokens(const StepParams* P, u64 cond, u32 y0) {
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < F16_TOKENS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    return active;
}

#define ROW_PTR(T, p, k, y) ((T*)((u8*)(p) + (u64)(y) * R.s[k]))

// mat_vec_f16 for a group of token rows: a warp per matrix row, all chunks.
extern "C" __global__ void mat_mul_f16(DS4_ARGS, MatVecF16Args a) {
    const u32 y0 = blockIdx.y * F16_TOKENS;
    const u32 active = f16_active_tokens(P, cond, y0);
    ds4_wait_predecessor(cond);
    const u32 lane = threadIdx.x & 31;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (!active || r >= a.rows) return;
    const u16* row = a.w + (u64)r * a.in_dim;
    const u64 xoff = (u64)(r / a.rows_per_group) * a.in_dim;
    float total[F16_TOKENS];
#pragma unroll
    for (u32 t = 0; t < F16_TOKENS; t++) total[t] = 0.0f;
    for (u32 c = 0; c < a.in_dim; c += DS4_CHUNK) {
        const F16ChunkF wf = f16_chunk_floats(load_chunk_f16(row + c, a.in_dim - c, lane));
#pragma unroll
        for (u32 t = 0; t < F16_TOKENS; t++)
            if ((active >> t) & 1) {
                const float* xg = ROW_PTR(const float, a.x, 1, y0 + t) + xoff;
                total[t] += warp_sum(chunk_dot_f16f(wf, xg + c, a.in_dim - c, lane));
            }
    }
    if (lane == 0)
#pragma unroll
        for (u32 t = 0; t < F16_TOKENS; t++)
            if ((active >> t) & 1) ROW_PTR(float, a.out, 2, y0 + t)[r] = total[t];
}

// mat_vec_f16_split for a group of token rows: a warp per (matrix row, chunk) writes each token
// row's chunk sum to that row's partials; the group's last block (the ticket of its first token
// row) adds each (token row, matrix row)'s chunk sums in order from +0.
extern "C" __global__ void mat_mul_f16_split(DS4_ARGS, MatVecF16SplitArgs a) {
    __shared__ bool last;
    const u32 y0 = blockIdx.y * F16_TOKENS;
    const u32 active = f16_active_tokens(P, cond, y0);
    const u32 lane = threadIdx.x & 31;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 all_rows = a.rows + a.rows2;
    const bool live = active && wid < all_rows * a.n_chunks;
    const u32 rr = live ? wid / a.n_chunks : 0, c = live ? (wid % a.n_chunks) * DS4_CHUNK : 0;
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr;
    const u16* row = (second ? a.w2 : a.w) + (u64)r * a.in_dim;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(row + c, a.in_dim - c, lane);
    ds4_wait_predecessor(cond);
    if (!active) return;  // the whole group's blocks: none takes the ticket
    if (live) {
        const F16ChunkF wf = f16_chunk_floats(chunk);
        const u64 xoff = second ? 0 : (u64)(r / a.rows_per_group) * a.in_dim;
#pragma unroll
        for (u32 t = 0; t < F16_TOKENS; t++)
            if ((active >> t) & 1) {
                const float* xg = ROW_PTR(const float, a.x, 1, y0 + t) + xoff;
                const float s = warp_sum(chunk_dot_f16f(wf, xg + c, a.in_dim - c, lane));
                if (lane == 0) ROW_PTR(float, a.partial, 2, y0 + t)[wid] = s;
            }
    }
    __threadfence();
    __syncthreads();
    u32* ticket = ROW_PTR(u32, a.tickets, 3, y0) + a.ticket;
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (u32 i = threadIdx.x; i < F16_TOKENS * all_rows; i += blockDim.x) {
        const u32 t = i / all_rows, rw = i % all_rows;
        if (!((active >> t) & 1)) continue;
        const float* part = ROW_PTR(const float, a.partial, 2, y0 + t) + (u64)rw * a.n_chunks;
        float total = 0.0f;
        for (u32 k = 0; k < a.n_chunks; k++) total += __ldcg(part + k);
        if (rw < a.rows) ROW_PTR(float, a.out, 4, y0 + t)[rw] = total;
        else ROW_PTR(float, a.out2, 6, y0 + t)[rw - a.rows] = total;
    }
    if (threadIdx.x == 0) *ticket = 0;
}
#undef ROW_PTR

// The chunk build's F16 products as register tiles (mat_mul_f16_tile, mat_mul_f16_split_tile and
// hc_pre_mix): a block of 256 threads takes F16T_ROWS matrix rows x F16T_TOKENS token rows, a
// thread F16T_TR x F16T_TT of them (rows ty + 16 i, tokens tx + 16 j), so each staged weight
// feeds F16T_TOKENS token rows and each staged input F16T_ROWS matrix rows. Every output is the
// per-row kernels' sum: per 512-term chunk the 32 lane sums (lane l: its 16 products of terms
// 256 u + 8 l + k, in that order, from +0), merged in warp_sum's tree by one thread (leaves in
// bit-reversed order), the chunk sums added in order from +0.
//
// A chunk is staged in eighths: leaves 4e .. 4e + 3 of the bit-reversed order are lanes
// bitrev3(e) + 8 bitrev2(m), m = 0..3, so eighth e holds those 4 lanes' 64 terms and closes a
// 4-leaf subtree; the eighths' subtrees merge as a binary counter (p2, p3, p4). Terms past in_dim
// are staged as +0 (weight and input), so their products are +0: they can change only the sign
// of a zero lane sum, which the chunk sums' +0 start absorbs. The first product of a lane sum
// skips the add to +0 (the same argument: only the sign of a zero can differ).
//
// gridDim.x is (matrix-row tiles) x (K splits): with K splits > 1 each block takes a run of
// chunks, writes their sums to `partial`, and the tile's last block (a ticket per tile: tile t
// uses the ticket word of token row t) adds every chunk sum in order from +0.
#ifndef F16T_TR
#define F16T_TR 4
#endif
#ifndef F16T_TT
#define F16T_TT 2
#endif
#define F16T_ROWS (16 * F16T_TR)
#define F16T_TOKENS (16 * F16T_TT)
// Floats per staged row: 64 terms and 4 more, so that 8 consecutive rows start in 8 bank groups.
#define F16T_PITCH 68

struct F16Tile {
    const u16* w;   // matrix rows 0 .. rows
    const u16* w2;  // matrix rows rows .. rows + rows2
    const float* x;  // token row y at byte y * x_stride
    float* out;
    float* out2;
    float* partial;
    u32* tickets;
    u32 x_stride, out_stride, out2_stride, partial_stride, tickets_stride;
    u32 rows, rows2, in_dim, ticket;
};


template <u32 TR, u32 TT>
__device__ __forceinline__ void f16_tile(const StepParams* P, u64 cond, const F16Tile& j) {
    static_assert(TR % 2 == 0 && TT % 2 == 0, "a thread stages TR / 2 weight and TT / 2 input units");
    __shared__ __align__(16) float ws[(16 * TR) * F16T_PITCH];
    __shared__ __align__(16) float xs[(16 * TT) * F16T_PITCH];
    __shared__ bool last;
    const u32 y0 = blockIdx.y * (16 * TT);
    static_assert(16 * TT <= 64, "the active token rows are one 64-bit mask");
    u64 active = 0;
#pragma unroll
    for (u32 t = 0; t < (16 * TT); t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1ull << t;
    ds4_wait_predecessor(cond);
    if (!active) return;  // the whole tile's blocks: none takes the ticket
    const u32 all_rows = j.rows + j.rows2;
    const u32 row_tiles = (all_rows + (16 * TR) - 1) / (16 * TR);
    const u32 ksplit = gridDim.x / row_tiles;
    const u32 rt = blockIdx.x / ksplit, ks = blockIdx.x % ksplit;
    const u32 r0 = rt * (16 * TR);
    const u32 n_chunks = (j.in_dim + DS4_CHUNK - 1) / DS4_CHUNK;
    const u32 per = (n_chunks + ksplit - 1) / ksplit;
    const u32 c0 = min(ks * per, n_chunks), c1 = min(c0 + per, n_chunks);
    const u32 tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

    // Staging: unit e of an eighth is 8 consecutive terms of one row: row e / 8, half u, lane slot q.
    uint4 wq[TR / 2];
    float4 xa[TT / 2], xb[TT / 2];
    auto fetch = [&](u32 s) {
        const u32 c = c0 + s / 8, g = bit_reverse3(s % 8);
#pragma unroll
        for (u32 k = 0; k < TR / 2; k++) {
            const u32 e = threadIdx.x + 256 * k, rr = r0 + e / 8, u = (e / 4) & 1, q = e & 3;
            const u32 i = c * DS4_CHUNK + u * 256 + (g + 8 * q) * 8;
            wq[k] = make_uint4(0, 0, 0, 0);
            if (rr < all_rows && i < j.in_dim) {
                const u16* row = rr < j.rows ? j.w + (u64)rr * j.in_dim : j.w2 + (u64)(rr - j.rows) * j.in_dim;
                wq[k] = __ldg((const uint4*)(row + i));
            }
        }
#pragma unroll
        for (u32 k = 0; k < TT / 2; k++) {
            const u32 e = threadIdx.x + 256 * k, t = e / 8, u = (e / 4) & 1, q = e & 3;
            const u32 i = c * DS4_CHUNK + u * 256 + (g + 8 * q) * 8;
            xa[k] = xb[k] = make_float4(0, 0, 0, 0);
            if (((active >> t) & 1) && i < j.in_dim) {
                const float* xr = (const float*)((const u8*)j.x + (u64)(y0 + t) * j.x_stride) + i;
                xa[k] = *(const float4*)xr;
                xb[k] = *(const float4*)(xr + 4);
            }
        }
    };
    auto store = [&]() {
#pragma unroll
        for (u32 k = 0; k < TR / 2; k++) {
            const u32 e = threadIdx.x + 256 * k;
            float* d = ws + (e / 8) * F16T_PITCH + (e & 7) * 8;
            const uint4 h = wq[k];
            *(float4*)d = make_float4(h2f((u16)(h.x & 0xffff)), h2f((u16)(h.x >> 16)), h2f((u16)(h.y & 0xffff)),
                                      h2f((u16)(h.y >> 16)));
            *(float4*)(d + 4) = make_float4(h2f((u16)(h.z & 0xffff)), h2f((u16)(h.z >> 16)),
                                            h2f((u16)(h.w & 0xffff)), h2f((u16)(h.w >> 16)));
        }
#pragma unroll
        for (u32 k = 0; k < TT / 2; k++) {
            const u32 e = threadIdx.x + 256 * k;
            float* d = xs + (e / 8) * F16T_PITCH + (e & 7) * 8;
            *(float4*)d = xa[k];
            *(float4*)(d + 4) = xb[k];
        }
    };

    float total[TR][TT], p2[TR][TT], p3[TR][TT], p4[TR][TT];
#pragma unroll
    for (u32 i = 0; i < TR; i++)
#pragma unroll
        for (u32 t = 0; t < TT; t++) total[i][t] = 0.0f;
    const u32 stages = (c1 - c0) * 8;
    if (stages) fetch(0);
    for (u32 s = 0; s < stages; s++) {
        __syncthreads();  // every thread is done with the previous eighth
        store();
        __syncthreads();
        if (s + 1 < stages) fetch(s + 1);  // in flight while this eighth is computed
        // The eighth's 4-leaf subtree: leaf m is lane slot q = bitrev2(m).
        float pa[TR][TT], pb[TR][TT], v[TR][TT];
#pragma unroll
        for (u32 m = 0; m < 4; m++) {
            const u32 q = ((m & 1) << 1) | (m >> 1);
#pragma unroll
            for (u32 h = 0; h < 4; h++) {
                const u32 off = (h >> 1) * 32 + q * 8 + (h & 1) * 4;
                float4 wv[TR], xv[TT];
#pragma unroll
                for (u32 i = 0; i < TR; i++) wv[i] = *(const float4*)(ws + (ty + 16 * i) * F16T_PITCH + off);
#pragma unroll
                for (u32 t = 0; t < TT; t++) xv[t] = *(const float4*)(xs + (tx + 16 * t) * F16T_PITCH + off);
#pragma unroll
                for (u32 i = 0; i < TR; i++)
#pragma unroll
                    for (u32 t = 0; t < TT; t++) {
                        float a = h == 0 ? wv[i].x * xv[t].x : v[i][t] + wv[i].x * xv[t].x;
                        a += wv[i].y * xv[t].y;
                        a += wv[i].z * xv[t].z;
                        a += wv[i].w * xv[t].w;
                        v[i][t] = a;
                    }
            }
#pragma unroll
            for (u32 i = 0; i < TR; i++)
#pragma unroll
                for (u32 t = 0; t < TT; t++) {
                    if (m == 0) pa[i][t] = v[i][t];
                    else if (m == 1) pa[i][t] = pa[i][t] + v[i][t];
                    else if (m == 2) pb[i][t] = v[i][t];
                    else v[i][t] = pa[i][t] + (pb[i][t] + v[i][t]);
                }
        }
        // Merge the subtree into the chunk's: eighths 2k and 2k+1 pair, then pairs of pairs.
        const u32 e8 = s % 8;
#pragma unroll
        for (u32 i = 0; i < TR; i++)
#pragma unroll
            for (u32 t = 0; t < TT; t++) {
                if (!(e8 & 1)) {
                    p2[i][t] = v[i][t];
                    continue;
                }
                float a = p2[i][t] + v[i][t];
                if (!(e8 & 2)) {
                    p3[i][t] = a;
                    continue;
                }
                a = p3[i][t] + a;
                if (!(e8 & 4)) {
                    p4[i][t] = a;
                    continue;
                }
                v[i][t] = p4[i][t] + a;  // the chunk's sum
            }
        if (e8 == 7) {
            if (ksplit == 1) {
#pragma unroll
                for (u32 i = 0; i < TR; i++)
#pragma unroll
                    for (u32 t = 0; t < TT; t++) total[i][t] += v[i][t];
            } else {
                const u32 c = c0 + s / 8;
#pragma unroll
                for (u32 t = 0; t < TT; t++) {
                    const u32 tok = tx + 16 * t;
                    if (!((active >> tok) & 1)) continue;
                    float* part = (float*)((u8*)j.partial + (u64)(y0 + tok) * j.partial_stride);
#pragma unroll
                    for (u32 i = 0; i < TR; i++) {
                        const u32 rr = r0 + ty + 16 * i;
                        if (rr < all_rows) part[(u64)rr * n_chunks + c] = v[i][t];
                    }
                }
            }
        }
    }
    if (ksplit > 1) {
        __threadfence();
        __syncthreads();
        u32* ticket = (u32*)((u8*)j.tickets + (u64)(blockIdx.y * row_tiles + rt) * j.tickets_stride) + j.ticket;
        if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == ksplit - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
#pragma unroll
        for (u32 t = 0; t < TT; t++) {
            const u32 tok = tx + 16 * t;
            if (!((active >> tok) & 1)) continue;
            const float* part = (const float*)((const u8*)j.partial + (u64)(y0 + tok) * j.partial_stride);
#pragma unroll
            for (u32 i = 0; i < TR; i++) {
                const u32 rr = r0 + ty + 16 * i;
                if (rr >= all_rows) continue;
                float sum = 0.0f;
                for (u32 c = 0; c < n_chunks; c++) sum += __ldcg(part + (u64)rr * n_chunks + c);
                total[i][t] = sum;
            }
        }
        if (threadIdx.x == 0) *ticket = 0;
    }
#pragma unroll
    for (u32 t = 0; t < TT; t++) {
        const u32 tok = tx + 16 * t;
        if (!((active >> tok) & 1)) continue;
#pragma unroll
        for (u32 i = 0; i < TR; i++) {
            const u32 rr = r0 + ty + 16 * i;
            if (rr < j.rows) ((float*)((u8*)j.out + (u64)(y0 + tok) * j.out_stride))[rr] = total[i][t];
            else if (rr < all_rows)
                ((float*)((u8*)j.out2 + (u64)(y0 + tok) * j.out2_stride))[rr - j.rows] = total[i][t];
        }
    }
}

// mat_vec_f16 (ungrouped) as a tile product: no K split (gridDim.x = matrix-row tiles).
extern "C" __global__ void __launch_bounds__(256, 2) mat_mul_f16_tile(DS4_ARGS, MatVecF16Args a) {
    F16Tile j;
    j.w = a.w, j.w2 = nullptr, j.x = a.x, j.out = a.out, j.out2 = nullptr, j.partial = nullptr, j.tickets = nullptr;
    j.x_stride = R.s[1], j.out_stride = R.s[2], j.out2_stride = 0, j.partial_stride = 0, j.tickets_stride = 0;
    j.rows = a.rows, j.rows2 = 0, j.in_dim = a.in_dim, j.ticket = 0;
    f16_tile<F16T_TR, F16T_TT>(P, cond, j);
}

// mat_vec_f16_split (ungrouped, with its optional second matrix) as a tile product.
extern "C" __global__ void __launch_bounds__(256, 2) mat_mul_f16_split_tile(DS4_ARGS, MatVecF16SplitArgs a) {
    F16Tile j;
    j.w = a.w, j.w2 = a.w2, j.x = a.x, j.out = a.out, j.out2 = a.out2, j.partial = a.partial, j.tickets = a.tickets;
    j.x_stride = R.s[1], j.out_stride = R.s[4], j.out2_stride = R.s[6], j.partial_stride = R.s[2];
    j.tickets_stride = R.s[3], j.rows = a.rows, j.rows2 = a.rows2, j.in_dim = a.in_dim, j.ticket = a.ticket;
    f16_tile<F16T_TR, F16T_TT>(P, cond, j);
}
#endif

// One warp per row of an F32 matrix (4 terms per lane step).
extern "C" __global__ void mat_vec_f32(DS4_ARGS, MatVecF32Args a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= a.rows) return;
    const float* row = a.w + (u64)r * a.in_dim;
    const float* xg = a.x + (u64)(r / a.rows_per_group) * a.in_dim;
    const float total = warp_dot_f32(row, xg, a.in_dim, lane);
    if (lane == 0) a.out[r] = total;
}
