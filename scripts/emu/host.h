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

// A random f16 (its bits): finite, normal, either sign, moderate (2^-7 .. 2^3); now and then +0
// or -0.
static unsigned short rand_half() {
    const u32 r = rnd() % 32;
    if (r == 0) return 0;
    if (r == 1) return 0x8000;
    return (unsigned short)(((rnd() & 1) << 15) | ((8 + rnd() % 11) << 10) | (rnd() & 1023));
}

// A random Q8_0 matrix of rows x nb blocks in the split layout (all quants, then their f16
// scales), 256-byte aligned as device allocations are: row<u8>(0).
static RowBuf q8_split_matrix(u32 rows, u32 nb) {
    RowBuf m((size_t)rows * nb * 34, 1);
    unsigned char* w = m.row<unsigned char>(0);
    for (size_t i = 0; i < (size_t)rows * nb * 32; i++) w[i] = (unsigned char)(rnd() % 255 - 127);
    for (size_t i = 0; i < (size_t)rows * nb; i++) {
        const unsigned short h = rand_half();
        memcpy(w + (size_t)rows * nb * 32 + 2 * i, &h, 2);
    }
    return m;
}

// Each pointer's byte stride from one row to the next, in the argument struct's field order.
static RowStrides row_strides(std::initializer_list<u32> s) {
    RowStrides r{};
    int i = 0;
    for (u32 v : s) r.s[i++] = v;
    return r;
}
