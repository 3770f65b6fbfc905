//! Rematerialisation: which values a training step keeps from its forward to its backward. A
//! full-size value that is a short pointwise chain over values kept anyway (batch norm's
//! normalised-and-ReLU'd output over the convolution's, which its backward keeps) is computed
//! again where the backward reads it, instead of being kept alive across the gap: AOTAutograd's
//! min-cut choice of recomputing cheap pointwise work rather than saving it. The memory plan
//! then frees the value after its last forward reader.

use super::graph::{Graph, NodeId, NodeOp};
#[cfg(test)]
use crate::ops::Op;

/// Fewest nodes between two readers for the later ones to count as another phase (a backward).
const MIN_GAP: usize = 32;
/// Most pointwise ops copied per recomputed value.
const MAX_CHAIN: usize = 8;
/// Fewest elements of a value worth recomputing.
const MIN_NUMEL: usize = 4096;

/// `g` with each late reader of a recomputable value reading a fresh copy of its chain, made
/// just before the first of them.
pub(crate) fn rematerialize(g: &Graph) -> Graph {
    if crate::switches::remat_off() {
        return g.clone();
    }
    let n = g.nodes.len();
    let readers = g.readers();
    // The last position each value is read at (outputs and write-backs: the end).
    let mut last = vec![0usize; n];
    for (i, rs) in readers.iter().enumerate() {
        last[i] = rs.iter().copied().max().unwrap_or(i);
    }
    for &o in g.outputs.iter().chain(g.mutations.iter().map(|(_, o)| o)) {
        last[o] = n;
    }
    // The readers of a value through its views.
    let mut reads: Vec<Vec<NodeId>> = vec![vec![]; n];
    for (i, node) in g.nodes.iter().enumerate() {
        if matches!(&node.op, NodeOp::Prim(op) if op.is_view()) {
            continue;
        }
        for &a in &node.args {
            reads[g.view_root(a)].push(i);
        }
    }
    for r in reads.iter_mut() {
        r.sort_unstable();
        r.dedup();
    }
    let kept: Vec<bool> = (0..n).map(|i| last[i] == n).collect();

    // Per value: the position from which its readers recompute it, and its chain.
    let mut from: Vec<Option<usize>> = vec![None; n];
    let mut in_chain = vec![false; n];
    for v in 0..n {
        let node = &g.nodes[v];
        if !node.is_pointwise() || matches!(node.op, NodeOp::Full(_)) || node.numel() < MIN_NUMEL || kept[v] || reads[v].is_empty() {
            continue;
        }
        // The widest gap between v (or a reader) and the next reader splits early from late.
        let mut at = v;
        let mut best = (0, 0);
        for &r in &reads[v] {
            if r - at > best.0 {
                best = (r - at, r);
            }
            at = r;
        }
        let (gap, first_late) = best;
        if gap < MIN_GAP || first_late == reads[v][0] {
            continue;
        }
        // The chain stops at values alive at the first late reader anyway (inputs, small
        // per-channel values, values read there or later); it must reach them within
        // MAX_CHAIN ops, through same-size pointwise ops only. Any other value it stops at
        // (a convolution's output under batch norm's F32 `x - mean`) is kept alive until then
        // instead: worth it when such values take fewer bytes than the one recomputed (the
        // min-cut choice, made one value at a time).
        let bytes = |x: NodeId| g.nodes[x].bytes();
        let alive = |x: NodeId| {
            let x = g.view_root(x);
            g.nodes[x].reads_nothing() || g.nodes[x].numel() * 16 <= node.numel() || last[x] >= first_late
        };
        let (mut nodes, mut stack, mut kept_longer) = (vec![], vec![v], vec![]);
        while let Some(x) = stack.pop() {
            if nodes.contains(&x) {
                continue;
            }
            nodes.push(x);
            for &a in &g.nodes[x].args {
                let an = &g.nodes[a];
                if alive(a) {
                    continue;
                }
                if an.is_pointwise() && an.numel() == node.numel() && nodes.len() < MAX_CHAIN {
                    stack.push(a);
                } else if !kept_longer.contains(&g.view_root(a)) {
                    kept_longer.push(g.view_root(a));
                }
            }
        }
        // A value made from the inputs alone (a weight cast to autocast's dtype) whose late
        // readers are none of them fused kernels (a product's backward) is stored for them anyway:
        // recomputed, it would be written again and its input read again, to save memory
        // only. It is kept, as PyTorch's autocast keeps its casts of the parameters.
        let input = |x: NodeId| g.nodes[g.view_root(x)].reads_nothing();
        let of_inputs = nodes.iter().all(|&x| g.nodes[x].args.iter().all(|&a| nodes.contains(&a) || input(a)));
        let late_fuse = reads[v].iter().any(|&r| r >= first_late && (g.nodes[r].is_pointwise() || super::fuse::reduces_in_a_kernel(g, r)));
        if of_inputs && !late_fuse {
            continue;
        }
        if kept_longer.iter().map(|&x| bytes(x)).sum::<usize>() < bytes(v) {
            from[v] = Some(first_late);
            for x in nodes {
                in_chain[x] = true;
            }
            for x in kept_longer {
                last[x] = last[x].max(first_late);
            }
        }
    }
    if from.iter().all(Option::is_none) {
        return g.clone();
    }

    let mut out = Graph::default();
    let mut map: Vec<NodeId> = vec![usize::MAX; n];
    // The copy of each recomputed value (and of the views of it) made for its late readers.
    let mut copies: std::collections::HashMap<NodeId, NodeId> = Default::default();
    for (i, node) in g.nodes.iter().enumerate() {
        let is_view = matches!(&node.op, NodeOp::Prim(op) if op.is_view());
        let args: Vec<NodeId> = node
            .args
            .iter()
            .map(|&a| match from[g.view_root(a)] {
                Some(f) if f <= i && !is_view => late_copy(g, &mut out, &map, &Recomputed { in_chain: &in_chain, from: &from, at: i }, &mut copies, a),
                _ => map[a],
            })
            .collect();
        map[i] = out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device);
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    out.mutations = g.mutations.iter().map(|&(k, o)| (k, map[o])).collect();
    out
}

