//! Layout: the memory format each 4-D value of a conv net is computed in. Convolutions run
//! channels-last (cuDNN's tensor-core kernels read NHWC; the CPU's im2col product is NHWC), so
//! the values around them are computed in NHWC order too, as Inductor's layout optimisation
//! does: a pointwise op whose full operands are all channels-last, or a reduction of a
//! channels-last value, is rewritten over the NHWC views of its operands (an `[N, H, W, C]` node, contiguous when it runs), and
//! an op that wants NCHW reads a permuted view of it. The one copy is where a contiguous value
//! first meets a convolution.

use super::graph::{Graph, Node, NodeId, NodeOp};
use crate::layout::{FROM_NHWC, TO_NHWC};
use crate::ops::Op;
use crate::{Device, MemoryFormat, Tensor};
#[cfg(test)]
use crate::DType;

/// How the rewritten graph holds an original 4-D value.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// As the original node: NCHW, laid out as its op makes it (contiguous for a kernel's).
    Plain(NodeId),
    /// An NCHW node that runs channels-last (a convolution's result, a channels-last input).
    ChannelsLast(NodeId),
    /// An `[N, H, W, C]` node holding the value's elements in NHWC order.
    Nhwc(NodeId),
}

/// Whether the compiler lays out `g`'s convolutions channels-last: on the CPU always (the
/// product is NHWC anyway), on CUDA when an input already is; `KILN_CHANNELS_LAST` (`0` or `1`)
/// decides instead. (On CUDA, batch norm's statistics over NHWC now run as column kernels; for a
/// contiguous model, channels-last costs a copy of the input and the weights' relayout each call:
/// the choice waits for that to be measured against NCHW.)
fn wanted(g: &Graph, inputs: &[Tensor]) -> bool {
    let mut convs = g.nodes.iter().filter(|n| matches!(&n.op, NodeOp::Prim(op) if op.is_conv())).peekable();
    if convs.peek().is_none() {
        return false;
    }
    if let Some(on) = crate::switches::channels_last() {
        return on;
    }
    inputs.iter().any(asks_channels_last) || convs.any(|n| n.device == Device::Cpu)
}

/// An input that makes `wanted` lay a CUDA conv net out channels-last: a 4-D tensor dense in
/// NHWC order.
fn asks_channels_last(t: &Tensor) -> bool {
    t.dense_format() == Some(MemoryFormat::ChannelsLast)
}

/// Whether the CUDA conv net being traced now will run channels-last, as far as its inputs so
/// far tell (`wanted` decides once the trace ends; inputs captured later can only turn it on).
/// Traced values are laid out contiguously until then, so an op worth recording only over
/// channels-last operands (`conv2d_bias_act`) asks this instead of its operands' layouts.
pub(crate) fn traced_conv_net_runs_channels_last() -> bool {
    crate::switches::channels_last().unwrap_or_else(|| super::trace::any_input(asks_channels_last))
}

