//! The `Backend` and `Executable` traits, and backend selection.

use std::fmt;
use std::sync::Arc;

use crate::model::Model;
use crate::recorder::{Buf, Program, StepParams};
use crate::sample::DeviceSample;

/// A backend failure. The message says what failed and, where it can, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{backend} backend: {msg}")]
pub struct BackendError {
    pub backend: &'static str,
    pub msg: String,
}

impl BackendError {
    pub fn new(backend: &'static str, msg: impl Into<String>) -> Self {
        BackendError { backend, msg: msg.into() }
    }
}

/// Compiles a recorded program into something that runs it.
pub trait Backend {
    fn name(&self) -> &'static str;
    /// The numerics profile it computes in (`crate::numerics`).
    fn numerics(&self) -> crate::numerics::Numerics;
    /// Prepares everything once: buffers, pipelines or kernels, uploaded weights.
    fn compile(&self, program: Arc<Program>, model: Arc<Model>) -> Result<Box<dyn Executable>, BackendError>;
    /// The device it runs on, where that says more than the name (the wgpu adapter and its API).
    fn describe(&self) -> Option<String> {
        None
    }
    /// Prompt tokens per prefill chunk when the user does not say. 1 means the backend has no
    /// chunk programs ([`Executable::attach_chunk`]) and prefills token by token.
    fn default_prefill_chunk(&self) -> usize {
        1
    }
}

/// What a backend without chunk programs says when asked for one.
pub const NO_CHUNK_PROGRAMS: &str = "this backend runs no chunk programs (batched prefill)";

