use kiln::prelude::*;
fn med(mut f: impl FnMut()) -> f64 {
    for _ in 0..5 { f(); }
    let mut t: Vec<f64> = (0..30).map(|_| { let s = std::time::Instant::now(); f(); s.elapsed().as_secs_f64() * 1e3 }).collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[15]
}
fn main() -> kiln::Result<()> {
    let d = Device::Cpu;
    let n = 2048usize;
    let big = Tensor::randn(&[n * n + 64], DType::F32, &d)?;
    for off in [0usize, 4, 8, 12, 0, 4, 8, 12] {
        let k = off;
        let x = big.narrow(0, k, n * n)?.reshape(&[n as i64, n as i64])?;
        let f = kiln::compile::compile(|x: &Tensor| x.softmax(-1));
        let ms = med(|| { f.call(&x).unwrap(); });
        let e = med(|| { x.softmax(-1).unwrap(); });
        println!("offset {off} floats: compiled {ms:.3} eager {e:.3}");
    }
    Ok(())
}
