//! The model shape, read from `deepseek4.*` metadata and validated against what the kernels need.

use crate::gguf::{File, Value};

const ARCH: &str = "deepseek4";

/// One layer's attention kind, from `deepseek4.attention.compress_ratios`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Ratio 0: raw sliding window only.
    Window,
    /// Ratio 4: two overlapping compressor lanes plus the indexer's top-k selection.
    Ratio4Indexed,
    /// Any other ratio: one compressor lane, every compressed row visible.
    Ratio(u32),
}

impl AttentionKind {
    pub fn from_ratio(r: u32) -> Self {
        match r {
            0 => AttentionKind::Window,
            4 => AttentionKind::Ratio4Indexed,
            r => AttentionKind::Ratio(r),
        }
    }
    pub fn ratio(self) -> u32 {
        match self {
            AttentionKind::Window => 0,
            AttentionKind::Ratio4Indexed => 4,
            AttentionKind::Ratio(r) => r,
        }
    }
    pub fn describe(self) -> String {
        match self {
            AttentionKind::Window => "sliding window only".into(),
            AttentionKind::Ratio4Indexed => "ratio 4 with indexer".into(),
            AttentionKind::Ratio(r) => format!("ratio {r}"),
        }
    }
}

/// RoPE parameters of one layer, as ds4 derives them (dense vs compressed layers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub freq_base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub n_ctx_orig: u64,
}

impl RopeParams {
    /// The rotation of each pair `(x[2k], x[2k+1])` of an `n_rot`-wide tail at `pos`, as
    /// `(cos θ·m, sin θ·m)` computed the way ds4 does (θ advanced by repeated multiplication).
    /// The CPU backend rotates with these values and the CUDA backend tabulates them, so both
    /// rotate by the very same numbers.
    pub fn cos_sin(&self, pos: u32, n_rot: usize, out: &mut [(f32, f32)]) {
        let theta_scale = self.freq_base.powf(-2.0 / n_rot as f32);
        let mut corr = [0.0f32; 2];
        if self.ext_factor != 0.0 {
            let corr_dim = |beta: f32| {
                n_rot as f32 * (self.n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                    / (2.0 * self.freq_base.ln())
            };
            corr[0] = corr_dim(self.beta_fast).floor().max(0.0);
            corr[1] = corr_dim(self.beta_slow).ceil().min(n_rot as f32 - 1.0);
        }
        let mut theta_extrap = pos as f32;
        for (k, cs) in out.iter_mut().take(n_rot / 2).enumerate() {
            let theta_interp = self.freq_scale * theta_extrap;
            let mut theta = theta_interp;
            let mut mscale = self.attn_factor;
            if self.ext_factor != 0.0 {
                let y = (k as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
                let ramp = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
                theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp;
                mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
            }
            *cs = (theta.cos() * mscale, theta.sin() * mscale);
            theta_extrap *= theta_scale;
        }
    }
}

/// The shape and constants of a DeepSeek V4 Flash-architecture model.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub name: String,
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
    pub indexer_head_dim: usize,
    pub indexer_top_k: usize,
    pub n_hc: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_eps: f32,
    pub compress_ratios: Vec<u32>,
    pub swiglu_clamp: Vec<f32>,
    pub rope_freq_base: f32,
    pub compress_rope_freq_base: f32,
    pub rope_scale_factor: f32,
    pub yarn_beta_fast: f32,
    pub yarn_beta_slow: f32,
    pub rope_orig_ctx: u64,
    pub expert_weight_scale: f32,
    /// The training context length, if the file states one.
    pub context_length: Option<u64>,
}

/// A metadata or shape problem, naming the key or constraint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {msg}")]
pub struct ConfigError {
    pub file: String,
    pub msg: String,
}

struct Meta<'a> {
    f: &'a File,
}

