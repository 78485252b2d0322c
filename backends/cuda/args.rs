//! Kernel arguments: one `#[repr(C)]` struct per kernel, defined once here. The C definitions
//! the kernels see are generated from the same declaration ([`c_header`]), so the host and the
//! kernel cannot disagree on a field's order, type or offset. Every kernel is
//! `NAME(const StepParams* P, u64 cond, const RowStrides R, NameArgs a)`: a launch covers one
//! token row, or the rows of a prefill chunk as `blockIdx.y` (row `y` reads `P[y]` and sees every
//! pointer of `a` advanced by `y * R.s[i]` bytes, [`ROW_STRIDES`]).

use crate::recorder::StepParams;

/// A device pointer field. While a launch is planned it holds a symbolic reference
/// ([`Ptr::buf`], [`Ptr::weight`], ...); the executable replaces it by the address.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Ptr(pub u64);

/// What a symbolic [`Ptr`] refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtrRef {
    Null,
    Buf(u32),
    Weight(u32),
    Scratch(u32),
    /// The IQ2_XXS grid table.
    Grid,
    /// The (cos, sin) table of `Plan::ropes[i]`.
    Rope(u32),
    /// Where each expert of routed-expert weight `w` is now: (quants, rest) per expert.
    ExpertTable(u32),
    /// Where each expert of weight `w` lives for good (device or host memory).
    ExpertHome(u32),
    /// The expert cache state of MoE layer `i` (kernels/expert_cache.cu).
    CacheState(u32),
    /// The expert cache slots of MoE layer `i`.
    CacheSlots(u32),
    /// The expert cache counters: hits, copies, reads from host memory.
    CacheStats,
}

impl Ptr {
    pub const NULL: Ptr = Ptr(0);
    pub const GRID: Ptr = Ptr(5 << 32);
    pub fn buf(b: crate::recorder::Buf) -> Ptr {
        Ptr((1 << 32) | b.0 as u64)
    }
    pub fn weight(w: crate::recorder::WeightId) -> Ptr {
        Ptr((2 << 32) | w.0 as u64)
    }
    pub fn scratch(i: u32) -> Ptr {
        Ptr((3 << 32) | i as u64)
    }
    pub fn rope(i: usize) -> Ptr {
        Ptr((4 << 32) | i as u64)
    }
    pub fn expert_table(w: crate::recorder::WeightId) -> Ptr {
        Ptr((6 << 32) | w.0 as u64)
    }
    pub fn expert_home(w: crate::recorder::WeightId) -> Ptr {
        Ptr((7 << 32) | w.0 as u64)
    }
    pub fn cache_state(layer: u32) -> Ptr {
        Ptr((8 << 32) | layer as u64)
    }
    pub fn cache_slots(layer: u32) -> Ptr {
        Ptr((9 << 32) | layer as u64)
    }
    pub const CACHE_STATS: Ptr = Ptr(10 << 32);
    /// The reference a planned (not yet resolved) pointer holds.
    pub fn reference(self) -> Option<PtrRef> {
        let (kind, i) = (self.0 >> 32, self.0 as u32);
        Some(match kind {
            0 if i == 0 => PtrRef::Null,
            1 => PtrRef::Buf(i),
            2 => PtrRef::Weight(i),
            3 => PtrRef::Scratch(i),
            4 => PtrRef::Rope(i),
            5 => PtrRef::Grid,
            6 => PtrRef::ExpertTable(i),
            7 => PtrRef::ExpertHome(i),
            8 => PtrRef::CacheState(i),
            9 => PtrRef::CacheSlots(i),
            10 => PtrRef::CacheStats,
            _ => return None,
        })
    }
}

/// The kind of one field, for the generated C and for finding the pointers to resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Ptr,
    U32,
    F32,
    U64,
}

impl Field {
    pub fn bytes(self) -> usize {
        match self {
            Field::Ptr | Field::U64 => 8,
            Field::U32 | Field::F32 => 4,
        }
    }
}

