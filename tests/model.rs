//! Model config and tensor binding: any size of the architecture, per-layer expert types, and a
//! clear error for each kind of mismatch. Also `ds4 inspect` and `ds4 synth` end to end.

mod common;

use std::path::PathBuf;
use std::process::Command;

use ds4::gguf::{File, Value, Writer};
use ds4::model::{AttentionKind, Model};
use ds4::quant::GgmlType;
use ds4::synth::{self, Preset};

fn tiny_a() -> PathBuf {
    common::golden("tiny-a/model.gguf")
}

fn ds4() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ds4"))
}

/// Copies a GGUF through the writer, letting `edit` change or drop metadata and tensors.
fn rewrite(
    f: &File,
    mut meta: impl FnMut(&str, &Value) -> Option<Value>,
    mut tensor: impl FnMut(&str, GgmlType, &[u64], &[u8]) -> Option<(GgmlType, Vec<u64>, Vec<u8>)>,
) -> File {
    let mut w = Writer::new();
    for (k, v) in f.metadata() {
        if let Some(v) = meta(k, v) {
            w.set(k.clone(), v);
        }
    }
    for t in f.tensors() {
        if let Some((ty, dims, data)) = tensor(&t.name, t.ty, &t.dims, f.tensor_data(t)) {
            w.tensor(t.name.clone(), ty, &dims, data);
        }
    }
    File::from_bytes("edited.gguf", w.to_bytes()).expect("rewritten file parses")
}

fn keep_meta(_: &str, v: &Value) -> Option<Value> {
    Some(v.clone())
}

fn keep_tensor(_: &str, ty: GgmlType, dims: &[u64], d: &[u8]) -> Option<(GgmlType, Vec<u64>, Vec<u8>)> {
    Some((ty, dims.to_vec(), d.to_vec()))
}

fn model_error(f: File) -> String {
    Model::from_file(f).expect_err("must not load").to_string()
}

#[test]
fn tiny_a_config_is_read_from_metadata() {
    let m = Model::open(tiny_a()).unwrap();
    let c = &m.config;
    assert_eq!((c.n_layer, c.n_embd, c.n_vocab, c.n_head, c.head_dim, c.n_rot), (6, 256, 512, 8, 256, 64));
    assert_eq!((c.q_lora_rank, c.o_lora_rank, c.n_out_group), (128, 64, 8));
    assert_eq!((c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_hash_layer), (8, 2, 256, 3));
    assert_eq!((c.n_swa, c.n_indexer_head, c.indexer_head_dim, c.indexer_top_k), (16, 16, 128, 4));
    assert_eq!(c.compress_ratios, vec![0, 0, 4, 8, 4, 8]);
    assert_eq!(c.swiglu_clamp, vec![10.0; 6]);
    let kinds: Vec<AttentionKind> = (0..6).map(|il| c.attention_kind(il)).collect();
    use AttentionKind::*;
    assert_eq!(kinds, vec![Window, Window, Ratio4Indexed, Ratio(8), Ratio4Indexed, Ratio(8)]);
    // ds4's RoPE: dense layers plain, compressed layers YaRN with the cancelling factor.
    assert_eq!(c.rope(0).freq_base, 10000.0);
    assert_eq!(c.rope(2).freq_base, 160000.0);
    assert!((c.rope(2).attn_factor - 0.782927).abs() < 1e-6);
    assert!(m.weights.layers[2].indexer.is_some() && m.weights.layers[3].indexer.is_none());
    assert!(m.weights.layers[0].tid2eid.is_some() && m.weights.layers[3].tid2eid.is_none());
}

#[test]
fn the_real_flash_shape_is_read_from_metadata() {
    let f = File::from_bytes("flash-meta.gguf", synth::metadata(&Preset::flash()).to_bytes()).unwrap();
    let c = ds4::model::Config::from_gguf(&f).unwrap();
    assert_eq!((c.n_layer, c.n_embd, c.n_vocab, c.n_expert, c.n_expert_used), (43, 4096, 129280, 256, 6));
    assert_eq!((c.n_head, c.head_dim, c.indexer_top_k), (64, 512, 512));
    assert_eq!(c.compress_ratios.iter().filter(|&&r| r == 4).count(), 21);
    assert_eq!(c.compress_ratios.iter().filter(|&&r| r == 128).count(), 20);
    assert_eq!(c.out_group_dim(), 4096);
    // No tensors: binding names the first missing one.
    let e = model_error(f);
    assert!(e.contains("flash-meta.gguf") && e.contains("missing tensor 'token_embd.weight'"), "{e}");
}

