//! A corpus of bad inputs to ops, shapes, autograd and optimisers: every case must return an
//! `Error` whose message names the problem. Each case runs under `catch_unwind`, so a panic is
//! reported by name instead of ending the run, and the test asserts there were none.

use crate::common::*;
use kiln::nn::functional as F;
use kiln::nn::{Embedding, Module};
use kiln::optim::{Adam, AdamConfig, AdamW, Optimizer, Sgd};
use kiln::nn::Conv2dArgs;
use kiln::{DType, Device, Error, Result, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs every case; each must fail with a message containing its word. Reports all failures.
/// A case: its name, a word its error must contain, and the call.
type Case<'a> = (&'a str, &'a str, Box<dyn FnOnce() -> Result<()> + 'a>);

fn run_corpus(cases: Vec<Case<'_>>) {
    let mut problems = vec![];
    let n = cases.len();
    for (name, word, case) in cases {
        match catch_unwind(AssertUnwindSafe(case)) {
            Err(p) => {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                problems.push(format!("{name}: panicked: {msg}"));
            }
            Ok(Ok(())) => problems.push(format!("{name}: accepted")),
            Ok(Err(e)) if !e.to_string().contains(word) => problems.push(format!("{name}: message {:?} does not mention {word:?}", e.to_string())),
            Ok(Err(_)) => {}
        }
    }
    assert!(problems.is_empty(), "{} of {n} cases failed:\n{}", problems.len(), problems.join("\n"));
}

macro_rules! case {
    ($name:expr, $word:expr, $body:expr) => {
        ($name, $word, Box::new(|| -> Result<()> { $body.map(|_| ()) }) as Box<dyn FnOnce() -> Result<()> + '_>)
    };
}

fn f32s(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, &dev()).unwrap()
}

#[test]
fn huge_host_allocations_are_out_of_memory_errors() {
    let big = [1usize << 20, 1 << 20];
    let cpu = Device::Cpu;
    let oom = |r: Result<Tensor>| match r {
        Err(Error::OutOfMemory { .. }) => {}
        other => panic!("expected OutOfMemory, got {:?}", other.map(|t| t.shape().to_vec())),
    };
    oom(Tensor::zeros(&big, DType::F32, &cpu));
    oom(Tensor::ones(&big, DType::F32, &cpu));
    oom(Tensor::full(&big, 2.0, DType::I64, &cpu));
    oom(Tensor::randn(&big, DType::F32, &cpu));
    oom(Tensor::rand(&big, DType::F64, &cpu));
    oom(Tensor::randint(0, 5, &big, &cpu));
    oom(Tensor::arange(0.0, (1u64 << 42) as f64, 1.0, DType::F32, &cpu));
    oom(Tensor::eye(1 << 21, DType::F32, &cpu));
    let x = Tensor::zeros(&[4, 4], DType::F32, &cpu).unwrap();
    oom(x.pad(&[0, 1 << 40, 0, 0], 0.0));
    oom(Tensor::zeros(&[1 << 20], DType::I64, &cpu).unwrap().one_hot(Some(1 << 20)));
    // A broadcast view stands for 4 TiB: reading or copying it is the same error.
    let v = Tensor::zeros(&[1], DType::F32, &cpu).unwrap().broadcast_to(&big).unwrap();
    assert!(matches!(v.to_vec::<f32>(), Err(Error::OutOfMemory { .. })));
    oom(v.contiguous());
}

