// Runs the q projection and qkv_finish as two launches (mat_vec_q8_0, then qkv_finish: the q heads'
// norm and RoPE, the kv row's norm, RoPE, fp8 round trip and ring store) and as one
// (mat_vec_q8_0_qkv, as plan.rs fuses them in decode; its blocks in a random order, so a head's
// last block is any of its blocks) in the emulator, on the same random weights and inputs, and
// compares q, kv and the whole raw ring bit for bit, and that every ticket is back at 0.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    u32 n_head, head_dim, n_rot, in_dim, raw_cap, pos;
};

static int run(const Config& c) {
    const u32 nh = c.n_head, hd = c.head_dim, nb = c.in_dim / 32, rows = nh * hd, pairs = c.n_rot / 2;
    RowBuf wm = q8_split_matrix(rows, nb);
    const u8* w = wm.row<u8>(0);
    std::vector<i8> xq(c.in_dim);
    std::vector<float> xd(nb);
    for (auto& v : xq) v = (i8)(int)(rnd() % 255 - 127);
    for (auto& v : xd) v = rnd() % 16 == 0 ? 0.0f : frand(1e-3f, 3e-2f);
    std::vector<float> kv_raw(hd), kv_norm(hd), table((size_t)(c.pos + 1) * std::max(pairs, 1u) * 2);
    for (auto& v : kv_raw) v = frand(-3.0f, 3.0f);
    for (auto& v : kv_norm) v = frand(0.5f, 1.5f);
    for (auto& v : table) v = frand(-1.0f, 1.0f);
    std::vector<float> cache0((size_t)c.raw_cap * hd);
    for (auto& v : cache0) v = frand(-1.0f, 1.0f);
    const StepParams P{0, c.pos, 0, 0};
    const StepParams* P0 = &P;
    const RowStrides R{};
    const float eps_q = 1e-6f, eps_kv = 1e-5f;

    std::vector<float> q2(rows, 7.0f), kv2(hd, 7.0f), cache2 = cache0;
    {
        MatVecQ80Args m{};
        m.w = w, m.xq = xq.data(), m.xd = xd.data(), m.out = q2.data();
        m.in_dim = c.in_dim, m.rows = rows, m.rows_per_group = rows;
        emu_launch({rows / 8, 1, 1}, 256, [&] { mat_vec_q8_0(P0, 0, R, m); });
        QkvFinishArgs f{};
        f.q = q2.data(), f.kv_raw = kv_raw.data(), f.kv_norm = kv_norm.data(), f.kv = kv2.data();
        f.cache = cache2.data(), f.table = table.data(), f.n_head = nh, f.head_dim = hd, f.n_rot = c.n_rot;
        f.raw_cap = c.raw_cap, f.eps_q = eps_q, f.eps_kv = eps_kv;
        emu_launch({nh + 1, 1, 1}, 256, [&] { qkv_finish(P0, 0, R, f); });
    }
    std::vector<float> q1(rows, 7.0f), kv1(hd, 7.0f), cache1 = cache0;
    std::vector<u32> tickets(nh + 3, 0);
    {
        MatVecQ80QkvArgs a{};
        a.w = w, a.xq = xq.data(), a.xd = xd.data(), a.q = q1.data(), a.tickets = tickets.data();
        a.kv_raw = kv_raw.data(), a.kv_norm = kv_norm.data(), a.kv = kv1.data(), a.cache = cache1.data();
        a.table = table.data(), a.in_dim = c.in_dim, a.n_head = nh, a.head_dim = hd, a.n_rot = c.n_rot;
        a.raw_cap = c.raw_cap, a.ticket = 2, a.eps_q = eps_q, a.eps_kv = eps_kv;
        const u32 n = 1 + rows / 8;
        emu_block_order.resize(n);
        for (u32 i = 0; i < n; i++) emu_block_order[i] = i;
        for (u32 i = 0; i + 1 < n; i++) std::swap(emu_block_order[i], emu_block_order[i + rnd() % (n - i)]);
        emu_launch({n, 1, 1}, 256, [&] { mat_vec_q8_0_qkv(P0, 0, R, a); });
        emu_block_order.clear();
    }
    int bad = 0;
    auto cmp = [&](const char* what, const std::vector<float>& two, const std::vector<float>& one) {
        for (size_t i = 0; i < two.size(); i++)
            if (memcmp(&two[i], &one[i], 4)) {
                if (bad < 10) printf("  %s %zu: two launches %08x, one %08x\n", what, i, bits_as<u32>(two[i]), bits_as<u32>(one[i]));
                bad++;
            }
    };
    cmp("q", q2, q1);
    cmp("kv", kv2, kv1);
    cmp("cache", cache2, cache1);
    for (u32 t : tickets) bad += t != 0;
    u32 changed = 0;
    for (size_t i = 0; i < cache0.size(); i++) changed += memcmp(&cache0[i], &cache1[i], 4) != 0;
    printf("q projection + qkv_finish, %2u heads of %3u (%3u rotated), %4u wide, ring %u at pos %u: %s (%u ring values stored)\n",
           nh, hd, c.n_rot, c.in_dim, c.raw_cap, c.pos, bad ? "DIFFER" : "same bits", changed);
    return bad;
}

int main() {
    // The Flash head (512, 64 rotated) and the tiny and small models' shapes, a pos past the ring.
    const Config configs[] = {{4, 512, 64, 1024, 8, 5}, {8, 256, 64, 512, 4, 13}, {3, 128, 64, 256, 16, 2},
                              {2, 64, 0, 96, 3, 7}, {5, 128, 64, 2048, 2, 1}};
    int bad = 0;
    for (const Config& c : configs) bad += run(c);
    return bad ? 1 : 0;
}
