//! Semantics PyTorch users rely on, with PyTorch's own values (computed with torch 2.11 and
//! written here): 0-dim tensors through reductions and indexing, NaN rules, broadcasting masks,
//! and the ops kiln added for parity, each checked in value, by finite differences, and compiled.

use crate::common::*;
use kiln::compile::compile;
use kiln::nn::functional as F;
use kiln::{gradcheck, DType, GradcheckOptions, RoundingMode, Tensor};

fn scalar(v: f64) -> Tensor {
    t(&[v], &[], DType::F32)
}

// ---------------------------------------------------------------- 0-dim tensors

#[test]
fn zero_dim_reductions_return_values() {
    let x = scalar(5.0);
    for dim in [0, -1] {
        let p = x.prod(dim, false).unwrap();
        assert_eq!((p.shape().to_vec(), vals(&p)), (vec![], vec![5.0]));
        for a in [x.argmax(dim, false).unwrap(), x.argmin(dim, true).unwrap()] {
            assert_eq!((a.shape().to_vec(), a.dtype(), vals(&a)), (vec![], DType::I64, vec![0.0]));
        }
        let (v, i) = x.max(dim, false).unwrap();
        assert_eq!((vals(&v), vals(&i)), (vec![5.0], vec![0.0]));
    }
    assert_eq!(vals(&x.amax(&[0], false).unwrap()), vec![5.0]);
    assert_eq!(vals(&x.sum(&[-1], true).unwrap()), vec![5.0]);
    assert_eq!(vals(&x.cumsum(0).unwrap()), vec![5.0]);
}

#[test]
fn zero_dim_indexing() {
    let x = scalar(5.0);
    let i0 = t(&[0.0], &[], DType::I64);
    let g = x.gather(0, &i0).unwrap();
    assert_eq!((g.shape().to_vec(), vals(&g)), (vec![], vec![5.0]));
    // torch.tensor(5.).gather(0, tensor([0, 0])) == tensor([5., 5.])
    let g2 = x.gather(0, &t(&[0.0, 0.0], &[2], DType::I64)).unwrap();
    assert_eq!((g2.shape().to_vec(), vals(&g2)), (vec![2], vec![5.0, 5.0]));
    let s = x.scatter_add(0, &i0, &scalar(2.0)).unwrap();
    assert_eq!((s.shape().to_vec(), vals(&s)), (vec![], vec![7.0]));
    for idx in [i0.clone(), t(&[0.0], &[1], DType::I64)] {
        let r = x.index_select(0, &idx).unwrap();
        assert_eq!((r.shape().to_vec(), vals(&r)), (vec![], vec![5.0]));
    }
    assert!(x.index_select(0, &t(&[0.0, 0.0], &[2], DType::I64)).is_err());
}

#[test]
fn empty_index_shapes() {
    let x = t(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3], DType::F32);
    let e = Tensor::zeros(&[0], DType::I64, &dev()).unwrap();
    assert_eq!(x.index_select(1, &e).unwrap().shape(), &[2, 0]);
    // An empty index skips gather's rank check, as in PyTorch.
    assert_eq!(x.gather(1, &e).unwrap().shape(), &[0]);
    assert_eq!(x.gather(0, &Tensor::zeros(&[5, 0], DType::I64, &dev()).unwrap()).unwrap().shape(), &[5, 0]);
    let s = x.scatter_add(0, &e, &Tensor::zeros(&[0], DType::F32, &dev()).unwrap()).unwrap();
    assert_eq!(vals(&s), vals(&x));
}

// ---------------------------------------------------------------- NaN and sign rules

