//! Backends: where kernels run. `cpu` is always there; the CUDA backend plugs in beside it.

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

/// A convolution pass by the device's library (cuDNN) where it takes it, else None (the
/// caller computes it as im2col and a product). `shapes`: input, weight, output.
pub(crate) fn conv_library(pass: crate::ops::conv::ConvPass, args: &crate::ops::Conv2dArgs, shapes: [[usize; 4]; 3], a: &crate::Tensor, b: &crate::Tensor, out: &[usize]) -> Result<Option<crate::Tensor>> {
    if !a.device().is_cuda() || !cuda::libs::cudnn::usable(a.dtype()) {
        return Ok(None);
    }
    let s = cuda::libs::cudnn::conv(pass, args, shapes, a, b)?;
    Ok(Some(crate::Tensor::from_backend(crate::storage::BackendStorage::Cuda(s), out)))
}
