//! Running graphs: the eager runner (op by op, with autograd), and programs — a schedule of
//! fused kernels and eager steps whose values are dropped after their last use, so the caching
//! allocator hands their memory to the next step (the memory plan).

use super::fuse::{self, Schedule, Step};
use crate::logging::Topic;
use super::graph::{Graph, Node, NodeId, NodeOp, RandomKind};
use crate::backend::cuda::device::graph::Footprint;
use crate::backend::cuda::kernels::fused::PendingRow;
use crate::layout::{Layout, FROM_NHWC, TO_NHWC};
use crate::{Result, Tensor};

fn input_of(g: &Graph, n: &Node, inputs: &[Tensor]) -> Option<Tensor> {
    match n.op {
        NodeOp::Arg(k) => Some(inputs[k].clone()),
        NodeOp::Captured(k) => Some(inputs[g.n_args + k].clone()),
        _ => None,
    }
}

fn random(kind: RandomKind, n: &Node) -> Result<Tensor> {
    match kind {
        RandomKind::Uniform => Tensor::rand(&n.shape, n.dtype, &n.device),
        RandomKind::Normal => Tensor::randn(&n.shape, n.dtype, &n.device),
        RandomKind::Int { low, high } => Tensor::randint(low, high, &n.shape, &n.device),
    }
}

/// Whether `a` and `b` are the same view of the same storage.
fn same_view(a: &Tensor, b: &Tensor) -> bool {
    a.shares_storage_with(b) && a.layout() == b.layout()
}

/// Writes the new values of captured tensors written in place into them (those a kernel
/// already wrote in place only get their version bumped). A host value that nothing else
/// reads (not returned, not written to a second tensor, no other tensor holding its storage)
/// hands its buffer over instead of being copied.
fn write_back(g: &Graph, inputs: &[Tensor], env: &[Option<Tensor>]) -> Result<()> {
    let mut copies = vec![];
    for (k, v) in &g.mutations {
        let target = &inputs[g.n_args + k];
        let value = env[*v].as_ref().expect("computed");
        if same_view(value, target) {
            target.storage().bump_version();
            continue;
        }
        let sole = !g.outputs.contains(v) && g.mutations.iter().filter(|m| m.1 == *v).count() == 1;
        if sole && target.device() == crate::Device::Cpu {
            // The copies before a handed-over buffer read what it held until now.
            crate::backend::write_many(&std::mem::take(&mut copies))?;
            if crate::backend::cpu::move_into(target, value) {
                target.storage().bump_version();
                continue;
            }
        }
        copies.push((target, value));
    }
    crate::backend::write_many(&copies)
}

/// Runs `g` op by op through the eager ops, recording autograd as eager code would.
pub(crate) fn run_eager(g: &Graph, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let _off = super::trace::Suspend::new();
    let mut env: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let t = match &n.op {
            NodeOp::Arg(_) | NodeOp::Captured(_) => input_of(g, n, inputs).expect("an input"),
            NodeOp::Prim(op) => {
                let args: Vec<&Tensor> = n.args.iter().map(|a| env[*a].as_ref().expect("computed before use")).collect();
                crate::ops::apply(op.clone(), &args)?
            }
            NodeOp::Custom(c) => c.call(&n.args.iter().map(|a| env[*a].as_ref().expect("computed before use")).collect::<Vec<_>>())?,
            NodeOp::Collective(c) => c.run(env[n.args[0]].as_ref().expect("computed before use"))?,
            NodeOp::Full(_) | NodeOp::Arange { .. } => n.make_constant()?,
            NodeOp::Random(kind) => random(*kind, n)?,
        };
        env[i] = Some(t);
    }
    write_back(g, inputs, &env)?;
    Ok(g.outputs.iter().map(|&o| env[o].clone().expect("computed")).collect())
}

/// How much of a program `run_steps_of` runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RunScope {
    /// Every step.
    Full,
    /// The steps computed from parameters alone, and the inputs and views they read (returns
    /// nothing).
    HoistedOnly,
    /// Every step's host side with the device left alone, nothing kept or written back: the
    /// kernels it asks for are built before the first run (`cuda::tuning::rehearsal`).
    Rehearsal,
}

/// A graph scheduled into fused kernels, library products and eager steps.
pub(crate) struct Program {
    pub graph: Graph,
    pub schedule: Schedule,
    /// Max-autotune: library algorithms and row-kernel launch shapes are timed on first use.
    tune: bool,
    /// Per step, the values no later step reads.
    frees: Vec<Vec<NodeId>>,
    /// New values of captured tensors that their fused kernel writes straight into them (by
    /// captured index): no copy afterwards.
    in_place: std::collections::HashMap<NodeId, usize>,
    /// Per fused kernel, per output: the inputs whose buffers it may take (`plan_reuse`).
    reuse: Vec<Vec<Vec<usize>>>,
    /// Per library product: whether its matrix is an input the program never writes
    /// (`settled_matrices`).
    settled: Vec<bool>,
    /// Values computed only from captured tensors the graph does not write (parameters under
    /// inference: their casts, transposes, sums), kept between runs.
    hoisted: Hoisted,
    /// Whether the first run's rehearsal (kernels built side by side) has happened.
    rehearsed: std::sync::atomic::AtomicBool,
    /// Views of captured tensors, made once.
    views: CapturedViews,
    /// Per fused kernel: whether a library product runs it as its prologue
    /// (`fuse::row_prologues`; its own step only makes its output buffers).
    deferred: Vec<bool>,
    /// Cache attentions whose cache and positions no earlier step writes (`settled_caches`).
    settled_caches: std::collections::HashSet<NodeId>,
}

/// Views of captured tensors (a weight transposed, a bias reshaped and spread over the rows)
/// are made once and reused while the captured tensor is the same: made each call, each costs
/// an op's host time (a compiled layer norm's four took 1.4 us of a 10 us call). A reshape
/// that had to copy is not kept (the copy would miss later writes to the tensor).
struct CapturedViews {
    /// Per node: for a view of a captured tensor (through other views), that tensor's node.
    roots: Vec<Option<NodeId>>,
    /// Per node: the captured tensor it was made from, and the view (held: no other tensor
    /// takes that storage while it is named here).
    made: parking_lot::Mutex<Vec<Option<(Tensor, Tensor)>>>,
}

impl CapturedViews {
    fn plan(g: &Graph) -> CapturedViews {
        let roots = (0..g.nodes.len()).map(|i| Some(g.view_root(i)).filter(|&r| r != i && matches!(g.nodes[r].op, NodeOp::Captured(_)))).collect();
        CapturedViews { made: parking_lot::Mutex::new(vec![None; g.nodes.len()]), roots }
    }
}

/// Work that depends only on captured tensors: its steps run once and their results are kept
/// until one of those tensors changes version (then they run again, writing into the kept
/// buffers, whose addresses a captured CUDA graph has baked in).
#[derive(Default)]
struct Hoisted {
    /// Per step: runs only to refresh the kept values.
    steps: Vec<bool>,
    /// Values of those steps that later steps read.
    kept: Vec<NodeId>,
    /// The captured tensors (by captured index) the kept values derive from.
    sources: Vec<usize>,
    cache: parking_lot::Mutex<Option<HoistCache>>,
    /// A captured CUDA graph reads the kept buffers: refreshing writes into them instead of
    /// replacing them.
    pinned: std::sync::atomic::AtomicBool,
}

struct HoistCache {
    versions: Vec<u64>,
    /// The source tensors the values were computed from (held, so no other tensor can take
    /// their storage while the cache names them).
    sources: Vec<Tensor>,
    values: Vec<Tensor>,
}

impl Hoisted {
    fn plan(g: &Graph, s: &Schedule) -> Hoisted {
        #[derive(Clone, Copy, PartialEq)]
        enum Class {
            Param,
            Const,
            Frozen,
            Dynamic,
        }
        let mutated: std::collections::HashSet<usize> = g.mutations.iter().map(|m| m.0).collect();
        let is_view = |i: NodeId| matches!(&g.nodes[i].op, NodeOp::Prim(op) if op.is_view());
        // Results handed to the caller or written back into captured tensors, and the values
        // they are views of, are made fresh each run: the caller owns them (and may write them
        // in place).
        let mut fresh_each_run = std::collections::HashSet::new();
        let mut class = vec![Class::Dynamic; g.nodes.len()];
        loop {
            for (i, n) in g.nodes.iter().enumerate() {
                let args = || n.args.iter().map(|&a| class[a]);
                class[i] = match &n.op {
                    _ if fresh_each_run.contains(&i) => Class::Dynamic,
                    NodeOp::Captured(k) if !mutated.contains(k) => Class::Param,
                    NodeOp::Full(_) => Class::Const,
                    // Made on the host and copied in: made once and kept, as parameters' work is.
                    NodeOp::Arange { .. } => Class::Frozen,
                    NodeOp::Prim(op) if op.is_view() => class[n.args[0]],
                    NodeOp::Prim(_) if args().any(|c| c == Class::Dynamic) => Class::Dynamic,
                    NodeOp::Prim(_) if args().any(|c| matches!(c, Class::Param | Class::Frozen)) => Class::Frozen,
                    NodeOp::Prim(_) => Class::Const,
                    _ => Class::Dynamic,
                };
            }
            let mut more = false;
            for &o in g.outputs.iter().chain(g.mutations.iter().map(|m| &m.1)) {
                let mut v = o;
                loop {
                    if class[v] == Class::Frozen {
                        more |= fresh_each_run.insert(v);
                    }
                    if !is_view(v) {
                        break;
                    }
                    v = g.nodes[v].args[0];
                }
            }
            if !more {
                break;
            }
        }
        let steps: Vec<bool> = s
            .steps
            .iter()
            .map(|st| match st {
                Step::Node(i) => class[*i] == Class::Frozen && !is_view(*i),
                Step::Kernel(k) => s.kernels[*k].outputs.iter().all(|(_, n)| class[*n] == Class::Frozen),
                Step::Gemm(_) => false,
            })
            .collect();
        let made: Vec<NodeId> = s
            .steps
            .iter()
            .zip(&steps)
            .filter(|(_, &h)| h)
            .flat_map(|(st, _)| step_outputs(s, st))
            .collect();
        let read_later = |v: NodeId| s.steps.iter().zip(&steps).any(|(st, &h)| !h && step_reads(g, s, st).contains(&v));
        let kept: Vec<NodeId> = made.into_iter().filter(|&v| read_later(v)).collect();
        let mut sources: Vec<usize> = g
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match n.op {
                NodeOp::Captured(k) if class[i] == Class::Param => Some(k),
                _ => None,
            })
            .collect();
        sources.sort_unstable();
        sources.dedup();
        if kept.is_empty() {
            return Hoisted::default();
        }
        crate::logging::log(Topic::Fusion, || format!("{} step(s) computed from parameters alone run once and keep {} value(s) until a parameter changes", steps.iter().filter(|&&h| h).count(), kept.len()));
        Hoisted { steps, kept, sources, cache: Default::default(), pinned: Default::default() }
    }

    fn versions(&self, g: &Graph, inputs: &[Tensor]) -> Vec<u64> {
        self.sources.iter().map(|&k| inputs[g.n_args + k].version()).collect()
    }

    /// Whether `cache` holds the kept values for these inputs: computed from the same source
    /// tensors, at their current versions. (Versions alone are not enough: a graph-break
    /// segment's captured inputs are values of the part before it, new tensors each call,
    /// whose versions repeat.)
    fn current(&self, cache: &Option<HoistCache>, g: &Graph, inputs: &[Tensor]) -> bool {
        cache.as_ref().is_some_and(|c| {
            c.values.len() == self.kept.len()
                && self.sources.iter().zip(&c.sources).all(|(&k, was)| same_view(&inputs[g.n_args + k], was))
                && c.versions == self.versions(g, inputs)
        })
    }
}

