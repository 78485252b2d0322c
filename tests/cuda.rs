//! The CUDA backend against the canonical CPU, bit for bit. These need an NVIDIA GPU, so they are
//! `#[ignore]`d in a plain `cargo test` (CI has no GPU) and reported as ignored, not passed;
//! `scripts/gpu-check` runs them with `--ignored` on a GPU machine, where a missing GPU fails.

mod common;

use std::sync::Arc;

use ds4::backend::{self, BackendKind, BackendOptions};
use ds4::backends::cpu::CpuBackend;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::recorder::StepParams;
use ds4::session::Session;

use common::{golden, golden_tokens};

fn cuda(graphs: bool) -> Box<dyn ds4::backend::Backend> {
    let opts = BackendOptions { threads: 0, graphs, numerics: Numerics::Canonical };
    backend::create(BackendKind::Cuda, opts).expect("this test needs an NVIDIA GPU and libcuda/libnvrtc")
}

/// Teacher-forced on `tokens`, then greedy (on the reference's argmax) for `extra` steps.
fn compare(model: &Arc<Model>, graphs: bool, tokens: &[u32], extra: usize, ctx: usize) {
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let gpu = cuda(graphs);
    let mut a = Session::new(model.clone(), &cpu, ctx).unwrap();
    let mut b = Session::new(model.clone(), gpu.as_ref(), ctx).unwrap();
    let mut next = tokens[0];
    for i in 0..tokens.len() + extra {
        let t = if i < tokens.len() { tokens[i] } else { next };
        let want = a.eval(t).unwrap().to_vec();
        let got = b.eval(t).unwrap();
        let same = want.iter().zip(got).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "graphs={graphs}: step {i} (token {t}) differs from the canonical CPU");
        next = ds4::sample::argmax(&want);
    }
    assert!(b.take_warnings().is_empty(), "no fallback expected");
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn cuda_equals_canonical_cpu_on_the_golden_tokens_graphs_on_and_off() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = golden_tokens();
    compare(&model, false, &tokens, 0, 256);
    compare(&model, true, &tokens, 40, 256);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn cuda_refuses_positions_and_tokens_out_of_range() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let gpu = cuda(false);
    let mut s = Session::new(model.clone(), gpu.as_ref(), 16).unwrap();
    let exe = s.executable();
    let e = exe.step(&StepParams::new(1, 16)).unwrap_err().to_string();
    assert!(e.contains("position 16") && e.contains("16 positions"), "{e}");
    let e = exe.step(&StepParams::new(model.config.n_vocab as u32, 0)).unwrap_err().to_string();
    assert!(e.contains("vocabulary"), "{e}");
    // A refused step runs nothing: the next good one gives the same logits as a fresh session.
    exe.step(&StepParams::new(5, 0)).unwrap();
    let mut got = Vec::new();
    exe.read_logits(&mut got).unwrap();
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let mut c = Session::new(model, &cpu, 16).unwrap();
    assert!(c.eval(5).unwrap().iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// Logits of `n` greedy steps from token 0 on the CUDA backend, with an optional injected failure.
fn cuda_run(graphs: bool, inject: Option<ds4::backend::GraphFailure>, n: usize) -> (Vec<Vec<u32>>, Vec<String>) {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let gpu = cuda(graphs);
    let mut s = Session::new(model, gpu.as_ref(), 256).unwrap();
    if let Some(f) = inject {
        s.executable().inject_graph_failure(f).unwrap();
    }
    let mut out = Vec::new();
    let mut t = 0;
    for _ in 0..n {
        let l = s.eval(t).unwrap();
        t = ds4::sample::argmax(l);
        out.push(l.iter().map(|v| v.to_bits()).collect());
    }
    (out, s.take_warnings())
}

/// A capture or a graph launch that fails falls back to eager launches without losing the
/// token: every step's logits equal an eager run's, and the fallback is reported.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn a_failed_capture_or_graph_launch_loses_no_token() {
    use ds4::backend::GraphFailure;
    let (eager, _) = cuda_run(false, None, 24);
    for f in [GraphFailure::Capture, GraphFailure::Launch { at_token: 7 }] {
        let (got, warnings) = cuda_run(true, Some(f), 24);
        assert!(got == eager, "{f:?}: logits differ from the eager run");
        assert_eq!(warnings.len(), 1, "{f:?}: {warnings:?}");
    }
}
