//! Concatenations gathered: a concatenation is one copy of its operands into a fresh buffer,
//! and its operands may be any views. So a permute of a concatenation becomes a concatenation
//! of permuted views, a concatenation along the last dim of values reshaped into it becomes
//! one over their own dims (no copy to reshape them first), and a concatenation of a
//! concatenation along the same dim becomes one. Attention's q, k and v gradients, each in
//! the attention's own `[L, B, H, D]` order, then meet in the `[B, L, 3 * H * D]` gradient of
//! their projection in one concatenation instead of going through four copies. A
//! concatenation of views that already lie one after the other in one value, in its own
//! order (a batch-first attention's gradients side by side), is a view of that value: no copy
//! (unless the caller sees it: a returned value never shares storage with another).

use super::graph::{Graph, Node, NodeId, NodeOp};
use crate::layout::Layout;
use crate::ops::Op;
use std::collections::HashSet;

/// `g` with its concatenations gathered (see the module's text); the nodes it replaces are
/// left dead for `simplify` to drop.
pub(crate) fn gather(g: &Graph) -> Graph {
    let users = g.users();
    let seen = g.seen_by_caller();
    let mut r = Rewrite { out: Graph::default(), map: Vec::with_capacity(g.nodes.len()), absorbable: HashSet::new(), may_view: true };
    for (i, node) in g.nodes.iter().enumerate() {
        let args: Vec<NodeId> = node.args.iter().map(|&a| r.map[a]).collect();
        // A returned concatenation stays a value of its own: as a view it could share storage
        // with another returned value, which eager code never does.
        r.may_view = !seen[i];
        let id = match &node.op {
            NodeOp::Prim(Op::Permute(perm)) if r.cat_dim(args[0]).is_some() && users[node.args[0]] == 1 => {
                let d = r.cat_dim(args[0]).expect("matched");
                let operands: Vec<NodeId> = r.out.nodes[args[0]].args.clone();
                let permuted: Vec<NodeId> = operands.iter().map(|&x| r.view(Op::Permute(perm.clone()), x, perm.iter().map(|&p| r.out.nodes[x].shape[p]).collect())).collect();
                let at = perm.iter().position(|&p| p == d).expect("a permutation");
                let operands = permuted.into_iter().map(|x| (x, false)).collect();
                r.cat(at, operands, node.shape.clone(), users[i] == 1)
            }
            NodeOp::Prim(Op::Cat(d)) if *d + 1 == node.shape.len() => match r.last_dim_cat(g, &node.args, &users, *d, &node.shape) {
                Some(id) => id,
                None => r.tiled(*d, &args, &node.shape).unwrap_or_else(|| r.push(node.op.clone(), args, node)),
            },
            NodeOp::Prim(Op::Cat(d)) => r.tiled(*d, &args, &node.shape).unwrap_or_else(|| r.push(node.op.clone(), args, node)),
            NodeOp::Prim(Op::Binary(crate::ops::BinaryOp::Add, _)) => match padded_parts(g, i, &users) {
                Some((d, parts)) => {
                    let operands = parts.iter().map(|&p| (r.map[p], users[p] == 1)).collect();
                    r.cat(d, operands, node.shape.clone(), users[i] == 1)
                }
                None => r.push(node.op.clone(), args, node),
            },
            _ => r.push(node.op.clone(), args, node),
        };
        r.map.push(id);
    }
    let outputs = g.outputs.iter().map(|&o| r.map[o]).collect();
    let mutations = g.mutations.iter().map(|&(k, v)| (k, r.map[v])).collect();
    Graph { outputs, mutations, ..r.out }
}

