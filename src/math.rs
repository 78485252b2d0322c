//! Transcendental functions for the numerics contract.
//!
//! ds4's CPU path calls the C library's `expf` and `log1pf`, and the golden logits carry their
//! exact roundings: glibc's `expf` differs from the correctly rounded value on about 0.06% of
//! inputs and its `log1pf` on about 6% (measured here over random inputs). The small test models
//! are chaotic, so those 1-ulp differences grow into logit differences of several hundredths
//! within 64 tokens. A GPU cannot call glibc, so the engine also has **portable** versions:
//! evaluated in f64 with basic IEEE operations only (+ − × ÷, exact scaling, conversions) and
//! rounded once to f32. The CUDA kernels (`kernels/common.cuh`) compute the same operations in
//! the same order, so a CPU run in portable mode and a GPU run agree bit for bit.

/// Which `exp` / `log1p` the CPU backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MathMode {
    /// The C library's, as ds4's CPU path: bit-identical to the golden logits.
    #[default]
    Libm,
    /// The portable versions below: bit-identical to the GPU backends.
    Portable,
}

/// 1/k! for k = 0..=12: the Taylor series of exp on |r| <= ln(2)/2 to about 2e-16.
const EXP_TAYLOR: [f64; 13] = [
    1.0,
    1.0,
    0.5,
    0.16666666666666666,
    0.041666666666666664,
    0.008333333333333333,
    0.001388888888888889,
    0.0001984126984126984,
    2.48015873015873e-5,
    2.7557319223985893e-6,
    2.755731922398589e-7,
    2.505210838544172e-8,
    2.08767569878681e-9,
];

/// exp(x) for f32 x: x = k·ln2 + r, a Taylor polynomial for exp(r), scaled by 2^k.
pub fn exp_f32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 89.0 {
        return f32::INFINITY;
    }
    if x < -104.0 {
        return 0.0;
    }
    let xd = x as f64;
    let k = (xd * std::f64::consts::LOG2_E).round_ties_even();
    let r = xd - k * std::f64::consts::LN_2;
    let mut p = EXP_TAYLOR[12];
    for &c in EXP_TAYLOR[..12].iter().rev() {
        p = p * r + c;
    }
    // k is in [-151, 129]: 2^k is a normal f64 and the scaling is exact.
    let scale = f64::from_bits(((k as i64 + 1023) as u64) << 52);
    (p * scale) as f32
}

/// 1/(2k+1) for k = 0..=11: ln(m) = 2s·Σ s^(2k)/(2k+1) with s = (m−1)/(m+1), |s| <= 0.172.
const ATANH_SERIES: [f64; 12] = [
    1.0,
    0.3333333333333333,
    0.2,
    0.14285714285714285,
    0.1111111111111111,
    0.09090909090909091,
    0.07692307692307693,
    0.06666666666666667,
    0.058823529411764705,
    0.05263157894736842,
    0.047619047619047616,
    0.043478260869565216,
];

/// ln(1 + x) for f32 x: 1 + x = m·2^j with m in [√½, √2), then the atanh series for ln(m).
pub fn ln_1p_f32(x: f32) -> f32 {
    if x.is_nan() || x < -1.0 {
        return f32::NAN;
    }
    if x == -1.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    let xd = x as f64;
    if xd.abs() < 1e-4 {
        // Near zero 1 + x would lose x's low bits; the series is exact enough there.
        return (xd - xd * xd / 2.0 + xd * xd * xd / 3.0 - xd * xd * xd * xd / 4.0) as f32;
    }
    let y = 1.0 + xd;
    let bits = y.to_bits();
    let mut j = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | (1023u64 << 52));
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        j += 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let mut p = ATANH_SERIES[11];
    for &c in ATANH_SERIES[..11].iter().rev() {
        p = p * z + c;
    }
    (j as f64 * std::f64::consts::LN_2 + 2.0 * s * p) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both stay within one f32 ulp of the libm result (which is itself within about 0.5 ulp of
    /// the exact value), over a sweep of the ranges the engine uses.
    #[test]
    fn portable_functions_are_accurate() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        let mut x = -103.0f32;
        while x < 88.5 {
            let (p, l) = (exp_f32(x), ((x as f64).exp()) as f32);
            assert!(ulps(p, l) <= 1, "exp({x}) = {p} vs {l}");
            x += 0.0137;
        }
        let mut x = -0.999f32;
        while x < 1e8 {
            let (p, l) = (ln_1p_f32(x), (x as f64).ln_1p() as f32);
            assert!(ulps(p, l) <= 1, "ln_1p({x}) = {p} vs {l}");
            x = if x < 1.0 { x + 0.00037 } else { x * 1.0137 };
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(ln_1p_f32(0.0), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(ln_1p_f32(-2.0).is_nan());
    }
}
