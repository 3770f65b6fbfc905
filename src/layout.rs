//! Shape, strides and offset: how a tensor's elements sit in its storage (DESIGN principle 4).

use crate::{Error, Result};

/// How the elements of a 4-D tensor `[N, C, H, W]` are ordered in memory (PyTorch's
/// `torch.memory_format`): the shape stays NCHW either way, only the strides differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryFormat {
    /// Row-major: W fastest, then H, C, N (`torch.contiguous_format`).
    Contiguous,
    /// NHWC in memory: C fastest, then W, H, N (`torch.channels_last`), the layout of
    /// tensor-core convolutions.
    ChannelsLast,
}

/// The permutation that turns NCHW dims into NHWC ones, and its inverse: a channels-last tensor
/// permuted by `TO_NHWC` is contiguous.
pub(crate) const TO_NHWC: [usize; 4] = [0, 2, 3, 1];
pub(crate) const FROM_NHWC: [usize; 4] = [0, 3, 1, 2];

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub shape: Vec<usize>,
    /// In elements, never negative: flips copy, as in PyTorch.
    pub strides: Vec<usize>,
    pub offset: usize,
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The element count of `shape`, or an error naming `op` when it overflows: the product with
/// zero sizes counted as one (the largest stride) times `elem_bytes` must fit in an `isize`, as
/// PyTorch requires of a storage size.
pub fn checked_numel(op: &'static str, shape: &[usize], elem_bytes: usize) -> Result<usize> {
    let bytes = shape.iter().try_fold(elem_bytes.max(1), |n, &d| n.checked_mul(d.max(1)));
    match bytes {
        Some(b) if b <= isize::MAX as usize => Ok(numel(shape)),
        _ => Err(Error::shape(op, format!("shape {shape:?} is too large: its element count overflows"))),
    }
}

/// The widest element any dtype has: shapes of views are checked as if they held it.
pub const MAX_ELEM_BYTES: usize = 8;

pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Normalises a possibly negative dim (`-1` = last) for a tensor of `ndim` dims.
pub fn norm_dim(op: &'static str, dim: i64, ndim: usize) -> Result<usize> {
    let n = ndim.max(1) as i64;
    let d = if dim < 0 { dim + n } else { dim };
    if d < 0 || d >= n {
        return Err(Error::Dim { op, dim, ndim });
    }
    Ok(d as usize)
}

