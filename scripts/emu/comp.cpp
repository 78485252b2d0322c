// Runs a chunk's compressor row loop through `compressor_update` (one block, the rows in order)
// and through `compressor_update_chunk` (a block per row, emits in parallel, the last block by
// ticket writes the state), in the emulator, on the same random inputs and carried state, and
// compares the compressed-row cache, the window state left for the next chunk, and each row's
// pooled and row outputs bit for bit (and the ticket back at 0). The parallel kernel runs with its
// blocks in order, in reverse and shuffled, so that no order of blocks passes by luck.
#include <algorithm>

#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    const char* what;
    u32 ratio, hd, n_rot, quant, ape_f16;
    u32 rows, active, pos0;
    bool fresh;       // the state as a new sequence starts it (kv 0, scores -1e30)
    bool shared_out;  // pooled and row without a row stride (one buffer for the chunk)
};

// Values with zeros of either sign; scores with some very negative ones so that windows whose
// every score is -1e30 (pool 0) and tiny weights occur.
static float value() {
    const u32 r = rnd() % 16;
    if (r == 0) return 0.0f;
    if (r == 1) return -0.0f;
    return frand(-2.0f, 2.0f);
}
static float score_value() {
    const u32 r = rnd() % 32;
    if (r == 0) return -1.0e30f;
    if (r == 1) return frand(-120.0f, -80.0f);
    return frand(-6.0f, 6.0f);
}

static int compare(const char* what, const u32* a, const u32* b, size_t n, int* shown) {
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) {
            if (*shown < 8) printf("  %s[%zu]: loop %08x, chunk %08x\n", what, i, a[i], b[i]);
            (*shown)++;
            bad++;
        }
    return bad;
}

static int run(const Config& c) {
    const u32 ratio = c.ratio, hd = c.hd, width = ratio == 4 ? 2 * hd : hd, ns = ratio == 4 ? 8 : ratio;
    const u32 pairs = c.n_rot / 2, pos_end = c.pos0 + c.rows;
    const u32 cache_rows = pos_end / ratio + 1;
    // Inputs: each row's kv and score, the weights, the RoPE table (a row per position).
    RowBuf KV((size_t)width * 4, c.rows, 0), SC((size_t)width * 4, c.rows, 0);
    for (u32 y = 0; y < c.rows; y++)
        for (u32 j = 0; j < width; j++) {
            KV.row<float>(y)[j] = value();
            SC.row<float>(y)[j] = score_value();
        }
    std::vector<float> ape_f((size_t)width * ratio);
    std::vector<unsigned short> ape_h((size_t)width * ratio);
    for (size_t i = 0; i < ape_f.size(); i++) {
        ape_f[i] = frand(-1.0f, 1.0f);
        ape_h[i] = emu_f2h(ape_f[i]);
    }
    std::vector<float> norm_w(hd), table((size_t)(pos_end + 1) * pairs * 2);
    for (auto& v : norm_w) v = frand(0.5f, 1.5f);
    for (auto& v : table) v = frand(-1.0f, 1.0f);
    // The carried state.
    std::vector<float> skv((size_t)ns * width), ssc((size_t)ns * width);
    for (size_t i = 0; i < skv.size(); i++) {
        skv[i] = c.fresh ? 0.0f : value();
        ssc[i] = c.fresh ? -1.0e30f : score_value();
    }
    std::vector<StepParams> P(c.rows);
    for (u32 y = 0; y < c.rows; y++) P[y] = StepParams{0, c.pos0 + y, 0, y < c.active ? c.active : 0u};
    // A chunk launch's predicate: always, but not on rows past the chunk's tokens; the row count.
    const u64 cond = 1ull << 63 | (u64)c.rows << 50;

    auto make = [&](std::vector<float>& st_kv, std::vector<float>& st_sc, std::vector<float>& cache, RowBuf& pooled,
                    RowBuf& row, std::vector<u32>& tickets) {
        st_kv = skv;
        st_sc = ssc;
        cache.assign((size_t)cache_rows * hd, bits_as<float>(0xababababu));
        tickets.assign(4, 0);
        CompressorUpdateArgs a{};
        a.kv = (const float*)KV.ptr();
        a.score = (const float*)SC.ptr();
        a.ape = c.ape_f16 ? (const void*)ape_h.data() : (const void*)ape_f.data();
        a.state_kv = st_kv.data();
        a.state_score = st_sc.data();
        a.pooled = (float*)pooled.ptr();
        a.norm_w = norm_w.data();
        a.row = (float*)row.ptr();
        a.table = table.data();
        a.cache = cache.data();
        a.tickets = tickets.data();
        a.emit_cond = 1ull | (u64)ratio << 2;
        a.ape_f16 = c.ape_f16;
        a.width = width;
        a.ratio = ratio;
        a.head_dim = hd;
        a.n_rot = c.n_rot;
        a.quant = c.quant;
        a.eps = 1.0e-6f;
        a.ticket = 2;
        return a;
    };
    auto strides = [&](RowBuf& pooled, RowBuf& row) {
        const u32 sp = c.shared_out ? 0 : pooled.stride, sr = c.shared_out ? 0 : row.stride;
        return row_strides({KV.stride, SC.stride, 0, 0, 0, sp, 0, sr, 0, 0, 0});
    };
    const StepParams* P0 = P.data();

    // The row loop, as build_chunk launches it (one block of 256).
    std::vector<float> l_kv, l_sc, l_cache;
    std::vector<u32> l_t;
    RowBuf l_pooled((size_t)hd * 4, c.rows), l_row((size_t)hd * 4, c.rows);
    {
        const CompressorUpdateArgs a = make(l_kv, l_sc, l_cache, l_pooled, l_row, l_t);
        const RowStrides R = strides(l_pooled, l_row);
        emu_block_order.clear();
        emu_launch({1, 1, 1}, 256, [&] { compressor_update(P0, cond, R, a); });
    }
    u32 emits = 0;
    for (u32 y = 0; y < c.active; y++) emits += (c.pos0 + y + 1) % ratio == 0;

    int bad_all = 0;
    const char* orders[] = {"in order", "reversed", "shuffled"};
    for (int o = 0; o < 3; o++) {
        std::vector<float> n_kv, n_sc, n_cache;
        std::vector<u32> n_t;
        RowBuf n_pooled((size_t)hd * 4, c.rows), n_row((size_t)hd * 4, c.rows);
        const CompressorUpdateArgs a = make(n_kv, n_sc, n_cache, n_pooled, n_row, n_t);
        const RowStrides R = strides(n_pooled, n_row);
        emu_block_order.resize(c.rows);
        for (u32 i = 0; i < c.rows; i++) emu_block_order[i] = o == 1 ? c.rows - 1 - i : i;
        if (o == 2) std::shuffle(emu_block_order.begin(), emu_block_order.end(), rng);
        emu_launch({c.rows, 1, 1}, COMP_CHUNK_THREADS, [&] { compressor_update_chunk(P0, cond, R, a); });
        emu_block_order.clear();
        int bad = 0, shown = 0;
        bad += compare("cache", (const u32*)l_cache.data(), (const u32*)n_cache.data(), l_cache.size(), &shown);
        bad += compare("state_kv", (const u32*)l_kv.data(), (const u32*)n_kv.data(), l_kv.size(), &shown);
        bad += compare("state_score", (const u32*)l_sc.data(), (const u32*)n_sc.data(), l_sc.size(), &shown);
        bad += compare("pooled", (const u32*)l_pooled.base(), (const u32*)n_pooled.base(),
                       l_pooled.stride * c.rows / 4, &shown);
        bad += compare("row", (const u32*)l_row.base(), (const u32*)n_row.base(), l_row.stride * c.rows / 4, &shown);
        bad += compare("tickets", l_t.data(), n_t.data(), l_t.size(), &shown);
        if (bad) printf("  blocks %s: %d words differ\n", orders[o], bad);
        bad_all += bad;
    }
    printf("%-38s ratio %3u hd %3u %s ape %s, rows %3u/%3u at %5u, %2u emits, blocks in order, reversed, shuffled: %s\n",
           c.what, ratio, hd, c.quant ? "fp4" : "fp8", c.ape_f16 ? "f16" : "f32", c.active, c.rows, c.pos0, emits,
           bad_all ? "DIFFER" : "same bits");
    return bad_all;
}

