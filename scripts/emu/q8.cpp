// Runs the chunk build's Q8_0 products (kernels/matvec.cu) in the emulator on the same random
// chunk: mat_mul_q8_0_tile (big tiles, cp.async and ldmatrix), today's mat_mul_q8_0 (16 token
// rows per block) and, where the shape is small enough to emulate quickly, the CUDA-core
// mat_vec_q8_0, each launched as build_chunk launches it, and compares every output row bit for
// bit, including the bytes none may write (token rows predicated off or past the chunk's tokens).
// Shapes: widths with a partial last chunk of 32 blocks, matrices whose rows end inside a block
// of 64, a paired second matrix (w2), grouped rows (rows_per_group), token counts that leave
// tiles partly empty. First it checks the emulated ldmatrix against its definition.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    const char* what;
    u32 in_dim, rows, rows2, groups, tokens, ratio;
    bool cuda_cores;  // also run mat_vec_q8_0 (slow in the emulator: a fiber switch per shuffle)
};

static u32 up(u32 n, u32 k) { return (n + k - 1) / k * k; }

static int run(const Config& c) {
    const u32 nb = c.in_dim / 32, rows_per_group = c.rows / c.groups;
    // Parameter rows padded as the host pads them (a whole number of every kernel's token tile).
    const u32 prow = up(up(up(c.tokens, Q8T_BN), Q8_MMA_TOKENS), Q8_TOKEN_ROWS);
    std::vector<StepParams> P(prow);
    // Token rows past the chunk's tokens have count 0; with a ratio, only rows whose position
    // ends a compressed row run (kind 1), so rows in the middle are predicated off too.
    for (u32 y = 0; y < prow; y++) P[y] = StepParams{rnd() % 1000, 100 + y, 0, y < c.tokens ? 1u : 0u};
    const u64 cond = (1ull << 63) | (c.ratio ? ((u64)c.ratio << 2) | 1 : 0);
    // Inputs for every parameter row (rows that run nothing hold data too: reading them for an
    // output would show as a difference). A block of zeros with scale 0 now and then.
    RowBuf XQ((size_t)c.groups * c.in_dim, prow), XD((size_t)c.groups * nb * 4, prow);
    for (u32 y = 0; y < prow; y++)
        for (u32 b = 0; b < c.groups * nb; b++) {
            const bool zero = rnd() % 16 == 0;
            for (u32 i = 0; i < 32; i++) XQ.row<i8>(y)[b * 32 + i] = zero ? 0 : (i8)(int)(rnd() % 255 - 127);
            XD.row<float>(y)[b] = zero ? 0.0f : frand(1e-3f, 3e-2f);
        }
    RowBuf W = q8_split_matrix(c.rows, nb), W2 = q8_split_matrix(c.rows2 ? c.rows2 : 1, nb);

    auto launch = [&](int kind, RowBuf& out, RowBuf& out2) {
        MatVecQ80Args a{};
        a.w = W.row<u8>(0);
        a.xq = (const i8*)XQ.ptr();
        a.xd = (const float*)XD.ptr();
        a.out = (float*)out.ptr();
        a.w2 = c.rows2 ? W2.row<u8>(0) : nullptr;
        a.out2 = c.rows2 ? (float*)out2.ptr() : nullptr;
        a.in_dim = c.in_dim;
        a.rows = c.rows;
        a.rows_per_group = rows_per_group;
        a.rows2 = c.rows2;
        const RowStrides R = row_strides({0, XQ.stride, XD.stride, out.stride, 0, out2.stride});
        const StepParams* P0 = P.data();
        const u32 all = c.rows + c.rows2;
        if (kind == 0)
            emu_launch({(c.tokens + Q8T_BN - 1) / Q8T_BN, (all + 63) / 64, 1}, Q8T_THREADS,
                       [&] { mat_mul_q8_0_tile(P0, cond, R, a); });
        else if (kind == 1)
            emu_launch({(c.tokens + Q8_MMA_TOKENS - 1) / Q8_MMA_TOKENS, (all + 63) / 64, 1}, 128,
                       [&] { mat_mul_q8_0(P0, cond, R, a); });
        else
            emu_launch({(c.tokens + Q8_TOKEN_ROWS - 1) / Q8_TOKEN_ROWS, (all + 7) / 8, 1}, 256,
                       [&] { mat_vec_q8_0(P0, cond, R, a); });
    };
    RowBuf out_new(c.rows * 4, prow), out2_new(c.rows2 * 4 + 4, prow);
    launch(0, out_new, out2_new);
    const char* names[3] = {"mat_mul_q8_0_tile", "mat_mul_q8_0", "mat_vec_q8_0"};
    int bad = 0;
    u32 written = 0;
    for (u32 y = 0; y < prow; y++) written += y < c.tokens && ds4_cond(&P[y], cond);
    for (int kind = 1; kind <= (c.cuda_cores ? 2 : 1); kind++) {
        RowBuf out_old(c.rows * 4, prow), out2_old(c.rows2 * 4 + 4, prow);
        launch(kind, out_old, out2_old);
        const size_t n = (size_t)out_new.stride * prow, n2 = (size_t)out2_new.stride * prow;
        const bool same = !memcmp(out_old.base(), out_new.base(), n) && !memcmp(out2_old.base(), out2_new.base(), n2);
        bad += !same;
        printf("%-44s %s against %-13s: %s\n", c.what, names[0], names[kind], same ? "same bits" : "DIFFER");
        if (!same)
            for (int m = 0, shown = 0; m < 2; m++) {
                RowBuf &o = m ? out2_old : out_old, &w = m ? out2_new : out_new;
                for (size_t i = 0; i < (size_t)w.stride * prow && shown < 6; i += 4)
                    if (memcmp(o.base() + i, w.base() + i, 4)) {
                        float x, z;
                        memcpy(&x, w.base() + i, 4);
                        memcpy(&z, o.base() + i, 4);
                        printf("  out%s token %zu row %zu: %a against %a\n", m ? "2" : "", i / w.stride, i % w.stride / 4, x, z);
                        shown++;
                    }
            }
    }
    // Sanity: some outputs were written, and they are not the fill.
    u32 filled = 0;
    for (u32 y = 0; y < prow; y++) {
        unsigned fill;
        memcpy(&fill, out_new.row<float>(y), 4);
        filled += fill == 0xababababu;
    }
    if (written == 0 || filled != prow - written) {
        printf("%-44s unexpected: %u token rows run, %u rows left unwritten of %u\n", c.what, written, filled, prow);
        bad++;
    }
    return bad;
}

