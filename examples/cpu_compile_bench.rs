//! CPU: eager against compiled for the bench's pointwise and reduction workloads (smaller sizes),
//! median of 15 calls after 3 warm-ups.
use kiln::compile::compile;
use kiln::nn::functional as F;
use kiln::prelude::*;
use std::time::Instant;

fn median_ms(f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t: Vec<f64> = (0..15)
        .map(|_| {
            let s = Instant::now();
            f().map(|_| s.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<_>>()?;
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[7])
}

fn main() -> Result<()> {
    let d = Device::Cpu;
    let n = 10_000_000;
    let (a, b) = (Tensor::randn(&[n], DType::F32, &d)?, Tensor::randn(&[n], DType::F32, &d)?);
    let x = Tensor::randn(&[2048, 2048], DType::F32, &d)?;
    let (w, bb) = (Tensor::randn(&[2048], DType::F32, &d)?, Tensor::randn(&[2048], DType::F32, &d)?);
    let f1 = compile(|a: &Tensor, b: &Tensor| (a + b)?.relu());
    let f2 = compile(|a: &Tensor| a.sin()?.exp()? + a.cos()?.abs()?.log()?);
    let f3 = compile(|x: &Tensor| x.softmax(-1));
    let (wc, bc) = (w.clone(), bb.clone());
    let f4 = compile(move |x: &Tensor| F::layer_norm(x, &[2048], Some(&wc), Some(&bc), 1e-5));
    let rows: Vec<(&str, f64, f64)> = vec![
        ("add_relu 1e7", median_ms(&mut || (&a + &b)?.relu())?, median_ms(&mut || f1.call(&a, &b))?),
        ("exp_sin_log_cos 1e7", median_ms(&mut || a.sin()?.exp()? + a.cos()?.abs()?.log()?)?, median_ms(&mut || f2.call(&a))?),
        ("softmax 2048x2048", median_ms(&mut || x.softmax(-1))?, median_ms(&mut || f3.call(&x))?),
        ("layer_norm 2048x2048", median_ms(&mut || F::layer_norm(&x, &[2048], Some(&w), Some(&bb), 1e-5))?, median_ms(&mut || f4.call(&x))?),
    ];
    println!("{:<24} {:>10} {:>10} {:>7}", "workload (CPU)", "eager ms", "compiled", "ratio");
    for (name, e, c) in rows {
        println!("{name:<24} {e:>10.3} {c:>10.3} {:>7.2}", e / c);
    }
    Ok(())
}
