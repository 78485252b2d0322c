//! One function per op, in two numerics profiles (`crate::numerics`): `ds4` follows ds4's CPU
//! reference (`ds4.c`: f64 sums of squares in RMS norms, sequential dot products, the C library's
//! exp/log1p); `canonical` follows the documented order that every backend reproduces.

use std::sync::Arc;

use rayon::prelude::*;

use super::Data;
use crate::gguf::TensorInfo;
use crate::model::{Model, RopeParams};
use crate::numerics::{self, Numerics};
use crate::quant::{self, BlockQ8K, GgmlType, QK_K};
use crate::recorder::{Buf, Op, Program, RopePos, StepParams, WeightId};

/// The profile's `exp` and `log1p`, and whether reductions take the canonical order.
#[derive(Clone, Copy)]
pub(crate) struct Math {
    pub exp: fn(f32) -> f32,
    pub ln_1p: fn(f32) -> f32,
    pub canonical: bool,
}

impl Math {
    pub fn new(numerics: Numerics) -> Math {
        match numerics {
            Numerics::Ds4 => Math { exp: f32::exp, ln_1p: f32::ln_1p, canonical: false },
            Numerics::Canonical => Math { exp: numerics::exp, ln_1p: numerics::ln_1p, canonical: true },
        }
    }
    fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        if self.canonical {
            numerics::dot_f32(a, b)
        } else {
            dot_f32(a, b)
        }
    }
}

pub(crate) struct Ctx<'a> {
    pub program: &'a Program,
    pub model: &'a Model,
    pub bufs: &'a mut Vec<Data>,
    /// Small weight vectors (norms, sinks, HC scales, ape), dequantized on first use.
    pub vectors: &'a mut Vec<Option<Arc<[f32]>>>,
    /// The parameters of the token the op computes (a chunk's row: `StepParams::row`).
    pub p: StepParams,
    /// The row of the chunk's multi-row buffers that an op addresses (0 in a decode program).
    pub row: usize,
    pub math: Math,
}

type R = Result<(), String>;

/// Rows per rayon task in matvecs: enough work per task to amortize scheduling.
const ROWS_PER_TASK: usize = 16;

impl<'a> Ctx<'a> {
    /// The values of `b` an op at `self.row` addresses: its row of a multi-row buffer, or all of
    /// a one-row buffer (decode scratch and state).
    fn span(&self, b: Buf) -> Option<std::ops::Range<usize>> {
        let d = self.program.buffer(b);
        (d.rows > 1).then(|| self.row * d.len..(self.row + 1) * d.len)
    }
    fn f(&self, b: Buf) -> &[f32] {
        match (&self.bufs[b.0 as usize], self.span(b)) {
            (Data::F32(v), Some(r)) => &v[r],
            (Data::F32(v), None) => v,
            (Data::I32(_), _) => &[],
        }
    }
    fn i(&self, b: Buf) -> &[i32] {
        match (&self.bufs[b.0 as usize], self.span(b)) {
            (Data::I32(v), Some(r)) => &v[r],
            (Data::I32(v), None) => v,
            (Data::F32(_), _) => &[],
        }
    }
    /// The op's values of `b` to write; [`Ctx::put`] stores them back. A row of a multi-row
    /// buffer is copied out (ops are written for one token's buffers).
    fn take(&mut self, b: Buf) -> Vec<f32> {
        let span = self.span(b);
        match (&mut self.bufs[b.0 as usize], span) {
            (Data::F32(v), Some(r)) => v[r].to_vec(),
            (Data::F32(v), None) => std::mem::take(v),
            (Data::I32(_), _) => Vec::new(),
        }
    }
    fn put(&mut self, b: Buf, v: Vec<f32>) {
        match (self.span(b), &mut self.bufs[b.0 as usize]) {
            (Some(r), Data::F32(all)) => all[r].copy_from_slice(&v),
            _ => self.bufs[b.0 as usize] = Data::F32(v),
        }
    }
    fn take_i(&mut self, b: Buf) -> Vec<i32> {
        let span = self.span(b);
        match (&mut self.bufs[b.0 as usize], span) {
            (Data::I32(v), Some(r)) => v[r].to_vec(),
            (Data::I32(v), None) => std::mem::take(v),
            (Data::F32(_), _) => Vec::new(),
        }
    }
    fn put_i(&mut self, b: Buf, v: Vec<i32>) {
        match (self.span(b), &mut self.bufs[b.0 as usize]) {
            (Some(r), Data::I32(all)) => all[r].copy_from_slice(&v),
            _ => self.bufs[b.0 as usize] = Data::I32(v),
        }
    }
    /// All rows of a buffer, for the ops that take a chunk's rows at once ([`Ctx::take`]'s
    /// counterpart; [`Ctx::put_all`] stores them back).
    fn take_all(&mut self, b: Buf) -> Vec<f32> {
        match &mut self.bufs[b.0 as usize] {
            Data::F32(v) => std::mem::take(v),
            Data::I32(_) => Vec::new(),
        }
    }
    fn put_all(&mut self, b: Buf, v: Vec<f32>) {
        self.bufs[b.0 as usize] = Data::F32(v);
    }
    /// All rows of a buffer as read-only values.
    fn f_all(&self, b: Buf) -> &[f32] {
        match &self.bufs[b.0 as usize] {
            Data::F32(v) => v,
            Data::I32(_) => &[],
        }
    }
    fn i_all(&self, b: Buf) -> &[i32] {
        match &self.bufs[b.0 as usize] {
            Data::I32(v) => v,
            Data::F32(_) => &[],
        }
    }
    fn w(&self, id: WeightId) -> (&'a TensorInfo, &'a [u8]) {
        let t = self.program.weight(id);
        (t, self.model.data(t))
    }
    /// A small F32/F16 weight as f32 values, dequantized once per executable.
    fn wvec(&mut self, id: WeightId) -> Result<Arc<[f32]>, String> {
        if let Some(v) = &self.vectors[id.0 as usize] {
            return Ok(v.clone());
        }
        let (t, data) = self.w(id);
        let mut v = vec![0.0; t.elements() as usize];
        quant::dequantize_row(t.ty, data, &mut v).map_err(|e| format!("{}: {e}", t.name))?;
        let v: Arc<[f32]> = v.into();
        self.vectors[id.0 as usize] = Some(v.clone());
        Ok(v)
    }

