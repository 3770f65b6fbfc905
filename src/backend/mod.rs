//! Backends: where kernels run. `cpu` is always there; the CUDA backend plugs in beside it.

pub(crate) mod cexpr;
pub(crate) mod cpu;
pub mod cuda;

use crate::{Device, Error, Result};

/// Whether this build can run on CUDA device `n`.
pub(crate) fn cuda_available(n: usize) -> bool {
    cuda::available(n)
}

/// The error for work asked of a device this build cannot use.
pub(crate) fn check_device(op: &'static str, device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(n) => cuda::device(n).map(|_| ()).map_err(|e| match e {
            Error::DeviceUnavailable { device, msg, .. } => Error::DeviceUnavailable { op, device, msg },
            e => e,
        }),
    }
}

/// Writes `value` (of `dst`'s shape, dtype and device) into `dst`'s elements.
pub(crate) fn write_into(dst: &crate::Tensor, value: &crate::Tensor) -> Result<()> {
    if dst.device().is_cuda() {
        // A value that aliases `dst` is copied first: one kernel must not read what it writes.
        let value = if value.shares_storage_with(dst) { value.copy_contiguous()? } else { value.clone() };
        cuda::kernels::write_into(dst, &value)
    } else {
        if !cpu::copy_contiguous_into(dst, value) {
            cpu::write_into(dst, &cpu::cast(value, dst.dtype()));
        }
        Ok(())
    }
}

/// Writes each pair's value into its `dst` (of `dst`'s shape, dtype and device), as
/// `write_into` one by one: on CUDA, the small contiguous ones that share no storage with the
/// other pairs go together in one launch (`kernels::copies`) after the rest, one by one in order.
/// Each `dst`'s version is bumped.
pub(crate) fn write_many(pairs: &[(&crate::Tensor, &crate::Tensor)]) -> Result<()> {
    let alone = |i: usize| {
        let (d, v) = pairs[i];
        pairs.iter().enumerate().all(|(j, (e, w))| j == i || !(e.shares_storage_with(d) || w.shares_storage_with(d) || e.shares_storage_with(v)))
    };
    let small = |(d, v): (&crate::Tensor, &crate::Tensor)| {
        d.device().is_cuda() && d.device() == v.device() && d.dtype() == v.dtype() && d.shape() == v.shape() && d.is_contiguous() && v.is_contiguous() && !v.shares_storage_with(d) && d.numel() * d.dtype().size_in_bytes() <= cuda::kernels::copies::MOST_BYTES
    };
    let mut together: Vec<(Device, Vec<(&crate::Tensor, &crate::Tensor)>)> = vec![];
    for (i, &(d, v)) in pairs.iter().enumerate() {
        if small((d, v)) && alone(i) {
            match together.iter_mut().find(|(dev, _)| *dev == d.device()) {
                Some((_, group)) => group.push((d, v)),
                None => together.push((d.device(), vec![(d, v)])),
            }
        } else {
            crate::no_grad(|| d.copy_(v))?;
        }
    }
    for (_, group) in &together {
        cuda::kernels::copies::copy_many(group)?;
        group.iter().for_each(|(d, _)| d.storage().bump_version());
    }
    Ok(())
}

/// `torch.scatter` written into `dst` (contiguous) itself: only the elements `index` names
/// change (a compiled program's in-place scatter into a captured tensor).
pub(crate) fn scatter_into(dst: &crate::Tensor, dim: usize, index: &crate::Tensor, src: &crate::Tensor) -> Result<()> {
    // Operands that alias `dst` are copied first: one kernel must not read what it writes.
    let own = |t: &crate::Tensor| if t.shares_storage_with(dst) { t.copy_contiguous() } else { Ok(t.clone()) };
    let (index, src) = (own(index)?, own(src)?);
    if dst.device().is_cuda() {
        cuda::kernels::scatter_into(dst, dim, &index, &src)
    } else {
        cpu::index::scatter_into(dst, dim, &index, &src)
    }
}

/// A convolution pass by the device's library (cuDNN) where it takes it, else None (the
/// caller computes it as im2col and a product). `shapes`: input, weight, output.
/// The result is stored in `format`'s order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_library(pass: crate::ops::conv::ConvPass, args: &crate::ops::Conv2dArgs, shapes: [[usize; 4]; 3], a: &crate::Tensor, b: &crate::Tensor, out: &[usize], format: crate::MemoryFormat) -> Result<Option<crate::Tensor>> {
    if !a.device().is_cuda() || !cuda::libs::cudnn::usable(a.dtype()) {
        return Ok(None);
    }
    let s = cuda::libs::cudnn::conv(pass, args, shapes, a, b, format)?;
    let t = crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(s), out);
    Ok(Some(t.relaid(crate::layout::Layout::dense_in(out, format))))
}

