//! `kiln bench`: the shared side-by-side workloads (../shared/bench), measured by the same rules
//! as the PyTorch reference, written in its JSON schema. Workloads kiln cannot run are written
//! as `{"error": ...}`, never left out; compiled modes join when the compiler exists.

use kiln::compile::{compile, compile_with, CompileOptions, Mode};
use kiln::cuda::{self, Event};
use kiln::nn::functional as F;
use kiln::prelude::*;
use serde_json::{json, Map, Value};
/// Kernels the GPU runs for one call after warm-up, as torch's profiler counts them: every
/// kernel a library call or a CUDA graph replay runs (CUPTI, detached again afterwards, so
/// later rows launch at full speed); where CUPTI is missing, the launches the profiler
/// recorded (a library call then counts one).
fn kernels(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<u64> {
    // The bench runs on one thread, where detaching is safe.
    kiln::profiler::set_cupti_detach(true);
    f()?;
    cuda::synchronize(dev)?;
    let (_, prof) = kiln::profiler::profile_with(kiln::profiler::ProfileOptions::new().device_kernels(true), f)?;
    Ok(match prof.cupti() {
        Ok(()) => prof.device_kernels().len(),
        Err(_) => prof.kernel_count(),
    } as u64)
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

/// The wall time of a compiled function's first call (trace, compile, run, synchronise).
pub(super) fn first_call(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    // The inputs' own kernels finish first: as in the reference, only the call is timed.
    cuda::synchronize(dev)?;
    let t0 = std::time::Instant::now();
    f()?;
    cuda::synchronize(dev)?;
    Ok(t0.elapsed().as_secs_f64())
}

/// The host time of one call (median of 30) made with the device idle: what it takes to queue
/// its work, which an event-timed call of an idle device includes.
fn host_us(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    let mut ts = vec![];
    for _ in 0..30 {
        cuda::synchronize(dev)?;
        let t = std::time::Instant::now();
        let out = f()?;
        ts.push(t.elapsed().as_secs_f64() * 1e6);
        cuda::synchronize(dev)?;
        drop(out);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

fn bandwidth_row(dev: &Device, bytes: usize, f: &mut dyn FnMut() -> Result<Tensor>, c: &mut dyn FnMut() -> Result<Tensor>) -> Result<Value> {
    let compile_s = first_call(dev, c)?;
    let ms = event_ms(dev, f)?;
    let cms = event_ms(dev, c)?;
    Ok(json!({
        "eager_host_us": host_us(dev, f)?,
        "compiled_host_us": host_us(dev, c)?,
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

pub type Call = Box<dyn FnMut() -> Result<Tensor>>;

/// Wall time per call over 50 calls after 5 warm-ups, one synchronisation at the end (host
/// overhead included, as the step workloads are defined).
pub(super) fn wall_ms(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
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

/// A step workload: eager, then each compiled variant (`compiled`, `reduce_overhead`, `max_autotune`) with its
/// first-call time as compile time.
fn step_row(dev: &Device, f: &mut dyn FnMut() -> Result<Tensor>, variants: &mut [(&'static str, Call)]) -> Result<Value> {
    let mut row = json!({"eager_ms": wall_ms(dev, f)?, "eager_kernels": kernels(dev, f)?, "peak_mib_eager": peak_mib(dev, f)?});
    for (name, c) in variants.iter_mut() {
        let compile_s = first_call(dev, c)?;
        row[format!("{name}_compile_s")] = json!(compile_s);
        row[format!("{name}_ms")] = json!(wall_ms(dev, c)?);
        // Beside the wall time per call: whether the host or the device sets the pace.
        row[format!("{name}_host_us")] = json!(host_us(dev, &mut || c())?);
        row[format!("{name}_kernels")] = json!(kernels(dev, c)?);
        row[format!("peak_mib_{name}")] = json!(peak_mib(dev, c)?);
    }
    Ok(row)
}

/// The compiled variants of a step workload built by `make` (None = eager).
fn variants(make: impl Fn(Option<Mode>) -> Result<Call>) -> Result<Vec<(&'static str, Call)>> {
    [Mode::Default, Mode::ReduceOverhead, Mode::MaxAutotune].into_iter().map(|m| Ok((variant_name(m), make(Some(m))?))).collect()
}

/// The name a step workload's compiled variant in `mode` has in the bench's rows.
pub fn variant_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Default => "compiled",
        Mode::ReduceOverhead => "reduce_overhead",
        Mode::MaxAutotune => "max_autotune",
    }
}

fn mlp(dev: &Device) -> Result<nn::Sequential> {
    manual_seed(0);
    Ok(nn::Sequential::new().add(nn::Linear::new(784, 256, dev)?).add(nn::ReLU).add(nn::Linear::new(256, 10, dev)?))
}

/// One training step of the MLP: forward, cross-entropy, backward, SGD(lr 0.01), grads cleared.
pub fn mlp_train(dev: &Device, bs: usize, mode: Option<Mode>) -> Result<Call> {
    let model = mlp(dev)?;
    let (x, y) = (Tensor::randn(&[bs, 784], DType::F32, dev)?, Tensor::randint(0, 10, &[bs], dev)?);
    let mut opt = optim::Sgd::new(model.parameters(), 0.01);
    Ok(training_call(x, y, mode, move |x: &Tensor, y: &Tensor| optimiser_step(F::cross_entropy(&model.forward(x)?, y)?, &mut opt)))
}

/// backward, the optimiser's step, gradients cleared: how every training row ends its step.
fn optimiser_step(loss: Tensor, opt: &mut impl optim::Optimizer) -> Result<Tensor> {
    loss.backward()?;
    opt.step()?;
    opt.zero_grad();
    Ok(loss)
}

/// The call of training step `step` on (x, y): as it is (None) or compiled in `mode`.
fn training_call(x: Tensor, y: Tensor, mode: Option<Mode>, mut step: impl FnMut(&Tensor, &Tensor) -> Result<Tensor> + Send + 'static) -> Call {
    match mode {
        None => Box::new(move || step(&x, &y)),
        Some(m) => {
            let f = compile_with(CompileOptions::new().mode(m), step);
            Box::new(move || f.call(&x, &y))
        }
    }
}

/// nn.Transformer(512, 8 heads, 6+6 layers, ff 2048, dropout 0) in eval mode, src = tgt of
/// shape (10, 32, 512), no grad; under bf16 autocast when `amp`.
fn transformer(dev: &Device, amp: bool, mode: Option<Mode>) -> Result<Call> {
    manual_seed(0);
    let cfg = nn::TransformerConfig { dropout: 0.0, ..Default::default() };
    let tr = nn::Transformer::new(cfg, dev)?;
    tr.eval();
    let xs = Tensor::randn(&[10, 32, 512], DType::F32, dev)?;
    let d = *dev;
    let run = move |x: &Tensor| {
        let fwd = || no_grad(|| tr.forward_src_tgt(x, x, &Default::default()));
        if amp { kiln::amp::autocast(&d, DType::BF16, fwd) } else { fwd() }
    };
    Ok(match mode {
        None => Box::new(move || run(&xs)),
        Some(m) => {
            let f = compile_with(CompileOptions::new().mode(m), run);
            Box::new(move || f.call(&xs))
        }
    })
}

/// GPT-2 small (124M: 12 layers, d 768, 12 heads, vocab 50257, 1024 positions, tied head).
fn gpt2_small(dtype: DType, dev: &Device) -> Result<kiln::models::Gpt2> {
    manual_seed(0);
    kiln::models::Gpt2::new(kiln::models::Gpt2Config::default(), dtype, dev)
}

/// The model as it is, or one data-parallel replica of it.
fn replica(m: impl Module + 'static, ddp: bool) -> Result<Box<dyn Module>> {
    Ok(if ddp { Box::new(nn::DistributedDataParallel::new(m)?) } else { Box::new(m) })
}

/// One GPT-2 small training step on 8 x 1024 random tokens under bf16 autocast: forward,
/// cross-entropy in F32, backward, AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1), grads
/// cleared; as it is (None) or compiled in `mode`.
/// With `ddp` the model is wrapped in `DistributedDataParallel` over the default group.
pub(super) fn gpt2_train(dev: &Device, mode: Option<Mode>, ddp: bool) -> Result<Call> {
    let model = replica(gpt2_small(DType::F32, dev)?, ddp)?;
    let cfg = optim::AdamConfig { lr: 3e-4, beta1: 0.9, beta2: 0.95, weight_decay: 0.1, ..Default::default() };
    let mut opt = optim::AdamW::new(model.parameters(), cfg);
    let (idx, tgt) = (Tensor::randint(0, 50257, &[8, 1024], dev)?, Tensor::randint(0, 50257, &[8 * 1024], dev)?);
    let d = *dev;
    Ok(training_call(idx, tgt, mode, move |idx: &Tensor, tgt: &Tensor| {
        let logits = kiln::amp::autocast(&d, DType::BF16, || model.forward(idx))?;
        optimiser_step(F::cross_entropy(&logits.reshape(&[-1, 50257])?.to_dtype(DType::F32)?, tgt)?, &mut opt)
    }))
}

/// One greedy decode step of GPT-2 small in bf16 at batch 1: the token at position 128 against
/// a static cache of 1024 positions, the argmax token id left on the device. Eager: the cache
/// rewound to 128 positions each call; compiled: `decode_step`, the position a device tensor
/// and attention over the whole cache under a mask (as PyTorch's side does).
fn gpt2_decode(dev: &Device, mode: Option<Mode>) -> Result<Call> {
    use kiln::models::CausalLm;
    let model = gpt2_small(DType::BF16, dev)?;
    let mut cache = model.new_cache(1, 1024)?;
    let tok = Tensor::randint(0, 50257, &[1, 1], dev)?;
    Ok(match mode {
        None => Box::new(move || {
            cache.set_len(128)?;
            no_grad(|| model.forward_ids(&tok, Some(&mut cache), None)?.argmax(-1, false))
        }),
        Some(m) => {
            let pos = Tensor::full(&[1], 128.0, DType::I64, dev)?;
            let f = compile_with(CompileOptions::new().mode(m), move |tok: &Tensor, pos: &Tensor| model.decode_step(tok, pos, &cache)?.argmax(-1, false));
            Box::new(move || no_grad(|| f.call(&tok, &pos)))
        }
    })
}

/// ResNet-50 inference at batch 128 (3x224x224) under bf16 autocast, channels-last as
/// `torch_reference.py` (model and input).
fn resnet50(dev: &Device, mode: Option<Mode>) -> Result<Call> {
    manual_seed(0);
    let mut rn = nn::resnet50(1000, dev)?;
    rn.eval();
    rn.to_memory_format(MemoryFormat::ChannelsLast)?;
    let x = Tensor::randn(&[128, 3, 224, 224], DType::F32, dev)?.to_memory_format(MemoryFormat::ChannelsLast)?;
    let d = *dev;
    let run = move |x: &Tensor| kiln::amp::autocast(&d, DType::BF16, || no_grad(|| rn.forward(x)));
    Ok(match mode {
        None => Box::new(move || run(&x)),
        Some(m) => {
            let f = compile_with(CompileOptions::new().mode(m), run);
            Box::new(move || f.call(&x))
        }
    })
}

/// One ResNet-50 training step at batch 128 (3x224x224) under bf16 autocast, as
/// `torch_reference.py`: channels-last model and input, forward, cross-entropy in F32,
/// backward, SGD (lr 0.1, momentum 0.9, weight decay 1e-4), grads cleared; batch norm in
/// training mode.
pub(super) fn resnet50_train(dev: &Device, mode: Option<Mode>, ddp: bool) -> Result<Call> {
    manual_seed(0);
    let mut rn = nn::resnet50(1000, dev)?;
    rn.to_memory_format(MemoryFormat::ChannelsLast)?;
    let rn = replica(rn, ddp)?;
    let mut opt = optim::Sgd::new(rn.parameters(), 0.1).momentum(0.9).weight_decay(1e-4);
    let x = Tensor::randn(&[128, 3, 224, 224], DType::F32, dev)?.to_memory_format(MemoryFormat::ChannelsLast)?;
    let y = Tensor::randint(0, 1000, &[128], dev)?;
    let d = *dev;
    Ok(training_call(x, y, mode, move |x: &Tensor, y: &Tensor| {
        let logits = kiln::amp::autocast(&d, DType::BF16, || rn.forward(x))?;
        optimiser_step(F::cross_entropy(&logits.to_dtype(DType::F32)?, y)?, &mut opt)
    }))
}

/// `(a + b).relu()` over `n` elements: (eager, compiled).
pub fn add_relu(n: usize, dev: &Device) -> Result<(Call, Call)> {
    let (a, b) = (Tensor::randn(&[n], DType::F32, dev)?, Tensor::randn(&[n], DType::F32, dev)?);
    let (ca, cb) = (a.clone(), b.clone());
    let f = compile(|a: &Tensor, b: &Tensor| (a + b)?.relu());
    Ok((Box::new(move || (&a + &b)?.relu()), Box::new(move || f.call(&ca, &cb))))
}

/// `exp(sin(x)) + log(abs(cos(x)))` over `n` elements: (eager, compiled).
pub fn exp_sin_log_cos(n: usize, dev: &Device) -> Result<(Call, Call)> {
    let x = Tensor::randn(&[n], DType::F32, dev)?;
    let cx = x.clone();
    let f = compile(|x: &Tensor| x.sin()?.exp()? + x.cos()?.abs()?.log()?);
    Ok((Box::new(move || x.sin()?.exp()? + x.cos()?.abs()?.log()?), Box::new(move || f.call(&cx))))
}

/// Layer norm over the last dim of `k` x `k`, with weight and bias: (eager, compiled).
pub fn layernorm(k: usize, dev: &Device) -> Result<(Call, Call)> {
    let r = |shape: &[usize]| Tensor::randn(shape, DType::F32, dev);
    let (x, w, b) = (r(&[k, k])?, r(&[k])?, r(&[k])?);
    let (cx, cw, cb) = (x.clone(), w.clone(), b.clone());
    let f = compile(move |x: &Tensor| F::layer_norm(x, &[k], Some(&cw), Some(&cb), 1e-5));
    Ok((Box::new(move || F::layer_norm(&x, &[k], Some(&w), Some(&b), 1e-5)), Box::new(move || f.call(&cx))))
}

/// Softmax over the last dim of `k` x `k`: (eager, compiled).
pub fn softmax(k: usize, dev: &Device) -> Result<(Call, Call)> {
    let x = Tensor::randn(&[k, k], DType::F32, dev)?;
    let cx = x.clone();
    let f = compile(|x: &Tensor| x.softmax(-1));
    Ok((Box::new(move || x.softmax(-1)), Box::new(move || f.call(&cx))))
}

/// The MLP's forward on a batch of 32 without grad, eager (None) or compiled in `mode`.
pub fn mlp_infer(dev: &Device, mode: Option<Mode>) -> Result<Call> {
    let (model, x) = (mlp(dev)?, Tensor::randn(&[32, 784], DType::F32, dev)?);
    let run = move |x: &Tensor| no_grad(|| model.forward(x));
    Ok(match mode {
        None => Box::new(move || run(&x)),
        Some(m) => {
            let f = compile_with(CompileOptions::new().mode(m), run);
            Box::new(move || f.call(&x))
        }
    })
}

/// One call of a workload, and how the bench reports it.
pub struct Workload {
    pub call: Box<dyn FnMut() -> Result<Tensor>>,
    /// The same work through `compile` (bandwidth workloads).
    pub compiled: Option<Box<dyn FnMut() -> Result<Tensor>>>,
    pub measure: Measure,
}

pub enum Measure {
    /// Bytes one call must read and write (the roofline is `copy_GBps`).
    Bandwidth { bytes: usize },
    /// Floating-point operations of one call.
    Flops(f64),
    /// A step: wall time per call, host overhead included; with its compiled variants.
    Step(Vec<(&'static str, Call)>),
}

/// Why a workload of the schema has no `setup` yet.
pub const NOT_YET: &str = "needs nn modules, optimisers and whole-step compilation, which kiln does not have yet";

/// The inputs of workload `name` (of [`WORKLOADS`]) on `dev` and the call to measure; None
/// for workloads kiln cannot run yet.
/// A `.tf32.` workload allows TF32 products from here on (PyTorch's `allow_tf32`), for itself:
/// every other row is FP32-accurate unless the bench was asked for TF32.
pub fn setup(name: &str, dev: &Device) -> Result<Option<Workload>> {
    if name.contains(".tf32.") {
        cuda::set_allow_tf32(true);
    }
    let n = 100_000_000usize;
    let r = |shape: &[usize]| Tensor::randn(shape, DType::F32, dev);
    let bw = |bytes, call: Box<dyn FnMut() -> Result<Tensor>>, compiled: Box<dyn FnMut() -> Result<Tensor>>| {
        Some(Workload { call, compiled: Some(compiled), measure: Measure::Bandwidth { bytes } })
    };
    let step = |call: Call, v: Vec<(&'static str, Call)>| Some(Workload { call, compiled: None, measure: Measure::Step(v) });
    Ok(match name {
        "pointwise.add_relu.f32.1e8" => {
            let (e, c) = add_relu(n, dev)?;
            bw(12 * n, e, c)
        }
        "pointwise.exp_sin_log_cos.f32.1e8" => {
            let (e, c) = exp_sin_log_cos(n, dev)?;
            bw(8 * n, e, c)
        }
        "pointwise.bias_gelu.f32.8192x8192" => {
            let (x, b) = (r(&[8192, 8192])?, r(&[8192])?);
            let (cx, cb) = (x.clone(), b.clone());
            let f = compile(move |x: &Tensor| x.add(&cb)?.gelu());
            bw(8 * 8192 * 8192, Box::new(move || x.add(&b)?.gelu()), Box::new(move || f.call(&cx)))
        }
        "reduction.layernorm.f32.8192x8192" => {
            let (e, c) = layernorm(8192, dev)?;
            bw(8 * 8192 * 8192, e, c)
        }
        "reduction.softmax.f32.8192x8192" => {
            let (e, c) = softmax(8192, dev)?;
            bw(8 * 8192 * 8192, e, c)
        }
        "reduction.sum_dim0.f32.8192x8192" => {
            let x = r(&[8192, 8192])?;
            let cx = x.clone();
            let f = compile(|x: &Tensor| x.sum(&[0], false));
            bw(4 * 8192 * 8192, Box::new(move || x.sum(&[0], false)), Box::new(move || f.call(&cx)))
        }
        "mlp.infer.bs32" => step(mlp_infer(dev, None)?, variants(|m| mlp_infer(dev, m))?),
        "mlp.train_sgd.bs32" => step(mlp_train(dev, 32, None)?, variants(|m| mlp_train(dev, 32, m))?),
        "mlp.train_sgd.bs4096" => step(mlp_train(dev, 4096, None)?, variants(|m| mlp_train(dev, 4096, m))?),
        "transformer.fwd.f32.10x32x512" => step(transformer(dev, false, None)?, variants(|m| transformer(dev, false, m))?),
        "transformer.fwd.bf16amp.10x32x512" => step(transformer(dev, true, None)?, variants(|m| transformer(dev, true, m))?),
        // The f32 transformer with TF32 products (`run` allows them for this row alone).
        "transformer.fwd.tf32.10x32x512" => step(transformer(dev, false, None)?, variants(|m| transformer(dev, false, m))?),
        "resnet50.infer.bf16amp.bs128" => step(resnet50(dev, None)?, variants(|m| resnet50(dev, m))?),
        "resnet50.train.bf16amp.bs128" => step(resnet50_train(dev, None, false)?, variants(|m| resnet50_train(dev, m, false))?),
        "gpt2.train.bf16amp.8x1024" => step(gpt2_train(dev, None, false)?, variants(|m| gpt2_train(dev, m, false))?),
        "gpt2.decode.bf16.bs1" => step(gpt2_decode(dev, None)?, variants(|m| gpt2_decode(dev, m))?),
        "matmul.bf16.8192" => {
            let a = Tensor::randn(&[8192, 8192], DType::BF16, dev)?;
            let b = Tensor::randn(&[8192, 8192], DType::BF16, dev)?;
            Some(Workload { call: Box::new(move || a.matmul(&b)), compiled: None, measure: Measure::Flops(2.0 * 8192f64.powi(3)) })
        }
        _ => None,
    })
}

fn workload(name: &str, dev: &Device) -> Result<Value> {
    let Some(mut w) = setup(name, dev)? else { return Ok(json!({"error": NOT_YET})) };
    match w.measure {
        Measure::Bandwidth { bytes } => {
            let c = w.compiled.as_mut().expect("bandwidth workloads have a compiled form");
            bandwidth_row(dev, bytes, &mut w.call, c)
        }
        Measure::Flops(flops) => {
            let ms = event_ms(dev, &mut w.call)?;
            Ok(json!({"eager_ms": ms, "TFLOPs": flops / (ms / 1e3) / 1e12}))
        }
        Measure::Step(mut v) => step_row(dev, &mut w.call, &mut v),
    }
}

pub const WORKLOADS: [&str; 17] = [
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
    "transformer.fwd.tf32.10x32x512",
    "resnet50.infer.bf16amp.bs128",
    "resnet50.train.bf16amp.bs128",
    "gpt2.train.bf16amp.8x1024",
    "gpt2.decode.bf16.bs1",
];

pub fn run(only: Option<&str>, out: impl AsRef<std::path::Path>, allow_tf32: bool, copy_fit: bool) -> Result<()> {
    let out = out.as_ref();
    let dev = Device::cuda_if_available(0);
    if dev == Device::Cpu {
        return Err(kiln::Error::DeviceUnavailable { op: "bench", device: Device::Cuda(0), msg: "the bench measures a GPU".into() });
    }
    cuda::set_allow_tf32(allow_tf32);
    manual_seed(0);
    let x = Tensor::randn(&[100_000_000], DType::F32, &dev)?;
    let y = Tensor::zeros(&[100_000_000], DType::F32, &dev)?;
    let copy_ms = event_ms(&dev, &mut || {
        y.copy_(&x)?;
        Ok(y.clone())
    })?;
    if copy_fit {
        for n in [25_000_000usize, 50_000_000, 67_108_864, 100_000_000] {
            let (a, b) = (x.narrow(0, 0, n)?, y.narrow(0, 0, n)?);
            let mut copy = || {
                b.copy_(&a)?;
                Ok(b.clone())
            };
            let (ms, host) = (event_ms(&dev, &mut copy)?, host_us(&dev, &mut copy)?);
            println!("copy of {} MB: {:.1} us event, host {host:.1} us", 8 * n / 1_000_000, ms * 1e3);
        }
    }
    drop((x, y));
    let mut res = Map::new();
    let tf32 = if allow_tf32 { " (allow_tf32)" } else { "" };
    res.insert("system".into(), json!(format!("kiln-{}{tf32}", env!("CARGO_PKG_VERSION"))));
    res.insert("device".into(), json!(cuda::device_name(&dev)?));
    res.insert("copy_GBps".into(), json!(8e8 / (copy_ms / 1e3) / 1e9));
    let mut rows = Map::new();
    for name in WORKLOADS {
        if only.is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let row = workload(name, &dev).unwrap_or_else(|e| json!({"error": e.to_string()}));
        // (a `.tf32.` row's setup allowed TF32 for itself)
        cuda::set_allow_tf32(allow_tf32);
        println!("{name} {row}");
        rows.insert(name.into(), row);
        cuda::empty_cache(&dev)?;
    }
    res.insert("workloads".into(), Value::Object(rows));
    let text = serde_json::to_string_pretty(&Value::Object(res)).expect("json");
    std::fs::write(out, text).map_err(|e| kiln::Error::Io { op: "bench", msg: format!("writing {}: {e}", out.display()) })
}

/// Median device time of 30 event-timed calls after 5 warm-ups (the shared bench's rule).
fn event_ms<T>(dev: &Device, f: &mut dyn FnMut() -> Result<T>) -> Result<f64> {
    Event::median_ms(dev, 5, 30, f)
}
