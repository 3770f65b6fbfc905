//! Composite ops (`torch.nn.functional`), each a decomposition into primitive ops. Half-precision
//! inputs are computed in F32 and the result converted back, as PyTorch's kernels do; under
//! `amp::autocast` the F32 ops (softmax, layer_norm, losses) return F32 and `linear` runs in
//! the autocast dtype.

use crate::ops::rows::RowKind;
use crate::{no_grad, DType, Error, Result, Tensor};

/// How a loss reduces over elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    None,
    #[default]
    Mean,
    Sum,
}

/// Runs `f` in F32 for F16/BF16 inputs and converts the result back.
fn in_opmath(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let dt = x.dtype();
    if dt == dt.compute_dtype() {
        return f(x);
    }
    f(&x.to_dtype(dt.compute_dtype())?)?.to_dtype(dt)
}

fn float_input(op: &'static str, x: &Tensor) -> Result<()> {
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "needs a floating-point input"));
    }
    Ok(())
}

/// All given tensors on `first`'s device, or an error naming `op` and both devices.
pub(crate) fn same_device(op: &'static str, first: &Tensor, others: &[Option<&Tensor>]) -> Result<()> {
    match others.iter().flatten().find(|t| t.device() != first.device()) {
        Some(t) => Err(Error::DeviceMismatch { op, a: first.device(), b: t.device() }),
        None => Ok(()),
    }
}

/// The max along `dim` (kept), or zeros when `x` is empty: amax refuses empty dims, and an empty
/// input (even one empty along `dim`) has an empty softmax, as in PyTorch.
fn line_max(x: &Tensor, dim: i64) -> Result<Tensor> {
    if x.numel() == 0 {
        return x.sum(&[dim], true);
    }
    x.amax(&[dim], true)
}

/// `exp(x - max) / sum(exp(x - max))` along `dim`.
#[track_caller]
pub fn softmax(x: &Tensor, dim: i64) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    float_input("softmax", x)?;
    crate::layout::norm_dim("softmax", dim, x.ndim())?;
    let x = &crate::amp::fp32(x)?;
    if let Some(y) = crate::ops::rows::fused(x, dim, RowKind::Softmax, None, None, 0.0, |xs| softmax(&xs[0], -1))? {
        return Ok(y);
    }
    in_opmath(x, |x| {
        let m = no_grad(|| line_max(x, dim))?;
        let e = x.sub(&m)?.exp()?;
        e.div(&e.sum(&[dim], true)?)
    })
}

/// `x - max - log(sum(exp(x - max)))` along `dim`.
#[track_caller]
pub fn log_softmax(x: &Tensor, dim: i64) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    float_input("log_softmax", x)?;
    crate::layout::norm_dim("log_softmax", dim, x.ndim())?;
    let x = &crate::amp::fp32(x)?;
    if let Some(y) = crate::ops::rows::fused(x, dim, RowKind::LogSoftmax, None, None, 0.0, |xs| log_softmax(&xs[0], -1))? {
        return Ok(y);
    }
    in_opmath(x, |x| {
        let m = no_grad(|| line_max(x, dim))?;
        let shifted = x.sub(&m)?;
        shifted.sub(&shifted.exp()?.sum(&[dim], true)?.log()?)
    })
}

