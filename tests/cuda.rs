//! The CUDA backend against the canonical CPU, bit for bit. These need an NVIDIA GPU, so they are
//! `#[ignore]`d in a plain `cargo test` (CI has no GPU) and reported as ignored, not passed;
//! `scripts/gpu-check` runs them with `--ignored` on a GPU machine, where a missing GPU fails.

mod common;

use std::sync::Arc;

use ds4::backend::{self, BackendKind, BackendOptions};
use ds4::backends::cpu::CpuBackend;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::session::Session;

use common::{golden, golden_tokens};

fn cuda(graphs: bool) -> Box<dyn ds4::backend::Backend> {
    let opts = BackendOptions { threads: 0, graphs, numerics: Numerics::Canonical, ..Default::default() };
    backend::create(BackendKind::Cuda, opts).expect("this test needs an NVIDIA GPU and libcuda/libnvrtc")
}

/// Teacher-forced on `tokens`, then greedy (on the reference's argmax) for `extra` steps.
fn compare(model: &Arc<Model>, graphs: bool, tokens: &[u32], extra: usize, ctx: usize) {
    compare_on(model, cuda(graphs).as_ref(), graphs, tokens, extra, ctx);
}

/// `compare` on a given CUDA backend; returns its expert cache counters, if it caches experts.
fn compare_on(
    model: &Arc<Model>,
    gpu: &dyn ds4::backend::Backend,
    graphs: bool,
    tokens: &[u32],
    extra: usize,
    ctx: usize,
) -> Option<ds4::backend::ExpertCacheStats> {
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    // Token by token on both sides: the decode program, step after step.
    let mut a = Session::with_prefill_chunk(model.clone(), &cpu, ctx, 1).unwrap();
    let mut b = Session::with_prefill_chunk(model.clone(), gpu, ctx, 1).unwrap();
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
    b.executable().expert_cache_stats()
}

