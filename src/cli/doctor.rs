//! `kiln doctor [WORKLOAD]`: the checklist of `kiln::doctor` on a bench workload's call, eager or
//! compiled, or by default on the demo's MLP training step (batch 32, SGD); as a table or JSON,
//! with the Chrome trace of the checked steps and their idle gaps.

use super::bench::{self, WORKLOADS};
use kiln::compile::{compile_with, CompileOptions, Mode};
use kiln::nn::functional as F;
use kiln::prelude::*;
use kiln::Error;

pub fn run(workload: Option<&str>, compiled: Option<&str>, json: bool, trace: Option<&std::path::Path>) -> Result<()> {
    let mode = compiled.map(parse_mode).transpose()?;
    let dev = Device::cuda_if_available(0);
    // One thread works on the GPU here, so CUPTI may be detached after the check.
    kiln::profiler::set_cupti_detach(true);
    let report = match workload {
        None | Some("demo") => demo(&dev, mode)?,
        Some(name) => workload_report(name, &dev, mode)?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report.to_json()).expect("json"));
    } else {
        print!("{}", report.table());
    }
    if let Some(path) = trace {
        report.export_chrome_trace(path)?;
    }
    Ok(())
}

fn parse_mode(mode: &str) -> Result<Mode> {
    match mode {
        "default" => Ok(Mode::Default),
        "reduce-overhead" => Ok(Mode::ReduceOverhead),
        "max-autotune" => Ok(Mode::MaxAutotune),
        m => Err(Error::Arg { op: "doctor", msg: format!("--compiled {m}: expected default, reduce-overhead or max-autotune") }),
    }
}

/// The demo's MLP training step, written out as a user writes one.
fn demo(dev: &Device, mode: Option<Mode>) -> Result<kiln::doctor::Report> {
    let model = kiln::demo::mlp_for_doctor(dev)?;
    let mut opt = optim::Sgd::new(model.parameters(), 0.1);
    let x = Tensor::randn(&[32, 784], DType::F32, dev)?;
    let y = Tensor::randint(0, 10, &[32], dev)?;
    let mut step = move |x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let loss = F::cross_entropy(&model.forward(x)?, y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    };
    match mode {
        None => kiln::doctor::check(|| step(&x, &y).map(drop)),
        Some(mode) => {
            let f = compile_with(CompileOptions::new().mode(mode), step);
            kiln::doctor::check(|| f.call(&x, &y).map(drop))
        }
    }
}

/// A bench workload's call as `kiln bench` measures it: eager, or the compiled variant of `mode`.
fn workload_report(name: &str, dev: &Device, mode: Option<Mode>) -> Result<kiln::doctor::Report> {
    if !WORKLOADS.contains(&name) {
        return Err(Error::Arg { op: "doctor", msg: format!("unknown workload '{name}'; demo or one of: {}", WORKLOADS.join(", ")) });
    }
    manual_seed(0);
    let Some(mut w) = bench::setup(name, dev)? else {
        return Err(Error::Arg { op: "doctor", msg: format!("{name} {}", bench::NOT_YET) });
    };
    let call: &mut bench::Call = match (mode, &mut w.compiled, &mut w.measure) {
        (None, ..) => &mut w.call,
        (Some(Mode::Default), Some(c), _) => c,
        (Some(m), _, bench::Measure::Step(v)) => {
            let variant = bench::variant_name(m);
            match v.iter_mut().find(|(n, _)| *n == variant) {
                Some((_, c)) => c,
                None => return Err(Error::Arg { op: "doctor", msg: format!("{name} has no {variant} variant in the bench") }),
            }
        }
        (Some(_), ..) => return Err(Error::Arg { op: "doctor", msg: format!("{name} has no compiled form in that mode in the bench") }),
    };
    kiln::doctor::check(|| call().map(drop))
}
