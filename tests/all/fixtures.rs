//! Modules and optimisers against PyTorch (2.15) itself: tests/fixtures/make_fixtures.py
//! writes weights, inputs, outputs and gradients computed in float64; kiln loads them with
//! its safetensors reader and runs the same computation in F64 and F32 on the test device.

use crate::common::*;
use kiln::nn::{self, AttnArgs, Module, TransformerConfig, TransformerMasks};
use kiln::optim::{Adam, AdamConfig, AdamW, Optimizer, Sgd};
use kiln::prelude::*;
use kiln::BackwardOptions;
use std::collections::HashMap;

/// (rtol, atol) per dtype: F64 agrees to rounding; F32 accumulates ~1e-7 relative per op.
fn tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F64 => (1e-9, 1e-10),
        _ => (2e-4, 2e-5),
    }
}

struct Fixture(HashMap<String, Tensor>);

impl Fixture {
    fn load(name: &str) -> Fixture {
        let path = format!("{}/tests/fixtures/{name}.safetensors", env!("CARGO_MANIFEST_DIR"));
        Fixture(nn::safetensors::load(&path, &Device::Cpu).unwrap().into_iter().collect())
    }
    fn raw(&self, key: &str) -> &Tensor {
        self.0.get(key).unwrap_or_else(|| panic!("fixture has no {key}"))
    }
    /// `key` on the test device, floating-point values in `dt`.
    fn get(&self, key: &str, dt: DType) -> Tensor {
        // A fresh tensor each time: callers may mark it as requiring grad.
        let t = self.raw(key).detach();
        let t = if t.dtype().is_float() { t.to_dtype(dt).unwrap() } else { t.clone() };
        t.to_device(&dev()).unwrap()
    }
    fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }
    /// Copies the fixture's `param.*` into the module (converted to `dt`); every parameter
    /// must be there. Buffers keep the module's own values.
    fn load_params(&self, m: &mut impl Module, dt: DType) {
        let mut mine: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
        let mut theirs: Vec<String> = self.0.keys().filter_map(|k| k.strip_prefix("param.")).map(String::from).collect();
        mine.sort();
        theirs.sort();
        assert_eq!(mine, theirs, "parameter names differ from PyTorch's");
        m.to_device(&dev()).unwrap();
        m.to_dtype(dt).unwrap();
        let sd: Vec<(String, Tensor)> = m
            .state_dict()
            .into_iter()
            .map(|(n, t)| {
                let key = format!("param.{n}");
                if m.named_parameters().iter().any(|(p, _)| *p == n) {
                    (n, self.get(&key, dt))
                } else {
                    (n, t)
                }
            })
            .collect();
        m.load_state_dict(&sd).unwrap();
    }
    /// Inputs with a `grad.input.*` entry become leaves that require grad.
    fn input(&self, name: &str, dt: DType) -> Tensor {
        let t = self.get(&format!("input.{name}"), dt);
        if self.has(&format!("grad.input.{name}")) {
            t.requires_grad()
        } else {
            t
        }
    }
}

#[track_caller]
fn close(what: &str, got: &Tensor, want: &Tensor, dt: DType) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (rtol, atol) = tol(dt);
    let (g, w) = (vals(got), vals(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= atol + rtol * b.abs() || (a.is_nan() && b.is_nan()), "{what} ({dt:?}) element {i}: got {a}, want {b}");
    }
}

