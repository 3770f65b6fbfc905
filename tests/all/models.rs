//! Models, optimiser state, initialisation and mixed precision: finite-difference gradients in
//! f64 for the new composites, PyTorch's init distributions, autocast's dtype policy,
//! GradScaler, training runs and bad input.

use crate::common::*;
use kiln::amp;
use kiln::optim::GradScaler;
use kiln::data::{DataLoader, SyntheticClassification};
use kiln::nn::{self, functional as F, AttnArgs, Module};
use kiln::optim::{Adam, AdamConfig, Optimizer, Sgd};
use kiln::prelude::*;
use kiln::{gradcheck, GradcheckOptions};

fn rand_t(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    t(&host_rand(shape.iter().product(), seed), shape, dt)
}

#[test]
fn conv2d_and_pooling_gradients_match_finite_differences() {
    let x = rand_t(&[2, 4, 5, 6], 1, DType::F64);
    let w = rand_t(&[6, 2, 3, 2], 2, DType::F64);
    let b = rand_t(&[6], 3, DType::F64);
    let args = F::Conv2dArgs { stride: (2, 1), padding: (1, 2), dilation: (1, 2), groups: 2 };
    gradcheck(|xs| F::conv2d(&xs[0], &xs[1], Some(&xs[2]), args), &[x.clone(), w, b], GradcheckOptions::default()).unwrap();
    // Distinct values so every window has one maximum (finite differences need that).
    gradcheck(|xs| F::max_pool2d(&xs[0], (3, 2), (2, 2), (1, 1)), std::slice::from_ref(&x), GradcheckOptions::default()).unwrap();
    gradcheck(|xs| F::adaptive_avg_pool2d(&xs[0], (3, 4)), std::slice::from_ref(&x), GradcheckOptions::default()).unwrap();
    let (wt, bt) = (rand_t(&[4], 4, DType::F64), rand_t(&[4], 5, DType::F64));
    gradcheck(|xs| F::batch_norm(&xs[0], None, None, Some(&xs[1]), Some(&xs[2]), true, 0.1, 1e-5), &[x, wt, bt], GradcheckOptions::default()).unwrap();
}

/// Direct loops in f64: y = conv(x, w), and for the output gradient `dy` the gradients of x and
/// w. Sizes: x [N, C, H, W], w [O, C / groups, KH, KW], y [N, O, OH, OW].
struct ConvRef {
    y: Vec<f64>,
    gx: Vec<f64>,
    gw: Vec<f64>,
}

fn conv_out_shape(xs: [usize; 4], ws: [usize; 4], a: F::Conv2dArgs) -> [usize; 4] {
    let len = |size: usize, k: usize, s: usize, p: usize, d: usize| (size + 2 * p - d * (k - 1) - 1) / s + 1;
    [xs[0], ws[0], len(xs[2], ws[2], a.stride.0, a.padding.0, a.dilation.0), len(xs[3], ws[3], a.stride.1, a.padding.1, a.dilation.1)]
}

