// Router and routed experts. Activations are quantized to Q8_K (256-blocks), the mid vector is
// re-quantized before the down projection, as ds4's CPU path does. Expert weights are
// IQ2_XXS (16), Q2_K (10) or Q4_K (12), per tensor.

// One block of 256 threads computes p = sqrt(softplus(logit)); then warp 0 takes the experts
// from the hash table (by token) or the top n_used of p + bias (ties to the lower expert);
// weights p[sel] / sum * scale.
// The router's choice for a token, by one block of at least 32 threads (every thread calls it).
__device__ __forceinline__ void router_select_block(const StepParams* P, const RouterSelectArgs& a) {
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
    const u32 t = threadIdx.x, lane = t & 31;
    // Warp 0 alone selects: no block barrier per round.
    if (t >= 32) return;
    if (a.hash) {
        // A token past the table (refused on the host) or an id past the experts reads nothing.
        const u32 token = min(P->token, a.n_vocab - 1);
        if (t < n_used) sel[t] = min(max(a.hash[(u64)token * n_used + t], 0), (int)n_expert - 1);
    } else {
        // n_used rounds of a warp argmax (largest value, lower expert on ties): the order in
        // which the CPU's insertion keeps them. Lane l holds experts l, l + 32, ... (bit j of
        // `taken`: expert l + 32 j is chosen).
        u32 taken = 0;
        for (u32 k = 0; k < n_used; k++) {
            float v = -__int_as_float(0x7f800000);
            int idx = 0x7fffffff;
            for (u32 j = 0, i = lane; i < n_expert; j++, i += 32) {
                if (!((taken >> j) & 1) && (choice[i] > v || idx == 0x7fffffff)) {
                    v = choice[i];
                    idx = (int)i;
                }
            }
            warp_argmax(&v, &idx);
            if ((u32)idx % 32 == lane) taken |= 1u << ((u32)idx / 32);
            if (lane == 0) sel[k] = idx;
        }
    }
    __syncwarp();
    if (t != 0) return;
    float sum = 0.0f;
    for (u32 k = 0; k < n_used; k++) sum += probs[sel[k]];
    sum = fmaxf(sum, 6.103515625e-5f);
    for (u32 k = 0; k < n_used; k++) {
        a.selected[k] = sel[k];
        a.weights[k] = probs[sel[k]] / sum * a.scale;
    }
}

extern "C" __global__ void router_select(DS4_ARGS, RouterSelectArgs a) {
    DS4_GUARD;
    router_select_block(P, a);
}

// One block of 256 threads per 256 values. d = 1/iscale with iscale = -127/max, where max is the
// value of largest magnitude (the first one on ties).
extern "C" __global__ void quantize_q8_k(DS4_ARGS, QuantizeQ8KArgs a) {
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

// Expert weights are in the split layout (ds4_block_split): the quants of every block (64 bytes
// for IQ2_XXS and Q2_K, 128 for Q4_K), then the rest of each block (d, scales); or, with
// DS4_NATIVE_BLOCKS, in GGUF's own blocks read in place (placement unified). A lane reads 16
// quant bytes of one block (one load where they are 16-byte aligned): L = quants / 16 lanes share a block and a warp covers
// 32 / L blocks per pass. Rows that multiply the same activations (gate and up, or neighbouring
// output rows) are done by one warp, so each lane reads its share of the activations once for
// all of them. Lanes add integer sums (exact in any order); the block terms then add in the
// canonical order (row_total).
#define MOE_MAX_BLOCKS 64
#define MOE_ROWS_PER_WARP 2

// A row of an expert tensor: its first block's quants and rest (null quants: no row). An expert
// tensor is reached through its table: for each expert, where its quants and its rest start (in
// device memory, in mapped host memory, or in a slot of the expert cache: kernels/expert_cache.cu).
struct ExpertRow {
    const u8* qs;
    const u8* rest;
};
// Native layout: the table's quants entry is the expert's first block plus `at`, its rest entry
// the first block itself, and both step a whole block per block.
// `qs0` and `rest0` are the expert's table entries (its block 0).
__device__ __forceinline__ ExpertRow expert_row_at(const u8* qs0, const u8* rest0, u32 ty, u64 first_block) {
    u32 bb = 0, at = 0, nq = 0;
    ds4_block_split(ty, &bb, &at, &nq);
    ExpertRow r;
#if DS4_NATIVE_BLOCKS
    r.qs = qs0 + first_block * bb;
    r.rest = rest0 + first_block * bb;
#else
    r.qs = qs0 + first_block * nq;
    r.rest = rest0 + first_block * (bb - nq);
#endif
    return r;
}
__device__ __forceinline__ ExpertRow expert_row(const u64* table, u32 ty, u64 e, u64 first_block) {
    return expert_row_at((const u8*)table[2 * e], (const u8*)table[2 * e + 1], ty, first_block);
}
__device__ __forceinline__ ExpertRow no_row() {
    ExpertRow r;
    r.qs = 0;
    r.rest = 0;
    return r;
}

template <u32 TY> struct Layout {
    static constexpr u32 NQ = TY == 12 ? 128 : 64;                   // quant bytes per block
    static constexpr u32 RB = TY == 16 ? 2 : (TY == 10 ? 20 : 16);   // rest bytes per block
    static constexpr u32 L = NQ / 16;                                // lanes per block
    static constexpr u32 BPP = 32 / L;                               // blocks per warp pass
#if DS4_NATIVE_BLOCKS
    static constexpr u32 BB = NQ + RB;                               // GGUF's block bytes
    static constexpr u32 QS = BB, RS = BB;                           // quants / rest stride
    static constexpr u32 Q2K_D = 80;                                 // Q2_K: d, dmin from the rest
    static constexpr u32 QALIGN = TY == 16 ? 2 : (TY == 10 ? 4 : 16);  // quants' alignment
#else
    static constexpr u32 QS = NQ, RS = RB;
    static constexpr u32 Q2K_D = 16;
    static constexpr u32 QALIGN = 16;
#endif
};

// 16 quant bytes at p, aligned to A bytes (2, 4 or 16).
template <u32 A> __device__ __forceinline__ int4 load_quants16(const u8* p) {
    if (A == 16) return ds4_wld((const int4*)p);
    u32 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (A == 4) v[i] = ds4_wld((const u32*)p + i);
        else v[i] = (u32)ds4_wld((const u16*)p + 2 * i) | ((u32)ds4_wld((const u16*)p + 2 * i + 1) << 16);
    }
    return make_int4((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
}

// The IQ2_XXS kernels decode a grid entry with two byte permutes: weight j's selector nibble is
// its grid byte's code (0, 1, 2 for 8, 25, 43: the grid's only bytes) plus 4 when its sign is
// set, and picks from the 8 bytes 8, 25, 43, 0, -8, -25, -43, 0. The codes of each entry come
// from a 256-word table (code of byte j at bit 4j), the sign bits from a 128-word table of the
// sign fields or by shifts.
#define IQ2_PRMT_POS 0x002b1908u
#define IQ2_PRMT_NEG 0x00d5e7f8u

// PTX prmt: byte n of the result is byte c_n & 7 of b:a (a the low four), c_n the selector's
// nibble n (bit 3 set would replicate that byte's sign; the nibbles here never set it). Unlike
// __byte_perm it needs no mask of the selector. (scripts/emu/gen.py maps the asm to the emulator's.)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 c) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Sign field s (7 bits) and its parity bit (the count of negatives is even) at bits 4j + 2.
__device__ __forceinline__ u32 iq2_sign_nibbles(u32 s) {
    u32 x = s | (u32)(__popc(s) & 1) << 7;
    x = (x | x << 12) & 0x000f000fu;
    x = (x | x << 6) & 0x03030303u;
    x = (x | x << 3) & 0x11111111u;
    return x << 2;
}

// The two tables in shared memory, filled by the whole block (every thread must call this).
__device__ __forceinline__ void iq2_nibble_tables(const u64* grid, u32* codes, u32* signs) {
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        const u64 g = grid[i];
        u32 c = 0;
#pragma unroll
        for (u32 j = 0; j < 8; j++) {
            const u32 v = (u32)(g >> (8 * j)) & 255;
            c |= ((u32)(v > 8) + (u32)(v > 25)) << (4 * j);
        }
        codes[i] = c;
    }
    for (u32 i = threadIdx.x; i < 128; i += blockDim.x) signs[i] = iq2_sign_nibbles(i);
    __syncthreads();
}

// Grid entry l of an IQ2_XXS sub-block (words aux0, aux1) with its signs, the bytes iq2_xxs_sub
// dots: weights 0-3 in lo, 4-7 in hi. With S > 1 the tables hold S copies of each word side by
// side (iq2_tab_copies) and `codes`, `signs` point at this lane's copy. `pos` is IQ2_PRMT_POS,
// with any byte 3 (never selected).
template <bool TABLE, u32 S = 1>
__device__ __forceinline__ void iq2_xxs_entry(u32 aux0, u32 aux1, u32 l, const u32* codes, const u32* signs, u32* lo,
                                              u32* hi, u32 pos = IQ2_PRMT_POS) {
    const u32 s = (aux1 >> (7 * l)) & 127;
    u32 sel;
    if (TABLE && S == 1) {
        // Both words' byte offsets by one shift and one mask each (l is unrolled), so that the
        // sign table's base folds into the load: 2 instructions fewer per entry than by index.
        const u32 co = (l == 0 ? aux0 << 2 : aux0 >> (8 * l - 2)) & 0x3fcu;
        const u32 so = (l == 0 ? aux1 << 2 : aux1 >> (7 * l - 2)) & 0x1fcu;
        sel = *(const u32*)((const char*)codes + co) | *(const u32*)((const char*)signs + so);
    } else {
        sel = codes[((aux0 >> (8 * l)) & 255) * S] | (TABLE ? signs[s * S] : iq2_sign_nibbles(s));
    }
    *lo = prmt(pos, IQ2_PRMT_NEG, sel);
    *hi = prmt(pos, IQ2_PRMT_NEG, sel >> 16);
}

// Whether the decode kernels' IQ2_XXS signs come from the 128-word table (1) or from shifts (0).
// The table measured faster on the H200 (Flash 141.5 / 140.9 against 139.3 / 139.0 tok/s). To
// measure: DS4_CUDA_DEFINES="MOE_IQ2_SIGN_TABLE=0".
#ifndef MOE_IQ2_SIGN_TABLE
#define MOE_IQ2_SIGN_TABLE 1
#endif

// An IQ2_XXS sub-block's 8 weight words (4 grid indices in aux0; 4x7 sign bits and a 4-bit scale
// in aux1) with their signs applied, by iq2_xxs_entry, and its scale 2s + 1: the sub-block's dot
// with any activations is sum_j dp4a(w[j], q8[j]) * scale.
template <u32 S = 1>
__device__ __forceinline__ int iq2_xxs_sub_weights(u32 aux0, u32 aux1, const u32* tab, int* w, u32 pos = IQ2_PRMT_POS) {
#pragma unroll
    for (u32 l = 0; l < 4; l++) {
        u32 lo, hi;
        iq2_xxs_entry<(MOE_IQ2_SIGN_TABLE != 0), S>(aux0, aux1, l, tab, tab + 256 * S, &lo, &hi, pos);
        w[2 * l] = (int)lo;
        w[2 * l + 1] = (int)hi;
    }
    return 2 * (int)(aux1 >> 28) + 1;
}

// An IQ2_XXS sub-block (32 values) dotted with its 32 activation bytes qa, qb. The integer sum is
// exact in any order.
template <u32 S = 1>
__device__ __forceinline__ int iq2_xxs_sub(u32 aux0, u32 aux1, int4 qa, int4 qb, const u32* tab, u32 pos = IQ2_PRMT_POS) {
    const int q8[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    int w[8];
    const int scale = iq2_xxs_sub_weights<S>(aux0, aux1, tab, w, pos);
    int sumi = 0;
#pragma unroll
    for (u32 j = 0; j < 8; j++) sumi = __dp4a(w[j], q8[j], sumi);
    return sumi * scale;
}

// Byte i (0..11) of the Q4_K scales held in three words.
__device__ __forceinline__ int q4k_byte(u32 i, u32 s0, u32 s1, u32 s2) {
    const u32 w = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (int)((w >> (8 * (i & 3))) & 255);
}
// Q4_K 6-bit scale and min of sub-block j (0..8): GGUF's 12-byte packing of 6-bit values.
__device__ __forceinline__ void q4k_scale_min_w(u32 j, u32 s0, u32 s1, u32 s2, int* sc, int* m) {
    if (j < 4) {
        *sc = q4k_byte(j, s0, s1, s2) & 63;
        *m = q4k_byte(j + 4, s0, s1, s2) & 63;
    } else {
        *sc = (q4k_byte(j + 4, s0, s1, s2) & 0x0f) | ((q4k_byte(j - 4, s0, s1, s2) >> 6) << 4);
        *m = (q4k_byte(j + 4, s0, s1, s2) >> 4) | ((q4k_byte(j, s0, s1, s2) >> 6) << 4);
    }
}

// What a lane reads for part p of one block: of the weight row (16 quant bytes, and for the
// k-quants the scales its part needs), and of the activations (shared by the rows of a group).
struct WeightPart {
    int4 q;
    uint4 ex;
};
struct ActPart {
    int4 q[4];
    int4 bs;
};

template <u32 TY>
__device__ __forceinline__ WeightPart load_weight_part(const ExpertRow& row, u32 b, u32 p) {
    WeightPart w;
    w.q = load_quants16<Layout<TY>::QALIGN>(row.qs + (u64)b * Layout<TY>::QS + 16 * p);
    const u8* rest = row.rest + (u64)b * Layout<TY>::RS;
    if (TY == 10) {  // the 8 scale bytes of 128-value chunk p/2 (4-byte aligned)
        w.ex.x = ds4_wld((const u32*)(rest + 8 * (p >> 1)));
        w.ex.y = ds4_wld((const u32*)(rest + 8 * (p >> 1)) + 1);
    } else if (TY == 12) {  // d, dmin and the 12 scale bytes (16-byte aligned)
        w.ex = ds4_wld((const uint4*)rest);
    }
    return w;
}

template <u32 TY>
__device__ __forceinline__ ActPart load_act_part(const BlockQ8K* y, u32 p) {
    ActPart a;
    if (TY == 16) {  // sub-blocks 2p and 2p+1: 64 bytes
        const int4* s = (const int4*)(y->qs + 64 * p);
#pragma unroll
        for (int i = 0; i < 4; i++) a.q[i] = s[i];
    } else if (TY == 10) {  // chunk p/2, half p%2, each 2-bit plane j; the chunk's 8 sums
        const u32 c = p >> 1, h = p & 1;
#pragma unroll
        for (int j = 0; j < 4; j++) a.q[j] = *(const int4*)(y->qs + 128 * c + 32 * j + 16 * h);
        a.bs = *(const int4*)(y->bsums + 8 * c);
    } else {  // sub-blocks 2(p/2) and 2(p/2)+1, half p%2; their 4 sums
        const u32 t = p >> 1, h = p & 1;
        a.q[0] = *(const int4*)(y->qs + 64 * t + 16 * h);
        a.q[1] = *(const int4*)(y->qs + 64 * t + 32 + 16 * h);
        const int2 bs = *(const int2*)(y->bsums + 4 * t);
        a.bs = make_int4(bs.x, bs.y, 0, 0);
    }
    return a;
}

// Integer sums of one part: `isum` the scaled quant·q8 products, `summ` the scaled mins times the
// q8 sums (Q2_K / Q4_K). S: the IQ2_XXS tables' copies (iq2_xxs_entry).
template <u32 TY, u32 S = 1>
__device__ __forceinline__ void part_sums(const WeightPart& w, const ActPart& a, u32 p, const u32* tab, int* isum,
                                          int* summ, u32 pos = IQ2_PRMT_POS) {
    const u32 wv[4] = {(u32)w.q.x, (u32)w.q.y, (u32)w.q.z, (u32)w.q.w};
    if (TY == 16) {
        *isum = iq2_xxs_sub<S>(wv[0], wv[1], a.q[0], a.q[1], tab, pos) +
                iq2_xxs_sub<S>(wv[2], wv[3], a.q[2], a.q[3], tab, pos);
        *summ = 0;
    } else if (TY == 10) {
        const u32 h = p & 1;
        const int bsw[4] = {a.bs.x, a.bs.y, a.bs.z, a.bs.w};
        int is_ = 0, sm = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int q8[4] = {a.q[j].x, a.q[j].y, a.q[j].z, a.q[j].w};
            int s = 0;
#pragma unroll
            for (int t = 0; t < 4; t++) s = __dp4a((int)((wv[t] >> (2 * j)) & 0x03030303u), q8[t], s);
            const u32 k = 2 * j + h;  // the scale's index within the chunk's 8
            const int sc = (int)(((j < 2 ? w.ex.x : w.ex.y) >> (8 * (k & 3))) & 255);
            const int bsum = (int)(short)(u32)(bsw[j] >> (16 * h));
            is_ += (sc & 15) * s;
            sm += (sc >> 4) * bsum;
        }
        *isum = is_;
        *summ = sm;
    } else {
        const u32 t = p >> 1, h = p & 1;
        const int lo[4] = {a.q[0].x, a.q[0].y, a.q[0].z, a.q[0].w};
        const int hi[4] = {a.q[1].x, a.q[1].y, a.q[1].z, a.q[1].w};
        int slo = 0, shi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            slo = __dp4a((int)(wv[i] & 0x0f0f0f0fu), lo[i], slo);
            shi = __dp4a((int)((wv[i] >> 4) & 0x0f0f0f0fu), hi[i], shi);
        }
        int sc0, m0, sc1, m1;
        q4k_scale_min_w(2 * t, w.ex.y, w.ex.z, w.ex.w, &sc0, &m0);
        q4k_scale_min_w(2 * t + 1, w.ex.y, w.ex.z, w.ex.w, &sc1, &m1);
        *isum = sc0 * slo + sc1 * shi;
        const int b0 = (int)(short)(a.bs.x & 0xffff), b1 = (int)(short)((u32)a.bs.x >> 16);
        const int b2 = (int)(short)(a.bs.y & 0xffff), b3 = (int)(short)((u32)a.bs.y >> 16);
        *summ = h ? 0 : m0 * (b0 + b1) + m1 * (b2 + b3);
    }
}

