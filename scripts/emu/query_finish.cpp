// Runs the indexer query's RoPE and FP4 round trip as two launches (rope_tail at the token's
// position, then indexer_qat) and as one (indexer_query_finish, as plan.rs fuses them in decode),
// in the emulator, on the same random query, and compares every value bit for bit.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    u32 n_head, n_rot, pos;
};

static int run(const Config& c) {
    const u32 nh = c.n_head, hd = 128, pairs = c.n_rot / 2;
    std::vector<float> q((size_t)nh * hd), table((size_t)(c.pos + 1) * std::max(pairs, 1u) * 2);
    for (auto& v : q) v = rnd() % 16 == 0 ? 0.0f : frand(-4.0f, 4.0f);
    for (auto& v : table) v = frand(-1.0f, 1.0f);
    std::vector<float> two = q, one = q;
    const StepParams P{0, c.pos, 0, 0};
    const StepParams* P0 = &P;
    const RowStrides R{};
    {
        RopeTailArgs a{};
        a.x = two.data(), a.table = table.data(), a.n_head = nh, a.head_dim = hd, a.n_rot = c.n_rot;
        emu_launch({(nh * pairs + 63) / 64, 1, 1}, 64, [&] { rope_tail(P0, 0, R, a); });
        IndexerQatArgs b{};
        b.x = two.data();
        emu_launch({nh, 1, 1}, 128, [&] { indexer_qat(P0, 0, R, b); });
    }
    {
        IndexerQueryFinishArgs a{};
        a.x = one.data(), a.table = table.data(), a.n_rot = c.n_rot;
        emu_launch({nh, 1, 1}, 128, [&] { indexer_query_finish(P0, 0, R, a); });
    }
    int bad = 0;
    u32 changed = 0;
    for (size_t i = 0; i < q.size(); i++) {
        changed += memcmp(&two[i], &q[i], 4) != 0;
        if (memcmp(&two[i], &one[i], 4)) {
            if (bad < 10) printf("  value %zu: two launches %08x, one %08x\n", i, bits_as<u32>(two[i]), bits_as<u32>(one[i]));
            bad++;
        }
    }
    printf("indexer query, heads %2u, %3u rotated dims at pos %4u: %s (%u of %zu values changed)\n", nh, c.n_rot, c.pos,
           bad ? "DIFFER" : "same bits", changed, q.size());
    return bad;
}

int main() {
    const Config configs[] = {{64, 64, 0}, {64, 64, 2100}, {16, 64, 37}, {20, 128, 9}, {3, 2, 5}};
    int bad = 0;
    for (const Config& c : configs) bad += run(c);
    return bad ? 1 : 0;
}
