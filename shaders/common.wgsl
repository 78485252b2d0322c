// Shared by every shader file (prepended by backends/wgpu): the step parameters, each dispatch's
// argument words, the opaque float arithmetic, f16 conversion, the canonical reductions, exp and
// log1p. The numerics constants are generated from src/numerics.rs and prepended before this.

struct Params {
    token: u32,
    pos: u32,
    // Always 0, but the compiler cannot know it: the opaque identity below XORs with it.
    zero: u32,
    pad: u32,
}

// Words 0..4: the predicate (kind, ratio, top_k, unused); words 4..: the op's arguments.
struct Args {
    w: array<vec4<u32>, 8>,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<uniform> A: Args;

fn arg(i: u32) -> u32 {
    return A.w[(i + 4u) / 4u][(i + 4u) % 4u];
}
fn argf(i: u32) -> f32 {
    return bitcast<f32>(arg(i));
}

var<private> Z: u32;

// Every entry point starts with `if (!guard()) { return; }`: the op's predicate, evaluated from
// the step parameters (uniform, so barriers after it stay in uniform control flow).
fn guard() -> bool {
    Z = P.zero;
    let kind = A.w[0].x;
    let ratio = A.w[0].y;
    let top_k = A.w[0].z;
    if (kind == 0u) {
        return true;
    }
    if (kind == 1u) {
        return (P.pos + 1u) % ratio == 0u;
    }
    return (P.pos + 1u) / ratio > top_k;
}

// The opaque identity: the driver can neither fuse a product into a sum (NVIDIA does, whatever
// the WGSL says) nor reassociate (Mesa's NIR does with constants) through an XOR with a value it
// does not know. Every float +, -, * and / goes through it (shared/reference/wgsl-exactness.md).
fn o(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ Z);
}
fn zero() -> f32 {
    return bitcast<f32>(Z);
}
fn fadd(a: f32, b: f32) -> f32 {
    return o(a + b);
}
fn fsub(a: f32, b: f32) -> f32 {
    return o(a - b);
}
fn fmul(a: f32, b: f32) -> f32 {
    return o(a * b);
}
// IEEE division and square root, correctly rounded on lavapipe. NVIDIA's Vulkan driver does not
// round these correctly (wgsl-exactness.md); the README says where that leaves bit-identity.
fn fdiv(a: f32, b: f32) -> f32 {
    return o(o(a) / o(b));
}
fn sqrt_rn(a: f32) -> f32 {
    return o(sqrt(o(a)));
}

fn pow2i(k: i32) -> f32 {
    return bitcast<f32>(u32(k + 127) << 23u);
}

// f16 bits (low 16 bits of h) to f32, exactly, from integer operations only.
fn h2f(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 31u;
    let m = h & 0x3ffu;
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    if (e == 0u) {
        // Subnormal or zero: m * 2^-24 (exact).
        let v = f32(m) * bitcast<f32>(0x33800000u);
        return bitcast<f32>(sign | bitcast<u32>(v));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// f32 to f16 bits, round to nearest even; overflow to infinity; NaN to 0x7e00 with the sign.
fn f2h(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u;
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;
    }
    if (a < 0x38800000u) {
        // Below 2^-14: a subnormal half (units of 2^-24), or zero.
        if (a < 0x33000000u) {
            return sign;
        }
        let e = a >> 23u;
        let m = (a & 0x7fffffu) | 0x800000u;
        let s = 126u - e;
        var q = m >> s;
        let rem = m & ((1u << s) - 1u);
        let half = 1u << (s - 1u);
        if (rem > half || (rem == half && (q & 1u) == 1u)) {
            q = q + 1u;
        }
        return sign | q;
    }
    var q = (((a >> 23u) - 112u) << 10u) | ((a & 0x7fffffu) >> 13u);
    let rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u) == 1u)) {
        q = q + 1u;
    }
    return sign | q;
}

fn round_f16(x: f32) -> f32 {
    return h2f(f2h(x));
}

// The canonical exp (numerics::exp).
fn ds4_exp(x: f32) -> f32 {
    if (x != x) {
        return x;
    }
    if (x > DS4_EXP_MAX) {
        return bitcast<f32>(0x7f800000u);
    }
    if (x < DS4_EXP_MIN) {
        return 0.0;
    }
    let k = round(fmul(x, DS4_LOG2_E));
    let r = fsub(fsub(x, fmul(k, DS4_LN2_HI)), fmul(k, DS4_LN2_LO));
    var p = DS4_EXP_C7;
    p = fadd(fmul(p, r), DS4_EXP_C6);
    p = fadd(fmul(p, r), DS4_EXP_C5);
    p = fadd(fmul(p, r), DS4_EXP_C4);
    p = fadd(fmul(p, r), DS4_EXP_C3);
    p = fadd(fmul(p, r), DS4_EXP_C2);
    p = fadd(fmul(p, r), 1.0);
    p = fadd(fmul(p, r), 1.0);
    let ki = i32(k);
    let k1 = ki / 2;
    let y = fmul(fmul(p, pow2i(k1)), pow2i(ki - k1));
    if (y < bitcast<f32>(0x00800000u)) {
        return 0.0;
    }
    return y;
}

