//! The command recorder: a token is recorded once as a [`Program`] of ops over typed buffers and
//! GGUF weights. Everything that varies per token lives in [`StepParams`]; predicated ops and
//! loop bounds are evaluated from it at execution time, so one program serves every position.

mod op;

pub use op::{CompQuant, Op, RopePos};

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::gguf::TensorInfo;
use crate::quant::GgmlType;

/// The per-token values: the only thing that changes between replays. Every other per-token
/// quantity (ring row, window length, compressed-row counts, emit flags) is derived from `pos`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StepParams {
    pub token: u32,
    pub pos: u32,
    pub _reserved: [u32; 2],
}

impl StepParams {
    pub fn new(token: u32, pos: u32) -> Self {
        StepParams { token, pos, _reserved: [0; 2] }
    }
}

/// A buffer handle, valid in the program that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Buf(pub u32);

/// A weight handle: an index into [`Program::weights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId(pub u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    I32,
}

/// Whether a buffer is per-token scratch or state that persists across tokens (KV caches,
/// compressor state). State is filled with `init` when a session starts or resets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BufKind {
    Scratch,
    State { init: f32 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct BufDesc {
    pub name: String,
    pub dtype: DType,
    pub len: usize,
    pub kind: BufKind,
}

/// A predicate evaluated from `StepParams` at execution time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cond {
    /// A compressed row is emitted this token: `(pos + 1) % ratio == 0`.
    Emit { ratio: u32 },
    /// The indexer selects rows: the layer has more than `top_k` compressed rows.
    IndexerActive { ratio: u32, top_k: u32 },
}

impl Cond {
    pub fn eval(&self, p: &StepParams) -> bool {
        match *self {
            Cond::Emit { ratio } => (p.pos + 1).is_multiple_of(ratio),
            Cond::IndexerActive { ratio, top_k } => (p.pos + 1) / ratio > top_k,
        }
    }
}

/// A loop bound read from `StepParams`, capped by a capacity fixed at record time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bound {
    pub kind: BoundKind,
    pub cap: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BoundKind {
    /// Rows of the raw window: `min(pos + 1, window)`.
    RawRows { window: u32 },
    /// Compressed rows written so far (this token's emit included): `(pos + 1) / ratio`.
    CompRows { ratio: u32 },
    /// No rows (a layer without compression).
    Zero,
}

impl Bound {
    pub fn eval(&self, p: &StepParams) -> u32 {
        let n = match self.kind {
            BoundKind::RawRows { window } => (p.pos + 1).min(window),
            BoundKind::CompRows { ratio } => (p.pos + 1) / ratio,
            BoundKind::Zero => 0,
        };
        n.min(self.cap)
    }
    pub fn zero() -> Bound {
        Bound { kind: BoundKind::Zero, cap: 0 }
    }
}

/// One recorded op and the predicate that guards it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub op: Op,
    pub cond: Option<Cond>,
}

/// An immutable recorded token program.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    buffers: Vec<BufDesc>,
    weights: Vec<TensorInfo>,
    steps: Vec<Step>,
    logits: Buf,
    positions: u32,
    fingerprint: u64,
}

