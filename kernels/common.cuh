// Shared by every kernel file: per-token parameters, predicates, f16 conversion, reductions.
// Compiled at run time by NVRTC (no CUDA headers needed).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Mirrors `recorder::StepParams` (repr(C)): the only per-token input of a replay.
struct StepParams {
    u32 token;
    u32 pos;
    u32 reserved0;
    u32 reserved1;
};

// A predicate packed by the host: kind (2 bits) | ratio (16 bits) << 2 | top_k (32 bits) << 18.
// kind 0: always; 1: a compressed row is emitted; 2: the indexer is active.
__device__ __forceinline__ bool ds4_cond(const StepParams* P, u64 cond) {
    const u32 kind = (u32)(cond & 3);
    const u32 ratio = (u32)((cond >> 2) & 0xffff);
    const u32 top_k = (u32)(cond >> 18);
    if (kind == 0) return true;
    if (kind == 1) return (P->pos + 1) % ratio == 0;
    return (P->pos + 1) / ratio > top_k;
}

// Every kernel starts with these two parameters and this guard, so a predicated op is a launch
// that returns at once: the launch list (and a captured graph) never changes.
#define DS4_ARGS const StepParams* __restrict__ P, u64 cond
#define DS4_GUARD if (!ds4_cond(P, cond)) return

// Visible rows, as `recorder::Bound` computes them.
__device__ __forceinline__ u32 ds4_raw_rows(const StepParams* P, u32 window, u32 cap) {
    return min(min(P->pos + 1, window), cap);
}
__device__ __forceinline__ u32 ds4_comp_rows(const StepParams* P, u32 ratio, u32 cap) {
    return ratio == 0 ? 0 : min((P->pos + 1) / ratio, cap);
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }

// Reads element i of an F32 (is_f16 == 0) or F16 (is_f16 == 1) weight.
__device__ __forceinline__ float wload(const void* w, u32 is_f16, u64 i) {
    return is_f16 ? h2f(((const u16*)w)[i]) : ((const float*)w)[i];
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Warp-wide (value, index) maximum; on equal values the lower index wins. Every lane gets it.
__device__ __forceinline__ void warp_argmax(float* v, int* idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, *idx, o);
        if (ov > *v || (ov == *v && oi < *idx)) {
            *v = ov;
            *idx = oi;
        }
    }
}

// Block-wide sum of doubles (blockDim.x a multiple of 32, at most 1024). Every thread gets it.
__device__ double block_sum_d(double v) {
    __shared__ double part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < nw; i++) t += part[i];
    return t;
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = part[0];
    for (int i = 1; i < nw; i++) t = fmaxf(t, part[i]);
    return t;
}

// exp and log1p exactly as `src/math.rs` computes them (its portable mode): f64 arithmetic with
// basic operations only, rounded once to f32, so the CPU (portable mode) and the GPU agree bit for
// bit. Keep the constants and the order of operations identical to that file.
__device__ __forceinline__ float ds4_expf(float x) {
    if (x != x) return x;
    if (x > 89.0f) return __int_as_float(0x7f800000);
    if (x < -104.0f) return 0.0f;
    const double xd = (double)x;
    const double k = rint(xd * 1.4426950408889634);
    const double r = xd - k * 0.6931471805599453;
    // Horner over 1/i! for i = 12 down to 0, written out so the constants stay in registers.
    double p = 2.08767569878681e-9;
    p = p * r + 2.505210838544172e-8;
    p = p * r + 2.755731922398589e-7;
    p = p * r + 2.7557319223985893e-6;
    p = p * r + 2.48015873015873e-5;
    p = p * r + 0.0001984126984126984;
    p = p * r + 0.001388888888888889;
    p = p * r + 0.008333333333333333;
    p = p * r + 0.041666666666666664;
    p = p * r + 0.16666666666666666;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const double scale = __longlong_as_double((long long)((long long)k + 1023) << 52);
    return (float)(p * scale);
}

__device__ __forceinline__ float ds4_log1pf(float x) {
    if (x != x || x < -1.0f) return __int_as_float(0x7fc00000);
    if (x == -1.0f) return __int_as_float(0xff800000);
    if (x == __int_as_float(0x7f800000)) return x;
    const double xd = (double)x;
    if (fabs(xd) < 1e-4) return (float)(xd - xd * xd / 2.0 + xd * xd * xd / 3.0 - xd * xd * xd * xd / 4.0);
    const double y = 1.0 + xd;
    const unsigned long long bits = (unsigned long long)__double_as_longlong(y);
    long long j = (long long)((bits >> 52) & 0x7ff) - 1023;
    double m = __longlong_as_double((long long)((bits & 0x000fffffffffffffULL) | (1023ULL << 52)));
    if (m > 1.4142135623730951) {
        m /= 2.0;
        j += 1;
    }
    const double f = m - 1.0;
    const double s = f / (2.0 + f);
    const double z = s * s;
    // Horner over 1/(2i+1) for i = 11 down to 0.
    double p = 0.043478260869565216;
    p = p * z + 0.047619047619047616;
    p = p * z + 0.05263157894736842;
    p = p * z + 0.058823529411764705;
    p = p * z + 0.06666666666666667;
    p = p * z + 0.07692307692307693;
    p = p * z + 0.09090909090909091;
    p = p * z + 0.1111111111111111;
    p = p * z + 0.14285714285714285;
    p = p * z + 0.2;
    p = p * z + 0.3333333333333333;
    p = p * z + 1.0;
    return (float)((double)j * 0.6931471805599453 + 2.0 * s * p);
}

__device__ __forceinline__ float ds4_log2f(float x) { return (float)log2((double)x); }

__device__ __forceinline__ float sigmoid_stable(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + ds4_expf(-x));
    const float e = ds4_expf(x);
    return e / (1.0f + e);
}
__device__ __forceinline__ float silu(float x) { return x * sigmoid_stable(x); }

// SwiGLU with ds4's clamp: gate only from above, up both ways.
__device__ __forceinline__ float swiglu_clamped(float g, float u, float clamp) {
    if (clamp > 1.0e-6f) {
        g = fminf(g, clamp);
        u = fminf(fmaxf(u, -clamp), clamp);
    }
    return silu(g) * u;
}

// Q8_K activation block, laid out as `quant::BlockQ8K` (292 bytes).
struct BlockQ8K {
    float d;
    i8 qs[256];
    i16 bsums[16];
};