/// Where sum `i` adds zero paddings of values along one dim that together tile it (the
/// gradients of a split into three or more `narrow`s, as `qkv.split(E, 2)`; two are a
/// concatenation after `simplify` already), through sums read only there: that dim and the
/// values in order.
fn padded_parts(g: &Graph, i: NodeId, users: &[usize]) -> Option<(usize, Vec<NodeId>)> {
    let node = &g.nodes[i];
    let (mut leaves, mut stack) = (vec![], vec![i]);
    while let Some(x) = stack.pop() {
        let n = &g.nodes[x];
        match &n.op {
            NodeOp::Prim(Op::Binary(crate::ops::BinaryOp::Add, _)) if n.dtype == node.dtype && n.shape == node.shape && (x == i || users[x] == 1) => stack.extend(n.args.iter().copied()),
            NodeOp::Prim(Op::Pad(p, v)) if *v == 0.0 && n.dtype == node.dtype && n.shape == node.shape => leaves.push((x, p.clone())),
            _ => return None,
        }
    }
    let d = leaves[0].1.iter().position(|&p| p != (0, 0))?;
    if leaves.len() < 3 || leaves.iter().any(|(_, p)| p.iter().enumerate().any(|(e, &q)| e != d && q != (0, 0))) {
        return None;
    }
    leaves.sort_by_key(|(_, p)| p[d].0);
    let mut at = 0;
    for (x, p) in &leaves {
        let len = g.nodes[g.nodes[*x].args[0]].shape[d];
        if p[d].0 != at {
            return None;
        }
        at += len;
    }
    if at != node.shape[d] {
        return None;
    }
    Some((d, leaves.iter().map(|(x, _)| g.nodes[*x].args[0]).collect()))
}

struct Rewrite {
    out: Graph,
    /// Per original node, its node in `out`.
    map: Vec<NodeId>,
    /// Concatenations of `out` nothing but their one reader reads, which a concatenation
    /// reading them may take apart.
    absorbable: HashSet<NodeId>,
    /// Whether the node being rewritten may become a view (`tiled`).
    may_view: bool,
}

impl Rewrite {
    fn push(&mut self, op: NodeOp, args: Vec<NodeId>, like: &Node) -> NodeId {
        self.out.push(op, args, like.shape.clone(), like.dtype, like.device)
    }

    fn view(&mut self, op: Op, x: NodeId, shape: Vec<usize>) -> NodeId {
        if self.out.nodes[x].shape == shape && !matches!(op, Op::Permute(_)) {
            return x;
        }
        let (dtype, device) = (self.out.nodes[x].dtype, self.out.nodes[x].device);
        self.out.push(NodeOp::Prim(op), vec![x], shape, dtype, device)
    }

    fn cat_dim(&self, x: NodeId) -> Option<usize> {
        match self.out.nodes[x].op {
            NodeOp::Prim(Op::Cat(d)) => Some(d),
            _ => None,
        }
    }

    /// A concatenation along `d` of `operands`, taking apart those that are themselves
    /// concatenations along `d` read only here (marked so, and absorbable).
    fn cat(&mut self, d: usize, operands: Vec<(NodeId, bool)>, shape: Vec<usize>, absorbable: bool) -> NodeId {
        let mut flat = vec![];
        for (x, only_here) in operands {
            if only_here && self.cat_dim(x) == Some(d) && self.absorbable.contains(&x) {
                flat.extend(self.out.nodes[x].args.clone());
            } else {
                flat.push(x);
            }
        }
        if let Some(id) = self.tiled(d, &flat, &shape) {
            return id;
        }
        let (dtype, device) = (self.out.nodes[flat[0]].dtype, self.out.nodes[flat[0]].device);
        let id = self.out.push(NodeOp::Prim(Op::Cat(d)), flat, shape, dtype, device);
        if absorbable {
            self.absorbable.insert(id);
        }
        id
    }

