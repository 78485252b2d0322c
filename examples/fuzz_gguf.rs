//! A GGUF fuzzer on stable Rust: mutations and truncations of real GGUF headers, tensor tables and
//! metadata, fed to the reader (and, when the reader accepts a file, to the model binder and the
//! tokenizer). It counts panics (there must be none) and checks that every accepted file's
//! tensors lie inside the file.
//!
//!     cargo run --release --example fuzz_gguf -- [--cases N] [--threads T] [--seed S] [--golden DIR]
//!     cargo run --release --example fuzz_gguf -- --replay CASE   # rerun one case, write it to fuzz-CASE.gguf
//!
//! Seeds: the golden tiny model and tokenizer (from `--golden`, default `tests/data/golden`, when
//! present; the tokenizer's arrays cut to their first entries so a case stays fast), the
//! embedded tiny synthetic model, and a small file holding every metadata value type. A case picks
//! a seed, rewrites fields found by walking its layout (counts, lengths, types, dims, offsets) with
//! boundary values, flips bits, inserts, deletes or copies byte runs, and may cut the file. The
//! tensor data region is zero-filled: the reader never reads it, and a zeroed allocation costs no
//! page writes, so a 12 MB model costs what its header costs. Every case is derived from the seed
//! and its index alone, so any case can be replayed on any thread count.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use ds4::gguf::{self, File, Value, ValueType, Writer};
use ds4::model::Model;
use ds4::quant::GgmlType;
use ds4::tokenizer::Tokenizer;

/// A seed file: its header (everything before the tensor data) and the size of its data region,
/// with the place of every field a mutation may rewrite.
struct Seed {
    name: String,
    header: Vec<u8>,
    data_len: usize,
    fields: Vec<(usize, usize)>,
}

/// splitmix64: a new independent stream per case from (seed, case index).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Walks a GGUF header, recording (offset, width) of every count, length, type id, dimension and
/// offset field. Returns the fields and the end of the tensor table. Only used on valid seeds.
fn layout(b: &[u8]) -> (Vec<(usize, usize)>, usize) {
    let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
    let mut f = vec![(4, 4), (8, 8), (16, 8)];
    let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
    let mut p = 24;
    fn value(b: &[u8], p: &mut usize, ty: u32, f: &mut Vec<(usize, usize)>, record: bool) {
        let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => *p += 1,
            2 | 3 => *p += 2,
            4..=6 => *p += 4,
            10..=12 => *p += 8,
            8 => {
                if record {
                    f.push((*p, 8));
                }
                *p += 8 + u64_at(*p);
            }
            9 => {
                let ety = u32_at(*p);
                let n = u64_at(*p + 4);
                f.push((*p, 4));
                f.push((*p + 4, 8));
                *p += 12;
                for i in 0..n {
                    // Long arrays: record the first few elements' fields, walk the rest.
                    value(b, p, ety, f, i < 4);
                }
            }
            _ => unreachable!("seeds are valid"),
        }
    }
    for _ in 0..n_kv {
        f.push((p, 8));
        p += 8 + u64_at(p);
        let ty = u32_at(p);
        f.push((p, 4));
        p += 4;
        value(b, &mut p, ty, &mut f, true);
    }
    for _ in 0..n_tensors {
        f.push((p, 8));
        p += 8 + u64_at(p);
        let n_dims = u32_at(p) as usize;
        f.push((p, 4));
        p += 4;
        for _ in 0..n_dims {
            f.push((p, 8));
            p += 8;
        }
        f.push((p, 4));
        f.push((p + 4, 8));
        p += 12;
    }
    (f, p)
}

fn seed_from_bytes(name: &str, bytes: &[u8]) -> Seed {
    let file = File::from_bytes(name, bytes.to_vec()).unwrap_or_else(|e| panic!("seed {name} is not valid: {e}"));
    let (fields, table_end) = layout(bytes);
    // The header runs to the data offset (the table plus alignment padding); with no tensors the
    // whole file is header.
    let header_end = if file.tensors().is_empty() { bytes.len() } else { file.data_offset as usize };
    assert!(table_end <= header_end);
    Seed { name: name.to_string(), header: bytes[..header_end].to_vec(), data_len: bytes.len() - header_end, fields }
}

