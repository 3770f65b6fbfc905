//! Device activity from CUPTI: every kernel the GPU ran for a recorded launch, with its own
//! start and end, including the kernels inside a replayed CUDA graph and inside a library
//! call, which CUDA events around the launch can only time as a whole.
//!
//! Each device launch a profile records pushes a kiln correlation id on the launching
//! thread (CUPTI's external correlation); CUPTI links it to the kernels the launch ran.
//! Collection is asked for per profile (`ProfileOptions::device_kernels`): while CUPTI is
//! attached, every launch of the process costs more host time (about 2.5x on the H200), so
//! plain profiles never attach it, and the last profile collecting (the bench's kernel counts,
//! for one) detaches it again (`cuptiFinalize`). Collection is process-wide and on only while
//! such a profile runs. Where CUPTI cannot be loaded or enabled, profiles carry no device
//! kernels (`Profile::cupti` says why).

use cudarc::cupti::{result as cr, sys as cs};
use std::collections::HashMap;
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

struct State {
    /// Profiles collecting now.
    users: usize,
    /// Why CUPTI is not used, once it failed to load or enable (checked once per process).
    broken: Option<String>,
    callbacks: bool,
    kernels: Vec<(u32, Raw)>,
    /// kiln correlation id → CUPTI correlation ids.
    links: Vec<(u64, u32)>,
}

/// Held while CUPTI is attached or detached, so that a profile starting on one thread never
/// meets the detach of another's (not `STATE`: CUPTI's buffer callback takes that one).
static ATTACH: Mutex<()> = Mutex::new(());
static STATE: Mutex<State> = Mutex::new(State { users: 0, broken: None, callbacks: false, kernels: Vec::new(), links: Vec::new() });
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
const BUFFER_BYTES: usize = 4 << 20;
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

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn buffer_layout() -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(BUFFER_BYTES, 8).expect("a valid layout")
}

unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in `buffer_completed`.
    unsafe {
        *buffer = std::alloc::alloc(buffer_layout());
        *size = if (*buffer).is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

unsafe extern "C" fn buffer_completed(_ctx: cudarc::driver::sys::CUcontext, _stream: u32, buffer: *mut u8, _size: usize, valid: usize) {
    if buffer.is_null() {
        return;
    }
    let (mut kernels, mut links) = (vec![], vec![]);
    let mut record: *mut cs::CUpti_Activity = std::ptr::null_mut();
    // SAFETY: `buffer` holds `valid` bytes of records CUPTI wrote; each record starts with its
    // kind (read as a plain u32: a kind this build does not know is skipped, not transmuted),
    // and the kinds read here have the layouts of this CUDA version's headers, whose leading
    // fields are the same in every version of them.
    unsafe {
        while cr::activity::get_next_record(buffer, valid, &mut record).is_ok() {
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
        std::alloc::dealloc(buffer, buffer_layout());
    }
    let mut s = state();
    s.kernels.extend(kernels);
    s.links.extend(links);
}

/// Collection held for one profile; collection stops when the last one is dropped.
pub(super) struct Collecting {
    /// CUPTI's clock at the start, and the profile's host time then (µs).
    t0_ns: u64,
    t0_host_us: f64,
}

/// Starts collecting for a profile at host time `now_us`, or says why it cannot.
pub(super) fn start(now_us: f64) -> Result<Collecting, String> {
    let _attach = ATTACH.lock().unwrap_or_else(|p| p.into_inner());
    let mut s = state();
    if let Some(why) = &s.broken {
        return Err(why.clone());
    }
    if s.users == 0 {
        let enable = |s: &mut State| -> Result<(), String> {
            // SAFETY: only checks whether the library can be loaded.
            if !unsafe { cs::is_culib_present() } {
                return Err("the CUPTI library (libcupti) was not found".into());
            }
            if !s.callbacks {
                cr::activity::register_callbacks(Some(buffer_requested), Some(buffer_completed)).map_err(|e| format!("registering CUPTI's buffers: {e:?}"))?;
                s.callbacks = true;
            }
            for kind in KINDS {
                cr::activity::enable(kind).map_err(|e| format!("enabling CUPTI activity {kind:?}: {e:?}"))?;
            }
            Ok(())
        };
        if let Err(why) = enable(&mut s) {
            s.broken = Some(why.clone());
            return Err(why);
        }
    }
    s.users += 1;
    let mut t0_ns = 0u64;
    // SAFETY: a plain out-parameter.
    let _ = unsafe { cs::cuptiGetTimestamp(&mut t0_ns) };
    Ok(Collecting { t0_ns, t0_host_us: now_us })
}

impl Drop for Collecting {
    fn drop(&mut self) {
        let _attach = ATTACH.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = state();
        s.users -= 1;
        if s.users > 0 {
            return;
        }
        for kind in KINDS {
            let _ = cr::activity::disable(kind);
        }
        drop(s);
        let _ = cr::activity::flush_all(FLUSH_FORCED);
        // Detach, so that later launches cost what they did before; the next profile that asks
        // attaches again (its buffers registered anew).
        // SAFETY: collection is off and flushed, and no profile can start meanwhile (ATTACH).
        let detached = unsafe { cs::cuptiFinalize() }.result().is_ok();
        let mut s = state();
        s.kernels.clear();
        s.links.clear();
        if detached {
            s.callbacks = false;
        }
    }
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

impl Collecting {
    /// The kernels run for each of `ids` (in the order they started), once the device has
    /// finished the work they were launched for.
    pub(super) fn take(&self, ids: &[u64]) -> HashMap<u64, Vec<DeviceKernel>> {
        let _ = cr::activity::flush_all(FLUSH_FORCED);
        let mut s = state();
        let wanted: std::collections::HashSet<u64> = ids.iter().copied().collect();
        let mut owner: HashMap<u32, u64> = HashMap::new();
        s.links.retain(|&(ext, corr)| {
            let mine = wanted.contains(&ext);
            if mine {
                owner.insert(corr, ext);
            }
            !mine
        });
        let mut out: HashMap<u64, Vec<DeviceKernel>> = HashMap::new();
        let at = |ns: u64| self.t0_host_us + (ns as f64 - self.t0_ns as f64) / 1e3;
        s.kernels.retain(|(corr, raw)| {
            let Some(ext) = owner.get(corr) else { return true };
            let mut k = raw.kernel.clone();
            (k.device_start_us, k.device_us) = (at(raw.start_ns), raw.end_ns.saturating_sub(raw.start_ns) as f64 / 1e3);
            out.entry(*ext).or_default().push(k);
            false
        });
        for ks in out.values_mut() {
            ks.sort_by(|a, b| a.device_start_us.total_cmp(&b.device_start_us));
        }
        out
    }
}
