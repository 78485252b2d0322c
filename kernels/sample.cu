// Token sampling on the device: the definition is in src/sample.rs (module docs), and this kernel
// picks the same token bit for bit, so only the 4-byte id goes back to the host. One block (any
// multiple of 32 threads up to 1024; the host launches 1024) over the whole vocabulary, launched
// after the token, not part of it.
//
// Greedy: a block argmax, one pass over the logits. Otherwise the K candidates (the K largest
// (logit, id) in the definition's order) are found in two passes: each thread keeps its two
// largest finite order keys, and the K-th largest of those 2 x threads keys is a bound no
// candidate is below (K real logits reach it); the second pass lists every finite logit at or
// above the bound, and when they fit (SAMPLE_LIST) a sort of the list gives the candidates in
// order. When they do not (many ties, flat logits) a radix select (four passes, 8 bits each)
// finds the K-th largest key and gathers the candidates above it plus the lowest ids equal to
// it. Either way they are sorted in shared memory by (logit descending, id ascending), weighted
// with ds4_expf in parallel, and the sequential parts (the sum and prefix sums, the draw) run on
// one thread in the host's order. The logits were just written by the token, so the passes read
// them from L2. The radix path alone took ~150 us a token on the H100 (run at temperature 1
// against greedy, flash-4l: 1058 against 1250 tok/s).
// The most candidates: sample::CANDIDATE_CAP (tests/cuda.rs checks that they agree).
#define DS4_SAMPLE_CAP 1024
// The most logits the bound may let through to the sort (32 KB of shared memory as keys and ids).
#define SAMPLE_LIST 4096

// A float's position in f32::total_cmp order, as an unsigned key: negative values with every
// bit flipped, the others with the sign bit set.
__device__ __forceinline__ u32 sample_order_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ bool sample_is_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// Each thread takes 8 consecutive logits of a tile (two 16-byte loads, so that enough bytes are
// in flight for one block to stream the vocabulary): ids first .. first + 7. Past the end: NaN,
// which is never a candidate and never the argmax.
#define SAMPLE_PER_THREAD 8
__device__ __forceinline__ void sample_load(const float* logits, u32 n, u32 first, float* v) {
    if (first + SAMPLE_PER_THREAD <= n && ((u64)logits & 15) == 0) {
        const float4 x = *(const float4*)(logits + first), y = *(const float4*)(logits + first + 4);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
        v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    } else {
        for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) v[j] = first + j < n ? logits[first + j] : __int_as_float(0x7fc00000);
    }
}

// Block-wide exclusive prefix sum of `v` in thread order; every thread gets the total too.
// `part` holds one word per warp. Every thread of the block must call it.
__device__ u32 sample_block_scan(u32 v, u32* part, u32* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 x = v;
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // an earlier call may still be reading `part`
    if (lane == 31) part[warp] = x;
    __syncthreads();
    u32 before = 0, all = 0;
    for (u32 w = 0; w < nw; w++) {
        if (w < warp) before += part[w];
        all += part[w];
    }
    *total = all;
    return before + x - v;
}

// Block-wide minimum; every thread gets it. Every thread of the block must call it.
__device__ u32 sample_block_min(u32 v, u32* part) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 m = part[0];
    for (u32 w = 1; w < (blockDim.x >> 5); w++) m = min(m, part[w]);
    return m;
}

