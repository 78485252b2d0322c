// RmsNorm in the canonical order: warp w of a block sums the chunks w, w + warps, ... (512 terms
// each, 4 per lane step) and the chunk sums add in order, whatever the block size.
// mean = ss / n, scale = 1 / sqrt(mean + eps), out = (x * scale) * w.
#define NORM_MAX_CHUNKS 64

// The scale of a row of n, computed by the whole block (every thread must call it). It returns
// after every thread has read the scale, so the caller may overwrite `x` (in place) at once.
__device__ float rms_scale_block(const float* x, u32 n, float eps) {
    __shared__ float chunk_sums[NORM_MAX_CHUNKS];
    __shared__ float scale_sh;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 n_chunks = (n + DS4_CHUNK - 1) / DS4_CHUNK;
    for (u32 c = warp; c < n_chunks; c += nw) {
        const float* xc = x + c * DS4_CHUNK;
        const float s = warp_sum(chunk_dot_f32(xc, xc, n - c * DS4_CHUNK, lane));
        if (lane == 0) chunk_sums[c] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float ss = 0.0f;
        for (u32 c = 0; c < n_chunks; c++) ss += chunk_sums[c];
        scale_sh = 1.0f / sqrtf(ss / (float)n + eps);
    }
    __syncthreads();
    const float scale = scale_sh;
    __syncthreads();
    return scale;
}

// Q8_0 of one 32-block by one warp (lane i holds value i): d = amax/127,
// q = round-half-even(v * (1/d)), as ds4.
__device__ __forceinline__ void quantize_q8_0_warp(float v, i8* xq, float* xd, u32 blk, u32 lane) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    xq[blk * 32 + lane] = (i8)max(-128, min(127, (int)rintf(v * id)));
    if (lane == 0) xd[blk] = d;
}

// A row is split over `slices` blocks (n / slices outputs each, a multiple of 32); each sums the
// whole row. `out` may alias `x` only with one slice. With `xq`, the output is also quantized to
// Q8_0 per 32, exactly as quantize_q8_0 would (a warp per block).
extern "C" __global__ void rms_norm(DS4_ARGS, RmsNormArgs a) {
    DS4_GUARD;
    const u32 n = a.n, row = blockIdx.x / a.slices, slice = blockIdx.x % a.slices;
    const float* xr = a.x + (u64)row * n;
    float* orow = a.out + (u64)row * n;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float scale = rms_scale_block(xr, n, a.eps);
    const u32 per = n / a.slices, begin = slice * per, end = begin + per;
    if (a.xq) {
        for (u32 blk = begin / 32 + warp; blk < end / 32; blk += nw) {
            const u32 i = blk * 32 + lane;
            const float v = xr[i] * scale;
            const float o = a.w ? v * a.w[i] : v;
            orow[i] = o;
            quantize_q8_0_warp(o, a.xq, a.xd, blk, lane);
        }
        return;
    }
    for (u32 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float v = xr[i] * scale;
        orow[i] = a.w ? v * a.w[i] : v;
    }
}
