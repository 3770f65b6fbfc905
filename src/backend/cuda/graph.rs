//! CUDA graphs: the launches of one compiled call captured on the device's stream, then
//! replayed with one driver call. Memory allocated during capture belongs to the graph (its
//! kernels read and write those addresses at every replay) and is reused only inside it.

use super::alloc::Block;
use super::CudaDevice;
use crate::{Error, Result};
use cudarc::driver::sys as ds;
use std::sync::Arc;

thread_local! {
    /// The device this thread is capturing a graph on.
    static CAPTURING: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// The names of the kernels (library calls) captured so far, for the profiler's replays.
    static CAPTURED: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Notes a kernel or library call while this thread captures a graph (the profiler hooks call
/// this whether or not a profile is being taken).
#[inline]
pub(crate) fn note_captured(name: impl FnOnce() -> String) {
    if capturing().is_some() {
        CAPTURED.with(|c| c.borrow_mut().push(name()));
    }
}

/// The device this thread is capturing a graph on, if any.
pub(crate) fn capturing() -> Option<usize> {
    CAPTURING.with(|c| c.get())
}

/// The blocks a capture allocated, and those of them free again for later steps of the capture.
#[derive(Default)]
pub(crate) struct CapturePool {
    pub(crate) blocks: Vec<Block>,
    free: Vec<Block>,
}

impl CapturePool {
    /// A free block that fits `bytes` without wasting more than half of it.
    pub(crate) fn take(&mut self, bytes: usize) -> Option<Block> {
        let i = self.free.iter().position(|b| b.size >= bytes && b.size <= 2 * bytes.max(512))?;
        Some(self.free.swap_remove(i))
    }
    pub(crate) fn give_back(&mut self, b: Block) {
        if self.blocks.iter().any(|x| x.ptr == b.ptr) {
            self.free.push(b);
        }
    }
}

/// A captured launch list, replayable on its device's stream.
pub(crate) struct Graph {
    graph: cudarc::driver::CudaGraph,
    blocks: Vec<Block>,
    dev: Arc<CudaDevice>,
    /// Kernels launched while capturing.
    pub(crate) kernels: u64,
    /// What the profiler shows for each replay: the captured kernels and library calls.
    work: Vec<String>,
}

// SAFETY: the graph handles are used under the caller's lock, from any thread that binds the
// context (as every launch does).
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

/// Captures what `f` launches on `dev`'s stream (nothing runs) into a graph.
#[track_caller]
pub(crate) fn capture<T>(dev: &Arc<CudaDevice>, f: impl FnOnce() -> Result<T>) -> Result<(Graph, T)> {
    dev.synchronize("graph capture")?;
    let mut slot = dev.capture.lock();
    if slot.is_some() {
        return Err(Error::Compile("another thread is capturing a CUDA graph on this device".into()));
    }
    *slot = Some(CapturePool::default());
    drop(slot);
    let launches = super::launch_count();
    let cs = &dev.capture_stream;
    let begun = cs.begin_capture(ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(|e| dev.err("begin capture", e));
    CAPTURED.with(|c| c.borrow_mut().clear());
    CAPTURING.with(|c| c.set(Some(dev.ordinal)));
    let r = begun.and_then(|_| f());
    CAPTURING.with(|c| c.set(None));
    let work = CAPTURED.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let ended = cs.end_capture(ds::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    let pool = dev.capture.lock().take().unwrap_or_default();
    let kernels = super::launch_count() - launches;
    let fail = |e: Error| {
        // Nothing captured ran: the blocks go back.
        let mut owned = dev.graph_blocks.lock();
        for b in &pool.blocks {
            owned.remove(&b.ptr);
        }
        drop(owned);
        for b in &pool.blocks {
            dev.release(*b);
        }
        Err(e)
    };
    let value = match r {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    match ended {
        Ok(Some(graph)) => Ok((Graph { graph, blocks: pool.blocks, dev: dev.clone(), kernels, work }, value)),
        Ok(None) => fail(Error::Compile("the captured CUDA graph is empty".into())),
        Err(e) => fail(dev.err("end capture", e)),
    }
}

/// A device-to-device copy inside a captured graph whose addresses change before each replay
/// (a call's arguments copied into the graph's static inputs, its outputs copied out into
/// fresh tensors), so the copies cost no launches of their own.
pub(crate) struct CopyNode {
    node: ds::CUgraphNode,
    bytes: usize,
}
// SAFETY: a handle into a graph that lives as long as the `Graph` holding it, used under the
// same lock.
unsafe impl Send for CopyNode {}
unsafe impl Sync for CopyNode {}

/// Inside `capture`: copies `bytes` from `src` to `dst` on the capture stream and returns the
/// node the copy became; None when the driver does not say which node that is.
pub(crate) fn captured_copy(dev: &CudaDevice, dst: u64, src: u64, bytes: usize) -> Result<Option<CopyNode>> {
    let stream = dev.work_stream().cu_stream();
    // SAFETY: both ranges hold `bytes` on this device; the stream is capturing (nothing runs).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream) }.map_err(|e| dev.err("copy", e))?;
    let mut status = ds::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph) = (0u64, std::ptr::null_mut());
    let (mut deps, mut edges, mut n): (*const ds::CUgraphNode, *const ds::CUgraphEdgeData, usize) = (std::ptr::null(), std::ptr::null(), 0);
    // SAFETY: plain out-parameters; `deps` points at `n` nodes until the next capture call.
    let st = unsafe { ds::cuStreamGetCaptureInfo_v3(stream, &mut status, &mut id, &mut graph, &mut deps, &mut edges, &mut n) };
    if st != ds::CUresult::CUDA_SUCCESS || status != ds::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || n != 1 || deps.is_null() {
        return Ok(None);
    }
    // SAFETY: checked above: one node.
    Ok(Some(CopyNode { node: unsafe { *deps }, bytes }))
}

impl Graph {
    /// Points a captured copy at new addresses (of the same size) for the next replays.
    pub(crate) fn set_copy(&self, c: &CopyNode, dst: u64, src: u64) -> Result<()> {
        let device = ds::CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let p = ds::CUDA_MEMCPY3D {
            srcXInBytes: 0,
            srcY: 0,
            srcZ: 0,
            srcLOD: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            reserved0: std::ptr::null_mut(),
            srcPitch: c.bytes,
            srcHeight: 1,
            dstXInBytes: 0,
            dstY: 0,
            dstZ: 0,
            dstLOD: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            reserved1: std::ptr::null_mut(),
            dstPitch: c.bytes,
            dstHeight: 1,
            WidthInBytes: c.bytes,
            Height: 1,
            Depth: 1,
        };
        // SAFETY: the node belongs to the graph this executable was made from; both addresses
        // hold `bytes` on the graph's device and stay alive until the replay has run.
        let st = unsafe { ds::cuGraphExecMemcpyNodeSetParams(self.graph.cu_graph_exec(), c.node, &p, self.dev.ctx.cu_ctx()) };
        if st != ds::CUresult::CUDA_SUCCESS {
            return Err(self.dev.err("graph copy update", st));
        }
        Ok(())
    }

    /// Runs the graph on the device's stream, in order with the work around it.
    pub(crate) fn replay(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: a live instantiated graph; its buffers belong to it or to tensors it keeps.
        unsafe { cudarc::driver::result::graph::launch(self.graph.cu_graph_exec(), self.dev.stream.cu_stream()) }
            .map_err(|e| self.dev.err("graph launch", e))?;
        super::count_launches(self.kernels);
        crate::profiler::graph_replay(&self.dev, &self.work);
        Ok(())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // Its kernels may still run: wait, then give its memory back.
        let _ = self.dev.stream.synchronize();
        let _ = self.dev.capture_stream.synchronize();
        let mut owned = self.dev.graph_blocks.lock();
        for b in &self.blocks {
            owned.remove(&b.ptr);
        }
        drop(owned);
        for b in &self.blocks {
            self.dev.release(*b);
        }
    }
}
