//! Modules, optimisers and safetensors state dicts.

use crate::common::*;
use kiln::nn::{self, functional as F, Module};
use kiln::optim::{Adam, AdamConfig, AdamW, Optimizer, Sgd};
use kiln::prelude::*;

fn mlp(d: &Device) -> nn::Sequential {
    nn::Sequential::new().add(nn::Linear::new(784, 256, d).unwrap()).add(nn::ReLU).add(nn::Linear::new(256, 10, d).unwrap())
}

#[test]
fn linear_computes_x_wt_plus_b_and_names_parameters_like_pytorch() {
    let d = dev();
    manual_seed(1);
    let model = mlp(&d);
    let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
    let shapes: Vec<Vec<usize>> = model.parameters().iter().map(|p| p.shape().to_vec()).collect();
    assert_eq!(shapes, [vec![256, 784], vec![256], vec![10, 256], vec![10]]);
    // PyTorch's init bound: 1/sqrt(fan_in).
    let w = vals(&model.parameters()[0]);
    let bound = 1.0 / 784f64.sqrt();
    assert!(w.iter().all(|v| v.abs() <= bound) && w.iter().any(|v| v.abs() > 0.9 * bound));

    let lin = nn::Linear::new(3, 2, &d).unwrap();
    let x = t(&[1.0, 2.0, 3.0, -1.0, 0.5, 2.0], &[2, 3], DType::F32);
    let y = vals(&lin.forward(&x).unwrap());
    let (wv, bv, xv) = (vals(&lin.weight), vals(lin.bias.as_ref().unwrap()), vals(&x));
    for r in 0..2 {
        for o in 0..2 {
            let want: f64 = (0..3).map(|i| xv[r * 3 + i] * wv[o * 3 + i]).sum::<f64>() + bv[o];
            assert!((y[r * 2 + o] - want).abs() < 1e-5, "{r} {o}");
        }
    }
}

