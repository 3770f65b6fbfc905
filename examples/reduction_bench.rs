//! Row and column reductions on the GPU: eager and compiled softmax, log_softmax, layer_norm
//! and sums, in device time (median of 30 event-timed calls after 5 warm-ups) and GB/s
//! (bytes read + written), beside a copy-like pointwise kernel measured in the same run.
//! Compiled functions also report their cold first call (trace + NVRTC + run), with the kernel
//! cache pointed at an empty directory.
//!
//!   cargo run --release --example reduction_bench            # default settings, then variants
//!   cargo run --release --example reduction_bench -- --once  # default settings only
//!   cargo run --release --example reduction_bench -- --latency  # the same calls on tiny inputs
//!
//! `--latency` times each call on 4 x 256 inputs, where the kernel is a few microseconds: what
//! is left is what a call costs before its kernel starts (the host's work up to the launch, and
//! the launch seen from an idle device), which an event-timed row of the bench pays once.
//!
//! Variants rerun this program with one tuning variable set (each process reads them once):
//! KILN_ROWS_THREADS (threads per row of the row kernels, eager and compiled) and
//! KILN_COLS_CHUNKS (how many chunks a column reduction's rows are split into).

use kiln::compile::compile;
use kiln::cuda::{self, Event};
use kiln::nn::functional as F;
use kiln::prelude::*;

/// The H200's copy roofline (read + write), for the "% of copy" columns.
const ROOFLINE_GBPS: f64 = 4089.0;

type Call = Box<dyn FnMut() -> Result<Tensor>>;
/// Wall time of the first call, synchronised (for a compiled function: its cold compile).
fn first_call_s(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    let t0 = std::time::Instant::now();
    f()?;
    cuda::synchronize(dev)?;
    Ok(t0.elapsed().as_secs_f64())
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms / 1e3) / 1e9
}

/// One workload: bytes moved, the eager call and the compiled call.
struct Workload {
    name: &'static str,
    bytes: usize,
    eager: Call,
    compiled: Call,
}

fn workloads(dev: &Device, n: usize) -> Result<Vec<Workload>> {
    let r = |shape: &[usize]| Tensor::randn(shape, DType::F32, dev);
    let mut v = vec![];
    {
        let x = r(&[n, n])?;
        let (cx, f) = (x.clone(), compile(|x: &Tensor| x.softmax(-1)));
        v.push(Workload { name: "softmax 8192x8192", bytes: 8 * n * n, eager: Box::new(move || x.softmax(-1)), compiled: Box::new(move || f.call(&cx)) });
    }
    {
        let x = r(&[n, n])?;
        let (cx, f) = (x.clone(), compile(|x: &Tensor| x.log_softmax(-1)));
        v.push(Workload { name: "log_softmax 8192x8192", bytes: 8 * n * n, eager: Box::new(move || x.log_softmax(-1)), compiled: Box::new(move || f.call(&cx)) });
    }
    {
        let (x, w, b) = (r(&[n, n])?, r(&[n])?, r(&[n])?);
        let (cx, cw, cb) = (x.clone(), w.clone(), b.clone());
        let f = compile(move |x: &Tensor| F::layer_norm(x, &[n], Some(&cw), Some(&cb), 1e-5));
        v.push(Workload {
            name: "layer_norm(w,b) 8192x8192",
            bytes: 8 * n * n,
            eager: Box::new(move || F::layer_norm(&x, &[n], Some(&w), Some(&b), 1e-5)),
            compiled: Box::new(move || f.call(&cx)),
        });
    }
    {
        // Short rows: many rows per SM, where launch shape and occupancy matter most.
        let x = r(&[8 * n, n / 8])?;
        let (cx, f) = (x.clone(), compile(|x: &Tensor| x.softmax(-1)));
        v.push(Workload { name: "softmax 65536x1024", bytes: 8 * n * n, eager: Box::new(move || x.softmax(-1)), compiled: Box::new(move || f.call(&cx)) });
    }
    {
        // Column reduction: the compiled program runs it as an eager step.
        let x = r(&[n, n])?;
        let (cx, f) = (x.clone(), compile(|x: &Tensor| x.sum(&[0], false)));
        v.push(Workload { name: "sum(dim 0) 8192x8192", bytes: 4 * n * n + 4 * n, eager: Box::new(move || x.sum(&[0], false)), compiled: Box::new(move || f.call(&cx)) });
    }
    {
        let x = r(&[n, n])?;
        let (cx, f) = (x.clone(), compile(|x: &Tensor| x.sum(&[1], false)));
        v.push(Workload { name: "sum(dim 1) 8192x8192", bytes: 4 * n * n + 4 * n, eager: Box::new(move || x.sum(&[1], false)), compiled: Box::new(move || f.call(&cx)) });
    }
    Ok(v)
}

