//! Ahead-of-time autodiff: the joint forward+backward graph of a traced function, built by
//! replaying it under a tracer and applying each op's gradient formula (`Op::backward`, the same
//! one the eager tape uses) in reverse. The joint graph is then split: the forward graph also
//! returns what backward needs; backward recomputes cheap pointwise values from those instead
//! of having them saved.

use super::graph::{Graph, NodeId, NodeOp};
use super::trace;
use crate::{Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// A function split for training: `forward` returns the outputs then `n_saved` saved values;
/// `backward` takes d(output) then the saved values and returns one gradient per input in
/// `needs_grad`.
pub(crate) struct Split {
    pub forward: Graph,
    pub backward: Graph,
    pub n_saved: usize,
    /// Which graph inputs (arguments then captured) get a gradient, in that order.
    pub needs_grad: Vec<bool>,
}

/// Builds the joint graph of single-output `g` and splits it. `inputs` are example values of
/// the graph's inputs (their shapes, dtypes, devices and `requires_grad` are what is used).
pub(crate) fn split(g: &Graph, inputs: &[Tensor]) -> Result<Split> {
    if g.outputs.len() != 1 {
        return Err(Error::Compile(format!("autodiff of a compiled function needs one output, it has {}", g.outputs.len())));
    }
    let out = &g.nodes[g.outputs[0]];
    let needs_grad: Vec<bool> = inputs.iter().map(|t| t.is_requires_grad()).collect();
    // Example d(output): only its metadata is used while tracing.
    let gout = Tensor::zeros(&out.shape, out.dtype, &out.device)?;
    let mut ex: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    ex.push(gout);
    let n_in = inputs.len();
    let g2 = g.clone();
    let ng = needs_grad.clone();
    let on_break: trace::BreakRunner = Arc::new(|_, _| Err(Error::Compile("a host read in a gradient formula".into())));
    let joint = trace::trace(&ex, true, on_break, &mut |sym| crate::no_grad(|| joint_body(&g2, &ng, &sym[..n_in], &sym[n_in])))?;
    let mut joint = joint.graph;
    joint.mutations.clear();
    partition(&joint, g, n_in, &needs_grad)
}

/// Replays `g` on `xs` and runs reverse mode from its output with gradient `gout`. Returns the
/// output, then the gradients of the inputs that need them.
fn joint_body(g: &Graph, needs: &[bool], xs: &[Tensor], gout: &Tensor) -> Result<Vec<Tensor>> {
    let n = g.nodes.len();
    let mut vals: Vec<Tensor> = Vec::with_capacity(n);
    let mut req = vec![false; n];
    let inputs = g.input_nodes();
    for (i, node) in g.nodes.iter().enumerate() {
        let v = match &node.op {
            NodeOp::Arg(_) | NodeOp::Captured(_) => {
                let k = inputs.iter().position(|&x| x == i).expect("an input node");
                req[i] = needs[k];
                xs[k].clone()
            }
            NodeOp::Prim(op) => {
                let args: Vec<&Tensor> = node.args.iter().map(|&a| &vals[a]).collect();
                let diff = op.differentiable_inputs(args.len());
                req[i] = node.dtype.is_float() && node.args.iter().zip(&diff).any(|(&a, &d)| d && req[a]);
                crate::ops::apply(op.clone(), &args)?
            }
            NodeOp::Custom(c) => {
                let args: Vec<&Tensor> = node.args.iter().map(|&a| &vals[a]).collect();
                req[i] = node.dtype.is_float() && node.args.iter().any(|&a| req[a]);
                c.call(&args)?
            }
            NodeOp::Full(_) | NodeOp::Arange { .. } => node.make_constant()?,
            NodeOp::Random(_) => {
                return Err(Error::Compile("random draws in a compiled function that needs gradients are not supported; draw them outside and pass them in".into()))
            }
            NodeOp::Collective(c) => {
                return Err(Error::Compile(format!("a {} in a compiled function whose result needs gradients is not supported; call backward inside the function", c.name())))
            }
        };
        vals.push(v);
    }
    let mut grads: Vec<Option<Tensor>> = vec![None; n];
    grads[g.outputs[0]] = Some(gout.clone());
    for i in (0..n).rev() {
        let Some(gi) = grads[i].take() else { continue };
        let node = &g.nodes[i];
        let (want, ga) = match &node.op {
            NodeOp::Prim(op) => {
                let want: Vec<bool> = node.args.iter().zip(op.differentiable_inputs(node.args.len())).map(|(&a, d)| d && req[a]).collect();
                if !want.iter().any(|&w| w) {
                    continue;
                }
                let xs: Vec<Option<Tensor>> = node.args.iter().map(|&a| Some(vals[a].clone())).collect();
                let meta: Vec<(Vec<usize>, crate::DType)> = node.args.iter().map(|&a| (g.nodes[a].shape.clone(), g.nodes[a].dtype)).collect();
                let ga = op.backward(&xs, Some(&vals[i]), &meta, &gi, &want)?;
                (want, ga)
            }
            // A custom op's own backward, traced into the joint graph like the formulas above.
            NodeOp::Custom(c) => {
                let want: Vec<bool> = node.args.iter().map(|&a| req[a]).collect();
                if !want.iter().any(|&w| w) {
                    continue;
                }
                let xs: Vec<Tensor> = node.args.iter().map(|&a| vals[a].clone()).collect();
                (want, c.gradients(&xs, &vals[i], &gi)?)
            }
            _ => {
                grads[i] = Some(gi); // inputs keep theirs
                continue;
            }
        };
        for ((&a, w), gr) in node.args.iter().zip(&want).zip(ga) {
            if let (true, Some(gr)) = (*w, gr) {
                let gr = if gr.dtype() != g.nodes[a].dtype { gr.to_dtype(g.nodes[a].dtype)? } else { gr };
                grads[a] = Some(match grads[a].take() {
                    Some(acc) => acc.add(&gr)?,
                    None => gr,
                });
            }
        }
    }
    let mut out = vec![vals[g.outputs[0]].clone()];
    for (k, &i) in inputs.iter().enumerate() {
        if needs[k] {
            out.push(match &grads[i] {
                Some(gr) => gr.clone(),
                None => Tensor::zeros(&g.nodes[i].shape, g.nodes[i].dtype, &g.nodes[i].device)?,
            });
        }
    }
    Ok(out)
}

/// Nodes whose value backward may recompute rather than have saved.
fn cheap(g: &Graph, i: NodeId) -> bool {
    g.nodes[i].is_pointwise() || g.nodes[i].is_constant() || matches!(&g.nodes[i].op, NodeOp::Prim(crate::ops::Op::Reshape(_) | crate::ops::Op::Expand(_) | crate::ops::Op::Permute(_)))
}

/// Splits the joint graph (inputs: the function's inputs then d(output); outputs: the output,
/// then the gradients) into forward and backward graphs.
fn partition(joint: &Graph, _orig: &Graph, n_in: usize, needs: &[bool]) -> Result<Split> {
    let inputs = joint.input_nodes();
    let fwd_out = joint.outputs[0];
    let grad_in = inputs[n_in];
    // Forward nodes: those not depending on d(output).
    let n = joint.nodes.len();
    let mut bwd = vec![false; n];
    bwd[grad_in] = true;
    for i in 0..n {
        if joint.nodes[i].args.iter().any(|&a| bwd[a]) {
            bwd[i] = true;
        }
    }
    // What backward reads from forward: recompute cheap values (recursively), save the rest.
    let mut saved: Vec<NodeId> = vec![];
    let mut recompute = vec![false; n];
    let mut stack: Vec<NodeId> = vec![];
    for i in 0..n {
        if bwd[i] {
            stack.extend(joint.nodes[i].args.iter().copied().filter(|&a| !bwd[a]));
        }
    }
    for &o in &joint.outputs[1..] {
        if !bwd[o] {
            stack.push(o);
        }
    }
    let mut seen = vec![false; n];
    while let Some(v) = stack.pop() {
        if seen[v] {
            continue;
        }
        seen[v] = true;
        let is_input = matches!(joint.nodes[v].op, NodeOp::Arg(_));
        if !is_input && cheap(joint, v) {
            recompute[v] = true;
            stack.extend(joint.nodes[v].args.iter().copied());
        } else {
            saved.push(v);
        }
    }
    saved.sort_unstable();
    // Forward graph: the function's inputs → output + saved values.
    let mut fwd_outputs = vec![fwd_out];
    fwd_outputs.extend(saved.iter().copied());
    let forward = extract(joint, &fwd_outputs, &inputs[..n_in].iter().enumerate().map(|(k, &i)| (i, k)).collect(), |i| !bwd[i]);
    // Backward graph: d(output) then the saved values → gradients.
    let mut bmap: HashMap<NodeId, usize> = HashMap::new();
    bmap.insert(grad_in, 0);
    for (k, &s) in saved.iter().enumerate() {
        bmap.insert(s, k + 1);
    }
    let backward = extract(joint, &joint.outputs[1..], &bmap, |i| bwd[i] || recompute[i]);
    Ok(Split { forward, backward, n_saved: saved.len(), needs_grad: needs.to_vec() })
}

/// The subgraph computing `outputs`, with `boundary` nodes turned into arguments (by index)
/// and only nodes satisfying `keep` (or on the boundary) included.
fn extract(g: &Graph, outputs: &[NodeId], boundary: &HashMap<NodeId, usize>, keep: impl Fn(NodeId) -> bool) -> Graph {
    let n = g.nodes.len();
    let mut need = vec![false; n];
    let mut stack: Vec<NodeId> = outputs.to_vec();
    while let Some(v) = stack.pop() {
        if need[v] {
            continue;
        }
        need[v] = true;
        if !boundary.contains_key(&v) {
            debug_assert!(keep(v), "node {v} crosses the split");
            stack.extend(g.nodes[v].args.iter().copied());
        }
    }
    let mut out = Graph::default();
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    // Arguments first, in boundary order, so input_nodes() matches the calling convention.
    let mut args: Vec<(usize, NodeId)> = boundary.iter().map(|(&node, &k)| (k, node)).collect();
    args.sort_unstable();
    for (k, node) in args {
        let nd = &g.nodes[node];
        let id = out.push(NodeOp::Arg(k), vec![], nd.shape.clone(), nd.dtype, nd.device);
        map.insert(node, id);
    }
    for (i, nd) in g.nodes.iter().enumerate() {
        if !need[i] || boundary.contains_key(&i) {
            continue;
        }
        let a = nd.args.iter().map(|x| map[x]).collect();
        let id = out.push(nd.op.clone(), a, nd.shape.clone(), nd.dtype, nd.device);
        map.insert(i, id);
    }
    out.outputs = outputs.iter().map(|o| map[o]).collect();
    out
}
