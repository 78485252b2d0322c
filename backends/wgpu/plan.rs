//! Turns each recorded op into WGSL dispatches, once, at compile time. Every dispatch is fixed:
//! same entry point, workgroup count, arguments and bindings for every token. Per-token work is
//! decided on the GPU from the step parameters (predicates and loop bounds).

use crate::backends::gpu_tables::attention_kq_scale;
use crate::model::RopeParams;
use crate::quant::GgmlType;
use crate::recorder::{BoundKind, Buf, Cond, Op, Program, RopePos, Step, WeightId};

/// Backend scratch areas that no recorded buffer covers, sized from the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scratch {
    /// Q8_0 activation: packed quants, then the scales.
    Q8,
    /// Q8_K blocks of the routed experts' input.
    Q8KX,
    /// Q8_K blocks of the experts' mid vectors.
    Q8KMid,
    /// The experts' mid vectors.
    Mid,
    /// The down projections per selected expert, before they are added in order.
    Partial,
    /// Attention scores, `max_rows` per head.
    Scores,
    /// Top-k flags, one per row of capacity.
    Taken,
}

/// What a binding of a dispatch is bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Res {
    Buf(Buf),
    /// Chunk `k` of a weight stored in row or expert ranges (most weights have one).
    Weight(WeightId, u32),
    /// A small weight vector, dequantized to f32 at compile time.
    Vector(WeightId),
    Scratch(Scratch),
    /// The IQ2_XXS grid.
    Grid,
    /// The RoPE table of `Plan::ropes[i]`.
    Rope(u32),
    /// A 4-byte placeholder for a binding the op does not use (an optional input).
    Dummy,
}

/// How a weight is stored on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// A matrix split into row ranges `(first row, rows)`, each its own buffer; Q8_0 repacked per range.
    Rows(Vec<(u32, u32)>),
    /// Routed experts split into expert ranges `(first expert, experts)`.
    Experts(Vec<(u32, u32)>),
    /// A small vector converted to f32.
    Vector,
    /// The bytes as they are (the I32 hash table).
    Raw,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    /// Index of the recorded op this dispatch belongs to.
    pub op: usize,
    pub entry: &'static str,
    /// Workgroups; entries that read `num_workgroups` take more than 65535 as a 2D grid.
    pub groups: u32,
    /// The predicate (kind, ratio, top_k) and then the entry's argument words.
    pub cond: [u32; 3],
    pub args: Vec<u32>,
    pub binds: Vec<(u32, Res)>,
}

pub struct Plan {
    pub dispatches: Vec<Dispatch>,
    pub scratch: Vec<(Scratch, u64)>,
    pub ropes: Vec<(RopeParams, u32)>,
    /// One per program weight; `None` for weights no op reads.
    pub layouts: Vec<Option<Layout>>,
}

/// The shader file each entry point lives in.
pub fn shader_of(entry: &str) -> Option<&'static str> {
    Some(match entry {
        "quantize_q8_0" | "mat_vec_q8_0" | "mat_vec_f16" | "mat_vec_f32" | "mat_vec_q8_0_rows" | "mat_vec_f16_rows"
        | "mat_vec_f32_rows" | "mat_vec_f16_split" | "mat_vec_f32_split" => "matvec",
        "rms_norm" => "norm",
        "swiglu" | "add" => "elementwise",
        "rope_tail" => "rope",
        "embed_hc" | "hc_split" | "hc_weighted_sum" | "hc_post" | "hc_head_weights" => "hc",
        "fp8_round_trip" | "indexer_qat" | "store_raw" | "store_comp_row" | "compressor_store" | "compressor_pool"
        | "compressor_shift" => "kv",
        "indexer_scores" | "indexer_top_k" => "indexer",
        "attention" => "attention",
        "router_select" | "quantize_q8_k" | "moe_gate_up" | "moe_down" | "moe_sum" | "moe_gate_up_rows"
        | "moe_down_rows" => "moe",
        _ => return None,
    })
}

