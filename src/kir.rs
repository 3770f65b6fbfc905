//! The kernel IR: what a fused kernel computes, between the compiler that builds it
//! (`compile::fuse`) and the backends that generate and run code for it
//! (`backend::cuda::kernels::fused`, `backend::cpu::fused`). Nothing here says how a backend caches
//! its code: each keeps that in the kernel's memo slot or keyed by `FusedKernel::signature`.
//!
//! Values are indexed linearly: a pointwise value at element i, a row value at row i / cols.

use crate::dtype::CType;
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::{DType, Device};
use std::any::Any;
use std::fmt::Write;
use std::sync::OnceLock;

/// A graph node (`compile::graph::NodeId`): where a kernel's inputs come from and its outputs go.
pub(crate) type NodeId = usize;

/// Longest row a row kernel (eager or fused) keeps in registers: 512 threads × 32 values.
/// Longer rows, up to `MAX_LOOPED_ROW`, are walked again by each pass (`RowPlan::recomputing`).
pub(crate) const MAX_ROW: usize = 32 * 512;
/// Longest row a product of one row computes first itself (`fuse::row_prologues`): at most 32
/// values per thread of its 256, and the row in at most 32 KiB of each block's shared memory.
pub(crate) const MAX_PROLOGUE_ROW: usize = 8192;

/// Longest row a row kernel takes at all (column indices stay 32-bit on the GPU).
pub(crate) const MAX_LOOPED_ROW: usize = 1 << 30;

/// How a fused kernel walks its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    /// Every value has `numel` elements.
    Flat { numel: usize },
    /// Full values have rows × cols elements, row values one per row.
    Rows { rows: usize, cols: usize },
    /// Full values have outer × rows × inner elements, row values one per middle index: the
    /// reductions sum over the outer and inner dims (batch norm's statistics of `[N, C, H, W]`
    /// per channel). One pass over the full values; no full value reads a row value. CUDA only.
    Mid { outer: usize, rows: usize, inner: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ValueRef {
    In(usize),
    Op(usize),
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum KKind {
    Unary(UnaryOp),
    Binary(BinaryOp, DType),
    Where,
    Cast,
    Const(f64),
    Reduce(ReduceOp),
    /// A row value seen by every element of its row.
    Broadcast,
    /// A reshape: the same elements in the same linear order.
    Same,
}

#[derive(Clone, Debug)]
pub(crate) struct KOp {
    pub kind: KKind,
    pub args: Vec<ValueRef>,
    pub dtype: DType,
    /// One value per row (in a `Rows` kernel).
    pub row: bool,
}

impl KOp {
    /// The type the op computes in: a unary op's rule (`UnaryOp::compute_type`), else its
    /// dtype's.
    pub(crate) fn unary_type(&self) -> CType {
        match self.kind {
            KKind::Unary(u) => u.compute_type(self.dtype),
            _ => CType::of(self.dtype),
        }
    }
    /// (operand type, result type) of a binary op (`BinaryOp::compute_types`).
    pub(crate) fn binary_types(&self) -> (CType, CType) {
        let KKind::Binary(b, compute) = self.kind else { unreachable!("not a binary op") };
        b.compute_types(compute)
    }
}

/// Columns stored after each row of a row kernel's full output: `cols` of `value` (the padding
/// a padded product's gradient needs, written with the row instead of by a copy after it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RowPad {
    pub cols: usize,
    pub value: f64,
}

#[derive(Clone, Debug)]
pub(crate) struct KInput {
    pub node: NodeId,
    pub dtype: DType,
    pub row: bool,
    /// A full input of a row kernel whose value at column c is `start + c * step` in every
    /// row, as (start, step): an `Arange` along the row spread over the rows (cross-entropy's
    /// column indices, compared with each row's class), marked by `fuse::columns_of` under
    /// `KILN_ROW_COLUMNS=1`: the GPU's row kernels then compute it rather than read it.
    pub columns: Option<(f64, f64)>,
}

/// One generated kernel: its inputs (stored values), ops in order, and which ops it stores.
#[derive(Clone, Debug)]
pub(crate) struct FusedKernel {
    pub name: String,
    pub device: Device,
    pub space: Space,
    /// The iteration shape of a flat kernel (its last op's shape).
    pub shape: Vec<usize>,
    pub inputs: Vec<KInput>,
    pub ops: Vec<KOp>,
    /// (op index, graph node it produces)
    pub outputs: Vec<(usize, NodeId)>,
    /// Per output: one element computed beside a larger flat space (an optimiser's step count
    /// next to a parameter's update), stored once rather than at every element.
    pub single: Vec<bool>,
    /// Per output of a `Rows` kernel on the GPU: columns of a constant stored after each row,
    /// when the output's node is the row values padded (`fuse::pad_row_outputs`).
    pub row_pads: Vec<Option<RowPad>>,
    /// What is derived from the kernel once and reused at every launch.
    pub memo: KernelMemo,
}

/// What is derived from a kernel once, so that later launches neither rebuild nor re-hash it
/// (the host time of a compiled call is mostly per-launch work): its text forms, and a slot
/// the backend that runs it fills with what it derives (code, loaded functions), opaque here.
/// A clone starts empty.
#[derive(Default)]
pub(crate) struct KernelMemo {
    describe: OnceLock<String>,
    signature: OnceLock<String>,
    backend: OnceLock<Box<dyn Any + Send + Sync>>,
}

impl Clone for KernelMemo {
    fn clone(&self) -> Self {
        KernelMemo::default()
    }
}

impl std::fmt::Debug for KernelMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.backend.get().is_some() { "memo(backend)" } else { "memo" })
    }
}

