//! Composite ops (`nn::functional`) against f64 references: softmax, log_softmax, layer_norm,
//! linear, dropout, cross_entropy, mse_loss.

use crate::common::*;
use crate::ops::*;
use kiln::nn::functional::{self as F, CrossEntropyOptions, Reduction};
use kiln::prelude::*;

/// Applies `f` to every 1-D line along `dim` of a row-major `shape`, writing a same-shape result.
fn along(v: &[f64], shape: &[usize], dim: usize, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let n = shape[dim];
    let mut out = vec![0.0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let line: Vec<f64> = (0..n).map(|k| v[(o * n + k) * inner + i]).collect();
            for (k, r) in f(&line).into_iter().enumerate() {
                out[(o * n + k) * inner + i] = r;
            }
        }
    }
    out
}

fn ref_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}
fn ref_log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

#[test]
fn softmax_and_log_softmax() {
    let shape = [3, 4, 5];
    for dt in [DType::F32, DType::F64] {
        let (rt, at) = tol(dt, true);
        for (lay, (x, xv)) in [("contig", inputs(&shape, 1, dt, |r| r * 3.0)), ("permuted", {
            let (b, bv) = inputs(&[5, 3, 4], 1, dt, |r| r * 3.0);
            let x = b.permute(&[1, 2, 0]).unwrap(); // x[i][j][k] = b[k][i][j]
            let v = (0..60).map(|f| (f / 20, (f / 5) % 4, f % 5)).map(|(i, j, k)| bv[(k * 3 + i) * 4 + j]).collect();
            (x, v)
        })] {
            for dim in [0i64, 1, 2, -1] {
                let d = if dim < 0 { (dim + 3) as usize } else { dim as usize };
                let ctx = |s: &str| format!("{s} {dt:?} {lay} dim {dim}");
                let y = x.softmax(dim).unwrap();
                check(&ctx("softmax"), &y, &shape, dt, &along(&xv, &shape, d, ref_softmax), rt, at);
                // lines sum to 1
                let ones = vals(&y.sum(&[dim], false).unwrap());
                close(&ctx("softmax sums"), &ones, &vec![1.0; ones.len()], rt, at);
                check(&ctx("log_softmax"), &F::log_softmax(&x, dim).unwrap(), &shape, dt, &along(&xv, &shape, d, ref_log_softmax), rt, at);
                check(&ctx("F::softmax"), &F::softmax(&x, dim).unwrap(), &shape, dt, &along(&xv, &shape, d, ref_softmax), rt, at);
            }
        }
        // large logits and -inf entries are stable
        let v = [1000.0, 1001.0, 999.0, f64::NEG_INFINITY, -1000.0, -1001.0, 0.0, f64::NEG_INFINITY];
        let x = t(&v, &[2, 4], dt);
        let want: Vec<f64> = v.chunks(4).flat_map(ref_softmax).collect();
        check(&format!("softmax large {dt:?}"), &x.softmax(1).unwrap(), &[2, 4], dt, &want, rt, at);
        let want: Vec<f64> = v.chunks(4).flat_map(ref_log_softmax).collect();
        check(&format!("log_softmax large {dt:?}"), &x.log_softmax(1).unwrap(), &[2, 4], dt, &want, rt, at);
    }
    // half inputs give half outputs, close to the F32 result
    for dt in [DType::F16, DType::BF16] {
        let (x, xv) = inputs(&[4, 6], 2, dt, |r| r * 2.0);
        let x32 = x.to_dtype(DType::F32).unwrap();
        let (rt, at) = tol(dt, true);
        let y = x.softmax(-1).unwrap();
        assert_eq!(y.dtype(), dt);
        close(&format!("softmax {dt:?} vs F32"), &vals(&y), &vals(&x32.softmax(-1).unwrap()), rt, at);
        check(&format!("softmax {dt:?}"), &y, &[4, 6], dt, &along(&xv, &[4, 6], 1, ref_softmax), rt, at);
        let ly = x.log_softmax(0).unwrap();
        assert_eq!(ly.dtype(), dt);
        close(&format!("log_softmax {dt:?} vs F32"), &vals(&ly), &vals(&x32.log_softmax(0).unwrap()), rt, at);
    }
    assert!(t(&[1.0, 2.0], &[2], DType::I64).softmax(0).is_err());
}

