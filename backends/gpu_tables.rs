//! What the GPU backends derive from a program that is not specific to one GPU API: the RoPE
//! (cos, sin) tables, the split layout of block-quantized weights, the IQ2_XXS grid as bytes and
//! the attention scale. Both the CUDA and the wgpu backend use these.

use crate::model::RopeParams;
use crate::quant::{GgmlType, IQ2XXS_GRID};

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

/// How the GPU kernels lay out a block-quantized weight (repacked at upload or drawn so on the
/// device; the wgpu backend repacks only Q8_0 for now): the quants of every block first, `quants` bytes from byte `quants_at` of each block,
/// 16-byte aligned; then the rest of each block (its scales), in the block's own order. GGUF's
/// blocks (34, 66, 84 or 144 bytes) are only 2- or 4-byte aligned. (type, block bytes, quants_at,
/// quants.)
pub const BLOCK_SPLITS: [(GgmlType, u32, u32, u32); 4] = [
    (GgmlType::Q8_0, 34, 2, 32),
    (GgmlType::IQ2_XXS, 66, 2, 64),
    (GgmlType::Q2_K, 84, 16, 64),
    (GgmlType::Q4_K, 144, 16, 128),
];

/// Where the GPU kernels find the bytes of a block-quantized weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockLayout {
    /// Repacked at upload, or drawn so on the device ([`BLOCK_SPLITS`]): aligned wide loads.
    Split,
    /// GGUF's own blocks, read in place from the file's pages (unified placement: no copy).
    Native,
}

/// The split layout of a type, if the kernels repack it: (block bytes, quants_at, quants).
pub fn block_split(ty: GgmlType) -> Option<(usize, usize, usize)> {
    BLOCK_SPLITS.iter().find(|s| s.0 == ty).map(|s| (s.1 as usize, s.2 as usize, s.3 as usize))
}

/// Reorders GGUF blocks of `ty` into the split layout ([`BLOCK_SPLITS`]); other types come back
/// unchanged. Same bytes, reordered: the values and so the results do not change.
pub fn repack_blocks(ty: GgmlType, data: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if block_split(ty).is_none() {
        return std::borrow::Cow::Borrowed(data);
    }
    let mut out = vec![0u8; data.len()];
    repack_blocks_into(ty, data, &mut out);
    std::borrow::Cow::Owned(out)
}

/// [`repack_blocks`] into `out` (as long as `data`), for example page-locked host memory.
pub fn repack_blocks_into(ty: GgmlType, data: &[u8], out: &mut [u8]) {
    let Some((bb, at, nq)) = block_split(ty) else {
        out.copy_from_slice(data);
        return;
    };
    use rayon::prelude::*;
    let blocks = data.len() / bb;
    let (quants, rest) = out[..blocks * bb].split_at_mut(blocks * nq);
    let nr = bb - nq;
    // In runs of blocks on every core: a model's weights are gigabytes.
    const RUN: usize = 4096;
    quants.par_chunks_mut(RUN * nq).zip(rest.par_chunks_mut(RUN * nr)).zip(data.par_chunks(RUN * bb)).for_each(
        |((quants, rest), data)| {
            for (i, b) in data.chunks_exact(bb).enumerate() {
                quants[nq * i..nq * (i + 1)].copy_from_slice(&b[at..at + nq]);
                rest[nr * i..nr * i + at].copy_from_slice(&b[..at]);
                rest[nr * i + at..nr * (i + 1)].copy_from_slice(&b[at + nq..]);
            }
        },
    );
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

    /// Repacking only reorders: every block's quants and the rest of its bytes come back whole.
    #[test]
    fn repacked_blocks_hold_every_byte_of_every_block() {
        for (ty, bb, at, nq) in BLOCK_SPLITS {
            let (bb, at, nq) = (bb as usize, at as usize, nq as usize);
            let data: Vec<u8> = (0..bb * 5).map(|i| (i * 131 % 251) as u8).collect();
            let out = repack_blocks(ty, &data);
            assert_eq!(out.len(), data.len());
            let (quants, rest) = out.split_at(5 * nq);
            for (i, b) in data.chunks_exact(bb).enumerate() {
                assert_eq!(&quants[nq * i..nq * (i + 1)], &b[at..at + nq], "{ty:?} block {i} quants");
                let r = &rest[(bb - nq) * i..(bb - nq) * (i + 1)];
                assert_eq!(&r[..at], &b[..at], "{ty:?} block {i} head");
                assert_eq!(&r[at..], &b[at + nq..], "{ty:?} block {i} tail");
            }
            assert_eq!(nq % 16, 0, "{ty:?}: quants must stay 16-byte aligned");
        }
        let f16 = [1u8, 2, 3, 4];
        assert_eq!(&*repack_blocks(GgmlType::F16, &f16), &f16);
    }
}