    pub fn run(&mut self, op: &Op) -> R {
        match *op {
            Op::EmbedHc { table, out, n_hc } => self.embed_hc(table, out, n_hc),
            Op::RmsNorm { x, weight, out, n, rows, eps } => self.rms_norm(x, weight, out, n, rows, eps),
            Op::MatVec { w, x, out } => self.mat_vec(w, x, out, 1),
            Op::MatVecGrouped { w, x, out, groups } => self.mat_vec(w, x, out, groups),
            Op::HcSplit { mix, scale, base, split, n_hc, iters, eps } => {
                self.hc_split(mix, scale, base, split, n_hc, iters, eps)
            }
            Op::HcWeightedSum { hc, weights, out, n_hc } => self.hc_weighted_sum(hc, weights, out, n_hc),
            Op::HcPost { block, residual, split, out, n_hc } => self.hc_post(block, residual, split, out, n_hc),
            Op::HcHeadWeights { pre, scale, base, out, eps } => self.hc_head_weights(pre, scale, base, out, eps),
            Op::RopeTail { x, n_head, head_dim, n_rot, rope, pos, inverse } => {
                let pos = match pos {
                    RopePos::Current => self.p.pos,
                    RopePos::CompressedRow { ratio } => (self.p.pos + 1).saturating_sub(ratio),
                };
                let mut v = self.take(x);
                for h in 0..n_head as usize {
                    let head = &mut v[h * head_dim as usize..(h + 1) * head_dim as usize];
                    rope_tail(&mut head[(head_dim - n_rot) as usize..], pos, &rope, inverse);
                }
                self.put(x, v);
                Ok(())
            }
            Op::Fp8RoundTrip { x, head_dim, n_rot } => {
                let mut v = self.take(x);
                fp8_round_trip(self.math, &mut v[..(head_dim - n_rot) as usize]);
                self.put(x, v);
                Ok(())
            }
            Op::IndexerQat { x, rows, head_dim } => {
                let mut v = self.take(x);
                for r in v.chunks_exact_mut(head_dim as usize).take(rows as usize) {
                    hadamard128(r);
                    fp4_round_trip(self.math, r);
                }
                self.put(x, v);
                Ok(())
            }
            Op::StoreRaw { kv, cache, row_dim, raw_cap } => {
                let row = (self.p.pos % raw_cap) as usize;
                self.store_row(kv, cache, row, row_dim as usize)
            }
            Op::CompressorStore { kv, score, ape, state_kv, state_score, width, ratio } => {
                self.compressor_store(kv, score, ape, state_kv, state_score, width as usize, ratio)
            }
            Op::CompressorPool { state_kv, state_score, out, head_dim, ratio } => {
                let mut o = self.take(out);
                compressor_pool(
                    self.math,
                    &mut o,
                    self.f(state_kv),
                    self.f(state_score),
                    head_dim as usize,
                    ratio as usize,
                );
                self.put(out, o);
                Ok(())
            }
            Op::CompressorShift { state_kv, state_score, width, ratio } => {
                let n = (ratio * width) as usize;
                for b in [state_kv, state_score] {
                    let mut v = self.take(b);
                    v.copy_within(n..2 * n, 0);
                    self.put(b, v);
                }
                Ok(())
            }
            Op::StoreCompRow { row, cache, row_dim, ratio } => {
                let r = ((self.p.pos + 1) / ratio)
                    .checked_sub(1)
                    .ok_or_else(|| format!("no compressed row to store at position {}", self.p.pos))?;
                self.store_row(row, cache, r as usize, row_dim as usize)
            }
            Op::IndexerScores { q, weights, cache, out, n_head, head_dim, scale, rows } => {
                let n = rows.eval(&self.p) as usize;
                let hd = head_dim as usize;
                let mut o = self.take(out);
                let (qv, wv, cv) = (self.f(q), self.f(weights), self.f(cache));
                let w: Vec<f32> = wv.iter().map(|&x| x * scale).collect();
                let m = self.math;
                o[..n].par_iter_mut().enumerate().for_each(|(c, s)| {
                    let k = &cv[c * hd..(c + 1) * hd];
                    let mut acc = 0.0f32;
                    for h in 0..n_head as usize {
                        let d = m.dot_f32(k, &qv[h * hd..(h + 1) * hd]);
                        acc += d.max(0.0) * w[h];
                    }
                    *s = acc;
                });
                self.put(out, o);
                Ok(())
            }
            Op::IndexerTopK { scores, out, top_k, rows } => {
                let n = rows.eval(&self.p) as usize;
                let mut o = self.take_i(out);
                top_k_ascending(&self.f(scores)[..n], &mut o[..top_k as usize]);
                self.put_i(out, o);
                Ok(())
            }
            Op::Attention { q, raw, comp, selected, top_k, sinks, out, n_head, head_dim, raw_rows, comp_rows } => {
                let n_raw = raw_rows.eval(&self.p) as usize;
                let n_comp = comp_rows.eval(&self.p) as usize;
                let raw_cap = raw_rows.cap as usize;
                // Raw rows oldest first: positions pos+1-n_raw ..= pos live at row (p % raw_cap).
                let first = self.p.pos as usize + 1 - n_raw;
                let mut rows: Vec<(bool, usize)> = (first..first + n_raw).map(|p| (false, p % raw_cap)).collect();
                match selected {
                    Some(sel) if n_comp > top_k as usize => {
                        for &r in &self.i(sel)[..top_k as usize] {
                            if r < 0 || r as usize >= n_comp {
                                return Err(format!("selected compressed row {r} outside 0..{n_comp}"));
                            }
                            rows.push((true, r as usize));
                        }
                    }
                    _ => rows.extend((0..n_comp).map(|r| (true, r))),
                }
                let sinks = self.wvec(sinks)?;
                let hd = head_dim as usize;
                let mut o = self.take(out);
                let (qv, rv) = (self.f(q), self.f(raw));
                let cv = comp.map(|c| self.f(c)).unwrap_or(&[]);
                let m = self.math;
                o.par_chunks_mut(hd).take(n_head as usize).enumerate().for_each(|(h, oh)| {
                    let kv = |&(is_comp, r): &(bool, usize)| {
                        if is_comp {
                            &cv[r * hd..(r + 1) * hd]
                        } else {
                            &rv[r * hd..(r + 1) * hd]
                        }
                    };
                    attention_head(m, oh, &qv[h * hd..(h + 1) * hd], sinks[h], rows.iter().map(kv));
                });
                self.put(out, o);
                Ok(())
            }
            Op::RouterSelect { logits, bias, hash, selected, weights, n_used, scale } => {
                self.router_select(logits, bias, hash, selected, weights, n_used as usize, scale)
            }
            Op::MoeExperts { x, selected, weights, gate, up, down, out, clamp } => {
                self.moe_experts(x, selected, weights, gate, up, down, out, clamp)
            }
            Op::SwiGlu { gate, up, out, clamp } => {
                let mut o = self.take(out);
                for ((o, &g), &u) in o.iter_mut().zip(self.f(gate)).zip(self.f(up)) {
                    *o = swiglu(self.math, g, u, clamp);
                }
                self.put(out, o);
                Ok(())
            }
            Op::Add { a, b, out } => {
                let mut o = self.take(out);
                for ((o, &x), &y) in o.iter_mut().zip(self.f(a)).zip(self.f(b)) {
                    *o = x + y;
                }
                self.put(out, o);
                Ok(())
            }
        }
    }

