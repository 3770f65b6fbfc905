//! The graph IR: a list of nodes in topological order, each a primitive op (or an input, a
//! constant fill, a random draw) with the shape, dtype and device of its value. It prints as
//! text, exports to Graphviz, and runs op by op (`eager_runner`).

use crate::ops::Op;
use crate::{DType, Device, Result, Tensor};
use std::fmt;
use std::sync::Arc;

pub type NodeId = usize;

/// What a node computes.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeOp {
    /// Argument `k` of the compiled function.
    Arg(usize),
    /// Tensor `k` the function captured (a parameter, a constant made outside).
    Captured(usize),
    Prim(Op),
    /// Every element `value` (`Tensor::full` inside the function).
    Full(f64),
    /// `start + i * step` at index i of its one dim (`Tensor::arange` inside the function):
    /// a constant, which a kernel that knows each element's index may compute instead of
    /// reading (`KILN_ROW_COLUMNS=1`).
    Arange { start: f64, step: f64 },
    /// A fresh draw from the global generator on every call.
    Random(RandomKind),
    /// A user op (`kiln::CustomOp`): opaque to fusion, run by its own kernel or CPU function.
    Custom(crate::custom::CustomOp),
    /// A collective over a process group (DDP's bucket all-reduces): opaque, never merged,
    /// hoisted or deduplicated, run where it was traced.
    Collective(crate::distributed::Collective),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RandomKind {
    Uniform,
    Normal,
    Int { low: i64, high: i64 },
}

#[derive(Clone, Debug)]
pub struct Node {
    pub op: NodeOp,
    pub args: Vec<NodeId>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub device: Device,
}

impl Node {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// The bytes its value takes, stored densely.
    pub(crate) fn bytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }
    /// The name kernels and printouts use for the op.
    pub fn name(&self) -> String {
        match &self.op {
            NodeOp::Arg(k) => format!("arg{k}"),
            NodeOp::Captured(k) => format!("captured{k}"),
            NodeOp::Prim(op) => op.name().to_string(),
            NodeOp::Full(_) => "full".into(),
            NodeOp::Arange { .. } => "arange".into(),
            NodeOp::Random(RandomKind::Uniform) => "rand".into(),
            NodeOp::Random(RandomKind::Normal) => "randn".into(),
            NodeOp::Random(RandomKind::Int { .. }) => "randint".into(),
            NodeOp::Custom(c) => c.name().into(),
            NodeOp::Collective(c) => c.name().into(),
        }
    }
    /// Static arguments, as printed after the name.
    fn params(&self) -> String {
        match &self.op {
            NodeOp::Prim(op) => match op {
                Op::Binary(_, c) => format!("[{}]", dtype_name(*c)),
                Op::Where(d) | Op::Cast(d) => format!("[{}]", dtype_name(*d)),
                Op::Reduce(_, dims, keep) => format!("[dims={dims:?}{}]", if *keep { ", keepdim" } else { "" }),
                Op::Reshape(s) | Op::Expand(s) | Op::Permute(s) => format!("{s:?}"),
                Op::Slice { dim, start, len, step } => format!("[dim={dim}, start={start}, len={len}, step={step}]"),
                Op::Cat(d) | Op::IndexSelect(d) | Op::Gather(d) | Op::ScatterAdd(d) | Op::Scatter(d) => format!("[dim={d}]"),
                Op::Pad(p, v) => format!("[{p:?}, value={v}]"),
                Op::ToDevice { to, .. } => format!("[{to}]"),
                Op::Relayout(f) => format!("[{f:?}]"),
                Op::Attention { scale, causal, batch_first } | Op::AttentionBackward { scale, causal, batch_first } => format!("[scale={scale}{}{}]", if *causal { ", causal" } else { "" }, if *batch_first { ", batch_first" } else { "" }),
                Op::AttentionUpTo { scale } => format!("[scale={scale}]"),
                Op::Unary(_) | Op::Matmul => String::new(),
                Op::Conv2d(a) => conv_params(a, ""),
                Op::Conv2dGradInput(a, hw) => conv_params(a, &format!(", input={hw:?}")),
                Op::Conv2dGradWeight(a, k) => conv_params(a, &format!(", kernel={k:?}")),
                Op::Conv2dBiasAct(a, relu) => conv_params(a, if *relu { ", relu" } else { "" }),
                Op::MaxPool2d(a) | Op::MaxPool2dBackward(a) => {
                    let mut s = format!("[kernel={:?}, stride={:?}, padding={:?}, dilation={:?}", a.kernel, a.stride, a.padding, a.dilation);
                    s += if a.ceil_mode { ", ceil_mode]" } else { "]" };
                    s
                }
            },
            NodeOp::Full(v) => format!("[{v}]"),
            NodeOp::Arange { start, step } => format!("[start={start}, step={step}]"),
            NodeOp::Random(RandomKind::Int { low, high }) => format!("[{low}, {high})"),
            NodeOp::Custom(_) => "[custom]".into(),
            NodeOp::Collective(c) => c.params(),
            _ => String::new(),
        }
    }
    /// A node that reads nothing and is the same on every call (`Full`, `Arange`).
    pub fn is_constant(&self) -> bool {
        matches!(self.op, NodeOp::Full(_) | NodeOp::Arange { .. })
    }
    /// A node computed from no other node: an input of the graph (an argument or a captured
    /// tensor) or a constant.
    pub fn reads_nothing(&self) -> bool {
        matches!(self.op, NodeOp::Arg(_) | NodeOp::Captured(_)) || self.is_constant()
    }
    /// A constant node's value, made by the eager ops.
    pub(crate) fn make_constant(&self) -> crate::Result<crate::Tensor> {
        match self.op {
            NodeOp::Full(v) => crate::Tensor::full(&self.shape, v, self.dtype, &self.device),
            NodeOp::Arange { start, step } => crate::Tensor::arange_n(start, step, self.numel(), self.dtype, &self.device),
            _ => Err(crate::Error::Compile(format!("{} is no constant", self.name()))),
        }
    }
    pub fn is_pointwise(&self) -> bool {
        matches!(&self.op, NodeOp::Prim(Op::Unary(_) | Op::Binary(..) | Op::Where(_) | Op::Cast(_)) | NodeOp::Full(_))
    }
}