/// The golden tokenizer with its arrays cut to their first `keep` entries: real metadata, small
/// enough to parse in microseconds.
fn cut_tokenizer(bytes: Vec<u8>, keep: usize) -> Vec<u8> {
    let f = File::from_bytes("vocab", bytes).expect("the golden tokenizer parses");
    let mut w = Writer::new();
    for (k, v) in f.metadata() {
        let v = match v {
            Value::Array(t, items) => Value::Array(*t, items.iter().take(keep).cloned().collect()),
            v => v.clone(),
        };
        w.set(k.clone(), v);
    }
    w.to_bytes()
}

/// A small file with one key of every value type, nested arrays and a few tensors.
fn every_type_file() -> Vec<u8> {
    let mut w = Writer::new();
    w.set("t.u8", Value::U8(7))
        .set("t.i8", Value::I8(-7))
        .set("t.u16", Value::U16(700))
        .set("t.i16", Value::I16(-700))
        .set("t.u32", Value::U32(70000))
        .set("t.i32", Value::I32(-70000))
        .set("t.f32", Value::F32(0.5))
        .set("t.bool", Value::Bool(true))
        .set("t.str", Value::String("héllo".into()))
        .set("t.u64", Value::U64(1 << 40))
        .set("t.i64", Value::I64(-(1 << 40)))
        .set("t.f64", Value::F64(0.25))
        .set("t.arr", gguf::u32_array(&[1, 2, 3]))
        .set("t.nested", Value::Array(ValueType::Array, vec![gguf::f32_array(&[1.0]), gguf::string_array(&["a", "b"])]))
        .set("general.alignment", Value::U32(64));
    w.tensor("a", GgmlType::F32, &[4, 2], vec![0; 32]);
    w.tensor("b", GgmlType::Q8_0, &[64], vec![0; 68]);
    w.tensor("c", GgmlType::Q2_K, &[256, 1, 1, 2], vec![0; 168]);
    w.to_bytes()
}

fn seeds(golden: &std::path::Path) -> Vec<Seed> {
    let mut out = Vec::new();
    if let Ok(b) = std::fs::read(golden.join("tiny-a/model.gguf")) {
        out.push(seed_from_bytes("golden tiny-a model", &b));
    }
    if let Ok(b) = std::fs::read(golden.join("tokenizer/vocab.gguf")) {
        out.push(seed_from_bytes("golden tokenizer (cut)", &cut_tokenizer(b, 600)));
    }
    let tiny = ds4::synth::build(&ds4::synth::Preset::tiny(), 4);
    out.push(seed_from_bytes("synthetic tiny model", &tiny));
    out.push(seed_from_bytes("every value type", &every_type_file()));
    out
}

/// Boundary values for a field of `width` bytes whose current value is `cur`.
fn interesting(rng: &mut Rng, cur: u64, width: usize, file_len: u64) -> u64 {
    let v = match rng.below(14) {
        0 => 0,
        1 => 1,
        2 => rng.below(16) as u64,
        3 => cur.wrapping_add(1),
        4 => cur.wrapping_sub(1),
        5 => cur.wrapping_add(rng.below(64) as u64),
        6 => cur.wrapping_mul(2),
        7 => u64::MAX,
        8 => u32::MAX as u64,
        9 => 1 << 31,
        10 => 1 << 63,
        11 => file_len.wrapping_add(rng.below(64) as u64).wrapping_sub(32),
        12 => cur ^ (1 << rng.below(width * 8)),
        _ => rng.next(),
    };
    if width == 4 {
        v & 0xffff_ffff
    } else {
        v
    }
}

