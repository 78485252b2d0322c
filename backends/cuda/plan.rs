//! Turns each recorded op into kernel launches, once, at compile time. Every launch is fixed:
//! same kernel, grid and arguments for every token. Per-token work is decided on the device
//! from `StepParams` (predicates and loop bounds), which is what lets one CUDA graph replay it.

use crate::model::RopeParams;
use crate::quant::GgmlType;
use crate::recorder::{Buf, Cond, Op, Program, RopePos, Step, WeightId};

/// Backend scratch areas that no recorded buffer covers (activation quantization, attention
/// scores, top-k flags). Sized from the program at compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scratch {
    Q8Qs,
    Q8D,
    Q8KX,
    Q8KMid,
    Mid,
    Scores,
    Taken,
}

pub const SCRATCH_KINDS: [Scratch; 7] =
    [Scratch::Q8Qs, Scratch::Q8D, Scratch::Q8KX, Scratch::Q8KMid, Scratch::Mid, Scratch::Scores, Scratch::Taken];

/// A kernel argument before device addresses are known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Buf(Buf),
    Weight(WeightId),
    Scratch(Scratch),
    /// The IQ2_XXS grid table.
    Grid,
    /// A (cos, sin) table per position for `Plan::ropes[i]`.
    Rope(usize),
    Null,
    U32(u32),
    F32(f32),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// Index of the recorded op this launch belongs to.
    pub op: usize,
    pub kernel: &'static str,
    pub grid: u32,
    pub block: u32,
    /// The op's predicate, packed for `ds4_cond` (kernels/common.cuh).
    pub cond: u64,
    pub args: Vec<Arg>,
}

/// The launches of a program and the scratch bytes they need.
pub struct Plan {
    pub launches: Vec<Launch>,
    pub scratch: Vec<(Scratch, usize)>,
    /// Distinct RoPE settings (params, rotated dims); each gets a host-computed table.
    pub ropes: Vec<(RopeParams, u32)>,
}

const Q8K_BLOCK_BYTES: usize = 292;

fn pack_cond(c: Option<Cond>) -> u64 {
    match c {
        None => 0,
        Some(Cond::Emit { ratio }) => 1 | (ratio as u64) << 2,
        Some(Cond::IndexerActive { ratio, top_k }) => 2 | (ratio as u64) << 2 | (top_k as u64) << 18,
    }
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

struct Builder<'a> {
    program: &'a Program,
    launches: Vec<Launch>,
    need: Vec<(Scratch, usize)>,
    cond: u64,
    op: usize,
    ropes: Vec<(RopeParams, u32)>,
}

