// Shared by every shader file (prepended by backends/wgpu): the step parameters, each dispatch's
// argument words, the opaque float arithmetic, f16 conversion, the canonical reductions, exp and
// log1p. The numerics constants are generated from src/numerics.rs and prepended before this.

struct Params {
    token: u32,
    pos: u32,
    // Always 0, but the compiler cannot know it: the opaque identity below XORs with it.
    zero: u32,
    // Tokens in the step: 1 for a decode step; a chunk's batched dispatches read the chunk's
    // length here (`chunk_rows`).
    count: u32,
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
    return guard_at(P.pos);
}

// The predicate at position `pos`: a chunk's batched dispatch evaluates it for each row.
fn guard_at(pos: u32) -> bool {
    Z = P.zero;
    let kind = A.w[0].x;
    let ratio = A.w[0].y;
    let top_k = A.w[0].z;
    if (kind == 0u) {
        return true;
    }
    if (kind == 1u) {
        return (pos + 1u) % ratio == 0u;
    }
    return (pos + 1u) / ratio > top_k;
}

// A batched dispatch of a chunk (one invocation per matrix row, looping over the chunk's rows):
// the rows it computes, and the row strides in words of its input and output, in argument words
// 26 and 27 (0 in a decode program, whose step has one row).
fn chunk_rows() -> u32 {
    return max(P.count, 1u);
}
fn x_stride() -> u32 {
    return arg(26u);
}
fn out_stride() -> u32 {
    return arg(27u);
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
// IEEE division and square root, correctly rounded: WGSL's `/` and `sqrt` may be 2.5 ulp off
// (NVIDIA's Vulkan driver is; lavapipe rounds them correctly), so the hardware result is only a
// first guess, corrected with exact residuals.
fn fdiv(a: f32, b: f32) -> f32 {
    return div_rn(a, b, o(o(a) / o(b)));
}
fn sqrt_rn(a: f32) -> f32 {
    return sqrt_fix(a, o(sqrt(o(a))));
}

// x split into a high part of 12 significant bits and the rest (Veltkamp), exactly.
fn split12(x: f32) -> vec2<f32> {
    let t = fmul(4097.0, x);
    let hi = fsub(t, fsub(t, x));
    return vec2<f32>(hi, fsub(x, hi));
}

// a - x*y rounded once (exact whenever it is representable), for x*y within a factor 2 of a and
// no overflow or underflow. Where the adapter's fma() rounds once (backends/wgpu probes it), this
// calls residual_fma instead: the same value, in one instruction instead of about twenty.
fn residual(a: f32, x: f32, y: f32) -> f32 {
    return residual_dekker(a, x, y);
}

// a - p is exact (Sterbenz) and so is Dekker's e = x*y - p, from + - * alone: fl((a - p) - e) is
// a - x*y rounded once.
fn residual_dekker(a: f32, x: f32, y: f32) -> f32 {
    let p = fmul(x, y);
    let xs = split12(x);
    let ys = split12(y);
    let e = fadd(fadd(fadd(fsub(fmul(xs.x, ys.x), p), fmul(xs.x, ys.y)), fmul(xs.y, ys.x)), fmul(xs.y, ys.y));
    return fsub(fsub(a, p), e);
}

fn residual_fma(a: f32, x: f32, y: f32) -> f32 {
    return o(fma(-x, y, a));
}

// The unbiased exponent of a finite nonzero x.
fn exponent(x: f32) -> i32 {
    return i32((bitcast<u32>(x) >> 23u) & 0xffu) - 127;
}

// Whether x is normal with its exponent in [lo, hi] (no overflow or underflow in the residuals).
fn in_range(x: f32, lo: i32, hi: i32) -> bool {
    let e = exponent(x);
    return x != 0.0 && e >= lo && e <= hi;
}

// The next float away from zero, and towards zero, of a finite nonzero x.
fn next_out(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) + 1u);
}
fn next_in(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) - 1u);
}

// a / b correctly rounded from a guess q0 within 3 ulp: of q0 and its neighbours, the one with
// the smallest |a - q*b| (ties cannot happen for normal quotients). Outside the range where the
// residuals are exact the guess is returned.
fn div_rn(a: f32, b: f32, q0: f32) -> f32 {
    if (!in_range(a, -80, 80) || !in_range(b, -40, 40) || !in_range(q0, -40, 40)) {
        return q0;
    }
    var best = q0;
    var best_r = abs(residual(a, q0, b));
    var up = q0;
    var dn = q0;
    for (var k = 0; k < 3; k = k + 1) {
        up = next_out(up);
        let ru = abs(residual(a, up, b));
        if (ru < best_r) {
            best = up;
            best_r = ru;
        }
        dn = next_in(dn);
        let rd = abs(residual(a, dn, b));
        if (rd < best_r) {
            best = dn;
            best_r = rd;
        }
    }
    return best;
}

