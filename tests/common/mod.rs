//! Paths to the test data kept in the repository (`tests/data/golden`, a byte-identical copy of the
//! project's shared golden data; `.ci/run` compares the two with `cmp` when both exist).
// Each test crate uses a subset of these helpers.
#![allow(dead_code)]

use std::path::PathBuf;

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
