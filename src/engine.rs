//! The engine behind `ds4 run` and `ds4 serve`: resolve and load a model once, pick a backend,
//! compile one [`Session`], then tokenize and generate with a callback per token.
//!
//! The session keeps the token ids whose state it holds, so a prompt that starts with them only
//! prefills the rest (prefix reuse: a chat client resends the whole conversation every turn).
//! Library code never prints: what the caller may want to show comes back as notes and stats.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{self, Backend, BackendError, BackendKind, BackendOptions};
use crate::gguf;
use crate::model::Model;
use crate::numerics::Numerics;
use crate::sample::{Sampler, SamplerConfig, SamplerError};
use crate::session::{Session, SessionError};
use crate::synth::{self, Preset};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// The file looked for when no model is named.
pub const DEFAULT_MODEL: &str = "ds4flash.gguf";
/// Seed of the embedded tiny model and of the synthetic presets.
pub const EMBEDDED_SEED: u64 = 4;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A setting or file refused before any work starts; the message names it.
    #[error("{0}")]
    Invalid(String),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt is {prompt} tokens, longer than --ctx {ctx}")]
    PromptTooLong { prompt: usize, ctx: usize },
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
}

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A GGUF file.
    File(PathBuf),
    /// A synthetic preset built in memory: tiny, small, flash-4l, or flash (drawn in device memory).
    Preset(String),
    /// `./ds4flash.gguf` if it exists, else the embedded tiny synthetic model.
    Default,
}

/// A model and its tokenizer, with a line saying where they came from.
pub struct Loaded {
    pub model: Arc<Model>,
    pub tokenizer: Tokenizer,
    pub source: String,
    /// Things worth telling the user (e.g. that the embedded model's output is noise).
    pub notes: Vec<String>,
}

/// Opens a GGUF file named by an option, with a message naming the option for a missing file or
/// a directory (a directory would otherwise fail to map with an obscure OS error).
pub fn open_gguf(path: &Path, option: &str) -> Result<gguf::File, EngineError> {
    if !path.exists() {
        return Err(EngineError::Invalid(format!("{option}: model file {} does not exist", path.display())));
    }
    if path.is_dir() {
        return Err(EngineError::Invalid(format!("{option}: {} is a directory, not a GGUF file", path.display())));
    }
    Ok(gguf::File::open(path)?)
}

/// Resolves and loads a model and its tokenizer.
pub fn load(source: &ModelSource) -> Result<Loaded, EngineError> {
    load_with(source, false)
}

/// As [`load`], for a backend that draws a preset's weights in its own memory (cuda): a preset
/// with a recipe (small, flash-4l, flash) is not built on the host. flash-4l's 9.5 GB host image
/// took about 20 s to build and was never read.
pub fn load_for_device(source: &ModelSource) -> Result<Loaded, EngineError> {
    load_with(source, true)
}

fn load_with(source: &ModelSource, device_only: bool) -> Result<Loaded, EngineError> {
    let mut notes = Vec::new();
    let (file, source, synthetic) = match source {
        ModelSource::Preset(name) => {
            let preset = Preset::by_name(name).ok_or_else(|| {
                EngineError::Invalid(format!("unknown preset '{name}' (tiny, small, flash-4l, flash)"))
            })?;
            if name == "flash" || (device_only && name != "tiny") {
                // Drawn in device memory by the backend, never built on the host: Flash (about
                // 80 GB) always, the other presets with a recipe when only the GPU reads them.
                let model = synth::device_model(&preset, EMBEDDED_SEED)?;
                let tokenizer = Tokenizer::from_gguf(&model.file)?;
                let source = format!("synthetic '{name}' model (drawn in device memory)");
                return Ok(Loaded { model, tokenizer, source, notes });
            }
            let bytes = synth::build(&preset, EMBEDDED_SEED);
            // small and flash-4l also carry their recipe: a GPU draws the weights itself (the same
            // bits), and a check against the CPU, which reads the host bytes, tests that drawing too.
            let synthetic = (name != "tiny").then(|| synth::synthetic(&preset, EMBEDDED_SEED));
            (
                gguf::File::from_bytes(format!("synthetic {name} model"), bytes)?,
                format!("synthetic '{name}' model (in memory)"),
                synthetic,
            )
        }
        ModelSource::File(p) => (open_gguf(p, "-m/--model")?, p.display().to_string(), None),
        ModelSource::Default if Path::new(DEFAULT_MODEL).exists() => {
            (open_gguf(Path::new(DEFAULT_MODEL), "-m/--model")?, DEFAULT_MODEL.to_string(), None)
        }
        ModelSource::Default => {
            let bytes = synth::build(&Preset::tiny(), EMBEDDED_SEED);
            notes.push(format!(
                "no -m given and no ./{DEFAULT_MODEL}: running the embedded tiny synthetic model \
                 (random weights, byte-level stand-in tokenizer; its output is noise)"
            ));
            let file = gguf::File::from_bytes("embedded tiny model", bytes)?;
            (file, "embedded tiny synthetic model".to_string(), None)
        }
    };
    // The model first: a tokenizer-only file or another architecture is named as such, rather
    // than reported as a missing tokenizer key.
    let model = Model::from_file_synthetic(file, synthetic)?;
    let tokenizer = Tokenizer::from_gguf(&model.file)?;
    if tokenizer.vocab_size() != model.config.n_vocab {
        return Err(EngineError::Invalid(format!(
            "{}: the tokenizer has {} tokens but the model's vocabulary is {}",
            model.file.name(),
            tokenizer.vocab_size(),
            model.config.n_vocab
        )));
    }
    Ok(Loaded { model, tokenizer, source, notes })
}

