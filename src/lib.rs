//! ds4: a Rust runtime for DeepSeek V4 Flash GGUF files.
//!
//! A decode token is recorded once as a [`recorder::Program`]; backends compile it into an
//! [`backend::Executable`] that is replayed for every token with a new [`recorder::StepParams`].

pub mod backend;
#[path = "../backends/mod.rs"]
pub mod backends;
pub mod chat;
pub mod decode;
pub mod engine;
pub mod gguf;
pub mod model;
pub mod numerics;
pub mod placement;
pub mod quant;
pub mod recorder;
pub mod sample;
pub mod session;
pub mod synth;
pub mod tokenizer;