/// Builds case `i`: the file bytes and a line saying what was done to which seed.
fn make_case(seeds: &[Seed], seed: u64, i: u64) -> (Vec<u8>, String) {
    let mut rng = Rng(seed ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93));
    let s = &seeds[rng.below(seeds.len())];
    let mut h = s.header.clone();
    let mut data_len = s.data_len;
    let file_len = (h.len() + data_len) as u64;
    let mut what = Vec::new();
    // Field rewrites first, while the seed's field offsets still hold.
    for _ in 0..rng.below(4) {
        let (at, width) = s.fields[rng.below(s.fields.len())];
        let cur = if width == 4 {
            u32::from_le_bytes(h[at..at + 4].try_into().unwrap()) as u64
        } else {
            u64::from_le_bytes(h[at..at + 8].try_into().unwrap())
        };
        let v = interesting(&mut rng, cur, width, file_len);
        h[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
        what.push(format!("field@{at}={v:#x}"));
    }
    for _ in 0..rng.below(3) {
        let at = rng.below(h.len());
        match rng.below(6) {
            0 | 1 => {
                h[at] ^= 1 << rng.below(8);
                what.push(format!("flip@{at}"));
            }
            2 => {
                h[at] = rng.next() as u8;
                what.push(format!("byte@{at}"));
            }
            3 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                h.splice(at..at, bytes);
                what.push(format!("insert{n}@{at}"));
            }
            4 => {
                let n = (1 + rng.below(64)).min(h.len() - at);
                h.drain(at..at + n);
                what.push(format!("delete{n}@{at}"));
            }
            _ => {
                let from = rng.below(h.len());
                let n = (1 + rng.below(32)).min(h.len() - from).min(h.len() - at);
                let chunk = h[from..from + n].to_vec();
                h[at..at + n].copy_from_slice(&chunk);
                what.push(format!("copy{n}@{from}->{at}"));
            }
        }
    }
    // Cuts: inside the header (drops the data too) or inside the data region.
    match rng.below(8) {
        0 => {
            let at = rng.below(h.len() + 1);
            h.truncate(at);
            data_len = 0;
            what.push(format!("cut-header@{at}"));
        }
        1 if data_len > 0 => {
            data_len = rng.below(data_len);
            what.push(format!("cut-data-to{data_len}"));
        }
        _ => {}
    }
    if what.is_empty() {
        what.push("unchanged".into());
    }
    // A zeroed allocation is mapped lazily: only the header pages are written.
    let mut bytes = vec![0u8; h.len() + data_len];
    bytes[..h.len()].copy_from_slice(&h);
    (bytes, format!("{}: {}", s.name, what.join(" ")))
}

#[derive(Default)]
struct Outcome {
    accepted: bool,
    model: bool,
    tokenizer: bool,
    /// The reader's error kind, e.g. `Truncated`, when it refused the file.
    refused: Option<String>,
    /// A broken promise: an accepted file whose tensors are not inside it.
    violation: Option<String>,
}

/// Runs the reader on one case, and the model binder and the tokenizer on what it accepts.
fn run_case(bytes: Vec<u8>, tokenizer_too: bool) -> Outcome {
    let len = bytes.len() as u64;
    let mut o = Outcome::default();
    let file = match File::from_bytes("case", bytes) {
        Ok(f) => f,
        Err(e) => {
            let kind = format!("{:?}", e.problem);
            o.refused = Some(kind.split(['(', ' ', '{']).next().unwrap_or("").to_string());
            return o;
        }
    };
    o.accepted = true;
    for t in file.tensors() {
        // In u128: the element count may exceed u64 where the byte count does not.
        let elems = t.dims.iter().fold(1u128, |a, &d| a.saturating_mul(d as u128));
        let expect = elems / t.ty.block_elems() as u128 * t.ty.block_bytes() as u128;
        let end = t.offset.checked_add(t.bytes);
        if t.offset < file.data_offset || end.is_none_or(|e| e > len) || t.bytes as u128 != expect {
            o.violation = Some(format!(
                "tensor '{}' at {} + {} bytes (expected {expect}) in a {len}-byte file with data at {}",
                t.name, t.offset, t.bytes, file.data_offset
            ));
            return o;
        }
        if file.tensor_data(t).len() as u64 != t.bytes {
            o.violation = Some(format!("tensor '{}' data slice has the wrong length", t.name));
            return o;
        }
    }
    if tokenizer_too {
        o.tokenizer = Tokenizer::from_gguf(&file).is_ok();
    }
    o.model = Model::from_file(file).is_ok();
    o
}

