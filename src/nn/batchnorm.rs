//! Batch normalisation over the channels of `[N, C, H, W]` (`nn.BatchNorm2d`): batch
//! statistics and running-statistics updates in training, running statistics in eval.

use super::Module;
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// `F.batch_norm` over dim 1 of `x` (`[N, C, ...]`). In training the batch's statistics
/// normalise (biased variance) and, when given, the running ones are updated in place with
/// the unbiased variance: `r = (1 - momentum) r + momentum * stat`. Computed in F32 for
/// F16/BF16 inputs; the result has the input's dtype.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let op = "batch_norm";
    if x.ndim() < 2 || !x.dtype().is_float() {
        return Err(Error::shape(op, format!("expected a floating-point input of at least 2 dims [N, C, ...], got {:?} {:?}", x.shape(), x.dtype())));
    }
    super::functional::same_device(op, x, &[running_mean, running_var, weight, bias])?;
    let c = x.shape()[1];
    for (name, t) in [("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            if t.shape() != [c] {
                return Err(Error::shape(op, format!("{name} of shape {:?} for {c} channels (input {:?})", t.shape(), x.shape())));
            }
        }
    }
    let per_channel = |t: &Tensor| per_channel(t, x);
    let plus_bias = |y: Tensor| -> Result<Tensor> {
        match bias {
            Some(b) => y.add(&per_channel(b)?),
            None => Ok(y),
        }
    };
    let y = if training {
        let n = x.numel() / c.max(1);
        if n <= 1 {
            return Err(Error::shape(op, format!("expected more than 1 value per channel when training, got input {:?}", x.shape())));
        }
        let dims: Vec<i64> = (0..x.ndim() as i64).filter(|&d| d != 1).collect();
        // The batch's statistics, two passes in F32; their gradient is part of BatchNormTrain's.
        // Half inputs are converted where they are read (the cast feeds the mean alone, and the
        // centred values promote against the F32 mean): compiled, each pass is one reduction
        // kernel reading x, with no F32 copy of x between them.
        let (mean, var) = no_grad(|| -> Result<(Tensor, Tensor)> {
            let mean = x.to_dtype(x.dtype().compute_dtype())?.mean(&dims, true)?;
            let centered = x.sub(&mean)?;
            Ok((mean, centered.mul(&centered)?.mean(&dims, true)?))
        })?;
        if let (Some(rm), Some(rv)) = (running_mean, running_var) {
            no_grad(|| -> Result<()> {
                let unbiased = var.mul_scalar(n as f64 / (n - 1) as f64)?.reshape_usize(&[c])?;
                rm.mul_scalar_(1.0 - momentum)?;
                rm.add_(&mean.reshape_usize(&[c])?.mul_scalar(momentum)?.to_dtype(rm.dtype())?)?;
                rv.mul_scalar_(1.0 - momentum)?;
                rv.add_(&unbiased.mul_scalar(momentum)?.to_dtype(rv.dtype())?)
            })?;
        }
        let invstd = no_grad(|| var.add_scalar(eps)?.rsqrt())?;
        let mut inputs = vec![x, &mean, &invstd];
        inputs.extend(weight);
        inputs.extend(bias);
        let f = BatchNormTrain { dims, n, c, weight: weight.is_some(), bias: bias.map(|b| b.dtype()) };
        return crate::autograd::Function::apply(f, &inputs);
    } else {
        let (rm, rv) = match (running_mean, running_var) {
            (Some(rm), Some(rv)) => (per_channel(rm)?, per_channel(rv)?),
            _ => return Err(Error::arg(op, "evaluation mode needs running_mean and running_var")),
        };
        // x * scale + (b - mean * scale); half inputs promote against the F32 per-channel
        // tensors, so this computes in F32 without a separate cast of x.
        let scale = scale(&rv.add_scalar(eps)?.rsqrt()?, weight, x)?;
        let shift = plus_bias(rm.mul(&scale)?.neg()?)?;
        let differentiable = crate::is_grad_enabled() && [Some(x), weight, bias].into_iter().flatten().any(|t| t.is_requires_grad());
        if x.device().is_cuda() && !differentiable && !crate::compile::tracing() && scale.dtype() == DType::F32 {
            // Inference on the GPU: one pass over x, in F32, stored in x's dtype.
            let (scale, shift) = (scale.broadcast_to(x.shape())?, shift.broadcast_to(x.shape())?);
            if let Some(y) = crate::backend::scale_shift(x, &scale, &shift)? {
                return Ok(y);
            }
        }
        x.mul(&scale)?.add(&shift)?
    };
    y.to_dtype(x.dtype())
}

