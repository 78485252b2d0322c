//! Bad input through the `ds4` binary: every case gets a clear message naming the option or file
//! and its limit, a non-zero exit and no backtrace, before any work starts. A closed stdout ends
//! quietly with success. Property tests cover random sampling option values, random bytes and
//! arbitrary Unicode as prompts, and the tokenizer's round trip.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use ds4::gguf::{self, Value, Writer};
use ds4::quant::GgmlType;
use ds4::tokenizer::Tokenizer;
use proptest::prelude::*;

use common::golden;

fn tiny() -> String {
    golden("tiny-a/model.gguf").to_str().unwrap().to_string()
}

fn ds4<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ds4")).args(args).env("RUST_BACKTRACE", "1").output().unwrap()
}

/// A scratch directory of this test process.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("ds4-bad-input-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// No panic message and no backtrace, whatever the outcome.
fn no_panic(out: &Output, what: &str) {
    let err = stderr(out);
    assert!(
        !err.contains("panicked") && !err.contains("backtrace") && !err.contains("internal error"),
        "{what}: {err}"
    );
    assert_ne!(out.status.code(), Some(101), "{what}: exit 101 is a panic: {err}");
}

/// One bad input: the arguments, the exit code (1: refused by ds4, 2: refused by the argument
/// parser), and the pieces the message must contain.
struct Case {
    args: Vec<String>,
    code: i32,
    says: Vec<String>,
}

fn case(args: &[&str], code: i32, says: &[&str]) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        code,
        says: says.iter().map(|s| s.to_string()).collect(),
    }
}

/// A GGUF of another architecture, with a tensor so that it is not mistaken for a vocabulary.
fn llama_file() -> String {
    let p = scratch().join("llama.gguf");
    let mut w = Writer::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("llama.block_count", Value::U32(2));
    w.tensor("token_embd.weight", GgmlType::F32, &[4, 2], vec![0; 32]);
    w.write_file(&p).unwrap();
    p.to_str().unwrap().to_string()
}

