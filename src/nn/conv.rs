//! Convolution and pooling over `[N, C, H, W]`. conv2d checks its arguments and applies the
//! `Conv2d` primitive (cuDNN on CUDA, im2col + one matmul elsewhere: `ops::conv`), then adds
//! the bias as a separate op the compiler can fuse. Pooling is a composition of primitives:
//! padding and one index_select gather the windows, argmax + gather pools.

use super::{init, Module};
use crate::ops::conv::{check_positive, out_len, unfold};
use crate::ops::{apply, Op};
use crate::{DType, Device, Error, Result, Tensor};

pub use crate::ops::conv::Conv2dArgs;

/// `[N, OH * OW, C]` channels-last rows back to `[N, C, OH, OW]` (a view).
fn to_nchw(y: &Tensor, out: (usize, usize)) -> Result<Tensor> {
    let (n, c) = (y.shape()[0], y.shape()[2]);
    y.reshape_usize(&[n, out.0, out.1, c])?.permute(&[0, 3, 1, 2])
}

/// 4-D input (or 3-D unbatched, given a batch dim of 1); whether it was unbatched.
fn batched(op: &'static str, x: &Tensor) -> Result<(Tensor, bool)> {
    match x.ndim() {
        4 => Ok((x.clone(), false)),
        3 => Ok((x.unsqueeze(0)?, true)),
        _ => Err(Error::shape(op, format!("expected a 4-D [N, C, H, W] (or 3-D unbatched) input, got {:?}", x.shape()))),
    }
}

/// 2-D cross-correlation (`F.conv2d`): `x` `[N, C, H, W]`, `weight` `[O, C / groups, KH, KW]`,
/// `bias` `[O]`, giving `[N, O, OH, OW]` (contiguous from cuDNN; elsewhere a view over the
/// channels-last rows of the im2col product).
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, args: Conv2dArgs) -> Result<Tensor> {
    let op = "conv2d";
    super::functional::same_device(op, x, &[Some(weight), bias])?;
    let (x, unbatched) = batched(op, x)?;
    let (x, weight, bias) = crate::amp::cast_low(&x, weight, bias)?;
    let bias = bias.as_ref();
    if weight.ndim() != 4 {
        return Err(Error::shape(op, format!("weight must be 4-D [out, in / groups, kh, kw], got {:?}", weight.shape())));
    }
    if x.dtype() != weight.dtype() || bias.is_some_and(|b| b.dtype() != x.dtype()) {
        return Err(Error::dtype(op, weight.dtype(), format!("input {:?}, weight {:?} and bias {:?} must have one dtype", x.dtype(), weight.dtype(), bias.map(|b| b.dtype()))));
    }
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "needs floating-point tensors"));
    }
    let c = x.shape()[1];
    let (o, cg, kh, kw) = (weight.shape()[0], weight.shape()[1], weight.shape()[2], weight.shape()[3]);
    let g = args.groups;
    if g == 0 || c != cg * g || !o.is_multiple_of(g) {
        return Err(Error::shape(op, format!("input {:?} and weight {:?} with groups {g}: need in channels = weight.shape[1] * groups and out channels divisible by groups", x.shape(), weight.shape())));
    }
    if let Some(b) = bias {
        if b.shape() != [o] {
            return Err(Error::shape(op, format!("bias of shape {:?}, expected [{o}]", b.shape())));
        }
    }
    check_positive(op, "stride", args.stride)?;
    check_positive(op, "dilation", args.dilation)?;
    check_positive(op, "kernel size", (kh, kw))?;
    // An image smaller than the (dilated) kernel is reported by the op's shape rule.
    let y = apply(Op::Conv2d(args), &[&x, &weight])?;
    let y = match bias {
        Some(b) => y.add(&b.reshape_usize(&[o, 1, 1])?)?,
        None => y,
    };
    if unbatched {
        y.squeeze(0)
    } else {
        Ok(y)
    }
}

/// Max over `kernel` windows (`F.max_pool2d`, floor mode); padding counts as `-inf`. The
/// gradient goes to the first maximum of each window, as PyTorch's.
pub fn max_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> Result<Tensor> {
    let op = "max_pool2d";
    let (x, unbatched) = batched(op, x)?;
    check_positive(op, "kernel size", kernel)?;
    check_positive(op, "stride", stride)?;
    if 2 * padding.0 > kernel.0 || 2 * padding.1 > kernel.1 {
        return Err(Error::arg(op, format!("padding {padding:?} must be at most half the kernel size {kernel:?}")));
    }
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "needs a floating-point input"));
    }
    let (oh, ow) = (out_len(op, x.shape()[2], kernel.0, stride.0, padding.0, 1)?, out_len(op, x.shape()[3], kernel.1, stride.1, padding.1, 1)?);
    let p = padding;
    let padded = if p == (0, 0) { x.clone() } else { x.pad(&[p.1 as i64, p.1 as i64, p.0 as i64, p.0 as i64], f64::NEG_INFINITY)? };
    let y = if crate::is_grad_enabled() && x.is_requires_grad() {
        // Windows, then the first maximum of each: its position is where PyTorch sends the
        // gradient.
        let ws = unfold(&padded, kernel, stride, (1, 1), (oh, ow))?;
        let first_max = crate::no_grad(|| ws.argmax(2, true))?;
        to_nchw(&ws.gather(2, &first_max)?.squeeze(2)?, (oh, ow))?
    } else {
        // Values only: the maximum of the window's kh * kw strided views of the input, each
        // pass reading the input in place (no window copy, no index search).
        let mut m: Option<Tensor> = None;
        for i in 0..kernel.0 {
            for j in 0..kernel.1 {
                let v = padded.slice(2, i as i64, (i + stride.0 * (oh - 1) + 1) as i64, stride.0)?.slice(3, j as i64, (j + stride.1 * (ow - 1) + 1) as i64, stride.1)?;
                m = Some(match m {
                    None => v,
                    Some(m) => m.maximum(&v)?,
                });
            }
        }
        m.expect("a kernel of at least one element").contiguous()?
    };
    if unbatched {
        y.squeeze(0)
    } else {
        Ok(y)
    }
}

