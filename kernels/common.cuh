// Shared by every kernel file: predicates, f16 conversion, the canonical reductions, exp and
// log1p. Compiled at run time by NVRTC (no CUDA headers needed). `StepParams`, each kernel's
// argument struct and the numerics constants are generated from the Rust definitions and
// prepended to this file (backends/cuda/args.rs, src/numerics.rs).


// A predicate packed by the host: kind (2 bits) | ratio (16 bits) << 2 | top_k (32 bits) << 18,
// and bit 63 on a chunk program's launches: a row past the chunk's tokens (count 0) runs nothing.
// kind 0: always; 1: a compressed row is emitted; 2: the indexer is active; 3: never (a
// measurement: plan.rs skip_for_measurement).
__device__ __forceinline__ bool ds4_cond(const StepParams* P, u64 cond) {
    const u32 kind = (u32)(cond & 3);
    const u32 ratio = (u32)((cond >> 2) & 0xffff);
    const u32 top_k = (u32)(cond >> 18);
#if DS4_CHUNK_ROWS
    if ((cond >> 63) && P->count == 0) return false;
#endif
    if (kind == 0) return true;
    if (kind == 1) return (P->pos + 1) % ratio == 0;
    if (kind == 3) return false;
    return (P->pos + 1) / ratio > top_k;
}

// The dynamic shared memory the launch gave the block, in bytes.
__device__ __forceinline__ u32 ds4_dynamic_smem() {
    u32 bytes = 0;
#if __CUDA_ARCH__
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
#endif
    return bytes;
}

// Traps when the launch gave less dynamic shared memory than `need` bytes: the host sizes it
// (mod.rs), so a smaller one is a bug, caught here rather than as a stray write.
__device__ __forceinline__ void ds4_check_dynamic_smem(u32 need) {
    if (ds4_dynamic_smem() < need) __trap();
}

// A weight stream's load (the Q8_0 and F16 matvecs, the experts): read once a token, so it goes
// through L2 as evict-first, leaving L2 to the code, activations and partial sums the latency
// chains read back. With __ldg the weights evicted them: H100 flash-4l decode +8% (1264 against
// 1173 tok/s), hc_pre's single-block tail 8.5 -> 4.1 us (BENCHMARKS, thirty-fifth session).
// DS4_WEIGHT_EVICT_FIRST 0: __ldg. Cache hints only: both load the same bits. (ld.global.nc with
// an evict-first L2 policy, with or without a 256-byte prefetch, measured +2% only.)
#ifndef DS4_WEIGHT_EVICT_FIRST
#define DS4_WEIGHT_EVICT_FIRST 1
#endif
template <class T> __device__ __forceinline__ T ds4_wld(const T* p) {
#if DS4_WEIGHT_EVICT_FIRST
    return __ldcs(p);
#else
    return __ldg(p);
#endif
}

// Asks L2 for the line holding p and goes on (no register, nothing to wait for); EVICT_LAST marks
// the line to be kept over normal ones. A hint only: what any load then reads is unchanged.
template <bool EVICT_LAST = false> __device__ __forceinline__ void ds4_prefetch_l2(const void* p) {
#if __CUDA_ARCH__ >= 800
    if (EVICT_LAST) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
    else asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}
// Every line of the n > 0 bytes at p, by the warp's lanes a 128-byte line each in turn; the span's
// last byte too, for spans that do not start on a line.
template <bool EVICT_LAST = false> __device__ __forceinline__ void ds4_prefetch_span_l2(const u8* p, u32 n, u32 lane) {
    for (u32 o = lane * 128; o < n + 128; o += 32 * 128) ds4_prefetch_l2<EVICT_LAST>(p + min(o, n - 1));
}

