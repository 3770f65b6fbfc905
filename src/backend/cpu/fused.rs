//! The compiler's fused kernels on the CPU: a kernel's ops run over a chunk of elements (or one
//! row) at a time, so intermediates live in small buffers that stay in cache instead of
//! full-size tensors. Scalar semantics come from the op definitions, as in the eager loops.
//! Kernels the native code generator (`jit`) runs never come here.

use super::pointwise::{Map1, Map2};
use super::pool;
use super::{with_storage, CpuStorage, HostBuf, Operand};
use crate::dtype::CType;
use crate::kir::{FusedKernel, ValueRef, KKind, KOp, Space};
use crate::dtype::Elem;
use crate::ops::reduce::{Accumulate, ReduceOp};
use crate::storage::BackendStorage;
use crate::{DType, Result, Tensor};
use rayon::prelude::*;

/// Elements per chunk of a flat kernel: a few buffers of this size fit in L1/L2.
const CHUNK: usize = 4096;

/// A value over a chunk; one element stands for the whole chunk (a constant, a row value).
#[derive(Clone)]
enum Val {
    F32(HostBuf<f32>),
    F64(HostBuf<f64>),
    I64(HostBuf<i64>),
    Bool(HostBuf<bool>),
}

macro_rules! with_val {
    ($v:expr, $x:ident => $body:expr) => {
        match $v {
            Val::F32($x) => $body,
            Val::F64($x) => $body,
            Val::I64($x) => $body,
            Val::Bool($x) => $body,
        }
    };
}

impl Val {
    fn from_vec<C: Elem>(v: impl AsRef<[C]>, t: CType) -> Val {
        let v = v.as_ref();
        match t {
            CType::F32 => Val::F32(v.iter().map(|x| x.cast()).collect()),
            CType::F64 => Val::F64(v.iter().map(|x| x.cast()).collect()),
            CType::I64 => Val::I64(v.iter().map(|x| x.cast()).collect()),
            CType::Bool => Val::Bool(v.iter().map(|x| x.cast()).collect()),
        }
    }
    /// `n` zeros, in a buffer from the host caching allocator where it has one.
    fn zeros(t: CType, n: usize) -> Val {
        match t {
            CType::F32 => Val::F32(pool::zeros(n)),
            CType::F64 => Val::F64(pool::zeros(n)),
            CType::I64 => Val::I64(pool::zeros(n)),
            CType::Bool => Val::Bool(pool::zeros(n)),
        }
    }
    fn ctype(&self) -> CType {
        match self {
            Val::F32(_) => CType::F32,
            Val::F64(_) => CType::F64,
            Val::I64(_) => CType::I64,
            Val::Bool(_) => CType::Bool,
        }
    }
    /// This value as type `t`: borrowed when it already is.
    fn to(&self, t: CType) -> std::borrow::Cow<'_, Val> {
        if self.ctype() == t {
            return std::borrow::Cow::Borrowed(self);
        }
        std::borrow::Cow::Owned(with_val!(self, v => Val::from_vec(v, t)))
    }
    fn into_type(self, t: CType) -> Val {
        if self.ctype() == t {
            return self;
        }
        with_val!(self, v => Val::from_vec(&v, t))
    }
    fn as_vec<C: Elem>(&self) -> Vec<C> {
        with_val!(self, v => v.iter().map(|x| x.cast()).collect())
    }
}

fn operand<C: Copy>(v: &[C], n: usize) -> Operand<'_, C> {
    if v.len() == 1 && n != 1 {
        Operand::Scalar(v[0])
    } else {
        Operand::Slice(v)
    }
}

