// Runs the decode build's HC post and pre-mix two ways in the emulator, on the same random
// inputs: hc_post (storing its chunk sums of squares) then hc_pre reading them, against one
// hc_pre that runs the post itself (the post_* arguments: plan.rs `hc_post_inside`). Compares
// every output bit for bit: the streams, the Add's sum, flat, mix, split, cur, norm, its Q8_0 and
// Q8_K, and the tickets left at 0 (n_embd a multiple of 512, as the plan asks), with and without
// the streams kept in dynamic shared memory. Prints checksums of hc_post's and hc_pre's outputs
// too, so two builds of the kernels (e.g. DS4_CUDA_DEFINES variants) can be compared with each
// other.
#include "emu.h"
#include "kern.inc"
#include "host.h"

static float value() {
    const u32 r = rnd() % 16;
    if (r == 0) return 0.0f;
    if (r == 1) return -0.0f;
    return frand(-1.0f, 1.0f);
}

static u64 checksum(const float* v, size_t n) {
    u64 h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        u32 b;
        memcpy(&b, &v[i], 4);
        h = (h ^ b) * 1099511628211ull;
    }
    return h;
}

struct Outs {
    std::vector<float> streams, sum, flat, mix, split, cur, norm, xd, part, ss;
    std::vector<i8> xq;
    std::vector<unsigned char> xk;
    std::vector<u32> tickets;
    Outs(u32 ne, u32 mr, u32 nc)
        : streams(4 * ne, 7.0f), sum(ne, 7.0f), flat(4 * ne, 7.0f), mix(mr, 7.0f), split(24, 7.0f), cur(ne, 7.0f),
          norm(ne, 7.0f), xd(ne / 32, 7.0f), part((size_t)mr * nc, 7.0f), ss(64, 7.0f), xq(ne, 7),
          xk(ne / 256 * 304, 7), tickets(16, 0) {}
};

template <class T> static int differ(const char* what, const std::vector<T>& a, const std::vector<T>& b) {
    if (memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0) return 0;
    printf("  %s differs\n", what);
    return 1;
}

