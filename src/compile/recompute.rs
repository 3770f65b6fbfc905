//! Recomputation: a cheap pointwise value on the GPU that several fusable nodes read is computed
//! again for each reader instead of stored by one kernel and loaded by the others. Common
//! subexpressions leave one `x - mean` for batch norm's variance and its normalisation; stored,
//! it costs a full-size F32 write and read between two kernels that both read x anyway. As
//! Inductor inlines pointwise nodes into their consumers, each reader here gets its own copy of
//! the value's chain of pointwise ops, back to stored values.

use super::graph::{Graph, NodeId, NodeOp};
use crate::ops::Op;

/// Most pointwise ops in a chain copied per reader.
const MAX_CHAIN: usize = 4;

/// `g` with a private copy of each cheap shared pointwise chain for every reader but the first.
pub(crate) fn recompute_cheap(g: &Graph) -> Graph {
    let n = g.nodes.len();
    let readers = g.readers();
    let kept = g.kept();
    // Readers a fused kernel computes: pointwise ops, reductions where the scheduler fuses
    // them (elsewhere an eager kernel would read a copy stored for it), and reshapes read only
    // by such readers (one read by a library product needs the value stored anyway).
    let mut fusable = vec![false; n];
    for r in (0..n).rev() {
        let node = &g.nodes[r];
        fusable[r] = node.is_pointwise()
            || super::fuse::reduces_in_a_kernel(g, r)
            || (matches!(node.op, NodeOp::Prim(Op::Reshape(_))) && !kept[r] && readers[r].iter().all(|&x| fusable[x]));
    }
    let fusable_reader = |r: NodeId| fusable[r];
    // The pointwise ops a value's chain holds (itself and its pointwise ancestors, shared ones
    // counted per path), capped past MAX_CHAIN.
    let mut chain = vec![usize::MAX; n];
    for i in 0..n {
        let node = &g.nodes[i];
        let pointwise = node.is_pointwise() && !matches!(node.op, NodeOp::Full(_));
        if !pointwise || !node.device.is_cuda() || node.numel() <= 1 {
            continue;
        }
        let mut c = 1usize;
        for &a in &node.args {
            let an = &g.nodes[a];
            if an.is_pointwise() && !matches!(an.op, NodeOp::Full(_)) && an.numel() > 1 {
                c = c.saturating_add(chain[a]);
            }
        }
        chain[i] = c;
    }
    // A node of a copied chain: one more reader of it would make its kernel store it.
    let in_chain = |i: NodeId| chain[i] <= MAX_CHAIN && !kept[i];
    let copied = |i: NodeId| in_chain(i) && readers[i].len() >= 2 && readers[i].iter().all(|&r| fusable_reader(r));
    if !(0..n).any(copied) {
        return g.clone();
    }
    let mut out = Graph { n_args: 0, n_captured: 0, ..Default::default() };
    let mut map: Vec<NodeId> = vec![usize::MAX; n];
    for i in 0..n {
        let node = &g.nodes[i];
        // Copies made for this reader, so that a chain it reads twice is copied once.
        let mut mine: Vec<(NodeId, NodeId)> = vec![];
        let args: Vec<NodeId> = node.args.iter().map(|&a| if copied(a) && readers[a][0] != i { copy(g, &mut out, &map, &in_chain, &mut mine, a) } else { map[a] }).collect();
        map[i] = out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device);
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    out.mutations = g.mutations.iter().map(|&(k, o)| (k, map[o])).collect();
    debug_assert_eq!((out.n_args, out.n_captured), (g.n_args, g.n_captured));
    out
}

/// A copy of node `a` (and of the chain nodes it reads) in `out`; `mine` remembers the copies
/// made for the current reader.
fn copy(g: &Graph, out: &mut Graph, map: &[NodeId], in_chain: &dyn Fn(NodeId) -> bool, mine: &mut Vec<(NodeId, NodeId)>, a: NodeId) -> NodeId {
    if let Some(&(_, c)) = mine.iter().find(|(o, _)| *o == a) {
        return c;
    }
    let node = &g.nodes[a];
    let args: Vec<NodeId> = node.args.iter().map(|&x| if in_chain(x) { copy(g, out, map, in_chain, mine, x) } else { map[x] }).collect();
    let c = out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device);
    mine.push((a, c));
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{fuse, simplify};
    use crate::kir::Space;
    use crate::{DType, Device, Result, Tensor};

    /// Batch norm's variance and normalisation share `x - mean`: after recomputation each
    /// kernel computes it from x, so the reduction stores per-channel values only and the
    /// normalisation's kernel reads x, not an F32 copy of x - mean.
    #[test]
    fn a_shared_difference_is_computed_by_each_kernel() {
        let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let centered = xs[0].sub(&xs[1])?;
            let var = centered.mul(&centered)?.sum(&[0, 2, 3], true)?;
            Ok(vec![centered.mul(&var)?])
        };
        let x = Tensor::zeros(&[2, 3, 4, 40], DType::BF16, &Device::Cpu).unwrap();
        let m = Tensor::zeros(&[1, 3, 1, 1], DType::F32, &Device::Cpu).unwrap();
        let g = simplify::simplify(&fuse::tests::graph_of(&[x, m], f));
        let subs = |g: &Graph| g.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Binary(crate::ops::BinaryOp::Sub, _)))).count();
        assert_eq!(subs(&g), 1, "{g}");
        let r = recompute_cheap(&g);
        assert_eq!(subs(&r), 2, "{r}");
        let s = fuse::schedule(&r);
        let mid = s.kernels.iter().find(|k| matches!(k.space, Space::Mid { .. })).expect("a mid kernel");
        assert!(mid.outputs.iter().all(|(o, _)| mid.ops[*o].row), "{}", mid.describe());
        // Without it, the mid kernel stores the difference for the other kernel.
        let s = fuse::schedule(&g);
        let mid = s.kernels.iter().find(|k| matches!(k.space, Space::Mid { .. })).expect("a mid kernel");
        assert!(mid.outputs.iter().any(|(o, _)| !mid.ops[*o].row), "{}", mid.describe());
    }

    /// A ReLU backward's output read by the bias gradient (a matrix's column sum, fused) and
    /// by the weight gradient's product (through a reshape): stored for the product anyway, it
    /// is not copied, and the column sum's kernel computes and stores it.
    #[test]
    fn a_value_read_by_a_column_sum_of_a_matrix_is_not_copied() {
        let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let g = xs[0].relu()?.gt_scalar(0.0)?.where_(&xs[1], &xs[1].mul_scalar(0.0)?)?;
            Ok(vec![g.sum(&[0], false)?, g.reshape(&[1, 64, 16])?.matmul(&xs[2])?])
        };
        let args = [Tensor::randn(&[64, 16], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[64, 16], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[1, 16, 8], DType::F32, &Device::Cpu).unwrap()];
        let g = simplify::simplify(&fuse::tests::graph_of(&args, f));
        let wheres = |g: &Graph| g.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Where(_)))).count();
        assert_eq!(wheres(&recompute_cheap(&g)), wheres(&g), "{}", recompute_cheap(&g));
        let s = fuse::schedule(&recompute_cheap(&g));
        let mid = s.kernels.iter().find(|k| matches!(k.space, Space::Mid { .. })).expect("the column sum is a mid kernel");
        assert!(mid.ops.iter().any(|o| o.kind == crate::kir::KKind::Where) && mid.outputs.iter().any(|(o, _)| !mid.ops[*o].row), "{}", mid.describe());
    }
}
