// Runs the chunk build's F16 products through the per-row-group kernels they replace
// (mat_mul_f16, mat_mul_f16_split: 8 token rows per block row) and through the tile kernels
// (mat_mul_f16_tile, mat_mul_f16_split_tile: kernels/matvec.cu f16_tile), and hc_pre per token
// row against its chunk form (hc_pre_flat, hc_pre_mix, hc_pre_tail), in the emulator, on the same
// random inputs; compares every output bit for bit, and the bytes neither may write (rows that run
// nothing). For hc_pre: flat, mix, split, cur, norm, its Q8_0 and its Q8_K.
#include "emu.h"
#include "kern.inc"
#include "host.h"

static float value() {
    const u32 r = rnd() % 16;
    if (r == 0) return 0.0f;
    if (r == 1) return -0.0f;
    return frand(-1.0f, 1.0f);
}
static u16 weight() {
    const u32 r = rnd() % 16;
    if (r == 0) return 0x8000;  // -0
    return emu_f2h(frand(-0.5f, 0.5f));
}

// Token rows: `rows` of which the first `active` have count > 0 and, with `every` > 1, only
// rows with pos % every == 0 run (cond kind 1: (pos + 1) % ratio == 0).
struct Tokens {
    u32 rows, active, every;
};
static std::vector<StepParams> params(const Tokens& tk, u32 pad) {
    std::vector<StepParams> P(pad);
    for (u32 y = 0; y < pad; y++) P[y] = StepParams{0, 100 + y, 0, y < tk.active ? tk.active : 0u};
    return P;
}
static u64 cond_of(const Tokens& tk) { return (tk.every > 1 ? 1ull | (u64)tk.every << 2 : 0ull) | 1ull << 63; }
static bool runs(const Tokens& tk, u32 y) { return y < tk.active && (tk.every <= 1 || (100 + y + 1) % tk.every == 0); }
// Parameter rows: whole tiles of 32 token rows (the F16 products) and of 64 (hc_pre_mix's).
static u32 pad_rows(u32 rows) { return (rows + 63) / 64 * 64; }

static int compare(const char* what, RowBuf& a, RowBuf& b, u32 rows, u32 bytes) {
    int bad = 0;
    for (u32 y = 0; y < rows; y++)
        for (u32 i = 0; i < bytes; i++)
            if (a.row<u8>(y)[i] != b.row<u8>(y)[i]) {
                if (bad < 5) printf("  %s: row %u byte %u: %02x vs %02x\n", what, y, i, a.row<u8>(y)[i], b.row<u8>(y)[i]);
                bad++;
            }
    return bad;
}

