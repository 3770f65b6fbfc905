//! A compiled program's kernels compiled side by side before its first run.
//!
//! Kernels are compiled when they first launch, one after another: the 47 of a small
//! transformer took seconds of NVRTC on one core. A rehearsal runs the program's host side once
//! with the device left alone (no launches, copies, library products or generator draws),
//! collecting every kernel it would load; NVRTC compiles them on all cores at once, and the
//! real run that follows finds them loaded. Sources depend only on shapes, dtypes, strides
//! and alignments, which the rehearsal computes exactly as the real run does.

use crate::backend::cuda::{device::nvrtc, CudaDevice, Kernel, KernelKey};
use crate::logging::{log, Topic};
use crate::Result;
use rayon::prelude::*;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static BUILT_AHEAD: AtomicU64 = AtomicU64::new(0);

/// Kernels this process built in rehearsals, ahead of their first launch.
pub fn kernels_built_ahead() -> u64 {
    BUILT_AHEAD.load(Ordering::Relaxed)
}

/// A kernel the rehearsal asked for.
struct Wanted {
    dev: Arc<CudaDevice>,
    key: KernelKey,
    name: String,
    src: String,
    options: Vec<String>,
}

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    static WANTED: RefCell<Vec<Wanted>> = const { RefCell::new(Vec::new()) };
}

/// Whether this thread is rehearsing: device work is skipped, kernels are only collected.
#[inline]
pub(crate) fn active() -> bool {
    ACTIVE.with(|a| a.get())
}

/// Whether this rehearsal has already noted the kernel of `key`.
pub(crate) fn wanted(key: &KernelKey) -> bool {
    WANTED.with(|w| w.borrow().iter().any(|x| &x.key == key))
}

/// Notes a kernel the rehearsal would load (the caller checked `wanted` first).
pub(crate) fn want(dev: &CudaDevice, key: KernelKey, name: String, src: String, options: &[String]) -> Result<Kernel> {
    let dev = crate::backend::cuda::device(dev.ordinal)?;
    WANTED.with(|w| w.borrow_mut().push(Wanted { dev, key, name, src, options: options.to_vec() }));
    Ok(Kernel::REHEARSED)
}

/// Turns rehearsal off again, also when the rehearsed code panics.
struct Active;
impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(false));
    }
}

/// Runs `f` as a rehearsal, then compiles the kernels it asked for on all cores and loads
/// them. An error inside `f` only ends the rehearsal early (the real run reports it where it
/// happens), and so does a kernel that fails to compile (the real run compiles it again and
/// reports the error at its launch).
pub(crate) fn rehearse(f: impl FnOnce() -> Result<()>) {
    if active() || crate::backend::cuda::device::graph::capturing().is_some() {
        return;
    }
    WANTED.with(|w| w.borrow_mut().clear());
    let outcome = {
        ACTIVE.with(|a| a.set(true));
        let _on = Active;
        f()
    };
    if let Err(e) = outcome {
        log(Topic::Kernels, || format!("rehearsal stopped early: {e}"));
    }
    let wanted = WANTED.with(|w| std::mem::take(&mut *w.borrow_mut()));
    if wanted.is_empty() {
        return;
    }
    let started = std::time::Instant::now();
    let built: Vec<_> = wanted
        .par_iter()
        .map(|w| {
            let t = std::time::Instant::now();
            let ours = !matches!(w.key, KernelKey::Custom { .. });
            (nvrtc::cubin(&w.src, &w.options, ours, &w.dev.arch, w.dev.driver, w.dev.kiln_device()), t.elapsed())
        })
        .collect();
    let wall = started.elapsed();
    let mut loaded = 0;
    for (w, (cubin, took)) in wanted.into_iter().zip(built) {
        let Ok(cubin) = cubin else { continue };
        let waits = !matches!(w.key, KernelKey::Custom { .. }) && crate::backend::cuda::device::waits_for_previous(&w.src);
        if w.dev.install(w.key, w.name, cubin, took, waits).is_ok() {
            loaded += 1;
            BUILT_AHEAD.fetch_add(1, Ordering::Relaxed);
        }
    }
    log(Topic::Kernels, || format!("rehearsal: {loaded} kernel(s) built side by side in {:.1} ms", wall.as_secs_f64() * 1e3));
}
