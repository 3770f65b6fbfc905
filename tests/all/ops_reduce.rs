//! Reductions against f64 reference loops: single, several, negative and all dims, keepdim,
//! contiguous and non-contiguous inputs, ties, NaN, -inf, and inputs large enough for the
//! parallel paths.

use crate::common::*;
use crate::ops::*;
use kiln::prelude::*;

/// For each output element (row-major over the kept dims), the input values it reduces
/// (row-major over the reduced dims). `dims` are normalised and sorted.
fn groups(v: &[f64], shape: &[usize], dims: &[usize]) -> Vec<Vec<f64>> {
    let n = shape.len();
    let mut strides = vec![1; n];
    for d in (0..n.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let kept: Vec<usize> = (0..n).filter(|d| !dims.contains(d)).collect();
    let nk: usize = kept.iter().map(|&d| shape[d]).product();
    let nr: usize = dims.iter().map(|&d| shape[d]).product();
    (0..nk)
        .map(|ko| {
            let (mut base, mut rem) = (0, ko);
            for &d in kept.iter().rev() {
                base += (rem % shape[d]) * strides[d];
                rem /= shape[d];
            }
            (0..nr)
                .map(|ro| {
                    let (mut off, mut rem) = (base, ro);
                    for &d in dims.iter().rev() {
                        off += (rem % shape[d]) * strides[d];
                        rem /= shape[d];
                    }
                    v[off]
                })
                .collect()
        })
        .collect()
}

fn norm(dims: &[i64], ndim: usize) -> Vec<usize> {
    let mut d: Vec<usize> = if dims.is_empty() { (0..ndim).collect() } else { dims.iter().map(|&d| if d < 0 { (d + ndim as i64) as usize } else { d as usize }).collect() };
    d.sort();
    d
}

fn out_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    shape.iter().enumerate().filter_map(|(i, &s)| if dims.contains(&i) { keepdim.then_some(1) } else { Some(s) }).collect()
}

