//! The host as a device: the caching allocator that keeps large freed buffers for the next
//! tensor of their size (its statistics, and a way to hand its memory back), and the engine
//! that runs compiled kernels (native code from C, or the interpreter).

pub use crate::backend::cpu::pool::{empty_cache, memory_stats, reset_peak_memory_stats, HostMemoryStats};
pub use crate::backend::cpu::jit::{cpu_codegen_counts, cpu_codegen_error, set_cpu_codegen, CpuCodegen, CpuCodegenCounts};
