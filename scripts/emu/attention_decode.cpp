// Runs one decode token's attention through the block-per-head kernel `attention`, through the
// split form (attention_scores, attention_partial, attention_combine, with the grids and scratch
// plan.rs gives them) and through the split form with the combine in the weighted sums' last
// blocks (attention_scores, attention_partial_combine; its blocks in a random order, where
// plan.rs fuses), in the emulator, and compares the output and the fused Q8_0 bit for bit (and
// the tickets back at 0).
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    const char* what;
    u32 n_head, head_dim, window, raw_cap, ratio, comp_cap, top_k;
    bool selected;
    u32 n_rot;   // 0: no fused inverse RoPE
    bool quant;  // the fused Q8_0 (head_dim a multiple of 32)
    u32 pos;
};

static u32 div_ceil(u32 a, u32 b) { return (a + b - 1) / b; }

static int run(const Config& c) {
    const u32 hd = c.head_dim, nh = c.n_head, max_rows = c.raw_cap + c.comp_cap, pairs = c.n_rot / 2;
    std::vector<float> raw((size_t)c.raw_cap * hd), comp((size_t)std::max(c.comp_cap, 1u) * hd), sinks(nh);
    std::vector<float> rope((size_t)(c.pos + 1) * std::max(pairs, 1u) * 2), q((size_t)nh * hd);
    for (auto& v : raw) v = frand(-1.0f, 1.0f);
    for (auto& v : comp) v = frand(-1.0f, 1.0f);
    for (auto& v : sinks) v = frand(-2.0f, 2.0f);
    for (auto& v : rope) v = frand(-1.0f, 1.0f);
    for (auto& v : q) v = frand(-3.0f, 3.0f);
    const StepParams P{rnd() % 1000, c.pos, 0, 0};
    // The indexer's pick: top_k distinct visible compressed rows, ascending.
    const u32 n_comp = c.ratio ? std::min((c.pos + 1) / c.ratio, c.comp_cap) : 0;
    std::vector<int> pick;
    for (u32 r = 0; r < n_comp; r++) pick.push_back((int)r);
    for (u32 i = 0; i + 1 < pick.size(); i++) std::swap(pick[i], pick[i + rnd() % (pick.size() - i)]);
    pick.resize(std::min<size_t>(pick.size(), c.top_k));
    std::sort(pick.begin(), pick.end());
    pick.resize(std::max(c.top_k, 1u));
    const u32 n_raw = std::min(std::min(c.pos + 1, c.window), c.raw_cap);
    const u32 n_rows = n_raw + (c.selected && n_comp > c.top_k ? c.top_k : n_comp);

    // plan.rs: attention_split's grids and scratch, for the most rows the layer can see.
    const u32 vis = std::min(c.window, c.raw_cap) +
                    (c.ratio == 0 ? 0 : c.selected ? std::min(c.comp_cap, c.top_k) : c.comp_cap);
    const u32 groups = div_ceil(nh, ATTN_SPLIT_HEADS), slices = div_ceil(vis, ATTN_SCORE_ROWS);
    const u32 chunks = div_ceil(vis, DS4_ATTN_ROW_CHUNK), dim_slices = div_ceil(hd, ATTN_SUM_THREADS);
    const u32 nblk = nh * hd / 32;
    // Everything starts as junk (3.4e38 as floats): a read of anything unwritten shows in the output.
    const unsigned char junk = 0x7f;
    std::vector<float> out_old(nh * hd), out_new(nh * hd), sc_old(nh * max_rows), sc_new(nh * max_rows);
    std::vector<float> maxes(slices * nh), sums((1 + chunks) * nh), parts((size_t)chunks * nh * hd);
    std::vector<i8> xq_old(nblk * 32), xq_new(nblk * 32);
    std::vector<float> xd_old(nblk), xd_new(nblk);
    // The fused combine's own scratch: a copy of the sums per dim slice, the tickets after 3 others.
    const u32 sums_slice = (1 + chunks) * nh;
    std::vector<float> out_fc(nh * hd), sc_fc(nh * max_rows), maxes_fc(slices * nh), sums_fc(dim_slices * sums_slice);
    std::vector<float> parts_fc((size_t)chunks * nh * hd), xd_fc(nblk);
    std::vector<i8> xq_fc(nblk * 32);
    std::vector<u32> tickets(3 + groups * dim_slices, 0);
    for (auto* v : {&out_old, &out_new, &sc_old, &sc_new, &maxes, &sums, &parts, &xd_old, &xd_new, &out_fc, &sc_fc,
                    &maxes_fc, &sums_fc, &parts_fc, &xd_fc})
        memset(v->data(), junk, v->size() * 4);
    memset(xq_old.data(), junk, xq_old.size());
    memset(xq_new.data(), junk, xq_new.size());
    memset(xq_fc.data(), junk, xq_fc.size());
    // plan.rs: the combine goes inside when the rotated dims lie in one dim slice.
    const bool fused = hd % 32 == 0 && (c.n_rot == 0 || (hd - c.n_rot) / ATTN_SUM_THREADS == (hd - 1) / ATTN_SUM_THREADS);
    auto fill = [&](auto& a, float* out, float* sc, i8* xq, float* xd) {
        a.q = q.data();
        a.raw = raw.data();
        a.comp = c.ratio ? comp.data() : nullptr;
        a.selected = c.selected ? pick.data() : nullptr;
        a.sinks = sinks.data();
        a.out = out;
        a.scores = sc;
        a.rope = c.n_rot ? rope.data() : nullptr;
        a.xq = c.quant ? xq : nullptr;
        a.xd = c.quant ? xd : nullptr;
        a.head_dim = hd;
        a.window = c.window;
        a.raw_cap = c.raw_cap;
        a.ratio = c.ratio;
        a.comp_cap = c.comp_cap;
        a.top_k = c.top_k;
        a.max_rows = max_rows;
        a.kq_scale = 1.0f / sqrtf((float)hd);
        a.n_rot = c.n_rot;
        a.n_head = nh;
    };
    const RowStrides R{};
    const StepParams* P0 = &P;
    {
        AttentionArgs a{};
        fill(a, out_old.data(), sc_old.data(), xq_old.data(), xd_old.data());
        emu_launch({nh, 1, 1}, 1024, [&] { attention(P0, 0, R, a); });
    }
    {
        AttentionScoresArgs a{};
        fill(a, out_new.data(), sc_new.data(), xq_new.data(), xd_new.data());
        a.maxes = maxes.data();
        a.sums = sums.data();
        a.parts = parts.data();
        AttentionPartialArgs b;
        AttentionCombineArgs m;
        static_assert(sizeof b == sizeof a && sizeof m == sizeof a, "the same fields");
        memcpy(&b, &a, sizeof a);
        memcpy(&m, &a, sizeof a);
        emu_launch({slices * groups, 1, 1}, ATTN_SCORE_THREADS, [&] { attention_scores(P0, 0, R, a); });
        emu_launch({chunks * groups * dim_slices, 1, 1}, ATTN_SUM_THREADS, [&] { attention_partial(P0, 0, R, b); });
        emu_launch({nh, 1, 1}, (hd + 31) / 32 * 32, [&] { attention_combine(P0, 0, R, m); });
    }
    if (fused) {
        AttentionScoresArgs a{};
        fill(a, out_fc.data(), sc_fc.data(), xq_fc.data(), xd_fc.data());
        a.maxes = maxes_fc.data();
        a.sums = sums_fc.data();
        a.parts = parts_fc.data();
        a.tickets = tickets.data();
        a.ticket = 3;
        a.sums_slice = sums_slice;
        AttentionPartialCombineArgs b;
        static_assert(sizeof b == sizeof a, "the same fields");
        memcpy(&b, &a, sizeof a);
        emu_launch({slices * groups, 1, 1}, ATTN_SCORE_THREADS, [&] { attention_scores(P0, 0, R, a); });
        const u32 n = chunks * groups * dim_slices;
        emu_block_order.resize(n);
        for (u32 i = 0; i < n; i++) emu_block_order[i] = i;
        for (u32 i = 0; i + 1 < n; i++) std::swap(emu_block_order[i], emu_block_order[i + rnd() % (n - i)]);
        emu_launch({n, 1, 1}, ATTN_SUM_THREADS, [&] { attention_partial_combine(P0, 0, R, b); });
        emu_block_order.clear();
    }
    int bad = 0;
    u32 nonzero = 0;
    auto differ = [&](const char* what, u32 i, const void* o, const void* n, size_t bytes) {
        if (!memcmp(o, n, bytes)) return;
        if (bad < 10) printf("  %s %u differs\n", what, i);
        bad++;
    };
    for (u32 i = 0; i < nh * hd; i++) {
        differ("out", i, &out_old[i], &out_new[i], 4);
        nonzero += std::isfinite(out_old[i]) && out_old[i] != 0.0f;
    }
    if (c.quant)
        for (u32 b = 0; b < nblk; b++) {
            differ("Q8_0 quants of block", b, &xq_old[b * 32], &xq_new[b * 32], 32);
            differ("Q8_0 scale of block", b, &xd_old[b], &xd_new[b], 4);
        }
    if (fused) {
        for (u32 i = 0; i < nh * hd; i++) differ("fused combine: out", i, &out_old[i], &out_fc[i], 4);
        if (c.quant)
            for (u32 b = 0; b < nblk; b++) {
                differ("fused combine: Q8_0 quants of block", b, &xq_old[b * 32], &xq_fc[b * 32], 32);
                differ("fused combine: Q8_0 scale of block", b, &xd_old[b], &xd_fc[b], 4);
            }
        for (u32 i = 0; i < tickets.size(); i++)
            if (tickets[i]) differ("fused combine: ticket", i, &tickets[i], "\0\0\0", 4);
    }
    printf("%-34s heads %2u x %3u at pos %5u, visible %4u of %4u, blocks %4u/%4u/%2u%s: %s (%u of %u outputs finite, nonzero)\n",
           c.what, nh, hd, c.pos, n_rows, vis, slices * groups, chunks * groups * dim_slices, nh,
           fused ? ", fused too" : "", bad ? "DIFFER" : "same bits", nonzero, nh * hd);
    return bad;
}