// The emulated ldmatrix against its definition (PTX ISA: matrix q's rows from lanes 8 q ..,
// lane l gets 4 bytes (l % 4) of row l / 4), on a staged tile as mat_mul_q8_0_tile lays it out.
static int ldmatrix_check() {
    int bad = 0;
    emu_launch({1, 1, 1}, 32, [&] {
        static unsigned char rows[16 * Q8T_ROW];
        if (threadIdx.x == 0)
            for (auto& b : rows) b = (unsigned char)rnd();
        __syncwarp();
        const u32 lane = threadIdx.x;
        u32 d[4];
        emu_ldmatrix_x4(d, rows + (lane % 8 + 8 * ((lane / 8) & 1)) * Q8T_ROW + 16 * (lane / 16));
        for (u32 q = 0; q < 4; q++) {
            // Matrix q: rows 8 (q & 1) .., bytes 16 (q >> 1) ..: the A fragment's register q.
            u32 want;
            memcpy(&want, rows + (lane / 4 + 8 * (q & 1)) * Q8T_ROW + 16 * (q >> 1) + 4 * (lane % 4), 4);
            bad += d[q] != want;
        }
    });
    printf("emulated ldmatrix .x4 against its definition: %s\n", bad ? "DIFFER" : "same");
    return bad;
}

int main(int argc, char** argv) {
    int bad = ldmatrix_check();
    const Config configs[] = {
        {"1024 wide, 64 rows, 16 tokens", 1024, 64, 0, 1, 16, 0, true},
        {"1056 wide (33 blocks), 80 rows, 7 tokens", 1056, 80, 0, 1, 7, 0, true},
        {"4096 wide, 128 rows, 37 tokens, ratio 3", 4096, 128, 0, 1, 37, 3, true},
        {"8192 wide, 64 rows, 16 tokens", 8192, 64, 0, 1, 16, 0, false},
        {"4096 wide, 96 + 48 paired rows, 37 tokens", 4096, 96, 48, 1, 37, 0, false},
        {"2048 wide, 64 + 16 paired rows, 1 token", 2048, 64, 16, 1, 1, 0, true},
        {"1024 wide, 2 groups of 64 rows, 16 tokens", 1024, 128, 0, 2, 16, 0, true},
        {"544 wide (17 blocks), 4 groups of 64, 9 tokens", 544, 256, 0, 4, 9, 2, false},
        {"1024 wide, 64 rows, 256 tokens", 1024, 64, 0, 1, 256, 0, false},
        {"1056 wide, 48 + 32 paired rows, 130 tokens, ratio 2", 1056, 48, 32, 1, 130, 2, false},
    };
    const int only = argc > 1 ? atoi(argv[1]) : -1;
    for (int i = 0; i < (int)(sizeof(configs) / sizeof(configs[0])); i++)
        if (only < 0 || only == i) bad += run(configs[i]);
    return bad ? 1 : 0;
}
