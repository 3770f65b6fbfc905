//! Convolution and pooling over `[N, C, H, W]`. conv2d checks its arguments and applies the
//! `Conv2d` primitive (cuDNN on CUDA, im2col + one matmul elsewhere: `ops::conv`), then adds
//! the bias as a separate op the compiler can fuse. Max pooling is a primitive (`ops::pool`), its
//! indices (`return_indices`) and mean pooling compositions: padding and the window's strided
//! views, stacked, then argmax + gather, or summed.

use super::{init, Module};
use crate::ops::conv::{check_positive, out_len};
use crate::ops::{apply, Op};
use crate::{DType, Device, Error, Result, Tensor};

pub use crate::ops::conv::Conv2dArgs;
pub use crate::ops::MaxPool2dArgs;

/// 4-D input (or 3-D unbatched, given a batch dim of 1); whether it was unbatched.
fn batched(op: &'static str, x: &Tensor) -> Result<(Tensor, bool)> {
    match x.ndim() {
        4 => Ok((x.clone(), false)),
        3 => Ok((x.unsqueeze(0)?, true)),
        _ => Err(Error::shape(op, format!("expected a 4-D [N, C, H, W] (or 3-D unbatched) input, got {:?}", x.shape()))),
    }
}

/// 2-D cross-correlation (`F.conv2d`): `x` `[N, C, H, W]`, `weight` `[O, C / groups, KH, KW]`,
/// `bias` `[O]`, giving `[N, O, OH, OW]`: channels-last when `x` or `weight` is
/// (`MemoryFormat`), else contiguous.
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, args: Conv2dArgs) -> Result<Tensor> {
    let op = "conv2d";
    super::functional::same_device(op, x, &[Some(weight), bias])?;
    let (x, unbatched) = batched(op, x)?;
    let (x, weight, bias) = crate::amp::cast_low(&x, weight, bias)?;
    let bias = bias.as_ref();
    check_operands(op, &x, &weight, args)?;
    let o = weight.shape()[0];
    if let Some(b) = bias {
        if b.dtype() != x.dtype() {
            return Err(Error::dtype(op, b.dtype(), format!("input {:?}, weight {:?} and bias {:?} must have one dtype", x.dtype(), weight.dtype(), b.dtype())));
        }
        if b.shape() != [o] {
            return Err(Error::shape(op, format!("bias of shape {:?}, expected [{o}]", b.shape())));
        }
    }
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

/// Checks a convolution's input `[N, C, H, W]` and weight against each other and its options.
fn check_operands(op: &'static str, x: &Tensor, weight: &Tensor, args: Conv2dArgs) -> Result<()> {
    if weight.ndim() != 4 {
        return Err(Error::shape(op, format!("weight must be 4-D [out, in / groups, kh, kw], got {:?}", weight.shape())));
    }
    if x.dtype() != weight.dtype() {
        return Err(Error::dtype(op, weight.dtype(), format!("input {:?} and weight {:?} must have one dtype", x.dtype(), weight.dtype())));
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
    check_positive(op, "stride", args.stride)?;
    check_positive(op, "dilation", args.dilation)?;
    check_positive(op, "kernel size", (kh, kw))
}

/// A convolution with its epilogue (PyTorch's `torch.cudnn_convolution_add_relu`, on every
/// device and dtype): `relu?(conv2d(x, weight, args) + bias + residual)` over `x`
/// `[N, C, H, W]`, `bias` `[O]` and `residual` (when given) of the output's shape, taken in
/// the input's dtype; the sums and ReLU computed in F32 for F16 / BF16 inputs (in the input's
/// dtype otherwise) and rounded once. An inference network's convolution with its batch norm
/// folded in (the bias), its skip connection and ReLU. On the GPU in F16 / BF16 over
/// channels-last operands one cuDNN kernel reads and writes each activation once (where cuDNN
/// has a fused engine for the geometry); elsewhere the convolution and one pass after it (one
/// fused kernel when compiled). The result is laid out as `conv2d`'s.
pub fn conv2d_bias_act(x: &Tensor, weight: &Tensor, bias: &Tensor, residual: Option<&Tensor>, args: Conv2dArgs, relu: bool) -> Result<Tensor> {
    let op = "conv2d_bias_act";
    super::functional::same_device(op, x, &[Some(weight), Some(bias), residual])?;
    if x.ndim() != 4 {
        return Err(Error::shape(op, format!("expected a 4-D [N, C, H, W] input, got {:?}", x.shape())));
    }
    let (x, weight, _) = crate::amp::cast_low(x, weight, None)?;
    check_operands(op, &x, &weight, args)?;
    let o = weight.shape()[0];
    if bias.shape() != [o] || !bias.dtype().is_float() {
        return Err(Error::shape(op, format!("bias must be a floating-point [{o}], got {:?} {:?}", bias.shape(), bias.dtype())));
    }
    let out = crate::ops::conv::out_shape(&args, x.shape(), weight.shape())?;
    if let Some(r) = residual {
        if r.shape() != out.as_slice() || !r.dtype().is_float() {
            return Err(Error::shape(op, format!("residual must be a floating-point {out:?} (the convolution's output), got {:?} {:?}", r.shape(), r.dtype())));
        }
    }
    let bias = bias.to_dtype(x.dtype().compute_dtype())?;
    let residual = residual.map(|r| r.to_dtype(x.dtype())).transpose()?;
    if crate::backend::conv_epilogue_pays(&x, &weight, args) {
        let mut inputs = vec![&x, &weight, &bias];
        inputs.extend(residual.as_ref());
        return apply(Op::Conv2dBiasAct(args, relu), &inputs);
    }
    crate::ops::conv::epilogue(&apply(Op::Conv2d(args), &[&x, &weight])?, &bias, residual.as_ref(), relu)
}

/// `x` padded with `value` by `pad` before each spatial dim, and after it as far as the last
/// window of `out` windows reaches (beyond `pad` in ceil mode, less where the last window stops short).
fn pad_for_windows(x: &Tensor, pad: (usize, usize), span: (usize, usize), stride: (usize, usize), out: (usize, usize), value: f64) -> Result<Tensor> {
    let (h, w) = (x.shape()[2], x.shape()[3]);
    let after = |o: usize, s: usize, sp: usize, n: usize, p: usize| ((o - 1) * s + sp) as i64 - (n + p) as i64;
    let (ah, aw) = (after(out.0, stride.0, span.0, h, pad.0), after(out.1, stride.1, span.1, w, pad.1));
    if pad == (0, 0) && ah <= 0 && aw <= 0 {
        return Ok(x.clone());
    }
    x.pad(&[pad.1 as i64, aw.max(0), pad.0 as i64, ah.max(0)], value)
}

/// Checks pooling options; the output size. Integer inputs only where `ints` allows them.
fn pool_geometry(op: &'static str, x: &Tensor, a: &MaxPool2dArgs, ints: bool) -> Result<(usize, usize)> {
    check_positive(op, "kernel size", a.kernel)?;
    check_positive(op, "stride", a.stride)?;
    check_positive(op, "dilation", a.dilation)?;
    if a.padding.0 > a.kernel.0 / 2 || a.padding.1 > a.kernel.1 / 2 {
        return Err(Error::arg(op, format!("padding {:?} must be at most half the kernel size {:?}", a.padding, a.kernel)));
    }
    if !(x.dtype().is_float() || ints && x.dtype().is_int()) {
        return Err(Error::dtype(op, x.dtype(), if ints { "needs a floating-point or integer input" } else { "needs a floating-point input" }));
    }
    let len = |d: usize, i: usize| {
        let pick = |p: (usize, usize)| if i == 0 { p.0 } else { p.1 };
        out_len(op, x.shape()[d], pick(a.kernel), pick(a.stride), pick(a.padding), pick(a.dilation), a.ceil_mode)
    };
    Ok((len(2, 0)?, len(3, 1)?))
}

/// Max over `kernel` windows (`F.max_pool2d`, floor mode, no dilation); padding counts as
/// `-inf`. The gradient goes to the first maximum of each window, as PyTorch's.
pub fn max_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> Result<Tensor> {
    max_pool2d_with(x, &MaxPool2dArgs::new(kernel, stride, padding))
}

/// `F.max_pool2d` with every option: dilation and ceil mode.
pub fn max_pool2d_with(x: &Tensor, args: &MaxPool2dArgs) -> Result<Tensor> {
    Ok(max_pool2d_impl(x, args, false)?.0)
}

/// `F.max_pool2d(..., return_indices=True)`: the values and, for each, the flat position
/// `h * W + w` of its maximum in the input's spatial plane (I64), as `max_unpool2d` reads them.
pub fn max_pool2d_with_indices(x: &Tensor, args: &MaxPool2dArgs) -> Result<(Tensor, Tensor)> {
    let (y, idx) = max_pool2d_impl(x, args, true)?;
    Ok((y, idx.expect("indices asked for")))
}

fn max_pool2d_impl(x: &Tensor, args: &MaxPool2dArgs, indices: bool) -> Result<(Tensor, Option<Tensor>)> {
    let op = "max_pool2d";
    let (x, unbatched) = batched(op, x)?;
    let (oh, ow) = pool_geometry(op, &x, args, false)?;
    let (y, idx) = if indices {
        // Windows `[N, C, OH, OW, KH * KW]` stacked from strided views, then the first maximum
        // of each: its position is the index PyTorch returns (and where the gradient goes).
        // Stacked views (not a gather of overlapping windows) keep the backward a sum of padded
        // slices, the same bits on every run, where a scatter of overlapping windows would add
        // in the order atomics land.
        let (k, s, d) = (args.kernel, args.stride, args.dilation);
        let span = (d.0 * (k.0 - 1) + 1, d.1 * (k.1 - 1) + 1);
        let padded = pad_for_windows(&x, args.padding, span, s, (oh, ow), f64::NEG_INFINITY)?;
        let views: Vec<Tensor> = (0..k.0).flat_map(|i| (0..k.1).map(move |j| (i, j))).map(|(i, j)| strided_window(&padded, (i * d.0, j * d.1), s, (oh, ow))).collect::<Result<_>>()?;
        let ws = crate::ops::movement::stack(&views.iter().collect::<Vec<_>>(), 4)?;
        let first_max = crate::no_grad(|| ws.argmax(4, true))?;
        let y = ws.gather(4, &first_max)?.squeeze(4)?;
        (y, Some(window_positions(&x, args, (oh, ow), &first_max)?))
    } else {
        // One kernel reading the input in place; its gradient one more (`ops::pool`).
        (apply(Op::MaxPool2d(*args), &[&x])?, None)
    };
    if unbatched {
        Ok((y.squeeze(0)?, idx.map(|i| i.squeeze(0)).transpose()?))
    } else {
        Ok((y, idx))
    }
}

/// The `out` window elements at offset `at` of every window: a strided view of `padded`.
fn strided_window(padded: &Tensor, at: (usize, usize), s: (usize, usize), out: (usize, usize)) -> Result<Tensor> {
    padded
        .slice(2, at.0 as i64, (at.0 + s.0 * (out.0 - 1) + 1) as i64, s.0)?
        .slice(3, at.1 as i64, (at.1 + s.1 * (out.1 - 1) + 1) as i64, s.1)
}

/// Flat input positions `h * W + w` of the window elements `which` (`[N, C, OH, OW, 1]`, each
/// an index into its window's kh * kw elements) picked, as `[N, C, OH, OW]` I64.
fn window_positions(x: &Tensor, a: &MaxPool2dArgs, out: (usize, usize), which: &Tensor) -> Result<Tensor> {
    let w = x.shape()[3] as i64;
    let (k, s, d, p) = (a.kernel, a.stride, a.dilation, a.padding);
    let mut table = Vec::with_capacity(out.0 * out.1 * k.0 * k.1);
    for oh in 0..out.0 {
        for ow in 0..out.1 {
            for i in 0..k.0 {
                for j in 0..k.1 {
                    let h = (oh * s.0 + i * d.0) as i64 - p.0 as i64;
                    let c = (ow * s.1 + j * d.1) as i64 - p.1 as i64;
                    table.push(h * w + c);
                }
            }
        }
    }
    let table = Tensor::from_vec(table, &[1, 1, out.0, out.1, k.0 * k.1], &x.device())?;
    let table = table.broadcast_to(&[which.shape()[0], which.shape()[1], out.0, out.1, k.0 * k.1])?;
    table.gather(4, which)?.squeeze(4)?.contiguous()
}

/// Mean over `kernel` windows (`F.avg_pool2d`): zero padding, `ceil_mode` as max pooling's;
/// each window's divisor is its size clipped to the padded input (`count_include_pad`) or the
/// number of input elements it covers. Integers sum in I64 and divide rounding toward zero, as
/// PyTorch's CPU kernel does.
pub fn avg_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize), ceil_mode: bool, count_include_pad: bool) -> Result<Tensor> {
    let op = "avg_pool2d";
    let (x, unbatched) = batched(op, x)?;
    let args = MaxPool2dArgs { kernel, stride, padding, dilation: (1, 1), ceil_mode };
    let (oh, ow) = pool_geometry(op, &x, &args, true)?;
    let dtype = x.dtype();
    let x = if dtype.is_float() { x } else { x.to_dtype(DType::I64)? };
    let padded = pad_for_windows(&x, padding, kernel, stride, (oh, ow), 0.0)?;
    let mut sum: Option<Tensor> = None;
    for i in 0..kernel.0 {
        for j in 0..kernel.1 {
            let v = strided_window(&padded, (i, j), stride, (oh, ow))?;
            sum = Some(match sum {
                None => v,
                Some(t) => t.add(&v)?,
            });
        }
    }
    // Divisors depend on the geometry alone: one small host table.
    let counts = |o: usize, k: usize, s: usize, p: usize, n: usize| -> Vec<(usize, usize)> {
        (0..o)
            .map(|i| {
                let start = (i * s) as i64 - p as i64;
                let end = (start + k as i64).min((n + p) as i64);
                let covered = end.min(n as i64) - start.max(0);
                ((end - start) as usize, covered.max(0) as usize)
            })
            .collect()
    };
    let (ch, cw) = (counts(oh, kernel.0, stride.0, padding.0, x.shape()[2]), counts(ow, kernel.1, stride.1, padding.1, x.shape()[3]));
    let div: Vec<f64> = ch
        .iter()
        .flat_map(|h| cw.iter().map(move |w| if count_include_pad { (h.0 * w.0) as f64 } else { (h.1 * w.1) as f64 }))
        .collect();
    let div = Tensor::from_vec(div, &[oh, ow], &x.device())?.to_dtype(x.dtype())?;
    let sum = sum.expect("a kernel of at least one element");
    let y = if dtype.is_float() { sum.div(&div)? } else { sum.div_mode(&div, crate::RoundingMode::Trunc)?.to_dtype(dtype)? };
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
    Tensor::from_vec(m, &[out, size], dev)?.to_dtype(dtype)
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
        let _site = crate::profiler::call_site();
        conv2d(x, &self.weight, self.bias.as_ref(), self.args)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        super::module::weight_and_bias(&self.weight, self.bias.as_ref())
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        super::module::visit_weight_and_bias(&mut self.weight, self.bias.as_mut(), f)
    }
}

