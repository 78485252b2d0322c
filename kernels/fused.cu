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
