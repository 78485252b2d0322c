//! Records one DS4 decode token in ds4's order: the token head, then per layer the attention
//! half and the FFN half, then the output head. The program covers every position up to the
//! context capacity: emits and the indexer are predicated, spans are bounds. An indexer that
//! could never select within the capacity (a layer never holds more compressed rows than its
//! top-k) is not recorded at all.
//!
//! The same function records a session's **chunk program** (batched prefill): the same ops in
//! the same order over scratch buffers with one row per token of the chunk (T rows, fixed when
//! the session is created; a shorter tail chunk is bounded by `StepParams::count`). Each op means
//! "the decode op, for every row", with predicates and bounds evaluated per row, so each row
//! computes exactly what a decode step at its position computes. Both programs bind the same
//! state buffers (the session's KV ring, compressed caches and compressor windows).
//!
//! Two things keep the rows of a chunk from stepping on each other's state:
//! - **The raw ring has `window + T - 1` rows** (at most the context) in a session whose chunks
//!   hold T tokens, for both programs. A chunk stores all its rows' KV into the ring first, then
//!   every row attends. Row `r` reads positions `pos_r - window + 1 ..= pos_r`; a later row of the
//!   same chunk writes position `p <= pos_r + T - 1`, whose ring slot `p % (window + T - 1)` holds
//!   no position that row `r` reads. So attention over the chunk is a batch op (rows independent),
//!   and the ring after the chunk is what token-by-token feeding leaves in a ring of that size.
//!   The decode program reads the same ring the same way (`pos % raw_cap`, the last `window`
//!   positions), so the extra rows only cost memory.
//! - **The compressor's window is a row loop** ([`Recorder::in_order`]): its store, pool and
//!   shift run row by row, in order, because row `r` pools what rows `r-7 ..= r` stored. Its
//!   projections, before the loop, are batched. The compressed caches are append-only (row
//!   `(pos+1)/ratio - 1` is written once), and a row reads only the rows its position has
//!   emitted, so the indexer and attention read them as batch ops.

use std::collections::HashMap;

use crate::model::weights::CompressorWeights;
use crate::model::{AttentionKind, Model};
use crate::recorder::{Bound, BoundKind, Buf, CompQuant, Cond, DType, Op, Program, Recorder, RopePos};

/// Capacities fixed when a session is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Context length: positions 0..ctx.
    pub ctx: u32,
}

impl Caps {
    /// Rows of the raw ring: the sliding window (or the context, if shorter).
    pub fn raw_cap(&self, window: usize) -> u32 {
        self.ring_rows(window, 1)
    }
    /// Rows of the raw ring in a session whose prefill chunks hold up to `chunk` tokens:
    /// `window + chunk - 1`, so that no row of a chunk overwrites a row an earlier row of the same
    /// chunk reads (module doc), or the context, if shorter.
    pub fn ring_rows(&self, window: usize, chunk: u32) -> u32 {
        (window as u32).saturating_add(chunk.max(1) - 1).min(self.ctx).max(1)
    }
    /// Compressed rows a layer of `ratio` can emit within the context.
    pub fn comp_cap(&self, ratio: u32) -> u32 {
        (self.ctx / ratio).max(1)
    }
    /// Whether an indexer picking `top_k` of a ratio-`ratio` layer's compressed rows can ever pick
    /// fewer than all of them within the context; if not, it is not recorded.
    pub fn records_indexer(&self, ratio: u32, top_k: u32) -> bool {
        self.comp_cap(ratio) > top_k
    }
}

/// Scratch buffers shared by all layers, created once per (name, length).
struct Scratch {
    bufs: HashMap<(String, usize), Buf>,
}

impl Scratch {
    fn get(&mut self, rec: &mut Recorder, name: &str, len: usize) -> Buf {
        *self
            .bufs
            .entry((name.to_string(), len))
            .or_insert_with(|| rec.buffer(&format!("{name}[{len}]"), DType::F32, len))
    }
    fn get_i32(&mut self, rec: &mut Recorder, name: &str, len: usize) -> Buf {
        *self
            .bufs
            .entry((format!("i32:{name}"), len))
            .or_insert_with(|| rec.buffer(&format!("{name}[{len}]"), DType::I32, len))
    }
}