    /// The concatenation along `d` of `operands` (nodes of `out`) as a view, where they are
    /// views of one value lying in it one after the other in the concatenation's own order:
    /// together a contiguous run of it. None otherwise.
    fn tiled(&mut self, d: usize, operands: &[NodeId], shape: &[usize]) -> Option<NodeId> {
        if !self.may_view {
            return None;
        }
        let views: Vec<(NodeId, Layout)> = operands.iter().map(|&x| self.view_layout(x)).collect::<Option<_>>()?;
        let (base, first) = (views[0].0, views[0].1.offset);
        // Never a view of an input: the caller's tensor (or one the program writes in place)
        // would then alias the concatenation, a value of its own.
        if matches!(self.out.nodes[base].op, NodeOp::Arg(_) | NodeOp::Captured(_)) {
            return None;
        }
        let dense = Layout::contiguous(shape);
        let mut start = 0;
        for (b, view) in &views {
            let in_order = view.shape.iter().zip(&view.strides).zip(&dense.strides).all(|((&n, &st), &want)| n <= 1 || st == want);
            if *b != base || !in_order || view.offset != first + start * dense.strides[d] {
                return None;
            }
            start += view.shape[d];
        }
        let whole = self.out.nodes[base].numel();
        let flat = self.view(Op::Reshape(vec![whole]), base, vec![whole]);
        let numel = dense.numel();
        let run = if first == 0 && numel == whole { flat } else { self.view(Op::Slice { dim: 0, start: first, len: numel, step: 1 }, flat, vec![numel]) };
        Some(self.view(Op::Reshape(shape.to_vec()), run, shape.to_vec()))
    }

    /// The value `x` of `out` is a view of, and where in it `x` lies (that value seen as
    /// contiguous): through reshapes that are views, permutes and slices. None for a broadcast.
    fn view_layout(&self, x: NodeId) -> Option<(NodeId, Layout)> {
        let n = &self.out.nodes[x];
        let own = Some((x, Layout::contiguous(&n.shape)));
        let NodeOp::Prim(op) = &n.op else { return own };
        match op {
            Op::Reshape(shape) => {
                let (b, l) = self.view_layout(n.args[0])?;
                match l.view_strides(shape) {
                    Some(strides) => Some((b, Layout { shape: shape.clone(), strides, offset: l.offset })),
                    None => own,
                }
            }
            Op::Permute(perm) => self.view_layout(n.args[0]).map(|(b, l)| (b, l.permuted(perm))),
            Op::Slice { dim, start, len, step } => self.view_layout(n.args[0]).map(|(b, l)| (b, l.sliced(*dim, *start, *len, *step))),
            Op::Expand(_) => None,
            _ => own,
        }
    }

