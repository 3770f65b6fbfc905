//! Fusion: schedules a graph into steps. Pointwise nodes (with the reshapes between them) that
//! produce values of one element count fuse into one kernel; a reduction over trailing dims
//! fuses with the pointwise work before it (its prologue), after it (its epilogue, on the
//! reduced rows) and with the broadcasts of its result back over the rows, so softmax and
//! layer_norm are one kernel each. A matrix product on the GPU is a library call (`Gemm`) that
//! takes the bias add along the last dim (and a ReLU after it) into its epilogue when dtypes
//! allow (`plan_gemm`). Everything else (gather, cat, other reductions, views of stored values)
//! is a step of its own, run by the eager backend.
//!
//! Values in a fused kernel are indexed linearly: a pointwise value at element i, a row value
//! at row i / cols. That is why reshapes cost nothing inside a kernel.

use super::graph::{Graph, NodeId, NodeOp};
use crate::ops::matmul::Activation;
use crate::ops::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::kir::MAX_LOOPED_ROW;
use crate::kir::{FusedKernel, ValueRef, KInput, KKind, KOp, KernelMemo, Space};
use crate::DType;

/// One step of a compiled program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A node run by the eager backend (or an input, which needs nothing).
    Node(NodeId),
    Kernel(usize),
    /// A matrix product by the BLAS library, with its epilogue (`Schedule::gemms`).
    Gemm(usize),
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Schedule {
    pub steps: Vec<Step>,
    pub kernels: Vec<FusedKernel>,
    pub gemms: Vec<Gemm>,
    /// Why bias adds after products stayed kernels of their own (for `KILN_LOG=fusion`).
    pub notes: Vec<String>,
}

/// A matrix product run by the library (cuBLASLt), with the bias add and an activation after
/// it when they run in its epilogue: `act?(matmul + bias)` in one call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Gemm {
    pub matmul: NodeId,
    /// The add's other operand: a view spreading a vector of the product's column count over
    /// its rows.
    pub bias: Option<NodeId>,
    pub act: Option<Activation>,
    /// The nodes the step computes, in order (the product, reshapes of it, the add, reshapes of
    /// the sum, the activation); only the last is stored, the others are read by nothing else.
    pub nodes: Vec<NodeId>,
    /// The one-row kernel whose output is the product's row, run by the product's kernel
    /// (`row_prologues`).
    pub prologue: Option<RowPrologue>,
    /// The last node is the index of the largest of the product's one row of columns (a
    /// greedy decode step's next token, `with_argmax`): the kernel computes it, and the
    /// product's values are never stored.
    pub argmax: bool,
    /// A cache attention (`Op::AttentionUpTo`) whose query and new key and value rows are views
    /// of the product's value: the product's kernel runs it, at the attention's step
    /// (`cache_attentions`).
    pub attention: Option<NodeId>,
}

/// A one-row kernel of the schedule (`Schedule::kernels[kernel]`) whose output `output` a
/// product of one row reads as its row: the step runs it as its kernel's prologue, and the
/// kernel's own step only makes its output buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowPrologue {
    pub kernel: usize,
    pub output: usize,
}

impl Gemm {
    /// The node whose value the step produces.
    pub(crate) fn out(&self) -> NodeId {
        *self.nodes.last().expect("a product at least")
    }
    pub(crate) fn describe(&self, g: &Graph) -> String {
        let mm = &g.nodes[self.matmul];
        let mut s = format!("gemm %{} = matmul(%{}, %{}) {:?} {}", self.matmul, mm.args[0], mm.args[1], mm.shape, mm.dtype.torch_name());
        if let Some(b) = self.bias {
            let (ep, act) = match self.act {
                None => ("BIAS", String::new()),
                Some(Activation::Relu) => ("RELU_BIAS", ", relu".into()),
                Some(Activation::GeluTanh) => ("GELU_BIAS", ", gelu_tanh".into()),
            };
            s += &format!(" + bias %{b}{act} -> %{} (cuBLASLt epilogue {ep})", self.out());
        }
        if let Some(p) = self.prologue {
            s += &format!(", its row computed first by kernel {} (output {})", p.kernel, p.output);
        }
        if self.argmax {
            s += &format!(", then the argmax of its columns -> %{}", self.out());
        }
        if let Some(a) = self.attention {
            s += &format!(", then the cache attention %{a} over its rows");
        }
        s
    }
}

/// `gm` with the argmax of its values joined (`Gemm::argmax`) where that is their only use: a
/// product of one row (a single `[1, 1, N]` product), through reshapes nothing else reads, to
/// the index of the largest along its last dim, of N columns.
fn with_argmax(g: &Graph, readers: &[Vec<NodeId>], users: &[usize], mut gm: Gemm) -> Gemm {
    let mm = &g.nodes[gm.matmul];
    let cols = mm.shape[2];
    if mm.shape[..2] != [1, 1] || !matches!(mm.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return gm;
    }
    let (chain, next) = sole_reader_chain(g, readers, users, gm.out(), |_| true);
    let read = &g.nodes[*chain.last().expect("not empty")];
    let Some(r) = next else { return gm };
    if !matches!(&g.nodes[r].op, NodeOp::Prim(Op::Reduce(ReduceOp::ArgMax, dims, _)) if read.shape.len().checked_sub(1).is_some_and(|last| *dims == [last]) && read.shape.last() == Some(&cols) && read.numel() == cols) {
        return gm;
    }
    gm.nodes.extend(&chain[1..]);
    gm.nodes.push(r);
    gm.argmax = true;
    gm
}

/// Whether the bias add (and a ReLU) after matmul node `mm` join its library call, and if not,
/// why (when there is such an add): the product's value must reach the add only through
/// reshapes nothing else reads; the add must compute in the product's dtype (F32, F16, BF16:
/// cuBLASLt's bias has the output's type), of one product (no batch), over values whose last
/// dim is the product's columns; its other operand must be a vector of that many elements
/// spread over the rows (`[1, .., N]`, expanded). A ReLU that is the add's only reader joins.
pub(crate) fn plan_gemm(g: &Graph, readers: &[Vec<NodeId>], users: &[usize], mm: NodeId) -> (Gemm, Option<String>) {
    let node = &g.nodes[mm];
    let plain = Gemm { matmul: mm, bias: None, act: None, nodes: vec![mm], prologue: None, argmax: false, attention: None };
    // The only reader of `x`, when nothing else (an output, a write-back) needs its value.
    let sole = |x: NodeId| (users[x] == 1 && readers[x].len() == 1).then(|| readers[x][0]);
    let mut nodes = vec![mm];
    let mut cur = mm;
    let add = loop {
        let Some(r) = sole(cur) else { return (plain, None) };
        match &g.nodes[r].op {
            NodeOp::Prim(Op::Reshape(_)) => {
                nodes.push(r);
                cur = r;
            }
            NodeOp::Prim(Op::Binary(BinaryOp::Add, _)) => break r,
            _ => return (plain, None),
        }
    };
    let an = &g.nodes[add];
    let NodeOp::Prim(Op::Binary(_, compute)) = an.op else { unreachable!("matched above") };
    let dt = node.dtype;
    let cols = node.shape[2];
    let no = |why: String| (plain.clone(), Some(format!("matmul %{mm}: the add %{add} after it stays a kernel: {why}")));
    if !matches!(dt, DType::F32 | DType::F16 | DType::BF16) {
        return no(format!("{} products get no epilogue", dt.torch_name()));
    }
    if compute != dt || an.dtype != dt {
        return no(format!("the add computes in {} for a {} product", compute.torch_name(), dt.torch_name()));
    }
    if node.shape[0] != 1 {
        return no(format!("a batch of {} products", node.shape[0]));
    }
    if an.shape.last() != Some(&cols) || an.numel() != node.numel() {
        return no(format!("its shape {:?} does not end in the product's {cols} columns", an.shape));
    }
    let other = if an.args[0] == cur { an.args[1] } else { an.args[0] };
    let v = &g.nodes[spread_vector(g, other)];
    if v.shape.last() != Some(&cols) || v.numel() != cols {
        return no(format!("its other operand is not a vector of {cols} along the last dim (spread from {:?})", v.shape));
    }
    nodes.push(add);
    // The activation may read the sum through reshapes nothing else reads (a product over
    // rows shaped back, as GPT-2's Conv1D). GELU only on half-precision products, where the
    // epilogue's own rounding is below the output's.
    let (mut between, mut at) = (vec![], add);
    let act = loop {
        let Some(r) = sole(at).filter(|&r| g.nodes[r].dtype == dt) else { break None };
        match g.nodes[r].op {
            NodeOp::Prim(Op::Reshape(_)) => {
                between.push(r);
                at = r;
            }
            NodeOp::Prim(Op::Unary(UnaryOp::Relu)) => break Some((r, Activation::Relu)),
            NodeOp::Prim(Op::Unary(UnaryOp::GeluTanh)) if matches!(dt, DType::F16 | DType::BF16) => break Some((r, Activation::GeluTanh)),
            _ => break None,
        }
    };
    if let Some((r, _)) = act {
        nodes.extend(between);
        nodes.push(r);
    }
    (Gemm { matmul: mm, bias: Some(other), act: act.map(|(_, a)| a), nodes, prologue: None, argmax: false, attention: None }, None)
}

/// The value a bias operand spreads over the rows: the vector under its expand.
pub(crate) fn spread_vector(g: &Graph, operand: NodeId) -> NodeId {
    match &g.nodes[operand].op {
        NodeOp::Prim(Op::Expand(_)) => g.nodes[operand].args[0],
        _ => operand,
    }
}

/// Farthest apart (in node positions) two sibling groups may start and still be merged.
const MAX_SIBLING_SPAN: usize = 64;

/// Shortest inner dim of a mid reduction (`Kind::MidReduce`).
const MID_MIN_INNER: usize = 32;

/// What a node can be inside a fused kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Pointwise,
    Reshape,
    /// A reduction over trailing dims: (rows, cols).
    Reduce(usize, usize),
    /// A reduction over the dims before and after a kept run (`Space::Mid`): (outer, rows, inner).
    MidReduce(usize, usize, usize),
    /// An expand of a row value over trailing dims: (rows, cols).
    Expand(usize, usize),
    Other,
}

/// Whether node `i` is a reduction that joins a fused kernel (else it runs as its own op).
pub(crate) fn reduces_in_a_kernel(g: &Graph, i: NodeId) -> bool {
    matches!(kind_of(g, i), Kind::Reduce(..) | Kind::MidReduce(..))
}

