//! Record one DS4 decode token program, compile it on every backend this build and machine
//! offer (the CPU in the canonical profile, wgpu, CUDA), replay it on each for the same tokens and
//! compare the logits bit for bit with the CPU's. A backend that is missing is reported, not hidden:
//!
//!     cargo run --release --example cross_backend

use std::sync::Arc;

use ds4::backend::{self, BackendKind, BackendOptions, Executable};
use ds4::decode::{self, Caps};
use ds4::gguf::File;
use ds4::model::Model;
use ds4::numerics::Numerics;
use ds4::recorder::StepParams;
use ds4::sample::argmax;
use ds4::synth::{self, Preset};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::from_file(File::from_bytes("tiny", synth::build(&Preset::tiny(), 4))?)?;
    // Recorded once; every backend compiles the very same program.
    let program = Arc::new(decode::record_token(&model, Caps { ctx: 64 })?);
    let opts = BackendOptions { threads: 0, graphs: true, numerics: Numerics::Canonical, ..Default::default() };
    let mut exes: Vec<(BackendKind, Box<dyn Executable>)> = Vec::new();
    for kind in [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda] {
        match backend::create(kind, opts) {
            Ok(b) => {
                println!("{kind}: {}", b.describe().unwrap_or_else(|| "ready".into()));
                exes.push((kind, b.compile(program.clone(), model.clone())?));
            }
            Err(e) => println!("{kind}: not compared ({e})"),
        }
    }
    let mut token = 0u32;
    let mut logits = vec![Vec::new(); exes.len()];
    for pos in 0..24u32 {
        for ((_, exe), l) in exes.iter_mut().zip(logits.iter_mut()) {
            exe.step(&StepParams::new(token, pos))?;
            exe.read_logits(l)?;
        }
        for ((kind, _), l) in exes.iter().zip(&logits).skip(1) {
            let differ = l.iter().zip(&logits[0]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            if differ > 0 {
                return Err(format!("pos {pos}: {kind} differs from the CPU in {differ} logits").into());
            }
        }
        token = argmax(&logits[0]);
    }
    let names: Vec<String> = exes.iter().map(|(k, _)| k.to_string()).collect();
    println!(
        "one program (fingerprint {:016x}), 24 tokens: {} agree bit for bit",
        program.fingerprint(),
        names.join(", ")
    );
    Ok(())
}
