//! Horizontal merging of products: matmuls of one input by several parameter-only matrices
//! become one matmul by their concatenation, and each result a column slice of it (a view).
//! A decoder's cross-attention projects the same encoder output in every layer: six small
//! GEMMs become one of six times the width, which fills the GPU better and launches once. The
//! concatenated weight reads only captured tensors, so the runtime computes it once and keeps
//! it (`runtime::Hoisted`). A bias added after every product (the cuBLASLt epilogue's pattern)
//! is concatenated too, so the merged product keeps its epilogue.
//!
//! A merged result holds every member's columns from the first member's product until the
//! last one's last reader: where the members are read far apart (each decoder layer reads its
//! own slice), that can raise the program's peak memory by most of the merged bytes. A group
//! is merged only where it does not raise the peak of live values in node order
//! (`LiveBytes`).

use super::graph::{Graph, Node, NodeId, NodeOp};
use crate::ops::{BinaryOp, Op};

/// One product of a group: its matmul, and (the bias add, the bias vector) after it when
/// there is one.
#[derive(Clone, Debug)]
struct Member {
    matmul: NodeId,
    bias: Option<(NodeId, NodeId)>,
}

impl Member {
    /// The node whose value the merged product replaces.
    fn result(&self) -> NodeId {
        self.bias.map(|b| b.0).unwrap_or(self.matmul)
    }
}

/// The graph with every group of two or more mergeable products merged; the graph itself when
/// there is none.
pub(crate) fn merge_products(g: &Graph) -> Graph {
    let groups = groups(g);
    let groups = if groups.is_empty() { groups } else { LiveBytes::of(g).keep_peak(g, groups) };
    if groups.is_empty() {
        return g.clone();
    }
    let mut b = Rebuild { g, out: Graph::default(), map: vec![None; g.nodes.len()], replaced: vec![None; g.nodes.len()], merged: vec![None; groups.len()] };
    for (k, grp) in groups.iter().enumerate() {
        let mut off = 0;
        for m in grp {
            let n = g.nodes[m.matmul].shape[2];
            b.replaced[m.result()] = Some((k, off, n));
            off += n;
        }
    }
    // Inputs first, in their order: what a merge moves earlier never reorders them.
    for i in 0..g.nodes.len() {
        if matches!(g.nodes[i].op, NodeOp::Arg(_) | NodeOp::Captured(_)) {
            b.emit(i, &groups);
        }
    }
    for i in 0..g.nodes.len() {
        b.emit(i, &groups);
    }
    let map = |i: NodeId| b.map[i].expect("every node is emitted");
    b.out.outputs = g.outputs.iter().map(|&o| map(o)).collect();
    b.out.mutations = g.mutations.iter().map(|&(k, v)| (k, map(v))).collect();
    // The members' own products are dead now.
    super::simplify::simplify(&b.out)
}

/// Nodes computed from constants and captured tensors the graph does not write (what the
/// runtime computes once and keeps).
fn parameter_only(g: &Graph) -> Vec<bool> {
    let mut p = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        p[i] = match n.op {
            NodeOp::Captured(k) => !g.mutations.iter().any(|&(w, _)| w == k),
            NodeOp::Full(_) | NodeOp::Arange { .. } => true,
            NodeOp::Prim(_) => n.args.iter().all(|&a| p[a]),
            NodeOp::Arg(_) | NodeOp::Random(_) | NodeOp::Custom(_) | NodeOp::Collective(_) => false,
        };
    }
    p
}

/// Groups of products of one input (not itself parameter-only) by parameter-only matrices,
/// of one dtype and device, all with a bias add or all without. The bias add is the one the
/// library call's epilogue would take (`fuse::plan_gemm`), with a parameter-only vector.
fn groups(g: &Graph) -> Vec<Vec<Member>> {
    let params = parameter_only(g);
    let (users, readers) = (g.users(), g.readers());
    let mut found: Vec<((NodeId, bool), Vec<Member>)> = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if !matches!(n.op, NodeOp::Prim(Op::Matmul)) || n.shape.len() != 3 || n.shape[0] != 1 || !n.dtype.is_float() {
            continue;
        }
        let (lhs, rhs) = (n.args[0], n.args[1]);
        if params[lhs] || !params[rhs] {
            continue;
        }
        let (gemm, _) = super::fuse::plan_gemm(g, &readers, &users, i);
        // An activation that joins the epilogue stays where it is: merged, it would become a
        // kernel of its own.
        if gemm.act.is_some() {
            continue;
        }
        let bias = gemm.bias.map(|b| (gemm.out(), super::fuse::spread_vector(g, b))).filter(|&(_, v)| params[v] && g.nodes[v].dtype == n.dtype);
        let m = Member { matmul: i, bias };
        let key = (lhs, m.bias.is_some());
        match found.iter_mut().find(|(k, ms)| *k == key && same_kind(&g.nodes[ms[0].matmul], n)) {
            Some((_, ms)) => ms.push(m),
            None => found.push((key, vec![m])),
        }
    }
    found.into_iter().map(|(_, ms)| ms).filter(|ms| ms.len() > 1).collect()
}