static int run(const char* what, u32 n_embd, bool add, bool kept) {
    const u32 hc_dim = 4 * n_embd, nc = hc_dim / 512, mix_rows = 24;
    StepParams P{0, 100, 0, 1};
    std::vector<float> block(n_embd), block_b(n_embd), residual(hc_dim), prev_split(24);
    for (auto& v : block) v = value() * 2.0f;
    for (auto& v : block_b) v = value();
    for (auto& v : residual) v = value() * 3.0f;
    for (u32 i = 0; i < 24; i++) prev_split[i] = frand(0.1f, 1.0f);
    std::vector<u16> fw((size_t)mix_rows * hc_dim);
    for (auto& v : fw) v = emu_f2h(frand(-0.5f, 0.5f));
    std::vector<float> scale(3), base(mix_rows), norm_w(n_embd);
    for (auto& v : scale) v = frand(0.5f, 2.0f);
    for (auto& v : base) v = frand(-1.0f, 1.0f);
    for (auto& v : norm_w) v = frand(0.5f, 1.5f);
    Outs o1(n_embd, mix_rows, nc), o2(n_embd, mix_rows, nc);
    const RowStrides R{};
    auto pre_args = [&](Outs& o) {
        HcPreArgs a{};
        a.x = o.streams.data(), a.fn_w = fw.data(), a.partial = o.part.data(), a.tickets = o.tickets.data();
        a.flat = o.flat.data(), a.mix = o.mix.data(), a.scale = scale.data(), a.base = base.data();
        a.split = o.split.data(), a.cur = o.cur.data(), a.norm_w = norm_w.data(), a.norm = o.norm.data();
        a.xq = o.xq.data(), a.xd = o.xd.data(), a.xk = (BlockQ8K*)o.xk.data();
        a.hc_dim = hc_dim, a.mix_rows = mix_rows, a.n_chunks = nc, a.ticket = 5, a.n_embd = n_embd, a.iters = 20;
        a.eps_flat = 1e-6f, a.eps_hc = 1e-6f, a.eps_norm = 1e-6f;
        a.blocks_pre = (4 * nc + HC_PRE_WARPS - 1) / HC_PRE_WARPS;
        return a;
    };
    const u32 grid = (4 * nc + HC_PRE_WARPS - 1) / HC_PRE_WARPS + ((mix_rows - 4) * nc + HC_PRE_WARPS - 1) / HC_PRE_WARPS;
    // Apart: hc_post, then hc_pre from its sums of squares.
    HcPostArgs p{};
    p.block = block.data(), p.block_b = add ? block_b.data() : nullptr, p.sum_out = add ? o1.sum.data() : nullptr;
    p.residual = residual.data(), p.split = prev_split.data(), p.out = o1.streams.data(), p.ss = o1.ss.data();
    p.n = n_embd, p.n_hc = 4;
    emu_launch({nc, 1, 1}, 32, [&] { hc_post(&P, 0, R, p); });
    const u64 post_sum = checksum(o1.streams.data(), o1.streams.size()) ^ checksum(o1.ss.data(), nc) ^
                         (add ? checksum(o1.sum.data(), n_embd) : 0);
    HcPreArgs a1 = pre_args(o1);
    a1.ss = o1.ss.data();
    emu_launch({grid, 1, 1}, HC_PRE_WARPS * 32, [&] { hc_pre(&P, 0, R, a1); });
    // Inside: one hc_pre running the post first, its streams and norm weights kept in dynamic
    // shared memory when the launch gives it 5 * n_embd floats (mod.rs hc_pre_smem), else none.
    HcPreArgs a2 = pre_args(o2);
    a2.post_block = block.data(), a2.post_block_b = add ? block_b.data() : nullptr;
    a2.post_sum = add ? o2.sum.data() : nullptr, a2.post_residual = residual.data(), a2.post_split = prev_split.data();
    emu_dynamic_smem = kept ? 5 * n_embd * 4 : 0;
    emu_launch({grid, 1, 1}, HC_PRE_WARPS * 32, [&] { hc_pre(&P, 0, R, a2); });
    emu_dynamic_smem = ~0u;
    int bad = differ("streams", o1.streams, o2.streams) + differ("flat", o1.flat, o2.flat) +
              differ("mix", o1.mix, o2.mix) + differ("split", o1.split, o2.split) + differ("cur", o1.cur, o2.cur) +
              differ("norm", o1.norm, o2.norm) + differ("xq", o1.xq, o2.xq) + differ("xd", o1.xd, o2.xd) +
              differ("xk", o1.xk, o2.xk) + differ("tickets", o1.tickets, o2.tickets);
    if (add) bad += differ("sum", o1.sum, o2.sum);
    for (u32 t : o1.tickets) bad += t != 0;
    const u64 pre_sum = checksum(o1.flat.data(), o1.flat.size()) ^ checksum(o1.mix.data(), o1.mix.size()) * 3 ^
                        checksum(o1.split.data(), o1.split.size()) * 5 ^ checksum(o1.cur.data(), n_embd) * 7 ^
                        checksum(o1.norm.data(), n_embd) * 11 ^ checksum(o1.xd.data(), o1.xd.size()) * 13 ^
                        checksum((const float*)o1.xq.data(), n_embd / 4) * 17 ^
                        checksum((const float*)o1.xk.data(), o1.xk.size() / 4) * 19;
    printf("%-24s n_embd %5u%s%s: %s (hc_post checksum %016llx, hc_pre %016llx)\n", what, n_embd,
           add ? ", with the add" : "", kept ? ", kept in shared memory" : "", bad ? "DIFFER" : "same bits",
           (unsigned long long)post_sum, (unsigned long long)pre_sum);
    return bad;
}

int main() {
    int bad = 0;
    for (bool kept : {false, true}) {
        bad += run("small", 512, false, kept);
        bad += run("small", 1024, true, kept);
        bad += run("flash", 4096, false, kept);
        bad += run("flash", 4096, true, kept);
    }
    printf(bad ? "HC post emulation: DIFFER\n" : "HC post emulation: all same bits\n");
    return bad ? 1 : 0;
}