// Sorts x[0, count) descending in shared memory (bitonic, over the next power of two, padded
// with 0, which sorts last); `x` must hold that many. Every thread of the block must call it.
template <class T> __device__ void sample_sort_desc(T* x, u32 count) {
    const u32 t = threadIdx.x, nt = blockDim.x;
    u32 width = 1;
    while (width < count) width <<= 1;
    for (u32 i = count + t; i < width; i += nt) x[i] = 0;
    __syncthreads();
    for (u32 size = 2; size <= width; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 i = t; i < width; i += nt) {
                const u32 j = i ^ stride;
                if (j > i) {
                    const T p = x[i], q = x[j];
                    const bool descending = (i & size) == 0;
                    if (descending ? p < q : p > q) {
                        x[i] = q;
                        x[j] = p;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// 32 to 40 registers a thread (ptxas for sm_89, sm_90, sm_121): a block of 1024 fits.
// `use_list` false: always the radix select (scripts/sample-emulate compares the two).
__device__ void sample_token_block(const SampleTokenArgs& a, bool use_list) {
    const float* logits = a.logits;
    const u32 n = a.n, t = threadIdx.x, nt = blockDim.x, lane = t & 31, warp = t >> 5, nw = nt >> 5;
    const u32 tile = nt * SAMPLE_PER_THREAD;
    __shared__ u32 part[32];
    __shared__ u32 hist[256];
    __shared__ u32 s_k, s_digit, s_above, s_count, s_slot;
    // Candidates as (order key << 32) | ~id: descending order is (logit desc, id asc).
    __shared__ u64 cand[SAMPLE_LIST];
    // The weights and their prefix sums; before them, each thread's two largest keys.
    __shared__ float weights[2 * DS4_SAMPLE_CAP];
    float* prob = weights;
    float* prefix = weights + DS4_SAMPLE_CAP;
    u32* tops = (u32*)weights;

    const bool greedy = !(a.temperature > 0.0f);
    // K, the K-th largest order key among the finite logits (the threshold), how many keys
    // equal to it are candidates, and how many there are.
    u32 k = 0, threshold = 0, need_eq = 0, n_eq = 0;
    bool listed = false;
    if (!greedy && use_list) {
        // Each thread's two largest finite keys (0: none; a finite logit's key is not 0).
        u32 top1 = 0, top2 = 0, finite = 0;
        for (u32 base = 0; base < n; base += tile) {
            float v[SAMPLE_PER_THREAD];
            sample_load(logits, n, base + t * SAMPLE_PER_THREAD, v);
#pragma unroll
            for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                if (!sample_is_finite(v[j])) continue;
                const u32 key = sample_order_key(v[j]);
                finite++;
                if (key > top1) {
                    top2 = top1;
                    top1 = key;
                } else if (key > top2) {
                    top2 = key;
                }
            }
        }
        u32 all_finite;
        sample_block_scan(finite, part, &all_finite);
        k = min(min(a.top_k, (u32)DS4_SAMPLE_CAP), all_finite);
        tops[2 * t] = top1;
        tops[2 * t + 1] = top2;
        sample_sort_desc(tops, 2 * nt);
        const u32 bound = k > 0 && k <= 2 * nt ? tops[k - 1] : 0;
        if (t == 0) s_slot = 0;
        __syncthreads();
        // List every finite key at or above the bound, a warp's entries at once.
        for (u32 base = 0; base < n && k > 0; base += tile) {
            const u32 first = base + t * SAMPLE_PER_THREAD;
            float v[SAMPLE_PER_THREAD];
            sample_load(logits, n, first, v);
#pragma unroll
            for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                const u32 key = sample_order_key(v[j]);
                const bool take = sample_is_finite(v[j]) && key >= bound;
                const u32 ballot = __ballot_sync(0xffffffffu, take);
                if (ballot == 0) continue;
                u32 at = 0;
                if (lane == 0) at = atomicAdd(&s_slot, (u32)__popc(ballot));
                at = __shfl_sync(0xffffffffu, at, 0) + (u32)__popc(ballot & ((1u << lane) - 1));
                if (take && at < SAMPLE_LIST) cand[at] = ((u64)key << 32) | (u64)(~(first + j));
            }
        }
        __syncthreads();
        const u32 listed_n = s_slot;
        if (k > 0 && listed_n <= SAMPLE_LIST) {
            sample_sort_desc(cand, listed_n);
            listed = true;
        }
    }
    if (!greedy && !listed) {
        // Radix select, 8 bits at a time from the top. `threshold`/`mask` hold the digits found
        // so far; `remaining` counts the candidates still to take among the keys matching them.
        u32 mask = 0, remaining = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (u32 i = t; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            // Whole warps step together, so lanes with the same digit add with one atomic.
            for (u32 base = 0; base < n; base += tile) {
                float v[SAMPLE_PER_THREAD];
                sample_load(logits, n, base + t * SAMPLE_PER_THREAD, v);
#pragma unroll
                for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                    const u32 key = sample_order_key(v[j]);
                    const u32 digit =
                        sample_is_finite(v[j]) && (key & mask) == threshold ? (key >> shift) & 255 : 256;
                    const u32 peers = __match_any_sync(0xffffffffu, digit);
                    if (digit < 256 && lane == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[digit], (u32)__popc(peers));
                }
            }
            __syncthreads();
            if (t == 0) {
                if (shift == 24) {
                    // The first pass counts every finite logit, so K is known now.
                    u32 finite = 0;
                    for (u32 d = 0; d < 256; d++) finite += hist[d];
                    s_k = min(min(a.top_k, (u32)DS4_SAMPLE_CAP), finite);
                }
                // The digit at which the count from the top reaches the candidates wanted.
                const u32 want = shift == 24 ? s_k : remaining;
                u32 above = 0, d = 255;
                while (d > 0 && above + hist[d] < want) {
                    above += hist[d];
                    d--;
                }
                s_digit = d;
                s_above = above;
                s_count = hist[d];
            }
            __syncthreads();
            if (shift == 24) {
                k = s_k;
                remaining = k;
            }
            threshold |= s_digit << shift;
            mask |= 255u << shift;
            remaining -= s_above;
            n_eq = s_count;  // after the last pass: the keys equal to the threshold
            __syncthreads();  // the shared values and hist are rewritten by the next pass
        }
        need_eq = remaining;
    }

    if (greedy || k == 0) {
        // The argmax (also when no logit is finite): largest by '>', lowest id on ties, 0 when
        // nothing is above -inf.
        float v = __int_as_float(0xff800000);
        int idx = 0;
        for (u32 base = 0; base < n; base += tile) {
            const u32 first = base + t * SAMPLE_PER_THREAD;
            float x[SAMPLE_PER_THREAD];
            sample_load(logits, n, first, x);
#pragma unroll
            for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                if (x[j] > v) {
                    v = x[j];
                    idx = (int)(first + j);
                }
            }
        }
        warp_argmax(&v, &idx);
        __shared__ float best_v[32];
        __shared__ int best_i[32];
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = idx;
        }
        __syncthreads();
        if (t == 0) {
            float bv = best_v[0];
            int bi = best_i[0];
            for (u32 w = 1; w < nw; w++) {
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) {
                    bv = best_v[w];
                    bi = best_i[w];
                }
            }
            *a.out = (u32)bi;
        }
        return;
    }

    if (!listed) {
        // Gather the K candidates: every key above the threshold and the `need_eq` lowest ids equal
        // to it. Slots are taken in any order; the sort below makes the result unique.
        __syncthreads();
        if (t == 0) s_slot = 0;
        __syncthreads();
        u32 eq_before = 0;  // keys equal to the threshold in earlier tiles
        for (u32 base = 0; base < n; base += tile) {
            const u32 first = base + t * SAMPLE_PER_THREAD;
            float v[SAMPLE_PER_THREAD];
            sample_load(logits, n, first, v);
            // This thread's keys equal to the threshold come after `rank` others in id order.
            u32 rank = 0, mine = 0;
            if (n_eq != need_eq) {
                // Only some of the equal keys are kept: rank them (all kept is the common case).
#pragma unroll
                for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                    mine += sample_is_finite(v[j]) && sample_order_key(v[j]) == threshold;
                }
                u32 tile_eq;
                rank = eq_before + sample_block_scan(mine, part, &tile_eq);
                eq_before += tile_eq;
            }
#pragma unroll
            for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                const u32 key = sample_order_key(v[j]);
                if (!sample_is_finite(v[j]) || key < threshold) continue;
                if (key == threshold && n_eq != need_eq && rank++ >= need_eq) continue;
                cand[atomicAdd(&s_slot, 1u)] = ((u64)key << 32) | (u64)(~(first + j));
            }
        }
        __syncthreads();

        sample_sort_desc(cand, k);
    }

    // Weights, each on its own thread (the same ops as the host, so the same bits).
    const float max = logits[~(u32)cand[0]];
    for (u32 c = t; c < k; c += nt) prob[c] = ds4_expf((logits[~(u32)cand[c]] - max) / a.temperature);
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (u32 c = 0; c < k; c++) {
            s += prob[c];
            prefix[c] = s;
        }
    }
    __syncthreads();
    // The cut: kept = min(first c > 0 under min-p, first c whose prefix reaches top-p, plus 1).
    const float sum = prefix[k - 1];
    const float min_prob = prob[0] / sum * a.min_p;
    u32 cut = k;
    for (u32 c = t; c < k; c += nt) {
        if (c > 0 && prob[c] / sum < min_prob) cut = min(cut, c);
        if (prefix[c] / sum >= a.top_p) cut = min(cut, c + 1);
    }
    const u32 kept = sample_block_min(cut, part);
    if (t == 0) {
        float r = a.r * prefix[kept - 1];
        u32 pick = kept - 1;
        for (u32 c = 0; c < kept; c++) {
            r -= prob[c];
            if (r <= 0.0f) {
                pick = c;
                break;
            }
        }
        *a.out = ~(u32)cand[pick];
    }
}

extern "C" __global__ void sample_token(DS4_ARGS, SampleTokenArgs a) {
    DS4_GUARD;
    sample_token_block(a, true);
}
