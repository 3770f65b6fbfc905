//! The NCCL backend: one communicator per group, one GPU per rank. Collectives run on the
//! group's own stream, after the work already queued on the device's stream (the capture stream
//! while a CUDA graph is being captured, so a replayed step runs its all-reduces inside the
//! graph); `Work::wait` orders later work on the device's stream after them. Between the two,
//! the device's kernels and the communication overlap, as DDP's buckets need. The tensor is
//! kept alive until then, so its memory is not reused while NCCL still reads or writes it.
//! libnccl is loaded at run time; a machine without it gets an error naming the library.
//! A watchdog (`watchdog.rs`) follows the collectives queued outside CUDA graph capture and
//! aborts the communicator when one outlives the group's timeout or NCCL reports an error.

use super::watchdog::{Progress, Watchdog};
use super::{ReduceOp, Work};
use crate::backend::cuda::device::CudaDevice;
use crate::storage::BackendStorage;
use crate::{DType, Error, Result, Tensor};
use cudarc::nccl::{result, sys};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub(crate) struct NcclGroup {
    comm: Arc<Comm>,
    dev: Arc<CudaDevice>,
    stream: Arc<cudarc::driver::CudaStream>,
    /// Its closures hold the communicator too, so it is destroyed only once this thread stops.
    watchdog: Watchdog,
}

struct Comm {
    raw: sys::ncclComm_t,
    /// Held while a call uses the communicator (one at a time).
    calls: Mutex<()>,
    /// `ncclCommAbort` freed it: nothing may use it again.
    aborted: AtomicBool,
}
// SAFETY: calls on the communicator take `calls`, but for the watchdog's abort of last resort,
// which NCCL allows from another thread while a call is blocked.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Comm {
    /// Ends the collectives in flight and frees the communicator (the watchdog's last resort,
    /// after it has set the group's error). Waits a moment for a call in progress; one blocked
    /// on a dead peer is what the abort ends, so it does not wait for that.
    fn abort(&self) {
        let _call = self.calls.try_lock_for(std::time::Duration::from_secs(1));
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: the communicator was initialised; `aborted` keeps every later call off it.
            unsafe {
                let _ = result::comm_abort(self.raw);
            }
        }
    }

    /// The error NCCL found on its own (a peer's connection lost, say), if any; not asked
    /// while a call holds the communicator (the next poll asks).
    fn async_error(&self) -> Option<String> {
        let _call = self.calls.try_lock()?;
        if self.aborted.load(Ordering::Acquire) {
            return None;
        }
        let mut e = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live; `e` is written by NCCL.
        let r = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut e) };
        match (r, e) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => None,
            (sys::ncclResult_t::ncclSuccess, e) => Some(format!("{e:?}")),
            (r, _) => Some(format!("ncclCommGetAsyncError: {r:?}")),
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !*self.aborted.get_mut() {
            // SAFETY: the communicator was initialised and is no longer used.
            unsafe {
                let _ = result::comm_destroy(self.raw);
            }
        }
    }
}

fn nccl_err(op: &'static str, e: impl std::fmt::Debug) -> Error {
    Error::dist(op, format!("NCCL: {e:?}"))
}

