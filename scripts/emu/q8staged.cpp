// Runs the decode build's mat_vec_q8_0_staged (kernels/matvec.cu) in the emulator against
// mat_vec_q8_0 on the same random matrix and input, each launched as the host launches it, and
// compares every output (and the bytes past them, which neither may write) bit for bit. The
// shapes make some blocks hold rows past their staged ones (read from global memory), grids that
// do not divide the rows, grouped rows, and a width with a partial last chunk of 32 blocks.
#include "emu.h"
#include "kern.inc"
#include "host.h"

static unsigned short rand_half() {
    const u32 r = rnd() % 32;
    if (r == 0) return 0;
    if (r == 1) return 0x8000;
    return (unsigned short)(((rnd() & 1) << 15) | ((8 + rnd() % 11) << 10) | (rnd() & 1023));
}

struct Config {
    const char* what;
    u32 in_dim, rows, groups, grid;
};

static int run(const Config& c) {
    const u32 nb = c.in_dim / 32;
    std::vector<unsigned char> W((size_t)c.rows * nb * 34 + 512);
    unsigned char* w = (unsigned char*)(((uintptr_t)W.data() + 255) & ~(uintptr_t)255);
    for (size_t i = 0; i < (size_t)c.rows * nb * 32; i++) w[i] = (unsigned char)(rnd() % 255 - 127);
    for (size_t i = 0; i < (size_t)c.rows * nb; i++) {
        const unsigned short h = rand_half();
        memcpy(&w[(size_t)c.rows * nb * 32 + 2 * i], &h, 2);
    }
    std::vector<i8> xq((size_t)c.groups * c.in_dim);
    std::vector<float> xd((size_t)c.groups * nb);
    for (u32 b = 0; b < c.groups * nb; b++) {
        const bool zero = rnd() % 16 == 0;
        for (u32 i = 0; i < 32; i++) xq[b * 32 + i] = zero ? 0 : (i8)(int)(rnd() % 255 - 127);
        xd[b] = zero ? 0.0f : frand(1e-3f, 3e-2f);
    }
    StepParams P{0, 100, 0, 1};
    const RowStrides R{};
    auto launch = [&](bool staged, std::vector<float>& out) {
        MatVecQ80Args a{};
        a.w = w, a.xq = xq.data(), a.xd = xd.data(), a.out = out.data();
        a.in_dim = c.in_dim, a.rows = c.rows, a.rows_per_group = c.rows / c.groups;
        if (staged) emu_launch({c.grid, 1, 1}, Q8S_THREADS, [&] { mat_vec_q8_0_staged(&P, 0, R, a); });
        else emu_launch({(c.rows + 7) / 8, 1, 1}, 256, [&] { mat_vec_q8_0(&P, 0, R, a); });
    };
    std::vector<float> plain(c.rows + 64, 7.0f), staged(c.rows + 64, 7.0f);
    launch(false, plain);
    launch(true, staged);
    const u32 per = (c.rows + c.grid - 1) / c.grid, fit = Q8S_BYTES / (nb * 34);
    const bool same = !memcmp(plain.data(), staged.data(), plain.size() * 4);
    u32 untouched = 0;
    for (u32 r = 0; r < c.rows; r++) untouched += plain[r] == 7.0f;
    printf("%-46s %u rows a block, %u staged: %s\n", c.what, per, fit < per ? fit : per, same ? "same bits" : "DIFFER");
    if (!same)
        for (u32 r = 0, shown = 0; r < plain.size() && shown < 6; r++)
            if (memcmp(&plain[r], &staged[r], 4)) {
                printf("  row %u: %a against %a\n", r, staged[r], plain[r]);
                shown++;
            }
    if (untouched) printf("  %u rows left unwritten by mat_vec_q8_0\n", untouched);
    return !same || untouched;
}

int main() {
    const Config configs[] = {
        {"1024 wide, 1000 rows, 4 blocks", 1024, 1000, 1, 4},
        {"1024 wide, 2 groups of 300 rows, 3 blocks", 1024, 600, 2, 3},
        {"8192 wide, 100 rows, 3 blocks", 8192, 100, 1, 3},
        {"1280 wide (40 blocks), 250 rows, 5 blocks", 1280, 250, 1, 5},
        {"4096 wide, 37 rows, 8 blocks", 4096, 37, 1, 8},
    };
    int bad = 0;
    for (const Config& c : configs) bad += run(c);
    return bad ? 1 : 0;
}