// A matrix pair (rows2 > 0: the split form) or one matrix; splits: the tile kernel's K splits.
static int run_f16(const char* what, u32 in_dim, u32 rows, u32 rows2, bool split, Tokens tk, u32 splits) {
    const u32 pad = pad_rows(tk.rows);
    std::vector<StepParams> P = params(tk, pad);
    const u64 cond = cond_of(tk);
    std::vector<u16> w((size_t)rows * in_dim), w2((size_t)rows2 * in_dim);
    for (auto& v : w) v = weight();
    for (auto& v : w2) v = weight();
    RowBuf X((size_t)in_dim * 4, tk.rows, 0);
    for (u32 y = 0; y < tk.rows; y++)
        for (u32 i = 0; i < in_dim; i++) X.row<float>(y)[i] = value();
    const u32 nc = (in_dim + 511) / 512, all = rows + rows2;
    RowBuf o1(rows * 4, tk.rows), o2(rows * 4, tk.rows), q1(std::max(rows2, 1u) * 4, tk.rows),
        q2(std::max(rows2, 1u) * 4, tk.rows);
    RowBuf part((size_t)all * nc * 4, tk.rows), tick(64, tk.rows, 0);
    const u32 old_grid = split ? (all * nc + 7) / 8 : (rows + 7) / 8;
    const u32 tiles = (all + F16T_ROWS - 1) / F16T_ROWS;
    for (int pass = 0; pass < 2; pass++) {
        RowBuf& o = pass ? o2 : o1;
        RowBuf& q = pass ? q2 : q1;
        if (split) {
            MatVecF16SplitArgs a{};
            a.w = w.data(), a.x = (const float*)X.ptr(), a.partial = (float*)part.ptr(), a.tickets = (u32*)tick.ptr();
            a.out = (float*)o.ptr(), a.w2 = rows2 ? w2.data() : nullptr, a.out2 = (float*)q.ptr();
            a.in_dim = in_dim, a.rows = rows, a.rows_per_group = rows, a.n_chunks = nc, a.ticket = 3, a.rows2 = rows2;
            const RowStrides R = row_strides({0, X.stride, part.stride, tick.stride, o.stride, 0, q.stride});
            if (!pass) emu_launch({old_grid, (tk.rows + 7) / 8, 1}, 256, [&] { mat_mul_f16_split(P.data(), cond, R, a); });
            else emu_launch({tiles * splits, pad / 32, 1}, 256, [&] { mat_mul_f16_split_tile(P.data(), cond, R, a); });
        } else {
            MatVecF16Args a{};
            a.w = w.data(), a.x = (const float*)X.ptr(), a.out = (float*)o.ptr();
            a.in_dim = in_dim, a.rows = rows, a.rows_per_group = rows;
            const RowStrides R = row_strides({0, X.stride, o.stride});
            if (!pass) emu_launch({old_grid, (tk.rows + 7) / 8, 1}, 256, [&] { mat_mul_f16(P.data(), cond, R, a); });
            else emu_launch({tiles, pad / 32, 1}, 256, [&] { mat_mul_f16_tile(P.data(), cond, R, a); });
        }
    }
    int bad = compare("out", o1, o2, tk.rows, rows * 4) + (rows2 ? compare("out2", q1, q2, tk.rows, rows2 * 4) : 0);
    for (u32 y = 0; y < tk.rows; y++)
        for (u32 i = 0; i < 64; i++) bad += tick.row<u8>(y)[i] != 0;  // tickets left at 0
    u32 ran = 0;
    for (u32 y = 0; y < tk.rows; y++) ran += runs(tk, y);
    printf("%-28s %s in %5u rows %5u+%4u, tokens %3u (%3u run), K splits %2u: %s\n", what,
           split ? "split" : "plain", in_dim, rows, rows2, tk.rows, ran, splits, bad ? "DIFFER" : "same bits");
    return bad;
}

