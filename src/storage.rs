//! Reference-counted tensor storage, shared by a tensor and all its views, with the version
//! counter that in-place ops bump and autograd checks.

use crate::backend::cpu::CpuStorage;
use crate::Device;
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The bytes of a storage on one backend. The CUDA backend adds its own variant.
pub(crate) enum BackendStorage {
    Cpu(CpuStorage),
    Cuda(crate::backend::cuda::CudaStorage),
}

pub(crate) struct Storage {
    pub(crate) data: RwLock<BackendStorage>,
    version: AtomicU64,
    pub(crate) device: Device,
}

impl Storage {
    pub(crate) fn cpu(s: CpuStorage) -> Self {
        Storage { data: RwLock::new(BackendStorage::Cpu(s)), version: AtomicU64::new(0), device: Device::Cpu }
    }
    pub(crate) fn cuda(s: crate::backend::cuda::CudaStorage) -> Self {
        let device = Device::Cuda(s.dev.ordinal);
        Storage { data: RwLock::new(BackendStorage::Cuda(s)), version: AtomicU64::new(0), device }
    }
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
    pub(crate) fn bump_version(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}