/// `conv` followed by `bn` in evaluation mode, as one convolution (PyTorch's
/// `torch.nn.utils.fuse_conv_bn_eval`): each output channel's weights scaled by
/// `weight / sqrt(running_var + eps)` and its bias moved to
/// `(bias - running_mean) * that scale + bn.bias`. Computed in F32 (or F64 for F64 weights) and
/// stored in the convolution's dtype and memory format; the new tensors are leaves that require
/// gradients when `conv`'s weight does. For inference: a folded network computes one pass less
/// per convolution, and a training-mode batch norm cannot be folded at all.
pub fn fuse_conv_bn_eval(conv: &super::Conv2d, bn: &BatchNorm2d) -> Result<super::Conv2d> {
    let w = &conv.weight;
    no_grad(|| {
        let (weight, bias) = fold(conv, bn)?;
        let weight = weight.copy_in(w.dense_format().unwrap_or(crate::MemoryFormat::Contiguous))?;
        let bias = bias.to_dtype(conv.bias.as_ref().map_or(w.dtype(), |b| b.dtype()))?;
        let grad = w.is_requires_grad();
        let leaf = |t: Tensor| if grad { t.requires_grad() } else { t };
        Ok(super::Conv2d { weight: leaf(weight), bias: Some(leaf(bias)), args: conv.args })
    })
}

/// `bn` (evaluation mode) folded into `conv`: the scaled weight in the convolution weight's
/// dtype (and memory format), and the bias in F32 (F64 for F64 weights). Differentiable in
/// every parameter (the ops are recorded unless the caller turns gradients off).
pub(crate) fn fold(conv: &super::Conv2d, bn: &BatchNorm2d) -> Result<(Tensor, Tensor)> {
    let op = "fuse_conv_bn_eval";
    let out = conv.weight.shape()[0];
    if bn.running_mean.shape() != [out] {
        return Err(Error::shape(op, format!("a batch norm of {:?} channels after a convolution of {out} output channels", bn.running_mean.shape())));
    }
    if bn.training.load(Ordering::Relaxed) {
        return Err(Error::arg(op, "the batch norm is in training mode: its batch statistics cannot be folded (call eval() first)"));
    }
    let w = &conv.weight;
    let compute = if w.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let f = |t: &Tensor| t.to_dtype(compute);
    let scale = f(&bn.running_var)?.add_scalar(bn.eps)?.rsqrt()?.mul(&f(&bn.weight)?)?;
    let weight = f(w)?.mul(&scale.reshape_usize(&[out, 1, 1, 1])?)?.to_dtype(w.dtype())?;
    let conv_bias = match &conv.bias {
        Some(b) => f(b)?,
        None => Tensor::zeros(&[out], compute, &w.device())?,
    };
    let bias = conv_bias.sub(&f(&bn.running_mean)?)?.mul(&scale)?.add(&f(&bn.bias)?)?;
    Ok((weight, bias))
}

impl BatchNorm2d {
    /// Whether it normalises by the batch's statistics (training mode).
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
}

/// `t` (`[C]`) as `[1, C, 1, ...]` in `like`'s compute dtype, to broadcast against `like`.
fn per_channel(t: &Tensor, like: &Tensor) -> Result<Tensor> {
    let mut shape = vec![1usize; like.ndim()];
    shape[1] = like.shape()[1];
    t.to_dtype(like.dtype().compute_dtype())?.reshape_usize(&shape)
}

/// What scales x - mean per channel: 1/std times the weight when there is one (only [C]-sized
/// tensors are combined before the full-size tensor is touched).
fn scale(invstd: &Tensor, weight: Option<&Tensor>, like: &Tensor) -> Result<Tensor> {
    match weight {
        Some(w) => invstd.mul(&per_channel(w, like)?),
        None => Ok(invstd.clone()),
    }
}

/// Batch norm's normalisation in training, given the batch's mean and 1/std (`[1, C, 1, ...]`,
/// F32): inputs x, mean, invstd, then the weight and the bias when there are. Its backward is
/// PyTorch's closed form, which also carries the gradient through the statistics; it saves x
/// in its own dtype and two per-channel vectors, not a normalised copy of x.
struct BatchNormTrain {
    dims: Vec<i64>,
    /// Values per channel.
    n: usize,
    c: usize,
    weight: bool,
    /// The bias's dtype, when there is one (its gradient's).
    bias: Option<DType>,
}