/// Normalises over the trailing `normalized_shape` dims, then scales and shifts
/// (`F.layer_norm`; biased variance, as PyTorch).
#[track_caller]
pub fn layer_norm(x: &Tensor, normalized_shape: &[usize], weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    float_input("layer_norm", x)?;
    let x = &crate::amp::fp32(x)?;
    let k = normalized_shape.len();
    if k == 0 || k > x.ndim() || &x.shape()[x.ndim() - k..] != normalized_shape {
        return Err(Error::shape("layer_norm", format!("normalized_shape {normalized_shape:?} does not match the trailing dims of input {:?}", x.shape())));
    }
    for (name, p) in [("weight", weight), ("bias", bias)] {
        if let Some(p) = p {
            if p.shape() != normalized_shape {
                return Err(Error::shape("layer_norm", format!("{name} has shape {:?}, expected {normalized_shape:?}", p.shape())));
            }
        }
    }
    if k == 1 {
        let decompose = |xs: &[Tensor]| {
            // The arguments are x, then the weight and the bias that are there.
            let mut rest = xs[1..].iter();
            let (w, b) = (weight.and_then(|_| rest.next()), bias.and_then(|_| rest.next()));
            layer_norm(&xs[0], normalized_shape, w, b, eps)
        };
        if let Some(y) = crate::ops::rows::fused(x, -1, RowKind::LayerNorm, weight, bias, eps, decompose)? {
            return Ok(y);
        }
    }
    let dims: Vec<i64> = (x.ndim() - k..x.ndim()).map(|d| d as i64).collect();
    in_opmath(x, |x| {
        let mean = x.mean(&dims, true)?;
        let centered = x.sub(&mean)?;
        let var = centered.mul(&centered)?.mean(&dims, true)?;
        let mut y = centered.mul(&var.add_scalar(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(w)?;
        }
        if let Some(b) = bias {
            y = y.add(b)?;
        }
        Ok(y)
    })
}

/// `x @ weight^T + bias` with `weight` of shape [out, in] (`F.linear`).
#[track_caller]
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    if weight.ndim() != 2 {
        return Err(Error::shape("linear", format!("weight must be 2-D [out, in], got {:?}", weight.shape())));
    }
    let (x, weight, bias) = crate::amp::cast_low(x, weight, bias)?;
    let y = x.matmul(&weight.t()?)?;
    match bias {
        Some(b) => y.add(&b),
        None => Ok(y),
    }
}

/// The optional arguments of [`scaled_dot_product_attention`], PyTorch's defaults.
#[derive(Clone, Copy, Debug, Default)]
pub struct SdpaOptions<'a> {
    /// Broadcastable to `[N, H, L, S]`: bool `true` lets a query attend to that key (PyTorch's
    /// convention for this function); a float mask is added to the scores.
    pub attn_mask: Option<&'a Tensor>,
    /// Dropout on the attention weights (the unfused path runs when it is positive).
    pub dropout_p: f64,
    /// Masks keys after each query (query i sees keys 0..=i).
    pub is_causal: bool,
    /// Scales the scores; 1/sqrt(D) when `None`.
    pub scale: Option<f64>,
}

