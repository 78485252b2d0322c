//! The CUDA backend: kernels from `kernels/*.cu` compiled at run time by NVRTC, driven by cudarc.
//! The recorded token becomes a fixed list of launches on one non-default stream. With graphs on,
//! the first token runs eagerly (warm-up), then the whole token is captured once as a CUDA graph
//! and replayed for every token; any capture or launch failure falls back to eager launches for
//! that token and the ones after it, without losing the token.

#[cfg(feature = "cuda")]
mod args;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod plan;

use crate::backend::{Backend, BackendError, BackendOptions};
pub use crate::backends::gpu_tables::BlockLayout;

/// Which launches a build of the kernels serves: the decode program's (one token row) or a
/// chunk program's (`blockIdx.y` rows; kernels/common.cuh `DS4_CHUNK_ROWS`). The decode build has no
/// per-row code at all, so batched prefill costs decode nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelRows {
    One,
    Chunk,
}

#[cfg(not(feature = "cuda"))]
pub fn create(_opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new("cuda", "ds4 was built without the `cuda` feature"))
}

#[cfg(feature = "cuda")]
pub fn create(opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    if opts.numerics != crate::numerics::Numerics::Canonical {
        return Err(BackendError::new(
            "cuda",
            format!("implements only the canonical numerics, not '{}'", opts.numerics),
        ));
    }
    Ok(Box::new(imp::CudaBackend::with_options(opts)?))
}

#[cfg(feature = "cuda")]
pub use imp::{kernel_source, CudaBackend, CudaExecutable};

/// Compiles the kernels with NVRTC for `arch` (e.g. `sm_90`) into SASS, stores it in the kernel
/// cache a run reads (so a later start on a GPU of that architecture compiles nothing) and returns
/// its size in bytes. Needs libnvrtc but no GPU.
#[cfg(feature = "cuda")]
pub fn compile_kernels(arch: &str, layout: BlockLayout, rows: KernelRows) -> Result<usize, BackendError> {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(BackendError::new("cuda", "no NVRTC library (libnvrtc, CUDA 13) on this machine"));
    }
    let cubin = imp::compile_kernels(arch, layout, rows)?;
    imp::cache::store(arch, layout, rows, &cubin);
    Ok(cubin.len())
}

#[cfg(not(feature = "cuda"))]
pub fn compile_kernels(_arch: &str, _layout: BlockLayout, _rows: KernelRows) -> Result<usize, BackendError> {
    Err(BackendError::new("cuda", "ds4 was built without the `cuda` feature"))
}

#[cfg(feature = "cuda")]
mod imp {
    use std::ffi::c_void;
    use std::sync::Arc;

    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use cudarc::driver::{result, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr};

    use super::args::{self, FillArgs, Ptr, PtrRef};
    use super::memory::{self, HostMem, HostRegistration, WeightMem};
    use super::plan::{self, SCRATCH_KINDS};
    use super::{BlockLayout, KernelRows};
    use crate::backend::{Backend, BackendError, Executable, GraphFailure, TraceLaunch};
    use crate::backend::{BackendOptions, ExpertCacheStats};
    use crate::model::Model;
    use crate::placement::{self, Footprint, Placement, PlacementMode};
    use crate::recorder::{Buf, BufKind, DType, Program, StepParams};
    use crate::sample::DeviceSample;

    /// Kernel sources, compiled together as one NVRTC program.
    const SOURCES: [&str; 14] = [
        include_str!("../../kernels/common.cuh"),
        include_str!("../../kernels/norm.cu"),
        include_str!("../../kernels/matvec.cu"),
        include_str!("../../kernels/hc.cu"),
        include_str!("../../kernels/rope.cu"),
        include_str!("../../kernels/kv.cu"),
        include_str!("../../kernels/indexer.cu"),
        include_str!("../../kernels/attention.cu"),
        include_str!("../../kernels/moe.cu"),
        include_str!("../../kernels/expert_cache.cu"),
        include_str!("../../kernels/fused.cu"),
        include_str!("../../kernels/elementwise.cu"),
        include_str!("../../kernels/synth.cu"),
        include_str!("../../kernels/sample.cu"),
    ];

    const ALIGN: usize = 256;

    /// Device memory left free when the budget is the free memory: the kernels, graphs and the
    /// context's own allocations.
    const HEADROOM: u64 = 1 << 30;

    /// One MoE layer's routed-expert tensors, in program order (the expert cache's layer index).
    struct MoeLayer {
        tensors: [crate::recorder::WeightId; 3],
        /// (quants, rest) bytes of one expert of gate, up, down.
        pieces: [(u64, u64); 3],
        slot_bytes: u64,
        n_expert: usize,
        n_used: usize,
    }

    fn moe_layers(program: &Program) -> Vec<MoeLayer> {
        let mut out = Vec::new();
        for step in program.steps() {
            if let crate::recorder::Op::MoeExperts { gate, up, down, selected, .. } = step.op {
                let n_expert = program.weight(gate).dim(2) as u32;
                let pieces = [gate, up, down].map(|t| plan::expert_pieces(program.weight(t), n_expert));
                out.push(MoeLayer {
                    tensors: [gate, up, down],
                    pieces,
                    slot_bytes: plan::cache_slot_bytes(&pieces),
                    n_expert: n_expert as usize,
                    n_used: program.buffers()[selected.0 as usize].len,
                });
            }
        }
        out
    }

    /// Prompt tokens per prefill chunk by default: each batch launch covers this many rows, and
    /// the grouped experts decode each weight once per pass of many pairs, so longer chunks pay.
    /// Flash on the H200 (BENCHMARKS.md): 2,048-token prompt 2,044 tok/s in chunks of 512, 2,321
    /// in 1024, 2,470 in 2048; 16,384 tokens 1,666, 1,842 and 1,944; bit-identical to token by
    /// token. Chunks past plan.rs MOE_ROUTE_MAX_PAIRS / n_used rows (2,730 for Flash) would run the routed
    /// experts row by row.
    const DEFAULT_PREFILL_CHUNK: usize = 2048;

    /// The kernel whose chunk build computes several token rows per warp (kernels/matvec.cu).
    const Q8_MULTI_ROW_KERNEL: &str = "mat_vec_q8_0";

    use plan::{env_choice, env_is, ALL_ROWS_KERNELS};

    /// Token rows a warp of the chunk build's Q8_0 matvec covers: each weight block is loaded once
    /// for this many rows. `DS4_CUDA_TOKEN_ROWS` (1 to 32) overrides the default 8, to measure.
    fn q8_token_rows() -> u32 {
        std::env::var("DS4_CUDA_TOKEN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(8u32).clamp(1, 32)
    }

    /// The chunk build's tensor-core Q8_0 product (kernels/matvec.cu, split layout only): 16 matrix
    /// rows per warp, 4 warps per block, `q8_mma_tokens` token rows per block.
    const Q8_MMA_KERNEL: &str = "mat_mul_q8_0";
    const Q8_MMA_ROWS_PER_BLOCK: u32 = 64;

    /// The chunk build's Q8_0 product in big tiles (kernels/matvec.cu, split layout only): 4 x
    /// `wn` warps per block, each 16 matrix rows x `nt` tiles of 8 token rows, so 64 matrix rows
    /// x 8 `nt` `wn` token rows a block, stages in dynamic shared memory. It replaces
    /// [`Q8_MMA_KERNEL`] unless `DS4_CUDA_Q8_TILE=0`; `DS4_CUDA_Q8_TILE_WN` (4 or 2: 128 or 64
    /// token rows per block) picks the shape, to measure; `DS4_CUDA_Q8_TILE=new` the 256-thread
    /// shape of 64 x 32 that fits 2 blocks per SM (registers capped at 128, ~91 KB of shared
    /// memory), to measure.
    const Q8_TILE_KERNEL: &str = "mat_mul_q8_0_tile";
    #[derive(Clone, Copy)]
    struct Q8Tile {
        /// Warps along the token rows (Q8T_WN).
        wn: u32,
        /// Tiles of 8 token rows per warp (Q8T_NT).
        nt: u32,
        /// Blocks per SM the kernel's registers are capped for (Q8T_MIN_BLOCKS).
        min_blocks: u32,
    }
    impl Q8Tile {
        /// Token rows per block.
        fn tokens(self) -> u32 {
            8 * self.nt * self.wn
        }
        fn threads(self) -> u32 {
            128 * self.wn
        }
        /// Its dynamic shared memory, as kernels/matvec.cu lays it out (Q8T_SMEM): two steps'
        /// staged rows of 272 bytes (64 weight rows and the token rows), two chunks' weight and
        /// token scales (floats), each thread's 4 `nt` totals and 4 `nt` half-chunk sums, the
        /// active token bits.
        fn smem(self) -> u32 {
            let (bm, bn, threads) = (Q8_MMA_ROWS_PER_BLOCK, self.tokens(), self.threads());
            2 * (bm + bn) * 272 + 2 * 32 * bm * 4 + 2 * 32 * bn * 4 + 2 * 4 * self.nt * threads * 4 + bn / 8
        }
    }
    fn q8_tile() -> Option<Q8Tile> {
        if env_is("DS4_CUDA_Q8_TILE", "0") {
            return None;
        }
        if env_is("DS4_CUDA_Q8_TILE", "new") {
            return Some(Q8Tile { wn: 2, nt: 2, min_blocks: 2 });
        }
        Some(Q8Tile { wn: env_choice("DS4_CUDA_Q8_TILE_WN", &[2, 4], 4), nt: 4, min_blocks: 1 })
    }

    /// The dynamic shared memory of `moe_gate_up_tile_iq2_xxs`, as kernels/moe.cu lays it out
    /// (GUT_SMEM, 4 tiles of 8 pairs): the code table (256 entries x 16 copies), 8 warps' quant
    /// copies (16 rows of 80 bytes), two buffers of 32 staged pairs (288 bytes each) and their d,
    /// 8 warps' tree slots (16 float4 per lane), a 16-byte constant.
    fn gate_up_tile_smem() -> u32 {
        let (tiles, warps) = (4, 8);
        let cols = 8 * tiles;
        256 * 16 * 4 + warps * 16 * 80 + 2 * cols * 288 + 2 * cols * 4 + warps * 4 * tiles * 32 * 16 + 16
    }

    /// Token rows per block of [`Q8_MMA_KERNEL`]: 8, 16 or 32 (`DS4_CUDA_MMA_TOKENS`, to measure).
    /// 16 measured best on the H200 (flash-4l chunk of 64: 3.09 ms against 3.83 for 32).
    fn q8_mma_tokens() -> u32 {
        env_choice("DS4_CUDA_MMA_TOKENS", &[8, 16, 32], 16)
    }

    /// The chunk build's attention with a block per (token row, group of heads) that reads each
    /// KV row once for the group (kernels/attention.cu: attention_chunk): its block size, which
    /// sets the group to a sixteenth of it. 256 by default; `DS4_CUDA_ATTN_CHUNK_THREADS` (128,
    /// 256 or 512) overrides it, and `DS4_CUDA_ATTN_CHUNK=0` keeps the block per (head, row), to
    /// measure.
    fn attn_chunk_threads() -> Option<u32> {
        if env_is("DS4_CUDA_ATTN_CHUNK", "0") {
            return None;
        }
        Some(env_choice("DS4_CUDA_ATTN_CHUNK_THREADS", &[128, 256, 512], 256))
    }
    const ATTN_CHUNK_KERNEL: &str = "attention_chunk";
    /// The chunk build's attention with a block per (pair of token rows, 16 heads) that stages
    /// each KV row once for both rows' heads (kernels/attention.cu: attention_rows): the default;
    /// `DS4_CUDA_ATTN_CHUNK=1` keeps [`ATTN_CHUNK_KERNEL`] (and `=0` the block per (head, row)), to
    /// measure.
    fn attn_rows_kernel() -> bool {
        !env_is("DS4_CUDA_ATTN_CHUNK", "0") && !env_is("DS4_CUDA_ATTN_CHUNK", "1")
    }
    const ATTN_ROWS_KERNEL: &str = "attention_rows";
    /// [`ATTN_ROWS_KERNEL`]'s blocks with two per SM (kernels/attention.cu: attention_rows2: the
    /// weighted sum's totals in shared memory, <= 128 registers, KV tiles by cp.async, the two
    /// rows' compressed rows as one union), the same bits (Flash 2,048-token prefill 1,479.9 ->
    /// 1,623.2 tok/s alone on the H200). `DS4_CUDA_ATTN_ROWS=rows2` picks it, `=old` attention_rows.
    fn attn_rows_new() -> bool {
        !env_is("DS4_CUDA_ATTN_ROWS", "old")
    }
    const ATTN_ROWS2_KERNEL: &str = "attention_rows2";
    /// Its dynamic shared memory, as kernels/attention.cu lays it out (ATTN_R2_SMEM), in floats:
    /// two KV tiles of 8 rows x 512, the totals (16 float4 x 256 threads), two tiles' weights
    /// (8 rows x 2 token rows x 16 heads), vis (2 x 2048 u16) and the union's compressed rows
    /// (2048 u16), 1 / denom (2 x 16), the flag and the union's count.
    fn attn_rows2_smem() -> u32 {
        4 * (2 * 8 * 512 + 16 * 4 * 256 + 2 * 8 * 2 * 16 + 3072 + 2 * 16 + 4)
    }
    /// The chunk build's attention with a block per (token row, 32 heads) over the row's own KV
    /// rows (kernels/attention.cu: attention_row_wide: every staged row feeds 32 heads, no union
    /// and nothing skipped; two blocks per SM), the same bits; the default (H200, Flash in chunks
    /// of 2048: 2k prompt 2,479.5 -> 2,578.7 tok/s, 16k 1,953.5 -> 2,096.9 against rows2).
    fn attn_rows_wide() -> bool {
        !env_is("DS4_CUDA_ATTN_ROWS", "rows2") && !env_is("DS4_CUDA_ATTN_ROWS", "old")
    }
    const ATTN_WIDE_KERNEL: &str = "attention_row_wide";
    /// Its dynamic shared memory, as kernels/attention.cu lays it out (ATTN_W_SMEM), in floats:
    /// two KV tiles of 8 rows x 512, the totals (16 float4 x 256 threads), two tiles' weights (8
    /// rows x 32 heads), 1 / denom (32 heads).
    fn attn_wide_smem() -> u32 {
        4 * (2 * 8 * 512 + 16 * 4 * 256 + 2 * 8 * 32 + 32)
    }

    /// The chunk build's indexer scores with a thread per few (token row, compressed row) pairs
    /// (kernels/indexer.cu: indexer_scores_chunk): the pairs a thread takes, token rows by
    /// compressed rows. 2x4 by default; `DS4_CUDA_INDEXER_TILE` (MTxMC, each 1, 2 or 4, not 4x4)
    /// overrides it, and `DS4_CUDA_INDEXER_CHUNK=0` keeps the block per compressed row and token
    /// row, to measure.
    fn indexer_chunk_tile() -> Option<(u32, u32)> {
        if env_is("DS4_CUDA_INDEXER_CHUNK", "0") {
            return None;
        }
        let want = std::env::var("DS4_CUDA_INDEXER_TILE").ok().and_then(|v| {
            let (t, c) = v.split_once('x')?;
            Some((t.parse::<u32>().ok()?, c.parse::<u32>().ok()?))
        });
        let ok = |&(t, c): &(u32, u32)| matches!(t, 1 | 2 | 4) && matches!(c, 1 | 2 | 4) && t * c < 16;
        Some(want.filter(ok).unwrap_or((2, 4)))
    }
    const INDEXER_CHUNK_KERNEL: &str = "indexer_scores_chunk";
    /// indexer_scores_chunk's block: 8 x 16 threads over (token rows, compressed rows).
    const INDEXER_CHUNK_THREADS: u32 = 128;

    /// The decode build's indexer scores with a lane per compressed row, 32 rows a block, and the
    /// head dots spread over the block's warps (kernels/indexer.cu: indexer_scores_one; head_dim
    /// 128, at most 64 heads, a multiple of 4). `DS4_CUDA_INDEXER_DECODE=0` keeps the block per
    /// compressed row, to measure.
    fn indexer_one(r: &mut Resolved, funcs: &mut Functions) -> Result<(), BackendError> {
        if r.kernel != "indexer_scores" || env_is("DS4_CUDA_INDEXER_DECODE", "0") {
            return Ok(());
        }
        let a = bytemuck::try_pod_read_unaligned::<args::IndexerScoresArgs>(bytemuck::cast_slice(&r.args))
            .map_err(|e| err(format!("{}: argument words: {e}", r.kernel)))?;
        if a.head_dim == 128 && a.n_head.is_multiple_of(4) && a.n_head <= 64 {
            r.kernel = INDEXER_ONE_KERNEL;
            r.func = funcs.get(INDEXER_ONE_KERNEL)?;
            r.block = 128;
            r.grid = a.cap.max(1).div_ceil(INDEXER_ONE_ROWS);
        }
        Ok(())
    }
    const INDEXER_ONE_KERNEL: &str = "indexer_scores_one";
    const INDEXER_ONE_ROWS: u32 = 32;

    /// A decode hc_pre with the HC post inside keeps the four streams it computes and the norm
    /// weights in 5 x n_embd floats of dynamic shared memory (kernels/fused.cu hc_pre), so its
    /// chunks and the pre gates' tail do not read them back from L2. `DS4_CUDA_HC_PRE_SMEM=0`
    /// gives it none (the streams and weights read from global memory), to measure.
    fn hc_pre_smem(r: &mut Resolved) -> Result<(), BackendError> {
        if r.kernel != "hc_pre" || env_is("DS4_CUDA_HC_PRE_SMEM", "0") {
            return Ok(());
        }
        let a = bytemuck::try_pod_read_unaligned::<args::HcPreArgs>(bytemuck::cast_slice(&r.args))
            .map_err(|e| err(format!("{}: argument words: {e}", r.kernel)))?;
        if a.post_block != args::Ptr::NULL {
            r.smem = 5 * a.n_embd * 4;
            opt_in_smem(r)?;
        }
        Ok(())
    }

    /// The chunk build's F16 products for `F16_TOKENS` token rows per block row from one load of
    /// each weight chunk (kernels/matvec.cu: mat_mul_f16, mat_mul_f16_split), in place of the
    /// per-row launches of the kernel each replaces. `DS4_CUDA_F16_CHUNK=0` keeps those, to measure.
    fn f16_chunk_kernel(kernel: &str) -> Option<&'static str> {
        if env_is("DS4_CUDA_F16_CHUNK", "0") {
            return None;
        }
        match kernel {
            "mat_vec_f16" => Some("mat_mul_f16"),
            "mat_vec_f16_split" => Some("mat_mul_f16_split"),
            _ => None,
        }
    }
    const F16_TOKENS: u32 = 8;

