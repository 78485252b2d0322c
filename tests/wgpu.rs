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

/// The shaders as SPIR-V with every float operation NoContraction and without the opaque
/// identity (what a Vulkan 1.3 GPU runs by default; lavapipe runs the WGSL unless asked, because
/// its compile takes ~50 s this way, and 4 minutes in the 32-lane shape, which scripts/wgpu-check
/// runs on the H200): the same bits. Without the decorations lavapipe reassociates and the
/// logits differ (measured: 1 of 4 steps).
#[test]
fn wgpu_spirv_with_no_contraction_equals_canonical_cpu_on_the_golden_tokens() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = golden_tokens();
    let gpu = wgpu_tuned(Tuning { spirv: Some(true), ..Tuning::default() });
    assert!(gpu.adapter().contains("SPIR-V with NoContraction"), "{}", gpu.adapter());
    compare(&model, &gpu, &tokens, 0, 256);
}

/// The 32-lane shape on `small` too: its expert rows of 4 blocks run 8 rows per 32 lanes
/// (`moe_gate_up` / `moe_down` with fewer lanes per row), which tiny's 1-block rows do not show;
/// the Q2_K down rows both two to a lane group (`moe_down_q2_k_pairs`) and one (`moe_down`).
#[test]
fn wgpu_32_lane_rows_equal_canonical_cpu_on_small_tokens() {
    let model = preset_model(&Preset::small());
    for pairs in [true, false] {
        let tuning = Tuning { rows_per_invocation: Some(false), moe_down_pairs: Some(pairs), ..Tuning::default() };
        assert_eq!(compare(&model, &wgpu_tuned(tuning), &[1, 7, 300, 42], 4, 64), 8, "moe_down pairs {pairs}");
    }
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

/// Asking for the fma residuals gets them where the start-up probe found an fma that rounds once,
/// and a clear error elsewhere (lavapipe rounds the product first), never Dekker's silently; asking
/// for Dekker's gets them on any adapter.
#[test]
fn the_fma_residuals_are_had_where_the_probe_allows_them_or_refused() {
    match WgpuBackend::new(None, Tuning { fused_fma: Some(true), ..Tuning::default() }) {
        Ok(be) => assert!(be.adapter().contains("fma residuals"), "{}", be.adapter()),
        Err(e) => assert!(e.to_string().contains("does not round once"), "{e}"),
    }
    let dekker = wgpu_tuned(Tuning { fused_fma: Some(false), ..Tuning::default() });
    assert!(dekker.adapter().contains("Dekker residuals"), "{}", dekker.adapter());
}

/// The indexer's top-k on wgpu (a radix select) equals the CPU's pick on crafted scores: ties,
/// NaN, -1e30, infinities, signed zeros, fewer pickable rows than k, several workgroups' rows.
#[test]
fn wgpu_top_k_equals_the_cpu_on_crafted_scores() {
    common::assert_top_k_equals_the_cpu(wgpu_backend().as_ref());
}

/// Sampling on the device (only the id comes back) picks what the host's definition picks for
/// the same draw (`sample::pick`), on crafted logits of the small preset's 8192-token vocabulary:
/// ties straddling the K-th candidate, NaN, infinities, signed zeros, subnormals, nothing finite,
/// and settings at their edges (subnormal temperature and min-p, infinite temperature, top-p 0).
#[test]
fn wgpu_device_sampling_equals_the_host_on_crafted_logits() {
    use ds4::sample::{pick, DeviceSample};
    let model = preset_model(&Preset::small());
    let program = Arc::new(ds4::decode::record_token(&model, ds4::decode::Caps { ctx: 16 }).unwrap());
    let mut exe = wgpu_backend().compile(program.clone(), model).unwrap();
    let n = program.n_vocab();
    let mut seed = 11u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let special =
        [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, f32::MIN_POSITIVE];
    let draw = |temperature: f32, top_k: u32, top_p: f32, min_p: f32, r: f32| DeviceSample {
        temperature,
        top_k,
        top_p,
        min_p,
        r,
    };
    for case in 0..8 {
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let r = next();
                match case {
                    0 => (r % 16001) as f32 / 1000.0 - 8.0,
                    // Five values, over 1600 logits each: the K-th candidate is among equals.
                    1 => (r % 5) as f32 * 0.5,
                    2 => match r % 4 {
                        0 => special[(r / 4) as usize % special.len()],
                        _ => (r % 2001) as f32 / 100.0 - 10.0,
                    },
                    3 => f32::NAN,
                    // Nothing finite: the argmax, the first +inf.
                    4 => [f32::NAN, f32::NEG_INFINITY, f32::INFINITY][(r % 3) as usize],
                    // Around the smallest normal: differences and quotients underflow.
                    5 => f32::from_bits((r % 3) << 23 | (r >> 9)) * if r % 2 == 0 { 1.0 } else { -1.0 },
                    // One spike over zeros of both signs.
                    6 => {
                        if i == 4321 {
                            2.0
                        } else {
                            [0.0, -0.0][(r % 2) as usize]
                        }
                    }
                    _ => 1.0 - (r % 3000) as f32 * 1e-4,
                }
            })
            .collect();
        exe.write_buffer(program.logits(), &v).unwrap();
        let mut r = || (next() >> 7) as f32 / (1u32 << 24) as f32;
        let draws = [
            DeviceSample::GREEDY,
            draw(0.8, 40, 0.9, 0.05, r()),
            draw(1.5, 0, 1.0, 0.0, 0.99999994),
            draw(0.3, 5000, 0.3, 0.0, r()),
            draw(1e-30, 3, 1.0, 0.0, r()),
            draw(f32::INFINITY, 1024, 1.0, 0.0, r()),
            draw(1e-40, 10, 1.0, 1e-40, 1e-40),
            draw(1.0, 1, 1.0, 0.0, r()),
            draw(2.0, 1023, 0.0, 1.0, 0.0),
            draw(0.7, 2, 0.5, 0.5, r()),
            draw(1e3, 700, 0.95, 1e-3, r()),
        ];
        for s in draws {
            let got = exe.sample(&s).unwrap().expect("wgpu samples on the device");
            assert_eq!(got, pick(&v, &s), "case {case}, {s:?}");
        }
    }
}