#[test]
fn sign_abs_relu_at_nan() {
    let x = t(&[f64::NAN, -0.0, 2.0, -3.0], &[4], DType::F32);
    assert_eq!(vals(&x.sign().unwrap()), vec![0.0, 0.0, 1.0, -1.0]);
    let b = t(&[1.0, 0.0], &[2], DType::Bool);
    let sb = b.sign().unwrap();
    assert_eq!((sb.dtype(), vals(&sb)), (DType::Bool, vec![1.0, 0.0]));
    // abs' gradient is sgn(x): 0 at NaN; relu passes a NaN's gradient.
    let a = t(&[f64::NAN, 1.0], &[2], DType::F32).requires_grad();
    a.abs().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&a.grad().unwrap()), vec![0.0, 1.0]);
    let r = t(&[f64::NAN, 1.0, -1.0, 0.0], &[4], DType::F32).requires_grad();
    r.relu().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&r.grad().unwrap()), vec![1.0, 1.0, 0.0, 0.0]);
    let c = compile(|x: &Tensor| x.sign());
    assert_eq!(vals(&c.call(&x).unwrap()), vec![0.0, 0.0, 1.0, -1.0]);
}

#[test]
fn masked_fill_broadcasts_to_the_larger_shape() {
    let x = Tensor::zeros(&[3], DType::F32, &dev()).unwrap();
    let m = t(&[1.0, 0.0, 1.0, 0.0, 0.0, 1.0], &[2, 3], DType::Bool);
    let y = x.masked_fill(&m, 1.0).unwrap();
    assert_eq!((y.shape().to_vec(), vals(&y)), (vec![2, 3], vec![1.0, 0.0, 1.0, 0.0, 0.0, 1.0]));
    // A float into an integer tensor is truncated, as PyTorch does; out of range is an error.
    let u = Tensor::zeros(&[3], DType::U8, &dev()).unwrap();
    let m3 = t(&[1.0, 0.0, 1.0], &[3], DType::Bool);
    assert_eq!(vals(&u.masked_fill(&m3, 2.5).unwrap()), vec![2.0, 0.0, 2.0]);
    let e = u.masked_fill(&m3, 300).unwrap_err().to_string();
    assert!(e.contains("masked_fill") && e.contains("300") && e.contains("U8"), "{e}");
    assert!(u.masked_fill(&m3, -1).is_err());
}

// ---------------------------------------------------------------- new pointwise ops

/// torch 2.11: the values of each op at these inputs.
#[test]
fn rounding_and_transcendental_values() {
    let x = t(&[0.5, 1.5, 2.5, -0.5, -1.7, 1.2345], &[6], DType::F64);
    assert_eq!(vals(&x.round().unwrap()), vec![0.0, 2.0, 2.0, -0.0, -2.0, 1.0]);
    assert_eq!(vals(&x.floor().unwrap()), vec![0.0, 1.0, 2.0, -1.0, -2.0, 1.0]);
    assert_eq!(vals(&x.ceil().unwrap()), vec![1.0, 2.0, 3.0, -0.0, -1.0, 2.0]);
    assert_eq!(vals(&x.trunc().unwrap()), vec![0.0, 1.0, 2.0, -0.0, -1.0, 1.0]);
    assert_close(&vals(&t(&[1.2345, 1255.0], &[2], DType::F64).round_decimals(2).unwrap()), &[1.23, 1255.0], 1e-12, 0.0);
    assert_eq!(vals(&t(&[1255.0, 1245.0], &[2], DType::F64).round_decimals(-1).unwrap()), vec![1260.0, 1240.0]);
    let i = t(&[3.0, -4.0], &[2], DType::I64);
    for r in [i.floor().unwrap(), i.ceil().unwrap(), i.round().unwrap(), i.trunc().unwrap()] {
        assert_eq!((r.dtype(), vals(&r)), (DType::I64, vec![3.0, -4.0]));
    }
    let small = t(&[1e-10, 1.0, -2.0], &[3], DType::F64);
    assert_close(&vals(&small.expm1().unwrap()), &[1.00000000005e-10, 1.718281828459045, -0.8646647167633873], 1e-12, 0.0);
    assert_close(&vals(&small.tan().unwrap()), &[1e-10, 1.5574077246549023, 2.185039863261519], 1e-12, 0.0);
}

