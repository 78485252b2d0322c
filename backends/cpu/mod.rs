//! The CPU backend: interprets a [`Program`] op by op. It is the reference the other backends
//! are checked against, so each op reads like its definition and follows ds4's CPU numerics.

mod ops;

use std::sync::Arc;

use crate::backend::{Backend, BackendError, Executable};
use crate::model::Model;
use crate::numerics::Numerics;
use crate::recorder::{Buf, BufKind, DType, Program, StepParams};

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

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn numerics(&self) -> Numerics {
        self.numerics
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
        let bufs = program
            .buffers()
            .iter()
            .map(|d| match d.dtype {
                DType::F32 => Data::F32(vec![0.0; d.len]),
                DType::I32 => Data::I32(vec![0; d.len]),
            })
            .collect();
        let vectors = vec![None; program.weights().len()];
        let math = ops::Math::new(self.numerics);
        let mut exe = CpuExecutable { program, model, pool: self.pool.clone(), bufs, vectors, math };
        exe.reset()?;
        Ok(Box::new(exe))
    }
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
