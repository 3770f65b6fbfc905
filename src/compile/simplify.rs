//! Simplification: algebraic identities (x*1, x+0, x-0, x/1, a cast to the same dtype, a
//! permute that moves only dims of size 1, which is a reshape, a sum of zero paddings that tile
//! it, which is a concatenation), constant folding of arithmetic
//! on constants, common subexpressions, and dead code. Each rewrite maps
//! a node to an equivalent earlier one; the graph is then rebuilt without what no output needs.

use super::graph::{Graph, NodeId, NodeOp};
use crate::ops::{BinaryOp, Op};
use std::collections::HashMap;

/// A constant, possibly broadcast or reshaped: its value.
fn constant(ops: &[NodeOp], args: &[Vec<NodeId>], mut j: NodeId) -> Option<f64> {
    loop {
        match &ops[j] {
            NodeOp::Full(v) => return Some(*v),
            NodeOp::Prim(Op::Expand(_) | Op::Reshape(_)) => j = args[j][0],
            _ => return None,
        }
    }
}

pub(crate) fn simplify(g: &Graph) -> Graph {
    let n = g.nodes.len();
    // Values the caller sees: returned, written back into a captured tensor, or viewed by one
    // that is.
    let outputs = g.seen_by_caller();
    let mut repl: Vec<NodeId> = (0..n).collect();
    let mut ops: Vec<NodeOp> = g.nodes.iter().map(|x| x.op.clone()).collect();
    let mut args: Vec<Vec<NodeId>> = g.nodes.iter().map(|x| x.args.clone()).collect();
    let mut seen: HashMap<String, NodeId> = HashMap::new();
    // Each node as common subexpressions see it: a constant (possibly broadcast or reshaped)
    // keeps its own node, so every fused kernel that reads one holds it inline (the layer
    // norms of a transformer's layers then have one code, not one that holds the shared
    // constants and others that read them as inputs), but nodes over equal constants still
    // count as the same expression.
    let mut canon: Vec<NodeId> = (0..n).collect();
    for i in 0..n {
        for a in args[i].iter_mut() {
            *a = repl[*a];
        }
        let node = &g.nodes[i];
        // A permute that keeps the order of the dims longer than 1 (a per-channel [1, 1, 1, C]
        // value seen as [1, C, 1, 1]) is a reshape: fusion sees through reshapes, not permutes.
        if let NodeOp::Prim(Op::Permute(perm)) = &ops[i] {
            let x = &g.nodes[args[i][0]].shape;
            let moved: Vec<usize> = perm.iter().copied().filter(|&d| x[d] != 1).collect();
            if moved.windows(2).all(|w| w[0] < w[1]) {
                ops[i] = NodeOp::Prim(Op::Reshape(node.shape.clone()));
            }
        }
        // Two zero paddings that tile their sum along one dim are a concatenation: the
        // gradients of a split (`narrow`s of one product, as attention's q, k and v are) then
        // meet in one buffer, not as two zero-filled copies added.
        if matches!(ops[i], NodeOp::Prim(Op::Binary(BinaryOp::Add, _))) {
            if let Some((d, first, second)) = tiling_pads(&ops, &args, g, i) {
                ops[i] = NodeOp::Prim(Op::Cat(d));
                args[i] = vec![first, second];
            }
        }
        let konst = |j: NodeId| constant(&ops, &args, j);
        if let NodeOp::Prim(op) = &ops[i] {
            let same = |j: NodeId| g.nodes[j].shape == node.shape && g.nodes[j].dtype == node.dtype;
            let identity = match op {
                Op::Binary(b, c) if *c == node.dtype => {
                    let (x, y) = (args[i][0], args[i][1]);
                    match b {
                        BinaryOp::Mul if konst(y) == Some(1.0) && same(x) => Some(x),
                        BinaryOp::Mul if konst(x) == Some(1.0) && same(y) => Some(y),
                        BinaryOp::Add if konst(y) == Some(0.0) && same(x) => Some(x),
                        BinaryOp::Add if konst(x) == Some(0.0) && same(y) => Some(y),
                        BinaryOp::Sub if konst(y) == Some(0.0) && same(x) => Some(x),
                        BinaryOp::Div if konst(y) == Some(1.0) && same(x) => Some(x),
                        _ => None,
                    }
                }
                // A same-dtype cast is a copy: needless inside a graph, but an output (or a
                // written-back value) must not alias an input.
                Op::Cast(d) if *d == g.nodes[args[i][0]].dtype && !outputs[i] => Some(args[i][0]),
                _ => None,
            };
            // (Never an input, or a view of one, for a value the caller sees.)
            let input_under = |mut j: NodeId| loop {
                match &ops[j] {
                    NodeOp::Prim(op) if op.is_view() => j = args[j][0],
                    op => break matches!(op, NodeOp::Arg(_) | NodeOp::Captured(_)),
                }
            };
            if let Some(j) = identity.filter(|&j| !outputs[i] || !input_under(j)) {
                repl[i] = j;
                continue;
            }
            // Arithmetic on two constants of float dtype folds into one constant.
            if let Op::Binary(b, c) = op {
                if c.is_float() && node.dtype.is_float() {
                    if let (Some(x), Some(y)) = (konst(args[i][0]), konst(args[i][1])) {
                        let v = match b {
                            BinaryOp::Add => Some(x + y),
                            BinaryOp::Sub => Some(x - y),
                            BinaryOp::Mul => Some(x * y),
                            BinaryOp::Div => Some(x / y),
                            _ => None,
                        };
                        if let Some(v) = v {
                            // Rounded to the dtype as a stored constant would be.
                            ops[i] = NodeOp::Full(round_to(v, node.dtype));
                            args[i].clear();
                        }
                    }
                }
            }
        }
        // Common subexpressions: the same op on the same arguments (random draws and collectives
        // differ: each is its own exchange with the other ranks).
        if !matches!(ops[i], NodeOp::Random(_) | NodeOp::Collective(_) | NodeOp::Arg(_) | NodeOp::Captured(_)) {
            let seen_args: Vec<NodeId> = args[i].iter().map(|&a| canon[a]).collect();
            let key = format!("{:?}|{:?}|{:?}|{:?}|{:?}", ops[i], seen_args, node.shape, node.dtype, node.device);
            match seen.get(&key) {
                Some(&j) if constant(&ops, &args, i).is_some() => canon[i] = j,
                Some(&j) => {
                    repl[i] = j;
                    continue;
                }
                None => {
                    seen.insert(key, i);
                }
            }
        }
    }
    // Dead code: keep what outputs and write-backs need, and every input.
    let mut live = vec![false; n];
    let mut stack: Vec<NodeId> = g.outputs.iter().chain(g.mutations.iter().map(|m| &m.1)).map(|&o| repl[o]).collect();
    while let Some(v) = stack.pop() {
        if !live[v] {
            live[v] = true;
            stack.extend(args[v].iter().copied());
        }
    }
    let mut out = Graph::default();
    let mut map: Vec<Option<NodeId>> = vec![None; n];
    for i in 0..n {
        let is_input = matches!(ops[i], NodeOp::Arg(_) | NodeOp::Captured(_));
        if repl[i] != i || !(live[i] || is_input) {
            continue;
        }
        let nd = &g.nodes[i];
        let a = args[i].iter().map(|x| map[*x].expect("arguments come first")).collect();
        map[i] = Some(out.push(ops[i].clone(), a, nd.shape.clone(), nd.dtype, nd.device));
    }
    out.outputs = g.outputs.iter().map(|&o| map[repl[o]].expect("live")).collect();
    out.mutations = g.mutations.iter().map(|&(k, v)| (k, map[repl[v]].expect("live"))).collect();
    out
}