impl Program {
    /// The program of `graph`. With `tune` (max-autotune) it times its library algorithms and
    /// row-kernel launch shapes on the device the first time each runs (a no-op on the CPU).
    pub(crate) fn new(graph: Graph, tune: bool) -> Program {
        let mut schedule = fuse::schedule(&graph);
        let in_place = plan_in_place(&graph, &schedule);
        let hoisted = Hoisted::plan(&graph, &schedule);
        let deferred = plan_prologues(&mut schedule, &in_place, &hoisted);
        plan_attentions(&mut schedule, &graph, &in_place, &hoisted);
        crate::logging::log(Topic::Fusion, || {
            let mut s = format!("the optimised graph:\n{graph}");
            s += &format!("{} kernels, {} library products, {} steps", schedule.kernels.len(), schedule.gemms.len(), schedule.steps.len());
            for k in &schedule.kernels {
                s += &format!("\n  {}", k.describe());
            }
            for gm in &schedule.gemms {
                s += &format!("\n  {}", gm.describe(&graph));
            }
            for note in &schedule.notes {
                s += &format!("\n  {note}");
            }
            s
        });
        let frees = plan(&graph, &schedule);
        let reuse = plan_reuse(&graph, &schedule, &frees);
        crate::logging::log(Topic::Memory, || planned_peak(&graph, &schedule, &frees, &in_place, &reuse).to_string());
        let views = CapturedViews::plan(&graph);
        let settled = settled_matrices(&graph, &schedule);
        let settled_caches = settled_caches(&graph, &schedule, &in_place);
        Program { graph, schedule, tune, frees, in_place, reuse, settled, hoisted, rehearsed: Default::default(), views, deferred, settled_caches }
    }

    /// Marks the captured tensors the program writes in place as written (their versions move),
    /// as a run's write-back does: after a replay of its CUDA graph, whose kernels wrote them.
    pub(crate) fn note_replayed_writes(&self, captured: &[Tensor]) {
        for (k, _) in &self.graph.mutations {
            captured[*k].storage().bump_version();
        }
    }

    /// Its steps as a CUDA graph's capture would order them, planned without a device
    /// (`KILN_PLAN_FOR=cuda` with `KILN_LOG=graph`): each value is handed memory by the capture
    /// pool's rule as its step begins and given back after its last reader, and each step waits
    /// for the steps it conflicts with. Arguments, captured tensors and kept values live outside
    /// the pool; library workspaces and outputs written into dying inputs are left out.
    pub(crate) fn planned_graph(&self) -> String {
        use crate::backend::cuda::device::graph::{longest_chain, Footprint, PlannedCapture};
        let Some(mut cap) = PlannedCapture::new() else { return "no planned graph while this thread captures one".into() };
        let (g, sch) = (&self.graph, &self.schedule);
        // Where each value lives, and how many live values share each pool buffer.
        let mut at: Vec<Option<(u64, u64)>> = vec![None; g.nodes.len()];
        let mut sharing: std::collections::HashMap<u64, usize> = Default::default();
        let captured_node: std::collections::HashMap<usize, NodeId> = g.nodes.iter().enumerate().filter_map(|(i, n)| match n.op {
            NodeOp::Captured(k) => Some((k, i)),
            _ => None,
        }).collect();
        let mut outside = 1u64 << 40;
        let mut place_outside = |bytes: usize| {
            let r = (outside, outside + bytes as u64);
            outside += bytes.next_multiple_of(512) as u64 + 512;
            r
        };
        cap.begin(vec![]);
        cap.end(true, Footprint::barrier("arguments copied in"));
        for (i, step) in sch.steps.iter().enumerate() {
            let hoisted = self.hoisted.steps.get(i).copied().unwrap_or(false);
            if hoisted {
                // Kept between calls: a replay does not run it.
                for o in step_outputs(sch, step) {
                    at[o] = Some(place_outside(g.nodes[o].bytes()));
                }
                continue;
            }
            let reads: Vec<(u64, u64)> = step_reads(g, sch, step).into_iter().filter_map(|n| at[n]).collect();
            cap.begin(reads.clone());
            let mut writes = vec![];
            let mut make = |cap: &mut PlannedCapture, n: NodeId| {
                let r = match self.in_place.get(&n) {
                    // Written into the captured tensor it updates.
                    Some(&k) => match captured_node.get(&k).and_then(|&c| at[c]) {
                        Some(r) => r,
                        None => place_outside(g.nodes[n].bytes()),
                    },
                    None => {
                        let r = cap.alloc(g.nodes[n].bytes());
                        sharing.insert(r.0, 1);
                        r
                    }
                };
                at[n] = Some(r);
                writes.push(r);
            };
            let captured = match step {
                Step::Node(n) if g.nodes[*n].reads_nothing() => {
                    at[*n] = Some(place_outside(g.nodes[*n].bytes()));
                    false
                }
                Step::Node(n) if matches!(&g.nodes[*n].op, NodeOp::Prim(op) if op.is_view()) => {
                    at[*n] = g.nodes[*n].args.first().and_then(|&a| at[a]);
                    if let Some(c) = at[*n].and_then(|r| sharing.get_mut(&r.0)) {
                        *c += 1;
                    }
                    false
                }
                Step::Node(n) => {
                    make(&mut cap, *n);
                    // (and the product that runs it)
                    if let Some(r) = attending_gemm(g, sch, *n).and_then(|j| at[sch.gemms[j].out()]) {
                        writes.push(r);
                    }
                    true
                }
                Step::Kernel(k) => {
                    for &(_, n) in &sch.kernels[*k].outputs {
                        make(&mut cap, n);
                    }
                    !self.deferred[*k]
                }
                Step::Gemm(j) => {
                    make(&mut cap, sch.gemms[*j].out());
                    sch.gemms[*j].attention.is_none()
                }
            };
            let what = step_name(g, sch, step);
            let fp = if is_barrier(g, step, false) { Footprint::barrier(what) } else { Footprint { reads, writes, shared: false, barrier: false, what } };
            cap.end(captured, fp);
            for &f in &self.frees[i] {
                let Some(r) = at[f].take() else { continue };
                if let Some(c) = sharing.get_mut(&r.0) {
                    *c -= 1;
                    if *c == 0 {
                        sharing.remove(&r.0);
                        cap.free(r);
                    }
                }
            }
        }
        let (whats, deps, held) = cap.finish();
        let mut text = format!("planned CUDA graph: {} steps, {} on the longest chain of waits; it would hold {:.1} MiB\n", deps.len(), longest_chain(&deps), held as f64 / (1u64 << 20) as f64);
        for (i, (what, d)) in whats.iter().zip(&deps).enumerate() {
            text += &format!("  {i:3} {what} <- {d:?}\n");
        }
        text
    }

    pub(crate) fn has_hoisted(&self) -> bool {
        !self.hoisted.kept.is_empty()
    }

    /// Whether a run makes an `Arange` itself (one the function returns or writes back, not
    /// computed once and kept): made on the host and copied to the device, which a CUDA graph
    /// cannot capture.
    pub(crate) fn makes_aranges(&self) -> bool {
        self.schedule.steps.iter().enumerate().any(|(s, st)| matches!(st, Step::Node(i) if matches!(self.graph.nodes[*i].op, NodeOp::Arange { .. })) && !self.hoisted.steps.get(s).copied().unwrap_or(false))
    }

    /// From now on the kept values keep their buffers (a CUDA graph about to be captured reads them).
    pub(crate) fn pin_hoisted(&self) {
        self.hoisted.pinned.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Brings the values computed from parameters alone up to date (nothing when they are):
    /// before replaying a CUDA graph that reads them.
    pub(crate) fn refresh_hoisted(&self, inputs: &[Tensor]) -> Result<()> {
        let h = &self.hoisted;
        let fresh = h.kept.is_empty() || h.current(&h.cache.lock(), &self.graph, inputs);
        if fresh {
            return Ok(());
        }
        let _off = super::trace::Suspend::new();
        crate::no_grad(|| self.run_steps_of(inputs, RunScope::HoistedOnly)).map(drop)
    }

    /// How many kernels one run launches on a GPU (fused kernels plus eager steps that compute),
    /// once the values computed from parameters alone are kept.
    pub(crate) fn kernel_count(&self) -> usize {
        self.schedule.steps.iter().enumerate().filter(|(i, _)| !self.hoisted.steps.get(*i).copied().unwrap_or(false)).map(|(_, s)| s).filter(|s| match s {
            Step::Kernel(k) => !self.deferred[*k],
            Step::Gemm(j) => self.schedule.gemms[*j].attention.is_none(),
            Step::Node(i) => matches!(&self.graph.nodes[*i].op, NodeOp::Prim(op) if !op.is_view())
                || self.graph.nodes[*i].is_constant()
                || matches!(self.graph.nodes[*i].op, NodeOp::Random(_) | NodeOp::Custom(_) | NodeOp::Collective(_)),
        }).count()
    }

    pub(crate) fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let _off = super::trace::Suspend::new();
        crate::no_grad(|| {
            // The first run on a GPU: its kernels are built side by side first.
            if !self.rehearsed.swap(true, std::sync::atomic::Ordering::Relaxed) && self.graph.nodes.iter().any(|n| n.device.is_cuda()) {
                crate::backend::cuda::tuning::rehearsal::rehearse(|| self.run_steps_of(inputs, RunScope::Rehearsal).map(drop));
            }
            self.run_steps(inputs)
        })
    }

    fn run_steps(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.run_steps_of(inputs, RunScope::Full)
    }

