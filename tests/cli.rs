//! The `ds4` binary end to end: generation against ds4's own argmax, logits dumps against the
//! golden logits, tokenization against HF's ids, and one-line errors.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::golden;

fn ds4(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ds4")).args(args).output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "ds4 failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// A failure prints exactly one line, `ds4: error: ...`, and exits with 1.
fn one_line_error(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let line = err.lines().find(|l| l.starts_with("ds4: error: ")).unwrap_or_else(|| panic!("no error line: {err}"));
    assert_eq!(err.lines().filter(|l| l.starts_with("ds4: error")).count(), 1);
    line.to_string()
}

fn golden_json() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(golden("tiny-a/tokens.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn run_generates_ds4s_greedy_continuation() {
    let g = golden_json();
    let model = golden("tiny-a/model.gguf");
    let out = ds4(&["run", "--backend", "cpu", "-m", model.to_str().unwrap(), "--tokens", "0,214,21", "-n", "16"]);
    let got: Vec<u32> = ok(&out).split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert_eq!(got, ids(&g["argmax"])[2..18].to_vec());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tok/s"), "speed is reported on stderr: {err}");
}

#[test]
fn dump_logits_matches_the_golden_logits() {
    let g = golden_json();
    let tokens: Vec<String> = ids(&g["tokens"]).iter().map(|t| t.to_string()).collect();
    let dir = std::env::temp_dir().join(format!("ds4-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out_path = dir.join("logits.f32");
    let model = golden("tiny-a/model.gguf");
    let read = |p: &PathBuf| -> Vec<f32> {
        std::fs::read(p).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    let want = read(&golden("tiny-a/logits.f32"));
    // The cpu's default prefill chunk, then chunks of 7: one row per prompt token either way, and
    // (the ds4 profile) ds4's own logits, bit for bit.
    for chunk in ["64", "7"] {
        let tokens = tokens.join(",");
        let args = ["run", "--backend", "cpu", "-m", model.to_str().unwrap(), "--tokens", &tokens, "-n", "0"];
        let out = ds4(&[&args[..], &["--prefill-chunk", chunk, "--dump-logits", out_path.to_str().unwrap()]].concat());
        ok(&out);
        let got = read(&out_path);
        assert_eq!(got.len(), want.len(), "64 rows of 512");
        let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "--prefill-chunk {chunk}: logits that are not ds4's");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn tokenize_prints_hf_ids() {
    let vocab = golden("tokenizer/vocab.gguf");
    let cases = std::fs::read_to_string(golden("tokenizer/cases.jsonl")).unwrap();
    for line in cases.lines().take(4) {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = case["text"].as_str().unwrap();
        let out = ok(&ds4(&["tokenize", "-m", vocab.to_str().unwrap(), "-p", text]));
        let got: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(got, ids(&case["ids"]), "text {text:?}");
    }
}

#[test]
fn the_embedded_default_model_runs_without_a_file() {
    let dir = std::env::temp_dir().join(format!("ds4-embedded-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .current_dir(&dir)
        .args(["run", "-p", "Hello", "-n", "8"])
        .output()
        .unwrap();
    ok(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("embedded tiny synthetic model"), "{err}");
    assert!(err.contains("prefill") && err.contains("decode"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn errors_are_one_line_with_the_reason() {
    let model = golden("tiny-a/model.gguf");
    let m = model.to_str().unwrap();
    let line = one_line_error(&ds4(&["run", "-m", "/no/such/model.gguf", "-p", "hi"]));
    assert!(line.contains("/no/such/model.gguf") && line.contains("does not exist"), "{line}");
    let line = one_line_error(&ds4(&["run", "--backend", "cpu", "-m", m, "-c", "8", "--tokens", "1,2,3,4,5,6,7,8,9"]));
    assert!(line.contains("9 tokens") && line.contains("--ctx 8"), "{line}");
    // The GPU backends have only the canonical profile: refused the same way with or without a GPU.
    let line = one_line_error(&ds4(&["run", "--backend", "cuda", "--numerics", "ds4", "-m", m, "--tokens", "1,2"]));
    assert!(line.contains("cuda") && line.contains("canonical"), "{line}");
    let line = one_line_error(&ds4(&["run", "--backend", "cpu", "-m", m, "--tokens", "1,999999"]));
    assert!(line.contains("999999") && line.contains("vocabulary"), "{line}");
}

#[test]
fn bench_reports_decode_speed() {
    let model = golden("tiny-a/model.gguf");
    let m = model.to_str().unwrap();
    let out = ok(&ds4(&["bench", "--backend", "cpu", "-m", m, "--prefill", "4", "-n", "4", "--warmup-ms", "50"]));
    assert!(out.contains("decode     4 tokens") && out.contains("tok/s"), "{out}");
    assert!(out.contains("warm-up    ") && out.contains("untimed passes"), "{out}");
    assert!(out.contains("prefill    4 tokens in chunks of 64,"), "the cpu prefills in chunks: {out}");
}

/// `inspect --vram-budget`: everything in device memory when it fits, the experts in host memory
/// with a cache when only the dense part fits, and a refusal naming the sizes below that (the
/// tiny model at ctx 4096: 9.0 MiB dense, 2.5 MiB of experts, 4.3 MiB of buffers).
#[test]
fn inspect_plans_placement_for_a_budget() {
    let model = golden("tiny-a/model.gguf");
    let m = model.to_str().unwrap();
    let fits = ok(&ds4(&["inspect", "-m", m, "--vram-budget", "64M"]));
    assert!(fits.contains("device  everything"), "{fits}");
    let spills = ok(&ds4(&["inspect", "-m", m, "--vram-budget", "14M"]));
    assert!(spills.contains("expert cache") && spills.contains("host    routed experts"), "{spills}");
    let out = ds4(&["inspect", "-m", m, "--vram-budget", "4M"]);
    assert!(!out.status.success());
    let err = one_line_error(&out);
    assert!(err.contains("cannot run in 4.0 MiB") && err.contains("dense weights"), "{err}");
    let out = ds4(&["inspect", "-m", m, "--vram-budget", "4X"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("'4X' is not a size"));
}