/// Implemented by every kernel's argument struct.
pub trait KernelArgs: bytemuck::Pod {
    /// The kernel that takes this struct.
    const KERNEL: &'static str;
    /// (name, kind, C type) of every field, in order.
    const FIELDS: &'static [(&'static str, Field, &'static str)];
}

macro_rules! field_kind {
    (Ptr) => {
        Field::Ptr
    };
    (u32) => {
        Field::U32
    };
    (f32) => {
        Field::F32
    };
    (u64) => {
        Field::U64
    };
}

macro_rules! kernel_args {
    ($( $kernel:literal => $name:ident { $( $field:ident : $ty:ident = $cty:literal ),* $(,)? } )*) => {
        $(
            #[repr(C)]
            #[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
            pub struct $name { $( pub $field: $ty ),* }
            impl KernelArgs for $name {
                const KERNEL: &'static str = $kernel;
                const FIELDS: &'static [(&'static str, Field, &'static str)] =
                    &[ $( (stringify!($field), field_kind!($ty), $cty) ),* ];
            }
        )*
        /// Every argument struct: (kernel, C name, fields, Rust size).
        pub fn all() -> Vec<(&'static str, &'static str, &'static [(&'static str, Field, &'static str)], usize)> {
            vec![ $( ($kernel, stringify!($name), <$name as KernelArgs>::FIELDS, std::mem::size_of::<$name>()) ),* ]
        }
    };
}