/// Outputs of an RMS norm row per workgroup (4 per invocation) when the output is not the input.
const NORM_SLICE: u32 = 1024;

/// Whether a dense F16 / F32 matrix runs split-K (a workgroup per row, its chunks over 8
/// groups of 32 lanes): narrow matrices of long rows, such as the HC mix projections (24 rows
/// of 16384 on Flash), where 32 lanes per row would leave the GPU nearly idle.
fn split_k(rows: u32, in_dim: u64) -> bool {
    let chunks = in_dim.div_ceil(crate::numerics::CHUNK as u64);
    rows < 2048 && (2..=64).contains(&chunks)
}

fn pack_cond(c: Option<Cond>) -> [u32; 3] {
    match c {
        None => [0, 0, 0],
        Some(Cond::Emit { ratio }) => [1, ratio, 0],
        Some(Cond::IndexerActive { ratio, top_k }) => [2, ratio, top_k],
    }
}

fn groups(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

/// Workgroups along x at most (WebGPU's default `max_compute_workgroups_per_dimension`).
pub const MAX_GROUPS_X: u32 = 65535;

struct Builder<'a> {
    program: &'a Program,
    max_binding: u64,
    /// One invocation per matrix row (the `_rows` entry points) instead of 32 lanes per row.
    rows: bool,
    out: Vec<Dispatch>,
    need: Vec<(Scratch, u64)>,
    ropes: Vec<(RopeParams, u32)>,
    layouts: Vec<Option<Layout>>,
    cond: [u32; 3],
    op: usize,
    /// The buffer whose Q8_0 quantization the scratch holds, and the predicate it ran under.
    q8_of: Option<(Buf, [u32; 3])>,
}