// One row's integer sums of block b (its part w, loaded, times act) into is[b], sm[b]: the lanes
// of the block add theirs (exact in any order). `row`: the row exists (else the sums are 0).
template <u32 TY>
__device__ __forceinline__ void store_block_sums(const WeightPart& w, const ActPart& act, bool row, u32 b, u32 nb,
                                                 const u32* tab, int* is, int* sm) {
    typedef Layout<TY> Lay;
    const u32 part = (threadIdx.x & 31) % Lay::L;
    int a = 0, m = 0;
    if (row && b < nb) part_sums<TY>(w, act, part, tab, &a, &m);
#pragma unroll
    for (u32 o = 1; o < Lay::L; o <<= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        if (TY != 16) m += __shfl_xor_sync(0xffffffffu, m, o);  // IQ2_XXS has no mins
    }
    if (part == 0 && b < nb) {
        is[b] = a;
        if (TY != 16) sm[b] = m;
    }
}

// Integer sums of every block of G groups of R rows (the rows of group g multiply activations
// y[g]; nb blocks each) into is[g*R+k][b], sm[g*R+k][b]. U passes of every row are loaded before
// any is used.
template <u32 TY, int G, int R, int U>
__device__ __forceinline__ void rows_sums(const ExpertRow* rows, const BlockQ8K* const* y, u32 nb, const u32* tab,
                                          int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    typedef Layout<TY> Lay;
    const u32 lane = threadIdx.x & 31, part = lane % Lay::L;
    for (u32 b0 = 0; b0 < nb; b0 += U * Lay::BPP) {
        WeightPart w[G * R][U];
#pragma unroll
        for (int k = 0; k < G * R; k++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const u32 b = b0 + u * Lay::BPP + lane / Lay::L;
                if (rows[k].qs && b < nb) w[k][u] = load_weight_part<TY>(rows[k], b, part);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (b0 + u * Lay::BPP >= nb) break;  // uniform across the warp
            const u32 b = b0 + u * Lay::BPP + lane / Lay::L;
#pragma unroll
            for (int g = 0; g < G; g++) {
                bool used = false;
#pragma unroll
                for (int k = g * R; k < g * R + R; k++) used |= rows[k].qs != 0;
                ActPart act;
                if (used && b < nb) act = load_act_part<TY>(y[g] + b, part);
#pragma unroll
                for (int k = g * R; k < g * R + R; k++)
                    store_block_sums<TY>(w[k][u], act, rows[k].qs != 0, b, nb, tab, is[k], sm[k]);
            }
        }
    }
    __syncwarp();
}

// The scales row_total needs of block b: d (IQ2_XXS), or d and dmin (Q2_K, Q4_K) as two halves.
// Loaded with the quants (row_first_scales), they cost no extra round trip to memory.
template <u32 TY> __device__ __forceinline__ u32 block_scales(const u8* rest, u32 b) {
    const u16* r = (const u16*)(rest + (u64)b * Layout<TY>::RS + (TY == 10 ? Layout<TY>::Q2K_D : 0));
    if (TY == 16) return ds4_wld(r);
    return (u32)ds4_wld(r) | ((u32)ds4_wld(r + 1) << 16);
}
// Lane l's scales in the first 32-block chunk of a row (block l).
template <u32 TY> __device__ __forceinline__ u32 row_first_scales(const ExpertRow& row, u32 nb) {
    const u32 lane = threadIdx.x & 31;
    return row.qs && lane < nb ? block_scales<TY>(row.rest, lane) : 0;
}

// The dot of one row from its block sums, in the canonical order: lane l takes the term of block
// c + l of each 32-block chunk, the butterfly reduces the chunk, chunk sums add in order from +0.
// Every lane gets the result. `first` is the lane's row_first_scales.
// `yd(b)` gives activation block b's scale (row_total reads it from y; a kernel that staged the
// activations in shared memory gives its copy).
template <u32 TY, class YD>
__device__ __forceinline__ float row_total_by(const u8* rest, YD yd_of, u32 nb, const int* is, const int* sm,
                                              u32 first) {
    const u32 lane = threadIdx.x & 31;
    float total = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        float acc = 0.0f;
        const u32 b = c + lane;
        if (b < nb) {
            const u32 sc = c == 0 ? first : block_scales<TY>(rest, b);
            const float yd = yd_of(b);
            if (TY == 16) {
                acc += (h2f((u16)sc) * yd) * (float)is[b];
            } else {
                const float d = yd * h2f((u16)(sc & 0xffff)), dmin = yd * h2f((u16)(sc >> 16));
                acc += d * (float)is[b] - dmin * (float)sm[b];
            }
        }
        total += warp_sum(acc);
    }
    if (TY == 16) total = 0.125f * total;
    return total;
}
template <u32 TY>
__device__ float row_total(const u8* rest, const BlockQ8K* y, u32 nb, const int* is, const int* sm, u32 first) {
    return row_total_by<TY>(rest, [&](u32 b) { return y[b].d; }, nb, is, sm, first);
}

// The IQ2_XXS decode tables in shared memory (iq2_nibble_tables: the 256 grid entries' codes, then
// the 128 sign fields' nibbles), filled by the whole block (every thread must call this).
__device__ __forceinline__ const u32* iq2_tab(const u64* grid, bool needed) {
    __shared__ u32 tab_sh[256 + 128];
    if (needed) iq2_nibble_tables(grid, tab_sh, tab_sh + 256);
    else __syncthreads();
    return tab_sh;
}

// iq2_nibble_tables with S copies of every word side by side (word i's copy c at i * S + c), so
// that lane l reading copy l % S finds its word in bank (i * S + l % S) % 32: with S = 32 no two
// lanes of a warp meet in a bank, with 16 at most two. A warp's 32 random lookups into the single
// tables meet about 3 to 4 deep in some bank, each depth one more shared-memory wavefront.
template <u32 S>
__device__ __forceinline__ void iq2_nibble_tables_copies(const u64* grid, u32* tab) {
    __shared__ u32 one[256 + 128];
    iq2_nibble_tables(grid, one, one + 256);
    for (u32 i = threadIdx.x; i < (256 + 128) * S; i += blockDim.x) tab[i] = one[i / S];
    __syncthreads();
}

// mid[slot][r] = silu(min(gate,c)) * clamp(up,±c) * weight[slot]; one warp per (slot, two rows).
template <u32 TY, int U>
__device__ __forceinline__ void moe_gate_up_rows(const MoeGateUpArgs& a, const u32* tab, u32 wid,
                                                 int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 per_slot = a.ff / MOE_ROWS_PER_WARP;
    const u32 slot = wid / per_slot, r0 = (wid % per_slot) * MOE_ROWS_PER_WARP, nb = a.in_dim / 256;
    const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
    ExpertRow rows[2 * MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
        const u64 first = (u64)(r0 + k) * nb;
        rows[2 * k] = expert_row(a.gate, TY, e, first);
        rows[2 * k + 1] = expert_row(a.up, TY, e, first);
    }
    u32 first[2 * MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) first[k] = row_first_scales<TY>(rows[k], nb);
    const BlockQ8K* ys[1] = {a.xq};
    rows_sums<TY, 1, 2 * MOE_ROWS_PER_WARP, U>(rows, ys, nb, tab, is, sm);
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
        const float g = row_total<TY>(rows[2 * k].rest, a.xq, nb, is[2 * k], sm[2 * k], first[2 * k]);
        const float u = row_total<TY>(rows[2 * k + 1].rest, a.xq, nb, is[2 * k + 1], sm[2 * k + 1], first[2 * k + 1]);
        if ((threadIdx.x & 31) == 0) a.mid[(u64)slot * a.ff + r0 + k] = swiglu_clamped(g, u, a.clamp) * a.weights[slot];
    }
}

// The Q8_K of 256 values by one warp, exactly as quantize_q8_k makes it: lane i holds values
// i + 32k; the value of largest magnitude (lowest index on ties) sets d; the 16-value sums by
// half-warp shuffles (exact integers). `x` was written by other blocks of this launch: read
// through L2.
__device__ __forceinline__ void quantize_q8_k_warp(const float* x, BlockQ8K* o, u32 lane) {
    float v[8];
#pragma unroll
    for (u32 k = 0; k < 8; k++) v[k] = __ldcg(x + lane + 32 * k);
    float am = -1.0f, mv = 0.0f;
    int idx = 0;
#pragma unroll
    for (u32 k = 0; k < 8; k++)
        if (fabsf(v[k]) > am) {
            am = fabsf(v[k]);
            mv = v[k];
            idx = (int)(lane + 32 * k);
        }
    warp_argmax(&am, &idx);
    const float winner = __shfl_sync(0xffffffffu, mv, (u32)idx % 32);
    const float maxv = am == 0.0f ? 0.0f : winner;
    const float iscale = maxv == 0.0f ? 0.0f : -127.0f / maxv;
#pragma unroll
    for (u32 k = 0; k < 8; k++) {
        const int q = maxv == 0.0f ? 0 : max(-128, min(127, (int)rintf(iscale * v[k])));
        o->qs[lane + 32 * k] = (i8)q;
        int sum = q;
        for (u32 off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if ((lane & 15) == 0) o->bsums[2 * k + (lane >> 4)] = (i16)sum;
    }
    if (lane == 0) o->d = maxv == 0.0f ? 0.0f : 1.0f / iscale;
}

// With `midq`, the mid vector's Q8_K for the down kernel too: a slot's rows are whole blocks (the
// plan asks ff % 16 == 0), and the last of a slot's blocks to finish (a ticket per slot)
// quantizes that slot's ff values, a warp per 256.
__device__ __forceinline__ void moe_gate_up_mid_q8_k(const MoeGateUpArgs& a) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    const u32 per_slot = gridDim.x / a.n_used, slot = blockIdx.x / per_slot;
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket + slot, 1u) == per_slot - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const u32 lane = threadIdx.x & 31, nb = a.ff / 256;
    for (u32 blk = threadIdx.x >> 5; blk < nb; blk += blockDim.x >> 5)
        quantize_q8_k_warp(a.mid + (u64)slot * a.ff + blk * 256, a.midq + (u64)slot * nb + blk, lane);
    if (threadIdx.x == 0) a.tickets[a.ticket + slot] = 0;
}

