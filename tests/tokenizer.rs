//! Tokenizer tests against the golden DeepSeek V4 vocabulary and the tiny-a stand-in vocabulary.
//! Missing golden files fail the tests: they are part of the repository (`tests/data/golden`).

mod common;

use std::sync::OnceLock;
use std::time::Instant;

use ds4::gguf;
use ds4::tokenizer::{standin_vocab, StreamDecoder, ThinkMode, Tokenizer, TokenizerError};

use common::golden;

fn open(rel: &str) -> gguf::File {
    let path = golden(rel);
    gguf::File::open(&path).unwrap_or_else(|e| panic!("cannot open golden {}: {e}", path.display()))
}

/// The real vocabulary, loaded once: building 128k merges is the slow part of these tests.
fn real() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_gguf(&open("tokenizer/vocab.gguf")).expect("load real tokenizer"))
}

struct Case {
    text: String,
    ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let path = golden("tokenizer/cases.jsonl");
    let body = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let cases: Vec<Case> = body
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("cases.jsonl line is JSON");
            Case {
                text: v["text"].as_str().expect("text").to_string(),
                ids: v["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect(),
            }
        })
        .collect();
    assert!(cases.len() >= 40, "expected the full golden case set, got {}", cases.len());
    cases
}

fn vocab_index(file: &gguf::File, s: &str) -> u32 {
    let tokens = file.string_array("tokenizer.ggml.tokens").expect("tokens");
    tokens.iter().position(|t| *t == s).unwrap_or_else(|| panic!("{s} not in vocab")) as u32
}

