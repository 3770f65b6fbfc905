//! Fork-join for mid-sized work (the MLP step's 32x784x256 product), with helper threads that
//! keep spinning for a while after each job instead of sleeping, as OpenMP's threads do for
//! PyTorch. Waking a sleeping rayon worker costs a small machine more than a second core saves
//! on such work (`bench/results/compare-cpu-2026-12-04b.txt`); a training step calls again
//! long before the spin window ends, so its helpers stay awake.
//!
//! One caller at a time: a thread that finds the helpers busy runs every part itself.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper spins for the next job before it parks.
const SPIN: Duration = Duration::from_millis(2);
/// Most helpers (the caller works too).
const MAX_HELPERS: usize = 7;

/// One part of a split job, on the caller's stack until every part is done.
struct Part<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    index: usize,
    done: AtomicBool,
    panicked: AtomicBool,
}

struct Helper {
    /// The part to run, or null.
    job: AtomicPtr<Part<'static>>,
    sleeping: AtomicBool,
    thread: Thread,
}

struct Helpers {
    list: Vec<&'static Helper>,
    /// Held by the one caller using the helpers.
    busy: Mutex<()>,
}

fn helpers() -> &'static Helpers {
    static H: OnceLock<Helpers> = OnceLock::new();
    H.get_or_init(|| {
        let n = rayon::current_num_threads().saturating_sub(1).min(MAX_HELPERS);
        let list = (0..n).filter_map(|k| spawn(k).ok()).collect();
        Helpers { list, busy: Mutex::new(()) }
    })
}

fn spawn(k: usize) -> std::io::Result<&'static Helper> {
    let (tx, rx) = std::sync::mpsc::channel::<&'static Helper>();
    std::thread::Builder::new().name(format!("kiln-spin-{k}")).spawn(move || {
        // Lives as long as the process, as the pool's threads do.
        let me: &'static Helper = Box::leak(Box::new(Helper { job: AtomicPtr::new(std::ptr::null_mut()), sleeping: AtomicBool::new(false), thread: std::thread::current() }));
        let _ = tx.send(me);
        serve(me);
    })?;
    rx.recv().map_err(|_| std::io::Error::other("the helper thread did not start"))
}

fn serve(me: &Helper) {
    let mut idle_since = Instant::now();
    loop {
        let p = me.job.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: the caller keeps the part alive until `done` is set (`Joined`).
            let part = unsafe { &*p };
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (part.f)(part.index))).is_ok();
            part.panicked.store(!ok, Ordering::Relaxed);
            part.done.store(true, Ordering::Release);
            idle_since = Instant::now();
            continue;
        }
        if idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        // Sleeping is announced before the last look for a job, and a caller posts its job
        // before it looks whether to wake us (both SeqCst): one of the two sees the other.
        me.sleeping.store(true, Ordering::SeqCst);
        if me.job.load(Ordering::SeqCst).is_null() {
            std::thread::park();
        }
        me.sleeping.store(false, Ordering::SeqCst);
        idle_since = Instant::now();
    }
}

/// Waits, even while unwinding, for the parts handed to helpers (they borrow the caller's stack).
struct Joined<'a, 'p>(&'a [Part<'p>]);

impl Drop for Joined<'_, '_> {
    fn drop(&mut self) {
        for p in self.0 {
            while !p.done.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
        }
    }
}

/// How many parts `run` splits work into on this machine (1 where there is no helper).
pub(crate) fn parts() -> usize {
    helpers().list.len() + 1
}

/// Runs `f(0)`, ..., `f(n - 1)` (n at most `parts()`), part 0 on this thread and the others on
/// the helpers; every part has run when it returns. A part that panics panics here.
pub(crate) fn run(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let h = helpers();
    let guard = if n > 1 { h.busy.try_lock() } else { None };
    let Some(_guard) = guard else {
        (0..n).for_each(f);
        return;
    };
    let n = n.min(h.list.len() + 1);
    let handed: Vec<Part<'_>> = (1..n).map(|index| Part { f, index, done: AtomicBool::new(false), panicked: AtomicBool::new(false) }).collect();
    let joined = Joined(&handed);
    for (p, helper) in handed.iter().zip(&h.list) {
        // SAFETY (lifetime): `joined` waits for the part before `handed` goes away.
        helper.job.store(p as *const Part<'_> as *mut Part<'static>, Ordering::SeqCst);
        if helper.sleeping.load(Ordering::SeqCst) {
            helper.thread.unpark();
        }
    }
    f(0);
    drop(joined);
    if handed.iter().any(|p| p.panicked.load(Ordering::Relaxed)) {
        panic!("a part of a split host job panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_part_runs_once_whether_helpers_are_awake_asleep_or_busy() {
        let n = parts();
        for pause in [0u64, 5] {
            // After 5 ms the helpers have parked: the call must wake them.
            std::thread::sleep(Duration::from_millis(pause));
            let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            run(n, &|i| {
                counts[i].fetch_add(1, Ordering::SeqCst);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::SeqCst) == 1));
        }
        // Callers side by side: one gets the helpers, the others run their parts themselves.
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        run(n, &|_| {
                            total.fetch_add(1, Ordering::SeqCst);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::SeqCst), 4 * 100 * n);
    }
}
