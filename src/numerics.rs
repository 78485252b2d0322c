//! The two numerics profiles, and the canonical profile written down op by op.
//!
//! The test models are chaotic: one ulp in one `exp` grows to hundredths in the logits within 64
//! tokens, and a reordered sum to whole units. So backends do not agree "within a tolerance";
//! they agree bit for bit, inside a profile:
//!
//! - **`ds4`** (CPU only): ds4's own CPU order and the C library's `expf` / `log1pf`, f64 sums of
//!   squares in RMS norms and f64 accumulation of F32 matvecs. Bit-identical to ds4's logits
//!   (`tests/data/golden/tiny-a`). It ties the engine to an outside oracle.
//! - **`canonical`** (every backend; the only one the GPU backends implement): the order below,
//!   which fast GPU kernels follow naturally, reproduced exactly by the CPU. Results do not depend
//!   on the thread count, the launch shape, split-K or the chunk size of a prefill.
//!
//! # Operations the canonical profile uses
//! Only operations that every backend computes identically: f32 `+ - *`, comparisons, min/max,
//! conversions between f32, f16 (round to nearest even) and integers, integer arithmetic, and the
//! two correctly rounded IEEE-754 operations **`a / b`** and **`sqrt(a)`** (round to nearest even).
//! Never f64, never a fused multiply-add (every `a * b + c` is two roundings; CUDA compiles with
//! `--fmad=false`), never a hardware `exp`, `log`, `rsqrt` or approximate division. CPU and CUDA
//! (`__fdiv_rn`, `__fsqrt_rn`: what `/` and `sqrtf` give under NVRTC's default `-prec-div=true
//! -prec-sqrt=true`) have correctly rounded division and square root in hardware; a target whose
//! division is not correctly rounded (WGSL allows 2.5 ulp) must build it from the basic operations.
//! `exp` and `log1p` are defined here, from the basic operations, and every backend evaluates the
//! same sequence ([`exp`], [`ln_1p`]). Subnormals: `exp` flushes results below 2^-126 to zero,
//! so softmax weights and sigmoids never carry a subnormal; elsewhere CPU and CUDA keep IEEE
//! gradual underflow (no `-ftz`).
//!
//! # The reduction order
//! Every long sum splits its terms into **chunks** of a fixed number of terms (the last chunk may
//! be short). Inside a chunk, term `i` (counted from the chunk's start) belongs to **lane**
//! `(i / W) % 32`, where `W` is the lane width: `W` consecutive terms (one 16-byte load) go to a
//! lane, then the next `W` to the next lane. Each lane starts at `+0.0` and adds its terms in
//! increasing `i`. The 32 lane sums are combined by the xor butterfly ([`tree32`]): for
//! `o = 16, 8, 4, 2, 1`, lane `l` becomes `v[l] + v[l ^ o]`. The chunk sums are added in chunk
//! order to a total that starts at `+0.0`. A GPU may give each chunk to a different warp or
//! block (split-K) and add the chunk sums afterwards; the result is the same.
//!
//! | reduction | terms | `W` | chunk |
//! |---|---|---|---|
//! | F16 weight row · f32 vector | `f32(w[i]) * x[i]` | 8 | 512 terms |
//! | F32 weight row · f32 vector, f32 · f32 dots (attention, indexer) | `a[i] * b[i]` | 4 | 512 terms |
//! | RMS norm sum of squares | `x[i] * x[i]` | 4 | 512 terms |
//! | Q8_0 weight row · Q8_0 activation | per 32-block: `(f32(d_w) * d_x) * f32(isum)` | 1 | 32 blocks |
//! | IQ2_XXS / Q2_K / Q4_K row · Q8_K activation | per 256-block: the block term below | 1 | 32 blocks |
//!
//! Integer sums inside a quant block are exact in any order (dp4a, tensor cores, any split).
//! The block terms are those of ds4: Q2_K and Q4_K `(d_y * d) * f32(isum) - (d_y * dmin) * f32(summs)`,
//! IQ2_XXS `(f32(d) * d_y) * f32(bsum)` with the row's sum then multiplied by `0.125`.
//!
//! # Op by op
//! - `embed_hc`, `store_raw`, `store_comp_row`, `compressor_store`, `compressor_shift`: copies,
//!   f16 rounding (nearest even) and one f32 add; no reduction.
//! - `rms_norm`: `ss` = the canonical sum of squares; `mean = ss / f32(n)`;
//!   `scale = 1 / sqrt(mean + eps)`; `out = (x * scale) * w`.
//! - `mat_vec`, `mat_vec_grouped`: the canonical dot per row. Q8_0 first quantizes the activation
//!   per 32 (`d = amax / 127`, `q = round_ties_even(x * (1 / d))`, as ds4).
//! - `hc_split`, `hc_head_weights`, `hc_weighted_sum`, `hc_post`: ds4's order (each output sums at
//!   most `n_hc = 4` terms, sequentially), with [`exp`] and IEEE division:
//!   `sigmoid(x) = 1 / (1 + exp(-x))` for `x >= 0`, else `e / (1 + e)` with `e = exp(x)`.
//! - `rope_tail`: rotates by the (cos, sin) table that `RopeParams::cos_sin` computes on the host
//!   once per process; every backend reads the same table.
//! - `fp8_round_trip`, `indexer_qat`: `scale` = the smallest power of two `>= amax / 448` (E4M3) or
//!   `>= amax / 6` (E2M1), found from the bits ([`pow2_ceil`]), not from `log2`; `x / scale` and
//!   `* scale` are exact. The Hadamard-128 is the butterfly with strides 1, 2, ..., 64, then
//!   `* (FRAC_1_SQRT_2 / 8)`.
//! - `compressor_pool`: per dim, sequential over the window rows in ds4's order, weights
//!   `exp(score - max)`, `out = sum / denom`.
//! - `attention` (per head): `s_r = dot(q, k_r) * kq_scale` with the canonical f32 dot and
//!   `kq_scale = 1 / sqrt(f32(head_dim))`; `m = max(sink, s_r...)`; `w_r = exp(s_r - m)`. Rows in
//!   order (raw rows oldest first, then the visible compressed rows ascending) split into chunks
//!   of [`ATTN_ROW_CHUNK`] rows; inside a chunk the weights and each output dim `w_r * k_r[d]` add
//!   sequentially from `+0.0`. `denom = exp(sink - m) + chunk_0 + chunk_1 + ...`, the output
//!   `(0 + chunk_0[d] + chunk_1[d] + ...) * (1 / denom)`.
//! - `indexer_scores`: per row, `dot(q_h, k)` the canonical f32 dot per head; the heads add
//!   sequentially: `acc += max(dot, 0) * (w_h * scale)`.
//! - `indexer_top_k`, `router_select` selection: exact comparisons, ties to the lower index.
//! - `router_select` weights: `p = sqrt(softplus(l))` with `softplus(x) = x` above 20, `exp(x)`
//!   below -20, else `ln_1p(exp(x))`; the selected `p` add sequentially, the sum is floored at
//!   2^-14, `w = p / sum * scale`.
//! - `moe_experts`: the activation quantized to Q8_K (ds4's rule), gate and up by the canonical
//!   block dot, `mid = silu(min(g, c)) * clamp(u, -c, c) * weight`, re-quantized to Q8_K, the down
//!   dot per expert, and the experts' results added sequentially in selection order.
//! - `swiglu`, `add`: element-wise.

