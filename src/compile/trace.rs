//! Tracing. While a compiled function runs under a tracer, every op on this thread records a
//! node instead of launching a kernel, and the tensors it returns are symbolic: a storage with
//! no data, bound to the node. Tensors from outside (parameters) are captured as graph inputs
//! by identity; in-place writes are recorded as new values (and, for captured tensors, written
//! back after the call). A host read of a symbolic tensor is a graph break: the graph so far is
//! compiled and run, its live values get real storage, and tracing goes on.

use super::graph::{Graph, NodeId, NodeOp, RandomKind};
use crate::logging::Topic;
use crate::layout::Layout;
use crate::ops::Op;
use crate::storage::{BackendStorage, Storage};
use crate::{DType, Device, Error, MemoryFormat, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Which trace and which node a symbolic storage stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TraceRef {
    pub trace: u64,
    pub node: NodeId,
}

/// Compiles and runs a finished part of a trace at a graph break: (graph, its real inputs) →
/// the values of its outputs.
pub(crate) type BreakRunner = Arc<dyn Fn(&Graph, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync>;

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    static TRACER: RefCell<Option<Tracer>> = const { RefCell::new(None) };
}

static NEXT_TRACE: AtomicU64 = AtomicU64::new(1);

/// Whether ops on this thread are being recorded.
pub(crate) fn active() -> bool {
    ACTIVE.with(|a| a.get())
}

pub(crate) struct Tracer {
    id: u64,
    graph: Graph,
    /// Real tensors the graph reads: arguments first, then captured ones.
    inputs: Vec<Tensor>,
    /// Captured tensors by identity.
    captured: HashMap<u64, NodeId>,
    /// Captured tensors written in place: identity → (tensor, node of its current value).
    written: HashMap<u64, (Tensor, NodeId)>,
    /// Every symbolic storage made, to find the live ones at a break.
    symbolic: Vec<Weak<Storage>>,
    fullgraph: bool,
    on_break: BreakRunner,
    /// Per captured tensor: it had no `.grad` when captured.
    grad_none: Vec<bool>,
    /// `backward` ran inside the traced function (a training step).
    ran_backward: bool,
    /// Reasons of the breaks taken, with their call sites.
    pub breaks: Vec<String>,
    /// The symbolic storage of each argument, to recognise writes into it.
    arg_storages: Vec<Weak<Storage>>,
    /// Arguments written in place: (argument, node of its latest value), one entry each.
    arg_writes: Vec<(usize, NodeId)>,
}

/// The result of a finished trace.
pub(crate) struct Traced {
    /// Outputs: what the function returned, then the gradients it left in captured tensors'
    /// `.grad`, then the values of symbolic tensors it left alive elsewhere (new optimiser state).
    pub graph: Graph,
    /// Real inputs of `graph`: the arguments, then the captured tensors.
    pub inputs: Vec<Tensor>,
    pub breaks: Vec<String>,
    pub effects: Effects,
}

/// What a traced call did besides returning values, beyond in-place writes (`Graph::mutations`).
#[derive(Clone, Default)]
pub(crate) struct Effects {
    pub n_returned: usize,
    /// Arguments the call wrote in place: one output each (after the returned values), copied
    /// into the argument after the call, as eager code would have written it.
    pub arg_writes: Vec<usize>,
    /// Captured tensors (by captured index) whose `.grad` the call set: one output each.
    pub grads: Vec<usize>,
    /// Whether each captured tensor had no `.grad` when it was captured (a guard: backward
    /// accumulates into an existing gradient, and the graph depends on which case it traced).
    pub grad_none: Vec<bool>,
    /// Storages of symbolic tensors still alive after the call, with the memory format their
    /// tensors are laid out in (`stored_format`): they take real values once, and the graph is
    /// not cached (it made state that the next call will read instead).
    pub escaped: Vec<(Arc<Storage>, MemoryFormat)>,
    /// `backward` ran inside the call: its outputs are plain values, not differentiated again.
    pub ran_backward: bool,
    /// A returned tensor requires grad (it was not computed under `no_grad` inside the call):
    /// the compiled call must take part in autograd.
    pub returns_grad: bool,
}

/// Called by `backward`: inside a trace, the function is a training step.
pub(crate) fn note_backward() {
    if active() {
        TRACER.with(|t| {
            if let Some(tr) = t.borrow_mut().as_mut() {
                tr.ran_backward = true;
            }
        });
    }
}

/// Runs `f` on symbolic stand-ins for `args` and returns the graph of what it computed.
/// `on_break` runs the finished part of the graph at a host read (unless `fullgraph`).
pub(crate) fn trace(args: &[Tensor], fullgraph: bool, on_break: BreakRunner, f: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<Traced> {
    if active() {
        return Err(Error::Compile("a compiled function was called while another one is being traced on this thread; nested compile is not supported".into()));
    }
    let mut tr = Tracer {
        id: NEXT_TRACE.fetch_add(1, Ordering::Relaxed),
        graph: Graph::default(),
        inputs: vec![],
        captured: HashMap::new(),
        written: HashMap::new(),
        symbolic: vec![],
        fullgraph,
        on_break,
        grad_none: vec![],
        ran_backward: false,
        breaks: vec![],
        arg_storages: vec![],
        arg_writes: vec![],
    };
    let sym: Vec<Tensor> = args
        .iter()
        .enumerate()
        .map(|(k, a)| {
            let id = tr.graph.push(NodeOp::Arg(k), vec![], a.shape().to_vec(), a.dtype(), a.device());
            tr.inputs.push(a.clone());
            let s = tr.symbolic_tensor(id, false);
            tr.arg_storages.push(Arc::downgrade(s.storage()));
            if a.is_requires_grad() {
                let _ = s.set_requires_grad(true);
            }
            s
        })
        .collect();
    TRACER.with(|t| *t.borrow_mut() = Some(tr));
    ACTIVE.with(|a| a.set(true));
    // Uninstalls the tracer however `f` ends, a panic included: the thread stays usable.
    let installed = Installed;
    let out = f(&sym);
    let mut tr = TRACER.with(|t| t.borrow_mut().take()).expect("the tracer is installed");
    drop(installed);
    drop(sym);
    let outs = out?;
    let mut ids = Vec::with_capacity(outs.len());
    for o in &outs {
        ids.push(tr.value_of(o)?);
    }
    let returns_grad = outs.iter().any(|o| o.is_requires_grad());
    // The returned symbolic tensors (and the trace-time autograd graph behind them) go now, so
    // that what stays alive is what the call left behind.
    drop(outs);
    let mut effects = Effects { n_returned: ids.len(), returns_grad, grad_none: std::mem::take(&mut tr.grad_none), ran_backward: tr.ran_backward, ..Default::default() };
    for &(k, v) in &tr.arg_writes {
        effects.arg_writes.push(k);
        ids.push(v);
    }
    let mut grad_storages = vec![];
    for (k, t) in tr.inputs[tr.graph.n_args..].iter().enumerate() {
        if let Some(g) = t.grad() {
            if let Some(r) = g.storage().traced_ref().filter(|r| r.trace == tr.id) {
                ids.push(r.node);
                effects.grads.push(k);
                grad_storages.push(g.storage().clone());
            }
        }
    }
    for w in &tr.symbolic {
        let Some(st) = w.upgrade() else { continue };
        if grad_storages.iter().any(|g| Arc::ptr_eq(g, &st)) {
            continue;
        }
        if let Some(r) = st.traced_ref().filter(|r| r.trace == tr.id) {
            ids.push(r.node);
            effects.escaped.push((st, stored_format(&tr.graph, r.node)));
        }
    }
    tr.graph.outputs = ids;
    tr.finish_writes();
    Ok(Traced { graph: tr.graph, inputs: tr.inputs, breaks: tr.breaks, effects })
}

/// Resets the thread's tracing state when dropped, also while unwinding from a panic.
struct Installed;
impl Drop for Installed {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(false));
        TRACER.with(|t| {
            if let Ok(mut t) = t.try_borrow_mut() {
                t.take();
            }
        });
    }
}

