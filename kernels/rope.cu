// RopeTail: rotate the last n_rot dims of each head by a host-computed table of (cos, sin) per
// position and pair, the very values the CPU reference rotates by. pos_mode 0 rotates by the
// token's position; 1 by the first position of this token's compressed row (pos + 1 - ratio).
extern "C" __global__ void rope_tail(DS4_ARGS, float* __restrict__ x, u32 n_head, u32 head_dim, u32 n_rot,
                                     const float* __restrict__ table, u32 pos_mode, u32 ratio, u32 inverse) {
    DS4_GUARD;
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 pairs = n_rot / 2;
    if (t >= n_head * pairs) return;
    const u32 h = t / pairs, k = t % pairs;
    const u32 pos = pos_mode == 0 ? P->pos : (P->pos + 1 >= ratio ? P->pos + 1 - ratio : 0);
    const float c = table[((u64)pos * pairs + k) * 2];
    const float s0 = table[((u64)pos * pairs + k) * 2 + 1];
    const float s = inverse ? -s0 : s0;
    float* tail = x + (u64)h * head_dim + (head_dim - n_rot);
    const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
    tail[2 * k] = x0 * c - x1 * s;
    tail[2 * k + 1] = x0 * s + x1 * c;
}
