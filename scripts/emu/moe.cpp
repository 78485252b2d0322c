// Runs a chunk's routed experts through the old per-row kernels (moe_gate_up[_iq2_xxs] with the
// fused mid Q8_K, moe_down; launched over blockIdx.y as build_chunk did) and through the grouped
// ones (moe_route, moe_gate_up_grouped[_iq2_xxs], quantize_q8_k per row, moe_down_grouped,
// moe_sum_slots), in the emulator, and compares mid, its Q8_K and out bit for bit; in the split
// layout, again with the tensor-core kernels (moe_gate_up_mma_iq2_xxs, moe_down_mma_q2_k) where
// the types have them; with the first of those, moe_gate_up_tile_iq2_xxs's mid against
// moe_gate_up_mma_iq2_xxs's; where the down is Q2_K of at most 8 blocks a row, the decode
// moe_down_q2_k's out against moe_down's; on configs of its own, moe_down_tile_q2_k's parts against
// moe_down_mma_q2_k's; on the smaller configs, the decode moe_gate_up_iq2_xxs with 2 and 3 tasks a
// warp against the generic moe_gate_up. First it checks the emulated int8 MMA against a plain
// matrix product.
#include "emu.h"
#include "kern.inc"
#include "host.h"

#include <chrono>

// n random Q8_K blocks: quants in -127..127, their 16-value sums as quantize_q8_k keeps them, a
// small positive scale.
static void rand_q8k(BlockQ8K* x, u32 n) {
    for (u32 b = 0; b < n; b++) {
        for (int i = 0; i < 256; i++) x[b].qs[i] = (i8)(int)(rnd() % 255 - 127);
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += x[b].qs[16 * j + i];
            x[b].bsums[j] = (i16)s;
        }
        x[b].d = frand(1e-3f, 3e-2f);
    }
}

static unsigned short rand_half_nonzero() {
    // Finite, normal, moderate: exponent 8..18 (2^-7 .. 2^3); never 0 (host.h rand_half may be).
    return (unsigned short)(((rnd() & 1) << 15) | ((8 + rnd() % 11) << 10) | (rnd() & 1023));
}

// One expert tensor: n_expert x rows x nb blocks of type ty, in the split or native layout, and
// its table of (quants, rest) per expert.
struct Experts {
    std::vector<unsigned char> data;
    std::vector<u64> table;
    Experts(u32 ty, u32 n_expert, u32 rows, u32 nb, bool native) {
        u32 bb = 0, at = 0, nq = 0;
        if (!ds4_block_split(ty, &bb, &at, &nq)) abort();
        const u64 blocks = (u64)rows * nb, per_expert = blocks * bb;
        data.resize(per_expert * n_expert + 256);
        for (auto& b : data) b = (unsigned char)rnd();
        unsigned char* base = (unsigned char*)(((uintptr_t)data.data() + 255) & ~(uintptr_t)255);
        // The f16 fields, at their place in the rest (split) or in GGUF's block (native).
        const u32 rb = bb - nq;
        for (u64 i = 0; i < blocks * n_expert; i++) {
            unsigned char* rest = native ? base + i * bb : base + blocks * n_expert * nq + i * rb;
            const u32 d_at = ty == 16 ? 0 : ty == 10 ? (native ? 80 : 16) : 0;
            const u32 nh = ty == 16 ? 1 : 2;
            for (u32 k = 0; k < nh; k++) {
                const unsigned short h = rand_half_nonzero();
                memcpy(rest + d_at + 2 * k, &h, 2);
            }
        }
        for (u32 e = 0; e < n_expert; e++) {
            if (native) {
                const u64 first = (u64)base + e * per_expert;
                table.push_back(first + at);
                table.push_back(first);
            } else {
                table.push_back((u64)base + e * blocks * nq);
                table.push_back((u64)base + blocks * n_expert * nq + e * blocks * rb);
            }
        }
    }
};

struct Config {
    u32 gate_ty, down_ty, in_dim, ff, out_dim, n_expert, n_used, rows, active;
    // When given: expert e gets exactly counts[e] pairs (the active rows' slots, in order).
    std::vector<u32> counts;
};

static u32 blocks_of(u32 n, u32 per) { return n ? (n + per - 1) / per : 1; }