extern "C" __global__ void moe_gate_up(DS4_ARGS, MoeGateUpArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u32* tab = iq2_tab(a.grid, a.gate_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + warp;
    // gate and up have one type (checked by the planner); IQ2_XXS goes to moe_gate_up_iq2_xxs.
    if (wid < a.n_used * (a.ff / MOE_ROWS_PER_WARP)) {
        if (a.gate_ty == 16) moe_gate_up_rows<16, 1>(a, tab, wid, is_sh[warp], sm_sh[warp]);
        else if (a.gate_ty == 10) moe_gate_up_rows<10, 1>(a, tab, wid, is_sh[warp], sm_sh[warp]);
        else moe_gate_up_rows<12, 1>(a, tab, wid, is_sh[warp], sm_sh[warp]);
    }
    if (a.midq) moe_gate_up_mid_q8_k(a);
}

// Passes of 8 blocks whose loads are issued together (2 cover a 4096-wide row in one round trip to
// memory, but take 102 registers instead of 80: measured slower on the H200, 33.5 against 28.1 us).
#ifndef MOE_GATE_UP_PASSES
#define MOE_GATE_UP_PASSES 1
#endif

// The same for IQ2_XXS alone (the Flash experts), in its own kernel: without the k-quant paths
// it needs fewer registers, so 3 blocks of 256 fit on an SM instead of 2 (these loads are
// latency-bound: ncu showed long-scoreboard stalls and 23% of the warps active; 32.6 -> 26.2 us
// on the H200). A bound of 4 blocks (64 registers, spilled) measured slower: Flash 137.1 against
// 141.5 tok/s.
//
// The launch has gridDim.x / n_used blocks per slot (plan.rs moe_gate_up_tasks gives two tasks
// per warp): a warp takes tasks (two rows of gate and up) of its slot in turn and loads the next
// pass's weights (the next task's first pass at a task's end) before it decodes this one's. The
// decode tables are built before waiting for the previous kernel (they are constant); the selected
// expert is read after. Each row's integer block sums and row_total are the one-task-per-warp
// kernel's: the same bits. H200, ncu on flash-4l: 27.7 us a launch before, 28.8 with one task a
// warp, 26.5 with two.
// Blocks per SM the registers are capped for.
#ifndef MOE_GU_MIN_BLOCKS
#define MOE_GU_MIN_BLOCKS 3
#endif
// Copies of the decode tables (iq2_nibble_tables_copies): 1, or 16 (24 KB) to spread the lookups
// over the banks (DS4_CUDA_DEFINES="MOE_IQ2_TAB_COPIES=16"). Measured slower on the H100: bank
// conflicts 1.57M -> 0.80M a launch, but 13% more instructions, 27.7 -> 29.3 us (ncu); flash-4l
// 1129 -> 1115 tok/s. The shared-memory pipe is not what binds this kernel.
#ifndef MOE_IQ2_TAB_COPIES
#define MOE_IQ2_TAB_COPIES 1
#endif
// Whether the block copies the activations' Q8_K into shared memory once (after the first pass's
// weight loads are issued), so that each pass reads them by LDS instead of a global load it waits
// on at once (1), or reads them from global memory each pass (0).
#ifndef MOE_GU_ACT_SHARED
#define MOE_GU_ACT_SHARED 1
#endif

// The activations' quants as moe_gate_up_iq2_xxs stages them: block b's 16-byte piece (chunk i of
// part p, load_act_part's a.q[i]) at int4 b * 16 + ((i + b) & 3) * 4 + p, so that the 8 lanes of a
// quarter warp (two neighbouring blocks, four parts) read 8 different 16-byte bank groups.
__device__ __forceinline__ u32 act_sh_index(u32 b, u32 i, u32 p) {
    return b * 16 + ((i + b) & 3) * 4 + p;
}

extern "C" __global__ void __launch_bounds__(256, MOE_GU_MIN_BLOCKS) moe_gate_up_iq2_xxs(DS4_ARGS, MoeGateUpArgs a) {
    DS4_GUARD_EARLY;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    constexpr u32 S = MOE_IQ2_TAB_COPIES;
#if MOE_IQ2_TAB_COPIES > 1
    __shared__ u32 tab_copies[(256 + 128) * S];
    iq2_nibble_tables_copies<S>(a.grid, tab_copies);
    const u32* tab = tab_copies + (threadIdx.x & 31) % S;
#else
    const u32* tab = iq2_tab(a.grid, true);
#endif
    ds4_wait_predecessor(cond);
    typedef Layout<16> Lay;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = lane % Lay::L;
    // The decode's positive bytes held in a register rather than copied in before each permute
    // (a value that differs per thread is not rematerialized). Byte 3 is never selected: the
    // codes are 0 to 2.
    const u32 pos = IQ2_PRMT_POS | threadIdx.x << 24;
    const u32 per_slot = gridDim.x / a.n_used, slot = blockIdx.x / per_slot;
    const u32 tasks = a.ff / MOE_ROWS_PER_WARP, stride = per_slot * (blockDim.x >> 5);
    const u32 nb = a.in_dim / 256, passes = (nb + Lay::BPP - 1) / Lay::BPP;
    const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
    const u8* gq = (const u8*)a.gate[2 * e];
    const u8* gr = (const u8*)a.gate[2 * e + 1];
    const u8* uq = (const u8*)a.up[2 * e];
    const u8* ur = (const u8*)a.up[2 * e + 1];
    int(*is)[MOE_MAX_BLOCKS] = is_sh[warp];
    // Row k of task t: gate then up of rows 2t and 2t + 1.
    auto row_of = [&](u32 t, int k) {
        const u64 first = (u64)(t * MOE_ROWS_PER_WARP + (k >> 1)) * nb;
        return (k & 1) ? expert_row_at(uq, ur, 16, first) : expert_row_at(gq, gr, 16, first);
    };
    u32 t = (blockIdx.x % per_slot) * (blockDim.x >> 5) + warp, p = 0;
    WeightPart cur[2 * MOE_ROWS_PER_WARP];
    if (t < tasks) {
#pragma unroll
        for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++)
            if (lane / Lay::L < nb) cur[k] = load_weight_part<16>(row_of(t, k), lane / Lay::L, part);
    }
#if MOE_GU_ACT_SHARED
    __shared__ int4 act_q[MOE_MAX_BLOCKS * 16];
    __shared__ float act_d[MOE_MAX_BLOCKS];
    for (u32 j = threadIdx.x; j < nb * 16; j += blockDim.x) {
        const u32 b = j / 16, q = j % 16;
        act_q[act_sh_index(b, q % 4, q / 4)] = *(const int4*)(a.xq[b].qs + 16 * q);
    }
    for (u32 b = threadIdx.x; b < nb; b += blockDim.x) act_d[b] = a.xq[b].d;
    __syncthreads();
#endif
    while (t < tasks) {
        const bool task_end = p + 1 == passes;
        const u32 nt = task_end ? t + stride : t, np = task_end ? 0 : p + 1;
        const u32 b = p * Lay::BPP + lane / Lay::L, nbk = np * Lay::BPP + lane / Lay::L;
        // The task's first block scales for row_total, loaded while its last pass decodes.
        u32 first[2 * MOE_ROWS_PER_WARP];
        if (task_end) {
#pragma unroll
            for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) first[k] = row_first_scales<16>(row_of(t, k), nb);
        }
        WeightPart nxt[2 * MOE_ROWS_PER_WARP];
        if (nt < tasks) {
#pragma unroll
            for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++)
                if (nbk < nb) nxt[k] = load_weight_part<16>(row_of(nt, k), nbk, part);
        }
        ActPart act;
#if MOE_GU_ACT_SHARED
        if (b < nb) {
#pragma unroll
            for (u32 i = 0; i < 4; i++) act.q[i] = act_q[act_sh_index(b, i, part)];
        }
#else
        if (b < nb) act = load_act_part<16>(a.xq + b, part);
#endif
#pragma unroll
        for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) {
            int s = 0, m = 0;
            if (b < nb) part_sums<16, S>(cur[k], act, part, tab, &s, &m, pos);
#pragma unroll
            for (u32 o = 1; o < Lay::L; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (part == 0 && b < nb) is[k][b] = s;
        }
        if (task_end) {
            __syncwarp();
#if MOE_GU_ACT_SHARED
            const auto yd = [&](u32 b) { return act_d[b]; };
#else
            const auto yd = [&](u32 b) { return a.xq[b].d; };
#endif
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const float g = row_total_by<16>(row_of(t, 2 * k).rest, yd, nb, is[2 * k], is[2 * k], first[2 * k]);
                const float u =
                    row_total_by<16>(row_of(t, 2 * k + 1).rest, yd, nb, is[2 * k + 1], is[2 * k + 1], first[2 * k + 1]);
                if (lane == 0)
                    a.mid[(u64)slot * a.ff + t * MOE_ROWS_PER_WARP + k] = swiglu_clamped(g, u, a.clamp) * a.weights[slot];
            }
            __syncwarp();
        }
#pragma unroll
        for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) cur[k] = nxt[k];
        t = nt;
        p = np;
    }
    if (a.midq) moe_gate_up_mid_q8_k(a);
}

// out[r] = sum over slots (in order, from +0) of down_e(row r) · midq[slot]; one warp per two
// rows, two slots' rows loaded together.
template <u32 TY>
__device__ __forceinline__ void moe_down_rows(const MoeDownArgs& a, const BlockQ8K* midq, const u32* tab, u32 r0,
                                              int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 nb = a.ff / 256;
    float acc[MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) acc[k] = 0.0f;
    for (u32 s0 = 0; s0 < a.n_used; s0 += 2) {
        ExpertRow rows[2 * MOE_ROWS_PER_WARP];
        const BlockQ8K* ys[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const u32 slot = s0 + g;
            ys[g] = midq + (u64)min(slot, a.n_used - 1) * nb;
            const u64 e = slot < a.n_used ? (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1) : 0;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const u32 r = r0 + k;
                rows[g * MOE_ROWS_PER_WARP + k] =
                    slot < a.n_used && r < a.out_dim ? expert_row(a.down, TY, e, (u64)r * nb) : no_row();
            }
        }
        rows_sums<TY, 2, MOE_ROWS_PER_WARP, 1>(rows, ys, nb, tab, is, sm);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            if (s0 + g >= a.n_used) break;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const int i = g * MOE_ROWS_PER_WARP + k;
                if (rows[i].qs)
                    acc[k] += row_total<TY>(rows[i].rest, ys[g], nb, is[i], sm[i], row_first_scales<TY>(rows[i], nb));
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++)
        if ((threadIdx.x & 31) == 0 && r0 + k < a.out_dim) a.out[r0 + k] = acc[k];
}

// Activation blocks (all slots' mid Q8_K) that moe_down copies into shared memory before its rows
// when they fit (0: every warp reads them from global memory, through L1). Each warp reads every
// slot's activations for its two rows: about twice the bytes of its weights.
#ifndef MOE_DOWN_ACT_SHARED
#define MOE_DOWN_ACT_SHARED 0
#endif

extern "C" __global__ void moe_down(DS4_ARGS, MoeDownArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u32* tab = iq2_tab(a.grid, a.down_ty == 16);
    const BlockQ8K* midq = a.midq;
#if MOE_DOWN_ACT_SHARED
    __shared__ BlockQ8K mid_sh[MOE_DOWN_ACT_SHARED];
    const u32 n = a.n_used * (a.ff / 256);
    if (n <= MOE_DOWN_ACT_SHARED) {
        constexpr u32 W = sizeof(BlockQ8K) / 16;
        for (u32 j = threadIdx.x; j < n * W; j += blockDim.x) ((int4*)mid_sh)[j] = ((const int4*)a.midq)[j];
        __syncthreads();
        midq = mid_sh;
    }
#endif
    const u32 warp = threadIdx.x >> 5;
    const u32 r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * MOE_ROWS_PER_WARP;
    if (r0 >= a.out_dim) return;
    if (a.down_ty == 16) moe_down_rows<16>(a, midq, tab, r0, is_sh[warp], sm_sh[warp]);
    else if (a.down_ty == 10) moe_down_rows<10>(a, midq, tab, r0, is_sh[warp], sm_sh[warp]);
    else moe_down_rows<12>(a, midq, tab, r0, is_sh[warp], sm_sh[warp]);
}

// The Q2_K down of rows of at most one pass (ff <= 2048: the Flash experts) in a kernel of its
// own. Each warp's two rows of a slot pair are loaded while the pair before is summed, and the
// first pair's before the PDL wait: the selected experts come from the router, which completed
// before the gate/up launch before this one passed its own wait, and this launch starts only after
// that (so not with DS4_PDL_TRIGGER, which lets it start earlier). moe_down took ~15 us on the
// critical path for 16.6 MB, a pair's loads at a time (this one 13.4, H100). Each slot's integer
// sums and row_total are moe_down_rows' and the slots add in the same order: the same bits.
// The default for such rows (plan.rs; `DS4_CUDA_MOE_DOWN=rows` keeps moe_down): BENCHMARKS, 36th
// to 38th sessions.
#ifndef MOE_DOWN_MIN_BLOCKS
#define MOE_DOWN_MIN_BLOCKS 2
#endif
// Whether each warp also asks L2 for its rows of the slots after the first pair before the PDL
// wait (1: prefetch.global.L2, 2: with evict_last; 0: none): its blocks become resident while
// gate/up's last blocks run, which leave the bus mostly idle. Hints only: the same bits.
#ifndef MOE_DOWN_PREFETCH
#define MOE_DOWN_PREFETCH 0
#endif
struct DownPair {
    WeightPart w[2 * MOE_ROWS_PER_WARP];
    u32 first[2 * MOE_ROWS_PER_WARP];
};
extern "C" __global__ void __launch_bounds__(256, MOE_DOWN_MIN_BLOCKS) moe_down_q2_k(DS4_ARGS, MoeDownArgs a) {
    DS4_GUARD_EARLY;
    typedef Layout<10> Lay;
    constexpr int RW = MOE_ROWS_PER_WARP;
    __shared__ int is_sh[8][2 * RW][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * RW][MOE_MAX_BLOCKS];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = lane % Lay::L, b = lane / Lay::L;
    const u32 r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * RW, nb = a.ff / 256;
    int(*is)[MOE_MAX_BLOCKS] = is_sh[warp];
    int(*sm)[MOE_MAX_BLOCKS] = sm_sh[warp];
    // The rows of slots s0 and s0 + 1 (empty rows past the slots or the outputs), their parts and
    // first scales loaded.
    auto load_pair = [&](u32 s0, DownPair* p) {
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const u32 s = s0 + g;
            const u8 *qs0 = nullptr, *rest0 = nullptr;
            if (s < a.n_used) {
                const u64 e = (u64)min(max(__ldcg(a.selected + s), 0), (int)a.n_expert - 1);
                qs0 = (const u8*)__ldcg(a.down + 2 * e);
                rest0 = (const u8*)__ldcg(a.down + 2 * e + 1);
            }
#pragma unroll
            for (int k = 0; k < RW; k++) {
                const bool row = s < a.n_used && r0 + k < a.out_dim;
                const ExpertRow r = row ? expert_row_at(qs0, rest0, 10, (u64)(r0 + k) * nb) : no_row();
                if (r.qs && b < nb) p->w[g * RW + k] = load_weight_part<10>(r, b, part);
                p->first[g * RW + k] = row_first_scales<10>(r, nb);
            }
        }
    };
    DownPair cur;
    const bool live = r0 < a.out_dim;
#if !DS4_PDL_TRIGGER
    if (live) load_pair(0, &cur);
#if MOE_DOWN_PREFETCH
    // Every (slot, row) past the first pair: its quants (nb * QS bytes) and rests (nb * RS).
    for (u32 s = 2; live && s < a.n_used; s++) {
        const u64 e = (u64)min(max(__ldcg(a.selected + s), 0), (int)a.n_expert - 1);
        const u8* qs0 = (const u8*)__ldcg(a.down + 2 * e);
        const u8* rest0 = (const u8*)__ldcg(a.down + 2 * e + 1);
        for (int k = 0; k < RW; k++) {
            if (r0 + k >= a.out_dim) break;
            const ExpertRow r = expert_row_at(qs0, rest0, 10, (u64)(r0 + k) * nb);
            ds4_prefetch_span_l2<MOE_DOWN_PREFETCH == 2>(r.qs, nb * Lay::QS, lane);
            ds4_prefetch_span_l2<MOE_DOWN_PREFETCH == 2>(r.rest, nb * Lay::RS, lane);
        }
    }
