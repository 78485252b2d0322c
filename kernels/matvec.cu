// MatVec and MatVecGrouped: dense F16 / F32 / Q8_0 weights. Q8_0 quantizes the activation per
// 32 first (d = amax/127, round half to even), then does integer dots, as ds4's CPU path does.
// Every row sums in the CPU reference's order (sequentially), so results match it bit for bit.
// Rows of group g read x[g*in_dim ..].

// One warp per 32-block.
extern "C" __global__ void quantize_q8_0(DS4_ARGS, const float* __restrict__ x, i8* __restrict__ xq,
                                         float* __restrict__ xd, u32 n) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31;
    const u32 b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b * 32 >= n) return;
    const float v = x[b * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q = (int)rintf(v * id);
    q = max(-128, min(127, q));
    xq[b * 32 + lane] = (i8)q;
    if (lane == 0) xd[b] = d;
}

// One warp per row: lanes compute each block's term f16(d_w)·d_x·isum (integer dots are exact in
// any order), then lane 0 adds the terms in block order.
#define Q8_MAX_BLOCKS 512
extern "C" __global__ void mat_vec_q8_0(DS4_ARGS, const u8* __restrict__ w, const i8* __restrict__ xq,
                                        const float* __restrict__ xd, float* __restrict__ out, u32 in_dim, u32 rows,
                                        u32 rows_per_group) {
    DS4_GUARD;
    __shared__ float terms[8][Q8_MAX_BLOCKS];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= rows) return;
    const u32 nb = in_dim / 32;
    const u32 g = r / rows_per_group;
    const u8* row = w + (u64)r * nb * 34;
    const int* x4 = (const int*)(xq + (u64)g * in_dim);
    const float* dx = xd + (u64)g * nb;
    float* t = terms[warp];
    for (u32 b = lane; b < nb; b += 32) {
        const u8* blk = row + (u64)b * 34;
        const u16* q16 = (const u16*)(blk + 2);  // blocks are 2-byte aligned, not 4
        int isum = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int wq = (int)((u32)q16[2 * k] | ((u32)q16[2 * k + 1] << 16));
            isum = __dp4a(wq, x4[b * 8 + k], isum);
        }
        t[b] = h2f(*(const u16*)blk) * dx[b] * (float)isum;
    }
    __syncwarp();
    if (lane == 0) {
        float acc = 0.0f;
        for (u32 b = 0; b < nb; b++) acc += t[b];
        out[r] = acc;
    }
}

// One warp per row. The lanes form the products h2f(w)·x of 256 columns at a time (16-byte
// loads, coalesced) into shared memory; lane 0 then adds them in column order, which is the
// reference's sequential sum. The chain of adds sets the time, so the loads must not.
extern "C" __global__ void mat_vec_f16(DS4_ARGS, const u16* __restrict__ w, const float* __restrict__ x,
                                       float* __restrict__ out, u32 in_dim, u32 rows, u32 rows_per_group) {
    DS4_GUARD;
    __shared__ float prod[8][256];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= rows) return;
    const u16* row = w + (u64)r * in_dim;
    const float* xg = x + (u64)(r / rows_per_group) * in_dim;
    float* p = prod[warp];
    float acc = 0.0f;
    if ((in_dim & 7) == 0) {
        for (u32 c0 = 0; c0 < in_dim; c0 += 256) {
            const u32 c = c0 + lane * 8;
            if (c < in_dim) {
                const uint4 q = *(const uint4*)(row + c);
                const float4 a = *(const float4*)(xg + c), b = *(const float4*)(xg + c + 4);
                float* o = p + lane * 8;
                o[0] = h2f((u16)(q.x & 0xffff)) * a.x;
                o[1] = h2f((u16)(q.x >> 16)) * a.y;
                o[2] = h2f((u16)(q.y & 0xffff)) * a.z;
                o[3] = h2f((u16)(q.y >> 16)) * a.w;
                o[4] = h2f((u16)(q.z & 0xffff)) * b.x;
                o[5] = h2f((u16)(q.z >> 16)) * b.y;
                o[6] = h2f((u16)(q.w & 0xffff)) * b.z;
                o[7] = h2f((u16)(q.w >> 16)) * b.w;
            }
            __syncwarp();
            if (lane == 0) {
                const u32 n = min(256u, in_dim - c0);
#pragma unroll 8
                for (u32 i = 0; i < n; i++) acc += p[i];
            }
            __syncwarp();
        }
    } else if (lane == 0) {
        for (u32 i = 0; i < in_dim; i++) acc += h2f(row[i]) * xg[i];
    }
    if (lane == 0) out[r] = acc;
}

// One thread per row; ds4 accumulates F32 matvecs in double.
extern "C" __global__ void mat_vec_f32(DS4_ARGS, const float* __restrict__ w, const float* __restrict__ x,
                                       float* __restrict__ out, u32 in_dim, u32 rows, u32 rows_per_group) {
    DS4_GUARD;
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = w + (u64)r * in_dim;
    const float* xg = x + (u64)(r / rows_per_group) * in_dim;
    double acc = 0.0;
    for (u32 i = 0; i < in_dim; i++) acc += (double)row[i] * xg[i];
    out[r] = (float)acc;
}