    /// Runs the schedule (`RunScope` says how much of it, and whether for real).
    fn run_steps_of(&self, inputs: &[Tensor], pass: RunScope) -> Result<Vec<Tensor>> {
        let hoisted_only = pass == RunScope::HoistedOnly;
        let g = &self.graph;
        let h = &self.hoisted;
        let mut env: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
        let mut cache = h.cache.lock();
        let mut views = self.views.made.lock();
        let fresh = pass != RunScope::Rehearsal && !h.kept.is_empty() && h.current(&cache, g, inputs);
        if fresh {
            for (v, t) in h.kept.iter().zip(&cache.as_ref().expect("fresh").values) {
                env[*v] = Some(t.clone());
            }
        }
        // Collectives started and not yet waited for (not while a CUDA graph is captured, where
        // each step's place in the graph comes from what it touches).
        let overlap = pass == RunScope::Full && crate::backend::cuda::device::graph::capturing().is_none();
        let mut in_flight = InFlight::default();
        // Once this run has launched a kernel, whatever ran before the program has ended by the
        // time a later kernel starts (every kernel of kiln's waits for those before it first).
        let launches_before = crate::backend::cuda::launch_count();
        // Row kernels waiting for the product that runs them (`deferred`): their inputs and
        // output buffers.
        let mut pending: std::collections::HashMap<usize, HeldRow> = Default::default();
        // Products waiting for the cache attention they run (`fuse::Gemm::attention`), by the
        // attention: the product, and its row kernel's inputs and outputs.
        let mut attending: std::collections::HashMap<NodeId, (usize, Option<HeldRow>)> = Default::default();
        for (s, step) in self.schedule.steps.iter().enumerate() {
            let view = matches!(step, Step::Node(i) if matches!(&g.nodes[*i].op, NodeOp::Prim(op) if op.is_view()));
            if !view {
                for r in step_reads(g, &self.schedule, step) {
                    in_flight.wait_for(r)?;
                }
            }
            let hoisted = h.steps.get(s).copied().unwrap_or(false);
            // Inputs, constants and views of what is at hand cost no kernel.
            let free = matches!(step, Step::Node(i)
                if (g.nodes[*i].reads_nothing() || matches!(&g.nodes[*i].op, NodeOp::Prim(op) if op.is_view()))
                    && g.nodes[*i].args.iter().all(|a| env[*a].is_some()));
            if (hoisted && fresh) || (hoisted_only && !hoisted && !free) {
                continue;
            }
            if pass == RunScope::Full {
                // While a CUDA graph is captured: what this step reads, so that the buffers it
                // is handed make it wait for no step it does not already wait for.
                crate::backend::cuda::device::graph::begin_step(|| ranges(step_reads(g, &self.schedule, step), &env));
            }
            match step {
                Step::Node(i) => {
                    env[*i] = Some(match self.views.roots[*i] {
                        Some(r) => {
                            let root = input_of(g, &g.nodes[r], inputs).expect("a captured tensor");
                            match &views[*i] {
                                Some((was, v)) if same_view(was, &root) => v.clone(),
                                _ => {
                                    let v = run_node(g, *i, inputs, &env)?;
                                    views[*i] = v.shares_storage_with(&root).then(|| (root, v.clone()));
                                    v
                                }
                            }
                        }
                        None => match self.in_place.get(i).map(|&k| &inputs[g.n_args + k]) {
                            // A scatter the plan writes into its captured tensor: only the indexed
                            // elements are stored, and the tensor is the value.
                            Some(t) if t.is_contiguous() => {
                                let (NodeOp::Prim(crate::ops::Op::Scatter(dim)), [_, index, src]) = (&g.nodes[*i].op, g.nodes[*i].args.as_slice()) else { unreachable!("the plan writes nodes in place only for scatters") };
                                let arg = |a: &NodeId| env[*a].as_ref().expect("computed before use");
                                crate::backend::scatter_into(t, *dim, arg(index), arg(src))?;
                                t.clone()
                            }
                            _ => match &g.nodes[*i].op {
                                NodeOp::Collective(c) if overlap => {
                                    let (t, w) = c.start(env[g.nodes[*i].args[0]].as_ref().expect("computed before use"))?;
                                    in_flight.start(*i, w);
                                    t
                                }
                                _ if view => {
                                    let a = g.nodes[*i].args[0];
                                    let v = run_node(g, *i, inputs, &env)?;
                                    if !in_flight.alias(*i, a, v.shares_storage_with(env[a].as_ref().expect("computed before use")))? {
                                        // A reshape that copied read the values: once more, after them.
                                        run_node(g, *i, inputs, &env)?
                                    } else {
                                        v
                                    }
                                }
                                _ if attending.contains_key(i) => {
                                    let (j, held) = attending.remove(i).expect("pending");
                                    let settled_cache = self.settled_caches.contains(i) && crate::backend::cuda::launch_count() > launches_before && reads_inputs_directly(g, *i, inputs, &env);
                                    let settled = self.settled[j] && crate::backend::cuda::launch_count() > launches_before;
                                    self.run_attending(j, *i, inputs, &mut env, settled, settled_cache, held)?
                                }
                                _ if self.settled_caches.contains(i) && crate::backend::cuda::launch_count() > launches_before && reads_inputs_directly(g, *i, inputs, &env) => {
                                    let _settled = crate::ops::attention::SettledCache::hold();
                                    run_node(g, *i, inputs, &env)?
                                }
                                _ => run_node(g, *i, inputs, &env)?,
                            },
                        },
                    })
                }
                Step::Gemm(j) if self.schedule.gemms[*j].attention.is_some() => {
                    // Run later with the attention: its output buffer now, for the views between.
                    let gm = &self.schedule.gemms[*j];
                    let (out, a) = (&g.nodes[gm.out()], g.nodes[gm.matmul].args[0]);
                    env[gm.out()] = Some(crate::backend::uninit_like(env[a].as_ref().expect("computed before use"), &out.shape, out.dtype)?);
                    let held = gm.prologue.and_then(|p| pending.remove(&p.kernel));
                    attending.insert(gm.attention.expect("checked"), (*j, held));
                }
                Step::Gemm(j) => {
                    let gm = &self.schedule.gemms[*j];
                    let settled = self.settled[*j] && crate::backend::cuda::launch_count() > launches_before;
                    let held = gm.prologue.and_then(|p| Some((p, pending.remove(&p.kernel)?)));
                    let row = held.as_ref().map(|(p, (ins, outs))| PendingRow { kernel: &self.schedule.kernels[p.kernel], inputs: ins, outputs: outs, row: p.output });
                    run_gemm_step(g, gm, inputs, &mut env, self.tune, settled, row.as_ref())?;
                }
                Step::Kernel(k) if self.deferred[*k] => {
                    // Run later by the product that reads its row: its buffers now, for the views
                    // between.
                    let kern = &self.schedule.kernels[*k];
                    let ins: Vec<Tensor> = kern.inputs.iter().map(|i| env[i.node].clone().expect("computed before use")).collect();
                    let outs = crate::backend::cuda::kernels::fused::pending_row_outputs(kern)?;
                    for ((_, node), t) in kern.outputs.iter().zip(&outs) {
                        env[*node] = Some(t.view_as_layout(Layout::contiguous(&g.nodes[*node].shape)));
                    }
                    pending.insert(*k, (ins, outs));
                }
                Step::Kernel(k) => {
                    let kern = &self.schedule.kernels[*k];
                    let ins: Vec<Tensor> = kern.inputs.iter().map(|i| env[i.node].clone().expect("computed before use")).collect();
                    // Outputs the plan writes into captured tensors in place.
                    let mut into: Vec<Option<Tensor>> = kern
                        .outputs
                        .iter()
                        .map(|(_, node)| {
                            let t = &inputs[g.n_args + *self.in_place.get(node)?];
                            let shape = g.nodes[*node].shape.as_slice();
                            if t.is_contiguous() && t.shape() == shape {
                                return Some(t.clone());
                            }
                            // A channels-last tensor, written by a kernel over its NHWC view.
                            let nhwc = (t.ndim() == 4).then(|| t.view_as_layout(t.layout().permuted(&TO_NHWC)))?;
                            (nhwc.is_contiguous() && nhwc.shape() == shape).then_some(nhwc)
                        })
                        .collect();
                    // Other outputs written into the buffers of inputs that die here.
                    for (m, j) in dying_inputs_to_write(&self.reuse[*k], &into, &ins).into_iter().enumerate() {
                        if let Some(j) = j {
                            into[m] = Some(ins[j].clone());
                            #[cfg(test)]
                            WRITES_INTO_DYING.with(|c| c.set(c.get() + 1));
                        }
                    }
                    let outs = if kern.device.is_cuda() {
                        crate::backend::cuda::kernels::fused::run(kern, &kern.shape, &ins, &into, self.tune)?
                    } else {
                        let _rec = crate::profiler::record::cpu_kernel(&kern.name);
                        crate::backend::cpu::fused::run(kern, &kern.shape, &ins, &into)?
                    };
                    for ((_, node), t) in kern.outputs.iter().zip(outs) {
                        let shape = &g.nodes[*node].shape;
                        env[*node] = Some(if t.shape() == shape.as_slice() { t } else { t.view_as_layout(Layout::contiguous(shape)) });
                    }
                }
            }
            if hoisted && pass != RunScope::Rehearsal {
                self.keep(inputs, s, &mut env, &mut cache)?;
            }
            if pass == RunScope::Full {
                // While a CUDA graph is captured: what this step touched, so that it waits at
                // replay only for the steps it conflicts with.
                crate::backend::cuda::device::graph::end_step(|| footprint(g, &self.schedule, step, &env, hoisted, &self.deferred));
            }
            if hoisted_only {
                continue;
            }
            // (Kept values stay alive in the cache.)
            for f in &self.frees[s] {
                env[*f] = None;
            }
        }
        in_flight.wait_all()?;
        if hoisted_only {
            return Ok(vec![]);
        }
        if pass != RunScope::Rehearsal {
            write_back(g, inputs, &env)?;
        }
        if pass == RunScope::Full {
            crate::backend::cuda::device::graph::end_step(|| Footprint::barrier("write-back"));
        }
        Ok(g.outputs.iter().map(|&o| env[o].clone().expect("computed")).collect())
    }

    /// After hoisted step `s` ran: its kept values go into the cache (into the buffers already
    /// there, whose addresses a CUDA graph may hold), and `env` reads them from there.
    fn keep(&self, inputs: &[Tensor], s: usize, env: &mut [Option<Tensor>], cache: &mut Option<HoistCache>) -> Result<()> {
        let h = &self.hoisted;
        let versions = h.versions(&self.graph, inputs);
        let made = step_outputs(&self.schedule, &self.schedule.steps[s]);
        let sources: Vec<Tensor> = h.sources.iter().map(|&k| inputs[self.graph.n_args + k].clone()).collect();
        let c = cache.get_or_insert_with(|| HoistCache { versions: versions.clone(), sources: sources.clone(), values: vec![] });
        for v in made {
            let Some(slot) = h.kept.iter().position(|&x| x == v) else { continue };
            let value = env[v].clone().expect("just computed");
            if let Some(kept) = c.values.get_mut(slot) {
                if h.pinned.load(std::sync::atomic::Ordering::Relaxed) {
                    kept.copy_(&value)?;
                    env[v] = Some(kept.clone());
                } else {
                    *kept = value;
                }
            } else {
                debug_assert_eq!(c.values.len(), slot, "hoisted values are kept in step order");
                c.values.push(value);
            }
        }
        c.versions = versions;
        c.sources = sources;
        Ok(())
    }
}

