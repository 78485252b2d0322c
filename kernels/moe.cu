// Router and routed experts. Activations are quantized to Q8_K (256-blocks), the mid vector is
// re-quantized before the down projection, as ds4's CPU path does. Expert weights are
// IQ2_XXS (16), Q2_K (10) or Q4_K (12), per tensor.

// One block of 256 threads: p = sqrt(softplus(logit)); experts from the hash table (by token) or
// the top n_used of p + bias (ties to the lower expert); weights p[sel] / sum * scale.
extern "C" __global__ void router_select(DS4_ARGS, const RouterSelectArgs a) {
    DS4_GUARD;
    const float* logits = a.logits;
    const float* bias = a.bias;
    const u32 n_expert = a.n_expert, n_used = a.n_used;
    __shared__ float probs[1024];
    __shared__ float choice[1024];
    for (u32 i = threadIdx.x; i < n_expert; i += blockDim.x) {
        const float x = logits[i];
        const float sp = x > 20.0f ? x : (x < -20.0f ? ds4_expf(x) : ds4_log1pf(ds4_expf(x)));
        probs[i] = sqrtf(sp);
        choice[i] = probs[i] + (bias ? bias[i] : 0.0f);
    }
    __syncthreads();
    __shared__ int sel[16];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const u32 t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
    if (a.hash) {
        // A token past the table (refused on the host) or an id past the experts reads nothing.
        const u32 token = min(P->token, a.n_vocab - 1);
        if (t < n_used) sel[t] = min(max(a.hash[(u64)token * n_used + t], 0), (int)n_expert - 1);
    } else {
        // n_used rounds of a block argmax (largest value, lower expert on ties): the order in
        // which the CPU's insertion keeps them.
        for (u32 k = 0; k < n_used; k++) {
            float v = -__int_as_float(0x7f800000);
            int idx = 0x7fffffff;
            for (u32 i = t; i < n_expert; i += blockDim.x) {
                bool taken = false;
                for (u32 j = 0; j < k; j++) taken |= sel[j] == (int)i;
                if (!taken && (choice[i] > v || idx == 0x7fffffff)) {
                    v = choice[i];
                    idx = (int)i;
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
                    if (best_i[w] != 0x7fffffff && (bi == 0x7fffffff || best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi))) {
                        bv = best_v[w];
                        bi = best_i[w];
                    }
                }
                sel[k] = bi;
            }
            __syncthreads();
        }
    }
    __syncthreads();
    if (t != 0) return;
    float sum = 0.0f;
    for (u32 k = 0; k < n_used; k++) sum += probs[sel[k]];
    sum = fmaxf(sum, 6.103515625e-5f);
    for (u32 k = 0; k < n_used; k++) {
        a.selected[k] = sel[k];
        a.weights[k] = probs[sel[k]] / sum * a.scale;
    }
}

// One block of 256 threads per 256 values. d = 1/iscale with iscale = -127/max, where max is the
// value of largest magnitude (the first one on ties).
extern "C" __global__ void quantize_q8_k(DS4_ARGS, const QuantizeQ8KArgs a) {
    DS4_GUARD;
    const float* x = a.x;
    BlockQ8K* out = a.out;
    __shared__ float wv[8];
    __shared__ int wi[8];
    __shared__ float maxv;
    const u32 b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const float v = x[(u64)b * 256 + t];
    float am = fabsf(v);
    int idx = (int)t;
    warp_argmax(&am, &idx);
    if (lane == 0) {
        wv[warp] = am;
        wi[warp] = idx;
    }
    __syncthreads();
    if (t == 0) {
        float ba = wv[0];
        int bi = wi[0];
        for (int w = 1; w < 8; w++) {
            if (wv[w] > ba || (wv[w] == ba && wi[w] < bi)) {
                ba = wv[w];
                bi = wi[w];
            }
        }
        maxv = ba == 0.0f ? 0.0f : x[(u64)b * 256 + bi];
    }
    __syncthreads();
    BlockQ8K* o = out + b;
    if (maxv == 0.0f) {
        o->qs[t] = 0;
        if (t < 16) o->bsums[t] = 0;
        if (t == 0) o->d = 0.0f;
        return;
    }
    const float iscale = -127.0f / maxv;
    const int q = max(-128, min(127, (int)rintf(iscale * v)));
    o->qs[t] = (i8)q;
    __syncthreads();
    if (t < 16) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += o->qs[t * 16 + i];
        o->bsums[t] = (i16)s;
    }
    if (t == 0) o->d = 1.0f / iscale;
}

