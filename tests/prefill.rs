//! Batched prefill: a prompt fed in chunks gives, at every position, the bits that feeding it
//! token by token gives, and leaves the same state; in the ds4 profile, ds4's own logits.

mod common;

use std::sync::Arc;

use ds4::backend::{Backend, BackendError, Executable};
use ds4::backends::cpu::{CpuBackend, DEFAULT_PREFILL_CHUNK};
use ds4::gguf::File;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::recorder::StepParams;
use ds4::session::Session;
use ds4::synth::{self, Preset};

use common::{chunked, golden, golden_tokens, same_bits, token_by_token};

fn tiny_a() -> Arc<Model> {
    Model::open(golden("tiny-a/model.gguf")).unwrap()
}

fn canonical() -> CpuBackend {
    CpuBackend::with_numerics(0, Numerics::Canonical).unwrap()
}

/// Every state buffer of the two sessions (KV ring, compressed caches, compressor windows).
fn assert_same_state(a: &mut Session, b: &mut Session, what: &str) {
    let program = a.program().clone();
    assert_eq!(program.fingerprint(), b.program().fingerprint(), "{what}: same decode program");
    let mut n = 0;
    for (buf, d) in program.state_buffers() {
        let (x, y) = (a.executable().read_buffer(buf).unwrap(), b.executable().read_buffer(buf).unwrap());
        assert!(same_bits(&x, &y), "{what}: state buffer {} differs", d.name);
        n += 1;
    }
    assert!(n > 0, "the program has state");
}

/// Canonical profile, tiny-a (window 16, ratios 4 and 8, indexer top-k 4 active from position
/// 19): 64 tokens in chunks of 1, 7, 20 and 64 (and the default), the first call feeding 5
/// tokens so that chunks start at positions that are not multiples of the chunk size. The ring
/// (window + chunk - 1 rows) wraps inside the prompt for chunks of 7 (shorter than the window) and
/// 20 (longer). Every row's logits, the state after the prompt and three decode steps after it
/// match token by token.
#[test]
fn canonical_chunks_are_bit_identical_to_token_by_token() {
    let model = tiny_a();
    let cpu = canonical();
    let tokens = golden_tokens();
    let ctx = 96;
    let want = token_by_token(&model, &cpu, &tokens, ctx);
    let after = [5u32, 77, 300];
    let mut want_after = Session::with_prefill_chunk(model.clone(), &cpu, ctx, 1).unwrap();
    want_after.prefill(&tokens, |_| {}).unwrap();
    let want_after: Vec<Vec<f32>> = after.iter().map(|&t| want_after.eval(t).unwrap().to_vec()).collect();
    let mut sizes = vec![1, 7, 20, 64];
    if !sizes.contains(&DEFAULT_PREFILL_CHUNK) {
        sizes.push(DEFAULT_PREFILL_CHUNK);
    }
    for chunk in sizes {
        let mut s = Session::with_prefill_chunk(model.clone(), &cpu, ctx, chunk).unwrap();
        assert_eq!(s.prefill_chunk(), chunk);
        let got = chunked(&mut s, &tokens, &[5]);
        assert_eq!(got.len(), want.len());
        let bad: Vec<usize> = (0..want.len()).filter(|&i| !same_bits(&got[i], &want[i])).collect();
        assert!(bad.is_empty(), "chunk {chunk}: positions whose logits differ from token by token: {bad:?}");

        // The same session shape fed token by token leaves the same state, bit for bit.
        let mut one = Session::with_prefill_chunk(model.clone(), &cpu, ctx, chunk).unwrap();
        one.set_prefill_chunk(1);
        one.prefill(&tokens, |_| {}).unwrap();
        assert_same_state(&mut s, &mut one, &format!("chunk {chunk}"));
        for (i, &t) in after.iter().enumerate() {
            assert!(same_bits(s.eval(t).unwrap(), &want_after[i]), "chunk {chunk}: decode step {i} after the prompt");
        }
    }
}