/// Whether the two arguments of sum `i` are zero paddings of values that tile it along one dim
/// (`[a, 0] + [0, b]`): that dim and the two values in order.
fn tiling_pads(ops: &[NodeOp], args: &[Vec<NodeId>], g: &Graph, i: NodeId) -> Option<(usize, NodeId, NodeId)> {
    let pad = |j: NodeId| match &ops[j] {
        NodeOp::Prim(Op::Pad(p, v)) if *v == 0.0 && g.nodes[j].dtype == g.nodes[i].dtype && g.nodes[j].shape == g.nodes[i].shape => Some(p),
        _ => None,
    };
    let (x, y) = (args[i][0], args[i][1]);
    let (px, py) = (pad(x)?, pad(y)?);
    let d = (0..px.len()).find(|&d| px[d] != (0, 0) || py[d] != (0, 0))?;
    if (0..px.len()).any(|e| e != d && (px[e] != (0, 0) || py[e] != (0, 0))) {
        return None;
    }
    // The value without padding before it comes first; it ends where the other starts.
    let (lead, tail, lp, tp) = if px[d].0 == 0 { (x, y, px[d], py[d]) } else { (y, x, py[d], px[d]) };
    let lead_len = g.nodes[i].shape[d] - lp.1;
    (lp.0 == 0 && tp.1 == 0 && tp.0 == lead_len).then(|| (d, args[lead][0], args[tail][0]))
}