/// Whether node `i` spreads a row value over its rows (an expand over trailing dims, which a
/// fused kernel reads as a broadcast of the row value).
pub(crate) fn spreads_rows(g: &Graph, i: NodeId) -> bool {
    matches!(kind_of(g, i), Kind::Expand(..))
}

fn kind_of(g: &Graph, i: NodeId) -> Kind {
    let n = &g.nodes[i];
    if n.numel() == 0 {
        return Kind::Other;
    }
    match &n.op {
        _ if n.is_pointwise() => Kind::Pointwise,
        NodeOp::Prim(Op::Reshape(_)) => Kind::Reshape,
        NodeOp::Prim(Op::Reduce(r, dims, _)) if !r.is_arg() => {
            let x = &g.nodes[n.args[0]].shape;
            let first = x.len() - dims.len();
            let trailing = dims.iter().enumerate().all(|(k, &d)| d == first + k);
            let cols: usize = x[first..].iter().product();
            let rows: usize = x[..first].iter().product();
            if trailing && cols > 1 && cols <= MAX_LOOPED_ROW && rows > 0 {
                return Kind::Reduce(rows, cols);
            }
            // Kept dims one run with reduced dims on both sides, on the GPU: a mid reduction.
            // Its threads walk the inner dim, so that dim must be long enough to be read a
            // warp's width at a time, or 1: then they walk the kept dims (channels-last batch
            // norm's statistics of `[N, H, W, C]`, a matrix's column sums: a bias's gradient,
            // or a layer norm weight's, computed from its product in the kernel, not stored).
            let kept: Vec<usize> = (0..x.len()).filter(|d| !dims.contains(d)).collect();
            let (Some(&a), Some(&b)) = (kept.first(), kept.last()) else { return Kind::Other };
            let (outer, rows, inner): (usize, usize, usize) = (x[..a].iter().product(), x[a..=b].iter().product(), x[b + 1..].iter().product());
            let one_run = b - a + 1 == kept.len();
            let walkable = inner >= MID_MIN_INNER || inner == 1;
            if n.device.is_cuda() && one_run && outer > 1 && walkable && rows > 1 && outer.checked_mul(inner).is_some_and(|k| k <= MAX_LOOPED_ROW) {
                Kind::MidReduce(outer, rows, inner)
            } else {
                Kind::Other
            }
        }
        // A broadcast one-element value (a scalar constant) is the same value everywhere.
        NodeOp::Prim(Op::Expand(_)) if g.nodes[n.args[0]].numel() == 1 => Kind::Pointwise,
        NodeOp::Prim(Op::Expand(shape)) => {
            let x = &g.nodes[n.args[0]].shape;
            // Only dims after the first expanded one may change, and those must all be 1 before.
            let Some(first) = (0..shape.len()).find(|&d| shape[d] != x[d]) else { return Kind::Other };
            let tail_ones = x[first..].iter().all(|&d| d == 1);
            let rows: usize = shape[..first].iter().product();
            let cols: usize = shape[first..].iter().product();
            if tail_ones && cols > 1 && cols <= MAX_LOOPED_ROW {
                Kind::Expand(rows, cols)
            } else {
                Kind::Other
            }
        }
        // Opaque: fusion stops at a custom op's edges.
        NodeOp::Custom(_) => Kind::Other,
        _ => Kind::Other,
    }
}

/// A group being formed: its members and the space they share.
#[derive(Clone)]
struct Group {
    members: Vec<NodeId>,
    /// Element count of its values, for a group without reductions.
    numel: usize,
    rows: Option<(usize, usize)>,
    /// A mid reduction's (outer, rows, inner) (`rows` is then (rows, outer * inner)).
    mid: Option<(usize, usize, usize)>,
}

impl Group {
    /// Whether a value of `numel` elements fits in this group's space.
    fn fits(&self, numel: usize) -> bool {
        match self.rows {
            Some((r, c)) => numel == r * c || numel == r,
            None => numel == self.numel,
        }
    }
    /// The space of `a` and `b` merged, if they share one: (numel, rows, mid).
    #[allow(clippy::type_complexity)]
    fn merge_space(a: &Group, b: &Group) -> Option<(usize, Option<(usize, usize)>, Option<(usize, usize, usize)>)> {
        // One-element values (constants) are the same for every element of any group.
        if a.rows.is_none() && a.numel == 1 {
            return Some((b.numel, b.rows, b.mid));
        }
        if b.rows.is_none() && b.numel == 1 {
            return Some((a.numel, a.rows, a.mid));
        }
        match (a.rows, b.rows) {
            // Row and mid spaces index their row values differently.
            (Some(x), Some(y)) => (x == y && a.mid == b.mid).then_some((a.numel, Some(x), a.mid)),
            (Some(x), None) => a.fits(b.numel).then_some((a.numel, Some(x), a.mid)),
            (None, Some(y)) => b.fits(a.numel).then_some((b.numel, Some(y), b.mid)),
            (None, None) => (a.numel == b.numel).then_some((a.numel, None, None)),
        }
    }
}

/// Groups fusable nodes and orders the steps.
pub(crate) fn schedule(g: &Graph) -> Schedule {
    let n = g.nodes.len();
    let kinds: Vec<Kind> = (0..n).map(|i| kind_of(g, i)).collect();
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut groups: Vec<Option<Group>> = vec![];
    // Who reads each node (once per argument slot), for the operand and output counts.
    let node_readers = g.readers();
    let users = g.users();
    // Matrix products on the GPU are library calls, with their epilogues; their nodes join no
    // fused kernel.
    let mut sched = Schedule::default();
    let mut gemm_of: Vec<Option<usize>> = vec![None; n];
    for i in 0..n {
        let node = &g.nodes[i];
        if matches!(node.op, NodeOp::Prim(Op::Matmul)) && node.device.is_cuda() && node.dtype.is_float() && node.numel() > 0 {
            let (gm, note) = plan_gemm(g, &node_readers, &users, i);
            let gm = if crate::switches::gemv_argmax_on() { with_argmax(g, &node_readers, &users, gm) } else { gm };
            for &x in &gm.nodes {
                gemm_of[x] = Some(sched.gemms.len());
            }
            sched.gemms.push(gm);
            sched.notes.extend(note);
        }
    }
    for i in 0..n {
        let node = &g.nodes[i];
        if gemm_of[i].is_some() {
            continue;
        }
        let (numel, rows, mid) = match kinds[i] {
            Kind::Other => continue,
            Kind::Reduce(r, c) => (r * c, Some((r, c)), None),
            Kind::MidReduce(o, r, q) => (o * r * q, Some((r, o * q)), Some((o, r, q))),
            Kind::Expand(r, c) => (r * c, Some((r, c)), None),
            Kind::Pointwise | Kind::Reshape => (node.numel(), None, None),
        };
        // A reduction's group holds its input's values; an expand's holds its output's.
        groups.push(Some(Group { members: vec![i], numel, rows, mid }));
        let mine = groups.len() - 1;
        group_of[i] = Some(mine);
        for &a in &node.args {
            let Some(ga) = group_of[a] else { continue };
            let gi = group_of[i].expect("just set");
            if ga == gi || g.nodes[a].device != node.device {
                continue;
            }
            // The producer's value must be one this node reads elementwise.
            let ok_edge = match kinds[i] {
                Kind::Pointwise | Kind::Reshape => true,
                Kind::Reduce(r, c) => g.nodes[a].numel() == r * c,
                Kind::MidReduce(o, r, q) => g.nodes[a].numel() == o * r * q,
                Kind::Expand(r, _) => g.nodes[a].numel() == r,
                Kind::Other => false,
            };
            if !ok_edge {
                continue;
            }
            try_merge(g, &node_readers, &users, &mut groups, &mut group_of, ga, gi);
        }
    }
    // Siblings: groups reading the same value over the same space become one kernel (the value
    // is loaded once, one launch instead of two), unless that would make a cycle. Groups that
    // are only views or broadcasts stay as they are (a lone reshape is no kernel at all).
    let computes = |grp: &Group| grp.members.iter().any(|&m| matches!(kinds[m], Kind::Pointwise | Kind::Reduce(..) | Kind::MidReduce(..)));
    for v in 0..n {
        let mut sibs: Vec<usize> = node_readers[v].iter().filter_map(|&r| group_of[r]).filter(|&h| Some(h) != group_of[v]).collect();
        sibs.sort_unstable();
        sibs.dedup();
        sibs.retain(|&h| groups[h].as_ref().is_some_and(computes) && g.nodes[groups[h].as_ref().expect("live").members[0]].device == g.nodes[v].device);
        if let Some((&first, rest)) = sibs.split_first() {
            for &other in rest {
                // Not across phases: a backward kernel merged into a forward one would compute
                // its values there and keep them alive across the gap (undoing `remat`).
                let start = |h: usize| groups[h].as_ref().map_or(0, |grp| grp.members[0]);
                if start(other).abs_diff(start(first)) > MAX_SIBLING_SPAN {
                    continue;
                }
                if try_merge(g, &node_readers, &users, &mut groups, &mut group_of, first, other) {
                    sched.notes.push(format!("siblings reading %{v} fused into one kernel"));
                }
            }
        }
    }
    let sunk = sink_stored_outputs(g, &node_readers, &users, &kinds, &mut groups, &mut group_of);
    if sunk > 0 {
        sched.notes.push(format!("{sunk} values moved into the kernel that reads them, with what only they are made of"));
    }
    detach_outer_views(g, &node_readers, &kinds, &mut groups, &mut group_of);
    let merged = merge_updates(g, &node_readers, &users, &mut groups, &mut group_of);
    if merged > 0 {
        sched.notes.push(format!("{merged} updates of captured tensors merged side by side into others' kernels"));
    }
    // Steps in topological order (a fused group is one unit; no outside node both feeds and
    // reads a group), preferring the original node order.
    let mut unit_of = vec![0usize; n];
    let mut units: Vec<Vec<NodeId>> = vec![];
    let mut unit_of_group: std::collections::HashMap<usize, usize> = Default::default();
    let mut unit_of_gemm: std::collections::HashMap<usize, usize> = Default::default();
    for i in 0..n {
        let (table, key) = match (gemm_of[i], group_of[i]) {
            (Some(gm), _) => (&mut unit_of_gemm, gm),
            (None, Some(gi)) => (&mut unit_of_group, gi),
            (None, None) => {
                units.push(vec![i]);
                unit_of[i] = units.len() - 1;
                continue;
            }
        };
        let u = *table.entry(key).or_insert_with(|| {
            units.push(vec![]);
            units.len() - 1
        });
        units[u].push(i);
        unit_of[i] = u;
    }
    let mut indeg = vec![0usize; units.len()];
    let mut readers: Vec<Vec<usize>> = vec![vec![]; units.len()];
    for (u, members) in units.iter().enumerate() {
        let mut deps: Vec<usize> = members.iter().flat_map(|&m| g.nodes[m].args.iter().map(|&a| unit_of[a])).filter(|&d| d != u).collect();
        deps.sort_unstable();
        deps.dedup();
        indeg[u] = deps.len();
        for d in deps {
            readers[d].push(u);
        }
    }
    // A collective's result, or a view of one: its readers go as late as the original order
    // allows (each keyed by its last node, not its first), so that the work between a DDP
    // bucket's all-reduce and its optimiser update overlaps the communication.
    let mut communicated = vec![false; n];
    for i in 0..n {
        communicated[i] = match &g.nodes[i].op {
            NodeOp::Collective(_) => true,
            NodeOp::Prim(op) if op.is_view() => communicated[g.nodes[i].args[0]],
            _ => false,
        };
    }
    let key = |u: usize| {
        let reads_comm = units[u].iter().any(|&m| !communicated[m] && g.nodes[m].args.iter().any(|&a| communicated[a]));
        std::cmp::Reverse((if reads_comm { *units[u].iter().max().expect("a unit has nodes") } else { units[u][0] }, u))
    };
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<(NodeId, usize)>> = (0..units.len()).filter(|&u| indeg[u] == 0).map(key).collect();
    let (mut counter, mut emitted) = (0, 0);
    while let Some(std::cmp::Reverse((_, u))) = ready.pop() {
        for &r in &readers[u] {
            indeg[r] -= 1;
            if indeg[r] == 0 {
                ready.push(key(r));
            }
        }
        emitted += 1;
        let first = units[u][0];
        if let Some(gm) = gemm_of[first] {
            sched.steps.push(Step::Gemm(gm));
            continue;
        }
        match group_of[first] {
            None => sched.steps.push(Step::Node(first)),
            Some(gi) => {
                let grp = groups[gi].as_ref().expect("live");
                // Reshapes and broadcasts alone (one, or a chain of them) are views, not a
                // kernel: an embedding's backward reads its ids spread over the rows through a
                // stride of 0 instead of a stored [tokens, features] copy of them.
                if grp.members.iter().all(|&m| matches!(kinds[m], Kind::Reshape | Kind::Expand(..))) {
                    sched.steps.extend(grp.members.iter().map(|&m| Step::Node(m)));
                    continue;
                }
                let k = build_kernel(g, grp, &group_of, &users, &node_readers, counter);
                counter += 1;
                sched.kernels.push(k);
                sched.steps.push(Step::Kernel(sched.kernels.len() - 1));
            }
        }
    }
    debug_assert_eq!(emitted, units.len(), "the step graph has no cycle");
    pad_row_outputs(g, &node_readers, &users, &mut sched);
    row_prologues(g, &node_readers, &users, &mut sched);
    cache_attentions(g, &mut sched);
    sched
}

