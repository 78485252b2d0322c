// Runs sample_token's two ways to its candidates (kernels/sample.cu: the bounded list, and the
// radix select it falls back to) on the same logits and draws, in the emulator, and compares the
// token each picks. The radix path is the one scripts/gpu-check's device_sampling test proved
// against the host's definition (src/sample.rs); the list path must pick the same token.
#include "emu.h"
#include "kern.inc"
#include "host.h"

// How many logits the list path lists for `k` candidates with `threads` threads (the kernel's
// bound, computed here on its own): more than SAMPLE_LIST means the radix path runs.
static size_t listed(const std::vector<float>& l, u32 threads, u32 k) {
    const size_t n = l.size(), tile = (size_t)threads * SAMPLE_PER_THREAD;
    std::vector<u32> tops;
    for (u32 t = 0; t < threads; t++) {
        u32 a = 0, b = 0;
        for (size_t base = 0; base < n; base += tile)
            for (size_t i = base + t * SAMPLE_PER_THREAD; i < std::min(n, base + (t + 1) * SAMPLE_PER_THREAD); i++) {
                if (!sample_is_finite(l[i])) continue;
                const u32 key = sample_order_key(l[i]);
                if (key > a) b = a, a = key;
                else if (key > b) b = key;
            }
        tops.push_back(a);
        tops.push_back(b);
    }
    std::sort(tops.rbegin(), tops.rend());
    const u32 bound = k > 0 && k <= tops.size() ? tops[k - 1] : 0;
    size_t c = 0;
    for (float v : l) c += sample_is_finite(v) && sample_order_key(v) >= bound;
    return c;
}

struct Draw {
    float temperature;
    u32 top_k;
    float top_p, min_p, r;
};

static std::vector<std::pair<const char*, std::vector<float>>> logit_sets(size_t n) {
    std::vector<std::pair<const char*, std::vector<float>>> v;
    std::vector<float> x(n);
    for (auto& e : x) e = frand(-10.0f, 10.0f);
    v.push_back({"random", x});
    for (auto& e : x) e = frand(-2.0f, 2.0f);
    x[n / 3] = 12.0f, x[n / 2] = 11.5f;
    v.push_back({"peaked", x});
    // Top logits clustered in one stretch of ids (many in one thread's 8-wide groups).
    for (size_t i = 0; i < n; i++) x[i] = frand(-4.0f, 0.0f) + (i >= n / 4 && i < n / 4 + 3000 ? 6.0f : 0.0f);
    v.push_back({"clustered", x});
    for (auto& e : x) e = std::floor(frand(0.0f, 8.0f)) * 0.5f;
    v.push_back({"eight levels", x});
    for (auto& e : x) e = frand(0.0f, 1.0f) < 0.01f ? 3.0f : 1.0f;
    v.push_back({"two levels", x});
    v.push_back({"all equal", std::vector<float>(n, 0.25f)});
    for (size_t i = 0; i < n; i++) x[i] = i % 37 == 0 ? (float[]){NAN, INFINITY, -INFINITY, -0.0f, 0.0f}[i % 5] : frand(-3.0f, 3.0f);
    v.push_back({"nan and inf", x});
    v.push_back({"all -inf", std::vector<float>(n, -INFINITY)});
    std::vector<float> one(n, NAN);
    one[n - 1] = -5.0f;
    v.push_back({"one finite", one});
    for (auto& e : x) e = frand(-1.0f, 1.0f) * 3.4e38f;
    v.push_back({"huge", x});
    for (size_t i = 0; i < n; i++) x[i] = i % 2 ? -0.0f : 0.0f;
    v.push_back({"signed zeros", x});
    return v;
}

int main() {
    const Draw draws[] = {{0.8f, 1024, 0.9f, 0.05f, 0.5f}, {1.0f, 1024, 1.0f, 0.0f, 0.7f}, {1.5f, 40, 1.0f, 0.0f, 0.999f},
                          {0.3f, 1, 1.0f, 0.0f, 0.3f},     {1.0f, 1000, 0.3f, 0.0f, 0.0f}, {0.0f, 1, 1.0f, 0.0f, 0.0f}};
    int bad = 0, runs = 0, via_list = 0;
    for (size_t n : {(size_t)512, (size_t)1000, (size_t)129280}) {
        for (u32 threads : {1024u, 256u}) {
            if (threads == 256 && n != 129280) continue;
            for (auto& [name, l] : logit_sets(n)) {
                for (const Draw& d : draws) {
                    u32 out[2] = {~0u, ~0u};
                    for (int list = 0; list < 2; list++) {
                        SampleTokenArgs a{};
                        a.logits = l.data();
                        a.out = &out[list];
                        a.n = (u32)n;
                        a.top_k = d.top_k;
                        a.temperature = d.temperature;
                        a.top_p = d.top_p;
                        a.min_p = d.min_p;
                        a.r = d.r;
                        emu_launch({1, 1, 1}, threads, [&] { sample_token_block(a, list == 1); });
                    }
                    size_t finite_n = 0;
                    for (float v : l) finite_n += sample_is_finite(v);
                    const u32 k = std::min<size_t>(std::min<u32>(d.top_k, DS4_SAMPLE_CAP), finite_n);
                    const bool list = d.temperature > 0 && k > 0 && listed(l, threads, k) <= SAMPLE_LIST;
                    via_list += list;
                    runs++;
                    if (out[0] != out[1]) {
                        bad++;
                        printf("  n %zu, %u threads, '%s', T %g top-k %u top-p %g min-p %g r %g: radix %u, list %u\n", n, threads,
                               name, d.temperature, d.top_k, d.top_p, d.min_p, d.r, out[0], out[1]);
                    }
                }
            }
            printf("vocab %6zu, %4u threads: %s so far (%d of %d picks through the list)\n", n, threads,
                   bad ? "DIFFER" : "same tokens", via_list, runs);
        }
    }
    printf("sampling emulation: %s\n", bad ? "DIFFER" : "all same tokens");
    return bad ? 1 : 0;
}
