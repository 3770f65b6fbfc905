//! matmul against a naive triple loop: every rank combination, batch broadcasting, transposed,
//! sliced and expanded operands, empty dims, a larger product, F32/F64/F16/BF16/I64.

use crate::common::*;
use crate::ops::*;
use kiln::prelude::*;
use kiln::nn::functional as F;
use kiln::Error;

/// NumPy broadcast of two (valid) shapes.
fn bshape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
            let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
            if da == 1 { db } else { da }
        })
        .collect()
}

/// torch.matmul by loops: (values, per-element sum of |a||b| for the error bound, shape).
fn reference(av: &[f64], sa: &[usize], bv: &[f64], sb: &[usize]) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    let sa2: Vec<usize> = if sa.len() == 1 { vec![1, sa[0]] } else { sa.to_vec() };
    let sb2: Vec<usize> = if sb.len() == 1 { vec![sb[0], 1] } else { sb.to_vec() };
    let (m, k) = (sa2[sa2.len() - 2], sa2[sa2.len() - 1]);
    let n = sb2[sb2.len() - 1];
    assert_eq!(k, sb2[sb2.len() - 2]);
    let batch = bshape(&sa2[..sa2.len() - 2], &sb2[..sb2.len() - 2]);
    let nb: usize = batch.iter().product();
    let full = |r: usize, c: usize| {
        let mut f = batch.clone();
        f.extend([r, c]);
        f
    };
    let ea = bcast(av, &sa2, &full(m, k));
    let eb = bcast(bv, &sb2, &full(k, n));
    let (mut out, mut mag) = (vec![0.0; nb * m * n], vec![0.0; nb * m * n]);
    for bi in 0..nb {
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut g) = (0.0, 0.0);
                for p in 0..k {
                    let prod = ea[(bi * m + i) * k + p] * eb[(bi * k + p) * n + j];
                    s += prod;
                    g += prod.abs();
                }
                out[(bi * m + i) * n + j] = s;
                mag[(bi * m + i) * n + j] = g;
            }
        }
    }
    let mut shape = batch;
    if sa.len() > 1 {
        shape.push(m);
    }
    if sb.len() > 1 {
        shape.push(n);
    }
    (out, mag, shape)
}

/// Relative error bound (times sum |a||b|) per dtype.
fn mm_rtol(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => F16_RTOL,
        DType::BF16 => BF16_RTOL,
        _ => 0.0,
    }
}

#[track_caller]
fn check_mm(ctx: &str, a: &Tensor, av: &[f64], b: &Tensor, bv: &[f64], dt: DType) {
    let (want, mag, shape) = reference(av, a.shape(), bv, b.shape());
    let got = a.matmul(b).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    assert_eq!(got.shape(), shape.as_slice(), "{ctx}: shape");
    assert_eq!(got.dtype(), dt, "{ctx}: dtype");
    let g = vals(&got);
    let rtol = mm_rtol(dt);
    for (i, ((x, y), m)) in g.iter().zip(&want).zip(&mag).enumerate() {
        let ok = x == y || (x - y).abs() <= rtol * (m + y.abs()) + 1e-300;
        assert!(ok, "{ctx}: element {i}: got {x}, expected {y} (bound {} = {rtol} * sum|ab| {m})", rtol * m);
    }
}

const MM_DTYPES: [DType; 5] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64];

fn dom(dt: DType) -> fn(f64) -> f64 {
    if dt == DType::I64 {
        |r| (r * 2.5).round()
    } else {
        |r| r
    }
}