/// A compiled program, replayed once per token.
pub trait Executable {
    /// The program this executable runs; it never changes after `compile`.
    fn program(&self) -> &Arc<Program>;
    /// Runs one token with these parameters. A position at or beyond the program's context, or a
    /// token outside the vocabulary, is refused before anything runs ([`Program::check_params`]).
    fn step(&mut self, params: &StepParams) -> Result<(), BackendError>;
    /// Compiles a chunk program (a prefill chunk of up to `chunk.rows()` tokens, recorded for the
    /// same session shape as this executable's program) to run on this executable's state: the
    /// two programs share their state buffers (paired by name, [`Program::state_binding`]),
    /// nothing is copied between them. Backends without chunk programs refuse.
    fn attach_chunk(&mut self, chunk: Arc<Program>) -> Result<(), BackendError> {
        let _ = chunk;
        Err(BackendError::new("backend", NO_CHUNK_PROGRAMS))
    }
    /// Runs the attached chunk program on `tokens` at positions `params.pos ..` (`params.count ==
    /// tokens.len()`; [`StepParams::chunk`]). Afterwards the program's logits buffer holds the
    /// logits of the chunk's last token, as if it had been fed by [`Executable::step`].
    fn step_chunk(&mut self, params: &StepParams, tokens: &[u32]) -> Result<(), BackendError> {
        let _ = (params, tokens);
        Err(BackendError::new("backend", NO_CHUNK_PROGRAMS))
    }
    /// The logits of every token of the last chunk, row after row (`count × vocabulary`).
    fn read_chunk_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
        let _ = out;
        Err(BackendError::new("backend", NO_CHUNK_PROGRAMS))
    }
    /// Runs only the recorded ops `ops` (by index) of a step, eagerly. For bisecting a difference
    /// between backends (`ds4 check --bisect`); a normal token uses `step`.
    fn step_ops(&mut self, params: &StepParams, ops: std::ops::Range<usize>) -> Result<(), BackendError>;
    /// Runs one token eagerly, timing it piece by piece: (kernel or op name, microseconds)
    /// summed per name, slowest first. For `ds4 bench --profile`.
    fn profile(&mut self, params: &StepParams) -> Result<Vec<(String, f64)>, BackendError>;
    /// Runs the attached chunk program on `tokens` (as [`Executable::step_chunk`]) eagerly, timing
    /// it launch by launch like [`Executable::profile`]. For `ds4 bench --profile --prefill N`.
    fn profile_chunk(&mut self, params: &StepParams, tokens: &[u32]) -> Result<Vec<(String, f64)>, BackendError> {
        let _ = (params, tokens);
        Err(BackendError::new("backend", "this backend does not time chunk programs"))
    }
    /// Runs `tokens` steps at `params` as [`Executable::step`] runs them (a replayed graph when
    /// one is captured), noting in-kernel timestamps: each launch's times, averaged. `Ok(None)`
    /// where the backend was not built to trace (CUDA: `DS4_CUDA_TRACE=1`). For `ds4 bench
    /// --profile`.
    fn trace(&mut self, params: &StepParams, tokens: usize) -> Result<Option<Vec<TraceLaunch>>, BackendError> {
        let _ = (params, tokens);
        Ok(None)
    }
    /// Overwrites a buffer (f32 values; I32 buffers take them as integers). For diagnostics.
    fn write_buffer(&mut self, buf: Buf, data: &[f32]) -> Result<(), BackendError>;
    /// Samples the token that follows the last step on the device and returns only its id, where
    /// the backend can; `Ok(None)` means it does not, and the caller reads the logits and samples
    /// on the host with [`crate::sample::pick`], which gives the same token for the same `s`.
    fn sample(&mut self, s: &DeviceSample) -> Result<Option<u32>, BackendError> {
        let _ = s;
        Ok(None)
    }
    /// Whether [`Executable::sample_then_step`] runs here.
    fn samples_then_steps(&self) -> bool {
        false
    }
    /// Samples the token after the last step on the device ([`Executable::sample`]) and runs the
    /// step that feeds it at position `pos` there too, queued before the id comes back: the host
    /// reads the id while that step runs. Backends where [`Executable::samples_then_steps`] is
    /// false refuse it, having run nothing.
    fn sample_then_step(&mut self, s: &DeviceSample, pos: u32) -> Result<u32, BackendError> {
        let _ = (s, pos);
        Err(BackendError::new("backend", "does not sample and step on the device"))
    }
    /// Copies the logits of the last step into `out` (resized to the vocabulary).
    fn read_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError>;
    /// Reads any buffer as f32 values (I32 buffers are converted). For tests and diagnostics.
    fn read_buffer(&mut self, buf: Buf) -> Result<Vec<f32>, BackendError>;
    /// Refills every state buffer with its initial value (a fresh context).
    fn reset(&mut self) -> Result<(), BackendError>;
    /// Device-to-device copy bandwidth in GB/s (bytes read plus written), measured now, where the
    /// backend has device memory: the ceiling a weight-streaming token is compared with.
    fn copy_bandwidth(&mut self) -> Option<f64> {
        None
    }
    /// Kernel launches (graph nodes) per token, where the backend launches kernels.
    fn nodes_per_token(&self) -> Option<usize> {
        None
    }
    /// A test hook: make the next graph capture, or the graph launch of one token, fail as a
    /// driver error would, to check that the fallback loses nothing. Backends without graphs
    /// refuse it.
    fn inject_graph_failure(&mut self, f: GraphFailure) -> Result<(), BackendError> {
        let _ = f;
        Err(BackendError::new("backend", "has no graphs to make fail"))
    }
    /// What loading decided and measured (for example where the weights went, and how fast
    /// they were uploaded), for the caller to print once.
    fn load_report(&self) -> Option<String> {
        None
    }
    /// Expert cache counters since the start, where routed experts are cached (placement "host").
    fn expert_cache_stats(&mut self) -> Option<ExpertCacheStats> {
        None
    }
    /// Diagnostics since the last call (for example a CUDA graph that fell back to eager
    /// launches). Library code never prints; the caller decides where these go.
    fn take_warnings(&mut self) -> Vec<String> {
        Vec::new()
    }
}

/// Expert cache counters (per used expert of a token's layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertCacheStats {
    /// Found in a cache slot.
    pub hits: u64,
    /// Copied into a slot from host memory.
    pub copies: u64,
    /// Read from host memory in place (no slot free).
    pub direct: u64,
    /// Bytes of one expert (gate, up and down), what a copy or a direct read moves over the bus.
    pub expert_bytes: u64,
}