/// The memory format a traced value's tensor is laid out in: channels-last for a copy into it
/// (`to_memory_format`, or autograd's copy of a gradient laid out as its channels-last weight),
/// so that state made from it (an optimiser's momentum, as `torch.clone` keeps the format) is
/// channels-last when the call's values fill it; contiguous otherwise.
fn stored_format(g: &Graph, node: NodeId) -> MemoryFormat {
    match &g.nodes[node].op {
        NodeOp::Prim(Op::Relayout(MemoryFormat::ChannelsLast)) if g.nodes[node].shape.len() == 4 => MemoryFormat::ChannelsLast,
        _ => MemoryFormat::Contiguous,
    }
}

/// Gives the storages a call left alive their real values (the graph's trailing outputs), each
/// a private copy laid out in its tensors' memory format.
pub(crate) fn fill_escaped(escaped: &[(Arc<Storage>, MemoryFormat)], values: Vec<Tensor>) -> Result<()> {
    for ((storage, format), v) in escaped.iter().zip(values) {
        let own = crate::no_grad(|| {
            let _s = Suspend::new();
            v.copy_in(*format)
        })?;
        let data = std::mem::replace(&mut *own.storage().data.write(), BackendStorage::Traced(TraceRef { trace: 0, node: 0 }));
        *storage.data.write() = data;
    }
    Ok(())
}