/// Which numbers the CPU backend computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// ds4's own order and the C library's `expf`/`log1pf`: bit-identical to ds4's CPU logits.
    #[default]
    Ds4,
    /// The profile every backend implements bit for bit (this module's doc).
    Canonical,
}

impl Numerics {
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Ds4 => "ds4",
            Numerics::Canonical => "canonical",
        }
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Lanes of a reduction (a warp).
pub const LANES: usize = 32;
/// Terms per chunk of an f32 or F16 reduction.
pub const CHUNK: usize = 512;
/// Consecutive terms per lane step for f32 data (one 16-byte load).
pub const F32_WIDTH: usize = 4;
/// Consecutive terms per lane step for F16 weights (one 16-byte load).
pub const F16_WIDTH: usize = 8;
/// Block terms per chunk of a block-quantized dot (one block per lane).
pub const BLOCK_CHUNK: usize = 32;
/// Rows per chunk of the attention sums.
pub const ATTN_ROW_CHUNK: usize = 64;

/// The xor butterfly over 32 lane sums: for o = 16, 8, 4, 2, 1, lane l adds lane l ^ o.
#[inline]
pub fn tree32(mut v: [f32; LANES]) -> f32 {
    let mut o = LANES / 2;
    while o > 0 {
        for l in 0..o {
            v[l] += v[l + o];
        }
        o /= 2;
    }
    v[0]
}

