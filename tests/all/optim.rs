//! Optimisers' multi-tensor steps (`foreach`, the default) against their per-tensor steps
//! (`foreach(false)`): the same parameters and state bit for bit, in every parameter dtype, and
//! a kernel launch or a few per step whatever the number of parameters (on the CPU, one pass
//! per group of parameters).

use crate::common::*;
use kiln::optim::{Adam, AdamConfig, AdamW, Optimizer, Sgd};
use kiln::{DType, Tensor};

#[derive(Clone, Copy, Debug)]
enum Kind {
    Sgd,
    SgdNesterov,
    SgdDampening,
    Adam,
    AdamW,
}
const KINDS: [Kind; 5] = [Kind::Sgd, Kind::SgdNesterov, Kind::SgdDampening, Kind::Adam, Kind::AdamW];

fn make(kind: Kind, params: Vec<Tensor>, foreach: bool) -> Box<dyn Optimizer> {
    let cfg = AdamConfig { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    match kind {
        Kind::Sgd => Box::new(Sgd::new(params, 0.1).foreach(foreach)),
        Kind::SgdNesterov => Box::new(Sgd::new(params, 0.1).momentum(0.9).nesterov(true).weight_decay(0.01).foreach(foreach)),
        Kind::SgdDampening => Box::new(Sgd::new(params, 0.1).momentum(0.9).dampening(0.1).foreach(foreach)),
        Kind::Adam => Box::new(Adam::new(params, cfg).foreach(foreach)),
        Kind::AdamW => Box::new(AdamW::new(params, cfg).foreach(foreach)),
    }
}

/// A leaf on the test device with values drawn from `seed`.
fn leaf(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    t(&host_rand(shape.iter().product(), seed), shape, dtype).requires_grad()
}

/// What a run leaves: each parameter's values, the state dict's values by name, and the
/// kernels each step launched (0 on the CPU).
struct Run {
    params: Vec<Vec<f64>>,
    state: Vec<(String, Vec<f64>)>,
    launches: Vec<u64>,
}

/// `steps` steps over `params` (made fresh for each run), with the gradient `grad(step, k)` of
/// parameter k (none: it has no gradient that step).
fn run(kind: Kind, params: &dyn Fn() -> Vec<Tensor>, foreach: bool, steps: usize, grad: &dyn Fn(usize, usize, &Tensor) -> Option<Tensor>) -> Run {
    let ps = params();
    let mut opt = make(kind, ps.clone(), foreach);
    let mut launches = vec![];
    for step in 0..steps {
        for (k, p) in ps.iter().enumerate() {
            p.set_grad(grad(step, k, p)).unwrap();
        }
        let before = kiln::cuda::launch_count();
        let prof = kiln::profiler::profile(|| opt.step()).unwrap();
        // Kernels launched on a GPU; the host's updates, as the profiler records them.
        launches.push(if dev().is_cuda() { kiln::cuda::launch_count() - before } else { prof.kernel_count() as u64 });
    }
    let state = opt.state_dict().unwrap().into_iter().map(|(n, t)| (n, vals(&t))).collect();
    Run { params: ps.iter().map(vals).collect(), state, launches }
}

/// A gradient like `p` (contiguous, its dtype) from `seed`.
fn grad_like(p: &Tensor, seed: u64) -> Tensor {
    t(&host_rand(p.numel(), seed), p.shape(), p.dtype())
}

/// Equal values, NaN where the other has NaN (F16 Adam with eps 1e-8 divides by a zero
/// denominator where the second moment underflows, in both paths).
fn same(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
}

#[track_caller]
fn assert_same(kind: Kind, what: &str, a: &Run, b: &Run) {
    assert_eq!(a.params.len(), b.params.len());
    for (k, (x, y)) in a.params.iter().zip(&b.params).enumerate() {
        assert!(same(x, y), "{kind:?} {what}: parameter {k} differs between the multi-tensor and the per-tensor step");
    }
    assert_eq!(a.state.iter().map(|s| &s.0).collect::<Vec<_>>(), b.state.iter().map(|s| &s.0).collect::<Vec<_>>(), "{kind:?} {what}: state names");
    for ((n, x), (_, y)) in a.state.iter().zip(&b.state) {
        assert!(same(x, y), "{kind:?} {what}: {n} differs between the multi-tensor and the per-tensor step");
    }
}

#[test]
fn optim_foreach_steps_match_per_tensor_steps_in_every_dtype() {
    // The last is split across cores on the host.
    let sizes: [&[usize]; 5] = [&[1], &[7], &[10, 100], &[70000], &[300_000]];
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let params = || sizes.iter().enumerate().map(|(k, s)| leaf(s, dtype, 1 + k as u64)).collect::<Vec<_>>();
        let grad = |step: usize, k: usize, p: &Tensor| Some(grad_like(p, 100 * step as u64 + k as u64));
        for kind in KINDS {
            let fused = run(kind, &params, true, 5, &grad);
            let single = run(kind, &params, false, 5, &grad);
            assert_same(kind, &format!("{dtype:?}"), &fused, &single);
            // Every parameter in one launch (on the host, one pass), on the first step too (new
            // state is a memset or is written by the kernel).
            assert_eq!(fused.launches, vec![1; 5], "{kind:?} {dtype:?}: kernels per step");
            assert!(single.launches.iter().all(|&n| n >= 4), "{kind:?} {dtype:?}: the per-tensor step launches per parameter: {:?}", single.launches);
        }
    }
}