/// Runs `f` with the tracer of this thread.
fn with<R>(f: impl FnOnce(&mut Tracer) -> Result<R>) -> Result<R> {
    TRACER.with(|t| {
        let mut t = t.borrow_mut();
        let tr = t.as_mut().ok_or_else(|| Error::Compile("no function is being traced on this thread".into()))?;
        f(tr)
    })
}

/// Whether `t`, a value of this thread's trace, is at run time a transpose of its last two dims
/// (as `W.t()` is, also behind dims of size 1 added or removed): the trace's stand-ins are all
/// contiguous, so the layout is read from the graph. None when `t` is not a traced value.
pub(crate) fn swaps_last_two(t: &Tensor) -> Option<bool> {
    let r = t.storage().traced_ref()?;
    TRACER.with(|tr| {
        let tr = tr.try_borrow().ok()?;
        let tr = tr.as_ref().filter(|tr| tr.id == r.trace)?;
        let g = &tr.graph;
        let bare = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        let mut n = r.node;
        loop {
            let node = &g.nodes[n];
            match &node.op {
                NodeOp::Prim(Op::Reshape(s)) if bare(s) == bare(&g.nodes[node.args[0]].shape) => n = node.args[0],
                NodeOp::Prim(Op::Permute(p)) => {
                    let k = p.len();
                    let swap = super::transpose::is_swap(p);
                    // Its source must be laid out in order: a fresh value, or a contiguous capture.
                    let src = node.args[0];
                    let ordered = match &g.nodes[src].op {
                        NodeOp::Captured(c) => tr.inputs[*c].is_contiguous(),
                        NodeOp::Prim(op) => !op.is_view(),
                        _ => true,
                    };
                    let shape = &g.nodes[r.node].shape;
                    let same_last_two = shape.len() >= 2 && node.shape.len() >= 2 && shape[shape.len() - 2..] == node.shape[k - 2..];
                    return Some(swap && ordered && same_last_two);
                }
                _ => return Some(false),
            }
        }
    })
}

/// Records a primitive op on (symbolic or captured) inputs; returns its symbolic result.
pub(crate) fn record(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
    let device = inputs[0].device();
    if !matches!(op, Op::ToDevice { .. }) {
        if let Some(x) = inputs.iter().find(|x| x.device() != device) {
            return Err(Error::DeviceMismatch { op: op.name(), a: device, b: x.device() });
        }
    }
    let metas: Vec<(&[usize], DType)> = inputs.iter().map(|t| (t.shape(), t.dtype())).collect();
    let (shape, dtype) = op.out_meta(&metas)?;
    let out_device = if let Op::ToDevice { to, .. } = op { to } else { device };
    let is_view = op.is_view();
    with(|tr| {
        let args = inputs.iter().map(|t| tr.value_of(t)).collect::<Result<Vec<_>>>()?;
        let id = tr.graph.push(NodeOp::Prim(op), args, shape, dtype, out_device);
        Ok(tr.symbolic_tensor(id, is_view))
    })
}

/// Records an opaque node (a custom op) of the given result on `inputs` (at least one).
pub(crate) fn record_node(op: NodeOp, inputs: &[&Tensor], shape: Vec<usize>, dtype: DType) -> Result<Tensor> {
    with(|tr| {
        let args = inputs.iter().map(|t| tr.value_of(t)).collect::<Result<Vec<_>>>()?;
        let id = tr.graph.push(op, args, shape, dtype, inputs[0].device());
        Ok(tr.symbolic_tensor(id, false))
    })
}