fn write_scratch(name: &str, bytes: &[u8]) -> String {
    let p = scratch().join(name);
    std::fs::write(&p, bytes).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn every_bad_input_is_refused_with_a_clear_message() {
    let m = tiny();
    let m = m.as_str();
    let logits = golden("tiny-a/logits.f32");
    let logits = logits.to_str().unwrap();
    let vocab = golden("tokenizer/vocab.gguf");
    let vocab = vocab.to_str().unwrap();
    let ids65: Vec<String> = (1..=65).map(|i| i.to_string()).collect();
    let ids65 = ids65.join(",");
    let dir = scratch().to_str().unwrap().to_string();
    let missing_dir_out = scratch().join("no/such/dir/out.f32");
    let missing_dir_out = missing_dir_out.to_str().unwrap();
    let llama = llama_file();
    let empty = write_scratch("empty.txt", b"");
    let not_utf8 = write_scratch("latin1.txt", b"caf\xe9 au lait");
    let run = ["run", "--backend", "cpu", "-m", m];
    let with = |base: &[&str], more: &[&str]| -> Vec<String> {
        base.iter().chain(more).map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let c = |args: Vec<String>, code: i32, says: &[&str]| Case {
        args,
        code,
        says: says.iter().map(|s| s.to_string()).collect(),
    };

    let cases = vec![
        // More token ids than reference rows used to index past the reference.
        c(
            with(&["check", "--backend", "cpu", "-m", m, "--logits", logits, "--token-ids"], &[&ids65]),
            1,
            &["--token-ids gives 65 ids", "only 64 rows"],
        ),
        case(
            &["check", "--backend", "cpu", "-m", m, "--logits", &format!("{dir}/none.f32")],
            1,
            &["--logits", "cannot read"],
        ),
        c(with(&["check", "--backend", "cpu", "-m", m, "--logits"], &[&empty]), 1, &["--logits", "empty"]),
        // Sampling options out of range were silently changed or accepted.
        c(with(&run, &["--tokens", "1,2", "--temp=-1"]), 2, &["--temp", "at least 0"]),
        c(with(&run, &["--tokens", "1,2", "--temp", "-1"]), 2, &["--temp", "at least 0"]),
        c(with(&run, &["--tokens", "1,2", "--temp", "nan"]), 2, &["--temp", "finite"]),
        c(with(&run, &["--tokens", "1,2", "--temp", "inf"]), 2, &["--temp", "finite"]),
        c(with(&run, &["--tokens", "1,2", "--top-p", "2"]), 2, &["--top-p", "between 0 and 1"]),
        c(with(&run, &["--tokens", "1,2", "--top-p=-0.5"]), 2, &["--top-p", "between 0 and 1"]),
        c(with(&run, &["--tokens", "1,2", "--min-p", "2"]), 2, &["--min-p", "between 0 and 1"]),
        c(with(&run, &["--tokens", "1,2", "--temp", "warm"]), 2, &["--temp", "not a number"]),
        // Output paths are checked before the model loads.
        c(with(&run, &["--tokens", "1,2", "--dump-logits", missing_dir_out]), 1, &["--dump-logits", missing_dir_out]),
        c(with(&run, &["--tokens", "1,2", "--dump-logits", &dir]), 1, &["--dump-logits", "cannot write"]),
        case(&["synth", "--preset", "tiny", "--out", missing_dir_out], 1, &["--out", "cannot write"]),
        // Threads beyond the cores, a directory as the model, tokenizer-only and foreign files.
        c(with(&run, &["--tokens", "1,2", "-t", "100000"]), 1, &["--threads 100000", "cores"]),
        case(&["run", "-m", &dir, "-p", "hi"], 1, &["-m/--model", "is a directory"]),
        case(&["inspect", "-m", &dir], 1, &["is a directory"]),
        case(&["tokenize", "-m", &dir, "-p", "hi"], 1, &["is a directory"]),
        case(&["run", "-m", vocab, "-p", "hi"], 1, &["tokenizer-only GGUF"]),
        case(&["inspect", "-m", vocab], 1, &["tokenizer-only GGUF"]),
        case(&["run", "-m", &llama, "-p", "hi"], 1, &["architecture 'llama' is not deepseek4"]),
        // --bisect past the context named neither option.
        case(
            &["check", "--backend", "cpu", "--against", "cpu", "-m", m, "--bisect", "100", "-c", "8"],
            1,
            &["--bisect 100", "--ctx 8"],
        ),
        case(&["check", "-m", m, "--logits", logits, "--bisect", "3"], 2, &["--bisect"]),
        case(&["check", "-m", m, "--isolate"], 2, &["--bisect"]),
        case(&["check", "-m", m, "--tolerance", "nan"], 2, &["--tolerance", "finite"]),
        case(&["check", "-m", m, "--token-ids", "1,2,3", "-c", "2"], 1, &["--token-ids gives 3 ids", "--ctx 2"]),
        case(&["check", "-m", m, "-n", "9", "-c", "8"], 1, &["-n 9", "--ctx 8"]),
        // Zero counts gave meaningless figures.
        case(&["bench", "--backend", "cpu", "-m", m, "--prefill", "0", "-n", "0"], 2, &["--prefill", "at least 1"]),
        case(&["bench", "--backend", "cpu", "-m", m, "--prefill", "1", "-n", "0"], 2, &["--tokens", "at least 1"]),
        case(
            &["bench", "--backend", "cpu", "-m", m, "--prefill", "8", "-n", "8", "-c", "10"],
            1,
            &["--prefill 8", "--ctx 10"],
        ),
        // Empty prompts, and contexts beyond the model's.
        c(with(&run, &["-p", ""]), 1, &["-p/--prompt is empty"]),
        c(with(&run, &["--prompt-file"]).into_iter().chain([empty.clone()]).collect(), 1, &["--prompt-file", "empty"]),
        c(
            with(&run, &["--prompt-file"]).into_iter().chain([not_utf8.clone()]).collect(),
            1,
            &["--prompt-file", "not valid UTF-8", "byte 3"],
        ),
        c(with(&run, &["-p", "hi", "--ctx", "16777216"]), 1, &["--ctx 16777216", "context length 1048576"]),
        c(with(&run, &["-p", "hi", "--ctx", "0"]), 2, &["--ctx", "at least 1"]),
        case(&["run", "--preset", "huge", "-p", "hi"], 2, &["--preset", "tiny"]),
    ];
    for case in cases {
        let what = case.args.join(" ");
        let out = ds4(&case.args);
        let err = stderr(&out);
        no_panic(&out, &what);
        assert_eq!(out.status.code(), Some(case.code), "{what}: {err}");
        for s in &case.says {
            assert!(err.contains(s), "{what}: the message lacks '{s}': {err}");
        }
        // Refused before any work: nothing loaded, nothing generated.
        assert!(!err.contains("loaded in") || case.args.contains(&"--logits".to_string()), "{what}: {err}");
        assert!(out.stdout.is_empty(), "{what}: {}", String::from_utf8_lossy(&out.stdout));
    }
}

/// Runs `ds4` with its stdout already closed, as `ds4 ... | head` leaves it.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let child = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn a_closed_stdout_ends_quietly_with_success() {
    let m = tiny();
    let m = m.as_str();
    let vocab = golden("tokenizer/vocab.gguf");
    for args in [
        vec!["inspect", "-m", m],
        vec!["tokenize", "-m", vocab.to_str().unwrap(), "-p", "Hello world"],
        vec!["bench", "--backend", "cpu", "-m", m, "--prefill", "1", "-n", "1", "-c", "8"],
        vec!["run", "--backend", "cpu", "-m", m, "--tokens", "1,2", "-n", "4", "-c", "8"],
        vec!["check", "--backend", "cpu", "--against", "cpu", "-m", m, "-c", "8", "--bisect", "0", "--isolate"],
    ] {
        let what = args.join(" ");
        let out = with_closed_stdout(&args);
        no_panic(&out, &what);
        assert_eq!(out.status.code(), Some(0), "{what}: {}", stderr(&out));
        assert!(!stderr(&out).contains("error"), "{what}: {}", stderr(&out));
    }
}

#[test]
fn speed_lines_count_what_was_timed() {
    let m = tiny();
    // One generated token comes from the prefill: there is no decode step to time.
    let out = ds4(&["run", "--backend", "cpu", "-m", &m, "--tokens", "1,2", "-n", "1", "-c", "8"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("generated 1 token, no decode step") && !err.contains("(0.0 tok/s)"), "{err}");
    let out = ds4(&["run", "--backend", "cpu", "-m", &m, "--tokens", "1,2", "-n", "3", "-c", "8"]);
    let err = stderr(&out);
    assert!(err.contains("generated 3 tokens; decode 2 tokens in"), "{err}");

    // bench names the backend the session runs on, whichever --backend auto chose.
    let out = ds4(&["bench", "--backend", "auto", "-m", &m, "--prefill", "1", "-n", "1", "-c", "8"]);
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout).to_string(), stderr(&out));
    assert!(out.status.success(), "{err}");
    let named = stdout.lines().find_map(|l| l.strip_prefix("backend")).unwrap().trim().to_string();
    assert!(err.contains(&format!(" on {named} (")), "bench says '{named}', the session line says: {err}");
    assert!(stdout.contains("prefill    1 tokens"), "{stdout}");
}