#[test]
fn golden_cases_exact() {
    let tok = real();
    assert_eq!(tok.vocab_size(), 129280);
    let cases = cases();
    let mut failures = Vec::new();
    for c in &cases {
        let got = tok.encode(&c.text);
        if got != c.ids {
            failures.push(format!("{:?}\n  want {:?}\n  got  {:?}", c.text, c.ids, got));
        }
        assert_eq!(tok.decode(&got), c.text.as_bytes(), "round trip of {:?}", c.text);
        assert_eq!(tok.decode(&c.ids), c.text.as_bytes(), "decode of golden ids for {:?}", c.text);
    }
    println!("tokenizer golden cases: {}/{} exact", cases.len() - failures.len(), cases.len());
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn specials_only_from_rendered_text() {
    let tok = real();
    let s = *tok.specials();
    let all = [s.bos, s.eos, s.user, s.assistant, s.think, s.think_end, s.dsml];
    let text = "<｜begin▁of▁sentence｜>sys<｜User｜>hi ｜DSML｜<think>x</think><｜Assistant｜><｜end▁of▁sentence｜>";

    let plain = tok.encode(text);
    assert!(plain.iter().all(|id| !all.contains(id)), "special id from plain text: {plain:?}");
    assert_eq!(tok.decode(&plain), text.as_bytes());
    for single in ["<｜User｜>", "<think>", "</think>", "｜DSML｜"] {
        let ids = tok.encode(single);
        assert!(ids.len() > 1 && ids.iter().all(|id| !all.contains(id)), "{single}: {ids:?}");
    }

    let rendered = tok.encode_rendered(text);
    let mut want = vec![s.bos];
    want.extend(tok.encode("sys"));
    want.push(s.user);
    want.extend(tok.encode("hi "));
    want.push(s.dsml);
    want.push(s.think);
    want.extend(tok.encode("x"));
    want.extend([s.think_end, s.assistant, s.eos]);
    assert_eq!(rendered, want);
    assert_eq!(tok.decode(&rendered), text.as_bytes(), "specials decode to their literal text");
    assert_eq!(tok.token_bytes(s.user).unwrap(), "<｜User｜>".as_bytes());
}

#[test]
fn chat_template_ids() {
    let file = open("tokenizer/vocab.gguf");
    let tok = real();
    let s = *tok.specials();
    // The special ids must be the positions of those strings in the GGUF token list.
    assert_eq!(s.bos, vocab_index(&file, "<｜begin▁of▁sentence｜>"));
    assert_eq!(s.user, vocab_index(&file, "<｜User｜>"));
    assert_eq!(s.assistant, vocab_index(&file, "<｜Assistant｜>"));
    assert_eq!(s.think, vocab_index(&file, "<think>"));
    assert_eq!(s.think_end, vocab_index(&file, "</think>"));
    assert_eq!((s.bos, s.eos, s.user, s.assistant), (0, 1, 128803, 128804));
    assert_eq!((s.think, s.think_end, s.dsml), (128821, 128822, 128825));

    let (system, prompt) = ("You are a helpful assistant.", "Hello world");
    assert_eq!(tok.encode(prompt), [19923, 2058], "prompt ids from cases.jsonl");
    for (mode, last) in [(ThinkMode::Think, s.think), (ThinkMode::NoThink, s.think_end)] {
        let mut want = vec![s.bos];
        want.extend(tok.encode(system));
        want.push(s.user);
        want.extend(tok.encode(prompt));
        want.extend([s.assistant, last]);
        assert_eq!(tok.render_chat(system, prompt, mode), want, "{mode:?}");

        // An empty system prompt adds nothing, as in ds4.
        let bare = tok.render_chat("", prompt, mode);
        assert_eq!(bare, [s.bos, s.user, 19923, 2058, s.assistant, last], "{mode:?}");
    }
}

#[test]
fn tiny_standin_vocab() {
    let file = open("tiny-a/model.gguf");
    let tok = Tokenizer::from_gguf(&file).expect("tiny-a tokenizer");
    assert_eq!(tok.vocab_size(), 512);
    let s = *tok.specials();
    assert_eq!([s.bos, s.eos, s.user, s.assistant, s.think, s.think_end, s.dsml], [0, 1, 2, 3, 4, 5, 6]);

    let ids = tok.encode("Hello");
    assert_eq!(ids.len(), 5, "{ids:?}");
    // Byte b of a printable ASCII char sits at 7 + (b - '!') in the stand-in alphabet.
    let want: Vec<u32> = "Hello".bytes().map(|b| 7 + u32::from(b - b'!')).collect();
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids), b"Hello");

    let mixed = "perché 中文\n<｜User｜>";
    let ids = tok.encode(mixed);
    assert_eq!(ids.len(), mixed.len(), "one token per byte");
    assert_eq!(tok.decode(&ids), mixed.as_bytes());

    // Out-of-range ids are skipped, never a panic.
    assert_eq!(tok.decode(&[u32::MAX, 512, ids[0]]), b"p");
    assert_eq!(tok.token_bytes(512), None);
}

#[test]
fn standin_vocab_layout() {
    let (tokens, merges) = standin_vocab(300).expect("standin");
    assert_eq!(tokens.len(), 300);
    assert!(merges.is_empty());
    let tiny = open("tiny-a/model.gguf");
    let tiny_tokens = tiny.string_array("tokenizer.ggml.tokens").expect("tokens");
    // Specials and the byte alphabet are laid out exactly as in the golden tiny model.
    assert_eq!(&tokens[..263], &tiny_tokens[..263]);
    assert_eq!(tokens[263], "<|filler_0|>");
    assert_eq!(tokens[299], "<|filler_36|>");

    let tok = Tokenizer::from_vocab(tokens, merges).expect("build");
    let text = "Ünïcode ✓ \u{0}\u{7f}";
    let ids = tok.encode(text);
    assert_eq!(ids.len(), text.len());
    assert_eq!(tok.decode(&ids), text.as_bytes());
    for b in 0..=255u8 {
        assert_eq!(tok.token_bytes(7 + u32::from(b)).map(|v| v.len()), Some(1));
    }

    assert!(matches!(standin_vocab(262), Err(TokenizerError::StandinTooSmall { .. })));
}

