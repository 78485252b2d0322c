//! Deterministic random-weight GGUFs of the DS4 architecture, for tests, benchmarks and the
//! embedded default model. Weights are random raw blocks with scales chosen so that every
//! projection keeps activations near unit size.

use crate::gguf::{self, Value, Writer};
use crate::quant::{self, GgmlType};

/// A named model shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub n_out_group: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_hash_layer: usize,
    pub n_swa: usize,
    pub n_indexer_head: usize,
    pub indexer_top_k: usize,
    pub compress_ratios: Vec<u32>,
    /// (gate/up, down) routed-expert types.
    pub expert_types: (GgmlType, GgmlType),
}

impl Preset {
    /// The shape of the golden `tiny-a` model.
    pub fn tiny() -> Preset {
        Preset {
            name: "tiny",
            n_layer: 6,
            n_embd: 256,
            n_vocab: 512,
            n_head: 8,
            head_dim: 256,
            n_rot: 64,
            q_lora_rank: 128,
            o_lora_rank: 64,
            n_out_group: 8,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 256,
            n_hash_layer: 3,
            n_swa: 16,
            n_indexer_head: 16,
            indexer_top_k: 4,
            compress_ratios: vec![0, 0, 4, 8, 4, 8],
            expert_types: (GgmlType::IQ2_XXS, GgmlType::Q2_K),
        }
    }

    /// A few layers at width 1024 with 16 experts: big enough to time, small enough for CI.
    pub fn small() -> Preset {
        Preset {
            name: "small",
            n_layer: 4,
            n_embd: 1024,
            n_vocab: 8192,
            n_head: 16,
            head_dim: 256,
            n_rot: 64,
            q_lora_rank: 256,
            o_lora_rank: 128,
            n_out_group: 8,
            n_expert: 16,
            n_expert_used: 4,
            n_ff_exp: 512,
            n_hash_layer: 1,
            n_swa: 64,
            n_indexer_head: 16,
            indexer_top_k: 16,
            compress_ratios: vec![0, 4, 16, 4],
            expert_types: (GgmlType::IQ2_XXS, GgmlType::Q2_K),
        }
    }

    /// The real DeepSeek V4 Flash shape (ds4's constants). Its weights are tens of gigabytes, so
    /// it is used for metadata and shape checks, not written by `ds4 synth`.
    pub fn flash() -> Preset {
        Preset {
            name: "flash",
            n_layer: 43,
            n_embd: 4096,
            n_vocab: 129280,
            n_head: 64,
            head_dim: 512,
            n_rot: 64,
            q_lora_rank: 1024,
            o_lora_rank: 1024,
            n_out_group: 8,
            n_expert: 256,
            n_expert_used: 6,
            n_ff_exp: 2048,
            n_hash_layer: 3,
            n_swa: 128,
            n_indexer_head: 64,
            indexer_top_k: 512,
            // ds4: layers 0-1 dense, then alternating ratio 4 (even) and ratio 128 (odd).
            compress_ratios: (0..43)
                .map(|il| {
                    if il < 2 {
                        0
                    } else if il % 2 == 0 {
                        4
                    } else {
                        128
                    }
                })
                .collect(),
            expert_types: (GgmlType::IQ2_XXS, GgmlType::Q2_K),
        }
    }

    /// The real Flash layer shape, first 4 layers only (dense, dense, ratio 4, ratio 128): about
    /// 9 GB, for timing one real layer of each kind without a model file.
    pub fn flash_4l() -> Preset {
        let mut p = Self::flash();
        p.name = "flash-4l";
        p.n_layer = 4;
        p.compress_ratios.truncate(4);
        p
    }

    pub fn by_name(name: &str) -> Option<Preset> {
        match name {
            "tiny" => Some(Self::tiny()),
            "small" => Some(Self::small()),
            "flash-4l" => Some(Self::flash_4l()),
            "flash" => Some(Self::flash()),
            _ => None,
        }
    }
}

/// splitmix64: a small, well-mixed deterministic generator.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, name: &str) -> Rng {
        // FNV-1a of the tensor name, so each tensor's values do not depend on writing order.
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x1000_0000_01b3));
        Rng(seed ^ h)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Appends `n` random bytes, eight per draw.
    fn bytes(&mut self, out: &mut Vec<u8>, n: usize) {
        for _ in 0..n / 8 {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        let tail = self.next().to_le_bytes();
        out.extend_from_slice(&tail[..n % 8]);
    }
}