/// Whether `conv2d_bias_act` of `x` by `w` is worth its own op here (else the convolution and a
/// pointwise pass the compiler fuses): on the GPU in F16 / BF16 over channels-last operands,
/// where cuDNN's fused engines run it (NHWC engines), for channel counts that are multiples of
/// 8 (16-byte pixels: for a 3-channel image, ResNet's stem, cuDNN's fused engine ran 1.56 ms on
/// the H100 against 0.9 for the convolution and the pass after it). While a function is traced
/// its values are laid out by the compiler's layout pass later, so the trace's inputs decide.
pub(crate) fn conv_epilogue_pays(x: &crate::Tensor, w: &crate::Tensor, args: crate::ops::Conv2dArgs) -> bool {
    let aligned = x.shape()[1].is_multiple_of(8) && w.shape()[0].is_multiple_of(8);
    let nhwc = if crate::compile::trace::active() {
        crate::compile::layout::traced_conv_net_runs_channels_last()
    } else {
        [x, w].iter().any(|t| t.suggest_memory_format() == crate::MemoryFormat::ChannelsLast)
    };
    (planned_for_cuda(x) || (x.device().is_cuda() && cuda::libs::cudnn::usable(x.dtype()))) && matches!(x.dtype(), crate::DType::F16 | crate::DType::BF16) && args.groups == 1 && aligned && nhwc
}

/// `Op::Conv2dBiasAct` as one cuDNN kernel, dense in `format`'s order, where the device has
/// one for it (CUDA, F16 / BF16, cuDNN's fused engines); None elsewhere (the caller composes it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_epilogue_library(args: &crate::ops::Conv2dArgs, shapes: [[usize; 4]; 3], x: &crate::Tensor, w: &crate::Tensor, bias: &crate::Tensor, z: Option<&crate::Tensor>, relu: bool, out: &[usize], format: crate::MemoryFormat) -> Result<Option<crate::Tensor>> {
    if !x.device().is_cuda() || !cuda::libs::cudnn::usable(x.dtype()) {
        return Ok(None);
    }
    let Some(s) = cuda::libs::conv_epilogue::forward(args, shapes, x, w, bias, z, relu, format)? else { return Ok(None) };
    let t = crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(s), out);
    Ok(Some(t.relaid(crate::layout::Layout::dense_in(out, format))))
}

/// `x * scale + shift` (all of x's shape) computed in F32 and stored in x's dtype, in one pass
/// where the device has the kernel for it (CUDA); None elsewhere (the caller composes it).
pub(crate) fn scale_shift(x: &crate::Tensor, scale: &crate::Tensor, shift: &crate::Tensor) -> Result<Option<crate::Tensor>> {
    if !x.device().is_cuda() {
        return Ok(None);
    }
    let run = |v: &[&crate::Tensor]| Ok(crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(cuda::kernels::scale_shift(v[0], v[1], v[2])?), v[0].shape()));
    if x.suggest_memory_format() == crate::MemoryFormat::ChannelsLast {
        // Over the NHWC views, so the result keeps x's format and x is read in order.
        return crate::ops::over_nhwc(&[x, scale, shift], run).map(Some);
    }
    run(&[x, scale, shift]).map(Some)
}

/// Whether the device's fused attention kernels take q, k, v (`[L, B, H, D]`) and beat a
/// matmul and softmax there (never on the CPU).
pub(crate) fn fused_attention_pays(q: &crate::Tensor, k: &crate::Tensor, v: &crate::Tensor) -> bool {
    let (l, b, h, d, s) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3], k.shape()[0]);
    (q.device().is_cuda() || planned_for_cuda(q)) && cuda::kernels::attention::takes(l, s, b * h, d)
        && matches!(q.dtype(), crate::DType::F32 | crate::DType::F16 | crate::DType::BF16)
        && cuda::kernels::attention::fused_is_faster(q, k, v)
}

/// Whether the fused attention of q, k, v (`[L, B, H, D]`) stores its output batch-first for
/// free: where cuDNN's forward takes it (cuDNN writes any strides; kiln's kernels store
/// seq-first, and the other order would cost them a copy).
pub(crate) fn attention_stores_batch_first(q: &crate::Tensor, k: &crate::Tensor, v: &crate::Tensor, mask: Option<&crate::Tensor>, causal: bool) -> bool {
    let n = crate::ops::AttnDims::of(q.shape(), k.shape());
    if planned_for_cuda(q) {
        return cuda::libs::sdpa::takes_sizes(q.dtype(), mask.is_some(), causal, &n, false);
    }
    if !q.device().is_cuda() {
        return false;
    }
    // A traced tensor has no address yet: its sizes decide (the op lays its result out again
    // where cuDNN then refuses it).
    if [q, k, v].into_iter().chain(mask).any(|t| t.storage().traced_ref().is_some()) {
        return cuda::libs::sdpa::takes_sizes(q.dtype(), mask.is_some(), causal, &n, false) && cuda::libs::sdpa::loaded();
    }
    cuda::libs::sdpa::takes(q, k, v, mask, causal, &n, false).unwrap_or(false)
}