impl Program {
    /// How many positions (0..positions) the program serves: the context capacity.
    pub fn positions(&self) -> u32 {
        self.positions
    }
    pub fn buffers(&self) -> &[BufDesc] {
        &self.buffers
    }
    pub fn buffer(&self, b: Buf) -> &BufDesc {
        &self.buffers[b.0 as usize]
    }
    pub fn weights(&self) -> &[TensorInfo] {
        &self.weights
    }
    pub fn weight(&self, w: WeightId) -> &TensorInfo {
        &self.weights[w.0 as usize]
    }
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
    /// The buffer that holds the logits after a step.
    pub fn logits(&self) -> Buf {
        self.logits
    }
    /// A hash of the whole program, fixed at `finish()`.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// How many ops are recorded, and how many of them are predicated.
    pub fn op_counts(&self) -> (usize, usize) {
        (self.steps.len(), self.steps.iter().filter(|s| s.cond.is_some()).count())
    }
    /// Bytes of all buffers (scratch and state).
    pub fn buffer_bytes(&self) -> u64 {
        self.buffers.iter().map(|b| b.len as u64 * 4).sum()
    }
    /// Vocabulary size: the length of the logits buffer.
    pub fn n_vocab(&self) -> usize {
        self.buffer(self.logits).len
    }
    /// Refuses parameters the program cannot run: a position at or beyond the context it was
    /// recorded for (the caches would be written past their rows), or a token outside the
    /// vocabulary (the embedding and hash tables would be read out of bounds).
    pub fn check_params(&self, p: &StepParams) -> Result<(), String> {
        if p.pos >= self.positions {
            return Err(format!(
                "position {} is outside the context of {} positions this program was recorded for",
                p.pos, self.positions
            ));
        }
        if p.token as usize >= self.n_vocab() {
            return Err(format!("token id {} is outside the vocabulary ({} tokens)", p.token, self.n_vocab()));
        }
        Ok(())
    }
    /// Ops that run for `p` (their predicates hold).
    pub fn active_steps<'a>(&'a self, p: &'a StepParams) -> impl Iterator<Item = &'a Op> + 'a {
        self.steps.iter().filter(move |s| s.cond.is_none_or(|c| c.eval(p))).map(|s| &s.op)
    }
}

/// Builds a [`Program`].
#[derive(Default)]
pub struct Recorder {
    buffers: Vec<BufDesc>,
    weights: Vec<TensorInfo>,
    weight_index: HashMap<String, WeightId>,
    steps: Vec<Step>,
    cond: Option<Cond>,
}

impl Recorder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A per-token scratch buffer of `len` elements.
    pub fn buffer(&mut self, name: &str, dtype: DType, len: usize) -> Buf {
        self.add(name, dtype, len, BufKind::Scratch)
    }

    /// A state buffer that persists across tokens, filled with `init` at session start.
    pub fn state(&mut self, name: &str, dtype: DType, len: usize, init: f32) -> Buf {
        self.add(name, dtype, len, BufKind::State { init })
    }

    fn add(&mut self, name: &str, dtype: DType, len: usize, kind: BufKind) -> Buf {
        self.buffers.push(BufDesc { name: name.to_string(), dtype, len, kind });
        Buf(self.buffers.len() as u32 - 1)
    }

    /// A handle to a GGUF tensor (deduplicated by name).
    pub fn weight(&mut self, t: &TensorInfo) -> WeightId {
        if let Some(&w) = self.weight_index.get(&t.name) {
            return w;
        }
        self.weights.push(t.clone());
        let w = WeightId(self.weights.len() as u32 - 1);
        self.weight_index.insert(t.name.clone(), w);
        w
    }

    pub fn len(&self, b: Buf) -> usize {
        self.buffers[b.0 as usize].len
    }

    /// Appends an op, guarded by the enclosing `when` predicate if any.
    pub fn push(&mut self, op: Op) {
        self.steps.push(Step { op, cond: self.cond });
    }

    /// Records the ops that `f` pushes under `cond`. Predicates do not nest.
    pub fn when(&mut self, cond: Cond, f: impl FnOnce(&mut Recorder)) {
        assert!(self.cond.is_none(), "recorder predicates do not nest");
        self.cond = Some(cond);
        f(self);
        self.cond = None;
    }

    /// Checks every op's buffer and weight sizes, and freezes the program, which serves
    /// positions `0..positions`.
    pub fn finish(self, logits: Buf, positions: u32) -> Result<Program, String> {
        let mut p = Program {
            buffers: self.buffers,
            weights: self.weights,
            steps: self.steps,
            logits,
            positions,
            fingerprint: 0,
        };
        for (i, s) in p.steps.iter().enumerate() {
            validate(&p, &s.op).map_err(|e| format!("op #{i} ({}): {e}", s.op.name()))?;
        }
        let mut h = DefaultHasher::new();
        format!("{:?}|{:?}|{:?}|{:?}|{}", p.buffers, p.weights, p.steps, p.logits, p.positions).hash(&mut h);
        p.fingerprint = h.finish();
        Ok(p)
    }
}

