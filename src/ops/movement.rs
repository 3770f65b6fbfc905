//! Shape and movement: views (reshape, permute, expand, slice and their relatives) and the
//! copying joins (cat, stack, pad).

use super::{apply, Op};
use crate::layout::{broadcast_shapes, norm_dim, numel};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// A tensor with the same elements in `shape`; one entry may be -1 (inferred). A view when
    /// the strides allow it, else a copy (`torch.reshape`).
    #[track_caller]
    pub fn reshape(&self, shape: &[i64]) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let shape = infer_shape("reshape", self, shape)?;
        self.reshape_usize(&shape)
    }

    /// Like `reshape`, but an error instead of a copy when no view exists (`torch.Tensor.view`).
    #[track_caller]
    pub fn view(&self, shape: &[i64]) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let shape = infer_shape("view", self, shape)?;
        if self.layout().view_strides(&shape).is_none() {
            return Err(Error::shape("view", format!(
                "a tensor of shape {:?} and strides {:?} cannot be viewed as {shape:?}; use reshape, which copies",
                self.shape(), self.strides()
            )));
        }
        self.reshape_usize(&shape)
    }

    pub(crate) fn reshape_usize(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        if crate::layout::checked_numel("reshape", shape, crate::layout::MAX_ELEM_BYTES)? != self.numel() {
            return Err(Error::shape("reshape", format!("shape {shape:?} is invalid for a tensor of shape {:?} ({} elements)", self.shape(), self.numel())));
        }
        apply(Op::Reshape(shape.to_vec()), &[self])
    }

    /// Reorders dims: `permute(&[1, 0])` is a transpose. A view.
    #[track_caller]
    pub fn permute(&self, dims: &[i64]) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if dims.len() != self.ndim() {
            return Err(Error::shape("permute", format!("{} dims given for a tensor of {} dims ({:?})", dims.len(), self.ndim(), self.shape())));
        }
        let perm = dims.iter().map(|&d| norm_dim("permute", d, self.ndim())).collect::<Result<Vec<_>>>()?;
        let mut seen = vec![false; perm.len()];
        for &p in &perm {
            if std::mem::replace(&mut seen[p], true) {
                return Err(Error::arg("permute", format!("dim {p} repeated in {dims:?}")));
            }
        }
        self.permute_usize(&perm)
    }

    pub(crate) fn permute_usize(&self, perm: &[usize]) -> Result<Tensor> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        apply(Op::Permute(perm.to_vec()), &[self])
    }

    /// Swaps two dims. A view.
    #[track_caller]
    pub fn transpose(&self, d0: i64, d1: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let (a, b) = (norm_dim("transpose", d0, self.ndim())?, norm_dim("transpose", d1, self.ndim())?);
        if self.ndim() < 2 {
            return Ok(self.clone());
        }
        let mut perm: Vec<usize> = (0..self.ndim()).collect();
        perm.swap(a, b);
        self.permute_usize(&perm)
    }

    /// The transpose of a matrix (`.t()`); vectors are returned as they are.
    #[track_caller]
    pub fn t(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.ndim() > 2 {
            return Err(Error::shape("t", format!("expects a tensor of at most 2 dims, got shape {:?}", self.shape())));
        }
        self.transpose(0, -1)
    }

    /// Broadcasts to `shape` without copying; -1 keeps a dim (`torch.Tensor.expand`).
    #[track_caller]
    pub fn expand(&self, shape: &[i64]) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if shape.len() < self.ndim() {
            return Err(Error::shape("expand", format!("the target {shape:?} has fewer dims than the tensor's shape {:?}", self.shape())));
        }
        let lead = shape.len() - self.ndim();
        let target = shape
            .iter()
            .enumerate()
            .map(|(i, &s)| match (s, i >= lead) {
                (-1, true) => Ok(self.shape()[i - lead]),
                (s, _) if s >= 0 => Ok(s as usize),
                _ => Err(Error::shape("expand", format!("invalid size {s} at dim {i} of {shape:?}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        self.broadcast_to(&target)
    }

    /// Broadcasts to `shape` by NumPy rules, without copying.
    #[track_caller]
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let b = broadcast_shapes("expand", self.shape(), shape)?;
        if b != shape {
            return Err(Error::shape("expand", format!("the tensor of shape {:?} cannot be expanded to {shape:?}", self.shape())));
        }
        let lead = shape.len() - self.ndim();
        let same_rank = if lead > 0 {
            let mut s = vec![1; lead];
            s.extend_from_slice(self.shape());
            self.reshape_usize(&s)?
        } else {
            self.clone()
        };
        apply(Op::Expand(shape.to_vec()), &[&same_rank])
    }

    /// Sums a broadcast gradient back down to `shape` (the adjoint of `broadcast_to`).
    pub(crate) fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead = self.ndim() - shape.len();
        let dims: Vec<usize> = (0..self.ndim()).filter(|&d| d < lead || (shape[d - lead] == 1 && self.shape()[d] != 1)).collect();
        self.sum_dims_usize(&dims, true)?.reshape_usize(shape)
    }

    /// `len` elements from `start` along `dim`. A view.
    #[track_caller]
    pub fn narrow(&self, dim: i64, start: usize, len: usize) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("narrow", dim, self.ndim())?;
        if self.ndim() == 0 || start.checked_add(len).is_none_or(|end| end > self.shape()[d]) {
            return Err(Error::shape("narrow", format!("start {start} + length {len} exceeds size {} of dim {d} (shape {:?})", self.shape().get(d).copied().unwrap_or(0), self.shape())));
        }
        self.slice_view(d, start, len, 1)
    }

    /// Python slicing `x[start:end:step]` along `dim`: negative bounds count from the end and
    /// out-of-range bounds are clamped. A view.
    #[track_caller]
    pub fn slice(&self, dim: i64, start: i64, end: i64, step: usize) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("slice", dim, self.ndim())?;
        if step == 0 {
            return Err(Error::arg("slice", "step must be positive"));
        }
        if self.ndim() == 0 {
            return Err(Error::shape("slice", "cannot slice a 0-dim tensor"));
        }
        let size = self.shape()[d] as i64;
        let clampi = |i: i64| (if i < 0 { i + size } else { i }).clamp(0, size) as usize;
        let (s, e) = (clampi(start), clampi(end));
        let len = if e > s { (e - s).div_ceil(step) } else { 0 };
        // With at most one element the step is irrelevant; normalising it keeps a huge step
        // from overflowing the view's stride (and the gradient's padding).
        self.slice_view(d, s, len, if len > 1 { step } else { 1 })
    }

    fn slice_view(&self, dim: usize, start: usize, len: usize, step: usize) -> Result<Tensor> {
        if start == 0 && len == self.shape()[dim] && step == 1 {
            return Ok(self.clone());
        }
        apply(Op::Slice { dim, start, len, step }, &[self])
    }

    /// Removes `dim` if it has size 1 (otherwise returns the tensor as it is, like PyTorch).
    #[track_caller]
    pub fn squeeze(&self, dim: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("squeeze", dim, self.ndim())?;
        if self.ndim() == 0 || self.shape()[d] != 1 {
            return Ok(self.clone());
        }
        let mut s = self.shape().to_vec();
        s.remove(d);
        self.reshape_usize(&s)
    }

    /// Removes every size-1 dim.
    #[track_caller]
    pub fn squeeze_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let s: Vec<usize> = self.shape().iter().copied().filter(|&d| d != 1).collect();
        self.reshape_usize(&s)
    }

    /// Inserts a size-1 dim at `dim` (which may be `ndim`, or negative counting from `ndim + 1`).
    #[track_caller]
    pub fn unsqueeze(&self, dim: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("unsqueeze", dim, self.ndim() + 1)?;
        let mut s = self.shape().to_vec();
        s.insert(d, 1);
        self.reshape_usize(&s)
    }

    /// Merges dims `start..=end` into one.
    #[track_caller]
    pub fn flatten(&self, start: i64, end: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.ndim() == 0 {
            return self.reshape_usize(&[1]);
        }
        let (s, e) = (norm_dim("flatten", start, self.ndim())?, norm_dim("flatten", end, self.ndim())?);
        if s > e {
            return Err(Error::arg("flatten", format!("start dim {start} comes after end dim {end}")));
        }
        let mut shape = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape_usize(&shape)
    }

    /// Splits into pieces of `size` along `dim` (the last may be smaller). Views.
    #[track_caller]
    pub fn split(&self, size: usize, dim: i64) -> Result<Vec<Tensor>> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("split", dim, self.ndim())?;
        if size == 0 {
            return Err(Error::arg("split", "split size must be positive"));
        }
        if self.ndim() == 0 {
            return Err(Error::shape("split", "split expects at least a 1-dimensional tensor"));
        }
        let n = self.shape()[d];
        (0..n.max(1)).step_by(size).map(|s| self.narrow(d as i64, s, size.min(n - s))).collect()
    }

    /// Splits into pieces of the given `sizes` along `dim`, which must add up to its size
    /// (`torch.split` with a list). Views.
    #[track_caller]
    pub fn split_sizes(&self, sizes: &[usize], dim: i64) -> Result<Vec<Tensor>> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("split", dim, self.ndim())?;
        if self.ndim() == 0 {
            return Err(Error::shape("split", "split expects at least a 1-dimensional tensor"));
        }
        let n = self.shape()[d];
        if sizes.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(n) {
            return Err(Error::shape("split", format!("split sizes {sizes:?} do not add up to the size {n} of dim {d} (shape {:?})", self.shape())));
        }
        let mut at = 0;
        sizes
            .iter()
            .map(|&len| {
                let part = self.narrow(d as i64, at, len);
                at += len;
                part
            })
            .collect()
    }

    /// Removes each of `dims` that has size 1 (`torch.squeeze(x, dims)`); others stay.
    #[track_caller]
    pub fn squeeze_dims(&self, dims: &[i64]) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let mut drop = vec![false; self.ndim()];
        for &dim in dims {
            let d = norm_dim("squeeze", dim, self.ndim())?;
            if self.ndim() > 0 && self.shape()[d] == 1 {
                drop[d] = true;
            }
        }
        let s: Vec<usize> = self.shape().iter().zip(&drop).filter(|(_, &x)| !x).map(|(&n, _)| n).collect();
        self.reshape_usize(&s)
    }

    /// Splits into `chunks` nearly equal pieces along `dim` (`torch.chunk`). Views.
    #[track_caller]
    pub fn chunk(&self, chunks: usize, dim: i64) -> Result<Vec<Tensor>> {
        let _site = crate::profiler::call_site();
        let d = norm_dim("chunk", dim, self.ndim())?;
        if chunks == 0 {
            return Err(Error::arg("chunk", "number of chunks must be positive"));
        }
        if self.ndim() == 0 {
            return Err(Error::shape("chunk", "chunk expects at least a 1-dimensional tensor"));
        }
        self.split(self.shape()[d].div_ceil(chunks).max(1), dim)
    }

    /// Constant padding, PyTorch's `F.pad` order: `(last_before, last_after, prev_before, ...)`.
    /// Negative amounts crop.
    #[track_caller]
    pub fn pad(&self, pads: &[i64], value: f64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if !pads.len().is_multiple_of(2) || pads.len() / 2 > self.ndim() {
            return Err(Error::arg("pad", format!("{} padding values for a tensor of {} dims: give pairs, at most two per dim", pads.len(), self.ndim())));
        }
        let mut x = self.clone();
        let mut amounts = vec![(0usize, 0usize); self.ndim()];
        for (i, pair) in pads.chunks(2).enumerate() {
            let d = self.ndim() - 1 - i;
            // In i128: amounts near i64::MIN or i64::MAX neither wrap nor overflow.
            let (before, after) = (pair[0] as i128, pair[1] as i128);
            let size = x.shape()[d] as i128;
            let (crop_b, crop_a) = ((-before).max(0), (-after).max(0));
            if crop_b + crop_a > size {
                return Err(Error::shape("pad", format!("padding {pads:?} crops more than the size {size} of dim {d}")));
            }
            if crop_b > 0 || crop_a > 0 {
                x = x.narrow(d as i64, crop_b as usize, (size - crop_b - crop_a) as usize)?;
            }
            let grow = |p: i128| usize::try_from(p.max(0)).map_err(|_| Error::shape("pad", format!("padding {pads:?} is too large for dim {d}")));
            amounts[d] = (grow(before)?, grow(after)?);
        }
        if amounts.iter().all(|p| *p == (0, 0)) {
            // Only cropping (or nothing): still a copy, as PyTorch's constant_pad_nd clones.
            return x.copy_contiguous();
        }
        apply(Op::Pad(amounts, value), &[&x])
    }

    /// Lower triangle of the last two dims (`torch.tril`): keeps `j - i <= k`.
    #[track_caller]
    pub fn tril(&self, k: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.triangle("tril", k, true)
    }
    /// Upper triangle of the last two dims (`torch.triu`): keeps `j - i >= k`.
    #[track_caller]
    pub fn triu(&self, k: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.triangle("triu", k, false)
    }
    fn triangle(&self, op: &'static str, k: i64, lower: bool) -> Result<Tensor> {
        if self.ndim() < 2 {
            return Err(Error::shape(op, format!("needs at least 2 dims, got shape {:?}", self.shape())));
        }
        let (r, c) = (self.shape()[self.ndim() - 2], self.shape()[self.ndim() - 1]);
        let dev = self.device();
        let rows = Tensor::arange(0.0, r as f64, 1.0, DType::I64, &dev)?.unsqueeze(1)?;
        let cols = Tensor::arange(0.0, c as f64, 1.0, DType::I64, &dev)?.unsqueeze(0)?;
        let diff = cols.sub(&rows)?;
        let drop = if lower { diff.gt_scalar(k)? } else { diff.lt_scalar(k)? };
        self.masked_fill(&drop, 0.0)
    }
}