#[test]
fn softmax_of_empty_inputs() {
    // PyTorch returns an empty result, whether or not the softmax dim itself is empty.
    for (shape, dim) in [(&[0usize, 3][..], 0i64), (&[2, 0], 1), (&[0, 3], 1), (&[2, 0, 4], -1)] {
        let e = t(&[], shape, DType::F32);
        check(&format!("softmax {shape:?} dim {dim}"), &e.softmax(dim).unwrap(), shape, DType::F32, &[], 0.0, 0.0);
        check(&format!("log_softmax {shape:?} dim {dim}"), &e.log_softmax(dim).unwrap(), shape, DType::F32, &[], 0.0, 0.0);
    }
}

#[test]
fn layer_norm_values() {
    let shape = [2, 3, 4];
    for dt in FLOATS {
        let (x, xv) = inputs(&shape, 1, dt, |r| r * 2.0 + 0.5);
        let (w, wv) = inputs(&[3, 4], 2, dt, |r| r);
        let (b, bv) = inputs(&[3, 4], 3, dt, |r| r);
        let (rt, at) = tol(dt, true);
        for eps in [1e-5, 0.1] {
            for (ns, k) in [(&[4usize][..], 4usize), (&[3, 4], 12)] {
                let norm: Vec<f64> = xv.chunks(k).flat_map(|g| {
                    let m = g.iter().sum::<f64>() / k as f64;
                    let var = g.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / k as f64;
                    g.iter().map(move |v| (v - m) / (var + eps).sqrt()).collect::<Vec<_>>()
                }).collect();
                let ctx = |s: &str| format!("layer_norm {s} {dt:?} {ns:?} eps {eps}");
                check(&ctx("plain"), &F::layer_norm(&x, ns, None, None, eps).unwrap(), &shape, dt, &norm, rt, at * 10.0);
                if k == 12 {
                    let want: Vec<f64> = norm.iter().enumerate().map(|(i, v)| v * wv[i % 12] + bv[i % 12]).collect();
                    check(&ctx("affine"), &F::layer_norm(&x, ns, Some(&w), Some(&b), eps).unwrap(), &shape, dt, &want, rt, at * 10.0);
                    let want: Vec<f64> = norm.iter().enumerate().map(|(i, v)| v * wv[i % 12]).collect();
                    check(&ctx("weight only"), &F::layer_norm(&x, ns, Some(&w), None, eps).unwrap(), &shape, dt, &want, rt, at * 10.0);
                } else {
                    let (w4, b4) = (w.narrow(0, 0, 1).unwrap().reshape(&[4]).unwrap(), b.narrow(0, 1, 1).unwrap().reshape(&[4]).unwrap());
                    let want: Vec<f64> = norm.iter().enumerate().map(|(i, v)| v * wv[i % 4] + bv[4 + i % 4]).collect();
                    check(&ctx("affine"), &F::layer_norm(&x, ns, Some(&w4), Some(&b4), eps).unwrap(), &shape, dt, &want, rt, at * 10.0);
                }
            }
        }
    }
    let x = t(&[1.0; 6], &[2, 3], DType::F32);
    assert!(F::layer_norm(&x, &[2], None, None, 1e-5).is_err());
    assert!(F::layer_norm(&x, &[3], Some(&t(&[1.0; 2], &[2], DType::F32)), None, 1e-5).is_err());
    // a constant row normalises to 0 (not NaN)
    assert_eq!(vals(&F::layer_norm(&x, &[3], None, None, 1e-5).unwrap()), vec![0.0; 6]);
}

