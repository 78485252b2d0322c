// SwiGlu, Add, and the cache fill.
extern "C" __global__ void swiglu(DS4_ARGS, const SwiGluArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = swiglu_clamped(a.gate[i], a.up[i], a.clamp);
}

extern "C" __global__ void add(DS4_ARGS, const AddArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = a.a[i] + a.b[i];
}

// Fills n 32-bit words with v (cache reset; not part of the token).
extern "C" __global__ void fill(DS4_ARGS, const FillArgs a) {
    DS4_GUARD;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.x[i] = a.v;
}
