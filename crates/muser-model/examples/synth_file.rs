//! Writes a synthetic model with `muser_model::synth` exactly as the parity tests regenerate it:
//! `cargo run --release -p muser-model --example synth_file -- PRESET TYPE SEED OUT.gguf`.

use muser_model::synth::{presets, Plan, WeightType};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        return Err("usage: synth_file PRESET TYPE SEED OUT.gguf".into());
    }
    let plan = Plan::new(
        presets::preset(&a[1])?,
        WeightType::from_name(&a[2])?,
        a[3].parse()?,
        None,
    );
    plan.write_file(a[4].as_ref(), &mut |_| {})?;
    Ok(())
}
