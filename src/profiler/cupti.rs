//! Device activity from CUPTI: every kernel the GPU ran for a recorded launch, with its own
//! start and end, including the kernels inside a replayed CUDA graph and inside a library
//! call, which CUDA events around the launch can only time as a whole.
//!
//! Each device launch a profile records pushes a kiln correlation id on the launching
//! thread (CUPTI's external correlation); CUPTI links it to the kernels the launch ran.
//! Collection is asked for per profile (`ProfileOptions::device_kernels`): while CUPTI is
//! attached, every launch of the process costs more host time, so plain profiles never attach
//! it. Collection is process-wide and on only while such a profile runs: other threads' kernels
//! come too, and are dropped unclaimed. Afterwards CUPTI stays attached, collecting nothing,
//! unless `profiler::set_cupti_detach(true)` asked the last collecting profile to detach it
//! (`cuptiFinalize`, at the exit of a driver call of its own): detaching while other threads
//! worked on the GPU made their kernels fail on the H200, so only single-threaded programs
//! (`kiln bench`) ask for it.
//! Where CUPTI cannot be loaded or enabled, profiles carry no device kernels (`Profile::cupti`
//! says why).

use cudarc::cupti::{result as cr, sys as cs};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A kernel as the GPU ran it, times in µs on the profile's host timeline.
#[derive(Clone, Debug)]
pub struct DeviceKernel {
    /// The name the kernel has in its module (a generated kernel's name, or a library's own).
    pub name: String,
    pub device_start_us: f64,
    pub device_us: f64,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// CUPTI's id of the stream it ran on.
    pub stream: u32,
    /// Whether it ran as a node of a CUDA graph.
    pub in_graph: bool,
}

/// A kernel record before it is placed on a profile's timeline (CUPTI timestamps, ns).
struct Raw {
    kernel: DeviceKernel,
    start_ns: u64,
    end_ns: u64,
}

/// Whether CUPTI is attached, and for how many profiles. No CUPTI callback takes this lock, so
/// CUPTI is called with it held: a profile starting waits for another's detach to end.
struct Control {
    /// Profiles collecting now.
    users: usize,
    /// Why CUPTI is not used, once it failed to load or enable (checked once per process).
    broken: Option<String>,
    callbacks: bool,
}

/// What CUPTI's completed buffers held. The buffer callback takes this lock, on CUPTI's own
/// thread or inside any thread's flush or detach, so it is never held across a CUPTI call
/// (CUPTI may wait for that callback meanwhile: a deadlock).
struct Records {
    /// CUPTI correlation id, the kernel, and whether a prune already found it unclaimed.
    kernels: Vec<(u32, Raw, bool)>,
    /// kiln correlation id → CUPTI correlation ids.
    links: Vec<(u64, u32)>,
    /// How many kernels are held when the next prune runs.
    prune_at: usize,
}

impl Records {
    fn add(&mut self, kernels: Vec<(u32, Raw)>, links: Vec<(u64, u32)>) {
        self.links.extend(links);
        self.kernels.extend(kernels.into_iter().map(|(c, k)| (c, k, false)));
        if self.kernels.len() < self.prune_at {
            return;
        }
        // Collection is process-wide: other threads' kernels come too and would pile up for as
        // long as any profile collects. A kernel still unclaimed at a second prune is theirs: a
        // profiled launch's link is written when its driver call returns, long before that.
        let linked: HashSet<u32> = self.links.iter().map(|&(_, c)| c).collect();
        self.kernels.retain_mut(|(c, _, seen)| linked.contains(c) || !std::mem::replace(seen, true));
        self.prune_at = (2 * self.kernels.len()).max(PRUNE_AT);
    }

    fn clear(&mut self) {
        (self.kernels, self.links, self.prune_at) = (Vec::new(), Vec::new(), PRUNE_AT);
    }
}