#[test]
fn overflowing_sizes_are_errors() {
    let d = dev();
    run_corpus(vec![
        case!("broadcast_to 2^80", "overflows", f32s(&[1]).broadcast_to(&[1 << 40, 1 << 40])),
        case!("expand 2^80", "overflows", f32s(&[1, 1]).expand(&[1 << 40, 1 << 40])),
        case!("add broadcasting to 2^80", "overflows", f32s(&[1, 1]).broadcast_to(&[1 << 40, 1]).unwrap().add(&f32s(&[1, 1]).broadcast_to(&[1, 1 << 40]).unwrap())),
        case!("zeros 2^80", "overflows", Tensor::zeros(&[1 << 40, 1 << 40], DType::F32, &d)),
        case!("reshape to a wrapping shape", "reshape", f32s(&[0]).reshape_usize_pub(&[1 << 32, 1 << 32, 0])),
        case!("cat of huge views", "overflows", {
            let v = f32s(&[1, 1]).broadcast_to(&[1 << 59, 1]).unwrap();
            kiln::cat(&[&v; 16], 0)
        }),
        case!("pad i64::MAX", "pad", f32s(&[2, 2]).pad(&[i64::MAX, i64::MAX], 0.0)),
        case!("pad i64::MIN", "pad", f32s(&[2, 2]).pad(&[i64::MIN, 0], 0.0)),
        case!("pad i64::MIN both", "pad", f32s(&[2, 2]).pad(&[i64::MIN, i64::MIN], 0.0)),
        case!("conv2d huge padding", "conv2d", F::conv2d(&f32s(&[1, 1, 3, 3]), &f32s(&[1, 1, 3, 3]), None, Conv2dArgs { padding: (usize::MAX / 2, 1), ..Default::default() })),
        case!("conv2d huge dilation", "conv2d", F::conv2d(&f32s(&[1, 1, 3, 3]), &f32s(&[1, 1, 3, 3]), None, Conv2dArgs { dilation: (usize::MAX / 2, 1), ..Default::default() })),
        case!("max_pool2d huge padding", "max_pool2d", F::max_pool2d(&f32s(&[1, 1, 3, 3]), (3, 3), (1, 1), (usize::MAX / 2 + 1, 0))),
        case!("max_pool2d huge kernel", "max_pool2d", F::max_pool2d(&f32s(&[1, 1, 3, 3]), (usize::MAX, 3), (1, 1), (0, 0))),
        case!("avg_pool2d huge kernel", "avg_pool2d", F::avg_pool2d(&f32s(&[1, 1, 3, 3]), (usize::MAX, 3), (1, 1), (0, 0), true, true)),
        case!("arange of 2^70", "arange", Tensor::arange(0.0, 1e21, 1.0, DType::F32, &d)),
    ]);
}

/// `reshape` with a usize shape through the public i64 form.
trait ReshapeUsize {
    fn reshape_usize_pub(&self, s: &[usize]) -> Result<Tensor>;
}
impl ReshapeUsize for Tensor {
    fn reshape_usize_pub(&self, s: &[usize]) -> Result<Tensor> {
        self.reshape(&s.iter().map(|&d| d as i64).collect::<Vec<_>>())
    }
}

#[test]
fn negative_and_out_of_range_indices_are_errors() {
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::F32);
    let neg = t(&[-1.0], &[1], DType::I64);
    let m = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2], DType::F32);
    // On the GPU a bad index is reported at the next synchronisation: `vals` reads the result.
    let read = |r: Result<Tensor>| r.and_then(|t| t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec::<f64>().map(|_| t));
    let emb = Embedding::new(4, 2, &dev()).unwrap();
    run_corpus(vec![
        case!("index_select -1", "out of range", read(x.index_select(0, &neg))),
        case!("index_select 3", "out of range", read(x.index_select(0, &t(&[3.0], &[1], DType::I64)))),
        case!("gather -1", "out of range", read(x.gather(0, &neg))),
        case!("gather 2-D -3", "out of range", read(m.gather(1, &t(&[0.0, -3.0, 1.0, 0.0], &[2, 2], DType::I64)))),
        case!("scatter_add -1", "out of range", read(x.scatter_add(0, &neg, &t(&[1.0], &[1], DType::F32)))),
        case!("embedding -1", "out of range", read(emb.forward(&t(&[0.0, -1.0], &[2], DType::I64)))),
        case!("embedding 4", "out of range", read(emb.forward(&t(&[4.0], &[1], DType::I64)))),
        case!("one_hot -1", "out of range", t(&[-1.0, 0.0], &[2], DType::I64).one_hot(Some(3))),
        case!("float index", "indices", x.index_select(0, &t(&[0.0], &[1], DType::F32))),
    ]);
}