/// Runs `forward` in F64 and F32: output (and attention weights) against the fixture, then
/// backward of sum(out * dout) and every stored input and parameter gradient.
fn check<M: Module>(name: &str, make: impl Fn() -> M, forward: impl Fn(&M, &Fixture, DType, &[Tensor]) -> (Tensor, Option<Tensor>), inputs: &[&str]) {
    let fx = Fixture::load(name);
    for dt in [DType::F64, DType::F32] {
        let mut m = make();
        fx.load_params(&mut m, dt);
        let xs: Vec<Tensor> = inputs.iter().map(|n| fx.input(n, dt)).collect();
        let (out, weights) = forward(&m, &fx, dt, &xs);
        close(&format!("{name} out"), &out, &fx.get("out", dt), dt);
        if let Some(w) = weights {
            close(&format!("{name} weights"), &w, &fx.get("weights", dt), dt);
        }
        out.backward_with(BackwardOptions { gradient: Some(fx.get("dout", dt)), retain_graph: false }).unwrap();
        for (n, x) in inputs.iter().zip(&xs) {
            if fx.has(&format!("grad.input.{n}")) {
                close(&format!("{name} grad of input {n}"), &x.grad().expect("input gradient"), &fx.get(&format!("grad.input.{n}"), dt), dt);
            }
        }
        for (n, p) in m.named_parameters() {
            close(&format!("{name} grad of {n}"), &p.grad().expect("parameter gradient"), &fx.get(&format!("grad.param.{n}"), dt), dt);
        }
    }
}

#[test]
fn linear_and_layer_norm_match_pytorch() {
    let d = dev();
    check("linear", || nn::Linear::new(5, 3, &d).unwrap(), |m, _, _, xs| (m.forward(&xs[0]).unwrap(), None), &["x"]);
    check("layer_norm", || nn::LayerNorm::new(&[6], 1e-5, &d).unwrap(), |m, _, _, xs| (m.forward(&xs[0]).unwrap(), None), &["x"]);
}

fn mha(batch_first: bool) -> nn::MultiheadAttention {
    nn::MultiheadAttention::with_options(8, 2, 0.0, true, batch_first, &dev()).unwrap()
}

#[test]
fn multihead_attention_matches_pytorch_with_bool_float_and_causal_masks() {
    check("mha_masks", || mha(false), |m, fx, dt, xs| {
        let (am, kpm) = (fx.get("input.attn_mask", dt), fx.get("input.key_padding_mask", dt));
        let args = AttnArgs { attn_mask: Some(&am), key_padding_mask: Some(&kpm), average_attn_weights: false, ..Default::default() };
        let (o, w) = m.attend(&xs[0], &xs[1], &xs[2], args).unwrap();
        (o, w)
    }, &["q", "k", "v"]);
    check("mha_float_mask", || mha(true), |m, fx, dt, xs| {
        let am = fx.get("input.attn_mask", dt);
        m.attend(&xs[0], &xs[1], &xs[2], AttnArgs { attn_mask: Some(&am), ..Default::default() }).unwrap()
    }, &["q", "k", "v"]);
    check("mha_self_causal", || mha(false), |m, _, dt, xs| {
        let mask = nn::generate_square_subsequent_mask(4, &dev()).unwrap().to_dtype(dt).unwrap();
        m.attend(&xs[0], &xs[0], &xs[0], AttnArgs { attn_mask: Some(&mask), ..Default::default() }).unwrap()
    }, &["x"]);
}

fn small_cfg() -> TransformerConfig {
    TransformerConfig { d_model: 8, nhead: 2, num_encoder_layers: 2, num_decoder_layers: 2, dim_feedforward: 16, dropout: 0.0, ..Default::default() }
}

#[test]
fn transformer_layers_match_pytorch_in_train_and_eval() {
    let d = dev();
    for (name, cfg, train) in [
        ("encoder_layer_eval", small_cfg(), false),
        ("encoder_layer_train", small_cfg(), true),
        ("encoder_layer_norm_first_gelu", TransformerConfig { norm_first: true, activation: nn::Activation::Gelu, ..small_cfg() }, true),
    ] {
        check(name, || {
            let l = nn::TransformerEncoderLayer::new(&cfg, &d).unwrap();
            if train { l.train() } else { l.eval() }
            l
        }, |m, fx, dt, xs| {
            let kpm = fx.get("input.src_key_padding_mask", dt);
            (m.forward_masked(&xs[0], None, Some(&kpm)).unwrap(), None)
        }, &["src"]);
    }
    check("decoder_layer", || nn::TransformerDecoderLayer::new(&small_cfg(), &d).unwrap(), |m, _, dt, xs| {
        let mask = nn::generate_square_subsequent_mask(3, &dev()).unwrap().to_dtype(dt).unwrap();
        (m.forward_memory(&xs[0], &xs[1], &TransformerMasks { tgt_mask: Some(&mask), ..Default::default() }).unwrap(), None)
    }, &["tgt", "memory"]);
}