#endif
#endif
    ds4_wait_predecessor(cond);
    if (!live) return;
#if DS4_PDL_TRIGGER
    load_pair(0, &cur);
#endif
    float acc[RW];
#pragma unroll
    for (int k = 0; k < RW; k++) acc[k] = 0.0f;
    for (u32 s0 = 0; s0 < a.n_used; s0 += 2) {
        DownPair nxt;
        if (s0 + 2 < a.n_used) load_pair(s0 + 2, &nxt);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const bool slot = s0 + g < a.n_used;
            ActPart act;
            if (slot && b < nb) act = load_act_part<10>(a.midq + (u64)(s0 + g) * nb + b, part);
#pragma unroll
            for (int k = g * RW; k < g * RW + RW; k++)
                store_block_sums<10>(cur.w[k], act, slot && r0 + (k - g * RW) < a.out_dim, b, nb, nullptr, is[k], sm[k]);
        }
        __syncwarp();
#pragma unroll
        for (int g = 0; g < 2; g++) {
            if (s0 + g >= a.n_used) break;
            const BlockQ8K* y = a.midq + (u64)(s0 + g) * nb;
#pragma unroll
            for (int k = 0; k < RW; k++) {
                const int i = g * RW + k;
                if (r0 + k < a.out_dim) acc[k] += row_total<10>(nullptr, y, nb, is[i], sm[i], cur.first[i]);
            }
        }
        __syncwarp();
        cur = nxt;
    }
#pragma unroll
    for (int k = 0; k < RW; k++)
        if (lane == 0 && r0 + k < a.out_dim) a.out[r0 + k] = acc[k];
}

#if DS4_CHUNK_ROWS
// The chunk build runs the routed experts grouped by expert, as the CPU's `moe_experts_rows`
// does: moe_route lists each expert's (row, slot) pairs, then a warp of gate/up or down takes its
// weight rows of one expert for every pair that chose it. The expert's weights come from DRAM once
// per chunk (the pairs after the first find them in L1 or L2), not once per row that chose it; the
// IQ2_XXS gate/up also decodes each weight sub-block once for two pairs. Each pair gets the decode
// kernels' integer block sums and their float order (row_total), and moe_sum_slots adds a row's
// slots in slot order from +0 as moe_down_rows does. The launches take no blockIdx.y: they find
// each row's pointers through ds4_row. scripts/moe-emulate checks them against the per-row
// kernels on the host.

// The pairs one routing block holds (plan.rs MOE_ROUTE_MAX_PAIRS); at most 1024 experts. Their
// experts are 16-bit in shared memory, so that a chunk of 2048 rows x 6 used fits the 48 KB of
// static shared memory (with int, chunks past 1365 rows fell back to the per-row kernels: 4x slower).
#define MOE_ROUTE_MAX_PAIRS 16384

// One block of 1024 threads writes `route`: counts[n_expert], starts[n_expert], then the pairs
// p = row * n_used + slot grouped by expert, ascending within an expert. Rows whose predicate is
// false (past the chunk's tokens) have none; expert ids are clamped as the decode kernels clamp
// them. Counts are integers (exact in any order); the order of the pairs is fixed by the scan.
//
// The pairs of each expert are placed by warp 0 walking them in order, 32 at a time (a lane's place
// is its expert's next free one plus its rank among the tile's lanes of that expert), in place of
// a thread per expert scanning every pair (MOE_ROUTE_SERIAL=1 keeps that, to measure).
#ifndef MOE_ROUTE_SERIAL
#define MOE_ROUTE_SERIAL 0
#endif
__device__ __forceinline__ void moe_route_block(const StepParams* P, u64 cond, const RowStrides& R, const MoeRouteArgs& a,
                                                bool serial) {
    __shared__ i16 ex[MOE_ROUTE_MAX_PAIRS];
    __shared__ u32 count[1024], start[1024];
    const u32 t = threadIdx.x, n_expert = a.n_expert, n_pairs = a.rows * a.n_used;
    for (u32 e = t; e < n_expert; e += blockDim.x) count[e] = 0;
    for (u32 p = t; p < n_pairs; p += blockDim.x) {
        const u32 y = p / a.n_used;
        int e = -1;
        if (ds4_cond(P + y, cond)) {
            MoeRouteArgs ay = a;
            ds4_row(ay, R, y);
            e = min(max(ay.selected[p % a.n_used], 0), (int)n_expert - 1);
        }
        ex[p] = (i16)e;
    }
    __syncthreads();
    for (u32 p = t; p < n_pairs; p += blockDim.x)
        if (ex[p] >= 0) atomicAdd(&count[ex[p]], 1u);
    __syncthreads();
    // Exclusive prefix sum of the counts by warp 0, lane l over a run of experts.
    if (t < 32) {
        const u32 per = (n_expert + 31) / 32, lo = min(t * per, n_expert), hi = min(lo + per, n_expert);
        u32 sum = 0;
        for (u32 e = lo; e < hi; e++) sum += count[e];
        u32 incl = sum;
        for (u32 o = 1; o < 32; o <<= 1) {
            const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
            if (t >= o) incl += v;
        }
        u32 at = incl - sum;
        for (u32 e = lo; e < hi; e++) {
            start[e] = at;
            at += count[e];
        }
    }
    __syncthreads();
    u32* pairs = a.route + 2 * n_expert;
    if (serial) {
        for (u32 e = t; e < n_expert; e += blockDim.x) {
            const u32 n = count[e], s = start[e];
            // Exactly n pairs name e: the scan stops at the last.
            for (u32 q = 0, k = 0; k < n; q++)
                if (ex[q] == (int)e) pairs[s + k++] = q;
            a.route[e] = n;
            a.route[n_expert + e] = s;
        }
        return;
    }
    for (u32 e = t; e < n_expert; e += blockDim.x) {
        a.route[e] = count[e];
        a.route[n_expert + e] = start[e];
    }
    __syncthreads();
    // start[e] becomes expert e's next free place.
    if (t < 32) {
        for (u32 q0 = 0; q0 < n_pairs; q0 += 32) {
            const u32 q = q0 + t;
            const int e = q < n_pairs ? ex[q] : -1;
            const u32 peers = __match_any_sync(0xffffffffu, e);
            if (e >= 0) pairs[start[e] + __popc(peers & ((1u << t) - 1))] = q;
            __syncwarp();
            // The group's highest lane moves its expert's next place past the group.
            if (e >= 0 && peers >> t == 1) start[e] += __popc(peers);
            __syncwarp();
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_route(DS4_ARGS, MoeRouteArgs a) {
    ds4_wait_predecessor(cond);
    moe_route_block(P, cond, R, a, MOE_ROUTE_SERIAL);
}

// Expert e's pairs: (count, the first of them).
__device__ __forceinline__ u32 moe_route_pairs(const u32* route, u32 n_expert, u32 e, const u32** pairs) {
    *pairs = route + 2 * n_expert + route[n_expert + e];
    return route[e];
}

// The decode kernel's arguments as chunk row y sees them.
__device__ __forceinline__ MoeGateUpArgs moe_gate_up_row_args(const MoeGateUpGroupedArgs& a, const RowStrides& R,
                                                              u32 y) {
    MoeGateUpGroupedArgs ay = a;
    ds4_row(ay, R, y);
    MoeGateUpArgs b;
    b.xq = ay.xq;
    b.selected = ay.selected;
    b.weights = ay.weights;
    b.gate = a.gate;
    b.up = a.up;
    b.mid = ay.mid;
    b.grid = a.grid;
    b.midq = 0;
    b.tickets = 0;
    b.gate_ty = a.gate_ty;
    b.up_ty = a.gate_ty;
    b.in_dim = a.in_dim;
    b.ff = a.ff;
    b.n_used = a.n_used;
    b.n_expert = a.n_expert;
    b.clamp = a.clamp;
    b.ticket = 0;
    return b;
}

// Warp w of expert e: mid rows 2w, 2w + 1 of every pair that chose e, each computed by
// moe_gate_up_rows as the decode kernel's warp (slot, rows 2w, 2w + 1) of the pair's row does.
template <u32 TY, int U>
__device__ __forceinline__ void moe_gate_up_pairs(const MoeGateUpGroupedArgs& a, const RowStrides& R, const u32* tab,
                                                  u32 e, u32 w, int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i = 0; i < n; i++) {
        const u32 p = pairs[i];
        const MoeGateUpArgs b = moe_gate_up_row_args(a, R, p / a.n_used);
        moe_gate_up_rows<TY, U>(b, tab, (p % a.n_used) * (a.ff / MOE_ROWS_PER_WARP) + w, is, sm);
        __syncwarp();  // the next pair rewrites is and sm
    }
}

// Blocks go (row block, expert): blockIdx.x = rb * n_expert + e, so the blocks of an expert that
// many rows chose are spread over the launch instead of coming last. A block of an expert no row
// chose leaves at once (the whole block: before any barrier).
extern "C" __global__ void moe_gate_up_grouped(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor(cond);
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u32* tab = iq2_tab(a.grid, a.gate_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 w = blockIdx.x / a.n_expert * (blockDim.x >> 5) + warp;
    if (w >= a.ff / MOE_ROWS_PER_WARP) return;
    if (a.gate_ty == 16) moe_gate_up_pairs<16, 1>(a, R, tab, e, w, is_sh[warp], sm_sh[warp]);
    else if (a.gate_ty == 10) moe_gate_up_pairs<10, 1>(a, R, tab, e, w, is_sh[warp], sm_sh[warp]);
    else moe_gate_up_pairs<12, 1>(a, R, tab, e, w, is_sh[warp], sm_sh[warp]);
}

// Pairs that moe_gate_up_grouped_iq2_xxs decodes each weight sub-block once for, and the blocks
// per SM its registers must allow: 2 pairs fit the 80 registers of 3 blocks (as
// moe_gate_up_iq2_xxs) without spilling; 3 or more spill unless the blocks go down to 2.
#ifndef MOE_PAIR_BATCH
#define MOE_PAIR_BATCH 2
#endif
#ifndef MOE_PAIR_MIN_BLOCKS
#define MOE_PAIR_MIN_BLOCKS 3
#endif

// row_total for IQ2_XXS rows of at most 32 blocks, from lane l's block sum `is` (block l).
__device__ __forceinline__ float iq2_xxs_row_total(const u8* rest, const BlockQ8K* y, u32 nb, int is) {
    const u32 lane = threadIdx.x & 31;
    float total = 0.0f;
    float acc = 0.0f;
    if (lane < nb) acc += (h2f((u16)block_scales<16>(rest, lane)) * y[lane].d) * (float)is;
    total += warp_sum(acc);
    return 0.125f * total;
}

// Warp w of expert e, IQ2_XXS rows of at most 32 blocks: mid rows 2w, 2w + 1 of every pair that
// chose e, MOE_PAIR_BATCH pairs at a time. The weight decode (grid lookups and signs: most of the
// instructions of this instruction-bound kernel) is done once per batch: a lane decodes a
// sub-block of each of the four rows and dots it with each pair's activations. The block sums are
// moe_gate_up_rows' integers (exact in any order); lane l keeps block l's, and each row's dot adds
// them as row_total does (one 32-block chunk: the lane's term from +0, the butterfly, times 1/8).
__device__ __forceinline__ void moe_gate_up_pairs_iq2_xxs(const MoeGateUpGroupedArgs& a, const RowStrides& R,
                                                          const u32* tab, u32 e, u32 w) {
    constexpr int PB = MOE_PAIR_BATCH;
    typedef Layout<16> Lay;
    const u32 lane = threadIdx.x & 31, part = lane % Lay::L, nb = a.in_dim / 256, r0 = w * MOE_ROWS_PER_WARP;
    // gate r0, up r0, gate r0 + 1, up r0 + 1, as moe_gate_up_rows orders them.
    ExpertRow rows[2 * MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
        rows[2 * k] = expert_row(a.gate, 16, e, (u64)(r0 + k) * nb);
        rows[2 * k + 1] = expert_row(a.up, 16, e, (u64)(r0 + k) * nb);
    }
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += PB) {
        // Each pair's activations (a missing last pair repeats the one before, unused).
        const BlockQ8K* ys[PB];
#pragma unroll
        for (int q = 0; q < PB; q++) {
            MoeGateUpGroupedArgs ay = a;
            ds4_row(ay, R, pairs[min(i0 + q, n - 1)] / a.n_used);
            ys[q] = ay.xq;
        }
        int is[PB][2 * MOE_ROWS_PER_WARP];
#pragma unroll
        for (int q = 0; q < PB; q++)
#pragma unroll
            for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) is[q][k] = 0;
        for (u32 b0 = 0; b0 < nb; b0 += Lay::BPP) {
            const u32 b = b0 + lane / Lay::L;
            int4 wq[2 * MOE_ROWS_PER_WARP];
#pragma unroll
            for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++)
                wq[k] = b < nb ? load_quants16<Lay::QALIGN>(rows[k].qs + (u64)b * Lay::QS + 16 * part)
                               : make_int4(0, 0, 0, 0);
            int sum[PB][2 * MOE_ROWS_PER_WARP];
#pragma unroll
            for (int q = 0; q < PB; q++)
#pragma unroll
                for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) sum[q][k] = 0;
            // The lane's two sub-blocks (part_sums: 2 part and 2 part + 1).
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int4 x[PB][2];
#pragma unroll
                for (int q = 0; q < PB; q++) {
                    x[q][0] = x[q][1] = make_int4(0, 0, 0, 0);
                    if (i0 + q < n && b < nb) {
                        const int4* s = (const int4*)(ys[q][b].qs + 64 * part + 32 * h);
                        x[q][0] = s[0];
                        x[q][1] = s[1];
                    }
                }
#pragma unroll
                for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) {
                    int wd[8];
                    const int sc = iq2_xxs_sub_weights(h ? (u32)wq[k].z : (u32)wq[k].x,
                                                       h ? (u32)wq[k].w : (u32)wq[k].y, tab, wd);
#pragma unroll
                    for (int q = 0; q < PB; q++) {
                        const int xs[8] = {x[q][0].x, x[q][0].y, x[q][0].z, x[q][0].w,
                                           x[q][1].x, x[q][1].y, x[q][1].z, x[q][1].w};
                        int s = 0;
#pragma unroll
                        for (int j = 0; j < 8; j++) s = __dp4a(wd[j], xs[j], s);
                        sum[q][k] += s * sc;
                    }
                }
            }
            // A block's sum from its L lanes; block b0 + j's then goes to lane b0 + j.
