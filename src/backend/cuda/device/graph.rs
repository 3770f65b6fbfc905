//! CUDA graphs: the launches of one compiled call captured on the device's stream, then
//! replayed with one driver call. Memory allocated during capture belongs to the graph (its
//! kernels read and write those addresses at every replay) and is reused only inside it.
//!
//! Capture on one stream orders every launch after the one before. The program marks where
//! each of its steps ends and what device memory it reads and writes (`end_step`); before the
//! graph is instantiated, each step waits only for the earlier steps it conflicts with
//! (`Steps::end`), so independent steps — a gradient's bias sum beside the next
//! product, the updates of different parameters — run side by side at each replay.

use crate::backend::cuda::device::alloc::Block;
use crate::backend::cuda::{CudaDevice, ErrorWord};
use crate::{Error, Result};
use cudarc::driver::sys as ds;
use std::sync::Arc;

thread_local! {
    /// The device this thread is capturing a graph on.
    static CAPTURING: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// The names of the kernels (library calls) captured so far, for the profiler's replays.
    static CAPTURED: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The steps captured so far: the nodes each ended on, and what it touched.
    static STEPS: std::cell::RefCell<Steps> = std::cell::RefCell::new(Steps::default());
    /// The error word of the graph being captured (its kernels report bad indices there).
    static CAPTURE_WORD: std::cell::RefCell<Option<Arc<ErrorWord>>> = const { std::cell::RefCell::new(None) };
}

/// The steps of the capture in progress.
#[derive(Default)]
struct Steps {
    /// The steps that captured work, with the nodes each ended on and what it touched.
    done: Vec<(Vec<usize>, Footprint)>,
    /// Blocks handed out since the last step ended (its scratch memory among them).
    allocated: Vec<(u64, u64)>,
    /// Set when the driver did not say where a step ended: the graph keeps the captured order.
    unknown: bool,
    /// Whether the step being captured uses shared scratch memory.
    shared_scratch: bool,
    /// Every done step's waits, direct or not.
    ancestry: Ancestry,
    /// Per done step, the earlier steps it must wait for: those it conflicts with (one writes
    /// memory the other reads or writes), with every wait another one already implies left out.
    deps: Vec<Vec<usize>>,
    /// The steps the step being captured waits for through what it reads (`begin_step`): a
    /// buffer only those touched can be handed to it without a new wait.
    open: Option<Vec<u64>>,
}

impl Steps {
    /// A step that reads `reads` begins.
    fn begin(&mut self, reads: Vec<(u64, u64)>) {
        let reads = Footprint { reads, ..Footprint::default() };
        self.open = Some(self.ancestry.waits(|t| self.done[t].1.conflicts(&reads)).1);
    }

    /// The step begun last ended on the capture's nodes `ends` (None: the driver did not say),
    /// having touched `fp`.
    fn end(&mut self, ends: Option<Vec<usize>>, mut fp: Footprint) {
        self.open = None;
        let Some(ends) = ends else {
            self.unknown = true;
            return;
        };
        // A step that captured nothing (a view, host work) has nothing to order, and what it
        // says it touched would only chain the steps around it (a view "writes" the memory it
        // aliases). Memory it was handed, and its shared scratch, count for the next step.
        if ends == self.done.last().map_or(&[][..], |d| d.0.as_slice()) {
            return;
        }
        fp.writes.append(&mut self.allocated);
        fp.shared |= std::mem::take(&mut self.shared_scratch);
        let (direct, implied) = self.ancestry.waits(|t| self.done[t].1.conflicts(&fp));
        self.ancestry.sets.push(implied);
        self.deps.push(direct);
        self.done.push((ends, fp));
    }

    /// Of the free pieces `fitting` (size, address; best fit first), where to hand the open
    /// step `size` bytes: (piece size, piece address, whether from its end). The first piece
    /// whose first (else last) bytes only steps the open one already waits for touched; else
    /// the place whose newest such step is oldest (the wait it adds is the one the open step is
    /// likeliest to have anyway); with no open step, the best fit's first bytes. (A freed piece
    /// merges with its free neighbours, so memory no step touched often lies at a piece's end.)
    fn least_waiting(&self, fitting: impl Iterator<Item = (usize, u64)>, size: usize) -> Option<(usize, u64, bool)> {
        let mut fitting = fitting.take(PIECES_WEIGHED);
        let Some(waits) = &self.open else { return fitting.next().map(|(found, ptr)| (found, ptr, false)) };
        // Done steps the open one does not wait for, newest first.
        let others: Vec<usize> = (0..self.done.len()).rev().filter(|&t| !Ancestry::has(waits, t)).collect();
        let newest = |start: u64| others.iter().copied().find(|&t| self.done[t].1.touches((start, start + size as u64)));
        let mut best: Option<((usize, u64, bool), usize)> = None;
        for (found, ptr) in fitting {
            let places = [(false, ptr), (true, ptr + (found - size) as u64)];
            for (tail, start) in places.into_iter().take(if found > size { 2 } else { 1 }) {
                match newest(start) {
                    None => return Some((found, ptr, tail)),
                    Some(t) if best.is_none_or(|(_, b)| t < b) => best = Some(((found, ptr, tail), t)),
                    Some(_) => {}
                }
            }
        }
        best.map(|(place, _)| place)
    }
}

/// How many free pieces (best fit first) a captured step's buffer is chosen among.
const PIECES_WEIGHED: usize = 32;

/// Per step, every earlier step it waits for, directly or not, as a bit set: steps are added in
/// capture order, each waiting for the earlier ones it conflicts with.
#[derive(Default)]
struct Ancestry {
    sets: Vec<Vec<u64>>,
}

