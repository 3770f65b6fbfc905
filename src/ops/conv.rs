//! Convolution primitives: `Op::Conv2d` and the two products its gradient needs,
//! `Op::Conv2dGradInput` and `Op::Conv2dGradWeight`. On CUDA (F32, F16, BF16) each is one cuDNN
//! call (`backend::cuda::libs::cudnn`). Everywhere else — the CPU, F64 on CUDA, a CUDA machine without
//! cuDNN — each is defined here with other primitives: padding and one index_select gather the
//! windows (im2col) and one matmul applies the kernel; the gradients are the same products
//! transposed, plus one scatter-add (col2im) for the input.

use super::Op;
use crate::{Device, Error, MemoryFormat, Result, Tensor};

/// Options of a 2-D convolution: `(height, width)` pairs and groups, PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dArgs {
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
}

impl Default for Conv2dArgs {
    fn default() -> Self {
        Conv2dArgs { stride: (1, 1), padding: (0, 0), dilation: (1, 1), groups: 1 }
    }
}

/// Which product of a convolution an op computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ConvPass {
    /// y from (x, w).
    Forward,
    /// dx from (dy, w).
    GradInput,
    /// dw from (x, dy).
    GradWeight,
}

/// Output length of a window sliding over `size` (PyTorch's formula: rounded down, or up with
/// `ceil` as pooling's ceil mode, where a last window must still start inside the input or its
/// left padding), or an error.
pub(crate) fn out_len(op: &'static str, size: usize, k: usize, stride: usize, pad: usize, dil: usize, ceil: bool) -> Result<usize> {
    let too_large = || Error::shape(op, format!("input size {size} with padding {pad}, kernel {k} and dilation {dil} is too large"));
    let span = dil.checked_mul(k.max(1) - 1).and_then(|s| s.checked_add(1)).ok_or_else(too_large)?;
    let padded = pad.checked_mul(2).and_then(|p| p.checked_add(size)).ok_or_else(too_large)?;
    if padded < span {
        return Err(Error::shape(op, format!("input size {size} with padding {pad} is smaller than the (dilated) kernel {span}")));
    }
    let stride = stride.max(1);
    let floor = (padded - span) / stride + 1;
    if !ceil || (padded - span).is_multiple_of(stride) {
        return Ok(floor);
    }
    Ok(if floor * stride >= size + pad { floor } else { floor + 1 })
}

pub(crate) fn check_positive(op: &'static str, what: &str, v: (usize, usize)) -> Result<()> {
    if v.0 == 0 || v.1 == 0 {
        return Err(Error::arg(op, format!("{what} must be positive, got {v:?}")));
    }
    Ok(())
}

/// `[N, O, OH, OW]`: the output shape of `x` `[N, C, H, W]` convolved with `w` `[O, C / g, KH, KW]`.
pub(crate) fn out_shape(a: &Conv2dArgs, x: &[usize], w: &[usize]) -> Result<Vec<usize>> {
    let oh = out_len("conv2d", x[2], w[2], a.stride.0, a.padding.0, a.dilation.0, false)?;
    let ow = out_len("conv2d", x[3], w[3], a.stride.1, a.padding.1, a.dilation.1, false)?;
    Ok(vec![x[0], w[0], oh, ow])
}

/// The `kh * kw` windows of padded `x` `[N, C, Hp, Wp]`, channels last:
/// `[N, OH * OW, kh * kw, C]`. One index_select over the flattened positions; a 1x1 kernel is a
/// strided view instead.
fn unfold(x: &Tensor, k: (usize, usize), stride: (usize, usize), dil: (usize, usize), out: (usize, usize)) -> Result<Tensor> {
    let (n, c, hp, wp) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let l = out.0 * out.1;
    if k == (1, 1) {
        let v = x.slice(2, 0, (stride.0 * (out.0 - 1) + 1) as i64, stride.0)?.slice(3, 0, (stride.1 * (out.1 - 1) + 1) as i64, stride.1)?;
        return v.permute(&[0, 2, 3, 1])?.reshape_usize(&[n, l, 1, c]);
    }
    let idx = window_index(&x.device(), wp, k, stride, dil, out)?;
    let flat = x.permute(&[0, 2, 3, 1])?.reshape_usize(&[n, hp * wp, c])?;
    flat.index_select(1, &idx)?.reshape_usize(&[n, l, k.0 * k.1, c])
}

