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
    /// The Q8_0 quantization of a buffer: packed quants, then the scales. One per quantized
    /// buffer, so that a quantization stays valid until its buffer is written again.
    Q8(Buf),
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
    /// The 512-chunk sums of squares of an HC post's output, for the HC mix that normalizes it.
    HcSumSq,
    /// The HC mix's chunk sums per row (`mat_vec_f16_chunks_norm`), for the hc_pre_norm that
    /// adds them.
    HcMixParts,
}

/// A dispatch's bindings: (binding number, what is bound).
type Binds = Vec<(u32, Res)>;

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
    /// A 16-byte placeholder (one vec4) for a binding the op does not use (an optional input).
    Dummy,
    /// A 16-byte placeholder for an optional output: read-write, so a separate buffer from
    /// `Dummy` (wgpu refuses one buffer bound read-only and read-write in one dispatch).
    DummyOut,
}

/// How a weight is stored on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// A matrix split into row ranges `(first row, rows)`, each its own buffer; Q8_0 repacked per range.
    Rows(Vec<(u32, u32)>),
    /// Routed experts split into expert ranges `(first expert, experts)`, each range repacked
    /// into the split layout (`gpu_tables::repack_blocks`).
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
    /// Later ops this dispatch computes too (fused into it), in program order.
    pub fused: Vec<usize>,
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
        "quantize_q8_0"
        | "mat_vec_q8_0"
        | "mat_vec_q8_0_pair"
        | "mat_vec_f16"
        | "mat_vec_f32"
        | "mat_vec_q8_0_rows"
        | "mat_vec_f16_rows"
        | "mat_vec_f32_rows"
        | "mat_vec_f16_split"
        | "mat_vec_f32_split"
        | "mat_vec_f16_split_norm"
        | "mat_vec_f16_chunks_norm" => "matvec",
        "rms_norm" | "rms_norm_kv" | "kv_finish" | "hc_pre_norm" => "norm",
        "swiglu" | "add" => "elementwise",
        "rope_tail" | "rope_tail_q8" => "rope",
        "embed_hc"
        | "hc_split"
        | "hc_split_weighted_sum"
        | "hc_split_weighted_sum_lanes"
        | "hc_weighted_sum"
        | "hc_post"
        | "hc_post_add"
        | "hc_post_add_moe"
        | "hc_head_weights" => "hc",
        "fp8_round_trip" | "indexer_qat" | "store_raw" | "store_comp_row" | "compressor_store" | "compressor_pool"
        | "compressor_shift" => "kv",
        "indexer_scores" | "indexer_top_k" => "indexer",
        "attention" => "attention",
        "router_select"
        | "quantize_q8_k"
        | "moe_gate_up"
        | "moe_gate_up_iq2_xxs"
        | "moe_down"
        | "moe_down_q2_k_pairs"
        | "moe_sum"
        | "moe_gate_up_rows"
        | "moe_down_rows" => "moe",
        // The device sampler (after a token, not planned).
        "sample_argmax_part"
        | "sample_argmax_final"
        | "sample_hist"
        | "sample_pick"
        | "sample_gather"
        | "sample_final" => "sample",
        "fma_probe" => "probe",
        _ => return None,
    })
}

/// Outputs of an RMS norm row per workgroup (one per invocation) when the output is not the
/// input: each workgroup's quantizations of its outputs (Q8_0 blocks, a Q8_K block) then run
/// once, not once per step of 256 in a chain, and a 4096 row is written by 16 workgroups.
const NORM_SLICE: u32 = 256;

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

/// Bytes of a Q8_K scratch of `blocks` blocks (81 words each), in whole 16-byte vectors: the
/// experts read its quants as vec4<u32>.
fn q8k_bytes(blocks: u64) -> u64 {
    (blocks * 81 * 4).div_ceil(16) * 16
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
    /// Fuse runs of ops into one dispatch (a token's plan); without, each dispatch computes one
    /// op and every Q8_0 matvec quantizes its own input (running single ops: `--isolate`).
    fuse: bool,
    /// Ops an earlier op's dispatches already computed.
    done: Vec<bool>,
    /// The ops the current op's dispatches absorbed so far.
    absorbed: Vec<usize>,
    out: Vec<Dispatch>,
    need: Vec<(Scratch, u64)>,
    ropes: Vec<(RopeParams, u32)>,
    layouts: Vec<Option<Layout>>,
    cond: [u32; 3],
    op: usize,
    /// Buffers whose Q8_0 scratch holds their quantization, and the predicate it ran under.
    q8_of: Vec<(Buf, [u32; 3])>,
    /// The buffer whose Q8_K quantization `Scratch::Q8KX` holds (written by its norm).
    q8k_of: Option<(Buf, [u32; 3])>,
    /// Fuse the HC split, weighted sum and norm into `hc_pre_norm` (else the split and sum share
    /// `hc_split_weighted_sum`, the norm its own `rms_norm`; `DS4_WGPU_HC_PRE=apart`). Warm on
    /// the H200, flash-4l 424.2 / 428.3 tok/s fused against 424.6 / 422.0 apart, 8 fewer
    /// dispatches (the ninth session's "slower" was measured while the GPU's clock ramped up).
    hc_pre_norm: bool,
    /// The HC mixes that an hc_pre_norm reads at one chunk per lane group
    /// (`mat_vec_f16_chunks_norm`), else a row per workgroup (`DS4_WGPU_HC_MIX=rows`).
    hc_mix_chunks: bool,
    /// hc_pre_norm's weighted sum of four streams with its loads unconditional
    /// (`DS4_WGPU_HC_STREAMS=loop` keeps the loop over up to 8 streams).
    hc_streams_unrolled: bool,
    /// The HcSplit op whose hc_pre_norm adds the mix's chunk sums, and the chunks per row.
    mix_parts: Option<(usize, u32)>,
    /// Q8_0 rows of one or two chunks 4 or 2 to a lane group (`q8_short_rows`):
    /// `DS4_WGPU_Q8_ROWS=1` keeps one row per lane group.
    q8_short_rows: bool,
    /// `DS4_WGPU_HC_SPLIT=old`: the HC split and sum as `hc_split_weighted_sum` (every workgroup
    /// runs the Sinkhorn on 256 invocations with a barrier per step), not
    /// `hc_split_weighted_sum_lanes` (only workgroup 0 runs it, on 32 lanes). Same bits.
    hc_split_old: bool,
    /// Q2_K down projections two rows to a lane group (`moe_down_q2_k_pairs`, one read of the
    /// activation block for both), else one (`moe_down`): `Tuning::moe_down_pairs`.
    moe_down_pairs: bool,
    /// A routed-expert sum left to the HC post that adds it (`hc_post_add_moe`, the MoE op's last
    /// dispatch in all but name): the MoE's output buffer, out_dim and n_used.
    moe_sum_later: Option<(Buf, u32, u32)>,
    /// The buffer whose 512-chunk sums of squares `Scratch::HcSumSq` holds (written by its HC
    /// post), and the predicate it ran under.
    ss_of: Option<(Buf, [u32; 3])>,
}