// hc_pre per token row (blockIdx.y) against hc_pre_flat + hc_pre_mix + hc_pre_tail.
static int run_hc(const char* what, u32 n_embd, u32 mix_rows, bool with_ss, bool q8, bool q8k, Tokens tk, u32 splits) {
    const u32 hc_dim = 4 * n_embd, nc = hc_dim / 512, pad = pad_rows(tk.rows);
    std::vector<StepParams> P = params(tk, pad);
    const u64 cond = cond_of(tk);
    std::vector<u16> fw((size_t)mix_rows * hc_dim);
    for (auto& v : fw) v = weight();
    std::vector<float> scale(3), base(mix_rows), norm_w(n_embd);
    for (auto& v : scale) v = frand(0.5f, 2.0f);
    for (auto& v : base) v = frand(-1.0f, 1.0f);
    for (auto& v : norm_w) v = frand(0.5f, 1.5f);
    RowBuf X((size_t)hc_dim * 4, tk.rows, 0), SS(nc * 4, tk.rows, 0);
    for (u32 y = 0; y < tk.rows; y++) {
        for (u32 i = 0; i < hc_dim; i++) X.row<float>(y)[i] = value() * 3.0f;
        for (u32 c = 0; c < nc; c++) {
            float s = 0.0f;
            for (u32 i = 0; i < 512; i++) s += X.row<float>(y)[c * 512 + i] * X.row<float>(y)[c * 512 + i];
            SS.row<float>(y)[c] = s;  // any values: both paths read the same
        }
    }
    struct Out {
        RowBuf flat, mix, split, cur, norm, xq, xd, xk, part, tick;
        Out(u32 hc_dim, u32 mr, u32 ne, u32 nc, u32 rows)
            : flat(hc_dim * 4, rows), mix(mr * 4, rows), split(24 * 4, rows), cur(ne * 4, rows), norm(ne * 4, rows),
              xq(ne, rows), xd(ne / 32 * 4, rows), xk(ne / 256 * 304, rows), part((size_t)mr * nc * 4, rows),
              tick(64, rows, 0) {}
    };
    Out o1(hc_dim, mix_rows, n_embd, nc, tk.rows), o2(hc_dim, mix_rows, n_embd, nc, tk.rows);
    for (int pass = 0; pass < 2; pass++) {
        Out& o = pass ? o2 : o1;
        HcPreArgs a{};
        a.x = (const float*)X.ptr(), a.fn_w = fw.data(), a.partial = (float*)o.part.ptr(), a.tickets = (u32*)o.tick.ptr();
        a.flat = (float*)o.flat.ptr(), a.mix = (float*)o.mix.ptr(), a.scale = scale.data(), a.base = base.data();
        a.split = (float*)o.split.ptr(), a.cur = (float*)o.cur.ptr(), a.norm_w = norm_w.data();
        a.norm = (float*)o.norm.ptr(), a.xq = q8 ? (i8*)o.xq.ptr() : nullptr, a.xd = q8 ? (float*)o.xd.ptr() : nullptr;
        a.xk = q8k ? (BlockQ8K*)o.xk.ptr() : nullptr, a.ss = with_ss ? (const float*)SS.ptr() : nullptr;
        a.hc_dim = hc_dim, a.mix_rows = mix_rows, a.n_chunks = nc, a.ticket = 5, a.n_embd = n_embd, a.iters = 20;
        a.eps_flat = 1e-6f, a.eps_hc = 1e-6f, a.eps_norm = 1e-6f;
        a.blocks_pre = (4 * nc + HC_PRE_WARPS - 1) / HC_PRE_WARPS;
        const RowStrides R = row_strides({X.stride, 0, o.part.stride, o.tick.stride, o.flat.stride, o.mix.stride, 0, 0,
                                          o.split.stride, o.cur.stride, 0, o.norm.stride, q8 ? o.xq.stride : 0,
                                          q8 ? o.xd.stride : 0, q8k ? o.xk.stride : 0, with_ss ? SS.stride : 0});
        // (a null pointer keeps stride 0, as build_chunk resolves it)
        if (!pass) {
            const u32 grid = a.blocks_pre + ((mix_rows - 4) * nc + HC_PRE_WARPS - 1) / HC_PRE_WARPS;
            emu_launch({grid, tk.rows, 1}, HC_PRE_WARPS * 32, [&] { hc_pre(P.data(), cond, R, a); });
        } else {
            emu_launch({(nc + HC_PRE_WARPS - 1) / HC_PRE_WARPS, tk.rows, 1}, HC_PRE_WARPS * 32,
                       [&] { hc_pre_flat(P.data(), cond, R, a); });
            emu_launch({((mix_rows + 16 * HC_MIX_TR - 1) / (16 * HC_MIX_TR)) * splits, pad / (16 * HC_MIX_TT), 1}, 256,
                       [&] { hc_pre_mix(P.data(), cond, R, a); });
            emu_launch({2, tk.rows, 1}, HC_PRE_WARPS * 32, [&] { hc_pre_tail(P.data(), cond, R, a); });
        }
    }
    int bad = compare("flat", o1.flat, o2.flat, tk.rows, hc_dim * 4) + compare("mix", o1.mix, o2.mix, tk.rows, mix_rows * 4) +
              compare("split", o1.split, o2.split, tk.rows, 24 * 4) + compare("cur", o1.cur, o2.cur, tk.rows, n_embd * 4) +
              compare("norm", o1.norm, o2.norm, tk.rows, n_embd * 4);
    if (q8) bad += compare("xq", o1.xq, o2.xq, tk.rows, n_embd) + compare("xd", o1.xd, o2.xd, tk.rows, n_embd / 32 * 4);
    if (q8k) bad += compare("xk", o1.xk, o2.xk, tk.rows, n_embd / 256 * 304);
    for (u32 y = 0; y < tk.rows; y++)
        for (u32 i = 0; i < 64; i++) bad += o2.tick.row<u8>(y)[i] != 0 || o1.tick.row<u8>(y)[i] != 0;
    u32 ran = 0;
    for (u32 y = 0; y < tk.rows; y++) ran += runs(tk, y);
    printf("%-28s hc_pre n_embd %5u, mix rows %2u, %s%s%s tokens %3u (%3u run), K splits %2u: %s\n", what, n_embd,
           mix_rows, with_ss ? "ss, " : "", q8 ? "q8_0, " : "", q8k ? "q8_k, " : "", tk.rows, ran, splits,
           bad ? "DIFFER" : "same bits");
    return bad;
}

