//! `matmul` with `torch.matmul` semantics, lowered to the batched 3-D primitive.

use super::{apply, Op};
use crate::layout::broadcast_shapes;
use crate::{Error, Result, Tensor};

/// The activation a matrix product's epilogue applies after its bias add (the library's
/// `RELU_BIAS` and `GELU_BIAS`, or kiln's matrix-vector kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Activation {
    Relu,
    /// GELU's tanh approximation (`gelu_tanh`, GPT-2's `gelu_new`).
    GeluTanh,
}


/// Products this large whose K or N is not a multiple of 8 are padded with zeros to one on CUDA
/// in 16-bit dtypes: an unaligned leading dimension keeps cuBLAS off the tensor-core kernels
/// of the GPU (it picks kernels of older GPUs, several times slower), and the padding copies
/// cost far less (Inductor's `pad_mm`). GPT-2's vocabulary of 50,257 is the case in point.
const PAD_MIN_FLOPS: usize = 1 << 32;

/// `a` `[M, K]` @ `b` `[K, N]` as the 3-D primitive, through zero-padded operands where
/// `PAD_MIN_FLOPS` says (the result then a view of the first N columns; gradients flow back
/// through the padding unchanged, and the backward's products are aligned too).
fn product_2d(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let up = |d: usize| d.div_ceil(8) * 8;
    let pad = a.device().is_cuda() && matches!(a.dtype(), crate::DType::F16 | crate::DType::BF16) && (k % 8 != 0 || n % 8 != 0) && 2 * m * k * n >= PAD_MIN_FLOPS;
    if !pad {
        return apply(Op::Matmul, &[&a.unsqueeze(0)?, &b.unsqueeze(0)?])?.squeeze(0);
    }
    let (kp, np) = (up(k) - k, up(n) - n);
    let a = if kp > 0 { a.pad(&[0, kp as i64], 0.0)? } else { a.clone() };
    let b = b.pad(&[0, np as i64, 0, kp as i64], 0.0)?;
    let y = apply(Op::Matmul, &[&a.unsqueeze(0)?, &b.unsqueeze(0)?])?.squeeze(0)?;
    if np > 0 {
        y.narrow(1, 0, n)
    } else {
        Ok(y)
    }
}

impl Tensor {
    /// Matrix product: 1-D·1-D is a dot product, 2-D a matrix product, and more dims a batched
    /// product whose batch dims broadcast; a 1-D operand gets a dim added and then removed.
    /// Under `amp::autocast` both operands are cast to the autocast dtype first.
    #[track_caller]
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
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
        if (a2.ndim() > 2 && b.ndim() == 2) || (a2.ndim() == 2 && b2.ndim() == 2) {
            let rows = a2.numel() / k.max(1);
            if k > 0 && a2.layout().view_strides(&[rows, k]).is_some() {
                let mut shape = a.shape()[..a.ndim() - 1].to_vec();
                if b.ndim() > 1 {
                    shape.push(n);
                }
                return product_2d(&a2.reshape_usize(&[rows, k])?, &b2)?.reshape_usize(&shape);
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

    /// The product of two matrices (`torch.mm`): both must be 2-D.
    #[track_caller]
    pub fn mm(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.ndim() != 2 || other.ndim() != 2 {
            return Err(Error::shape("mm", format!("both arguments must be 2-D matrices, got {:?} and {:?}", self.shape(), other.shape())));
        }
        self.matmul(other)
    }

    /// Batched products of 3-D tensors with one batch size (`torch.bmm`; no broadcasting).
    #[track_caller]
    pub fn bmm(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.ndim() != 3 || other.ndim() != 3 || self.shape()[0] != other.shape()[0] {
            return Err(Error::shape("bmm", format!("both arguments must be 3-D with the same batch size, got {:?} and {:?}", self.shape(), other.shape())));
        }
        self.matmul(other)
    }

    /// `beta * self + alpha * (m1 @ m2)` (`torch.addmm`): `self` broadcasts to the product's
    /// shape; with `beta == 0` it is not read (its NaNs do not propagate), as in PyTorch. Under
    /// `amp::autocast` all three are cast to the autocast dtype, as PyTorch's autocast does, so
    /// the sum is in that dtype too (a layer's bias then joins the product's epilogue).
    #[track_caller]
    pub fn addmm(&self, m1: &Tensor, m2: &Tensor, beta: f64, alpha: f64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let (m1, m2, input) = crate::amp::cast_low(m1, m2, Some(self))?;
        let input = input.expect("a bias was given");
        let p = m1.mm(&m2).map_err(|e| match e {
            Error::Shape { msg, .. } => Error::shape("addmm", msg),
            e => e,
        })?;
        let b = broadcast_shapes("addmm", input.shape(), p.shape())?;
        if b != p.shape() {
            return Err(Error::shape("addmm", format!("input of shape {:?} does not broadcast to the product's shape {:?}", input.shape(), p.shape())));
        }
        // Integral factors stay integers, so integer products stay integer (as PyTorch's).
        let factor = |v: f64| if v.fract() == 0.0 && v.abs() < 9e15 { crate::Scalar::Int(v as i64) } else { crate::Scalar::Float(v) };
        let p = if alpha == 1.0 { p } else { p.mul_scalar(factor(alpha))? };
        match beta {
            0.0 => Ok(p),
            1.0 => input.add(&p),
            _ => input.mul_scalar(factor(beta))?.add(&p),
        }
    }
}
