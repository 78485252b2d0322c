// IEEE f32 operations with gradual underflow, from integer operations (or exact scalings), for
// sample.wgsl: the host samples with IEEE f32 (subnormals kept), which NVIDIA's Vulkan driver
// flushes to zero, inputs and results. Every function takes and returns the bits; round to
// nearest even; a NaN result is 0x7fc00000 (its sign and payload are never looked at).

const SF_INF: u32 = 0x7f800000u;
const SF_NAN: u32 = 0x7fc00000u;

struct SfNum {
    // The significand, its leading bit at bit 23.
    m: u32,
    // The biased exponent (below 1 for a subnormal).
    e: i32,
}

// A finite nonzero magnitude (sign bit clear), subnormals normalized.
fn sf_unpack(b: u32) -> SfNum {
    let e = i32(b >> 23u);
    let m = b & 0x7fffffu;
    if (e == 0) {
        let s = countLeadingZeros(m) - 8u;
        return SfNum(m << s, 1 - i32(s));
    }
    return SfNum(m | 0x800000u, e);
}

// sign | the float nearest to (q / 2^24) * 2^(e - 127), for q in [2^24, 2^25) with `sticky`
// telling whether anything nonzero lies below q's last bit: ties to even, subnormal results
// rounded once at their own position, overflow to infinity.
fn sf_round(sign: u32, e: i32, q: u32, sticky: bool) -> u32 {
    if (e >= 255) {
        return sign | SF_INF;
    }
    var s = 0u;
    if (e < 1) {
        if (e < -24) {
            return sign;
        }
        s = u32(1 - e);
    }
    let sh = 1u + s;
    var m = q >> sh;
    let half = (q >> (sh - 1u)) & 1u;
    let rest = sticky || (q & ((1u << (sh - 1u)) - 1u)) != 0u;
    if (half == 1u && (rest || (m & 1u) == 1u)) {
        m = m + 1u;
    }
    var bits = m;
    if (s == 0u) {
        bits = (u32(e - 1) << 23u) + m;
    }
    if (bits >= SF_INF) {
        return sign | SF_INF;
    }
    return sign | bits;
}

// a / b.
fn sf_div(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & 0x80000000u;
    let x = a & 0x7fffffffu;
    let y = b & 0x7fffffffu;
    if (x > SF_INF || y > SF_INF || (x == SF_INF && y == SF_INF) || (x == 0u && y == 0u)) {
        return SF_NAN;
    }
    if (x == SF_INF || y == 0u) {
        return sign | SF_INF;
    }
    if (y == SF_INF || x == 0u) {
        return sign;
    }
    let u = sf_unpack(x);
    let v = sf_unpack(y);
    var r = u.m;
    var e = u.e - v.e + 127;
    if (r < v.m) {
        r = r << 1u;
        e = e - 1;
    }
    // r / v.m is in [1, 2): 25 quotient bits by long division, the remainder for the sticky bit.
    var q = 0u;
    for (var i = 0u; i < 25u; i = i + 1u) {
        q = q << 1u;
        if (r >= v.m) {
            r = r - v.m;
            q = q | 1u;
        }
        r = r << 1u;
    }
    return sf_round(sign, e, q, r != 0u);
}

// a * b.
fn sf_mul(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & 0x80000000u;
    let x = a & 0x7fffffffu;
    let y = b & 0x7fffffffu;
    if (x > SF_INF || y > SF_INF || (x == SF_INF && y == 0u) || (x == 0u && y == SF_INF)) {
        return SF_NAN;
    }
    if (x == SF_INF || y == SF_INF) {
        return sign | SF_INF;
    }
    if (x == 0u || y == 0u) {
        return sign;
    }
    let u = sf_unpack(x);
    let v = sf_unpack(y);
    // The 48-bit product hi * 2^24 + lo from 12-bit halves.
    let ah = u.m >> 12u;
    let al = u.m & 0xfffu;
    let bh = v.m >> 12u;
    let bl = v.m & 0xfffu;
    let mid = ah * bl + al * bh;
    let t = al * bl + ((mid & 0xfffu) << 12u);
    let lo = t & 0xffffffu;
    let hi = ah * bh + (mid >> 12u) + (t >> 24u);
    var e = u.e + v.e - 127;
    var q = (hi << 2u) | (lo >> 22u);
    var sticky = (lo & 0x3fffffu) != 0u;
    if (hi >= 0x800000u) {
        q = (hi << 1u) | (lo >> 23u);
        sticky = (lo & 0x7fffffu) != 0u;
        e = e + 1;
    }
    return sf_round(sign, e, q, sticky);
}

// b * 2^64 exactly, for |b| < 2^-100 (subnormals too): a normal float or zero.
fn sf_up64(b: u32) -> f32 {
    if ((b & 0x7f800000u) != 0u) {
        return bitcast<f32>(b + (64u << 23u));
    }
    // m * 2^-149 * 2^64: m is exact in f32, and the product is normal.
    let v = fmul(f32(b & 0x7fffffu), bitcast<f32>(0x15000000u));
    return bitcast<f32>(bitcast<u32>(v) | (b & 0x80000000u));
}

// a - b. The hardware's when either is at least 2^-100 in magnitude: the difference is then 0 or
// at least 2^-124 (no subnormal result), and a subnormal operand, flushed or not, is below half
// an ulp of the other. Otherwise both are scaled by 2^64, where the difference is 0 or normal and
// rounds as the unscaled one does (below 2^-126 it is exact: a multiple of 2^-149), then scaled
// back exactly.
fn sf_sub(a: u32, b: u32) -> u32 {
    let tiny = 0x0d800000u;
    if ((a & 0x7fffffffu) >= tiny || (b & 0x7fffffffu) >= tiny) {
        return bitcast<u32>(fsub(bitcast<f32>(a), bitcast<f32>(b)));
    }
    let d = fsub(sf_up64(a), sf_up64(b));
    let db = bitcast<u32>(d);
    if (((db >> 23u) & 255u) > 64u) {
        return db - (64u << 23u);
    }
    // |d| < 2^-62 and a multiple of 2^-85: d * 2^85 is an integer below 2^23, the subnormal's bits.
    return (db & 0x80000000u) | u32(fmul(abs(d), bitcast<f32>(0x6a000000u)));
}

fn sf_is_nan(b: u32) -> bool {
    return (b & 0x7fffffffu) > SF_INF;
}

// The order of non-NaN floats as unsigned integers, -0 with +0.
fn sf_order(b: u32) -> u32 {
    if ((b & 0x7fffffffu) == 0u) {
        return 0x80000000u;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// a < b, a >= b and a <= 0 as IEEE compares (false with a NaN), from the bits: a compiler may
// assume that no float is NaN.
fn sf_lt(a: u32, b: u32) -> bool {
    return !sf_is_nan(a) && !sf_is_nan(b) && sf_order(a) < sf_order(b);
}
fn sf_ge(a: u32, b: u32) -> bool {
    return !sf_is_nan(a) && !sf_is_nan(b) && sf_order(a) >= sf_order(b);
}
fn sf_le0(a: u32) -> bool {
    return !sf_is_nan(a) && sf_order(a) <= 0x80000000u;
}
