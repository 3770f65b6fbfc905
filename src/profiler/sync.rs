//! Sync debug mode: every host synchronisation reported with the call site that caused it.
//!
//! The call site travels by `#[track_caller]` from the public read (`to_vec`, `item`,
//! `to_device` to the host, `cuda::synchronize`) down to the synchronisation. Reads of CPU
//! tensors wait for nothing and are not reported; an explicit `cuda::synchronize` is reported
//! on every device, the CPU included, so the mode can be checked on a machine without a GPU.
//! Printing a CUDA tensor synchronises too, but formatting traits cannot carry the caller's
//! location: its report names kiln's `Display` implementation, and in `Error` mode the tensor
//! prints as its description (`Tensor[shape, dtype, device]`), formatting having no way to fail
//! with a kiln error.

use super::record::{self, Span};
use crate::logging::{self, Topic};
use crate::{Device, Error, Result};
use std::cell::Cell;
use std::panic::Location;
use std::sync::atomic::{AtomicU8, Ordering};

/// What a host synchronisation does besides waiting (`torch.cuda.set_sync_debug_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncDebug {
    /// Nothing (`KILN_LOG=sync` still logs each one).
    #[default]
    Off,
    /// One warning line per synchronisation, with its call site, through the `log` facade
    /// (target `kiln::sync`).
    Warn,
    /// The synchronising call returns `Error::Sync` naming its call site instead of waiting.
    Error,
}

static MODE: AtomicU8 = AtomicU8::new(0);

thread_local! {
    static OVERRIDE: Cell<Option<SyncDebug>> = const { Cell::new(None) };
}

/// Sets the mode for every thread (except inside [`with_sync_debug_mode`]).
pub fn set_sync_debug_mode(mode: SyncDebug) {
    MODE.store(mode as u8, Ordering::Relaxed);
}

/// The mode in effect on this thread.
pub fn sync_debug_mode() -> SyncDebug {
    OVERRIDE.with(|o| o.get()).unwrap_or(match MODE.load(Ordering::Relaxed) {
        1 => SyncDebug::Warn,
        2 => SyncDebug::Error,
        _ => SyncDebug::Off,
    })
}

/// Runs `f` with `mode` on this thread only (other threads keep theirs): a region where no
/// synchronisation is expected can be checked while other threads go on.
pub fn with_sync_debug_mode<T>(mode: SyncDebug, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<SyncDebug>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(mode))));
    f()
}

/// Hook: the host is about to wait for `device` (`what` says why), called from `at`. Reports it
/// as the mode asks, records it when profiling, and in `Error` mode refuses.
pub(crate) fn sync(what: &'static str, device: Device, at: &'static Location<'static>) -> Result<Span> {
    let at = record::caller_of(at);
    let report = || format!("{what} on {device}: host synchronisation at {}:{}:{}", at.file(), at.line(), at.column());
    match sync_debug_mode() {
        SyncDebug::Off => logging::log(Topic::Sync, report),
        SyncDebug::Warn => logging::warn(Topic::Sync, &report()),
        SyncDebug::Error => return Err(Error::Sync { what, device, at: format!("{}:{}:{}", at.file(), at.line(), at.column()) }),
    }
    Ok(record::sync(what, device, at))
}