/// Runs a fused kernel on the host; returns its outputs (flat, or [rows, cols] / [rows]).
pub(crate) fn run(k: &FusedKernel, shape: &[usize], inputs: &[Tensor], into: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
    if matches!(k.space, Space::Mid { .. }) {
        return Err(crate::Error::Compile(format!("{}: mid reductions are fused on CUDA only", k.name)));
    }
    if k.row_pads.iter().any(Option::is_some) {
        return Err(crate::Error::Compile(format!("{}: padded row outputs are fused on CUDA only", k.name)));
    }
    if let Some(outs) = super::jit::run(k, shape, inputs, into) {
        return outs;
    }
    super::jit::count_interpreted();
    let (rows, cols) = match k.space {
        Space::Flat { numel } => (1, numel),
        Space::Rows { rows, cols } => (rows, cols),
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    };
    // Output m holds `len(m)` values; every block writes its own range of each, in place.
    let len = |m: usize| if k.single[m] { 1 } else if k.ops[k.outputs[m].0].row { rows } else { rows * cols };
    let mut bufs: Vec<Val> = (0..k.outputs.len()).map(|m| Val::zeros(CType::of(k.ops[k.outputs[m].0].dtype), len(m))).collect();
    let targets: Vec<Target> = bufs.iter_mut().map(Target::of).collect();
    let store = |m: usize, at: usize, v: &Val| targets[m].write(at, v);
    match k.space {
        Space::Flat { numel } => (0..numel.div_ceil(CHUNK)).into_par_iter().for_each(|b| {
            let start = b * CHUNK;
            for (m, v) in eval_chunk(k, inputs, start, (start + CHUNK).min(numel), 0).iter().enumerate() {
                // A one-element output is stored once, by the first chunk.
                match k.single[m] {
                    true if start == 0 => store(m, 0, v),
                    true => {}
                    false => store(m, start, v),
                }
            }
        }),
        Space::Rows { rows, cols } => {
            let per = (CHUNK * 4 / cols).max(1);
            (0..rows.div_ceil(per)).into_par_iter().for_each(|b| {
                for r in b * per..((b + 1) * per).min(rows) {
                    for (m, v) in eval_chunk(k, inputs, r * cols, r * cols + cols, r).iter().enumerate() {
                        store(m, if k.ops[k.outputs[m].0].row { r } else { r * cols }, v);
                    }
                }
            })
        }
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    }
    let mut outs = vec![];
    for (m, buf) in bufs.into_iter().enumerate() {
        let op = &k.ops[k.outputs[m].0];
        let storage = with_val!(buf, v => CpuStorage::from_vec_as(v, op.dtype));
        let s: Vec<usize> = match k.space {
            Space::Flat { .. } if k.single[m] => vec![1],
            Space::Flat { .. } => shape.to_vec(),
            Space::Rows { rows, cols } => if op.row { vec![rows] } else { vec![rows, cols] },
            Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
        };
        outs.push(Tensor::from_cpu(storage, &s));
    }
    Ok(outs)
}

/// Where a block writes its part of an output: the output's first element, shared by the blocks
/// of one `run`, each writing a disjoint range.
struct Target {
    ptr: usize,
    len: usize,
    ty: CType,
}

impl Target {
    fn of(v: &mut Val) -> Target {
        let ty = v.ctype();
        let (ptr, len) = with_val!(v, x => (x.as_mut_ptr() as usize, x.len()));
        Target { ptr, len, ty }
    }
    /// Writes `v` at `at..at + v.len()`.
    fn write(&self, at: usize, v: &Val) {
        fn go<T: Copy>(ptr: usize, len: usize, at: usize, x: &[T]) {
            assert!(at + x.len() <= len, "a block writes inside its output");
            // SAFETY: the buffer outlives `run`'s blocks, which write disjoint ranges of it, and
            // holds elements of type T (checked by the caller's type match).
            let out = unsafe { std::slice::from_raw_parts_mut((ptr as *mut T).add(at), x.len()) };
            out.copy_from_slice(x);
        }
        assert_eq!(self.ty, v.ctype(), "an output keeps its type");
        with_val!(v, x => go(self.ptr, self.len, at, x))
    }
}

/// Where an op's value lives during `eval_chunk`: its own buffer, or (a view or broadcast,
/// which computes nothing) the input or op it passes through.
#[derive(Clone, Copy)]
enum Slot {
    In(usize),
    Op(usize),
}

impl Slot {
    fn val<'a>(self, ins: &'a [Val], vals: &'a [Val]) -> &'a Val {
        match self {
            Slot::In(j) => &ins[j],
            Slot::Op(j) => &vals[j],
        }
    }
}