#if !DS4_NATIVE_BLOCKS
// moe_gate_up_tile_iq2_xxs against moe_gate_up_mma_iq2_xxs's mid (`want`), launched as plan.rs
// launches the tile kernel (the same grid; its dynamic shared memory is a static array here).
static int gate_up_tile_check(const Config& c, MoeGateUpGroupedArgs a, RowBuf& route, RowBuf& want, RowBuf& X,
                              RowBuf& SEL, RowBuf& W, size_t mid_bytes,
                              const StepParams* P0, u64 cond) {
    RowBuf mid(mid_bytes, c.rows);
    a.mid = (float*)mid.ptr();
    const RowStrides R = row_strides({X.stride, SEL.stride, W.stride, 0, 0, mid.stride, 0, route.stride});
    const auto t0 = std::chrono::steady_clock::now();
    emu_launch({c.n_expert * blocks_of(c.ff / MOE_MMA_MID_ROWS, 8), 1, 1}, 256,
               [&] { moe_gate_up_tile_iq2_xxs(P0, cond, R, a); });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int bad = 0;
    for (u32 y = 0; y < c.rows; y++) {
        if (y < c.active ? memcmp(mid.row<char>(y), want.row<char>(y), mid_bytes) != 0
                         : mid.row<u32>(y)[0] != 0xababababu) {
            printf("  row %u: tile mid differs\n", y);
            bad++;
        }
    }
    u32 most = 0;
    for (u32 e = 0; e < c.n_expert; e++) most = std::max(most, route.row<u32>(0)[e]);
    printf("gate 16 tile in %u ff %u experts %u used %u rows %u/%u (most pairs %u) split: %s against mma (%.1f s)\n",
           c.in_dim, c.ff, c.n_expert, c.n_used, c.active, c.rows, most, bad ? "DIFFER" : "same bits", secs);
    return bad;
}
#endif

// moe_gate_up_iq2_xxs (the one-task-per-warp grid already ran as the old path) with T = 2, 3 tasks
// per warp (plan.rs moe_gate_up_tasks: whole blocks per slot, so a warp takes rows t, t + stride,
// ...), against the generic moe_gate_up's IQ2_XXS path: mid and its Q8_K bit for bit.
static int gate_up_tasks_check(const Config& c, MoeGateUpArgs a, RowBuf& X, RowBuf& SEL, RowBuf& W,
                               size_t mid_bytes, size_t midq_bytes, const StepParams* P0, u64 cond) {
    // Launches `kernel` on `grid` blocks with fresh mid, Q8_K and tickets.
    auto launch = [&](u32 grid, RowBuf& mid, RowBuf& midq, RowBuf& tickets, auto kernel) {
        a.mid = (float*)mid.ptr();
        a.midq = (BlockQ8K*)midq.ptr();
        a.tickets = (u32*)tickets.ptr();
        const RowStrides R = row_strides({X.stride, SEL.stride, W.stride, 0, 0, mid.stride, 0, midq.stride, tickets.stride});
        emu_launch({grid, c.rows, 1}, 256, [&] { kernel(P0, cond, R, a); });
    };
    RowBuf mid_ref(mid_bytes, c.rows), midq_ref(midq_bytes, c.rows), tickets_ref(c.n_used * 4, c.rows, 0);
    launch(blocks_of(c.n_used * c.ff / 2, 8), mid_ref, midq_ref, tickets_ref, moe_gate_up);
    int bad = 0;
    for (u32 tasks = 2; tasks <= 3; tasks++) {
        RowBuf mid(mid_bytes, c.rows), midq(midq_bytes, c.rows), tickets(c.n_used * 4, c.rows, 0);
        launch(c.n_used * ((blocks_of(c.ff / 2, 8) + tasks - 1) / tasks), mid, midq, tickets, moe_gate_up_iq2_xxs);
        int b = 0;
        for (u32 y = 0; y < c.active; y++) {
            b += memcmp(mid.row<char>(y), mid_ref.row<char>(y), mid_bytes) != 0;
            b += memcmp(midq.row<char>(y), midq_ref.row<char>(y), midq_bytes) != 0;
            for (u32 s = 0; s < c.n_used; s++) b += tickets.row<u32>(y)[s] != 0;
        }
        printf("gate 16 in %u ff %u used %u rows %u/%u: moe_gate_up_iq2_xxs, %u tasks a warp, against moe_gate_up: %s\n",
               c.in_dim, c.ff, c.n_used, c.active, c.rows, tasks, b ? "DIFFER" : "same bits");
        bad += b;
    }
    return bad;
}