/// Canonical profile, the `small` preset (window 64, ratios 4 and 16, indexer top-k 16 active
/// from position 67): 72 tokens in chunks of the default size, against token by token.
#[test]
fn canonical_chunks_on_the_small_preset_slide_the_window_and_start_the_indexer() {
    let model = Model::from_file(File::from_bytes("small", synth::build(&Preset::small(), 4)).unwrap()).unwrap();
    let cpu = canonical();
    let n_vocab = model.config.n_vocab;
    let tokens: Vec<u32> = (0..72).map(|i| ((i * 7919 + 13) % n_vocab) as u32).collect();
    let want = token_by_token(&model, &cpu, &tokens, 128);
    let mut s = Session::new(model.clone(), &cpu, 128).unwrap();
    assert_eq!(s.prefill_chunk(), DEFAULT_PREFILL_CHUNK);
    let got = chunked(&mut s, &tokens, &[]);
    let bad: Vec<usize> = (0..want.len()).filter(|&i| !same_bits(&got[i], &want[i])).collect();
    assert!(bad.is_empty(), "positions whose logits differ from token by token: {bad:?}");
}

/// ds4 profile: tiny-a's 64 golden tokens in chunks of 7 and 64 give ds4's own logits at every
/// position, bit for bit.
#[test]
fn ds4_profile_chunks_give_the_golden_logits_at_every_position() {
    let dir = golden("tiny-a");
    let raw = std::fs::read(dir.join("logits.f32")).expect("golden logits.f32");
    let golden: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let tokens = golden_tokens();
    let model = tiny_a();
    let n_vocab = model.config.n_vocab;
    assert_eq!(golden.len(), tokens.len() * n_vocab);
    let cpu = CpuBackend::new(0).unwrap();
    for chunk in [7, 64] {
        let mut s = Session::with_prefill_chunk(model.clone(), &cpu, 256, chunk).unwrap();
        let got = chunked(&mut s, &tokens, &[]);
        let bad: Vec<usize> =
            (0..tokens.len()).filter(|&i| !same_bits(&got[i], &golden[i * n_vocab..(i + 1) * n_vocab])).collect();
        assert!(bad.is_empty(), "chunk {chunk}: positions whose logits are not ds4's: {bad:?}");
    }
}

/// A backend without chunk programs: the session feeds token by token and says so once.
struct NoChunks(CpuBackend);

impl Backend for NoChunks {
    fn name(&self) -> &'static str {
        "nochunks"
    }
    fn numerics(&self) -> Numerics {
        self.0.numerics()
    }
    fn compile(&self, p: Arc<ds4::recorder::Program>, m: Arc<Model>) -> Result<Box<dyn Executable>, BackendError> {
        self.0.compile(p, m)
    }
}

#[test]
fn a_backend_without_chunk_programs_falls_back_to_token_by_token() {
    let model = tiny_a();
    let tokens = &golden_tokens()[..20];
    let b = NoChunks(canonical());
    let mut s = Session::with_prefill_chunk(model.clone(), &b, 64, 16).unwrap();
    assert_eq!(s.prefill_chunk(), 1);
    let w = s.take_warnings();
    assert!(
        w.len() == 1 && w[0].contains("nochunks") && w[0].contains("no batched prefill; prefilling token by token"),
        "{w:?}"
    );
    let got = s.prefill(tokens, |_| {}).unwrap().to_vec();
    assert!(s.take_warnings().is_empty(), "said once");
    let want = token_by_token(&model, &canonical(), tokens, 64);
    assert!(same_bits(&got, want.last().unwrap()));
}

/// A chunk is refused before anything runs when it does not fit: more tokens than the program's
/// rows, positions past the context, a token outside the vocabulary.
#[test]
fn bad_chunks_are_refused_and_change_nothing() {
    let model = tiny_a();
    let cpu = canonical();
    let tokens = golden_tokens();
    let mut s = Session::with_prefill_chunk(model.clone(), &cpu, 32, 8).unwrap();
    let exe = s.executable();
    let e = exe.step_chunk(&StepParams::chunk(0, 9), &tokens[..9]).unwrap_err().to_string();
    assert!(e.contains("9 tokens") && e.contains("8 rows"), "{e}");
    let e = exe.step_chunk(&StepParams::chunk(28, 5), &tokens[..5]).unwrap_err().to_string();
    assert!(e.contains("outside the context of 32"), "{e}");
    let e = exe.step_chunk(&StepParams::chunk(0, 2), &[1, 100_000]).unwrap_err().to_string();
    assert!(e.contains("token id 100000"), "{e}");
    let e = exe.step_chunk(&StepParams::chunk(0, 3), &tokens[..2]).unwrap_err().to_string();
    assert!(e.contains("2 given"), "{e}");
    // Nothing ran: the session still gives token by token's logits.
    let got = s.prefill(&tokens[..10], |_| {}).unwrap().to_vec();
    assert!(same_bits(&got, token_by_token(&model, &cpu, &tokens[..10], 32).last().unwrap()));
}