    /// Runs one batch step of a chunk ([`crate::recorder::Step`]) for the chunk rows in `rows`
    /// (those whose predicate holds), row `r` with `params[r]`. Matrix products and the routed
    /// experts take all rows at once, reading each weight once per chunk; every other op runs
    /// row by row. Either way each row gets the bits a decode step gives.
    pub fn run_rows(&mut self, op: &Op, rows: &[usize], params: &[StepParams]) -> R {
        if rows.is_empty() {
            return Ok(());
        }
        match *op {
            Op::MatVec { w, x, out } => self.mat_mul(w, x, out, 1, rows),
            Op::MatVecGrouped { w, x, out, groups } => self.mat_mul(w, x, out, groups, rows),
            Op::MoeExperts { x, selected, weights, gate, up, down, out, clamp } => {
                self.moe_experts_rows(x, selected, weights, [gate, up, down], out, clamp, rows)
            }
            Op::EmbedHc { .. }
            | Op::RmsNorm { .. }
            | Op::HcSplit { .. }
            | Op::HcWeightedSum { .. }
            | Op::HcPost { .. }
            | Op::HcHeadWeights { .. }
            | Op::RopeTail { .. }
            | Op::Fp8RoundTrip { .. }
            | Op::IndexerQat { .. }
            | Op::StoreRaw { .. }
            | Op::CompressorStore { .. }
            | Op::CompressorPool { .. }
            | Op::CompressorShift { .. }
            | Op::StoreCompRow { .. }
            | Op::IndexerScores { .. }
            | Op::IndexerTopK { .. }
            | Op::Attention { .. }
            | Op::RouterSelect { .. }
            | Op::SwiGlu { .. }
            | Op::Add { .. } => {
                for &r in rows {
                    self.row = r;
                    self.p = params[r];
                    self.run(op)?;
                }
                Ok(())
            }
        }
    }

