//! Recording: the per-thread session the hooks write to, and the hooks the backends call.
//!
//! Recording is per thread, like `cuda::launch_count`: work of other threads (tests running in
//! parallel, loader workers) does not enter a profile. When no thread profiles, every hook
//! returns after one relaxed atomic load.

use super::{cupti, CopyKind, Event, EventKind};
use crate::backend::cuda::CudaDevice;
use crate::ops::Op;
use crate::{DType, Device, Error, Result, Tensor};
use cudarc::driver::{sys as ds, CudaEvent, CudaStream};
use std::cell::RefCell;
use std::panic::Location;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Why a profile has no device kernels when they were not asked for.
const NOT_ASKED: &str = "device kernels were not asked for (ProfileOptions::device_kernels)";

/// Threads profiling now.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Device work queued by any thread while some thread profiles, per device ordinal (the last
/// slot shared by ordinals past it): a profile compares it with its own to see other threads'
/// work, which shares the devices' streams and so lands inside its timings.
static QUEUED: [AtomicUsize; 16] = [const { AtomicUsize::new(0) }; 16];

/// The slot of `QUEUED` (and of a session's `own`) that counts device `ordinal`'s work.
fn slot(ordinal: usize) -> usize {
    ordinal.min(QUEUED.len() - 1)
}

#[inline(always)]
fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// A device's first recorded point: device timestamps are placed on the host timeline by it.
struct Base {
    ordinal: usize,
    event: CudaEvent,
    host_us: f64,
}

struct Session {
    t0: Instant,
    events: Vec<Event>,
    /// Device time to read at the end: event index, ordinal, start and end events.
    timings: Vec<(usize, usize, CudaEvent, CudaEvent)>,
    bases: Vec<Base>,
    /// CUPTI collection, started with the first device work (Err: why there is none).
    cupti: Option<std::result::Result<cupti::Collecting, String>>,
    /// The kiln correlation id each device event's launches ran under.
    correlated: Vec<(usize, u64)>,
    /// `QUEUED` when recording began, and the device work this session queued, per ordinal.
    queued_before: Vec<usize>,
    own: Vec<usize>,
}

impl Session {
    fn now_us(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1e6
    }
}

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's session, if it is recording (None otherwise, also during thread
/// teardown, where a storage may still be dropped).
fn with_session<R>(f: impl FnOnce(&mut Session) -> R) -> Option<R> {
    SESSION.try_with(|s| s.try_borrow_mut().ok()?.as_mut().map(f)).ok().flatten()
}

/// Recording on this thread; stops when dropped, also when the profiled closure panics.
pub(super) struct Recording(());

impl Recording {
    /// `device_kernels`: collect the kernels the GPU ran for each launch (CUPTI).
    pub(super) fn start(device_kernels: bool) -> Result<Recording> {
        SESSION.with(|s| {
            let mut s = s.borrow_mut();
            if s.is_some() {
                return Err(Error::arg("profile", "this thread is already being profiled; profiles do not nest"));
            }
            *s = Some(Session { t0: Instant::now(), events: Vec::new(), timings: Vec::new(), bases: Vec::new(), cupti: if device_kernels { None } else { Some(Err(NOT_ASKED.into())) }, correlated: Vec::new(), queued_before: QUEUED.iter().map(|q| q.load(Ordering::Relaxed)).collect(), own: vec![0; QUEUED.len()] });
            Ok(())
        })?;
        ACTIVE.fetch_add(1, Ordering::Relaxed);
        Ok(Recording(()))
    }