#[test]
fn a_small_transformer_matches_pytorch() {
    let d = dev();
    check("transformer", || nn::Transformer::new(small_cfg(), &d).unwrap(), |m, fx, dt, xs| {
        let mask = nn::generate_square_subsequent_mask(3, &dev()).unwrap().to_dtype(dt).unwrap();
        let kpm = fx.get("input.src_key_padding_mask", dt);
        let masks = TransformerMasks { tgt_mask: Some(&mask), src_key_padding_mask: Some(&kpm), memory_key_padding_mask: Some(&kpm), ..Default::default() };
        (m.forward_src_tgt(&xs[0], &xs[1], &masks).unwrap(), None)
    }, &["src", "tgt"]);
}

#[test]
fn conv2d_matches_pytorch_with_stride_padding_dilation_and_groups() {
    let d = dev();
    let conv = |cin, cout, k, args, bias| move || nn::Conv2d::with_options(cin, cout, k, args, bias, &d).unwrap();
    let fwd = |m: &nn::Conv2d, _: &Fixture, _: DType, xs: &[Tensor]| (m.forward(&xs[0]).unwrap(), None);
    check("conv_stride_pad", conv(3, 4, (3, 3), nn::Conv2dArgs { stride: (2, 2), padding: (1, 1), ..Default::default() }, true), fwd, &["x"]);
    let args = nn::Conv2dArgs { stride: (1, 2), padding: (2, 1), dilation: (2, 1), groups: 2 };
    check("conv_dilation_groups", conv(4, 6, (3, 2), args, false), fwd, &["x"]);
    check("conv_1x1_stride", conv(4, 5, (1, 1), nn::Conv2dArgs { stride: (2, 2), ..Default::default() }, true), fwd, &["x"]);
}

#[test]
fn pooling_matches_pytorch() {
    check("max_pool", || nn::MaxPool2d::new(3, 2, 1), |m, _, _, xs| (m.forward(&xs[0]).unwrap(), None), &["x"]);
    check("adaptive_avg_pool", || nn::AdaptiveAvgPool2d((2, 3)), |m, _, _, xs| (m.forward(&xs[0]).unwrap(), None), &["x"]);
}

#[test]
fn batch_norm_trains_and_evaluates_like_pytorch() {
    let d = dev();
    let fx = Fixture::load("batch_norm");
    for dt in [DType::F64, DType::F32] {
        let mut bn = nn::BatchNorm2d::with_options(3, 1e-5, Some(0.2), &d).unwrap();
        fx.load_params(&mut bn, dt);
        let x = fx.input("x", dt);
        let out = bn.forward(&x).unwrap();
        close("batch_norm out", &out, &fx.get("out", dt), dt);
        out.backward_with(BackwardOptions { gradient: Some(fx.get("dout", dt)), retain_graph: false }).unwrap();
        close("batch_norm grad x", &x.grad().unwrap(), &fx.get("grad.input.x", dt), dt);
        close("batch_norm grad weight", &bn.weight.grad().unwrap(), &fx.get("grad.param.weight", dt), dt);
        close("batch_norm grad bias", &bn.bias.grad().unwrap(), &fx.get("grad.param.bias", dt), dt);
        close("running_mean", &bn.running_mean, &fx.get("buffer.running_mean", dt), dt);
        close("running_var (unbiased)", &bn.running_var, &fx.get("buffer.running_var", dt), dt);
        assert_eq!(bn.num_batches_tracked.item::<i64>().unwrap(), 1);
        bn.eval();
        close("batch_norm eval", &bn.forward(&fx.get("eval_x", dt)).unwrap(), &fx.get("eval_out", dt), dt);
    }
}

