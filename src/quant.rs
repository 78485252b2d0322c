//! Block formats: layouts, dequantization, CPU dot products and activation quantizers.

use crate::numerics;

/// GGML tensor types, with the ids GGUF stores. The reader knows every standard type so that
/// `inspect` can describe any file; the engine itself computes with the subset
/// F32, F16, Q8_0, Q2_K, IQ2_XXS, Q4_K and I32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match v {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block), as ggml defines them.
    pub fn block(self) -> (usize, usize) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            IQ2_XXS => (256, 66),
            IQ2_XS => (256, 74),
            IQ3_XXS => (256, 98),
            IQ1_S => (256, 50),
            IQ4_NL => (32, 18),
            IQ3_S => (256, 110),
            IQ2_S => (256, 82),
            IQ4_XS => (256, 136),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1_M => (256, 56),
            BF16 => (1, 2),
            TQ1_0 => (256, 54),
            TQ2_0 => (256, 66),
            MXFP4 => (32, 17),
        }
    }
    pub fn block_elems(self) -> usize {
        self.block().0
    }
    pub fn block_bytes(self) -> usize {
        self.block().1
    }
    /// Bytes of one row of `n` elements (`n` a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }
    /// Whether this engine can dequantize and compute with the type.
    pub fn is_supported(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | Q8_0 | Q2_K | IQ2_XXS | Q4_K | I32)
    }
}

// ---------------------------------------------------------------------------------------------
// Block constants and f16 helpers
// ---------------------------------------------------------------------------------------------

/// Elements per Q8_0 block.
pub const QK8_0: usize = 32;
/// Elements per k-quant super-block (Q2_K, Q4_K, IQ2_XXS, Q8_K).
pub const QK_K: usize = 256;

const Q8_0_BYTES: usize = 34;
const Q2_K_BYTES: usize = 84;
const Q4_K_BYTES: usize = 144;
const IQ2_XXS_BYTES: usize = 66;

/// Converts IEEE half-precision bits to f32. Exact for every finite value and infinity; a NaN
/// stays a NaN with its payload shifted into the f32 mantissa (no quieting), as ds4's scalar path does.
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let mag = u32::from(h & 0x7fff);
    let bits = if mag >= 0x7c00 {
        0x7f80_0000 | ((mag & 0x03ff) << 13)
    } else {
        // Placing the f16 exponent/mantissa in the f32 fields and scaling by 2^112 rebiases the
        // exponent (127 - 15); subnormal halves land on f32 subnormals, which the scale makes
        // normal again. Multiplication by a power of two is exact here.
        (f32::from_bits(mag << 13) * f32::from_bits(0x7780_0000)).to_bits()
    };
    f32::from_bits(sign | bits)
}

/// Converts f32 to IEEE half-precision bits, rounding to nearest with ties to even; overflow
/// gives infinity, and every NaN becomes the quiet NaN `0x7e00` with the input's sign.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    if x.is_nan() {
        return ((x.to_bits() >> 16) as u16 & 0x8000) | 0x7e00;
    }
    half::f16::from_f32(x).to_bits()
}

/// Rounds an f32 to the nearest f16 value and back (`f16_to_f32(f32_to_f16(x))`).
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16_to_f32(f32_to_f16(x))
}

/// Reads the little-endian f16 at byte `i` of `b` as f32.
#[inline(always)]
fn le_f16(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

// ---------------------------------------------------------------------------------------------
// Errors and dequantization
// ---------------------------------------------------------------------------------------------

/// Failures of [`dequantize_row`].
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// The source slice does not hold exactly one row of the requested length.
    #[error("{ty:?} row of {n} elements takes {expected} bytes, but the source has {got}")]
    WrongLength { ty: GgmlType, n: usize, expected: usize, got: usize },
    /// The destination length is not a whole number of blocks.
    #[error("{n} elements is not a multiple of the {ty:?} block size {block}")]
    NotBlockAligned { ty: GgmlType, n: usize, block: usize },
    /// The engine has no dequantizer for this type.
    #[error("tensor type {0:?} is not supported by this engine")]
    Unsupported(GgmlType),
}

/// Dequantizes one row of `dst.len()` elements of type `ty` from its raw little-endian bytes.
///
/// Supported types: F32, F16, Q8_0, Q2_K, IQ2_XXS, Q4_K and I32 (the integer converted to the
/// nearest f32). `dst.len()` must be a multiple of the block size and `src.len()` must equal
/// `ty.row_bytes(dst.len())`; otherwise an error is returned and `dst` is left untouched.
/// The results are bit-identical to the reference dequantizers of gguf-py / ggml.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::Unsupported(ty));
    }
    let n = dst.len();
    let block = ty.block_elems();
    if !n.is_multiple_of(block) {
        return Err(QuantError::NotBlockAligned { ty, n, block });
    }
    let expected = ty.row_bytes(n);
    if src.len() != expected {
        return Err(QuantError::WrongLength { ty, n, expected, got: src.len() });
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgmlType::I32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(QK8_0)) {
                dequant_q8_0_block(b, o);
            }
        }
        GgmlType::Q2_K => {
            for (b, o) in src.chunks_exact(Q2_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
                dequant_q2_k_block(b, o);
            }
        }
        GgmlType::Q4_K => {
            for (b, o) in src.chunks_exact(Q4_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
                dequant_q4_k_block(b, o);
            }
        }
        GgmlType::IQ2_XXS => {
            for (b, o) in src.chunks_exact(IQ2_XXS_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
                dequant_iq2_xxs_block(b, o);
            }
        }
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

/// Q8_0: f16 scale, then 32 signed bytes; value = d · q.
fn dequant_q8_0_block(b: &[u8], out: &mut [f32]) {
    let d = le_f16(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..Q8_0_BYTES]) {
        *o = f32::from(q as i8) * d;
    }
}

/// Q2_K: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, f16 d,
/// f16 dmin. Each 128-element half uses 32 quant bytes at shifts 0, 2, 4, 6; each 16 outputs
/// have their own scale byte. value = (d·sc)·q − (dmin·m).
fn dequant_q2_k_block(b: &[u8], out: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = le_f16(b, 80);
    let dmin = le_f16(b, 82);
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for k in 0..2 {
                let sc = scales[8 * half + 2 * j + k];
                let dl = d * f32::from(sc & 0x0f);
                let ml = dmin * f32::from(sc >> 4);
                let o = &mut out[128 * half + 32 * j + 16 * k..][..16];
                for (o, &qq) in o.iter_mut().zip(&q[16 * k..16 * k + 16]) {
                    *o = dl * f32::from((qq >> shift) & 3) - ml;
                }
            }
        }
    }
}

/// Unpacks the 6-bit scale and min of sub-block `j` (0..8) from Q4_K's 12 packed bytes: the
/// first four use the low 6 bits of bytes j and j+4; the last four take their low nibbles from
/// byte j+4 and their top two bits from the high bits of bytes j−4 and j.
#[inline(always)]
fn q4_k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles. Each
/// 64-element chunk reads 32 bytes: low nibbles are the first 32 outputs, high nibbles the next.
/// value = (d·sc)·q − (dmin·m).
fn dequant_q4_k_block(b: &[u8], out: &mut [f32]) {
    let d = le_f16(b, 0);
    let dmin = le_f16(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..Q4_K_BYTES];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc1, m1) = q4_k_scale_min(2 * c, scales);
        let (sc2, m2) = q4_k_scale_min(2 * c + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let o = &mut out[64 * c..64 * c + 64];
        let (lo, hi) = o.split_at_mut(32);
        for ((l, h), &qq) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
            *l = d1 * f32::from(qq & 0x0f) - min1;
            *h = d2 * f32::from(qq >> 4) - min2;
        }
    }
}