/// The profile a backend computes in: GPU backends only `canonical`; the CPU `ds4` by default.
pub fn numerics_for(kind: BackendKind, asked: Option<Numerics>) -> Result<Numerics, EngineError> {
    match (kind, asked) {
        (BackendKind::Cpu, None) => Ok(Numerics::Ds4),
        (BackendKind::Cpu, Some(a)) => Ok(a),
        (_, None | Some(Numerics::Canonical)) => Ok(Numerics::Canonical),
        (k, Some(Numerics::Ds4)) => Err(EngineError::Invalid(format!(
            "--numerics ds4 is the CPU's profile; the {k} backend implements only --numerics canonical"
        ))),
    }
}

/// How to pick and set up a backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackendChoice {
    /// None: auto, the first of cuda, wgpu, cpu that this build and machine offer (only the cpu
    /// with `Numerics::Ds4`).
    pub kind: Option<BackendKind>,
    /// CPU worker threads (0: all cores).
    pub threads: usize,
    /// CUDA: capture the token as one graph.
    pub graphs: bool,
    /// None: the backend's default profile.
    pub numerics: Option<Numerics>,
    /// CUDA: the device memory budget and a forced placement.
    pub placement: crate::placement::PlacementRequest,
    /// Called while weights load with (bytes done, bytes in all).
    pub load_progress: Option<fn(u64, u64)>,
}

/// Creates the backend asked for. The second value says why auto fell back to the CPU.
pub fn make_backend(c: &BackendChoice) -> Result<(Box<dyn Backend>, Option<String>), EngineError> {
    let opts = |kind| -> Result<BackendOptions, EngineError> {
        if kind != BackendKind::Cuda && !c.placement.is_default() {
            return Err(EngineError::Invalid(format!(
                "--vram-budget and --placement apply to the cuda backend, not to {kind}"
            )));
        }
        Ok(BackendOptions {
            threads: c.threads,
            graphs: c.graphs,
            numerics: numerics_for(kind, c.numerics)?,
            placement: c.placement,
            load_progress: c.load_progress,
        })
    };
    // A placement request is for the cuda backend: auto means cuda then.
    let kind = c.kind.or((!c.placement.is_default()).then_some(BackendKind::Cuda));
    match kind {
        Some(kind) => Ok((backend::create(kind, opts(kind)?)?, None)),
        None if c.numerics == Some(Numerics::Ds4) => {
            Ok((backend::create(BackendKind::Cpu, opts(BackendKind::Cpu)?)?, None))
        }
        None => {
            let mut skipped = Vec::new();
            for kind in [BackendKind::Cuda, BackendKind::Wgpu] {
                match backend::create(kind, opts(kind)?) {
                    Ok(b) => return Ok((b, None)),
                    Err(e) => skipped.push(e.msg),
                }
            }
            let note = format!("--backend auto chose cpu (cuda: {}; wgpu: {})", skipped[0], skipped[1]);
            Ok((backend::create(BackendKind::Cpu, opts(BackendKind::Cpu)?)?, Some(note)))
        }
    }
}