/// Random tensor data of `ty` with element scale about `std`; the half-width and block scales
/// come from [`random_constants`], which the GPU generator uses too.
fn random_data(rng: &mut Rng, ty: GgmlType, elements: usize, std: f32) -> Vec<u8> {
    let (a, d, dmin) = random_constants(ty, std);
    let (d, dmin) = (d.to_le_bytes(), dmin.to_le_bytes());
    let blocks = elements / ty.block_elems();
    let mut out = Vec::with_capacity(blocks * ty.block_bytes());
    match ty {
        GgmlType::F32 => (0..elements).for_each(|_| out.extend_from_slice(&(rng.uniform() * a).to_le_bytes())),
        GgmlType::F16 => {
            (0..elements).for_each(|_| out.extend_from_slice(&quant::f32_to_f16(rng.uniform() * a).to_le_bytes()))
        }
        GgmlType::Q8_0 => {
            for _ in 0..blocks {
                out.extend_from_slice(&d);
                (0..32).for_each(|_| out.push((rng.uniform() * 127.0).round() as i8 as u8));
            }
        }
        GgmlType::IQ2_XXS => {
            for _ in 0..blocks {
                out.extend_from_slice(&d);
                rng.bytes(&mut out, 64);
            }
        }
        GgmlType::Q2_K => {
            for _ in 0..blocks {
                rng.bytes(&mut out, 80);
                out.extend_from_slice(&d);
                out.extend_from_slice(&dmin);
            }
        }
        GgmlType::Q4_K => {
            for _ in 0..blocks {
                out.extend_from_slice(&d);
                out.extend_from_slice(&dmin);
                rng.bytes(&mut out, 140);
            }
        }
        other => unreachable!("synth does not write {other:?}"),
    }
    out
}

/// How a tensor's values are drawn. Every draw comes from a splitmix64 stream keyed by the seed
/// and the tensor's name, so a tensor can be generated alone, on the host or on a GPU
/// (`kernels/synth.cu` follows [`tensor_data`] draw for draw).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    /// Random values (or raw blocks) with element scale about `std`.
    Random { std: f32 },
    /// F32: `center + uniform * spread`.
    Around { center: f32, spread: f32 },
    /// I32 `[n_used, n_vocab]`: each token's row names `n_used` consecutive experts from a random start.
    Hash { n_expert: u32 },
}

/// One tensor of a preset: name, type, dims and how its values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub fill: Fill,
}

/// A model whose tensors are drawn by [`Fill`]s: what a backend needs to generate the weights
/// itself instead of copying them (`--preset flash` exists only in device memory).
#[derive(Debug, Clone, PartialEq)]
pub struct Synthetic {
    pub seed: u64,
    pub fills: std::collections::HashMap<String, Fill>,
}

impl Synthetic {
    /// The generator's start state for `name` (see [`Fill`]).
    pub fn rng_state(&self, name: &str) -> u64 {
        Rng::new(self.seed, name).0
    }
}

/// The constants of the [`Fill::Random`] draws for `ty`: the uniform's half-width `a` and the f16
/// block scales (d, dmin), as [`tensor_data`] computes them.
pub fn random_constants(ty: GgmlType, std: f32) -> (f32, u16, u16) {
    let h = |x: f32| quant::f32_to_f16(x);
    match ty {
        // q uniform in [-127, 127] has std ~73.
        GgmlType::Q8_0 => (0.0, h(std / 73.0), 0),
        // |w| = d * (2s+1)/8 * grid, grid in {8, 25, 43}, s uniform in 0..16: about 50 d.
        GgmlType::IQ2_XXS => (0.0, h(std / 50.0), 0),
        // w = d * sc * q - dmin * m with sc, m < 16 and q < 4: about 6 d around its mean.
        GgmlType::Q2_K => (0.0, h(std / 6.0), h(std / 12.0)),
        // w = d * sc * q - dmin * m with 6-bit sc, m and 4-bit q: about 80 d around its mean.
        GgmlType::Q4_K => (0.0, h(std / 80.0), h(std / 160.0)),
        // Uniform in [-a, a) has standard deviation a / sqrt(3).
        _ => (std * 3f32.sqrt(), 0, 0),
    }
}

