//! `kiln::doctor`: the production checklist checked on the user's own training step. A few steps
//! run under the profiler, and each item of the checklist is reported as passed, failed or not
//! applicable, with its evidence and, where there is one, the line of code to look at:
//!
//! - `synchronisation`: implicit host synchronisations in the step (`.item()`, `to_vec`, a
//!   host copy), each with its call site and how long the host waited;
//! - `gpu_busy`: the fraction of the step the GPU was busy, the idle time split into waits on
//!   synchronisations, waits on copies and host-bound gaps, the costliest gaps named by the
//!   work around them and the lines that queued it;
//! - `compilation`: whether the step runs compiled, and every recompile with its reason;
//! - `precision`: F32 products on a GPU with tensor cores (autocast to BF16 pays there), F16
//!   products in a step with backward and no gradient scaler;
//! - `launches`: kernels shorter than their launch, and whether the step is bound by the host
//!   (then a CUDA graph, `Mode::ReduceOverhead`, pays);
//! - `loader`: whether the step's batches were pinned and their copies asynchronous (and so
//!   free to overlap compute), with the loader's workers.
//!
//! Device work carries the line of the outermost call into kiln that queued it (the entry
//! points are `#[track_caller]`). The idle gaps are kept in the report and marked in its Chrome
//! trace.
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
    /// Every stretch the GPU sat idle between the steps' work, in order.
    pub gaps: Vec<Gap>,
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

    /// The checked steps' Chrome trace, with each idle gap marked on an "idle gaps" track of its
    /// device: what the device waited on, and the work before and after it with their lines.
    pub fn chrome_trace(&self) -> serde_json::Value {
        let marks: Vec<profiler::Mark> = self
            .gaps
            .iter()
            .map(|g| profiler::Mark {
                device: g.device,
                name: format!("idle: {}", g.kind.words()),
                start_us: g.start_us,
                us: g.us,
                args: json!({"idle us": g.idle_us(), "other threads' kernels us": g.other_us, "before": g.before, "after": g.after, "waited on": g.waited_on, "look at": g.at}),
            })
            .collect();
        self.profile.chrome_trace_marked(&marks, "idle gaps (kiln doctor)")
    }

    /// Writes [`Report::chrome_trace`] for chrome://tracing or ui.perfetto.dev.
    pub fn export_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        profiler::write_trace(path.as_ref(), &self.chrome_trace())
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
pub fn check(step: impl FnMut() -> Result<()>) -> Result<Report> {
    check_with(DoctorOptions::default(), step)
}

/// Runs `opts.warmup` steps, then `opts.steps` under the profiler, and judges them.
///
/// On a GPU the steps' kernels are timed by CUPTI: CUDA events around each launch read a
/// kernel of a few microseconds as several times longer, and their times include other
/// threads' kernels queued on the same stream, while CUPTI's records are the kernels' own and
/// say which launch ran them. Where CUPTI cannot be used the events' times are judged, and
/// the evidence says so. CUPTI stays attached to the process afterwards, collecting nothing
/// (see [`profiler::set_cupti_detach`]).
pub fn check_with(opts: DoctorOptions, mut step: impl FnMut() -> Result<()>) -> Result<Report> {
    let steps = opts.steps.max(1);
    let (backwards, scaled) = (crate::autograd::backward_calls(), crate::optim::scaled_losses());
    for _ in 0..opts.warmup {
        step()?;
    }
    let run = profiled(&mut step, steps)?;
    let used_backward = crate::autograd::backward_calls() > backwards;
    let used_scaler = crate::optim::scaled_losses() > scaled;
    let p = &run.profile;
    let gpu = p.events().iter().any(|e| e.device.is_cuda());
    let cupti = p.cupti();
    let timeline = Timeline::new(p, cupti.is_ok());
    let gaps = if gpu { idle_gaps(p, &timeline) } else { Vec::new() };
    // Other threads' work: the launches they queued while the steps ran, and the kernels of
    // theirs CUPTI saw.
    let (foreign, theirs) = (p.foreign_work(), p.other_kernels().len());
    let shared = match &cupti {
        Ok(()) if foreign + theirs > 0 => Some(format!("timed by CUPTI, which left out the {theirs} kernels of other threads that shared the device ({foreign} launches)")),
        Ok(()) => None,
        Err(why) if foreign > 0 => Some(format!("timed by CUDA events, which include the {foreign} launches of other threads that shared the device, since CUPTI could not be used: {why}")),
        Err(why) => Some(format!("timed by CUDA events, which read kernels of a few microseconds as longer, since CUPTI could not be used: {why}")),
    };
    let mut items = vec![
        synchronisation(p, steps, gpu),
        gpu_busy(&timeline, &gaps, steps, gpu),
        compilation(p, steps, &run.compiled.0, &run.compiled.1),
        precision(p, &timeline, gpu, used_backward, used_scaler),
        launches(p, &timeline, steps, gpu),
        loader(p, steps, gpu, &run.loaded.0, &run.loaded.1),
    ];
    if let Some(note) = shared {
        for i in items.iter_mut().filter(|i| ["gpu_busy", "launches"].contains(&i.name) && i.status != Status::NotApplicable) {
            i.evidence.push_str(&format!(" ({note})"));
        }
    }
    Ok(Report { items, steps, gaps, profile: run.profile })
}