/// `Tensor::full` inside a traced function.
pub(crate) fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
    with(|tr| {
        let id = tr.graph.push(NodeOp::Full(value), vec![], shape.to_vec(), dtype, device);
        Ok(tr.symbolic_tensor(id, false))
    })
}

/// `Tensor::arange` inside a traced function: `n` values `start + i * step`.
pub(crate) fn arange(start: f64, step: f64, n: usize, dtype: DType, device: Device) -> Result<Tensor> {
    with(|tr| {
        let id = tr.graph.push(NodeOp::Arange { start, step }, vec![], vec![n], dtype, device);
        Ok(tr.symbolic_tensor(id, false))
    })
}

/// A random draw inside a traced function: a new draw on every call of the compiled function.
pub(crate) fn random(kind: RandomKind, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    with(|tr| {
        let id = tr.graph.push(NodeOp::Random(kind), vec![], shape.to_vec(), dtype, device);
        Ok(tr.symbolic_tensor(id, false))
    })
}

/// An in-place write of `value` (already of `dst`'s shape and dtype) into `dst`, functionalised:
/// a symbolic `dst` is rebound to the new value; a captured one is written back after the call.
pub(crate) fn assign(dst: &Tensor, value: &Tensor) -> Result<()> {
    with(|tr| {
        let v = tr.value_of(value)?;
        match dst.storage().traced_ref() {
            Some(r) if r.trace == tr.id => {
                if dst.is_view() {
                    return Err(Error::Compile(format!(
                        "an in-place write into a view (shape {:?}) inside a compiled function is not supported; write into the base tensor",
                        dst.shape()
                    )));
                }
                // Every tensor sharing the storage sees the new value.
                *dst.storage().data.write() = BackendStorage::Traced(TraceRef { trace: tr.id, node: v });
                if let Some(k) = tr.arg_of(dst) {
                    match tr.arg_writes.iter_mut().find(|w| w.0 == k) {
                        Some(w) => w.1 = v,
                        None => tr.arg_writes.push((k, v)),
                    }
                }
                Ok(())
            }
            Some(_) => Err(escaped()),
            None if tr.arg_of(dst).is_some() => Err(Error::Compile(
                "an in-place write into an argument after a graph break is not supported; write before the host read or compile with fullgraph".into(),
            )),
            None => {
                tr.value_of(dst)?; // captures it, checking aliasing
                // An input (or a view of one) written back after the call would be read as the
                // write-backs and the program's in-place writes left it: copied here, where the
                // program reads it.
                let v = if matches!(tr.graph.nodes[tr.graph.view_root(v)].op, NodeOp::Arg(_) | NodeOp::Captured(_)) {
                    let (shape, dtype, device) = (value.shape().to_vec(), value.dtype(), value.device());
                    tr.graph.push(NodeOp::Prim(crate::ops::Op::Cast(dtype)), vec![v], shape, dtype, device)
                } else {
                    v
                };
                tr.written.insert(dst.id(), (dst.clone(), v));
                Ok(())
            }
        }
    })
}

/// Whether any real tensor the trace on this thread reads so far (its arguments, the tensors it
/// captured) satisfies `pred`; false outside a trace (and while the tracer itself is busy).
pub(crate) fn any_input(pred: impl Fn(&Tensor) -> bool) -> bool {
    TRACER.with(|t| t.try_borrow().is_ok_and(|t| t.as_ref().is_some_and(|tr| tr.inputs.iter().any(&pred))))
}

/// Called before a host read of `t`: a symbolic tensor is an error under `fullgraph`, else a
/// graph break that gives it (and every other live symbolic tensor) real values.
#[track_caller]
pub(crate) fn before_host_read(t: &Tensor, what: &str) -> Result<()> {
    let Some(r) = t.storage().traced_ref() else { return Ok(()) };
    let loc = std::panic::Location::caller();
    let (id, fullgraph) = TRACER.with(|tr| tr.borrow().as_ref().map(|tr| (tr.id, tr.fullgraph))).unwrap_or((0, false));
    if id != r.trace {
        return Err(escaped());
    }
    if fullgraph {
        return Err(Error::Compile(format!(
            "{what} at {}:{}:{} reads the value of a tensor inside a function compiled with fullgraph(true); \
             remove the read or compile without fullgraph (the read becomes a graph break)",
            loc.file(),
            loc.line(),
            loc.column()
        )));
    }
    let reason = format!("{what} at {}:{}:{}", loc.file(), loc.line(), loc.column());
    crate::logging::log(Topic::Breaks, || format!("graph break: {reason}"));
    graph_break(reason)
}

