//! The `ds4` command line: run, serve, check, bench, inspect, synth, tokenize.

mod serve;

use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use ds4::backend::{Backend, BackendKind};
use ds4::engine::{self, open_gguf, BackendChoice, Engine, Event, GenParams, ModelSource, EMBEDDED_SEED};
use ds4::model::{IndexerReads, Model};
use ds4::numerics::Numerics;
use ds4::sample::{self as sampling, SamplerConfig};
use ds4::session::Session;
use ds4::synth::{self, Preset};
use ds4::tokenizer::{ThinkMode, Tokenizer};

/// Prints a line to stdout and returns an error when stdout is gone (e.g. closed by `| head`);
/// `main` ends quietly with success on that error, as Unix tools do.
macro_rules! out {
    ($($arg:tt)*) => { writeln!(std::io::stdout(), $($arg)*)? };
}

#[derive(Parser)]
#[command(name = "ds4", version, about = "A Rust runtime for DeepSeek V4 Flash GGUF files", args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text (or token ids) from a prompt.
    Run(RunArgs),
    /// Serve the model over HTTP: OpenAI's chat completions and Anthropic's messages APIs.
    Serve(ServeArgs),
    /// Compare one backend's logits against another backend or a reference file.
    Check(CheckArgs),
    /// Measure prefill and decode speed (greedy decode, sampled as `run` samples).
    Bench(BenchArgs),
    /// Describe a model file.
    Inspect {
        /// GGUF model file to describe.
        #[arg(short, long)]
        model: PathBuf,
        /// Also print where the weights would go with this much device memory (e.g. 22G, 512M;
        /// binary units), as the CUDA backend plans it at load.
        #[arg(long, value_parser = ds4::placement::parse_size)]
        vram_budget: Option<u64>,
        /// Context length the plan's KV state is sized for.
        #[arg(short = 'c', long, default_value_t = 4096, value_parser = at_least_one)]
        ctx: usize,
    },
    /// Write a deterministic random-weight model of a named shape.
    Synth {
        /// Model shape: tiny, small, flash-4l (4 layers of the real Flash shape, about 8 GB) or
        /// flash (all 43 layers, about 80 GB). Written one tensor at a time.
        #[arg(long, value_parser = ["tiny", "small", "flash-4l", "flash"])]
        preset: String,
        /// GGUF file to write (checked before the model is built).
        #[arg(long)]
        out: PathBuf,
        /// Seed of the random weights.
        #[arg(long, default_value_t = EMBEDDED_SEED)]
        seed: u64,
    },
    /// Compile the CUDA kernels with NVRTC for an architecture (needs libnvrtc, not a GPU) into the
    /// kernel cache (DS4_CACHE_DIR), so that a later run on that GPU compiles nothing.
    Kernels {
        /// GPU architecture, e.g. sm_89, sm_90, sm_121.
        #[arg(long, default_value = "sm_90")]
        arch: String,
        /// Write the source NVRTC compiles (split layout) to FILE instead of compiling it, for
        /// tools such as `scripts/kernel-registers`.
        #[arg(long, value_name = "FILE")]
        source: Option<PathBuf>,
        /// With --source: the build for prefill chunks (several token rows per launch) instead
        /// of the decode build.
        #[arg(long, requires = "source")]
        chunk: bool,
    },
    /// Print the token ids of a text as a JSON array.
    Tokenize {
        /// GGUF file with a tokenizer: a model or a tokenizer-only file.
        #[arg(short, long)]
        model: PathBuf,
        /// Text to tokenize (plain text, no chat template).
        #[arg(short, long, conflicts_with = "prompt_file")]
        prompt: Option<String>,
        /// Read the text to tokenize from a file (UTF-8).
        #[arg(long)]
        prompt_file: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum BackendArg {
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum NumericsArg {
    Ds4,
    Canonical,
}

impl NumericsArg {
    fn profile(self) -> Numerics {
        match self {
            NumericsArg::Ds4 => Numerics::Ds4,
            NumericsArg::Canonical => Numerics::Canonical,
        }
    }
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum OnOff {
    On,
    Off,
}

/// Where the model comes from and how it runs.
#[derive(Args)]
struct ModelArgs {
    /// GGUF model file. Without it, ./ds4flash.gguf, else the embedded tiny synthetic model.
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Synthesize a preset model in memory instead of reading a file.
    #[arg(long, conflicts_with = "model", value_parser = ["tiny", "small", "flash-4l", "flash"])]
    preset: Option<String>,
    /// Where to run: auto takes the first of cuda, wgpu, cpu that this build and machine offer.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// CUDA: replay the token as one captured graph (on) or launch kernels eagerly (off).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    graphs: OnOff,
    /// CPU worker threads, at most the number of cores (0: all cores).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// wgpu: the adapter whose name contains NAME (case-insensitive); sets DS4_WGPU_ADAPTER.
    #[arg(long, value_name = "NAME")]
    adapter: Option<String>,
    /// Numerics: ds4 (CPU only, its default) or canonical (every backend, bit for bit).
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
    /// Context length in tokens, at most the model's trained context length.
    #[arg(short, long, default_value_t = 32768, value_parser = at_least_one)]
    ctx: usize,
    /// CUDA: device memory the weights, KV state and expert cache may use (e.g. 22G; binary
    /// units). Default: the memory free on the device.
    #[arg(long, value_name = "SIZE", value_parser = ds4::placement::parse_size)]
    vram_budget: Option<u64>,
    /// CUDA: force where the weights go: device (all in device memory), host (routed experts in
    /// page-locked host memory, the rest of the budget caches them) or unified (every weight in
    /// page-locked host memory, read in place: the GB10's default). Default: planned from the budget.
    #[arg(long, value_name = "PLACE", value_parser = ["device", "host", "unified"])]
    placement: Option<String>,
    /// CUDA, placement host: at most N expert cache slots per MoE layer (0: every routed expert
    /// is read from host memory in place). Default: as many as the budget holds.
    #[arg(long, value_name = "N")]
    cache_slots: Option<usize>,
    /// Prompt tokens per prefill step (1: token by token). Default: the backend's (64 on the
    /// cpu and cuda, 16 on wgpu; cuda with experts cached from host memory feeds token by token).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    prefill_chunk: Option<usize>,
}

/// `--tokens` is the generation count (`-n/--tokens N`, as in ds4) or, given a comma list such as
/// `--tokens 0,338,298`, the token ids to feed.
#[derive(Clone, Debug)]
enum TokensArg {
    Count(usize),
    Ids(Vec<u32>),
}

/// A count that must be at least 1 (a context length, a number of steps to compare or time).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("'{s}' is not a whole number")),
    }
}

fn parse_f32(s: &str) -> Result<f32, String> {
    s.trim().parse::<f32>().map_err(|_| format!("'{s}' is not a number"))
}

fn parse_temp(s: &str) -> Result<f32, String> {
    sampling::check_temperature(parse_f32(s)?).map_err(|e| e.to_string())
}

fn parse_top_p(s: &str) -> Result<f32, String> {
    sampling::check_top_p(parse_f32(s)?).map_err(|e| e.to_string())
}

fn parse_min_p(s: &str) -> Result<f32, String> {
    sampling::check_min_p(parse_f32(s)?).map_err(|e| e.to_string())
}

fn parse_tolerance(s: &str) -> Result<f32, String> {
    let t = parse_f32(s)?;
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        Err(format!("tolerance {t} must be a finite number at least 0"))
    }
}

