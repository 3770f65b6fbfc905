//! `kiln::doctor`: the production checklist checked on the user's own training step. A few steps
//! run under the profiler, and each item of the checklist is reported as passed, failed or not
//! applicable, with its evidence and, where there is one, the line of code to look at:
//!
//! - `synchronisation`: implicit host synchronisations in the step (`.item()`, `to_vec`, a
//!   host copy), each with its call site and how long the host waited;
//! - `gpu_busy`: the fraction of the step the GPU was busy, the idle time split into waits on
//!   synchronisations and host-bound gaps, the largest gap named by the launch that ended it;
//! - `compilation`: whether the step runs compiled, and every recompile with its reason;
//! - `precision`: F32 products on a GPU with tensor cores (autocast to BF16 pays there);
//! - `launches`: kernels shorter than their launch, and whether the step is bound by the host
//!   (then a CUDA graph, `Mode::ReduceOverhead`, pays);
//! - `loader`: whether the step's batches were pinned and their copies asynchronous (and so
//!   free to overlap compute), with the loader's workers.
//!
//! On the CPU the GPU items are not applicable.
//!
//! ```
//! use kiln::prelude::*;
//! # fn main() -> kiln::Result<()> {
//! let x = Tensor::randn(&[64, 64], DType::F32, &Device::Cpu)?;
//! let report = kiln::doctor::check(|| x.matmul(&x)?.relu().map(drop))?;
//! println!("{}", report.table());
//! assert!(report.item("compilation").unwrap().failed(), "an eager step");
//! # Ok(())
//! # }
//! ```

use crate::profiler::{self, Event, EventKind, Profile, ProfileOptions};
use crate::{Device, Result};
use serde_json::json;

/// How many steps to run before and under the profiler.
#[derive(Clone, Debug)]
pub struct DoctorOptions {
    /// Steps run first and not looked at (compilation, caches, capture).
    pub warmup: usize,
    /// Steps profiled.
    pub steps: usize,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions { warmup: 3, steps: 5 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Passed,
    Failed,
    NotApplicable,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Status::Passed => "passed",
            Status::Failed => "FAILED",
            Status::NotApplicable => "n/a",
        }
    }
}

/// One checklist item's verdict.
#[derive(Clone, Debug)]
pub struct Item {
    pub name: &'static str,
    pub status: Status,
    /// What was measured, and what to do about a failure.
    pub evidence: String,
    /// The call site to look at (`file:line`), when the finding has one.
    pub at: Option<String>,
}

impl Item {
    pub fn failed(&self) -> bool {
        self.status == Status::Failed
    }
    pub fn passed(&self) -> bool {
        self.status == Status::Passed
    }
}

/// What `check` found, with the profile of the checked steps.
pub struct Report {
    pub items: Vec<Item>,
    pub steps: usize,
    pub profile: Profile,
}

impl Report {
    pub fn item(&self, name: &str) -> Option<&Item> {
        self.items.iter().find(|i| i.name == name)
    }

    /// The checklist as a terminal table.
    pub fn table(&self) -> String {
        let mut s = format!("kiln doctor: {} profiled steps\n", self.steps);
        for i in &self.items {
            s.push_str(&format!("{:<16} {:<7} {}", i.name, i.status.word(), i.evidence));
            if let Some(at) = &i.at {
                s.push_str(&format!(" [at {at}]"));
            }
            s.push('\n');
        }
        s
    }

    /// The checklist for tools.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "steps": self.steps,
            "items": self.items.iter().map(|i| json!({"name": i.name, "status": i.status.word().to_lowercase(), "evidence": i.evidence, "at": i.at})).collect::<Vec<_>>(),
        })
    }
}

/// Checks `step` with the default options.
#[track_caller]
pub fn check(step: impl FnMut() -> Result<()>) -> Result<Report> {
    check_with(DoctorOptions::default(), step)
}

