//! The watchdog of a group whose collectives run on the device (NCCL), as PyTorch's
//! ProcessGroupNCCL has one: a collective queued on a GPU never returns an error to the host by
//! itself, and one that waits for a dead rank spins on the device for ever. A thread per group
//! follows the collectives this rank issued; when the oldest has not completed within the
//! group's timeout, or the backend reports an error of its own, it aborts the communicator
//! (which ends the collectives in flight) and keeps an error that every later call returns.
//!
//! The error names the ranks behind: each rank publishes in the store how many collectives it
//! has issued (the watchdog does, between its polls: nothing on the hot path), so a rank that
//! never issued the stuck one (dead, hung, or calling other collectives) is told apart from a
//! collective every rank issued and the device or network never finished.

use super::Store;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where one issued collective stands.
pub(crate) enum Progress {
    Done,
    Running,
    /// The backend's own error for it.
    Failed(String),
}

type ProgressFn = Box<dyn Fn() -> Progress + Send>;

pub(crate) struct Watchdog {
    state: Arc<State>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct State {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Store key of rank r's count of issued collectives: `{key}{r}`.
    key: String,
    /// The watchdog's own connection, with a short timeout.
    store: Store,
    pending: Mutex<VecDeque<Issued>>,
    issued: AtomicU64,
    error: Mutex<Option<String>>,
    stop: AtomicBool,
    /// An error the backend found on its own (NCCL's asynchronous error), if any.
    health: Box<dyn Fn() -> Option<String> + Send + Sync>,
    /// Ends the collectives in flight (NCCL: `ncclCommAbort`).
    abort: Box<dyn Fn() + Send + Sync>,
}

struct Issued {
    seq: u64,
    op: &'static str,
    since: Instant,
    progress: ProgressFn,
}

impl Watchdog {
    /// Starts the watchdog of rank `rank` of `world`, polling every `poll`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        store: &Store,
        prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
        poll: Duration,
        health: impl Fn() -> Option<String> + Send + Sync + 'static,
        abort: impl Fn() + Send + Sync + 'static,
    ) -> Result<Watchdog> {
        let key = format!("{prefix}/issued/");
        let store = store.another_client(timeout.min(Duration::from_secs(10)))?;
        store.set(&format!("{key}{rank}"), &0u64.to_le_bytes())?;
        let state = Arc::new(State {
            rank,
            world,
            timeout,
            key,
            store,
            pending: Mutex::new(VecDeque::new()),
            issued: AtomicU64::new(0),
            error: Mutex::new(None),
            stop: AtomicBool::new(false),
            health: Box::new(health),
            abort: Box::new(abort),
        });
        let s = state.clone();
        let thread = std::thread::Builder::new().name(format!("kiln-watchdog-{rank}")).spawn(move || s.watch(poll))?;
        Ok(Watchdog { state, thread: Some(thread) })
    }

