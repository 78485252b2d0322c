// Runs the decode build's grouped Q8_0 projection with its quantization inside (kernels/fused.cu
// mat_vec_q8_0_quant in quant mode, as plan.rs fuses wo_a with wo_b's input) in the emulator
// against the two launches it replaces (mat_vec_q8_0, then quantize_q8_0), on the same random
// weights and inputs, and compares the projection, its Q8_0 quants and scales bit for bit.
// Shapes: Flash's wo_a width (4096, 8 groups of rows), one chunk, a partial chunk, a wide row.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    u32 in_dim, rows, groups;
};

struct Outs {
    std::vector<float> out, xd;
    std::vector<i8> xq;
    explicit Outs(u32 rows) : out(rows, 7.0f), xd(rows / 32, 7.0f), xq(rows, 7) {}
};

static int run(const Config& c) {
    const u32 nb = c.in_dim / 32, rows = c.rows, per_group = rows / c.groups;
    RowBuf wm = q8_split_matrix(rows, nb);
    const u8* w = wm.row<u8>(0);
    // Each group's input and its Q8_0 scales.
    std::vector<i8> xq((size_t)c.groups * c.in_dim);
    std::vector<float> xd((size_t)c.groups * nb);
    for (auto& v : xq) v = (i8)(int)(rnd() % 255 - 127);
    for (auto& v : xd) v = rnd() % 16 == 0 ? 0.0f : frand(1e-3f, 3e-2f);
    const StepParams P{0, 3, 0, 0};
    const StepParams* P0 = &P;
    const RowStrides R{};
    MatVecQ80Args m{};
    m.w = w, m.xq = xq.data(), m.xd = xd.data(), m.in_dim = c.in_dim, m.rows = rows, m.rows_per_group = per_group;

    Outs two(rows);
    m.out = two.out.data();
    emu_launch({rows / 8, 1, 1}, 256, [&] { mat_vec_q8_0(P0, 0, R, m); });
    QuantizeQ80Args q{};
    q.x = two.out.data(), q.xq = two.xq.data(), q.xd = two.xd.data(), q.n = rows;
    emu_launch({(rows / 32 + 7) / 8, 1, 1}, 256, [&] { quantize_q8_0(P0, 0, R, q); });

    Outs fused(rows);
    MatVecQ80TailArgs t{};
    t.w = w, t.xq = xq.data(), t.xd = xd.data(), t.out = fused.out.data();
    t.tail_xq = fused.xq.data(), t.tail_xd = fused.xd.data();
    t.in_dim = c.in_dim, t.rows = rows, t.rows_per_group = per_group, t.mode = Q8_TAIL_QUANT;
    emu_launch({rows / 32, 1, 1}, 1024, [&] { mat_vec_q8_0_quant(P0, 0, R, t); });

    int bad = 0;
    for (u32 i = 0; i < rows; i++)
        if (memcmp(&fused.out[i], &two.out[i], 4) || fused.xq[i] != two.xq[i]) {
            if (bad < 5)
                printf("  row %u: %08x (q %d) against %08x (q %d)\n", i, bits_as<u32>(fused.out[i]), fused.xq[i],
                       bits_as<u32>(two.out[i]), two.xq[i]);
            bad++;
        }
    bad += memcmp(fused.xd.data(), two.xd.data(), fused.xd.size() * 4) != 0;
    u32 nonzero = 0;
    for (u32 i = 0; i < rows; i++) nonzero += two.xq[i] != 0;
    printf("Q8_0 %5u wide, %4u rows in %u groups: fused %s against two launches (%u of %u quants nonzero)\n", c.in_dim,
           rows, c.groups, bad ? "DIFFER" : "same bits", nonzero, rows);
    return bad;
}

int main() {
    // Flash's wo_a width in groups; one 32-block chunk; a partial last chunk; a wide row.
    const Config configs[] = {{4096, 256, 8}, {1024, 96, 3}, {2304, 64, 1}, {256, 32, 1}, {8192, 64, 2}};
    int bad = 0;
    for (const Config& c : configs) bad += run(c);
    printf(bad ? "Q8_0 quant emulation: DIFFER\n" : "Q8_0 quant emulation: all same bits\n");
    return bad ? 1 : 0;
}
