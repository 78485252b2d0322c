//! Binds GGUF tensors by name and checks each one's type and shape against the config.

use super::config::{AttentionKind, Config};
use crate::gguf::{File, TensorInfo};
use crate::quant::GgmlType;

/// A tensor binding problem, naming the file and tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {msg}")]
pub struct WeightError {
    pub file: String,
    pub msg: String,
}

/// One compressor lane's weights (attention or indexer).
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    pub ape: TensorInfo,
    pub kv: TensorInfo,
    pub gate: TensorInfo,
    pub norm: TensorInfo,
}

#[derive(Debug, Clone)]
pub struct IndexerWeights {
    pub q_b: TensorInfo,
    pub proj: TensorInfo,
    pub compressor: CompressorWeights,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub hc_attn_fn: TensorInfo,
    pub hc_attn_scale: TensorInfo,
    pub hc_attn_base: TensorInfo,
    pub attn_norm: TensorInfo,
    pub attn_q_a: TensorInfo,
    pub attn_q_a_norm: TensorInfo,
    pub attn_q_b: TensorInfo,
    pub attn_kv: TensorInfo,
    pub attn_kv_a_norm: TensorInfo,
    pub attn_sinks: TensorInfo,
    pub attn_output_a: TensorInfo,
    pub attn_output_b: TensorInfo,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
    pub hc_ffn_fn: TensorInfo,
    pub hc_ffn_scale: TensorInfo,
    pub hc_ffn_base: TensorInfo,
    pub ffn_norm: TensorInfo,
    pub ffn_gate_inp: TensorInfo,
    pub exp_probs_b: Option<TensorInfo>,
    pub ffn_gate_exps: TensorInfo,
    pub ffn_up_exps: TensorInfo,
    pub ffn_down_exps: TensorInfo,
    pub ffn_gate_shexp: TensorInfo,
    pub ffn_up_shexp: TensorInfo,
    pub ffn_down_shexp: TensorInfo,
    pub tid2eid: Option<TensorInfo>,
}

#[derive(Debug, Clone)]
pub struct Weights {
    pub token_embd: TensorInfo,
    pub output_hc_base: TensorInfo,
    pub output_hc_fn: TensorInfo,
    pub output_hc_scale: TensorInfo,
    pub output_norm: TensorInfo,
    pub output: TensorInfo,
    pub layers: Vec<LayerWeights>,
}

const F16_OR_F32: &[GgmlType] = &[GgmlType::F16, GgmlType::F32];
const F32: &[GgmlType] = &[GgmlType::F32];
const Q8_0: &[GgmlType] = &[GgmlType::Q8_0];
const I32: &[GgmlType] = &[GgmlType::I32];
const EXPERT: &[GgmlType] = &[GgmlType::IQ2_XXS, GgmlType::Q2_K, GgmlType::Q4_K];

struct Binder<'a> {
    f: &'a File,
}

impl<'a> Binder<'a> {
    fn err(&self, msg: String) -> WeightError {
        WeightError { file: self.f.name().to_string(), msg }
    }

    fn check(&self, t: &TensorInfo, types: &[GgmlType], dims: &[usize]) -> Result<(), WeightError> {
        if !types.contains(&t.ty) {
            let want: Vec<String> = types.iter().map(|t| format!("{t:?}")).collect();
            return Err(self.err(format!("tensor '{}' has type {:?}, expected {}", t.name, t.ty, want.join(" or "))));
        }
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if t.dims != want {
            return Err(self.err(format!("tensor '{}' has shape {:?}, expected {:?}", t.name, t.dims, want)));
        }
        Ok(())
    }

    fn req(&self, name: &str, types: &[GgmlType], dims: &[usize]) -> Result<TensorInfo, WeightError> {
        let t = self.f.tensor(name).ok_or_else(|| self.err(format!("missing tensor '{name}'")))?;
        self.check(t, types, dims)?;
        Ok(t.clone())
    }

    fn opt(&self, name: &str, types: &[GgmlType], dims: &[usize]) -> Result<Option<TensorInfo>, WeightError> {
        match self.f.tensor(name) {
            None => Ok(None),
            Some(t) => {
                self.check(t, types, dims)?;
                Ok(Some(t.clone()))
            }
        }
    }

    fn compressor(
        &self,
        prefix: &str,
        cfg: &Config,
        head_dim: usize,
        ratio: usize,
    ) -> Result<CompressorWeights, WeightError> {
        let coff = if ratio == 4 { 2 } else { 1 };
        let width = coff * head_dim;
        Ok(CompressorWeights {
            ape: self.req(&format!("{prefix}_ape.weight"), F16_OR_F32, &[width, ratio])?,
            kv: self.req(&format!("{prefix}_kv.weight"), F16_OR_F32, &[cfg.n_embd, width])?,
            gate: self.req(&format!("{prefix}_gate.weight"), F16_OR_F32, &[cfg.n_embd, width])?,
            norm: self.req(&format!("{prefix}_norm.weight"), F32, &[head_dim])?,
        })
    }