/// What the late copies are made of: the nodes of recomputed chains, where each recomputed
/// value's late readers start, and the position of the reader a copy is made for.
struct Recomputed<'a> {
    in_chain: &'a [bool],
    from: &'a [Option<usize>],
    at: NodeId,
}

/// What a late reader reads instead of `a`: a copy of `a`'s chain (or a view of one), made once.
/// A chain that stops at another recomputed value reads that value's copy.
fn late_copy(g: &Graph, out: &mut Graph, map: &[NodeId], r: &Recomputed, copies: &mut std::collections::HashMap<NodeId, NodeId>, a: NodeId) -> NodeId {
    if let Some(&c) = copies.get(&a) {
        return c;
    }
    let node = &g.nodes[a];
    let recomputed_by_now = |x: NodeId| r.from[g.view_root(x)].is_some_and(|f| f <= r.at);
    let args: Vec<NodeId> = if matches!(&node.op, NodeOp::Prim(op) if op.is_view()) {
        vec![late_copy(g, out, map, r, copies, node.args[0])]
    } else {
        node.args.iter().map(|&x| if r.in_chain[x] || recomputed_by_now(x) { late_copy(g, out, map, r, copies, x) } else { map[x] }).collect()
    };
    let c = out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device);
    copies.insert(a, c);
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{BinaryOp, UnaryOp};
    use crate::{DType, Device};

    /// a2 = sum of an argument over its last dim (a value computed by something other than a
    /// pointwise op); y = relu(a2 * s); early reader z = y + 1; 40 unrelated nodes; late
    /// readers y * w and a2 - that (so a2 is alive there anyway).
    fn phases() -> (Graph, NodeId) {
        let mut g = Graph::default();
        let (f, d, sh) = (DType::F32, Device::Cpu, vec![64, 128]);
        let a = g.push(NodeOp::Arg(0), vec![], vec![64, 128, 2], f, d);
        let a2 = g.push(NodeOp::Prim(Op::Reduce(crate::ops::ReduceOp::Sum, vec![2], false)), vec![a], sh.clone(), f, d);
        let s = g.push(NodeOp::Full(0.5), vec![], sh.clone(), f, d);
        let m = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Mul, f)), vec![a2, s], sh.clone(), f, d);
        let y = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Relu)), vec![m], sh.clone(), f, d);
        let one = g.push(NodeOp::Full(1.0), vec![], sh.clone(), f, d);
        let z = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Add, f)), vec![y, one], sh.clone(), f, d);
        let mut w = z;
        for _ in 0..40 {
            w = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Neg)), vec![w], sh.clone(), f, d);
        }
        let late = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Mul, f)), vec![y, w], sh.clone(), f, d);
        let la = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Sub, f)), vec![a2, late], sh.clone(), f, d);
        g.outputs = vec![la];
        (g, y)
    }

    #[test]
    fn a_late_reader_recomputes_a_cheap_chain_over_values_alive_anyway() {
        let (g, _) = phases();
        let r = rematerialize(&g);
        let relus: Vec<NodeId> = (0..r.nodes.len()).filter(|&i| r.nodes[i].op == NodeOp::Prim(Op::Unary(UnaryOp::Relu))).collect();
        assert_eq!(relus.len(), 2, "{r}");
        // The copy comes right before its reader, after the 40 nodes between.
        let readers = r.readers();
        assert_eq!(readers[relus[0]].len(), 1, "the original now has its early reader only: {r}");
        assert!(relus[1] > 40 && readers[relus[1]][0] > relus[1], "{r}");
    }

    #[test]
    fn a_chain_over_a_value_that_would_have_died_is_kept_instead() {
        // Without the late `a2 - ...`, recomputing y would keep a2 alive across the gap instead.
        let (mut g, _) = phases();
        let last = g.nodes.len() - 1;
        g.outputs = vec![g.nodes[last].args[1]];
        g.nodes.pop();
        let r = rematerialize(&g);
        assert_eq!(r.nodes.iter().filter(|n| n.op == NodeOp::Prim(Op::Unary(UnaryOp::Relu))).count(), 1, "{r}");
    }

    /// x = a half-precision value made by something other than a pointwise op (a convolution's
    /// output); s = x - m in F32 (batch norm's) and y = relu(s), each read early and after 40
    /// unrelated nodes.
    fn half_precision_leaf() -> (Graph, NodeId, NodeId, NodeId) {
        let mut g = Graph::default();
        let (f, h, d, sh) = (DType::F32, DType::BF16, Device::Cpu, vec![64, 128]);
        let a = g.push(NodeOp::Arg(0), vec![], vec![64, 128, 2], h, d);
        let x = g.push(NodeOp::Prim(Op::Reduce(crate::ops::ReduceOp::Sum, vec![2], false)), vec![a], sh.clone(), h, d);
        let m = g.push(NodeOp::Full(0.5), vec![], sh.clone(), f, d);
        let s = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Sub, f)), vec![x, m], sh.clone(), f, d);
        let y = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Relu)), vec![s], sh.clone(), f, d);
        let mut w = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Add, f)), vec![s, y], sh.clone(), f, d);
        for _ in 0..40 {
            w = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Neg)), vec![w], sh.clone(), f, d);
        }
        let late = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Mul, f)), vec![s, w], sh.clone(), f, d);
        let late = g.push(NodeOp::Prim(Op::Binary(BinaryOp::Mul, f)), vec![y, late], sh.clone(), f, d);
        g.outputs = vec![late];
        (g, x, s, y)
    }

    #[test]
    fn a_value_is_recomputed_from_a_smaller_one_kept_longer_for_it() {
        // Recomputing s keeps x (half its bytes) alive across the gap instead of s; y's copy
        // reads s's copy, so neither original is read late.
        let (g, x, s, y) = half_precision_leaf();
        let r = rematerialize(&g);
        let subs: Vec<NodeId> = (0..r.nodes.len()).filter(|&i| matches!(r.nodes[i].op, NodeOp::Prim(Op::Binary(BinaryOp::Sub, _)))).collect();
        let relus: Vec<NodeId> = (0..r.nodes.len()).filter(|&i| r.nodes[i].op == NodeOp::Prim(Op::Unary(UnaryOp::Relu))).collect();
        assert_eq!((subs.len(), relus.len()), (2, 2), "{r}");
        let readers = r.readers();
        let late = r.nodes.len() - 40;
        // Nothing is moved before x, s and y: their ids are unchanged in the copy.
        assert!(readers[s].iter().chain(&readers[y]).all(|&i| i < late), "the originals are read early only: {r}");
        assert!(readers[x].iter().any(|&i| i > late), "x is read by the late copy of s: {r}");
        assert_eq!(r.nodes[relus[1]].args, vec![subs[1]], "y's copy reads s's copy: {r}");
    }

    #[test]
    fn a_value_is_kept_when_what_it_needs_kept_longer_is_as_large() {
        // x in F32 takes as many bytes as s: recomputing s saves nothing.
        let (mut g, x, ..) = half_precision_leaf();
        g.nodes[x].dtype = DType::F32;
        g.nodes[x - 1].dtype = DType::F32;
        let r = rematerialize(&g);
        assert_eq!(r.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Binary(BinaryOp::Sub, _)))).count(), 1, "{r}");
    }

    /// A weight cast to BF16 read by a product early and by another after 40 unrelated nodes
    /// (its backward) is kept, not cast again: the late product reads it from memory either
    /// way. The same cast read late by a pointwise op is recomputed there.
    #[test]
    fn a_cast_of_an_input_read_late_only_by_products_is_kept() {
        for late_product in [true, false] {
            let mut g = Graph::default();
            let (f, h, d) = (DType::F32, DType::BF16, Device::Cpu);
            let w = g.push(NodeOp::Captured(0), vec![], vec![1, 64, 128], f, d);
            let x = g.push(NodeOp::Arg(0), vec![], vec![1, 32, 64], h, d);
            let wh = g.push(NodeOp::Prim(Op::Cast(h)), vec![w], vec![1, 64, 128], h, d);
            let mut y = g.push(NodeOp::Prim(Op::Matmul), vec![x, wh], vec![1, 32, 128], h, d);
            for _ in 0..40 {
                y = g.push(NodeOp::Prim(Op::Unary(UnaryOp::Neg)), vec![y], vec![1, 32, 128], h, d);
            }
            let late = match late_product {
                true => {
                    let t = g.push(NodeOp::Prim(Op::Permute(vec![0, 2, 1])), vec![wh], vec![1, 128, 64], h, d);
                    g.push(NodeOp::Prim(Op::Matmul), vec![y, t], vec![1, 32, 64], h, d)
                }
                false => g.push(NodeOp::Prim(Op::Unary(UnaryOp::Neg)), vec![wh], vec![1, 64, 128], h, d),
            };
            g.outputs = vec![late, y];
            let r = rematerialize(&g);
            let casts = r.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Cast(_)))).count();
            assert_eq!(casts, if late_product { 1 } else { 2 }, "{r}");
        }
    }
}
