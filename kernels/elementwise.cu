// SwiGlu, Add, and the cache fill.
// With `xq`, one warp per 32 outputs also writes their Q8_0 quantization (n a multiple of 32).
extern "C" __global__ void swiglu(DS4_ARGS, SwiGluArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    const float o = swiglu_clamped(a.gate[i], a.up[i], a.clamp);
    a.out[i] = o;
    if (a.xq) quantize_q8_0_warp(o, a.xq, a.xd, i / 32, threadIdx.x & 31);
}

extern "C" __global__ void add(DS4_ARGS, AddArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = a.a[i] + a.b[i];
}

// Fills n 32-bit words with v (cache reset; not part of the token).
extern "C" __global__ void fill(DS4_ARGS, FillArgs a) {
    DS4_GUARD;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.x[i] = a.v;
}