/// Collectives a program has started and not yet waited for: a step that reads one of their
/// values (or a view of one) waits for it first, so the steps between overlap the
/// communication, as backward's earlier layers overlap a DDP bucket's all-reduce.
#[derive(Default)]
struct InFlight {
    works: Vec<Option<crate::distributed::Work>>,
    /// Per value not yet complete: the work it waits for.
    pending: std::collections::HashMap<NodeId, usize>,
}

impl InFlight {
    fn start(&mut self, node: NodeId, w: crate::distributed::Work) {
        self.pending.insert(node, self.works.len());
        self.works.push(Some(w));
    }

    /// Waits for the work `node`'s value depends on, if any.
    fn wait_for(&mut self, node: NodeId) -> Result<()> {
        match self.pending.remove(&node).and_then(|k| self.works[k].take()) {
            Some(w) => w.wait(),
            None => Ok(()),
        }
    }

    /// View `node` of `of` was made: when `of` is pending, a view sharing its storage is pending
    /// on the same work; one that copied has read incomplete values, so the work is waited for
    /// and false returned (make the view again).
    fn alias(&mut self, node: NodeId, of: NodeId, shares: bool) -> Result<bool> {
        let Some(&k) = self.pending.get(&of) else { return Ok(true) };
        if self.works[k].is_none() {
            return Ok(true);
        }
        if shares {
            self.pending.insert(node, k);
            return Ok(true);
        }
        self.wait_for(of)?;
        Ok(false)
    }

    fn wait_all(self) -> Result<()> {
        self.works.into_iter().flatten().try_for_each(crate::distributed::Work::wait)
    }
}

/// Whether kernels on `device` write into the buffers of inputs that die there
/// (`KILN_MEMORY_REUSE` decides when set).
fn reuses_dying_buffers(device: crate::Device) -> bool {
    crate::switches::memory_reuse().unwrap_or(REUSE_BY_DEFAULT || device == crate::Device::Cpu)
}

/// Whether compiled CUDA kernels reuse dying buffers by default (the host's always do). An
/// output takes only an input that feeds it alone: the first rule (any dying input) made the
/// compiled ResNet training step diverge on the H200.
const REUSE_BY_DEFAULT: bool = true;

#[cfg(test)]
thread_local! {
    /// Kernels on this thread that wrote into a dying input's buffer.
    static WRITES_INTO_DYING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Per fused kernel, per output: the inputs whose buffers that output may take, as far as the
/// schedule tells (`dying_inputs_to_write` checks the tensors at run time): in a flat kernel, or
/// a full output of a mid kernel, on a device that reuses buffers, an input that dies at the
/// kernel's step, of the output's dtype and size, and read by no other full output. Each
/// element of the output is stored after the loads it depends on (a mid kernel's single walk
/// loads a batch of elements before it stores any, and its per-row results come from
/// accumulators, not loads), but a generated kernel (`__restrict__` operands on CUDA) may load
/// an input again after storing an output that does not depend on it.
fn plan_reuse(g: &Graph, s: &Schedule, frees: &[Vec<NodeId>]) -> Vec<Vec<Vec<usize>>> {
    let mut reuse: Vec<Vec<Vec<usize>>> = s.kernels.iter().map(|k| vec![vec![]; k.outputs.len()]).collect();
    for (step, st) in s.steps.iter().enumerate() {
        let Step::Kernel(kx) = st else { continue };
        let kern = &s.kernels[*kx];
        let numel = match kern.space {
            crate::kir::Space::Flat { numel } => numel,
            crate::kir::Space::Mid { outer, rows, inner } => outer * rows * inner,
            crate::kir::Space::Rows { .. } => continue,
        };
        if !reuses_dying_buffers(kern.device) {
            continue;
        }
        let full = |m: &usize| !kern.ops[kern.outputs[*m].0].row;
        let readers: Vec<Vec<usize>> = outputs_reading(kern).into_iter().map(|r| r.into_iter().filter(full).collect()).collect();
        for (m, (o, _)) in kern.outputs.iter().enumerate().filter(|&(m, _)| !kern.single[m] && full(&m)) {
            let dtype = kern.ops[*o].dtype;
            // (every input slot of the value feeds output m alone)
            let only_m = |node: NodeId| kern.inputs.iter().zip(&readers).filter(|(i, _)| i.node == node).all(|(_, r)| *r == [m]);
            reuse[*kx][m] = (0..kern.inputs.len())
                .filter(|&j| {
                    let node = kern.inputs[j].node;
                    frees[step].contains(&node) && g.nodes[node].dtype == dtype && g.nodes[node].numel() == numel && only_m(node)
                })
                .collect();
        }
    }
    reuse
}

/// For each output of a kernel not written in place (no tensor in `in_place`), given its
/// `candidates` (`plan_reuse`), the input whose buffer it takes: contiguous, held by nothing
/// but the program's environment and `ins` (no view of it, not an argument of the call, not
/// kept for a later call), and taken by no other output.
fn dying_inputs_to_write(candidates: &[Vec<usize>], in_place: &[Option<Tensor>], ins: &[Tensor]) -> Vec<Option<usize>> {
    let mut taken: Vec<usize> = vec![];
    candidates
        .iter()
        .zip(in_place)
        .map(|(cands, written)| {
            if written.is_some() {
                return None;
            }
            let j = cands.iter().copied().find(|&j| {
                let t = &ins[j];
                let copies = ins.iter().filter(|u| u.same_tensor(t)).count();
                !taken.iter().any(|&k| ins[k].same_tensor(t)) && t.is_contiguous() && t.held_only_by(1 + copies)
            })?;
            taken.push(j);
            Some(j)
        })
        .collect()
}

/// For each input of `kern`, the outputs whose values depend on it.
fn outputs_reading(kern: &crate::kir::FusedKernel) -> Vec<Vec<usize>> {
    use crate::kir::ValueRef;
    // Per op, the inputs it depends on (as a bit set over inputs, in words).
    let words = kern.inputs.len().div_ceil(64).max(1);
    let mut deps: Vec<Vec<u64>> = Vec::with_capacity(kern.ops.len());
    for op in &kern.ops {
        let mut d = vec![0u64; words];
        for a in &op.args {
            match a {
                ValueRef::In(j) => d[j / 64] |= 1 << (j % 64),
                ValueRef::Op(o) => d.iter_mut().zip(&deps[*o]).for_each(|(x, y)| *x |= y),
            }
        }
        deps.push(d);
    }
    (0..kern.inputs.len()).map(|j| (0..kern.outputs.len()).filter(|&m| deps[kern.outputs[m].0][j / 64] >> (j % 64) & 1 == 1).collect()).collect()
}

/// One node run by the eager backend (or an input, which needs nothing).
fn run_node(g: &Graph, i: NodeId, inputs: &[Tensor], env: &[Option<Tensor>]) -> Result<Tensor> {
    let n = &g.nodes[i];
    let arg = |a: &NodeId| env[*a].as_ref().expect("computed before use");
    Ok(match &n.op {
        NodeOp::Arg(_) | NodeOp::Captured(_) => input_of(g, n, inputs).expect("an input"),
        NodeOp::Prim(op) => op.forward(&n.args.iter().map(arg).collect::<Vec<_>>())?,
        NodeOp::Custom(c) => c.call(&n.args.iter().map(arg).collect::<Vec<_>>())?,
        NodeOp::Collective(c) => c.run(arg(&n.args[0]))?,
        NodeOp::Full(_) | NodeOp::Arange { .. } => n.make_constant()?,
        NodeOp::Random(kind) => random(*kind, n)?,
    })
}

/// A row kernel a product runs (`Program::deferred`), held until then: its inputs and its output
/// buffers.
type HeldRow = (Vec<Tensor>, Vec<Tensor>);

impl Program {
    /// Product `j` into its output buffer (made at its step) and the cache attention `i` that
    /// reads its rows, in one launch where the product's kernel takes both, else one after the
    /// other (the product's value written into the buffer): the attention's value. `held`: the
    /// product's row kernel, not yet run.
    #[allow(clippy::too_many_arguments)]
    fn run_attending(&self, j: usize, i: NodeId, inputs: &[Tensor], env: &mut [Option<Tensor>], settled: bool, settled_cache: bool, held: Option<HeldRow>) -> Result<Tensor> {
        let (g, gm) = (&self.graph, &self.schedule.gemms[j]);
        let (mm, n) = (&g.nodes[gm.matmul], &g.nodes[i]);
        let NodeOp::Prim(crate::ops::Op::AttentionUpTo { scale }) = n.op else { unreachable!("a cache attention") };
        let row = gm.prologue.zip(held.as_ref()).map(|(p, (ins, outs))| PendingRow { kernel: &self.schedule.kernels[p.kernel], inputs: ins, outputs: outs, row: p.output });
        let buffer = env[gm.out()].clone().expect("made at the product's step");
        {
            let arg = |a: NodeId| env[a].as_ref().expect("computed before use");
            let attend = crate::backend::cuda::kernels::gemv::Attend { out: &buffer, q: arg(n.args[0]), k: arg(n.args[1]), v: arg(n.args[2]), last: arg(n.args[3]), k_new: arg(n.args[4]), v_new: arg(n.args[5]), scale, settled: settled_cache };
            let bias = gm.bias.map(|b| (arg(b), gm.act));
            if let Some(t) = crate::backend::cuda::kernels::gemm_attending(arg(mm.args[0]), arg(mm.args[1]), mm.dtype, bias, settled, row.as_ref(), &attend, &n.shape)? {
                return Ok(t);
            }
        }
        // Apart: the product, written into the buffer the views read, then the attention.
        run_gemm_step(g, gm, inputs, env, self.tune, settled, row.as_ref())?;
        let value = env[gm.out()].replace(buffer.clone()).expect("computed");
        crate::backend::write_into(&buffer, &value)?;
        let _settled = settled_cache.then(crate::ops::attention::SettledCache::hold);
        run_node(g, i, inputs, env)
    }
}

/// Library product `gm` with its epilogue into `env[gm.out()]`: `run_gemm`, or where the
/// epilogue cannot run there (the library has no algorithm for it, or the bias is not a packed
/// vector) its nodes one by one.
fn run_gemm_step(g: &Graph, gm: &fuse::Gemm, inputs: &[Tensor], env: &mut [Option<Tensor>], tune: bool, settled: bool, row: Option<&PendingRow>) -> Result<()> {
    match run_gemm(g, gm, env, tune, settled, row)? {
        Some(t) => env[gm.out()] = Some(t),
        None => {
            for &i in &gm.nodes {
                env[i] = Some(run_node(g, i, inputs, env)?);
            }
            for &i in &gm.nodes[..gm.nodes.len() - 1] {
                env[i] = None;
            }
        }
    }
    Ok(())
}

/// A library product with its epilogue: the value of `gm.out()`, or None when the epilogue
/// cannot run (the caller then runs the step's nodes one by one).
/// `row`: the product's row kernel, not yet run (`fuse::RowPrologue`); it has run once this
/// returns.
fn run_gemm(g: &Graph, gm: &fuse::Gemm, env: &[Option<Tensor>], tune: bool, settled: bool, row: Option<&PendingRow>) -> Result<Option<Tensor>> {
    let mm = &g.nodes[gm.matmul];
    let arg = |a: NodeId| env[a].as_ref().expect("computed before use");
    let bias = gm.bias.map(|b| (arg(b), gm.act));
    let Some(t) = crate::backend::cuda::kernels::gemm(arg(mm.args[0]), arg(mm.args[1]), mm.dtype, bias, tune, settled, row, gm.argmax)? else { return Ok(None) };
    let out = &g.nodes[gm.out()].shape;
    Ok(Some(if t.shape() == out.as_slice() { t } else { t.view_as_layout(Layout::contiguous(out)) }))
}

/// Per library product of the schedule: whether its matrix (through views) is a captured tensor
/// the program does not write back, or an argument of a program that writes back nothing (an
/// argument may share memory with a captured tensor). No kernel of the program writes such a
/// matrix, so once the program has launched a kernel, none still running does.
fn settled_matrices(g: &Graph, s: &Schedule) -> Vec<bool> {
    let written: std::collections::HashSet<usize> = g.mutations.iter().map(|&(k, _)| k).collect();
    s.gemms
        .iter()
        .map(|gm| match g.nodes[g.view_root(g.nodes[gm.matmul].args[1])].op {
            NodeOp::Captured(k) => !written.contains(&k),
            NodeOp::Arg(_) => g.mutations.is_empty(),
            _ => false,
        })
        .collect()
}

/// The cache attentions (`Op::AttentionUpTo`) whose cache (keys, values) and positions no
/// kernel still running writes when they run, given that the program has launched a kernel
/// before them (`ops::attention::SettledCache`): those operands are views of the program's
/// inputs, and no step before writes anything in place (a tensor written in place may share
/// memory with them; the write-back of the program's other new values comes after its last
/// step) or runs user code (a custom op, a collective). Only in a program whose ops all run on
/// one device: the launch count that says the program has launched a kernel is per thread, and
/// a kernel on another device says nothing of the one before the attention on its stream.
fn settled_caches(g: &Graph, s: &Schedule, in_place: &std::collections::HashMap<NodeId, usize>) -> std::collections::HashSet<NodeId> {
    let mut op_devices = g.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(_) | NodeOp::Custom(_) | NodeOp::Collective(_))).map(|n| n.device);
    if let Some(first) = op_devices.next() {
        if op_devices.any(|d| d != first) {
            return Default::default();
        }
    }
    let writes = |step: &Step| match step {
        Step::Node(i) => in_place.contains_key(i) || matches!(g.nodes[*i].op, NodeOp::Custom(_) | NodeOp::Collective(_)),
        Step::Kernel(k) => s.kernels[*k].outputs.iter().any(|(_, n)| in_place.contains_key(n)),
        Step::Gemm(_) => false,
    };
    let before_writes = s.steps.iter().position(writes).unwrap_or(s.steps.len());
    let input = |a: NodeId| matches!(g.nodes[g.view_root(a)].op, NodeOp::Arg(_) | NodeOp::Captured(_));
    s.steps[..before_writes]
        .iter()
        .filter_map(|step| match step {
            Step::Node(i) if matches!(g.nodes[*i].op, NodeOp::Prim(crate::ops::Op::AttentionUpTo { .. })) && g.nodes[*i].args[1..4].iter().all(|&a| input(a)) => Some(*i),
            _ => None,
        })
        .collect()
}