/// Resolves a shape with at most one -1 for a tensor of `t`'s size.
fn infer_shape(op: &'static str, t: &Tensor, shape: &[i64]) -> Result<Vec<usize>> {
    let mut infer = None;
    let mut known = 1usize;
    for (i, &s) in shape.iter().enumerate() {
        match s {
            -1 if infer.is_none() => infer = Some(i),
            -1 => return Err(Error::shape(op, format!("only one dim can be inferred in {shape:?}"))),
            s if s < 0 => return Err(Error::shape(op, format!("invalid size {s} in {shape:?}"))),
            s => {
                known = known.checked_mul(s as usize).ok_or_else(|| Error::shape(op, format!("shape {shape:?} is too large: its element count overflows")))?;
            }
        }
    }
    let mut out: Vec<usize> = shape.iter().map(|&s| s.max(0) as usize).collect();
    if let Some(i) = infer {
        if known == 0 || !t.numel().is_multiple_of(known) {
            return Err(Error::shape(op, format!("shape {shape:?} is invalid for a tensor of shape {:?} ({} elements)", t.shape(), t.numel())));
        }
        out[i] = t.numel() / known;
    }
    if numel(&out) != t.numel() {
        return Err(Error::shape(op, format!("shape {shape:?} is invalid for a tensor of shape {:?} ({} elements)", t.shape(), t.numel())));
    }
    Ok(out)
}