#[test]
fn matmul_rank_combinations_and_batch_broadcast() {
    #[rustfmt::skip]
    let cases: &[(&[usize], &[usize])] = &[
        (&[7], &[7]),
        (&[3, 4], &[4, 5]),
        (&[4], &[4, 5]),
        (&[3, 4], &[4]),
        (&[2, 3, 4], &[4, 5]),
        (&[3, 4], &[2, 4, 5]),
        (&[4], &[2, 4, 5]),
        (&[2, 3, 4], &[4]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[3, 4, 5]),
        (&[1, 3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[1, 2, 4, 5]),
        (&[1, 1], &[1, 1]),
        (&[6, 40, 50], &[50, 30]),
    ];
    for dt in MM_DTYPES {
        for (k, &(sa, sb)) in cases.iter().enumerate() {
            let (a, av) = inputs(sa, 100 + k as u64, dt, dom(dt));
            let (b, bv) = inputs(sb, 200 + k as u64, dt, dom(dt));
            check_mm(&format!("{sa:?} @ {sb:?} {dt:?}"), &a, &av, &b, &bv, dt);
        }
    }
}

#[test]
fn matmul_non_contiguous_operands() {
    for dt in MM_DTYPES {
        let d = dom(dt);
        // a = [4,3]^T, b = [5,4]^T
        let (a, av) = make2(3, 4, Lay::Transposed, dt, 1, d);
        let (b, bv) = make2(4, 5, Lay::Transposed, dt, 2, d);
        check_mm(&format!("t @ t {dt:?}"), &a, &av, &b, &bv, dt);
        let (bc, bcv) = make2(4, 5, Lay::Contig, dt, 3, d);
        check_mm(&format!("t @ contig {dt:?}"), &a, &av, &bc, &bcv, dt);
        // step-sliced and expanded operands
        let (s, sv) = make2(3, 4, Lay::Strided, dt, 4, d);
        check_mm(&format!("strided @ t {dt:?}"), &s, &sv, &b, &bv, dt);
        let (e, ev) = make2(4, 5, Lay::Expanded, dt, 5, d);
        check_mm(&format!("strided @ expanded {dt:?}"), &s, &sv, &e, &ev, dt);
        let (s2, s2v) = make2(4, 5, Lay::Strided, dt, 6, d);
        check_mm(&format!("expanded[3,4] @ strided {dt:?}"), &make2(3, 4, Lay::Expanded, dt, 7, d).0, &make2(3, 4, Lay::Expanded, dt, 7, d).1, &s2, &s2v, dt);
        // batched transposed: [2,4,3] -> transpose(1,2) = [2,3,4]
        let (base, bav) = inputs(&[2, 4, 3], 8, dt, d);
        let bt = base.transpose(1, 2).unwrap();
        let btv: Vec<f64> = (0..24).map(|f| (f / 12, (f / 4) % 3, f % 4)).map(|(z, i, j)| bav[z * 12 + j * 3 + i]).collect();
        let (w, wv) = make2(4, 5, Lay::Transposed, dt, 9, d);
        check_mm(&format!("batched transposed @ t {dt:?}"), &bt, &btv, &w, &wv, dt);
        // 1-D strided vector
        let (vb, vbv) = inputs(&[8], 10, dt, d);
        let v = vb.slice(0, 1, 8, 2).unwrap();
        let vv: Vec<f64> = (0..4).map(|i| vbv[1 + 2 * i]).collect();
        check_mm(&format!("t @ strided vector {dt:?}"), &a, &av, &v, &vv, dt);
        check_mm(&format!("strided vector . strided vector {dt:?}"), &v, &vv, &v, &vv, dt);
    }
}

#[test]
fn matmul_empty_dims() {
    #[rustfmt::skip]
    let cases: &[(&[usize], &[usize])] = &[
        (&[0, 3], &[3, 4]), (&[3, 0], &[0, 4]), (&[3, 4], &[4, 0]), (&[0, 3, 4], &[4, 5]),
        (&[0], &[0]), (&[2, 3, 0], &[0, 5]), (&[0], &[0, 2]),
    ];
    for dt in MM_DTYPES {
        for &(sa, sb) in cases {
            let (a, av) = inputs(sa, 1, dt, dom(dt));
            let (b, bv) = inputs(sb, 2, dt, dom(dt));
            check_mm(&format!("{sa:?} @ {sb:?} {dt:?}"), &a, &av, &b, &bv, dt);
        }
    }
}

#[test]
fn matmul_130x70x90() {
    for dt in MM_DTYPES {
        let (a, av) = inputs(&[130, 70], 31, dt, dom(dt));
        let (b, bv) = inputs(&[70, 90], 32, dt, dom(dt));
        check_mm(&format!("[130,70] @ [70,90] {dt:?}"), &a, &av, &b, &bv, dt);
        // the same product from transposed storage
        let at = t(&(0..130 * 70).map(|f| av[(f % 130) * 70 + f / 130]).collect::<Vec<_>>(), &[70, 130], dt).t().unwrap();
        let bt = t(&(0..70 * 90).map(|f| bv[(f % 70) * 90 + f / 70]).collect::<Vec<_>>(), &[90, 70], dt).t().unwrap();
        assert!(!at.is_contiguous() && !bt.is_contiguous());
        check_mm(&format!("[130,70]^T-stored @ [70,90]^T-stored {dt:?}"), &at, &av, &bt, &bv, dt);
    }
}

/// Mid-sized products (2M to 8M multiply-adds) are split across the host's cores, by rows
/// when there are many, else by columns; each split product equals the loops, in the MLP
/// step's three layouts (x @ W^T, x^T @ dy, dy @ W) and with a transposed output-side operand.
#[test]
fn mid_sized_products_split_across_cores_match() {
    for (m, k, n, la, lb) in [(32, 784, 256, Lay::Contig, Lay::Transposed), (256, 32, 784, Lay::Transposed, Lay::Contig), (32, 256, 300, Lay::Contig, Lay::Contig), (130, 150, 129, Lay::Transposed, Lay::Transposed)] {
        for dt in [DType::F32, DType::F64] {
            let (a, av) = make2(m, k, la, dt, 11, |r| r);
            let (b, bv) = make2(k, n, lb, dt, 12, |r| r);
            check_mm(&format!("{m}x{k} {la:?} @ {k}x{n} {lb:?} {dt:?}"), &a, &av, &b, &bv, dt);
        }
    }
}

#[test]
fn matmul_errors() {
    let a = t(&[1.0; 12], &[3, 4], DType::F32);
    let b = t(&[1.0; 15], &[3, 5], DType::F32);
    assert!(matches!(a.matmul(&b), Err(Error::Shape { .. })));
    assert!(matches!(a.matmul(&t(&[1.0; 20], &[4, 5], DType::F64)), Err(Error::DType { .. })));
    assert!(a.matmul(&t0(1.0, DType::F32)).is_err());
    assert!(t(&[1.0; 3], &[3], DType::F32).matmul(&t(&[1.0; 4], &[4], DType::F32)).is_err());
    // batch dims that do not broadcast
    assert!(t(&[1.0; 24], &[2, 3, 4], DType::F32).matmul(&t(&[1.0; 60], &[3, 4, 5], DType::F32)).is_err());
}

#[test]
fn large_bf16_products_with_unaligned_k_and_n_match_and_their_gradients_too() -> Result<()> {
    // On CUDA these are padded to multiples of 8 (cuBLAS's tensor-core kernels need aligned
    // leading dims): the result is then a view of the padded product's first N columns.
    let d = dev();
    let (m, k, n) = (1024, 1003, 4197);
    let r = |shape: &[usize], seed| -> Result<Tensor> { Tensor::from_vec(host_rand(shape.iter().product(), seed), shape, &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(&d) };
    let (a, b, g) = (r(&[m, k], 1)?.requires_grad(), r(&[k, n], 2)?.requires_grad(), r(&[m, n], 3)?);
    let y = a.matmul(&b)?;
    if d.is_cuda() {
        assert!(!y.is_contiguous(), "the CUDA product is a view of a padded one");
    }
    y.mul(&g)?.sum_all()?.backward()?;
    // The reference: the same BF16 values multiplied in F32 on the host.
    let f = |t: &Tensor| t.detach().to_dtype(DType::F32).and_then(|t| t.to_device(&Device::Cpu));
    let (af, bf, gf) = (f(&a)?, f(&b)?, f(&g)?);
    // BF16 results: rounded to 8 bits of mantissa (2^-8 relative), over F32 sums of ~1000 terms.
    let (rtol, atol) = (8e-3, 5e-2);
    assert_close_named("y", &vals(&y.to_dtype(DType::F32)?), &vals(&af.matmul(&bf)?), rtol, atol);
    assert_close_named("da", &vals(&a.grad().expect("a grad").to_dtype(DType::F32)?), &vals(&gf.matmul(&bf.t()?)?), rtol, atol);
    assert_close_named("db", &vals(&b.grad().expect("b grad").to_dtype(DType::F32)?), &vals(&af.t()?.matmul(&gf)?), rtol, atol);
    Ok(())
}

/// An F32 product's values within mm_rtol of the reference, scaled by sum |a||b| per element.
#[track_caller]
fn assert_product_close(ctx: &str, got: &Tensor, want: &Tensor, mag: &Tensor) {
    let rtol = mm_rtol(DType::F32);
    for (i, ((x, y), m)) in vals(got).iter().zip(vals(want)).zip(vals(mag)).enumerate() {
        assert!((x - y).abs() <= rtol * (m + y.abs()), "{ctx}: element {i}: got {x}, expected {y} (bound {rtol} * sum|ab| {m})");
    }
}

/// A product's gradient comes in its operand's layout, as PyTorch's do: a `Linear` weight used
/// as `W.t()` gets a contiguous gradient (its update then reads it in order), and the values
/// are the products `g bᵀ` and `aᵀ g` either way.
#[test]
fn gradients_of_transposed_operands_come_in_their_operands_layout() -> Result<()> {
    let d = dev();
    for (m, k, n) in [(32usize, 784usize, 256usize), (5, 3, 7)] {
        let w = Tensor::randn(&[n, k], DType::F32, &d)?.requires_grad();
        let xt = Tensor::randn(&[k, m], DType::F32, &d)?.requires_grad();
        let g = Tensor::randn(&[m, n], DType::F32, &d)?;
        // x = xt.t() and w.t() are both transposed views.
        xt.t()?.matmul(&w.t()?)?.mul(&g)?.sum_all()?.backward()?;
        let (gw, gx) = (w.grad().expect("w's gradient"), xt.grad().expect("x's gradient"));
        assert!(gw.is_contiguous() && gx.is_contiguous(), "{:?} {:?}", gw.strides(), gx.strides());
        // d/dW of sum(g * x Wᵀ) = gᵀ x; d/dxt = (g W)ᵀ.
        let want_w = no_grad(|| g.t()?.matmul(&xt.t()?))?;
        let want_x = no_grad(|| g.matmul(&w)?.t())?;
        // The products' error bounds scale with sum |a||b| (mm_rtol), as in check_mm.
        let mag_w = no_grad(|| g.abs()?.t()?.matmul(&xt.abs()?.t()?))?;
        let mag_x = no_grad(|| g.abs()?.matmul(&w.abs()?)?.t())?;
        assert_product_close("dW", &gw, &want_w, &mag_w);
        assert_product_close("dx", &gx, &want_x, &mag_x);
        // Compiled, where the trace's stand-ins are contiguous and the layout comes from the graph.
        let w2 = Tensor::randn(&[n, k], DType::F32, &d)?.requires_grad();
        no_grad(|| w2.copy_(&w))?;
        let x = no_grad(|| xt.t()?.copy_contiguous())?;
        let w3 = w2.clone();
        let step = kiln::compile::compile(move |x: &Tensor, g: &Tensor| {
            let loss = x.matmul(&w3.t()?)?.mul(g)?.sum_all()?;
            loss.backward()?;
            Ok(loss)
        });
        step.call(&x, &g)?;
        let gw2 = w2.grad().expect("the compiled step's gradient");
        assert!(gw2.is_contiguous(), "compiled: {:?}", gw2.strides());
        assert_product_close("compiled dW", &gw2, &want_w, &mag_w);
    }
    Ok(())
}

/// A row times a matrix (every linear layer of a one-token decode step), in both storage
/// orders of the matrix, at sizes around the 16-byte vector, long rows and wide outputs, from
/// offsets that break alignment; with a bias and ReLU through `compile`. On CUDA the aligned
/// ones run kiln's matrix-vector kernels (checked by name) and the rest cuBLASLt.
#[test]
fn products_of_one_row_in_both_storage_orders() -> Result<()> {
    let d = dev();
    let names = |f: &dyn Fn() -> Result<Tensor>| -> Result<(Tensor, Vec<String>)> {
        let (out, p) = kiln::profiler::profile_value(f)?;
        Ok((out, p.kernel_names().iter().map(|s| s.to_string()).collect()))
    };
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let vw = 16 / dt.size_in_bytes();
        for (k, n) in [(8, 8), (768, 2304), (3072, 768), (8192, 64), (1000, 24), (24, 1000), (13, 17), (4096, 50), (64, 50257)] {
            for transposed in [false, true] {
                // The matrix stored [K, N], or [N, K] and read through its transpose.
                let (bv, bs) = (host_rand(k * n, 7 + k as u64), if transposed { [n, k] } else { [k, n] });
                let b = t(&bv, &bs, dt);
                let b = if transposed { b.t()? } else { b };
                let bvals = vals(&b);
                for offset in [0, 1] {
                    let av = host_rand(k + offset, 3);
                    let a = t(&av, &[1, k + offset], dt).slice(1, offset as i64, (k + offset) as i64, 1)?;
                    let ctx = format!("{dt:?} [1,{k}] @ [{k},{n}] transposed={transposed} offset={offset}");
                    let (y, kernels) = names(&|| a.matmul(&b))?;
                    let (want, mag, _) = reference(&vals(&a), &[1, k], &bvals, &[k, n]);
                    let rtol = mm_rtol(dt);
                    for (i, ((x, y), m)) in vals(&y).iter().zip(&want).zip(&mag).enumerate() {
                        assert!((x - y).abs() <= rtol * (m + y.abs()), "{ctx}: element {i}: got {x}, expected {y}");
                    }
                    if d.is_cuda() {
                        let aligned = offset == 0 || !transposed;
                        let takes = aligned && if transposed { k % vw == 0 && k > 1 } else { n % vw == 0 && n > 1 };
                        let ours = kernels.iter().any(|s| s.starts_with("gemv_"));
                        assert_eq!(ours, takes, "{ctx}: {kernels:?}");
                    }
                }
            }
        }
        // A linear layer with its bias and ReLU on one row, compiled (the library product's
        // epilogue) and eager.
        let (w, bias) = (t(&host_rand(96 * 64, 1), &[96, 64], dt), t(&host_rand(96, 2), &[96], dt));
        let x = t(&host_rand(64, 3), &[1, 64], dt);
        let (w2, b2) = (w.clone(), bias.clone());
        let f = kiln::compile::compile(move |x: &Tensor| F::linear(x, &w2, Some(&b2))?.relu());
        let got = f.call(&x)?;
        let eager = F::linear(&x, &w, Some(&bias))?.relu()?;
        let f64s = |t: &Tensor| t.to_dtype(DType::F64);
        let want = F::linear(&f64s(&x)?, &f64s(&w)?, Some(&f64s(&bias)?))?.relu()?;
        let tol = if dt == DType::F32 { 1e-5 } else { 2e-2 };
        assert_close_named(&format!("{dt:?} compiled"), &vals(&got), &vals(&want), tol, tol * 8.0);
        assert_close_named(&format!("{dt:?} eager"), &vals(&eager), &vals(&want), tol, tol * 8.0);
    }
    Ok(())
}

/// The index of the largest output of a compiled row product (a greedy decode step's next
/// token from a tied output head, `[N, K]` read through its transpose): the same index as
/// eager, at sizes where one warp walks several outputs and where a block's warps have none,
/// with the largest value twice (the first index, as `Tensor::argmax`), with a NaN (its
/// index), with a bias. A kernel runs before the product, so its matrix is settled (on CUDA
/// fetched into L2 before the kernel's wait, the next kernel let start at once); in the `norm`
/// case that kernel is a product whose row a layer norm takes before the head, which the head's
/// kernel computes itself at any number of columns: there the index is one whose eager logit is
/// the largest within the dtype's rounding (the layer norm inside the head may round
/// differently from the eager one, and a near tie may then go either way). On CUDA unless
/// `KILN_GEMV_ARGMAX=0` or `KILN_GEMV=0` the product's kernel computes the argmax
/// (`gemv_rows_argmax_*`, checked by name, with the layer norm in its name in the `norm` case)
/// and no argmax kernel runs.
#[test]
fn the_argmax_of_a_compiled_row_product_is_eager_argmax() -> Result<()> {
    let d = dev();
    let fused = d.is_cuda() && ["KILN_GEMV_ARGMAX", "KILN_GEMV"].iter().all(|s| std::env::var(s).map_or(true, |v| v != "0"));
    for (dt, tol) in [(DType::F32, 1e-4), (DType::F16, 5e-3), (DType::BF16, 2e-2)] {
        for (k, n) in [(64, 50257), (768, 1001), (16, 5)] {
            for case in ["plain", "tie", "nan", "bias", "norm"] {
                let mut wv = host_rand(n * k, 11 + n as u64);
                let xv: Vec<f64> = host_rand(k, 5).iter().map(|v| v.abs() + 0.1).collect();
                // Rows made largest (all-positive weights against a positive row): twice the
                // same row, or a NaN in one.
                let (first, second) = (n / 3, n / 3 + 2);
                if case == "tie" || case == "nan" {
                    for j in 0..k {
                        wv[first * k + j] = 4.0;
                        wv[second * k + j] = 4.0;
                    }
                }
                if case == "nan" {
                    wv[(n - 1) * k + k / 2] = f64::NAN;
                }
                let w = t(&wv, &[n, k], dt);
                let x = t(&xv, &[1, k], dt);
                let bias = (case == "bias").then(|| t(&host_rand(n, 9), &[n], dt));
                let eye = Tensor::eye(k, dt, &d)?;
                let norm = case == "norm";
                let logits_of = move |x: &Tensor, w: &Tensor, b: Option<&Tensor>, eye: &Tensor| -> Result<Tensor> {
                    let x = if norm { F::layer_norm(&x.matmul(eye)?, &[k], None, None, 1e-5)? } else { x.mul_scalar(2.0)? };
                    let logits = match b {
                        Some(b) => x.matmul(&w.t()?)?.add(b)?,
                        None => x.matmul(&w.t()?)?,
                    };
                    logits.reshape(&[1, 1, n as i64])
                };
                let (w2, b2, eye2) = (w.clone(), bias.clone(), eye.clone());
                let f = kiln::compile::compile(move |x: &Tensor| logits_of(x, &w2, b2.as_ref(), &eye2)?.argmax(-1, false));
                let logits = logits_of(&x, &w, bias.as_ref(), &eye)?;
                let want = logits.argmax(-1, false)?;
                let ctx = format!("{dt:?} [1,{k}] @ [{k},{n}] {case}");
                f.call(&x)?;
                let (got, p) = kiln::profiler::profile_value(|| f.call(&x))?;
                assert_eq!(got.shape(), want.shape(), "{ctx}");
                if norm {
                    let l = logits.to_dtype(DType::F64)?.to_vec::<f64>()?;
                    let top = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let at = got.to_vec::<i64>()?[0] as usize;
                    assert!(at < n && l[at] >= top - tol * top.abs().max(1.0), "{ctx}: index {at} has {} against the largest {top}", l[at.min(n - 1)]);
                } else {
                    assert_eq!(got.to_vec::<i64>()?, want.to_vec::<i64>()?, "{ctx}");
                }
                match case {
                    "tie" => assert_eq!(got.to_vec::<i64>()?, [first as i64], "{ctx}"),
                    "nan" => assert_eq!(got.to_vec::<i64>()?, [n as i64 - 1], "{ctx}"),
                    _ => {}
                }
                if fused {
                    let names: Vec<String> = p.kernel_names().iter().map(|s| s.to_string()).collect();
                    let head = format!("gemv_rows_argmax_{}", dt.torch_name());
                    assert_eq!(names.len(), 2, "{ctx}: {names:?}");
                    assert!(names[1].starts_with(&head) && names[1].contains("_fused") == norm, "{ctx}: {names:?}");
                    assert!(!names[0].contains("argmax"), "{ctx}: {names:?}");
                }
            }
        }
    }
    Ok(())
}

/// Compiled F32 linear layers under `allow_tf32` on CUDA: kiln's TF32 tensor-core kernels (by
/// name) in both storage orders of the weight, at tile edges, with K split and not, with a bias
/// and ReLU; each element within TF32's rounding of its inputs (10 bits kept of each, about
/// 2^-9 of sum |a||b| a product) plus F32 accumulation over K. `allow_tf32` is process-wide, so
/// the products run in a child process of this test binary, where no other test's F32 product
/// can take TF32 meanwhile.
#[test]
fn compiled_f32_products_under_allow_tf32_run_tensor_core_kernels() {
    if dev().is_cuda() {
        run_child_with("ops_matmul::tf32_products_child", &[("KILN_TF32_GEMM", "1")]);
    }
}

#[test]
#[ignore = "run as a child process by compiled_f32_products_under_allow_tf32_run_tensor_core_kernels"]
fn tf32_products_child() -> Result<()> {
    if !dev().is_cuda() {
        return Ok(());
    }
    kiln::cuda::set_allow_tf32(true);
    // Split K at whole tiles; ragged tiles with a split K and a short last piece; ragged tiles
    // without a split.
    for (m, k, n) in [(320, 512, 512), (320, 2048, 512), (320, 512, 1536), (100, 1000, 100), (77, 100, 36), (5, 36, 20), (130, 64, 200), (64, 4, 64)] {
        for transposed in [true, false] {
            let ctx = format!("[{m},{k}] @ [{k},{n}] weight stored {}", if transposed { "[N, K]" } else { "[K, N]" });
            let (xv, wv, bv) = (host_rand(m * k, 3 + k as u64), host_rand(k * n, 5 + n as u64), host_rand(n, 7));
            let x = t(&xv, &[m, k], DType::F32);
            // The weight as [K, N] values either way: stored [N, K] and transposed, or [K, N].
            let w_kn: Vec<f64> = if transposed { (0..k * n).map(|i| wv[(i % n) * k + i / n]).collect() } else { wv.clone() };
            let w = if transposed { t(&wv, &[n, k], DType::F32).t()? } else { t(&wv, &[k, n], DType::F32) };
            let bias = t(&bv, &[n], DType::F32);
            let (want, mag, _) = reference(&xv, &[m, k], &w_kn, &[k, n]);
            // Each input rounded to 10 fraction bits (2^-11 each), F32 sums over K.
            let tol = 2f64.powi(-10) + 2f64.powi(-21) + k as f64 * 2f64.powi(-22);
            let kernel = if transposed { "tf32_gemm_nk" } else { "tf32_gemm_kn" };
            // The product first in its program, and after a kernel of the program's own (the
            // weight then settled: loaded before the wait for that kernel).
            for scale in [1.0, 2.0] {
                let (w, bias) = (w.clone(), bias.clone());
                let f = kiln::compile::compile(move |x: &Tensor| {
                    let x = if scale == 1.0 { x.clone() } else { x.mul_scalar(scale)? };
                    x.matmul(&w)?.add(&bias)?.relu()
                });
                let (y, p) = kiln::profiler::profile_value(|| f.call(&x))?;
                let names: Vec<String> = p.kernel_names().iter().map(|s| s.to_string()).collect();
                assert!(names.iter().any(|s| s == kernel), "{ctx} x{scale}: {names:?}");
                for (i, ((got, want), mag)) in vals(&y).iter().zip(&want).zip(&mag).enumerate() {
                    let want = (scale * want + bv[i % n]).max(0.0);
                    assert!((got - want).abs() <= tol * (scale * mag + bv[i % n].abs()) + 1e-6, "{ctx} x{scale}: element {i}: got {got}, expected {want}");
                }
            }
        }
    }
    Ok(())
}
