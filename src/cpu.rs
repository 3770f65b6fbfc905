//! The host as a device: the caching allocator that keeps large freed buffers for the next
//! tensor of their size (its statistics, and a way to hand its memory back).

pub use crate::backend::cpu::pool::{empty_cache, memory_stats, HostMemoryStats};