/// Whether the cache attention `i`'s cache and positions, as computed, are views of the
/// program's inputs (a view that had to copy is the work of a kernel just before).
fn reads_inputs_directly(g: &Graph, i: NodeId, inputs: &[Tensor], env: &[Option<Tensor>]) -> bool {
    g.nodes[i].args[1..4].iter().all(|&a| {
        let root = input_of(g, &g.nodes[g.view_root(a)], inputs);
        matches!((&env[a], root), (Some(t), Some(r)) if t.shares_storage_with(&r))
    })
}

/// What a step that just ran touched on the device: the storage of the values it read and
/// wrote (memory it was handed meanwhile is added by the capture: a cuDNN call's workspace
/// comes from the allocator). Hoisted steps (which also write the kept buffers) and eager ops
/// not known to touch only those (a random draw, a copy between devices, a custom op) are
/// barriers; work using scratch memory shared across calls says so itself
/// (`graph::note_shared_scratch`).
fn footprint(g: &Graph, s: &Schedule, step: &Step, env: &[Option<Tensor>], hoisted: bool, deferred: &[bool]) -> Footprint {
    let what = step_name(g, s, step);
    if is_barrier(g, step, hoisted) {
        return Footprint::barrier(what);
    }
    // A row kernel its product runs touches memory in the product's step, and a product that
    // runs a cache attention in the attention's.
    if matches!(step, Step::Kernel(k) if deferred[*k]) || matches!(step, Step::Gemm(j) if s.gemms[*j].attention.is_some()) {
        return Footprint { reads: vec![], writes: vec![], shared: false, barrier: false, what };
    }
    let mut writes = step_outputs(s, step);
    if let Some(j) = match step {
        Step::Node(i) => attending_gemm(g, s, *i),
        _ => None,
    } {
        writes.extend(step_outputs(s, &Step::Gemm(j)));
    }
    Footprint { reads: ranges(step_reads(g, s, step), env), writes: ranges(writes, env), shared: false, barrier: false, what }
}

/// What a step is, for `KILN_LOG=graph`.
fn step_name(g: &Graph, s: &Schedule, step: &Step) -> String {
    match step {
        Step::Node(i) => format!("{} %{i}", g.nodes[*i].name()),
        Step::Kernel(k) => s.kernels[*k].name.clone(),
        Step::Gemm(j) => format!("gemm %{}", s.gemms[*j].matmul),
    }
}

/// Whether a captured step orders every step around it: hoisted work (which also writes the
/// kept buffers), and eager ops not known to touch only their arguments and result (a random
/// draw, a copy between devices, a custom op).
fn is_barrier(g: &Graph, step: &Step, hoisted: bool) -> bool {
    let known = |op: &crate::ops::Op| {
        use crate::ops::Op;
        matches!(op, Op::Unary(_) | Op::Binary(..) | Op::Where(_) | Op::Cast(_) | Op::Relayout(_) | Op::Reduce(..) | Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } | Op::Cat(_) | Op::Pad(..) | Op::IndexSelect(_) | Op::Gather(_) | Op::ScatterAdd(_) | Op::Scatter(_) | Op::Matmul | Op::Attention { .. } | Op::AttentionBackward { .. } | Op::AttentionUpTo { .. } | Op::Conv2d(_) | Op::Conv2dGradInput(..) | Op::Conv2dGradWeight(..) | Op::Conv2dBiasAct(..) | Op::MaxPool2d(_) | Op::MaxPool2dBackward(_))
    };
    hoisted || matches!(step, Step::Node(i) if !(matches!(&g.nodes[*i].op, NodeOp::Prim(op) if known(op)) || g.nodes[*i].is_constant()))
}

/// The device memory of values `nodes` (those computed so far).
fn ranges(nodes: Vec<NodeId>, env: &[Option<Tensor>]) -> Vec<(u64, u64)> {
    nodes.into_iter().filter_map(|n| env[n].as_ref().and_then(crate::backend::cuda::kernels::storage_range)).collect()
}

/// The values step `step` reads.
fn step_reads(g: &Graph, s: &Schedule, step: &Step) -> Vec<NodeId> {
    match step {
        // (a cache attention its product runs reads what the product reads, and the product's
        // output, which it writes, lives until then though the views of it are dead before)
        Step::Node(i) => {
            let product = attending_gemm(g, s, *i).map_or(vec![], |j| [step_reads(g, s, &Step::Gemm(j)), vec![s.gemms[j].out()]].concat());
            g.nodes[*i].args.iter().copied().chain(product).collect()
        }
        Step::Kernel(j) => s.kernels[*j].inputs.iter().map(|i| i.node).collect(),
        Step::Gemm(j) => {
            let gm = &s.gemms[*j];
            let prologue = gm.prologue.iter().flat_map(|p| s.kernels[p.kernel].inputs.iter().map(|i| i.node));
            gm.nodes.iter().flat_map(|&m| g.nodes[m].args.iter().copied()).filter(|a| !gm.nodes.contains(a)).chain(prologue).collect()
        }
    }
}

/// The values step `step` computes (a library product: its epilogue's result).
fn step_outputs(s: &Schedule, step: &Step) -> Vec<NodeId> {
    match step {
        Step::Node(i) => vec![*i],
        Step::Kernel(k) => s.kernels[*k].outputs.iter().map(|(_, n)| *n).collect(),
        Step::Gemm(j) => {
            let gm = &s.gemms[*j];
            std::iter::once(gm.out()).chain(gm.prologue.iter().flat_map(|p| s.kernels[p.kernel].outputs.iter().map(|(_, n)| *n))).collect()
        }
    }
}

/// Per fused kernel: whether the library product reading its row runs it as its prologue
/// (`fuse::row_prologues`). Not a kernel computed from parameters alone (kept between runs), nor
/// one writing a captured tensor in place: their products drop the prologue here.
fn plan_prologues(s: &mut Schedule, in_place: &std::collections::HashMap<NodeId, usize>, hoisted: &Hoisted) -> Vec<bool> {
    let mut deferred = vec![false; s.kernels.len()];
    for j in 0..s.gemms.len() {
        let Some(p) = s.gemms[j].prologue else { continue };
        if kept_between_runs(s, hoisted, Step::Kernel(p.kernel)) || s.kernels[p.kernel].outputs.iter().any(|(_, n)| in_place.contains_key(n)) {
            s.gemms[j].prologue = None;
        } else {
            deferred[p.kernel] = true;
        }
    }
    deferred
}

/// Cache attentions their product runs (`fuse::cache_attentions`), but not where either step is
/// kept between runs or the product's value is written into a captured tensor.
fn plan_attentions(s: &mut Schedule, g: &Graph, in_place: &std::collections::HashMap<NodeId, usize>, hoisted: &Hoisted) {
    for j in 0..s.gemms.len() {
        let Some(a) = s.gemms[j].attention else { continue };
        if kept_between_runs(s, hoisted, Step::Gemm(j)) || kept_between_runs(s, hoisted, Step::Node(a)) || in_place.contains_key(&s.gemms[j].out()) || g.nodes[s.gemms[j].out()].dtype != g.nodes[s.gemms[j].matmul].dtype {
            s.gemms[j].attention = None;
        }
    }
}