#[test]
fn linear_values() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (w, wv) = inputs(&[4, 3], 1, dt, |r| r);
        let (b, bv) = inputs(&[4], 2, dt, |r| r);
        for xs in [&[5usize, 3][..], &[2, 5, 3], &[3]] {
            let (x, xv) = inputs(xs, 3, dt, |r| r);
            let rows = xv.len() / 3;
            let mut out_shape = xs[..xs.len() - 1].to_vec();
            out_shape.push(4);
            let mm: Vec<f64> = (0..rows * 4).map(|f| (0..3).map(|k| xv[(f / 4) * 3 + k] * wv[(f % 4) * 3 + k]).sum()).collect();
            let (rt, at) = sum_tol(dt);
            let ctx = format!("linear {dt:?} {xs:?}");
            check(&ctx, &F::linear(&x, &w, None).unwrap(), &out_shape, dt, &mm, rt, at * 10.0);
            let want: Vec<f64> = mm.iter().enumerate().map(|(i, v)| v + bv[i % 4]).collect();
            check(&format!("{ctx} + bias"), &F::linear(&x, &w, Some(&b)).unwrap(), &out_shape, dt, &want, rt, at * 10.0);
        }
    }
    assert!(F::linear(&t(&[1.0; 3], &[3], DType::F32), &t(&[1.0; 3], &[3], DType::F32), None).is_err());
}

#[test]
fn dropout_training_and_eval() {
    let n = 4000;
    let (x, xv) = inputs(&[40, 100], 1, DType::F32, |r| r + 3.0); // no zeros in the input
    let y = F::dropout(&x, 0.5, true).unwrap();
    assert_eq!((y.shape(), y.dtype()), (&[40usize, 100][..], DType::F32));
    let yv = vals(&y);
    let mut zeros = 0;
    for (i, (&a, &b)) in xv.iter().zip(&yv).enumerate() {
        if b == 0.0 {
            zeros += 1;
        } else {
            assert!((b - 2.0 * a).abs() <= 1e-6 * a.abs(), "element {i}: {b} is neither 0 nor 2 * {a}");
        }
    }
    let frac = zeros as f64 / n as f64;
    assert!((0.44..=0.56).contains(&frac), "dropout(0.5) zeroed {frac} of the elements");
    // p = 0.2 scales by 1/0.8
    let y = vals(&F::dropout(&x, 0.2, true).unwrap());
    let kept: Vec<usize> = (0..n).filter(|&i| y[i] != 0.0).collect();
    assert!((0.75..=0.85).contains(&(kept.len() as f64 / n as f64)));
    for &i in &kept {
        assert!((y[i] - xv[i] / 0.8).abs() <= 1e-6 * y[i].abs());
    }
    // the same seed gives the same mask. Other tests draw from the global generator concurrently,
    // so a draw can land between seeding and dropout: retry a few times before failing.
    let same = (0..20).any(|k| {
        kiln::manual_seed(1234 + k);
        let a = vals(&F::dropout(&x, 0.5, true).unwrap());
        kiln::manual_seed(1234 + k);
        let b = vals(&F::dropout(&x, 0.5, true).unwrap());
        a == b
    });
    assert!(same, "manual_seed did not reproduce the dropout mask");
    // different seeds give different masks
    kiln::manual_seed(1);
    let a = vals(&F::dropout(&x, 0.5, true).unwrap());
    kiln::manual_seed(2);
    let b = vals(&F::dropout(&x, 0.5, true).unwrap());
    assert_ne!(a, b);
    // eval mode and p = 0 are the identity; p = 1 zeroes everything
    assert_eq!(vals(&F::dropout(&x, 0.5, false).unwrap()), xv);
    assert_eq!(vals(&F::dropout(&x, 0.0, true).unwrap()), xv);
    assert_eq!(vals(&F::dropout(&x, 1.0, true).unwrap()), vec![0.0; n]);
    // other dtypes
    for dt in [DType::F64, DType::F16, DType::BF16] {
        let y = F::dropout(&x.to_dtype(dt).unwrap(), 0.5, true).unwrap();
        assert_eq!(y.dtype(), dt);
        let xr: Vec<f64> = xv.iter().map(|&v| round_to(dt, v)).collect();
        for (a, b) in xr.iter().zip(vals(&y)) {
            assert!(b == 0.0 || (b - 2.0 * a).abs() <= tol(dt, false).0 * 2.0 * a.abs(), "{dt:?}: {b} vs 2 * {a}");
        }
    }
    assert!(F::dropout(&x, 1.5, true).is_err());
    assert!(F::dropout(&x, -0.1, true).is_err());
}