/// Records the token program for `model` at capacity `caps` (a session that feeds one token at
/// a time).
pub fn record_token(model: &Model, caps: Caps) -> Result<Program, String> {
    record(model, caps, 1, 1)
}

/// Records one of a session's programs: `rows == 1` the decode program, `rows == chunk` the chunk
/// program, for a session whose prefill chunks hold up to `chunk` tokens (which sizes the ring).
/// Both programs of a session are recorded with the same `chunk`, so they bind the same state.
pub fn record(model: &Model, caps: Caps, rows: u32, chunk: u32) -> Result<Program, String> {
    if rows != 1 && rows != chunk {
        return Err(format!("a program has 1 row or the session's chunk of {chunk} rows, not {rows}"));
    }
    if chunk == 0 || chunk > caps.ctx {
        return Err(format!("a prefill chunk holds 1 to {} tokens (the context), not {chunk}", caps.ctx));
    }
    let cfg = &model.config;
    let w = &model.weights;
    let mut rec = Recorder::with_rows(rows);
    let mut s = Scratch { bufs: HashMap::new() };
    let (n_embd, n_hc, hc_dim) = (cfg.n_embd, cfg.n_hc as u32, cfg.hc_dim());
    let mix_dim = cfg.hc_mix_dim();
    let eps = cfg.rms_eps;
    let raw_cap = caps.ring_rows(cfg.n_swa, chunk);

    // Residual HC state: layer l reads hc[l % 2] and writes hc[(l + 1) % 2].
    let hc = [rec.buffer("hc_a", DType::F32, hc_dim), rec.buffer("hc_b", DType::F32, hc_dim)];
    let hc_mid = rec.buffer("hc_after_attn", DType::F32, hc_dim);
    let flat = s.get(&mut rec, "hc_flat", hc_dim);
    let mix = s.get(&mut rec, "hc_mix", mix_dim);
    let split = s.get(&mut rec, "hc_split", mix_dim);
    let cur = s.get(&mut rec, "sub_in", n_embd);
    let norm = s.get(&mut rec, "sub_norm", n_embd);

    let table = rec.weight(&w.token_embd);
    rec.push(Op::EmbedHc { table, out: hc[0], n_hc });

    // HC pre: plain RMS norm of the streams, the control projection, the split, the weighted sum
    // and the sublayer's RMS norm.
    let hc_pre = |rec: &mut Recorder, input: Buf, fn_w, scale_w, base_w, norm_w| {
        let (fw, sw, bw, nw) = (rec.weight(fn_w), rec.weight(scale_w), rec.weight(base_w), rec.weight(norm_w));
        rec.push(Op::RmsNorm { x: input, weight: None, out: flat, n: hc_dim as u32, rows: 1, eps });
        rec.push(Op::MatVec { w: fw, x: flat, out: mix });
        rec.push(Op::HcSplit {
            mix,
            scale: sw,
            base: bw,
            split,
            n_hc,
            iters: cfg.hc_sinkhorn_iters as u32,
            eps: cfg.hc_eps,
        });
        rec.push(Op::HcWeightedSum { hc: input, weights: split, out: cur, n_hc });
        rec.push(Op::RmsNorm { x: cur, weight: Some(nw), out: norm, n: n_embd as u32, rows: 1, eps });
    };

    for (il, lw) in w.layers.iter().enumerate() {
        let kind = cfg.attention_kind(il);
        let ratio = kind.ratio();
        let rope = cfg.rope(il);
        let (hd, n_head, n_rot) = (cfg.head_dim as u32, cfg.n_head as u32, cfg.n_rot as u32);
        let input = hc[il % 2];
        let output = hc[(il + 1) % 2];

        // ---- attention half ----
        hc_pre(&mut rec, input, &lw.hc_attn_fn, &lw.hc_attn_scale, &lw.hc_attn_base, &lw.attn_norm);
        let qr = s.get(&mut rec, "qr", cfg.q_lora_rank);
        let qr_norm = s.get(&mut rec, "qr_norm", cfg.q_lora_rank);
        let q = s.get(&mut rec, "q", cfg.q_dim());
        let kv_raw = s.get(&mut rec, "kv_raw", cfg.head_dim);
        let kv = s.get(&mut rec, "kv", cfg.head_dim);
        let (qa, qan, qb) = (rec.weight(&lw.attn_q_a), rec.weight(&lw.attn_q_a_norm), rec.weight(&lw.attn_q_b));
        let (kvw, kvn) = (rec.weight(&lw.attn_kv), rec.weight(&lw.attn_kv_a_norm));
        rec.push(Op::MatVec { w: qa, x: norm, out: qr });
        rec.push(Op::RmsNorm { x: qr, weight: Some(qan), out: qr_norm, n: cfg.q_lora_rank as u32, rows: 1, eps });
        rec.push(Op::MatVec { w: qb, x: qr_norm, out: q });
        rec.push(Op::RmsNorm { x: q, weight: None, out: q, n: hd, rows: n_head, eps });
        rec.push(Op::MatVec { w: kvw, x: norm, out: kv_raw });
        rec.push(Op::RmsNorm { x: kv_raw, weight: Some(kvn), out: kv, n: hd, rows: 1, eps });
        rec.push(Op::RopeTail { x: q, n_head, head_dim: hd, n_rot, rope, pos: RopePos::Current, inverse: false });
        rec.push(Op::RopeTail { x: kv, n_head: 1, head_dim: hd, n_rot, rope, pos: RopePos::Current, inverse: false });
        rec.push(Op::Fp8RoundTrip { x: kv, head_dim: hd, n_rot });
        let raw = rec.state(&format!("blk.{il}.raw_kv"), DType::F32, (raw_cap * hd) as usize, 0.0);
        rec.push(Op::StoreRaw { kv, cache: raw, row_dim: hd, raw_cap });

        let mut comp = None;
        let mut comp_rows = Bound::zero();
        let mut selected = None;
        if let Some(cw) = &lw.compressor {
            let cap = caps.comp_cap(ratio);
            let cache = rec.state(&format!("blk.{il}.comp_kv"), DType::F32, (cap * hd) as usize, 0.0);
            record_compressor(&mut rec, &mut s, cw, norm, cache, il, ratio, hd, CompQuant::Fp8, rope, n_rot, eps);
            comp = Some(cache);
            comp_rows = Bound { kind: BoundKind::CompRows { ratio }, cap };
        }
        // The indexer (its compressor lane, query, scores and top-k) only matters once a layer
        // holds more compressed rows than it selects; a context with no more rows than top_k
        // never gets there (attention then reads every row), so it is not recorded at all.
        let indexer = match (kind, &lw.indexer) {
            (AttentionKind::Ratio4Indexed, Some(ix)) if caps.records_indexer(ratio, cfg.indexer_top_k as u32) => {
                Some(ix)
            }
            _ => None,
        };
        if let Some(ix) = indexer {
            let ihd = cfg.indexer_head_dim as u32;
            let n_ih = cfg.n_indexer_head as u32;
            let cap = caps.comp_cap(ratio);
            let top_k = cfg.indexer_top_k as u32;
            let icache = rec.state(&format!("blk.{il}.index_comp_kv"), DType::F32, (cap * ihd) as usize, 0.0);
            record_compressor(
                &mut rec,
                &mut s,
                &ix.compressor,
                norm,
                icache,
                il,
                ratio,
                ihd,
                CompQuant::IndexerQat,
                rope,
                n_rot,
                eps,
            );
            let iq = s.get(&mut rec, "index_q", (n_ih * ihd) as usize);
            let iw = s.get(&mut rec, "index_w", n_ih as usize);
            let scores = s.get(&mut rec, "index_scores", cap as usize);
            let sel = s.get_i32(&mut rec, "index_selected", top_k as usize);
            let (qbw, pw) = (rec.weight(&ix.q_b), rec.weight(&ix.proj));
            let rows = Bound { kind: BoundKind::CompRows { ratio }, cap };
            rec.when(Cond::IndexerActive { ratio, top_k }, |rec| {
                rec.push(Op::MatVec { w: qbw, x: qr_norm, out: iq });
                rec.push(Op::RopeTail {
                    x: iq,
                    n_head: n_ih,
                    head_dim: ihd,
                    n_rot,
                    rope,
                    pos: RopePos::Current,
                    inverse: false,
                });
                rec.push(Op::IndexerQat { x: iq, rows: n_ih, head_dim: ihd });
                rec.push(Op::MatVec { w: pw, x: norm, out: iw });
                rec.push(Op::IndexerScores {
                    q: iq,
                    weights: iw,
                    cache: icache,
                    out: scores,
                    n_head: n_ih,
                    head_dim: ihd,
                    scale: 1.0 / ((ihd * n_ih) as f32).sqrt(),
                    rows,
                });
                rec.push(Op::IndexerTopK { scores, out: sel, top_k, rows });
            });
            selected = Some(sel);
        }

        let heads = s.get(&mut rec, "heads", cfg.q_dim());
        let sinks = rec.weight(&lw.attn_sinks);
        rec.push(Op::Attention {
            q,
            raw,
            comp,
            selected,
            top_k: cfg.indexer_top_k as u32,
            sinks,
            out: heads,
            n_head,
            head_dim: hd,
            raw_rows: Bound { kind: BoundKind::RawRows { window: cfg.n_swa as u32 }, cap: raw_cap },
            comp_rows,
        });
        rec.push(Op::RopeTail { x: heads, n_head, head_dim: hd, n_rot, rope, pos: RopePos::Current, inverse: true });
        let low = s.get(&mut rec, "attn_low", cfg.out_low_dim());
        let attn_out = s.get(&mut rec, "attn_out", n_embd);
        let (oa, ob) = (rec.weight(&lw.attn_output_a), rec.weight(&lw.attn_output_b));
        rec.push(Op::MatVecGrouped { w: oa, x: heads, out: low, groups: cfg.n_out_group as u32 });
        rec.push(Op::MatVec { w: ob, x: low, out: attn_out });
        rec.push(Op::HcPost { block: attn_out, residual: input, split, out: hc_mid, n_hc });

        // ---- FFN half ----
        hc_pre(&mut rec, hc_mid, &lw.hc_ffn_fn, &lw.hc_ffn_scale, &lw.hc_ffn_base, &lw.ffn_norm);
        let n_used = cfg.n_expert_used;
        let router_logits = s.get(&mut rec, "router_logits", cfg.n_expert);
        let sel = s.get_i32(&mut rec, "expert_selected", n_used);
        let ew = s.get(&mut rec, "expert_weights", n_used);
        let moe = s.get(&mut rec, "moe_out", n_embd);
        let gate_inp = rec.weight(&lw.ffn_gate_inp);
        let bias = lw.exp_probs_b.as_ref().map(|t| rec.weight(t));
        let hash = lw.tid2eid.as_ref().map(|t| rec.weight(t));
        rec.push(Op::MatVec { w: gate_inp, x: norm, out: router_logits });
        rec.push(Op::RouterSelect {
            logits: router_logits,
            bias,
            hash,
            selected: sel,
            weights: ew,
            n_used: n_used as u32,
            scale: cfg.expert_weight_scale,
        });
        let clamp = cfg.swiglu_clamp[il];
        let (ge, ue, de) = (rec.weight(&lw.ffn_gate_exps), rec.weight(&lw.ffn_up_exps), rec.weight(&lw.ffn_down_exps));
        rec.push(Op::MoeExperts { x: norm, selected: sel, weights: ew, gate: ge, up: ue, down: de, out: moe, clamp });
        let sh_gate = s.get(&mut rec, "shexp_gate", cfg.n_ff_exp);
        let sh_up = s.get(&mut rec, "shexp_up", cfg.n_ff_exp);
        let sh_mid = s.get(&mut rec, "shexp_mid", cfg.n_ff_exp);
        let sh_out = s.get(&mut rec, "shexp_out", n_embd);
        let ffn_out = s.get(&mut rec, "ffn_out", n_embd);
        let (gs, us, ds) =
            (rec.weight(&lw.ffn_gate_shexp), rec.weight(&lw.ffn_up_shexp), rec.weight(&lw.ffn_down_shexp));
        rec.push(Op::MatVec { w: gs, x: norm, out: sh_gate });
        rec.push(Op::MatVec { w: us, x: norm, out: sh_up });
        rec.push(Op::SwiGlu { gate: sh_gate, up: sh_up, out: sh_mid, clamp });
        rec.push(Op::MatVec { w: ds, x: sh_mid, out: sh_out });
        rec.push(Op::Add { a: moe, b: sh_out, out: ffn_out });
        rec.push(Op::HcPost { block: ffn_out, residual: hc_mid, split, out: output, n_hc });
    }

    // ---- output head ----
    let last = hc[cfg.n_layer % 2];
    let pre = s.get(&mut rec, "out_hc_pre", cfg.n_hc);
    let hw = s.get(&mut rec, "out_hc_w", cfg.n_hc);
    let embd = s.get(&mut rec, "out_embd", n_embd);
    let onorm = s.get(&mut rec, "out_norm", n_embd);
    let logits = rec.buffer("logits", DType::F32, cfg.n_vocab);
    let (fw, sw, bw) = (rec.weight(&w.output_hc_fn), rec.weight(&w.output_hc_scale), rec.weight(&w.output_hc_base));
    let (nw, ow) = (rec.weight(&w.output_norm), rec.weight(&w.output));
    rec.push(Op::RmsNorm { x: last, weight: None, out: flat, n: hc_dim as u32, rows: 1, eps });
    rec.push(Op::MatVec { w: fw, x: flat, out: pre });
    rec.push(Op::HcHeadWeights { pre, scale: sw, base: bw, out: hw, eps: cfg.hc_eps });
    rec.push(Op::HcWeightedSum { hc: last, weights: hw, out: embd, n_hc });
    rec.push(Op::RmsNorm { x: embd, weight: Some(nw), out: onorm, n: n_embd as u32, rows: 1, eps });
    rec.push(Op::MatVec { w: ow, x: onorm, out: logits });
    rec.finish(logits, caps.ctx)
}