    /// The chunk form of [`Ctx::mat_vec`] (`mat_vec` and `mat_vec_grouped` ops): `out[t] = W · x[t]`
    /// for the chunk rows `t` in `rows`. Each weight row is read once and dotted with every row's
    /// input by the matvec's own dot function, so each row's result has the matvec's bits.
    fn mat_mul(&mut self, w: WeightId, x: Buf, out: Buf, groups: u32, rows: &[usize]) -> R {
        let (t, data) = self.w(w);
        let in_dim = t.dim(0) as usize;
        let out_dim = t.dim(1) as usize;
        let rows_per_group = out_dim / groups as usize;
        let rb = t.ty.row_bytes(in_dim);
        let (x_len, o_len) = (self.program.buffer(x).len, self.program.buffer(out).len);
        let xv = self.f_all(x);
        let n = rows.len();
        let canonical = self.math.canonical;
        // [weight row][chunk row]: each task writes whole weight rows; scattered to `out` below.
        let mut tmp = vec![0f32; out_dim * n];
        match t.ty {
            GgmlType::Q8_0 => {
                let mut xq = vec![0i8; n * x_len];
                let mut xd = vec![0f32; n * x_len / 32];
                for (k, &r) in rows.iter().enumerate() {
                    let (q, d) = (&mut xq[k * x_len..(k + 1) * x_len], &mut xd[k * x_len / 32..(k + 1) * x_len / 32]);
                    quant::quantize_q8_0(&xv[r * x_len..(r + 1) * x_len], q, d);
                }
                // Each weight row is decoded once and dotted with the rows' activations 8 at a
                // time (`QuantRows8`, one per group of the input and 8 rows): the bits of
                // `dot_q8_0` (or its canonical form), without decoding the row n times.
                let (groups, tg, blocks) = (groups as usize, n.div_ceil(8), in_dim / 32);
                let mut acts = vec![quant::QuantRows8::default(); groups * tg];
                for g in 0..groups {
                    for q in 0..tg {
                        let rows: Vec<(&[i8], &[f32])> = (q * 8..n.min(q * 8 + 8))
                            .map(|k| {
                                let base = k * x_len + g * in_dim;
                                (&xq[base..base + in_dim], &xd[base / 32..base / 32 + blocks])
                            })
                            .collect();
                        acts[g * tg + q].set_q8_0(&rows);
                    }
                }
                tmp.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(c, chunk)| {
                    let mut row = quant::DecodedRow::default();
                    for (j, o) in chunk.chunks_mut(n).enumerate() {
                        let r = c * ROWS_PER_TASK + j;
                        let g = r / rows_per_group;
                        row.load(GgmlType::Q8_0, &data[r * rb..(r + 1) * rb]);
                        for (q, o8) in o.chunks_mut(8).enumerate() {
                            o8.copy_from_slice(&row.dot_rows8(&acts[g * tg + q], canonical)[..o8.len()]);
                        }
                    }
                });
            }
            GgmlType::F16 if canonical => {
                // Each weight row is converted to f32 once (exact) and, like every row's input,
                // put in lane order, where the canonical dot's 32 lane sums vectorize.
                let mut xt = vec![0f32; n * x_len];
                for (k, &t) in rows.iter().enumerate() {
                    for g in 0..groups as usize {
                        let at = g * in_dim;
                        let (src, dst) = (&xv[t * x_len + at..][..in_dim], &mut xt[k * x_len + at..][..in_dim]);
                        quant::to_lane_major(src, dst);
                    }
                }
                tmp.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(c, chunk)| {
                    let (mut w32, mut wt) = (vec![0f32; in_dim], vec![0f32; in_dim]);
                    for (j, o) in chunk.chunks_mut(n).enumerate() {
                        let r = c * ROWS_PER_TASK + j;
                        let at = (r / rows_per_group) * in_dim;
                        for (d, b) in w32.iter_mut().zip(data[r * rb..(r + 1) * rb].chunks_exact(2)) {
                            *d = quant::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                        }
                        quant::to_lane_major(&w32, &mut wt);
                        // Two rows' inputs at a time: twice the independent lane sums.
                        let x = |k: usize| &xt[k * x_len + at..][..in_dim];
                        for (q, o2) in o.chunks_mut(2).enumerate() {
                            if let [a, b] = o2 {
                                [*a, *b] = quant::dot_lane_major2(&wt, x(2 * q), x(2 * q + 1));
                            } else {
                                o2[0] = quant::dot_lane_major(&wt, x(2 * q));
                            }
                        }
                    }
                });
            }
            GgmlType::F16 => {
                // Each weight row is converted to f32 once (exact) and dotted with the rows'
                // inputs 8 at a time, interleaved term by term (`x8`) so the 8 sums vectorize.
                let (groups, tg) = (groups as usize, n.div_ceil(8));
                let mut x8 = vec![0f32; groups * tg * in_dim * 8];
                for g in 0..groups {
                    for (k, &t) in rows.iter().enumerate() {
                        let src = &xv[t * x_len + g * in_dim..][..in_dim];
                        let dst = &mut x8[(g * tg + k / 8) * in_dim * 8..][..in_dim * 8];
                        for (i, &v) in src.iter().enumerate() {
                            dst[i * 8 + k % 8] = v;
                        }
                    }
                }
                tmp.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(c, chunk)| {
                    let mut w32 = vec![0f32; in_dim];
                    for (j, o) in chunk.chunks_mut(n).enumerate() {
                        let r = c * ROWS_PER_TASK + j;
                        let g = r / rows_per_group;
                        for (d, b) in w32.iter_mut().zip(data[r * rb..(r + 1) * rb].chunks_exact(2)) {
                            *d = quant::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                        }
                        for (q, o8) in o.chunks_mut(8).enumerate() {
                            let mut acc = [0f32; 8];
                            quant::dot_f16_rows8(&w32, &x8[(g * tg + q) * in_dim * 8..][..in_dim * 8], &mut acc);
                            o8.copy_from_slice(&acc[..o8.len()]);
                        }
                    }
                });
            }
            GgmlType::F32 => {
                let dot = if canonical { quant::dot_f32_f32_canonical } else { quant::dot_f32_f32 };
                tmp.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(c, chunk)| {
                    for (j, o) in chunk.chunks_mut(n).enumerate() {
                        let r = c * ROWS_PER_TASK + j;
                        let at = (r / rows_per_group) * in_dim;
                        let row = &data[r * rb..(r + 1) * rb];
                        for (v, &t) in o.iter_mut().zip(rows) {
                            *v = dot(row, &xv[t * x_len + at..t * x_len + at + in_dim]);
                        }
                    }
                });
            }
            other => return Err(format!("tensor '{}' of type {other:?} is not a dense matrix type", t.name)),
        }
        let mut o = self.take_all(out);
        for (r, col) in tmp.chunks_exact(n).enumerate() {
            for (&t, &v) in rows.iter().zip(col) {
                o[t * o_len + r] = v;
            }
        }
        self.put_all(out, o);
        Ok(())
    }

    /// The chunk form of [`Ctx::moe_experts`]: the routed experts of the chunk rows in `rows`. The
    /// rows are grouped by expert, so each selected expert's weights are read once per chunk; each
    /// (row, slot) pair gets the decode op's dots, and each row adds its slots' down projections
    /// in slot order from 0, as the decode op does.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_rows(
        &mut self,
        x: Buf,
        selected: Buf,
        weights: Buf,
        [gate, up, down]: [WeightId; 3],
        out: Buf,
        clamp: f32,
        rows: &[usize],
    ) -> R {
        let ((gt, gd), (ut, ud), (dt, dd)) = (self.w(gate), self.w(up), self.w(down));
        let (in_dim, ff, n_expert) = (gt.dim(0) as usize, gt.dim(1) as usize, gt.dim(2) as usize);
        let out_dim = dt.dim(1) as usize;
        let n_used = self.program.buffer(selected).len;
        let (x_len, o_len) = (self.program.buffer(x).len, self.program.buffer(out).len);
        let (sel, ew) = (self.i_all(selected), self.f_all(weights));
        // The (chunk row index k, slot i) pairs of each expert; pair (k, i) is `slot` k * n_used + i.
        let mut pairs: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_expert];
        for (k, &r) in rows.iter().enumerate() {
            for i in 0..n_used {
                let e = sel[r * n_used + i];
                if e < 0 || e as usize >= n_expert {
                    return Err(format!("expert id {e} outside 0..{n_expert}"));
                }
                pairs[e as usize].push((k, i));
            }
        }
        let math = self.math;
        let n = rows.len();
        let nb = in_dim / QK_K;
        let mut xq = vec![BlockQ8K::default(); n * nb];
        for (k, &r) in rows.iter().enumerate() {
            quant::quantize_q8_k(&self.f_all(x)[r * x_len..r * x_len + in_dim], &mut xq[k * nb..(k + 1) * nb]);
        }
        let (g_rb, u_rb, d_rb) = (gt.ty.row_bytes(in_dim), ut.ty.row_bytes(in_dim), dt.ty.row_bytes(ff));
        let c = math.canonical;
        let (gdot, udot, ddot) = (
            RowDot::new(gt.ty, expert_dot(gt.ty, c)?, c),
            RowDot::new(ut.ty, expert_dot(ut.ty, c)?, c),
            RowDot::new(dt.ty, expert_dot(dt.ty, c)?, c),
        );

        // Gate and up: per expert, [ff row][pair]; the pairs' activations 8 at a time.
        let mids: Vec<Vec<f32>> = pairs
            .par_iter()
            .enumerate()
            .map(|(e, ps)| {
                let np = ps.len();
                let mut m = vec![0f32; ff * np];
                if np == 0 {
                    return m;
                }
                let acts: Vec<ExpertRows> = ps
                    .chunks(8)
                    .map(|p8| ExpertRows::new(p8.iter().map(|&(k, _)| &xq[k * nb..(k + 1) * nb])))
                    .collect();
                m.par_chunks_mut(ROWS_PER_TASK * np).enumerate().for_each(|(c, chunk)| {
                    let (mut g, mut u) = (gdot.clone(), udot.clone());
                    for (j, o) in chunk.chunks_mut(np).enumerate() {
                        let f = c * ROWS_PER_TASK + j;
                        g.load(&gd[(e * ff + f) * g_rb..(e * ff + f + 1) * g_rb]);
                        u.load(&ud[(e * ff + f) * u_rb..(e * ff + f + 1) * u_rb]);
                        for ((o8, p8), a) in o.chunks_mut(8).zip(ps.chunks(8)).zip(&acts) {
                            let (gv, uv) = (g.dot8(a), u.dot8(a));
                            for (q, (v, &(k, i))) in o8.iter_mut().zip(p8).enumerate() {
                                *v = swiglu(math, gv[q], uv[q], clamp) * ew[rows[k] * n_used + i];
                            }
                        }
                    }
                });
                m
            })
            .collect();
        let mut mid = vec![0f32; n * n_used * ff];
        for (ps, m) in pairs.iter().zip(&mids) {
            for (p, &(k, i)) in ps.iter().enumerate() {
                let slot = k * n_used + i;
                for f in 0..ff {
                    mid[slot * ff + f] = m[f * ps.len() + p];
                }
            }
        }
        let fb = ff / QK_K;
        let mut midq = vec![BlockQ8K::default(); n * n_used * fb];
        for (m, q) in mid.chunks_exact(ff).zip(midq.chunks_exact_mut(fb)) {
            quant::quantize_q8_k(m, q);
        }

        // Down: per expert, [out row][pair]; then each row sums its slots in order.
        let downs: Vec<Vec<f32>> = pairs
            .par_iter()
            .enumerate()
            .map(|(e, ps)| {
                let np = ps.len();
                let mut d = vec![0f32; out_dim * np];
                if np == 0 {
                    return d;
                }
                let acts: Vec<ExpertRows> = ps
                    .chunks(8)
                    .map(|p8| {
                        ExpertRows::new(
                            p8.iter().map(|&(k, i)| &midq[(k * n_used + i) * fb..(k * n_used + i + 1) * fb]),
                        )
                    })
                    .collect();
                d.par_chunks_mut(ROWS_PER_TASK * np).enumerate().for_each(|(c, chunk)| {
                    let mut dw = ddot.clone();
                    for (j, o) in chunk.chunks_mut(np).enumerate() {
                        let r = c * ROWS_PER_TASK + j;
                        let base = (e * out_dim + r) * d_rb;
                        dw.load(&dd[base..base + d_rb]);
                        for (o8, a) in o.chunks_mut(8).zip(&acts) {
                            o8.copy_from_slice(&dw.dot8(a)[..o8.len()]);
                        }
                    }
                });
                d
            })
            .collect();
        let mut part = vec![0f32; n * n_used * out_dim];
        for (ps, d) in pairs.iter().zip(&downs) {
            for (p, &(k, i)) in ps.iter().enumerate() {
                let slot = k * n_used + i;
                for r in 0..out_dim {
                    part[slot * out_dim + r] = d[r * ps.len() + p];
                }
            }
        }
        let mut o = self.take_all(out);
        for (k, &t) in rows.iter().enumerate() {
            for r in 0..out_dim {
                let mut acc = 0.0f32;
                for i in 0..n_used {
                    acc += part[(k * n_used + i) * out_dim + r];
                }
                o[t * o_len + r] = acc;
            }
        }
        self.put_all(out, o);
        Ok(())
    }

    fn embed_hc(&mut self, table: WeightId, out: Buf, n_hc: u32) -> R {
        let (t, data) = self.w(table);
        let n_embd = t.dim(0) as usize;
        let token = self.p.token as usize;
        if token as u64 >= t.dim(1) {
            return Err(format!("token {token} is outside the embedding table ({} rows)", t.dim(1)));
        }
        let rb = t.ty.row_bytes(n_embd);
        let mut o = self.take(out);
        quant::dequantize_row(t.ty, &data[token * rb..(token + 1) * rb], &mut o[..n_embd])
            .map_err(|e| e.to_string())?;
        for h in 1..n_hc as usize {
            o.copy_within(0..n_embd, h * n_embd);
        }
        self.put(out, o);
        Ok(())
    }

    fn rms_norm(&mut self, x: Buf, weight: Option<WeightId>, out: Buf, n: u32, rows: u32, eps: f32) -> R {
        let w = weight.map(|w| self.wvec(w)).transpose()?;
        let n = n as usize;
        let input = if x == out { self.f(x).to_vec() } else { Vec::new() };
        let mut o = self.take(out);
        let xs = if x == out { &input[..] } else { self.f(x) };
        for r in 0..rows as usize {
            let (xr, or) = (&xs[r * n..(r + 1) * n], &mut o[r * n..(r + 1) * n]);
            let scale = if self.math.canonical {
                1.0 / (numerics::sum_squares(xr) / n as f32 + eps).sqrt()
            } else {
                let ss: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum();
                1.0 / ((ss / n as f64) as f32 + eps).sqrt()
            };
            match &w {
                Some(w) => or.iter_mut().zip(xr).zip(w.iter()).for_each(|((o, &v), &g)| *o = v * scale * g),
                None => or.iter_mut().zip(xr).for_each(|(o, &v)| *o = v * scale),
            }
        }
        self.put(out, o);
        Ok(())
    }

    /// Dense matvec; with `groups > 1`, output rows of group g read the g-th slice of `x`.
    fn mat_vec(&mut self, w: WeightId, x: Buf, out: Buf, groups: u32) -> R {
        let (t, data) = self.w(w);
        let in_dim = t.dim(0) as usize;
        let rows_per_group = t.dim(1) as usize / groups as usize;
        let rb = t.ty.row_bytes(in_dim);
        let mut o = self.take(out);
        let xv = self.f(x);
        let canonical = self.math.canonical;
        match t.ty {
            GgmlType::Q8_0 => {
                // Quantizing per 32-block makes quantizing the whole input equal to quantizing each group.
                let mut xq = vec![0i8; xv.len()];
                let mut xd = vec![0f32; xv.len() / 32];
                quant::quantize_q8_0(xv, &mut xq, &mut xd);
                o.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
                    for (k, v) in chunk.iter_mut().enumerate() {
                        let r = c * ROWS_PER_TASK + k;
                        let g = r / rows_per_group;
                        let (xq, xd) = (&xq[g * in_dim..(g + 1) * in_dim], &xd[g * in_dim / 32..(g + 1) * in_dim / 32]);
                        let row = &data[r * rb..(r + 1) * rb];
                        *v = if canonical {
                            quant::dot_q8_0_canonical(row, xq, xd)
                        } else {
                            quant::dot_q8_0(row, xq, xd)
                        };
                    }
                });
            }
            GgmlType::F16 | GgmlType::F32 => {
                let dot = match (t.ty, canonical) {
                    (GgmlType::F16, false) => quant::dot_f16_f32,
                    (GgmlType::F16, true) => quant::dot_f16_f32_canonical,
                    (_, false) => quant::dot_f32_f32,
                    (_, true) => quant::dot_f32_f32_canonical,
                };
                o.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
                    for (k, v) in chunk.iter_mut().enumerate() {
                        let r = c * ROWS_PER_TASK + k;
                        let g = r / rows_per_group;
                        *v = dot(&data[r * rb..(r + 1) * rb], &xv[g * in_dim..(g + 1) * in_dim]);
                    }
                });
            }
            other => {
                self.put(out, o);
                return Err(format!("tensor '{}' of type {other:?} is not a dense matrix type", t.name));
            }
        }
        self.put(out, o);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn hc_split(
        &mut self,
        mix: Buf,
        scale: WeightId,
        base: WeightId,
        split: Buf,
        n_hc: u32,
        iters: u32,
        eps: f32,
    ) -> R {
        let (scale, base) = (self.wvec(scale)?, self.wvec(base)?);
        let mut o = self.take(split);
        hc_split_sinkhorn(self.math, &mut o, self.f(mix), &scale, &base, n_hc as usize, iters as usize, eps);
        self.put(split, o);
        Ok(())
    }

    fn hc_weighted_sum(&mut self, hc: Buf, weights: Buf, out: Buf, n_hc: u32) -> R {
        let mut o = self.take(out);
        let n = o.len();
        let (x, w) = (self.f(hc), self.f(weights));
        for (d, v) in o.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for h in 0..n_hc as usize {
                acc += x[h * n + d] * w[h];
            }
            *v = acc;
        }
        self.put(out, o);
        Ok(())
    }

    fn hc_post(&mut self, block: Buf, residual: Buf, split: Buf, out: Buf, n_hc: u32) -> R {
        let n_hc = n_hc as usize;
        let mut o = self.take(out);
        let (b, res, s) = (self.f(block), self.f(residual), self.f(split));
        let n = b.len();
        let (post, comb) = (&s[n_hc..2 * n_hc], &s[2 * n_hc..]);
        for dst in 0..n_hc {
            for d in 0..n {
                let mut acc = b[d] * post[dst];
                for src in 0..n_hc {
                    // The combine matrix is addressed as [dst, src] with dst fastest.
                    acc += comb[dst + src * n_hc] * res[src * n + d];
                }
                o[dst * n + d] = acc;
            }
        }
        self.put(out, o);
        Ok(())
    }

    fn hc_head_weights(&mut self, pre: Buf, scale: WeightId, base: WeightId, out: Buf, eps: f32) -> R {
        let (scale, base) = (self.wvec(scale)?, self.wvec(base)?);
        let mut o = self.take(out);
        for ((o, &p), &b) in o.iter_mut().zip(self.f(pre)).zip(base.iter()) {
            *o = sigmoid(self.math, p * scale[0] + b) + eps;
        }
        self.put(out, o);
        Ok(())
    }

    fn store_row(&mut self, src: Buf, cache: Buf, row: usize, dim: usize) -> R {
        let mut c = self.take(cache);
        if (row + 1) * dim > c.len() {
            self.put(cache, c);
            return Err(format!("row {row} is past the cache capacity ({} rows)", self.f(cache).len() / dim));
        }
        for (d, &v) in c[row * dim..(row + 1) * dim].iter_mut().zip(self.f(src)) {
            *d = quant::round_f16(v);
        }
        self.put(cache, c);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn compressor_store(
        &mut self,
        kv: Buf,
        score: Buf,
        ape: WeightId,
        state_kv: Buf,
        state_score: Buf,
        width: usize,
        ratio: u32,
    ) -> R {
        let pos_mod = (self.p.pos % ratio) as usize;
        let row = if ratio == 4 { 4 + pos_mod } else { pos_mod };
        let ape = self.wvec(ape)?;
        let mut sk = self.take(state_kv);
        sk[row * width..(row + 1) * width].copy_from_slice(self.f(kv));
        self.put(state_kv, sk);
        let mut ss = self.take(state_score);
        for ((d, &s), &a) in
            ss[row * width..(row + 1) * width].iter_mut().zip(self.f(score)).zip(&ape[pos_mod * width..])
        {
            *d = s + a;
        }
        self.put(state_score, ss);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn router_select(
        &mut self,
        logits: Buf,
        bias: Option<WeightId>,
        hash: Option<WeightId>,
        selected: Buf,
        weights: Buf,
        n_used: usize,
        scale: f32,
    ) -> R {
        let probs: Vec<f32> = self.f(logits).iter().map(|&l| softplus(self.math, l).sqrt()).collect();
        let mut sel = self.take_i(selected);
        match hash {
            Some(h) => {
                let (t, data) = self.w(h);
                let token = self.p.token as u64;
                if token >= t.dim(1) {
                    self.put_i(selected, sel);
                    return Err(format!("token {token} is outside the hash routing table ({} rows)", t.dim(1)));
                }
                let row = &data[(token as usize * n_used) * 4..(token as usize + 1) * n_used * 4];
                for (s, c) in sel.iter_mut().zip(row.chunks_exact(4)) {
                    *s = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            None => {
                let mut choice = probs.clone();
                if let Some(b) = bias {
                    for (c, b) in choice.iter_mut().zip(self.wvec(b)?.iter()) {
                        *c += b;
                    }
                }
                top_k_desc(&choice, &mut sel);
            }
        }
        let mut wv = self.take(weights);
        let mut sum = 0.0f32;
        for (w, &s) in wv.iter_mut().zip(&sel) {
            *w = probs.get(s as usize).copied().unwrap_or(0.0);
            sum += *w;
        }
        let sum = sum.max(6.103_515_6e-5); // 2^-14, ds4's floor
        for w in wv.iter_mut() {
            *w = *w / sum * scale;
        }
        self.put_i(selected, sel);
        self.put(weights, wv);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &mut self,
        x: Buf,
        selected: Buf,
        weights: Buf,
        gate: WeightId,
        up: WeightId,
        down: WeightId,
        out: Buf,
        clamp: f32,
    ) -> R {
        let ((gt, gd), (ut, ud), (dt, dd)) = (self.w(gate), self.w(up), self.w(down));
        let (in_dim, ff, n_expert) = (gt.dim(0) as usize, gt.dim(1) as usize, gt.dim(2) as usize);
        let out_dim = dt.dim(1) as usize;
        let sel: Vec<usize> = self.i(selected).iter().map(|&e| e as usize).collect();
        if let Some(&bad) = sel.iter().find(|&&e| e >= n_expert) {
            return Err(format!("expert id {bad} outside 0..{n_expert}"));
        }
        let math = self.math;
        let ew = self.f(weights).to_vec();
        let mut xq = vec![BlockQ8K::default(); in_dim / QK_K];
        quant::quantize_q8_k(self.f(x), &mut xq);

        let (g_rb, u_rb, d_rb) = (gt.ty.row_bytes(in_dim), ut.ty.row_bytes(in_dim), dt.ty.row_bytes(ff));
        let c = math.canonical;
        let (gdot, udot, ddot) = (expert_dot(gt.ty, c)?, expert_dot(ut.ty, c)?, expert_dot(dt.ty, c)?);
        let mut mid = vec![0f32; sel.len() * ff];
        mid.par_chunks_mut(ff).enumerate().for_each(|(i, m)| {
            let (g_base, u_base) = (sel[i] * ff * g_rb, sel[i] * ff * u_rb);
            m.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
                for (k, v) in chunk.iter_mut().enumerate() {
                    let r = c * ROWS_PER_TASK + k;
                    let g = gdot(&gd[g_base + r * g_rb..g_base + (r + 1) * g_rb], &xq);
                    let u = udot(&ud[u_base + r * u_rb..u_base + (r + 1) * u_rb], &xq);
                    *v = swiglu(math, g, u, clamp) * ew[i];
                }
            });
        });
        let mut midq = vec![BlockQ8K::default(); sel.len() * ff / QK_K];
        for (m, q) in mid.chunks_exact(ff).zip(midq.chunks_exact_mut(ff / QK_K)) {
            quant::quantize_q8_k(m, q);
        }
        let mut o = self.take(out);
        o.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
            for (k, v) in chunk.iter_mut().enumerate() {
                let r = c * ROWS_PER_TASK + k;
                let mut acc = 0.0f32;
                for (i, &e) in sel.iter().enumerate() {
                    let base = (e * out_dim + r) * d_rb;
                    acc += ddot(&dd[base..base + d_rb], &midq[i * ff / QK_K..(i + 1) * ff / QK_K]);
                }
                *v = acc;
            }
        });
        self.put(out, o);
        Ok(())
    }
}

