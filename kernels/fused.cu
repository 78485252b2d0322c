// Fused launches: runs of small ops of one layer in one kernel. Each op's arithmetic is its own
// kernel's (the same device functions, the same order), so fusing changes no bit; only the
// launches between them go. backends/cuda/plan.rs decides which runs fuse.

// After the q and kv projections: each q head RMS-normalized in place (no weight) and its tail
// rotated; the kv row RMS-normalized with its weight, rotated, fp8 round-tripped and stored into
// the raw ring at pos % raw_cap. Blocks 0..n_head take a q head each, block n_head the kv row.
extern "C" __global__ void qkv_finish(DS4_ARGS, const QkvFinishArgs a) {
    DS4_GUARD;
    const u32 hd = a.head_dim, pairs = a.n_rot / 2, h = blockIdx.x;
    const float* trow = a.table + (u64)P->pos * pairs * 2;
    if (h < a.n_head) {
        float* x = a.q + (u64)h * hd;
        const float scale = rms_scale_block(x, hd, a.eps_q);
        for (u32 i = threadIdx.x; i < hd; i += blockDim.x) x[i] = x[i] * scale;
        __syncthreads();
        rope_tail_block(x + (hd - a.n_rot), trow, pairs, false);
        return;
    }
    const float scale = rms_scale_block(a.kv_raw, hd, a.eps_kv);
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        const float v = a.kv_raw[i] * scale;
        a.kv[i] = v * a.kv_norm[i];
    }
    __syncthreads();
    rope_tail_block(a.kv + (hd - a.n_rot), trow, pairs, false);
    __syncthreads();
    fp8_round_trip_block(a.kv, hd - a.n_rot);
    __syncthreads();
    float* dst = a.cache + (u64)(P->pos % a.raw_cap) * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = round_f16(a.kv[i]);
}

// One compressor lane of a token, one block: the window state update (compressor_store), then,
// on an emit token (`emit_cond`), the pool, the RMS norm with weight, the RoPE of the row's tail
// at its first position, the fp8 (quant 0) or Hadamard + FP4 (quant 1) round trip, the f16 store
// as compressed row (pos+1)/ratio - 1, and for ratio 4 the window shift.
extern "C" __global__ void compressor_update(DS4_ARGS, const CompressorUpdateArgs a) {
    DS4_GUARD;
    const u32 width = a.width, ratio = a.ratio, hd = a.head_dim, pos = P->pos;
    const u32 pos_mod = pos % ratio;
    const u32 srow = ratio == 4 ? 4 + pos_mod : pos_mod;
    for (u32 j = threadIdx.x; j < width; j += blockDim.x) {
        a.state_kv[(u64)srow * width + j] = a.kv[j];
        a.state_score[(u64)srow * width + j] = a.score[j] + wload(a.ape, a.ape_f16, (u64)pos_mod * width + j);
    }
    if (!ds4_cond(P, a.emit_cond)) return;
    __syncthreads();
    for (u32 j = threadIdx.x; j < hd; j += blockDim.x)
        a.pooled[j] = compressor_pool_value(a.state_kv, a.state_score, hd, ratio, j);
    __syncthreads();
    const float scale = rms_scale_block(a.pooled, hd, a.eps);
    for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
        const float v = a.pooled[j] * scale;
        a.row[j] = v * a.norm_w[j];
    }
    __syncthreads();
    const u32 pairs = a.n_rot / 2;
    const u32 rpos = pos + 1 >= ratio ? pos + 1 - ratio : 0;
    rope_tail_block(a.row + (hd - a.n_rot), a.table + (u64)rpos * pairs * 2, pairs, false);
    __syncthreads();
    if (a.quant == 0) fp8_round_trip_block(a.row, hd - a.n_rot);
    else indexer_qat_block(a.row);
    __syncthreads();
    const u32 n = (pos + 1) / ratio;
    if (n > 0)
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) a.cache[(u64)(n - 1) * hd + j] = round_f16(a.row[j]);
    if (ratio == 4) {
        const u32 ns = ratio * width;
        for (u32 i = threadIdx.x; i < ns; i += blockDim.x) {
            a.state_kv[i] = a.state_kv[ns + i];
            a.state_score[i] = a.state_score[ns + i];
        }
    }
}