/// Whether `Op::AttentionUpTo` over q `[L, B, H, D]` and k `[S, B, H_kv, D]` runs as its own GPU
/// kernel (else the functional computes it as the masked attention, whose mask it then traces).
pub(crate) fn attention_up_to_kernel_takes(q: &crate::Tensor, k: &crate::Tensor) -> bool {
    let (l, b, h, d, s) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3], k.shape()[0]);
    (q.device().is_cuda() || planned_for_cuda(q)) && cuda::kernels::attention::up_to_takes(l, s, b * h, d, q.dtype())
}

/// Whether `t` is traced in a CPU trace planned for the GPU (`KILN_PLAN_FOR=cuda`): ops choose
/// as on the GPU, though the CPU program then runs their reference kernels.
fn planned_for_cuda(t: &crate::Tensor) -> bool {
    crate::switches::plan_for_cuda() && t.storage().traced_ref().is_some()
}

/// What a multi-tensor optimiser update computes (the slots and scalars each rule reads).
pub(crate) use cuda::kernels::foreach::Rule as UpdateRule;

/// Whether `device` updates parameters of `dtype` in one multi-tensor update.
pub(crate) fn multi_tensor_update_supports(device: Device, dtype: crate::DType) -> bool {
    match device {
        Device::Cuda(_) => cuda::kernels::foreach::supports(dtype),
        Device::Cpu => cpu::foreach::supports(dtype),
    }
}

/// Applies `rule` to every entry (its slots, of `dtype`, on one device `multi_tensor_update_supports`
/// accepts) in as few launches as a launch's table holds.
pub(crate) fn multi_tensor_update(rule: UpdateRule, dtype: crate::DType, entries: &[Vec<&crate::Tensor>], scalars: &[f64], first: bool) -> Result<()> {
    match entries.first().map(|e| e[0].device()) {
        Some(Device::Cpu) => cpu::foreach::update(rule, dtype, entries, scalars, first),
        _ => cuda::kernels::foreach::launch(rule, dtype, entries, scalars, first),
    }
}

/// A contiguous tensor of `shape` and `dtype` on `like`'s device whose values are not set
/// (zeros on the host, where the page cache hands out cleared memory anyway).
pub(crate) fn uninit_like(like: &crate::Tensor, shape: &[usize], dtype: crate::DType) -> Result<crate::Tensor> {
    match like.device() {
        Device::Cuda(_) => cuda::kernels::custom::empty(like, shape, dtype),
        Device::Cpu => crate::Tensor::zeros(shape, dtype, &Device::Cpu),
    }
}

/// A random distribution of `Tensor::rand`/`randn`/`randint`.
pub(crate) use cuda::kernels::Dist;

/// `shape` of `dtype` filled with `value` on GPU `device`.
pub(crate) fn cuda_full(device: usize, shape: &[usize], value: f64, dtype: crate::DType) -> Result<crate::Tensor> {
    let s = cuda::kernels::full(device, shape, value, dtype)?;
    Ok(crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(s), shape))
}

/// `shape` of `dtype` drawn by `dist` from the global generator on GPU `device`: the same
/// numbers, element for element, as the host draws.
pub(crate) fn cuda_random(device: usize, shape: &[usize], dtype: crate::DType, dist: Dist) -> Result<crate::Tensor> {
    let s = cuda::kernels::random(device, shape, dtype, dist)?;
    Ok(crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(s), shape))
}

/// A host tensor's values copied onto GPU `device` (contiguous); `non_blocking` queues the copy
/// without waiting for it (through a pinned staging buffer unless the source is pinned).
pub(crate) fn upload(host: &crate::Tensor, device: usize, non_blocking: bool) -> Result<crate::Tensor> {
    let s = if non_blocking { cuda::kernels::upload_async(device, host)? } else { cuda::kernels::upload(device, host)? };
    Ok(crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(s), host.shape()))
}

/// A GPU tensor's values copied to the host (waits for them; a synchronisation is reported at
/// the caller's line).
#[track_caller]
pub(crate) fn download(x: &crate::Tensor) -> Result<crate::Tensor> {
    Ok(crate::Tensor::from_cpu(cuda::kernels::download(x)?, x.shape()))
}