#[test]
fn division_modes_remainder_fmod_values() {
    let a = t(&[-7.0, 7.0, -3.0, 3.0, 5.5], &[5], DType::F64);
    let b = t(&[2.0, 2.0, -2.0, -2.0, 1.5], &[5], DType::F64);
    assert_eq!(vals(&a.div_mode(&b, RoundingMode::Floor).unwrap()), vec![-4.0, 3.0, 1.0, -2.0, 3.0]);
    assert_eq!(vals(&a.div_mode(&b, RoundingMode::Trunc).unwrap()), vec![-3.0, 3.0, 1.0, -1.0, 3.0]);
    assert_eq!(vals(&a.remainder(&b).unwrap()), vec![1.0, 1.0, -1.0, -1.0, 1.0]);
    assert_eq!(vals(&a.fmod(&b).unwrap()), vec![-1.0, 1.0, -1.0, 1.0, 1.0]);
    let r0 = vals(&t(&[-3.0], &[1], DType::F32).remainder_scalar(0.0).unwrap());
    assert!(r0[0].is_nan());
    let ai = t(&[-7.0, 7.0], &[2], DType::I64);
    let fl = ai.div_mode_scalar(2, RoundingMode::Floor).unwrap();
    assert_eq!((fl.dtype(), vals(&fl)), (DType::I64, vec![-4.0, 3.0]));
    assert_eq!(vals(&ai.div_mode_scalar(2, RoundingMode::Trunc).unwrap()), vec![-3.0, 3.0]);
    assert_eq!(vals(&ai.remainder_scalar(-2).unwrap()), vec![-1.0, -1.0]);
    assert_eq!(vals(&ai.fmod_scalar(-2).unwrap()), vec![-1.0, 1.0]);
    if dev() == kiln::Device::Cpu {
        let e = ai.remainder(&t(&[0.0, 1.0], &[2], DType::I64)).unwrap_err().to_string();
        assert!(e.contains("remainder") && e.contains("division by zero"), "{e}");
    }
}

