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

// Integer sums of 32-value sub-block `sb` (0..8) of one 256-block of a weight row: `isum` takes
// the scaled quant·q8 products, `summ` the scaled mins times the q8 sums (Q2_K / Q4_K).
__device__ void sub_sums(u32 ty, const u8* blk, const BlockQ8K* y, int sb, const u64* __restrict__ grid, int* isum,
                         int* summ) {
    const i8* q8 = y->qs + sb * 32;
    if (ty == 16) {  // IQ2_XXS: f16 d, then per 32 values two u32: 4 grid bytes, 4x7 sign bits + 4-bit scale
        const u16* qs = (const u16*)(blk + 2) + sb * 4;
        const u32 aux0 = (u32)qs[0] | ((u32)qs[1] << 16);
        const u32 aux1 = (u32)qs[2] | ((u32)qs[3] << 16);
        int sumi = 0;
        for (int l = 0; l < 4; l++) {
            const u64 g = grid[(aux0 >> (8 * l)) & 255];
            u32 signs = (aux1 >> (7 * l)) & 127;
            signs |= (u32)(__popc(signs) & 1) << 7;  // parity bit: the count of negatives is even
            for (int j = 0; j < 8; j++) {
                const int gv = (int)((g >> (8 * j)) & 255);
                sumi += ((signs >> j) & 1 ? -gv : gv) * q8[8 * l + j];
            }
        }
        *isum = sumi * (2 * (int)(aux1 >> 28) + 1);
        *summ = 0;
    } else if (ty == 10) {  // Q2_K: scales[16], qs[64], f16 d, f16 dmin
        const u8* sc = blk;
        const u8* qs = blk + 16;
        const int chunk = sb / 4, j = sb % 4;  // 128-value chunk, 2-bit plane
        int is_ = 0, sm = 0;
        for (int half = 0; half < 2; half++) {
            const int k = 8 * chunk + 2 * j + half;
            int s = 0;
            for (int l = 0; l < 16; l++) s += ((qs[32 * chunk + 16 * half + l] >> (2 * j)) & 3) * q8[16 * half + l];
            is_ += (sc[k] & 15) * s;
            sm += (sc[k] >> 4) * y->bsums[k];
        }
        *isum = is_;
        *summ = sm;
    } else {  // Q4_K: f16 d, f16 dmin, scales[12], qs[128]
        const u8* qs = blk + 16 + 32 * (sb / 2);
        int sc, m;
        q4k_scale_min(sb, blk + 4, &sc, &m);
        int s = 0;
        for (int l = 0; l < 32; l++) s += (sb & 1 ? qs[l] >> 4 : qs[l] & 15) * q8[l];
        *isum = sc * s;
        *summ = m * (y->bsums[2 * sb] + y->bsums[2 * sb + 1]);
    }
}

__device__ __forceinline__ u32 block_bytes(u32 ty) { return ty == 16 ? 66 : (ty == 10 ? 84 : 144); }

#define MOE_MAX_BLOCKS 64
// One warp per row: the dot of a weight row (n_blocks 256-blocks) with Q8_K blocks in the
// canonical order. Lanes add integer sums per block (exact in any order); then lane l takes the
// term of block c + l of each 32-block chunk, the butterfly reduces the chunk, and the chunk sums
// add in order. Every lane gets the result.
__device__ float row_dot(u32 ty, const u8* row, const BlockQ8K* y, u32 n_blocks, const u64* grid) {
    __shared__ int isum_sh[8][MOE_MAX_BLOCKS];
    __shared__ int summ_sh[8][MOE_MAX_BLOCKS];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, bb = block_bytes(ty);
    int* is = isum_sh[warp];
    int* sm = summ_sh[warp];
    for (u32 b = lane; b < n_blocks; b += 32) {
        is[b] = 0;
        sm[b] = 0;
    }
    __syncwarp();
    for (u32 s = lane; s < n_blocks * 8; s += 32) {
        int a, m;
        sub_sums(ty, row + (u64)(s / 8) * bb, y + s / 8, s % 8, grid, &a, &m);
        atomicAdd(&is[s / 8], a);
        atomicAdd(&sm[s / 8], m);
    }
    __syncwarp();
    float total = 0.0f;
    for (u32 c = 0; c < n_blocks; c += DS4_BLOCK_CHUNK) {
        float acc = 0.0f;
        const u32 b = c + lane;
        if (b < n_blocks) {
            const u8* blk = row + (u64)b * bb;
            const float yd = y[b].d;
            if (ty == 16) {
                acc += (h2f(*(const u16*)blk) * yd) * (float)is[b];
            } else if (ty == 10) {
                const float dall = yd * h2f(*(const u16*)(blk + 80)), dmin = yd * h2f(*(const u16*)(blk + 82));
                acc += dall * (float)is[b] - dmin * (float)sm[b];
            } else {
                const float d = yd * h2f(*(const u16*)blk), dmin = yd * h2f(*(const u16*)(blk + 2));
                acc += d * (float)is[b] - dmin * (float)sm[b];
            }
        }
        total += warp_sum(acc);
    }
    if (ty == 16) total = 0.125f * total;
    __syncwarp();
    return total;
}

// mid[slot][r] = silu(min(gate,c)) * clamp(up,±c) * weight[slot]; one warp per (slot, row).
extern "C" __global__ void moe_gate_up(DS4_ARGS, const MoeGateUpArgs a) {
    DS4_GUARD;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (wid >= a.n_used * a.ff) return;
    const u32 slot = wid / a.ff, r = wid % a.ff;
    const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
    const u64 g_rb = (u64)(a.in_dim / 256) * block_bytes(a.gate_ty), u_rb = (u64)(a.in_dim / 256) * block_bytes(a.up_ty);
    const float g = row_dot(a.gate_ty, a.gate + (e * a.ff + r) * g_rb, a.xq, a.in_dim / 256, a.grid);
    const float u = row_dot(a.up_ty, a.up + (e * a.ff + r) * u_rb, a.xq, a.in_dim / 256, a.grid);
    if ((threadIdx.x & 31) == 0) a.mid[wid] = swiglu_clamped(g, u, a.clamp) * a.weights[slot];
}

// out[r] = sum over slots (in order, from +0) of down_e(row r) · midq[slot]; one warp per row.
extern "C" __global__ void moe_down(DS4_ARGS, const MoeDownArgs a) {
    DS4_GUARD;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= a.out_dim) return;
    const u64 rb = (u64)(a.ff / 256) * block_bytes(a.down_ty);
    float acc = 0.0f;
    for (u32 slot = 0; slot < a.n_used; slot++) {
        const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
        acc += row_dot(a.down_ty, a.down + (e * a.out_dim + r) * rb, a.midq + (u64)slot * (a.ff / 256), a.ff / 256,
                       a.grid);
    }
    if ((threadIdx.x & 31) == 0) a.out[r] = acc;
}