static int run(const Config& c, bool native) {
    const u32 nbi = c.in_dim / 256, nbf = c.ff / 256;
    Experts gate(c.gate_ty, c.n_expert, c.ff, nbi, native), up(c.gate_ty, c.n_expert, c.ff, nbi, native);
    Experts down(c.down_ty, c.n_expert, c.out_dim, nbf, native);
    std::vector<u64> grid(256);
    const unsigned char gb[3] = {8, 25, 43};
    for (auto& g : grid) {
        g = 0;
        for (int i = 0; i < 8; i++) g |= (u64)gb[rnd() % 3] << (8 * i);
    }
    // Step parameters: rows past `active` have count 0 (past the chunk's tokens).
    std::vector<StepParams> P(c.rows);
    for (u32 y = 0; y < c.rows; y++) P[y] = StepParams{rnd() % 1000, 100 + y, 0, y < c.active ? 1u : 0u};
    const u64 cond = 1ull << 63;
    RowBuf X(nbi * sizeof(BlockQ8K), c.rows, 0), SEL(c.n_used * 4, c.rows, 0), W(c.n_used * 4, c.rows, 0);
    for (u32 y = 0; y < c.rows; y++) {
        rand_q8k(X.row<BlockQ8K>(y), nbi);
        int* sel = SEL.row<int>(y);
        if (!c.counts.empty()) {
            for (u32 s = 0; s < c.n_used; s++) W.row<float>(y)[s] = frand(0.05f, 1.0f);
            continue;
        }
        // Distinct experts per row (as the router picks), then a few edge cases.
        for (u32 s = 0; s < c.n_used; s++) {
            for (;;) {
                int e = (int)(rnd() % c.n_expert);
                bool dup = false;
                for (u32 k = 0; k < s; k++) dup |= sel[k] == e;
                if (!dup) {
                    sel[s] = e;
                    break;
                }
            }
            W.row<float>(y)[s] = frand(0.05f, 1.0f);
        }
        if (y == 1) sel[0] = -5;                            // clamps to expert 0
        if (y == 2) sel[c.n_used - 1] = (int)c.n_expert + 7;  // clamps to the last expert
        if (y == 3 && c.n_used > 1) sel[1] = sel[0];        // one expert twice in a row
        if (y >= c.active) sel[0] = 1 << 30;                // never read
    }
    if (!c.counts.empty()) {
        // The experts in order, a run of counts[e] each, down the active rows' slot 0, then
        // slot 1, ...: a row gets one expert twice only if a run is longer than the rows.
        std::vector<int> list;
        for (u32 e = 0; e < c.n_expert; e++) list.insert(list.end(), c.counts[e], (int)e);
        if (list.size() != (size_t)c.active * c.n_used) abort();
        for (u32 y = 0; y < c.rows; y++)
            for (u32 s = 0; s < c.n_used; s++) SEL.row<int>(y)[s] = y < c.active ? list[s * c.active + y] : 1 << 30;
    }
    const size_t mid_bytes = (size_t)c.n_used * c.ff * 4, midq_bytes = (size_t)c.n_used * nbf * sizeof(BlockQ8K);
    RowBuf mid_old(mid_bytes, c.rows), midq_old(midq_bytes, c.rows), out_old(c.out_dim * 4, c.rows);
    RowBuf tickets(c.n_used * 4, c.rows, 0);
    const float clamp = 7.0f;
    const u64 G = (u64)grid.data(), TG = (u64)gate.table.data(), TU = (u64)up.table.data(),
              TD = (u64)down.table.data();
    auto P0 = P.data();

    int bad_tasks = 0;
    // Old: per row, over blockIdx.y.
    {
        MoeGateUpArgs a{};
        a.xq = (const BlockQ8K*)X.ptr();
        a.selected = (const int*)SEL.ptr();
        a.weights = (const float*)W.ptr();
        a.gate = (const u64*)TG;
        a.up = (const u64*)TU;
        a.mid = (float*)mid_old.ptr();
        a.grid = (const u64*)G;
        a.midq = (BlockQ8K*)midq_old.ptr();
        a.tickets = (u32*)tickets.ptr();
        a.gate_ty = a.up_ty = c.gate_ty;
        a.in_dim = c.in_dim;
        a.ff = c.ff;
        a.n_used = c.n_used;
        a.n_expert = c.n_expert;
        a.clamp = clamp;
        a.ticket = 0;
        const RowStrides R = row_strides({X.stride, SEL.stride, W.stride, 0, 0, mid_old.stride, 0, midq_old.stride, tickets.stride});
        emu_launch({blocks_of(c.n_used * c.ff / 2, 8), c.rows, 1}, 256, [&] {
            if (c.gate_ty == 16) moe_gate_up_iq2_xxs(P0, cond, R, a);
            else moe_gate_up(P0, cond, R, a);
        });
        MoeDownArgs d{};
        d.midq = (const BlockQ8K*)midq_old.ptr();
        d.selected = (const int*)SEL.ptr();
        d.down = (const u64*)TD;
        d.out = (float*)out_old.ptr();
        d.grid = (const u64*)G;
        d.down_ty = c.down_ty;
        d.ff = c.ff;
        d.out_dim = c.out_dim;
        d.n_used = c.n_used;
        d.n_expert = c.n_expert;
        const RowStrides RD = row_strides({midq_old.stride, SEL.stride, 0, out_old.stride, 0});
        emu_launch({blocks_of((c.out_dim + 1) / 2, 8), c.rows, 1}, 256, [&] { moe_down(P0, cond, RD, d); });
        // The decode's Q2_K down of one-pass rows (plan.rs: ff <= 2048) on the same grid and
        // inputs: its out against moe_down's bit for bit.
        if (c.down_ty == 10 && c.ff % 256 == 0 && c.ff / 256 <= 8) {
            RowBuf out_q2k(c.out_dim * 4, c.rows);
            d.out = (float*)out_q2k.ptr();
            emu_launch({blocks_of((c.out_dim + 1) / 2, 8), c.rows, 1}, 256, [&] { moe_down_q2_k(P0, cond, RD, d); });
            int b = 0;
            for (u32 y = 0; y < c.active; y++) b += memcmp(out_q2k.row<char>(y), out_old.row<char>(y), c.out_dim * 4) != 0;
            printf("down 10 ff %u out %u used %u rows %u/%u: moe_down_q2_k against moe_down: %s\n", c.ff, c.out_dim,
                   c.n_used, c.active, c.rows, b ? "DIFFER" : "same bits");
            bad_tasks += b;
            d.out = (float*)out_old.ptr();
        }
        if (c.gate_ty == 16 && c.ff % 256 == 0 && c.counts.empty() && c.rows <= 8)
            bad_tasks = gate_up_tasks_check(c, a, X, SEL, W, mid_bytes, midq_bytes, P0, cond);
    }
    // New: grouped by expert, on CUDA cores (mma false) or, where the layout and types have them,
    // on tensor cores; each compared with the old.
    int bad = 0;
    bad += bad_tasks;
    // mma: 0 CUDA cores, 1 the tensor-core kernels.
    for (int mma = 0; mma < 2; mma++) {
        const bool mma_gate_up = mma && !native && c.gate_ty == 16, mma_down = mma && !native && c.down_ty == 10;
        if (mma && !mma_gate_up && !mma_down) continue;
        RowBuf mid_new(mid_bytes, c.rows), midq_new(midq_bytes, c.rows), out_new(c.out_dim * 4, c.rows);
        RowBuf route((2 * c.n_expert + c.rows * c.n_used) * 4, c.rows);
        RowBuf parts((size_t)c.n_used * c.out_dim * 4, c.rows);
        MoeRouteArgs r{(const int*)SEL.ptr(), (u32*)route.ptr(), c.n_expert, c.n_used, c.rows, 0};
        const RowStrides RR = row_strides({SEL.stride, route.stride});
        emu_launch({1, 1, 1}, 1024, [&] { moe_route(P0, cond, RR, r); });
        MoeGateUpGroupedArgs a{};
        a.xq = (const BlockQ8K*)X.ptr();
        a.selected = (const int*)SEL.ptr();
        a.weights = (const float*)W.ptr();
        a.gate = (const u64*)TG;
        a.up = (const u64*)TU;
        a.mid = (float*)mid_new.ptr();
        a.grid = (const u64*)G;
        a.route = (const u32*)route.ptr();
        a.gate_ty = c.gate_ty;
        a.in_dim = c.in_dim;
        a.ff = c.ff;
        a.n_used = c.n_used;
        a.n_expert = c.n_expert;
        a.clamp = clamp;
        const RowStrides RG = row_strides({X.stride, SEL.stride, W.stride, 0, 0, mid_new.stride, 0, route.stride});
        if (mma_gate_up) {
#if !DS4_NATIVE_BLOCKS
            emu_launch({c.n_expert * blocks_of(c.ff / MOE_MMA_MID_ROWS, 8), 1, 1}, 256,
                       [&] { moe_gate_up_mma_iq2_xxs(P0, cond, RG, a); });
            // With the first tensor-core kernel: moe_gate_up_tile_iq2_xxs (the same grid) on the
            // same route, its mid compared with that kernel's bit for bit.
            bad += gate_up_tile_check(c, a, route, mid_new, X, SEL, W, mid_bytes, P0, cond);
#endif
        } else {
            emu_launch({c.n_expert * blocks_of(c.ff / 2, 8), 1, 1}, 256, [&] {
                if (c.gate_ty == 16) moe_gate_up_grouped_iq2_xxs(P0, cond, RG, a);
                else moe_gate_up_grouped(P0, cond, RG, a);
            });
        }
        QuantizeQ8KArgs q{(const float*)mid_new.ptr(), (BlockQ8K*)midq_new.ptr()};
        const RowStrides RQ = row_strides({mid_new.stride, midq_new.stride});
        emu_launch({c.n_used * c.ff / 256, c.rows, 1}, 256, [&] { quantize_q8_k(P0, cond, RQ, q); });
        MoeDownGroupedArgs d{};
        d.midq = (const BlockQ8K*)midq_new.ptr();
        d.down = (const u64*)TD;
        d.parts = (float*)parts.ptr();
        d.grid = (const u64*)G;
        d.route = (const u32*)route.ptr();
        d.down_ty = c.down_ty;
        d.ff = c.ff;
        d.out_dim = c.out_dim;
        d.n_used = c.n_used;
        d.n_expert = c.n_expert;
        const RowStrides RD = row_strides({midq_new.stride, 0, parts.stride, 0, route.stride});
        if (mma_down) {
#if !DS4_NATIVE_BLOCKS
            emu_launch({c.n_expert * blocks_of((c.out_dim + MOE_MMA_DOWN_ROWS - 1) / MOE_MMA_DOWN_ROWS, 8), 1, 1}, 256,
                       [&] { moe_down_mma_q2_k(P0, cond, RD, d); });
#endif
        } else {
            emu_launch({c.n_expert * blocks_of((c.out_dim + 1) / 2, 8), 1, 1}, 256,
                       [&] { moe_down_grouped(P0, cond, RD, d); });
        }
        MoeSumSlotsArgs sum{(const float*)parts.ptr(), (float*)out_new.ptr(), c.out_dim, c.n_used};
        const RowStrides RS = row_strides({parts.stride, out_new.stride});
        emu_launch({blocks_of(c.out_dim, 256), c.rows, 1}, 256, [&] { moe_sum_slots(P0, cond, RS, sum); });
        // Compare.
        int bad_mode = 0;
        u32 pairs = 0, most = 0;
        for (u32 e = 0; e < c.n_expert; e++) {
            const u32 n = route.row<u32>(0)[e];
            pairs += n;
            most = n > most ? n : most;
            if (!c.counts.empty() && n != c.counts[e]) {
                printf("  expert %u has %u pairs, want %u\n", e, n, c.counts[e]);
                bad_mode++;
            }
        }
        if (pairs != c.active * c.n_used) {
            printf("  route holds %u pairs, want %u\n", pairs, c.active * c.n_used);
            bad_mode++;
        }
        u32 nonzero = 0;
        for (u32 y = 0; y < c.rows; y++) {
            const bool live = y < c.active;
            if (live) {
                if (memcmp(mid_old.row<char>(y), mid_new.row<char>(y), mid_bytes)) {
                    printf("  row %u: mid differs\n", y);
                    bad_mode++;
                }
                for (u32 b = 0; b < c.n_used * nbf; b++) {
                    const BlockQ8K& o = midq_old.row<BlockQ8K>(y)[b];
                    const BlockQ8K& n = midq_new.row<BlockQ8K>(y)[b];
                    if (memcmp(o.qs, n.qs, 256) || memcmp(o.bsums, n.bsums, 32) || memcmp(&o.d, &n.d, 4)) {
                        printf("  row %u: mid Q8_K block %u differs\n", y, b);
                        bad_mode++;
                    }
                }
            } else if (mid_new.row<u32>(y)[0] != 0xababababu) {
                printf("  inactive row %u: mid written\n", y);
                bad_mode++;
            }
            for (u32 r = 0; r < c.out_dim; r++) {
                const float o = out_old.row<float>(y)[r], n = out_new.row<float>(y)[r];
                u32 ob, nb_;
                memcpy(&ob, &o, 4);
                memcpy(&nb_, &n, 4);
                if (ob != nb_) {
                    if (bad_mode < 20) printf("  row %u out %u: %08x (%g) vs %08x (%g)\n", y, r, ob, o, nb_, n);
                    bad_mode++;
                }
                if (!live && nb_ != 0xabababab) {
                    printf("  inactive row %u written\n", y);
                    bad_mode++;
                }
                nonzero += live && std::isfinite(o) && o != 0.0f;
            }
        }
        printf("gate %u%s down %u%s in %u ff %u out %u experts %u used %u rows %u/%u (most pairs %u) %s: %s (%u of "
               "%u outputs finite, nonzero)\n",
               c.gate_ty, mma_gate_up ? " mma" : "", c.down_ty, mma_down ? " mma" : "", c.in_dim, c.ff, c.out_dim,
               c.n_expert, c.n_used, c.active, c.rows, most, native ? "native" : "split",
               bad_mode ? "DIFFER" : "same bits", nonzero, c.active * c.out_dim);
        bad += bad_mode;
    }
    return bad;
}

