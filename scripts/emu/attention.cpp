// Runs a chunk's attention through the per-(head, row) kernel `attention` (launched over
// blockIdx.y as build_chunk does) and through `attention_chunk` (a block per row and group of
// heads), in the emulator, and compares the output, the weights left in the scores scratch and
// the fused Q8_0 bit for bit.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    const char* what;
    u32 n_head, head_dim, window, raw_cap, ratio, comp_cap, top_k;
    bool selected;
    u32 n_rot;  // 0: no fused inverse RoPE
    bool quant;  // the fused Q8_0 (head_dim a multiple of 32)
    u32 rows, active, pos0;
    bool shuffled = false;  // odd rows' lists not ascending (attention takes any order)
};

static int run(const Config& c) {
    const u32 hd = c.head_dim, nh = c.n_head, max_rows = c.raw_cap + c.comp_cap;
    const u32 last_pos = c.pos0 + c.rows - 1, pairs = c.n_rot / 2;
    std::vector<float> raw((size_t)c.raw_cap * hd), comp((size_t)std::max(c.comp_cap, 1u) * hd), sinks(nh);
    std::vector<float> rope((size_t)(last_pos + 1) * std::max(pairs, 1u) * 2);
    for (auto& v : raw) v = frand(-1.0f, 1.0f);
    for (auto& v : comp) v = frand(-1.0f, 1.0f);
    for (auto& v : sinks) v = frand(-2.0f, 2.0f);
    for (auto& v : rope) v = frand(-1.0f, 1.0f);
    std::vector<StepParams> P(c.rows);
    for (u32 y = 0; y < c.rows; y++) P[y] = StepParams{rnd() % 1000, c.pos0 + y, 0, y < c.active ? 1u : 0u};
    RowBuf Q((size_t)nh * hd * 4, c.rows, 0), SEL(std::max(c.top_k, 1u) * 4, c.rows, 0);
    for (u32 y = 0; y < c.rows; y++) {
        for (u32 i = 0; i < nh * hd; i++) Q.row<float>(y)[i] = frand(-3.0f, 3.0f);
        // The indexer's pick: top_k distinct visible compressed rows, ascending.
        const u32 n_comp = c.ratio ? std::min((c.pos0 + y + 1) / c.ratio, c.comp_cap) : 0;
        std::vector<int> pick;
        for (u32 r = 0; r < n_comp; r++) pick.push_back((int)r);
        for (u32 i = 0; i + 1 < pick.size(); i++) std::swap(pick[i], pick[i + rnd() % (pick.size() - i)]);
        pick.resize(std::min<size_t>(pick.size(), c.top_k));
        std::sort(pick.begin(), pick.end());
        if (c.shuffled && y % 2 && pick.size() > 1) std::swap(pick[0], pick[pick.size() - 1]);
        for (u32 i = 0; i < pick.size(); i++) SEL.row<int>(y)[i] = pick[i];
    }
    const size_t out_bytes = (size_t)nh * hd * 4, sc_bytes = (size_t)nh * max_rows * 4;
    const u32 nblk = nh * hd / 32;
    RowBuf out_old(out_bytes, c.rows), out_new(out_bytes, c.rows), sc_old(sc_bytes, c.rows), sc_new(sc_bytes, c.rows);
    RowBuf xq_old(nblk * 32, c.rows), xq_new(nblk * 32, c.rows), xd_old(nblk * 4, c.rows), xd_new(nblk * 4, c.rows);
    const u64 cond = 1ull << 63;
    auto args = [&](RowBuf& out, RowBuf& sc, RowBuf& xq, RowBuf& xd) {
        AttentionArgs a{};
        a.q = (const float*)Q.ptr();
        a.raw = raw.data();
        a.comp = c.ratio ? comp.data() : nullptr;
        a.selected = c.selected ? (const int*)SEL.ptr() : nullptr;
        a.sinks = sinks.data();
        a.out = (float*)out.ptr();
        a.scores = (float*)sc.ptr();
        a.rope = c.n_rot ? rope.data() : nullptr;
        a.xq = c.quant ? (i8*)xq.ptr() : nullptr;
        a.xd = c.quant ? (float*)xd.ptr() : nullptr;
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
        return a;
    };
    auto strides = [&](RowBuf& out, RowBuf& sc, RowBuf& xq, RowBuf& xd) {
        // A null pointer stays null on every row (its stride is 0, as build_chunk resolves it).
        const u32 sel = c.selected ? SEL.stride : 0, q8 = c.quant ? xq.stride : 0, q8d = c.quant ? xd.stride : 0;
        return row_strides({Q.stride, 0, 0, sel, 0, out.stride, sc.stride, 0, q8, q8d});
    };
    const StepParams* P0 = P.data();
    {
        const AttentionArgs a = args(out_old, sc_old, xq_old, xd_old);
        const RowStrides R = strides(out_old, sc_old, xq_old, xd_old);
        emu_launch({nh, c.rows, 1}, std::max(512u, hd), [&] { attention(P0, cond, R, a); });
    }
    {
        const AttentionArgs a = args(out_new, sc_new, xq_new, xd_new);
        const RowStrides R = strides(out_new, sc_new, xq_new, xd_new);
#if defined(EMU_ATTN_WIDE)
        // As mod.rs launches it: a block per (group of 32 heads, token row), cond as the plan's.
        emu_launch({(nh + ATTN_WIDE_HEADS - 1) / ATTN_WIDE_HEADS, c.rows, 1}, ATTN_WIDE_THREADS,
                   [&] { attention_row_wide(P0, cond, R, a); });
#elif defined(EMU_ATTN_ROWS2)
        // As mod.rs launches it: attention_rows's grid and block (its shared memory is static here).
        const u64 rcond = cond | (u64)c.rows << 50;
        emu_launch({(nh + 15) / 16, (c.rows + 1) / 2, 1}, ATTN_ROWS_THREADS, [&] { attention_rows2(P0, rcond, R, a); });
#elif defined(EMU_ATTN_ROWS)
        // As mod.rs launches it: row pairs along y, the row count in cond bits 50..62.
        const u64 rcond = cond | (u64)c.rows << 50;
        emu_launch({(nh + 15) / 16, (c.rows + 1) / 2, 1}, ATTN_ROWS_THREADS, [&] { attention_rows(P0, rcond, R, a); });
#else
        emu_launch({(nh + ATTN_CHUNK_HEADS - 1) / ATTN_CHUNK_HEADS, c.rows, 1}, ATTN_CHUNK_THREADS,
                   [&] { attention_chunk(P0, cond, R, a); });
#endif
    }
    int bad = 0;
    u32 nonzero = 0, n_rows_min = ~0u, n_rows_max = 0;
    auto differ = [&](const char* what, u32 y, u32 i, const void* o, const void* n, size_t bytes) {
        if (!memcmp(o, n, bytes)) return;
        if (bad < 10) printf("  row %u %s %u differs\n", y, what, i);
        bad++;
    };
    for (u32 y = 0; y < c.rows; y++) {
        if (y >= c.active) {
            for (u32 i = 0; i < nh * hd; i++)
                if (out_new.row<u32>(y)[i] != 0xababababu) {
                    printf("  inactive row %u written\n", y);
                    bad++;
                    break;
                }
            continue;
        }
        const u32 pos = c.pos0 + y;
        const u32 n_raw = std::min(std::min(pos + 1, c.window), c.raw_cap);
        const u32 n_comp = c.ratio ? std::min((pos + 1) / c.ratio, c.comp_cap) : 0;
        const u32 n_rows = n_raw + (c.selected && n_comp > c.top_k ? c.top_k : n_comp);
        n_rows_min = std::min(n_rows_min, n_rows);
        n_rows_max = std::max(n_rows_max, n_rows);
        for (u32 i = 0; i < nh * hd; i++) {
            differ("out", y, i, out_old.row<float>(y) + i, out_new.row<float>(y) + i, 4);
            const float o = out_old.row<float>(y)[i];
            nonzero += std::isfinite(o) && o != 0.0f;
        }
        for (u32 h = 0; h < nh; h++)
            differ("weights of head", y, h, sc_old.row<float>(y) + h * max_rows, sc_new.row<float>(y) + h * max_rows,
                   n_rows * 4);
        if (c.quant)
            for (u32 b = 0; b < nblk; b++) {
                differ("Q8_0 quants of block", y, b, xq_old.row<i8>(y) + b * 32, xq_new.row<i8>(y) + b * 32, 32);
                differ("Q8_0 scale of block", y, b, xd_old.row<float>(y) + b, xd_new.row<float>(y) + b, 4);
            }
    }
#if defined(EMU_ATTN_WIDE)
    const char* form = "attention_row_wide";
    const u32 threads = ATTN_WIDE_THREADS;
#elif defined(EMU_ATTN_ROWS2)
    const char* form = "attention_rows2";
    const u32 threads = ATTN_ROWS_THREADS;
#elif defined(EMU_ATTN_ROWS)
    const char* form = "attention_rows";
    const u32 threads = ATTN_ROWS_THREADS;
#else
    const char* form = "attention_chunk";
    const u32 threads = ATTN_CHUNK_THREADS;
#endif
    printf("%s %-36s heads %2u x %3u rows %u/%u at %u, visible %u..%u, %u threads: %s (%u of %u outputs finite, nonzero)\n",
           form, c.what, nh, hd, c.active, c.rows, c.pos0, n_rows_min, n_rows_max, threads,
           bad ? "DIFFER" : "same bits", nonzero, c.active * nh * hd);
    return bad;
}