/// IQ2_XXS: f16 d, then per 32 elements 8 bytes: four grid indices (one byte each, 8 values
/// per grid row) and a little-endian u32 holding four 7-bit sign indices and a 4-bit scale in
/// the top bits. value = (d·(0.5 + s)·0.25)·grid · (±1).
fn dequant_iq2_xxs_block(b: &[u8], out: &mut [f32]) {
    let d = le_f16(b, 0);
    let qs = &b[2..IQ2_XXS_BYTES];
    for ib in 0..QK_K / 32 {
        let g = &qs[8 * ib..8 * ib + 8];
        let aux = u32::from_le_bytes([g[4], g[5], g[6], g[7]]);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[usize::from(g[l])].to_le_bytes();
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            let o = &mut out[32 * ib + 8 * l..][..8];
            for (j, (o, &gv)) in o.iter_mut().zip(&grid).enumerate() {
                let w = db * f32::from(gv);
                *o = if signs & (1 << j) != 0 { -w } else { w };
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// IQ2_XXS tables
// ---------------------------------------------------------------------------------------------

/// Sign patterns of IQ2_XXS: index `s` holds its 7 bits as the signs of the first 7 values and
/// an 8th bit that makes the number of negative values even (bit 7 = parity of `s`).
pub(crate) const KSIGNS_IQ2XS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut s = 0;
    while s < 128 {
        t[s] = s as u8 | (((s as u32).count_ones() as u8 & 1) << 7);
        s += 1;
    }
    t
};

/// The same sign patterns as ±1 factors per value, for the integer dot product.
const SIGNS_I8: [[i8; 8]; 128] = {
    let mut t = [[1i8; 8]; 128];
    let mut s = 0;
    while s < 128 {
        let mut j = 0;
        while j < 8 {
            if KSIGNS_IQ2XS[s] & (1 << j) != 0 {
                t[s][j] = -1;
            }
            j += 1;
        }
        s += 1;
    }
    t
};

/// The 256-entry IQ2_XXS lattice: each u64 packs 8 unsigned magnitudes (bytes, little-endian
/// order), each one of 8, 25 or 43. These are format constants of ggml's IQ2_XXS type and
/// cannot be derived; the values are those of `iq2xxs_grid` in ggml (ggml-common.h), also
/// found as `iq2xxs_grid` in antirez's ds4.c.
pub(crate) static IQ2XXS_GRID: [u64; 256] = [
    0x0808080808080808,
    0x080808080808082b,
    0x0808080808081919,
    0x0808080808082b08,
    0x0808080808082b2b,
    0x0808080808190819,
    0x0808080808191908,
    0x08080808082b0808,
    0x08080808082b082b,
    0x08080808082b2b08,
    0x08080808082b2b2b,
    0x0808080819080819,
    0x0808080819081908,
    0x0808080819190808,
    0x0808080819192b08,
    0x08080808192b0819,
    0x08080808192b1908,
    0x080808082b080808,
    0x080808082b08082b,
    0x080808082b082b2b,
    0x080808082b2b082b,
    0x0808081908080819,
    0x0808081908081908,
    0x0808081908190808,
    0x0808081908191919,
    0x0808081919080808,
    0x080808192b081908,
    0x080808192b192b08,
    0x0808082b08080808,
    0x0808082b0808082b,
    0x0808082b082b082b,
    0x0808082b2b08082b,
    0x0808190808080819,
    0x0808190808081908,
    0x0808190808190808,
    0x08081908082b0819,
    0x08081908082b1908,
    0x0808190819080808,
    0x080819081908082b,
    0x0808190819082b08,
    0x08081908192b0808,
    0x080819082b080819,
    0x080819082b081908,
    0x080819082b190808,
    0x080819082b2b1908,
    0x0808191908080808,
    0x080819190808082b,
    0x0808191908082b08,
    0x08081919082b0808,
    0x080819191908192b,
    0x08081919192b2b19,
    0x080819192b080808,
    0x080819192b190819,
    0x0808192b08082b19,
    0x0808192b08190808,
    0x0808192b19080808,
    0x0808192b2b081908,
    0x0808192b2b2b1908,
    0x08082b0808080808,
    0x08082b0808081919,
    0x08082b0808082b08,
    0x08082b0808191908,
    0x08082b08082b2b08,
    0x08082b0819080819,
    0x08082b0819081908,
    0x08082b0819190808,
    0x08082b081919082b,
    0x08082b082b082b08,
    0x08082b1908081908,
    0x08082b1919080808,
    0x08082b2b0808082b,
    0x08082b2b08191908,
    0x0819080808080819,
    0x0819080808081908,
    0x0819080808190808,
    0x08190808082b0819,
    0x0819080819080808,
    0x08190808192b0808,
    0x081908082b081908,
    0x081908082b190808,
    0x081908082b191919,
    0x0819081908080808,
    0x0819081908082b08,
    0x08190819082b0808,
    0x0819081919190808,
    0x0819081919192b2b,
    0x081908192b080808,
    0x0819082b082b1908,
    0x0819082b19081919,
    0x0819190808080808,
    0x0819190808082b08,
    0x08191908082b0808,
    0x08191908082b1919,
    0x0819190819082b19,
    0x081919082b080808,
    0x0819191908192b08,
    0x08191919192b082b,
    0x0819192b08080808,
    0x0819192b0819192b,
    0x08192b0808080819,
    0x08192b0808081908,
    0x08192b0808190808,
    0x08192b0819080808,
    0x08192b082b080819,
    0x08192b1908080808,
    0x08192b1908081919,
    0x08192b192b2b0808,
    0x08192b2b19190819,
    0x082b080808080808,
    0x082b08080808082b,
    0x082b080808082b2b,
    0x082b080819081908,
    0x082b0808192b0819,
    0x082b08082b080808,
    0x082b08082b08082b,
    0x082b0819082b2b19,
    0x082b081919082b08,
    0x082b082b08080808,
    0x082b082b0808082b,
    0x082b190808080819,
    0x082b190808081908,
    0x082b190808190808,
    0x082b190819080808,
    0x082b19081919192b,
    0x082b191908080808,
    0x082b191919080819,
    0x082b1919192b1908,
    0x082b192b2b190808,
    0x082b2b0808082b08,
    0x082b2b08082b0808,
    0x082b2b082b191908,
    0x082b2b2b19081908,
    0x1908080808080819,
    0x1908080808081908,
    0x1908080808190808,
    0x1908080808192b08,
    0x19080808082b0819,
    0x19080808082b1908,
    0x1908080819080808,
    0x1908080819082b08,
    0x190808081919192b,
    0x19080808192b0808,
    0x190808082b080819,
    0x190808082b081908,
    0x190808082b190808,
    0x1908081908080808,
    0x19080819082b0808,
    0x19080819192b0819,
    0x190808192b080808,
    0x190808192b081919,
    0x1908082b08080819,
    0x1908082b08190808,
    0x1908082b19082b08,
    0x1908082b1919192b,
    0x1908082b192b2b08,
    0x1908190808080808,
    0x1908190808082b08,
    0x19081908082b0808,
    0x190819082b080808,
    0x190819082b192b19,
    0x190819190819082b,
    0x19081919082b1908,
    0x1908192b08080808,
    0x19082b0808080819,
    0x19082b0808081908,
    0x19082b0808190808,
    0x19082b0819080808,
    0x19082b0819081919,
    0x19082b1908080808,
    0x19082b1919192b08,
    0x19082b19192b0819,
    0x19082b192b08082b,
    0x19082b2b19081919,
    0x19082b2b2b190808,
    0x1919080808080808,
    0x1919080808082b08,
    0x1919080808190819,
    0x1919080808192b19,
    0x19190808082b0808,
    0x191908082b080808,
    0x191908082b082b08,
    0x1919081908081908,
    0x191908191908082b,
    0x191908192b2b1908,
    0x1919082b2b190819,
    0x191919082b190808,
    0x191919082b19082b,
    0x1919191908082b2b,
    0x1919192b08080819,
    0x1919192b19191908,
    0x19192b0808080808,
    0x19192b0808190819,
    0x19192b0808192b19,
    0x19192b08192b1908,
    0x19192b1919080808,
    0x19192b2b08082b08,
    0x192b080808081908,
    0x192b080808190808,
    0x192b080819080808,
    0x192b0808192b2b08,
    0x192b081908080808,
    0x192b081919191919,
    0x192b082b08192b08,
    0x192b082b192b0808,
    0x192b190808080808,
    0x192b190808081919,
    0x192b191908190808,
    0x192b19190819082b,
    0x192b19192b081908,
    0x192b2b081908082b,
    0x2b08080808080808,
    0x2b0808080808082b,
    0x2b08080808082b2b,
    0x2b08080819080819,
    0x2b0808082b08082b,
    0x2b08081908081908,
    0x2b08081908192b08,
    0x2b08081919080808,
    0x2b08082b08190819,
    0x2b08190808080819,
    0x2b08190808081908,
    0x2b08190808190808,
    0x2b08190808191919,
    0x2b08190819080808,
    0x2b081908192b0808,
    0x2b08191908080808,
    0x2b0819191908192b,
    0x2b0819192b191908,
    0x2b08192b08082b19,
    0x2b08192b19080808,
    0x2b08192b192b0808,
    0x2b082b080808082b,
    0x2b082b1908081908,
    0x2b082b2b08190819,
    0x2b19080808081908,
    0x2b19080808190808,
    0x2b190808082b1908,
    0x2b19080819080808,
    0x2b1908082b2b0819,
    0x2b1908190819192b,
    0x2b1908192b080808,
    0x2b19082b19081919,
    0x2b19190808080808,
    0x2b191908082b082b,
    0x2b19190819081908,
    0x2b19191919190819,
    0x2b192b082b080819,
    0x2b192b19082b0808,
    0x2b2b08080808082b,
    0x2b2b080819190808,
    0x2b2b08082b081919,
    0x2b2b081908082b19,
    0x2b2b082b08080808,
    0x2b2b190808192b08,
    0x2b2b2b0819190808,
    0x2b2b2b1908081908,
];

// ---------------------------------------------------------------------------------------------
// Activation quantizers
// ---------------------------------------------------------------------------------------------

/// Quantizes an activation into Q8_0 form: one f32 scale per 32 values and signed bytes.
///
/// Per block: `d = amax / 127`, `id = 1/d` (0 when `d == 0`), `q = clamp(round_ties_even(x·id),
/// −128, 127)`. `x.len()` should be a multiple of 32; a shorter final block is quantized on its
/// own and its unused `qs` entries are zeroed (as ds4 does). Preconditions: `qs.len()` equals
/// the padded length (`x.len()` rounded up to 32) and `d.len()` the number of blocks; extra
/// input beyond what the outputs can hold is ignored (checked with `debug_assert!`).
pub fn quantize_q8_0(x: &[f32], qs: &mut [i8], d: &mut [f32]) {
    let blocks = x.len().div_ceil(QK8_0);
    debug_assert!(qs.len() >= blocks * QK8_0 && d.len() >= blocks);
    for ((xb, qb), db) in x.chunks(QK8_0).zip(qs.chunks_mut(QK8_0)).zip(d.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        *db = scale;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = ((v * id).round_ties_even() as i32).clamp(-128, 127) as i8;
        }
        for q in qb.iter_mut().skip(xb.len()) {
            *q = 0;
        }
    }
}

/// One Q8_K activation block: 256 signed bytes with an f32 scale and the sums of each 16 bytes.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale: the value of `qs[i]` is `d · qs[i]`.
    pub d: f32,
    /// Quantized values.
    pub qs: [i8; QK_K],
    /// `bsums[j]` = sum of `qs[16j..16j+16]`.
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] }
    }
}