/// `g` with its convolutions and the 4-D work around them channels-last, where `wanted` says so;
/// `inputs` (arguments, then captured tensors) are what the program will be called with.
pub(crate) fn channels_last(g: &Graph, inputs: &[Tensor]) -> Graph {
    if !wanted(g, inputs) {
        return g.clone();
    }
    let mut r = Rewrite { out: Graph::default(), forms: Vec::with_capacity(g.nodes.len()), nhwc_of: Default::default(), nchw_of: Default::default(), copies: Default::default() };
    let input_nodes = g.input_nodes();
    let users = g.users();
    for (i, n) in g.nodes.iter().enumerate() {
        let form = match &n.op {
            NodeOp::Arg(_) | NodeOp::Captured(_) => {
                let id = r.push(n.op.clone(), vec![], n);
                // Dense in NHWC order (a 1x1 image or a single channel is in both orders).
                let t = input_nodes.iter().position(|&k| k == i).and_then(|k| inputs.get(k));
                if t.is_some_and(|t| t.ndim() == 4 && t.is_contiguous_for(MemoryFormat::ChannelsLast)) {
                    Form::ChannelsLast(id)
                } else {
                    Form::Plain(id)
                }
            }
            NodeOp::Prim(op) if op.is_conv() || matches!(op, Op::MaxPool2d(_) | Op::MaxPool2dBackward(_)) => {
                // Convolutions read channels-last operands (a copy where one is not) and so
                // return channels-last; pooling follows its input.
                let follow = op.is_conv() || n.args.iter().any(|&a| r.is_nhwc(a));
                let args: Vec<NodeId> = n.args.iter().map(|&a| if follow && g.nodes[a].shape.len() == 4 { r.channels_last(a, g) } else { r.nchw(a) }).collect();
                let id = r.push(n.op.clone(), args, n);
                if follow {
                    Form::ChannelsLast(id)
                } else {
                    Form::Plain(id)
                }
            }
            // A copy into channels-last memory (autograd's copy of a gradient laid out as its
            // parameter): of a value already in NHWC order that nothing else reads, the value
            // itself; else a copy that runs channels-last. Either way the work after it stays in
            // NHWC order (an optimiser's update of a channels-last weight is then one kernel).
            NodeOp::Prim(Op::Relayout(MemoryFormat::ChannelsLast)) if n.shape.len() == 4 => {
                let a = n.args[0];
                if r.is_nhwc(a) && users[a] == 1 {
                    Form::Nhwc(r.nhwc(a, g))
                } else {
                    let src = r.nchw(a);
                    Form::ChannelsLast(r.push(n.op.clone(), vec![src], n))
                }
            }
            NodeOp::Prim(op @ (Op::Unary(_) | Op::Binary(..) | Op::Where(_) | Op::Cast(_))) if n.shape.len() == 4 && r.decides_nhwc(g, &n.args, &n.shape) => {
                let args: Vec<NodeId> = n.args.iter().map(|&a| r.nhwc(a, g)).collect();
                Form::Nhwc(r.push_shaped(NodeOp::Prim(op.clone()), args, n, TO_NHWC.map(|d| n.shape[d]).to_vec()))
            }
            NodeOp::Prim(Op::Reduce(red, dims, keep)) if g.nodes[n.args[0]].shape.len() == 4 && r.is_nhwc(n.args[0]) => {
                // Reduced over the same dims at their NHWC positions.
                let pos = |d: usize| TO_NHWC.iter().position(|&t| t == d).expect("a permutation");
                let mut nd: Vec<usize> = dims.iter().map(|&d| pos(d)).collect();
                nd.sort_unstable();
                let src = r.nhwc(n.args[0], g);
                let in_nhwc = &r.out.nodes[src].shape.clone();
                let shape = crate::ops::reduce::reduced_shape(in_nhwc, &nd, *keep);
                let id = r.push_shaped(NodeOp::Prim(Op::Reduce(*red, nd.clone(), *keep)), vec![src], n, shape);
                if *keep {
                    Form::Nhwc(id)
                } else {
                    // The kept dims in NHWC order, put back in NCHW order.
                    let kept_nchw: Vec<usize> = (0..4).filter(|d| !dims.contains(d)).collect();
                    let kept_nhwc: Vec<usize> = TO_NHWC.iter().copied().filter(|d| !dims.contains(d)).collect();
                    let perm: Vec<usize> = kept_nchw.iter().map(|d| kept_nhwc.iter().position(|k| k == d).expect("kept")).collect();
                    if perm.iter().enumerate().all(|(i, &p)| i == p) {
                        Form::Plain(id)
                    } else {
                        Form::Plain(r.push_shaped(NodeOp::Prim(Op::Permute(perm)), vec![id], n, n.shape.clone()))
                    }
                }
            }
            _ => {
                let args: Vec<NodeId> = n.args.iter().map(|&a| r.nchw(a)).collect();
                Form::Plain(r.push(n.op.clone(), args, n))
            }
        };
        r.forms.push(form);
    }
    let outputs = g.outputs.iter().map(|&o| r.nchw(o)).collect();
    let mutations = g.mutations.iter().map(|&(k, v)| (k, r.nchw(v))).collect();
    Graph { outputs, mutations, ..r.out }
}

struct Rewrite {
    out: Graph,
    /// Per original node, how the rewritten graph holds it.
    forms: Vec<Form>,
    /// Views made so far: an original node's NHWC view, its NCHW view.
    nhwc_of: std::collections::HashMap<NodeId, NodeId>,
    nchw_of: std::collections::HashMap<NodeId, NodeId>,
    /// Channels-last copies of inputs.
    copies: std::collections::HashMap<NodeId, NodeId>,
}

impl Rewrite {
    fn push(&mut self, op: NodeOp, args: Vec<NodeId>, like: &Node) -> NodeId {
        self.out.push(op, args, like.shape.clone(), like.dtype, like.device)
    }

