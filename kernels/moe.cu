// Router and routed experts. Activations are quantized to Q8_K (256-blocks), the mid vector is
// re-quantized before the down projection, as ds4's CPU path does. Expert weights are
// IQ2_XXS (16), Q2_K (10) or Q4_K (12), per tensor.

// One block of 256 threads: p = sqrt(softplus(logit)); experts from the hash table (by token) or
// the top n_used of p + bias (ties to the lower expert); weights p[sel] / sum * scale.
extern "C" __global__ void router_select(DS4_ARGS, const float* __restrict__ logits, const float* __restrict__ bias,
                                         const int* __restrict__ hash, int* __restrict__ selected,
                                         float* __restrict__ weights, u32 n_expert, u32 n_used, float scale) {
    DS4_GUARD;
    __shared__ float probs[1024];
    __shared__ float choice[1024];
    for (u32 i = threadIdx.x; i < n_expert; i += blockDim.x) {
        const float x = logits[i];
        const float sp = x > 20.0f ? x : (x < -20.0f ? ds4_expf(x) : ds4_log1pf(ds4_expf(x)));
        probs[i] = sqrtf(sp);
        choice[i] = probs[i] + (bias ? bias[i] : 0.0f);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int sel[16];
    if (hash) {
        for (u32 k = 0; k < n_used; k++) sel[k] = hash[(u64)P->token * n_used + k];
    } else {
        for (u32 k = 0; k < n_used; k++) sel[k] = -1;
        for (u32 i = 0; i < n_expert; i++) {
            for (u32 j = 0; j < n_used; j++) {
                if (sel[j] < 0 || choice[i] > choice[sel[j]]) {
                    for (u32 m = n_used - 1; m > j; m--) sel[m] = sel[m - 1];
                    sel[j] = (int)i;
                    break;
                }
            }
        }
    }
    float sum = 0.0f;
    for (u32 k = 0; k < n_used; k++) sum += probs[sel[k]];
    sum = fmaxf(sum, 6.103515625e-5f);
    for (u32 k = 0; k < n_used; k++) {
        selected[k] = sel[k];
        weights[k] = probs[sel[k]] / sum * scale;
    }
}

// One block of 256 threads per 256 values. d = 1/iscale with iscale = -127/max, where max is the
// value of largest magnitude (the first one on ties).
extern "C" __global__ void quantize_q8_k(DS4_ARGS, const float* __restrict__ x, BlockQ8K* __restrict__ out) {
    DS4_GUARD;
    __shared__ float wv[8];
    __shared__ int wi[8];
    __shared__ float maxv;
    const u32 b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const float v = x[(u64)b * 256 + t];
    float a = fabsf(v);
    int idx = (int)t;
    warp_argmax(&a, &idx);
    if (lane == 0) {
        wv[warp] = a;
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
// One warp per row: the dot of a weight row (n_blocks 256-blocks) with Q8_K blocks. Lanes add
// integer sums per block (exact in any order); lane 0 then accumulates the blocks in order with
// the CPU reference's float formula. The result is valid in lane 0.
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
    float sumf = 0.0f;
    if (lane == 0) {
        for (u32 b = 0; b < n_blocks; b++) {
            const u8* blk = row + (u64)b * bb;
            const float yd = y[b].d;
            if (ty == 16) {
                sumf += (h2f(*(const u16*)blk) * yd) * (float)is[b];
            } else if (ty == 10) {
                const float dall = yd * h2f(*(const u16*)(blk + 80)), dmin = yd * h2f(*(const u16*)(blk + 82));
                sumf += dall * (float)is[b] - dmin * (float)sm[b];
            } else {
                const float d = yd * h2f(*(const u16*)blk), dmin = yd * h2f(*(const u16*)(blk + 2));
                sumf += d * (float)is[b] - dmin * (float)sm[b];
            }
        }
        if (ty == 16) sumf = 0.125f * sumf;
    }
    __syncwarp();
    return sumf;
}

// mid[slot][r] = silu(min(gate,c)) * clamp(up,±c) * weight[slot]; one warp per (slot, row).
extern "C" __global__ void moe_gate_up(DS4_ARGS, const BlockQ8K* __restrict__ xq, const int* __restrict__ selected,
                                       const float* __restrict__ weights, const u8* __restrict__ gate,
                                       const u8* __restrict__ up, u32 gate_ty, u32 up_ty, float* __restrict__ mid,
                                       u32 in_dim, u32 ff, u32 n_used, float clamp, const u64* __restrict__ grid) {
    DS4_GUARD;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (wid >= n_used * ff) return;
    const u32 slot = wid / ff, r = wid % ff;
    const u64 e = (u64)selected[slot];
    const u64 g_rb = (u64)(in_dim / 256) * block_bytes(gate_ty), u_rb = (u64)(in_dim / 256) * block_bytes(up_ty);
    const float g = row_dot(gate_ty, gate + (e * ff + r) * g_rb, xq, in_dim / 256, grid);
    const float u = row_dot(up_ty, up + (e * ff + r) * u_rb, xq, in_dim / 256, grid);
    if ((threadIdx.x & 31) == 0) mid[wid] = swiglu_clamped(g, u, clamp) * weights[slot];
}

// out[r] = sum over slots of down_e(row r) · midq[slot]; one warp per output row.
extern "C" __global__ void moe_down(DS4_ARGS, const BlockQ8K* __restrict__ midq, const int* __restrict__ selected,
                                    const u8* __restrict__ down, u32 down_ty, float* __restrict__ out, u32 ff,
                                    u32 out_dim, u32 n_used, const u64* __restrict__ grid) {
    DS4_GUARD;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= out_dim) return;
    const u64 rb = (u64)(ff / 256) * block_bytes(down_ty);
    float acc = 0.0f;
    for (u32 slot = 0; slot < n_used; slot++) {
        const u64 e = (u64)selected[slot];
        acc += row_dot(down_ty, down + (e * out_dim + r) * rb, midq + (u64)slot * (ff / 256), ff / 256, grid);
    }
    if ((threadIdx.x & 31) == 0) out[r] = acc;
}
