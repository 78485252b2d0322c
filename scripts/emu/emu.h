// A tiny CUDA emulator for checking kernels on the host: one block at a time, each thread a
// cooperative fiber (ucontext); __syncwarp / __syncthreads / shuffles are barriers over the live
// threads of the warp / block. Shared memory is `static` (one block runs at a time).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 {
    unsigned x, y, z;
};
struct int4 {
    int x, y, z, w;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};
struct float2 {
    float x, y;
};
struct int2 {
    int x, y;
};
struct uint2 {
    unsigned x, y;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline int4 make_int4(int a, int b, int c, int d) { return int4{a, b, c, d}; }
inline int2 make_int2(int a, int b) { return int2{a, b}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }

enum { EMU_RUN, EMU_WARP, EMU_BLOCK, EMU_DONE };
// A cp.async copy not yet done: it lands when its thread waits (emu_cp_async_wait), so a read
// before the wait sees the old bytes.
struct EmuCopy {
    void* dst;
    const void* src;
    unsigned n;
};
struct EmuFiber {
    ucontext_t ctx;
    emu_dim3 tid;
    int state;
    std::vector<char> stack;
    std::vector<EmuCopy> async;
};
struct EmuBlock {
    std::vector<EmuFiber> f;
    emu_dim3 bid, bdim, gdim;
    ucontext_t sched;
    unsigned long long xchg[32][32];
    unsigned mma[32][32][6];  // each lane's MMA fragments: A's registers, then B's
    std::function<void()> body;
};
extern EmuFiber* emu_cur;
extern EmuBlock* emu_blk;
// The dynamic shared memory a launch gives (common.cuh ds4_dynamic_smem), in bytes; the arrays
// themselves are static at their largest (gen.py).
extern unsigned emu_dynamic_smem;

#define threadIdx (emu_cur->tid)
#define blockIdx (emu_blk->bid)
#define blockDim (emu_blk->bdim)
#define gridDim (emu_blk->gdim)

inline void emu_wait(int kind) {
    emu_cur->state = kind;
    swapcontext(&emu_cur->ctx, &emu_blk->sched);
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wait(EMU_WARP); }
inline void __syncthreads() { emu_wait(EMU_BLOCK); }
inline void __threadfence() {}
inline void __trap() {
    fprintf(stderr, "emu: __trap\n");
    abort();
}

inline unsigned emu_lane() { return threadIdx.x & 31; }
template <class T> T emu_shfl(T v, int src, bool keep) {
    const unsigned lane = emu_lane(), warp = threadIdx.x >> 5;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    emu_blk->xchg[warp][lane] = bits;
    __syncwarp();
    T r = v;
    if (!keep) memcpy(&r, &emu_blk->xchg[warp][src & 31], sizeof(T));
    __syncwarp();
    return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return emu_shfl(v, (int)emu_lane() ^ o, false); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src, false); }
template <class T> T __shfl_up_sync(unsigned, T v, unsigned d) {
    const int src = (int)emu_lane() - (int)d;
    return emu_shfl(v, src, src < 0);
}

// The live lanes of the warp whose v equals this lane's.
inline unsigned __match_any_sync(unsigned, int v) {
    const unsigned lane = emu_lane(), warp = threadIdx.x >> 5;
    emu_blk->xchg[warp][lane] = (unsigned)v;
    __syncwarp();
    unsigned r = 0;
    for (unsigned l = 0; l < 32 && warp * 32 + l < blockDim.x; l++)
        if (emu_blk->f[warp * 32 + l].state != EMU_DONE && emu_blk->xchg[warp][l] == (unsigned)v) r |= 1u << l;
    __syncwarp();
    return r;
}

inline unsigned __ballot_sync(unsigned, int p) {
    const unsigned lane = emu_lane(), warp = threadIdx.x >> 5;
    emu_blk->xchg[warp][lane] = p != 0;
    __syncwarp();
    unsigned r = 0;
    for (unsigned l = 0; l < 32 && warp * 32 + l < blockDim.x; l++)
        if (emu_blk->f[warp * 32 + l].state != EMU_DONE && emu_blk->xchg[warp][l]) r |= 1u << l;
    __syncwarp();
    return r;
}