/// A budget below what must stay in device memory is refused before anything is uploaded, with
/// a message that names the sizes; a budget above the free memory likewise.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn a_budget_too_small_or_too_large_is_refused_by_name() {
    use ds4::placement::PlacementRequest;
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    for (budget, words) in [(1u64 << 20, ["cannot run in 1.0 MiB", "dense weights"]), (1 << 50, ["exceeds", "free"])] {
        let placement = PlacementRequest { budget: Some(budget), ..Default::default() };
        let opts = BackendOptions { numerics: Numerics::Canonical, placement, ..Default::default() };
        let gpu = backend::create(BackendKind::Cuda, opts).expect("this test needs an NVIDIA GPU");
        let msg = match Session::new(model.clone(), gpu.as_ref(), 256) {
            Ok(_) => panic!("a budget of {budget} bytes was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(words.iter().all(|w| msg.contains(w)), "{msg}");
    }
}

/// Every placement of the weights gives the canonical CPU's logits: routed experts in host
/// memory read in place (no cache slot), through a cache of one slot (fewer than a token uses:
/// copies, evictions and reads in place) and of more slots than a token uses (hits), and every
/// weight in host memory (unified: the mapped file's pages read in place in GGUF's blocks, and
/// the same model held in a buffer, copied once unrepacked). The counters add up to every used
/// expert of every layer.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn every_placement_equals_canonical_cpu() {
    use ds4::placement::{PlacementMode, PlacementRequest};
    let mapped = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let bytes = std::fs::read(golden("tiny-a/model.gguf")).unwrap();
    let in_buffer = Model::from_file(ds4::gguf::File::from_bytes("tiny-a", bytes).unwrap()).unwrap();
    let tokens = golden_tokens();
    let n_used = mapped.config.n_expert_used;
    let extra = 24;
    for (mode, slots, model) in [
        (PlacementMode::Host, Some(0), &mapped),
        (PlacementMode::Host, Some(1), &mapped),
        (PlacementMode::Host, Some(n_used + 2), &mapped),
        (PlacementMode::Unified, None, &mapped),
        (PlacementMode::Unified, None, &in_buffer),
    ] {
        for graphs in [false, true] {
            let placement = PlacementRequest { budget: None, mode: Some(mode), cache_slots: slots };
            let opts = BackendOptions { graphs, numerics: Numerics::Canonical, placement, ..Default::default() };
            let gpu = backend::create(BackendKind::Cuda, opts).expect("this test needs an NVIDIA GPU");
            let stats = compare_on(model, gpu.as_ref(), graphs, &tokens, extra, 256);
            let what = format!("{mode:?} with {slots:?} slots, graphs {graphs}");
            if mode == PlacementMode::Unified {
                let report = Session::new(model.clone(), gpu.as_ref(), 256)
                    .unwrap()
                    .executable()
                    .load_report()
                    .unwrap_or_default();
                let mapped_file = model.file.mapping().is_some();
                assert_eq!(report.contains("no copy"), mapped_file, "{what}: {report}");
            }
            match slots {
                Some(n) if n > 0 => {
                    let s = stats.unwrap_or_else(|| panic!("{what}: no cache counters"));
                    let layers = Session::new(model.clone(), gpu.as_ref(), 256)
                        .unwrap()
                        .program()
                        .steps()
                        .iter()
                        .filter(|s| matches!(s.op, ds4::recorder::Op::MoeExperts { .. }))
                        .count() as u64;
                    let steps = (tokens.len() + extra) as u64;
                    assert_eq!(s.hits + s.copies + s.direct, steps * layers * n_used as u64, "{what}: {s:?}");
                    assert!(s.copies > 0, "{what}: {s:?}");
                    if n < n_used {
                        assert!(s.direct > 0, "{what}: {s:?}");
                    } else {
                        assert!(s.direct == 0 && s.hits > 0, "{what}: {s:?}");
                    }
                }
                _ => assert!(stats.is_none(), "{what}: no cache expected"),
            }
        }
    }
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
    common::assert_refuses_positions_and_tokens_out_of_range(cuda(false).as_ref());
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

/// The sampling kernel holds as many candidates as the definition weighs (no GPU needed).
#[cfg(feature = "cuda")]
#[test]
fn the_sampling_kernel_holds_the_candidate_cap() {
    let cap = format!("#define DS4_SAMPLE_CAP {}\n", ds4::sample::CANDIDATE_CAP);
    assert!(
        ds4::backends::cuda::kernel_source(
            ds4::backends::cuda::BlockLayout::Split,
            ds4::backends::cuda::KernelRows::One
        )
        .contains(&cap),
        "kernels/sample.cu: {cap}"
    );
}

/// Logit vectors of `n` tokens that stress the sampler: random, peaked, heavy ties, all equal,
/// NaN and infinities sprinkled in, nothing finite, huge and tiny magnitudes, signed zeros.
fn sampler_logits(n: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut state = 0x1234_5678_9abc_def1u64 ^ n as u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut v = Vec::new();
    v.push(("random", (0..n).map(|_| next() * 20.0 - 10.0).collect::<Vec<f32>>()));
    let mut peaked: Vec<f32> = (0..n).map(|_| next() * 4.0 - 2.0).collect();
    peaked[n / 3] = 12.0;
    peaked[n / 2] = 11.5;
    v.push(("peaked", peaked));
    v.push(("eight levels", (0..n).map(|_| (next() * 8.0).floor() * 0.5).collect()));
    v.push(("two levels", (0..n).map(|_| if next() < 0.01 { 3.0 } else { 1.0 }).collect()));
    v.push(("all equal", vec![0.25; n]));
    let mut specials: Vec<f32> = (0..n).map(|_| next() * 6.0 - 3.0).collect();
    for i in (0..n).step_by(37) {
        specials[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0][i % 5];
    }
    v.push(("nan and inf", specials));
    v.push(("all -inf", vec![f32::NEG_INFINITY; n]));
    v.push(("all nan", vec![f32::NAN; n]));
    let mut one = vec![f32::NAN; n];
    one[n - 1] = -5.0;
    v.push(("one finite", one));
    v.push(("huge", (0..n).map(|_| (next() * 2.0 - 1.0) * 3.4e38).collect()));
    v.push(("tiny", (0..n).map(|_| (next() * 2.0 - 1.0) * 1e-40).collect()));
    v.push(("signed zeros", (0..n).map(|i| if i % 2 == 0 { 0.0 } else { -0.0 }).collect()));
    v
}

/// Device sampling picks the host's token for the same draw: many logit vectors (Flash's
/// 129,280-token vocabulary and a small one), greedy and every combination of temperature,
/// top-k (the cap and beyond), top-p, min-p, over several seeds and the extreme draws.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn device_sampling_picks_the_hosts_token() {
    use ds4::sample::{pick, DeviceSample, Sampler, SamplerConfig};
    use ds4::synth::Preset;
    let gpu = cuda(false);
    for n_vocab in [512usize, 129_280] {
        // The tiny shape with this vocabulary, its weights drawn on the device: only its logits
        // buffer is used.
        let preset = Preset { n_vocab, ..Preset::tiny() };
        let model = ds4::synth::device_model(&preset, 4).unwrap();
        let mut session = Session::new(model, gpu.as_ref(), 8).unwrap();
        let logits_buf = session.program().logits();
        let exe = session.executable();
        let mut draws = vec![DeviceSample::GREEDY];
        for temperature in [0.3f32, 0.8, 1.5] {
            for top_k in [0usize, 1, 40, 1024, 5000] {
                for top_p in [1.0f32, 0.9, 0.3] {
                    for min_p in [0.0f32, 0.05] {
                        for seed in [1u64, 42, 7777] {
                            let cfg = SamplerConfig { temperature, top_k, top_p, min_p, seed };
                            let mut s = Sampler::new(cfg);
                            draws.push(s.draw());
                            draws.push(s.draw());
                        }
                        let d = Sampler::new(SamplerConfig { temperature, top_k, top_p, min_p, seed: 0 }).draw();
                        draws.push(DeviceSample { r: 0.0, ..d });
                        draws.push(DeviceSample { r: 1.0 - f32::EPSILON / 2.0, ..d });
                    }
                }
            }
        }
        let mut checked = 0;
        for (name, logits) in sampler_logits(n_vocab) {
            exe.write_buffer(logits_buf, &logits).unwrap();
            for d in &draws {
                let got = exe.sample(d).unwrap().expect("the cuda backend samples on the device");
                let want = pick(&logits, d);
                assert_eq!(got, want, "vocab {n_vocab}, logits '{name}', {d:?}");
                checked += 1;
            }
        }
        eprintln!("vocab {n_vocab}: {checked} device samples equal the host's");
    }
}

