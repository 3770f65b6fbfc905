//! Recomputation: a cheap pointwise value on the GPU that several fusable nodes read is computed
//! again for each reader instead of stored by one kernel and loaded by the others. Common
//! subexpressions leave one `x - mean` for batch norm's variance and its normalisation; stored,
//! it costs a full-size F32 write and read between two kernels that both read x anyway. As
//! Inductor inlines pointwise nodes into their consumers, each reader here gets its own copy of
//! the value's chain of pointwise ops, back to stored values. Row values spread over their rows
//! (`expand`) are copied too and cost nothing: such a broadcast is a view, never worth storing
//! at full size. A chain whose stored leaves are larger than its value (`a + b` of two full F32
//! values) is not copied: each reader would load both leaves, more than the stored value costs.

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
    // counted per path; broadcasts count none), capped past MAX_CHAIN.
    let spreads = |i: NodeId| super::fuse::spreads_rows(g, i);
    let link = |i: NodeId| {
        let node = &g.nodes[i];
        let op = (node.is_pointwise() && !matches!(node.op, NodeOp::Full(_))) || spreads(i);
        op && node.device.is_cuda() && node.numel() > 1
    };
    let mut chain = vec![usize::MAX; n];
    for i in 0..n {
        if !link(i) {
            continue;
        }
        let mut c = usize::from(!spreads(i));
        for &a in &g.nodes[i].args {
            if link(a) {
                c = c.saturating_add(chain[a]);
            }
        }
        chain[i] = c;
    }
    // A node of a copied chain: one more reader of it would make its kernel store it.
    let in_chain = |i: NodeId| chain[i] <= MAX_CHAIN && !kept[i];
    // Bytes a copy of `i` loads: the full-size stored values at its chain's leaves, each once
    // (a broadcast value, a mean or a bias, is read from cache and counts nothing).
    let stored = |mut a: NodeId, numel: usize| {
        while matches!(g.nodes[a].op, NodeOp::Prim(Op::Expand(_))) {
            a = g.nodes[a].args[0];
        }
        if g.nodes[a].numel() == numel {
            numel * g.nodes[a].dtype.size_in_bytes()
        } else {
            0
        }
    };
    let leaf_bytes = |i: NodeId| {
        let (mut seen, mut todo, mut bytes) = (vec![], vec![i], 0usize);
        while let Some(x) = todo.pop() {
            for &a in &g.nodes[x].args {
                if seen.contains(&a) {
                    continue;
                }
                seen.push(a);
                if in_chain(a) {
                    todo.push(a);
                } else {
                    bytes += stored(a, g.nodes[i].numel());
                }
            }
        }
        bytes
    };
    // Decided once per node: every reader's arguments ask again.
    let copied: Vec<bool> = (0..n)
        .map(|i| in_chain(i) && readers[i].len() >= 2 && readers[i].iter().all(|&r| fusable_reader(r)) && leaf_bytes(i) <= g.nodes[i].numel() * g.nodes[i].dtype.size_in_bytes())
        .collect();
    if !copied.contains(&true) {
        return g.clone();
    }
    let mut out = Graph { n_args: 0, n_captured: 0, ..Default::default() };
    let mut map: Vec<NodeId> = vec![usize::MAX; n];
    for i in 0..n {
        let node = &g.nodes[i];
        // Copies made for this reader, so that a chain it reads twice is copied once.
        let mut mine: Vec<(NodeId, NodeId)> = vec![];
        let args: Vec<NodeId> = node.args.iter().map(|&a| if copied[a] && readers[a][0] != i { copy(g, &mut out, &map, &in_chain, &mut mine, a) } else { map[a] }).collect();
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

    /// A layer norm's row statistics spread over the rows, read by its own kernel and by one
    /// after a product (as the backward reads them): each reader gets its own broadcast, so no
    /// kernel stores one at full size; the row kernel stores the row values, and the later
    /// kernel loads them once per row. Without the pass, the row kernel stores the spread mean.
    #[test]
    fn row_statistics_spread_over_their_rows_are_never_stored_at_full_size() {
        let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let mean = xs[0].mean(&[1], true)?;
            let centered = xs[0].sub(&mean)?;
            let h = centered.matmul(&xs[1])?;
            Ok(vec![h.sub(&mean)?.relu()?.sum(&[1], false)?])
        };
        let args = [Tensor::randn(&[64, 32], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[32, 32], DType::F32, &Device::Cpu).unwrap()];
        let g = simplify::simplify(&fuse::tests::graph_of(&args, f));
        let spread_stored = |s: &fuse::Schedule| s.kernels.iter().any(|k| k.outputs.iter().any(|(o, _)| k.ops[*o].kind == crate::kir::KKind::Broadcast && !k.ops[*o].row));
        assert!(spread_stored(&fuse::schedule(&g)));
        let s = fuse::schedule(&recompute_cheap(&g));
        assert!(!spread_stored(&s), "{:?}", s.kernels.iter().map(|k| k.describe().to_string()).collect::<Vec<_>>());
        let last = s.kernels.last().expect("the sum's row kernel");
        assert!(last.inputs.iter().any(|i| i.row), "{}", last.describe());
    }

    /// The sum of two full-size values read by two kernels apart (an embedding's token and
    /// position rows, read by the first block's layer norm and by its residual): a copy per
    /// reader would load both values in each, more than loading the sum once, so it is stored.
    #[test]
    fn a_sum_of_two_stored_values_is_not_copied_per_reader() {
        let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let h = xs[0].add(&xs[1])?;
            let y = h.relu()?.matmul(&xs[2])?;
            Ok(vec![y.add(&h)?.exp()?])
        };
        let args = [Tensor::randn(&[64, 32], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[64, 32], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[32, 32], DType::F32, &Device::Cpu).unwrap()];
        let g = simplify::simplify(&fuse::tests::graph_of(&args, f));
        let adds = |g: &Graph| g.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Binary(crate::ops::BinaryOp::Add, _)))).count();
        assert_eq!(adds(&recompute_cheap(&g)), adds(&g), "{}", recompute_cheap(&g));
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