impl crate::autograd::Function for BatchNormTrain {
    fn forward(&self, ctx: &mut crate::autograd::Ctx, xs: &[&Tensor]) -> Result<Tensor> {
        let (x, mean, invstd) = (xs[0], xs[1], xs[2]);
        // x promotes against the F32 statistics: no cast of its own.
        let mut y = x.sub(mean)?.mul(&scale(invstd, self.weight.then(|| xs[3]), x)?)?;
        if self.bias.is_some() {
            y = y.add(&per_channel(xs[xs.len() - 1], x)?)?;
        }
        let mut saved = vec![x, mean, invstd];
        if self.weight {
            saved.push(xs[3]);
        }
        ctx.save_for_backward(&saved);
        y.to_dtype(x.dtype())
    }

    fn backward(&self, ctx: &crate::autograd::Ctx, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let s = ctx.saved();
        let (x, mean, invstd) = (&s[0], &s[1], &s[2]);
        // Half dy and x promote against the F32 statistics where they are read; the one cast
        // feeds sum(dy) alone, so compiled, both sums are one reduction kernel.
        let cd = x.dtype().compute_dtype();
        let xhat = x.sub(mean)?.mul(invstd)?;
        let sum_dy = dy.to_dtype(cd)?.sum(&self.dims, true)?;
        let sum_dy_xhat = dy.mul(&xhat)?.sum(&self.dims, true)?;
        let k = scale(invstd, self.weight.then(|| &s[3]), x)?;
        // dx = w / std * (dy - mean(dy) - xhat * mean(dy * xhat))
        let inv_n = 1.0 / self.n as f64;
        let dx = dy.sub(&sum_dy.mul_scalar(inv_n)?)?.sub(&xhat.mul(&sum_dy_xhat.mul_scalar(inv_n)?)?)?.mul(&k)?.to_dtype(x.dtype())?;
        let mut grads = vec![Some(dx), None, None];
        if self.weight {
            grads.push(Some(sum_dy_xhat.reshape_usize(&[self.c])?.to_dtype(s[3].dtype())?));
        }
        if let Some(dt) = self.bias {
            grads.push(Some(sum_dy.reshape_usize(&[self.c])?.to_dtype(dt)?));
        }
        Ok(grads)
    }
}

/// `nn.BatchNorm2d(num_features, eps, momentum)`: weight ones, bias zeros, buffers
/// `running_mean` (zeros), `running_var` (ones), `num_batches_tracked` (I64). A momentum of
/// `None` uses the cumulative average, as PyTorch.
pub struct BatchNorm2d {
    pub weight: Tensor,
    pub bias: Tensor,
    pub running_mean: Tensor,
    pub running_var: Tensor,
    pub num_batches_tracked: Tensor,
    pub eps: f64,
    pub momentum: Option<f64>,
    training: AtomicBool,
}

impl BatchNorm2d {
    /// eps 1e-5, momentum 0.1.
    pub fn new(num_features: usize, dev: &Device) -> Result<BatchNorm2d> {
        BatchNorm2d::with_options(num_features, 1e-5, Some(0.1), dev)
    }
    pub fn with_options(num_features: usize, eps: f64, momentum: Option<f64>, dev: &Device) -> Result<BatchNorm2d> {
        let c = [num_features];
        Ok(BatchNorm2d {
            weight: Tensor::ones(&c, DType::F32, dev)?.requires_grad(),
            bias: Tensor::zeros(&c, DType::F32, dev)?.requires_grad(),
            running_mean: Tensor::zeros(&c, DType::F32, dev)?,
            running_var: Tensor::ones(&c, DType::F32, dev)?,
            num_batches_tracked: Tensor::zeros(&[], DType::I64, dev)?,
            eps,
            momentum,
            training: AtomicBool::new(true),
        })
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if x.ndim() != 4 {
            return Err(Error::shape("BatchNorm2d", format!("expected a 4-D [N, C, H, W] input, got {:?}", x.shape())));
        }
        let training = self.training.load(Ordering::Relaxed);
        let momentum = if training {
            no_grad(|| self.num_batches_tracked.add_scalar_(1))?;
            match self.momentum {
                Some(m) => m,
                // Cumulative moving average: 1 / batches seen.
                None => 1.0 / self.num_batches_tracked.item::<i64>()? as f64,
            }
        } else {
            0.0
        };
        batch_norm(x, Some(&self.running_mean), Some(&self.running_var), Some(&self.weight), Some(&self.bias), training, momentum, self.eps)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }
    fn own_buffers(&self) -> Vec<(String, Tensor)> {
        vec![
            ("running_mean".into(), self.running_mean.clone()),
            ("running_var".into(), self.running_var.clone()),
            ("num_batches_tracked".into(), self.num_batches_tracked.clone()),
        ]
    }
    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        for t in [&mut self.weight, &mut self.bias, &mut self.running_mean, &mut self.running_var, &mut self.num_batches_tracked] {
            f(t)?;
        }
        Ok(())
    }
}
