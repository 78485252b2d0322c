// Runs a chunk's indexer scores through the per-row kernel `indexer_scores` (launched over
// blockIdx.y as build_chunk does) and through `indexer_scores_chunk` (a block per tile of token
// rows x compressed rows), in the emulator, and compares every score bit for bit, as well as the
// bytes neither may write (past each row's visible rows, rows that run nothing). Both are also
// checked against the canonical order computed on the host (numerics::dot_f32, terms from +0).
// Built from the decode build's source, it checks indexer_scores_one against indexer_scores.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    const char* what;
    u32 n_head, ratio, cap, top_k;
    u32 rows, active, pos0;
    bool old;  // also run the per-row kernel (slow in the emulator: a fiber switch per shuffle)
};

// Inputs with zeros and negatives, so that max(dot, 0), zero products of either sign and zero
// sums all occur.
static float value() {
    const u32 r = rnd() % 16;
    if (r == 0) return 0.0f;
    if (r == 1) return -0.0f;
    return frand(-1.0f, 1.0f);
}

// The canonical score on the host: each dot's 32 lane sums (4 products each, from +0), tree32,
// added to +0; the terms max(dot, 0) * (w * scale) added in head order from +0.
static float host_score(const float* q, const float* w, float scale, const float* k, u32 nh) {
    float acc = 0.0f;
    for (u32 h = 0; h < nh; h++) {
        float v[32];
        for (u32 l = 0; l < 32; l++) {
            float s = 0.0f;
            for (u32 i = 0; i < 4; i++) s += k[4 * l + i] * q[h * 128 + 4 * l + i];
            v[l] = s;
        }
        for (u32 o = 16; o > 0; o /= 2)
            for (u32 l = 0; l < o; l++) v[l] += v[l + o];
        const float d = 0.0f + v[0];
        acc += fmaxf(d, 0.0f) * (w[h] * scale);
    }
    return acc;
}

