//! Transposes: a swap of a value's last two dims is free for a matrix product, which reads an
//! operand in either order (cuBLAS's and the CPU's operand transposes), and costs a strided pass
//! anywhere else. So work between a transpose and the products that read it (autocast's cast
//! of a tied weight's `W.t()`, the padding that aligns it) is done in the stored order and the
//! transpose stays a view for the product; and a product whose result is only read transposed
//! (that weight's gradient, `(h^T g)^T`) is computed as `g^T h`, in the order its readers want.

use super::graph::{Graph, NodeId, NodeOp};
use crate::ops::Op;
use std::collections::HashMap;

/// Whether `perm` swaps the last two dims and keeps the others.
pub(crate) fn is_swap(perm: &[usize]) -> bool {
    let k = perm.len();
    k >= 2 && perm[k - 2] == k - 1 && perm[k - 1] == k - 2 && perm[..k - 2].iter().enumerate().all(|(i, &d)| i == d)
}

fn swapped<T: Clone>(shape: &[T]) -> Vec<T> {
    let mut s = shape.to_vec();
    let k = s.len();
    s.swap(k - 2, k - 1);
    s
}

/// The dim of a value that is dim `d` of its transpose.
fn swapped_dim(d: usize, rank: usize) -> usize {
    match d {
        _ if d + 2 == rank => rank - 1,
        _ if d + 1 == rank => rank - 2,
        _ => d,
    }
}

/// `op` over the transpose of its operand, as the op over the operand itself: elementwise ops
/// as they are, a reshape that keeps the last two dims, padding and slicing on the swapped dims.
/// `None` for any other op (or a reshape that moves the last two dims).
fn over_stored(op: &Op, in_shape: &[usize]) -> Option<Op> {
    let rank = in_shape.len();
    match op {
        Op::Cast(_) | Op::Unary(_) => Some(op.clone()),
        Op::Reshape(s) if rank >= 2 && s.len() >= 2 && in_shape[rank - 2..] == s[s.len() - 2..] => Some(Op::Reshape(swapped(s))),
        Op::Pad(pads, v) => Some(Op::Pad(swapped(pads), *v)),
        Op::Slice { dim, start, len, step } => Some(Op::Slice { dim: swapped_dim(*dim, rank), start: *start, len: *len, step: *step }),
        _ => None,
    }
}

/// How the rewritten graph holds an original node: as itself, or as the node it is the transpose of.
#[derive(Clone, Copy)]
enum Form {
    Plain(NodeId),
    Swapped(NodeId),
}

/// `g` with each value computed in the order its readers want (see the module's text); the
/// nodes it replaces are left dead for `simplify` to drop.
pub(crate) fn transposes(g: &Graph) -> Graph {
    let n = g.nodes.len();
    let readers = g.readers();
    let kept = g.kept();
    let swap_of = |i: NodeId| matches!(&g.nodes[i].op, NodeOp::Prim(Op::Permute(p)) if is_swap(p));
    let movable = |i: NodeId| match &g.nodes[i].op {
        NodeOp::Prim(op) => g.nodes[i].shape.len() >= 2 && over_stored(op, &g.nodes[g.nodes[i].args[0]].shape).is_some(),
        _ => false,
    };
    // Readers decide, from the last node back, which order each value is wanted in: a product
    // takes either (`None`), a transpose the opposite of what its own readers want, an op that
    // can run in either order what its readers want, and anything else (an output too) the
    // value as it is (`Some(false)`); readers that disagree get it as it is.
    let mut want: Vec<Option<bool>> = vec![None; n];
    for i in (0..n).rev() {
        let mut w = kept[i].then_some(false);
        for &r in &readers[i] {
            let wr = match &g.nodes[r].op {
                NodeOp::Prim(Op::Matmul) => None,
                _ if swap_of(r) => want[r].map(|s| !s),
                _ if movable(r) => want[r],
                _ => Some(false),
            };
            w = match (w, wr) {
                (None, x) | (x, None) => x,
                (Some(a), Some(b)) if a == b => Some(a),
                _ => Some(false),
            };
        }
        want[i] = w;
    }
    let mut r = Rewrite { out: Graph::default(), forms: Vec::with_capacity(n), plain_views: HashMap::new() };
    for (i, node) in g.nodes.iter().enumerate() {
        let form = match &node.op {
            NodeOp::Prim(Op::Permute(p)) if is_swap(p) => match r.forms[node.args[0]] {
                Form::Plain(id) => Form::Swapped(id),
                Form::Swapped(id) => Form::Plain(id),
            },
            NodeOp::Prim(Op::Matmul) if want[i] == Some(true) && g.nodes[node.args[0]].shape[0] == g.nodes[node.args[1]].shape[0] => {
                // (a b)^T = b^T a^T, the operands' transposes being views (or stored values).
                let (bt, at) = (r.stored(node.args[1]), r.stored(node.args[0]));
                Form::Swapped(r.out.push(node.op.clone(), vec![bt, at], swapped(&node.shape), node.dtype, node.device))
            }
            NodeOp::Prim(op) if movable(i) && want[i] != Some(false) && matches!(r.forms[node.args[0]], Form::Swapped(_)) => {
                let Form::Swapped(src) = r.forms[node.args[0]] else { unreachable!("matched above") };
                let op = over_stored(op, &g.nodes[node.args[0]].shape).expect("movable");
                Form::Swapped(r.out.push(NodeOp::Prim(op), vec![src], swapped(&node.shape), node.dtype, node.device))
            }
            _ => {
                let args = node.args.iter().map(|&a| r.plain(a)).collect();
                Form::Plain(r.out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device))
            }
        };
        r.forms.push(form);
    }
    let outputs = g.outputs.iter().map(|&o| r.plain(o)).collect();
    let mutations = g.mutations.iter().map(|&(k, v)| (k, r.plain(v))).collect();
    Graph { outputs, mutations, ..r.out }
}