    /// Stops recording and returns what was recorded: the events with their device times, read
    /// after one synchronisation per device that was used, the kernels CUPTI saw each launch
    /// run, why there are none where CUPTI was not used for device work, and other threads'
    /// work on the devices this thread used.
    pub(super) fn finish(self) -> Result<Recorded> {
        let s = SESSION.with(|s| s.borrow_mut().take()).expect("a recording has a session");
        let wall_us = s.now_us();
        drop(self);
        let foreign_work = (0..QUEUED.len()).filter(|&i| s.own[i] > 0).map(|i| QUEUED[i].load(Ordering::Relaxed).wrapping_sub(s.queued_before[i]).saturating_sub(s.own[i])).sum();
        let mut events = s.events;
        let cuda_err = |ordinal, e| Error::Cuda { op: "profile", device: Device::Cuda(ordinal), msg: format!("{e:?}") };
        // Each end event is waited for, not the whole context: another thread may be capturing
        // a CUDA graph on a stream of the same context, which a context-wide wait would break.
        for (i, ordinal, start, end) in &s.timings {
            end.synchronize().map_err(|e| cuda_err(*ordinal, e))?;
            let base = s.bases.iter().find(|b| b.ordinal == *ordinal).expect("a device with timings has a base");
            let offset_ms = base.event.elapsed_ms(start).map_err(|e| cuda_err(*ordinal, e))? as f64;
            let ms = start.elapsed_ms(end).map_err(|e| cuda_err(*ordinal, e))? as f64;
            events[*i].device_start_us = Some(base.host_us + offset_ms * 1e3);
            events[*i].device_us = Some(ms * 1e3);
        }
        let mut other_kernels = Vec::new();
        let cupti_missing = match &s.cupti {
            Some(Ok(c)) => {
                let ids: Vec<u64> = s.correlated.iter().map(|&(_, id)| id).collect();
                let (mut ran, others) = c.take(&ids);
                for (i, id) in &s.correlated {
                    events[*i].device_kernels = ran.remove(id).unwrap_or_default();
                }
                other_kernels = others.into_iter().filter(|&(start, end)| end > 0.0 && start < wall_us).collect();
                None
            }
            // Said only where there was device work to see.
            Some(Err(why)) if !s.timings.is_empty() => Some(why.clone()),
            _ => None,
        };
        Ok(Recorded { events, wall_us, cupti_missing, foreign_work, other_kernels })
    }
}

/// What a finished recording hands the profile.
pub(super) struct Recorded {
    pub(super) events: Vec<Event>,
    pub(super) wall_us: f64,
    pub(super) cupti_missing: Option<String>,
    pub(super) foreign_work: usize,
    pub(super) other_kernels: Vec<(f64, f64)>,
}

thread_local! {
    /// The caller's line the device work queued now was asked for at (see [`call_site`]).
    static SITE: std::cell::Cell<Option<&'static Location<'static>>> = const { std::cell::Cell::new(None) };
}

/// While the guard lives, device work this thread queues is recorded as issued at the line
/// [`call_site`] names, unless an outer guard already named one: the outermost entry into kiln
/// (the user's call) wins over the entries kiln makes inside it. Costs one relaxed load when
/// nothing is profiled.
#[must_use]
pub(crate) struct SiteGuard(bool);

/// Names the caller's line for the device work queued while the guard lives. Itself
/// `#[track_caller]` and called first thing in `#[track_caller]` entry points, so the line is
/// the one that called the entry point.
#[inline]
#[track_caller]
pub(crate) fn call_site() -> SiteGuard {
    let at = Location::caller();
    if !(active() || super::sync::sync_debug_mode() != super::SyncDebug::Off) || inside_the_library(at) {
        return SiteGuard(false);
    }
    SiteGuard(SITE.try_with(|s| s.get().is_none() && { s.set(Some(at)); true }).unwrap_or(false))
}

/// Whether `at` is a line of kiln's library itself, reached where a chain of `#[track_caller]`
/// functions from the user's call is broken: such a line names no caller, so it is not recorded.
/// The `kiln` program's own files (`cli/`, `main.rs`) are callers like any other.
fn inside_the_library(at: &Location) -> bool {
    let root = file!().strip_suffix("profiler/record.rs").unwrap_or("");
    at.file().strip_prefix(root).is_some_and(|rest| !rest.starts_with("cli/") && !rest.starts_with("cli\\") && rest != "main.rs")
}

/// The line the device work queued now was asked for at, if a guard named one.
fn current_site() -> Option<&'static Location<'static>> {
    SITE.try_with(|s| s.get()).ok().flatten()
}

