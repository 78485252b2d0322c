//! Block formats against golden data (dequantized by gguf-py), dot products against an
//! independent f64 reference, and properties of the activation quantizers.

mod common;

use ds4::quant::{
    dequantize_row, dot_f16_f32, dot_f32_f32, dot_iq2_xxs_q8_k, dot_q2_k_q8_k, dot_q4_k_q8_k, dot_q8_0, f16_to_f32,
    quantize_q8_0, quantize_q8_k, BlockQ8K, GgmlType, QuantError, QK8_0, QK_K,
};
use proptest::prelude::*;

const ROWS: usize = 8;
const COLS: usize = 1024;

/// Reads a golden file; a missing file fails the test.
fn golden(name: &str) -> Vec<u8> {
    let path = common::golden("quants").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("golden file {} is required: {e}", path.display()))
}

/// Raw weight rows of a golden type.
fn raw_rows(ty: GgmlType, file: &str) -> Vec<Vec<u8>> {
    let raw = golden(file);
    let rb = ty.row_bytes(COLS);
    assert_eq!(raw.len(), ROWS * rb, "{file}: size");
    raw.chunks_exact(rb).map(<[u8]>::to_vec).collect()
}

fn dequant(ty: GgmlType, row: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0f32; COLS];
    dequantize_row(ty, row, &mut out).expect("dequantize golden row");
    out
}