impl Ancestry {
    fn has(set: &[u64], t: usize) -> bool {
        set[t / 64] >> (t % 64) & 1 == 1
    }

    /// The waits of a step after every step so far, where `conflicts(t)` says whether it must
    /// come after step t: (the direct ones, oldest first, none implied by another; all of them
    /// as a bit set).
    fn waits(&self, conflicts: impl Fn(usize) -> bool) -> (Vec<usize>, Vec<u64>) {
        let n = self.sets.len();
        let mut implied = vec![0u64; n.div_ceil(64)];
        let mut direct = vec![];
        // Latest first: a step already implied by a chosen one needs no edge (nor a check), and
        // the chosen ones never imply each other.
        for t in (0..n).rev() {
            if Ancestry::has(&implied, t) || !conflicts(t) {
                continue;
            }
            direct.push(t);
            implied[t / 64] |= 1 << (t % 64);
            for (w, a) in implied.iter_mut().zip(&self.sets[t]) {
                *w |= a;
            }
        }
        direct.reverse();
        (direct, implied)
    }
}

/// A capture planned without a device (`KILN_PLAN_FOR=cuda`): a program's steps begun, handed
/// buffers by the capture pool's rule (at made-up addresses), and ended as `capture` sees them,
/// then the waits `relax` would give them. Library workspaces are left out.
pub(crate) struct PlannedCapture {
    pool: CapturePool,
    /// Where the next block the caching allocator would give starts.
    fresh: u64,
    /// The captured nodes so far: a step that captured work ends on the next one.
    nodes: usize,
}

impl PlannedCapture {
    /// Uses this thread's capture bookkeeping: not while it captures.
    pub(crate) fn new() -> Option<PlannedCapture> {
        if capturing().is_some() {
            return None;
        }
        STEPS.with(|s| *s.borrow_mut() = Steps::default());
        Some(PlannedCapture { pool: CapturePool::default(), fresh: 1 << 44, nodes: 0 })
    }

    pub(crate) fn begin(&mut self, reads: Vec<(u64, u64)>) {
        STEPS.with(|s| s.borrow_mut().begin(reads));
    }

    /// A buffer of `bytes` for the open step: a free piece, else a new block (whole 2 MiB
    /// segments, as the caching allocator cuts them).
    pub(crate) fn alloc(&mut self, bytes: usize) -> (u64, u64) {
        let size = crate::backend::cuda::device::alloc::round_size(bytes.max(1)).unwrap_or(usize::MAX);
        let b = self.pool.take(size).unwrap_or_else(|| {
            let block = Block { ptr: self.fresh, size: size.next_multiple_of(2 << 20) };
            self.fresh += block.size as u64;
            self.pool.adopt(block, size)
        });
        note_alloc(b.ptr, b.size);
        (b.ptr, b.ptr + b.size as u64)
    }

    pub(crate) fn free(&mut self, (start, end): (u64, u64)) {
        self.pool.give_back(Block { ptr: start, size: (end - start) as usize });
    }

    /// The open step ends, having captured work or not, having touched `fp`.
    pub(crate) fn end(&mut self, captured: bool, fp: Footprint) {
        STEPS.with(|s| {
            let mut s = s.borrow_mut();
            let ends = if captured {
                self.nodes += 1;
                vec![self.nodes]
            } else {
                s.done.last().map_or(vec![], |d| d.0.clone())
            };
            s.end(Some(ends), fp);
        });
    }

    /// The steps that captured work (what each is) and the steps each waits for; the memory
    /// the graph would hold.
    pub(crate) fn finish(self) -> (Vec<String>, Vec<Vec<usize>>, usize) {
        let steps = STEPS.with(|s| std::mem::take(&mut *s.borrow_mut()));
        (steps.done.into_iter().map(|d| d.1.what).collect(), steps.deps, self.pool.blocks.iter().map(|b| b.size).sum())
    }
}

/// Notes, while this thread captures, that the step being captured uses scratch memory shared
/// across calls (a library's workspace, the column reductions' counters): such steps stay in
/// order among themselves.
pub(crate) fn note_shared_scratch() {
    if capturing().is_some() {
        STEPS.with(|s| s.borrow_mut().shared_scratch = true);
    }
}

/// Notes a block handed out while this thread captures: the step being captured writes it.
pub(crate) fn note_alloc(ptr: u64, bytes: usize) {
    STEPS.with(|s| s.borrow_mut().allocated.push((ptr, ptr + bytes as u64)));
}

/// Inside `capture`: a step that reads the memory `reads` (built only while capturing) begins.
/// The buffers it is handed are then chosen so as to add no wait for a step it does not
/// already wait for, where the free memory allows (`Steps::least_waiting`).
pub(crate) fn begin_step(reads: impl FnOnce() -> Vec<(u64, u64)>) {
    if capturing().is_none() {
        return;
    }
    let reads = reads();
    STEPS.with(|s| s.borrow_mut().begin(reads));
}

/// Inside `capture`: ends the step whose launches were captured since the last one ended;
/// `footprint` (built only while capturing) says what it reads and writes.
pub(crate) fn end_step(footprint: impl FnOnce() -> Footprint) {
    let Some(ord) = capturing() else { return };
    let Ok(dev) = crate::backend::cuda::device(ord) else { return };
    let fp = footprint();
    let ends = capture_ends(&dev);
    STEPS.with(|s| s.borrow_mut().end(ends, fp));
}

