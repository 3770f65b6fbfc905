//! Row ops (softmax, log_softmax, layer norm over the last dim) with a one-kernel eager form.

use crate::{DType, Result, Tensor};

/// One-kernel eager forms of the row ops on the GPU, used when nothing needs their history
/// (inference, `no_grad`): the decompositions below remain the definition, and what autograd
/// and the compiler see.
pub(crate) fn fused(x: &Tensor, dim: i64, kind: RowKind, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Option<Tensor>> {
    let tracked = crate::is_grad_enabled() && [Some(x), w, b].iter().flatten().any(|t| t.is_requires_grad());
    // F64 keeps its own precision through the decomposition; the kernel's statistics are f32.
    if !x.device().is_cuda() || tracked || crate::compile::trace::active() || x.ndim() == 0 || x.dtype() == DType::F64 {
        return Ok(None);
    }
    if crate::layout::norm_dim(kind.name(), dim, x.ndim())? != x.ndim() - 1 {
        return Ok(None);
    }
    let k = x.shape()[x.ndim() - 1];
    if k == 0 || k > crate::kir::MAX_ROW || [w, b].iter().flatten().any(|p| p.dtype() != x.dtype() || p.device() != x.device()) {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let (w, b) = (w.map(|t| t.contiguous()).transpose()?, b.map(|t| t.contiguous()).transpose()?);
    crate::backend::rows(kind, &x, w.as_ref(), b.as_ref(), eps).map(Some)
}

/// The row ops with a fused eager kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RowKind {
    Softmax,
    LogSoftmax,
    LayerNorm,
}

impl RowKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            RowKind::Softmax => "softmax",
            RowKind::LogSoftmax => "log_softmax",
            RowKind::LayerNorm => "layer_norm",
        }
    }
}