/// Most columns of a product that computes its row itself: each of its blocks computes the row
/// again (the tied output head's 50,257 columns would have 6,283 blocks each compute the final
/// layer norm). A product with an argmax has no such limit: its blocks are a few per SM
/// (`gemv.rs`), each walking many columns.
const MAX_PROLOGUE_COLUMNS: usize = 4096;

/// (start, step) where `v`, read by a row kernel over rows of `cols`, is an `Arange` of `cols`
/// values along its last dim seen through reshapes and broadcasts that keep that dim: its value
/// at column c is then `start + c * step` in every row (`KInput::columns`).
fn columns_of(g: &Graph, v: NodeId, cols: usize) -> Option<(f64, f64)> {
    if !crate::switches::row_columns_on() || cols < 2 {
        return None;
    }
    let mut n = v;
    loop {
        let node = &g.nodes[n];
        if node.shape.last() != Some(&cols) {
            return None;
        }
        match node.op {
            // Integer values exactly as `arange` makes them (whole start and step), or F32 and
            // F64 ones rounded once from F64, as it rounds them.
            NodeOp::Arange { start, step } if node.shape.len() == 1 => {
                let whole = start.fract() == 0.0 && step.fract() == 0.0;
                let last = start + step * (cols - 1) as f64;
                let exact = match node.dtype {
                    // Values an I32 holds (past them `arange` wraps, a 64-bit column would not).
                    DType::I32 => whole && [start, last].iter().all(|v| (i32::MIN as f64..=i32::MAX as f64).contains(v)),
                    DType::I64 => whole,
                    DType::F32 | DType::F64 => true,
                    _ => false,
                };
                return exact.then_some((start, step));
            }
            NodeOp::Prim(Op::Reshape(_) | Op::Expand(_)) => n = node.args[0],
            _ => return None,
        }
    }
}

/// A GPU row kernel over one row whose full output only a product reads, as its row (through
/// reshapes): a decode step's layer norm before its matrix-vector product. The product's
/// kernel computes the row first in every block (`gemv.cu`'s `GEMV_ROW`), so the two are one
/// launch. Only where nothing runs between the two steps but views and inputs, and the product
/// reads no other output of the kernel (those the product's kernel stores, from its first block,
/// are read only after it), and where the row is the product's whole left operand in the
/// product's dtype, of at most `MAX_PROLOGUE_ROW`.
fn row_prologues(g: &Graph, readers: &[Vec<NodeId>], users: &[usize], sched: &mut Schedule) {
    if crate::switches::row_prologues_off() {
        return;
    }
    let gemm_of: std::collections::HashMap<NodeId, usize> = sched.gemms.iter().enumerate().map(|(j, gm)| (gm.matmul, j)).collect();
    let step_of = |want: &Step| sched.steps.iter().position(|s| s == want);
    let mut found = vec![];
    for (ki, k) in sched.kernels.iter().enumerate() {
        let Space::Rows { rows: 1, cols } = k.space else { continue };
        if !k.device.is_cuda() || cols > crate::kir::MAX_PROLOGUE_ROW {
            continue;
        }
        let Some(at) = step_of(&Step::Kernel(ki)) else { continue };
        let made_here = |v: NodeId| k.outputs.iter().any(|(_, n)| *n == g.view_root(v));
        for (m, &(o, node)) in k.outputs.iter().enumerate() {
            if k.ops[o].row || k.row_pads[m].is_some() {
                continue;
            }
            // The value and reshapes of it, then the product reading the last as its row.
            let (chain, next) = sole_reader_chain(g, readers, users, node, |_| true);
            let last = *chain.last().expect("not empty");
            let product = next.filter(|&r| matches!(g.nodes[r].op, NodeOp::Prim(Op::Matmul)) && g.nodes[r].args[0] == last).and_then(|r| gemm_of.get(&r).copied());
            let Some(j) = product else { continue };
            let mm = &g.nodes[sched.gemms[j].matmul];
            let gm = &sched.gemms[j];
            let few_blocks = gm.argmax || mm.shape.last().is_some_and(|&n| n <= MAX_PROLOGUE_COLUMNS);
            // The product's other operands (its matrix, its bias) are not the kernel's: only the
            // first block stores those, while every block reads its operands.
            let reads_other = gm.nodes.iter().flat_map(|&x| g.nodes[x].args.iter().copied()).any(|a| !chain.contains(&a) && !gm.nodes.contains(&a) && made_here(a));
            // (the row's numel is `cols`: the product's K must be too)
            if g.nodes[last].shape.last() != Some(&cols) || k.ops[o].dtype != mm.dtype || !few_blocks || reads_other || gm.prologue.is_some() {
                continue;
            }
            let Some(until) = step_of(&Step::Gemm(j)) else { continue };
            let quiet = |s: &Step| match s {
                Step::Node(i) => match &g.nodes[*i].op {
                    // (an arange reads nothing and is made once, then kept)
                    NodeOp::Arg(_) | NodeOp::Captured(_) | NodeOp::Arange { .. } => true,
                    NodeOp::Prim(op) if op.is_view() => g.nodes[*i].args.iter().all(|&a| chain.contains(&a) || !made_here(a)),
                    _ => false,
                },
                _ => false,
            };
            if at < until && sched.steps[at + 1..until].iter().all(quiet) {
                found.push((j, RowPrologue { kernel: ki, output: m }));
                break;
            }
        }
    }
    if !found.is_empty() {
        sched.notes.push(format!("{} one-row kernels run by the product that reads their row", found.len()));
    }
    for (j, p) in found {
        sched.gemms[j].prologue = Some(p);
    }
}

/// Joins each cache attention (`Op::AttentionUpTo`) given its new key and value rows whose
/// query, new key and new value are all views of one product of one row (a decode step's
/// query, key and value projection) to that product (`Gemm::attention`): the product's kernel
/// attends each head as soon as its rows are stored, one launch and one wait fewer. Only where
/// nothing but views and inputs come between the two steps, on the GPU, and under
/// `KILN_ATTEND_IN_PRODUCT=1`.
fn cache_attentions(g: &Graph, sched: &mut Schedule) {
    if !crate::switches::attend_in_product_on() {
        return;
    }
    let mut found = vec![];
    for (j, gm) in sched.gemms.iter().enumerate() {
        let mm = &g.nodes[gm.matmul];
        if gm.argmax || !mm.device.is_cuda() || mm.shape.iter().rev().skip(1).product::<usize>() != 1 {
            continue;
        }
        let Some(at) = sched.steps.iter().position(|s| *s == Step::Gemm(j)) else { continue };
        let out = gm.out();
        // The steps after the product, up to the attention: views and inputs only.
        for s in &sched.steps[at + 1..] {
            let Step::Node(i) = *s else { break };
            let n = &g.nodes[i];
            match &n.op {
                NodeOp::Prim(Op::AttentionUpTo { .. }) => {
                    let of_product = |a: NodeId| g.view_root(a) == out;
                    if n.args.len() == 6 && [0, 4, 5].iter().all(|&a| of_product(n.args[a])) && n.args[1..4].iter().all(|&a| !of_product(a)) {
                        found.push((j, i));
                    }
                    break;
                }
                NodeOp::Arg(_) | NodeOp::Captured(_) => {}
                NodeOp::Prim(op) if op.is_view() => {}
                _ => break,
            }
        }
    }
    if !found.is_empty() {
        sched.notes.push(format!("{} cache attentions run by the product that computes their rows", found.len()));
    }
    for (j, a) in found {
        sched.gemms[j].attention = Some(a);
    }
}