    fn layer(&self, cfg: &Config, il: usize) -> Result<LayerWeights, WeightError> {
        let p = |s: &str| format!("blk.{il}.{s}");
        let (e, hc, mix) = (cfg.n_embd, cfg.hc_dim(), cfg.hc_mix_dim());
        let ratio = cfg.compress_ratios[il] as usize;
        let compressor =
            if ratio != 0 { Some(self.compressor(&p("attn_compressor"), cfg, cfg.head_dim, ratio)?) } else { None };
        let indexer = if cfg.attention_kind(il) == AttentionKind::Ratio4Indexed {
            Some(IndexerWeights {
                q_b: self.req(
                    &p("indexer.attn_q_b.weight"),
                    F16_OR_F32,
                    &[cfg.q_lora_rank, cfg.n_indexer_head * cfg.indexer_head_dim],
                )?,
                proj: self.req(&p("indexer.proj.weight"), F16_OR_F32, &[e, cfg.n_indexer_head])?,
                compressor: self.compressor(&p("indexer_compressor"), cfg, cfg.indexer_head_dim, ratio)?,
            })
        } else {
            None
        };
        let gate = self.req(&p("ffn_gate_exps.weight"), EXPERT, &[e, cfg.n_ff_exp, cfg.n_expert])?;
        let up = self.req(&p("ffn_up_exps.weight"), EXPERT, &[e, cfg.n_ff_exp, cfg.n_expert])?;
        if gate.ty != up.ty {
            return Err(self.err(format!(
                "layer {il}: routed gate ({:?}) and up ({:?}) experts must share a quant type",
                gate.ty, up.ty
            )));
        }
        let tid2eid = if cfg.is_hash_layer(il) {
            Some(self.req(&p("ffn_gate_tid2eid.weight"), I32, &[cfg.n_expert_used, cfg.n_vocab])?)
        } else {
            None
        };
        Ok(LayerWeights {
            hc_attn_fn: self.req(&p("hc_attn_fn.weight"), F16_OR_F32, &[hc, mix])?,
            hc_attn_scale: self.req(&p("hc_attn_scale.weight"), F32, &[3])?,
            hc_attn_base: self.req(&p("hc_attn_base.weight"), F32, &[mix])?,
            attn_norm: self.req(&p("attn_norm.weight"), F32, &[e])?,
            attn_q_a: self.req(&p("attn_q_a.weight"), Q8_0, &[e, cfg.q_lora_rank])?,
            attn_q_a_norm: self.req(&p("attn_q_a_norm.weight"), F32, &[cfg.q_lora_rank])?,
            attn_q_b: self.req(&p("attn_q_b.weight"), Q8_0, &[cfg.q_lora_rank, cfg.q_dim()])?,
            attn_kv: self.req(&p("attn_kv.weight"), Q8_0, &[e, cfg.head_dim])?,
            attn_kv_a_norm: self.req(&p("attn_kv_a_norm.weight"), F32, &[cfg.head_dim])?,
            attn_sinks: self.req(&p("attn_sinks.weight"), F32, &[cfg.n_head])?,
            attn_output_a: self.req(&p("attn_output_a.weight"), Q8_0, &[cfg.out_group_dim(), cfg.out_low_dim()])?,
            attn_output_b: self.req(&p("attn_output_b.weight"), Q8_0, &[cfg.out_low_dim(), e])?,
            compressor,
            indexer,
            hc_ffn_fn: self.req(&p("hc_ffn_fn.weight"), F16_OR_F32, &[hc, mix])?,
            hc_ffn_scale: self.req(&p("hc_ffn_scale.weight"), F32, &[3])?,
            hc_ffn_base: self.req(&p("hc_ffn_base.weight"), F32, &[mix])?,
            ffn_norm: self.req(&p("ffn_norm.weight"), F32, &[e])?,
            ffn_gate_inp: self.req(&p("ffn_gate_inp.weight"), F16_OR_F32, &[e, cfg.n_expert])?,
            exp_probs_b: self.opt(&p("exp_probs_b.bias"), F32, &[cfg.n_expert])?,
            ffn_gate_exps: gate,
            ffn_up_exps: up,
            ffn_down_exps: self.req(&p("ffn_down_exps.weight"), EXPERT, &[cfg.n_ff_exp, e, cfg.n_expert])?,
            ffn_gate_shexp: self.req(&p("ffn_gate_shexp.weight"), Q8_0, &[e, cfg.n_ff_exp])?,
            ffn_up_shexp: self.req(&p("ffn_up_shexp.weight"), Q8_0, &[e, cfg.n_ff_exp])?,
            ffn_down_shexp: self.req(&p("ffn_down_shexp.weight"), Q8_0, &[cfg.n_ff_exp, e])?,
            tid2eid,
        })
    }
}

