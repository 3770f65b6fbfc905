//! CPU: eager against compiled for the bench's pointwise and reduction workloads, median of 15
//! calls after 3 warm-ups (smaller sizes than the GPU bench's).
//!
//! `--tiny`: the same functions on inputs of 8 elements (rows of 8), median of 2001 calls in
//! µs: the framework's own work per call, which on a GPU an idle device waits for.
//! `--tiny --loop N`: only N calls of the compiled `(a + b).relu()`, for a profiler.
use kiln::compile::compile;
use kiln::nn::functional as F;
use kiln::prelude::*;
use std::time::Instant;

/// Median seconds of `calls` calls of `f` after `warm` warm-ups.
fn median_s(warm: usize, calls: usize, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    let mut t: Vec<f64> = (0..calls)
        .map(|_| {
            let s = Instant::now();
            f().map(|_| s.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[calls / 2])
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let tiny = args.iter().any(|a| a == "--tiny");
    let calls_only = args.iter().position(|a| a == "--loop").and_then(|i| args.get(i + 1)?.parse::<usize>().ok());
    let d = Device::Cpu;
    let (n, k) = if tiny { (8, 8) } else { (10_000_000, 2048) };
    let (a, b) = (Tensor::randn(&[n], DType::F32, &d)?, Tensor::randn(&[n], DType::F32, &d)?);
    let x = Tensor::randn(&[if tiny { 2 } else { k }, k], DType::F32, &d)?;
    let (w, bb) = (Tensor::randn(&[k], DType::F32, &d)?, Tensor::randn(&[k], DType::F32, &d)?);
    let f1 = compile(|a: &Tensor, b: &Tensor| (a + b)?.relu());
    let f2 = compile(|a: &Tensor| a.sin()?.exp()? + a.cos()?.abs()?.log()?);
    let f3 = compile(|x: &Tensor| x.softmax(-1));
    let (wc, bc) = (w.clone(), bb.clone());
    let f4 = compile(move |x: &Tensor| F::layer_norm(x, &[k], Some(&wc), Some(&bc), 1e-5));
    let f5 = compile(|x: &Tensor| x.sum(&[0], false));
    if let Some(calls) = calls_only {
        for _ in 0..calls {
            f1.call(&a, &b)?;
        }
        return Ok(());
    }
    let (warm, calls, scale, unit) = if tiny { (200, 2001, 1e6, "us") } else { (3, 15, 1e3, "ms") };
    let time = |f: &mut dyn FnMut() -> Result<Tensor>| median_s(warm, calls, f).map(|s| s * scale);
    let size = |s: &str| if tiny { String::new() } else { format!(" {s}") };
    let rows: Vec<(String, f64, f64)> = vec![
        (format!("add_relu{}", size("1e7")), time(&mut || (&a + &b)?.relu())?, time(&mut || f1.call(&a, &b))?),
        (format!("exp_sin_log_cos{}", size("1e7")), time(&mut || a.sin()?.exp()? + a.cos()?.abs()?.log()?)?, time(&mut || f2.call(&a))?),
        (format!("softmax{}", size("2048x2048")), time(&mut || x.softmax(-1))?, time(&mut || f3.call(&x))?),
        (format!("layer_norm{}", size("2048x2048")), time(&mut || F::layer_norm(&x, &[k], Some(&w), Some(&bb), 1e-5))?, time(&mut || f4.call(&x))?),
        (format!("sum_dim0{}", size("2048x2048")), time(&mut || x.sum(&[0], false))?, time(&mut || f5.call(&x))?),
    ];
    println!("{:<24} {:>10} {:>10} {:>7}", "workload (CPU)", format!("eager {unit}"), "compiled", "ratio");
    for (name, e, c) in rows {
        println!("{name:<24} {e:>10.3} {c:>10.3} {:>7.2}", e / c);
    }
    Ok(())
}