#[test]
fn optim_foreach_launches_do_not_grow_with_the_number_of_parameters() {
    // 300 parameters need more than one table (a launch holds up to about a hundred).
    let params = || (0..300).map(|k| leaf(&[1 + (k * 37) % 300], DType::F32, k as u64)).collect::<Vec<_>>();
    let grad = |step: usize, k: usize, p: &Tensor| Some(grad_like(p, 1000 * step as u64 + k as u64));
    for kind in [Kind::Sgd, Kind::SgdNesterov, Kind::AdamW] {
        let fused = run(kind, &params, true, 3, &grad);
        let single = run(kind, &params, false, 3, &grad);
        assert_same(kind, "300 parameters", &fused, &single);
        if dev().is_cuda() {
            assert!(fused.launches.iter().all(|&n| (1..=4).contains(&n)), "{kind:?}: kernels per step {:?}", fused.launches);
            assert!(single.launches.iter().all(|&n| n >= 300), "{kind:?}: {:?}", single.launches);
        }
    }
}

#[test]
fn optim_foreach_falls_back_per_parameter_and_groups_the_rest() {
    // An F32 parameter; a transposed (non-contiguous) one, which takes the per-tensor path; a
    // BF16 and an F64 one (groups of their own); and one without a gradient on steps 0 and 2,
    // so that its momentum buffer is new, and its Adam step count behind, when the others' are
    // not.
    let params = || {
        let transposed = t(&host_rand(600, 2), &[30, 20], DType::F32).t().unwrap().requires_grad();
        assert!(!transposed.is_contiguous());
        vec![leaf(&[1000], DType::F32, 1), transposed, leaf(&[7], DType::BF16, 3), leaf(&[3, 5], DType::F64, 4), leaf(&[33], DType::F32, 5)]
    };
    let grad = |step: usize, k: usize, p: &Tensor| (k != 4 || step % 2 == 1).then(|| grad_like(p, 10 * step as u64 + k as u64));
    for kind in KINDS {
        let fused = run(kind, &params, true, 5, &grad);
        let single = run(kind, &params, false, 5, &grad);
        assert_same(kind, "mixed parameters", &fused, &single);
        if dev().is_cuda() {
            // F32, BF16 and F64 groups, the F32 one split in two on the steps where the last
            // parameter's state differs; the transposed parameter adds its own ops.
            assert!(fused.launches.iter().all(|&n| n < single.launches[0]), "{kind:?}: {:?} against {:?}", fused.launches, single.launches);
        }
    }
}