#[test]
fn each_metadata_problem_is_named() {
    let f = File::open(tiny_a()).unwrap();
    type Edit = Box<dyn Fn(&str, &Value) -> Option<Value>>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "missing metadata key 'deepseek4.attention.sliding_window'",
            Box::new(|k, v| (k != "deepseek4.attention.sliding_window").then(|| v.clone())),
        ),
        (
            "hyper_connection.count is 3",
            Box::new(|k, v| Some(if k == "deepseek4.hyper_connection.count" { Value::U32(3) } else { v.clone() })),
        ),
        (
            "must be a multiple of 64",
            Box::new(|k, v| Some(if k == "deepseek4.rope.dimension_count" { Value::U32(32) } else { v.clone() })),
        ),
        (
            "compress_ratios has 6 entries, need one per layer (7)",
            Box::new(|k, v| Some(if k == "deepseek4.block_count" { Value::U32(7) } else { v.clone() })),
        ),
        (
            "must divide into attention.output_group_count",
            Box::new(|k, v| {
                Some(if k == "deepseek4.attention.output_group_count" { Value::U32(3) } else { v.clone() })
            }),
        ),
        (
            "architecture 'llama' is not deepseek4",
            Box::new(|k, v| Some(if k == "general.architecture" { Value::String("llama".into()) } else { v.clone() })),
        ),
        (
            "must be a non-negative integer",
            Box::new(|k, v| Some(if k == "deepseek4.expert_count" { Value::F32(8.0) } else { v.clone() })),
        ),
    ];
    for (want, edit) in cases {
        let e = model_error(rewrite(&f, |k, v| edit(k, v), keep_tensor));
        assert!(e.starts_with("edited.gguf: ") && e.contains(want), "want '{want}', got: {e}");
    }
}

#[test]
fn each_tensor_problem_is_named() {
    let f = File::open(tiny_a()).unwrap();
    type Edit = Box<dyn Fn(&str, GgmlType, &[u64], &[u8]) -> Option<(GgmlType, Vec<u64>, Vec<u8>)>>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "missing tensor 'blk.2.attn_kv.weight'",
            Box::new(|n, ty, d, b| (n != "blk.2.attn_kv.weight").then(|| (ty, d.to_vec(), b.to_vec()))),
        ),
        (
            "tensor 'blk.1.attn_q_a.weight' has type F16, expected Q8_0",
            Box::new(|n, ty, d, b| {
                Some(if n == "blk.1.attn_q_a.weight" {
                    (GgmlType::F16, d.to_vec(), vec![0; 2 * 256 * 128])
                } else {
                    (ty, d.to_vec(), b.to_vec())
                })
            }),
        ),
        (
            "tensor 'blk.0.attn_sinks.weight' has shape [7], expected [8]",
            Box::new(|n, ty, d, b| {
                Some(if n == "blk.0.attn_sinks.weight" {
                    (ty, vec![7], b[..28].to_vec())
                } else {
                    (ty, d.to_vec(), b.to_vec())
                })
            }),
        ),
        (
            "layer 4: routed gate (IQ2_XXS) and up (Q2_K) experts must share a quant type",
            Box::new(|n, ty, d, b| {
                Some(if n == "blk.4.ffn_up_exps.weight" {
                    (GgmlType::Q2_K, d.to_vec(), vec![0; 84 * 256 * 8])
                } else {
                    (ty, d.to_vec(), b.to_vec())
                })
            }),
        ),
        (
            "tensor 'blk.3.ffn_down_exps.weight' has type Q8_0",
            Box::new(|n, ty, d, b| {
                Some(if n == "blk.3.ffn_down_exps.weight" {
                    (GgmlType::Q8_0, d.to_vec(), vec![0; 34 * 8 * 256 * 8])
                } else {
                    (ty, d.to_vec(), b.to_vec())
                })
            }),
        ),
        (
            "holds expert id 9, outside 0..8",
            Box::new(|n, ty, d, b| {
                let mut b = b.to_vec();
                if n == "blk.1.ffn_gate_tid2eid.weight" {
                    b[40..44].copy_from_slice(&9i32.to_le_bytes());
                }
                Some((ty, d.to_vec(), b))
            }),
        ),
    ];
    for (want, edit) in cases {
        let e = model_error(rewrite(&f, keep_meta, |n, ty, d, b| edit(n, ty, d, b)));
        assert!(e.starts_with("edited.gguf: ") && e.contains(want), "want '{want}', got: {e}");
    }
}

