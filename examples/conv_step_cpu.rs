//! CPU: a ResNet-style training step (stem, max pool, one bottleneck per stage, batch norm in
//! training mode, SGD with momentum and weight decay) on `BATCH` images of 64x64 (8 unless set),
//! eager and compiled: the best of 5 means of 5 steps after 3 warm-ups. `KILN_CHANNELS_LAST=0`
//! turns the compiler's channels-last layout off, for comparison.
use kiln::compile::compile;
use kiln::nn::{functional as F, Module, ResNet};
use kiln::optim::{Optimizer, Sgd};
use kiln::prelude::*;
use std::sync::Arc;

/// The best mean milliseconds per call of `f` over 5 rounds of 5 calls, after 3 warm-ups.
fn best_ms(f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        for _ in 0..5 {
            f()?;
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e3 / 5.0);
    }
    Ok(best)
}

fn main() -> Result<()> {
    let d = Device::Cpu;
    manual_seed(3);
    let model = Arc::new(ResNet::bottleneck([1, 1, 1, 1], 10, &d)?);
    let n: usize = std::env::var("BATCH").ok().and_then(|b| b.parse().ok()).unwrap_or(8);
    let x = Tensor::randn(&[n, 3, 64, 64], DType::F32, &d)?;
    let y = Tensor::from_vec((0..n as i64).map(|i| i % 10).collect(), &[n], &d)?;
    let sgd = |m: &ResNet| Sgd::new(m.parameters(), 0.01).momentum(0.9).weight_decay(1e-4);
    let step_of = |m: &ResNet, opt: &mut Sgd, x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let loss = F::cross_entropy(&m.forward(x)?, y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    };
    let (m, mut opt) = (model.clone(), sgd(&model));
    let step = compile(move |x: &Tensor, y: &Tensor| step_of(&m, &mut opt, x, y));
    let compiled = best_ms(&mut || step.call(&x, &y))?;
    let mut opt = sgd(&model);
    let eager = best_ms(&mut || step_of(&model, &mut opt, &x, &y))?;
    println!("resnet-style train step, {n}x3x64x64, CPU: eager {eager:.1} ms, compiled {compiled:.1} ms");
    Ok(())
}