/// Quantizes an activation into Q8_K blocks, following ds4's rule.
///
/// Per block: `max` is the element of largest magnitude (the first one on ties),
/// `iscale = −127 / max`, `q = clamp(round_ties_even(iscale·x), −128, 127)`, `d = 1 / iscale`,
/// so the max element maps to −127 and `d` has the opposite sign of `max`. An all-zero block
/// gets `d = 0` and zero quants. Precondition: `x.len() == out.len() * 256` (checked with
/// `debug_assert!`; otherwise only whole blocks that fit both are written).
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).clamp(-128, 127) as i8;
        }
        for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        y.d = 1.0 / iscale;
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------------------------

/// One Q8_0 block's term: `(f16(d_w)·d_x)·Σ w·x`, the integer sum exact.
#[inline]
fn q8_0_term(b: &[u8], xq: &[i8], dx: f32) -> f32 {
    let isum: i32 = b[2..Q8_0_BYTES].iter().zip(xq).map(|(&w, &x)| i32::from(w as i8) * i32::from(x)).sum();
    le_f16(b, 0) * dx * isum as f32
}

/// Dot product of one Q8_0 weight row (raw blocks) with a Q8_0-quantized activation from
/// [`quantize_q8_0`]: per block `acc += (f16(d_w)·d_x)·Σ w·x` in f32, in block order (ds4's order).
///
/// Preconditions (checked with `debug_assert!`): `row.len()` is a multiple of 34 and `qs`/`d`
/// cover at least `row.len() / 34` blocks. Only whole blocks present in all inputs are used.
pub fn dot_q8_0(row: &[u8], qs: &[i8], d: &[f32]) -> f32 {
    let blocks = row.len() / Q8_0_BYTES;
    debug_assert_eq!(row.len() % Q8_0_BYTES, 0);
    debug_assert!(qs.len() >= blocks * QK8_0 && d.len() >= blocks);
    let mut acc = 0.0f32;
    for ((b, xq), &dx) in row.chunks_exact(Q8_0_BYTES).zip(qs.chunks_exact(QK8_0)).zip(d) {
        acc += q8_0_term(b, xq, dx);
    }
    acc
}

/// [`dot_q8_0`] with the block terms added in the canonical order (`crate::numerics`).
pub fn dot_q8_0_canonical(row: &[u8], qs: &[i8], d: &[f32]) -> f32 {
    let blocks = (row.len() / Q8_0_BYTES).min(qs.len() / QK8_0).min(d.len());
    numerics::sum_blocks(blocks, |b| {
        q8_0_term(&row[b * Q8_0_BYTES..(b + 1) * Q8_0_BYTES], &qs[b * QK8_0..(b + 1) * QK8_0], d[b])
    })
}