impl Weights {
    /// Binds every tensor the decode program reads, with type and shape checks.
    pub fn bind(f: &File, cfg: &Config) -> Result<Weights, WeightError> {
        let b = Binder { f };
        let (e, hc) = (cfg.n_embd, cfg.hc_dim());
        let w = Weights {
            token_embd: b.req("token_embd.weight", F16_OR_F32, &[e, cfg.n_vocab])?,
            output_hc_base: b.req("output_hc_base.weight", F32, &[cfg.n_hc])?,
            output_hc_fn: b.req("output_hc_fn.weight", F16_OR_F32, &[hc, cfg.n_hc])?,
            output_hc_scale: b.req("output_hc_scale.weight", F32, &[1])?,
            output_norm: b.req("output_norm.weight", F32, &[e])?,
            output: b.req("output.weight", Q8_0, &[e, cfg.n_vocab])?,
            layers: (0..cfg.n_layer).map(|il| b.layer(cfg, il)).collect::<Result<_, _>>()?,
        };
        // Hash routing tables must name existing experts: a bad id would index past the expert tensor.
        for (il, l) in w.layers.iter().enumerate() {
            if let Some(t) = &l.tid2eid {
                let data = f.tensor_data(t);
                if let Some(bad) = data
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .find(|&v| v < 0 || v as usize >= cfg.n_expert)
                {
                    return Err(b.err(format!(
                        "tensor '{}' (layer {il}) holds expert id {bad}, outside 0..{}",
                        t.name, cfg.n_expert
                    )));
                }
            }
        }
        Ok(w)
    }

    /// Every tensor the engine binds, in a stable order.
    pub fn all(&self) -> Vec<&TensorInfo> {
        let mut v = vec![
            &self.token_embd,
            &self.output_hc_base,
            &self.output_hc_fn,
            &self.output_hc_scale,
            &self.output_norm,
            &self.output,
        ];
        for l in &self.layers {
            v.extend([
                &l.hc_attn_fn,
                &l.hc_attn_scale,
                &l.hc_attn_base,
                &l.attn_norm,
                &l.attn_q_a,
                &l.attn_q_a_norm,
                &l.attn_q_b,
                &l.attn_kv,
                &l.attn_kv_a_norm,
                &l.attn_sinks,
                &l.attn_output_a,
                &l.attn_output_b,
            ]);
            if let Some(c) = &l.compressor {
                v.extend([&c.ape, &c.kv, &c.gate, &c.norm]);
            }
            if let Some(ix) = &l.indexer {
                let c = &ix.compressor;
                v.extend([&ix.q_b, &ix.proj, &c.ape, &c.kv, &c.gate, &c.norm]);
            }
            v.extend([
                &l.hc_ffn_fn,
                &l.hc_ffn_scale,
                &l.hc_ffn_base,
                &l.ffn_norm,
                &l.ffn_gate_inp,
                &l.ffn_gate_exps,
                &l.ffn_up_exps,
                &l.ffn_down_exps,
                &l.ffn_gate_shexp,
                &l.ffn_up_shexp,
                &l.ffn_down_shexp,
            ]);
            v.extend(l.exp_probs_b.iter());
            v.extend(l.tid2eid.iter());
        }
        v
    }

    /// Bytes of all bound weights.
    pub fn total_bytes(&self) -> u64 {
        self.all().iter().map(|t| t.bytes).sum()
    }

    /// Weight bytes one decode token reads: every dense weight, one embedding row, one hash-table
    /// row per hash layer, and `n_expert_used` of the `n_expert` routed experts per layer.
    pub fn decode_bytes_per_token(&self, cfg: &Config) -> u64 {
        self.decode_bytes_at(cfg, IndexerReads::All)
    }

    /// Weight bytes one decode token reads, with the indexer's weights as `indexer` says.
    pub fn decode_bytes_at(&self, cfg: &Config, indexer: IndexerReads) -> u64 {
        let mut total = 0u64;
        for t in self.all() {
            let query = t.name.ends_with("indexer.attn_q_b.weight") || t.name.ends_with("indexer.proj.weight");
            let compressor = t.name.contains("indexer_compressor");
            let skip = match indexer {
                IndexerReads::None => query || compressor,
                IndexerReads::Compressor => query,
                IndexerReads::All => false,
            };
            if skip {
                continue;
            }
            let is_expert = t.dims.len() == 3;
            let is_row_table = std::ptr::eq(t, &self.token_embd) || t.name.ends_with("ffn_gate_tid2eid.weight");
            total += if is_expert {
                t.bytes / cfg.n_expert as u64 * cfg.n_expert_used as u64
            } else if is_row_table {
                t.bytes / t.dim(1)
            } else {
                t.bytes
            };
        }
        total
    }
}

/// Which of the indexer's weights a decode token reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexerReads {
    /// None: the context is too short for the indexer ever to select, so it is not recorded.
    None,
    /// Its compressor's: it is recorded but a layer does not yet hold more rows than it selects.
    Compressor,
    /// All of them: the query and weights projections run too.
    All,
}
