//! Batched prefill on the wgpu backend: a prompt fed in chunks (the chunk program) gives, at
//! every position and after the prompt, the canonical CPU's logits fed token by token, bit for
//! bit. CI runs these on Mesa's lavapipe; a machine without any wgpu adapter fails them.
#![cfg(feature = "wgpu")]

mod common;

use std::sync::Arc;

use ds4::backend::{Backend, BackendKind, BackendOptions};
use ds4::backends::cpu::CpuBackend;
use ds4::backends::wgpu::{Tuning, WgpuBackend};
use ds4::gguf::File;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::session::Session;
use ds4::synth::{self, Preset};

use common::{chunked, golden, golden_tokens, same_bits, token_by_token};

fn wgpu_backend() -> Box<dyn Backend> {
    let opts = BackendOptions { threads: 0, graphs: false, numerics: Numerics::Canonical, ..Default::default() };
    ds4::backend::create(BackendKind::Wgpu, opts)
        .unwrap_or_else(|e| panic!("this test needs a wgpu adapter (lavapipe in CI): {e}"))
}

fn canonical() -> CpuBackend {
    CpuBackend::with_numerics(0, Numerics::Canonical).unwrap()
}

fn check(model: &Arc<Model>, tokens: &[u32], ctx: usize, chunks: &[usize], pieces: &[usize]) {
    check_on(wgpu_backend().as_ref(), model, tokens, ctx, chunks, pieces)
}

fn check_on(gpu: &dyn Backend, model: &Arc<Model>, tokens: &[u32], ctx: usize, chunks: &[usize], pieces: &[usize]) {
    let after = [5u32, 77, 300].map(|t| t % model.config.n_vocab as u32);
    let all: Vec<u32> = tokens.iter().chain(&after).copied().collect();
    let want = token_by_token(model, &canonical(), &all, ctx);
    for &chunk in chunks {
        let mut s = Session::with_prefill_chunk(model.clone(), gpu, ctx, chunk).unwrap();
        assert_eq!(s.prefill_chunk(), chunk, "the wgpu backend runs chunks of {chunk}");
        // The prompt in chunks, then three decode steps.
        let mut got = chunked(&mut s, tokens, pieces);
        got.extend(after.iter().map(|&t| s.eval(t).unwrap().to_vec()));
        assert_eq!(got.len(), want.len());
        let bad: Vec<usize> = (0..want.len()).filter(|&i| !same_bits(&got[i], &want[i])).collect();
        assert!(
            bad.is_empty(),
            "chunk {chunk}: positions whose logits differ from the CPU's token by token \
             (>= {} are decode steps after the prompt): {bad:?}",
            tokens.len()
        );
    }
}

/// tiny-a (window 16, ratios 4 and 8, indexer top-k 4 active from position 19): its 64 golden
/// tokens in chunks of 1, 7 and 64, the first call feeding 5 tokens, so that chunks straddle the
/// window's wrap and the compressors' emits; then three decode steps.
#[test]
fn wgpu_chunks_equal_canonical_cpu_token_by_token_on_tiny_a() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    check(&model, &golden_tokens(), 96, &[1, 7, 64], &[5]);
}

/// The `small` preset (window 64, ratios 4 and 16, indexer top-k 16 active from position 67):
/// 72 tokens in chunks of 64 and 7, so that a chunk slides the window and starts the indexer.
#[test]
fn wgpu_chunks_equal_canonical_cpu_token_by_token_on_small() {
    let model = Model::from_file(File::from_bytes("small", synth::build(&Preset::small(), 4)).unwrap()).unwrap();
    let n_vocab = model.config.n_vocab;
    let tokens: Vec<u32> = (0..72).map(|i| ((i * 7919 + 13) % n_vocab) as u32).collect();
    check(&model, &tokens, 128, &[64, 7], &[3]);
}

/// The other shapes a chunk's dispatches come in: 32 lanes per matrix row (what a GPU adapter
/// runs: those matvecs run once per row of the chunk, not batched), and weights split over
/// 64 KiB bindings (several row-range dispatches per matvec, each batched on its own), on
/// tiny-a's first 40 tokens in chunks of 7.
#[test]
fn wgpu_chunks_in_the_other_dispatch_shapes_equal_canonical_cpu() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = &golden_tokens()[..40];
    for tuning in [
        Tuning { rows_per_invocation: Some(false), ..Tuning::default() },
        Tuning { max_binding: Some(64 << 10), rows_per_invocation: Some(true), ..Tuning::default() },
    ] {
        let gpu = WgpuBackend::new(None, tuning)
            .unwrap_or_else(|e| panic!("this test needs a wgpu adapter (lavapipe in CI): {e}"));
        check_on(&gpu, &model, tokens, 64, &[7], &[3]);
    }
}
