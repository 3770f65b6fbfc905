//! The host caching allocator: large buffers that tensors free are kept by element type and
//! size and handed to the next buffer of that type and size, so a training loop's fresh outputs
//! reuse memory already mapped instead of faulting new pages in (the CUDA caching allocator's
//! idea, on the host). Buffers under `MIN_BYTES` are left to malloc, which reuses those itself.
//! At most `MAX_CACHED` bytes are kept: a buffer that would pass it frees the least recently
//! used sizes first, so a program whose shapes change keeps caching the shapes it uses now.

use super::HostBuf;
use parking_lot::Mutex;
use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Smallest buffer kept: below it malloc serves from its own free lists without page faults.
const MIN_BYTES: usize = 128 << 10;
/// Most bytes kept for reuse at once.
const MAX_CACHED: usize = 1 << 30;

static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);
/// `Pool::cached`, readable without the lock.
static CACHED: AtomicUsize = AtomicUsize::new(0);

/// Bytes the cache holds now.
pub(crate) fn cached_bytes() -> usize {
    CACHED.load(Ordering::Relaxed)
}

/// What the host caching allocator holds and how often it served a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemoryStats {
    /// Bytes of freed buffers kept for reuse.
    pub cached_bytes: usize,
    /// Large buffers served from the cache.
    pub hits: u64,
    /// Large buffers freshly allocated (no cached buffer of their size).
    pub misses: u64,
    /// Bytes of host tensor storage in use now (kiln's buffers and the `Vec`s it adopted; not
    /// the cached ones), as CUDA's `MemoryStats::allocated`.
    pub allocated: usize,
    /// The most of `allocated` at once since the start or `reset_peak_memory_stats`.
    pub peak_allocated: usize,
}

/// The host caching allocator's statistics, over every thread of the process.
pub fn memory_stats() -> HostMemoryStats {
    let cached = POOL.lock().cached;
    let allocated = super::buf::LIVE_BYTES.load(Ordering::Relaxed).saturating_sub(cached);
    HostMemoryStats { cached_bytes: cached, hits: HITS.load(Ordering::Relaxed), misses: MISSES.load(Ordering::Relaxed), allocated, peak_allocated: super::buf::PEAK_IN_USE.load(Ordering::Relaxed).max(allocated) }
}

/// Starts `peak_allocated` again from what is in use now.
pub fn reset_peak_memory_stats() {
    super::buf::PEAK_IN_USE.store(memory_stats().allocated, Ordering::Relaxed);
}

/// Returns every cached buffer to the system.
pub fn empty_cache() {
    let mut pool = POOL.lock();
    pool.classes.clear();
    pool.cached = 0;
    CACHED.store(0, Ordering::Relaxed);
}

/// Element types the cache can hold (buffers keep their type: no reinterpretation).
pub(crate) trait Pooled: Send + 'static {}
impl<T: Send + 'static> Pooled for T {}

/// The freed buffers of one element type and capacity, and when that size was last used.
struct Class {
    bytes: usize,
    free: Vec<Box<dyn Any + Send>>,
    last_used: u64,
}

struct Pool {
    classes: BTreeMap<(TypeId, usize), Class>,
    /// Bytes held in `classes`, at most `limit`.
    cached: usize,
    limit: usize,
    /// Counts takes and gives: a class's `last_used` is this clock's value at its last use.
    clock: u64,
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new(MAX_CACHED));

impl Pool {
    const fn new(limit: usize) -> Pool {
        Pool { classes: BTreeMap::new(), cached: 0, limit, clock: 0 }
    }

    /// A cached buffer of `n` elements of `T`, if one is held.
    fn take<T: Pooled>(&mut self, n: usize) -> Option<HostBuf<T>> {
        self.clock += 1;
        let class = self.classes.get_mut(&(TypeId::of::<T>(), n))?;
        class.last_used = self.clock;
        let v = class.free.pop()?;
        self.cached -= class.bytes;
        CACHED.store(self.cached, Ordering::Relaxed);
        super::buf::note_in_use(self.cached);
        v.downcast::<HostBuf<T>>().ok().map(|v| *v)
    }