/// Whether `step` is kept between runs (computed from parameters alone), or not a step of `s`.
fn kept_between_runs(s: &Schedule, hoisted: &Hoisted, step: Step) -> bool {
    s.steps.iter().position(|st| *st == step).is_none_or(|at| hoisted.steps.get(at).copied().unwrap_or(false))
}

/// The product whose kernel runs the cache attention `i` (`fuse::Gemm::attention`).
fn attending_gemm(g: &Graph, s: &Schedule, i: NodeId) -> Option<usize> {
    if !matches!(g.nodes[i].op, NodeOp::Prim(crate::ops::Op::AttentionUpTo { .. })) {
        return None;
    }
    s.gemms.iter().position(|gm| gm.attention == Some(i))
}

/// The memory plan: after which step each value is dead (outputs and written-back values live
/// to the end).
fn plan(g: &Graph, s: &Schedule) -> Vec<Vec<NodeId>> {
    let mut last = vec![None; g.nodes.len()];
    for (k, step) in s.steps.iter().enumerate() {
        for r in step_reads(g, s, step) {
            last[r] = Some(k);
        }
    }
    for &o in g.outputs.iter().chain(g.mutations.iter().map(|(_, n)| n)) {
        last[o] = None;
    }
    let mut frees = vec![vec![]; s.steps.len()];
    for (v, l) in last.iter().enumerate() {
        if let Some(k) = l {
            frees[*k].push(v);
        }
    }
    frees
}

/// A program's memory plan, as `KILN_LOG=memory` prints it.
struct PlannedPeak {
    steps: usize,
    /// The most bytes of computed values alive at once, and the step where that is reached.
    peak: usize,
    at: usize,
    what: String,
    inputs: usize,
    /// The largest values alive at the peak: (node, its op, bytes).
    largest: Vec<(NodeId, String, usize)>,
    /// What is alive at the peak by the op that made it: (op, values, bytes), most bytes first.
    by_op: Vec<(String, usize, usize)>,
}

impl std::fmt::Display for PlannedPeak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = |b: usize| if b < 1 << 20 { format!("{:.1} KiB", b as f64 / 1024.0) } else { format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64) };
        write!(f, "program of {} steps: planned peak {} of computed values at step {} ({}), beside {} of inputs (library workspaces not counted)", self.steps, size(self.peak), self.at, self.what, size(self.inputs))?;
        if !self.largest.is_empty() {
            let l: Vec<String> = self.largest.iter().map(|(i, op, b)| format!("%{i} {op} {}", size(*b))).collect();
            write!(f, "; largest there: {}", l.join(", "))?;
        }
        if !self.by_op.is_empty() {
            let l: Vec<String> = self.by_op.iter().map(|(op, k, b)| format!("{op} {} in {k}", size(*b))).collect();
            write!(f, "; there by op: {}", l.join(", "))?;
        }
        Ok(())
    }
}

/// Walks the schedule with the frees of `plan`: each computed value holds its bytes from the
/// step that makes it until it and every view of it are dead; views, inputs and values stored
/// straight into captured tensors hold none.
fn planned_peak(g: &Graph, s: &Schedule, frees: &[Vec<NodeId>], in_place: &std::collections::HashMap<NodeId, usize>, reuse: &[Vec<Vec<usize>>]) -> PlannedPeak {
    let n = g.nodes.len();
    let bytes = |i: NodeId| g.nodes[i].bytes();
    // The value whose storage each node uses (None: an input's).
    let mut root: Vec<Option<NodeId>> = vec![None; n];
    for (i, node) in g.nodes.iter().enumerate() {
        root[i] = match &node.op {
            NodeOp::Arg(_) | NodeOp::Captured(_) => None,
            NodeOp::Prim(op) if op.is_view() => root[node.args[0]],
            _ if in_place.contains_key(&i) => None,
            _ => Some(i),
        };
    }
    let inputs = g.nodes.iter().enumerate().filter(|(_, x)| matches!(x.op, NodeOp::Arg(_) | NodeOp::Captured(_))).map(|(i, _)| bytes(i)).sum();
    let mut holders = vec![0usize; n];
    let (mut live, mut p) = (0usize, PlannedPeak { steps: s.steps.len(), peak: 0, at: 0, what: String::new(), inputs, largest: vec![], by_op: vec![] });
    for (k, step) in s.steps.iter().enumerate() {
        // Kernels' outputs written into dying inputs' buffers (`plan_reuse`; at run time
        // each must also be contiguous and held by nothing else).
        if let &Step::Kernel(j) = step {
            let kern = &s.kernels[j];
            let mut taken = vec![];
            for (m, (_, out)) in kern.outputs.iter().enumerate().filter(|(_, (_, o))| !in_place.contains_key(o)) {
                let found = reuse[j][m].iter().filter_map(|&i| root[kern.inputs[i].node]).find(|&r| holders[r] == 1 && !taken.contains(&r) && bytes(r) == bytes(*out));
                if let (Some(r), Some(was)) = (found, root[*out]) {
                    taken.push(r);
                    // (views of the output, later, hold that buffer too)
                    root.iter_mut().filter(|x| **x == Some(was)).for_each(|x| *x = Some(r));
                }
            }
        }
        for v in step_outputs(s, step) {
            if let Some(r) = root[v] {
                if holders[r] == 0 {
                    live += bytes(r);
                }
                holders[r] += 1;
            }
        }
        if live > p.peak {
            p.peak = live;
            p.at = k;
            p.what = match step {
                Step::Node(i) => g.nodes[*i].name(),
                Step::Kernel(j) => s.kernels[*j].name.clone(),
                Step::Gemm(_) => "matmul".into(),
            };
            let mut held: Vec<NodeId> = (0..n).filter(|&r| holders[r] > 0).collect();
            held.sort_by_key(|&r| std::cmp::Reverse(bytes(r)));
            let mut by_op: Vec<(String, usize, usize)> = vec![];
            for &r in &held {
                let name = g.nodes[r].name();
                match by_op.iter_mut().find(|(op, ..)| *op == name) {
                    Some((_, k, b)) => (*k, *b) = (*k + 1, *b + bytes(r)),
                    None => by_op.push((name, 1, bytes(r))),
                }
            }
            by_op.sort_by_key(|&(_, _, b)| std::cmp::Reverse(b));
            by_op.truncate(6);
            p.by_op = by_op;
            p.largest = held.into_iter().take(3).map(|r| (r, g.nodes[r].name(), bytes(r))).collect();
        }
        for &f in &frees[k] {
            if let Some(r) = root[f] {
                holders[r] = holders[r].saturating_sub(1);
                if holders[r] == 0 {
                    live -= bytes(r);
                }
            }
        }
    }
    p
}

