//! The `kiln` program: a short eager example by default, and `kiln bench` for the shared
//! side-by-side benchmark.

mod cli;

use clap::{Parser, Subcommand};
use kiln::prelude::*;

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: tensors, autograd and generated kernels")]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the shared benchmark workloads on the GPU and writes their JSON.
    Bench {
        /// Only workloads whose name contains this.
        #[arg(long)]
        only: Option<String>,
        #[arg(long, default_value = "kiln.json")]
        out: std::path::PathBuf,
    },
}

fn main() {
    let args = Args::parse();
    let r = match args.cmd {
        None => example(),
        Some(Cmd::Bench { only, out }) => cli::bench::run(only.as_deref(), &out),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// A short eager example on the GPU when there is one.
fn example() -> Result<()> {
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