fn parse_tokens_arg(s: &str) -> Result<TokensArg, String> {
    if s.contains(',') {
        parse_ids(s).map(|l| TokensArg::Ids(l.0))
    } else {
        s.trim().parse().map(TokensArg::Count).map_err(|_| format!("'{s}' is neither a count nor a comma list of ids"))
    }
}

/// A comma list of token ids (a newtype, so clap takes it as one value).
#[derive(Clone, Debug)]
struct IdList(Vec<u32>);

fn parse_ids(s: &str) -> Result<IdList, String> {
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().map_err(|_| format!("'{t}' is not a token id")))
        .collect::<Result<_, _>>()?;
    if ids.is_empty() {
        return Err("the token id list is empty".into());
    }
    Ok(IdList(ids))
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// The prompt, rendered with DeepSeek V4's chat template.
    #[arg(short, long, conflicts_with_all = ["prompt_file", "token_ids"])]
    prompt: Option<String>,
    /// Read the prompt from a file (UTF-8 text).
    #[arg(long, conflicts_with = "token_ids")]
    prompt_file: Option<PathBuf>,
    /// System prompt of the chat template.
    #[arg(short, long, default_value = "You are a helpful assistant")]
    system: String,
    /// Tokens to generate (`-n 0` only feeds the prompt); a comma list feeds those token ids instead.
    #[arg(short = 'n', long = "tokens", value_parser = parse_tokens_arg, action = clap::ArgAction::Append)]
    tokens: Vec<TokensArg>,
    /// Token ids to feed as they are, with no chat template (same as a comma list to --tokens).
    #[arg(long, value_parser = parse_ids)]
    token_ids: Option<IdList>,
    /// Sampling temperature, at least 0; 0 is greedy. Default: 1.0 with a prompt, 0 with raw token ids.
    #[arg(long, value_parser = parse_temp, allow_negative_numbers = true)]
    temp: Option<f32>,
    /// Sample only from the most likely tokens whose probabilities add up to this (0 to 1; 1: no limit).
    #[arg(long, default_value_t = 1.0, value_parser = parse_top_p, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only the k most likely tokens (0: no limit).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens less likely than this fraction of the most likely one (0 to 1; 0: no limit).
    #[arg(long, default_value_t = 0.05, value_parser = parse_min_p, allow_negative_numbers = true)]
    min_p: f32,
    /// Seed of the sampler: the same seed and options give the same text.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Open the answer with <think> (the default).
    #[arg(long, conflicts_with = "nothink")]
    think: bool,
    /// Open the answer with </think>: no reasoning.
    #[arg(long)]
    nothink: bool,
    /// Keep generating past the end-of-sentence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Write one row of little-endian f32 logits per fed token, prompt and generated (steps x vocab).
    /// The file is created before the model loads, so a bad path fails at once.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// Address to listen on (the loopback address: only this machine can connect).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the URL printed says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// The backend compared against --backend (ignored with --logits).
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    against: BackendArg,
    /// Numerics of --against (default: canonical if a GPU is involved, else --numerics).
    #[arg(long, value_enum)]
    against_numerics: Option<NumericsArg>,
    /// Reference logits (steps x vocab little-endian f32), e.g. from `run --dump-logits`.
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Token ids to feed (comma list). Default: greedy continuation of token 0 on the reference.
    #[arg(long, value_parser = parse_ids)]
    token_ids: Option<IdList>,
    /// Steps to compare when no token ids are given.
    #[arg(short = 'n', long, default_value_t = 64, value_parser = at_least_one)]
    steps: usize,
    /// Largest allowed |logit difference|.
    #[arg(long, default_value_t = 0.01, value_parser = parse_tolerance, allow_negative_numbers = true)]
    tolerance: f32,
    /// Find the first op whose buffers differ between the two backends at this position
    /// (the token ids, or zeros, are fed before it). Needs --against, not --logits.
    #[arg(long, conflicts_with = "logits")]
    bisect: Option<usize>,
    /// With --bisect: print the largest difference after every op.
    #[arg(long, requires = "bisect")]
    trace: bool,
    /// With --bisect: run each op on both backends from the same inputs (copied from --against)
    /// and print each op's own relative difference.
    #[arg(long, requires = "bisect")]
    isolate: bool,
    /// With --isolate: the largest relative difference an op may show.
    #[arg(long, default_value_t = 1e-5)]
    rel_tolerance: f32,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// Prompt tokens to prefill before timing decode (at least 1: decode starts from its last token).
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    prefill: usize,
    /// Decode tokens to time (at least 1).
    #[arg(short = 'n', long, default_value_t = 64, value_parser = at_least_one)]
    tokens: usize,
    /// Also time one more token op by op (kernel by kernel on GPUs) and print every family, slowest first.
    /// With the CUDA backend and DS4_CUDA_TRACE=1 (a measurement build), also where a replayed
    /// token's critical path goes, launch family by family.
    #[arg(long)]
    profile: bool,
    /// Untimed passes (a prefill and decode of the same lengths from another prompt, then a reset)
    /// for at least this many milliseconds before the timed one, and on until two passes' decode
    /// times agree within 3% (at most ten times as long): an idle GPU runs at its lowest clock and
    /// takes up to a second to reach its highest (H200: 345 -> 1980 MHz), so a cold decode
    /// measures the ramp.
    #[arg(long, default_value_t = 1000)]
    warmup_ms: u64,
}