static CONTROL: Mutex<Control> = Mutex::new(Control { users: 0, broken: None, callbacks: false });
static RECORDS: Mutex<Records> = Mutex::new(Records { kernels: Vec::new(), links: Vec::new(), prune_at: PRUNE_AT });
/// Counts detaches. Each buffer carries the count it was handed out under: one completed after
/// a detach holds records of the CUPTI that is gone, whose correlation ids the next one reuses.
static EPOCH: AtomicU64 = AtomicU64::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
const BUFFER_BYTES: usize = 4 << 20;
/// The epoch in front of each buffer (8 bytes keep the records 8-aligned, as CUPTI needs).
const HEADER: usize = 8;
const PRUNE_AT: usize = 1 << 16;
/// The records collected: kernels, and the links from kiln's ids to CUPTI's, which CUPTI writes
/// beside the records of the driver and runtime calls made under an id (so those are on too:
/// kiln launches through the driver, the libraries through the runtime).
const KINDS: [cs::CUpti_ActivityKind; 4] = [
    cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
    cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER,
    cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME,
];
const FLUSH_FORCED: u32 = 1;

fn control() -> std::sync::MutexGuard<'static, Control> {
    CONTROL.lock().unwrap_or_else(|p| p.into_inner())
}

fn records() -> std::sync::MutexGuard<'static, Records> {
    RECORDS.lock().unwrap_or_else(|p| p.into_inner())
}

fn buffer_layout() -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(HEADER + BUFFER_BYTES, 8).expect("a valid layout")
}

unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the allocation holds the header and the buffer,
    // and is freed in `buffer_completed`.
    unsafe {
        let base = std::alloc::alloc(buffer_layout());
        if base.is_null() {
            (*buffer, *size) = (std::ptr::null_mut(), 0);
        } else {
            (base as *mut u64).write(EPOCH.load(Ordering::Acquire));
            (*buffer, *size) = (base.add(HEADER), BUFFER_BYTES);
        }
        *max_records = 0;
    }
}

unsafe extern "C" fn buffer_completed(_ctx: cudarc::driver::sys::CUcontext, _stream: u32, buffer: *mut u8, _size: usize, valid: usize) {
    if buffer.is_null() {
        return;
    }
    let (mut kernels, mut links) = (vec![], vec![]);
    let mut record: *mut cs::CUpti_Activity = std::ptr::null_mut();
    // SAFETY: `buffer` is the one `buffer_requested` handed out, HEADER bytes into its
    // allocation, and holds `valid` bytes of records CUPTI wrote; each record starts with its
    // kind (read as a plain u32: a kind this build does not know is skipped, not transmuted),
    // and the kinds read here have the layouts of this CUDA version's headers, whose leading
    // fields are the same in every version of them.
    unsafe {
        let base = buffer.sub(HEADER);
        let current = (base as *const u64).read() == EPOCH.load(Ordering::Acquire);
        while current && cr::activity::get_next_record(buffer, valid, &mut record).is_ok() {
            let kind = *(record as *const u32);
            if kind == cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32 || kind == cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_KERNEL as u32 {
                let k = record as *const cs::CUpti_ActivityKernel10;
                let name_ptr = std::ptr::addr_of!((*k).name).read_unaligned();
                let name = if name_ptr.is_null() { "?".to_string() } else { std::ffi::CStr::from_ptr(name_ptr).to_string_lossy().into_owned() };
                let dim = |x: i32| x.max(0) as u32;
                kernels.push((
                    std::ptr::addr_of!((*k).correlationId).read_unaligned(),
                    Raw {
                        kernel: DeviceKernel {
                            name,
                            device_start_us: 0.0,
                            device_us: 0.0,
                            grid: (dim(std::ptr::addr_of!((*k).gridX).read_unaligned()), dim(std::ptr::addr_of!((*k).gridY).read_unaligned()), dim(std::ptr::addr_of!((*k).gridZ).read_unaligned())),
                            block: (dim(std::ptr::addr_of!((*k).blockX).read_unaligned()), dim(std::ptr::addr_of!((*k).blockY).read_unaligned()), dim(std::ptr::addr_of!((*k).blockZ).read_unaligned())),
                            stream: std::ptr::addr_of!((*k).streamId).read_unaligned(),
                            in_graph: std::ptr::addr_of!((*k).graphId).read_unaligned() != 0,
                        },
                        start_ns: std::ptr::addr_of!((*k).start).read_unaligned(),
                        end_ns: std::ptr::addr_of!((*k).end).read_unaligned(),
                    },
                ));
            } else if kind == cs::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION as u32 {
                let e = record as *const cs::CUpti_ActivityExternalCorrelation;
                let external_kind = *((record as *const u32).add(1));
                if external_kind == cs::CUpti_ExternalCorrelationKind::CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0 as u32 {
                    links.push((std::ptr::addr_of!((*e).externalId).read_unaligned(), std::ptr::addr_of!((*e).correlationId).read_unaligned()));
                }
            }
        }
        std::alloc::dealloc(base, buffer_layout());
    }
    if !kernels.is_empty() || !links.is_empty() {
        records().add(kernels, links);
    }
}