fn ref_sum(g: &[f64]) -> f64 {
    g.iter().sum()
}
fn ref_mean(g: &[f64]) -> f64 {
    g.iter().sum::<f64>() / g.len() as f64
}
fn ref_var(g: &[f64], c: f64) -> f64 {
    let m = ref_mean(g);
    g.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (g.len() as f64 - c)
}
fn ref_max(g: &[f64]) -> f64 {
    g.iter().copied().fold(f64::NEG_INFINITY, |a, b| if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) })
}
fn ref_min(g: &[f64]) -> f64 {
    -ref_max(&g.iter().map(|x| -x).collect::<Vec<_>>())
}
/// First index of the maximum (a NaN counts as the maximum, as in PyTorch).
fn ref_argmax(g: &[f64]) -> f64 {
    if let Some(i) = g.iter().position(|x| x.is_nan()) {
        return i as f64;
    }
    let m = ref_max(g);
    g.iter().position(|&x| x == m).unwrap() as f64
}
fn ref_argmin(g: &[f64]) -> f64 {
    ref_argmax(&g.iter().map(|x| -x).collect::<Vec<_>>())
}
fn ref_lse(g: &[f64]) -> f64 {
    let m = ref_max(g);
    if m.is_infinite() {
        return if g.contains(&f64::INFINITY) { f64::INFINITY } else { f64::NEG_INFINITY };
    }
    m + g.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// A [3, 4, 5] tensor as a contiguous, a permuted and a step-sliced tensor, with its logical values.
fn make3(lay: Lay, dt: DType, seed: u64, f: impl Fn(f64) -> f64) -> (Tensor, Vec<f64>) {
    let (a, b, c) = (3, 4, 5);
    match lay {
        Lay::Contig => inputs(&[a, b, c], seed, dt, f),
        Lay::Transposed => {
            // base [4, 5, 3] permuted (2, 0, 1): x[i][j][k] = base[j][k][i]
            let (base, bv) = inputs(&[b, c, a], seed, dt, f);
            let x = base.permute(&[2, 0, 1]).unwrap();
            assert!(!x.is_contiguous());
            let v = (0..a * b * c).map(|f| (f / (b * c), (f / c) % b, f % c)).map(|(i, j, k)| bv[(j * c + k) * a + i]).collect();
            (x, v)
        }
        _ => {
            // base [3, 8, 5], every other row of dim 1 from 1: x[i][j][k] = base[i][2j+1][k]
            let (base, bv) = inputs(&[a, 2 * b, c], seed, dt, f);
            let x = base.slice(1, 1, (2 * b) as i64, 2).unwrap();
            assert!(!x.is_contiguous());
            let v = (0..a * b * c).map(|f| (f / (b * c), (f / c) % b, f % c)).map(|(i, j, k)| bv[(i * 2 * b + 2 * j + 1) * c + k]).collect();
            (x, v)
        }
    }
}

const DIM_SETS: [&[i64]; 10] = [&[0], &[1], &[2], &[-1], &[-2], &[0, 2], &[-1, 0], &[1, 2], &[0, 1, 2], &[]];
const LAYS3: [Lay; 3] = [Lay::Contig, Lay::Transposed, Lay::Strided];

#[test]
fn sum_mean_amax_amin_over_dims() {
    let shape = [3, 4, 5];
    for dt in FLOATS {
        for lay in LAYS3 {
            let (x, xv) = make3(lay, dt, 1, |r| r);
            for dims in DIM_SETS {
                let nd = norm(dims, 3);
                let g = groups(&xv, &shape, &nd);
                for keepdim in [false, true] {
                    let os = out_shape(&shape, &nd, keepdim);
                    let ctx = |s: &str| format!("{s} {dt:?} {lay:?} dims {dims:?} keepdim {keepdim}");
                    let (rt, at) = sum_tol(dt);
                    let want: Vec<f64> = g.iter().map(|g| ref_sum(g)).collect();
                    check(&ctx("sum"), &x.sum(dims, keepdim).unwrap(), &os, dt, &want, rt, at);
                    let want: Vec<f64> = g.iter().map(|g| ref_mean(g)).collect();
                    check(&ctx("mean"), &x.mean(dims, keepdim).unwrap(), &os, dt, &want, rt, at);
                    let want: Vec<f64> = g.iter().map(|g| ref_max(g)).collect();
                    check(&ctx("amax"), &x.amax(dims, keepdim).unwrap(), &os, dt, &want, 0.0, 0.0);
                    let want: Vec<f64> = g.iter().map(|g| ref_min(g)).collect();
                    check(&ctx("amin"), &x.amin(dims, keepdim).unwrap(), &os, dt, &want, 0.0, 0.0);
                }
            }
            let (rt, at) = sum_tol(dt);
            check(&format!("sum_all {dt:?} {lay:?}"), &x.sum_all().unwrap(), &[], dt, &[ref_sum(&xv)], rt, at);
            check(&format!("mean_all {dt:?} {lay:?}"), &x.mean_all().unwrap(), &[], dt, &[ref_mean(&xv)], rt, at);
            check(&format!("max_all {dt:?} {lay:?}"), &x.max_all().unwrap(), &[], dt, &[ref_max(&xv)], 0.0, 0.0);
            check(&format!("min_all {dt:?} {lay:?}"), &x.min_all().unwrap(), &[], dt, &[ref_min(&xv)], 0.0, 0.0);
        }
    }
}

#[test]
fn prod_over_dims() {
    let shape = [3, 4, 5];
    for dt in FLOATS {
        for lay in LAYS3 {
            // values around 1 so that products stay well inside every dtype's range
            let (x, xv) = make3(lay, dt, 2, |r| 1.0 + r / 4.0);
            for dim in [0i64, 1, 2, -1, -3] {
                let nd = norm(&[dim], 3);
                let g = groups(&xv, &shape, &nd);
                let want: Vec<f64> = g.iter().map(|g| g.iter().product()).collect();
                let (rt, at) = sum_tol(dt);
                for keepdim in [false, true] {
                    check(&format!("prod {dt:?} {lay:?} dim {dim} {keepdim}"), &x.prod(dim, keepdim).unwrap(), &out_shape(&shape, &nd, keepdim), dt, &want, rt, at);
                }
            }
            let (rt, at) = sum_tol(dt);
            check(&format!("prod_all {dt:?} {lay:?}"), &x.prod_all().unwrap(), &[], dt, &[xv.iter().product()], rt * 4.0, at);
        }
    }
    // a zero makes the product zero; integers give I64
    check("prod zero", &t(&[2.0, 0.0, 3.0, 4.0], &[2, 2], DType::F32).prod(1, false).unwrap(), &[2], DType::F32, &[0.0, 12.0], 0.0, 0.0);
    check("prod int", &t(&[2.0, -3.0, 5.0, 7.0], &[2, 2], DType::I32).prod(0, false).unwrap(), &[2], DType::I64, &[10.0, -21.0], 0.0, 0.0);
}

#[test]
fn max_min_argmax_with_ties_take_the_first_index() {
    let shape = [3, 4, 5];
    for dt in FLOATS.into_iter().chain([DType::I64, DType::I32]) {
        for lay in LAYS3 {
            // integers in [-2, 2]: many ties
            let (x, xv) = make3(lay, dt, 3, |r| r.round());
            for dim in [0i64, 1, 2, -1, -2] {
                let nd = norm(&[dim], 3);
                let g = groups(&xv, &shape, &nd);
                for keepdim in [false, true] {
                    let os = out_shape(&shape, &nd, keepdim);
                    let ctx = |s: &str| format!("{s} {dt:?} {lay:?} dim {dim} keepdim {keepdim}");
                    let (v, i) = x.max(dim, keepdim).unwrap();
                    check(&ctx("max values"), &v, &os, dt, &g.iter().map(|g| ref_max(g)).collect::<Vec<_>>(), 0.0, 0.0);
                    check(&ctx("max indices"), &i, &os, DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
                    let (v, i) = x.min(dim, keepdim).unwrap();
                    check(&ctx("min values"), &v, &os, dt, &g.iter().map(|g| ref_min(g)).collect::<Vec<_>>(), 0.0, 0.0);
                    check(&ctx("min indices"), &i, &os, DType::I64, &g.iter().map(|g| ref_argmin(g)).collect::<Vec<_>>(), 0.0, 0.0);
                    check(&ctx("argmax"), &x.argmax(dim, keepdim).unwrap(), &os, DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
                    check(&ctx("argmin"), &x.argmin(dim, keepdim).unwrap(), &os, DType::I64, &g.iter().map(|g| ref_argmin(g)).collect::<Vec<_>>(), 0.0, 0.0);
                }
            }
            check(&format!("argmax_all {dt:?} {lay:?}"), &x.argmax_all().unwrap(), &[], DType::I64, &[ref_argmax(&xv)], 0.0, 0.0);
            check(&format!("argmin_all {dt:?} {lay:?}"), &x.argmin_all().unwrap(), &[], DType::I64, &[ref_argmin(&xv)], 0.0, 0.0);
        }
    }
    // explicit ties
    let x = t(&[1.0, 3.0, 3.0, 0.0, 0.0, -1.0, 5.0, -1.0], &[2, 4], DType::F32);
    let (v, i) = x.max(1, false).unwrap();
    assert_eq!((vals(&v), i64s(&i)), (vec![3.0, 5.0], vec![1, 2]));
    let (v, i) = x.min(1, false).unwrap();
    assert_eq!((vals(&v), i64s(&i)), (vec![0.0, -1.0], vec![3, 1]));
    assert_eq!(i64s(&x.argmax_all().unwrap()), vec![6]);
    assert_eq!(i64s(&x.argmin_all().unwrap()), vec![5]);
}

#[test]
fn reductions_propagate_nan() {
    let nan = f64::NAN;
    for dt in FLOATS {
        let x = t(&[1.0, nan, 3.0, 4.0, -1.0, 2.0, 0.0, nan], &[2, 4], dt);
        let ctx = |s: &str| format!("{s} {dt:?}");
        close(&ctx("amax"), &vals(&x.amax(&[1], false).unwrap()), &[nan, nan], 0.0, 0.0);
        close(&ctx("amin"), &vals(&x.amin(&[1], false).unwrap()), &[nan, nan], 0.0, 0.0);
        close(&ctx("amax dim0"), &vals(&x.amax(&[0], false).unwrap()), &[1.0, nan, 3.0, nan], 0.0, 0.0);
        close(&ctx("sum"), &vals(&x.sum(&[0], false).unwrap()), &[0.0, nan, 3.0, nan], 0.0, 0.0);
        // the index of the (first) NaN
        assert_eq!(i64s(&x.argmax(1, false).unwrap()), vec![1, 3], "{}", ctx("argmax"));
        assert_eq!(i64s(&x.argmin(1, false).unwrap()), vec![1, 3], "{}", ctx("argmin"));
        let (v, i) = x.max(1, false).unwrap();
        close(&ctx("max values"), &vals(&v), &[nan, nan], 0.0, 0.0);
        assert_eq!(i64s(&i), vec![1, 3]);
        close(&ctx("max_all"), &vals(&x.max_all().unwrap()), &[nan], 0.0, 0.0);
    }
}

#[test]
fn var_std_with_corrections() {
    let shape = [3, 4, 5];
    for dt in FLOATS {
        for lay in LAYS3 {
            let (x, xv) = make3(lay, dt, 4, |r| r);
            for dims in [&[0i64][..], &[2], &[-1], &[0, 2], &[1, -1], &[]] {
                let nd = norm(dims, 3);
                let g = groups(&xv, &shape, &nd);
                for c in [0.0, 1.0, 2.0] {
                    for keepdim in [false, true] {
                        let os = out_shape(&shape, &nd, keepdim);
                        let ctx = |s: &str| format!("{s} {dt:?} {lay:?} dims {dims:?} correction {c} keepdim {keepdim}");
                        let (rt, at) = sum_tol(dt);
                        let want: Vec<f64> = g.iter().map(|g| ref_var(g, c)).collect();
                        check(&ctx("var"), &x.var(dims, c, keepdim).unwrap(), &os, dt, &want, rt, at);
                        let want: Vec<f64> = g.iter().map(|g| ref_var(g, c).sqrt()).collect();
                        check(&ctx("std"), &x.std(dims, c, keepdim).unwrap(), &os, dt, &want, rt, at);
                    }
                }
            }
        }
    }
    // n - correction <= 0: inf (or nan), as in PyTorch
    let x = t(&[1.0, 2.0], &[2], DType::F64);
    assert_eq!(vals(&x.var(&[], 2.0, false).unwrap()), vec![f64::INFINITY]);
    // a constant input has zero variance
    assert_eq!(vals(&t(&[3.0; 6], &[6], DType::F32).var(&[0], 1.0, false).unwrap()), vec![0.0]);
}

#[test]
fn logsumexp_values() {
    let shape = [3, 4, 5];
    for dt in FLOATS {
        for lay in LAYS3 {
            let (x, xv) = make3(lay, dt, 5, |r| r * 3.0);
            for dims in [&[0i64][..], &[1], &[-1], &[0, 2], &[]] {
                let nd = norm(dims, 3);
                let g = groups(&xv, &shape, &nd);
                let want: Vec<f64> = g.iter().map(|g| ref_lse(g)).collect();
                let (rt, at) = tol(dt, true);
                for keepdim in [false, true] {
                    let got = x.logsumexp(dims, keepdim).unwrap();
                    let ctx = format!("logsumexp {dt:?} {lay:?} {dims:?} {keepdim}");
                    if dt.is_float() && matches!(dt, DType::F16 | DType::BF16) {
                        // Like PyTorch, half inputs compute max, exp, sum, log and the final add in
                        // the half type: the error scales with the parts |max| and |log(sum)|, not
                        // with the (possibly much smaller) result; log of the rounded sum (>= 1)
                        // adds one rounding in absolute terms.
                        assert_eq!((got.shape(), got.dtype()), (out_shape(&shape, &nd, keepdim).as_slice(), dt), "{ctx}");
                        for (i, (gv, (w, grp))) in vals(&got).iter().zip(want.iter().zip(&g)).enumerate() {
                            let m = ref_max(grp);
                            let bound = 3.0 * rt * (m.abs() + (w - m).abs() + 1.0) + at;
                            assert!((gv - w).abs() <= bound, "{ctx}: element {i}: got {gv}, expected {w} (bound {bound})");
                        }
                    } else {
                        check(&ctx, &got, &out_shape(&shape, &nd, keepdim), dt, &want, rt, at);
                    }
                }
            }
        }
    }
    let inf = f64::INFINITY;
    for dt in [DType::F32, DType::F64] {
        // large values (no overflow), -inf entries, an all -inf row, a +inf entry
        let v = [1000.0, 1000.5, 999.0, -inf, -inf, 0.0, 1.0, -inf, -inf, -inf, -inf, -inf, 3.0, inf, 2.0, -inf, -88.0, -89.0, -90.0, -inf];
        let x = t(&v, &[5, 4], dt);
        let want: Vec<f64> = v.chunks(4).map(ref_lse).collect();
        check(&format!("logsumexp specials {dt:?}"), &x.logsumexp(&[1], false).unwrap(), &[5], dt, &want, tol(dt, true).0, 0.0);
        // integer input computes in the default float
        check("logsumexp I64", &t(&[0.0, 0.0], &[2], DType::I64).logsumexp(&[0], false).unwrap(), &[], DType::F32, &[2f64.ln()], F32_TRANS_RTOL, 0.0);
    }
}

#[test]
fn integer_reductions() {
    let (x, xv) = make3(Lay::Transposed, DType::I32, 6, |r| (r * 50.0).round());
    let shape = [3, 4, 5];
    for dims in DIM_SETS {
        let nd = norm(dims, 3);
        let g = groups(&xv, &shape, &nd);
        check(&format!("I32 sum {dims:?}"), &x.sum(dims, false).unwrap(), &out_shape(&shape, &nd, false), DType::I64, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), 0.0, 0.0);
        check(&format!("I32 amax {dims:?}"), &x.amax(dims, true).unwrap(), &out_shape(&shape, &nd, true), DType::I32, &g.iter().map(|g| ref_max(g)).collect::<Vec<_>>(), 0.0, 0.0);
    }
    let u = tu8(&[255, 255, 255, 1], &[2, 2]);
    check("U8 sum", &u.sum(&[0], false).unwrap(), &[2], DType::I64, &[510.0, 256.0], 0.0, 0.0);
    check("U8 amin", &u.amin(&[1], false).unwrap(), &[2], DType::U8, &[255.0, 1.0], 0.0, 0.0);
    check("Bool sum dim", &t(&[1.0, 1.0, 0.0, 1.0], &[2, 2], DType::Bool).sum(&[0], true).unwrap(), &[1, 2], DType::I64, &[1.0, 2.0], 0.0, 0.0);
}

#[test]
fn reductions_of_expanded_input() {
    // a stride-0 (expanded) dim is read as repeated values
    for dt in [DType::F32, DType::F64, DType::I64] {
        let (x, xv) = make2(3, 4, Lay::Expanded, dt, 9, |r| (r * 10.0).round());
        let out = if dt.is_float() { dt } else { DType::I64 };
        for dim in [0i64, 1] {
            let g = groups(&xv, &[3, 4], &[dim as usize]);
            check(&format!("sum expanded {dt:?} dim {dim}"), &x.sum(&[dim], false).unwrap(), &[if dim == 0 { 4 } else { 3 }], out, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), 0.0, 0.0);
            check(&format!("argmax expanded {dt:?} dim {dim}"), &x.argmax(dim, false).unwrap(), &[if dim == 0 { 4 } else { 3 }], DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
        }
    }
}

#[test]
fn logsumexp_over_an_empty_dim_is_neg_inf() {
    // torch.logsumexp(torch.empty(0, 3), 0) -> [-inf, -inf, -inf]
    let e = t(&[], &[0, 3], DType::F32);
    check("logsumexp empty dim", &e.logsumexp(&[0], false).unwrap(), &[3], DType::F32, &[f64::NEG_INFINITY; 3], 0.0, 0.0);
    check("logsumexp non-empty dim of empty", &e.logsumexp(&[1], true).unwrap(), &[0, 1], DType::F32, &[], 0.0, 0.0);
}

#[test]
fn reductions_of_empty_and_zero_dim() {
    // sums over empty dims are 0, products 1; max over an empty dim is an error
    let e = t(&[], &[0, 3], DType::F32);
    check("sum empty", &e.sum(&[0], false).unwrap(), &[3], DType::F32, &[0.0; 3], 0.0, 0.0);
    check("prod empty", &e.prod(0, false).unwrap(), &[3], DType::F32, &[1.0; 3], 0.0, 0.0);
    check("sum over non-empty of empty", &e.sum(&[1], false).unwrap(), &[0], DType::F32, &[], 0.0, 0.0);
    assert!(e.amax(&[0], false).is_err());
    assert!(e.argmax(0, false).is_err());
    assert!(e.amax(&[1], false).is_ok());
    let s = t0(2.5, DType::F32);
    check("0-dim sum", &s.sum_all().unwrap(), &[], DType::F32, &[2.5], 0.0, 0.0);
    check("0-dim amax", &s.amax(&[], false).unwrap(), &[], DType::F32, &[2.5], 0.0, 0.0);
    let (v, i) = s.max(0, false).unwrap();
    assert_eq!((vals(&v), i64s(&i)), (vec![2.5], vec![0]));
    // bad dims
    let x = t(&[1.0; 6], &[2, 3], DType::F32);
    assert!(x.sum(&[2], false).is_err());
    assert!(x.sum(&[-3], false).is_err());
    assert!(x.sum(&[0, 0], false).is_err());
    assert!(x.sum(&[1, -1], false).is_err());
}

// ---- large inputs: the parallel paths ----

/// Positive values, so that relative tolerances on sums are meaningful.
fn pos(r: f64) -> f64 {
    r + 2.5
}

#[test]
fn large_sum_all_and_mean() {
    for dt in [DType::F32, DType::F64] {
        let (x, xv) = inputs(&[300_000], 71, dt, pos);
        let (rt, at) = sum_tol(dt);
        check(&format!("sum_all 300k {dt:?}"), &x.sum_all().unwrap(), &[], dt, &[ref_sum(&xv)], rt, at);
        check(&format!("mean_all 300k {dt:?}"), &x.mean_all().unwrap(), &[], dt, &[ref_mean(&xv)], rt, at);
        check(&format!("amax 300k {dt:?}"), &x.max_all().unwrap(), &[], dt, &[ref_max(&xv)], 0.0, 0.0);
        check(&format!("argmin 300k {dt:?}"), &x.argmin_all().unwrap(), &[], DType::I64, &[ref_argmin(&xv)], 0.0, 0.0);
        check(&format!("var 300k {dt:?}"), &x.var(&[], 1.0, false).unwrap(), &[], dt, &[ref_var(&xv, 1.0)], rt, at);
        check(&format!("logsumexp 300k {dt:?}"), &x.logsumexp(&[0], false).unwrap(), &[], dt, &[ref_lse(&xv)], tol(dt, true).0, 0.0);
        // as a 3-D tensor, all dims
        let x3 = x.reshape(&[60, 50, 100]).unwrap();
        check(&format!("sum_all [60,50,100] {dt:?}"), &x3.sum_all().unwrap(), &[], dt, &[ref_sum(&xv)], rt, at);
    }
    // F16 / BF16 accumulate in a wider type: 300k values of ~2.5 sum far beyond F16's precision
    for dt in [DType::F16, DType::BF16] {
        let (x, xv) = inputs(&[300_000], 72, dt, |r| r / 100.0);
        let (rt, at) = tol(dt, false);
        check(&format!("sum_all 300k {dt:?}"), &x.sum_all().unwrap(), &[], dt, &[ref_sum(&xv)], rt, at.max(0.05));
        check(&format!("mean_all 300k {dt:?}"), &x.mean_all().unwrap(), &[], dt, &[ref_mean(&xv)], rt, at);
    }
}

#[test]
fn large_sum_over_dims_of_matrix() {
    let (r, c) = (600, 700);
    for dt in [DType::F32, DType::F64] {
        let (rt, at) = sum_tol(dt);
        let (x, xv) = inputs(&[r, c], 73, dt, pos);
        // and the same values seen through a transpose of a [700, 600] tensor
        let base_v: Vec<f64> = (0..c * r).map(|f| xv[(f % r) * c + f / r]).collect();
        let xt = t(&base_v, &[c, r], dt).t().unwrap();
        assert!(!xt.is_contiguous());
        for (name, x) in [("contiguous", &x), ("transposed", &xt)] {
            for dim in [0i64, 1, -1] {
                let nd = norm(&[dim], 2);
                let g = groups(&xv, &[r, c], &nd);
                let os = out_shape(&[r, c], &nd, false);
                let ctx = |s: &str| format!("{s} [600,700] {name} {dt:?} dim {dim}");
                check(&ctx("sum"), &x.sum(&[dim], false).unwrap(), &os, dt, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at);
                check(&ctx("mean"), &x.mean(&[dim], false).unwrap(), &os, dt, &g.iter().map(|g| ref_mean(g)).collect::<Vec<_>>(), rt, at);
                check(&ctx("amax"), &x.amax(&[dim], false).unwrap(), &os, dt, &g.iter().map(|g| ref_max(g)).collect::<Vec<_>>(), 0.0, 0.0);
                check(&ctx("argmax"), &x.argmax(dim, false).unwrap(), &os, DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
                check(&ctx("var"), &x.var(&[dim], 1.0, false).unwrap(), &os, dt, &g.iter().map(|g| ref_var(g, 1.0)).collect::<Vec<_>>(), rt, at);
            }
        }
    }
}

#[test]
fn large_sum_over_dims_of_3d() {
    let shape = [60, 50, 100];
    for dt in [DType::F32, DType::F64] {
        let (rt, at) = sum_tol(dt);
        let (x, xv) = inputs(&shape, 74, dt, pos);
        for dims in [&[0i64, 2][..], &[0, 1], &[1, 2], &[1], &[-1], &[0]] {
            let nd = norm(dims, 3);
            let g = groups(&xv, &shape, &nd);
            for keepdim in [false, true] {
                let os = out_shape(&shape, &nd, keepdim);
                let ctx = |s: &str| format!("{s} {shape:?} {dt:?} dims {dims:?} keepdim {keepdim}");
                check(&ctx("sum"), &x.sum(dims, keepdim).unwrap(), &os, dt, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at);
                check(&ctx("amin"), &x.amin(dims, keepdim).unwrap(), &os, dt, &g.iter().map(|g| ref_min(g)).collect::<Vec<_>>(), 0.0, 0.0);
            }
        }
    }
}

/// Reductions read in place, without a copy: kept dims in the middle (batch norm's statistics
/// over N, H and W, split into chunks) and reduced dims in the middle (a pooling window's argmax,
/// in batches of columns, vectorised when the inner size allows).
#[test]
fn reductions_over_middle_dims_read_in_place() {
    for (shape, dims) in [(&[6usize, 16, 24, 40][..], &[0i64, 2, 3][..]), (&[6, 16, 24, 40], &[1]), (&[7, 9, 5, 3], &[1, 2]), (&[7, 9, 5, 3], &[0, 3]), (&[300, 9, 64], &[1])] {
        for dt in [DType::F32, DType::BF16] {
            let (rt, at) = sum_tol(dt);
            let (x, xv) = inputs(shape, 76, dt, pos);
            let nd = norm(dims, shape.len());
            let g = groups(&xv, shape, &nd);
            let os = out_shape(shape, &nd, false);
            let ctx = |s: &str| format!("{s} {shape:?} {dt:?} dims {dims:?}");
            check(&ctx("sum"), &x.sum(dims, false).unwrap(), &os, dt, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at);
            check(&ctx("amax"), &x.amax(dims, false).unwrap(), &os, dt, &g.iter().map(|g| ref_max(g)).collect::<Vec<_>>(), 0.0, 0.0);
            if let [d] = dims {
                check(&ctx("argmax"), &x.argmax(*d, false).unwrap(), &os, DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
            }
        }
    }
}

#[test]
fn large_few_long_rows_split_across_threads() {
    // Two rows of 150k: each row is split into parts reduced in parallel and combined in order.
    let n = 150_000;
    for dt in [DType::F32, DType::F64] {
        let (rt, at) = sum_tol(dt);
        let mut v: Vec<f64> = host_rand(2 * n, 75).into_iter().map(|r| round_to(dt, pos(r))).collect();
        // ties for the maximum / minimum in different parts of each row: the first must win
        for &(i, val) in &[(5_000, 10.0), (140_000, 10.0), (n + 100_000, 10.0), (n + 120_000, 10.0), (n + 149_999, 10.0), (7, -1.0), (90_000, -1.0), (n + 60_000, -1.0), (n + 5, -1.0)] {
            v[i] = val;
        }
        let x = t(&v, &[2, n], dt);
        let g = groups(&v, &[2, n], &[1]);
        let ctx = |s: &str| format!("{s} [2,150000] {dt:?}");
        check(&ctx("sum"), &x.sum(&[1], false).unwrap(), &[2], dt, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at);
        check(&ctx("amax"), &x.amax(&[1], false).unwrap(), &[2], dt, &[10.0, 10.0], 0.0, 0.0);
        assert_eq!(i64s(&x.argmax(1, false).unwrap()), vec![5_000, 100_000], "{}", ctx("argmax"));
        assert_eq!(i64s(&x.argmin(1, false).unwrap()), vec![7, 5], "{}", ctx("argmin"));
        let (vmax, imax) = x.max(-1, true).unwrap();
        assert_eq!((vals(&vmax), i64s(&imax)), (vec![10.0, 10.0], vec![5_000, 100_000]));
        assert_eq!(i64s(&x.argmax_all().unwrap()), vec![5_000]);
        // a NaN late in a row wins
        let mut w = v.clone();
        w[n + 130_000] = f64::NAN;
        let xn = t(&w, &[2, n], dt);
        assert_eq!(i64s(&xn.argmax(1, false).unwrap()), vec![5_000, 130_000], "{}", ctx("argmax NaN"));
        assert!(vals(&xn.amax(&[1], false).unwrap())[1].is_nan());
        // the same values as columns of a [150000, 2] tensor, reducing the leading dim
        let xt = t(&(0..2 * n).map(|f| v[(f % 2) * n + f / 2]).collect::<Vec<_>>(), &[n, 2], dt);
        assert_eq!(i64s(&xt.argmax(0, false).unwrap()), vec![5_000, 100_000], "{}", ctx("argmax dim 0 of [150000, 2]"));
        check(&ctx("sum dim 0 of [150000, 2]"), &xt.sum(&[0], false).unwrap(), &[2], dt, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at);
    }
}

#[test]
fn column_reductions_across_vector_widths_splits_and_alignment() {
    // Leading-dim reductions of contiguous inputs read several adjacent columns per load:
    // widths that are and are not a multiple of the vector, tall inputs split into chunks,
    // ties between the threads of a column (the first index wins), and NaN columns. On a GPU,
    // the last two have a column block for every SM, so they reduce unsplit in tall blocks (two
    // columns per load in the first, one in the second, with a partial last block).
    for &(r, c) in &[(5, 8), (300, 130), (257, 132), (4096, 64), (2000, 1), (257, 8256), (260, 4001)] {
        for dt in [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::U8, DType::Bool] {
            let f = |v: f64| match dt {
                DType::Bool => (v > 0.0) as u8 as f64,
                d if d.is_float() => v,
                _ => (v * 20.0).round().abs(),
            };
            let mut xv: Vec<f64> = host_rand(r * c, (r * c) as u64).into_iter().map(|v| round_to(dt, f(v))).collect();
            if dt.is_float() {
                xv[(r / 2) * c] = f64::NAN;
            }
            let x = t(&xv, &[r, c], dt);
            let g = groups(&xv, &[r, c], &[0]);
            let ctx = |s: &str| format!("{s} [{r}, {c}] {dt:?} dim 0");
            let sum_dt = if dt.is_float() { dt } else { DType::I64 };
            let (rt, at) = sum_tol(dt);
            check(&ctx("sum"), &x.sum(&[0], false).unwrap(), &[c], sum_dt, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at * r as f64);
            check(&ctx("amax"), &x.amax(&[0], false).unwrap(), &[c], dt, &g.iter().map(|g| ref_max(g)).collect::<Vec<_>>(), 0.0, 0.0);
            if dt == DType::Bool {
                continue;
            }
            check(&ctx("amin"), &x.amin(&[0], false).unwrap(), &[c], dt, &g.iter().map(|g| ref_min(g)).collect::<Vec<_>>(), 0.0, 0.0);
            check(&ctx("argmax"), &x.argmax(0, false).unwrap(), &[c], DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
            check(&ctx("argmin"), &x.argmin(0, false).unwrap(), &[c], DType::I64, &g.iter().map(|g| ref_argmin(g)).collect::<Vec<_>>(), 0.0, 0.0);
        }
    }
    // A contiguous view one element into its buffer: rows are not aligned to a vector.
    let (r, c) = (64, 128);
    let (flat, fv) = inputs(&[1 + r * c], 90, DType::F32, |v| v);
    let x = flat.narrow(0, 1, r * c).unwrap().reshape(&[r as i64, c as i64]).unwrap();
    assert!(x.is_contiguous());
    let g = groups(&fv[1..], &[r, c], &[0]);
    let (rt, at) = sum_tol(DType::F32);
    check("sum of an unaligned view", &x.sum(&[0], false).unwrap(), &[c], DType::F32, &g.iter().map(|g| ref_sum(g)).collect::<Vec<_>>(), rt, at * r as f64);
    check("amax of an unaligned view", &x.amax(&[0], false).unwrap(), &[c], DType::F32, &g.iter().map(|g| ref_max(g)).collect::<Vec<_>>(), 0.0, 0.0);
}

/// Arg reductions over a few long rows (greedy sampling's row of 50,257 logits) give the first
/// index of the extreme value, as PyTorch does, in every dtype a sampler meets.
#[test]
fn arg_reductions_over_a_few_long_rows_pick_the_first_extreme() -> Result<()> {
    let d = dev();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (rows, cols) in [(1usize, 50257usize), (3, 70001)] {
            // Small integers (exact in every dtype), with the extremes placed more than once.
            let mut v: Vec<f64> = (0..rows * cols).map(|i| ((i * 7919) % 201) as f64 - 100.0).collect();
            for r in 0..rows {
                for (c, x) in [(cols / 3 + r, 150.0), (cols - 2 - r, 150.0), (cols / 2, -150.0), (cols - 1, -150.0)] {
                    v[r * cols + c] = x;
                }
            }
            let x = Tensor::from_vec(v.clone(), &[rows, cols], &d)?.to_dtype(dtype)?;
            let (hi, lo) = (x.argmax(1, false)?.to_vec::<i64>()?, x.argmin(1, false)?.to_vec::<i64>()?);
            for r in 0..rows {
                let row = &v[r * cols..(r + 1) * cols];
                assert_eq!(hi[r] as f64, ref_argmax(row), "argmax {dtype:?} {rows}x{cols} row {r}");
                assert_eq!(lo[r] as f64, ref_argmin(row), "argmin {dtype:?} {rows}x{cols} row {r}");
            }
        }
    }
    Ok(())
}

/// Arg reductions of a few long rows (a vocabulary's logits), which CUDA reads 16 bytes at a
/// time: rows of a multiple of the vector and not, one row of 50257, ties across vectors and
/// in the tail, a NaN, and a row starting past an aligned address.
#[test]
fn arg_reductions_of_long_rows() {
    for dt in FLOATS {
        for (rows, cols) in [(1, 50257), (3, 8192), (2, 4099)] {
            // integers in [-50, 50]: ties between vectors
            let mut xv: Vec<f64> = host_rand(rows * cols, 11).iter().map(|r| (r * 25.0).round()).collect();
            // the maximum again in the row's last element (a tie in the tail) and a larger one
            // at its end in the last row
            for r in 0..rows {
                xv[r * cols + cols - 1] = 50.0;
            }
            xv[rows * cols - 2] = 60.0;
            let x = t(&xv, &[rows, cols], dt);
            let g: Vec<Vec<f64>> = vals(&x).chunks(cols).map(|c| c.to_vec()).collect();
            let ctx = format!("{dt:?} [{rows}, {cols}]");
            check(&format!("argmax {ctx}"), &x.argmax(1, false).unwrap(), &[rows], DType::I64, &g.iter().map(|g| ref_argmax(g)).collect::<Vec<_>>(), 0.0, 0.0);
            check(&format!("argmin {ctx}"), &x.argmin(1, false).unwrap(), &[rows], DType::I64, &g.iter().map(|g| ref_argmin(g)).collect::<Vec<_>>(), 0.0, 0.0);
            // one element in: the row no longer starts on a vector
            let s = x.reshape(&[(rows * cols) as i64]).unwrap().slice(0, 1, (rows * cols) as i64, 1).unwrap();
            let sv = &vals(&x)[1..];
            check(&format!("argmax offset {ctx}"), &s.argmax(0, false).unwrap(), &[], DType::I64, &[ref_argmax(sv)], 0.0, 0.0);
            // a NaN counts as the maximum
            let mut nv = vals(&x);
            nv[cols / 2] = f64::NAN;
            let n = t(&nv, &[rows, cols], dt);
            check(&format!("argmax NaN {ctx}"), &n.argmax(1, false).unwrap(), &[rows], DType::I64, &nv.chunks(cols).map(ref_argmax).collect::<Vec<_>>(), 0.0, 0.0);
        }
    }
}

/// Reductions large enough to be split into parts: over the leading dims with few kept columns
/// (batch norm's statistics over an NHWC tensor) and over dims on both sides of a kept run (over
/// NCHW), sums, maxima and an arg reduction down a long column, against the host's. Tolerance:
/// F32 inputs summed in F64 in another order.
#[test]
fn reductions_split_into_parts_match_the_host() {
    for (shape, dims) in [(vec![16usize, 16, 16, 24], vec![0usize, 1, 2]), (vec![8, 24, 32, 16], vec![0, 2, 3]), (vec![4, 3, 8, 40, 9], vec![0, 1, 4])] {
        let n: usize = shape.iter().product();
        let v = host_rand(n, shape[1] as u64);
        let x = t(&v, &shape, DType::F32);
        let idims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let g = groups(&v.iter().map(|&a| a as f32 as f64).collect::<Vec<_>>(), &shape, &dims);
        let sums: Vec<f64> = g.iter().map(|g| ref_sum(g)).collect();
        assert_close_named(&format!("sum {shape:?} over {dims:?}"), &vals(&x.sum(&idims, false).unwrap()), &sums, 1e-5, 1e-4);
        let maxes: Vec<f64> = g.iter().map(|g| ref_max(g)).collect();
        assert_close_named(&format!("amax {shape:?} over {dims:?}"), &vals(&x.amax(&idims, false).unwrap()), &maxes, 0.0, 0.0);
    }
    // Down a long column of few columns: the first maximum of each.
    let v = host_rand(8192 * 5, 3);
    let x = t(&v, &[8192, 5], DType::F32);
    let g = groups(&v.iter().map(|&a| a as f32 as f64).collect::<Vec<_>>(), &[8192, 5], &[0]);
    let want: Vec<f64> = g.iter().map(|g| ref_argmax(g)).collect();
    assert_eq!(vals(&x.argmax(0, false).unwrap()), want);
}