/// The nodes the next captured launch would wait for (those the capture ended on so far).
fn capture_ends(dev: &CudaDevice) -> Option<Vec<usize>> {
    let stream = dev.work().stream()?.cu_stream();
    let mut status = ds::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph) = (0u64, std::ptr::null_mut());
    let (mut deps, mut edges, mut n): (*const ds::CUgraphNode, *const ds::CUgraphEdgeData, usize) = (std::ptr::null(), std::ptr::null(), 0);
    // SAFETY: plain out-parameters; `deps` points at `n` nodes until the next capture call.
    let st = unsafe { ds::cuStreamGetCaptureInfo_v3(stream, &mut status, &mut id, &mut graph, &mut deps, &mut edges, &mut n) };
    if st != ds::CUresult::CUDA_SUCCESS || status != ds::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || (n > 0 && deps.is_null()) {
        return None;
    }
    // SAFETY: `n` valid nodes, copied out at once.
    Some((0..n).map(|i| unsafe { *deps.add(i) } as usize).collect())
}

/// A node another waits for, and the data of the edge between them.
type Wait = (ds::CUgraphNode, ds::CUgraphEdgeData);

/// The nodes `node` waits for, with each edge's data (a library kernel launched for
/// programmatic dependent launch waits through a non-default edge; asking without the edge
/// data is then refused as a lossy query).
fn node_deps(node: ds::CUgraphNode) -> Option<Vec<Wait>> {
    let mut n = 0usize;
    // SAFETY: a node of a live graph; first the count, then that many nodes and edges.
    unsafe {
        if ds::cuGraphNodeGetDependencies_v2(node, std::ptr::null_mut(), std::ptr::null_mut(), &mut n) != ds::CUresult::CUDA_SUCCESS {
            return None;
        }
        let mut deps = vec![std::ptr::null_mut(); n];
        let mut edges = vec![std::mem::zeroed::<ds::CUgraphEdgeData>(); n];
        if n > 0 && ds::cuGraphNodeGetDependencies_v2(node, deps.as_mut_ptr(), edges.as_mut_ptr(), &mut n) != ds::CUresult::CUDA_SUCCESS {
            return None;
        }
        deps.truncate(n);
        edges.truncate(n);
        Some(deps.into_iter().zip(edges).collect())
    }
}

/// Replaces the captured order between steps by their waits (`Steps::deps`): each step's first
/// nodes wait for the last nodes of the steps it conflicts with. Returns (steps, steps on the
/// longest chain), or None when the graph could not be read and was left in its captured order.
fn relax(graph: ds::CUgraph, kept: Vec<(Vec<usize>, Footprint)>, deps: Vec<Vec<usize>>) -> Result<Option<(usize, usize)>> {
    crate::logging::log(crate::logging::Topic::Graph, || {
        let mut s = String::from("CUDA graph steps (<- the steps each one waits for):");
        for (i, ((_, fp), d)) in kept.iter().zip(&deps).enumerate() {
            s += &format!("\n  {i:3} {} <- {d:?}", fp.what);
        }
        s
    });
    // Each node belongs to the first step that ends on it or on a node waiting for it. Every
    // node's waits are read before the graph is changed, so a refused query changes nothing.
    let mut step_of: std::collections::HashMap<usize, usize> = Default::default();
    let mut nodes_of: Vec<Vec<(ds::CUgraphNode, Vec<Wait>)>> = vec![vec![]; kept.len()];
    for (s, (ends, _)) in kept.iter().enumerate() {
        let mut todo: Vec<ds::CUgraphNode> = ends.iter().map(|&n| n as ds::CUgraphNode).collect();
        while let Some(n) = todo.pop() {
            if step_of.contains_key(&(n as usize)) {
                continue;
            }
            step_of.insert(n as usize, s);
            // A node whose waits cannot be read: the graph keeps its captured order.
            let Some(waits) = node_deps(n) else { return Ok(None) };
            todo.extend(waits.iter().map(|w| w.0));
            nodes_of[s].push((n, waits));
        }
    }
    for (s, nodes) in nodes_of.iter().enumerate() {
        for (n, waits) in nodes {
            let before: Vec<&Wait> = waits.iter().filter(|d| step_of.get(&(d.0 as usize)).is_some_and(|&t| t < s)).collect();
            if before.len() < waits.len() {
                // It waits for a node of its own step: not where the step starts.
                continue;
            }
            // `n` starts step s: it waits for the ends of the steps s depends on instead, a node
            // it waited for as captured through the same edge (a programmatic launch's edge
            // lets it start before that node ends), the others through plain edges (a whole
            // wait is never weaker than the edge it replaces).
            let (from_old, data_old): (Vec<ds::CUgraphNode>, Vec<ds::CUgraphEdgeData>) = before.iter().map(|d| (d.0, d.1)).unzip();
            let after: Vec<ds::CUgraphNode> = deps[s].iter().flat_map(|&t| kept[t].0.iter().map(|&e| e as ds::CUgraphNode)).collect();
            // SAFETY: zeroed edge data is a plain edge.
            let plain: ds::CUgraphEdgeData = unsafe { std::mem::zeroed() };
            let data_new: Vec<ds::CUgraphEdgeData> = after.iter().map(|a| before.iter().find(|d| d.0 == *a).map_or(plain, |d| d.1)).collect();
            // The same waits as captured: the edges stay, with their data (a programmatic
            // launch's edge lets the step start before the one it waits for ends).
            let set = |v: &[ds::CUgraphNode]| v.iter().map(|&n| n as usize).collect::<std::collections::BTreeSet<usize>>();
            if set(&from_old) == set(&after) {
                continue;
            }
            let to_old = vec![*n; before.len()];
            let to_new = vec![*n; after.len()];
            // SAFETY: nodes of `graph`; the edges removed exist (with their data), the ones
            // added join a node to nodes of earlier steps (no cycle).
            unsafe {
                if !before.is_empty() && ds::cuGraphRemoveDependencies_v2(graph, from_old.as_ptr(), to_old.as_ptr(), data_old.as_ptr(), before.len()) != ds::CUresult::CUDA_SUCCESS {
                    return Err(graph_error("removing a dependency"));
                }
                // (Plain edges where the driver refuses a kept edge's data.)
                if !after.is_empty()
                    && ds::cuGraphAddDependencies_v2(graph, after.as_ptr(), to_new.as_ptr(), data_new.as_ptr(), after.len()) != ds::CUresult::CUDA_SUCCESS
                    && ds::cuGraphAddDependencies_v2(graph, after.as_ptr(), to_new.as_ptr(), std::ptr::null(), after.len()) != ds::CUresult::CUDA_SUCCESS
                {
                    return Err(graph_error("adding a dependency"));
                }
            }
        }
    }
    Ok(Some((kept.len(), longest_chain(&deps))))
}