#[test]
fn resnet50_first_bottleneck_matches_torchvision() {
    let d = dev();
    let (w, e) = (Fixture::load("resnet_layer1_0_weights"), Fixture::load("resnet_layer1_0_expected"));
    // F32 results stored from a float64 reference: F32 tolerance for both runs.
    let (rtol, atol) = tol(DType::F32);
    for dt in [DType::F64, DType::F32] {
        let mut blk = nn::Bottleneck::new(64, 64, 1, &d).unwrap();
        w.load_params(&mut blk, dt);
        let x = w.get("input.x", dt).requires_grad();
        let out = blk.forward(&x).unwrap();
        assert_close(&vals(&out), &vals(e.raw("out")), rtol, atol);
        out.backward_with(BackwardOptions { gradient: Some(e.get("dout", dt)), retain_graph: false }).unwrap();
        assert_close(&vals(&x.grad().unwrap()), &vals(e.raw("grad.input.x")), rtol, atol);
        let params: HashMap<String, Tensor> = blk.named_parameters().into_iter().collect();
        for n in ["conv1.weight", "bn3.weight", "downsample.0.weight"] {
            assert_close(&vals(&params[n].grad().unwrap()), &vals(e.raw(&format!("grad.param.{n}"))), rtol, atol);
        }
        let bufs: HashMap<String, Tensor> = blk.named_buffers().into_iter().collect();
        for n in ["bn1.running_var", "downsample.1.running_mean"] {
            assert_close(&vals(&bufs[n]), &vals(e.raw(&format!("buffer.{n}"))), rtol, atol);
        }
    }
}

#[test]
fn resnet50_has_torchvisions_state_dict_names_and_shapes() {
    let text = std::fs::read_to_string(format!("{}/tests/fixtures/resnet50_state_dict.txt", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let want: Vec<(String, String)> = text.lines().map(|l| { let (n, s) = l.split_once(' ').unwrap(); (n.to_string(), s.replace(' ', "")) }).collect();
    let model = nn::resnet50(1000, &Device::Cpu).unwrap();
    let mut got: Vec<(String, String)> = model.state_dict().into_iter().map(|(n, t)| (n, format!("{:?}", t.shape()).replace(' ', ""))).collect();
    let mut want_sorted = want.clone();
    got.sort();
    want_sorted.sort();
    assert_eq!(got.len(), want_sorted.len());
    for (g, w) in got.iter().zip(&want_sorted) {
        assert_eq!(g, w);
    }
    // Parameters in torchvision's order (optimiser state indices follow it).
    let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    let torch_params: Vec<&String> = want.iter().map(|(n, _)| n).filter(|n| !n.contains("running_") && !n.contains("num_batches")).collect();
    assert_eq!(names.iter().collect::<Vec<_>>(), torch_params);
}

/// Three steps from the fixture's gradients; parameters after each and the final state.
fn optim_steps(name: &str, mut make: impl FnMut(Vec<Tensor>) -> Box<dyn Optimizer>, state_keys: &[&str]) {
    let fx = Fixture::load(name);
    let p = fx.get("p0", DType::F64).requires_grad();
    let mut opt = make(vec![p.clone()]);
    for i in 0..3 {
        p.set_grad(Some(fx.get(&format!("g{i}"), DType::F64))).unwrap();
        opt.step().unwrap();
        assert_close(&vals(&p), &vals(fx.raw(&format!("p{}", i + 1))), 1e-12, 1e-14);
    }
    let sd: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    for k in state_keys {
        assert_close(&vals(&sd[&format!("state.0.{k}")]), &vals(fx.raw(&format!("state.{k}"))), 1e-12, 1e-14);
    }
}

#[test]
fn optimisers_match_pytorch_for_three_steps() {
    optim_steps("sgd_momentum_dampening", |ps| Box::new(Sgd::new(ps, 0.1).momentum(0.9).dampening(0.1).weight_decay(0.01)), &["momentum_buffer"]);
    optim_steps("sgd_nesterov", |ps| Box::new(Sgd::new(ps, 0.1).momentum(0.9).nesterov(true).weight_decay(0.01)), &["momentum_buffer"]);
    let cfg = AdamConfig { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    optim_steps("adam", |ps| Box::new(Adam::new(ps, cfg)), &["step", "exp_avg", "exp_avg_sq"]);
    optim_steps("adamw", |ps| Box::new(AdamW::new(ps, cfg)), &["step", "exp_avg", "exp_avg_sq"]);
}
