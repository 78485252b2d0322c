//! The canonical numerics profile on the CPU: the same bits for any thread count, and the same
//! mathematics as the ds4 profile (each op fed identical inputs, `ds4 check --isolate`).

mod common;

use std::process::Command;
use std::sync::Arc;

use ds4::backends::cpu::CpuBackend;
use ds4::gguf::File;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::session::Session;
use ds4::synth::{self, Preset};

use common::{golden, golden_tokens};

/// Logits of every step as raw bits: teacher-forced on `tokens`, then greedy for `extra` steps.
fn logit_bits(model: &Arc<Model>, threads: usize, tokens: &[u32], extra: usize, ctx: usize) -> Vec<Vec<u32>> {
    let backend = CpuBackend::with_numerics(threads, Numerics::Canonical).unwrap();
    let mut s = Session::new(model.clone(), &backend, ctx).unwrap();
    let mut out = Vec::new();
    let mut next = tokens[0];
    for i in 0..tokens.len() + extra {
        let t = if i < tokens.len() { tokens[i] } else { next };
        let l = s.eval(t).unwrap();
        next = ds4::sample::argmax(l);
        out.push(l.iter().map(|v| v.to_bits()).collect());
    }
    out
}

#[test]
fn canonical_cpu_logits_are_identical_for_any_thread_count() {
    let model = Model::open(golden("tiny-a/model.gguf")).unwrap();
    let tokens = golden_tokens();
    // 64 golden tokens then 80 greedy ones: past the 128-row window and many emits.
    let one = logit_bits(&model, 1, &tokens, 80, 256);
    for threads in [2, 3, 0] {
        let other = logit_bits(&model, threads, &tokens, 80, 256);
        let first = one.iter().zip(&other).position(|(a, b)| a != b);
        assert_eq!(first, None, "-t {threads} differs from -t 1 at step {first:?}");
    }
    let small = Model::from_file(File::from_bytes("small", synth::build(&Preset::small(), 4)).unwrap()).unwrap();
    let a = logit_bits(&small, 1, &[0, 17, 99], 5, 64);
    let b = logit_bits(&small, 3, &[0, 17, 99], 5, 64);
    assert!(a == b, "the small preset differs between -t 1 and -t 3");
}

fn isolate(model: &[&str], pos: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(["check", "--backend", "cpu", "--numerics", "ds4", "--against", "cpu", "--against-numerics", "canonical"])
        .args(model)
        .args(["--ctx", "256", "--bisect", pos, "--isolate"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "isolate failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        stdout.lines().filter(|l| l.contains("OVER") || !l.starts_with("op #")).collect::<Vec<_>>().join("\n")
    );
    stdout
}

/// Each op fed identical inputs computes the same value in both profiles to a relative 1e-5,
/// at a position with emits of both ratios and (on tiny-a) the indexer active.
#[test]
fn profiles_compute_the_same_mathematics() {
    let m = golden("tiny-a/model.gguf");
    let out = isolate(&["-m", m.to_str().unwrap()], "139");
    assert!(out.contains("ops within a relative 1e-5"), "{out}");
    let ran = out.lines().filter(|l| l.starts_with("op #") && !l.contains("skipped")).count();
    assert!(ran > 100, "{out}");
    let out = isolate(&["--preset", "small"], "127");
    assert!(out.contains("ops within a relative 1e-5"), "{out}");
}