/// Collection held for one profile; collection stops when the last one is dropped.
pub(super) struct Collecting {
    /// CUPTI's clock at the start, and the profile's host time then (µs).
    t0_ns: u64,
    t0_host_us: f64,
}

/// Starts collecting for a profile, or says why it cannot; `now_us` reads the profile's host
/// time, taken with CUPTI's clock once collection is on.
pub(super) fn start(now_us: impl FnOnce() -> f64) -> Result<Collecting, String> {
    let mut c = control();
    if let Some(why) = &c.broken {
        return Err(why.clone());
    }
    if c.users == 0 {
        if let Err(why) = attach(&mut c) {
            c.broken = Some(why.clone());
            return Err(why);
        }
    }
    c.users += 1;
    let mut t0_ns = 0u64;
    // SAFETY: a plain out-parameter.
    let _ = unsafe { cs::cuptiGetTimestamp(&mut t0_ns) };
    Ok(Collecting { t0_ns, t0_host_us: now_us() })
}

/// Turns collection on for the first profile that asks.
fn attach(c: &mut Control) -> Result<(), String> {
    // SAFETY: only checks whether the library can be loaded.
    if !unsafe { cs::is_culib_present() } {
        return Err("the CUPTI library (libcupti) was not found".into());
    }
    if !c.callbacks {
        cr::activity::register_callbacks(Some(buffer_requested), Some(buffer_completed)).map_err(|e| format!("registering CUPTI's buffers: {e:?}"))?;
        c.callbacks = true;
    }
    for (i, kind) in KINDS.into_iter().enumerate() {
        if let Err(e) = cr::activity::enable(kind) {
            // Nothing is left half on: every launch of the process would pay for it.
            for on in &KINDS[..i] {
                let _ = cr::activity::disable(*on);
            }
            return Err(format!("enabling CUPTI activity {kind:?}: {e:?}"));
        }
    }
    Ok(())
}

impl Drop for Collecting {
    fn drop(&mut self) {
        let mut c = control();
        c.users -= 1;
        if c.users > 0 {
            return;
        }
        for kind in KINDS {
            let _ = cr::activity::disable(kind);
        }
        let _ = cr::activity::flush_all(FLUSH_FORCED);
        // Detach, so that later launches cost what they did before; the next profile that asks
        // attaches again (its buffers registered anew). Where CUPTI cannot be detached safely,
        // it stays attached, collecting nothing.
        if detach_allowed() && detach() {
            c.callbacks = false;
            EPOCH.fetch_add(1, Ordering::AcqRel);
        }
        records().clear();
    }
}

/// Whether the last collecting profile detaches CUPTI: see [`crate::profiler::set_cupti_detach`].
static DETACH_ALLOWED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(super) fn set_detach(on: bool) {
    DETACH_ALLOWED.store(on, Ordering::Relaxed);
}

fn detach_allowed() -> bool {
    DETACH_ALLOWED.load(Ordering::Relaxed)
}

/// Where the detaching thread is in `detach`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Detach {
    Idle,
    /// Making the driver call at whose exit CUPTI is detached.
    Armed,
    Done,
    Failed,
}

thread_local! {
    static DETACH: Cell<Detach> = const { Cell::new(Detach::Idle) };
}

const EXIT_CALL: cs::CUpti_CallbackId = cs::CUpti_driver_api_trace_cbid::CUPTI_DRIVER_TRACE_CBID_cuCtxGetCurrent as u32;