fn main() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // `println!` panics when stdout is closed (`ds4 check ... | head`): end quietly instead.
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        // Any other panic is a bug: one line, no backtrace.
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        eprintln!("ds4: internal error (a bug, please report it): {msg}{at}");
    }));
    let cli = Cli::parse();
    // Before any thread starts: the wgpu backend reads the adapter name from the environment.
    let adapter = match &cli.cmd {
        Cmd::Run(a) => a.m.adapter.clone(),
        Cmd::Serve(a) => a.m.adapter.clone(),
        Cmd::Check(a) => a.m.adapter.clone(),
        Cmd::Bench(a) => a.m.adapter.clone(),
        _ => None,
    };
    if let Some(name) = adapter {
        std::env::set_var(ds4::backends::wgpu::ADAPTER_ENV, name);
    }
    let r = match cli.cmd {
        Cmd::Run(a) => cmd_run(a),
        Cmd::Serve(a) => cmd_serve(a),
        Cmd::Check(a) => cmd_check(a),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::Inspect { model, vram_budget, ctx } => cmd_inspect(&model, vram_budget, ctx),
        Cmd::Synth { preset, out, seed } => cmd_synth(&preset, &out, seed),
        Cmd::Tokenize { model, prompt, prompt_file } => cmd_tokenize(&model, prompt, prompt_file),
        Cmd::Kernels { arch, source, chunk } => cmd_kernels(&arch, source.as_deref(), chunk),
    };
    if let Err(e) = r {
        // A reader that stopped reading (`ds4 inspect | head`) is not a failure.
        let closed_stdout =
            e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == ErrorKind::BrokenPipe));
        if closed_stdout {
            std::process::exit(0);
        }
        eprintln!("ds4: error: {e:#}");
        std::process::exit(1);
    }
}

/// Refuses settings that would run badly or not at all, before any work starts.
fn check_model_args(m: &ModelArgs) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if m.threads > cores {
        bail!("-t/--threads {} is more than the {cores} cores of this machine (0 uses all of them)", m.threads);
    }
    Ok(())
}

/// Creates an output file before any work starts, so a bad path fails at once.
fn create_output(path: &Path, option: &str) -> Result<std::fs::File> {
    std::fs::File::create(path).with_context(|| format!("{option}: cannot write {}", path.display()))
}