#pragma unroll
            for (int q = 0; q < PB; q++) {
                if (i0 + q >= n) break;  // uniform: a batch short of pairs
#pragma unroll
                for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) {
                    int v = sum[q][k];
#pragma unroll
                    for (u32 o = 1; o < Lay::L; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    v = __shfl_sync(0xffffffffu, v, ((lane - b0) * Lay::L) & 31);
                    if (lane - b0 < Lay::BPP) is[q][k] = v;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < PB; q++) {
            if (i0 + q >= n) break;
            const u32 p = pairs[i0 + q], slot = p % a.n_used;
            MoeGateUpGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const float g = iq2_xxs_row_total(rows[2 * k].rest, ys[q], nb, is[q][2 * k]);
                const float u = iq2_xxs_row_total(rows[2 * k + 1].rest, ys[q], nb, is[q][2 * k + 1]);
                if (lane == 0) ay.mid[(u64)slot * a.ff + r0 + k] = swiglu_clamped(g, u, a.clamp) * ay.weights[slot];
            }
        }
    }
}

// IQ2_XXS alone (the Flash experts): rows of at most 32 blocks decode each weight sub-block once
// per batch of pairs; wider rows take moe_gate_up_pairs, a pair at a time.
extern "C" __global__ void __launch_bounds__(256, MOE_PAIR_MIN_BLOCKS) moe_gate_up_grouped_iq2_xxs(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor(cond);
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u32* tab = iq2_tab(a.grid, true);
    const u32 warp = threadIdx.x >> 5;
    const u32 w = blockIdx.x / a.n_expert * (blockDim.x >> 5) + warp;
    if (w >= a.ff / MOE_ROWS_PER_WARP) return;
    if (a.in_dim <= 256 * DS4_BLOCK_CHUNK) moe_gate_up_pairs_iq2_xxs(a, R, tab, e, w);
    else moe_gate_up_pairs<16, MOE_GATE_UP_PASSES>(a, R, tab, e, w, is_sh[warp], sm_sh[warp]);
}

// Expert e's down rows r0, r0 + 1 for every pair that chose it, into parts[slot] of the pair's
// row: two pairs at a time, as moe_down_rows takes two slots (the second pair loads the same
// weight rows again, from L1). Each row's dot is row_total's over the same integer block sums.
template <u32 TY>
__device__ __forceinline__ void moe_down_pairs(const MoeDownGroupedArgs& a, const RowStrides& R, const u32* tab, u32 e,
                                               u32 r0, int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 nb = a.ff / 256;
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i = 0; i < n; i += 2) {
        ExpertRow rows[2 * MOE_ROWS_PER_WARP];
        const BlockQ8K* ys[2];
        float* parts[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const u32 p = pairs[min(i + g, n - 1)], slot = p % a.n_used;
            MoeDownGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
            ys[g] = ay.midq + (u64)slot * nb;
            parts[g] = ay.parts + (u64)slot * a.out_dim;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const u32 r = r0 + k;
                rows[g * MOE_ROWS_PER_WARP + k] =
                    i + g < n && r < a.out_dim ? expert_row(a.down, TY, e, (u64)r * nb) : no_row();
            }
        }
        rows_sums<TY, 2, MOE_ROWS_PER_WARP, 1>(rows, ys, nb, tab, is, sm);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            if (i + g >= n) break;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const int j = g * MOE_ROWS_PER_WARP + k;
                if (rows[j].qs) {
                    const float t = row_total<TY>(rows[j].rest, ys[g], nb, is[j], sm[j], row_first_scales<TY>(rows[j], nb));
                    if ((threadIdx.x & 31) == 0) parts[g][r0 + k] = t;
                }
            }
        }
        __syncwarp();  // the next pairs rewrite is and sm
    }
}

extern "C" __global__ void moe_down_grouped(DS4_ARGS, MoeDownGroupedArgs a) {
    ds4_wait_predecessor(cond);
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u32* tab = iq2_tab(a.grid, a.down_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 r0 = (blockIdx.x / a.n_expert * (blockDim.x >> 5) + warp) * MOE_ROWS_PER_WARP;
    if (r0 >= a.out_dim) return;
    if (a.down_ty == 16) moe_down_pairs<16>(a, R, tab, e, r0, is_sh[warp], sm_sh[warp]);
    else if (a.down_ty == 10) moe_down_pairs<10>(a, R, tab, e, r0, is_sh[warp], sm_sh[warp]);
    else moe_down_pairs<12>(a, R, tab, e, r0, is_sh[warp], sm_sh[warp]);
}

// out[r] = the row's slots' down rows added in slot order from +0, as moe_down_rows adds them.
extern "C" __global__ void moe_sum_slots(DS4_ARGS, MoeSumSlotsArgs a) {
    DS4_GUARD;
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= a.out_dim) return;
    float acc = 0.0f;
    for (u32 s = 0; s < a.n_used; s++) acc += a.parts[(u64)s * a.out_dim + r];
    a.out[r] = acc;
}

#if !DS4_NATIVE_BLOCKS
// The grouped experts on int8 tensor cores (split layout; plan.rs takes them unless
// DS4_CUDA_MOE_MMA=0): IQ2_XXS gate/up (moe_gate_up_mma_iq2_xxs) and Q2_K down
// (moe_down_mma_q2_k). A warp takes a tile of 16 weight rows of one expert and its pairs 8 at a
// time, the n = 8 columns of an m16n8k32 MMA, so each weight is decoded once per 8 pairs. The MMAs
// give each (row, pair) the decode kernels' integer block sums (exact in any order; a k
// permutation applied to both A and B leaves them unchanged), and the block terms then add in
// row_total's order (tree32_leaf). A column past the expert's pairs repeats its last pair: an
// MMA's columns do not mix, and that column's outputs are not written.

// D += A B over k = 32 (PTX mma m16n8k32 .s8, .s32 accumulators). With g = lane / 4 and
// t = lane % 4, byte j of each register: a[0] row g, k 4t + j; a[1] row g + 8, k 4t + j; a[2],
// a[3] the same at k 16 + 4t + j; b[0] k 4t + j of column g, b[1] k 16 + 4t + j; d[0], d[1] row
// g, columns 2t and 2t + 1; d[2], d[3] row g + 8. (scripts/emu/gen.py maps the asm to the
// emulator's MMA.)
__device__ __forceinline__ void mma_s8_k32(int* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Adds leaf i (0..31) of a 32-block chunk, blocks taken in bit_reverse5 order, to the pending
// sums of warp_sum's tree: a leaf closes level l while bit l of i is set, so every add pairs what
// the butterfly pairs. After leaf 31, v holds the chunk's sum as warp_sum gives it.
template <int N> __device__ __forceinline__ void tree32_leaf(float (*pend)[N], float* v, u32 i) {
#pragma unroll
    for (u32 l = 0; l < 5; l++) {
        if (!((i >> l) & 1)) {
#pragma unroll
            for (int k = 0; k < N; k++) pend[l][k] = v[k];
            return;
        }
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = pend[l][k] + v[k];
    }
}

// The block of leaf L: chunk L / 32, leaf L % 32 of its tree.
__device__ __forceinline__ u32 leaf_block(u32 L) { return (L & ~31u) + bit_reverse5(L & 31); }
// The first leaf after L whose block exists, or `end` (the chunks' leaves).
__device__ __forceinline__ u32 next_leaf(u32 L, u32 nb, u32 end) {
    do L++;
    while (L < end && leaf_block(L) >= nb);
    return L;
}

// Which rows take their sign bits from the table (smem loads, which conflict on the banks) rather
// than from shifts (ALU): 0 none, 1 the gate rows, 2 gate and up. To measure:
// DS4_CUDA_DEFINES="MOE_MMA_SIGN_TABLE=2".
#ifndef MOE_MMA_SIGN_TABLE
#define MOE_MMA_SIGN_TABLE 1
#endif

// Blocks of 256 per SM the registers of moe_gate_up_mma_iq2_xxs and moe_down_mma_q2_k must allow:
// 3 fit both in 80 registers without spilling (down takes 96 by itself, 2 blocks); 4 spill. To
// measure others: DS4_CUDA_DEFINES="MOE_MMA_MIN_BLOCKS=2" (1: as many registers as ptxas likes).
#ifndef MOE_MMA_MIN_BLOCKS
#define MOE_MMA_MIN_BLOCKS 3
#endif

// Mid rows of a gate/up tile: tile rows 0-7 are gate rows r0..r0 + 7, rows 8-15 the up rows of
// the same mid rows, so a lane's accumulators hold gate and up of mid row r0 + g for two pairs.
#define MOE_MMA_MID_ROWS 8

// One IQ2_XXS block of a gate/up tile: lane (g, t) holds part t (sub-blocks 2t, 2t + 1) of gate
// row g (qg) and of up row g (qu), and reads column g's activations x. For each sub-block the lane
// decodes grid entry t of both rows (its 8 k slots: values 8t..8t + 7 of the sub-block), one MMA
// gives the sub-block's dots for 16 rows x 8 pairs, and each adds times its row's scale 2s + 1
// (iq2_xxs_sub's sum). is: gate of columns 2t, 2t + 1, then up.
__device__ __forceinline__ void iq2_xxs_mma_block(int4 qg, int4 qu, const BlockQ8K* x, const u32* codes,
                                                  const u32* signs, int* is) {
    const u32 lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
    for (int k = 0; k < 4; k++) is[k] = 0;
#pragma unroll
    for (u32 s = 0; s < 8; s++) {
        const u32 src = (lane & ~3u) | (s >> 1);
        const u32 g0 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qg.z : qg.x), src);
        const u32 g1 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qg.w : qg.y), src);
        const u32 u0 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qu.z : qu.x), src);
        const u32 u1 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qu.w : qu.y), src);
        u32 w[4];
        iq2_xxs_entry<(MOE_MMA_SIGN_TABLE >= 1)>(g0, g1, t, codes, signs, &w[0], &w[2]);
        iq2_xxs_entry<(MOE_MMA_SIGN_TABLE >= 2)>(u0, u1, t, codes, signs, &w[1], &w[3]);
        const uint2 xv = *(const uint2*)(x->qs + 32 * s + 8 * t);
        const u32 xb[2] = {xv.x, xv.y};
        int d[4] = {0, 0, 0, 0};
        mma_s8_k32(d, w, xb);
        const int sg = 2 * (int)(g1 >> 28) + 1, su = 2 * (int)(u1 >> 28) + 1;
        is[0] += d[0] * sg;
        is[1] += d[1] * sg;
        is[2] += d[2] * su;
        is[3] += d[3] * su;
    }
}

// The Q8_K activations of pair p (its row's normed input).
__device__ __forceinline__ const BlockQ8K* gate_up_pair_x(const MoeGateUpGroupedArgs& a, const RowStrides& R, u32 p) {
    MoeGateUpGroupedArgs ay = a;
    ds4_row(ay, R, p / a.n_used);
    return ay.xq;
}

// IQ2_XXS gate and up (the Flash experts) for every pair of each expert: blocks go (mid row
// block, expert) as moe_gate_up_grouped's, a warp per MOE_MMA_MID_ROWS mid rows. Each block's
// quants are loaded one block ahead, in the leaves' order.
extern "C" __global__ void __launch_bounds__(256, MOE_MMA_MIN_BLOCKS) moe_gate_up_mma_iq2_xxs(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor(cond);
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    const u32* codes = iq2_tab(a.grid, true);
    const u32* signs = codes + 256;
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 r0 = (blockIdx.x / a.n_expert * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_MMA_MID_ROWS;
    if (r0 >= a.ff) return;
    const u32 nb = a.in_dim / 256, r = r0 + g;
    const u32 end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow gate = expert_row(a.gate, 16, e, (u64)r * nb), up = expert_row(a.up, 16, e, (u64)r * nb);
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += 8) {
        const BlockQ8K* xg = gate_up_pair_x(a, R, pairs[min(i0 + g, n - 1)]);
        const BlockQ8K* x0 = gate_up_pair_x(a, R, pairs[min(i0 + 2 * t, n - 1)]);
        const BlockQ8K* x1 = gate_up_pair_x(a, R, pairs[min(i0 + 2 * t + 1, n - 1)]);
        int4 qg = __ldg((const int4*)(gate.qs + 16 * t)), qu = __ldg((const int4*)(up.qs + 16 * t));
        float total[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pend[5][4];
#pragma unroll 1
        for (u32 L = 0; L < end; L++) {
            const u32 b = leaf_block(L);
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b < nb) {
                const int4 cg = qg, cu = qu;
                const u32 next = next_leaf(L, nb, end);
                if (next < end) {
                    const u64 at = (u64)leaf_block(next) * 64 + 16 * t;
                    qg = __ldg((const int4*)(gate.qs + at));
                    qu = __ldg((const int4*)(up.qs + at));
                }
                const float dg = h2f(__ldg((const u16*)gate.rest + b)), du = h2f(__ldg((const u16*)up.rest + b));
                const float y0 = x0[b].d, y1 = x1[b].d;
                int is[4];
                iq2_xxs_mma_block(cg, cu, xg + b, codes, signs, is);
                v[0] = 0.0f + (dg * y0) * (float)is[0];
                v[1] = 0.0f + (dg * y1) * (float)is[1];
                v[2] = 0.0f + (du * y0) * (float)is[2];
                v[3] = 0.0f + (du * y1) * (float)is[3];
            }
            tree32_leaf<4>(pend, v, L & 31);
            if ((L & 31) == 31) {
#pragma unroll
                for (int k = 0; k < 4; k++) total[k] += v[k];
            }
        }
#pragma unroll
        for (u32 j = 0; j < 2; j++) {
            const u32 q = i0 + 2 * t + j;
            if (q >= n) break;
            const u32 p = pairs[q], slot = p % a.n_used;
            MoeGateUpGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
            const float gv = 0.125f * total[j], uv = 0.125f * total[2 + j];
            ay.mid[(u64)slot * a.ff + r] = swiglu_clamped(gv, uv, a.clamp) * ay.weights[slot];
        }
    }
}

// One Q2_K block of a down tile: lane (g, t) holds the quants of 128-value chunk c = t / 2, half
// h = t % 2 (16 bytes: four 2-bit planes j of 16 values each, whose scale is byte 2j + h of the
// chunk's 8 in sa / sb) of rows g (qa) and g + 8 (qb), and reads column g's activations x. A value's
// scale folds into its weight (q * (s & 15) <= 45 fits an int8) and its min is a weight of its
// own (s >> 4), so an MMA may take 8 values of each lane's sub-block: per plane and half, one MMA
// adds the scaled quants' dots to is and one the mins' to sm, part_sums' isum and summ (the mins
// times the activations' 16-value sums, which quantize_q8_k makes from the same quants).
__device__ __forceinline__ void q2_k_mma_block(int4 qa, int4 qb, uint2 sa, uint2 sb, const BlockQ8K* x, int* is,
                                               int* sm) {
    const u32 t = threadIdx.x & 3, c = t >> 1, h = t & 1;
#pragma unroll
    for (int k = 0; k < 4; k++) is[k] = sm[k] = 0;
#pragma unroll
    for (u32 j = 0; j < 4; j++) {
        const u32 sh = 8 * ((2 * j + h) & 3);
        const u32 sca = ((j < 2 ? sa.x : sa.y) >> sh) & 255, scb = ((j < 2 ? sb.x : sb.y) >> sh) & 255;
        const u32 ka = sca & 15, kb = scb & 15;
        const u32 mins[4] = {(sca >> 4) * 0x01010101u, (scb >> 4) * 0x01010101u, (sca >> 4) * 0x01010101u,
                             (scb >> 4) * 0x01010101u};
#pragma unroll
        for (u32 half = 0; half < 2; half++) {
            const u32 a0 = (u32)(half ? qa.z : qa.x), a1 = (u32)(half ? qa.w : qa.y);
            const u32 b0 = (u32)(half ? qb.z : qb.x), b1 = (u32)(half ? qb.w : qb.y);
            const u32 w[4] = {((a0 >> (2 * j)) & 0x03030303u) * ka, ((b0 >> (2 * j)) & 0x03030303u) * kb,
                              ((a1 >> (2 * j)) & 0x03030303u) * ka, ((b1 >> (2 * j)) & 0x03030303u) * kb};
            const uint2 xv = *(const uint2*)(x->qs + 128 * c + 32 * j + 16 * h + 8 * half);
            const u32 xb[2] = {xv.x, xv.y};
            mma_s8_k32(is, w, xb);
            mma_s8_k32(sm, mins, xb);
        }
    }
}