impl Builder<'_> {
    fn launch(&mut self, kernel: &'static str, grid: u32, block: u32, args: Vec<Arg>) {
        self.launches.push(Launch { op: self.op, kernel, grid, block, cond: self.cond, args });
    }
    fn need(&mut self, s: Scratch, bytes: usize) {
        match self.need.iter_mut().find(|(k, _)| *k == s) {
            Some((_, b)) => *b = (*b).max(bytes),
            None => self.need.push((s, bytes)),
        }
    }
    fn len(&self, b: Buf) -> usize {
        self.program.buffer(b).len
    }
    /// 1 for F16 weights, 0 for F32; anything else is not a plain vector or matrix here.
    fn is_f16(&self, w: WeightId) -> Result<u32, String> {
        match self.program.weight(w).ty {
            GgmlType::F16 => Ok(1),
            GgmlType::F32 => Ok(0),
            t => Err(format!("tensor '{}' is {t:?}; expected F16 or F32", self.program.weight(w).name)),
        }
    }
    fn f32_weight(&self, w: WeightId) -> Result<Arg, String> {
        match self.is_f16(w)? {
            0 => Ok(Arg::Weight(w)),
            _ => Err(format!("tensor '{}' must be F32 for the CUDA kernels", self.program.weight(w).name)),
        }
    }
    fn expert_type(&self, w: WeightId) -> Result<u32, String> {
        match self.program.weight(w).ty {
            t @ (GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K) => Ok(t as u32),
            t => Err(format!("tensor '{}' is {t:?}, not a routed-expert type", self.program.weight(w).name)),
        }
    }

    /// A dense matvec; Q8_0 weights first quantize the whole input per 32.
    fn mat_vec(&mut self, w: WeightId, x: Buf, out: Buf, groups: u32) -> Result<(), String> {
        let t = self.program.weight(w);
        let (in_dim, rows) = (t.dim(0) as usize, t.dim(1) as usize);
        let rows_per_group = (rows / groups as usize) as u32;
        let grid = blocks(rows, 8);
        match t.ty {
            GgmlType::Q8_0 => {
                if in_dim / 32 > 512 {
                    return Err(format!("Q8_0 rows of {in_dim} exceed the kernel's 512 blocks"));
                }
                let n = self.len(x);
                self.need(Scratch::Q8Qs, n);
                self.need(Scratch::Q8D, n / 32 * 4);
                self.launch(
                    "quantize_q8_0",
                    blocks(n / 32, 8),
                    256,
                    vec![Arg::Buf(x), Arg::Scratch(Scratch::Q8Qs), Arg::Scratch(Scratch::Q8D), Arg::U32(n as u32)],
                );
                self.launch(
                    "mat_vec_q8_0",
                    grid,
                    256,
                    vec![
                        Arg::Weight(w),
                        Arg::Scratch(Scratch::Q8Qs),
                        Arg::Scratch(Scratch::Q8D),
                        Arg::Buf(out),
                        Arg::U32(in_dim as u32),
                        Arg::U32(rows as u32),
                        Arg::U32(rows_per_group),
                    ],
                );
            }
            GgmlType::F16 | GgmlType::F32 => {
                let args = vec![
                    Arg::Weight(w),
                    Arg::Buf(x),
                    Arg::Buf(out),
                    Arg::U32(in_dim as u32),
                    Arg::U32(rows as u32),
                    Arg::U32(rows_per_group),
                ];
                if t.ty == GgmlType::F16 {
                    // One warp per row, 8 rows per block.
                    self.launch("mat_vec_f16", grid, 256, args);
                } else {
                    // One thread per row (sequential sums), 64 rows per block.
                    self.launch("mat_vec_f32", blocks(rows, 64), 64, args);
                }
            }
            other => return Err(format!("tensor '{}' of type {other:?} is not a dense matrix", t.name)),
        }
        Ok(())
    }

    fn op(&mut self, step: &Step) -> Result<(), String> {
        self.cond = pack_cond(step.cond);
        use Arg::{Buf as B, Weight as W, F32, U32};
        match step.op {
            Op::EmbedHc { table, out, n_hc } => {
                let n_embd = self.program.weight(table).dim(0) as usize;
                let f16 = self.is_f16(table)?;
                let args = vec![W(table), U32(f16), B(out), U32(n_embd as u32), U32(n_hc)];
                self.launch("embed_hc", blocks(n_embd, 256), 256, args);
            }
            Op::RmsNorm { x, weight, out, n, rows, eps } => {
                let w = match weight {
                    Some(w) => self.f32_weight(w)?,
                    None => Arg::Null,
                };
                self.launch("rms_norm", rows, 256, vec![B(x), w, B(out), U32(n), F32(eps)]);
            }
            Op::MatVec { w, x, out } => self.mat_vec(w, x, out, 1)?,
            Op::MatVecGrouped { w, x, out, groups } => self.mat_vec(w, x, out, groups)?,
            Op::HcSplit { mix, scale, base, split, n_hc, iters, eps } => {
                if n_hc != 4 {
                    return Err(format!("the HC kernel needs 4 streams, not {n_hc}"));
                }
                let (s, b) = (self.f32_weight(scale)?, self.f32_weight(base)?);
                self.launch("hc_split", 1, 32, vec![B(mix), s, b, B(split), U32(n_hc), U32(iters), F32(eps)]);
            }
            Op::HcWeightedSum { hc, weights, out, n_hc } => {
                let n = self.len(out);
                self.launch(
                    "hc_weighted_sum",
                    blocks(n, 256),
                    256,
                    vec![B(hc), B(weights), B(out), U32(n as u32), U32(n_hc)],
                );
            }
            Op::HcPost { block, residual, split, out, n_hc } => {
                let n = self.len(block);
                let args = vec![B(block), B(residual), B(split), B(out), U32(n as u32), U32(n_hc)];
                self.launch("hc_post", blocks(n * n_hc as usize, 256), 256, args);
            }
            Op::HcHeadWeights { pre, scale, base, out, eps } => {
                let n = self.len(pre) as u32;
                let (s, b) = (self.f32_weight(scale)?, self.f32_weight(base)?);
                self.launch("hc_head_weights", 1, 32, vec![B(pre), s, b, B(out), U32(n), F32(eps)]);
            }
            Op::RopeTail { x, n_head, head_dim, n_rot, rope, pos, inverse } => {
                let (mode, ratio) = match pos {
                    RopePos::Current => (0, 0),
                    RopePos::CompressedRow { ratio } => (1, ratio),
                };
                let table = match self.ropes.iter().position(|r| *r == (rope, n_rot)) {
                    Some(i) => i,
                    None => {
                        self.ropes.push((rope, n_rot));
                        self.ropes.len() - 1
                    }
                };
                let args = vec![
                    B(x),
                    U32(n_head),
                    U32(head_dim),
                    U32(n_rot),
                    Arg::Rope(table),
                    U32(mode),
                    U32(ratio),
                    U32(inverse as u32),
                ];
                self.launch("rope_tail", blocks((n_head * n_rot / 2) as usize, 128), 128, args);
            }
            Op::Fp8RoundTrip { x, head_dim, n_rot } => {
                self.launch("fp8_round_trip", (head_dim - n_rot) / 64, 64, vec![B(x)]);
            }
            Op::IndexerQat { x, rows, .. } => self.launch("indexer_qat", rows, 128, vec![B(x)]),
            Op::StoreRaw { kv, cache, row_dim, raw_cap } => {
                self.launch(
                    "store_raw",
                    blocks(row_dim as usize, 256),
                    256,
                    vec![B(kv), B(cache), U32(row_dim), U32(raw_cap)],
                );
            }
            Op::CompressorStore { kv, score, ape, state_kv, state_score, width, ratio } => {
                let f16 = self.is_f16(ape)?;
                let args = vec![B(kv), B(score), W(ape), U32(f16), B(state_kv), B(state_score), U32(width), U32(ratio)];
                self.launch("compressor_store", blocks(width as usize, 256), 256, args);
            }
            Op::CompressorPool { state_kv, state_score, out, head_dim, ratio } => {
                let args = vec![B(state_kv), B(state_score), B(out), U32(head_dim), U32(ratio)];
                self.launch("compressor_pool", blocks(head_dim as usize, 256), 256, args);
            }
            Op::CompressorShift { state_kv, state_score, width, ratio } => {
                let n = ratio * width;
                self.launch(
                    "compressor_shift",
                    blocks(n as usize, 256),
                    256,
                    vec![B(state_kv), B(state_score), U32(n)],
                );
            }
            Op::StoreCompRow { row, cache, row_dim, ratio } => {
                let args = vec![B(row), B(cache), U32(row_dim), U32(ratio)];
                self.launch("store_comp_row", blocks(row_dim as usize, 256), 256, args);
            }
            Op::IndexerScores { q, weights, cache, out, n_head, head_dim, scale, rows } => {
                if head_dim > 128 || n_head > 128 {
                    return Err(format!("indexer of {n_head} heads x {head_dim} exceeds the kernel's 128 x 128"));
                }
                let ratio = comp_ratio(rows)?;
                let args = vec![
                    B(q),
                    B(weights),
                    B(cache),
                    B(out),
                    U32(n_head),
                    U32(head_dim),
                    F32(scale),
                    U32(ratio),
                    U32(rows.cap),
                ];
                self.launch("indexer_scores", rows.cap.clamp(1, 4096), 128, args);
            }
            Op::IndexerTopK { scores, out, top_k, rows } => {
                if top_k > 1024 {
                    return Err(format!("indexer top-k {top_k} exceeds the kernel's 1024"));
                }
                self.need(Scratch::Taken, rows.cap as usize * 4);
                let ratio = comp_ratio(rows)?;
                let args = vec![B(scores), B(out), Arg::Scratch(Scratch::Taken), U32(top_k), U32(ratio), U32(rows.cap)];
                self.launch("indexer_top_k", 1, 1024, args);
            }
            Op::Attention { q, raw, comp, selected, top_k, sinks, out, n_head, head_dim, raw_rows, comp_rows } => {
                let window = match raw_rows.kind {
                    crate::recorder::BoundKind::RawRows { window } => window,
                    _ => return Err("attention raw rows must be a raw-window bound".into()),
                };
                if head_dim % 4 != 0 {
                    return Err(format!("the attention kernel needs a head width divisible by 4, not {head_dim}"));
                }
                let ratio = if comp.is_some() { comp_ratio(comp_rows)? } else { 0 };
                // Visible compressed rows never exceed the cap, nor top_k once the indexer selects.
                let max_rows = raw_rows.cap + comp_rows.cap;
                self.need(Scratch::Scores, (n_head * max_rows) as usize * 4);
                let args = vec![
                    B(q),
                    B(raw),
                    comp.map_or(Arg::Null, B),
                    selected.map_or(Arg::Null, B),
                    self.f32_weight(sinks)?,
                    B(out),
                    Arg::Scratch(Scratch::Scores),
                    U32(head_dim),
                    U32(window),
                    U32(raw_rows.cap),
                    U32(ratio),
                    U32(comp_rows.cap),
                    U32(top_k),
                    U32(max_rows),
                ];
                self.launch("attention", n_head, 256, args);
            }
            Op::RouterSelect { logits, bias, hash, selected, weights, n_used, scale } => {
                let n_expert = self.len(logits) as u32;
                if n_expert > 1024 || n_used > 16 {
                    return Err(format!(
                        "router of {n_expert} experts with {n_used} used exceeds the kernel's 1024/16"
                    ));
                }
                let bias = match bias {
                    Some(b) => self.f32_weight(b)?,
                    None => Arg::Null,
                };
                let args = vec![
                    B(logits),
                    bias,
                    hash.map_or(Arg::Null, W),
                    B(selected),
                    B(weights),
                    U32(n_expert),
                    U32(n_used),
                    F32(scale),
                ];
                self.launch("router_select", 1, 256, args);
            }
            Op::MoeExperts { x, selected, weights, gate, up, down, out, clamp } => {
                let (gt, dt) = (self.program.weight(gate), self.program.weight(down));
                let (in_dim, ff, out_dim) = (gt.dim(0) as usize, gt.dim(1) as usize, dt.dim(1) as usize);
                let n_used = self.len(selected);
                if in_dim / 256 > 64 || ff / 256 > 64 {
                    return Err(format!("expert rows of {in_dim} and {ff} exceed the kernel's 64 blocks of 256"));
                }
                let (g_ty, u_ty, d_ty) = (self.expert_type(gate)?, self.expert_type(up)?, self.expert_type(down)?);
                self.need(Scratch::Q8KX, in_dim / 256 * Q8K_BLOCK_BYTES);
                self.need(Scratch::Mid, n_used * ff * 4);
                self.need(Scratch::Q8KMid, n_used * ff / 256 * Q8K_BLOCK_BYTES);
                self.launch("quantize_q8_k", (in_dim / 256) as u32, 256, vec![B(x), Arg::Scratch(Scratch::Q8KX)]);
                let args = vec![
                    Arg::Scratch(Scratch::Q8KX),
                    B(selected),
                    B(weights),
                    W(gate),
                    W(up),
                    U32(g_ty),
                    U32(u_ty),
                    Arg::Scratch(Scratch::Mid),
                    U32(in_dim as u32),
                    U32(ff as u32),
                    U32(n_used as u32),
                    F32(clamp),
                    Arg::Grid,
                ];
                self.launch("moe_gate_up", blocks(n_used * ff, 8), 256, args);
                self.launch(
                    "quantize_q8_k",
                    (n_used * ff / 256) as u32,
                    256,
                    vec![Arg::Scratch(Scratch::Mid), Arg::Scratch(Scratch::Q8KMid)],
                );
                let args = vec![
                    Arg::Scratch(Scratch::Q8KMid),
                    B(selected),
                    W(down),
                    U32(d_ty),
                    B(out),
                    U32(ff as u32),
                    U32(out_dim as u32),
                    U32(n_used as u32),
                    Arg::Grid,
                ];
                self.launch("moe_down", blocks(out_dim, 8), 256, args);
            }
            Op::SwiGlu { gate, up, out, clamp } => {
                let n = self.len(out);
                self.launch("swiglu", blocks(n, 256), 256, vec![B(gate), B(up), B(out), U32(n as u32), F32(clamp)]);
            }
            Op::Add { a, b, out } => {
                let n = self.len(out);
                self.launch("add", blocks(n, 256), 256, vec![B(a), B(b), B(out), U32(n as u32)]);
            }
        }
        Ok(())
    }
}

