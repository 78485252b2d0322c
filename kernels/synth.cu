// Synthetic weights drawn in device memory, draw for draw as `synth::tensor_data` draws them on
// the host: a splitmix64 stream keyed by the seed and the tensor name, whose k-th draw is
// mix(state + (k+1)·golden). Not part of a token: run once per weight at load.
// kind 0: random values / raw blocks of `ty`; 1: F32 center + uniform·spread; 2: I32 hash rows.
// `n` counts elements (F16, F32), blocks (Q8_0, IQ2_XXS, Q2_K, Q4_K) or token rows (hash).
__device__ __forceinline__ u64 sm_draw(u64 state, u64 k) {
    u64 z = state + (k + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float sm_uniform(u64 z) { return (float)(z >> 40) / 8388608.0f - 1.0f; }

// Writes the 8 bytes of draw k at p, little-endian, as the host's to_le_bytes.
__device__ __forceinline__ void put_draw(u8* p, u64 z, u32 n_bytes) {
    for (u32 i = 0; i < n_bytes; i++) p[i] = (u8)(z >> (8 * i));
}

// Stores block i of n, drawn whole in `blk` in GGUF's layout, where the kernels read it: in
// GGUF's layout, or split (ds4_block_split: all quants, then the rest of each block).
__device__ void put_block(u8* out, u64 i, u64 n, u32 ty, const u8* blk, u32 repack) {
    u32 bb = 0, at = 0, nq = 0;
    ds4_block_split(ty, &bb, &at, &nq);
    if (!repack) {
        for (u32 j = 0; j < bb; j++) out[i * bb + j] = blk[j];
        return;
    }
    u8* q = out + i * nq;
    u8* r = out + n * nq + i * (bb - nq);
    for (u32 j = 0; j < nq; j++) q[j] = blk[at + j];
    for (u32 j = 0; j < at; j++) r[j] = blk[j];
    for (u32 j = at + nq; j < bb; j++) r[j - nq] = blk[j];
}

extern "C" __global__ void synth_fill(DS4_ARGS, SynthFillArgs a) {
    DS4_GUARD;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
        u8 b[144];
        if (a.kind == 2) {
            const u32 start = (u32)(sm_draw(a.state, i) % a.n_expert);
            for (u32 k = 0; k < a.n_used; k++) ((int*)a.out)[i * a.n_used + k] = (int)((start + k) % a.n_expert);
        } else if (a.kind == 1) {
            ((float*)a.out)[i] = a.center + sm_uniform(sm_draw(a.state, i)) * a.spread;
        } else if (a.ty == 0) {  // F32
            ((float*)a.out)[i] = sm_uniform(sm_draw(a.state, i)) * a.a;
        } else if (a.ty == 1) {  // F16
            ((u16*)a.out)[i] = f2h(sm_uniform(sm_draw(a.state, i)) * a.a);
        } else if (a.ty == 8) {  // Q8_0: scale, 32 quants
            *(u16*)b = (u16)a.d;
            for (u32 j = 0; j < 32; j++) b[2 + j] = (u8)(signed char)roundf(sm_uniform(sm_draw(a.state, i * 32 + j)) * 127.0f);
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        } else if (a.ty == 16) {  // IQ2_XXS: d, 64 random bytes (8 draws and an unused tail draw)
            *(u16*)b = (u16)a.d;
            for (u32 w = 0; w < 8; w++) put_draw(b + 2 + 8 * w, sm_draw(a.state, i * 9 + w), 8);
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        } else if (a.ty == 10) {  // Q2_K: 80 random bytes (10 draws and a tail), d, dmin
            for (u32 w = 0; w < 10; w++) put_draw(b + 8 * w, sm_draw(a.state, i * 11 + w), 8);
            *(u16*)(b + 80) = (u16)a.d;
            *(u16*)(b + 82) = (u16)a.dmin;
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        } else if (a.ty == 12) {  // Q4_K: d, dmin, 140 random bytes (17 draws and 4 of the tail)
            *(u16*)b = (u16)a.d;
            *(u16*)(b + 2) = (u16)a.dmin;
            for (u32 w = 0; w < 17; w++) put_draw(b + 4 + 8 * w, sm_draw(a.state, i * 18 + w), 8);
            put_draw(b + 4 + 136, sm_draw(a.state, i * 18 + 17), 4);
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        }
    }
}
