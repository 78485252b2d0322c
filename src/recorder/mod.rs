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

/// The per-step values: the only thing that changes between replays. Every other per-token
/// quantity (ring row, window length, compressed-row counts, emit flags) is derived from `pos`.
///
/// A decode step is one token: `token` at `pos`, `count == 1`. A prefill chunk (a program with
/// [`Program::rows`] > 1) covers `count` tokens at positions `pos .. pos + count`, whose ids the
/// host writes into the program's [`Program::tokens`] buffer; row `r` of the chunk is evaluated
/// with [`StepParams::row`]. The layout (four u32, 16 bytes) is what the GPU backends mirror.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StepParams {
    /// The token of a decode step (unused by a chunk: its tokens are in a buffer).
    pub token: u32,
    /// The position of a decode step, or of a chunk's first row.
    pub pos: u32,
    /// Always 0: the wgpu shaders read it as a zero the compiler cannot see through.
    pub _reserved: u32,
    /// Tokens in the step: 1 for a decode step, the chunk length (1 ..= rows) for a chunk.
    pub count: u32,
}

impl StepParams {
    /// A decode step: one token at `pos`.
    pub fn new(token: u32, pos: u32) -> Self {
        StepParams { token, pos, _reserved: 0, count: 1 }
    }
    /// A prefill chunk of `count` tokens starting at position `pos`.
    pub fn chunk(pos: u32, count: u32) -> Self {
        StepParams { token: 0, pos, _reserved: 0, count }
    }
    /// The parameters row `r` of a chunk is evaluated with: a decode step of `token` at `pos + r`.
    /// Predicates and bounds are evaluated per row from these, exactly as for a decode step.
    pub fn row(&self, r: u32, token: u32) -> Self {
        StepParams::new(token, self.pos + r)
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

/// A buffer: `rows` rows of `len` values. A decode program's buffers have one row; a chunk
/// program's scratch has one row per token of the chunk (row `r` is the decode step's buffer for
/// the chunk's row `r`), and its state, shared with the decode program, has one row.
#[derive(Debug, Clone, PartialEq)]
pub struct BufDesc {
    pub name: String,
    pub dtype: DType,
    /// Values per row: what every op's sizes are checked against.
    pub len: usize,
    pub kind: BufKind,
    pub rows: u32,
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
///
/// In a chunk program every op means "for each row `r < count`, with [`StepParams::row`]: the
/// decode op on row `r` of each scratch buffer" (the predicate is evaluated per row too). A step
/// with `seq: None` runs for all rows before the next step starts: its rows are independent, so
/// a backend may batch them (a matrix-matrix product reads each weight once per chunk). Steps
/// that share `seq: Some(k)` form a **row loop**: row 0 runs all of them, then row 1, and so on,
/// because they carry state from one position to the next (the compressor window). In a decode
/// program (one row) both mean the same.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub op: Op,
    pub cond: Option<Cond>,
    pub seq: Option<u32>,
}

/// An immutable recorded token program.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    buffers: Vec<BufDesc>,
    weights: Vec<TensorInfo>,
    steps: Vec<Step>,
    logits: Buf,
    positions: u32,
    rows: u32,
    tokens: Option<Buf>,
    fingerprint: u64,
}

impl Program {
    /// Token rows per step: 1 for a decode program, the chunk capacity T for a chunk program.
    pub fn rows(&self) -> u32 {
        self.rows
    }
    /// A chunk program's I32 buffer of token ids (one per row), written by the host before each
    /// chunk; `None` for a decode program, which takes its token from `StepParams`.
    pub fn tokens(&self) -> Option<Buf> {
        self.tokens
    }
    /// The state buffers (KV ring, compressed caches, compressor windows), by name.
    pub fn state_buffers(&self) -> impl Iterator<Item = (Buf, &BufDesc)> + '_ {
        self.buffers
            .iter()
            .enumerate()
            .filter(|(_, d)| matches!(d.kind, BufKind::State { .. }))
            .map(|(i, d)| (Buf(i as u32), d))
    }
    /// Pairs each state buffer of `self` with the state buffer of `other` that has its name, so
    /// that two programs of one session (decode and chunk) run on the same state. Refuses
    /// programs whose state differs in any buffer's name, type, length or initial value.
    pub fn state_binding(&self, other: &Program) -> Result<Vec<(Buf, Buf)>, String> {
        let theirs: HashMap<&str, (Buf, &BufDesc)> =
            other.state_buffers().map(|(b, d)| (d.name.as_str(), (b, d))).collect();
        let mut out = Vec::new();
        for (b, d) in self.state_buffers() {
            match theirs.get(d.name.as_str()) {
                Some(&(ob, od)) if od == d => out.push((b, ob)),
                Some((_, od)) => return Err(format!("state buffer '{}' differs: {d:?} and {od:?}", d.name)),
                None => return Err(format!("state buffer '{}' is missing from the other program", d.name)),
            }
        }
        if out.len() != theirs.len() {
            return Err(format!("the programs have {} and {} state buffers", out.len(), theirs.len()));
        }
        Ok(out)
    }
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
        self.buffers.iter().map(|b| b.len as u64 * b.rows as u64 * 4).sum()
    }
    /// Vocabulary size: the length of the logits buffer.
    pub fn n_vocab(&self) -> usize {
        self.buffer(self.logits).len
    }
    /// Refuses parameters the program cannot run: a position at or beyond the context it was
    /// recorded for (the caches would be written past their rows), or a token outside the
    /// vocabulary (the embedding and hash tables would be read out of bounds).
    pub fn check_params(&self, p: &StepParams) -> Result<(), String> {
        if self.rows > 1 {
            return Err("this is a chunk program: a step of it needs its tokens (check_chunk)".into());
        }
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
    /// Refuses a chunk the program cannot run: no tokens or more than its rows, positions past
    /// its context, or a token outside the vocabulary.
    pub fn check_chunk(&self, p: &StepParams, tokens: &[u32]) -> Result<(), String> {
        if self.tokens.is_none() {
            return Err("this is a decode program, not a chunk program".into());
        }
        if p.count == 0 || p.count > self.rows || tokens.len() != p.count as usize {
            return Err(format!(
                "a chunk of {} tokens ({} given) does not fit this program's 1 ..= {} rows",
                p.count,
                tokens.len(),
                self.rows
            ));
        }
        let end = p.pos as u64 + p.count as u64;
        if end > self.positions as u64 {
            return Err(format!(
                "positions {} .. {end} reach outside the context of {} positions this program was recorded for",
                p.pos, self.positions
            ));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.n_vocab()) {
            return Err(format!("token id {t} is outside the vocabulary ({} tokens)", self.n_vocab()));
        }
        Ok(())
    }
    /// Ops that run for `p` (their predicates hold).
    pub fn active_steps<'a>(&'a self, p: &'a StepParams) -> impl Iterator<Item = &'a Op> + 'a {
        self.steps.iter().filter(move |s| s.cond.is_none_or(|c| c.eval(p))).map(|s| &s.op)
    }
}