    /// A concatenation along the last dim `d` of values reshaped into it (original operands
    /// `args`), as one over their own dims: each operand's dims past `d` (its tail) end in a
    /// common suffix, after one leading dim of its own (or none: then 1), so the operands meet
    /// along that leading dim and the result is a reshape of it. None when the operands do not
    /// fit, or none of them is reshaped from more dims.
    fn last_dim_cat(&mut self, g: &Graph, args: &[NodeId], users: &[usize], d: usize, shape: &[usize]) -> Option<NodeId> {
        // Each operand's source: what it reshapes, or itself.
        let sources: Vec<NodeId> = args
            .iter()
            .map(|&a| match &g.nodes[a].op {
                NodeOp::Prim(Op::Reshape(_)) => self.map[g.nodes[a].args[0]],
                _ => self.map[a],
            })
            .collect();
        let prefix = &shape[..d];
        let tails: Vec<Vec<usize>> = sources.iter().map(|&s| self.out.nodes[s].shape.clone()).map(|s| if s.len() > d && s[..d] == *prefix { s[d..].to_vec() } else { vec![] }).collect();
        if tails.iter().any(|t| t.is_empty()) {
            return None;
        }
        let longest = tails.iter().max_by_key(|t| t.len()).expect("operands");
        if longest.len() < 2 {
            return None;
        }
        let common = &longest[1..];
        let per = common.iter().product::<usize>();
        // A tail of one dim is a contiguous run of the common suffix (a reshape, not a copy).
        let lead: Vec<usize> = tails
            .iter()
            .map(|t| match t.len() {
                n if n == common.len() && t[..] == *common => Some(1),
                n if n == common.len() + 1 && t[1..] == *common => Some(t[0]),
                1 if per > 0 && t[0] % per == 0 => Some(t[0] / per),
                _ => None,
            })
            .collect::<Option<_>>()?;
        let mut operands = vec![];
        for ((&s, &k), &a) in sources.iter().zip(&lead).zip(args) {
            let mut want = prefix.to_vec();
            want.push(k);
            want.extend_from_slice(common);
            let only_here = users[a] == 1;
            operands.push((self.view(Op::Reshape(want.clone()), s, want), only_here));
        }
        let mut joined = prefix.to_vec();
        joined.push(lead.iter().sum());
        joined.extend_from_slice(common);
        let cat = self.cat(d, operands, joined, false);
        Some(self.view(Op::Reshape(shape.to_vec()), cat, shape.to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Device, Tensor};

    /// Attention's backward as GPT-2's projection wants it: q's gradient and the concatenated
    /// k and v gradients (each `[L, B, H, D]`), permuted to `[B, L, ..]` and reshaped, then
    /// concatenated along the features. Gathered, it is one concatenation of the three
    /// gradients' views, reshaped; the values are the same.
    #[test]
    fn concatenations_of_reshaped_and_permuted_values_are_one() {
        let r = |s: &[usize]| Tensor::randn(s, DType::F32, &Device::Cpu).unwrap();
        let (l, b, h, d) = (5, 2, 3, 4);
        let args = [r(&[l, b, h, d]), r(&[l, b, h, d]), r(&[l, b, h, d])];
        let f = move |xs: &[Tensor]| {
            let bhld = |x: &Tensor| x.permute(&[1, 2, 0, 3])?.unsqueeze(0);
            let kv = crate::ops::movement::cat(&[&bhld(&xs[1])?, &bhld(&xs[2])?], 0)?.permute(&[1, 3, 0, 2, 4])?.reshape(&[b as i64, l as i64, (2 * h * d) as i64])?;
            let q = xs[0].permute(&[1, 0, 2, 3])?.reshape(&[b as i64, l as i64, (h * d) as i64])?;
            Ok(vec![crate::ops::movement::cat(&[&q, &kv], 2)?])
        };
        let before = crate::compile::simplify::simplify(&crate::compile::fuse::tests::host_graph_of(&args, f));
        let after = crate::compile::simplify::simplify(&gather(&before));
        let cats: Vec<(usize, &Vec<usize>)> = after.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))).map(|n| (n.args.len(), &n.shape)).collect();
        assert_eq!(cats, [(3, &vec![b, l, 3, h, d])], "{after}");
        let run = |graph: &Graph| graph.eager_runner().run(&args).unwrap()[0].to_vec::<f32>().unwrap();
        assert_eq!(run(&before), run(&after));
    }

    /// Views of one value concatenated where they already lie one after the other in it (a
    /// batch-first attention's gradients side by side, `[B, L, 3, H, D]`, permuted away and
    /// back as a model does) become a view of it; in another order they stay a concatenation.
    /// The values are the same.
    #[test]
    fn concatenations_of_views_lying_in_order_are_views() {
        let (b, l, h, d) = (2, 3, 2, 4);
        let packed = Tensor::randn(&[b * l * 3 * h * d + 5], DType::F32, &Device::Cpu).unwrap();
        for order in [[0, 1, 2], [1, 0, 2]] {
            let f = move |xs: &[Tensor]| {
                let side_by_side = xs[0].mul_scalar(2.0)?.narrow(0, 0, b * l * 3 * h * d)?.reshape_usize(&[b, l, 3, h, d])?;
                let part = |i: usize| side_by_side.narrow(2, i, 1)?.reshape_usize(&[b, l, h, d])?.permute(&[0, 2, 1, 3])?.permute(&[0, 2, 1, 3])?.reshape_usize(&[b, l, h * d]);
                let parts = order.map(|i| part(i).unwrap());
                Ok(vec![crate::ops::movement::cat(&[&parts[0], &parts[1], &parts[2]], 2)?.add_scalar(1.0)?])
            };
            let args = [packed.clone()];
            let before = crate::compile::simplify::simplify(&crate::compile::fuse::tests::host_graph_of(&args, f));
            let after = crate::compile::simplify::simplify(&gather(&before));
            let cats = after.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))).count();
            assert_eq!(cats, usize::from(order != [0, 1, 2]), "{after}");
            // Views of the argument itself stay a concatenation (a value of its own).
            let of_arg = move |xs: &[Tensor]| Ok(vec![crate::ops::movement::cat(&[&xs[0].narrow(0, 0, 4)?, &xs[0].narrow(0, 4, 6)?], 0)?]);
            let g = gather(&crate::compile::fuse::tests::host_graph_of(&args, of_arg));
            assert!(g.nodes.iter().any(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))), "{g}");
            // A returned concatenation stays one: as a view it would share storage with the
            // value it views, returned too.
            let returned = move |xs: &[Tensor]| {
                let whole = xs[0].mul_scalar(2.0)?;
                Ok(vec![crate::ops::movement::cat(&[&whole.narrow(0, 0, 4)?, &whole.narrow(0, 4, 6)?], 0)?, whole])
            };
            let g = gather(&crate::compile::fuse::tests::host_graph_of(&args, returned));
            assert!(g.nodes.iter().any(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))), "{g}");
            let run = |graph: &Graph| graph.eager_runner().run(&args).unwrap()[0].to_vec::<f32>().unwrap();
            assert_eq!(run(&before), run(&after));
        }
    }

    /// The gradient of a split into three (`narrow`s of one value, as `qkv.split(E, 2)`): zero
    /// paddings that tile their sum, in any order, added two at a time. Gathered, it is one
    /// concatenation of the three values; the values are the same.
    #[test]
    fn a_sum_of_three_paddings_that_tile_it_is_one_concatenation() {
        let r = |s: &[usize]| Tensor::randn(s, DType::F32, &Device::Cpu).unwrap();
        let args = [r(&[2, 3]), r(&[2, 4]), r(&[2, 5])];
        let f = |xs: &[Tensor]| Ok(vec![xs[2].pad(&[7, 0], 0.0)?.add(&xs[0].pad(&[0, 9], 0.0)?)?.add(&xs[1].pad(&[3, 5], 0.0)?)?]);
        let before = crate::compile::simplify::simplify(&crate::compile::fuse::tests::host_graph_of(&args, f));
        let after = crate::compile::simplify::simplify(&gather(&before));
        let cats: Vec<usize> = after.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))).map(|n| n.args.len()).collect();
        assert_eq!(cats, [3], "{after}");
        assert!(!after.nodes.iter().any(|n| matches!(n.op, NodeOp::Prim(Op::Pad(..)))), "{after}");
        // Three paddings that leave the end of the dim empty are no concatenation of theirs.
        let short = |xs: &[Tensor]| Ok(vec![xs[2].pad(&[7, 1], 0.0)?.add(&xs[0].pad(&[0, 10], 0.0)?)?.add(&xs[1].pad(&[3, 6], 0.0)?)?]);
        let g = gather(&crate::compile::simplify::simplify(&crate::compile::fuse::tests::host_graph_of(&args, short)));
        assert!(!g.nodes.iter().any(|n| matches!(n.op, NodeOp::Prim(Op::Cat(_)))), "{g}");
        let run = |graph: &Graph| graph.eager_runner().run(&args).unwrap()[0].to_vec::<f32>().unwrap();
        assert_eq!(run(&before), run(&after));
    }
}