/// The canonical sum of `t(0) .. t(n-1)`: chunks of `C` terms, `W` consecutive terms per lane,
/// 32 lanes combined by [`tree32`], chunk sums added in order.
#[inline]
pub fn sum<const W: usize, const C: usize>(n: usize, mut t: impl FnMut(usize) -> f32) -> f32 {
    let mut total = 0.0f32;
    let mut c0 = 0;
    while c0 < n {
        let end = (c0 + C).min(n);
        let mut acc = [0.0f32; LANES];
        for i in c0..end {
            acc[((i - c0) / W) % LANES] += t(i);
        }
        total += tree32(acc);
        c0 = end;
    }
    total
}

/// Canonical dot of two f32 vectors (attention, indexer, F32 weights).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let full = n / CHUNK * CHUNK;
    let mut total = 0.0f32;
    // Whole chunks through fixed-size arrays (no bounds checks, independent lanes).
    for (x, y) in a[..full].chunks_exact(CHUNK).zip(b[..full].chunks_exact(CHUNK)) {
        let x: &[f32; CHUNK] = x.try_into().expect("chunk");
        let y: &[f32; CHUNK] = y.try_into().expect("chunk");
        let mut acc = [0.0f32; LANES];
        for u in 0..CHUNK / (F32_WIDTH * LANES) {
            for (l, s) in acc.iter_mut().enumerate() {
                let base = (u * LANES + l) * F32_WIDTH;
                for v in base..base + F32_WIDTH {
                    *s += x[v] * y[v];
                }
            }
        }
        total += tree32(acc);
    }
    if n > full {
        let (x, y) = (&a[full..n], &b[full..n]);
        total += sum::<F32_WIDTH, CHUNK>(n - full, |i| x[i] * y[i]);
    }
    total
}

/// Canonical sum of squares (RMS norm).
pub fn sum_squares(x: &[f32]) -> f32 {
    dot_f32(x, x)
}

/// Canonical sum of per-block terms (Q8_0, k-quants, IQ2_XXS).
pub fn sum_blocks(n: usize, t: impl FnMut(usize) -> f32) -> f32 {
    sum::<1, BLOCK_CHUNK>(n, t)
}

/// ln 2 split so that `k * LN2_HI` is exact for |k| < 2^15 (9 significant bits).
pub const LN2_HI: f32 = 0.693_359_4;
pub const LN2_LO: f32 = -2.121_944_4e-4;
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// Above this `exp` overflows to infinity.
pub const EXP_MAX: f32 = 88.722_83;
/// Below this `exp` would be under 2^-126; the result is flushed to zero.
pub const EXP_MIN: f32 = -87.336_55;
/// 1/k! for k = 2..=7, rounded to f32 (Horner from the highest).
pub const EXP_POLY: [f32; 6] = [0.5, 0.166_666_67, 0.041_666_668, 0.008_333_334, 0.001_388_888_9, 1.984_127e-4];
/// 2/(2k+1) for k = 1..=5: ln(1+f) = f - (f²/2 - s·(f²/2 + R)), R = z·Σ LN_POLY[k-1]·z^(k-1).
pub const LN_POLY: [f32; 5] = [0.666_666_7, 0.4, 0.285_714_3, 0.222_222_22, 0.181_818_18];
/// 1/3, for the series near zero.
pub const LN_THIRD: f32 = 0.333_333_34;