/// Bytes of computed values alive at each node, the graph run in node order: a value holds
/// its storage from its node until the last reader of it or of a view of it (outputs and
/// written-back values to the end); inputs, views and parameter-only values (computed once and
/// kept by the runtime) hold none.
struct LiveBytes {
    live: Vec<i64>,
    /// Per node: the node whose storage it uses, and the last node that reads that storage.
    root: Vec<Option<NodeId>>,
    dies: Vec<NodeId>,
}

impl LiveBytes {
    fn of(g: &Graph) -> LiveBytes {
        let n = g.nodes.len();
        let params = parameter_only(g);
        let mut root: Vec<Option<NodeId>> = vec![None; n];
        for (i, node) in g.nodes.iter().enumerate() {
            root[i] = match &node.op {
                NodeOp::Arg(_) | NodeOp::Captured(_) => None,
                _ if params[i] => None,
                NodeOp::Prim(op) if op.is_view() => root[node.args[0]],
                _ => Some(i),
            };
        }
        let mut dies: Vec<NodeId> = (0..n).collect();
        for (j, node) in g.nodes.iter().enumerate() {
            for &a in &node.args {
                if let Some(r) = root[a] {
                    dies[r] = dies[r].max(j);
                }
            }
        }
        for &o in g.outputs.iter().chain(g.mutations.iter().map(|(_, v)| v)) {
            if let Some(r) = root[o] {
                dies[r] = n - 1;
            }
        }
        let mut live = vec![0i64; n + 1];
        for i in 0..n {
            if root[i] == Some(i) {
                live[i] += g.nodes[i].bytes() as i64;
                live[dies[i] + 1] -= g.nodes[i].bytes() as i64;
            }
        }
        for i in 1..=n {
            live[i] += live[i - 1];
        }
        live.truncate(n);
        LiveBytes { live, root, dies }
    }

    /// The groups whose merging keeps the peak where it is, taken in order, each judged with
    /// the ones before it merged.
    fn keep_peak(mut self, g: &Graph, groups: Vec<Vec<Member>>) -> Vec<Vec<Member>> {
        let peak = self.live.iter().copied().max().unwrap_or(0);
        let mut kept = vec![];
        for grp in groups {
            // Unmerged, each member's result holds its bytes from its product to its last
            // reader; merged, all of them from the first product to the last reader.
            let spans: Vec<(NodeId, NodeId, i64)> = grp
                .iter()
                .filter_map(|m| {
                    let r = self.root[m.result()]?;
                    Some((m.matmul, self.dies[r], g.nodes[m.result()].bytes() as i64))
                })
                .collect();
            let (Some(from), Some(to)) = (spans.iter().map(|s| s.0).min(), spans.iter().map(|s| s.1).max()) else { continue };
            let total: i64 = spans.iter().map(|s| s.2).sum();
            let mut delta = vec![0i64; self.live.len() + 1];
            delta[from] += total;
            delta[to + 1] -= total;
            for &(a, b, x) in &spans {
                delta[a] -= x;
                delta[b + 1] += x;
            }
            let mut run = 0;
            let after: Vec<i64> = self.live.iter().zip(&delta).map(|(l, d)| {
                run += d;
                l + run
            }).collect();
            if after.iter().copied().max().unwrap_or(0) <= peak {
                self.live = after;
                kept.push(grp);
            }
        }
        kept
    }
}

fn same_kind(a: &Node, b: &Node) -> bool {
    a.dtype == b.dtype && a.device == b.device && a.shape[1] == b.shape[1]
}

/// Rebuilds the graph node by node, emitting each merged product (and the parameter-only
/// nodes it reads, wherever they were) before its first member's result is needed.
struct Rebuild<'a> {
    g: &'a Graph,
    out: Graph,
    map: Vec<Option<NodeId>>,
    /// Per node replaced by a slice of a merged product: (group, first column, columns).
    replaced: Vec<Option<(usize, usize, usize)>>,
    /// Per group: its merged result `[1, M, sum N]`, once emitted.
    merged: Vec<Option<NodeId>>,
}

