//! A decoding session: one recorded program, its compiled executable and caches sized for a
//! context length, and the position counter that produces each token's `StepParams`.
//!
//! With a prefill chunk of T > 1 tokens the session also records a chunk program (T rows, once)
//! and attaches it to the executable, which runs it on the same state (`decode` module doc): a
//! prompt is then fed T tokens per step, with the same bits as token by token. A backend without
//! chunk programs falls back to token by token and says so once ([`Session::take_warnings`]).

use std::sync::Arc;

use crate::backend::{Backend, BackendError, Executable};
use crate::decode::{self, Caps};
use crate::model::Model;
use crate::numerics::Numerics;
use crate::recorder::{Program, StepParams};
use crate::sample::Sampler;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("context is full: {needed} tokens do not fit in the remaining {remaining} of --ctx {ctx}")]
    ContextFull { needed: usize, remaining: usize, ctx: usize },
    #[error("token id {token} is outside the vocabulary ({n_vocab} tokens)")]
    BadToken { token: u32, n_vocab: usize },
    #[error("no token has been fed yet: there is nothing to sample from")]
    NothingFed,
    #[error("context length must be between 1 and {max}, got {ctx}")]
    BadContext { ctx: usize, max: usize },
    #[error("a prefill chunk holds at least 1 token, got 0")]
    BadChunk,
    #[error("recording the token program failed: {0}")]
    Record(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

pub struct Session {
    model: Arc<Model>,
    backend: &'static str,
    numerics: Numerics,
    exe: Box<dyn Executable>,
    caps: Caps,
    pos: u32,
    /// The logits after the last token fed, when they were read back; empty otherwise.
    logits: Vec<f32>,
    /// Rows of the attached chunk program (1: none, token by token).
    rows: usize,
    /// Prompt tokens per chunk now (1 ..= rows).
    chunk: usize,
    /// Diagnostics of the session itself, for [`Session::take_warnings`].
    warnings: Vec<String>,
}

impl Session {
    /// Records the token program once for `ctx` positions and compiles it on `backend`, with the
    /// backend's default prefill chunk ([`Backend::default_prefill_chunk`]).
    pub fn new(model: Arc<Model>, backend: &dyn Backend, ctx: usize) -> Result<Session, SessionError> {
        Session::with_prefill_chunk(model, backend, ctx, backend.default_prefill_chunk())
    }

    /// [`Session::new`] with prompts fed `chunk` tokens at a time (1: token by token; at most the
    /// context). A backend without chunk programs feeds token by token and says so once.
    pub fn with_prefill_chunk(
        model: Arc<Model>,
        backend: &dyn Backend,
        ctx: usize,
        chunk: usize,
    ) -> Result<Session, SessionError> {
        const MAX_CTX: usize = 1 << 24;
        if ctx == 0 || ctx > MAX_CTX {
            return Err(SessionError::BadContext { ctx, max: MAX_CTX });
        }
        if chunk == 0 {
            return Err(SessionError::BadChunk);
        }
        let mut warnings = Vec::new();
        let mut chunk = chunk.min(ctx);
        if chunk > 1 && backend.default_prefill_chunk() <= 1 {
            warnings.push(format!("{} backend: no batched prefill; prefilling token by token", backend.name()));
            chunk = 1;
        }
        let caps = Caps { ctx: ctx as u32 };
        let rows = chunk as u32;
        let program = Arc::new(decode::record(&model, caps, 1, rows).map_err(SessionError::Record)?);
        let mut exe = backend.compile(program, model.clone())?;
        if chunk > 1 {
            let chunk_program = Arc::new(decode::record(&model, caps, rows, rows).map_err(SessionError::Record)?);
            // A backend that cannot run this chunk program here (for example CUDA with experts
            // cached from host memory) still decodes: the prompt goes token by token.
            if let Err(e) = exe.attach_chunk(chunk_program) {
                warnings.push(format!("{} backend: {}; prefilling token by token", backend.name(), e.msg));
                chunk = 1;
            }
        }
        Ok(Session {
            model,
            backend: backend.name(),
            numerics: backend.numerics(),
            exe,
            caps,
            pos: 0,
            logits: Vec::new(),
            rows: chunk,
            chunk,
            warnings,
        })
    }

    /// Prompt tokens fed per step now (1: token by token).
    pub fn prefill_chunk(&self) -> usize {
        self.chunk
    }

    /// Feeds prompts `n` tokens at a time from now on, at most the chunk the session was created
    /// with (1: token by token, through the decode program). Returns the chunk now in use.
    pub fn set_prefill_chunk(&mut self, n: usize) -> usize {
        self.chunk = n.clamp(1, self.rows);
        self.chunk
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
    /// The name of the backend the session runs on.
    pub fn backend_name(&self) -> &'static str {
        self.backend
    }
    /// The numerics profile the session computes in.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }
    /// The program recorded when the session was created; it serves every position.
    pub fn program(&self) -> &Arc<Program> {
        self.exe.program()
    }
    pub fn executable(&mut self) -> &mut dyn Executable {
        self.exe.as_mut()
    }
    /// The next position to be filled (tokens seen so far).
    pub fn pos(&self) -> usize {
        self.pos as usize
    }
    pub fn ctx(&self) -> usize {
        self.caps.ctx as usize
    }
    pub fn remaining(&self) -> usize {
        self.ctx() - self.pos()
    }

    fn check(&self, tokens: &[u32]) -> Result<(), SessionError> {
        let n_vocab = self.model.config.n_vocab;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(SessionError::BadToken { token, n_vocab });
        }
        if tokens.len() > self.remaining() {
            return Err(SessionError::ContextFull {
                needed: tokens.len(),
                remaining: self.remaining(),
                ctx: self.ctx(),
            });
        }
        Ok(())
    }

    /// Feeds one token without reading the logits back.
    fn step(&mut self, token: u32) -> Result<(), SessionError> {
        self.logits.clear();
        self.exe.step(&StepParams::new(token, self.pos))?;
        self.pos += 1;
        Ok(())
    }

    /// Feeds `tokens` (at most one chunk) as one chunk step, or as a decode step if it is one.
    fn step_piece(&mut self, tokens: &[u32]) -> Result<(), SessionError> {
        if let [t] = tokens {
            return self.step(*t);
        }
        self.logits.clear();
        self.exe.step_chunk(&StepParams::chunk(self.pos, tokens.len() as u32), tokens)?;
        self.pos += tokens.len() as u32;
        Ok(())
    }

    /// Feeds tokens without reading any logits back, in chunks of [`Session::prefill_chunk`];
    /// `progress(done)` is called for each token, once the step that fed it has run (a chunk's
    /// calls come together). Checks that they all fit before running anything. Follow with
    /// [`Session::sample`].
    pub fn feed(&mut self, tokens: &[u32], mut progress: impl FnMut(usize)) -> Result<(), SessionError> {
        self.check(tokens)?;
        let mut done = 0;
        for piece in tokens.chunks(self.chunk) {
            self.step_piece(piece)?;
            for _ in piece {
                done += 1;
                progress(done);
            }
        }
        Ok(())
    }

    /// Feeds tokens in chunks and calls `each(i, logits)` with the logits after token `i`, for
    /// every token in order (one row per token, as token by token). `each` returning false stops
    /// the feeding at the end of the current chunk (no further calls). Returns how many tokens
    /// were fed. Checks that they all fit before running anything.
    pub fn feed_with_logits(
        &mut self,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]) -> bool,
    ) -> Result<usize, SessionError> {
        self.check(tokens)?;
        let n_vocab = self.model.config.n_vocab;
        let mut done = 0;
        let mut rows = Vec::new();
        for piece in tokens.chunks(self.chunk) {
            self.step_piece(piece)?;
            if piece.len() == 1 {
                self.exe.read_logits(&mut rows)?;
            } else {
                self.exe.read_chunk_logits(&mut rows)?;
            }
            let mut go = true;
            for (k, row) in rows.chunks_exact(n_vocab).enumerate() {
                if !each(done + k, row) {
                    go = false;
                    break;
                }
            }
            done += piece.len();
            self.logits.clear();
            self.logits.extend_from_slice(&rows[rows.len() - n_vocab..]);
            if !go {
                break;
            }
        }
        Ok(done)
    }

    /// Samples the token that follows the last one fed. On a backend that samples on the device
    /// only the id comes back; otherwise (or when this position's logits were read already) the
    /// host samples from the logits. Either way the same sampler state gives the same token
    /// (`crate::sample`'s definition), and the sampler advances the same way.
    pub fn sample(&mut self, sampler: &mut Sampler) -> Result<u32, SessionError> {
        if self.pos == 0 {
            return Err(SessionError::NothingFed);
        }
        let draw = sampler.draw();
        if self.logits.is_empty() {
            if let Some(id) = self.exe.sample(&draw)? {
                return Ok(id);
            }
            self.exe.read_logits(&mut self.logits)?;
        }
        Ok(sampler.pick(&self.logits, &draw))
    }

    /// Whether [`Session::sample_and_feed`] overlaps the host's round trip with the next step
    /// (the backend samples and steps on the device); elsewhere it is a sample, then a feed.
    pub fn feeds_ahead(&self) -> bool {
        self.exe.samples_then_steps()
    }

    /// Samples the token that follows the last one fed ([`Session::sample`]) and feeds it. Where
    /// the session [`Session::feeds_ahead`], the step that feeds it is queued on the device before
    /// the id comes back, so the host's read-back hides behind that step. The token is fed
    /// whatever it turns out to be (an end of sentence too): call this only where the caller
    /// would feed any token sampled.
    pub fn sample_and_feed(&mut self, sampler: &mut Sampler) -> Result<u32, SessionError> {
        if self.pos == 0 {
            return Err(SessionError::NothingFed);
        }
        self.check(&[0])?;
        if self.logits.is_empty() && self.exe.samples_then_steps() {
            let draw = sampler.draw();
            let id = self.exe.sample_then_step(&draw, self.pos)?;
            self.pos += 1;
            return Ok(id);
        }
        let id = self.sample(sampler)?;
        self.step(id)?;
        Ok(id)
    }

    /// Feeds one token and samples the next ([`Session::feed`], then [`Session::sample`]).
    pub fn eval_sampled(&mut self, token: u32, sampler: &mut Sampler) -> Result<u32, SessionError> {
        self.feed(&[token], |_| {})?;
        self.sample(sampler)
    }

    /// Feeds one token at the next position and returns the logits that follow it.
    pub fn eval(&mut self, token: u32) -> Result<&[f32], SessionError> {
        self.check(&[token])?;
        self.step(token)?;
        self.exe.read_logits(&mut self.logits)?;
        Ok(&self.logits)
    }

    /// Feeds a prompt ([`Session::feed`]: in chunks); `progress(done)` is called for each token.
    /// Checks that the whole prompt fits before running anything. Returns the logits after the
    /// last token.
    pub fn prefill(&mut self, tokens: &[u32], progress: impl FnMut(usize)) -> Result<&[f32], SessionError> {
        self.feed(tokens, progress)?;
        if self.pos > 0 && self.logits.is_empty() {
            self.exe.read_logits(&mut self.logits)?;
        }
        Ok(&self.logits)
    }

    /// Diagnostics from the backend since the last call (see `Executable::take_warnings`).
    pub fn take_warnings(&mut self) -> Vec<String> {
        let mut w = std::mem::take(&mut self.warnings);
        w.extend(self.exe.take_warnings());
        w
    }

    /// The logits after the last token fed, if they were read back ([`Session::eval`],
    /// [`Session::prefill`], or [`Session::sample`] on a backend that samples on the host);
    /// empty otherwise.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Forgets the context: position 0, caches back to their initial values.
    pub fn reset(&mut self) -> Result<(), SessionError> {
        self.exe.reset()?;
        self.pos = 0;
        self.logits.clear();
        Ok(())
    }
}