/// Concatenates along `dim`; dtypes promote, other dims must match (`torch.cat`).
#[track_caller]
pub fn cat(ts: &[&Tensor], dim: i64) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    // 1-D tensors of size 0 join any others (PyTorch's legacy rule): each takes the shape of the
    // first other tensor with nothing along `dim`, so it still gets its (empty) gradient.
    let legacy_empty = |t: &&Tensor| t.shape() == [0];
    if let Some(other) = ts.iter().find(|t| !legacy_empty(t)).filter(|o| o.ndim() > 0 && ts.iter().any(legacy_empty)) {
        let d = norm_dim("cat", dim, other.ndim())?;
        let mut empty = other.shape().to_vec();
        empty[d] = 0;
        let all: Vec<Tensor> = ts.iter().map(|t| if legacy_empty(t) { t.reshape_usize(&empty) } else { Ok((*t).clone()) }).collect::<Result<_>>()?;
        return cat(&all.iter().collect::<Vec<_>>(), dim);
    }
    let first = ts.first().ok_or_else(|| Error::arg("cat", "needs at least one tensor"))?;
    let d = norm_dim("cat", dim, first.ndim())?;
    if first.ndim() == 0 {
        return Err(Error::shape("cat", "zero-dimensional tensors cannot be concatenated"));
    }
    let dtype = ts.iter().skip(1).fold(first.dtype(), |a, t| crate::dtype::promote_types(a, t.dtype()));
    for (i, t) in ts.iter().enumerate() {
        let same = t.ndim() == first.ndim() && (0..t.ndim()).all(|k| k == d || t.shape()[k] == first.shape()[k]);
        if !same {
            return Err(Error::shape("cat", format!("tensor {i} has shape {:?}, which does not match {:?} except in dim {d}", t.shape(), first.shape())));
        }
        if t.device() != first.device() {
            return Err(Error::DeviceMismatch { op: "cat", a: first.device(), b: t.device() });
        }
    }
    let cast: Vec<Tensor> = ts.iter().map(|t| t.to_dtype(dtype)).collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = cast.iter().collect();
    // Always a new tensor, even from one input (torch.cat never returns a view).
    apply(Op::Cat(d), &refs)
}