/// `softmax(q k^T * scale + mask) v` over `q` `[N, H, L, D]` and `k`, `v` `[N, H, S, D]`
/// (`F.scaled_dot_product_attention`). One fused kernel (and two for its gradient) where the
/// head dim allows, else matmul and softmax; the result is `[N, H, L, D]`.
#[track_caller]
pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    let op = "scaled_dot_product_attention";
    same_device(op, q, &[Some(k), Some(v), opts.attn_mask])?;
    if q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 {
        // `[N, L, D]`: one head. A mask of 3 dims or more gets the head dim too.
        let mask = opts.attn_mask.map(|m| if m.ndim() >= 3 { m.unsqueeze(-3) } else { Ok(m.clone()) }).transpose()?;
        let heads = SdpaOptions { attn_mask: mask.as_ref(), ..*opts };
        return scaled_dot_product_attention(&q.unsqueeze(1)?, &k.unsqueeze(1)?, &v.unsqueeze(1)?, &heads)?.squeeze(1);
    }
    for t in [q, k, v] {
        float_input(op, t)?;
    }
    let (n, h, l, d) = match q.shape() {
        &[n, h, l, d] => (n, h, l, d),
        s => return Err(Error::shape(op, format!("query must be [N, H, L, D] or [N, L, D], got {s:?}"))),
    };
    let s = k.shape().get(2).copied().unwrap_or(0);
    if k.shape() != [n, h, s, d] || v.shape() != k.shape() {
        return Err(Error::shape(op, format!("key and value must be [N, H, S, D] = [{n}, {h}, S, {d}] (value's D as the query's), got {:?} and {:?}", k.shape(), v.shape())));
    }
    if !(0.0..1.0).contains(&opts.dropout_p) {
        return Err(Error::arg(op, format!("dropout_p must be in [0, 1), got {}", opts.dropout_p)));
    }
    let (q, k) = crate::amp::cast_pair(q, k)?;
    let (v, _) = crate::amp::cast_pair(v, &q)?;
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return Err(Error::dtype(op, k.dtype(), format!("query, key and value must share a dtype, got {:?}, {:?} and {:?}", q.dtype(), k.dtype(), v.dtype())));
    }
    let mask = match opts.attn_mask {
        None => None,
        Some(m) => {
            let m = match m.dtype() {
                DType::Bool => Tensor::zeros(m.shape(), q.dtype(), &m.device())?.masked_fill(&m.logical_not()?, f64::NEG_INFINITY)?,
                dt if dt.is_float() => m.to_dtype(q.dtype())?,
                dt => return Err(Error::dtype(op, dt, "attn_mask must be bool or floating point")),
            };
            Some(m.broadcast_to(&[n, h, l, s]).map_err(|_| Error::shape(op, format!("attn_mask of shape {:?} does not broadcast to [{n}, {h}, {l}, {s}]", m.shape())))?)
        }
    };
    let scale = opts.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let lbhd = |t: &Tensor| t.permute(&[2, 0, 1, 3]);
    // The fused op stores its output batch-first (`[N, L, H, D]`, as PyTorch's fused kernels
    // do), so `out.transpose(1, 2).reshape([N, L, E])` is a view.
    let out = attention_lbhd(&lbhd(&q)?, &lbhd(&k)?, &lbhd(&v)?, mask.as_ref(), scale, opts.is_causal, opts.dropout_p, true)?;
    out.permute(&[1, 2, 0, 3])
}