fn conv_reference(x: &[f64], xs: [usize; 4], w: &[f64], ws: [usize; 4], a: F::Conv2dArgs, dy: &[f64]) -> ConvRef {
    let ys = conv_out_shape(xs, ws, a);
    let (og, cg) = (ws[0] / a.groups, ws[1]);
    let (mut y, mut gx, mut gw) = (vec![0.0; ys.iter().product()], vec![0.0; x.len()], vec![0.0; w.len()]);
    for n in 0..ys[0] {
        for o in 0..ys[1] {
            for oh in 0..ys[2] {
                for ow in 0..ys[3] {
                    let yi = ((n * ys[1] + o) * ys[2] + oh) * ys[3] + ow;
                    for ic in 0..cg {
                        let c = (o / og) * cg + ic;
                        for i in 0..ws[2] {
                            for j in 0..ws[3] {
                                let ih = (oh * a.stride.0 + i * a.dilation.0) as i64 - a.padding.0 as i64;
                                let iw = (ow * a.stride.1 + j * a.dilation.1) as i64 - a.padding.1 as i64;
                                if ih < 0 || iw < 0 || ih >= xs[2] as i64 || iw >= xs[3] as i64 {
                                    continue;
                                }
                                let xi = ((n * xs[1] + c) * xs[2] + ih as usize) * xs[3] + iw as usize;
                                let wi = ((o * cg + ic) * ws[2] + i) * ws[3] + j;
                                y[yi] += x[xi] * w[wi];
                                gx[xi] += dy[yi] * w[wi];
                                gw[wi] += dy[yi] * x[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    ConvRef { y, gx, gw }
}

/// Values rounded to `dt` (and back to f64).
fn rounded(v: &[f64], dt: DType) -> Vec<f64> {
    let t = Tensor::from_slice(v, &[v.len()], &Device::Cpu).unwrap();
    t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// y, dL/dx and dL/dw of conv2d on `d` in `dt`, for L = sum(y * dy).
// A convolution's inputs with their shapes, its arguments and the output gradient.
#[allow(clippy::too_many_arguments)]
fn conv_with_grads(d: &Device, dt: DType, x: &[f64], xs: [usize; 4], w: &[f64], ws: [usize; 4], a: F::Conv2dArgs, dy: &[f64]) -> [Vec<f64>; 3] {
    let on = |v: &[f64], s: &[usize]| Tensor::from_slice(v, s, &Device::Cpu).unwrap().to_dtype(dt).unwrap().to_device(d).unwrap();
    let (xt, wt) = (on(x, &xs).requires_grad(), on(w, &ws).requires_grad());
    let y = F::conv2d(&xt, &wt, None, a).unwrap();
    assert_eq!(y.dtype(), dt);
    let ys = conv_out_shape(xs, ws, a);
    assert_eq!(y.shape(), ys);
    y.backward_with(kiln::BackwardOptions { gradient: Some(on(dy, &ys)), ..Default::default() }).unwrap();
    [vals(&y), vals(&xt.grad().unwrap()), vals(&wt.grad().unwrap())]
}

/// max |a - b| <= tol * max(1, max |b|).
#[track_caller]
fn assert_close_to_scale(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    let (i, err) = a.iter().zip(b).map(|(x, y)| (x - y).abs()).enumerate().fold((0, 0.0f64), |m, (i, e)| if e > m.1 { (i, e) } else { m });
    assert!(err <= tol * scale, "{what}: element {i}: got {}, expected {} (|diff| {err:e} > {tol:e} * {scale})", a[i], b[i]);
}

/// The convolution cases the device paths are checked on: stride 2 (with a column the windows
/// never reach), padding, dilation 2, groups 2 and a depthwise convolution.
fn conv_cases() -> Vec<(&'static str, [usize; 4], [usize; 4], F::Conv2dArgs)> {
    let a = F::Conv2dArgs::default();
    vec![
        ("stride 2", [2, 3, 9, 8], [4, 3, 3, 3], F::Conv2dArgs { stride: (2, 2), ..a }),
        ("padding", [2, 3, 7, 6], [5, 3, 3, 2], F::Conv2dArgs { padding: (1, 2), ..a }),
        ("dilation 2", [2, 2, 9, 9], [3, 2, 3, 3], F::Conv2dArgs { dilation: (2, 2), padding: (2, 1), ..a }),
        ("groups 2", [2, 4, 7, 7], [6, 2, 3, 3], F::Conv2dArgs { groups: 2, stride: (1, 2), padding: (1, 1), ..a }),
        ("depthwise", [2, 6, 8, 8], [6, 1, 3, 3], F::Conv2dArgs { groups: 6, padding: (1, 1), ..a }),
        ("1x1 stride 2", [2, 4, 7, 7], [5, 4, 1, 1], F::Conv2dArgs { stride: (2, 2), ..a }),
    ]
}

/// The forward convolution and both gradients on the test device (cuDNN on CUDA) against the
/// CPU path (im2col + matmul) on the same inputs, which is itself checked against direct loops.
/// Tolerances, as max |diff| <= tol * max(1, max |expected|) per tensor:
/// - CPU F32 against f64 loops: 1e-5.
/// - F32 on the device: 1e-4 (TF32, which cuDNN must not use here, errs by about 5e-4).
/// - F16 / BF16 on the device, against the CPU path in F32 on the same rounded values: 5e-3 /
///   2e-2 (results are rounded to F16 / BF16, relative steps 2^-11 / 2^-8; accumulation is F32).
#[test]
fn conv2d_on_the_device_matches_the_cpu_path_in_f32_f16_and_bf16() {
    let d = dev();
    for (k, (name, xs, ws, a)) in conv_cases().into_iter().enumerate() {
        let ys = conv_out_shape(xs, ws, a);
        let x = host_rand(xs.iter().product(), 100 + k as u64);
        let w: Vec<f64> = host_rand(ws.iter().product(), 200 + k as u64).iter().map(|v| v * 0.5).collect();
        let dy = host_rand(ys.iter().product(), 300 + k as u64);
        for (dt, tol) in [(DType::F32, 1e-4), (DType::F16, 5e-3), (DType::BF16, 2e-2)] {
            let (x, w, dy) = (rounded(&x, dt), rounded(&w, dt), rounded(&dy, dt));
            let cpu = conv_with_grads(&Device::Cpu, DType::F32, &x, xs, &w, ws, a, &dy);
            let r = conv_reference(&x, xs, &w, ws, a, &dy);
            for (got, want, what) in [(&cpu[0], &r.y, "y"), (&cpu[1], &r.gx, "grad input"), (&cpu[2], &r.gw, "grad weight")] {
                assert_close_to_scale(got, want, 1e-5, &format!("{name}, CPU F32 vs loops: {what}"));
            }
            let got = conv_with_grads(&d, dt, &x, xs, &w, ws, a, &dy);
            for (i, what) in ["y", "grad input", "grad weight"].iter().enumerate() {
                assert_close_to_scale(&got[i], &cpu[i], tol, &format!("{name}, {d} {dt:?} vs CPU: {what}"));
            }
        }
    }
}

/// On CUDA the convolution and both gradients are cuDNN calls (the machine under test must have
/// cuDNN 9); on the CPU they are the im2col definition, whose parts the profiler shows.
#[test]
fn conv2d_runs_through_cudnn_on_cuda() {
    let d = dev();
    let x = rand_t(&[2, 4, 8, 8], 7, DType::F32).requires_grad();
    let w = rand_t(&[8, 4, 3, 3], 8, DType::F32).requires_grad();
    let args = F::Conv2dArgs { padding: (1, 1), ..Default::default() };
    // A first call picks cuDNN's algorithm (an algorithm that refuses would be a second call).
    no_grad(|| F::conv2d(&x, &w, None, args)).unwrap();
    let (y, fwd) = profiler::profile_value(|| F::conv2d(&x, &w, None, args)).unwrap();
    let bwd = profiler::profile(|| y.sum_all()?.backward()).unwrap();
    let (fwd, bwd) = (fwd.kernel_names(), bwd.kernel_names());
    if d.is_cuda() {
        let v = kiln::cuda::cudnn_version();
        assert!(v.as_ref().is_ok_and(|v| *v >= 90000), "cuDNN 9 is needed on the GPU under test: {v:?}");
        assert_eq!(fwd, ["cudnn_conv2d_fwd_float32"]);
        for name in ["cudnn_conv2d_bwd_data_float32", "cudnn_conv2d_bwd_filter_float32"] {
            assert!(bwd.contains(&name), "{bwd:?}");
        }
    } else {
        assert!(fwd.contains(&"matmul") && !fwd.iter().any(|n| n.starts_with("conv2d")), "{fwd:?}");
        assert!(bwd.contains(&"scatter_add") && bwd.contains(&"matmul"), "{bwd:?}");
    }
    // A channels-last input view (not contiguous NCHW) gives the same values, channels-last
    // (on CUDA through cuDNN's NHWC kernels, another summation order: F32 rtol 1e-5).
    let xv = vals(&x);
    let nhwc = t(&xv, &[2, 4, 8, 8], DType::F32).permute(&[0, 2, 3, 1]).unwrap().contiguous().unwrap().permute(&[0, 3, 1, 2]).unwrap();
    assert!(!nhwc.is_contiguous());
    let y2 = F::conv2d(&nhwc, &w.detach(), None, args).unwrap();
    assert!(y2.is_contiguous_for(MemoryFormat::ChannelsLast));
    assert_close(&vals(&y2), &vals(&y), 1e-5, 1e-6);
}

/// The convolution primitive and its two gradient products against finite differences, in F64 on
/// the CPU, with stride, padding, dilation, groups and a bias.
#[test]
fn conv2d_gradcheck_in_f64_on_the_cpu() {
    let cpu = Device::Cpu;
    let r = |shape: &[usize], seed| Tensor::from_vec(host_rand(shape.iter().product(), seed), shape, &cpu).unwrap();
    for (xs, ws, a) in [
        ([2, 4, 6, 5], [6, 2, 3, 2], F::Conv2dArgs { stride: (2, 1), padding: (1, 2), dilation: (1, 2), groups: 2 }),
        ([1, 3, 5, 5], [3, 1, 3, 3], F::Conv2dArgs { stride: (1, 2), padding: (1, 1), dilation: (2, 1), groups: 3 }),
    ] {
        let (x, w, b) = (r(&xs, 11), r(&ws, 12), r(&[ws[0]], 13));
        gradcheck(|v| F::conv2d(&v[0], &v[1], Some(&v[2]), a), &[x, w, b], GradcheckOptions::default()).unwrap();
    }
}

#[test]
fn max_pool_sends_the_gradient_to_the_first_maximum_like_pytorch() {
    // A window of equal values (as after a ReLU): PyTorch's gradient goes to the first.
    let x = t(&[0.0, 0.0, 0.0, 0.0], &[1, 1, 2, 2], DType::F32).requires_grad();
    let y = F::max_pool2d(&x, (2, 2), (2, 2), (0, 0)).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(&x.grad().unwrap()), [1.0, 0.0, 0.0, 0.0]);
}

#[test]
fn attention_gradients_match_finite_differences_with_masks() {
    let d = dev();
    manual_seed(4);
    let mut m = nn::MultiheadAttention::with_options(4, 2, 0.0, true, true, &d).unwrap();
    m.to_dtype(DType::F64).unwrap();
    let kpm = Tensor::from_vec(vec![false, false, true, false, true, false], &[2, 3], &d).unwrap();
    let am = t(&host_rand(6, 9), &[2, 3], DType::F64);
    let (q, k, v) = (rand_t(&[2, 2, 4], 6, DType::F64), rand_t(&[2, 3, 4], 7, DType::F64), rand_t(&[2, 3, 4], 8, DType::F64));
    let args = AttnArgs { key_padding_mask: Some(&kpm), attn_mask: Some(&am), need_weights: false, ..Default::default() };
    gradcheck(|xs| Ok(m.attend(&xs[0], &xs[1], &xs[2], args)?.0), &[q, k, v], GradcheckOptions::default()).unwrap();
}

#[test]
fn attention_dropout_acts_in_training_only_and_weights_average_over_heads() {
    let d = dev();
    manual_seed(2);
    let m = nn::MultiheadAttention::with_options(8, 2, 0.5, true, false, &d).unwrap();
    let x = Tensor::randn(&[5, 3, 8], DType::F32, &d).unwrap();
    let full = AttnArgs { average_attn_weights: false, ..Default::default() };
    let (_, w_train) = m.attend(&x, &x, &x, full).unwrap();
    let zeros = vals(&w_train.unwrap()).iter().filter(|&&v| v == 0.0).count();
    assert!(zeros > 0, "dropout zeroes some weights in training");
    m.eval();
    let (o1, w) = m.attend(&x, &x, &x, full).unwrap();
    let (o2, avg) = m.attend(&x, &x, &x, AttnArgs::default()).unwrap();
    let (w, avg) = (w.unwrap(), avg.unwrap());
    assert_eq!((w.shape(), avg.shape()), (&[3usize, 2, 5, 5][..], &[3usize, 5, 5][..]));
    assert_close(&vals(&avg), &vals(&w.mean(&[1], false).unwrap()), 1e-6, 1e-7);
    assert_close(&vals(&w.sum(&[-1], false).unwrap()), &[1.0; 30], 1e-5, 1e-6);
    assert_eq!(vals(&o1), vals(&o2));
    // The Module form is self-attention without weights (the fused kernel: same values up to
    // F32 summation order); unbatched input keeps its rank.
    assert_close(&vals(&m.forward(&x).unwrap()), &vals(&o1), 1e-5, 1e-6);
    let single = x.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    let (o, w) = m.attend(&single, &single, &single, AttnArgs::default()).unwrap();
    assert_eq!((o.shape(), w.unwrap().shape()), (&[5usize, 8][..], &[5usize, 5][..]));
    assert_close(&vals(&o), &vals(&o1.narrow(1, 0, 1).unwrap()), 1e-5, 1e-6);
}

#[test]
fn square_subsequent_mask_and_transformer_defaults() {
    let m = nn::Transformer::generate_square_subsequent_mask(3, &dev()).unwrap();
    let inf = f64::NEG_INFINITY;
    assert_eq!(vals(&m), [0.0, inf, inf, 0.0, 0.0, inf, 0.0, 0.0, 0.0]);
    let c = nn::TransformerConfig::default();
    assert_eq!((c.d_model, c.nhead, c.num_encoder_layers, c.num_decoder_layers, c.dim_feedforward), (512, 8, 6, 6, 2048));
    assert_eq!((c.dropout, c.layer_norm_eps, c.activation, c.norm_first, c.batch_first), (0.1, 1e-5, nn::Activation::Relu, false, false));
    // API.md's construction, scaled down in layers to keep the test quick.
    let tr = nn::Transformer::new(nn::TransformerConfig { d_model: 512, nhead: 8, num_encoder_layers: 1, num_decoder_layers: 1, ..Default::default() }, &dev()).unwrap();
    let names: Vec<String> = tr.named_parameters().into_iter().map(|(n, _)| n).collect();
    for n in ["encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.0.linear1.weight", "encoder.norm.weight", "decoder.layers.0.multihead_attn.out_proj.bias", "decoder.layers.0.norm3.bias", "decoder.norm.bias"] {
        assert!(names.iter().any(|m| m == n), "{n} missing from {names:?}");
    }
    assert_eq!(tr.named_parameters().iter().find(|(n, _)| n == "encoder.layers.0.linear1.weight").unwrap().1.shape(), [2048, 512]);
}

#[test]
fn encoder_layers_start_as_copies_and_dropout_follows_the_mode() {
    let d = dev();
    manual_seed(8);
    let cfg = nn::TransformerConfig { d_model: 8, nhead: 2, dim_feedforward: 16, dropout: 0.5, ..Default::default() };
    let enc = nn::TransformerEncoder::new(nn::TransformerEncoderLayer::new(&cfg, &d).unwrap(), 3, None, &d).unwrap();
    let p = enc.named_parameters();
    let first = |i: usize| vals(&p.iter().find(|(n, _)| *n == format!("layers.{i}.linear1.weight")).unwrap().1);
    assert_eq!(first(0), first(2), "deep copies, as PyTorch's _get_clones");
    let x = Tensor::randn(&[4, 2, 8], DType::F32, &d).unwrap();
    let (a, b) = (vals(&enc.forward(&x).unwrap()), vals(&enc.forward(&x).unwrap()));
    assert_ne!(a, b, "dropout draws differ in training");
    enc.eval();
    assert_eq!(vals(&enc.forward(&x).unwrap()), vals(&enc.forward(&x).unwrap()));
}

/// Max |v| and the sample standard deviation.
fn spread(t: &Tensor) -> (f64, f64) {
    let v = vals(t);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    (v.iter().fold(0.0f64, |m, x| m.max(x.abs())), var.sqrt())
}

#[test]
fn default_initialisations_follow_pytorch() {
    let d = dev();
    manual_seed(11);
    // Uniform in ±b has std b/sqrt(3); 10k+ samples put the estimate within a few percent.
    let uniform_ok = |t: &Tensor, bound: f64| {
        let (max, std) = spread(t);
        assert!(max <= bound && max > 0.98 * bound, "max {max} for bound {bound}");
        assert!((std / (bound / 3f64.sqrt()) - 1.0).abs() < 0.05, "std {std} for bound {bound}");
    };
    let conv = nn::Conv2d::with_options(16, 32, (3, 3), nn::Conv2dArgs { groups: 2, ..Default::default() }, true, &d).unwrap();
    uniform_ok(&conv.weight, 1.0 / (8.0f64 * 9.0).sqrt());
    assert!(spread(conv.bias.as_ref().unwrap()).0 <= 1.0 / 72f64.sqrt());
    let lin = nn::Linear::new(300, 200, &d).unwrap();
    uniform_ok(&lin.weight, 1.0 / 300f64.sqrt());
    let mha = nn::MultiheadAttention::new(64, 4, &d).unwrap();
    uniform_ok(&mha.in_proj_weight, (6.0 / (64.0 + 192.0f64)).sqrt());
    assert!(vals(mha.in_proj_bias.as_ref().unwrap()).iter().all(|&v| v == 0.0));
    assert!(vals(mha.out_proj.bias.as_ref().unwrap()).iter().all(|&v| v == 0.0));
    uniform_ok(&mha.out_proj.weight, 1.0 / 8.0);
    let emb = nn::Embedding::new(100, 100, &d).unwrap();
    let (_, std) = spread(&emb.weight);
    assert!((std - 1.0).abs() < 0.03, "Embedding is standard normal: std {std}");
    let bn = nn::BatchNorm2d::new(4, &d).unwrap();
    assert_eq!((vals(&bn.weight), vals(&bn.bias), vals(&bn.running_var)), (vec![1.0; 4], vec![0.0; 4], vec![1.0; 4]));
    // torchvision's ResNet convs: kaiming normal, fan_out, gain sqrt(2).
    let blk = nn::Bottleneck::new(256, 64, 1, &d).unwrap();
    let (_, std) = spread(&blk.conv2.weight);
    assert!((std / (2.0 / (64.0 * 9.0f64)).sqrt() - 1.0).abs() < 0.05, "conv2 std {std}");
    // Seeded: the same seed gives the same model.
    manual_seed(3);
    let a = nn::Linear::new(5, 4, &d).unwrap();
    manual_seed(3);
    let b = nn::Linear::new(5, 4, &d).unwrap();
    assert_eq!(vals(&a.weight), vals(&b.weight));
}

#[test]
fn resnet50_classifies_a_small_batch() {
    let d = dev();
    manual_seed(0);
    let model = nn::resnet50(10, &d).unwrap();
    model.eval();
    let x = Tensor::randn(&[1, 3, 32, 32], DType::F32, &d).unwrap();
    let y = no_grad(|| model.forward(&x)).unwrap();
    assert_eq!(y.shape(), [1, 10]);
    assert!(vals(&y).iter().all(|v| v.is_finite()));
    assert_eq!(model.parameters().len(), 161);
}

#[test]
fn bad_model_inputs_are_clear_errors() {
    let d = dev();
    let x = Tensor::randn(&[2, 4, 5, 5], DType::F32, &d).unwrap();
    let w = Tensor::randn(&[6, 4, 3, 3], DType::F32, &d).unwrap();
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    let e = err(F::conv2d(&x, &Tensor::randn(&[6, 3, 3, 3], DType::F32, &d).unwrap(), None, Default::default()));
    assert!(e.contains("conv2d") && e.contains("[2, 4, 5, 5]") && e.contains("[6, 3, 3, 3]"), "{e}");
    let e = err(F::conv2d(&x.reshape(&[2, 100]).unwrap(), &w, None, Default::default()));
    assert!(e.contains("4-D"), "{e}");
    let e = err(F::conv2d(&x, &w.to_dtype(DType::F64).unwrap(), None, Default::default()));
    assert!(e.contains("conv2d") && e.contains("F64"), "{e}");
    let e = err(F::conv2d(&x, &w, Some(&Tensor::zeros(&[5], DType::F32, &d).unwrap()), Default::default()));
    assert!(e.contains("bias") && e.contains("[5]"), "{e}");
    let e = err(F::conv2d(&x, &Tensor::randn(&[6, 4, 7, 7], DType::F32, &d).unwrap(), None, Default::default()));
    assert!(e.contains("smaller than the (dilated) kernel"), "{e}");
    let e = err(F::conv2d(&x, &w, None, F::Conv2dArgs { stride: (0, 1), ..Default::default() }));
    assert!(e.contains("stride"), "{e}");
    assert!(nn::Conv2d::with_options(4, 6, (3, 3), F::Conv2dArgs { groups: 4, ..Default::default() }, true, &d).is_err());
    let e = err(F::max_pool2d(&x, (2, 2), (2, 2), (2, 2)));
    assert!(e.contains("half the kernel"), "{e}");
    let e = err(nn::BatchNorm2d::new(4, &d).unwrap().forward(&Tensor::randn(&[1, 4, 1, 1], DType::F32, &d).unwrap()));
    assert!(e.contains("more than 1 value per channel"), "{e}");
    let e = err(nn::BatchNorm2d::new(3, &d).unwrap().forward(&x));
    assert!(e.contains("running_mean") && e.contains("[3]"), "{e}");

    let m = nn::MultiheadAttention::new(8, 2, &d).unwrap();
    assert!(nn::MultiheadAttention::new(8, 3, &d).err().unwrap().to_string().contains("multiple of num_heads"));
    let q = Tensor::randn(&[3, 2, 8], DType::F32, &d).unwrap();
    let e = m.attend(&q, &Tensor::randn(&[4, 2, 6], DType::F32, &d).unwrap(), &q, AttnArgs::default()).unwrap_err().to_string();
    assert!(e.contains("embed_dim 8"), "{e}");
    let bad = Tensor::zeros(&[2, 2], DType::Bool, &d).unwrap();
    let e = m.attend(&q, &q, &q, AttnArgs { attn_mask: Some(&bad), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("attn_mask of shape [2, 2]"), "{e}");
    let int_mask = Tensor::zeros(&[2, 3], DType::I64, &d).unwrap();
    let e = m.attend(&q, &q, &q, AttnArgs { key_padding_mask: Some(&int_mask), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("key_padding_mask must be bool or floating point"), "{e}");

    let cfg = nn::TransformerConfig { d_model: 8, nhead: 2, num_encoder_layers: 1, num_decoder_layers: 1, dim_feedforward: 8, ..Default::default() };
    let tr = nn::Transformer::new(cfg, &d).unwrap();
    let e = tr.forward_src_tgt(&q, &Tensor::randn(&[3, 5, 8], DType::F32, &d).unwrap(), &Default::default()).unwrap_err().to_string();
    assert!(e.contains("same batch size"), "{e}");
    assert!(tr.forward(&q).unwrap_err().to_string().contains("forward_src_tgt"));
}

#[test]
fn optimiser_state_round_trips_through_a_file_and_resumes_bit_exactly() {
    let d = dev();
    let path = std::env::temp_dir().join(format!("kiln-{}-adam-state.safetensors", std::process::id())).to_string_lossy().into_owned();
    let grads = |i: usize| rand_t(&[3, 2], 100 + i as u64, DType::F32);
    let run = |opt: &mut dyn Optimizer, p: &Tensor, from: usize, to: usize| {
        for i in from..to {
            p.set_grad(Some(grads(i))).unwrap();
            opt.step().unwrap();
        }
    };
    let cfg = AdamConfig { lr: 0.05, ..Default::default() };
    let p = rand_t(&[3, 2], 1, DType::F32).requires_grad();
    let mut a = Adam::new(vec![p.clone()], cfg);
    run(&mut a, &p, 0, 3);
    nn::safetensors::save(&a.state_dict().unwrap(), &path).unwrap();
    let q = p.detach().copy_contiguous().unwrap().requires_grad();
    let mut b = Adam::new(vec![q.clone()], AdamConfig::default());
    b.load_state_dict(&nn::safetensors::load(&path, &d).unwrap()).unwrap();
    assert_eq!(b.lr(), 0.05, "hyperparameters restored");
    run(&mut a, &p, 3, 6);
    run(&mut b, &q, 3, 6);
    assert_eq!(vals(&p), vals(&q), "resumed optimiser continues bit-exactly");
    assert_eq!(b.state()[0].as_ref().unwrap().step, 6);

    // SGD's momentum buffers, and errors naming what does not fit.
    let mut s = Sgd::new(vec![p.clone()], 0.1).momentum(0.9);
    run(&mut s, &p, 0, 1);
    let sd = s.state_dict().unwrap();
    assert!(sd.iter().any(|(n, _)| n == "state.0.momentum_buffer"));
    let other = Tensor::zeros(&[4], DType::F32, &d).unwrap().requires_grad();
    let e = Sgd::new(vec![other], 0.1).load_state_dict(&sd).unwrap_err().to_string();
    assert!(e.contains("state.0.momentum_buffer has shape [3, 2], parameter 0 has [4]"), "{e}");
    let e = Sgd::new(vec![p.clone()], 0.1).load_state_dict(&a.state_dict().unwrap()).unwrap_err().to_string();
    assert!(e.contains("missing param_groups.0.momentum"), "{e}");
    let e = Adam::new(vec![], cfg).load_state_dict(&a.state_dict().unwrap()).unwrap_err().to_string();
    assert!(e.contains("unexpected keys") && e.contains("state.0.exp_avg"), "{e}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn autocast_follows_pytorchs_op_policy() {
    let d = dev();
    let a = Tensor::randn(&[4, 8], DType::F32, &d).unwrap();
    let w = Tensor::randn(&[3, 8], DType::F32, &d).unwrap();
    let y = Tensor::from_vec(vec![0i64, 2, 1, 0], &[4], &Device::Cpu).unwrap().to_device(&d).unwrap();
    for low in [DType::F16, DType::BF16] {
        amp::autocast(&d, low, || {
            assert_eq!(amp::autocast_dtype(&d), Some(low));
            assert_eq!(a.matmul(&w.t()?)?.dtype(), low);
            let lin = F::linear(&a, &w, Some(&Tensor::zeros(&[3], DType::F32, &d)?))?;
            assert_eq!(lin.dtype(), low, "bias included, like one autocast op");
            let bias = Tensor::zeros(&[3], DType::F32, &d)?;
            assert_eq!(bias.addmm(&a, &w.t()?, 1.0, 1.0)?.dtype(), low, "addmm casts its input too");
            let img = Tensor::randn(&[1, 2, 4, 4], DType::F32, &d)?;
            assert_eq!(F::conv2d(&img, &Tensor::randn(&[3, 2, 3, 3], DType::F32, &d)?, None, Default::default())?.dtype(), low);
            for out in [lin.softmax(-1)?, lin.log_softmax(-1)?, F::layer_norm(&lin, &[3], None, None, 1e-5)?, F::cross_entropy(&lin, &y)?, lin.sum_all()?, lin.mean(&[0], false)?, F::mse_loss(&lin, &lin, F::Reduction::Mean)?] {
                assert_eq!(out.dtype(), DType::F32);
            }
            assert_eq!(lin.relu()?.dtype(), low, "other ops run in their input's dtype");
            assert_eq!(amp::suspended(|| a.matmul(&w.t().unwrap()).unwrap().dtype()), DType::F32);
            Ok(())
        })
        .unwrap();
    }
    // F64 is not cast (PyTorch's eligibility rule).
    let a64 = a.to_dtype(DType::F64).unwrap();
    let dt = amp::autocast(&d, DType::F16, || Ok(a64.matmul(&a64.t()?)?.dtype())).unwrap();
    assert_eq!(dt, DType::F64);
    assert_eq!(amp::autocast_dtype(&d), None, "restored after the closure");
    assert_eq!(a.matmul(&w.t().unwrap()).unwrap().dtype(), DType::F32);
    // Autocast for another device type leaves these tensors alone.
    let other = if d.is_cuda() { Device::Cpu } else { Device::Cuda(0) };
    let dt = amp::autocast(&other, DType::F16, || Ok(a.matmul(&w.t()?)?.dtype())).unwrap();
    assert_eq!(dt, DType::F32);
    assert!(amp::autocast(&d, DType::F32, || Ok(())).unwrap_err().to_string().contains("F16 or BF16"));

    // Gradients of F32 parameters stay F32 and match the F32 computation to F16 precision.
    let wg = w.detach().requires_grad();
    let loss = amp::autocast(&d, DType::F16, || F::cross_entropy(&F::linear(&a, &wg, None)?, &y)).unwrap();
    loss.backward().unwrap();
    let g16 = wg.grad().unwrap();
    assert_eq!(g16.dtype(), DType::F32);
    let w32 = w.detach().requires_grad();
    F::cross_entropy(&F::linear(&a, &w32, None).unwrap(), &y).unwrap().backward().unwrap();
    assert_close(&vals(&g16), &vals(&w32.grad().unwrap()), 1e-2, 2e-3);
}

#[test]
fn grad_scaler_skips_non_finite_steps_and_adjusts_its_scale() {
    let p = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
    let mut opt = Sgd::new(vec![p.clone()], 0.5);
    let mut scaler = GradScaler::with_options(1024.0, 2.0, 0.5, 2);
    assert_eq!(GradScaler::new().get_scale(), 65536.0);
    assert!(scaler.update().unwrap_err().to_string().contains("step() (or unscale_) first"));
    let step = |scaler: &mut GradScaler, opt: &mut Sgd, bad: bool| {
        let loss = p.mul_scalar(3.0).unwrap().sum_all().unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap();
        if bad {
            p.grad().unwrap().fill_(f64::INFINITY).unwrap();
        }
        scaler.step(opt).unwrap();
        scaler.update().unwrap();
        opt.zero_grad();
    };
    step(&mut scaler, &mut opt, false);
    assert_close(&vals(&p), &[-0.5, 0.5], 1e-6, 0.0);
    assert_eq!(scaler.get_scale(), 1024.0);
    step(&mut scaler, &mut opt, false);
    assert_eq!(scaler.get_scale(), 2048.0, "grows after growth_interval clean steps");
    step(&mut scaler, &mut opt, true);
    assert_close(&vals(&p), &[-2.0, -1.0], 1e-6, 0.0);
    assert_eq!(scaler.get_scale(), 1024.0, "backs off on overflow");
    // NaN also skips.
    let loss = p.mul_scalar(f64::NAN).unwrap().sum_all().unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
    scaler.step(&mut opt).unwrap();
    assert!(scaler.step_was_skipped());
    scaler.update().unwrap();
    assert_close(&vals(&p), &[-2.0, -1.0], 1e-6, 0.0);
    // Two optimisers: each is unscaled once; an overflow in one skips only that one's step
    // but backs off the shared scale.
    opt.zero_grad();
    let q = t(&[1.0], &[1], DType::F32).requires_grad();
    let mut opt_q = Sgd::new(vec![q.clone()], 1.0);
    let before = scaler.get_scale();
    let loss = p.sum_all().unwrap().add(&q.sum_all().unwrap()).unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
    q.grad().unwrap().fill_(f64::NAN).unwrap();
    scaler.unscale_(&opt).unwrap();
    assert!(scaler.unscale_(&opt).unwrap_err().to_string().contains("already called for this optimiser"));
    scaler.step(&mut opt).unwrap();
    assert!(!scaler.step_was_skipped());
    scaler.step(&mut opt_q).unwrap();
    assert!(scaler.step_was_skipped());
    scaler.update().unwrap();
    assert_close(&vals(&p), &[-2.5, -1.5], 1e-6, 0.0);
    assert_eq!((vals(&q), scaler.get_scale()), (vec![1.0], before * 0.5));
    opt.zero_grad();
    opt_q.zero_grad();
    let mut restored = GradScaler::new();
    restored.load_state_dict(&scaler.state_dict().unwrap()).unwrap();
    assert_eq!((restored.get_scale(), restored.growth_interval), (256.0, 2));
}

/// The 784-256-10 MLP trained for 400 steps of batch 32 (SGD lr 0.1) on the synthetic task,
/// in F32 or under F16 autocast with a GradScaler; held-out accuracy.
fn train_mlp(d: &Device, f16: bool) -> f32 {
    manual_seed(0);
    let loader = DataLoader::new(SyntheticClassification::mnist_like(32 * 400, 0).unwrap(), 32).unwrap().shuffle(0).drop_last(true);
    let model = nn::Sequential::new().add(nn::Linear::new(784, 256, d).unwrap()).add(nn::ReLU).add(nn::Linear::new(256, 10, d).unwrap());
    let mut opt = Sgd::new(model.parameters(), 0.1);
    let mut scaler = GradScaler::new();
    for batch in loader.iter() {
        let (x, y) = batch.unwrap();
        let (x, y) = (x.to_device(d).unwrap(), y.to_device(d).unwrap());
        let forward = || F::cross_entropy(&model.forward(&x)?, &y);
        let loss = if f16 { amp::autocast(d, DType::F16, forward) } else { forward() }.unwrap();
        assert_eq!(loss.dtype(), DType::F32);
        scaler.scale(&loss).unwrap().backward().unwrap();
        scaler.step(&mut opt).unwrap();
        assert!(!scaler.step_was_skipped(), "no overflow expected at this scale");
        scaler.update().unwrap();
        opt.zero_grad();
    }
    assert!(model.parameters().iter().all(|p| p.dtype() == DType::F32));
    let test = DataLoader::new(SyntheticClassification::mnist_like(1024, 1).unwrap(), 1024).unwrap();
    let (x, y) = test.iter().next().unwrap().unwrap();
    let (x, y) = (x.to_device(d).unwrap(), y.to_device(d).unwrap());
    no_grad(|| model.forward(&x).unwrap().argmax(1, false).unwrap().eq(&y).unwrap().to_dtype(DType::F32).unwrap().mean_all().unwrap().item::<f32>().unwrap())
}

#[test]
fn the_mlp_learns_the_synthetic_task_in_f32_and_under_f16_autocast() {
    let d = dev();
    let (full, half) = (train_mlp(&d, false), train_mlp(&d, true));
    // Chance is 0.1; 400 steps reach about 0.63 in both.
    assert!(full >= 0.55 && half >= 0.55, "held-out accuracy: F32 {full}, F16 autocast {half}");
    assert!((full - half).abs() < 0.05, "autocast converges like F32: {full} vs {half}");
}

#[test]
fn checkpoints_with_running_statistics_round_trip_bit_exactly() {
    let d = dev();
    let path = std::env::temp_dir().join(format!("kiln-{}-bottleneck.safetensors", std::process::id())).to_string_lossy().into_owned();
    manual_seed(21);
    let a = nn::Bottleneck::new(32, 8, 2, &d).unwrap();
    a.forward(&Tensor::randn(&[2, 32, 6, 6], DType::F32, &d).unwrap()).unwrap();
    a.save_safetensors(&path).unwrap();
    let b = nn::Bottleneck::new(32, 8, 2, &d).unwrap();
    b.load_safetensors(&path).unwrap();
    let (sa, sb) = (a.state_dict(), b.state_dict());
    assert_eq!(sa.len(), sb.len());
    for ((na, ta), (nb, tb)) in sa.iter().zip(&sb) {
        assert_eq!((na, ta.dtype()), (nb, tb.dtype()));
        assert_eq!(vals(ta), vals(tb), "{na} bit-exact");
    }
    assert_eq!(b.bn1.num_batches_tracked.item::<i64>().unwrap(), 1);
    b.eval();
    a.eval();
    let x = Tensor::randn(&[1, 32, 6, 6], DType::F32, &d).unwrap();
    assert_eq!(vals(&a.forward(&x).unwrap()), vals(&b.forward(&x).unwrap()));
    // Another width: every mismatching tensor is named with both shapes.
    let e = nn::Bottleneck::new(32, 4, 2, &d).unwrap().load_safetensors(&path).unwrap_err().to_string();
    assert!(e.contains("conv1.weight: shape [8, 32, 1, 1] in the state dict, [4, 32, 1, 1] in the module") && e.contains("bn2.running_var"), "{e}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn batch_first_transformers_and_cumulative_batch_norm() {
    let d = dev();
    let cfg = nn::TransformerConfig { d_model: 8, nhead: 2, num_encoder_layers: 1, num_decoder_layers: 1, dim_feedforward: 16, dropout: 0.0, ..Default::default() };
    let seq = nn::Transformer::new(cfg, &d).unwrap();
    let bf = nn::Transformer::new(nn::TransformerConfig { batch_first: true, ..cfg }, &d).unwrap();
    bf.load_state_dict(&seq.state_dict()).unwrap();
    let (src, tgt) = (Tensor::randn(&[5, 2, 8], DType::F32, &d).unwrap(), Tensor::randn(&[3, 2, 8], DType::F32, &d).unwrap());
    let a = seq.forward_src_tgt(&src, &tgt, &Default::default()).unwrap();
    let b = bf.forward_src_tgt(&src.transpose(0, 1).unwrap(), &tgt.transpose(0, 1).unwrap(), &Default::default()).unwrap();
    assert_eq!(b.shape(), [2, 3, 8]);
    assert_close(&vals(&b.transpose(0, 1).unwrap()), &vals(&a), 1e-5, 1e-6);

    // momentum None: running statistics are the plain average over batches.
    let bn = nn::BatchNorm2d::with_options(1, 1e-5, None, &d).unwrap();
    for v in [1.0, 3.0] {
        bn.forward(&t(&[v, v + 2.0], &[2, 1, 1, 1], DType::F32)).unwrap();
    }
    // Factor 1/batches: the first batch replaces the initial values. Means 2 and 4 -> 3;
    // unbiased variances 2 and 2 -> 2.
    assert_close(&vals(&bn.running_mean), &[3.0], 1e-6, 1e-6);
    assert_close(&vals(&bn.running_var), &[2.0], 1e-6, 1e-6);
}

#[test]
fn transformer_and_resnet_run_under_bf16_autocast_close_to_f32() {
    let d = dev();
    manual_seed(5);
    let cfg = nn::TransformerConfig { d_model: 16, nhead: 2, num_encoder_layers: 1, num_decoder_layers: 1, dim_feedforward: 32, dropout: 0.0, ..Default::default() };
    let tr = nn::Transformer::new(cfg, &d).unwrap();
    let xs = Tensor::randn(&[4, 2, 16], DType::F32, &d).unwrap();
    let full = no_grad(|| tr.forward_src_tgt(&xs, &xs, &Default::default())).unwrap();
    let low = amp::autocast(&d, DType::BF16, || no_grad(|| tr.forward_src_tgt(&xs, &xs, &Default::default()))).unwrap();
    // The last op is a layer norm: F32 under autocast. BF16 keeps ~3 significant digits.
    assert_eq!(low.dtype(), DType::F32);
    assert_close(&vals(&low), &vals(&full), 5e-2, 5e-2);

    let rn = nn::resnet50(10, &d).unwrap();
    rn.eval();
    let x = Tensor::randn(&[2, 3, 32, 32], DType::F32, &d).unwrap();
    let full = no_grad(|| rn.forward(&x)).unwrap();
    let low = amp::autocast(&d, DType::BF16, || no_grad(|| rn.forward(&x))).unwrap();
    assert_eq!(low.dtype(), DType::BF16, "fc is a linear: BF16 under autocast");
    let (a, b) = (vals(&low), vals(&full));
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 0.05 * scale), "{a:?} vs {b:?}");
}

#[test]
fn inputs_on_another_device_name_the_op_and_both_devices() {
    let Some(g) = Some(dev()).filter(|d| d.is_cuda()) else { return };
    let x = Tensor::randn(&[1, 2, 4, 4], DType::F32, &g).unwrap();
    let w = Tensor::randn(&[3, 2, 3, 3], DType::F32, &Device::Cpu).unwrap();
    let e = F::conv2d(&x, &w, None, Default::default()).unwrap_err();
    assert!(matches!(e, kiln::Error::DeviceMismatch { op: "conv2d", .. }), "{e}");
    let bn = nn::BatchNorm2d::new(2, &Device::Cpu).unwrap();
    assert!(matches!(bn.forward(&x).unwrap_err(), kiln::Error::DeviceMismatch { op: "batch_norm", .. }));
    let m = nn::MultiheadAttention::new(4, 2, &Device::Cpu).unwrap();
    let q = Tensor::randn(&[3, 1, 4], DType::F32, &g).unwrap();
    assert!(matches!(m.attend(&q, &q, &q, AttnArgs::default()).unwrap_err(), kiln::Error::DeviceMismatch { op: "multi_head_attention", .. }));
}

#[test]
fn max_pool_matches_its_window_search_definition() {
    // The primitive (one kernel each way) against the composition `return_indices` keeps:
    // stacked windows, argmax, gather. Inputs with ties (values on a grid of 0.5, as after a
    // ReLU), a NaN and -inf, read through a transposed view; every option; the gradient of a sum
    // of integers is exact in every dtype, so values and gradients must be equal.
    let d = dev();
    let cases = [
        F::MaxPool2dArgs::new((3, 3), (2, 2), (1, 1)),
        F::MaxPool2dArgs::new((3, 2), (1, 2), (1, 0)),
        F::MaxPool2dArgs::new((2, 2), (2, 2), (0, 0)),
        F::MaxPool2dArgs::new((1, 1), (2, 1), (0, 0)),
        F::MaxPool2dArgs { dilation: (2, 1), ceil_mode: true, ..F::MaxPool2dArgs::new((2, 3), (2, 2), (1, 1)) },
        F::MaxPool2dArgs { ceil_mode: true, ..F::MaxPool2dArgs::new((3, 3), (2, 2), (0, 1)) },
    ];
    let mut grid: Vec<f64> = host_rand(2 * 3 * 9 * 8, 11).iter().map(|v| (v * 4.0).round() / 2.0).collect();
    grid[5] = f64::NAN;
    grid[40] = f64::NEG_INFINITY;
    for a in cases {
        for dt in [DType::F32, DType::BF16, DType::F64] {
            // [2, 3, 9, 8] stored as [2, 3, 8, 9]: the kernels read it through its strides.
            let x = Tensor::from_vec(grid.clone(), &[2, 3, 8, 9], &Device::Cpu).unwrap().to_device(&d).unwrap().to_dtype(dt).unwrap().transpose(2, 3).unwrap();
            let what = format!("{a:?} {dt:?}");
            let fast = F::max_pool2d_with(&x, &a).unwrap();
            let (slow, _) = F::max_pool2d_with_indices(&x, &a).unwrap();
            assert_eq!(fast.shape(), slow.shape(), "{what}");
            assert_eq!(fast.dtype(), dt);
            let bits = |t: &Tensor| vals(t).iter().map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() }).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&slow), "values, {what}");
            let grad = |indices: bool| {
                let xg = x.detach().requires_grad();
                let y = if indices { F::max_pool2d_with_indices(&xg, &a).unwrap().0 } else { F::max_pool2d_with(&xg, &a).unwrap() };
                // Weights 1..=7 by window: a gradient sent to the wrong position shows, and the
                // sums stay exact in BF16.
                let w: Vec<f64> = (0..y.numel()).map(|i| (i % 7 + 1) as f64).collect();
                let w = Tensor::from_vec(w, y.shape(), &Device::Cpu).unwrap().to_device(&d).unwrap().to_dtype(dt).unwrap();
                y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                xg.grad().unwrap()
            };
            assert_eq!(vals(&grad(false)), vals(&grad(true)), "gradients, {what}");
        }
    }
}

#[test]
fn batch_norm_inference_matches_the_differentiable_evaluation() {
    // Under no_grad the GPU evaluates x * scale + shift in one F32 pass; with gradients, the
    // per-op form. Tolerances: F32 1e-6 relative (one fused multiply-add against two roundings),
    // BF16 one rounding of the result (2^-8 relative).
    let d = dev();
    let bn = nn::BatchNorm2d::new(5, &d).unwrap();
    kiln::no_grad(|| -> kiln::Result<()> {
        bn.running_mean.copy_(&rand_t(&[5], 1, DType::F32))?;
        bn.running_var.copy_(&rand_t(&[5], 2, DType::F32).abs()?.add_scalar(0.1)?)?;
        bn.weight.copy_(&rand_t(&[5], 3, DType::F32))?;
        bn.bias.copy_(&rand_t(&[5], 4, DType::F32))
    })
    .unwrap();
    bn.eval();
    for (dt, rtol, atol) in [(DType::F32, 1e-6, 1e-6), (DType::BF16, 8e-3, 8e-3)] {
        let x = rand_t(&[3, 5, 7, 6], 5, dt);
        let fast = kiln::no_grad(|| bn.forward(&x)).unwrap();
        let slow = bn.forward(&x).unwrap();
        assert_eq!(fast.dtype(), dt);
        assert_close(&vals(&fast), &vals(&slow), rtol, atol);
    }
}
