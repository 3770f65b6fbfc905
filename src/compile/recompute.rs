//! Recomputation: a cheap pointwise value (a short chain of pointwise ops, views and broadcasts
//! over stored values) is computed again by every node that reads it instead of being stored
//! once and read back. Each reader's fused kernel then holds the chain inline: batch norm's
//! `x.to_dtype(F32) - mean`, read by the statistics, the normalisation and (in a training
//! step) the backward, no longer becomes an F32 copy of the activations kept from the forward
//! to the backward; the backward recomputes it from x, which it keeps anyway. This is what
//! AOTAutograd's partitioner and Inductor's inlining of pointwise nodes do.

use super::graph::{Graph, NodeId, NodeOp};
use crate::ops::Op;

/// The most ops (counted along every path) one recomputed chain may hold.
const MAX_CHAIN: usize = 8;

/// The graph with every cheap value copied into each of its readers.
pub(crate) fn recompute(g: &Graph) -> Graph {
    let n = g.nodes.len();
    let kept: Vec<bool> = (0..n).map(|i| g.outputs.contains(&i) || g.mutations.iter().any(|m| m.1 == i)).collect();
    // size[i]: the ops a copy of i holds, when i is cheap. A chain over captured tensors and
    // constants alone is not copied: the runtime computes it once and keeps it.
    let mut size: Vec<Option<usize>> = vec![None; n];
    let mut computed = vec![false; n];
    for (i, node) in g.nodes.iter().enumerate() {
        let chain = matches!(&node.op, NodeOp::Prim(Op::Reshape(_) | Op::Expand(_))) || (node.is_pointwise() && !matches!(node.op, NodeOp::Full(_)));
        computed[i] = match &node.op {
            NodeOp::Captured(_) | NodeOp::Full(_) => false,
            _ if chain => node.args.iter().any(|&a| computed[a]),
            _ => true,
        };
        if !chain || kept[i] || !computed[i] {
            continue;
        }
        // Each argument is stored (its own node is read) or cheap itself (copied along).
        let total = node.args.iter().map(|&a| size[a].unwrap_or(0)).sum::<usize>() + 1;
        if total <= MAX_CHAIN {
            size[i] = Some(total);
        }
    }
    if size.iter().all(Option::is_none) {
        return g.clone();
    }
    let mut out = Graph::default();
    let mut map: Vec<Option<NodeId>> = vec![None; n];
    for i in 0..n {
        if size[i].is_none() {
            let args: Vec<NodeId> = g.nodes[i].args.iter().map(|&a| copy(g, &size, &map, &mut out, a)).collect();
            let node = &g.nodes[i];
            map[i] = Some(out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device));
        }
    }
    let at = |i: NodeId| map[i].expect("outputs and write-backs are never recomputed");
    out.outputs = g.outputs.iter().map(|&o| at(o)).collect();
    out.mutations = g.mutations.iter().map(|&(k, v)| (k, at(v))).collect();
    // Cheap values nothing stored reads are gone with the copies.
    out
}

/// Node `i` as one reader sees it: the stored node, or a fresh copy of a cheap chain.
fn copy(g: &Graph, size: &[Option<usize>], map: &[Option<NodeId>], out: &mut Graph, i: NodeId) -> NodeId {
    if size[i].is_none() {
        return map[i].expect("stored values come first");
    }
    let args: Vec<NodeId> = g.nodes[i].args.iter().map(|&a| copy(g, size, map, out, a)).collect();
    let node = &g.nodes[i];
    out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device)
}