static int run(const Config& c) {
    const u32 nh = c.n_head, hd = 128;
    std::vector<float> cache((size_t)c.cap * hd);
    for (u32 r = 0; r < c.cap; r++) {
        // Some rows all zero, some scaled up so a few terms dominate.
        const u32 kind = rnd() % 8;
        for (u32 i = 0; i < hd; i++) cache[(size_t)r * hd + i] = kind == 0 ? (rnd() & 1 ? -0.0f : 0.0f) : value();
    }
    std::vector<StepParams> P(c.rows);
    for (u32 y = 0; y < c.rows; y++) P[y] = StepParams{0, c.pos0 + y, 0, y < c.active ? c.active : 0u};
    RowBuf Q((size_t)nh * hd * 4, c.rows, 0), W(nh * 4, c.rows, 0);
    for (u32 y = 0; y < c.rows; y++) {
        for (u32 h = 0; h < nh; h++) {
            const bool zero_head = rnd() % 16 == 0;
            for (u32 i = 0; i < hd; i++) Q.row<float>(y)[h * hd + i] = zero_head ? 0.0f : value();
        }
        for (u32 h = 0; h < nh; h++) W.row<float>(y)[h] = value() * 4.0f;
    }
    const float scale = 1.0f / sqrtf((float)(hd * nh));
    RowBuf out_old((size_t)c.cap * 4, c.rows), out_new((size_t)c.cap * 4, c.rows);
    // The indexer's predicate (kind 2: active when (pos + 1) / ratio > top_k) on a chunk's launch.
    const u64 cond = 2ull | (u64)c.ratio << 2 | (u64)c.top_k << 18 | 1ull << 63;
    auto args = [&](RowBuf& out) {
        IndexerScoresArgs a{};
        a.q = (const float*)Q.ptr();
        a.weights = (const float*)W.ptr();
        a.cache = cache.data();
        a.out = (float*)out.ptr();
        a.n_head = nh;
        a.head_dim = hd;
        a.scale = scale;
        a.ratio = c.ratio;
        a.cap = c.cap;
        return a;
    };
    const StepParams* P0 = P.data();
#if DS4_CHUNK_ROWS
    if (c.old) {
        const IndexerScoresArgs a = args(out_old);
        const RowStrides R = row_strides({Q.stride, W.stride, 0, out_old.stride});
        emu_launch({std::min(std::max(c.cap, 1u), 4096u), c.rows, 1}, 128, [&] { indexer_scores(P0, cond, R, a); });
    }
    {
        const IndexerScoresArgs a = args(out_new);
        const RowStrides R = row_strides({Q.stride, W.stride, 0, out_new.stride});
        const u64 cond_rows = cond | (u64)c.rows << 50;
        emu_launch({(std::max(c.cap, 1u) + IDX_BC - 1) / IDX_BC, (c.rows + IDX_BT - 1) / IDX_BT, 1}, IDX_THREADS,
                   [&] { indexer_scores_chunk(P0, cond_rows, R, a); });
    }
    char what[16];
    snprintf(what, sizeof what, "tile %ux%u", IDX_MT, IDX_MC);
#else
    // The decode build: one row, indexer_scores (a block per compressed row, as plan.rs launches
    // it) against indexer_scores_one.
    const RowStrides R{};
    if (c.old) {
        const IndexerScoresArgs a = args(out_old);
        emu_launch({std::min(std::max(c.cap, 1u), 4096u), 1, 1}, 128, [&] { indexer_scores(P0, cond, R, a); });
    }
    {
        const IndexerScoresArgs a = args(out_new);
        emu_launch({(std::max(c.cap, 1u) + IDX1_ROWS - 1) / IDX1_ROWS, 1, 1}, IDX1_THREADS,
                   [&] { indexer_scores_one(P0, cond, R, a); });
    }
    const char* what = "decode";
#endif
    int bad = 0;
    u32 n_min = ~0u, n_max = 0, positive = 0, zero = 0, scored = 0;
    for (u32 y = 0; y < c.rows; y++) {
        const u32 pos = c.pos0 + y;
        const bool live = y < c.active && (pos + 1) / c.ratio > c.top_k;
        const u32 n = live ? std::min((pos + 1) / c.ratio, c.cap) : 0;
        if (live) {
            n_min = std::min(n_min, n);
            n_max = std::max(n_max, n);
        }
        for (u32 r = 0; r < c.cap; r++) {
            const u32 got = out_new.row<u32>(y)[r];
            u32 want = 0xababababu;
            if (r < n) {
                const float s = host_score(Q.row<float>(y), W.row<float>(y), scale, &cache[(size_t)r * hd], nh);
                want = bits_as<u32>(s);
                positive += s > 0.0f;
                zero += s == 0.0f;
                scored++;
            }
            const u32 old = c.old ? out_old.row<u32>(y)[r] : want;
            if (got != want || old != want) {
                if (bad < 10)
                    printf("  row %u score %u: chunk %08x, per row %08x, host %08x%s\n", y, r, got, old, want,
                           r < n ? "" : " (not to be written)");
                bad++;
            }
        }
    }
    if (n_min > n_max) n_min = n_max = 0;
    printf("%-34s heads %2u, rows %3u/%3u at %5u, visible %u..%u, cap %4u, %s%s: %s (%u scores: %u > 0, %u zero)\n",
           c.what, nh, c.active, c.rows, c.pos0, n_min, n_max, c.cap, what, c.old ? ", per-row kernel too" : "",
           bad ? "DIFFER" : "same bits", scored, positive, zero);
    return bad;
}

int main(int argc, char** argv) {
    const Config configs[] = {
        // what, heads, ratio, cap, top_k, rows, active, pos0, old
#if DS4_CHUNK_ROWS
        {"flash heads, 7 rows", 64, 4, 40, 2, 7, 7, 90, true},
        {"flash heads, one row", 64, 4, 80, 4, 1, 1, 283, true},
        {"flash heads, rows turn active", 64, 4, 100, 20, 9, 8, 76, true},
        {"tiny heads, 128 rows from 0", 16, 4, 40, 4, 128, 128, 0, true},
        {"tiny heads, 128 rows, cap reached", 16, 4, 24, 2, 128, 100, 40, true},
        {"flash heads, 128 rows, n > tile", 64, 4, 200, 8, 128, 128, 300, false},
        {"flash heads, 33 rows of 48", 64, 4, 130, 8, 48, 33, 411, false},
#else
        {"flash heads, 3 blocks of rows", 64, 4, 100, 4, 1, 1, 330, true},
        {"flash heads, cap reached", 64, 4, 45, 4, 1, 1, 400, true},
        {"flash heads, indexer inactive", 64, 4, 100, 90, 1, 1, 330, true},
        {"tiny heads, few rows", 16, 4, 40, 2, 1, 1, 27, true},
        {"heads 20 (5 groups)", 20, 4, 70, 2, 1, 1, 255, true},
#endif
    };
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    int bad = 0;
    for (int i = 0; i < (int)(sizeof(configs) / sizeof(configs[0])); i++)
        if (only < 0 || only == i) bad += run(configs[i]);
    return bad ? 1 : 0;
}
