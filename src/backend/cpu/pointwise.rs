//! Pointwise loops: the ops module supplies the scalar function, these supply the iteration.

use super::{fill_new, to_vec_as, with_operand, CpuStorage, HostBuf, HostElem, Operand};
use crate::ops::pointwise::{BinaryOp, MapBinary, MapUnary, UnaryOp};
use crate::{DType, Tensor};

pub(crate) struct Map1<'a, A> {
    pub(crate) x: Operand<'a, A>,
    pub(crate) n: usize,
}
impl<A: Copy + Sync, B: Send + Sync + Copy + 'static> MapUnary<A, B> for Map1<'_, A> {
    fn run(self, f: impl Fn(A) -> B + Sync) -> HostBuf<B> {
        match self.x {
            Operand::Slice(s) => fill_new(self.n, |start, out| {
                let end = start + out.len();
                for (o, &x) in out.iter_mut().zip(&s[start..end]) {
                    o.write(f(x));
                }
            }),
            Operand::Scalar(c) => vec![f(c); self.n].into(),
        }
    }
    fn run_covered(self, fast: impl Fn(A) -> B + Sync, covered: impl Fn(A) -> bool + Sync, exact: impl Fn(A) -> B + Sync) -> HostBuf<B> {
        match self.x {
            Operand::Slice(s) => fill_new(self.n, |start, out| {
                let x = &s[start..start + out.len()];
                for (o, &v) in out.iter_mut().zip(x) {
                    o.write(fast(v));
                }
                for (o, &v) in out.iter_mut().zip(x) {
                    if !covered(v) {
                        o.write(exact(v));
                    }
                }
            }),
            Operand::Scalar(c) => vec![if covered(c) { fast(c) } else { exact(c) }; self.n].into(),
        }
    }
}

pub(crate) struct Map2<'a, A> {
    pub(crate) a: Operand<'a, A>,
    pub(crate) b: Operand<'a, A>,
    pub(crate) n: usize,
}
impl<A: Copy + Sync, B: Send + Sync + Copy + 'static> MapBinary<A, B> for Map2<'_, A> {
    fn run(self, f: impl Fn(A, A) -> B + Sync) -> HostBuf<B> {
        use Operand::*;
        match (self.a, self.b) {
            (Slice(a), Slice(b)) => fill_new(self.n, |start, out| {
                let (a, b) = (&a[start..start + out.len()], &b[start..start + out.len()]);
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    o.write(f(x, y));
                }
            }),
            (Slice(a), Scalar(y)) => fill_new(self.n, |start, out| {
                let end = start + out.len();
                for (o, &x) in out.iter_mut().zip(&a[start..end]) {
                    o.write(f(x, y));
                }
            }),
            (Scalar(x), Slice(b)) => fill_new(self.n, |start, out| {
                let end = start + out.len();
                for (o, &y) in out.iter_mut().zip(&b[start..end]) {
                    o.write(f(x, y));
                }
            }),
            (Scalar(x), Scalar(y)) => vec![f(x, y); self.n].into(),
        }
    }
}

fn map1<C: HostElem, R>(x: &Tensor, f: impl FnOnce(Map1<'_, C>) -> R) -> R {
    let n = x.numel();
    with_operand::<C, _>(x, |x| f(Map1 { x, n }))
}

fn map2<C: HostElem, R>(a: &Tensor, b: &Tensor, f: impl FnOnce(Map2<'_, C>) -> R) -> R {
    let n = a.numel();
    with_operand::<C, _>(a, |a| with_operand::<C, _>(b, |b| f(Map2 { a, b, n })))
}

pub(crate) fn unary(op: UnaryOp, x: &Tensor, out: DType) -> CpuStorage {
    if op == UnaryOp::LogicalNot {
        return CpuStorage::Bool(map1::<bool, _>(x, |m| op.logical(m)));
    }
    match out {
        DType::F64 => CpuStorage::F64(map1::<f64, _>(x, |m| op.real(m))),
        DType::F32 | DType::F16 | DType::BF16 => CpuStorage::from_vec_as(map1::<f32, _>(x, |m| op.real(m)), out),
        _ => CpuStorage::from_vec_as(map1::<i64, _>(x, |m| op.int(m)), out),
    }
}

/// `a` and `b` have the same shape; `compute` is the dtype the arithmetic runs in.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, compute: DType) -> CpuStorage {
    if op.is_logical() {
        return CpuStorage::Bool(map2::<bool, _>(a, b, |m| op.logical(m)));
    }
    if op.is_comparison() {
        return CpuStorage::Bool(match compute {
            DType::F64 => map2::<f64, _>(a, b, |m| op.compare(m)),
            DType::F32 | DType::F16 | DType::BF16 => map2::<f32, _>(a, b, |m| op.compare(m)),
            DType::Bool => map2::<bool, _>(a, b, |m| op.compare(m)),
            _ => map2::<i64, _>(a, b, |m| op.compare(m)),
        });
    }
    let out = op.out_dtype(compute);
    match compute {
        DType::F64 => CpuStorage::F64(map2::<f64, _>(a, b, |m| op.real(m))),
        DType::F32 | DType::F16 | DType::BF16 => CpuStorage::from_vec_as(map2::<f32, _>(a, b, |m| op.real(m)), out),
        _ => CpuStorage::from_vec_as(map2::<i64, _>(a, b, |m| op.int(m)), out),
    }
}

/// `cond ? a : b` elementwise; all three have the same shape.
pub(crate) fn where_(cond: &Tensor, a: &Tensor, b: &Tensor, out: DType) -> CpuStorage {
    fn go<C: HostElem>(cond: &Tensor, a: &Tensor, b: &Tensor, out: DType) -> CpuStorage {
        let c = to_vec_as::<bool>(cond);
        let v = map2::<C, _>(a, b, |m| {
            let Map2 { a, b, n } = m;
            fill_new(n, |start, o| {
                for (k, o) in o.iter_mut().enumerate() {
                    let i = start + k;
                    o.write(if c[i] { a.get(i) } else { b.get(i) });
                }
            })
        });
        CpuStorage::from_vec_as(v, out)
    }
    match out {
        DType::F64 => go::<f64>(cond, a, b, out),
        DType::F32 | DType::F16 | DType::BF16 => go::<f32>(cond, a, b, out),
        DType::Bool => go::<bool>(cond, a, b, out),
        _ => go::<i64>(cond, a, b, out),
    }
}