// row_total's Q2_K term of a block: sc its d and dmin (block_scales<10>), yd the activations'.
__device__ __forceinline__ float q2_k_term(u32 sc, float yd, int is, int sm) {
    const float d = yd * h2f((u16)(sc & 0xffff)), dmin = yd * h2f((u16)(sc >> 16));
    return 0.0f + (d * (float)is - dmin * (float)sm);
}

// The mid Q8_K of pair p (its row and slot).
__device__ __forceinline__ const BlockQ8K* down_pair_x(const MoeDownGroupedArgs& a, const RowStrides& R, u32 p) {
    MoeDownGroupedArgs ay = a;
    ds4_row(ay, R, p / a.n_used);
    return ay.midq + (u64)(p % a.n_used) * (a.ff / 256);
}

// Down rows of a tile: rows g and g + 8 of a lane are r0 + g and r0 + g + 8.
#define MOE_MMA_DOWN_ROWS 16

// Q2_K down for every pair of each expert, into parts[slot] of the pair's row (moe_sum_slots adds
// them): blocks go (row block, expert), a warp per MOE_MMA_DOWN_ROWS rows; rows past out_dim read
// the last row and are not written.
extern "C" __global__ void __launch_bounds__(256, MOE_MMA_MIN_BLOCKS) moe_down_mma_q2_k(DS4_ARGS, MoeDownGroupedArgs a) {
    ds4_wait_predecessor(cond);
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, c = t >> 1;
    const u32 r0 = (blockIdx.x / a.n_expert * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_MMA_DOWN_ROWS;
    if (r0 >= a.out_dim) return;
    const u32 nb = a.ff / 256, end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow wa = expert_row(a.down, 10, e, (u64)min(r0 + g, a.out_dim - 1) * nb);
    const ExpertRow wb = expert_row(a.down, 10, e, (u64)min(r0 + g + 8, a.out_dim - 1) * nb);
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += 8) {
        const BlockQ8K* xg = down_pair_x(a, R, pairs[min(i0 + g, n - 1)]);
        const BlockQ8K* x0 = down_pair_x(a, R, pairs[min(i0 + 2 * t, n - 1)]);
        const BlockQ8K* x1 = down_pair_x(a, R, pairs[min(i0 + 2 * t + 1, n - 1)]);
        int4 qa = __ldg((const int4*)(wa.qs + 16 * t)), qb = __ldg((const int4*)(wb.qs + 16 * t));
        float total[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pend[5][4];
#pragma unroll 1
        for (u32 L = 0; L < end; L++) {
            const u32 b = leaf_block(L);
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b < nb) {
                const int4 ca = qa, cb = qb;
                const u32 next = next_leaf(L, nb, end);
                if (next < end) {
                    const u64 at = (u64)leaf_block(next) * 64 + 16 * t;
                    qa = __ldg((const int4*)(wa.qs + at));
                    qb = __ldg((const int4*)(wb.qs + at));
                }
                const u8* ra = wa.rest + (u64)b * Layout<10>::RS;
                const u8* rb = wb.rest + (u64)b * Layout<10>::RS;
                const uint2 sa = make_uint2(__ldg((const u32*)(ra + 8 * c)), __ldg((const u32*)(ra + 8 * c + 4)));
                const uint2 sb = make_uint2(__ldg((const u32*)(rb + 8 * c)), __ldg((const u32*)(rb + 8 * c + 4)));
                const u32 da = __ldg((const u32*)(ra + Layout<10>::Q2K_D));
                const u32 db = __ldg((const u32*)(rb + Layout<10>::Q2K_D));
                const float y0 = x0[b].d, y1 = x1[b].d;
                int is[4], sm[4];
                q2_k_mma_block(ca, cb, sa, sb, xg + b, is, sm);
                v[0] = q2_k_term(da, y0, is[0], sm[0]);
                v[1] = q2_k_term(da, y1, is[1], sm[1]);
                v[2] = q2_k_term(db, y0, is[2], sm[2]);
                v[3] = q2_k_term(db, y1, is[3], sm[3]);
            }
            tree32_leaf<4>(pend, v, L & 31);
            if ((L & 31) == 31) {
#pragma unroll
                for (int k = 0; k < 4; k++) total[k] += v[k];
            }
        }
#pragma unroll
        for (u32 j = 0; j < 2; j++) {
            const u32 q = i0 + 2 * t + j;
            if (q >= n) break;
            const u32 p = pairs[q], slot = p % a.n_used;
            MoeDownGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
            float* parts = ay.parts + (u64)slot * a.out_dim;
            if (r0 + g < a.out_dim) parts[r0 + g] = total[j];
            if (r0 + g + 8 < a.out_dim) parts[r0 + g + 8] = total[2 + j];
        }
    }
}

// Helpers of the tile experts below (moe_gate_up_tile_iq2_xxs, moe_down_tile_q2_k): the IQ2_XXS
// grid codes from a table replicated over the banks and the signs from a multiply, the
// activations permuted to the MMA's k order, weights prefetched into L2 a few blocks ahead. (They
// came from a second generation of tensor-core experts, moe_*_mma2_*, slower than the first on
// the H200 and removed.)

// The blocks per SM the down tile's registers must allow, and how many leaves ahead weights are
// prefetched into L2.
#ifndef MOE2_MIN_BLOCKS
#define MOE2_MIN_BLOCKS 2
#endif
#ifndef MOE2_L2_AHEAD
#define MOE2_L2_AHEAD 4
#endif
// Copies of the code table (16: a lookup of 32 lanes meets at most 2 on a bank).
#define MOE2_COPIES 16
// Bytes between two pairs' staged blocks: 256 + 32, so the 16 lanes of a 64-bit load meet no bank twice.
#define MOE2_PAIR_STRIDE 288
// Candidate bytes of the IQ2_XXS decode with the sign in bit 0 of a selector nibble: 8, -8, 25,
// -25, 43, -43 (nibble 2 code + sign).
#define MOE2_PRMT_LO 0xe719f808u
#define MOE2_PRMT_HI 0x0000d52bu

// 8 scale bytes of a Q2_K block's rest: two 4-byte loads, since the rests are 20 bytes apart
// (an 8-byte load faults on every odd block).
__device__ __forceinline__ uint2 moe2_scales8(const u8* p) {
    return make_uint2(__ldg((const u32*)p), __ldg((const u32*)(p + 4)));
}

// x rotated right by n (0..31).
__device__ __forceinline__ u32 moe2_rotr(u32 x, u32 n) {
#if __CUDA_ARCH__ >= 800
    return __funnelshift_r(x, x, n);
#else
    return n ? (x >> n) | (x << (32 - n)) : x;
#endif
}

// Selector nibble n of an entry holds weight moe2_weight(n) of its 8: 0, 4, 1, 5, 2, 6, 3, 7 (the
// order in which a multiply spreads the sign bits, below). The MMA's k slots follow it: the
// staged activations are permuted the same way (moe2_permute).
__device__ __forceinline__ u32 moe2_weight(u32 n) { return n & 1 ? 4 + (n >> 1) : n >> 1; }

// The code table: entry i (twice the code of each of grid[i]'s bytes, in selector order) in
// MOE2_COPIES copies, copy c of entry i at word 16 i + c (every thread must call this).
__device__ __forceinline__ void moe2_code_table(const u64* grid, u32* codes) {
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        const u64 g = grid[i];
        u32 c = 0;
#pragma unroll
        for (u32 n = 0; n < 8; n++) {
            const u32 v = (u32)(g >> (8 * moe2_weight(n))) & 255;
            c |= 2 * ((u32)(v > 8) + (u32)(v > 25)) << (4 * n);
        }
#pragma unroll
        for (u32 k = 0; k < MOE2_COPIES; k++) codes[i * MOE2_COPIES + k] = c;
    }
}

// 16 activation bytes (two entries of 8) in the MMA's k order of gut_entry.
__device__ __forceinline__ int4 moe2_permute(int4 v) {
    return make_int4((int)prmt((u32)v.x, (u32)v.y, 0x5140u), (int)prmt((u32)v.x, (u32)v.y, 0x7362u),
                     (int)prmt((u32)v.z, (u32)v.w, 0x5140u), (int)prmt((u32)v.z, (u32)v.w, 0x7362u));
}

// moe_gate_up_tile_iq2_xxs: IQ2_XXS gate and up for every pair of each expert (plan.rs takes it
// with DS4_CUDA_MOE_GATE_UP=tile), the same bits as moe_gate_up_mma_iq2_xxs with each weight
// decoded once per pass of up to GUT_COLS pairs instead of once per 8. Blocks go (64 mid rows,
// expert) as that kernel's, a warp per 16-row tile (8 gate rows, their 8 up rows), the MMAs and
// the IQ2_XXS decode of gut_entry (the warp's quants copied to shared memory).
// Per block (in leaf order) a lane decodes each sub-block's fragment once and multiplies it with
// every 8-pair tile of the pass; the tiles' integer block sums stay in registers, and the block
// terms go into row_total's tree, whose pending sums (and the chunk total, for rows of more than
// 32 blocks) live in shared memory per lane and tile. The pass's activations of the next block
// are copied by cp.async while the current block is computed (every warp shares them).
//
// Float order: each term is (d * y) * (float)isum as row_total makes it; the leaf's "0.0f +" is
// left out and an absent block's subtree (a zero term) is skipped rather than added: either only
// changes the sign of a zero inside the chunk's tree, and the chunk's sum is then added to a total
// that starts from +0 (kept here: "0.0f + v"), which absorbs it (kernels/README.md, the proven
// freedom). The tree pairs the present leaves exactly as warp_sum does.

// Tiles of 8 pairs per pass at most, and float4 tree slots per lane and warp (levels x tiles):
// Flash's 16-block rows need 4 levels, so 4 tiles; wider rows take fewer tiles per pass.
#ifndef GUT_TILES
#define GUT_TILES 4
#endif
#define GUT_COLS (8 * GUT_TILES)
#define GUT_SLOTS (4 * GUT_TILES)
// Bytes between two pairs' staged blocks (moe2's: the 8 lanes of a column meet no bank twice).
#define GUT_STRIDE MOE2_PAIR_STRIDE
// Dynamic shared memory (backends/cuda/mod.rs gate_up_tile_smem computes the same size): the code
// table [256 * MOE2_COPIES] u32; each warp's quant copy [8][16 * 80]; the staged activations
// [2][GUT_COLS][GUT_STRIDE] and their d [2][GUT_COLS]; the tree slots [8][GUT_SLOTS][32] float4;
// MOE2_PRMT_LO (16 bytes).
#define GUT_WQ_OFF (256 * MOE2_COPIES * 4)
#define GUT_ACT_OFF (GUT_WQ_OFF + 8 * 16 * 80)
#define GUT_ACTD_OFF (GUT_ACT_OFF + 2 * GUT_COLS * GUT_STRIDE)
#define GUT_TREE_OFF (GUT_ACTD_OFF + 2 * GUT_COLS * 4)
#define GUT_CONST_OFF (GUT_TREE_OFF + 8 * GUT_SLOTS * 32 * 16)
#define GUT_SMEM (GUT_CONST_OFF + 16)

// Stages block b of the pass's pairs: thread i copies 16-byte chunk i % 16 of columns i / 16 and
// i / 16 + 16 (x0, x1: their Q8_K rows, null past the pass), and the first chunk's thread the d.
__device__ __forceinline__ void gut_stage(const BlockQ8K* x0, const BlockQ8K* x1, u32 b, u8* act, float* actd) {
    const u32 q = threadIdx.x & 15, col = threadIdx.x >> 4;
    if (x0) {
        cp_async16(act + col * GUT_STRIDE + 16 * q, x0[b].qs + 16 * q);
        if (q == 0) cp_async4(actd + col, &x0[b].d);
    }
    if (x1) {
        cp_async16(act + (col + 16) * GUT_STRIDE + 16 * q, x1[b].qs + 16 * q);
        if (q == 0) cp_async4(actd + col + 16, &x1[b].d);
    }
}
// After the copies landed: the thread's own chunks permuted in place for the MMA (moe2_permute).
__device__ __forceinline__ void gut_permute(bool c0, bool c1, u8* act) {
    const u32 q = threadIdx.x & 15, col = threadIdx.x >> 4;
    if (c0) {
        int4* p = (int4*)(act + col * GUT_STRIDE + 16 * q);
        *p = moe2_permute(*p);
    }
    if (c1) {
        int4* p = (int4*)(act + (col + 16) * GUT_STRIDE + 16 * q);
        *p = moe2_permute(*p);
    }
}

// The block of leaf L (leaf_block), by a bit reverse on the device.
__device__ __forceinline__ u32 gut_leaf_block(u32 L) {
#if __CUDA_ARCH__
    return (L & ~31u) | (__brev(L) >> 27);
#else
    return leaf_block(L);
#endif
}
// The next leaf after L whose block exists, or `end`: leaves step by `step` (present leaves have
// their low log2(step) bits clear).
__device__ __forceinline__ u32 gut_next(u32 L, u32 step, u32 nb, u32 end) {
    do L += step;
    while (L < end && gut_leaf_block(L) >= nb);
    return L;
}