/// Refuses a context longer than the model was trained for: past it the caches only cost
/// memory and time.
pub fn check_ctx(loaded: &Loaded, ctx: usize) -> Result<(), EngineError> {
    if let Some(max) = loaded.model.config.context_length {
        if ctx as u64 > max {
            return Err(EngineError::Invalid(format!(
                "-c/--ctx {ctx} is more than the model's context length {max} ({})",
                loaded.source
            )));
        }
    }
    Ok(())
}

/// What one `generate` call does.
#[derive(Debug, Clone, Copy)]
pub struct GenParams {
    pub sampler: SamplerConfig,
    /// Tokens to sample at most; fewer when the context ends first.
    pub max_tokens: usize,
    /// Keep going past the end-of-sentence token.
    pub ignore_eos: bool,
    /// Report the logits after every fed token ([`Event::Logits`]); this feeds the prompt token by
    /// token and never reuses a prefix, so every row is there, and samples on the host from the
    /// logits it read. Without it nothing but the sampled ids comes back from a backend that
    /// samples on the device.
    pub logits: bool,
}

/// Prompt tokens fed, at least, between two chances to stop a prefill (rounded up to whole
/// prefill chunks of the session).
const PREFILL_CHUNK: usize = 32;

/// What `generate` reports while it runs.
#[derive(Debug)]
pub enum Event<'a> {
    /// `done` of the `total` prompt tokens that need prefilling are in. Returning false stops
    /// the call at the end of the current piece of the prompt (32 tokens, or whole prefill
    /// chunks of at least that).
    Prefill { done: usize, total: usize },
    /// The logits after a fed token (only with [`GenParams::logits`]).
    Logits(&'a [f32]),
    /// A sampled token and the text it completes (UTF-8 safe: a split character waits for the
    /// next token; empty for the end-of-sentence token).
    Token { id: u32, text: &'a str },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The end-of-sentence token.
    Eos,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The callback asked to stop.
    Callback,
}

/// What one `generate` call did.
#[derive(Debug, Clone)]
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose state the session already held.
    pub reused: usize,
    /// Prompt tokens fed now.
    pub prefilled: usize,
    /// Tokens sampled (the end-of-sentence token included).
    pub generated: usize,
    /// Decode steps: sampled tokens fed back (the last one never is; one that ended the call
    /// early is where the session feeds ahead).
    pub decoded: usize,
    /// Until the first sampled token, whose sampling waits for the prompt's steps on a GPU (the
    /// whole call when nothing is sampled).
    pub prefill_time: Duration,
    /// From the first sampled token to the last: the decode steps and their samples.
    pub decode_time: Duration,
    /// From the call to the first sampled token.
    pub first_token: Option<Duration>,
    pub stop: StopReason,
    /// Text still held by the UTF-8 decoder at the end (an unfinished character as U+FFFD).
    pub tail: String,
}

/// A loaded model with one compiled session: the weights are uploaded once, here.
pub struct Engine {
    pub loaded: Loaded,
    session: Session,
    /// The backend the session runs on (what auto chose), with the CPU's thread count.
    pub backend_label: String,
    /// Token ids whose state the session holds, in order. Empty after an error: the state is then
    /// unknown and the next call starts afresh.
    history: Vec<u32>,
    /// The last token sampled and not fed (the end-of-sentence token, say), if the last call
    /// ended so: a conversation sent back continues with it.
    unfed: Option<u32>,
    /// Test hook ([`Engine::force_output`]): ids to emit instead of sampling.
    forced: Option<Vec<u32>>,
}

impl Engine {
    /// Compiles a session of `ctx` positions on `backend`, with the backend's prefill chunk.
    pub fn new(loaded: Loaded, backend: &dyn Backend, ctx: usize, threads: usize) -> Result<Engine, EngineError> {
        Engine::with_prefill_chunk(loaded, backend, ctx, threads, None)
    }

    /// [`Engine::new`] feeding prompts `chunk` tokens at a time (None: the backend's default;
    /// 1: token by token). See [`Session::with_prefill_chunk`].
    pub fn with_prefill_chunk(
        loaded: Loaded,
        backend: &dyn Backend,
        ctx: usize,
        threads: usize,
        chunk: Option<usize>,
    ) -> Result<Engine, EngineError> {
        check_ctx(&loaded, ctx)?;
        let chunk = chunk.unwrap_or_else(|| backend.default_prefill_chunk());
        let session = Session::with_prefill_chunk(loaded.model.clone(), backend, ctx, chunk)?;
        let backend_label = if backend.name() == "cpu" {
            let threads = if threads == 0 { rayon::current_num_threads() } else { threads };
            format!("cpu ({threads} threads)")
        } else {
            backend.name().to_string()
        };
        Ok(Engine { loaded, session, backend_label, history: Vec::new(), unfed: None, forced: None })
    }