    fn push_shaped(&mut self, op: NodeOp, args: Vec<NodeId>, like: &Node, shape: Vec<usize>) -> NodeId {
        self.out.push(op, args, shape, like.dtype, like.device)
    }

    /// Whether `a`'s elements sit in NHWC order when the program runs.
    fn is_nhwc(&self, a: NodeId) -> bool {
        matches!(self.forms[a], Form::ChannelsLast(_) | Form::Nhwc(_))
    }

    /// Whether an elementwise op of `shape` over `args` is computed in NHWC: when every operand
    /// that is neither broadcast nor a constant is in NHWC order. (Eager ops let the first one
    /// decide; here a contiguous operand, such as a parameter an optimiser updates, would be
    /// read out of order and its update could not be stored in place.) With no such operand
    /// (average pooling's gradient, a broadcast scaled), NHWC too: the net around it is
    /// channels-last, and its readers would otherwise read it out of order.
    fn decides_nhwc(&self, g: &Graph, args: &[NodeId], shape: &[usize]) -> bool {
        let full = |a: &&NodeId| g.nodes[**a].shape == shape && !matches!(g.nodes[**a].op, NodeOp::Full(_) | NodeOp::Prim(Op::Expand(_)));
        args.iter().filter(full).all(|&a| self.is_nhwc(a))
    }

    /// `a` as an NCHW node (a view of its NHWC node where it has one).
    fn nchw(&mut self, a: NodeId) -> NodeId {
        let id = match self.forms[a] {
            Form::Plain(id) | Form::ChannelsLast(id) => return id,
            Form::Nhwc(id) => id,
        };
        if let Some(&v) = self.nchw_of.get(&a) {
            return v;
        }
        let n = &self.out.nodes[id];
        let (shape, dtype, device) = (FROM_NHWC.map(|d| n.shape[d]).to_vec(), n.dtype, n.device);
        let v = self.out.push(NodeOp::Prim(Op::Permute(FROM_NHWC.to_vec())), vec![id], shape, dtype, device);
        self.nchw_of.insert(a, v);
        v
    }

    /// `a` as an `[N, H, W, C]` node: its NHWC node, or a permuted view of its NCHW one (which
    /// reads a contiguous value out of order: only operands that do not decide come here so).
    fn nhwc(&mut self, a: NodeId, g: &Graph) -> NodeId {
        let id = match self.forms[a] {
            Form::Nhwc(id) => return id,
            Form::Plain(id) | Form::ChannelsLast(id) => id,
        };
        if let Some(&v) = self.nhwc_of.get(&a) {
            return v;
        }
        let shape = TO_NHWC.map(|d| g.nodes[a].shape[d]).to_vec();
        // A constant or a broadcast is made in NHWC shape itself, so that kernels still hold it
        // inline instead of reading a permuted view of a stored one.
        let v = match &g.nodes[a].op {
            NodeOp::Full(x) => self.push_shaped(NodeOp::Full(*x), vec![], &g.nodes[a], shape),
            // At most one dim past 1 (a per-channel vector, a scalar): the same order, reshaped.
            _ if g.nodes[a].shape.iter().filter(|&&d| d > 1).count() <= 1 => self.push_shaped(NodeOp::Prim(Op::Reshape(shape.clone())), vec![id], &g.nodes[a], shape),
            NodeOp::Prim(Op::Expand(_)) if g.nodes[g.nodes[a].args[0]].shape.len() == 4 => {
                let src = self.nhwc(g.nodes[a].args[0], g);
                self.push_shaped(NodeOp::Prim(Op::Expand(shape.clone())), vec![src], &g.nodes[a], shape)
            }
            _ => self.push_shaped(NodeOp::Prim(Op::Permute(TO_NHWC.to_vec())), vec![id], &g.nodes[a], shape),
        };
        self.nhwc_of.insert(a, v);
        v
    }