// sqrt(a) correctly rounded from a guess s: move s by an ulp while a lies beyond the midpoint
// to a neighbour. With r = a - s*s (exact), a > (s + u/2)^2 exactly when r - s*u > 0, and
// a < (s - d/2)^2 exactly when r + s*d < 0 (u, d: the gaps to the neighbours; no ties).
fn sqrt_fix(a: f32, s0: f32) -> f32 {
    if (!(a > 0.0) || !in_range(a, -80, 80) || !in_range(s0, -40, 40)) {
        return s0;
    }
    var s = s0;
    for (var k = 0; k < 4; k = k + 1) {
        let r = residual(a, s, s);
        let up = next_out(s);
        if (fsub(r, fmul(s, fsub(up, s))) > 0.0) {
            s = up;
            continue;
        }
        let dn = next_in(s);
        if (fadd(r, fmul(s, fsub(s, dn))) < 0.0) {
            s = dn;
            continue;
        }
        break;
    }
    return s;
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

// Integer dot of 4 signed bytes packed in each word (exact in any order): WGSL's packed 4x8
// dot product, which drivers map to their int8 dot instruction where they have one.
fn dot4i8(a: u32, b: u32) -> i32 {
    return dot4I8Packed(a, b);
}

// The flat index of this workgroup in a dispatch of (x, y) workgroups.
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// The same butterfly for 32 lane sums held by one invocation: for o = 16, 8, 4, 2, 1, lane l < o
// adds lane l + o (what the xor butterfly leaves in lane 0). For adapters that run invocations
// on CPU cores (lavapipe), where one invocation per row beats 32 lanes and their barriers.
fn tree32(v: ptr<function, array<f32, 32>>) -> f32 {
    for (var off = 16u; off > 0u; off = off / 2u) {
        for (var l = 0u; l < off; l = l + 1u) {
            (*v)[l] = fadd((*v)[l], (*v)[l + off]);
        }
    }
    return (*v)[0];
}

fn zero32() -> array<f32, 32> {
    var v: array<f32, 32>;
    for (var l = 0u; l < 32u; l = l + 1u) {
        v[l] = zero();
    }
    return v;
}

// Q8_0 of one block of 32 values held by a 32-lane group (lane = lid % 32), as quantize_q8_0
// computes it: d = amax/127, q = round-half-even(x * (1/d)). Returns the lane's packed word of
// 4 quants (meaningful on lanes lid % 4 == 0, which store it) and the bits of d. Workgroups of
// 256; call in uniform control flow. Norms and SwiGLU call it on their own outputs, so that the
// Q8_0 matvecs that read them need no quantize dispatch.
var<workgroup> q8_bytes: array<i32, 256>;

fn q8_block(v: f32, lid: u32) -> vec2<u32> {
    let amax = lane_max(abs(v), lid);
    let d = fdiv(amax, 127.0);
    var id = 0.0;
    if (d != 0.0) {
        id = fdiv(1.0, d);
    }
    q8_bytes[lid] = clamp(i32(round(fmul(v, id))), -128, 127);
    workgroupBarrier();
    var w = 0u;
    if (lid % 4u == 0u) {
        w = (u32(q8_bytes[lid]) & 255u) | ((u32(q8_bytes[lid + 1u]) & 255u) << 8u)
            | ((u32(q8_bytes[lid + 2u]) & 255u) << 16u) | ((u32(q8_bytes[lid + 3u]) & 255u) << 24u);
    }
    // The next call's writes wait for these reads.
    workgroupBarrier();
    return vec2<u32>(w, bitcast<u32>(d));
}

// E4M3 (fp8) values and rounding, for the fp8 round trip of KV rows (kv.wgsl, norm.wgsl's kv_finish).
fn e4m3_value(i: i32) -> f32 {
    let e = (i >> 3u) & 15;
    let mant = f32(i & 7);
    if (e == 0) {
        return fmul(mant, 0.001953125);
    }
    return fmul(fadd(1.0, fmul(mant, 0.125)), pow2i(e - 7));
}

// Nearest E4M3 value (ties to the even code), saturating at 448.
fn e4m3_round(x: f32) -> f32 {
    var sign = 1.0;
    if (x < 0.0) {
        sign = -1.0;
    }
    let ax = min(abs(x), 448.0);
    var lo = 0;
    var hi = 126;
    while (lo < hi) {
        let mid = (lo + hi + 1) >> 1u;
        if (e4m3_value(mid) <= ax) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    var best = lo;
    if (best < 126) {
        let d0 = abs(fsub(ax, e4m3_value(best)));
        let d1 = abs(fsub(ax, e4m3_value(best + 1)));
        if (d1 < d0 || (d1 == d0 && ((best + 1) & 1) == 0 && (best & 1) != 0)) {
            best = best + 1;
        }
    }
    return fmul(sign, e4m3_value(best));
}

// Q8_K of one block of 256 values, one per invocation of a workgroup of 256, as quantize_q8_k
// computes it: max is the value of largest magnitude (the first one on ties), iscale =
// -127/max, q = round(iscale * x), d = 1/iscale; an all-zero block gets d = 0 and zero quants.
// Returns the invocation's share of the block: packed quant word `lid` (lid < 64), the sum of
// quants 16*lid .. 16*lid + 15 (lid < 16) and d's bits (lid 0). Call in uniform control flow.
var<workgroup> q8k_abs: array<f32, 256>;
var<workgroup> q8k_idx: array<u32, 256>;
var<workgroup> q8k_x: array<f32, 256>;
var<workgroup> q8k_q: array<i32, 256>;

struct Q8KLane {
    word: u32,
    bsum: u32,
    d: u32,
}

fn q8k_block(v: f32, lid: u32) -> Q8KLane {
    // The serial scan keeps the first value of largest magnitude (NaN and zeros never taken): a
    // tree over (|x|, index) that keeps the larger magnitude, the lower index on ties, picks the
    // same value in 8 steps instead of 256.
    var key = 0.0;
    if (abs(v) > 0.0) {
        key = abs(v);
    }
    q8k_abs[lid] = key;
    q8k_idx[lid] = lid;
    q8k_x[lid] = v;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off = off / 2u) {
        if (lid < off) {
            let a2 = q8k_abs[lid + off];
            let i2 = q8k_idx[lid + off];
            if (a2 > q8k_abs[lid] || (a2 == q8k_abs[lid] && i2 < q8k_idx[lid])) {
                q8k_abs[lid] = a2;
                q8k_idx[lid] = i2;
            }
        }
        workgroupBarrier();
    }
    let amax = q8k_abs[0];
    let mx = q8k_x[q8k_idx[0]];
    var iscale = 0.0;
    var q = 0;
    if (amax != 0.0) {
        iscale = fdiv(-127.0, mx);
        q = clamp(i32(round(fmul(iscale, v))), -128, 127);
    }
    q8k_q[lid] = q;
    workgroupBarrier();
    var out = Q8KLane(0u, 0u, 0u);
    if (lid < 64u) {
        let k = lid * 4u;
        out.word = (u32(q8k_q[k]) & 255u) | ((u32(q8k_q[k + 1u]) & 255u) << 8u)
            | ((u32(q8k_q[k + 2u]) & 255u) << 16u) | ((u32(q8k_q[k + 3u]) & 255u) << 24u);
    }
    if (lid < 16u) {
        var s = 0;
        for (var i = 0u; i < 16u; i = i + 1u) {
            s = s + q8k_q[lid * 16u + i];
        }
        out.bsum = u32(s);
    }
    if (lid == 0u && amax != 0.0) {
        out.d = bitcast<u32>(fdiv(1.0, iscale));
    }
    // The next call's writes wait for these reads.
    workgroupBarrier();
    return out;
}

var<workgroup> scan_words: array<u32, 256>;

// The sum of `v` over the invocations of a 256-invocation workgroup before this one, and over
// all (uniform): (before, total), added in the same tree for every invocation. Call in uniform
// control flow; the barrier first lets it follow an earlier scan whose total is still being read
// (the indexer's top-k runs two in a row).
fn scan_before(v: u32, lid: u32) -> vec2<u32> {
    workgroupBarrier();
    scan_words[lid] = v;
    workgroupBarrier();
    for (var o = 1u; o < 256u; o = o * 2u) {
        var t = 0u;
        if (lid >= o) {
            t = scan_words[lid - o];
        }
        workgroupBarrier();
        scan_words[lid] = scan_words[lid] + t;
        workgroupBarrier();
    }
    let before = scan_words[lid] - v;
    return vec2<u32>(before, workgroupUniformLoad(&scan_words[255]));
}