/// From `node`: it and the reshapes after it that `through` takes (by their shape), each the
/// sole reader of the one before, and the sole reader of the last that is no such reshape (None
/// where a value has another reader or is an output).
fn sole_reader_chain(g: &Graph, readers: &[Vec<NodeId>], users: &[usize], node: NodeId, through: impl Fn(&[usize]) -> bool) -> (Vec<NodeId>, Option<NodeId>) {
    let mut chain = vec![node];
    loop {
        let v = *chain.last().expect("not empty");
        let [r] = readers[v].as_slice() else { return (chain, None) };
        if users[v] != 1 {
            return (chain, None);
        }
        match &g.nodes[*r].op {
            NodeOp::Prim(Op::Reshape(shape)) if through(shape) => chain.push(*r),
            _ => return (chain, Some(*r)),
        }
    }
}

/// A GPU row kernel's full output read only by a constant padding of its last dim (through
/// reshapes that keep that dim): the kernel stores the padded rows itself, and the reshapes and
/// the padding are no steps of their own. That is the gradient of a product padded to aligned
/// columns (`ops::matmul`'s `product_2d`: GPT-2's 50,257 classes), which cross-entropy's row
/// kernel computes: without this, an 823 MB copy into a padded buffer follows it.
fn pad_row_outputs(g: &Graph, readers: &[Vec<NodeId>], users: &[usize], sched: &mut Schedule) {
    let alone: std::collections::HashSet<NodeId> = sched.steps.iter().filter_map(|s| if let Step::Node(n) = s { Some(*n) } else { None }).collect();
    let mut gone: Vec<NodeId> = vec![];
    for k in &mut sched.kernels {
        let Space::Rows { cols, .. } = k.space else { continue };
        if !k.device.is_cuda() {
            continue;
        }
        for m in 0..k.outputs.len() {
            let (o, node) = k.outputs[m];
            if k.ops[o].row {
                continue;
            }
            // The value and reshapes of it that keep its last dim, then the padding.
            let (chain, next) = sole_reader_chain(g, readers, users, node, |shape| shape.last() == Some(&cols));
            let v = *chain.last().expect("not empty");
            let found = next.and_then(|r| match &g.nodes[r].op {
                NodeOp::Prim(Op::Pad(pads, value)) if g.nodes[v].shape.last() == Some(&cols) => {
                    let (last, rest) = pads.split_last().expect("a padded value has dims");
                    (last.0 == 0 && last.1 > 0 && rest.iter().all(|p| *p == (0, 0))).then_some((r, last.1, *value))
                }
                _ => None,
            });
            // Every node after the value must be a step of its own (not a member of a kernel).
            let Some((padded, extra, value)) = found.filter(|(p, ..)| chain[1..].iter().chain([p]).all(|n| alone.contains(n))) else { continue };
            k.outputs[m].1 = padded;
            k.row_pads[m] = Some(crate::kir::RowPad { cols: extra, value });
            sched.notes.push(format!("the padding %{padded} of %{node} stored by its row kernel"));
            gone.extend(chain.iter().skip(1).copied());
            gone.push(padded);
        }
    }
    if !gone.is_empty() {
        sched.steps.retain(|s| !matches!(s, Step::Node(n) if gone.contains(n)));
    }
}

/// Takes out of their groups the reshapes that only steps outside read: inside, each would be
/// an output stored beside the value it reshapes (a ReLU's output and its `[1, M, N]` view for
/// the next product: the same bytes written twice, held twice). Outside, it is a view of that
/// value. So too a reshape of a value the kernel loads that steps outside also read (a bias
/// gradient's input, which the weight gradient's product reads as well): inside, it would be a
/// copy of that input; outside, the kernel loads the view. A reshape that is a written-back
/// value stays, so that it is still stored in place. Likewise a broadcast that only steps
/// outside read (a layer norm's mean spread over its rows, for the backward): inside, the
/// kernel would store it at full size; outside, it is a view of the row value it stores.
fn detach_outer_views(g: &Graph, node_readers: &[Vec<NodeId>], kinds: &[Kind], groups: &mut [Option<Group>], group_of: &mut [Option<usize>]) {
    let written_back: std::collections::HashSet<NodeId> = g.mutations.iter().map(|&(_, v)| v).collect();
    for (gi, grp) in groups.iter_mut().enumerate() {
        let Some(grp) = grp.as_mut() else { continue };
        if !grp.members.iter().any(|&m| !matches!(kinds[m], Kind::Reshape | Kind::Expand(..))) {
            continue;
        }
        // Latest first: a reshape of a reshape leaves first, then may let the inner one go.
        for k in (0..grp.members.len()).rev() {
            let m = grp.members[k];
            let outside = |r: &NodeId| group_of[*r] != Some(gi);
            let detached = match kinds[m] {
                Kind::Reshape => node_readers[m].iter().all(outside) || (g.nodes[m].args.iter().all(outside) && node_readers[m].iter().any(outside)),
                Kind::Expand(..) => node_readers[m].iter().all(outside),
                _ => false,
            };
            if detached && !written_back.contains(&m) {
                grp.members.remove(k);
                group_of[m] = None;
            }
        }
    }
}

/// Moves a pointwise value out of the kernel that would store it only for one other kernel (a
/// reduction's), into that kernel, with the values of its kernel that only it is made of, where
/// that kernel then loads fewer bytes than the value's store and load cost: one full-size store
/// and load fewer, or a narrower one. That is a layer norm's normalised values, which producer
/// fusion puts in the forward's kernel, stored there for the backward's weight gradient, whose
/// kernel loads the centred values they are made of; and GELU's derivative, an F32 value the
/// forward's kernel computes from the BF16 pre-activation, which the backward's kernel can
/// compute from that pre-activation instead (half the bytes loaded, no store). Later values go
/// first, so a chain of them can follow. Kernels that write captured tensors (optimiser
/// updates) give nothing away. Returns how many moved.
fn sink_stored_outputs(g: &Graph, node_readers: &[Vec<NodeId>], users: &[usize], kinds: &[Kind], groups: &mut [Option<Group>], group_of: &mut [Option<usize>]) -> usize {
    let written: std::collections::HashSet<NodeId> = g.mutations.iter().map(|&(_, v)| v).collect();
    let kept: std::collections::HashSet<NodeId> = g.outputs.iter().copied().chain(written.iter().copied()).collect();
    let bytes = |x: NodeId| g.nodes[x].bytes();
    let mut moved = 0;
    for o in (0..g.nodes.len()).rev() {
        let (Some(src), Some(&first)) = (group_of[o], node_readers[o].first()) else { continue };
        let Some(dst) = group_of[first] else { continue };
        if kinds[o] != Kind::Pointwise || kept.contains(&o) || dst == src || !node_readers[o].iter().all(|&r| group_of[r] == Some(dst)) {
            continue;
        }
        let (from, to) = (groups[src].as_ref().expect("live"), groups[dst].as_ref().expect("live"));
        if !to.fits(g.nodes[o].numel()) || to.rows.is_none() || from.members.iter().any(|m| written.contains(m)) {
            continue;
        }
        // The chain: `o` and the members of its kernel that only the chain reads, where `o`
        // and they are pointwise values over the reader's whole space (its elements one to
        // one), or one-element constants and their reshapes (the same for every element). No
        // broadcast of per-row values moves: its rows are the source kernel's, not the
        // reader's.
        let full = |x: NodeId| g.nodes[x].numel() == to.numel;
        let movable = |x: NodeId| {
            let constant = g.nodes[x].numel() == 1 && matches!(kinds[x], Kind::Pointwise | Kind::Reshape);
            !kept.contains(&x) && ((kinds[x] == Kind::Pointwise && full(x)) || constant)
        };
        let mut chain = vec![o];
        while full(o) {
            let more: Vec<NodeId> = from
                .members
                .iter()
                .copied()
                .filter(|&x| !chain.contains(&x) && movable(x) && !node_readers[x].is_empty() && node_readers[x].iter().all(|r| chain.contains(r)) && users[x] == node_readers[x].len())
                .collect();
            if more.is_empty() {
                break;
            }
            chain.extend(more);
        }
        chain.sort_unstable();
        // What the reader's kernel must load anew for the chain: values outside it that none of
        // its members reads yet and that are no broadcast left as a view. A value the source
        // kernel computed without storing it must now be stored too.
        let loads = |x: NodeId| to.members.iter().any(|&m| g.nodes[m].args.contains(&x));
        let view = |x: NodeId| matches!(kinds[x], Kind::Expand(..)) && (group_of[x].is_none() || node_readers[x].iter().all(|&r| chain.contains(&r) || group_of[r] != Some(src)));
        let mut leaves: Vec<NodeId> = chain.iter().flat_map(|&m| g.nodes[m].args.iter().copied()).filter(|x| !chain.contains(x)).collect();
        leaves.sort_unstable();
        leaves.dedup();
        let stored = |x: NodeId| group_of[x] != Some(src) || users[x] > node_readers[x].iter().filter(|&&r| group_of[r] == Some(src) && !chain.contains(&r)).count();
        let new_loads: Vec<NodeId> = leaves.iter().copied().filter(|&x| !loads(x) && !view(x)).collect();
        // (a value loaded anew is read element by element: of the reader's whole space)
        if new_loads.iter().any(|&x| !full(x)) {
            continue;
        }
        let extra: usize = new_loads.iter().map(|&x| if stored(x) { bytes(x) } else { 2 * bytes(x) }).sum();
        if extra >= 2 * bytes(o) {
            continue;
        }
        let mut members = to.members.clone();
        members.extend(&chain);
        members.sort_unstable();
        let most = if to.mid.is_some() { MAX_MID_OPERANDS } else { MAX_OPERANDS };
        if too_many_operands(g, node_readers, users, &members, most) {
            continue;
        }
        let rest: Vec<NodeId> = from.members.iter().copied().filter(|m| !chain.contains(m)).collect();
        let (numel, rows, mid) = (to.numel, to.rows, to.mid);
        let mut others = group_of.to_vec();
        for &m in &members {
            others[m] = None;
        }
        if rest.is_empty() || creates_cycle(g, &members, &others, groups.len()) {
            continue;
        }
        if let Some(grp) = groups[src].as_mut() {
            grp.members = rest;
        }
        groups[dst] = Some(Group { members, numel, rows, mid });
        for &m in &chain {
            group_of[m] = Some(dst);
        }
        moved += 1;
    }
    moved
}

/// Argument words a flat kernel's launch holds before its constants (CUDA's map kernels: the
/// element count, an address per operand, the sizes, then the strides of each strided operand).
const FLAT_LAUNCH_WORDS: usize = 56;

/// Largest update (in elements) that `merge_updates` puts beside others: parameters and their
/// optimiser state, not a batch's activations.
const MAX_UPDATE_NUMEL: usize = 1 << 22;