// 16 (4) bytes from global to shared memory without passing through registers; cp_async_wait
// waits for all of this thread's copies. (scripts/emu/gen.py maps these asm lines.)
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Programmatic dependent launch (sm_90 on): the host may start a kernel while the one before it
// finishes. Each kernel waits until its predecessor has completed and its writes are visible (a
// no-op when launched without it) before it reads anything an earlier kernel wrote; every kernel
// waits, so completion is transitive along the stream. It lets its successor start launching
// after its wait, or with DS4_PDL_TRIGGER 1 already at the guard, its first instruction, so the
// successor's blocks may become resident, and load their weights, while this kernel still waits
// for its own predecessor.
#ifndef DS4_PDL_TRIGGER
#define DS4_PDL_TRIGGER 0
#endif
__device__ __forceinline__ void ds4_trigger_successor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The in-graph trace (DS4_TRACE 1, `DS4_CUDA_TRACE=1`; decode build only): the host numbers each
// launch in the predicate's spare bits from DS4_TRACE_SHIFT (13 bits, 1-based, 0: not traced), and
// a few blocks of the launch note the global timer (ns, one clock for all SMs) into its
// DS4_TRACE_SLOTS slots: 0 the first block's start (min), 1 the first block past the PDL wait
// (min), 2 the last block past it (max), 3.. kernel-chosen points (max, DS4_TRACE_MARK). Only the
// first and last 8 blocks write, so a 4096-block launch is not held up by its atomics. Measurement
// only: no output changes. The host defines the sizes with DS4_TRACE (plan.rs TRACE_*).
#ifndef DS4_TRACE
#define DS4_TRACE 0
#endif
#if DS4_TRACE && !DS4_CHUNK_ROWS
__device__ unsigned long long ds4_trace[DS4_TRACE_SLOTS * DS4_TRACE_LAUNCHES];
__device__ __forceinline__ void ds4_trace_note(u64 cond, u32 slot) {
    const u32 i = (u32)((cond >> DS4_TRACE_SHIFT) & 0x1fff);
    if (i == 0 || i > DS4_TRACE_LAUNCHES || threadIdx.x + threadIdx.y + threadIdx.z != 0) return;
    const bool first = blockIdx.x < 8, final = blockIdx.x + 8 >= gridDim.x;
    if (slot < 3 && !first && !final) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned long long* s = ds4_trace + DS4_TRACE_SLOTS * (i - 1);
    if (slot == 0) {
        if (first) atomicMin(s, t);
    } else if (slot == 1) {
        if (first) atomicMin(s + 1, t);
        if (final) atomicMax(s + 2, t);
    } else {
        atomicMax(s + slot, t);
    }
}
#define DS4_TRACE_MARK(slot) ds4_trace_note(cond, slot)
#else
#define DS4_TRACE_MARK(slot)
#endif

// `cond` is the launch's predicate word (for the trace only).
__device__ __forceinline__ void ds4_wait_predecessor(u64 cond) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    ds4_trigger_successor();  // a second signal (after the guards' early one) changes nothing
#endif
    DS4_TRACE_MARK(1);
}

// Every kernel starts with these parameters and one of the guards below, so a predicated op is
// a launch that returns at once: the launch list (and a captured graph) never changes. In the
// chunk build (DS4_CHUNK_ROWS 1) a launch covers its rows as blockIdx.y: the guard moves P and
// the pointers of `a` to the row. The decode build ignores R and has no per-row code.
#define DS4_ARGS const StepParams* __restrict__ P, u64 cond, const RowStrides R
#if DS4_CHUNK_ROWS
#define DS4_ROW                         \
    if (blockIdx.y) {                   \
        P += blockIdx.y;                \
        ds4_row(a, R, blockIdx.y);      \
    }
#else
#define DS4_ROW
#endif
#define DS4_GUARD                \
    DS4_TRACE_MARK(0);           \
    if (DS4_PDL_TRIGGER) ds4_trigger_successor(); \
    DS4_ROW                      \
    ds4_wait_predecessor(cond);  \
    if (!ds4_cond(P, cond)) return
// For kernels that load their weights before waiting (weights never change during a token; the
// step parameters are written before the token starts): the predicate first, then the weight
// loads, then ds4_wait_predecessor() before reading anything an earlier kernel writes.
#define DS4_GUARD_EARLY              \
    DS4_TRACE_MARK(0);               \
    if (DS4_PDL_TRIGGER) ds4_trigger_successor(); \
    DS4_ROW                          \
    if (!ds4_cond(P, cond)) {        \
        ds4_wait_predecessor(cond);  \
        return;                      \
    }

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

// The canonical butterfly (numerics::tree32): for o = 16, 8, 4, 2, 1 each lane adds lane ^ o.
// Every lane ends with the same value.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The lane of leaf i when one thread adds 32 lane values in warp_sum's tree: fed in this
// (bit-reversed) order and merged pairwise as they come, each level's pairs meet as in warp_sum.
__device__ __forceinline__ constexpr u32 bit_reverse5(u32 i) {
    return ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
}
__device__ __forceinline__ constexpr u32 bit_reverse3(u32 i) { return ((i & 1) << 2) | (i & 2) | ((i & 4) >> 2); }
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

