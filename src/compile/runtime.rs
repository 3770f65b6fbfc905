//! Running graphs: the eager runner (op by op, with autograd), and programs — a schedule of
//! fused kernels and eager steps whose values are dropped after their last use, so the caching
//! allocator hands their memory to the next step (the memory plan).

use super::fuse::{self, Schedule, Step};
use crate::logging::Category;
use super::graph::{Graph, Node, NodeId, NodeOp, RandomKind};
use crate::layout::Layout;
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

/// Writes the new values of captured tensors written in place into them.
/// Writes the new values of captured tensors written in place into them (those a kernel
/// already wrote in place only get their version bumped).
fn write_back(g: &Graph, inputs: &[Tensor], env: &[Option<Tensor>]) -> Result<()> {
    for (k, v) in &g.mutations {
        let target = &inputs[g.n_args + k];
        let value = env[*v].as_ref().expect("computed");
        if value.shares_storage_with(target) && value.layout() == target.layout() {
            target.storage().bump_version();
            continue;
        }
        crate::no_grad(|| target.copy_(value))?;
    }
    Ok(())
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
            NodeOp::Full(v) => Tensor::full(&n.shape, *v, n.dtype, &n.device)?,
            NodeOp::Random(kind) => random(*kind, n)?,
        };
        env[i] = Some(t);
    }
    write_back(g, inputs, &env)?;
    Ok(g.outputs.iter().map(|&o| env[o].clone().expect("computed")).collect())
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
}