// Q4_K 6-bit scale and min of sub-block j (0..8).
__device__ __forceinline__ void q4k_scale_min(int j, const u8* s, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Expert weights are in the split layout (ds4_block_split): the quants of every block (64 bytes
// for IQ2_XXS and Q2_K, 128 for Q4_K), then the rest of each block (d, scales). A lane reads 16
// quant bytes of one block (one load), so L = quants / 16 lanes share a block and a warp covers
// 32 / L blocks per pass. Lanes add integer sums (exact in any order); the block terms then add in
// the canonical order.
#define MOE_MAX_BLOCKS 64

// A row of an expert tensor: its first block's quants and rest, and the block counts.
struct ExpertRow {
    const u8* qs;
    const u8* rest;
};
__device__ __forceinline__ ExpertRow expert_row(const u8* tensor, u32 ty, u64 total_blocks, u64 first_block) {
    u32 bb = 0, at = 0, nq = 0;
    ds4_block_split(ty, &bb, &at, &nq);
    ExpertRow r;
    r.qs = tensor + first_block * nq;
    r.rest = tensor + total_blocks * nq + first_block * (bb - nq);
    return r;
}
__device__ __forceinline__ u32 quant_bytes(u32 ty) { return ty == 12 ? 128 : 64; }
__device__ __forceinline__ u32 rest_bytes(u32 ty) { return ty == 16 ? 2 : (ty == 10 ? 20 : 16); }

// IQ2_XXS sub-block (32 values) from its two words: 4 grid bytes; 4x7 sign bits + a 4-bit scale.
__device__ __forceinline__ int iq2_xxs_sub(u32 aux0, u32 aux1, const int* q8, const u64* grid) {
    int sumi = 0;
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u64 g = grid[(aux0 >> (8 * l)) & 255];
        u32 signs = (aux1 >> (7 * l)) & 127;
        signs |= (u32)(__popc(signs) & 1) << 7;  // parity bit: the count of negatives is even
        // Byte j of the mask is 0xff where sign bit j is set; (v ^ m) - m negates those bytes.
        const u32 mlo = (((signs & 15) * 0x00204081u) & 0x01010101u) * 0xffu;
        const u32 mhi = (((signs >> 4) * 0x00204081u) & 0x01010101u) * 0xffu;
        sumi = __dp4a((int)__vsub4((u32)g ^ mlo, mlo), q8[2 * l], sumi);
        sumi = __dp4a((int)__vsub4((u32)(g >> 32) ^ mhi, mhi), q8[2 * l + 1], sumi);
    }
    return sumi * (2 * (int)(aux1 >> 28) + 1);
}

// Integer sums of part p (16 quant bytes `w`) of one block: `isum` takes the scaled quant·q8
// products, `summ` the scaled mins times the q8 sums (Q2_K / Q4_K). `rest` is the block's rest.
__device__ __forceinline__ void part_sums(u32 ty, int4 w, const u8* rest, const BlockQ8K* y, u32 p, const u64* grid,
                                          int* isum, int* summ) {
    const u32 wv[4] = {(u32)w.x, (u32)w.y, (u32)w.z, (u32)w.w};
    if (ty == 16) {  // part p: sub-blocks 2p and 2p+1
        const int* q8 = (const int*)(y->qs + 64 * p);
        *isum = iq2_xxs_sub(wv[0], wv[1], q8, grid) + iq2_xxs_sub(wv[2], wv[3], q8 + 8, grid);
        *summ = 0;
    } else if (ty == 10) {  // part p: 128-value chunk p/2, 16-byte half p%2, all four 2-bit planes
        const u32 chunk = p >> 1, half = p & 1;
        int is_ = 0, sm = 0;
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            const int* q8 = (const int*)(y->qs + 128 * chunk + 32 * j + 16 * half);
            int s = 0;
#pragma unroll
            for (u32 t = 0; t < 4; t++) s = __dp4a((int)((wv[t] >> (2 * j)) & 0x03030303u), q8[t], s);
            const u32 k = 8 * chunk + 2 * j + half;
            is_ += (rest[k] & 15) * s;
            sm += (rest[k] >> 4) * y->bsums[k];
        }
        *isum = is_;
        *summ = sm;
    } else {  // Q4_K, part p: sub-blocks 2(p/2) (low nibbles) and 2(p/2)+1 (high), 16-byte half p%2
        const u32 t = p >> 1, half = p & 1;
        const int* qlo = (const int*)(y->qs + 64 * t + 16 * half);
        const int* qhi = qlo + 8;
        int slo = 0, shi = 0;
#pragma unroll
        for (u32 i = 0; i < 4; i++) {
            slo = __dp4a((int)(wv[i] & 0x0f0f0f0fu), qlo[i], slo);
            shi = __dp4a((int)((wv[i] >> 4) & 0x0f0f0f0fu), qhi[i], shi);
        }
        int sc0, m0, sc1, m1;
        q4k_scale_min(2 * t, rest + 4, &sc0, &m0);
        q4k_scale_min(2 * t + 1, rest + 4, &sc1, &m1);
        *isum = sc0 * slo + sc1 * shi;
        *summ = half ? 0 : m0 * (y->bsums[4 * t] + y->bsums[4 * t + 1]) + m1 * (y->bsums[4 * t + 2] + y->bsums[4 * t + 3]);
    }
}

