#define DS4_NATIVE_BLOCKS 0
#define DS4_CHUNK_ROWS 1
#define Q8_TOKEN_ROWS 8
#define Q8_MMA_TOKENS 16
#define Q8T_WN 4
#define ATTN_CHUNK_THREADS 256
#define IDX_MT 2
#define IDX_MC 4
#define ATTN_SPLIT_HEADS 16
#define ATTN_SCORE_ROWS 16
#define ATTN_SCORE_THREADS 256
#define ATTN_SUM_THREADS 128
// Generated from backends/cuda/args.rs and src/numerics.rs: do not edit by hand.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Q8_K activation block: `quant::BlockQ8K`'s fields, reordered so that the quants and the
// sums are 16-byte aligned (304 bytes).
struct BlockQ8K {
    i8 qs[256];
    i16 bsums[16];
    float d;
    u32 pad[3];
};

// Mirrors `recorder::StepParams` (repr(C)): the only per-token input of a replay.
struct StepParams {
    u32 token;
    u32 pos;
    u32 reserved0;
    u32 count;
};

// Generated from src/numerics.rs: the canonical profile's constants.
#define DS4_LN2_HI __int_as_float(0x3f318000) /* 6.933594e-1 */
#define DS4_LN2_LO __int_as_float(0xb95e8083) /* -2.1219444e-4 */
#define DS4_LOG2_E __int_as_float(0x3fb8aa3b) /* 1.442695e0 */
#define DS4_EXP_MAX __int_as_float(0x42b17217) /* 8.872283e1 */
#define DS4_EXP_MIN __int_as_float(0xc2aeac50) /* -8.733655e1 */
#define DS4_EXP_C2 __int_as_float(0x3f000000) /* 5e-1 */
#define DS4_EXP_C3 __int_as_float(0x3e2aaaab) /* 1.6666667e-1 */
#define DS4_EXP_C4 __int_as_float(0x3d2aaaab) /* 4.1666668e-2 */
#define DS4_EXP_C5 __int_as_float(0x3c088889) /* 8.333334e-3 */
#define DS4_EXP_C6 __int_as_float(0x3ab60b61) /* 1.3888889e-3 */
#define DS4_EXP_C7 __int_as_float(0x39500d01) /* 1.984127e-4 */
#define DS4_LN_P1 __int_as_float(0x3f2aaaab) /* 6.666667e-1 */
#define DS4_LN_P2 __int_as_float(0x3ecccccd) /* 4e-1 */
#define DS4_LN_P3 __int_as_float(0x3e924925) /* 2.857143e-1 */
#define DS4_LN_P4 __int_as_float(0x3e638e39) /* 2.2222222e-1 */
#define DS4_LN_P5 __int_as_float(0x3e3a2e8c) /* 1.8181819e-1 */
#define DS4_LN_THIRD __int_as_float(0x3eaaaaab) /* 3.3333334e-1 */
#define DS4_SQRT2 __int_as_float(0x3fb504f3) /* 1.4142135e0 */
#define DS4_HADAMARD_SCALE __int_as_float(0x3db504f3) /* 8.8388346e-2 */
#define DS4_CHUNK 512
#define DS4_BLOCK_CHUNK 32
#define DS4_ATTN_ROW_CHUNK 64

// Split layout of a repacked block type (backends/gpu_tables.rs: BLOCK_SPLITS): block bytes,
// where its quants start, how many bytes they take. Returns false for other types.
__device__ __forceinline__ bool ds4_block_split(u32 ty, u32* bb, u32* at, u32* nq) {
    if (ty == 8) { *bb = 34; *at = 2; *nq = 32; return true; }
    if (ty == 16) { *bb = 66; *at = 2; *nq = 64; return true; }
    if (ty == 10) { *bb = 84; *at = 16; *nq = 64; return true; }
    if (ty == 12) { *bb = 144; *at = 16; *nq = 128; return true; }
    return false;
}

// The byte stride of each pointer argument from one chunk row to the next (0: shared).
struct RowStrides {
    u32 s[16];
};

// The arguments of `embed_hc`.
struct EmbedHcArgs {
    const void* table;
    float* out;
    u32 n_embd;
    u32 n_hc;
    u32 is_f16;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(EmbedHcArgs& a, const RowStrides& R, u32 y) {
    a.table = (const void*)((u64)a.table + (u64)R.s[0] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[1] * y);
}
// The arguments of `rms_norm`.
struct RmsNormArgs {
    const float* x;
    const float* w;
    float* out;
    i8* xq;
    float* xd;
    u32 n;
    float eps;
    u32 slices;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(RmsNormArgs& a, const RowStrides& R, u32 y) {
    a.x = (const float*)((u64)a.x + (u64)R.s[0] * y);
    a.w = (const float*)((u64)a.w + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[3] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[4] * y);
}
// The arguments of `quantize_q8_0`.
struct QuantizeQ80Args {
    const float* x;
    i8* xq;
    float* xd;
    u32 n;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(QuantizeQ80Args& a, const RowStrides& R, u32 y) {
    a.x = (const float*)((u64)a.x + (u64)R.s[0] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[1] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[2] * y);
}
// The arguments of `mat_vec_q8_0`.
struct MatVecQ80Args {
    const u8* w;
    const i8* xq;
    const float* xd;
    float* out;
    const u8* w2;
    float* out2;
    u32 in_dim;
    u32 rows;
    u32 rows_per_group;
    u32 rows2;
};
__device__ __forceinline__ void ds4_row(MatVecQ80Args& a, const RowStrides& R, u32 y) {
    a.w = (const u8*)((u64)a.w + (u64)R.s[0] * y);
    a.xq = (const i8*)((u64)a.xq + (u64)R.s[1] * y);
    a.xd = (const float*)((u64)a.xd + (u64)R.s[2] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[3] * y);
    a.w2 = (const u8*)((u64)a.w2 + (u64)R.s[4] * y);
    a.out2 = (float*)((u64)a.out2 + (u64)R.s[5] * y);
}
// The arguments of `mat_vec_f16`.
struct MatVecF16Args {
    const u16* w;
    const float* x;
    float* out;
    u32 in_dim;
    u32 rows;
    u32 rows_per_group;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(MatVecF16Args& a, const RowStrides& R, u32 y) {
    a.w = (const u16*)((u64)a.w + (u64)R.s[0] * y);
    a.x = (const float*)((u64)a.x + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
}
// The arguments of `mat_vec_f16_split`.
struct MatVecF16SplitArgs {
    const u16* w;
    const float* x;
    float* partial;
    u32* tickets;
    float* out;
    const u16* w2;
    float* out2;
    u32 in_dim;
    u32 rows;
    u32 rows_per_group;
    u32 n_chunks;
    u32 ticket;
    u32 rows2;
};
__device__ __forceinline__ void ds4_row(MatVecF16SplitArgs& a, const RowStrides& R, u32 y) {
    a.w = (const u16*)((u64)a.w + (u64)R.s[0] * y);
    a.x = (const float*)((u64)a.x + (u64)R.s[1] * y);
    a.partial = (float*)((u64)a.partial + (u64)R.s[2] * y);
    a.tickets = (u32*)((u64)a.tickets + (u64)R.s[3] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[4] * y);
    a.w2 = (const u16*)((u64)a.w2 + (u64)R.s[5] * y);
    a.out2 = (float*)((u64)a.out2 + (u64)R.s[6] * y);
}
// The arguments of `mat_vec_f32`.
struct MatVecF32Args {
    const float* w;
    const float* x;
    float* out;
    u32 in_dim;
    u32 rows;
    u32 rows_per_group;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(MatVecF32Args& a, const RowStrides& R, u32 y) {
    a.w = (const float*)((u64)a.w + (u64)R.s[0] * y);
    a.x = (const float*)((u64)a.x + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
}
// The arguments of `hc_split`.
struct HcSplitArgs {
    const float* mix;
    const float* scale;
    const float* base;
    float* split;
    u32 n_hc;
    u32 iters;
    float eps;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(HcSplitArgs& a, const RowStrides& R, u32 y) {
    a.mix = (const float*)((u64)a.mix + (u64)R.s[0] * y);
    a.scale = (const float*)((u64)a.scale + (u64)R.s[1] * y);
    a.base = (const float*)((u64)a.base + (u64)R.s[2] * y);
    a.split = (float*)((u64)a.split + (u64)R.s[3] * y);
}
// The arguments of `hc_weighted_sum`.
struct HcWeightedSumArgs {
    const float* hc;
    const float* weights;
    float* out;
    u32 n;
    u32 n_hc;
};
__device__ __forceinline__ void ds4_row(HcWeightedSumArgs& a, const RowStrides& R, u32 y) {
    a.hc = (const float*)((u64)a.hc + (u64)R.s[0] * y);
    a.weights = (const float*)((u64)a.weights + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
}
// The arguments of `hc_post`.
struct HcPostArgs {
    const float* block;
    const float* block_b;
    float* sum_out;
    const float* residual;
    const float* split;
    float* out;
    float* ss;
    u32 n;
    u32 n_hc;
};
__device__ __forceinline__ void ds4_row(HcPostArgs& a, const RowStrides& R, u32 y) {
    a.block = (const float*)((u64)a.block + (u64)R.s[0] * y);
    a.block_b = (const float*)((u64)a.block_b + (u64)R.s[1] * y);
    a.sum_out = (float*)((u64)a.sum_out + (u64)R.s[2] * y);
    a.residual = (const float*)((u64)a.residual + (u64)R.s[3] * y);
    a.split = (const float*)((u64)a.split + (u64)R.s[4] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[5] * y);
    a.ss = (float*)((u64)a.ss + (u64)R.s[6] * y);
}
// The arguments of `hc_head_weights`.
struct HcHeadWeightsArgs {
    const float* pre;
    const float* scale;
    const float* base;
    float* out;
    u32 n;
    float eps;
};
__device__ __forceinline__ void ds4_row(HcHeadWeightsArgs& a, const RowStrides& R, u32 y) {
    a.pre = (const float*)((u64)a.pre + (u64)R.s[0] * y);
    a.scale = (const float*)((u64)a.scale + (u64)R.s[1] * y);
    a.base = (const float*)((u64)a.base + (u64)R.s[2] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[3] * y);
}
// The arguments of `rope_tail`.
struct RopeTailArgs {
    float* x;
    const float* table;
    u32 n_head;
    u32 head_dim;
    u32 n_rot;
    u32 pos_mode;
    u32 ratio;
    u32 inverse;
};
__device__ __forceinline__ void ds4_row(RopeTailArgs& a, const RowStrides& R, u32 y) {
    a.x = (float*)((u64)a.x + (u64)R.s[0] * y);
    a.table = (const float*)((u64)a.table + (u64)R.s[1] * y);
}
// The arguments of `fp8_round_trip`.
struct Fp8RoundTripArgs {
    float* x;
};
__device__ __forceinline__ void ds4_row(Fp8RoundTripArgs& a, const RowStrides& R, u32 y) {
    a.x = (float*)((u64)a.x + (u64)R.s[0] * y);
}
// The arguments of `indexer_qat`.
struct IndexerQatArgs {
    float* x;
};
__device__ __forceinline__ void ds4_row(IndexerQatArgs& a, const RowStrides& R, u32 y) {
    a.x = (float*)((u64)a.x + (u64)R.s[0] * y);
}
// The arguments of `store_raw`.
struct StoreRawArgs {
    const float* kv;
    float* cache;
    u32 dim;
    u32 raw_cap;
};
__device__ __forceinline__ void ds4_row(StoreRawArgs& a, const RowStrides& R, u32 y) {
    a.kv = (const float*)((u64)a.kv + (u64)R.s[0] * y);
    a.cache = (float*)((u64)a.cache + (u64)R.s[1] * y);
}
// The arguments of `store_comp_row`.
struct StoreCompRowArgs {
    const float* row;
    float* cache;
    u32 dim;
    u32 ratio;
};
__device__ __forceinline__ void ds4_row(StoreCompRowArgs& a, const RowStrides& R, u32 y) {
    a.row = (const float*)((u64)a.row + (u64)R.s[0] * y);
    a.cache = (float*)((u64)a.cache + (u64)R.s[1] * y);
}
// The arguments of `compressor_store`.
struct CompressorStoreArgs {
    const float* kv;
    const float* score;
    const void* ape;
    float* state_kv;
    float* state_score;
    u32 ape_f16;
    u32 width;
    u32 ratio;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(CompressorStoreArgs& a, const RowStrides& R, u32 y) {
    a.kv = (const float*)((u64)a.kv + (u64)R.s[0] * y);
    a.score = (const float*)((u64)a.score + (u64)R.s[1] * y);
    a.ape = (const void*)((u64)a.ape + (u64)R.s[2] * y);
    a.state_kv = (float*)((u64)a.state_kv + (u64)R.s[3] * y);
    a.state_score = (float*)((u64)a.state_score + (u64)R.s[4] * y);
}
// The arguments of `compressor_pool`.
struct CompressorPoolArgs {
    const float* kv;
    const float* score;
    float* out;
    u32 head_dim;
    u32 ratio;
};
__device__ __forceinline__ void ds4_row(CompressorPoolArgs& a, const RowStrides& R, u32 y) {
    a.kv = (const float*)((u64)a.kv + (u64)R.s[0] * y);
    a.score = (const float*)((u64)a.score + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
}
// The arguments of `compressor_shift`.
struct CompressorShiftArgs {
    float* state_kv;
    float* state_score;
    u32 n;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(CompressorShiftArgs& a, const RowStrides& R, u32 y) {
    a.state_kv = (float*)((u64)a.state_kv + (u64)R.s[0] * y);
    a.state_score = (float*)((u64)a.state_score + (u64)R.s[1] * y);
}
// The arguments of `indexer_scores`.
struct IndexerScoresArgs {
    const float* q;
    const float* weights;
    const float* cache;
    float* out;
    u32 n_head;
    u32 head_dim;
    float scale;
    u32 ratio;
    u32 cap;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(IndexerScoresArgs& a, const RowStrides& R, u32 y) {
    a.q = (const float*)((u64)a.q + (u64)R.s[0] * y);
    a.weights = (const float*)((u64)a.weights + (u64)R.s[1] * y);
    a.cache = (const float*)((u64)a.cache + (u64)R.s[2] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[3] * y);
}
// The arguments of `indexer_top_k`.
struct IndexerTopKArgs {
    const float* scores;
    int* out;
    int* taken;
    u32 top_k;
    u32 ratio;
    u32 cap;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(IndexerTopKArgs& a, const RowStrides& R, u32 y) {
    a.scores = (const float*)((u64)a.scores + (u64)R.s[0] * y);
    a.out = (int*)((u64)a.out + (u64)R.s[1] * y);
    a.taken = (int*)((u64)a.taken + (u64)R.s[2] * y);
}
// The arguments of `attention`.
struct AttentionArgs {
    const float* q;
    const float* raw;
    const float* comp;
    const int* selected;
    const float* sinks;
    float* out;
    float* scores;
    const float* rope;
    i8* xq;
    float* xd;
    u32 head_dim;
    u32 window;
    u32 raw_cap;
    u32 ratio;
    u32 comp_cap;
    u32 top_k;
    u32 max_rows;
    float kq_scale;
    u32 n_rot;
    u32 n_head;
};
__device__ __forceinline__ void ds4_row(AttentionArgs& a, const RowStrides& R, u32 y) {
    a.q = (const float*)((u64)a.q + (u64)R.s[0] * y);
    a.raw = (const float*)((u64)a.raw + (u64)R.s[1] * y);
    a.comp = (const float*)((u64)a.comp + (u64)R.s[2] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[3] * y);
    a.sinks = (const float*)((u64)a.sinks + (u64)R.s[4] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[5] * y);
    a.scores = (float*)((u64)a.scores + (u64)R.s[6] * y);
    a.rope = (const float*)((u64)a.rope + (u64)R.s[7] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[8] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[9] * y);
}
// The arguments of `attention_scores`.
struct AttentionScoresArgs {
    const float* q;
    const float* raw;
    const float* comp;
    const int* selected;
    const float* sinks;
    float* out;
    float* scores;
    const float* rope;
    i8* xq;
    float* xd;
    float* maxes;
    float* sums;
    float* parts;
    u32 head_dim;
    u32 window;
    u32 raw_cap;
    u32 ratio;
    u32 comp_cap;
    u32 top_k;
    u32 max_rows;
    float kq_scale;
    u32 n_rot;
    u32 n_head;
};
__device__ __forceinline__ void ds4_row(AttentionScoresArgs& a, const RowStrides& R, u32 y) {
    a.q = (const float*)((u64)a.q + (u64)R.s[0] * y);
    a.raw = (const float*)((u64)a.raw + (u64)R.s[1] * y);
    a.comp = (const float*)((u64)a.comp + (u64)R.s[2] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[3] * y);
    a.sinks = (const float*)((u64)a.sinks + (u64)R.s[4] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[5] * y);
    a.scores = (float*)((u64)a.scores + (u64)R.s[6] * y);
    a.rope = (const float*)((u64)a.rope + (u64)R.s[7] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[8] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[9] * y);
    a.maxes = (float*)((u64)a.maxes + (u64)R.s[10] * y);
    a.sums = (float*)((u64)a.sums + (u64)R.s[11] * y);
    a.parts = (float*)((u64)a.parts + (u64)R.s[12] * y);
}
// The arguments of `attention_partial`.
struct AttentionPartialArgs {
    const float* q;
    const float* raw;
    const float* comp;
    const int* selected;
    const float* sinks;
    float* out;
    float* scores;
    const float* rope;
    i8* xq;
    float* xd;
    float* maxes;
    float* sums;
    float* parts;
    u32 head_dim;
    u32 window;
    u32 raw_cap;
    u32 ratio;
    u32 comp_cap;
    u32 top_k;
    u32 max_rows;
    float kq_scale;
    u32 n_rot;
    u32 n_head;
};
__device__ __forceinline__ void ds4_row(AttentionPartialArgs& a, const RowStrides& R, u32 y) {
    a.q = (const float*)((u64)a.q + (u64)R.s[0] * y);
    a.raw = (const float*)((u64)a.raw + (u64)R.s[1] * y);
    a.comp = (const float*)((u64)a.comp + (u64)R.s[2] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[3] * y);
    a.sinks = (const float*)((u64)a.sinks + (u64)R.s[4] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[5] * y);
    a.scores = (float*)((u64)a.scores + (u64)R.s[6] * y);
    a.rope = (const float*)((u64)a.rope + (u64)R.s[7] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[8] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[9] * y);
    a.maxes = (float*)((u64)a.maxes + (u64)R.s[10] * y);
    a.sums = (float*)((u64)a.sums + (u64)R.s[11] * y);
    a.parts = (float*)((u64)a.parts + (u64)R.s[12] * y);
}
// The arguments of `attention_combine`.
struct AttentionCombineArgs {
    const float* q;
    const float* raw;
    const float* comp;
    const int* selected;
    const float* sinks;
    float* out;
    float* scores;
    const float* rope;
    i8* xq;
    float* xd;
    float* maxes;
    float* sums;
    float* parts;
    u32 head_dim;
    u32 window;
    u32 raw_cap;
    u32 ratio;
    u32 comp_cap;
    u32 top_k;
    u32 max_rows;
    float kq_scale;
    u32 n_rot;
    u32 n_head;
};
__device__ __forceinline__ void ds4_row(AttentionCombineArgs& a, const RowStrides& R, u32 y) {
    a.q = (const float*)((u64)a.q + (u64)R.s[0] * y);
    a.raw = (const float*)((u64)a.raw + (u64)R.s[1] * y);
    a.comp = (const float*)((u64)a.comp + (u64)R.s[2] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[3] * y);
    a.sinks = (const float*)((u64)a.sinks + (u64)R.s[4] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[5] * y);
    a.scores = (float*)((u64)a.scores + (u64)R.s[6] * y);
    a.rope = (const float*)((u64)a.rope + (u64)R.s[7] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[8] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[9] * y);
    a.maxes = (float*)((u64)a.maxes + (u64)R.s[10] * y);
    a.sums = (float*)((u64)a.sums + (u64)R.s[11] * y);
    a.parts = (float*)((u64)a.parts + (u64)R.s[12] * y);
}
// The arguments of `router_select`.
struct RouterSelectArgs {
    const float* logits;
    const float* bias;
    const int* hash;
    int* selected;
    float* weights;
    u32 n_expert;
    u32 n_used;
    u32 n_vocab;
    float scale;
};
__device__ __forceinline__ void ds4_row(RouterSelectArgs& a, const RowStrides& R, u32 y) {
    a.logits = (const float*)((u64)a.logits + (u64)R.s[0] * y);
    a.bias = (const float*)((u64)a.bias + (u64)R.s[1] * y);
    a.hash = (const int*)((u64)a.hash + (u64)R.s[2] * y);
    a.selected = (int*)((u64)a.selected + (u64)R.s[3] * y);
    a.weights = (float*)((u64)a.weights + (u64)R.s[4] * y);
}
// The arguments of `quantize_q8_k`.
struct QuantizeQ8KArgs {
    const float* x;
    BlockQ8K* out;
};
__device__ __forceinline__ void ds4_row(QuantizeQ8KArgs& a, const RowStrides& R, u32 y) {
    a.x = (const float*)((u64)a.x + (u64)R.s[0] * y);
    a.out = (BlockQ8K*)((u64)a.out + (u64)R.s[1] * y);
}
// The arguments of `moe_gate_up`.
struct MoeGateUpArgs {
    const BlockQ8K* xq;
    const int* selected;
    const float* weights;
    const u64* gate;
    const u64* up;
    float* mid;
    const u64* grid;
    BlockQ8K* midq;
    u32* tickets;
    u32 gate_ty;
    u32 up_ty;
    u32 in_dim;
    u32 ff;
    u32 n_used;
    u32 n_expert;
    float clamp;
    u32 ticket;
};
__device__ __forceinline__ void ds4_row(MoeGateUpArgs& a, const RowStrides& R, u32 y) {
    a.xq = (const BlockQ8K*)((u64)a.xq + (u64)R.s[0] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[1] * y);
    a.weights = (const float*)((u64)a.weights + (u64)R.s[2] * y);
    a.gate = (const u64*)((u64)a.gate + (u64)R.s[3] * y);
    a.up = (const u64*)((u64)a.up + (u64)R.s[4] * y);
    a.mid = (float*)((u64)a.mid + (u64)R.s[5] * y);
    a.grid = (const u64*)((u64)a.grid + (u64)R.s[6] * y);
    a.midq = (BlockQ8K*)((u64)a.midq + (u64)R.s[7] * y);
    a.tickets = (u32*)((u64)a.tickets + (u64)R.s[8] * y);
}
// The arguments of `moe_down`.
struct MoeDownArgs {
    const BlockQ8K* midq;
    const int* selected;
    const u64* down;
    float* out;
    const u64* grid;
    u32 down_ty;
    u32 ff;
    u32 out_dim;
    u32 n_used;
    u32 n_expert;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(MoeDownArgs& a, const RowStrides& R, u32 y) {
    a.midq = (const BlockQ8K*)((u64)a.midq + (u64)R.s[0] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[1] * y);
    a.down = (const u64*)((u64)a.down + (u64)R.s[2] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[3] * y);
    a.grid = (const u64*)((u64)a.grid + (u64)R.s[4] * y);
}
// The arguments of `moe_route`.
struct MoeRouteArgs {
    const int* selected;
    u32* route;
    u32 n_expert;
    u32 n_used;
    u32 rows;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(MoeRouteArgs& a, const RowStrides& R, u32 y) {
    a.selected = (const int*)((u64)a.selected + (u64)R.s[0] * y);
    a.route = (u32*)((u64)a.route + (u64)R.s[1] * y);
}
// The arguments of `moe_gate_up_grouped`.
struct MoeGateUpGroupedArgs {
    const BlockQ8K* xq;
    const int* selected;
    const float* weights;
    const u64* gate;
    const u64* up;
    float* mid;
    const u64* grid;
    const u32* route;
    u32 gate_ty;
    u32 in_dim;
    u32 ff;
    u32 n_used;
    u32 n_expert;
    float clamp;
};
__device__ __forceinline__ void ds4_row(MoeGateUpGroupedArgs& a, const RowStrides& R, u32 y) {
    a.xq = (const BlockQ8K*)((u64)a.xq + (u64)R.s[0] * y);
    a.selected = (const int*)((u64)a.selected + (u64)R.s[1] * y);
    a.weights = (const float*)((u64)a.weights + (u64)R.s[2] * y);
    a.gate = (const u64*)((u64)a.gate + (u64)R.s[3] * y);
    a.up = (const u64*)((u64)a.up + (u64)R.s[4] * y);
    a.mid = (float*)((u64)a.mid + (u64)R.s[5] * y);
    a.grid = (const u64*)((u64)a.grid + (u64)R.s[6] * y);
    a.route = (const u32*)((u64)a.route + (u64)R.s[7] * y);
}
// The arguments of `moe_down_grouped`.
struct MoeDownGroupedArgs {
    const BlockQ8K* midq;
    const u64* down;
    float* parts;
    const u64* grid;
    const u32* route;
    u32 down_ty;
    u32 ff;
    u32 out_dim;
    u32 n_used;
    u32 n_expert;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(MoeDownGroupedArgs& a, const RowStrides& R, u32 y) {
    a.midq = (const BlockQ8K*)((u64)a.midq + (u64)R.s[0] * y);
    a.down = (const u64*)((u64)a.down + (u64)R.s[1] * y);
    a.parts = (float*)((u64)a.parts + (u64)R.s[2] * y);
    a.grid = (const u64*)((u64)a.grid + (u64)R.s[3] * y);
    a.route = (const u32*)((u64)a.route + (u64)R.s[4] * y);
}
// The arguments of `moe_sum_slots`.
struct MoeSumSlotsArgs {
    const float* parts;
    float* out;
    u32 out_dim;
    u32 n_used;
};
__device__ __forceinline__ void ds4_row(MoeSumSlotsArgs& a, const RowStrides& R, u32 y) {
    a.parts = (const float*)((u64)a.parts + (u64)R.s[0] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[1] * y);
}
// The arguments of `expert_cache_plan`.
struct ExpertCachePlanArgs {
    const int* selected;
    int* state;
    u64* stats;
    u64* gate_table;
    u64* up_table;
    u64* down_table;
    const u64* gate_home;
    const u64* up_home;
    const u64* down_home;
    u8* slots;
    u64 slot_bytes;
    u32 gate_qs;
    u32 gate_rest;
    u32 up_qs;
    u32 up_rest;
    u32 down_qs;
    u32 down_rest;
    u32 n_expert;
    u32 n_used;
};
__device__ __forceinline__ void ds4_row(ExpertCachePlanArgs& a, const RowStrides& R, u32 y) {
    a.selected = (const int*)((u64)a.selected + (u64)R.s[0] * y);
    a.state = (int*)((u64)a.state + (u64)R.s[1] * y);
    a.stats = (u64*)((u64)a.stats + (u64)R.s[2] * y);
    a.gate_table = (u64*)((u64)a.gate_table + (u64)R.s[3] * y);
    a.up_table = (u64*)((u64)a.up_table + (u64)R.s[4] * y);
    a.down_table = (u64*)((u64)a.down_table + (u64)R.s[5] * y);
    a.gate_home = (const u64*)((u64)a.gate_home + (u64)R.s[6] * y);
    a.up_home = (const u64*)((u64)a.up_home + (u64)R.s[7] * y);
    a.down_home = (const u64*)((u64)a.down_home + (u64)R.s[8] * y);
    a.slots = (u8*)((u64)a.slots + (u64)R.s[9] * y);
}
// The arguments of `expert_cache_copy`.
struct ExpertCacheCopyArgs {
    const int* state;
};
__device__ __forceinline__ void ds4_row(ExpertCacheCopyArgs& a, const RowStrides& R, u32 y) {
    a.state = (const int*)((u64)a.state + (u64)R.s[0] * y);
}
// The arguments of `swiglu`.
struct SwiGluArgs {
    const float* gate;
    const float* up;
    float* out;
    i8* xq;
    float* xd;
    u32 n;
    float clamp;
};
__device__ __forceinline__ void ds4_row(SwiGluArgs& a, const RowStrides& R, u32 y) {
    a.gate = (const float*)((u64)a.gate + (u64)R.s[0] * y);
    a.up = (const float*)((u64)a.up + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[3] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[4] * y);
}
// The arguments of `add`.
struct AddArgs {
    const float* a;
    const float* b;
    float* out;
    u32 n;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(AddArgs& a, const RowStrides& R, u32 y) {
    a.a = (const float*)((u64)a.a + (u64)R.s[0] * y);
    a.b = (const float*)((u64)a.b + (u64)R.s[1] * y);
    a.out = (float*)((u64)a.out + (u64)R.s[2] * y);
}
// The arguments of `qkv_finish`.
struct QkvFinishArgs {
    float* q;
    const float* kv_raw;
    const float* kv_norm;
    float* kv;
    float* cache;
    const float* table;
    u32 n_head;
    u32 head_dim;
    u32 n_rot;
    u32 raw_cap;
    float eps_q;
    float eps_kv;
};
__device__ __forceinline__ void ds4_row(QkvFinishArgs& a, const RowStrides& R, u32 y) {
    a.q = (float*)((u64)a.q + (u64)R.s[0] * y);
    a.kv_raw = (const float*)((u64)a.kv_raw + (u64)R.s[1] * y);
    a.kv_norm = (const float*)((u64)a.kv_norm + (u64)R.s[2] * y);
    a.kv = (float*)((u64)a.kv + (u64)R.s[3] * y);
    a.cache = (float*)((u64)a.cache + (u64)R.s[4] * y);
    a.table = (const float*)((u64)a.table + (u64)R.s[5] * y);
}
// The arguments of `compressor_update`.
struct CompressorUpdateArgs {
    const float* kv;
    const float* score;
    const void* ape;
    float* state_kv;
    float* state_score;
    float* pooled;
    const float* norm_w;
    float* row;
    const float* table;
    float* cache;
    u32* tickets;
    u64 emit_cond;
    u32 ape_f16;
    u32 width;
    u32 ratio;
    u32 head_dim;
    u32 n_rot;
    u32 quant;
    float eps;
    u32 ticket;
};
__device__ __forceinline__ void ds4_row(CompressorUpdateArgs& a, const RowStrides& R, u32 y) {
    a.kv = (const float*)((u64)a.kv + (u64)R.s[0] * y);
    a.score = (const float*)((u64)a.score + (u64)R.s[1] * y);
    a.ape = (const void*)((u64)a.ape + (u64)R.s[2] * y);
    a.state_kv = (float*)((u64)a.state_kv + (u64)R.s[3] * y);
    a.state_score = (float*)((u64)a.state_score + (u64)R.s[4] * y);
    a.pooled = (float*)((u64)a.pooled + (u64)R.s[5] * y);
    a.norm_w = (const float*)((u64)a.norm_w + (u64)R.s[6] * y);
    a.row = (float*)((u64)a.row + (u64)R.s[7] * y);
    a.table = (const float*)((u64)a.table + (u64)R.s[8] * y);
    a.cache = (float*)((u64)a.cache + (u64)R.s[9] * y);
    a.tickets = (u32*)((u64)a.tickets + (u64)R.s[10] * y);
}
// The arguments of `hc_pre`.
struct HcPreArgs {
    const float* x;
    const u16* fn_w;
    float* partial;
    u32* tickets;
    float* flat;
    float* mix;
    const float* scale;
    const float* base;
    float* split;
    float* cur;
    const float* norm_w;
    float* norm;
    i8* xq;
    float* xd;
    BlockQ8K* xk;
    const float* ss;
    u32 hc_dim;
    u32 mix_rows;
    u32 n_chunks;
    u32 ticket;
    u32 n_embd;
    u32 iters;
    float eps_flat;
    float eps_hc;
    float eps_norm;
    u32 blocks_pre;
};
__device__ __forceinline__ void ds4_row(HcPreArgs& a, const RowStrides& R, u32 y) {
    a.x = (const float*)((u64)a.x + (u64)R.s[0] * y);
    a.fn_w = (const u16*)((u64)a.fn_w + (u64)R.s[1] * y);
    a.partial = (float*)((u64)a.partial + (u64)R.s[2] * y);
    a.tickets = (u32*)((u64)a.tickets + (u64)R.s[3] * y);
    a.flat = (float*)((u64)a.flat + (u64)R.s[4] * y);
    a.mix = (float*)((u64)a.mix + (u64)R.s[5] * y);
    a.scale = (const float*)((u64)a.scale + (u64)R.s[6] * y);
    a.base = (const float*)((u64)a.base + (u64)R.s[7] * y);
    a.split = (float*)((u64)a.split + (u64)R.s[8] * y);
    a.cur = (float*)((u64)a.cur + (u64)R.s[9] * y);
    a.norm_w = (const float*)((u64)a.norm_w + (u64)R.s[10] * y);
    a.norm = (float*)((u64)a.norm + (u64)R.s[11] * y);
    a.xq = (i8*)((u64)a.xq + (u64)R.s[12] * y);
    a.xd = (float*)((u64)a.xd + (u64)R.s[13] * y);
    a.xk = (BlockQ8K*)((u64)a.xk + (u64)R.s[14] * y);
    a.ss = (const float*)((u64)a.ss + (u64)R.s[15] * y);
}
// The arguments of `synth_fill`.
struct SynthFillArgs {
    u8* out;
    u64 state;
    u64 n;
    u32 ty;
    u32 kind;
    float a;
    float center;
    float spread;
    u32 d;
    u32 dmin;
    u32 n_expert;
    u32 n_used;
    u32 repack;
};
__device__ __forceinline__ void ds4_row(SynthFillArgs& a, const RowStrides& R, u32 y) {
    a.out = (u8*)((u64)a.out + (u64)R.s[0] * y);
}
// The arguments of `fill`.
struct FillArgs {
    u32* x;
    u64 n;
    u32 v;
    u32 _pad;
};
__device__ __forceinline__ void ds4_row(FillArgs& a, const RowStrides& R, u32 y) {
    a.x = (u32*)((u64)a.x + (u64)R.s[0] * y);
}
// The arguments of `sample_token`.
struct SampleTokenArgs {
    const float* logits;
    u32* out;
    u32 n;
    u32 top_k;
    float temperature;
    float top_p;
    float min_p;
    float r;
};
__device__ __forceinline__ void ds4_row(SampleTokenArgs& a, const RowStrides& R, u32 y) {
    a.logits = (const float*)((u64)a.logits + (u64)R.s[0] * y);
    a.out = (u32*)((u64)a.out + (u64)R.s[1] * y);
}

// Shared by every kernel file: predicates, f16 conversion, the canonical reductions, exp and
// log1p. Compiled at run time by NVRTC (no CUDA headers needed). `StepParams`, each kernel's
// argument struct and the numerics constants are generated from the Rust definitions and
// prepended to this file (backends/cuda/args.rs, src/numerics.rs).


// A predicate packed by the host: kind (2 bits) | ratio (16 bits) << 2 | top_k (32 bits) << 18,
// and bit 63 on a chunk program's launches: a row past the chunk's tokens (count 0) runs nothing.
// kind 0: always; 1: a compressed row is emitted; 2: the indexer is active.
__device__ __forceinline__ bool ds4_cond(const StepParams* P, u64 cond) {
    const u32 kind = (u32)(cond & 3);
    const u32 ratio = (u32)((cond >> 2) & 0xffff);
    const u32 top_k = (u32)(cond >> 18);
#if DS4_CHUNK_ROWS
    if ((cond >> 63) && P->count == 0) return false;
#endif
    if (kind == 0) return true;
    if (kind == 1) return (P->pos + 1) % ratio == 0;
    return (P->pos + 1) / ratio > top_k;
}

// Programmatic dependent launch (sm_90 on): the host may start a kernel while the one before it
// finishes. Each kernel first waits until its predecessor has completed and its writes are
// visible (a no-op when launched without it), then lets its own successor start launching.
// Waiting before any memory access keeps completion transitive along the stream.
__device__ __forceinline__ void ds4_wait_predecessor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Every kernel starts with these parameters and one of the guards below, so a predicated op is
// a launch that returns at once: the launch list (and a captured graph) never changes. In the
// chunk build (DS4_CHUNK_ROWS 1) a launch covers its rows as blockIdx.y: the guard moves P and
// the pointers of `a` to the row. The decode build ignores R and has no per-row code.
#define DS4_ARGS const StepParams* __restrict__ P, u64 cond, const RowStrides R
#if DS4_CHUNK_ROWS
#define DS4_ROW                         \
    if (blockIdx.y) {                   \
        P += blockIdx.y;                \
        ds4_row(a, R, blockIdx.y);      \
    }
#else
#define DS4_ROW
#endif
#define DS4_GUARD                \
    DS4_ROW                      \
    ds4_wait_predecessor();      \
    if (!ds4_cond(P, cond)) return
// For kernels that load their weights before waiting (weights never change during a token; the
// step parameters are written before the token starts): the predicate first, then the weight
// loads, then ds4_wait_predecessor() before reading anything an earlier kernel writes.
#define DS4_GUARD_EARLY              \
    DS4_ROW                          \
    if (!ds4_cond(P, cond)) {        \
        ds4_wait_predecessor();      \
        return;                      \
    }

// Visible rows, as `recorder::Bound` computes them.
__device__ __forceinline__ u32 ds4_raw_rows(const StepParams* P, u32 window, u32 cap) {
    return min(min(P->pos + 1, window), cap);
}
__device__ __forceinline__ u32 ds4_comp_rows(const StepParams* P, u32 ratio, u32 cap) {
    return ratio == 0 ? 0 : min((P->pos + 1) / ratio, cap);
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }

// Reads element i of an F32 (is_f16 == 0) or F16 (is_f16 == 1) weight.
__device__ __forceinline__ float wload(const void* w, u32 is_f16, u64 i) {
    return is_f16 ? h2f(((const u16*)w)[i]) : ((const float*)w)[i];
}

// The canonical butterfly (numerics::tree32): for o = 16, 8, 4, 2, 1 each lane adds lane ^ o.
// Every lane ends with the same value.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The lane of leaf i when one thread adds 32 lane values in warp_sum's tree: fed in this
// (bit-reversed) order and merged pairwise as they come, each level's pairs meet as in warp_sum.
__device__ __forceinline__ constexpr u32 bit_reverse5(u32 i) {
    return ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
}
__device__ __forceinline__ constexpr u32 bit_reverse3(u32 i) { return ((i & 1) << 2) | (i & 2) | ((i & 4) >> 2); }
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Warp-wide (value, index) maximum; on equal values the lower index wins. Every lane gets it.
__device__ __forceinline__ void warp_argmax(float* v, int* idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, *idx, o);
        if (ov > *v || (ov == *v && oi < *idx)) {
            *v = ov;
            *idx = oi;
        }
    }
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = part[0];
    for (int i = 1; i < nw; i++) t = fmaxf(t, part[i]);
    return t;
}

// Lane sum of one 512-term chunk of an f32 dot (4 consecutive terms per lane step), from +0.
// `n` is the number of terms left from `a`/`b` (a multiple of 4). Adds in the canonical order.
__device__ __forceinline__ float chunk_dot_f32(const float* a, const float* b, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = u * 128 + lane * 4;
        if (i < n) {
            const float4 x = *(const float4*)(a + i), y = *(const float4*)(b + i);
            acc += x.x * y.x;
            acc += x.y * y.y;
            acc += x.z * y.z;
            acc += x.w * y.w;
        }
    }
    return acc;
}

// The canonical f32 dot of two n-vectors (n a multiple of 4, 16-byte aligned) by one warp.
// Every lane gets the result.
__device__ __forceinline__ float warp_dot_f32(const float* a, const float* b, u32 n, u32 lane) {
    float total = 0.0f;
    for (u32 c = 0; c < n; c += DS4_CHUNK) total += warp_sum(chunk_dot_f32(a + c, b + c, n - c, lane));
    return total;
}

// The canonical exp (numerics::exp): Cody-Waite reduction, degree-7 Taylor polynomial by
// Horner, two exact power-of-two scalings; results below 2^-126 flush to zero. With --fmad=false
// every operation rounds separately, as on the CPU.
__device__ __forceinline__ float ds4_pow2i(int k) { return __int_as_float((k + 127) << 23); }
__device__ __forceinline__ float ds4_expf(float x) {
    if (x != x) return x;
    if (x > DS4_EXP_MAX) return __int_as_float(0x7f800000);
    if (x < DS4_EXP_MIN) return 0.0f;
    const float k = rintf(x * DS4_LOG2_E);
    const float r = (x - k * DS4_LN2_HI) - k * DS4_LN2_LO;
    float p = DS4_EXP_C7;
    p = p * r + DS4_EXP_C6;
    p = p * r + DS4_EXP_C5;
    p = p * r + DS4_EXP_C4;
    p = p * r + DS4_EXP_C3;
    p = p * r + DS4_EXP_C2;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int ki = (int)k;
    const int k1 = ki / 2;
    const float y = p * ds4_pow2i(k1) * ds4_pow2i(ki - k1);
    return y < __int_as_float(0x00800000) ? 0.0f : y;
}

// The canonical log1p (numerics::ln_1p).
__device__ __forceinline__ float ds4_log1pf(float x) {
    if (x != x || x < -1.0f) return __int_as_float(0x7fc00000);
    if (x == -1.0f) return __int_as_float(0xff800000);
    if (x == __int_as_float(0x7f800000)) return x;
    if (fabsf(x) < 2.44140625e-4f) {
        const float x2 = x * x;
        return (x - x2 * 0.5f) + (x2 * x) * DS4_LN_THIRD;
    }
    const float u = 1.0f + x;
    const float c = u < 16777216.0f ? (x - (u - 1.0f)) / u : 0.0f;
    const u32 bits = __float_as_uint(u);
    int j = (int)((bits >> 23) & 0xff) - 127;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (m > DS4_SQRT2) {
        m *= 0.5f;
        j += 1;
    }
    const float f = m - 1.0f;
    const float hfsq = 0.5f * f * f;
    const float s = f / (2.0f + f);
    const float z = s * s;
    float p = DS4_LN_P5;
    p = p * z + DS4_LN_P4;
    p = p * z + DS4_LN_P3;
    p = p * z + DS4_LN_P2;
    p = p * z + DS4_LN_P1;
    const float r = z * p;
    const float jf = (float)j;
    return jf * DS4_LN2_HI - ((hfsq - (s * (hfsq + r) + (jf * DS4_LN2_LO + c))) - f);
}

// The smallest power of two >= t, for positive normal t (numerics::pow2_ceil).
__device__ __forceinline__ float ds4_pow2_ceil(float t) {
    const u32 b = __float_as_uint(t);
    return (b & 0x007fffffu) == 0 ? t : __uint_as_float((b & 0x7f800000u) + 0x00800000u);
}

__device__ __forceinline__ float sigmoid_stable(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + ds4_expf(-x));
    const float e = ds4_expf(x);
    return e / (1.0f + e);
}
__device__ __forceinline__ float silu(float x) { return x * sigmoid_stable(x); }

// SwiGLU with ds4's clamp: gate only from above, up both ways.
__device__ __forceinline__ float swiglu_clamped(float g, float u, float clamp) {
    if (clamp > 1.0e-6f) {
        g = fminf(g, clamp);
        u = fminf(fmaxf(u, -clamp), clamp);
    }
    return silu(g) * u;
}

// RmsNorm in the canonical order: warp w of a block sums the chunks w, w + warps, ... (512 terms
// each, 4 per lane step) and the chunk sums add in order, whatever the block size.
// mean = ss / n, scale = 1 / sqrt(mean + eps), out = (x * scale) * w.
#define NORM_MAX_CHUNKS 64

// The scale of a row of n, computed by the whole block (every thread must call it). It returns
// after every thread has read the scale, so the caller may overwrite `x` (in place) at once.
__device__ float rms_scale_block(const float* x, u32 n, float eps) {
    __shared__ float chunk_sums[NORM_MAX_CHUNKS];
    __shared__ float scale_sh;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 n_chunks = (n + DS4_CHUNK - 1) / DS4_CHUNK;
    for (u32 c = warp; c < n_chunks; c += nw) {
        const float* xc = x + c * DS4_CHUNK;
        const float s = warp_sum(chunk_dot_f32(xc, xc, n - c * DS4_CHUNK, lane));
        if (lane == 0) chunk_sums[c] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float ss = 0.0f;
        for (u32 c = 0; c < n_chunks; c++) ss += chunk_sums[c];
        scale_sh = 1.0f / sqrtf(ss / (float)n + eps);
    }
    __syncthreads();
    const float scale = scale_sh;
    __syncthreads();
    return scale;
}

// Q8_0 of one 32-block by one warp (lane i holds value i): d = amax/127,
// q = round-half-even(v * (1/d)), as ds4.
__device__ __forceinline__ void quantize_q8_0_warp(float v, i8* xq, float* xd, u32 blk, u32 lane) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    xq[blk * 32 + lane] = (i8)max(-128, min(127, (int)rintf(v * id)));
    if (lane == 0) xd[blk] = d;
}

// A row is split over `slices` blocks (n / slices outputs each, a multiple of 32); each sums the
// whole row. `out` may alias `x` only with one slice. With `xq`, the output is also quantized to
// Q8_0 per 32, exactly as quantize_q8_0 would (a warp per block).
extern "C" __global__ void rms_norm(DS4_ARGS, RmsNormArgs a) {
    DS4_GUARD;
    const u32 n = a.n, row = blockIdx.x / a.slices, slice = blockIdx.x % a.slices;
    const float* xr = a.x + (u64)row * n;
    float* orow = a.out + (u64)row * n;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float scale = rms_scale_block(xr, n, a.eps);
    const u32 per = n / a.slices, begin = slice * per, end = begin + per;
    if (a.xq) {
        for (u32 blk = begin / 32 + warp; blk < end / 32; blk += nw) {
            const u32 i = blk * 32 + lane;
            const float v = xr[i] * scale;
            const float o = a.w ? v * a.w[i] : v;
            orow[i] = o;
            quantize_q8_0_warp(o, a.xq, a.xd, blk, lane);
        }
        return;
    }
    for (u32 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float v = xr[i] * scale;
        orow[i] = a.w ? v * a.w[i] : v;
    }
}

// MatVec and MatVecGrouped: dense F16 / F32 / Q8_0 weights, every row in the canonical order
// (src/numerics.rs): chunks of 512 terms (F16: 8 per lane step, F32: 4) or 32 blocks (Q8_0: one
// block per lane), each chunk reduced by the butterfly, chunk sums added in order from +0.
// Rows of group g read x[g*in_dim ..]. One warp per row; narrow matrices split the row's chunks
// over warps (split-K); the last block adds the chunk sums in order, which gives the same bits.

// One warp per 32-block (kernels/norm.cu: quantize_q8_0_warp).
extern "C" __global__ void quantize_q8_0(DS4_ARGS, QuantizeQ80Args a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31;
    const u32 b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b * 32 >= a.n) return;
    quantize_q8_0_warp(a.x[b * 32 + lane], a.xq, a.xd, b, lane);
}

// Block b's term: (f16(d_w) * d_x) * isum, the integer dot exact.
__device__ __forceinline__ float q8_0_term(int4 w0, int4 w1, u16 ws, const int4* x4, const float* dx, u32 b) {
    const int4 x0 = x4[2 * b], x1 = x4[2 * b + 1];
    int isum = 0;
    isum = __dp4a(w0.x, x0.x, isum);
    isum = __dp4a(w0.y, x0.y, isum);
    isum = __dp4a(w0.z, x0.z, isum);
    isum = __dp4a(w0.w, x0.w, isum);
    isum = __dp4a(w1.x, x1.x, isum);
    isum = __dp4a(w1.y, x1.y, isum);
    isum = __dp4a(w1.z, x1.z, isum);
    isum = __dp4a(w1.w, x1.w, isum);
    return h2f(ws) * dx[b] * (float)isum;
}

// Loads block b of row r of a Q8_0 matrix of `rows` rows and nb blocks per row. Split layout
// (gpu_tables.rs: BLOCK_SPLITS): all quants (32 bytes per block), then all f16 scales; a lane
// reads a block as two 16-byte loads. Native layout (DS4_NATIVE_BLOCKS: GGUF's 34-byte blocks,
// read in place from the file): a scale then 32 quants, only 2-byte aligned, so 17 loads of 2.
__device__ __forceinline__ void q8_0_load(const u8* w, u32 rows, u32 nb, u32 r, u32 b, int4* w0, int4* w1, u16* s) {
#if DS4_NATIVE_BLOCKS
    const u16* blk = (const u16*)(w + ((u64)r * nb + b) * 34);
    u32 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = (u32)__ldg(blk + 1 + 2 * i) | ((u32)__ldg(blk + 2 + 2 * i) << 16);
    *w0 = make_int4((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
    *w1 = make_int4((int)v[4], (int)v[5], (int)v[6], (int)v[7]);
    *s = __ldg(blk);
#else
    const int4* wq = (const int4*)(w + (u64)r * nb * 32);
    *w0 = __ldg(wq + 2 * b);
    *w1 = __ldg(wq + 2 * b + 1);
    *s = __ldg((const u16*)(w + (u64)rows * nb * 32) + (u64)r * nb + b);
#endif
}

// Chunks whose weights a lane loads before waiting for the previous kernel.
#define Q8_EARLY_CHUNKS 4

// With `rows2` > 0 a second matrix of the same width (`w2`, `out2`) follows the first in the
// same launch, reading the same input (both ungrouped): two ops, one launch.
#if DS4_CHUNK_ROWS
// The chunk build: a warp computes its matrix row for Q8_TOKEN_ROWS token rows of the chunk,
// loading each weight block once for all of them. blockIdx.x picks the token rows and blockIdx.y
// the matrix rows, so the blocks that read the same weights are scheduled side by side and all
// but the first find them in L2 (with the token rows along y, each group of blocks streamed the
// whole matrix from DRAM again). Each token row's
// sum is the decode kernel's: per chunk a lane's one term from +0, the butterfly, chunk sums
// added in order from +0. Rows past the chunk's tokens (and rows whose predicate is false) are
// neither read nor written.
extern "C" __global__ void mat_vec_q8_0(DS4_ARGS, MatVecQ80Args a) {
    const u32 y0 = blockIdx.x * Q8_TOKEN_ROWS;
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < Q8_TOKEN_ROWS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    ds4_wait_predecessor();
    const u32 lane = threadIdx.x & 31;
    const u32 rr = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr, rows = second ? a.rows2 : a.rows;
    if (!active || r >= rows) return;
    const u8* w = second ? a.w2 : a.w;
    const u32 out_stride = second ? R.s[5] : R.s[3];
    const u32 nb = a.in_dim / 32;
    const u32 g = second ? 0 : r / a.rows_per_group;
    float total[Q8_TOKEN_ROWS];
#pragma unroll
    for (u32 t = 0; t < Q8_TOKEN_ROWS; t++) total[t] = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        const u32 b = c + lane;
        int4 q0 = make_int4(0, 0, 0, 0), q1 = q0;
        u16 sc = 0;
        if (b < nb) q8_0_load(w, rows, nb, r, b, &q0, &q1, &sc);
#pragma unroll
        for (u32 t = 0; t < Q8_TOKEN_ROWS; t++) {
            if (!((active >> t) & 1)) continue;
            const u64 y = y0 + t;
            const int4* x4 = (const int4*)(a.xq + y * R.s[1] + (u64)g * a.in_dim);
            const float* dx = (const float*)((const u8*)a.xd + y * R.s[2]) + (u64)g * nb;
            float acc = 0.0f;
            if (b < nb) acc += q8_0_term(q0, q1, sc, x4, dx, b);
            total[t] += warp_sum(acc);
        }
    }
    if (lane != 0) return;
    float* out = second ? a.out2 : a.out;
#pragma unroll
    for (u32 t = 0; t < Q8_TOKEN_ROWS; t++)
        if ((active >> t) & 1) ((float*)((u8*)out + (u64)(y0 + t) * out_stride))[r] = total[t];
}

#if !DS4_NATIVE_BLOCKS
// The chunk build's Q8_0 matrix product on tensor cores (split block layout only). A warp computes
// 16 matrix rows for Q8_MMA_TOKENS token rows; each weight block is one k = 32 step of an int8
// m16n8k32 MMA per 8 token rows, so the block's integer dot is exact, as __dp4a's is. A lane's
// 8 bytes of a block (words 2 tq and 2 tq + 1) feed both A and B: the MMA's k order inside a block
// does not change an integer sum. Each (row, token) then gets the decode kernel's float terms and
// order: term (f16(d_w) * d_x) * isum added to +0, per 32-block chunk the butterfly's tree (fed
// leaf by leaf in bit-reversed block order, so each level's pairs meet as in warp_sum), chunk sums
// added in order from +0. Token rows past the chunk's tokens (or predicated off) read the first
// active row's data and are not written.
#ifndef Q8_MMA_TOKENS
#define Q8_MMA_TOKENS 16
#endif
#define Q8_MMA_TILES (Q8_MMA_TOKENS / 8)
static_assert(DS4_BLOCK_CHUNK == 32, "the bit-reversed leaf order is 5 bits");

// Token row t of the tile, or the first active one when t is not active.
__device__ __forceinline__ u32 mma_token(u32 active, u32 first, u32 t) { return ((active >> t) & 1) ? t : first; }

#define Q8_MMA_WARPS 4
// A token row's staged quants: 32 blocks of 32 bytes, then 32 bytes of padding so that the 8 token
// rows of one fragment load fall in different banks.
#define Q8_MMA_XS_ROW (32 * 32 + 32)
// 1.5 * 2^23: an MMA started at this bit pattern returns 0x4B400000 + dot, which read as a float
// is 1.5 * 2^23 + dot exactly (|dot| <= 32 * 128 * 127 < 2^22); subtracting 1.5 * 2^23 gives
// (float)dot exactly with one add instead of a conversion.
#define Q8_MMA_BIAS 0x4B400000
#define Q8_MMA_BIAS_F 12582912.0f

// D = bias + A (16 x 32: rows gq and gq + 8 of the warp's 16) * B (32 x 8: token column gq).
__device__ __forceinline__ void mma_s8_m16n8k32(int* d, uint2 wa, uint2 wb, uint2 x) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(wa.x), "r"(wb.x), "r"(wa.y), "r"(wb.y), "r"(x.x), "r"(x.y), "r"(Q8_MMA_BIAS));
}

// A block of 4 warps covers 64 matrix rows (16 per warp) and Q8_MMA_TOKENS token rows. Per chunk
// of 32 weight blocks, the block stages the token rows' quants and scales and its rows' weight
// scales in shared memory (coalesced loads); the weight quants stream from global memory.
extern "C" __global__ void __launch_bounds__(128) mat_mul_q8_0(DS4_ARGS, MatVecQ80Args a) {
    __shared__ __align__(16) u8 xs[Q8_MMA_TOKENS * Q8_MMA_XS_ROW];
    __shared__ float dxs[Q8_MMA_TOKENS][33];
    __shared__ float wss[Q8_MMA_WARPS * 16][33];
    const u32 y0 = blockIdx.x * Q8_MMA_TOKENS;
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < Q8_MMA_TOKENS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    ds4_wait_predecessor();
    if (!active) return;
    const u32 lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3, warp = threadIdx.x >> 5;
    const u32 rr = (blockIdx.y * Q8_MMA_WARPS + warp) * 16;
    const bool second = rr >= a.rows;
    const u32 r0 = second ? rr - a.rows : rr, rows = second ? a.rows2 : a.rows;
    const bool live = r0 < rows;
    const u8* w = second ? a.w2 : a.w;
    const u32 nb = a.in_dim / 32;
    // The host gives a grouped matrix groups of a multiple of 64 rows (and no second matrix), so
    // one group's input serves the whole block.
    const u32 row0 = blockIdx.y * Q8_MMA_WARPS * 16;
    const u32 g = row0 < a.rows ? row0 / a.rows_per_group : 0;
    const u32 first = __ffs(active) - 1;
    const u8* wq_a = w + (u64)(r0 + gq) * nb * 32 + tq * 8;
    const u8* wq_b = wq_a + (u64)8 * nb * 32;
    const u16* ws = (const u16*)(w + (u64)rows * nb * 32) + (u64)r0 * nb;
    // total[j][k]: k = 0, 1: row r0 + gq, tokens 8 j + 2 tq (+1); k = 2, 3: row r0 + gq + 8.
    float total[Q8_MMA_TILES][4];
#pragma unroll
    for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
        for (u32 k = 0; k < 4; k++) total[j][k] = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        const u32 nblk = min((u32)DS4_BLOCK_CHUNK, nb - c);
        __syncthreads();
        for (u32 i = threadIdx.x; i < Q8_MMA_TOKENS * 64; i += blockDim.x) {
            const u32 t = i / 64, q = i % 64;
            if (q < nblk * 2) {
                const u64 y = y0 + mma_token(active, first, t);
                const i8* x = a.xq + y * R.s[1] + (u64)g * a.in_dim + (u64)c * 32;
                *(uint4*)(xs + t * Q8_MMA_XS_ROW + q * 16) = *(const uint4*)(x + q * 16);
            }
        }
        for (u32 i = threadIdx.x; i < Q8_MMA_TOKENS * 32; i += blockDim.x) {
            const u32 t = i / 32, k = i % 32;
            if (k < nblk) {
                const u64 y = y0 + mma_token(active, first, t);
                dxs[t][k] = ((const float*)((const u8*)a.xd + y * R.s[2]))[(u64)g * nb + c + k];
            }
        }
        if (live)
            for (u32 r = 0; r < 16; r++)
                if (lane < nblk) wss[warp * 16 + r][lane] = h2f(__ldg(ws + (u64)r * nb + c + lane));
        __syncthreads();
        if (!live) continue;
        float pend[5][Q8_MMA_TILES][4];
#pragma unroll
        for (u32 i = 0; i < DS4_BLOCK_CHUNK; i++) {
            const u32 bi = bit_reverse5(i), b = c + bi;
            float v[Q8_MMA_TILES][4];
            if (b < nb) {
                const uint2 qa = __ldg((const uint2*)(wq_a + (u64)b * 32));
                const uint2 qb = __ldg((const uint2*)(wq_b + (u64)b * 32));
                const float sa = wss[warp * 16 + gq][bi], sb = wss[warp * 16 + gq + 8][bi];
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++) {
                    int d[4];
                    mma_s8_m16n8k32(d, qa, qb, *(const uint2*)(xs + (8 * j + gq) * Q8_MMA_XS_ROW + bi * 32 + tq * 8));
                    const float d0 = dxs[8 * j + 2 * tq][bi], d1 = dxs[8 * j + 2 * tq + 1][bi];
                    v[j][0] = 0.0f + sa * d0 * (__int_as_float(d[0]) - Q8_MMA_BIAS_F);
                    v[j][1] = 0.0f + sa * d1 * (__int_as_float(d[1]) - Q8_MMA_BIAS_F);
                    v[j][2] = 0.0f + sb * d0 * (__int_as_float(d[2]) - Q8_MMA_BIAS_F);
                    v[j][3] = 0.0f + sb * d1 * (__int_as_float(d[3]) - Q8_MMA_BIAS_F);
                }
            } else {
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) v[j][k] = 0.0f;
            }
            // Leaf i of the bit-reversed order closes level l when bit l of i is set.
#pragma unroll
            for (u32 l = 0; l < 5; l++) {
                if (!((i >> l) & 1)) {
#pragma unroll
                    for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                        for (u32 k = 0; k < 4; k++) pend[l][j][k] = v[j][k];
                    break;
                }
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) v[j][k] = pend[l][j][k] + v[j][k];
            }
            if (i == DS4_BLOCK_CHUNK - 1) {
#pragma unroll
                for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) total[j][k] += v[j][k];
            }
        }
    }
    if (!live) return;
    float* out = second ? a.out2 : a.out;
    const u32 out_stride = second ? R.s[5] : R.s[3];
#pragma unroll
    for (u32 j = 0; j < Q8_MMA_TILES; j++)
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            const u32 t = 8 * j + 2 * tq + (k & 1);
            if ((active >> t) & 1)
                ((float*)((u8*)out + (u64)(y0 + t) * out_stride))[r0 + gq + (k >> 1) * 8] = total[j][k];
        }
}

// The chunk's Q8_0 product in big tiles (split block layout only; DS4_CUDA_Q8_TILE=0 keeps
// mat_mul_q8_0 above): a block of Q8T_WM x Q8T_WN warps covers Q8T_BM = 64 matrix rows and
// Q8T_BN token rows, a warp 16 matrix rows x Q8T_NT tiles of 8 token rows, so each A fragment
// (the weights) feeds Q8T_NT MMAs and each weight load from L2 serves Q8T_BN token rows. The
// terms and the float order are mat_mul_q8_0's (the decode kernel's): per (row, token, block)
// (f16(d_w) * d_x) * isum, per 32-block chunk the butterfly's tree fed leaf by leaf in
// bit-reversed block order, chunk sums added in order from +0. The leaf's "0.0f +" is left out:
// a tree's sum feeds only `total`, which starts from +0, so only a zero's sign could differ and
// that add absorbs it (kernels/README.md, the proven freedom).
//
// A chunk of 32 blocks runs as 4 steps of 8; leaf i = 8 s + u of the tree (block bit_reverse5(i))
// is block 4 bit_reverse3(u) + bit_reverse2(s), so step s stages the chunk's blocks = s' (mod 4),
// s' = bit_reverse2(s), 8 per row, and its leaves come in slot order bit_reverse3(u). The steps'
// quants are copied by cp.async into two buffers (the copies of step k + 1 run during the math of
// step k); a chunk's scales are read into registers during step 1 of the chunk before and stored
// converted and reordered during step 2 (two buffers by chunk parity), so each lane reads its
// scale pairs with one 8- or 16-byte load.
#ifndef Q8T_NT
#define Q8T_NT 4
#endif
#ifndef Q8T_WN
#define Q8T_WN 4
#endif
// Blocks per SM the registers are capped for (launch bounds): 1 for the 512-thread shape; the
// 256-thread shape of 64 x 32 (Q8T_NT 2, Q8T_WN 2, DS4_CUDA_Q8_TILE=new) asks for 2, which its
// ~91 KB of shared memory allows, so one block's barriers and prologue overlap the other's math.
#ifndef Q8T_MIN_BLOCKS
#define Q8T_MIN_BLOCKS 1
#endif
#define Q8T_WM 4
#define Q8T_BM (16 * Q8T_WM)
#define Q8T_BN (8 * Q8T_NT * Q8T_WN)
#define Q8T_THREADS (32 * Q8T_WM * Q8T_WN)
// A staged row (a weight row or a token row): 8 blocks of 32 bytes, then 16 bytes of padding so
// that the 8 rows of one ldmatrix matrix (16 bytes each) fall in different banks.
#define Q8T_ROW 272
#define Q8T_QBUF ((Q8T_BM + Q8T_BN) * Q8T_ROW)
// Dynamic shared memory (backends/cuda/mod.rs: q8_tile_smem computes the same size): quants
// [2][BM + BN][ROW]; weight scales [2][32][BM] floats, rows 16 w + g and 16 w + g + 8 side by side;
// token scales [2][32][BN] floats, a lane's 2 Q8T_NT tokens side by side; each thread's 4 Q8T_NT
// chunk totals [4 Q8T_NT][THREADS], then as many first-half sums of the chunk's tree (kept here,
// not in registers, which the tree's other pending sums fill); the active token bits.
#define Q8T_WS_OFF (2 * Q8T_QBUF)
#define Q8T_DX_OFF (Q8T_WS_OFF + 2 * 32 * Q8T_BM * 4)
#define Q8T_TOT_OFF (Q8T_DX_OFF + 2 * 32 * Q8T_BN * 4)
#define Q8T_HALF_OFF (Q8T_TOT_OFF + 4 * Q8T_NT * Q8T_THREADS * 4)
#define Q8T_ACT_OFF (Q8T_HALF_OFF + 4 * Q8T_NT * Q8T_THREADS * 4)
#define Q8T_SMEM (Q8T_ACT_OFF + Q8T_BN / 8)
// Threads per staged weight row and per staged token row (each copies BPW or BPX = 8 / that of
// the step's 8 blocks, and 32 / that of the chunk's 32 scales).
#define Q8T_TPW (Q8T_THREADS / Q8T_BM)
#define Q8T_TPX (Q8T_THREADS / Q8T_BN)
#define Q8T_BPW (8 / Q8T_TPW)
#define Q8T_BPX (8 / Q8T_TPX)
static_assert(Q8T_THREADS % Q8T_BM == 0 && 8 % Q8T_TPW == 0, "whole blocks of a weight row per thread");
static_assert(Q8T_THREADS % Q8T_BN == 0 && 8 % Q8T_TPX == 0, "whole blocks of a token row per thread");
static_assert(Q8T_BN % 32 == 0 && Q8T_BN <= Q8T_THREADS, "a warp's ballot per 32 token rows");
static_assert(Q8T_NT % 2 == 0, "B fragments by pairs of token tiles");

__device__ __forceinline__ constexpr u32 bit_reverse2(u32 s) { return ((s & 1) << 1) | ((s & 2) >> 1); }

// 16 bytes from global to shared memory without passing through registers; cp_async_wait waits
// for all of this thread's copies.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Four 8 x 8 matrices of b16 from shared memory (lanes 8 q .. 8 q + 7 give matrix q's row
// addresses); register q of lane l holds 4 bytes (l % 4) of row l / 4 of matrix q. Volatile so
// that it stays between the barriers around it.
__device__ __forceinline__ void ldmatrix_x4(u32* d, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"((u32)__cvta_generic_to_shared(p)));
}
// D = D + A * B for int8 m16n8k32 fragments (A: 4 registers, B: 2), D started at the bias.
__device__ __forceinline__ void mma_s8_k32_acc(int* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Where a token (0..BN) of the tile keeps its scales: the lane that holds it (t) next to the
// lane's other tokens, 2 per tile j.
__device__ __forceinline__ u32 q8t_token_slot(u32 tok) {
    const u32 wn = tok / (8 * Q8T_NT), rem = tok % (8 * Q8T_NT);
    const u32 j = rem / 8, t = (rem % 8) / 2, k = rem % 2;
    return wn * 8 * Q8T_NT + t * 2 * Q8T_NT + 2 * j + k;
}
// Where a weight row (0..BM) of the tile keeps its scales: rows g and g + 8 of a warp's 16 together.
__device__ __forceinline__ u32 q8t_row_slot(u32 r) { return (r / 16) * 16 + 2 * (r % 8) + (r % 16) / 8; }

// One step (8 blocks) of a warp's 16 x 8 Q8T_NT tile: the MMAs, the terms, the tree's leaves
// 8 s .. 8 s + 7. The fragments come by ldmatrix, in the natural k order of a block (A: rows g,
// g + 8, bytes 4 t.. and 16 + 4 t..; B: token g, the same bytes), so each A fragment lands in
// the MMA's four registers as loaded. `qa`: this lane's ldmatrix row address for A (row
// l % 8 + 8 ((l / 8) & 1), byte 16 (l / 16)); `qb`: for B, a pair of token tiles (token row
// l % 8 of tile l / 16, byte 16 ((l / 8) & 1)). A block past the row's end was staged as zero
// token quants and +0 scales, so its term is (+0 * +0) * +0 = +0, the leaf mat_mul_q8_0 feeds.
template <u32 S>
__device__ __forceinline__ void q8t_step(const u8* qa, const u8* qb, const float* wsp, const float* dxp,
                                         float (&pend)[4][Q8T_NT][4], float* half, float* total) {
#pragma unroll
    for (u32 u = 0; u < 8; u++) {
        const u32 i = 8 * S + u, m = bit_reverse3(u), kb = 4 * m + bit_reverse2(S);
        float v[Q8T_NT][4];
        u32 fa[4];
        ldmatrix_x4(fa, qa + m * 32);
        const float2 sw = *(const float2*)(wsp + kb * Q8T_BM);
        float dd[2 * Q8T_NT];
#pragma unroll
        for (u32 h = 0; h < Q8T_NT / 2; h++) {
            const float4 q = *(const float4*)(dxp + kb * Q8T_BN + 4 * h);
            dd[4 * h] = q.x;
            dd[4 * h + 1] = q.y;
            dd[4 * h + 2] = q.z;
            dd[4 * h + 3] = q.w;
        }
#pragma unroll
        for (u32 h = 0; h < Q8T_NT / 2; h++) {
            u32 fb[4];
            ldmatrix_x4(fb, qb + 16 * h * Q8T_ROW + m * 32);
#pragma unroll
            for (u32 jj = 0; jj < 2; jj++) {
                const u32 j = 2 * h + jj;
                int d[4] = {Q8_MMA_BIAS, Q8_MMA_BIAS, Q8_MMA_BIAS, Q8_MMA_BIAS};
                mma_s8_k32_acc(d, fa, fb + 2 * jj);
                v[j][0] = sw.x * dd[2 * j] * (__int_as_float(d[0]) - Q8_MMA_BIAS_F);
                v[j][1] = sw.x * dd[2 * j + 1] * (__int_as_float(d[1]) - Q8_MMA_BIAS_F);
                v[j][2] = sw.y * dd[2 * j] * (__int_as_float(d[2]) - Q8_MMA_BIAS_F);
                v[j][3] = sw.y * dd[2 * j + 1] * (__int_as_float(d[3]) - Q8_MMA_BIAS_F);
            }
        }
        // Leaf i of the bit-reversed order closes level l when bit l of i is set. Level 4 (the
        // first half's sum, held from leaf 15 to leaf 31) waits in shared memory.
#pragma unroll
        for (u32 l = 0; l < 5; l++) {
            if (!((i >> l) & 1)) {
#pragma unroll
                for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
                    for (u32 k = 0; k < 4; k++) {
                        if (l < 4) pend[l][j][k] = v[j][k];
                        else half[(4 * j + k) * Q8T_THREADS] = v[j][k];
                    }
                break;
            }
#pragma unroll
            for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
                for (u32 k = 0; k < 4; k++) v[j][k] = (l < 4 ? pend[l][j][k] : half[(4 * j + k) * Q8T_THREADS]) + v[j][k];
        }
        if (i == 31) {
#pragma unroll
            for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
                for (u32 k = 0; k < 4; k++) total[(4 * j + k) * Q8T_THREADS] += v[j][k];
        }
    }
}

extern "C" __global__ void __launch_bounds__(Q8T_THREADS, Q8T_MIN_BLOCKS) mat_mul_q8_0_tile(DS4_ARGS, MatVecQ80Args a) {
    extern __shared__ __align__(16) u8 q8t_smem[];
    float* const wss = (float*)(q8t_smem + Q8T_WS_OFF);
    float* const dxs = (float*)(q8t_smem + Q8T_DX_OFF);
    u32* const act = (u32*)(q8t_smem + Q8T_ACT_OFF);
#if __CUDA_ARCH__
    // The host sizes the dynamic shared memory (mod.rs: q8_tile_smem); a smaller one is a bug.
    u32 smem_bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
    if (smem_bytes < Q8T_SMEM) __trap();
#endif
    const u32 tid = threadIdx.x, lane = tid & 31, gq = lane >> 2, tq = lane & 3, warp = tid >> 5;
    const u32 wm = warp % Q8T_WM, wn = warp / Q8T_WM;
    const u32 y0 = blockIdx.x * Q8T_BN;
    // The tile's token rows that run (count 0 past the chunk's tokens, or a false predicate).
    if (tid < Q8T_BN) {
        const u32 bits = __ballot_sync(0xffffffffu, ds4_cond(P + y0 + tid, cond));
        if (lane == 0) act[warp] = bits;
    }
    __syncthreads();
    u32 first = Q8T_BN;
#pragma unroll
    for (u32 w = Q8T_BN / 32; w-- > 0;)
        if (act[w]) first = 32 * w + __ffs(act[w]) - 1;
    if (first == Q8T_BN) {
        ds4_wait_predecessor();
        return;
    }
    const u32 nb = a.in_dim / 32;
    const u32 row0 = blockIdx.y * Q8T_BM;
    // The host gives a grouped matrix groups of a multiple of 64 rows (and no second matrix), so
    // one group's input serves the whole block.
    const u32 grp = row0 < a.rows ? row0 / a.rows_per_group : 0;

    // This thread's staged weight row (its quants and scales) and token row.
    const u32 wrow = tid / Q8T_TPW, wpart = tid % Q8T_TPW;
    const u32 wrr = row0 + wrow;
    const bool wsecond = wrr >= a.rows;
    const u32 wr = wsecond ? wrr - a.rows : wrr, wrows = wsecond ? a.rows2 : a.rows;
    const bool wlive = wr < wrows;
    const u8* const wmat = wsecond ? a.w2 : a.w;
    const u8* const wq_row = wmat + (u64)wr * nb * 32;
    const u16* const ws_row = (const u16*)(wmat + (u64)wrows * nb * 32) + (u64)wr * nb;
    const u32 xtok = tid / Q8T_TPX, xpart = tid % Q8T_TPX;
    const u32 xt = ((act[xtok / 32] >> (xtok % 32)) & 1) ? xtok : first;
    const u64 xy = y0 + xt;
    const i8* const xq_row = a.xq + xy * R.s[1] + (u64)grp * a.in_dim;
    const float* const xd_row = (const float*)((const u8*)a.xd + xy * R.s[2]) + (u64)grp * nb;

    // Step s of the chunk at block c into buffer `buf`: this thread's slots wm0 .. wm0 + BPW of
    // its weight row and xm0 .. xm0 + BPX of its token row, both 16-byte halves of each (slot m
    // holds block c + 4 m + s'; blocks past the row's end are not read: zero token quants).
    const u32 wm0 = Q8T_BPW * wpart, xm0 = Q8T_BPX * xpart;
    const u8* const wsrc = wq_row + 128 * wm0;
    const i8* const xsrc = xq_row + 128 * xm0;
    u8* const wdst = q8t_smem + wrow * Q8T_ROW + 32 * wm0;
    u8* const xdst = q8t_smem + (Q8T_BM + xtok) * Q8T_ROW + 32 * xm0;
    auto stage_weights = [&](u32 c, u32 s, u32 buf) {
        const u32 bq = c + bit_reverse2(s);
#pragma unroll
        for (u32 k = 0; k < Q8T_BPW; k++)
#pragma unroll
            for (u32 h = 0; h < 2; h++)
                if (wlive && bq + 4 * (wm0 + k) < nb)
                    cp_async16(wdst + buf * Q8T_QBUF + 32 * k + 16 * h, wsrc + (u64)bq * 32 + 128 * k + 16 * h);
    };
    auto stage_tokens = [&](u32 c, u32 s, u32 buf) {
        const u32 bq = c + bit_reverse2(s);
#pragma unroll
        for (u32 k = 0; k < Q8T_BPX; k++)
#pragma unroll
            for (u32 h = 0; h < 2; h++) {
                u8* dst = xdst + buf * Q8T_QBUF + 32 * k + 16 * h;
                if (bq + 4 * (xm0 + k) < nb) cp_async16(dst, xsrc + (u64)bq * 32 + 128 * k + 16 * h);
                else *(uint4*)dst = make_uint4(0, 0, 0, 0);
            }
    };
    // A chunk's scales: this thread's 32 / TPX token scales go by 4-byte copies straight to
    // their slots in the chunk's buffer; its 32 / TPW weight scales are read into registers,
    // then stored there as floats (missing blocks are not read: +0 in their place).
    auto stage_token_scales = [&](u32 c, u32 cbuf) {
#pragma unroll
        for (u32 k = 0; k < 32 / Q8T_TPX; k++) {
            const u32 kb = xpart * (32 / Q8T_TPX) + k;
            float* dst = dxs + (cbuf * 32 + kb) * Q8T_BN + q8t_token_slot(xtok);
            if (c + kb < nb) cp_async4(dst, xd_row + c + kb);
            else *dst = 0.0f;
        }
    };
    u16 wsr[32 / Q8T_TPW];
    auto load_weight_scales = [&](u32 c) {
#pragma unroll
        for (u32 k = 0; k < 32 / Q8T_TPW; k++) {
            const u32 b = c + wpart * (32 / Q8T_TPW) + k;
            wsr[k] = wlive && b < nb ? __ldg(ws_row + b) : (u16)0;
        }
    };
    auto store_weight_scales = [&](u32 cbuf) {
#pragma unroll
        for (u32 k = 0; k < 32 / Q8T_TPW; k++)
            wss[(cbuf * 32 + wpart * (32 / Q8T_TPW) + k) * Q8T_BM + q8t_row_slot(wrow)] = h2f(wsr[k]);
    };

    // Weights never change during a token: their first step is copied before waiting.
    stage_weights(0, 0, 0);
    ds4_wait_predecessor();
    stage_tokens(0, 0, 0);
    stage_token_scales(0, 0);
    load_weight_scales(0);
    store_weight_scales(0);

    // This warp's 16 matrix rows (all in one matrix: the host gives both multiples of 16).
    const u32 rr = row0 + 16 * wm;
    const bool second = rr >= a.rows;
    const u32 r0 = second ? rr - a.rows : rr;
    const bool live = r0 < (second ? a.rows2 : a.rows);
    const u8* const qa0 = q8t_smem + (16 * wm + lane % 8 + 8 * ((lane / 8) & 1)) * Q8T_ROW + 16 * (lane / 16);
    const u8* const qb0 = q8t_smem + (Q8T_BM + 8 * Q8T_NT * wn + 8 * (lane / 16) + lane % 8) * Q8T_ROW + 16 * ((lane / 8) & 1);
    const float* const ws0 = wss + 16 * wm + 2 * gq;
    const float* const dx0 = dxs + 8 * Q8T_NT * wn + 2 * Q8T_NT * tq;
    // total[(4 j + k) THREADS]: k = 0, 1: row r0 + gq, tokens 8 j + 2 tq (+1) of the warp's;
    // k = 2, 3: row r0 + gq + 8.
    float* const total = (float*)(q8t_smem + Q8T_TOT_OFF) + tid;
    float* const half = (float*)(q8t_smem + Q8T_HALF_OFF) + tid;
    float pend[4][Q8T_NT][4];
#pragma unroll
    for (u32 k = 0; k < 4 * Q8T_NT; k++) total[k * Q8T_THREADS] = 0.0f;

    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        const u32 cbuf = (c / DS4_BLOCK_CHUNK) & 1;
        const bool more = c + DS4_BLOCK_CHUNK < nb;
        const float* const wsp = ws0 + cbuf * 32 * Q8T_BM;
        const float* const dxp = dx0 + cbuf * 32 * Q8T_BN;
#define Q8T_STEP(S)                                                                          \
    {                                                                                        \
        cp_async_wait();                                                                     \
        __syncthreads();                                                                     \
        if (S < 3) {                                                                         \
            stage_weights(c, (S + 1) & 3, (S + 1) & 1);                                      \
            stage_tokens(c, (S + 1) & 3, (S + 1) & 1);                                       \
        } else if (more) {                                                                   \
            stage_weights(c + DS4_BLOCK_CHUNK, 0, 0);                                        \
            stage_tokens(c + DS4_BLOCK_CHUNK, 0, 0);                                         \
        }                                                                                    \
        if (S == 1 && more) {                                                                \
            stage_token_scales(c + DS4_BLOCK_CHUNK, cbuf ^ 1);                               \
            load_weight_scales(c + DS4_BLOCK_CHUNK);                                         \
        }                                                                                    \
        if (S == 2 && more) store_weight_scales(cbuf ^ 1);                                   \
        if (live) q8t_step<S>(qa0 + (S & 1) * Q8T_QBUF, qb0 + (S & 1) * Q8T_QBUF, wsp, dxp, pend, half, total); \
    }
        Q8T_STEP(0)
        Q8T_STEP(1)
        Q8T_STEP(2)
        Q8T_STEP(3)
#undef Q8T_STEP
    }
    if (!live) return;
    float* out = second ? a.out2 : a.out;
    const u32 out_stride = second ? R.s[5] : R.s[3];
#pragma unroll
    for (u32 j = 0; j < Q8T_NT; j++)
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            const u32 t = 8 * Q8T_NT * wn + 8 * j + 2 * tq + (k & 1);
            if ((act[t / 32] >> (t % 32)) & 1)
                ((float*)((u8*)out + (u64)(y0 + t) * out_stride))[r0 + gq + (k >> 1) * 8] = total[(4 * j + k) * Q8T_THREADS];
        }
}
#endif
#else
extern "C" __global__ void mat_vec_q8_0(DS4_ARGS, MatVecQ80Args a) {
    DS4_GUARD_EARLY;
    const u32 lane = threadIdx.x & 31;
    const u32 rr = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr, rows = second ? a.rows2 : a.rows;
    const u8* w = second ? a.w2 : a.w;
    float* out = second ? a.out2 : a.out;
    const bool live = r < rows;
    const u32 nb = a.in_dim / 32;
    int4 w0[Q8_EARLY_CHUNKS], w1[Q8_EARLY_CHUNKS];
    u16 s[Q8_EARLY_CHUNKS];
#pragma unroll
    for (u32 u = 0; u < Q8_EARLY_CHUNKS; u++) {
        const u32 b = u * DS4_BLOCK_CHUNK + lane;
        if (live && b < nb) q8_0_load(w, rows, nb, r, b, &w0[u], &w1[u], &s[u]);
    }
    ds4_wait_predecessor();
    if (!live) return;
    const u32 g = second ? 0 : r / a.rows_per_group;
    const int4* x4 = (const int4*)(a.xq + (u64)g * a.in_dim);
    const float* dx = a.xd + (u64)g * nb;
    float total = 0.0f;
#pragma unroll
    for (u32 u = 0; u < Q8_EARLY_CHUNKS; u++) {
        const u32 c = u * DS4_BLOCK_CHUNK;
        if (c < nb) {
            float acc = 0.0f;
            if (c + lane < nb) acc += q8_0_term(w0[u], w1[u], s[u], x4, dx, c + lane);
            total += warp_sum(acc);
        }
    }
    for (u32 c = Q8_EARLY_CHUNKS * DS4_BLOCK_CHUNK; c < nb; c += DS4_BLOCK_CHUNK) {
        float acc = 0.0f;
        const u32 b = c + lane;
        if (b < nb) {
            int4 q0, q1;
            u16 sc;
            q8_0_load(w, rows, nb, r, b, &q0, &q1, &sc);
            acc += q8_0_term(q0, q1, sc, x4, dx, b);
        }
        total += warp_sum(acc);
    }
    if (lane == 0) out[r] = total;
}
#endif

// The 16 halves a lane reads of one 512-term chunk of an F16 row (8 consecutive per lane step);
// `n` is the number of terms left (a multiple of 8). Lanes past the row's end read nothing.
struct F16Chunk {
    uint4 q[2];
};
__device__ __forceinline__ F16Chunk load_chunk_f16(const u16* w, u32 n, u32 lane) {
    F16Chunk c;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        c.q[u] = i < n ? __ldg((const uint4*)(w + i)) : make_uint4(0, 0, 0, 0);
    }
    return c;
}

// Lane sum of one chunk from its loaded halves, from +0, in the canonical order.
__device__ __forceinline__ float chunk_dot_f16(const F16Chunk& c, const float* x, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const uint4 q = c.q[u];
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += h2f((u16)(q.x & 0xffff)) * p.x;
            acc += h2f((u16)(q.x >> 16)) * p.y;
            acc += h2f((u16)(q.y & 0xffff)) * p.z;
            acc += h2f((u16)(q.y >> 16)) * p.w;
            acc += h2f((u16)(q.z & 0xffff)) * s.x;
            acc += h2f((u16)(q.z >> 16)) * s.y;
            acc += h2f((u16)(q.w & 0xffff)) * s.z;
            acc += h2f((u16)(q.w >> 16)) * s.w;
        }
    }
    return acc;
}

#define F16_EARLY_CHUNKS 2

// One warp per row, all chunks.
extern "C" __global__ void mat_vec_f16(DS4_ARGS, MatVecF16Args a) {
    DS4_GUARD_EARLY;
    const u32 lane = threadIdx.x & 31;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool live = r < a.rows;
    const u16* row = a.w + (u64)r * a.in_dim;
    F16Chunk early[F16_EARLY_CHUNKS];
#pragma unroll
    for (u32 u = 0; u < F16_EARLY_CHUNKS; u++) {
        const u32 c = u * DS4_CHUNK;
        if (live && c < a.in_dim) early[u] = load_chunk_f16(row + c, a.in_dim - c, lane);
    }
    ds4_wait_predecessor();
    if (!live) return;
    const float* xg = a.x + (u64)(r / a.rows_per_group) * a.in_dim;
    float total = 0.0f;
#pragma unroll
    for (u32 u = 0; u < F16_EARLY_CHUNKS; u++) {
        const u32 c = u * DS4_CHUNK;
        if (c < a.in_dim) total += warp_sum(chunk_dot_f16(early[u], xg + c, a.in_dim - c, lane));
    }
    for (u32 c = F16_EARLY_CHUNKS * DS4_CHUNK; c < a.in_dim; c += DS4_CHUNK)
        total += warp_sum(chunk_dot_f16(load_chunk_f16(row + c, a.in_dim - c, lane), xg + c, a.in_dim - c, lane));
    if (lane == 0) a.out[r] = total;
}

// Split-K: one warp per (row, chunk); partial[r * n_chunks + c] is the chunk's sum. The last
// block to finish (a ticket counter, reset by that block for the next launch) adds each row's
// chunk sums in order from +0: the same bits as one warp doing the whole row. With `rows2` > 0 a
// second matrix of the same width (`w2`, `out2`, ungrouped) follows as rows `rows..`.
extern "C" __global__ void mat_vec_f16_split(DS4_ARGS, MatVecF16SplitArgs a) {
    DS4_GUARD_EARLY;
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 all_rows = a.rows + a.rows2;
    const bool live = wid < all_rows * a.n_chunks;
    const u32 rr = live ? wid / a.n_chunks : 0, c = live ? (wid % a.n_chunks) * DS4_CHUNK : 0;
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr;
    const u16* row = (second ? a.w2 : a.w) + (u64)r * a.in_dim;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(row + c, a.in_dim - c, lane);
    ds4_wait_predecessor();
    if (live) {
        const float* xg = a.x + (second ? 0 : (u64)(r / a.rows_per_group) * a.in_dim);
        const float s = warp_sum(chunk_dot_f16(chunk, xg + c, a.in_dim - c, lane));
        if (lane == 0) a.partial[wid] = s;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (u32 r = threadIdx.x; r < all_rows; r += blockDim.x) {
        float total = 0.0f;
        for (u32 c = 0; c < a.n_chunks; c++) total += __ldcg(a.partial + (u64)r * a.n_chunks + c);
        if (r < a.rows) a.out[r] = total;
        else a.out2[r - a.rows] = total;
    }
    if (threadIdx.x == 0) a.tickets[a.ticket] = 0;
}

#if DS4_CHUNK_ROWS
// The chunk build's F16 products for F16_TOKENS token rows (blockIdx.y's group) from one load of
// each weight chunk: the same warps, terms and sums as the per-row kernels above, so the same bits.
#define F16_TOKENS 8

// The 16 weights a lane holds of a chunk, as floats (converted once for every token row).
struct F16ChunkF {
    float w[16];
};
__device__ __forceinline__ F16ChunkF f16_chunk_floats(const F16Chunk& c) {
    F16ChunkF f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const uint4 q = c.q[u];
        const u32 h[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (u32 k = 0; k < 4; k++) {
            f.w[8 * u + 2 * k] = h2f((u16)(h[k] & 0xffff));
            f.w[8 * u + 2 * k + 1] = h2f((u16)(h[k] >> 16));
        }
    }
    return f;
}
// chunk_dot_f16's lane sum from the converted weights: the same products in the same order.
__device__ __forceinline__ float chunk_dot_f16f(const F16ChunkF& c, const float* x, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += c.w[8 * u] * p.x;
            acc += c.w[8 * u + 1] * p.y;
            acc += c.w[8 * u + 2] * p.z;
            acc += c.w[8 * u + 3] * p.w;
            acc += c.w[8 * u + 4] * s.x;
            acc += c.w[8 * u + 5] * s.y;
            acc += c.w[8 * u + 6] * s.z;
            acc += c.w[8 * u + 7] * s.w;
        }
    }
    return acc;
}

// Which of the group's token rows run (count 0 past the chunk's tokens, or a false predicate).
__device__ __forceinline__ u32 f16_active_tokens(const StepParams* P, u64 cond, u32 y0) {
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < F16_TOKENS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    return active;
}

#define ROW_PTR(T, p, k, y) ((T*)((u8*)(p) + (u64)(y) * R.s[k]))

// mat_vec_f16 for a group of token rows: a warp per matrix row, all chunks.
extern "C" __global__ void mat_mul_f16(DS4_ARGS, MatVecF16Args a) {
    const u32 y0 = blockIdx.y * F16_TOKENS;
    const u32 active = f16_active_tokens(P, cond, y0);
    ds4_wait_predecessor();
    const u32 lane = threadIdx.x & 31;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (!active || r >= a.rows) return;
    const u16* row = a.w + (u64)r * a.in_dim;
    const u64 xoff = (u64)(r / a.rows_per_group) * a.in_dim;
    float total[F16_TOKENS];
#pragma unroll
    for (u32 t = 0; t < F16_TOKENS; t++) total[t] = 0.0f;
    for (u32 c = 0; c < a.in_dim; c += DS4_CHUNK) {
        const F16ChunkF wf = f16_chunk_floats(load_chunk_f16(row + c, a.in_dim - c, lane));
#pragma unroll
        for (u32 t = 0; t < F16_TOKENS; t++)
            if ((active >> t) & 1) {
                const float* xg = ROW_PTR(const float, a.x, 1, y0 + t) + xoff;
                total[t] += warp_sum(chunk_dot_f16f(wf, xg + c, a.in_dim - c, lane));
            }
    }
    if (lane == 0)
#pragma unroll
        for (u32 t = 0; t < F16_TOKENS; t++)
            if ((active >> t) & 1) ROW_PTR(float, a.out, 2, y0 + t)[r] = total[t];
}

// mat_vec_f16_split for a group of token rows: a warp per (matrix row, chunk) writes each token
// row's chunk sum to that row's partials; the group's last block (the ticket of its first token
// row) adds each (token row, matrix row)'s chunk sums in order from +0.
extern "C" __global__ void mat_mul_f16_split(DS4_ARGS, MatVecF16SplitArgs a) {
    __shared__ bool last;
    const u32 y0 = blockIdx.y * F16_TOKENS;
    const u32 active = f16_active_tokens(P, cond, y0);
    const u32 lane = threadIdx.x & 31;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 all_rows = a.rows + a.rows2;
    const bool live = active && wid < all_rows * a.n_chunks;
    const u32 rr = live ? wid / a.n_chunks : 0, c = live ? (wid % a.n_chunks) * DS4_CHUNK : 0;
    const bool second = rr >= a.rows;
    const u32 r = second ? rr - a.rows : rr;
    const u16* row = (second ? a.w2 : a.w) + (u64)r * a.in_dim;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(row + c, a.in_dim - c, lane);
    ds4_wait_predecessor();
    if (!active) return;  // the whole group's blocks: none takes the ticket
    if (live) {
        const F16ChunkF wf = f16_chunk_floats(chunk);
        const u64 xoff = second ? 0 : (u64)(r / a.rows_per_group) * a.in_dim;
#pragma unroll
        for (u32 t = 0; t < F16_TOKENS; t++)
            if ((active >> t) & 1) {
                const float* xg = ROW_PTR(const float, a.x, 1, y0 + t) + xoff;
                const float s = warp_sum(chunk_dot_f16f(wf, xg + c, a.in_dim - c, lane));
                if (lane == 0) ROW_PTR(float, a.partial, 2, y0 + t)[wid] = s;
            }
    }
    __threadfence();
    __syncthreads();
    u32* ticket = ROW_PTR(u32, a.tickets, 3, y0) + a.ticket;
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (u32 i = threadIdx.x; i < F16_TOKENS * all_rows; i += blockDim.x) {
        const u32 t = i / all_rows, rw = i % all_rows;
        if (!((active >> t) & 1)) continue;
        const float* part = ROW_PTR(const float, a.partial, 2, y0 + t) + (u64)rw * a.n_chunks;
        float total = 0.0f;
        for (u32 k = 0; k < a.n_chunks; k++) total += __ldcg(part + k);
        if (rw < a.rows) ROW_PTR(float, a.out, 4, y0 + t)[rw] = total;
        else ROW_PTR(float, a.out2, 6, y0 + t)[rw - a.rows] = total;
    }
    if (threadIdx.x == 0) *ticket = 0;
}
#undef ROW_PTR

// The chunk build's F16 products as register tiles (mat_mul_f16_tile, mat_mul_f16_split_tile and
// hc_pre_mix): a block of 256 threads takes F16T_ROWS matrix rows x F16T_TOKENS token rows, a
// thread F16T_TR x F16T_TT of them (rows ty + 16 i, tokens tx + 16 j), so each staged weight
// feeds F16T_TOKENS token rows and each staged input F16T_ROWS matrix rows. Every output is the
// per-row kernels' sum: per 512-term chunk the 32 lane sums (lane l: its 16 products of terms
// 256 u + 8 l + k, in that order, from +0), merged in warp_sum's tree by one thread (leaves in
// bit-reversed order), the chunk sums added in order from +0.
//
// A chunk is staged in eighths: leaves 4e .. 4e + 3 of the bit-reversed order are lanes
// bitrev3(e) + 8 bitrev2(m), m = 0..3, so eighth e holds those 4 lanes' 64 terms and closes a
// 4-leaf subtree; the eighths' subtrees merge as a binary counter (p2, p3, p4). Terms past in_dim
// are staged as +0 (weight and input), so their products are +0: they can change only the sign
// of a zero lane sum, which the chunk sums' +0 start absorbs. The first product of a lane sum
// skips the add to +0 (the same argument: only the sign of a zero can differ).
//
// gridDim.x is (matrix-row tiles) x (K splits): with K splits > 1 each block takes a run of
// chunks, writes their sums to `partial`, and the tile's last block (a ticket per tile: tile t
// uses the ticket word of token row t) adds every chunk sum in order from +0.
#ifndef F16T_TR
#define F16T_TR 4
#endif
#ifndef F16T_TT
#define F16T_TT 2
#endif
#define F16T_ROWS (16 * F16T_TR)
#define F16T_TOKENS (16 * F16T_TT)
// Floats per staged row: 64 terms and 4 more, so that 8 consecutive rows start in 8 bank groups.
#define F16T_PITCH 68

struct F16Tile {
    const u16* w;   // matrix rows 0 .. rows
    const u16* w2;  // matrix rows rows .. rows + rows2
    const float* x;  // token row y at byte y * x_stride
    float* out;
    float* out2;
    float* partial;
    u32* tickets;
    u32 x_stride, out_stride, out2_stride, partial_stride, tickets_stride;
    u32 rows, rows2, in_dim, ticket;
};


__device__ __forceinline__ void f16_tile(const StepParams* P, u64 cond, const F16Tile& j) {
    static_assert(F16T_TR % 2 == 0 && F16T_TT % 2 == 0, "a thread stages TR / 2 weight and TT / 2 input units");
    __shared__ __align__(16) float ws[F16T_ROWS * F16T_PITCH];
    __shared__ __align__(16) float xs[F16T_TOKENS * F16T_PITCH];
    __shared__ bool last;
    const u32 y0 = blockIdx.y * F16T_TOKENS;
    u32 active = 0;
#pragma unroll
    for (u32 t = 0; t < F16T_TOKENS; t++)
        if (ds4_cond(P + y0 + t, cond)) active |= 1u << t;
    ds4_wait_predecessor();
    if (!active) return;  // the whole tile's blocks: none takes the ticket
    const u32 all_rows = j.rows + j.rows2;
    const u32 row_tiles = (all_rows + F16T_ROWS - 1) / F16T_ROWS;
    const u32 ksplit = gridDim.x / row_tiles;
    const u32 rt = blockIdx.x / ksplit, ks = blockIdx.x % ksplit;
    const u32 r0 = rt * F16T_ROWS;
    const u32 n_chunks = (j.in_dim + DS4_CHUNK - 1) / DS4_CHUNK;
    const u32 per = (n_chunks + ksplit - 1) / ksplit;
    const u32 c0 = min(ks * per, n_chunks), c1 = min(c0 + per, n_chunks);
    const u32 tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

    // Staging: unit e of an eighth is 8 consecutive terms of one row: row e / 8, half u, lane slot q.
    uint4 wq[F16T_TR / 2];
    float4 xa[F16T_TT / 2], xb[F16T_TT / 2];
    auto fetch = [&](u32 s) {
        const u32 c = c0 + s / 8, g = bit_reverse3(s % 8);
#pragma unroll
        for (u32 k = 0; k < F16T_TR / 2; k++) {
            const u32 e = threadIdx.x + 256 * k, rr = r0 + e / 8, u = (e / 4) & 1, q = e & 3;
            const u32 i = c * DS4_CHUNK + u * 256 + (g + 8 * q) * 8;
            wq[k] = make_uint4(0, 0, 0, 0);
            if (rr < all_rows && i < j.in_dim) {
                const u16* row = rr < j.rows ? j.w + (u64)rr * j.in_dim : j.w2 + (u64)(rr - j.rows) * j.in_dim;
                wq[k] = __ldg((const uint4*)(row + i));
            }
        }
#pragma unroll
        for (u32 k = 0; k < F16T_TT / 2; k++) {
            const u32 e = threadIdx.x + 256 * k, t = e / 8, u = (e / 4) & 1, q = e & 3;
            const u32 i = c * DS4_CHUNK + u * 256 + (g + 8 * q) * 8;
            xa[k] = xb[k] = make_float4(0, 0, 0, 0);
            if (((active >> t) & 1) && i < j.in_dim) {
                const float* xr = (const float*)((const u8*)j.x + (u64)(y0 + t) * j.x_stride) + i;
                xa[k] = *(const float4*)xr;
                xb[k] = *(const float4*)(xr + 4);
            }
        }
    };
    auto store = [&]() {
#pragma unroll
        for (u32 k = 0; k < F16T_TR / 2; k++) {
            const u32 e = threadIdx.x + 256 * k;
            float* d = ws + (e / 8) * F16T_PITCH + (e & 7) * 8;
            const uint4 h = wq[k];
            *(float4*)d = make_float4(h2f((u16)(h.x & 0xffff)), h2f((u16)(h.x >> 16)), h2f((u16)(h.y & 0xffff)),
                                      h2f((u16)(h.y >> 16)));
            *(float4*)(d + 4) = make_float4(h2f((u16)(h.z & 0xffff)), h2f((u16)(h.z >> 16)),
                                            h2f((u16)(h.w & 0xffff)), h2f((u16)(h.w >> 16)));
        }
#pragma unroll
        for (u32 k = 0; k < F16T_TT / 2; k++) {
            const u32 e = threadIdx.x + 256 * k;
            float* d = xs + (e / 8) * F16T_PITCH + (e & 7) * 8;
            *(float4*)d = xa[k];
            *(float4*)(d + 4) = xb[k];
        }
    };

    float total[F16T_TR][F16T_TT], p2[F16T_TR][F16T_TT], p3[F16T_TR][F16T_TT], p4[F16T_TR][F16T_TT];
#pragma unroll
    for (u32 i = 0; i < F16T_TR; i++)
#pragma unroll
        for (u32 t = 0; t < F16T_TT; t++) total[i][t] = 0.0f;
    const u32 stages = (c1 - c0) * 8;
    if (stages) fetch(0);
    for (u32 s = 0; s < stages; s++) {
        __syncthreads();  // every thread is done with the previous eighth
        store();
        __syncthreads();
        if (s + 1 < stages) fetch(s + 1);  // in flight while this eighth is computed
        // The eighth's 4-leaf subtree: leaf m is lane slot q = bitrev2(m).
        float pa[F16T_TR][F16T_TT], pb[F16T_TR][F16T_TT], v[F16T_TR][F16T_TT];
#pragma unroll
        for (u32 m = 0; m < 4; m++) {
            const u32 q = ((m & 1) << 1) | (m >> 1);
#pragma unroll
            for (u32 h = 0; h < 4; h++) {
                const u32 off = (h >> 1) * 32 + q * 8 + (h & 1) * 4;
                float4 wv[F16T_TR], xv[F16T_TT];
#pragma unroll
                for (u32 i = 0; i < F16T_TR; i++) wv[i] = *(const float4*)(ws + (ty + 16 * i) * F16T_PITCH + off);
#pragma unroll
                for (u32 t = 0; t < F16T_TT; t++) xv[t] = *(const float4*)(xs + (tx + 16 * t) * F16T_PITCH + off);
#pragma unroll
                for (u32 i = 0; i < F16T_TR; i++)
#pragma unroll
                    for (u32 t = 0; t < F16T_TT; t++) {
                        float a = h == 0 ? wv[i].x * xv[t].x : v[i][t] + wv[i].x * xv[t].x;
                        a += wv[i].y * xv[t].y;
                        a += wv[i].z * xv[t].z;
                        a += wv[i].w * xv[t].w;
                        v[i][t] = a;
                    }
            }
#pragma unroll
            for (u32 i = 0; i < F16T_TR; i++)
#pragma unroll
                for (u32 t = 0; t < F16T_TT; t++) {
                    if (m == 0) pa[i][t] = v[i][t];
                    else if (m == 1) pa[i][t] = pa[i][t] + v[i][t];
                    else if (m == 2) pb[i][t] = v[i][t];
                    else v[i][t] = pa[i][t] + (pb[i][t] + v[i][t]);
                }
        }
        // Merge the subtree into the chunk's: eighths 2k and 2k+1 pair, then pairs of pairs.
        const u32 e8 = s % 8;
#pragma unroll
        for (u32 i = 0; i < F16T_TR; i++)
#pragma unroll
            for (u32 t = 0; t < F16T_TT; t++) {
                if (!(e8 & 1)) {
                    p2[i][t] = v[i][t];
                    continue;
                }
                float a = p2[i][t] + v[i][t];
                if (!(e8 & 2)) {
                    p3[i][t] = a;
                    continue;
                }
                a = p3[i][t] + a;
                if (!(e8 & 4)) {
                    p4[i][t] = a;
                    continue;
                }
                v[i][t] = p4[i][t] + a;  // the chunk's sum
            }
        if (e8 == 7) {
            if (ksplit == 1) {
#pragma unroll
                for (u32 i = 0; i < F16T_TR; i++)
#pragma unroll
                    for (u32 t = 0; t < F16T_TT; t++) total[i][t] += v[i][t];
            } else {
                const u32 c = c0 + s / 8;
#pragma unroll
                for (u32 t = 0; t < F16T_TT; t++) {
                    const u32 tok = tx + 16 * t;
                    if (!((active >> tok) & 1)) continue;
                    float* part = (float*)((u8*)j.partial + (u64)(y0 + tok) * j.partial_stride);
#pragma unroll
                    for (u32 i = 0; i < F16T_TR; i++) {
                        const u32 rr = r0 + ty + 16 * i;
                        if (rr < all_rows) part[(u64)rr * n_chunks + c] = v[i][t];
                    }
                }
            }
        }
    }
    if (ksplit > 1) {
        __threadfence();
        __syncthreads();
        u32* ticket = (u32*)((u8*)j.tickets + (u64)(blockIdx.y * row_tiles + rt) * j.tickets_stride) + j.ticket;
        if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == ksplit - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
#pragma unroll
        for (u32 t = 0; t < F16T_TT; t++) {
            const u32 tok = tx + 16 * t;
            if (!((active >> tok) & 1)) continue;
            const float* part = (const float*)((const u8*)j.partial + (u64)(y0 + tok) * j.partial_stride);
#pragma unroll
            for (u32 i = 0; i < F16T_TR; i++) {
                const u32 rr = r0 + ty + 16 * i;
                if (rr >= all_rows) continue;
                float sum = 0.0f;
                for (u32 c = 0; c < n_chunks; c++) sum += __ldcg(part + (u64)rr * n_chunks + c);
                total[i][t] = sum;
            }
        }
        if (threadIdx.x == 0) *ticket = 0;
    }
#pragma unroll
    for (u32 t = 0; t < F16T_TT; t++) {
        const u32 tok = tx + 16 * t;
        if (!((active >> tok) & 1)) continue;
#pragma unroll
        for (u32 i = 0; i < F16T_TR; i++) {
            const u32 rr = r0 + ty + 16 * i;
            if (rr < j.rows) ((float*)((u8*)j.out + (u64)(y0 + tok) * j.out_stride))[rr] = total[i][t];
            else if (rr < all_rows)
                ((float*)((u8*)j.out2 + (u64)(y0 + tok) * j.out2_stride))[rr - j.rows] = total[i][t];
        }
    }
}

// mat_vec_f16 (ungrouped) as a tile product: no K split (gridDim.x = matrix-row tiles).
extern "C" __global__ void __launch_bounds__(256, 2) mat_mul_f16_tile(DS4_ARGS, MatVecF16Args a) {
    F16Tile j;
    j.w = a.w, j.w2 = nullptr, j.x = a.x, j.out = a.out, j.out2 = nullptr, j.partial = nullptr, j.tickets = nullptr;
    j.x_stride = R.s[1], j.out_stride = R.s[2], j.out2_stride = 0, j.partial_stride = 0, j.tickets_stride = 0;
    j.rows = a.rows, j.rows2 = 0, j.in_dim = a.in_dim, j.ticket = 0;
    f16_tile(P, cond, j);
}

// mat_vec_f16_split (ungrouped, with its optional second matrix) as a tile product.
extern "C" __global__ void __launch_bounds__(256, 2) mat_mul_f16_split_tile(DS4_ARGS, MatVecF16SplitArgs a) {
    F16Tile j;
    j.w = a.w, j.w2 = a.w2, j.x = a.x, j.out = a.out, j.out2 = a.out2, j.partial = a.partial, j.tickets = a.tickets;
    j.x_stride = R.s[1], j.out_stride = R.s[4], j.out2_stride = R.s[6], j.partial_stride = R.s[2];
    j.tickets_stride = R.s[3], j.rows = a.rows, j.rows2 = a.rows2, j.in_dim = a.in_dim, j.ticket = a.ticket;
    f16_tile(P, cond, j);
}
#endif

// One warp per row of an F32 matrix (4 terms per lane step).
extern "C" __global__ void mat_vec_f32(DS4_ARGS, MatVecF32Args a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= a.rows) return;
    const float* row = a.w + (u64)r * a.in_dim;
    const float* xg = a.x + (u64)(r / a.rows_per_group) * a.in_dim;
    const float total = warp_dot_f32(row, xg, a.in_dim, lane);
    if (lane == 0) a.out[r] = total;
}

// Hyper-connections: the token embedding into the HC streams, the Sinkhorn split, the weighted
// sum of streams, the post mix, and the output head's weights. Each output sums at most n_hc = 4
// terms, sequentially, in ds4's order (the canonical order for these ops).

// out[h*n_embd + d] = table[token][d] for each of the n_hc streams.
extern "C" __global__ void embed_hc(DS4_ARGS, EmbedHcArgs a) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= a.n_embd) return;
    const float v = wload(a.table, a.is_f16, (u64)P->token * a.n_embd + d);
    for (u32 h = 0; h < a.n_hc; h++) a.out[h * a.n_embd + d] = v;
}

// A pre gate: sigmoid(mix * scale + base) + eps, in ds4's form.
__device__ __forceinline__ float hc_pre_gate(float mix, const float* scale, float base, float eps) {
    return 1.0f / (1.0f + ds4_expf(-(mix * scale[0] + base))) + eps;
}

// One warp: lanes 0..7 make the 4 pre and 4 post gates; lane k < 16 holds the combine matrix's
// element k = src + dst*4 through the softmax and the 20 Sinkhorn iterations. Every row and column
// sum reads its four elements by shuffles and adds them in ds4's order (dst, or src, ascending),
// so each lane computes exactly what the serial reference does. Called by all 32 lanes of a warp.
// Without `with_pre` the 4 pre gates (which read mix[0..4]) are left to the caller.
__device__ void hc_split_warp(const float* mix, const float* scale, const float* base, float* split, u32 iters,
                              float eps, bool with_pre) {
    const u32 lane = threadIdx.x & 31;
    const int n = 4;
    if (lane < 4) {
        if (with_pre) split[lane] = hc_pre_gate(mix[lane], scale, base[lane], eps);
    }
    else if (lane < 8) split[lane] = 2.0f / (1.0f + ds4_expf(-(mix[lane] * scale[1] + base[lane])));
    const u32 k = lane & 15, src = k & 3, dst = k >> 2;
    float c = mix[2 * n + k] * scale[2] + base[2 * n + k];
    // Softmax over src for each dst row, then + eps.
    float mx = -1.0e30f;
    for (u32 s = 0; s < 4; s++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, c, dst * 4 + s));
    c = ds4_expf(c - mx);
    float sum = 0.0f;
    for (u32 s = 0; s < 4; s++) sum += __shfl_sync(0xffffffffu, c, dst * 4 + s);
    c = c * (1.0f / sum) + eps;
    for (u32 it = 0; it < iters; it++) {
        if (it > 0) {
            float t = 0.0f;  // this dst row, over src
            for (u32 s = 0; s < 4; s++) t += __shfl_sync(0xffffffffu, c, dst * 4 + s);
            c *= 1.0f / (t + eps);
        }
        float t = 0.0f;  // this src column, over dst
        for (u32 d = 0; d < 4; d++) t += __shfl_sync(0xffffffffu, c, d * 4 + src);
        c *= 1.0f / (t + eps);
    }
    if (lane < 16) split[2 * n + k] = c;
}

extern "C" __global__ void hc_split(DS4_ARGS, HcSplitArgs a) {
    DS4_GUARD;
    if (blockIdx.x != 0 || a.n_hc != 4) return;
    hc_split_warp(a.mix, a.scale, a.base, a.split, a.iters, a.eps, true);
}

// out[d] = sum_h weights[h] * hc[h*n + d]
extern "C" __global__ void hc_weighted_sum(DS4_ARGS, HcWeightedSumArgs a) {
    DS4_GUARD;
    const u32 d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= a.n) return;
    float acc = 0.0f;
    for (u32 h = 0; h < a.n_hc; h++) acc += a.hc[h * a.n + d] * a.weights[h];
    a.out[d] = acc;
}

// out[dst][d] = post[dst]*block[d] + sum_src comb[dst + src*n_hc] * residual[src][d]
// With `block_b` (an Add fused in front), block = block[d] + block_b[d], also stored to `sum_out`.
// A warp per 512 outputs, lane l taking 4 consecutive ones per 128: the lanes of the canonical
// sum of squares, so with `ss` it also stores each 512-chunk's sum of squares of `out`, from which
// the next hc_pre takes the RMS norm of the streams without reading them again. n % 4 == 0,
// n_hc <= 4.
extern "C" __global__ void hc_post(DS4_ARGS, HcPostArgs a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31, chunk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 total = a.n * a.n_hc, c0 = chunk * DS4_CHUNK;
    if (c0 >= total) return;
    const float* post = a.split + a.n_hc;
    const float* comb = a.split + 2 * a.n_hc;
    // Every load first (out may not alias the inputs, but the compiler cannot know that).
    float4 bl[4], bb[4], res[4][4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = c0 + u * 128 + lane * 4, d = i % a.n;
        const bool ok = i < total;
        bl[u] = ok ? *(const float4*)(a.block + d) : make_float4(0, 0, 0, 0);
        bb[u] = ok && a.block_b ? *(const float4*)(a.block_b + d) : make_float4(0, 0, 0, 0);
#pragma unroll
        for (u32 src = 0; src < 4; src++)
            res[u][src] = ok && src < a.n_hc ? *(const float4*)(a.residual + src * a.n + d) : make_float4(0, 0, 0, 0);
    }
    float sq = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = c0 + u * 128 + lane * 4, dst = i / a.n, d = i % a.n;
        if (i >= total) break;
        float v[4] = {bl[u].x, bl[u].y, bl[u].z, bl[u].w};
        if (a.block_b) {
            v[0] = v[0] + bb[u].x, v[1] = v[1] + bb[u].y, v[2] = v[2] + bb[u].z, v[3] = v[3] + bb[u].w;
            if (dst == 0) *(float4*)(a.sum_out + d) = make_float4(v[0], v[1], v[2], v[3]);
        }
        float o[4];
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            float acc = v[j] * post[dst];
#pragma unroll
            for (u32 src = 0; src < 4; src++) {
                const float r = j == 0 ? res[u][src].x : j == 1 ? res[u][src].y : j == 2 ? res[u][src].z : res[u][src].w;
                if (src < a.n_hc) acc += comb[dst + src * a.n_hc] * r;
            }
            o[j] = acc;
            sq += acc * acc;
        }
        *(float4*)(a.out + i) = make_float4(o[0], o[1], o[2], o[3]);
    }
    if (a.ss) {
        sq = warp_sum(sq);
        if (lane == 0) a.ss[chunk] = sq;
    }
}

// w = sigmoid(pre*scale + base) + eps, no Sinkhorn.
extern "C" __global__ void hc_head_weights(DS4_ARGS, HcHeadWeightsArgs a) {
    DS4_GUARD;
    const u32 i = threadIdx.x;
    if (i < a.n) a.out[i] = sigmoid_stable(a.pre[i] * a.scale[0] + a.base[i]) + a.eps;
}

// RopeTail: rotate the last n_rot dims of each head by a host-computed table of (cos, sin) per
// position and pair, the very values the CPU reference rotates by. pos_mode 0 rotates by the
// token's position; 1 by the first position of this token's compressed row (pos + 1 - ratio).

// Pair k of one head's tail, with `trow` the table's row for the position.
__device__ __forceinline__ void rope_pair(float* tail, const float* trow, u32 k, bool inverse) {
    const float c = trow[2 * k];
    const float s0 = trow[2 * k + 1];
    const float s = inverse ? -s0 : s0;
    const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
    tail[2 * k] = x0 * c - x1 * s;
    tail[2 * k + 1] = x0 * s + x1 * c;
}

// Every pair of one head's tail, by the threads of a block.
__device__ __forceinline__ void rope_tail_block(float* tail, const float* trow, u32 pairs, bool inverse) {
    for (u32 k = threadIdx.x; k < pairs; k += blockDim.x) rope_pair(tail, trow, k, inverse);
}

extern "C" __global__ void rope_tail(DS4_ARGS, RopeTailArgs a) {
    DS4_GUARD;
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 pairs = a.n_rot / 2;
    if (t >= a.n_head * pairs) return;
    const u32 h = t / pairs, k = t % pairs;
    const u32 pos = a.pos_mode == 0 ? P->pos : (P->pos + 1 >= a.ratio ? P->pos + 1 - a.ratio : 0);
    float* tail = a.x + (u64)h * a.head_dim + (a.head_dim - a.n_rot);
    rope_pair(tail, a.table + (u64)pos * pairs * 2, k, a.inverse != 0);
}

// KV cache and compressor ops: fp8 / FP4 round trips, the raw ring, the compressor window state
// and the compressed-row caches. Rows are f16-rounded on store, as ds4's CPU path does.

__device__ float e4m3_value(int i) {
    const int e = (i >> 3) & 15;
    const float mant = (float)(i & 7);
    return e == 0 ? mant * 0.001953125f : (1.0f + mant * 0.125f) * ldexpf(1.0f, e - 7);
}

// Nearest E4M3 value (ties to the even code), saturating at 448.
__device__ float e4m3_round(float x) {
    const float sign = x < 0.0f ? -1.0f : 1.0f;
    const float ax = fminf(fabsf(x), 448.0f);
    int lo = 0, hi = 126;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (e4m3_value(mid) <= ax) lo = mid; else hi = mid - 1;
    }
    int best = lo;
    if (best < 126) {
        const float d0 = fabsf(ax - e4m3_value(best)), d1 = fabsf(ax - e4m3_value(best + 1));
        if (d1 < d0 || (d1 == d0 && ((best + 1) & 1) == 0 && (best & 1) != 0)) best++;
    }
    return sign * e4m3_value(best);
}

// One 64-dim group by one warp (lane i holds dims i and 32 + i): a power-of-two scale from the
// group's amax (a maximum, so the same whatever the grouping of the comparisons).
__device__ __forceinline__ void fp8_group_warp(float* x, u32 lane) {
    const float v0 = x[lane], v1 = x[32 + lane];
    const float amax = fmaxf(warp_max(fmaxf(fabsf(v0), fabsf(v1))), 1.0e-4f);
    const float scale = ds4_pow2_ceil(amax / 448.0f);
    x[lane] = e4m3_round(fminf(fmaxf(v0 / scale, -448.0f), 448.0f)) * scale;
    x[32 + lane] = e4m3_round(fminf(fmaxf(v1 / scale, -448.0f), 448.0f)) * scale;
}

// The first n dims (a multiple of 64) of x, a warp per group, by the threads of a block.
__device__ __forceinline__ void fp8_round_trip_block(float* x, u32 n) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 g = warp; g < n / 64; g += nw) fp8_group_warp(x + g * 64, lane);
}

// One warp per 64 non-RoPE dims.
extern "C" __global__ void fp8_round_trip(DS4_ARGS, Fp8RoundTripArgs a) {
    DS4_GUARD;
    fp8_group_warp(a.x + blockIdx.x * 64, threadIdx.x & 31);
}

__device__ float e2m1_round(float x) {
    const float vals[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float sign = x < 0.0f ? -1.0f : 1.0f;
    const float ax = fminf(fabsf(x), 6.0f);
    int best = 0;
    float best_diff = ax;
    for (int i = 1; i < 8; i++) {
        const float d = fabsf(ax - vals[i]);
        if (d < best_diff || (d == best_diff && (i & 1) == 0 && (best & 1) != 0)) {
            best = i;
            best_diff = d;
        }
    }
    return sign * vals[best];
}

// One row of 128: Hadamard-128, then FP4 E2M1 per 32 (one warp each), by threads 0..127 of a
// block (every thread of the block must call it).
__device__ void indexer_qat_block(float* row) {
    __shared__ float s[128];
    const u32 t = threadIdx.x;
    const bool on = t < 128;
    if (on) s[t] = row[t];
    __syncthreads();
    for (u32 stride = 1; stride < 128; stride <<= 1) {
        float v = 0.0f;
        if (on) {
            const u32 base = t & ~(2 * stride - 1), off = t & (2 * stride - 1);
            if (off < stride) v = s[base + off] + s[base + off + stride];
            else v = s[base + off - stride] - s[base + off];
        }
        __syncthreads();
        if (on) s[t] = v;
        __syncthreads();
    }
    if (on) {
        const float v = s[t] * DS4_HADAMARD_SCALE;
        const float amax = fmaxf(warp_max(fabsf(v)), 7.052966104933725e-38f);
        const float scale = ds4_pow2_ceil(amax / 6.0f);
        row[t] = e2m1_round(fminf(fmaxf(v / scale, -6.0f), 6.0f)) * scale;
    }
}

// One block of 128 threads per row.
extern "C" __global__ void indexer_qat(DS4_ARGS, IndexerQatArgs a) {
    DS4_GUARD;
    indexer_qat_block(a.x + (u64)blockIdx.x * 128);
}

// The token's KV row, f16-rounded, into ring row pos % raw_cap.
extern "C" __global__ void store_raw(DS4_ARGS, StoreRawArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.dim) return;
    a.cache[(u64)(P->pos % a.raw_cap) * a.dim + i] = round_f16(a.kv[i]);
}

// This token's compressed row, f16-rounded, as row (pos+1)/ratio - 1.
extern "C" __global__ void store_comp_row(DS4_ARGS, StoreCompRowArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 n = (P->pos + 1) / a.ratio;
    if (i >= a.dim || n == 0) return;
    a.cache[(u64)(n - 1) * a.dim + i] = round_f16(a.row[i]);
}

// Window state row (4 + pos%4 for ratio 4, else pos%ratio) = kv, score + ape[pos % ratio].
extern "C" __global__ void compressor_store(DS4_ARGS, CompressorStoreArgs a) {
    DS4_GUARD;
    const u32 width = a.width, ratio = a.ratio;
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width) return;
    const u32 pos_mod = P->pos % ratio;
    const u32 row = ratio == 4 ? 4 + pos_mod : pos_mod;
    a.state_kv[(u64)row * width + j] = a.kv[j];
    a.state_score[(u64)row * width + j] = a.score[j] + wload(a.ape, a.ape_f16, (u64)pos_mod * width + j);
}

// Softmax pool of dim j over the window; ratio 4 mixes rows 0..4 (first half) with rows 4..8
// (second half), interleaved in the sums as ds4 does.
__device__ float compressor_pool_value(const float* kv, const float* score, u32 head_dim, u32 ratio, u32 j) {
    const u32 width = ratio == 4 ? 2 * head_dim : head_dim;
    float mx = -1.0e30f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            mx = fmaxf(mx, score[(u64)r * width + j]);
            mx = fmaxf(mx, score[(u64)(4 + r) * width + head_dim + j]);
        }
    } else {
        for (u32 r = 0; r < ratio; r++) mx = fmaxf(mx, score[(u64)r * width + j]);
    }
    if (mx <= -1.0e30f * 0.5f) return 0.0f;
    float denom = 0.0f, sum = 0.0f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            const u64 bp = (u64)r * width + j, bc = (u64)(4 + r) * width + head_dim + j;
            const float wp = ds4_expf(score[bp] - mx), wc = ds4_expf(score[bc] - mx);
            denom += wp + wc;
            sum += wp * kv[bp];
            sum += wc * kv[bc];
        }
    } else {
        for (u32 r = 0; r < ratio; r++) {
            const u64 b = (u64)r * width + j;
            const float w = ds4_expf(score[b] - mx);
            denom += w;
            sum += w * kv[b];
        }
    }
    return denom > 0.0f ? sum / denom : 0.0f;
}

extern "C" __global__ void compressor_pool(DS4_ARGS, CompressorPoolArgs a) {
    DS4_GUARD;
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < a.head_dim) a.out[j] = compressor_pool_value(a.kv, a.score, a.head_dim, a.ratio, j);
}

// Ratio 4: rows 4..8 become rows 0..4, for both kv and score.
extern "C" __global__ void compressor_shift(DS4_ARGS, CompressorShiftArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    a.state_kv[i] = a.state_kv[a.n + i];
    a.state_score[i] = a.state_score[a.n + i];
}

// The indexer: score every visible compressed row, then pick the top_k rows (ties to the lower
// row), written in ascending row order.

// One block of 128 threads (4 warps) per row, grid-stride over rows. Warp w takes heads w, w+4,
// ...: dot(q_h, k) in the canonical f32 order; then one thread adds the head terms
// max(dot, 0) * (w_h * scale) sequentially, as the canonical profile defines. The chunk build
// uses indexer_scores_chunk below instead (same bits), unless DS4_CUDA_INDEXER_CHUNK=0.
#define INDEXER_MAX_HEADS 128
extern "C" __global__ void indexer_scores(DS4_ARGS, IndexerScoresArgs a) {
    DS4_GUARD;
    __shared__ float term[INDEXER_MAX_HEADS];
    const u32 n = ds4_comp_rows(P, a.ratio, a.cap);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 c = blockIdx.x; c < n; c += gridDim.x) {
        const float* k = a.cache + (u64)c * a.head_dim;
        __syncthreads();
        for (u32 h = warp; h < a.n_head; h += nw) {
            const float d = warp_dot_f32(k, a.q + (u64)h * a.head_dim, a.head_dim, lane);
            if (lane == 0) term[h] = fmaxf(d, 0.0f) * (a.weights[h] * a.scale);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0.0f;
            for (u32 h = 0; h < a.n_head; h++) t += term[h];
            a.out[c] = t;
        }
    }
}

#if DS4_CHUNK_ROWS
// The chunk build's scores: a block per tile of IDX_BT token rows x IDX_BC compressed rows, a thread
// per IDX_MT x IDX_MC (t, c) pairs computing each pair's head dots itself, so a staged k row and
// q head feed several pairs. Same bits as indexer_scores per row: each dot's lane sums (lane l:
// its 4 products added in order) merged in warp_sum's tree (leaves in bit-reversed lane order,
// pairs merged as they come), added to +0, then the terms max(dot, 0) * (w_h * scale) added in
// head order from +0. A lane sum starts at its first product, not at +0 + it: the two differ only
// in the sign of a zero, which the tree keeps only in a zero total, and +0 + total drops it.
// The launch covers the chunk's rows without blockIdx.y moving P (row count in cond bits 50..62);
// tiles past a row's visible count do no work and are not written.
#ifndef IDX_MT
#define IDX_MT 2
#endif
#ifndef IDX_MC
#define IDX_MC 4
#endif
#define IDX_THREADS 128
#define IDX_DIM 128
// Threads lie 8 along t by 16 along c (a warp: 4 t by 8 c, so a shared load reads 4 or 8 rows).
#define IDX_BT (8 * IDX_MT)
#define IDX_BC (16 * IDX_MC)
// A staged row: 32 float4 plus one, so that 8 consecutive rows' same column fall in distinct banks.
#define IDX_ROW4 33
// float4 loads per thread to stage one head of the tile's q rows.
#define IDX_QLOADS (IDX_BT * 32 / IDX_THREADS)
static_assert(IDX_BT * 32 % IDX_THREADS == 0, "whole q loads per thread");
static_assert((IDX_BT + IDX_BC) * IDX_ROW4 * 16 + IDX_BT * 4 <= 48 * 1024, "static shared memory");

// Visible compressed rows of chunk row t; 0 when the row runs nothing (past the chunk's rows, past
// its tokens or its indexer inactive).
__device__ __forceinline__ u32 idx_row_count(const StepParams* P, u64 cond, const IndexerScoresArgs& a, u32 rows,
                                             u32 t) {
    return t < rows && ds4_cond(P + t, cond) ? ds4_comp_rows(P + t, a.ratio, a.cap) : 0;
}

// s[i][j] = the tree over leaves [I, I + N) (leaf order: lane bit_reverse5(leaf)) of the lane sums
// of q row qr[i] and k row kr[j] (staged, IDX_ROW4 float4 a row).
template <u32 I, u32 N>
__device__ __forceinline__ void idx_tree(float (&s)[IDX_MT][IDX_MC], const float4* const (&qr)[IDX_MT],
                                         const float4* const (&kr)[IDX_MC]) {
    if constexpr (N == 1) {
        constexpr u32 l = bit_reverse5(I);
        float4 qv[IDX_MT], kv[IDX_MC];
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++) qv[i] = qr[i][l];
#pragma unroll
        for (u32 j = 0; j < IDX_MC; j++) kv[j] = kr[j][l];
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++)
#pragma unroll
            for (u32 j = 0; j < IDX_MC; j++) {
                float acc = kv[j].x * qv[i].x;
                acc += kv[j].y * qv[i].y;
                acc += kv[j].z * qv[i].z;
                acc += kv[j].w * qv[i].w;
                s[i][j] = acc;
            }
    } else {
        float b[IDX_MT][IDX_MC];
        idx_tree<I, N / 2>(s, qr, kr);
        idx_tree<I + N / 2, N / 2>(b, qr, kr);
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++)
#pragma unroll
            for (u32 j = 0; j < IDX_MC; j++) s[i][j] += b[i][j];
    }
}

extern "C" __global__ void __launch_bounds__(IDX_THREADS) indexer_scores_chunk(DS4_ARGS, IndexerScoresArgs a) {
    ds4_wait_predecessor();
    __shared__ float4 ks[IDX_BC * IDX_ROW4];
    __shared__ float4 qs[IDX_BT * IDX_ROW4];
    __shared__ float ws[IDX_BT];
    const u32 rows = (u32)(cond >> 50) & 0x1fff;
    const u32 t0 = blockIdx.y * IDX_BT, c0 = blockIdx.x * IDX_BC;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ty = (warp >> 1) * 4 + (lane >> 3), tx = (warp & 1) * 8 + (lane & 7);
    u32 n_max = 0;
    for (u32 r = 0; r < IDX_BT; r++) n_max = max(n_max, idx_row_count(P, cond, a, rows, t0 + r));
    if (c0 >= n_max) return;

    // The tile's k rows (zeros past the visible ones), staged once for every head.
    for (u32 i = threadIdx.x; i < IDX_BC * 32; i += IDX_THREADS) {
        const u32 r = i >> 5, c = c0 + r;
        ks[r * IDX_ROW4 + (i & 31)] =
            c < n_max ? ((const float4*)(a.cache + (u64)c * IDX_DIM))[i & 31] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // This thread's share of staging each head: row warp + 4 k, float4 `lane`; null for a row that
    // runs nothing (staged as zeros). Threads below IDX_BT also stage row threadIdx.x's weight.
    const float* qsrc[IDX_QLOADS];
#pragma unroll
    for (u32 k = 0; k < IDX_QLOADS; k++) {
        const u32 t = t0 + warp + 4 * k;
        IndexerScoresArgs ay = a;
        ds4_row(ay, R, t);
        qsrc[k] = idx_row_count(P, cond, a, rows, t) ? ay.q + lane * 4 : nullptr;
    }
    const float* wsrc = nullptr;
    if (threadIdx.x < IDX_BT && idx_row_count(P, cond, a, rows, t0 + threadIdx.x)) {
        IndexerScoresArgs ay = a;
        ds4_row(ay, R, t0 + threadIdx.x);
        wsrc = ay.weights;
    }
    // This thread's pairs: token rows ty + 8 i, compressed rows tx + 16 j of the tile.
    const float4* qr[IDX_MT];
    const float4* kr[IDX_MC];
#pragma unroll
    for (u32 i = 0; i < IDX_MT; i++) qr[i] = qs + (ty + 8 * i) * IDX_ROW4;
#pragma unroll
    for (u32 j = 0; j < IDX_MC; j++) kr[j] = ks + (tx + 16 * j) * IDX_ROW4;
    float acc[IDX_MT][IDX_MC];
#pragma unroll
    for (u32 i = 0; i < IDX_MT; i++)
#pragma unroll
        for (u32 j = 0; j < IDX_MC; j++) acc[i][j] = 0.0f;

    // Head h + 1's q is loaded into registers while head h is computed.
    float4 qnext[IDX_QLOADS];
    float wnext = 0.0f;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (u32 k = 0; k < IDX_QLOADS; k++) qnext[k] = qsrc[k] ? *(const float4*)qsrc[k] : zero;
    if (wsrc) wnext = wsrc[0] * a.scale;
    for (u32 h = 0; h < a.n_head; h++) {
        __syncthreads();
#pragma unroll
        for (u32 k = 0; k < IDX_QLOADS; k++) qs[(warp + 4 * k) * IDX_ROW4 + lane] = qnext[k];
        if (threadIdx.x < IDX_BT) ws[threadIdx.x] = wnext;
        __syncthreads();
        if (h + 1 < a.n_head) {
#pragma unroll
            for (u32 k = 0; k < IDX_QLOADS; k++)
                qnext[k] = qsrc[k] ? *(const float4*)(qsrc[k] + (u64)(h + 1) * IDX_DIM) : zero;
            if (wsrc) wnext = wsrc[h + 1] * a.scale;
        }
        float d[IDX_MT][IDX_MC];
        idx_tree<0, 32>(d, qr, kr);
#pragma unroll
        for (u32 i = 0; i < IDX_MT; i++) {
            const float w = ws[ty + 8 * i];
#pragma unroll
            for (u32 j = 0; j < IDX_MC; j++) {
                const float dot = 0.0f + d[i][j];
                acc[i][j] += fmaxf(dot, 0.0f) * w;
            }
        }
    }
#pragma unroll
    for (u32 i = 0; i < IDX_MT; i++) {
        const u32 t = t0 + ty + 8 * i, n = idx_row_count(P, cond, a, rows, t);
        IndexerScoresArgs ay = a;
        ds4_row(ay, R, t);
#pragma unroll
        for (u32 j = 0; j < IDX_MC; j++) {
            const u32 c = c0 + tx + 16 * j;
            if (c < n) ay.out[c] = acc[i][j];
        }
    }
}
#endif

#if !DS4_CHUNK_ROWS
// The decode build's scores: a block per IDX1_ROWS compressed rows, lane l of every warp on row
// l; warp w computes the dots of head groups w, w + 4, ... (IDX1_HEADS heads a group, from one
// load of the k row's float4 per leaf) itself in indexer_scores_chunk's order, keeps the terms
// max(dot, 0) * (w_h * scale) in registers, then one lane per row adds them in head order from +0.
// Same bits as indexer_scores; q (at most IDX1_MAX_HEADS heads) and the rows are staged in shared
// memory, the terms in the rows' space once the dots are done.
#define IDX1_ROWS 32
#define IDX1_THREADS 128
#define IDX1_HEADS 4
#define IDX1_MAX_HEADS 64
#define IDX1_GROUPS (IDX1_MAX_HEADS / IDX1_HEADS / (IDX1_THREADS / 32))
// A row's terms, padded so that the 32 rows' same head fall in distinct banks.
#define IDX1_TERMS (IDX1_MAX_HEADS + 1)
static_assert(IDX1_ROWS * IDX1_TERMS <= IDX1_ROWS * 32 * 4, "the terms fit the rows' space");

// s[e] = the tree over leaves [I, I + N) of the lane sums of q head qh + 32 e and the k row kr,
// whose float4 j is staged at j ^ sw.
template <u32 I, u32 N>
__device__ __forceinline__ void idx1_tree(float (&s)[IDX1_HEADS], const float4* qh, const float4* kr, u32 sw) {
    if constexpr (N == 1) {
        constexpr u32 l = bit_reverse5(I);
        const float4 kv = kr[l ^ sw];
#pragma unroll
        for (u32 e = 0; e < IDX1_HEADS; e++) {
            const float4 qv = qh[e * 32 + l];
            float acc = kv.x * qv.x;
            acc += kv.y * qv.y;
            acc += kv.z * qv.z;
            acc += kv.w * qv.w;
            s[e] = acc;
        }
    } else {
        float b[IDX1_HEADS];
        idx1_tree<I, N / 2>(s, qh, kr, sw);
        idx1_tree<I + N / 2, N / 2>(b, qh, kr, sw);
#pragma unroll
        for (u32 e = 0; e < IDX1_HEADS; e++) s[e] += b[e];
    }
}

extern "C" __global__ void __launch_bounds__(IDX1_THREADS) indexer_scores_one(DS4_ARGS, IndexerScoresArgs a) {
    DS4_GUARD;
    __shared__ float4 sm[(IDX1_MAX_HEADS + IDX1_ROWS) * 32];
    float4* qs = sm;
    float4* ks = sm + IDX1_MAX_HEADS * 32;
    float* terms = (float*)ks;
    const u32 n = ds4_comp_rows(P, a.ratio, a.cap), c0 = blockIdx.x * IDX1_ROWS;
    if (c0 >= n) return;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (u32 i = threadIdx.x; i < a.n_head * 32; i += IDX1_THREADS) qs[i] = ((const float4*)a.q)[i];
    // Row r's float4 j at j ^ (r & 7): lanes reading one column of 32 rows spread over all banks.
    for (u32 i = threadIdx.x; i < IDX1_ROWS * 32; i += IDX1_THREADS) {
        const u32 r = i >> 5, j = i & 31, c = c0 + r;
        ks[r * 32 + (j ^ (r & 7))] = c < n ? ((const float4*)(a.cache + (u64)c * 128))[j] : zero;
    }
    __syncthreads();
    float term[IDX1_GROUPS * IDX1_HEADS];
#pragma unroll
    for (u32 m = 0; m < IDX1_GROUPS; m++) {
        const u32 h0 = (warp + 4 * m) * IDX1_HEADS;
        if (h0 < a.n_head) {
            float d[IDX1_HEADS];
            idx1_tree<0, 32>(d, qs + h0 * 32, ks + lane * 32, lane & 7);
#pragma unroll
            for (u32 e = 0; e < IDX1_HEADS; e++) {
                const float dot = 0.0f + d[e];
                term[m * IDX1_HEADS + e] = fmaxf(dot, 0.0f) * (a.weights[h0 + e] * a.scale);
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (u32 m = 0; m < IDX1_GROUPS; m++) {
        const u32 h0 = (warp + 4 * m) * IDX1_HEADS;
        if (h0 < a.n_head)
#pragma unroll
            for (u32 e = 0; e < IDX1_HEADS; e++) terms[lane * IDX1_TERMS + h0 + e] = term[m * IDX1_HEADS + e];
    }
    __syncthreads();
    if (warp == 0 && c0 + lane < n) {
        float t = 0.0f;
        for (u32 h = 0; h < a.n_head; h++) t += terms[lane * IDX1_TERMS + h];
        a.out[c0 + lane] = t;
    }
}
#endif

// The order-preserving key of a score: larger scores, larger keys; 0 for a row that is never
// picked (at or below -1e30, or NaN: the canonical pick takes only scores above -1e30). -0 takes
// +0's key (as integers), as the float comparison ranks them equal.
__device__ __forceinline__ u32 top_k_key(float s) {
    if (!(s > -1.0e30f)) return 0;
    u32 u = __float_as_uint(s);
    if (u == 0x80000000u) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix count of `flag` over the block's threads in thread order; *total gets the
// block's count. `counts` is shared scratch of one word per warp.
__device__ __forceinline__ u32 block_count_before(bool flag, u32* total, u32* counts) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    __syncthreads();
    if (lane == 0) counts[warp] = __popc(ballot);
    __syncthreads();
    u32 before = 0, all = 0;
    for (u32 w = 0; w < nw; w++) {
        before += w < warp ? counts[w] : 0;
        all += counts[w];
    }
    *total = all;
    return before + __popc(ballot & ((1u << lane) - 1));
}

// One block of 1024 threads. The canonical pick (recorder: IndexerTopK; the CPU's
// top_k_ascending) takes k = min(top_k, rows) times the best untaken row above -1e30, ties to the
// lower row, row 0 when none is left; the result is written in ascending row order, zeros after.
// That set is found without k rounds: a radix select (four 8-bit passes over the keys) finds the
// key T of the last row taken from the pickable rows and how many rows of key T are taken (the
// lowest ones); a block-wide prefix count then writes the set in row order.
extern "C" __global__ void __launch_bounds__(1024) indexer_top_k(DS4_ARGS, IndexerTopKArgs a) {
    DS4_GUARD;
    __shared__ u32 hist[256];
    __shared__ u32 counts[32];
    __shared__ u32 pickable, digit, left;
    const u32 n = ds4_comp_rows(P, a.ratio, a.cap);
    const u32 k = min(a.top_k, n);
    const u32 t = threadIdx.x;
    if (t == 0) pickable = 0;
    __syncthreads();
    u32 mine = 0;
    for (u32 c = t; c < n; c += blockDim.x) mine += top_k_key(a.scores[c]) != 0;
    atomicAdd(&pickable, mine);
    __syncthreads();
    const u32 want = min(k, pickable);
    u32 prefix = 0, mask = 0, need = want;
    if (want > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (u32 i = t; i < 256; i += blockDim.x) hist[i] = 0;
            __syncthreads();
            for (u32 c = t; c < n; c += blockDim.x) {
                const u32 key = top_k_key(a.scores[c]);
                if (key != 0 && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
            }
            __syncthreads();
            if (t == 0) {
                // The digit holding the need-th largest key among those matching the prefix.
                u32 above = 0, d = 255;
                while (above + hist[d] < need) above += hist[d--];
                digit = d;
                left = need - above;
            }
            __syncthreads();
            prefix |= digit << shift;
            mask |= 255u << shift;
            need = left;
            __syncthreads();
        }
    }
    // Rows with a key above T, and the first `need` rows of key T, in row order; row 0 as well
    // when fewer than k rows are pickable.
    const bool fallback = pickable < k;
    u32 written = 0, ties_seen = 0;
    for (u32 base = 0; base < n; base += blockDim.x) {
        const u32 c = base + t;
        const u32 key = c < n ? top_k_key(a.scores[c]) : 0;
        const bool tie = want > 0 && key != 0 && key == prefix;
        u32 tie_total;
        const u32 tie_rank = ties_seen + block_count_before(tie, &tie_total, counts);
        const bool sel = (want > 0 && key != 0 && (key > prefix || (tie && tie_rank < need))) || (fallback && c == 0);
        u32 total;
        const u32 at = written + block_count_before(sel, &total, counts);
        if (sel) a.out[at] = (int)c;
        written += total;
        ties_seen += tie_total;
    }
    for (u32 i = written + t; i < a.top_k; i += blockDim.x) a.out[i] = 0;
}

// Sink attention for one token in the canonical order: per head, softmax over {sink} ∪ raw
// window rows ∪ visible compressed rows (K == V), the sink in the denominator only. One block
// per head; `scores` is scratch with `max_rows` floats per head.
//   s_r = dot(q, k_r) * kq_scale (the canonical f32 dot, one warp per row)
//   w_r = exp(s_r - max(sink, s...))
//   rows in chunks of DS4_ATTN_ROW_CHUNK: inside a chunk the weights and each output dim add
//   sequentially from +0; denom = exp(sink - m) + chunk sums in order; out = (sum of chunk sums) * (1/denom).
// Parallel shape: a block of up to 1024 threads per head. Scores: a warp per row. Denominator:
// a thread per chunk sums its weights, then one thread adds the chunk sums in order. Output:
// a thread per (chunk, dim) sums the chunk's rows, batches of chunks held in shared memory, and
// the thread that owns a dim adds them in order (head_dim <= blockDim, plan.rs checks it).
// Fused (plan.rs): the inverse RoPE of head h's tail, then the head's Q8_0 quantization for the
// output projection, as rope_tail and quantize_q8_0 would compute them. The whole block calls it
// once the head's output is written.
template <class A> __device__ __forceinline__ void attention_head_tail(const StepParams* P, const A& a, u32 h) {
    const u32 head_dim = a.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* oh = a.out + (u64)h * head_dim;
    if (a.rope) {
        __syncthreads();
        const u32 pairs = a.n_rot / 2;
        rope_tail_block(oh + (head_dim - a.n_rot), a.rope + (u64)P->pos * pairs * 2, pairs, true);
    }
    if (a.xq) {
        __syncthreads();
        for (u32 b = warp; b < head_dim / 32; b += nw) {
            const u32 blk = h * (head_dim / 32) + b;
            quantize_q8_0_warp(oh[b * 32 + lane], a.xq, a.xd, blk, lane);
        }
    }
}

#define ATTN_PART 4096
extern "C" __global__ void __launch_bounds__(1024) attention(DS4_ARGS, AttentionArgs a) {
    DS4_GUARD;
    __shared__ float denom_sh;
    __shared__ float part[ATTN_PART];
    const u32 h = blockIdx.x;
    const u32 head_dim = a.head_dim;
    const u32 n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    const bool indexed = a.selected != 0 && n_comp > a.top_k;
    const u32 n_vis = indexed ? a.top_k : n_comp;
    const u32 n_rows = n_raw + n_vis;
    const u32 first = P->pos + 1 - n_raw;
    const float* qh = a.q + (u64)h * head_dim;
    float* sc = a.scores + (u64)h * a.max_rows;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 n_chunks = (n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;

    // Row r: raw rows oldest first, then compressed rows in ascending order.
#define ROW_PTR(r) ((r) < n_raw ? a.raw + (u64)((first + (r)) % a.raw_cap) * head_dim \
                                : a.comp + (u64)(indexed ? a.selected[(r) - n_raw] : (int)((r) - n_raw)) * head_dim)
    for (u32 r = warp; r < n_rows; r += nw) {
        const float d = warp_dot_f32(qh, ROW_PTR(r), head_dim, lane);
        if (lane == 0) sc[r] = d * a.kq_scale;
    }
    __syncthreads();
    const float sink = a.sinks[h];
    float m = sink;
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) m = fmaxf(m, sc[r]);
    m = block_max(m);
    __syncthreads();
    for (u32 r = threadIdx.x; r < n_rows; r += blockDim.x) sc[r] = ds4_expf(sc[r] - m);
    __syncthreads();
    // Each chunk's weight sum from +0, sequentially; then the sink's weight and the chunk sums
    // in order (plan.rs: n_chunks <= ATTN_PART).
    for (u32 c = threadIdx.x; c < n_chunks; c += blockDim.x) {
        float s = 0.0f;
        const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
        for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) s += sc[r];
        part[c] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float denom = ds4_expf(sink - m);
        for (u32 c = 0; c < n_chunks; c++) denom += part[c];
        denom_sh = denom;
    }
    __syncthreads();
    const float inv = 1.0f / denom_sh;
    const u32 batch = ATTN_PART / head_dim;
    float acc = 0.0f;
    for (u32 c0 = 0; c0 < n_chunks; c0 += batch) {
        const u32 nc = min(batch, n_chunks - c0);
        for (u32 task = threadIdx.x; task < nc * head_dim; task += blockDim.x) {
            const u32 c = c0 + task / head_dim, i = task % head_dim;
            const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
            float p = 0.0f;
#pragma unroll 8
            for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) p += sc[r] * ROW_PTR(r)[i];
            part[task] = p;
        }
        __syncthreads();
        if (threadIdx.x < head_dim)
            for (u32 c = 0; c < nc; c++) acc += part[c * head_dim + threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.x < head_dim) a.out[(u64)h * head_dim + threadIdx.x] = acc * inv;
#undef ROW_PTR
    attention_head_tail(P, a, h);
}

#if DS4_CHUNK_ROWS
// attention's chunk form (backends/cuda/mod.rs: build_chunk): a block per (token row, group of
// ATTN_CHUNK_HEADS heads) instead of per (head, row), so a block reads each visible KV row from
// L2 once for its heads rather than once per head. Every (row, head) gets `attention`'s bits:
// the same dot (chunk_dot_f32's lane order, the butterfly, + onto 0), max, exp, chunk sums and
// their order; only which thread computes what differs. K == V: the rows are staged in shared
// memory in tiles of ATTN_TILE_ROWS twice, for the scores and (once the weights are known) for
// the weighted sum; the next tile is loaded into registers while the current one is used.
//   Scores: warp w owns heads 2w and 2w + 1 of the group, their q in registers.
//   Softmax: the same warp: max, exp, a lane per chunk sums its weights, the sums in order.
//   Weighted sum: a thread per (8 heads, 4 dims) walks the rows in order: p += w * v inside a
//   chunk, acc += p at its end.
// build_chunk picks it for head_dim <= 512 (one DS4_CHUNK of the dot; a multiple of 4, as
// `attention` needs) and launches blockDim == ATTN_CHUNK_THREADS (128, 256 or 512, which it also
// defines in the source): a group of blockDim / 16 heads.
#ifndef ATTN_CHUNK_THREADS
#define ATTN_CHUNK_THREADS 256
#endif
#define ATTN_CHUNK_HEADS (ATTN_CHUNK_THREADS / 16)
// Rows per tile: four float4 loads per thread fill a tile of 512-wide rows.
#define ATTN_TILE_ROWS (ATTN_CHUNK_THREADS / 32)
#define ATTN_TILE_DIM 512
#define ATTN_TILE_LOADS (ATTN_TILE_ROWS * ATTN_TILE_DIM / 4 / ATTN_CHUNK_THREADS)
// At most 128 registers a thread, so that 512 threads of the kernel fit an SM's 64K registers.
#define ATTN_CHUNK_MIN_BLOCKS (512 / ATTN_CHUNK_THREADS)
// A tile's weights are at most one per thread.
static_assert(ATTN_TILE_ROWS * ATTN_CHUNK_HEADS <= ATTN_CHUNK_THREADS, "a weight per thread");
static_assert(ATTN_CHUNK_HEADS % 8 == 0, "whole octets of heads");

// chunk_dot_f32's lane sum with q in registers (q4[u] = q[u * 128 + lane * 4 ..]) and the row
// in shared memory.
__device__ __forceinline__ float attn_tile_dot(const float4* q4, const float* k, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = u * 128 + lane * 4;
        if (i < n) {
            const float4 x = q4[u], y = *(const float4*)(k + i);
            acc += x.x * y.x;
            acc += x.y * y.y;
            acc += x.z * y.z;
            acc += x.w * y.w;
        }
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(ATTN_CHUNK_THREADS, ATTN_CHUNK_MIN_BLOCKS) attention_chunk(DS4_ARGS, AttentionArgs a) {
    DS4_GUARD;
    __shared__ __align__(16) float tile[ATTN_TILE_ROWS * ATTN_TILE_DIM];
    // The tile's weights, [row][head of the group].
    __shared__ __align__(16) float wtile[ATTN_TILE_ROWS * ATTN_CHUNK_HEADS];
    __shared__ float inv_sh[ATTN_CHUNK_HEADS];
    const u32 head_dim = a.head_dim, quads = head_dim / 4;
    const u32 h0 = blockIdx.x * ATTN_CHUNK_HEADS;
    const u32 n_group = min((u32)ATTN_CHUNK_HEADS, a.n_head - h0);  // heads of this block
    const u32 n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    const bool indexed = a.selected != 0 && n_comp > a.top_k;
    const u32 n_vis = indexed ? a.top_k : n_comp;
    const u32 n_rows = n_raw + n_vis;
    const u32 first = P->pos + 1 - n_raw;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n_chunks = (n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;

    // Row r: raw rows oldest first, then compressed rows in ascending order (as `attention`);
    // raw row r is at ring index (first + r) % raw_cap, found from the first row's.
    const u32 ring0 = first % a.raw_cap;
    auto row_ptr = [&](u32 r) -> const float* {
        if (r < n_raw) return a.raw + (u64)(ring0 + r < a.raw_cap ? ring0 + r : ring0 + r - a.raw_cap) * head_dim;
        return a.comp + (u64)(indexed ? a.selected[r - n_raw] : (int)(r - n_raw)) * head_dim;
    };
    // Tile t0's rows into registers (rows past n_rows are not read), then into shared memory:
    // thread (tj, tc) moves the float4 tc of rows tj, tj + step, ...
    const u32 step = ATTN_CHUNK_THREADS / quads, tj = threadIdx.x / quads, tc = threadIdx.x % quads;
    float4 pf[ATTN_TILE_LOADS];
    auto load_tile = [&](u32 t0) {
#pragma unroll
        for (u32 k = 0; k < ATTN_TILE_LOADS; k++) {
            const u32 j = tj + k * step;
            if (tj < step && j < ATTN_TILE_ROWS && t0 + j < n_rows) pf[k] = *(const float4*)(row_ptr(t0 + j) + 4 * tc);
        }
    };
    auto store_tile = [&](u32 t0) {
#pragma unroll
        for (u32 k = 0; k < ATTN_TILE_LOADS; k++) {
            const u32 j = tj + k * step;
            if (tj < step && j < ATTN_TILE_ROWS && t0 + j < n_rows) *(float4*)(tile + j * head_dim + 4 * tc) = pf[k];
        }
    };

    // Scores: this warp's two heads against every row.
    const u32 ha = 2 * warp, hb = 2 * warp + 1;  // within the group
    float4 qa[4], qb[4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 i = u * 128 + lane * 4;
        qa[u] = qb[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < head_dim && ha < n_group) qa[u] = *(const float4*)(a.q + (u64)(h0 + ha) * head_dim + i);
        if (i < head_dim && hb < n_group) qb[u] = *(const float4*)(a.q + (u64)(h0 + hb) * head_dim + i);
    }
    float* sca = a.scores + (u64)(h0 + ha) * a.max_rows;
    float* scb = a.scores + (u64)(h0 + hb) * a.max_rows;
    load_tile(0);
    for (u32 t0 = 0; t0 < n_rows; t0 += ATTN_TILE_ROWS) {
        __syncthreads();
        store_tile(t0);
        __syncthreads();
        if (t0 + ATTN_TILE_ROWS < n_rows) load_tile(t0 + ATTN_TILE_ROWS);
        const u32 nj = min((u32)ATTN_TILE_ROWS, n_rows - t0);
        for (u32 j = 0; j < nj; j++) {
            const float* k = tile + j * head_dim;
            if (ha < n_group) {
                float d = 0.0f;
                d += warp_sum(attn_tile_dot(qa, k, head_dim, lane));
                if (lane == 0) sca[t0 + j] = d * a.kq_scale;
            }
            if (hb < n_group) {
                float d = 0.0f;
                d += warp_sum(attn_tile_dot(qb, k, head_dim, lane));
                if (lane == 0) scb[t0 + j] = d * a.kq_scale;
            }
        }
    }
    __syncwarp();
    // Softmax of this warp's heads: scores become weights; 1 / denom per head.
    for (u32 hh = ha; hh <= hb; hh++) {
        if (hh >= n_group) break;
        float* sc = a.scores + (u64)(h0 + hh) * a.max_rows;
        const float sink = a.sinks[h0 + hh];
        float m = sink;
        for (u32 r = lane; r < n_rows; r += 32) m = fmaxf(m, sc[r]);
        m = warp_max(m);
        for (u32 r = lane; r < n_rows; r += 32) sc[r] = ds4_expf(sc[r] - m);
        __syncwarp();
        // Each chunk's weight sum from +0, sequentially; then the sink's weight and the chunk
        // sums in order.
        float denom = ds4_expf(sink - m);
        for (u32 c0 = 0; c0 < n_chunks; c0 += 32) {
            const u32 c = c0 + lane;
            float s = 0.0f;
            if (c < n_chunks) {
                const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, n_rows);
                for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) s += sc[r];
            }
            for (u32 l = 0; l < 32; l++) {
                const float cs = __shfl_sync(0xffffffffu, s, l);
                if (c0 + l < n_chunks) denom += cs;
            }
        }
        if (lane == 0) inv_sh[hh] = 1.0f / denom;
    }
    __syncthreads();

    // Weighted sum: thread (oct, dq) owns heads 8 oct .. 8 oct + 7 and dims 4 dq .. 4 dq + 3.
    const u32 oct = threadIdx.x / quads, dq = threadIdx.x % quads;
    const bool owns = oct < ATTN_CHUNK_HEADS / 8;
    const u32 wj = threadIdx.x / ATTN_CHUNK_HEADS, wh = threadIdx.x % ATTN_CHUNK_HEADS;
    float wpf = 0.0f;
    auto load_weight = [&](u32 t0) {
        if (wj < ATTN_TILE_ROWS && t0 + wj < n_rows && wh < n_group)
            wpf = a.scores[(u64)(h0 + wh) * a.max_rows + t0 + wj];
    };
    float4 acc[8], p[8];
#pragma unroll
    for (u32 k = 0; k < 8; k++) acc[k] = p[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    load_tile(0);
    load_weight(0);
    for (u32 t0 = 0; t0 < n_rows; t0 += ATTN_TILE_ROWS) {
        __syncthreads();
        store_tile(t0);
        if (wj < ATTN_TILE_ROWS) wtile[threadIdx.x] = wpf;
        __syncthreads();
        if (t0 + ATTN_TILE_ROWS < n_rows) {
            load_tile(t0 + ATTN_TILE_ROWS);
            load_weight(t0 + ATTN_TILE_ROWS);
        }
        if (!owns) continue;
        const u32 nj = min((u32)ATTN_TILE_ROWS, n_rows - t0);
        for (u32 j = 0; j < nj; j++) {
            if (j + t0 > 0 && (j + t0) % DS4_ATTN_ROW_CHUNK == 0) {
                // A chunk ends: its sums join the total in order.
#pragma unroll
                for (u32 k = 0; k < 8; k++) {
                    acc[k].x += p[k].x;
                    acc[k].y += p[k].y;
                    acc[k].z += p[k].z;
                    acc[k].w += p[k].w;
                    p[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            const float4 v = *(const float4*)(tile + j * head_dim + 4 * dq);
            const float4 w0 = *(const float4*)(wtile + j * ATTN_CHUNK_HEADS + 8 * oct);
            const float4 w1 = *(const float4*)(wtile + j * ATTN_CHUNK_HEADS + 8 * oct + 4);
            const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                p[k].x += w[k] * v.x;
                p[k].y += w[k] * v.y;
                p[k].z += w[k] * v.z;
                p[k].w += w[k] * v.w;
            }
        }
    }
    if (owns) {
#pragma unroll
        for (u32 k = 0; k < 8; k++) {
            const u32 hh = 8 * oct + k;
            if (hh >= n_group) break;
            const float inv = inv_sh[hh];
            float4 o;
            o.x = (acc[k].x + p[k].x) * inv;
            o.y = (acc[k].y + p[k].y) * inv;
            o.z = (acc[k].z + p[k].z) * inv;
            o.w = (acc[k].w + p[k].w) * inv;
            *(float4*)(a.out + (u64)(h0 + hh) * head_dim + 4 * dq) = o;
        }
    }
    // Fused (plan.rs): the inverse RoPE of each head's tail, then the heads' Q8_0 quantization,
    // as `attention` computes them.
    float* og = a.out + (u64)h0 * head_dim;
    if (a.rope) {
        __syncthreads();
        const u32 pairs = a.n_rot / 2;
        const float* trow = a.rope + (u64)P->pos * pairs * 2;
        for (u32 t = threadIdx.x; t < n_group * pairs; t += blockDim.x)
            rope_pair(og + (t / pairs) * head_dim + (head_dim - a.n_rot), trow, t % pairs, true);
    }
    if (a.xq) {
        __syncthreads();
        const u32 nw = blockDim.x >> 5;
        for (u32 b = warp; b < n_group * head_dim / 32; b += nw)
            quantize_q8_0_warp(og[b * 32 + lane], a.xq, a.xd, h0 * (head_dim / 32) + b, lane);
    }
}
#endif

#if DS4_CHUNK_ROWS
// attention's chunk form over two token rows and 16 heads a block (mod.rs: build_chunk; the
// default; DS4_CUDA_ATTN_CHUNK=1 keeps attention_chunk, =0 `attention`): each staged KV row feeds
// 32 (row, head) pairs instead of 16. Neighbouring token rows see nearly the same KV rows, so the
// block walks a "universe" of rows that covers both: the raw rows of both windows by ascending
// position, then the compressed rows by ascending index; vis[i][u] is token row i's own index of
// universe row u in `attention`'s order (raw rows oldest first, then its visible compressed rows,
// or its `selected` list), or none. Both orders ascend, so each row meets its rows in its own
// order and skips the rest. The indexer's list is ascending (indexer_top_k); a block checks it
// (strictly ascending, each entry visible) and otherwise, or when the universe overflows the
// table, runs its rows one at a time with the universe = that row's own rows (no sharing).
// Every (row, head) gets `attention`'s bits:
//   Scores: warp w owns token row w / 4 and heads 4 (w % 4) .. + 3, q of its lane's dims in
//     registers; per KV row a lane forms chunk_dot_f32's lane sums of its 4 heads and the
//     butterfly's first level (l + (l ^ 16)) by one shuffle; then lane (row, head) of the warp
//     adds the 16 level-one sums in the butterfly's tree, d = 0 + that, times kq_scale.
//     The lane sum's first product enters without `0 +` (the sum feeds d = 0 + ..., which
//     absorbs a zero's sign).
//   Softmax: a warp per (row, head) as attention_chunk; the chunk sums read the weights from
//     shared memory when they fit (1024 floats a warp).
//   Weighted sum: thread (row, 8 heads, 8 dims) walks its row's rows in order: p += w * v inside
//     a chunk of the row's own index, acc += p at its end; out = (acc + p) * inv.
// The KV rows are staged in tiles of ATTN_ROWS_TILE rows twice (scores, then the weighted sum),
// the next tile in registers while the current one is used. head_dim <= 512 and a multiple of 4
// (plan.rs, mod.rs). The token row count is in cond bits 50..62; blockIdx.y picks the row pair.
#define ATTN_ROWS_THREADS 256
#define ATTN_ROWS_HEADS 16
#define ATTN_ROWS_TILE 8
#define ATTN_ROWS_VIS 3072  // universe rows vis holds
#define ATTN_ROWS_NONE 0xffffu
#define ATTN_ROWS_LOADS (ATTN_ROWS_TILE * 128 / ATTN_ROWS_THREADS)

// One token row of a block.
struct AttnRowsY {
    AttentionArgs a;  // its pointers
    u32 pos, n_raw, n_comp, n_rows, first;
    bool indexed, on;
};

extern "C" __global__ void __launch_bounds__(ATTN_ROWS_THREADS, 1) attention_rows(DS4_ARGS, AttentionArgs a0) {
    ds4_wait_predecessor();
    // The KV tile, then per warp the level-one sums of [tile row][lane ^ tile row][head] (the xor
    // spreads the banks); during the softmax, 1024 floats a warp for its weights.
    __shared__ __align__(16) float smem[ATTN_ROWS_TILE * 512 + 8 * ATTN_ROWS_TILE * 64];
    float* const tile = smem;
    float* const part = smem + ATTN_ROWS_TILE * 512;
    __shared__ __align__(16) float wt[ATTN_ROWS_TILE][2][ATTN_ROWS_HEADS];  // weights [row][token row][head]
    __shared__ u16 vis[2][ATTN_ROWS_VIS];
    __shared__ float inv_sh[2][ATTN_ROWS_HEADS];
    __shared__ u32 flag_sh;
    const u32 rows = (u32)(cond >> 50) & 0x1fff;
    const u32 head_dim = a0.head_dim, quads = head_dim / 4;
    const u32 h0 = blockIdx.x * ATTN_ROWS_HEADS, n_group = min((u32)ATTN_ROWS_HEADS, a0.n_head - h0);
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    AttnRowsY Y[2];
#pragma unroll
    for (u32 i = 0; i < 2; i++) {
        const u32 y = blockIdx.y * 2 + i;
        AttnRowsY& v = Y[i];
        v.a = a0;
        ds4_row(v.a, R, y);
        v.on = y < rows && ds4_cond(P + y, cond);
        v.pos = v.on ? P[y].pos : 0;
        v.n_raw = v.on ? ds4_raw_rows(P + y, a0.window, a0.raw_cap) : 0;
        v.n_comp = v.on ? ds4_comp_rows(P + y, a0.ratio, a0.comp_cap) : 0;
        v.indexed = a0.selected != 0 && v.n_comp > a0.top_k;
        v.n_rows = v.n_raw + (v.indexed ? a0.top_k : v.n_comp);
        v.first = v.pos + 1 - v.n_raw;
    }
    if (!Y[0].on && !Y[1].on) return;

    // The shared universe when both rows run: raw positions lo..hi, then compressed rows 0..n_comp.
    const u32 lo = min(Y[0].first, Y[1].first), hi = max(Y[0].pos, Y[1].pos);
    const u32 u_raw = hi + 1 - lo, u_all = u_raw + max(Y[0].n_comp, Y[1].n_comp);
    bool shared = Y[0].on && Y[1].on && hi - lo < ATTN_ROWS_VIS && u_all <= ATTN_ROWS_VIS;
    if (shared) {
        for (u32 u = tid; u < u_all; u += ATTN_ROWS_THREADS)
#pragma unroll
            for (u32 i = 0; i < 2; i++) {
                const AttnRowsY& v = Y[i];
                u32 r = ATTN_ROWS_NONE;
                if (u < u_raw) {
                    const u32 p = lo + u;
                    if (p >= v.first && p <= v.pos) r = p - v.first;
                } else if (!v.indexed && u - u_raw < v.n_comp) {
                    r = v.n_raw + (u - u_raw);
                }
                vis[i][u] = (u16)r;
            }
        if (tid == 0) flag_sh = 0;
        __syncthreads();
#pragma unroll
        for (u32 i = 0; i < 2; i++) {
            const AttnRowsY& v = Y[i];
            if (!v.indexed) continue;
            for (u32 e = tid; e < a0.top_k; e += ATTN_ROWS_THREADS) {
                const int c = v.a.selected[e];
                const bool ok = c >= 0 && (u32)c < v.n_comp && (e == 0 || v.a.selected[e - 1] < c);
                if (ok)
                    vis[i][u_raw + c] = (u16)(v.n_raw + e);
                else
                    flag_sh = 1;
            }
        }
        __syncthreads();
        shared = flag_sh == 0;
    }

    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // One pass of the block over a universe: `single` 2 is the shared one; 0 or 1 is that token
    // row alone, its own rows in order (universe row u = its row u).
    auto run = [&](u32 single) {
        const u32 n_univ = single < 2 ? Y[single].n_rows : u_all;
        auto mine = [&](u32 i) { return single < 2 ? i == single : Y[i].on; };
        auto visof = [&](u32 i, u32 u) -> u32 {
            if (single < 2) return i == single ? u : ATTN_ROWS_NONE;
            return vis[i][u];
        };
        auto kv_row = [&](u32 u) -> const float* {
            if (single < 2) {
                const AttnRowsY& v = Y[single];
                if (u < v.n_raw) return a0.raw + (u64)((v.first + u) % a0.raw_cap) * head_dim;
                return a0.comp + (u64)(v.indexed ? v.a.selected[u - v.n_raw] : (int)(u - v.n_raw)) * head_dim;
            }
            if (u < u_raw) return a0.raw + (u64)((lo + u) % a0.raw_cap) * head_dim;
            return a0.comp + (u64)(u - u_raw) * head_dim;
        };
        float4 pf[ATTN_ROWS_LOADS];
        auto load_tile = [&](u32 t0) {
#pragma unroll
            for (u32 k = 0; k < ATTN_ROWS_LOADS; k++) {
                const u32 f = tid + k * ATTN_ROWS_THREADS, j = f / quads;
                if (j < ATTN_ROWS_TILE && t0 + j < n_univ) pf[k] = *(const float4*)(kv_row(t0 + j) + 4 * (f % quads));
            }
        };
        auto store_tile = [&](u32 t0) {
#pragma unroll
            for (u32 k = 0; k < ATTN_ROWS_LOADS; k++) {
                const u32 f = tid + k * ATTN_ROWS_THREADS, j = f / quads;
                if (j < ATTN_ROWS_TILE && t0 + j < n_univ) *(float4*)(tile + j * 512 + 4 * (f % quads)) = pf[k];
            }
        };
        __syncthreads();
        // The tile's dims past head_dim are +0 for the scores (staging writes the first head_dim).
        for (u32 f = tid; f < ATTN_ROWS_TILE * 128; f += ATTN_ROWS_THREADS) *(float4*)(tile + 4 * f) = zero4;

        // Scores: this warp's token row and 4 heads.
        const u32 si = warp >> 2, hq0 = (warp & 3) * 4;
        const AttnRowsY ys = si ? Y[1] : Y[0];
        const bool on = mine(si);
        float4 q[4][4];
#pragma unroll
        for (u32 k = 0; k < 4; k++)
#pragma unroll
            for (u32 u = 0; u < 4; u++) {
                const u32 d = u * 128 + lane * 4;
                q[k][u] = zero4;
                if (on && d < head_dim && hq0 + k < n_group)
                    q[k][u] = *(const float4*)(ys.a.q + (u64)(h0 + hq0 + k) * head_dim + d);
            }
        load_tile(0);
        for (u32 t0 = 0; t0 < n_univ; t0 += ATTN_ROWS_TILE) {
            __syncthreads();
            store_tile(t0);
            __syncthreads();
            if (t0 + ATTN_ROWS_TILE < n_univ) load_tile(t0 + ATTN_ROWS_TILE);
            if (!on) continue;
            const u32 nj = min((u32)ATTN_ROWS_TILE, n_univ - t0);
            for (u32 jj = 0; jj < nj; jj++) {
                if (visof(si, t0 + jj) == ATTN_ROWS_NONE) continue;
                // Dims past head_dim hold +0 in q and in the tile: their products and sums are
                // +0, as the lane sums that skip them (no branch per float4).
                const float* kr = tile + jj * 512 + lane * 4;
                float acc[4];
                const float4 y0 = *(const float4*)kr;
#pragma unroll
                for (u32 k = 0; k < 4; k++) {
                    // The lane's first product enters without `0 +` (see above).
                    acc[k] = q[k][0].x * y0.x;
                    acc[k] += q[k][0].y * y0.y;
                    acc[k] += q[k][0].z * y0.z;
                    acc[k] += q[k][0].w * y0.w;
                }
#pragma unroll
                for (u32 u = 1; u < 4; u++) {
                    const float4 y = *(const float4*)(kr + u * 128);
#pragma unroll
                    for (u32 k = 0; k < 4; k++) {
                        acc[k] += q[k][u].x * y.x;
                        acc[k] += q[k][u].y * y.y;
                        acc[k] += q[k][u].z * y.z;
                        acc[k] += q[k][u].w * y.w;
                    }
                }
                float4 s1;
                s1.x = acc[0] + __shfl_xor_sync(0xffffffffu, acc[0], 16);
                s1.y = acc[1] + __shfl_xor_sync(0xffffffffu, acc[1], 16);
                s1.z = acc[2] + __shfl_xor_sync(0xffffffffu, acc[2], 16);
                s1.w = acc[3] + __shfl_xor_sync(0xffffffffu, acc[3], 16);
                if (lane < 16) *(float4*)(part + ((warp * ATTN_ROWS_TILE + jj) * 16 + (lane ^ jj)) * 4) = s1;
            }
            __syncwarp();
            // Lane (tile row lane / 4, head lane % 4): the butterfly's levels 8, 4, 2, 1 of the
            // level-one sums of lanes 0..15.
            const u32 mj = lane >> 2, mk = lane & 3;
            if (mj < nj && hq0 + mk < n_group) {
                const u32 r = visof(si, t0 + mj);
                if (r != ATTN_ROWS_NONE) {
                    float s[16];
#pragma unroll
                    for (u32 l = 0; l < 16; l++) s[l] = part[((warp * ATTN_ROWS_TILE + mj) * 16 + (l ^ mj)) * 4 + mk];
#pragma unroll
                    for (u32 l = 0; l < 8; l++) s[l] = s[l] + s[l + 8];
#pragma unroll
                    for (u32 l = 0; l < 4; l++) s[l] = s[l] + s[l + 4];
#pragma unroll
                    for (u32 l = 0; l < 2; l++) s[l] = s[l] + s[l + 2];
                    float d = 0.0f;
                    d += s[0] + s[1];
                    ys.a.scores[(u64)(h0 + hq0 + mk) * a0.max_rows + r] = d * a0.kq_scale;
                }
            }
        }
        __syncthreads();
        // Softmax: warp w takes (token row w / 4, head 4 (w % 4) + k) for k = 0..3. The weights
        // also go to the warp's buffer (chunk c's row r at r + c, so that the lanes' chunk sums
        // read distinct banks) when they fit, for the chunk sums.
        const u32 n_chunks = (ys.n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;
        float* const wbuf = smem + warp * 1024;
        const bool inbuf = ys.n_rows + n_chunks <= 1024;
        for (u32 k = 0; k < 4; k++) {
            const u32 hh = hq0 + k;
            if (!on || hh >= n_group) break;
            float* sc = ys.a.scores + (u64)(h0 + hh) * a0.max_rows;
            const float sink = a0.sinks[h0 + hh];
            float m = sink;
            for (u32 r = lane; r < ys.n_rows; r += 32) m = fmaxf(m, sc[r]);
            m = warp_max(m);
            for (u32 r = lane; r < ys.n_rows; r += 32) {
                const float e = ds4_expf(sc[r] - m);
                sc[r] = e;
                if (inbuf) wbuf[r + r / DS4_ATTN_ROW_CHUNK] = e;
            }
            __syncwarp();
            // Each chunk's weight sum from +0, sequentially; then the sink's weight and the chunk
            // sums in order.
            float denom = ds4_expf(sink - m);
            for (u32 c0 = 0; c0 < n_chunks; c0 += 32) {
                const u32 c = c0 + lane;
                float s = 0.0f;
                if (c < n_chunks) {
                    const u32 r1 = min((c + 1) * DS4_ATTN_ROW_CHUNK, ys.n_rows);
                    for (u32 r = c * DS4_ATTN_ROW_CHUNK; r < r1; r++) s += inbuf ? wbuf[r + c] : sc[r];
                }
                for (u32 l = 0; l < 32; l++) {
                    const float cs = __shfl_sync(0xffffffffu, s, l);
                    if (c0 + l < n_chunks) denom += cs;
                }
            }
            if (lane == 0) inv_sh[si][hh] = 1.0f / denom;
            __syncwarp();
        }
        __syncthreads();

        // Weighted sum: thread (token row tid / 128, heads 8 oct .. + 7, dims 4 dq .. + 3 and
        // 256 + 4 dq .. + 3); the same token row as the warp's scores.
        const u32 oct = (tid >> 6) & 1, dq = tid & 63;
        // Staging the weights: thread (tile row, token row, head).
        const u32 wj = tid >> 5, wi = (tid >> 4) & 1, wh = tid & 15;
        const float* wsc = (wi ? Y[1].a.scores : Y[0].a.scores) + (u64)(h0 + wh) * a0.max_rows;
        float wpf = 0.0f;
        auto load_weight = [&](u32 t0) {
            wpf = 0.0f;
            if (t0 + wj < n_univ && mine(wi) && wh < n_group) {
                const u32 r = visof(wi, t0 + wj);
                if (r != ATTN_ROWS_NONE) wpf = wsc[r];
            }
        };
        float4 acc[8][2], p[8][2];
#pragma unroll
        for (u32 k = 0; k < 8; k++) acc[k][0] = acc[k][1] = p[k][0] = p[k][1] = zero4;
        load_tile(0);
        load_weight(0);
        for (u32 t0 = 0; t0 < n_univ; t0 += ATTN_ROWS_TILE) {
            __syncthreads();
            store_tile(t0);
            (&wt[0][0][0])[tid] = wpf;
            __syncthreads();
            if (t0 + ATTN_ROWS_TILE < n_univ) {
                load_tile(t0 + ATTN_ROWS_TILE);
                load_weight(t0 + ATTN_ROWS_TILE);
            }
            if (!on) continue;
            const u32 nj = min((u32)ATTN_ROWS_TILE, n_univ - t0);
            for (u32 j = 0; j < nj; j++) {
                const u32 r = visof(si, t0 + j);
                if (r == ATTN_ROWS_NONE) continue;
                if (r > 0 && r % DS4_ATTN_ROW_CHUNK == 0) {
                    // A chunk of this token row's rows ends: its sums join the total in order.
#pragma unroll
                    for (u32 k = 0; k < 8; k++)
#pragma unroll
                        for (u32 hf = 0; hf < 2; hf++) {
                            acc[k][hf].x += p[k][hf].x;
                            acc[k][hf].y += p[k][hf].y;
                            acc[k][hf].z += p[k][hf].z;
                            acc[k][hf].w += p[k][hf].w;
                            p[k][hf] = zero4;
                        }
                }
                const float4 v[2] = {*(const float4*)(tile + j * 512 + 4 * dq), *(const float4*)(tile + j * 512 + 256 + 4 * dq)};
                const float4 w0 = *(const float4*)&wt[j][si][8 * oct];
                const float4 w1 = *(const float4*)&wt[j][si][8 * oct + 4];
                const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (u32 k = 0; k < 8; k++)
#pragma unroll
                    for (u32 hf = 0; hf < 2; hf++) {
                        p[k][hf].x += w[k] * v[hf].x;
                        p[k][hf].y += w[k] * v[hf].y;
                        p[k][hf].z += w[k] * v[hf].z;
                        p[k][hf].w += w[k] * v[hf].w;
                    }
            }
        }
        if (on) {
#pragma unroll
            for (u32 k = 0; k < 8; k++) {
                const u32 hh = 8 * oct + k;
                if (hh >= n_group) break;
                const float inv = inv_sh[si][hh];
#pragma unroll
                for (u32 hf = 0; hf < 2; hf++) {
                    const u32 d = hf * 256 + 4 * dq;
                    if (d >= head_dim) break;
                    float4 o;
                    o.x = (acc[k][hf].x + p[k][hf].x) * inv;
                    o.y = (acc[k][hf].y + p[k][hf].y) * inv;
                    o.z = (acc[k][hf].z + p[k][hf].z) * inv;
                    o.w = (acc[k][hf].w + p[k][hf].w) * inv;
                    *(float4*)(ys.a.out + (u64)(h0 + hh) * head_dim + d) = o;
                }
            }
        }
    };
    if (shared) {
        run(2);
    } else {
        if (Y[0].on) run(0);
        if (Y[1].on) run(1);
    }
    // Fused (plan.rs): the inverse RoPE of each head's tail, then the heads' Q8_0 quantization,
    // as `attention` computes them, for both token rows.
    if (a0.rope) {
        __syncthreads();
        const u32 pairs = a0.n_rot / 2, per = n_group * pairs;
        for (u32 t = tid; t < 2 * per; t += ATTN_ROWS_THREADS) {
            const u32 i = t / per, tt = t % per;
            const AttnRowsY& v = Y[i];
            if (!v.on) continue;
            float* og = v.a.out + (u64)h0 * head_dim;
            rope_pair(og + (tt / pairs) * head_dim + (head_dim - a0.n_rot), a0.rope + (u64)v.pos * pairs * 2, tt % pairs, true);
        }
    }
    if (a0.xq) {
        __syncthreads();
        const u32 nb = n_group * head_dim / 32;
        for (u32 b = warp; b < 2 * nb; b += ATTN_ROWS_THREADS / 32) {
            const u32 i = b / nb, bb = b % nb;
            const AttnRowsY& v = Y[i];
            if (!v.on) continue;
            quantize_q8_0_warp(v.a.out[(u64)h0 * head_dim + bb * 32 + lane], v.a.xq, v.a.xd, h0 * (head_dim / 32) + bb, lane);
        }
    }
}
#endif

#if !DS4_CHUNK_ROWS
// attention's decode form split over the KV rows (plan.rs picks it for a decode program with
// head_dim <= 512; DS4_CUDA_ATTN_DECODE=0 keeps `attention`). `attention` runs a block per head
// that reads every visible row twice; here three launches spread the rows over the GPU and read
// each row from L2 once per group of ATTN_SPLIT_HEADS heads per pass:
//   attention_scores: a block per (slice of ATTN_SCORE_ROWS rows, head group) stages the slice's
//     rows in shared memory and stores the group's scores, and each head's max over the slice;
//   attention_partial: a block per (64-row chunk, head group, slice of blockDim dims): m = the
//     head's max over the slices and its sink, the chunk's weights, their sum (slice 0), and the
//     chunk's weighted sum of the rows per (head, dim);
//   attention_combine: a block per head adds the chunk sums in order, scales, then the fused RoPE
//     and Q8_0 tail.
// Every (row, head) gets `attention`'s bits: the same dot (chunk_dot_f32's lane order, the
// butterfly, + onto 0), exp(s - m) with the same m (max is order-free), each chunk's weights and
// weighted rows added sequentially from +0, denom = exp(sink - m) + the chunk sums in order, out =
// (0 + the chunks' sums in order) * (1 / denom). Scratch (plan.rs): `maxes` [slice][head], `sums`
// [1 + chunk][head] (row 0: m), `parts` [chunk][head][dim]. ATTN_SPLIT_HEADS, ATTN_SCORE_ROWS,
// ATTN_SCORE_THREADS and ATTN_SUM_THREADS come from plan.rs, which sizes the grids and scratch
// by them (mod.rs: kernel_source).
#define ATTN_WARP_HEADS 4  // heads per warp in attention_scores, their q in registers
#define ATTN_HEAD_SETS (ATTN_SPLIT_HEADS / ATTN_WARP_HEADS)
#define ATTN_ROW_SETS (ATTN_SCORE_THREADS / 32 / ATTN_HEAD_SETS)
static_assert(ATTN_SPLIT_HEADS % ATTN_WARP_HEADS == 0 && ATTN_ROW_SETS >= 1, "whole head sets per block");
static_assert(ATTN_SPLIT_HEADS % 4 == 0, "the weights of a row as float4s");
static_assert(ATTN_SCORE_ROWS <= ATTN_SCORE_THREADS && ATTN_SUM_THREADS >= DS4_ATTN_ROW_CHUNK, "a thread per row pointer");
static_assert(ATTN_SPLIT_HEADS == 16 && ATTN_SUM_THREADS % 32 == 0, "attention_partial: lanes l and l ^ 16 share a head");

// The visible rows of this token, as `attention` counts them: the raw rows oldest first (raw row
// r at ring index (ring0 + r) % raw_cap), then the visible compressed rows ascending.
struct AttnRows {
    u32 n_raw, n_rows, ring0;
    bool indexed;
};
template <class A> __device__ __forceinline__ AttnRows attn_rows(const StepParams* P, const A& a) {
    AttnRows v;
    v.n_raw = ds4_raw_rows(P, a.window, a.raw_cap);
    const u32 n_comp = ds4_comp_rows(P, a.ratio, a.comp_cap);
    v.indexed = a.selected != 0 && n_comp > a.top_k;
    v.n_rows = v.n_raw + (v.indexed ? a.top_k : n_comp);
    v.ring0 = (P->pos + 1 - v.n_raw) % a.raw_cap;
    return v;
}
template <class A> __device__ __forceinline__ const float* attn_row(const A& a, const AttnRows& v, u32 r) {
    if (r < v.n_raw) {
        const u32 i = v.ring0 + r;
        return a.raw + (u64)(i < a.raw_cap ? i : i - a.raw_cap) * a.head_dim;
    }
    return a.comp + (u64)(v.indexed ? a.selected[r - v.n_raw] : (int)(r - v.n_raw)) * a.head_dim;
}
// fmaxf's identity: fmaxf(NaN, x) = x, so a max that starts here is the max over a set whatever
// its grouping (NaN only when every value is NaN, as in `attention`).
#define ATTN_MAX_NONE __int_as_float(0x7fc00000)

// Grid: slices of ATTN_SCORE_ROWS rows x head groups (group fastest, so that the groups of a
// slice read its rows from L2 close together). Warp w holds q of ATTN_WARP_HEADS heads (head set
// w % ATTN_HEAD_SETS) in registers and takes every ATTN_ROW_SETS-th row of the slice.
extern "C" __global__ void __launch_bounds__(ATTN_SCORE_THREADS) attention_scores(DS4_ARGS, AttentionScoresArgs a) {
    DS4_GUARD;
    __shared__ __align__(16) float tile[ATTN_SCORE_ROWS * 512];
    __shared__ const float* rowp[ATTN_SCORE_ROWS];
    __shared__ float wmax[ATTN_SCORE_THREADS / 32][ATTN_WARP_HEADS];
    const AttnRows v = attn_rows(P, a);
    const u32 n_groups = (a.n_head + ATTN_SPLIT_HEADS - 1) / ATTN_SPLIT_HEADS;
    const u32 g = blockIdx.x % n_groups, slice = blockIdx.x / n_groups, r0 = slice * ATTN_SCORE_ROWS;
    if (r0 >= v.n_rows) return;
    const u32 nj = min((u32)ATTN_SCORE_ROWS, v.n_rows - r0);
    const u32 head_dim = a.head_dim, quads = head_dim / 4;
    const u32 h0 = g * ATTN_SPLIT_HEADS, n_group = min((u32)ATTN_SPLIT_HEADS, a.n_head - h0);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x < nj) rowp[threadIdx.x] = attn_row(a, v, r0 + threadIdx.x);
    // q of this warp's heads (zeros past the group or head_dim), loaded while the rows are found.
    const u32 hs = warp % ATTN_HEAD_SETS, rs = warp / ATTN_HEAD_SETS;
    float4 q[ATTN_WARP_HEADS][4];
#pragma unroll
    for (u32 k = 0; k < ATTN_WARP_HEADS; k++) {
        const u32 hh = hs * ATTN_WARP_HEADS + k;
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 i = u * 128 + lane * 4;
            q[k][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (i < head_dim && hh < n_group) q[k][u] = *(const float4*)(a.q + (u64)(h0 + hh) * head_dim + i);
        }
    }
    __syncthreads();
    // The slice's rows into shared memory: all loads first, then the stores.
    constexpr u32 LOADS = ATTN_SCORE_ROWS * 128 / ATTN_SCORE_THREADS;
    float4 buf[LOADS];
#pragma unroll
    for (u32 k = 0; k < LOADS; k++) {
        const u32 f = threadIdx.x + k * ATTN_SCORE_THREADS;
        if (f < nj * quads) buf[k] = *(const float4*)(rowp[f / quads] + 4 * (f % quads));
    }
#pragma unroll
    for (u32 k = 0; k < LOADS; k++) {
        const u32 f = threadIdx.x + k * ATTN_SCORE_THREADS;
        if (f < nj * quads) *(float4*)(tile + f * 4) = buf[k];
    }
    __syncthreads();
    float mx[ATTN_WARP_HEADS];
#pragma unroll
    for (u32 k = 0; k < ATTN_WARP_HEADS; k++) mx[k] = ATTN_MAX_NONE;
    for (u32 j = rs; j < nj; j += ATTN_ROW_SETS) {
        // chunk_dot_f32's lane sums of the row against each head (the row's float4 read once).
        float acc[ATTN_WARP_HEADS];
#pragma unroll
        for (u32 k = 0; k < ATTN_WARP_HEADS; k++) acc[k] = 0.0f;
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 i = u * 128 + lane * 4;
            if (i < head_dim) {
                const float4 y = *(const float4*)(tile + j * head_dim + i);
#pragma unroll
                for (u32 k = 0; k < ATTN_WARP_HEADS; k++) {
                    acc[k] += q[k][u].x * y.x;
                    acc[k] += q[k][u].y * y.y;
                    acc[k] += q[k][u].z * y.z;
                    acc[k] += q[k][u].w * y.w;
                }
            }
        }
#pragma unroll
        for (u32 k = 0; k < ATTN_WARP_HEADS; k++) {
            float d = 0.0f;
            d += warp_sum(acc[k]);
            const float s = d * a.kq_scale;
            const u32 hh = hs * ATTN_WARP_HEADS + k;
            if (hh < n_group) {
                if (lane == 0) a.scores[(u64)(h0 + hh) * a.max_rows + r0 + j] = s;
                mx[k] = fmaxf(mx[k], s);
            }
        }
    }
    if (lane == 0)
#pragma unroll
        for (u32 k = 0; k < ATTN_WARP_HEADS; k++) wmax[warp][k] = mx[k];
    __syncthreads();
    if (threadIdx.x < n_group) {
        const u32 hs2 = threadIdx.x / ATTN_WARP_HEADS, k = threadIdx.x % ATTN_WARP_HEADS;
        float m = ATTN_MAX_NONE;
        for (u32 r = 0; r < ATTN_ROW_SETS; r++) m = fmaxf(m, wmax[r * ATTN_HEAD_SETS + hs2][k]);
        a.maxes[(u64)slice * a.n_head + h0 + threadIdx.x] = m;
    }
}

// Grid: 64-row chunks x head groups x dim slices (slice fastest); ATTN_SUM_THREADS (>= 64, the
// block size) dims per slice. Thread d owns dim d of the slice for all the group's heads, so each value of a row is
// read by one thread of the block; the chunk's values are loaded into registers first, and
// arrive while the weights are computed.
extern "C" __global__ void __launch_bounds__(ATTN_SUM_THREADS) attention_partial(DS4_ARGS, AttentionPartialArgs a) {
    DS4_GUARD;
    __shared__ const float* rowp[DS4_ATTN_ROW_CHUNK];
    __shared__ __align__(16) float wsh[DS4_ATTN_ROW_CHUNK * ATTN_SPLIT_HEADS];  // [row][head]
    __shared__ float wmax[ATTN_SUM_THREADS / 32][ATTN_SPLIT_HEADS];
    __shared__ float m_sh[ATTN_SPLIT_HEADS];
    const AttnRows v = attn_rows(P, a);
    const u32 head_dim = a.head_dim;
    const u32 n_groups = (a.n_head + ATTN_SPLIT_HEADS - 1) / ATTN_SPLIT_HEADS;
    const u32 n_dslices = (head_dim + ATTN_SUM_THREADS - 1) / ATTN_SUM_THREADS;
    const u32 ds = blockIdx.x % n_dslices, g = blockIdx.x / n_dslices % n_groups;
    const u32 c = blockIdx.x / n_dslices / n_groups, r0 = c * DS4_ATTN_ROW_CHUNK;
    if (r0 >= v.n_rows) return;
    const u32 nj = min((u32)DS4_ATTN_ROW_CHUNK, v.n_rows - r0);
    const u32 h0 = g * ATTN_SPLIT_HEADS, n_group = min((u32)ATTN_SPLIT_HEADS, a.n_head - h0);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 d = ds * ATTN_SUM_THREADS + threadIdx.x;
    // Everything this block reads that no other load depends on is requested at once: the row
    // addresses (through `selected`), the chunk's scores (thread t: rows t / 16 + k * stride,
    // head t % 16), the slices' maxes and the sinks.
    if (threadIdx.x < nj) rowp[threadIdx.x] = attn_row(a, v, r0 + threadIdx.x);
    constexpr u32 WEIGHTS = DS4_ATTN_ROW_CHUNK * ATTN_SPLIT_HEADS / ATTN_SUM_THREADS;
    const u32 hh = threadIdx.x % ATTN_SPLIT_HEADS, j0 = threadIdx.x / ATTN_SPLIT_HEADS;
    constexpr u32 JSTEP = ATTN_SUM_THREADS / ATTN_SPLIT_HEADS;
    float sc[WEIGHTS];
#pragma unroll
    for (u32 k = 0; k < WEIGHTS; k++) {
        const u32 j = j0 + k * JSTEP;
        sc[k] = hh < n_group && j < nj ? a.scores[(u64)(h0 + hh) * a.max_rows + r0 + j] : 0.0f;
    }
    const float sink = hh < n_group ? a.sinks[h0 + hh] : 0.0f;
    // m per head: the sink and the slices' maxes (attention_scores); thread t takes head t % 16
    // of every JSTEP-th slice.
    const u32 n_slices = (v.n_rows + ATTN_SCORE_ROWS - 1) / ATTN_SCORE_ROWS;
    float mx = ATTN_MAX_NONE;
    if (hh < n_group)
        for (u32 s = j0; s < n_slices; s += JSTEP) mx = fmaxf(mx, a.maxes[(u64)s * a.n_head + h0 + hh]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    if (lane < ATTN_SPLIT_HEADS) wmax[warp][lane] = mx;
    __syncthreads();
    // The chunk's values of dim d into registers; they arrive while the weights are computed.
    float val[DS4_ATTN_ROW_CHUNK];
#pragma unroll
    for (u32 j = 0; j < DS4_ATTN_ROW_CHUNK; j++) val[j] = j < nj && d < head_dim ? rowp[j][d] : 0.0f;
    if (threadIdx.x < ATTN_SPLIT_HEADS) {
        float m = sink;
        for (u32 w = 0; w < ATTN_SUM_THREADS / 32; w++) m = fmaxf(m, wmax[w][threadIdx.x]);
        m_sh[threadIdx.x] = m;
    }
    __syncthreads();
    // The chunk's weights, [row][head]; zero past the rows and the group.
#pragma unroll
    for (u32 k = 0; k < WEIGHTS; k++) {
        const u32 j = j0 + k * JSTEP;
        wsh[j * ATTN_SPLIT_HEADS + hh] = hh < n_group && j < nj ? ds4_expf(sc[k] - m_sh[hh]) : 0.0f;
    }
    __syncthreads();
    // Slice 0: the chunk's weight sum per head, sequentially from +0 (and chunk 0: m per head).
    if (ds == 0 && threadIdx.x < n_group) {
        const u32 k = threadIdx.x;
        float s = 0.0f;
#pragma unroll 16
        for (u32 j = 0; j < nj; j++) s += wsh[j * ATTN_SPLIT_HEADS + k];
        a.sums[(u64)(1 + c) * a.n_head + h0 + k] = s;
        if (c == 0) a.sums[h0 + k] = m_sh[k];
    }
    if (d >= head_dim) return;
    // The chunk's weighted sum of dim d per head, sequentially from +0.
    float p[ATTN_SPLIT_HEADS];
#pragma unroll
    for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++) p[k] = 0.0f;
#pragma unroll
    for (u32 j = 0; j < DS4_ATTN_ROW_CHUNK; j++) {
        if (j < nj) {
#pragma unroll
            for (u32 k4 = 0; k4 < ATTN_SPLIT_HEADS; k4 += 4) {
                const float4 w = *(const float4*)(wsh + j * ATTN_SPLIT_HEADS + k4);
                p[k4 + 0] += w.x * val[j];
                p[k4 + 1] += w.y * val[j];
                p[k4 + 2] += w.z * val[j];
                p[k4 + 3] += w.w * val[j];
            }
        }
    }
#pragma unroll
    for (u32 k = 0; k < ATTN_SPLIT_HEADS; k++)
        if (k < n_group) a.parts[((u64)c * a.n_head + h0 + k) * head_dim + d] = p[k];
}

// A block per head, a thread per dim (blockDim >= head_dim): the chunks' sums in order, the
// denominator, the scale, then the fused tail as `attention`'s.
extern "C" __global__ void __launch_bounds__(512) attention_combine(DS4_ARGS, AttentionCombineArgs a) {
    DS4_GUARD;
    __shared__ float inv_sh;
    const AttnRows v = attn_rows(P, a);
    const u32 h = blockIdx.x, head_dim = a.head_dim;
    const u32 n_chunks = (v.n_rows + DS4_ATTN_ROW_CHUNK - 1) / DS4_ATTN_ROW_CHUNK;
    if (threadIdx.x == 0) {
        float denom = ds4_expf(a.sinks[h] - a.sums[h]);
#pragma unroll 8
        for (u32 c = 0; c < n_chunks; c++) denom += a.sums[(u64)(1 + c) * a.n_head + h];
        inv_sh = 1.0f / denom;
    }
    float acc = 0.0f;
    const u32 d = threadIdx.x;
    if (d < head_dim)
#pragma unroll 8
        for (u32 c = 0; c < n_chunks; c++) acc += a.parts[((u64)c * a.n_head + h) * head_dim + d];
    __syncthreads();
    if (d < head_dim) a.out[(u64)h * head_dim + d] = acc * inv_sh;
    attention_head_tail(P, a, h);
}
#endif

// Router and routed experts. Activations are quantized to Q8_K (256-blocks), the mid vector is
// re-quantized before the down projection, as ds4's CPU path does. Expert weights are
// IQ2_XXS (16), Q2_K (10) or Q4_K (12), per tensor.

// One block of 256 threads computes p = sqrt(softplus(logit)); then warp 0 takes the experts
// from the hash table (by token) or the top n_used of p + bias (ties to the lower expert);
// weights p[sel] / sum * scale.
extern "C" __global__ void router_select(DS4_ARGS, RouterSelectArgs a) {
    DS4_GUARD;
    const float* logits = a.logits;
    const float* bias = a.bias;
    const u32 n_expert = a.n_expert, n_used = a.n_used;
    __shared__ float probs[1024];
    __shared__ float choice[1024];
    for (u32 i = threadIdx.x; i < n_expert; i += blockDim.x) {
        const float x = logits[i];
        const float sp = x > 20.0f ? x : (x < -20.0f ? ds4_expf(x) : ds4_log1pf(ds4_expf(x)));
        probs[i] = sqrtf(sp);
        choice[i] = probs[i] + (bias ? bias[i] : 0.0f);
    }
    __syncthreads();
    __shared__ int sel[16];
    const u32 t = threadIdx.x, lane = t & 31;
    // Warp 0 alone selects: no block barrier per round.
    if (t >= 32) return;
    if (a.hash) {
        // A token past the table (refused on the host) or an id past the experts reads nothing.
        const u32 token = min(P->token, a.n_vocab - 1);
        if (t < n_used) sel[t] = min(max(a.hash[(u64)token * n_used + t], 0), (int)n_expert - 1);
    } else {
        // n_used rounds of a warp argmax (largest value, lower expert on ties): the order in
        // which the CPU's insertion keeps them. Lane l holds experts l, l + 32, ... (bit j of
        // `taken`: expert l + 32 j is chosen).
        u32 taken = 0;
        for (u32 k = 0; k < n_used; k++) {
            float v = -__int_as_float(0x7f800000);
            int idx = 0x7fffffff;
            for (u32 j = 0, i = lane; i < n_expert; j++, i += 32) {
                if (!((taken >> j) & 1) && (choice[i] > v || idx == 0x7fffffff)) {
                    v = choice[i];
                    idx = (int)i;
                }
            }
            warp_argmax(&v, &idx);
            if ((u32)idx % 32 == lane) taken |= 1u << ((u32)idx / 32);
            if (lane == 0) sel[k] = idx;
        }
    }
    __syncwarp();
    if (t != 0) return;
    float sum = 0.0f;
    for (u32 k = 0; k < n_used; k++) sum += probs[sel[k]];
    sum = fmaxf(sum, 6.103515625e-5f);
    for (u32 k = 0; k < n_used; k++) {
        a.selected[k] = sel[k];
        a.weights[k] = probs[sel[k]] / sum * a.scale;
    }
}

// One block of 256 threads per 256 values. d = 1/iscale with iscale = -127/max, where max is the
// value of largest magnitude (the first one on ties).
extern "C" __global__ void quantize_q8_k(DS4_ARGS, QuantizeQ8KArgs a) {
    DS4_GUARD;
    const float* x = a.x;
    BlockQ8K* out = a.out;
    __shared__ float wv[8];
    __shared__ int wi[8];
    __shared__ float maxv;
    const u32 b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const float v = x[(u64)b * 256 + t];
    float am = fabsf(v);
    int idx = (int)t;
    warp_argmax(&am, &idx);
    if (lane == 0) {
        wv[warp] = am;
        wi[warp] = idx;
    }
    __syncthreads();
    if (t == 0) {
        float ba = wv[0];
        int bi = wi[0];
        for (int w = 1; w < 8; w++) {
            if (wv[w] > ba || (wv[w] == ba && wi[w] < bi)) {
                ba = wv[w];
                bi = wi[w];
            }
        }
        maxv = ba == 0.0f ? 0.0f : x[(u64)b * 256 + bi];
    }
    __syncthreads();
    BlockQ8K* o = out + b;
    if (maxv == 0.0f) {
        o->qs[t] = 0;
        if (t < 16) o->bsums[t] = 0;
        if (t == 0) o->d = 0.0f;
        return;
    }
    const float iscale = -127.0f / maxv;
    const int q = max(-128, min(127, (int)rintf(iscale * v)));
    o->qs[t] = (i8)q;
    __syncthreads();
    if (t < 16) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += o->qs[t * 16 + i];
        o->bsums[t] = (i16)s;
    }
    if (t == 0) o->d = 1.0f / iscale;
}

// Expert weights are in the split layout (ds4_block_split): the quants of every block (64 bytes
// for IQ2_XXS and Q2_K, 128 for Q4_K), then the rest of each block (d, scales); or, with
// DS4_NATIVE_BLOCKS, in GGUF's own blocks read in place (placement unified). A lane reads 16
// quant bytes of one block (one load where they are 16-byte aligned): L = quants / 16 lanes share a block and a warp covers
// 32 / L blocks per pass. Rows that multiply the same activations (gate and up, or neighbouring
// output rows) are done by one warp, so each lane reads its share of the activations once for
// all of them. Lanes add integer sums (exact in any order); the block terms then add in the
// canonical order (row_total).
#define MOE_MAX_BLOCKS 64
#define MOE_ROWS_PER_WARP 2

// A row of an expert tensor: its first block's quants and rest (null quants: no row). An expert
// tensor is reached through its table: for each expert, where its quants and its rest start (in
// device memory, in mapped host memory, or in a slot of the expert cache: kernels/expert_cache.cu).
struct ExpertRow {
    const u8* qs;
    const u8* rest;
};
// Native layout: the table's quants entry is the expert's first block plus `at`, its rest entry
// the first block itself, and both step a whole block per block.
__device__ __forceinline__ ExpertRow expert_row(const u64* table, u32 ty, u64 e, u64 first_block) {
    u32 bb = 0, at = 0, nq = 0;
    ds4_block_split(ty, &bb, &at, &nq);
    ExpertRow r;
#if DS4_NATIVE_BLOCKS
    r.qs = (const u8*)table[2 * e] + first_block * bb;
    r.rest = (const u8*)table[2 * e + 1] + first_block * bb;
#else
    r.qs = (const u8*)table[2 * e] + first_block * nq;
    r.rest = (const u8*)table[2 * e + 1] + first_block * (bb - nq);
#endif
    return r;
}
__device__ __forceinline__ ExpertRow no_row() {
    ExpertRow r;
    r.qs = 0;
    r.rest = 0;
    return r;
}

template <u32 TY> struct Layout {
    static constexpr u32 NQ = TY == 12 ? 128 : 64;                   // quant bytes per block
    static constexpr u32 RB = TY == 16 ? 2 : (TY == 10 ? 20 : 16);   // rest bytes per block
    static constexpr u32 L = NQ / 16;                                // lanes per block
    static constexpr u32 BPP = 32 / L;                               // blocks per warp pass
#if DS4_NATIVE_BLOCKS
    static constexpr u32 BB = NQ + RB;                               // GGUF's block bytes
    static constexpr u32 QS = BB, RS = BB;                           // quants / rest stride
    static constexpr u32 Q2K_D = 80;                                 // Q2_K: d, dmin from the rest
    static constexpr u32 QALIGN = TY == 16 ? 2 : (TY == 10 ? 4 : 16);  // quants' alignment
#else
    static constexpr u32 QS = NQ, RS = RB;
    static constexpr u32 Q2K_D = 16;
    static constexpr u32 QALIGN = 16;
#endif
};

// 16 quant bytes at p, aligned to A bytes (2, 4 or 16).
template <u32 A> __device__ __forceinline__ int4 load_quants16(const u8* p) {
    if (A == 16) return __ldg((const int4*)p);
    u32 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (A == 4) v[i] = __ldg((const u32*)p + i);
        else v[i] = (u32)__ldg((const u16*)p + 2 * i) | ((u32)__ldg((const u16*)p + 2 * i + 1) << 16);
    }
    return make_int4((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
}

// IQ2_XXS sub-block (32 values) from its two words (4 grid indices; 4x7 sign bits and a 4-bit
// scale) and its 32 activation bytes qa, qb. The 7 sign bits of a group and their parity bit
// (the count of negatives is even) spread to one bit per byte; grid bytes are 8, 25 or 43, so the
// negation (v ^ 0xff) + 1 of a byte never carries into the next. (Sign masks from a shared table
// were slower: random 8-byte lookups conflict on the banks.)
__device__ __forceinline__ u32 spread4(u32 x) { return ((x & 15) * 0x00204081u) & 0x01010101u; }
__device__ __forceinline__ int iq2_xxs_sub(u32 aux0, u32 aux1, int4 qa, int4 qb, const u64* grid) {
    const int q8[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    int sumi = 0;
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u64 g = grid[(aux0 >> (8 * l)) & 255];
        u32 signs = (aux1 >> (7 * l)) & 127;
        signs |= (u32)(__popc(signs) & 1) << 7;
        const u32 slo = spread4(signs), shi = spread4(signs >> 4);
        sumi = __dp4a((int)(((u32)g ^ (slo * 0xffu)) + slo), q8[2 * l], sumi);
        sumi = __dp4a((int)(((u32)(g >> 32) ^ (shi * 0xffu)) + shi), q8[2 * l + 1], sumi);
    }
    return sumi * (2 * (int)(aux1 >> 28) + 1);
}

// Byte i (0..11) of the Q4_K scales held in three words.
__device__ __forceinline__ int q4k_byte(u32 i, u32 s0, u32 s1, u32 s2) {
    const u32 w = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (int)((w >> (8 * (i & 3))) & 255);
}
// Q4_K 6-bit scale and min of sub-block j (0..8): GGUF's 12-byte packing of 6-bit values.
__device__ __forceinline__ void q4k_scale_min_w(u32 j, u32 s0, u32 s1, u32 s2, int* sc, int* m) {
    if (j < 4) {
        *sc = q4k_byte(j, s0, s1, s2) & 63;
        *m = q4k_byte(j + 4, s0, s1, s2) & 63;
    } else {
        *sc = (q4k_byte(j + 4, s0, s1, s2) & 0x0f) | ((q4k_byte(j - 4, s0, s1, s2) >> 6) << 4);
        *m = (q4k_byte(j + 4, s0, s1, s2) >> 4) | ((q4k_byte(j, s0, s1, s2) >> 6) << 4);
    }
}

// What a lane reads for part p of one block: of the weight row (16 quant bytes, and for the
// k-quants the scales its part needs), and of the activations (shared by the rows of a group).
struct WeightPart {
    int4 q;
    uint4 ex;
};
struct ActPart {
    int4 q[4];
    int4 bs;
};

template <u32 TY>
__device__ __forceinline__ WeightPart load_weight_part(const ExpertRow& row, u32 b, u32 p) {
    WeightPart w;
    w.q = load_quants16<Layout<TY>::QALIGN>(row.qs + (u64)b * Layout<TY>::QS + 16 * p);
    const u8* rest = row.rest + (u64)b * Layout<TY>::RS;
    if (TY == 10) {  // the 8 scale bytes of 128-value chunk p/2 (4-byte aligned)
        w.ex.x = __ldg((const u32*)(rest + 8 * (p >> 1)));
        w.ex.y = __ldg((const u32*)(rest + 8 * (p >> 1)) + 1);
    } else if (TY == 12) {  // d, dmin and the 12 scale bytes (16-byte aligned)
        w.ex = __ldg((const uint4*)rest);
    }
    return w;
}

template <u32 TY>
__device__ __forceinline__ ActPart load_act_part(const BlockQ8K* y, u32 p) {
    ActPart a;
    if (TY == 16) {  // sub-blocks 2p and 2p+1: 64 bytes
        const int4* s = (const int4*)(y->qs + 64 * p);
#pragma unroll
        for (int i = 0; i < 4; i++) a.q[i] = s[i];
    } else if (TY == 10) {  // chunk p/2, half p%2, each 2-bit plane j; the chunk's 8 sums
        const u32 c = p >> 1, h = p & 1;
#pragma unroll
        for (int j = 0; j < 4; j++) a.q[j] = *(const int4*)(y->qs + 128 * c + 32 * j + 16 * h);
        a.bs = *(const int4*)(y->bsums + 8 * c);
    } else {  // sub-blocks 2(p/2) and 2(p/2)+1, half p%2; their 4 sums
        const u32 t = p >> 1, h = p & 1;
        a.q[0] = *(const int4*)(y->qs + 64 * t + 16 * h);
        a.q[1] = *(const int4*)(y->qs + 64 * t + 32 + 16 * h);
        const int2 bs = *(const int2*)(y->bsums + 4 * t);
        a.bs = make_int4(bs.x, bs.y, 0, 0);
    }
    return a;
}

// Integer sums of one part: `isum` the scaled quant·q8 products, `summ` the scaled mins times the
// q8 sums (Q2_K / Q4_K).
template <u32 TY>
__device__ __forceinline__ void part_sums(const WeightPart& w, const ActPart& a, u32 p, const u64* grid, int* isum,
                                          int* summ) {
    const u32 wv[4] = {(u32)w.q.x, (u32)w.q.y, (u32)w.q.z, (u32)w.q.w};
    if (TY == 16) {
        *isum = iq2_xxs_sub(wv[0], wv[1], a.q[0], a.q[1], grid) + iq2_xxs_sub(wv[2], wv[3], a.q[2], a.q[3], grid);
        *summ = 0;
    } else if (TY == 10) {
        const u32 h = p & 1;
        const int bsw[4] = {a.bs.x, a.bs.y, a.bs.z, a.bs.w};
        int is_ = 0, sm = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int q8[4] = {a.q[j].x, a.q[j].y, a.q[j].z, a.q[j].w};
            int s = 0;
#pragma unroll
            for (int t = 0; t < 4; t++) s = __dp4a((int)((wv[t] >> (2 * j)) & 0x03030303u), q8[t], s);
            const u32 k = 2 * j + h;  // the scale's index within the chunk's 8
            const int sc = (int)(((j < 2 ? w.ex.x : w.ex.y) >> (8 * (k & 3))) & 255);
            const int bsum = (int)(short)(u32)(bsw[j] >> (16 * h));
            is_ += (sc & 15) * s;
            sm += (sc >> 4) * bsum;
        }
        *isum = is_;
        *summ = sm;
    } else {
        const u32 t = p >> 1, h = p & 1;
        const int lo[4] = {a.q[0].x, a.q[0].y, a.q[0].z, a.q[0].w};
        const int hi[4] = {a.q[1].x, a.q[1].y, a.q[1].z, a.q[1].w};
        int slo = 0, shi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            slo = __dp4a((int)(wv[i] & 0x0f0f0f0fu), lo[i], slo);
            shi = __dp4a((int)((wv[i] >> 4) & 0x0f0f0f0fu), hi[i], shi);
        }
        int sc0, m0, sc1, m1;
        q4k_scale_min_w(2 * t, w.ex.y, w.ex.z, w.ex.w, &sc0, &m0);
        q4k_scale_min_w(2 * t + 1, w.ex.y, w.ex.z, w.ex.w, &sc1, &m1);
        *isum = sc0 * slo + sc1 * shi;
        const int b0 = (int)(short)(a.bs.x & 0xffff), b1 = (int)(short)((u32)a.bs.x >> 16);
        const int b2 = (int)(short)(a.bs.y & 0xffff), b3 = (int)(short)((u32)a.bs.y >> 16);
        *summ = h ? 0 : m0 * (b0 + b1) + m1 * (b2 + b3);
    }
}

// Integer sums of every block of G groups of R rows (the rows of group g multiply activations
// y[g]; nb blocks each) into is[g*R+k][b], sm[g*R+k][b]. U passes of every row are loaded before
// any is used.
template <u32 TY, int G, int R, int U>
__device__ __forceinline__ void rows_sums(const ExpertRow* rows, const BlockQ8K* const* y, u32 nb, const u64* grid,
                                          int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    typedef Layout<TY> Lay;
    const u32 lane = threadIdx.x & 31, part = lane % Lay::L;
    for (u32 b0 = 0; b0 < nb; b0 += U * Lay::BPP) {
        WeightPart w[G * R][U];
#pragma unroll
        for (int k = 0; k < G * R; k++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const u32 b = b0 + u * Lay::BPP + lane / Lay::L;
                if (rows[k].qs && b < nb) w[k][u] = load_weight_part<TY>(rows[k], b, part);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (b0 + u * Lay::BPP >= nb) break;  // uniform across the warp
            const u32 b = b0 + u * Lay::BPP + lane / Lay::L;
#pragma unroll
            for (int g = 0; g < G; g++) {
                bool used = false;
#pragma unroll
                for (int k = g * R; k < g * R + R; k++) used |= rows[k].qs != 0;
                ActPart act;
                if (used && b < nb) act = load_act_part<TY>(y[g] + b, part);
#pragma unroll
                for (int k = g * R; k < g * R + R; k++) {
                    int a = 0, m = 0;
                    if (rows[k].qs && b < nb) part_sums<TY>(w[k][u], act, part, grid, &a, &m);
#pragma unroll
                    for (u32 o = 1; o < Lay::L; o <<= 1) {
                        a += __shfl_xor_sync(0xffffffffu, a, o);
                        m += __shfl_xor_sync(0xffffffffu, m, o);
                    }
                    if (part == 0 && b < nb) {
                        is[k][b] = a;
                        sm[k][b] = m;
                    }
                }
            }
        }
    }
    __syncwarp();
}

// The scales row_total needs of block b: d (IQ2_XXS), or d and dmin (Q2_K, Q4_K) as two halves.
// Loaded with the quants (row_first_scales), they cost no extra round trip to memory.
template <u32 TY> __device__ __forceinline__ u32 block_scales(const u8* rest, u32 b) {
    const u16* r = (const u16*)(rest + (u64)b * Layout<TY>::RS + (TY == 10 ? Layout<TY>::Q2K_D : 0));
    if (TY == 16) return __ldg(r);
    return (u32)__ldg(r) | ((u32)__ldg(r + 1) << 16);
}
// Lane l's scales in the first 32-block chunk of a row (block l).
template <u32 TY> __device__ __forceinline__ u32 row_first_scales(const ExpertRow& row, u32 nb) {
    const u32 lane = threadIdx.x & 31;
    return row.qs && lane < nb ? block_scales<TY>(row.rest, lane) : 0;
}

// The dot of one row from its block sums, in the canonical order: lane l takes the term of block
// c + l of each 32-block chunk, the butterfly reduces the chunk, chunk sums add in order from +0.
// Every lane gets the result. `first` is the lane's row_first_scales.
template <u32 TY>
__device__ float row_total(const u8* rest, const BlockQ8K* y, u32 nb, const int* is, const int* sm, u32 first) {
    const u32 lane = threadIdx.x & 31;
    float total = 0.0f;
    for (u32 c = 0; c < nb; c += DS4_BLOCK_CHUNK) {
        float acc = 0.0f;
        const u32 b = c + lane;
        if (b < nb) {
            const u32 sc = c == 0 ? first : block_scales<TY>(rest, b);
            const float yd = y[b].d;
            if (TY == 16) {
                acc += (h2f((u16)sc) * yd) * (float)is[b];
            } else {
                const float d = yd * h2f((u16)(sc & 0xffff)), dmin = yd * h2f((u16)(sc >> 16));
                acc += d * (float)is[b] - dmin * (float)sm[b];
            }
        }
        total += warp_sum(acc);
    }
    if (TY == 16) total = 0.125f * total;
    return total;
}

// The IQ2_XXS grid in shared memory, filled by the whole block (every thread must call this).
__device__ __forceinline__ const u64* iq2_grid(const u64* grid, bool needed) {
    __shared__ u64 grid_sh[256];
    if (needed)
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) grid_sh[i] = grid[i];
    __syncthreads();
    return grid_sh;
}

// mid[slot][r] = silu(min(gate,c)) * clamp(up,±c) * weight[slot]; one warp per (slot, two rows).
template <u32 TY, int U>
__device__ __forceinline__ void moe_gate_up_rows(const MoeGateUpArgs& a, const u64* grid, u32 wid,
                                                 int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 per_slot = a.ff / MOE_ROWS_PER_WARP;
    const u32 slot = wid / per_slot, r0 = (wid % per_slot) * MOE_ROWS_PER_WARP, nb = a.in_dim / 256;
    const u64 e = (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1);
    ExpertRow rows[2 * MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
        const u64 first = (u64)(r0 + k) * nb;
        rows[2 * k] = expert_row(a.gate, TY, e, first);
        rows[2 * k + 1] = expert_row(a.up, TY, e, first);
    }
    u32 first[2 * MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) first[k] = row_first_scales<TY>(rows[k], nb);
    const BlockQ8K* ys[1] = {a.xq};
    rows_sums<TY, 1, 2 * MOE_ROWS_PER_WARP, U>(rows, ys, nb, grid, is, sm);
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
        const float g = row_total<TY>(rows[2 * k].rest, a.xq, nb, is[2 * k], sm[2 * k], first[2 * k]);
        const float u = row_total<TY>(rows[2 * k + 1].rest, a.xq, nb, is[2 * k + 1], sm[2 * k + 1], first[2 * k + 1]);
        if ((threadIdx.x & 31) == 0) a.mid[(u64)slot * a.ff + r0 + k] = swiglu_clamped(g, u, a.clamp) * a.weights[slot];
    }
}

// The Q8_K of 256 values by one warp, exactly as quantize_q8_k makes it: lane i holds values
// i + 32k; the value of largest magnitude (lowest index on ties) sets d; the 16-value sums by
// half-warp shuffles (exact integers). `x` was written by other blocks of this launch: read
// through L2.
__device__ __forceinline__ void quantize_q8_k_warp(const float* x, BlockQ8K* o, u32 lane) {
    float v[8];
#pragma unroll
    for (u32 k = 0; k < 8; k++) v[k] = __ldcg(x + lane + 32 * k);
    float am = -1.0f, mv = 0.0f;
    int idx = 0;
#pragma unroll
    for (u32 k = 0; k < 8; k++)
        if (fabsf(v[k]) > am) {
            am = fabsf(v[k]);
            mv = v[k];
            idx = (int)(lane + 32 * k);
        }
    warp_argmax(&am, &idx);
    const float winner = __shfl_sync(0xffffffffu, mv, (u32)idx % 32);
    const float maxv = am == 0.0f ? 0.0f : winner;
    const float iscale = maxv == 0.0f ? 0.0f : -127.0f / maxv;
#pragma unroll
    for (u32 k = 0; k < 8; k++) {
        const int q = maxv == 0.0f ? 0 : max(-128, min(127, (int)rintf(iscale * v[k])));
        o->qs[lane + 32 * k] = (i8)q;
        int sum = q;
        for (u32 off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if ((lane & 15) == 0) o->bsums[2 * k + (lane >> 4)] = (i16)sum;
    }
    if (lane == 0) o->d = maxv == 0.0f ? 0.0f : 1.0f / iscale;
}

// With `midq`, the mid vector's Q8_K for the down kernel too: a slot's rows are whole blocks (the
// plan asks ff % 16 == 0), and the last of a slot's blocks to finish (a ticket per slot)
// quantizes that slot's ff values, a warp per 256.
__device__ __forceinline__ void moe_gate_up_mid_q8_k(const MoeGateUpArgs& a) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    const u32 per_slot = a.ff / MOE_ROWS_PER_WARP / (blockDim.x >> 5), slot = blockIdx.x / per_slot;
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + a.ticket + slot, 1u) == per_slot - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const u32 lane = threadIdx.x & 31, nb = a.ff / 256;
    for (u32 blk = threadIdx.x >> 5; blk < nb; blk += blockDim.x >> 5)
        quantize_q8_k_warp(a.mid + (u64)slot * a.ff + blk * 256, a.midq + (u64)slot * nb + blk, lane);
    if (threadIdx.x == 0) a.tickets[a.ticket + slot] = 0;
}

extern "C" __global__ void moe_gate_up(DS4_ARGS, MoeGateUpArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u64* grid = iq2_grid(a.grid, a.gate_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + warp;
    // gate and up have one type (checked by the planner); IQ2_XXS goes to moe_gate_up_iq2_xxs.
    if (wid < a.n_used * (a.ff / MOE_ROWS_PER_WARP)) {
        if (a.gate_ty == 16) moe_gate_up_rows<16, 1>(a, grid, wid, is_sh[warp], sm_sh[warp]);
        else if (a.gate_ty == 10) moe_gate_up_rows<10, 1>(a, grid, wid, is_sh[warp], sm_sh[warp]);
        else moe_gate_up_rows<12, 1>(a, grid, wid, is_sh[warp], sm_sh[warp]);
    }
    if (a.midq) moe_gate_up_mid_q8_k(a);
}

// Passes of 8 blocks whose loads are issued together (2 cover a 4096-wide row in one round trip to
// memory, but take 102 registers instead of 80: measured slower on the H200, 33.5 against 28.1 us).
#ifndef MOE_GATE_UP_PASSES
#define MOE_GATE_UP_PASSES 1
#endif

// The same for IQ2_XXS alone (the Flash experts): without the k-quant paths it needs 80
// registers (71 before the scales were loaded with the quants) instead of 96-112, so 3 blocks of 256 fit on an SM instead of 2; these loads are
// latency-bound (ncu: long-scoreboard stalls, 23% of the warps active), so that pays: 32.6 ->
// 26.2 us per launch on the H200.
extern "C" __global__ void moe_gate_up_iq2_xxs(DS4_ARGS, MoeGateUpArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u64* grid = iq2_grid(a.grid, true);
    const u32 warp = threadIdx.x >> 5;
    const u32 wid = blockIdx.x * (blockDim.x >> 5) + warp;
    if (wid < a.n_used * (a.ff / MOE_ROWS_PER_WARP))
        moe_gate_up_rows<16, MOE_GATE_UP_PASSES>(a, grid, wid, is_sh[warp], sm_sh[warp]);
    if (a.midq) moe_gate_up_mid_q8_k(a);
}

// out[r] = sum over slots (in order, from +0) of down_e(row r) · midq[slot]; one warp per two
// rows, two slots' rows loaded together.
template <u32 TY>
__device__ __forceinline__ void moe_down_rows(const MoeDownArgs& a, const u64* grid, u32 r0,
                                              int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 nb = a.ff / 256;
    float acc[MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) acc[k] = 0.0f;
    for (u32 s0 = 0; s0 < a.n_used; s0 += 2) {
        ExpertRow rows[2 * MOE_ROWS_PER_WARP];
        const BlockQ8K* ys[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const u32 slot = s0 + g;
            ys[g] = a.midq + (u64)min(slot, a.n_used - 1) * nb;
            const u64 e = slot < a.n_used ? (u64)min(max(a.selected[slot], 0), (int)a.n_expert - 1) : 0;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const u32 r = r0 + k;
                rows[g * MOE_ROWS_PER_WARP + k] =
                    slot < a.n_used && r < a.out_dim ? expert_row(a.down, TY, e, (u64)r * nb) : no_row();
            }
        }
        rows_sums<TY, 2, MOE_ROWS_PER_WARP, 1>(rows, ys, nb, grid, is, sm);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            if (s0 + g >= a.n_used) break;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const int i = g * MOE_ROWS_PER_WARP + k;
                if (rows[i].qs)
                    acc[k] += row_total<TY>(rows[i].rest, ys[g], nb, is[i], sm[i], row_first_scales<TY>(rows[i], nb));
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++)
        if ((threadIdx.x & 31) == 0 && r0 + k < a.out_dim) a.out[r0 + k] = acc[k];
}

extern "C" __global__ void moe_down(DS4_ARGS, MoeDownArgs a) {
    DS4_GUARD;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u64* grid = iq2_grid(a.grid, a.down_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * MOE_ROWS_PER_WARP;
    if (r0 >= a.out_dim) return;
    if (a.down_ty == 16) moe_down_rows<16>(a, grid, r0, is_sh[warp], sm_sh[warp]);
    else if (a.down_ty == 10) moe_down_rows<10>(a, grid, r0, is_sh[warp], sm_sh[warp]);
    else moe_down_rows<12>(a, grid, r0, is_sh[warp], sm_sh[warp]);
}

#if DS4_CHUNK_ROWS
// The chunk build runs the routed experts grouped by expert, as the CPU's `moe_experts_rows`
// does: moe_route lists each expert's (row, slot) pairs, then a warp of gate/up or down takes its
// weight rows of one expert for every pair that chose it. The expert's weights come from DRAM once
// per chunk (the pairs after the first find them in L1 or L2), not once per row that chose it; the
// IQ2_XXS gate/up also decodes each weight sub-block once for two pairs. Each pair gets the decode
// kernels' integer block sums and their float order (row_total), and moe_sum_slots adds a row's
// slots in slot order from +0 as moe_down_rows does. The launches take no blockIdx.y: they find
// each row's pointers through ds4_row. scripts/moe-emulate checks them against the per-row
// kernels on the host.

// The pairs one routing block holds (plan.rs MOE_ROUTE_MAX_PAIRS); at most 1024 experts.
#define MOE_ROUTE_MAX_PAIRS 8192

// One block of 1024 threads writes `route`: counts[n_expert], starts[n_expert], then the pairs
// p = row * n_used + slot grouped by expert, ascending within an expert. Rows whose predicate is
// false (past the chunk's tokens) have none; expert ids are clamped as the decode kernels clamp
// them. Counts are integers (exact in any order); the order of the pairs is fixed by the scan.
//
// The pairs of each expert are placed by warp 0 walking them in order, 32 at a time (a lane's place
// is its expert's next free one plus its rank among the tile's lanes of that expert), in place of
// a thread per expert scanning every pair (MOE_ROUTE_SERIAL=1 keeps that, to measure).
#ifndef MOE_ROUTE_SERIAL
#define MOE_ROUTE_SERIAL 0
#endif
__device__ __forceinline__ void moe_route_block(const StepParams* P, u64 cond, const RowStrides& R, const MoeRouteArgs& a,
                                                bool serial) {
    __shared__ int ex[MOE_ROUTE_MAX_PAIRS];
    __shared__ u32 count[1024], start[1024];
    const u32 t = threadIdx.x, n_expert = a.n_expert, n_pairs = a.rows * a.n_used;
    for (u32 e = t; e < n_expert; e += blockDim.x) count[e] = 0;
    for (u32 p = t; p < n_pairs; p += blockDim.x) {
        const u32 y = p / a.n_used;
        int e = -1;
        if (ds4_cond(P + y, cond)) {
            MoeRouteArgs ay = a;
            ds4_row(ay, R, y);
            e = min(max(ay.selected[p % a.n_used], 0), (int)n_expert - 1);
        }
        ex[p] = e;
    }
    __syncthreads();
    for (u32 p = t; p < n_pairs; p += blockDim.x)
        if (ex[p] >= 0) atomicAdd(&count[ex[p]], 1u);
    __syncthreads();
    // Exclusive prefix sum of the counts by warp 0, lane l over a run of experts.
    if (t < 32) {
        const u32 per = (n_expert + 31) / 32, lo = min(t * per, n_expert), hi = min(lo + per, n_expert);
        u32 sum = 0;
        for (u32 e = lo; e < hi; e++) sum += count[e];
        u32 incl = sum;
        for (u32 o = 1; o < 32; o <<= 1) {
            const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
            if (t >= o) incl += v;
        }
        u32 at = incl - sum;
        for (u32 e = lo; e < hi; e++) {
            start[e] = at;
            at += count[e];
        }
    }
    __syncthreads();
    u32* pairs = a.route + 2 * n_expert;
    if (serial) {
        for (u32 e = t; e < n_expert; e += blockDim.x) {
            const u32 n = count[e], s = start[e];
            // Exactly n pairs name e: the scan stops at the last.
            for (u32 q = 0, k = 0; k < n; q++)
                if (ex[q] == (int)e) pairs[s + k++] = q;
            a.route[e] = n;
            a.route[n_expert + e] = s;
        }
        return;
    }
    for (u32 e = t; e < n_expert; e += blockDim.x) {
        a.route[e] = count[e];
        a.route[n_expert + e] = start[e];
    }
    __syncthreads();
    // start[e] becomes expert e's next free place.
    if (t < 32) {
        for (u32 q0 = 0; q0 < n_pairs; q0 += 32) {
            const u32 q = q0 + t;
            const int e = q < n_pairs ? ex[q] : -1;
            const u32 peers = __match_any_sync(0xffffffffu, e);
            if (e >= 0) pairs[start[e] + __popc(peers & ((1u << t) - 1))] = q;
            __syncwarp();
            // The group's highest lane moves its expert's next place past the group.
            if (e >= 0 && peers >> t == 1) start[e] += __popc(peers);
            __syncwarp();
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_route(DS4_ARGS, MoeRouteArgs a) {
    ds4_wait_predecessor();
    moe_route_block(P, cond, R, a, MOE_ROUTE_SERIAL);
}

// Expert e's pairs: (count, the first of them).
__device__ __forceinline__ u32 moe_route_pairs(const u32* route, u32 n_expert, u32 e, const u32** pairs) {
    *pairs = route + 2 * n_expert + route[n_expert + e];
    return route[e];
}

// The decode kernel's arguments as chunk row y sees them.
__device__ __forceinline__ MoeGateUpArgs moe_gate_up_row_args(const MoeGateUpGroupedArgs& a, const RowStrides& R,
                                                              u32 y) {
    MoeGateUpGroupedArgs ay = a;
    ds4_row(ay, R, y);
    MoeGateUpArgs b;
    b.xq = ay.xq;
    b.selected = ay.selected;
    b.weights = ay.weights;
    b.gate = a.gate;
    b.up = a.up;
    b.mid = ay.mid;
    b.grid = a.grid;
    b.midq = 0;
    b.tickets = 0;
    b.gate_ty = a.gate_ty;
    b.up_ty = a.gate_ty;
    b.in_dim = a.in_dim;
    b.ff = a.ff;
    b.n_used = a.n_used;
    b.n_expert = a.n_expert;
    b.clamp = a.clamp;
    b.ticket = 0;
    return b;
}

// Warp w of expert e: mid rows 2w, 2w + 1 of every pair that chose e, each computed by
// moe_gate_up_rows as the decode kernel's warp (slot, rows 2w, 2w + 1) of the pair's row does.
template <u32 TY, int U>
__device__ __forceinline__ void moe_gate_up_pairs(const MoeGateUpGroupedArgs& a, const RowStrides& R, const u64* grid,
                                                  u32 e, u32 w, int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i = 0; i < n; i++) {
        const u32 p = pairs[i];
        const MoeGateUpArgs b = moe_gate_up_row_args(a, R, p / a.n_used);
        moe_gate_up_rows<TY, U>(b, grid, (p % a.n_used) * (a.ff / MOE_ROWS_PER_WARP) + w, is, sm);
        __syncwarp();  // the next pair rewrites is and sm
    }
}

// Blocks go (row block, expert): blockIdx.x = rb * n_expert + e, so the blocks of an expert that
// many rows chose are spread over the launch instead of coming last. A block of an expert no row
// chose leaves at once (the whole block: before any barrier).
extern "C" __global__ void moe_gate_up_grouped(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u64* grid = iq2_grid(a.grid, a.gate_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 w = blockIdx.x / a.n_expert * (blockDim.x >> 5) + warp;
    if (w >= a.ff / MOE_ROWS_PER_WARP) return;
    if (a.gate_ty == 16) moe_gate_up_pairs<16, 1>(a, R, grid, e, w, is_sh[warp], sm_sh[warp]);
    else if (a.gate_ty == 10) moe_gate_up_pairs<10, 1>(a, R, grid, e, w, is_sh[warp], sm_sh[warp]);
    else moe_gate_up_pairs<12, 1>(a, R, grid, e, w, is_sh[warp], sm_sh[warp]);
}

// Pairs that moe_gate_up_grouped_iq2_xxs decodes each weight sub-block once for, and the blocks
// per SM its registers must allow: 2 pairs fit the 80 registers of 3 blocks (as
// moe_gate_up_iq2_xxs) without spilling; 3 or more spill unless the blocks go down to 2.
#ifndef MOE_PAIR_BATCH
#define MOE_PAIR_BATCH 2
#endif
#ifndef MOE_PAIR_MIN_BLOCKS
#define MOE_PAIR_MIN_BLOCKS 3
#endif

// An IQ2_XXS sub-block's 8 weight words with their signs applied, and its scale 2s + 1: the
// weight half of iq2_xxs_sub, whose sum is sum_j dp4a(w[j], q8[j]) * scale for any activations.
__device__ __forceinline__ int iq2_xxs_sub_weights(u32 aux0, u32 aux1, const u64* grid, int* w) {
#pragma unroll
    for (int l = 0; l < 4; l++) {
        const u64 g = grid[(aux0 >> (8 * l)) & 255];
        u32 signs = (aux1 >> (7 * l)) & 127;
        signs |= (u32)(__popc(signs) & 1) << 7;
        const u32 slo = spread4(signs), shi = spread4(signs >> 4);
        w[2 * l] = (int)(((u32)g ^ (slo * 0xffu)) + slo);
        w[2 * l + 1] = (int)(((u32)(g >> 32) ^ (shi * 0xffu)) + shi);
    }
    return 2 * (int)(aux1 >> 28) + 1;
}

// row_total for IQ2_XXS rows of at most 32 blocks, from lane l's block sum `is` (block l).
__device__ __forceinline__ float iq2_xxs_row_total(const u8* rest, const BlockQ8K* y, u32 nb, int is) {
    const u32 lane = threadIdx.x & 31;
    float total = 0.0f;
    float acc = 0.0f;
    if (lane < nb) acc += (h2f((u16)block_scales<16>(rest, lane)) * y[lane].d) * (float)is;
    total += warp_sum(acc);
    return 0.125f * total;
}

// Warp w of expert e, IQ2_XXS rows of at most 32 blocks: mid rows 2w, 2w + 1 of every pair that
// chose e, MOE_PAIR_BATCH pairs at a time. The weight decode (grid lookups and signs: most of the
// instructions of this instruction-bound kernel) is done once per batch: a lane decodes a
// sub-block of each of the four rows and dots it with each pair's activations. The block sums are
// moe_gate_up_rows' integers (exact in any order); lane l keeps block l's, and each row's dot adds
// them as row_total does (one 32-block chunk: the lane's term from +0, the butterfly, times 1/8).
__device__ __forceinline__ void moe_gate_up_pairs_iq2_xxs(const MoeGateUpGroupedArgs& a, const RowStrides& R,
                                                          const u64* grid, u32 e, u32 w) {
    constexpr int PB = MOE_PAIR_BATCH;
    typedef Layout<16> Lay;
    const u32 lane = threadIdx.x & 31, part = lane % Lay::L, nb = a.in_dim / 256, r0 = w * MOE_ROWS_PER_WARP;
    // gate r0, up r0, gate r0 + 1, up r0 + 1, as moe_gate_up_rows orders them.
    ExpertRow rows[2 * MOE_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
        rows[2 * k] = expert_row(a.gate, 16, e, (u64)(r0 + k) * nb);
        rows[2 * k + 1] = expert_row(a.up, 16, e, (u64)(r0 + k) * nb);
    }
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += PB) {
        // Each pair's activations (a missing last pair repeats the one before, unused).
        const BlockQ8K* ys[PB];
#pragma unroll
        for (int q = 0; q < PB; q++) {
            MoeGateUpGroupedArgs ay = a;
            ds4_row(ay, R, pairs[min(i0 + q, n - 1)] / a.n_used);
            ys[q] = ay.xq;
        }
        int is[PB][2 * MOE_ROWS_PER_WARP];
#pragma unroll
        for (int q = 0; q < PB; q++)
#pragma unroll
            for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) is[q][k] = 0;
        for (u32 b0 = 0; b0 < nb; b0 += Lay::BPP) {
            const u32 b = b0 + lane / Lay::L;
            int4 wq[2 * MOE_ROWS_PER_WARP];
#pragma unroll
            for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++)
                wq[k] = b < nb ? load_quants16<Lay::QALIGN>(rows[k].qs + (u64)b * Lay::QS + 16 * part)
                               : make_int4(0, 0, 0, 0);
            int sum[PB][2 * MOE_ROWS_PER_WARP];
#pragma unroll
            for (int q = 0; q < PB; q++)
#pragma unroll
                for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) sum[q][k] = 0;
            // The lane's two sub-blocks (part_sums: 2 part and 2 part + 1).
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int4 x[PB][2];
#pragma unroll
                for (int q = 0; q < PB; q++) {
                    x[q][0] = x[q][1] = make_int4(0, 0, 0, 0);
                    if (i0 + q < n && b < nb) {
                        const int4* s = (const int4*)(ys[q][b].qs + 64 * part + 32 * h);
                        x[q][0] = s[0];
                        x[q][1] = s[1];
                    }
                }
#pragma unroll
                for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) {
                    int wd[8];
                    const int sc = iq2_xxs_sub_weights(h ? (u32)wq[k].z : (u32)wq[k].x,
                                                       h ? (u32)wq[k].w : (u32)wq[k].y, grid, wd);
#pragma unroll
                    for (int q = 0; q < PB; q++) {
                        const int xs[8] = {x[q][0].x, x[q][0].y, x[q][0].z, x[q][0].w,
                                           x[q][1].x, x[q][1].y, x[q][1].z, x[q][1].w};
                        int s = 0;
#pragma unroll
                        for (int j = 0; j < 8; j++) s = __dp4a(wd[j], xs[j], s);
                        sum[q][k] += s * sc;
                    }
                }
            }
            // A block's sum from its L lanes; block b0 + j's then goes to lane b0 + j.
#pragma unroll
            for (int q = 0; q < PB; q++) {
                if (i0 + q >= n) break;  // uniform: a batch short of pairs
#pragma unroll
                for (int k = 0; k < 2 * MOE_ROWS_PER_WARP; k++) {
                    int v = sum[q][k];
#pragma unroll
                    for (u32 o = 1; o < Lay::L; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    v = __shfl_sync(0xffffffffu, v, ((lane - b0) * Lay::L) & 31);
                    if (lane - b0 < Lay::BPP) is[q][k] = v;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < PB; q++) {
            if (i0 + q >= n) break;
            const u32 p = pairs[i0 + q], slot = p % a.n_used;
            MoeGateUpGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const float g = iq2_xxs_row_total(rows[2 * k].rest, ys[q], nb, is[q][2 * k]);
                const float u = iq2_xxs_row_total(rows[2 * k + 1].rest, ys[q], nb, is[q][2 * k + 1]);
                if (lane == 0) ay.mid[(u64)slot * a.ff + r0 + k] = swiglu_clamped(g, u, a.clamp) * ay.weights[slot];
            }
        }
    }
}

// IQ2_XXS alone (the Flash experts): rows of at most 32 blocks decode each weight sub-block once
// per batch of pairs; wider rows take moe_gate_up_pairs, a pair at a time.
extern "C" __global__ void __launch_bounds__(256, MOE_PAIR_MIN_BLOCKS) moe_gate_up_grouped_iq2_xxs(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u64* grid = iq2_grid(a.grid, true);
    const u32 warp = threadIdx.x >> 5;
    const u32 w = blockIdx.x / a.n_expert * (blockDim.x >> 5) + warp;
    if (w >= a.ff / MOE_ROWS_PER_WARP) return;
    if (a.in_dim <= 256 * DS4_BLOCK_CHUNK) moe_gate_up_pairs_iq2_xxs(a, R, grid, e, w);
    else moe_gate_up_pairs<16, MOE_GATE_UP_PASSES>(a, R, grid, e, w, is_sh[warp], sm_sh[warp]);
}

// Expert e's down rows r0, r0 + 1 for every pair that chose it, into parts[slot] of the pair's
// row: two pairs at a time, as moe_down_rows takes two slots (the second pair loads the same
// weight rows again, from L1). Each row's dot is row_total's over the same integer block sums.
template <u32 TY>
__device__ __forceinline__ void moe_down_pairs(const MoeDownGroupedArgs& a, const RowStrides& R, const u64* grid, u32 e,
                                               u32 r0, int (*is)[MOE_MAX_BLOCKS], int (*sm)[MOE_MAX_BLOCKS]) {
    const u32 nb = a.ff / 256;
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i = 0; i < n; i += 2) {
        ExpertRow rows[2 * MOE_ROWS_PER_WARP];
        const BlockQ8K* ys[2];
        float* parts[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const u32 p = pairs[min(i + g, n - 1)], slot = p % a.n_used;
            MoeDownGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
            ys[g] = ay.midq + (u64)slot * nb;
            parts[g] = ay.parts + (u64)slot * a.out_dim;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const u32 r = r0 + k;
                rows[g * MOE_ROWS_PER_WARP + k] =
                    i + g < n && r < a.out_dim ? expert_row(a.down, TY, e, (u64)r * nb) : no_row();
            }
        }
        rows_sums<TY, 2, MOE_ROWS_PER_WARP, 1>(rows, ys, nb, grid, is, sm);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            if (i + g >= n) break;
#pragma unroll
            for (int k = 0; k < MOE_ROWS_PER_WARP; k++) {
                const int j = g * MOE_ROWS_PER_WARP + k;
                if (rows[j].qs) {
                    const float t = row_total<TY>(rows[j].rest, ys[g], nb, is[j], sm[j], row_first_scales<TY>(rows[j], nb));
                    if ((threadIdx.x & 31) == 0) parts[g][r0 + k] = t;
                }
            }
        }
        __syncwarp();  // the next pairs rewrite is and sm
    }
}

extern "C" __global__ void moe_down_grouped(DS4_ARGS, MoeDownGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ int is_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    __shared__ int sm_sh[8][2 * MOE_ROWS_PER_WARP][MOE_MAX_BLOCKS];
    const u64* grid = iq2_grid(a.grid, a.down_ty == 16);
    const u32 warp = threadIdx.x >> 5;
    const u32 r0 = (blockIdx.x / a.n_expert * (blockDim.x >> 5) + warp) * MOE_ROWS_PER_WARP;
    if (r0 >= a.out_dim) return;
    if (a.down_ty == 16) moe_down_pairs<16>(a, R, grid, e, r0, is_sh[warp], sm_sh[warp]);
    else if (a.down_ty == 10) moe_down_pairs<10>(a, R, grid, e, r0, is_sh[warp], sm_sh[warp]);
    else moe_down_pairs<12>(a, R, grid, e, r0, is_sh[warp], sm_sh[warp]);
}

// out[r] = the row's slots' down rows added in slot order from +0, as moe_down_rows adds them.
extern "C" __global__ void moe_sum_slots(DS4_ARGS, MoeSumSlotsArgs a) {
    DS4_GUARD;
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= a.out_dim) return;
    float acc = 0.0f;
    for (u32 s = 0; s < a.n_used; s++) acc += a.parts[(u64)s * a.out_dim + r];
    a.out[r] = acc;
}

#if !DS4_NATIVE_BLOCKS
// The grouped experts on int8 tensor cores (split layout; plan.rs takes them unless
// DS4_CUDA_MOE_MMA=0): IQ2_XXS gate/up (moe_gate_up_mma_iq2_xxs) and Q2_K down
// (moe_down_mma_q2_k). A warp takes a tile of 16 weight rows of one expert and its pairs 8 at a
// time, the n = 8 columns of an m16n8k32 MMA, so each weight is decoded once per 8 pairs. The MMAs
// give each (row, pair) the decode kernels' integer block sums (exact in any order; a k
// permutation applied to both A and B leaves them unchanged), and the block terms then add in
// row_total's order (tree32_leaf). A column past the expert's pairs repeats its last pair: an
// MMA's columns do not mix, and that column's outputs are not written.

// D += A B over k = 32 (PTX mma m16n8k32 .s8, .s32 accumulators). With g = lane / 4 and
// t = lane % 4, byte j of each register: a[0] row g, k 4t + j; a[1] row g + 8, k 4t + j; a[2],
// a[3] the same at k 16 + 4t + j; b[0] k 4t + j of column g, b[1] k 16 + 4t + j; d[0], d[1] row
// g, columns 2t and 2t + 1; d[2], d[3] row g + 8. (scripts/emu/gen.py maps the asm to the
// emulator's MMA.)
__device__ __forceinline__ void mma_s8_k32(int* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Adds leaf i (0..31) of a 32-block chunk, blocks taken in bit_reverse5 order, to the pending
// sums of warp_sum's tree: a leaf closes level l while bit l of i is set, so every add pairs what
// the butterfly pairs. After leaf 31, v holds the chunk's sum as warp_sum gives it.
template <int N> __device__ __forceinline__ void tree32_leaf(float (*pend)[N], float* v, u32 i) {
#pragma unroll
    for (u32 l = 0; l < 5; l++) {
        if (!((i >> l) & 1)) {
#pragma unroll
            for (int k = 0; k < N; k++) pend[l][k] = v[k];
            return;
        }
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = pend[l][k] + v[k];
    }
}

// The block of leaf L: chunk L / 32, leaf L % 32 of its tree.
__device__ __forceinline__ u32 leaf_block(u32 L) { return (L & ~31u) + bit_reverse5(L & 31); }
// The first leaf after L whose block exists, or `end` (the chunks' leaves).
__device__ __forceinline__ u32 next_leaf(u32 L, u32 nb, u32 end) {
    do L++;
    while (L < end && leaf_block(L) >= nb);
    return L;
}

// The tensor-core gate/up decodes an IQ2_XXS grid entry with two byte permutes: weight j's
// selector nibble is its grid byte's code (0, 1, 2 for 8, 25, 43: the grid's only bytes) plus 4
// when its sign is set, and picks from the 8 bytes 8, 25, 43, 0, -8, -25, -43, 0 (the bytes
// iq2_xxs_sub's (v ^ 0xff) + 1 makes). The codes of each entry come from a 256-word table (code of
// byte j at bit 4j), the sign bits from a 128-word table of the sign fields or by shifts.
#define IQ2_PRMT_POS 0x002b1908u
#define IQ2_PRMT_NEG 0x00d5e7f8u
// Which rows take their sign bits from the table (smem loads, which conflict on the banks) rather
// than from shifts (ALU): 0 none, 1 the gate rows, 2 gate and up. To measure:
// DS4_CUDA_DEFINES="MOE_MMA_SIGN_TABLE=2".
#ifndef MOE_MMA_SIGN_TABLE
#define MOE_MMA_SIGN_TABLE 1
#endif

// PTX prmt: byte n of the result is byte c_n & 7 of b:a (a the low four), c_n the selector's
// nibble n (bit 3 set would replicate that byte's sign; the nibbles here never set it). Unlike
// __byte_perm it needs no mask of the selector. (scripts/emu/gen.py maps the asm to the emulator's.)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 c) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Sign field s (7 bits) and its parity bit (the count of negatives is even) at bits 4j + 2.
__device__ __forceinline__ u32 iq2_sign_nibbles(u32 s) {
    u32 x = s | (u32)(__popc(s) & 1) << 7;
    x = (x | x << 12) & 0x000f000fu;
    x = (x | x << 6) & 0x03030303u;
    x = (x | x << 3) & 0x11111111u;
    return x << 2;
}

// The two tables in shared memory, filled by the whole block (every thread must call this).
__device__ __forceinline__ void iq2_nibble_tables(const u64* grid, u32* codes, u32* signs) {
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        const u64 g = grid[i];
        u32 c = 0;
#pragma unroll
        for (u32 j = 0; j < 8; j++) {
            const u32 v = (u32)(g >> (8 * j)) & 255;
            c |= ((u32)(v > 8) + (u32)(v > 25)) << (4 * j);
        }
        codes[i] = c;
    }
    for (u32 i = threadIdx.x; i < 128; i += blockDim.x) signs[i] = iq2_sign_nibbles(i);
    __syncthreads();
}

// Grid entry l of an IQ2_XXS sub-block (words aux0, aux1) with its signs, the bytes iq2_xxs_sub
// dots: weights 0-3 in lo, 4-7 in hi.
template <bool TABLE>
__device__ __forceinline__ void iq2_xxs_entry(u32 aux0, u32 aux1, u32 l, const u32* codes, const u32* signs, u32* lo,
                                              u32* hi) {
    const u32 s = (aux1 >> (7 * l)) & 127;
    const u32 sel = codes[(aux0 >> (8 * l)) & 255] | (TABLE ? signs[s] : iq2_sign_nibbles(s));
    *lo = prmt(IQ2_PRMT_POS, IQ2_PRMT_NEG, sel);
    *hi = prmt(IQ2_PRMT_POS, IQ2_PRMT_NEG, sel >> 16);
}

// Blocks of 256 per SM the registers of moe_gate_up_mma_iq2_xxs and moe_down_mma_q2_k must allow:
// 3 fit both in 80 registers without spilling (down takes 96 by itself, 2 blocks); 4 spill. To
// measure others: DS4_CUDA_DEFINES="MOE_MMA_MIN_BLOCKS=2" (1: as many registers as ptxas likes).
#ifndef MOE_MMA_MIN_BLOCKS
#define MOE_MMA_MIN_BLOCKS 3
#endif

// Mid rows of a gate/up tile: tile rows 0-7 are gate rows r0..r0 + 7, rows 8-15 the up rows of
// the same mid rows, so a lane's accumulators hold gate and up of mid row r0 + g for two pairs.
#define MOE_MMA_MID_ROWS 8

// One IQ2_XXS block of a gate/up tile: lane (g, t) holds part t (sub-blocks 2t, 2t + 1) of gate
// row g (qg) and of up row g (qu), and reads column g's activations x. For each sub-block the lane
// decodes grid entry t of both rows (its 8 k slots: values 8t..8t + 7 of the sub-block), one MMA
// gives the sub-block's dots for 16 rows x 8 pairs, and each adds times its row's scale 2s + 1
// (iq2_xxs_sub's sum). is: gate of columns 2t, 2t + 1, then up.
__device__ __forceinline__ void iq2_xxs_mma_block(int4 qg, int4 qu, const BlockQ8K* x, const u32* codes,
                                                  const u32* signs, int* is) {
    const u32 lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
    for (int k = 0; k < 4; k++) is[k] = 0;
#pragma unroll
    for (u32 s = 0; s < 8; s++) {
        const u32 src = (lane & ~3u) | (s >> 1);
        const u32 g0 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qg.z : qg.x), src);
        const u32 g1 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qg.w : qg.y), src);
        const u32 u0 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qu.z : qu.x), src);
        const u32 u1 = __shfl_sync(0xffffffffu, (u32)(s & 1 ? qu.w : qu.y), src);
        u32 w[4];
        iq2_xxs_entry<(MOE_MMA_SIGN_TABLE >= 1)>(g0, g1, t, codes, signs, &w[0], &w[2]);
        iq2_xxs_entry<(MOE_MMA_SIGN_TABLE >= 2)>(u0, u1, t, codes, signs, &w[1], &w[3]);
        const uint2 xv = *(const uint2*)(x->qs + 32 * s + 8 * t);
        const u32 xb[2] = {xv.x, xv.y};
        int d[4] = {0, 0, 0, 0};
        mma_s8_k32(d, w, xb);
        const int sg = 2 * (int)(g1 >> 28) + 1, su = 2 * (int)(u1 >> 28) + 1;
        is[0] += d[0] * sg;
        is[1] += d[1] * sg;
        is[2] += d[2] * su;
        is[3] += d[3] * su;
    }
}

// The Q8_K activations of pair p (its row's normed input).
__device__ __forceinline__ const BlockQ8K* gate_up_pair_x(const MoeGateUpGroupedArgs& a, const RowStrides& R, u32 p) {
    MoeGateUpGroupedArgs ay = a;
    ds4_row(ay, R, p / a.n_used);
    return ay.xq;
}

// IQ2_XXS gate and up (the Flash experts) for every pair of each expert: blocks go (mid row
// block, expert) as moe_gate_up_grouped's, a warp per MOE_MMA_MID_ROWS mid rows. Each block's
// quants are loaded one block ahead, in the leaves' order.
extern "C" __global__ void __launch_bounds__(256, MOE_MMA_MIN_BLOCKS) moe_gate_up_mma_iq2_xxs(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ u32 codes[256], signs[128];
    iq2_nibble_tables(a.grid, codes, signs);
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 r0 = (blockIdx.x / a.n_expert * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_MMA_MID_ROWS;
    if (r0 >= a.ff) return;
    const u32 nb = a.in_dim / 256, r = r0 + g;
    const u32 end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow gate = expert_row(a.gate, 16, e, (u64)r * nb), up = expert_row(a.up, 16, e, (u64)r * nb);
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += 8) {
        const BlockQ8K* xg = gate_up_pair_x(a, R, pairs[min(i0 + g, n - 1)]);
        const BlockQ8K* x0 = gate_up_pair_x(a, R, pairs[min(i0 + 2 * t, n - 1)]);
        const BlockQ8K* x1 = gate_up_pair_x(a, R, pairs[min(i0 + 2 * t + 1, n - 1)]);
        int4 qg = __ldg((const int4*)(gate.qs + 16 * t)), qu = __ldg((const int4*)(up.qs + 16 * t));
        float total[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pend[5][4];
#pragma unroll 1
        for (u32 L = 0; L < end; L++) {
            const u32 b = leaf_block(L);
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b < nb) {
                const int4 cg = qg, cu = qu;
                const u32 next = next_leaf(L, nb, end);
                if (next < end) {
                    const u64 at = (u64)leaf_block(next) * 64 + 16 * t;
                    qg = __ldg((const int4*)(gate.qs + at));
                    qu = __ldg((const int4*)(up.qs + at));
                }
                const float dg = h2f(__ldg((const u16*)gate.rest + b)), du = h2f(__ldg((const u16*)up.rest + b));
                const float y0 = x0[b].d, y1 = x1[b].d;
                int is[4];
                iq2_xxs_mma_block(cg, cu, xg + b, codes, signs, is);
                v[0] = 0.0f + (dg * y0) * (float)is[0];
                v[1] = 0.0f + (dg * y1) * (float)is[1];
                v[2] = 0.0f + (du * y0) * (float)is[2];
                v[3] = 0.0f + (du * y1) * (float)is[3];
            }
            tree32_leaf<4>(pend, v, L & 31);
            if ((L & 31) == 31) {
#pragma unroll
                for (int k = 0; k < 4; k++) total[k] += v[k];
            }
        }
#pragma unroll
        for (u32 j = 0; j < 2; j++) {
            const u32 q = i0 + 2 * t + j;
            if (q >= n) break;
            const u32 p = pairs[q], slot = p % a.n_used;
            MoeGateUpGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
            const float gv = 0.125f * total[j], uv = 0.125f * total[2 + j];
            ay.mid[(u64)slot * a.ff + r] = swiglu_clamped(gv, uv, a.clamp) * ay.weights[slot];
        }
    }
}

// One Q2_K block of a down tile: lane (g, t) holds the quants of 128-value chunk c = t / 2, half
// h = t % 2 (16 bytes: four 2-bit planes j of 16 values each, whose scale is byte 2j + h of the
// chunk's 8 in sa / sb) of rows g (qa) and g + 8 (qb), and reads column g's activations x. A value's
// scale folds into its weight (q * (s & 15) <= 45 fits an int8) and its min is a weight of its
// own (s >> 4), so an MMA may take 8 values of each lane's sub-block: per plane and half, one MMA
// adds the scaled quants' dots to is and one the mins' to sm, part_sums' isum and summ (the mins
// times the activations' 16-value sums, which quantize_q8_k makes from the same quants).
__device__ __forceinline__ void q2_k_mma_block(int4 qa, int4 qb, uint2 sa, uint2 sb, const BlockQ8K* x, int* is,
                                               int* sm) {
    const u32 t = threadIdx.x & 3, c = t >> 1, h = t & 1;
#pragma unroll
    for (int k = 0; k < 4; k++) is[k] = sm[k] = 0;
#pragma unroll
    for (u32 j = 0; j < 4; j++) {
        const u32 sh = 8 * ((2 * j + h) & 3);
        const u32 sca = ((j < 2 ? sa.x : sa.y) >> sh) & 255, scb = ((j < 2 ? sb.x : sb.y) >> sh) & 255;
        const u32 ka = sca & 15, kb = scb & 15;
        const u32 mins[4] = {(sca >> 4) * 0x01010101u, (scb >> 4) * 0x01010101u, (sca >> 4) * 0x01010101u,
                             (scb >> 4) * 0x01010101u};
#pragma unroll
        for (u32 half = 0; half < 2; half++) {
            const u32 a0 = (u32)(half ? qa.z : qa.x), a1 = (u32)(half ? qa.w : qa.y);
            const u32 b0 = (u32)(half ? qb.z : qb.x), b1 = (u32)(half ? qb.w : qb.y);
            const u32 w[4] = {((a0 >> (2 * j)) & 0x03030303u) * ka, ((b0 >> (2 * j)) & 0x03030303u) * kb,
                              ((a1 >> (2 * j)) & 0x03030303u) * ka, ((b1 >> (2 * j)) & 0x03030303u) * kb};
            const uint2 xv = *(const uint2*)(x->qs + 128 * c + 32 * j + 16 * h + 8 * half);
            const u32 xb[2] = {xv.x, xv.y};
            mma_s8_k32(is, w, xb);
            mma_s8_k32(sm, mins, xb);
        }
    }
}

// row_total's Q2_K term of a block: sc its d and dmin (block_scales<10>), yd the activations'.
__device__ __forceinline__ float q2_k_term(u32 sc, float yd, int is, int sm) {
    const float d = yd * h2f((u16)(sc & 0xffff)), dmin = yd * h2f((u16)(sc >> 16));
    return 0.0f + (d * (float)is - dmin * (float)sm);
}

// The mid Q8_K of pair p (its row and slot).
__device__ __forceinline__ const BlockQ8K* down_pair_x(const MoeDownGroupedArgs& a, const RowStrides& R, u32 p) {
    MoeDownGroupedArgs ay = a;
    ds4_row(ay, R, p / a.n_used);
    return ay.midq + (u64)(p % a.n_used) * (a.ff / 256);
}

// Down rows of a tile: rows g and g + 8 of a lane are r0 + g and r0 + g + 8.
#define MOE_MMA_DOWN_ROWS 16

// Q2_K down for every pair of each expert, into parts[slot] of the pair's row (moe_sum_slots adds
// them): blocks go (row block, expert), a warp per MOE_MMA_DOWN_ROWS rows; rows past out_dim read
// the last row and are not written.
extern "C" __global__ void __launch_bounds__(256, MOE_MMA_MIN_BLOCKS) moe_down_mma_q2_k(DS4_ARGS, MoeDownGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, c = t >> 1;
    const u32 r0 = (blockIdx.x / a.n_expert * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_MMA_DOWN_ROWS;
    if (r0 >= a.out_dim) return;
    const u32 nb = a.ff / 256, end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow wa = expert_row(a.down, 10, e, (u64)min(r0 + g, a.out_dim - 1) * nb);
    const ExpertRow wb = expert_row(a.down, 10, e, (u64)min(r0 + g + 8, a.out_dim - 1) * nb);
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    for (u32 i0 = 0; i0 < n; i0 += 8) {
        const BlockQ8K* xg = down_pair_x(a, R, pairs[min(i0 + g, n - 1)]);
        const BlockQ8K* x0 = down_pair_x(a, R, pairs[min(i0 + 2 * t, n - 1)]);
        const BlockQ8K* x1 = down_pair_x(a, R, pairs[min(i0 + 2 * t + 1, n - 1)]);
        int4 qa = __ldg((const int4*)(wa.qs + 16 * t)), qb = __ldg((const int4*)(wb.qs + 16 * t));
        float total[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pend[5][4];
#pragma unroll 1
        for (u32 L = 0; L < end; L++) {
            const u32 b = leaf_block(L);
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b < nb) {
                const int4 ca = qa, cb = qb;
                const u32 next = next_leaf(L, nb, end);
                if (next < end) {
                    const u64 at = (u64)leaf_block(next) * 64 + 16 * t;
                    qa = __ldg((const int4*)(wa.qs + at));
                    qb = __ldg((const int4*)(wb.qs + at));
                }
                const u8* ra = wa.rest + (u64)b * Layout<10>::RS;
                const u8* rb = wb.rest + (u64)b * Layout<10>::RS;
                const uint2 sa = make_uint2(__ldg((const u32*)(ra + 8 * c)), __ldg((const u32*)(ra + 8 * c + 4)));
                const uint2 sb = make_uint2(__ldg((const u32*)(rb + 8 * c)), __ldg((const u32*)(rb + 8 * c + 4)));
                const u32 da = __ldg((const u32*)(ra + Layout<10>::Q2K_D));
                const u32 db = __ldg((const u32*)(rb + Layout<10>::Q2K_D));
                const float y0 = x0[b].d, y1 = x1[b].d;
                int is[4], sm[4];
                q2_k_mma_block(ca, cb, sa, sb, xg + b, is, sm);
                v[0] = q2_k_term(da, y0, is[0], sm[0]);
                v[1] = q2_k_term(da, y1, is[1], sm[1]);
                v[2] = q2_k_term(db, y0, is[2], sm[2]);
                v[3] = q2_k_term(db, y1, is[3], sm[3]);
            }
            tree32_leaf<4>(pend, v, L & 31);
            if ((L & 31) == 31) {
#pragma unroll
                for (int k = 0; k < 4; k++) total[k] += v[k];
            }
        }
#pragma unroll
        for (u32 j = 0; j < 2; j++) {
            const u32 q = i0 + 2 * t + j;
            if (q >= n) break;
            const u32 p = pairs[q], slot = p % a.n_used;
            MoeDownGroupedArgs ay = a;
            ds4_row(ay, R, p / a.n_used);
            float* parts = ay.parts + (u64)slot * a.out_dim;
            if (r0 + g < a.out_dim) parts[r0 + g] = total[j];
            if (r0 + g + 8 < a.out_dim) parts[r0 + g + 8] = total[2 + j];
        }
    }
}

// The second generation of the tensor-core experts (plan.rs takes them unless DS4_CUDA_MOE_MMA=1
// keeps the first, or =0 the CUDA cores): moe_gate_up_mma2_iq2_xxs and moe_down_mma2_q2_k. The same
// tiles, MMAs, integer block sums and float order as the kernels above, with the overheads those
// measured removed: each weight fragment is decoded once for MOE2_TILES tiles of 8 pairs; a lane
// takes a block's words from a per-warp copy in shared memory (one broadcast load) instead of
// shuffles; the grid codes come from a table replicated over the banks and the signs from a
// multiply; the activations of a block's pairs are staged in shared memory once for all warps
// (padded rows: no bank conflicts), a phase ahead; weights are prefetched into L2 a few blocks
// ahead; and the block terms go through a leaf tree held in registers (the old one spilled it to
// local memory).

// Tiles of 8 pairs one pass over an expert's weights serves (more pairs: more passes), the blocks
// per SM the registers must allow, the leaves (blocks) whose activations one phase stages, and
// how many leaves ahead weights are prefetched into L2. One tile fits 2 blocks of 256 per SM
// without spilling (120 registers); two spill about 150 bytes a thread at 128 registers (a
// variant to measure where experts have more than 8 pairs: DS4_CUDA_DEFINES="MOE2_TILES=2").
#ifndef MOE2_TILES
#define MOE2_TILES 1
#endif
#ifndef MOE2_MIN_BLOCKS
#define MOE2_MIN_BLOCKS 2
#endif
#ifndef MOE2_PHASE
#define MOE2_PHASE 2
#endif
#ifndef MOE2_L2_AHEAD
#define MOE2_L2_AHEAD 4
#endif
// Pairs of sub-blocks decoded per iteration of a block's loop (registers against scheduling).
#ifndef MOE2_UNROLL
#define MOE2_UNROLL 1
#endif
// Copies of the code table (16: a lookup of 32 lanes meets at most 2 on a bank).
#define MOE2_COPIES 16
// Bytes between two pairs' staged blocks: 256 + 32, so the 16 lanes of a 64-bit load meet no bank twice.
#define MOE2_PAIR_STRIDE 288
// Candidate bytes of the IQ2_XXS decode with the sign in bit 0 of a selector nibble: 8, -8, 25,
// -25, 43, -43 (nibble 2 code + sign).
#define MOE2_PRMT_LO 0xe719f808u
#define MOE2_PRMT_HI 0x0000d52bu

// 8 scale bytes of a Q2_K block's rest: two 4-byte loads, since the rests are 20 bytes apart
// (an 8-byte load faults on every odd block).
__device__ __forceinline__ uint2 moe2_scales8(const u8* p) {
    return make_uint2(__ldg((const u32*)p), __ldg((const u32*)(p + 4)));
}
__device__ __forceinline__ void moe2_prefetch_l2(const void* p) {
#if __CUDA_ARCH__ >= 800
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// MOE2_PRMT_LO in a register the compiler keeps (it otherwise rebuilds the constant for every
// prmt, whose first operand must be a register).
__device__ __forceinline__ u32 moe2_prmt_lo() {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm volatile("mov.b32 %0, 0xe719f808;" : "=r"(r));
    return r;
#else
    return MOE2_PRMT_LO;
#endif
}

// x rotated right by n (0..31).
__device__ __forceinline__ u32 moe2_rotr(u32 x, u32 n) {
#if __CUDA_ARCH__ >= 800
    return __funnelshift_r(x, x, n);
#else
    return n ? (x >> n) | (x << (32 - n)) : x;
#endif
}

// Selector nibble n of an entry holds weight moe2_weight(n) of its 8: 0, 4, 1, 5, 2, 6, 3, 7 (the
// order in which a multiply spreads the sign bits, below). The MMA's k slots follow it: the
// staged activations are permuted the same way (moe2_permute).
__device__ __forceinline__ u32 moe2_weight(u32 n) { return n & 1 ? 4 + (n >> 1) : n >> 1; }

// The code table: entry i (twice the code of each of grid[i]'s bytes, in selector order) in
// MOE2_COPIES copies, copy c of entry i at word 16 i + c (every thread must call this).
__device__ __forceinline__ void moe2_code_table(const u64* grid, u32* codes) {
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        const u64 g = grid[i];
        u32 c = 0;
#pragma unroll
        for (u32 n = 0; n < 8; n++) {
            const u32 v = (u32)(g >> (8 * moe2_weight(n))) & 255;
            c |= 2 * ((u32)(v > 8) + (u32)(v > 25)) << (4 * n);
        }
#pragma unroll
        for (u32 k = 0; k < MOE2_COPIES; k++) codes[i * MOE2_COPIES + k] = c;
    }
}

// Grid entry t of an IQ2_XXS sub-block (words aux0, aux1) with its signs: weights 0, 4, 1, 5 in
// lo, 2, 6, 3, 7 in hi, as bytes iq2_xxs_sub would dot. The 7 sign bits go to bit 0 of nibbles
// 0, 2, 4, 6, 1, 3, 5 by one multiply (bit i lands at i + 7j; the products never overlap) and their
// parity to nibble 7. `rot` = (8 t + 26) % 32 puts the entry's index at bits 6-13; `copy` is the
// lane's copy of the table, times 4.
__device__ __forceinline__ void moe2_entry(u32 aux0, u32 aux1, u32 t, u32 rot, u32 copy, const u32* codes, u32* lo,
                                           u32* hi) {
    const u32 at = (moe2_rotr(aux0, rot) & 0x3fc0u) | copy;
    const u32 code = *(const u32*)((const u8*)codes + at);
    const u32 s = (aux1 >> (7 * t)) & 127;
    const u32 sel = (((s * 0x00204081u) & 0x01111111u) | code) | (((u32)__popc(s) << 28) & 0x10000000u);
    *lo = prmt(moe2_prmt_lo(), MOE2_PRMT_HI, sel);
    *hi = prmt(moe2_prmt_lo(), MOE2_PRMT_HI, sel >> 16);
}

// 16 activation bytes (two entries of 8) in the MMA's k order of moe2_entry.
__device__ __forceinline__ int4 moe2_permute(int4 v) {
    return make_int4((int)prmt((u32)v.x, (u32)v.y, 0x5140u), (int)prmt((u32)v.x, (u32)v.y, 0x7362u),
                     (int)prmt((u32)v.z, (u32)v.w, 0x5140u), (int)prmt((u32)v.z, (u32)v.w, 0x7362u));
}

// Leaf pair i (0..15) of a 32-leaf chunk, v the pair's sum: levels 1-4 of warp_sum's tree (level
// 0 is the pair itself). After pair 15, v holds the chunk's sum.
template <int N> __device__ __forceinline__ void moe2_tree(float (*pend)[N], float* v, u32 i) {
    if (!(i & 1)) {
#pragma unroll
        for (int k = 0; k < N; k++) pend[0][k] = v[k];
        return;
    }
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = pend[0][k] + v[k];
    if (!(i & 2)) {
#pragma unroll
        for (int k = 0; k < N; k++) pend[1][k] = v[k];
        return;
    }
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = pend[1][k] + v[k];
    if (!(i & 4)) {
#pragma unroll
        for (int k = 0; k < N; k++) pend[2][k] = v[k];
        return;
    }
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = pend[2][k] + v[k];
    if (!(i & 8)) {
#pragma unroll
        for (int k = 0; k < N; k++) pend[3][k] = v[k];
        return;
    }
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = pend[3][k] + v[k];
}

// The next leaf whose block exists after L, or `end` (next_leaf, for a cursor already at end).
__device__ __forceinline__ u32 moe2_next(u32 L, u32 nb, u32 end) { return L < end ? next_leaf(L, nb, end) : end; }

// A phase's activations: the Q8_K blocks of up to MOE2_PHASE leaves for the pass's 8 MOE2_TILES
// pairs (a column past the pairs repeats the last), 16 bytes a chunk, permuted for the MMA, and
// their d. Each thread loads its chunks into registers (stage_load) a phase before it stores them
// (stage_store), so the loads have a phase of compute to arrive.
#define MOE2_COLS (8 * MOE2_TILES)
#define MOE2_CHUNKS (MOE2_PHASE * MOE2_COLS * 16)
#define MOE2_PER_THREAD ((MOE2_CHUNKS + 255) / 256)
struct Moe2Stage {
    int4 q[MOE2_PER_THREAD];
    float d;
};

// blocks[i] for a runtime i, without local memory.
__device__ __forceinline__ u32 moe2_pick(const u32* blocks, u32 i) {
    u32 b = blocks[0];
#pragma unroll
    for (u32 k = 1; k < MOE2_PHASE; k++) b = i == k ? blocks[k] : b;
    return b;
}

// Stages leaves `blocks` (past nb: none) of the pairs `pairs[i0 ..]` (n in all); x(p) gives pair
// p's Q8_K row.
template <class X>
__device__ __forceinline__ void moe2_stage_load(Moe2Stage* s, const u32* blocks, const u32* pairs, u32 i0, u32 n,
                                                u32 nb, X x) {
#pragma unroll
    for (u32 k = 0; k < MOE2_PER_THREAD; k++) {
        const u32 c = threadIdx.x + 256 * k, slot = c / 16, leaf = slot / MOE2_COLS, col = slot % MOE2_COLS;
        const u32 b = moe2_pick(blocks, leaf);
        if (c < MOE2_CHUNKS && b < nb) {
            const BlockQ8K* y = x(pairs[min(i0 + col, n - 1)]) + b;
            s->q[k] = *((const int4*)y->qs + c % 16);
        }
    }
    if (threadIdx.x < MOE2_PHASE * MOE2_COLS) {
        const u32 b = moe2_pick(blocks, threadIdx.x / MOE2_COLS), col = threadIdx.x % MOE2_COLS;
        if (b < nb) s->d = x(pairs[min(i0 + col, n - 1)])[b].d;
    }
}
// A pair's block at MOE2_PAIR_STRIDE: for gate/up (DOWN false) permuted; for down its second 128
// bytes 8 further on, so that the 16 lanes of moe_down_mma2_q2_k's 64-bit loads meet no bank twice.
template <bool DOWN>
__device__ __forceinline__ void moe2_stage_store(const Moe2Stage* s, u8* act, float* actd, const u32* blocks, u32 nb) {
#pragma unroll
    for (u32 k = 0; k < MOE2_PER_THREAD; k++) {
        const u32 c = threadIdx.x + 256 * k, slot = c / 16, leaf = slot / MOE2_COLS, q = c % 16;
        if (c < MOE2_CHUNKS && moe2_pick(blocks, leaf) < nb) {
            if (DOWN) {
                uint2* o = (uint2*)(act + slot * MOE2_PAIR_STRIDE + 16 * q + (q >= 8 ? 8 : 0));
                o[0] = make_uint2((u32)s->q[k].x, (u32)s->q[k].y);
                o[1] = make_uint2((u32)s->q[k].z, (u32)s->q[k].w);
            }
            else *(int4*)(act + slot * MOE2_PAIR_STRIDE + 16 * q) = moe2_permute(s->q[k]);
        }
    }
    if (threadIdx.x < MOE2_PHASE * MOE2_COLS && moe2_pick(blocks, threadIdx.x / MOE2_COLS) < nb) actd[threadIdx.x] = s->d;
}
// The blocks of the next MOE2_PHASE leaves at cursor *L (advanced past them).
__device__ __forceinline__ void moe2_phase_blocks(u32* L, u32 nb, u32 end, u32* blocks) {
#pragma unroll
    for (u32 k = 0; k < MOE2_PHASE; k++) {
        blocks[k] = *L < end ? leaf_block(*L) : 0xffffffffu;
        *L = moe2_next(*L, nb, end);
    }
}

// IQ2_XXS gate and up for every pair of each expert: blocks go (64 mid rows, expert) as
// moe_gate_up_mma_iq2_xxs's, a warp per 16-row tile (8 gate rows, their 8 up rows), the same bits.
// A pass takes up to 8 MOE2_TILES pairs; every block of the row goes by in leaf order; per
// block, the warp's 1 KB of quants goes from registers (loaded a block ahead) to its copy in
// shared memory, rows 80 bytes apart so that the lanes' broadcast loads (8 rows, one chunk) meet
// no bank twice.
extern "C" __global__ void __launch_bounds__(256, MOE2_MIN_BLOCKS) moe_gate_up_mma2_iq2_xxs(DS4_ARGS, MoeGateUpGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ u32 codes[256 * MOE2_COPIES];
    __shared__ __align__(16) u8 wq[8][16 * 80];
    __shared__ __align__(16) u8 act[2][MOE2_PHASE * MOE2_COLS * MOE2_PAIR_STRIDE];
    __shared__ float actd[2][MOE2_PHASE * MOE2_COLS];
    moe2_code_table(a.grid, codes);
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 rot = (8 * t + 26) & 31, copy = 4 * (lane & 15);
    const u32 r0 = (blockIdx.x / a.n_expert * 8 + warp) * MOE_MMA_MID_ROWS;
    // A warp past ff computes row ff - 1 (it must keep the block's barriers) and writes nothing.
    const u32 nb = a.in_dim / 256, r = min(r0 + g, a.ff - 1);
    const u32 end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow gate = expert_row(a.gate, 16, e, (u64)r * nb), up = expert_row(a.up, 16, e, (u64)r * nb);
    // Lanes (g, 0) and (g, 1) prefetch gate row g and up row g into L2.
    const u8* pf = t == 0 ? gate.qs : up.qs;
    u8* mine = wq[warp];
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    auto x_of = [&](u32 p) { return gate_up_pair_x(a, R, p); };
    for (u32 i0 = 0; i0 < n; i0 += MOE2_COLS) {
        const u32 cols = min(n - i0, (u32)MOE2_COLS);
        __syncthreads();  // the previous pass has finished with the staging buffers
        // Prologue: phase 0 staged, phase 1 in registers.
        u32 Ls = 0, blocks[MOE2_PHASE];
        Moe2Stage st;
        moe2_phase_blocks(&Ls, nb, end, blocks);
        moe2_stage_load(&st, blocks, pairs, i0, n, nb, x_of);
        moe2_stage_store<false>(&st, act[0], actd[0], blocks, nb);
        moe2_phase_blocks(&Ls, nb, end, blocks);
        moe2_stage_load(&st, blocks, pairs, i0, n, nb, x_of);
        __syncthreads();
        // Weights: block of leaf 0 in registers; L2 prefetch cursor MOE2_L2_AHEAD leaves on.
        u32 Lp = 0;
        for (u32 k = 0; k < MOE2_L2_AHEAD; k++) {
            if (t < 2 && Lp < end) moe2_prefetch_l2(pf + (u64)leaf_block(Lp) * 64);
            Lp = moe2_next(Lp, nb, end);
        }
        int4 qg = __ldg((const int4*)(gate.qs + 16 * t)), qu = __ldg((const int4*)(up.qs + 16 * t));
        u16 hg = __ldg((const u16*)gate.rest), hu = __ldg((const u16*)up.rest);
        float total[MOE2_TILES][4], pend[4][MOE2_TILES * 4];
#pragma unroll
        for (int j = 0; j < MOE2_TILES; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) total[j][k] = 0.0f;
        u32 k = 0;  // present leaves so far
#pragma unroll 1
        for (u32 L2 = 0; L2 < end; L2 += 2) {
            float v[MOE2_TILES * 4];
#pragma unroll
            for (int q = 0; q < MOE2_TILES * 4; q++) v[q] = 0.0f;
#pragma unroll 1
            for (u32 h = 0; h < 2; h++) {
                const u32 L = L2 + h, b = leaf_block(L);
                if (b >= nb) {
                    // An absent leaf's term is +0 (row_total's lanes past nb).
                    if (h)
#pragma unroll
                        for (int q = 0; q < MOE2_TILES * 4; q++) v[q] = v[q] + 0.0f;
                    continue;
                }
                const u32 ph = k / MOE2_PHASE, slot = k % MOE2_PHASE;
                if (slot == 0) {
                    // A new phase: stage the next one into the other buffer (after every warp is
                    // done with it: the barrier; phase 0's other buffer is free since the pass
                    // began) and load the one after into registers.
                    if (k > 0) __syncthreads();
                    moe2_stage_store<false>(&st, act[(ph + 1) & 1], actd[(ph + 1) & 1], blocks, nb);
                    moe2_phase_blocks(&Ls, nb, end, blocks);
                    moe2_stage_load(&st, blocks, pairs, i0, n, nb, x_of);
                }
                k++;
                const u8* xs = act[ph & 1] + slot * MOE2_COLS * MOE2_PAIR_STRIDE;
                const float* xd = actd[ph & 1] + slot * MOE2_COLS;
                // This block's quants to the warp's copy; the next block's into registers.
                __syncwarp();
                *(int4*)(mine + 80 * g + 16 * t) = qg;
                *(int4*)(mine + 80 * (8 + g) + 16 * t) = qu;
                __syncwarp();
                const float dg = h2f(hg), du = h2f(hu);
                const u32 next = next_leaf(L, nb, end);
                if (next < end) {
                    const u64 at = (u64)leaf_block(next) * 64 + 16 * t;
                    qg = __ldg((const int4*)(gate.qs + at));
                    qu = __ldg((const int4*)(up.qs + at));
                    hg = __ldg((const u16*)gate.rest + leaf_block(next));
                    hu = __ldg((const u16*)up.rest + leaf_block(next));
                }
                if (t < 2 && Lp < end) moe2_prefetch_l2(pf + (u64)leaf_block(Lp) * 64);
                Lp = moe2_next(Lp, nb, end);
                int is[MOE2_TILES][4];
#pragma unroll
                for (int j = 0; j < MOE2_TILES; j++)
#pragma unroll
                    for (int q = 0; q < 4; q++) is[j][q] = 0;
#pragma unroll MOE2_UNROLL
                for (u32 c = 0; c < 4; c++) {
                    // Sub-blocks 2c, 2c + 1 of gate row g and up row g (one broadcast load each).
                    const uint4 wg = *(const uint4*)(mine + 80 * g + 16 * c);
                    const uint4 wu = *(const uint4*)(mine + 80 * (8 + g) + 16 * c);
#pragma unroll
                    for (u32 hs = 0; hs < 2; hs++) {
                        const u32 s = 2 * c + hs;
                        const u32 g0 = hs ? wg.z : wg.x, g1 = hs ? wg.w : wg.y;
                        const u32 u0 = hs ? wu.z : wu.x, u1 = hs ? wu.w : wu.y;
                        u32 w[4];
                        moe2_entry(g0, g1, t, rot, copy, codes, &w[0], &w[2]);
                        moe2_entry(u0, u1, t, rot, copy, codes, &w[1], &w[3]);
                        const int sg = (int)((g1 >> 27) | 1), su = (int)((u1 >> 27) | 1);
#pragma unroll
                        for (int j = 0; j < MOE2_TILES; j++) {
                            if (j > 0 && 8 * j >= cols) break;  // uniform: no pairs for this tile
                            const u32 col = min(8 * j + g, cols - 1);
                            const uint2 xv = *(const uint2*)(xs + col * MOE2_PAIR_STRIDE + 32 * s + 8 * t);
                            const u32 xb[2] = {xv.x, xv.y};
                            int d[4] = {0, 0, 0, 0};
                            mma_s8_k32(d, w, xb);
                            is[j][0] += d[0] * sg;
                            is[j][1] += d[1] * sg;
                            is[j][2] += d[2] * su;
                            is[j][3] += d[3] * su;
                        }
                    }
                }
                // row_total's terms: the lane's first add from +0 is kept.
#pragma unroll
                for (int j = 0; j < MOE2_TILES; j++) {
                    if (j > 0 && 8 * j >= cols) break;
                    const float y0 = xd[min(8 * j + 2 * t, cols - 1)], y1 = xd[min(8 * j + 2 * t + 1, cols - 1)];
                    const float tv[4] = {0.0f + (dg * y0) * (float)is[j][0], 0.0f + (dg * y1) * (float)is[j][1],
                                         0.0f + (du * y0) * (float)is[j][2], 0.0f + (du * y1) * (float)is[j][3]};
                    // Level 0 of the tree: leaf 2i + h.
#pragma unroll
                    for (int q = 0; q < 4; q++) v[4 * j + q] = h ? v[4 * j + q] + tv[q] : tv[q];
                }
            }
            moe2_tree<MOE2_TILES * 4>(pend, v, (L2 >> 1) & 15);
            if ((L2 & 31) == 30) {
#pragma unroll
                for (int j = 0; j < MOE2_TILES; j++)
#pragma unroll
                    for (int q = 0; q < 4; q++) total[j][q] += v[4 * j + q];
            }
        }
        if (r0 + g >= a.ff) continue;
#pragma unroll
        for (int j = 0; j < MOE2_TILES; j++) {
#pragma unroll
            for (u32 jj = 0; jj < 2; jj++) {
                const u32 q = i0 + 8 * j + 2 * t + jj;
                if (q >= n) break;
                const u32 p = pairs[q], slot = p % a.n_used;
                MoeGateUpGroupedArgs ay = a;
                ds4_row(ay, R, p / a.n_used);
                const float gv = 0.125f * total[j][jj], uv = 0.125f * total[j][2 + jj];
                ay.mid[(u64)slot * a.ff + r0 + g] = swiglu_clamped(gv, uv, a.clamp) * ay.weights[slot];
            }
        }
    }
}

// Q2_K down for every pair of each expert, into parts[slot] of the pair's row: blocks go (row
// block, expert) as moe_down_mma_q2_k's, a warp per 16 output rows, the same bits. A lane's 16
// quant bytes of each row are its own k slots (q2_k_mma_block), so they go straight from the
// registers (loaded a block ahead, with the block's scales) to the MMAs; the pairs' mid Q8_K is
// staged in shared memory a phase ahead, as the gate/up kernel stages its activations.
extern "C" __global__ void __launch_bounds__(256, MOE2_MIN_BLOCKS) moe_down_mma2_q2_k(DS4_ARGS, MoeDownGroupedArgs a) {
    ds4_wait_predecessor();
    const u32 e = blockIdx.x % a.n_expert;
    if (a.route[e] == 0) return;
    __shared__ __align__(16) u8 act[2][MOE2_PHASE * MOE2_COLS * MOE2_PAIR_STRIDE];
    __shared__ float actd[2][MOE2_PHASE * MOE2_COLS];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, c = t >> 1, h = t & 1;
    const u32 r0 = (blockIdx.x / a.n_expert * 8 + warp) * MOE_MMA_DOWN_ROWS;
    // A warp past out_dim computes the last row (it must keep the block's barriers), writes nothing.
    const u32 nb = a.ff / 256, end = (nb + DS4_BLOCK_CHUNK - 1) / DS4_BLOCK_CHUNK * DS4_BLOCK_CHUNK;
    const ExpertRow wa = expert_row(a.down, 10, e, (u64)min(r0 + g, a.out_dim - 1) * nb);
    const ExpertRow wb = expert_row(a.down, 10, e, (u64)min(r0 + g + 8, a.out_dim - 1) * nb);
    // Lanes (g, 0) and (g, 1) prefetch rows g and g + 8 into L2 (quants; the rest is a fifth as big).
    const u8* pf = t == 0 ? wa.qs : wb.qs;
    const u32* pairs;
    const u32 n = moe_route_pairs(a.route, a.n_expert, e, &pairs);
    auto x_of = [&](u32 p) { return down_pair_x(a, R, p); };
    for (u32 i0 = 0; i0 < n; i0 += MOE2_COLS) {
        const u32 cols = min(n - i0, (u32)MOE2_COLS);
        __syncthreads();  // the previous pass has finished with the staging buffers
        u32 Ls = 0, blocks[MOE2_PHASE];
        Moe2Stage st;
        moe2_phase_blocks(&Ls, nb, end, blocks);
        moe2_stage_load(&st, blocks, pairs, i0, n, nb, x_of);
        moe2_stage_store<true>(&st, act[0], actd[0], blocks, nb);
        moe2_phase_blocks(&Ls, nb, end, blocks);
        moe2_stage_load(&st, blocks, pairs, i0, n, nb, x_of);
        __syncthreads();
        u32 Lp = 0;
        for (u32 k = 0; k < MOE2_L2_AHEAD; k++) {
            if (t < 2 && Lp < end) moe2_prefetch_l2(pf + (u64)leaf_block(Lp) * 64);
            Lp = moe2_next(Lp, nb, end);
        }
        // Block 0's quants, the scales of chunk c, d and dmin, of rows g and g + 8.
        int4 qa = __ldg((const int4*)(wa.qs + 16 * t)), qb = __ldg((const int4*)(wb.qs + 16 * t));
        uint2 sa = moe2_scales8(wa.rest + 8 * c), sb = moe2_scales8(wb.rest + 8 * c);
        u32 da = __ldg((const u32*)(wa.rest + Layout<10>::Q2K_D)), db = __ldg((const u32*)(wb.rest + Layout<10>::Q2K_D));
        float total[MOE2_TILES][4], pend[4][MOE2_TILES * 4];
#pragma unroll
        for (int j = 0; j < MOE2_TILES; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) total[j][k] = 0.0f;
        u32 k = 0;
#pragma unroll 1
        for (u32 L2 = 0; L2 < end; L2 += 2) {
            float v[MOE2_TILES * 4];
#pragma unroll
            for (int q = 0; q < MOE2_TILES * 4; q++) v[q] = 0.0f;
#pragma unroll 1
            for (u32 hl = 0; hl < 2; hl++) {
                const u32 L = L2 + hl, b = leaf_block(L);
                if (b >= nb) {
                    if (hl)
#pragma unroll
                        for (int q = 0; q < MOE2_TILES * 4; q++) v[q] = v[q] + 0.0f;
                    continue;
                }
                const u32 ph = k / MOE2_PHASE, slot = k % MOE2_PHASE;
                if (slot == 0) {
                    if (k > 0) __syncthreads();
                    moe2_stage_store<true>(&st, act[(ph + 1) & 1], actd[(ph + 1) & 1], blocks, nb);
                    moe2_phase_blocks(&Ls, nb, end, blocks);
                    moe2_stage_load(&st, blocks, pairs, i0, n, nb, x_of);
                }
                k++;
                const u8* xs = act[ph & 1] + slot * MOE2_COLS * MOE2_PAIR_STRIDE;
                const float* xd = actd[ph & 1] + slot * MOE2_COLS;
                const int4 ca = qa, cb = qb;
                const uint2 csa = sa, csb = sb;
                const u32 cda = da, cdb = db;
                const u32 next = next_leaf(L, nb, end);
                if (next < end) {
                    const u32 nbk = leaf_block(next);
                    const u8* ra = wa.rest + (u64)nbk * Layout<10>::RS;
                    const u8* rb = wb.rest + (u64)nbk * Layout<10>::RS;
                    qa = __ldg((const int4*)(wa.qs + (u64)nbk * 64 + 16 * t));
                    qb = __ldg((const int4*)(wb.qs + (u64)nbk * 64 + 16 * t));
                    sa = moe2_scales8(ra + 8 * c);
                    sb = moe2_scales8(rb + 8 * c);
                    da = __ldg((const u32*)(ra + Layout<10>::Q2K_D));
                    db = __ldg((const u32*)(rb + Layout<10>::Q2K_D));
                }
                if (t < 2 && Lp < end) moe2_prefetch_l2(pf + (u64)leaf_block(Lp) * 64);
                Lp = moe2_next(Lp, nb, end);
                int is[MOE2_TILES][4], sm[MOE2_TILES][4];
#pragma unroll
                for (int j = 0; j < MOE2_TILES; j++)
#pragma unroll
                    for (int q = 0; q < 4; q++) is[j][q] = sm[j][q] = 0;
                // q2_k_mma_block's MMAs, each weight fragment built once for every tile.
#pragma unroll
                for (u32 jp = 0; jp < 4; jp++) {
                    const u32 sh = 8 * ((2 * jp + h) & 3);
                    const u32 sca = ((jp < 2 ? csa.x : csa.y) >> sh) & 255, scb = ((jp < 2 ? csb.x : csb.y) >> sh) & 255;
                    const u32 ka = sca & 15, kb = scb & 15;
                    const u32 mins[4] = {(sca >> 4) * 0x01010101u, (scb >> 4) * 0x01010101u, (sca >> 4) * 0x01010101u,
                                         (scb >> 4) * 0x01010101u};
#pragma unroll
                    for (u32 half = 0; half < 2; half++) {
                        const u32 a0 = (u32)(half ? ca.z : ca.x), a1 = (u32)(half ? ca.w : ca.y);
                        const u32 b0 = (u32)(half ? cb.z : cb.x), b1 = (u32)(half ? cb.w : cb.y);
                        const u32 w[4] = {((a0 >> (2 * jp)) & 0x03030303u) * ka, ((b0 >> (2 * jp)) & 0x03030303u) * kb,
                                          ((a1 >> (2 * jp)) & 0x03030303u) * ka, ((b1 >> (2 * jp)) & 0x03030303u) * kb};
#pragma unroll
                        for (int j = 0; j < MOE2_TILES; j++) {
                            if (j > 0 && 8 * j >= cols) break;  // uniform: no pairs for this tile
                            const u32 col = min(8 * j + g, cols - 1);
                            const uint2 xv =
                                *(const uint2*)(xs + col * MOE2_PAIR_STRIDE + 136 * c + 32 * jp + 16 * h + 8 * half);
                            const u32 xb[2] = {xv.x, xv.y};
                            mma_s8_k32(is[j], w, xb);
                            mma_s8_k32(sm[j], mins, xb);
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < MOE2_TILES; j++) {
                    if (j > 0 && 8 * j >= cols) break;
                    const float y0 = xd[min(8 * j + 2 * t, cols - 1)], y1 = xd[min(8 * j + 2 * t + 1, cols - 1)];
                    const float tv[4] = {q2_k_term(cda, y0, is[j][0], sm[j][0]), q2_k_term(cda, y1, is[j][1], sm[j][1]),
                                         q2_k_term(cdb, y0, is[j][2], sm[j][2]), q2_k_term(cdb, y1, is[j][3], sm[j][3])};
#pragma unroll
                    for (int q = 0; q < 4; q++) v[4 * j + q] = hl ? v[4 * j + q] + tv[q] : tv[q];
                }
            }
            moe2_tree<MOE2_TILES * 4>(pend, v, (L2 >> 1) & 15);
            if ((L2 & 31) == 30) {
#pragma unroll
                for (int j = 0; j < MOE2_TILES; j++)
#pragma unroll
                    for (int q = 0; q < 4; q++) total[j][q] += v[4 * j + q];
            }
        }
#pragma unroll
        for (int j = 0; j < MOE2_TILES; j++) {
#pragma unroll
            for (u32 jj = 0; jj < 2; jj++) {
                const u32 q = i0 + 8 * j + 2 * t + jj;
                if (q >= n) break;
                const u32 p = pairs[q], slot = p % a.n_used;
                MoeDownGroupedArgs ay = a;
                ds4_row(ay, R, p / a.n_used);
                float* parts = ay.parts + (u64)slot * a.out_dim;
                if (r0 + g < a.out_dim) parts[r0 + g] = total[j][jj];
                if (r0 + g + 8 < a.out_dim) parts[r0 + g + 8] = total[j][2 + jj];
            }
        }
    }
}
#endif
#endif

// The expert cache (placement "host", src/placement.rs): routed experts live in page-locked host
// memory and the kernels reach each expert through a table (kernels/moe.cu, ExpertRow). Device
// memory left over holds slots, each a copy of one expert's gate, up and down. After the router
// picks a token's experts, expert_cache_plan (one thread) looks them up, evicts the least
// recently used slots for the ones missing and points their table entries at those slots;
// expert_cache_copy (every block) then copies the missing experts in from host memory. Both run
// inside the token's graph: no host round trip. An expert with no slot free (more used than
// slots) is read from host memory directly. The weights and so the results never change.
//
// State of one layer, as i32 (laid out by backends/cuda/mod.rs): n_slots, tick, n_jobs, jobs_at,
// slot_expert[n_slots], slot_stamp[n_slots], expert_slot[n_expert]; from i32 index jobs_at
// (8-byte aligned) the copy jobs of this token, (source, destination, bytes) as u64 each.

#define CACHE_PIECES 6

// Offset of piece p (gate quants, gate rest, up quants, up rest, down quants, down rest) in a
// slot: each piece starts 256-aligned (backends/cuda/mod.rs sizes slots the same way).
__device__ __forceinline__ u64 cache_piece_offset(const u32* sizes, u32 p) {
    u64 off = 0;
    for (u32 i = 0; i < p; i++) off += ((u64)sizes[i] + 255) / 256 * 256;
    return off;
}

extern "C" __global__ void expert_cache_plan(DS4_ARGS, ExpertCachePlanArgs a) {
    DS4_GUARD;
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int* st = a.state;
    const int n_slots = st[0];
    const int tick = st[1] + 1;
    st[1] = tick;
    int* slot_expert = st + 4;
    int* stamp = slot_expert + n_slots;
    int* expert_slot = stamp + n_slots;
    u64* jobs = (u64*)(st + st[3]);
    int n_jobs = 0;
    u64* tables[3] = {a.gate_table, a.up_table, a.down_table};
    const u64* homes[3] = {a.gate_home, a.up_home, a.down_home};
    const u32 sizes[CACHE_PIECES] = {a.gate_qs, a.gate_rest, a.up_qs, a.up_rest, a.down_qs, a.down_rest};
    u64 hits = 0, copies = 0, direct = 0;
    for (u32 s = 0; s < a.n_used; s++) {
        const int e = min(max(a.selected[s], 0), (int)a.n_expert - 1);
        const int k = expert_slot[e];
        if (k >= 0) {
            stamp[k] = tick;
            hits++;
            continue;
        }
        int best = -1;
        for (int j = 0; j < n_slots; j++)
            if (stamp[j] != tick && (best < 0 || stamp[j] < stamp[best])) best = j;
        if (best < 0) {  // every slot holds an expert of this token: read this one from host memory
            direct++;
            continue;
        }
        const int old = slot_expert[best];
        if (old >= 0) {
            expert_slot[old] = -1;
            for (int t = 0; t < 3; t++) {
                tables[t][2 * old] = homes[t][2 * old];
                tables[t][2 * old + 1] = homes[t][2 * old + 1];
            }
        }
        slot_expert[best] = e;
        expert_slot[e] = best;
        stamp[best] = tick;
        const u64 base = (u64)a.slots + (u64)best * a.slot_bytes;
        for (u32 p = 0; p < CACHE_PIECES; p++) {
            const u64 dst = base + cache_piece_offset(sizes, p);
            tables[p / 2][2 * e + (p & 1)] = dst;
            jobs[3 * n_jobs] = homes[p / 2][2 * e + (p & 1)];
            jobs[3 * n_jobs + 1] = dst;
            jobs[3 * n_jobs + 2] = sizes[p];
            n_jobs++;
        }
        copies++;
    }
    st[2] = n_jobs;
    a.stats[0] += hits;
    a.stats[1] += copies;
    a.stats[2] += direct;
}

extern "C" __global__ void expert_cache_copy(DS4_ARGS, ExpertCacheCopyArgs a) {
    DS4_GUARD;
    const int n_jobs = a.state[2];
    const u64* jobs = (const u64*)(a.state + a.state[3]);
    const u64 stride = (u64)gridDim.x * blockDim.x, first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (int j = 0; j < n_jobs; j++) {
        const u8* src = (const u8*)jobs[3 * j];
        u8* dst = (u8*)jobs[3 * j + 1];
        const u64 n = jobs[3 * j + 2];
        if ((((u64)src | (u64)dst | n) & 15) == 0) {
            for (u64 i = first; i < n / 16; i += stride) ((uint4*)dst)[i] = ((const uint4*)src)[i];
        } else {
            for (u64 i = first; i < n; i += stride) dst[i] = src[i];
        }
    }
}

// Fused launches: runs of small ops of one layer in one kernel. Each op's arithmetic is its own
// kernel's (the same device functions, the same order), so fusing changes no bit; only the
// launches between them go. backends/cuda/plan.rs decides which runs fuse.

// After the q and kv projections: each q head RMS-normalized in place (no weight) and its tail
// rotated; the kv row RMS-normalized with its weight, rotated, fp8 round-tripped and stored into
// the raw ring at pos % raw_cap. Blocks 0..n_head take a q head each, block n_head the kv row.
extern "C" __global__ void qkv_finish(DS4_ARGS, QkvFinishArgs a) {
    DS4_GUARD;
    const u32 hd = a.head_dim, pairs = a.n_rot / 2, h = blockIdx.x;
    const float* trow = a.table + (u64)P->pos * pairs * 2;
    if (h < a.n_head) {
        float* x = a.q + (u64)h * hd;
        const float scale = rms_scale_block(x, hd, a.eps_q);
        for (u32 i = threadIdx.x; i < hd; i += blockDim.x) x[i] = x[i] * scale;
        __syncthreads();
        rope_tail_block(x + (hd - a.n_rot), trow, pairs, false);
        return;
    }
    const float scale = rms_scale_block(a.kv_raw, hd, a.eps_kv);
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        const float v = a.kv_raw[i] * scale;
        a.kv[i] = v * a.kv_norm[i];
    }
    __syncthreads();
    rope_tail_block(a.kv + (hd - a.n_rot), trow, pairs, false);
    __syncthreads();
    fp8_round_trip_block(a.kv, hd - a.n_rot);
    __syncthreads();
    float* dst = a.cache + (u64)(P->pos % a.raw_cap) * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = round_f16(a.kv[i]);
}

// One compressor lane of a token, one block: the window state update (compressor_store), then,
// on an emit token (`emit_cond`), the pool, the RMS norm with weight, the RoPE of the row's tail
// at its first position, the fp8 (quant 0) or Hadamard + FP4 (quant 1) round trip, the f16 store
// as compressed row (pos+1)/ratio - 1, and for ratio 4 the window shift.
__device__ __forceinline__ void compressor_update_row(const StepParams* P, const CompressorUpdateArgs& a) {
    const u32 width = a.width, ratio = a.ratio, hd = a.head_dim, pos = P->pos;
    const u32 pos_mod = pos % ratio;
    const u32 srow = ratio == 4 ? 4 + pos_mod : pos_mod;
    for (u32 j = threadIdx.x; j < width; j += blockDim.x) {
        a.state_kv[(u64)srow * width + j] = a.kv[j];
        a.state_score[(u64)srow * width + j] = a.score[j] + wload(a.ape, a.ape_f16, (u64)pos_mod * width + j);
    }
    if (!ds4_cond(P, a.emit_cond)) return;
    __syncthreads();
    for (u32 j = threadIdx.x; j < hd; j += blockDim.x)
        a.pooled[j] = compressor_pool_value(a.state_kv, a.state_score, hd, ratio, j);
    __syncthreads();
    const float scale = rms_scale_block(a.pooled, hd, a.eps);
    for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
        const float v = a.pooled[j] * scale;
        a.row[j] = v * a.norm_w[j];
    }
    __syncthreads();
    const u32 pairs = a.n_rot / 2;
    const u32 rpos = pos + 1 >= ratio ? pos + 1 - ratio : 0;
    rope_tail_block(a.row + (hd - a.n_rot), a.table + (u64)rpos * pairs * 2, pairs, false);
    __syncthreads();
    if (a.quant == 0) fp8_round_trip_block(a.row, hd - a.n_rot);
    else indexer_qat_block(a.row);
    __syncthreads();
    const u32 n = (pos + 1) / ratio;
    if (n > 0)
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) a.cache[(u64)(n - 1) * hd + j] = round_f16(a.row[j]);
    if (ratio == 4) {
        const u32 ns = ratio * width;
        for (u32 i = threadIdx.x; i < ns; i += blockDim.x) {
            a.state_kv[i] = a.state_kv[ns + i];
            a.state_score[i] = a.state_score[ns + i];
        }
    }
}

extern "C" __global__ void compressor_update(DS4_ARGS, CompressorUpdateArgs a) {
#if DS4_CHUNK_ROWS
    // One launch for a chunk's whole row loop (the row count in cond bits 50..62): the rows in
    // order in this block, each with its own step parameters and pointers; the barrier after a
    // row makes its state writes visible to the next.
    ds4_wait_predecessor();
    const u32 n_rows = (u32)(cond >> 50) & 0x1fff;
    for (u32 y = 0; y < n_rows; y++) {
        if (ds4_cond(P + y, cond)) {
            CompressorUpdateArgs ay = a;
            ds4_row(ay, R, y);
            compressor_update_row(P + y, ay);
        }
        __syncthreads();
    }
#else
    DS4_GUARD;
    compressor_update_row(P, a);
#endif
}

#if DS4_CHUNK_ROWS
// compressor_update_chunk: the same chunk row loop with the rows in parallel (a block per chunk
// row; only emit rows do work). A window's state rows come from the chunk's own kv / score rows or
// from the state carried into the chunk, so an emit block finds for each state row its source as
// the serial loop would have left it at that row, pools from the sources, and does the emit as
// compressor_update_row (same device functions, same order). The last block to finish (a
// ticket) writes the state left after the chunk, once no block still reads the carried state.
#define COMP_MAX_STATE_ROWS 256
#define COMP_MAX_HEAD_DIM 512
#define COMP_CHUNK_THREADS 512

// Source of window state row s: chunk row src >= 0 (its kv, and its score + ape at its
// pos % ratio), or carried state row -1 - src.
struct CompSources {
    int src[COMP_MAX_STATE_ROWS];
    const float* kv[COMP_MAX_STATE_ROWS];
    const float* score[COMP_MAX_STATE_ROWS];
    int ape[COMP_MAX_STATE_ROWS];  // element offset of the ape row, -1 for carried rows
    int emit_before;               // the last emit row before (or up to) y, -1 if none
    int emit_after;                // an emit row after y exists
};

// The state rows after row y's store (and, with `through`, after its shift): state row s of the
// serial loop holds the latest active row y' <= y that stored into it, else the carried row. For
// ratio 4, rows 4..8 take stores (4 + pos % 4); rows 0..4 are rows 4..8 as they were at the last
// emit e (< y, or <= y with `through`), else the carried rows 0..4. Every thread must call it.
__device__ void comp_sources(const StepParams* P, u64 cond, const CompressorUpdateArgs& a, const RowStrides& R,
                             u32 n_rows, u32 y, bool through, CompSources* S) {
    const u32 ratio = a.ratio, ns = ratio == 4 ? 8 : ratio;
    for (u32 s = threadIdx.x; s < ns; s += blockDim.x) S->src[s] = -1 - (int)s;
    if (threadIdx.x == 0) {
        S->emit_before = -1;
        S->emit_after = 0;
    }
    __syncthreads();
    for (u32 t = threadIdx.x; t < n_rows; t += blockDim.x) {
        if (!ds4_cond(P + t, cond)) continue;
        const u32 m = P[t].pos % ratio;
        const bool em = ds4_cond(P + t, a.emit_cond);
        if (t <= y) atomicMax(&S->src[ratio == 4 ? 4 + m : m], (int)t);
        if (em && (t < y || (through && t == y))) atomicMax(&S->emit_before, (int)t);
        if (em && t > y) S->emit_after = 1;
    }
    __syncthreads();
    const int e = S->emit_before;
    if (ratio == 4 && e >= 0) {
        // Rows 0..4 as rows 4..8 were after row e's store: its chunk rows, else carried rows 4..8.
        if (threadIdx.x < 4) S->src[threadIdx.x] = -5 - (int)threadIdx.x;
        __syncthreads();
        for (u32 t = threadIdx.x; t <= (u32)e; t += blockDim.x)
            if (ds4_cond(P + t, cond)) atomicMax(&S->src[P[t].pos % 4], (int)t);
        __syncthreads();
    }
    for (u32 s = threadIdx.x; s < ns; s += blockDim.x) {
        const int src = S->src[s];
        if (src >= 0) {
            CompressorUpdateArgs at = a;
            ds4_row(at, R, (u32)src);
            S->kv[s] = at.kv;
            S->score[s] = at.score;
            S->ape[s] = (int)((P[src].pos % ratio) * a.width);
        } else {
            const u64 k = (u64)(-1 - src);
            S->kv[s] = a.state_kv + k * a.width;
            S->score[s] = a.state_score + k * a.width;
            S->ape[s] = -1;
        }
    }
    __syncthreads();
}

// Window state row s, column c, as the serial loop's state holds it.
__device__ __forceinline__ float comp_score(const CompSources* S, const CompressorUpdateArgs& a, u32 s, u32 c) {
    const float v = S->score[s][c];
    const int o = S->ape[s];
    return o >= 0 ? v + wload(a.ape, a.ape_f16, (u64)o + c) : v;
}

// compressor_pool_value over the sources (the same order: maxima, then the sums in row order).
__device__ float comp_pool_value(const CompSources* S, const CompressorUpdateArgs& a, u32 j) {
    const u32 hd = a.head_dim, ratio = a.ratio;
    float mx = -1.0e30f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            mx = fmaxf(mx, comp_score(S, a, r, j));
            mx = fmaxf(mx, comp_score(S, a, 4 + r, hd + j));
        }
    } else {
#pragma unroll 4
        for (u32 r = 0; r < ratio; r++) mx = fmaxf(mx, comp_score(S, a, r, j));
    }
    if (mx <= -1.0e30f * 0.5f) return 0.0f;
    float denom = 0.0f, sum = 0.0f;
    if (ratio == 4) {
        for (u32 r = 0; r < 4; r++) {
            const float wp = ds4_expf(comp_score(S, a, r, j) - mx), wc = ds4_expf(comp_score(S, a, 4 + r, hd + j) - mx);
            denom += wp + wc;
            sum += wp * S->kv[r][j];
            sum += wc * S->kv[4 + r][hd + j];
        }
    } else {
#pragma unroll 4
        for (u32 r = 0; r < ratio; r++) {
            const float w = ds4_expf(comp_score(S, a, r, j) - mx);
            denom += w;
            sum += w * S->kv[r][j];
        }
    }
    return denom > 0.0f ? sum / denom : 0.0f;
}

// State rows first..end (all `width` columns) from their sources, where that is not the row
// itself: 4-column pieces, each thread's loads of four pieces issued before their stores.
__device__ void comp_write_state(const CompSources* S, const CompressorUpdateArgs& a, u32 first, u32 end) {
    const u32 w4 = a.width / 4, n = (end - first) * w4;
    for (u32 i0 = 0; i0 < n; i0 += 4 * blockDim.x) {
        float4 kv[4], sc[4];
        u64 at[4];
        bool on[4];
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            const u32 i = i0 + u * blockDim.x + threadIdx.x;
            const u32 s = first + i / w4, c = (i % w4) * 4;
            on[u] = i < n && S->src[s] != -1 - (int)s;
            at[u] = (u64)s * a.width + c;
            if (on[u]) {
                kv[u] = *(const float4*)(S->kv[s] + c);
                const float4 v = *(const float4*)(S->score[s] + c);
                const int o = S->ape[s];
                sc[u] = v;
                if (o >= 0) {
                    sc[u].x = v.x + wload(a.ape, a.ape_f16, (u64)o + c);
                    sc[u].y = v.y + wload(a.ape, a.ape_f16, (u64)o + c + 1);
                    sc[u].z = v.z + wload(a.ape, a.ape_f16, (u64)o + c + 2);
                    sc[u].w = v.w + wload(a.ape, a.ape_f16, (u64)o + c + 3);
                }
            }
        }
#pragma unroll
        for (u32 u = 0; u < 4; u++)
            if (on[u]) {
                *(float4*)(a.state_kv + at[u]) = kv[u];
                *(float4*)(a.state_score + at[u]) = sc[u];
            }
    }
}

extern "C" __global__ void __launch_bounds__(COMP_CHUNK_THREADS) compressor_update_chunk(DS4_ARGS, CompressorUpdateArgs a) {
    ds4_wait_predecessor();
    __shared__ CompSources S;
    __shared__ __align__(16) float pooled[COMP_MAX_HEAD_DIM];
    __shared__ __align__(16) float row[COMP_MAX_HEAD_DIM];
    __shared__ bool last;
    const u32 n_rows = (u32)(cond >> 50) & 0x1fff, y = blockIdx.x;
    const u32 hd = a.head_dim, ratio = a.ratio;
    if (y < n_rows && ds4_cond(P + y, cond) && ds4_cond(P + y, a.emit_cond)) {
        const u32 pos = P[y].pos;
        comp_sources(P, cond, a, R, n_rows, y, false, &S);
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) pooled[j] = comp_pool_value(&S, a, j);
        __syncthreads();
        const float scale = rms_scale_block(pooled, hd, a.eps);
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
            const float v = pooled[j] * scale;
            row[j] = v * a.norm_w[j];
        }
        __syncthreads();
        const u32 pairs = a.n_rot / 2;
        const u32 rpos = pos + 1 >= ratio ? pos + 1 - ratio : 0;
        rope_tail_block(row + (hd - a.n_rot), a.table + (u64)rpos * pairs * 2, pairs, false);
        __syncthreads();
        if (a.quant == 0) fp8_round_trip_block(row, hd - a.n_rot);
        else indexer_qat_block(row);
        __syncthreads();
        const u32 n = (pos + 1) / ratio;
        // The row's pooled and row outputs, as the loop leaves them (a shared buffer: the last emit's).
        CompressorUpdateArgs ay = a, an = a;
        ds4_row(ay, R, y);
        ds4_row(an, R, y + 1);
        const bool later = S.emit_after != 0;
        for (u32 j = threadIdx.x; j < hd; j += blockDim.x) {
            if (n > 0) a.cache[(u64)(n - 1) * hd + j] = round_f16(row[j]);
            if (!later || an.pooled != ay.pooled) ay.pooled[j] = pooled[j];
            if (!later || an.row != ay.row) ay.row[j] = row[j];
        }
    }
    // Every read of the carried state is done before this block takes its ticket.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(a.tickets + a.ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    comp_sources(P, cond, a, R, n_rows, n_rows - 1, true, &S);
    // Ratio 4's rows 0..4 may copy the carried rows 4..8: before those are overwritten.
    if (ratio == 4) {
        comp_write_state(&S, a, 0, 4);
        __syncthreads();
        comp_write_state(&S, a, 4, 8);
    } else {
        comp_write_state(&S, a, 0, ratio);
    }
    if (threadIdx.x == 0) a.tickets[a.ticket] = 0;
}
#endif

// Lane sum of one 512-term chunk of an F16 row times x * scale (the RMS-normalized input, each
// value rounded as rms_norm stores it), in chunk_dot_f16's order.
__device__ __forceinline__ float chunk_dot_f16_scaled(const F16Chunk& c, const float* x, float scale, u32 n, u32 lane) {
    float acc = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 2; u++) {
        const u32 i = u * 256 + lane * 8;
        if (i < n) {
            const uint4 q = c.q[u];
            const float4 p = *(const float4*)(x + i), s = *(const float4*)(x + i + 4);
            acc += h2f((u16)(q.x & 0xffff)) * (p.x * scale);
            acc += h2f((u16)(q.x >> 16)) * (p.y * scale);
            acc += h2f((u16)(q.y & 0xffff)) * (p.z * scale);
            acc += h2f((u16)(q.y >> 16)) * (p.w * scale);
            acc += h2f((u16)(q.z & 0xffff)) * (s.x * scale);
            acc += h2f((u16)(q.z >> 16)) * (s.y * scale);
            acc += h2f((u16)(q.w & 0xffff)) * (s.z * scale);
            acc += h2f((u16)(q.w >> 16)) * (s.w * scale);
        }
    }
    return acc;
}

// The HC pre-mix of a half-layer: the plain RMS norm of the streams (`flat`), the F16 control
// projection (`mix`, split-K: a warp per 512-chunk of a row), the Sinkhorn split, the weighted sum
// of the streams (`cur`) and the sublayer's RMS norm with weight (`norm`, with its Q8_0
// quantization when `xq` is set, and its Q8_K when `xk` is).
//
// The norm's scale comes from the streams' chunk sums of squares when the hc_post that wrote them
// stored those (`ss`); otherwise every block sums the streams itself. The blocks form two groups
// with a ticket each: the first `blocks_pre` blocks take mix rows 0..3 (the pre gates), the rest
// rows 4.. (post gates and combine matrix). The last block of the first group does the weighted
// sum and the norm, which need only the pre gates; the last block of the second group runs the
// Sinkhorn split, which only hc_post reads, on another SM at the same time. The tails are chains
// of dependent steps on one SM, so each step issues all its loads before using any.
#define HC_PRE_MAX_PARTIALS 2048
#define HC_PRE_MAX_EMBD 8192
#define HC_PRE_WARPS 16

// The sum from +0 of v[0..n] in order, where lane k of the warp holds v[k0 + k]; every lane
// gets it.
__device__ __forceinline__ float ordered_sum_lanes(const float* v, u32 n, u32 lane) {
    float total = 0.0f;
    for (u32 k0 = 0; k0 < n; k0 += 32) {
        const float mine = k0 + lane < n ? v[k0 + lane] : 0.0f;
#pragma unroll
        for (u32 k = 0; k < 32; k++) {
            const float t = __shfl_sync(0xffffffffu, mine, k);
            if (k0 + k < n) total += t;
        }
    }
    return total;
}

// A group's last block: the chunk sums of mix rows first .. first+rows, staged in shared memory
// by all threads at once, then each row's added in order by one thread.
__device__ __forceinline__ void hc_pre_mix_rows(const HcPreArgs& a, u32 first, u32 rows, float* mix) {
    __shared__ float sums[HC_PRE_MAX_PARTIALS];
    const u32 nc = a.n_chunks, base = first * nc;
    for (u32 i = threadIdx.x; i < rows * nc; i += blockDim.x) sums[i] = __ldcg(a.partial + base + i);
    __syncthreads();
    if (threadIdx.x < rows) {
        float total = 0.0f;
#pragma unroll 8
        for (u32 k = 0; k < nc; k++) total += sums[threadIdx.x * nc + k];
        mix[first + threadIdx.x] = total;
        a.mix[first + threadIdx.x] = total;
    }
    __syncthreads();
}

// The first group's tail for the 512-chunk `ch` of `cur`, by one warp, lane l holding values
// ch*512 + 128u + 4l + j (the lanes of the canonical sum of squares): the weighted sum, then,
// once `s2` is known, the norm and its quantizations. Q8_0: a 32-block is 8 lanes; Q8_K: a
// 256-block is u = 2h, 2h+1, the 16-value sums 4 lanes each. Both as quantize_q8_0 and
// quantize_q8_k make them (the maxima are exact in any order).
struct HcPreChunk {
    float v[4][4];
    bool ok[4];
};
__device__ __forceinline__ float hc_pre_cur_chunk(const HcPreArgs& a, const float* pre, u32 ch, u32 lane, HcPreChunk* c) {
    const u32 ne = a.n_embd;
    float4 xs[4][4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
        c->ok[u] = d < ne;
#pragma unroll
        for (u32 h = 0; h < 4; h++) xs[u][h] = c->ok[u] ? *(const float4*)(a.x + h * ne + d) : make_float4(0, 0, 0, 0);
    }
    float sq = 0.0f;
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const float x[4][4] = {{xs[u][0].x, xs[u][1].x, xs[u][2].x, xs[u][3].x},
                               {xs[u][0].y, xs[u][1].y, xs[u][2].y, xs[u][3].y},
                               {xs[u][0].z, xs[u][1].z, xs[u][2].z, xs[u][3].z},
                               {xs[u][0].w, xs[u][1].w, xs[u][2].w, xs[u][3].w}};
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            float acc = 0.0f;
            acc += x[j][0] * pre[0];
            acc += x[j][1] * pre[1];
            acc += x[j][2] * pre[2];
            acc += x[j][3] * pre[3];
            c->v[u][j] = acc;
            if (c->ok[u]) sq += acc * acc;
        }
        if (c->ok[u]) {
            const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
            *(float4*)(a.cur + d) = make_float4(c->v[u][0], c->v[u][1], c->v[u][2], c->v[u][3]);
        }
    }
    return warp_sum(sq);
}

__device__ __forceinline__ void hc_pre_norm_chunk(const HcPreArgs& a, float s2, u32 ch, u32 lane, HcPreChunk* c) {
    float4 w[4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
        w[u] = c->ok[u] ? *(const float4*)(a.norm_w + d) : make_float4(0, 0, 0, 0);
    }
    float o[4][4];
#pragma unroll
    for (u32 u = 0; u < 4; u++) {
        const float wv[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            const float v = c->v[u][j] * s2;
            o[u][j] = v * wv[j];
        }
        const u32 d = ch * DS4_CHUNK + u * 128 + lane * 4;
        if (c->ok[u]) *(float4*)(a.norm + d) = make_float4(o[u][0], o[u][1], o[u][2], o[u][3]);
    }
    if (a.xq) {
#pragma unroll
        for (u32 u = 0; u < 4; u++) {
            float amax = fmaxf(fmaxf(fabsf(o[u][0]), fabsf(o[u][1])), fmaxf(fabsf(o[u][2]), fabsf(o[u][3])));
            for (u32 off = 1; off < 8; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            u32 packed = 0;
#pragma unroll
            for (u32 j = 0; j < 4; j++) packed |= (u32)(u8)(i8)max(-128, min(127, (int)rintf(o[u][j] * id))) << (8 * j);
            const u32 i = ch * DS4_CHUNK + u * 128 + lane * 4;
            if (c->ok[u]) {
                *(u32*)(a.xq + i) = packed;
                if ((lane & 7) == 0) a.xd[i / 32] = d;
            }
        }
    }
    if (a.xk) {
        // Per 256: the value of largest magnitude, lowest index on ties, sets d.
#pragma unroll
        for (u32 h = 0; h < 2; h++) {
            const u32 blk = ch * 2 + h;
            if (!c->ok[2 * h]) break;  // uniform: the plan asks n_embd % 256 == 0
            float am = -1.0f, mv = 0.0f;
            int idx = 0;
#pragma unroll
            for (u32 k = 0; k < 2; k++)
#pragma unroll
                for (u32 j = 0; j < 4; j++)
                    if (fabsf(o[2 * h + k][j]) > am) {
                        am = fabsf(o[2 * h + k][j]);
                        mv = o[2 * h + k][j];
                        idx = (int)(k * 128 + lane * 4 + j);
                    }
            warp_argmax(&am, &idx);
            // The winner's own lane gives its signed value.
            const float winner = __shfl_sync(0xffffffffu, mv, ((u32)idx % 128) / 4);
            const float maxv = am == 0.0f ? 0.0f : winner;
            BlockQ8K* q8 = a.xk + blk;
            const float iscale = maxv == 0.0f ? 0.0f : -127.0f / maxv;
#pragma unroll
            for (u32 k = 0; k < 2; k++) {
                u32 packed = 0;
                int sum = 0;
#pragma unroll
                for (u32 j = 0; j < 4; j++) {
                    const int q = maxv == 0.0f ? 0 : max(-128, min(127, (int)rintf(iscale * o[2 * h + k][j])));
                    packed |= (u32)(u8)(i8)q << (8 * j);
                    sum += q;
                }
                *(u32*)(q8->qs + k * 128 + lane * 4) = packed;
                for (u32 off = 1; off < 4; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if ((lane & 3) == 0) q8->bsums[k * 8 + lane / 4] = (i16)sum;
            }
            if (lane == 0) q8->d = maxv == 0.0f ? 0.0f : 1.0f / iscale;
        }
    }
}

// The first group's tail from the mix rows 0..4 (in shared memory): the pre gates, the weighted
// sum of the streams and the sublayer norm with its quantizations. All threads of the block.
__device__ __forceinline__ void hc_pre_finish(const HcPreArgs& a, const float* mix) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float pre[4];
    if (threadIdx.x < 4) {
        pre[threadIdx.x] = hc_pre_gate(mix[threadIdx.x], a.scale, a.base[threadIdx.x], a.eps_hc);
        a.split[threadIdx.x] = pre[threadIdx.x];
    }
    __syncthreads();
    // Each warp keeps its chunks of `cur` in registers (the plan asks n_embd <= 16 * 512).
    __shared__ float cur_ss[HC_PRE_MAX_EMBD / DS4_CHUNK];
    const u32 ne_chunks = (a.n_embd + DS4_CHUNK - 1) / DS4_CHUNK;
    HcPreChunk cc;
    if (warp < ne_chunks) {
        const float sq = hc_pre_cur_chunk(a, pre, warp, lane, &cc);
        if (lane == 0) cur_ss[warp] = sq;
    }
    __syncthreads();
    if (warp < ne_chunks) {
        float ss2 = 0.0f;
        for (u32 k = 0; k < ne_chunks; k++) ss2 += cur_ss[k];
        const float s2 = 1.0f / sqrtf(ss2 / (float)a.n_embd + a.eps_norm);
        hc_pre_norm_chunk(a, s2, warp, lane, &cc);
    }
}

extern "C" __global__ void __launch_bounds__(HC_PRE_WARPS * 32) hc_pre(DS4_ARGS, HcPreArgs a) {
    DS4_GUARD_EARLY;
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n = a.hc_dim, nc = a.n_chunks;
    const bool group_pre = blockIdx.x < a.blocks_pre;
    const u32 rows = group_pre ? 4 : a.mix_rows - 4;
    const u32 gw = (group_pre ? blockIdx.x : blockIdx.x - a.blocks_pre) * HC_PRE_WARPS + warp;
    const bool live = gw < rows * nc;
    const u32 r = (group_pre ? 0 : 4) + (live ? gw / nc : 0), c = live ? (gw % nc) * DS4_CHUNK : 0;
    F16Chunk chunk;
    if (live) chunk = load_chunk_f16(a.fn_w + (u64)r * n + c, n - c, lane);
    ds4_wait_predecessor();
    float scale;
    if (a.ss) scale = 1.0f / sqrtf(ordered_sum_lanes(a.ss, nc, lane) / (float)n + a.eps_flat);
    else scale = rms_scale_block(a.x, n, a.eps_flat);
    if (live) {
        const float s = warp_sum(chunk_dot_f16_scaled(chunk, a.x + c, scale, n - c, lane));
        if (lane == 0) a.partial[r * nc + c / DS4_CHUNK] = s;
        if (r == 0)
            for (u32 i = lane; i < min((u32)DS4_CHUNK, n - c); i += 32) a.flat[c + i] = a.x[c + i] * scale;
    }
    __threadfence();
    __syncthreads();
    const u32 ticket = a.ticket + (group_pre ? 0 : 1);
    const u32 group_blocks = group_pre ? a.blocks_pre : gridDim.x - a.blocks_pre;
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + ticket, 1u) == group_blocks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    __shared__ float mix[32];
    if (!group_pre) {
        hc_pre_mix_rows(a, 4, rows, mix);
        if (warp == 0) hc_split_warp(mix, a.scale, a.base, a.split, a.iters, a.eps_hc, false);
        if (threadIdx.x == 0) a.tickets[ticket] = 0;
        return;
    }
    hc_pre_mix_rows(a, 0, 4, mix);
    hc_pre_finish(a, mix);
    if (threadIdx.x == 0) a.tickets[ticket] = 0;
}

#if DS4_CHUNK_ROWS
// hc_pre in three launches for a chunk's token rows, the same bits: hc_pre_flat (per token row:
// the streams' RMS scale and `flat`, a warp per 512-chunk as hc_pre's row-0 warps write it),
// hc_pre_mix (the control projection of every token row as a tile product, f16_tile: each weight
// read once per 32 token rows; `flat` is exactly the x * scale hc_pre multiplies the weights by),
// hc_pre_tail (per token row: block 0 the pre gates, weighted sum and norm, block 1 the Sinkhorn
// split, as hc_pre's two last blocks do).
extern "C" __global__ void __launch_bounds__(HC_PRE_WARPS * 32) hc_pre_flat(DS4_ARGS, HcPreArgs a) {
    DS4_GUARD;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n = a.hc_dim, nc = a.n_chunks;
    float scale;
    if (a.ss) scale = 1.0f / sqrtf(ordered_sum_lanes(a.ss, nc, lane) / (float)n + a.eps_flat);
    else scale = rms_scale_block(a.x, n, a.eps_flat);
    const u32 c = (blockIdx.x * HC_PRE_WARPS + warp) * DS4_CHUNK;
    if (c < n)
        for (u32 i = lane; i < min((u32)DS4_CHUNK, n - c); i += 32) a.flat[c + i] = a.x[c + i] * scale;
}

extern "C" __global__ void __launch_bounds__(256, 2) hc_pre_mix(DS4_ARGS, HcPreArgs a) {
    F16Tile j;
    j.w = a.fn_w, j.w2 = nullptr, j.x = a.flat, j.out = a.mix, j.out2 = nullptr, j.partial = a.partial;
    j.tickets = a.tickets, j.x_stride = R.s[4], j.out_stride = R.s[5], j.out2_stride = 0;
    j.partial_stride = R.s[2], j.tickets_stride = R.s[3];
    j.rows = a.mix_rows, j.rows2 = 0, j.in_dim = a.hc_dim, j.ticket = a.ticket;
    f16_tile(P, cond, j);
}

extern "C" __global__ void __launch_bounds__(HC_PRE_WARPS * 32) hc_pre_tail(DS4_ARGS, HcPreArgs a) {
    DS4_GUARD;
    __shared__ float mix[32];
    if (threadIdx.x < a.mix_rows) mix[threadIdx.x] = a.mix[threadIdx.x];
    __syncthreads();
    if (blockIdx.x == 0) hc_pre_finish(a, mix);
    else if (threadIdx.x < 32) hc_split_warp(mix, a.scale, a.base, a.split, a.iters, a.eps_hc, false);
}
#endif

// SwiGlu, Add, and the cache fill.
// With `xq`, one warp per 32 outputs also writes their Q8_0 quantization (n a multiple of 32).
extern "C" __global__ void swiglu(DS4_ARGS, SwiGluArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    const float o = swiglu_clamped(a.gate[i], a.up[i], a.clamp);
    a.out[i] = o;
    if (a.xq) quantize_q8_0_warp(o, a.xq, a.xd, i / 32, threadIdx.x & 31);
}

extern "C" __global__ void add(DS4_ARGS, AddArgs a) {
    DS4_GUARD;
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = a.a[i] + a.b[i];
}

// Fills n 32-bit words with v (cache reset; not part of the token).
extern "C" __global__ void fill(DS4_ARGS, FillArgs a) {
    DS4_GUARD;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.x[i] = a.v;
}

// Synthetic weights drawn in device memory, draw for draw as `synth::tensor_data` draws them on
// the host: a splitmix64 stream keyed by the seed and the tensor name, whose k-th draw is
// mix(state + (k+1)·golden). Not part of a token: run once per weight at load.
// kind 0: random values / raw blocks of `ty`; 1: F32 center + uniform·spread; 2: I32 hash rows.
// `n` counts elements (F16, F32), blocks (Q8_0, IQ2_XXS, Q2_K, Q4_K) or token rows (hash).
__device__ __forceinline__ u64 sm_draw(u64 state, u64 k) {
    u64 z = state + (k + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float sm_uniform(u64 z) { return (float)(z >> 40) / 8388608.0f - 1.0f; }

// Writes the 8 bytes of draw k at p, little-endian, as the host's to_le_bytes.
__device__ __forceinline__ void put_draw(u8* p, u64 z, u32 n_bytes) {
    for (u32 i = 0; i < n_bytes; i++) p[i] = (u8)(z >> (8 * i));
}

// Stores block i of n, drawn whole in `blk` in GGUF's layout, where the kernels read it: in
// GGUF's layout, or split (ds4_block_split: all quants, then the rest of each block).
__device__ void put_block(u8* out, u64 i, u64 n, u32 ty, const u8* blk, u32 repack) {
    u32 bb = 0, at = 0, nq = 0;
    ds4_block_split(ty, &bb, &at, &nq);
    if (!repack) {
        for (u32 j = 0; j < bb; j++) out[i * bb + j] = blk[j];
        return;
    }
    u8* q = out + i * nq;
    u8* r = out + n * nq + i * (bb - nq);
    for (u32 j = 0; j < nq; j++) q[j] = blk[at + j];
    for (u32 j = 0; j < at; j++) r[j] = blk[j];
    for (u32 j = at + nq; j < bb; j++) r[j - nq] = blk[j];
}

extern "C" __global__ void synth_fill(DS4_ARGS, SynthFillArgs a) {
    DS4_GUARD;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
        u8 b[144];
        if (a.kind == 2) {
            const u32 start = (u32)(sm_draw(a.state, i) % a.n_expert);
            for (u32 k = 0; k < a.n_used; k++) ((int*)a.out)[i * a.n_used + k] = (int)((start + k) % a.n_expert);
        } else if (a.kind == 1) {
            ((float*)a.out)[i] = a.center + sm_uniform(sm_draw(a.state, i)) * a.spread;
        } else if (a.ty == 0) {  // F32
            ((float*)a.out)[i] = sm_uniform(sm_draw(a.state, i)) * a.a;
        } else if (a.ty == 1) {  // F16
            ((u16*)a.out)[i] = f2h(sm_uniform(sm_draw(a.state, i)) * a.a);
        } else if (a.ty == 8) {  // Q8_0: scale, 32 quants
            *(u16*)b = (u16)a.d;
            for (u32 j = 0; j < 32; j++) b[2 + j] = (u8)(signed char)roundf(sm_uniform(sm_draw(a.state, i * 32 + j)) * 127.0f);
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        } else if (a.ty == 16) {  // IQ2_XXS: d, 64 random bytes (8 draws and an unused tail draw)
            *(u16*)b = (u16)a.d;
            for (u32 w = 0; w < 8; w++) put_draw(b + 2 + 8 * w, sm_draw(a.state, i * 9 + w), 8);
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        } else if (a.ty == 10) {  // Q2_K: 80 random bytes (10 draws and a tail), d, dmin
            for (u32 w = 0; w < 10; w++) put_draw(b + 8 * w, sm_draw(a.state, i * 11 + w), 8);
            *(u16*)(b + 80) = (u16)a.d;
            *(u16*)(b + 82) = (u16)a.dmin;
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        } else if (a.ty == 12) {  // Q4_K: d, dmin, 140 random bytes (17 draws and 4 of the tail)
            *(u16*)b = (u16)a.d;
            *(u16*)(b + 2) = (u16)a.dmin;
            for (u32 w = 0; w < 17; w++) put_draw(b + 4 + 8 * w, sm_draw(a.state, i * 18 + w), 8);
            put_draw(b + 4 + 136, sm_draw(a.state, i * 18 + 17), 4);
            put_block(a.out, i, a.n, a.ty, b, a.repack);
        }
    }
}

// Token sampling on the device: the definition is in src/sample.rs (module docs), and this kernel
// picks the same token bit for bit, so only the 4-byte id goes back to the host. One block (any
// multiple of 32 threads up to 1024; the host launches 1024) over the whole vocabulary, launched
// after the token, not part of it.
//
// Greedy: a block argmax, one pass over the logits. Otherwise five passes: a radix select (four,
// 8 bits each) finds the K-th largest order key among the finite logits, then the candidates
// above it plus the lowest ids equal to it are gathered; they are sorted in shared memory by
// (logit descending, id ascending), weighted with ds4_expf in parallel, and the sequential parts
// (the sum and prefix sums, the draw) run on one thread in the host's order. The logits were just
// written by the token, so the passes read them from L2.
// The most candidates: sample::CANDIDATE_CAP (tests/cuda.rs checks that they agree).
#define DS4_SAMPLE_CAP 1024

// A float's position in f32::total_cmp order, as an unsigned key: negative values with every
// bit flipped, the others with the sign bit set.
__device__ __forceinline__ u32 sample_order_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ bool sample_is_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// Each thread takes 8 consecutive logits of a tile (two 16-byte loads, so that enough bytes are
// in flight for one block to stream the vocabulary): ids first .. first + 7. Past the end: NaN,
// which is never a candidate and never the argmax.
#define SAMPLE_PER_THREAD 8
__device__ __forceinline__ void sample_load(const float* logits, u32 n, u32 first, float* v) {
    if (first + SAMPLE_PER_THREAD <= n && ((u64)logits & 15) == 0) {
        const float4 x = *(const float4*)(logits + first), y = *(const float4*)(logits + first + 4);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
        v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    } else {
        for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) v[j] = first + j < n ? logits[first + j] : __int_as_float(0x7fc00000);
    }
}

// Block-wide exclusive prefix sum of `v` in thread order; every thread gets the total too.
// `part` holds one word per warp. Every thread of the block must call it.
__device__ u32 sample_block_scan(u32 v, u32* part, u32* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 x = v;
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // an earlier call may still be reading `part`
    if (lane == 31) part[warp] = x;
    __syncthreads();
    u32 before = 0, all = 0;
    for (u32 w = 0; w < nw; w++) {
        if (w < warp) before += part[w];
        all += part[w];
    }
    *total = all;
    return before + x - v;
}

// Block-wide minimum; every thread gets it. Every thread of the block must call it.
__device__ u32 sample_block_min(u32 v, u32* part) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 m = part[0];
    for (u32 w = 1; w < (blockDim.x >> 5); w++) m = min(m, part[w]);
    return m;
}

// 32 to 40 registers a thread (ptxas for sm_89, sm_90, sm_121): a block of 1024 fits.
extern "C" __global__ void sample_token(DS4_ARGS, SampleTokenArgs a) {
    DS4_GUARD;
    const float* logits = a.logits;
    const u32 n = a.n, t = threadIdx.x, nt = blockDim.x, lane = t & 31, warp = t >> 5, nw = nt >> 5;
    const u32 tile = nt * SAMPLE_PER_THREAD;
    __shared__ u32 part[32];
    __shared__ u32 hist[256];
    __shared__ u32 s_k, s_digit, s_above, s_count, s_slot;
    // Candidates as (order key << 32) | ~id: descending order is (logit desc, id asc).
    __shared__ u64 cand[DS4_SAMPLE_CAP];
    __shared__ float prob[DS4_SAMPLE_CAP];
    __shared__ float prefix[DS4_SAMPLE_CAP];

    const bool greedy = !(a.temperature > 0.0f);
    // K, the K-th largest order key among the finite logits (the threshold), how many keys
    // equal to it are candidates, and how many there are.
    u32 k = 0, threshold = 0, need_eq = 0, n_eq = 0;
    if (!greedy) {
        // Radix select, 8 bits at a time from the top. `threshold`/`mask` hold the digits found
        // so far; `remaining` counts the candidates still to take among the keys matching them.
        u32 mask = 0, remaining = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (u32 i = t; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            // Whole warps step together, so lanes with the same digit add with one atomic.
            for (u32 base = 0; base < n; base += tile) {
                float v[SAMPLE_PER_THREAD];
                sample_load(logits, n, base + t * SAMPLE_PER_THREAD, v);
#pragma unroll
                for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                    const u32 key = sample_order_key(v[j]);
                    const u32 digit =
                        sample_is_finite(v[j]) && (key & mask) == threshold ? (key >> shift) & 255 : 256;
                    const u32 peers = __match_any_sync(0xffffffffu, digit);
                    if (digit < 256 && lane == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[digit], (u32)__popc(peers));
                }
            }
            __syncthreads();
            if (t == 0) {
                if (shift == 24) {
                    // The first pass counts every finite logit, so K is known now.
                    u32 finite = 0;
                    for (u32 d = 0; d < 256; d++) finite += hist[d];
                    s_k = min(min(a.top_k, (u32)DS4_SAMPLE_CAP), finite);
                }
                // The digit at which the count from the top reaches the candidates wanted.
                const u32 want = shift == 24 ? s_k : remaining;
                u32 above = 0, d = 255;
                while (d > 0 && above + hist[d] < want) {
                    above += hist[d];
                    d--;
                }
                s_digit = d;
                s_above = above;
                s_count = hist[d];
            }
            __syncthreads();
            if (shift == 24) {
                k = s_k;
                remaining = k;
            }
            threshold |= s_digit << shift;
            mask |= 255u << shift;
            remaining -= s_above;
            n_eq = s_count;  // after the last pass: the keys equal to the threshold
            __syncthreads();  // the shared values and hist are rewritten by the next pass
        }
        need_eq = remaining;
    }

    if (greedy || k == 0) {
        // The argmax (also when no logit is finite): largest by '>', lowest id on ties, 0 when
        // nothing is above -inf.
        float v = __int_as_float(0xff800000);
        int idx = 0;
        for (u32 base = 0; base < n; base += tile) {
            const u32 first = base + t * SAMPLE_PER_THREAD;
            float x[SAMPLE_PER_THREAD];
            sample_load(logits, n, first, x);
#pragma unroll
            for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                if (x[j] > v) {
                    v = x[j];
                    idx = (int)(first + j);
                }
            }
        }
        warp_argmax(&v, &idx);
        __shared__ float best_v[32];
        __shared__ int best_i[32];
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = idx;
        }
        __syncthreads();
        if (t == 0) {
            float bv = best_v[0];
            int bi = best_i[0];
            for (u32 w = 1; w < nw; w++) {
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) {
                    bv = best_v[w];
                    bi = best_i[w];
                }
            }
            *a.out = (u32)bi;
        }
        return;
    }

    // Gather the K candidates: every key above the threshold and the `need_eq` lowest ids equal
    // to it. Slots are taken in any order; the sort below makes the result unique.
    __syncthreads();
    if (t == 0) s_slot = 0;
    __syncthreads();
    u32 eq_before = 0;  // keys equal to the threshold in earlier tiles
    for (u32 base = 0; base < n; base += tile) {
        const u32 first = base + t * SAMPLE_PER_THREAD;
        float v[SAMPLE_PER_THREAD];
        sample_load(logits, n, first, v);
        // This thread's keys equal to the threshold come after `rank` others in id order.
        u32 rank = 0, mine = 0;
        if (n_eq != need_eq) {
            // Only some of the equal keys are kept: rank them (all kept is the common case).
#pragma unroll
            for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
                mine += sample_is_finite(v[j]) && sample_order_key(v[j]) == threshold;
            }
            u32 tile_eq;
            rank = eq_before + sample_block_scan(mine, part, &tile_eq);
            eq_before += tile_eq;
        }
#pragma unroll
        for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
            const u32 key = sample_order_key(v[j]);
            if (!sample_is_finite(v[j]) || key < threshold) continue;
            if (key == threshold && n_eq != need_eq && rank++ >= need_eq) continue;
            cand[atomicAdd(&s_slot, 1u)] = ((u64)key << 32) | (u64)(~(first + j));
        }
    }
    __syncthreads();

    // Bitonic sort, descending, over the next power of two >= K; the padding (0) sorts last.
    u32 width = 1;
    while (width < k) width <<= 1;
    for (u32 i = k + t; i < width; i += nt) cand[i] = 0;
    __syncthreads();
    for (u32 size = 2; size <= width; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 i = t; i < width; i += nt) {
                const u32 j = i ^ stride;
                if (j > i) {
                    const u64 x = cand[i], y = cand[j];
                    const bool descending = (i & size) == 0;
                    if (descending ? x < y : x > y) {
                        cand[i] = y;
                        cand[j] = x;
                    }
                }
            }
            __syncthreads();
        }
    }

    // Weights, each on its own thread (the same ops as the host, so the same bits).
    const float max = logits[~(u32)cand[0]];
    for (u32 c = t; c < k; c += nt) prob[c] = ds4_expf((logits[~(u32)cand[c]] - max) / a.temperature);
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (u32 c = 0; c < k; c++) {
            s += prob[c];
            prefix[c] = s;
        }
    }
    __syncthreads();
    // The cut: kept = min(first c > 0 under min-p, first c whose prefix reaches top-p, plus 1).
    const float sum = prefix[k - 1];
    const float min_prob = prob[0] / sum * a.min_p;
    u32 cut = k;
    for (u32 c = t; c < k; c += nt) {
        if (c > 0 && prob[c] / sum < min_prob) cut = min(cut, c);
        if (prefix[c] / sum >= a.top_p) cut = min(cut, c + 1);
    }
    const u32 kept = sample_block_min(cut, part);
    if (t == 0) {
        float r = a.r * prefix[kept - 1];
        u32 pick = kept - 1;
        for (u32 c = 0; c < kept; c++) {
            r -= prob[c];
            if (r <= 0.0f) {
                pick = c;
                break;
            }
        }
        *a.out = ~(u32)cand[pick];
    }
}