type IndexKey = (Device, usize, (usize, usize), (usize, usize), (usize, usize), (usize, usize));

thread_local! {
    /// Window indices by geometry, so repeated calls copy nothing to the device.
    static WINDOW_INDEX: std::cell::RefCell<std::collections::HashMap<IndexKey, Tensor>> = Default::default();
}

/// Flat input positions (row * `wp` + col) of every window element, in (oh, ow, i, j) order.
fn window_index(dev: &Device, wp: usize, k: (usize, usize), stride: (usize, usize), dil: (usize, usize), out: (usize, usize)) -> Result<Tensor> {
    let key = (*dev, wp, k, stride, dil, out);
    if let Some(t) = WINDOW_INDEX.with(|c| c.borrow().get(&key).cloned()) {
        return Ok(t);
    }
    let mut idx = Vec::with_capacity(out.0 * out.1 * k.0 * k.1);
    for oh in 0..out.0 {
        for ow in 0..out.1 {
            for i in 0..k.0 {
                for j in 0..k.1 {
                    idx.push(((oh * stride.0 + i * dil.0) * wp + ow * stride.1 + j * dil.1) as i64);
                }
            }
        }
    }
    let n = idx.len();
    let t = Tensor::from_vec(idx, &[n], dev)?;
    WINDOW_INDEX.with(|c| {
        let mut c = c.borrow_mut();
        // A model has few geometries; inputs of ever-changing sizes must not grow it forever.
        if c.len() >= 64 {
            c.clear();
        }
        c.insert(key, t.clone());
    });
    Ok(t)
}

/// Sizes of one convolution: input `[n, c, h, w]`, weight `[o, c / g, kh, kw]`, output
/// `[n, o, oh, ow]`.
struct Geom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    g: usize,
}

impl Geom {
    fn new(x: &[usize], w: &[usize], y: &[usize], g: usize) -> Geom {
        Geom { n: x[0], c: x[1], h: x[2], w: x[3], o: w[0], kh: w[2], kw: w[3], oh: y[2], ow: y[3], g }
    }
    fn rows(&self) -> usize {
        self.n * self.oh * self.ow
    }
    fn kk(&self) -> usize {
        self.kh * self.kw
    }
}

/// Runs one of the convolution ops (arguments validated by its caller) on its inputs' device;
/// `out` is the result's shape from `Op::out_meta`.
pub(crate) fn run(op: &Op, xs: &[&Tensor], out: &[usize]) -> Result<Tensor> {
    let (a, b) = (xs[0], xs[1]);
    let (pass, args, x, w, y) = match op {
        Op::Conv2dBiasAct(args, relu) => return with_epilogue(args, *relu, xs, out),
        Op::Conv2d(args) => (ConvPass::Forward, args, a.shape(), b.shape(), out),
        Op::Conv2dGradInput(args, _) => (ConvPass::GradInput, args, out, b.shape(), a.shape()),
        Op::Conv2dGradWeight(args, _) => (ConvPass::GradWeight, args, a.shape(), out, b.shape()),
        _ => unreachable!("{} is not a convolution", op.name()),
    };
    let format = result_format(a, b);
    if let Some(t) = crate::backend::conv_library(pass, args, [x, w, y].map(|s| [s[0], s[1], s[2], s[3]]), a, b, out, format)? {
        return Ok(t);
    }
    let geo = Geom::new(x, w, y, args.groups);
    // The definition below is written with tensor ops: none of them is recorded (for autograd or
    // by a tracer) or cast by autocast; this op is the one that was.
    let _off = crate::compile::trace::Suspend::new();
    crate::amp::suspended(|| {
        crate::no_grad(|| {
            // Each product comes out over channels-last memory (the columns' order).
            let t = match pass {
                ConvPass::Forward => forward(a, b, args, &geo),
                ConvPass::GradInput => grad_input(a, b, args, &geo),
                ConvPass::GradWeight => grad_weight(a, b, args, &geo),
            }?;
            t.to_memory_format(format)
        })
    })
}

/// A convolution's result's memory format: channels-last when either operand is (as PyTorch's),
/// so a channels-last network stays channels-last through its convolutions and their gradients.
fn result_format(a: &Tensor, b: &Tensor) -> MemoryFormat {
    if [a, b].iter().any(|t| t.suggest_memory_format() == MemoryFormat::ChannelsLast) {
        MemoryFormat::ChannelsLast
    } else {
        MemoryFormat::Contiguous
    }
}

