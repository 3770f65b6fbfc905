//! Forward values of ops against plain f64 reference loops, type promotion and broadcasting.
//!
//! This module holds the shared tolerances and helpers, and the promotion / broadcasting tests;
//! the op families live in `ops_pointwise`, `ops_reduce`, `ops_matmul`, `ops_index` and `ops_nn`.
//! Every reference is computed in f64 from the *rounded* inputs (the values the tensor really
//! holds), so the tolerances only have to cover the op's own rounding.
#![allow(dead_code)]

use crate::common::*;
use kiln::prelude::*;
use kiln::Error;

// ---- tolerances, per dtype: |got - want| <= ATOL + RTOL * |want| ----

/// F64: plain arithmetic and libm-quality transcendentals.
pub const F64_RTOL: f64 = 1e-12;
pub const F64_ATOL: f64 = 1e-12;
/// F32: arithmetic.
pub const F32_RTOL: f64 = 1e-6;
pub const F32_ATOL: f64 = 1e-6;
/// F32: transcendental functions (exp, log, tanh, erf, ...).
pub const F32_TRANS_RTOL: f64 = 1e-5;
pub const F32_TRANS_ATOL: f64 = 1e-5;
/// F16: one rounding of the result is 2^-11 ≈ 4.9e-4 relative.
pub const F16_RTOL: f64 = 1e-3;
pub const F16_ATOL: f64 = 1e-5;
/// BF16: one rounding of the result is 2^-8 ≈ 3.9e-3 relative.
pub const BF16_RTOL: f64 = 8e-3;
pub const BF16_ATOL: f64 = 1e-5;
/// Sums (and means, variances) of F32 values.
pub const F32_SUM_RTOL: f64 = 1e-5;
pub const F32_SUM_ATOL: f64 = 1e-5;

pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
pub const INTS: [DType; 3] = [DType::I64, DType::I32, DType::U8];

/// (rtol, atol) for results of dtype `dt`; `trans` selects the transcendental F32 tolerance.
pub fn tol(dt: DType, trans: bool) -> (f64, f64) {
    match dt {
        DType::F64 => (F64_RTOL, F64_ATOL),
        DType::F32 if trans => (F32_TRANS_RTOL, F32_TRANS_ATOL),
        DType::F32 => (F32_RTOL, F32_ATOL),
        DType::F16 => (F16_RTOL, F16_ATOL),
        DType::BF16 => (BF16_RTOL, BF16_ATOL),
        _ => (0.0, 0.0),
    }
}

/// Tolerance for sums / means / variances of `dt` values.
pub fn sum_tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F32 => (F32_SUM_RTOL, F32_SUM_ATOL),
        d => tol(d, false),
    }
}