/// Where the graph-failure test hook strikes ([`Executable::inject_graph_failure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphFailure {
    /// The capture (and instantiation) after the warm-up token.
    Capture,
    /// The graph launch of the step with this index (0 is the executable's first step).
    Launch { at_token: u64 },
}

/// The backends a user can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Wgpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(BackendKind::Cpu),
            "wgpu" => Ok(BackendKind::Wgpu),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(format!("unknown backend '{other}' (expected cpu, wgpu or cuda)")),
        }
    }
}

/// Options that some backends use.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackendOptions {
    /// CPU worker threads (0: all cores).
    pub threads: usize,
    /// CUDA: capture the token as one graph (true) or launch eagerly.
    pub graphs: bool,
    /// The numerics profile (`ds4` or `canonical`). The GPU backends implement only
    /// `canonical` and refuse anything else.
    pub numerics: crate::numerics::Numerics,
    /// CUDA: the device memory budget and a forced placement of the weights (src/placement.rs).
    pub placement: crate::placement::PlacementRequest,
    /// Called while weights load with (bytes done, bytes in all), for a progress bar.
    pub load_progress: Option<fn(u64, u64)>,
}

/// Creates a backend of `kind`. A backend this build or machine lacks is an error that says so.
pub fn create(kind: BackendKind, opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(crate::backends::cpu::CpuBackend::with_numerics(opts.threads, opts.numerics)?)),
        BackendKind::Wgpu => crate::backends::wgpu::create(opts),
        BackendKind::Cuda => crate::backends::cuda::create(opts),
    }
}

/// One launch of a traced token ([`Executable::trace`]): microseconds from the moment the token's
/// first launch could start work (its first block past its wait), averaged over the tokens.
#[derive(Clone, Debug, Default)]
pub struct TraceLaunch {
    /// The kernel, or a fused launch's kernel and ops.
    pub label: String,
    /// On the side stream: its launches form a chain of their own beside the main one.
    pub side: bool,
    /// The first block started (resident, before it waits for the launch before).
    pub entry: f64,
    /// The first block passed that wait: the launch's inputs were ready.
    pub ready: f64,
    /// The last block passed it.
    pub last_ready: f64,
    /// Points the kernel chose to note (its trace slots 3..7), where it noted them.
    pub marks: [Option<f64>; 5],
}

/// A traced token's launches summed per label ([`summarize_trace`]).
#[derive(Clone, Debug, Default)]
pub struct TraceRow {
    pub label: String,
    pub launches: usize,
    /// Summed share of its chain's critical path, us.
    pub path: f64,
    /// Summed time its first block was resident before its inputs were ready, us.
    pub ahead: f64,
    /// Summed time from its first to its last block past the wait, us.
    pub spread: f64,
    /// Per slot 3..7: summed time after ready, and how many launches noted it.
    pub marks: [(f64, usize); 5],
}

/// A traced token per label, the costliest first, and each chain's length (main, side), us.
#[derive(Clone, Debug, Default)]
pub struct TraceSummary {
    pub rows: Vec<TraceRow>,
    pub chains: [f64; 2],
}

/// Sums a traced token's launches per label: each launch's share of its chain's critical path is
/// the time from its inputs being ready to the next launch's on the same stream (so it includes
/// its own drain and the next launch's start); a chain's last launch gets none.
pub fn summarize_trace(launches: &[TraceLaunch]) -> TraceSummary {
    let mut sum = TraceSummary::default();
    for (i, l) in launches.iter().enumerate() {
        let next = launches[i + 1..].iter().find(|m| m.side == l.side);
        let path = next.map_or(0.0, |m| m.ready - l.ready);
        sum.chains[l.side as usize] += path;
        let label = if l.side { format!("{} (side)", l.label) } else { l.label.clone() };
        let at = match sum.rows.iter().position(|r| r.label == label) {
            Some(at) => at,
            None => {
                sum.rows.push(TraceRow { label, ..TraceRow::default() });
                sum.rows.len() - 1
            }
        };
        let r = &mut sum.rows[at];
        r.launches += 1;
        r.path += path;
        r.ahead += l.ready - l.entry;
        r.spread += l.last_ready - l.ready;
        for (m, v) in r.marks.iter_mut().zip(&l.marks) {
            if let Some(v) = v {
                *m = (m.0 + v - l.ready, m.1 + 1);
            }
        }
    }
    sum.rows.sort_by(|a, b| b.path.total_cmp(&a.path));
    sum
}

