//! The wgpu backend against the canonical CPU, bit for bit. CI runs these on Mesa's lavapipe
//! (`.ci/run` installs it); a machine without any wgpu adapter fails them, it does not skip.

mod common;

use std::sync::Arc;

use ds4::backend::{Backend, BackendKind, BackendOptions};
use ds4::backends::cpu::CpuBackend;
use ds4::backends::wgpu::WgpuBackend;
use ds4::gguf::File;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::recorder::StepParams;
use ds4::session::Session;
use ds4::synth::{self, Preset};

use common::{golden, golden_tokens};

fn wgpu_backend() -> Box<dyn Backend> {
    let opts = BackendOptions { threads: 0, graphs: false, numerics: Numerics::Canonical };
    ds4::backend::create(BackendKind::Wgpu, opts)
        .unwrap_or_else(|e| panic!("this test needs a wgpu adapter (lavapipe in CI): {e}"))
}

/// Teacher-forced on `tokens`, then greedy (on the reference's argmax) for `extra` steps; every
/// step's logits must have the same bits. Returns the number of steps compared.
fn compare(model: &Arc<Model>, gpu: &dyn Backend, tokens: &[u32], extra: usize, ctx: usize) -> usize {
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let mut a = Session::new(model.clone(), &cpu, ctx).unwrap();
    let mut b = Session::new(model.clone(), gpu, ctx).unwrap();
    let mut next = tokens[0];
    let n = tokens.len() + extra;
    for i in 0..n {
        let t = if i < tokens.len() { tokens[i] } else { next };
        let want = a.eval(t).unwrap().to_vec();
        let got = b.eval(t).unwrap();
        let bad = want.iter().zip(got).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        let worst = want.iter().zip(got).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(bad == 0 && want.len() == got.len(), "step {i} (token {t}): {bad} logits differ, worst {worst}");
        next = ds4::sample::argmax(&want);
    }
    n
}

#[test]
fn wgpu_equals_canonical_cpu_on_the_golden_tokens_then_greedy() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = golden_tokens();
    let gpu = wgpu_backend();
    let n = compare(&model, gpu.as_ref(), &tokens, 300usize.saturating_sub(tokens.len()), 512);
    assert!(n >= 300, "{n} steps");
}