impl Drop for SiteGuard {
    fn drop(&mut self) {
        if self.0 {
            let _ = SITE.try_with(|s| s.set(None));
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let _ = SESSION.try_with(|s| s.borrow_mut().take());
        ACTIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Something being recorded: pushed to the session when dropped, with its host time and, on
/// a device, an end event recorded on its stream.
pub(crate) struct Span(Option<Box<Open>>);

struct Open {
    event: Event,
    start: Instant,
    /// The stream and start event of device work (None on the CPU, or if the event failed).
    timing: Option<(Arc<CudaStream>, CudaEvent)>,
    /// The kiln correlation id pushed for CUPTI while the work is launched.
    correlation: Option<u64>,
}

impl Span {
    const OFF: Span = Span(None);

    fn open(mut event: Event) -> Span {
        match with_session(|s| s.now_us()) {
            Some(t) => {
                event.start_us = t;
                Span(Some(Box::new(Open { event, start: Instant::now(), timing: None, correlation: None })))
            }
            None => Span::OFF,
        }
    }

    /// Device work queued on `stream`: timed by events around it.
    fn on_device(event: Event, dev: &CudaDevice, stream: &Arc<CudaStream>) -> Span {
        // CUPTI starts before the span opens: attaching it takes milliseconds, which are not
        // this launch's.
        let collecting = with_session(|s| {
            let t0 = s.t0;
            s.cupti.get_or_insert_with(|| cupti::start(|| t0.elapsed().as_secs_f64() * 1e6)).is_ok()
        });
        let mut span = Span::open(event);
        if let Some(o) = span.0.as_mut() {
            let timed = Some(ds::CUevent_flags::CU_EVENT_DEFAULT);
            let has_base = with_session(|s| s.bases.iter().any(|b| b.ordinal == dev.ordinal)).unwrap_or(true);
            if !has_base {
                if let Ok(event) = dev.stream.record_event(timed) {
                    let base = Base { ordinal: dev.ordinal, event, host_us: o.event.start_us };
                    with_session(|s| s.bases.push(base));
                }
            }
            o.timing = stream.record_event(timed).ok().map(|e| (stream.clone(), e));
            if collecting == Some(true) {
                o.correlation = cupti::push();
            }
        }
        span
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(o) = self.0.take() else { return };
        let Open { mut event, start, timing, correlation } = *o;
        if correlation.is_some() {
            cupti::pop();
        }
        event.host_us = start.elapsed().as_secs_f64() * 1e6;
        if event.device == Device::Cpu && event.kind == EventKind::Kernel {
            event.device_us = Some(event.host_us); // the CPU is the device
            event.device_start_us = Some(event.start_us);
        }
        let ordinal = match event.device {
            Device::Cuda(n) => n,
            Device::Cpu => 0,
        };
        let end = timing.and_then(|(stream, start)| Some((start, stream.record_event(Some(ds::CUevent_flags::CU_EVENT_DEFAULT)).ok()?)));
        with_session(|s| {
            if let Some((start, end)) = end {
                s.timings.push((s.events.len(), ordinal, start, end));
            }
            if let Some(id) = correlation {
                s.correlated.push((s.events.len(), id));
            }
            s.events.push(event);
        });
    }
}

fn event(kind: EventKind, name: String, device: Device) -> Event {
    Event { kind, name, device, start_us: 0.0, host_us: 0.0, device_us: None, device_start_us: None, grid: None, block: None, stream: None, bytes: 0, bytes_in_use: None, location: None, device_kernels: Vec::new() }
}

fn device_work(dev: &CudaDevice, stream: &Arc<CudaStream>, kind: EventKind, name: String, bytes: usize) -> Span {
    QUEUED[slot(dev.ordinal)].fetch_add(1, Ordering::Relaxed);
    with_session(|s| s.own[slot(dev.ordinal)] += 1);
    let mut e = event(kind, name, dev.kiln_device());
    e.stream = Some(stream.cu_stream() as u64);
    e.bytes = bytes;
    e.location = current_site();
    Span::on_device(e, dev, stream)
}

/// Hook: a generated kernel launched on the device's stream.
#[inline]
pub(crate) fn kernel(dev: &CudaDevice, name: &'static str, grid: (u32, u32, u32), block: (u32, u32, u32)) -> Span {
    crate::backend::cuda::device::graph::note_captured(|| name.to_string());
    if !active() {
        return Span::OFF;
    }
    let mut span = device_work(dev, &dev.stream, EventKind::Kernel, name.to_string(), 0);
    if let Some(o) = span.0.as_mut() {
        (o.event.grid, o.event.block) = (Some(grid), Some(block));
    }
    span
}

/// Hook: a cuBLAS(Lt) matrix product, with its epilogue in the name (`_bias`, `_bias_relu`),
/// counted as one kernel whatever the library launches inside.
#[inline]
pub(crate) fn blas(dev: &CudaDevice, dtype: DType, epilogue: &str) -> Span {
    let name = || format!("cublas_gemm{epilogue}_{}", dtype.torch_name());
    crate::backend::cuda::device::graph::note_captured(name);
    if !active() {
        return Span::OFF;
    }
    device_work(dev, &dev.stream, EventKind::Kernel, name(), 0)
}

/// Hook: a cuDNN call (`what`: `conv2d_fwd`, `conv2d_bwd_data`, `conv2d_bwd_filter`).
#[inline]
pub(crate) fn cudnn(dev: &CudaDevice, what: &str, dtype: DType) -> Span {
    let name = || format!("cudnn_{what}_{}", dtype.torch_name());
    crate::backend::cuda::device::graph::note_captured(name);
    if !active() {
        return Span::OFF;
    }
    device_work(dev, &dev.stream, EventKind::Kernel, name(), 0)
}

/// Hook: a CUDA graph about to be replayed on the device's stream: one kernel event per kernel
/// (library call) it holds, by the name it had when captured, without device times of their
/// own, and the replay itself (`cuda_graph_replay`), timed on the device around its launch.
#[inline]
pub(crate) fn graph_replay(dev: &CudaDevice, kernels: &[String]) -> Span {
    if !active() {
        return Span::OFF;
    }
    for name in kernels {
        let mut e = event(EventKind::Kernel, name.clone(), dev.kiln_device());
        e.stream = Some(dev.stream.cu_stream() as u64);
        e.location = current_site();
        drop(Span::open(e));
    }
    device_work(dev, &dev.stream, EventKind::Graph, "cuda_graph_replay".to_string(), 0)
}

/// Hook: a copy of `bytes` queued on `stream`.
#[inline]
pub(crate) fn copy(dev: &CudaDevice, stream: &Arc<CudaStream>, kind: CopyKind, bytes: usize) -> Span {
    if !active() {
        return Span::OFF;
    }
    device_work(dev, stream, EventKind::Copy(kind), kind.name().to_string(), bytes)
}

/// Hook: a memset of `bytes` on the device's stream.
#[inline]
pub(crate) fn memset(dev: &CudaDevice, bytes: usize) -> Span {
    if !active() {
        return Span::OFF;
    }
    device_work(dev, &dev.stream, EventKind::Memset, "memset".to_string(), bytes)
}

/// Hook: at the top of `Op::forward`; records the op when it runs a CPU kernel (not a view,
/// not a copy between devices, which the copy hooks record).
#[inline]
pub(crate) fn cpu_op(op: &Op, xs: &[&Tensor]) -> Span {
    if !active() {
        return Span::OFF;
    }
    let view_or_move = op.is_view() || matches!(op, Op::ToDevice { .. });
    // Convolutions on the host are made of other ops, which record themselves.
    if view_or_move || op.is_conv() || xs.first().is_none_or(|x| x.device() != Device::Cpu) {
        return Span::OFF;
    }
    Span::open(event(EventKind::Kernel, op.name().to_string(), Device::Cpu))
}

/// Hook: a fused kernel of the compiler running on the host.
#[inline]
pub(crate) fn cpu_kernel(name: &str) -> Span {
    if !active() {
        return Span::OFF;
    }
    Span::open(event(EventKind::Kernel, name.to_string(), Device::Cpu))
}

/// Where a synchronisation reached at `at` was asked for: `at` itself, unless that is a line of
/// the library (a chain of `#[track_caller]` broken on the way), then the user's line a guard
/// recorded, if any.
pub(super) fn caller_of(at: &'static Location<'static>) -> &'static Location<'static> {
    if inside_the_library(at) {
        current_site().unwrap_or(at)
    } else {
        at
    }
}

/// Hook: a host synchronisation called at `at` (its host time is the wait).
pub(super) fn sync(what: &'static str, device: Device, at: &'static Location<'static>) -> Span {
    if !active() {
        return Span::OFF;
    }
    let mut e = event(EventKind::Sync, what.to_string(), device);
    e.location = Some(at);
    Span::open(e)
}

/// Hook: the caching allocator handed out (`delta` > 0) or took back (< 0) a block of device
/// `ordinal`; `in_use` gives the bytes allocated afterwards.
#[inline]
pub(crate) fn memory(ordinal: usize, delta: i64, in_use: impl FnOnce() -> usize) {
    let log = crate::logging::enabled(crate::logging::Topic::Alloc);
    if delta == 0 || !(active() || log) {
        return;
    }
    let in_use = in_use();
    let (kind, name) = if delta > 0 { (EventKind::Alloc, "alloc") } else { (EventKind::Free, "free") };
    crate::logging::log(crate::logging::Topic::Alloc, || format!("cuda:{ordinal} {name} {} bytes, {in_use} in use", delta.unsigned_abs()));
    let mut e = event(kind, name.to_string(), Device::Cuda(ordinal));
    (e.bytes, e.bytes_in_use) = (delta.unsigned_abs() as usize, Some(in_use));
    with_session(|s| {
        e.start_us = s.now_us();
        s.events.push(e);
    });
}