kernel_args! {
    "embed_hc" => EmbedHcArgs { table: Ptr = "const void*", out: Ptr = "float*", n_embd: u32 = "u32", n_hc: u32 = "u32", is_f16: u32 = "u32", _pad: u32 = "u32" }
    "rms_norm" => RmsNormArgs { x: Ptr = "const float*", w: Ptr = "const float*", out: Ptr = "float*", xq: Ptr = "i8*", xd: Ptr = "float*", n: u32 = "u32", eps: f32 = "float", slices: u32 = "u32", _pad: u32 = "u32" }
    "quantize_q8_0" => QuantizeQ80Args { x: Ptr = "const float*", xq: Ptr = "i8*", xd: Ptr = "float*", n: u32 = "u32", _pad: u32 = "u32" }
    "mat_vec_q8_0" => MatVecQ80Args { w: Ptr = "const u8*", xq: Ptr = "const i8*", xd: Ptr = "const float*", out: Ptr = "float*", w2: Ptr = "const u8*", out2: Ptr = "float*", in_dim: u32 = "u32", rows: u32 = "u32", rows_per_group: u32 = "u32", rows2: u32 = "u32" }
    "mat_vec_f16" => MatVecF16Args { w: Ptr = "const u16*", x: Ptr = "const float*", out: Ptr = "float*", in_dim: u32 = "u32", rows: u32 = "u32", rows_per_group: u32 = "u32", _pad: u32 = "u32" }
    "mat_vec_f16_split" => MatVecF16SplitArgs { w: Ptr = "const u16*", x: Ptr = "const float*", partial: Ptr = "float*", tickets: Ptr = "u32*", out: Ptr = "float*", w2: Ptr = "const u16*", out2: Ptr = "float*", in_dim: u32 = "u32", rows: u32 = "u32", rows_per_group: u32 = "u32", n_chunks: u32 = "u32", ticket: u32 = "u32", rows2: u32 = "u32" }
    "mat_vec_f32" => MatVecF32Args { w: Ptr = "const float*", x: Ptr = "const float*", out: Ptr = "float*", in_dim: u32 = "u32", rows: u32 = "u32", rows_per_group: u32 = "u32", _pad: u32 = "u32" }
    "hc_split" => HcSplitArgs { mix: Ptr = "const float*", scale: Ptr = "const float*", base: Ptr = "const float*", split: Ptr = "float*", n_hc: u32 = "u32", iters: u32 = "u32", eps: f32 = "float", _pad: u32 = "u32" }
    "hc_weighted_sum" => HcWeightedSumArgs { hc: Ptr = "const float*", weights: Ptr = "const float*", out: Ptr = "float*", n: u32 = "u32", n_hc: u32 = "u32" }
    "hc_post" => HcPostArgs { block: Ptr = "const float*", block_b: Ptr = "const float*", sum_out: Ptr = "float*", residual: Ptr = "const float*", split: Ptr = "const float*", out: Ptr = "float*", ss: Ptr = "float*", n: u32 = "u32", n_hc: u32 = "u32" }
    "hc_head_weights" => HcHeadWeightsArgs { pre: Ptr = "const float*", scale: Ptr = "const float*", base: Ptr = "const float*", out: Ptr = "float*", n: u32 = "u32", eps: f32 = "float" }
    "rope_tail" => RopeTailArgs { x: Ptr = "float*", table: Ptr = "const float*", n_head: u32 = "u32", head_dim: u32 = "u32", n_rot: u32 = "u32", pos_mode: u32 = "u32", ratio: u32 = "u32", inverse: u32 = "u32" }
    "fp8_round_trip" => Fp8RoundTripArgs { x: Ptr = "float*" }
    "indexer_qat" => IndexerQatArgs { x: Ptr = "float*" }
    "indexer_query_finish" => IndexerQueryFinishArgs { x: Ptr = "float*", table: Ptr = "const float*", n_rot: u32 = "u32", _pad: u32 = "u32" }
    "store_raw" => StoreRawArgs { kv: Ptr = "const float*", cache: Ptr = "float*", dim: u32 = "u32", raw_cap: u32 = "u32" }
    "store_comp_row" => StoreCompRowArgs { row: Ptr = "const float*", cache: Ptr = "float*", dim: u32 = "u32", ratio: u32 = "u32" }
    "compressor_store" => CompressorStoreArgs { kv: Ptr = "const float*", score: Ptr = "const float*", ape: Ptr = "const void*", state_kv: Ptr = "float*", state_score: Ptr = "float*", ape_f16: u32 = "u32", width: u32 = "u32", ratio: u32 = "u32", _pad: u32 = "u32" }
    "compressor_pool" => CompressorPoolArgs { kv: Ptr = "const float*", score: Ptr = "const float*", out: Ptr = "float*", head_dim: u32 = "u32", ratio: u32 = "u32" }
    "compressor_shift" => CompressorShiftArgs { state_kv: Ptr = "float*", state_score: Ptr = "float*", n: u32 = "u32", _pad: u32 = "u32" }
    "indexer_scores" => IndexerScoresArgs { q: Ptr = "const float*", weights: Ptr = "const float*", cache: Ptr = "const float*", out: Ptr = "float*", n_head: u32 = "u32", head_dim: u32 = "u32", scale: f32 = "float", ratio: u32 = "u32", cap: u32 = "u32", _pad: u32 = "u32" }
    "indexer_top_k" => IndexerTopKArgs { scores: Ptr = "const float*", out: Ptr = "int*", taken: Ptr = "int*", top_k: u32 = "u32", ratio: u32 = "u32", cap: u32 = "u32", _pad: u32 = "u32" }
    "attention" => AttentionArgs { q: Ptr = "const float*", raw: Ptr = "const float*", comp: Ptr = "const float*", selected: Ptr = "const int*", sinks: Ptr = "const float*", out: Ptr = "float*", scores: Ptr = "float*", rope: Ptr = "const float*", xq: Ptr = "i8*", xd: Ptr = "float*", head_dim: u32 = "u32", window: u32 = "u32", raw_cap: u32 = "u32", ratio: u32 = "u32", comp_cap: u32 = "u32", top_k: u32 = "u32", max_rows: u32 = "u32", kq_scale: f32 = "float", n_rot: u32 = "u32", n_head: u32 = "u32" }
    "attention_scores" => AttentionScoresArgs { q: Ptr = "const float*", raw: Ptr = "const float*", comp: Ptr = "const float*", selected: Ptr = "const int*", sinks: Ptr = "const float*", out: Ptr = "float*", scores: Ptr = "float*", rope: Ptr = "const float*", xq: Ptr = "i8*", xd: Ptr = "float*", maxes: Ptr = "float*", sums: Ptr = "float*", parts: Ptr = "float*", tickets: Ptr = "u32*", head_dim: u32 = "u32", window: u32 = "u32", raw_cap: u32 = "u32", ratio: u32 = "u32", comp_cap: u32 = "u32", top_k: u32 = "u32", max_rows: u32 = "u32", kq_scale: f32 = "float", n_rot: u32 = "u32", n_head: u32 = "u32", ticket: u32 = "u32", sums_slice: u32 = "u32" }
    "attention_partial" => AttentionPartialArgs { q: Ptr = "const float*", raw: Ptr = "const float*", comp: Ptr = "const float*", selected: Ptr = "const int*", sinks: Ptr = "const float*", out: Ptr = "float*", scores: Ptr = "float*", rope: Ptr = "const float*", xq: Ptr = "i8*", xd: Ptr = "float*", maxes: Ptr = "float*", sums: Ptr = "float*", parts: Ptr = "float*", tickets: Ptr = "u32*", head_dim: u32 = "u32", window: u32 = "u32", raw_cap: u32 = "u32", ratio: u32 = "u32", comp_cap: u32 = "u32", top_k: u32 = "u32", max_rows: u32 = "u32", kq_scale: f32 = "float", n_rot: u32 = "u32", n_head: u32 = "u32", ticket: u32 = "u32", sums_slice: u32 = "u32" }
    "attention_partial_combine" => AttentionPartialCombineArgs { q: Ptr = "const float*", raw: Ptr = "const float*", comp: Ptr = "const float*", selected: Ptr = "const int*", sinks: Ptr = "const float*", out: Ptr = "float*", scores: Ptr = "float*", rope: Ptr = "const float*", xq: Ptr = "i8*", xd: Ptr = "float*", maxes: Ptr = "float*", sums: Ptr = "float*", parts: Ptr = "float*", tickets: Ptr = "u32*", head_dim: u32 = "u32", window: u32 = "u32", raw_cap: u32 = "u32", ratio: u32 = "u32", comp_cap: u32 = "u32", top_k: u32 = "u32", max_rows: u32 = "u32", kq_scale: f32 = "float", n_rot: u32 = "u32", n_head: u32 = "u32", ticket: u32 = "u32", sums_slice: u32 = "u32" }
    "attention_combine" => AttentionCombineArgs { q: Ptr = "const float*", raw: Ptr = "const float*", comp: Ptr = "const float*", selected: Ptr = "const int*", sinks: Ptr = "const float*", out: Ptr = "float*", scores: Ptr = "float*", rope: Ptr = "const float*", xq: Ptr = "i8*", xd: Ptr = "float*", maxes: Ptr = "float*", sums: Ptr = "float*", parts: Ptr = "float*", tickets: Ptr = "u32*", head_dim: u32 = "u32", window: u32 = "u32", raw_cap: u32 = "u32", ratio: u32 = "u32", comp_cap: u32 = "u32", top_k: u32 = "u32", max_rows: u32 = "u32", kq_scale: f32 = "float", n_rot: u32 = "u32", n_head: u32 = "u32", ticket: u32 = "u32", sums_slice: u32 = "u32" }
    "router_select" => RouterSelectArgs { logits: Ptr = "const float*", bias: Ptr = "const float*", hash: Ptr = "const int*", selected: Ptr = "int*", weights: Ptr = "float*", n_expert: u32 = "u32", n_used: u32 = "u32", n_vocab: u32 = "u32", scale: f32 = "float" }
    "quantize_q8_k" => QuantizeQ8KArgs { x: Ptr = "const float*", out: Ptr = "BlockQ8K*" }
    "moe_gate_up" => MoeGateUpArgs { xq: Ptr = "const BlockQ8K*", selected: Ptr = "const int*", weights: Ptr = "const float*", gate: Ptr = "const u64*", up: Ptr = "const u64*", mid: Ptr = "float*", grid: Ptr = "const u64*", midq: Ptr = "BlockQ8K*", tickets: Ptr = "u32*", gate_ty: u32 = "u32", up_ty: u32 = "u32", in_dim: u32 = "u32", ff: u32 = "u32", n_used: u32 = "u32", n_expert: u32 = "u32", clamp: f32 = "float", ticket: u32 = "u32" }
    "moe_down" => MoeDownArgs { midq: Ptr = "const BlockQ8K*", selected: Ptr = "const int*", down: Ptr = "const u64*", out: Ptr = "float*", grid: Ptr = "const u64*", down_ty: u32 = "u32", ff: u32 = "u32", out_dim: u32 = "u32", n_used: u32 = "u32", n_expert: u32 = "u32", _pad: u32 = "u32" }
    "moe_route" => MoeRouteArgs { selected: Ptr = "const int*", route: Ptr = "u32*", n_expert: u32 = "u32", n_used: u32 = "u32", rows: u32 = "u32", _pad: u32 = "u32" }
    "moe_gate_up_grouped" => MoeGateUpGroupedArgs { xq: Ptr = "const BlockQ8K*", selected: Ptr = "const int*", weights: Ptr = "const float*", gate: Ptr = "const u64*", up: Ptr = "const u64*", mid: Ptr = "float*", grid: Ptr = "const u64*", route: Ptr = "const u32*", gate_ty: u32 = "u32", in_dim: u32 = "u32", ff: u32 = "u32", n_used: u32 = "u32", n_expert: u32 = "u32", clamp: f32 = "float" }
    "moe_down_grouped" => MoeDownGroupedArgs { midq: Ptr = "const BlockQ8K*", down: Ptr = "const u64*", parts: Ptr = "float*", grid: Ptr = "const u64*", route: Ptr = "const u32*", down_ty: u32 = "u32", ff: u32 = "u32", out_dim: u32 = "u32", n_used: u32 = "u32", n_expert: u32 = "u32", _pad: u32 = "u32" }
    "moe_sum_slots" => MoeSumSlotsArgs { parts: Ptr = "const float*", out: Ptr = "float*", out_dim: u32 = "u32", n_used: u32 = "u32" }
    "expert_cache_plan" => ExpertCachePlanArgs { selected: Ptr = "const int*", state: Ptr = "int*", stats: Ptr = "u64*", gate_table: Ptr = "u64*", up_table: Ptr = "u64*", down_table: Ptr = "u64*", gate_home: Ptr = "const u64*", up_home: Ptr = "const u64*", down_home: Ptr = "const u64*", slots: Ptr = "u8*", slot_bytes: u64 = "u64", gate_qs: u32 = "u32", gate_rest: u32 = "u32", up_qs: u32 = "u32", up_rest: u32 = "u32", down_qs: u32 = "u32", down_rest: u32 = "u32", n_expert: u32 = "u32", n_used: u32 = "u32" }
    "expert_cache_copy" => ExpertCacheCopyArgs { state: Ptr = "const int*" }
    "swiglu" => SwiGluArgs { gate: Ptr = "const float*", up: Ptr = "const float*", out: Ptr = "float*", xq: Ptr = "i8*", xd: Ptr = "float*", n: u32 = "u32", clamp: f32 = "float" }
    "add" => AddArgs { a: Ptr = "const float*", b: Ptr = "const float*", out: Ptr = "float*", n: u32 = "u32", _pad: u32 = "u32" }
    "qkv_finish" => QkvFinishArgs { q: Ptr = "float*", kv_raw: Ptr = "const float*", kv_norm: Ptr = "const float*", kv: Ptr = "float*", cache: Ptr = "float*", table: Ptr = "const float*", n_head: u32 = "u32", head_dim: u32 = "u32", n_rot: u32 = "u32", raw_cap: u32 = "u32", eps_q: f32 = "float", eps_kv: f32 = "float" }
    "compressor_update" => CompressorUpdateArgs { kv: Ptr = "const float*", score: Ptr = "const float*", ape: Ptr = "const void*", state_kv: Ptr = "float*", state_score: Ptr = "float*", pooled: Ptr = "float*", norm_w: Ptr = "const float*", row: Ptr = "float*", table: Ptr = "const float*", cache: Ptr = "float*", tickets: Ptr = "u32*", emit_cond: u64 = "u64", ape_f16: u32 = "u32", width: u32 = "u32", ratio: u32 = "u32", head_dim: u32 = "u32", n_rot: u32 = "u32", quant: u32 = "u32", eps: f32 = "float", ticket: u32 = "u32" }
    "mat_vec_f16_split_comp" => MatVecF16SplitCompArgs { w: Ptr = "const u16*", x: Ptr = "const float*", partial: Ptr = "float*", tickets: Ptr = "u32*", out: Ptr = "float*", w2: Ptr = "const u16*", out2: Ptr = "float*", ape: Ptr = "const void*", state_kv: Ptr = "float*", state_score: Ptr = "float*", pooled: Ptr = "float*", norm_w: Ptr = "const float*", row: Ptr = "float*", table: Ptr = "const float*", cache: Ptr = "float*", emit_cond: u64 = "u64", in_dim: u32 = "u32", rows: u32 = "u32", rows_per_group: u32 = "u32", n_chunks: u32 = "u32", ticket: u32 = "u32", rows2: u32 = "u32", ape_f16: u32 = "u32", width: u32 = "u32", ratio: u32 = "u32", head_dim: u32 = "u32", n_rot: u32 = "u32", quant: u32 = "u32", eps: f32 = "float", _pad: u32 = "u32" }
    "router" => RouterArgs { w: Ptr = "const u16*", x: Ptr = "const float*", partial: Ptr = "float*", tickets: Ptr = "u32*", logits: Ptr = "float*", bias: Ptr = "const float*", hash: Ptr = "const int*", selected: Ptr = "int*", weights: Ptr = "float*", in_dim: u32 = "u32", rows: u32 = "u32", n_chunks: u32 = "u32", ticket: u32 = "u32", n_used: u32 = "u32", n_vocab: u32 = "u32", scale: f32 = "float", _pad: u32 = "u32" }
    "mat_vec_q8_0_quant" => MatVecQ80TailArgs { w: Ptr = "const u8*", xq: Ptr = "const i8*", xd: Ptr = "const float*", out: Ptr = "float*", w2: Ptr = "const u8*", out2: Ptr = "float*", tickets: Ptr = "u32*", norm_w: Ptr = "const float*", tail_out: Ptr = "float*", tail_xq: Ptr = "i8*", tail_xd: Ptr = "float*", in_dim: u32 = "u32", rows: u32 = "u32", rows_per_group: u32 = "u32", rows2: u32 = "u32", mode: u32 = "u32", ticket: u32 = "u32", eps: f32 = "float", clamp: f32 = "float" }
    "mat_vec_q8_0_qkv" => MatVecQ80QkvArgs { w: Ptr = "const u8*", xq: Ptr = "const i8*", xd: Ptr = "const float*", q: Ptr = "float*", tickets: Ptr = "u32*", kv_raw: Ptr = "const float*", kv_norm: Ptr = "const float*", kv: Ptr = "float*", cache: Ptr = "float*", table: Ptr = "const float*", in_dim: u32 = "u32", n_head: u32 = "u32", head_dim: u32 = "u32", n_rot: u32 = "u32", raw_cap: u32 = "u32", ticket: u32 = "u32", eps_q: f32 = "float", eps_kv: f32 = "float" }
    "hc_pre" => HcPreArgs { x: Ptr = "const float*", fn_w: Ptr = "const u16*", partial: Ptr = "float*", tickets: Ptr = "u32*", flat: Ptr = "float*", mix: Ptr = "float*", scale: Ptr = "const float*", base: Ptr = "const float*", split: Ptr = "float*", cur: Ptr = "float*", norm_w: Ptr = "const float*", norm: Ptr = "float*", xq: Ptr = "i8*", xd: Ptr = "float*", xk: Ptr = "BlockQ8K*", ss: Ptr = "const float*", post_block: Ptr = "const float*", post_block_b: Ptr = "const float*", post_sum: Ptr = "float*", post_residual: Ptr = "const float*", post_split: Ptr = "const float*", hc_dim: u32 = "u32", mix_rows: u32 = "u32", n_chunks: u32 = "u32", ticket: u32 = "u32", n_embd: u32 = "u32", iters: u32 = "u32", eps_flat: f32 = "float", eps_hc: f32 = "float", eps_norm: f32 = "float", blocks_pre: u32 = "u32" }
    "synth_fill" => SynthFillArgs { out: Ptr = "u8*", state: u64 = "u64", n: u64 = "u64", ty: u32 = "u32", kind: u32 = "u32", a: f32 = "float", center: f32 = "float", spread: f32 = "float", d: u32 = "u32", dmin: u32 = "u32", n_expert: u32 = "u32", n_used: u32 = "u32", repack: u32 = "u32" }
    "fill" => FillArgs { x: Ptr = "u32*", n: u64 = "u64", v: u32 = "u32", _pad: u32 = "u32" }
    "sample_token" => SampleTokenArgs { logits: Ptr = "const float*", out: Ptr = "u32*", n: u32 = "u32", top_k: u32 = "u32", temperature: f32 = "float", top_p: f32 = "float", min_p: f32 = "float", r: f32 = "float" }
}