/// A session on wgpu samples on the device (no logits read back) and picks the canonical CPU's
/// tokens, greedy and seeded with every filter on, along a sampled continuation of tiny-a.
#[test]
fn wgpu_device_sampling_equals_the_canonical_cpu_over_tiny_tokens() {
    use ds4::sample::{Sampler, SamplerConfig};
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let gpu = wgpu_backend();
    let mut a = Session::new(model.clone(), &cpu, 64).unwrap();
    let mut b = Session::new(model, gpu.as_ref(), 64).unwrap();
    let seeded = SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 3 };
    let (mut ga, mut gb) = (Sampler::new(SamplerConfig::default()), Sampler::new(SamplerConfig::default()));
    let (mut sa, mut sb) = (Sampler::new(seeded), Sampler::new(seeded));
    let mut t = 0;
    for i in 0..24 {
        a.feed(&[t], |_| {}).unwrap();
        b.feed(&[t], |_| {}).unwrap();
        let greedy = (a.sample(&mut ga).unwrap(), b.sample(&mut gb).unwrap());
        let sampled = (a.sample(&mut sa).unwrap(), b.sample(&mut sb).unwrap());
        assert_eq!(greedy.0, greedy.1, "token {i}: greedy");
        assert_eq!(sampled.0, sampled.1, "token {i}: seeded");
        assert!(b.logits().is_empty(), "wgpu read the logits back");
        t = sampled.0;
    }
}

/// Fed ahead (each sampled token's step queued on the device before its id comes back), a wgpu
/// session samples the canonical CPU's tokens, greedy and seeded in turn, and ends in the CPU's
/// state: the next token's logits have the same bits.
#[test]
fn wgpu_feeding_ahead_equals_the_canonical_cpu_sampling_then_feeding() {
    use ds4::sample::{Sampler, SamplerConfig};
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let gpu = wgpu_backend();
    let mut a = Session::new(model.clone(), &cpu, 64).unwrap();
    let mut b = Session::new(model, gpu.as_ref(), 64).unwrap();
    assert!(b.feeds_ahead() && !a.feeds_ahead());
    let seeded = SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 5 };
    let mut samplers = [Sampler::new(SamplerConfig::default()), Sampler::new(seeded)];
    let mut twins = [Sampler::new(SamplerConfig::default()), Sampler::new(seeded)];
    a.feed(&[0], |_| {}).unwrap();
    b.feed(&[0], |_| {}).unwrap();
    let mut last = 0;
    for i in 0..30 {
        let want = a.sample_and_feed(&mut samplers[i % 2]).unwrap();
        let got = b.sample_and_feed(&mut twins[i % 2]).unwrap();
        assert_eq!(want, got, "token {i}");
        assert_eq!((a.pos(), b.pos()), (i + 2, i + 2));
        last = got;
    }
    let want = a.eval(last).unwrap().to_vec();
    let got = b.eval(last).unwrap();
    let bad = want.iter().zip(got).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    assert_eq!(bad, 0, "after feeding ahead, {bad} logits differ");
}

/// `generate` on wgpu feeds ahead: the same answer as on the canonical CPU (which samples, then
/// feeds), and a continuation reuses the answer's tokens and goes on as the CPU does.
#[test]
fn wgpu_generate_feeding_ahead_answers_and_continues_as_the_cpu() {
    use ds4::engine::{self, BackendChoice, Engine, Event, GenParams, ModelSource};
    use ds4::sample::SamplerConfig;
    let engine_on = |kind: BackendKind| {
        let loaded = engine::load(&ModelSource::Preset("tiny".into())).unwrap();
        let choice =
            BackendChoice { kind: Some(kind), threads: 1, numerics: Some(Numerics::Canonical), ..Default::default() };
        let (backend, _) = engine::make_backend(&choice).unwrap();
        Engine::new(loaded, backend.as_ref(), 128, 1).unwrap()
    };
    let p = GenParams {
        sampler: SamplerConfig { temperature: 0.9, top_k: 0, top_p: 0.95, min_p: 0.05, seed: 7 },
        max_tokens: 12,
        ignore_eos: true,
        logits: false,
    };
    let answer = |e: &mut Engine, prompt: &[u32]| {
        let mut ids = Vec::new();
        let stats = e
            .generate(prompt, &p, |ev| {
                if let Event::Token { id, .. } = ev {
                    ids.push(id);
                }
                true
            })
            .unwrap();
        (ids, stats)
    };
    let (mut cpu, mut gpu) = (engine_on(BackendKind::Cpu), engine_on(BackendKind::Wgpu));
    let prompt = [0, 300, 301, 302];
    let (want, _) = answer(&mut cpu, &prompt);
    let (got, stats) = answer(&mut gpu, &prompt);
    assert_eq!(got, want);
    assert_eq!((stats.generated, stats.decoded), (12, 11));
    let next: Vec<u32> = prompt.iter().chain(&got).chain(&[310, 311]).copied().collect();
    assert_eq!(gpu.reusable(&next), prompt.len() + 11, "the prompt and the answer's fed tokens");
    let (want, _) = answer(&mut cpu, &next);
    let (got, stats) = answer(&mut gpu, &next);
    assert_eq!(got, want);
    assert_eq!((stats.reused, stats.prefilled), (15, 3));
}