// The emulated m16n8k{16,32} int8 MMA against a plain integer product: fragments laid out by the
// PTX ISA's element tables (element i of a lane's fragment, low to high), in two warps at once.
template <int K> static int mma_check() {
    int bad = 0;
    for (int trial = 0; trial < 4; trial++) {
        int A[2][16][K], B[2][K][8], C[2][16][8];
        for (int w = 0; w < 2; w++) {
            for (auto& row : A[w])
                for (int& v : row) v = trial == 0 ? -128 + (int)(rnd() % 2) * 255 : (int)(rnd() % 256) - 128;
            for (auto& row : B[w])
                for (int& v : row) v = trial == 0 ? -128 : (int)(rnd() % 256) - 128;
            for (auto& row : C[w])
                for (int& v : row) v = (int)rnd();
        }
        int D[2][16][8];
        emu_launch({1, 1, 1}, 64, [&] {
            const unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
            unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
            int d[4];
            for (unsigned i = 0; i < (unsigned)K / 2; i++) {  // A: K / 2 elements a lane
                const unsigned row = K == 32 ? (i < 4 || (i >= 8 && i < 12) ? g : g + 8) : (i < 4 ? g : g + 8);
                const unsigned col = t * 4 + (i & 3) + (K == 32 && i >= 8 ? 16 : 0);
                a[i / 4] |= (unsigned)(A[w][row][col] & 255) << (8 * (i % 4));
            }
            for (unsigned i = 0; i < (unsigned)K / 4; i++) {  // B: K / 4 elements a lane
                const unsigned row = t * 4 + (i & 3) + (i >= 4 ? 16 : 0);
                b[i / 4] |= (unsigned)(B[w][row][g] & 255) << (8 * (i % 4));
            }
            for (unsigned i = 0; i < 4; i++) d[i] = C[w][i < 2 ? g : g + 8][t * 2 + (i & 1)];
            emu_mma_s8<K>(d, a, b);
            for (unsigned i = 0; i < 4; i++) D[w][i < 2 ? g : g + 8][t * 2 + (i & 1)] = d[i];
        });
        for (int w = 0; w < 2; w++)
            for (int m = 0; m < 16; m++)
                for (int n = 0; n < 8; n++) {
                    long long s = C[w][m][n];
                    for (int k = 0; k < K; k++) s += (long long)A[w][m][k] * B[w][k][n];
                    if ((int)(unsigned)s != D[w][m][n]) bad++;
                }
    }
    printf("emulated mma m16n8k%d .s8 against the plain product: %s\n", K, bad ? "DIFFER" : "same");
    return bad;
}