/// `StepParams` as the kernels see it; its fields are checked against the Rust struct's size.
const STEP_PARAMS_FIELDS: [(&str, &str); 4] =
    [("token", "u32"), ("pos", "u32"), ("reserved0", "u32"), ("count", "u32")];

/// Pointer fields an argument struct may have: the length of `RowStrides` (the byte stride of
/// each pointer from one chunk row to the next, in field order; 0 for weights, tables and state).
pub const ROW_STRIDES: usize = 24;
/// Per-row byte strides of a launch's pointers, as the kernels take them by value.
pub type RowStrides = [u32; ROW_STRIDES];
const _: () = assert!(std::mem::size_of::<StepParams>() == 4 * STEP_PARAMS_FIELDS.len());

/// The generated C header: integer typedefs, `StepParams`, the numerics constants and every
/// kernel's argument struct.
pub fn c_header() -> String {
    let mut s = String::from(
        "// Generated from backends/cuda/args.rs and src/numerics.rs: do not edit by hand.\n\
         typedef unsigned char u8;\ntypedef signed char i8;\ntypedef unsigned short u16;\ntypedef short i16;\n\
         typedef unsigned int u32;\ntypedef unsigned long long u64;\n\n\
         // Q8_K activation block: `quant::BlockQ8K`'s fields, reordered so that the quants and the\n\
         // sums are 16-byte aligned (304 bytes).\n\
         struct BlockQ8K {\n    i8 qs[256];\n    i16 bsums[16];\n    float d;\n    u32 pad[3];\n};\n\n",
    );
    s += "// Mirrors `recorder::StepParams` (repr(C)): the only per-token input of a replay.\nstruct StepParams {\n";
    for (name, ty) in STEP_PARAMS_FIELDS {
        s += &format!("    {ty} {name};\n");
    }
    s += "};\n\n";
    s += &crate::numerics::cuda_constants();
    s += "\n";
    s += &c_block_splits();
    s += "\n";
    s += &format!(
        "// The byte stride of each pointer argument from one chunk row to the next (0: shared).\n\
         struct RowStrides {{\n    u32 s[{ROW_STRIDES}];\n}};\n\n"
    );
    for (kernel, name, fields, _) in all() {
        s += &format!("// The arguments of `{kernel}`.\nstruct {name} {{\n");
        for (f, _, cty) in fields {
            s += &format!("    {cty} {f};\n");
        }
        s += "};\n";
        // Row y of a chunk launch: its pointers advanced by y strides.
        s += &format!("__device__ __forceinline__ void ds4_row({name}& a, const RowStrides& R, u32 y) {{\n");
        let ptrs = fields.iter().filter(|(_, k, _)| *k == Field::Ptr);
        for (i, (f, _, cty)) in ptrs.enumerate() {
            s += &format!("    a.{f} = ({cty})((u64)a.{f} + (u64)R.s[{i}] * y);\n");
        }
        s += "}\n";
    }
    s
}