// The canonical log1p (numerics::ln_1p).
fn ds4_log1p(x: f32) -> f32 {
    if (x != x || x < -1.0) {
        return bitcast<f32>(0x7fc00000u);
    }
    if (x == -1.0) {
        return bitcast<f32>(0xff800000u);
    }
    if (x == bitcast<f32>(0x7f800000u)) {
        return x;
    }
    if (abs(x) < bitcast<f32>(0x39800000u)) {
        let x2 = fmul(x, x);
        return fadd(fsub(x, fmul(x2, 0.5)), fmul(fmul(x2, x), DS4_LN_THIRD));
    }
    let u = fadd(1.0, x);
    var c = 0.0;
    if (u < 16777216.0) {
        c = fdiv(fsub(x, fsub(u, 1.0)), u);
    }
    let bits = bitcast<u32>(u);
    var j = i32((bits >> 23u) & 0xffu) - 127;
    var m = bitcast<f32>((bits & 0x007fffffu) | 0x3f800000u);
    if (m > DS4_SQRT2) {
        m = fmul(m, 0.5);
        j = j + 1;
    }
    let f = fsub(m, 1.0);
    let hfsq = fmul(fmul(0.5, f), f);
    let s = fdiv(f, fadd(2.0, f));
    let z = fmul(s, s);
    var p = DS4_LN_P5;
    p = fadd(fmul(p, z), DS4_LN_P4);
    p = fadd(fmul(p, z), DS4_LN_P3);
    p = fadd(fmul(p, z), DS4_LN_P2);
    p = fadd(fmul(p, z), DS4_LN_P1);
    let r = fmul(z, p);
    let jf = f32(j);
    return fsub(fmul(jf, DS4_LN2_HI), fsub(fsub(hfsq, fadd(fmul(s, fadd(hfsq, r)), fadd(fmul(jf, DS4_LN2_LO), c))), f));
}

// The smallest power of two >= t, for positive normal t (numerics::pow2_ceil).
fn pow2_ceil(t: f32) -> f32 {
    let b = bitcast<u32>(t);
    if ((b & 0x007fffffu) == 0u) {
        return t;
    }
    return bitcast<f32>((b & 0x7f800000u) + 0x00800000u);
}

fn sigmoid(x: f32) -> f32 {
    if (x >= 0.0) {
        return fdiv(1.0, fadd(1.0, ds4_exp(-x)));
    }
    let e = ds4_exp(x);
    return fdiv(e, fadd(1.0, e));
}

fn silu(x: f32) -> f32 {
    return fmul(x, sigmoid(x));
}

// SwiGLU with ds4's clamp: the gate only from above, the up both ways.
fn swiglu_clamped(g0: f32, u0: f32, c: f32) -> f32 {
    var g = g0;
    var u = u0;
    if (c > 1.0e-6) {
        g = min(g, c);
        u = min(max(u, -c), c);
    }
    return fmul(silu(g), u);
}

// Sign-extended byte k (0..3) of a word.
fn sbyte(w: u32, k: u32) -> i32 {
    return extractBits(i32(w), k * 8u, 8u);
}

// Integer dot of 4 signed bytes packed in each word (exact in any order).
fn dot4i8(a: u32, b: u32) -> i32 {
    return sbyte(a, 0u) * sbyte(b, 0u) + sbyte(a, 1u) * sbyte(b, 1u) + sbyte(a, 2u) * sbyte(b, 2u)
        + sbyte(a, 3u) * sbyte(b, 3u);
}

// The canonical butterfly over the 32 lanes of each group of 32 invocations (numerics::tree32):
// for o = 16, 8, 4, 2, 1 lane l becomes v[l] + v[l ^ o]. Every lane gets the sum. Workgroups are
// 256 invocations; call in uniform control flow.
var<workgroup> red: array<f32, 256>;

fn lane_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var off = 16u; off > 0u; off = off / 2u) {
        let t = fadd(red[lid], red[lid ^ off]);
        workgroupBarrier();
        red[lid] = t;
        workgroupBarrier();
    }
    let s = red[lid];
    workgroupBarrier();
    return s;
}

fn lane_max(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var off = 16u; off > 0u; off = off / 2u) {
        let t = max(red[lid], red[lid ^ off]);
        workgroupBarrier();
        red[lid] = t;
        workgroupBarrier();
    }
    let s = red[lid];
    workgroupBarrier();
    return s;
}

// The flat index of this workgroup in a dispatch of (x, y) workgroups.
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}
