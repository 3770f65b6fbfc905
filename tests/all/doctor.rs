//! `kiln::doctor`: built-in bad steps each produce exactly their finding, a good compiled step
//! passes every item, and on the CPU the GPU items are not applicable.

use crate::common::*;
use kiln::compile::{compile, compile_with, CompileOptions, Mode};
use kiln::doctor::{self, Idle, Report, Status};
use kiln::prelude::*;

fn failed(r: &Report) -> Vec<&'static str> {
    r.items.iter().filter(|i| i.failed()).map(|i| i.name).collect()
}

/// On the CPU every GPU item says not applicable.
fn gpu_items_not_applicable(r: &Report) {
    for name in ["synchronisation", "gpu_busy", "precision", "launches", "loader"] {
        assert_eq!(r.item(name).unwrap().status, Status::NotApplicable, "{name}: {}", r.table());
    }
}

#[test]
fn an_eager_step_fails_compilation_only() {
    let d = dev();
    let x = Tensor::randn(&[256, 256], DType::BF16, &d).unwrap();
    let r = doctor::check(|| x.matmul(&x)?.relu().map(drop)).unwrap();
    assert!(r.item("compilation").unwrap().evidence.contains("eagerly"), "{}", r.table());
    if d.is_cuda() {
        // A small eager step is also bound by its launches.
        for f in failed(&r) {
            assert!(["compilation", "launches", "gpu_busy"].contains(&f), "{}", r.table());
        }
    } else {
        assert_eq!(failed(&r), ["compilation"], "{}", r.table());
        gpu_items_not_applicable(&r);
    }
}

#[test]
fn a_recompiling_step_names_its_recompiles() {
    let d = dev();
    let f = compile(|x: &Tensor| x.exp()?.sum_all());
    let mut n = 8;
    let r = doctor::check(|| {
        n += 1; // a new size every step
        f.call(&Tensor::ones(&[n], DType::F32, &d)?).map(drop)
    })
    .unwrap();
    let c = r.item("compilation").unwrap();
    // Recompiles, or, once they reach the recompile limit, eager calls.
    assert!(c.failed() && c.evidence.contains("recompil"), "{}", r.table());
}

#[test]
fn a_host_read_per_step_is_a_synchronisation_named_by_its_line() {
    let d = dev();
    let x = Tensor::randn(&[1024], DType::F32, &d).unwrap();
    let line = line!() + 1;
    let r = doctor::check(|| x.exp()?.sum_all()?.item::<f32>().map(drop)).unwrap();
    let s = r.item("synchronisation").unwrap();
    if d.is_cuda() {
        assert!(s.failed(), "{}", r.table());
        assert_eq!(s.at.as_deref(), Some(format!("tests/all/doctor.rs:{line}").as_str()), "{}", r.table());
    } else {
        gpu_items_not_applicable(&r);
    }
}

#[test]
fn f32_products_on_a_gpu_fail_precision_and_bf16_autocast_passes() {
    let d = dev();
    let x = Tensor::randn(&[512, 512], DType::F32, &d).unwrap();
    let r = doctor::check(|| x.matmul(&x).map(drop)).unwrap();
    let amp = doctor::check(|| amp::autocast(&d, DType::BF16, || x.matmul(&x)).map(drop)).unwrap();
    if d.is_cuda() {
        assert!(r.item("precision").unwrap().failed(), "{}", r.table());
        assert!(r.item("precision").unwrap().evidence.contains("autocast"));
        assert!(amp.item("precision").unwrap().passed(), "{}", amp.table());
    } else {
        gpu_items_not_applicable(&r);
    }
}

#[test]
fn a_tiny_eager_step_is_host_bound_and_its_graph_replay_is_not() {
    let d = dev();
    let x = Tensor::randn(&[64], DType::F32, &d).unwrap();
    let tiny = |x: &Tensor| -> kiln::Result<Tensor> { (0..20).try_fold(x.clone(), |a, _| a.mul_scalar(1.01)?.add_scalar(0.1)) };
    let r = doctor::check(|| tiny(&x).map(drop)).unwrap();
    let graphed = compile_with(CompileOptions::new().mode(Mode::ReduceOverhead), tiny);
    let g = doctor::check(|| graphed.call(&x).map(drop)).unwrap();
    if d.is_cuda() {
        let l = r.item("launches").unwrap();
        assert!(l.failed() && l.evidence.contains("ReduceOverhead"), "{}", r.table());
        assert!(g.item("launches").unwrap().passed(), "{}", g.table());
        assert!(g.item("compilation").unwrap().passed(), "{}", g.table());
    } else {
        gpu_items_not_applicable(&r);
        assert!(g.item("compilation").unwrap().passed(), "{}", g.table());
    }
}

#[test]
fn a_good_compiled_step_passes_every_item() {
    let d = dev();
    // Device-bound: bf16 products of 2048², replayed as one CUDA graph on a GPU.
    let n = if d.is_cuda() { 2048 } else { 64 };
    let w = Tensor::randn(&[n, n], DType::BF16, &d).unwrap();
    let x = Tensor::randn(&[n, n], DType::BF16, &d).unwrap();
    let step = compile_with(CompileOptions::new().mode(Mode::ReduceOverhead), move |x: &Tensor| (0..8).try_fold(x.clone(), |a, _| a.matmul(&w)?.relu()));
    let r = doctor::check(|| step.call(&x).map(drop)).unwrap();
    if !r.item("gpu_busy").unwrap().evidence.contains("other threads") {
        assert!(failed(&r).is_empty(), "{}", r.table());
    } else {
        // Beside other threads' GPU work (tests side by side) this thread's host may be slowed
        // between replays, which gpu_busy rightly reports; every other item still holds.
        assert!(failed(&r).iter().all(|f| *f == "gpu_busy"), "{}", r.table());
    }
    if !d.is_cuda() {
        gpu_items_not_applicable(&r);
    }
    let j = r.to_json();
    assert_eq!(j["items"].as_array().unwrap().len(), 6);
}

