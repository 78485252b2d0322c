//! A decoding session: one recorded program, its compiled executable and caches sized for a
//! context length, and the position counter that produces each token's `StepParams`.

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
}

impl Session {
    /// Records the token program once for `ctx` positions and compiles it on `backend`.
    pub fn new(model: Arc<Model>, backend: &dyn Backend, ctx: usize) -> Result<Session, SessionError> {
        const MAX_CTX: usize = 1 << 24;
        if ctx == 0 || ctx > MAX_CTX {
            return Err(SessionError::BadContext { ctx, max: MAX_CTX });
        }
        let caps = Caps { ctx: ctx as u32 };
        let program = Arc::new(decode::record_token(&model, caps).map_err(SessionError::Record)?);
        let exe = backend.compile(program, model.clone())?;
        Ok(Session {
            model,
            backend: backend.name(),
            numerics: backend.numerics(),
            exe,
            caps,
            pos: 0,
            logits: Vec::new(),
        })
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

    /// Feeds tokens without reading any logits back; `progress(done)` is called after each token.
    /// Checks that they all fit before running anything. Follow with [`Session::sample`].
    pub fn feed(&mut self, tokens: &[u32], mut progress: impl FnMut(usize)) -> Result<(), SessionError> {
        self.check(tokens)?;
        for (i, &t) in tokens.iter().enumerate() {
            self.step(t)?;
            progress(i + 1);
        }
        Ok(())
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

    /// Feeds a prompt token by token; `progress(done)` is called after each token. Checks that
    /// the whole prompt fits before running anything. Returns the logits after the last token.
    pub fn prefill(&mut self, tokens: &[u32], progress: impl FnMut(usize)) -> Result<&[f32], SessionError> {
        self.feed(tokens, progress)?;
        if self.pos > 0 && self.logits.is_empty() {
            self.exe.read_logits(&mut self.logits)?;
        }
        Ok(&self.logits)
    }

    /// Diagnostics from the backend since the last call (see `Executable::take_warnings`).
    pub fn take_warnings(&mut self) -> Vec<String> {
        self.exe.take_warnings()
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
