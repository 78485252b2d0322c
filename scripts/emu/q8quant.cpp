// Runs the decode build's grouped Q8_0 projection with its quantization inside (kernels/fused.cu
// mat_vec_q8_0_quant in quant mode, as plan.rs fuses wo_a with wo_b's input) in the emulator
// against the two launches it replaces (mat_vec_q8_0, then quantize_q8_0), on the same random
// weights and inputs, and compares the projection, its Q8_0 quants and scales bit for bit.
// Shapes: Flash's wo_a width (4096, 8 groups of rows), one chunk, a partial chunk, a wide row.
#include "emu.h"
#include "kern.inc"
#include "host.h"

static unsigned short rand_half() {
    // Finite, normal, either sign, moderate (2^-7 .. 2^3); now and then +0 or -0.
    const u32 r = rnd() % 32;
    if (r == 0) return 0;
    if (r == 1) return 0x8000;
    return (unsigned short)(((rnd() & 1) << 15) | ((8 + rnd() % 11) << 10) | (rnd() & 1023));
}

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
    // The Q8_0 matrix in the split layout (quants, then the f16 scales), 256-byte aligned.
    std::vector<unsigned char> wmem((size_t)rows * nb * 34 + 512);
    u8* w = (u8*)(((uintptr_t)wmem.data() + 255) & ~(uintptr_t)255);
    for (size_t i = 0; i < (size_t)rows * nb * 32; i++) w[i] = (unsigned char)(rnd() % 255 - 127);
    for (size_t i = 0; i < (size_t)rows * nb; i++) {
        const unsigned short h = rand_half();
        memcpy(w + (size_t)rows * nb * 32 + 2 * i, &h, 2);
    }
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