/// `nn.MaxPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct MaxPool2d(pub MaxPool2dArgs);

impl MaxPool2d {
    /// Square kernel, floor mode, no dilation; the stride defaults to the kernel size in
    /// PyTorch: pass it explicitly.
    pub fn new(kernel: usize, stride: usize, padding: usize) -> MaxPool2d {
        MaxPool2d(MaxPool2dArgs::new((kernel, kernel), (stride, stride), (padding, padding)))
    }
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        max_pool2d_with(x, &self.0)
    }
}

/// `nn.AvgPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct AvgPool2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub ceil_mode: bool,
    pub count_include_pad: bool,
}

impl AvgPool2d {
    /// Square kernel, floor mode, padding counted (PyTorch's defaults but the stride).
    pub fn new(kernel: usize, stride: usize, padding: usize) -> AvgPool2d {
        AvgPool2d { kernel: (kernel, kernel), stride: (stride, stride), padding: (padding, padding), ceil_mode: false, count_include_pad: true }
    }
}

impl Module for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        avg_pool2d(x, self.kernel, self.stride, self.padding, self.ceil_mode, self.count_include_pad)
    }
}

/// `nn.AdaptiveAvgPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct AdaptiveAvgPool2d(pub (usize, usize));

impl Module for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
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
        let _site = crate::profiler::call_site();
        x.flatten(self.start_dim, self.end_dim)
    }
}