/// Cross-entropy by loops over rows of logits [M, C]: (per-row losses, per-row weights).
fn ref_ce_rows(x: &[f64], c: usize, tg: &[i64], w: Option<&[f64]>, ignore: i64, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let mut losses = vec![];
    let mut ws = vec![];
    for (row, &t) in x.chunks(c).zip(tg) {
        if t == ignore {
            losses.push(0.0);
            ws.push(0.0);
            continue;
        }
        let lp = ref_log_softmax(row);
        let wc = |k: usize| w.map_or(1.0, |w| w[k]);
        let nll = -lp[t as usize] * wc(t as usize);
        let smooth: f64 = -(0..c).map(|k| lp[k] * wc(k)).sum::<f64>();
        losses.push((1.0 - eps) * nll + eps / c as f64 * smooth);
        ws.push(wc(t as usize));
    }
    (losses, ws)
}

fn reduce_ce(losses: &[f64], ws: &[f64], red: Reduction) -> Vec<f64> {
    match red {
        Reduction::None => losses.to_vec(),
        Reduction::Sum => vec![losses.iter().sum()],
        Reduction::Mean => vec![losses.iter().sum::<f64>() / ws.iter().sum::<f64>()],
    }
}

#[test]
fn cross_entropy_values() {
    let (n, c) = (6, 5);
    for dt in [DType::F32, DType::F64] {
        let (rt, at) = tol(dt, true);
        let (x, xv) = inputs(&[n, c], 1, dt, |r| r * 2.0);
        let wv = [0.5, 1.0, 2.0, 0.25, 1.5];
        let w = t(&wv, &[c], dt);
        let targets = [3i64, 0, 4, 2, 2, 1];
        let targets_ign = [3i64, -100, 4, 2, -100, 1];
        let targets_ign2 = [3i64, 2, 4, 2, 0, 2];
        for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
            for (tg, ignore) in [(&targets, -100i64), (&targets_ign, -100), (&targets_ign2, 2)] {
                for weight in [None, Some(&wv[..])] {
                    for eps in [0.0, 0.1] {
                        let opts = CrossEntropyOptions { weight: weight.map(|_| w.clone()), ignore_index: ignore, label_smoothing: eps, reduction: red };
                        let got = F::cross_entropy_with(&x, &ti64(tg, &[n]), &opts).unwrap();
                        let (l, ws) = ref_ce_rows(&xv, c, tg, weight, ignore, eps);
                        let want = reduce_ce(&l, &ws, red);
                        let shape: &[usize] = if red == Reduction::None { &[n] } else { &[] };
                        check(&format!("cross_entropy {dt:?} {red:?} targets {tg:?} ignore {ignore} weight {} eps {eps}", weight.is_some()), &got, shape, dt, &want, rt, at);
                    }
                }
            }
        }
        // the default options: mean, ignore_index -100
        let (l, ws) = ref_ce_rows(&xv, c, &targets_ign, None, -100, 0.0);
        check(&format!("cross_entropy default {dt:?}"), &F::cross_entropy(&x, &ti64(&targets_ign, &[n])).unwrap(), &[], dt, &reduce_ce(&l, &ws, Reduction::Mean), rt, at);
        // I32 targets work too
        let got = F::cross_entropy(&x, &ti32(&[3, 0, 4, 2, 2, 1], &[n])).unwrap();
        let (l, ws) = ref_ce_rows(&xv, c, &targets, None, -100, 0.0);
        check(&format!("cross_entropy I32 targets {dt:?}"), &got, &[], dt, &reduce_ce(&l, &ws, Reduction::Mean), rt, at);
        // [N, C, d]: classes in dim 1
        let (x3, x3v) = inputs(&[2, c, 3], 2, dt, |r| r * 2.0);
        let tg3 = [1i64, 4, 0, 2, -100, 3];
        // rows: for (b, j) the logits x3[b, :, j]
        let rows: Vec<f64> = (0..2).flat_map(|b| (0..3).flat_map(move |j| (0..c).map(move |k| (b, j, k)))).map(|(b, j, k)| x3v[(b * c + k) * 3 + j]).collect();
        for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
            for weight in [None, Some(&wv[..])] {
                for eps in [0.0, 0.1] {
                    let opts = CrossEntropyOptions { weight: weight.map(|_| w.clone()), ignore_index: -100, label_smoothing: eps, reduction: red };
                    let got = F::cross_entropy_with(&x3, &ti64(&tg3, &[2, 3]), &opts).unwrap();
                    let (l, ws) = ref_ce_rows(&rows, c, &tg3, weight, -100, eps);
                    let shape: &[usize] = if red == Reduction::None { &[2, 3] } else { &[] };
                    check(&format!("cross_entropy [N,C,d] {dt:?} {red:?} weight {} eps {eps}", weight.is_some()), &got, shape, dt, &reduce_ce(&l, &ws, red), rt, at);
                }
            }
        }
        // 1-D input [C] with a 0-dim target
        let got = F::cross_entropy(&x.narrow(0, 2, 1).unwrap().reshape(&[c as i64]).unwrap(), &ti64(&[4], &[])).unwrap();
        check(&format!("cross_entropy 1-D {dt:?}"), &got, &[], dt, &[-ref_log_softmax(&xv[2 * c..3 * c])[4]], rt, at);
        // non-contiguous logits
        let (xt, xtv) = make2(n, c, Lay::Transposed, dt, 3, |r| r * 2.0);
        let (l, ws) = ref_ce_rows(&xtv, c, &targets, None, -100, 0.0);
        check(&format!("cross_entropy transposed {dt:?}"), &F::cross_entropy(&xt, &ti64(&targets, &[n])).unwrap(), &[], dt, &reduce_ce(&l, &ws, Reduction::Mean), rt, at);
    }
    // half logits: half result, close to the reference (log_softmax rounds to half first, as in PyTorch)
    for dt in [DType::F16, DType::BF16] {
        let (x, xv) = inputs(&[n, c], 4, dt, |r| r * 2.0);
        let tg = [3i64, 0, 4, 2, -100, 1];
        for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
            let opts = CrossEntropyOptions { label_smoothing: 0.1, reduction: red, ..Default::default() };
            let got = F::cross_entropy_with(&x, &ti64(&tg, &[n]), &opts).unwrap();
            let (l, ws) = ref_ce_rows(&xv, c, &tg, None, -100, 0.1);
            let shape: &[usize] = if red == Reduction::None { &[n] } else { &[] };
            let (rt, at) = tol(dt, true);
            check(&format!("cross_entropy {dt:?} {red:?}"), &got, shape, dt, &reduce_ce(&l, &ws, red), 3.0 * rt, 3.0 * rt + at);
        }
    }
    let x = t(&[0.0; 10], &[2, 5], DType::F32);
    assert!(F::cross_entropy(&x, &ti64(&[0, 1, 2], &[3])).is_err(), "target shape");
    assert!(F::cross_entropy(&x, &t(&[0.0, 1.0], &[2], DType::F32)).is_err(), "float targets");
    // On the GPU a bad class is reported at the next read, like CUDA's asynchronous errors.
    assert!(F::cross_entropy(&x, &ti64(&[0, 5], &[2])).and_then(|l| l.to_device(&kiln::Device::Cpu)).is_err(), "target out of range");
    let bad = CrossEntropyOptions { label_smoothing: 1.5, ..Default::default() };
    assert!(F::cross_entropy_with(&x, &ti64(&[0, 1], &[2]), &bad).is_err());
    let badw = CrossEntropyOptions { weight: Some(t(&[1.0; 3], &[3], DType::F32)), ..Default::default() };
    assert!(F::cross_entropy_with(&x, &ti64(&[0, 1], &[2]), &badw).is_err());
}

