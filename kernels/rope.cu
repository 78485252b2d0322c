// RopeTail: rotate the last n_rot dims of each head by a host-computed table of (cos, sin) per
// position and pair, the very values the CPU reference rotates by. pos_mode 0 rotates by the
// token's position; 1 by the first position of this token's compressed row (pos + 1 - ratio).
extern "C" __global__ void rope_tail(DS4_ARGS, const RopeTailArgs a) {
    DS4_GUARD;
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 pairs = a.n_rot / 2;
    if (t >= a.n_head * pairs) return;
    const u32 h = t / pairs, k = t % pairs;
    const u32 pos = a.pos_mode == 0 ? P->pos : (P->pos + 1 >= a.ratio ? P->pos + 1 - a.ratio : 0);
    const float c = a.table[((u64)pos * pairs + k) * 2];
    const float s0 = a.table[((u64)pos * pairs + k) * 2 + 1];
    const float s = a.inverse ? -s0 : s0;
    float* tail = a.x + (u64)h * a.head_dim + (a.head_dim - a.n_rot);
    const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
    tail[2 * k] = x0 * c - x1 * s;
    tail[2 * k + 1] = x0 * s + x1 * c;
}