int main(int argc, char** argv) {
    const Config configs[] = {
        // what, ratio, hd, n_rot, quant, ape_f16, rows, active, pos0, fresh, shared_out
        {"1 row, emit", 4, 512, 64, 0, 1, 1, 1, 3, false, false},
        {"1 row, no emit", 4, 512, 64, 0, 0, 1, 1, 5, false, false},
        {"7 rows, emit first and mid", 4, 512, 64, 0, 1, 7, 7, 3, false, false},
        {"7 rows, emit mid and last", 4, 512, 64, 0, 0, 7, 7, 1, false, false},
        {"37 rows, 30 on, straddles", 4, 512, 64, 0, 1, 37, 30, 2, false, false},
        {"37 rows from 0, fresh state", 4, 512, 64, 0, 1, 37, 37, 0, true, false},
        {"37 rows, one pooled/row buffer", 4, 512, 64, 0, 1, 37, 33, 6, false, true},
        {"256 rows, bench chunk", 4, 512, 64, 0, 1, 256, 256, 2052, false, false},
        {"indexer 1 row, emit", 4, 128, 64, 1, 1, 1, 1, 7, false, false},
        {"indexer 7 rows, emit mid and last", 4, 128, 64, 1, 1, 7, 7, 5, false, false},
        {"indexer 37 rows, 35 on", 4, 128, 64, 1, 0, 37, 35, 9, false, false},
        {"indexer 256 rows, bench chunk", 4, 128, 64, 1, 1, 256, 256, 2052, false, false},
        {"1 row, emit (128)", 128, 512, 64, 0, 1, 1, 1, 255, false, false},
        {"7 rows, emit last, straddles (128)", 128, 512, 64, 0, 1, 7, 7, 121, false, false},
        {"7 rows, emit first (128)", 128, 512, 64, 0, 0, 7, 7, 127, false, false},
        {"37 rows, 20 on, no emit (128)", 128, 512, 64, 0, 1, 37, 20, 100, false, false},
        {"37 rows, emit at 27 (128)", 128, 512, 64, 0, 1, 37, 37, 100, false, false},
        {"256 rows, bench chunk (128)", 128, 512, 64, 0, 1, 256, 256, 2052, false, false},
        {"256 rows from 127, 200 on (128)", 128, 512, 64, 0, 0, 256, 200, 127, false, false},
        {"256 rows from 0, fresh (128)", 128, 512, 64, 0, 1, 256, 256, 0, true, true},
    };
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    int bad = 0;
    for (int i = 0; i < (int)(sizeof(configs) / sizeof(configs[0])); i++)
        if (only < 0 || only == i) bad += run(configs[i]);
    return bad ? 1 : 0;
}