/// A tensor's bytes, drawn on the host.
pub fn tensor_data(spec: &Spec, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed, &spec.name);
    let n: usize = spec.dims.iter().product::<u64>() as usize;
    match spec.fill {
        Fill::Random { std } => random_data(&mut rng, spec.ty, n, std),
        Fill::Around { center, spread } => {
            (0..n).flat_map(|_| (center + rng.uniform() * spread).to_le_bytes()).collect()
        }
        Fill::Hash { n_expert } => {
            let (n_used, n_vocab) = (spec.dims[0] as usize, spec.dims[1] as usize);
            let mut data = Vec::with_capacity(n_vocab * n_used * 4);
            for _ in 0..n_vocab {
                let start = (rng.next() % n_expert as u64) as usize;
                for k in 0..n_used {
                    data.extend_from_slice(&(((start + k) % n_expert as usize) as i32).to_le_bytes());
                }
            }
            data
        }
    }
}

#[derive(Default)]
struct Builder {
    specs: Vec<Spec>,
}

impl Builder {
    fn add(&mut self, name: &str, ty: GgmlType, dims: &[usize], fill: Fill) {
        let dims = dims.iter().map(|&d| d as u64).collect();
        self.specs.push(Spec { name: name.to_string(), ty, dims, fill });
    }
    fn random(&mut self, name: &str, ty: GgmlType, dims: &[usize], std: f32) {
        self.add(name, ty, dims, Fill::Random { std });
    }
    /// An F32 vector around `center`.
    fn around(&mut self, name: &str, n: usize, center: f32, spread: f32) {
        self.add(name, GgmlType::F32, &[n], Fill::Around { center, spread });
    }
    /// A matrix `[in, out]` that maps unit-size inputs to unit-size outputs.
    fn matrix(&mut self, name: &str, ty: GgmlType, n_in: usize, n_out: usize) {
        self.random(name, ty, &[n_in, n_out], 1.0 / (n_in as f32).sqrt());
    }
}

/// The preset's `deepseek4.*` metadata and a stand-in tokenizer, with no tensors.
pub fn metadata(p: &Preset) -> Writer {
    let mut w = Writer::new();
    let u = |v: usize| Value::U32(v as u32);
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("deepseek4".into())),
        ("general.name", Value::String(format!("ds4-synth-{}", p.name))),
        ("deepseek4.block_count", u(p.n_layer)),
        ("deepseek4.embedding_length", u(p.n_embd)),
        ("deepseek4.vocab_size", u(p.n_vocab)),
        ("deepseek4.context_length", u(1 << 20)),
        ("deepseek4.attention.head_count", u(p.n_head)),
        ("deepseek4.attention.head_count_kv", u(1)),
        ("deepseek4.attention.key_length", u(p.head_dim)),
        ("deepseek4.attention.value_length", u(p.head_dim)),
        ("deepseek4.rope.dimension_count", u(p.n_rot)),
        ("deepseek4.attention.q_lora_rank", u(p.q_lora_rank)),
        ("deepseek4.attention.output_lora_rank", u(p.o_lora_rank)),
        ("deepseek4.attention.output_group_count", u(p.n_out_group)),
        ("deepseek4.expert_count", u(p.n_expert)),
        ("deepseek4.expert_used_count", u(p.n_expert_used)),
        ("deepseek4.expert_feed_forward_length", u(p.n_ff_exp)),
        ("deepseek4.expert_shared_count", u(1)),
        ("deepseek4.hash_layer_count", u(p.n_hash_layer)),
        ("deepseek4.attention.sliding_window", u(p.n_swa)),
        ("deepseek4.attention.indexer.head_count", u(p.n_indexer_head)),
        ("deepseek4.attention.indexer.key_length", u(128)),
        ("deepseek4.attention.indexer.top_k", u(p.indexer_top_k)),
        ("deepseek4.hyper_connection.count", u(4)),
        ("deepseek4.hyper_connection.sinkhorn_iterations", u(20)),
        ("deepseek4.attention.compress_ratios", gguf::u32_array(&p.compress_ratios)),
        ("deepseek4.swiglu_clamp_exp", gguf::f32_array(&vec![10.0; p.n_layer])),
        ("deepseek4.rope.scaling.original_context_length", u(65536)),
        ("deepseek4.rope.freq_base", Value::F32(10000.0)),
        ("deepseek4.rope.scaling.factor", Value::F32(16.0)),
        ("deepseek4.rope.scaling.yarn_beta_fast", Value::F32(32.0)),
        ("deepseek4.rope.scaling.yarn_beta_slow", Value::F32(1.0)),
        ("deepseek4.attention.compress_rope_freq_base", Value::F32(160000.0)),
        ("deepseek4.expert_weights_scale", Value::F32(1.5)),
        ("deepseek4.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("deepseek4.hyper_connection.epsilon", Value::F32(1e-6)),
        ("deepseek4.expert_weights_norm", Value::Bool(true)),
    ];
    for (k, v) in meta {
        w.set(k, v);
    }
    let (tokens, merges) = crate::tokenizer::standin_vocab(p.n_vocab).expect("presets have at least 263 tokens");
    w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.set("tokenizer.ggml.tokens", gguf::string_array(&tokens));
    w.set("tokenizer.ggml.merges", gguf::string_array(&merges));
    w
}