/// Library kernels that wait for the grids before them themselves (`griddepcontrol.wait`, as
/// kiln's do) before they touch memory, by name prefix: cuBLASLt's Hopper products and their
/// split-K reductions (every kernel of these families in cuBLASLt 13 carries the wait).
const WAITING_LIBRARY_KERNELS: &[&str] = &["sm90_xmma_gemm_", "_ZN8cublasLt19splitKreduce_kernel"];

/// The function name of kernel node `node`, if it is one and the driver says.
fn kernel_node_name(node: ds::CUgraphNode) -> Option<String> {
    // SAFETY: a node of a live graph; plain out-parameters; the name is a C string the driver
    // owns, copied at once.
    unsafe {
        let mut ty = ds::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        if ds::cuGraphNodeGetType(node, &mut ty) != ds::CUresult::CUDA_SUCCESS || ty != ds::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            return None;
        }
        let mut p: ds::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
        if ds::cuGraphKernelNodeGetParams_v2(node, &mut p) != ds::CUresult::CUDA_SUCCESS {
            return None;
        }
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let st = if !p.func.is_null() { ds::cuFuncGetName(&mut name, p.func) } else if !p.kern.is_null() { ds::cuKernelGetName(&mut name, p.kern) } else { return None };
        (st == ds::CUresult::CUDA_SUCCESS && !name.is_null()).then(|| std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned())
    }
}

/// Turns the plain edge into a library kernel that waits for the grids before it itself
/// (`WAITING_LIBRARY_KERNELS`) from the one kernel it waits for into a programmatic one, as
/// kiln's own launches are: the library kernel then starts, and sets itself up, while the
/// kernel before still runs (a library cannot be asked to launch so). Returns how many library
/// kernels may now start early.
fn library_kernels_start_early(graph: ds::CUgraph) -> Result<usize> {
    let mut n = 0usize;
    // SAFETY: a live graph; first the count, then that many nodes.
    let nodes = unsafe {
        if ds::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) != ds::CUresult::CUDA_SUCCESS {
            return Ok(0);
        }
        let mut v = vec![std::ptr::null_mut(); n];
        if n > 0 && ds::cuGraphGetNodes(graph, v.as_mut_ptr(), &mut n) != ds::CUresult::CUDA_SUCCESS {
            return Ok(0);
        }
        v.truncate(n);
        v
    };
    let mut early = 0;
    for node in nodes {
        let waits_itself = kernel_node_name(node).is_some_and(|name| WAITING_LIBRARY_KERNELS.iter().any(|p| name.starts_with(p)));
        if !waits_itself {
            continue;
        }
        // Only a kernel waiting for one kernel through a plain edge: a chain's link, as a
        // stream launch makes it.
        let Some(waits) = node_deps(node) else { continue };
        let [(from, plain)] = waits[..] else { continue };
        if plain.from_port != 0 || plain.to_port != 0 || plain.type_ != 0 || kernel_node_name(from).is_none() {
            continue;
        }
        let mut programmatic = plain;
        programmatic.from_port = ds::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        programmatic.type_ = ds::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        // SAFETY: nodes of `graph`; the plain edge removed exists, and the same edge comes back
        // programmatic (or, where the driver refuses, plain again).
        unsafe {
            if ds::cuGraphRemoveDependencies_v2(graph, &from, &node, &plain, 1) != ds::CUresult::CUDA_SUCCESS {
                return Err(graph_error("removing a library kernel's dependency"));
            }
            if ds::cuGraphAddDependencies_v2(graph, &from, &node, &programmatic, 1) != ds::CUresult::CUDA_SUCCESS {
                if ds::cuGraphAddDependencies_v2(graph, &from, &node, &plain, 1) != ds::CUresult::CUDA_SUCCESS {
                    return Err(graph_error("restoring a library kernel's dependency"));
                }
                continue;
            }
        }
        early += 1;
    }
    Ok(early)
}

/// The error of a graph edit the driver refused.
fn graph_error(what: &str) -> Error {
    Error::Compile(format!("CUDA graph: {what}"))
}