impl Builder<'_> {
    fn push(&mut self, entry: &'static str, groups: u32, args: Vec<u32>, binds: Vec<(u32, Res)>) {
        self.out.push(Dispatch { op: self.op, entry, groups, cond: self.cond, args, binds });
    }
    fn need(&mut self, s: Scratch, bytes: u64) {
        match self.need.iter_mut().find(|(k, _)| *k == s) {
            Some((_, b)) => *b = (*b).max(bytes),
            None => self.need.push((s, bytes)),
        }
    }
    fn len(&self, b: Buf) -> usize {
        self.program.buffer(b).len
    }
    fn layout(&mut self, w: WeightId, l: Layout) -> Result<(), String> {
        let slot = &mut self.layouts[w.0 as usize];
        match slot {
            Some(old) if *old != l => {
                Err(format!("tensor '{}' is read in two different ways", self.program.weight(w).name))
            }
            _ => {
                *slot = Some(l);
                Ok(())
            }
        }
    }
    fn vector(&mut self, w: WeightId) -> Result<Res, String> {
        let t = self.program.weight(w);
        if !matches!(t.ty, GgmlType::F32 | GgmlType::F16) {
            return Err(format!("tensor '{}' is {:?}; a weight vector must be F32 or F16", t.name, t.ty));
        }
        self.layout(w, Layout::Vector)?;
        Ok(Res::Vector(w))
    }
    /// Splits `n` items of `bytes` each into ranges that fit one binding.
    fn ranges(&self, what: &str, n: u64, bytes: u64) -> Result<Vec<(u32, u32)>, String> {
        let per = (self.max_binding.saturating_sub(16) / bytes.max(1)).min(n);
        if per == 0 {
            return Err(format!(
                "one {what} of {bytes} bytes is larger than the adapter's largest storage binding ({} bytes)",
                self.max_binding
            ));
        }
        let mut out = Vec::new();
        let mut first = 0;
        while first < n {
            let k = per.min(n - first);
            out.push((first as u32, k as u32));
            first += k;
        }
        Ok(out)
    }

    fn mat_vec(&mut self, w: WeightId, x: Buf, out: Buf, groups_n: u32) -> Result<(), String> {
        let t = self.program.weight(w);
        let (in_dim, rows) = (t.dim(0), t.dim(1));
        let rows_per_group = (rows / groups_n as u64) as u32;
        let ranges = self.ranges("matrix row", rows, t.ty.row_bytes(in_dim as usize) as u64)?;
        self.layout(w, Layout::Rows(ranges.clone()))?;
        let entry = match t.ty {
            GgmlType::Q8_0 => {
                if in_dim % 32 != 0 {
                    return Err(format!("Q8_0 rows of {in_dim} are not whole blocks"));
                }
                // Consecutive matvecs of one input (q_a and kv, the shared expert's gate and up)
                // quantize it once, if nothing wrote it since and the quantization ran whenever
                // this op runs.
                let fresh = matches!(self.q8_of, Some((q, c)) if q == x && (c == [0; 3] || c == self.cond));
                if !fresh {
                    let n = self.len(x) as u64;
                    let d_off = (n / 4) as u32;
                    // Whole 16-byte vectors: mat_vec_q8_0 reads the scratch as vec4<u32>.
                    self.need(Scratch::Q8, (n + n / 32 * 4).div_ceil(16) * 16);
                    let binds = vec![(3, Res::Buf(x)), (5, Res::Scratch(Scratch::Q8))];
                    self.push("quantize_q8_0", groups(n as usize / 32, 8), vec![n as u32, d_off], binds);
                    self.q8_of = Some((x, self.cond));
                }
                "mat_vec_q8_0"
            }
            GgmlType::F16 if in_dim % 2 == 0 => "mat_vec_f16",
            GgmlType::F32 => "mat_vec_f32",
            other => return Err(format!("tensor '{}' of type {other:?} is not a dense matrix here", t.name)),
        };
        let n = self.len(x) as u32;
        for (k, &(row0, rows)) in ranges.iter().enumerate() {
            let mut args = vec![in_dim as u32, rows, rows_per_group, row0];
            let mut binds = vec![(2, Res::Weight(w, k as u32)), (3, Res::Buf(x)), (4, Res::Buf(out))];
            if entry == "mat_vec_q8_0" {
                args.extend([n / 4, rows * (in_dim as u32 / 32) * 8]);
                binds.push((5, Res::Scratch(Scratch::Q8)));
            }
            if self.rows {
                let entry = match entry {
                    "mat_vec_q8_0" => "mat_vec_q8_0_rows",
                    "mat_vec_f16" => "mat_vec_f16_rows",
                    _ => "mat_vec_f32_rows",
                };
                self.push(entry, groups(rows as usize, 64), args, binds);
            } else if entry != "mat_vec_q8_0" && split_k(rows, in_dim) {
                let entry = if entry == "mat_vec_f16" { "mat_vec_f16_split" } else { "mat_vec_f32_split" };
                self.push(entry, rows, args, binds);
            } else {
                self.push(entry, groups(rows as usize, 8), args, binds);
            }
        }
        Ok(())
    }

    fn op(&mut self, step: &Step) -> Result<(), String> {
        self.cond = pack_cond(step.cond);
        match step.op {
            Op::EmbedHc { table, out, n_hc } => {
                let t = self.program.weight(table);
                let n_embd = t.dim(0);
                let is_f16 = match t.ty {
                    GgmlType::F16 => 1,
                    GgmlType::F32 => 0,
                    other => return Err(format!("embedding table of type {other:?}: expected F16 or F32")),
                };
                let ranges = self.ranges("embedding row", t.dim(1), t.ty.row_bytes(n_embd as usize) as u64)?;
                self.layout(table, Layout::Rows(ranges.clone()))?;
                for (k, &(t0, n)) in ranges.iter().enumerate() {
                    let args = vec![n_embd as u32, n_hc, is_f16, t0, t0 + n];
                    let binds = vec![(5, Res::Buf(out)), (8, Res::Weight(table, k as u32))];
                    self.push("embed_hc", groups(n_embd as usize, 256), args, binds);
                }
            }
            Op::RmsNorm { x, weight, out, n, rows, eps } => {
                let wv = match weight {
                    Some(w) => self.vector(w)?,
                    None => Res::Dummy,
                };
                if n as usize > 64 * crate::numerics::CHUNK {
                    return Err(format!("RMS norm rows of {n} exceed the shader's 64 chunks"));
                }
                // Long rows are written by several workgroups, each summing the whole row
                // (the same bits in each); in place, one workgroup must read before it writes.
                let per = if x == out { n.max(1) } else { NORM_SLICE };
                let slices = n.div_ceil(per).max(1);
                let binds = vec![(2, Res::Buf(x)), (3, Res::Buf(out)), (4, wv)];
                let args = vec![n, eps.to_bits(), weight.is_some() as u32, slices, per, rows * slices];
                self.push("rms_norm", rows * slices, args, binds);
            }
            Op::MatVec { w, x, out } => self.mat_vec(w, x, out, 1)?,
            Op::MatVecGrouped { w, x, out, groups } => self.mat_vec(w, x, out, groups)?,
            Op::HcSplit { mix, scale, base, split, n_hc, iters, eps } => {
                if n_hc == 0 || n_hc > 8 {
                    return Err(format!("the HC shader takes 1 to 8 streams, not {n_hc}"));
                }
                let (s, b) = (self.vector(scale)?, self.vector(base)?);
                let binds = vec![(2, Res::Buf(mix)), (5, Res::Buf(split)), (6, s), (7, b)];
                self.push("hc_split", 1, vec![n_hc, iters, eps.to_bits()], binds);
            }
            Op::HcWeightedSum { hc, weights, out, n_hc } => {
                let n = self.len(out);
                let binds = vec![(2, Res::Buf(hc)), (3, Res::Buf(weights)), (5, Res::Buf(out))];
                self.push("hc_weighted_sum", groups(n, 256), vec![n as u32, n_hc], binds);
            }
            Op::HcPost { block, residual, split, out, n_hc } => {
                let n = self.len(block);
                let binds =
                    vec![(2, Res::Buf(block)), (3, Res::Buf(residual)), (4, Res::Buf(split)), (5, Res::Buf(out))];
                self.push("hc_post", groups(n * n_hc as usize, 256), vec![n as u32, n_hc], binds);
            }
            Op::HcHeadWeights { pre, scale, base, out, eps } => {
                let n = self.len(pre) as u32;
                if n > 32 {
                    return Err(format!("head HC weights of {n} streams exceed the shader's 32"));
                }
                let (s, b) = (self.vector(scale)?, self.vector(base)?);
                let binds = vec![(2, Res::Buf(pre)), (5, Res::Buf(out)), (6, s), (7, b)];
                self.push("hc_head_weights", 1, vec![n, eps.to_bits()], binds);
            }
            Op::RopeTail { x, n_head, head_dim, n_rot, rope, pos, inverse } => {
                let (pos_mode, ratio) = match pos {
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
                let args = vec![n_head, head_dim, n_rot, pos_mode, ratio, inverse as u32];
                let binds = vec![(2, Res::Buf(x)), (3, Res::Rope(table as u32))];
                self.push("rope_tail", groups((n_head * n_rot / 2) as usize, 128), args, binds);
            }
            Op::Fp8RoundTrip { x, head_dim, n_rot } => {
                self.push("fp8_round_trip", (head_dim - n_rot) / 64, vec![], vec![(2, Res::Buf(x))]);
            }
            Op::IndexerQat { x, rows, .. } => self.push("indexer_qat", rows, vec![], vec![(2, Res::Buf(x))]),
            Op::StoreRaw { kv, cache, row_dim, raw_cap } => {
                let binds = vec![(2, Res::Buf(kv)), (3, Res::Buf(cache))];
                self.push("store_raw", groups(row_dim as usize, 256), vec![row_dim, raw_cap], binds);
            }
            Op::CompressorStore { kv, score, ape, state_kv, state_score, width, ratio } => {
                let ape = self.vector(ape)?;
                let binds = vec![
                    (2, Res::Buf(kv)),
                    (3, Res::Buf(score)),
                    (4, Res::Buf(state_kv)),
                    (5, Res::Buf(state_score)),
                    (6, ape),
                ];
                self.push("compressor_store", groups(width as usize, 256), vec![width, ratio], binds);
            }
            Op::CompressorPool { state_kv, state_score, out, head_dim, ratio } => {
                let binds = vec![(2, Res::Buf(out)), (4, Res::Buf(state_kv)), (5, Res::Buf(state_score))];
                self.push("compressor_pool", groups(head_dim as usize, 256), vec![head_dim, ratio], binds);
            }
            Op::CompressorShift { state_kv, state_score, width, ratio } => {
                let n = ratio * width;
                let binds = vec![(4, Res::Buf(state_kv)), (5, Res::Buf(state_score))];
                self.push("compressor_shift", groups(n as usize, 256), vec![n], binds);
            }
            Op::StoreCompRow { row, cache, row_dim, ratio } => {
                let binds = vec![(2, Res::Buf(row)), (3, Res::Buf(cache))];
                self.push("store_comp_row", groups(row_dim as usize, 256), vec![row_dim, ratio], binds);
            }
            Op::IndexerScores { q, weights, cache, out, n_head, head_dim, scale, rows } => {
                if n_head > 128 {
                    return Err(format!("indexer of {n_head} heads exceeds the shader's 128"));
                }
                let ratio = comp_ratio(rows.kind)?;
                let args = vec![n_head, head_dim, scale.to_bits(), ratio, rows.cap];
                let binds = vec![(2, Res::Buf(q)), (3, Res::Buf(weights)), (4, Res::Buf(cache)), (5, Res::Buf(out))];
                self.push("indexer_scores", rows.cap.max(1), args, binds);
            }
            Op::IndexerTopK { scores, out, top_k, rows } => {
                self.need(Scratch::Taken, rows.cap as u64 * 4);
                let ratio = comp_ratio(rows.kind)?;
                let binds = vec![(5, Res::Buf(scores)), (6, Res::Buf(out)), (7, Res::Scratch(Scratch::Taken))];
                self.push("indexer_top_k", 1, vec![top_k, ratio, rows.cap], binds);
            }
            Op::Attention { q, raw, comp, selected, top_k, sinks, out, n_head, head_dim, raw_rows, comp_rows } => {
                let window = match raw_rows.kind {
                    BoundKind::RawRows { window } => window,
                    _ => return Err("attention raw rows must be a raw-window bound".into()),
                };
                let ratio = if comp.is_some() { comp_ratio(comp_rows.kind)? } else { 0 };
                let max_rows = raw_rows.cap + comp_rows.cap;
                self.need(Scratch::Scores, (n_head * max_rows) as u64 * 4);
                let args = vec![
                    head_dim,
                    window,
                    raw_rows.cap,
                    ratio,
                    comp_rows.cap,
                    top_k,
                    max_rows,
                    attention_kq_scale(head_dim).to_bits(),
                    selected.is_some() as u32,
                ];
                let sinks = self.vector(sinks)?;
                let binds = vec![
                    (2, Res::Buf(q)),
                    (3, Res::Buf(raw)),
                    (4, comp.map_or(Res::Dummy, Res::Buf)),
                    (5, selected.map_or(Res::Dummy, Res::Buf)),
                    (6, sinks),
                    (7, Res::Buf(out)),
                    (8, Res::Scratch(Scratch::Scores)),
                ];
                self.push("attention", n_head, args, binds);
            }
            Op::RouterSelect { logits, bias, hash, selected, weights, n_used, scale } => {
                let n_expert = self.len(logits) as u32;
                if n_expert > 1024 || n_used > 16 {
                    return Err(format!("router of {n_expert} experts, {n_used} used, exceeds the shader's 1024/16"));
                }
                let b = match bias {
                    Some(b) => self.vector(b)?,
                    None => Res::Dummy,
                };
                let h = match hash {
                    Some(h) => {
                        self.layout(h, Layout::Raw)?;
                        Res::Weight(h, 0)
                    }
                    None => Res::Dummy,
                };
                let args = vec![n_expert, n_used, scale.to_bits(), bias.is_some() as u32, hash.is_some() as u32];
                let binds =
                    vec![(8, Res::Buf(selected)), (9, Res::Buf(weights)), (10, Res::Buf(logits)), (12, b), (13, h)];
                self.push("router_select", 1, args, binds);
            }
            Op::MoeExperts { x, selected, weights, gate, up, down, out, clamp } => {
                let (gt, ut, dt) = (self.program.weight(gate), self.program.weight(up), self.program.weight(down));
                let (in_dim, ff, n_expert) = (gt.dim(0), gt.dim(1), gt.dim(2));
                let out_dim = dt.dim(1);
                let n_used = self.len(selected) as u64;
                let ty = |t: &crate::gguf::TensorInfo| match t.ty {
                    GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K => Ok(t.ty as u32),
                    other => Err(format!("tensor '{}' is {other:?}, not a routed-expert type", t.name)),
                };
                let (g_ty, u_ty, d_ty) = (ty(gt)?, ty(ut)?, ty(dt)?);
                // One expert range for all three tensors: the largest expert decides its size.
                let expert_bytes = [gt, ut, dt].iter().map(|t| t.bytes / n_expert).max().unwrap_or(1);
                let ranges = self.ranges("expert", n_expert, expert_bytes)?;
                for w in [gate, up, down] {
                    self.layout(w, Layout::Experts(ranges.clone()))?;
                }
                let (nbx, nb_mid) = (in_dim / 256, n_used * ff / 256);
                self.need(Scratch::Q8KX, nbx * 81 * 4);
                self.need(Scratch::Q8KMid, nb_mid * 81 * 4);
                self.need(Scratch::Mid, n_used * ff * 4);
                self.need(Scratch::Partial, n_used * out_dim * 4);
                let binds = vec![(5, Res::Scratch(Scratch::Q8KX)), (10, Res::Buf(x))];
                self.push("quantize_q8_k", nbx as u32, vec![nbx as u32], binds);
                let q8k = [(5, Res::Scratch(Scratch::Q8KX)), (6, Res::Scratch(Scratch::Q8KMid)), (7, Res::Grid)];
                // The arguments of the gate/up and down dispatches over experts e0 .. e0 + n.
                // Lanes per expert row: 32, or fewer for rows of fewer than 32 blocks (Flash: 16
                // for gate/up, 8 for down), so that no lane of a 32-lane group idles.
                let width = |blocks: u64| blocks.next_power_of_two().clamp(1, 32) as u32;
                let (w_gu, w_down) = (width(nbx), width(ff / 256));
                let moe_args = |e0: u32, n: u32| {
                    let (in_dim, ff, out_dim, n_used) = (in_dim as u32, ff as u32, out_dim as u32, n_used as u32);
                    let nb_mid = nb_mid as u32;
                    vec![
                        g_ty,
                        u_ty,
                        d_ty,
                        in_dim,
                        ff,
                        out_dim,
                        n_used,
                        e0,
                        e0 + n,
                        clamp.to_bits(),
                        nb_mid,
                        w_gu,
                        w_down,
                    ]
                };
                for (k, &(e0, n)) in ranges.iter().enumerate() {
                    let args = moe_args(e0, n);
                    let k = k as u32;
                    let mut binds = vec![
                        (2, Res::Weight(gate, k)),
                        (3, Res::Weight(up, k)),
                        (4, Res::Weight(down, k)),
                        (8, Res::Buf(selected)),
                        (9, Res::Buf(weights)),
                        (10, Res::Scratch(Scratch::Mid)),
                    ];
                    binds.extend(q8k);
                    match self.rows {
                        true => self.push("moe_gate_up_rows", groups((n_used * ff) as usize, 64), args, binds),
                        false => {
                            let per = 256 / w_gu as usize;
                            self.push("moe_gate_up", groups((n_used * ff) as usize, per), args, binds)
                        }
                    }
                }
                let binds = vec![(5, Res::Scratch(Scratch::Q8KMid)), (10, Res::Scratch(Scratch::Mid))];
                self.push("quantize_q8_k", nb_mid as u32, vec![nb_mid as u32], binds);
                for (k, &(e0, n)) in ranges.iter().enumerate() {
                    let args = moe_args(e0, n);
                    let k = k as u32;
                    let mut binds = vec![
                        (2, Res::Weight(gate, k)),
                        (3, Res::Weight(up, k)),
                        (4, Res::Weight(down, k)),
                        (8, Res::Buf(selected)),
                        (11, Res::Scratch(Scratch::Partial)),
                    ];
                    binds.extend(q8k);
                    match self.rows {
                        true => self.push("moe_down_rows", groups((n_used * out_dim) as usize, 64), args, binds),
                        false => {
                            let per = 256 / w_down as usize;
                            self.push("moe_down", groups((n_used * out_dim) as usize, per), args, binds)
                        }
                    }
                }
                let binds = vec![(10, Res::Buf(out)), (11, Res::Scratch(Scratch::Partial))];
                self.push("moe_sum", groups(out_dim as usize, 256), vec![out_dim as u32, n_used as u32], binds);
            }
            Op::SwiGlu { gate, up, out, clamp } => {
                let n = self.len(out);
                let binds = vec![(2, Res::Buf(gate)), (3, Res::Buf(up)), (4, Res::Buf(out))];
                self.push("swiglu", groups(n, 256), vec![n as u32, clamp.to_bits()], binds);
            }
            Op::Add { a, b, out } => {
                let n = self.len(out);
                let binds = vec![(2, Res::Buf(a)), (3, Res::Buf(b)), (4, Res::Buf(out))];
                self.push("add", groups(n, 256), vec![n as u32], binds);
            }
        }
        Ok(())
    }
}