/// One compressor lane: project kv and score, store them in the window state, and on an emit
/// token pool, normalize, rope, round and store a compressed row.
#[allow(clippy::too_many_arguments)]
fn record_compressor(
    rec: &mut Recorder,
    s: &mut Scratch,
    cw: &CompressorWeights,
    x: Buf,
    cache: Buf,
    il: usize,
    ratio: u32,
    head_dim: u32,
    quant: CompQuant,
    rope: crate::model::RopeParams,
    n_rot: u32,
    eps: f32,
) {
    let lane = match quant {
        CompQuant::Fp8 => "attn",
        CompQuant::IndexerQat => "index",
    };
    let width = if ratio == 4 { 2 * head_dim } else { head_dim };
    let rows = if ratio == 4 { 8 } else { ratio };
    let kv_cur = s.get(rec, &format!("{lane}_comp_kv_cur"), width as usize);
    let sc_cur = s.get(rec, &format!("{lane}_comp_score_cur"), width as usize);
    let pooled = s.get(rec, &format!("{lane}_comp_pooled"), head_dim as usize);
    let row = s.get(rec, &format!("{lane}_comp_row"), head_dim as usize);
    let state_kv = rec.state(&format!("blk.{il}.{lane}_state_kv"), DType::F32, (rows * width) as usize, 0.0);
    // ds4 starts the window scores at -1e30 so that unwritten rows get no weight.
    let state_score = rec.state(&format!("blk.{il}.{lane}_state_score"), DType::F32, (rows * width) as usize, -1.0e30);
    let (kw, gw, ape, nw) = (rec.weight(&cw.kv), rec.weight(&cw.gate), rec.weight(&cw.ape), rec.weight(&cw.norm));
    rec.push(Op::MatVec { w: kw, x, out: kv_cur });
    rec.push(Op::MatVec { w: gw, x, out: sc_cur });
    // The window state carries from one position to the next: row by row in a chunk.
    rec.in_order(|rec| {
        rec.push(Op::CompressorStore { kv: kv_cur, score: sc_cur, ape, state_kv, state_score, width, ratio });
        rec.when(Cond::Emit { ratio }, |rec| {
            rec.push(Op::CompressorPool { state_kv, state_score, out: pooled, head_dim, ratio });
            rec.push(Op::RmsNorm { x: pooled, weight: Some(nw), out: row, n: head_dim, rows: 1, eps });
            rec.push(Op::RopeTail {
                x: row,
                n_head: 1,
                head_dim,
                n_rot,
                rope,
                pos: RopePos::CompressedRow { ratio },
                inverse: false,
            });
            match quant {
                CompQuant::Fp8 => rec.push(Op::Fp8RoundTrip { x: row, head_dim, n_rot }),
                CompQuant::IndexerQat => rec.push(Op::IndexerQat { x: row, rows: 1, head_dim }),
            }
            rec.push(Op::StoreCompRow { row, cache, row_dim: head_dim, ratio });
            if ratio == 4 {
                rec.push(Op::CompressorShift { state_kv, state_score, width, ratio });
            }
        });
    });
}
