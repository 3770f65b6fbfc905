//! The MLP training step (784-256-10, batch 32, SGD) on the CPU, `N` eager calls then `N`
//! compiled ones, for a profiler: `cargo run --release --example mlp_step_cpu -- 2000`.
use kiln::compile::compile;
use kiln::nn::functional as F;
use kiln::prelude::*;

fn main() -> Result<()> {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let mode = std::env::args().nth(2).unwrap_or_else(|| "both".into());
    let dev = Device::Cpu;
    manual_seed(0);
    let model = nn::Sequential::new().add(nn::Linear::new(784, 256, &dev)?).add(nn::ReLU).add(nn::Linear::new(256, 10, &dev)?);
    let (x, y) = (Tensor::randn(&[32, 784], DType::F32, &dev)?, Tensor::randint(0, 10, &[32], &dev)?);
    let mut opt = optim::Sgd::new(model.parameters(), 0.01);
    let mut step = move |x: &Tensor, y: &Tensor| {
        let loss = F::cross_entropy(&model.forward(x)?, y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    };
    if mode != "compiled" {
        let t = std::time::Instant::now();
        for _ in 0..n {
            step(&x, &y)?;
        }
        println!("eager {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    }
    if mode != "eager" {
        let f = compile(step);
        let t = std::time::Instant::now();
        for _ in 0..n {
            f.call(&x, &y)?;
        }
        println!("compiled {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    }
    Ok(())
}