type ExpertDot = fn(&[u8], &[BlockQ8K]) -> f32;

/// Up to 8 Q8_K activations of an expert's (row, slot) pairs: as they are, for the row dot, and
/// laid out for the decoded rows' 8-row dot.
struct ExpertRows<'a> {
    y: Vec<&'a [BlockQ8K]>,
    rows8: quant::QuantRows8,
}

impl<'a> ExpertRows<'a> {
    fn new(y: impl Iterator<Item = &'a [BlockQ8K]>) -> Self {
        let y: Vec<&[BlockQ8K]> = y.collect();
        let mut rows8 = quant::QuantRows8::default();
        rows8.set_q8_k(&y);
        ExpertRows { y, rows8 }
    }
}

/// One expert weight row at a time against many Q8_K activations: decoded once where the type
/// has a decoded form ([`quant::DecodedRow`], the same bits), else through the row dot.
struct RowDot<'r> {
    ty: GgmlType,
    dot: ExpertDot,
    canonical: bool,
    raw: &'r [u8],
    decoded: Option<quant::DecodedRow>,
}

impl Clone for RowDot<'_> {
    fn clone(&self) -> Self {
        RowDot::new(self.ty, self.dot, self.canonical)
    }
}

impl<'r> RowDot<'r> {
    fn new(ty: GgmlType, dot: ExpertDot, canonical: bool) -> Self {
        let decoded = quant::DecodedRow::supports(ty).then(quant::DecodedRow::default);
        RowDot { ty, dot, canonical, raw: &[], decoded }
    }
    fn load(&mut self, row: &'r [u8]) {
        match &mut self.decoded {
            Some(d) => d.load(self.ty, row),
            None => self.raw = row,
        }
    }
    /// The row's dots with up to 8 activations (entries past `a.y.len()` are to be ignored).
    fn dot8(&self, a: &ExpertRows) -> [f32; 8] {
        match &self.decoded {
            Some(d) => d.dot_rows8(&a.rows8, self.canonical),
            None => {
                let mut out = [0.0f32; 8];
                for (o, y) in out.iter_mut().zip(&a.y) {
                    *o = (self.dot)(self.raw, y);
                }
                out
            }
        }
    }
}