/// `Op::Conv2dBiasAct`: cuDNN's fused kernel where it has one for the geometry, else the
/// convolution, then its `epilogue` (neither recorded); in the memory format a convolution of
/// the same operands returns.
fn with_epilogue(args: &Conv2dArgs, relu: bool, xs: &[&Tensor], out: &[usize]) -> Result<Tensor> {
    let (x, w, bias, z) = (xs[0], xs[1], xs[2], xs.get(3).copied());
    let format = result_format(x, w);
    let shapes = [x.shape(), w.shape(), out].map(|s| [s[0], s[1], s[2], s[3]]);
    if let Some(t) = crate::backend::conv_epilogue_library(args, shapes, x, w, bias, z, relu, out, format)? {
        return Ok(t);
    }
    let y = run(&Op::Conv2d(*args), &[x, w], out)?;
    let _off = crate::compile::trace::Suspend::new();
    crate::amp::suspended(|| crate::no_grad(|| epilogue(&y, bias, z, relu)?.to_memory_format(format)))
}

/// relu?(y + bias + residual) for a convolution's output `y` `[N, O, H, W]` and `bias` `[O]`,
/// computed in y's compute dtype and rounded once into y's dtype: `Op::Conv2dBiasAct`'s
/// definition (`conv2d_bias_act`'s composite, and the op's own where cuDNN has no plan).
pub(crate) fn epilogue(y: &Tensor, bias: &Tensor, residual: Option<&Tensor>, relu: bool) -> Result<Tensor> {
    let c = y.dtype().compute_dtype();
    let mut v = y.to_dtype(c)?.add(&bias.to_dtype(c)?.reshape_usize(&[1, y.shape()[1], 1, 1])?)?;
    if let Some(r) = residual {
        v = v.add(&r.to_dtype(c)?)?;
    }
    if relu {
        v = v.relu()?;
    }
    v.to_dtype(y.dtype())
}

/// im2col columns of `x`: `[N, OH * OW, KH * KW, C]` (window-major, channel-minor).
fn columns(x: &Tensor, a: &Conv2dArgs, geo: &Geom) -> Result<Tensor> {
    let p = a.padding;
    let padded = if p == (0, 0) { x.clone() } else { x.pad(&[p.1 as i64, p.1 as i64, p.0 as i64, p.0 as i64], 0.0)? };
    unfold(&padded, (geo.kh, geo.kw), a.stride, a.dilation, (geo.oh, geo.ow))
}

/// The weight as the matrix the columns multiply: `[G, O / G, KH * KW * C / G]`, in the
/// columns' (window, channel) order.
fn weight_rows(w: &Tensor, geo: &Geom) -> Result<Tensor> {
    let cg = geo.c / geo.g;
    w.permute(&[0, 2, 3, 1])?.reshape_usize(&[geo.g, geo.o / geo.g, geo.kk() * cg])
}

/// `dy` `[N, O, OH, OW]` as rows of the columns' product, per group: `[G, N * OH * OW, O / G]`.
fn grad_rows(dy: &Tensor, geo: &Geom) -> Result<Tensor> {
    let rows = dy.permute(&[0, 2, 3, 1])?.reshape_usize(&[geo.rows(), geo.o])?;
    if geo.g == 1 {
        return rows.unsqueeze(0);
    }
    rows.reshape_usize(&[geo.rows(), geo.g, geo.o / geo.g])?.transpose(0, 1)
}

/// `y = cols @ W^T`, returned as `[N, O, OH, OW]` viewed over channels-last memory.
fn forward(x: &Tensor, w: &Tensor, a: &Conv2dArgs, geo: &Geom) -> Result<Tensor> {
    let (rows, kk, c, o, g) = (geo.rows(), geo.kk(), geo.c, geo.o, geo.g);
    let cols = columns(x, a, geo)?;
    let wk = weight_rows(w, geo)?;
    let y = if g == 1 {
        cols.reshape_usize(&[rows, kk * c])?.matmul(&wk.squeeze(0)?.t()?)?
    } else {
        let cg = c / g;
        let cols = cols.reshape_usize(&[rows, kk, g, cg])?.permute(&[2, 0, 1, 3])?.reshape_usize(&[g, rows, kk * cg])?;
        cols.matmul(&wk.transpose(1, 2)?)?.transpose(0, 1)?.reshape_usize(&[rows, o])?
    };
    y.reshape_usize(&[geo.n, geo.oh, geo.ow, o])?.permute(&[0, 3, 1, 2])
}