fn round_to(v: f64, d: crate::DType) -> f64 {
    use crate::DType::*;
    match d {
        F32 => v as f32 as f64,
        F16 => half::f16::from_f32(v as f32).to_f64(),
        BF16 => half::bf16::from_f32(v as f32).to_f64(),
        _ => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Device, Tensor};

    /// The gradient of two `narrow`s that split a value: zero paddings that tile it, added.
    /// Simplified, it is their concatenation (in order along the split dim), with the same
    /// values; paddings that overlap or leave a gap stay a sum.
    #[test]
    fn zero_paddings_that_tile_their_sum_are_a_concatenation() {
        let cpu = Device::Cpu;
        let (a, b) = (Tensor::randn(&[2, 3, 4], DType::F32, &cpu).unwrap(), Tensor::randn(&[2, 3, 6], DType::F32, &cpu).unwrap());
        let tiled = |xs: &[Tensor]| Ok(vec![xs[1].pad(&[4, 0], 0.0)?.add(&xs[0].pad(&[0, 6], 0.0)?)?]);
        let g = simplify(&crate::compile::fuse::tests::graph_of(&[a.clone(), b.clone()], tiled));
        let cats: Vec<&Op> = g.nodes.iter().filter_map(|n| if let NodeOp::Prim(op @ Op::Cat(_)) = &n.op { Some(op) } else { None }).collect();
        assert_eq!(cats, [&Op::Cat(2)], "{g}");
        assert!(!g.nodes.iter().any(|n| matches!(n.op, NodeOp::Prim(Op::Pad(..) | Op::Binary(..)))), "{g}");
        let want = crate::ops::movement::cat(&[&a, &b], 2).unwrap();
        let got = crate::compile::compile_with(crate::compile::CompileOptions::new(), tiled).call(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(got[0].to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        // A gap between them (or an overlap) is no tiling.
        let gap = |xs: &[Tensor]| Ok(vec![xs[1].pad(&[5, 0], 0.0)?.add(&xs[0].pad(&[0, 7], 0.0)?)?]);
        let g = simplify(&crate::compile::fuse::tests::graph_of(&[a, b], gap));
        assert!(!g.nodes.iter().any(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))), "{g}");
    }

    /// Batch norm's per-channel scale over a channels-last image: the `[1, 1, 1, C]` statistic
    /// seen as `[1, C, 1, 1]` is a reshape, so the scale joins the kernels around it; a permute
    /// that reorders dims longer than 1 stays.
    #[test]
    fn a_permute_of_dims_of_size_one_is_a_reshape() {
        let stat = Tensor::randn(&[1, 1, 1, 8], DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::randn(&[1, 8, 1, 1], DType::F32, &Device::Cpu).unwrap();
        let img = Tensor::randn(&[2, 8, 3, 3], DType::F32, &Device::Cpu).unwrap();
        let g = simplify(&crate::compile::fuse::tests::graph_of(&[stat, w, img], |xs| Ok(vec![xs[0].rsqrt()?.permute(&[0, 3, 1, 2])?.mul(&xs[1])?, xs[2].permute(&[0, 2, 3, 1])?.exp()?])));
        let permutes: Vec<&Vec<usize>> = g.nodes.iter().filter_map(|n| if let NodeOp::Prim(Op::Permute(p)) = &n.op { Some(p) } else { None }).collect();
        assert_eq!(permutes, [&vec![0, 2, 3, 1]], "{g}");
        let s = crate::compile::fuse::schedule(&g);
        let scale = s.kernels.iter().find(|k| k.name.contains("rsqrt")).expect("the scale's kernel");
        assert!(scale.name.contains("mul"), "rsqrt and the product are one kernel: {}", scale.describe());
    }
}
