// The expert cache (placement "host", src/placement.rs): routed experts live in page-locked host
// memory and the kernels reach each expert through a table (kernels/moe.cu, ExpertRow). Device
// memory left over holds slots, each a copy of one expert's gate, up and down. After the router
// picks a token's experts, expert_cache_plan (one thread) looks them up, evicts the least
// recently used slots for the ones missing and points their table entries at those slots;
// expert_cache_copy (every block) then copies the missing experts in from host memory. Both run
// inside the token's graph: no host round trip. An expert with no slot free (more used than
// slots) is read from host memory directly. The weights and so the results never change.
//
// State of one layer, as i32 (laid out by backends/cuda/mod.rs): n_slots, tick, n_jobs, jobs_at,
// slot_expert[n_slots], slot_stamp[n_slots], expert_slot[n_expert]; from i32 index jobs_at
// (8-byte aligned) the copy jobs of this token, (source, destination, bytes) as u64 each.

#define CACHE_PIECES 6

// Offset of piece p (gate quants, gate rest, up quants, up rest, down quants, down rest) in a
// slot: each piece starts 256-aligned (backends/cuda/mod.rs sizes slots the same way).
__device__ __forceinline__ u64 cache_piece_offset(const u32* sizes, u32 p) {
    u64 off = 0;
    for (u32 i = 0; i < p; i++) off += ((u64)sizes[i] + 255) / 256 * 256;
    return off;
}

extern "C" __global__ void expert_cache_plan(DS4_ARGS, ExpertCachePlanArgs a) {
    DS4_GUARD;
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int* st = a.state;
    const int n_slots = st[0];
    const int tick = st[1] + 1;
    st[1] = tick;
    int* slot_expert = st + 4;
    int* stamp = slot_expert + n_slots;
    int* expert_slot = stamp + n_slots;
    u64* jobs = (u64*)(st + st[3]);
    int n_jobs = 0;
    u64* tables[3] = {a.gate_table, a.up_table, a.down_table};
    const u64* homes[3] = {a.gate_home, a.up_home, a.down_home};
    const u32 sizes[CACHE_PIECES] = {a.gate_qs, a.gate_rest, a.up_qs, a.up_rest, a.down_qs, a.down_rest};
    u64 hits = 0, copies = 0, direct = 0;
    for (u32 s = 0; s < a.n_used; s++) {
        const int e = min(max(a.selected[s], 0), (int)a.n_expert - 1);
        const int k = expert_slot[e];
        if (k >= 0) {
            stamp[k] = tick;
            hits++;
            continue;
        }
        int best = -1;
        for (int j = 0; j < n_slots; j++)
            if (stamp[j] != tick && (best < 0 || stamp[j] < stamp[best])) best = j;
        if (best < 0) {  // every slot holds an expert of this token: read this one from host memory
            direct++;
            continue;
        }
        const int old = slot_expert[best];
        if (old >= 0) {
            expert_slot[old] = -1;
            for (int t = 0; t < 3; t++) {
                tables[t][2 * old] = homes[t][2 * old];
                tables[t][2 * old + 1] = homes[t][2 * old + 1];
            }
        }
        slot_expert[best] = e;
        expert_slot[e] = best;
        stamp[best] = tick;
        const u64 base = (u64)a.slots + (u64)best * a.slot_bytes;
        for (u32 p = 0; p < CACHE_PIECES; p++) {
            const u64 dst = base + cache_piece_offset(sizes, p);
            tables[p / 2][2 * e + (p & 1)] = dst;
            jobs[3 * n_jobs] = homes[p / 2][2 * e + (p & 1)];
            jobs[3 * n_jobs + 1] = dst;
            jobs[3 * n_jobs + 2] = sizes[p];
            n_jobs++;
        }
        copies++;
    }
    st[2] = n_jobs;
    a.stats[0] += hits;
    a.stats[1] += copies;
    a.stats[2] += direct;
}

extern "C" __global__ void expert_cache_copy(DS4_ARGS, ExpertCacheCopyArgs a) {
    DS4_GUARD;
    const int n_jobs = a.state[2];
    const u64* jobs = (const u64*)(a.state + a.state[3]);
    const u64 stride = (u64)gridDim.x * blockDim.x, first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (int j = 0; j < n_jobs; j++) {
        const u8* src = (const u8*)jobs[3 * j];
        u8* dst = (u8*)jobs[3 * j + 1];
        const u64 n = jobs[3 * j + 2];
        if ((((u64)src | (u64)dst | n) & 15) == 0) {
            for (u64 i = first; i < n / 16; i += stride) ((uint4*)dst)[i] = ((const uint4*)src)[i];
        } else {
            for (u64 i = first; i < n; i += stride) dst[i] = src[i];
        }
    }
}