    /// The group's error, once the watchdog has aborted it.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        match &*self.state.error.lock() {
            Some(e) => Err(Error::dist(op, e.clone())),
            None => Ok(()),
        }
    }

    /// A collective this rank just issued; `progress` says where it stands.
    pub(crate) fn issued(&self, op: &'static str, progress: impl Fn() -> Progress + Send + 'static) {
        let seq = self.state.issued.fetch_add(1, Ordering::AcqRel) + 1;
        self.state.pending.lock().push_back(Issued { seq, op, since: Instant::now(), progress: Box::new(progress) });
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl State {
    fn watch(&self, poll: Duration) {
        let mut published = 0;
        while !self.stop.load(Ordering::Acquire) {
            std::thread::sleep(poll);
            if let Some(why) = self.verdict() {
                crate::logging::warn(crate::logging::Topic::Sync, &format!("rank {}: {why}", self.rank));
                // Set first: a call that finds the communicator aborted returns this error.
                *self.error.lock() = Some(why);
                (self.abort)();
                return;
            }
            let issued = self.issued.load(Ordering::Acquire);
            if issued != published && self.store.set(&format!("{}{}", self.key, self.rank), &issued.to_le_bytes()).is_ok() {
                published = issued;
            }
        }
    }

    /// Why the group must be aborted, if it must: drops completed collectives from the front.
    fn verdict(&self) -> Option<String> {
        if let Some(e) = (self.health)() {
            return Some(format!("the communicator failed ({e}); it was aborted"));
        }
        let mut pending = self.pending.lock();
        while let Some(c) = pending.front() {
            match (c.progress)() {
                Progress::Done => {
                    pending.pop_front();
                }
                Progress::Failed(e) => return Some(format!("{} #{} failed ({e}); the communicator was aborted", c.op, c.seq)),
                Progress::Running if c.since.elapsed() < self.timeout => return None,
                Progress::Running => {
                    let (op, seq, secs) = (c.op, c.seq, c.since.elapsed().as_secs_f64());
                    drop(pending);
                    return Some(format!("{op} #{seq} did not complete within {secs:.0} s; {}; the communicator was aborted", self.who(seq)));
                }
            }
        }
        None
    }

    /// Which ranks had not issued collective `seq`, from what they published in the store.
    fn who(&self, seq: u64) -> String {
        let mut behind = Vec::new();
        for r in (0..self.world).filter(|&r| r != self.rank) {
            match self.store.get(&format!("{}{r}", self.key)) {
                Ok(v) if v.len() == 8 => {
                    let n = u64::from_le_bytes(v.try_into().expect("8 bytes"));
                    if n < seq {
                        behind.push(format!("rank {r} (its last was #{n})"));
                    }
                }
                Ok(_) => behind.push(format!("rank {r} (unreadable count)")),
                Err(e) => return format!("the store on rank 0 does not answer, so rank 0 is gone ({e})"),
            }
        }
        if behind.is_empty() {
            "every rank issued it, so a rank's device or the network between them failed".into()
        } else {
            format!("{} never issued it (dead, hung, or calling other collectives)", behind.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn store_pair() -> (Store, Store) {
        let server = Store::serve("127.0.0.1", 0, Duration::from_secs(5)).unwrap();
        let port = server.server_port().expect("serving");
        (server, Store::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap())
    }

    fn dog(store: &Store, rank: usize, aborted: Arc<AtomicUsize>) -> Watchdog {
        let poll = Duration::from_millis(5);
        Watchdog::start(store, "t", rank, 2, Duration::from_millis(400), poll, || None, move || {
            aborted.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap()
    }

    #[test]
    fn a_collective_another_rank_never_issued_aborts_the_group_naming_that_rank() {
        let (s0, s1) = store_pair();
        let (a0, a1) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (w0, w1) = (dog(&s0, 0, a0.clone()), dog(&s1, 1, a1.clone()));
        // Both ranks issue two collectives that complete; rank 0 issues a third, which waits for rank 1.
        for w in [&w0, &w1] {
            w.issued("all_reduce", || Progress::Done);
            w.issued("broadcast", || Progress::Done);
        }
        w0.issued("all_reduce", || Progress::Running);
        std::thread::sleep(Duration::from_millis(1200));
        let e = w0.check("all_reduce").unwrap_err().to_string();
        assert!(e.contains("all_reduce #3") && e.contains("rank 1 (its last was #2) never issued it"), "{e}");
        assert_eq!(a0.load(Ordering::SeqCst), 1, "aborted once");
        assert!(w1.check("all_reduce").is_ok(), "rank 1 had nothing in flight");
        assert_eq!(a1.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_collective_every_rank_issued_blames_the_device_or_network_and_backend_errors_abort_at_once() {
        let (s0, s1) = store_pair();
        let a = Arc::new(AtomicUsize::new(0));
        let (w0, w1) = (dog(&s0, 0, a.clone()), dog(&s1, 1, Arc::new(AtomicUsize::new(0))));
        w0.issued("all_reduce", || Progress::Running);
        w1.issued("all_reduce", || Progress::Done);
        std::thread::sleep(Duration::from_millis(1200));
        let e = w0.check("barrier").unwrap_err().to_string();
        assert!(e.contains("every rank issued it"), "{e}");
        // The backend's own error needs no timeout.
        let failed = Watchdog::start(&Store::serve("127.0.0.1", 0, Duration::from_secs(5)).unwrap(), "u", 0, 1, Duration::from_secs(60), Duration::from_millis(5), || Some("ncclRemoteError".into()), || {}).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(failed.check("send").unwrap_err().to_string().contains("ncclRemoteError"));
    }

    #[test]
    fn completed_collectives_never_trip_the_watchdog() {
        let (s0, _s1) = store_pair();
        let a = Arc::new(AtomicUsize::new(0));
        let w = dog(&s0, 0, a.clone());
        let t0 = Instant::now();
        // Done after 100 ms: within the timeout.
        w.issued("all_reduce", move || if t0.elapsed() > Duration::from_millis(100) { Progress::Done } else { Progress::Running });
        std::thread::sleep(Duration::from_millis(800));
        assert!(w.check("all_reduce").is_ok());
        assert_eq!(a.load(Ordering::SeqCst), 0);
    }
}