/// Which written-back values a flat fused kernel (or a scatter) can store straight into their captured tensor:
/// every other read of that tensor (through views too) must come in an earlier step, the
/// kernel must read it directly (element i read and written by the same thread), not a view,
/// and the kernel must run over exactly the tensor's elements (a one-element value, such as an
/// optimiser's step count, can be computed in a larger kernel, which writes it once per
/// element: into its own buffer, never into the one-element tensor).
fn plan_in_place(g: &Graph, s: &Schedule) -> std::collections::HashMap<NodeId, usize> {
    let mut reads: Vec<Vec<usize>> = vec![vec![]; g.nodes.len()];
    let mut made_by: std::collections::HashMap<NodeId, (usize, usize)> = Default::default();
    for (k, step) in s.steps.iter().enumerate() {
        step_reads(g, s, step).into_iter().for_each(|a| reads[a].push(k));
        if let Step::Kernel(j) = step {
            s.kernels[*j].outputs.iter().for_each(|(_, node)| {
                made_by.insert(*node, (k, *j));
            });
        }
    }
    let step_of_view: std::collections::HashMap<usize, NodeId> =
        s.steps.iter().enumerate().filter_map(|(k, st)| if let Step::Node(i) = st { Some((k, *i)) } else { None }).collect();
    // Every read of `node` (following views) happens before step `at`, or is `at` reading it
    // directly when `direct`.
    // With `nhwc`, the kernel reads the tensor through its NHWC view, which it may read
    // directly (element i of that view is element i of the kernel's output).
    fn before(g: &Graph, reads: &[Vec<usize>], views: &std::collections::HashMap<usize, NodeId>, node: NodeId, at: usize, direct: bool, nhwc: bool) -> bool {
        reads[node].iter().all(|&k| {
            if k == at {
                return direct;
            }
            match views.get(&k).map(|&i| (i, &g.nodes[i].op)) {
                Some((i, NodeOp::Prim(crate::ops::Op::Permute(p)))) if nhwc && p.as_slice() == TO_NHWC => before(g, reads, views, i, at, true, false),
                Some((i, NodeOp::Prim(op))) if op.is_view() => before(g, reads, views, i, at, false, false),
                _ => k < at,
            }
        })
    }
    let captured: std::collections::HashMap<usize, NodeId> =
        g.nodes.iter().enumerate().filter_map(|(i, n)| if let NodeOp::Captured(k) = n.op { Some((k, i)) } else { None }).collect();
    let step_of_node: std::collections::HashMap<NodeId, usize> =
        step_of_view.iter().map(|(&k, &i)| (i, k)).collect();
    let mut out = std::collections::HashMap::new();
    for &(k, v) in &g.mutations {
        let Some(&c) = captured.get(&k) else { continue };
        // The NCHW view of an NHWC kernel output (a channels-last parameter's update): the
        // kernel can write into the tensor's NHWC view.
        let written = v;
        let (v, nhwc) = match &g.nodes[v].op {
            NodeOp::Prim(crate::ops::Op::Permute(p)) if p.as_slice() == FROM_NHWC && made_by.contains_key(&g.nodes[v].args[0]) => (g.nodes[v].args[0], true),
            _ => (v, false),
        };
        // A flat kernel over exactly the tensor's elements, a mid kernel's per-row value (a
        // running statistic: the thread that stores a row's value is the only one that reads
        // the row's inputs), or a scatter into the tensor itself.
        let at = match made_by.get(&v) {
            Some(&(at, j)) if matches!(s.kernels[j].space, crate::kir::Space::Flat { numel } if numel == g.nodes[v].numel()) => at,
            Some(&(at, j)) if matches!(s.kernels[j].space, crate::kir::Space::Mid { rows, .. } if rows == g.nodes[v].numel()) => at,
            Some(_) => continue,
            None => match (step_of_node.get(&v), &g.nodes[v].op) {
                (Some(&at), NodeOp::Prim(crate::ops::Op::Scatter(_))) if g.nodes[v].args[0] == c => at,
                _ => continue,
            },
        };
        let shape_of_c: Vec<usize> = if nhwc { TO_NHWC.iter().map(|&d| g.nodes[c].shape[d]).collect() } else { g.nodes[c].shape.clone() };
        let same = g.nodes[v].shape == shape_of_c && g.nodes[v].dtype == g.nodes[c].dtype;
        let once = g.mutations.iter().filter(|m| m.0 == k).count() == 1;
        let returned = g.outputs.contains(&c) || g.outputs.contains(&v) || g.outputs.contains(&written);
        // Over the NHWC view, the kernel must not read the tensor in NCHW order itself.
        if same && once && !returned && before(g, &reads, &step_of_view, c, at, !nhwc, nhwc) {
            out.insert(v, k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::compile::{compile_with, Backend, CompileOptions};
    use crate::{DType, Device, Tensor};
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_cache_attention_over_a_products_rows_runs_in_the_products_step() {
        // Under KILN_ATTEND_IN_PRODUCT=1, read once per process: in a child process.
        let me = "compile::runtime::tests::cache_attention_in_product_child";
        let out = std::process::Command::new(std::env::current_exe().unwrap()).args([me, "--exact", "--ignored", "--test-threads=1"]).env("KILN_ATTEND_IN_PRODUCT", "1").output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
    }

    #[test]
    #[ignore = "run as a child process by a_cache_attention_over_a_products_rows_runs_in_the_products_step"]
    fn cache_attention_in_product_child() {
        // A decode layer's query, key and value projection of one row, then the cache attention
        // over its rows: on a GPU one step runs both, at the attention's place; with a kernel
        // between (the query scaled), they stay apart.
        let (h, d, s) = (2, 8, 6);
        let t = |shape: &[usize]| Tensor::randn(shape, DType::F32, &Device::Cpu).unwrap();
        let (w, k, v) = (t(&[16, 3 * h * d]), t(&[s, 1, h, d]), t(&[s, 1, h, d]));
        let plan = |scaled: bool| {
            let (w, k, v) = (w.clone(), k.clone(), v.clone());
            let f = move |xs: &[Tensor]| {
                let qkv = xs[0].matmul(&w)?;
                // (`Op::AttentionUpTo`'s layout: [L, B, H, D])
                let rows = |i: usize| qkv.narrow(1, i * h * d, h * d)?.reshape(&[1, 1, h as i64, d as i64]);
                let q = if scaled { rows(0)?.mul_scalar(2.0)? } else { rows(0)? };
                let (kn, vn) = (rows(1)?, rows(2)?);
                Ok(vec![crate::ops::apply(crate::ops::Op::AttentionUpTo { scale: 0.5 }, &[&q, &k, &v, &xs[1], &kn, &vn])?])
            };
            let g = crate::compile::fuse::tests::host_graph_of(&[t(&[1, 16]), Tensor::zeros(&[1], DType::I64, &Device::Cpu).unwrap()], f).as_on_cuda();
            let p = super::Program::new(crate::compile::optimise(&g, &[]), false);
            // The product's output, which the attention's step writes, is not freed before it.
            if let Some(gm) = p.schedule.gemms.iter().find(|gm| gm.attention.is_some()) {
                let at = p.schedule.steps.iter().position(|st| matches!(st, super::Step::Node(i) if gm.attention == Some(*i))).expect("the attention's step");
                let freed = p.frees.iter().position(|f| f.contains(&gm.out()));
                assert!(freed.is_none_or(|f| f >= at), "the product's output is freed after step {freed:?}, before the attention's {at}");
            }
            (p.planned_graph(), p.kernel_count())
        };
        let (planned, kernels) = plan(false);
        let steps: Vec<&str> = planned.lines().skip(1).collect();
        assert!(steps.iter().any(|l| l.contains("attention_up_to")) && !steps.iter().any(|l| l.contains("gemm")), "{planned}");
        assert_eq!(kernels, 1, "{planned}");
        let (apart, kernels) = plan(true);
        assert!(apart.lines().any(|l| l.contains("gemm")) && kernels == 3, "{apart}");
    }

    #[test]
    fn a_planned_graph_runs_a_product_beside_the_chain_in_memory_the_chain_never_touched() {
        // A chain of two products, the ReLU between them freed after the second; then a product
        // of another input. Best fit would hand the last one the start of the freed piece (the
        // ReLU's memory, merged with the untouched rest of its block) and a wait for the chain;
        // the capture's rule hands it that piece's untouched end.
        let w = || Tensor::randn(&[8, 8], DType::F32, &Device::Cpu).unwrap();
        let (w1, w2, w3) = (w(), w(), w());
        let f = move |xs: &[Tensor]| Ok(vec![xs[0].matmul(&w1)?.relu()?.matmul(&w2)?, xs[1].matmul(&w3)?]);
        let g = crate::compile::fuse::tests::host_graph_of(&[w(), w()], f).as_on_cuda();
        let planned = super::Program::new(crate::compile::optimise(&g, &[]), false).planned_graph();
        let lines: Vec<&str> = planned.lines().collect();
        // The arguments, the first product, its ReLU, the second product; then the third.
        assert!(lines[0].starts_with("planned CUDA graph: 5 steps, 4 on the longest chain"), "{planned}");
        assert!(lines[1].ends_with("arguments copied in <- []") && lines[2].ends_with("<- [0]") && lines[3].ends_with("<- [1]") && lines[4].ends_with("<- [2]"), "{planned}");
        assert!(lines[5].ends_with("<- [0]"), "the last product waits for the arguments only: {planned}");
    }

    #[test]
    fn only_matrices_the_program_never_writes_are_settled() {
        let randn = |s: &[usize]| Tensor::randn(s, DType::F32, &Device::Cpu).unwrap();
        let settled = |written: bool| {
            let (w, v) = (randn(&[8, 8]), randn(&[8, 8]));
            let g = crate::compile::fuse::tests::graph_of(&[randn(&[1, 8]), randn(&[8, 8])], move |xs| {
                // A captured weight seen through a transpose, an argument, and a captured
                // tensor the program may write after reading it.
                let h = xs[0].matmul(&w.t()?)?.matmul(&xs[1])?.matmul(&v)?;
                if written {
                    v.add_scalar_(1.0)?;
                }
                Ok(vec![h])
            });
            let s = crate::compile::fuse::schedule(&g);
            super::settled_matrices(&g, &s)
        };
        assert_eq!(settled(false), [true, true, true]);
        // Writing one captured tensor unsettles it, and every argument (which may be it).
        assert_eq!(settled(true), [true, false, false]);
    }

    #[test]
    fn a_scatter_into_a_captured_tensor_nothing_reads_after_is_planned_in_place() {
        // A decode step's cache write: the scatter's value is read, the cache itself is not.
        let cache = Tensor::zeros(&[1, 2, 8, 4], DType::F32, &Device::Cpu).unwrap();
        let seen = Arc::new(Mutex::new(None));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            *s2.lock().unwrap() = Some(g.clone());
            Ok(g.eager_runner())
        });
        let c2 = cache.clone();
        compile_with(CompileOptions::new().backend(backend), move |pos: &Tensor, k: &Tensor| {
            crate::no_grad(|| {
                let at = pos.reshape(&[1, 1, 1, 1])?.broadcast_to(&[1, 2, 1, 4])?;
                c2.scatter_(2, &at, k)?;
                c2.sum_all()
            })
        })
        .call(&Tensor::full(&[1], 3.0, DType::I64, &Device::Cpu).unwrap(), &Tensor::ones(&[1, 2, 1, 4], DType::F32, &Device::Cpu).unwrap())
        .unwrap();
        let g = crate::compile::simplify::simplify(&seen.lock().unwrap().take().unwrap());
        let s = crate::compile::fuse::schedule(&g);
        let scatters: Vec<usize> = (0..g.nodes.len()).filter(|&i| matches!(g.nodes[i].op, crate::compile::graph::NodeOp::Prim(crate::ops::Op::Scatter(_)))).collect();
        assert_eq!(scatters.len(), 1);
        let plan = super::plan_in_place(&g, &s);
        assert!(plan.contains_key(&scatters[0]), "{plan:?}");
    }

    #[test]
    fn a_cache_attention_is_settled_only_before_writes_to_its_inputs() {
        // A decode step's attention over a captured cache at an argument position, the cache
        // written after it (settled) or before it (the attention then reads the write).
        let settled = |write_first: bool| {
            let zeros = |s: &[usize]| Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap();
            let (kc, vc) = (zeros(&[8, 1, 2, 4]), zeros(&[8, 1, 2, 4]));
            let seen = Arc::new(Mutex::new(None));
            let s2 = seen.clone();
            let backend = Backend::custom(move |g, _| {
                *s2.lock().unwrap() = Some(g.clone());
                Ok(g.eager_runner())
            });
            compile_with(CompileOptions::new().backend(backend), move |pos: &Tensor, q: &Tensor| {
                crate::no_grad(|| {
                    let (kn, vn) = (q.mul_scalar(2.0)?, q.add_scalar(1.0)?);
                    let at = pos.reshape(&[1, 1, 1, 1])?.broadcast_to(&[1, 1, 2, 4])?;
                    if write_first {
                        kc.scatter_(0, &at, &kn)?;
                    }
                    let out = crate::ops::apply(crate::ops::Op::AttentionUpTo { scale: 0.5 }, &[q, &kc, &vc, pos, &kn, &vn])?;
                    if !write_first {
                        kc.scatter_(0, &at, &kn)?;
                    }
                    vc.scatter_(0, &at, &vn)?;
                    Ok(out)
                })
            })
            .call(&Tensor::full(&[1], 3.0, DType::I64, &Device::Cpu).unwrap(), &Tensor::ones(&[1, 1, 2, 4], DType::F32, &Device::Cpu).unwrap())
            .unwrap();
            let g = crate::compile::simplify::simplify(&seen.lock().unwrap().take().unwrap());
            let s = crate::compile::fuse::schedule(&g);
            let attn: Vec<usize> = (0..g.nodes.len()).filter(|&i| matches!(g.nodes[i].op, crate::compile::graph::NodeOp::Prim(crate::ops::Op::AttentionUpTo { .. }))).collect();
            assert_eq!(attn.len(), 1);
            super::settled_caches(&g, &s, &super::plan_in_place(&g, &s)).contains(&attn[0])
        };
        assert!(settled(false));
        assert!(!settled(true));
    }

    #[test]
    fn running_statistics_updated_by_mid_kernels_are_planned_in_place() {
        // Training-mode batch norm on the GPU: the mean and variance kernels (mid kernels, also
        // the column form of channels-last inputs) update the running statistics in their
        // epilogues, straight into the captured tensors (no copy after the kernel).
        for channels_last in [false, true] {
            let (rm, rv) = (Tensor::zeros(&[4], DType::F32, &Device::Cpu).unwrap(), Tensor::ones(&[4], DType::F32, &Device::Cpu).unwrap());
            let x = Tensor::randn(&[8, 4, 6, 6], DType::F32, &Device::Cpu).unwrap();
            let x = if channels_last { x.to_memory_format(crate::MemoryFormat::ChannelsLast).unwrap() } else { x };
            let bn = move |xs: &[Tensor]| Ok(vec![crate::nn::functional::batch_norm(&xs[0], Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)?]);
            let g = crate::compile::fuse::tests::graph_of(std::slice::from_ref(&x), bn);
            let g = if channels_last { crate::compile::layout::channels_last(&g, &[x]) } else { g };
            let g = crate::compile::recompute::recompute_cheap(&crate::compile::simplify::simplify(&g));
            let s = crate::compile::fuse::schedule(&g);
            let in_place = super::plan_in_place(&g, &s);
            assert_eq!(g.mutations.len(), 2);
            for (_, v) in &g.mutations {
                let k = s.kernels.iter().find(|k| k.outputs.iter().any(|(_, n)| n == v)).expect("computed in a kernel");
                assert!(matches!(k.space, crate::kir::Space::Mid { rows: 4, .. }), "the case this checks: {}", k.describe());
                assert!(in_place.contains_key(v), "channels-last {channels_last}: %{v} is copied back: {in_place:?}");
            }
        }
    }

    #[test]
    fn a_one_element_value_computed_in_a_larger_kernel_is_not_written_in_place() {
        // An optimiser-like step: a scalar count and a vector updated from it, which fuse into
        // one kernel over the vector's elements.
        let p = Tensor::randn(&[640], DType::F32, &Device::Cpu).unwrap();
        let count = Tensor::zeros(&[], DType::F32, &Device::Cpu).unwrap();
        let seen = Arc::new(Mutex::new(None));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            *s2.lock().unwrap() = Some(g.clone());
            Ok(g.eager_runner())
        });
        let (p2, c2) = (p.clone(), count.clone());
        compile_with(CompileOptions::new().backend(backend), move |x: &Tensor| {
            crate::no_grad(|| {
                c2.add_scalar_(1.0)?;
                p2.sub_(&x.mul(&c2)?)?;
                x.exp()
            })
        })
        .call(&Tensor::randn(&[640], DType::F32, &Device::Cpu).unwrap())
        .unwrap();
        let g = crate::compile::simplify::simplify(&seen.lock().unwrap().take().unwrap()).as_on_cuda();
        let s = crate::compile::fuse::schedule(&g);
        let counted = g.mutations.iter().find(|(_, v)| g.nodes[*v].numel() == 1).expect("the count is written back").1;
        let kernel = s.kernels.iter().find(|k| k.outputs.iter().any(|(_, n)| *n == counted)).expect("computed in a kernel");
        assert!(matches!(kernel.space, crate::kir::Space::Flat { numel: 640 }), "the case this checks: {}", kernel.describe());
        let in_place = super::plan_in_place(&g, &s);
        assert!(!in_place.contains_key(&counted), "{in_place:?}");
        assert_eq!(in_place.len(), 1, "the vector is still written in place: {in_place:?}");
        // The count is stored once (one element), the vector at every element.
        let single: Vec<bool> = kernel.outputs.iter().map(|(_, n)| *n == counted).collect();
        assert_eq!(kernel.single, single);
        // On the CPU too: the count comes out as one element, equal to its eager value.
        let mut cpu = kernel.clone();
        cpu.device = Device::Cpu;
        let ins: Vec<Tensor> = cpu.inputs.iter().map(|i| if g.nodes[i.node].numel() == 1 { Tensor::full(&[], 2.0, DType::F32, &Device::Cpu).unwrap() } else { Tensor::randn(&g.nodes[i.node].shape, DType::F32, &Device::Cpu).unwrap() }).collect();
        let outs = crate::backend::cpu::fused::run(&cpu, &cpu.shape, &ins, &[]).unwrap();
        let m = single.iter().position(|&s| s).unwrap();
        assert_eq!(outs[m].numel(), 1);
        assert_eq!(outs[m].to_vec::<f32>().unwrap(), vec![3.0]);
    }

    #[test]
    fn a_kernel_writes_into_a_dying_value_and_never_into_one_still_held() {
        use crate::compile::compile;
        use super::WRITES_INTO_DYING;
        let writes = || WRITES_INTO_DYING.with(|c| c.get());
        let d = Device::Cpu;
        let (x, w) = (Tensor::randn(&[128, 128], DType::F32, &d).unwrap(), Tensor::randn(&[128, 128], DType::F32, &d).unwrap());
        let x_before = x.to_vec::<f32>().unwrap();
        // sin(a), computed beside `a` (whose other reader, the product, comes between), dies in
        // the kernel of `b`: `b` may take its buffer.
        let body = |x: &Tensor, w: &Tensor| -> crate::Result<(Tensor, Tensor, Tensor)> {
            let a = x.exp()?.mul_scalar(0.5)?;
            let m = a.matmul(w)?;
            let b = a.sin()?.add(&m)?.relu()?;
            Ok((a, m, b))
        };
        let eager = body(&x, &w).unwrap();
        let close = |got: &Tensor, want: &Tensor| {
            let (g, e) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
            assert!(g.iter().zip(&e).all(|(a, b)| (a - b).abs() <= 1e-4 * (1.0 + b.abs())));
        };
        let f = compile(move |xs: &[Tensor]| {
            let (_, m, b) = body(&xs[0], &xs[1])?;
            Ok(vec![m, b])
        });
        let before = writes();
        let out = f.call(&[x.clone(), w.clone()]).unwrap();
        assert!(writes() > before, "the kernel of b wrote into sin(a)'s buffer");
        close(&out[0], &eager.1);
        close(&out[1], &eager.2);
        // `a` also returned (as a view): it is held, so nothing may write into it (sin(a) still
        // dies), and every output keeps its values; the call's own arguments are never written.
        let g = compile(move |xs: &[Tensor]| {
            let (a, m, b) = body(&xs[0], &xs[1])?;
            Ok(vec![a.reshape(&[-1])?, m, b])
        });
        let out = g.call(&[x.clone(), w.clone()]).unwrap();
        close(&out[0].reshape(&[128, 128]).unwrap(), &eager.0);
        close(&out[1], &eager.1);
        close(&out[2], &eager.2);
        let h = compile(|xs: &[Tensor]| Ok(vec![xs[0].sin()?.exp()?]));
        h.call(std::slice::from_ref(&x)).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), x_before, "an argument is never written");
    }

    /// The GPU schedule of an MLP's ReLU backward beside its bias gradient (one mid kernel):
    /// the masked gradient, stored for the weight's product, and its column sums; with `bias`,
    /// an SGD step on that captured bias, written in place by the same kernel.
    fn relu_backward(bias: Option<Tensor>) -> (crate::compile::graph::Graph, super::Schedule) {
        let randn = |s: &[usize]| Tensor::randn(s, DType::F32, &Device::Cpu).unwrap();
        let g = crate::compile::fuse::tests::graph_of(&[randn(&[256, 64]), randn(&[64, 32]), randn(&[256, 10]), randn(&[10, 32])], move |xs| {
            let h = xs[0].matmul(&xs[1])?;
            let h = match &bias { Some(b) => h.add(b)?, None => h }.relu()?;
            let dh = xs[2].matmul(&xs[3])?;
            let masked = h.le_scalar(0.0)?.where_(&Tensor::scalar(0.0, DType::F32, &xs[0].device())?, &dh)?;
            let weight = masked.t()?.matmul(&xs[0])?;
            Ok(match &bias {
                Some(b) => {
                    b.sub_(&masked.sum(&[0], false)?.mul_scalar(0.1)?)?;
                    vec![weight]
                }
                None => vec![masked.sum(&[0], false)?, weight],
            })
        });
        let g = crate::compile::simplify::simplify(&g);
        let s = crate::compile::fuse::schedule(&g);
        (g, s)
    }

    /// In the mid kernel of `relu_backward`, the masked gradient (its full output not written
    /// in place) may take the buffer of the incoming gradient, which dies there, and the
    /// planned peak is lower for it.
    fn the_masked_gradient_takes_a_dying_buffer(g: &crate::compile::graph::Graph, s: &super::Schedule) {
        let (frees, in_place) = (super::plan(g, s), super::plan_in_place(g, s));
        let reuse = super::plan_reuse(g, s, &frees);
        let (k, kern) = s.kernels.iter().enumerate().find(|(_, k)| matches!(k.space, crate::kir::Space::Mid { .. })).expect("a mid kernel");
        let full = kern.outputs.iter().position(|(o, n)| !kern.ops[*o].row && !in_place.contains_key(n)).expect("the masked gradient");
        assert!(!reuse[k][full].is_empty(), "{}", kern.describe());
        let planned = |reuse: &[Vec<Vec<usize>>]| super::planned_peak(g, s, &frees, &in_place, reuse).peak;
        let none: Vec<Vec<Vec<usize>>> = reuse.iter().map(|r| vec![vec![]; r.len()]).collect();
        assert!(planned(&reuse) < planned(&none));
    }

    /// As torch's threshold backward does.
    #[test]
    fn a_mid_kernels_full_output_may_take_a_dying_inputs_buffer() {
        let (g, s) = relu_backward(None);
        the_masked_gradient_takes_a_dying_buffer(&g, &s);
    }

    /// The mid kernel also updates the bias in place: the masked gradient still takes the
    /// incoming gradient's buffer.
    #[test]
    fn an_output_takes_a_dying_buffer_beside_one_written_in_place() {
        let (g, s) = relu_backward(Some(Tensor::randn(&[32], DType::F32, &Device::Cpu).unwrap()));
        let in_place = super::plan_in_place(&g, &s);
        let kern = s.kernels.iter().find(|k| k.outputs.iter().any(|(_, o)| in_place.contains_key(o))).expect("a kernel writing the bias in place");
        assert!(matches!(kern.space, crate::kir::Space::Mid { .. }), "the case this checks: {}", kern.describe());
        the_masked_gradient_takes_a_dying_buffer(&g, &s);
    }

    /// The planned peak counts each computed value from the step that makes it until it and
    /// its views are dead: exp(x) (1 KiB) lives while the product reads it, the product's
    /// 1 KiB beside it, and the view of the product costs nothing.
    #[test]
    fn the_planned_peak_follows_liveness_and_views() {
        let seen = Arc::new(Mutex::new(None));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            *s2.lock().unwrap() = Some(g.clone());
            Ok(g.eager_runner())
        });
        compile_with(CompileOptions::new().backend(backend), |x: &Tensor| {
            let e = x.exp()?;
            e.matmul(&e)?.t()?.sum(&[0], false)
        })
        .call(&Tensor::randn(&[16, 16], DType::F32, &Device::Cpu).unwrap())
        .unwrap();
        let g = crate::compile::simplify::simplify(&seen.lock().unwrap().take().unwrap());
        let s = crate::compile::fuse::schedule(&g);
        let frees = super::plan(&g, &s);
        let p = super::planned_peak(&g, &s, &frees, &super::plan_in_place(&g, &s), &super::plan_reuse(&g, &s, &frees));
        assert_eq!((p.peak, p.inputs), (2 * 16 * 16 * 4, 16 * 16 * 4), "{p}");
    }
}
