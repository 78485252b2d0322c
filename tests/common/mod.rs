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

/// The indexer's top-k pick on a GPU backend equals the CPU's (the canonical pick: the best
/// untaken row above -1e30, ties to the lower row, row 0 when none is left; ascending, zeros
/// after) on crafted scores: ties, NaN and -1e30 (never picked), infinities, signed zeros, fewer
/// pickable rows than k, and more rows than one workgroup or block covers. The op runs alone
/// (`step_ops`) on the `small` preset's first indexer (top-k 16, ratio 4) at positions that make
/// 18 to 1024 compressed rows visible.
pub fn assert_top_k_equals_the_cpu(gpu: &dyn Backend) {
    use ds4::backends::cpu::CpuBackend;
    use ds4::numerics::Numerics;
    use ds4::recorder::{Op, StepParams};
    let model = Model::from_file(
        ds4::gguf::File::from_bytes("small", ds4::synth::build(&ds4::synth::Preset::small(), 1)).unwrap(),
    )
    .unwrap();
    let ctx = 4096;
    let program = Arc::new(ds4::decode::record_token(&model, ds4::decode::Caps { ctx }).unwrap());
    let (at, scores, out, top_k, cap) = program
        .steps()
        .iter()
        .enumerate()
        .find_map(|(i, s)| match s.op {
            Op::IndexerTopK { scores, out, top_k, rows } => Some((i, scores, out, top_k, rows.cap)),
            _ => None,
        })
        .expect("the small preset has an indexer");
    let cpu = CpuBackend::with_numerics(0, Numerics::Canonical).unwrap();
    let mut a = cpu.compile(program.clone(), model.clone()).unwrap();
    let mut b = gpu.compile(program.clone(), model.clone()).unwrap();
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let special = [0.0f32, -0.0, 1.0, -1.0, 2.5, -1.0e30, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -2.0e30];
    for case in 0..15 {
        // Visible compressed rows: (pos + 1) / 4, from 18 (just active) to `cap`.
        let n = [18usize, 257, 1024][case / 5].min(cap as usize);
        let pos = (4 * n + 3).min(ctx as usize - 1) as u32;
        let mut v = vec![0f32; cap as usize];
        for x in v.iter_mut() {
            let r = next();
            *x = match case % 5 {
                0 => (r % 2001) as f32 / 1000.0 - 1.0,
                1 => (r % 3) as f32,
                2 => special[r as usize % special.len()],
                // Fewer pickable rows than k: a few above -1e30, the rest not.
                3 => {
                    if r % 97 == 0 {
                        (r % 5) as f32
                    } else {
                        special[5 + r as usize % 2]
                    }
                }
                // The k-th pick among zeros of both signs (equal, so the lower rows win).
                _ => {
                    if r % 50 == 0 {
                        1.0
                    } else {
                        special[r as usize % 2]
                    }
                }
            };
        }
        let p = StepParams::new(0, pos);
        let mut got = Vec::new();
        for exe in [&mut a, &mut b] {
            exe.write_buffer(scores, &v).unwrap();
            exe.write_buffer(out, &vec![-7.0; top_k as usize]).unwrap();
            exe.step_ops(&p, at..at + 1).unwrap();
            got.push(exe.read_buffer(out).unwrap());
        }
        assert_eq!(got[0], got[1], "case {case}: {n} rows at position {pos}");
    }
}
