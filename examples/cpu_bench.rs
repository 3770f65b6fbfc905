//! CPU throughput of eager kernels: elementwise GB/s and matmul GFLOP/s.
//!
//!     cargo run --release --example cpu_bench
//!
//! Each row is the median of 15 timed calls after 3 warm-up calls. GB/s counts bytes read plus
//! bytes written by the op itself.

use kiln::prelude::*;
use std::time::Instant;

fn median_secs(mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut times: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            let r = f();
            let dt = t.elapsed().as_secs_f64();
            r.map(|_| dt)
        })
        .collect::<Result<_>>()?;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    manual_seed(0);
    println!("threads: {}", rayon::current_num_threads());
    println!("{:<34} {:>10} {:>12}", "workload", "ms", "throughput");
    for n in [1_000_000usize, 10_000_000] {
        let a = Tensor::randn(&[n], DType::F32, &dev)?;
        let b = Tensor::randn(&[n], DType::F32, &dev)?;
        type Row<'a> = (&'a str, usize, Box<dyn Fn() -> Result<Tensor> + 'a>);
        let rows: [Row; 4] = [
            ("add.f32", 3, Box::new(|| a.add(&b))),
            ("mul_scalar.f32", 2, Box::new(|| a.mul_scalar(2.0))),
            ("exp.f32", 2, Box::new(|| a.exp())),
            ("sum_all.f32", 1, Box::new(|| a.sum_all())),
        ];
        for (name, arrays, f) in rows {
            let s = median_secs(f)?;
            let gbps = (arrays * n * 4) as f64 / s / 1e9;
            println!("{:<34} {:>10.3} {:>8.2} GB/s", format!("{name}.{n:.0e}"), s * 1e3, gbps);
        }
    }
    for n in [1024usize, 2048] {
        for dtype in [DType::F32, DType::F64] {
            let a = Tensor::randn(&[n, n], dtype, &dev)?;
            let b = Tensor::randn(&[n, n], dtype, &dev)?;
            let s = median_secs(|| a.matmul(&b))?;
            let gflops = 2.0 * (n as f64).powi(3) / s / 1e9;
            println!("{:<34} {:>10.3} {:>6.1} GFLOP/s", format!("matmul.{dtype:?}.{n}x{n}"), s * 1e3, gflops);
        }
    }
    Ok(())
}
