//! `kiln bench`: the shared side-by-side workloads (../shared/bench), measured by the same rules
//! as the PyTorch reference, written in its JSON schema. Workloads kiln cannot run are written
//! as `{"error": ...}`, never left out; compiled modes join when the compiler exists.

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

fn bandwidth_row(dev: &Device, bytes: usize, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<Value> {
    let ms = event_ms(dev, f)?;
    Ok(json!({
        "eager_ms": ms,
        "eager_kernels": kernels(dev, f)?,
        "peak_mib_eager": peak_mib(dev, f)?,
        "bytes": bytes,
        "best_GBps": bytes as f64 / (ms / 1e3) / 1e9,
    }))
}

/// Wall time per call over 50 calls after 5 warm-ups, one synchronisation at the end (host
/// overhead included, as the step workloads are defined).
fn wall_ms(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..5 {
        f()?;
    }
    cuda::synchronize(dev)?;
    let start = std::time::Instant::now();
    for _ in 0..50 {
        f()?;
    }
    cuda::synchronize(dev)?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / 50.0)
}

fn step_row(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<Value> {
    Ok(json!({"eager_ms": wall_ms(dev, f)?, "eager_kernels": kernels(dev, f)?, "peak_mib_eager": peak_mib(dev, f)?}))
}

fn mlp(dev: &Device) -> Result<nn::Sequential> {
    manual_seed(0);
    Ok(nn::Sequential::new().add(nn::Linear::new(784, 256, dev)?).add(nn::ReLU).add(nn::Linear::new(256, 10, dev)?))
}

/// One training step of the MLP: forward, cross-entropy, backward, SGD(lr 0.01), grads cleared.
fn mlp_train(dev: &Device, bs: usize) -> Result<Value> {
    let model = mlp(dev)?;
    let (x, y) = (Tensor::randn(&[bs, 784], DType::F32, dev)?, Tensor::randint(0, 10, &[bs], dev)?);
    let mut opt = optim::Sgd::new(model.parameters(), 0.01);
    step_row(dev, &mut || {
        let loss = F::cross_entropy(&model.forward(&x)?, &y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    })
}

/// nn.Transformer(512, 8 heads, 6+6 layers, ff 2048, dropout 0) in eval mode, src = tgt of
/// shape (10, 32, 512), no grad; under bf16 autocast when `amp`.
fn transformer(dev: &Device, amp: bool) -> Result<Value> {
    manual_seed(0);
    let cfg = nn::TransformerConfig { dropout: 0.0, ..Default::default() };
    let tr = nn::Transformer::new(cfg, dev)?;
    tr.eval();
    let xs = Tensor::randn(&[10, 32, 512], DType::F32, dev)?;
    let fwd = || no_grad(|| tr.forward_src_tgt(&xs, &xs, &Default::default()));
    step_row(dev, &mut || if amp { kiln::amp::autocast(dev, DType::BF16, fwd) } else { fwd() })
}

fn resnet50(dev: &Device) -> Result<Value> {
    manual_seed(0);
    let rn = nn::resnet50(1000, dev)?;
    rn.eval();
    let x = Tensor::randn(&[128, 3, 224, 224], DType::F32, dev)?;
    step_row(dev, &mut || kiln::amp::autocast(dev, DType::BF16, || no_grad(|| rn.forward(&x))))
}

fn workload(name: &str, dev: &Device) -> Result<Value> {
    let n = 100_000_000usize;
    let r = |shape: &[usize]| Tensor::randn(shape, DType::F32, dev);
    match name {
        "pointwise.add_relu.f32.1e8" => {
            let (a, b) = (r(&[n])?, r(&[n])?);
            bandwidth_row(dev, 12 * n, &mut || (&a + &b)?.relu())
        }
        "pointwise.exp_sin_log_cos.f32.1e8" => {
            let x = r(&[n])?;
            bandwidth_row(dev, 8 * n, &mut || x.sin()?.exp()? + x.cos()?.abs()?.log()?)
        }
        "pointwise.bias_gelu.f32.8192x8192" => {
            let (x, b) = (r(&[8192, 8192])?, r(&[8192])?);
            bandwidth_row(dev, 8 * 8192 * 8192, &mut || x.add(&b)?.gelu())
        }
        "reduction.layernorm.f32.8192x8192" => {
            let (x, w, b) = (r(&[8192, 8192])?, r(&[8192])?, r(&[8192])?);
            bandwidth_row(dev, 8 * 8192 * 8192, &mut || F::layer_norm(&x, &[8192], Some(&w), Some(&b), 1e-5))
        }
        "reduction.softmax.f32.8192x8192" => {
            let x = r(&[8192, 8192])?;
            bandwidth_row(dev, 8 * 8192 * 8192, &mut || x.softmax(-1))
        }
        "reduction.sum_dim0.f32.8192x8192" => {
            let x = r(&[8192, 8192])?;
            bandwidth_row(dev, 4 * 8192 * 8192, &mut || x.sum(&[0], false))
        }
        "matmul.bf16.8192" => {
            let a = Tensor::randn(&[8192, 8192], DType::BF16, dev)?;
            let b = Tensor::randn(&[8192, 8192], DType::BF16, dev)?;
            let ms = event_ms(dev, &mut || a.matmul(&b))?;
            Ok(json!({"eager_ms": ms, "TFLOPs": 2.0 * 8192f64.powi(3) / (ms / 1e3) / 1e12}))
        }
        "mlp.infer.bs32" => {
            let (model, x) = (mlp(dev)?, r(&[32, 784])?);
            step_row(dev, &mut || no_grad(|| model.forward(&x)))
        }
        "mlp.train_sgd.bs32" => mlp_train(dev, 32),
        "mlp.train_sgd.bs4096" => mlp_train(dev, 4096),
        "transformer.fwd.f32.10x32x512" => transformer(dev, false),
        "transformer.fwd.bf16amp.10x32x512" => transformer(dev, true),
        "resnet50.infer.bf16amp.bs128" => resnet50(dev),
        _ => Ok(json!({"error": format!("unknown workload {name}")})),
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