fn check_golden_dequant(ty: GgmlType, stem: &str) {
    let rows = raw_rows(ty, &format!("{stem}.bin"));
    let want: Vec<f32> =
        golden(&format!("{stem}.f32")).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(want.len(), ROWS * COLS, "{stem}.f32: size");
    let got: Vec<f32> = rows.iter().flat_map(|r| dequant(ty, r)).collect();
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{ty:?}: first mismatch at index {i} (row {}, col {}): got {:e} ({:#010x}), want {:e} ({:#010x})",
            i / COLS,
            i % COLS,
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

#[test]
fn golden_dequant_f16() {
    check_golden_dequant(GgmlType::F16, "f16");
}

#[test]
fn golden_dequant_q8_0() {
    check_golden_dequant(GgmlType::Q8_0, "q8_0");
}

#[test]
fn golden_dequant_q2_k() {
    check_golden_dequant(GgmlType::Q2_K, "q2_k");
}

#[test]
fn golden_dequant_iq2_xxs() {
    check_golden_dequant(GgmlType::IQ2_XXS, "iq2_xxs");
}

#[test]
fn golden_dequant_q4_k() {
    check_golden_dequant(GgmlType::Q4_K, "q4_k");
}

// ---------------------------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------------------------
//
// Error bounds. With u = 2^-24 and gamma(k) = k·u / (1 − k·u), a computation made of k
// successive f32 roundings on each term, whose exact terms have magnitudes summing to S, is off
// by at most gamma(k)·S from the exact sum. Here S = Σ_i a_i·|x̂_i| over the dequantized
// activation x̂, where a_i bounds the weight terms before any cancellation: |w_i| for F16,
// Q8_0 and IQ2_XXS (their dequantized values are exact products), and |w_i| + 2·|m_i| for
// Q2_K and Q4_K, where m_i = dmin·min of the element's sub-block (the kernels form d·sc·q and
// dmin·m separately, and the f32 dequantized w_i itself carries one rounding). k is the number
// of accumulated blocks (or elements, for F16) plus 8 for the per-term products and
// conversions. The f64 reference adds error far below this.
//
// Against the unquantized activation x, each |x̂_i − x_i| ≤ |d_b|·(1/2 + 1e-3) for the
// activation block b of element i (round-to-nearest of x/d, plus f32 rounding of x·(1/d),
// which is below 127·3u ≈ 2.3e-5 in units of d), so the bound grows by Σ_i |w_i|·|d_b|·(1/2 + 1e-3).

const U: f64 = 1.0 / 16_777_216.0;

fn gamma(k: usize) -> f64 {
    let ku = k as f64 * U;
    ku / (1.0 - ku)
}

struct Check {
    /// Kernel result.
    dot: f32,
    /// Dequantized weights.
    w: Vec<f32>,
    /// Per-element magnitude bound `a_i` of the weight terms.
    a: Vec<f64>,
    /// Dequantized activation.
    xq: Vec<f64>,
    /// Activation scale of each element's block (0 for unquantized activations).
    dx: Vec<f64>,
    /// Original activation.
    x: Vec<f32>,
    /// Number of f32 roundings per term (see above).
    k: usize,
}

impl Check {
    fn verify(&self, what: &str) {
        let refq: f64 = self.w.iter().zip(&self.xq).map(|(&w, &x)| f64::from(w) * x).sum();
        let s: f64 = self.a.iter().zip(&self.xq).map(|(a, x)| a * x.abs()).sum();
        let b1 = gamma(self.k) * s + 1e-30;
        let e1 = (f64::from(self.dot) - refq).abs();
        assert!(e1 <= b1, "{what}: |dot − ref(x̂)| = {e1:e} > {b1:e} (dot {}, ref {refq})", self.dot);
        let refx: f64 = self.w.iter().zip(&self.x).map(|(&w, &x)| f64::from(w) * f64::from(x)).sum();
        let act: f64 = self.w.iter().zip(&self.dx).map(|(&w, &d)| f64::from(w).abs() * d.abs() * (0.5 + 1e-3)).sum();
        let b2 = b1 + act;
        let e2 = (f64::from(self.dot) - refx).abs();
        assert!(e2 <= b2, "{what}: |dot − ref(x)| = {e2:e} > {b2:e} (dot {}, ref {refx})", self.dot);
    }
}

fn q8_k_all(x: &[f32]) -> Vec<BlockQ8K> {
    let mut y = vec![BlockQ8K::default(); x.len() / QK_K];
    quantize_q8_k(x, &mut y);
    y
}

fn q8_k_dequant(y: &[BlockQ8K]) -> (Vec<f64>, Vec<f64>) {
    let xq = y.iter().flat_map(|b| b.qs.iter().map(move |&q| f64::from(b.d) * f64::from(q))).collect();
    let dx = y.iter().flat_map(|b| [f64::from(b.d); QK_K]).collect();
    (xq, dx)
}

/// `|w_i| + 2·|dmin·min|` for a k-quant row, given each super-block's f16 dmin offset and a
/// function giving the min of sub-block `j` of `sub` sub-blocks.
fn kquant_magnitudes(
    row: &[u8],
    w: &[f32],
    block_bytes: usize,
    dmin_off: usize,
    sub: usize,
    min_of: impl Fn(&[u8], usize) -> u8,
) -> Vec<f64> {
    w.iter()
        .enumerate()
        .map(|(i, &wi)| {
            let b = &row[i / QK_K * block_bytes..][..block_bytes];
            let dmin = f16_to_f32(u16::from_le_bytes([b[dmin_off], b[dmin_off + 1]]));
            let m = f64::from(dmin) * f64::from(min_of(b, (i % QK_K) / (QK_K / sub)));
            f64::from(wi).abs() + 2.0 * m.abs()
        })
        .collect()
}

fn q2_k_min(b: &[u8], j: usize) -> u8 {
    b[j] >> 4
}

/// The 6-bit min of sub-block `j` in Q4_K's packed scales (bytes 4..16 of the block).
fn q4_k_min(b: &[u8], j: usize) -> u8 {
    let s = &b[4..16];
    if j < 4 {
        s[j + 4] & 63
    } else {
        (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
    }
}

fn activation() -> impl Strategy<Value = Vec<f32>> {
    (prop::collection::vec(-4.0f32..4.0, COLS), -8i32..8, prop::option::of(0usize..COLS / QK8_0)).prop_map(
        |(mut x, e, zero)| {
            let scale = 2.0f32.powi(e);
            for v in &mut x {
                *v *= scale;
            }
            // Sometimes zero one 32-block, to cover all-zero Q8_0 blocks.
            if let Some(z) = zero {
                x[z * QK8_0..(z + 1) * QK8_0].fill(0.0);
            }
            x
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn dot_q8_0_matches_reference(x in activation(), r in 0..ROWS) {
        let rows = raw_rows(GgmlType::Q8_0, "q8_0.bin");
        let row = &rows[r];
        let mut qs = vec![0i8; COLS];
        let mut d = vec![0.0f32; COLS / QK8_0];
        quantize_q8_0(&x, &mut qs, &mut d);
        let w = dequant(GgmlType::Q8_0, row);
        let check = Check {
            dot: dot_q8_0(row, &qs, &d),
            a: w.iter().map(|&v| f64::from(v).abs()).collect(),
            xq: qs.iter().enumerate().map(|(i, &q)| f64::from(d[i / QK8_0]) * f64::from(q)).collect(),
            dx: (0..COLS).map(|i| f64::from(d[i / QK8_0])).collect(),
            w,
            x,
            k: COLS / QK8_0 + 8,
        };
        check.verify("Q8_0");
    }

    #[test]
    fn dot_f16_matches_reference(x in activation(), r in 0..ROWS) {
        let rows = raw_rows(GgmlType::F16, "f16.bin");
        let w = dequant(GgmlType::F16, &rows[r]);
        let check = Check {
            dot: dot_f16_f32(&rows[r], &x),
            a: w.iter().map(|&v| f64::from(v).abs()).collect(),
            xq: x.iter().map(|&v| f64::from(v)).collect(),
            dx: vec![0.0; COLS],
            w,
            x,
            k: COLS + 8,
        };
        check.verify("F16");
    }

    #[test]
    fn dot_f32_is_the_rounded_f64_sum(x in activation(), r in 0..ROWS) {
        // The golden Q8_0 values serve as an F32 weight row.
        let w = dequant(GgmlType::Q8_0, &raw_rows(GgmlType::Q8_0, "q8_0.bin")[r]);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut acc = 0.0f64;
        for (&a, &b) in w.iter().zip(&x) {
            acc += f64::from(a) * f64::from(b);
        }
        prop_assert_eq!(dot_f32_f32(&bytes, &x).to_bits(), (acc as f32).to_bits());
    }

    #[test]
    fn dot_q2_k_matches_reference(x in activation(), r in 0..ROWS) {
        let rows = raw_rows(GgmlType::Q2_K, "q2_k.bin");
        let row = &rows[r];
        let y = q8_k_all(&x);
        let (xq, dx) = q8_k_dequant(&y);
        let w = dequant(GgmlType::Q2_K, row);
        let check = Check {
            dot: dot_q2_k_q8_k(row, &y),
            a: kquant_magnitudes(row, &w, 84, 82, 16, q2_k_min),
            w,
            xq,
            dx,
            x,
            k: COLS / QK_K + 8,
        };
        check.verify("Q2_K");
    }

    #[test]
    fn dot_q4_k_matches_reference(x in activation(), r in 0..ROWS) {
        let rows = raw_rows(GgmlType::Q4_K, "q4_k.bin");
        let row = &rows[r];
        let y = q8_k_all(&x);
        let (xq, dx) = q8_k_dequant(&y);
        let w = dequant(GgmlType::Q4_K, row);
        let check = Check {
            dot: dot_q4_k_q8_k(row, &y),
            a: kquant_magnitudes(row, &w, 144, 2, 8, q4_k_min),
            w,
            xq,
            dx,
            x,
            k: COLS / QK_K + 8,
        };
        check.verify("Q4_K");
    }

    #[test]
    fn dot_iq2_xxs_matches_reference(x in activation(), r in 0..ROWS) {
        let rows = raw_rows(GgmlType::IQ2_XXS, "iq2_xxs.bin");
        let row = &rows[r];
        let y = q8_k_all(&x);
        let (xq, dx) = q8_k_dequant(&y);
        let w = dequant(GgmlType::IQ2_XXS, row);
        let check = Check {
            dot: dot_iq2_xxs_q8_k(row, &y),
            a: w.iter().map(|&v| f64::from(v).abs()).collect(),
            w,
            xq,
            dx,
            x,
            k: COLS / QK_K + 8,
        };
        check.verify("IQ2_XXS");
    }

    #[test]
    fn q8_k_follows_ds4_rule(x in prop::collection::vec(-100.0f32..100.0, QK_K)) {
        let y = q8_k_all(&x);
        let b = &y[0];
        // The first element of largest magnitude.
        let mut k = 0;
        for (i, v) in x.iter().enumerate() {
            if v.abs() > x[k].abs() {
                k = i;
            }
        }
        let max = x[k];
        prop_assume!(max != 0.0);
        let iscale = -127.0f32 / max;
        prop_assert_eq!(b.qs[k], -127);
        prop_assert_eq!(b.d.to_bits(), (1.0 / iscale).to_bits());
        prop_assert!(b.d.signum() == -max.signum());
        for (i, (&q, &v)) in b.qs.iter().zip(&x).enumerate() {
            let want = ((iscale * v).round_ties_even() as i32).clamp(-128, 127);
            prop_assert_eq!(i32::from(q), want, "element {}", i);
        }
        for (j, &s) in b.bsums.iter().enumerate() {
            let sum: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| i32::from(q)).sum();
            prop_assert_eq!(i32::from(s), sum);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantizer properties
// ---------------------------------------------------------------------------------------------

#[test]
fn q8_0_rounds_ties_to_even() {
    // amax = 127 gives d = 1 and id = 1, so x·id is exactly x.
    let mut x = [0.0f32; QK8_0];
    let vals = [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -0.5, 126.5, -1.5, 4.4, -4.6];
    x[..vals.len()].copy_from_slice(&vals);
    let mut qs = [0i8; QK8_0];
    let mut d = [0.0f32; 1];
    quantize_q8_0(&x, &mut qs, &mut d);
    assert_eq!(d[0], 1.0);
    assert_eq!(&qs[..vals.len()], &[127, 2, 4, -2, -4, 0, 2, 0, 126, -2, 4, -5]);
    assert!(qs[vals.len()..].iter().all(|&q| q == 0));
}

#[test]
fn q8_0_scale_and_zero_blocks() {
    let mut x = vec![0.0f32; 3 * QK8_0];
    x[QK8_0 + 5] = -0.75; // block 1: amax 0.75, maps to −127
    x[QK8_0 + 6] = 0.25;
    x[2 * QK8_0] = 1e-3;
    let mut qs = vec![99i8; 3 * QK8_0];
    let mut d = vec![9.0f32; 3];
    quantize_q8_0(&x, &mut qs, &mut d);
    assert_eq!(d[0], 0.0);
    assert!(qs[..QK8_0].iter().all(|&q| q == 0));
    assert_eq!(d[1], 0.75 / 127.0);
    assert_eq!(qs[QK8_0 + 5], -127);
    assert_eq!(qs[QK8_0 + 6], 42); // 0.25·127/0.75 = 42.33
    assert_eq!(qs[2 * QK8_0], 127);
    assert_eq!(d[2], 1e-3 / 127.0);
}

#[test]
fn q8_0_partial_final_block_is_zero_padded() {
    let x: Vec<f32> = (0..40).map(|i| i as f32 - 20.0).collect();
    let mut qs = vec![55i8; 64];
    let mut d = vec![0.0f32; 2];
    quantize_q8_0(&x, &mut qs, &mut d);
    assert_eq!(d[1], 19.0 / 127.0);
    assert_eq!(qs[39], 127);
    assert!(qs[40..].iter().all(|&q| q == 0));
}

#[test]
fn q8_k_rounds_ties_to_even() {
    // max = −127 gives iscale = 1 and d = 1; 127.0 ties in magnitude but comes later.
    let mut x = [0.0f32; QK_K];
    let vals = [-127.0, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 126.5, 127.0, -0.5];
    x[..vals.len()].copy_from_slice(&vals);
    let y = q8_k_all(&x);
    assert_eq!(y[0].d, 1.0);
    assert_eq!(&y[0].qs[..vals.len()], &[-127, 2, 4, -2, -4, 0, 2, 126, 127, 0]);
    assert_eq!(i32::from(y[0].bsums[0]), y[0].qs[..16].iter().map(|&q| i32::from(q)).sum::<i32>());
}

#[test]
fn q8_k_first_max_wins_and_sets_sign() {
    let mut x = [0.0f32; QK_K];
    // 127/254 = 0.5 exactly: iscale = −0.5, d = −2.
    x[3] = 254.0;
    x[7] = -254.0;
    x[100] = 5.0;
    x[101] = 7.0;
    let y = q8_k_all(&x);
    let b = &y[0];
    assert_eq!(b.qs[3], -127);
    assert_eq!(b.qs[7], 127);
    assert_eq!(b.qs[100], -2); // −2.5 → −2 (even)
    assert_eq!(b.qs[101], -4); // −3.5 → −4 (even)
    assert_eq!(b.d, -2.0);
    assert_eq!(b.bsums[0], 0);
    assert_eq!(b.bsums[6], -6);
}

#[test]
fn q8_k_all_zero_block() {
    let mut x = vec![0.0f32; 2 * QK_K];
    x[QK_K + 1] = 1.0;
    let mut y = vec![BlockQ8K { d: 3.0, qs: [7; QK_K], bsums: [7; QK_K / 16] }; 2];
    quantize_q8_k(&x, &mut y);
    assert_eq!(y[0].d, 0.0);
    assert!(y[0].qs.iter().all(|&q| q == 0));
    assert!(y[0].bsums.iter().all(|&s| s == 0));
    assert_eq!(y[1].qs[1], -127);
    assert_eq!(y[1].bsums[0], -127);
}

// ---------------------------------------------------------------------------------------------
// dequantize_row errors and simple types
// ---------------------------------------------------------------------------------------------

#[test]
fn dequantize_row_rejects_wrong_source_length() {
    let mut dst = vec![0.0f32; 64];
    for (ty, len) in [(GgmlType::Q8_0, 67), (GgmlType::Q8_0, 69), (GgmlType::F16, 127), (GgmlType::F32, 0)] {
        let src = vec![0u8; len];
        match dequantize_row(ty, &src, &mut dst) {
            Err(QuantError::WrongLength { expected, got, .. }) => {
                assert_eq!(expected, ty.row_bytes(64));
                assert_eq!(got, len);
            }
            other => panic!("{ty:?} with {len} bytes: {other:?}"),
        }
    }
    let mut dst = vec![0.0f32; QK_K];
    let err = dequantize_row(GgmlType::Q2_K, &[0u8; 83], &mut dst).unwrap_err();
    assert!(matches!(err, QuantError::WrongLength { .. }), "{err:?}");
}

#[test]
fn dequantize_row_rejects_partial_blocks() {
    let mut dst = vec![0.0f32; 33];
    let err = dequantize_row(GgmlType::Q8_0, &[0u8; 34], &mut dst).unwrap_err();
    assert!(matches!(err, QuantError::NotBlockAligned { .. }), "{err:?}");
}

#[test]
fn dequantize_row_rejects_unsupported_types() {
    let mut dst = vec![0.0f32; 32];
    for ty in [GgmlType::Q4_0, GgmlType::Q6_K, GgmlType::BF16] {
        let src = vec![0u8; ty.row_bytes(32)];
        let err = dequantize_row(ty, &src, &mut dst).unwrap_err();
        assert!(matches!(err, QuantError::Unsupported(t) if t == ty), "{err:?}");
        assert!(err.to_string().contains(&format!("{ty:?}")), "{err}");
    }
}

#[test]
fn dequantize_row_f32_and_i32() {
    let vals = [1.5f32, -0.0, f32::MIN_POSITIVE, 3.0e38];
    let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut dst = [0.0f32; 4];
    dequantize_row(GgmlType::F32, &src, &mut dst).unwrap();
    for (a, b) in dst.iter().zip(&vals) {
        assert_eq!(a.to_bits(), b.to_bits());
    }
    let ints = [0i32, -7, 123_456, 16_777_217];
    let src: Vec<u8> = ints.iter().flat_map(|v| v.to_le_bytes()).collect();
    dequantize_row(GgmlType::I32, &src, &mut dst).unwrap();
    assert_eq!(dst, [0.0, -7.0, 123_456.0, 16_777_216.0]);
}

/// The batched prefill's decoded rows (`DecodedRow`, `dot_f16_rows8`, `dot_lane_major`) give the bits of the row
/// dots, in both profiles, for the golden rows of each type against varied activations.
#[test]
fn decoded_row_dots_have_the_row_dots_bits() {
    use ds4::quant::{
        dot_f16_f32_canonical, dot_f16_rows8, dot_iq2_xxs_q8_k_canonical, dot_lane_major, dot_q2_k_q8_k_canonical,
        dot_q8_0_canonical, to_lane_major, DecodedRow, QuantRows8,
    };
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits();
    // The golden rows, and longer rows made of golden rows end to end: 80 Q8_0 blocks and 37
    // k-quant blocks, more than one canonical chunk of 32 blocks with a short last one.
    for (q8_0_blocks, k_blocks) in [(COLS / QK8_0, COLS / QK_K), (80, 37)] {
        let rows = |ty: GgmlType, file: &str, blocks: usize| -> Vec<Vec<u8>> {
            let raw = raw_rows(ty, file);
            // Row r: golden rows r, r + 1, ... (cyclically), cut after `blocks` blocks.
            (0..raw.len())
                .map(|r| raw.iter().cycle().skip(r).flatten().take(blocks * ty.block_bytes()).copied().collect())
                .collect()
        };
        let acts = |cols: usize| -> Vec<Vec<f32>> {
            (0..5)
                .map(|s| (0..cols).map(|i| ((i * 37 + s * 101) % 97) as f32 * 0.03 - 1.4 + s as f32 * 0.2).collect())
                .collect()
        };
        // Five activations at once, 8 wide (three left empty).
        let cols = q8_0_blocks * QK8_0;
        let (mut xq, mut xd) = (vec![vec![0i8; cols]; 5], vec![vec![0f32; q8_0_blocks]; 5]);
        for (k, x) in acts(cols).iter().enumerate() {
            quantize_q8_0(x, &mut xq[k], &mut xd[k]);
        }
        let mut x8 = QuantRows8::default();
        x8.set_q8_0(&xq.iter().zip(&xd).map(|(q, d)| (&q[..], &d[..])).collect::<Vec<_>>());
        let mut d = DecodedRow::default();
        for row in rows(GgmlType::Q8_0, "q8_0.bin", q8_0_blocks) {
            d.load(GgmlType::Q8_0, &row);
            let (ds4, canonical) = (d.dot_rows8(&x8, false), d.dot_rows8(&x8, true));
            for k in 0..5 {
                assert!(same(ds4[k], dot_q8_0(&row, &xq[k], &xd[k])), "q8_0, ds4 order");
                assert!(same(canonical[k], dot_q8_0_canonical(&row, &xq[k], &xd[k])), "q8_0, canonical");
            }
        }
        let mut y = vec![vec![BlockQ8K::default(); k_blocks]; 5];
        for (k, x) in acts(k_blocks * QK_K).iter().enumerate() {
            quantize_q8_k(x, &mut y[k]);
        }
        let mut y8 = QuantRows8::default();
        y8.set_q8_k(&y.iter().map(|b| &b[..]).collect::<Vec<_>>());
        for row in rows(GgmlType::Q2_K, "q2_k.bin", k_blocks) {
            d.load(GgmlType::Q2_K, &row);
            let (ds4, canonical) = (d.dot_rows8(&y8, false), d.dot_rows8(&y8, true));
            for k in 0..5 {
                assert!(same(ds4[k], dot_q2_k_q8_k(&row, &y[k])), "q2_k, ds4 order");
                assert!(same(canonical[k], dot_q2_k_q8_k_canonical(&row, &y[k])), "q2_k, canonical");
            }
        }
        for row in rows(GgmlType::IQ2_XXS, "iq2_xxs.bin", k_blocks) {
            d.load(GgmlType::IQ2_XXS, &row);
            let (ds4, canonical) = (d.dot_rows8(&y8, false), d.dot_rows8(&y8, true));
            for k in 0..5 {
                assert!(same(ds4[k], dot_iq2_xxs_q8_k(&row, &y[k])), "iq2_xxs, ds4 order");
                assert!(same(canonical[k], dot_iq2_xxs_q8_k_canonical(&row, &y[k])), "iq2_xxs, canonical");
            }
        }
    }
    let acts: Vec<Vec<f32>> = (0..5)
        .map(|s| (0..COLS).map(|i| ((i * 37 + s * 101) % 97) as f32 * 0.03 - 1.4 + s as f32 * 0.2).collect())
        .collect();
    // F16 rows against all five activations at once: interleaved 8 wide (three left empty) in
    // ds4's order, and in lane order in the canonical one.
    let mut x8 = vec![0f32; COLS * 8];
    for (j, a) in acts.iter().enumerate() {
        for (i, &v) in a.iter().enumerate() {
            x8[i * 8 + j] = v;
        }
    }
    for row in raw_rows(GgmlType::F16, "f16.bin") {
        let w: Vec<f32> = row.chunks_exact(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
        let mut out = [0f32; 8];
        dot_f16_rows8(&w, &x8[..w.len() * 8], &mut out);
        let mut wt = vec![0f32; w.len()];
        to_lane_major(&w, &mut wt);
        for (j, x) in acts.iter().enumerate() {
            assert!(same(out[j], dot_f16_f32(&row, x)), "f16, ds4 order");
            let mut xt = vec![0f32; w.len()];
            to_lane_major(&x[..w.len()], &mut xt);
            assert!(same(dot_lane_major(&wt, &xt), dot_f16_f32_canonical(&row, x)), "f16, canonical");
        }
    }
}