/// 2^k as an f32, for k in -126..=127.
#[inline]
pub fn pow2i(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// exp(x) from f32 basic operations: x = k·ln2 + r (Cody-Waite), a degree-7 Taylor polynomial
/// for exp(r) by Horner, scaled by 2^k in two exact steps. Results below 2^-126 are flushed to 0.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_MAX {
        return f32::INFINITY;
    }
    if x < EXP_MIN {
        return 0.0;
    }
    let k = (x * LOG2_E).round_ties_even();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p = EXP_POLY[5];
    for &c in EXP_POLY[..5].iter().rev() {
        p = p * r + c;
    }
    p = p * r + 1.0;
    p = p * r + 1.0;
    let k = k as i32;
    let k1 = k / 2;
    let y = p * pow2i(k1) * pow2i(k - k1);
    if y < f32::MIN_POSITIVE {
        0.0
    } else {
        y
    }
}

/// ln(1 + x) from f32 basic operations and IEEE division: u = 1 + x rounded, the rounding error
/// carried as `c = (x - (u - 1)) / u`, u = m·2^j with m in [√½, √2), f = m - 1, s = f/(2 + f),
/// z = s², and ln(m) = f - (f²/2 - s·(f²/2 + R)) with R = z·(2/3 + 2z/5 + ...) (fdlibm's form,
/// which keeps the large terms exact).
#[inline]
pub fn ln_1p(x: f32) -> f32 {
    if x.is_nan() || x < -1.0 {
        return f32::NAN;
    }
    if x == -1.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    if x.abs() < 2.441_406_3e-4 {
        // 2^-12: the series x - x²/2 + x³/3 is exact to well under an ulp.
        let x2 = x * x;
        return (x - x2 * 0.5) + (x2 * x) * LN_THIRD;
    }
    let u = 1.0 + x;
    // u - 1 is exact for u < 2^24; beyond it the correction is far below an ulp.
    let c = if u < 16_777_216.0 { (x - (u - 1.0)) / u } else { 0.0 };
    let bits = u.to_bits();
    let mut j = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        j += 1;
    }
    let f = m - 1.0;
    let hfsq = 0.5 * f * f;
    let s = f / (2.0 + f);
    let z = s * s;
    let mut p = LN_POLY[4];
    for &k in LN_POLY[..4].iter().rev() {
        p = p * z + k;
    }
    let r = z * p;
    let jf = j as f32;
    jf * LN2_HI - ((hfsq - (s * (hfsq + r) + (jf * LN2_LO + c))) - f)
}

/// The smallest power of two `>= t`, for positive normal `t` (the fp8 / fp4 block scales).
#[inline]
pub fn pow2_ceil(t: f32) -> f32 {
    let bits = t.to_bits();
    if bits & 0x007f_ffff == 0 {
        t
    } else {
        f32::from_bits((bits & 0x7f80_0000) + 0x0080_0000)
    }
}

/// The profile's float constants by the names the GPU shaders and kernels use: one list for
/// both generated headers (`cuda_constants` here, the wgpu backend's `wgsl_constants`).
pub fn float_constants() -> Vec<(String, f32)> {
    let mut v: Vec<(String, f32)> = vec![
        ("DS4_LN2_HI".into(), LN2_HI),
        ("DS4_LN2_LO".into(), LN2_LO),
        ("DS4_LOG2_E".into(), LOG2_E),
        ("DS4_EXP_MAX".into(), EXP_MAX),
        ("DS4_EXP_MIN".into(), EXP_MIN),
    ];
    v.extend(EXP_POLY.iter().enumerate().map(|(i, &c)| (format!("DS4_EXP_C{}", i + 2), c)));
    v.extend(LN_POLY.iter().enumerate().map(|(i, &c)| (format!("DS4_LN_P{}", i + 1), c)));
    v.push(("DS4_LN_THIRD".into(), LN_THIRD));
    v.push(("DS4_SQRT2".into(), std::f32::consts::SQRT_2));
    v.push(("DS4_HADAMARD_SCALE".into(), std::f32::consts::FRAC_1_SQRT_2 / 8.0));
    v
}