struct Rewrite {
    out: Graph,
    /// Per original node, how the rewritten graph holds it.
    forms: Vec<Form>,
    /// Per original node held swapped, its plain view (made once).
    plain_views: HashMap<NodeId, NodeId>,
}

impl Rewrite {
    /// Original node `a` as a node of its own shape: a transposed view where it is held swapped.
    fn plain(&mut self, a: NodeId) -> NodeId {
        match self.forms[a] {
            Form::Plain(id) => id,
            Form::Swapped(id) => match self.plain_views.get(&a) {
                Some(&v) => v,
                None => {
                    let v = self.swap(id);
                    self.plain_views.insert(a, v);
                    v
                }
            },
        }
    }

    /// The transpose of original node `a`: what it is held as when swapped, else a view.
    fn stored(&mut self, a: NodeId) -> NodeId {
        match self.forms[a] {
            Form::Swapped(id) => id,
            Form::Plain(_) => {
                let p = self.plain(a);
                self.swap(p)
            }
        }
    }

    /// A transposed view of rewritten node `id`.
    fn swap(&mut self, id: NodeId) -> NodeId {
        let s = &self.out.nodes[id];
        let (shape, dtype, device) = (swapped(&s.shape), s.dtype, s.device);
        let perm = swapped(&(0..s.shape.len()).collect::<Vec<_>>());
        self.out.push(NodeOp::Prim(Op::Permute(perm)), vec![id], shape, dtype, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Device, Tensor};

    /// A tied embedding's two products: the logits `h @ W^T` with `W^T` cast (and padded, as
    /// the GPU aligns it) on the way, and the weight's gradient `(h^T g)^T` cast back and added
    /// to the embedding's. Rewritten, the cast and the padding read `W` in its stored order,
    /// the gradient is the product `g^T h` in `W`'s layout, and no transpose is left in front
    /// of anything but a product; a product transposed twice stays as it is. The values are the
    /// same.
    #[test]
    fn transposes_are_left_to_the_products_that_read_them() {
        let cpu = Device::Cpu;
        let r = |s: &[usize]| Tensor::randn(s, DType::F32, &cpu).unwrap();
        let (w, h, g, emb) = (r(&[13, 6]), r(&[5, 6]), r(&[5, 16]), r(&[13, 6]));
        let f = |xs: &[Tensor]| {
            let (w, h, g, emb) = (&xs[0], &xs[1], &xs[2], &xs[3]);
            let wt = w.t()?.to_dtype(DType::BF16)?.pad(&[0, 3], 0.0)?;
            let logits = h.to_dtype(DType::BF16)?.matmul(&wt)?;
            let dw = h.to_dtype(DType::BF16)?.t()?.matmul(&g.to_dtype(DType::BF16)?)?.narrow(1, 0, 13)?.to_dtype(DType::F32)?.t()?;
            // Transposed twice, a product is wanted as it is.
            let twice = h.t()?.matmul(g)?.t()?.exp()?.t()?;
            Ok(vec![logits, dw.add(emb)?, twice])
        };
        let args = [w, h, g, emb];
        let before = crate::compile::simplify::simplify(&crate::compile::fuse::tests::host_graph_of(&args, f));
        let after = crate::compile::simplify::simplify(&transposes(&before));
        for (i, n) in after.nodes.iter().enumerate() {
            if let NodeOp::Prim(Op::Permute(_)) = n.op {
                for (j, m) in after.nodes.iter().enumerate() {
                    assert!(!m.args.contains(&i) || matches!(m.op, NodeOp::Prim(Op::Matmul)), "%{j} reads the transpose %{i}:\n{after}");
                }
            }
        }
        assert!(after.outputs.iter().all(|&o| !matches!(after.nodes[o].op, NodeOp::Prim(Op::Permute(_)))), "{after}");
        let products: Vec<&Vec<usize>> = after.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Matmul))).map(|n| &n.shape).collect();
        assert_eq!(products, [&vec![1, 5, 16], &vec![1, 16, 6], &vec![1, 6, 16]], "{after}");
        let run = |graph: &Graph| graph.eager_runner().run(&args).unwrap();
        for (x, y) in run(&before).iter().zip(run(&after)) {
            assert_eq!(x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), y.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap());
        }
    }
}