// Lane sum of one 512-term chunk of an f32 dot (4 consecutive terms per lane step), from +0.
// `n` is the number of terms left from `a`/`b` (a multiple of 4). Adds in the canonical order.
__device__ __forceinline__ float chunk_dot_f32(const float* a, const float* b, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = u * 128 + lane * 4;
        if (i < n) {
            const float4 x = *(const float4*)(a + i), y = *(const float4*)(b + i);
            acc += x.x * y.x;
            acc += x.y * y.y;
            acc += x.z * y.z;
            acc += x.w * y.w;
        }
    }
    return acc;
}

// The canonical f32 dot of two n-vectors (n a multiple of 4, 16-byte aligned) by one warp.
// Every lane gets the result.
__device__ __forceinline__ float warp_dot_f32(const float* a, const float* b, u32 n, u32 lane) {
    float total = 0.0f;
    for (u32 c = 0; c < n; c += DS4_CHUNK) total += warp_sum(chunk_dot_f32(a + c, b + c, n - c, lane));
    return total;
}

// The canonical exp (numerics::exp): Cody-Waite reduction, degree-7 Taylor polynomial by
// Horner, two exact power-of-two scalings; results below 2^-126 flush to zero. With --fmad=false
// every operation rounds separately, as on the CPU.
__device__ __forceinline__ float ds4_pow2i(int k) { return __int_as_float((k + 127) << 23); }
__device__ __forceinline__ float ds4_expf(float x) {
    if (x != x) return x;
    if (x > DS4_EXP_MAX) return __int_as_float(0x7f800000);
    if (x < DS4_EXP_MIN) return 0.0f;
    const float k = rintf(x * DS4_LOG2_E);
    const float r = (x - k * DS4_LN2_HI) - k * DS4_LN2_LO;
    float p = DS4_EXP_C7;
    p = p * r + DS4_EXP_C6;
    p = p * r + DS4_EXP_C5;
    p = p * r + DS4_EXP_C4;
    p = p * r + DS4_EXP_C3;
    p = p * r + DS4_EXP_C2;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int ki = (int)k;
    const int k1 = ki / 2;
    const float y = p * ds4_pow2i(k1) * ds4_pow2i(ki - k1);
    return y < __int_as_float(0x00800000) ? 0.0f : y;
}

// The canonical log1p (numerics::ln_1p).
__device__ __forceinline__ float ds4_log1pf(float x) {
    if (x != x || x < -1.0f) return __int_as_float(0x7fc00000);
    if (x == -1.0f) return __int_as_float(0xff800000);
    if (x == __int_as_float(0x7f800000)) return x;
    if (fabsf(x) < 2.44140625e-4f) {
        const float x2 = x * x;
        return (x - x2 * 0.5f) + (x2 * x) * DS4_LN_THIRD;
    }
    const float u = 1.0f + x;
    const float c = u < 16777216.0f ? (x - (u - 1.0f)) / u : 0.0f;
    const u32 bits = __float_as_uint(u);
    int j = (int)((bits >> 23) & 0xff) - 127;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (m > DS4_SQRT2) {
        m *= 0.5f;
        j += 1;
    }
    const float f = m - 1.0f;
    const float hfsq = 0.5f * f * f;
    const float s = f / (2.0f + f);
    const float z = s * s;
    float p = DS4_LN_P5;
    p = p * z + DS4_LN_P4;
    p = p * z + DS4_LN_P3;
    p = p * z + DS4_LN_P2;
    p = p * z + DS4_LN_P1;
    const float r = z * p;
    const float jf = (float)j;
    return jf * DS4_LN2_HI - ((hfsq - (s * (hfsq + r) + (jf * DS4_LN2_LO + c))) - f);
}

// The smallest power of two >= t, for positive normal t (numerics::pow2_ceil).
__device__ __forceinline__ float ds4_pow2_ceil(float t) {
    const u32 b = __float_as_uint(t);
    return (b & 0x007fffffu) == 0 ? t : __uint_as_float((b & 0x7f800000u) + 0x00800000u);
}

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
