//! The CPU backend: interprets a [`Program`] op by op. It is the reference the other backends
//! are checked against, so each op reads like its definition and follows ds4's CPU numerics.

mod ops;

use std::sync::Arc;

use crate::backend::{Backend, BackendError, Executable};
use crate::model::Model;
use crate::numerics::Numerics;
use crate::recorder::{Buf, BufKind, DType, Program, Step, StepParams};

pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    numerics: Numerics,
}

impl CpuBackend {
    /// `threads == 0` uses every core. Computes in the `ds4` profile: ds4's own numbers.
    pub fn new(threads: usize) -> Result<Self, BackendError> {
        Self::with_numerics(threads, Numerics::Ds4)
    }

    /// With `Numerics::Canonical`, the results match the GPU backends bit for bit.
    pub fn with_numerics(threads: usize, numerics: Numerics) -> Result<Self, BackendError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ds4-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::new("cpu", format!("cannot start worker threads: {e}")))?;
        Ok(CpuBackend { pool: Arc::new(pool), numerics })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

/// Prompt tokens per prefill chunk by default: enough rows for each weight read to serve many
/// tokens, few enough that the chunk's scratch stays small.
pub const DEFAULT_PREFILL_CHUNK: usize = 64;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn numerics(&self) -> Numerics {
        self.numerics
    }
    fn default_prefill_chunk(&self) -> usize {
        DEFAULT_PREFILL_CHUNK
    }

    fn compile(&self, program: Arc<Program>, model: Arc<Model>) -> Result<Box<dyn Executable>, BackendError> {
        if !model.file.has_data() {
            return Err(BackendError::new(
                "cpu",
                format!(
                    "{} has no weights in host memory; it runs on --backend cuda, which draws them",
                    model.file.name()
                ),
            ));
        }
        for t in program.weights() {
            if !t.ty.is_supported() {
                return Err(BackendError::new("cpu", format!("tensor '{}' has unsupported type {:?}", t.name, t.ty)));
            }
        }
        let need = program.buffer_bytes();
        if let Some(avail) = available_memory() {
            if need > avail {
                return Err(BackendError::new(
                    "cpu",
                    format!(
                        "the buffers and caches for {} positions need {:.2} GB, but only {:.2} GB of memory are available; \
                         use a smaller --ctx",
                        program.positions(),
                        need as f64 / 1e9,
                        avail as f64 / 1e9
                    ),
                ));
            }
        }
        let bufs = allocate(&program);
        let vectors = vec![None; program.weights().len()];
        let math = ops::Math::new(self.numerics);
        let mut exe = CpuExecutable { program, model, pool: self.pool.clone(), bufs, vectors, math, chunk: None };
        exe.reset()?;
        Ok(Box::new(exe))
    }
}

fn allocate(program: &Program) -> Vec<Data> {
    program
        .buffers()
        .iter()
        .map(|d| match d.dtype {
            DType::F32 => Data::F32(vec![0.0; d.len * d.rows as usize]),
            DType::I32 => Data::I32(vec![0; d.len * d.rows as usize]),
        })
        .collect()
}

/// One buffer's contents.
pub(crate) enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

pub struct CpuExecutable {
    program: Arc<Program>,
    model: Arc<Model>,
    pool: Arc<rayon::ThreadPool>,
    bufs: Vec<Data>,
    vectors: Vec<Option<Arc<[f32]>>>,
    math: ops::Math,
    chunk: Option<Chunk>,
}

/// An attached chunk program: its own scratch, and the decode program's state.
struct Chunk {
    program: Arc<Program>,
    /// Its buffers; the state entries are empty: the decode program's are moved in for a chunk.
    bufs: Vec<Data>,
    vectors: Vec<Option<Arc<[f32]>>>,
    /// (chunk program buffer, decode program buffer) for each state buffer.
    state: Vec<(Buf, Buf)>,
    /// Tokens in the last chunk run.
    count: usize,
}

