//! The profiler (`torch.profiler`): what a piece of code ran on the device, and what it cost.
//!
//! ```
//! use kiln::prelude::*;
//! # fn main() -> kiln::Result<()> {
//! let dev = Device::cuda_if_available(0);
//! let x = Tensor::randn(&[1000], DType::F32, &dev)?;
//! let f = |x: &Tensor| x.relu();
//! let prof = profiler::profile(|| f(&x))?;
//! println!("{}", prof.key_averages().table(SortBy::DeviceTimeTotal, 10));
//! assert_eq!(prof.kernel_count(), 1);
//! prof.export_chrome_trace(std::env::temp_dir().join("kiln-doc-trace.json"))?;
//! # Ok(())
//! # }
//! ```
//!
//! While `profile` runs its closure, the calling thread records every kernel launch (name,
//! grid, block, stream; device time from CUDA events around it, read with one synchronisation
//! at the end), cuBLAS call, host↔device copy, memset, synchronisation (with its call site) and
//! device allocation (with the bytes in use after it). A replayed CUDA graph shows the kernels
//! it holds by name and the replay itself (`cuda_graph_replay`), timed as a whole. Asked for
//! (`profile_with(ProfileOptions::new().device_kernels(true), ..)`) and where CUPTI is
//! installed, each device launch also lists the kernels the GPU ran for it with their own
//! device times (`Event::device_kernels`, `Profile::device_kernels`): a library call's kernels,
//! every kernel inside a graph replay. On the CPU, each primitive op that runs
//! a CPU kernel is recorded as a kernel named after the op, its device time being its host time.
//! Views (reshape, permute, expand, slice) are no kernels. Other threads are not recorded.
//! When nothing is profiled, each hook costs one relaxed atomic load.

mod cupti;
pub(crate) mod record;
mod sync;
mod table;
mod trace;

pub(crate) use record::{blas, call_site, copy, cpu_op, cudnn, graph_replay, kernel, memory, memset};
pub(crate) use sync::sync;
pub(crate) use trace::Mark;
pub use sync::{set_sync_debug_mode, sync_debug_mode, with_sync_debug_mode, SyncDebug};
pub use cupti::DeviceKernel;
pub use table::{KernelStats, KeyAverages, SortBy};

use crate::{Device, Error, Result};
use std::panic::Location;

/// Runs `f` and returns what it did on the devices; `f`'s value is dropped after recording
/// stopped (see [`profile_value`] to keep it).
pub fn profile<T>(f: impl FnOnce() -> Result<T>) -> Result<Profile> {
    profile_value(f).map(|(_, p)| p)
}

/// Runs `f` and returns its value with what it did on the devices. An error of `f` is returned
/// as is (the recording is dropped).
pub fn profile_value<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Profile)> {
    profile_with(ProfileOptions::new(), f)
}

/// What a profile collects beyond the default.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProfileOptions {
    device_kernels: bool,
}

impl ProfileOptions {
    pub fn new() -> Self {
        Self::default()
    }
    /// Also list the kernels the GPU ran for each launch, with their own device times
    /// (`Event::device_kernels`), through CUPTI. Collection is on only while such a profile
    /// runs, but CUPTI stays attached to the process afterwards (see [`set_cupti_detach`]).
    pub fn device_kernels(mut self, on: bool) -> Self {
        self.device_kernels = on;
        self
    }
}

/// Whether the last profile collecting device kernels also detaches CUPTI (`cuptiFinalize`),
/// so that later launches cost what they did before it attached (an attached CUPTI, collecting
/// or not, adds host time to every launch of the process). Off by default: detaching while
/// other threads work on the GPU made their kernels fail (illegal addresses, launch failures)
/// on the H200. Turn it on only where no other thread uses the GPU meanwhile, as `kiln bench`
/// does between its rows.
pub fn set_cupti_detach(on: bool) {
    cupti::set_detach(on);
}

/// [`profile_value`] with options.
pub fn profile_with<T>(options: ProfileOptions, f: impl FnOnce() -> Result<T>) -> Result<(T, Profile)> {
    let rec = record::Recording::start(options.device_kernels)?;
    let value = f()?;
    let record::Recorded { events, wall_us, cupti_missing, foreign_work, other_kernels } = rec.finish()?;
    Ok((value, Profile { events, wall_us, cupti_missing, foreign_work, other_kernels }))
}

/// What was recorded, in the order the host issued it.
#[derive(Clone, Debug)]
pub struct Profile {
    events: Vec<Event>,
    wall_us: f64,
    cupti_missing: Option<String>,
    foreign_work: usize,
    other_kernels: Vec<(f64, f64)>,
}

/// One recorded thing. Times are µs; `start_us` counts from the start of `profile`.
#[derive(Clone, Debug)]
pub struct Event {
    pub kind: EventKind,
    /// The kernel's name (as in its generated source; `cublas_gemm_<dtype>` for a library
    /// product, `cublas_gemm_bias[_relu]_<dtype>` with a fused epilogue; the op's name for a CPU
    /// kernel), `memcpy HtoD`/`DtoH`/`DtoD`, `memset`, `alloc`/`free`, or what a
    /// synchronisation was for.
    pub name: String,
    pub device: Device,
    /// When the host began it.
    pub start_us: f64,
    /// Host time: launching or queueing on a GPU, running on the CPU, waiting for a sync.
    pub host_us: f64,
    /// Time on the device, from CUDA events around it (the host time for a CPU kernel).
    pub device_us: Option<f64>,
    /// When the device began it, on the host's timeline (anchored at the device's first
    /// recorded point).
    pub device_start_us: Option<f64>,
    pub grid: Option<(u32, u32, u32)>,
    pub block: Option<(u32, u32, u32)>,
    /// The CUDA stream's handle (0 is the default stream).
    pub stream: Option<u64>,
    /// Bytes copied, set or (de)allocated.
    pub bytes: usize,
    /// After an allocation or free: the device's bytes allocated.
    pub bytes_in_use: Option<usize>,
    /// The line of the caller's code that issued it: a synchronisation's call site; for device
    /// work, the call into kiln that queued it (an op, `backward`, an optimiser's `step`, a
    /// compiled function's `call`, a copy), where kiln's entry points know it.
    pub location: Option<&'static Location<'static>>,
    /// The kernels the GPU ran for this launch, as CUPTI saw them (empty without CUPTI): one
    /// for a generated kernel, the library's own for a cuBLAS or cuDNN call, every kernel of a
    /// replayed CUDA graph.
    pub device_kernels: Vec<DeviceKernel>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Kernel,
    /// A CUDA graph replayed: one launch, timed on the device as a whole (the kernels it holds
    /// are `Kernel` events without device times of their own).
    Graph,
    Copy(CopyKind),
    Memset,
    Sync,
    Alloc,
    Free,
}

