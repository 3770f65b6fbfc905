//! `kiln doctor`: the checklist of `kiln::doctor` on the demo's MLP training step (batch 32,
//! SGD), eager or compiled, as a table or JSON, with the Chrome trace of the checked steps.

use kiln::compile::{compile_with, CompileOptions, Mode};
use kiln::nn::functional as F;
use kiln::prelude::*;

pub fn run(compiled: Option<&str>, json: bool, trace: Option<&std::path::Path>) -> Result<()> {
    let dev = Device::cuda_if_available(0);
    let model = kiln::demo::mlp_for_doctor(&dev)?;
    let mut opt = optim::Sgd::new(model.parameters(), 0.1);
    let x = Tensor::randn(&[32, 784], DType::F32, &dev)?;
    let y = Tensor::randint(0, 10, &[32], &dev)?;
    let mut step = move |x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let loss = F::cross_entropy(&model.forward(x)?, y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    };
    let report = match compiled {
        None => kiln::doctor::check(|| step(&x, &y).map(drop))?,
        Some(mode) => {
            let mode = match mode {
                "default" => Mode::Default,
                "reduce-overhead" => Mode::ReduceOverhead,
                "max-autotune" => Mode::MaxAutotune,
                m => return Err(kiln::Error::Arg { op: "doctor", msg: format!("--compiled {m}: expected default, reduce-overhead or max-autotune") }),
            };
            let f = compile_with(CompileOptions::new().mode(mode), step);
            kiln::doctor::check(|| f.call(&x, &y).map(drop))?
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report.to_json()).expect("json"));
    } else {
        print!("{}", report.table());
    }
    if let Some(path) = trace {
        report.profile.export_chrome_trace(path)?;
    }
    Ok(())
}
