//! The CUDA backend, by role: `device` (contexts, streams, the allocator, NVRTC, launches, CUDA
//! graphs), `kernels` (the generated kernels: eager maps and reductions, the compiler's fused
//! kernels, multi-tensor optimiser updates, attention, custom ops), `libs` (cuBLASLt, cuDNN
//! convolutions and attention) and `tuning` (max-autotune's timed choices and the rehearsal that
//! builds a first run's kernels ahead). cudarc loads the CUDA libraries dynamically, so builds
//! and CPU runs need no CUDA. The public API is `kiln::cuda`.

pub(crate) mod device;
pub(crate) mod kernels;
pub(crate) mod libs;
pub(crate) mod tuning;

pub(crate) use device::*;