#[test]
fn the_mlp_learns_a_synthetic_task() {
    let d = dev();
    manual_seed(0);
    let n = 256;
    let x = Tensor::randn(&[n, 784], DType::F32, &d).unwrap();
    let proj = Tensor::randn(&[784, 10], DType::F32, &d).unwrap();
    let y = no_grad(|| x.matmul(&proj).unwrap().argmax(1, false).unwrap());
    let model = mlp(&d);
    let mut opt = Sgd::new(model.parameters(), 0.05).momentum(0.9);
    let mut first = None;
    for _ in 0..60 {
        let loss = F::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        first.get_or_insert(loss.item::<f32>().unwrap());
        loss.backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let pred = no_grad(|| model.forward(&x).unwrap().argmax(1, false).unwrap());
    let acc = pred.eq(&y).unwrap().to_dtype(DType::F32).unwrap().mean_all().unwrap().item::<f32>().unwrap();
    assert!(acc >= 0.95, "training accuracy {acc} (first loss {first:?})");
    assert!(model.parameters().iter().all(|p| p.grad().is_none()), "zero_grad sets gradients to none");
}

#[test]
fn sgd_momentum_nesterov_and_weight_decay_follow_pytorch() {
    let d = dev();
    let p = t(&[1.0, -2.0], &[2], DType::F64).requires_grad();
    let mut opt = Sgd::new(vec![p.clone()], 0.1).momentum(0.9).dampening(0.1).nesterov(false).weight_decay(0.01);
    let (mut pv, mut buf): (Vec<f64>, Option<Vec<f64>>) = (vec![1.0, -2.0], None);
    for step in 0..3 {
        let g = [0.5 + step as f64, -0.25];
        p.set_grad(Some(t(&g, &[2], DType::F64))).unwrap();
        opt.step().unwrap();
        let gd: Vec<f64> = (0..2).map(|i| g[i] + 0.01 * pv[i]).collect();
        let b: Vec<f64> = match &buf {
            None => gd.clone(),
            Some(b) => (0..2).map(|i| 0.9 * b[i] + 0.9 * gd[i]).collect(),
        };
        pv = (0..2).map(|i| pv[i] - 0.1 * b[i]).collect();
        buf = Some(b);
        assert_close(&vals(&p), &pv, 1e-12, 1e-12);
    }
    // Nesterov: the step uses g + momentum * buf.
    let q = t(&[0.0], &[1], DType::F64).requires_grad();
    let mut nes = Sgd::new(vec![q.clone()], 1.0).momentum(0.5).nesterov(true);
    q.set_grad(Some(t(&[2.0], &[1], DType::F64))).unwrap();
    nes.step().unwrap();
    assert_eq!(vals(&q), vec![-(2.0 + 0.5 * 2.0)]);
    let _ = d;
}

#[test]
fn adam_and_adamw_follow_pytorch() {
    let cfg = AdamConfig { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
    for decoupled in [false, true] {
        let p = t(&[1.0, -0.5], &[2], DType::F64).requires_grad();
        let mut opt: Box<dyn Optimizer> = if decoupled { Box::new(AdamW::new(vec![p.clone()], cfg)) } else { Box::new(Adam::new(vec![p.clone()], cfg)) };
        let (mut pv, mut m, mut v) = (vec![1.0, -0.5], vec![0.0; 2], vec![0.0; 2]);
        for step in 1..=3 {
            let g = [0.3 * step as f64, -0.7];
            p.set_grad(Some(t(&g, &[2], DType::F64))).unwrap();
            opt.step().unwrap();
            for i in 0..2 {
                let mut gi = g[i];
                if decoupled {
                    pv[i] *= 1.0 - cfg.lr * cfg.weight_decay;
                } else {
                    gi += cfg.weight_decay * pv[i];
                }
                m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * gi;
                v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * gi * gi;
                let (bc1, bc2) = (1.0 - cfg.beta1.powi(step), 1.0 - cfg.beta2.powi(step));
                pv[i] -= cfg.lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + cfg.eps);
            }
            assert_close(&vals(&p), &pv, 1e-12, 1e-12);
        }
    }
}

#[test]
fn dropout_follows_train_and_eval() {
    let d = dev();
    let model = nn::Sequential::new().add(nn::Dropout::new(0.5).unwrap()).add(nn::ReLU);
    let x = Tensor::ones(&[1000], DType::F32, &d).unwrap();
    let y = vals(&model.forward(&x).unwrap());
    assert!(y.contains(&0.0) && y.contains(&2.0));
    model.eval();
    assert!(vals(&model.forward(&x).unwrap()).iter().all(|&v| v == 1.0));
    model.train();
    assert!(vals(&model.forward(&x).unwrap()).contains(&0.0));
}

#[test]
fn embedding_and_layer_norm_modules() {
    let d = dev();
    let e = nn::Embedding::new(5, 3, &d).unwrap();
    let idx = Tensor::from_vec(vec![4i64, 0, 4, 2], &[2, 2], &d).unwrap();
    let y = e.forward(&idx).unwrap();
    assert_eq!(y.shape(), &[2, 2, 3]);
    let (w, yv) = (vals(&e.weight), vals(&y));
    assert_eq!(&yv[0..3], &w[12..15]);
    assert_eq!(&yv[3..6], &w[0..3]);
    let ln = nn::LayerNorm::new(&[4], 1e-5, &d).unwrap();
    assert_eq!(ln.named_parameters().iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["weight", "bias"]);
    let z = vals(&ln.forward(&t(&[1.0, 2.0, 3.0, 4.0], &[1, 4], DType::F32)).unwrap());
    assert!(z.iter().sum::<f64>().abs() < 1e-5);
}

fn tmp(name: &str) -> String {
    std::env::temp_dir().join(format!("kiln-{}-{name}", std::process::id())).to_string_lossy().into_owned()
}

#[test]
fn checkpoints_round_trip_bit_exactly_and_atomically() {
    let d = dev();
    manual_seed(5);
    let a = mlp(&d);
    let path = tmp("mlp.safetensors");
    a.save_safetensors(&path).unwrap();
    manual_seed(6);
    let b = mlp(&d);
    assert_ne!(vals(&a.parameters()[0]), vals(&b.parameters()[0]));
    b.load_safetensors(&path).unwrap();
    for (pa, pb) in a.parameters().iter().zip(b.parameters()) {
        assert_eq!(vals(pa), vals(&pb), "bit-exact");
        assert_eq!(pb.device(), d);
    }
    let dir = std::path::Path::new(&path).parent().unwrap().to_path_buf();
    let leftovers = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().starts_with(&format!("kiln-{}-mlp.safetensors.tmp", std::process::id()))).count();
    assert_eq!(leftovers, 0, "no temporary file left behind");

    // Every dtype survives a file.
    let sd = vec![
        ("f16".to_string(), t(&[1.5, -2.25], &[2], DType::F16)),
        ("bf16".to_string(), t(&[3.0, 0.5], &[2], DType::BF16)),
        ("i64".to_string(), Tensor::from_vec(vec![i64::MIN, 7], &[2], &d).unwrap()),
        ("mask".to_string(), Tensor::from_vec(vec![true, false, true], &[3], &d).unwrap()),
        ("u8".to_string(), Tensor::from_vec(vec![255u8], &[1, 1], &d).unwrap()),
    ];
    let p2 = tmp("dtypes.safetensors");
    nn::safetensors::save(&sd, &p2).unwrap();
    let back = nn::safetensors::load(&p2, &d).unwrap();
    for (name, t0) in &sd {
        let (_, t1) = back.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!((t1.dtype(), t1.shape()), (t0.dtype(), t0.shape()), "{name}");
        assert_eq!(vals(t1), vals(t0), "{name}");
    }
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&p2);
}