/// Dot product of an F16 weight row (raw little-endian bytes) with f32 values, accumulated
/// sequentially in f32. Precondition: `row.len() == 2 * x.len()` (checked with `debug_assert!`;
/// otherwise the shorter length is used).
pub fn dot_f16_f32(row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(row.len(), 2 * x.len());
    let mut acc = 0.0f32;
    for (c, &xi) in row.chunks_exact(2).zip(x) {
        acc += f16_to_f32(u16::from_le_bytes([c[0], c[1]])) * xi;
    }
    acc
}

/// [`dot_f16_f32`] in the canonical order: 8 terms per lane step, chunks of 512.
pub fn dot_f16_f32_canonical(row: &[u8], x: &[f32]) -> f32 {
    const W: usize = numerics::F16_WIDTH;
    const C: usize = numerics::CHUNK;
    let n = (row.len() / 2).min(x.len());
    let full = n / C * C;
    let mut total = 0.0f32;
    // Whole chunks through fixed-size arrays (no bounds checks, independent lanes).
    for (w, xs) in row[..2 * full].chunks_exact(2 * C).zip(x[..full].chunks_exact(C)) {
        let w: &[u8; 2 * C] = w.try_into().expect("chunk");
        let xs: &[f32; C] = xs.try_into().expect("chunk");
        let mut acc = [0.0f32; numerics::LANES];
        for u in 0..C / (W * numerics::LANES) {
            for (l, a) in acc.iter_mut().enumerate() {
                let base = (u * numerics::LANES + l) * W;
                for v in base..base + W {
                    *a += f16_to_f32(u16::from_le_bytes([w[2 * v], w[2 * v + 1]])) * xs[v];
                }
            }
        }
        total += numerics::tree32(acc);
    }
    if n > full {
        let (w, xs) = (&row[2 * full..2 * n], &x[full..n]);
        total += numerics::sum::<W, C>(n - full, |i| f16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) * xs[i]);
    }
    total
}

/// Dot product of an F32 weight row (raw little-endian bytes) with f32 values, accumulated in
/// f64 and rounded to f32 at the end. Precondition: `row.len() == 4 * x.len()` (checked with
/// `debug_assert!`; otherwise the shorter length is used).
pub fn dot_f32_f32(row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(row.len(), 4 * x.len());
    let mut acc = 0.0f64;
    for (c, &xi) in row.chunks_exact(4).zip(x) {
        acc += f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])) * f64::from(xi);
    }
    acc as f32
}

/// [`dot_f32_f32`] in the canonical order, in f32: 4 terms per lane step, chunks of 512.
pub fn dot_f32_f32_canonical(row: &[u8], x: &[f32]) -> f32 {
    let n = (row.len() / 4).min(x.len());
    numerics::sum::<{ numerics::F32_WIDTH }, { numerics::CHUNK }>(n, |i| {
        f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]) * x[i]
    })
}

/// Σ ((q2 >> shift) & 3) · q8 over 16 values.
#[inline(always)]
fn dot_q2_16(q2: &[u8], q8: &[i8], shift: u32) -> i32 {
    q2.iter().zip(q8).map(|(&q, &y)| i32::from((q >> shift) & 3) * i32::from(y)).sum()
}

/// One Q2_K super-block's term: integer sums per 16 values times their 4-bit scale give `isum`,
/// the mins times `bsums` give `summs`, and the term is `(d_y·d)·isum − (d_y·dmin)·summs`.
#[inline]
fn q2_k_term(b: &[u8], y: &BlockQ8K) -> f32 {
    let sc = &b[0..16];
    let qs = &b[16..80];
    let summs: i32 = sc.iter().zip(&y.bsums).map(|(&s, &bs)| i32::from(s >> 4) * i32::from(bs)).sum();
    let dall = y.d * le_f16(b, 80);
    let dmin = y.d * le_f16(b, 82);
    let mut isum = 0i32;
    for half in 0..2 {
        let q2 = &qs[32 * half..32 * half + 32];
        for j in 0..4 {
            let shift = 2 * j as u32;
            let q8 = &y.qs[128 * half + 32 * j..][..32];
            let lo = dot_q2_16(&q2[..16], &q8[..16], shift);
            let hi = dot_q2_16(&q2[16..], &q8[16..], shift);
            isum += i32::from(sc[8 * half + 2 * j] & 0x0f) * lo;
            isum += i32::from(sc[8 * half + 2 * j + 1] & 0x0f) * hi;
        }
    }
    dall * isum as f32 - dmin * summs as f32
}

/// One Q4_K super-block's term: integer sums per 32 values times their 6-bit scale give `isum`,
/// the 6-bit mins times the pairwise `bsums` give `summs`; `(d_y·d)·isum − (d_y·dmin)·summs`.
#[inline]
fn q4_k_term(b: &[u8], y: &BlockQ8K) -> f32 {
    let d = y.d * le_f16(b, 0);
    let dmin = y.d * le_f16(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..Q4_K_BYTES];
    let mut isum = 0i32;
    let mut summs = 0i32;
    for c in 0..4 {
        let q4 = &qs[32 * c..32 * c + 32];
        let q8 = &y.qs[64 * c..64 * c + 64];
        let (sc1, m1) = q4_k_scale_min(2 * c, scales);
        let (sc2, m2) = q4_k_scale_min(2 * c + 1, scales);
        let lo: i32 = q4.iter().zip(&q8[..32]).map(|(&q, &v)| i32::from(q & 0x0f) * i32::from(v)).sum();
        let hi: i32 = q4.iter().zip(&q8[32..]).map(|(&q, &v)| i32::from(q >> 4) * i32::from(v)).sum();
        isum += i32::from(sc1) * lo + i32::from(sc2) * hi;
        let bs = &y.bsums[4 * c..4 * c + 4];
        summs += i32::from(m1) * (i32::from(bs[0]) + i32::from(bs[1]));
        summs += i32::from(m2) * (i32::from(bs[2]) + i32::from(bs[3]));
    }
    d * isum as f32 - dmin * summs as f32
}

/// One IQ2_XXS super-block's term: per 32 values the signed grid values times the quants summed
/// in integers, times the odd scale `2s + 1`; the term is `(f16(d)·d_y)·Σ` (the row's sum is
/// multiplied by 0.125 at the end).
#[inline]
fn iq2_xxs_term(b: &[u8], y: &BlockQ8K) -> f32 {
    let d = le_f16(b, 0) * y.d;
    let qs = &b[2..IQ2_XXS_BYTES];
    let mut bsum = 0i32;
    for ib in 0..QK_K / 32 {
        let g = &qs[8 * ib..8 * ib + 8];
        let aux = u32::from_le_bytes([g[4], g[5], g[6], g[7]]);
        let ls = (2 * (aux >> 28) + 1) as i32;
        let mut sumi = 0i32;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[usize::from(g[l])].to_le_bytes();
            let signs = &SIGNS_I8[((aux >> (7 * l)) & 127) as usize];
            let q8 = &y.qs[32 * ib + 8 * l..][..8];
            for j in 0..8 {
                sumi += i32::from(grid[j]) * i32::from(signs[j]) * i32::from(q8[j]);
            }
        }
        bsum += sumi * ls;
    }
    d * bsum as f32
}