pub(crate) fn dtype_name(d: DType) -> &'static str {
    d.torch_name()
}

/// A traced function: nodes in topological order, its outputs, and the in-place writes it made
/// to captured tensors (captured index, node holding the new value).
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub outputs: Vec<NodeId>,
    pub mutations: Vec<(usize, NodeId)>,
    pub n_args: usize,
    pub n_captured: usize,
}

impl Graph {
    pub(crate) fn push(&mut self, op: NodeOp, args: Vec<NodeId>, shape: Vec<usize>, dtype: DType, device: Device) -> NodeId {
        match op {
            NodeOp::Arg(_) => self.n_args += 1,
            NodeOp::Captured(_) => self.n_captured += 1,
            _ => {}
        }
        self.nodes.push(Node { op, args, shape, dtype, device });
        self.nodes.len() - 1
    }

    /// How many nodes read each node (outputs and write-backs count as readers).
    pub fn users(&self) -> Vec<usize> {
        let mut u = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for &a in &n.args {
                u[a] += 1;
            }
        }
        for &o in self.outputs.iter().chain(self.mutations.iter().map(|(_, n)| n)) {
            u[o] += 1;
        }
        u
    }

    /// Whether each node is an output or a written-back value (the program keeps it).
    pub(crate) fn kept(&self) -> Vec<bool> {
        let mut kept = vec![false; self.nodes.len()];
        for &o in self.outputs.iter().chain(self.mutations.iter().map(|(_, n)| n)) {
            kept[o] = true;
        }
        kept
    }

    /// Who reads each node: one entry per argument slot that names it (outputs and write-backs
    /// are not readers here; `users` counts them).
    pub(crate) fn readers(&self) -> Vec<Vec<NodeId>> {
        let mut r = vec![vec![]; self.nodes.len()];
        for (j, n) in self.nodes.iter().enumerate() {
            for &a in &n.args {
                r[a].push(j);
            }
        }
        r
    }

    /// This graph (traced on the CPU) with its host nodes moved to the GPU: what the GPU would
    /// schedule and plan for it (scheduling only reads the graph, so no GPU is needed).
    pub(crate) fn as_on_cuda(&self) -> Graph {
        let mut g = self.clone();
        for n in &mut g.nodes {
            if n.device == Device::Cpu {
                n.device = Device::Cuda(0);
            }
        }
        g
    }

    /// Per node, whether the caller sees its storage: it is returned, written back into a
    /// captured tensor, or viewed by a node that is.
    pub(crate) fn seen_by_caller(&self) -> Vec<bool> {
        let mut seen = vec![false; self.nodes.len()];
        self.outputs.iter().chain(self.mutations.iter().map(|(_, v)| v)).for_each(|&o| seen[o] = true);
        for i in (0..self.nodes.len()).rev() {
            if seen[i] && matches!(&self.nodes[i].op, NodeOp::Prim(op) if op.is_view()) {
                seen[self.nodes[i].args[0]] = true;
            }
        }
        seen
    }

    /// The value whose storage the view `i` (or value `i`) reads: `i` through its views.
    pub(crate) fn view_root(&self, mut i: NodeId) -> NodeId {
        while matches!(&self.nodes[i].op, NodeOp::Prim(op) if op.is_view()) {
            i = self.nodes[i].args[0];
        }
        i
    }

    /// Nodes that are graph inputs, in calling order: arguments, then captured tensors.
    pub fn input_nodes(&self) -> Vec<NodeId> {
        let mut args = vec![None; self.n_args];
        let mut caps = vec![None; self.n_captured];
        for (i, n) in self.nodes.iter().enumerate() {
            match n.op {
                NodeOp::Arg(k) => args[k] = Some(i),
                NodeOp::Captured(k) => caps[k] = Some(i),
                _ => {}
            }
        }
        args.into_iter().chain(caps).map(|x| x.expect("every input has a node")).collect()
    }

    /// Graphviz source: one box per node, edges from producers to consumers.
    pub fn to_dot(&self) -> String {
        let mut s = String::from("digraph kiln {\n  node [shape=box, fontname=monospace];\n");
        for (i, n) in self.nodes.iter().enumerate() {
            let style = match n.op {
                NodeOp::Arg(_) | NodeOp::Captured(_) => ", style=filled, fillcolor=lightblue",
                _ if self.outputs.contains(&i) => ", style=filled, fillcolor=lightgreen",
                _ => "",
            };
            s += &format!("  n{i} [label=\"%{i} = {}{}\\n{}{:?}\"{style}];\n", n.name(), n.params().replace('"', "'"), dtype_name(n.dtype), n.shape);
            for &a in &n.args {
                s += &format!("  n{a} -> n{i};\n");
            }
        }
        s + "}\n"
    }

    /// Runs the graph op by op through the eager ops (with autograd), as `Backend::Eager` does.
    pub fn eager_runner(&self) -> Runner {
        let g = self.clone();
        Runner::new(move |inputs: &[Tensor]| crate::compile::runtime::run_eager(&g, inputs))
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inputs = self.input_nodes();
        let sig: Vec<String> = inputs.iter().map(|&i| format!("%{i}: {}{:?}", dtype_name(self.nodes[i].dtype), self.nodes[i].shape)).collect();
        writeln!(f, "graph({}) {{", sig.join(", "))?;
        for (i, n) in self.nodes.iter().enumerate() {
            if inputs.contains(&i) {
                continue;
            }
            let args: Vec<String> = n.args.iter().map(|a| format!("%{a}")).collect();
            writeln!(f, "  %{i}: {}{:?} = {}{}({})", dtype_name(n.dtype), n.shape, n.name(), n.params(), args.join(", "))?;
        }
        for (k, n) in &self.mutations {
            writeln!(f, "  captured{k} <- %{n}")?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|o| format!("%{o}")).collect();
        writeln!(f, "  return ({})\n}}", outs.join(", "))
    }
}

/// Runs a compiled graph on real inputs (arguments, then captured tensors) and returns its
/// outputs. A custom backend returns one of these.
#[derive(Clone)]
pub struct Runner(pub(crate) Arc<RunFn>);

/// What a `Runner` calls.
type RunFn = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

impl Runner {
    pub fn new(f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static) -> Runner {
        Runner(Arc::new(f))
    }
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        (self.0)(inputs)
    }
}

fn conv_params(a: &crate::ops::Conv2dArgs, extra: &str) -> String {
    format!("[stride={:?}, padding={:?}, dilation={:?}, groups={}{extra}]", a.stride, a.padding, a.dilation, a.groups)
}