#[test]
fn new_ops_gradients() {
    let x = t(&host_rand(6, 3), &[2, 3], DType::F64);
    let y = t(&host_rand(6, 4).iter().map(|v| v.abs() + 0.5).collect::<Vec<_>>(), &[2, 3], DType::F64);
    let o = GradcheckOptions::default();
    gradcheck(|xs| xs[0].expm1(), std::slice::from_ref(&x), o).unwrap();
    gradcheck(|xs| xs[0].mul_scalar(0.5)?.tan(), std::slice::from_ref(&x), o).unwrap();
    gradcheck(|xs| xs[0].remainder(&xs[1]), &[x.clone(), y.clone()], o).unwrap();
    gradcheck(|xs| xs[0].fmod(&xs[1]), &[x.clone(), y.clone()], o).unwrap();
    gradcheck(|xs| xs[0].cumsum(1), std::slice::from_ref(&x), o).unwrap();
    gradcheck(|xs| xs[0].cumprod(0), std::slice::from_ref(&x), o).unwrap();
    gradcheck(|xs| xs[0].clamp_tensor(Some(&xs[1].neg()?), Some(&xs[1])), &[x.clone(), y.clone()], o).unwrap();
    // Piecewise constant ops have zero gradients.
    let xg = x.detach().requires_grad();
    xg.floor().unwrap().add(&xg.round().unwrap()).unwrap().add(&xg.div_mode(&y, RoundingMode::Floor).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(vals(&xg.grad().unwrap()).iter().all(|&g| g == 0.0));
}

#[test]
fn cumsum_cumprod_values_and_dtypes() {
    let x = t(&[1.0, 2.0, 3.0, 4.0, 0.0, 6.0], &[2, 3], DType::F32);
    assert_eq!(vals(&x.cumsum(1).unwrap()), vec![1.0, 3.0, 6.0, 4.0, 4.0, 10.0]);
    assert_eq!(vals(&x.cumsum(0).unwrap()), vec![1.0, 2.0, 3.0, 5.0, 2.0, 9.0]);
    assert_eq!(vals(&x.cumprod(-1).unwrap()), vec![1.0, 2.0, 6.0, 4.0, 0.0, 0.0]);
    let b = t(&[1.0, 0.0, 1.0], &[3], DType::Bool).cumsum(0).unwrap();
    assert_eq!((b.dtype(), vals(&b)), (DType::I64, vec![1.0, 1.0, 2.0]));
    let long: Vec<f64> = (0..37).map(|i| i as f64).collect();
    let c = t(&long, &[37], DType::F64).cumsum(0).unwrap();
    assert_eq!(vals(&c)[36], (0..37).sum::<i32>() as f64);
    let f = compile(|x: &Tensor| x.cumsum(1));
    assert_eq!(vals(&f.call(&x).unwrap()), vec![1.0, 3.0, 6.0, 4.0, 4.0, 10.0]);
}

#[test]
fn mm_bmm_addmm() {
    let a = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32);
    let b = t(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2], DType::F32);
    assert_eq!(vals(&a.mm(&b).unwrap()), vec![4.0, 5.0, 10.0, 11.0]);
    assert!(a.mm(&t(&[1.0, 2.0, 3.0], &[3], DType::F32)).unwrap_err().to_string().contains("mm"));
    let ab = a.unsqueeze(0).unwrap();
    assert_eq!(vals(&ab.bmm(&b.unsqueeze(0).unwrap()).unwrap()), vec![4.0, 5.0, 10.0, 11.0]);
    assert!(ab.bmm(&b).is_err());
    let bias = t(&[10.0, f64::NAN], &[2], DType::F32);
    let r = bias.addmm(&a, &b, 0.5, 2.0).unwrap();
    assert!(vals(&r)[1].is_nan());
    assert_eq!(vals(&r)[0], 13.0);
    // beta = 0 ignores the input, NaN included.
    assert_eq!(vals(&bias.addmm(&a, &b, 0.0, 1.0).unwrap()), vec![4.0, 5.0, 10.0, 11.0]);
}

#[test]
fn split_sizes_squeeze_dims_clamp_tensor() {
    let x = t(&(0..10).map(|v| v as f64).collect::<Vec<_>>(), &[1, 10, 1], DType::F32);
    let parts = x.split_sizes(&[3, 0, 7], 1).unwrap();
    assert_eq!(parts.iter().map(|p| p.shape()[1]).collect::<Vec<_>>(), vec![3, 0, 7]);
    assert_eq!(vals(&parts[2])[0], 3.0);
    assert!(x.split_sizes(&[3, 3], 1).unwrap_err().to_string().contains("split"));
    assert_eq!(x.squeeze_dims(&[0, -1]).unwrap().shape(), &[10]);
    assert_eq!(x.squeeze_dims(&[1]).unwrap().shape(), &[1, 10, 1]);
    let v = t(&[-2.0, 0.5, 3.0, f64::NAN], &[4], DType::F32);
    let lo = t(&[-1.0, 1.0, 0.0, 0.0], &[4], DType::F32);
    let hi = t(&[1.0], &[1], DType::F32);
    let c = vals(&v.clamp_tensor(Some(&lo), Some(&hi)).unwrap());
    assert_eq!(&c[..3], &[-1.0, 1.0, 1.0]);
    assert!(c[3].is_nan());
    assert!(vals(&v.clamp_tensor(Some(&t(&[f64::NAN], &[1], DType::F32)), None).unwrap()).iter().all(|x| x.is_nan()));
}

// ---------------------------------------------------------------- pooling, losses, attention