impl KernelMemo {
    /// The backend's memo of type `T`, made on first use; None where another type holds the
    /// slot (a kernel runs on one backend, so that is never expected).
    pub(crate) fn backend<T: Default + Send + Sync + 'static>(&self) -> Option<&T> {
        self.backend.get_or_init(|| Box::<T>::default()).downcast_ref()
    }
}

impl FusedKernel {
    /// The value `a` names, past reshapes and broadcasts (which computes nothing of its own).
    pub(crate) fn through_views(&self, mut a: ValueRef) -> ValueRef {
        while let ValueRef::Op(j) = a {
            match self.ops[j].kind {
                KKind::Same | KKind::Broadcast => a = self.ops[j].args[0],
                _ => break,
            }
        }
        a
    }

    /// The positions in `outputs` of a row kernel's full outputs (one value per element, not
    /// per row), in order.
    pub(crate) fn full_outputs(&self) -> Vec<usize> {
        (0..self.outputs.len()).filter(|&m| !self.ops[self.outputs[m].0].row).collect()
    }

    /// A text form of what it computes (for `KILN_LOG=fusion` and as a cache key).
    pub(crate) fn describe(&self) -> &str {
        self.memo.describe.get_or_init(|| self.describe_now())
    }

    /// What a row kernel's code depends on (its constants included), graph positions and sizes
    /// left out: kernels of one signature (the residual add and layer norm of every layer of
    /// a transformer, in one graph or several) share one compiled kernel.
    pub(crate) fn signature(&self) -> &str {
        self.memo.signature.get_or_init(|| self.signature_with(|_| false))
    }

