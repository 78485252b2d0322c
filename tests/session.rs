//! Recorder and session semantics: one program for every position, determinism, and clean
//! errors at the context limit.

mod common;

use std::sync::Arc;

use ds4::backends::cpu::CpuBackend;
use ds4::gguf::File;
use ds4::model::Model;
use ds4::recorder::{Cond, StepParams};
use ds4::session::{Session, SessionError};
use ds4::synth::{self, Preset};

fn tiny_a() -> Arc<Model> {
    Model::open(common::golden("tiny-a/model.gguf")).unwrap()
}

use common::golden_tokens;

fn run(s: &mut Session, tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens.iter().map(|&t| s.eval(t).unwrap().to_vec()).collect()
}

#[test]
fn the_program_recorded_before_position_0_runs_at_position_63() {
    let backend = CpuBackend::new(0).unwrap();
    let mut s = Session::new(tiny_a(), &backend, 64).unwrap();
    let before = s.program().clone();
    let fingerprint = before.fingerprint();
    let tokens = golden_tokens();
    run(&mut s, &tokens[..63]);
    assert_eq!(s.pos(), 63);
    assert!(Arc::ptr_eq(&before, s.program()), "the session never re-records");
    assert_eq!(s.program().fingerprint(), fingerprint);
    s.eval(tokens[63]).unwrap();

    // The same program does different work at 0 and 63: emits and the indexer are predicates.
    let conds: Vec<Cond> = before.steps().iter().filter_map(|st| st.cond).collect();
    assert!(conds.contains(&Cond::Emit { ratio: 4 }) && conds.contains(&Cond::Emit { ratio: 8 }));
    assert!(conds.contains(&Cond::IndexerActive { ratio: 4, top_k: 4 }));
    let active = |pos| before.active_steps(&StepParams::new(0, pos)).count();
    assert!(active(0) < active(7), "pos 7 emits on ratio 4 and 8 layers");
    assert!(active(3) < active(23), "the indexer runs from pos 19");
    assert_eq!(active(63), before.steps().len(), "pos 63 emits everywhere with the indexer on");
}

#[test]
fn fresh_sessions_and_reset_are_bit_identical() {
    let tokens = golden_tokens();
    let b2 = CpuBackend::new(2).unwrap();
    let b1 = CpuBackend::new(1).unwrap();
    let mut a = Session::new(tiny_a(), &b2, 128).unwrap();
    let first = run(&mut a, &tokens);
    let mut b = Session::new(tiny_a(), &b2, 128).unwrap();
    assert_eq!(first, run(&mut b, &tokens), "two fresh sessions");
    a.reset().unwrap();
    assert_eq!(a.pos(), 0);
    assert_eq!(first, run(&mut a, &tokens), "after reset");
    let mut c = Session::new(tiny_a(), &b1, 128).unwrap();
    assert_eq!(first, run(&mut c, &tokens), "thread count does not change the numbers");
}

#[test]
fn the_context_limit_is_an_error_that_loses_nothing() {
    let backend = CpuBackend::new(0).unwrap();
    let mut s = Session::new(tiny_a(), &backend, 8).unwrap();
    let tokens = golden_tokens();
    s.prefill(&tokens[..5], |_| {}).unwrap();
    let e = s.prefill(&tokens[5..9], |_| {}).unwrap_err();
    assert!(matches!(e, SessionError::ContextFull { needed: 4, remaining: 3, ctx: 8 }), "{e}");
    assert_eq!(s.pos(), 5, "a refused prompt runs nothing");
    // The session is still good: the next tokens give the same logits as an unrefused run.
    let got = s.prefill(&tokens[5..8], |_| {}).unwrap().to_vec();
    let mut fresh = Session::new(tiny_a(), &backend, 8).unwrap();
    assert_eq!(got, fresh.prefill(&tokens[..8], |_| {}).unwrap());
    assert!(matches!(s.eval(1), Err(SessionError::ContextFull { .. })));

    let e = s.eval(100_000).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    assert!(matches!(Session::new(tiny_a(), &backend, 0), Err(SessionError::BadContext { .. })));
}

#[test]
fn synthetic_models_decode_to_finite_varied_logits() {
    let backend = CpuBackend::new(0).unwrap();
    for (preset, steps) in [(Preset::tiny(), 40), (Preset::small(), 72)] {
        let m = Model::from_file(File::from_bytes(preset.name, synth::build(&preset, 4)).unwrap()).unwrap();
        let n_vocab = m.config.n_vocab;
        let mut s = Session::new(m, &backend, 128).unwrap();
        let mut token = 0;
        for step in 0..steps {
            let l = s.eval(token).unwrap();
            assert!(l.iter().all(|v| v.is_finite()), "{} step {step}: non-finite logits", preset.name);
            let mean = l.iter().sum::<f32>() / n_vocab as f32;
            let sd = (l.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n_vocab as f32).sqrt();
            assert!(sd > 0.05 && sd < 100.0, "{} step {step}: logit spread {sd}", preset.name);
            token = ds4::sample::argmax(l);
        }
    }
}

/// Every backend refuses a position at or past the context and a token past the vocabulary
/// before running anything (the caches and tables would be addressed out of bounds).
#[test]
fn step_refuses_positions_and_tokens_out_of_range() {
    let backend = CpuBackend::new(1).unwrap();
    let model = tiny_a();
    let mut s = Session::new(model.clone(), &backend, 16).unwrap();
    let n_vocab = model.config.n_vocab as u32;
    let exe = s.executable();
    let e = exe.step(&StepParams::new(1, 16)).unwrap_err().to_string();
    assert!(e.contains("position 16") && e.contains("16 positions"), "{e}");
    let e = exe.step_ops(&StepParams::new(1, 40), 0..3).unwrap_err().to_string();
    assert!(e.contains("position 40"), "{e}");
    let e = exe.step(&StepParams::new(n_vocab, 0)).unwrap_err().to_string();
    assert!(e.contains(&format!("token id {n_vocab}")) && e.contains("vocabulary"), "{e}");
}

/// A context in which no layer can hold more compressed rows than the indexer selects (tiny-a:
/// ratio 4, top-k 4, ctx 16) records no indexer at all; its logits equal, bit for bit, those of a
/// longer context whose program has the indexer, at every position both reach.
#[test]
fn a_context_too_short_for_the_indexer_records_none_and_decodes_the_same() {
    let backend = CpuBackend::new(0).unwrap();
    let mut short = Session::new(tiny_a(), &backend, 16).unwrap();
    let mut long = Session::new(tiny_a(), &backend, 64).unwrap();
    let has_indexer = |s: &Session| {
        s.program().steps().iter().any(|st| st.cond.is_some_and(|c| matches!(c, Cond::IndexerActive { .. })))
    };
    assert!(!has_indexer(&short) && has_indexer(&long));
    assert!(short.program().steps().len() < long.program().steps().len());
    let tokens = &golden_tokens()[..16];
    let (a, b) = (run(&mut short, tokens), run(&mut long, tokens));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "position {i}");
    }
}
