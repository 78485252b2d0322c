// RopeTail: rotate the last n_rot dims of each head by a host-computed table of (cos, sin) per
// position and pair, the very values the CPU reference rotates by. pos_mode 0 rotates by the
// token's position; 1 by the first position of this token's compressed row (pos + 1 - ratio).

// Pair k of one head's tail, with `trow` the table's row for the position.
__device__ __forceinline__ void rope_pair(float* tail, const float* trow, u32 k, bool inverse) {
    const float c = trow[2 * k];
    const float s0 = trow[2 * k + 1];
    const float s = inverse ? -s0 : s0;
    const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
    tail[2 * k] = x0 * c - x1 * s;
    tail[2 * k + 1] = x0 * s + x1 * c;
}

// Every pair of one head's tail, by the threads of a block.
__device__ __forceinline__ void rope_tail_block(float* tail, const float* trow, u32 pairs, bool inverse) {
    for (u32 k = threadIdx.x; k < pairs; k += blockDim.x) rope_pair(tail, trow, k, inverse);
}

extern "C" __global__ void rope_tail(DS4_ARGS, RopeTailArgs a) {
    DS4_GUARD;
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 pairs = a.n_rot / 2;
    if (t >= a.n_head * pairs) return;
    const u32 h = t / pairs, k = t % pairs;
    const u32 pos = a.pos_mode == 0 ? P->pos : (P->pos + 1 >= a.ratio ? P->pos + 1 - a.ratio : 0);
    float* tail = a.x + (u64)h * a.head_dim + (a.head_dim - a.n_rot);
    rope_pair(tail, a.table + (u64)pos * pairs * 2, k, a.inverse != 0);
}