fn run(label: &str) -> Result<()> {
    let dev = Device::Cuda(0);
    // A copy-like pointwise kernel, x * 2 (read 4 B, write 4 B per element): the achievable roofline.
    let x = Tensor::randn(&[8192, 8192], DType::F32, &dev)?;
    let copy_ms = event_ms(&dev, &mut || x.mul_scalar(2.0))?;
    let copy = gbps(8 * 8192 * 8192, copy_ms);
    println!("== {label}");
    println!("copy-like x*2 8192x8192: {copy_ms:.4} ms, {copy:.0} GB/s ({:.1}% of the {ROOFLINE_GBPS:.0} GB/s roofline)", 100.0 * copy / ROOFLINE_GBPS);
    println!("{:<28} {:>9} {:>7} {:>6} {:>6} | {:>9} {:>7} {:>6} {:>6} | {:>8}", "workload", "eager ms", "GB/s", "%copy", "%roof", "comp. ms", "GB/s", "%copy", "%roof", "cold s");
    for mut w in workloads(&dev, 8192)? {
        // The compiled call first, so its cold time includes compiling every kernel it uses.
        let cold = first_call_s(&dev, &mut w.compiled)?;
        let e = event_ms(&dev, &mut w.eager)?;
        let c = event_ms(&dev, &mut w.compiled)?;
        let (ge, gc) = (gbps(w.bytes, e), gbps(w.bytes, c));
        println!(
            "{:<28} {e:>9.4} {ge:>7.0} {:>6.1} {:>6.1} | {c:>9.4} {gc:>7.0} {:>6.1} {:>6.1} | {cold:>8.3}",
            w.name,
            100.0 * ge / copy,
            100.0 * ge / ROOFLINE_GBPS,
            100.0 * gc / copy,
            100.0 * gc / ROOFLINE_GBPS
        );
    }
    Ok(())
}

/// Device time of each call on tiny inputs (see the header), beside an eager x * 2 and a copy.
fn latency() -> Result<()> {
    let dev = Device::Cuda(0);
    let x = Tensor::randn(&[4, 256], DType::F32, &dev)?;
    let y = Tensor::zeros(&[4, 256], DType::F32, &dev)?;
    println!("== latency: event-timed calls on tiny inputs (µs)");
    println!("eager x*2 4x256: {:.2}", 1e3 * event_ms(&dev, &mut || x.mul_scalar(2.0))?);
    println!("copy_ 4x256: {:.2}", 1e3 * event_ms(&dev, &mut || y.copy_(&x))?);
    // The workloads' names say their full size; here their rows are short (the row kernels'
    // shapes for n = 256).
    for mut w in workloads(&dev, 256)? {
        let _ = first_call_s(&dev, &mut w.compiled)?;
        let e = event_ms(&dev, &mut w.eager)?;
        let c = event_ms(&dev, &mut w.compiled)?;
        println!("{:<28} eager {:>6.2}  compiled {:>6.2}", w.name.split(' ').next().unwrap_or(w.name), 1e3 * e, 1e3 * c);
    }
    Ok(())
}

fn main() -> Result<()> {
    // An empty kernel cache, set before any kernel is built, so first calls compile cold.
    let cache = std::env::temp_dir().join(format!("kiln-reduction-bench-{}", std::process::id()));
    std::env::set_var("KILN_CACHE_DIR", &cache);
    if !Device::cuda_if_available(0).is_cuda() {
        println!("reduction_bench needs a CUDA device");
        return Ok(());
    }
    if std::env::args().any(|a| a == "--latency") {
        return latency();
    }
    let label = std::env::var("KILN_BENCH_VARIANT").unwrap_or_else(|_| "default settings".into());
    let result = run(&label);
    let _ = std::fs::remove_dir_all(&cache);
    result?;
    if std::env::var_os("KILN_BENCH_VARIANT").is_some() || std::env::args().any(|a| a == "--once") {
        return Ok(());
    }
    let variants = [
        ("KILN_ROWS_THREADS", "256"),
        ("KILN_ROWS_THREADS", "1024"),
        ("KILN_COLS_CHUNKS", "8"),
        ("KILN_COLS_CHUNKS", "32"),
        ("KILN_COLS_CHUNKS", "64"),
    ];
    let exe = std::env::current_exe().expect("the path of this program");
    for (var, value) in variants {
        println!();
        let status = std::process::Command::new(&exe).env(var, value).env("KILN_BENCH_VARIANT", format!("{var}={value}")).status();
        if !matches!(status, Ok(s) if s.success()) {
            println!("variant {var}={value} failed: {status:?}");
        }
    }
    Ok(())
}

/// Median device time of 30 event-timed calls after 5 warm-ups (the shared bench's rule).
fn event_ms<T>(dev: &Device, f: &mut dyn FnMut() -> Result<T>) -> Result<f64> {
    Event::median_ms(dev, 5, 30, f)
}