impl EventKind {
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Kernel => "kernel",
            EventKind::Graph => "graph",
            EventKind::Copy(_) => "copy",
            EventKind::Memset => "memset",
            EventKind::Sync => "sync",
            EventKind::Alloc => "alloc",
            EventKind::Free => "free",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

impl CopyKind {
    pub fn name(self) -> &'static str {
        match self {
            CopyKind::HostToDevice => "memcpy HtoD",
            CopyKind::DeviceToHost => "memcpy DtoH",
            CopyKind::DeviceToDevice => "memcpy DtoD",
        }
    }
}

impl Profile {
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Device work other threads queued, while this profile recorded, on the devices it used.
    /// They share the devices' streams, so their kernels may run between this thread's and
    /// inside its device times (the kernels CUPTI reports, [`Event::device_kernels`], are this
    /// thread's own).
    pub fn foreign_work(&self) -> usize {
        self.foreign_work
    }

    /// When kernels of other threads ran during the profile (start and end, µs), as CUPTI saw
    /// them; empty without CUPTI.
    pub(crate) fn other_kernels(&self) -> &[(f64, f64)] {
        &self.other_kernels
    }

    /// Host time of the whole profiled closure, µs.
    pub fn wall_us(&self) -> f64 {
        self.wall_us
    }

    pub fn kernels(&self) -> impl Iterator<Item = &Event> {
        self.events.iter().filter(|e| e.kind == EventKind::Kernel)
    }

    /// Kernels launched (cuBLAS calls count one each; copies and memsets are not kernels).
    pub fn kernel_count(&self) -> usize {
        self.kernels().count()
    }

    /// Every kernel the GPU ran for the recorded launches, in the order they started on the
    /// device, as CUPTI reported them (empty where CUPTI was not used: see [`Profile::cupti`]).
    pub fn device_kernels(&self) -> Vec<&DeviceKernel> {
        let mut ks: Vec<&DeviceKernel> = self.events.iter().flat_map(|e| &e.device_kernels).collect();
        ks.sort_by(|a, b| a.device_start_us.total_cmp(&b.device_start_us));
        ks
    }

    /// The kernels the GPU ran (CUPTI), grouped by name: library kernels under their own
    /// names, graph replays broken into their kernels.
    pub fn device_key_averages(&self) -> KeyAverages {
        KeyAverages::of_device_kernels(&self.device_kernels())
    }

    /// Ok when CUPTI reported the device's kernels (or no device work was recorded); else why
    /// not (not asked for, the library missing, or CUPTI refusing to collect).
    pub fn cupti(&self) -> std::result::Result<(), &str> {
        self.cupti_missing.as_deref().map_or(Ok(()), Err)
    }

    /// The kernels' names in launch order.
    pub fn kernel_names(&self) -> Vec<&str> {
        self.kernels().map(|e| e.name.as_str()).collect()
    }

    pub fn key_averages(&self) -> KeyAverages {
        KeyAverages::new(&self.events)
    }

    /// Host synchronisations with their call sites.
    pub fn syncs(&self) -> impl Iterator<Item = &Event> {
        self.events.iter().filter(|e| e.kind == EventKind::Sync)
    }

    /// Allocations and frees of `device`, in order, each with the bytes in use after it.
    pub fn memory_timeline(&self, device: Device) -> impl Iterator<Item = &Event> {
        self.events.iter().filter(move |e| matches!(e.kind, EventKind::Alloc | EventKind::Free) && e.device == device)
    }

    /// The most bytes `device` had allocated at any point of the profile (None: no allocation
    /// or free was recorded).
    pub fn peak_bytes_in_use(&self, device: Device) -> Option<usize> {
        self.memory_timeline(device).filter_map(|e| e.bytes_in_use).max()
    }

    /// The Chrome trace as JSON (see [`Profile::export_chrome_trace`]).
    pub fn chrome_trace(&self) -> serde_json::Value {
        trace::chrome_trace(&self.events, &[], "")
    }

    /// The Chrome trace with `marks` laid over the devices' timelines on a track named `track`.
    pub(crate) fn chrome_trace_marked(&self, marks: &[Mark], track: &str) -> serde_json::Value {
        trace::chrome_trace(&self.events, marks, track)
    }

    /// Writes the trace for chrome://tracing or ui.perfetto.dev.
    pub fn export_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        write_trace(path.as_ref(), &self.chrome_trace())
    }
}

/// Writes a Chrome trace as JSON to `path`.
pub(crate) fn write_trace(path: &std::path::Path, trace: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string(trace).expect("a JSON value serialises");
    std::fs::write(path, text).map_err(|e| Error::Io { op: "export_chrome_trace", msg: format!("writing {}: {e}", path.display()) })
}