#[test]
fn avg_pool2d_matches_torch() {
    // torch: F.avg_pool2d(arange(16).view(1,1,4,4), 3, 2, 1, ceil_mode, count_include_pad)
    let x = t(&(0..16).map(|v| v as f64).collect::<Vec<_>>(), &[1, 1, 4, 4], DType::F32);
    let y = F::avg_pool2d(&x, (3, 3), (2, 2), (1, 1), false, true).unwrap();
    assert_close(&vals(&y), &[1.1111112, 2.6666667, 5.6666665, 10.0], 1e-6, 1e-6);
    let y = F::avg_pool2d(&x, (3, 3), (2, 2), (1, 1), false, false).unwrap();
    assert_close(&vals(&y), &[2.5, 4.0, 8.5, 10.0], 1e-6, 1e-6);
    let y = F::avg_pool2d(&x, (2, 2), (3, 3), (0, 0), true, true).unwrap();
    assert_eq!(y.shape(), &[1, 1, 2, 2]);
    assert_close(&vals(&y), &[2.5, 5.0, 12.5, 15.0], 1e-6, 1e-6);
    gradcheck(|xs| F::avg_pool2d(&xs[0], (3, 2), (2, 1), (1, 1), true, false), &[t(&host_rand(2 * 25, 5), &[1, 2, 5, 5], DType::F64)], GradcheckOptions::default()).unwrap();
}

#[test]
fn max_pool2d_ceil_dilation_and_indices() {
    let x = t(&(0..25).map(|v| ((v * 7) % 25) as f64).collect::<Vec<_>>(), &[1, 1, 5, 5], DType::F32);
    // torch: F.max_pool2d(x, 2, 2, ceil_mode=True, return_indices=True)
    let a = F::MaxPool2dArgs { ceil_mode: true, ..F::MaxPool2dArgs::new((2, 2), (2, 2), (0, 0)) };
    let (y, i) = F::max_pool2d_with_indices(&x, &a).unwrap();
    assert_eq!(y.shape(), &[1, 1, 3, 3]);
    assert_eq!(vals(&y), vec![17.0, 24.0, 13.0, 20.0, 19.0, 23.0, 22.0, 11.0, 18.0]);
    assert_eq!(vals(&i), vec![6.0, 7.0, 9.0, 10.0, 17.0, 14.0, 21.0, 23.0, 24.0]);
    // Dilation 2, kernel 2, stride 1: windows read every other element.
    let d = F::MaxPool2dArgs { dilation: (2, 2), ..F::MaxPool2dArgs::new((2, 2), (1, 1), (0, 0)) };
    let yd = F::max_pool2d_with(&x, &d).unwrap();
    assert_eq!(yd.shape(), &[1, 1, 3, 3]);
    assert_eq!(vals(&yd), vec![20.0, 21.0, 23.0, 24.0, 17.0, 24.0, 20.0, 22.0, 23.0]);
    let xd = t(&host_rand(2 * 36, 9), &[1, 2, 6, 6], DType::F64);
    gradcheck(|xs| F::max_pool2d_with(&xs[0], &F::MaxPool2dArgs { dilation: (2, 1), ceil_mode: true, ..F::MaxPool2dArgs::new((2, 3), (2, 2), (1, 1)) }), &[xd], GradcheckOptions::default()).unwrap();
}

#[test]
fn bce_with_logits_weight() {
    let z = t(&[0.5, -1.0, 2.0], &[3], DType::F64);
    let y = t(&[1.0, 0.0, 1.0], &[3], DType::F64);
    let w = t(&[2.0, 0.5, 0.0], &[3], DType::F64);
    // torch: F.binary_cross_entropy_with_logits(z, y, weight=w, reduction='none')
    let l = F::binary_cross_entropy_with_logits(&z, &y, Some(&w), None, F::Reduction::None).unwrap();
    assert_close(&vals(&l), &[0.9481539683602134, 0.1566308437591114, 0.0], 1e-12, 1e-12);
    gradcheck(|xs| F::binary_cross_entropy_with_logits(&xs[0], &xs[1], Some(&xs[2]), None, F::Reduction::Mean), &[z, y, w], GradcheckOptions::default()).unwrap();
}