/// Attention over the first keys of a static key/value cache (flash-attention's
/// `cache_seqlens`): `softmax(q k^T * scale) v` over `q` `[N, H, L, D]` and `k`, `v`
/// `[N, H_kv, S, D]`, where every query of sequence n sees the keys `0..=last[n]` only (`last`
/// `[N]`, I64: the position each sequence has reached; past S - 1 all S keys, below 0 none, which
/// gives NaN as a fully masked row does). Heads share key/value heads in groups of H / H_kv
/// (grouped-query attention) without copying them. `new`: the keys and values at position
/// `last[n]`, `[N, H_kv, 1, D]` each, read in place of the cache's row there (a decode step's,
/// which it writes into the cache afterwards, so nothing waits for that write).
/// `scale` is 1/sqrt(D) when `None`. The same
/// numbers as [`scaled_dot_product_attention`] under the mask `keys <= last[n]`; on the GPU a
/// decode step's one query row per head runs as one kernel that reads only the keys it sees.
/// Returns `[N, H, L, D]`.
#[track_caller]
pub fn attention_up_to(q: &Tensor, k: &Tensor, v: &Tensor, last: &Tensor, new: Option<(&Tensor, &Tensor)>, scale: Option<f64>) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    let op = "attention_up_to";
    same_device(op, q, &[Some(k), Some(v), Some(last), new.map(|n| n.0), new.map(|n| n.1)])?;
    for t in [q, k, v].into_iter().chain(new.map(|n| n.0)).chain(new.map(|n| n.1)) {
        float_input(op, t)?;
    }
    let (n, h, d) = match q.shape() {
        &[n, h, _, d] => (n, h, d),
        s => return Err(Error::shape(op, format!("query must be [N, H, L, D], got {s:?}"))),
    };
    match k.shape() {
        &[kn, hkv, _, kd] if kn == n && kd == d && hkv > 0 && h.is_multiple_of(hkv) && v.shape() == k.shape() => {}
        _ => return Err(Error::shape(op, format!("key and value must be [N, H_kv, S, D] = [{n}, H_kv, S, {d}] with H_kv dividing the {h} query heads, got {:?} and {:?}", k.shape(), v.shape()))),
    }
    if last.shape() != [n] || last.dtype() != DType::I64 {
        return Err(Error::shape(op, format!("last must be one I64 position per sequence ([{n}]), got {:?} {:?}", last.shape(), last.dtype())));
    }
    if let Some((kn, vn)) = new {
        let row = [n, k.shape()[1], 1, d];
        if kn.shape() != row || vn.shape() != row {
            return Err(Error::shape(op, format!("the new key and value must be [N, H_kv, 1, D] = {row:?}, got {:?} and {:?}", kn.shape(), vn.shape())));
        }
    }
    let (q, k) = crate::amp::cast_pair(q, k)?;
    let (v, _) = crate::amp::cast_pair(v, &q)?;
    let new = new.map(|(kn, vn)| -> Result<(Tensor, Tensor)> { Ok((crate::amp::cast_pair(kn, &q)?.0, crate::amp::cast_pair(vn, &q)?.0)) }).transpose()?;
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() || new.as_ref().is_some_and(|(kn, vn)| kn.dtype() != q.dtype() || vn.dtype() != q.dtype()) {
        return Err(Error::dtype(op, k.dtype(), format!("query, keys and values must share a dtype, got {:?}, {:?} and {:?}", q.dtype(), k.dtype(), v.dtype())));
    }
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let lbhd = |t: &Tensor| t.permute(&[2, 0, 1, 3]);
    let (q, k, v) = (lbhd(&q)?, lbhd(&k)?, lbhd(&v)?);
    let new = new.map(|(kn, vn)| -> Result<(Tensor, Tensor)> { Ok((lbhd(&kn)?, lbhd(&vn)?)) }).transpose()?;
    let out = match crate::backend::attention_up_to_kernel_takes(&q, &k) {
        true => {
            let mut inputs = vec![&q, &k, &v, last];
            inputs.extend(new.iter().flat_map(|(kn, vn)| [kn, vn]));
            crate::ops::apply(crate::ops::Op::AttentionUpTo { scale }, &inputs)?
        }
        false => {
            let (k, v, mask) = crate::ops::attention::up_to_operands(&q, &k, &v, last, new.as_ref().map(|(kn, vn)| (kn, vn)))?;
            attention_lbhd(&q, &k, &v, Some(&mask), scale, false, 0.0, true)?
        }
    };
    out.permute(&[1, 2, 0, 3])
}