/// The tensors of a preset, in file order.
pub fn specs(p: &Preset) -> Vec<Spec> {
    let mut b = Builder::default();

    let (e, hc, mix) = (p.n_embd, 4 * p.n_embd, 8 + 16);
    let q_dim = p.n_head * p.head_dim;
    let group_dim = p.head_dim * (p.n_head / p.n_out_group);
    let low = p.o_lora_rank * p.n_out_group;
    b.random("token_embd.weight", GgmlType::F16, &[e, p.n_vocab], 1.0);
    b.around("output_hc_base.weight", 4, 0.0, 0.5);
    b.matrix("output_hc_fn.weight", GgmlType::F16, hc, 4);
    b.around("output_hc_scale.weight", 1, 0.5, 0.2);
    b.around("output_norm.weight", e, 1.0, 0.1);
    b.matrix("output.weight", GgmlType::Q8_0, e, p.n_vocab);
    for il in 0..p.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}");
        let ratio = p.compress_ratios[il] as usize;
        for half in ["attn", "ffn"] {
            b.matrix(&n(&format!("hc_{half}_fn.weight")), GgmlType::F16, hc, mix);
            b.around(&n(&format!("hc_{half}_scale.weight")), 3, 0.5, 0.2);
            b.around(&n(&format!("hc_{half}_base.weight")), mix, 0.0, 0.5);
            b.around(&n(&format!("{half}_norm.weight")), e, 1.0, 0.1);
        }
        b.matrix(&n("attn_q_a.weight"), GgmlType::Q8_0, e, p.q_lora_rank);
        b.around(&n("attn_q_a_norm.weight"), p.q_lora_rank, 1.0, 0.1);
        b.matrix(&n("attn_q_b.weight"), GgmlType::Q8_0, p.q_lora_rank, q_dim);
        b.matrix(&n("attn_kv.weight"), GgmlType::Q8_0, e, p.head_dim);
        b.around(&n("attn_kv_a_norm.weight"), p.head_dim, 1.0, 0.1);
        b.around(&n("attn_sinks.weight"), p.n_head, 0.0, 1.0);
        b.matrix(&n("attn_output_a.weight"), GgmlType::Q8_0, group_dim, low);
        b.matrix(&n("attn_output_b.weight"), GgmlType::Q8_0, low, e);
        if ratio != 0 {
            let width = if ratio == 4 { 2 * p.head_dim } else { p.head_dim };
            b.random(&n("attn_compressor_ape.weight"), GgmlType::F16, &[width, ratio], 0.3);
            b.matrix(&n("attn_compressor_kv.weight"), GgmlType::F16, e, width);
            b.matrix(&n("attn_compressor_gate.weight"), GgmlType::F16, e, width);
            b.around(&n("attn_compressor_norm.weight"), p.head_dim, 1.0, 0.1);
        }
        if ratio == 4 {
            b.matrix(&n("indexer.attn_q_b.weight"), GgmlType::F16, p.q_lora_rank, p.n_indexer_head * 128);
            b.matrix(&n("indexer.proj.weight"), GgmlType::F16, e, p.n_indexer_head);
            b.random(&n("indexer_compressor_ape.weight"), GgmlType::F16, &[256, 4], 0.3);
            b.matrix(&n("indexer_compressor_kv.weight"), GgmlType::F16, e, 256);
            b.matrix(&n("indexer_compressor_gate.weight"), GgmlType::F16, e, 256);
            b.around(&n("indexer_compressor_norm.weight"), 128, 1.0, 0.1);
        }
        b.matrix(&n("ffn_gate_inp.weight"), GgmlType::F16, e, p.n_expert);
        let (gu, down) = p.expert_types;
        b.random(&n("ffn_gate_exps.weight"), gu, &[e, p.n_ff_exp, p.n_expert], 1.0 / (e as f32).sqrt());
        b.random(&n("ffn_up_exps.weight"), gu, &[e, p.n_ff_exp, p.n_expert], 1.0 / (e as f32).sqrt());
        b.random(&n("ffn_down_exps.weight"), down, &[p.n_ff_exp, e, p.n_expert], 1.0 / (p.n_ff_exp as f32).sqrt());
        b.matrix(&n("ffn_gate_shexp.weight"), GgmlType::Q8_0, e, p.n_ff_exp);
        b.matrix(&n("ffn_up_shexp.weight"), GgmlType::Q8_0, e, p.n_ff_exp);
        b.matrix(&n("ffn_down_shexp.weight"), GgmlType::Q8_0, p.n_ff_exp, e);
        if il < p.n_hash_layer {
            let dims = [p.n_expert_used, p.n_vocab];
            b.add(&n("ffn_gate_tid2eid.weight"), GgmlType::I32, &dims, Fill::Hash { n_expert: p.n_expert as u32 });
        } else {
            b.around(&n("exp_probs_b.bias"), p.n_expert, 0.0, 0.1);
        }
    }
    b.specs
}