    /// `a` as an NCHW node that runs channels-last: a view of its NHWC node, or a copy of a
    /// plain value in NHWC order (`Op::Relayout`, made once). A computed value is then held by
    /// its copy; an input keeps its own form for its other readers (an optimiser updating a
    /// parameter in place reads the parameter itself).
    fn channels_last(&mut self, a: NodeId, g: &Graph) -> NodeId {
        match self.forms[a] {
            Form::ChannelsLast(id) => id,
            Form::Nhwc(_) => self.nchw(a),
            Form::Plain(id) => {
                if let Some(&c) = self.copies.get(&a) {
                    return c;
                }
                let copy = self.push(NodeOp::Prim(Op::Relayout(MemoryFormat::ChannelsLast)), vec![id], &g.nodes[a]);
                if matches!(g.nodes[a].op, NodeOp::Arg(_) | NodeOp::Captured(_)) {
                    self.copies.insert(a, copy);
                } else {
                    self.forms[a] = Form::ChannelsLast(copy);
                    self.nhwc_of.remove(&a);
                }
                copy
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{BinaryOp, Conv2dArgs, ReduceOp, UnaryOp};

    /// conv -> per-channel shift -> relu -> sum over (N, H, W) -> conv, on the CPU.
    fn conv_net() -> Graph {
        let mut g = Graph::default();
        let d = Device::Cpu;
        let f = DType::F32;
        let x = g.push(NodeOp::Arg(0), vec![], vec![2, 3, 8, 8], f, d);
        let w1 = g.push(NodeOp::Captured(0), vec![], vec![4, 3, 3, 3], f, d);
        let w2 = g.push(NodeOp::Captured(1), vec![], vec![5, 4, 1, 1], f, d);
        let b = g.push(NodeOp::Captured(2), vec![], vec![1, 4, 1, 1], f, d);
        let c1 = g.push(NodeOp::Prim(Op::Conv2d(Conv2dArgs { padding: (1, 1), ..Default::default() })), vec![x, w1], vec![2, 4, 8, 8], f, d);
        let bb = g.push(NodeOp::Prim(Op::Expand(vec![2, 4, 8, 8])), vec![b], vec![2, 4, 8, 8], f, d);
        let s = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Add, f)), vec![c1, bb], vec![2, 4, 8, 8], f, d);
        let a = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Relu)), vec![s], vec![2, 4, 8, 8], f, d);
        let m = g.push(NodeOp::Prim(Op::Reduce(ReduceOp::Sum, vec![0, 2, 3], false)), vec![a], vec![4], f, d);
        let c2 = g.push(NodeOp::Prim(Op::Conv2d(Conv2dArgs::default())), vec![a, w2], vec![2, 5, 8, 8], f, d);
        g.outputs = vec![c2, m];
        g
    }

    #[test]
    fn the_work_between_convolutions_runs_over_nhwc_views_and_the_input_is_copied_once() {
        let g = conv_net();
        let inputs: Vec<Tensor> = g.input_nodes().iter().map(|&i| Tensor::zeros(&g.nodes[i].shape, DType::F32, &Device::Cpu).unwrap()).collect();
        let h = channels_last(&g, &inputs);
        let text = h.to_string();
        // The add and the relu run on [N, H, W, C]; the sum reduces NHWC dims (0, 1, 2).
        let adds: Vec<&Node> = h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Binary(..)) | NodeOp::Prim(Op::Unary(_)))).collect();
        assert!(adds.len() == 2 && adds.iter().all(|n| n.shape == [2, 8, 8, 4]), "{text}");
        assert!(h.nodes.iter().any(|n| n.op == NodeOp::Prim(Op::Reduce(ReduceOp::Sum, vec![0, 1, 2], false)) && n.shape == [4]), "{text}");
        // Copies into NHWC order: the argument and the 3x3 weight (a contiguous 1x1 weight is in
        // both orders).
        let copies = h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Relayout(_)))).count();
        assert_eq!(copies, 2, "{text}");
        // Both convolutions read channels-last copies or permuted views of NHWC nodes (or the
        // 1x1 weight as it is).
        for n in h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Conv2d(_)))) {
            for &a in &n.args {
                let op = &h.nodes[a].op;
                assert!(*op == NodeOp::Prim(Op::Permute(FROM_NHWC.to_vec())) || *op == NodeOp::Prim(Op::Relayout(MemoryFormat::ChannelsLast)) || *op == NodeOp::Captured(1), "{text}");
            }
        }
        // Channels-last inputs need no copy.
        let cl: Vec<Tensor> = inputs.iter().map(|t| t.to_memory_format(MemoryFormat::ChannelsLast).unwrap()).collect();
        let h = channels_last(&g, &cl);
        let copies = h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Relayout(_)))).count();
        assert_eq!(copies, 0, "{h}");
    }

    #[test]
    fn work_on_a_broadcast_alone_runs_in_nhwc_beside_a_convolution() {
        // Average pooling's gradient: a per-(image, channel) value spread over H x W and scaled,
        // then multiplied by a convolution's output and summed per channel (batch norm's
        // backward). Laid out NCHW, the product would read the convolution's NHWC output out of
        // order and the sum would be no column reduction.
        let (f, d) = (DType::F32, Device::Cpu);
        let mut g = Graph::default();
        let x = g.push(NodeOp::Arg(0), vec![], vec![2, 3, 8, 8], f, d);
        let gs = g.push(NodeOp::Arg(1), vec![], vec![2, 4, 1, 1], f, d);
        let w = g.push(NodeOp::Captured(0), vec![], vec![4, 3, 3, 3], f, d);
        let c = g.push(NodeOp::Prim(Op::Conv2d(Conv2dArgs { padding: (1, 1), ..Default::default() })), vec![x, w], vec![2, 4, 8, 8], f, d);
        let e = g.push(NodeOp::Prim(Op::Expand(vec![2, 4, 8, 8])), vec![gs], vec![2, 4, 8, 8], f, d);
        let scaled = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Neg)), vec![e], vec![2, 4, 8, 8], f, d);
        let m = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Mul, f)), vec![c, scaled], vec![2, 4, 8, 8], f, d);
        let r = g.push(NodeOp::Prim(Op::Reduce(ReduceOp::Sum, vec![0, 2, 3], false)), vec![m], vec![4], f, d);
        g.outputs = vec![r];
        let inputs: Vec<Tensor> = g.input_nodes().iter().map(|&i| Tensor::zeros(&g.nodes[i].shape, f, &d).unwrap().to_memory_format(MemoryFormat::ChannelsLast).unwrap()).collect();
        let h = channels_last(&g, &inputs);
        for n in h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Unary(_) | Op::Binary(..)))) {
            assert_eq!(n.shape, [2, 8, 8, 4], "{h}");
        }
        assert!(h.nodes.iter().any(|n| n.op == NodeOp::Prim(Op::Reduce(ReduceOp::Sum, vec![0, 1, 2], false))), "{h}");
    }

    #[test]
    fn a_channels_last_copy_of_an_nhwc_value_keeps_the_work_after_it_in_nhwc() {
        // A convolution's output cast to F32 and copied channels-last (a gradient laid out as
        // its parameter), then updated with a channels-last state tensor.
        let (f, d) = (DType::F32, Device::Cpu);
        let build = |also_read: bool| {
            let mut g = Graph::default();
            let x = g.push(NodeOp::Arg(0), vec![], vec![2, 3, 8, 8], f, d);
            let w = g.push(NodeOp::Captured(0), vec![], vec![4, 3, 3, 3], f, d);
            let s = g.push(NodeOp::Captured(1), vec![], vec![2, 4, 8, 8], f, d);
            let c = g.push(NodeOp::Prim(Op::Conv2d(Conv2dArgs { padding: (1, 1), ..Default::default() })), vec![x, w], vec![2, 4, 8, 8], DType::BF16, d);
            let cast = g.push(NodeOp::Prim(Op::Cast(f)), vec![c], vec![2, 4, 8, 8], f, d);
            let copy = g.push(NodeOp::Prim(Op::Relayout(MemoryFormat::ChannelsLast)), vec![cast], vec![2, 4, 8, 8], f, d);
            let sum = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Add, f)), vec![copy, s], vec![2, 4, 8, 8], f, d);
            g.outputs = if also_read { vec![sum, cast] } else { vec![sum] };
            g
        };
        for also_read in [false, true] {
            let g = build(also_read);
            let inputs: Vec<Tensor> = g.input_nodes().iter().map(|&i| Tensor::zeros(&g.nodes[i].shape, DType::F32, &Device::Cpu).unwrap().to_memory_format(MemoryFormat::ChannelsLast).unwrap()).collect();
            let h = channels_last(&g, &inputs);
            let adds: Vec<&Node> = h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Binary(..)))).collect();
            assert!(adds.len() == 1 && adds[0].shape == [2, 8, 8, 4], "{h}");
            // The copy is left out unless the value it copies is read too (the two must not
            // share memory then).
            let copies = h.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Relayout(_)))).count();
            assert_eq!(copies, usize::from(also_read), "{h}");
        }
    }
}
