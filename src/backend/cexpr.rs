//! The C expression of a kernel op, shared by the generated code of both backends (CUDA C
//! compiled by NVRTC, C compiled by the system's compiler for the CPU): each op's expression
//! comes from its definition (`ops::pointwise`), conversions and literals from the CUDA
//! generator's helpers, which the CPU's C prelude defines too.

use crate::backend::cuda::kernels::codegen::{convert, load, store};
use crate::dtype::CType;
use crate::kir::{FusedKernel, KKind, KOp, ValueRef};

/// The type each op computes in and the C expression of its value, given its arguments'.
pub(crate) fn lower(op: &KOp, args: &[(CType, String)]) -> (CType, String) {
    let out = CType::of(op.dtype);
    let arg = |k: usize, t: CType| convert(args[k].0, t, &args[k].1);
    match &op.kind {
        KKind::Unary(u) => {
            let t = op.unary_type();
            (t, u.cuda(&format!("({})", arg(0, t)), t))
        }
        KKind::Binary(b, _) => {
            let (t, res) = op.binary_types();
            (res, b.cuda(&format!("({})", arg(0, t)), &format!("({})", arg(1, t)), t))
        }
        KKind::Where => (out, format!("({} ? {} : {})", arg(0, CType::Bool), arg(1, out), arg(2, out))),
        // A cast rounds to its dtype (an f16 in the middle of a kernel holds f16 values).
        KKind::Cast => (out, load(op.dtype, out, &store(op.dtype, args[0].0, &args[0].1))),
        KKind::Const(v) => (out, literal(*v, out)),
        KKind::Same | KKind::Broadcast => args[0].clone(),
        KKind::Reduce(_) => unreachable!("reductions are emitted by the row generator"),
    }
}

/// `v` as a C literal of type `t` (floats by their bits: exact, and infinities too).
pub(crate) fn literal(v: f64, t: CType) -> String {
    match t {
        CType::F32 => format!("__int_as_float({})", (v as f32).to_bits() as i32),
        CType::F64 => format!("__longlong_as_double({}ll)", v.to_bits() as i64),
        CType::I64 => format!("{}ll", v as i64),
        CType::Bool => (if v != 0.0 { "true" } else { "false" }).into(),
    }
}

/// A value's C type and name.
pub(crate) type Named = (CType, String);

/// The C names and types of a kernel's values: input j is `x{j}` (its own type), op i `t{i}` in
/// the type it computes in; views and broadcasts are their argument's name.
pub(crate) fn value_names(k: &FusedKernel) -> (Vec<Named>, Vec<Named>) {
    let ins: Vec<Named> = k.inputs.iter().enumerate().map(|(j, i)| (CType::of(i.dtype), format!("x{j}"))).collect();
    let mut vals: Vec<Named> = Vec::with_capacity(k.ops.len());
    for op in &k.ops {
        let v = match op.kind {
            KKind::Same | KKind::Broadcast => arg(&op.args[0], &ins, &vals),
            KKind::Reduce(_) => (CType::of(op.dtype), format!("t{}", vals.len())),
            _ => (lower(op, &op.args.iter().map(|a| arg(a, &ins, &vals)).collect::<Vec<_>>()).0, format!("t{}", vals.len())),
        };
        vals.push(v);
    }
    (ins, vals)
}

/// The C name and type of an argument.
pub(crate) fn arg(a: &ValueRef, ins: &[Named], vals: &[Named]) -> Named {
    match a {
        ValueRef::In(j) => ins[*j].clone(),
        ValueRef::Op(j) => vals[*j].clone(),
    }
}
