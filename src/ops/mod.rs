//! Primitive ops: one `Op` value per kind of primitive, one place that runs it on a backend
//! (`forward`) and one place that differentiates it (`backward`). Public tensor methods in the
//! sibling modules validate arguments, then build these ops; composites are written in them.

pub(crate) mod attention;
pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod index;
pub(crate) mod inplace;
pub(crate) mod matmul;
pub(crate) mod movement;
pub mod pointwise;
pub(crate) mod pool;
pub(crate) mod reduce;
pub(crate) mod rows;

pub use conv::Conv2dArgs;
pub use pool::MaxPool2dArgs;
pub use pointwise::{BinaryOp, UnaryOp};
pub use reduce::ReduceOp;

use crate::backend::{check_device, cpu, cuda};
use crate::storage::BackendStorage;
use crate::layout::{Layout, MemoryFormat, FROM_NHWC, TO_NHWC};
use crate::{DType, Error, Result, Tensor};

/// A primitive op with its static arguments. Inputs are tensors passed beside it.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Unary(UnaryOp),
    /// Same-shape operands; arithmetic in the given dtype (operands are converted on the fly).
    Binary(BinaryOp, DType),
    /// `cond ? a : b` on same-shape operands, producing the given dtype.
    Where(DType),
    /// A conversion to another dtype, in the input's memory format; to the same dtype, a
    /// contiguous copy (`Tensor::copy_contiguous`).
    Cast(DType),
    /// A copy stored densely in the format (`Tensor::to_memory_format`).
    Relayout(MemoryFormat),
    /// Reduces sorted `dims`; `keepdim` keeps them as size 1.
    Reduce(ReduceOp, Vec<usize>, bool),
    /// A view with a new shape (a copy first when the strides do not allow one).
    Reshape(Vec<usize>),
    Permute(Vec<usize>),
    /// A broadcast view (stride 0 on expanded dims); same rank as the input.
    Expand(Vec<usize>),
    /// `start, start+step, ...` (`len` of them) along `dim`, as a view.
    Slice { dim: usize, start: usize, len: usize, step: usize },
    Cat(usize),
    /// Constant padding `(before, after)` per dim.
    Pad(Vec<(usize, usize)>, f64),
    IndexSelect(usize),
    Gather(usize),
    ScatterAdd(usize),
    /// `torch.scatter` along the dim: a copy of the base with src written at the index.
    Scatter(usize),
    /// [B, M, K] @ [B, K, N].
    Matmul,
    /// 2-D cross-correlation of [N, C, H, W] by [O, C / groups, KH, KW] -> [N, O, OH, OW]
    /// (no bias: adding it is a separate, fusable op).
    Conv2d(Conv2dArgs),
    /// `Conv2d`'s gradient for its input, from (grad of the output, weight); the input's
    /// (H, W), which the output's size does not determine when the stride is above 1.
    Conv2dGradInput(Conv2dArgs, (usize, usize)),
    /// `Conv2d`'s gradient for its weight, from (input, grad of the output); the kernel's (KH, KW).
    Conv2dGradWeight(Conv2dArgs, (usize, usize)),
    /// A convolution with its epilogue, relu?(conv2d(x, w) + bias + residual), from (x, w,
    /// bias `[O]` in x's compute dtype (F32 for F16 / BF16), and optionally a residual of the
    /// output's shape), computed in the compute dtype and rounded once (`true`: ReLU). On the GPU
    /// one cuDNN kernel where it has one for the geometry (an inference network's convolution,
    /// folded batch norm, skip connection and ReLU read and write each activation once).
    Conv2dBiasAct(Conv2dArgs, bool),
    /// The maximum of each window of [N, C, H, W] (`ops::pool`) -> [N, C, OH, OW].
    MaxPool2d(MaxPool2dArgs),
    /// `MaxPool2d`'s gradient for its input, from (input, grad of the output).
    MaxPool2dBackward(MaxPool2dArgs),
    /// A copy on another device.
    ToDevice { from: crate::Device, to: crate::Device, non_blocking: bool },
    /// softmax(scale q k^T + mask) v over q `[L, B, H, D]`, k and v `[S, B, H, D]` and an
    /// optional additive mask `[B, H, L, S]` (any strides), keys after the query masked out
    /// when `causal`; the output is contiguous `[L, B, H, D]`, so `[L, B, E]` is a view of it.
    /// `batch_first`: q, k, v and the output are `[B, L, H, D]` instead (the output contiguous
    /// so, `[B, L, E]` a view of it, as PyTorch's fused attention leaves it).
    Attention { scale: f64, causal: bool, batch_first: bool },
    /// The gradients of [`Op::Attention`] from inputs (q, k, v, out, d(out)[, mask]), packed as
    /// one vector of q's dtype `[dq | dk | dv | lse | delta]` (the last two per query row,
    /// `[B, H, L]`: the scores' log-sum-exp and d(out)·out, where the backend computed them;
    /// nothing reads them). Every backend computes in F32 or wider and rounds once at the end.
    /// `batch_first` as the forward's: the gradients are in its order, and where q, k and v
    /// have one shape, side by side per row (`[B, L, 3, H, D]`, so a projection that made
    /// them in one product gets its gradient as a view): `AttnDims::grads`.
    AttentionBackward { scale: f64, causal: bool, batch_first: bool },
    /// softmax(scale q k^T) v where the queries of batch b see only the keys `0..=last[b]` (a
    /// static cache's filled positions, flash-attention's `cache_seqlens`), from q
    /// `[L, B, H, D]`, k and v `[S, B, H_kv, D]` (heads share key/value heads in groups of
    /// H / H_kv) and `last` `[B]` (I64; below 0 no key: NaN, as a fully masked row), and
    /// optionally the key and value at position `last[b]` `[1, B, H_kv, D]` each, read in place
    /// of the cache's row there (which the caller writes afterwards). The output is contiguous
    /// `[L, B, H, D]`, as [`Op::Attention`]'s.
    AttentionUpTo { scale: f64 },
}