    /// Keeps `v` (cleared), first freeing the least recently used other sizes' buffers while
    /// it would not fit; a buffer larger than the whole limit is freed instead.
    fn give<T: Pooled>(&mut self, mut v: HostBuf<T>) {
        let bytes = v.capacity() * std::mem::size_of::<T>();
        let key = (TypeId::of::<T>(), v.capacity());
        while self.cached + bytes > self.limit {
            let oldest = self.classes.iter().filter(|(k, c)| **k != key && !c.free.is_empty()).min_by_key(|(_, c)| c.last_used).map(|(k, _)| *k);
            let Some(oldest) = oldest else { return };
            let class = self.classes.get_mut(&oldest).expect("the class just found");
            class.free.pop();
            self.cached -= class.bytes;
            CACHED.store(self.cached, Ordering::Relaxed);
            if class.free.is_empty() {
                self.classes.remove(&oldest);
            }
        }
        v.clear();
        self.clock += 1;
        self.cached += bytes;
        CACHED.store(self.cached, Ordering::Relaxed);
        let class = self.classes.entry(key).or_insert_with(|| Class { bytes, free: Vec::new(), last_used: 0 });
        class.last_used = self.clock;
        class.free.push(Box::new(v));
    }
}

/// An empty buffer with room for `n` elements: a cached buffer of that capacity where there is one.
pub(crate) fn take<T: Pooled>(n: usize) -> HostBuf<T> {
    if n * std::mem::size_of::<T>() >= MIN_BYTES {
        if let Some(v) = POOL.lock().take(n) {
            HITS.fetch_add(1, Ordering::Relaxed);
            return v;
        }
        MISSES.fetch_add(1, Ordering::Relaxed);
    }
    HostBuf::with_capacity(n)
}

/// `n` default values (zeros for every element type) in a buffer from `take`.
pub(crate) fn zeros<T: Pooled + Default + Clone>(n: usize) -> HostBuf<T> {
    let mut v = take(n);
    v.resize(n, T::default());
    v
}

/// Keeps `v`'s memory for a later `take` of its capacity, or frees it if it is small or an
/// adopted `Vec` (whose alignment `take` could not promise).
pub(crate) fn give<T: Pooled>(v: HostBuf<T>) {
    if v.capacity() * std::mem::size_of::<T>() >= MIN_BYTES && v.is_aligned_by_kiln() {
        POOL.lock().give(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_buffer_serves_the_next_of_its_size_and_small_ones_are_left_to_malloc() {
        let n = 1 << 20; // 4 MiB of f32: no other test uses this size
        let v: HostBuf<f32> = take(n);
        let p = v.as_ptr();
        give(v);
        let again: HostBuf<f32> = take(n);
        assert_eq!(again.as_ptr(), p, "the same memory");
        assert!(again.is_empty() && again.capacity() >= n);
        assert_eq!(again.as_ptr() as usize % super::super::buf::ALIGN, 0, "aligned");
        give(HostBuf::from(vec![0u8; 16])); // below MIN_BYTES: freed
        assert!(!POOL.lock().classes.contains_key(&(TypeId::of::<u8>(), 16)));
        // An adopted Vec is freed, not kept: `take` promises aligned buffers.
        let adopted = 3 << 17; // no other test uses this size either
        give(HostBuf::from(vec![0f32; adopted]));
        assert!(!POOL.lock().classes.contains_key(&(TypeId::of::<f32>(), adopted)));
    }

    #[test]
    fn a_full_cache_frees_its_least_recently_used_sizes_to_keep_the_new_one() {
        let mut pool = Pool::new(4 << 10);
        for n in [1000, 1001, 1002, 1003] {
            pool.give(HostBuf::<f32>::with_capacity(n)); // four sizes of about 4 KiB: only one fits
        }
        pool.give(HostBuf::<f32>::with_capacity(999));
        assert!(pool.take::<f32>(1003).is_none(), "the older size was freed to make room");
        assert!(pool.take::<f32>(999).is_some(), "the newest size was kept");
        assert_eq!(pool.cached, 0);
        pool.give(HostBuf::<u8>::with_capacity(8 << 10));
        assert!(pool.take::<u8>(8 << 10).is_none(), "a buffer past the whole limit is not kept");
    }
}
