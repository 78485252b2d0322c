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

// Writes the 8 bytes of draw k at p (2-byte aligned), little-endian, as the host's to_le_bytes.
__device__ __forceinline__ void put_draw(u8* p, u64 z, u32 n_bytes) {
    for (u32 i = 0; i < n_bytes; i++) p[i] = (u8)(z >> (8 * i));
}

extern "C" __global__ void synth_fill(DS4_ARGS, const SynthFillArgs a) {
    DS4_GUARD;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
        if (a.kind == 2) {
            const u32 start = (u32)(sm_draw(a.state, i) % a.n_expert);
            for (u32 k = 0; k < a.n_used; k++) ((int*)a.out)[i * a.n_used + k] = (int)((start + k) % a.n_expert);
        } else if (a.kind == 1) {
            ((float*)a.out)[i] = a.center + sm_uniform(sm_draw(a.state, i)) * a.spread;
        } else if (a.ty == 0) {  // F32
            ((float*)a.out)[i] = sm_uniform(sm_draw(a.state, i)) * a.a;
        } else if (a.ty == 1) {  // F16
            ((u16*)a.out)[i] = f2h(sm_uniform(sm_draw(a.state, i)) * a.a);
        } else if (a.ty == 8) {  // Q8_0: scale, 32 quants; repacked: all quants, then all scales
            u8* q = a.repack ? a.out + i * 32 : a.out + i * 34 + 2;
            u16* d = a.repack ? (u16*)(a.out + a.n * 32) + i : (u16*)(a.out + i * 34);
            *d = (u16)a.d;
            for (u32 j = 0; j < 32; j++) q[j] = (u8)(signed char)roundf(sm_uniform(sm_draw(a.state, i * 32 + j)) * 127.0f);
        } else if (a.ty == 16) {  // IQ2_XXS: d, 64 random bytes (8 draws and an unused tail draw)
            u8* b = a.out + i * 66;
            *(u16*)b = (u16)a.d;
            for (u32 w = 0; w < 8; w++) put_draw(b + 2 + 8 * w, sm_draw(a.state, i * 9 + w), 8);
        } else if (a.ty == 10) {  // Q2_K: 80 random bytes (10 draws and a tail), d, dmin
            u8* b = a.out + i * 84;
            for (u32 w = 0; w < 10; w++) put_draw(b + 8 * w, sm_draw(a.state, i * 11 + w), 8);
            *(u16*)(b + 80) = (u16)a.d;
            *(u16*)(b + 82) = (u16)a.dmin;
        } else if (a.ty == 12) {  // Q4_K: d, dmin, 140 random bytes (17 draws and 4 of the tail)
            u8* b = a.out + i * 144;
            *(u16*)b = (u16)a.d;
            *(u16*)(b + 2) = (u16)a.dmin;
            for (u32 w = 0; w < 17; w++) put_draw(b + 4 + 8 * w, sm_draw(a.state, i * 18 + w), 8);
            put_draw(b + 4 + 136, sm_draw(a.state, i * 18 + 17), 4);
        }
    }
}