    /// The signature with the constants `param` names (by op) left out: the code reads them
    /// from launch words, so kernels differing only in those share it.
    pub(crate) fn signature_with(&self, param: impl Fn(usize) -> bool) -> String {
        {
            let mut s = match self.space {
                Space::Flat { .. } => "flat:".to_string(),
                Space::Rows { .. } => "rows:".to_string(),
                Space::Mid { .. } => "mid:".to_string(),
            };
            for i in &self.inputs {
                let _ = write!(s, " {:?}{}", i.dtype, if i.row { "(row)" } else { "" });
                if let Some((start, step)) = i.columns {
                    let _ = write!(s, "(columns {start} {step})");
                }
            }
            // Views (`Same`) are left out, their readers reading what they view: a reshape
            // that sits elsewhere in the kernel (before a product's output is normalised, or
            // after) computes the same code.
            let mut seen: Vec<ValueRef> = Vec::with_capacity(self.ops.len());
            // Whether each op written so far is a row value.
            let mut kept_rows: Vec<bool> = vec![];
            let arg = |a: &ValueRef, seen: &[ValueRef]| match a {
                ValueRef::In(j) => ValueRef::In(*j),
                ValueRef::Op(j) => seen[*j],
            };
            for (i, o) in self.ops.iter().enumerate() {
                if o.kind == KKind::Same {
                    let viewed = arg(&o.args[0], &seen);
                    let row = match viewed {
                        ValueRef::In(j) => self.inputs[j].row,
                        ValueRef::Op(j) => kept_rows[j],
                    };
                    if row == o.row {
                        seen.push(viewed);
                        continue;
                    }
                }
                let args: Vec<ValueRef> = o.args.iter().map(|a| arg(a, &seen)).collect();
                let kind = if param(i) { "Param".to_string() } else { format!("{:?}", o.kind) };
                let _ = write!(s, " | {kind}{:?}:{:?}{}", args, o.dtype, if o.row { "(row)" } else { "" });
                seen.push(ValueRef::Op(kept_rows.len()));
                kept_rows.push(o.row);
            }
            for ((o, _), pad) in self.outputs.iter().zip(&self.row_pads) {
                let _ = write!(s, " | <-{:?}", seen[*o]);
                if let Some(p) = pad {
                    let _ = write!(s, " +{}x{}", p.cols, p.value);
                }
            }
            s
        }
    }

    /// The name its generated code goes by: `fused_<ops>_<hash of what the code depends on>`,
    /// one name per compiled kernel however many graph positions share it.
    pub(crate) fn code_name(&self, code: &str) -> String {
        // `name` is `fused_<ops>_<counter>`: the counter gives way to the hash.
        let ops = self.name.rsplit_once('_').map_or(self.name.as_str(), |(ops, _)| ops);
        format!("{ops}_{:04x}", crate::hash::fnv64(&[code.as_bytes()]) & 0xffff)
    }

    pub(crate) fn describe_now(&self) -> String {
        let mut s = format!("{} {:?}:", self.name, self.space);
        for (k, i) in self.inputs.iter().enumerate() {
            let _ = write!(s, " in{k}=%{}{}", i.node, if i.row { "(row)" } else { "" });
        }
        for (k, o) in self.ops.iter().enumerate() {
            let _ = write!(s, " | t{k}={:?}{:?}:{:?}{}", o.kind, o.args, o.dtype, if o.row { "(row)" } else { "" });
        }
        for ((o, n), pad) in self.outputs.iter().zip(&self.row_pads) {
            let _ = write!(s, " | %{n}<-t{o}");
            if let Some(p) = pad {
                let _ = write!(s, " padded by {} of {}", p.cols, p.value);
            }
        }
        s
    }
}

/// Ops worth computing once and keeping (in registers on the GPU, in a row buffer on the CPU)
/// when several passes over the row read them (the rest are cheaper to recompute than to hold).
pub(crate) fn expensive(op: &KOp) -> bool {
    use crate::ops::{BinaryOp as B, UnaryOp as U};
    match op.kind {
        KKind::Unary(u) => !matches!(u, U::Neg | U::Abs | U::Sign | U::Relu | U::LogicalNot),
        KKind::Binary(b, _) => matches!(b, B::Pow | B::Div),
        _ => false,
    }
}

/// The plan of a row kernel. The row is walked in passes: one per reduction (its argument
/// folded into a per-thread accumulator, then a block reduction) and a last one storing the
/// full outputs. A full value is computed in each pass that reads it, from inputs loaded in
/// that pass, except where that would repeat work: an input read by several passes is loaded
/// once into an array (registers on the GPU), and so is an expensive op (an `exp`) read by
/// several passes. Both backends' row generators follow it.
pub(crate) struct RowPlan {
    /// Per op: it is one value per element (not per row).
    pub elem: Vec<bool>,
    /// Per pass (reductions in op order, then the output pass): the full inputs and ops it
    /// computes, and the ones it reads from register arrays.
    pub passes: Vec<RowPass>,
    pub in_array: Vec<bool>,
    pub op_array: Vec<bool>,
}