fn expert_dot(ty: GgmlType, canonical: bool) -> Result<ExpertDot, String> {
    match (ty, canonical) {
        (GgmlType::IQ2_XXS, false) => Ok(quant::dot_iq2_xxs_q8_k),
        (GgmlType::Q2_K, false) => Ok(quant::dot_q2_k_q8_k),
        (GgmlType::Q4_K, false) => Ok(quant::dot_q4_k_q8_k),
        (GgmlType::IQ2_XXS, true) => Ok(quant::dot_iq2_xxs_q8_k_canonical),
        (GgmlType::Q2_K, true) => Ok(quant::dot_q2_k_q8_k_canonical),
        (GgmlType::Q4_K, true) => Ok(quant::dot_q4_k_q8_k_canonical),
        (other, _) => Err(format!("{other:?} is not a routed-expert type")),
    }
}

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |acc, (&x, &y)| acc + x * y)
}

fn sigmoid(m: Math, x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (m.exp)(-x))
    } else {
        let e = (m.exp)(x);
        e / (1.0 + e)
    }
}

fn silu(m: Math, x: f32) -> f32 {
    x * sigmoid(m, x)
}

fn softplus(m: Math, x: f32) -> f32 {
    if x > 20.0 {
        x
    } else if x < -20.0 {
        (m.exp)(x)
    } else {
        (m.ln_1p)((m.exp)(x))
    }
}