fn comp_ratio(b: BoundKind) -> Result<u32, String> {
    match b {
        BoundKind::CompRows { ratio } => Ok(ratio),
        _ => Err("expected a compressed-row bound".into()),
    }
}

/// Plans every op of `program`, in order. Weights larger than `max_binding` bytes are split;
/// `rows` picks the one-invocation-per-row matvecs.
pub fn plan(program: &Program, max_binding: u64, rows: bool) -> Result<Plan, String> {
    if program.rows() > 1 {
        return Err(format!("{} (a chunk program of {} rows)", crate::backend::NO_CHUNK_PROGRAMS, program.rows()));
    }
    let mut b = Builder {
        program,
        max_binding,
        rows,
        out: Vec::new(),
        need: Vec::new(),
        ropes: Vec::new(),
        layouts: vec![None; program.weights().len()],
        cond: [0; 3],
        op: 0,
        q8_of: None,
    };
    for (i, step) in program.steps().iter().enumerate() {
        b.op = i;
        b.op(step).map_err(|e| format!("op #{i} ({}): {e}", step.op.name()))?;
        // What an op writes is no longer what was quantized.
        if b.q8_of.is_some_and(|(q, _)| step.op.writes().contains(&q)) {
            b.q8_of = None;
        }
    }
    for d in &b.out {
        if d.args.len() > 28 {
            return Err(format!("{}: {} argument words exceed the 28 the shaders read", d.entry, d.args.len()));
        }
    }
    Ok(Plan { dispatches: b.out, scratch: b.need, ropes: b.ropes, layouts: b.layouts })
}
