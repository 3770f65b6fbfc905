//! The `kiln` program. For now it runs a short eager example; the demo, `bench` and `profile`
//! subcommands come with the data, profiler and CUDA parts.

use kiln::prelude::*;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let dev = Device::cuda_if_available(0);
    println!("kiln {} on {dev}", env!("CARGO_PKG_VERSION"));
    manual_seed(0);
    let x = Tensor::randn(&[4, 3], DType::F32, &dev)?;
    let w = Tensor::randn(&[3, 2], DType::F32, &dev)?.requires_grad();
    let y = x.matmul(&w)?.relu()?;
    println!("x = {x}\nrelu(x @ w) = {y}");
    let loss = y.sum_all()?;
    loss.backward()?;
    println!("d loss / d w = {}", w.grad().expect("w requires grad"));
    Ok(())
}