#[test]
fn sdpa_three_dims_and_mask_gradient() {
    let q = t(&host_rand(2 * 3 * 4, 1), &[2, 3, 4], DType::F64);
    let k = t(&host_rand(2 * 5 * 4, 2), &[2, 5, 4], DType::F64);
    let v = t(&host_rand(2 * 5 * 4, 3), &[2, 5, 4], DType::F64);
    let o3 = F::scaled_dot_product_attention(&q, &k, &v, &Default::default()).unwrap();
    assert_eq!(o3.shape(), &[2, 3, 4]);
    let o4 = F::scaled_dot_product_attention(&q.unsqueeze(1).unwrap(), &k.unsqueeze(1).unwrap(), &v.unsqueeze(1).unwrap(), &Default::default()).unwrap();
    assert_close(&vals(&o3), &vals(&o4), 1e-12, 1e-12);
    // A float mask that requires grad gets its gradient.
    let m = t(&host_rand(3 * 5, 4), &[3, 5], DType::F64);
    gradcheck(
        |xs| F::scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &F::SdpaOptions { attn_mask: Some(&xs[3]), ..Default::default() }),
        &[q, k, v, m],
        GradcheckOptions::default(),
    )
    .unwrap();
}

#[test]
fn errors_name_the_op_the_user_called() {
    let x = t(&[1.0, 2.0], &[2], DType::F32);
    let e = F::softmax(&x, 3).unwrap_err().to_string();
    assert!(e.starts_with("softmax"), "{e}");
    let e = F::log_softmax(&x, -3).unwrap_err().to_string();
    assert!(e.starts_with("log_softmax"), "{e}");
    let e = x.std(&[4], 1.0, false).unwrap_err().to_string();
    assert!(e.starts_with("std"), "{e}");
    let e = t(&[1.0], &[1], DType::I64).std(&[], 1.0, false).unwrap_err().to_string();
    assert!(e.starts_with("std"), "{e}");
}

// ---------------------------------------------------------------- compiled functions

#[test]
fn compiled_writes_into_arguments_reach_them() {
    let f = compile(|x: &Tensor| {
        x.add_scalar_(1.0)?;
        x.mul_scalar(2.0)
    });
    let x = t(&[1.0, 2.0], &[2], DType::F32);
    for call in 1..=3 {
        let y = f.call(&x).unwrap();
        assert_eq!(vals(&x), vec![1.0 + call as f64, 2.0 + call as f64], "call {call}");
        assert_eq!(vals(&y), vec![2.0 * (1.0 + call as f64), 2.0 * (2.0 + call as f64)]);
    }
    // The same through eager code.
    let e = t(&[1.0, 2.0], &[2], DType::F32);
    e.add_scalar_(1.0).unwrap();
    assert_eq!(vals(&e), vec![2.0, 3.0]);
}

#[test]
fn a_panic_inside_a_compiled_function_leaves_the_thread_usable() {
    let bad = compile(|x: &Tensor| -> kiln::Result<Tensor> {
        let y = x.add_scalar(1.0)?;
        if y.shape()[0] == 2 {
            panic!("user code panicked while traced");
        }
        Ok(y)
    });
    let x = t(&[1.0, 2.0], &[2], DType::F32);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bad.call(&x)));
    assert!(caught.is_err());
    let good = compile(|x: &Tensor| x.mul_scalar(3.0));
    assert_eq!(vals(&good.call(&x).unwrap()), vec![3.0, 6.0]);
    // Eager ops run for real again.
    assert_eq!(vals(&x.add_scalar(1.0).unwrap()), vec![2.0, 3.0]);
}
