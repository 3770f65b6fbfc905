//! Where a tensor lives.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    /// `Cuda(n)` when a CUDA device `n` can be used by this build, else `Cpu`.
    pub fn cuda_if_available(n: usize) -> Device {
        if crate::backend::cuda_available(n) {
            Device::Cuda(n)
        } else {
            Device::Cpu
        }
    }
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