// Barrier `id` over the first `n` threads that reach it (a multiple of 32), for warps that
// synchronize among themselves while another warp of the block does something else.
__device__ __forceinline__ void named_barrier(u32 id, u32 n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// rms_scale_block for the `n_threads` threads from warp `w0` on, synchronized by named barrier 1:
// the same chunk sums added in the same order, so the same scale.
__device__ float rms_scale_warps(const float* x, u32 n, float eps, u32 w0, u32 n_threads) {
    __shared__ float chunk_sums[NORM_MAX_CHUNKS];
    __shared__ float scale_sh;
    const u32 lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) - w0, nw = n_threads >> 5;
    const u32 n_chunks = (n + DS4_CHUNK - 1) / DS4_CHUNK;
    for (u32 c = warp; c < n_chunks; c += nw) {
        const float* xc = x + c * DS4_CHUNK;
        const float s = warp_sum(chunk_dot_f32(xc, xc, n - c * DS4_CHUNK, lane));
        if (lane == 0) chunk_sums[c] = s;
    }
    named_barrier(1, n_threads);
    if (warp == 0 && lane == 0) {
        float ss = 0.0f;
        for (u32 c = 0; c < n_chunks; c++) ss += chunk_sums[c];
        scale_sh = 1.0f / sqrtf(ss / (float)n + eps);
    }
    named_barrier(1, n_threads);
    const float scale = scale_sh;
    named_barrier(1, n_threads);
    return scale;
}

// Lane sum of one 512-term chunk of an F16 row times x * scale (the RMS-normalized input, each
// value rounded as rms_norm stores it), in chunk_dot_f16's order.
__device__ __forceinline__ float chunk_dot_f16_scaled(const F16Chunk& c, const float* x, float scale, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const uint4 q = c.q[u];
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += h2f((u16)(q.x & 0xffff)) * (p.x * scale);
            acc += h2f((u16)(q.x >> 16)) * (p.y * scale);
            acc += h2f((u16)(q.y & 0xffff)) * (p.z * scale);
            acc += h2f((u16)(q.y >> 16)) * (p.w * scale);
            acc += h2f((u16)(q.z & 0xffff)) * (s.x * scale);
            acc += h2f((u16)(q.z >> 16)) * (s.y * scale);
            acc += h2f((u16)(q.w & 0xffff)) * (s.z * scale);
            acc += h2f((u16)(q.w >> 16)) * (s.w * scale);
        }
    }
    return acc;
}

