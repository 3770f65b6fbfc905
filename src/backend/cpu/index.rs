//! Joining, padding and indexing loops. They move elements without arithmetic (scatter_add
//! excepted), so they are generic over the storage type itself.

use super::{gather, to_vec_as, with_dtype, with_storage, CpuStorage, HostBuf, HostElem};
use crate::dtype::Elem;
use crate::layout::{contiguous_strides, numel, Layout};
use crate::storage::BackendStorage;
use crate::{DType, Error, Result, Tensor};

/// The tensor's elements, row-major, in its own dtype.
fn contiguous<T: HostElem>(t: &Tensor) -> HostBuf<T> {
    to_vec_as::<T>(t)
}

/// Concatenation along `dim` of tensors that all have dtype `dtype`.
pub(crate) fn cat(ts: &[&Tensor], dim: usize, out_shape: &[usize], dtype: DType) -> CpuStorage {
    with_dtype!(dtype, T => {
        let outer: usize = out_shape[..dim].iter().product();
        let inner: usize = out_shape[dim + 1..].iter().product();
        let mut out: Vec<T> = Vec::with_capacity(numel(out_shape));
        let parts: Vec<(HostBuf<T>, usize)> = ts.iter().map(|t| (contiguous::<T>(t), t.shape()[dim] * inner)).collect();
        for o in 0..outer {
            for (v, block) in &parts {
                out.extend_from_slice(&v[o * block..(o + 1) * block]);
            }
        }
        T::wrap(out)
    })
}

/// Constant padding: `pads[d] = (before, after)` for every dim.
pub(crate) fn pad(x: &Tensor, pads: &[(usize, usize)], value: f64, out_shape: &[usize]) -> CpuStorage {
    with_dtype!(x.dtype(), T => {
        let mut out = vec![T::from_f64(value); numel(out_shape)];
        let strides = contiguous_strides(out_shape);
        let interior = Layout {
            shape: x.shape().to_vec(),
            strides: strides.clone(),
            offset: pads.iter().zip(&strides).map(|(p, s)| p.0 * s).sum(),
        };
        let src = contiguous::<T>(x);
        interior.for_each_run(0, src.len(), |pos, off, stride, len| {
            for k in 0..len {
                out[off + k * stride] = src[pos + k];
            }
        });
        T::wrap(out)
    })
}

/// An index in `[0, size)`; negative ones are out of range, as in PyTorch's index_select,
/// gather, scatter and embedding.
fn check_index(op: &'static str, i: i64, size: usize) -> Result<usize> {
    if i < 0 || i >= size as i64 {
        return Err(Error::Index { op, index: i, size });
    }
    Ok(i as usize)
}

/// `x` indexed along `dim` by the 1-D `index`.
pub(crate) fn index_select(x: &Tensor, dim: usize, index: &Tensor) -> Result<CpuStorage> {
    let idx = to_vec_as::<i64>(index);
    let size = x.shape()[dim];
    let idx: Vec<usize> = idx.iter().map(|&i| check_index("index_select", i, size)).collect::<Result<_>>()?;
    let outer: usize = x.shape()[..dim].iter().product();
    let inner: usize = x.shape()[dim + 1..].iter().product();
    Ok(with_dtype!(x.dtype(), T => {
        let src = contiguous::<T>(x);
        let mut out: Vec<T> = Vec::with_capacity(outer * idx.len() * inner);
        for o in 0..outer {
            for &j in &idx {
                let s = (o * size + j) * inner;
                out.extend_from_slice(&src[s..s + inner]);
            }
        }
        T::wrap(out)
    }))
}