/// Sums a row's super-block terms in ds4's order (sequentially) or the canonical one.
fn sum_k_terms(row: &[u8], y: &[BlockQ8K], bytes: usize, canonical: bool, term: fn(&[u8], &BlockQ8K) -> f32) -> f32 {
    let blocks = (row.len() / bytes).min(y.len());
    if canonical {
        numerics::sum_blocks(blocks, |b| term(&row[b * bytes..(b + 1) * bytes], &y[b]))
    } else {
        let mut sumf = 0.0f32;
        for b in 0..blocks {
            sumf += term(&row[b * bytes..(b + 1) * bytes], &y[b]);
        }
        sumf
    }
}

/// Dot product of one Q2_K weight row (raw blocks) with Q8_K activation blocks, in ds4's order.
/// Precondition: `row.len() == 84 * y.len()` (checked with `debug_assert!`; otherwise only
/// blocks present in both are used).
pub fn dot_q2_k_q8_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(row.len(), Q2_K_BYTES * y.len());
    sum_k_terms(row, y, Q2_K_BYTES, false, q2_k_term)
}

/// Dot product of one Q4_K weight row (raw blocks) with Q8_K activation blocks, in ds4's order.
/// Precondition: `row.len() == 144 * y.len()` (checked with `debug_assert!`).
pub fn dot_q4_k_q8_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(row.len(), Q4_K_BYTES * y.len());
    sum_k_terms(row, y, Q4_K_BYTES, false, q4_k_term)
}

/// Dot product of one IQ2_XXS weight row (raw blocks) with Q8_K activation blocks, in ds4's
/// order; the result is `0.125·Σ`. Precondition: `row.len() == 66 * y.len()` (checked with
/// `debug_assert!`).
pub fn dot_iq2_xxs_q8_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(row.len(), IQ2_XXS_BYTES * y.len());
    0.125 * sum_k_terms(row, y, IQ2_XXS_BYTES, false, iq2_xxs_term)
}

/// [`dot_q2_k_q8_k`] with the block terms in the canonical order.
pub fn dot_q2_k_q8_k_canonical(row: &[u8], y: &[BlockQ8K]) -> f32 {
    sum_k_terms(row, y, Q2_K_BYTES, true, q2_k_term)
}

/// [`dot_q4_k_q8_k`] with the block terms in the canonical order.
pub fn dot_q4_k_q8_k_canonical(row: &[u8], y: &[BlockQ8K]) -> f32 {
    sum_k_terms(row, y, Q4_K_BYTES, true, q4_k_term)
}

/// [`dot_iq2_xxs_q8_k`] with the block terms in the canonical order.
pub fn dot_iq2_xxs_q8_k_canonical(row: &[u8], y: &[BlockQ8K]) -> f32 {
    0.125 * sum_k_terms(row, y, IQ2_XXS_BYTES, true, iq2_xxs_term)
}

// ---------------------------------------------------------------------------------------------
// Decoded rows: one weight row against many activations (a prefill chunk)
// ---------------------------------------------------------------------------------------------

/// Up to 8 quantized activations (rows of a prefill chunk) laid out for
/// [`DecodedRow::dot_rows8`]: per block, the 8 rows' quants (widened to i16) one after another,
/// so that a decoded weight block is dotted with all 8 while it is in registers. Rows past the
/// ones given are zeros; their results are to be ignored.
#[derive(Default, Clone)]
pub struct QuantRows8 {
    /// Values per block: 32 (Q8_0) or 256 (Q8_K).
    block: usize,
    /// `[block][row][value]`.
    q: Vec<i16>,
    /// `[block][row]`: the block's scale.
    d: Vec<[f32; 8]>,
    /// `[block][row][16]` (Q8_K): the sums of each 16 quants.
    bsums: Vec<i16>,
}

impl QuantRows8 {
    fn reset(&mut self, block: usize, blocks: usize) {
        self.block = block;
        self.q.clear();
        self.q.resize(blocks * 8 * block, 0);
        self.d.clear();
        self.d.resize(blocks, [0.0; 8]);
        self.bsums.clear();
    }

    /// Up to 8 Q8_0 activations from [`quantize_q8_0`]: each a pair (quants, scales) of
    /// `blocks` blocks.
    pub fn set_q8_0(&mut self, rows: &[(&[i8], &[f32])]) {
        assert!(rows.len() <= 8, "at most 8 rows");
        let blocks = rows.first().map_or(0, |r| r.1.len());
        self.reset(QK8_0, blocks);
        for (j, &(qs, d)) in rows.iter().enumerate() {
            for b in 0..blocks {
                self.d[b][j] = d[b];
                let dst = &mut self.q[(b * 8 + j) * QK8_0..][..QK8_0];
                for (o, &v) in dst.iter_mut().zip(&qs[b * QK8_0..(b + 1) * QK8_0]) {
                    *o = i16::from(v);
                }
            }
        }
    }

    /// Up to 8 Q8_K activations from [`quantize_q8_k`], of the same number of blocks.
    pub fn set_q8_k(&mut self, rows: &[&[BlockQ8K]]) {
        assert!(rows.len() <= 8, "at most 8 rows");
        let blocks = rows.first().map_or(0, |r| r.len());
        self.reset(QK_K, blocks);
        self.bsums.resize(blocks * 8 * 16, 0);
        for (j, y) in rows.iter().enumerate() {
            for (b, yb) in y[..blocks].iter().enumerate() {
                self.d[b][j] = yb.d;
                for (o, &v) in self.q[(b * 8 + j) * QK_K..][..QK_K].iter_mut().zip(&yb.qs) {
                    *o = i16::from(v);
                }
                self.bsums[(b * 8 + j) * 16..][..16].copy_from_slice(&yb.bsums);
            }
        }
    }
}

/// The exact integer dots of one weight block `w` (a multiple of 16 values) with the 8 rows'
/// blocks in `x` (row `j` at `j · w.len()`, [`QuantRows8`]'s layout).
#[inline(always)]
fn isum8_portable(w: &[i16], x: &[i16]) -> [i32; 8] {
    let mut out = [0i32; 8];
    for (o, xj) in out.iter_mut().zip(x.chunks_exact(w.len())) {
        *o = idot_portable(w, xj);
    }
    out
}

/// [`isum8_portable`] with AVX2's 16-bit multiply-add (16 products per instruction, adjacent
/// pairs summed into 32 bits): each 16 weights are loaded once for the 8 rows. Integer sums are
/// exact in any order, and the quant formats keep every pair's sum far inside i32.
///
/// Safety: the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn isum8_avx2(w: &[i16], x: &[i16]) -> [i32; 8] {
    use std::arch::x86_64::*;
    let block = w.len();
    assert!(block.is_multiple_of(16) && x.len() >= 8 * block);
    let mut acc = [_mm256_setzero_si256(); 8];
    for i in (0..block).step_by(16) {
        // SAFETY: values i .. i + 16 of `w` and j·block + i .. + 16 of `x` exist (the lengths
        // are checked above); the loads are unaligned.
        unsafe {
            let wv = _mm256_loadu_si256(w.as_ptr().add(i) as *const __m256i);
            for (j, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_si256(x.as_ptr().add(j * block + i) as *const __m256i);
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(wv, xv));
            }
        }
    }
    // The 8 accumulators' horizontal sums into one vector, lane j = row j: pairwise adds (within
    // 128-bit halves), then the two halves added.
    let h01 = _mm256_hadd_epi32(acc[0], acc[1]);
    let h23 = _mm256_hadd_epi32(acc[2], acc[3]);
    let h45 = _mm256_hadd_epi32(acc[4], acc[5]);
    let h67 = _mm256_hadd_epi32(acc[6], acc[7]);
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    let lo = _mm256_permute2x128_si256::<0x20>(h0123, h4567);
    let hi = _mm256_permute2x128_si256::<0x31>(h0123, h4567);
    let mut out = [0i32; 8];
    // SAFETY: `out` holds 8 i32 (32 bytes); the store is unaligned.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, _mm256_add_epi32(lo, hi)) };
    out
}