impl NcclGroup {
    /// Rank 0 makes the unique id and publishes it in `store`; every rank then joins the
    /// communicator on GPU `local_rank`.
    pub(crate) fn connect(store: &super::store::Store, prefix: &str, rank: usize, world: usize, local_rank: usize, timeout: std::time::Duration) -> Result<NcclGroup> {
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::dist("init", "the NCCL backend needs libnccl.so.2, which this machine does not have (the TCP backend needs nothing)"));
        }
        let dev = crate::backend::cuda::device::device(local_rank)?;
        dev.bind()?;
        let key = format!("{prefix}/nccl/id");
        let id = if rank == 0 {
            let id = result::get_uniqueid().map_err(|e| nccl_err("init", e))?;
            store.set(&key, &id.internal.iter().map(|&c| c as u8).collect::<Vec<u8>>())?;
            id
        } else {
            let bytes = store.get(&key).map_err(|e| Error::dist("init", format!("rank 0 never published NCCL's id ({e})")))?;
            if bytes.len() != 128 {
                return Err(Error::dist("init", format!("NCCL's id from the store has {} bytes, not 128", bytes.len())));
            }
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            for (d, s) in id.internal.iter_mut().zip(&bytes) {
                *d = *s as _;
            }
            id
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL; every rank passes the same id and world size.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }.map_err(|e| nccl_err("init", e))?;
        let stream = dev.ctx.new_stream().map_err(|e| dev.err("stream", e))?;
        let comm = Arc::new(Comm { raw: comm, calls: Mutex::new(()), aborted: AtomicBool::new(false) });
        let (health, abort) = (comm.clone(), comm.clone());
        let poll = std::time::Duration::from_millis(100);
        let watchdog = Watchdog::start(store, &format!("{prefix}/nccl"), rank, world, timeout, poll, move || health.async_error(), move || abort.abort())?;
        Ok(NcclGroup { comm, dev, stream, watchdog })
    }

    /// The group's error, once its watchdog has aborted it.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        self.watchdog.check(op)
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.dev.ordinal
    }

    /// Runs `f` with the communicator on the group's stream, once the work queued so far on
    /// this thread's stream is done (nothing in a rehearsal, which runs the host side only).
    fn queue(&self, op: &'static str, t: &Tensor, f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<result::NcclStatus, result::NcclError>) -> Result<Work> {
        self.watchdog.check(op)?;
        self.dev.bind()?;
        let Some(work) = self.dev.work().stream() else { return Ok(Work::queued()) };
        self.stream.join(work).map_err(|e| self.dev.err("stream wait", e))?;
        {
            let _call = self.comm.calls.lock();
            if self.comm.aborted.load(Ordering::Acquire) {
                // The watchdog set the group's error before aborting.
                return Err(self.watchdog.check(op).err().unwrap_or_else(|| Error::dist(op, "the communicator was aborted")));
            }
            f(self.comm.raw, self.stream.cu_stream() as sys::cudaStream_t).map_err(|e| nccl_err(op, e))?;
        }
        let done = self.stream.record_event(None).map_err(|e| self.dev.err("event", e))?;
        // Captured into a CUDA graph, the call runs at each replay: nothing to follow now.
        if crate::backend::cuda::device::graph::capturing().is_none() {
            let followed = self.stream.record_event(None).map_err(|e| self.dev.err("event", e))?;
            self.watchdog.issued(op, move || match followed.try_is_complete() {
                Ok(true) => Progress::Done,
                Ok(false) => Progress::Running,
                Err(e) => Progress::Failed(format!("CUDA: {e:?}")),
            });
        }
        Ok(Work::on_stream(done, work.clone(), t.clone()))
    }

    pub(crate) fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        let (ptr, n, dt) = pointer(t)?;
        let (ty, red) = (nccl_type(t.dtype())?, nccl_op(dt, op));
        let r = self.queue("all_reduce", t, |c, s| unsafe { result::all_reduce(ptr as *const c_void, ptr as *mut c_void, n, ty, red, c, s) });
        t.storage().bump_version();
        r
    }

    pub(crate) fn broadcast(&self, t: &Tensor, src: usize) -> Result<Work> {
        let (ptr, n, _) = pointer(t)?;
        let ty = nccl_type(t.dtype())?;
        let r = self.queue("broadcast", t, |c, s| unsafe { result::broadcast(ptr as *const c_void, ptr as *mut c_void, n, ty, src as i32, c, s) });
        t.storage().bump_version();
        r
    }

    pub(crate) fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<Work> {
        let ((o, _, _), (i, n, _)) = (pointer(out)?, pointer(input)?);
        let ty = nccl_type(input.dtype())?;
        let r = self.queue("all_gather", out, |c, s| unsafe { result::all_gather(i as *const c_void, o as *mut c_void, n, ty, c, s) });
        out.storage().bump_version();
        r
    }

    pub(crate) fn reduce_scatter(&self, out: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        let ((o, n, dt), (i, _, _)) = (pointer(out)?, pointer(input)?);
        let (ty, red) = (nccl_type(dt)?, nccl_op(dt, op));
        let r = self.queue("reduce_scatter", out, |c, s| unsafe { result::reduce_scatter(i as *const c_void, o as *mut c_void, n, ty, red, c, s) });
        out.storage().bump_version();
        r
    }

    pub(crate) fn send(&self, t: &Tensor, dst: usize) -> Result<Work> {
        let (p, n, dt) = pointer(t)?;
        let ty = nccl_type(dt)?;
        self.queue("send", t, |c, s| unsafe { result::send(p as *const c_void, n, ty, dst as i32, c, s) })
    }

    pub(crate) fn recv(&self, t: &Tensor, src: usize) -> Result<Work> {
        let (p, n, dt) = pointer(t)?;
        let ty = nccl_type(dt)?;
        let r = self.queue("recv", t, |c, s| unsafe { result::recv(p as *mut c_void, n, ty, src as i32, c, s) });
        t.storage().bump_version();
        r
    }
}

/// The device address of a contiguous CUDA tensor's first element, its length and dtype.
fn pointer(t: &Tensor) -> Result<(u64, usize, DType)> {
    let data = t.storage().data.read();
    let BackendStorage::Cuda(s) = &*data else {
        return Err(Error::dist("collective", "the NCCL backend takes CUDA tensors"));
    };
    Ok((s.block.ptr + (t.storage_offset() * t.dtype().size_in_bytes()) as u64, t.numel(), t.dtype()))
}

fn nccl_type(dt: DType) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t::*;
    Ok(match dt {
        DType::F32 => ncclFloat32,
        DType::F64 => ncclFloat64,
        DType::F16 => ncclFloat16,
        DType::BF16 => ncclBfloat16,
        DType::I64 => ncclInt64,
        DType::I32 => ncclInt32,
        DType::U8 | DType::Bool => ncclUint8,
    })
}

/// Booleans reduce as bytes: a sum or maximum is their "or", a minimum their "and".
fn nccl_op(dt: DType, op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t::*;
    match (op, dt) {
        (ReduceOp::Sum, DType::Bool) | (ReduceOp::Max, _) => ncclMax,
        (ReduceOp::Sum, _) => ncclSum,
        (ReduceOp::Avg, _) => ncclAvg,
        (ReduceOp::Min, _) => ncclMin,
    }
}
