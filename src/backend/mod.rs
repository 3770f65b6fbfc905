//! Backends: where kernels run. `cpu` is always there; the CUDA backend plugs in beside it.

pub(crate) mod cpu;

use crate::{Device, Error, Result};

/// Whether this build can run on CUDA device `n`.
pub(crate) fn cuda_available(_n: usize) -> bool {
    false
}

/// The error for work asked of a device this build cannot use.
pub(crate) fn check_device(op: &'static str, device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => Err(Error::DeviceUnavailable {
            op,
            device,
            msg: "this build of kiln has no CUDA backend yet; use Device::Cpu or Device::cuda_if_available".into(),
        }),
    }
}