impl<'a> Meta<'a> {
    fn err(&self, msg: impl Into<String>) -> ConfigError {
        ConfigError { file: self.f.name().to_string(), msg: msg.into() }
    }
    fn key(k: &str) -> String {
        format!("{ARCH}.{k}")
    }
    fn raw(&self, k: &str) -> Result<&'a Value, ConfigError> {
        let key = Self::key(k);
        self.f.get(&key).ok_or_else(|| self.err(format!("missing metadata key '{key}'")))
    }
    fn usize(&self, k: &str) -> Result<usize, ConfigError> {
        let v = self.raw(k)?;
        v.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(|| {
            self.err(format!("metadata key '{}' must be a non-negative integer, got {v:?}", Self::key(k)))
        })
    }
    fn u64_or(&self, k: &str, default: u64) -> Result<u64, ConfigError> {
        match self.f.get(&Self::key(k)) {
            None => Ok(default),
            Some(v) => v.as_u64().ok_or_else(|| {
                self.err(format!("metadata key '{}' must be a non-negative integer, got {v:?}", Self::key(k)))
            }),
        }
    }
    fn f32(&self, k: &str) -> Result<f32, ConfigError> {
        let v = self.raw(k)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.err(format!("metadata key '{}' must be a number, got {v:?}", Self::key(k))))
    }
    fn f32_or(&self, k: &str, default: f32) -> Result<f32, ConfigError> {
        if self.f.get(&Self::key(k)).is_some() {
            self.f32(k)
        } else {
            Ok(default)
        }
    }
    fn array(&self, k: &str) -> Result<&'a [Value], ConfigError> {
        let v = self.raw(k)?;
        v.as_array().ok_or_else(|| self.err(format!("metadata key '{}' must be an array", Self::key(k))))
    }
}