fn validate(p: &Program, op: &Op) -> Result<(), String> {
    let len = |b: Buf| p.buffer(b).len;
    let f32b = |b: Buf, n: usize| -> Result<(), String> {
        let d = p.buffer(b);
        if d.dtype != DType::F32 || d.len != n {
            return Err(format!("buffer '{}' is {:?}[{}], expected F32[{n}]", d.name, d.dtype, d.len));
        }
        Ok(())
    };
    let i32b = |b: Buf, n: usize| -> Result<(), String> {
        let d = p.buffer(b);
        if d.dtype != DType::I32 || d.len != n {
            return Err(format!("buffer '{}' is {:?}[{}], expected I32[{n}]", d.name, d.dtype, d.len));
        }
        Ok(())
    };
    let w = |id: WeightId| p.weight(id);
    let wlen = |id: WeightId| w(id).elements() as usize;
    let dense = |id: WeightId| -> Result<(usize, usize), String> {
        let t = w(id);
        if t.dims.len() != 2 || !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0) {
            return Err(format!("weight '{}' must be a 2D F32/F16/Q8_0 matrix", t.name));
        }
        Ok((t.dims[0] as usize, t.dims[1] as usize))
    };
    match *op {
        Op::EmbedHc { table, out, n_hc } => {
            let (n_embd, _) = dense(table)?;
            f32b(out, n_embd * n_hc as usize)
        }
        Op::RmsNorm { x, weight, out, n, rows, .. } => {
            f32b(x, (n * rows) as usize)?;
            f32b(out, (n * rows) as usize)?;
            match weight {
                Some(wt) if wlen(wt) != n as usize => {
                    Err(format!("norm weight has {} elements, expected {n}", wlen(wt)))
                }
                _ => Ok(()),
            }
        }
        Op::MatVec { w: wt, x, out } => {
            let (i, o) = dense(wt)?;
            f32b(x, i)?;
            f32b(out, o)
        }
        Op::MatVecGrouped { w: wt, x, out, groups } => {
            let (i, o) = dense(wt)?;
            if w(wt).ty != GgmlType::Q8_0 || o % groups as usize != 0 {
                return Err("grouped matvec needs a Q8_0 weight whose rows divide into the groups".into());
            }
            f32b(x, i * groups as usize)?;
            f32b(out, o)
        }
        Op::HcSplit { mix, scale, base, split, n_hc, .. } => {
            let m = (2 * n_hc + n_hc * n_hc) as usize;
            f32b(mix, m)?;
            f32b(split, m)?;
            if wlen(scale) != 3 || wlen(base) != m {
                return Err("HC scale must have 3 and base mix-dim elements".into());
            }
            Ok(())
        }
        Op::HcWeightedSum { hc, weights, out, n_hc } => {
            if len(hc) != len(out) * n_hc as usize || len(weights) < n_hc as usize {
                return Err("HC weighted sum: hc must be n_hc × out, weights at least n_hc".into());
            }
            Ok(())
        }
        Op::HcPost { block, residual, split, out, n_hc } => {
            let n = len(block);
            f32b(residual, n * n_hc as usize)?;
            f32b(out, n * n_hc as usize)?;
            f32b(split, (2 * n_hc + n_hc * n_hc) as usize)
        }
        Op::HcHeadWeights { pre, scale, base, out, .. } => {
            let n = len(pre);
            f32b(out, n)?;
            if wlen(scale) != 1 || wlen(base) != n {
                return Err("head HC scale must have 1 and base n_hc elements".into());
            }
            Ok(())
        }
        Op::RopeTail { x, n_head, head_dim, n_rot, .. } => {
            if n_rot > head_dim || n_rot % 2 != 0 {
                return Err("n_rot must be even and at most head_dim".into());
            }
            f32b(x, (n_head * head_dim) as usize)
        }
        Op::Fp8RoundTrip { x, head_dim, n_rot } => {
            if (head_dim - n_rot) % 64 != 0 {
                return Err("non-RoPE dims must be a multiple of 64".into());
            }
            f32b(x, head_dim as usize)
        }
        Op::IndexerQat { x, rows, head_dim } => {
            if head_dim != 128 {
                return Err("the indexer QAT needs 128-wide rows".into());
            }
            f32b(x, (rows * head_dim) as usize)
        }
        Op::StoreRaw { kv, cache, row_dim, raw_cap } => {
            f32b(kv, row_dim as usize)?;
            f32b(cache, (row_dim * raw_cap) as usize)
        }
        Op::CompressorStore { kv, score, ape, state_kv, state_score, width, ratio } => {
            let rows = if ratio == 4 { 8 } else { ratio } as usize;
            f32b(kv, width as usize)?;
            f32b(score, width as usize)?;
            f32b(state_kv, rows * width as usize)?;
            f32b(state_score, rows * width as usize)?;
            if w(ape).dims != [width as u64, ratio as u64] {
                return Err(format!("ape has shape {:?}, expected [{width}, {ratio}]", w(ape).dims));
            }
            Ok(())
        }
        Op::CompressorPool { state_kv, state_score, out, head_dim, ratio } => {
            let (rows, width) = if ratio == 4 { (8, 2 * head_dim) } else { (ratio, head_dim) };
            f32b(state_kv, (rows * width) as usize)?;
            f32b(state_score, (rows * width) as usize)?;
            f32b(out, head_dim as usize)
        }
        Op::CompressorShift { state_kv, state_score, width, ratio } => {
            if ratio != 4 {
                return Err("only ratio 4 keeps two lanes to shift".into());
            }
            f32b(state_kv, 8 * width as usize)?;
            f32b(state_score, 8 * width as usize)
        }
        Op::StoreCompRow { row, cache, row_dim, .. } => {
            f32b(row, row_dim as usize)?;
            if len(cache) % row_dim as usize != 0 {
                return Err("cache length must be whole rows".into());
            }
            Ok(())
        }
        Op::IndexerScores { q, weights, cache, out, n_head, head_dim, rows, .. } => {
            f32b(q, (n_head * head_dim) as usize)?;
            f32b(weights, n_head as usize)?;
            f32b(cache, (rows.cap * head_dim) as usize)?;
            f32b(out, rows.cap as usize)
        }
        Op::IndexerTopK { scores, out, top_k, rows } => {
            f32b(scores, rows.cap as usize)?;
            i32b(out, top_k as usize)
        }
        Op::Attention { q, raw, comp, selected, top_k, sinks, out, n_head, head_dim, raw_rows, comp_rows } => {
            let qn = (n_head * head_dim) as usize;
            f32b(q, qn)?;
            f32b(out, qn)?;
            f32b(raw, (raw_rows.cap * head_dim) as usize)?;
            if let Some(c) = comp {
                f32b(c, (comp_rows.cap * head_dim) as usize)?;
            } else if comp_rows.cap != 0 {
                return Err("compressed rows without a compressed cache".into());
            }
            if let Some(s) = selected {
                i32b(s, top_k as usize)?;
            }
            if wlen(sinks) != n_head as usize {
                return Err("one sink per head".into());
            }
            Ok(())
        }
        Op::RouterSelect { logits, bias, hash, selected, weights, n_used, .. } => {
            let n = len(logits);
            i32b(selected, n_used as usize)?;
            f32b(weights, n_used as usize)?;
            if bias.is_some_and(|b| wlen(b) != n) {
                return Err("router bias must have one entry per expert".into());
            }
            if hash.is_some_and(|h| w(h).dim(0) != n_used as u64 || w(h).ty != GgmlType::I32) {
                return Err("hash table must be I32 [n_used, n_vocab]".into());
            }
            Ok(())
        }
        Op::MoeExperts { x, selected, weights, gate, up, down, out, .. } => {
            let (g, u, d) = (w(gate), w(up), w(down));
            if g.dims.len() != 3
                || g.dims != u.dims
                || d.dims.len() != 3
                || d.dim(0) != g.dim(1)
                || d.dim(2) != g.dim(2)
            {
                return Err("expert tensors must be [in, ff, n] gate/up and [ff, out, n] down".into());
            }
            f32b(x, g.dim(0) as usize)?;
            f32b(out, d.dim(1) as usize)?;
            if len(selected) != len(weights) {
                return Err("one weight per selected expert".into());
            }
            Ok(())
        }
        Op::SwiGlu { gate, up, out, .. } => {
            let n = len(gate);
            f32b(up, n)?;
            f32b(out, n)
        }
        Op::Add { a, b, out } => {
            let n = len(a);
            f32b(b, n)?;
            f32b(out, n)
        }
    }
}