/// Reads a UTF-8 text file; invalid UTF-8 is an error naming the file and the byte offset.
fn read_text(path: &Path, option: &str) -> Result<String> {
    if path.is_dir() {
        bail!("{option}: {} is a directory", path.display());
    }
    let bytes = std::fs::read(path).with_context(|| format!("{option}: cannot read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{option}: {} is not valid UTF-8 text (at byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Where `-m`/`--preset` say the model comes from.
fn model_source(m: &ModelArgs) -> ModelSource {
    match (&m.preset, &m.model) {
        (Some(name), _) => ModelSource::Preset(name.clone()),
        (None, Some(p)) => ModelSource::File(p.clone()),
        (None, None) => ModelSource::Default,
    }
}

fn backend_kind(b: BackendArg) -> Option<BackendKind> {
    match b {
        BackendArg::Auto => None,
        BackendArg::Cpu => Some(BackendKind::Cpu),
        BackendArg::Wgpu => Some(BackendKind::Wgpu),
        BackendArg::Cuda => Some(BackendKind::Cuda),
    }
}

/// The backend asked for; `auto` takes the first of cuda, wgpu, cpu that this build and machine
/// offer (only the cpu with `--numerics ds4`).
fn make_backend(m: &ModelArgs, which: BackendArg, numerics: Option<NumericsArg>) -> Result<Box<dyn Backend>> {
    let choice = BackendChoice {
        kind: backend_kind(which),
        threads: m.threads,
        graphs: m.graphs == OnOff::On,
        numerics: numerics.map(NumericsArg::profile),
        // The placement flags are for the backend they were given with (`--backend`), or for
        // a cuda backend `check --against` names; not for the cpu or wgpu reference of a check.
        placement: if which == m.backend || which == BackendArg::Cuda {
            ds4::placement::PlacementRequest {
                budget: m.vram_budget,
                mode: m.placement.as_deref().map(str::parse).transpose().map_err(anyhow::Error::msg)?,
                cache_slots: m.cache_slots,
            }
        } else {
            Default::default()
        },
        load_progress: Some(upload_progress),
    };
    let (backend, note) = engine::make_backend(&choice)?;
    if let Some(note) = note {
        eprintln!("ds4: {note}");
    }
    if let Some(device) = backend.describe() {
        eprintln!("ds4: {} backend on {device}", backend.name());
    }
    Ok(backend)
}

/// The weight upload's progress bar, made on its first call (a plain function, so the backend
/// options stay plain data).
/// This process's host memory (Linux): resident anonymous memory (what it allocated: copies of
/// weights included) apart from resident pages of mapped files (the model file read in place).
fn host_memory() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()
    };
    let gib = |k: u64| k as f64 / (1u64 << 20) as f64;
    Some(format!(
        "host mem   {:.2} GiB resident: {:.2} GiB allocated, {:.2} GiB of mapped files (peak {:.2} GiB)",
        gib(kb("VmRSS:")?),
        gib(kb("RssAnon:")?),
        gib(kb("RssFile:")?),
        gib(kb("VmHWM:")?)
    ))
}

fn upload_progress(done: u64, total: u64) {
    // One bar per load: a finished bar is dropped, so a second load in the process gets its own.
    static BAR: std::sync::Mutex<Option<ProgressBar>> = std::sync::Mutex::new(None);
    let mut bar = BAR.lock().unwrap_or_else(|e| e.into_inner());
    let pb = bar.get_or_insert_with(|| {
        let pb = ProgressBar::new(total);
        pb.set_style(
            ProgressStyle::with_template(
                "uploading weights {bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}",
            )
            .unwrap(),
        );
        pb
    });
    pb.set_position(done);
    if done >= total {
        pb.finish_and_clear();
        *bar = None;
    }
}

fn spinner(msg: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").unwrap());
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// Loads the model and compiles a session, with a progress line; returns the load time too.
fn start(m: &ModelArgs, which: BackendArg, host_bytes: bool) -> Result<(Engine, Duration)> {
    let t0 = Instant::now();
    let pb = spinner("loading model");
    // A cuda backend draws a preset's weights itself; `check` compares with a backend that
    // reads the host bytes, so it builds them.
    let loaded = if which == BackendArg::Cuda && !host_bytes {
        engine::load_for_device(&model_source(m))
    } else {
        engine::load(&model_source(m))
    };
    pb.finish_and_clear();
    let loaded = loaded?;
    for note in &loaded.notes {
        eprintln!("ds4: {note}");
    }
    engine::check_ctx(&loaded, m.ctx)?;
    let backend = make_backend(m, which, m.numerics)?;
    // The CUDA backend draws its own upload bar.
    let pb = (backend.name() != "cuda").then(|| spinner(&format!("preparing the {} backend", backend.name())));
    let engine = Engine::with_prefill_chunk(loaded, backend.as_ref(), m.ctx, m.threads, m.prefill_chunk);
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let mut engine = engine?;
    if let Some(report) = engine.session().executable().load_report() {
        eprint!("{report}");
    }
    let elapsed = t0.elapsed();
    for w in engine.take_warnings() {
        eprintln!("ds4: {w}");
    }
    let (ops, predicated) = engine.session().program().op_counts();
    let chunk = engine.session().prefill_chunk();
    eprintln!(
        "ds4: {} on {} ({} numerics): {} layers, ctx {}, {ops} ops recorded once ({predicated} predicated), \
         prefill chunk {chunk}, loaded in {:.2} s",
        engine.loaded.source,
        engine.backend_label,
        backend.numerics(),
        engine.model().config.n_layer,
        m.ctx,
        elapsed.as_secs_f64()
    );
    Ok((engine, elapsed))
}

/// "1 token", "2 tokens".
fn tokens(n: usize) -> String {
    format!("{n} token{}", if n == 1 { "" } else { "s" })
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

fn cmd_run(a: RunArgs) -> Result<()> {
    check_model_args(&a.m)?;
    let mut n_gen = None;
    let mut ids = a.token_ids.clone().map(|l| l.0);
    for t in &a.tokens {
        match t {
            TokensArg::Count(n) => n_gen = Some(*n),
            TokensArg::Ids(v) => {
                if ids.is_some() {
                    bail!("token ids given twice");
                }
                ids = Some(v.clone());
            }
        }
    }
    let raw_ids = ids.is_some();
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) if p.is_empty() => bail!("-p/--prompt is empty"),
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => {
            let text = read_text(f, "--prompt-file")?;
            if text.is_empty() {
                bail!("--prompt-file: {} is empty", f.display());
            }
            Some(text)
        }
        (None, None) => None,
    };
    if !raw_ids && prompt.is_none() {
        bail!("give a prompt (-p TEXT or --prompt-file FILE) or token ids (--tokens 0,338,298)");
    }
    let temperature = a.temp.unwrap_or(if raw_ids { 0.0 } else { 1.0 });
    let sampler_cfg = SamplerConfig { temperature, top_k: a.top_k, top_p: a.top_p, min_p: a.min_p, seed: a.seed };
    sampler_cfg.validate()?;
    // Created now, not after generating: a bad path must not cost the whole run.
    let mut dump_file = match &a.dump_logits {
        Some(p) => Some(create_output(p, "--dump-logits")?),
        None => None,
    };

    let (mut engine, _) = start(&a.m, a.m.backend, false)?;
    let tok = engine.tokenizer();
    let think = if a.nothink { ThinkMode::NoThink } else { ThinkMode::Think };
    let input: Vec<u32> = match (ids, &prompt) {
        (Some(v), _) => v,
        (None, Some(p)) => tok.render_chat(&a.system, p, think),
        (None, None) => unreachable!("checked above"),
    };
    if input.is_empty() {
        bail!("the prompt is empty");
    }
    let n_gen = n_gen.unwrap_or(if raw_ids { 16 } else { 512 });
    let ctx = engine.ctx();
    if input.len() > ctx {
        bail!("the prompt is {} tokens, longer than --ctx {}", input.len(), ctx);
    }
    let room = ctx - input.len();
    let n_gen = if n_gen > room {
        eprintln!("ds4: generating at most {room} tokens: the context ends there (--ctx {ctx})");
        room
    } else {
        n_gen
    };

    // With --dump-logits the logits after every fed token are kept (prompt and generated).
    let mut dump = a.dump_logits.as_ref().map(|_| Vec::<u8>::new());
    let pb = if input.len() >= 64 { ProgressBar::new(input.len() as u64) } else { ProgressBar::hidden() };
    pb.set_style(ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens {per_sec}").unwrap());
    let params =
        GenParams { sampler: sampler_cfg, max_tokens: n_gen, ignore_eos: a.ignore_eos, logits: dump.is_some() };
    let mut out = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let mut first = true;
    let stats = engine.generate(&input, &params, |ev| {
        let r = match ev {
            Event::Prefill { done, .. } => {
                pb.set_position(done as u64);
                if done == input.len() {
                    pb.finish_and_clear();
                }
                Ok(())
            }
            Event::Logits(l) => {
                if let Some(buf) = dump.as_mut() {
                    buf.extend(l.iter().flat_map(|v| v.to_le_bytes()));
                }
                Ok(())
            }
            Event::Token { id, text } => {
                if raw_ids {
                    let sep = if first { "" } else { " " };
                    first = false;
                    write!(out, "{sep}{id}").and_then(|_| out.flush())
                } else {
                    write!(out, "{text}").and_then(|_| out.flush())
                }
            }
        };
        match r {
            Ok(()) => true,
            Err(e) => {
                write_err = Some(e);
                false
            }
        }
    });
    pb.finish_and_clear();
    let stats = stats?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    // Bytes of an unfinished UTF-8 character at the end belong to the text, not to a list of ids.
    if !raw_ids {
        write!(out, "{}", stats.tail)?;
    }
    if stats.generated > 0 {
        writeln!(out)?;
    }
    for w in engine.take_warnings() {
        eprintln!("ds4: {w}");
    }
    if let (Some(path), Some(buf), Some(f)) = (&a.dump_logits, &dump, dump_file.as_mut()) {
        f.write_all(buf).with_context(|| format!("--dump-logits: cannot write {}", path.display()))?;
        let n_vocab = engine.model().config.n_vocab;
        let rows = buf.len() / 4 / n_vocab.max(1);
        eprintln!("ds4: wrote {rows} x {n_vocab} logits (one row per fed token) to {}", path.display());
    }
    // The first generated token comes from the prefill's logits; each later one costs one decode
    // step, so the rate counts steps, not generated tokens.
    let decode = if stats.decoded == 0 {
        format!("generated {}, no decode step to time", tokens(stats.generated))
    } else {
        format!(
            "generated {}; decode {} in {:.3} s ({:.1} tok/s)",
            tokens(stats.generated),
            tokens(stats.decoded),
            stats.decode_time.as_secs_f64(),
            rate(stats.decoded, stats.decode_time)
        )
    };
    eprintln!(
        "ds4: prefill {} tokens in {:.3} s ({:.1} tok/s); {decode}",
        input.len(),
        stats.prefill_time.as_secs_f64(),
        rate(input.len(), stats.prefill_time),
    );
    Ok(())
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    check_model_args(&a.m)?;
    let ServeArgs { m, host, port } = a;
    serve::run(Box::new(move || Ok(start(&m, m.backend, false)?.0)), &host, port)
}

fn cmd_check(mut a: CheckArgs) -> Result<()> {
    if a.m.numerics.is_none() && matches!(a.against, BackendArg::Cuda | BackendArg::Wgpu) {
        a.m.numerics = Some(NumericsArg::Canonical);
    }
    check_model_args(&a.m)?;
    let ctx = a.m.ctx;
    let n_ids = a.token_ids.as_ref().map(|l| l.0.len());
    if let Some(pos) = a.bisect {
        if pos >= ctx {
            bail!("--bisect {pos} is past the context: -c/--ctx {ctx} holds positions 0 to {}", ctx - 1);
        }
        // Bisecting runs the decode program op by op on both sides, over buffers of one shape:
        // both sessions feed token by token (a chunked session's raw ring has more rows).
        match a.m.prefill_chunk {
            None | Some(1) => a.m.prefill_chunk = Some(1),
            Some(n) => bail!("--bisect runs token by token; --prefill-chunk {n} cannot apply"),
        }
    } else if let Some(n) = n_ids {
        if n > ctx {
            bail!("--token-ids gives {n} ids, more than -c/--ctx {ctx}");
        }
    } else if a.logits.is_none() && a.steps > ctx {
        bail!("-n {} steps do not fit in -c/--ctx {ctx}", a.steps);
    }
    // Read the reference before loading anything: a bad path must fail at once.
    let raw_reference = match &a.logits {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("--logits: cannot read {}", p.display()))?),
        None => None,
    };
    let (loaded, mut session, _) = start(&a.m, a.m.backend, true)?.0.into_parts();
    let n_vocab = loaded.model.config.n_vocab;
    let reference: Option<Vec<f32>> = match (&a.logits, raw_reference) {
        (Some(p), Some(raw)) => {
            if raw.len() % (4 * n_vocab) != 0 {
                bail!("{}: {} bytes is not a whole number of {n_vocab}-logit rows", p.display(), raw.len());
            }
            let rows = raw.len() / (4 * n_vocab);
            if rows == 0 {
                bail!("--logits: {} is empty: no rows to compare", p.display());
            }
            match n_ids {
                Some(n) if n > rows => {
                    bail!("--token-ids gives {n} ids, but --logits {} has only {rows} rows", p.display())
                }
                None if rows > ctx => bail!("--logits {} has {rows} rows, more than -c/--ctx {ctx}", p.display()),
                _ => {}
            }
            Some(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        _ => None,
    };
    let mut other = match reference {
        Some(_) => None,
        None => {
            // Both sides compute in one profile unless told otherwise: canonical when a GPU is
            // involved (the only profile the GPUs have), else the CPU's own.
            let numerics = a.against_numerics.unwrap_or(match session.numerics() {
                Numerics::Canonical => NumericsArg::Canonical,
                Numerics::Ds4 => NumericsArg::Ds4,
            });
            let b = make_backend(&a.m, a.against, Some(numerics))?;
            Some(Session::with_prefill_chunk(loaded.model.clone(), b.as_ref(), a.m.ctx, 1)?)
        }
    };
    let token_ids = a.token_ids.as_ref().map(|l| &l.0);
    if let (Some(pos), Some(o)) = (a.bisect, other.as_mut()) {
        let ids = token_ids.map_or(&[][..], |t| &t[..]);
        if a.isolate {
            return isolate_ops(o, &mut session, ids, pos, a.rel_tolerance);
        }
        return bisect(&mut session, o, ids, pos, a.tolerance, a.trace);
    }
    let steps = match (token_ids, &reference) {
        (Some(t), _) => t.len(),
        (None, Some(r)) => r.len() / n_vocab,
        (None, None) => a.steps,
    };
    // The reference feeds token by token (its greedy continuation picks the tokens); the checked
    // session feeds the same tokens in its prefill chunks (--prefill-chunk), one piece at a time.
    let piece = session.prefill_chunk();
    let mut worst = 0.0f32;
    let mut bad = 0;
    let mut token = token_ids.map_or(0, |t| t[0]);
    let mut step = 0;
    while step < steps {
        let n = piece.min(steps - step);
        let mut fed = Vec::with_capacity(n);
        let mut want = Vec::with_capacity(n * n_vocab);
        for s in step..step + n {
            let row: Vec<f32> = match (&reference, other.as_mut()) {
                (Some(r), _) => r[s * n_vocab..(s + 1) * n_vocab].to_vec(),
                (None, Some(o)) => o.eval(token)?.to_vec(),
                (None, None) => unreachable!("one reference exists"),
            };
            fed.push(token);
            token = match token_ids {
                Some(t) if s + 1 < t.len() => t[s + 1],
                _ => ds4::sample::argmax(&row),
            };
            want.extend_from_slice(&row);
        }
        session.feed_with_logits(&fed, |i, got| {
            let d = max_abs_diff(got, &want[i * n_vocab..(i + 1) * n_vocab]);
            worst = worst.max(d);
            bad += (d > a.tolerance) as usize;
            println!("step {:4} token {:6}: max |diff| {d:.3e}", step + i, fed[i]);
            true
        })?;
        step += n;
    }
    println!("worst {worst:.3e} over {steps} steps; {bad} steps above {}", a.tolerance);
    if bad > 0 {
        bail!("{bad} of {steps} steps differ by more than {}", a.tolerance);
    }
    Ok(())
}

/// The largest |a[i] − b[i]|; infinite when a value is NaN or infinite on either side, or the
/// lengths differ, so a broken backend can never pass a comparison.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() || a.iter().chain(b).any(|v| !v.is_finite()) {
        return f32::INFINITY;
    }
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Reruns position `pos` op by op on both sessions and reports the first op after which some
/// buffer differs by more than `tol`; with `trace`, the largest difference after every op.
fn bisect(a: &mut Session, b: &mut Session, ids: &[u32], pos: usize, tol: f32, trace: bool) -> Result<()> {
    let program = a.program().clone();
    let token = |p: usize| ds4::recorder::StepParams::new(ids.get(p).copied().unwrap_or(0), p as u32);
    for k in 1..=program.steps().len() {
        for s in [&mut *a, &mut *b] {
            s.reset()?;
            let exe = s.executable();
            for p in 0..pos {
                exe.step(&token(p))?;
            }
            exe.step_ops(&token(pos), 0..k)?;
        }
        let mut worst: Vec<(f32, String)> = Vec::new();
        for (i, d) in program.buffers().iter().enumerate() {
            let buf = ds4::recorder::Buf(i as u32);
            let (x, y) = (a.executable().read_buffer(buf)?, b.executable().read_buffer(buf)?);
            let diff = max_abs_diff(&x, &y);
            worst.push((diff, d.name.clone()));
        }
        worst.sort_by(|p, q| q.0.total_cmp(&p.0));
        let st = &program.steps()[k - 1];
        if trace {
            println!("op #{:3} {:18} worst {:.3e} in {}", k - 1, st.op.name(), worst[0].0, worst[0].1);
        }
        if worst[0].0 > tol {
            println!("first difference after op #{} {} (cond {:?}) at position {pos}:", k - 1, st.op.name(), st.cond);
            println!("  {:?}", st.op);
            for (d, name) in worst.iter().take(8) {
                println!("  buffer {name}: max |diff| {d:.3e}");
            }
            bail!("the backends differ from op #{}", k - 1);
        }
    }
    println!("all {} ops agree within {tol} at position {pos}", program.steps().len());
    Ok(())
}

/// Runs every op of position `pos` on both sessions from identical inputs: the reference `r`
/// computes everything up to the op, its buffers are copied into `t`, then both run the op alone.
/// Each op's difference is relative to the largest |value| of the buffer it lands in. An op above
/// `rel_tol` fails the check, except two kinds of flip that the two sides may legitimately make
/// on a near-tie, counted and named apart: a changed selection (an integer buffer: router or
/// indexer top-k) and a re-quantized intermediate (the experts' Q8_K `mid`).
fn isolate_ops(r: &mut Session, t: &mut Session, ids: &[u32], pos: usize, rel_tol: f32) -> Result<()> {
    use ds4::recorder::{Buf, DType, Op};
    let program = r.program().clone();
    let token = |p: usize| ds4::recorder::StepParams::new(ids.get(p).copied().unwrap_or(0), p as u32);
    let n_bufs = program.buffers().len();
    r.reset()?;
    for p in 0..pos {
        r.executable().step(&token(p))?;
    }
    let (mut within, mut flips, mut bad) = (0usize, Vec::new(), Vec::new());
    for (k, st) in program.steps().iter().enumerate() {
        let before: Vec<Vec<f32>> =
            (0..n_bufs).map(|i| r.executable().read_buffer(Buf(i as u32))).collect::<Result<_, _>>()?;
        for (i, v) in before.iter().enumerate() {
            t.executable().write_buffer(Buf(i as u32), v)?;
        }
        r.executable().step_ops(&token(pos), k..k + 1)?;
        t.executable().step_ops(&token(pos), k..k + 1)?;
        let (mut worst, mut worst_abs, mut scale, mut name) = (0.0f32, 0.0f32, 0.0f32, String::new());
        let mut selection_changed = false;
        for (i, d) in program.buffers().iter().enumerate() {
            let buf = Buf(i as u32);
            let (x, y) = (r.executable().read_buffer(buf)?, t.executable().read_buffer(buf)?);
            if x == before[i] && y == before[i] {
                continue;
            }
            if d.dtype == DType::I32 {
                selection_changed |= x != y;
                continue;
            }
            let diff = max_abs_diff(&x, &y);
            let max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let rel = if diff == 0.0 { 0.0 } else { diff / max.max(f32::MIN_POSITIVE) };
            if rel > worst || name.is_empty() {
                (worst, worst_abs, scale, name) = (rel, diff, max, d.name.clone());
            }
        }
        let active = st.cond.is_none_or(|c| c.eval(&token(pos)));
        let what = if !active {
            "skipped"
        } else if selection_changed {
            flips.push(format!("op #{k} {} (selection)", st.op.name()));
            "selection flip"
        } else if worst > rel_tol && matches!(st.op, Op::MoeExperts { .. }) {
            flips.push(format!("op #{k} {} (Q8_K re-quantization, relative {worst:.1e})", st.op.name()));
            "quantization flip"
        } else if worst > rel_tol || !worst.is_finite() {
            bad.push(format!("op #{k} {} (relative {worst:.3e} in {name})", st.op.name()));
            "OVER"
        } else {
            within += 1;
            ""
        };
        println!(
            "op #{k:3} {:18} relative {worst:.3e} (|diff| {worst_abs:.3e}, max |value| {scale:.3e}) in {name} {what}",
            st.op.name()
        );
    }
    println!(
        "{within} ops within a relative {rel_tol:e}; {} flips on a near-tie{}{}",
        flips.len(),
        if flips.is_empty() { String::new() } else { format!(": {}", flips.join(", ")) },
        if bad.is_empty() { String::new() } else { format!("; {} ops over: {}", bad.len(), bad.join(", ")) }
    );
    if !bad.is_empty() {
        bail!("{} ops differ by more than a relative {rel_tol:e} from identical inputs", bad.len());
    }
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    check_model_args(&a.m)?;
    if a.prefill.saturating_add(a.tokens) > a.m.ctx {
        bail!("--prefill {} plus -n {} tokens do not fit in -c/--ctx {}", a.prefill, a.tokens, a.m.ctx);
    }
    let (engine, load_time) = start(&a.m, a.m.backend, false)?;
    let (loaded, mut session, backend_label) = engine.into_parts();
    let cfg = &loaded.model.config;
    let prompt_from =
        |first: usize| -> Vec<u32> { (0..a.prefill).map(|i| ((i * 7919 + first) % cfg.n_vocab) as u32).collect() };
    let prompt = prompt_from(13);
    // Greedy, as `ds4 run` decodes: sampled on the device where the backend can, so a GPU token
    // sends back its 4-byte id, not the logits.
    let mut greedy = ds4::sample::Sampler::new(SamplerConfig::default());
    // -n tokens from `next`: the last token sampled and how long they took.
    // Each sampled token but the last is fed as `ds4 run` feeds it: its step queued on the device
    // before the id comes back, where the session feeds ahead.
    let decode = |session: &mut Session, greedy: &mut ds4::sample::Sampler, mut next: u32| -> Result<(u32, Duration)> {
        let t = Instant::now();
        if a.tokens > 0 {
            session.feed(&[next], |_| {})?;
            for _ in 1..a.tokens {
                session.sample_and_feed(greedy)?;
            }
            next = session.sample(greedy)?;
        }
        Ok((next, t.elapsed()))
    };
    // Warm-up passes until --warmup-ms has passed and the decode time of the last pass is within
    // 3% of the one before (a GPU can stay on its ramp for more than half a second), or for ten
    // times --warmup-ms at most. They decode from another prompt: an expert cache (placement
    // "host") keeps its slots across a reset, and replaying the timed tokens would fill it with
    // exactly the experts the timed pass needs.
    let warm_prompt = prompt_from(14);
    let warm = Instant::now();
    let (min_warm, max_warm) =
        (Duration::from_millis(a.warmup_ms), Duration::from_millis(a.warmup_ms.saturating_mul(10)));
    let (mut passes, mut settled, mut last) = (0, false, None::<Duration>);
    while a.warmup_ms > 0 && warm.elapsed() < max_warm && (passes == 0 || !settled || warm.elapsed() < min_warm) {
        session.feed(&warm_prompt, |_| {})?;
        let first = session.sample(&mut greedy)?;
        let (_, took) = decode(&mut session, &mut greedy, first)?;
        settled = last.is_some_and(|l| took.abs_diff(l) * 100 <= l * 3);
        last = Some(took);
        session.reset()?;
        passes += 1;
    }
    let warm_time = warm.elapsed();
    let t0 = Instant::now();
    session.feed(&prompt, |_| {})?;
    let first = session.sample(&mut greedy)?;
    let prefill_time = t0.elapsed();
    let cache_before = session.executable().expert_cache_stats();
    let (next, decode_time) = decode(&mut session, &mut greedy, first)?;
    let cache_after = session.executable().expert_cache_stats();
    for w in session.take_warnings() {
        eprintln!("ds4: {w}");
    }
    // The indexer's compressor runs when the program has an indexer, its query once a ratio-4
    // layer has more than top_k compressed rows.
    let recorded =
        session.program().steps().iter().any(|s| matches!(s.cond, Some(ds4::recorder::Cond::IndexerActive { .. })));
    let indexer = if !recorded {
        IndexerReads::None
    } else if (session.pos() + 1) / 4 > cfg.indexer_top_k {
        IndexerReads::All
    } else {
        IndexerReads::Compressor
    };
    let bytes = loaded.model.weights.decode_bytes_at(cfg, indexer) as f64;
    let tps = rate(a.tokens, decode_time);
    let ms_per_token = 1e3 * decode_time.as_secs_f64() / a.tokens as f64;
    out!("model      {}", loaded.source);
    out!("backend    {backend_label}");
    out!("load       {:.3} s", load_time.as_secs_f64());
    if passes > 0 {
        out!(
            "warm-up    {passes} untimed passes of prefill and decode (another prompt) in {:.2} s{}",
            warm_time.as_secs_f64(),
            if settled {
                ""
            } else {
                " (the decode time had not settled to within 3%: the timed pass may still be on the clock ramp)"
            }
        );
    }
    out!(
        "prefill    {} tokens in chunks of {}, {:.1} tok/s",
        prompt.len(),
        session.prefill_chunk(),
        rate(prompt.len(), prefill_time)
    );
    out!("decode     {} tokens, {:.1} tok/s ({:.2} ms/token)", a.tokens, tps, ms_per_token);
    out!(
        "weights    {:.1} MB read per token{}, {:.2} GB/s effective",
        bytes / 1e6,
        match indexer {
            IndexerReads::All => " (indexer active)",
            IndexerReads::Compressor => " (indexer not active yet)",
            IndexerReads::None => " (no indexer within this context)",
        },
        bytes * tps / 1e9
    );
    if let Some(copy) = session.executable().copy_bandwidth() {
        let read = bytes * tps / 1e9;
        out!(
            "ceiling    a device copy moves {copy:.0} GB/s (read + write): the token reads at {:.1}% of it",
            100.0 * read / copy
        );
    }
    if let Some(n) = session.executable().nodes_per_token() {
        out!("nodes      {n} kernel launches (graph nodes) per token");
    }
    if let Some(m) = host_memory() {
        out!("{m}");
    }
    if let (Some(b), Some(e)) = (cache_before, cache_after) {
        let (hits, copies, direct) = (e.hits - b.hits, e.copies - b.copies, e.direct - b.direct);
        let used = (hits + copies + direct).max(1) as f64;
        let bus = (copies + direct) as f64 * e.expert_bytes as f64 / a.tokens.max(1) as f64;
        out!(
            "experts    cache hit rate {:.1}% ({hits} hits, {copies} copied in, {direct} read in place); \
             {:.1} MB per token over the bus, {:.2} GB/s",
            100.0 * hits as f64 / used,
            bus / 1e6,
            bus * tps / 1e9
        );
    }
    if a.profile {
        let params = ds4::recorder::StepParams::new(next, session.pos() as u32);
        // The device's own time per token: steps queued back to back at one position (as the
        // profile below runs), then one sample or read-back to wait for them, so the host's
        // round trip per token (read-back, sampling, the gap before the next submit) is left out.
        const QUEUED: usize = 32;
        let exe = session.executable();
        let t = Instant::now();
        for _ in 0..QUEUED {
            exe.step(&params)?;
        }
        if exe.sample(&ds4::sample::DeviceSample::GREEDY)?.is_none() {
            exe.read_logits(&mut Vec::new())?;
        }
        let queued = t.elapsed();
        out!(
            "queued     {QUEUED} steps back to back, then one read: {:.3} ms/token ({:.1} tok/s), against {ms_per_token:.3} decoding",
            1e3 * queued.as_secs_f64() / QUEUED as f64,
            rate(QUEUED, queued)
        );
        // The in-graph trace, where the backend was built for it (CUDA: DS4_CUDA_TRACE=1).
        if let Some(trace) = session.executable().trace(&params, QUEUED)? {
            for line in ds4::backend::summarize_trace(&trace).lines() {
                out!("{line}");
            }
            // A stretch of the token in launch order (two layers or so, from a third of the way in).
            let from = trace.len() / 3;
            out!("trace      launches {from}.. in order: start, ready, last ready, marks (us from the token's first ready)");
            for (i, l) in trace.iter().enumerate().skip(from).take(40) {
                let marks: Vec<String> =
                    (l.marks.iter().enumerate()).filter_map(|(k, m)| m.map(|m| format!("{}:{m:.1}", k + 3))).collect();
                out!(
                    "  {i:4} {:44} {:9.1} {:9.1} {:9.1}  {}{}",
                    l.label,
                    l.entry,
                    l.ready,
                    l.last_ready,
                    if l.side { "side " } else { "" },
                    marks.join(" ")
                );
            }
        }
        let prof = session.executable().profile(&params)?;
        let total: f64 = prof.iter().map(|(_, t)| t).sum();
        out!("profile    one token, eager, {:.1} us in total:", total);
        for (name, t) in &prof {
            out!("  {name:36} {t:10.1} us  {:5.1}%", 100.0 * t / total.max(1e-9));
        }
        // One more prefill chunk where the prompt and decode left off (its rows' KV writes are the
        // last thing this session does).
        let (chunk, pos) = (session.prefill_chunk(), session.pos());
        if a.prefill > 1 && chunk > 1 {
            if pos + chunk > a.m.ctx {
                out!("profile    no room for one more chunk of {chunk} at position {pos} in -c/--ctx {}", a.m.ctx);
            } else {
                let tokens = &prompt[..chunk.min(prompt.len())];
                let params = ds4::recorder::StepParams::chunk(pos as u32, tokens.len() as u32);
                let prof = match session.executable().profile_chunk(&params, tokens) {
                    Ok(prof) => prof,
                    Err(e) => {
                        out!("profile    chunk not timed: {e}");
                        return Ok(());
                    }
                };
                let total: f64 = prof.iter().map(|(_, t)| t).sum();
                out!(
                    "profile    one chunk of {} rows at positions {pos}..{}, eager, {total:.1} us in total:",
                    tokens.len(),
                    pos + tokens.len()
                );
                for (name, t) in prof.iter().take(16) {
                    out!("  {name:36} {t:10.1} us  {:5.1}%", 100.0 * t / total.max(1e-9));
                }
            }
        }
    }
    Ok(())
}

fn cmd_inspect(path: &Path, vram_budget: Option<u64>, ctx: usize) -> Result<()> {
    let file = open_gguf(path, "-m/--model")?;
    let n_tokens = file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(|a| a.len());
    let arch = file.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("?").to_string();
    let name = file.get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let n_tensors = file.tensors().len();
    let file_bytes = file.len();
    let model = Model::from_file(file)?;
    let c = &model.config;
    let w = &model.weights;
    out!("file          {} ({:.2} MB, {n_tensors} tensors)", path.display(), file_bytes as f64 / 1e6);
    out!("architecture  {arch}{}", if name.is_empty() { String::new() } else { format!(" ({name})") });
    out!("layers        {}", c.n_layer);
    out!("embedding     {}  (x{} HC streams)", c.n_embd, c.n_hc);
    out!("vocab         {}", c.n_vocab);
    out!(
        "attention     {} heads x {} (RoPE on the last {}), 1 shared KV head, window {}",
        c.n_head,
        c.head_dim,
        c.n_rot,
        c.n_swa
    );
    out!("q / o LoRA    {} / {} x {} groups", c.q_lora_rank, c.o_lora_rank, c.n_out_group);
    out!(
        "experts       {} routed, {} used, ff {}, {} hash-routed layers, 1 shared",
        c.n_expert,
        c.n_expert_used,
        c.n_ff_exp,
        c.n_hash_layer
    );
    out!("indexer       {} heads x {}, top-k {}", c.n_indexer_head, c.indexer_head_dim, c.indexer_top_k);
    let ratios: Vec<String> = c.compress_ratios.iter().map(|r| r.to_string()).collect();
    out!("ratios        {}", ratios.join(","));
    for (il, l) in w.layers.iter().enumerate() {
        out!(
            "  layer {il:2}    {:<22} experts {:?}/{:?}/{:?}{}",
            c.attention_kind(il).describe(),
            l.ffn_gate_exps.ty,
            l.ffn_up_exps.ty,
            l.ffn_down_exps.ty,
            if c.is_hash_layer(il) { "  hash-routed" } else { "" }
        );
    }
    out!("weights       {:.2} MB", w.total_bytes() as f64 / 1e6);
    out!("per token     {:.2} MB read by one decode token", w.decode_bytes_per_token(c) as f64 / 1e6);
    match n_tokens {
        Some(n) => out!("tokenizer     {n} tokens"),
        None => out!("tokenizer     none"),
    }
    if let Some(budget) = vram_budget {
        let caps = ds4::decode::Caps { ctx: u32::try_from(ctx).context("--ctx is too large")? };
        let program = ds4::decode::record_token(&model, caps).map_err(|e| anyhow::anyhow!("{e}"))?;
        let footprint = ds4::placement::Footprint::of(&program, c.n_expert_used, c.n_expert);
        let plan = ds4::placement::plan(&footprint, budget).with_context(|| format!("--vram-budget at --ctx {ctx}"))?;
        out!("{}", plan.table().trim_end());
        out!("(the CUDA backend plans the same at load, with its scratch buffers counted too: run it with --vram-budget)");
    }
    Ok(())
}

fn cmd_synth(preset: &str, out: &Path, seed: u64) -> Result<()> {
    let p = Preset::by_name(preset).with_context(|| format!("unknown preset '{preset}'"))?;
    let file = create_output(out, "--out")?;
    let mut writer = std::io::BufWriter::with_capacity(1 << 22, file);
    let len = synth::write(&p, seed, &mut writer)
        .and_then(|n| writer.flush().map(|_| n))
        .with_context(|| format!("--out: cannot write {}", out.display()))?;
    eprintln!("ds4: wrote the '{preset}' preset ({:.2} MB, seed {seed}) to {}", len as f64 / 1e6, out.display());
    Ok(())
}

fn cmd_tokenize(model: &Path, prompt: Option<String>, prompt_file: Option<PathBuf>) -> Result<()> {
    let text = match (prompt, prompt_file) {
        (Some(p), _) => p,
        (None, Some(f)) => read_text(&f, "--prompt-file")?,
        (None, None) => bail!("give -p TEXT or --prompt-file FILE"),
    };
    let file = open_gguf(model, "-m/--model")?;
    let tok = Tokenizer::from_gguf(&file)?;
    out!("{}", serde_json::to_string(&tok.encode(&text))?);
    Ok(())
}

fn cmd_kernels(arch: &str, source: Option<&Path>, chunk: bool) -> Result<()> {
    use ds4::backends::cuda::{BlockLayout, KernelRows};
    if let Some(path) = source {
        #[cfg(feature = "cuda")]
        {
            let rows = if chunk { KernelRows::Chunk } else { KernelRows::One };
            let text = ds4::backends::cuda::kernel_source(BlockLayout::Split, rows);
            std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
            return Ok(());
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = chunk;
            bail!("ds4 was built without the `cuda` feature: no kernel source to write to {}", path.display());
        }
    }
    for (layout, what) in [(BlockLayout::Split, "split blocks"), (BlockLayout::Native, "GGUF's blocks, unified")] {
        for (rows, which) in [(KernelRows::One, "decode"), (KernelRows::Chunk, "prefill chunks")] {
            let t0 = Instant::now();
            let bytes = ds4::backends::cuda::compile_kernels(arch, layout, rows)?;
            out!(
                "compiled the CUDA kernels for {arch} ({what}, {which}): {bytes} bytes of SASS in {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}