#if !DS4_NATIVE_BLOCKS
// Grid entry l of an IQ2_XXS sub-block (words aux0, aux1) as the format defines it, written here
// from the definition rather than taken from the kernels: byte j of the grid entry that index
// (aux0 >> 8l) & 255 names, negated when bit j of the entry's sign field (7 bits at 7l of aux1,
// bit 7 their parity: the count of negatives is even) is set; weights 0-3 in lo, 4-7 in hi.
static void iq2_reference_entry(const std::vector<u64>& grid, u32 aux0, u32 aux1, u32 l, u32* lo, u32* hi) {
    const u64 g = grid[(aux0 >> (8 * l)) & 255];
    u32 s = (aux1 >> (7 * l)) & 127;
    s |= (u32)(__builtin_popcount(s) & 1) << 7;
    u32 w[2] = {0, 0};
    for (u32 j = 0; j < 8; j++) {
        int v = (int)((g >> (8 * j)) & 255);
        if ((s >> j) & 1) v = -v;
        w[j / 4] |= (u32)(v & 255) << (8 * (j % 4));
    }
    *lo = w[0];
    *hi = w[1];
}

// The IQ2_XXS decode of every kernel but the tile ones (iq2_xxs_entry: byte permutes, signs from
// the table or by shifts; iq2_xxs_sub_weights over the tables iq2_tab holds) against the
// format's definition, for every grid entry, sign field and entry position.
static int iq2_decode_check(const std::vector<u64>& grid) {
    int bad = 0;
    emu_launch({1, 1, 1}, 256, [&] {
        static u32 codes[256], signs[128], tab[256 + 128];
        iq2_nibble_tables(grid.data(), codes, signs);
        iq2_nibble_tables(grid.data(), tab, tab + 256);
        if (threadIdx.x != 0) return;
        for (u32 idx = 0; idx < 256; idx++)
            for (u32 s = 0; s < 128; s++)
                for (u32 l = 0; l < 4; l++) {
                    const u32 aux0 = idx << (8 * l), aux1 = s << (7 * l);
                    u32 rlo, rhi;
                    iq2_reference_entry(grid, aux0, aux1, l, &rlo, &rhi);
                    int got[8];
                    iq2_xxs_sub_weights(aux0, aux1, tab, got);
                    u32 lo, hi, tlo, thi;
                    iq2_xxs_entry<false>(aux0, aux1, l, codes, signs, &lo, &hi);
                    iq2_xxs_entry<true>(aux0, aux1, l, codes, signs, &tlo, &thi);
                    bad += lo != rlo || hi != rhi || tlo != lo || thi != hi;
                    bad += (u32)got[2 * l] != rlo || (u32)got[2 * l + 1] != rhi;
                }
    });
    printf("IQ2_XXS byte-permute decode against the format's definition: %s\n", bad ? "DIFFER" : "same");
    // The tile kernels' decode (gut_entry: sign bits by a multiply, nibbles in moe2_weight order)
    // and their activations' permutation (moe2_permute) against the same weights.
    int bad2 = 0;
    emu_launch({1, 1, 1}, 256, [&] {
        static u32 codes[256 * MOE2_COPIES];
        moe2_code_table(grid.data(), codes);
        __syncthreads();
        const u32 lane = threadIdx.x & 31, copy = 4 * (lane & 15);
        for (u32 idx = threadIdx.x; idx < 256; idx += 256)
            for (u32 s = 0; s < 128; s++)
                for (u32 l = 0; l < 4; l++) {
                    const u32 aux0 = idx << (8 * l) | (rnd() & ~(255u << (8 * l))), aux1 = s << (7 * l);
                    int want[8];
                    iq2_reference_entry(grid, aux0, aux1, l, (u32*)&want[2 * l], (u32*)&want[2 * l + 1]);
                    u32 lo, hi;
                    gut_entry(aux0, aux1, l, (8 * l + 26) & 31, copy, codes, MOE2_PRMT_LO, &lo, &hi);
                    // Dot with activation bytes 1..8 both ways.
                    const int4 xv = moe2_permute(make_int4(0x04030201, 0x08070605, 0, 0));
                    const u32 wb[2] = {(u32)want[2 * l], (u32)want[2 * l + 1]};
                    const int ref = __dp4a((int)wb[0], 0x04030201, __dp4a((int)wb[1], 0x08070605, 0));
                    const int got = __dp4a((int)lo, xv.x, __dp4a((int)hi, xv.y, 0));
                    for (u32 n = 0; n < 8; n++) {
                        const u32 w = n < 4 ? (lo >> (8 * n)) & 255 : (hi >> (8 * (n - 4))) & 255;
                        const u32 m = moe2_weight(n), ww = (wb[m / 4] >> (8 * (m % 4))) & 255;
                        bad2 += w != ww;
                    }
                    bad2 += ref != got;
                }
    });
    printf("IQ2_XXS decode of the tile kernels against the format's definition: %s\n", bad2 ? "DIFFER" : "same");
    return bad + bad2;
}
#endif

