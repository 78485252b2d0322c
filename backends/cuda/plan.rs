//! Turns each recorded op into kernel launches, once, at compile time. Every launch is fixed:
//! same kernel, grid and arguments for every token. Per-token work is decided on the device
//! from `StepParams` (predicates and loop bounds), which is what lets one CUDA graph replay it.

use super::args::PtrRef;
use super::args::{self, *};
use crate::model::RopeParams;
use crate::numerics;
use crate::quant::GgmlType;
use crate::recorder::{Buf, Cond, Op, Program, RopePos, Step, WeightId};

/// Backend scratch areas that no recorded buffer covers (activation quantization, attention
/// scores, top-k flags, split-K partial sums). Sized from the program at compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scratch {
    Q8Qs,
    Q8D,
    /// A second Q8_0 activation scratch: a matvec's tail quantizes its output there while other
    /// blocks still read the input's quantization from `Q8Qs`/`Q8D` ([`Q8Tail`]).
    Q8QsB,
    Q8DB,
    Q8KX,
    Q8KMid,
    Mid,
    Scores,
    Taken,
    Partial,
    /// One u32 ticket per split-K launch: the last block to finish adds the chunk sums.
    Tickets,
    /// The HC streams' 512-chunk sums of squares, from hc_post to the next hc_pre.
    HcSumSq,
    /// A chunk's routed experts grouped by expert (kernels/moe.cu moe_route): per expert its
    /// count and first pair, then the (row, slot) pairs. Only row 0's copy is used.
    MoeRoute,
    /// A chunk row's down projection of each slot, before moe_sum_slots adds them.
    MoeParts,
    /// The split decode attention (kernels/attention.cu): each head's score max per slice of
    /// [`attn_score_rows`] rows.
    AttnMaxes,
    /// The split decode attention: each head's max, then its weight sum per 64-row chunk.
    AttnSums,
    /// The split decode attention: each chunk's weighted sum of the rows per (head, dim).
    AttnParts,
}

pub const SCRATCH_KINDS: [Scratch; 17] = [
    Scratch::Q8Qs,
    Scratch::Q8D,
    Scratch::Q8QsB,
    Scratch::Q8DB,
    Scratch::Q8KX,
    Scratch::Q8KMid,
    Scratch::Mid,
    Scratch::Scores,
    Scratch::Taken,
    Scratch::Partial,
    Scratch::Tickets,
    Scratch::HcSumSq,
    Scratch::MoeRoute,
    Scratch::MoeParts,
    Scratch::AttnMaxes,
    Scratch::AttnSums,
    Scratch::AttnParts,
];

impl Scratch {
    fn ptr(self) -> Ptr {
        Ptr::scratch(SCRATCH_KINDS.iter().position(|&k| k == self).unwrap_or(0) as u32)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The recorded ops this launch computes, ascending (more than one when ops fuse).
    pub ops: Vec<usize>,
    pub kernel: &'static str,
    pub grid: u32,
    pub block: u32,
    /// The op's predicate, packed for `ds4_cond` (kernels/common.cuh).
    pub cond: u64,
    /// The kernel's argument struct as 8-byte words; pointer fields still hold references.
    pub args: Vec<u64>,
    /// Which words of `args` are pointers to resolve.
    pub ptr_words: Vec<usize>,
    /// Runs on the side stream, beside the main stream's launches (see [`mark_side_branches`]).
    pub side: bool,
    /// The side stream first waits for the main stream's work before this launch.
    pub fork: bool,
    /// The main stream first waits for the side stream's work so far.
    pub join: bool,
}

/// The launches of a program and the scratch bytes they need.
pub struct Plan {
    pub launches: Vec<Launch>,
    pub scratch: Vec<(Scratch, usize)>,
    /// Distinct RoPE settings (params, rotated dims); each gets a host-computed table.
    pub ropes: Vec<(RopeParams, u32)>,
}

/// `BlockQ8K` as the kernels lay it out (args.rs: the generated header).
const Q8K_BLOCK_BYTES: usize = 304;
/// Whether a norm that feeds a Q8_0 matvec also writes the quantization, so the matvec skips its
/// own quantize launch (130 launches fewer per Flash token). The plan test below checks the
/// bookkeeping; `scripts/gpu-check` checks the bits.
const FUSE_NORM_Q8: bool = true;
/// Warps per block of hc_pre (kernels/fused.cu HC_PRE_WARPS).
pub(crate) const HC_PRE_WARPS: usize = 16;

/// What `mat_vec_q8_0_quant` and `mat_vec_q8_0_norm` (kernels/fused.cu) do after their rows ([`Builder::try_q8_tail`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Q8Tail {
    /// The last block: the RMS norm of the first matrix's output and its Q8_0.
    Norm = 1,
    /// The last block of each 32 rows: their Q8_0.
    Quant = 2,
    /// The last of the blocks of 32 gate and 32 up rows: their SwiGLU and its Q8_0.
    SwiGlu = 3,
}
/// The widest row the norm tail takes (kernels/fused.cu Q8_TAIL_MAX_NORM).
const Q8_TAIL_MAX_NORM: usize = 4096;

/// The matvec tails planned: `DS4_CUDA_Q8_TAIL` = `0` for none, or a comma list of `norm`,
/// `quant`, `swiglu` (to measure each).
fn q8_tails() -> Vec<Q8Tail> {
    let all = [("norm", Q8Tail::Norm), ("quant", Q8Tail::Quant), ("swiglu", Q8Tail::SwiGlu)];
    match std::env::var("DS4_CUDA_Q8_TAIL") {
        Err(_) => all.iter().map(|&(_, t)| t).collect(),
        Ok(v) => all.iter().filter(|(n, _)| v.split(',').any(|x| x == *n)).map(|&(_, t)| t).collect(),
    }
}

/// The (row, slot) pairs of a chunk that the grouped routed experts take (kernels/moe.cu
/// MOE_ROUTE_MAX_PAIRS: the routing block holds them in shared memory), and the experts.
const MOE_ROUTE_MAX_PAIRS: usize = 16384;
const MOE_ROUTE_MAX_EXPERTS: u32 = 1024;

/// Matrices with fewer rows than this split each row's chunks over warps (split-K).
const SPLIT_K_ROWS: usize = 2048;

/// The decode attention split over its KV rows (kernels/attention.cu: attention_scores,
/// attention_partial, attention_combine; mod.rs passes its shape to the kernels): heads per group
/// (each KV row is read from L2 once per group and pass), and the scores block's threads.
pub const ATTN_SPLIT_HEADS: u32 = 16;
pub const ATTN_SCORE_THREADS: u32 = 256;

/// Tasks (two rows of gate and up) per warp of `moe_gate_up_iq2_xxs`: each warp loads its next
/// task's weights while it decodes this one's. Two measured fastest on the H200 (Flash 144.4 /
/// 144.3 tok/s against 143.5 / 142.8 for one task a warp before; three were not timed there);
/// `DS4_CUDA_MOE_GU_TASKS` (1 to 4) to measure.
fn moe_gate_up_tasks() -> u32 {
    env_choice("DS4_CUDA_MOE_GU_TASKS", &[1, 2, 3, 4], 2)
}

/// Whether the measuring switch `name` (an environment variable) is set to `value`.
pub fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

/// The in-graph trace, a measurement (`DS4_CUDA_TRACE=1`): the kernels are built with `DS4_TRACE`
/// (kernels/common.cuh), each decode launch carries its number in the predicate's bits
/// [`TRACE_SHIFT`].., and `ds4 bench --profile` prints where a replayed token's time goes.
pub fn trace_on() -> bool {
    env_is("DS4_CUDA_TRACE", "1")
}

/// Where a traced launch's number (1-based, 13 bits) sits in its predicate word, how many launches
/// are traced, and the timer slots of each (kernels/common.cuh takes all three as defines).
pub const TRACE_SHIFT: u32 = 50;
pub const TRACE_LAUNCHES: usize = 4096;
pub const TRACE_SLOTS: usize = 8;
const _: () = assert!(TRACE_LAUNCHES < 1 << 13 && TRACE_SHIFT + 13 <= 63);

/// The measuring switch `name` when it is one of `allowed`, else `default`.
pub fn env_choice(name: &str, allowed: &[u32], default: u32) -> u32 {
    let n = std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    n.filter(|n| allowed.contains(n)).unwrap_or(default)
}

/// Rows per scores block of the split decode attention: 8, or 4 or 16 with
/// `DS4_CUDA_ATTN_SCORE_ROWS` (twice or half the blocks), to measure. 8 measured 1.7-2.2% faster a
/// flash-4l token at ctx 2048, near its start and near its end (BENCHMARKS.md, twenty-ninth session).
pub fn attn_score_rows() -> u32 {
    env_choice("DS4_CUDA_ATTN_SCORE_ROWS", &[4, 8, 16], 8)
}

/// Dims (threads) per weighted-sum block of the split decode attention: 128, or 64 or 256 with
/// `DS4_CUDA_ATTN_SUM_THREADS`, to measure.
pub fn attn_sum_threads() -> u32 {
    env_choice("DS4_CUDA_ATTN_SUM_THREADS", &[64, 128, 256], 128)
}

/// Whether the split decode attention adds its chunks in the weighted sums' last blocks
/// (`DS4_CUDA_ATTN_COMBINE=fused`, `attention_partial_combine`, one launch fewer per layer) or in
/// a launch of their own (`attention_combine`, the default). With `DS4_CUDA_QKV=fused` beside
/// it, Flash measured 7% slower (BENCHMARKS.md, twenty-fourth session).
fn combine_inside_partial() -> bool {
    env_is("DS4_CUDA_ATTN_COMBINE", "fused")
}

/// Set on every launch of a chunk program: the kernel skips a row whose StepParams count is 0 (a
/// row past the chunk's tokens). Decode launches leave it clear and never read the count.
pub const CHUNK_ROW: u64 = 1 << 63;

fn pack_cond(c: Option<Cond>) -> u64 {
    match c {
        None => 0,
        Some(Cond::Emit { ratio }) => 1 | (ratio as u64) << 2,
        Some(Cond::IndexerActive { ratio, top_k }) => 2 | (ratio as u64) << 2 | (top_k as u64) << 18,
    }
}

/// How a chunk program runs its routed experts (every way gives the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkExperts {
    /// The decode kernels, a launch per row.
    PerRow,
    /// Grouped by expert on CUDA cores (kernels/moe.cu `moe_gate_up_grouped*`, `moe_down_grouped`).
    Grouped,
    /// Grouped by expert, IQ2_XXS gate/up and Q2_K down on int8 tensor cores
    /// (`moe_gate_up_mma_iq2_xxs`, `moe_down_mma_q2_k`; the split block layout only); other
    /// types as [`ChunkExperts::Grouped`].
    GroupedMma,
    /// As [`ChunkExperts::GroupedMma`] with `moe_gate_up_tile_iq2_xxs` for the IQ2_XXS gate/up
    /// (each weight decoded once per pass of up to 32 pairs; dynamic shared memory): the same bits.
    GroupedMmaTile,
}

/// Kernels of the chunk build that cover all the chunk's rows in one launch without
/// `blockIdx.y`, finding each row's pointers through the strides (kernels/moe.cu: the routed
/// experts grouped by expert). A kernel missing here is launched over `blockIdx.y` 0..rows and
/// every row's blocks redo all of it (same writes: exact, but rows times slower); the plan tests
/// check that every grouped expert kernel is listed.
pub const ALL_ROWS_KERNELS: [&str; 8] = [
    "moe_route",
    "moe_gate_up_grouped",
    "moe_gate_up_grouped_iq2_xxs",
    "moe_down_grouped",
    "moe_gate_up_mma_iq2_xxs",
    "moe_down_mma_q2_k",
    "moe_gate_up_tile_iq2_xxs",
    "moe_down_tile_q2_k",
];

/// The IQ2_XXS gate/up that decodes each weight once per pass of many pairs (kernels/moe.cu); it
/// takes dynamic shared memory (mod.rs sizes it).
pub const GATE_UP_TILE_KERNEL: &str = "moe_gate_up_tile_iq2_xxs";

/// Mid rows per warp of `moe_gate_up_mma_iq2_xxs` and output rows per warp of `moe_down_mma_q2_k`
/// (kernels/moe.cu: MOE_MMA_MID_ROWS, MOE_MMA_DOWN_ROWS); 8 warps a block.
const MOE_MMA_MID_ROWS: usize = 8;
const MOE_MMA_DOWN_ROWS: usize = 16;

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

struct Builder<'a> {
    program: &'a Program,
    /// Whether runs of ops may share a launch (the graph's plan); off for op-by-op execution.
    fuse: bool,
    /// How a chunk program's routed experts run.
    experts: ChunkExperts,
    /// Whether a tensor-core chunk takes its Q2_K down from `moe_down_tile_q2_k`.
    down_tile: bool,
    /// Ops already computed by an earlier op's launch.
    done: Vec<bool>,
    launches: Vec<Launch>,
    need: Vec<(Scratch, usize)>,
    cond: u64,
    op: usize,
    ropes: Vec<(RopeParams, u32)>,
    /// The buffer whose Q8_0 quantization is in the scratch now, the predicate it ran under, the
    /// op that made it, and whether it is in the second scratch (`Q8QsB`).
    q8_of: Option<(Buf, u64, usize, bool)>,
    /// Split-K launches so far (each takes its own ticket).
    tickets: u32,
    /// The ops the current op's launches compute (itself and any it absorbed).
    group: Vec<usize>,
    /// The buffer whose Q8_K quantization (the experts' input) `hc_pre` left in the scratch.
    q8k_of: Option<(Buf, usize)>,
    /// The HC state whose chunk sums of squares the last launch (an hc_post) stored, and the
    /// launch count after it.
    ss_of: Option<(Buf, usize)>,
    /// The last hc_post's arguments and the launch count after it: an hc_pre right after it
    /// takes it in ([`Builder::try_hc_pre`]).
    hc_post_of: Option<(HcPostArgs, usize)>,
    /// The last F16 split-K launch's arguments and the launch count after it: a decode
    /// compressor update of its two outputs right after it runs in its last block
    /// ([`Builder::try_compressor_update`]).
    f16_split_of: Option<(MatVecF16SplitArgs, usize)>,
    /// Launches of earlier ops that the current op's launch took in (removed from the list).
    taken_back: usize,
    /// Whether a decode program's hc_pre runs the HC post before it: one launch fewer per
    /// half-layer (Flash 779 -> 694 launches a token). On by default since the thirty-second
    /// session (H100 flash-4l: -0.1 to -0.5% decode; the thirteenth session's H200 Flash, with an
    /// older hc_pre: -1%); `DS4_CUDA_HC_POST=apart` keeps the launches apart.
    hc_post_inside: bool,
    /// Whether routed experts go through the expert cache (kernels/expert_cache.cu).
    expert_cache: bool,
    /// MoE layers planned so far: the index of each layer's cache state.
    moe_layers: u32,
    /// Whether a decode program's attention runs split over its KV rows (three launches) rather
    /// than as one block per head.
    split_attention: bool,
}

fn b(x: Buf) -> Ptr {
    Ptr::buf(x)
}
fn w(x: WeightId) -> Ptr {
    Ptr::weight(x)
}

