//! The host caching allocator: large buffers that tensors free are kept by size and handed to
//! the next buffer of that size, so a training loop's fresh outputs reuse memory already mapped
//! instead of faulting new pages in (the CUDA caching allocator's idea, on the host). Buffers
//! under `MIN_BYTES` are left to malloc, which reuses those itself; at most `MAX_CACHED` bytes
//! are kept.

use half::{bf16, f16};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Smallest buffer kept: below it malloc serves from its own free lists without page faults.
const MIN_BYTES: usize = 128 << 10;
/// Most bytes kept for reuse at once.
const MAX_CACHED: usize = 1 << 30;

static CACHED: AtomicUsize = AtomicUsize::new(0);
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

/// What the host caching allocator holds and how often it served a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemoryStats {
    /// Bytes of freed buffers kept for reuse.
    pub cached_bytes: usize,
    /// Large buffers served from the cache.
    pub hits: u64,
    /// Large buffers freshly allocated (no cached buffer of their size).
    pub misses: u64,
}

/// The host caching allocator's statistics, over every thread of the process.
pub fn memory_stats() -> HostMemoryStats {
    HostMemoryStats { cached_bytes: CACHED.load(Ordering::Relaxed), hits: HITS.load(Ordering::Relaxed), misses: MISSES.load(Ordering::Relaxed) }
}

/// Returns every cached buffer to the system.
pub fn empty_cache() {
    macro_rules! each {
        ($($t:ty),*) => {$( <$t as Pooled>::pool().lock().clear(); )*};
    }
    each!(f32, f64, f16, bf16, i64, i32, u8, bool);
    CACHED.store(0, Ordering::Relaxed);
}

/// Element types with a pool of their own (buffers keep their type: no reinterpretation).
pub(crate) trait Pooled: Copy + Send + 'static {
    fn pool() -> &'static Mutex<HashMap<usize, Vec<Vec<Self>>>>;
}
macro_rules! pooled {
    ($($t:ty),*) => {$(
        impl Pooled for $t {
            fn pool() -> &'static Mutex<HashMap<usize, Vec<Vec<Self>>>> {
                static P: std::sync::OnceLock<Mutex<HashMap<usize, Vec<Vec<$t>>>>> = std::sync::OnceLock::new();
                P.get_or_init(Default::default)
            }
        }
    )*};
}
pooled!(f32, f64, f16, bf16, i64, i32, u8, bool);

/// An empty Vec with room for `n` elements: a cached buffer of that capacity where there is one.
pub(crate) fn take<T: Pooled>(n: usize) -> Vec<T> {
    if n * std::mem::size_of::<T>() >= MIN_BYTES {
        if let Some(v) = T::pool().lock().get_mut(&n).and_then(|l| l.pop()) {
            CACHED.fetch_sub(n * std::mem::size_of::<T>(), Ordering::Relaxed);
            HITS.fetch_add(1, Ordering::Relaxed);
            return v;
        }
        MISSES.fetch_add(1, Ordering::Relaxed);
    }
    Vec::with_capacity(n)
}

/// `take` for any element type: a pooled one's cache, else a fresh Vec.
pub(crate) fn take_any<T: 'static>(n: usize) -> Vec<T> {
    use std::any::{Any, TypeId};
    if n * std::mem::size_of::<T>() < MIN_BYTES {
        return Vec::with_capacity(n);
    }
    macro_rules! typed {
        ($($t:ty),*) => {$(
            if TypeId::of::<T>() == TypeId::of::<$t>() {
                let v: Box<dyn Any> = Box::new(take::<$t>(n));
                if let Ok(v) = v.downcast::<Vec<T>>() {
                    return *v;
                }
            }
        )*};
    }
    typed!(f32, f64, f16, bf16, i64, i32, u8, bool);
    Vec::with_capacity(n)
}

/// Keeps `v`'s memory for a later `take` of its capacity, or frees it.
pub(crate) fn give<T: Pooled>(mut v: Vec<T>) {
    let bytes = v.capacity() * std::mem::size_of::<T>();
    if bytes < MIN_BYTES || CACHED.load(Ordering::Relaxed) + bytes > MAX_CACHED {
        return;
    }
    v.clear();
    CACHED.fetch_add(bytes, Ordering::Relaxed);
    T::pool().lock().entry(v.capacity()).or_default().push(v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_buffer_serves_the_next_of_its_size_and_small_ones_are_left_to_malloc() {
        let n = 1 << 20; // 4 MiB of f32: no other test uses this size
        let v: Vec<f32> = take(n);
        let p = v.as_ptr();
        give(v);
        let again: Vec<f32> = take(n);
        assert_eq!(again.as_ptr(), p, "the same memory");
        assert!(again.is_empty() && again.capacity() >= n);
        give(vec![0u8; 16]); // below MIN_BYTES: freed
        assert!(u8::pool().lock().get(&16).is_none());
    }
}