fn escaped() -> Error {
    Error::Compile("a tensor made inside a compiled function was used outside the call that made it; return it from the function instead".into())
}

/// Runs the graph so far and swaps real data into every symbolic storage still alive.
fn graph_break(reason: String) -> Result<()> {
    let (mut graph, inputs, live, runner) = with(|tr| {
        if !tr.arg_writes.is_empty() {
            return Err(Error::Compile(format!(
                "an argument was written in place before a graph break ({reason}), which is not supported; move the host read before the write"
            )));
        }
        tr.breaks.push(reason);
        let mut live: Vec<(NodeId, Arc<Storage>)> = vec![];
        for w in &tr.symbolic {
            if let Some(s) = w.upgrade() {
                if let Some(r) = s.traced_ref() {
                    live.push((r.node, s));
                }
            }
        }
        tr.finish_writes();
        let graph = std::mem::take(&mut tr.graph);
        let inputs = std::mem::take(&mut tr.inputs);
        tr.captured.clear();
        tr.grad_none.clear();
        tr.written.clear();
        tr.symbolic.clear();
        Ok((graph, inputs, live, tr.on_break.clone()))
    })?;
    graph.outputs = live.iter().map(|l| l.0).collect();
    let values = {
        let _off = Suspend::new();
        runner(&graph, &inputs)?
    };
    // Each live storage takes a private copy of its value.
    fill_escaped(&live.into_iter().map(|(node, st)| (st, stored_format(&graph, node))).collect::<Vec<_>>(), values)
}

/// Turns tracing off for its lifetime (the runtime runs real ops inside a trace at a break).
pub(crate) struct Suspend(bool);
impl Suspend {
    pub(crate) fn new() -> Suspend {
        Suspend(ACTIVE.with(|a| a.replace(false)))
    }
}
impl Drop for Suspend {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.0));
    }
}

impl Tracer {
    /// Which argument's symbolic storage `t` is, if any.
    fn arg_of(&self, t: &Tensor) -> Option<usize> {
        self.arg_storages.iter().position(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(t.storage())))
    }

    fn symbolic_tensor(&mut self, node: NodeId, is_view: bool) -> Tensor {
        let n = &self.graph.nodes[node];
        let st = Arc::new(Storage::traced(n.device, TraceRef { trace: self.id, node }));
        self.symbolic.push(Arc::downgrade(&st));
        Tensor::from_parts(st, Layout::dense_in(&n.shape, stored_format(&self.graph, node)), n.dtype, is_view)
    }

    /// The node holding `t`'s value: its own node when symbolic, else it is captured.
    fn value_of(&mut self, t: &Tensor) -> Result<NodeId> {
        if let Some(r) = t.storage().traced_ref() {
            if r.trace != self.id {
                return Err(escaped());
            }
            return Ok(r.node);
        }
        if let Some((_, n)) = self.written.get(&t.id()) {
            return Ok(*n);
        }
        if let Some(&n) = self.captured.get(&t.id()) {
            return Ok(n);
        }
        // Another view of a storage written in place would miss the write.
        if let Some((w, _)) = self.written.values().find(|(w, _)| w.shares_storage_with(t)) {
            return Err(Error::Compile(format!(
                "a compiled function reads a view (shape {:?}) of a captured tensor (shape {:?}) it also writes in place; \
                 use the written tensor itself",
                t.shape(),
                w.shape()
            )));
        }
        let k = self.graph.n_captured;
        let id = self.graph.push(NodeOp::Captured(k), vec![], t.shape().to_vec(), t.dtype(), t.device());
        self.inputs.push(t.clone());
        self.grad_none.push(t.grad().is_none());
        self.captured.insert(t.id(), id);
        Ok(id)
    }

    /// Moves the in-place writes to captured tensors into the graph's write-back list.
    fn finish_writes(&mut self) {
        let mut writes: Vec<(usize, NodeId)> = self
            .written
            .values()
            .map(|(t, v)| {
                let input = self.captured[&t.id()];
                let k = match self.graph.nodes[input].op {
                    NodeOp::Captured(k) => k,
                    _ => unreachable!("written tensors are captured"),
                };
                (k, *v)
            })
            .collect();
        writes.sort();
        self.graph.mutations = writes;
    }
}
