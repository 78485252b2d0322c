// RmsNorm: one block per row. Sums of squares in double, scale = 1/sqrt(mean + eps) in f32,
// out = x * scale * w, as ds4's CPU path. `out` may alias `x`.
extern "C" __global__ void rms_norm(DS4_ARGS, const float* x, const float* __restrict__ w, float* out, u32 n,
                                    float eps) {
    DS4_GUARD;
    const float* xr = x + (u64)blockIdx.x * n;
    float* orow = out + (u64)blockIdx.x * n;
    double ss = 0.0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * xr[i];
    ss = block_sum_d(ss);
    const float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] * scale;
        orow[i] = w ? v * w[i] : v;
    }
}
