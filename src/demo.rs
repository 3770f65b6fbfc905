//! The demo the `kiln` program runs by default: the 784-256-10 MLP trained eagerly on the
//! built-in synthetic data, with a progress bar, then evaluated; then one training step under
//! the profiler, with its kernels per step and step time; then the same training compiled.
//! `lm` holds the language-model demo (`kiln demo lm`).

pub mod lm;

use crate::data::{DataLoader, Dataset, SyntheticClassification};
use crate::nn::{self, functional as F, Module};
use crate::optim::{Optimizer, Sgd};
use crate::profiler::{self, Profile, SortBy};
use crate::{manual_seed, no_grad, DType, Device, Result, Tensor};
use std::io::Write;
use std::time::Instant;

/// What a demo run measured.
#[derive(Clone, Debug)]
pub struct DemoReport {
    pub steps: usize,
    pub first_loss: f32,
    pub last_loss: f32,
    /// On a held-out set of the same task.
    pub accuracy: f32,
    /// Wall time per training step, data loading included.
    pub step_ms: f64,
    /// Kernels of one training step, as the profiler counts them (on the CPU: ops that ran a
    /// CPU kernel).
    pub kernels_per_step: usize,
    /// One training step under the profiler.
    pub profile: Profile,
    /// The same training as one compiled call per step (`kiln::compile`): its last loss, step
    /// time, kernels per step and profiled step.
    pub compiled_last_loss: f32,
    pub compiled_step_ms: f64,
    pub compiled_kernels_per_step: usize,
    pub compiled_profile: Profile,
}

/// Runs `steps` training steps of `step` over `loader` (copying batches to `device`): (first
/// loss, last loss, seconds, the last batch).
type Batch = (Tensor, Tensor);
fn train(loader: &DataLoader<SyntheticClassification>, steps: usize, device: &Device, progress: bool, step: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>) -> Result<(f32, f32, f64, Batch)> {
    let bar = if progress { indicatif::ProgressBar::new(steps as u64) } else { indicatif::ProgressBar::hidden() };
    let (mut first, mut last) = (None, 0.0f32);
    let mut last_batch = None;
    let start = Instant::now();
    for (i, batch) in loader.iter().enumerate().take(steps) {
        let (x, y) = batch?;
        let (x, y) = (x.to_device_async(device)?, y.to_device_async(device)?);
        let loss = step(&x, &y)?;
        last_batch = Some((x, y));
        // Reading the loss synchronises: only every 50 steps and at the end.
        if i == 0 || (i + 1) % 50 == 0 || i + 1 == steps {
            last = loss.item::<f32>()?;
            first.get_or_insert(last);
            bar.set_message(format!("loss {last:.4}"));
        }
        bar.inc(1);
    }
    crate::cuda::synchronize(device)?;
    let elapsed = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let batch = last_batch.ok_or_else(|| crate::Error::arg("demo", "needs at least one training step"))?;
    Ok((first.unwrap_or(f32::NAN), last, elapsed, batch))
}

/// The demo's 784-256-10 MLP, seeded (`kiln doctor` checks its training step).
pub fn mlp_for_doctor(device: &Device) -> Result<nn::Sequential> {
    mlp(device)
}

fn mlp(device: &Device) -> Result<nn::Sequential> {
    manual_seed(0);
    Ok(nn::Sequential::new().add(nn::Linear::new(784, 256, device)?).add(nn::ReLU).add(nn::Linear::new(256, 10, device)?))
}

/// Trains for `steps` steps of batch 32 on `device` and writes what it does to `out`.
pub fn run(steps: usize, device: &Device, progress: bool, out: &mut dyn Write) -> Result<DemoReport> {
    let io = |e: std::io::Error| crate::Error::Io { op: "demo", msg: e.to_string() };
    manual_seed(0);
    let train_set = DataLoader::new(SyntheticClassification::mnist_like(steps.max(1) * 32, 0)?, 32)?.shuffle(0).workers(2).drop_last(true);
    if steps == 0 {
        return Err(crate::Error::arg("demo", "needs at least one training step"));
    }
    let model = mlp(device)?;
    let mut opt = Sgd::new(model.parameters(), 0.1);
    writeln!(out, "kiln {}: training the 784-256-10 MLP on {device} (synthetic data, batch 32, SGD lr 0.1)", env!("CARGO_PKG_VERSION")).map_err(io)?;
    let mut step = |x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let loss = F::cross_entropy(&model.forward(x)?, y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    };
    let (first, last, elapsed, (bx, by)) = train(&train_set, steps, device, progress, &mut step)?;
    let prof = profiler::profile(|| step(&bx, &by))?;
    let test = SyntheticClassification::mnist_like(1024, 1)?;
    let samples: Vec<(Tensor, Tensor)> = (0..test.len()).map(|i| test.get(i)).collect::<Result<_>>()?;
    let xs: Vec<&Tensor> = samples.iter().map(|s| &s.0).collect();
    let ys: Vec<&Tensor> = samples.iter().map(|s| &s.1).collect();
    let (x, y) = (crate::stack(&xs, 0)?.to_device(device)?, crate::stack(&ys, 0)?.to_device(device)?);
    let accuracy = no_grad(|| model.forward(&x)?.argmax(1, false)?.eq(&y)?.to_dtype(DType::F32)?.mean_all()?.item::<f32>())?;
    writeln!(out, "loss {first:.4} -> {last:.4} over {steps} steps; held-out accuracy {:.1}%", 100.0 * accuracy).map_err(io)?;
    let step_ms = elapsed * 1e3 / steps as f64;
    report_step("eager", step_ms, &prof, out).map_err(io)?;

    // The same training, each step one compiled call: traced once, then replayed.
    let cmodel = mlp(device)?;
    let mut copt = Sgd::new(cmodel.parameters(), 0.1);
    let cstep = crate::compile::compile(move |x: &Tensor, y: &Tensor| {
        let loss = F::cross_entropy(&cmodel.forward(x)?, y)?;
        loss.backward()?;
        copt.step()?;
        copt.zero_grad();
        Ok(loss)
    });
    writeln!(out, "\nthe same training compiled (kiln::compile): one call per step").map_err(io)?;
    let (_, clast, celapsed, (cx, cy)) = train(&train_set, steps, device, progress, &mut |x, y| cstep.call(x, y))?;
    let cprof = profiler::profile(|| cstep.call(&cx, &cy))?;
    let compiled_step_ms = celapsed * 1e3 / steps as f64;
    writeln!(out, "compiled: loss {clast:.4} after {steps} steps (eager {last:.4})").map_err(io)?;
    report_step("compiled", compiled_step_ms, &cprof, out).map_err(io)?;
    Ok(DemoReport {
        steps,
        first_loss: first,
        last_loss: last,
        accuracy,
        step_ms,
        kernels_per_step: prof.kernel_count(),
        profile: prof,
        compiled_last_loss: clast,
        compiled_step_ms,
        compiled_kernels_per_step: cprof.kernel_count(),
        compiled_profile: cprof,
    })
}

/// A training variant's step time, kernels per step, and its profiled step as a table.
fn report_step(variant: &str, step_ms: f64, prof: &Profile, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "{variant} step: {step_ms:.3} ms, {} kernels per step", prof.kernel_count())?;
    writeln!(out, "\none {variant} training step under the profiler (kiln::profiler):")?;
    writeln!(out, "{}", prof.key_averages().table(SortBy::DeviceTimeTotal, 12))
}