/// Attention in the sequence-first layout: q `[L, B, H, D]`, k and v `[S, B, H, D]`, an
/// additive `mask` `[B, H, L, S]` in q's dtype; returns `[L, B, H, D]`, when fused contiguous
/// so, or a view of a contiguous `[B, L, H, D]` where `batch_first_out` asks for it and the
/// kernel stores it so for free (`backend::attention_stores_batch_first`).
/// Fused (`Op::Attention`) on the GPU unless dropout is active, the kernels cannot take the
/// shape, or matmul and softmax are faster (long sequences the tensor cores do not take); on
/// the CPU matmul and softmax (the GEMM library beats the op's f64 reference loops).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_lbhd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool, dropout_p: f64, batch_first_out: bool) -> Result<Tensor> {
    // The fused kernels give no gradient for the mask: a mask that needs one takes matmul and softmax.
    let mask_needs_grad = mask.is_some_and(|m| crate::is_grad_enabled() && m.is_requires_grad());
    let fused = dropout_p == 0.0 && !mask_needs_grad && crate::backend::fused_attention_pays(q, k, v);
    if fused {
        let batch_first = batch_first_out && crate::backend::attention_stores_batch_first(q, k, v, mask, causal);
        let op = crate::ops::Op::Attention { scale, causal, batch_first };
        if batch_first {
            use crate::ops::attention::swap_seq_batch;
            let mut inputs = vec![swap_seq_batch(q)?, swap_seq_batch(k)?, swap_seq_batch(v)?];
            inputs.extend(mask.cloned());
            return swap_seq_batch(&crate::ops::apply(op, &inputs.iter().collect::<Vec<_>>())?);
        }
        let mut inputs = vec![q, k, v];
        inputs.extend(mask);
        return crate::ops::apply(op, &inputs);
    }
    if q.dtype() == DType::F32 && (q.device() == crate::Device::Cpu || mask_needs_grad) {
        // Scores of long, large-valued rows lose digits in F32 sums, and softmax magnifies the
        // loss: on the host the whole attention runs in F64 (PyTorch's CPU kernel comes close
        // to F64 there; kiln in F32 did not), rounded once at the end; so does a GPU attention
        // that differentiates its mask, as the fused F32 kernels keep their scores in double.
        let up = |t: &Tensor| t.to_dtype(DType::F64);
        let mask = mask.map(up).transpose()?;
        return attention_lbhd(&up(q)?, &up(k)?, &up(v)?, mask.as_ref(), scale, causal, dropout_p, batch_first_out)?.to_dtype(DType::F32);
    }
    // softmax(q k^T) v with matmuls over [B, H, ., D].
    let bhld = |t: &Tensor| t.permute(&[1, 2, 0, 3]);
    let (l, s) = (q.shape()[0], k.shape()[0]);
    let mut scores = bhld(q)?.mul_scalar(scale)?.matmul(&bhld(k)?.transpose(2, 3)?)?;
    if let Some(m) = mask {
        scores = scores.add(m)?;
    }
    if causal {
        let above = Tensor::full(&[l, s], f64::NEG_INFINITY, scores.dtype(), &q.device())?.triu(1)?;
        scores = scores.add(&above)?;
    }
    let w = dropout(&softmax(&scores, -1)?, dropout_p, true)?;
    w.matmul(&bhld(v)?)?.permute(&[2, 0, 1, 3])
}

/// Zeroes each element with probability `p` and scales the rest by `1 / (1 - p)` when
/// `training`; the identity otherwise (`F.dropout`). Draws from the global generator.
#[track_caller]
pub fn dropout(x: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::arg("dropout", format!("probability must be in [0, 1], got {p}")));
    }
    if !training || p == 0.0 {
        return Ok(x.clone());
    }
    if p == 1.0 {
        return x.mul_scalar(0.0);
    }
    let keep = Tensor::rand(x.shape(), DType::F32, &x.device())?.lt_scalar(1.0 - p)?;
    x.mul(&keep.to_dtype(x.dtype())?)?.div_scalar(1.0 - p)
}

/// Options of [`cross_entropy_with`], defaults as PyTorch's.
#[derive(Clone, Debug)]
pub struct CrossEntropyOptions {
    pub weight: Option<Tensor>,
    pub ignore_index: i64,
    pub label_smoothing: f64,
    pub reduction: Reduction,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions { weight: None, ignore_index: -100, label_smoothing: 0.0, reduction: Reduction::Mean }
    }
}

/// Cross-entropy of logits `[N, C]` (or `[C]`, or `[N, C, d1, ...]`) against class indices.
#[track_caller]
pub fn cross_entropy(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    cross_entropy_with(input, target, &CrossEntropyOptions::default())
}

#[track_caller]
pub fn cross_entropy_with(input: &Tensor, target: &Tensor, opts: &CrossEntropyOptions) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    class_loss("cross_entropy", input, target, opts, false)
}