impl Program {
    /// The program of `graph`. With `tune` (max-autotune) it times its library algorithms and
    /// row-kernel launch shapes on the device the first time each runs (a no-op on the CPU).
    pub(crate) fn new(graph: Graph, tune: bool) -> Program {
        let schedule = fuse::schedule(&graph);
        crate::logging::log(Category::Fusion, || {
            let mut s = format!("{} kernels, {} library products, {} steps", schedule.kernels.len(), schedule.gemms.len(), schedule.steps.len());
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
        let in_place = plan_in_place(&graph, &schedule);
        Program { graph, schedule, tune, frees, in_place }
    }

    /// How many kernels one run launches on a GPU (fused kernels plus eager steps that compute).
    pub(crate) fn kernel_count(&self) -> usize {
        self.schedule.steps.iter().filter(|s| match s {
            Step::Kernel(_) | Step::Gemm(_) => true,
            Step::Node(i) => matches!(&self.graph.nodes[*i].op, NodeOp::Prim(op) if !matches!(op, crate::ops::Op::Permute(_) | crate::ops::Op::Expand(_) | crate::ops::Op::Slice { .. } | crate::ops::Op::Reshape(_)))
                || matches!(self.graph.nodes[*i].op, NodeOp::Full(_) | NodeOp::Random(_) | NodeOp::Custom(_)),
        }).count()
    }

    pub(crate) fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let _off = super::trace::Suspend::new();
        crate::no_grad(|| self.run_steps(inputs))
    }

    fn run_steps(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let g = &self.graph;
        let mut env: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
        for (s, step) in self.schedule.steps.iter().enumerate() {
            match step {
                Step::Node(i) => env[*i] = Some(run_node(g, *i, inputs, &env)?),
                Step::Gemm(j) => {
                    let gm = &self.schedule.gemms[*j];
                    match run_gemm(g, gm, &env, self.tune)? {
                        Some(t) => env[gm.out()] = Some(t),
                        // The epilogue cannot run here (the library has no algorithm for it, or
                        // the bias is not a packed vector): its nodes run one by one.
                        None => {
                            for &i in &gm.nodes {
                                env[i] = Some(run_node(g, i, inputs, &env)?);
                            }
                            for &i in &gm.nodes[..gm.nodes.len() - 1] {
                                env[i] = None;
                            }
                        }
                    }
                }
                Step::Kernel(k) => {
                    let kern = &self.schedule.kernels[*k];
                    let ins: Vec<Tensor> = kern.inputs.iter().map(|i| env[i.node].clone().expect("computed before use")).collect();
                    let outs = if kern.device.is_cuda() {
                        let into: Vec<Option<Tensor>> = kern
                            .outputs
                            .iter()
                            .map(|(_, node)| {
                                let t = &inputs[g.n_args + *self.in_place.get(node)?];
                                (t.is_contiguous() && t.shape() == g.nodes[*node].shape.as_slice()).then(|| t.clone())
                            })
                            .collect();
                        crate::backend::cuda::fused::run(kern, &kern.shape, &ins, &into, self.tune)?
                    } else {
                        let _rec = crate::profiler::record::cpu_kernel(&kern.name);
                        crate::backend::cpu::fused::run(kern, &kern.shape, &ins)?
                    };
                    for ((_, node), t) in kern.outputs.iter().zip(outs) {
                        let shape = &g.nodes[*node].shape;
                        env[*node] = Some(if t.shape() == shape.as_slice() { t } else { t.view_as_layout(Layout::contiguous(shape)) });
                    }
                }
            }
            for f in &self.frees[s] {
                env[*f] = None;
            }
        }
        write_back(g, inputs, &env)?;
        Ok(g.outputs.iter().map(|&o| env[o].clone().expect("computed")).collect())
    }
}

/// One node run by the eager backend (or an input, which needs nothing).
fn run_node(g: &Graph, i: NodeId, inputs: &[Tensor], env: &[Option<Tensor>]) -> Result<Tensor> {
    let n = &g.nodes[i];
    let arg = |a: &NodeId| env[*a].as_ref().expect("computed before use");
    Ok(match &n.op {
        NodeOp::Arg(_) | NodeOp::Captured(_) => input_of(g, n, inputs).expect("an input"),
        NodeOp::Prim(op) => op.forward(&n.args.iter().map(arg).collect::<Vec<_>>())?,
        NodeOp::Custom(c) => c.call(&n.args.iter().map(arg).collect::<Vec<_>>())?,
        NodeOp::Full(v) => Tensor::full(&n.shape, *v, n.dtype, &n.device)?,
        NodeOp::Random(kind) => random(*kind, n)?,
    })
}

/// A library product with its epilogue: the value of `gm.out()`, or None when the epilogue
/// cannot run (the caller then runs the step's nodes one by one).
fn run_gemm(g: &Graph, gm: &fuse::Gemm, env: &[Option<Tensor>], tune: bool) -> Result<Option<Tensor>> {
    let mm = &g.nodes[gm.matmul];
    let arg = |a: NodeId| env[a].as_ref().expect("computed before use");
    let bias = gm.bias.map(|b| (arg(b), gm.relu));
    let Some(t) = crate::backend::cuda::kernels::gemm(arg(mm.args[0]), arg(mm.args[1]), mm.dtype, bias, tune)? else { return Ok(None) };
    let out = &g.nodes[gm.out()].shape;
    Ok(Some(if t.shape() == out.as_slice() { t } else { t.view_as_layout(Layout::contiguous(out)) }))
}

/// The values step `step` reads.
fn step_reads(g: &Graph, s: &Schedule, step: &Step) -> Vec<NodeId> {
    match step {
        Step::Node(i) => g.nodes[*i].args.clone(),
        Step::Kernel(j) => s.kernels[*j].inputs.iter().map(|i| i.node).collect(),
        Step::Gemm(j) => {
            let gm = &s.gemms[*j];
            gm.nodes.iter().flat_map(|&m| g.nodes[m].args.iter().copied()).filter(|a| !gm.nodes.contains(a)).collect()
        }
    }
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

/// Which written-back values a flat fused kernel can store straight into their captured tensor:
/// every other read of that tensor (through views too) must come in an earlier step, and the
/// kernel must read it directly (element i read and written by the same thread), not a view.
fn plan_in_place(g: &Graph, s: &Schedule) -> std::collections::HashMap<NodeId, usize> {
    use crate::ops::Op;
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
    fn before(g: &Graph, reads: &[Vec<usize>], views: &std::collections::HashMap<usize, NodeId>, node: NodeId, at: usize, direct: bool) -> bool {
        reads[node].iter().all(|&k| {
            if k == at {
                return direct;
            }
            match views.get(&k).map(|&i| (i, &g.nodes[i].op)) {
                Some((i, NodeOp::Prim(Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. }))) => before(g, reads, views, i, at, false),
                _ => k < at,
            }
        })
    }
    let captured: std::collections::HashMap<usize, NodeId> =
        g.nodes.iter().enumerate().filter_map(|(i, n)| if let NodeOp::Captured(k) = n.op { Some((k, i)) } else { None }).collect();
    let mut out = std::collections::HashMap::new();
    for &(k, v) in &g.mutations {
        let (Some(&(at, j)), Some(&c)) = (made_by.get(&v), captured.get(&k)) else { continue };
        let flat = matches!(s.kernels[j].space, super::fuse::Space::Flat { .. });
        let same = g.nodes[v].shape == g.nodes[c].shape && g.nodes[v].dtype == g.nodes[c].dtype;
        let once = g.mutations.iter().filter(|m| m.0 == k).count() == 1;
        let returned = g.outputs.contains(&c) || g.outputs.contains(&v);
        if flat && same && once && !returned && before(g, &reads, &step_of_view, c, at, true) {
            out.insert(v, k);
        }
    }
    out
}
