//! `kiln bench --device cpu`: the shared workloads at CPU-sized inputs, written in the shared
//! schema, for `bench/torch_cpu.py` to stand beside. Bandwidth rows: median of 30 calls after 5
//! warm-ups, by the host's clock in place of device events; step rows and compile times as the
//! GPU bench measures them (`bench::wall_ms`, `bench::first_call`).

use super::bench::{add_relu, exp_sin_log_cos, first_call, layernorm, mlp_infer, mlp_train, softmax, wall_ms, Call};
use kiln::compile::Mode;
use kiln::prelude::*;
use serde_json::{json, Map, Value};
use std::time::Instant;

pub const WORKLOADS: [&str; 7] = [
    "pointwise.add_relu.f32.1e7",
    "pointwise.exp_sin_log_cos.f32.1e7",
    "reduction.layernorm.f32.2048x2048",
    "reduction.softmax.f32.2048x2048",
    "matmul.f32.2048",
    "mlp.infer.bs32",
    "mlp.train_sgd.bs32",
];

/// Median milliseconds of 30 calls after 5 warm-ups.
fn median_ms(f: &mut dyn FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..5 {
        f()?;
    }
    let mut t = (0..30)
        .map(|_| {
            let s = Instant::now();
            f().map(|_| s.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<Vec<f64>>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// A bandwidth row: eager and compiled times, the compiled one's first call, bytes moved.
fn bandwidth(bytes: usize, (mut eager, mut compiled): (Call, Call)) -> Result<Value> {
    let compile_s = first_call(&Device::Cpu, &mut compiled)?;
    let (e, c) = (median_ms(&mut eager)?, median_ms(&mut compiled)?);
    Ok(json!({"eager_ms": e, "compiled_ms": c, "compiled_compile_s": compile_s, "bytes": bytes, "best_GBps": bytes as f64 / (e.min(c) / 1e3) / 1e9}))
}

fn step(mut eager: Call, mut compiled: Call) -> Result<Value> {
    let compile_s = first_call(&Device::Cpu, &mut compiled)?;
    Ok(json!({"eager_ms": wall_ms(&Device::Cpu, &mut eager)?, "compiled_ms": wall_ms(&Device::Cpu, &mut compiled)?, "compiled_compile_s": compile_s}))
}

fn workload(name: &str) -> Result<Value> {
    let (cpu, n) = (Device::Cpu, 10_000_000usize);
    match name {
        "pointwise.add_relu.f32.1e7" => bandwidth(12 * n, add_relu(n, &cpu)?),
        "pointwise.exp_sin_log_cos.f32.1e7" => bandwidth(8 * n, exp_sin_log_cos(n, &cpu)?),
        "reduction.layernorm.f32.2048x2048" => bandwidth(8 * 2048 * 2048, layernorm(2048, &cpu)?),
        "reduction.softmax.f32.2048x2048" => bandwidth(8 * 2048 * 2048, softmax(2048, &cpu)?),
        "matmul.f32.2048" => {
            let (a, b) = (Tensor::randn(&[2048, 2048], DType::F32, &cpu)?, Tensor::randn(&[2048, 2048], DType::F32, &cpu)?);
            let ms = median_ms(&mut || a.matmul(&b))?;
            Ok(json!({"eager_ms": ms, "GFLOPs": 2.0 * 2048f64.powi(3) / (ms / 1e3) / 1e9}))
        }
        "mlp.infer.bs32" => step(mlp_infer(&cpu, None)?, mlp_infer(&cpu, Some(Mode::Default))?),
        "mlp.train_sgd.bs32" => step(mlp_train(&cpu, 32, None)?, mlp_train(&cpu, 32, Some(Mode::Default))?),
        _ => Err(kiln::Error::Arg { op: "bench", msg: format!("no CPU workload {name}") }),
    }
}

pub fn run(only: Option<&str>, out: &std::path::Path) -> Result<()> {
    manual_seed(0);
    let (x, y) = (Tensor::randn(&[10_000_000], DType::F32, &Device::Cpu)?, Tensor::zeros(&[10_000_000], DType::F32, &Device::Cpu)?);
    let copy_ms = median_ms(&mut || {
        y.copy_(&x)?;
        Ok(y.clone())
    })?;
    drop((x, y));
    let mut rows = Map::new();
    for name in WORKLOADS.iter().filter(|n| only.is_none_or(|o| n.contains(o))) {
        let row = workload(name).unwrap_or_else(|e| json!({"error": e.to_string()}));
        println!("{name} {row}");
        rows.insert(name.to_string(), row);
    }
    let res = json!({
        "system": format!("kiln-{}", env!("CARGO_PKG_VERSION")),
        "device": format!("cpu ({} threads)", rayon::current_num_threads()),
        "copy_GBps": 8e7 / (copy_ms / 1e3) / 1e9,
        "workloads": Value::Object(rows),
    });
    let text = serde_json::to_string_pretty(&res).expect("json");
    std::fs::write(out, text).map_err(|e| kiln::Error::Io { op: "bench", msg: format!("writing {}: {e}", out.display()) })
}