#[test]
fn dtype_and_autograd_misuse_are_errors() {
    let x = t(&[1.0, 2.0], &[2], DType::F32);
    let p = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
    run_corpus(vec![
        case!("set_grad of another shape", "shape", p.set_grad(Some(t(&[1.0], &[1], DType::F32)))),
        case!("set_grad of another dtype", "dtype", p.set_grad(Some(t(&[1.0, 1.0], &[2], DType::F64)))),
        case!("masked_fill 300 into U8", "overflow", t(&[0.0], &[1], DType::U8).masked_fill(&t(&[1.0], &[1], DType::Bool), 300)),
        case!("masked_fill -1 into U8", "overflow", t(&[0.0], &[1], DType::U8).masked_fill(&t(&[1.0], &[1], DType::Bool), -1)),
        case!("masked_fill 2^40 into I32", "overflow", t(&[0.0], &[1], DType::I32).masked_fill(&t(&[1.0], &[1], DType::Bool), 1i64 << 40)),
        case!("masked_fill with a float mask", "mask", x.masked_fill(&x, 1.0)),
        case!("backward of a non-scalar", "scalar", p.mul_scalar(2.0).unwrap().backward()),
        case!("in-place on a leaf that requires grad", "leaf", p.add_scalar_(1.0)),
        case!("mean of integers", "mean", t(&[1.0], &[1], DType::I64).mean_all()),
        case!("sub of bools", "sub", t(&[1.0], &[1], DType::Bool).sub(&t(&[1.0], &[1], DType::Bool))),
        case!("relu of bools", "relu", t(&[1.0], &[1], DType::Bool).relu()),
        case!("mm of vectors", "mm", x.mm(&x)),
        case!("bmm batch mismatch", "bmm", f32s(&[2, 2, 3]).bmm(&f32s(&[3, 3, 2]))),
        case!("split sizes short", "split", x.split_sizes(&[1], 0)),
        case!("split of a 0-dim tensor", "1-dimensional", t(&[1.0], &[], DType::F32).split(1, 0)),
        case!("split_sizes of a 0-dim tensor", "1-dimensional", t(&[1.0], &[], DType::F32).split_sizes(&[1], 0)),
        case!("chunk of a 0-dim tensor", "1-dimensional", t(&[1.0], &[], DType::F32).chunk(1, -1)),
        case!("cat of an empty 1-D and a 0-dim tensor", "does not match", kiln::cat(&[&f32s(&[0]), &t(&[1.0], &[], DType::F32)], 0)),
        case!("softmax dim 5", "softmax", F::softmax(&x, 5)),
        case!("sdpa 2-D query", "scaled_dot_product_attention", F::scaled_dot_product_attention(&x, &x, &x, &Default::default())),
        case!("bce weight that does not broadcast", "weight", F::binary_cross_entropy_with_logits(&x, &x, Some(&f32s(&[3])), None, F::Reduction::Mean)),
        case!("avg_pool2d padding over half", "padding", F::avg_pool2d(&f32s(&[1, 1, 4, 4]), (2, 2), (1, 1), (2, 2), false, true)),
        case!("max_pool2d dilation 0", "dilation", F::max_pool2d_with(&f32s(&[1, 1, 4, 4]), &F::MaxPool2dArgs { dilation: (0, 1), ..F::MaxPool2dArgs::new((2, 2), (1, 1), (0, 0)) })),
    ]);
}

#[test]
fn optimiser_hyperparameters_are_checked() {
    let p = || {
        let p = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
        p.set_grad(Some(t(&[1.0, 1.0], &[2], DType::F32))).unwrap();
        p
    };
    let adam = |cfg: AdamConfig| -> Result<()> { Adam::new(vec![p()], cfg).step() };
    let adamw = |cfg: AdamConfig| -> Result<()> { AdamW::new(vec![p()], cfg).step() };
    let d = AdamConfig::default();
    run_corpus(vec![
        case!("sgd lr -1", "learning rate", Sgd::new(vec![p()], -1.0).step()),
        case!("sgd lr NaN", "learning rate", Sgd::new(vec![p()], f64::NAN).step()),
        case!("sgd momentum -0.5", "momentum", Sgd::new(vec![p()], 0.1).momentum(-0.5).step()),
        case!("sgd weight decay -1", "weight_decay", Sgd::new(vec![p()], 0.1).weight_decay(-1.0).step()),
        case!("sgd nesterov without momentum", "Nesterov", Sgd::new(vec![p()], 0.1).nesterov(true).step()),
        case!("sgd nesterov with dampening", "Nesterov", Sgd::new(vec![p()], 0.1).momentum(0.9).dampening(0.1).nesterov(true).step()),
        case!("adam lr -1", "learning rate", adam(AdamConfig { lr: -1.0, ..d })),
        case!("adam lr NaN", "learning rate", adam(AdamConfig { lr: f64::NAN, ..d })),
        case!("adam beta1 1", "beta", adam(AdamConfig { beta1: 1.0, ..d })),
        case!("adam beta2 -0.1", "beta", adam(AdamConfig { beta2: -0.1, ..d })),
        case!("adam eps -1", "epsilon", adam(AdamConfig { eps: -1e-8, ..d })),
        case!("adam weight decay -1", "weight_decay", adam(AdamConfig { weight_decay: -1.0, ..d })),
        case!("adamw beta1 NaN", "beta", adamw(AdamConfig { beta1: f64::NAN, ..d })),
    ]);
    // A failed step changes nothing.
    let q = p();
    assert!(Sgd::new(vec![q.clone()], -1.0).step().is_err());
    assert_eq!(vals(&q), vec![1.0, 2.0]);
    // Valid settings still step.
    Sgd::new(vec![q.clone()], 0.5).momentum(0.9).nesterov(true).step().unwrap();
    assert_close(&vals(&q), &[1.0 - 0.5 * 1.9, 2.0 - 0.5 * 1.9], 1e-6, 1e-6);
}

