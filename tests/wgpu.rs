//! The wgpu backend against the canonical CPU, bit for bit. CI runs these on Mesa's lavapipe
//! (`.ci/run` installs it); a machine without any wgpu adapter fails them, it does not skip.
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

use common::{golden, golden_tokens};

fn wgpu_backend() -> Box<dyn Backend> {
    let opts = BackendOptions { threads: 0, graphs: false, numerics: Numerics::Canonical, ..Default::default() };
    ds4::backend::create(BackendKind::Wgpu, opts)
        .unwrap_or_else(|e| panic!("this test needs a wgpu adapter (lavapipe in CI): {e}"))
}

fn wgpu_tuned(tuning: Tuning) -> WgpuBackend {
    WgpuBackend::new(None, tuning).unwrap_or_else(|e| panic!("this test needs a wgpu adapter (lavapipe in CI): {e}"))
}

fn preset_model(p: &Preset) -> Arc<Model> {
    Model::from_file(File::from_bytes("t", synth::build(p, 1)).unwrap()).unwrap()
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

/// The 32-lanes-per-row matvecs (what a GPU adapter runs) give the same bits as well: the default
/// on lavapipe is one invocation per row, so this forces the other shape, on fewer tokens.
#[test]
fn wgpu_32_lane_rows_equal_canonical_cpu_on_the_golden_tokens() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = golden_tokens();
    let gpu = wgpu_tuned(Tuning { rows_per_invocation: Some(false), ..Tuning::default() });
    compare(&model, &gpu, &tokens[..40], 0, 256);
}

/// The 32-lane shape on `small` too: its expert rows of 4 blocks run 8 rows per 32 lanes
/// (`moe_gate_up` / `moe_down` with fewer lanes per row), which tiny's 1-block rows do not show.
#[test]
fn wgpu_32_lane_rows_equal_canonical_cpu_on_small_tokens() {
    let model = preset_model(&Preset::small());
    let gpu = wgpu_tuned(Tuning { rows_per_invocation: Some(false), ..Tuning::default() });
    assert_eq!(compare(&model, &gpu, &[1, 7, 300, 42], 4, 64), 8);
}

#[test]
fn wgpu_equals_canonical_cpu_over_200_small_tokens() {
    let model = preset_model(&Preset::small());
    let gpu = wgpu_backend();
    assert_eq!(compare(&model, gpu.as_ref(), &[1, 7, 300, 42], 196, 256), 200);
}

/// Weights larger than a storage binding are split into row and expert ranges: with a 64 KiB
/// limit every matrix of the tiny model is split (the 512-row Q8_0 output head into 4, the
/// experts into 2-expert ranges), and the results keep every bit, in both matvec shapes.
#[test]
fn weights_split_over_small_bindings_give_the_same_bits() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = golden_tokens();
    for rows in [true, false] {
        let whole = wgpu_tuned(Tuning { rows_per_invocation: Some(rows), ..Tuning::default() });
        let unsplit = Session::new(model.clone(), &whole, 64).unwrap().executable().nodes_per_token().unwrap();
        let tuning = Tuning { max_binding: Some(64 << 10), rows_per_invocation: Some(rows), ..Tuning::default() };
        let gpu = wgpu_tuned(tuning);
        let mut s = Session::new(model.clone(), &gpu, 64).unwrap();
        let split = s.executable().nodes_per_token().unwrap();
        assert!(split > unsplit + 20, "the split weights add dispatches: {split} against {unsplit}");
        drop(s);
        compare(&model, &gpu, &tokens[..24], 0, 64);
    }
}

#[test]
fn wgpu_refuses_positions_and_tokens_out_of_range() {
    common::assert_refuses_positions_and_tokens_out_of_range(wgpu_backend().as_ref());
}

#[test]
fn an_adapter_that_is_not_there_is_a_clear_error() {
    let e = WgpuBackend::new(Some("no-such-adapter-xyz"), Tuning::default()).err().expect("no such adapter");
    assert!(e.to_string().contains("no-such-adapter-xyz") && e.to_string().contains("adapters found"), "{e}");
}

/// The indexer's top-k on wgpu (a radix select) equals the CPU's pick on crafted scores: ties,
/// NaN, -1e30, infinities, signed zeros, fewer pickable rows than k, several workgroups' rows.
#[test]
fn wgpu_top_k_equals_the_cpu_on_crafted_scores() {
    common::assert_top_k_equals_the_cpu(wgpu_backend().as_ref());
}