#[test]
fn truncated_or_mismatched_checkpoints_are_clear_errors() {
    let d = dev();
    let a = mlp(&d);
    let path = tmp("trunc.safetensors");
    a.save_safetensors(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = a.load_safetensors(&path).unwrap_err();
    assert!(matches!(e, kiln::Error::Io { .. }) && e.to_string().contains("trunc.safetensors"), "{e}");
    let e = a.load_safetensors(tmp("does-not-exist.safetensors")).unwrap_err();
    assert!(matches!(e, kiln::Error::Io { .. }), "{e}");

    // A different architecture: every mismatch is named, nothing is written.
    let other = nn::Sequential::new().add(nn::Linear::new(784, 128, &d).unwrap()).add(nn::ReLU).add(nn::Linear::new(128, 10, &d).unwrap()).add(nn::Linear::new(10, 2, &d).unwrap());
    let before = vals(&a.parameters()[0]);
    let e = a.load_state_dict(&other.state_dict()).unwrap_err().to_string();
    for part in ["0.weight", "0.bias", "2.weight", "unexpected 3.weight", "unexpected 3.bias"] {
        assert!(e.contains(part), "{part} missing from: {e}");
    }
    assert_eq!(vals(&a.parameters()[0]), before);
    let mut sd = a.state_dict();
    sd.pop();
    let e = a.load_state_dict(&sd).unwrap_err().to_string();
    assert!(e.contains("missing 2.bias"), "{e}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn schedulers_follow_pytorch_closed_forms() {
    use kiln::optim::{CosineAnnealingLr, LinearWarmup, LrScheduler, StepLr};
    let p = t(&[1.0], &[1], DType::F32).requires_grad();
    let mut opt = Sgd::new(vec![p], 0.1);
    let mut s = StepLr::new(&opt, 2, 0.5);
    let lrs: Vec<f64> = (0..5).map(|_| { s.step(&mut opt); opt.lr() }).collect();
    assert_close(&lrs, &[0.1, 0.05, 0.05, 0.025, 0.025], 1e-12, 0.0);
    let mut opt = Sgd::new(vec![], 1.0);
    let mut c = CosineAnnealingLr::new(&opt, 4, 0.0);
    let lrs: Vec<f64> = (0..4).map(|_| { c.step(&mut opt); opt.lr() }).collect();
    assert_close(&lrs, &[0.8535533905932737, 0.5, 0.14644660940672627, 0.0], 1e-12, 1e-15);
    let mut opt = Sgd::new(vec![], 1.0);
    let mut w = LinearWarmup::new(&mut opt, 0.25, 3);
    assert_eq!(opt.lr(), 0.25);
    let lrs: Vec<f64> = (0..4).map(|_| { w.step(&mut opt); opt.lr() }).collect();
    assert_close(&lrs, &[0.5, 0.75, 1.0, 1.0], 1e-12, 0.0);
}

#[test]
fn nll_and_bce_with_logits_match_their_formulas() {
    let d = dev();
    let x = t(&[0.5, -1.0, 2.0, 0.1, 0.3, -0.2], &[2, 3], DType::F64);
    let y = Tensor::from_vec(vec![2i64, 0], &[2], &d).unwrap();
    let nll = vals(&F::nll_loss(&x.log_softmax(1).unwrap(), &y).unwrap());
    let ce = vals(&F::cross_entropy(&x, &y).unwrap());
    assert_close(&nll, &ce, 1e-12, 1e-12);
    let opts = F::CrossEntropyOptions { label_smoothing: 0.1, ..Default::default() };
    assert!(F::nll_loss_with(&x, &y, &opts).is_err(), "label smoothing belongs to cross_entropy");

    let z = [3.0, -2.0, 0.0, 50.0, -50.0];
    let tg = [1.0, 0.0, 0.5, 0.0, 1.0];
    let (zt, tt) = (t(&z, &[5], DType::F64), t(&tg, &[5], DType::F64));
    let got = vals(&F::binary_cross_entropy_with_logits(&zt, &tt, None, None, F::Reduction::None).unwrap());
    let want: Vec<f64> = z.iter().zip(&tg).map(|(&v, &y)| {
        // log-sigmoid written stably: large |v| must not overflow.
        let ls = |u: f64| if u >= 0.0 { -(1.0 + (-u).exp()).ln() } else { u - (1.0 + u.exp()).ln() };
        -(y * ls(v) + (1.0 - y) * ls(-v))
    }).collect();
    assert_close(&got, &want, 1e-12, 1e-12);
    let pw = t(&[2.0; 5], &[5], DType::F64);
    let got = vals(&F::binary_cross_entropy_with_logits(&zt, &tt, None, Some(&pw), F::Reduction::Sum).unwrap());
    let want: f64 = z.iter().zip(&tg).map(|(&v, &y)| {
        let ls = |u: f64| if u >= 0.0 { -(1.0 + (-u).exp()).ln() } else { u - (1.0 + u.exp()).ln() };
        -(2.0 * y * ls(v) + (1.0 - y) * ls(-v))
    }).sum();
    assert_close(&got, &[want], 1e-12, 1e-12);
    // Including logits exactly 0, where the gradient is sigmoid(0) - y.
    kiln::gradcheck(|xs| F::binary_cross_entropy_with_logits(&xs[0], &xs[1], None, None, F::Reduction::Mean), &[zt.clone(), tt.clone()], Default::default()).unwrap();
    kiln::gradcheck(|xs| F::binary_cross_entropy_with_logits(&xs[0], &xs[1], None, Some(&xs[2]), F::Reduction::Sum), &[zt, tt, pw], Default::default()).unwrap();
}

#[test]
fn modules_move_and_convert_their_parameters() {
    let d = dev();
    manual_seed(3);
    let mut model = nn::Sequential::new().add(nn::Linear::new(4, 3, &Device::Cpu).unwrap()).add(nn::LayerNorm::new(&[3], 1e-5, &Device::Cpu).unwrap()).add(nn::Embedding::new(2, 2, &Device::Cpu).unwrap());
    let before: Vec<Vec<f64>> = model.parameters().iter().map(vals).collect();
    model.to_device(&d).unwrap();
    model.to_dtype(DType::F64).unwrap();
    let params = model.parameters();
    assert_eq!(params.len(), 5);
    for (p, b) in params.iter().zip(&before) {
        assert_eq!((p.device(), p.dtype()), (d, DType::F64));
        assert!(p.is_leaf() && p.is_requires_grad());
        assert_eq!(&vals(p), b, "values kept exactly (f32 -> f64 is exact)");
    }
    // Still trains: gradients reach the moved parameters.
    let lin = nn::Sequential::new().add(nn::Linear::new(4, 3, &Device::Cpu).unwrap());
    let mut lin = lin;
    lin.to_device(&d).unwrap();
    let x = t(&[1.0, 2.0, 3.0, 4.0], &[1, 4], DType::F32);
    lin.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(lin.parameters().iter().all(|p| p.grad().is_some()));
}

/// A convolution and an evaluation-mode batch norm folded into one convolution compute what
/// the pair computes (F32: rtol 1e-4, atol 1e-5; only the order of the rounding changes), with
/// and without the convolution's bias, contiguous and channels-last; a training-mode batch
/// norm or a channel mismatch is an error.
#[test]
fn a_folded_batch_norm_equals_the_convolution_and_batch_norm_it_replaces() {
    let d = dev();
    let r = |shape: &[usize], seed: u64| t(&host_rand(shape.iter().product(), seed), shape, DType::F32);
    let x = r(&[2, 3, 9, 8], 1);
    for (bias, format) in [(false, MemoryFormat::Contiguous), (true, MemoryFormat::Contiguous), (true, MemoryFormat::ChannelsLast)] {
        let args = nn::Conv2dArgs { stride: (2, 1), padding: (1, 1), ..Default::default() };
        let mut conv = nn::Conv2d::with_options(3, 6, (3, 3), args, bias, &d).unwrap();
        conv.weight = r(&[6, 3, 3, 3], 2).to_memory_format(format).unwrap();
        if bias {
            conv.bias = Some(r(&[6], 3));
        }
        let bn = nn::BatchNorm2d::new(6, &d).unwrap();
        no_grad(|| -> Result<()> {
            bn.weight.copy_(&r(&[6], 4))?;
            bn.bias.copy_(&r(&[6], 5))?;
            bn.running_mean.copy_(&r(&[6], 6).mul_scalar(0.3)?)?;
            bn.running_var.copy_(&r(&[6], 7).abs()?.add_scalar(0.2)?)
        })
        .unwrap();
        assert!(nn::fuse_conv_bn_eval(&conv, &bn).err().expect("an error").to_string().contains("training mode"));
        bn.eval();
        let x = x.to_memory_format(format).unwrap();
        let want = bn.forward(&conv.forward(&x).unwrap()).unwrap();
        let folded = nn::fuse_conv_bn_eval(&conv, &bn).unwrap();
        assert!(folded.weight.is_contiguous_for(format), "the folded weight keeps the format");
        let got = folded.forward(&x).unwrap();
        assert_close_named(&format!("folded (bias {bias}, {format:?})"), &vals(&got), &vals(&want), 1e-4, 1e-5);
    }
    let conv = nn::Conv2d::new(3, 5, 3, &d).unwrap();
    let bn = nn::BatchNorm2d::new(6, &d).unwrap();
    bn.eval();
    assert!(nn::fuse_conv_bn_eval(&conv, &bn).err().expect("an error").to_string().contains("5 output channels"));
}

/// `conv2d_bias_act` against the convolution and its epilogue written out (in F32 from the same
/// rounded inputs): with and without a residual and ReLU, strided and padded, contiguous and
/// channels-last, in F32 (rtol 1e-5, atol 1e-5) and, on the GPU where cuDNN's fused kernel
/// runs it, BF16 and F16 (rounded once from F32: rtol 1e-2, atol 1e-2 for values of a few
/// units); its gradients equal the written-out ones; bad arguments are errors.
#[test]
fn a_convolution_with_its_epilogue_equals_it_written_out() {
    let r = |shape: &[usize], seed: u64, dt: DType| t(&host_rand(shape.iter().product(), seed), shape, dt);
    let mut dtypes = vec![(DType::F32, 1e-5)];
    if dev().is_cuda() {
        dtypes.extend([(DType::BF16, 1e-2), (DType::F16, 1e-2)]);
    }
    for (dt, tol) in dtypes {
        // The last: a 2x2 image strided to one pixel (ResNet's last stage on a small input).
        for (residual, relu, format, stride, (ih, iw)) in [(false, true, MemoryFormat::ChannelsLast, 1, (9, 8)), (true, true, MemoryFormat::ChannelsLast, 1, (9, 8)), (true, false, MemoryFormat::Contiguous, 2, (9, 8)), (false, false, MemoryFormat::ChannelsLast, 2, (9, 8)), (true, true, MemoryFormat::ChannelsLast, 2, (2, 2))] {
            let args = nn::Conv2dArgs { stride: (stride, stride), padding: (1, 1), ..Default::default() };
            let x = r(&[2, 16, ih, iw], 1, dt).mul_scalar(0.5).unwrap().to_memory_format(format).unwrap();
            let w = r(&[32, 16, 3, 3], 2, dt).mul_scalar(0.1).unwrap().to_memory_format(format).unwrap();
            let b = r(&[32], 3, DType::F32);
            let (oh, ow) = (ih.div_ceil(stride), iw.div_ceil(stride));
            let z = residual.then(|| r(&[2, 32, oh, ow], 4, dt).to_memory_format(format).unwrap());
            let leaf = |t: &Tensor| t.detach().requires_grad();
            let (xg, wg, bg, zg) = (leaf(&x), leaf(&w), leaf(&b), z.as_ref().map(leaf));
            let got = nn::functional::conv2d_bias_act(&xg, &wg, &bg, zg.as_ref(), args, relu).unwrap();
            assert_eq!(got.shape(), [2, 32, oh, ow]);
            assert_eq!(got.dtype(), dt);
            let f32s = |t: &Tensor| leaf(&t.to_dtype(DType::F32).unwrap());
            let (xr, wr, br, zr) = (f32s(&x), f32s(&w), f32s(&b), z.as_ref().map(f32s));
            let mut want = nn::functional::conv2d(&xr, &wr, Some(&br), args).unwrap();
            if let Some(z) = &zr {
                want = want.add(z).unwrap();
            }
            if relu {
                want = want.relu().unwrap();
            }
            let what = format!("{dt:?} residual {residual} relu {relu} {format:?} stride {stride}");
            assert_close_named(&what, &vals(&got), &vals(&want), tol, tol);
            // Gradients of a weighted sum (one BF16 rounding of each gradient: 2e-2).
            let g = r(&[2, 32, oh, ow], 5, DType::F32);
            got.to_dtype(DType::F32).unwrap().mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            want.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let gtol = if dt == DType::F32 { 1e-4 } else { 3e-2 };
            for (name, a, b) in [("x", &xg, &xr), ("w", &wg, &wr), ("bias", &bg, &br)] {
                assert_close_named(&format!("{what}: d{name}"), &vals(&a.grad().unwrap()), &vals(&b.grad().unwrap()), gtol, gtol);
            }
            if let (Some(a), Some(b)) = (&zg, &zr) {
                assert_close_named(&format!("{what}: dresidual"), &vals(&a.grad().unwrap()), &vals(&b.grad().unwrap()), gtol, gtol);
            }
        }
    }
    if dev().is_cuda() && kiln::cuda::cudnn_version().is_ok() {
        // One cuDNN call: no kernel of kiln's after it.
        let (x, w, b) = (r(&[4, 64, 14, 14], 1, DType::BF16).to_memory_format(MemoryFormat::ChannelsLast).unwrap(), r(&[64, 64, 3, 3], 2, DType::BF16).to_memory_format(MemoryFormat::ChannelsLast).unwrap(), r(&[64], 3, DType::F32));
        let args = nn::Conv2dArgs { padding: (1, 1), ..Default::default() };
        let p = kiln::profiler::profile(|| no_grad(|| nn::functional::conv2d_bias_act(&x, &w, &b, Some(&x), args, true))).unwrap();
        let names: Vec<String> = p.key_averages().rows().iter().map(|r| r.name.clone()).collect();
        assert_eq!(names, ["cudnn_conv2d_bias_act_fwd_bfloat16"]);
    }
    let (x, w, b) = (r(&[1, 4, 5, 5], 1, DType::F32), r(&[6, 4, 3, 3], 2, DType::F32), r(&[6], 3, DType::F32));
    let err = |res: Result<Tensor>| res.expect_err("an error").to_string();
    let a = nn::Conv2dArgs::default();
    assert!(err(nn::functional::conv2d_bias_act(&x, &w, &b.narrow(0, 0, 5).unwrap(), None, a, true)).contains("bias"));
    assert!(err(nn::functional::conv2d_bias_act(&x, &w, &b, Some(&x), a, true)).contains("residual"));
    assert!(err(nn::functional::conv2d_bias_act(&x.squeeze(0).unwrap(), &w, &b, None, a, true)).contains("4-D"));
}

/// A compile backend that runs graphs eagerly and records the names of the convolution ops
/// (`conv2d...`) of the last graph it was handed.
fn convolutions_recorded() -> (kiln::compile::Backend, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use kiln::compile::graph::{Graph, NodeOp};
    let convs = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    let seen = convs.clone();
    let backend = kiln::compile::Backend::custom(move |g: &Graph, _| {
        *seen.lock().unwrap() = g.nodes.iter().filter_map(|n| match &n.op {
            NodeOp::Prim(op) if op.name().starts_with("conv2d") => Some(op.name().to_string()),
            _ => None,
        }).collect();
        Ok(g.eager_runner())
    });
    (backend, convs)
}

/// An evaluation-mode ResNet block runs each convolution with its batch norm folded in and its
/// residual and ReLU as the epilogue (`conv2d_bias_act`): the same numbers as the convolutions
/// and batch norms apart (F32: rtol 1e-4, atol 1e-5), compiled one convolution op per conv.
#[test]
fn an_evaluation_mode_bottleneck_folds_its_batch_norms_into_its_convolutions() {
    use kiln::compile::{compile_with, CompileOptions};
    let d = dev();
    manual_seed(3);
    let block = nn::Bottleneck::new(16, 8, 2, &d).unwrap();
    for (i, p) in block.parameters().iter().enumerate() {
        no_grad(|| p.copy_(&p.mul_scalar(0.5 + 0.1 * i as f64)?)).unwrap();
    }
    let x = t(&host_rand(2 * 16 * 8 * 8, 4), &[2, 16, 8, 8], DType::F32);
    // A few training steps' worth of running statistics, then evaluation.
    block.train();
    for _ in 0..3 {
        no_grad(|| block.forward(&x)).unwrap();
    }
    block.eval();
    let got = no_grad(|| block.forward(&x)).unwrap();
    let bn = |c: &nn::Conv2d, b: &nn::BatchNorm2d, x: &Tensor| b.forward(&c.forward(x).unwrap()).unwrap();
    let want = no_grad(|| {
        let out = bn(&block.conv1, &block.bn1, &x).relu()?;
        let out = bn(&block.conv2, &block.bn2, &out).relu()?;
        let ds = block.downsample.as_ref().expect("a strided block downsamples");
        bn(&block.conv3, &block.bn3, &out).add(&bn(&ds.conv, &ds.bn, &x))?.relu()
    })
    .unwrap();
    assert_close(&vals(&got), &vals(&want), 1e-4, 1e-5);
    let (backend, convs) = convolutions_recorded();
    let f = compile_with(CompileOptions::new().backend(backend), |x: &Tensor| no_grad(|| block.forward(x)));
    assert_close(&vals(&f.call(&x).unwrap()), &vals(&want), 1e-4, 1e-5);
    assert_eq!(convs.lock().unwrap().len(), 4, "{:?}", convs.lock().unwrap());
}

/// A compiled evaluation-mode block under BF16 autocast records `conv2d_bias_act` where the
/// compiler will lay the net out channels-last (a channels-last model and input; the values it
/// traces are contiguous until the layout pass), and the convolutions with their epilogues
/// otherwise (a contiguous model and input); on
/// the CPU always the latter. Both give eager's numbers (BF16 output: rtol 2e-2, atol 2e-2).
#[test]
fn a_compiled_channels_last_evaluation_block_records_convolutions_with_their_epilogues() {
    use kiln::compile::{compile_with, CompileOptions};
    let d = dev();
    for (format, fused) in [(MemoryFormat::ChannelsLast, 4), (MemoryFormat::Contiguous, 0)] {
        manual_seed(4);
        let mut block = nn::Bottleneck::new(16, 8, 2, &d).unwrap();
        block.eval();
        block.to_memory_format(format).unwrap();
        let x = t(&host_rand(2 * 16 * 8 * 8, 6), &[2, 16, 8, 8], DType::F32).to_memory_format(format).unwrap();
        let run = |x: &Tensor| kiln::amp::autocast(&d, DType::BF16, || no_grad(|| block.forward(x)));
        let want = run(&x).unwrap();
        let (backend, ops) = convolutions_recorded();
        let f = compile_with(CompileOptions::new().backend(backend), run);
        assert_close(&vals(&f.call(&x).unwrap()), &vals(&want), 2e-2, 2e-2);
        let ops = ops.lock().unwrap().clone();
        let with_epilogue = ops.iter().filter(|n| *n == "conv2d_bias_act").count();
        assert_eq!(ops.len(), 4, "{format:?}: {ops:?}");
        assert_eq!(with_epilogue, if d.is_cuda() { fused } else { 0 }, "{format:?}: {ops:?}");
    }
}
