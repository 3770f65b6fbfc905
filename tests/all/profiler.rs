//! The profiler, sync debug mode and KILN_LOG: counts and names of kernels on the test device,
//! the table, the Chrome trace, call sites of synchronisations.

use crate::common::*;
use kiln::logging::{self, Topic};
use kiln::prelude::*;
use kiln::profiler::{CopyKind, EventKind};
use kiln::{with_sync_debug_mode, Error};

fn inputs(n: usize) -> (Tensor, Tensor) {
    let d = dev();
    (Tensor::randn(&[n], DType::F32, &d).unwrap(), Tensor::randn(&[n], DType::F32, &d).unwrap())
}

#[test]
fn eager_add_relu_is_two_kernels_named_after_their_ops() {
    let (a, b) = inputs(1000);
    let prof = profiler::profile(|| (&a + &b)?.relu()).unwrap();
    assert_eq!(prof.kernel_count(), 2, "{:?}", prof.events());
    let names = prof.kernel_names();
    assert!(names[0].starts_with("add") && names[1].starts_with("relu"), "{names:?}");
    for k in prof.kernels() {
        assert_eq!(k.device, dev());
        assert!(k.device_us.is_some_and(|t| t >= 0.0) && k.host_us >= 0.0, "{k:?}");
        assert_eq!(k.grid.is_some(), dev().is_cuda(), "launch configuration only on a GPU: {k:?}");
    }
    if dev() == Device::Cpu {
        assert_eq!(names, ["add", "relu"]);
    }
}

#[test]
fn views_are_not_kernels_and_matmul_is_one() {
    let d = dev();
    let x = Tensor::randn(&[4, 6], DType::F32, &d).unwrap();
    let prof = profiler::profile(|| x.reshape(&[6, 4])?.transpose(0, 1)?.unsqueeze(0)).unwrap();
    assert_eq!(prof.kernel_count(), 0, "{:?}", prof.kernel_names());
    let w = Tensor::randn(&[6, 3], DType::F32, &d).unwrap();
    let prof = profiler::profile(|| x.matmul(&w)).unwrap();
    assert_eq!(prof.kernel_count(), 1, "{:?}", prof.kernel_names());
    let expected = if d.is_cuda() { "cublas_gemm_float32" } else { "matmul" };
    assert_eq!(prof.kernel_names(), [expected]);
}

#[test]
fn table_groups_by_name_and_sorts() {
    let (a, b) = inputs(256);
    let prof = profiler::profile(|| {
        let s = (&(&a + &b)? + &b)?;
        (&s + &a)?.relu()
    })
    .unwrap();
    let avg = prof.key_averages();
    let add = avg.rows().iter().find(|r| r.name.starts_with("add")).expect("an add row");
    assert_eq!(add.calls, 3);
    assert!((add.device_avg_us() - add.device_total_us / 3.0).abs() < 1e-9);
    let table = avg.table(SortBy::Calls, 10);
    let lines: Vec<&str> = table.lines().collect();
    for col in ["kernel", "calls", "device total", "device avg", "host total"] {
        assert!(lines[0].contains(col), "{table}");
    }
    assert!(lines[1].starts_with(&add.name) && lines[1].split_whitespace().nth(1) == Some("3"), "most calls first:\n{table}");
    assert!(lines[2].starts_with("relu"), "{table}");
    assert!(lines.last().unwrap().starts_with("total") && lines.last().unwrap().split_whitespace().nth(1) == Some("4"), "{table}");
    let cut = avg.table(SortBy::DeviceTimeTotal, 1);
    assert!(cut.contains("(1 more not shown)"), "{cut}");
    assert_eq!(cut.lines().count(), 4, "header, one row, the note, totals:\n{cut}");
}

