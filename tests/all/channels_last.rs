//! Channels-last (`MemoryFormat::ChannelsLast`): the strides and checks PyTorch gives, the
//! format kept through elementwise ops, convolutions, batch norm and pooling (forward and
//! backward), and every result equal to the same computation on contiguous tensors.
//! Tolerances: F32; the CPU computes both formats in the same order (equal up to rounding of
//! sums taken in other orders by the reductions), cuDNN picks other algorithms per format.

use crate::common::{assert_close_named, dev, host_rand, t, vals};
use kiln::compile::compile;
use kiln::nn::{self, functional as F, Conv2dArgs, Module};
use kiln::optim::{Optimizer, Sgd};
use kiln::{DType, MemoryFormat, Result, Tensor};
use std::sync::Arc;

const CL: MemoryFormat = MemoryFormat::ChannelsLast;
const RTOL: f64 = 1e-4;
const ATOL: f64 = 1e-5;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    t(&host_rand(shape.iter().product(), seed), shape, DType::F32)
}

#[track_caller]
fn same(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.shape(), b.shape(), "{what}: shapes");
    assert_close_named(what, &vals(a), &vals(b), RTOL, ATOL);
}

#[track_caller]
fn is_cl(what: &str, x: &Tensor) {
    assert_eq!(x.suggest_memory_format(), CL, "{what}: strides {:?} of shape {:?} are not channels-last", x.strides(), x.shape());
}

#[test]
fn channels_last_strides_and_checks_are_pytorchs() -> Result<()> {
    let x = rand(&[2, 3, 4, 5], 1);
    let y = x.to_memory_format(CL)?;
    assert_eq!(y.strides(), [60, 1, 15, 3]);
    assert!(!y.is_contiguous() && y.is_contiguous_for(CL) && !x.is_contiguous_for(CL));
    assert_eq!((x.suggest_memory_format(), y.suggest_memory_format()), (MemoryFormat::Contiguous, CL));
    same("to channels-last", &y, &x);
    // Already channels-last: the same tensor; back to contiguous: NCHW strides.
    assert!(y.to_memory_format(CL)?.shares_storage_with(&y));
    let back = y.contiguous()?;
    assert_eq!(back.strides(), [60, 20, 5, 1]);
    same("back to contiguous", &back, &x);
    // A window of a channels-last tensor is still ordered so; a 1x1 image is contiguous.
    is_cl("a window", &y.narrow(2, 1, 2)?.narrow(3, 0, 3)?);
    assert_eq!(rand(&[2, 3, 1, 1], 2).to_memory_format(CL)?.suggest_memory_format(), MemoryFormat::Contiguous);
    let e = rand(&[3, 4, 5], 3).to_memory_format(CL).unwrap_err().to_string();
    assert!(e.contains("4-D") && e.contains("[3, 4, 5]"), "{e}");
    Ok(())
}

#[test]
fn elementwise_ops_keep_the_format_of_their_first_full_input() -> Result<()> {
    let x = rand(&[2, 3, 4, 5], 4);
    let o = rand(&[2, 3, 4, 5], 5);
    let bias = rand(&[1, 3, 1, 1], 6);
    let xc = x.to_memory_format(CL)?;
    let ys = [
        ("relu", xc.relu()?, x.relu()?),
        ("add", xc.add(&o)?, x.add(&o)?),
        ("per-channel bias first", bias.add(&xc)?, bias.add(&x)?),
        ("scalar", xc.mul_scalar(3.0)?, x.mul_scalar(3.0)?),
        ("where", xc.gt_scalar(0.0)?.where_(&xc, &o)?, x.gt_scalar(0.0)?.where_(&x, &o)?),
        ("to_dtype", xc.to_dtype(DType::F64)?, x.to_dtype(DType::F64)?),
        ("pad", xc.pad(&[1, 2, 0, 1], 0.5)?, x.pad(&[1, 2, 0, 1], 0.5)?),
        ("zeros_like", xc.zeros_like()?, x.zeros_like()?),
    ];
    for (what, got, want) in &ys {
        is_cl(what, got);
        same(what, got, want);
    }
    // A contiguous first operand decides; a copy is contiguous.
    assert!(o.add(&xc)?.is_contiguous());
    assert!(xc.copy_contiguous()?.is_contiguous());
    Ok(())
}