#if !DS4_NATIVE_BLOCKS
// moe_down_tile_q2_k against moe_down_mma_q2_k (split layout): the same random mid Q8_K and
// routing (moe_route) into both, parts compared bit for bit for every (row, slot) and output row,
// rows past the tokens left unwritten. counts: pairs per expert as in Config (empty: random).
struct DownTileConfig {
    u32 ff, out_dim, n_expert, n_used, rows, active;
    std::vector<u32> counts;
};
static int down_tile_check(const DownTileConfig& c) {
    const u32 nb = c.ff / 256;
    Experts down(10, c.n_expert, c.out_dim, nb, false);
    // Zero scales (d, dmin of +-0) on every block of some rows and one block of others: terms of
    // +-0 check that leaving out the missing leaves changes no zero's sign in the result.
    for (u32 e = 0; e < c.n_expert; e++)
        for (u32 r = 0; r < c.out_dim; r++)
            for (u32 b = 0; b < nb; b++)
                if (r % 3 == 1 || (r % 5 == 2 && b == r % nb)) {
                    const unsigned short z[2] = {(unsigned short)(b & 1 ? 0x8000 : 0), (unsigned short)(r & 1 ? 0x8000 : 0)};
                    memcpy((unsigned char*)down.table[2 * e + 1] + ((u64)r * nb + b) * 20 + 16, z, 4);
                }
    std::vector<StepParams> P(c.rows);
    for (u32 y = 0; y < c.rows; y++) P[y] = StepParams{rnd() % 1000, 100 + y, 0, y < c.active ? 1u : 0u};
    const u64 cond = 1ull << 63;
    RowBuf SEL(c.n_used * 4, c.rows, 0), MQ((size_t)c.n_used * nb * sizeof(BlockQ8K), c.rows, 0);
    std::vector<int> list;
    for (u32 e = 0; e < c.counts.size(); e++) list.insert(list.end(), c.counts[e], (int)e);
    if (!c.counts.empty() && list.size() != (size_t)c.active * c.n_used) abort();
    for (u32 y = 0; y < c.rows; y++) {
        rand_q8k(MQ.row<BlockQ8K>(y), c.n_used * nb);
        int* sel = SEL.row<int>(y);
        for (u32 s = 0; s < c.n_used; s++) {
            if (y >= c.active) sel[s] = 1 << 30;  // never read
            else if (!c.counts.empty()) sel[s] = list[s * c.active + y];
            else
                for (;;) {
                    const int e = (int)(rnd() % c.n_expert);
                    bool dup = false;
                    for (u32 k = 0; k < s; k++) dup |= sel[k] == e;
                    if (!dup) {
                        sel[s] = e;
                        break;
                    }
                }
        }
    }
    auto P0 = P.data();
    RowBuf route((2 * c.n_expert + c.rows * c.n_used) * 4, c.rows);
    MoeRouteArgs r{(const int*)SEL.ptr(), (u32*)route.ptr(), c.n_expert, c.n_used, c.rows, 0};
    const RowStrides RR = row_strides({SEL.stride, route.stride});
    emu_launch({1, 1, 1}, 1024, [&] { moe_route(P0, cond, RR, r); });
    const size_t parts_bytes = (size_t)c.n_used * c.out_dim * 4;
    RowBuf parts_old(parts_bytes, c.rows), parts_new(parts_bytes, c.rows);
    MoeDownGroupedArgs d{};
    d.midq = (const BlockQ8K*)MQ.ptr();
    d.down = (const u64*)down.table.data();
    d.route = (const u32*)route.ptr();
    d.down_ty = 10;
    d.ff = c.ff;
    d.out_dim = c.out_dim;
    d.n_used = c.n_used;
    d.n_expert = c.n_expert;
    const emu_dim3 grid{c.n_expert * blocks_of((c.out_dim + MOE_MMA_DOWN_ROWS - 1) / MOE_MMA_DOWN_ROWS, 8), 1, 1};
    d.parts = (float*)parts_old.ptr();
    const RowStrides RO = row_strides({MQ.stride, 0, parts_old.stride, 0, route.stride});
    emu_launch(grid, 256, [&] { moe_down_mma_q2_k(P0, cond, RO, d); });
    d.parts = (float*)parts_new.ptr();
    const RowStrides RN = row_strides({MQ.stride, 0, parts_new.stride, 0, route.stride});
    emu_launch(grid, 256, [&] { moe_down_tile_q2_k(P0, cond, RN, d); });
    int bad = 0;
    u32 most = 0, nonzero = 0, negzero = 0;
    for (u32 e = 0; e < c.n_expert; e++) most = std::max(most, route.row<u32>(0)[e]);
    for (u32 y = 0; y < c.rows; y++)
        for (u32 i = 0; i < c.n_used * c.out_dim; i++) {
            const u32 o = parts_old.row<u32>(y)[i], n = parts_new.row<u32>(y)[i];
            if (o != n || (y >= c.active && n != 0xababababu)) {
                if (bad < 20) printf("  row %u slot %u out %u: %08x vs %08x\n", y, i / c.out_dim, i % c.out_dim, o, n);
                bad++;
            }
            nonzero += y < c.active && o != 0 && o != 0x80000000u;
            negzero += y < c.active && o == 0x80000000u;
        }
    printf("down tile against mma: ff %u out %u experts %u used %u rows %u/%u (most pairs %u): %s (%u of %u parts "
           "nonzero, %u -0)\n",
           c.ff, c.out_dim, c.n_expert, c.n_used, c.active, c.rows, most, bad ? "DIFFER" : "same bits", nonzero,
           c.active * c.n_used * c.out_dim, negzero);
    return bad;
}
#endif

