// Host-side helpers of the emulator drivers (include after kern.inc): a seeded random source,
// per-row buffers laid out as a chunk arena lays them, and RowStrides from a list.
#pragma once
#include <initializer_list>
#include <random>

static std::mt19937_64 rng(12345);
static u32 rnd() { return (u32)rng(); }
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 8) / 16777216.0f; }

// `rows` rows of `bytes`, 256-aligned (as a chunk arena lays a per-row area out).
struct RowBuf {
    std::vector<unsigned char> mem;
    u32 stride;
    RowBuf(size_t bytes, u32 rows, unsigned char fill = 0xab) {
        stride = (u32)((bytes + 255) / 256 * 256);
        if (!stride) stride = 256;
        mem.assign((size_t)stride * rows + 256, fill);
    }
    unsigned char* base() { return (unsigned char*)(((uintptr_t)mem.data() + 255) & ~(uintptr_t)255); }
    template <class T> T* row(u32 y) { return (T*)(base() + (size_t)y * stride); }
    u64 ptr() { return (u64)base(); }
};

// Each pointer's byte stride from one row to the next, in the argument struct's field order.
static RowStrides row_strides(std::initializer_list<u32> s) {
    RowStrides r{};
    int i = 0;
    for (u32 v : s) r.s[i++] = v;
    return r;
}