/// Negative log-likelihood of log-probabilities `[N, C]` (or `[C]`, `[N, C, d1, ...]`) against
/// class indices (`F.nll_loss`).
#[track_caller]
pub fn nll_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    nll_loss_with(input, target, &CrossEntropyOptions::default())
}

/// `nll_loss` with class weights, `ignore_index` and reduction (label smoothing must be 0).
#[track_caller]
pub fn nll_loss_with(input: &Tensor, target: &Tensor, opts: &CrossEntropyOptions) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    if opts.label_smoothing != 0.0 {
        return Err(Error::arg("nll_loss", "label smoothing is a cross_entropy option"));
    }
    class_loss("nll_loss", input, target, opts, true)
}

/// Cross-entropy (`log_probs` false: logits) or NLL (`log_probs` true) against class indices.
fn class_loss(op: &'static str, input: &Tensor, target: &Tensor, opts: &CrossEntropyOptions, log_probs: bool) -> Result<Tensor> {
    float_input(op, input)?;
    let input = &crate::amp::fp32(input)?;
    if !target.dtype().is_int() {
        return Err(Error::dtype(op, target.dtype(), "targets must be class indices (I64); class-probability targets are not supported"));
    }
    if !(0.0..=1.0).contains(&opts.label_smoothing) {
        return Err(Error::arg(op, format!("label_smoothing must be in [0, 1], got {}", opts.label_smoothing)));
    }
    // Classes last, everything else flattened: logits [M, C], targets [M].
    let (logits, tshape) = match input.ndim() {
        1 => (input.unsqueeze(0)?, vec![]),
        2 => (input.clone(), vec![input.shape()[0]]),
        n if n > 2 => {
            let mut perm: Vec<i64> = vec![0];
            perm.extend(2..n as i64);
            perm.push(1);
            let mut ts = vec![input.shape()[0]];
            ts.extend_from_slice(&input.shape()[2..]);
            (input.permute(&perm)?.reshape(&[-1, input.shape()[1] as i64])?, ts)
        }
        _ => return Err(Error::shape(op, "input must have at least 1 dim")),
    };
    let c = logits.shape()[1];
    if target.shape() != tshape.as_slice() {
        return Err(Error::shape(op, format!("target of shape {:?} for input of shape {:?} (expected {tshape:?})", target.shape(), input.shape())));
    }
    if let Some(w) = &opts.weight {
        if w.shape() != [c] {
            return Err(Error::shape(op, format!("weight of shape {:?}, expected [{c}]", w.shape())));
        }
    }
    let t = target.to_dtype(DType::I64)?.reshape(&[-1])?;
    let valid = t.ne_scalar(opts.ignore_index)?;
    let safe_t = t.masked_fill(&valid.logical_not()?, 0)?;
    let (picked, classes) = if log_probs { picked_log_probs(&logits, &safe_t)? } else { picked_logits(&logits, &safe_t)? };
    let dt = picked.dtype();
    let picked = picked.neg()?;
    let validf = valid.to_dtype(dt)?;
    // Per-sample weight: w[target], 0 for ignored samples.
    let w_t = match &opts.weight {
        Some(w) => w.to_dtype(dt)?.index_select(0, &safe_t)?.mul(&validf)?,
        None => validf.clone(),
    };
    let mut loss = picked.mul(&w_t)?;
    if opts.label_smoothing > 0.0 {
        let eps = opts.label_smoothing;
        let smooth = classes.sum(opts.weight.as_ref().map(|w| w.to_dtype(dt)).transpose()?.as_ref())?.neg()?.mul(&validf)?;
        loss = loss.mul_scalar(1.0 - eps)?.add(&smooth.mul_scalar(eps / c as f64)?)?;
    }
    let loss = loss.to_dtype(input.dtype())?;
    match opts.reduction {
        Reduction::None => loss.reshape_usize(&tshape),
        Reduction::Sum => loss.sum_all(),
        Reduction::Mean => loss.sum_all()?.div(&w_t.sum_all()?.to_dtype(input.dtype())?),
    }
}