/// `v` rounded to `dt` exactly as storing it in a tensor of `dt` does (host-side, via `half`).
pub fn round_to(dt: DType, v: f64) -> f64 {
    match dt {
        DType::F64 => v,
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f32(v as f32).to_f64(),
        DType::BF16 => half::bf16::from_f32(v as f32).to_f64(),
        DType::I64 => v as i64 as f64,
        DType::I32 => v as i64 as i32 as f64,
        DType::U8 => v as i64 as u8 as f64,
        DType::Bool => (v != 0.0) as u8 as f64,
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A contiguous tensor of `shape` with values `f(host_rand)` and those values as stored (rounded).
pub fn inputs(shape: &[usize], seed: u64, dt: DType, f: impl Fn(f64) -> f64) -> (Tensor, Vec<f64>) {
    let v: Vec<f64> = host_rand(numel(shape), seed).into_iter().map(f).collect();
    let x = t(&v, shape, dt);
    (x, v.iter().map(|&a| round_to(dt, a)).collect())
}

/// The layouts pointwise inputs are tested in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lay {
    Contig,
    /// A transposed [c, r] tensor.
    Transposed,
    /// Every other row and every other column (from 1) of a [2r, 2c+1] tensor.
    Strided,
    /// An [r, 1] tensor expanded (stride 0) to [r, c].
    Expanded,
}
pub const LAYOUTS: [Lay; 4] = [Lay::Contig, Lay::Transposed, Lay::Strided, Lay::Expanded];

/// An [r, c] tensor in layout `lay` and its logical (row-major) values, computed on the host by
/// index arithmetic from the base tensor's values.
pub fn make2(r: usize, c: usize, lay: Lay, dt: DType, seed: u64, f: impl Fn(f64) -> f64) -> (Tensor, Vec<f64>) {
    match lay {
        Lay::Contig => inputs(&[r, c], seed, dt, f),
        Lay::Transposed => {
            let (b, bv) = inputs(&[c, r], seed, dt, f);
            let x = b.transpose(0, 1).unwrap();
            assert!(!x.is_contiguous() && x.shares_storage_with(&b));
            let mut v = vec![0.0; r * c];
            for i in 0..r {
                for j in 0..c {
                    v[i * c + j] = bv[j * r + i];
                }
            }
            (x, v)
        }
        Lay::Strided => {
            let w = 2 * c + 1;
            let (b, bv) = inputs(&[2 * r, w], seed, dt, f);
            let x = b.slice(0, 0, (2 * r) as i64, 2).unwrap().slice(1, 1, w as i64, 2).unwrap();
            assert_eq!(x.shape(), &[r, c]);
            assert!(!x.is_contiguous() && x.shares_storage_with(&b));
            let mut v = vec![0.0; r * c];
            for i in 0..r {
                for j in 0..c {
                    v[i * c + j] = bv[2 * i * w + 1 + 2 * j];
                }
            }
            (x, v)
        }
        Lay::Expanded => {
            let (b, bv) = inputs(&[r, 1], seed, dt, f);
            let x = b.expand(&[r as i64, c as i64]).unwrap();
            assert_eq!(x.strides()[1], 0);
            let mut v = vec![0.0; r * c];
            for i in 0..r {
                for j in 0..c {
                    v[i * c + j] = bv[i];
                }
            }
            (x, v)
        }
    }
}

/// Row-major values of `v` (of shape `from`) broadcast to `to` by NumPy rules.
pub fn bcast(v: &[f64], from: &[usize], to: &[usize]) -> Vec<f64> {
    let lead = to.len() - from.len();
    (0..numel(to))
        .map(|flat| {
            let (mut rem, mut idx, mut stride) = (flat, 0, 1);
            for d in (0..to.len()).rev() {
                let i = rem % to[d];
                rem /= to[d];
                if d >= lead {
                    let fd = from[d - lead];
                    if fd != 1 {
                        idx += i * stride;
                    }
                    stride *= fd;
                }
            }
            v[idx]
        })
        .collect()
}

/// Elementwise closeness with a context string in the failure message (NaN matches NaN).
#[track_caller]
pub fn close(ctx: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{ctx}: lengths differ");
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * y.abs();
        assert!(ok, "{ctx}: element {i}: got {x}, expected {y} (rtol {rtol}, atol {atol})\n got  {got:?}\n want {want:?}");
    }
}

/// Checks shape, dtype and values of `got`.
#[track_caller]
pub fn check(ctx: &str, got: &Tensor, shape: &[usize], dtype: DType, want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.shape(), shape, "{ctx}: shape");
    assert_eq!(got.dtype(), dtype, "{ctx}: dtype");
    close(ctx, &vals(got), want, rtol, atol);
}