// Integer sums of every block of R rows (same type, nb blocks each, activations y[k]) into
// is[k][b], sm[k][b]: U loads of each of the R rows are issued before any is used.
template <int R, int U>
__device__ __forceinline__ void rows_sums(u32 ty, const ExpertRow* rows, const BlockQ8K* const* y, u32 nb,
                                          const u64* grid, int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 lane = threadIdx.x & 31, nq = quant_bytes(ty), L = nq / 16, bpp = 32 / L, part = lane % L;
    const u32 rb = rest_bytes(ty);
    for (u32 b0 = 0; b0 < nb; b0 += U * bpp) {
        int4 w[R][U];
#pragma unroll
        for (int k = 0; k < R; k++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const u32 b = b0 + u * bpp + lane / L;
                w[k][u] = make_int4(0, 0, 0, 0);
                if (rows[k].qs && b < nb) w[k][u] = __ldg((const int4*)(rows[k].qs + (u64)b * nq) + part);
            }
        }
#pragma unroll
        for (int k = 0; k < R; k++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const u32 b = b0 + u * bpp + lane / L;
                if (b0 + u * bpp >= nb) break;  // uniform across the warp
                int a = 0, m = 0;
                if (rows[k].qs && b < nb) part_sums(ty, w[k][u], rows[k].rest + (u64)b * rb, y[k] + b, part, grid, &a, &m);
                for (u32 o = 1; o < L; o <<= 1) {
                    a += __shfl_xor_sync(0xffffffffu, a, o);
                    m += __shfl_xor_sync(0xffffffffu, m, o);
                }
                if (part == 0 && b < nb) {
                    is[k][b] = a;
                    sm[k][b] = m;
                }
            }
        }
    }
    __syncwarp();
}

// The dot of one row from its block sums, in the canonical order: lane l takes the term of block
// c + l of each 32-block chunk, the butterfly reduces the chunk, chunk sums add in order from +0.
// Every lane gets the result.
__device__ float row_total(u32 ty, const u8* rest, const BlockQ8K* y, u32 nb, const int* is, const int* sm) {
    const u32 lane = threadIdx.x & 31, rb = rest_bytes(ty);
    float total = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        float acc = 0.0f;
        const u32 b = c + lane;
        if (b < nb) {
            const u8* r = rest + (u64)b * rb;
            const float yd = y[b].d;
            if (ty == 16) {
                acc += (h2f(*(const u16*)r) * yd) * (float)is[b];
            } else if (ty == 10) {
                const float dall = yd * h2f(*(const u16*)(r + 16)), dmin = yd * h2f(*(const u16*)(r + 18));
                acc += dall * (float)is[b] - dmin * (float)sm[b];
            } else {
                const float d = yd * h2f(*(const u16*)r), dmin = yd * h2f(*(const u16*)(r + 2));
                acc += d * (float)is[b] - dmin * (float)sm[b];
            }
        }
        total += warp_sum(acc);
    }
    if (ty == 16) total = 0.125f * total;
    return total;
}