fn main() {
    let mut cases: u64 = 100_000;
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut seed: u64 = 1;
    let mut golden = PathBuf::from("tests/data/golden");
    let mut replay: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage(&format!("{a} needs a value")));
        match a.as_str() {
            "--cases" => cases = val().parse().unwrap_or_else(|_| usage("--cases takes a number")),
            "--threads" => threads = val().parse().unwrap_or_else(|_| usage("--threads takes a number")),
            "--seed" => seed = val().parse().unwrap_or_else(|_| usage("--seed takes a number")),
            "--golden" => golden = PathBuf::from(val()),
            "--replay" => replay = Some(val().parse().unwrap_or_else(|_| usage("--replay takes a case number"))),
            _ => usage(&format!("unknown argument {a}")),
        }
    }
    let seeds = seeds(&golden);
    let names: Vec<&str> = seeds.iter().map(|s| s.name.as_str()).collect();

    if let Some(i) = replay {
        let (bytes, what) = make_case(&seeds, seed, i);
        let path = format!("fuzz-{i}.gguf");
        std::fs::write(&path, &bytes).expect("write the case");
        println!("case {i} ({} bytes): {what}; written to {path}", bytes.len());
        let o = run_case(bytes, true);
        println!("accepted {} model {} refused {:?} violation {:?}", o.accepted, o.model, o.refused, o.violation);
        return;
    }

    // Panics are counted, not printed by the default hook; the first few are reported below.
    std::panic::set_hook(Box::new(|_| {}));
    let threads = threads.max(1) as u64;
    let done = AtomicU64::new(0);
    // Threads take chunks of cases from a shared counter, so slow cases do not pile up on one.
    let next = AtomicU64::new(0);
    let counts: Mutex<std::collections::BTreeMap<String, u64>> = Mutex::default();
    let failures: Mutex<Vec<String>> = Mutex::default();
    let t0 = Instant::now();
    println!("fuzzing {cases} cases on {threads} threads, seed {seed}, seed files: {}", names.join(", "));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let (seeds, done, next, counts, failures) = (&seeds, &done, &next, &counts, &failures);
            scope.spawn(move || {
                let mut local: std::collections::BTreeMap<String, u64> = Default::default();
                const CHUNK: u64 = 256;
                loop {
                    let start = next.fetch_add(CHUNK, Ordering::Relaxed);
                    if start >= cases {
                        break;
                    }
                    for i in start..(start + CHUNK).min(cases) {
                        let (bytes, what) = make_case(seeds, seed, i);
                        // The tokenizer builds a BPE model: run it on every 16th accepted case.
                        let r = catch_unwind(AssertUnwindSafe(|| run_case(bytes, i % 16 == 0)));
                        let key = match r {
                            Ok(o) => {
                                if let Some(v) = o.violation {
                                    failures.lock().unwrap().push(format!("case {i} ({what}): {v}"));
                                    "VIOLATION".to_string()
                                } else if let Some(kind) = o.refused {
                                    format!("refused: {kind}")
                                } else {
                                    *local.entry("accepted: tokenizer loads".into()).or_default() += o.tokenizer as u64;
                                    format!(
                                        "accepted: {}",
                                        if o.model { "binds as a model" } else { "refused as a model" }
                                    )
                                }
                            }
                            Err(p) => {
                                let msg = p
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| p.downcast_ref::<String>().cloned())
                                    .unwrap_or_default();
                                failures.lock().unwrap().push(format!("case {i} ({what}): PANIC {msg}"));
                                "PANIC".to_string()
                            }
                        };
                        *local.entry(key).or_default() += 1;
                        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                        if n % 100_000 == 0 {
                            eprintln!("  {n} cases, {:.0} s", t0.elapsed().as_secs_f64());
                        }
                    }
                }
                let mut c = counts.lock().unwrap();
                for (k, v) in local {
                    *c.entry(k).or_default() += v;
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    let counts = counts.into_inner().unwrap();
    let failures = failures.into_inner().unwrap();
    for (k, v) in &counts {
        println!("  {k:40} {v}");
    }
    let panics = counts.get("PANIC").copied().unwrap_or(0);
    let violations = counts.get("VIOLATION").copied().unwrap_or(0);
    println!(
        "{cases} cases in {secs:.1} s ({:.0} cases/s): {panics} panics, {violations} accepted files with a tensor outside the file",
        cases as f64 / secs
    );
    for f in failures.iter().take(10) {
        println!("  {f}");
    }
    if !failures.is_empty() {
        println!("replay one with: cargo run --release --example fuzz_gguf -- --seed {seed} --replay CASE");
        std::process::exit(1);
    }
}

fn usage(msg: &str) -> ! {
    eprintln!("fuzz_gguf: {msg}");
    eprintln!("usage: fuzz_gguf [--cases N] [--threads T] [--seed S] [--golden DIR] [--replay CASE]");
    std::process::exit(2);
}