fn idot_portable(a: &[i16], b: &[i16]) -> i32 {
    // Fixed-size pieces of 16 so that the compiler keeps whole vectors of products.
    let mut acc = [0i32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let x: &[i16; 16] = x.try_into().expect("16");
        let y: &[i16; 16] = y.try_into().expect("16");
        for k in 0..16 {
            acc[k] += i32::from(x[k]) * i32::from(y[k]);
        }
    }
    acc.iter().sum::<i32>() + ra.iter().zip(rb).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum::<i32>()
}
/// An F16 row converted to f32 (exact), dotted with 8 inputs at once in ds4's order (each sum
/// sequential from 0, as [`dot_f16_f32`]): `x8[i·8 + j]` is term `i` of input `j`, so the 8 sums
/// advance side by side (vector instructions) and each has [`dot_f16_f32`]'s bits.
pub fn dot_f16_rows8(w: &[f32], x8: &[f32], out: &mut [f32; 8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { dot_f16_rows8_avx2(w, x8, out) };
    }
    dot_f16_rows8_portable(w, x8, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_f16_rows8_avx2(w: &[f32], x8: &[f32], out: &mut [f32; 8]) {
    dot_f16_rows8_portable(w, x8, out)
}

#[inline(always)]
fn dot_f16_rows8_portable(w: &[f32], x8: &[f32], out: &mut [f32; 8]) {
    let mut acc = [0.0f32; 8];
    for (&wi, xi) in w.iter().zip(x8.chunks_exact(8)) {
        let xi: &[f32; 8] = xi.try_into().expect("8 inputs");
        for j in 0..8 {
            acc[j] += wi * xi[j];
        }
    }
    *out = acc;
}

/// A canonical F16 dot's terms in lane order: inside each whole step of 256 terms (8 terms for
/// each of the 32 lanes; a 512-term chunk is two steps), term `l·8 + k` (lane `l`'s `k`-th term)
/// moves to `k·32 + l`, so the 32 lane sums advance side by side over contiguous values (vector
/// instructions) while each lane still adds its own terms in increasing order. The terms after
/// the last whole step keep their order.
pub fn to_lane_major(v: &[f32], out: &mut [f32]) {
    const W: usize = numerics::F16_WIDTH;
    const L: usize = numerics::LANES;
    let steps = v.len() / (W * L) * (W * L);
    for (src, dst) in v[..steps].chunks_exact(W * L).zip(out[..steps].chunks_exact_mut(W * L)) {
        for l in 0..L {
            for k in 0..W {
                dst[k * L + l] = src[l * W + k];
            }
        }
    }
    out[steps..v.len()].copy_from_slice(&v[steps..]);
}

/// [`dot_f16_f32_canonical`] of a row converted to f32 and a vector, both in lane order
/// ([`to_lane_major`]): the same terms added in the same order, so the same bits. (The pair's
/// code with the vector twice: it serves the odd last row of a chunk.)
pub fn dot_lane_major(w: &[f32], x: &[f32]) -> f32 {
    dot_lane_major2(w, x, x)[0]
}

/// [`dot_lane_major`] of one row with two vectors at once: the row is read once for both, and
/// the two vectors' 32 lane sums (independent additions) advance side by side.
pub fn dot_lane_major2(w: &[f32], a: &[f32], b: &[f32]) -> [f32; 2] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { dot_lane_major2_avx2(w, a, b) };
    }
    dot_lane_major2_portable(w, a, b)
}

/// The same code compiled for AVX2: 8 lanes per instruction. Each product and sum still rounds
/// on its own (Rust never contracts `a * b + c` into a fused multiply-add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_lane_major2_avx2(w: &[f32], a: &[f32], b: &[f32]) -> [f32; 2] {
    dot_lane_major2_portable(w, a, b)
}

#[inline(always)]
fn dot_lane_major2_portable(w: &[f32], a: &[f32], b: &[f32]) -> [f32; 2] {
    const W: usize = numerics::F16_WIDTH;
    const C: usize = numerics::CHUNK;
    const L: usize = numerics::LANES;
    let n = w.len().min(a.len()).min(b.len());
    let steps = n / (W * L) * (W * L);
    let mut total = [0.0f32; 2];
    let mut c0 = 0;
    while c0 < n {
        let end = (c0 + C).min(n);
        let (mut sa, mut sb) = ([0.0f32; L], [0.0f32; L]);
        // The chunk's whole steps in lane order, then the terms after the last one (in the last
        // chunk only) in their order, each to its lane.
        let le = end.min(steps).max(c0);
        let rows = w[c0..le].chunks_exact(L).zip(a[c0..le].chunks_exact(L)).zip(b[c0..le].chunks_exact(L));
        for ((wr, ar), br) in rows {
            let wr: &[f32; L] = wr.try_into().expect("lane row");
            let ar: &[f32; L] = ar.try_into().expect("lane row");
            let br: &[f32; L] = br.try_into().expect("lane row");
            for l in 0..L {
                sa[l] += wr[l] * ar[l];
                sb[l] += wr[l] * br[l];
            }
        }
        for i in le..end {
            sa[((i - c0) / W) % L] += w[i] * a[i];
            sb[((i - c0) / W) % L] += w[i] * b[i];
        }
        total[0] += numerics::tree32(sa);
        total[1] += numerics::tree32(sb);
        c0 = end;
    }
    total
}

/// A weight row decoded once for dots with many activations (the rows of a prefill chunk), where
/// the row dots above would decode it again for each. Per block: the integer weights, with the
/// block's small integer scales folded in where its integer sum allows (`Σ s·Σ w·x = Σ (s·w)·x`,
/// exact), and the float factors. Each dot gives the bits of the type's row dot: the integer sums
/// are exact in any order, the float terms are the same expressions, added in the same order.
#[derive(Default)]
pub struct DecodedRow {
    ty: Option<GgmlType>,
    /// Weights, `block_elems` per block.
    w: Vec<i16>,
    /// Per block: the f16 scale (Q8_0, IQ2_XXS) or `d` (Q2_K).
    d: Vec<f32>,
    /// Per block (Q2_K): `dmin`.
    dmin: Vec<f32>,
    /// Per block (Q2_K): the 16 4-bit mins.
    mins: Vec<i16>,
}

impl DecodedRow {
    /// Whether rows of `ty` have a decoded form.
    pub fn supports(ty: GgmlType) -> bool {
        matches!(ty, GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::IQ2_XXS)
    }