#[test]
fn expert_types_can_differ_per_layer() {
    // Layer 4 switches to Q4_K gate/up/down (as ds4's mixed files do); the rest stay IQ2_XXS/Q2_K.
    let f = File::open(tiny_a()).unwrap();
    let edited = rewrite(&f, keep_meta, |n, ty, d, b| {
        if n.starts_with("blk.4.ffn_") && n.ends_with("_exps.weight") {
            let blocks = d.iter().product::<u64>() as usize / 256;
            let mut data = vec![0u8; blocks * 144];
            for (i, blk) in data.chunks_exact_mut(144).enumerate() {
                blk[..2].copy_from_slice(&0x1c00u16.to_le_bytes()); // d = 2^-8
                blk[2..4].copy_from_slice(&0x1800u16.to_le_bytes()); // dmin = 2^-9
                for (j, v) in blk[4..].iter_mut().enumerate() {
                    *v = (i * 31 + j * 17) as u8;
                }
            }
            return Some((GgmlType::Q4_K, d.to_vec(), data));
        }
        Some((ty, d.to_vec(), b.to_vec()))
    });
    let m = Model::from_file(edited).unwrap();
    let types: Vec<GgmlType> = m.weights.layers.iter().map(|l| l.ffn_down_exps.ty).collect();
    assert_eq!(types[4], GgmlType::Q4_K);
    assert_eq!(types[3], GgmlType::Q2_K);
    let backend = ds4::backends::cpu::CpuBackend::new(0).unwrap();
    let mut s = ds4::session::Session::new(m, &backend, 64).unwrap();
    for t in [0u32, 5, 9, 200] {
        let logits = s.eval(t).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()), "Q4_K layer gives finite logits");
    }
}

#[test]
fn inspect_reports_tiny_a() {
    let out = ds4().args(["inspect", "-m"]).arg(tiny_a()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    println!("{text}");
    for want in [
        "layers        6",
        "vocab         512",
        "ratios        0,0,4,8,4,8",
        "layer  0    sliding window only",
        "layer  2    ratio 4 with indexer",
        "layer  3    ratio 8 ",
        "experts IQ2_XXS/IQ2_XXS/Q2_K",
        "tokenizer     512 tokens",
    ] {
        assert!(text.contains(want), "inspect output lacks '{want}'");
    }
    // Total weight bytes: the sum over the file's tensors, computed independently here.
    let f = File::open(tiny_a()).unwrap();
    let total: u64 = f.tensors().iter().map(|t| t.bytes).sum();
    assert!(text.contains(&format!("weights       {:.2} MB", total as f64 / 1e6)), "total bytes {total}");
}

#[test]
fn synth_presets_load_and_tiny_has_tiny_a_shape() {
    let dir = std::env::temp_dir().join(format!("ds4-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let st = ds4().args(["synth", "--preset", "tiny", "--out"]).arg(&path).status().unwrap();
    assert!(st.success());
    let out = ds4().args(["inspect", "-m"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let tiny = Model::open(&path).unwrap();
    let golden = Model::open(tiny_a()).unwrap();
    let mut a = tiny.config.clone();
    a.name = golden.config.name.clone();
    a.context_length = golden.config.context_length;
    assert_eq!(a, golden.config, "the tiny preset has tiny-a's shape");
    assert_eq!(std::fs::read(&path).unwrap(), synth::build(&Preset::tiny(), 4), "synth is deterministic");

    let small_bytes = synth::build(&Preset::small(), 1);
    let mut streamed = Vec::new();
    let len = synth::write(&Preset::small(), 1, &mut streamed).unwrap();
    assert_eq!(len, streamed.len() as u64);
    assert!(streamed == small_bytes, "synth::write streams the bytes synth::build makes");
    let small = Model::from_file(File::from_bytes("small", small_bytes).unwrap()).unwrap();
    assert!(small.config.n_embd >= 1024 && small.config.n_expert >= 16 && small.config.n_layer >= 3);
    std::fs::remove_dir_all(&dir).ok();
}

/// A device-only preset has the same tensor table as the host-built image, and a recipe for every
/// tensor; a backend that needs host bytes refuses it with a message that says where it runs.
#[test]
fn device_only_presets_describe_the_same_tensors_as_the_host_build() {
    for preset in [Preset::tiny(), Preset::small()] {
        let host = File::from_bytes("host", synth::build(&preset, 4)).unwrap();
        let model = synth::device_model(&preset, 4).unwrap();
        assert!(!model.file.has_data() && host.has_data());
        assert_eq!(model.file.tensors(), host.tensors(), "{}", preset.name);
        let syn = model.synthetic.as_ref().unwrap();
        for t in host.tensors() {
            let fill = syn.fills.get(&t.name).unwrap_or_else(|| panic!("no recipe for {}", t.name));
            let spec = synth::Spec { name: t.name.clone(), ty: t.ty, dims: t.dims.clone(), fill: *fill };
            assert_eq!(synth::tensor_data(&spec, 4), host.tensor_data(t), "{}", t.name);
        }
        let cpu = ds4::backends::cpu::CpuBackend::new(1).unwrap();
        let e = ds4::session::Session::new(model, &cpu, 16).err().unwrap().to_string();
        assert!(e.contains("no weights in host memory") && e.contains("--backend cuda"), "{e}");
    }
}