/// The broadcast shape of two shapes, by NumPy/PyTorch rules.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(
                    op,
                    format!("shapes {a:?} and {b:?} cannot be broadcast (dim {i}: {da} vs {db})"),
                ))
            }
        };
    }
    checked_numel(op, &out, MAX_ELEM_BYTES)?;
    Ok(out)
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    /// Row-major contiguous (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }
    /// Dense strides for `shape` in `format`'s order (channels-last needs a 4-D shape).
    pub fn dense_in(shape: &[usize], format: MemoryFormat) -> Self {
        match format {
            MemoryFormat::Contiguous => Layout::contiguous(shape),
            MemoryFormat::ChannelsLast => Layout::channels_last(shape),
        }
    }

    /// Channels-last strides for a 4-D `shape` (`[N, C, H, W]` stored as NHWC).
    pub fn channels_last(shape: &[usize]) -> Self {
        debug_assert_eq!(shape.len(), 4);
        let nhwc = contiguous_strides(&TO_NHWC.map(|d| shape[d]));
        Layout { shape: shape.to_vec(), strides: FROM_NHWC.map(|d| nhwc[d]).to_vec(), offset: 0 }
    }

    /// Whether the elements are dense in `format`'s order (size-1 dims may have any stride, as
    /// in PyTorch's `is_contiguous(memory_format)`); only 4-D layouts can be channels-last.
    pub fn is_contiguous_for(&self, format: MemoryFormat) -> bool {
        match format {
            MemoryFormat::Contiguous => self.is_contiguous(),
            MemoryFormat::ChannelsLast => self.ndim() == 4 && self.permuted(&TO_NHWC).is_contiguous(),
        }
    }

    /// The format a result computed from this layout keeps (PyTorch's
    /// `suggest_memory_format`): channels-last when the strides grow in NHWC order (C
    /// smallest, then W, H, N), dense or not (a window of a channels-last tensor is still
    /// ordered so); a single channel or a 1x1 image, both orders at once, stays contiguous.
    pub fn suggested_format(&self) -> MemoryFormat {
        if self.ndim() != 4 || self.strides[1] == 0 {
            return MemoryFormat::Contiguous;
        }
        let mut min = 0;
        for d in [1, 3, 2, 0] {
            if self.shape[d] == 0 || self.strides[d] < min || (d == 0 && min == self.strides[1]) {
                return MemoryFormat::Contiguous;
            }
            min = self.strides[d] * self.shape[d].max(1);
        }
        MemoryFormat::ChannelsLast
    }

    /// The view of `len` elements along `dim` from `start`, every `step`-th.
    pub(crate) fn sliced(&self, dim: usize, start: usize, len: usize, step: usize) -> Layout {
        let mut l = self.clone();
        if len > 0 {
            l.offset += start * self.strides[dim];
        }
        l.shape[dim] = len;
        l.strides[dim] *= step;
        l
    }

    /// The layout with its dims reordered: dim `i` of the result is dim `perm[i]` of this one.
    pub(crate) fn permuted(&self, perm: &[usize]) -> Layout {
        Layout { shape: perm.iter().map(|&d| self.shape[d]).collect(), strides: perm.iter().map(|&d| self.strides[d]).collect(), offset: self.offset }
    }

    /// Every element is the same storage element (a broadcast scalar).
    pub fn is_broadcast_scalar(&self) -> bool {
        self.shape.iter().zip(&self.strides).all(|(&d, &s)| d == 1 || s == 0)
    }

    /// Strides for viewing this layout with `shape` without copying, when they exist
    /// (PyTorch's `computeStride`); `None` means a reshape must copy.
    pub fn view_strides(&self, shape: &[usize]) -> Option<Vec<usize>> {
        if self.is_contiguous() {
            return Some(contiguous_strides(shape));
        }
        let numel = self.numel();
        let mut new_strides = vec![0; shape.len()];
        if numel == 0 {
            return Some(contiguous_strides(shape));
        }
        let mut view_d = shape.len() as isize - 1;
        let mut chunk_base_stride = *self.strides.last().unwrap_or(&1);
        let mut tensor_numel = 1;
        let mut view_numel = 1;
        for tensor_d in (0..self.shape.len()).rev() {
            tensor_numel *= self.shape[tensor_d];
            if tensor_d == 0
                || (self.shape[tensor_d - 1] != 1
                    && self.strides[tensor_d - 1] != tensor_numel * chunk_base_stride)
            {
                while view_d >= 0 && (view_numel < tensor_numel || shape[view_d as usize] == 1) {
                    new_strides[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = self.strides[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Some(new_strides)
    }

    /// Storage offsets of every element in row-major order, handed to `f` in runs along the
    /// last dimension: `f(first_offset, stride, len)`. The workhorse of strided reads and writes.
    pub fn for_each_run(&self, start: usize, end: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
        // f(out_index, storage_offset, stride, len)
        if start >= end {
            return;
        }
        let nd = self.ndim();
        if nd == 0 {
            f(0, self.offset, 0, 1);
            return;
        }
        let inner = self.shape[nd - 1];
        let inner_stride = self.strides[nd - 1];
        // multi-index of `start`
        let mut idx = vec![0usize; nd];
        let mut rem = start;
        for d in (0..nd).rev() {
            idx[d] = rem % self.shape[d];
            rem /= self.shape[d];
        }
        let mut pos = start;
        while pos < end {
            let mut off = self.offset;
            off += idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>();
            let len = (inner - idx[nd - 1]).min(end - pos);
            f(pos, off, inner_stride, len);
            pos += len;
            // advance the multi-index by `len` (to the start of the next row)
            idx[nd - 1] += len;
            let mut d = nd - 1;
            while idx[d] >= self.shape[d] && d > 0 {
                idx[d] = 0;
                d -= 1;
                idx[d] += 1;
            }
        }
    }
}
