//! The engine API on the tiny preset: generation, prefix reuse against a fresh session, refused
//! prompts, and the multi-turn chat template.

use ds4::backend::BackendKind;
use ds4::engine::{self, BackendChoice, Engine, EngineError, Event, GenParams, ModelSource, StopReason};
use ds4::sample::SamplerConfig;
use ds4::tokenizer::{standin_vocab, Role, ThinkMode, Tokenizer};

fn tiny(ctx: usize) -> Engine {
    let loaded = engine::load(&ModelSource::Preset("tiny".into())).unwrap();
    let choice = BackendChoice { kind: Some(BackendKind::Cpu), threads: 1, ..Default::default() };
    let (backend, note) = engine::make_backend(&choice).unwrap();
    assert!(note.is_none());
    Engine::new(loaded, backend.as_ref(), ctx, 1).unwrap()
}

fn greedy(n: usize) -> GenParams {
    GenParams { sampler: SamplerConfig::default(), max_tokens: n, ignore_eos: true, logits: false }
}

/// The sampled ids and the stats.
fn run(e: &mut Engine, prompt: &[u32], p: &GenParams) -> (Vec<u32>, engine::GenStats) {
    let mut ids = Vec::new();
    let stats = e
        .generate(prompt, p, |ev| {
            if let Event::Token { id, .. } = ev {
                ids.push(id);
            }
            true
        })
        .unwrap();
    (ids, stats)
}

#[test]
fn prefix_reuse_gives_the_tokens_of_a_fresh_session() {
    let mut e = tiny(64);
    let first: Vec<u32> = vec![0, 300, 301, 302];
    let (out1, s1) = run(&mut e, &first, &greedy(3));
    assert_eq!((s1.reused, s1.prefilled, s1.generated, s1.decoded), (0, 4, 3, 2));
    assert_eq!(s1.stop, StopReason::Length);
    // The session holds the prompt and the two fed answer tokens; extend all of it.
    let mut second = first.clone();
    second.extend_from_slice(&out1[..2]);
    second.extend_from_slice(&[310, 311]);
    assert_eq!(e.reusable(&second), 6);
    let (out2, s2) = run(&mut e, &second, &greedy(4));
    assert_eq!((s2.reused, s2.prefilled), (6, 2));

    let mut fresh = tiny(64);
    let (want, s) = run(&mut fresh, &second, &greedy(4));
    assert_eq!(s.reused, 0);
    assert_eq!(out2, want);

    // A prompt that diverges starts over, and still gives a fresh session's tokens.
    let other: Vec<u32> = vec![0, 300, 450, 5];
    assert_eq!(e.reusable(&other), 0);
    let (got, s3) = run(&mut e, &other, &greedy(1));
    assert_eq!(s3.reused, 0);
    let (want, _) = run(&mut tiny(64), &other, &greedy(1));
    assert_eq!(got, want);

    // One token sampled, none fed: the session holds exactly the prompt. Asked again, nothing is
    // prefilled and the same token comes.
    let (again, s4) = run(&mut e, &other, &greedy(1));
    assert_eq!((s4.reused, s4.prefilled), (4, 0));
    assert_eq!(again, want);
}

#[test]
fn a_callback_returning_false_stops_at_once() {
    let mut e = tiny(64);
    let mut n = 0;
    let stats = e
        .generate(&[0, 300], &greedy(50), |ev| {
            if matches!(ev, Event::Token { .. }) {
                n += 1;
            }
            n < 3
        })
        .unwrap();
    assert_eq!(n, 3);
    assert_eq!(stats.stop, StopReason::Callback);
    assert_eq!(stats.generated, 3);
}

/// A prefill asked to stop ends at a chunk boundary with the state of the tokens fed; the same
/// prompt then reuses them and gives a fresh session's tokens, and the forced-output test hook
/// emits its ids (then end of sentence) through the same path.
#[test]
fn a_prefill_asked_to_stop_keeps_what_it_fed() {
    let mut e = tiny(256);
    let prompt: Vec<u32> = (0..100).map(|i| 300 + (i * 7 % 90)).collect();
    let mut events = 0;
    let stats = e
        .generate(&prompt, &greedy(5), |ev| {
            events += 1;
            !matches!(ev, Event::Prefill { done: 40, .. })
        })
        .unwrap();
    assert_eq!(stats.stop, StopReason::Callback);
    assert_eq!((stats.prefilled, stats.generated), (64, 0), "the chunk that saw the stop is finished");
    assert_eq!(events, 64);
    assert_eq!(e.reusable(&prompt), 64);
    let (got, s) = run(&mut e, &prompt, &greedy(5));
    assert_eq!((s.reused, s.prefilled), (64, 36));
    let (want, _) = run(&mut tiny(256), &prompt, &greedy(5));
    assert_eq!(got, want);

    let eos = e.tokenizer().specials().eos;
    e.force_output(Some(vec![301, 302]));
    let mut p = greedy(5);
    p.ignore_eos = false;
    let (forced, s) = run(&mut e, &[0, 300], &p);
    assert_eq!(forced, vec![301, 302, eos]);
    assert_eq!(s.stop, StopReason::Eos);
}

