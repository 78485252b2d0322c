//! What the GPU backends derive from a program that is not specific to one GPU API: the RoPE
//! (cos, sin) tables, the Q8_0 repacking, the IQ2_XXS grid as bytes and the attention scale.
//! The wgpu backend uses these; the CUDA backend has its own copies (backends/cuda/mod.rs:
//! `repack_q8_0`, the RoPE table loop in `CudaExecutable::new`; plan.rs: `attention_kq_scale`)
//! until it is switched to this module.

use crate::model::RopeParams;
use crate::quant::IQ2XXS_GRID;

/// (cos, sin) per position and pair for `positions` positions, interleaved, computed by the
/// very function the CPU reference rotates with.
pub fn rope_table(rope: &RopeParams, n_rot: u32, positions: u32) -> Vec<f32> {
    let pairs = n_rot as usize / 2;
    let mut table = vec![0f32; positions as usize * pairs * 2];
    let mut cs = vec![(0f32, 0f32); pairs];
    for (pos, chunk) in table.chunks_exact_mut(pairs * 2).enumerate() {
        rope.cos_sin(pos as u32, n_rot as usize, &mut cs);
        for (k, &(c, s)) in cs.iter().enumerate() {
            chunk[2 * k] = c;
            chunk[2 * k + 1] = s;
        }
    }
    table
}

/// Q8_0 blocks as the GPU kernels read them: all quants first (32 bytes per block), then all the
/// f16 scales. GGUF's 34-byte blocks are only 2-byte aligned. Same bytes, reordered.
pub fn repack_q8_0(data: &[u8]) -> Vec<u8> {
    let blocks = data.len() / 34;
    let mut out = vec![0u8; blocks * 34];
    let (quants, scales) = out.split_at_mut(blocks * 32);
    for (i, b) in data.chunks_exact(34).enumerate() {
        scales[2 * i..2 * i + 2].copy_from_slice(&b[..2]);
        quants[32 * i..32 * i + 32].copy_from_slice(&b[2..]);
    }
    out
}

/// The IQ2_XXS grid (256 entries of 8 bytes), little-endian.
pub fn iq2_xxs_grid_bytes() -> Vec<u8> {
    IQ2XXS_GRID.iter().flat_map(|g| g.to_le_bytes()).collect()
}

/// `1 / sqrt(head_dim)`, as the CPU computes it (IEEE division and square root).
pub fn attention_kq_scale(head_dim: u32) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repacked_q8_0_keeps_every_byte() {
        let data: Vec<u8> = (0..3 * 34).map(|i| (i * 7 % 251) as u8).collect();
        let r = repack_q8_0(&data);
        for b in 0..3 {
            assert_eq!(&r[32 * b..32 * b + 32], &data[34 * b + 2..34 * b + 34]);
            assert_eq!(&r[96 + 2 * b..96 + 2 * b + 2], &data[34 * b..34 * b + 2]);
        }
    }
}
