// RmsNorm in the canonical order: warp w of a block sums the chunks w, w + warps, ... (512 terms
// each, 4 per lane step) and the chunk sums add in order, whatever the block size.
// mean = ss / n, scale = 1 / sqrt(mean + eps), out = (x * scale) * w. A row is split over
// `slices` blocks (n / slices outputs each, a multiple of 32); each sums the whole row. `out`
// may alias `x` only with one slice.
#define NORM_MAX_CHUNKS 64
extern "C" __global__ void rms_norm(DS4_ARGS, const RmsNormArgs a) {
    DS4_GUARD;
    __shared__ float chunk_sums[NORM_MAX_CHUNKS];
    __shared__ float scale_sh;
    const u32 n = a.n, row = blockIdx.x / a.slices, slice = blockIdx.x % a.slices;
    const float* xr = a.x + (u64)row * n;
    float* orow = a.out + (u64)row * n;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 n_chunks = (n + DS4_CHUNK - 1) / DS4_CHUNK;
    for (u32 c = warp; c < n_chunks; c += nw) {
        const float* xc = xr + c * DS4_CHUNK;
        const float s = warp_sum(chunk_dot_f32(xc, xc, n - c * DS4_CHUNK, lane));
        if (lane == 0) chunk_sums[c] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float ss = 0.0f;
        for (u32 c = 0; c < n_chunks; c++) ss += chunk_sums[c];
        scale_sh = 1.0f / sqrtf(ss / (float)n + a.eps);
    }
    __syncthreads();
    const float scale = scale_sh;
    const u32 per = n / a.slices, begin = slice * per, end = begin + per;
    if (a.xq) {
        // Also quantize the output to Q8_0 per 32, exactly as quantize_q8_0 would: a warp per block.
        for (u32 blk = begin / 32 + warp; blk < end / 32; blk += nw) {
            const u32 i = blk * 32 + lane;
            const float v = xr[i] * scale;
            const float o = a.w ? v * a.w[i] : v;
            orow[i] = o;
            const float amax = warp_max(fabsf(o));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            a.xq[i] = (i8)max(-128, min(127, (int)rintf(o * id)));
            if (lane == 0) a.xd[blk] = d;
        }
        return;
    }
    for (u32 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float v = xr[i] * scale;
        orow[i] = a.w ? v * a.w[i] : v;
    }
}