int main(int argc, char** argv) {
    const Config configs[] = {
        // what, heads, head_dim, window, raw_cap, ratio, comp_cap, top_k, selected, n_rot, quant, rows, active, pos0
        // Flash's heads; the raw window wraps the ring inside the chunk; 64-row chunks straddled.
        {"flash heads, window + comp", 64, 512, 40, 48, 4, 64, 512, false, 64, true, 7, 7, 100},
        {"flash heads, indexer selects", 64, 512, 60, 66, 4, 64, 12, true, 64, true, 7, 6, 60},
        {"flash heads, one row", 64, 512, 128, 191, 4, 64, 512, true, 64, true, 1, 1, 200},
        {"flash heads, window only", 64, 512, 24, 30, 0, 0, 0, false, 0, false, 4, 4, 0},
        {"small heads, odd group", 5, 36, 16, 20, 2, 40, 6, true, 8, false, 7, 7, 13},
        {"small heads, fused", 19, 64, 32, 38, 4, 16, 8, true, 16, true, 7, 5, 30},
        {"tiny heads, 33 row chunks", 3, 8, 1024, 1030, 2, 1200, 2000, false, 0, false, 3, 3, 2100},
        {"tiny heads, 33 chunks indexed", 2, 12, 1500, 1502, 2, 2000, 600, true, 4, false, 3, 3, 2400},
        {"head_dim 128, first tokens", 16, 128, 64, 70, 4, 16, 4, true, 64, true, 7, 7, 0},
#if defined(EMU_ATTN_ROWS) || defined(EMU_ATTN_ROWS2) || defined(EMU_ATTN_WIDE)
        // attention_rows shares a pair of token rows' KV rows: odd row counts (a lone last row),
        // windows that wrap the ring inside the chunk, chunks of 1, 7, 64 and 256 (part active),
        // with and without the indexer's lists, Flash heads and small ones, lists that are not
        // ascending (each row alone) and universes past its table (each row alone).
        {"flash heads, 9 rows wrap + indexer", 64, 512, 128, 136, 4, 80, 40, true, 64, true, 9, 9, 300},
        {"flash heads, 2 rows ratio 128", 64, 512, 128, 136, 128, 32, 512, false, 64, true, 2, 2, 2052},
        {"flash heads, 1 row indexer", 64, 512, 128, 136, 4, 600, 512, true, 64, true, 1, 1, 2100},
        {"small heads, 64 rows wrap", 4, 32, 16, 80, 4, 40, 5, true, 8, true, 64, 64, 70},
        {"small heads, 64 rows no indexer", 6, 48, 24, 90, 2, 64, 1000, false, 0, false, 64, 61, 41},
        {"small heads, 256 rows partial", 3, 32, 20, 280, 4, 100, 12, true, 8, true, 256, 233, 100},
        {"small heads, 256 rows ratio 8", 17, 16, 32, 300, 8, 64, 3, false, 4, false, 256, 256, 0},
        {"dim 4, 7 rows", 2, 4, 8, 16, 2, 20, 3, true, 0, false, 7, 7, 9},
        {"big universe: rows alone", 2, 8, 2000, 2010, 2, 1500, 3000, false, 0, false, 3, 3, 2500},
        {"lists not ascending: rows alone", 5, 36, 16, 40, 2, 40, 6, true, 8, false, 7, 7, 23, true},
        {"flash heads, 2 rows indexer 512", 64, 512, 128, 136, 4, 600, 512, true, 64, true, 2, 2, 2100},
#endif
#if defined(EMU_ATTN_ROWS2) || defined(EMU_ATTN_WIDE)
        // attention_rows2 shares the union of the two rows' compressed rows: two picks of 512 from
        // 4,096 (past attention_rows' table), every row of a long ratio-128 cache, and more
        // compressed rows than its bitmap holds (each row alone).
        {"union of two picks from 4096", 4, 32, 128, 136, 4, 4200, 512, true, 8, true, 4, 4, 16384},
        {"union: 1562 rows, no indexer", 3, 16, 128, 136, 128, 1600, 512, false, 4, false, 3, 3, 200000},
        {"union past the bitmap: rows alone", 2, 8, 16, 24, 2, 70000, 16, true, 0, false, 3, 3, 140000},
#endif
#ifdef EMU_ATTN_WIDE
        // attention_row_wide: a block per (token row, 32 heads): a chunk of 1,040 rows (some off)
        // with indexer picks of 50 (two chunks of rows) and the window wrapping; 20 heads (a part
        // group) over 110 rows; 36 heads of dim 128 (a second group of 4).
        {"1040 rows, indexer, window wraps", 2, 32, 24, 30, 4, 400, 50, true, 8, true, 1040, 1031, 500},
        {"20 heads, indexer 70", 20, 64, 40, 44, 4, 100, 70, true, 16, true, 9, 9, 300},
        {"36 heads, dim 128, part group", 36, 128, 40, 44, 8, 20, 6, true, 16, true, 5, 5, 140},
#endif
    };
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    int bad = 0;
    for (int i = 0; i < (int)(sizeof(configs) / sizeof(configs[0])); i++)
        if (only < 0 || only == i) bad += run(configs[i]);
    return bad ? 1 : 0;
}