/// A preset as a GGUF image, every tensor drawn on the host.
pub fn build(p: &Preset, seed: u64) -> Vec<u8> {
    let mut w = metadata(p);
    let specs = specs(p);
    for spec in &specs {
        w.tensor(spec.name.clone(), spec.ty, &spec.dims, Vec::new());
    }
    // Each tensor is drawn from its own stream, so the order they are drawn in does not matter.
    w.to_bytes_parallel(|i| tensor_data(&specs[i], seed)).expect("a preset's tensors have their types' sizes")
}

/// Writes a preset as a GGUF file to `out`, one tensor at a time (the 43-layer Flash shape
/// does not fit in memory): the same bytes as [`build`]. Returns the file's length.
pub fn write(p: &Preset, seed: u64, out: &mut impl std::io::Write) -> std::io::Result<u64> {
    let mut w = metadata(p);
    let specs = specs(p);
    for spec in &specs {
        w.tensor(spec.name.clone(), spec.ty, &spec.dims, Vec::new());
    }
    w.write_streamed(out, |i| tensor_data(&specs[i], seed))
}

/// The recipe of a preset's tensors, for a backend that generates them itself.
pub fn synthetic(p: &Preset, seed: u64) -> Synthetic {
    Synthetic { seed, fills: specs(p).into_iter().map(|s| (s.name, s.fill)).collect() }
}

/// A preset's model with no tensor data on the host: the GGUF header only, and the recipe that
/// lets a GPU backend draw every weight in its own memory (the 43-layer Flash shape is about
/// 80 GB). Backends that need the bytes on the host refuse it.
pub fn device_model(p: &Preset, seed: u64) -> Result<std::sync::Arc<crate::model::Model>, crate::model::ModelError> {
    let mut w = metadata(p);
    let specs = specs(p);
    for spec in &specs {
        w.tensor(spec.name.clone(), spec.ty, &spec.dims, Vec::new());
    }
    let (header, total) = w.to_header_only();
    let file = gguf::File::from_header(format!("synthetic {} model (device memory only)", p.name), header, total)?;
    crate::model::Model::from_file_synthetic(file, Some(synthetic(p, seed)))
}