#[test]
fn convolutions_in_channels_last_equal_contiguous_ones_with_their_gradients() -> Result<()> {
    let cases = [
        ([2, 4, 9, 7], [6, 4, 3, 3], Conv2dArgs { stride: (2, 1), padding: (1, 1), ..Default::default() }),
        ([2, 4, 6, 6], [8, 2, 3, 3], Conv2dArgs { groups: 2, dilation: (2, 1), padding: (2, 0), ..Default::default() }),
        ([3, 8, 5, 5], [4, 8, 1, 1], Conv2dArgs::default()),
    ];
    for (i, (xs, ws, args)) in cases.into_iter().enumerate() {
        let x = rand(&xs, 10 + i as u64).requires_grad();
        let w = rand(&ws, 20 + i as u64).requires_grad();
        let b = rand(&[ws[0]], 30 + i as u64).requires_grad();
        let xc = x.detach().to_memory_format(CL)?.requires_grad();
        let wc = w.detach().to_memory_format(CL)?.requires_grad();
        let bc = b.detach().requires_grad();
        let y = F::conv2d(&x, &w, Some(&b), args)?;
        let yc = F::conv2d(&xc, &wc, Some(&bc), args)?;
        is_cl("conv output", &yc);
        assert_eq!(y.suggest_memory_format(), MemoryFormat::Contiguous, "a contiguous convolution stays contiguous");
        same(&format!("case {i}: output"), &yc, &y);
        let r = rand(y.shape(), 40 + i as u64);
        y.mul(&r)?.sum_all()?.backward()?;
        yc.mul(&r)?.sum_all()?.backward()?;
        is_cl("input gradient", &xc.grad().unwrap());
        for (what, a, b) in [("dx", &xc, &x), ("dw", &wc, &w), ("db", &bc, &b)] {
            same(&format!("case {i}: {what}"), &a.grad().unwrap(), &b.grad().unwrap());
        }
        // Only the input channels-last (the weight contiguous) is channels-last too.
        is_cl("conv of a channels-last input", &F::conv2d(&xc.detach(), &w.detach(), None, args)?);
    }
    Ok(())
}

#[test]
fn batch_norm_and_pooling_keep_channels_last_and_their_values() -> Result<()> {
    let x = rand(&[3, 4, 7, 6], 50).requires_grad();
    let xc = x.detach().to_memory_format(CL)?.requires_grad();
    let (w, b) = (rand(&[4], 51), rand(&[4], 52));
    let stats = || -> Result<(Tensor, Tensor)> { Ok((rand(&[4], 53).mul_scalar(0.1)?, rand(&[4], 54).abs()?.add_scalar(0.5)?)) };
    let ((rm, rv), (rmc, rvc)) = (stats()?, stats()?);
    let outs = |x: &Tensor, rm: &Tensor, rv: &Tensor| -> Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![
            ("batch norm (training)", F::batch_norm(x, Some(rm), Some(rv), Some(&w), Some(&b), true, 0.1, 1e-5)?),
            ("batch norm (eval)", F::batch_norm(x, Some(rm), Some(rv), Some(&w), Some(&b), false, 0.1, 1e-5)?),
            ("max pool", F::max_pool2d(x, (3, 2), (2, 2), (1, 1))?),
            ("avg pool", F::avg_pool2d(x, (2, 2), (2, 2), (0, 0), false, true)?),
            ("adaptive avg pool", F::adaptive_avg_pool2d(x, (1, 1))?),
        ])
    };
    let (plain, cl) = (outs(&x, &rm, &rv)?, outs(&xc, &rmc, &rvc)?);
    let r: Vec<Tensor> = plain.iter().enumerate().map(|(i, (_, y))| rand(y.shape(), 60 + i as u64)).collect();
    let loss = |ys: &[(&str, Tensor)]| -> Result<()> { ys.iter().zip(&r).try_fold(Tensor::scalar(0.0, DType::F32, &dev())?, |acc, ((_, y), r)| acc.add(&y.mul(r)?.sum_all()?))?.backward() };
    loss(&plain)?;
    loss(&cl)?;
    for ((what, want), (_, got)) in plain.iter().zip(&cl) {
        if !what.starts_with("adaptive") {
            is_cl(what, got);
        }
        same(what, got, want);
    }
    same("running mean", &rmc, &rm);
    same("running var", &rvc, &rv);
    same("input gradient", &xc.grad().unwrap(), &x.grad().unwrap());
    Ok(())
}

#[test]
fn max_pool_of_any_channel_count_keeps_its_values_channels_last() -> Result<()> {
    // Channels-last threads take 8, 4, 2 or 1 channels each (whichever divides C).
    for (k, c) in [16, 6, 5].into_iter().enumerate() {
        let x = rand(&[2, c, 9, 7], 80 + k as u64).requires_grad();
        let xc = x.detach().to_memory_format(CL)?.requires_grad();
        let (y, yc) = (F::max_pool2d(&x, (3, 3), (2, 2), (1, 1))?, F::max_pool2d(&xc, (3, 3), (2, 2), (1, 1))?);
        is_cl("max pool", &yc);
        same(&format!("max pool of {c} channels"), &yc, &y);
        let r = rand(y.shape(), 90 + k as u64);
        y.mul(&r)?.sum_all()?.backward()?;
        yc.mul(&r)?.sum_all()?.backward()?;
        same(&format!("max pool gradient of {c} channels"), &xc.grad().unwrap(), &x.grad().unwrap());
    }
    Ok(())
}

