//! Batched matrix products through the `gemm` crate, which takes arbitrary strides, so
//! transposed and broadcast operands are read in place.

use super::{with_operand, CpuStorage, HostBuf, HostElem, Operand};
use crate::layout::Layout;
use crate::storage::BackendStorage;
use crate::{DType, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

/// `a` [B, M, K] @ `b` [B, K, N] -> contiguous [B, M, N], all of dtype `dtype`.
pub(crate) fn bmm(a: &Tensor, b: &Tensor, dtype: DType) -> CpuStorage {
    let (bs, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[2];
    match dtype {
        DType::F32 => CpuStorage::F32(gemm_strided::<f32>(a, b, bs, m, k, n)),
        DType::F64 => CpuStorage::F64(gemm_strided::<f64>(a, b, bs, m, k, n)),
        // f16 and bf16 accumulate in f32, like PyTorch's CPU path (the gemm crate's f16
        // kernels lose more than the result's own rounding on 768-term sums).
        DType::F16 | DType::BF16 => {
            let (a32, b32) = (a.to_dtype(DType::F32).expect("cast"), b.to_dtype(DType::F32).expect("cast"));
            CpuStorage::from_vec_as(gemm_strided::<f32>(&a32, &b32, bs, m, k, n), dtype)
        }
        _ => CpuStorage::from_vec_as(int_bmm(a, b, bs, m, k, n), dtype),
    }
}

fn strides(l: &Layout) -> (usize, isize, isize) {
    (l.strides[0], l.strides[1] as isize, l.strides[2] as isize)
}

fn gemm_strided<T: HostElem + num_zero::Zero>(a: &Tensor, b: &Tensor, bs: usize, m: usize, k: usize, n: usize) -> HostBuf<T> {
    let mut out = super::pool::zeros(bs * m * n);
    if k == 0 || out.is_empty() {
        return out;
    }
    let ga = a.storage().data.read_recursive();
    let gb = b.storage().data.read_recursive();
    let (BackendStorage::Cpu(sa), BackendStorage::Cpu(sb)) = (&*ga, &*gb) else { unreachable!("CPU kernel on a CUDA tensor") };
    let (da, db) = (T::slice(sa).expect("dtype"), T::slice(sb).expect("dtype"));
    let (a_bs, a_rs, a_cs) = strides(a.layout());
    let (b_bs, b_rs, b_cs) = strides(b.layout());
    let (ao, bo) = (a.layout().offset, b.layout().offset);
    let flops = m * n * k;
    let threads = rayon::current_num_threads();
    // Big products parallelise inside gemm; many small ones across the batch. Mid-sized ones
    // (from 2M multiply-adds: the MLP step's 32x784x256) are split into single-threaded
    // products on the spinning helpers (`spin.rs`): gemm's own threading, and waking rayon's
    // sleeping workers, cost more than a second core saves there.
    let big = flops >= 1 << 23 && bs < threads;
    let inner = if big { Parallelism::Rayon(threads) } else { Parallelism::None };
    // Rows i0..i1 and columns j0..j1 of product i into `o` (its m×n block, row stride n).
    let block = |i: usize, o: *mut T, (i0, i1): (usize, usize), (j0, j1): (usize, usize)| unsafe {
        // SAFETY: offsets and strides come from layouts that describe in-bounds elements of
        // these storages; `o` is a contiguous m×n block, and the ranges lie inside it.
        gemm::gemm(
            i1 - i0, j1 - j0, k,
            o.add(i0 * n + j0), 1, n as isize, false,
            da.as_ptr().add(ao + i * a_bs).offset(i0 as isize * a_rs), a_cs, a_rs,
            db.as_ptr().add(bo + i * b_bs).offset(j0 as isize * b_cs), b_cs, b_rs,
            T::zero(), T::one(), false, false, false, inner,
        )
    };
    let parts = if !big && bs == 1 && flops >= 1 << 21 { super::spin::parts() } else { 1 };
    let one = |(i, o): (usize, &mut [T])| {
        if parts == 1 {
            return block(i, o.as_mut_ptr(), (0, m), (0, n));
        }
        // Each part writes its own rows (or, for few rows, columns) of `o`: disjoint elements.
        let base = o.as_mut_ptr() as usize;
        let cut = |len: usize, p: usize| (p * len / parts, (p + 1) * len / parts);
        super::spin::run(parts, &|p| {
            let o = base as *mut T;
            if m >= 64 * parts { block(i, o, cut(m, p), (0, n)) } else { block(i, o, (0, m), cut(n, p)) }
        });
    };
    if bs > 1 && flops * bs >= 1 << 16 {
        out.par_chunks_mut(m * n).enumerate().for_each(one);
    } else {
        out.chunks_mut(m * n).enumerate().for_each(one);
    }
    out
}

fn int_bmm(a: &Tensor, b: &Tensor, bs: usize, m: usize, k: usize, n: usize) -> Vec<i64> {
    with_operand::<i64, _>(a, |oa| {
        with_operand::<i64, _>(b, |ob| {
            let get = |o: &Operand<i64>, i| o.get(i);
            let mut out = vec![0i64; bs * m * n];
            for bi in 0..bs {
                for i in 0..m {
                    for j in 0..n {
                        let mut s = 0i64;
                        for p in 0..k {
                            s = s.wrapping_add(get(&oa, (bi * m + i) * k + p).wrapping_mul(get(&ob, (bi * k + p) * n + j)));
                        }
                        out[(bi * m + i) * n + j] = s;
                    }
                }
            }
            out
        })
    })
}

/// Zero and one for the element types gemm multiplies.
mod num_zero {
    pub trait Zero: Sized {
        fn zero() -> Self;
        fn one() -> Self;
    }
    impl Zero for f32 {
        fn zero() -> Self { 0.0 }
        fn one() -> Self { 1.0 }
    }
    impl Zero for f64 {
        fn zero() -> Self { 0.0 }
        fn one() -> Self { 1.0 }
    }
    impl Zero for half::f16 {
        fn zero() -> Self { half::f16::ZERO }
        fn one() -> Self { half::f16::ONE }
    }
}