#if !DS4_NATIVE_BLOCKS
// The tile down's configurations: Flash's ff (8 blocks) with experts of 0, 1, 7, 8, 9, 17, 33 and
// 39 pairs (up to three passes of 16) and out_dim past a warp; small ff (1, 3, 5, 20 blocks)
// with random routing; ff of 33 blocks (two 32-block chunks of the tree). `moe 100` runs only
// these.
static int down_tile_checks() {
    const DownTileConfig configs[] = {
        {2048, 40, 8, 2, 58, 57, {0, 1, 7, 8, 9, 17, 33, 39}},
        {256, 130, 6, 3, 9, 8, {}},
        {768, 24, 4, 2, 8, 7, {}},
        {8448, 20, 3, 2, 20, 19, {1, 0, 37}},
        {1280, 16, 2, 1, 9, 9, {}},   // 5 blocks: missing leaves inside the tree's 8-block grid
        {5120, 16, 2, 2, 12, 11, {}},  // 20 blocks: every tree level, missing leaves
    };
    int bad = 0;
    for (const auto& c : configs) bad += down_tile_check(c);
    return bad;
}
#endif

int main(int argc, char** argv) {
    const bool native = DS4_NATIVE_BLOCKS;
    int bad = mma_check<16>() + mma_check<32>();
#if !DS4_NATIVE_BLOCKS
    {
        std::vector<u64> grid(256);
        const unsigned char gb[3] = {8, 25, 43};
        for (auto& g : grid) {
            g = 0;
            for (int i = 0; i < 8; i++) g |= (u64)gb[rnd() % 3] << (8 * i);
        }
        bad += iq2_decode_check(grid);
    }
#endif
    const Config configs[] = {
        {16, 10, 512, 256, 263, 8, 3, 8, 6},    // Flash's types, odd n_used and out_dim, 2 rows past the tokens
        {16, 10, 256, 512, 256, 16, 4, 8, 8},   // all rows live
        {10, 12, 512, 256, 200, 5, 2, 6, 5},    // Q2_K gate/up, Q4_K down
        {12, 16, 256, 256, 130, 4, 3, 5, 3},    // Q4_K gate/up, IQ2_XXS down
        {16, 10, 4096, 256, 64, 8, 6, 4, 4},    // Flash's input width: two passes per row
        {16, 12, 8448, 256, 32, 4, 2, 3, 2},    // 33 blocks: two 32-block chunks per row
        {16, 10, 512, 256, 64, 3, 2, 8, 7},     // 14 pairs on 3 experts: batches of pairs
        {16, 10, 8448, 256, 32, 2, 2, 5, 5},    // 5 pairs an expert, two chunks per row
        // Experts of 0, 1, 3, 8, 9, 17 pairs: none, part of a tile of 8, whole tiles, and more.
        {16, 10, 512, 512, 100, 8, 2, 22, 20, {0, 1, 3, 8, 9, 17, 0, 2}},
        {16, 10, 8448, 256, 40, 8, 2, 21, 20, {2, 0, 17, 9, 8, 3, 1, 0}},  // two chunks per row
        {16, 10, 4096, 2048, 48, 4, 2, 6, 5, {1, 3, 0, 6}},                 // Flash's widths (16, 8 blocks)
        // Experts of 0, 1, 3, 8, 9, 17, 33 pairs (up to five tiles of 8), at Flash's widths.
        {16, 10, 4096, 2048, 40, 8, 2, 38, 36, {0, 1, 3, 8, 9, 17, 33, 1}},
        // 24 blocks (one chunk, all tree levels: moe_gate_up_tile_iq2_xxs passes of 24 pairs),
        // experts of 7 and 41 pairs.
        {16, 10, 6144, 256, 32, 4, 2, 24, 24, {7, 0, 41, 0}},
    };
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    for (int i = 0; i < (int)(sizeof(configs) / sizeof(configs[0])); i++)
        if (only < 0 || only == i) bad += run(configs[i], native);
#if !DS4_NATIVE_BLOCKS
    if (only < 0 || only == 100) bad += down_tile_checks();
#endif
    return bad ? 1 : 0;
}