/// Builds a [`Program`].
pub struct Recorder {
    buffers: Vec<BufDesc>,
    weights: Vec<TensorInfo>,
    weight_index: HashMap<String, WeightId>,
    steps: Vec<Step>,
    cond: Option<Cond>,
    rows: u32,
    seq: Option<u32>,
    loops: u32,
    tokens: Option<Buf>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::with_rows(1)
    }
}

impl Recorder {
    /// A decode program's recorder: one token per step.
    pub fn new() -> Self {
        Self::default()
    }

    /// A chunk program's recorder: up to `rows` tokens per step (at least 1). With more than one
    /// row it holds the chunk's token ids in an I32 buffer ([`Program::tokens`]).
    pub fn with_rows(rows: u32) -> Self {
        let mut rec = Recorder {
            buffers: Vec::new(),
            weights: Vec::new(),
            weight_index: HashMap::new(),
            steps: Vec::new(),
            cond: None,
            rows: rows.max(1),
            seq: None,
            loops: 0,
            tokens: None,
        };
        if rec.rows > 1 {
            rec.tokens = Some(rec.buffer("chunk_tokens", DType::I32, 1));
        }
        rec
    }

    /// Token rows per step.
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// A per-token scratch buffer of `len` elements (one row of them per token of a chunk).
    pub fn buffer(&mut self, name: &str, dtype: DType, len: usize) -> Buf {
        self.add(name, dtype, len, BufKind::Scratch, self.rows)
    }

    /// A state buffer that persists across tokens, filled with `init` at session start.
    pub fn state(&mut self, name: &str, dtype: DType, len: usize, init: f32) -> Buf {
        self.add(name, dtype, len, BufKind::State { init }, 1)
    }

    fn add(&mut self, name: &str, dtype: DType, len: usize, kind: BufKind, rows: u32) -> Buf {
        self.buffers.push(BufDesc { name: name.to_string(), dtype, len, kind, rows });
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
        self.steps.push(Step { op, cond: self.cond, seq: self.seq });
    }

    /// Records the ops that `f` pushes under `cond`. Predicates do not nest.
    pub fn when(&mut self, cond: Cond, f: impl FnOnce(&mut Recorder)) {
        assert!(self.cond.is_none(), "recorder predicates do not nest");
        self.cond = Some(cond);
        f(self);
        self.cond = None;
    }

    /// Records the ops that `f` pushes as one row loop ([`Step::seq`]): in a chunk they run row
    /// by row, in order, because each row reads state the previous rows wrote. Loops do not nest;
    /// a `when` may sit inside one.
    pub fn in_order(&mut self, f: impl FnOnce(&mut Recorder)) {
        assert!(self.seq.is_none(), "row loops do not nest");
        self.seq = Some(self.loops);
        self.loops += 1;
        f(self);
        self.seq = None;
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
            rows: self.rows,
            tokens: self.tokens,
            fingerprint: 0,
        };
        for (i, s) in p.steps.iter().enumerate() {
            validate(&p, &s.op).map_err(|e| format!("op #{i} ({}): {e}", s.op.name()))?;
        }
        let mut h = DefaultHasher::new();
        format!("{:?}|{:?}|{:?}|{:?}|{}|{}", p.buffers, p.weights, p.steps, p.logits, p.positions, p.rows).hash(&mut h);
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
