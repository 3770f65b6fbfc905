//! CPU eager softmax and layer norm over 2048 x 2048, for a profiler: `N` calls of each.
//!
//!     cargo run --release --example row_ops_cpu -- 50
use kiln::nn::functional as F;
use kiln::prelude::*;

fn main() -> Result<()> {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(50);
    let x = Tensor::randn(&[2048, 2048], DType::F32, &Device::Cpu)?;
    let (w, b) = (Tensor::randn(&[2048], DType::F32, &Device::Cpu)?, Tensor::randn(&[2048], DType::F32, &Device::Cpu)?);
    let t = std::time::Instant::now();
    for _ in 0..n {
        x.softmax(-1)?;
    }
    println!("softmax {:.2} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    let t = std::time::Instant::now();
    for _ in 0..n {
        F::layer_norm(&x, &[2048], Some(&w), Some(&b), 1e-5)?;
    }
    println!("layer_norm {:.2} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    Ok(())
}