#[test]
fn optim_foreach_step_bumps_versions_so_saved_tensors_are_checked() {
    for kind in KINDS {
        let p = leaf(&[50], DType::F32, 9);
        let mut opt = make(kind, vec![p.clone()], true);
        for _ in 0..2 {
            // `y` saves `p` for its backward; the step changes `p` in place.
            let y = p.mul(&p).unwrap().sum_all().unwrap();
            p.mul(&p).unwrap().sum_all().unwrap().backward().unwrap();
            let v = p.version();
            opt.step().unwrap();
            assert!(p.version() > v, "{kind:?}: the step bumps the parameter's version");
            let e = y.backward().unwrap_err().to_string();
            assert!(e.contains("modified by an inplace operation"), "{kind:?}: {e}");
            opt.zero_grad();
        }
    }
    // The state is updated in place too.
    let p = leaf(&[50], DType::F32, 9);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::default());
    p.set_grad(Some(grad_like(&p, 1))).unwrap();
    opt.step().unwrap();
    let m = opt.state()[0].as_ref().unwrap().exp_avg.clone();
    let v = m.version();
    opt.step().unwrap();
    assert!(m.version() > v, "exp_avg's version");
}

#[test]
fn optim_foreach_continues_adam_state_made_by_a_compiled_step() {
    // A compiled step keeps Adam's count on the device; an eager step after it reads that count
    // (the per-tensor ops) and continues from it.
    let x = t(&host_rand(64, 4), &[64], DType::F32);
    let loss = |p: &Tensor| p.mul(&x)?.mul(p)?.sum_all();
    let p = leaf(&[64], DType::F32, 3);
    let opt = std::sync::Mutex::new(AdamW::with_lr(vec![p.clone()], 0.01));
    let step = kiln::compile::compile(|x: &Tensor| {
        let l = p.mul(x)?.mul(&p)?.sum_all()?;
        l.backward()?;
        let mut o = opt.lock().unwrap();
        o.step()?;
        o.zero_grad();
        Ok(l)
    });
    for _ in 0..3 {
        step.call(&x).unwrap();
    }
    let mut opt = opt.into_inner().unwrap();
    assert!(opt.state()[0].as_ref().unwrap().step_tensor.is_some());
    loss(&p).unwrap().backward().unwrap();
    opt.step().unwrap();
    assert_eq!(opt.state()[0].as_ref().unwrap().steps().unwrap(), 4);
    // The same four steps eagerly.
    let q = leaf(&[64], DType::F32, 3);
    let mut eager = AdamW::with_lr(vec![q.clone()], 0.01);
    for _ in 0..4 {
        loss(&q).unwrap().backward().unwrap();
        eager.step().unwrap();
        eager.zero_grad();
    }
    assert_close(&vals(&p), &vals(&q), 1e-5, 1e-6);
}

/// A CPU training loop reuses its large buffers through the host caching allocator: after the
/// first step, each step's fresh outputs (gradients of a 1 MiB weight, activations) come from
/// the cache. The layer's sizes are this test's own, so no other test takes its buffers.
#[test]
fn a_cpu_training_loop_takes_its_buffers_from_the_host_cache() -> kiln::Result<()> {
    use kiln::{nn, nn::Module, optim, Device};
    let cpu = Device::Cpu;
    kiln::manual_seed(0);
    let model = nn::Sequential::new().add(nn::Linear::new(777, 333, &cpu)?).add(nn::ReLU).add(nn::Linear::new(333, 7, &cpu)?);
    let (x, y) = (Tensor::randn(&[97, 777], DType::F32, &cpu)?, Tensor::randint(0, 7, &[97], &cpu)?);
    let mut opt = optim::Sgd::new(model.parameters(), 0.01);
    let mut step = || -> kiln::Result<()> {
        nn::functional::cross_entropy(&model.forward(&x)?, &y)?.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(())
    };
    step()?;
    let before = kiln::cpu::memory_stats();
    for _ in 0..4 {
        step()?;
    }
    let after = kiln::cpu::memory_stats();
    // Other tests only add hits: at least one per step of this loop is its own.
    assert!(after.hits >= before.hits + 4, "{before:?} -> {after:?}");
    Ok(())
}