/// `generate` with seeded sampling on the CUDA backend (device sampling, graphs on and off, and
/// the logits path) gives the canonical CPU's tokens: the logits are bit-identical, so the
/// sampled ids must be too.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn seeded_generation_on_cuda_gives_the_cpus_tokens() {
    use ds4::backend::Backend;
    use ds4::engine::{self, Engine, Event, GenParams, ModelSource};
    use ds4::sample::SamplerConfig;
    let generate = |backend: &dyn Backend, p: &GenParams| -> Vec<u32> {
        let loaded = engine::load(&ModelSource::Preset("tiny".into())).unwrap();
        let mut e = Engine::new(loaded, backend, 256, 0).unwrap();
        let mut ids = Vec::new();
        e.generate(&[0, 5, 9, 300], p, |ev| {
            if let Event::Token { id, .. } = ev {
                ids.push(id);
            }
            true
        })
        .unwrap();
        assert!(e.take_warnings().is_empty(), "no fallback expected");
        ids
    };
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let configs = [
        SamplerConfig::default(),
        SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 7 },
        SamplerConfig { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 1 },
        SamplerConfig { temperature: 0.3, top_k: 5000, top_p: 0.3, min_p: 0.05, seed: 2 },
    ];
    for cfg in configs {
        let p = GenParams { sampler: cfg, max_tokens: 32, ignore_eos: true, logits: false };
        let want = generate(&cpu, &p);
        assert_eq!(want.len(), 32);
        for graphs in [false, true] {
            let gpu = cuda(graphs);
            assert_eq!(generate(gpu.as_ref(), &p), want, "{cfg:?}, graphs {graphs}: device sampling");
            let with_logits = GenParams { logits: true, ..p };
            assert_eq!(generate(gpu.as_ref(), &with_logits), want, "{cfg:?}, graphs {graphs}: host sampling");
        }
    }
}