    /// Test hook: every `generate` call emits these ids in turn, then the end-of-sentence token,
    /// instead of sampling (the prompt is fed and each emitted id decoded as usual). Lets the
    /// server's tests see a known answer (a tool call, say) from a model whose output is noise.
    pub fn force_output(&mut self, ids: Option<Vec<u32>>) {
        self.forced = ids;
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.loaded.tokenizer
    }
    pub fn model(&self) -> &Arc<Model> {
        &self.loaded.model
    }
    pub fn session(&mut self) -> &mut Session {
        // Whoever drives the session directly may change its state behind the history's back.
        self.history.clear();
        self.unfed = None;
        &mut self.session
    }
    pub fn ctx(&self) -> usize {
        self.session.ctx()
    }

    /// `prompt`, with the session's own tokens for a part that spells the same bytes. A client
    /// sends back the model's answer as text, which the prompt renderer tokenizes its own way;
    /// the model may have sampled another split of the same bytes (a multi-byte token where the
    /// renderer writes single bytes, say). The session's tokens then cover the bytes they spell,
    /// and `reusable` counts them. The prompt comes back unchanged when its bytes differ from what
    /// the session holds, or it extends the session's tokens already.
    pub fn align(&self, prompt: &[u32]) -> Vec<u32> {
        if self.history.is_empty() || prompt.starts_with(&self.history) {
            return prompt.to_vec();
        }
        let tok = &self.loaded.tokenizer;
        // The session's tokens and, first, the unfed one after them; then without it.
        let with_unfed: Vec<u32> = self.history.iter().copied().chain(self.unfed).collect();
        for held in [&with_unfed[..], &self.history[..]] {
            let same = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            let want = tok.decode(&held[same..]);
            // The prompt tokens after `same` that spell exactly those bytes.
            let mut spelled = Vec::new();
            let mut end = same;
            while spelled.len() < want.len() && end < prompt.len() {
                spelled.extend(tok.token_bytes(prompt[end]).unwrap_or_default());
                end += 1;
            }
            if spelled == want {
                let mut out = held.to_vec();
                out.extend_from_slice(&prompt[end..]);
                return out;
            }
        }
        prompt.to_vec()
    }