/// Whether captured graphs keep the captured order (`KILN_GRAPH_BRANCHES=0`, read once): to
/// measure what side-by-side steps gain, or to rule them out.
fn keep_captured_order() -> bool {
    crate::switches::graph_keeps_captured_order()
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

/// The device address of the error word of the graph this thread is capturing on `ordinal`.
pub(crate) fn capture_error_word(ordinal: usize) -> Option<u64> {
    if capturing() != Some(ordinal) {
        return None;
    }
    CAPTURE_WORD.with(|w| w.borrow().as_ref().map(|w| w.dev_ptr))
}

/// The blocks a capture took from the caching allocator (the graph keeps them), cut into pieces
/// for the captured steps: a step's buffer is the smallest free piece that fits, cut to size,
/// and a piece freed during the capture merges with its free neighbours for later steps, so
/// the graph holds about what its steps hold at their peak.
#[derive(Default)]
pub(crate) struct CapturePool {
    pub(crate) blocks: Vec<Block>,
    pieces: crate::backend::cuda::device::alloc::LargePool,
}

impl CapturePool {
    /// A free piece for `bytes` (> 0), cut to size.
    pub(crate) fn take(&mut self, bytes: usize) -> Option<Block> {
        let size = crate::backend::cuda::device::alloc::round_size(bytes)?;
        let (found, ptr, tail) = STEPS.with(|s| s.borrow().least_waiting(self.pieces.fitting(size), size))?;
        Some(self.pieces.take_free(found, ptr, size, tail))
    }
    /// Keeps `block`, just taken from the caching allocator, and hands out its first `bytes`.
    pub(crate) fn adopt(&mut self, block: Block, bytes: usize) -> Block {
        self.blocks.push(block);
        let size = crate::backend::cuda::device::alloc::round_size(bytes).unwrap_or(block.size).min(block.size);
        self.pieces.add_segment(block.ptr, block.size, size)
    }
    pub(crate) fn give_back(&mut self, b: Block) {
        if self.pieces.hands_out(b.ptr) {
            self.pieces.give_back(b);
        }
    }
}

/// A captured launch list, replayable on its device's stream.
pub(crate) struct CudaGraph {
    graph: ds::CUgraph,
    exec: ds::CUgraphExec,
    blocks: Vec<Block>,
    dev: Arc<CudaDevice>,
    /// Kernels launched while capturing.
    pub(crate) kernels: u64,
    /// What the profiler shows for each replay: the captured kernels and library calls.
    work: Vec<String>,
    /// Where its kernels report bad indices; a replaying thread reads it at its next
    /// synchronisation.
    word: Arc<ErrorWord>,
}

// SAFETY: the graph handles are used under the caller's lock, from any thread that binds the
// context (as every launch does).
unsafe impl Send for CudaGraph {}
unsafe impl Sync for CudaGraph {}

/// Captures what `f` launches on `dev`'s stream (nothing runs) into a graph. A capture
/// another thread has in progress on `dev` is waited for: captures take turns.
#[track_caller]
pub(crate) fn capture<T>(dev: &Arc<CudaDevice>, f: impl FnOnce() -> Result<T>) -> Result<(CudaGraph, T)> {
    if capturing().is_some() {
        return Err(Error::Compile("this thread is already capturing a CUDA graph".into()));
    }
    let _turn = dev.capture_turn.lock();
    dev.synchronize("graph capture")?;
    let word = dev.new_error_word()?;
    CAPTURE_WORD.with(|w| *w.borrow_mut() = Some(word.clone()));
    *dev.capture.lock() = Some(CapturePool::default());
    let launches = crate::backend::cuda::launch_count();
    let cs = &dev.capture_stream;
    let begun = cs.begin_capture(ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(|e| dev.err("begin capture", e));
    CAPTURED.with(|c| c.borrow_mut().clear());
    STEPS.with(|s| *s.borrow_mut() = Steps::default());
    CAPTURING.with(|c| c.set(Some(dev.ordinal)));
    let r = begun.and_then(|_| f());
    // Whatever was captured after the last step the program marked comes last.
    end_step(|| Footprint::barrier("the call's end"));
    CAPTURING.with(|c| c.set(None));
    CAPTURE_WORD.with(|w| w.borrow_mut().take());
    let work = CAPTURED.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let steps = STEPS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let ended = end_capture(dev, steps, r.is_ok());
    let pool = dev.capture.lock().take().unwrap_or_default();
    let kernels = crate::backend::cuda::launch_count() - launches;
    let e = match (r, ended) {
        (Ok(value), Ok((graph, exec))) => {
            let held: usize = pool.blocks.iter().map(|b| b.size).sum();
            crate::logging::log(crate::logging::Topic::Memory, || format!("CUDA graph captured: {kernels} kernels; it holds {:.1} MiB in {} blocks for its replays", held as f64 / (1u64 << 20) as f64, pool.blocks.len()));
            return Ok((CudaGraph { graph, exec, blocks: pool.blocks, dev: dev.clone(), kernels, work, word }, value));
        }
        (Err(e), _) => e,
        // The value's tensors go first: dropped while their blocks still belong to the graph,
        // they give nothing back (the blocks go back once, below).
        (Ok(value), Err(e)) => {
            drop(value);
            e
        }
    };
    // Nothing captured ran: the blocks and the word go back.
    dev.retire_error_word(word);
    let mut owned = dev.graph_blocks.lock();
    for b in &pool.blocks {
        owned.remove(&b.ptr);
    }
    drop(owned);
    for b in &pool.blocks {
        dev.release(*b);
    }
    Err(e)
}

/// Ends the capture on `dev`'s capture stream, lets its steps run side by side where they do
/// not conflict, and instantiates the graph (when the captured work itself succeeded).
fn end_capture(dev: &CudaDevice, steps: Steps, succeeded: bool) -> Result<(ds::CUgraph, ds::CUgraphExec)> {
    dev.bind()?;
    // SAFETY: the stream is capturing (or the error says why not).
    let graph = unsafe { cudarc::driver::result::stream::end_capture(dev.capture_stream.cu_stream()) }.map_err(|e| dev.err("end capture", e))?;
    if graph.is_null() {
        return Err(Error::Compile("the captured CUDA graph is empty".into()));
    }
    let destroy = |e: Error| {
        // SAFETY: the graph ended above, not instantiated.
        unsafe { cudarc::driver::result::graph::destroy(graph) }.ok();
        Err(e)
    };
    if !succeeded {
        return destroy(Error::Compile("the captured work failed".into()));
    }
    if !steps.unknown && !keep_captured_order() {
        match relax(graph, steps.done, steps.deps) {
            Ok(Some((n, chain))) => crate::logging::log(crate::logging::Topic::Recompiles, || format!("CUDA graph: {n} steps, {chain} on the longest chain of waits")),
            Ok(None) => crate::logging::log(crate::logging::Topic::Recompiles, || "CUDA graph: a node's waits could not be read; the steps keep their captured order".into()),
            Err(e) => return destroy(e),
        }
    }
    if dev.hopper && crate::switches::pdl() && !crate::switches::pdl_library_off() {
        match library_kernels_start_early(graph) {
            Ok(n) => crate::logging::log(crate::logging::Topic::Recompiles, || format!("CUDA graph: {n} library kernels may start before the kernels they wait for end")),
            Err(e) => return destroy(e),
        }
    }
    let flags = ds::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
    // SAFETY: a complete graph.
    match unsafe { cudarc::driver::result::graph::instantiate(graph, flags) } {
        Ok(exec) => Ok((graph, exec)),
        Err(e) => destroy(dev.err("instantiate graph", e)),
    }
}

/// A device-to-device copy inside a captured graph whose addresses change before each replay
/// (a call's arguments copied into the graph's static inputs, its outputs copied out into
/// fresh tensors), so the copies cost no launches of their own.
pub(crate) struct CopyNode {
    node: ds::CUgraphNode,
    bytes: usize,
}
// SAFETY: a handle into a graph that lives as long as the `CudaGraph` holding it, used under the
// same lock.
unsafe impl Send for CopyNode {}
unsafe impl Sync for CopyNode {}

/// Inside `capture`: copies `bytes` from `src` to `dst` on the capture stream and returns the
/// node the copy became; None when the driver does not say which node that is.
pub(crate) fn captured_copy(dev: &CudaDevice, dst: u64, src: u64, bytes: usize) -> Result<Option<CopyNode>> {
    let Some(stream) = dev.work().stream() else { return Ok(None) };
    let stream = stream.cu_stream();
    // SAFETY: both ranges hold `bytes` on this device; the stream is capturing (nothing runs).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream) }.map_err(|e| dev.err("copy", e))?;
    // The copy is the node the capture now ends on.
    Ok(match capture_ends(dev).as_deref() {
        Some(&[node]) => Some(CopyNode { node: node as ds::CUgraphNode, bytes }),
        _ => None,
    })
}

impl CudaGraph {
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
        let st = unsafe { ds::cuGraphExecMemcpyNodeSetParams(self.exec, c.node, &p, self.dev.ctx.cu_ctx()) };
        if st != ds::CUresult::CUDA_SUCCESS {
            return Err(self.dev.err("graph copy update", st));
        }
        Ok(())
    }

    /// Whether copy `c` runs in the next replays (a disabled node does nothing).
    pub(crate) fn enable_copy(&self, c: &CopyNode, on: bool) -> Result<()> {
        // SAFETY: the node belongs to the graph this executable was made from.
        let st = unsafe { ds::cuGraphNodeSetEnabled(self.exec, c.node, u32::from(on)) };
        if st != ds::CUresult::CUDA_SUCCESS {
            return Err(self.dev.err("graph copy enable", st));
        }
        Ok(())
    }

    /// Runs the graph on the device's stream, in order with the work around it.
    pub(crate) fn replay(&self) -> Result<()> {
        self.dev.bind()?;
        let _rec = crate::profiler::graph_replay(&self.dev, &self.work);
        // SAFETY: a live instantiated graph; its buffers belong to it or to tensors it keeps.
        unsafe { cudarc::driver::result::graph::launch(self.exec, self.dev.stream.cu_stream()) }
            .map_err(|e| self.dev.err("graph launch", e))?;
        crate::backend::cuda::note_replayed_word(self.dev.ordinal, &self.word);
        crate::backend::cuda::count_launches(self.kernels);
        Ok(())
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // Its kernels may still run (replays run on `stream`): wait, then give its memory back.
        // Not the capture stream: waiting on a stream another thread is capturing on would
        // break that capture.
        let _ = self.dev.stream.synchronize();
        // SAFETY: made by `end_capture`, destroyed once, after its last replay finished.
        unsafe {
            cudarc::driver::result::graph::exec_destroy(self.exec).ok();
            cudarc::driver::result::graph::destroy(self.graph).ok();
        }
        let mut owned = self.dev.graph_blocks.lock();
        for b in &self.blocks {
            owned.remove(&b.ptr);
        }
        drop(owned);
        for b in &self.blocks {
            self.dev.release(*b);
        }
        // Reused once no thread that replayed the graph still means to read it.
        self.dev.retire_error_word(self.word.clone());
    }
}

/// What one step of a captured launch list touches on the device: byte ranges `[start, end)`
/// it reads and writes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Footprint {
    pub(crate) reads: Vec<(u64, u64)>,
    pub(crate) writes: Vec<(u64, u64)>,
    /// Uses scratch memory shared across calls (cuBLAS's workspace, the column reductions'
    /// counters): such steps stay in order among themselves.
    pub(crate) shared: bool,
    /// Waits for every earlier step, and every later step waits for it: for work whose memory
    /// is not known (an eager op, a copy with addresses set at each replay).
    pub(crate) barrier: bool,
    /// What the step is, for `KILN_LOG=graph`.
    pub(crate) what: String,
}