#[test]
fn chrome_trace_is_json_with_slices_and_named_tracks() {
    let (a, b) = inputs(1000);
    let prof = profiler::profile(|| (&a + &b)?.relu()).unwrap();
    let path = std::env::temp_dir().join(format!("kiln-trace-{}.json", std::process::id()));
    prof.export_chrome_trace(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let events = v["traceEvents"].as_array().expect("traceEvents");
    let slices: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let on_host: Vec<&str> = slices.iter().filter(|e| e["pid"] == 0 && e["cat"] == "kernel").map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(on_host, prof.kernel_names());
    assert!(slices.iter().all(|e| e["ts"].is_number() && e["dur"].as_f64().is_some_and(|d| d >= 0.0)), "{v}");
    assert!(events.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "host"), "{v}");
    if let Device::Cuda(n) = dev() {
        let on_device = slices.iter().filter(|e| e["pid"] == 1 + n as u64).count();
        assert_eq!(on_device, 2, "each kernel on its device track: {v}");
        assert!(events.iter().any(|e| e["ph"] == "C"), "memory counters: {v}");
    }
}

#[test]
fn a_sync_is_reported_with_the_callers_line() {
    let d = dev();
    // An explicit synchronize is reported on every device, the CPU included.
    let (r, line) = (with_sync_debug_mode(SyncDebug::Error, || kiln::cuda::synchronize(&d)), line!());
    let e = r.unwrap_err();
    assert!(matches!(e, Error::Sync { .. }), "{e}");
    let at = format!("{}:{line}:", file!());
    assert!(e.to_string().contains(&at), "{e} should name {at}");

    let (prof, line) = (profiler::profile(|| with_sync_debug_mode(SyncDebug::Warn, || kiln::cuda::synchronize(&d))).unwrap(), line!());
    let syncs: Vec<_> = prof.syncs().collect();
    assert_eq!(syncs.len(), 1, "{:?}", prof.events());
    let loc = syncs[0].location.expect("a call site");
    assert_eq!((loc.file(), loc.line()), (file!(), line));

    // Reads wait for a GPU only; on the CPU they are no synchronisation.
    let x = Tensor::ones(&[3], DType::F32, &d).unwrap().sum_all().unwrap();
    let (r, line) = (profiler::profile_value(|| with_sync_debug_mode(SyncDebug::Error, || x.item::<f32>())), line!());
    if d.is_cuda() {
        let e = r.unwrap_err().to_string();
        assert!(e.contains(&format!("{}:{line}:", file!())), "{e}");
        let (r, line) = (with_sync_debug_mode(SyncDebug::Error, || x.to_device(&Device::Cpu)), line!());
        let e = r.expect_err("a synchronisation error").to_string();
        assert!(e.contains(&format!("{}:{line}:", file!())), "{e}");
    } else {
        assert_eq!(r.unwrap().0, 3.0);
    }
    assert_eq!(x.item::<f32>().unwrap(), 3.0, "the mode ends with its scope");
}

#[test]
fn the_global_mode_applies_unless_a_thread_overrides_it() {
    assert_eq!(kiln::profiler::sync_debug_mode(), SyncDebug::Off);
    kiln::set_sync_debug_mode(SyncDebug::Warn);
    assert_eq!(kiln::profiler::sync_debug_mode(), SyncDebug::Warn);
    with_sync_debug_mode(SyncDebug::Off, || assert_eq!(kiln::profiler::sync_debug_mode(), SyncDebug::Off));
    kiln::set_sync_debug_mode(SyncDebug::Off);
    assert_eq!(kiln::profiler::sync_debug_mode(), SyncDebug::Off);
}

#[test]
fn profiles_are_per_thread_and_do_not_nest() {
    let (a, b) = inputs(100);
    let prof = profiler::profile(|| {
        let (a2, b2) = (a.clone(), b.clone());
        std::thread::spawn(move || (&a2 + &b2).map(drop)).join().unwrap()?;
        assert!(profiler::profile(|| Ok(())).is_err(), "a nested profile is refused");
        a.neg()
    })
    .unwrap();
    assert_eq!(prof.kernel_count(), 1, "only this thread's neg: {:?}", prof.kernel_names());

    let e = profiler::profile(|| a.reshape(&[7])).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "the closure's error comes back: {e}");
    assert_eq!(profiler::profile(|| a.exp()).unwrap().kernel_count(), 1, "recording restarts cleanly");
}