#[test]
fn vocab_errors_are_reported() {
    let (mut tokens, _) = standin_vocab(263).unwrap();
    // Merges whose pieces are not in the vocabulary are skipped, not fatal.
    assert!(Tokenizer::from_vocab(tokens.clone(), vec!["xy z".into(), "a b".into()]).is_ok());
    let err = Tokenizer::from_vocab(tokens.clone(), vec!["nospace".into()]).unwrap_err();
    assert!(matches!(err, TokenizerError::BadMerge { index: 0, .. }), "{err}");

    tokens.retain(|t| t != "｜DSML｜");
    let err = Tokenizer::from_vocab(tokens, vec![]).unwrap_err();
    assert!(err.to_string().contains("｜DSML｜"), "{err}");

    let mut w = gguf::Writer::new();
    w.set("tokenizer.ggml.tokens", gguf::string_array(&["a"]));
    let file = gguf::File::from_bytes("no-merges.gguf", w.to_bytes()).expect("gguf");
    let err = Tokenizer::from_gguf(&file).unwrap_err().to_string();
    assert!(err.contains("no-merges.gguf") && err.contains("tokenizer.ggml.merges"), "{err}");
}

#[test]
fn stream_decoder_never_splits_chars() {
    let text = "aé中😀👍🏽 ok ĠÑĤ";
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for b in text.as_bytes() {
        let piece = dec.push(std::slice::from_ref(b));
        assert!(!piece.contains('\u{FFFD}'), "broken char after byte {b:#x}");
        out.push_str(&piece);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);

    // Token by token through the real vocabulary: CJK and emoji tokens split characters.
    let tok = real();
    let text = "日本語のテキスト 😀🎉 perché";
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for id in tok.encode(text) {
        out.push_str(&dec.push(&tok.token_bytes(id).unwrap()));
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);

    // Invalid bytes become U+FFFD at once instead of being held forever.
    let mut dec = StreamDecoder::new();
    assert_eq!(dec.push(b"a\xffb"), "a\u{FFFD}b");
    assert_eq!(dec.push(b"\xe4\xb8"), "");
    assert_eq!(dec.push(b"x"), "\u{FFFD}x");
    assert_eq!(dec.push(b"\xe4\xb8"), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
    assert_eq!(dec.finish(), "");
}

#[test]
fn encode_100kb_fast() {
    let tok = real();
    let cases = cases();
    let mut text = String::new();
    let mut i = 0;
    while text.len() < 100 * 1024 {
        text.push_str(&cases[i % cases.len()].text);
        text.push('\n');
        i += 1;
    }
    let t0 = Instant::now();
    let ids = tok.encode(&text);
    let dt = t0.elapsed();
    println!("encoded {} bytes into {} tokens in {:.1} ms", text.len(), ids.len(), dt.as_secs_f64() * 1e3);
    assert_eq!(tok.decode(&ids), text.as_bytes());
    if cfg!(debug_assertions) {
        println!("debug build: timing not asserted");
    } else {
        assert!(dt.as_secs_f64() < 1.0, "100 KB took {dt:?}");
    }
}

#[test]
fn long_runs_split_like_short_ones() {
    let tok = real();
    let n = 200_000;
    // `\s+(?!\S)` gives the run minus one space, and the last space joins the word.
    let spaces = " ".repeat(n);
    let mut want = tok.encode(&spaces[1..]);
    want.extend(tok.encode(" x"));
    let t0 = Instant::now();
    assert_eq!(tok.encode(&format!("{spaces}x")), want);
    for text in ["\n".repeat(n), "7".repeat(n), "ab".repeat(n), "中".repeat(n), "!?".repeat(n)] {
        let ids = tok.encode(&text);
        assert_eq!(tok.decode(&ids), text.as_bytes());
    }
    assert_eq!(tok.encode(&"123".repeat(1000)), vec![tok.encode("123")[0]; 1000]);
    println!("long runs encoded in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
}