/// `[out, size]` averaging matrix of adaptive pooling: row i averages
/// `floor(i * size / out) .. ceil((i + 1) * size / out)`.
fn adaptive_weights(size: usize, out: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mut m = vec![0.0f64; out * size];
    for i in 0..out {
        let (a, b) = (i * size / out, ((i + 1) * size).div_ceil(out));
        for j in a..b {
            m[i * size + j] = 1.0 / (b - a) as f64;
        }
    }
    Tensor::from_vec(m, &[out, size], &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)
}

/// Average pooling to a fixed output size (`F.adaptive_avg_pool2d`).
pub fn adaptive_avg_pool2d(x: &Tensor, output_size: (usize, usize)) -> Result<Tensor> {
    let op = "adaptive_avg_pool2d";
    let (x, unbatched) = batched(op, x)?;
    check_positive(op, "output size", output_size)?;
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "needs a floating-point input"));
    }
    let (h, w) = (x.shape()[2], x.shape()[3]);
    if h == 0 || w == 0 {
        return Err(Error::shape(op, format!("input {:?} has an empty spatial dim", x.shape())));
    }
    let y = if output_size == (1, 1) {
        x.mean(&[2, 3], true)?
    } else {
        // Averaging matrices on both sides, outside autocast: pooling keeps the input's dtype.
        crate::amp::suspended(|| {
            let (mh, mw) = (adaptive_weights(h, output_size.0, x.dtype(), &x.device())?, adaptive_weights(w, output_size.1, x.dtype(), &x.device())?);
            mh.matmul(&x.matmul(&mw.t()?)?)
        })?
    };
    if unbatched {
        y.squeeze(0)
    } else {
        Ok(y)
    }
}

/// `nn.Conv2d`: weight `[out, in / groups, kh, kw]` kaiming uniform (a = sqrt(5)), bias
/// uniform in ±1/sqrt(fan_in), as PyTorch initialises them.
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub args: Conv2dArgs,
}

impl Conv2d {
    /// Stride 1, no padding, no dilation, one group, with bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel: usize, dev: &Device) -> Result<Conv2d> {
        Conv2d::with_options(in_channels, out_channels, (kernel, kernel), Conv2dArgs::default(), true, dev)
    }
    pub fn with_options(in_channels: usize, out_channels: usize, kernel: (usize, usize), args: Conv2dArgs, bias: bool, dev: &Device) -> Result<Conv2d> {
        let g = args.groups;
        if g == 0 || !in_channels.is_multiple_of(g) || !out_channels.is_multiple_of(g) {
            return Err(Error::arg("Conv2d", format!("in_channels {in_channels} and out_channels {out_channels} must be divisible by groups {g}")));
        }
        check_positive("Conv2d", "kernel size", kernel)?;
        check_positive("Conv2d", "stride", args.stride)?;
        check_positive("Conv2d", "dilation", args.dilation)?;
        let shape = [out_channels, in_channels / g, kernel.0, kernel.1];
        Ok(Conv2d {
            weight: init::kaiming_uniform(&shape, 5f64.sqrt(), dev)?.requires_grad(),
            bias: if bias { Some(init::bias_uniform(&shape, dev)?.requires_grad()) } else { None },
            args,
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv2d(x, &self.weight, self.bias.as_ref(), self.args)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        super::module::weight_and_bias(&self.weight, self.bias.as_ref())
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        super::module::visit_weight_and_bias(&mut self.weight, self.bias.as_mut(), f)
    }
}

/// `nn.MaxPool2d` (floor mode, no dilation).
#[derive(Clone, Copy, Debug)]
pub struct MaxPool2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
}

impl MaxPool2d {
    /// Square kernel; the stride defaults to the kernel size in PyTorch: pass it explicitly.
    pub fn new(kernel: usize, stride: usize, padding: usize) -> MaxPool2d {
        MaxPool2d { kernel: (kernel, kernel), stride: (stride, stride), padding: (padding, padding) }
    }
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        max_pool2d(x, self.kernel, self.stride, self.padding)
    }
}

/// `nn.AdaptiveAvgPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct AdaptiveAvgPool2d(pub (usize, usize));

impl Module for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        adaptive_avg_pool2d(x, self.0)
    }
}

/// `nn.Flatten`: merges dims `start_dim..=end_dim` (default 1..=-1).
#[derive(Clone, Copy, Debug)]
pub struct Flatten {
    pub start_dim: i64,
    pub end_dim: i64,
}

impl Default for Flatten {
    fn default() -> Self {
        Flatten { start_dim: 1, end_dim: -1 }
    }
}

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(self.start_dim, self.end_dim)
    }
}