    /// How many leading tokens of `prompt` the session holds already and `generate` would reuse:
    /// all it holds when that is a prefix of `prompt`, else none.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        if !self.history.is_empty() && prompt.starts_with(&self.history) {
            self.history.len()
        } else {
            0
        }
    }

    /// Feeds `prompt` (reusing the state of a prefix already fed), then samples up to
    /// `max_tokens` tokens, calling `on` for each event; `on` returning false stops the call
    /// after that event. The last sampled token is not fed (nothing would read its logits). Where
    /// the session feeds ahead ([`Session::feeds_ahead`]: the GPU backends), every token before
    /// the last is fed as it is sampled, so one that ends the call early (an end of sentence, a
    /// stop from `on`) is held by the session like the rest of the answer.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        p: &GenParams,
        mut on: impl FnMut(Event) -> bool,
    ) -> Result<GenStats, EngineError> {
        p.sampler.validate()?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let ctx = self.session.ctx();
        if prompt.len() > ctx {
            return Err(EngineError::PromptTooLong { prompt: prompt.len(), ctx });
        }
        let t0 = Instant::now();
        // Reuse only when everything the session holds is a prefix of the prompt. A prompt that
        // diverges earlier starts over: the KV ring and the compressor and indexer state cannot be
        // rolled back to an earlier position, only reset.
        let reused = if p.logits { 0 } else { self.reusable(prompt) };
        let history = std::mem::take(&mut self.history);
        self.unfed = None;
        if reused == 0 && self.session.pos() > 0 {
            self.session.reset()?;
        }
        let suffix = &prompt[reused..];
        let mut stats = GenStats {
            prompt_tokens: prompt.len(),
            reused,
            prefilled: suffix.len(),
            generated: 0,
            decoded: 0,
            prefill_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            first_token: None,
            stop: StopReason::Length,
            tail: String::new(),
        };
        let mut fed = if reused > 0 { history } else { Vec::with_capacity(prompt.len()) };
        let mut stopped = false;
        // A prompt held whole needs nothing fed: the session's state is already after its last
        // token, and sampling starts from there.
        if p.logits {
            // One row of logits per token, in prefill chunks; a stop takes effect at the end of
            // the chunk, where the state still matches `fed`.
            let total = suffix.len();
            let n = self.session.feed_with_logits(suffix, |i, l| {
                let go = on(Event::Logits(l)) && on(Event::Prefill { done: i + 1, total });
                stopped |= !go;
                go
            })?;
            fed.extend_from_slice(&suffix[..n]);
            if stopped {
                stats.prefilled = n;
            }
        } else {
            // In pieces: a caller that asks to stop (a client gone) stops at the end of a piece,
            // where the state still matches `fed`. No logits come back: the first token is
            // sampled after the prompt like every other.
            let total = suffix.len();
            let chunk = self.session.prefill_chunk();
            let piece = chunk * PREFILL_CHUNK.div_ceil(chunk);
            for (n, chunk) in suffix.chunks(piece).enumerate() {
                let start = n * piece;
                let mut go = true;
                self.session.feed(chunk, |done| go &= on(Event::Prefill { done: start + done, total }))?;
                fed.extend_from_slice(chunk);
                if !go {
                    stats.prefilled = start + chunk.len();
                    stopped = true;
                    break;
                }
            }
        }
        stats.prefill_time = t0.elapsed();
        if stopped {
            self.history = fed;
            stats.stop = StopReason::Callback;
            return Ok(stats);
        }

        let n_gen = p.max_tokens.min(ctx - prompt.len());
        let mut sampler = Sampler::new(p.sampler);
        let tok = &self.loaded.tokenizer;
        let eos = tok.specials().eos;
        let mut text = StreamDecoder::new();
        let mut t_decode = Instant::now();
        let mut unfed = None;
        for i in 0..n_gen {
            // Sampled on the device where the backend can (only the id comes back), else on the
            // host from the logits; with `p.logits` they were read already and the host samples.
            // Where the session feeds ahead, a token before the last is fed as it is sampled (its
            // step queued before the host sees it), an end of sentence too.
            let ahead = self.forced.is_none() && !p.logits && i + 1 < n_gen && self.session.feeds_ahead();
            let next = match &self.forced {
                Some(ids) => ids.get(i).copied().unwrap_or(eos),
                None if ahead => self.session.sample_and_feed(&mut sampler)?,
                None => self.session.sample(&mut sampler)?,
            };
            if ahead {
                fed.push(next);
                stats.decoded += 1;
                unfed = None;
            } else {
                unfed = Some(next);
            }
            stats.generated += 1;
            if stats.first_token.is_none() {
                // A GPU runs the prompt's steps while the host goes on: the first sample waits for
                // them, so the prefill ends here and the decode's clock starts here.
                stats.first_token = Some(t0.elapsed());
                stats.prefill_time = t0.elapsed();
                t_decode = Instant::now();
            }
            let piece = if next == eos { String::new() } else { text.push(&tok.token_bytes(next).unwrap_or_default()) };
            if !on(Event::Token { id: next, text: &piece }) {
                stats.stop = StopReason::Callback;
                break;
            }
            if next == eos && !p.ignore_eos {
                stats.stop = StopReason::Eos;
                break;
            }
            if i + 1 < n_gen && !ahead {
                let logits = if p.logits {
                    Some(self.session.eval(next)?)
                } else {
                    self.session.feed(&[next], |_| {})?;
                    None
                };
                fed.push(next);
                unfed = None;
                stats.decoded += 1;
                if let Some(l) = logits {
                    if !on(Event::Logits(l)) {
                        stats.stop = StopReason::Callback;
                        break;
                    }
                }
            }
        }
        stats.decode_time = t_decode.elapsed();
        stats.tail = text.finish();
        self.history = fed;
        self.unfed = unfed;
        Ok(stats)
    }

    /// The model, the session and the backend label, for callers that drive the session
    /// themselves (`ds4 check`, `ds4 bench`).
    pub fn into_parts(self) -> (Loaded, Session, String) {
        (self.loaded, self.session, self.backend_label)
    }

    /// Diagnostics from the backend since the last call.
    pub fn take_warnings(&mut self) -> Vec<String> {
        self.session.take_warnings()
    }
}