/// The sizes of an attention: L queries, S keys, B batches, H heads of D features.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnDims {
    pub l: usize,
    pub s: usize,
    pub b: usize,
    pub h: usize,
    pub d: usize,
}

impl AttnDims {
    /// Of q `[L, B, H, D]` and k `[S, B, H, D]`.
    pub(crate) fn of(q: &[usize], k: &[usize]) -> AttnDims {
        AttnDims { l: q[0], s: k[0], b: q[1], h: q[2], d: q[3] }
    }
    /// Of an attention op's q and k, `[B, L, H, D]` and `[B, S, H, D]` when `batch_first`.
    pub(crate) fn of_op(q: &[usize], k: &[usize], batch_first: bool) -> AttnDims {
        match batch_first {
            true => AttnDims { l: q[1], s: k[1], b: q[0], h: q[2], d: q[3] },
            false => AttnDims::of(q, k),
        }
    }
    /// The output's strides along (L, B, H) (D contiguous): `[L, B, H, D]` contiguous, or
    /// `[B, L, H, D]` when `batch_first`.
    pub(crate) fn out_strides(&self, batch_first: bool) -> [usize; 3] {
        let AttnDims { l, b, h, d, .. } = *self;
        if batch_first {
            [h * d, l * h * d, d]
        } else {
            [b * h * d, h * d, d]
        }
    }
    /// Where [`Op::AttentionBackward`]'s packed result keeps dq, dk and dv: each one's first
    /// element and its strides along (L or S, B, H). Seq-first, each contiguous `[L, B, H, D]`
    /// after the other; batch-first, each contiguous `[B, L, H, D]`, or where queries and keys
    /// have one shape (self-attention without shared heads), side by side as `[B, L, 3, H, D]`.
    pub(crate) fn grads(&self, batch_first: bool) -> [(usize, [usize; 3]); 3] {
        let AttnDims { l, s, b, h, d } = *self;
        let (nq, nk) = (l * b * h * d, s * b * h * d);
        match batch_first {
            false => {
                let st = self.out_strides(false);
                [(0, st), (nq, st), (nq + nk, st)]
            }
            true if l == s => {
                let st = [3 * h * d, 3 * l * h * d, d];
                [(0, st), (h * d, st), (2 * h * d, st)]
            }
            true => [(0, self.out_strides(true)), (nq, [h * d, s * h * d, d]), (nq + nk, [h * d, s * h * d, d])],
        }
    }
    /// Elements of [`Op::AttentionBackward`]'s packed result.
    pub(crate) fn packed_len(&self) -> usize {
        let AttnDims { l, s, b, h, d } = *self;
        l * b * h * d + 2 * s * b * h * d + 2 * b * h * l
    }
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => u.name(),
            Op::Binary(b, _) => b.name(),
            Op::Where(_) => "where",
            Op::Cast(_) => "to_dtype",
            Op::Relayout(_) => "to_memory_format",
            Op::Reduce(r, ..) => r.name(),
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Expand(_) => "expand",
            Op::Slice { .. } => "slice",
            Op::Cat(_) => "cat",
            Op::Pad(..) => "pad",
            Op::IndexSelect(_) => "index_select",
            Op::Gather(_) => "gather",
            Op::ScatterAdd(_) => "scatter_add",
            Op::Scatter(_) => "scatter",
            Op::Matmul => "matmul",
            Op::Conv2d(_) => "conv2d",
            Op::Conv2dGradInput(..) => "conv2d_grad_input",
            Op::Conv2dGradWeight(..) => "conv2d_grad_weight",
            Op::Conv2dBiasAct(..) => "conv2d_bias_act",
            Op::MaxPool2d(_) => "max_pool2d",
            Op::MaxPool2dBackward(_) => "max_pool2d_backward",
            Op::ToDevice { .. } => "to_device",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::AttentionUpTo { .. } => "attention_up_to",
        }
    }

    /// A convolution product (a cuDNN call on CUDA, made of other ops elsewhere).
    pub(crate) fn is_conv(&self) -> bool {
        matches!(self, Op::Conv2d(_) | Op::Conv2dGradInput(..) | Op::Conv2dGradWeight(..) | Op::Conv2dBiasAct(..))
    }

    /// A view of its input's storage: no kernel on any device.
    pub(crate) fn is_view(&self) -> bool {
        matches!(self, Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. })
    }

    /// Which inputs gradients flow into.
    pub(crate) fn differentiable_inputs(&self, n: usize) -> Vec<bool> {
        match self {
            Op::Unary(u) => vec![u.differentiable()],
            Op::Binary(b, _) => vec![b.differentiable(); 2],
            Op::Where(_) => vec![false, true, true],
            Op::Reduce(r, ..) => vec![r.differentiable()],
            Op::IndexSelect(_) | Op::Gather(_) => vec![true, false],
            Op::ScatterAdd(_) | Op::Scatter(_) => vec![true, false, true],
            Op::Attention { .. } => (0..n).map(|i| i < 3).collect(),
            Op::AttentionUpTo { .. } => (0..n).map(|i| i != 3).collect(),
            Op::AttentionBackward { .. } | Op::MaxPool2dBackward(_) => vec![false; n],
            _ => vec![true; n],
        }
    }

    /// Which inputs, and whether the output, backward reads.
    pub(crate) fn saves(&self, n: usize) -> (Vec<bool>, bool) {
        match self {
            Op::Unary(u) => {
                let (i, o) = u.saves();
                (vec![i], o)
            }
            Op::Binary(b, _) => {
                let (i, o) = b.saves();
                (vec![i; 2], o)
            }
            Op::Where(_) => (vec![true, false, false], false),
            Op::Reduce(ReduceOp::Sum, ..) => (vec![false], false),
            Op::Reduce(..) => (vec![true], true),
            Op::IndexSelect(_) | Op::Gather(_) => (vec![false, true], false),
            Op::ScatterAdd(_) | Op::Scatter(_) => (vec![false, true, false], false),
            Op::Attention { .. } | Op::AttentionUpTo { .. } => (vec![true; n], true),
            // The output for ReLU's mask.
            Op::Conv2dBiasAct(_, relu) => ((0..n).map(|i| i < 2).collect(), *relu),
            Op::MaxPool2d(_) => (vec![true], false),
            Op::Matmul | Op::Conv2d(_) | Op::Conv2dGradInput(..) | Op::Conv2dGradWeight(..) => (vec![true, true], false),
            _ => (vec![false; n], false),
        }
    }

    /// The shape and dtype of the result, from the inputs' shapes and dtypes (validated by the
    /// caller). Tracing records nodes with it; `forward` allocates with it.
    pub(crate) fn out_meta(&self, xs: &[(&[usize], DType)]) -> Result<(Vec<usize>, DType)> {
        let (shape, dt) = xs[0];
        Ok(match self {
            Op::Unary(u) => (shape.to_vec(), u.out_dtype(dt)?),
            Op::Binary(b, c) => (shape.to_vec(), b.out_dtype(*c)),
            Op::Where(d) => (xs[1].0.to_vec(), *d),
            Op::Cast(d) => (shape.to_vec(), *d),
            Op::Relayout(_) => (shape.to_vec(), dt),
            Op::Reduce(r, dims, keepdim) => (reduce::reduced_shape(shape, dims, *keepdim), r.out_dtype(dt)),
            Op::Reshape(s) | Op::Expand(s) => (s.clone(), dt),
            Op::Permute(perm) => (perm.iter().map(|&d| shape[d]).collect(), dt),
            Op::Slice { dim, len, .. } => {
                let mut s = shape.to_vec();
                s[*dim] = *len;
                (s, dt)
            }
            Op::Cat(dim) => {
                let mut s = shape.to_vec();
                s[*dim] = xs.iter().try_fold(0usize, |n, x| n.checked_add(x.0[*dim])).ok_or_else(|| too_large("cat"))?;
                (s, dt)
            }
            Op::Pad(pads, _) => {
                let s = shape.iter().zip(pads).map(|(d, p)| d.checked_add(p.0)?.checked_add(p.1)).collect::<Option<Vec<_>>>();
                (s.ok_or_else(|| too_large("pad"))?, dt)
            }
            Op::IndexSelect(dim) => {
                let mut s = shape.to_vec();
                s[*dim] = crate::layout::numel(xs[1].0);
                (s, dt)
            }
            Op::Gather(_) => (xs[1].0.to_vec(), dt),
            Op::ScatterAdd(_) | Op::Scatter(_) | Op::ToDevice { .. } => (shape.to_vec(), dt),
            Op::Matmul => (vec![shape[0], shape[1], xs[1].0[2]], dt),
            Op::Attention { .. } | Op::AttentionUpTo { .. } => (shape.to_vec(), dt),
            Op::AttentionBackward { batch_first, .. } => (vec![AttnDims::of_op(shape, xs[1].0, *batch_first).packed_len()], dt),
            Op::Conv2d(a) | Op::Conv2dBiasAct(a, _) => (conv::out_shape(a, shape, xs[1].0)?, dt),
            Op::Conv2dGradInput(a, hw) => (vec![shape[0], xs[1].0[1] * a.groups, hw.0, hw.1], dt),
            Op::Conv2dGradWeight(a, k) => (vec![xs[1].0[1], shape[1] / a.groups.max(1), k.0, k.1], dt),
            Op::MaxPool2d(a) => {
                let (oh, ow) = a.out_hw("max_pool2d", shape[2], shape[3])?;
                (vec![shape[0], shape[1], oh, ow], dt)
            }
            Op::MaxPool2dBackward(_) => (shape.to_vec(), dt),
        })
    }

    /// Runs the op on its inputs' device. Arguments were validated by the caller.
    #[track_caller]
    /// Whether this op's result is channels-last because its inputs are (PyTorch's elementwise
    /// ops and padding preserve the format): the first input not broadcast along any dim
    /// decides. A cast to the same dtype is a contiguous copy (`Tensor::copy_contiguous`).
    fn keeps_channels_last(&self, xs: &[&Tensor]) -> bool {
        let elementwise = match self {
            Op::Unary(_) | Op::Binary(..) | Op::Where(_) | Op::Pad(..) => true,
            Op::Cast(dt) => *dt != xs[0].dtype(),
            _ => false,
        };
        if !elementwise || xs[0].ndim() != 4 {
            return false;
        }
        let full = |t: &&&Tensor| t.shape().iter().zip(t.strides()).all(|(&d, &s)| d <= 1 || s != 0);
        xs.iter().find(full).is_some_and(|t| t.layout().suggested_format() == MemoryFormat::ChannelsLast)
    }

    pub(crate) fn forward(&self, xs: &[&Tensor]) -> Result<Tensor> {
        let _rec = crate::profiler::cpu_op(self, xs);
        let device = xs[0].device();
        for x in &xs[1..] {
            if x.device() != device {
                return Err(Error::DeviceMismatch { op: self.name(), a: device, b: x.device() });
            }
        }
        let x = xs[0];
        // Views first: they need no kernel on any device.
        match self {
            Op::ToDevice { to, non_blocking, .. } => return x.copy_to_device(*to, *non_blocking),
            Op::Reshape(shape) => {
                return Ok(match x.layout().view_strides(shape) {
                    Some(strides) => x.view_as_layout(Layout { shape: shape.clone(), strides, offset: x.layout().offset }),
                    None => {
                        // A fresh copy, not a view of the input: in-place ops on it are fine.
                        let c = x.copy_contiguous()?;
                        Tensor::from_parts(c.storage().clone(), Layout::contiguous(shape), c.dtype(), false)
                    }
                });
            }
            Op::Permute(perm) => return Ok(x.view_as_layout(x.layout().permuted(perm))),
            Op::Expand(shape) => {
                let l = x.layout();
                let strides = shape.iter().zip(&l.shape).zip(&l.strides).map(|((&s, &d), &st)| if s == d { st } else { 0 }).collect();
                return Ok(x.view_as_layout(Layout { shape: shape.clone(), strides, offset: l.offset }));
            }
            Op::Slice { dim, start, len, step } => return Ok(x.view_as_layout(x.layout().sliced(*dim, *start, *len, *step))),
            _ => {}
        }
        check_device(self.name(), device)?;
        if self.keeps_channels_last(xs) {
            let op = match self {
                Op::Pad(pads, value) => Op::Pad(TO_NHWC.iter().map(|&d| pads[d]).collect(), *value),
                op => op.clone(),
            };
            return over_nhwc(xs, |views| op.compute(views));
        }
        self.compute(xs)
    }

    /// `forward` of an op that needs a backend, on inputs on one (checked) device.
    fn compute(&self, xs: &[&Tensor]) -> Result<Tensor> {
        let (x, device) = (xs[0], xs[0].device());
        let metas: Vec<(&[usize], DType)> = xs.iter().map(|t| (t.shape(), t.dtype())).collect();
        let (shape, dtype) = self.out_meta(&metas)?;
        let n = crate::layout::checked_numel(self.name(), &shape, dtype.size_in_bytes())?;
        if !device.is_cuda() {
            cpu::ensure_host_memory(self.name(), n * dtype.size_in_bytes())?;
        }
        if self.is_conv() {
            return conv::run(self, xs, &shape);
        }
        let on_cuda = device.is_cuda();
        // The same op on the tensors' backend: `run!(cpu call, cuda call)`.
        macro_rules! run {
            ($cpu:expr, $cuda:expr) => {
                if on_cuda { BackendStorage::Cuda($cuda?) } else { BackendStorage::Cpu($cpu) }
            };
        }
        let storage = match self {
            Op::Unary(u) => run!(cpu::pointwise::unary(*u, x, dtype), cuda::kernels::unary(*u, x, dtype)),
            Op::Binary(b, c) => run!(cpu::pointwise::binary(*b, x, xs[1], *c), cuda::kernels::binary(*b, x, xs[1], *c)),
            Op::Where(dt) => run!(cpu::pointwise::where_(x, xs[1], xs[2], *dt), cuda::kernels::where_(x, xs[1], xs[2], *dt)),
            Op::Cast(dt) => run!(cpu::cast(x, *dt), cuda::kernels::cast(x, *dt)),
            Op::Relayout(format) => return dense_copy(x, *format),
            Op::Reduce(r, dims, _) => run!(cpu::reduce::reduce(*r, x, dims, dtype), cuda::kernels::reduce(*r, x, dims, dtype)),
            Op::Cat(dim) => run!(cpu::index::cat(xs, *dim, &shape, x.dtype()), cuda::kernels::cat(xs, *dim, &shape, x.dtype())),
            Op::Pad(pads, value) => run!(cpu::index::pad(x, pads, *value, &shape), cuda::kernels::pad(x, pads, *value, &shape)),
            Op::IndexSelect(dim) => run!(cpu::index::index_select(x, *dim, xs[1])?, cuda::kernels::index_select(x, *dim, xs[1])),
            Op::Gather(dim) => run!(cpu::index::gather_dim(x, *dim, xs[1])?, cuda::kernels::gather_dim("gather", x, *dim, xs[1])),
            Op::ScatterAdd(dim) => run!(cpu::index::scatter_add(x, *dim, xs[1], xs[2])?, cuda::kernels::scatter_add(x, *dim, xs[1], xs[2])),
            Op::Scatter(dim) => run!(cpu::index::scatter(x, *dim, xs[1], xs[2])?, cuda::kernels::scatter(x, *dim, xs[1], xs[2])),
            Op::Matmul => run!(cpu::matmul::bmm(x, xs[1], x.dtype()), cuda::kernels::bmm(x, xs[1], x.dtype())),
            // Backends take `[L, B, H, D]` views; `batch_first` says where the results go.
            Op::Attention { scale, causal, batch_first } => {
                let (q, k, v) = attention::seq_first_qkv(xs, *batch_first)?;
                let mask = xs.get(3).copied();
                if on_cuda {
                    BackendStorage::Cuda(cuda::kernels::attention::attention(&q, &k, &v, mask, *scale, *causal, *batch_first)?)
                } else {
                    let y = BackendStorage::Cpu(cpu::attention::attention(&q, &k, &v, mask, *scale, *causal));
                    if *batch_first {
                        return attention::swap_seq_batch(&Tensor::from_backend(y, q.shape()))?.copy_contiguous();
                    }
                    y
                }
            }
            Op::AttentionBackward { scale, causal, batch_first } => {
                let (q, k, v) = attention::seq_first_qkv(xs, *batch_first)?;
                let (out, g) = (attention::seq_first(xs[3], *batch_first)?, attention::seq_first(xs[4], *batch_first)?);
                let mask = xs.get(5).copied();
                if *batch_first {
                    if on_cuda {
                        if let Some(p) = cuda::kernels::attention::attention_backward_cudnn(&q, &k, &v, &out, &g, mask, *scale, *causal, true)? {
                            return Ok(Tensor::from_backend(BackendStorage::Cuda(p), &shape));
                        }
                    }
                    // Elsewhere the seq-first gradients, laid out again.
                    let mut inputs = vec![&q, &k, &v, &out, &g];
                    inputs.extend(mask);
                    let seq = Op::AttentionBackward { scale: *scale, causal: *causal, batch_first: false }.compute(&inputs)?;
                    return attention::batch_first_grads(&seq, &AttnDims::of(q.shape(), k.shape()));
                }
                let (out, g) = (out.contiguous()?, g.contiguous()?);
                run!(cpu::attention::attention_backward(&q, &k, &v, &g, mask, *scale, *causal), cuda::kernels::attention::attention_backward(&q, &k, &v, &out, &g, mask, *scale, *causal))
            }
            // On the GPU only what its kernel takes (`backend::attention_up_to_kernel_takes`).
            Op::AttentionUpTo { scale } => {
                let (q, k, v) = (head_dim_contiguous(x)?, head_dim_contiguous(xs[1])?, head_dim_contiguous(xs[2])?);
                let new = match xs.get(4..6) {
                    Some([kn, vn]) => Some((head_dim_contiguous(kn)?, head_dim_contiguous(vn)?)),
                    _ => None,
                };
                let new = new.as_ref().map(|(kn, vn)| (kn, vn));
                if on_cuda {
                    let settled = attention::SettledCache::held() && k.shares_storage_with(xs[1]) && v.shares_storage_with(xs[2]);
                    BackendStorage::Cuda(cuda::kernels::attention::attention_up_to(&q, &k, &v, xs[3], new, *scale, settled)?)
                } else {
                    let (k, v, mask) = attention::up_to_operands(&q, &k, &v, xs[3], new)?;
                    BackendStorage::Cpu(cpu::attention::attention(&q, &k, &v, Some(&mask), *scale, false))
                }
            }
            // Channels-last inputs: on CUDA the kernels store NHWC order themselves, on the host
            // the NCHW result is copied.
            Op::MaxPool2d(a) => {
                let nhwc = on_cuda && x.suggest_memory_format() == MemoryFormat::ChannelsLast;
                let y = run!(cpu::maxpool::max_pool2d(x, a, &shape), cuda::kernels::maxpool::max_pool2d(x, a, &shape, nhwc));
                return pooled(y, &shape, nhwc, x);
            }
            Op::MaxPool2dBackward(a) => {
                let nhwc = on_cuda && x.suggest_memory_format() == MemoryFormat::ChannelsLast;
                let dx = run!(cpu::maxpool::max_pool2d_backward(x, xs[1], a), cuda::kernels::maxpool::max_pool2d_backward(x, xs[1], a, nhwc));
                return pooled(dx, &shape, nhwc, x);
            }
            Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } | Op::ToDevice { .. } => unreachable!("handled above"),
            Op::Conv2d(_) | Op::Conv2dGradInput(..) | Op::Conv2dGradWeight(..) | Op::Conv2dBiasAct(..) => unreachable!("handled above"),
        };
        Ok(Tensor::from_backend(storage, &shape))
    }

    /// Input gradients from the output gradient `g`. `xs` and `y` hold what `saves` asked for;
    /// `meta` the inputs' shapes and dtypes; `want` which gradients are needed.
    pub(crate) fn backward(
        &self,
        xs: &[Option<Tensor>],
        y: Option<&Tensor>,
        meta: &[(Vec<usize>, DType)],
        g: &Tensor,
        want: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        let in_shape = &meta[0].0;
        let one = |t: Result<Tensor>| -> Result<Vec<Option<Tensor>>> { Ok(vec![Some(t?)]) };
        match self {
            Op::Unary(u) => one(u.backward(xs[0].as_ref(), y, g)),
            Op::Binary(b, _) => Ok(b.backward(xs[0].as_ref(), xs[1].as_ref(), y, g, [want[0], want[1]])?.into()),
            Op::Where(_) => {
                let c = xs[0].as_ref().expect("condition saved");
                Ok(vec![None, Some(g.masked_fill(&c.logical_not()?, 0.0)?), Some(g.masked_fill(c, 0.0)?)])
            }
            Op::Cast(_) | Op::Relayout(_) => one(Ok(g.clone())),
            Op::ToDevice { from, .. } => one(g.to_device(from)),
            Op::Reduce(r, dims, keepdim) => one(r.backward(xs[0].as_ref(), y, g, in_shape, dims, *keepdim)),
            Op::Reshape(_) => one(g.reshape_usize(in_shape)),
            Op::Permute(perm) => {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                one(g.permute_usize(&inv))
            }
            Op::Expand(_) => one(g.sum_to_shape(in_shape)),
            Op::Slice { dim, start, len, step } => one(movement::slice_backward(g, in_shape, *dim, *start, *len, *step)),
            Op::Cat(dim) => {
                let mut at = 0;
                meta.iter()
                    .map(|(s, _)| {
                        let part = g.narrow(*dim as i64, at, s[*dim])?;
                        at += s[*dim];
                        Ok(Some(part))
                    })
                    .collect()
            }
            Op::Pad(pads, _) => {
                let mut r = g.clone();
                for (d, (p, s)) in pads.iter().zip(in_shape).enumerate() {
                    r = r.narrow(d as i64, p.0, *s)?;
                }
                one(Ok(r))
            }
            Op::IndexSelect(dim) => {
                let idx = xs[1].as_ref().expect("index saved");
                let mut ishape = vec![1; g.ndim()];
                ishape[*dim] = idx.numel();
                let idx = idx.reshape_usize(&ishape)?.broadcast_to(g.shape())?;
                let base = Tensor::zeros(in_shape, g.dtype(), &g.device())?;
                Ok(vec![Some(base.scatter_add(*dim as i64, &idx, g)?), None])
            }
            Op::Gather(dim) => {
                let idx = xs[1].as_ref().expect("index saved");
                let base = Tensor::zeros(in_shape, g.dtype(), &g.device())?;
                Ok(vec![Some(base.scatter_add(*dim as i64, idx, g)?), None])
            }
            Op::ScatterAdd(dim) | Op::Scatter(dim) => {
                let idx = xs[1].as_ref().expect("index saved");
                let gs = if want[2] {
                    let part = g.gather(*dim as i64, idx)?;
                    let src_shape = &meta[2].0;
                    let pads: Vec<(usize, usize)> = part.shape().iter().zip(src_shape).map(|(&p, &s)| (0, s - p)).collect();
                    Some(if pads.iter().all(|p| p.1 == 0) { part } else { crate::ops::apply(Op::Pad(pads, 0.0), &[&part])? })
                } else {
                    None
                };
                // Scatter's overwritten elements take no gradient back to the base.
                let gb = match self {
                    Op::Scatter(_) if want[0] => Some(g.scatter(*dim as i64, idx, &Tensor::zeros(idx.shape(), g.dtype(), &g.device())?)?),
                    Op::Scatter(_) => None,
                    _ => Some(g.clone()),
                };
                Ok(vec![gb, None, gs])
            }
            Op::Matmul => {
                let (a, b) = (xs[0].as_ref().expect("saved"), xs[1].as_ref().expect("saved"));
                // A gradient comes in its operand's layout, as PyTorch's do: for a transposed
                // view (a `Linear` weight's `W.t()`) the product is computed transposed, so the
                // weight's own gradient is contiguous and its update reads it in order.
                let transposed = |t: &Tensor| {
                    t.shape()[1] > 1 && t.shape()[2] > 1 && crate::compile::trace::swaps_last_two(t).unwrap_or_else(|| t.strides()[1] == 1 && t.strides()[2] != 1)
                };
                let gt = || g.transpose(1, 2);
                let ga = match want[0] {
                    false => None,
                    true if transposed(a) => Some(apply(Op::Matmul, &[b, &gt()?])?.transpose(1, 2)?),
                    true => Some(apply(Op::Matmul, &[g, &b.transpose(1, 2)?])?),
                };
                let gb = match want[1] {
                    false => None,
                    true if transposed(b) => Some(apply(Op::Matmul, &[&gt()?, a])?.transpose(1, 2)?),
                    true => Some(apply(Op::Matmul, &[&a.transpose(1, 2)?, g])?),
                };
                Ok(vec![ga, gb])
            }
            Op::Attention { scale, causal, batch_first } => {
                let saved = |i: usize| xs[i].as_ref().expect("attention inputs saved");
                let (q, k, v) = (saved(0), saved(1), saved(2));
                let y = y.expect("attention output saved");
                // (cuDNN reads a batch-first gradient in any layout; the rest copy it if need be.)
                let g = if *batch_first { g.clone() } else { g.contiguous()? };
                let mut inputs = vec![q, k, v, y, &g];
                if let Some(Some(m)) = xs.get(3) {
                    inputs.push(m);
                }
                let packed = apply(Op::AttentionBackward { scale: *scale, causal: *causal, batch_first: *batch_first }, &inputs)?;
                let n = AttnDims::of_op(q.shape(), k.shape(), *batch_first);
                let part = |i: usize| attention::grad_of(&packed, &n, *batch_first, i)?.to_dtype(meta[i].1);
                let mut grads = vec![
                    if want[0] { Some(part(0)?) } else { None },
                    if want[1] { Some(part(1)?) } else { None },
                    if want[2] { Some(part(2)?) } else { None },
                ];
                grads.resize(meta.len(), None);
                Ok(grads)
            }
            Op::AttentionBackward { .. } => Err(Error::arg("attention_backward", "the attention gradient is not differentiable again")),
            // The masked attention's gradient, with each key/value head's share summed over the
            // query heads that read it.
            Op::AttentionUpTo { scale } => {
                let saved = |i: usize| xs[i].as_ref().expect("attention inputs saved");
                let (q, k, v, last) = (saved(0), saved(1), saved(2), saved(3));
                let new = (xs.len() > 4).then(|| (saved(4), saved(5)));
                let y = y.expect("attention output saved");
                let (kh, vh, mask) = attention::up_to_operands(q, k, v, last, new)?;
                let g = g.contiguous()?;
                let packed = apply(Op::AttentionBackward { scale: *scale, causal: false, batch_first: false }, &[q, &kh, &vh, y, &g, &mask])?;
                let n = AttnDims::of_op(q.shape(), kh.shape(), false);
                let mut grads = vec![None; meta.len()];
                if want[0] {
                    grads[0] = Some(attention::grad_of(&packed, &n, false, 0)?.to_dtype(meta[0].1)?);
                }
                // Key and value gradients: the cache's rows, and the new row's where it stood in.
                for i in [1, 2] {
                    if !(want[i] || new.is_some() && want[i + 3]) {
                        continue;
                    }
                    let heads = attention::sum_head_groups(&attention::grad_of(&packed, &n, false, i)?, k.shape()[2])?;
                    let (cache, fresh) = attention::split_new_row(&heads, new.is_some())?;
                    if want[i] {
                        grads[i] = Some(cache.to_dtype(meta[i].1)?);
                    }
                    if let Some(f) = fresh.filter(|_| want[i + 3]) {
                        grads[i + 3] = Some(f.to_dtype(meta[i + 3].1)?);
                    }
                }
                Ok(grads)
            }
            // The three convolution products are bilinear and adjoint to one another, so each
            // one's gradients are the other two.
            Op::Conv2d(a) => {
                let (x, w) = (xs[0].as_ref().expect("saved"), xs[1].as_ref().expect("saved"));
                let kernel = (meta[1].0[2], meta[1].0[3]);
                let gx = if want[0] { Some(apply(Op::Conv2dGradInput(*a, (in_shape[2], in_shape[3])), &[g, w])?) } else { None };
                let gw = if want[1] { Some(apply(Op::Conv2dGradWeight(*a, kernel), &[x, g])?) } else { None };
                Ok(vec![gx, gw])
            }
            // The convolution's gradients from the output gradient where ReLU passed it; the
            // bias's is its sum per channel, the residual's itself.
            Op::Conv2dBiasAct(a, relu) => {
                let g = match relu {
                    true => g.masked_fill(&y.expect("output saved").le_scalar(0.0)?, 0.0)?,
                    false => g.clone(),
                };
                let mut grads = Op::Conv2d(*a).backward(&xs[..2], None, &meta[..2], &g, &want[..2])?;
                grads.push(if want[2] { Some(g.to_dtype(meta[2].1)?.sum(&[0, 2, 3], false)?) } else { None });
                if meta.len() > 3 {
                    grads.push(if want[3] { Some(g.to_dtype(meta[3].1)?) } else { None });
                }
                Ok(grads)
            }
            Op::Conv2dGradInput(a, _) => {
                // <GradInput(dy, w), g> = <dy, Conv2d(g, w)>.
                let (dy, w) = (xs[0].as_ref().expect("saved"), xs[1].as_ref().expect("saved"));
                let kernel = (meta[1].0[2], meta[1].0[3]);
                let gdy = if want[0] { Some(apply(Op::Conv2d(*a), &[g, w])?) } else { None };
                let gw = if want[1] { Some(apply(Op::Conv2dGradWeight(*a, kernel), &[g, dy])?) } else { None };
                Ok(vec![gdy, gw])
            }
            Op::Conv2dGradWeight(a, _) => {
                // <GradWeight(x, dy), g> = <dy, Conv2d(x, g)>.
                let (x, dy) = (xs[0].as_ref().expect("saved"), xs[1].as_ref().expect("saved"));
                let gx = if want[0] { Some(apply(Op::Conv2dGradInput(*a, (in_shape[2], in_shape[3])), &[dy, g])?) } else { None };
                let gdy = if want[1] { Some(apply(Op::Conv2d(*a), &[x, g])?) } else { None };
                Ok(vec![gx, gdy])
            }
            Op::MaxPool2d(a) => one(apply(Op::MaxPool2dBackward(*a), &[xs[0].as_ref().expect("saved"), g])),
            Op::MaxPool2dBackward(_) => Err(Error::arg("max_pool2d_backward", "max pooling's gradient is not differentiable again")),
        }
    }
}