/// Batched prefill on CUDA: the prompt fed in chunks (the chunk program, graph on and off) gives
/// the canonical CPU's logits fed token by token at every position and for three decode steps
/// after it, bit for bit; `pieces` cut the first call short so that chunks straddle calls.
fn check_chunks(model: &Arc<Model>, gpu: &dyn ds4::backend::Backend, tokens: &[u32], ctx: usize, chunks: &[usize]) {
    // A context shorter than a chunk would clamp the chunk.
    let ctx = chunks.iter().fold(ctx, |c, &n| c.max(n));
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let after = [5u32, 77, 300].map(|t| t % model.config.n_vocab as u32);
    let all: Vec<u32> = tokens.iter().chain(&after).copied().collect();
    let want = common::token_by_token(model, &cpu, &all, ctx);
    for &chunk in chunks {
        let mut s = Session::with_prefill_chunk(model.clone(), gpu, ctx, chunk).unwrap();
        assert_eq!(s.prefill_chunk(), chunk, "warnings: {:?}", s.take_warnings());
        let mut got = common::chunked(&mut s, tokens, &[5]);
        got.extend(after.iter().map(|&t| s.eval(t).unwrap().to_vec()));
        let bad: Vec<usize> = (0..want.len()).filter(|&i| !common::same_bits(&got[i], &want[i])).collect();
        assert!(
            bad.is_empty(),
            "chunk {chunk}: positions whose logits differ from the CPU's token by token \
             (>= {} are decode steps after the prompt): {bad:?}",
            tokens.len()
        );
        assert!(s.take_warnings().is_empty(), "chunk {chunk}: no fallback");
    }
}

/// tiny-a (window 16, ratios 4 and 8, indexer active from position 19): the 64 golden tokens in
/// chunks of 1, 7, 64 and the backend's default, across the window's wrap and the emits; and the
/// `small` preset (window 64, ratios 4 and 16, indexer from position 67) in chunks of 64, 7 and the
/// default.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn cuda_chunks_equal_canonical_cpu_token_by_token() {
    let tiny = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let small = Model::from_file(
        ds4::gguf::File::from_bytes("small", ds4::synth::build(&ds4::synth::Preset::small(), 4)).unwrap(),
    )
    .unwrap();
    let n_vocab = small.config.n_vocab;
    let small_tokens: Vec<u32> = (0..150).map(|i| ((i * 7919 + 13) % n_vocab) as u32).collect();
    for graphs in [false, true] {
        let gpu = cuda(graphs);
        check_chunks(&tiny, gpu.as_ref(), &golden_tokens(), 160, &[1, 7, 64, gpu.default_prefill_chunk()]);
        check_chunks(&small, gpu.as_ref(), &small_tokens, 256, &[64, 7, gpu.default_prefill_chunk()]);
    }
}

/// Chunks under the other placements: every weight in host memory read in place (unified) runs
/// the chunk program too; routed experts cached from host memory (placement host) cannot, and
/// the session says so once and prefills token by token, with the same logits.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn cuda_chunks_under_the_other_placements() {
    use ds4::placement::{PlacementMode, PlacementRequest};
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = &golden_tokens()[..40];
    let with = |mode| {
        let placement = PlacementRequest { budget: None, mode: Some(mode), cache_slots: Some(2) };
        let opts = BackendOptions { graphs: true, numerics: Numerics::Canonical, placement, ..Default::default() };
        backend::create(BackendKind::Cuda, opts).expect("this test needs an NVIDIA GPU")
    };
    check_chunks(&model, with(PlacementMode::Unified).as_ref(), tokens, 64, &[7]);
    let host = with(PlacementMode::Host);
    let mut s = Session::with_prefill_chunk(model.clone(), host.as_ref(), 64, 7).unwrap();
    assert_eq!(s.prefill_chunk(), 1);
    let w = s.take_warnings();
    assert!(
        w.len() == 1 && w[0].contains("not cached from host memory (placement host); prefilling token by token"),
        "{w:?}"
    );
    let got = common::chunked(&mut s, tokens, &[]);
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let want = common::token_by_token(&model, &cpu, tokens, 64);
    assert!((0..tokens.len()).all(|i| common::same_bits(&got[i], &want[i])));
}

/// The indexer's top-k on CUDA equals the CPU's pick on crafted scores: ties, NaN, -1e30,
/// infinities, signed zeros, fewer pickable rows than k, more rows than one block's threads.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn cuda_top_k_equals_the_cpu_on_crafted_scores() {
    common::assert_top_k_equals_the_cpu(cuda(false).as_ref());
}
