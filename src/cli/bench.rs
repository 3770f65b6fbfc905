//! `kiln bench`: the shared side-by-side workloads (../shared/bench), measured by the same rules
//! as the PyTorch reference, written in its JSON schema. Workloads kiln cannot run yet are
//! written as `{"error": ...}`, never left out.

use kiln::compile::compile;
use kiln::cuda::{self, Event};
use kiln::nn::functional as F;
use kiln::prelude::*;
use serde_json::{json, Map, Value};

/// Median device time of 30 event-timed calls after 5 warm-ups.
fn event_ms(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..5 {
        f()?;
    }
    let mut ts = Vec::with_capacity(30);
    for _ in 0..30 {
        let s = Event::record(dev)?;
        let out = f()?;
        let e = Event::record(dev)?;
        ts.push(s.elapsed_ms(&e)?);
        drop(out);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2])
}

/// Kernels one call launches (after warm-up).
fn kernels(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<u64> {
    f()?;
    cuda::synchronize(dev)?;
    let before = cuda::launch_count();
    f()?;
    Ok(cuda::launch_count() - before)
}

/// Peak device memory one call allocates, beyond what was allocated before it.
fn peak_mib(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    cuda::synchronize(dev)?;
    cuda::reset_peak_memory_stats(dev)?;
    let base = cuda::memory_stats(dev)?.allocated;
    let out = f()?;
    cuda::synchronize(dev)?;
    drop(out);
    Ok((cuda::memory_stats(dev)?.peak_allocated - base) as f64 / (1u64 << 20) as f64)
}

/// A compiled variant of a workload: its call, and the wall time of its first call.
type CompiledRun<'a> = (&'a mut dyn FnMut() -> Result<Tensor>, f64);

fn bandwidth_row(dev: &Device, bytes: usize, f: &mut dyn FnMut() -> Result<Tensor>, compiled: CompiledRun) -> Result<Value> {
    let ms = event_ms(dev, f)?;
    let (c, compile_s) = compiled;
    let cms = event_ms(dev, c)?;
    Ok(json!({
        "eager_ms": ms,
        "eager_kernels": kernels(dev, f)?,
        "peak_mib_eager": peak_mib(dev, f)?,
        "compiled_ms": cms,
        "compiled_kernels": kernels(dev, c)?,
        "compiled_compile_s": compile_s,
        "peak_mib_compiled": peak_mib(dev, c)?,
        "bytes": bytes,
        "best_GBps": bytes as f64 / (ms.min(cms) / 1e3) / 1e9,
    }))
}

/// The wall time of a compiled function's first call (trace, compile, run, synchronise).
fn first_call(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    let t0 = std::time::Instant::now();
    f()?;
    cuda::synchronize(dev)?;
    Ok(t0.elapsed().as_secs_f64())
}

