// SwiGlu and Add.
extern "C" __global__ void swiglu(DS4_ARGS, const float* __restrict__ gate, const float* __restrict__ up,
                                  float* __restrict__ out, u32 n, float clamp) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_clamped(gate[i], up[i], clamp);
}

extern "C" __global__ void add(DS4_ARGS, const float* __restrict__ a, const float* __restrict__ b,
                               float* __restrict__ out, u32 n) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// Fills n 32-bit words with v (cache reset; not part of the token).
extern "C" __global__ void fill(DS4_ARGS, u32* __restrict__ x, u64 n, u32 v) {
    DS4_GUARD;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