impl Rebuild<'_> {
    fn emit(&mut self, i: NodeId, groups: &[Vec<Member>]) -> NodeId {
        if let Some(m) = self.map[i] {
            return m;
        }
        let node = &self.g.nodes[i];
        let new = match self.replaced[i] {
            Some((k, start, len)) => {
                let whole = self.merged(k, groups);
                let rows = self.out.nodes[whole].shape[1];
                let s = self.out.push(NodeOp::Prim(Op::Slice { dim: 2, start, len, step: 1 }), vec![whole], vec![1, rows, len], node.dtype, node.device);
                if node.shape == [1, rows, len] {
                    s
                } else {
                    self.out.push(NodeOp::Prim(Op::Reshape(node.shape.clone())), vec![s], node.shape.clone(), node.dtype, node.device)
                }
            }
            None => {
                let args: Vec<NodeId> = node.args.iter().map(|&a| self.emit(a, groups)).collect();
                self.out.push(node.op.clone(), args, node.shape.clone(), node.dtype, node.device)
            }
        };
        self.map[i] = Some(new);
        new
    }

    /// Group k's product by the concatenated matrices, plus the concatenated bias.
    fn merged(&mut self, k: usize, groups: &[Vec<Member>]) -> NodeId {
        if let Some(m) = self.merged[k] {
            return m;
        }
        let ms = &groups[k];
        let first = &self.g.nodes[ms[0].matmul];
        let (dt, dev, rows, depth) = (first.dtype, first.device, first.shape[1], self.g.nodes[first.args[0]].shape[2]);
        let total: usize = ms.iter().map(|m| self.g.nodes[m.matmul].shape[2]).sum();
        let lhs = self.emit(first.args[0], groups);
        let rhs: Vec<NodeId> = ms.iter().map(|m| self.emit(self.g.nodes[m.matmul].args[1], groups)).collect();
        let w = self.out.push(NodeOp::Prim(Op::Cat(2)), rhs, vec![1, depth, total], dt, dev);
        let mut r = self.out.push(NodeOp::Prim(Op::Matmul), vec![lhs, w], vec![1, rows, total], dt, dev);
        if ms[0].bias.is_some() {
            let vs: Vec<NodeId> = ms
                .iter()
                .map(|m| {
                    let (_, v) = m.bias.expect("a group is all with bias or all without");
                    let v = self.emit(v, groups);
                    let n = self.out.nodes[v].numel();
                    self.out.push(NodeOp::Prim(Op::Reshape(vec![n])), vec![v], vec![n], dt, dev)
                })
                .collect();
            let cat = self.out.push(NodeOp::Prim(Op::Cat(0)), vs, vec![total], dt, dev);
            let row = self.out.push(NodeOp::Prim(Op::Reshape(vec![1, 1, total])), vec![cat], vec![1, 1, total], dt, dev);
            let spread = self.out.push(NodeOp::Prim(Op::Expand(vec![1, rows, total])), vec![row], vec![1, rows, total], dt, dev);
            r = self.out.push(NodeOp::Prim(Op::Binary(BinaryOp::Add, dt)), vec![r, spread], vec![1, rows, total], dt, dev);
        }
        self.merged[k] = Some(r);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{compile, compile_with, Backend, CompileOptions};
    use crate::nn::functional as F;
    use crate::{DType, Device, Tensor};
    use std::sync::{Arc, Mutex};

    fn products(g: &Graph) -> usize {
        g.nodes.iter().filter(|n| matches!(n.op, NodeOp::Prim(Op::Matmul))).count()
    }

    #[test]
    fn products_of_one_input_become_one() {
        let dev = Device::Cpu;
        let x = Tensor::randn(&[5, 3, 8], DType::F32, &dev).unwrap();
        let w = Tensor::randn(&[24, 8], DType::F32, &dev).unwrap();
        let bias = Tensor::randn(&[24], DType::F32, &dev).unwrap();
        let w2 = Tensor::randn(&[6, 8], DType::F32, &dev).unwrap();
        // Two projections with biases (rows of one weight, as attention's K and V), one with
        // its own weight, one whose ReLU joins its epilogue (left alone); all read together, so
        // merging raises no peak.
        let f = move |x: &Tensor| {
            crate::no_grad(|| {
                let k = F::linear(x, &w.narrow(0, 8, 8)?, Some(&bias.narrow(0, 8, 8)?))?;
                let v = F::linear(x, &w.narrow(0, 16, 8)?, Some(&bias.narrow(0, 16, 8)?))?;
                let u = F::linear(x, &w2, Some(&bias.narrow(0, 0, 6)?))?;
                let r = F::linear(x, &w.narrow(0, 0, 8)?, Some(&bias.narrow(0, 0, 8)?))?.relu()?;
                crate::cat(&[&k, &v, &u, &r], -1)
            })
        };
        let seen = Arc::new(Mutex::new(vec![]));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            let simple = crate::compile::simplify::simplify(g);
            let merged = merge_products(&simple);
            s2.lock().unwrap().push((products(&simple), products(&merged)));
            Ok(merged.eager_runner())
        });
        let expect = f(&x).unwrap();
        let got = compile_with(CompileOptions::new().backend(backend), f.clone()).call(&x).unwrap();
        assert_eq!(seen.lock().unwrap()[0], (4, 2), "three biased products merge; the ReLU one stays");
        let compiled = compile(f).call(&x).unwrap();
        for y in [got, compiled] {
            assert_eq!(y.shape(), expect.shape());
            // f32: a wider product may sum in another order (a few ulps).
            assert!(y.allclose(&expect, 1e-5, 1e-5).unwrap());
        }
    }

    #[test]
    fn products_read_far_apart_stay_apart_where_merging_would_raise_the_peak() {
        // Two products of x, each read once, with a larger value made and dropped between
        // them: merged, the first product's columns would still be held, together with the
        // second's, where the larger values peak.
        let dev = Device::Cpu;
        let x = Tensor::randn(&[256, 64], DType::F32, &dev).unwrap();
        let z = Tensor::randn(&[512, 512], DType::F32, &dev).unwrap();
        let (w1, w2) = (Tensor::randn(&[64, 256], DType::F32, &dev).unwrap(), Tensor::randn(&[64, 256], DType::F32, &dev).unwrap());
        let seen = Arc::new(Mutex::new(vec![]));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            let simple = crate::compile::simplify::simplify(g);
            s2.lock().unwrap().push((products(&simple), products(&merge_products(&simple))));
            Ok(g.eager_runner())
        });
        let (a, b) = (w1.clone(), w2.clone());
        let far = compile_with(CompileOptions::new().backend(backend.clone()), move |x: &Tensor, z: &Tensor| {
            crate::no_grad(|| {
                let s1 = x.matmul(&a)?.sum_all()?;
                let h = z.exp()?;
                let s1 = s1.add(&h.sum_all()?)?;
                let h2 = h.sin()?;
                let s2 = x.matmul(&b)?.sum_all()?.add(&h2.sum_all()?)?;
                s1.add(&s2)
            })
        });
        far.call(&x, &z).unwrap();
        // The same products read side by side merge.
        let near = compile_with(CompileOptions::new().backend(backend), move |x: &Tensor, z: &Tensor| {
            crate::no_grad(|| {
                let h = z.exp()?.sin()?.sum_all()?;
                h.add(&x.matmul(&w1)?.mul(&x.matmul(&w2)?)?.sum_all()?)
            })
        });
        near.call(&x, &z).unwrap();
        assert_eq!(seen.lock().unwrap()[..], [(2, 2), (2, 1)]);
    }

    #[test]
    fn products_of_written_parameters_stay_apart() {
        let dev = Device::Cpu;
        let x = Tensor::randn(&[4, 8], DType::F32, &dev).unwrap();
        let (a, b) = (Tensor::randn(&[8, 8], DType::F32, &dev).unwrap(), Tensor::randn(&[8, 8], DType::F32, &dev).unwrap());
        let seen = Arc::new(Mutex::new(vec![]));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            s2.lock().unwrap().push(products(&merge_products(&crate::compile::simplify::simplify(g))));
            Ok(g.eager_runner())
        });
        let f = compile_with(CompileOptions::new().backend(backend), move |x: &Tensor| {
            crate::no_grad(|| {
                let y = x.matmul(&a)?.add(&x.matmul(&b)?)?;
                if x.shape()[0] == 4 {
                    a.add_(&Tensor::ones(&[8, 8], DType::F32, &Device::Cpu)?)?;
                }
                Ok(y)
            })
        });
        f.call(&x).unwrap();
        f.call(&x.narrow(0, 0, 3).unwrap()).unwrap();
        assert_eq!(seen.lock().unwrap()[..], [2, 1], "a weight the call writes is not concatenated once and kept; the same products without the write merge");
    }
}