/// An answer sent back as text re-tokenizes into other tokens than the model sampled (here a
/// multi-byte filler token of the stand-in vocabulary, which the tokenizer writes byte by byte):
/// `align` puts the session's tokens back where they spell the same bytes, so they are reused.
#[test]
fn a_prompt_spelling_the_sampled_tokens_otherwise_is_aligned_to_them() {
    let mut e = tiny(256);
    let tok = e.tokenizer();
    let eos = tok.specials().eos;
    let filler = (0..tok.vocab_size() as u32).find(|&id| tok.token_bytes(id).unwrap().len() > 3).unwrap();
    let a = tok.encode("a")[0];
    let answer = [filler, a];
    let text = String::from_utf8(tok.decode(&answer)).unwrap();
    let respelled = tok.encode(&text);
    assert!(respelled.len() > 2 && !respelled.contains(&filler), "the text re-tokenizes byte by byte");
    let first = [0, 300];
    let differs: Vec<u32> = first.iter().chain(&tok.encode("<|x")).copied().collect();

    e.force_output(Some(answer.to_vec()));
    let mut p = greedy(10);
    p.ignore_eos = false;
    let (got, _) = run(&mut e, &first, &p);
    assert_eq!(got, vec![filler, a, eos]);
    e.force_output(None);

    // The conversation goes on: the answer as the renderer spells it, then the end of sentence.
    let next: Vec<u32> = first.iter().chain(&respelled).chain(&[eos, 305, 306]).copied().collect();
    assert_eq!(e.reusable(&next), 0);
    let aligned = e.align(&next);
    assert_eq!(aligned, vec![0, 300, filler, a, eos, 305, 306]);
    assert_eq!(e.reusable(&aligned), 4, "the prompt and the two fed answer tokens");
    // Without the end of sentence the unfed token is left out; other bytes are left alone.
    let other: Vec<u32> = first.iter().chain(&respelled).chain(&[305]).copied().collect();
    assert_eq!(e.align(&other), vec![0, 300, filler, a, 305]);
    assert_eq!(e.align(&differs), differs);
    // The aligned prompt continues as a fresh session on it would.
    let (cont, s) = run(&mut e, &aligned, &greedy(3));
    assert_eq!((s.reused, s.prefilled), (4, 3));
    let (want, _) = run(&mut tiny(256), &aligned, &greedy(3));
    assert_eq!(cont, want);
}

#[test]
fn bad_prompts_are_errors() {
    let mut e = tiny(8);
    assert!(matches!(e.generate(&[], &greedy(1), |_| true), Err(EngineError::EmptyPrompt)));
    let long = vec![300u32; 9];
    assert!(matches!(e.generate(&long, &greedy(1), |_| true), Err(EngineError::PromptTooLong { prompt: 9, ctx: 8 })));
    let mut p = greedy(1);
    p.sampler.temperature = f32::NAN;
    assert!(matches!(e.generate(&[0], &p, |_| true), Err(EngineError::Sampler(_))));
    // Generation stops where the context ends.
    let (_, s) = run(&mut e, &[0, 1, 2, 3, 4, 5], &greedy(100));
    assert_eq!(s.generated, 2);
}

#[test]
fn conversations_render_with_ds4s_template() {
    let (tokens, merges) = standin_vocab(400).unwrap();
    let tok = Tokenizer::from_vocab(tokens, merges).unwrap();
    let s = *tok.specials();
    for think in [ThinkMode::Think, ThinkMode::NoThink] {
        assert_eq!(tok.render_conversation("Sys", &[(Role::User, "Hi")], think), tok.render_chat("Sys", "Hi", think));
    }
    let turns = [(Role::User, "a"), (Role::Assistant, "b"), (Role::User, "c")];
    let got = tok.render_conversation("", &turns, ThinkMode::Think);
    let mut want = vec![s.bos, s.user];
    want.extend(tok.encode("a"));
    want.extend([s.assistant, s.think_end]);
    want.extend(tok.encode("b"));
    want.extend([s.eos, s.user]);
    want.extend(tok.encode("c"));
    want.extend([s.assistant, s.think]);
    assert_eq!(got, want);
    // A follow-up starts with the earlier prompt rendered without thinking: prefix reuse.
    let earlier = tok.render_conversation("", &turns[..1], ThinkMode::NoThink);
    assert!(got.starts_with(&earlier));
}

