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
    /// No data: a value inside a function being traced by the compiler, bound to a graph node.
    /// A graph break swaps real data in.
    Traced(crate::compile::trace::TraceRef),
}

pub(crate) struct Storage {
    pub(crate) data: RwLock<BackendStorage>,
    version: AtomicU64,
    pub(crate) device: Device,
    /// Host memory page-locked for asynchronous copies (`pin_memory`): its address.
    pinned: Option<usize>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Some(p) = self.pinned {
            crate::backend::cuda::unpin(p as *const u8);
        }
        // Host buffers go back to the caching allocator (an empty Vec allocates nothing).
        if let BackendStorage::Cpu(s) = std::mem::replace(self.data.get_mut(), BackendStorage::Cpu(CpuStorage::U8(Default::default()))) {
            s.recycle();
        }
    }
}

impl Storage {
    pub(crate) fn cpu(s: CpuStorage) -> Self {
        Storage { data: RwLock::new(BackendStorage::Cpu(s)), version: AtomicU64::new(0), device: Device::Cpu, pinned: None }
    }
    pub(crate) fn cuda(s: crate::backend::cuda::CudaStorage) -> Self {
        let device = Device::Cuda(s.dev.ordinal);
        Storage { data: RwLock::new(BackendStorage::Cuda(s)), version: AtomicU64::new(0), device, pinned: None }
    }
    pub(crate) fn traced(device: Device, r: crate::compile::trace::TraceRef) -> Self {
        Storage { data: RwLock::new(BackendStorage::Traced(r)), version: AtomicU64::new(0), device, pinned: None }
    }
    /// The graph node this storage stands for while a function is traced.
    pub(crate) fn traced_ref(&self) -> Option<crate::compile::trace::TraceRef> {
        match &*self.data.read_recursive() {
            BackendStorage::Traced(r) => Some(*r),
            _ => None,
        }
    }
    /// Host storage page-locked in place (its Vec never reallocates).
    pub(crate) fn cpu_pinned(s: CpuStorage) -> crate::Result<Self> {
        let (ptr, bytes) = crate::backend::cpu::with_storage!(&s, v => (v.as_ptr().cast::<u8>(), std::mem::size_of_val(&v[..])));
        if bytes > 0 {
            crate::backend::cuda::pin(ptr, bytes)?;
        }
        let mut st = Storage::cpu(s);
        st.pinned = (bytes > 0).then_some(ptr as usize);
        Ok(st)
    }
    pub(crate) fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
    pub(crate) fn bump_version(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}