/// `dW = dy_rows^T @ cols`, as `[O, C / G, KH, KW]`.
fn grad_weight(x: &Tensor, dy: &Tensor, a: &Conv2dArgs, geo: &Geom) -> Result<Tensor> {
    let (rows, kk, c, o, g) = (geo.rows(), geo.kk(), geo.c, geo.o, geo.g);
    let cg = c / g;
    let cols = columns(x, a, geo)?.reshape_usize(&[rows, kk, g, cg])?.permute(&[2, 0, 1, 3])?.reshape_usize(&[g, rows, kk * cg])?;
    let gw = grad_rows(dy, geo)?.transpose(1, 2)?.matmul(&cols)?; // [G, O / G, KH * KW * Cg]
    gw.reshape_usize(&[o, geo.kh, geo.kw, cg])?.permute(&[0, 3, 1, 2])
}

/// `dcols = dy_rows @ W`, scattered back onto the (padded) input positions it was gathered
/// from (col2im), as `[N, C, H, W]`.
fn grad_input(dy: &Tensor, w: &Tensor, a: &Conv2dArgs, geo: &Geom) -> Result<Tensor> {
    let (rows, kk, c, g, n) = (geo.rows(), geo.kk(), geo.c, geo.g, geo.n);
    let cg = c / g;
    let dcols = grad_rows(dy, geo)?.matmul(&weight_rows(w, geo)?)?; // [G, rows, KH * KW * Cg]
    let dcols = dcols.reshape_usize(&[g, rows, kk, cg])?.permute(&[1, 2, 0, 3])?.reshape_usize(&[n, geo.oh * geo.ow * kk, c])?;
    let p = a.padding;
    let (hp, wp) = (geo.h + 2 * p.0, geo.w + 2 * p.1);
    let idx = window_index(&dy.device(), wp, (geo.kh, geo.kw), a.stride, a.dilation, (geo.oh, geo.ow))?;
    let idx = idx.reshape_usize(&[1, idx.numel(), 1])?.broadcast_to(dcols.shape())?;
    let base = Tensor::zeros(&[n, hp * wp, c], dy.dtype(), &dy.device())?;
    let padded = base.scatter_add(1, &idx, &dcols)?.reshape_usize(&[n, hp, wp, c])?.permute(&[0, 3, 1, 2])?;
    padded.narrow(2, p.0, geo.h)?.narrow(3, p.1, geo.w)
}

#[cfg(test)]
mod tests {
    use crate::ops::{apply, Op};
    use crate::{gradcheck, GradcheckOptions};

    /// `Op::Conv2dBiasAct` itself on the host (the functional sends it only to the GPU): the
    /// convolution and its epilogue, and its gradients (through ReLU's mask, into the bias and
    /// the residual) by finite differences in F64.
    #[test]
    fn the_epilogue_ops_host_reference_and_gradient() {
        let rand = crate::ops::host_values;
        let args = super::Conv2dArgs { stride: (2, 1), padding: (1, 1), ..Default::default() };
        let (x, w, b, z) = (rand(&[2, 3, 5, 4], 1), rand(&[4, 3, 3, 3], 2), rand(&[4], 3), rand(&[2, 4, 3, 4], 4));
        for relu in [false, true] {
            let got = apply(Op::Conv2dBiasAct(args, relu), &[&x, &w, &b, &z]).unwrap();
            let mut want = apply(Op::Conv2d(args), &[&x, &w]).unwrap().add(&b.reshape_usize(&[1, 4, 1, 1]).unwrap()).unwrap().add(&z).unwrap();
            if relu {
                want = want.relu().unwrap();
            }
            let (g, wv) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
            assert!(g.iter().zip(&wv).all(|(a, b)| (a - b).abs() < 1e-12), "{g:?} against {wv:?}");
            gradcheck(|xs| apply(Op::Conv2dBiasAct(args, relu), &[&xs[0], &xs[1], &xs[2], &xs[3]]), &[x.clone(), w.clone(), b.clone(), z.clone()], GradcheckOptions::default()).unwrap();
        }
        gradcheck(|xs| apply(Op::Conv2dBiasAct(args, true), &[&xs[0], &xs[1], &xs[2]]), &[x, w, b], GradcheckOptions::default()).unwrap();
    }
}