    /// Decodes `row`, a row of `ty` (one that [`DecodedRow::supports`]).
    pub fn load(&mut self, ty: GgmlType, row: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { self.load_avx2(ty, row) };
        }
        self.load_portable(ty, row)
    }

    /// The same code compiled for AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn load_avx2(&mut self, ty: GgmlType, row: &[u8]) {
        self.load_portable(ty, row)
    }

    /// The inner loops run over fixed-size pieces, so that they compile to vector instructions.
    #[inline(always)]
    fn load_portable(&mut self, ty: GgmlType, row: &[u8]) {
        let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
        let blocks = row.len() / bytes;
        self.ty = Some(ty);
        self.w.resize(blocks * elems, 0);
        self.d.resize(blocks, 0.0);
        self.dmin.resize(blocks, 0.0);
        self.mins.resize(blocks * 16, 0);
        for (i, (b, w)) in row.chunks_exact(bytes).zip(self.w.chunks_exact_mut(elems)).enumerate() {
            match ty {
                GgmlType::Q8_0 => {
                    self.d[i] = le_f16(b, 0);
                    let (w, q): (&mut [i16; QK8_0], &[u8; QK8_0]) =
                        (w.try_into().expect("block"), b[2..Q8_0_BYTES].try_into().expect("block"));
                    for k in 0..QK8_0 {
                        w[k] = i16::from(q[k] as i8);
                    }
                }
                GgmlType::Q2_K => {
                    let (sc, qs) = (&b[0..16], &b[16..80]);
                    self.d[i] = le_f16(b, 80);
                    self.dmin[i] = le_f16(b, 82);
                    for (m, &s) in self.mins[i * 16..(i + 1) * 16].iter_mut().zip(sc) {
                        *m = i16::from(s >> 4);
                    }
                    // Value k of the 32 at (half, j) is bits 2j of qs[32·half + k], scaled by the
                    // 4-bit scale of its 16 (`q2_k_term`'s layout).
                    for (half, w128) in w.chunks_exact_mut(128).enumerate() {
                        let q: &[u8; 32] = qs[32 * half..32 * half + 32].try_into().expect("32");
                        for (j, w32) in w128.chunks_exact_mut(32).enumerate() {
                            let w32: &mut [i16; 32] = w32.try_into().expect("32");
                            let (s0, s1) = (sc[8 * half + 2 * j] & 0x0f, sc[8 * half + 2 * j + 1] & 0x0f);
                            for k in 0..32 {
                                let s = if k < 16 { s0 } else { s1 };
                                w32[k] = i16::from((q[k] >> (2 * j)) & 3) * i16::from(s);
                            }
                        }
                    }
                }
                GgmlType::IQ2_XXS => {
                    self.d[i] = le_f16(b, 0);
                    let qs = &b[2..IQ2_XXS_BYTES];
                    for (g, w32) in qs.chunks_exact(8).zip(w.chunks_exact_mut(32)) {
                        let aux = u32::from_le_bytes([g[4], g[5], g[6], g[7]]);
                        let ls = (2 * (aux >> 28) + 1) as i16;
                        for (l, w8) in w32.chunks_exact_mut(8).enumerate() {
                            let w8: &mut [i16; 8] = w8.try_into().expect("8");
                            let grid = IQ2XXS_GRID[usize::from(g[l])].to_le_bytes();
                            let signs = &SIGNS_I8[((aux >> (7 * l)) & 127) as usize];
                            for j in 0..8 {
                                w8[j] = i16::from(grid[j]) * i16::from(signs[j]) * ls;
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// The row's dot with each of 8 activations (`x`, of the type's activation format: Q8_0 for a
    /// Q8_0 row, Q8_K for Q2_K and IQ2_XXS), with the bits of the row dot ([`dot_q8_0`],
    /// [`dot_q2_k_q8_k`], [`dot_iq2_xxs_q8_k`] or their canonical forms): per block the 8 integer
    /// sums, then the 8 float terms side by side, each the row dot's expression, added in its order.
    pub fn dot_rows8(&self, x: &QuantRows8, canonical: bool) -> [f32; 8] {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { self.dot_rows8_avx2(x, canonical) };
        }
        self.dot_rows8_with(x, canonical, isum8_portable)
    }

    /// [`DecodedRow::dot_rows8`] compiled for AVX2 (the 8 rows' float terms in one vector), with
    /// [`isum8_avx2`]. Each product and sum still rounds on its own (Rust never contracts
    /// `a * b + c` into a fused multiply-add).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_rows8_avx2(&self, x: &QuantRows8, canonical: bool) -> [f32; 8] {
        // SAFETY: the CPU has AVX2 (this function's caller checked).
        self.dot_rows8_with(x, canonical, |w, x| unsafe { isum8_avx2(w, x) })
    }

    #[inline(always)]
    fn dot_rows8_with(&self, x: &QuantRows8, canonical: bool, isum8: impl Fn(&[i16], &[i16]) -> [i32; 8]) -> [f32; 8] {
        const L: usize = numerics::LANES;
        let e = x.block;
        let blocks = self.d.len().min(x.d.len());
        debug_assert_eq!(Some(e), self.ty.map(GgmlType::block_elems));
        let mut total = [0.0f32; 8];
        // Canonical order (`numerics::sum_blocks`): block b's term in lane b % 32 of its chunk of
        // 32 blocks, the chunk's lanes combined by the butterfly and added to the total.
        let mut lanes = [[0.0f32; 8]; L];
        for b in 0..blocks {
            let isum = isum8(&self.w[b * e..(b + 1) * e], &x.q[b * 8 * e..(b + 1) * 8 * e]);
            let (wd, xd) = (self.d[b], &x.d[b]);
            let mut t = [0.0f32; 8];
            match self.ty {
                Some(GgmlType::Q8_0) | Some(GgmlType::IQ2_XXS) => {
                    for j in 0..8 {
                        t[j] = wd * xd[j] * isum[j] as f32;
                    }
                }
                Some(GgmlType::Q2_K) => {
                    let summs = isum8(&self.mins[b * 16..(b + 1) * 16], &x.bsums[b * 8 * 16..(b + 1) * 8 * 16]);
                    for j in 0..8 {
                        let dall = xd[j] * wd;
                        let dmin = xd[j] * self.dmin[b];
                        t[j] = dall * isum[j] as f32 - dmin * summs[j] as f32;
                    }
                }
                _ => return [f32::NAN; 8],
            }
            if canonical {
                let lane = &mut lanes[b % L];
                for j in 0..8 {
                    lane[j] += t[j];
                }
                if b % L == L - 1 || b + 1 == blocks {
                    let mut o = L / 2;
                    while o > 0 {
                        for l in 0..o {
                            let high = lanes[l + o];
                            for (v, h) in lanes[l].iter_mut().zip(high) {
                                *v += h;
                            }
                        }
                        o /= 2;
                    }
                    for (s, &v) in total.iter_mut().zip(&lanes[0]) {
                        *s += v;
                    }
                    lanes = [[0.0f32; 8]; L];
                }
            } else {
                for j in 0..8 {
                    total[j] += t[j];
                }
            }
        }
        if self.ty == Some(GgmlType::IQ2_XXS) {
            // `0.125 * sum`, as the row dot (the product is the same either way round).
            for v in &mut total {
                *v *= 0.125;
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 stream: test data that is the same on every run.
    fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// A random F16 row of `n` values in [-1, 1]: its bytes and its values as f32.
    fn f16_row(n: usize, next: &mut impl FnMut() -> u64) -> (Vec<u8>, Vec<f32>) {
        let w16: Vec<u16> = (0..n).map(|_| f32_to_f16((next() % 20001) as f32 / 10000.0 - 1.0)).collect();
        (w16.iter().flat_map(|h| h.to_le_bytes()).collect(), w16.iter().map(|&h| f16_to_f32(h)).collect())
    }

    /// Eight interleaved F16 dots have the bits of eight sequential ones.
    #[test]
    fn interleaved_f16_dots_equal_the_sequential_dot() {
        let mut next = xorshift(0x1234_5678_9abc_def1);
        for n in [1usize, 7, 512, 1000] {
            let (bytes, w32) = f16_row(n, &mut next);
            let xs: Vec<Vec<f32>> =
                (0..8).map(|_| (0..n).map(|_| (next() % 2_000_001) as f32 / 1_000_000.0 - 1.0).collect()).collect();
            let x8: Vec<f32> = (0..n).flat_map(|i| xs.iter().map(move |x| x[i])).collect();
            let mut out = [0.0f32; 8];
            dot_f16_rows8(&w32, &x8, &mut out);
            for (j, x) in xs.iter().enumerate() {
                assert_eq!(out[j].to_bits(), dot_f16_f32(&bytes, x).to_bits(), "n = {n}, input {j}");
            }
        }
    }

    /// Lane-order F16 dots have the bits of the canonical F16 dot for whole and short chunks.
    #[test]
    fn lane_major_dots_equal_the_canonical_f16_dot() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for n in [8usize, 256, 264, 300, 504, 512, 768, 868, 1024, 1536 + 8, 4096, 16384 + 136] {
            let (bytes, w32) = f16_row(n, &mut next);
            let x: Vec<f32> = (0..n).map(|_| ((next() % 2_000_001) as f32 / 1_000_000.0 - 1.0) * 3.0).collect();
            let (mut wt, mut xt) = (vec![0.0; n], vec![0.0; n]);
            to_lane_major(&w32, &mut wt);
            to_lane_major(&x, &mut xt);
            let want = dot_f16_f32_canonical(&bytes, &x);
            assert_eq!(dot_lane_major(&wt, &xt).to_bits(), want.to_bits(), "n = {n}");
            let (mut x2, mut x2t) = (x.clone(), vec![0.0; n]);
            x2.reverse();
            to_lane_major(&x2, &mut x2t);
            let want2 = [want, dot_f16_f32_canonical(&bytes, &x2)].map(f32::to_bits);
            assert_eq!(dot_lane_major2(&wt, &xt, &x2t).map(f32::to_bits), want2, "n = {n}");
            assert_eq!(dot_lane_major2_portable(&wt, &xt, &x2t).map(f32::to_bits), want2, "n = {n}");
        }
    }

    /// The integer block dots for 8 rows (portable, and AVX2 where the CPU has it) equal the
    /// plain loop, for the block sizes used and the extremes the formats reach.
    #[test]
    fn integer_dots_equal_the_plain_loop() {
        type Kernel<'k> = &'k dyn Fn(&[i16], &[i16]) -> [i32; 8];
        let kernels = |w: &[i16], x: &[i16], block: usize, blocks: usize| -> Vec<Vec<[i32; 8]>> {
            let per_block = |k: Kernel| -> Vec<[i32; 8]> {
                (0..blocks).map(|b| k(&w[b * block..(b + 1) * block], &x[b * 8 * block..(b + 1) * 8 * block])).collect()
            };
            let mut outs = vec![per_block(&|w, x| isum8_portable(w, x))];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                outs.push(per_block(&|w, x| unsafe { isum8_avx2(w, x) }));
            }
            outs
        };
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for block in [16usize, 32, 256] {
            for range in [128i64, 2048, 16384] {
                let blocks = 5;
                let w: Vec<i16> = (0..blocks * block).map(|_| (next() as i64 % range) as i16).collect();
                let x: Vec<i16> = (0..blocks * 8 * block).map(|_| (next() as i64 % range) as i16).collect();
                for out in kernels(&w, &x, block, blocks) {
                    for (b, o) in out.iter().enumerate() {
                        for (j, &s) in o.iter().enumerate() {
                            let (wb, xb) = (&w[b * block..(b + 1) * block], &x[(b * 8 + j) * block..][..block]);
                            let plain: i32 = wb.iter().zip(xb).map(|(&p, &q)| i32::from(p) * i32::from(q)).sum();
                            assert_eq!(s, plain, "block {block}, range {range}");
                        }
                    }
                }
            }
        }
        let w: Vec<i16> = (0..32).map(|i| (i * 37 % 255) as i16 - 127).collect();
        let plain: i32 = w.iter().map(|&v| i32::from(v) * -128).sum();
        for out in kernels(&w, &[-128i16; 32 * 8], 32, 1) {
            assert_eq!(out[0], [plain; 8]);
        }
    }

    #[test]
    fn f16_to_f32_matches_half_for_every_input() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
                assert_eq!(ours.is_sign_negative(), theirs.is_sign_negative());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn f32_to_f16_round_trips_and_rounds_to_even() {
        for h in 0..=u16::MAX {
            let f = half::f16::from_bits(h).to_f32();
            if !f.is_nan() {
                assert_eq!(f32_to_f16(f), h);
            }
        }
        // 1 + 2^-11 lies halfway between 1 and the next half (1 + 2^-10): ties go to even.
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02);
        assert_eq!(f32_to_f16(1.0e6), 0x7c00);
        assert_eq!(f32_to_f16(f32::NAN), 0x7e00);
        assert_eq!(f32_to_f16(-f32::NAN), 0xfe00);
        assert_eq!(round_f16(0.1), half::f16::from_f32(0.1).to_f32());
    }

    #[test]
    fn sign_table_has_even_parity_and_known_entries() {
        for (s, &v) in KSIGNS_IQ2XS.iter().enumerate() {
            assert_eq!(usize::from(v & 127), s);
            assert_eq!(v.count_ones() % 2, 0);
            let neg = SIGNS_I8[s].iter().filter(|&&x| x == -1).count();
            assert_eq!(neg as u32, v.count_ones());
        }
        // Spot values of ggml's ksigns_iq2xs.
        assert_eq!(KSIGNS_IQ2XS[0], 0);
        assert_eq!(KSIGNS_IQ2XS[1], 129);
        assert_eq!(KSIGNS_IQ2XS[3], 3);
        assert_eq!(KSIGNS_IQ2XS[16], 144);
        assert_eq!(KSIGNS_IQ2XS[127], 255);
    }

    #[test]
    fn grid_values_are_the_three_magnitudes_and_distinct() {
        for &g in IQ2XXS_GRID.iter() {
            for b in g.to_le_bytes() {
                assert!(matches!(b, 0x08 | 0x19 | 0x2b), "{g:#018x}");
            }
        }
        let mut sorted = IQ2XXS_GRID.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        // The table is stored sorted ascending, as in ggml.
        assert!(IQ2XXS_GRID.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn q4_k_scale_unpacking() {
        // Pack known 6-bit scales/mins with the inverse of the unpacking rule and read them back.
        let sc: [u8; 8] = [1, 63, 17, 40, 33, 62, 5, 48];
        let mn: [u8; 8] = [63, 0, 21, 44, 9, 31, 60, 2];
        let mut p = [0u8; 12];
        for j in 0..4 {
            p[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            p[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            p[j + 8] = (sc[j + 4] & 0x0f) | ((mn[j + 4] & 0x0f) << 4);
        }
        for j in 0..8 {
            assert_eq!(q4_k_scale_min(j, &p), (sc[j], mn[j]), "sub-block {j}");
        }
    }
}