#[test]
fn copies_syncs_and_memory_on_the_device() {
    let d = dev();
    let host = Tensor::from_vec(vec![1.0f32; 1 << 20], &[1 << 20], &Device::Cpu).unwrap();
    let (y, prof) = profiler::profile_value(|| host.to_device(&d)?.neg()?.to_device(&Device::Cpu)).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap()[7], -1.0);
    assert_eq!(prof.kernel_count(), 1, "{:?}", prof.kernel_names());
    let copies: Vec<CopyKind> = prof.events().iter().filter_map(|e| if let EventKind::Copy(k) = e.kind { Some(k) } else { None }).collect();
    if d.is_cuda() {
        assert_eq!(copies, [CopyKind::HostToDevice, CopyKind::DeviceToHost]);
        assert!(prof.events().iter().filter(|e| matches!(e.kind, EventKind::Copy(_))).all(|e| e.bytes == 4 << 20));
        assert_eq!(prof.syncs().count(), 1, "the read back waits once");
        let timeline: Vec<(EventKind, usize, Option<usize>)> = prof.memory_timeline(d).map(|e| (e.kind, e.bytes, e.bytes_in_use)).collect();
        assert!(prof.peak_bytes_in_use(d).is_some_and(|p| p >= 8 << 20), "input and product are live together: {timeline:?}");
        assert!(prof.memory_timeline(d).any(|e| e.kind == EventKind::Alloc && e.bytes >= 4 << 20));
    } else {
        assert!(copies.is_empty() && prof.syncs().count() == 0 && prof.memory_timeline(d).count() == 0);
        let e = kiln::cuda::memory_stats(&d).unwrap_err().to_string();
        assert!(e.contains("memory_stats") && e.contains("CUDA"), "{e}");
    }
}

#[test]
fn kiln_log_names_parse() {
    assert_eq!(logging::parse("graph, Kernels,,sync").unwrap(), [Topic::Graph, Topic::Kernels, Topic::Sync]);
    assert_eq!(logging::parse("all").unwrap(), Topic::ALL);
    assert!(logging::parse("").unwrap().is_empty());
    let e = logging::parse("kernels,kernal").unwrap_err().to_string();
    assert!(e.contains("KILN_LOG") && e.contains("'kernal'") && e.contains("recompiles"), "{e}");
    assert_eq!(Topic::Fusion.target(), "kiln::fusion");
    let env = logging::parse(&std::env::var("KILN_LOG").unwrap_or_default()).unwrap_or_default();
    for c in Topic::ALL {
        assert_eq!(logging::enabled(c), env.contains(&c), "{c:?} follows KILN_LOG");
    }
}

/// The `kiln` program where cargo built it, or in the bundle the GPU machine runs from (`.gpu/bin`).
fn kiln_bin() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kiln"));
    if built.exists() { built } else { ".gpu/bin/kiln".into() }
}

#[test]
fn kiln_log_prints_through_the_default_logger() {
    // The demo synchronises explicitly after training (on the CPU too) and reads losses.
    let out = std::process::Command::new(kiln_bin()).args(["demo", "--steps", "1"]).env("KILN_LOG", "bogus,sync").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("KILN_LOG") && err.contains("'bogus'"), "a bad name is reported once:\n{err}");
    assert!(err.lines().any(|l| l.starts_with("[kiln sync] ") && l.contains("src/demo.rs:")), "{err}");
}