impl CpuExecutable {
    /// Runs the attached chunk program's steps: batch steps for all rows whose predicate holds,
    /// row loops row by row (`recorder::Step`).
    fn run_chunk(&mut self, params: &StepParams, tokens: &[u32]) -> Result<(), BackendError> {
        let err = |e: String| BackendError::new("cpu", e);
        let Some(chunk) = self.chunk.as_mut() else {
            return Err(err("no chunk program is attached".into()));
        };
        let program = chunk.program.clone();
        program.check_chunk(params, tokens).map_err(err)?;
        let tb = program.tokens().ok_or_else(|| err("the chunk program has no token buffer".into()))?;
        if let Data::I32(v) = &mut chunk.bufs[tb.0 as usize] {
            v.iter_mut().zip(tokens).for_each(|(d, &t)| *d = t as i32);
        }
        let rows: Vec<StepParams> = tokens.iter().enumerate().map(|(r, &t)| params.row(r as u32, t)).collect();
        // The session's state moves into the chunk program for the chunk and back after it.
        for &(c, d) in &chunk.state {
            std::mem::swap(&mut chunk.bufs[c.0 as usize], &mut self.bufs[d.0 as usize]);
        }
        let mut ctx = ops::Ctx {
            program: &program,
            model: &self.model,
            bufs: &mut chunk.bufs,
            vectors: &mut chunk.vectors,
            p: rows[0],
            row: 0,
            math: self.math,
        };
        let steps = program.steps();
        let r = self.pool.install(|| {
            let mut i = 0;
            while i < steps.len() {
                let named = |s: &Step, e: String| err(format!("{}: {e}", s.op.name()));
                match steps[i].seq {
                    None => {
                        let s = &steps[i];
                        let active: Vec<usize> =
                            (0..rows.len()).filter(|&r| s.cond.is_none_or(|c| c.eval(&rows[r]))).collect();
                        ctx.run_rows(&s.op, &active, &rows).map_err(|e| named(s, e))?;
                        i += 1;
                    }
                    Some(k) => {
                        let end = i + steps[i..].iter().take_while(|s| s.seq == Some(k)).count();
                        for (r, p) in rows.iter().enumerate() {
                            (ctx.row, ctx.p) = (r, *p);
                            for s in steps[i..end].iter().filter(|s| s.cond.is_none_or(|c| c.eval(p))) {
                                ctx.run(&s.op).map_err(|e| named(s, e))?;
                            }
                        }
                        i = end;
                    }
                }
            }
            Ok(())
        });
        for &(c, d) in &chunk.state {
            std::mem::swap(&mut chunk.bufs[c.0 as usize], &mut self.bufs[d.0 as usize]);
        }
        chunk.count = tokens.len();
        r?;
        // The decode program's logits are the last token's, as after a decode step.
        let n_vocab = self.program.n_vocab();
        let last = tokens.len() - 1;
        if let (Data::F32(c), Data::F32(d)) =
            (&chunk.bufs[program.logits().0 as usize], &mut self.bufs[self.program.logits().0 as usize])
        {
            d.copy_from_slice(&c[last * n_vocab..(last + 1) * n_vocab]);
        }
        Ok(())
    }
}

impl Executable for CpuExecutable {
    fn program(&self) -> &Arc<Program> {
        &self.program
    }

    fn step(&mut self, params: &StepParams) -> Result<(), BackendError> {
        self.step_ops(params, 0..usize::MAX)
    }

    fn step_ops(&mut self, params: &StepParams, ops: std::ops::Range<usize>) -> Result<(), BackendError> {
        let program = self.program.clone();
        program.check_params(params).map_err(|e| BackendError::new("cpu", e))?;
        let mut ctx = ops::Ctx {
            program: &program,
            model: &self.model,
            bufs: &mut self.bufs,
            vectors: &mut self.vectors,
            p: *params,
            row: 0,
            math: self.math,
        };
        self.pool.install(|| {
            for s in program.steps().iter().take(ops.end).skip(ops.start) {
                if s.cond.is_none_or(|c| c.eval(params)) {
                    ctx.run(&s.op).map_err(|e| BackendError::new("cpu", format!("{}: {e}", s.op.name())))?;
                }
            }
            Ok(())
        })
    }