/// Two copies of one bottleneck block (with a downsample path), the second channels-last.
fn two_blocks() -> Result<(nn::Bottleneck, nn::Bottleneck)> {
    let d = dev();
    let a = nn::Bottleneck::new(8, 4, 2, &d)?;
    let mut b = nn::Bottleneck::new(8, 4, 2, &d)?;
    b.load_state_dict(&a.state_dict())?;
    b.to_memory_format(CL)?;
    assert!(b.named_parameters().iter().filter(|(_, p)| p.ndim() == 4).all(|(_, p)| p.is_contiguous_for(CL)));
    Ok((a, b))
}

#[test]
fn a_channels_last_bottleneck_trains_as_a_contiguous_one() -> Result<()> {
    let (a, b) = two_blocks()?;
    let x = rand(&[2, 8, 10, 10], 70);
    let xc = x.to_memory_format(CL)?;
    let sgd = |m: &nn::Bottleneck| Sgd::new(m.parameters(), 0.05).momentum(0.9).weight_decay(1e-4);
    let (mut oa, mut ob) = (sgd(&a), sgd(&b));
    for step in 0..3 {
        let (ya, yb) = (a.forward(&x)?, b.forward(&xc)?);
        is_cl("block output", &yb);
        same(&format!("step {step}: output"), &yb, &ya);
        ya.square()?.mean_all()?.backward()?;
        yb.square()?.mean_all()?.backward()?;
        oa.step()?;
        ob.step()?;
        oa.zero_grad();
        ob.zero_grad();
    }
    for ((name, pa), (_, pb)) in a.state_dict().iter().zip(b.state_dict()) {
        same(name, &pb, pa);
    }
    // The update kept the parameters channels-last.
    assert!(b.named_parameters().iter().filter(|(_, p)| p.ndim() == 4).all(|(_, p)| p.is_contiguous_for(CL)));
    Ok(())
}

#[test]
fn a_compiled_step_of_a_channels_last_block_equals_eager() -> Result<()> {
    let (a, b) = two_blocks()?;
    let x = rand(&[2, 8, 10, 10], 80);
    let xc = x.to_memory_format(CL)?;
    let sgd = |m: &nn::Bottleneck| Sgd::new(m.parameters(), 0.05).momentum(0.9);
    let step_of = |m: &nn::Bottleneck, opt: &mut Sgd, x: &Tensor| -> Result<Tensor> {
        let loss = m.forward(x)?.square()?.mean_all()?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss)
    };
    let mut oa = sgd(&a);
    let b = Arc::new(b);
    let ob = Arc::new(std::sync::Mutex::new(sgd(&b)));
    let (m, o) = (b.clone(), ob.clone());
    let step = compile(move |x: &Tensor| step_of(&m, &mut o.lock().unwrap(), x));
    for i in 0..3 {
        let want = step_of(&a, &mut oa, &x)?;
        same(&format!("loss {i}"), &step.call(&xc)?, &want);
    }
    for ((name, pa), (_, pb)) in a.state_dict().iter().zip(b.state_dict()) {
        same(name, &pb, pa);
    }
    // The momentum buffers the compiled first call made hold eager's values.
    let state_b = ob.lock().unwrap().state_dict()?;
    for ((name, sa), (_, sb)) in oa.state_dict()?.iter().zip(&state_b) {
        same(name, sb, sa);
    }
    assert!(state_b.iter().any(|(_, t)| t.ndim() == 4), "the block's convolutions have momentum buffers");
    Ok(())
}

#[test]
fn state_a_compiled_call_copies_channels_last_is_channels_last() -> Result<()> {
    // A tensor made inside a compiled call and kept after it (an optimiser's new state): laid
    // out as the copy asked, with the values it was given.
    let x = rand(&[2, 3, 4, 5], 81);
    let kept: Arc<std::sync::Mutex<Vec<Tensor>>> = Default::default();
    let k2 = kept.clone();
    let f = compile(move |x: &Tensor| {
        let y = x.mul_scalar(2.0)?;
        k2.lock().unwrap().extend([y.to_memory_format(CL)?, y.add_scalar(1.0)?]);
        y.sum_all()
    });
    f.call(&x)?;
    let kept = kept.lock().unwrap();
    assert!(kept[0].is_contiguous_for(CL), "strides {:?}", kept[0].strides());
    assert!(kept[1].is_contiguous(), "strides {:?}", kept[1].strides());
    same("the channels-last copy", &kept[0], &x.mul_scalar(2.0)?);
    same("the other", &kept[1], &x.mul_scalar(2.0)?.add_scalar(1.0)?);
    Ok(())
}