fn too_large(op: &'static str) -> Error {
    Error::shape(op, "the result's size overflows")
}

/// `t` (`[len, B, H, D]`) with its head dim contiguous, as the attention kernels read it.
fn head_dim_contiguous(t: &Tensor) -> Result<Tensor> {
    if t.strides()[3] == 1 || t.shape()[3] <= 1 {
        Ok(t.clone())
    } else {
        t.copy_contiguous()
    }
}

/// A pooling kernel's result `s` of `shape` in the memory format of its input `x`: stored in
/// NHWC order already when `nhwc`, else contiguous and copied when `x` is channels-last.
fn pooled(s: BackendStorage, shape: &[usize], nhwc: bool, x: &Tensor) -> Result<Tensor> {
    let y = Tensor::from_backend(s, shape);
    if nhwc {
        Ok(y.view_as_layout(Layout::channels_last(shape)))
    } else {
        in_format_of(y, x)
    }
}

/// `y` (contiguous) as PyTorch's pooling returns it: in the memory format of its input `x`.
fn in_format_of(y: Tensor, x: &Tensor) -> Result<Tensor> {
    match x.suggest_memory_format() {
        MemoryFormat::Contiguous => Ok(y),
        format => dense_copy(&y, format),
    }
}

/// `f` computed over the NHWC views of the 4-D `xs` (where channels-last operands are as the
/// plain kernels want them), its `[N, H, W, C]` result handed back as NCHW over that memory:
/// channels-last.
pub(crate) fn over_nhwc(xs: &[&Tensor], f: impl FnOnce(&[&Tensor]) -> Result<Tensor>) -> Result<Tensor> {
    let views: Vec<Tensor> = xs.iter().map(|t| t.view_as_layout(t.layout().permuted(&TO_NHWC))).collect();
    let y = f(&views.iter().collect::<Vec<_>>())?;
    Ok(y.relaid(y.layout().permuted(&FROM_NHWC)))
}

/// A copy of `t` stored densely in `format`'s order, computed without recording anything (for
/// backends and ops that want their operands or results in one layout).
pub(crate) fn dense_copy(t: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    let copy = |xs: &[&Tensor]| Op::Cast(t.dtype()).compute(xs);
    match format {
        MemoryFormat::Contiguous => copy(&[t]),
        MemoryFormat::ChannelsLast => over_nhwc(&[t], copy),
    }
}

/// Runs a primitive op and records it for autograd.
#[track_caller]
pub(crate) fn apply(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    // Inside a function being compiled the op is recorded, not run.
    let out = if crate::compile::trace::active() { crate::compile::trace::record(op.clone(), inputs)? } else { op.forward(inputs)? };
    crate::autograd::record(op, inputs, out)
}

/// Deterministic F64 values in [-1, 1) of `shape` on the host, for the ops' unit tests.
#[cfg(test)]
pub(crate) fn host_values(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 500.0 - 1.0).collect();
    Tensor::from_vec(v, shape, &crate::Device::Cpu).expect("a host tensor")
}