/// Joins along a new dim `dim` (`torch.stack`); all shapes must be equal.
#[track_caller]
pub fn stack(ts: &[&Tensor], dim: i64) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    let first = ts.first().ok_or_else(|| Error::arg("stack", "needs at least one tensor"))?;
    for (i, t) in ts.iter().enumerate() {
        if t.shape() != first.shape() {
            return Err(Error::shape("stack", format!("tensor {i} has shape {:?}, expected {:?} like tensor 0", t.shape(), first.shape())));
        }
    }
    let d = norm_dim("stack", dim, first.ndim() + 1)?;
    let us: Vec<Tensor> = ts.iter().map(|t| t.unsqueeze(d as i64)).collect::<Result<_>>()?;
    cat(&us.iter().collect::<Vec<_>>(), d as i64)
}

/// The gradient of a strided slice: `g` placed at its positions in zeros of `in_shape`.
pub(crate) fn slice_backward(g: &Tensor, in_shape: &[usize], dim: usize, start: usize, len: usize, step: usize) -> Result<Tensor> {
    let size = in_shape[dim];
    let mut spread = g.clone();
    if step > 1 && len > 0 {
        // Interleave step-1 zeros after each element, then trim to the covered range.
        let mut pads = vec![(0, 0); g.ndim() + 1];
        pads[dim + 1] = (0, step - 1);
        spread = apply(Op::Pad(pads, 0.0), &[&g.unsqueeze(dim as i64 + 1)?])?.flatten(dim as i64, dim as i64 + 1)?;
        let covered = ((len - 1) * step + 1).min(size - start);
        spread = spread.narrow(dim as i64, 0, covered)?;
    }
    let mut pads = vec![(0, 0); g.ndim()];
    pads[dim] = (start.min(size), size - start.min(size) - spread.shape()[dim]);
    if pads[dim] == (0, 0) {
        return Ok(spread);
    }
    apply(Op::Pad(pads, 0.0), &[&spread])
}