/// An I64 tensor on the test device from exact i64 values (t() goes through f64).
pub fn ti64(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap().to_device(&dev()).unwrap()
}
pub fn ti32(v: &[i32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap().to_device(&dev()).unwrap()
}
pub fn tu8(v: &[u8], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap().to_device(&dev()).unwrap()
}
pub fn tbool(v: &[bool], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap().to_device(&dev()).unwrap()
}
/// The values of an I64 tensor, exactly.
pub fn i64s(x: &Tensor) -> Vec<i64> {
    assert_eq!(x.dtype(), DType::I64);
    x.to_device(&Device::Cpu).unwrap().to_vec::<i64>().unwrap()
}
/// A 0-dim tensor.
pub fn t0(v: f64, dt: DType) -> Tensor {
    t(&[v], &[], dt)
}

// ---------------------------------------------------------------------------------------------
// Type promotion through real ops (PyTorch's rules: category first, dims > 0-dim > plain numbers)
// ---------------------------------------------------------------------------------------------

use DType::*;

#[track_caller]
fn is(x: kiln::Result<Tensor>, dtype: DType, want: &[f64]) {
    let x = x.unwrap();
    assert_eq!(x.dtype(), dtype, "result dtype");
    close(&format!("{dtype:?} result"), &vals(&x), want, 1e-6, 0.0);
}

#[test]
fn promotion_tensor_with_scalar() {
    let i = t(&[1.0, 2.0, 3.0], &[3], I64);
    // int tensor + float number -> default float
    is(i.add_scalar(2.5), F32, &[3.5, 4.5, 5.5]);
    is(i.mul_scalar(0.5f32), F32, &[0.5, 1.0, 1.5]);
    // int tensor + int number keeps the tensor's dtype
    is(i.add_scalar(2i64), I64, &[3.0, 4.0, 5.0]);
    is(t(&[1.0, 2.0], &[2], I32).mul_scalar(3i64), I32, &[3.0, 6.0]);
    // the number's width does not count: u8 + 300 stays u8 (and wraps)
    is(t(&[1.0, 2.0, 250.0], &[3], U8).add_scalar(300i64), U8, &[45.0, 46.0, 38.0]);
    is(t(&[250.0, 3.0], &[2], U8).add_scalar(10i64), U8, &[4.0, 13.0]);
    // half tensors stay half with float numbers
    is(t(&[1.5, -2.0], &[2], F16).mul_scalar(2.0), F16, &[3.0, -4.0]);
    is(t(&[1.5, -2.0], &[2], BF16).add_scalar(0.25), BF16, &[1.75, -1.75]);
    is(t(&[1.5, -2.0], &[2], F16).pow_scalar(2i64), F16, &[2.25, 4.0]);
    // f32 + f64 number stays f32
    is(t(&[1.0], &[1], F32).add_scalar(0.5f64), F32, &[1.5]);
    // bool tensor: int number -> I64, float number -> F32, bool -> Bool
    let b = t(&[1.0, 0.0, 1.0], &[3], Bool);
    is(b.add_scalar(1i64), I64, &[2.0, 1.0, 2.0]);
    is(b.add_scalar(2.5), F32, &[3.5, 2.5, 3.5]);
    is(b.add_scalar(true), Bool, &[1.0, 1.0, 1.0]);
    is(b.mul_scalar(false), Bool, &[0.0, 0.0, 0.0]);
    // int / int -> F32, and the reversed forms
    is(i.div_scalar(2i64), F32, &[0.5, 1.0, 1.5]);
    is(t(&[1.0, 2.0, 4.0], &[3], I32).rdiv_scalar(1i64), F32, &[1.0, 0.5, 0.25]);
    is(i.rsub_scalar(10i64), I64, &[9.0, 8.0, 7.0]);
    is(i.rsub_scalar(0.5), F32, &[-0.5, -1.5, -2.5]);
    // pow: int ** int stays int, int ** float is float
    is(i.pow_scalar(2i64), I64, &[1.0, 4.0, 9.0]);
    is(t(&[4.0, 9.0], &[2], I64).pow_scalar(0.5), F32, &[2.0, 3.0]);
    // comparisons and logical ops are Bool whatever the operands
    is(i.lt_scalar(2.5), Bool, &[1.0, 1.0, 0.0]);
    is(i.ge_scalar(2i64), Bool, &[0.0, 1.0, 1.0]);
    is(t(&[0.5, 0.0], &[2], F16).logical_or_scalar(0.0), Bool, &[1.0, 0.0]);
    is(i.logical_and_scalar(true), Bool, &[1.0, 1.0, 1.0]);
}

#[test]
fn promotion_tensor_with_tensor() {
    let v = [1.0, 2.0, 3.0];
    let tt = |dt| t(&v, &[3], dt);
    // same category: the wider dtype
    is(tt(I32).add(&tt(I64)), I64, &[2.0, 4.0, 6.0]);
    is(tt(U8).add(&tt(I32)), I32, &[2.0, 4.0, 6.0]);
    is(tt(Bool).add(&tt(U8)), U8, &[2.0, 3.0, 4.0]);
    is(tt(F32).add(&tt(F64)), F64, &[2.0, 4.0, 6.0]);
    is(tt(F16).mul(&tt(F32)), F32, &[1.0, 4.0, 9.0]);
    // f16 with bf16: neither holds the other -> F32
    is(tt(F16).add(&tt(BF16)), F32, &[2.0, 4.0, 6.0]);
    is(tt(BF16).sub(&tt(F16)), F32, &[0.0, 0.0, 0.0]);
    // int with float: the float
    is(tt(I64).add(&tt(F16)), F16, &[2.0, 4.0, 6.0]);
    is(tt(I32).mul(&tt(BF16)), BF16, &[1.0, 4.0, 9.0]);
    is(tt(Bool).add(&tt(F32)), F32, &[2.0, 3.0, 4.0]);
    // bool + bool stays bool (add is "or", mul is "and")
    let a = t(&[1.0, 0.0, 1.0, 0.0], &[4], Bool);
    let b = t(&[1.0, 1.0, 0.0, 0.0], &[4], Bool);
    is(a.add(&b), Bool, &[1.0, 1.0, 1.0, 0.0]);
    is(a.mul(&b), Bool, &[1.0, 0.0, 0.0, 0.0]);
    // bool - bool is refused, as in PyTorch
    assert!(matches!(a.sub(&b), Err(Error::DType { .. })));
    // int / int -> F32
    is(t(&[7.0, -7.0, 1.0], &[3], I64).div(&t(&[2.0, 2.0, 4.0], &[3], I32)), F32, &[3.5, -3.5, 0.25]);
    is(tt(U8).div(&tt(U8)), F32, &[1.0, 1.0, 1.0]);
    // maximum / pow promote like arithmetic
    is(tt(I32).maximum(&t(&[1.5, 1.5, 1.5], &[3], F32)), F32, &[1.5, 2.0, 3.0]);
    is(tt(I64).pow(&t(&[2.0, 2.0, 2.0], &[3], I32)), I64, &[1.0, 4.0, 9.0]);
    // comparisons -> Bool, compared in the promoted dtype
    is(tt(I64).lt(&t(&[1.5, 2.0, 2.5], &[3], F32)), Bool, &[1.0, 0.0, 0.0]);
    is(tt(U8).eq(&tt(F16)), Bool, &[1.0, 1.0, 1.0]);
    is(tt(F64).ne(&tt(BF16)), Bool, &[0.0, 0.0, 0.0]);
    is(tt(Bool).le(&tt(I32)), Bool, &[1.0, 1.0, 1.0]);
    // logical ops -> Bool from any dtypes
    is(t(&[0.0, 2.0, -1.0], &[3], F32).logical_xor(&t(&[0.0, 0.0, 3.0], &[3], I64)), Bool, &[0.0, 1.0, 0.0]);
}

#[test]
fn promotion_zero_dim_tensors() {
    let v = [1.0, 2.0];
    // a 0-dim tensor of a higher category decides the dtype...
    is(t(&v, &[2], I32).add(&t0(0.5, F64)), F64, &[1.5, 2.5]);
    is(t(&v, &[2], I64).mul(&t0(0.5, F32)), F32, &[0.5, 1.0]);
    is(t(&[1.0, 0.0], &[2], Bool).add(&t0(3.0, I32)), I32, &[4.0, 3.0]);
    // ...of the same category it does not
    is(t(&v, &[2], F32).add(&t0(0.5, F64)), F32, &[1.5, 2.5]);
    is(t(&v, &[2], F16).add(&t0(0.5, F32)), F16, &[1.5, 2.5]);
    is(t(&v, &[2], BF16).add(&t0(0.5, F16)), BF16, &[1.5, 2.5]);
    is(t(&v, &[2], U8).add(&t0(300.0, I64)), U8, &[45.0, 46.0]);
    is(t(&v, &[2], I32).add(&t0(3.0, I64)), I32, &[4.0, 5.0]);
    // order does not matter
    is(t0(0.5, F64).add(&t(&v, &[2], I32)), F64, &[1.5, 2.5]);
    is(t0(0.5, F64).add(&t(&v, &[2], F32)), F32, &[1.5, 2.5]);
    // two 0-dim tensors promote normally
    is(t0(1.0, F32).add(&t0(0.5, F64)), F64, &[1.5]);
    is(t0(1.0, I32).add(&t0(2.0, I64)), I64, &[3.0]);
    is(t0(1.0, F16).add(&t0(2.0, BF16)), F32, &[3.0]);
    // where: the branches promote with the same rules
    let c = t(&[1.0, 0.0], &[2], Bool);
    is(c.where_(&t(&v, &[2], I32), &t(&[5.5, 6.5], &[2], F32)), F32, &[1.0, 6.5]);
    is(c.where_(&t0(9.0, F64), &t(&[5.5, 6.5], &[2], F32)), F32, &[9.0, 6.5]);
    is(c.where_(&t0(9.0, F64), &t(&[5.0, 6.0], &[2], I64)), F64, &[9.0, 6.0]);
    is(c.where_(&t(&v, &[2], F16), &t(&v, &[2], BF16)), F32, &[1.0, 2.0]);
}

#[test]
fn promotion_of_unary_ops_and_reductions() {
    let i = t(&[1.0, -2.0, 4.0], &[3], I64);
    // integer-preserving unary ops
    is(i.neg(), I64, &[-1.0, 2.0, -4.0]);
    is(i.abs(), I64, &[1.0, 2.0, 4.0]);
    is(i.sign(), I64, &[1.0, -1.0, 1.0]);
    is(i.relu(), I64, &[1.0, 0.0, 4.0]);
    is(t(&[3.0, 0.0], &[2], U8).relu(), U8, &[3.0, 0.0]);
    // the rest compute in the default float
    is(t(&[0.0, 1.0], &[2], I64).exp(), F32, &[1.0, std::f64::consts::E]);
    is(t(&[4.0, 9.0], &[2], I32).sqrt(), F32, &[2.0, 3.0]);
    is(t(&[0.0, 1.0], &[2], Bool).sigmoid(), F32, &[0.5, 1.0 / (1.0 + (-1.0f64).exp())]);
    is(t(&[0.0, 1.0], &[2], U8).tanh(), F32, &[0.0, 1.0f64.tanh()]);
    // floats keep their dtype
    is(t(&[0.0, 1.0], &[2], F16).exp(), F16, &[1.0, round_to(F16, std::f64::consts::E)]);
    is(t(&[0.0, 1.0], &[2], BF16).exp(), BF16, &[1.0, round_to(BF16, std::f64::consts::E)]);
    // logical_not is Bool from anything
    is(i.logical_not(), Bool, &[0.0, 0.0, 0.0]);
    is(t(&[0.0, 0.5], &[2], F16).logical_not(), Bool, &[1.0, 0.0]);
    // neg / abs of bool are refused
    let b = t(&[1.0, 0.0], &[2], Bool);
    assert!(b.neg().is_err() && b.abs().is_err());
    // sums: int and bool -> I64 (no wrap in the narrow type)
    is(t(&[2e9, 2e9, 2e9], &[3], I32).sum_all(), I64, &[6e9]);
    is(t(&[200.0, 200.0, 100.0], &[3], U8).sum_all(), I64, &[500.0]);
    is(t(&[1.0, 0.0, 1.0, 1.0], &[4], Bool).sum_all(), I64, &[3.0]);
    is(t(&[1.0, 0.0, 1.0, 1.0], &[2, 2], Bool).sum(&[1], false), I64, &[1.0, 2.0]);
    is(t(&[3.0, 4.0, 5.0], &[3], I32).prod_all(), I64, &[60.0]);
    is(t(&[1.0, 2.0], &[2], F16).sum_all(), F16, &[3.0]);
    // amax keeps the dtype; argmax is I64
    is(t(&[3.0, 7.0, 5.0], &[3], U8).amax(&[], false), U8, &[7.0]);
    is(t(&[3.0, 7.0, 5.0], &[3], F16).argmax(0, false), I64, &[1.0]);
    // mean / var need floats
    assert!(matches!(i.mean_all(), Err(Error::DType { .. })));
    assert!(i.var(&[], 1.0, false).is_err());
}

#[test]
fn int_scalars_are_exact() {
    // Integer numbers must reach integer arithmetic exactly, beyond f64's 53-bit mantissa.
    let big = (1i64 << 53) + 1;
    let x = ti64(&[0, 1 << 53, big], &[3]);
    let s = x.add_scalar(big).unwrap();
    assert_eq!(i64s(&s), vec![big, (1 << 54) + 1, 2 * big]);
    let e = x.eq_scalar(big).unwrap();
    assert_eq!(vals(&e), vec![0.0, 0.0, 1.0]);
    let m = ti64(&[1, 2], &[2]).mul_scalar(i64::MAX).unwrap();
    assert_eq!(i64s(&m), vec![i64::MAX, i64::MAX.wrapping_mul(2)]);
    // masked_fill with a large integer value
    let m = t(&[0.0, 1.0, 0.0], &[3], Bool);
    assert_eq!(i64s(&x.masked_fill(&m, big).unwrap()), vec![0, big, big]);
    assert_eq!(i64s(&x.masked_fill(&m, i64::MIN).unwrap()), vec![0, i64::MIN, big]);
    // and tensors of large integers stay exact through elementwise ops
    let a = ti64(&[1 << 53, i64::MAX, -7], &[3]);
    let b = ti64(&[1, 1, 2], &[3]);
    assert_eq!(i64s(&a.add(&b).unwrap()), vec![big, i64::MIN, -5]);
    assert_eq!(vals(&a.add(&b).unwrap().gt(&a).unwrap()), vec![1.0, 0.0, 1.0]);
    assert_eq!(i64s(&a.maximum(&ti64(&[big, 0, 0], &[3])).unwrap()), vec![big, i64::MAX, 0]);
    assert_eq!(i64s(&a.sum_all().unwrap()), vec![(1i64 << 53).wrapping_add(i64::MAX).wrapping_sub(7)]);
}

// ---------------------------------------------------------------------------------------------
// Broadcasting
// ---------------------------------------------------------------------------------------------

#[test]
fn broadcasting_table() {
    #[rustfmt::skip]
    let ok: &[(&[usize], &[usize], &[usize])] = &[
        (&[3, 1], &[4], &[3, 4]),
        (&[2, 1, 4], &[3, 1], &[2, 3, 4]),
        (&[], &[5], &[5]),
        (&[5], &[], &[5]),
        (&[1], &[0], &[0]),
        (&[5, 0], &[1, 1], &[5, 0]),
        (&[4, 1, 2], &[3, 1], &[4, 3, 2]),
        (&[1, 1, 1], &[2], &[1, 1, 2]),
        (&[2, 3], &[2, 3], &[2, 3]),
        (&[1, 3, 1, 5], &[6, 1], &[1, 3, 6, 5]),
        (&[7, 1], &[1, 1], &[7, 1]),
        (&[], &[], &[]),
    ];
    for (k, &(sa, sb, want)) in ok.iter().enumerate() {
        let (a, av) = inputs(sa, 10 + k as u64, F64, |x| x);
        let (b, bv) = inputs(sb, 50 + k as u64, F64, |x| x);
        let (ea, eb) = (bcast(&av, sa, want), bcast(&bv, sb, want));
        let sum: Vec<f64> = ea.iter().zip(&eb).map(|(x, y)| x + y).collect();
        let diff: Vec<f64> = ea.iter().zip(&eb).map(|(x, y)| x - y).collect();
        check(&format!("{sa:?} + {sb:?}"), &a.add(&b).unwrap(), want, F64, &sum, 0.0, 0.0);
        check(&format!("{sb:?} + {sa:?}"), &b.add(&a).unwrap(), want, F64, &sum, 0.0, 0.0);
        check(&format!("{sa:?} - {sb:?}"), &a.sub(&b).unwrap(), want, F64, &diff, 0.0, 0.0);
        let lt: Vec<f64> = ea.iter().zip(&eb).map(|(x, y)| (x < y) as u8 as f64).collect();
        check(&format!("{sa:?} < {sb:?}"), &a.lt(&b).unwrap(), want, Bool, &lt, 0.0, 0.0);
        // broadcast_to the result shape gives the same expansion
        check(&format!("{sa:?} broadcast_to {want:?}"), &a.broadcast_to(want).unwrap(), want, F64, &ea, 0.0, 0.0);
    }
    #[rustfmt::skip]
    let bad: &[(&[usize], &[usize])] = &[
        (&[3], &[4]), (&[2, 3], &[3, 2]), (&[2, 1], &[3, 4]), (&[0], &[2]), (&[2, 3, 4], &[5, 4]), (&[2], &[2, 3]),
    ];
    for &(sa, sb) in bad {
        let a = t(&vec![1.0; numel(sa)], sa, F32);
        let b = t(&vec![1.0; numel(sb)], sb, F32);
        for r in [a.add(&b), b.add(&a), a.mul(&b), a.eq(&b), a.maximum(&b), a.logical_and(&b)] {
            assert!(matches!(r, Err(Error::Shape { .. })), "{sa:?} with {sb:?} must not broadcast: {r:?}");
        }
        let c = t(&vec![1.0; numel(sa)], sa, Bool);
        assert!(c.where_(&b, &b).is_err(), "where {sa:?} {sb:?}");
    }
    // broadcast_to only expands: it never shrinks or drops dims
    let x = t(&[1.0, 2.0, 3.0], &[3, 1], F32);
    assert!(x.broadcast_to(&[3]).is_err());
    assert!(x.broadcast_to(&[3, 4]).is_ok());
    assert!(x.broadcast_to(&[2, 3, 4]).is_ok());
    assert!(x.broadcast_to(&[4, 4]).is_err());
    assert!(x.expand(&[-1, 5]).unwrap().shape() == [3, 5]);
}

#[test]
fn broadcasting_three_way_where_and_masked_fill() {
    // where(cond [2,1,4], a [3,1], b [4]) -> [2,3,4]
    let (cf, cv) = inputs(&[2, 1, 4], 1, F64, |x| x);
    let c = cf.gt_scalar(0.0).unwrap();
    let (a, av) = inputs(&[3, 1], 2, F32, |x| x);
    let (b, bv) = inputs(&[4], 3, F64, |x| x);
    let out = [2, 3, 4];
    let (ec, ea, eb) = (bcast(&cv, &[2, 1, 4], &out), bcast(&av, &[3, 1], &out), bcast(&bv, &[4], &out));
    let want: Vec<f64> = (0..24).map(|i| if ec[i] > 0.0 { ea[i] } else { eb[i] }).collect();
    check("where 3-way", &c.where_(&a, &b).unwrap(), &out, F64, &want, 0.0, 0.0);
    // masked_fill: the tensor and the mask broadcast together, as in torch
    let (x, xv) = inputs(&[2, 3, 4], 4, F32, |x| x);
    let m = t(&[1.0, 0.0, 0.0, 1.0], &[4], Bool);
    let want: Vec<f64> = xv.iter().enumerate().map(|(i, &v)| if i % 4 == 0 || i % 4 == 3 { -7.5 } else { v }).collect();
    check("masked_fill", &x.masked_fill(&m, -7.5).unwrap(), &out, F32, &want, 0.0, 0.0);
    let big = t(&[1.0; 48], &[2, 2, 3, 4], Bool);
    let filled = x.masked_fill(&big, 0.0).unwrap();
    assert_eq!((filled.shape().to_vec(), vals(&filled)), (vec![2, 2, 3, 4], vec![0.0; 48]));
    assert!(x.masked_fill(&t(&[1.0, 0.0, 1.0], &[3], Bool), 0.0).is_err());
}