/// SwiGLU with ds4's clamp: the gate only from above, the up both ways.
fn swiglu(m: Math, g: f32, u: f32, clamp: f32) -> f32 {
    let (g, u) = if clamp > 1e-6 { (g.min(clamp), u.clamp(-clamp, clamp)) } else { (g, u) };
    silu(m, g) * u
}

/// `out = [pre | post | comb]`: sigmoid gates and a Sinkhorn-normalized combine matrix.
#[allow(clippy::too_many_arguments)]
fn hc_split_sinkhorn(
    m: Math,
    out: &mut [f32],
    mix: &[f32],
    scale: &[f32],
    base: &[f32],
    n: usize,
    iters: usize,
    eps: f32,
) {
    for i in 0..n {
        out[i] = 1.0 / (1.0 + (m.exp)(-(mix[i] * scale[0] + base[i]))) + eps;
        out[n + i] = 2.0 / (1.0 + (m.exp)(-(mix[n + i] * scale[1] + base[n + i])));
    }
    // c[src + dst*n]: softmax over src for each dst, plus eps.
    let mut c = vec![0f32; n * n];
    for dst in 0..n {
        let row = &mut c[dst * n..(dst + 1) * n];
        for (src, v) in row.iter_mut().enumerate() {
            let k = 2 * n + src + dst * n;
            *v = mix[k] * scale[2] + base[k];
        }
        let max = row.iter().fold(-1.0e30f32, |m, &v| m.max(v));
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (m.exp)(*v - max);
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v = *v * inv + eps;
        }
    }
    let normalize_src = |c: &mut [f32]| {
        for src in 0..n {
            let sum: f32 = (0..n).fold(0.0, |s, dst| s + c[src + dst * n]);
            let inv = 1.0 / (sum + eps);
            for dst in 0..n {
                c[src + dst * n] *= inv;
            }
        }
    };
    let normalize_dst = |c: &mut [f32]| {
        for dst in 0..n {
            let sum: f32 = (0..n).fold(0.0, |s, src| s + c[src + dst * n]);
            let inv = 1.0 / (sum + eps);
            for src in 0..n {
                c[src + dst * n] *= inv;
            }
        }
    };
    normalize_src(&mut c);
    for _ in 1..iters {
        normalize_dst(&mut c);
        normalize_src(&mut c);
    }
    out[2 * n..2 * n + n * n].copy_from_slice(&c);
}

/// RoPE on one head's tail (`x.len() == n_rot`); `inverse` rotates the other way.
fn rope_tail(x: &mut [f32], pos: u32, r: &RopeParams, inverse: bool) {
    let mut cs = [(0.0f32, 0.0f32); 256];
    let pairs = &mut cs[..x.len() / 2];
    r.cos_sin(pos, x.len(), pairs);
    for (k, &(c, s)) in pairs.iter().enumerate() {
        let s = if inverse { -s } else { s };
        let (x0, x1) = (x[2 * k], x[2 * k + 1]);
        x[2 * k] = x0 * c - x1 * s;
        x[2 * k + 1] = x0 * s + x1 * c;
    }
}

/// The E4M3 value with code `i` (0..=126), sign excluded.
fn e4m3_value(i: i32) -> f32 {
    let exp = (i >> 3) & 15;
    let mant = (i & 7) as f32;
    if exp == 0 {
        mant * 0.001953125
    } else {
        (1.0 + mant * 0.125) * (2.0f32).powi(exp - 7)
    }
}

/// Nearest E4M3 value (ties to the even code), saturating at 448.
fn e4m3_round(x: f32) -> f32 {
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let ax = x.abs().min(448.0);
    let (mut lo, mut hi) = (0i32, 126i32);
    while lo < hi {
        let mid = (lo + hi + 1) >> 1;
        if e4m3_value(mid) <= ax {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut best = lo;
    if best < 126 {
        let (d0, d1) = ((ax - e4m3_value(best)).abs(), (ax - e4m3_value(best + 1)).abs());
        if d1 < d0 || (d1 == d0 && (best + 1) % 2 == 0 && best % 2 != 0) {
            best += 1;
        }
    }
    sign * e4m3_value(best)
}

/// The power-of-two block scale `2^ceil(log2(t))`: ds4 takes it from `log2f`, the canonical
/// profile from the bits of `t`.
fn pow2_scale(m: Math, t: f32) -> f32 {
    if m.canonical {
        numerics::pow2_ceil(t)
    } else {
        (2.0f32).powi(t.log2().ceil() as i32)
    }
}

/// fp8 E4M3 round trip per 64 values with a power-of-two scale.
fn fp8_round_trip(m: Math, x: &mut [f32]) {
    for block in x.chunks_exact_mut(64) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1.0e-4);
        let scale = pow2_scale(m, amax / 448.0);
        for v in block.iter_mut() {
            *v = e4m3_round((*v / scale).clamp(-448.0, 448.0)) * scale;
        }
    }
}

const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Nearest E2M1 value (ties to the even code), saturating at 6.
fn e2m1_round(x: f32) -> f32 {
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let ax = x.abs().min(6.0);
    let mut best = 0usize;
    let mut best_diff = ax;
    for (i, &v) in E2M1.iter().enumerate().skip(1) {
        let d = (ax - v).abs();
        if d < best_diff || (d == best_diff && i % 2 == 0 && !best.is_multiple_of(2)) {
            best = i;
            best_diff = d;
        }
    }
    sign * E2M1[best]
}

/// FP4 E2M1 round trip per 32 values with a power-of-two scale.
fn fp4_round_trip(m: Math, x: &mut [f32]) {
    for block in x.chunks_exact_mut(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(6.0 * f32::MIN_POSITIVE);
        let scale = pow2_scale(m, amax / 6.0);
        for v in block.iter_mut() {
            *v = e2m1_round((*v / scale).clamp(-6.0, 6.0)) * scale;
        }
    }
}

/// Orthonormal Walsh-Hadamard transform of 128 values.
fn hadamard128(x: &mut [f32]) {
    let mut stride = 1;
    while stride < 128 {
        for base in (0..128).step_by(2 * stride) {
            for i in base..base + stride {
                let (a, b) = (x[i], x[i + stride]);
                x[i] = a + b;
                x[i + stride] = a - b;
            }
        }
        stride <<= 1;
    }
    for v in x.iter_mut().take(128) {
        *v *= std::f32::consts::FRAC_1_SQRT_2 / 8.0; // 1/sqrt(128)
    }
}

