//! `kiln bench --distributed`: the data-parallel rows of `../shared/bench/ddp_reference.py`,
//! run under `kiln launch` (alone, as world size 1), timed by its rules (20 steps after 3
//! warm-ups, 5 for the collectives, every rank synchronised at the end); rank 0 writes the JSON.
//! The DDP steps run eager, compiled whole (`compiled_` keys, as the reference's) and replayed as
//! one CUDA graph (`reduce-overhead_`).
//! `--device cpu` measures the TCP backend's all-reduce on host tensors; `cuda` NCCL's and the
//! DDP training steps on GPU `LOCAL_RANK`.

use kiln::compile::Mode;
use kiln::distributed::{self as dist, Backend, InitOptions, ReduceOp};
use kiln::prelude::*;
use serde_json::{json, Map, Value};

pub fn run(only: Option<&str>, out: &std::path::Path, device: &str) -> Result<()> {
    let backend = match device {
        "cpu" => Backend::Tcp,
        "cuda" => Backend::Nccl,
        d => return Err(kiln::Error::Arg { op: "bench", msg: format!("--device {d}: expected cuda or cpu") }),
    };
    let mut opts = InitOptions::new(backend);
    if std::env::var_os("RANK").is_none() {
        (opts.rank, opts.world_size) = (Some(0), Some(1));
    }
    dist::init_process_group_with(opts)?;
    let (rank, world) = (dist::rank(), dist::world_size());
    let dev = if backend == Backend::Nccl { Device::Cuda(dist::local_rank()) } else { Device::Cpu };
    let sync = |dev: &Device| -> Result<()> {
        if dev.is_cuda() {
            kiln::cuda::synchronize(dev)?;
        }
        dist::barrier()
    };
    let timed = |step: &mut dyn FnMut() -> Result<()>, iters: usize, warm: usize| -> Result<f64> {
        for _ in 0..warm {
            step()?;
        }
        sync(&dev)?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            step()?;
        }
        sync(&dev)?;
        Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64)
    };
    let mut rows = Map::new();
    let mut record = |name: &str, row: Value| {
        if rank == 0 {
            println!("{name} {row}");
        }
        rows.insert(name.to_string(), row);
    };
    let sizes: &[usize] = if dev.is_cuda() { &[1, 16, 256, 1024] } else { &[1, 16, 256] };
    for &mib in sizes {
        let name = format!("allreduce.f32.{}", mib << 20);
        if only.is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let x = Tensor::randn(&[(mib << 20) / 4], DType::F32, &dev)?;
        let ms = timed(&mut || dist::all_reduce(&x, ReduceOp::Sum)?.wait(), 20, 5)?;
        let algbw = (mib << 20) as f64 / (ms / 1e3) / 1e9;
        record(&name, json!({"ms": ms, "world_size": world, "busbw_GBps": algbw * 2.0 * (world as f64 - 1.0) / world as f64}));
    }
    if dev.is_cuda() {
        type Make = fn(&Device, Option<Mode>) -> Result<super::bench::Call>;
        let steps: [(&str, usize, Make); 2] = [
            ("ddp.resnet50.train.bf16amp.bs128", 128, |d, m| super::bench::resnet50_train(d, m, true)),
            ("ddp.gpt2.train.bf16amp.8x1024", 8 * 1024, |d, m| super::bench::gpt2_train(d, m, true)),
        ];
        for (name, per_step, make) in steps {
            if only.is_some_and(|o| !name.contains(o)) {
                continue;
            }
            let unit = if name.contains("resnet") { "images_per_s" } else { "tokens_per_s" };
            let mut row = Map::new();
            row.insert("world_size".into(), json!(world));
            // Eager, then compiled whole (the all-reduces inside the step's graph), then replayed
            // as one CUDA graph.
            for (key, mode) in [("", None), ("compiled_", Some(Mode::Default)), ("reduce-overhead_", Some(Mode::ReduceOverhead))] {
                let r = make(&dev, mode).and_then(|mut call| timed(&mut || call().map(drop), 20, 3));
                match r {
                    Ok(ms) => {
                        row.insert(format!("{key}ms"), json!(ms));
                        row.insert(format!("{key}{unit}"), json!((per_step * world) as f64 / (ms / 1e3)));
                    }
                    Err(e) => {
                        row.insert(format!("{key}error"), json!(e.to_string()));
                    }
                }
                kiln::cuda::empty_cache(&dev)?;
            }
            record(name, Value::Object(row));
        }
    }
    if rank == 0 {
        let name = if dev.is_cuda() { kiln::cuda::device_name(&dev)? } else { "cpu".into() };
        let res = json!({"system": format!("kiln-{}", env!("CARGO_PKG_VERSION")), "device": name, "world_size": world, "workloads": Value::Object(rows)});
        std::fs::write(out, serde_json::to_string_pretty(&res).expect("json")).map_err(|e| kiln::Error::Io { op: "bench", msg: format!("writing {}: {e}", out.display()) })?;
    }
    dist::destroy_process_group()
}