/// Runs `opts.warmup` steps, then `opts.steps` under the profiler, and judges them.
pub fn check_with(opts: DoctorOptions, mut step: impl FnMut() -> Result<()>) -> Result<Report> {
    let steps = opts.steps.max(1);
    for _ in 0..opts.warmup {
        step()?;
    }
    let devices = cuda_devices_in_use();
    for d in &devices {
        crate::cuda::synchronize(d)?;
    }
    let (before, loaded_before) = (crate::compile::activity(), crate::data::loader_activity());
    let (_, profile) = profiler::profile_with(ProfileOptions::new(), || (0..steps).try_for_each(|_| step()))?;
    let (after, loaded_after) = (crate::compile::activity(), crate::data::loader_activity());
    for d in &devices {
        crate::cuda::synchronize(d)?;
    }
    let gpu = profile.events().iter().any(|e| e.device.is_cuda());
    let busy = busy_intervals(&profile);
    let items = vec![
        synchronisation(&profile, steps, gpu),
        gpu_busy(&profile, &busy, steps, gpu),
        compilation(&profile, steps, &before, &after),
        precision(&profile, gpu),
        launches(&profile, &busy, steps, gpu),
        loader(&profile, steps, gpu, &loaded_before, &loaded_after),
    ];
    Ok(Report { items, steps, profile })
}

/// The CUDA devices this process has opened (the step's warm-up opened those it uses).
fn cuda_devices_in_use() -> Vec<Device> {
    (0..crate::cuda::device_count()).filter(|&n| crate::backend::cuda::device::is_open(n)).map(Device::Cuda).collect()
}

fn not_applicable(name: &'static str) -> Item {
    Item { name, status: Status::NotApplicable, evidence: "no GPU work in the step".into(), at: None }
}

fn at(e: &Event) -> Option<String> {
    e.location.map(|l| format!("{}:{}", l.file(), l.line()))
}

fn synchronisation(p: &Profile, steps: usize, gpu: bool) -> Item {
    let name = "synchronisation";
    if !gpu {
        return not_applicable(name);
    }
    let syncs: Vec<&Event> = p.syncs().collect();
    if syncs.is_empty() {
        return Item { name, status: Status::Passed, evidence: "no implicit synchronisation in the step".into(), at: None };
    }
    // Grouped by call site, the costliest first.
    let mut sites: Vec<(Option<String>, String, usize, f64)> = Vec::new();
    for e in &syncs {
        let site = at(e);
        match sites.iter_mut().find(|s| s.0 == site) {
            Some(s) => {
                s.2 += 1;
                s.3 += e.host_us;
            }
            None => sites.push((site, e.name.clone(), 1, e.host_us)),
        }
    }
    sites.sort_by(|a, b| b.3.total_cmp(&a.3));
    let list: Vec<String> = sites
        .iter()
        .map(|(site, what, n, us)| format!("{what} at {} ({:.1} per step, host waited {:.0} us per step)", site.as_deref().unwrap_or("an unknown site"), *n as f64 / steps as f64, us / steps as f64))
        .collect();
    Item {
        name,
        status: Status::Failed,
        evidence: format!("{:.1} synchronisations per step: {}; keep values on the device, or read them every N steps", syncs.len() as f64 / steps as f64, list.join("; ")),
        at: sites[0].0.clone(),
    }
}