impl Builder<'_> {
    fn push(&mut self, entry: &'static str, groups: u32, args: Vec<u32>, binds: Vec<(u32, Res)>) {
        let fused = self.absorbed.clone();
        self.out.push(Dispatch { op: self.op, fused, entry, groups, cond: self.cond, args, binds });
    }
    /// The routed experts' slot outputs added in slot order into `out`.
    fn push_moe_sum(&mut self, out: Buf, out_dim: u32, n_used: u32) {
        let binds = vec![(10, Res::Buf(out)), (11, Res::Scratch(Scratch::Partial))];
        self.push("moe_sum", groups(out_dim as usize, 256), vec![out_dim, n_used], binds);
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

    /// The Q8_0 scratch of `x`, sized for it: quants, then scales, in whole 16-byte vectors
    /// (mat_vec_q8_0 reads it as vec4<u32>).
    fn q8_scratch(&mut self, x: Buf) -> Res {
        let n = self.len(x) as u64;
        self.need(Scratch::Q8(x), (n + n / 32 * 4).div_ceil(16) * 16);
        Res::Scratch(Scratch::Q8(x))
    }
    /// Whether `x`'s Q8_0 scratch holds its quantization whenever the current op runs.
    fn q8_fresh(&self, x: Buf) -> bool {
        self.q8_of.iter().any(|&(q, c)| q == x && self.holds_now(c))
    }
    /// Whether what a dispatch under predicate `c` wrote holds whenever the current op runs: it
    /// ran unconditionally, or under the same predicate.
    fn holds_now(&self, c: [u32; 3]) -> bool {
        c == [0; 3] || c == self.cond
    }
    /// What the ops in `writes` write is no longer what was quantized (nor what the HC sums of
    /// squares were made of).
    fn q8_written(&mut self, writes: &[Buf]) {
        self.q8_of.retain(|(q, _)| !writes.contains(q));
        if self.q8k_of.is_some_and(|(q, _)| writes.contains(&q)) {
            self.q8k_of = None;
        }
        if self.ss_of.is_some_and(|(q, _)| writes.contains(&q)) {
            self.ss_of = None;
        }
    }
    /// An HC post's `with_ss` argument (its third word) and its SS binding: whether the post
    /// writing `out` also stores its 512-chunk sums of squares, for an HC mix of `out` that
    /// reads them (`mat_vec_f16_split_norm`; fused plans on 32-lane adapters). Records it for
    /// that mix.
    fn hc_post_ss(&mut self, out: Buf) -> (u32, Res) {
        if !self.fuse || self.rows {
            return (0, Res::DummyOut);
        }
        let n = self.len(out) as u64;
        self.need(Scratch::HcSumSq, n.div_ceil(512) * 4);
        self.ss_of = Some((out, self.cond));
        (1, Res::Scratch(Scratch::HcSumSq))
    }
    /// Whether the next routed-experts op reads `buf`, under the current op's predicate, before
    /// any op writes it: then the norm writing `buf` also writes its Q8_K quantization.
    fn moe_reads_later(&self, buf: Buf) -> bool {
        if !self.fuse || !self.len(buf).is_multiple_of(256) {
            return false;
        }
        let steps = self.program.steps();
        for (k, st) in steps.iter().enumerate().skip(self.op + 1) {
            if self.done[k] {
                continue;
            }
            if let Op::MoeExperts { x, .. } = st.op {
                return x == buf && pack_cond(st.cond) == self.cond;
            }
            if st.op.writes().contains(&buf) {
                return false;
            }
        }
        false
    }
    /// Whether a later Q8_0 matvec reads `buf` before any op writes it: then the op writing
    /// `buf` now also writes its quantization (norms, SwiGLU).
    fn q8_read_later(&self, buf: Buf) -> bool {
        if !self.fuse || !self.len(buf).is_multiple_of(32) {
            return false;
        }
        let steps = self.program.steps();
        for (k, st) in steps.iter().enumerate().skip(self.op + 1) {
            if self.done[k] {
                continue;
            }
            if let Op::MatVec { w, x, .. } | Op::MatVecGrouped { w, x, .. } = st.op {
                if x == buf && self.program.weight(w).ty == GgmlType::Q8_0 {
                    return true;
                }
            }
            if st.op.writes().contains(&buf) {
                return false;
            }
        }
        false
    }
    /// Whether the routed experts' sum into `out` (the current op's) can be left to the HC post
    /// that adds it (`hc_post_add_moe`): the first later op to touch `out` is an Add of it as
    /// `a` under this op's predicate, the HcPost of that sum comes right after, no MoE between
    /// writes the slots' outputs (`Scratch::Partial`), and nothing after the Add reads `out`.
    fn moe_sum_in_hc_post(&self, out: Buf) -> bool {
        let steps = self.program.steps();
        let touches = |k: usize| steps[k].op.reads().contains(&out) || steps[k].op.writes().contains(&out);
        let Some(k) = (self.op + 1..steps.len()).find(|&k| touches(k)) else {
            return false;
        };
        let Op::Add { a, b, out: sum } = steps[k].op else {
            return false;
        };
        if !self.fuse || self.done[k] || a != out || b == out || pack_cond(steps[k].cond) != self.cond {
            return false;
        }
        if steps[self.op + 1..k].iter().any(|st| matches!(st.op, Op::MoeExperts { .. })) {
            return false;
        }
        if !matches!(steps.get(k + 1).map(|st| &st.op), Some(Op::HcPost { block, .. }) if *block == sum) {
            return false;
        }
        for st in &steps[k + 1..] {
            if st.op.reads().contains(&out) {
                return false;
            }
            if st.op.writes().contains(&out) {
                break;
            }
        }
        true
    }

    /// Marks op `k` as computed by the current op's dispatches.
    fn absorb(&mut self, k: usize) {
        self.done[k] = true;
        self.absorbed.push(k);
        let writes = self.program.steps()[k].op.writes();
        self.q8_written(&writes);
    }
    /// The next op after the current one that no dispatch computed yet, if it has the current
    /// op's predicate.
    fn next_op(&self) -> Option<(usize, &Op)> {
        let steps = self.program.steps();
        let k = (self.op + 1..steps.len()).find(|&k| !self.done[k])?;
        (pack_cond(steps[k].cond) == self.cond).then_some((k, &steps[k].op))
    }
    /// Whether op `j` may run now, before the ops between: it has the current op's predicate,
    /// and none of them writes what it reads or reads or writes what it writes.
    fn can_run_early(&self, j: usize) -> bool {
        let steps = self.program.steps();
        if self.done[j] || pack_cond(steps[j].cond) != self.cond {
            return false;
        }
        let (r, w) = (steps[j].op.reads(), steps[j].op.writes());
        steps[self.op..j].iter().all(|st| {
            let (r2, w2) = (st.op.reads(), st.op.writes());
            !w2.iter().any(|b| r.contains(b) || w.contains(b)) && !r2.iter().any(|b| w.contains(b))
        })
    }
    /// Whether ops `i` and `j` may not change places: one writes what the other reads or writes.
    fn conflict(&self, i: usize, j: usize) -> bool {
        let steps = self.program.steps();
        let (ri, wi, rj, wj) = (steps[i].op.reads(), steps[i].op.writes(), steps[j].op.reads(), steps[j].op.writes());
        wi.iter().any(|b| rj.contains(b) || wj.contains(b)) || ri.iter().any(|b| wj.contains(b))
    }
    /// The ops after op `at` that no dispatch computed yet, as far as the fusions look (six).
    fn ahead(&self, at: usize) -> impl Iterator<Item = usize> + '_ {
        (at + 1..self.program.steps().len()).filter(|&k| !self.done[k]).take(6)
    }
    /// The next op to read or write `buf`, among those [`Self::ahead`] of the current one.
    fn next_touching(&self, buf: Buf) -> Option<usize> {
        let steps = self.program.steps();
        self.ahead(self.op).find(|&k| steps[k].op.reads().contains(&buf) || steps[k].op.writes().contains(&buf))
    }
    /// Whether ops `set` (later ops, ascending) may run now, in the current op's dispatch: they
    /// have its predicate, and no op between that stays behind conflicts with one that moves
    /// ahead of it.
    fn can_join(&self, set: &[usize]) -> bool {
        let steps = self.program.steps();
        let last = set.last().copied().unwrap_or(self.op);
        set.iter().all(|&j| !self.done[j] && pack_cond(steps[j].cond) == self.cond)
            && (self.op + 1..last)
                .filter(|i| !self.done[*i] && !set.contains(i))
                .all(|i| set.iter().filter(|&&j| j > i).all(|&j| !self.conflict(i, j)))
    }

    /// The ops after the KV row's norm (op `at`, `x` into `out`, `n` values) that `kv_finish`
    /// computes with it: the RoPE of its tail, its fp8 round trip and its store into the raw
    /// ring (other ops may come between: the query's RoPE). ([rope, fp8, store], the RoPE's
    /// setting, n_rot, the ring, its rows.)
    fn kv_finish_ops(&self, at: usize, x: Buf, out: Buf, n: u32) -> Option<([usize; 3], RopeParams, u32, Buf, u32)> {
        let steps = self.program.steps();
        let ahead: Vec<usize> = self.ahead(at).collect();
        let find = |f: &dyn Fn(&Op) -> bool| ahead.iter().copied().find(|&k| f(&steps[k].op));
        let j1 = find(&|op| {
            matches!(*op, Op::RopeTail { x: rx, n_head: 1, head_dim, pos: RopePos::Current, inverse: false, .. }
                if rx == out && head_dim == n)
        })?;
        let Op::RopeTail { n_rot, rope, .. } = steps[j1].op else { return None };
        let j2 = find(
            &|op| matches!(*op, Op::Fp8RoundTrip { x: fx, head_dim, n_rot: r } if fx == out && head_dim == n && r == n_rot),
        )?;
        let j3 = find(&|op| matches!(*op, Op::StoreRaw { kv, row_dim, .. } if kv == out && row_dim == n))?;
        let Op::StoreRaw { cache, raw_cap, .. } = steps[j3].op else { return None };
        let shape_ok = n <= 1024
            && n_rot <= n
            && n_rot.is_multiple_of(2)
            && (n - n_rot).is_multiple_of(64)
            && x != out
            && cache != out;
        (shape_ok && j1 < j2 && j2 < j3).then_some(([j1, j2, j3], rope, n_rot, cache, raw_cap))
    }

    /// At the KV row's norm: what follows it in `kv_finish_ops` fuses into one `kv_finish`.
    /// Returns whether it did.
    fn try_kv_finish(&mut self, x: Buf, weight: Res, out: Buf, n: u32, eps: f32) -> bool {
        let Some((js, rope, n_rot, cache, raw_cap)) = self.kv_finish_ops(self.op, x, out, n) else { return false };
        if !self.can_join(&js) {
            return false;
        }
        for j in js {
            self.absorb(j);
        }
        let table = self.rope_table(rope, n_rot);
        // 2: the norm's row, which the row reader names (unread here).
        let binds = vec![
            (2, Res::Dummy),
            (15, Res::Buf(x)),
            (16, Res::Buf(out)),
            (17, weight),
            (6, Res::Rope(table)),
            (7, Res::Buf(cache)),
        ];
        self.push("kv_finish", 1, vec![n, eps.to_bits(), n_rot, raw_cap], binds);
        true
    }

    /// At the query heads' norm and RoPE (rotated with RoPE table `table`): a KV row's norm a
    /// few ops ahead and what `kv_finish` fuses with it join the dispatch as its last
    /// workgroup (`rms_norm_kv`), where they may run now, beside the heads' norm (they share no
    /// buffer with it) and with the same RoPE table. Returns the KV part's args (n, eps, n_rot,
    /// raw_cap) and bindings.
    fn kv_beside_norm(&mut self, table: u32) -> Result<Option<(Vec<u32>, Binds)>, String> {
        if !self.fuse {
            return Ok(None);
        }
        let steps = self.program.steps();
        let found = self.ahead(self.op).find(|&k| matches!(steps[k].op, Op::RmsNorm { weight: Some(_), rows: 1, .. }));
        let Some(k) = found else { return Ok(None) };
        let Op::RmsNorm { x, weight: Some(w), out, n, rows: 1, eps } = steps[k].op else { return Ok(None) };
        let Some((js, rope, n_rot, cache, raw_cap)) = self.kv_finish_ops(k, x, out, n) else { return Ok(None) };
        let same_table = self.ropes.iter().position(|r| *r == (rope, n_rot)) == Some(table as usize);
        let set = [k, js[0], js[1], js[2]];
        // Workgroups of one dispatch run together: nothing the heads' ops touch may be touched.
        let mine: Vec<usize> = std::iter::once(self.op).chain(self.absorbed.iter().copied()).collect();
        let independent = mine.iter().all(|&i| set.iter().all(|&j| !self.conflict(i, j)));
        if !(same_table && independent && self.can_join(&set)) {
            return Ok(None);
        }
        let wv = self.vector(w)?;
        for j in set {
            self.absorb(j);
        }
        let binds = vec![(15, Res::Buf(x)), (16, Res::Buf(out)), (17, wv), (7, Res::Buf(cache))];
        Ok(Some((vec![n, eps.to_bits(), n_rot, raw_cap], binds)))
    }

    /// At a norm without weight whose output the next op multiplies by a split-K F16 matrix (the
    /// HC mix projections): one `mat_vec_f16_split_norm` does both. Returns whether it did.
    fn try_norm_mat_vec(&mut self, x: Buf, out: Buf, n: u32, eps: f32) -> Result<bool, String> {
        let Some((j, &Op::MatVec { w, x: mx, out: mix })) = self.next_op() else { return Ok(false) };
        let t = self.program.weight(w);
        let (in_dim, rows) = (t.dim(0), t.dim(1));
        let one_range = rows * t.ty.row_bytes(in_dim as usize) as u64 <= self.max_binding.saturating_sub(16);
        let fits = t.ty == GgmlType::F16 && in_dim == n as u64 && n.is_multiple_of(2) && split_k(rows as u32, in_dim);
        if self.rows || mx != out || mix == x || mix == out || x == out || !fits || !one_range {
            return Ok(false);
        }
        // The HC post that wrote x left its sums of squares.
        let from_ss = self.ss_of.is_some_and(|(b, c)| b == x && self.holds_now(c));
        self.absorb(j);
        self.layout(w, Layout::Rows(vec![(0, rows as u32)]))?;
        // The split-K pair's bindings, unread here.
        let mut binds = vec![
            (2, Res::Weight(w, 0)),
            (3, Res::Buf(x)),
            (4, Res::Buf(mix)),
            (7, Res::Buf(mix)),
            (8, Res::Buf(out)),
            (9, Res::Weight(w, 0)),
            (10, if from_ss { Res::Scratch(Scratch::HcSumSq) } else { Res::Dummy }),
        ];
        // Where an hc_pre_norm reads the mix next and nothing after it does, one chunk per lane
        // group, the chunk sums left for hc_pre_norm to add.
        let nc = n / 512;
        let split = self.ahead(j).next().filter(|_| self.hc_mix_chunks && n.is_multiple_of(512));
        let chunked = split.filter(|&k| match self.program.steps()[k].op {
            Op::HcSplit { mix: m, split, n_hc, .. } if m == mix && (1..=8).contains(&n_hc) => {
                self.hc_pre_norm_ops(k, mix, split, n_hc).is_some() && !self.read_before_rewritten(mix, k)
            }
            _ => false,
        });
        if let Some(k) = chunked {
            let wgs = (rows as u32 * nc).div_ceil(8);
            binds[2] = (4, Res::Scratch(Scratch::HcMixParts));
            self.need(Scratch::HcMixParts, rows * nc as u64 * 4);
            self.mix_parts = Some((k, nc));
            let args = vec![n, rows as u32, wgs, 0, eps.to_bits(), 0, from_ss as u32];
            self.push("mat_vec_f16_chunks_norm", wgs, args, binds);
            return Ok(true);
        }
        let args = vec![n, rows as u32, rows as u32, 0, eps.to_bits(), 0, from_ss as u32];
        self.push("mat_vec_f16_split_norm", rows as u32, args, binds);
        Ok(true)
    }

    /// Whether an op after op `at` reads `buf` before an op that runs every token rewrites it.
    fn read_before_rewritten(&self, buf: Buf, at: usize) -> bool {
        for st in &self.program.steps()[at + 1..] {
            if st.op.reads().contains(&buf) {
                return true;
            }
            if st.cond.is_none() && st.op.writes().contains(&buf) {
                return false;
            }
        }
        false
    }

    /// The HcWeightedSum and RmsNorm that one `hc_pre_norm` computes with the HcSplit at op `at`
    /// (of `mix` into `split`, `n_hc` streams), if the plan fuses them and they have its shape.
    fn hc_pre_norm_ops(&self, at: usize, mix: Buf, split: Buf, n_hc: u32) -> Option<(usize, usize)> {
        if !self.fuse || !self.hc_pre_norm {
            return None;
        }
        let steps = self.program.steps();
        let ahead: Vec<usize> = (at + 1..steps.len()).filter(|&k| !self.done[k]).take(2).collect();
        let &[j1, j2] = ahead.as_slice() else { return None };
        let Op::HcWeightedSum { hc, weights, out: cur, n_hc: n2 } = steps[j1].op else { return None };
        let Op::RmsNorm { x, weight: Some(_), out, n, rows: 1, .. } = steps[j2].op else { return None };
        let bufs = [mix, split, hc, cur, out];
        let distinct = (0..5).all(|i| (i + 1..5).all(|k| bufs[i] != bufs[k]));
        let shape = weights == split
            && n2 == n_hc
            && x == cur
            && self.len(cur) == n as usize
            && self.len(hc) == (n * n_hc) as usize
            && n.is_multiple_of(NORM_SLICE);
        let same_cond = [at, j1, j2].iter().all(|&k| pack_cond(steps[k].cond) == self.cond);
        (distinct && shape && same_cond).then_some((j1, j2))
    }

    /// At an HcSplit followed by the HcWeightedSum of its pre weights and the RmsNorm (with
    /// weight) of that sum (the HC pre-mix's tail): one `hc_pre_norm` computes all three, the
    /// Sinkhorn once, in a workgroup beside the norm's. Returns whether it did.
    #[allow(clippy::too_many_arguments)]
    fn try_hc_pre_norm(
        &mut self,
        mix: Buf,
        scale: Res,
        base: Res,
        split: Buf,
        n_hc: u32,
        iters: u32,
        eps_hc: f32,
    ) -> Result<bool, String> {
        let parts = self.mix_parts.take();
        if parts.is_some_and(|(k, _)| k != self.op) {
            return Err("the HC mix's chunk sums were planned for another HC split".into());
        }
        let Some((j1, j2)) = self.hc_pre_norm_ops(self.op, mix, split, n_hc) else {
            return match parts {
                Some(_) => Err("the HC mix's chunk sums were planned for an hc_pre_norm that is not".into()),
                None => Ok(false),
            };
        };
        let steps = self.program.steps();
        let Op::HcWeightedSum { hc, out: cur, .. } = steps[j1].op else { unreachable!() };
        let Op::RmsNorm { weight: Some(nw), out, n, eps, .. } = steps[j2].op else { unreachable!() };
        self.absorb(j1);
        self.absorb(j2);
        let wv = self.vector(nw)?;
        // As rms_norm plans a row that is not its own output: slices of NORM_SLICE, each
        // writing the quantizations that later matvecs and experts read. Each slice's workgroup
        // sums the whole weighted sum itself: on adapters that run on CPU cores (`rows`), where
        // that is no longer parallel, one workgroup takes the whole row.
        let per = if self.rows { n } else { NORM_SLICE };
        let slices = n / per;
        let q8 = self.q8_read_later(out);
        let xq = if q8 { self.q8_scratch(out) } else { Res::DummyOut };
        let q8k = self.moe_reads_later(out);
        let xk = match q8k {
            true => {
                self.need(Scratch::Q8KX, q8k_bytes(n as u64 / 256));
                Res::Scratch(Scratch::Q8KX)
            }
            false => Res::DummyOut,
        };
        let binds = vec![
            (2, Res::Buf(hc)),
            (3, Res::Buf(out)),
            (4, wv),
            (5, xq),
            (6, Res::Dummy),
            (9, xk),
            (10, if parts.is_some() { Res::Scratch(Scratch::HcMixParts) } else { Res::Buf(mix) }),
            (11, scale),
            (12, base),
            (13, Res::Buf(split)),
            (14, Res::Buf(cur)),
            (15, Res::Dummy),
        ];
        let nc = parts.map_or(0, |(_, nc)| nc);
        let args = vec![
            n,
            eps.to_bits(),
            1,
            slices,
            per,
            slices,
            q8 as u32,
            q8k as u32,
            0,
            0,
            n_hc,
            iters,
            eps_hc.to_bits(),
            nc,
            self.hc_streams_unrolled as u32,
        ];
        if q8 {
            self.q8_of.push((out, self.cond));
        }
        if q8k {
            self.q8k_of = Some((out, self.cond));
        }
        // The norm's slices, then the Sinkhorn's workgroup.
        self.push("hc_pre_norm", slices + 1, args, binds);
        Ok(true)
    }

    /// The RoPE at the current position of `rows` heads of `n` (the whole buffer `out`), if it is
    /// the next op to touch `out` and may run now: (op, its setting, n_rot).
    fn rope_after_norm(&self, out: Buf, n: u32, rows: u32) -> Option<(usize, RopeParams, u32)> {
        if !self.fuse || self.len(out) != (n * rows) as usize || !n.is_multiple_of(2) {
            return None;
        }
        let steps = self.program.steps();
        let j = self.next_touching(out)?;
        match steps[j].op {
            Op::RopeTail { x, n_head, head_dim, n_rot, rope, pos: RopePos::Current, inverse: false }
                if x == out
                    && n_head == rows
                    && head_dim == n
                    && n_rot <= n
                    && n_rot.is_multiple_of(2)
                    && self.can_join(&[j]) =>
            {
                Some((j, rope, n_rot))
            }
            _ => None,
        }
    }

    /// At the attention: the inverse RoPE of the heads' tails that follows it, when the next op
    /// to touch its output and a Q8_0 matvec then reads the rotated heads (wo_a): the attention
    /// does both, as rope_tail_q8 would (kernels/attention.cu's tail). Absorbs the RoPE; returns
    /// its table and n_rot.
    fn attention_tail(&mut self, out: Buf, n_head: u32, head_dim: u32) -> Option<(u32, u32)> {
        if !self.fuse || self.len(out) != (n_head * head_dim) as usize || !head_dim.is_multiple_of(32) {
            return None;
        }
        let steps = self.program.steps();
        let j = self.next_touching(out)?;
        let Op::RopeTail { x, n_head: nh, head_dim: hd, n_rot, rope, pos: RopePos::Current, inverse: true } =
            steps[j].op
        else {
            return None;
        };
        if x != out || nh != n_head || hd != head_dim || n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return None;
        }
        if !self.can_join(&[j]) {
            return None;
        }
        // Whether the rotated heads are quantized for a matvec, asked as if the RoPE were done.
        self.done[j] = true;
        let q8 = self.q8_read_later(out);
        self.done[j] = false;
        if !q8 {
            return None;
        }
        self.absorb(j);
        Some((self.rope_table(rope, n_rot), n_rot))
    }

    /// The table index of a RoPE setting, added on first use.
    fn rope_table(&mut self, rope: RopeParams, n_rot: u32) -> u32 {
        match self.ropes.iter().position(|r| *r == (rope, n_rot)) {
            Some(i) => i as u32,
            None => {
                self.ropes.push((rope, n_rot));
                self.ropes.len() as u32 - 1
            }
        }
    }

    /// A later ungrouped matvec of the same input, weight type and width, in one binding, that
    /// may run in the current op's dispatch (two matrices, one dispatch); F16 ones only where
    /// both run split-K. Looks a few ops ahead.
    fn partner(&self, x: Buf, ty: GgmlType, in_dim: u64) -> Option<(usize, WeightId, Buf)> {
        if !self.fuse || self.rows {
            return None;
        }
        let steps = self.program.steps();
        for (j, st) in steps.iter().enumerate().take(self.op + 8).skip(self.op + 1) {
            if let Op::MatVec { w, x: x2, out } = st.op {
                let t = self.program.weight(w);
                let one_range =
                    t.dim(1) * (t.ty.row_bytes(in_dim as usize) as u64) <= self.max_binding.saturating_sub(16);
                let shape = ty == GgmlType::Q8_0 || split_k(t.dim(1) as u32, in_dim);
                if x2 == x && t.ty == ty && t.dim(0) == in_dim && shape && one_range && self.can_run_early(j) {
                    return Some((j, w, out));
                }
            }
        }
        None
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
                // Matvecs of one input (q_a and kv, the shared expert's gate and up) quantize it
                // once, if nothing wrote it since and the quantization ran whenever this op runs
                // (a norm or SwiGLU may have written it with its output).
                let q8 = self.q8_scratch(x);
                if !self.q8_fresh(x) {
                    let n = self.len(x) as u64;
                    let binds = vec![(3, Res::Buf(x)), (5, q8)];
                    self.push("quantize_q8_0", groups(n as usize / 32, 8), vec![n as u32, (n / 4) as u32], binds);
                    if self.fuse {
                        self.q8_of.push((x, self.cond));
                    }
                }
                "mat_vec_q8_0"
            }
            GgmlType::F16 if in_dim % 2 == 0 => "mat_vec_f16",
            GgmlType::F32 => "mat_vec_f32",
            other => return Err(format!("tensor '{}' of type {other:?} is not a dense matrix here", t.name)),
        };
        let n = self.len(x) as u32;
        // A second ungrouped Q8_0 matrix of this input shares the dispatch.
        if entry == "mat_vec_q8_0" && groups_n == 1 && ranges.len() == 1 {
            if let Some((j, w2, out2)) = self.partner(x, GgmlType::Q8_0, in_dim) {
                let rows2 = self.program.weight(w2).dim(1) as u32;
                self.layout(w2, Layout::Rows(vec![(0, rows2)]))?;
                self.absorb(j);
                let rows = rows as u32;
                let nb = in_dim as u32 / 32;
                let args = vec![in_dim as u32, rows, n / 4, rows * nb * 8, rows2, rows2 * nb * 8];
                let binds = vec![
                    (2, Res::Weight(w, 0)),
                    (4, Res::Buf(out)),
                    (5, Res::Scratch(Scratch::Q8(x))),
                    (6, Res::Weight(w2, 0)),
                    (7, Res::Buf(out2)),
                ];
                self.push("mat_vec_q8_0_pair", groups((rows + rows2) as usize, 8), args, binds);
                return Ok(());
            }
        }
        for (k, &(row0, rows)) in ranges.iter().enumerate() {
            let mut args = vec![in_dim as u32, rows, rows_per_group, row0];
            let mut binds = vec![(2, Res::Weight(w, k as u32)), (3, Res::Buf(x)), (4, Res::Buf(out))];
            // Rows per 32 lanes for mat_vec_q8_0: short rows share a lane group (q8_short_rows).
            let nb = in_dim as u32 / 32;
            let per = match (self.q8_short_rows, nb) {
                (true, 0..=32) => 4,
                (true, 33..=64) => 2,
                _ => 1,
            };
            if entry == "mat_vec_q8_0" {
                args.extend([n / 4, rows * nb * 8, per]);
                binds.push((5, Res::Scratch(Scratch::Q8(x))));
                // The pair entry's second matrix and output, unused here (the shader names them).
                binds.extend([(6, Res::Weight(w, k as u32)), (7, Res::Buf(out))]);
            }
            if self.rows {
                let entry = match entry {
                    "mat_vec_q8_0" => "mat_vec_q8_0_rows",
                    "mat_vec_f16" => "mat_vec_f16_rows",
                    _ => "mat_vec_f32_rows",
                };
                self.push(entry, groups(rows as usize, 64), args, binds);
            } else if entry != "mat_vec_q8_0" && split_k(rows, in_dim) {
                // A second F16 matrix of this input (the compressor's kv and score) shares the
                // dispatch: its rows on workgroups rows .. rows + rows2.
                let pair = match entry == "mat_vec_f16" && groups_n == 1 && ranges.len() == 1 {
                    true => self.partner(x, GgmlType::F16, in_dim),
                    false => None,
                };
                let (w2, out2, rows2) = match pair {
                    Some((j, w2, out2)) => {
                        let rows2 = self.program.weight(w2).dim(1) as u32;
                        self.layout(w2, Layout::Rows(vec![(0, rows2)]))?;
                        self.absorb(j);
                        (w2, out2, rows2)
                    }
                    None => (w, out, 0),
                };
                args.extend([0, rows2]);
                // Without a partner, the second matrix's bindings repeat the first's (unread).
                binds.extend([(7, Res::Buf(out2)), (9, Res::Weight(w2, k as u32))]);
                let entry = if entry == "mat_vec_f16" { "mat_vec_f16_split" } else { "mat_vec_f32_split" };
                self.push(entry, rows + rows2, args, binds);
            } else if entry == "mat_vec_q8_0" {
                self.push(entry, groups(rows as usize, 8 * per as usize), args, binds);
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
                if self.fuse && rows == 1 && weight.is_some() && self.try_kv_finish(x, wv, out, n, eps) {
                    return Ok(());
                }
                if self.fuse && rows == 1 && weight.is_none() && self.try_norm_mat_vec(x, out, n, eps)? {
                    return Ok(());
                }
                // Long rows are written by several workgroups, each summing the whole row
                // (the same bits in each); in place, one workgroup must read before it writes.
                let per = if x == out { n.max(1) } else { NORM_SLICE };
                let slices = n.div_ceil(per).max(1);
                // One row read by Q8_0 matvecs: the norm writes its quantization too.
                // Heads whose RoPE comes next (the query's): the norm rotates them too.
                let rope = self.rope_after_norm(out, n, rows);
                let (rope_args, table) = match rope {
                    Some((j, params, n_rot)) => {
                        self.absorb(j);
                        ([1, n_rot], Res::Rope(self.rope_table(params, n_rot)))
                    }
                    None => ([0, 0], Res::Dummy),
                };
                // The query heads' norm: the KV row's norm and finish may run beside it.
                let kv = match table {
                    Res::Rope(t) if rows > 1 => self.kv_beside_norm(t)?,
                    _ => None,
                };
                let q8 = rows == 1 && self.q8_read_later(out);
                let xq = if q8 { self.q8_scratch(out) } else { Res::DummyOut };
                // One row the routed experts read: the norm writes its Q8_K blocks too.
                let q8k = rows == 1 && per.is_multiple_of(256) && self.moe_reads_later(out);
                let xk = match q8k {
                    true => {
                        self.need(Scratch::Q8KX, q8k_bytes(n as u64 / 256));
                        Res::Scratch(Scratch::Q8KX)
                    }
                    false => Res::DummyOut,
                };
                // 15: kv_finish's row, which the norm's row reader names (unread here).
                let mut binds =
                    vec![(2, Res::Buf(x)), (3, Res::Buf(out)), (4, wv), (5, xq), (6, table), (9, xk), (15, Res::Dummy)];
                let flags = [q8 as u32, q8k as u32, rope_args[0], rope_args[1]];
                let args =
                    [vec![n, eps.to_bits(), weight.is_some() as u32, slices, per, rows * slices], flags.to_vec()];
                let mut args = args.concat();
                if q8 {
                    self.q8_of.push((out, self.cond));
                }
                if q8k {
                    self.q8k_of = Some((out, self.cond));
                }
                if let Some((kv_args, kv_binds)) = kv {
                    // The KV row's workgroup after the heads' (args 10: its index, 11..14: kv_finish's).
                    args.push(rows * slices);
                    args.extend(kv_args);
                    binds.retain(|(k, _)| kv_binds.iter().all(|(k2, _)| k2 != k));
                    binds.extend(kv_binds);
                    self.push("rms_norm_kv", rows * slices + 1, args, binds);
                    return Ok(());
                }
                self.push("rms_norm", rows * slices, args, binds);
            }
            Op::MatVec { w, x, out } => self.mat_vec(w, x, out, 1)?,
            Op::MatVecGrouped { w, x, out, groups } => self.mat_vec(w, x, out, groups)?,
            Op::HcSplit { mix, scale, base, split, n_hc, iters, eps } => {
                if n_hc == 0 || n_hc > 8 {
                    return Err(format!("the HC shader takes 1 to 8 streams, not {n_hc}"));
                }
                let (s, b) = (self.vector(scale)?, self.vector(base)?);
                if self.try_hc_pre_norm(mix, s, b, split, n_hc, iters, eps)? {
                    return Ok(());
                }
                // The weighted sum of the streams by the pre weights right after: each of its
                // workgroups runs the (tiny) Sinkhorn itself, one dispatch instead of two.
                if let Some((j, &Op::HcWeightedSum { hc, weights, out, n_hc: n2 })) = self.next_op() {
                    let bufs = [mix, split, hc, out];
                    let distinct = (0..4).all(|i| (i + 1..4).all(|k| bufs[i] != bufs[k]));
                    if self.fuse && weights == split && n2 == n_hc && distinct {
                        self.absorb(j);
                        let n = self.len(out);
                        let binds = vec![
                            (2, Res::Buf(mix)),
                            (3, Res::Buf(hc)),
                            (4, Res::Buf(out)),
                            (5, Res::Buf(split)),
                            (6, s),
                            (7, b),
                        ];
                        let args = vec![n_hc, iters, eps.to_bits(), n as u32];
                        let entry = match self.hc_split_old {
                            true => "hc_split_weighted_sum",
                            false => "hc_split_weighted_sum_lanes",
                        };
                        self.push(entry, groups(n, 256), args, binds);
                        return Ok(());
                    }
                }
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
                let (with_ss, ss) = self.hc_post_ss(out);
                let binds = vec![
                    (2, Res::Buf(block)),
                    (3, Res::Buf(residual)),
                    (4, Res::Buf(split)),
                    (5, Res::Buf(out)),
                    (12, ss),
                ];
                // 4 outputs an invocation (hc.wgsl post_at).
                self.push("hc_post", groups(n * n_hc as usize, 1024), vec![n as u32, n_hc, with_ss], binds);
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
                let table = self.rope_table(rope, n_rot);
                let mut args = vec![n_head, head_dim, n_rot, pos_mode, ratio, inverse as u32];
                // Rows read next by a Q8_0 matvec (the attention output before wo_a): one dispatch
                // rotates and quantizes.
                let n = self.len(x) as u32;
                let whole = n == n_head * head_dim
                    && head_dim.is_multiple_of(2)
                    && n_rot.is_multiple_of(2)
                    && n_rot <= head_dim;
                if whole && self.q8_read_later(x) {
                    let xq = self.q8_scratch(x);
                    args.push(n);
                    let binds = vec![(2, Res::Buf(x)), (3, Res::Rope(table)), (4, xq)];
                    self.push("rope_tail_q8", groups(n as usize, 256), args, binds);
                    self.q8_of.push((x, self.cond));
                    return Ok(());
                }
                let binds = vec![(2, Res::Buf(x)), (3, Res::Rope(table))];
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
                let ratio = comp_ratio(rows.kind)?;
                let binds = vec![(5, Res::Buf(scores)), (6, Res::Buf(out))];
                self.push("indexer_top_k", 1, vec![top_k, ratio, rows.cap], binds);
            }
            Op::Attention { q, raw, comp, selected, top_k, sinks, out, n_head, head_dim, raw_rows, comp_rows } => {
                let window = match raw_rows.kind {
                    BoundKind::RawRows { window } => window,
                    _ => return Err("attention raw rows must be a raw-window bound".into()),
                };
                let ratio = if comp.is_some() { comp_ratio(comp_rows.kind)? } else { 0 };
                let max_rows = raw_rows.cap + comp_rows.cap;
                if head_dim % 4 != 0 || head_dim > 1024 {
                    return Err(format!(
                        "attention heads of {head_dim} dims: the shader needs a multiple of 4, at most 1024"
                    ));
                }
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
                let mut args = args;
                let (table, xq) = match self.attention_tail(out, n_head, head_dim) {
                    Some((table, n_rot)) => {
                        args.extend([1, n_rot, n_head * head_dim]);
                        (Res::Rope(table), self.q8_scratch(out))
                    }
                    None => {
                        args.extend([0, 0, 0]);
                        (Res::Dummy, Res::DummyOut)
                    }
                };
                let binds = vec![
                    (2, Res::Buf(q)),
                    (3, Res::Buf(raw)),
                    (4, comp.map_or(Res::Dummy, Res::Buf)),
                    (5, selected.map_or(Res::Dummy, Res::Buf)),
                    (6, sinks),
                    (7, Res::Buf(out)),
                    (8, Res::Scratch(Scratch::Scores)),
                    (9, table),
                    (10, xq),
                ];
                self.push("attention", n_head, args, binds);
                if xq != Res::DummyOut {
                    self.q8_of.push((out, self.cond));
                }
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
                self.need(Scratch::Q8KX, q8k_bytes(nbx));
                self.need(Scratch::Q8KMid, q8k_bytes(nb_mid));
                self.need(Scratch::Mid, n_used * ff * 4);
                self.need(Scratch::Partial, n_used * out_dim * 4);
                // The input's Q8_K blocks, unless its norm wrote them under this op's predicate.
                if !matches!(self.q8k_of, Some((q, c)) if q == x && self.holds_now(c)) {
                    let binds = vec![(5, Res::Scratch(Scratch::Q8KX)), (10, Res::Buf(x))];
                    self.push("quantize_q8_k", nbx as u32, vec![nbx as u32], binds);
                    self.q8k_of = None;
                }
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
                            let iq2 = gt.ty == GgmlType::IQ2_XXS && ut.ty == GgmlType::IQ2_XXS;
                            let entry = if iq2 { "moe_gate_up_iq2_xxs" } else { "moe_gate_up" };
                            self.push(entry, groups((n_used * ff) as usize, per), args, binds)
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
                        false if self.moe_down_pairs && dt.ty == GgmlType::Q2_K && out_dim % 2 == 0 => {
                            let per = 2 * (256 / w_down as usize);
                            self.push("moe_down_q2_k_pairs", groups((n_used * out_dim) as usize, per), args, binds)
                        }
                        false => {
                            let per = 256 / w_down as usize;
                            self.push("moe_down", groups((n_used * out_dim) as usize, per), args, binds)
                        }
                    }
                }
                if self.moe_sum_in_hc_post(out) {
                    self.moe_sum_later = Some((out, out_dim as u32, n_used as u32));
                } else {
                    self.push_moe_sum(out, out_dim as u32, n_used as u32);
                }
            }
            Op::SwiGlu { gate, up, out, clamp } => {
                let n = self.len(out);
                // Read by Q8_0 matvecs (the shared expert's down): SwiGLU writes the quantization.
                let q8 = self.q8_read_later(out);
                let xq = if q8 { self.q8_scratch(out) } else { Res::DummyOut };
                let binds = vec![(2, Res::Buf(gate)), (3, Res::Buf(up)), (4, Res::Buf(out)), (5, xq)];
                self.push("swiglu", groups(n, 256), vec![n as u32, clamp.to_bits(), q8 as u32], binds);
                if q8 {
                    self.q8_of.push((out, self.cond));
                }
            }
            Op::Add { a, b, out } => {
                let n = self.len(out);
                // An HcPost of the sum right after: one dispatch adds and mixes.
                // `a` may be a routed-expert sum left to this dispatch (moe_sum_in_hc_post).
                let moe = self.moe_sum_later.take_if(|m| m.0 == a);
                if let Some((j, &Op::HcPost { block, residual, split, out: post_out, n_hc })) = self.next_op() {
                    let bufs = [a, b, out, residual, split, post_out];
                    let distinct = (0..6).all(|i| (i + 1..6).all(|k| bufs[i] != bufs[k]));
                    if self.fuse && block == out && distinct && moe.is_none_or(|m| m.1 as usize == n) {
                        self.absorb(j);
                        let mut binds = vec![
                            (2, Res::Buf(a)),
                            (3, Res::Buf(residual)),
                            (4, Res::Buf(split)),
                            (5, Res::Buf(post_out)),
                            (9, Res::Buf(b)),
                            (10, Res::Buf(out)),
                        ];
                        let (with_ss, ss) = self.hc_post_ss(post_out);
                        binds.push((12, ss));
                        // 4 outputs an invocation (hc.wgsl post_at).
                        let g = groups(n * n_hc as usize, 1024);
                        match moe {
                            Some((_, _, n_used)) => {
                                binds.push((11, Res::Scratch(Scratch::Partial)));
                                self.push("hc_post_add_moe", g, vec![n as u32, n_hc, with_ss, n_used], binds);
                            }
                            None => self.push("hc_post_add", g, vec![n as u32, n_hc, with_ss], binds),
                        }
                        return Ok(());
                    }
                }
                if let Some((moe_out, out_dim, n_used)) = moe {
                    self.push_moe_sum(moe_out, out_dim, n_used);
                }
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
/// `rows` picks the one-invocation-per-row matvecs. With `fuse`, runs of ops share dispatches
/// (the plan a token uses); without, every dispatch computes one op (for running single ops).
/// `moe_down_pairs`: Q2_K down projections two rows to a lane group (`moe_down_q2_k_pairs`)
/// instead of one (`moe_down`); same bits either way.
pub fn plan(program: &Program, max_binding: u64, rows: bool, fuse: bool, moe_down_pairs: bool) -> Result<Plan, String> {
    // A chunk program runs each dispatch once per row, and a row loop's dispatches row by row:
    // a fused dispatch could join ops of a row loop and batch ops, so it is planned unfused.
    if program.rows() > 1 && fuse {
        return Err(format!("a chunk program ({} rows) is planned one op per dispatch, not fused", program.rows()));
    }
    let mut b = Builder {
        program,
        max_binding,
        rows,
        fuse,
        done: vec![false; program.steps().len()],
        absorbed: Vec::new(),
        out: Vec::new(),
        need: Vec::new(),
        ropes: Vec::new(),
        layouts: vec![None; program.weights().len()],
        cond: [0; 3],
        op: 0,
        q8_of: Vec::new(),
        q8k_of: None,
        hc_pre_norm: std::env::var("DS4_WGPU_HC_PRE").map_or(true, |v| v != "apart"),
        q8_short_rows: std::env::var("DS4_WGPU_Q8_ROWS").map_or(true, |v| v != "1"),
        hc_split_old: std::env::var("DS4_WGPU_HC_SPLIT").is_ok_and(|v| v == "old"),
        moe_down_pairs,
        moe_sum_later: None,
        ss_of: None,
        hc_mix_chunks: std::env::var("DS4_WGPU_HC_MIX").map_or(true, |v| v != "rows"),
        mix_parts: None,
        hc_streams_unrolled: std::env::var("DS4_WGPU_HC_STREAMS").map_or(true, |v| v != "loop"),
    };
    // RoPE tables in program order, whatever the fusion: both plans index the same tables.
    for step in program.steps() {
        if let Op::RopeTail { rope, n_rot, .. } = step.op {
            b.rope_table(rope, n_rot);
        }
    }
    for (i, step) in program.steps().iter().enumerate() {
        if b.done[i] {
            continue;
        }
        b.op = i;
        b.absorbed.clear();
        // What an op writes is no longer what was quantized (its own output's quantization,
        // which a norm or SwiGLU writes, is added back by the op).
        b.q8_written(&step.op.writes());
        b.op(step).map_err(|e| format!("op #{i} ({}): {e}", step.op.name()))?;
    }
    if let Some((out, ..)) = b.moe_sum_later {
        return Err(format!("the routed experts' sum into buffer {} was left to an HC post that never came", out.0));
    }
    for d in &b.out {
        if d.args.len() > 28 {
            return Err(format!("{}: {} argument words exceed the 28 the shaders read", d.entry, d.args.len()));
        }
    }
    Ok(Plan { dispatches: b.out, scratch: b.need, ropes: b.ropes, layouts: b.layouts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{record_token, Caps};
    use crate::gguf::File;
    use crate::model::Model;
    use crate::synth::{self, Preset};

    fn programs() -> Vec<(&'static str, Program)> {
        let tiny = Model::from_file(File::from_bytes("t", synth::build(&Preset::tiny(), 1)).unwrap()).unwrap();
        let small = Model::from_file(File::from_bytes("t", synth::build(&Preset::small(), 1)).unwrap()).unwrap();
        let flash = synth::device_model(&Preset::flash_4l(), 1).unwrap();
        [("tiny", tiny), ("small", small), ("flash-4l", flash)]
            .into_iter()
            .map(|(name, m)| (name, record_token(&m, Caps { ctx: 256 }).unwrap()))
            .collect()
    }

    /// The shapes a token's plan comes in: (max binding, one invocation per row).
    const SHAPES: [(u64, bool); 3] = [(1 << 31, false), (1 << 31, true), (64 << 10, false)];

    /// Every recorded op is computed by exactly one group of consecutive dispatches; without
    /// fusion each dispatch computes one op; a fused dispatch's ops share its predicate.
    #[test]
    fn every_op_is_computed_exactly_once() {
        for (name, program) in programs() {
            for (max_binding, rows) in SHAPES {
                // Only the tiny model's experts fit the small bindings that split its weights.
                if name != "tiny" && max_binding < 1 << 31 {
                    continue;
                }
                for fuse in [false, true] {
                    let plan = plan(&program, max_binding, rows, fuse, true).unwrap();
                    let mut seen = vec![0; program.steps().len()];
                    for (i, d) in plan.dispatches.iter().enumerate() {
                        assert!(fuse || d.fused.is_empty(), "{name}: {} fused without fusion", d.entry);
                        let first_of_group = i == 0 || {
                            let p = &plan.dispatches[i - 1];
                            (p.op, &p.fused) != (d.op, &d.fused)
                        };
                        for &k in std::iter::once(&d.op).chain(&d.fused) {
                            assert_eq!(d.cond, pack_cond(program.steps()[k].cond), "{name}: {} op {k}", d.entry);
                            if first_of_group {
                                seen[k] += 1;
                            }
                        }
                    }
                    assert!(seen.iter().all(|&s| s == 1), "{name} (fuse {fuse}): {seen:?}");
                }
            }
        }
    }

    /// The fused plan runs the ops in an order the program's data allows: an op that moved
    /// earlier (a second matrix in a matvec dispatch) never passes an op it depends on, or one
    /// that reads what it overwrites.
    #[test]
    fn fused_order_respects_every_dependency() {
        let mut moved = 0;
        for (name, program) in programs() {
            let steps = program.steps();
            let plan = plan(&program, 1 << 31, false, true, true).unwrap();
            // The dispatch position at which each op runs.
            let mut at = vec![usize::MAX; steps.len()];
            for (i, d) in plan.dispatches.iter().enumerate() {
                for &k in std::iter::once(&d.op).chain(&d.fused) {
                    at[k] = at[k].min(i);
                }
            }
            let conflict = |i: usize, j: usize| {
                let (ri, wi, rj, wj) =
                    (steps[i].op.reads(), steps[i].op.writes(), steps[j].op.reads(), steps[j].op.writes());
                wi.iter().any(|b| rj.contains(b) || wj.contains(b)) || ri.iter().any(|b| wj.contains(b))
            };
            for j in 0..steps.len() {
                for i in 0..j {
                    if at[i] > at[j] {
                        moved += 1;
                        assert!(!conflict(i, j), "{name}: op {j} runs before op {i}, which it depends on");
                    }
                }
            }
        }
        assert!(moved > 0, "some op moved earlier");
    }

    /// Every Q8_0 matvec reads a Q8_0 scratch that holds its own input's quantization: written
    /// (by a quantize_q8_0, or a norm or SwiGLU that quantizes its output) under no predicate or
    /// the matvec's, and no op has written that buffer since.
    #[test]
    fn every_q8_0_matvec_reads_the_quantization_of_its_input() {
        for (name, program) in programs() {
            let steps = program.steps();
            for (max_binding, rows) in SHAPES {
                // Only the tiny model's experts fit the small bindings that split its weights.
                if name != "tiny" && max_binding < 1 << 31 {
                    continue;
                }
                for fuse in [false, true] {
                    let plan = plan(&program, max_binding, rows, fuse, true).unwrap();
                    let bind = |d: &Dispatch, k: u32| d.binds.iter().find(|b| b.0 == k).map(|b| b.1);
                    // (quantized buffer, predicate it was quantized under)
                    let mut held: Vec<(Buf, [u32; 3])> = Vec::new();
                    // The buffer whose Q8_K blocks the experts' input scratch holds.
                    let mut held_k: Option<(Buf, [u32; 3])> = None;
                    let (mut checked, mut in_place) = (0, 0);
                    for d in &plan.dispatches {
                        let ops: Vec<usize> = std::iter::once(d.op).chain(d.fused.iter().copied()).collect();
                        // Before the dispatch's own quantization: what its ops write is stale.
                        for &k in &ops {
                            let w = steps[k].op.writes();
                            held.retain(|(b, _)| !w.contains(b));
                            held_k = held_k.filter(|(b, _)| !w.contains(b));
                        }
                        let xk = Some(Res::Scratch(Scratch::Q8KX));
                        match d.entry {
                            "quantize_q8_k" if bind(d, 5) == xk => match bind(d, 10) {
                                Some(Res::Buf(b)) => held_k = Some((b, d.cond)),
                                other => panic!("{name}: quantize_q8_k of {other:?}"),
                            },
                            "rms_norm" | "hc_pre_norm" if bind(d, 9) == xk => match bind(d, 3) {
                                Some(Res::Buf(b)) if d.args[7] == 1 => held_k = Some((b, d.cond)),
                                other => panic!("{name}: rms_norm writes Q8_K of {other:?}"),
                            },
                            "moe_gate_up" | "moe_gate_up_iq2_xxs" | "moe_gate_up_rows" => {
                                let Op::MoeExperts { x, .. } = steps[d.op].op else { panic!("{name}: op {}", d.op) };
                                let fresh = held_k.is_some_and(|(b, c)| b == x && (c == [0; 3] || c == d.cond));
                                assert!(fresh, "{name} (fuse {fuse}): op {} reads stale Q8_K blocks", d.op);
                            }
                            _ => {}
                        }
                        let quantized = match (d.entry, bind(d, 5)) {
                            ("quantize_q8_0", Some(Res::Scratch(Scratch::Q8(b)))) => Some((b, 3)),
                            ("rms_norm" | "hc_pre_norm", Some(Res::Scratch(Scratch::Q8(b)))) if d.args[6] == 1 => {
                                Some((b, 3))
                            }
                            ("swiglu", Some(Res::Scratch(Scratch::Q8(b)))) if d.args[2] == 1 => Some((b, 4)),
                            ("attention", _) => match bind(d, 10) {
                                Some(Res::Scratch(Scratch::Q8(b))) => Some((b, 7)),
                                _ => None,
                            },
                            ("rope_tail_q8", _) => match bind(d, 4) {
                                Some(Res::Scratch(Scratch::Q8(b))) => Some((b, 2)),
                                other => panic!("{name}: rope_tail_q8 into {other:?}"),
                            },
                            _ => None,
                        };
                        if let Some((b, k)) = quantized {
                            assert_eq!(bind(d, k), Some(Res::Buf(b)), "{name}: {} quantizes another buffer", d.entry);
                            in_place += (d.entry != "quantize_q8_0") as usize;
                            held.push((b, d.cond));
                        }
                        if d.entry.starts_with("mat_vec_q8_0") {
                            let x = match steps[d.op].op {
                                Op::MatVec { x, .. } | Op::MatVecGrouped { x, .. } => x,
                                ref op => panic!("{name}: {op:?} in a Q8_0 matvec"),
                            };
                            for &k in &d.fused {
                                assert!(matches!(steps[k].op, Op::MatVec { x: x2, .. } if x2 == x), "{name}: op {k}");
                            }
                            assert_eq!(bind(d, 5), Some(Res::Scratch(Scratch::Q8(x))), "{name}: op {}", d.op);
                            let fresh = held.iter().any(|&(b, c)| b == x && (c == [0; 3] || c == d.cond));
                            assert!(fresh, "{name} (fuse {fuse}): op {} reads a stale quantization", d.op);
                            checked += 1;
                        }
                    }
                    assert!(checked > 10, "{name}: {checked} Q8_0 matvecs");
                    assert!(!fuse || in_place > 3, "{name}: {in_place} norms or SwiGLUs quantize");
                }
            }
        }
    }

    /// Dispatches per flash-4l token (the number the H200's per-dispatch cost multiplies): the
    /// fused kernels appear and the count stays at or under what fusion reached (220 before it,
    /// 135 with the HC norms apart, 127 with them in `hc_pre_norm`).
    #[test]
    fn flash_4l_dispatches_per_token() {
        let model = synth::device_model(&Preset::flash_4l(), 1).unwrap();
        let program = record_token(&model, Caps { ctx: 4096 }).unwrap();
        let (fused, single) =
            (plan(&program, 1 << 31, false, true, true).unwrap(), plan(&program, 1 << 31, false, false, true).unwrap());
        let mut by: std::collections::BTreeMap<&str, usize> = Default::default();
        for d in &fused.dispatches {
            *by.entry(d.entry).or_default() += 1;
        }
        println!("{by:?}");
        println!(
            "flash-4l: {} dispatches per token fused, {} one op each",
            fused.dispatches.len(),
            single.dispatches.len()
        );
        assert_eq!(by.get("hc_split"), None);
        // Each HC pre-mix's split, weighted sum and norm in one dispatch.
        assert_eq!(by.get("hc_split_weighted_sum_lanes"), None);
        assert_eq!(by["hc_pre_norm"], 8);
        assert_eq!(by.get("add"), None);
        assert_eq!(by["mat_vec_q8_0_pair"], 8);
        // The KV row's norm and finish run beside the query heads' norm.
        assert_eq!(by.get("kv_finish"), None);
        assert_eq!(by["rms_norm_kv"], 4);
        // The 8 HC mixes that an hc_pre_norm reads at a chunk per lane group, the head's by rows.
        assert_eq!(by["mat_vec_f16_chunks_norm"], 8);
        assert_eq!(by["mat_vec_f16_split_norm"], 1);
        // Every HC mix but the token's first (after embed_hc) takes its row's sums of squares
        // from the HC post right before it, which is the dispatch before.
        let mixes: Vec<usize> = (0..fused.dispatches.len())
            .filter(|&i| fused.dispatches[i].entry.starts_with("mat_vec_f16_"))
            .filter(|&i| fused.dispatches[i].entry.ends_with("_norm"))
            .collect();
        for (k, &i) in mixes.iter().enumerate() {
            let d = &fused.dispatches[i];
            assert_eq!(d.args[6], (k > 0) as u32, "HC mix {k}");
            if k > 0 {
                let post = &fused.dispatches[i - 1];
                assert!(post.entry.starts_with("hc_post") && post.args[2] == 1, "{}", post.entry);
            }
        }
        // Every hc_pre_norm adds the 32 chunk sums per row that the mix right before it left.
        for i in (0..fused.dispatches.len()).filter(|&i| fused.dispatches[i].entry == "hc_pre_norm") {
            let (d, mix) = (&fused.dispatches[i], &fused.dispatches[i - 1]);
            assert_eq!(mix.entry, "mat_vec_f16_chunks_norm");
            assert_eq!((d.args[13], mix.groups), (32, 24 * 32 / 8));
            let bind = |d: &Dispatch, b: u32| d.binds.iter().find(|(k, _)| *k == b).map(|(_, r)| *r);
            assert_eq!(bind(d, 10), Some(Res::Scratch(Scratch::HcMixParts)));
            assert_eq!(bind(mix, 4), Some(Res::Scratch(Scratch::HcMixParts)));
        }
        // Only the experts' mid vectors are quantized to Q8_K on their own.
        assert_eq!(by["quantize_q8_k"], 4);
        // The attention output's inverse RoPE and Q8_0 are the attention's own.
        assert_eq!(by.get("rope_tail_q8"), None);
        // Left on their own: the compressed rows' and the indexer query's.
        assert_eq!(by["rope_tail"], 4);
        // The compressors' kv and score projections, one dispatch each pair.
        assert_eq!(by["mat_vec_f16_split"], 4 + 1 + 3);
        assert_eq!(by.get("store_raw"), None);
        // The Q2_K down projections two rows to a lane group.
        assert_eq!((by["moe_down_q2_k_pairs"], by.get("moe_down")), (4, None));
        // The routed experts' slot sums inside the HC post that adds the shared expert.
        assert_eq!((by.get("moe_sum"), by["hc_post_add_moe"], by.get("hc_post_add")), (None, 4, None));
        assert!(fused.dispatches.len() <= 123, "{} dispatches", fused.dispatches.len());
    }
}
