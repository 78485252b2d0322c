//! Record a DS4 decode token once, then replay the same program for many positions with only
//! `StepParams` changing. Runs on the deterministic tiny synthetic model (no files needed):
//!
//!     cargo run --release --example record_replay

use std::sync::Arc;

use ds4::backend::Backend;
use ds4::backends::cpu::CpuBackend;
use ds4::decode::{self, Caps};
use ds4::gguf::File;
use ds4::model::Model;
use ds4::recorder::{Cond, StepParams};
use ds4::sample::argmax;
use ds4::synth::{self, Preset};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::from_file(File::from_bytes("tiny", synth::build(&Preset::tiny(), 4))?)?;

    // Record once: one program for every position up to the context capacity.
    let program = Arc::new(decode::record_token(&model, Caps { ctx: 64 })?);
    let (ops, predicated) = program.op_counts();
    println!("recorded {ops} ops once ({predicated} predicated), {} buffers", program.buffers().len());

    // Compile once.
    let backend = CpuBackend::new(0)?;
    let mut exe = backend.compile(program.clone(), model.clone())?;

    // Replay: each step only writes new StepParams. The predicates decide per position which
    // ops run (compressor emits every 4th / 8th token, the indexer once there are > 4 rows).
    let mut token = 0u32;
    let mut logits = Vec::new();
    for pos in 0..24u32 {
        let params = StepParams::new(token, pos);
        exe.step(&params)?;
        exe.read_logits(&mut logits)?;
        let ran = program.active_steps(&params).count();
        let emits: Vec<String> =
            [4, 8].iter().filter(|&&ratio| Cond::Emit { ratio }.eval(&params)).map(|r| format!("emit/{r}")).collect();
        let indexer = Cond::IndexerActive { ratio: 4, top_k: 4 }.eval(&params);
        let next = argmax(&logits);
        println!(
            "pos {pos:2} token {token:3} -> {next:3}   ran {ran:3} of {ops} ops  {}{}",
            emits.join(" "),
            if indexer { " indexer" } else { "" }
        );
        token = next;
    }
    assert!(Arc::ptr_eq(exe.program(), &program), "the executable still runs the program recorded first");
    println!("same program (fingerprint {:016x}) for all 24 positions", program.fingerprint());
    Ok(())
}