impl TraceSummary {
    /// The table `ds4 bench --profile` prints.
    pub fn lines(&self) -> Vec<String> {
        let launches: usize = self.rows.iter().map(|r| r.launches).sum();
        let mut out = vec![
            format!(
                "trace      {launches} launches; the main chain from its first launch ready to its last: {:.1} us, \
                 the side chain {:.1} us",
                self.chains[0], self.chains[1]
            ),
            format!(
                "  {:44} {:>5} {:>9} {:>7} {:>7} {:>7}  marks (us after ready: slot:us)",
                "launch", "n", "path us", "each", "ahead", "spread"
            ),
        ];
        for r in &self.rows {
            let n = r.launches as f64;
            let marks: Vec<String> = (r.marks.iter().enumerate())
                .filter(|(_, m)| m.1 > 0)
                .map(|(k, m)| format!("{}:{:.1}", k + 3, m.0 / m.1 as f64))
                .collect();
            out.push(format!(
                "  {:44} {:5} {:9.1} {:7.2} {:7.2} {:7.2}  {}",
                r.label,
                r.launches,
                r.path,
                r.path / n,
                r.ahead / n,
                r.spread / n,
                marks.join(" ")
            ));
        }
        out
    }
}

/// Sums (name, time) pairs per name, slowest first; a name timed more than once gets its count
/// and the time of one (`router_select x4, 12.5 each`).
pub fn summarize_profile(items: impl IntoIterator<Item = (String, f64)>) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64, usize)> = Vec::new();
    for (name, t) in items {
        match out.iter_mut().find(|(n, _, _)| *n == name) {
            Some((_, total, count)) => {
                *total += t;
                *count += 1;
            }
            None => out.push((name, t, 1)),
        }
    }
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out.into_iter()
        .map(|(name, t, n)| if n > 1 { (format!("{name} x{n}, {:.1} each", t / n as f64), t) } else { (name, t) })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(label: &str, side: bool, entry: f64, ready: f64) -> TraceLaunch {
        TraceLaunch { label: label.into(), side, entry, ready, last_ready: ready + 1.0, marks: [None; 5] }
    }

    /// Each chain's shares add up to its span from first to last ready, whatever the side
    /// launches interleaved with it, and a label's launches are summed.
    #[test]
    fn trace_shares_add_up_to_each_chain() {
        let mut t = vec![
            launch("a", false, -3.0, 0.0),
            launch("s", true, 1.0, 2.0),
            launch("b", false, 4.0, 10.0),
            launch("u", true, 3.0, 5.0),
            launch("a", false, 20.0, 25.0),
            launch("c", false, 25.0, 31.0),
        ];
        t[2].marks[1] = Some(12.5);
        let s = summarize_trace(&t);
        assert_eq!(s.chains, [31.0, 3.0]);
        let row = |l: &str| s.rows.iter().find(|r| r.label == l).unwrap().clone();
        assert_eq!((row("a").launches, row("a").path, row("a").ahead), (2, 16.0, 8.0));
        assert_eq!((row("b").path, row("b").marks[1]), (15.0, (2.5, 1)));
        assert_eq!(row("s (side)").path, 3.0);
        assert_eq!((row("c").path, row("u (side)").path), (0.0, 0.0));
        assert_eq!(s.rows[0].label, "a");
        assert_eq!(s.rows.iter().map(|r| r.path).sum::<f64>(), 34.0);
    }
}
