//! The GGUF reader: real files load, the writer round-trips every value type, and each kind of
//! corruption gives its own error (never a panic).

mod common;

use ds4::gguf::{self, File, GgufProblem, Value, ValueType, Writer};
use ds4::quant::GgmlType;
use proptest::prelude::*;

use common::golden;

#[test]
fn golden_files_load() {
    let f = File::open(golden("tiny-a/model.gguf")).expect("tiny-a parses");
    assert_eq!(f.version, 3);
    assert_eq!(f.tensors().len(), 178);
    let t = f.tensor("blk.3.ffn_down_exps.weight").unwrap();
    assert_eq!((t.ty, t.dims.as_slice()), (GgmlType::Q2_K, &[256u64, 256, 8][..]));
    assert_eq!(f.tensor_data(t).len() as u64, t.bytes);
    assert_eq!(f.get("deepseek4.block_count"), Some(&Value::U32(6)));

    let v = File::open(golden("tokenizer/vocab.gguf")).expect("vocab parses");
    assert_eq!(v.string_array("tokenizer.ggml.tokens").unwrap().len(), 129280);
    assert!(!v.string_array("tokenizer.ggml.merges").unwrap().is_empty());
}

fn every_value_type() -> Vec<(&'static str, Value)> {
    vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-5)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("f32", Value::F32(1.5e-6)),
        ("bool", Value::Bool(true)),
        ("string", Value::String("héllo ｜ world".into())),
        ("u64", Value::U64(u64::MAX - 1)),
        ("i64", Value::I64(i64::MIN + 1)),
        ("f64", Value::F64(-2.25)),
        ("arr_u32", gguf::u32_array(&[1, 2, 3])),
        ("arr_str", gguf::string_array(&["a", "", "ccc"])),
        ("arr_arr", Value::Array(ValueType::Array, vec![gguf::u32_array(&[7]), gguf::u32_array(&[])])),
    ]
}

/// A small valid file: every value type and two tensors.
fn sample_writer() -> Writer {
    let mut w = Writer::new();
    for (k, v) in every_value_type() {
        w.set(k, v);
    }
    w.tensor("a.weight", GgmlType::F32, &[4, 2], (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect());
    w.tensor("b.weight", GgmlType::Q8_0, &[32], vec![0x11; 34]);
    w
}

#[test]
fn writer_round_trips_every_value_type() {
    let f = File::from_bytes("sample", sample_writer().to_bytes()).unwrap();
    for (k, v) in every_value_type() {
        assert_eq!(f.get(k), Some(&v), "key {k}");
    }
    let a = f.tensor("a.weight").unwrap();
    assert_eq!(a.offset % 32, 0, "tensor data is aligned");
    assert_eq!(f.tensor_data(a)[4..8], 1.0f32.to_le_bytes());
    assert_eq!(f.tensor_data(f.tensor("b.weight").unwrap()), &[0x11; 34][..]);
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).expect("pattern present")
}

/// Byte offset just past a length-prefixed string.
fn after_string(bytes: &[u8], s: &str) -> usize {
    find(bytes, s.as_bytes()) + s.len()
}

fn problem(bytes: Vec<u8>) -> GgufProblem {
    let e = File::from_bytes("corrupt.gguf", bytes).expect_err("corrupted file must not parse");
    assert!(e.to_string().starts_with("corrupt.gguf: "), "error names the file: {e}");
    e.problem
}

fn patch(bytes: &mut [u8], at: usize, with: &[u8]) {
    bytes[at..at + with.len()].copy_from_slice(with);
}