/// Detaches CUPTI (`cuptiFinalize`) at the exit of a driver call this thread makes, the one
/// place CUPTI documents it as safe while other threads may be inside the driver: called
/// anywhere else it races their launches, which crashed or hung processes profiling one thread
/// while others worked on the GPU. False where it could not be done.
fn detach() -> bool {
    let mut sub: cs::CUpti_SubscriberHandle = std::ptr::null_mut();
    // SAFETY: a plain out-parameter; the callback is a plain function without user data.
    if unsafe { cs::cuptiSubscribe(&mut sub, Some(at_driver_call), std::ptr::null_mut()) }.result().is_err() {
        return false;
    }
    // SAFETY: `sub` was just subscribed; only this one driver call calls back.
    let armed = unsafe { cs::cuptiEnableCallback(1, sub, cs::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API, EXIT_CALL) }.result().is_ok();
    let mut done = false;
    if armed {
        DETACH.with(|d| d.set(Detach::Armed));
        let mut ctx: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a plain out-parameter; the call is made for its exit callback.
        let _ = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) };
        done = DETACH.with(|d| d.replace(Detach::Idle)) == Detach::Done;
    }
    if !done {
        // SAFETY: CUPTI was not finalized, so `sub` is still subscribed.
        let _ = unsafe { cs::cuptiUnsubscribe(sub) };
    }
    done
}

unsafe extern "C" fn at_driver_call(_user: *mut std::ffi::c_void, domain: cs::CUpti_CallbackDomain, cbid: cs::CUpti_CallbackId, data: *const std::ffi::c_void) {
    if domain != cs::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API || cbid != EXIT_CALL || data.is_null() {
        return;
    }
    // SAFETY: a driver API callback's data is a CUpti_CallbackData, whose first field is the
    // call site (read as a plain u32).
    let site = unsafe { *(data as *const u32) };
    // Other threads' calls of it go on untouched.
    if site != cs::CUpti_ApiCallbackSite::CUPTI_API_EXIT as u32 || !DETACH.try_with(|d| d.get()).is_ok_and(|d| d == Detach::Armed) {
        return;
    }
    // SAFETY: at a driver call's exit, as CUPTI asks; collection is off and flushed, and no
    // profile can start meanwhile (the detaching thread holds CONTROL).
    let ok = unsafe { cs::cuptiFinalize() }.result().is_ok();
    let _ = DETACH.try_with(|d| d.set(if ok { Detach::Done } else { Detach::Failed }));
}

/// A fresh kiln correlation id, pushed for the launches this thread makes until `pop`.
pub(super) fn push() -> Option<u64> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    cr::activity::push_external_correlation_id(cs::CUpti_ExternalCorrelationKind::CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, id).ok().map(|_| id)
}

pub(super) fn pop() {
    let mut last = 0u64;
    // SAFETY: a plain out-parameter.
    let _ = unsafe { cr::activity::pop_external_correlation_id(cs::CUpti_ExternalCorrelationKind::CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &mut last) };
}

/// The kernels each launch ran, by its kiln correlation id.
pub(super) type Claimed = HashMap<u64, Vec<DeviceKernel>>;

impl Collecting {
    /// The kernels run for each of `ids` (in the order they started), once the device has
    /// finished the work they were launched for; and when every other kernel CUPTI has seen ran
    /// (start and end, µs on the profile's timeline), left for the profiles that own them.
    pub(super) fn take(&self, ids: &[u64]) -> (Claimed, Vec<(f64, f64)>) {
        // Not with RECORDS held: the flush hands buffers to the callback, which takes it.
        let _ = cr::activity::flush_all(FLUSH_FORCED);
        let mut r = records();
        let wanted: HashSet<u64> = ids.iter().copied().collect();
        let mut owner: HashMap<u32, u64> = HashMap::new();
        r.links.retain(|&(ext, corr)| {
            let mine = wanted.contains(&ext);
            if mine {
                owner.insert(corr, ext);
            }
            !mine
        });
        let mut out: Claimed = HashMap::new();
        let at = |ns: u64| self.t0_host_us + (ns as f64 - self.t0_ns as f64) / 1e3;
        // A record CUPTI could not time carries zero timestamps: it is dropped, not placed at the
        // clock's origin.
        r.kernels.retain(|(_, raw, _)| raw.start_ns != 0 && raw.end_ns >= raw.start_ns);
        r.kernels.retain(|(corr, raw, _)| {
            let Some(ext) = owner.get(corr) else { return true };
            let mut k = raw.kernel.clone();
            (k.device_start_us, k.device_us) = (at(raw.start_ns), raw.end_ns.saturating_sub(raw.start_ns) as f64 / 1e3);
            out.entry(*ext).or_default().push(k);
            false
        });
        for ks in out.values_mut() {
            ks.sort_by(|a, b| a.device_start_us.total_cmp(&b.device_start_us));
        }
        let others = r.kernels.iter().map(|(_, raw, _)| (at(raw.start_ns), at(raw.end_ns))).collect();
        (out, others)
    }
}