fn workload(name: &str, dev: &Device) -> Result<Value> {
    let n = 100_000_000usize;
    let r = |shape: &[usize]| Tensor::randn(shape, DType::F32, dev);
    match name {
        "pointwise.add_relu.f32.1e8" => {
            let (a, b) = (r(&[n])?, r(&[n])?);
            let f = compile(|a: &Tensor, b: &Tensor| (a + b)?.relu());
            let mut c = || f.call(&a, &b);
            let s = first_call(dev, &mut c)?;
            bandwidth_row(dev, 12 * n, &mut || (&a + &b)?.relu(), (&mut c, s))
        }
        "pointwise.exp_sin_log_cos.f32.1e8" => {
            let x = r(&[n])?;
            let f = compile(|x: &Tensor| x.sin()?.exp()? + x.cos()?.abs()?.log()?);
            let mut c = || f.call(&x);
            let s = first_call(dev, &mut c)?;
            bandwidth_row(dev, 8 * n, &mut || x.sin()?.exp()? + x.cos()?.abs()?.log()?, (&mut c, s))
        }
        "pointwise.bias_gelu.f32.8192x8192" => {
            let (x, b) = (r(&[8192, 8192])?, r(&[8192])?);
            let bc = b.clone();
            let f = compile(move |x: &Tensor| x.add(&bc)?.gelu());
            let mut c = || f.call(&x);
            let s = first_call(dev, &mut c)?;
            bandwidth_row(dev, 8 * 8192 * 8192, &mut || x.add(&b)?.gelu(), (&mut c, s))
        }
        "reduction.layernorm.f32.8192x8192" => {
            let (x, w, b) = (r(&[8192, 8192])?, r(&[8192])?, r(&[8192])?);
            let (wc, bc) = (w.clone(), b.clone());
            let f = compile(move |x: &Tensor| F::layer_norm(x, &[8192], Some(&wc), Some(&bc), 1e-5));
            let mut c = || f.call(&x);
            let s = first_call(dev, &mut c)?;
            bandwidth_row(dev, 8 * 8192 * 8192, &mut || F::layer_norm(&x, &[8192], Some(&w), Some(&b), 1e-5), (&mut c, s))
        }
        "reduction.softmax.f32.8192x8192" => {
            let x = r(&[8192, 8192])?;
            let f = compile(|x: &Tensor| x.softmax(-1));
            let mut c = || f.call(&x);
            let s = first_call(dev, &mut c)?;
            bandwidth_row(dev, 8 * 8192 * 8192, &mut || x.softmax(-1), (&mut c, s))
        }
        "reduction.sum_dim0.f32.8192x8192" => {
            let x = r(&[8192, 8192])?;
            let f = compile(|x: &Tensor| x.sum(&[0], false));
            let mut c = || f.call(&x);
            let s = first_call(dev, &mut c)?;
            bandwidth_row(dev, 4 * 8192 * 8192, &mut || x.sum(&[0], false), (&mut c, s))
        }
        "matmul.bf16.8192" => {
            let a = Tensor::randn(&[8192, 8192], DType::BF16, dev)?;
            let b = Tensor::randn(&[8192, 8192], DType::BF16, dev)?;
            let ms = event_ms(dev, &mut || a.matmul(&b))?;
            Ok(json!({"eager_ms": ms, "TFLOPs": 2.0 * 8192f64.powi(3) / (ms / 1e3) / 1e12}))
        }
        _ => Ok(json!({"error": "needs nn modules, optimisers and whole-step compilation, which kiln does not have yet"})),
    }
}

pub const WORKLOADS: [&str; 13] = [
    "pointwise.add_relu.f32.1e8",
    "pointwise.exp_sin_log_cos.f32.1e8",
    "pointwise.bias_gelu.f32.8192x8192",
    "reduction.layernorm.f32.8192x8192",
    "reduction.softmax.f32.8192x8192",
    "reduction.sum_dim0.f32.8192x8192",
    "matmul.bf16.8192",
    "mlp.infer.bs32",
    "mlp.train_sgd.bs32",
    "mlp.train_sgd.bs4096",
    "transformer.fwd.f32.10x32x512",
    "transformer.fwd.bf16amp.10x32x512",
    "resnet50.infer.bf16amp.bs128",
];

pub fn run(only: Option<&str>, out: &std::path::Path) -> Result<()> {
    let dev = Device::cuda_if_available(0);
    if dev == Device::Cpu {
        return Err(kiln::Error::DeviceUnavailable { op: "bench", device: Device::Cuda(0), msg: "the bench measures a GPU".into() });
    }
    manual_seed(0);
    let x = Tensor::randn(&[100_000_000], DType::F32, &dev)?;
    let y = Tensor::zeros(&[100_000_000], DType::F32, &dev)?;
    let copy_ms = event_ms(&dev, &mut || {
        y.copy_(&x)?;
        Ok(y.clone())
    })?;
    drop((x, y));
    let mut res = Map::new();
    res.insert("system".into(), json!(format!("kiln-{}", env!("CARGO_PKG_VERSION"))));
    res.insert("device".into(), json!(cuda::device_name(&dev)?));
    res.insert("copy_GBps".into(), json!(8e8 / (copy_ms / 1e3) / 1e9));
    let mut rows = Map::new();
    for name in WORKLOADS {
        if only.is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let row = workload(name, &dev).unwrap_or_else(|e| json!({"error": e.to_string()}));
        println!("{name} {row}");
        rows.insert(name.into(), row);
        cuda::empty_cache(&dev)?;
    }
    res.insert("workloads".into(), Value::Object(rows));
    let text = serde_json::to_string_pretty(&Value::Object(res)).expect("json");
    std::fs::write(out, text).map_err(|e| kiln::Error::Io { op: "bench", msg: format!("writing {}: {e}", out.display()) })
}