int main(int argc, char** argv) {
    const bool full = argc > 1 && !strcmp(argv[1], "full");
    int bad = 0;
    // Small odd shapes: in_dim not a multiple of 512, rows not of 64, token rows predicated off.
    bad += run_f16("odd, one token", 520, 37, 0, false, {1, 1, 1}, 1);
    bad += run_f16("odd, 7 tokens", 1032, 70, 0, false, {7, 7, 1}, 1);
    bad += run_f16("odd pair, 7 tokens", 1032, 40, 33, true, {7, 7, 1}, 1);
    bad += run_f16("odd pair, 37 of 40, K 3", 1544, 50, 20, true, {40, 37, 1}, 3);
    bad += run_f16("odd pair, every 4th, K 2", 1032, 64, 64, true, {37, 37, 4}, 2);
    bad += run_f16("single, 37 tokens, K 4", 2048, 100, 0, true, {37, 37, 1}, 4);
    bad += run_f16("tiny rows, 256 tokens, K 8", 4096, 4, 0, true, {256, 256, 1}, 8);
    bad += run_f16("plain, 256 tokens", 1024, 130, 0, false, {256, 250, 1}, 1);
    // Flash shapes (rows cut where the full shape would take long in the emulator; "full" runs them).
    bad += run_f16("indexer q_b (plain)", 1024, full ? 8192 : 256, 0, false, {37, 37, 1}, 1);
    bad += run_f16("compressor r4 pair", 4096, full ? 1024 : 128, full ? 1024 : 128, true, {37, 37, 1}, 2);
    bad += run_f16("indexer compressor pair", 4096, 256, 256, true, {7, 7, 1}, 8);
    bad += run_f16("router (single)", 4096, 256, 0, true, {37, 37, 1}, 8);
    bad += run_f16("indexer proj (single)", 4096, 64, 0, true, {256, 256, 1}, 8);
    // hc_pre: Flash (n_embd 4096, 24 mix rows) and small ones.
    bad += run_hc("flash, 7 tokens", 4096, 24, true, true, true, {7, 7, 1}, 32);
    bad += run_hc("flash, 37 of 40, no ss", 4096, 24, false, false, true, {40, 37, 1}, 16);
    bad += run_hc("small, one token", 1024, 24, true, true, false, {1, 1, 1}, 1);
    bad += run_hc("small, 37 tokens", 256, 24, false, true, true, {37, 37, 1}, 2);
    bad += run_hc("small, 97 of 100, two tiles", 256, 24, true, true, true, {100, 97, 1}, 2);
    bad += run_hc("small, every 3rd of 70", 256, 24, false, false, false, {70, 70, 3}, 1);
    if (full) bad += run_hc("flash, 256 tokens", 4096, 24, true, true, true, {256, 256, 1}, 32);
    printf(bad ? "F16 emulation: DIFFER\n" : "F16 emulation: all same bits\n");
    return bad ? 1 : 0;
}