// mma.sync.aligned.m16n8k{16,32}.row.col.s32.s8.s8.s32 with C = D: a warp collective. Every lane
// publishes its A and B registers, then computes its own accumulators from the whole matrices.
// PTX ISA fragments (g = lane / 4, t = lane % 4, element j of a register is its byte j): A register
// r (K / 8 of them) holds row g + 8 (r & 1), columns 4t + j + 16 (r >> 1); B register r (K / 16)
// holds rows 4t + j + 16 r of column g; accumulator i is row g + 8 (i >> 1), column 2t + (i & 1).
template <int K> void emu_mma_s8(int* d, const unsigned* a, const unsigned* b) {
    static_assert(K == 16 || K == 32, "the int8 shapes m16n8k16 and m16n8k32");
    const unsigned lane = emu_lane(), warp = threadIdx.x >> 5;
    unsigned* mine = emu_blk->mma[warp][lane];
    for (int r = 0; r < K / 8; r++) mine[r] = a[r];
    for (int r = 0; r < K / 16; r++) mine[4 + r] = b[r];
    __syncwarp();
    int A[16][K], B[K][8];
    for (unsigned l = 0; l < 32; l++) {
        const unsigned g = l >> 2, t = l & 3;
        const unsigned* f = emu_blk->mma[warp][l];
        for (unsigned r = 0; r < K / 8; r++)
            for (unsigned j = 0; j < 4; j++) A[g + 8 * (r & 1)][4 * t + j + 16 * (r >> 1)] = (signed char)(f[r] >> (8 * j));
        for (unsigned r = 0; r < K / 16; r++)
            for (unsigned j = 0; j < 4; j++) B[4 * t + j + 16 * r][g] = (signed char)(f[4 + r] >> (8 * j));
    }
    __syncwarp();
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 4; i++) {
        const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        long long s = d[i];
        for (unsigned k = 0; k < K; k++) s += (long long)A[row][k] * B[k][col];
        d[i] = (int)(unsigned)s;  // .s32 wraps
    }
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: a warp collective. Lanes 8 q .. 8 q + 7 give the
// addresses of matrix q's 8 rows (16 bytes each); register q of lane l gets bytes 4 (l % 4) ..
// of row l / 4 of matrix q.
inline void emu_ldmatrix_x4(unsigned* d, const void* p) {
    const unsigned lane = emu_lane(), warp = threadIdx.x >> 5;
    emu_blk->xchg[warp][lane] = (unsigned long long)(uintptr_t)p;
    __syncwarp();
    for (unsigned q = 0; q < 4; q++) {
        const unsigned char* row = (const unsigned char*)(uintptr_t)emu_blk->xchg[warp][8 * q + lane / 4];
        memcpy(&d[q], row + 4 * (lane % 4), 4);
    }
    __syncwarp();
}
inline void emu_cp_async(void* dst, const void* src, unsigned n) { emu_cur->async.push_back(EmuCopy{dst, src, n}); }
inline void emu_cp_async_wait() {
    for (const EmuCopy& c : emu_cur->async) memcpy(c.dst, c.src, c.n);
    emu_cur->async.clear();
}

template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcs(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
// PTX prmt.b32 (default mode): byte n of the result is byte c_n & 7 of b:a (a the low four), or
// that byte's sign bit replicated when bit 3 of c_n, the selector's nibble n, is set.
inline unsigned emu_prmt(unsigned a, unsigned b, unsigned c) {
    const unsigned long long v = (unsigned long long)b << 32 | a;
    unsigned r = 0;
    for (int n = 0; n < 4; n++) {
        const unsigned cn = (c >> (4 * n)) & 15;
        unsigned byte = (unsigned)(v >> (8 * (cn & 7))) & 255;
        if (cn & 8) byte = byte & 128 ? 255 : 0;
        r |= byte << (8 * n);
    }
    return r;
}
template <class To, class From>
inline To bits_as(From v) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To t;
    memcpy(&t, &v, sizeof t);
    return t;
}
inline float __int_as_float(int x) { return bits_as<float>(x); }
inline float __uint_as_float(unsigned x) { return bits_as<float>(x); }
inline unsigned __float_as_uint(float f) { return bits_as<unsigned>(f); }
inline int __float_as_int(float f) { return bits_as<int>(f); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned o = *p;
    *p = o + v;
    return o;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
    const unsigned o = *p;
    *p = o | v;
    return o;
}
inline int atomicMax(int* p, int v) {
    const int o = *p;
    if (v > o) *p = v;
    return o;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// f16 <-> f32 as the PTX cvt instructions do (round to nearest even, subnormals kept).
inline float emu_h2f(unsigned short h) {
    const unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
inline unsigned short emu_f2h(float f) {
    const _Float16 h = (_Float16)f;
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}

// Runs `kernel` over a grid as CUDA would (blocks one after another).
void emu_launch(emu_dim3 grid, unsigned block, const std::function<void()>& body);
// When not empty, the order emu_launch runs a one-row grid's blocks in (blockIdx.x values): to
// check that a kernel's result does not depend on the order its blocks run in.
extern std::vector<unsigned> emu_block_order;