/// The device's busy intervals, merged, on the host's timeline.
fn busy_intervals(p: &Profile) -> Vec<(f64, f64)> {
    let mut iv: Vec<(f64, f64)> = p
        .events()
        .iter()
        .filter(|e| e.device.is_cuda() && matches!(e.kind, EventKind::Kernel | EventKind::Graph | EventKind::Copy(_) | EventKind::Memset))
        .filter_map(|e| Some((e.device_start_us?, e.device_start_us? + e.device_us?)))
        .collect();
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for (s, e) in iv {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

fn gpu_busy(p: &Profile, busy: &[(f64, f64)], steps: usize, gpu: bool) -> Item {
    let name = "gpu_busy";
    if !gpu {
        return not_applicable(name);
    }
    let (Some(first), Some(last)) = (busy.first(), busy.last()) else {
        return Item { name, status: Status::NotApplicable, evidence: "no device times were recorded".into(), at: None };
    };
    let span = last.1 - first.0;
    let on: f64 = busy.iter().map(|(s, e)| e - s).sum();
    let syncs: Vec<&Event> = p.syncs().collect();
    let (mut waiting, mut host_bound) = (0.0, 0.0);
    let mut largest: Option<(f64, f64)> = None;
    for w in busy.windows(2) {
        let (gap_start, gap_end) = (w[0].1, w[1].0);
        let gap = gap_end - gap_start;
        // A gap the host spent in a synchronisation is a wait on it; the rest, host-bound.
        if syncs.iter().any(|s| s.start_us < gap_end && s.start_us + s.host_us > gap_start) {
            waiting += gap;
        } else {
            host_bound += gap;
        }
        if largest.is_none_or(|l| gap > l.1 - l.0) {
            largest = Some((gap_start, gap_end));
        }
    }
    let fraction = on / span.max(1e-9);
    let next_launch = largest.and_then(|(_, end)| {
        p.events().iter().filter(|e| e.device_start_us.is_some_and(|d| d >= end - 1e-3)).min_by(|a, b| a.device_start_us.unwrap_or(0.0).total_cmp(&b.device_start_us.unwrap_or(0.0)))
    });
    let mut evidence = format!(
        "the GPU was busy {:.0}% of {:.0} us per step; idle {:.0} us per step waiting on synchronisations, {:.0} us host-bound",
        100.0 * fraction,
        span / steps as f64,
        waiting / steps as f64,
        host_bound / steps as f64
    );
    if let (Some((s, e)), Some(n)) = (largest, next_launch) {
        evidence.push_str(&format!("; the largest gap ({:.0} us) ends at {}", e - s, n.name));
    }
    let status = if fraction >= 0.85 { Status::Passed } else { Status::Failed };
    let at = largest.and_then(|(s, e)| syncs.iter().find(|x| x.start_us < e && x.start_us + x.host_us > s).and_then(|x| at(x)));
    Item { name, status, evidence, at }
}

fn compilation(p: &Profile, steps: usize, before: &crate::compile::Activity, after: &crate::compile::Activity) -> Item {
    let name = "compilation";
    let calls = after.calls - before.calls;
    let traces = &after.traces[before.traces.len()..];
    let eager = after.eager - before.eager;
    let kernels = p.kernel_count() as f64 / steps as f64;
    if calls == 0 {
        return Item { name, status: Status::Failed, evidence: format!("the step runs eagerly ({kernels:.0} kernels per step): compile it with kiln::compile::compile"), at: None };
    }
    if eager > 0 {
        return Item { name, status: Status::Failed, evidence: format!("{eager} compiled calls ran eagerly: the function reached its recompile limit (mark changing sizes dynamic, or pad them to a few buckets)"), at: None };
    }
    if !traces.is_empty() {
        let mut reasons: Vec<&str> = traces.iter().map(String::as_str).collect();
        reasons.dedup();
        return Item {
            name,
            status: Status::Failed,
            evidence: format!("{} traces in {steps} steps after warm-up (recompiles: {}); keep shapes stable, mark them dynamic, or pad them to a few buckets", traces.len(), reasons.join("; ")),
            at: None,
        };
    }
    Item { name, status: Status::Passed, evidence: format!("compiled, no recompiles ({calls} calls, {kernels:.0} kernels per step)"), at: None }
}

fn precision(p: &Profile, gpu: bool) -> Item {
    let name = "precision";
    if !gpu {
        return not_applicable(name);
    }
    // Library calls are named after their dtype (`cublas_gemm_float32`, ...).
    let f32_name = crate::DType::F32.torch_name();
    let ks: Vec<&Event> = p.kernels().filter(|e| e.device.is_cuda() && (e.name.starts_with("cublas") || e.name.starts_with("cudnn")) && e.name.ends_with(f32_name)).collect();
    let (n32, us32): (usize, f64) = (ks.len(), ks.iter().filter_map(|e| e.device_us).sum());
    let total: f64 = p.kernels().filter_map(|e| e.device_us).sum();
    if n32 == 0 {
        return Item { name, status: Status::Passed, evidence: "no F32 products or convolutions".into(), at: None };
    }
    if crate::cuda::allow_tf32() {
        return Item { name, status: Status::Passed, evidence: format!("{n32} F32 products or convolutions run on TF32 tensor cores (allow_tf32)"), at: None };
    }
    // Tensor cores came with compute capability 7.0 (`sm_70`).
    let tensor_cores = ks.iter().filter_map(|e| match e.device {
        Device::Cuda(n) => crate::backend::cuda::device(n).ok(),
        Device::Cpu => None,
    })
    .any(|d| d.arch.trim_start_matches("sm_").parse::<u32>().is_ok_and(|cc| cc >= 70));
    if !tensor_cores {
        return Item { name, status: Status::Passed, evidence: format!("{n32} F32 products or convolutions on a GPU without tensor cores"), at: None };
    }
    // Inside a replayed CUDA graph the kernels have no device times of their own.
    let share = if total > 0.0 { format!(" take {:.0}% of the device time", 100.0 * us32 / total) } else { " run inside a CUDA graph".into() };
    Item {
        name,
        status: Status::Failed,
        evidence: format!("{n32} F32 products or convolutions{share}; this GPU has tensor cores: run the step under amp::autocast(&dev, DType::BF16, ..)"),
        at: None,
    }
}

fn launches(p: &Profile, busy: &[(f64, f64)], steps: usize, gpu: bool) -> Item {
    let name = "launches";
    if !gpu {
        return not_applicable(name);
    }
    let replays = p.events().iter().filter(|e| e.kind == EventKind::Graph).count();
    let launched: Vec<&Event> = p.kernels().filter(|e| e.device.is_cuda() && e.device_us.is_some()).collect();
    let short = launched.iter().filter(|e| e.device_us.is_some_and(|d| d < e.host_us)).count();
    let host: f64 = p.events().iter().filter(|e| e.device.is_cuda() && matches!(e.kind, EventKind::Kernel | EventKind::Graph)).map(|e| e.host_us).sum();
    let device: f64 = busy.iter().map(|(s, e)| e - s).sum();
    let per = |x: f64| x / steps as f64;
    if replays > 0 && launched.is_empty() {
        return Item { name, status: Status::Passed, evidence: format!("the step replays as a CUDA graph ({} replays per step, {:.0} us of device work)", replays / steps, per(device)), at: None };
    }
    let host_bound = host > device;
    let evidence = format!(
        "{:.0} launches per step, {:.0} shorter than their launch; {:.0} us of launch time for {:.0} us of device work per step",
        per(launched.len() as f64),
        per(short as f64),
        per(host),
        per(device)
    );
    if host_bound {
        return Item { name, status: Status::Failed, evidence: format!("{evidence}: the step is bound by the host; compile it with Mode::ReduceOverhead to replay it as one CUDA graph"), at: None };
    }
    Item { name, status: Status::Passed, evidence, at: None }
}

fn loader(p: &Profile, steps: usize, gpu: bool, before: &crate::data::LoaderActivity, after: &crate::data::LoaderActivity) -> Item {
    let name = "loader";
    if !gpu {
        return not_applicable(name);
    }
    let uploads: Vec<&Event> = p.events().iter().filter(|e| e.kind == EventKind::Copy(profiler::CopyKind::HostToDevice)).collect();
    let (batches, pinned) = (after.batches - before.batches, after.pinned - before.pinned);
    let mb = uploads.iter().map(|e| e.bytes).sum::<usize>() as f64 / 1e6 / steps as f64;
    // Without a loader, copies of a few values (a scalar made on the host) are no input pipeline.
    if batches == 0 && mb < 1.0 {
        return Item { name, status: Status::NotApplicable, evidence: format!("no batches from a loader, and {:.1} KB of host-to-device copies per step", mb * 1e3), at: None };
    }
    // Blocking copies run on the device's own stream; `to_device_async` ones on its copy stream.
    let kernel_streams: std::collections::HashSet<u64> = p.kernels().filter_map(|e| e.stream).collect();
    let blocking: Vec<&&Event> = uploads.iter().filter(|e| e.stream.is_some_and(|s| kernel_streams.contains(&s))).collect();
    let overlapped = uploads.iter().filter(|e| {
        let (Some(s), Some(d)) = (e.device_start_us, e.device_us) else { return false };
        p.kernels().any(|k| k.device_start_us.zip(k.device_us).is_some_and(|(ks, kd)| ks < s + d && ks + kd > s))
    });
    let mut evidence = format!(
        "{:.1} batches per step ({pinned} of {batches} pinned, {} loader workers); {:.1} host-to-device copies per step ({mb:.2} MB), {} blocking, {} overlapping kernels",
        batches as f64 / steps as f64,
        after.workers,
        uploads.len() as f64 / steps as f64,
        blocking.len(),
        overlapped.count()
    );
    let failed = !blocking.is_empty() || pinned < batches;
    if failed {
        evidence.push_str(": pin the batches (DataLoader::pin_memory(true)) and copy them with to_device_async, so that copies overlap compute");
    }
    Item { name, status: if failed { Status::Failed } else { Status::Passed }, evidence, at: None }
}
