//! Paths to the test data kept in the repository (`tests/data/golden`, a byte-identical copy of the
//! project's shared golden data; `.ci/run` compares the two with `cmp` when both exist).
// Each test crate uses a subset of these helpers.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use ds4::backend::Backend;
use ds4::model::Model;
use ds4::session::Session;

/// A file or folder of the golden data, e.g. `golden("tiny-a/model.gguf")`.
pub fn golden(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden").join(rel)
}

/// The golden tiny-a token sequence (ds4's own greedy continuation from token 0).
pub fn golden_tokens() -> Vec<u32> {
    let path = golden("tiny-a/tokens.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{} is required: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// A GPU backend refuses a position past the context and a token past the vocabulary, and a
/// refused step runs nothing: the next good one gives the canonical CPU's logits, bit for bit.
pub fn assert_refuses_positions_and_tokens_out_of_range(gpu: &dyn ds4::backend::Backend) {
    use ds4::backends::cpu::CpuBackend;
    use ds4::model::Model;
    use ds4::numerics::Numerics;
    use ds4::recorder::StepParams;
    use ds4::session::Session;
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let mut s = Session::new(model.clone(), gpu, 16).unwrap();
    let exe = s.executable();
    let e = exe.step(&StepParams::new(1, 16)).unwrap_err().to_string();
    assert!(e.contains("position 16") && e.contains("16 positions"), "{e}");
    let e = exe.step(&StepParams::new(model.config.n_vocab as u32, 0)).unwrap_err().to_string();
    assert!(e.contains("vocabulary"), "{e}");
    exe.step(&StepParams::new(5, 0)).unwrap();
    let mut got = Vec::new();
    exe.read_logits(&mut got).unwrap();
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let mut c = Session::new(model, &cpu, 16).unwrap();
    assert!(c.eval(5).unwrap().iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// Whether two logit rows are the same bits.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The logits after every token, fed one at a time through the decode program.
pub fn token_by_token(model: &Arc<Model>, backend: &dyn Backend, tokens: &[u32], ctx: usize) -> Vec<Vec<f32>> {
    let mut s = Session::with_prefill_chunk(model.clone(), backend, ctx, 1).unwrap();
    tokens.iter().map(|&t| s.eval(t).unwrap().to_vec()).collect()
}

/// The logits after every token, fed with `feed_with_logits` in `pieces` (so chunks straddle
/// the calls' boundaries too).
pub fn chunked(s: &mut Session, tokens: &[u32], pieces: &[usize]) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    let mut at = 0;
    for &end in pieces.iter().chain([&tokens.len()]) {
        let fed = s
            .feed_with_logits(&tokens[at..end], |i, l| {
                assert_eq!(at + i, rows.len(), "one call per token, in order");
                rows.push(l.to_vec());
                true
            })
            .unwrap();
        assert_eq!(fed, end - at);
        at = end;
    }
    rows
}
