//! `kiln profile WORKLOAD`: one call of a bench workload under the profiler, after a warm-up
//! call; prints the per-kernel table and writes a Chrome trace.

use super::bench::{self, WORKLOADS};
use kiln::prelude::*;
use kiln::Error;
use std::path::Path;

pub fn run(name: &str, trace: impl AsRef<Path>, compiled: bool, variant: Option<&str>) -> Result<()> {
    let trace = trace.as_ref();
    if !WORKLOADS.contains(&name) {
        return Err(Error::Arg { op: "profile", msg: format!("unknown workload '{name}'; one of: {}", WORKLOADS.join(", ")) });
    }
    let dev = Device::cuda_if_available(0);
    manual_seed(0);
    let Some(mut w) = bench::setup(name, &dev)? else {
        return Err(Error::Arg { op: "profile", msg: format!("{name} {}", bench::NOT_YET) });
    };
    let call: &mut bench::Call = if compiled {
        match (&mut w.compiled, &mut w.measure, variant) {
            (Some(c), _, None) => c,
            (None, bench::Measure::Step(v), None) if !v.is_empty() => &mut v[0].1,
            (None, bench::Measure::Step(v), Some(want)) => {
                let names: Vec<&str> = v.iter().map(|(n, _)| *n).collect();
                match v.iter_mut().find(|(n, _)| *n == want) {
                    Some((_, c)) => c,
                    None => return Err(Error::Arg { op: "profile", msg: format!("{name} has no compiled variant '{want}'; it has {}", names.join(", ")) }),
                }
            }
            (_, _, Some(want)) => return Err(Error::Arg { op: "profile", msg: format!("{name} has one compiled form, not variants ('{want}')") }),
            _ => return Err(Error::Arg { op: "profile", msg: format!("{name} has no compiled form in the bench") }),
        }
    } else {
        &mut w.call
    };
    drop(call()?); // kernels compiled, allocator cache warm
    drop(call()?);
    kiln::cuda::synchronize(&dev)?;
    let (_, prof) = profiler::profile_with(profiler::ProfileOptions::new().device_kernels(true), call)?;
    let form = if compiled { "compiled" } else { "eager" };
    println!("{name} ({form}) on {dev}: one call after warm-up, {:.3} ms on the host", prof.wall_us() / 1e3);
    println!("{}", prof.key_averages().table(SortBy::DeviceTimeTotal, 20));
    println!("{} kernels", prof.kernel_count());
    match prof.cupti() {
        Ok(()) => {
            let ran = prof.device_key_averages();
            println!("\nkernels the GPU ran (CUPTI: library kernels by their own names, graph replays by their kernels):");
            println!("{}", ran.table(SortBy::DeviceTimeTotal, 20));
            println!("{} kernels on the device", ran.rows().iter().map(|r| r.calls).sum::<usize>());
        }
        Err(why) => println!("(no per-kernel device timeline: {why})"),
    }
    if let Some(peak) = prof.peak_bytes_in_use(dev) {
        println!("peak device memory allocated: {:.1} MiB", peak as f64 / (1u64 << 20) as f64);
    }
    prof.export_chrome_trace(trace)?;
    println!("Chrome trace written to {} (open in chrome://tracing or ui.perfetto.dev)", trace.display());
    Ok(())
}
