//! `Mode::MaxAutotune`'s memory: the winner of each timed choice (a cuBLASLt algorithm, a row
//! kernel's threads per row), kept in memory and on disk beside the kernel cache
//! (`<KILN_CACHE_DIR>/autotune/`), so a second process does not time again. Keys name the
//! device, the library or compiler version and everything the timing depends on (shapes,
//! layout, dtypes, the kernel's ops); the value is a short text the caller parses.
//!
//! Timing happens on the first run of a compiled program that asks for it, never while a CUDA
//! graph is being captured on the device, and only chooses between candidates that compute
//! the same values (up to floating-point reassociation).

use crate::backend::cuda::CudaDevice;
use crate::logging::{log, Topic};
use crate::{Device, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

/// What this thread's autotuning did so far (per thread, like `launch_count`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AutotuneCounts {
    /// Choices decided by timing candidates on the device.
    pub timed: u64,
    /// Choices found in this process's memory (decided earlier by any thread).
    pub memory_hits: u64,
    /// Choices read from the on-disk cache (decided by an earlier process).
    pub disk_hits: u64,
}

thread_local! {
    static COUNTS: std::cell::Cell<AutotuneCounts> = const { std::cell::Cell::new(AutotuneCounts { timed: 0, memory_hits: 0, disk_hits: 0 }) };
}

/// This thread's autotuning counts.
pub fn autotune_counts() -> AutotuneCounts {
    COUNTS.with(|c| c.get())
}

fn count(f: impl FnOnce(&mut AutotuneCounts)) {
    COUNTS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

fn memory() -> &'static Mutex<HashMap<String, String>> {
    static M: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

fn dir() -> Option<PathBuf> {
    crate::backend::cuda::device::nvrtc::cache_dir().map(|d| d.join("autotune"))
}

fn file_of(key: &str) -> Option<PathBuf> {
    dir().map(|d| d.join(format!("{:016x}.txt", crate::hash::fnv64(&[key.as_bytes()]))))
}

/// Whether timing may run on `dev` now: not while this thread captures a graph, nor while
/// another thread does on the same device. A choice wanted outside a rehearsal but not timed
/// is counted (`deferred`).
pub(crate) fn allowed(dev: &CudaDevice) -> bool {
    if dev.work().stream().is_none() {
        return false;
    }
    let ok = crate::backend::cuda::device::graph::capturing().is_none() && dev.capture.lock().is_none();
    if !ok {
        DEFERRED.with(|d| d.set(d.get() + 1));
    }
    ok
}

thread_local! {
    static DEFERRED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many choices this thread wanted timed but could not (a CUDA graph was being captured):
/// a max-autotune program that ran into one is not captured yet, or the graph would keep the
/// untimed default for good.
pub(crate) fn deferred() -> u64 {
    DEFERRED.with(|d| d.get())
}

/// The remembered winner for `key`: from memory, else from disk (then remembered). Counted.
pub(crate) fn lookup(key: &str) -> Option<String> {
    if let Some(v) = memory().lock().get(key) {
        count(|c| c.memory_hits += 1);
        return Some(v.clone());
    }
    let text = std::fs::read_to_string(file_of(key)?).ok()?;
    // The file holds the key (checked: a hash collision must not pick another problem's
    // winner) and the value.
    let (k, v) = text.split_once('\n')?;
    if k != key {
        return None;
    }
    let v = v.trim_end().to_string();
    memory().lock().insert(key.to_string(), v.clone());
    count(|c| c.disk_hits += 1);
    log(Topic::Kernels, || format!("autotune: {key} -> {v} (from the disk cache)"));
    Some(v)
}

/// Forgets a remembered winner that no longer works (a stale disk entry).
pub(crate) fn forget(key: &str) {
    memory().lock().remove(key);
}

/// Remembers the winner for `key` in memory and on disk (written to a temporary name and
/// renamed, so a concurrent reader never sees half a file). Counted as one timed choice.
pub(crate) fn store(key: &str, value: &str) {
    count(|c| c.timed += 1);
    memory().lock().insert(key.to_string(), value.to_string());
    let Some(path) = file_of(key) else { return };
    let Some(d) = path.parent() else { return };
    let _ = std::fs::create_dir_all(d);
    let _ = crate::files::write_atomically(&path, format!("{key}\n{value}\n").as_bytes());
}

/// Median device time (ms) of `f` on `dev` over a few runs after one warm-up. `None` when a run
/// fails (that candidate is skipped).
pub(crate) fn time_ms(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Option<f64> {
    crate::backend::cuda::Event::median_ms(&Device::Cuda(dev.ordinal), 1, 5, &mut f).ok()
}

/// Picks the fastest of `candidates` (label, time) and logs every timing under `kernels`.
pub(crate) fn pick<T: Clone>(what: &str, candidates: &[(String, T, Option<f64>)]) -> Option<(usize, T)> {
    let best = candidates.iter().enumerate().filter_map(|(i, c)| c.2.map(|t| (i, t))).min_by(|a, b| a.1.total_cmp(&b.1));
    log(Topic::Kernels, || {
        let mut s = format!("autotune {what}:");
        for (i, (label, _, t)) in candidates.iter().enumerate() {
            let mark = if best.map(|b| b.0) == Some(i) { "  <- fastest" } else { "" };
            match t {
                Some(t) => s += &format!("\n  {label}: {:.4} ms{mark}", t),
                None => s += &format!("\n  {label}: failed"),
            }
        }
        s
    });
    best.map(|(i, _)| (i, candidates[i].1.clone()))
}