impl Config {
    /// Reads and validates the shape from a GGUF's metadata.
    pub fn from_gguf(f: &File) -> Result<Config, ConfigError> {
        let m = Meta { f };
        match f.get("general.architecture").and_then(|v| v.as_str()) {
            Some(ARCH) => {}
            Some(other) => {
                return Err(m.err(format!("architecture '{other}' is not {ARCH} (this runtime runs DeepSeek V4 Flash)")))
            }
            None => return Err(m.err("missing metadata key 'general.architecture'")),
        }
        // A vocabulary-only file (what `ds4 tokenize` reads) has neither tensors nor a shape: say
        // so rather than report the first missing shape key.
        if f.tensors().is_empty() && f.get(&Meta::key("block_count")).is_none() {
            return Err(m.err(if f.get("tokenizer.ggml.tokens").is_some() {
                "this file is a tokenizer-only GGUF (a vocabulary, no weights): give a model file"
            } else {
                "this file has no tensors and no model shape: it is not a model"
            }));
        }
        let n_layer = m.usize("block_count")?;
        let ratios = m.array("attention.compress_ratios")?;
        let mut compress_ratios = Vec::with_capacity(n_layer);
        for (i, v) in ratios.iter().enumerate().take(n_layer) {
            let r = v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| {
                m.err(format!("{ARCH}.attention.compress_ratios[{i}] must be a non-negative integer, got {v:?}"))
            })?;
            compress_ratios.push(r);
        }
        let clamps = m.array("swiglu_clamp_exp")?;
        let mut swiglu_clamp = Vec::with_capacity(n_layer);
        for (i, v) in clamps.iter().enumerate().take(n_layer) {
            let c =
                v.as_f64().ok_or_else(|| m.err(format!("{ARCH}.swiglu_clamp_exp[{i}] must be a number, got {v:?}")))?;
            swiglu_clamp.push(c as f32);
        }
        for key in ["expert_group_count", "expert_group_used_count"] {
            if m.u64_or(key, 0)? != 0 {
                return Err(m.err(format!("{ARCH}.{key} must be 0 (grouped routing is not part of this architecture)")));
            }
        }
        if m.usize("attention.head_count_kv")? != 1 {
            return Err(m.err(format!("{ARCH}.attention.head_count_kv must be 1 (one shared KV head)")));
        }
        let head_dim = m.usize("attention.key_length")?;
        if m.usize("attention.value_length")? != head_dim {
            return Err(m.err(format!(
                "{ARCH}.attention.value_length must equal key_length ({head_dim}): K and V share one row"
            )));
        }
        if m.usize("expert_shared_count")? != 1 {
            return Err(m.err(format!("{ARCH}.expert_shared_count must be 1")));
        }
        if let Some(v) = f.get(&Meta::key("expert_weights_norm")) {
            if v.as_bool() != Some(true) {
                return Err(m.err(format!("{ARCH}.expert_weights_norm must be true, got {v:?}")));
            }
        }
        let cfg = Config {
            name: f.get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_string(),
            n_layer,
            n_embd: m.usize("embedding_length")?,
            n_vocab: m.usize("vocab_size")?,
            n_head: m.usize("attention.head_count")?,
            head_dim,
            n_rot: m.usize("rope.dimension_count")?,
            q_lora_rank: m.usize("attention.q_lora_rank")?,
            o_lora_rank: m.usize("attention.output_lora_rank")?,
            n_out_group: m.usize("attention.output_group_count")?,
            n_expert: m.usize("expert_count")?,
            n_expert_used: m.usize("expert_used_count")?,
            n_ff_exp: m.usize("expert_feed_forward_length")?,
            n_hash_layer: m.usize("hash_layer_count")?,
            n_swa: m.usize("attention.sliding_window")?,
            n_indexer_head: m.usize("attention.indexer.head_count")?,
            indexer_head_dim: m.usize("attention.indexer.key_length")?,
            indexer_top_k: m.usize("attention.indexer.top_k")?,
            n_hc: m.usize("hyper_connection.count")?,
            hc_sinkhorn_iters: m.usize("hyper_connection.sinkhorn_iterations")?,
            hc_eps: m.f32_or("hyper_connection.epsilon", 1e-6)?,
            rms_eps: m.f32_or("attention.layer_norm_rms_epsilon", 1e-6)?,
            compress_ratios,
            swiglu_clamp,
            rope_freq_base: m.f32("rope.freq_base")?,
            compress_rope_freq_base: m.f32("attention.compress_rope_freq_base")?,
            rope_scale_factor: m.f32("rope.scaling.factor")?,
            yarn_beta_fast: m.f32("rope.scaling.yarn_beta_fast")?,
            yarn_beta_slow: m.f32("rope.scaling.yarn_beta_slow")?,
            rope_orig_ctx: m.u64_or("rope.scaling.original_context_length", 0)?,
            expert_weight_scale: m.f32("expert_weights_scale")?,
            context_length: f.get(&Meta::key("context_length")).and_then(|v| v.as_u64()),
        };
        cfg.validate().map_err(|msg| m.err(msg))?;
        Ok(cfg)
    }

    /// Checks every constraint the kernels rely on. The message names the violated one.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        let nonzero = [
            ("block_count", c.n_layer),
            ("embedding_length", c.n_embd),
            ("vocab_size", c.n_vocab),
            ("attention.head_count", c.n_head),
            ("attention.key_length", c.head_dim),
            ("attention.q_lora_rank", c.q_lora_rank),
            ("attention.output_lora_rank", c.o_lora_rank),
            ("attention.output_group_count", c.n_out_group),
            ("expert_count", c.n_expert),
            ("expert_used_count", c.n_expert_used),
            ("expert_feed_forward_length", c.n_ff_exp),
            ("attention.sliding_window", c.n_swa),
            ("hyper_connection.sinkhorn_iterations", c.hc_sinkhorn_iters),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return Err(format!("{ARCH}.{k} must be positive"));
            }
        }
        // Far above any real shape, and low enough that products of two sizes cannot overflow.
        const MAX_DIM: usize = 1 << 24;
        let bounded = nonzero.iter().copied().chain([
            ("rope.dimension_count", c.n_rot),
            ("hash_layer_count", c.n_hash_layer),
            ("attention.indexer.head_count", c.n_indexer_head),
            ("attention.indexer.key_length", c.indexer_head_dim),
            ("attention.indexer.top_k", c.indexer_top_k),
            ("hyper_connection.count", c.n_hc),
        ]);
        for (k, v) in bounded {
            if v > MAX_DIM {
                return Err(format!("{ARCH}.{k} is {v}, more than the largest supported {MAX_DIM}"));
            }
        }
        if c.compress_ratios.len() < c.n_layer {
            return Err(format!(
                "{ARCH}.attention.compress_ratios has {} entries, need one per layer ({})",
                c.compress_ratios.len(),
                c.n_layer
            ));
        }
        if c.swiglu_clamp.len() < c.n_layer {
            return Err(format!(
                "{ARCH}.swiglu_clamp_exp has {} entries, need one per layer ({})",
                c.swiglu_clamp.len(),
                c.n_layer
            ));
        }
        if c.n_hc != 4 {
            return Err(format!("{ARCH}.hyper_connection.count is {}, the HC kernels need 4 streams", c.n_hc));
        }
        if c.n_rot == 0 || !c.n_rot.is_multiple_of(2) || c.n_rot > c.head_dim || c.n_rot > 512 {
            return Err(format!(
                "rope.dimension_count {} must be even, at most 512 and at most key_length {}",
                c.n_rot, c.head_dim
            ));
        }
        if !(c.head_dim - c.n_rot).is_multiple_of(64) {
            return Err(format!(
                "key_length - rope dims = {} must be a multiple of 64 (fp8 KV blocks of 64)",
                c.head_dim - c.n_rot
            ));
        }
        if !c.n_head.is_multiple_of(c.n_out_group) {
            return Err(format!(
                "attention.head_count {} must divide into attention.output_group_count {} groups",
                c.n_head, c.n_out_group
            ));
        }
        if !c.n_embd.is_multiple_of(256) {
            return Err(format!("embedding_length {} must be a multiple of 256 (Q8_K blocks)", c.n_embd));
        }
        if !c.n_ff_exp.is_multiple_of(256) {
            return Err(format!("expert_feed_forward_length {} must be a multiple of 256 (Q8_K blocks)", c.n_ff_exp));
        }
        for (what, dim) in [
            ("attention.q_lora_rank", c.q_lora_rank),
            ("grouped output input (key_length * heads per group)", c.head_dim * c.n_head / c.n_out_group),
            ("output_lora_rank * output_group_count", c.o_lora_rank * c.n_out_group),
        ] {
            if dim % 32 != 0 {
                return Err(format!("{what} = {dim} must be a multiple of 32 (Q8_0 blocks)"));
            }
        }
        if c.n_expert_used > c.n_expert {
            return Err(format!("expert_used_count {} exceeds expert_count {}", c.n_expert_used, c.n_expert));
        }
        if c.n_hash_layer > c.n_layer {
            return Err(format!("hash_layer_count {} exceeds block_count {}", c.n_hash_layer, c.n_layer));
        }
        let any_r4 = c.compress_ratios[..c.n_layer].contains(&4);
        if any_r4 {
            if c.indexer_head_dim != 128 {
                return Err(format!(
                    "attention.indexer.key_length is {}, the indexer's Hadamard transform needs 128",
                    c.indexer_head_dim
                ));
            }
            if c.n_rot > c.indexer_head_dim {
                return Err(format!("rope dims {} exceed the indexer head width {}", c.n_rot, c.indexer_head_dim));
            }
            if c.n_indexer_head == 0 || c.indexer_top_k == 0 {
                return Err("attention.indexer.head_count and top_k must be positive".into());
            }
        }
        for (il, &r) in c.compress_ratios[..c.n_layer].iter().enumerate() {
            if r == 1 {
                return Err(format!("layer {il} has compress ratio 1; ratios are 0 (window only), 4, or at least 2"));
            }
            if r > 128 {
                return Err(format!("layer {il} has compress ratio {r}; at most 128 is supported"));
            }
        }
        Ok(())
    }

    pub fn attention_kind(&self, il: usize) -> AttentionKind {
        AttentionKind::from_ratio(self.compress_ratios[il])
    }

    pub fn hc_dim(&self) -> usize {
        self.n_hc * self.n_embd
    }
    /// Width of the HC control vector: pre, post and combine weights.
    pub fn hc_mix_dim(&self) -> usize {
        2 * self.n_hc + self.n_hc * self.n_hc
    }
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    /// Input width of one output group: the heads of that group side by side.
    pub fn out_group_dim(&self) -> usize {
        self.head_dim * (self.n_head / self.n_out_group)
    }
    pub fn out_low_dim(&self) -> usize {
        self.o_lora_rank * self.n_out_group
    }
    pub fn is_hash_layer(&self, il: usize) -> bool {
        il < self.n_hash_layer
    }

    /// ds4's per-layer RoPE: dense layers use the plain base; compressed layers use the
    /// compressed base with YaRN, and an attention factor that cancels YaRN's magnitude scaling.
    pub fn rope(&self, il: usize) -> RopeParams {
        let compressed = self.compress_ratios[il] != 0;
        let freq_base = if compressed && self.compress_rope_freq_base > 0.0 {
            self.compress_rope_freq_base
        } else {
            self.rope_freq_base
        };
        let freq_scale = if compressed && self.rope_scale_factor > 0.0 { 1.0 / self.rope_scale_factor } else { 1.0 };
        let ext_factor = if compressed && self.rope_scale_factor > 1.0 { 1.0 } else { 0.0 };
        let mut attn_factor = 1.0f32;
        if ext_factor != 0.0 && freq_scale > 0.0 {
            attn_factor /= 1.0 + 0.1 * (1.0 / freq_scale).ln();
        }
        RopeParams {
            freq_base,
            freq_scale,
            ext_factor,
            attn_factor,
            beta_fast: self.yarn_beta_fast,
            beta_slow: self.yarn_beta_slow,
            n_ctx_orig: if compressed { self.rope_orig_ctx } else { 0 },
        }
    }
}
