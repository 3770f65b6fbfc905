//! Indexing: index_select, gather, scatter, scatter_add, one_hot.

use super::{apply, Op};
use crate::layout::norm_dim;
use crate::{DType, Error, Result, Tensor};

fn check_index_dtype(op: &'static str, index: &Tensor) -> Result<Tensor> {
    match index.dtype() {
        DType::I64 => Ok(index.clone()),
        DType::I32 | DType::U8 => index.to_dtype(DType::I64),
        d => Err(Error::dtype(op, d, "indices must be an integer tensor (I64)")),
    }
}

impl Tensor {
    /// The entries of `dim` listed by the 1-D `index` (`torch.index_select`).
    #[track_caller]
    pub fn index_select(&self, dim: i64, index: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("index_select", dim, self.ndim())?;
        let index = check_index_dtype("index_select", index)?;
        if index.ndim() > 1 {
            return Err(Error::shape("index_select", format!("index must be 0-D or 1-D, got shape {:?}", index.shape())));
        }
        if self.ndim() == 0 {
            // A 0-dim tensor is indexed as one element, and stays 0-dim (as in PyTorch).
            if index.numel() != 1 {
                return Err(Error::shape("index_select", format!("indexing a 0-dim tensor takes one index, got {}", index.numel())));
            }
            return self.reshape_usize(&[1])?.index_select(0, &index)?.reshape_usize(&[]);
        }
        apply(Op::IndexSelect(d), &[self, &index.reshape_usize(&[index.numel()])?])
    }

    /// `out[i][j] = self[index[i][j]][j]` for dim 0, and likewise for other dims
    /// (`torch.gather`). The output has the index's shape.
    #[track_caller]
    pub fn gather(&self, dim: i64, index: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("gather", dim, self.ndim())?;
        let index = check_index_dtype("gather", index)?;
        if self.ndim() == 0 && index.ndim() <= 1 {
            // A 0-dim tensor gathers as one element: the result has the index's shape.
            let flat = index.reshape_usize(&[index.numel()])?;
            return self.reshape_usize(&[1])?.gather(0, &flat)?.reshape_usize(index.shape());
        }
        // An empty index gathers nothing whatever its rank (PyTorch skips its shape checks).
        if index.numel() > 0 {
            check_index_shape("gather", self.shape(), index.shape(), d, &[])?;
        } else if index.ndim() != self.ndim() {
            // No element of the input, as a view of it: the (empty) gradient still reaches it.
            return self.flatten(0, -1)?.narrow(0, 0, 0)?.reshape_usize(index.shape());
        }
        apply(Op::Gather(d), &[self, &index])
    }

    /// A copy of `self` with `src[i][j]` added at row `index[i][j]` (dim 0; likewise for other
    /// dims) (`torch.scatter_add`).
    #[track_caller]
    pub fn scatter_add(&self, dim: i64, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.scatter_op(Op::ScatterAdd, dim, index, src)
    }

    /// A copy of `self` with `src[i][j]` written at row `index[i][j]` (dim 0; likewise for other
    /// dims) (`torch.scatter`). Where an index repeats, which of its values lands is not
    /// specified (as in PyTorch).
    #[track_caller]
    pub fn scatter(&self, dim: i64, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.scatter_op(Op::Scatter, dim, index, src)
    }

    /// `scatter_add` or `scatter` (`make` its op along a dim), checked as PyTorch checks them.
    fn scatter_op(&self, make: fn(usize) -> Op, dim: i64, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let op = make(0).name();
        let d = norm_dim(op, dim, self.ndim())?;
        let index = check_index_dtype(op, index)?;
        if src.dtype() != self.dtype() {
            return Err(Error::dtype(op, src.dtype(), format!("src must have the tensor's dtype {:?}", self.dtype())));
        }
        if self.ndim() == 0 && index.ndim() <= 1 && src.ndim() <= 1 {
            // A 0-dim tensor takes its one element's values, and stays 0-dim.
            let (i, s) = (index.reshape_usize(&[index.numel()])?, src.reshape_usize(&[src.numel()])?);
            return self.reshape_usize(&[1])?.scatter_op(make, 0, &i, &s)?.reshape_usize(&[]);
        }
        if index.numel() == 0 {
            // Nothing is written (PyTorch skips its shape checks): a copy, as always.
            return self.copy_contiguous();
        }
        check_index_shape(op, self.shape(), index.shape(), d, src.shape())?;
        apply(make(d), &[self, &index, src])
    }

    /// `scatter` in place (`Tensor.scatter_`). Inside a compiled function, a scatter into a
    /// captured tensor that nothing reads afterwards writes only the indexed elements.
    #[track_caller]
    pub fn scatter_(&self, dim: i64, index: &Tensor, src: &Tensor) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update_with("scatter_", Some(src), |x| x.scatter(dim, index, src))
    }

    /// Class indices to one-hot rows (`F.one_hot`), I64; `num_classes` None means max + 1.
    #[track_caller]
    pub fn one_hot(&self, num_classes: Option<usize>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if !self.dtype().is_int() {
            return Err(Error::dtype("one_hot", self.dtype(), "class values must be an integer tensor"));
        }
        let n = match num_classes {
            Some(n) => n,
            None => (self.max_all()?.to_dtype(DType::I64)?.item::<i64>()? + 1).max(0) as usize,
        };
        let min = if self.numel() > 0 { self.min_all()?.to_dtype(DType::I64)?.item::<i64>()? } else { 0 };
        let max = if self.numel() > 0 { self.max_all()?.to_dtype(DType::I64)?.item::<i64>()? } else { 0 };
        if min < 0 || (self.numel() > 0 && max as usize >= n) {
            return Err(Error::Index { op: "one_hot", index: if min < 0 { min } else { max }, size: n });
        }
        let classes = Tensor::arange(0.0, n as f64, 1.0, DType::I64, &self.device())?;
        self.unsqueeze(-1)?.eq(&classes)?.to_dtype(DType::I64)
    }
}

/// PyTorch's rule for gather/scatter: same rank, and the index no larger than the tensor in
/// every dim but `dim` (and no larger than `src` anywhere, when given).
fn check_index_shape(op: &'static str, shape: &[usize], index: &[usize], dim: usize, src: &[usize]) -> Result<()> {
    let bad = index.len() != shape.len()
        || index.iter().zip(shape).enumerate().any(|(d, (&i, &s))| d != dim && i > s)
        || (!src.is_empty() && (src.len() != index.len() || index.iter().zip(src).any(|(&i, &s)| i > s)));
    if bad {
        return Err(Error::shape(op, format!("index of shape {index:?} does not fit the tensor of shape {shape:?} along dim {dim}{}",
            if src.is_empty() { String::new() } else { format!(" and src of shape {src:?}") })));
    }
    Ok(())
}