#[test]
fn each_corruption_has_its_own_error() {
    let good = sample_writer().to_bytes();
    type Expect = fn(&GgufProblem) -> bool;
    let mut cases: Vec<(&str, Vec<u8>, Expect)> = Vec::new();

    let mut b = good.clone();
    patch(&mut b, 0, b"GGML");
    cases.push(("bad magic", b, |p| matches!(p, GgufProblem::BadMagic(_))));

    let mut b = good.clone();
    patch(&mut b, 4, &2u32.to_le_bytes());
    cases.push(("version 2", b, |p| matches!(p, GgufProblem::UnsupportedVersion(2))));

    cases.push(("truncated header", good[..30].to_vec(), |p| matches!(p, GgufProblem::Truncated { .. })));

    let mut b = good.clone();
    let at = after_string(&b, "u16");
    patch(&mut b, at, &99u32.to_le_bytes());
    cases.push(("unknown value type", b, |p| matches!(p, GgufProblem::UnknownValueType { ty: 99, .. })));

    let mut b = good.clone();
    let at = find(&b, b"string") - 8;
    patch(&mut b, at, &u64::MAX.to_le_bytes());
    cases.push(("bad string length", b, |p| matches!(p, GgufProblem::BadStringLength { .. })));

    let mut b = good.clone();
    let at = after_string(&b, "arr_u32") + 4 + 4;
    patch(&mut b, at, &(1u64 << 60).to_le_bytes());
    cases.push(("array count overflow", b, |p| matches!(p, GgufProblem::Overflow { .. })));

    let mut b = good.clone();
    let at = after_string(&b, "a.weight");
    patch(&mut b, at + 4 + 16, &99u32.to_le_bytes());
    cases.push(("unknown tensor type", b, |p| matches!(p, GgufProblem::UnknownTensorType { ty: 99, .. })));

    let mut b = good.clone();
    let at = after_string(&b, "a.weight");
    patch(&mut b, at + 4, &(1u64 << 62).to_le_bytes());
    patch(&mut b, at + 12, &(1u64 << 62).to_le_bytes());
    cases.push(("size overflow", b, |p| matches!(p, GgufProblem::Overflow { .. })));

    let mut b = good.clone();
    let at = after_string(&b, "a.weight");
    patch(&mut b, at + 4 + 16 + 4, &(u64::MAX - 31).to_le_bytes());
    cases.push(("offset overflow", b, |p| matches!(p, GgufProblem::Overflow { .. })));

    let mut b = good.clone();
    let at = after_string(&b, "a.weight");
    patch(&mut b, at + 4 + 16 + 4, &3u64.to_le_bytes());
    cases.push(("misaligned tensor", b, |p| matches!(p, GgufProblem::MisalignedTensor { offset: 3, .. })));

    let mut b = good.clone();
    let at = after_string(&b, "b.weight");
    patch(&mut b, at, &5u32.to_le_bytes());
    cases.push(("too many dims", b, |p| matches!(p, GgufProblem::TooManyDims { n_dims: 5, .. })));

    let mut b = good.clone();
    let at = find(&b, "héllo".as_bytes());
    patch(&mut b, at + 1, &[0xff]);
    cases.push(("invalid utf-8", b, |p| matches!(p, GgufProblem::InvalidUtf8 { .. })));

    let b = good[..good.len() - 64].to_vec();
    cases.push(("tensor past the end", b, |p| matches!(p, GgufProblem::TensorOutOfBounds { .. })));

    let mut w = sample_writer();
    w.tensor("a.weight", GgmlType::F32, &[1], vec![0; 4]);
    cases.push(("duplicate tensor", w.to_bytes(), |p| matches!(p, GgufProblem::DuplicateTensor(n) if n == "a.weight")));

    let mut b = good.clone();
    let at = find(&b, b"u16");
    patch(&mut b, at, b"u32");
    cases.push(("duplicate key", b, |p| matches!(p, GgufProblem::DuplicateKey(k) if k == "u32")));

    let mut w = sample_writer();
    w.set("general.alignment", Value::U32(24));
    cases.push(("bad alignment", w.to_bytes(), |p| matches!(p, GgufProblem::BadAlignment(24))));

    let mut b = good.clone();
    let at = after_string(&b, "b.weight");
    patch(&mut b, at + 4, &33u64.to_le_bytes());
    cases.push(("partial block", b, |p| matches!(p, GgufProblem::BadShape { .. })));

    for (name, bytes, expect) in cases {
        let p = problem(bytes);
        println!("{name:20} -> {p}");
        assert!(expect(&p), "{name}: unexpected error {p:?}");
    }
}

#[test]
fn a_missing_file_names_the_path() {
    let e = File::open("/nonexistent/dir/model.gguf").unwrap_err();
    assert!(e.to_string().contains("/nonexistent/dir/model.gguf"));
    assert!(matches!(e.problem, GgufProblem::Io(_)));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Whatever bytes are flipped or cut, parsing returns (never panics), and every tensor it
    /// accepts lies inside the file.
    #[test]
    fn corrupted_bytes_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in any::<usize>()) {
        let mut b = sample_writer().to_bytes();
        for (at, v) in flips {
            let n = b.len();
            b[at % n] ^= v | 1;
        }
        let keep = b.len() - cut % 64;
        b.truncate(keep);
        if let Ok(f) = File::from_bytes("fuzz", b) {
            for t in f.tensors() {
                prop_assert!(t.offset + t.bytes <= f.len());
                prop_assert_eq!(f.tensor_data(t).len() as u64, t.bytes);
            }
        }
    }
}