/// Softmax-pools the compressor window per dim. Ratio 4 mixes the previous lane's first half
/// (rows 0..4) with the current lane's second half (rows 4..8).
fn compressor_pool(m: Math, out: &mut [f32], kv: &[f32], score: &[f32], head_dim: usize, ratio: usize) {
    let width = if ratio == 4 { 2 * head_dim } else { head_dim };
    let lanes: Vec<usize> = if ratio == 4 {
        (0..4).map(|r| r * width).chain((4..8).map(|r| r * width + head_dim)).collect()
    } else {
        (0..ratio).map(|r| r * width).collect()
    };
    for (j, o) in out.iter_mut().enumerate() {
        let max = lanes.iter().fold(-1.0e30f32, |m, &b| m.max(score[b + j]));
        if max <= -1.0e30 * 0.5 {
            *o = 0.0;
            continue;
        }
        let (mut denom, mut sum) = (0.0f32, 0.0f32);
        if ratio == 4 {
            // ds4 interleaves the two lanes' terms in its sums.
            for r in 0..4 {
                let (bp, bc) = (lanes[r], lanes[4 + r]);
                let (wp, wc) = ((m.exp)(score[bp + j] - max), (m.exp)(score[bc + j] - max));
                denom += wp + wc;
                sum += wp * kv[bp + j];
                sum += wc * kv[bc + j];
            }
        } else {
            for &b in &lanes {
                let w = (m.exp)(score[b + j] - max);
                denom += w;
                sum += w * kv[b + j];
            }
        }
        *o = if denom > 0.0 { sum / denom } else { 0.0 };
    }
}

/// One head of sink attention over `rows` (K == V).
fn attention_head<'r>(m: Math, out: &mut [f32], q: &[f32], sink: f32, rows: impl Iterator<Item = &'r [f32]> + Clone) {
    if m.canonical {
        return attention_head_canonical(m, out, q, sink, rows);
    }
    let kq_scale = 1.0 / (q.len() as f32).sqrt();
    let scores: Vec<f32> = rows.clone().map(|k| dot_f32(q, k) * kq_scale).collect();
    let max = scores.iter().fold(sink, |m, &s| m.max(s));
    out.fill(0.0);
    let mut denom = (m.exp)(sink - max);
    for (k, &s) in rows.zip(&scores) {
        let w = (m.exp)(s - max);
        denom += w;
        for (o, &v) in out.iter_mut().zip(k) {
            *o += w * v;
        }
    }
    let inv = 1.0 / denom;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// [`attention_head`] in the canonical order: rows in chunks of `ATTN_ROW_CHUNK`, sequential
/// inside a chunk, chunk sums added in order (the sink's weight first in the denominator).
fn attention_head_canonical<'r>(
    m: Math,
    out: &mut [f32],
    q: &[f32],
    sink: f32,
    rows: impl Iterator<Item = &'r [f32]> + Clone,
) {
    let kq_scale = 1.0 / (q.len() as f32).sqrt();
    let rows: Vec<&[f32]> = rows.collect();
    let scores: Vec<f32> = rows.iter().map(|k| numerics::dot_f32(q, k) * kq_scale).collect();
    let max = scores.iter().fold(sink, |m, &s| m.max(s));
    let w: Vec<f32> = scores.iter().map(|&s| (m.exp)(s - max)).collect();
    let mut denom = (m.exp)(sink - max);
    out.fill(0.0);
    let mut part = vec![0.0f32; out.len()];
    for (rc, wc) in rows.chunks(numerics::ATTN_ROW_CHUNK).zip(w.chunks(numerics::ATTN_ROW_CHUNK)) {
        part.fill(0.0);
        let mut d = 0.0f32;
        for (k, &wr) in rc.iter().zip(wc) {
            d += wr;
            for (p, &v) in part.iter_mut().zip(k.iter()) {
                *p += wr * v;
            }
        }
        denom += d;
        for (o, &p) in out.iter_mut().zip(&part) {
            *o += p;
        }
    }
    let inv = 1.0 / denom;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// The indices of the `out.len()` largest scores, best first (ties to the lower index).
fn top_k_desc(score: &[f32], out: &mut [i32]) {
    out.fill(-1);
    for (i, &s) in score.iter().enumerate() {
        for j in 0..out.len() {
            if out[j] < 0 || s > score[out[j] as usize] {
                out.copy_within(j..out.len() - 1, j + 1);
                out[j] = i as i32;
                break;
            }
        }
    }
}

/// The `out.len()` best rows as ds4's indexer picks them, written in ascending row order.
fn top_k_ascending(score: &[f32], out: &mut [i32]) {
    let mut taken = vec![false; score.len()];
    for _ in 0..out.len().min(score.len()) {
        let mut best = 0usize;
        let mut best_score = -1.0e30f32;
        for (c, &s) in score.iter().enumerate() {
            if !taken[c] && s > best_score {
                best = c;
                best_score = s;
            }
        }
        taken[best] = true;
    }
    let picked: Vec<i32> = taken.iter().enumerate().filter(|(_, &t)| t).map(|(i, _)| i as i32).collect();
    out.fill(0);
    out[..picked.len()].copy_from_slice(&picked);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_rounds_to_representable_values() {
        assert_eq!(e4m3_round(448.0), 448.0);
        assert_eq!(e4m3_round(1000.0), 448.0);
        assert_eq!(e4m3_round(-1.0), -1.0);
        // 1.0625 lies halfway between 1.0 (code 56, even) and 1.125 (code 57): ties to even.
        assert_eq!(e4m3_round(1.0625), 1.0);
        assert_eq!(e4m3_round(1.1875), 1.25);
        // Smallest subnormal is 2^-9.
        assert_eq!(e4m3_round(0.001953125), 0.001953125);
    }

    #[test]
    fn hadamard_is_orthonormal() {
        let mut x = vec![0f32; 128];
        x[3] = 1.0;
        hadamard128(&mut x);
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 1.0).abs() < 1e-5);
        hadamard128(&mut x);
        assert!((x[3] - 1.0).abs() < 1e-5 && x.iter().enumerate().all(|(i, v)| i == 3 || v.abs() < 1e-5));
    }

    #[test]
    fn sinkhorn_is_doubly_stochastic() {
        let mix: Vec<f32> = (0..24).map(|i| ((i * 7) % 11) as f32 * 0.3 - 1.0).collect();
        let mut out = vec![0f32; 24];
        hc_split_sinkhorn(Math::new(Numerics::Ds4), &mut out, &mix, &[1.0, 1.0, 1.0], &[0.0; 24], 4, 20, 1e-6);
        let c = &out[8..];
        for k in 0..4 {
            let rows: f32 = (0..4).map(|j| c[k + j * 4]).sum();
            let cols: f32 = (0..4).map(|j| c[j + k * 4]).sum();
            assert!((rows - 1.0).abs() < 1e-3 && (cols - 1.0).abs() < 1e-3, "{rows} {cols}");
        }
    }

    #[test]
    fn top_k_picks_best_and_sorts_ascending() {
        let mut out = [0i32; 3];
        top_k_ascending(&[0.1, 0.9, 0.5, 0.9, 0.2], &mut out);
        assert_eq!(out, [1, 2, 3]);
        let mut d = [0i32; 2];
        top_k_desc(&[0.1, 0.9, 0.5, 0.9], &mut d);
        assert_eq!(d, [1, 3]);
    }
}