    fn read_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
        *out = self.read_buffer(self.program.logits())?;
        Ok(())
    }

    fn attach_chunk(&mut self, chunk: Arc<Program>) -> Result<(), BackendError> {
        let err = |e: String| BackendError::new("cpu", e);
        if chunk.tokens().is_none() {
            return Err(err("a chunk program needs more than one row".into()));
        }
        if chunk.positions() != self.program.positions() || chunk.n_vocab() != self.program.n_vocab() {
            return Err(err("the chunk program was recorded for another context or model".into()));
        }
        let state = chunk.state_binding(&self.program).map_err(|e| err(format!("chunk program: {e}")))?;
        let mut bufs = allocate(&chunk);
        for &(c, _) in &state {
            bufs[c.0 as usize] = Data::F32(Vec::new());
        }
        let vectors = vec![None; chunk.weights().len()];
        self.chunk = Some(Chunk { program: chunk, bufs, vectors, state, count: 0 });
        Ok(())
    }

    fn step_chunk(&mut self, params: &StepParams, tokens: &[u32]) -> Result<(), BackendError> {
        self.run_chunk(params, tokens)
    }

    fn read_chunk_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
        let chunk = self.chunk.as_ref().ok_or_else(|| BackendError::new("cpu", "no chunk program is attached"))?;
        let n = chunk.count * chunk.program.n_vocab();
        match &chunk.bufs[chunk.program.logits().0 as usize] {
            Data::F32(v) => *out = v[..n].to_vec(),
            Data::I32(_) => return Err(BackendError::new("cpu", "the logits buffer is not F32")),
        }
        Ok(())
    }

    fn read_buffer(&mut self, buf: Buf) -> Result<Vec<f32>, BackendError> {
        match self.bufs.get(buf.0 as usize) {
            Some(Data::F32(v)) => Ok(v.clone()),
            Some(Data::I32(v)) => Ok(v.iter().map(|&x| x as f32).collect()),
            None => Err(BackendError::new("cpu", format!("no buffer {}", buf.0))),
        }
    }

    fn profile(&mut self, params: &StepParams) -> Result<Vec<(String, f64)>, BackendError> {
        let mut times = Vec::new();
        for (i, s) in self.program.clone().steps().iter().enumerate() {
            if s.cond.is_none_or(|c| c.eval(params)) {
                let t0 = std::time::Instant::now();
                self.step_ops(params, i..i + 1)?;
                times.push((s.op.name().to_string(), t0.elapsed().as_secs_f64() * 1e6));
            }
        }
        Ok(crate::backend::summarize_profile(times))
    }

    fn write_buffer(&mut self, buf: Buf, data: &[f32]) -> Result<(), BackendError> {
        match self.bufs.get_mut(buf.0 as usize) {
            Some(Data::F32(v)) if v.len() == data.len() => v.copy_from_slice(data),
            Some(Data::I32(v)) if v.len() == data.len() => v.iter_mut().zip(data).for_each(|(d, &x)| *d = x as i32),
            _ => return Err(BackendError::new("cpu", format!("buffer {} does not take {} values", buf.0, data.len()))),
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), BackendError> {
        for (d, b) in self.program.buffers().iter().zip(self.bufs.iter_mut()) {
            let init = match d.kind {
                BufKind::State { init } => init,
                BufKind::Scratch => 0.0,
            };
            match b {
                Data::F32(v) => v.fill(init),
                Data::I32(v) => v.fill(init as i32),
            }
        }
        Ok(())
    }
}

/// Bytes of memory available for new allocations (Linux `MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