    /// The chunk build's F16 products as register tiles (kernels/matvec.cu: f16_tile, a block of
    /// 256 threads per `F16T_ROWS` matrix rows x `F16T_TOKENS` token rows, each weight staged
    /// once for all of them), in place of mat_mul_f16 and mat_mul_f16_split (ungrouped matrices).
    /// `DS4_CUDA_F16_TILE=old` keeps those, to measure.
    fn f16_tile_kernel(kernel: &str) -> Option<&'static str> {
        if env_is("DS4_CUDA_F16_TILE", "old") {
            return None;
        }
        match kernel {
            "mat_mul_f16" => Some("mat_mul_f16_tile"),
            "mat_mul_f16_split" => Some("mat_mul_f16_split_tile"),
            _ => None,
        }
    }
    const F16T_ROWS: u32 = 64;
    const F16T_TOKENS: u32 = 32;
    /// hc_pre_mix's tile (kernels/fused.cu HC_MIX_TR, HC_MIX_TT), matrix rows x token rows: 32 x 64
    /// for its 24-row control projection, of which a 64-row tile left 40 idle (Flash, a chunk of
    /// 2048 rows: 312 us a launch x 86). `DS4_CUDA_HC_MIX_TILE=old` takes the F16 products' 64 x 32,
    /// `32x32` a tile of fewer registers, to measure.
    fn hc_mix_tile() -> (u32, u32) {
        match std::env::var("DS4_CUDA_HC_MIX_TILE").as_deref() {
            Ok("old") => (F16T_ROWS, F16T_TOKENS),
            Ok("32x32") => (32, 32),
            _ => (32, 64),
        }
    }
    const F16T_THREADS: u32 = 256;

    /// K splits of a tile product: the fewest (dividing the chunks) that give at least
    /// `F16T_MIN_BLOCKS` blocks. Each tile's last block finishes it with a ticket word of token
    /// row `tile` (a ticket area per chunk row), so splitting needs no more tiles than rows.
    const F16T_MIN_BLOCKS: u32 = 512;
    fn f16_tile_splits(all_rows: u32, n_chunks: u32, rows: u32, (tile_rows, tile_tokens): (u32, u32)) -> u32 {
        let tiles = all_rows.div_ceil(tile_rows) * rows.div_ceil(tile_tokens);
        if tiles > rows {
            return 1;
        }
        (1..=n_chunks).find(|k| n_chunks.is_multiple_of(*k) && tiles * k >= F16T_MIN_BLOCKS).unwrap_or(n_chunks)
    }

    /// The chunk build's hc_pre as three launches (kernels/fused.cu: hc_pre_flat, hc_pre_mix,
    /// hc_pre_tail): the control projection of all token rows as one tile product instead of a
    /// weight read per token row. `DS4_CUDA_HC_PRE_CHUNK=0` keeps the per-row hc_pre, to measure.
    fn hc_pre_chunk() -> bool {
        !env_is("DS4_CUDA_HC_PRE_CHUNK", "0")
    }

    /// Whether a chunk's compressor row loop runs as `compressor_update_chunk` (kernels/fused.cu:
    /// a block per chunk row, the emit rows in parallel, the same bits) instead of one block
    /// looping over the rows (`compressor_update`). `DS4_CUDA_COMP_CHUNK=0` keeps the loop, to
    /// measure.
    fn comp_chunk() -> bool {
        !env_is("DS4_CUDA_COMP_CHUNK", "0")
    }
    const COMP_CHUNK_KERNEL: &str = "compressor_update_chunk";
    /// The kernel's block size and its shared arrays' bounds (COMP_CHUNK_THREADS,
    /// COMP_MAX_HEAD_DIM, COMP_MAX_STATE_ROWS).
    const COMP_CHUNK_THREADS: u32 = 512;
    const COMP_CHUNK_MAX_HEAD_DIM: u32 = 512;
    const COMP_CHUNK_MAX_RATIO: u32 = 256;

    /// Parameter rows of a chunk of `rows`: a whole number of the token groups of the Q8_0 and F16
    /// kernels.
    fn chunk_param_rows(rows: u32) -> u32 {
        let lcm = |a: u32, b: u32| {
            let (mut x, mut y) = (a, b);
            while y != 0 {
                (x, y) = (y, x % y);
            }
            a / x * b
        };
        let tile = q8_tile().map_or(1, Q8Tile::tokens);
        let group =
            [q8_mma_tokens(), F16_TOKENS, F16T_TOKENS, tile, hc_mix_tile().1].into_iter().fold(q8_token_rows(), lcm);
        rows.next_multiple_of(group)
    }

    /// Threads of the sampling kernel's one block (kernels/sample.cu).
    const SAMPLE_THREADS: u32 = 1024;

    fn err(msg: impl Into<String>) -> BackendError {
        BackendError::new("cuda", msg)
    }

    fn drv(what: &str) -> impl Fn(result::DriverError) -> BackendError + '_ {
        move |e| err(format!("{what}: {e}"))
    }

    /// Lets a launch's kernel take its `smem` bytes of dynamic shared memory: over 48 KiB needs
    /// the kernel's opt-in.
    fn opt_in_smem(r: &Resolved) -> Result<(), BackendError> {
        r.func
            .set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                r.smem as i32,
            )
            .map_err(drv(&format!("{}: {} bytes of shared memory", r.kernel, r.smem)))
    }

    /// The full kernel source, as NVRTC compiles it: the block layout the kernels read, any
    /// tuning defines from `DS4_CUDA_DEFINES` (for measuring variants, e.g.
    /// `MOE_GATE_UP_PASSES=2`, separated by spaces or commas; the kernels give each a default),
    /// the header generated from the Rust definitions (StepParams, argument structs, numerics
    /// constants), then the files.
    pub fn kernel_source(layout: BlockLayout, rows: KernelRows) -> String {
        let native = (layout == BlockLayout::Native) as u32;
        let chunk = (rows == KernelRows::Chunk) as u32;
        let token_rows = match rows {
            KernelRows::Chunk => {
                let (mt, mc) = indexer_chunk_tile().unwrap_or((2, 4));
                let tile = q8_tile().unwrap_or(Q8Tile { wn: 4, nt: 4, min_blocks: 1 });
                format!(
                    "#define Q8_TOKEN_ROWS {}\n#define Q8_MMA_TOKENS {}\n#define Q8T_WN {}\n#define Q8T_NT {}\n\
                     #define Q8T_MIN_BLOCKS {}\n#define ATTN_CHUNK_THREADS {}\n#define IDX_MT {mt}\n#define IDX_MC {mc}\n",
                    q8_token_rows(),
                    q8_mma_tokens(),
                    tile.wn,
                    tile.nt,
                    tile.min_blocks,
                    attn_chunk_threads().unwrap_or(256)
                )
            }
            KernelRows::One => String::new(),
        };
        let mut tuning: String = std::env::var("DS4_CUDA_DEFINES")
            .unwrap_or_default()
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|d| !d.is_empty())
            .map(|d| format!("#define {}\n", d.replacen('=', " ", 1)))
            .collect();
        if plan::trace_on() {
            tuning.push_str(&format!(
                "#define DS4_TRACE 1\n#define DS4_TRACE_SHIFT {}\n#define DS4_TRACE_LAUNCHES {}\n#define DS4_TRACE_SLOTS {}\n",
                plan::TRACE_SHIFT,
                plan::TRACE_LAUNCHES,
                plan::TRACE_SLOTS
            ));
        }
        // The decode attention's split shape, which plan.rs sizes its grids and scratch by.
        let split = format!(
            "#define ATTN_SPLIT_HEADS {}\n#define ATTN_SCORE_ROWS {}\n#define ATTN_SCORE_THREADS {}\n#define ATTN_SUM_THREADS {}\n",
            plan::ATTN_SPLIT_HEADS,
            plan::attn_score_rows(),
            plan::ATTN_SCORE_THREADS,
            plan::attn_sum_threads()
        );
        // hc_pre_mix is in the chunk build only.
        let (mix_rows, mix_tokens) = hc_mix_tile();
        let mix = match rows {
            KernelRows::Chunk => {
                format!("#define HC_MIX_TR {}\n#define HC_MIX_TT {}\n", mix_rows / 16, mix_tokens / 16)
            }
            KernelRows::One => String::new(),
        };
        format!("#define DS4_NATIVE_BLOCKS {native}\n#define DS4_CHUNK_ROWS {chunk}\n{token_rows}{split}{mix}{tuning}")
            + &args::c_header()
            + "\n"
            + &SOURCES.join("\n")
    }

    /// Compiles the kernels for an `sm_XY` architecture into a CUBIN (SASS), so that loading them
    /// needs no JIT compilation by the driver: from PTX that took about 30 s on an H100 at every
    /// start on a fresh machine, and again for every variant of the source.
    pub fn compile_kernels(arch: &str, layout: BlockLayout, rows: KernelRows) -> Result<Vec<u8>, BackendError> {
        use cudarc::nvrtc::{result as nvrtc, sys};
        use std::ffi::{CStr, CString};
        // Through NVRTC's C API: cudarc's safe one hands back PTX only.
        let (fmad, prec_div, prec_sqrt, ftz) = COMPILE_FLAGS;
        // The canonical profile (src/numerics.rs): a*b+c is two roundings, division and square
        // root correctly rounded, subnormals kept, as the CPU computes them.
        let options = [
            format!("--ftz={ftz}"),
            format!("--prec-sqrt={prec_sqrt}"),
            format!("--prec-div={prec_div}"),
            format!("--fmad={fmad}"),
            format!("--gpu-architecture={arch}"),
        ];
        let failed = |what: &str, e: cudarc::nvrtc::result::NvrtcError| err(format!("NVRTC {what}: {e:?}"));
        let src = CString::new(kernel_source(layout, rows)).map_err(|_| err("the kernel source holds a NUL byte"))?;
        let name = CString::new("ds4_kernels.cu").expect("no NUL");
        let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| failed("cannot create a program", e))?;
        // SAFETY: `prog` is a live program from create_program (its source and name outlive it),
        // used only here and destroyed once at the end; the CUBIN buffer has the size NVRTC gave.
        unsafe {
            let compiled = match nvrtc::compile_program(prog, &options) {
                Ok(()) => {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .and_then(|()| {
                            let mut cubin = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()).result().map(|()| cubin)
                        })
                        .map_err(|e| failed("cannot read the compiled SASS", e))
                }
                Err(e) => {
                    let log = nvrtc::get_program_log(prog)
                        .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                        .unwrap_or_default();
                    Err(err(format!("NVRTC failed to compile the kernels for {arch}: {e:?}\n{log}")))
                }
            };
            let _ = nvrtc::destroy_program(prog);
            compiled
        }
    }

    /// NVRTC output cached on disk by source hash and architecture, so a second start compiles
    /// nothing. `DS4_CACHE_DIR` overrides the folder (default `$XDG_CACHE_HOME/ds4` or
    /// `~/.cache/ds4`); `DS4_CACHE_DIR=off` disables it. A cache that cannot be written is skipped.
    pub mod cache {
        use std::path::PathBuf;

        /// FNV-1a: a hash that is stable across Rust versions, unlike `DefaultHasher`.
        fn fnv1a(bytes: &[u8]) -> u64 {
            bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
        }

        fn dir() -> Option<PathBuf> {
            match std::env::var_os("DS4_CACHE_DIR") {
                Some(d) if d == "off" => None,
                Some(d) => Some(PathBuf::from(d)),
                None => std::env::var_os("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                    .map(|d| d.join("ds4")),
            }
        }

        /// The cache file for `arch`: its name carries the hash of the source and the options.
        pub fn path(arch: &str, layout: super::BlockLayout, rows: super::KernelRows) -> Option<PathBuf> {
            let key = format!("{}|{arch}|{:?}", super::kernel_source(layout, rows), super::COMPILE_FLAGS);
            Some(dir()?.join(format!("kernels-{arch}-{:016x}.cubin", fnv1a(key.as_bytes()))))
        }

        /// The cached CUBIN, if its file is whole: the CUBIN's bytes, then their FNV-1a hash (a
        /// truncated or damaged file is compiled again, never handed to the driver).
        pub fn load(arch: &str, layout: super::BlockLayout, rows: super::KernelRows) -> Option<Vec<u8>> {
            read(&path(arch, layout, rows)?)
        }

        pub fn store(arch: &str, layout: super::BlockLayout, rows: super::KernelRows, cubin: &[u8]) {
            if let Some(p) = path(arch, layout, rows) {
                write(&p, cubin);
            }
        }

        fn read(p: &std::path::Path) -> Option<Vec<u8>> {
            let mut bytes = std::fs::read(p).ok()?;
            let body = bytes.len().checked_sub(8)?;
            let hash = u64::from_le_bytes(bytes[body..].try_into().ok()?);
            bytes.truncate(body);
            (hash == fnv1a(&bytes) && bytes.starts_with(b"\x7fELF")).then_some(bytes)
        }

        fn write(p: &std::path::Path, cubin: &[u8]) {
            let tmp = p.with_extension("tmp");
            let mut file = cubin.to_vec();
            file.extend_from_slice(&fnv1a(cubin).to_le_bytes());
            let ok = p.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok())
                && std::fs::write(&tmp, file).is_ok()
                && std::fs::rename(&tmp, p).is_ok();
            if !ok {
                let _ = std::fs::remove_file(&tmp);
            }
        }

        #[cfg(test)]
        mod tests {
            /// What was stored comes back; a truncated, damaged or foreign file does not (the
            /// kernels are compiled again instead).
            #[test]
            fn only_a_whole_cache_entry_is_read_back() {
                let dir = std::env::temp_dir().join(format!("ds4-cache-test-{}", std::process::id()));
                let p = dir.join("kernels-sm_90-0.cubin");
                let cubin: Vec<u8> = b"\x7fELF".iter().copied().chain((0..1000u32).map(|i| (i * 7) as u8)).collect();
                super::write(&p, &cubin);
                assert_eq!(super::read(&p).as_deref(), Some(&cubin[..]));
                let whole = std::fs::read(&p).unwrap();
                std::fs::write(&p, &whole[..whole.len() - 100]).unwrap();
                assert_eq!(super::read(&p), None, "truncated");
                let mut flipped = whole.clone();
                flipped[500] ^= 1;
                std::fs::write(&p, &flipped).unwrap();
                assert_eq!(super::read(&p), None, "one bit flipped");
                std::fs::write(&p, b"//\n// Generated by NVIDIA NVVM Compiler\n.version 9.0\n}").unwrap();
                assert_eq!(super::read(&p), None, "an old PTX entry");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }

    /// NVRTC flags of the canonical profile (see `compile_kernels`), part of the cache key.
    const COMPILE_FLAGS: (bool, bool, bool, bool) = (false, true, true, false);

    /// Draws a synthetic weight in device memory (kernels/synth.cu), as `synth::tensor_data`
    /// would on the host; block types straight into the split layout (`gpu_tables::BLOCK_SPLITS`).
    fn generate(
        stream: &Arc<CudaStream>,
        func: &CudaFunction,
        t: &crate::gguf::TensorInfo,
        state: u64,
        fill: crate::synth::Fill,
        layout: BlockLayout,
    ) -> Result<CudaSlice<u8>, BackendError> {
        use crate::quant::GgmlType;
        use crate::synth::Fill;
        let d = stream.alloc_zeros::<u8>(t.bytes as usize).map_err(drv(&format!("cannot allocate '{}'", t.name)))?;
        let (kind, n, a_, center, spread, dq, dmin, n_expert, n_used) = match fill {
            Fill::Random { std } => {
                let (a_, dq, dmin) = crate::synth::random_constants(t.ty, std);
                let n = match t.ty {
                    GgmlType::F32 | GgmlType::F16 => t.elements(),
                    GgmlType::Q8_0 | GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K => {
                        t.elements() / t.ty.block_elems() as u64
                    }
                    other => return Err(err(format!("synthetic '{}': cannot draw {other:?} values", t.name))),
                };
                (0, n, a_, 0.0, 0.0, dq as u32, dmin as u32, 0, 0)
            }
            Fill::Around { center, spread } => (1, t.elements(), 0.0, center, spread, 0, 0, 0, 0),
            Fill::Hash { n_expert } => (2, t.dim(1), 0.0, 0.0, 0.0, 0, 0, n_expert, t.dim(0) as u32),
        };
        let a = args::SynthFillArgs {
            out: Ptr(d.device_ptr(stream).0),
            state,
            n,
            ty: t.ty as u32,
            kind,
            a: a_,
            center,
            spread,
            d: dq,
            dmin,
            n_expert,
            n_used,
            repack: (layout == BlockLayout::Split && crate::backends::gpu_tables::block_split(t.ty).is_some()) as u32,
        };
        let (words, _) = args::encode(&a);
        let grid = n.div_ceil(256).clamp(1, 1 << 16) as u32;
        launch_with(stream, func, 0, (grid, 1), 256, 0, &[0; args::ROW_STRIDES], &words, 0, false)
            .map_err(drv(&format!("cannot generate '{}'", t.name)))?;
        Ok(d)
    }

    /// The kernels for `arch`, from the cache or compiled (and cached), loaded into `ctx`.
    fn load_kernels(
        ctx: &Arc<CudaContext>,
        arch: &str,
        layout: BlockLayout,
        rows: KernelRows,
    ) -> Result<Arc<cudarc::driver::CudaModule>, BackendError> {
        use cudarc::nvrtc::Ptx;
        match cache::load(arch, layout, rows).map(|cubin| ctx.load_module(Ptx::from_binary(cubin))) {
            Some(Ok(m)) => Ok(m),
            // No cache entry, a damaged one, or one the driver rejects: compile and rewrite it.
            _ => {
                let cubin = compile_kernels(arch, layout, rows)?;
                cache::store(arch, layout, rows, &cubin);
                ctx.load_module(Ptx::from_binary(cubin)).map_err(drv("cannot load the compiled kernels"))
            }
        }
    }

    /// Captures what `launch` puts on `stream` as a graph, instantiated and uploaded.
    fn capture_on(
        stream: &Arc<CudaStream>,
        launch: impl FnOnce() -> Result<(), result::DriverError>,
    ) -> Result<CudaGraph, result::DriverError> {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let launched = launch();
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let graph =
            graph?.ok_or(result::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED))?;
        graph.upload()?;
        Ok(graph)
    }

    /// A RoPE table, (cos, sin) per position and pair as the CPU reference computes them, in
    /// device memory.
    fn upload_rope_table(
        stream: &Arc<CudaStream>,
        (rope, n_rot): &(crate::model::RopeParams, u32),
        positions: u32,
    ) -> Result<CudaSlice<u8>, BackendError> {
        let table = crate::backends::gpu_tables::rope_table(rope, *n_rot, positions);
        let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
        stream.clone_htod(&bytes).map_err(drv("cannot upload a RoPE table"))
    }

    /// A chunk's launches, in order, on one stream (the decode plan's side branches are not used).
    /// The StepParams rows of a chunk: row r is token r at pos + r; rows past the tokens get
    /// count 0 and run nothing.
    fn chunk_words(c: &Chunk, p: &StepParams, tokens: &[u32]) -> Vec<u32> {
        (0..(c.params.len() / 4) as u32)
            .flat_map(|r| match tokens.get(r as usize) {
                Some(&t) => [t, p.pos + r, 0, 1],
                None => [0, p.pos + r, 0, 0],
            })
            .collect()
    }

    /// Runs `launches` eagerly with an event after each: (kernel, or a fused launch's kernel and
    /// ops, microseconds) summed per name, slowest first. For `ds4 bench --profile`.
    fn time_launches(
        stream: &CudaStream,
        launches: &[Resolved],
        params: u64,
        pdl: bool,
        program: &Program,
    ) -> Result<Vec<(String, f64)>, BackendError> {
        let ctx = stream.context().clone();
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut marks = Vec::with_capacity(launches.len());
        let first = ctx.new_event(timing).map_err(drv("cannot create an event"))?;
        first.record(stream).map_err(drv("cannot record an event"))?;
        for l in launches {
            l.launch(stream, params, pdl).map_err(drv("kernel launch failed"))?;
            let e = ctx.new_event(timing).map_err(drv("cannot create an event"))?;
            e.record(stream).map_err(drv("cannot record an event"))?;
            marks.push(e);
        }
        stream.synchronize().map_err(drv("the timed launches failed"))?;
        let mut times = Vec::with_capacity(marks.len());
        let mut prev = &first;
        for (l, e) in launches.iter().zip(&marks) {
            let ms = prev.elapsed_ms(e).map_err(drv("cannot read an event"))?;
            times.push((launch_label(l, program), ms as f64 * 1e3));
            prev = e;
        }
        Ok(crate::backend::summarize_profile(times))
    }

    /// A launch's name in a profile or trace: its kernel, and the recorded ops when it fuses several.
    fn launch_label(l: &Resolved, program: &Program) -> String {
        match l.ops.len() {
            1 => l.kernel.to_string(),
            _ => {
                let steps = program.steps();
                let names: Vec<&str> = l.ops.iter().map(|&k| steps[k].op.name()).collect();
                format!("{} [{}]", l.kernel, names.join(" + "))
            }
        }
    }

    fn launch_chunk(stream: &CudaStream, c: &Chunk, pdl: bool) -> Result<(), result::DriverError> {
        let p = c.params.device_ptr(stream).0;
        c.launches.iter().try_for_each(|l| l.launch(stream, p, pdl))
    }

    /// Launches `func(P, cond, R, args)`: `args` is the kernel's argument struct as words, `rows`
    /// the chunk rows it covers (`blockIdx.y`; 1 for a decode launch) and `strides` each pointer's
    /// byte stride from one row to the next ([`args::RowStrides`]), `smem` its dynamic shared
    /// memory per block. With `pdl`
    /// the launch may begin while the previous kernel on the stream finishes (programmatic
    /// dependent launch, sm_90 on): every kernel waits for its predecessor (`griddepcontrol.wait`
    /// in DS4_GUARD, kernels/common.cuh) before it touches memory, so only the launch overlaps.
    #[allow(clippy::too_many_arguments)]
    fn launch_with(
        stream: &CudaStream,
        func: &CudaFunction,
        params: u64,
        (grid, rows): (u32, u32),
        block: u32,
        cond: u64,
        strides: &args::RowStrides,
        args: &[u64],
        smem: u32,
        pdl: bool,
    ) -> Result<(), result::DriverError> {
        use cudarc::driver::sys;
        let mut p = params;
        let mut c = cond;
        let mut r = *strides;
        let mut a = args.to_vec();
        let mut ptrs: Vec<*mut c_void> = vec![
            &mut p as *mut u64 as *mut c_void,
            &mut c as *mut u64 as *mut c_void,
            r.as_mut_ptr() as *mut c_void,
            a.as_mut_ptr() as *mut c_void,
        ];
        if !pdl {
            // SAFETY: the kernel's parameters are (const StepParams*, u64, RowStrides, XArgs);
            // `r` holds RowStrides and `a` the bytes of XArgs (the structs args.rs declares and
            // the kernel source is generated from), and the driver copies all four before
            // returning. Every pointer inside `a`, advanced by up to `rows - 1` strides, is
            // inside an allocation the caller owns, and `params` holds `rows` StepParams; a null
            // `params` is only given with `cond` 0 and one row, which never reads it.
            return unsafe {
                result::launch_kernel(
                    func.cu_function(),
                    (grid, rows, 1),
                    (block, 1, 1),
                    smem,
                    stream.cu_stream(),
                    &mut ptrs,
                )
            };
        }
        // SAFETY: a zeroed attribute is a valid plain-data value; its id and the union field
        // that id selects are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: rows,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as above for the parameters; `config` and `attr` outlive the call, which
        // copies them.
        unsafe { sys::cuLaunchKernelEx(&config, func.cu_function(), ptrs.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }

    pub struct CudaBackend {
        ctx: Arc<CudaContext>,
        opts: BackendOptions,
    }

    impl CudaBackend {
        pub fn new(graphs: bool) -> Result<Self, BackendError> {
            Self::with_options(BackendOptions { graphs, ..Default::default() })
        }

        pub fn with_options(opts: BackendOptions) -> Result<Self, BackendError> {
            // SAFETY: these only try to load the libraries; nothing else is called before.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(err("no CUDA driver (libcuda) on this machine"));
            }
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(err("no NVRTC library (libnvrtc, CUDA 13) on this machine"));
            }
            let n = CudaContext::device_count().map_err(drv("cannot count CUDA devices"))?;
            if n < 1 {
                return Err(err("no CUDA device found"));
            }
            let ctx = CudaContext::new(0).map_err(drv("cannot open CUDA device 0"))?;
            Ok(CudaBackend { ctx, opts })
        }
    }

    impl Backend for CudaBackend {
        fn name(&self) -> &'static str {
            "cuda"
        }
        fn numerics(&self) -> crate::numerics::Numerics {
            crate::numerics::Numerics::Canonical
        }

        fn compile(&self, program: Arc<Program>, model: Arc<Model>) -> Result<Box<dyn Executable>, BackendError> {
            CudaExecutable::new(self.ctx.clone(), program, model, self.opts).map(|e| Box::new(e) as Box<dyn Executable>)
        }
        fn default_prefill_chunk(&self) -> usize {
            DEFAULT_PREFILL_CHUNK
        }
        fn describe(&self) -> Option<String> {
            plan::skipped_for_measurement().map(|k| {
                format!("the device, with DS4_CUDA_SKIP={k}: those kernels run nothing (a measurement): every output is wrong")
            })
        }
    }

    /// A launch with device addresses resolved: the kernel's argument struct as 8-byte words.
    struct Resolved {
        /// The recorded ops the launch computes (several when ops fuse).
        ops: Vec<usize>,
        kernel: &'static str,
        func: CudaFunction,
        grid: u32,
        block: u32,
        cond: u64,
        args: Vec<u64>,
        /// Stream placement (plan::mark_side_branches).
        side: bool,
        fork: bool,
        join: bool,
        /// `gridDim.y`: 1 for a decode launch and for a row loop's launch; for a batch step the
        /// chunk's rows (the chunk build's Q8_0 matvec: its groups of `q8_token_rows` rows).
        rows: u32,
        /// The first row's StepParams (an index into the program's parameter rows).
        row: u32,
        /// Each pointer's byte stride from one row to the next (all 0 for a decode launch and for
        /// a row loop's, whose pointers are already at their row).
        strides: args::RowStrides,
        /// Dynamic shared memory per block, in bytes (0 but for [`Q8_TILE_KERNEL`]).
        smem: u32,
    }

    impl Resolved {
        /// Launches it on `stream` with the parameter rows at `params`.
        fn launch(&self, stream: &CudaStream, params: u64, pdl: bool) -> Result<(), result::DriverError> {
            let p = params + self.row as u64 * std::mem::size_of::<StepParams>() as u64;
            launch_with(
                stream,
                &self.func,
                p,
                (self.grid, self.rows),
                self.block,
                self.cond,
                &self.strides,
                &self.args,
                self.smem,
                pdl,
            )
        }
    }

    /// The kernels, loaded from the module on first use.
    struct Functions {
        module: Arc<cudarc::driver::CudaModule>,
        loaded: Vec<(&'static str, CudaFunction)>,
    }

    impl Functions {
        fn get(&mut self, name: &'static str) -> Result<CudaFunction, BackendError> {
            if let Some((_, f)) = self.loaded.iter().find(|(n, _)| *n == name) {
                return Ok(f.clone());
            }
            let f = self.module.load_function(name).map_err(drv(&format!("kernel '{name}' is missing")))?;
            self.loaded.push((name, f.clone()));
            Ok(f)
        }
    }

    /// Device addresses that planned pointers resolve to, apart from a program's own buffers
    /// and scratch areas ([`Areas`]); shared by the decode and chunk programs.
    struct Addresses {
        weights: Vec<u64>,
        grid: u64,
        /// (weight, live table, home table) of every routed-expert tensor.
        expert_tables: Vec<(u32, u64, u64)>,
        cache_states: Vec<u64>,
        cache_slots: Vec<u64>,
        cache_stats: u64,
        /// Every RoPE table uploaded: its settings and its address.
        ropes: Vec<((crate::model::RopeParams, u32), u64)>,
    }

    /// Where one program's buffers and scratch areas are: (row 0's address, bytes from one row
    /// to the next; 0 for a decode program and for state).
    struct Areas {
        bufs: Vec<(u64, u32)>,
        /// Indexed like `SCRATCH_KINDS`.
        scratch: Vec<(u64, u32)>,
    }

    /// The rows a resolved launch covers.
    #[derive(Clone, Copy)]
    enum Rows {
        /// A decode program's launch: one token, no per-row anything.
        Decode,
        /// A chunk launch over `blockIdx.y` 0..n (each covering one token row, or several for
        /// the chunk build's Q8_0 matvec; n = 1 for `ALL_ROWS_KERNELS`, which cover every row).
        All(u32),
        /// This row alone.
        One(u32),
    }

    /// Resolves a planned launch's pointer references to device addresses.
    fn resolve(
        l: &plan::Launch,
        plan_ropes: &[(crate::model::RopeParams, u32)],
        at: &Areas,
        addrs: &Addresses,
        funcs: &mut Functions,
        rows: Rows,
    ) -> Result<Resolved, BackendError> {
        let func = funcs.get(l.kernel)?;
        let mut a = l.args.clone();
        let mut strides = [0u32; args::ROW_STRIDES];
        for (i, &word) in l.ptr_words.iter().enumerate() {
            let r = Ptr(a[word]).reference().ok_or_else(|| err(format!("{}: bad pointer reference", l.kernel)))?;
            let missing = |what: &str| err(format!("{}: no {what}", l.kernel));
            let (addr, stride) = match r {
                PtrRef::Null => (0, 0),
                PtrRef::Buf(b) => *at.bufs.get(b as usize).ok_or_else(|| missing("such buffer"))?,
                PtrRef::Scratch(s) => *at.scratch.get(s as usize).ok_or_else(|| missing("such scratch area"))?,
                PtrRef::Weight(w) => (*addrs.weights.get(w as usize).ok_or_else(|| missing("such weight"))?, 0),
                PtrRef::Grid => (addrs.grid, 0),
                PtrRef::ExpertTable(w) | PtrRef::ExpertHome(w) => {
                    let t = addrs.expert_tables.iter().find(|e| e.0 == w).ok_or_else(|| missing("expert table"))?;
                    (if matches!(r, PtrRef::ExpertTable(_)) { t.1 } else { t.2 }, 0)
                }
                PtrRef::CacheState(i) => {
                    (*addrs.cache_states.get(i as usize).ok_or_else(|| missing("expert cache"))?, 0)
                }
                PtrRef::CacheSlots(i) => {
                    (*addrs.cache_slots.get(i as usize).ok_or_else(|| missing("expert cache"))?, 0)
                }
                PtrRef::CacheStats => (addrs.cache_stats, 0),
                PtrRef::Rope(i) => {
                    let want = plan_ropes.get(i as usize).ok_or_else(|| missing("such RoPE table"))?;
                    (addrs.ropes.iter().find(|(r, _)| r == want).ok_or_else(|| missing("RoPE table"))?.1, 0)
                }
            };
            match rows {
                Rows::Decode => a[word] = addr,
                Rows::All(_) => {
                    a[word] = addr;
                    strides[i] = stride;
                }
                Rows::One(row) => a[word] = addr + row as u64 * stride as u64,
            }
        }
        let (rows, row, cond) = match rows {
            Rows::Decode => (1, 0, l.cond),
            Rows::All(n) => (n, 0, l.cond | plan::CHUNK_ROW),
            Rows::One(r) => (1, r, l.cond | plan::CHUNK_ROW),
        };
        Ok(Resolved {
            ops: l.ops.clone(),
            kernel: l.kernel,
            func,
            grid: l.grid,
            block: l.block,
            cond,
            args: a,
            side: l.side,
            fork: l.fork,
            join: l.join,
            rows,
            row,
            strides,
            smem: 0,
        })
    }

    /// An attached chunk program ([`Executable::attach_chunk`]): its launches, its own buffers
    /// and scratch with one row per token, and the decode program's state.
    struct Chunk {
        program: Arc<Program>,
        /// Its per-row buffers and scratch areas.
        _arena: CudaSlice<u8>,
        /// StepParams of each row (count 0 past the chunk's tokens: the row runs nothing).
        params: CudaSlice<u32>,
        launches: Vec<Resolved>,
        graph: GraphState,
        /// The logits buffer: row 0's address and the bytes from one row to the next.
        logits: (u64, u32),
        /// RoPE tables that the decode program has no copy of.
        _ropes: Vec<CudaSlice<u8>>,
        /// Tokens in the last chunk run.
        count: usize,
    }

    enum GraphState {
        /// Graphs off: every token launches eagerly.
        Off,
        /// Graphs on, nothing captured yet: the next token runs eagerly, then the token is captured.
        WarmUp,
        Ready(CudaGraph),
        /// Capture or launch failed once: eager from then on.
        Failed,
    }

    pub struct CudaExecutable {
        program: Arc<Program>,
        stream: Arc<CudaStream>,
        _weights: Vec<WeightMem>,
        /// The model file's pages, registered and read in place (unified placement); dropped
        /// before the model that owns the mapping.
        _registration: Option<HostRegistration>,
        _model: Arc<Model>,
        /// Expert tables, cache states and slots, the grid and RoPE tables: kept alive.
        _device_mem: Vec<CudaSlice<u8>>,
        _tables: Vec<CudaSlice<u64>>,
        _cache_states: Vec<CudaSlice<i32>>,
        /// Expert cache counters (hits, copies, direct reads), when experts are cached.
        cache_stats: Option<CudaSlice<u64>>,
        /// Bytes of one expert (gate, up, down) of the first MoE layer.
        expert_bytes: u64,
        /// Where the weights went and how fast they came, for the caller to print.
        report: String,
        arena: CudaSlice<u8>,
        params: CudaSlice<u32>,
        /// Byte offset of each program buffer in the arena.
        offsets: Vec<usize>,
        /// The token's launches, runs of ops fused (what a step runs and the graph captures).
        launches: Vec<Resolved>,
        /// The same program one op per launch, for running a range of ops that cuts a fused run.
        single: Vec<Resolved>,
        graph: GraphState,
        fill: CudaFunction,
        /// Fallbacks that happened (a failed capture or graph launch), for the caller to report.
        warnings: Vec<String>,
        /// Steps run so far (for the failure-injection test hook).
        tokens: u64,
        inject: Option<GraphFailure>,
        /// Programmatic dependent launch (sm_90 on; `DS4_CUDA_PDL=0` turns it off).
        pdl: bool,
        /// The device sampler (kernels/sample.cu), launched after a token, not part of it.
        sample_fn: CudaFunction,
        /// The 4-byte token id it writes.
        sampled: CudaSlice<u32>,
        /// The side stream and the fork and join events, when the plan has side launches.
        branches: Option<(Arc<CudaStream>, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
        addrs: Addresses,
        /// The attached chunk program, if any.
        chunk: Option<Chunk>,
        /// The chunk build of the kernels (`KernelRows::Chunk`), loaded when a chunk program is
        /// first attached, and what it is compiled for.
        chunk_funcs: Option<Functions>,
        arch: String,
        layout: BlockLayout,
        /// The decode kernels' module (for the trace's device buffer).
        module: Arc<cudarc::driver::CudaModule>,
    }

    impl CudaExecutable {
        fn new(
            ctx: Arc<CudaContext>,
            program: Arc<Program>,
            model: Arc<Model>,
            opts: BackendOptions,
        ) -> Result<Self, BackendError> {
            let graphs = opts.graphs;
            ctx.bind_to_thread().map_err(drv("cannot bind the CUDA context"))?;
            // cudarc's per-allocation events would end up inside the captured graph.
            // SAFETY: set before any allocation, and every launch goes through one stream.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(drv("cannot create a stream"))?;

            let plan = plan::plan(&program, true, false).map_err(err)?;
            let single_plan = plan::plan(&program, false, false).map_err(err)?;
            // Arena layout: program buffers, then backend scratch.
            let mut offsets = Vec::with_capacity(program.buffers().len());
            let mut size = 0usize;
            for b in program.buffers() {
                offsets.push(size);
                size += (b.len * 4).div_ceil(ALIGN) * ALIGN;
            }
            let mut scratch_off = Vec::new();
            for kind in SCRATCH_KINDS {
                let bytes = [&plan, &single_plan]
                    .iter()
                    .flat_map(|p| p.scratch.iter().filter(|(k, _)| *k == kind).map(|&(_, b)| b))
                    .max()
                    .unwrap_or(0);
                scratch_off.push((kind, size));
                size += bytes.max(4).div_ceil(ALIGN) * ALIGN;
            }

            // Where the weights go: planned from the budget before anything is uploaded.
            let (free, total) = result::mem_get_info().map_err(drv("cannot query device memory"))?;
            let cfg = &model.config;
            let mut footprint = Footprint::of(&program, cfg.n_expert_used, cfg.n_expert);
            footprint.buffers = size as u64;
            let budget = match opts.placement.budget {
                Some(b) if b > free as u64 => {
                    return Err(err(format!(
                        "--vram-budget {} exceeds the {} free on the device ({} in all)",
                        placement::gb(b),
                        placement::gb(free as u64),
                        placement::gb(total as u64)
                    )))
                }
                Some(b) => b,
                // Room for the kernels, graphs and the context's own allocations.
                None => (free as u64).saturating_sub(HEADROOM),
            };
            let integrated = ctx
                .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
                .map_err(drv("cannot read the device's attributes"))?
                == 1;
            let mode = opts.placement.mode.or(integrated.then_some(PlacementMode::Unified));
            let mut placed = placement::plan_for(&footprint, budget, mode).map_err(|e| err(e.to_string()))?;
            let moe = moe_layers(&program);
            // Expert cache slots per MoE layer: what the cache bytes hold, at most every expert.
            let n_slots = match placed.placement {
                Placement::HostExperts { cache } if !moe.is_empty() => {
                    let per_round: u64 = moe.iter().map(|l| l.slot_bytes).sum();
                    let fit = (cache / per_round.max(1)).min(cfg.n_expert as u64) as usize;
                    opts.placement.cache_slots.map_or(fit, |cap| fit.min(cap))
                }
                _ => 0,
            };
            let (plan, single_plan) = if n_slots > 0 {
                (plan::plan(&program, true, true).map_err(err)?, plan::plan(&program, false, true).map_err(err)?)
            } else {
                (plan, single_plan)
            };
            // Unified placement reads every weight where it is on the host, so the kernels read
            // GGUF's own blocks; the other placements repack them for aligned wide loads.
            let layout = match placed.placement {
                Placement::Unified => BlockLayout::Native,
                _ => BlockLayout::Split,
            };
            let (major, minor) = ctx.compute_capability().map_err(drv("cannot read the compute capability"))?;
            let arch = format!("sm_{major}{minor}");
            let module = load_kernels(&ctx, &arch, layout, KernelRows::One)?;

            // A mapped file under unified placement: its pages are registered and read in place,
            // no byte copied. Otherwise (a model held in a buffer, or a driver that cannot lock
            // read-only pages) the weights are copied once into page-locked memory, unrepacked.
            let weight_bytes: u64 = program.weights().iter().map(|t| t.bytes).sum();
            let mut registration: Option<(HostRegistration, usize)> = None;
            let mut in_place_note = String::new();
            if layout == BlockLayout::Native && model.synthetic.is_none() {
                match model.file.mapping() {
                    Some(map) => {
                        let read_only = ctx
                            .attribute(
                                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                            )
                            .map_err(drv("cannot read the device's attributes"))?
                            == 1;
                        let t0 = std::time::Instant::now();
                        let done = std::sync::atomic::AtomicU64::new(0);
                        memory::fault_in(map, |n| {
                            let d = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
                            if let Some(p) = opts.load_progress {
                                p(d.min(weight_bytes.saturating_sub(1)), weight_bytes);
                            }
                        });
                        match HostRegistration::register(map, read_only) {
                            Ok(r) => {
                                in_place_note = format!(
                                    "  in place  the file's {} registered in {:.2} s; kernels read GGUF's blocks, no copy\n",
                                    placement::gb(map.len() as u64),
                                    t0.elapsed().as_secs_f64()
                                );
                                registration = Some((r, map.as_ptr() as usize));
                            }
                            Err(e) => {
                                in_place_note = format!(
                                    "  copied    the file's pages could not be registered ({e}): weights copied once\n"
                                )
                            }
                        }
                    }
                    None => in_place_note = "  copied    the model is not a mapped file: weights copied once\n".into(),
                }
            }

            let on_host = |name: &str| match placed.placement {
                Placement::Device => false,
                Placement::HostExperts { .. } => Footprint::is_expert(name),
                Placement::Unified => true,
            };

            let mut uploader = memory::Uploader::new(&stream, weight_bytes, opts.load_progress)
                .map_err(drv("cannot allocate the upload's staging buffers"))?;
            let mut weights: Vec<WeightMem> = Vec::with_capacity(program.weights().len());
            let mut weight_ptrs = Vec::with_capacity(program.weights().len());
            let synth_fill = module.load_function("synth_fill").map_err(drv("kernel 'synth_fill' is missing"))?;
            let synthetic = model.synthetic.as_ref();
            let host_alloc = |t: &crate::gguf::TensorInfo| {
                HostMem::alloc(t.bytes as usize)
                    .map_err(drv(&format!("cannot allocate page-locked memory for '{}'", t.name)))
            };
            for t in program.weights() {
                let host = on_host(&t.name);
                let recipe = synthetic.and_then(|s| s.fills.get(&t.name).map(|f| (s, *f)));
                let m = match recipe {
                    // A synthetic preset's weights are drawn in device memory, not copied; those
                    // placed in host memory move there once drawn.
                    Some((syn, fill)) => {
                        let d = generate(&stream, &synth_fill, t, syn.rng_state(&t.name), fill, layout)?;
                        if host {
                            let mut h = host_alloc(t)?;
                            stream
                                .memcpy_dtoh(&d, h.as_mut_slice())
                                .map_err(drv(&format!("cannot move '{}' to host memory", t.name)))?;
                            WeightMem::Host(h)
                        } else {
                            WeightMem::Device(d)
                        }
                    }
                    None if !model.file.has_data() => {
                        return Err(err(format!("tensor '{}' has neither host data nor a recipe", t.name)))
                    }
                    None if registration.is_some() => {
                        let (reg, base) = registration.as_ref().expect("checked");
                        WeightMem::InPlace(reg.device_ptr(model.data(t).as_ptr() as usize - base))
                    }
                    None if host => {
                        let mut h = host_alloc(t)?;
                        match layout {
                            BlockLayout::Split => {
                                crate::backends::gpu_tables::repack_blocks_into(t.ty, model.data(t), h.as_mut_slice())
                            }
                            BlockLayout::Native => memory::parallel_copy(h.as_mut_slice(), model.data(t)),
                        }
                        WeightMem::Host(h)
                    }
                    None => {
                        let bytes = crate::backends::gpu_tables::repack_blocks(t.ty, model.data(t));
                        let d = stream
                            .alloc_zeros::<u8>(bytes.len())
                            .map_err(drv(&format!("cannot allocate '{}'", t.name)))?;
                        uploader
                            .upload(&stream, d.device_ptr(&stream).0, &bytes)
                            .map_err(drv(&format!("cannot upload tensor '{}'", t.name)))?;
                        WeightMem::Device(d)
                    }
                };
                // (Pages read in place were counted while they were faulted in.)
                if (recipe.is_some() || host) && registration.is_none() {
                    uploader.advance(t.bytes);
                }
                weight_ptrs.push(m.ptr(&stream));
                weights.push(m);
            }
            let (copied, upload_s) = uploader.finish(&stream).map_err(drv("weight upload failed"))?;
            // Allocations that only need to stay alive.
            let mut device_mem: Vec<CudaSlice<u8>> = Vec::new();
            let mut table_mem: Vec<CudaSlice<u64>> = Vec::new();
            let mut state_mem: Vec<CudaSlice<i32>> = Vec::new();

            // Every routed-expert tensor's table: where each expert's quants and rest are. The
            // home table never changes; the live one points at cache slots while cached.
            let mut expert_tables: Vec<(u32, u64, u64)> = Vec::new();
            for l in &moe {
                for (&w, pieces) in l.tensors.iter().zip(&l.pieces) {
                    if expert_tables.iter().any(|e| e.0 == w.0) {
                        continue;
                    }
                    let base = weight_ptrs[w.0 as usize];
                    let n_expert = l.n_expert as u64;
                    let home: Vec<u64> = match layout {
                        BlockLayout::Split => (0..n_expert)
                            .flat_map(|e| [base + e * pieces.0, base + n_expert * pieces.0 + e * pieces.1])
                            .collect(),
                        // GGUF's blocks: an expert is one run; its quants start `at` into each block.
                        BlockLayout::Native => {
                            let ty = program.weight(w).ty;
                            let at = crate::backends::gpu_tables::block_split(ty).map_or(0, |s| s.1) as u64;
                            (0..n_expert)
                                .flat_map(|e| {
                                    let first = base + e * (pieces.0 + pieces.1);
                                    [first + at, first]
                                })
                                .collect()
                        }
                    };
                    let h = stream.clone_htod(&home).map_err(drv("cannot upload an expert table"))?;
                    let t = stream.clone_htod(&home).map_err(drv("cannot upload an expert table"))?;
                    expert_tables.push((w.0, t.device_ptr(&stream).0, h.device_ptr(&stream).0));
                    table_mem.extend([h, t]);
                }
            }

            // The expert cache: per MoE layer its state and slots, and the shared counters.
            let mut cache_states = Vec::new();
            let mut cache_slots = Vec::new();
            let cache_stats = stream.alloc_zeros::<u64>(3).map_err(drv("cannot allocate the cache counters"))?;
            if n_slots > 0 {
                for l in &moe {
                    // kernels/expert_cache.cu: header, slots, experts, then (8-byte aligned) at
                    // most six copy jobs per used expert of three u64 each.
                    let jobs_at = (4 + 2 * n_slots + l.n_expert).next_multiple_of(2);
                    let mut state = vec![-1i32; jobs_at + 6 * l.n_used * 3 * 2];
                    state[..4].copy_from_slice(&[n_slots as i32, 0, 0, jobs_at as i32]);
                    let st = stream.clone_htod(&state).map_err(drv("cannot allocate the expert cache"))?;
                    let slots = stream
                        .alloc_zeros::<u8>(n_slots * l.slot_bytes as usize)
                        .map_err(drv("cannot allocate the expert cache"))?;
                    cache_states.push(st.device_ptr(&stream).0);
                    cache_slots.push(slots.device_ptr(&stream).0);
                    state_mem.push(st);
                    device_mem.push(slots);
                }
            }
            let expert_bytes = moe.first().map_or(0, |l| l.pieces.iter().map(|p| p.0 + p.1).sum());
            if let Placement::HostExperts { cache } = &mut placed.placement {
                // What the slots take, not what the budget left.
                *cache = n_slots as u64 * moe.iter().map(|l| l.slot_bytes).sum::<u64>();
            }
            let mut report = placed.table();
            if let Placement::HostExperts { .. } = placed.placement {
                report += &format!(
                    "  cache   {n_slots} slots of {} per MoE layer (of {} experts; {} routed per token)\n",
                    placement::gb(expert_bytes),
                    cfg.n_expert,
                    cfg.n_expert_used
                );
            }
            report += &in_place_note;
            if integrated && matches!(placed.placement, Placement::Unified) {
                report += "  (this GPU shares host memory: the weights are held once)\n";
            }
            if copied > 0 {
                report += &format!(
                    "  upload  {} through pinned staging in {upload_s:.2} s ({:.1} GB/s)\n",
                    placement::gb(copied),
                    copied as f64 / upload_s.max(1e-9) / 1e9
                );
            }

            let grid_bytes = crate::backends::gpu_tables::iq2_xxs_grid_bytes();
            let grid_table = stream.clone_htod(&grid_bytes).map_err(drv("cannot upload the IQ2_XXS grid"))?;
            let grid_ptr = grid_table.device_ptr(&stream).0;
            device_mem.push(grid_table);

            // RoPE tables: (cos, sin) per position and pair, computed as the CPU reference does.
            let mut ropes = Vec::new();
            for r in plan.ropes.iter().chain(&single_plan.ropes) {
                if !ropes.iter().any(|(have, _)| have == r) {
                    let d = upload_rope_table(&stream, r, program.positions())?;
                    ropes.push((*r, d.device_ptr(&stream).0));
                    device_mem.push(d);
                }
            }

            let arena = stream.alloc_zeros::<u8>(size).map_err(drv("cannot allocate the buffer arena"))?;
            let base = arena.device_ptr(&stream).0;
            let params = stream.alloc_zeros::<u32>(4).map_err(drv("cannot allocate the step parameters"))?;

            let addrs = Addresses {
                weights: weight_ptrs,
                grid: grid_ptr,
                expert_tables,
                cache_states,
                cache_slots,
                cache_stats: cache_stats.device_ptr(&stream).0,
                ropes,
            };
            let areas = Areas {
                bufs: offsets.iter().map(|&o| (base + o as u64, 0)).collect(),
                scratch: scratch_off.iter().map(|&(_, o)| (base + o as u64, 0)).collect(),
            };
            let mut funcs = Functions { module: module.clone(), loaded: Vec::new() };
            let mut resolve_all = |p: &plan::Plan, traced: bool| -> Result<Vec<Resolved>, BackendError> {
                let mut out = Vec::with_capacity(p.launches.len());
                for (i, l) in p.launches.iter().enumerate() {
                    let mut r = resolve(l, &p.ropes, &areas, &addrs, &mut funcs, Rows::Decode)?;
                    indexer_one(&mut r, &mut funcs)?;
                    hc_pre_smem(&mut r)?;
                    if traced && i < plan::TRACE_LAUNCHES {
                        r.cond |= (i as u64 + 1) << plan::TRACE_SHIFT;
                    }
                    out.push(r);
                }
                Ok(out)
            };
            let launches = resolve_all(&plan, plan::trace_on())?;
            let single = resolve_all(&single_plan, false)?;
            let fill = module.load_function("fill").map_err(drv("kernel 'fill' is missing"))?;
            let sample_fn = module.load_function("sample_token").map_err(drv("kernel 'sample_token' is missing"))?;
            let sampled = stream.alloc_zeros::<u32>(1).map_err(drv("cannot allocate the sampled token"))?;
            let branches = if launches.iter().any(|l| l.side) && !env_is("DS4_CUDA_BRANCHES", "0") {
                let side = ctx.new_stream().map_err(drv("cannot create a stream"))?;
                let fork = ctx.new_event(None).map_err(drv("cannot create an event"))?;
                let join = ctx.new_event(None).map_err(drv("cannot create an event"))?;
                Some((side, fork, join))
            } else {
                None
            };

            let mut exe = CudaExecutable {
                program,
                stream,
                _weights: weights,
                _registration: registration.map(|r| r.0),
                _model: model.clone(),
                _device_mem: device_mem,
                _tables: table_mem,
                _cache_states: state_mem,
                cache_stats: (n_slots > 0).then_some(cache_stats),
                expert_bytes,
                report,
                arena,
                params,
                offsets,
                launches,
                single,
                graph: if graphs { GraphState::WarmUp } else { GraphState::Off },
                fill,
                warnings: Vec::new(),
                tokens: 0,
                inject: None,
                pdl: major >= 9 && !env_is("DS4_CUDA_PDL", "0"),
                sample_fn,
                sampled,
                branches,
                addrs,
                chunk: None,
                chunk_funcs: None,
                arch,
                layout,
                module,
            };
            exe.reset()?;
            Ok(exe)
        }

        fn buf_ptr(&self, b: Buf) -> u64 {
            self.arena.device_ptr(&self.stream).0 + self.offsets[b.0 as usize] as u64
        }

        /// Launches the whole token: the fused launches, the shared experts' runs on the side
        /// stream, forked from and joined back into the main stream (a captured graph keeps
        /// them as parallel branches). `DS4_CUDA_BRANCHES=0` keeps everything on one stream.
        fn launch_all(&self) -> Result<(), result::DriverError> {
            let Some((side, fork, join)) = &self.branches else {
                return self.launch_ops(0..usize::MAX);
            };
            let p = self.params.device_ptr(&self.stream).0;
            for l in &self.launches {
                if l.fork {
                    fork.record(&self.stream)?;
                    side.wait(fork)?;
                }
                if l.join {
                    join.record(side)?;
                    self.stream.wait(join)?;
                }
                let stream = if l.side { side } else { &self.stream };
                l.launch(stream, p, self.pdl)?;
            }
            Ok(())
        }

        /// Launches the kernels of the recorded ops in `ops`: the fused launches when none of them
        /// computes ops both inside and outside the range, else one launch per op.
        fn launch_ops(&self, ops: std::ops::Range<usize>) -> Result<(), result::DriverError> {
            let cut = self.launches.iter().any(|l| {
                let inside = l.ops.iter().filter(|k| ops.contains(k)).count();
                inside > 0 && inside < l.ops.len()
            });
            let list = if cut { &self.single } else { &self.launches };
            for l in list.iter().filter(|l| ops.contains(&l.ops[0])) {
                self.launch_resolved(l)?;
            }
            Ok(())
        }

        fn launch_resolved(&self, l: &Resolved) -> Result<(), result::DriverError> {
            l.launch(&self.stream, self.params.device_ptr(&self.stream).0, self.pdl)
        }

        /// Launches a helper kernel outside the program (fill, sampling): one row, no step
        /// parameters, always run.
        fn launch_helper(
            &self,
            func: &CudaFunction,
            grid: u32,
            block: u32,
            args: &[u64],
        ) -> Result<(), result::DriverError> {
            launch_with(&self.stream, func, 0, (grid, 1), block, 0, &[0; args::ROW_STRIDES], args, 0, self.pdl)
        }

        fn capture(&self) -> Result<CudaGraph, result::DriverError> {
            let graph = capture_on(&self.stream, || self.launch_all())?;
            if self.inject == Some(GraphFailure::Capture) {
                // The test hook: the capture ended cleanly, its graph is dropped as if it failed.
                return Err(result::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
            }
            Ok(graph)
        }

        /// Runs one chunk of the attached program (its parameter rows written): the graph where
        /// there is one, else eagerly, capturing after the first (warm-up) chunk.
        fn run_chunk(&mut self, c: &mut Chunk) -> Result<(), BackendError> {
            if let GraphState::Ready(g) = &c.graph {
                match g.launch() {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        self.warnings
                            .push(format!("cuda chunk graph launch failed ({e}); running eagerly from now on"));
                        c.graph = GraphState::Failed;
                    }
                }
            }
            launch_chunk(&self.stream, c, self.pdl).map_err(drv("kernel launch failed"))?;
            if matches!(c.graph, GraphState::WarmUp) {
                self.stream.synchronize().map_err(drv("warm-up chunk failed"))?;
                c.graph = match capture_on(&self.stream, || launch_chunk(&self.stream, c, self.pdl)) {
                    Ok(g) => GraphState::Ready(g),
                    Err(e) => {
                        self.warnings.push(format!("cuda chunk graph capture failed ({e}); running eagerly"));
                        GraphState::Failed
                    }
                };
            }
            Ok(())
        }

        /// Plans the chunk program and lays out its per-row buffers (see `attach_chunk`).
        fn build_chunk(&mut self, chunk: Arc<Program>) -> Result<Chunk, BackendError> {
            let rows = chunk.rows();
            let state = chunk.state_binding(&self.program).map_err(err)?;
            // `DS4_CUDA_EXPERTS_PER_ROW=1` keeps the per-row expert launches, to measure against.
            // `DS4_CUDA_MOE_MMA=0` keeps the grouped kernels on CUDA cores instead of the int8
            // tensor cores' (IQ2_XXS gate/up, Q2_K down; the split layout only). By default the IQ2_XXS gate/up is
            // `moe_gate_up_tile_iq2_xxs` (each weight decoded once per pass of up to 32 pairs;
            // alone 1,479.9 -> 1,568.3 tok/s); `DS4_CUDA_MOE_GATE_UP=mma` keeps the first. The
            // Q2_K down of the tensor-core kinds is `moe_down_tile_q2_k` (each fragment built once
            // per 16 pairs; alone 1,479.9 -> 1,615.7); `DS4_CUDA_MOE_DOWN=mma` keeps
            // `moe_down_mma_q2_k`.
            let mma = std::env::var("DS4_CUDA_MOE_MMA").ok();
            let experts = if std::env::var("DS4_CUDA_EXPERTS_PER_ROW").is_ok() {
                plan::ChunkExperts::PerRow
            } else if self.layout != BlockLayout::Split || mma.as_deref() == Some("0") {
                plan::ChunkExperts::Grouped
            } else if env_is("DS4_CUDA_MOE_GATE_UP", "mma") {
                plan::ChunkExperts::GroupedMma
            } else {
                plan::ChunkExperts::GroupedMmaTile
            };
            let down_tile = !env_is("DS4_CUDA_MOE_DOWN", "mma");
            let plan = plan::plan_experts(&chunk, true, false, experts, down_tile).map_err(err)?;
            let row_bytes = |bytes: usize| bytes.max(4).div_ceil(ALIGN) * ALIGN;
            // Per-row buffers, then per-row scratch areas; state is the decode program's.
            let mut size = 0usize;
            let mut bufs: Vec<(Option<Buf>, usize, usize)> = Vec::new();
            for (i, b) in chunk.buffers().iter().enumerate() {
                match state.iter().find(|(c, _)| c.0 as usize == i) {
                    Some(&(_, d)) => bufs.push((Some(d), 0, 0)),
                    None => {
                        let stride = row_bytes(b.len * 4);
                        bufs.push((None, size, if b.rows > 1 { stride } else { 0 }));
                        size += stride * b.rows as usize;
                    }
                }
            }
            let mut scratch = Vec::new();
            for kind in SCRATCH_KINDS {
                let bytes = plan.scratch.iter().filter(|(k, _)| *k == kind).map(|&(_, b)| b).max().unwrap_or(0);
                let stride = row_bytes(bytes);
                scratch.push((size, stride));
                size += stride * rows as usize;
            }
            let arena = self.stream.alloc_zeros::<u8>(size).map_err(|e| {
                err(format!(
                    "cannot allocate the prefill chunk's {} of buffers ({rows} rows; a smaller --prefill-chunk needs less): {e}",
                    placement::gb(size as u64)
                ))
            })?;
            let base = arena.device_ptr(&self.stream).0;
            let areas = Areas {
                bufs: bufs
                    .iter()
                    .map(|&(d, off, stride)| match d {
                        Some(d) => (self.buf_ptr(d), 0),
                        None => (base + off as u64, stride as u32),
                    })
                    .collect(),
                scratch: scratch.iter().map(|&(off, stride)| (base + off as u64, stride as u32)).collect(),
            };
            let mut ropes = Vec::new();
            for r in &plan.ropes {
                if !self.addrs.ropes.iter().any(|(have, _)| have == r) {
                    let d = upload_rope_table(&self.stream, r, chunk.positions())?;
                    self.addrs.ropes.push((*r, d.device_ptr(&self.stream).0));
                    ropes.push(d);
                }
            }
            // Batch steps: one launch over all rows. A row loop: its launches for row 0, then
            // for row 1, and so on (each row reads the state the previous row left).
            let mut funcs = match self.chunk_funcs.take() {
                Some(f) => f,
                None => Functions {
                    module: load_kernels(self.stream.context(), &self.arch, self.layout, KernelRows::Chunk)?,
                    loaded: Vec::new(),
                },
            };
            let steps = chunk.steps();
            let seq_of = |l: &plan::Launch| l.ops.iter().find_map(|&k| steps[k].seq);
            // The chunk build's Q8_0 kernels cover several token rows per block; the parameter
            // rows are padded to a whole number of them (count 0: nothing runs).
            let token_rows = q8_token_rows();
            let param_rows = chunk_param_rows(rows);
            let mut launches = Vec::new();
            let mut loops_seen = Vec::new();
            let mut i = 0;
            while i < plan.launches.len() {
                let Some(k) = seq_of(&plan.launches[i]) else {
                    let l = &plan.launches[i];
                    let multi = l.kernel == Q8_MULTI_ROW_KERNEL;
                    if multi && self.layout == BlockLayout::Split {
                        // The tensor-core product when every warp's 16 matrix rows lie in one matrix
                        // and every block's 64 in one group (it stages one group's input).
                        let m = bytemuck::try_pod_read_unaligned::<args::MatVecQ80Args>(bytemuck::cast_slice(&l.args))
                            .map_err(|e| err(format!("{}: argument words: {e}", l.kernel)))?;
                        let grouped = m.rows_per_group != m.rows;
                        let fits = m.rows.is_multiple_of(16)
                            && m.rows2.is_multiple_of(16)
                            && (!grouped || (m.rows_per_group.is_multiple_of(Q8_MMA_ROWS_PER_BLOCK) && m.rows2 == 0));
                        if fits {
                            let mut r = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(1))?;
                            if let Some(tile) = q8_tile() {
                                r.kernel = Q8_TILE_KERNEL;
                                r.func = funcs.get(Q8_TILE_KERNEL)?;
                                r.block = tile.threads();
                                r.grid = rows.div_ceil(tile.tokens());
                                r.smem = tile.smem();
                                opt_in_smem(&r)?;
                                // Several blocks per SM need the shared memory carveout at its
                                // largest (the default is only a hint, which may leave room for one).
                                if tile.min_blocks > 1 {
                                    r.func
                                        .set_attribute(
                                            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                            100,
                                        )
                                        .map_err(drv(&format!("{Q8_TILE_KERNEL}: shared memory carveout")))?;
                                }
                            } else {
                                r.kernel = Q8_MMA_KERNEL;
                                r.func = funcs.get(Q8_MMA_KERNEL)?;
                                r.block = 32 * Q8_MMA_ROWS_PER_BLOCK / 16;
                                r.grid = rows.div_ceil(q8_mma_tokens());
                            }
                            r.rows = (m.rows + m.rows2).div_ceil(Q8_MMA_ROWS_PER_BLOCK);
                            if r.rows > 65535 {
                                return Err(err(format!("{}: {} blocks do not fit gridDim.y", r.kernel, r.rows)));
                            }
                            launches.push(r);
                            i += 1;
                            continue;
                        }
                    }
                    if let Some(kernel) = f16_chunk_kernel(l.kernel) {
                        let mut r = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(1))?;
                        r.kernel = kernel;
                        r.func = funcs.get(kernel)?;
                        r.rows = rows.div_ceil(F16_TOKENS);
                        // (all rows, chunks) of an ungrouped matrix (pair), for the tile product.
                        let shape = if l.kernel == "mat_vec_f16" {
                            let m =
                                bytemuck::try_pod_read_unaligned::<args::MatVecF16Args>(bytemuck::cast_slice(&l.args))
                                    .map_err(|e| err(format!("{}: argument words: {e}", l.kernel)))?;
                            (m.rows_per_group == m.rows).then_some((m.rows, 1))
                        } else {
                            let m = bytemuck::try_pod_read_unaligned::<args::MatVecF16SplitArgs>(bytemuck::cast_slice(
                                &l.args,
                            ))
                            .map_err(|e| err(format!("{}: argument words: {e}", l.kernel)))?;
                            let splits = f16_tile_splits(m.rows + m.rows2, m.n_chunks, rows, (F16T_ROWS, F16T_TOKENS));
                            (m.rows_per_group == m.rows).then_some((m.rows + m.rows2, splits))
                        };
                        if let (Some(tile), Some((all_rows, splits))) = (f16_tile_kernel(kernel), shape) {
                            r.kernel = tile;
                            r.func = funcs.get(tile)?;
                            r.block = F16T_THREADS;
                            r.grid = all_rows.div_ceil(F16T_ROWS) * splits;
                            r.rows = rows.div_ceil(F16T_TOKENS);
                        }
                        launches.push(r);
                        i += 1;
                        continue;
                    }
                    if l.kernel == "hc_pre" && hc_pre_chunk() {
                        let h = bytemuck::try_pod_read_unaligned::<args::HcPreArgs>(bytemuck::cast_slice(&l.args))
                            .map_err(|e| err(format!("{}: argument words: {e}", l.kernel)))?;
                        let warps = plan::HC_PRE_WARPS as u32;
                        let mut flat = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(rows))?;
                        flat.kernel = "hc_pre_flat";
                        flat.func = funcs.get(flat.kernel)?;
                        flat.grid = h.n_chunks.div_ceil(warps);
                        flat.block = warps * 32;
                        flat.join = false;
                        let mut mix = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(1))?;
                        mix.kernel = "hc_pre_mix";
                        mix.func = funcs.get(mix.kernel)?;
                        mix.block = F16T_THREADS;
                        let (tile_rows, tile_tokens) = hc_mix_tile();
                        mix.grid = h.mix_rows.div_ceil(tile_rows)
                            * f16_tile_splits(h.mix_rows, h.n_chunks, rows, (tile_rows, tile_tokens));
                        mix.rows = rows.div_ceil(tile_tokens);
                        (mix.fork, mix.join) = (false, false);
                        let mut tail = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(rows))?;
                        tail.kernel = "hc_pre_tail";
                        tail.func = funcs.get(tail.kernel)?;
                        tail.grid = 2;
                        tail.block = warps * 32;
                        tail.fork = false;
                        launches.extend([flat, mix, tail]);
                        i += 1;
                        continue;
                    }
                    let ys = if multi {
                        rows.div_ceil(token_rows)
                    } else if ALL_ROWS_KERNELS.contains(&l.kernel) {
                        1
                    } else {
                        rows
                    };
                    let mut r = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(ys))?;
                    if multi {
                        // Token-row groups along x, matrix-row blocks along y (kernels/matvec.cu).
                        if r.grid > 65535 {
                            return Err(err(format!("{}: {} blocks do not fit gridDim.y", r.kernel, r.grid)));
                        }
                        (r.grid, r.rows) = (r.rows, r.grid);
                    }
                    if r.kernel == plan::GATE_UP_TILE_KERNEL {
                        r.smem = gate_up_tile_smem();
                        opt_in_smem(&r)?;
                    }
                    if r.kernel == "attention" {
                        let a = bytemuck::try_pod_read_unaligned::<args::AttentionArgs>(bytemuck::cast_slice(&r.args))
                            .map_err(|e| err(format!("{}: argument words: {e}", r.kernel)))?;
                        match attn_chunk_threads().filter(|_| a.head_dim <= 512) {
                            // A block per (group of 32 heads, token row): same bits, each staged KV
                            // row feeds the group's 32 heads (blockIdx.y is the token row).
                            Some(_) if attn_rows_kernel() && attn_rows_wide() && rows <= 65535 => {
                                r.kernel = ATTN_WIDE_KERNEL;
                                r.func = funcs.get(ATTN_WIDE_KERNEL)?;
                                r.block = 256;
                                r.grid = a.n_head.div_ceil(32);
                                r.smem = attn_wide_smem();
                                opt_in_smem(&r)?;
                            }
                            // A block per (two rows, 16 heads): same bits, each KV row read once
                            // for 32 (row, head) pairs (the row count in cond bits 50..62).
                            Some(_) if attn_rows_kernel() && rows < 1 << 13 => {
                                r.kernel = ATTN_ROWS_KERNEL;
                                r.func = funcs.get(ATTN_ROWS_KERNEL)?;
                                r.block = 256;
                                r.grid = a.n_head.div_ceil(16);
                                r.rows = rows.div_ceil(2);
                                r.cond |= (rows as u64) << 50;
                                if attn_rows_new() {
                                    // The same grid, block and row count.
                                    r.kernel = ATTN_ROWS2_KERNEL;
                                    r.func = funcs.get(ATTN_ROWS2_KERNEL)?;
                                    r.smem = attn_rows2_smem();
                                    opt_in_smem(&r)?;
                                }
                            }
                            // A block per (row, group of threads / 16 heads): same bits, each KV row
                            // read once per group instead of once per head.
                            Some(t) => {
                                r.kernel = ATTN_CHUNK_KERNEL;
                                r.func = funcs.get(ATTN_CHUNK_KERNEL)?;
                                r.block = t;
                                r.grid = a.n_head.div_ceil(t / 16);
                            }
                            // The chunk's attention (a block per head and row) in blocks of 512
                            // threads, or head_dim if larger: Flash prefill 305.6 -> 316.7 tok/s
                            // against 1024 on the H200. The order of every sum does not depend on
                            // the block size. `DS4_CUDA_ATTN_THREADS` overrides it, to measure.
                            None => {
                                let want =
                                    std::env::var("DS4_CUDA_ATTN_THREADS").ok().and_then(|v| v.parse::<u32>().ok());
                                let t = want.unwrap_or(512).max(a.head_dim);
                                if t.is_multiple_of(32) && t <= 1024 {
                                    r.block = t;
                                }
                            }
                        }
                    }
                    if r.kernel == "indexer_scores" {
                        let a =
                            bytemuck::try_pod_read_unaligned::<args::IndexerScoresArgs>(bytemuck::cast_slice(&r.args))
                                .map_err(|e| err(format!("{}: argument words: {e}", r.kernel)))?;
                        // A block per tile of token rows x compressed rows (the row count in cond
                        // bits 50..62): same bits, each staged k row and q head feeding several pairs.
                        if let Some((mt, mc)) = indexer_chunk_tile().filter(|_| a.head_dim == 128 && rows < 1 << 13) {
                            r.kernel = INDEXER_CHUNK_KERNEL;
                            r.func = funcs.get(INDEXER_CHUNK_KERNEL)?;
                            r.block = INDEXER_CHUNK_THREADS;
                            r.grid = a.cap.max(1).div_ceil(16 * mc);
                            r.rows = rows.div_ceil(8 * mt);
                            r.cond |= (rows as u64) << 50;
                        }
                    }
                    launches.push(r);
                    i += 1;
                    continue;
                };
                if loops_seen.contains(&k) {
                    return Err(err(format!(
                        "the plan splits row loop {k} of the chunk program (a launch between its ops)"
                    )));
                }
                loops_seen.push(k);
                let end = i + plan.launches[i..].iter().take_while(|l| seq_of(l) == Some(k)).count();
                // A loop that is one `compressor_update` runs as one launch looping over the rows
                // (kernels/fused.cu; the row count in cond bits 50..62).
                if let [l] = &plan.launches[i..end] {
                    if l.kernel == "compressor_update" && rows < 1 << 13 {
                        let mut r = resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::All(1))?;
                        r.cond |= (rows as u64) << 50;
                        let c = bytemuck::try_pod_read_unaligned::<args::CompressorUpdateArgs>(bytemuck::cast_slice(
                            &r.args,
                        ))
                        .map_err(|e| err(format!("{}: argument words: {e}", r.kernel)))?;
                        // The rows in parallel, a block per row: same bits (kernels/fused.cu).
                        if comp_chunk()
                            && c.head_dim <= COMP_CHUNK_MAX_HEAD_DIM
                            && (c.ratio == 4 || c.ratio <= COMP_CHUNK_MAX_RATIO)
                        {
                            r.kernel = COMP_CHUNK_KERNEL;
                            r.func = funcs.get(COMP_CHUNK_KERNEL)?;
                            r.block = COMP_CHUNK_THREADS;
                            r.grid = rows;
                        }
                        launches.push(r);
                        i = end;
                        continue;
                    }
                }
                if let Some(l) = plan.launches[i..end]
                    .iter()
                    .find(|l| l.kernel == Q8_MULTI_ROW_KERNEL || ALL_ROWS_KERNELS.contains(&l.kernel))
                {
                    return Err(err(format!("{} inside row loop {k}: its chunk build covers several rows", l.kernel)));
                }
                for r in 0..rows {
                    for l in &plan.launches[i..end] {
                        launches.push(resolve(l, &plan.ropes, &areas, &self.addrs, &mut funcs, Rows::One(r))?);
                    }
                }
                i = end;
            }
            self.chunk_funcs = Some(funcs);
            let params = self
                .stream
                .alloc_zeros::<u32>(4 * param_rows as usize)
                .map_err(drv("cannot allocate the chunk's parameters"))?;
            Ok(Chunk {
                logits: areas.bufs[chunk.logits().0 as usize],
                program: chunk,
                _arena: arena,
                params,
                launches,
                graph: if matches!(self.graph, GraphState::Off) { GraphState::Off } else { GraphState::WarmUp },
                _ropes: ropes,
                count: 0,
            })
        }

        /// Kernel launches per token: the nodes of the captured graph.
        pub fn launches(&self) -> usize {
            self.launches.len()
        }

        /// Whether the token is replayed as a captured graph now.
        pub fn graph_active(&self) -> bool {
            matches!(self.graph, GraphState::Ready(_))
        }
    }

    impl Executable for CudaExecutable {
        fn program(&self) -> &Arc<Program> {
            &self.program
        }

        fn step(&mut self, p: &StepParams) -> Result<(), BackendError> {
            self.program.check_params(p).map_err(err)?;
            let words = [p.token, p.pos, 0, 1];
            self.stream.memcpy_htod(&words, &mut self.params).map_err(drv("cannot write the step parameters"))?;
            let token = self.tokens;
            self.tokens += 1;
            if let GraphState::Ready(g) = &self.graph {
                let injected = self.inject == Some(GraphFailure::Launch { at_token: token });
                let launched = if injected {
                    Err(result::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED))
                } else {
                    g.launch()
                };
                match launched {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        self.warnings.push(format!("cuda graph launch failed ({e}); running eagerly from now on"));
                        self.graph = GraphState::Failed;
                    }
                }
            }
            self.launch_all().map_err(drv("kernel launch failed"))?;
            if matches!(self.graph, GraphState::WarmUp) {
                // The warm-up token has run; capture the token once for every later replay.
                self.stream.synchronize().map_err(drv("warm-up token failed"))?;
                self.graph = match self.capture() {
                    Ok(g) => GraphState::Ready(g),
                    Err(e) => {
                        self.warnings.push(format!("cuda graph capture failed ({e}); running eagerly"));
                        GraphState::Failed
                    }
                };
            }
            Ok(())
        }

        fn attach_chunk(&mut self, chunk: Arc<Program>) -> Result<(), BackendError> {
            if chunk.tokens().is_none() {
                return Err(err("a chunk program needs more than one row"));
            }
            if chunk.positions() != self.program.positions() || chunk.n_vocab() != self.program.n_vocab() {
                return Err(err("the chunk program was recorded for another session shape"));
            }
            if self.cache_stats.is_some() {
                return Err(err(
                    "batched prefill needs the routed experts in device memory or read in place (placement device \
                     or unified), not cached from host memory (placement host)",
                ));
            }
            self.chunk = None;
            self.chunk = Some(self.build_chunk(chunk)?);
            Ok(())
        }

        fn step_chunk(&mut self, p: &StepParams, tokens: &[u32]) -> Result<(), BackendError> {
            let mut c = self.chunk.take().ok_or_else(|| err("no chunk program is attached"))?;
            let ran = (|| {
                c.program.check_chunk(p, tokens).map_err(err)?;
                self.stream
                    .memcpy_htod(&chunk_words(&c, p, tokens), &mut c.params)
                    .map_err(drv("cannot write the step parameters"))?;
                self.run_chunk(&mut c)?;
                c.count = tokens.len();
                // The decode program's logits: the chunk's last token's, as if it had been stepped.
                let n = c.program.n_vocab();
                let src = c.logits.0 + (c.count as u64 - 1) * c.logits.1 as u64;
                // SAFETY: both ranges are `n` f32 values inside live arenas of this executable.
                unsafe {
                    result::memcpy_dtod_async(self.buf_ptr(self.program.logits()), src, n * 4, self.stream.cu_stream())
                }
                .map_err(drv("cannot copy the chunk's logits"))
            })();
            self.chunk = Some(c);
            ran
        }

        fn read_chunk_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
            let c = self.chunk.as_ref().ok_or_else(|| err("no chunk program is attached"))?;
            let n = c.program.n_vocab();
            out.clear();
            let mut row = vec![0u32; n];
            for r in 0..c.count {
                // SAFETY: row r of the logits buffer holds `n` f32 values inside the chunk's arena.
                unsafe {
                    result::memcpy_dtoh_async(
                        &mut row,
                        c.logits.0 + r as u64 * c.logits.1 as u64,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(drv("cannot read the chunk's logits"))?;
                self.stream.synchronize().map_err(drv("chunk failed"))?;
                out.extend(row.iter().map(|&v| f32::from_bits(v)));
            }
            Ok(())
        }

        fn step_ops(&mut self, p: &StepParams, ops: std::ops::Range<usize>) -> Result<(), BackendError> {
            self.program.check_params(p).map_err(err)?;
            let words = [p.token, p.pos, 0, 1];
            self.stream.memcpy_htod(&words, &mut self.params).map_err(drv("cannot write the step parameters"))?;
            self.launch_ops(ops).map_err(drv("kernel launch failed"))
        }

        fn profile(&mut self, p: &StepParams) -> Result<Vec<(String, f64)>, BackendError> {
            self.program.check_params(p).map_err(err)?;
            let words = [p.token, p.pos, 0, 1];
            self.stream.memcpy_htod(&words, &mut self.params).map_err(drv("cannot write the step parameters"))?;
            let params = self.params.device_ptr(&self.stream).0;
            time_launches(&self.stream, &self.launches, params, self.pdl, &self.program)
        }

        fn trace(&mut self, p: &StepParams, tokens: usize) -> Result<Option<Vec<TraceLaunch>>, BackendError> {
            if !plan::trace_on() {
                return Ok(None);
            }
            const SLOTS: usize = plan::TRACE_SLOTS;
            let n = self.launches.len().min(plan::TRACE_LAUNCHES);
            let mut init = vec![0u64; SLOTS * plan::TRACE_LAUNCHES];
            for i in 0..plan::TRACE_LAUNCHES {
                init[SLOTS * i] = u64::MAX;
                init[SLOTS * i + 1] = u64::MAX;
            }
            let init: Vec<u8> = bytemuck::cast_slice(&init).to_vec();
            let mut host = vec![0u8; init.len()];
            let mut sums = vec![[(0.0f64, 0usize); SLOTS]; n];
            for _ in 0..tokens {
                {
                    let mut buf = self.module.get_global("ds4_trace", &self.stream).map_err(drv("no trace buffer"))?;
                    self.stream.memcpy_htod(&init, &mut buf).map_err(drv("cannot clear the trace"))?;
                }
                self.step(p)?;
                {
                    let buf = self.module.get_global("ds4_trace", &self.stream).map_err(drv("no trace buffer"))?;
                    self.stream.memcpy_dtoh(&buf, &mut host).map_err(drv("cannot read the trace"))?;
                }
                self.stream.synchronize().map_err(drv("the traced token failed"))?;
                let v: Vec<u64> =
                    host.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
                let noted = |x: u64| x != 0 && x != u64::MAX;
                let t0 = (0..n).map(|i| v[SLOTS * i + 1]).filter(|&x| noted(x)).min().unwrap_or(0);
                for (i, sum) in sums.iter_mut().enumerate() {
                    for (k, s) in sum.iter_mut().enumerate() {
                        let x = v[SLOTS * i + k];
                        if noted(x) {
                            *s = (s.0 + (x as f64 - t0 as f64) / 1e3, s.1 + 1);
                        }
                    }
                }
            }
            let mean = |s: (f64, usize)| (s.1 > 0).then(|| s.0 / s.1 as f64);
            let out = self.launches[..n]
                .iter()
                .zip(&sums)
                .map(|(l, s)| {
                    let ready = mean(s[1]).unwrap_or(0.0);
                    TraceLaunch {
                        label: launch_label(l, &self.program),
                        side: l.side,
                        entry: mean(s[0]).unwrap_or(ready),
                        ready,
                        last_ready: mean(s[2]).unwrap_or(ready),
                        marks: std::array::from_fn(|k| mean(s[k + 3])),
                    }
                })
                .collect();
            Ok(Some(out))
        }

        fn profile_chunk(&mut self, p: &StepParams, tokens: &[u32]) -> Result<Vec<(String, f64)>, BackendError> {
            let mut c = self.chunk.take().ok_or_else(|| err("no chunk program is attached"))?;
            let ran = (|| {
                c.program.check_chunk(p, tokens).map_err(err)?;
                self.stream
                    .memcpy_htod(&chunk_words(&c, p, tokens), &mut c.params)
                    .map_err(drv("cannot write the step parameters"))?;
                c.count = tokens.len();
                let params = c.params.device_ptr(&self.stream).0;
                time_launches(&self.stream, &c.launches, params, self.pdl, &c.program)
            })();
            self.chunk = Some(c);
            ran
        }

        fn sample(&mut self, s: &DeviceSample) -> Result<Option<u32>, BackendError> {
            // One block over the logits of the last step, on the same stream after it; then the
            // 4-byte id comes back instead of the whole vocabulary's logits.
            let logits = self.program.logits();
            let n = self.program.buffers()[logits.0 as usize].len;
            let a = args::SampleTokenArgs {
                logits: Ptr(self.buf_ptr(logits)),
                out: Ptr(self.sampled.device_ptr(&self.stream).0),
                n: n as u32,
                top_k: s.candidates(),
                temperature: s.temperature,
                top_p: s.top_p,
                min_p: s.min_p,
                r: s.r,
            };
            let (words, _) = args::encode(&a);
            self.launch_helper(&self.sample_fn, 1, SAMPLE_THREADS, &words)
                .map_err(drv("sampling kernel launch failed"))?;
            let mut id = [0u32];
            // SAFETY: `sampled` is a live 4-byte allocation of this executable.
            unsafe { result::memcpy_dtoh_async(&mut id, a.out.0, self.stream.cu_stream()) }
                .map_err(drv("cannot read the sampled token back"))?;
            self.stream.synchronize().map_err(drv("token failed"))?;
            if id[0] as usize >= n {
                return Err(err(format!("the device sampler returned token {} of a {n}-token vocabulary", id[0])));
            }
            Ok(Some(id[0]))
        }

        fn read_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
            *out = self.read_buffer(self.program.logits())?;
            Ok(())
        }

        fn read_buffer(&mut self, buf: Buf) -> Result<Vec<f32>, BackendError> {
            let d = self.program.buffers().get(buf.0 as usize).ok_or_else(|| err(format!("no buffer {}", buf.0)))?;
            let mut raw = vec![0u32; d.len];
            let src = self.buf_ptr(buf);
            // SAFETY: `src` addresses `d.len` 4-byte values inside the arena.
            unsafe { result::memcpy_dtoh_async(&mut raw, src, self.stream.cu_stream()) }
                .map_err(drv("cannot read a buffer back"))?;
            self.stream.synchronize().map_err(drv("token failed"))?;
            Ok(match d.dtype {
                DType::F32 => raw.into_iter().map(f32::from_bits).collect(),
                DType::I32 => raw.into_iter().map(|v| v as i32 as f32).collect(),
            })
        }

        fn write_buffer(&mut self, buf: Buf, data: &[f32]) -> Result<(), BackendError> {
            let d = self.program.buffers().get(buf.0 as usize).ok_or_else(|| err(format!("no buffer {}", buf.0)))?;
            if d.len != data.len() {
                return Err(err(format!("buffer '{}' holds {} values, not {}", d.name, d.len, data.len())));
            }
            let raw: Vec<u32> = match d.dtype {
                DType::F32 => data.iter().map(|v| v.to_bits()).collect(),
                DType::I32 => data.iter().map(|&v| v as i32 as u32).collect(),
            };
            // SAFETY: the destination addresses `d.len` 4-byte values inside the arena.
            unsafe { result::memcpy_htod_async(self.buf_ptr(buf), &raw, self.stream.cu_stream()) }
                .map_err(drv("cannot write a buffer"))?;
            self.stream.synchronize().map_err(drv("cannot write a buffer"))
        }

        fn copy_bandwidth(&mut self) -> Option<f64> {
            // 1 GiB copied device to device 10 times, timed by events: read + write bytes per second.
            const BYTES: usize = 1 << 30;
            let a = self.stream.alloc_zeros::<u8>(BYTES).ok()?;
            let mut b = self.stream.alloc_zeros::<u8>(BYTES).ok()?;
            let ctx = self.stream.context().clone();
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            self.stream.memcpy_dtod(&a, &mut b).ok()?;
            let (e0, e1) = (ctx.new_event(timing).ok()?, ctx.new_event(timing).ok()?);
            e0.record(&self.stream).ok()?;
            for _ in 0..10 {
                self.stream.memcpy_dtod(&a, &mut b).ok()?;
            }
            e1.record(&self.stream).ok()?;
            self.stream.synchronize().ok()?;
            let ms = e0.elapsed_ms(&e1).ok()? as f64;
            Some(2.0 * 10.0 * BYTES as f64 / (ms * 1e-3) / 1e9)
        }

        fn nodes_per_token(&self) -> Option<usize> {
            Some(self.launches.len())
        }

        fn load_report(&self) -> Option<String> {
            Some(self.report.clone())
        }

        fn expert_cache_stats(&mut self) -> Option<ExpertCacheStats> {
            let stats = self.cache_stats.as_ref()?;
            let v = self.stream.clone_dtoh(stats).ok()?;
            Some(ExpertCacheStats { hits: v[0], copies: v[1], direct: v[2], expert_bytes: self.expert_bytes })
        }

        fn inject_graph_failure(&mut self, f: GraphFailure) -> Result<(), BackendError> {
            self.inject = Some(f);
            Ok(())
        }

        fn take_warnings(&mut self) -> Vec<String> {
            std::mem::take(&mut self.warnings)
        }

        fn reset(&mut self) -> Result<(), BackendError> {
            for (i, d) in self.program.buffers().iter().enumerate() {
                let init = match d.kind {
                    BufKind::State { init } => init,
                    BufKind::Scratch => 0.0,
                };
                let value = match d.dtype {
                    DType::F32 => init.to_bits(),
                    DType::I32 => init as i32 as u32,
                };
                let a = FillArgs { x: Ptr(self.buf_ptr(Buf(i as u32))), n: d.len as u64, v: value, _pad: 0 };
                let (words, _) = args::encode(&a);
                self.launch_helper(&self.fill, (d.len as u32).div_ceil(256).max(1), 256, &words)
                    .map_err(drv("cannot reset the caches"))?;
            }
            self.stream.synchronize().map_err(drv("cannot reset the caches"))?;
            Ok(())
        }
    }
}