/// Kernels that only compute new values of captured tensors (optimiser updates, batch norm's
/// running statistics and batch counts), over the same number of elements, become one kernel as
/// far as the operand limit allows: a training step's hundreds of small updates cost launches
/// more than work. Only such updates: nothing in the program reads what they compute (so
/// running one later delays no reader), they are never hoisted, and what they read (parameters,
/// gradients, state) is small. Returns how many groups were merged away.
fn merge_updates(g: &Graph, node_readers: &[Vec<NodeId>], users: &[usize], groups: &mut [Option<Group>], group_of: &mut [Option<usize>]) -> usize {
    let mut written = vec![0usize; g.nodes.len()];
    for &(_, v) in &g.mutations {
        written[v] += 1;
    }
    let is_view = |i: NodeId| matches!(&g.nodes[i].op, NodeOp::Prim(op) if op.is_view());
    // Whether `i`'s value goes nowhere but into captured tensors (through views): no graph output,
    // no reader outside `inside` but views that themselves go only there.
    fn only_written_back(readers: &[Vec<NodeId>], users: &[usize], written: &[usize], is_view: &dyn Fn(NodeId) -> bool, inside: &dyn Fn(NodeId) -> bool, i: NodeId) -> bool {
        users[i] == readers[i].len() + written[i] && readers[i].iter().all(|&r| inside(r) || (is_view(r) && only_written_back(readers, users, written, is_view, inside, r)))
    }
    fn writes_back(readers: &[Vec<NodeId>], written: &[usize], is_view: &dyn Fn(NodeId) -> bool, i: NodeId) -> bool {
        written[i] > 0 || readers[i].iter().any(|&r| is_view(r) && writes_back(readers, written, is_view, r))
    }
    let mut candidates: Vec<(usize, NodeId, usize)> = vec![];
    for (h, grp) in groups.iter().enumerate() {
        let Some(grp) = grp else { continue };
        if grp.rows.is_some() || grp.mid.is_some() || grp.numel > MAX_UPDATE_NUMEL {
            continue;
        }
        let inside = |x: NodeId| group_of[x] == Some(h);
        let update = grp.members.iter().any(|&m| writes_back(node_readers, &written, &is_view, m))
            && grp.members.iter().all(|&m| only_written_back(node_readers, users, &written, &is_view, &inside, m));
        if update {
            candidates.push((grp.numel, grp.members[0], h));
        }
    }
    candidates.sort_unstable();
    // Loaded inputs plus stored values of a set of members, write-backs included.
    let operands = |members: &[NodeId]| {
        let inside = |x: NodeId| members.binary_search(&x).is_ok();
        outside_inputs(g, members) + members.iter().filter(|&&m| users[m] > node_readers[m].iter().filter(|&&r| inside(r)).count()).count()
    };
    let mut merged = 0;
    let mut at: Option<(usize, usize)> = None;
    for &(numel, _, h) in &candidates {
        if let Some((n, acc)) = at.filter(|&(n, _)| n == numel) {
            let both = groups[acc].as_ref().zip(groups[h].as_ref()).filter(|(a, b)| g.nodes[a.members[0]].device == g.nodes[b.members[0]].device);
            let fits = both.is_some_and(|(a, b)| {
                let mut members: Vec<NodeId> = a.members.iter().chain(&b.members).copied().collect();
                members.sort_unstable();
                // Room for every operand's strides too, should they all be read strided.
                let ndim = members.iter().map(|&m| g.nodes[m].shape.len()).max().unwrap_or(1);
                operands(&members) <= MAX_OPERANDS.min((FLAT_LAUNCH_WORDS - 1 - ndim) / (1 + ndim))
            });
            if fits && try_merge(g, node_readers, users, groups, group_of, acc, h) {
                merged += 1;
                at = Some((n, acc));
                continue;
            }
        }
        at = Some((numel, h));
    }
    merged
}

/// Merges group `b` into group `a` when their spaces agree, the kernel stays within its operand
/// limit and no step outside would both feed and read it; whether it did.
fn try_merge(g: &Graph, node_readers: &[Vec<NodeId>], users: &[usize], groups: &mut [Option<Group>], group_of: &mut [Option<usize>], a: usize, b: usize) -> bool {
    let (ga, gb) = (groups[a].as_ref().expect("live"), groups[b].as_ref().expect("live"));
    let Some((numel, rows, mid)) = Group::merge_space(ga, gb) else { return false };
    let mut members: Vec<NodeId> = ga.members.iter().chain(&gb.members).copied().collect();
    members.sort_unstable();
    if too_many_operands(g, node_readers, users, &members, if mid.is_some() { MAX_MID_OPERANDS } else { MAX_OPERANDS }) {
        return false;
    }
    // A mid kernel loads its stored inputs as values of its walk: a one-element one (an
    // optimiser's step-dependent scalar) read by a per-row member would be undefined there.
    if let Some((o, r, q)) = mid {
        let walked = o * r * q;
        let outside = |a: &NodeId| members.binary_search(a).is_err();
        if members.iter().any(|&m| g.nodes[m].numel() != walked && g.nodes[m].args.iter().any(|a| outside(a) && g.nodes[*a].numel() == 1)) {
            return false;
        }
    }
    // The two groups being merged are not "other groups" for the check.
    let mut others = group_of.to_vec();
    for &m in &members {
        others[m] = None;
    }
    if creates_cycle(g, &members, &others, groups.len()) {
        return false;
    }
    for &m in &members {
        group_of[m] = Some(a);
    }
    groups[a] = Some(Group { members, numel, rows, mid });
    groups[b] = None;
    true
}

/// Most loaded inputs plus stored outputs of one fused kernel: every operand takes argument
/// words in the launch's fixed block (addresses, and strides when strided).
const MAX_OPERANDS: usize = 20;

/// The same for a mid reduction, whose inputs take four words each (three strides).
const MAX_MID_OPERANDS: usize = 12;

fn too_many_operands(g: &Graph, readers: &[Vec<NodeId>], users: &[usize], members: &[NodeId], most: usize) -> bool {
    let inside = |x: NodeId| members.binary_search(&x).is_ok();
    // Outputs: members some node outside reads, graph outputs and values written back (an
    // optimiser's new parameters and state, which no node reads).
    let outputs = members.iter().filter(|&&m| users[m] > readers[m].iter().filter(|&&j| inside(j)).count()).count();
    outside_inputs(g, members) + outputs > most
}

/// How many distinct values outside `members` (sorted) they read: a kernel's loaded inputs.
fn outside_inputs(g: &Graph, members: &[NodeId]) -> usize {
    let mut inputs: Vec<NodeId> = members.iter().flat_map(|&m| g.nodes[m].args.iter().copied()).filter(|a| members.binary_search(a).is_err()).collect();
    inputs.sort_unstable();
    inputs.dedup();
    inputs.len()
}