/// Every method that takes a dim, on a 0-dim and an empty tensor with dims in and out of range:
/// a value or an error, never a panic.
#[test]
fn dim_methods_never_panic_on_0_dim_or_empty_tensors() {
    let mut panics = vec![];
    for shape in [&[][..], &[0][..], &[2, 0][..]] {
        let x = Tensor::zeros(shape, DType::F32, &dev()).unwrap();
        let idx = Tensor::zeros(shape, DType::I64, &dev()).unwrap();
        for d in [-3i64, -2, -1, 0, 1, 2] {
            type Call<'a> = (&'a str, Box<dyn Fn() -> Result<Tensor> + 'a>);
            let calls: Vec<Call> = vec![
                ("sum", Box::new(|| x.sum(&[d], false))),
                ("mean", Box::new(|| x.mean(&[d], true))),
                ("prod", Box::new(|| x.prod(d, false))),
                ("amax", Box::new(|| x.amax(&[d], false))),
                ("argmax", Box::new(|| x.argmax(d, false))),
                ("argmin", Box::new(|| x.argmin(d, true))),
                ("max", Box::new(|| x.max(d, false).map(|r| r.0))),
                ("var", Box::new(|| x.var(&[d], 1.0, false))),
                ("std", Box::new(|| x.std(&[d], 0.0, false))),
                ("logsumexp", Box::new(|| x.logsumexp(&[d], false))),
                ("cumsum", Box::new(|| x.cumsum(d))),
                ("cumprod", Box::new(|| x.cumprod(d))),
                ("softmax", Box::new(|| F::softmax(&x, d))),
                ("log_softmax", Box::new(|| F::log_softmax(&x, d))),
                ("squeeze", Box::new(|| x.squeeze(d))),
                ("squeeze_dims", Box::new(|| x.squeeze_dims(&[d]))),
                ("unsqueeze", Box::new(|| x.unsqueeze(d))),
                ("transpose", Box::new(|| x.transpose(d, 0))),
                ("flatten", Box::new(|| x.flatten(d, -1))),
                ("narrow", Box::new(|| x.narrow(d, 0, 0))),
                ("slice", Box::new(|| x.slice(d, 0, 1, 1))),
                ("split", Box::new(|| x.split(1, d).map(|v| v.into_iter().next().unwrap_or_else(|| x.clone())))),
                ("chunk", Box::new(|| x.chunk(2, d).map(|v| v.into_iter().next().unwrap_or_else(|| x.clone())))),
                ("cat", Box::new(|| kiln::cat(&[&x, &x], d))),
                ("stack", Box::new(|| kiln::stack(&[&x, &x], d))),
                ("index_select", Box::new(|| x.index_select(d, &Tensor::zeros(&[0], DType::I64, &dev()).unwrap()))),
                ("gather", Box::new(|| x.gather(d, &idx))),
                ("scatter_add", Box::new(|| x.scatter_add(d, &idx, &x))),
            ];
            for (name, call) in calls {
                if catch_unwind(AssertUnwindSafe(|| {
                    let _ = call().and_then(|y| y.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec::<f64>());
                }))
                .is_err()
                {
                    panics.push(format!("{name} of shape {shape:?} along dim {d}"));
                }
            }
        }
    }
    assert!(panics.is_empty(), "panicked: {panics:?}");
}
