//! The C expression of a kernel op, shared by the generated code of both backends (CUDA C
//! compiled by NVRTC, C compiled by the system's compiler for the CPU): each op's expression
//! comes from its definition (`ops::pointwise`), conversions and literals from the CUDA
//! generator's helpers, which the CPU's C prelude defines too.

use crate::backend::cuda::kernels::codegen::{convert, load, store};
use crate::dtype::CType;
use crate::kir::{KKind, KOp};

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

fn literal(v: f64, t: CType) -> String {
    match t {
        CType::F32 => format!("__int_as_float({})", (v as f32).to_bits() as i32),
        CType::F64 => format!("__longlong_as_double({}ll)", v.to_bits() as i64),
        CType::I64 => format!("{}ll", v as i64),
        CType::Bool => (if v != 0.0 { "true" } else { "false" }).into(),
    }
}