/// For each position of `index` (shape of the output), the offset in a contiguous `x` it reads.
fn gather_offsets(op: &'static str, x_shape: &[usize], dim: usize, index: &Tensor) -> Result<Vec<usize>> {
    let idx = to_vec_as::<i64>(index);
    let xs = contiguous_strides(x_shape);
    let ishape = index.shape();
    let mut offsets = Vec::with_capacity(idx.len());
    let mut multi = vec![0usize; ishape.len()];
    for &i in idx.iter() {
        let j = check_index(op, i, x_shape[dim])?;
        let mut off = 0;
        for d in 0..ishape.len() {
            off += if d == dim { j } else { multi[d] } * xs[d];
        }
        offsets.push(off);
        for d in (0..ishape.len()).rev() {
            multi[d] += 1;
            if multi[d] < ishape[d] {
                break;
            }
            multi[d] = 0;
        }
    }
    Ok(offsets)
}

/// `out[i][j] = x[index[i][j]][j]` (for dim 0), output of index's shape.
pub(crate) fn gather_dim(x: &Tensor, dim: usize, index: &Tensor) -> Result<CpuStorage> {
    let offsets = gather_offsets("gather", x.shape(), dim, index)?;
    Ok(with_dtype!(x.dtype(), T => {
        let src = contiguous::<T>(x);
        T::wrap(offsets.iter().map(|&o| src[o]).collect::<Vec<_>>())
    }))
}

/// src's values at the index's positions: its leading index-shaped block (src may be larger).
fn scattered<T: HostElem>(index: &Tensor, src: &Tensor) -> HostBuf<T> {
    let sub = Layout { shape: index.shape().to_vec(), strides: src.layout().strides.clone(), offset: src.layout().offset };
    let guard = src.storage().data.read_recursive();
    let BackendStorage::Cpu(s) = &*guard else { unreachable!("CPU kernel on a CUDA tensor") };
    with_storage!(s, v => gather(v, &sub))
}

/// `out = base; out[index[i][j]][j] = src[i][j]` (for dim 0).
pub(crate) fn scatter(base: &Tensor, dim: usize, index: &Tensor, src: &Tensor) -> Result<CpuStorage> {
    let offsets = gather_offsets("scatter", base.shape(), dim, index)?;
    Ok(with_dtype!(base.dtype(), T => {
        let mut out = contiguous::<T>(base);
        for (&o, &v) in offsets.iter().zip(scattered::<T>(index, src).iter()) {
            out[o] = v;
        }
        T::wrap(out)
    }))
}

/// `scatter` into the contiguous `target` itself: only the indexed elements are written.
pub(crate) fn scatter_into(target: &Tensor, dim: usize, index: &Tensor, src: &Tensor) -> Result<()> {
    let offsets = gather_offsets("scatter_", target.shape(), dim, index)?;
    let at = target.layout().offset;
    with_dtype!(target.dtype(), T => {
        let vals = scattered::<T>(index, src);
        let mut guard = target.storage().data.write();
        let BackendStorage::Cpu(s) = &mut *guard else { unreachable!("CPU kernel on a CUDA tensor") };
        let out = T::slice_mut(s).expect("the tensor's own dtype");
        for (&o, &v) in offsets.iter().zip(vals.iter()) {
            out[at + o] = v;
        }
    });
    Ok(())
}

/// `out = base; out[index[i][j]][j] += src[i][j]` (for dim 0).
pub(crate) fn scatter_add(base: &Tensor, dim: usize, index: &Tensor, src: &Tensor) -> Result<CpuStorage> {
    let offsets = gather_offsets("scatter_add", base.shape(), dim, index)?;
    fn go<C: HostElem + std::ops::Add<Output = C>>(base: &Tensor, index: &Tensor, src: &Tensor, offsets: &[usize]) -> CpuStorage {
        let mut out = to_vec_as::<C>(base);
        for (&o, &v) in offsets.iter().zip(scattered::<C>(index, src).iter()) {
            out[o] = out[o] + v;
        }
        CpuStorage::from_vec_as(out, base.dtype())
    }
    Ok(match base.dtype() {
        DType::F64 => go::<f64>(base, index, src, &offsets),
        d if d.is_float() => go::<f32>(base, index, src, &offsets),
        _ => go::<i64>(base, index, src, &offsets),
    })
}