/// Each row's log-probabilities over all classes, summed (with per-class weights) on demand:
/// what label smoothing needs, without keeping `[M, C]` log-probabilities for it.
enum ClassSum {
    /// Log-probabilities given: `[M, C]`.
    LogProbs(Tensor),
    /// From logits: `logp = shifted - log_sum` with `shifted` `[M, C]` and `log_sum` `[M, 1]`.
    Shifted { shifted: Tensor, log_sum: Tensor, dtype: DType },
}

impl ClassSum {
    /// `sum_j w_j logp_j` per row (`[M]`), `w_j` = 1 without weights.
    fn sum(&self, weight: Option<&Tensor>) -> Result<Tensor> {
        match self {
            ClassSum::LogProbs(lp) => match weight {
                Some(w) => lp.mul(w)?.sum(&[1], false),
                None => lp.sum(&[1], false),
            },
            ClassSum::Shifted { shifted, log_sum, dtype } => {
                let (sum, total) = match weight {
                    Some(w) => {
                        let w = w.to_dtype(shifted.dtype())?;
                        (shifted.mul(&w)?.sum(&[1], false)?, log_sum.squeeze(1)?.mul(&w.sum_all()?)?)
                    }
                    None => (shifted.sum(&[1], false)?, log_sum.squeeze(1)?.mul_scalar(shifted.shape()[1] as f64)?),
                };
                sum.sub(&total)?.to_dtype(*dtype)
            }
        }
    }
}

/// Log-probabilities `[M, C]` at the targets `[M]`.
fn picked_log_probs(logp: &Tensor, t: &Tensor) -> Result<(Tensor, ClassSum)> {
    Ok((logp.gather(1, &t.unsqueeze(1)?)?.squeeze(1)?, ClassSum::LogProbs(logp.clone())))
}

/// `log_softmax(logits)` `[M, C]` at the targets `[M]`, as `(x_t - max) - log(sum(exp(x - max)))`
/// (the same bits as `log_softmax` there, rounded to the logits' dtype as it rounds), without
/// the full `[M, C]` log-probabilities: the target's term is picked by comparing each column's
/// index with the target, so the forward is row reductions over the logits and the backward one
/// pointwise pass, `softmax - one_hot`, instead of a scatter into a zeroed `[M, C]`.
fn picked_logits(x: &Tensor, t: &Tensor) -> Result<(Tensor, ClassSum)> {
    let dtype = x.dtype();
    let x = if dtype == dtype.compute_dtype() { x.clone() } else { x.to_dtype(dtype.compute_dtype())? };
    let m = no_grad(|| line_max(&x, 1))?;
    let shifted = x.sub(&m)?;
    let log_sum = shifted.exp()?.sum(&[1], true)?.log()?;
    // Column indices as I32 where classes fit (every vocabulary does): the comparison below
    // reads one per element of the row, half the bytes of I64.
    let index = if x.shape()[1] <= i32::MAX as usize { DType::I32 } else { DType::I64 };
    let columns = Tensor::arange(0.0, x.shape()[1] as f64, 1.0, index, &x.device())?;
    // The targets read through the column indices: themselves, with a class out of range
    // reported as a gather reports it.
    let t = columns.index_select(0, t)?;
    let hit = columns.unsqueeze(0)?.eq(&t.unsqueeze(1)?)?;
    // The target's logit, then less the max: the same bits as picking `x - max` (one term in
    // the sum, the rest exact zeros), and a sum that does not wait for the max, so a kernel
    // walking a long row takes it in the max's walk.
    let at_target = hit.where_(&x, &Tensor::scalar(0.0, x.dtype(), &x.device())?)?.sum(&[1], true)?.sub(&m)?;
    let picked = at_target.sub(&log_sum)?.squeeze(1)?.to_dtype(dtype)?;
    Ok((picked, ClassSum::Shifted { shifted, log_sum, dtype }))
}