#[test]
fn mse_loss_values() {
    for dt in FLOATS {
        let (a, av) = inputs(&[3, 4], 1, dt, |r| r);
        let (b, bv) = make2(3, 4, Lay::Transposed, dt, 2, |r| r);
        let sq: Vec<f64> = av.iter().zip(&bv).map(|(x, y)| (x - y) * (x - y)).collect();
        // Like PyTorch, half inputs round the difference and its square separately.
        let (rt, at) = if matches!(dt, DType::F16 | DType::BF16) { (3.0 * tol(dt, false).0, tol(dt, false).1) } else { sum_tol(dt) };
        check(&format!("mse none {dt:?}"), &F::mse_loss(&a, &b, Reduction::None).unwrap(), &[3, 4], dt, &sq, rt, at);
        check(&format!("mse sum {dt:?}"), &F::mse_loss(&a, &b, Reduction::Sum).unwrap(), &[], dt, &[sq.iter().sum()], rt, at);
        check(&format!("mse mean {dt:?}"), &F::mse_loss(&a, &b, Reduction::Mean).unwrap(), &[], dt, &[sq.iter().sum::<f64>() / 12.0], rt, at);
        // a broadcast target
        let (c, cv) = inputs(&[4], 3, dt, |r| r);
        let sq: Vec<f64> = av.iter().enumerate().map(|(i, x)| (x - cv[i % 4]) * (x - cv[i % 4])).collect();
        check(&format!("mse broadcast {dt:?}"), &F::mse_loss(&a, &c, Reduction::Mean).unwrap(), &[], dt, &[sq.iter().sum::<f64>() / 12.0], rt, at);
    }
}