#[test]
fn every_option_has_a_description() {
    for (cmd, options) in [
        (
            "run",
            &["-p, --prompt", "--prompt-file", "--top-p", "--top-k", "--min-p", "--seed", "--backend", "--temp"][..],
        ),
        ("inspect", &["-m, --model"][..]),
        ("synth", &["--out", "--preset", "--seed"][..]),
        ("tokenize", &["-m, --model", "-p, --prompt", "--prompt-file"][..]),
        ("check", &["--backend", "--logits", "--bisect"][..]),
        ("bench", &["--backend", "--prefill"][..]),
    ] {
        let out = ds4(&[cmd, "-h"]);
        let help = String::from_utf8_lossy(&out.stdout).to_string();
        let lines: Vec<&str> = help.lines().collect();
        for opt in options {
            let at = lines
                .iter()
                .position(|l| l.trim_start().starts_with(opt) && l.contains(&format!("{opt} ")))
                .unwrap_or_else(|| panic!("ds4 {cmd} -h lacks {opt}: {help}"));
            let line = lines[at];
            // The description follows the option and its value name after a run of spaces, or,
            // when clap lays long options out that way, on the next, more indented line.
            let next = lines.get(at + 1).filter(|l| !l.trim_start().starts_with('-')).map_or("", |l| l.trim());
            let desc = line.trim().split_once("  ").map(|(_, d)| d.trim()).unwrap_or(next);
            assert!(desc.len() > 10, "ds4 {cmd} -h: {opt} has no description: '{line}'");
        }
    }
}