// The HC pre-mix of a half-layer: the plain RMS norm of the streams (`flat`), the F16 control
// projection (`mix`, split-K as mat_vec_f16_split: every block computes the norm's scale itself),
// then in the last block to finish: the Sinkhorn split, the weighted sum of the streams (`cur`)
// and the sublayer's RMS norm with weight (`norm`, with its Q8_0 quantization when `xq` is set).
#define HC_PRE_MAX_PARTIALS 2048
#define HC_PRE_MAX_EMBD 8192
extern "C" __global__ void __launch_bounds__(1024) hc_pre(DS4_ARGS, const HcPreArgs a) {
    DS4_GUARD_EARLY;
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 n = a.hc_dim;
    const u32 wid = blockIdx.x * nw + warp;
    const bool live = wid < a.mix_rows * a.n_chunks;
    const u32 r = live ? wid / a.n_chunks : 0, c = live ? (wid % a.n_chunks) * DS4_CHUNK : 0;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(a.fn_w + (u64)r * n + c, n - c, lane);
    ds4_wait_predecessor();
    const float scale = rms_scale_block(a.x, n, a.eps_flat);
    if (live) {
        const float s = warp_sum(chunk_dot_f16_scaled(chunk, a.x + c, scale, n - c, lane));
        if (lane == 0) a.partial[wid] = s;
        if (r == 0)
            for (u32 i = lane; i < min((u32)DS4_CHUNK, n - c); i += 32) a.flat[c + i] = a.x[c + i] * scale;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The last block: the chunk sums staged in shared memory by all threads at once (their
    // loads overlap), then each row's sums added in order by one thread.
    __shared__ float sums[HC_PRE_MAX_PARTIALS];
    __shared__ __align__(16) float cur[HC_PRE_MAX_EMBD];
    const u32 n_part = a.mix_rows * a.n_chunks;
    for (u32 i = threadIdx.x; i < n_part; i += blockDim.x) sums[i] = __ldcg(a.partial + i);
    __syncthreads();
    for (u32 row = threadIdx.x; row < a.mix_rows; row += blockDim.x) {
        float total = 0.0f;
        for (u32 k = 0; k < a.n_chunks; k++) total += sums[row * a.n_chunks + k];
        a.mix[row] = total;
    }
    // Only the 4 pre gates feed the weighted sum; the post gates and the Sinkhorn combine matrix
    // wait until hc_post. So warp 0 publishes the pre gates, then runs the whole split while
    // warps 1.. do the weighted sum and the norm, synchronized by a named barrier.
    __shared__ float pre[4];
    if (threadIdx.x < 4) {
        const u32 h = threadIdx.x;
        pre[h] = 1.0f / (1.0f + ds4_expf(-(a.mix[h] * a.scale[0] + a.base[h]))) + a.eps_hc;
    }
    __syncthreads();
    if (warp == 0) {
        hc_split_warp(a.mix, a.scale, a.base, a.split, a.iters, a.eps_hc);
        return;
    }
    const u32 ne = a.n_embd, t = threadIdx.x - 32, nt = blockDim.x - 32;
    for (u32 d = t; d < ne; d += nt) {
        float acc = 0.0f;
        acc += a.x[d] * pre[0];
        acc += a.x[ne + d] * pre[1];
        acc += a.x[2 * ne + d] * pre[2];
        acc += a.x[3 * ne + d] * pre[3];
        cur[d] = acc;
        a.cur[d] = acc;
    }
    named_barrier(1, nt);
    const float s2 = rms_scale_warps(cur, ne, a.eps_norm, 1, nt);
    if (a.xq) {
        for (u32 blk = warp - 1; blk < ne / 32; blk += nw - 1) {
            const u32 i = blk * 32 + lane;
            const float v = cur[i] * s2;
            const float o = v * a.norm_w[i];
            a.norm[i] = o;
            quantize_q8_0_warp(o, a.xq, a.xd, blk, lane);
        }
    } else {
        for (u32 i = t; i < ne; i += nt) {
            const float v = cur[i] * s2;
            a.norm[i] = v * a.norm_w[i];
        }
    }
    if (a.xk) {
        // The routed experts' Q8_K of the same output, as quantize_q8_k makes it: per 256, the
        // value of largest magnitude (lowest index on ties) sets d; a warp per block, lane i
        // holding values i + 32k, the 16-value sums by half-warp shuffles (exact integers).
        for (u32 blk = warp - 1; blk < ne / 256; blk += nw - 1) {
            const u32 base = blk * 256;
            float v[8];
            float am = -1.0f;
            int idx = 0;
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                const u32 i = base + lane + 32 * k;
                v[k] = (cur[i] * s2) * a.norm_w[i];
                if (fabsf(v[k]) > am) {
                    am = fabsf(v[k]);
                    idx = (int)(lane + 32 * k);
                }
            }
            warp_argmax(&am, &idx);
            const u32 bi = base + (u32)idx;
            const float maxv = am == 0.0f ? 0.0f : (cur[bi] * s2) * a.norm_w[bi];
            BlockQ8K* o = a.xk + blk;
            const float iscale = maxv == 0.0f ? 0.0f : -127.0f / maxv;
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                const int q = maxv == 0.0f ? 0 : max(-128, min(127, (int)rintf(iscale * v[k])));
                o->qs[lane + 32 * k] = (i8)q;
                int sum = q;
                for (u32 off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if ((lane & 15) == 0) o->bsums[2 * k + (lane >> 4)] = (i16)sum;
            }
            if (lane == 0) o->d = maxv == 0.0f ? 0.0f : 1.0f / iscale;
        }
    }
    if (t == 0) a.tickets[a.ticket] = 0;
}
