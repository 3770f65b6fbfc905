//! `matmul` with `torch.matmul` semantics, lowered to the batched 3-D primitive.

use super::{apply, Op};
use crate::layout::broadcast_shapes;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Matrix product: 1-D·1-D is a dot product, 2-D a matrix product, and more dims a batched
    /// product whose batch dims broadcast; a 1-D operand gets a dim added and then removed.
    /// Under `amp::autocast` both operands are cast to the autocast dtype first.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let (a, b) = crate::amp::cast_pair(self, other)?;
        let (a, b) = (&a, &b);
        if a.ndim() == 0 || b.ndim() == 0 {
            return Err(Error::shape("matmul", format!("both arguments need at least 1 dim, got {:?} and {:?}", a.shape(), b.shape())));
        }
        if a.dtype() != b.dtype() {
            return Err(Error::dtype("matmul", b.dtype(), format!("expected both operands to have the same dtype, got {:?} and {:?}", a.dtype(), b.dtype())));
        }
        if a.device() != b.device() {
            return Err(Error::DeviceMismatch { op: "matmul", a: a.device(), b: b.device() });
        }
        let a2 = if a.ndim() == 1 { a.unsqueeze(0)? } else { a.clone() };
        let b2 = if b.ndim() == 1 { b.unsqueeze(1)? } else { b.clone() };
        let (m, k) = (a2.shape()[a2.ndim() - 2], a2.shape()[a2.ndim() - 1]);
        let (k2, n) = (b2.shape()[b2.ndim() - 2], b2.shape()[b2.ndim() - 1]);
        if k != k2 {
            return Err(Error::shape("matmul", format!("shapes {:?} and {:?} cannot be multiplied ({m}x{k} and {k2}x{n})", a.shape(), b.shape())));
        }
        // [.., M, K] @ [K, N] is one [(.. M), K] @ [K, N] product when the batch folds into the
        // rows without a copy: one large GEMM instead of many small ones (as PyTorch does).
        if a2.ndim() > 2 && b.ndim() == 2 {
            let rows = a2.numel() / k.max(1);
            if k > 0 && a2.layout().view_strides(&[rows, k]).is_some() {
                let mut shape = a2.shape()[..a2.ndim() - 1].to_vec();
                shape.push(n);
                return apply(Op::Matmul, &[&a2.reshape_usize(&[1, rows, k])?, &b2.unsqueeze(0)?])?.reshape_usize(&shape);
            }
        }
        let batch = broadcast_shapes("matmul", &a2.shape()[..a2.ndim() - 2], &b2.shape()[..b2.ndim() - 2])?;
        let nb: usize = batch.iter().product();
        let full = |t: &Tensor, r: usize, c: usize| -> Result<Tensor> {
            let mut s = batch.clone();
            s.extend([r, c]);
            t.broadcast_to(&s)?.reshape_usize(&[nb, r, c])
        };
        let out = apply(Op::Matmul, &[&full(&a2, m, k)?, &full(&b2, k, n)?])?;
        let mut shape = batch;
        if a.ndim() > 1 {
            shape.push(m);
        }
        if b.ndim() > 1 {
            shape.push(n);
        }
        out.reshape_usize(&shape)
    }
}
