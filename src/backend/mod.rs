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