// Grid entry t of an IQ2_XXS sub-block (words aux0, aux1) with its signs: weights 0, 4, 1, 5 in
// lo, 2, 6, 3, 7 in hi, as bytes iq2_xxs_sub would dot. The 7 sign bits go to bit 0 of nibbles
// 0, 2, 4, 6, 1, 3, 5 by one multiply (bit i lands at i + 7j; the products never overlap) and their
// parity to nibble 7. `rot` = (8 t + 26) % 32 puts the entry's index at bits 6-13; `copy` is the
// lane's copy of the table, times 4; `lo_bytes` is MOE2_PRMT_LO, in a register the caller holds
// (loaded from shared memory, so the compiler keeps it instead of moving the constant in before
// every prmt).
__device__ __forceinline__ void gut_entry(u32 aux0, u32 aux1, u32 t, u32 rot, u32 copy, const u32* codes, u32 lo_bytes,
                                          u32* lo, u32* hi) {
    const u32 at = (moe2_rotr(aux0, rot) & 0x3fc0u) | copy;
    const u32 code = *(const u32*)((const u8*)codes + at);
    const u32 s = (aux1 >> (7 * t)) & 127;
    const u32 sel = ((s * 0x00204081u) & 0x01111111u) | ((((u32)__popc(s) << 28) & 0x10000000u) | code);
    *lo = prmt(lo_bytes, MOE2_PRMT_HI, sel);
    *hi = prmt(lo_bytes, MOE2_PRMT_HI, sel >> 16);
}

// One block (leaf i of its chunk, L in all) of a pass of TL tiles: every sub-block's fragment
// decoded once and multiplied with each tile's columns, the terms, and the leaf into the tree
// (tree32_leaf with the absent subtrees skipped: at level l a leaf with bit l set adds the pending
// left sum; one with it clear waits for its right sibling if any block of that subtree exists,
// else goes on up). The last leaf of a chunk adds the chunk's sum to the total (from +0, kept in
// the slot after the levels while another chunk follows). v: each tile's 4 values (the total,
// after the row's last leaf).
template <int TL>
__device__ __forceinline__ void gut_leaf(const u8* mine, const u8* xs, const float* xd, float4* tree, const u32* codes,
                                         u32 lo_bytes, u32 rot, u32 copy, u32 cols, float dg, float du, u32 L, u32 nb,
                                         u32 lmin, u32 T, float (*v)[4]) {
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, i = L & 31;
    int is[TL][4];
#pragma unroll
    for (int j = 0; j < TL; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) is[j][q] = 0;
#pragma unroll 1
    for (u32 c = 0; c < 4; c++) {
        // Sub-blocks 2c, 2c + 1 of gate row g and up row g (one broadcast load each).
        const uint4 wg = *(const uint4*)(mine + 80 * g + 16 * c);
        const uint4 wu = *(const uint4*)(mine + 80 * (8 + g) + 16 * c);
#pragma unroll
        for (u32 hs = 0; hs < 2; hs++) {
            const u32 s = 2 * c + hs;
            const u32 g0 = hs ? wg.z : wg.x, g1 = hs ? wg.w : wg.y;
            const u32 u0 = hs ? wu.z : wu.x, u1 = hs ? wu.w : wu.y;
            u32 w[4];
            gut_entry(g0, g1, t, rot, copy, codes, lo_bytes, &w[0], &w[2]);
            gut_entry(u0, u1, t, rot, copy, codes, lo_bytes, &w[1], &w[3]);
            const int sg = (int)((g1 >> 27) | 1), su = (int)((u1 >> 27) | 1);
            // The fragment once for every tile (a column past the pairs repeats the last: an
            // MMA's columns do not mix, and it is not written).
#pragma unroll
            for (int j = 0; j < TL; j++) {
                const u32 col = min(8 * j + g, cols - 1);
                const uint2 xv = *(const uint2*)(xs + col * GUT_STRIDE + 32 * s + 8 * t);
                const u32 xb[2] = {xv.x, xv.y};
                int d[4] = {0, 0, 0, 0};
                mma_s8_k32(d, w, xb);
                is[j][0] += d[0] * sg;
                is[j][1] += d[1] * sg;
                is[j][2] += d[2] * su;
                is[j][3] += d[3] * su;
            }
        }
    }
    // row_total's terms (gate of columns 2t, 2t + 1, then up), without the "0.0f +".
#pragma unroll
    for (int j = 0; j < TL; j++) {
        const float y0 = xd[min(8 * j + 2 * t, cols - 1)], y1 = xd[min(8 * j + 2 * t + 1, cols - 1)];
        v[j][0] = (dg * y0) * (float)is[j][0];
        v[j][1] = (dg * y1) * (float)is[j][1];
        v[j][2] = (du * y0) * (float)is[j][2];
        v[j][3] = (du * y1) * (float)is[j][3];
    }
#pragma unroll
    for (u32 l = 0; l < 5; l++) {
        if (l < lmin) continue;
        float4* const slot = tree + (l - lmin) * T * 32;
        if ((i >> l) & 1) {
#pragma unroll
            for (int j = 0; j < TL; j++) {
                const float4 p = slot[32 * j];
                v[j][0] = p.x + v[j][0];
                v[j][1] = p.y + v[j][1];
                v[j][2] = p.z + v[j][2];
                v[j][3] = p.w + v[j][3];
            }
        } else if ((L & ~31u) + bit_reverse5(((i >> l) | 1) << l) < nb) {
#pragma unroll
            for (int j = 0; j < TL; j++) slot[32 * j] = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
            return;
        }
    }
    float4* const tot = tree + (5 - lmin) * T * 32;
#pragma unroll
    for (int j = 0; j < TL; j++) {
        const float4 p = L < 32 ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : tot[32 * j];
        v[j][0] = p.x + v[j][0];
        v[j][1] = p.y + v[j][1];
        v[j][2] = p.z + v[j][2];
        v[j][3] = p.w + v[j][3];
        if ((L | 31) + 1 < nb) tot[32 * j] = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up_tile_iq2_xxs(DS4_ARGS, MoeGateUpGroupedArgs a) {
    static_assert(GUT_COLS <= 32 && GUT_TILES >= 1 && GUT_TILES <= 4, "two staged columns per thread of 256");
    ds4_wait_predecessor(cond);
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    extern __shared__ __align__(16) u8 gut_smem[];
    ds4_check_dynamic_smem(GUT_SMEM);  // mod.rs: gate_up_tile_smem
    u32* const codes = (u32*)gut_smem;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u8* const mine = gut_smem + GUT_WQ_OFF + warp * 16 * 80;
    float4* const tree = (float4*)(gut_smem + GUT_TREE_OFF) + warp * GUT_SLOTS * 32 + lane;
    moe2_code_table(a.grid, codes);
    if (threadIdx.x == 0) *(u32*)(gut_smem + GUT_CONST_OFF) = MOE2_PRMT_LO;
    const u32 rot = (8 * t + 26) & 31, copy = 4 * (lane & 15);
    const u32 r0 = (blockIdx.x / a.n_expert * 8 + warp) * MOE_MMA_MID_ROWS;
    // A warp past ff computes row ff - 1 (it must keep the block's barriers) and writes nothing.
    const u32 nb = a.in_dim / 256, r = min(r0 + g, a.ff - 1);
    const u32 end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow gate = expert_row(a.gate, 16, e, (u64)r * nb), up = expert_row(a.up, 16, e, (u64)r * nb);
    // Tree levels below lmin never pair (a present leaf has those bits clear and no sibling):
    // blocks < 2^(5 - lmin). Slots: levels lmin..4, then the total when a row has several chunks.
    const u32 cbmax = min(nb, (u32)DS4_BLOCK_CHUNK);
    u32 lmin = 5;
    while (lmin > 0 && (1u << (5 - lmin)) < cbmax) lmin--;
    const u32 step = 1u << min(lmin, 4u);
    const u32 slots = 5 - lmin + (nb > DS4_BLOCK_CHUNK ? 1 : 0);
    const u32 T = min((u32)GUT_TILES, (u32)GUT_SLOTS / max(slots, 1u));
    // Lanes (g, 0) and (g, 1) prefetch gate row g and up row g into L2.
    const u8* pf = t == 0 ? gate.qs : up.qs;
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    __syncthreads();  // the code table and the constant
    const u32 lo_bytes = *(volatile const u32*)(gut_smem + GUT_CONST_OFF);
    for (u32 i0 = 0; i0 < n; i0 += 8 * T) {
        const u32 cols = min(n - i0, 8 * T), tiles = (cols + 7) / 8;
        // This thread's staged columns (their rows' activations), null past the pass.
        const u32 c0 = threadIdx.x >> 4, c1 = c0 + 16;
        const BlockQ8K* x0 = c0 < cols ? gate_up_pair_x(a, R, pairs[i0 + c0]) : 0;
        const BlockQ8K* x1 = c1 < cols ? gate_up_pair_x(a, R, pairs[i0 + c1]) : 0;
        __syncthreads();  // the previous pass has finished with the staging buffers
        gut_stage(x0, x1, 0, gut_smem + GUT_ACT_OFF, (float*)(gut_smem + GUT_ACTD_OFF));
        u32 Lp = 0;
        for (u32 k = 0; k < MOE2_L2_AHEAD; k++) {
            if (t < 2 && Lp < end) ds4_prefetch_l2(pf + (u64)gut_leaf_block(Lp) * 64);
            Lp = Lp < end ? gut_next(Lp, step, nb, end) : end;
        }
        int4 qg = __ldg((const int4*)(gate.qs + 16 * t)), qu = __ldg((const int4*)(up.qs + 16 * t));
        u16 hg = __ldg((const u16*)gate.rest), hu = __ldg((const u16*)up.rest);
        float v[GUT_TILES][4];
        u32 k = 0;  // present leaves so far
        // Leaf 0 (block 0) exists; each step goes to the next present leaf.
#pragma unroll 1
        for (u32 L = 0; L < end;) {
            const u32 next = gut_next(L, step, nb, end), bn = gut_leaf_block(next);
            u8* const xs = gut_smem + GUT_ACT_OFF + (k & 1) * GUT_COLS * GUT_STRIDE;
            const float* const xd = (const float*)(gut_smem + GUT_ACTD_OFF) + (k & 1) * GUT_COLS;
            // This block's activations have landed (every thread's copies: the barrier); the next
            // block's go into the other buffer, which every warp finished with before the barrier.
            cp_async_wait();
            gut_permute(x0 != 0, x1 != 0, xs);
            __syncthreads();
            if (next < end)
                gut_stage(x0, x1, bn, gut_smem + GUT_ACT_OFF + ((k + 1) & 1) * GUT_COLS * GUT_STRIDE,
                          (float*)(gut_smem + GUT_ACTD_OFF) + ((k + 1) & 1) * GUT_COLS);
            k++;
            // This block's quants to the warp's copy; the next block's into registers.
            __syncwarp();
            *(int4*)(mine + 80 * g + 16 * t) = qg;
            *(int4*)(mine + 80 * (8 + g) + 16 * t) = qu;
            __syncwarp();
            const float dg = h2f(hg), du = h2f(hu);
            if (next < end) {
                const u64 at = (u64)bn * 64 + 16 * t;
                qg = __ldg((const int4*)(gate.qs + at));
                qu = __ldg((const int4*)(up.qs + at));
                hg = __ldg((const u16*)gate.rest + bn);
                hu = __ldg((const u16*)up.rest + bn);
            }
            if (Lp < end) {
                if (t < 2) ds4_prefetch_l2(pf + (u64)gut_leaf_block(Lp) * 64);
                Lp = gut_next(Lp, step, nb, end);
            }
            // The pass's tile count as a constant of the code (uniform).
            if (tiles == 1) gut_leaf<1>(mine, xs, xd, tree, codes, lo_bytes, rot, copy, cols, dg, du, L, nb, lmin, T, v);
            else if (tiles == 2) gut_leaf<2>(mine, xs, xd, tree, codes, lo_bytes, rot, copy, cols, dg, du, L, nb, lmin, T, v);
#if GUT_TILES >= 3
            else if (tiles == 3) gut_leaf<3>(mine, xs, xd, tree, codes, lo_bytes, rot, copy, cols, dg, du, L, nb, lmin, T, v);
#endif
#if GUT_TILES >= 4
            else gut_leaf<4>(mine, xs, xd, tree, codes, lo_bytes, rot, copy, cols, dg, du, L, nb, lmin, T, v);
#endif
            L = next;
        }
        // v holds the last chunk's total (the last present leaf completes its chunk).
        if (r0 + g >= a.ff) continue;
#pragma unroll
        for (u32 j = 0; j < GUT_TILES; j++) {
            if (j >= tiles) break;
#pragma unroll
            for (u32 jj = 0; jj < 2; jj++) {
                const u32 q = 8 * j + 2 * t + jj;
                if (q >= cols) break;
                const u32 p = pairs[i0 + q], slot = p % a.n_used;
                MoeGateUpGroupedArgs ay = a;
                ds4_row(ay, R, p / a.n_used);
                const float gv = 0.125f * v[j][jj], uv = 0.125f * v[j][2 + jj];
                ay.mid[(u64)slot * a.ff + r0 + g] = swiglu_clamped(gv, uv, a.clamp) * ay.weights[slot];
            }
        }
    }
}

// The third Q2_K down (plan.rs takes it with DS4_CUDA_MOE_DOWN=tile): moe_down_tile_q2_k. The tiles,
// MMAs and integer block sums of moe_down_mma_q2_k, the same bits, with the work per pass cut:
// a pass takes up to 8 MOE_TILE_T pairs; per block each lane builds its weight fragments once
// and feeds them to every tile of the pass; the pass's activations (the pairs' mid Q8_K blocks, a
// round of MOE_TILE_S blocks at a time) are staged in shared memory once for all 8 warps; and
// only the blocks that exist go through the tree (tile_tree).

// Tiles of 8 pairs per pass (more pairs: more passes) and blocks (leaves) per staging round:
// 16 pairs of 8 blocks stage 41 KB (static shared memory stops at 48 KB). To measure others:
// DS4_CUDA_DEFINES="MOE_TILE_T=1" (8 pairs a pass, no spills).
#ifndef MOE_TILE_T
#define MOE_TILE_T 2
#endif
#ifndef MOE_TILE_S
#define MOE_TILE_S 8
#endif
#define MOE_TILE_COLS (8 * MOE_TILE_T)

// The leaves of a row of nb blocks: chunks of 32 leaves up to `end`, the last from `last`. The
// existing leaves of a chunk of m blocks lie on a grid of step 32 / P (P: m rounded up to a power
// of two), since bit_reverse5(i) < m <= P clears i's low bits: 1 in a whole chunk, `step` in
// the last.
struct TileLeaves {
    u32 nb, end, last, step;
};
__device__ __forceinline__ TileLeaves tile_leaves(u32 nb) {
    TileLeaves lv;
    lv.nb = nb;
    lv.end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    lv.last = lv.end - 32;
    const u32 m = nb - lv.last;
    lv.step = 1u << ((u32)(m <= 1) + (u32)(m <= 2) + (u32)(m <= 4) + (u32)(m <= 8) + (u32)(m <= 16));
    return lv;
}
// leaf_block by one bit reversal of the whole word (leaf bits 0-4 land at 31-27).
__device__ __forceinline__ u32 tile_leaf_block(u32 L) { return (L & ~31u) + (__brev(L) >> 27); }
// next_leaf for an existing leaf L, stepping on its chunk's grid (a chunk's leaf 0 always exists).
__device__ __forceinline__ u32 tile_next_leaf(u32 L, const TileLeaves& lv) {
    do L += L >= lv.last ? lv.step : 1;
    while (L < lv.end && tile_leaf_block(L) >= lv.nb);
    return L;
}

// Adds the term v (N values) of leaf i (0..31) of a 32-block chunk whose first m blocks exist
// to the pending sums, warp_sum's tree as tree32_leaf builds it, with the leaves of missing blocks
// left out: such a leaf is +0 there, and x + 0 is x but for a zero's sign, which the chunk sums'
// +0 start (total = 0 + chunk) absorbs, so the result has the same bits. A level-l node pairs
// with its right sibling only if that holds a block (its first block is bit_reverse5 of its first
// leaf); a left sibling always holds one. Levels below LO only pass v up (LO = 2 when m <= 8: the
// leaves are multiples of 4). Returns true when v is the chunk's sum. (One exit, so that the
// loop unrolls and pend stays in registers.)
template <int N, int NP, int LO>
__device__ __forceinline__ bool tile_tree(float (*pend)[NP], float* v, u32 i, u32 m) {
    bool stored = false;
#pragma unroll
    for (u32 l = LO; l < 5; l++) {
        if (stored) continue;
        if ((i >> l) & 1) {
#pragma unroll
            for (int k = 0; k < N; k++) v[k] = pend[l][k] + v[k];
        } else if (bit_reverse5((i & ~((2u << l) - 1)) | (1u << l)) < m) {
#pragma unroll
            for (int k = 0; k < N; k++) pend[l][k] = v[k];
            stored = true;
        }
    }
    return !stored;
}

// A pair's staged block: its first 128 bytes (chunk c = 0), 32 bytes of gap, the second 128, at
// a stride of 320 bytes (64 modulo 128): the 8 lanes of a quarter warp's 128-bit loads (columns g
// and g + 1, t = 0..3 at 16 t + 16 c) meet no bank twice.
#define MOE_TILE_STRIDE 320
#define MOE_TILE_C1 160

// Stages the round of MOE_TILE_S existing leaves from leaf L for the pass's first cols8 columns
// (pair rows colx): each pair's block (MOE_TILE_STRIDE) and its d, by cp.async; waits for them
// (the caller's barrier then publishes them). A thread copies the same 16 bytes of every leaf.
#define MOE_TILE_CPT ((MOE_TILE_COLS * 16 + 255) / 256)
__device__ __forceinline__ void tile_stage(u8* act, float* actd, const BlockQ8K* const* colx, u32 L,
                                           const TileLeaves& lv, u32 cols8) {
    const u8* src[MOE_TILE_CPT];
    u32 dst[MOE_TILE_CPT];
#pragma unroll
    for (u32 k = 0; k < MOE_TILE_CPT; k++) {
        const u32 c = threadIdx.x + 256 * k, col = c / 16, qi = c % 16;
        src[k] = c < MOE_TILE_COLS * 16 && col < cols8 ? (const u8*)colx[col]->qs + 16 * qi : 0;
        dst[k] = col * MOE_TILE_STRIDE + 16 * qi + (qi >= 8 ? MOE_TILE_C1 - 128 : 0);
    }
    const u8* dsrc = threadIdx.x < cols8 ? (const u8*)&colx[threadIdx.x]->d : 0;
#pragma unroll
    for (u32 s = 0; s < MOE_TILE_S; s++) {
        if (L >= lv.end) break;  // uniform
        const u64 at = (u64)tile_leaf_block(L) * sizeof(BlockQ8K);
#pragma unroll
        for (u32 k = 0; k < MOE_TILE_CPT; k++)
            if (src[k]) cp_async16(act + s * MOE_TILE_COLS * MOE_TILE_STRIDE + dst[k], src[k] + at);
        if (dsrc) cp_async4(actd + s * MOE_TILE_COLS + threadIdx.x, dsrc + at);
        L = tile_next_leaf(L, lv);
    }
    cp_async_wait();
}

// The lane's weights of one block: quants, the scales of chunk c, d and dmin, of rows g and g + 8.
struct TileWeights {
    int4 qa, qb;
    uint2 sa, sb;
    u32 da, db;
};
__device__ __forceinline__ TileWeights tile_weights(const ExpertRow& wa, const ExpertRow& wb, u32 b) {
    const u32 t = threadIdx.x & 3, c = t >> 1;
    const u8* ra = wa.rest + (u64)b * Layout<10>::RS;
    const u8* rb = wb.rest + (u64)b * Layout<10>::RS;
    TileWeights w;
    w.qa = __ldg((const int4*)(wa.qs + (u64)b * 64 + 16 * t));
    w.qb = __ldg((const int4*)(wb.qs + (u64)b * 64 + 16 * t));
    w.sa = moe2_scales8(ra + 8 * c);
    w.sb = moe2_scales8(rb + 8 * c);
    w.da = __ldg((const u32*)(ra + Layout<10>::Q2K_D));
    w.db = __ldg((const u32*)(rb + Layout<10>::Q2K_D));
    return w;
}

// One block of NT tiles: q2_k_mma_block's MMAs with each weight fragment built once for every
// tile (xs: the block's staged columns, xd their d), then q2_k_term of each (row, pair) without
// its 0 + (the leaf's +0, absorbed as in tile_tree): v[4 j + k] is d[k] of tile j.
template <int NT>
__device__ __forceinline__ void tile_block(const TileWeights& w, const u8* xs, const float* xd, float* v) {
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, c = t >> 1, h = t & 1;
    int is[NT][4], sm[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) is[j][q] = sm[j][q] = 0;
#pragma unroll
    for (u32 jp = 0; jp < 4; jp++) {
        const u32 sh = 8 * ((2 * jp + h) & 3);
        const u32 sca = ((jp < 2 ? w.sa.x : w.sa.y) >> sh) & 255, scb = ((jp < 2 ? w.sb.x : w.sb.y) >> sh) & 255;
        const u32 ka = sca & 15, kb = scb & 15;
        const u32 mins[4] = {(sca >> 4) * 0x01010101u, (scb >> 4) * 0x01010101u, (sca >> 4) * 0x01010101u,
                             (scb >> 4) * 0x01010101u};
        // Both halves' activations of each column in one 128-bit load.
        int4 xv[NT];
#pragma unroll
        for (u32 j = 0; j < NT; j++)
            xv[j] = *(const int4*)(xs + (8 * j + g) * MOE_TILE_STRIDE + MOE_TILE_C1 * c + 32 * jp + 16 * h);
#pragma unroll
        for (u32 half = 0; half < 2; half++) {
            const u32 a0 = (u32)(half ? w.qa.z : w.qa.x), a1 = (u32)(half ? w.qa.w : w.qa.y);
            const u32 b0 = (u32)(half ? w.qb.z : w.qb.x), b1 = (u32)(half ? w.qb.w : w.qb.y);
            const u32 wf[4] = {((a0 >> (2 * jp)) & 0x03030303u) * ka, ((b0 >> (2 * jp)) & 0x03030303u) * kb,
                               ((a1 >> (2 * jp)) & 0x03030303u) * ka, ((b1 >> (2 * jp)) & 0x03030303u) * kb};
#pragma unroll
            for (u32 j = 0; j < NT; j++) {
                const u32 xb[2] = {(u32)(half ? xv[j].z : xv[j].x), (u32)(half ? xv[j].w : xv[j].y)};
                mma_s8_k32(is[j], wf, xb);
                mma_s8_k32(sm[j], mins, xb);
            }
        }
    }
    const float hda = h2f((u16)(w.da & 0xffff)), hma = h2f((u16)(w.da >> 16));
    const float hdb = h2f((u16)(w.db & 0xffff)), hmb = h2f((u16)(w.db >> 16));
#pragma unroll
    for (u32 j = 0; j < NT; j++) {
        const float2 y = *(const float2*)(xd + 8 * j + 2 * t);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float yd = q & 1 ? y.y : y.x;
            const float d = yd * (q < 2 ? hda : hdb), dmin = yd * (q < 2 ? hma : hmb);
            v[4 * j + q] = d * (float)is[j][q] - dmin * (float)sm[j][q];
        }
    }
}

// Block b (leaf L) of a pass of `tiles` tiles (1..NT), into the tree (LO: tile_tree's) and the
// totals.
template <int NT, int LO>
__device__ __forceinline__ void tile_leaf(u32 tiles, const TileWeights& w, const u8* xs, const float* xd, u32 L,
                                          u32 nb, float (*pend)[4 * MOE_TILE_T], float* total) {
    if (NT > 1 && tiles < NT) {
        tile_leaf<(NT > 1 ? NT - 1 : 1), LO>(tiles, w, xs, xd, L, nb, pend, total);
        return;
    }
    float v[4 * NT];
    tile_block<NT>(w, xs, xd, v);
    if (tile_tree<4 * NT, 4 * MOE_TILE_T, LO>(pend, v, L & 31, min(nb - (L & ~31u), 32u)))
#pragma unroll
        for (int q = 0; q < 4 * NT; q++) total[q] += v[q];
}

// Leaf *L (staged at xs, xd) with the weights in cur: loads the next leaf's (*Ln) into nxt and
// prefetches the one after into L2 (pf: the quants of row g or g + 8, lanes t < 2), computes,
// and moves both cursors on one leaf.
template <int LO>
__device__ __forceinline__ void tile_step(const ExpertRow& wa, const ExpertRow& wb, const u8* pf,
                                          const TileWeights& cur, TileWeights& nxt, u32* L, u32* Ln,
                                          const TileLeaves& lv, bool live, u32 tiles, const u8* xs, const float* xd,
                                          float (*pend)[4 * MOE_TILE_T], float* total) {
    const u32 Ln2 = *Ln < lv.end ? tile_next_leaf(*Ln, lv) : lv.end;
    if (live) {
        if (*Ln < lv.end) nxt = tile_weights(wa, wb, tile_leaf_block(*Ln));
        if ((threadIdx.x & 3) < 2 && Ln2 < lv.end) ds4_prefetch_l2(pf + (u64)tile_leaf_block(Ln2) * 64);
        tile_leaf<MOE_TILE_T, LO>(tiles, cur, xs, xd, *L, lv.nb, pend, total);
    }
    *L = *Ln;
    *Ln = Ln2;
}

// The kernel's body (below), LO: tile_tree's. Shared: act (MOE_TILE_S x MOE_TILE_COLS staged
// blocks), actd (their d), colx (the pass's pair rows).
template <int LO>
__device__ __forceinline__ void moe_down_tile_body(const RowStrides& R, const MoeDownGroupedArgs& a, u8* act,
                                                   float* actd, const BlockQ8K** colx) {
    const u32 e = blockIdx.x % a.n_expert;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 r0 = (blockIdx.x / a.n_expert * 8 + warp) * MOE_MMA_DOWN_ROWS;
    const bool live = r0 < a.out_dim;
    const u32 nb = a.ff / 256;
    const TileLeaves lv = tile_leaves(nb);
    const ExpertRow wa = expert_row(a.down, 10, e, (u64)min(r0 + g, a.out_dim - 1) * nb);
    const ExpertRow wb = expert_row(a.down, 10, e, (u64)min(r0 + g + 8, a.out_dim - 1) * nb);
    const u8* pf = t == 0 ? wa.qs : wb.qs;
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += MOE_TILE_COLS) {
        const u32 tiles = (min(n - i0, (u32)MOE_TILE_COLS) + 7) / 8;
        __syncthreads();  // the previous pass has finished with colx and the staged rounds
        // A column past the pairs repeats the last pair (its outputs are not written).
        if (threadIdx.x < 8 * tiles) colx[threadIdx.x] = down_pair_x(a, R, pairs[min(i0 + threadIdx.x, n - 1)]);
        // Block 0's weights; leaf L (block 0 exists: nb >= 1), the next Ln.
        u32 L = 0, Ln = tile_next_leaf(0, lv);
        TileWeights w0 = {};
        if (live) {
            w0 = tile_weights(wa, wb, 0);
            if (t < 2 && Ln < lv.end) ds4_prefetch_l2(pf + (u64)tile_leaf_block(Ln) * 64);
        }
        float total[4 * MOE_TILE_T], pend[5][4 * MOE_TILE_T];
#pragma unroll
        for (int q = 0; q < 4 * MOE_TILE_T; q++) total[q] = 0.0f;
        while (L < lv.end) {
            __syncthreads();  // colx is written; the last round is done with the buffers
            tile_stage(act, actd, colx, L, lv, 8 * tiles);
            __syncthreads();
#pragma unroll 1
            for (u32 s = 0; s < MOE_TILE_S && L < lv.end; s++) {
                const TileWeights cw = w0;
                tile_step<LO>(wa, wb, pf, cw, w0, &L, &Ln, lv, live, tiles,
                              act + s * MOE_TILE_COLS * MOE_TILE_STRIDE, actd + s * MOE_TILE_COLS, pend, total);
            }
        }
        if (!live) continue;
#pragma unroll
        for (u32 j = 0; j < MOE_TILE_T; j++) {
#pragma unroll
            for (u32 jj = 0; jj < 2; jj++) {
                const u32 q = i0 + 8 * j + 2 * t + jj;
                if (q >= n) break;
                const u32 p = pairs[q], slot = p % a.n_used;
                MoeDownGroupedArgs ay = a;
                ds4_row(ay, R, p / a.n_used);
                float* parts = ay.parts + (u64)slot * a.out_dim;
                if (r0 + g < a.out_dim) parts[r0 + g] = total[4 * j + jj];
                if (r0 + g + 8 < a.out_dim) parts[r0 + g + 8] = total[4 * j + 2 + jj];
            }
        }
    }
}