int main(int argc, char** argv) {
    const Config configs[] = {
        // what, heads, head_dim, window, raw_cap, ratio, comp_cap, top_k, selected, n_rot, quant, pos
        {"flash heads, one row", 64, 512, 128, 128, 4, 64, 512, true, 64, true, 0},
        {"flash heads, 63 rows", 64, 512, 128, 128, 0, 0, 0, false, 64, true, 62},
        {"flash heads, 64 rows", 64, 512, 128, 128, 0, 0, 0, false, 64, true, 63},
        {"flash heads, 65 rows", 64, 512, 128, 128, 0, 0, 0, false, 64, true, 64},
        {"flash heads, 200 rows, wrap, indexed", 64, 512, 128, 130, 4, 128, 72, true, 64, true, 299},
        {"flash heads, 640 rows, wrap, indexed", 64, 512, 128, 191, 4, 1024, 512, true, 64, true, 2100},
        {"flash heads, selected, not yet indexed", 64, 512, 128, 128, 4, 1024, 512, true, 64, true, 1000},
        {"flash heads, ratio 128, no rope/q8", 64, 512, 128, 250, 128, 200, 0, false, 0, false, 16000},
        {"tiny model heads, indexed", 8, 256, 16, 16, 4, 16, 4, true, 64, true, 40},
        {"tiny model heads, ratio 8", 8, 256, 16, 79, 8, 16, 0, false, 64, true, 60},
        {"small heads, odd group", 5, 36, 16, 20, 2, 40, 6, true, 8, false, 13},
        {"19 heads, fused", 19, 64, 32, 38, 4, 16, 8, true, 16, true, 30},
        {"tiny heads, 2074 rows", 3, 8, 1024, 1030, 2, 1200, 2000, false, 0, false, 2100},
        {"tiny heads, 2100 rows indexed", 2, 12, 1500, 1502, 2, 2000, 600, true, 4, false, 2400},
    };
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    int bad = 0;
    for (int i = 0; i < (int)(sizeof(configs) / sizeof(configs[0])); i++)
        if (only < 0 || only == i) bad += run(configs[i]);
    return bad ? 1 : 0;
}