#[test]
fn row_kernels_across_widths_dtypes_and_nan_rows() {
    // Widths below, at and past a vector multiple, and past the longest row the fused row
    // kernels keep in registers (16384: the decomposition runs instead); a row with a NaN.
    for &c in &[1, 7, 8, 300, 1031, 4096, 20000] {
        for dt in FLOATS {
            let r = 3;
            let mut xv: Vec<f64> = host_rand(r * c, c as u64).into_iter().map(|v| round_to(dt, v * 3.0)).collect();
            xv[c + c / 2] = f64::NAN;
            let x = t(&xv, &[r, c], dt);
            let (w, wv) = inputs(&[c], 7, dt, |v| v);
            let (b, bv) = inputs(&[c], 8, dt, |v| v);
            let (rt, at) = tol(dt, true);
            let ctx = |s: &str| format!("{s} [{r}, {c}] {dt:?}");
            check(&ctx("softmax"), &x.softmax(-1).unwrap(), &[r, c], dt, &along(&xv, &[r, c], 1, ref_softmax), rt, at);
            check(&ctx("log_softmax"), &x.log_softmax(-1).unwrap(), &[r, c], dt, &along(&xv, &[r, c], 1, ref_log_softmax), rt, at * 10.0);
            let want: Vec<f64> = xv
                .chunks(c)
                .flat_map(|g| {
                    let m = g.iter().sum::<f64>() / c as f64;
                    let var = g.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
                    g.iter().map(move |v| (v - m) / (var + 1e-5).sqrt()).collect::<Vec<_>>()
                })
                .enumerate()
                .map(|(i, v)| v * wv[i % c] + bv[i % c])
                .collect();
            check(&ctx("layer_norm"), &F::layer_norm(&x, &[c], Some(&w), Some(&b), 1e-5).unwrap(), &[r, c], dt, &want, rt * 10.0, at * 100.0);
        }
    }
}