fn comp_ratio(b: crate::recorder::Bound) -> Result<u32, String> {
    match b.kind {
        crate::recorder::BoundKind::CompRows { ratio } => Ok(ratio),
        _ => Err("expected a compressed-row bound".into()),
    }
}

/// Plans every op of `program`, in order.
pub fn plan(program: &Program) -> Result<Plan, String> {
    let mut b = Builder { program, launches: Vec::new(), need: Vec::new(), cond: 0, op: 0, ropes: Vec::new() };
    for (i, step) in program.steps().iter().enumerate() {
        b.op = i;
        b.op(step).map_err(|e| format!("op #{i} ({}): {e}", step.op.name()))?;
    }
    Ok(Plan { launches: b.launches, scratch: b.need, ropes: b.ropes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{record_token, Caps};
    use crate::gguf::File;
    use crate::model::Model;
    use crate::synth::{self, Preset};

    /// Parameter count of each `extern "C" __global__` kernel in the sources (DS4_ARGS is two).
    fn kernel_arities() -> Vec<(String, usize)> {
        let src = super::super::kernel_source();
        let mut out = Vec::new();
        for part in src.split("extern \"C\" __global__ void ").skip(1) {
            let name = part[..part.find('(').unwrap()].trim().to_string();
            let params = &part[part.find('(').unwrap() + 1..part.find(')').unwrap()];
            let n = params.split(',').count() + params.contains("DS4_ARGS") as usize;
            out.push((name, n));
        }
        out
    }

    #[test]
    fn every_launch_matches_its_kernel_signature() {
        let arities = kernel_arities();
        assert!(arities.len() >= 20, "kernels found: {arities:?}");
        for preset in [Preset::tiny(), Preset::small()] {
            let model = Model::from_file(File::from_bytes("t", synth::build(&preset, 1)).unwrap()).unwrap();
            let program = record_token(&model, Caps { ctx: 128 }).unwrap();
            let plan = plan(&program).unwrap();
            let mut ops_seen = vec![false; program.steps().len()];
            for l in &plan.launches {
                let (_, n) = arities
                    .iter()
                    .find(|(k, _)| k == l.kernel)
                    .unwrap_or_else(|| panic!("no kernel named {} in kernels/", l.kernel));
                assert_eq!(l.args.len() + 2, *n, "kernel {} takes {n} parameters", l.kernel);
                assert!(l.grid >= 1 && l.block >= 32 && l.block <= 1024, "{}: {} x {}", l.kernel, l.grid, l.block);
                ops_seen[l.op] = true;
            }
            assert!(ops_seen.iter().all(|&s| s), "every recorded op has at least one launch");
            // Predicated ops keep their predicate on every launch.
            for l in &plan.launches {
                assert_eq!(l.cond, pack_cond(program.steps()[l.op].cond));
            }
        }
    }

    #[test]
    fn predicates_pack_as_the_kernels_unpack_them() {
        let unpack = |c: u64| (c & 3, (c >> 2) & 0xffff, c >> 18);
        assert_eq!(unpack(pack_cond(None)), (0, 0, 0));
        assert_eq!(unpack(pack_cond(Some(Cond::Emit { ratio: 128 }))), (1, 128, 0));
        assert_eq!(unpack(pack_cond(Some(Cond::IndexerActive { ratio: 4, top_k: 512 }))), (2, 4, 512));
    }
}