#[test]
fn the_profile_command_rejects_an_unknown_workload_in_one_line() {
    let out = std::process::Command::new(kiln_bin()).args(["profile", "pointwise.nope"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: profile:") && err.contains("unknown workload 'pointwise.nope'") && err.contains("pointwise.add_relu.f32.1e8"), "{err}");
}

/// `--variant` picks one of a step workload's compiled forms; an unknown one is an error that
/// lists them, and it needs `--compiled`.
#[test]
fn the_profile_command_names_the_compiled_variants_it_has() {
    let out = std::process::Command::new(kiln_bin()).args(["profile", "mlp.infer.bs32", "--compiled", "--variant", "fastest"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("no compiled variant 'fastest'") && err.contains("compiled, reduce_overhead, max_autotune"), "{err}");
    let out = std::process::Command::new(kiln_bin()).args(["profile", "mlp.infer.bs32", "--variant", "max_autotune"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--compiled"), "{err}");
}

#[test]
fn each_launch_lists_the_kernels_the_gpu_ran_for_it() {
    use kiln::compile::{compile_with, CompileOptions, Mode};
    let d = dev();
    let x = Tensor::randn(&[64, 64], DType::F32, &d).unwrap();
    let with_kernels = profiler::ProfileOptions::new().device_kernels(true);
    // Host time per eager launch, printed before CUPTI attaches and after its last profile (a
    // test never asserts timings; `--nocapture` shows them).
    let launch_us = || {
        let t = std::time::Instant::now();
        for _ in 0..500 {
            drop(x.relu().unwrap());
        }
        kiln::cuda::synchronize(&d).ok();
        t.elapsed().as_secs_f64() * 1e6 / 500.0
    };
    let before = launch_us();
    let plain = profiler::profile(|| x.relu()).unwrap();
    assert!(plain.device_kernels().is_empty());
    assert_eq!(plain.cupti().is_err(), d.is_cuda(), "a plain profile of device work says it has no device kernels");
    let (_, prof) = profiler::profile_with(with_kernels, || x.relu()?.matmul(&x)).unwrap();
    assert_eq!(prof.cupti(), Ok(()), "CUPTI collects where the GPU's libraries are installed");
    if !d.is_cuda() {
        assert!(prof.device_kernels().is_empty(), "no device kernels on the CPU");
        return;
    }
    let ks: Vec<&kiln::profiler::Event> = prof.kernels().collect();
    // A generated kernel is itself; a library call runs kernels of the library's own.
    assert_eq!(ks[0].device_kernels.len(), 1, "{:?}", ks[0]);
    assert_eq!(ks[0].device_kernels[0].name, ks[0].name);
    assert!(ks[0].device_kernels[0].device_us > 0.0 && !ks[0].device_kernels[0].in_graph);
    assert!(!ks[1].device_kernels.is_empty() && ks[1].device_kernels.iter().all(|k| k.name != ks[1].name), "{:?}", ks[1]);
    assert_eq!(prof.device_kernels().len(), ks.iter().map(|k| k.device_kernels.len()).sum::<usize>());
    let by_name = prof.device_key_averages();
    assert_eq!(by_name.get(&ks[0].name).map(|r| r.calls), Some(1), "{}", by_name.table(SortBy::Calls, 10));

    // A replayed CUDA graph: every kernel inside it, with its own device time.
    let f = compile_with(CompileOptions::new().mode(Mode::ReduceOverhead), |x: &Tensor| x.exp()?.mul_scalar(2.0)?.matmul(x)?.relu());
    for _ in 0..2 {
        f.call(&x).unwrap();
    }
    let (_, prof) = profiler::profile_with(with_kernels, || f.call(&x)).unwrap();
    let replay = prof.events().iter().find(|e| e.kind == EventKind::Graph).expect("a graph replay");
    let inside: Vec<&str> = replay.device_kernels.iter().map(|k| k.name.as_str()).collect();
    assert!(replay.device_kernels.iter().all(|k| k.in_graph && k.device_us > 0.0), "{:?}", replay.device_kernels);
    for name in prof.kernel_names().iter().filter(|n| n.starts_with("fused")) {
        assert!(inside.contains(name), "{name} ran inside the replay: {inside:?}");
    }
    assert!(inside.len() >= 2, "the fused kernels and the product's: {inside:?}");
    let trace = prof.chrome_trace().to_string();
    assert!(trace.contains("kernels (CUPTI)") && trace.contains("in a CUDA graph"), "{trace}");
    drop(prof);
    // Collection ended with the last profile asking for it, and a later profile turns it on
    // again.
    let (_, again) = profiler::profile_with(with_kernels, || x.relu()).unwrap();
    assert_eq!(again.device_kernels().len(), 1, "{:?}", again.events());
    drop(again);
    eprintln!("host time per relu: {before:.2} us before CUPTI, {:.2} us after its profiles (attached, not collecting)", launch_us());
}

/// GPU work a thread keeps doing until `stop`, each result checked against the same computation
/// run eagerly once: eager ops with a product (`kind` 0), a compiled function made anew now and
/// then (1), reduce-overhead functions, CUDA graphs captured anew now and then (2), host copies
/// and reads (3). `ready` counts the threads past their first checked call. Returns the calls.
fn keep_busy(kind: usize, stop: &std::sync::atomic::AtomicBool, ready: &std::sync::atomic::AtomicUsize) -> std::result::Result<usize, String> {
    use kiln::compile::{compile, compile_with, CompileOptions, Mode};
    use std::sync::atomic::Ordering;
    let d = dev();
    let x = Tensor::randn(&[64, 64], DType::F32, &d).map_err(|e| e.to_string())?;
    let eager = |x: &Tensor| -> Result<Tensor> {
        match kind {
            0 => x.sin()?.mul_scalar(2.0)?.matmul(x),
            1 => x.tanh()?.add_scalar(1.0)?.exp(),
            2 => x.tanh()?.mul_scalar(0.5)?.matmul(x)?.relu(),
            _ => Tensor::from_vec(x.to_vec::<f32>()?, &[64, 64], &Device::Cpu)?.to_device(&d)?.cos()?.sum_all(),
        }
    };
    let make_compiled = || compile(|x: &Tensor| x.tanh()?.add_scalar(1.0)?.exp());
    let make_graphed = || compile_with(CompileOptions::new().mode(Mode::ReduceOverhead), |x: &Tensor| x.tanh()?.mul_scalar(0.5)?.matmul(x)?.relu());
    let (mut compiled, mut graphed) = (make_compiled(), make_graphed());
    let want = eager(&x).map_err(|e| e.to_string())?;
    let mut calls = 0;
    while calls == 0 || !stop.load(Ordering::Relaxed) {
        let got = match kind {
            1 => {
                if calls % 50 == 49 {
                    compiled = make_compiled();
                }
                compiled.call(&x)
            }
            2 => {
                if calls % 25 == 24 {
                    graphed = make_graphed();
                }
                graphed.call(&x)
            }
            _ => eager(&x),
        };
        let got = got.map_err(|e| format!("worker {kind}, call {calls}: {e}"))?;
        if !got.allclose(&want, 1e-4, 1e-3).map_err(|e| e.to_string())? {
            return Err(format!("worker {kind}, call {calls}: {got} should be {want}"));
        }
        if calls == 0 {
            ready.fetch_add(1, Ordering::Relaxed);
        }
        calls += 1;
    }
    Ok(calls)
}

#[test]
fn a_profile_holds_only_its_threads_work_while_other_threads_use_the_gpu() {
    profile_beside_busy_threads(|_| false);
}

#[test]
fn a_profile_with_device_kernels_holds_only_its_threads_work_while_other_threads_use_the_gpu() {
    profile_beside_busy_threads(|round| round % 2 == 0);
}

/// Eight profiles of this thread's work while four threads keep the GPU busy; `collect(round)`
/// says which also collect device kernels (attaching and detaching CUPTI each time).
fn profile_beside_busy_threads(collect: fn(usize) -> bool) {
    use kiln::profiler::{Profile, ProfileOptions};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let d = dev();
    if !d.is_cuda() {
        return;
    }
    let n = 1 << 18;
    let values: Vec<f32> = (0..n).map(|i| (i % 17) as f32 - 8.0).collect();
    let host = Tensor::from_vec(values.clone(), &[n], &Device::Cpu).unwrap();
    let want: Vec<f32> = values.iter().map(|&v| ((-v).abs().sqrt() + v).max(0.0)).collect();
    // Five kernels, two copies, one read back, allocations and frees: all on this thread.
    let work = || {
        let x = host.to_device(&d)?;
        let y = x.neg()?.abs()?.sqrt()?;
        (&y + &x)?.relu()?.to_device(&Device::Cpu)
    };
    // What a profile holds, less the block sizes the allocator picks.
    let shape = |p: &Profile| -> Vec<(EventKind, String, usize)> {
        p.events().iter().map(|e| (e.kind, e.name.clone(), if matches!(e.kind, EventKind::Alloc | EventKind::Free) { 0 } else { e.bytes })).collect()
    };
    for _ in 0..2 {
        work().unwrap();
    }
    let alone = shape(&profiler::profile(work).unwrap());
    assert_eq!(alone.iter().filter(|e| e.0 == EventKind::Kernel).count(), 5, "{alone:?}");

    let (stop, ready) = (AtomicBool::new(false), AtomicUsize::new(0));
    // Stops the workers however this thread leaves the scope (a failed assertion too).
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = Stop(&stop);
        let workers: Vec<_> = (0..4).map(|kind| (kind, s.spawn({
            let (stop, ready) = (&stop, &ready);
            move || keep_busy(kind, stop, ready)
        }))).collect();
        let started = std::time::Instant::now();
        while ready.load(Ordering::Relaxed) < workers.len() && !workers.iter().any(|(_, w)| w.is_finished()) {
            assert!(started.elapsed().as_secs() < 300, "the workers did not start");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if ready.load(Ordering::Relaxed) < workers.len() {
            stop.store(true, Ordering::Relaxed);
            let how: Vec<String> = workers.into_iter().map(|(kind, w)| format!("worker {kind}: {:?}", w.join())).collect();
            panic!("a worker stopped before profiling began: {how:?}");
        }
        // Collecting device kernels or not, attaching and detaching CUPTI each time, while every
        // worker keeps launching.
        for round in 0..8 {
            let device_kernels = collect(round);
            let launches = kiln::cuda::launch_count();
            let (y, prof) = profiler::profile_with(ProfileOptions::new().device_kernels(device_kernels), work).unwrap();
            assert_eq!(kiln::cuda::launch_count() - launches, 5, "round {round}");
            let y = y.to_vec::<f32>().unwrap();
            assert!(y.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)), "round {round}: wrong values");
            assert_eq!(shape(&prof), alone, "round {round}: only this thread's events, as when it ran alone");
            assert!(prof.events().iter().all(|e| e.device == d), "round {round}");
            assert_eq!(prof.syncs().count(), 1, "round {round}");
            if device_kernels {
                assert_eq!(prof.cupti(), Ok(()), "round {round}");
                for k in prof.kernels() {
                    let ran: Vec<(&str, bool)> = k.device_kernels.iter().map(|r| (r.name.as_str(), r.in_graph)).collect();
                    assert_eq!(ran, [(k.name.as_str(), false)], "round {round}: {} ran itself and nothing else", k.name);
                }
                assert_eq!(prof.device_kernels().len(), 5, "round {round}: no other thread's kernels");
            } else {
                assert!(prof.device_kernels().is_empty() && prof.cupti().is_err(), "round {round}");
            }
        }
        stop.store(true, Ordering::Relaxed);
        for (kind, w) in workers {
            let calls = w.join().expect("a worker panicked").unwrap_or_else(|e| panic!("{e}"));
            assert!(calls > 0, "worker {kind}");
        }
    });
}
