//! The ops of a token program. Each op is defined once here; every backend implements each
//! variant in one place and dispatches with an exhaustive `match` (no `_` arm).

use super::{Bound, Buf, WeightId};
use crate::model::RopeParams;

/// Which position a RoPE op rotates by, derived from `StepParams::pos`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopePos {
    /// The current token's position.
    Current,
    /// The first position of the compressed row emitted this token: `pos + 1 - ratio`.
    CompressedRow { ratio: u32 },
}

/// How a compressed row is rounded before it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompQuant {
    /// fp8 E4M3 round trip on the non-RoPE dims (attention lane).
    Fp8,
    /// Hadamard-128 plus FP4 E2M1 round trip (indexer lane).
    IndexerQat,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `out[h*n_embd..]` = row `token` of the embedding table, for each of the `n_hc` streams.
    EmbedHc { table: WeightId, out: Buf, n_hc: u32 },
    /// RMS norm over `rows` rows of `n`; optional learned weight. `out` may equal `x`.
    RmsNorm { x: Buf, weight: Option<WeightId>, out: Buf, n: u32, rows: u32, eps: f32 },
    /// `out = W · x`. F16/F32 weights take f32 activations; Q8_0 weights quantize `x` per 32.
    MatVec { w: WeightId, x: Buf, out: Buf },
    /// Grouped Q8_0 matvec: output rows of group `g` read `x[g*in .. (g+1)*in]`.
    MatVecGrouped { w: WeightId, x: Buf, out: Buf, groups: u32 },
    /// HC control split: `split = [pre | post | comb]` from the mix vector, with Sinkhorn.
    HcSplit { mix: Buf, scale: WeightId, base: WeightId, split: Buf, n_hc: u32, iters: u32, eps: f32 },
    /// `out = Σ_h weights[h] · hc[h]` over the first `n_hc` entries of `weights`.
    HcWeightedSum { hc: Buf, weights: Buf, out: Buf, n_hc: u32 },
    /// `out[dst] = post[dst]·block + Σ_src comb[dst + src·n_hc]·residual[src]`.
    HcPost { block: Buf, residual: Buf, split: Buf, out: Buf, n_hc: u32 },
    /// Output-head HC weights: `w = sigmoid(pre·scale + base) + eps` (no Sinkhorn).
    HcHeadWeights { pre: Buf, scale: WeightId, base: WeightId, out: Buf, eps: f32 },
    /// RoPE on the last `n_rot` dims of each head, in place. `inverse` undoes it.
    RopeTail { x: Buf, n_head: u32, head_dim: u32, n_rot: u32, rope: RopeParams, pos: RopePos, inverse: bool },
    /// fp8 E4M3 round trip of the non-RoPE dims, power-of-two scale per 64, in place.
    Fp8RoundTrip { x: Buf, head_dim: u32, n_rot: u32 },
    /// Hadamard-128 then FP4 E2M1 round trip per 32, per row of `head_dim`, in place.
    IndexerQat { x: Buf, rows: u32, head_dim: u32 },
    /// Writes `kv`, rounded to f16, into the raw ring at row `pos % raw_cap`.
    StoreRaw { kv: Buf, cache: Buf, row_dim: u32, raw_cap: u32 },
    /// Compressor state update: `score += ape[pos % ratio]`, then both rows are stored at the
    /// token's state row (`4 + pos%4` for ratio 4, else `pos % ratio`).
    CompressorStore { kv: Buf, score: Buf, ape: WeightId, state_kv: Buf, state_score: Buf, width: u32, ratio: u32 },
    /// Softmax-pools the window per dim (ratio 4: previous lane's first half + current lane's second half).
    CompressorPool { state_kv: Buf, state_score: Buf, out: Buf, head_dim: u32, ratio: u32 },
    /// Ratio 4: the current lane (rows 4..8) becomes the previous lane (rows 0..4).
    CompressorShift { state_kv: Buf, state_score: Buf, width: u32, ratio: u32 },
    /// Writes `row`, rounded to f16, as compressed row `(pos+1)/ratio - 1` of `cache`.
    StoreCompRow { row: Buf, cache: Buf, row_dim: u32, ratio: u32 },
    /// `out[c] = Σ_h relu(q_h · cache[c]) · weights[h] · scale`, for the visible rows.
    IndexerScores { q: Buf, weights: Buf, cache: Buf, out: Buf, n_head: u32, head_dim: u32, scale: f32, rows: Bound },
    /// The `top_k` best rows of `scores` (ties to the lower index), written ascending.
    IndexerTopK { scores: Buf, out: Buf, top_k: u32, rows: Bound },
    /// Sink attention over the raw window plus the visible compressed rows. With `selected`,
    /// only those compressed rows are visible once the indexer is active (`comp_rows > top_k`).
    Attention {
        q: Buf,
        raw: Buf,
        comp: Option<Buf>,
        selected: Option<Buf>,
        top_k: u32,
        sinks: WeightId,
        out: Buf,
        n_head: u32,
        head_dim: u32,
        raw_rows: Bound,
        comp_rows: Bound,
    },
    /// Router: `p = sqrt(softplus(logits))`; experts from the hash table (by token) or by top-k
    /// of `p + bias`; weights `p[sel] / Σ · scale`.
    RouterSelect {
        logits: Buf,
        bias: Option<WeightId>,
        hash: Option<WeightId>,
        selected: Buf,
        weights: Buf,
        n_used: u32,
        scale: f32,
    },
    /// Routed experts: Q8_K activations; `mid = silu(min(g,c))·clamp(u,±c)·w`, re-quantized, then
    /// the down projections summed over the selected experts.
    MoeExperts {
        x: Buf,
        selected: Buf,
        weights: Buf,
        gate: WeightId,
        up: WeightId,
        down: WeightId,
        out: Buf,
        clamp: f32,
    },
    /// `out = silu(min(gate,c)) · clamp(up, ±c)`.
    SwiGlu { gate: Buf, up: Buf, out: Buf, clamp: f32 },
    /// `out = a + b`.
    Add { a: Buf, b: Buf, out: Buf },
}