/// Elements `start..end` of every op (row `row` of a row kernel); returns the stored ones.
fn eval_chunk(k: &FusedKernel, inputs: &[Tensor], start: usize, end: usize, row: usize) -> Vec<Val> {
    let n = end - start;
    let ins: Vec<Val> = k
        .inputs
        .iter()
        .zip(inputs)
        .map(|(inp, t)| if inp.row { load(t, row, row + 1, CType::of(inp.dtype)) } else { load(t, start, end, CType::of(inp.dtype)) })
        .collect();
    let mut vals: Vec<Val> = Vec::with_capacity(k.ops.len());
    let mut slots: Vec<Slot> = Vec::with_capacity(k.ops.len());
    let slot_of = |a: &ValueRef, slots: &[Slot]| match a {
        ValueRef::In(j) => Slot::In(*j),
        ValueRef::Op(j) => slots[*j],
    };
    for (i, op) in k.ops.iter().enumerate() {
        // A view or broadcast of a value already of its type is that value: no copy.
        if let KKind::Same | KKind::Broadcast = op.kind {
            let s = slot_of(&op.args[0], &slots);
            if s.val(&ins, &vals).ctype() == CType::of(op.dtype) {
                slots.push(s);
                vals.push(Val::F32(HostBuf::default()));
                continue;
            }
        }
        let args: Vec<&Val> = op.args.iter().map(|a| slot_of(a, &slots).val(&ins, &vals)).collect();
        // A reduction folds the chunk's n elements into one (its operand may be one element
        // standing for all n: a broadcast row value).
        let len = if op.row && !matches!(op.kind, KKind::Reduce(_)) { 1 } else { n };
        let v = eval(op, &args, len);
        vals.push(v);
        slots.push(Slot::Op(i));
    }
    // A full output whose value is one element (a broadcast row value, a constant) is spread,
    // unless the output itself is one element.
    k.outputs
        .iter()
        .zip(&k.single)
        .map(|((o, _), &single)| {
            let v = slots[*o].val(&ins, &vals);
            let len = with_val!(v, x => x.len());
            if single {
                // (Ops compute over the chunk whatever their operands' lengths.)
                with_val!(v, x => Val::from_vec([x[0]], v.ctype()))
            } else if !k.ops[*o].row && len == 1 && n > 1 {
                with_val!(v, x => Val::from_vec(vec![x[0]; n], v.ctype()))
            } else {
                v.clone()
            }
        })
        .collect()
}

/// Elements `start..end` (row-major in its own shape) of `t`, as `ctype`.
fn load(t: &Tensor, start: usize, end: usize, ctype: CType) -> Val {
    let g = t.storage().data.read_recursive();
    let BackendStorage::Cpu(s) = &*g else { unreachable!("CPU kernel on a device tensor") };
    let layout = t.layout();
    fn go<T: Elem, C: Elem>(src: &[T], layout: &crate::layout::Layout, start: usize, end: usize) -> Vec<C> {
        let mut out = Vec::with_capacity(end - start);
        layout.for_each_run(start, end, |_, off, stride, len| {
            if stride == 1 {
                out.extend(src[off..off + len].iter().map(|x| x.cast::<C>()));
            } else {
                out.extend((0..len).map(|i| src[off + i * stride].cast::<C>()));
            }
        });
        out
    }
    if t.numel() == 1 {
        return with_storage!(s, v => Val::from_vec([v[layout.offset]], ctype));
    }
    match ctype {
        CType::F32 => Val::F32(with_storage!(s, v => go(v, layout, start, end)).into()),
        CType::F64 => Val::F64(with_storage!(s, v => go(v, layout, start, end)).into()),
        CType::I64 => Val::I64(with_storage!(s, v => go(v, layout, start, end)).into()),
        CType::Bool => Val::Bool(with_storage!(s, v => go(v, layout, start, end)).into()),
    }
}