/// A sampling option value: mostly numbers in and around the allowed ranges, sometimes anything.
fn option_value() -> impl Strategy<Value = String> {
    prop_oneof![
        (-2.0f32..3.0).prop_map(|v| v.to_string()),
        (0.0f32..=1.0).prop_map(|v| v.to_string()),
        any::<u32>().prop_map(|b| f32::from_bits(b).to_string()),
        prop::sample::select(vec!["nan", "inf", "-inf", "1e40", "-0", "0", "1", "", "x", "0.5.5", "1e-45"])
            .prop_map(String::from),
    ]
}

fn valid(option: &str, value: &str) -> bool {
    let Ok(v) = value.trim().parse::<f32>() else { return false };
    match option {
        "--temp" => v.is_finite() && v >= 0.0,
        _ => (0.0..=1.0).contains(&v),
    }
}

/// With token ids in, ids come out, and nothing else: here the last sampled token ends in the
/// middle of a UTF-8 character (found by `random_sampling_options`), whose pending bytes once
/// followed the ids as U+FFFD.
#[test]
fn ids_out_stay_ids_when_the_text_ends_mid_character() {
    let out = ds4(&[
        "run",
        "--backend",
        "cpu",
        "-m",
        &tiny(),
        "-c",
        "8",
        "--tokens",
        "1,2",
        "-n",
        "3",
        "--temp=0.9830512",
        "--top-p=0.14841393",
        "--min-p=0",
        "--top-k=964518721164",
        "--seed=18051259715510619906",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    let ids: Vec<u32> = text.split_whitespace().map(|t| t.parse().expect("only ids")).collect();
    assert_eq!(ids.len(), 3, "{text:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Random values for the sampling options: a valid set samples in-vocabulary tokens, an
    /// invalid one is refused with the name of an offending option, and nothing panics.
    #[test]
    fn random_sampling_options(temp in option_value(), top_p in option_value(), min_p in option_value(),
                               top_k in any::<u64>(), seed in any::<u64>()) {
        let m = tiny();
        let args = vec![
            "run".to_string(), "--backend".into(), "cpu".into(), "-m".into(), m, "-c".into(), "8".into(),
            "--tokens".into(), "1,2".into(), "-n".into(), "3".into(),
            format!("--temp={temp}"), format!("--top-p={top_p}"), format!("--min-p={min_p}"),
            format!("--top-k={top_k}"), format!("--seed={seed}"),
        ];
        let out = ds4(&args);
        let what = args.join(" ");
        no_panic(&out, &what);
        let bad: Vec<&str> = [("--temp", &temp), ("--top-p", &top_p), ("--min-p", &min_p)]
            .iter().filter(|(o, v)| !valid(o, v)).map(|(o, _)| *o).collect();
        if bad.is_empty() {
            prop_assert!(out.status.success(), "{}: {}", what, stderr(&out));
            let ids: Vec<u32> = String::from_utf8_lossy(&out.stdout).split_whitespace()
                .map(|t| t.parse().unwrap()).collect();
            prop_assert_eq!(ids.len(), 3);
            prop_assert!(ids.iter().all(|&t| t < 512), "{:?}", ids);
        } else {
            prop_assert_eq!(out.status.code(), Some(2), "{}: {}", what, stderr(&out));
            let err = stderr(&out);
            prop_assert!(bad.iter().any(|o| err.contains(&format!("'{o} <"))), "{}: {}", what, err);
        }
    }

    /// Any bytes as a prompt file: valid UTF-8 is tokenized, anything else is refused with the
    /// file's name; nothing panics.
    #[test]
    fn random_prompt_files(bytes in prop_oneof![
        prop::collection::vec(any::<u8>(), 0..200),
        any::<String>().prop_map(String::into_bytes),
    ]) {
        let path = scratch().join(format!("prompt-{}.txt", std::thread::current().name().unwrap_or("t").replace(':', "_")));
        std::fs::write(&path, &bytes).unwrap();
        let out = ds4(&["tokenize".as_ref(), "-m".as_ref(), golden("tiny-a/model.gguf").as_os_str(),
                        "--prompt-file".as_ref(), path.as_os_str()]);
        no_panic(&out, "tokenize --prompt-file");
        match std::str::from_utf8(&bytes) {
            Ok(text) => {
                prop_assert!(out.status.success(), "{}", stderr(&out));
                let ids: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
                prop_assert!(ids.iter().all(|&t| t < 512));
                prop_assert_eq!(ids.is_empty(), text.is_empty());
            }
            Err(_) => {
                prop_assert_eq!(out.status.code(), Some(1));
                prop_assert!(stderr(&out).contains("not valid UTF-8"), "{}", stderr(&out));
            }
        }
    }
}

fn real_tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_gguf(&gguf::File::open(golden("tokenizer/vocab.gguf")).unwrap()).unwrap())
}

fn tiny_tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_gguf(&gguf::File::open(golden("tiny-a/model.gguf")).unwrap()).unwrap())
}

