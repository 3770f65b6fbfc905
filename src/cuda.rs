//! CUDA devices as a program sees them: how many there are, synchronisation, memory statistics
//! and the caching allocator, events for timing, the kernel cache, TF32 and cuDNN switches, and
//! the counters the profiler and tests read. The backend itself is `backend::cuda`.

pub use crate::backend::cuda::device::alloc::MemoryStats;
pub use crate::backend::cuda::device::nvrtc::{kernel_cache_counts, KernelSource};
pub use crate::backend::cuda::device::{
    allow_tf32, cudnn_deterministic, cudnn_version, device_count, device_name, empty_cache, kernel_cache_dir, kernels_loaded, launch_count, memory_stats, reset_peak_memory_stats, set_allow_tf32, set_cudnn_deterministic,
    synchronize, Event,
};
pub use crate::backend::cuda::libs::sdpa::with_cudnn_attention;
pub use crate::backend::cuda::tuning::autotune::{autotune_counts, AutotuneCounts};
pub use crate::backend::cuda::tuning::rehearsal::kernels_built_ahead;