#[derive(Default, Clone)]
pub(crate) struct RowPass {
    pub inputs: Vec<usize>,
    pub ops: Vec<usize>,
}

impl RowPlan {
    pub(crate) fn new(k: &FusedKernel) -> RowPlan {
        RowPlan::with_arrays(k, true)
    }

    /// The plan for rows too long for arrays (`MAX_ROW`): every pass loads and computes all it
    /// needs again.
    pub(crate) fn recomputing(k: &FusedKernel) -> RowPlan {
        RowPlan::with_arrays(k, false)
    }

    fn with_arrays(k: &FusedKernel, arrays: bool) -> RowPlan {
        let n = k.ops.len();
        let in_elem = |a: &ValueRef, elem: &[bool]| match a {
            ValueRef::In(j) => !k.inputs[*j].row,
            ValueRef::Op(j) => elem[*j],
        };
        let mut elem = vec![false; n];
        for (i, op) in k.ops.iter().enumerate() {
            elem[i] = !matches!(op.kind, KKind::Reduce(_)) && op.args.iter().any(|a| in_elem(a, &elem));
        }
        let mut roots: Vec<Vec<ValueRef>> = k.ops.iter().filter(|o| matches!(o.kind, KKind::Reduce(_))).map(|o| vec![o.args[0]]).collect();
        roots.push(k.outputs.iter().filter(|(o, _)| !k.ops[*o].row).map(|(o, _)| ValueRef::Op(*o)).collect());
        // The full values a pass needs, walking back from its roots and stopping at ops held in
        // arrays computed by an earlier pass.
        let closure = |roots: &[ValueRef], stop: &dyn Fn(usize) -> bool| {
            let (mut ins, mut ops) = (vec![false; k.inputs.len()], vec![false; n]);
            let mut todo = roots.to_vec();
            while let Some(a) = todo.pop() {
                match a {
                    ValueRef::In(j) => ins[j] |= !k.inputs[j].row,
                    ValueRef::Op(i) if elem[i] && !ops[i] => {
                        ops[i] = true;
                        if !stop(i) {
                            todo.extend(k.ops[i].args.iter().copied());
                        }
                    }
                    ValueRef::Op(_) => {}
                }
            }
            (ins, ops)
        };
        // Expensive ops read by several passes get arrays (decided on the passes that read
        // them with everything recomputed) ...
        let mut reads = vec![0usize; n];
        for r in &roots {
            for (i, used) in closure(r, &|_| false).1.into_iter().enumerate() {
                reads[i] += used as usize;
            }
        }
        let op_array: Vec<bool> = (0..n).map(|i| arrays && elem[i] && reads[i] > 1 && expensive(&k.ops[i])).collect();
        // ... then each pass computes what it needs, reading arrays filled by earlier passes.
        let mut filled = vec![false; n];
        let mut passes = vec![];
        let mut in_reads = vec![0usize; k.inputs.len()];
        for r in &roots {
            let (ins, ops) = closure(r, &|i| filled[i]);
            for (j, used) in ins.iter().enumerate() {
                in_reads[j] += *used as usize;
            }
            let p = RowPass { inputs: (0..ins.len()).filter(|&j| ins[j]).collect(), ops: (0..n).filter(|&i| ops[i]).collect() };
            for &i in &p.ops {
                filled[i] |= op_array[i];
            }
            passes.push(p);
        }
        // (an input whose values the kernel computes, `KInput::columns`, takes no registers)
        let in_array = in_reads.iter().zip(&k.inputs).map(|(&c, i)| arrays && c > 1 && i.columns.is_none()).collect();
        RowPlan { elem, passes, in_array, op_array }
    }
}