impl<'a> Builder<'a> {
    fn launch<A: KernelArgs>(&mut self, grid: u32, block: u32, a: A) {
        let (args, ptr_words) = args::encode(&a);
        self.launches.push(Launch {
            ops: vec![self.op],
            kernel: A::KERNEL,
            grid,
            block,
            cond: self.cond,
            args,
            ptr_words,
            side: false,
            fork: false,
            join: false,
        });
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
    fn f32_weight(&self, x: WeightId) -> Result<Ptr, String> {
        match self.is_f16(x)? {
            0 => Ok(w(x)),
            _ => Err(format!("tensor '{}' must be F32 for the CUDA kernels", self.program.weight(x).name)),
        }
    }
    /// The expert cache's launches for one MoE layer: which experts miss, then their copy.
    fn expert_cache_launches(&mut self, selected: Buf, tensors: [WeightId; 3], n_used: u32, n_expert: u32) {
        let layer = self.moe_layers;
        self.moe_layers += 1;
        let [g, u, d] = tensors.map(|t| expert_pieces(self.program.weight(t), n_expert));
        let slot_bytes = cache_slot_bytes(&[g, u, d]);
        let pieces = |p: u64| p as u32;
        let a = ExpertCachePlanArgs {
            selected: b(selected),
            state: Ptr::cache_state(layer),
            stats: Ptr::CACHE_STATS,
            gate_table: Ptr::expert_table(tensors[0]),
            up_table: Ptr::expert_table(tensors[1]),
            down_table: Ptr::expert_table(tensors[2]),
            gate_home: Ptr::expert_home(tensors[0]),
            up_home: Ptr::expert_home(tensors[1]),
            down_home: Ptr::expert_home(tensors[2]),
            slots: Ptr::cache_slots(layer),
            slot_bytes,
            gate_qs: pieces(g.0),
            gate_rest: pieces(g.1),
            up_qs: pieces(u.0),
            up_rest: pieces(u.1),
            down_qs: pieces(d.0),
            down_rest: pieces(d.1),
            n_expert,
            n_used,
        };
        self.launch(1, 32, a);
        // The plan kernel leaves (source, destination, bytes) jobs in the state. Enough 16-byte
        // loads in flight to keep the bus busy (two blocks per SM on an H200).
        self.launch(264, 256, ExpertCacheCopyArgs { state: Ptr::cache_state(layer) });
    }

    /// A chunk's routed experts grouped by expert (kernels/moe.cu, the chunk build): the routing
    /// block lists each expert's (row, slot) pairs; gate/up and down read each chosen expert's
    /// rows for all its pairs; the mid vectors are quantized per row; each row adds its slots.
    /// Every grid is fixed (all experts), so the chunk's graph replays for any routing: the
    /// blocks of an expert no row chose leave at once.
    fn moe_experts_grouped(
        &mut self,
        gu: MoeGateUpGroupedArgs,
        down: (WeightId, u32),
        out: Buf,
        out_dim: usize,
        rows: usize,
    ) {
        let (down, down_ty) = down;
        let (n_used, ff, n_expert) = (gu.n_used as usize, gu.ff as usize, gu.n_expert);
        self.need(Scratch::MoeRoute, (2 * n_expert as usize + rows * n_used) * 4);
        self.need(Scratch::MoeParts, n_used * out_dim * 4);
        let route = MoeRouteArgs {
            selected: gu.selected,
            route: gu.route,
            n_expert,
            n_used: n_used as u32,
            rows: rows as u32,
            _pad: 0,
        };
        self.launch(1, 1024, route);
        let tile = self.experts == ChunkExperts::GroupedMmaTile;
        let mma = tile || self.experts == ChunkExperts::GroupedMma;
        if mma && gu.gate_ty == GgmlType::IQ2_XXS as u32 {
            // A warp per 8 mid rows (a tile of their gate and up rows) of an expert, 8 warps a block.
            self.launch(n_expert * blocks(ff / MOE_MMA_MID_ROWS, 8), 256, gu);
            self.launches.last_mut().expect("just launched").kernel =
                if tile { GATE_UP_TILE_KERNEL } else { "moe_gate_up_mma_iq2_xxs" };
        } else {
            // A warp per two mid rows of an expert, 8 warps a block: ff / 16 blocks per expert.
            self.launch(n_expert * blocks(ff / 2, 8), 256, gu);
            if gu.gate_ty == GgmlType::IQ2_XXS as u32 {
                self.launches.last_mut().expect("just launched").kernel = "moe_gate_up_grouped_iq2_xxs";
            }
        }
        let q = QuantizeQ8KArgs { x: Scratch::Mid.ptr(), out: Scratch::Q8KMid.ptr() };
        self.launch((n_used * ff / 256) as u32, 256, q);
        let d = MoeDownGroupedArgs {
            midq: Scratch::Q8KMid.ptr(),
            down: Ptr::expert_table(down),
            parts: Scratch::MoeParts.ptr(),
            grid: Ptr::GRID,
            route: gu.route,
            down_ty,
            ff: gu.ff,
            out_dim: out_dim as u32,
            n_used: gu.n_used,
            n_expert,
            _pad: 0,
        };
        if mma && down_ty == GgmlType::Q2_K as u32 {
            // A warp per 16 output rows of an expert, 8 warps a block.
            self.launch(n_expert * blocks(out_dim.div_ceil(MOE_MMA_DOWN_ROWS), 8), 256, d);
            self.launches.last_mut().expect("just launched").kernel =
                if self.down_tile { "moe_down_tile_q2_k" } else { "moe_down_mma_q2_k" };
        } else {
            // A warp per two output rows of an expert, 8 warps a block.
            self.launch(n_expert * blocks(out_dim.div_ceil(2), 8), 256, d);
        }
        let s =
            MoeSumSlotsArgs { parts: Scratch::MoeParts.ptr(), out: b(out), out_dim: out_dim as u32, n_used: gu.n_used };
        self.launch(blocks(out_dim, 256), 256, s);
    }

    fn expert_type(&self, w: WeightId) -> Result<u32, String> {
        match self.program.weight(w).ty {
            t @ (GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K) => Ok(t as u32),
            t => Err(format!("tensor '{}' is {t:?}, not a routed-expert type", self.program.weight(w).name)),
        }
    }

    /// Whether the next op after op `after` that quantizes to the Q8_0 scratch is a Q8_0 matvec
    /// of `buf`, with nothing writing `buf` before it.
    fn next_q8_input_after(&self, buf: Buf, after: usize) -> bool {
        self.next_consumer_reads(buf, after, |st| match st.op {
            Op::MatVec { w, x, .. } | Op::MatVecGrouped { w, x, .. } if self.program.weight(w).ty == GgmlType::Q8_0 => {
                Some(x == buf)
            }
            _ => None,
        })
    }
    /// Whether a routed-experts op reads `buf` after op `after` under the same predicate, with
    /// nothing writing `buf` before it.
    fn next_moe_input_after(&self, buf: Buf, after: usize) -> bool {
        let cond = self.program.steps()[after].cond;
        self.next_consumer_reads(buf, after, |st| match st.op {
            Op::MoeExperts { x, .. } => Some(x == buf && st.cond == cond),
            _ => None,
        })
    }
    /// Scans the ops after `after` that no launch computed yet: the first one `consumer` answers
    /// for gives the answer; an op writing `buf` before it gives false.
    fn next_consumer_reads(&self, buf: Buf, after: usize, consumer: impl Fn(&Step) -> Option<bool>) -> bool {
        let steps = self.program.steps();
        for st in (after + 1..steps.len()).filter(|&k| !self.done[k]).map(|k| &steps[k]) {
            if let Some(answer) = consumer(st) {
                return answer;
            }
            if st.op.writes().contains(&buf) {
                return false;
            }
        }
        false
    }
    fn next_q8_input_is(&self, buf: Buf) -> bool {
        self.next_q8_input_after(buf, self.op)
    }

    /// The next `n` ops after the current one that no earlier launch computed, if they share
    /// the current op's predicate (or, with `cond`, that one).
    fn next_ops(&self, n: usize, cond: Option<Option<Cond>>) -> Option<Vec<(usize, &'a Op)>> {
        let steps = self.program.steps();
        let want = cond.unwrap_or(steps[self.op].cond);
        let out: Vec<(usize, &'a Op)> =
            (self.op + 1..steps.len()).filter(|&k| !self.done[k]).take(n).map(|k| (k, &steps[k].op)).collect();
        (out.len() == n && out.iter().all(|&(k, _)| steps[k].cond == want)).then_some(out)
    }

    /// Whether op `j` may run now, before the ops between: it shares the current op's predicate,
    /// and none of them writes what it reads or reads or writes what it writes.
    fn can_run_early(&self, j: usize) -> bool {
        let steps = self.program.steps();
        if self.done[j] || steps[j].cond != steps[self.op].cond {
            return false;
        }
        let (r, w) = (steps[j].op.reads(), steps[j].op.writes());
        steps[self.op..j].iter().all(|st| {
            let (r2, w2) = (st.op.reads(), st.op.writes());
            !w2.iter().any(|b| r.contains(b) || w.contains(b)) && !r2.iter().any(|b| w.contains(b))
        })
    }

    /// A later ungrouped matvec of the same input, weight type and width that may run in the
    /// current op's launch (two matrices, one launch). Looks a few ops ahead.
    fn matvec_partner(&self, x: Buf, ty: GgmlType, in_dim: u64) -> Option<(usize, WeightId, Buf)> {
        if !self.fuse {
            return None;
        }
        let steps = self.program.steps();
        for (j, st) in steps.iter().enumerate().take(self.op + 8).skip(self.op + 1) {
            if let Op::MatVec { w: w2, x: x2, out: o2 } = st.op {
                let t = self.program.weight(w2);
                if x2 == x && t.ty == ty && t.dim(0) == in_dim && self.can_run_early(j) {
                    return Some((j, w2, o2));
                }
            }
        }
        None
    }

    /// The decode attention split over its KV rows, up to `vis` of them: scores per (slice of
    /// rows, head group), each 64-row chunk's weights and weighted sum per (chunk, head group, dim
    /// slice), and the chunks added in order per head (kernels/attention.cu). Every grid covers
    /// `vis` rows; the blocks past this token's rows return at once.
    fn attention_split(&mut self, a: AttentionArgs, vis: u32) {
        let (n_head, head_dim) = (a.n_head as usize, a.head_dim as usize);
        let (score_rows, sum_threads) = (attn_score_rows(), attn_sum_threads());
        let groups = n_head.div_ceil(ATTN_SPLIT_HEADS as usize) as u32;
        let slices = vis.div_ceil(score_rows);
        let chunks = vis.div_ceil(numerics::ATTN_ROW_CHUNK as u32);
        let dim_slices = a.head_dim.div_ceil(sum_threads);
        // The combine inside the weighted sums' launch needs the rotated dims in one dim slice.
        let rot_first = a.head_dim - a.n_rot;
        let combine_inside = combine_inside_partial()
            && a.head_dim.is_multiple_of(32)
            && (a.rope == Ptr::NULL || a.n_rot == 0 || rot_first / sum_threads == (a.head_dim - 1) / sum_threads);
        // Inside, each dim slice keeps a copy of the sums of its own (`sums_slice` floats).
        let sums_slice = (1 + chunks) * a.n_head;
        let sum_copies = if combine_inside { dim_slices } else { 1 };
        self.need(Scratch::AttnMaxes, slices as usize * n_head * 4);
        self.need(Scratch::AttnSums, (sum_copies * sums_slice) as usize * 4);
        self.need(Scratch::AttnParts, chunks as usize * n_head * head_dim * 4);
        let ticket = self.tickets;
        if combine_inside {
            self.tickets += groups * dim_slices;
            self.need(Scratch::Tickets, self.tickets as usize * 4);
        }
        let a = AttentionScoresArgs {
            q: a.q,
            raw: a.raw,
            comp: a.comp,
            selected: a.selected,
            sinks: a.sinks,
            out: a.out,
            scores: a.scores,
            rope: a.rope,
            xq: a.xq,
            xd: a.xd,
            maxes: Scratch::AttnMaxes.ptr(),
            sums: Scratch::AttnSums.ptr(),
            parts: Scratch::AttnParts.ptr(),
            tickets: if combine_inside { Scratch::Tickets.ptr() } else { Ptr::NULL },
            head_dim: a.head_dim,
            window: a.window,
            raw_cap: a.raw_cap,
            ratio: a.ratio,
            comp_cap: a.comp_cap,
            top_k: a.top_k,
            max_rows: a.max_rows,
            kq_scale: a.kq_scale,
            n_rot: a.n_rot,
            n_head: a.n_head,
            ticket,
            sums_slice,
        };
        self.launch(slices * groups, ATTN_SCORE_THREADS, a);
        // The kernels take the same fields (args.rs).
        if combine_inside {
            let partial: AttentionPartialCombineArgs = bytemuck::cast(a);
            self.launch(chunks * groups * dim_slices, sum_threads, partial);
            return;
        }
        let partial: AttentionPartialArgs = bytemuck::cast(a);
        self.launch(chunks * groups * dim_slices, sum_threads, partial);
        let combine: AttentionCombineArgs = bytemuck::cast(a);
        self.launch(a.n_head, a.head_dim.next_multiple_of(32), combine);
    }

    /// A dense matvec; Q8_0 weights first quantize the whole input per 32.
    fn mat_vec(&mut self, wt: WeightId, x: Buf, out: Buf, groups: u32) -> Result<(), String> {
        let t = self.program.weight(wt);
        let (in_dim, rows) = (t.dim(0) as usize, t.dim(1) as usize);
        let rows_per_group = (rows / groups as usize) as u32;
        let (in_u, rows_u) = (in_dim as u32, rows as u32);
        match t.ty {
            GgmlType::Q8_0 => {
                // Consecutive matvecs of one input (q_a and kv, shared gate and up) quantize it once,
                // if nothing wrote it since and the quantization ran whenever this op runs.
                let fresh = matches!(self.q8_of, Some((q, c, _, _)) if q == x && (c == 0 || c == self.cond));
                if !fresh {
                    let n = self.len(x);
                    let (xq, xd) = self.q8_scratch(n);
                    let a = QuantizeQ80Args { x: b(x), xq, xd, n: n as u32, _pad: 0 };
                    self.launch(blocks(n / 32, 8), 256, a);
                    self.q8_of = Some((x, self.cond, self.op, false));
                }
                let in_b = matches!(self.q8_of, Some((q, _, _, true)) if q == x);
                let (xq, xd) = if in_b {
                    (Scratch::Q8QsB.ptr(), Scratch::Q8DB.ptr())
                } else {
                    (Scratch::Q8Qs.ptr(), Scratch::Q8D.ptr())
                };
                // A second matrix of the same input shares the launch (q_a and kv, shared gate and up).
                let (w2, out2, rows2) = self.take_matvec_partner(x, GgmlType::Q8_0, in_dim, groups, usize::MAX);
                let a = MatVecQ80Args {
                    w: w(wt),
                    xq,
                    xd,
                    out: b(out),
                    w2,
                    out2,
                    in_dim: in_u,
                    rows: rows_u,
                    rows_per_group,
                    rows2,
                };
                if !self.try_q8_qkv(&a, out)? && !self.try_q8_tail(a, out, out2, in_b)? {
                    self.launch(blocks(rows + rows2 as usize, 8), 256, a);
                }
            }
            GgmlType::F16 => {
                if in_dim % 8 != 0 {
                    return Err(format!("F16 rows of {in_dim} are not a multiple of 8 for the 16-byte loads"));
                }
                let n_chunks = in_dim.div_ceil(numerics::CHUNK);
                if rows < SPLIT_K_ROWS && n_chunks > 1 {
                    let (w2, out2, rows2) = self.take_matvec_partner(x, GgmlType::F16, in_dim, groups, SPLIT_K_ROWS);
                    let all_rows = rows + rows2 as usize;
                    self.need(Scratch::Partial, all_rows * n_chunks * 4);
                    self.tickets += 1;
                    self.need(Scratch::Tickets, self.tickets as usize * 4);
                    if rows2 == 0 && groups == 1 && self.try_router(wt, x, out, n_chunks as u32)? {
                        return Ok(());
                    }
                    let a = MatVecF16SplitArgs {
                        w: w(wt),
                        x: b(x),
                        partial: Scratch::Partial.ptr(),
                        tickets: Scratch::Tickets.ptr(),
                        out: b(out),
                        w2,
                        out2,
                        in_dim: in_u,
                        rows: rows_u,
                        rows_per_group,
                        n_chunks: n_chunks as u32,
                        ticket: self.tickets - 1,
                        rows2,
                    };
                    self.launch(blocks(all_rows * n_chunks, 8), 256, a);
                    self.f16_split_of = Some((a, self.launches.len()));
                } else {
                    let a = MatVecF16Args {
                        w: w(wt),
                        x: b(x),
                        out: b(out),
                        in_dim: in_u,
                        rows: rows_u,
                        rows_per_group,
                        _pad: 0,
                    };
                    self.launch(blocks(rows, 8), 256, a);
                }
            }
            GgmlType::F32 => {
                if in_dim % 4 != 0 {
                    return Err(format!("F32 rows of {in_dim} are not a multiple of 4 for the 16-byte loads"));
                }
                let a = MatVecF32Args {
                    w: w(wt),
                    x: b(x),
                    out: b(out),
                    in_dim: in_u,
                    rows: rows_u,
                    rows_per_group,
                    _pad: 0,
                };
                self.launch(blocks(rows, 8), 256, a);
            }
            other => return Err(format!("tensor '{}' of type {other:?} is not a dense matrix", t.name)),
        }
        Ok(())
    }

    /// A decode Q8_0 matvec whose output the next op only normalizes, quantizes or takes the
    /// SwiGLU of for the next Q8_0 matvec: that op runs in the matvec's blocks once the rows it
    /// needs are complete ([`Q8Tail`]). `in_b`: the matvec reads the second
    /// Q8_0 scratch.
    fn try_q8_tail(&mut self, a: MatVecQ80Args, out: Buf, out2: Ptr, in_b: bool) -> Result<bool, String> {
        if !self.fuse || self.program.rows() != 1 {
            return Ok(false);
        }
        let on = q8_tails();
        let (rows, rows2) = (a.rows as usize, a.rows2 as usize);
        let next = self.next_ops(1, None);
        let mut t = MatVecQ80TailArgs {
            w: a.w,
            xq: a.xq,
            xd: a.xd,
            out: a.out,
            w2: a.w2,
            out2: a.out2,
            tickets: Scratch::Tickets.ptr(),
            norm_w: Ptr::NULL,
            tail_out: Ptr::NULL,
            tail_xq: Ptr::NULL,
            tail_xd: Ptr::NULL,
            in_dim: a.in_dim,
            rows: a.rows,
            rows_per_group: a.rows_per_group,
            rows2: a.rows2,
            mode: 0,
            ticket: self.tickets,
            eps: 0.0,
            clamp: 0.0,
        };
        // (the op absorbed, the buffer quantized, its quantization in the second scratch)
        let (absorbed, quantized, to_b) = match next.as_deref() {
            // The q_a norm: the last block, once every row is stored; the input's quantization
            // is no longer read then, so it goes to the first scratch.
            Some(&[(k, &Op::RmsNorm { x: nx, weight, out: no, n, rows: 1, eps })])
                if on.contains(&Q8Tail::Norm)
                    && nx == out
                    && n as usize == rows
                    && rows <= Q8_TAIL_MAX_NORM
                    && rows.is_multiple_of(32)
                    && !in_b
                    && self.next_q8_input_after(no, k) =>
            {
                t.mode = Q8Tail::Norm as u32;
                t.norm_w = match weight {
                    Some(x) => self.f32_weight(x)?,
                    None => Ptr::NULL,
                };
                t.eps = eps;
                t.tail_out = b(no);
                self.tickets += 1;
                (Some(k), no, false)
            }
            // The shared expert's SwiGLU: the blocks of 32 gate rows and of the 32 up rows beside.
            Some(&[(k, &Op::SwiGlu { gate, up, out: so, clamp })])
                if on.contains(&Q8Tail::SwiGlu)
                    && gate == out
                    && out2 == b(up)
                    && rows == rows2
                    && self.len(so) == rows
                    && rows.is_multiple_of(32)
                    && !in_b
                    && self.next_q8_input_after(so, k) =>
            {
                t.mode = Q8Tail::SwiGlu as u32;
                t.clamp = clamp;
                t.tail_out = b(so);
                (Some(k), so, true)
            }
            // A plain quantization for the next Q8_0 matvec (wo_a's output for wo_b).
            _ if on.contains(&Q8Tail::Quant)
                && rows2 == 0
                && rows.is_multiple_of(32)
                && !in_b
                && self.next_q8_input_is(out) =>
            {
                t.mode = Q8Tail::Quant as u32;
                (None, out, true)
            }
            _ => return Ok(false),
        };
        self.need(Scratch::Tickets, self.tickets as usize * 4);
        let n = self.len(quantized);
        if to_b {
            self.need(Scratch::Q8QsB, n);
            self.need(Scratch::Q8DB, n / 32 * 4);
            (t.tail_xq, t.tail_xd) = (Scratch::Q8QsB.ptr(), Scratch::Q8DB.ptr());
        } else {
            (t.tail_xq, t.tail_xd) = self.q8_scratch(n);
        }
        if let Some(k) = absorbed {
            self.absorb_op(k);
        }
        if t.mode == Q8Tail::Norm as u32 {
            self.launch(blocks(rows + rows2, 8), 256, t);
            self.launches.last_mut().expect("just launched").kernel = "mat_vec_q8_0_norm";
        } else {
            // A block of 32 warps per 32 output rows.
            self.launch((rows / 32) as u32, 1024, t);
        }
        self.q8_of = Some((quantized, self.cond, self.op, to_b));
        Ok(true)
    }

    /// At the router's projection (split-K, its ticket taken): with the selection next, one
    /// `router` launch whose last block selects once every logit is stored.
    fn try_router(&mut self, wt: WeightId, x: Buf, out: Buf, n_chunks: u32) -> Result<bool, String> {
        if !self.fuse || self.program.rows() != 1 || env_is("DS4_CUDA_ROUTER", "apart") {
            return Ok(false);
        }
        let Some(next) = self.next_ops(1, None) else { return Ok(false) };
        let Op::RouterSelect { logits, bias, hash, selected, weights, n_used, scale } = *next[0].1 else {
            return Ok(false);
        };
        let t = self.program.weight(wt);
        let (in_dim, rows) = (t.dim(0) as u32, t.dim(1) as u32);
        // The select block's threads: one per expert for the probabilities (at most 1024).
        if logits != out || rows > 1024 || n_used > 16 || self.len(out) != rows as usize {
            return Ok(false);
        }
        let bias = match bias {
            Some(x) => self.f32_weight(x)?,
            None => Ptr::NULL,
        };
        let n_vocab = hash.map_or(1, |h| self.program.weight(h).dim(1) as u32);
        self.absorb(&next);
        let a = RouterArgs {
            w: w(wt),
            x: b(x),
            partial: Scratch::Partial.ptr(),
            tickets: Scratch::Tickets.ptr(),
            logits: b(out),
            bias,
            hash: hash.map_or(Ptr::NULL, w),
            selected: b(selected),
            weights: b(weights),
            in_dim,
            rows,
            n_chunks,
            ticket: self.tickets - 1,
            n_used,
            n_vocab,
            scale,
            _pad: 0,
        };
        self.launch(blocks(rows as usize * n_chunks as usize, 8), 256, a);
        Ok(true)
    }

    /// The table index of a RoPE setting, added on first use.
    fn rope_table(&mut self, rope: RopeParams, n_rot: u32) -> usize {
        match self.ropes.iter().position(|r| *r == (rope, n_rot)) {
            Some(i) => i,
            None => {
                self.ropes.push((rope, n_rot));
                self.ropes.len() - 1
            }
        }
    }

    /// HcPost; with `add = Some((block_b, sum_out))`, an Add fused in front: `block + block_b` is
    /// the block, also stored to `sum_out`. It also stores the output's chunk sums of squares,
    /// which an hc_pre launched right after it reads instead of the streams ([`Scratch::HcSumSq`]).
    fn hc_post(
        &mut self,
        block: Buf,
        add: Option<(Buf, Buf)>,
        residual: Buf,
        split: Buf,
        out: Buf,
        n_hc: u32,
    ) -> Result<(), String> {
        let n = self.len(block);
        if !n.is_multiple_of(4) || n_hc > 4 {
            return Err(format!(
                "the HC post kernel needs at most 4 streams of a multiple of 4 values, not {n_hc} of {n}"
            ));
        }
        let chunks = (n * n_hc as usize).div_ceil(numerics::CHUNK);
        let ss = if chunks <= 64 {
            self.need(Scratch::HcSumSq, chunks * 4);
            Scratch::HcSumSq.ptr()
        } else {
            Ptr::NULL
        };
        let (block_b, sum_out) = add.map_or((Ptr::NULL, Ptr::NULL), |(bb, so)| (b(bb), b(so)));
        let a = HcPostArgs {
            block: b(block),
            block_b,
            sum_out,
            residual: b(residual),
            split: b(split),
            out: b(out),
            ss,
            n: n as u32,
            n_hc,
        };
        // A warp per 512 outputs, each warp its own block to spread them over SMs.
        self.launch(chunks as u32, 32, a);
        if ss != Ptr::NULL {
            self.ss_of = Some((out, self.launches.len()));
        }
        self.hc_post_of = Some((a, self.launches.len()));
        Ok(())
    }

    /// Marks op `k` as computed by the current op's launches.
    fn absorb_op(&mut self, k: usize) {
        self.done[k] = true;
        self.group.push(k);
    }
    fn absorb(&mut self, ops: &[(usize, &Op)]) {
        for &(k, _) in ops {
            self.absorb_op(k);
        }
    }

    /// The Q8_0 activation scratch for `n` values: (quants, scales).
    fn q8_scratch(&mut self, n: usize) -> (Ptr, Ptr) {
        self.need(Scratch::Q8Qs, n);
        self.need(Scratch::Q8D, n / 32 * 4);
        (Scratch::Q8Qs.ptr(), Scratch::Q8D.ptr())
    }

    /// For an ungrouped matvec, the partner [`Self::matvec_partner`] finds (fewer than `max_rows`
    /// rows), absorbed into the current launch, as the `(w2, out2, rows2)` arguments; none: nulls.
    fn take_matvec_partner(
        &mut self,
        x: Buf,
        ty: GgmlType,
        in_dim: usize,
        groups: u32,
        max_rows: usize,
    ) -> (Ptr, Ptr, u32) {
        let partner = match groups {
            1 => self.matvec_partner(x, ty, in_dim as u64),
            _ => None,
        };
        match partner.map(|(j, w2, o2)| (j, w2, o2, self.program.weight(w2).dim(1) as usize)) {
            Some((j, w2, o2, rows2)) if rows2 < max_rows => {
                self.absorb_op(j);
                (w(w2), b(o2), rows2 as u32)
            }
            _ => (Ptr::NULL, Ptr::NULL, 0),
        }
    }

    /// At the in-place RMS norm of the q heads: with the kv projection already computed, the
    /// run [norm kv, RoPE q, RoPE kv, fp8 kv, store kv] fuses into one `qkv_finish`.
    fn try_qkv_finish(&mut self, q: Buf, n_head: u32, hd: u32, eps_q: f32) -> Result<bool, String> {
        let Some(next) = self.next_ops(5, None) else { return Ok(false) };
        let Some(a) = self.qkv_finish_run(&next, q, n_head, hd, eps_q)? else { return Ok(false) };
        self.absorb(&next);
        self.launch(n_head + 1, 256, a);
        Ok(true)
    }

    /// At the q projection (a Q8_0 matvec `a` into `q`): when the next op normalizes the q heads
    /// in place and qkv_finish's run follows, one `mat_vec_q8_0_qkv` launch does all of it (block
    /// 0 the kv row, each head's last block its norm and RoPE). Only with `DS4_CUDA_QKV=fused`:
    /// measured slower (BENCHMARKS.md), at 66 registers then (3 blocks an SM where `mat_vec_q8_0`
    /// runs 4); bounded to 64 since, not yet timed.
    fn try_q8_qkv(&mut self, a: &MatVecQ80Args, q: Buf) -> Result<bool, String> {
        if !self.fuse || self.program.rows() != 1 || a.rows2 != 0 || !env_is("DS4_CUDA_QKV", "fused") {
            return Ok(false);
        }
        let Some(next) = self.next_ops(6, None) else { return Ok(false) };
        let Op::RmsNorm { x, weight: None, out, n: hd, rows: n_head, eps } = *next[0].1 else { return Ok(false) };
        // Each block's 8 rows lie in one head; a head fits the tail's shared memory.
        if x != q || out != q || n_head * hd != a.rows || a.rows_per_group != a.rows || hd % 8 != 0 || hd > 1024 {
            return Ok(false);
        }
        let Some(f) = self.qkv_finish_run(&next[1..], q, n_head, hd, eps)? else { return Ok(false) };
        self.absorb(&next);
        let t = MatVecQ80QkvArgs {
            w: a.w,
            xq: a.xq,
            xd: a.xd,
            q: f.q,
            tickets: Scratch::Tickets.ptr(),
            kv_raw: f.kv_raw,
            kv_norm: f.kv_norm,
            kv: f.kv,
            cache: f.cache,
            table: f.table,
            in_dim: a.in_dim,
            n_head,
            head_dim: hd,
            n_rot: f.n_rot,
            raw_cap: f.raw_cap,
            ticket: self.tickets,
            eps_q: f.eps_q,
            eps_kv: f.eps_kv,
        };
        self.tickets += n_head;
        self.need(Scratch::Tickets, self.tickets as usize * 4);
        self.launch(1 + a.rows / 8, 256, t);
        Ok(true)
    }

    /// qkv_finish's arguments when `next` is its run after the norm of the q heads `q` (n_head
    /// of hd): [norm kv, RoPE q, RoPE kv, fp8 kv, store kv].
    fn qkv_finish_run(
        &mut self,
        next: &[(usize, &Op)],
        q: Buf,
        n_head: u32,
        hd: u32,
        eps_q: f32,
    ) -> Result<Option<QkvFinishArgs>, String> {
        let [(_, n0), (_, n1), (_, n2), (_, n3), (_, n4)] = next else { return Ok(None) };
        let (
            Op::RmsNorm { x: kv_raw, weight: Some(kvn), out: kv, n, rows: 1, eps: eps_kv },
            Op::RopeTail { x: rq, n_head: nh, head_dim: hq, n_rot, rope, pos: RopePos::Current, inverse: false },
            Op::RopeTail {
                x: rk,
                n_head: 1,
                head_dim: hk,
                n_rot: nr2,
                rope: rope2,
                pos: RopePos::Current,
                inverse: false,
            },
            Op::Fp8RoundTrip { x: fx, head_dim: hf, n_rot: nr3 },
            Op::StoreRaw { kv: sk, cache, row_dim, raw_cap },
        ) = ((*n0).clone(), (*n1).clone(), (*n2).clone(), (*n3).clone(), (*n4).clone())
        else {
            return Ok(None);
        };
        let same = rq == q
            && nh == n_head
            && hq == hd
            && n == hd
            && rk == kv
            && hk == hd
            && nr2 == n_rot
            && rope2 == rope
            && fx == kv
            && hf == hd
            && nr3 == n_rot
            && sk == kv
            && row_dim == hd;
        if !same
            || n_rot > hd
            || n_rot % 2 != 0
            || !(hd - n_rot).is_multiple_of(64)
            || !hd.is_multiple_of(4)
            || kv_raw == kv
        {
            return Ok(None);
        }
        let kv_norm = self.f32_weight(kvn)?;
        let table = self.rope_table(rope, n_rot);
        Ok(Some(QkvFinishArgs {
            q: b(q),
            kv_raw: b(kv_raw),
            kv_norm,
            kv: b(kv),
            cache: b(cache),
            table: Ptr::rope(table),
            n_head,
            head_dim: hd,
            n_rot,
            raw_cap,
            eps_q,
            eps_kv,
        }))
    }

    /// At the plain RMS norm of the HC streams: the run [control projection (F16), Sinkhorn split,
    /// weighted sum, sublayer norm] fuses into one split-K `hc_pre` whose last block does the rest.
    fn try_hc_pre(&mut self, x: Buf, flat: Buf, hc_dim: u32, eps_flat: f32) -> Result<bool, String> {
        let Some(next) = self.next_ops(4, None) else { return Ok(false) };
        let (
            Op::MatVec { w: fw, x: mx, out: mix },
            Op::HcSplit { mix: sm, scale, base, split, n_hc: 4, iters, eps: eps_hc },
            Op::HcWeightedSum { hc, weights, out: cur, n_hc: 4 },
            Op::RmsNorm { x: nx, weight: Some(nw), out: norm, n: n_embd, rows: 1, eps: eps_norm },
        ) = (next[0].1.clone(), next[1].1.clone(), next[2].1.clone(), next[3].1.clone())
        else {
            return Ok(false);
        };
        let t = self.program.weight(fw);
        let (in_dim, mix_rows) = (t.dim(0) as u32, t.dim(1) as u32);
        let same = mx == flat
            && sm == mix
            && hc == x
            && weights == split
            && nx == cur
            && in_dim == hc_dim
            && hc_dim == 4 * n_embd
            && self.len(mix) == mix_rows as usize
            && self.len(cur) == n_embd as usize;
        if !same
            || t.ty != GgmlType::F16
            || !hc_dim.is_multiple_of(numerics::CHUNK as u32)
            || !n_embd.is_multiple_of(32)
            || hc_dim as usize > 64 * numerics::CHUNK
            || n_embd as usize > 64 * numerics::CHUNK
            || !(2 * 4 + 16..=32).contains(&mix_rows)
            || n_embd > 8192
            || mix_rows * (hc_dim / numerics::CHUNK as u32) > 2048
        {
            return Ok(false);
        }
        let (scale, base, norm_w) = (self.f32_weight(scale)?, self.f32_weight(base)?, self.f32_weight(nw)?);
        let norm_op = next[3].0;
        self.absorb(&next);
        let n_chunks = hc_dim / numerics::CHUNK as u32;
        self.need(Scratch::Partial, (mix_rows * n_chunks) as usize * 4);
        // Two groups of blocks with a ticket each: the pre gates' rows, and the other rows.
        self.tickets += 2;
        let blocks_pre = blocks(4 * n_chunks as usize, HC_PRE_WARPS);
        // The streams' sums of squares, if the hc_post launched just before stored them; in a
        // decode program that hc_post runs inside this launch instead (every block computes the
        // streams and their sums of squares; block 0 stores them).
        let mut ss = match self.ss_of {
            Some((buf, at)) if buf == x && at == self.launches.len() => Scratch::HcSumSq.ptr(),
            _ => Ptr::NULL,
        };
        let post = match self.hc_post_of {
            Some((p, at))
                if ss != Ptr::NULL
                    && at == self.launches.len()
                    && p.out == b(x)
                    && p.n_hc == 4
                    && p.n == n_embd
                    && n_embd.is_multiple_of(numerics::CHUNK as u32)
                    && self.program.rows() == 1
                    && self.hc_post_inside =>
            {
                let l = self.launches.pop().expect("the hc_post launch");
                self.group.extend(l.ops);
                self.taken_back += 1;
                ss = Ptr::NULL;
                Some(p)
            }
            _ => None,
        };
        self.need(Scratch::Tickets, self.tickets as usize * 4);
        let (xq, xd) = if FUSE_NORM_Q8 && self.next_q8_input_after(norm, norm_op) {
            self.q8_scratch(n_embd as usize)
        } else {
            (Ptr::NULL, Ptr::NULL)
        };
        // The routed experts that read this norm take its Q8_K from here.
        let xk = if n_embd.is_multiple_of(256) && self.next_moe_input_after(norm, norm_op) {
            self.need(Scratch::Q8KX, n_embd as usize / 256 * Q8K_BLOCK_BYTES);
            self.q8k_of = Some((norm, self.op));
            Scratch::Q8KX.ptr()
        } else {
            Ptr::NULL
        };
        let a = HcPreArgs {
            x: b(x),
            fn_w: w(fw),
            partial: Scratch::Partial.ptr(),
            tickets: Scratch::Tickets.ptr(),
            flat: b(flat),
            mix: b(mix),
            scale,
            base,
            split: b(split),
            cur: b(cur),
            norm_w,
            norm: b(norm),
            xq,
            xd,
            xk,
            ss,
            post_block: post.map_or(Ptr::NULL, |p| p.block),
            post_block_b: post.map_or(Ptr::NULL, |p| p.block_b),
            post_sum: post.map_or(Ptr::NULL, |p| p.sum_out),
            post_residual: post.map_or(Ptr::NULL, |p| p.residual),
            post_split: post.map_or(Ptr::NULL, |p| p.split),
            hc_dim,
            mix_rows,
            n_chunks,
            ticket: self.tickets - 2,
            n_embd,
            iters,
            eps_flat,
            eps_hc,
            eps_norm,
            blocks_pre,
        };
        self.launch(
            blocks_pre + blocks((mix_rows - 4) as usize * n_chunks as usize, HC_PRE_WARPS),
            HC_PRE_WARPS as u32 * 32,
            a,
        );
        if xq != Ptr::NULL {
            self.q8_of = Some((norm, self.cond, self.op, false));
        }
        Ok(true)
    }

    /// At a compressor's window store: the emit run that follows it (pool, norm, RoPE, round
    /// trip, row store, and for ratio 4 the shift) fuses into one `compressor_update`.
    fn try_compressor_update(&mut self, st: &Op) -> Result<bool, String> {
        let Op::CompressorStore { kv, score, ape, state_kv, state_score, width, ratio } = *st else {
            return Ok(false);
        };
        let n = if ratio == 4 { 6 } else { 5 };
        let Some(next) = self.next_ops(n, Some(Some(Cond::Emit { ratio }))) else { return Ok(false) };
        let (
            Op::CompressorPool { state_kv: pk, state_score: ps, out: pooled, head_dim: hd, ratio: pr },
            Op::RmsNorm { x: nx, weight: Some(nw), out: row, n: nn, rows: 1, eps },
            Op::RopeTail {
                x: rx,
                n_head: 1,
                head_dim: rh,
                n_rot,
                rope,
                pos: RopePos::CompressedRow { ratio: rr },
                inverse: false,
            },
            quant_op,
            Op::StoreCompRow { row: sr, cache, row_dim, ratio: sratio },
        ) = (next[0].1.clone(), next[1].1.clone(), next[2].1.clone(), next[3].1.clone(), next[4].1.clone())
        else {
            return Ok(false);
        };
        let quant = match quant_op {
            Op::Fp8RoundTrip { x, head_dim, n_rot: q_rot } if x == row && head_dim == hd && q_rot == n_rot => 0,
            Op::IndexerQat { x, rows: 1, head_dim: 128 } if x == row && hd == 128 => 1,
            _ => return Ok(false),
        };
        let shift_ok = ratio != 4
            || matches!(*next[5].1, Op::CompressorShift { state_kv: a, state_score: s, width: w2, ratio: 4 }
                if a == state_kv && s == state_score && w2 == width);
        let same = pk == state_kv
            && ps == state_score
            && pr == ratio
            && nx == pooled
            && nn == hd
            && rx == row
            && rh == hd
            && rr == ratio
            && sr == row
            && row_dim == hd
            && sratio == ratio
            && width == if ratio == 4 { 2 * hd } else { hd };
        if !same
            || !shift_ok
            || n_rot > hd
            || n_rot % 2 != 0
            || (quant == 0 && !(hd - n_rot).is_multiple_of(64))
            || !hd.is_multiple_of(4)
        {
            return Ok(false);
        }
        let ape_f16 = self.is_f16(ape)?;
        let norm_w = self.f32_weight(nw)?;
        let table = self.rope_table(rope, n_rot);
        self.absorb(&next);
        // The chunk build's compressor_update_chunk: its last block writes the state (a ticket).
        self.tickets += 1;
        self.need(Scratch::Tickets, self.tickets as usize * 4);
        let a = CompressorUpdateArgs {
            kv: b(kv),
            score: b(score),
            ape: w(ape),
            state_kv: b(state_kv),
            state_score: b(state_score),
            pooled: b(pooled),
            norm_w,
            row: b(row),
            table: Ptr::rope(table),
            cache: b(cache),
            tickets: Scratch::Tickets.ptr(),
            emit_cond: pack_cond(Some(Cond::Emit { ratio })),
            ape_f16,
            width,
            ratio,
            head_dim: hd,
            n_rot,
            quant,
            eps,
            ticket: self.tickets - 1,
        };
        // A decode lane's update runs in the last block of the kv + score projections before it.
        match self.f16_split_of {
            Some((s, at))
                if at == self.launches.len()
                    && s.out == b(kv)
                    && s.out2 == b(score)
                    && self.program.tokens().is_none()
                    && self.launches.last().is_some_and(|l| l.cond == self.cond && l.block == 256) =>
            {
                let l = self.launches.pop().expect("the split-K launch");
                self.group.extend(l.ops);
                self.taken_back += 1;
                let f = MatVecF16SplitCompArgs {
                    w: s.w,
                    x: s.x,
                    partial: s.partial,
                    tickets: s.tickets,
                    out: s.out,
                    w2: s.w2,
                    out2: s.out2,
                    ape: a.ape,
                    state_kv: a.state_kv,
                    state_score: a.state_score,
                    pooled: a.pooled,
                    norm_w: a.norm_w,
                    row: a.row,
                    table: a.table,
                    cache: a.cache,
                    emit_cond: a.emit_cond,
                    in_dim: s.in_dim,
                    rows: s.rows,
                    rows_per_group: s.rows_per_group,
                    n_chunks: s.n_chunks,
                    ticket: s.ticket,
                    rows2: s.rows2,
                    ape_f16: a.ape_f16,
                    width: a.width,
                    ratio: a.ratio,
                    head_dim: a.head_dim,
                    n_rot: a.n_rot,
                    quant: a.quant,
                    eps: a.eps,
                    _pad: 0,
                };
                self.launch(l.grid, 256, f);
            }
            _ => self.launch(1, 256, a),
        }
        Ok(true)
    }

    fn op(&mut self, step: &Step) -> Result<(), String> {
        self.cond = pack_cond(step.cond);
        match step.op {
            Op::EmbedHc { table, out, n_hc } => {
                let n_embd = self.program.weight(table).dim(0) as usize;
                let is_f16 = self.is_f16(table)?;
                let a = EmbedHcArgs { table: w(table), out: b(out), n_embd: n_embd as u32, n_hc, is_f16, _pad: 0 };
                self.launch(blocks(n_embd, 256), 256, a);
            }
            Op::RmsNorm { x, weight, out, n, rows, eps } => {
                if self.fuse && rows > 1 && x == out && weight.is_none() && self.try_qkv_finish(x, rows, n, eps)? {
                    return Ok(());
                }
                if self.fuse && rows == 1 && x != out && weight.is_none() && self.try_hc_pre(x, out, n, eps)? {
                    return Ok(());
                }
                if n % 4 != 0 || n as usize > 64 * numerics::CHUNK {
                    return Err(format!("RMS norm rows of {n} must be a multiple of 4 and at most 32768"));
                }
                let wp = match weight {
                    Some(x) => self.f32_weight(x)?,
                    None => Ptr::NULL,
                };
                // A norm whose output the next Q8_0 matvec reads also writes its Q8_0 quantization
                // (the same values quantize_q8_0 would make): one launch fewer per such pair.
                let (xq, xd) = if FUSE_NORM_Q8 && rows == 1 && n % 32 == 0 && self.next_q8_input_is(out) {
                    self.q8_scratch(n as usize)
                } else {
                    (Ptr::NULL, Ptr::NULL)
                };
                // A row that is not normalized in place is split over blocks of 256 outputs, each
                // block summing the whole row itself (the same bits in each): one block per row
                // serialized the scaling and quantization of wide rows on one SM. In place, a
                // block may not write what another still reads: one block per row, with enough
                // warps to take the row's 512-term chunks at once (up to 1024 threads).
                let (slices, block) = if x != out && n % 256 == 0 && n >= 512 {
                    (n / 256, 256)
                } else {
                    (1, (32 * (n as usize).div_ceil(numerics::CHUNK) as u32).clamp(256, 1024))
                };
                let a = RmsNormArgs { x: b(x), w: wp, out: b(out), xq, xd, n, eps, slices, _pad: 0 };
                self.launch(rows * slices, block, a);
                if xq != Ptr::NULL {
                    self.q8_of = Some((out, self.cond, self.op, false));
                }
            }
            Op::MatVec { w, x, out } => self.mat_vec(w, x, out, 1)?,
            Op::MatVecGrouped { w, x, out, groups } => self.mat_vec(w, x, out, groups)?,
            Op::HcSplit { mix, scale, base, split, n_hc, iters, eps } => {
                if n_hc != 4 {
                    return Err(format!("the HC kernel needs 4 streams, not {n_hc}"));
                }
                let (scale, base) = (self.f32_weight(scale)?, self.f32_weight(base)?);
                self.launch(
                    1,
                    32,
                    HcSplitArgs { mix: b(mix), scale, base, split: b(split), n_hc, iters, eps, _pad: 0 },
                );
            }
            Op::HcWeightedSum { hc, weights, out, n_hc } => {
                let n = self.len(out);
                let a = HcWeightedSumArgs { hc: b(hc), weights: b(weights), out: b(out), n: n as u32, n_hc };
                self.launch(blocks(n, 256), 256, a);
            }
            Op::HcPost { block, residual, split, out, n_hc } => {
                self.hc_post(block, None, residual, split, out, n_hc)?
            }
            Op::HcHeadWeights { pre, scale, base, out, eps } => {
                let n = self.len(pre) as u32;
                let (scale, base) = (self.f32_weight(scale)?, self.f32_weight(base)?);
                self.launch(1, 32, HcHeadWeightsArgs { pre: b(pre), scale, base, out: b(out), n, eps });
            }
            Op::RopeTail { x, n_head, head_dim, n_rot, rope, pos, inverse } => {
                let (pos_mode, ratio) = match pos {
                    RopePos::Current => (0, 0),
                    RopePos::CompressedRow { ratio } => (1, ratio),
                };
                let table = self.rope_table(rope, n_rot);
                // The indexer query's FP4 round trip that follows runs in the same blocks.
                let qat_next = self.next_ops(1, None).filter(|_| self.fuse && self.program.tokens().is_none());
                if let Some(next) = qat_next.filter(|next| {
                    matches!(*next[0].1, Op::IndexerQat { x: qx, rows, head_dim: 128 } if qx == x && rows == n_head)
                        && head_dim == 128
                        && n_rot % 2 == 0
                        && n_rot <= 128
                        && pos == RopePos::Current
                        && !inverse
                }) {
                    self.absorb(&next);
                    let a = IndexerQueryFinishArgs { x: b(x), table: Ptr::rope(table), n_rot, _pad: 0 };
                    self.launch(n_head, 128, a);
                    return Ok(());
                }
                let a = RopeTailArgs {
                    x: b(x),
                    table: Ptr::rope(table),
                    n_head,
                    head_dim,
                    n_rot,
                    pos_mode,
                    ratio,
                    inverse: inverse as u32,
                };
                self.launch(blocks((n_head * n_rot / 2) as usize, 128), 128, a);
            }
            Op::Fp8RoundTrip { x, head_dim, n_rot } => {
                self.launch((head_dim - n_rot) / 64, 32, Fp8RoundTripArgs { x: b(x) });
            }
            Op::IndexerQat { x, rows, .. } => self.launch(rows, 128, IndexerQatArgs { x: b(x) }),
            Op::StoreRaw { kv, cache, row_dim, raw_cap } => {
                let a = StoreRawArgs { kv: b(kv), cache: b(cache), dim: row_dim, raw_cap };
                self.launch(blocks(row_dim as usize, 256), 256, a);
            }
            Op::CompressorStore { kv, score, ape, state_kv, state_score, width, ratio } => {
                if self.fuse && self.try_compressor_update(&step.op)? {
                    return Ok(());
                }
                let ape_f16 = self.is_f16(ape)?;
                let a = CompressorStoreArgs {
                    kv: b(kv),
                    score: b(score),
                    ape: w(ape),
                    state_kv: b(state_kv),
                    state_score: b(state_score),
                    ape_f16,
                    width,
                    ratio,
                    _pad: 0,
                };
                self.launch(blocks(width as usize, 256), 256, a);
            }
            Op::CompressorPool { state_kv, state_score, out, head_dim, ratio } => {
                let a = CompressorPoolArgs { kv: b(state_kv), score: b(state_score), out: b(out), head_dim, ratio };
                self.launch(blocks(head_dim as usize, 256), 256, a);
            }
            Op::CompressorShift { state_kv, state_score, width, ratio } => {
                let n = ratio * width;
                let a = CompressorShiftArgs { state_kv: b(state_kv), state_score: b(state_score), n, _pad: 0 };
                self.launch(blocks(n as usize, 256), 256, a);
            }
            Op::StoreCompRow { row, cache, row_dim, ratio } => {
                let a = StoreCompRowArgs { row: b(row), cache: b(cache), dim: row_dim, ratio };
                self.launch(blocks(row_dim as usize, 256), 256, a);
            }
            Op::IndexerScores { q, weights, cache, out, n_head, head_dim, scale, rows } => {
                if head_dim % 4 != 0 || n_head > 128 {
                    return Err(format!("indexer of {n_head} heads x {head_dim} exceeds the kernel's 128 heads"));
                }
                let ratio = comp_ratio(rows)?;
                let a = IndexerScoresArgs {
                    q: b(q),
                    weights: b(weights),
                    cache: b(cache),
                    out: b(out),
                    n_head,
                    head_dim,
                    scale,
                    ratio,
                    cap: rows.cap,
                    _pad: 0,
                };
                self.launch(rows.cap.clamp(1, 4096), 128, a);
            }
            Op::IndexerTopK { scores, out, top_k, rows } => {
                if top_k > 1024 {
                    return Err(format!("indexer top-k {top_k} exceeds the kernel's 1024"));
                }
                self.need(Scratch::Taken, rows.cap as usize * 4);
                let ratio = comp_ratio(rows)?;
                let a = IndexerTopKArgs {
                    scores: b(scores),
                    out: b(out),
                    taken: Scratch::Taken.ptr(),
                    top_k,
                    ratio,
                    cap: rows.cap,
                    _pad: 0,
                };
                self.launch(1, 1024, a);
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
                if head_dim > 1024 || max_rows.div_ceil(numerics::ATTN_ROW_CHUNK as u32) > 4096 {
                    return Err(format!(
                        "attention over {max_rows} rows of {head_dim} exceeds the kernel's 1024 dims and 4096 row chunks"
                    ));
                }
                self.need(Scratch::Scores, (n_head * max_rows) as usize * 4);
                // The inverse RoPE that follows, and the Q8_0 quantization of the heads for the
                // output projection, run in the attention blocks.
                let (mut rope_ptr, mut rope_rot, mut xq, mut xd) = (Ptr::NULL, 0, Ptr::NULL, Ptr::NULL);
                if let Some(next) = self.next_ops(1, None).filter(|_| self.fuse) {
                    if let Op::RopeTail {
                        x,
                        n_head: nh,
                        head_dim: hh,
                        n_rot,
                        rope,
                        pos: RopePos::Current,
                        inverse: true,
                    } = *next[0].1
                    {
                        if x == out && nh == n_head && hh == head_dim && n_rot % 2 == 0 {
                            rope_ptr = Ptr::rope(self.rope_table(rope, n_rot));
                            rope_rot = n_rot;
                            self.absorb(&next);
                            if head_dim % 32 == 0 && self.next_q8_input_after(out, next[0].0) {
                                (xq, xd) = self.q8_scratch(self.len(out));
                            }
                        }
                    }
                }
                let a = AttentionArgs {
                    q: b(q),
                    raw: b(raw),
                    comp: comp.map_or(Ptr::NULL, b),
                    selected: selected.map_or(Ptr::NULL, b),
                    sinks: self.f32_weight(sinks)?,
                    out: b(out),
                    scores: Scratch::Scores.ptr(),
                    rope: rope_ptr,
                    xq,
                    xd,
                    head_dim,
                    window,
                    raw_cap: raw_rows.cap,
                    ratio,
                    comp_cap: comp_rows.cap,
                    top_k,
                    max_rows,
                    kq_scale: crate::backends::gpu_tables::attention_kq_scale(head_dim),
                    n_rot: rope_rot,
                    n_head,
                };
                // The split form's scores hold one chunk of the dot (head_dim <= 512).
                // Visible rows at most: the window's (not the ring's), and top_k compressed rows
                // once the indexer selects.
                let comp_vis = match (comp, selected) {
                    (None, _) => 0,
                    (Some(_), Some(_)) => comp_rows.cap.min(top_k),
                    (Some(_), None) => comp_rows.cap,
                };
                let max_rows = window.min(raw_rows.cap) + comp_vis;
                if self.split_attention && head_dim as usize <= numerics::CHUNK && max_rows > single_attention_rows() {
                    self.attention_split(a, max_rows);
                } else {
                    self.launch(n_head, 1024, a);
                }
                if xq != Ptr::NULL {
                    self.q8_of = Some((out, self.cond, self.op, false));
                }
            }
            Op::RouterSelect { logits, bias, hash, selected, weights, n_used, scale } => {
                let n_expert = self.len(logits) as u32;
                if n_expert > 1024 || n_used > 16 {
                    return Err(format!(
                        "router of {n_expert} experts with {n_used} used exceeds the kernel's 1024/16"
                    ));
                }
                let bias = match bias {
                    Some(x) => self.f32_weight(x)?,
                    None => Ptr::NULL,
                };
                let n_vocab = hash.map_or(1, |h| self.program.weight(h).dim(1) as u32);
                let a = RouterSelectArgs {
                    logits: b(logits),
                    bias,
                    hash: hash.map_or(Ptr::NULL, w),
                    selected: b(selected),
                    weights: b(weights),
                    n_expert,
                    n_used,
                    n_vocab,
                    scale,
                };
                self.launch(1, 256, a);
            }
            Op::MoeExperts { x, selected, weights, gate, up, down, out, clamp } => {
                let (gt, dt) = (self.program.weight(gate), self.program.weight(down));
                let (in_dim, ff, out_dim) = (gt.dim(0) as usize, gt.dim(1) as usize, dt.dim(1) as usize);
                let n_expert = gt.dim(2) as u32;
                let n_used = self.len(selected);
                if in_dim / 256 > 64 || ff / 256 > 64 {
                    return Err(format!("expert rows of {in_dim} and {ff} exceed the kernel's 64 blocks of 256"));
                }
                let (gate_ty, up_ty, down_ty) =
                    (self.expert_type(gate)?, self.expert_type(up)?, self.expert_type(down)?);
                if gate_ty != up_ty {
                    return Err(format!(
                        "expert gate ({gate_ty}) and up ({up_ty}) weights of one layer must share a type for the CUDA kernels"
                    ));
                }
                self.need(Scratch::Q8KX, in_dim / 256 * Q8K_BLOCK_BYTES);
                self.need(Scratch::Mid, n_used * ff * 4);
                self.need(Scratch::Q8KMid, n_used * ff / 256 * Q8K_BLOCK_BYTES);
                if self.q8k_of.take().map(|q| q.0) != Some(x) {
                    self.launch((in_dim / 256) as u32, 256, QuantizeQ8KArgs { x: b(x), out: Scratch::Q8KX.ptr() });
                }
                if self.expert_cache {
                    self.expert_cache_launches(selected, [gate, up, down], n_used as u32, n_expert);
                }
                // A chunk runs its rows grouped by expert when the routing block can hold the
                // pairs and each slot's mid vector is whole Q8_K blocks; otherwise (a chunk of
                // more than MOE_ROUTE_MAX_PAIRS pairs) row by row as below, which gives the same bits.
                let rows = self.program.rows() as usize;
                if rows > 1
                    && self.experts != ChunkExperts::PerRow
                    && !self.expert_cache
                    && ff.is_multiple_of(256)
                    && n_expert <= MOE_ROUTE_MAX_EXPERTS
                    && rows * n_used <= MOE_ROUTE_MAX_PAIRS
                {
                    let a = MoeGateUpGroupedArgs {
                        xq: Scratch::Q8KX.ptr(),
                        selected: b(selected),
                        weights: b(weights),
                        gate: Ptr::expert_table(gate),
                        up: Ptr::expert_table(up),
                        mid: Scratch::Mid.ptr(),
                        grid: Ptr::GRID,
                        route: Scratch::MoeRoute.ptr(),
                        gate_ty,
                        in_dim: in_dim as u32,
                        ff: ff as u32,
                        n_used: n_used as u32,
                        n_expert,
                        clamp,
                    };
                    self.moe_experts_grouped(a, (down, down_ty), out, out_dim, rows);
                    return Ok(());
                }
                // The mid vector's Q8_K is made by the last block of each slot (a ticket per
                // slot) when the slot is whole Q8_K blocks, so its rows are also whole blocks of
                // 8 warps of 2 rows (the kernel's ff % 16 == 0).
                let fuse_mid = self.fuse && ff.is_multiple_of(256);
                let ticket = self.tickets;
                if fuse_mid {
                    self.tickets += n_used as u32;
                    self.need(Scratch::Tickets, self.tickets as usize * 4);
                }
                let a = MoeGateUpArgs {
                    xq: Scratch::Q8KX.ptr(),
                    selected: b(selected),
                    weights: b(weights),
                    gate: Ptr::expert_table(gate),
                    up: Ptr::expert_table(up),
                    mid: Scratch::Mid.ptr(),
                    grid: Ptr::GRID,
                    midq: if fuse_mid { Scratch::Q8KMid.ptr() } else { Ptr::NULL },
                    tickets: if fuse_mid { Scratch::Tickets.ptr() } else { Ptr::NULL },
                    gate_ty,
                    up_ty,
                    in_dim: in_dim as u32,
                    ff: ff as u32,
                    n_used: n_used as u32,
                    n_expert,
                    clamp,
                    ticket,
                };
                // One warp per two rows of each used expert (kernels/moe.cu: MOE_ROWS_PER_WARP);
                // IQ2_XXS has a kernel of its own (fewer registers than all three types' paths),
                // whose warps may take several of their slot's tasks in turn: the grid is whole
                // blocks per slot.
                if gt.ty == GgmlType::IQ2_XXS {
                    let per_slot = blocks(ff / 2, 8).div_ceil(moe_gate_up_tasks());
                    self.launch(n_used as u32 * per_slot, 256, a);
                    self.launches.last_mut().expect("just launched").kernel = "moe_gate_up_iq2_xxs";
                } else {
                    self.launch(blocks(n_used * ff / 2, 8), 256, a);
                }
                if !fuse_mid {
                    let a = QuantizeQ8KArgs { x: Scratch::Mid.ptr(), out: Scratch::Q8KMid.ptr() };
                    self.launch((n_used * ff / 256) as u32, 256, a);
                }
                let a = MoeDownArgs {
                    midq: Scratch::Q8KMid.ptr(),
                    selected: b(selected),
                    down: Ptr::expert_table(down),
                    out: b(out),
                    grid: Ptr::GRID,
                    down_ty,
                    ff: ff as u32,
                    out_dim: out_dim as u32,
                    n_used: n_used as u32,
                    n_expert,
                    _pad: 0,
                };
                self.launch(blocks(out_dim.div_ceil(2), 8), 256, a);
                // Q2_K rows of one pass (8 blocks) have a kernel of their own that loads a slot
                // pair ahead (kernels/moe.cu `moe_down_q2_k`); `DS4_CUDA_MOE_DOWN=rows` keeps
                // `moe_down` to measure against.
                if down_ty == GgmlType::Q2_K as u32
                    && ff.is_multiple_of(256)
                    && ff / 256 <= 8
                    && !env_is("DS4_CUDA_MOE_DOWN", "rows")
                {
                    self.launches.last_mut().expect("just launched").kernel = "moe_down_q2_k";
                }
            }
            Op::SwiGlu { gate, up, out, clamp } => {
                let n = self.len(out);
                // Writes the Q8_0 quantization too when the next Q8_0 matvec reads its output.
                let (xq, xd) = if self.fuse && n.is_multiple_of(32) && self.next_q8_input_is(out) {
                    self.q8_scratch(n)
                } else {
                    (Ptr::NULL, Ptr::NULL)
                };
                let a = SwiGluArgs { gate: b(gate), up: b(up), out: b(out), xq, xd, n: n as u32, clamp };
                self.launch(blocks(n, 256), 256, a);
                if xq != Ptr::NULL {
                    self.q8_of = Some((out, self.cond, self.op, false));
                }
            }
            Op::Add { a, b: y, out } => {
                // An add whose sum only feeds the HC post that follows runs inside it.
                if let Some(next) = self.next_ops(1, None).filter(|_| self.fuse) {
                    if let Op::HcPost { block, residual, split, out: hc_out, n_hc } = *next[0].1 {
                        if block == out && ![a, y].contains(&hc_out) && ![residual, split].contains(&out) {
                            self.absorb(&next);
                            self.hc_post(a, Some((y, out)), residual, split, hc_out, n_hc)?;
                            return Ok(());
                        }
                    }
                }
                let n = self.len(out);
                self.launch(blocks(n, 256), 256, AddArgs { a: b(a), b: b(y), out: b(out), n: n as u32, _pad: 0 });
            }
        }
        Ok(())
    }
}

/// `1 / sqrt(head_dim)`, as the CPU computes it (IEEE division and square root).
fn comp_ratio(b: crate::recorder::Bound) -> Result<u32, String> {
    match b.kind {
        crate::recorder::BoundKind::CompRows { ratio } => Ok(ratio),
        _ => Err("expected a compressed-row bound".into()),
    }
}

/// Bytes of one expert of a routed-expert tensor in the split layout: (quants, rest). The
/// tensor holds every expert's quants, then every expert's rest (`gpu_tables::repack_blocks`).
pub fn expert_pieces(t: &crate::gguf::TensorInfo, n_expert: u32) -> (u64, u64) {
    let (bb, _, nq) = crate::backends::gpu_tables::block_split(t.ty).unwrap_or((1, 0, 1));
    let blocks = t.bytes / bb as u64 / n_expert.max(1) as u64;
    (blocks * nq as u64, blocks * (bb - nq) as u64)
}

/// Bytes of one expert cache slot: gate, up and down, each piece 256-aligned
/// (kernels/expert_cache.cu, `cache_piece_offset`).
pub fn cache_slot_bytes(tensors: &[(u64, u64); 3]) -> u64 {
    tensors.iter().flat_map(|&(q, r)| [q, r]).map(|p| p.div_ceil(256) * 256).sum()
}

/// Plans every op of `program`, in order. With `fuse`, runs of ops share launches (the plan a
/// token and its graph use); without, every launch computes one op (for running a range of ops).
///
/// With `expert_cache`, each MoE layer first runs the expert cache's two launches (placement
/// "host": routed experts in host memory, cached in device memory).
/// Whether a decode program's attention may run split over its KV rows (kernels/attention.cu:
/// attention_scores, attention_partial, attention_combine); `DS4_CUDA_ATTN_DECODE=0` keeps the
/// block per head (`attention`), to compare.
fn split_attention() -> bool {
    !env_is("DS4_CUDA_ATTN_DECODE", "0")
}

/// A decode attention that can see at most this many rows runs as one launch (`attention`)
/// rather than split (`DS4_CUDA_ATTN_SINGLE_ROWS`, to measure).
fn single_attention_rows() -> u32 {
    std::env::var("DS4_CUDA_ATTN_SINGLE_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

pub fn plan(program: &Program, fuse: bool, expert_cache: bool) -> Result<Plan, String> {
    plan_experts(program, fuse, expert_cache, ChunkExperts::Grouped, false)
}

/// [`plan`], choosing how a chunk program runs its routed experts (the same bits every way):
/// `experts`, and with the tensor-core kinds `down_tile`, whether the Q2_K down is
/// `moe_down_tile_q2_k` (the caller reads both switches, mod.rs `build_chunk`).
pub fn plan_experts(
    program: &Program,
    fuse: bool,
    expert_cache: bool,
    experts: ChunkExperts,
    down_tile: bool,
) -> Result<Plan, String> {
    plan_with(program, fuse, expert_cache, experts, down_tile, !env_is("DS4_CUDA_HC_POST", "apart"))
}

/// [`plan_experts`], with `hc_post_inside` ([`Builder::hc_post_inside`]) given.
fn plan_with(
    program: &Program,
    fuse: bool,
    expert_cache: bool,
    experts: ChunkExperts,
    down_tile: bool,
    hc_post_inside: bool,
) -> Result<Plan, String> {
    if program.rows() > 1 && expert_cache {
        return Err("a chunk program cannot run with the expert cache (placement host)".into());
    }
    let mut b = Builder {
        program,
        fuse,
        expert_cache,
        experts,
        down_tile,
        moe_layers: 0,
        done: vec![false; program.steps().len()],
        group: Vec::new(),
        launches: Vec::new(),
        need: Vec::new(),
        cond: 0,
        op: 0,
        ropes: Vec::new(),
        q8_of: None,
        q8k_of: None,
        ss_of: None,
        hc_post_of: None,
        f16_split_of: None,
        taken_back: 0,
        hc_post_inside,
        tickets: 0,
        split_attention: program.tokens().is_none() && split_attention(),
    };
    for (i, step) in program.steps().iter().enumerate() {
        if b.done[i] {
            continue;
        }
        b.op = i;
        b.group = vec![i];
        b.taken_back = 0;
        let first = b.launches.len();
        b.op(step).map_err(|e| format!("op #{i} ({}): {e}", step.op.name()))?;
        let first = first - b.taken_back;
        let mut ops = b.group.clone();
        ops.sort_unstable();
        for l in &mut b.launches[first..] {
            l.ops = ops.clone();
        }
        // What the ops wrote is no longer what was quantized, unless they quantized their output.
        let steps = program.steps();
        if b.q8_of.is_some_and(|(q, _, by, _)| by != i && ops.iter().any(|&k| steps[k].op.writes().contains(&q))) {
            b.q8_of = None;
        }
        if b.q8k_of.is_some_and(|(q, by)| by != i && ops.iter().any(|&k| steps[k].op.writes().contains(&q))) {
            b.q8k_of = None;
        }
    }
    let mut plan = Plan { launches: b.launches, scratch: b.need, ropes: b.ropes };
    if fuse {
        mark_side_branches(program, &mut plan.launches);
    }
    skip_for_measurement(&mut plan.launches);
    Ok(plan)
}

/// `ds4_cond`'s kind 3: the launch runs nothing (it still waits for its predecessor).
pub const COND_SKIP: u64 = 3;

/// A measurement of what each kernel's work costs a token, not a mode to run: the launches of
/// the kernels named in `DS4_CUDA_SKIP` (comma-separated) keep their place in the plan and the
/// graph but return at their guard, so the token's time less theirs is the critical path without
/// their work. Their outputs are wrong, and so are the logits; the backend says so when it starts.
fn skip_for_measurement(launches: &mut [Launch]) {
    if let Some(names) = skipped_for_measurement() {
        skip_kernels(launches, &names.split(',').map(str::trim).collect::<Vec<_>>());
    }
}

fn skip_kernels(launches: &mut [Launch], names: &[&str]) {
    for l in launches.iter_mut().filter(|l| names.contains(&l.kernel)) {
        l.cond = (l.cond & !3) | COND_SKIP;
    }
}

/// The kernels `DS4_CUDA_SKIP` names, when it is set: every result of this process is wrong.
pub fn skipped_for_measurement() -> Option<String> {
    std::env::var("DS4_CUDA_SKIP").ok().filter(|v| !v.trim().is_empty())
}

/// Two runs of ops that do not depend on each other go on two streams, so one's matvecs stream
/// their weights while the other's kernels, which leave bandwidth unused, run (graph capture turns
/// the fork and join into graph edges):
/// - the shared expert of each MoE layer (gate + up, SwiGLU, down) beside the router and the routed
///   experts: both read the FFN norm and its quantizations, and the Add after them joins them;
/// - the compressor lanes of a compressed layer (their projections and window updates, which read
///   the attention norm and write only their own state) beside the query and KV path (q_a, q_b,
///   the head norms, RoPE, the raw-ring store), joined before the indexer or the attention.
///
/// A pair branches only when its launches are exactly the two runs, one after the other, and share
/// no buffer either run writes and no scratch; otherwise it stays on one stream. Each kernel
/// computes what it computed before, so the bits cannot change.
pub fn mark_side_branches(program: &Program, launches: &mut [Launch]) {
    let steps = program.steps();
    let is = |k: usize, f: fn(&Op) -> bool| k < steps.len() && f(&steps[k].op);
    for m in 0..steps.len() {
        // The FFN half: router matvec, select, experts | shared gate, up, SwiGLU, down | Add.
        if is(m, |o| matches!(o, Op::MoeExperts { .. }))
            && m >= 2
            && is(m - 2, |o| matches!(o, Op::MatVec { .. }))
            && is(m - 1, |o| matches!(o, Op::RouterSelect { .. }))
            && is(m + 1, |o| matches!(o, Op::MatVec { .. }))
            && is(m + 2, |o| matches!(o, Op::MatVec { .. }))
            && is(m + 3, |o| matches!(o, Op::SwiGlu { .. }))
            && is(m + 4, |o| matches!(o, Op::MatVec { .. }))
            && is(m + 5, |o| matches!(o, Op::Add { .. }))
        {
            try_branch(program, launches, m - 2..=m, m + 1..=m + 4);
        }
        // The attention half: q_a, its norm, q_b, head norms, kv, its norm, RoPE x2, fp8, ring
        // store | the compressor lanes' ops, up to the indexer or the attention.
        if is(m, |o| matches!(o, Op::StoreRaw { .. })) && m >= 9 && is(m - 9, |o| matches!(o, Op::MatVec { .. })) {
            let end = (m + 1..steps.len())
                .find(|&k| {
                    matches!(steps[k].op, Op::Attention { .. })
                        || matches!(steps[k].cond, Some(Cond::IndexerActive { .. }))
                })
                .unwrap_or(steps.len());
            if end > m + 1 {
                try_branch(program, launches, m - 9..=m, m + 1..=end - 1);
            }
        }
    }
}

/// Puts the launches of `side` ops on the side stream beside those of `main` ops, if the launch
/// list holds them as two whole runs, `main` then `side`, followed by another launch, and the runs
/// share nothing either writes. Returns whether it did.
fn try_branch(
    program: &Program,
    launches: &mut [Launch],
    main: std::ops::RangeInclusive<usize>,
    side: std::ops::RangeInclusive<usize>,
) -> bool {
    let steps = program.steps();
    let Some(first) = launches.iter().position(|l| l.ops.iter().any(|k| main.contains(k))) else { return false };
    let run = |from: usize, ops: &std::ops::RangeInclusive<usize>| {
        launches[from..].iter().take_while(|l| l.ops.iter().all(|k| ops.contains(k))).count()
    };
    let n_main = run(first, &main);
    let n_side = run(first + n_main, &side);
    let after = first + n_main + n_side;
    let covered = |a: usize, n: usize, ops: &std::ops::RangeInclusive<usize>| {
        ops.clone().all(|k| launches[a..a + n].iter().any(|l| l.ops.contains(&k)))
    };
    if n_main == 0
        || n_side == 0
        || after >= launches.len()
        || !covered(first, n_main, &main)
        || !covered(first + n_main, n_side, &side)
        || launches[first..after].iter().any(|l| l.side || l.fork || l.join)
    {
        return false;
    }
    let written: Vec<Buf> = main.clone().chain(side.clone()).flat_map(|k| steps[k].op.writes()).collect();
    let refs = |from: usize, n: usize| -> Vec<PtrRef> {
        launches[from..from + n]
            .iter()
            .flat_map(|l| l.ptr_words.iter().filter_map(|&w| Ptr(l.args[w]).reference()))
            .collect()
    };
    let (a, b) = (refs(first, n_main), refs(first + n_main, n_side));
    let conflict = a.iter().any(|r| {
        b.contains(r)
            && match *r {
                PtrRef::Null | PtrRef::Weight(_) | PtrRef::Grid | PtrRef::Rope(_) => false,
                // Each launch takes tickets of its own.
                PtrRef::Scratch(s) if s == Scratch::Tickets.ptr().0 as u32 => false,
                PtrRef::Buf(x) => written.contains(&Buf(x)),
                _ => true,
            }
    });
    if conflict {
        return false;
    }
    launches[first].fork = true;
    for l in &mut launches[first + n_main..after] {
        l.side = true;
    }
    launches[after].join = true;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{record_token, Caps};
    use crate::gguf::File;
    use crate::model::Model;
    use crate::synth::{self, Preset};

    /// A chunk program plans like the decode program (the executable runs a batch step's launch
    /// over all rows and a row loop's launches row by row), so each row loop's launches must come
    /// together, with nothing of another op between them; with the expert cache it is refused.
    #[test]
    fn chunk_plans_keep_each_row_loop_together() {
        for preset in [Preset::tiny(), Preset::small()] {
            let model = Model::from_file(File::from_bytes("t", synth::build(&preset, 1)).unwrap()).unwrap();
            let chunk = crate::decode::record(&model, Caps { ctx: 256 }, 8, 8).unwrap();
            let e = plan(&chunk, true, true).err().expect("refused");
            assert!(e.contains("expert cache"), "{e}");
            for fuse in [false, true] {
                let p = plan(&chunk, fuse, false).unwrap();
                let seq: Vec<Option<u32>> =
                    p.launches.iter().map(|l| l.ops.iter().find_map(|&k| chunk.steps()[k].seq)).collect();
                let loops: Vec<u32> = seq.iter().flatten().copied().collect();
                assert!(!loops.is_empty(), "{}: the compressors' row loops", preset.name);
                for k in loops {
                    let at: Vec<usize> = (0..seq.len()).filter(|&i| seq[i] == Some(k)).collect();
                    assert_eq!(
                        at.last().unwrap() - at[0] + 1,
                        at.len(),
                        "{} fuse {fuse}: loop {k} at {at:?}",
                        preset.name
                    );
                }
            }
        }
    }

    /// A chunk program runs each MoE layer's routed experts grouped by expert: the routing block,
    /// gate/up over every expert's blocks, the mid vectors' Q8_K per row, down over every
    /// expert's blocks, then each row's slot sum; the decode program keeps its per-token kernels.
    /// Past the routing block's pairs, a chunk falls back to the per-row kernels.
    #[test]
    fn chunk_plans_group_the_routed_experts_by_expert() {
        const GROUPED: [&str; 5] =
            ["moe_route", "moe_gate_up_grouped_iq2_xxs", "quantize_q8_k", "moe_down_grouped", "moe_sum_slots"];
        for preset in [Preset::tiny(), Preset::small(), Preset::flash_4l()] {
            let model = synth::device_model(&preset, 1).unwrap();
            let (n_expert, n_used, ff, n_embd) =
                (preset.n_expert as u32, preset.n_expert_used, preset.n_ff_exp, preset.n_embd);
            let decode = record_token(&model, Caps { ctx: 256 }).unwrap();
            for l in plan(&decode, true, false).unwrap().launches {
                assert!(!GROUPED[..4].contains(&l.kernel) && l.kernel != "moe_sum_slots", "{}", l.kernel);
            }
            let rows = 64;
            let chunk = crate::decode::record(&model, Caps { ctx: 256 }, rows, rows).unwrap();
            let moe: Vec<usize> =
                (0..chunk.steps().len()).filter(|&k| matches!(chunk.steps()[k].op, Op::MoeExperts { .. })).collect();
            assert_eq!(moe.len(), preset.n_layer);
            for fuse in [false, true] {
                let p = plan(&chunk, fuse, false).unwrap();
                for &m in &moe {
                    let ls: Vec<&Launch> = p.launches.iter().filter(|l| l.ops.contains(&m)).collect();
                    let kernels: Vec<&str> = ls.iter().map(|l| l.kernel).collect();
                    // hc_pre quantizes the experts' input when it fuses; else a launch of its own.
                    let at = kernels.len() - GROUPED.len();
                    assert_eq!(kernels[at..], GROUPED, "{} fuse {fuse}: {kernels:?}", preset.name);
                    let [route, gate_up, _, down, sum] = [at, at + 1, at + 2, at + 3, at + 4].map(|i| ls[i]);
                    assert_eq!((route.grid, route.block), (1, 1024));
                    assert_eq!(route.args[3] as u32, rows, "the routing block's row count");
                    assert_eq!(gate_up.grid, n_expert * (ff / 16) as u32);
                    assert_eq!(down.grid, n_expert * (n_embd.div_ceil(2).div_ceil(8)) as u32);
                    assert_eq!(sum.grid, n_embd.div_ceil(256) as u32);
                    // The three grouped launches read the routing block's list.
                    let route_ref = Scratch::MoeRoute.ptr().0;
                    assert_eq!(route.args[1], route_ref);
                    assert_eq!(gate_up.args[7], route_ref);
                    assert_eq!(down.args[4], route_ref);
                }
                let need = |k: Scratch| p.scratch.iter().find(|(s, _)| *s == k).map_or(0, |&(_, b)| b);
                assert_eq!(need(Scratch::MoeRoute), (2 * n_expert as usize + rows as usize * n_used) * 4);
                assert_eq!(need(Scratch::MoeParts), n_used * n_embd * 4);
            }
        }
        // More pairs than the routing block holds: the per-row kernels.
        let preset = Preset::small();
        let model = synth::device_model(&preset, 1).unwrap();
        let rows = (MOE_ROUTE_MAX_PAIRS / preset.n_expert_used + 1) as u32;
        let chunk = crate::decode::record(&model, Caps { ctx: rows }, rows, rows).unwrap();
        let kernels: Vec<&str> = plan(&chunk, true, false).unwrap().launches.iter().map(|l| l.kernel).collect();
        assert!(kernels.iter().any(|k| ["moe_down", "moe_down_q2_k"].contains(k)) && !kernels.contains(&"moe_route"));
    }

    /// With the tensor-core choice, a chunk's IQ2_XXS gate/up and Q2_K down take the int8 MMA
    /// kernels (a warp per 8 mid rows, per 16 output rows; 8 warps a block), the rest as grouped;
    /// per row, the choice changes nothing.
    #[test]
    fn chunk_plans_take_the_tensor_core_experts() {
        const MMA: [&str; 5] =
            ["moe_route", "moe_gate_up_mma_iq2_xxs", "quantize_q8_k", "moe_down_mma_q2_k", "moe_sum_slots"];
        for preset in [Preset::tiny(), Preset::small(), Preset::flash_4l()] {
            assert_eq!(preset.expert_types, (GgmlType::IQ2_XXS, GgmlType::Q2_K), "{}", preset.name);
            let model = synth::device_model(&preset, 1).unwrap();
            let (n_expert, ff, n_embd) = (preset.n_expert as u32, preset.n_ff_exp, preset.n_embd);
            let rows = 64;
            let chunk = crate::decode::record(&model, Caps { ctx: 256 }, rows, rows).unwrap();
            let grouped = plan(&chunk, true, false).unwrap();
            for (mode, tile, gate_up, down) in [
                (ChunkExperts::GroupedMma, false, "moe_gate_up_mma_iq2_xxs", "moe_down_mma_q2_k"),
                (ChunkExperts::GroupedMmaTile, false, GATE_UP_TILE_KERNEL, "moe_down_mma_q2_k"),
                (ChunkExperts::GroupedMma, true, "moe_gate_up_mma_iq2_xxs", "moe_down_tile_q2_k"),
                (ChunkExperts::GroupedMmaTile, true, GATE_UP_TILE_KERNEL, "moe_down_tile_q2_k"),
            ] {
                let mma = plan_experts(&chunk, true, false, mode, tile).unwrap();
                assert_eq!(grouped.launches.len(), mma.launches.len());
                let mut seen = 0;
                for (g, m) in grouped.launches.iter().zip(&mma.launches) {
                    match m.kernel {
                        k if k == gate_up => {
                            assert_eq!(g.kernel, "moe_gate_up_grouped_iq2_xxs");
                            assert_eq!((m.grid, m.block), (n_expert * (ff / 64) as u32, 256));
                            seen += 1;
                        }
                        k if k == down => {
                            assert_eq!(g.kernel, "moe_down_grouped");
                            assert_eq!((m.grid, m.block), (n_expert * n_embd.div_ceil(16).div_ceil(8) as u32, 256));
                            seen += 1;
                        }
                        k => assert_eq!((k, m.grid, m.block), (g.kernel, g.grid, g.block)),
                    }
                    assert_eq!((&m.args, &m.ops, m.cond), (&g.args, &g.ops, g.cond), "{}", m.kernel);
                }
                assert_eq!(seen, 2 * preset.n_layer, "{}", preset.name);
                let kernels: Vec<&str> = mma.launches.iter().map(|l| l.kernel).collect();
                let want = [MMA[0], gate_up, MMA[2], down, MMA[4]];
                for k in [MMA[0], gate_up, down] {
                    assert!(ALL_ROWS_KERNELS.contains(&k), "{k} covers every chunk row in one launch");
                }
                assert!(kernels.windows(5).any(|w| w == want), "{kernels:?}");
            }
            let decode = record_token(&model, Caps { ctx: 256 }).unwrap();
            let a = plan_experts(&decode, true, false, ChunkExperts::GroupedMma, false).unwrap().launches;
            let b = plan(&decode, true, false).unwrap().launches;
            assert!(a.iter().map(|l| l.kernel).eq(b.iter().map(|l| l.kernel)));
        }
    }

    /// (kernel, argument struct) of each `extern "C" __global__` kernel in the sources.
    fn kernel_signatures() -> Vec<(String, String)> {
        let src = super::super::kernel_source(super::super::BlockLayout::Split, super::super::KernelRows::Chunk);
        let mut out = Vec::new();
        for part in src.split("extern \"C\" __global__ void ").skip(1) {
            // A `__launch_bounds__(...)` may come before the name.
            let part = match part.strip_prefix("__launch_bounds__(") {
                Some(rest) => &rest[rest.find(')').unwrap() + 1..],
                None => part,
            };
            let name = part[..part.find('(').unwrap()].trim().to_string();
            let params = &part[part.find('(').unwrap() + 1..part.find(')').unwrap()];
            let parts: Vec<&str> = params.split(',').map(str::trim).collect();
            assert_eq!(parts.len(), 2, "{name} takes (DS4_ARGS, XArgs a), not ({params})");
            assert_eq!(parts[0], "DS4_ARGS", "{name}");
            let ty = parts[1].strip_suffix(" a").unwrap_or("?").to_string();
            out.push((name, ty));
        }
        out
    }

    #[test]
    fn every_launch_matches_its_kernel_signature() {
        let sigs = kernel_signatures();
        assert!(sigs.len() >= 25, "kernels found: {sigs:?}");
        // Each kernel takes the struct declared for it in args.rs.
        for (kernel, c_name, _, _) in args::all() {
            let (_, ty) = sigs
                .iter()
                .find(|(k, _)| k == kernel)
                .unwrap_or_else(|| panic!("no kernel named {kernel} in kernels/"));
            assert_eq!(ty, c_name, "kernel {kernel}");
        }
        for (preset, fuse) in [(Preset::tiny(), false), (Preset::tiny(), true), (Preset::small(), true)] {
            let model = Model::from_file(File::from_bytes("t", synth::build(&preset, 1)).unwrap()).unwrap();
            let program = record_token(&model, Caps { ctx: 128 }).unwrap();
            let plan = plan(&program, fuse, false).unwrap();
            let mut ops_seen = vec![0; program.steps().len()];
            let mut last_group: Option<&Vec<usize>> = None;
            for l in &plan.launches {
                assert!(sigs.iter().any(|(k, _)| k == l.kernel), "no kernel named {} in kernels/", l.kernel);
                assert!(l.grid >= 1 && l.block >= 32 && l.block <= 1024, "{}: {} x {}", l.kernel, l.grid, l.block);
                for &p in &l.ptr_words {
                    assert!(args::Ptr(l.args[p]).reference().is_some(), "{}: word {p} is not a reference", l.kernel);
                }
                assert!(fuse || l.ops.len() == 1, "{}: fused without fusion", l.kernel);
                // An op belongs to one group of consecutive launches.
                if last_group != Some(&l.ops) {
                    for &k in &l.ops {
                        ops_seen[k] += 1;
                    }
                }
                last_group = Some(&l.ops);
                // Predicated ops keep their predicate on every launch; a fused launch's ops share it,
                // or it decides their predicate inside (a compressor update, under emit).
                if l.kernel != "compressor_update" && l.kernel != "mat_vec_f16_split_comp" {
                    for &k in &l.ops {
                        assert_eq!(l.cond, pack_cond(program.steps()[k].cond), "{} op {k}", l.kernel);
                    }
                }
            }
            assert!(ops_seen.iter().all(|&s| s == 1), "every recorded op is computed by exactly one group of launches");
        }
    }

    /// A decode program's attention runs split over its KV rows: three launches whose grids
    /// cover the rows a layer can see (the window, and top_k compressed rows once the indexer
    /// selects; not the whole ring or cache), with scratch for them. A chunk program keeps
    /// `attention`, which build_chunk replaces by its chunk form.
    #[test]
    fn decode_attention_splits_over_its_rows() {
        let model = synth::device_model(&Preset::flash_4l(), 1).unwrap();
        let ctx = 32768;
        let program = record_token(&model, Caps { ctx }).unwrap();
        for fuse in [false, true] {
            let p = plan(&program, fuse, false).unwrap();
            let mut layers = [0; 3];
            for (k, step) in program.steps().iter().enumerate() {
                let Op::Attention { comp, selected, .. } = step.op else { continue };
                let ls: Vec<&Launch> = p.launches.iter().filter(|l| l.ops.contains(&k)).collect();
                let kernels: Vec<&str> = ls.iter().map(|l| l.kernel).collect();
                assert_eq!(kernels, ["attention_scores", "attention_partial", "attention_combine"]);
                // Visible rows: the window of 128, then 512 selected or ctx / 128 compressed rows.
                let (kind, vis) = match (comp, selected) {
                    (None, _) => (0, 128),
                    (Some(_), Some(_)) => (1, 128 + 512),
                    (Some(_), None) => (2, 128 + ctx / 128),
                };
                layers[kind] += 1;
                // 4 groups of 16 heads; rows in slices of 8 and chunks of 64; 512 dims in 4 slices.
                assert_eq!((ls[0].grid, ls[0].block), (vis.div_ceil(8) * 4, 256));
                assert_eq!((ls[1].grid, ls[1].block), (vis.div_ceil(64) * 4 * 4, 128));
                assert!(ls.iter().all(|l| l.cond == ls[0].cond && l.args[..10] == ls[0].args[..10]));
                // The combine in its own launch (the default): no tickets, one copy of the sums.
                assert_eq!(ls[1].args[13], 0);
                assert_eq!((ls[2].grid, ls[2].block), (64, 512));
                assert_eq!(ls[1].args[19] >> 32, (1 + vis.div_ceil(64) as u64) * 64, "sums_slice");
            }
            assert_eq!(layers, [2, 1, 1], "flash-4l: two dense layers, then ratios 4 and 128");
            let need = |k: Scratch| p.scratch.iter().find(|(s, _)| *s == k).map_or(0, |&(_, b)| b);
            assert_eq!(need(Scratch::AttnMaxes), 80 * 64 * 4);
            assert_eq!(need(Scratch::AttnSums), 11 * 64 * 4);
            assert_eq!(need(Scratch::AttnParts), 10 * 64 * 512 * 4);
        }
        let chunk = crate::decode::record(&model, Caps { ctx: 256 }, 8, 8).unwrap();
        let kernels: Vec<&str> = plan(&chunk, true, false).unwrap().launches.iter().map(|l| l.kernel).collect();
        assert!(kernels.contains(&"attention") && !kernels.iter().any(|k| k.starts_with("attention_")));
    }

    /// Every MoE layer of the token's (fused) plan forks once, and so does every compressed
    /// layer's attention half: the shared expert's launches, or the compressor lanes' launches,
    /// and only they, run on the side stream right after the main run, and the next launch joins
    /// them; the one-op-per-launch plan stays on one stream.
    #[test]
    fn shared_experts_and_compressors_run_beside_the_main_path() {
        for preset in [Preset::small(), Preset::flash_4l()] {
            let model = synth::device_model(&preset, 1).unwrap();
            let program = record_token(&model, Caps { ctx: 128 }).unwrap();
            let steps = program.steps();
            let moe: Vec<usize> = (0..steps.len()).filter(|&k| matches!(steps[k].op, Op::MoeExperts { .. })).collect();
            // (first, last) op of each layer's compressor run: after the ring store, before the
            // indexer's predicated ops or the attention.
            let comp: Vec<(usize, usize)> = (0..steps.len())
                .filter(|&k| matches!(steps[k].op, Op::StoreRaw { .. }))
                .filter_map(|k| {
                    let end = (k + 1..steps.len()).find(|&e| {
                        matches!(steps[e].op, Op::Attention { .. })
                            || matches!(steps[e].cond, Some(Cond::IndexerActive { .. }))
                    })?;
                    (end > k + 1).then_some((k + 1, end - 1))
                })
                .collect();
            assert!(!comp.is_empty());
            for cache in [false, true] {
                let plan = plan(&program, true, cache).unwrap();
                let l = &plan.launches;
                assert_eq!(l.iter().filter(|l| l.fork).count(), moe.len() + comp.len());
                assert_eq!(l.iter().filter(|l| l.join).count(), moe.len() + comp.len());
                for (i, x) in l.iter().enumerate().filter(|(_, x)| x.side) {
                    for &k in &x.ops {
                        let shared = moe.iter().any(|&m| (m + 1..=m + 4).contains(&k));
                        let compressor = comp.iter().any(|&(a, b)| (a..=b).contains(&k));
                        assert!(
                            shared || compressor,
                            "side launch {i} ({}) computes op {k} {:?}",
                            x.kernel,
                            steps[k].op
                        );
                    }
                    // A side run ends at a join and starts after a fork.
                    assert!(l[i + 1].side || l[i + 1].join, "launch {i}");
                    assert!(l[..i].iter().rev().find(|y| !y.side).is_some_and(|_| l[..i].iter().any(|y| y.fork)));
                }
            }
            assert!(plan(&program, false, false).unwrap().launches.iter().all(|l| !l.side && !l.fork && !l.join));
        }
    }

    /// With the expert cache, each MoE layer first finds its misses and copies them, then its
    /// experts run: the two launches belong to the MoE op and number the layers in program order.
    #[test]
    fn expert_cache_launches_come_before_each_moe_layer() {
        let model = Model::from_file(File::from_bytes("t", synth::build(&Preset::small(), 1)).unwrap()).unwrap();
        let program = record_token(&model, Caps { ctx: 128 }).unwrap();
        let moe: Vec<usize> =
            (0..program.steps().len()).filter(|&i| matches!(program.steps()[i].op, Op::MoeExperts { .. })).collect();
        assert!(!moe.is_empty());
        for fuse in [false, true] {
            let (plain, cached) = (plan(&program, fuse, false).unwrap(), plan(&program, fuse, true).unwrap());
            assert_eq!(cached.launches.len(), plain.launches.len() + 2 * moe.len());
            let mut layer = 0;
            for (i, l) in cached.launches.iter().enumerate() {
                if l.kernel != "expert_cache_plan" {
                    continue;
                }
                let next: Vec<&str> = cached.launches[i + 1..]
                    .iter()
                    .map(|l| l.kernel)
                    .take_while(|k| *k != "expert_cache_plan")
                    .collect();
                assert_eq!(next[0], "expert_cache_copy");
                assert!(
                    next.iter().any(|k| k.starts_with("moe_gate_up")) && next.iter().any(|k| k.starts_with("moe_down")),
                    "{next:?}"
                );
                assert!(l.ops.contains(&moe[layer]), "launch {i}");
                assert_eq!(l.args[1], Ptr::cache_state(layer as u32).0);
                layer += 1;
            }
            assert_eq!(layer, moe.len());
        }
        // A slot holds one expert's six pieces, each 256-aligned.
        let pieces = [(1000, 30), (512, 256), (4096, 1)];
        assert_eq!(cache_slot_bytes(&pieces), 1024 + 256 + 512 + 256 + 4096 + 256);
    }

    /// Every Q8_0 matvec reads a Q8_0 scratch that holds its own input's quantization: the last
    /// quantizing launch into that scratch before it (a quantize_q8_0, or a norm, attention,
    /// SwiGLU or matvec tail that quantizes its output) was of that buffer, and no op has written
    /// the buffer since. Both scratches (`Q8Qs`, `Q8QsB`) are tracked apart.
    #[test]
    fn every_q8_0_matvec_reads_the_quantization_of_its_input() {
        let (mut tails, mut in_b) = (0, 0);
        for preset in [Preset::tiny(), Preset::small()] {
            let model = Model::from_file(File::from_bytes("t", synth::build(&preset, 1)).unwrap()).unwrap();
            let program = record_token(&model, Caps { ctx: 128 }).unwrap();
            for fuse in [false, true] {
                let plan = plan(&program, fuse, false).unwrap();
                // scratch reference -> (the quantized buffer's reference, the launch group that quantized it)
                let mut held: std::collections::HashMap<u64, (u64, &Vec<usize>)> = Default::default();
                let (mut checked, mut fused) = (0, 0);
                for (i, l) in plan.launches.iter().enumerate() {
                    let ops = &l.ops;
                    let reads_q8 = l.kernel.starts_with("mat_vec_q8_0");
                    if reads_q8 {
                        for &k in ops {
                            let x = match program.steps()[k].op {
                                Op::MatVec { x, .. } | Op::MatVecGrouped { x, .. } => x,
                                Op::RmsNorm { .. } | Op::SwiGlu { .. } if l.kernel != "mat_vec_q8_0" => continue,
                                Op::RopeTail { .. } | Op::Fp8RoundTrip { .. } | Op::StoreRaw { .. }
                                    if l.kernel == "mat_vec_q8_0_qkv" =>
                                {
                                    continue
                                }
                                ref op => panic!("launch {i}: {op:?} in a Q8_0 matvec"),
                            };
                            let have = held.get(&l.args[1]).map(|h| h.0);
                            assert_eq!(have, Some(args::Ptr::buf(x).0), "launch {i} (op {k})");
                            in_b += (l.args[1] == Scratch::Q8QsB.ptr().0) as usize;
                            checked += 1;
                        }
                    }
                    // (word of the output, word of xq) for the launches that quantize their output.
                    let quantizes = match l.kernel {
                        "quantize_q8_0" => Some((0, 1)),
                        "rms_norm" => Some((2, 3)),
                        "attention" | "attention_combine" | "attention_partial_combine" => Some((5, 8)),
                        "swiglu" => Some((2, 3)),
                        "hc_pre" => Some((11, 12)),
                        // mode (word 13, low half) 2 quantizes the matvec's own output (word 3).
                        "mat_vec_q8_0_quant" | "mat_vec_q8_0_norm" => {
                            Some((if l.args[13] as u32 == Q8Tail::Quant as u32 { 3 } else { 8 }, 9))
                        }
                        _ => None,
                    };
                    if let Some((out, xq)) = quantizes.filter(|&(_, xq)| l.args[xq] != 0) {
                        if l.kernel == "quantize_q8_0" {
                            let again = held.get(&l.args[xq]).map(|h| h.0) == Some(l.args[out]);
                            assert!(!again, "launch {i} re-quantizes a held input");
                        } else {
                            fused += 1;
                        }
                        tails += l.kernel.starts_with("mat_vec_q8_0_") as usize;
                        held.insert(l.args[xq], (l.args[out], ops));
                    }
                    // After a group's last launch, what its ops wrote is no longer what was quantized
                    // (unless the group quantized its own output).
                    let last_of_group = plan.launches.get(i + 1).is_none_or(|n| n.ops != l.ops);
                    if last_of_group {
                        held.retain(|_, &mut (buf, by)| {
                            let writes = ops
                                .iter()
                                .any(|&k| program.steps()[k].op.writes().iter().any(|&w| args::Ptr::buf(w).0 == buf));
                            by == ops || !writes
                        });
                    }
                }
                assert!(checked > 10, "{}: {checked} Q8_0 matvecs", preset.name);
                assert!(!FUSE_NORM_Q8 || fused > 3, "{}: {fused} fused quantizations", preset.name);
            }
        }
        assert!(tails > 0 && in_b > 0, "{tails} matvec tails, {in_b} matvecs reading the second scratch");
    }

    /// The fused plan runs the ops in an order the program's data allows: an op that moved
    /// earlier (a second matrix in a matvec launch) never passes an op it depends on, or one that
    /// reads what it overwrites.
    #[test]
    fn fused_order_respects_every_dependency() {
        let models = [
            Model::from_file(File::from_bytes("t", synth::build(&Preset::tiny(), 1)).unwrap()).unwrap(),
            Model::from_file(File::from_bytes("t", synth::build(&Preset::small(), 1)).unwrap()).unwrap(),
            synth::device_model(&Preset::flash_4l(), 1).unwrap(),
        ];
        for (model, hc_post_inside) in models.iter().flat_map(|m| [(m, false), (m, true)]) {
            let program = record_token(model, Caps { ctx: 256 }).unwrap();
            let steps = program.steps();
            let plan = plan_with(&program, true, false, ChunkExperts::Grouped, false, hc_post_inside).unwrap();
            // The position of each op's group in launch order.
            let mut at = vec![usize::MAX; steps.len()];
            let mut group = 0;
            for (i, l) in plan.launches.iter().enumerate() {
                if i > 0 && plan.launches[i - 1].ops != l.ops {
                    group += 1;
                }
                for &k in &l.ops {
                    at[k] = group;
                }
            }
            let conflict = |i: usize, j: usize| {
                let (ri, wi, rj, wj) =
                    (steps[i].op.reads(), steps[i].op.writes(), steps[j].op.reads(), steps[j].op.writes());
                wi.iter().any(|b| rj.contains(b) || wj.contains(b)) || ri.iter().any(|b| wj.contains(b))
            };
            let mut moved = 0;
            for j in 0..steps.len() {
                for i in 0..j {
                    if at[i] > at[j] {
                        moved += 1;
                        assert!(
                            !conflict(i, j),
                            "op {j} ({}) runs before op {i} ({}) it depends on",
                            steps[j].op.name(),
                            steps[i].op.name()
                        );
                    }
                }
            }
            assert!(moved > 0, "some op moved earlier");
        }
    }

    /// Fusion keeps the work and cuts the launches: on the Flash shape every fused kernel appears,
    /// and the node count is well under the unfused one.
    #[test]
    fn flash_fuses_its_small_ops() {
        let model = synth::device_model(&Preset::flash(), 1).unwrap();
        // 4096: the indexer (top-k 512 of ctx / 4 rows) is recorded; at 2048 it never selects.
        let program = record_token(&model, Caps { ctx: 4096 }).unwrap();
        // The HC posts apart first (DS4_CUDA_HC_POST=apart); inside hc_pre (the default) below.
        let fused = plan_with(&program, true, false, ChunkExperts::Grouped, false, false).unwrap();
        let single = plan(&program, false, false).unwrap();
        let count = |p: &Plan, k: &str| p.launches.iter().filter(|l| l.kernel == k).count();
        let layers = 43;
        // qkv_finish is a launch of its own unless DS4_CUDA_QKV=fused (measured slower).
        assert_eq!((count(&fused, "qkv_finish"), count(&fused, "mat_vec_q8_0_qkv")), (layers, 0));
        // Each compressor lane's update runs in the last block of its kv + score projections.
        assert_eq!(count(&fused, "mat_vec_f16_split_comp"), count(&single, "compressor_store"));
        assert_eq!(count(&fused, "compressor_update"), 0);
        for l in fused.launches.iter().filter(|l| l.kernel == "mat_vec_f16_split_comp") {
            let names: Vec<&str> = l.ops.iter().map(|&k| program.steps()[k].op.name()).collect();
            assert!(names.starts_with(&["mat_vec", "mat_vec", "compressor_store"]), "{names:?}");
        }
        assert_eq!(count(&fused, "add"), 0);
        assert_eq!(count(&fused, "hc_pre"), 2 * layers);
        assert_eq!(count(&fused, "hc_split"), 0);
        // The router selects in its projection's last block; the q_a norm, wo_a's quantization
        // and the shared expert's SwiGLU run in their matvecs' tails.
        assert_eq!((count(&fused, "router"), count(&fused, "router_select")), (layers, 0));
        let tails = count(&fused, "mat_vec_q8_0_quant") + count(&fused, "mat_vec_q8_0_norm");
        assert_eq!(tails, q8_tails().len() * layers);
        assert_eq!((count(&fused, "swiglu"), count(&fused, "quantize_q8_0")), (0, 0));
        // Every hc_pre but the token's first (after embed_hc) takes the streams' sums of squares
        // from the hc_post launched just before it.
        let reads_ss = |l: &Launch| l.ptr_words.iter().any(|&k| l.args[k] == Scratch::HcSumSq.ptr().0);
        for (i, l) in fused.launches.iter().enumerate().filter(|(_, l)| l.kernel == "hc_pre") {
            let after_post = i > 0 && fused.launches[i - 1].kernel == "hc_post";
            assert_eq!(reads_ss(l), after_post, "hc_pre launch {i}");
            assert_eq!(after_post, i != fused.launches.iter().position(|l| l.kernel == "hc_pre").unwrap());
        }
        // With the HC post inside hc_pre, every hc_pre but the first runs it instead: only the
        // last, before the output head, is a launch of its own.
        let inside = plan_with(&program, true, false, ChunkExperts::Grouped, false, true).unwrap();
        let hc_pres: Vec<&Launch> = inside.launches.iter().filter(|l| l.kernel == "hc_pre").collect();
        let takes_post = |l: &Launch| {
            l.ops.iter().any(|&k| matches!(program.steps()[k].op, Op::HcPost { .. })) && !reads_ss(l) && l.args[16] != 0
            // post_block
        };
        assert!(!takes_post(hc_pres[0]) && hc_pres[1..].iter().all(|l| takes_post(l)));
        assert_eq!(count(&inside, "hc_post"), 1);
        assert_eq!(inside.launches.len() + 2 * layers - 1, fused.launches.len());
        if !env_is("DS4_CUDA_HC_POST", "apart") {
            assert_eq!(plan(&program, true, false).unwrap().launches.len(), inside.launches.len(), "the default");
        }
        // The experts' input is quantized inside hc_pre, the mid vector inside gate/up.
        assert_eq!(count(&fused, "quantize_q8_k"), 0);
        // The indexer query's RoPE and FP4 round trip share a launch; no other RoPE is on its own.
        let indexers = fused.launches.iter().filter(|l| l.kernel.starts_with("indexer_scores")).count();
        assert!(indexers > 0);
        assert_eq!(count(&fused, "indexer_query_finish"), indexers);
        assert_eq!((count(&fused, "rope_tail"), count(&fused, "indexer_qat")), (0, 0));
        let mut by_kernel: std::collections::BTreeMap<&str, usize> = Default::default();
        for l in &fused.launches {
            *by_kernel.entry(l.kernel).or_default() += 1;
        }
        println!("{by_kernel:?}");
        println!("Flash: {} launches fused, {} one per op", fused.launches.len(), single.launches.len());
        assert!(fused.launches.len() < single.launches.len() * 2 / 3, "{} launches", fused.launches.len());

        // At ctx 2048 a ratio-4 layer holds at most top_k compressed rows: the indexer's compressor
        // lane and its five launches are not recorded, and nothing else changes.
        let short_program = record_token(&model, Caps { ctx: 2048 }).unwrap();
        let short = plan_with(&short_program, true, false, ChunkExperts::Grouped, false, false).unwrap();
        assert!(short.launches.iter().all(|l| !l.kernel.starts_with("indexer")));
        let comp_lanes = count(&fused, "mat_vec_f16_split_comp") - count(&short, "mat_vec_f16_split_comp");
        assert_eq!(comp_lanes, indexers);
        let indexer_launches = fused.launches.len() - short.launches.len() - comp_lanes;
        let names = "query and weights projections, query finish, scores, top-k";
        assert_eq!(indexer_launches, 5 * indexers, "{names}");
        // With the HC posts inside hc_pre (the default, checked above) a Flash token at ctx 2048
        // stays within the graph-node budget of 700 that the CUDA backend aims at.
        let short_inside = plan_with(&short_program, true, false, ChunkExperts::Grouped, false, true).unwrap();
        let inside_n = short_inside.launches.len();
        println!("Flash at ctx 2048: {} launches apart, {inside_n} with the posts inside", short.launches.len());
        assert!(inside_n <= 700, "{inside_n} launches");
    }

    /// The measurement switch turns only the named kernels' launches off, keeping every launch
    /// (the graph's shape) and the other bits of their predicates (a chunk's row count).
    #[test]
    fn skipping_a_kernel_keeps_the_launch_and_turns_it_off() {
        let model = synth::device_model(&Preset::flash_4l(), 1).unwrap();
        let program = record_token(&model, Caps { ctx: 4096 }).unwrap();
        let base = plan(&program, true, false).unwrap();
        let mut skipped = plan(&program, true, false).unwrap();
        skip_kernels(&mut skipped.launches, &["hc_pre", "moe_down_q2_k"]);
        assert_eq!(base.launches.len(), skipped.launches.len());
        let mut off = 0;
        for (b, s) in base.launches.iter().zip(&skipped.launches) {
            assert_eq!((b.kernel, &b.args, b.side), (s.kernel, &s.args, s.side));
            if ["hc_pre", "moe_down_q2_k"].contains(&b.kernel) {
                assert_eq!((s.cond & 3, s.cond >> 2), (COND_SKIP, b.cond >> 2));
                off += 1;
            } else {
                assert_eq!(s.cond, b.cond);
            }
        }
        assert_eq!(off, 3 * 4, "flash-4l: two hc_pre and one moe_down_q2_k a layer");
    }

    /// kernels/moe.cu decodes IQ2_XXS grid bytes as codes 0, 1, 2 for 8, 25, 43 (iq2_nibble_tables):
    /// no other byte may occur.
    #[test]
    fn iq2_xxs_grid_bytes_are_8_25_or_43() {
        for g in crate::quant::IQ2XXS_GRID {
            assert!(g.to_le_bytes().iter().all(|b| [8, 25, 43].contains(b)), "{g:#x}");
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