#[test]
fn an_unpinned_loader_with_blocking_copies_fails_the_loader_item_and_a_pinned_one_passes() {
    use kiln::data::{DataLoader, SyntheticClassification};
    let d = dev();
    let run = |pinned: bool| -> Report {
        let loader = DataLoader::new(SyntheticClassification::mnist_like(128, 0).unwrap(), 8).unwrap().pin_memory(pinned && d.is_cuda());
        let mut batches = loader.iter();
        doctor::check(|| {
            let (x, _) = batches.next().expect("enough batches")?;
            let x = if pinned { x.to_device_async(&d)? } else { x.to_device(&d)? };
            x.relu().map(drop)
        })
        .unwrap()
    };
    let (bad, good) = (run(false), run(true));
    if d.is_cuda() {
        let l = bad.item("loader").unwrap();
        assert!(l.failed() && l.evidence.contains("pin_memory"), "{}", bad.table());
        assert!(good.item("loader").unwrap().passed(), "{}", good.table());
    } else {
        gpu_items_not_applicable(&bad);
        gpu_items_not_applicable(&good);
    }
}

#[test]
fn f16_products_with_backward_and_no_scaler_fail_precision_and_a_scaled_loss_passes() {
    let d = dev();
    let x = Tensor::randn(&[256, 256], DType::F16, &d).unwrap();
    let w = Tensor::randn(&[256, 256], DType::F16, &d).unwrap().requires_grad();
    let scaler = optim::GradScaler::new();
    let step = |scaled: bool| {
        let loss = x.matmul(&w)?.to_dtype(DType::F32)?.mean_all()?;
        let loss = if scaled { scaler.scale(&loss)? } else { loss };
        loss.backward()?;
        w.clear_grad();
        Ok::<(), kiln::Error>(())
    };
    let line = line!() - 6;
    let bad = doctor::check(|| step(false)).unwrap();
    let good = doctor::check(|| step(true)).unwrap();
    if d.is_cuda() {
        let p = bad.item("precision").unwrap();
        assert!(p.failed() && p.evidence.contains("GradScaler"), "{}", bad.table());
        assert_eq!(p.at.as_deref(), Some(format!("tests/all/doctor.rs:{line}").as_str()), "{}", bad.table());
        assert!(good.item("precision").unwrap().passed(), "{}", good.table());
    } else {
        gpu_items_not_applicable(&bad);
        gpu_items_not_applicable(&good);
    }
}

#[test]
fn a_host_bound_gap_names_the_line_before_it_and_is_marked_in_the_trace() {
    let d = dev();
    let x = Tensor::randn(&[1 << 16], DType::F32, &d).unwrap();
    let line = line!() + 2;
    let r = doctor::check(|| {
        let a = x.exp()?;
        std::thread::sleep(std::time::Duration::from_micros(500)); // host work between launches
        a.sin().map(drop)
    })
    .unwrap();
    if d.is_cuda() {
        let site = format!("tests/all/doctor.rs:{line}");
        let gap = r.gaps.iter().find(|g| g.kind == Idle::HostBound && g.us >= 400.0).expect("the sleep's gap");
        assert_eq!(gap.at.as_deref(), Some(site.as_str()), "{gap:?}");
        assert!(gap.before.starts_with("exp") && gap.after.starts_with("sin"), "{gap:?}");
        // Other threads' kernels (tests side by side) may fill the gap; alone it is the finding.
        if r.gaps.iter().all(|g| g.other_us == 0.0) {
            let b = r.item("gpu_busy").unwrap();
            assert!(b.failed() && b.evidence.contains("host-bound after"), "{}", r.table());
            assert_eq!(b.at.as_deref(), Some(site.as_str()), "{}", r.table());
        }
        let trace = r.chrome_trace();
        let marks: Vec<&serde_json::Value> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "mark").collect();
        assert!(marks.iter().any(|m| m["name"] == "idle: host-bound" && m["args"]["look at"] == site.as_str() && m["dur"] == gap.us), "{marks:?}");
        assert!(trace["traceEvents"].as_array().unwrap().iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "idle gaps (kiln doctor)"));
    } else {
        assert!(r.gaps.is_empty());
        gpu_items_not_applicable(&r);
    }
}

#[test]
fn other_threads_gpu_work_during_the_check_is_left_out_of_its_timings() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let d = dev();
    if !d.is_cuda() {
        return; // no shared device on the CPU
    }
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (started, running) = std::sync::mpsc::channel();
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || -> kiln::Result<()> {
            let m = Tensor::randn(&[1 << 20], DType::F32, &d)?;
            while !stop.load(Ordering::Relaxed) {
                // Launches queued back to back, read once in a while to bound the queue.
                (0..64).try_fold(m.clone(), |a, _| a.sin())?.sum_all()?.item::<f32>()?;
                let _ = started.send(());
            }
            Ok(())
        })
    };
    running.recv().expect("the other thread runs");
    let x = Tensor::randn(&[64], DType::F32, &d).unwrap();
    let r = doctor::check(|| (0..20).try_fold(x.clone(), |a, _| a.mul_scalar(1.01)?.add_scalar(0.1)).map(drop));
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap().unwrap();
    let r = r.unwrap();
    let l = r.item("launches").unwrap();
    assert!(l.failed() && l.evidence.contains("other threads"), "{}", r.table());
}