/// One profiled run of the steps, with the compiler's and the loader's activity around it.
struct Run {
    profile: Profile,
    compiled: (crate::compile::Activity, crate::compile::Activity),
    loaded: (crate::data::LoaderActivity, crate::data::LoaderActivity),
}

/// The steps under the profiler, their kernels timed by CUPTI where the warm-up opened a GPU.
fn profiled(step: &mut impl FnMut() -> Result<()>, steps: usize) -> Result<Run> {
    let devices = cuda_devices_in_use();
    let options = ProfileOptions::new().device_kernels(!devices.is_empty());
    for d in &devices {
        crate::cuda::synchronize(d)?;
    }
    let (compiled, loaded) = (crate::compile::activity(), crate::data::loader_activity());
    let (_, profile) = profiler::profile_with(options, || (0..steps).try_for_each(|_| step()))?;
    let run = Run { profile, compiled: (compiled, crate::compile::activity()), loaded: (loaded, crate::data::loader_activity()) };
    for d in &devices {
        crate::cuda::synchronize(d)?;
    }
    Ok(run)
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

/// A launch's name with the line that queued it, where that is known.
fn named(e: &Event) -> String {
    match at(e) {
        Some(site) => format!("{} at {site}", e.name),
        None => e.name.clone(),
    }
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

/// When the device worked on this thread's steps, on the host's timeline.
struct Timeline {
    /// Kernels timed by CUPTI, which reports this thread's own, rather than by events on the
    /// stream, whose times include other threads' kernels queued between.
    cupti: bool,
    busy: Vec<Busy>,
    /// When other threads' kernels ran (CUPTI), sorted and merged into disjoint intervals.
    others: Vec<(f64, f64)>,
}

/// A stretch the device was busy, with the indices of the events whose work began and ended it.
#[derive(Clone, Copy, Debug)]
struct Busy {
    start: f64,
    end: f64,
    first: usize,
    last: usize,
}

impl Timeline {
    fn new(p: &Profile, cupti: bool) -> Timeline {
        let mut pieces: Vec<(f64, f64, usize)> = Vec::new();
        for (i, e) in p.events().iter().enumerate().filter(|(_, e)| e.device.is_cuda()) {
            match e.kind {
                EventKind::Kernel | EventKind::Graph if cupti => pieces.extend(e.device_kernels.iter().map(|k| (k.device_start_us, k.device_start_us + k.device_us, i))),
                EventKind::Kernel | EventKind::Graph | EventKind::Copy(_) | EventKind::Memset => {
                    if let (Some(s), Some(d)) = (e.device_start_us, e.device_us) {
                        pieces.push((s, s + d, i));
                    }
                }
                _ => {}
            }
        }
        pieces.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut busy: Vec<Busy> = Vec::new();
        for (start, end, i) in pieces {
            match busy.last_mut() {
                Some(b) if start <= b.end => {
                    if end > b.end {
                        (b.end, b.last) = (end, i);
                    }
                }
                _ => busy.push(Busy { start, end, first: i, last: i }),
            }
        }
        let mut others = p.other_kernels().to_vec();
        others.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut merged: Vec<(f64, f64)> = Vec::new();
        for (start, end) in others {
            match merged.last_mut() {
                Some(m) if start <= m.1 => m.1 = m.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        Timeline { cupti, busy, others: merged }
    }

    /// How much of `[start, end]` other threads' kernels covered.
    fn others_within(&self, start: f64, end: f64) -> f64 {
        let first = self.others.partition_point(|&(_, e)| e <= start);
        self.others[first..].iter().take_while(|&&(s, _)| s < end).fold(0.0, |sum, &(s, e)| sum + e.min(end) - s.max(start))
    }

    /// The device time of one launch: its own kernels' with CUPTI, else its events'.
    fn device_us(&self, e: &Event) -> Option<f64> {
        if self.cupti && matches!(e.kind, EventKind::Kernel | EventKind::Graph) {
            (!e.device_kernels.is_empty()).then(|| e.device_kernels.iter().map(|k| k.device_us).sum())
        } else {
            e.device_us
        }
    }

    fn busy_us(&self) -> f64 {
        self.busy.iter().map(|b| b.end - b.start).sum()
    }
}

/// What the device waited on while it was idle (HTA's split of idle time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// The host was in a synchronisation: it waited for the device, then issued late.
    Synchronisation,
    /// The host was staging or waiting on a copy.
    Copy,
    /// The host was busy with other work between two launches.
    HostBound,
}

impl Idle {
    fn words(self) -> &'static str {
        match self {
            Idle::Synchronisation => "waiting on a synchronisation",
            Idle::Copy => "waiting on a copy",
            Idle::HostBound => "host-bound",
        }
    }
}

/// A stretch the device was idle between two pieces of the step's work.
#[derive(Clone, Debug)]
pub struct Gap {
    pub kind: Idle,
    pub device: Device,
    pub start_us: f64,
    pub us: f64,
    /// Of `us`, the time the device ran other threads' kernels (seen by CUPTI): not idle, but
    /// not this step's work either.
    pub other_us: f64,
    /// The work that ran before the gap and the work that ended it, each named with the line
    /// that queued it where known (`cublas_gemm_float32 at src/train.rs:41`).
    pub before: String,
    pub after: String,
    /// The synchronisation or copy the host was in, with its call site.
    pub waited_on: Option<String>,
    /// The line to look at: the synchronisation's or copy's for a wait, else the call that
    /// preceded the gap (or, where that is not known, the one that ended it).
    pub at: Option<String>,
}

impl Gap {
    /// The part of the gap the device was idle: less what other threads' kernels filled.
    pub fn idle_us(&self) -> f64 {
        self.us - self.other_us
    }
}

fn idle_gaps(p: &Profile, t: &Timeline) -> Vec<Gap> {
    let events = p.events();
    let syncs: Vec<&Event> = p.syncs().collect();
    let copies: Vec<&Event> = events.iter().filter(|e| matches!(e.kind, EventKind::Copy(_))).collect();
    t.busy
        .windows(2)
        .map(|w| {
            let (start, end) = (w[0].end, w[1].start);
            let during = |x: &&&Event| x.start_us < end && x.start_us + x.host_us > start;
            let (a, b) = (&events[w[0].last], &events[w[1].first]);
            let (kind, waited) = match (syncs.iter().find(during), copies.iter().find(during)) {
                (Some(s), _) => (Idle::Synchronisation, Some(*s)),
                (None, Some(c)) => (Idle::Copy, Some(*c)),
                (None, None) if matches!(b.kind, EventKind::Copy(_)) => (Idle::Copy, Some(b)),
                _ => (Idle::HostBound, None),
            };
            let site = match waited {
                Some(w) => at(w),
                None => at(a).or_else(|| at(b)),
            };
            let other_us = t.others_within(start, end);
            Gap { kind, device: b.device, start_us: start, us: end - start, other_us, before: named(a), after: named(b), waited_on: waited.map(named), at: site }
        })
        .collect()
}

fn gpu_busy(t: &Timeline, gaps: &[Gap], steps: usize, gpu: bool) -> Item {
    let name = "gpu_busy";
    if !gpu {
        return not_applicable(name);
    }
    let (Some(first), Some(last)) = (t.busy.first(), t.busy.last()) else {
        return Item { name, status: Status::NotApplicable, evidence: "no device times were recorded".into(), at: None };
    };
    let span = last.end - first.start;
    let others: f64 = gaps.iter().map(|g| g.other_us).sum();
    let fraction = (t.busy_us() + others) / span.max(1e-9);
    let per = |x: f64| x / steps as f64;
    let idle = |k: Idle| gaps.iter().filter(|g| g.kind == k).map(Gap::idle_us).sum::<f64>();
    let mut evidence = format!(
        "the GPU was busy {:.0}% of {:.0} us per step; idle {:.0} us per step waiting on synchronisations, {:.0} us on copies, {:.0} us host-bound",
        100.0 * fraction,
        per(span),
        per(idle(Idle::Synchronisation)),
        per(idle(Idle::Copy)),
        per(idle(Idle::HostBound))
    );
    if others > 0.0 {
        evidence.push_str(&format!("; {:.0} us per step between the step's kernels ran other threads' kernels", per(others)));
    }
    // The same gap recurs every step: grouped by kind and the work around it, the costliest
    // (in idle time) first.
    let mut groups: Vec<(&Gap, f64)> = Vec::new();
    for g in gaps {
        let idle = g.idle_us();
        match groups.iter_mut().find(|(h, _)| h.kind == g.kind && h.before == g.before && h.after == g.after && h.waited_on == g.waited_on) {
            Some(x) => x.1 += idle,
            None => groups.push((g, idle)),
        }
    }
    groups.sort_by(|a, b| b.1.total_cmp(&a.1));
    let large: Vec<String> = groups
        .iter()
        .take(3)
        .filter(|(_, us)| *us >= 0.01 * span)
        .map(|(g, us)| match &g.waited_on {
            Some(w) => format!("{:.0} us per step {} ({w}), before {}", per(*us), g.kind.words(), g.after),
            None => format!("{:.0} us per step {} after {}, until {}", per(*us), g.kind.words(), g.before, g.after),
        })
        .collect();
    if !large.is_empty() {
        evidence.push_str(&format!("; the largest gaps: {}", large.join("; ")));
    }
    let status = if fraction >= 0.85 { Status::Passed } else { Status::Failed };
    Item { name, status, evidence, at: groups.first().and_then(|(g, _)| g.at.clone()) }
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
        return Item { name, status: Status::Failed, evidence: format!("{eager} compiled calls ran eagerly: the function reached its recompile limit, recompiling for every new shape (mark changing sizes dynamic, or pad them to a few buckets)"), at: None };
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

/// The library calls (cuBLAS products, cuDNN convolutions and attention) in `dtype`: they are
/// named after it (`cublas_gemm_float32`, `cudnn_conv_fwd_float16`).
fn products(p: &Profile, dtype: crate::DType) -> Vec<&Event> {
    let suffix = format!("_{}", dtype.torch_name());
    p.kernels().filter(|e| e.device.is_cuda() && (e.name.starts_with("cublas") || e.name.starts_with("cudnn")) && e.name.ends_with(&suffix)).collect()
}

fn precision(p: &Profile, t: &Timeline, gpu: bool, used_backward: bool, used_scaler: bool) -> Item {
    let name = "precision";
    if !gpu {
        return not_applicable(name);
    }
    let passed = |evidence: String| Item { name, status: Status::Passed, evidence, at: None };
    let f32s = products(p, crate::DType::F32);
    let f16s = products(p, crate::DType::F16);
    // F16 has 5 exponent bits: gradients below 6e-8 flush to zero unless the loss is scaled.
    if !f16s.is_empty() && used_backward && !used_scaler {
        return Item {
            name,
            status: Status::Failed,
            evidence: format!("{} F16 products or convolutions in a step with backward and no gradient scaler: small gradients underflow F16; scale the loss with optim::GradScaler, or autocast to BF16, which needs none", f16s.len()),
            at: f16s.iter().find_map(|e| at(e)),
        };
    }
    let f16_note = match (f16s.len(), used_backward) {
        (0, _) => String::new(),
        (n, true) => format!("; {n} F16 products or convolutions, with a gradient scaler"),
        (n, false) => format!("; {n} F16 products or convolutions (no backward)"),
    };
    let n32 = f32s.len();
    if n32 == 0 {
        return passed(format!("no F32 products or convolutions{f16_note}"));
    }
    if crate::cuda::allow_tf32() {
        return passed(format!("{n32} F32 products or convolutions run on TF32 tensor cores (allow_tf32){f16_note}"));
    }
    // Tensor cores came with compute capability 7.0 (`sm_70`).
    let tensor_cores = f32s
        .iter()
        .filter_map(|e| match e.device {
            Device::Cuda(n) => crate::backend::cuda::device(n).ok(),
            Device::Cpu => None,
        })
        .any(|d| d.arch.trim_start_matches("sm_").parse::<u32>().is_ok_and(|cc| cc >= 70));
    if !tensor_cores {
        return passed(format!("{n32} F32 products or convolutions on a GPU without tensor cores{f16_note}"));
    }
    let us32: f64 = f32s.iter().filter_map(|e| t.device_us(e)).sum();
    let total: f64 = p.kernels().filter_map(|e| t.device_us(e)).sum();
    // Inside a replayed CUDA graph the kernels have no device times of their own.
    let share = if total > 0.0 { format!(" take {:.0}% of the device time", 100.0 * us32 / total) } else { " run inside a CUDA graph".into() };
    Item {
        name,
        status: Status::Failed,
        evidence: format!("{n32} F32 products or convolutions{share}; this GPU has tensor cores: run the step under amp::autocast(&dev, DType::BF16, ..)"),
        at: f32s.iter().find_map(|e| at(e)),
    }
}

fn launches(p: &Profile, t: &Timeline, steps: usize, gpu: bool) -> Item {
    let name = "launches";
    if !gpu {
        return not_applicable(name);
    }
    let replays = p.events().iter().filter(|e| e.kind == EventKind::Graph).count();
    let launched: Vec<(&Event, f64)> = p.kernels().filter(|e| e.device.is_cuda()).filter_map(|e| Some((e, t.device_us(e)?))).collect();
    let short = launched.iter().filter(|(e, d)| *d < e.host_us).count();
    let host: f64 = p.events().iter().filter(|e| e.device.is_cuda() && matches!(e.kind, EventKind::Kernel | EventKind::Graph)).map(|e| e.host_us).sum();
    let device = t.busy_us();
    let per = |x: f64| x / steps as f64;
    if replays > 0 && launched.is_empty() {
        return Item { name, status: Status::Passed, evidence: format!("the step replays as a CUDA graph ({} replays per step, {:.0} us of device work)", replays / steps, per(device)), at: None };
    }
    let evidence = format!(
        "{:.0} launches per step, {:.0} shorter than their launch; {:.0} us of launch time for {:.0} us of device work per step",
        per(launched.len() as f64),
        per(short as f64),
        per(host),
        per(device)
    );
    if host > device {
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