/// Text that stresses the pre-tokenizer: digits, CJK and kana runs, whitespace and newlines,
/// punctuation, special-token strings, and anything else.
fn tricky_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        any::<char>().prop_map(String::from),
        "[0-9]{1,8}",
        "[\u{4E00}-\u{9FA5}\u{3040}-\u{30FF}]{1,6}",
        "[ \t\r\n]{1,5}",
        "[!-/:-@\\[-`{-~]{1,4}[A-Za-z]{0,4}",
        prop::sample::select(vec![
            "<｜User｜>",
            "<think>",
            "</think>",
            "<｜end▁of▁sentence｜>",
            "｜DSML｜",
            "\u{FEFF}",
            "é",
            "🦀"
        ])
        .prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Encoding never panics and decoding the ids gives the text back, byte for byte.
    #[test]
    fn tokenizer_round_trips_any_text(text in prop_oneof![any::<String>(), tricky_text()]) {
        for tok in [real_tokenizer(), tiny_tokenizer()] {
            let ids = tok.encode(&text);
            prop_assert!(ids.iter().all(|&t| (t as usize) < tok.vocab_size()));
            prop_assert_eq!(String::from_utf8(tok.decode(&ids)).unwrap(), text.clone());
            // Rendered text (specials become their tokens) and the chat template never panic.
            let _ = tok.encode_rendered(&text);
            let _ = tok.render_chat(&text, &text, ds4::tokenizer::ThinkMode::Think);
        }
    }
}