// Q2_K down for every pair of each expert, into parts[slot] of the pair's row: blocks go (row
// block, expert) as moe_down_mma_q2_k's, a warp per 16 output rows (a warp past out_dim only
// stages and keeps the barriers), the same bits. Per pass: the pairs' rows (colx), then rounds of
// staged activations; per existing block in leaf order, the lane's weights of rows g and g + 8
// (loaded a block ahead; L2 prefetched two ahead) go to every tile. The body is instantiated with
// LO = 2 for rows of at most 8 blocks (Flash: 8), where the tree's levels 0 and 1 take no
// registers (no spills in the loop); LO = 0 for any row.
extern "C" __global__ void __launch_bounds__(256, MOE2_MIN_BLOCKS) moe_down_tile_q2_k(DS4_ARGS, MoeDownGroupedArgs a) {
    ds4_wait_predecessor(cond);
    if (a.route[blockIdx.x % a.n_expert] == 0) return;
    __shared__ __align__(16) u8 act[MOE_TILE_S * MOE_TILE_COLS * MOE_TILE_STRIDE];
    __shared__ __align__(8) float actd[MOE_TILE_S * MOE_TILE_COLS];
    __shared__ const BlockQ8K* colx[MOE_TILE_COLS];
    if (a.ff / 256 <= 8) moe_down_tile_body<2>(R, a, act, actd, colx);
    else moe_down_tile_body<0>(R, a, act, actd, colx);
}
#endif
#endif
