//! CPU: the framework's own time per call (tiny inputs, so the kernels cost little), eager against
//! compiled, median of 2001 calls: where a compiled call spends host time besides its kernel.
use kiln::compile::compile;
use kiln::nn::functional as F;
use kiln::prelude::*;
use std::time::Instant;

fn median_us(f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..200 {
        f()?;
    }
    let mut t: Vec<f64> = (0..2001)
        .map(|_| {
            let s = Instant::now();
            f().map(|_| s.elapsed().as_secs_f64() * 1e6)
        })
        .collect::<Result<_>>()?;
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[1000])
}

fn main() -> Result<()> {
    let d = Device::Cpu;
    let (a, b) = (Tensor::randn(&[8], DType::F32, &d)?, Tensor::randn(&[8], DType::F32, &d)?);
    let x = Tensor::randn(&[2, 8], DType::F32, &d)?;
    let (w, bb) = (Tensor::randn(&[8], DType::F32, &d)?, Tensor::randn(&[8], DType::F32, &d)?);
    let f1 = compile(|a: &Tensor, b: &Tensor| (a + b)?.relu());
    let f3 = compile(|x: &Tensor| x.softmax(-1));
    let (wc, bc) = (w.clone(), bb.clone());
    let f4 = compile(move |x: &Tensor| F::layer_norm(x, &[8], Some(&wc), Some(&bc), 1e-5));
    let f5 = compile(|x: &Tensor| x.sum(&[0], false));
    // `HOST_LOOP=<n>`: only n calls of the compiled layer norm (for a profiler).
    if let Some(n) = std::env::var("HOST_LOOP").ok().and_then(|v| v.parse::<usize>().ok()) {
        for _ in 0..n {
            f4.call(&x)?;
        }
        return Ok(());
    }
    let rows: Vec<(&str, f64, f64)> = vec![
        ("add_relu", median_us(&mut || (&a + &b)?.relu())?, median_us(&mut || f1.call(&a, &b))?),
        ("softmax", median_us(&mut || x.softmax(-1))?, median_us(&mut || f3.call(&x))?),
        ("layer_norm", median_us(&mut || F::layer_norm(&x, &[8], Some(&w), Some(&bb), 1e-5))?, median_us(&mut || f4.call(&x))?),
        ("sum_dim0", median_us(&mut || x.sum(&[0], false))?, median_us(&mut || f5.call(&x))?),
    ];
    println!("{:<12} {:>10} {:>12}", "(CPU, tiny)", "eager us", "compiled us");
    for (name, e, c) in rows {
        println!("{name:<12} {e:>10.2} {c:>12.2}");
    }
    Ok(())
}