fn eval(op: &KOp, args: &[&Val], n: usize) -> Val {
    let out = CType::of(op.dtype);
    let v = match &op.kind {
        KKind::Unary(u) => {
            let t = op.unary_type();
            let a = args[0].to(t);
            match a.as_ref() {
                Val::F32(x) => Val::F32(u.real(Map1 { x: operand(x, n), n })),
                Val::F64(x) => Val::F64(u.real(Map1 { x: operand(x, n), n })),
                Val::I64(x) => Val::I64(u.int(Map1 { x: operand(x, n), n })),
                Val::Bool(x) => Val::Bool(u.logical(Map1 { x: operand(x, n), n })),
            }
        }
        KKind::Binary(b, _) => {
            let (t, _) = op.binary_types();
            let (x, y) = (args[0].to(t), args[1].to(t));
            macro_rules! m2 {
                ($x:expr, $y:expr) => {
                    Map2 { a: operand($x, n), b: operand($y, n), n }
                };
            }
            match (x.as_ref(), y.as_ref()) {
                (Val::Bool(x), Val::Bool(y)) if b.is_logical() => Val::Bool(b.logical(m2!(x, y))),
                (Val::Bool(x), Val::Bool(y)) => Val::Bool(b.compare(m2!(x, y))),
                (Val::F32(x), Val::F32(y)) if b.is_comparison() => Val::Bool(b.compare(m2!(x, y))),
                (Val::F64(x), Val::F64(y)) if b.is_comparison() => Val::Bool(b.compare(m2!(x, y))),
                (Val::I64(x), Val::I64(y)) if b.is_comparison() => Val::Bool(b.compare(m2!(x, y))),
                (Val::F32(x), Val::F32(y)) => Val::F32(b.real(m2!(x, y))),
                (Val::F64(x), Val::F64(y)) => Val::F64(b.real(m2!(x, y))),
                (Val::I64(x), Val::I64(y)) => Val::I64(b.int(m2!(x, y))),
                _ => unreachable!("operands converted to one type"),
            }
        }
        KKind::Where => {
            let c = args[0].as_vec::<bool>();
            let (a, b) = (args[1].to(out), args[2].to(out));
            let pick = |i: usize, len: usize| if len == 1 { 0 } else { i };
            with_val!(a.as_ref(), x => {
                let y: Vec<_> = b.as_vec();
                let v: Vec<_> = (0..n).map(|i| if c[pick(i, c.len())] { x[pick(i, x.len())] } else { y[pick(i, y.len())] }).collect();
                Val::from_vec(v, out)
            })
        }
        // Rounds to the dtype, as a stored value would be.
        KKind::Cast => {
            let d = op.dtype;
            with_val!(args[0], x => {
                let r: Vec<f64> = match d {
                    DType::F16 => x.iter().map(|v| v.cast::<half::f16>().to_f64()).collect(),
                    DType::BF16 => x.iter().map(|v| v.cast::<half::bf16>().to_f64()).collect(),
                    DType::I32 => return Val::from_vec(x.iter().map(|v| v.cast::<i32>()).collect::<Vec<i32>>(), out),
                    DType::U8 => return Val::from_vec(x.iter().map(|v| v.cast::<u8>()).collect::<Vec<u8>>(), out),
                    DType::Bool => return Val::from_vec(x.iter().map(|v| v.cast::<bool>()).collect::<Vec<bool>>(), out),
                    DType::F32 => return Val::from_vec(x.iter().map(|v| v.cast::<f32>()).collect::<Vec<f32>>(), out),
                    DType::I64 => return Val::from_vec(x.iter().map(|v| v.cast::<i64>()).collect::<Vec<i64>>(), out),
                    DType::F64 => return Val::from_vec(x.iter().map(|v| v.cast::<f64>()).collect::<Vec<f64>>(), out),
                };
                Val::from_vec(r, out)
            })
        }
        KKind::Const(c) => Val::from_vec(vec![*c], out),
        KKind::Same | KKind::Broadcast => args[0].clone(),
        KKind::Reduce(r) => {
            let a = args[0].to(out);
            // One element standing for the whole chunk is reduced as n copies of itself.
            let len = with_val!(a.as_ref(), x => x.len());
            if len == 1 && n > 1 {
                reduce(*r, &with_val!(a.as_ref(), x => Val::from_vec(vec![x[0]; n], out)))
            } else {
                reduce(*r, &a)
            }
        }
    };
    v.into_type(out)
}

/// One row (or chunk) reduced by the op's own definition (`ReduceOp::identity`, `combine`), in
/// its accumulator type: f32 sums and products in f64, as the eager reductions.
fn reduce(r: ReduceOp, v: &Val) -> Val {
    match v {
        Val::F32(x) if r.acc_type(DType::F32) == CType::F64 => Val::F32(vec![fold(r, x, |b| b as f64) as f32].into()),
        Val::F32(x) => Val::F32(vec![fold(r, x, |b| b)].into()),
        Val::F64(x) => Val::F64(vec![fold(r, x, |b| b)].into()),
        Val::I64(x) => Val::I64(vec![fold(r, x, |b| b)].into()),
        Val::Bool(x) => Val::Bool(vec![fold(r, x, |b| b)].into()),
    }
}

/// Interleaved partial results a reduction folds into: four vectors of eight, so that four
/// independent chains overlap (one chain waits on every add or compare).
pub(crate) const FOLD_LANES: usize = 32;

/// `x` reduced by `r` in accumulator `A`, over `FOLD_LANES` interleaved partial results
/// (independent chains the CPU overlaps and vectorises), combined in lane order at the end.
fn fold<S: Copy, A: Accumulate>(r: ReduceOp, x: &[S], to: impl Fn(S) -> A + Copy) -> A {
    #[inline(always)]
    fn lanes<S: Copy, A: Accumulate>(x: &[S], id: A, to: impl Fn(S) -> A, f: impl Fn(A, A) -> A) -> A {
        let mut acc = [id; FOLD_LANES];
        let chunks = x.chunks_exact(FOLD_LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a = f(*a, to(v));
            }
        }
        let a = acc.into_iter().fold(id, &f);
        rest.iter().fold(a, |a, &v| f(a, to(v)))
    }
    let id = r.identity::<A>();
    super::wide(|| match r {
        ReduceOp::Sum => lanes(x, id, to, |a, b| a.add(b)),
        ReduceOp::Prod => lanes(x, id, to, |a, b| a.mul(b)),
        _ => lanes(x, id, to, |a, b| r.combine(a, b)),
    })
}