impl Footprint {
    pub(crate) fn barrier(what: impl Into<String>) -> Footprint {
        Footprint { barrier: true, what: what.into(), ..Footprint::default() }
    }

    /// Whether it reads or writes memory in `range`.
    fn touches(&self, range: (u64, u64)) -> bool {
        self.reads.iter().chain(&self.writes).any(|x| x.0 < range.1 && range.0 < x.1)
    }

    fn conflicts(&self, later: &Footprint) -> bool {
        let overlap = |a: &[(u64, u64)], b: &[(u64, u64)]| a.iter().any(|x| b.iter().any(|y| x.0 < y.1 && y.0 < x.1));
        self.barrier
            || later.barrier
            || (self.shared && later.shared)
            || overlap(&self.writes, &later.reads)
            || overlap(&self.writes, &later.writes)
            || overlap(&self.reads, &later.writes)
    }
}

/// The number of steps on the longest chain of waits.
pub(crate) fn longest_chain(deps: &[Vec<usize>]) -> usize {
    let mut depth = vec![0usize; deps.len()];
    for (s, d) in deps.iter().enumerate() {
        depth[s] = 1 + d.iter().map(|&t| depth[t]).max().unwrap_or(0);
    }
    depth.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::{longest_chain, note_alloc, CapturePool, Footprint, Steps, STEPS};
    use crate::backend::cuda::device::alloc::Block;

    /// The waits of steps that each captured work, as `Steps::end` finds them.
    fn step_dependencies(fps: &[Footprint]) -> Vec<Vec<usize>> {
        let mut steps = Steps::default();
        for (node, fp) in fps.iter().enumerate() {
            steps.end(Some(vec![node + 1]), fp.clone());
        }
        steps.deps
    }

    #[test]
    fn a_capture_cuts_its_blocks_to_size_and_reuses_freed_pieces() {
        const MIB: usize = 1 << 20;
        let mut pool = CapturePool::default();
        assert_eq!(pool.take(MIB), None, "nothing adopted yet");
        // A step's 8 MiB buffer, freed within the capture: later steps' 3 and 5 MiB fit in it.
        let first = pool.adopt(Block { ptr: 0x10_0000_0000, size: 8 * MIB }, 8 * MIB);
        assert_eq!(first, Block { ptr: 0x10_0000_0000, size: 8 * MIB });
        pool.give_back(first);
        let three = pool.take(3 * MIB - 100).unwrap();
        assert_eq!(three, Block { ptr: first.ptr, size: 3 * MIB });
        let five = pool.take(5 * MIB).unwrap();
        assert_eq!(five, Block { ptr: first.ptr + 3 * MIB as u64, size: 5 * MIB });
        assert_eq!(pool.take(512), None, "all handed out");
        // Freed pieces merge again; a block the graph does not hand out is ignored.
        pool.give_back(Block { ptr: 0x99, size: 512 });
        pool.give_back(five);
        pool.give_back(three);
        assert_eq!(pool.take(8 * MIB), Some(first));
        assert_eq!(pool.blocks, vec![first]);
    }

    fn fp(reads: &[u64], writes: &[u64]) -> Footprint {
        // Each address stands for a 16-byte buffer.
        let r = |a: &[u64]| a.iter().map(|&x| (x, x + 16)).collect();
        Footprint { reads: r(reads), writes: r(writes), ..Footprint::default() }
    }

    #[test]
    fn a_step_waits_for_what_wrote_its_inputs_and_for_readers_of_what_it_overwrites() {
        let steps = [
            fp(&[0], &[100]),   // 0: a -> b
            fp(&[0], &[200]),   // 1: a -> c, independent of 0
            fp(&[100], &[300]), // 2: b -> d, after 0
            fp(&[], &[0]),      // 3: overwrites a, after its readers 0 and 1
            fp(&[108], &[400]), // 4: reads inside b (a view), after 0
        ];
        assert_eq!(step_dependencies(&steps), vec![vec![], vec![], vec![0], vec![0, 1], vec![0]]);
    }

    #[test]
    fn implied_waits_are_left_out() {
        // 0 -> 1 -> 2, and 2 also reads what 0 wrote: its wait for 1 implies the one for 0.
        let steps = [fp(&[], &[0]), fp(&[0], &[100]), fp(&[0, 100], &[200])];
        let deps = step_dependencies(&steps);
        assert_eq!(deps, vec![vec![], vec![0], vec![1]]);
        assert_eq!(longest_chain(&deps), 3);
    }

    #[test]
    fn barriers_and_users_of_shared_scratch_keep_their_order() {
        let mut lib = fp(&[0], &[100]);
        lib.shared = true;
        let mut lib2 = fp(&[0], &[200]);
        lib2.shared = true;
        let steps = [Footprint::barrier("in"), lib, lib2, fp(&[0], &[300]), Footprint::barrier("out"), fp(&[0], &[500])];
        let deps = step_dependencies(&steps);
        assert_eq!(deps, vec![vec![], vec![0], vec![1], vec![0], vec![2, 3], vec![4]]);
        assert_eq!(longest_chain(&deps), 5);
    }

    /// Steps done in capture order, and the open one reading `reads`.
    fn steps_with_open(done: Vec<Footprint>, reads: &[u64]) -> Steps {
        let mut steps = Steps::default();
        for (node, fp) in done.into_iter().enumerate() {
            steps.begin(vec![]);
            steps.end(Some(vec![node]), fp);
        }
        steps.begin(fp(reads, &[]).reads);
        steps
    }

    #[test]
    fn a_step_after_the_chain_is_not_handed_memory_a_step_beside_it_used() {
        const MIB: usize = 1 << 20;
        let mib = |n: u64| n * MIB as u64;
        let range = |b: Block| (b.ptr, b.ptr + b.size as u64);
        STEPS.with(|s| *s.borrow_mut() = Steps::default());
        let mut pool = CapturePool::default();
        let node = std::cell::Cell::new(0usize);
        // One step as a program runs it: begun with what it reads, handed its output (`fresh`:
        // where the pool has nothing), ended.
        let step = |pool: &mut CapturePool, reads: (u64, u64), fresh: u64| {
            STEPS.with(|s| s.borrow_mut().begin(vec![reads]));
            let out = pool.take(MIB).unwrap_or_else(|| pool.adopt(Block { ptr: fresh, size: MIB }, MIB));
            note_alloc(out.ptr, out.size);
            node.set(node.get() + 1);
            STEPS.with(|s| s.borrow_mut().end(Some(vec![node.get()]), Footprint { reads: vec![reads], ..Footprint::default() }));
            out
        };
        let input = (mib(1), mib(2));
        // A chain of three steps over the input; a view between two captures nothing (and
        // "writes" the memory it aliases).
        let a = step(&mut pool, input, mib(16));
        let b = step(&mut pool, range(a), mib(20));
        pool.give_back(a);
        STEPS.with(|s| s.borrow_mut().end(Some(vec![node.get()]), fp(&[], &[b.ptr])));
        let c = step(&mut pool, range(b), mib(24));
        // Beside the chain, reading the input only (`c` was handed `a`'s memory, so nothing is
        // free): its output and its scratch memory are new, the scratch freed within it.
        STEPS.with(|s| s.borrow_mut().begin(vec![input]));
        assert_eq!(pool.take(MIB), None);
        let beside = pool.adopt(Block { ptr: mib(12), size: MIB }, MIB);
        let scratch = pool.adopt(Block { ptr: mib(8), size: MIB }, MIB);
        note_alloc(beside.ptr, beside.size);
        note_alloc(scratch.ptr, scratch.size);
        pool.give_back(scratch);
        node.set(node.get() + 1);
        STEPS.with(|s| s.borrow_mut().end(Some(vec![node.get()]), Footprint { reads: vec![input], ..Footprint::default() }));
        pool.give_back(b);
        // After the chain: of the scratch's memory (the best fit: same size, lower address)
        // and `b`'s, it is handed `b`'s, which only steps it waits for touched.
        let after = step(&mut pool, range(c), mib(28));
        assert_eq!((c, after), (a, b));
        let deps = STEPS.with(|s| s.borrow().deps.clone());
        assert_eq!(deps, vec![vec![], vec![0], vec![1], vec![], vec![2]], "the view is left out; the step after waits for the chain only");
        STEPS.with(|s| *s.borrow_mut() = Steps::default());
    }

    #[test]
    fn a_captured_step_is_handed_memory_only_steps_it_waits_for_touched() {
        // 0 writes x and uses 0x100; 1, which the open step does not wait for, uses 0x200 and
        // 0x300; 2 uses 0x400 after 1. The open step reads x only.
        let done = vec![fp(&[], &[0, 0x100]), fp(&[0x900], &[0x200, 0x300]), fp(&[0x200], &[0x400])];
        let steps = steps_with_open(done, &[0]);
        // Best fit first: 0x200 (16 bytes) would make it wait for 1; 0x100 (32) adds no wait.
        assert_eq!(steps.least_waiting([(16, 0x200), (32, 0x100)].into_iter(), 16), Some((32, 0x100, false)));
        // Every piece adds a wait: the one for the oldest step (1, not 2).
        assert_eq!(steps.least_waiting([(16, 0x400), (16, 0x300)].into_iter(), 16), Some((16, 0x300, false)));
        // Memory no step touched, and no open step: the best fit.
        assert_eq!(steps.least_waiting([(16, 0x200), (32, 0x700)].into_iter(), 16), Some((32, 0x700, false)));
        // A piece whose first bytes step 1 touched, and whose last bytes none did: its end.
        assert_eq!(steps.least_waiting([(32, 0x200)].into_iter(), 16), Some((32, 0x200, true)));
        let closed = Steps { open: None, ..steps };
        assert_eq!(closed.least_waiting([(16, 0x200), (32, 0x100)].into_iter(), 16), Some((16, 0x200, false)));
        assert_eq!(closed.least_waiting(std::iter::empty(), 16), None);
    }

    #[test]
    fn independent_updates_of_parameters_run_side_by_side() {
        // Four parameters, each updated in place from its own gradient.
        let steps: Vec<Footprint> = (0..4).map(|p| fp(&[1000 + 100 * p], &[100 * p])).collect();
        let deps = step_dependencies(&steps);
        assert!(deps.iter().all(|d| d.is_empty()));
        assert_eq!(longest_chain(&deps), 1);
    }
}