// The IQ2_XXS grid in shared memory, loaded by the whole block (every thread must call it).
__device__ __forceinline__ const u64* shared_grid(const u64* grid, bool needed) {
    __shared__ u64 grid_sh[256];
    if (needed)
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) grid_sh[i] = grid[i];
    __syncthreads();
    return grid_sh;
}

// mid[slot][r] = silu(min(gate,c)) * clamp(up,±c) * weight[slot]; one warp per (slot, row).
extern "C" __global__ void moe_gate_up(DS4_ARGS, const MoeGateUpArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][2][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2][MOE_MAX_BLOCKS];
    const u64* grid = shared_grid(a.grid, a.gate_ty == 16 || a.up_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + warp;
    if (wid >= a.n_used * a.ff) return;
    const u32 slot = wid / a.ff, r = wid % a.ff, nb = a.in_dim / 256;
    const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
    const u64 total = (u64)a.n_expert * a.ff * nb, first = (e * a.ff + r) * nb;
    ExpertRow rows[2] = {expert_row(a.gate, a.gate_ty, total, first), expert_row(a.up, a.up_ty, total, first)};
    const BlockQ8K* ys[2] = {a.xq, a.xq};
    if (a.gate_ty == a.up_ty) {
        rows_sums<2, 2>(a.gate_ty, rows, ys, nb, grid, is_sh[warp], sm_sh[warp]);
    } else {
        rows_sums<1, 4>(a.gate_ty, rows, ys, nb, grid, is_sh[warp], sm_sh[warp]);
        rows_sums<1, 4>(a.up_ty, rows + 1, ys, nb, grid, is_sh[warp] + 1, sm_sh[warp] + 1);
    }
    const float g = row_total(a.gate_ty, rows[0].rest, a.xq, nb, is_sh[warp][0], sm_sh[warp][0]);
    const float u = row_total(a.up_ty, rows[1].rest, a.xq, nb, is_sh[warp][1], sm_sh[warp][1]);
    if ((threadIdx.x & 31) == 0) a.mid[wid] = swiglu_clamped(g, u, a.clamp) * a.weights[slot];
}

// out[r] = sum over slots (in order, from +0) of down_e(row r) · midq[slot]; one warp per row,
// the rows of MOE_DOWN_SLOTS slots loaded together.
#define MOE_DOWN_SLOTS 4
extern "C" __global__ void moe_down(DS4_ARGS, const MoeDownArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][MOE_DOWN_SLOTS][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][MOE_DOWN_SLOTS][MOE_MAX_BLOCKS];
    const u64* grid = shared_grid(a.grid, a.down_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= a.out_dim) return;
    const u32 nb = a.ff / 256;
    const u64 total = (u64)a.n_expert * a.out_dim * nb;
    float acc = 0.0f;
    for (u32 s0 = 0; s0 < a.n_used; s0 += MOE_DOWN_SLOTS) {
        ExpertRow rows[MOE_DOWN_SLOTS];
        const BlockQ8K* ys[MOE_DOWN_SLOTS];
#pragma unroll
        for (u32 k = 0; k < MOE_DOWN_SLOTS; k++) {
            const u32 slot = s0 + k;
            ys[k] = a.midq + (u64)min(slot, a.n_used - 1) * nb;
            if (slot < a.n_used) {
                const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
                rows[k] = expert_row(a.down, a.down_ty, total, (e * a.out_dim + r) * nb);
            } else {
                rows[k].qs = 0;
                rows[k].rest = 0;
            }
        }
        rows_sums<MOE_DOWN_SLOTS, 1>(a.down_ty, rows, ys, nb, grid, is_sh[warp], sm_sh[warp]);
        for (u32 k = 0; k < MOE_DOWN_SLOTS && s0 + k < a.n_used; k++)
            acc += row_total(a.down_ty, rows[k].rest, ys[k], nb, is_sh[warp][k], sm_sh[warp][k]);
        __syncwarp();
    }
    if ((threadIdx.x & 31) == 0) a.out[r] = acc;
}
