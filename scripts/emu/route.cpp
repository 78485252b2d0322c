// Runs a chunk's moe_route both ways, in the emulator: a thread per expert scanning every pair
// (the serial form, MOE_ROUTE_SERIAL=1) and warp 0 placing the pairs 32 at a time (the default),
// on the same random expert choices (repeats within a row, ids out of range for the clamp, rows
// past the chunk's tokens), and compares the whole route buffer bit for bit.
#include "emu.h"
#include "kern.inc"
#include "host.h"

struct Config {
    u32 n_expert, n_used, rows, active;
    u32 spread;  // experts drawn from the first `spread` (few: long runs per expert)
};

static int run(const Config& c) {
    std::vector<StepParams> P(c.rows);
    for (u32 y = 0; y < c.rows; y++) P[y] = StepParams{0, 100 + y, 0, y < c.active ? c.active : 0u};
    RowBuf sel((size_t)c.n_used * 4, c.rows, 0);
    for (u32 y = 0; y < c.rows; y++)
        for (u32 k = 0; k < c.n_used; k++) {
            const u32 r = rnd() % 64;
            int e = (int)(rnd() % c.spread);
            if (r == 0) e = -3;
            if (r == 1) e = (int)c.n_expert + 5;
            sel.row<int>(y)[k] = e;
        }
    const size_t words = 2 * c.n_expert + c.rows * c.n_used;
    std::vector<u32> old_route(words + 64, 0xabababab), new_route(words + 64, 0xabababab);
    const u64 cond = 1ull << 63;
    const RowStrides R = row_strides({sel.stride, 0});
    auto args = [&](std::vector<u32>& route) {
        MoeRouteArgs a{};
        a.selected = (const int*)sel.ptr();
        a.route = route.data();
        a.n_expert = c.n_expert;
        a.n_used = c.n_used;
        a.rows = c.rows;
        return a;
    };
    const StepParams* P0 = P.data();
    const MoeRouteArgs ao = args(old_route), an = args(new_route);
    emu_launch({1, 1, 1}, 1024, [&] { moe_route_block(P0, cond, R, ao, true); });
    emu_launch({1, 1, 1}, 1024, [&] { moe_route_block(P0, cond, R, an, false); });
    int bad = 0;
    for (size_t i = 0; i < old_route.size(); i++)
        if (old_route[i] != new_route[i]) {
            if (bad < 8) printf("  route[%zu]: serial %08x, warp %08x\n", i, old_route[i], new_route[i]);
            bad++;
        }
    printf("experts %4u, used %u, rows %3u/%3u, ids from %4u: %s\n", c.n_expert, c.n_used, c.active, c.rows, c.spread,
           bad ? "DIFFER" : "same bits");
    return bad;
}

int main() {
    const Config configs[] = {
        {256, 6, 1, 1, 256},   {256, 6, 7, 7, 256},     {256, 6, 37, 30, 256}, {256, 6, 256, 256, 256},
        {256, 6, 256, 200, 8}, {1024, 8, 256, 256, 1024}, {64, 6, 1024, 1000, 64}, {33, 2, 100, 99, 40}, {256, 6, 2730, 2700, 256},
    };
    int bad = 0;
    for (const Config& c : configs) bad += run(c);
    return bad ? 1 : 0;
}