/// A CPU backend that samples "on the device": its executable answers `sample` with
/// `sample::pick` over its own logits, as a GPU kernel would, and counts the logits reads the
/// session asks for. The engine must then give the tokens of host sampling, without reading
/// any logits back.
mod device_sampling {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use ds4::backend::{Backend, BackendError, Executable};
    use ds4::backends::cpu::CpuBackend;
    use ds4::model::Model;
    use ds4::numerics::Numerics;
    use ds4::recorder::{Buf, Program, StepParams};
    use ds4::sample::DeviceSample;

    pub struct Counts {
        pub samples: AtomicUsize,
        pub logit_reads: AtomicUsize,
    }

    pub struct SamplingCpu {
        inner: CpuBackend,
        pub counts: Arc<Counts>,
    }

    impl SamplingCpu {
        pub fn new() -> SamplingCpu {
            let counts = Counts { samples: AtomicUsize::new(0), logit_reads: AtomicUsize::new(0) };
            SamplingCpu { inner: CpuBackend::with_numerics(1, Numerics::Ds4).unwrap(), counts: Arc::new(counts) }
        }
    }

    struct Exe {
        inner: Box<dyn Executable>,
        counts: Arc<Counts>,
        scratch: Vec<f32>,
    }

    impl Backend for SamplingCpu {
        fn name(&self) -> &'static str {
            "cpu"
        }
        fn numerics(&self) -> Numerics {
            self.inner.numerics()
        }
        fn compile(&self, program: Arc<Program>, model: Arc<Model>) -> Result<Box<dyn Executable>, BackendError> {
            let inner = self.inner.compile(program, model)?;
            Ok(Box::new(Exe { inner, counts: self.counts.clone(), scratch: Vec::new() }))
        }
    }

    impl Executable for Exe {
        fn program(&self) -> &Arc<Program> {
            self.inner.program()
        }
        fn step(&mut self, params: &StepParams) -> Result<(), BackendError> {
            self.inner.step(params)
        }
        fn step_ops(&mut self, params: &StepParams, ops: std::ops::Range<usize>) -> Result<(), BackendError> {
            self.inner.step_ops(params, ops)
        }
        fn profile(&mut self, params: &StepParams) -> Result<Vec<(String, f64)>, BackendError> {
            self.inner.profile(params)
        }
        fn write_buffer(&mut self, buf: Buf, data: &[f32]) -> Result<(), BackendError> {
            self.inner.write_buffer(buf, data)
        }
        fn sample(&mut self, s: &DeviceSample) -> Result<Option<u32>, BackendError> {
            self.counts.samples.fetch_add(1, Ordering::Relaxed);
            self.inner.read_logits(&mut self.scratch)?;
            Ok(Some(ds4::sample::pick(&self.scratch, s)))
        }
        fn read_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
            self.counts.logit_reads.fetch_add(1, Ordering::Relaxed);
            self.inner.read_logits(out)
        }
        fn read_buffer(&mut self, buf: Buf) -> Result<Vec<f32>, BackendError> {
            self.inner.read_buffer(buf)
        }
        fn reset(&mut self) -> Result<(), BackendError> {
            self.inner.reset()
        }
    }
}

#[test]
fn device_sampling_gives_the_tokens_of_host_sampling_without_reading_logits() {
    use std::sync::atomic::Ordering;
    let configs = [
        SamplerConfig::default(),
        SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 7 },
        SamplerConfig { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 1 },
        SamplerConfig { temperature: 0.3, top_k: 5000, top_p: 0.3, min_p: 0.0, seed: 2 },
    ];
    for cfg in configs {
        let p = GenParams { sampler: cfg, max_tokens: 24, ignore_eos: true, logits: false };
        let prompt: Vec<u32> = vec![0, 300, 301, 302];
        let (want, _) = run(&mut tiny(64), &prompt, &p);
        // The same through the reference path that reads every logit row.
        let (with_logits, _) = run(&mut tiny(64), &prompt, &GenParams { logits: true, ..p });
        assert_eq!(with_logits, want, "{cfg:?}: logits mode");

        let backend = device_sampling::SamplingCpu::new();
        let loaded = engine::load(&ModelSource::Preset("tiny".into())).unwrap();
        let mut e = Engine::new(loaded, &backend, 64, 1).unwrap();
        let (got, stats) = run(&mut e, &prompt, &p);
        assert_eq!(got, want, "{cfg:?}");
        assert_eq!(backend.counts.samples.load(Ordering::Relaxed), stats.generated);
        assert_eq!(backend.counts.logit_reads.load(Ordering::Relaxed), 0, "{cfg:?}: logits were read");

        // A prompt the session holds whole is sampled from the session's state too.
        let mut again = prompt.clone();
        again.extend_from_slice(&got[..23]);
        let (more, stats) = run(&mut e, &again, &GenParams { max_tokens: 4, ..p });
        assert_eq!((stats.reused, stats.prefilled), (again.len(), 0));
        let (fresh, _) = run(&mut tiny(64), &again, &GenParams { max_tokens: 4, ..p });
        assert_eq!(more, fresh, "{cfg:?}: after a reused prompt");
    }
}