/// The constants the CUDA kernels use, as `#define`s with exact bit patterns, so that the kernel
/// source and this module cannot drift apart.
pub fn cuda_constants() -> String {
    let mut s = String::from("// Generated from src/numerics.rs: the canonical profile's constants.\n");
    for (name, v) in float_constants() {
        s += &format!("#define {name} __int_as_float(0x{:08x}) /* {v:e} */\n", v.to_bits());
    }
    s += &format!(
        "#define DS4_CHUNK {CHUNK}\n#define DS4_BLOCK_CHUNK {BLOCK_CHUNK}\n#define DS4_ATTN_ROW_CHUNK {ATTN_ROW_CHUNK}\n"
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> i64 {
        (a.to_bits() as i64 - b.to_bits() as i64).abs()
    }

    /// Within 2 ulp of the exactly rounded value over the range the engine uses; exact at the
    /// special points; flushed below 2^-126.
    #[test]
    fn exp_is_accurate() {
        let mut worst = 0;
        let mut x = -87.3f32;
        while x < 88.7 {
            let want = (x as f64).exp() as f32;
            worst = worst.max(ulps(exp(x), want));
            x += 0.000_731;
        }
        assert!(worst <= 2, "exp is {worst} ulp off");
        assert_eq!(LN2_HI.to_bits(), 0x3f31_8000, "0.693359375: 9 significant bits");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(-87.4), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-87.3) >= f32::MIN_POSITIVE);
    }

    #[test]
    fn ln_1p_is_accurate() {
        let mut worst = 0;
        let mut x = -0.999f32;
        while x < 1e9 {
            let want = (x as f64).ln_1p() as f32;
            worst = worst.max(ulps(ln_1p(x), want));
            x = if x < 1.0 { x + 0.000_037 } else { x * 1.000_37 };
        }
        let mut x = 1e-30f32;
        while x < 1e-3 {
            let want = (x as f64).ln_1p() as f32;
            worst = worst.max(ulps(ln_1p(x), want));
            worst = worst.max(ulps(ln_1p(-x), (-x as f64).ln_1p() as f32));
            x *= 1.01;
        }
        assert!(worst <= 2, "ln_1p is {worst} ulp off{}", {
            let mut at = String::new();
            let mut x = -0.999f32;
            while x < 1e9 {
                if ulps(ln_1p(x), (x as f64).ln_1p() as f32) > 2 && at.len() < 200 {
                    at += &format!(" {x:e}");
                }
                x = if x < 1.0 { x + 0.000_037 } else { x * 1.000_37 };
            }
            at
        });
        assert_eq!(ln_1p(0.0), 0.0);
        assert_eq!(ln_1p(-1.0), f32::NEG_INFINITY);
        assert!(ln_1p(-2.0).is_nan());
    }

    #[test]
    fn pow2_ceil_is_the_next_power_of_two() {
        for &(t, want) in
            &[(1.0f32, 1.0f32), (1.000_000_1, 2.0), (0.75, 1.0), (3.0, 4.0), (0.25, 0.25), (5e-7, 9.536_743e-7)]
        {
            assert_eq!(pow2_ceil(t), want, "{t}");
        }
        let mut t = 1.0e-30f32;
        while t < 1e30 {
            let p = pow2_ceil(t);
            assert!(p >= t && p / 2.0 < t && p.to_bits() & 0x007f_ffff == 0, "{t} -> {p}");
            t *= 1.37;
        }
    }

    /// The butterfly is the shuffle-xor reduction: lane 0's value after every level.
    #[test]
    fn tree32_is_the_xor_butterfly() {
        let v: [f32; 32] = std::array::from_fn(|i| ((i * 37 % 11) as f32 - 5.0) * 1.0e-3 * (i as f32 + 1.0).powi(3));
        let mut lanes = v;
        for o in [16, 8, 4, 2, 1] {
            let prev = lanes;
            for l in 0..32 {
                lanes[l] = prev[l] + prev[l ^ o];
            }
        }
        assert!(lanes.iter().all(|&x| x.to_bits() == lanes[0].to_bits()));
        assert_eq!(tree32(v).to_bits(), lanes[0].to_bits());
    }

    /// Splitting a sum at chunk boundaries (split-K) and adding the chunk sums gives the same bits.
    #[test]
    fn chunked_sum_equals_split_sum() {
        let x: Vec<f32> = (0..5000).map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 0.013).collect();
        let whole = sum_squares(&x);
        let mut total = 0.0f32;
        for c in x.chunks(CHUNK) {
            total += sum_squares(c);
        }
        assert_eq!(whole.to_bits(), total.to_bits());
    }
}