/// The split layouts as a C function for the kernels (`ds4_block_split`).
fn c_block_splits() -> String {
    let mut s = String::from(
        "// Split layout of a repacked block type (backends/gpu_tables.rs: BLOCK_SPLITS): block bytes,\n\
         // where its quants start, how many bytes they take. Returns false for other types.\n\
         __device__ __forceinline__ bool ds4_block_split(u32 ty, u32* bb, u32* at, u32* nq) {\n",
    );
    for (ty, bb, at, nq) in crate::backends::gpu_tables::BLOCK_SPLITS {
        s += &format!("    if (ty == {}) {{ *bb = {bb}; *at = {at}; *nq = {nq}; return true; }}\n", ty as u32);
    }
    s += "    return false;\n}\n";
    s
}

/// A planned launch's argument bytes and where its pointers are, from a typed struct.
pub fn encode<A: KernelArgs>(a: &A) -> (Vec<u64>, Vec<usize>) {
    let bytes = bytemuck::bytes_of(a);
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
    let mut ptrs = Vec::new();
    let mut off = 0;
    for (_, kind, _) in A::FIELDS {
        if *kind == Field::Ptr {
            ptrs.push(off / 8);
        }
        off += kind.bytes();
    }
    (words, ptrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C layout of every struct (as the kernels compile it) has the Rust struct's size and
    /// offsets: fields are packed in order with no padding, 8-byte fields 8-aligned.
    #[test]
    fn c_layout_matches_the_rust_structs() {
        for (kernel, name, fields, size) in all() {
            let mut off = 0usize;
            for (f, kind, cty) in fields {
                let c_bytes = if cty.ends_with('*') || *cty == "u64" { 8 } else { 4 };
                assert_eq!(c_bytes, kind.bytes(), "{name}.{f}: C type {cty} vs {kind:?}");
                assert_eq!(off % c_bytes, 0, "{name}.{f} would be padded in C");
                off += c_bytes;
            }
            assert_eq!(off.div_ceil(8) * 8, size, "{kernel}: C size {off} vs Rust {size}");
            let ptrs = fields.iter().filter(|(_, k, _)| *k == Field::Ptr).count();
            assert!(ptrs <= ROW_STRIDES, "{kernel}: {ptrs} pointers, RowStrides holds {ROW_STRIDES}");
        }
    }

    #[test]
    fn pointer_references_round_trip() {
        use crate::recorder::{Buf, WeightId};
        assert_eq!(Ptr::buf(Buf(7)).reference(), Some(PtrRef::Buf(7)));
        assert_eq!(Ptr::weight(WeightId(3)).reference(), Some(PtrRef::Weight(3)));
        assert_eq!(Ptr::scratch(2).reference(), Some(PtrRef::Scratch(2)));
        assert_eq!(Ptr::rope(1).reference(), Some(PtrRef::Rope(1)));
        assert_eq!(Ptr::GRID.reference(), Some(PtrRef::Grid));
        assert_eq!(Ptr::NULL.reference(), Some(PtrRef::Null));
        assert_eq!(Ptr::expert_table(WeightId(4)).reference(), Some(PtrRef::ExpertTable(4)));
        assert_eq!(Ptr::expert_home(WeightId(4)).reference(), Some(PtrRef::ExpertHome(4)));
        assert_eq!(Ptr::cache_state(9).reference(), Some(PtrRef::CacheState(9)));
        assert_eq!(Ptr::cache_slots(9).reference(), Some(PtrRef::CacheSlots(9)));
        assert_eq!(Ptr::CACHE_STATS.reference(), Some(PtrRef::CacheStats));
        let a = RmsNormArgs {
            x: Ptr::buf(Buf(1)),
            w: Ptr::NULL,
            out: Ptr::buf(Buf(2)),
            xq: Ptr::NULL,
            xd: Ptr::NULL,
            n: 16,
            eps: 1e-6,
            slices: 1,
            _pad: 0,
        };
        let (words, ptrs) = encode(&a);
        assert_eq!(ptrs, vec![0, 1, 2, 3, 4]);
        assert_eq!(words.len(), 7);
        assert_eq!(words[5] as u32, 16);
        assert_eq!(words[6] as u32, 1);
    }
}