/// `log(1 + exp(x))` without overflow, with the exact gradient `sigmoid(x)` everywhere (also
/// at 0, where a `relu + log1p(exp(-|x|))` form would give a subgradient).
fn softplus_exact(x: &Tensor) -> Result<Tensor> {
    let pos = x.clamp(Some(0.0), None)?;
    let neg = x.clamp(None, Some(0.0))?;
    let upper = x.add(&pos.neg()?.exp()?.log1p()?)?; // x + log(1 + e^-x), for x >= 0
    let lower = neg.exp()?.log1p()?; // log(1 + e^x), for x < 0
    x.ge_scalar(0.0)?.where_(&upper, &lower)
}

/// Binary cross-entropy of logits `input` against targets in [0, 1]
/// (`F.binary_cross_entropy_with_logits`): `softplus(x) - x y`, computed without overflow;
/// `pos_weight` scales the positive term: `(1 - y) x + (1 + (pw - 1) y) softplus(-x)`;
/// `weight` (broadcast to the input) scales each element's loss before the reduction.
#[track_caller]
pub fn binary_cross_entropy_with_logits(input: &Tensor, target: &Tensor, weight: Option<&Tensor>, pos_weight: Option<&Tensor>, reduction: Reduction) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    float_input("binary_cross_entropy_with_logits", input)?;
    let (input, target) = (&crate::amp::fp32(input)?, &crate::amp::fp32(target)?);
    if input.shape() != target.shape() {
        return Err(Error::shape("binary_cross_entropy_with_logits", format!("target of shape {:?} for input of shape {:?}", target.shape(), input.shape())));
    }
    let loss = match pos_weight {
        None => softplus_exact(input)?.sub(&input.mul(target)?)?,
        Some(pw) => {
            let lw = pw.sub_scalar(1.0)?.mul(target)?.add_scalar(1.0)?;
            target.rsub_scalar(1.0)?.mul(input)?.add(&lw.mul(&softplus_exact(&input.neg()?)?)?)?
        }
    };
    let loss = match weight {
        Some(w) => {
            let b = crate::layout::broadcast_shapes("binary_cross_entropy_with_logits", w.shape(), input.shape()).ok();
            if b.as_deref() != Some(input.shape()) {
                return Err(Error::shape("binary_cross_entropy_with_logits", format!("weight of shape {:?} does not broadcast to the input's shape {:?}", w.shape(), input.shape())));
            }
            loss.mul(&crate::amp::fp32(w)?)?
        }
        None => loss,
    };
    match reduction {
        Reduction::None => Ok(loss),
        Reduction::Mean => loss.mean_all(),
        Reduction::Sum => loss.sum_all(),
    }
}

/// Mean (or sum, or elementwise) squared error (`F.mse_loss`); shapes broadcast.
#[track_caller]
pub fn mse_loss(input: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    float_input("mse_loss", input)?;
    let (input, target) = (&crate::amp::fp32(input)?, &crate::amp::fp32(target)?);
    let d = input.sub(target)?;
    let sq = d.mul(&d)?;
    match reduction {
        Reduction::None => Ok(sq),
        Reduction::Mean => sq.mean_all(),
        Reduction::Sum => sq.sum_all(),
    }
}

impl Tensor {
    /// See [`softmax`].
    #[track_caller]
    pub fn softmax(&self, dim: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        softmax(self, dim)
    }
    /// See [`log_softmax`].
    #[track_caller]
    pub fn log_softmax(&self, dim: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        log_softmax(self, dim)
    }
}

pub use super::batchnorm::batch_norm;
pub use super::conv::{adaptive_avg_pool2d, avg_pool2d, conv2d, conv2d_bias_act, max_pool2d, max_pool2d_with, max_pool2d_with_indices, Conv2dArgs, MaxPool2dArgs};