/// Whether some step outside `members` both reads from and feeds the group (it could then run
/// neither before nor after the fused kernel). Other groups run as one step, so one of their
/// members depending on the group makes all of them depend on it.
fn creates_cycle(g: &Graph, members: &[NodeId], group_of: &[Option<usize>], n_groups: usize) -> bool {
    let inside = |x: NodeId| members.binary_search(&x).is_ok();
    let lo = members[0];
    let mut tainted = vec![false; g.nodes.len()];
    let mut group_tainted = vec![false; n_groups];
    loop {
        let mut changed = false;
        for u in lo..g.nodes.len() {
            if inside(u) || tainted[u] {
                continue;
            }
            let via_group = group_of[u].is_some_and(|h| group_tainted[h]);
            if via_group || g.nodes[u].args.iter().any(|&a| inside(a) || tainted[a]) {
                tainted[u] = true;
                changed = true;
                if let Some(h) = group_of[u] {
                    group_tainted[h] = true;
                }
            }
        }
        // Members of a tainted group that come before the group's first member matter too.
        for u in 0..lo {
            if !tainted[u] && group_of[u].is_some_and(|h| group_tainted[h]) {
                tainted[u] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    members.iter().any(|&m| g.nodes[m].args.iter().any(|&a| !inside(a) && tainted[a]))
}

fn build_kernel(g: &Graph, grp: &Group, group_of: &[Option<usize>], users: &[usize], readers: &[Vec<NodeId>], counter: usize) -> FusedKernel {
    let me = group_of[grp.members[0]];
    let space = match (grp.mid, grp.rows) {
        (Some((outer, rows, inner)), _) => Space::Mid { outer, rows, inner },
        (None, Some((rows, cols))) => Space::Rows { rows, cols },
        (None, None) => Space::Flat { numel: grp.numel },
    };
    let is_row = |numel: usize| match space {
        Space::Rows { rows, cols } => numel == rows && numel != rows * cols,
        Space::Mid { outer, rows, inner } => numel == rows && numel != outer * rows * inner,
        Space::Flat { .. } => false,
    };
    let mut inputs: Vec<KInput> = vec![];
    let mut ops: Vec<KOp> = vec![];
    let mut val: std::collections::HashMap<NodeId, ValueRef> = Default::default();
    let mut names: Vec<String> = vec![];
    for &m in &grp.members {
        let node = &g.nodes[m];
        let mut args = vec![];
        for &a in &node.args {
            let arg = match val.get(&a) {
                Some(v) => *v,
                None => {
                    // A row value spread over the rows by a view step of its own (a detached
                    // broadcast, in no kernel) is loaded as the row value, once per row.
                    let spread = matches!(space, Space::Rows { .. }) && group_of[a].is_none() && spreads_rows(g, a) && is_row(g.nodes[g.nodes[a].args[0]].numel());
                    let src = if spread { g.nodes[a].args[0] } else { a };
                    let mut v = match val.get(&src) {
                        Some(v) => *v,
                        None => {
                            // One element is the same value in every row: a row input (as a
                            // full one, a value the kernel computes per row from it would read
                            // an element value, and the row kernel would never compute it).
                            let n = g.nodes[src].numel();
                            let row = is_row(n) || (n == 1 && matches!(space, Space::Rows { .. }));
                            let columns = match space {
                                Space::Rows { cols, .. } if !row => columns_of(g, src, cols),
                                _ => None,
                            };
                            inputs.push(KInput { node: src, dtype: g.nodes[src].dtype, row, columns });
                            ValueRef::In(inputs.len() - 1)
                        }
                    };
                    if spread {
                        val.insert(src, v);
                        ops.push(KOp { kind: KKind::Broadcast, args: vec![v], dtype: g.nodes[a].dtype, row: false });
                        v = ValueRef::Op(ops.len() - 1);
                    }
                    val.insert(a, v);
                    v
                }
            };
            args.push(arg);
        }
        let kind = match &node.op {
            NodeOp::Full(v) => KKind::Const(*v),
            NodeOp::Prim(Op::Unary(u)) => KKind::Unary(*u),
            NodeOp::Prim(Op::Binary(b, c)) => KKind::Binary(*b, *c),
            NodeOp::Prim(Op::Where(_)) => KKind::Where,
            NodeOp::Prim(Op::Cast(_)) => KKind::Cast,
            NodeOp::Prim(Op::Reshape(_)) => KKind::Same,
            NodeOp::Prim(Op::Reduce(r, ..)) => KKind::Reduce(*r),
            NodeOp::Prim(Op::Expand(_)) => KKind::Broadcast,
            other => unreachable!("{other:?} is not fusable"),
        };
        if !matches!(kind, KKind::Same | KKind::Broadcast | KKind::Const(_)) || grp.members.len() == 1 {
            names.push(node.name());
        }
        let row = is_row(node.numel());
        // A row value, possibly seen through the broadcast that spreads it over the row.
        let row_arg = |a: &ValueRef, ops: &[KOp]| {
            let mut a = *a;
            loop {
                match a {
                    ValueRef::Op(j) if matches!(ops[j].kind, KKind::Broadcast | KKind::Same) && !ops[j].row => a = ops[j].args[0],
                    ValueRef::Op(j) => return ops[j].row,
                    ValueRef::In(j) => return inputs[j].row,
                }
            }
        };
        if let KKind::Binary(BinaryOp::Div, c) = kind {
            if !row && c.is_float() && row_arg(&args[1], &ops) {
                // Dividing a row by its per-row value: one reciprocal per row, then a multiply
                // per element (as the eager softmax kernel does; within an ulp of dividing).
                ops.push(KOp { kind: KKind::Const(1.0), args: vec![], dtype: c, row: true });
                let one = ValueRef::Op(ops.len() - 1);
                ops.push(KOp { kind: KKind::Binary(BinaryOp::Div, c), args: vec![one, args[1]], dtype: c, row: true });
                let recip = ValueRef::Op(ops.len() - 1);
                ops.push(KOp { kind: KKind::Binary(BinaryOp::Mul, c), args: vec![args[0], recip], dtype: node.dtype, row });
                val.insert(m, ValueRef::Op(ops.len() - 1));
                continue;
            }
        }
        ops.push(KOp { kind, args, dtype: node.dtype, row });
        val.insert(m, ValueRef::Op(ops.len() - 1));
    }
    // Stored: values read outside the group, outputs and write-backs.
    let mut outputs = vec![];
    for &m in &grp.members {
        let read_outside = users[m] > readers[m].iter().filter(|&&j| group_of[j] == me).count();
        if read_outside {
            let ValueRef::Op(k) = val[&m] else { unreachable!("members are ops") };
            outputs.push((k, m));
        }
    }
    names.dedup();
    names.truncate(6);
    let name = format!("fused_{}_{counter}", names.join("_"));
    // The iteration shape: a member with the group's element count (one-element members, like
    // constants, are the same at every element).
    let shape = grp.members.iter().rev().map(|&m| &g.nodes[m]).find(|n| n.numel() == grp.numel).map(|n| n.shape.clone()).unwrap_or_else(|| vec![grp.numel]);
    let single = outputs.iter().map(|&(_, m)| matches!(space, Space::Flat { numel } if numel > 1) && g.nodes[m].numel() == 1).collect();
    let row_pads = vec![None; outputs.len()];
    FusedKernel { name, device: g.nodes[grp.members[0]].device, space, shape, inputs, ops, outputs, single, row_pads, memo: KernelMemo::default() }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::compile::{compile_with, Backend, CompileOptions};
    use crate::nn::functional as F;
    use crate::{Device, Result, Tensor};
    use std::sync::{Arc, Mutex};

    /// The graph `f` traces to on the CPU.
    pub(crate) fn host_graph_of(args: &[Tensor], f: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static) -> Graph {
        let seen = Arc::new(Mutex::new(None));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            *s2.lock().unwrap() = Some(g.clone());
            Ok(g.eager_runner())
        });
        compile_with(CompileOptions::new().backend(backend), f).call(args).unwrap();
        let traced = seen.lock().unwrap().take();
        traced.unwrap()
    }

    /// The graph `f` traces to on the CPU, with every node moved to the GPU (scheduling is pure:
    /// it only reads the graph, so it runs without one).
    pub(crate) fn graph_of(args: &[Tensor], f: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static) -> Graph {
        host_graph_of(args, f).as_on_cuda()
    }

    fn gemms(g: &Graph) -> Vec<(Gemm, Option<String>)> {
        let readers = g.readers();
        let users = g.users();
        (0..g.nodes.len()).filter(|&i| matches!(g.nodes[i].op, NodeOp::Prim(Op::Matmul))).map(|i| plan_gemm(g, &readers, &users, i)).collect()
    }

    fn r(shape: &[usize], dt: DType) -> Tensor {
        Tensor::randn(shape, DType::F32, &Device::Cpu).unwrap().to_dtype(dt).unwrap()
    }

    /// A bias's gradient (a matrix's column sum, a mid kernel) and an update of the bias by a
    /// one-element stored value (an optimiser's step-dependent rate): the update, per column,
    /// stays out of the mid kernel, which holds stored inputs only as values of its walk.
    #[test]
    fn a_mid_kernel_reads_no_one_element_input_per_row() {
        let args = [r(&[64, 32], DType::F32), r(&[32], DType::F32), r(&[1], DType::F32)];
        let g = graph_of(&args, |xs| Ok(vec![xs[1].sub(&xs[0].tanh()?.sum(&[0], false)?.mul(&xs[2].expand(&[32])?)?)?]));
        let s = schedule(&g);
        let mids: Vec<&FusedKernel> = s.kernels.iter().filter(|k| matches!(k.space, Space::Mid { .. })).collect();
        assert_eq!(mids.len(), 1, "{}", s.kernels.iter().map(|k| k.describe()).collect::<Vec<_>>().join("\n"));
        let k = mids[0];
        // Every per-row op reads per-row values (through views), never a full input.
        let mut row_valued: Vec<bool> = vec![];
        for op in &k.ops {
            let reads_row = |a: &ValueRef| match a {
                ValueRef::In(j) => k.inputs[*j].row,
                ValueRef::Op(j) => row_valued[*j],
            };
            let row = op.row && (op.args.is_empty() || op.args.iter().all(reads_row) || matches!(op.kind, KKind::Reduce(_)));
            assert!(!op.row || row, "{}", k.describe());
            row_valued.push(op.row);
        }
        assert!(s.kernels.len() >= 2, "the update is a kernel of its own");
    }

    /// A value a kernel loads through a reshape that a product reads too (attention's q, k and v
    /// gradients concatenated, then summed for the bias and multiplied for the weight): the
    /// kernel loads the view, and stores no copy of it.
    #[test]
    fn a_kernel_stores_no_copy_of_what_it_loads() {
        let args = [r(&[4, 8, 16], DType::BF16), r(&[4, 8, 32], DType::BF16), r(&[1, 48, 24], DType::BF16)];
        let g = graph_of(&args, |xs| {
            let v = crate::ops::movement::cat(&[&xs[0], &xs[1]], 2)?.reshape(&[32, 48])?;
            Ok(vec![v.sum(&[0], false)?, v.reshape(&[1, 32, 48])?.matmul(&xs[2])?])
        });
        let s = schedule(&g);
        assert!(!s.kernels.is_empty());
        for k in &s.kernels {
            for (o, _) in &k.outputs {
                let mut v = ValueRef::Op(*o);
                while let ValueRef::Op(j) = v {
                    if k.ops[j].kind != KKind::Same {
                        break;
                    }
                    v = k.ops[j].args[0];
                }
                assert!(matches!(v, ValueRef::Op(_)), "an output is a view of an input: {}", k.describe());
            }
        }
    }

    /// A one-row layer norm whose output only a product reads (a decode step's) is run by the
    /// product's kernel; not where it covers several rows, where another step reads its output,
    /// or where the product has too many columns for every block to compute the row again,
    /// unless the product ends in an argmax (a greedy step's output head: a few blocks per SM).
    #[test]
    fn a_one_row_kernel_becomes_the_prologue_of_the_product_reading_its_row() {
        let prologues = |rows: usize, n: usize, also_read: bool, argmax: bool| {
            let (x, w) = (r(&[1, rows, 64], DType::BF16), r(&[n, 64], DType::BF16));
            let g = graph_of(&[x], move |xs| {
                let y = F::layer_norm(&xs[0], &[64], None, None, 1e-5)?;
                let p = y.matmul(&w.t()?)?;
                let mut outs = vec![if argmax { p.argmax(-1, false)? } else { p }];
                if also_read {
                    outs.push(y);
                }
                Ok(outs)
            });
            let s = schedule(&g);
            s.gemms.iter().filter_map(|gm| gm.prologue).filter(|p| matches!(s.kernels[p.kernel].space, Space::Rows { rows: 1, .. })).count()
        };
        assert_eq!(prologues(1, 96, false, false), 1);
        assert_eq!(prologues(2, 96, false, false), 0, "two rows");
        assert_eq!(prologues(1, 96, true, false), 0, "the normalised row is an output too");
        assert_eq!(prologues(1, MAX_PROLOGUE_COLUMNS + 8, false, false), 0, "too many columns");
        if crate::switches::gemv_argmax_on() {
            assert_eq!(prologues(1, MAX_PROLOGUE_COLUMNS + 8, false, true), 1, "many columns, then their argmax");
        }
        // A product whose bias is the kernel's other output (the residual sum it stores from its
        // first block only): the layer norm stays a launch of its own.
        let args = [r(&[1, 1, 64], DType::BF16), r(&[1, 1, 64], DType::BF16)];
        let w = r(&[64, 64], DType::BF16);
        let g = graph_of(&args, move |xs| {
            let h = xs[0].add(&xs[1])?;
            Ok(vec![F::layer_norm(&h, &[64], None, None, 1e-5)?.matmul(&w)?.add(&h)?])
        });
        let s = schedule(&g);
        assert!(s.gemms.iter().all(|gm| gm.prologue.is_none()), "{:?}", s.gemms);
    }

    #[test]
    fn the_argmax_of_a_one_row_product_joins_its_step() {
        // A greedy decode step's next token: the tied output head's product (a transposed
        // weight), reshaped, then the index of its largest column.
        let argmax_joins = |rows: usize, also_return_logits: bool, dim: i64| {
            let w = r(&[40, 16], DType::BF16);
            let g = graph_of(&[r(&[rows, 16], DType::BF16)], move |xs| {
                let logits = xs[0].matmul(&w.t()?)?.reshape(&[rows as i64, 1, 40])?;
                let next = logits.argmax(dim, false)?;
                Ok(if also_return_logits { vec![next, logits] } else { vec![next] })
            });
            let (readers, users) = (g.readers(), g.users());
            let mm = (0..g.nodes.len()).find(|&i| matches!(g.nodes[i].op, NodeOp::Prim(Op::Matmul))).unwrap();
            let gm = with_argmax(&g, &readers, &users, plan_gemm(&g, &readers, &users, mm).0);
            if gm.argmax {
                assert!(matches!(g.nodes[gm.out()].op, NodeOp::Prim(Op::Reduce(ReduceOp::ArgMax, ..))), "{}", gm.describe(&g));
                assert!(gm.describe(&g).contains("then the argmax"), "{}", gm.describe(&g));
            }
            gm.argmax
        };
        assert!(argmax_joins(1, false, -1));
        assert!(!argmax_joins(2, false, -1), "two rows");
        assert!(!argmax_joins(1, true, -1), "the logits are an output too");
        assert!(!argmax_joins(1, false, 0), "along another dim");
    }

    #[test]
    fn gelu_joins_the_epilogue_of_half_precision_products_only() {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let (w, b) = (r(&[48, 64], dt), r(&[48], dt));
            let g = graph_of(&[r(&[1, 64], dt)], move |xs| Ok(vec![F::linear(&xs[0], &w, Some(&b))?.gelu_tanh()?]));
            let found = gemms(&g);
            assert_eq!(found.len(), 1);
            let gm = &found[0].0;
            let half = dt != DType::F32;
            assert_eq!(gm.act, half.then_some(Activation::GeluTanh), "{dt:?}: {gm:?}");
            assert_eq!(gm.describe(&g).contains("GELU_BIAS"), half, "{}", gm.describe(&g));
            // F32: the GELU is a kernel of its own after the bias epilogue.
            let s = schedule(&g);
            assert_eq!((s.kernels.len(), s.gemms.len()), (usize::from(!half), 1), "{dt:?}");
        }
    }

    #[test]
    fn an_activation_after_a_reshape_of_the_sum_joins_the_epilogue() {
        // GPT-2's Conv1D: a product over rows, shaped back to [batch, seq, n], then GELU.
        let (w, b) = (r(&[64, 48], DType::BF16), r(&[48], DType::BF16));
        let g = graph_of(&[r(&[1, 1, 64], DType::BF16)], move |xs| Ok(vec![b.addmm(&xs[0].reshape(&[1, 64])?, &w, 1.0, 1.0)?.reshape(&[1, 1, 48])?.gelu_tanh()?]));
        let found = gemms(&g);
        let gm = &found[0].0;
        assert_eq!(gm.act, Some(Activation::GeluTanh), "{}", gm.describe(&g));
        assert_eq!(gm.out(), g.outputs[0]);
        assert_eq!(schedule(&g).kernels.len(), 0, "{}", gm.describe(&g));
    }

    #[test]
    fn updates_of_captured_tensors_of_one_size_share_kernels() {
        // Six state tensors of 16 elements and two of 32, each updated from the argument: an
        // optimiser's step in small. Each update reads its tensor and the argument and writes
        // the tensor back (two operands each beside the shared argument).
        let state = || -> Vec<Tensor> { [16, 16, 16, 16, 16, 16, 32, 32].iter().map(|&n| Tensor::zeros(&[n], DType::F32, &Device::Cpu).unwrap()).collect() };
        let step = |state: Vec<Tensor>| {
            move |xs: &[Tensor]| -> Result<Vec<Tensor>> {
                for (i, t) in state.iter().enumerate() {
                    let x = xs[0].narrow(0, 0, t.numel())?;
                    t.mul_scalar_(0.5)?;
                    t.add_(&x.mul_scalar(i as f64 + 1.0)?)?;
                }
                Ok(vec![xs[0].sum_all()?])
            }
        };
        let x = Tensor::arange(0.0, 32.0, 1.0, DType::F32, &Device::Cpu).unwrap();
        let g = graph_of(std::slice::from_ref(&x), step(state()));
        let s = schedule(&g);
        let updates = s.kernels.iter().filter(|k| k.outputs.iter().any(|(_, n)| g.mutations.iter().any(|&(_, v)| v == *n))).count();
        assert_eq!(updates, 2, "one kernel per size: {:?}", s.notes);
        assert_eq!(super::FLAT_LAUNCH_WORDS, crate::backend::cuda::kernels::codegen::PARAM_BASE, "the map kernels' launch block");
        // The same on the host, run: each tensor gets its own update.
        let s3 = state();
        let run = step(s3.clone());
        let f = crate::compile::compile(move |x: &Tensor| Ok(run(std::slice::from_ref(x))?.remove(0)));
        f.call(&x).unwrap();
        for (i, t) in s3.iter().enumerate() {
            let want: Vec<f32> = (0..t.numel()).map(|j| j as f32 * (i as f32 + 1.0)).collect();
            assert_eq!(t.to_vec::<f32>().unwrap(), want, "state {i}");
        }
    }

    #[test]
    fn linear_and_relu_become_one_library_call() {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let (w, b) = (r(&[48, 64], dt), r(&[48], dt));
            let g = graph_of(&[r(&[32, 64], dt)], move |xs| Ok(vec![F::linear(&xs[0], &w, Some(&b))?.relu()?]));
            let found = gemms(&g);
            assert_eq!(found.len(), 1);
            let (gm, note) = &found[0];
            assert!(note.is_none(), "{note:?}");
            assert!(gm.bias.is_some() && gm.act == Some(Activation::Relu), "{dt:?}: {gm:?}");
            assert_eq!(gm.out(), g.outputs[0]);
            assert!(matches!(g.nodes[gm.out()].op, NodeOp::Prim(Op::Unary(UnaryOp::Relu))));
            // The whole program is that one step plus views.
            let s = schedule(&g);
            assert_eq!((s.kernels.len(), s.gemms.len()), (0, 1), "{}", gm.describe(&g));
            assert!(gm.describe(&g).contains("RELU_BIAS"), "{}", gm.describe(&g));
        }
    }

    #[test]
    fn batch_norm_statistics_are_mid_kernels_on_the_gpu_alone() {
        // Training-mode batch norm of BF16 [8, 4, 6, 6]: on the GPU the mean and the variance are
        // one mid kernel each (the running statistics' update in the second's epilogue), storing
        // per-channel values only; the normalisation reads x itself. On the host the
        // reductions stay eager steps.
        let (rm, rv, w, b) = (r(&[4], DType::F32), r(&[4], DType::F32).abs().unwrap(), r(&[4], DType::F32), r(&[4], DType::F32));
        let bn = move |xs: &[Tensor]| Ok(vec![F::batch_norm(&xs[0], Some(&rm), Some(&rv), Some(&w), Some(&b), true, 0.1, 1e-5)?]);
        let g = crate::compile::recompute::recompute_cheap(&crate::compile::simplify::simplify(&graph_of(&[r(&[8, 4, 6, 6], DType::BF16)], bn.clone())));
        let s = schedule(&g);
        let mids: Vec<&FusedKernel> = s.kernels.iter().filter(|k| matches!(k.space, Space::Mid { outer: 8, rows: 4, inner: 36 })).collect();
        let all = || s.kernels.iter().map(|k| k.describe().to_string()).collect::<Vec<_>>();
        assert_eq!(mids.len(), 2, "{:?}", all());
        for k in &mids {
            assert!(k.outputs.iter().all(|(o, _)| k.ops[*o].row), "{}", k.describe());
        }
        // Every full-size value a kernel reads is the input itself.
        let x = g.input_nodes()[0];
        for k in &s.kernels {
            for i in k.inputs.iter().filter(|i| !i.row && g.nodes[i.node].numel() == 8 * 4 * 36) {
                let mut n = i.node;
                while let NodeOp::Prim(Op::Reshape(_) | Op::Expand(_)) = g.nodes[n].op {
                    n = g.nodes[n].args[0];
                }
                assert!(n == x || g.nodes[n].numel() < 8 * 4 * 36, "{} reads %{}: {:?}", k.describe(), i.node, all());
            }
        }
        let host = crate::compile::simplify::simplify(&host_graph_of(&[r(&[8, 4, 6, 6], DType::BF16)], bn));
        assert!(schedule(&host).kernels.iter().all(|k| !matches!(k.space, Space::Mid { .. })));
    }

    #[test]
    fn channels_last_batch_norm_statistics_are_column_mid_kernels_on_the_gpu() {
        // A convolution laid out channels-last (`layout`), then training-mode batch norm: its
        // statistics reduce the leading dims of `[N, H, W, C]` values, one mid kernel each with
        // an inner dim of 1 (the column kernel), storing per-channel values only.
        let (rm, rv, w, b) = (r(&[4], DType::F32), r(&[4], DType::F32).abs().unwrap(), r(&[4], DType::F32), r(&[4], DType::F32));
        let x = r(&[8, 3, 6, 6], DType::F32).to_memory_format(crate::MemoryFormat::ChannelsLast).unwrap();
        let k = r(&[4, 3, 3, 3], DType::F32);
        let args = [x, k];
        let f = move |xs: &[Tensor]| Ok(vec![F::batch_norm(&F::conv2d(&xs[0], &xs[1], None, F::Conv2dArgs { padding: (1, 1), ..Default::default() })?, Some(&rm), Some(&rv), Some(&w), Some(&b), true, 0.1, 1e-5)?]);
        let g = crate::compile::layout::channels_last(&graph_of(&args, f), &args);
        let g = crate::compile::recompute::recompute_cheap(&crate::compile::simplify::simplify(&g));
        let s = schedule(&g);
        let all = || s.kernels.iter().map(|k| k.describe().to_string()).collect::<Vec<_>>();
        let cols: Vec<&FusedKernel> = s.kernels.iter().filter(|k| matches!(k.space, Space::Mid { outer: 288, rows: 4, inner: 1 })).collect();
        assert_eq!(cols.len(), 2, "{:?}", all());
        for k in &cols {
            assert!(k.outputs.iter().all(|(o, _)| k.ops[*o].row), "{}", k.describe());
        }
    }

    #[test]
    fn row_kernels_that_differ_in_where_a_view_sits_share_one_code() {
        // The first softmax's output is reshaped into the product (a view at its end), the
        // second reads the product's result through a reshape (a view at its start): one
        // signature, one compiled kernel.
        let m = r(&[64, 64], DType::F32);
        let g = graph_of(&[r(&[8, 64], DType::F32)], move |xs| Ok(vec![xs[0].softmax(-1)?.matmul(&m)?.softmax(-1)?]));
        let s = schedule(&crate::compile::simplify::simplify(&g));
        let rows: Vec<&FusedKernel> = s.kernels.iter().filter(|k| matches!(k.space, Space::Rows { .. })).collect();
        assert_eq!(rows.len(), 2, "{:?}", s.kernels.iter().map(|k| k.describe().to_string()).collect::<Vec<_>>());
        assert_ne!(rows[0].describe_now().split_once(':').map(|x| x.1.replace(char::is_numeric, "")), rows[1].describe_now().split_once(':').map(|x| x.1.replace(char::is_numeric, "")), "the case this checks: the views sit apart");
        assert_eq!(rows[0].signature(), rows[1].signature());
    }

    #[test]
    fn layer_norms_with_a_product_between_share_one_code() {
        // Both norms make the same constants (the row length, eps): simplified, each kernel
        // still holds its own, so the two have one signature (one compiled kernel).
        let (w, b, m) = (r(&[64], DType::F32), r(&[64], DType::F32), r(&[64, 64], DType::F32));
        let g = graph_of(&[r(&[8, 64], DType::F32)], move |xs| {
            let y = F::layer_norm(&xs[0], &[64], Some(&w), Some(&b), 1e-5)?.matmul(&m)?;
            Ok(vec![F::layer_norm(&y, &[64], Some(&w), Some(&b), 1e-5)?])
        });
        let s = schedule(&crate::compile::simplify::simplify(&g));
        let rows: Vec<&FusedKernel> = s.kernels.iter().filter(|k| matches!(k.space, Space::Rows { .. })).collect();
        assert_eq!(rows.len(), 2, "{:?}", s.kernels.iter().map(|k| k.describe().to_string()).collect::<Vec<_>>());
        assert_eq!(rows[0].signature(), rows[1].signature());
    }

    #[test]
    fn reshapes_between_library_calls_are_views() {
        // An attention-like output reshaped twice on its way into a product: both reshapes are
        // views of its buffer, not a copy kernel.
        let w = r(&[64, 64], DType::F32);
        let g = graph_of(&[r(&[4, 2, 64], DType::F32)], move |xs| {
            let y = xs[0].matmul(&w)?.reshape(&[4, 2, 8, 8])?;
            Ok(vec![y.reshape(&[8, 64])?.reshape(&[4, 2, 64])?.matmul(&w)?])
        });
        let s = schedule(&g);
        assert_eq!((s.kernels.len(), s.gemms.len()), (0, 2), "{:?}", s.steps);
    }

    #[test]
    fn a_padding_of_a_row_kernels_output_is_stored_by_the_kernel() {
        // The gradient of a product padded to aligned columns: the row kernel writes the padded
        // rows, through the reshapes between; no step of its own pads them.
        let x = r(&[6, 50], DType::BF16);
        let g = graph_of(&[x], |xs| Ok(vec![xs[0].to_dtype(DType::F32)?.softmax(-1)?.to_dtype(DType::BF16)?.reshape(&[2, 3, 50])?.reshape(&[6, 50])?.pad(&[0, 6], 0.0)?]));
        let s = schedule(&g);
        let pad = (0..g.nodes.len()).find(|&i| matches!(g.nodes[i].op, NodeOp::Prim(Op::Pad(..)))).unwrap();
        let k = s.kernels.iter().find(|k| matches!(k.space, Space::Rows { .. })).unwrap();
        let m = k.outputs.iter().position(|o| o.1 == pad).expect("the kernel stores the padding");
        assert_eq!(k.row_pads[m], Some(crate::kir::RowPad { cols: 6, value: 0.0 }));
        assert!(s.steps.iter().all(|st| !matches!(st, Step::Node(n) if *n == pad || matches!(g.nodes[*n].op, NodeOp::Prim(Op::Reshape(_))))));
        // Padding before the last dim, or a value read elsewhere too, stays a step of its own.
        let x = r(&[6, 50], DType::F32);
        let g = graph_of(&[x], |xs| Ok(vec![xs[0].softmax(-1)?.pad(&[0, 0, 0, 2], 0.0)?]));
        assert!(schedule(&g).kernels.iter().all(|k| k.row_pads.iter().all(Option::is_none)));
        let x = r(&[6, 50], DType::F32);
        let g = graph_of(&[x], |xs| {
            let y = xs[0].softmax(-1)?;
            Ok(vec![y.pad(&[0, 6], 0.0)?, y])
        });
        assert!(schedule(&g).kernels.iter().all(|k| k.row_pads.iter().all(Option::is_none)));
    }

    #[test]
    fn a_bias_add_alone_and_over_folded_batches() {
        // [2, 5, 64] @ W^T folds into one [10, 64] product; the bias add follows its reshape.
        let (w, b) = (r(&[48, 64], DType::F32), r(&[48], DType::F32));
        let g = graph_of(&[r(&[2, 5, 64], DType::F32)], move |xs| Ok(vec![F::linear(&xs[0], &w, Some(&b))?.gelu()?]));
        let (gm, note) = &gemms(&g)[0];
        assert!(note.is_none() && gm.bias.is_some() && gm.act.is_none(), "{gm:?} {note:?}");
        assert!(matches!(g.nodes[gm.out()].op, NodeOp::Prim(Op::Binary(BinaryOp::Add, _))));
        // gelu stays a generated kernel after the product.
        let s = schedule(&g);
        assert_eq!((s.kernels.len(), s.gemms.len()), (1, 1));
        let pos = |want: fn(&Step) -> bool| s.steps.iter().position(want).unwrap();
        assert!(pos(|st| matches!(st, Step::Gemm(_))) < pos(|st| matches!(st, Step::Kernel(_))));
    }

    #[test]
    fn a_relu_whose_input_is_also_needed_stays_outside() {
        let (w, b) = (r(&[8, 16], DType::F32), r(&[8], DType::F32));
        let g = graph_of(&[r(&[4, 16], DType::F32)], move |xs| {
            let y = F::linear(&xs[0], &w, Some(&b))?;
            Ok(vec![y.relu()?, y])
        });
        let (gm, _) = &gemms(&g)[0];
        assert!(gm.bias.is_some() && gm.act.is_none(), "{gm:?}");
    }

    #[test]
    fn a_value_and_its_reshape_are_stored_once() {
        // A ReLU'd hidden layer read by the next product (through its [1, M, N] view) and by
        // the backward's mask: one output, the view a step of its own.
        let x = r(&[64, 32], DType::F32);
        let (w1, w2) = (r(&[32, 16], DType::F32), r(&[16, 8], DType::F32));
        let g = graph_of(&[x], move |xs| {
            let h = (xs[0].matmul(&w1)? + 1.0)?.exp()?;
            let mask = h.gt_scalar(1.5)?;
            Ok(vec![h.reshape(&[1, 64, 16])?.matmul(&w2.reshape(&[1, 16, 8])?)?, mask])
        });
        let s = schedule(&g);
        let k = s.kernels.iter().find(|k| k.name.contains("exp")).expect("the exp kernel");
        let stored: Vec<usize> = k.outputs.iter().map(|&(o, _)| o).collect();
        assert!(stored.iter().all(|&o| !matches!(k.ops[o].kind, KKind::Same)), "{}", k.describe());
        assert_eq!(stored.len(), 2, "the exponential and the mask: {}", k.describe());
        let view = s.steps.iter().any(|st| matches!(st, Step::Node(n) if matches!(&g.nodes[*n].op, NodeOp::Prim(Op::Reshape(_)))));
        assert!(view, "the reshape is a step of its own");
    }

    #[test]
    fn ids_spread_over_rows_for_a_scatter_are_a_view() {
        // An embedding's backward: the ids, spread over each row's features, index the
        // scatter of the rows' gradients.
        let ids = Tensor::from_vec(vec![3i64, 1, 3, 0, 7, 1], &[6], &Device::Cpu).unwrap();
        let g = graph_of(&[ids, r(&[6, 4], DType::F32)], |xs| {
            let spread = xs[0].reshape(&[6, 1])?.expand(&[6, 4])?;
            Ok(vec![Tensor::zeros(&[10, 4], DType::F32, &Device::Cpu)?.scatter_add(0, &spread, &xs[1])?])
        });
        let s = schedule(&g);
        assert!(s.kernels.iter().all(|k| k.inputs.iter().all(|i| i.dtype != DType::I64)), "no kernel copies the ids: {:?}", s.kernels.iter().map(|k| k.describe()).collect::<Vec<_>>());
    }

    type MakeGraph = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

    #[test]
    fn epilogues_are_refused_where_dtypes_or_shapes_do_not_allow() {
        let cases: Vec<(&str, Vec<Tensor>, MakeGraph)> = vec![
            // An f16 product plus an f32 bias adds in f32.
            ("computes in float32", vec![r(&[4, 16], DType::F16), r(&[16, 8], DType::F16), r(&[8], DType::F32)], Box::new(|xs| Ok(vec![(xs[0].matmul(&xs[1])? + &xs[2])?]))),
            ("float64 products", vec![r(&[4, 16], DType::F64), r(&[16, 8], DType::F64), r(&[8], DType::F64)], Box::new(|xs| Ok(vec![(xs[0].matmul(&xs[1])? + &xs[2])?]))),
            // One value per row, not per column.
            ("not a vector of 8", vec![r(&[4, 16], DType::F32), r(&[16, 8], DType::F32), r(&[4, 1], DType::F32)], Box::new(|xs| Ok(vec![(xs[0].matmul(&xs[1])? + &xs[2])?]))),
            ("a batch of 3", vec![r(&[3, 4, 16], DType::F32), r(&[3, 16, 8], DType::F32), r(&[8], DType::F32)], Box::new(|xs| Ok(vec![(xs[0].matmul(&xs[1])? + &xs[2])?]))),
        ];
        for (why, args, f) in cases {
            let g = graph_of(&args, f);
            let (gm, note) = &gemms(&g)[0];
            assert!(gm.bias.is_none(), "{why}: {gm:?}");
            assert!(note.as_deref().is_some_and(|n| n.contains(why)), "{why}: {note:?}");
        }
        // A product whose value is also returned keeps it: no epilogue, nothing to explain.
        let g = graph_of(&[r(&[4, 16], DType::F32), r(&[16, 8], DType::F32), r(&[8], DType::F32)], |xs| {
            let y = xs[0].matmul(&xs[1])?;
            Ok(vec![(&y + &xs[2])?, y])
        });
        let (gm, note) = &gemms(&g)[0];
        assert!(gm.bias.is_none() && note.is_none(), "{gm:?} {note:?}");
        // On the CPU a product stays an eager step.
        let mut cpu = g.clone();
        for n in &mut cpu.nodes {
            n.device = Device::Cpu;
        }
        assert!(schedule(&cpu).gemms.is_empty());
    }
}