impl Op {
    /// The buffers the op writes (in place or not). Plans use it to know when a value derived
    /// from a buffer (a quantized copy, say) goes stale.
    pub fn writes(&self) -> Vec<Buf> {
        match *self {
            Op::EmbedHc { out, .. }
            | Op::RmsNorm { out, .. }
            | Op::MatVec { out, .. }
            | Op::MatVecGrouped { out, .. }
            | Op::HcWeightedSum { out, .. }
            | Op::HcPost { out, .. }
            | Op::HcHeadWeights { out, .. }
            | Op::CompressorPool { out, .. }
            | Op::IndexerScores { out, .. }
            | Op::IndexerTopK { out, .. }
            | Op::Attention { out, .. }
            | Op::MoeExperts { out, .. }
            | Op::SwiGlu { out, .. }
            | Op::Add { out, .. } => vec![out],
            Op::HcSplit { split, .. } => vec![split],
            Op::RopeTail { x, .. } | Op::Fp8RoundTrip { x, .. } | Op::IndexerQat { x, .. } => vec![x],
            Op::StoreRaw { cache, .. } | Op::StoreCompRow { cache, .. } => vec![cache],
            Op::CompressorStore { state_kv, state_score, .. } | Op::CompressorShift { state_kv, state_score, .. } => {
                vec![state_kv, state_score]
            }
            Op::RouterSelect { selected, weights, .. } => vec![selected, weights],
        }
    }

    /// The buffers the op reads (state it updates in place included). With [`Op::writes`], plans
    /// use it to know whether an op may move past others.
    pub fn reads(&self) -> Vec<Buf> {
        let mut r = match *self {
            Op::EmbedHc { .. } => vec![],
            Op::RmsNorm { x, .. } | Op::MatVec { x, .. } | Op::MatVecGrouped { x, .. } => vec![x],
            Op::HcSplit { mix, .. } => vec![mix],
            Op::HcWeightedSum { hc, weights, .. } => vec![hc, weights],
            Op::HcPost { block, residual, split, .. } => vec![block, residual, split],
            Op::HcHeadWeights { pre, .. } => vec![pre],
            Op::RopeTail { x, .. } | Op::Fp8RoundTrip { x, .. } | Op::IndexerQat { x, .. } => vec![x],
            Op::StoreRaw { kv, .. } => vec![kv],
            Op::CompressorStore { kv, score, .. } => vec![kv, score],
            Op::CompressorPool { state_kv, state_score, .. } | Op::CompressorShift { state_kv, state_score, .. } => {
                vec![state_kv, state_score]
            }
            Op::StoreCompRow { row, .. } => vec![row],
            Op::IndexerScores { q, weights, cache, .. } => vec![q, weights, cache],
            Op::IndexerTopK { scores, .. } => vec![scores],
            Op::Attention { q, raw, comp, selected, .. } => {
                [Some(q), Some(raw), comp, selected].into_iter().flatten().collect()
            }
            Op::RouterSelect { logits, .. } => vec![logits],
            Op::MoeExperts { x, selected, weights, .. } => vec![x, selected, weights],
            Op::SwiGlu { gate, up, .. } => vec![gate, up],
            Op::Add { a, b, .. } => vec![a, b],
        };
        r.sort();
        r.dedup();
        r
    }

    /// The op's name, shared by the CPU function, the WGSL entry point and the CUDA kernel.
    pub fn name(&self) -> &'static str {
        match self {
            Op::EmbedHc { .. } => "embed_hc",
            Op::RmsNorm { .. } => "rms_norm",
            Op::MatVec { .. } => "mat_vec",
            Op::MatVecGrouped { .. } => "mat_vec_grouped",
            Op::HcSplit { .. } => "hc_split",
            Op::HcWeightedSum { .. } => "hc_weighted_sum",
            Op::HcPost { .. } => "hc_post",
            Op::HcHeadWeights { .. } => "hc_head_weights",
            Op::RopeTail { .. } => "rope_tail",
            Op::Fp8RoundTrip { .. } => "fp8_round_trip",
            Op::IndexerQat { .. } => "indexer_qat",
            Op::StoreRaw { .. } => "store_raw",
            Op::CompressorStore { .. } => "compressor_store",
            Op::CompressorPool { .. } => "compressor_pool",
            Op::CompressorShift { .. } => "compressor_shift",
            Op::StoreCompRow { .. } => "store_comp_row",
            Op::IndexerScores { .. } => "indexer_scores",
            Op::IndexerTopK { .. } => "indexer_top_k",
            Op::Attention { .. } => "attention",
            Op::RouterSelect { .. } => "router_select",
            Op::MoeExperts { .. } => "moe_experts",
            Op::SwiGlu { .. } => "swiglu",
            Op::Add { .. } => "add",
        }
    }
}
