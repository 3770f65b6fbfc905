//! A caching device-memory allocator in the manner of PyTorch's CUDACachingAllocator.
//!
//! Device allocation calls (cuMemAlloc/cuMemFree) are slow and synchronize the device, so freed
//! blocks are kept in a cache and handed out again. Small requests (up to 1 MiB) are reused by
//! exact size class. Large ones are cut from segments (device allocations rounded to 2 MiB): a
//! request takes the smallest free piece that fits, split to its size, and a freed piece merges
//! with its free neighbours in the segment. So a block counts (in `allocated`) the bytes asked
//! for, rounded to 512, as PyTorch's do, instead of a whole cached block up to twice the
//! request. The allocator knows nothing of CUDA: the device calls come in through
//! [`RawAlloc`], so all of its bookkeeping is unit-testable on a CPU machine.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

/// Requests up to this size are "small": rounded to [`ROUND`] and reused by exact class.
const SMALL_LIMIT: usize = 1 << 20;
/// Granularity of every block; keeps every block 512-byte aligned relative to the device.
const ROUND: usize = 512;
/// Granularity of the device allocations large blocks are cut from.
const SEGMENT_ROUND: usize = 2 << 20;

/// The device's own allocation calls (cuMemAlloc/cuMemFree in the CUDA backend; a mock in tests).
pub(crate) trait RawAlloc: Send {
    /// Allocates `bytes` of device memory; Err(()) when the device is out of memory.
    fn malloc(&mut self, bytes: usize) -> Result<u64, ()>;
    fn free(&mut self, ptr: u64);
}

/// A block handed out: device pointer and its (rounded) size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    pub ptr: u64,
    pub size: usize,
}

/// Figures as torch.cuda.memory_stats reports them (bytes; counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out now (rounded sizes).
    pub allocated: usize,
    /// Max of `allocated` since creation or `reset_peak_stats`.
    pub peak_allocated: usize,
    /// Bytes obtained from the device (handed out + cached).
    pub reserved: usize,
    /// Max of `reserved` since creation or `reset_peak_stats`.
    pub peak_reserved: usize,
    /// Number of non-empty `alloc()` calls served (0-byte requests are not counted, as in PyTorch).
    pub alloc_count: u64,
    /// Number of `RawAlloc::malloc` calls that succeeded.
    pub device_alloc_count: u64,
    /// `alloc()` calls served from the cache.
    pub cache_hits: u64,
}

/// Out of memory, with the allocator's figures at the time (requested bytes, stats).
///
/// `stats` are taken when the device first refused, before the cache was emptied for the retry,
/// so `reserved - allocated` is what was cached and freed before retrying.
#[derive(Debug, Clone)]
pub(crate) struct OutOfMemory {
    pub requested: usize,
    pub stats: MemoryStats,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        write!(
            f,
            "out of device memory: tried to allocate {}; {} allocated (peak {}), {} reserved (peak {}), \
             {} cached and freed before retrying",
            fmt_bytes(self.requested),
            fmt_bytes(s.allocated),
            fmt_bytes(s.peak_allocated),
            fmt_bytes(s.reserved),
            fmt_bytes(s.peak_reserved),
            fmt_bytes(s.reserved.saturating_sub(s.allocated)),
        )
    }
}

impl std::error::Error for OutOfMemory {}

/// Human-readable size, as PyTorch prints it in its OOM message.
fn fmt_bytes(bytes: usize) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes < 1 << 10 {
        format!("{bytes} bytes")
    } else if bytes < 1 << 20 {
        format!("{:.2} KiB", b / KIB)
    } else if bytes < 1 << 30 {
        format!("{:.2} MiB", b / (KIB * KIB))
    } else {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    }
}

/// The block size of a request of `bytes` (> 0); None when rounding would overflow.
pub(crate) fn round_size(bytes: usize) -> Option<usize> {
    bytes.checked_next_multiple_of(ROUND)
}

/// A piece of a large segment: its size, whether it is free, and the segment it belongs to
/// (its base pointer), so that neighbours merge only within one device allocation.
#[derive(Clone, Copy, Debug)]
struct Piece {
    size: usize,
    free: bool,
    segment: u64,
}

/// Pieces cut from segments: the segments (device allocations here; a captured CUDA graph's
/// blocks in its capture pool), every piece of them by address, and the free pieces by (size,
/// address) for best-fit lookups.
#[derive(Default)]
pub(crate) struct LargePool {
    /// Segment base -> its size.
    segments: HashMap<u64, usize>,
    pieces: BTreeMap<u64, Piece>,
    free: BTreeSet<(usize, u64)>,
}

impl LargePool {
    /// The smallest free piece of at least `size` bytes, taken (split to `size`).
    pub(crate) fn take(&mut self, size: usize) -> Option<Block> {
        let (found, ptr) = self.fitting(size).next()?;
        Some(self.take_free(found, ptr, size, false))
    }

    /// The free pieces of at least `size` bytes, (size, address), smallest first.
    pub(crate) fn fitting(&self, size: usize) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.free.range((size, 0)..).copied()
    }

    /// Takes the free piece at `ptr` of `found` bytes (one `fitting` gave), split to `size`:
    /// its first bytes, or with `tail` its last, the rest staying free.
    pub(crate) fn take_free(&mut self, found: usize, ptr: u64, size: usize, tail: bool) -> Block {
        assert!(self.free.remove(&(found, ptr)), "a free piece of the pool");
        self.hand_out(ptr, found, size, tail)
    }

    /// Marks `size` bytes of the free piece at `ptr` (of `found` bytes) handed out, its first
    /// bytes or with `tail` its last; the rest, if any, becomes a free piece of its own. (A rest
    /// of 1 MiB or less fits no large request alone, but merges back when a neighbour is freed.)
    fn hand_out(&mut self, ptr: u64, found: usize, size: usize, tail: bool) -> Block {
        let piece = self.pieces.get_mut(&ptr).expect("a free piece is a piece");
        let (segment, rest) = (piece.segment, found - size);
        if rest == 0 {
            piece.free = false;
            return Block { ptr, size };
        }
        let (used, spare) = if tail { (ptr + rest as u64, ptr) } else { (ptr, ptr + size as u64) };
        self.pieces.insert(used, Piece { size, free: false, segment });
        self.pieces.insert(spare, Piece { size: rest, free: true, segment });
        self.free.insert((rest, spare));
        Block { ptr: used, size }
    }

    /// A new segment of `seg_size` bytes at `base`, its first `size` bytes handed out.
    pub(crate) fn add_segment(&mut self, base: u64, seg_size: usize, size: usize) -> Block {
        self.segments.insert(base, seg_size);
        self.pieces.insert(base, Piece { size: seg_size, free: true, segment: base });
        self.hand_out(base, seg_size, size, false)
    }

    /// Whether `ptr` starts a piece handed out from this pool.
    pub(crate) fn hands_out(&self, ptr: u64) -> bool {
        self.pieces.get(&ptr).is_some_and(|p| !p.free)
    }

    /// Frees the handed-out piece `b`, merged with the free pieces on either side of it.
    pub(crate) fn give_back(&mut self, b: Block) {
        let Piece { segment, .. } = self.pieces[&b.ptr];
        let (mut ptr, mut size) = (b.ptr, b.size);
        let next = ptr + size as u64;
        if let Some(&n) = self.pieces.get(&next).filter(|n| n.free && n.segment == segment) {
            self.free.remove(&(n.size, next));
            self.pieces.remove(&next);
            size += n.size;
        }
        if let Some((&p, &prev)) = self.pieces.range(..ptr).next_back().filter(|(_, p)| p.free && p.segment == segment) {
            self.free.remove(&(prev.size, p));
            self.pieces.remove(&ptr);
            ptr = p;
            size += prev.size;
        }
        self.pieces.insert(ptr, Piece { size, free: true, segment });
        self.free.insert((size, ptr));
    }

    /// Takes out every segment that is one free piece, for the device to free: (base, size).
    fn drain_unused(&mut self) -> Vec<(u64, usize)> {
        let unused: Vec<(u64, usize)> = self.segments.iter().filter(|(base, size)| self.pieces.get(base).is_some_and(|p| p.free && p.size == **size)).map(|(&b, &s)| (b, s)).collect();
        for &(base, size) in &unused {
            self.segments.remove(&base);
            self.pieces.remove(&base);
            self.free.remove(&(size, base));
        }
        unused
    }
}

/// Caches freed device blocks so that steady-state training loops make no device allocation
/// calls: small blocks by exact class (O(1)), large ones cut from segments (O(log n)).
pub(crate) struct CachingAllocator<R: RawAlloc> {
    raw: R,
    /// Cached small blocks by exact class (LIFO: the most recently freed block is the warmest).
    small: HashMap<usize, Vec<u64>>,
    large: LargePool,
    /// Blocks handed out now, ptr -> size: catches double frees and foreign blocks, which would
    /// otherwise hand the same memory out twice.
    live: HashMap<u64, usize>,
    stats: MemoryStats,
}

impl<R: RawAlloc> CachingAllocator<R> {
    pub(crate) fn new(raw: R) -> Self {
        Self { raw, small: HashMap::new(), large: LargePool::default(), live: HashMap::new(), stats: MemoryStats::default() }
    }

    /// A block of at least `bytes` (0 bytes gives a block of size 0 with ptr 0, no device call).
    ///
    /// Sizes round up to multiples of 512 B. A small request (up to 1 MiB) reuses a cached
    /// block of its exact class; a large one the smallest free piece of a segment that fits
    /// (split to its size), else a new segment (rounded to 2 MiB). On device
    /// OOM the cache's unused memory is returned to the device and the call retried once.
    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<Block, OutOfMemory> {
        if bytes == 0 {
            return Ok(Block { ptr: 0, size: 0 });
        }
        let oom = |stats| OutOfMemory { requested: bytes, stats };
        let Some(size) = round_size(bytes) else { return Err(oom(self.stats)) };
        let large = size > SMALL_LIMIT;
        let cached = if large { self.large.take(size) } else { self.take_small(size) };
        let block = match cached {
            Some(block) => {
                self.stats.cache_hits += 1;
                block
            }
            None => {
                let Some(device_size) = (if large { size.checked_next_multiple_of(SEGMENT_ROUND) } else { Some(size) }) else { return Err(oom(self.stats)) };
                let ptr = match self.raw.malloc(device_size) {
                    Ok(ptr) => ptr,
                    Err(()) => {
                        let at_failure = self.stats;
                        let freed = self.empty_cache();
                        if freed == 0 {
                            return Err(oom(at_failure)); // nothing cached: a retry cannot succeed
                        }
                        self.raw.malloc(device_size).map_err(|()| oom(at_failure))?
                    }
                };
                self.stats.device_alloc_count += 1;
                self.stats.reserved += device_size;
                self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
                if large {
                    self.large.add_segment(ptr, device_size, size)
                } else {
                    Block { ptr, size }
                }
            }
        };

        let prev = self.live.insert(block.ptr, block.size);
        assert!(prev.is_none(), "caching allocator: device pointer {:#x} handed out twice", block.ptr);
        self.stats.alloc_count += 1;
        self.stats.allocated += block.size;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        Ok(block)
    }

    /// A cached block of small class `size`, removed from the cache.
    fn take_small(&mut self, size: usize) -> Option<Block> {
        let ptrs = self.small.get_mut(&size)?;
        let ptr = ptrs.pop()?;
        if ptrs.is_empty() {
            self.small.remove(&size);
        }
        Some(Block { ptr, size })
    }

    /// Returns a block to the cache (not to the device).
    ///
    /// Panics on a block this allocator did not hand out (or freed twice): caching it would give
    /// the same memory to two owners.
    pub(crate) fn free(&mut self, block: Block) {
        if block.size == 0 && block.ptr == 0 {
            return;
        }
        match self.live.remove(&block.ptr) {
            Some(size) if size == block.size => {}
            Some(size) => panic!(
                "caching allocator: block {:#x} freed with size {} but was handed out with size {size}",
                block.ptr, block.size
            ),
            None => panic!("caching allocator: block {:#x} freed twice or not from this allocator", block.ptr),
        }
        self.stats.allocated -= block.size;
        if block.size <= SMALL_LIMIT {
            self.small.entry(block.size).or_default().push(block.ptr);
        } else {
            self.large.give_back(block);
        }
    }

    /// Returns every cached small block and every segment with nothing handed out to the
    /// device; the bytes returned.
    pub(crate) fn empty_cache(&mut self) -> usize {
        let small = std::mem::take(&mut self.small).into_iter().flat_map(|(size, ptrs)| ptrs.into_iter().map(move |p| (p, size)));
        let unused: Vec<(u64, usize)> = small.chain(self.large.drain_unused()).collect();
        let mut freed = 0;
        for (ptr, size) in unused {
            self.raw.free(ptr);
            self.stats.reserved -= size;
            freed += size;
        }
        freed
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        self.stats
    }

    /// Sets both peaks to the current values.
    pub(crate) fn reset_peak_stats(&mut self) {
        self.stats.peak_allocated = self.stats.allocated;
        self.stats.peak_reserved = self.stats.reserved;
    }
}

/// Cached blocks go back to the device; blocks still handed out are left alone (their owners may
/// outlive the allocator only by a bug, and freeing memory in use would be worse than leaking it).
impl<R: RawAlloc> Drop for CachingAllocator<R> {
    fn drop(&mut self) {
        self.empty_cache();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;

    /// Device state shared between the test and the mock the allocator owns.
    #[derive(Default)]
    struct Device {
        capacity: usize,
        live: HashMap<u64, usize>,
        live_bytes: usize,
        next_ptr: u64,
        mallocs: u64,
        failed_mallocs: u64,
        frees: u64,
        freed: HashSet<u64>,
    }

    #[derive(Clone)]
    struct Mock(Arc<Mutex<Device>>);

    impl Mock {
        fn new(capacity: usize) -> Self {
            Mock(Arc::new(Mutex::new(Device { capacity, next_ptr: 0x7f00_0000_0000, ..Device::default() })))
        }
        fn dev(&self) -> std::sync::MutexGuard<'_, Device> {
            self.0.lock().unwrap()
        }
    }

    impl RawAlloc for Mock {
        fn malloc(&mut self, bytes: usize) -> Result<u64, ()> {
            let mut d = self.dev();
            assert!(bytes > 0 && bytes.is_multiple_of(512), "device asked for {bytes} bytes");
            if d.live_bytes + bytes > d.capacity {
                d.failed_mallocs += 1;
                return Err(());
            }
            let ptr = d.next_ptr;
            // Fresh pointers never repeat, with a gap so overlapping use would show.
            d.next_ptr += bytes as u64 + 4096;
            d.live.insert(ptr, bytes);
            d.live_bytes += bytes;
            d.mallocs += 1;
            Ok(ptr)
        }
        fn free(&mut self, ptr: u64) {
            let mut d = self.dev();
            let bytes = d.live.remove(&ptr).unwrap_or_else(|| panic!("device free of {ptr:#x}, which is not live"));
            assert!(d.freed.insert(ptr), "device pointer {ptr:#x} freed twice");
            d.live_bytes -= bytes;
            d.frees += 1;
        }
    }

    fn setup(capacity: usize) -> (CachingAllocator<Mock>, Mock) {
        let mock = Mock::new(capacity);
        (CachingAllocator::new(mock.clone()), mock)
    }

    /// The pieces of every segment tile it exactly, neighbouring free pieces are merged, and
    /// the free set lists exactly the free pieces.
    fn check_pieces<R: RawAlloc>(a: &CachingAllocator<R>) {
        let pool = &a.large;
        for (&base, &size) in &pool.segments {
            let mut at = base;
            let mut last_free = false;
            for (&p, piece) in pool.pieces.range(base..base + size as u64) {
                assert_eq!(p, at, "pieces of segment {base:#x} leave a gap or overlap at {p:#x}");
                assert_eq!(piece.segment, base);
                assert!(!(last_free && piece.free), "two neighbouring free pieces at {p:#x}");
                last_free = piece.free;
                at = p + piece.size as u64;
            }
            assert_eq!(at, base + size as u64, "segment {base:#x} not covered");
        }
        let free: BTreeSet<(usize, u64)> = pool.pieces.iter().filter(|(_, p)| p.free).map(|(&ptr, p)| (p.size, ptr)).collect();
        assert_eq!(free, pool.free);
        assert_eq!(pool.pieces.values().map(|p| p.size).sum::<usize>(), pool.segments.values().sum::<usize>());
    }

    #[test]
    fn sizes_round_to_512_bytes_and_segments_to_2_mib() {
        let cases = [
            (1, 512, 512),
            (511, 512, 512),
            (512, 512, 512),
            (513, 1024, 1024),
            (4 * KIB + 1, 4 * KIB + 512, 4 * KIB + 512),
            (MIB - 1, MIB, MIB),
            (MIB, MIB, MIB),
            (MIB + 1, MIB + 512, 2 * MIB),
            (2 * MIB, 2 * MIB, 2 * MIB),
            (5 * MIB, 5 * MIB, 6 * MIB),
            (100 * MIB + 3, 100 * MIB + 512, 102 * MIB),
        ];
        for (bytes, block, _) in cases {
            assert_eq!(round_size(bytes), Some(block), "block of {bytes}");
        }
        assert_eq!(round_size(usize::MAX), None);

        for (bytes, block, device) in cases {
            let (mut a, mock) = setup(usize::MAX);
            let b = a.alloc(bytes).unwrap();
            assert_eq!(b.size, block, "block for {bytes}");
            assert_eq!(mock.dev().live[&b.ptr], device, "device allocation for {bytes}");
            assert_eq!((a.stats().allocated, a.stats().reserved), (block, device));
        }
    }


    #[test]
    fn small_block_reused_by_exact_class() {
        let (mut a, mock) = setup(usize::MAX);
        let b = a.alloc(1000).unwrap();
        assert_eq!(b.size, 1024);
        a.free(b);
        assert_eq!(mock.dev().frees, 0, "free goes to the cache, not the device");

        let c = a.alloc(600).unwrap(); // same 1024 class
        assert_eq!(c, b);
        assert_eq!(mock.dev().mallocs, 1);
        assert_eq!(a.stats().cache_hits, 1);

        // Another class does not take it, even a smaller one.
        a.free(c);
        let d = a.alloc(512).unwrap();
        assert_ne!(d.ptr, b.ptr);
        let e = a.alloc(1536).unwrap();
        assert_ne!(e.ptr, b.ptr);
        assert_eq!(mock.dev().mallocs, 3);
        assert_eq!(a.stats().cache_hits, 1);

        // Most recently freed block of a class comes back first.
        let f = a.alloc(1024).unwrap();
        assert_eq!(f.ptr, b.ptr);
        let g = a.alloc(1024).unwrap();
        a.free(f);
        a.free(g);
        assert_eq!(a.alloc(1024).unwrap().ptr, g.ptr);
        assert_eq!(a.alloc(1024).unwrap().ptr, f.ptr);
        assert_eq!(a.stats().cache_hits, 4);
    }

    #[test]
    fn a_large_request_takes_the_smallest_free_piece_split_to_its_size() {
        let (mut a, mock) = setup(usize::MAX);
        let big = a.alloc(40 * MIB).unwrap();
        a.free(big);
        // 1 MiB is small: never cut from a segment.
        let small = a.alloc(MIB).unwrap();
        assert_ne!(small.ptr, big.ptr);

        // 10 MiB from the free 40: the first 10 handed out, 30 left free behind it.
        let ten = a.alloc(10 * MIB).unwrap();
        assert_eq!(ten, Block { ptr: big.ptr, size: 10 * MIB });
        assert_eq!(a.stats().allocated, MIB + 10 * MIB, "counts what was asked, not the cached block");
        let twenty = a.alloc(20 * MIB).unwrap();
        assert_eq!(twenty, Block { ptr: big.ptr + 10 * MIB as u64, size: 20 * MIB });
        check_pieces(&a);
        // 10 MiB left in the segment; 12 do not fit: a new segment.
        let twelve = a.alloc(12 * MIB).unwrap();
        assert_eq!(mock.dev().live[&twelve.ptr], 12 * MIB);
        assert_eq!(mock.dev().mallocs, 3);
        // The 10 left give 9.5 MiB; 512 KiB stay free behind them.
        let nine = a.alloc(9 * MIB + 512 * KIB).unwrap();
        assert_eq!(nine, Block { ptr: big.ptr + 30 * MIB as u64, size: 9 * MIB + 512 * KIB });
        assert_eq!(a.stats().cache_hits, 3);
        check_pieces(&a);

        // Best fit: of free pieces of 30 MiB (twenty, nine and the rest merged) and 12 MiB
        // (twelve's segment), 11 MiB comes from the 12.
        a.free(twenty);
        a.free(nine);
        a.free(twelve);
        check_pieces(&a);
        let eleven = a.alloc(11 * MIB).unwrap();
        assert_eq!(eleven, Block { ptr: twelve.ptr, size: 11 * MIB });
        check_pieces(&a);
        for b in [small, ten, eleven] {
            a.free(b);
        }
        check_pieces(&a);
        a.empty_cache();
        assert_eq!(mock.dev().live_bytes, 0);
    }

    #[test]
    fn a_free_piece_hands_out_its_end_and_merges_back_whole() {
        let mut pool = LargePool::default();
        let first = pool.add_segment(0x1000_0000, 4 * MIB, MIB);
        let (found, ptr) = pool.fitting(MIB).next().unwrap();
        assert_eq!((found, ptr), (3 * MIB, first.ptr + MIB as u64));
        let end = pool.take_free(found, ptr, MIB, true);
        assert_eq!(end, Block { ptr: first.ptr + 3 * MIB as u64, size: MIB });
        assert_eq!(pool.fitting(MIB).collect::<Vec<_>>(), vec![(2 * MIB, first.ptr + MIB as u64)], "the rest stays free where it was");
        pool.give_back(end);
        pool.give_back(first);
        assert_eq!(pool.fitting(MIB).collect::<Vec<_>>(), vec![(4 * MIB, first.ptr)], "one piece again");
    }

    #[test]
    fn freed_pieces_merge_with_free_neighbours_and_empty_segments_go_back() {
        let (mut a, mock) = setup(usize::MAX);
        let seg = a.alloc(30 * MIB).unwrap();
        a.free(seg);
        let x = a.alloc(10 * MIB).unwrap();
        let y = a.alloc(10 * MIB).unwrap();
        let z = a.alloc(10 * MIB).unwrap();
        assert_eq!([x.ptr, y.ptr, z.ptr], [seg.ptr, seg.ptr + 10 * MIB as u64, seg.ptr + 20 * MIB as u64]);
        // A segment with anything handed out stays.
        a.free(x);
        a.free(z);
        check_pieces(&a);
        assert_eq!(a.empty_cache(), 0);
        assert_eq!(mock.dev().frees, 0);
        // y between two free pieces: all three merge, and 30 MiB fit again without the device.
        a.free(y);
        check_pieces(&a);
        assert_eq!(a.large.pieces.len(), 1);
        let again = a.alloc(30 * MIB).unwrap();
        assert_eq!(again, seg);
        assert_eq!(mock.dev().mallocs, 1);
        a.free(again);
        // Pieces of two segments never merge, though their addresses might touch.
        let other = a.alloc(40 * MIB).unwrap();
        a.free(other);
        assert_eq!(a.large.pieces.len(), 2);
        assert_eq!(a.empty_cache(), 30 * MIB + 40 * MIB);
        let d = mock.dev();
        assert_eq!((d.frees, d.live_bytes), (2, 0));
        drop(d);
        assert!(a.large.pieces.is_empty() && a.large.free.is_empty() && a.large.segments.is_empty());
    }

    #[test]
    fn stats_and_peaks() {
        let (mut a, _mock) = setup(usize::MAX);
        assert_eq!(a.stats(), MemoryStats::default());

        let x = a.alloc(1000).unwrap(); // 1 KiB
        let y = a.alloc(4 * MIB).unwrap(); // one 4 MiB segment
        let s = a.stats();
        assert_eq!(s.allocated, KIB + 4 * MIB);
        assert_eq!(s.reserved, KIB + 4 * MIB);
        assert_eq!(s.peak_allocated, KIB + 4 * MIB);
        assert_eq!(s.peak_reserved, KIB + 4 * MIB);
        assert_eq!((s.alloc_count, s.device_alloc_count, s.cache_hits), (2, 2, 0));

        a.free(y);
        let s = a.stats();
        assert_eq!(s.allocated, KIB);
        assert_eq!(s.reserved, KIB + 4 * MIB, "freed blocks stay reserved");
        assert_eq!(s.peak_allocated, KIB + 4 * MIB);

        a.reset_peak_stats();
        let s = a.stats();
        assert_eq!((s.peak_allocated, s.peak_reserved), (KIB, KIB + 4 * MIB));

        let y2 = a.alloc(4 * MIB).unwrap(); // cache hit
        let s = a.stats();
        assert_eq!(s.allocated, KIB + 4 * MIB);
        assert_eq!(s.peak_allocated, KIB + 4 * MIB);
        assert_eq!(s.reserved, KIB + 4 * MIB);
        assert_eq!((s.alloc_count, s.device_alloc_count, s.cache_hits), (3, 2, 1));

        a.free(x);
        a.free(y2);
        a.empty_cache();
        let s = a.stats();
        assert_eq!((s.allocated, s.reserved), (0, 0));
        assert_eq!((s.peak_allocated, s.peak_reserved), (KIB + 4 * MIB, KIB + 4 * MIB));
        a.reset_peak_stats();
        assert_eq!((a.stats().peak_allocated, a.stats().peak_reserved), (0, 0));
        assert_eq!(a.stats().alloc_count, 3, "counts survive reset_peak_stats");
    }

    #[test]
    fn oom_empties_cache_and_retries() {
        let (mut a, mock) = setup(10 * MIB);
        let six = a.alloc(6 * MIB).unwrap();
        a.free(six);
        assert_eq!(a.stats().reserved, 6 * MIB);

        // 6 + 8 > 10: the device refuses, the cached 6 MiB go back, the retry succeeds.
        let eight = a.alloc(8 * MIB).unwrap();
        assert_eq!(eight.size, 8 * MIB);
        let d = mock.dev();
        assert_eq!((d.mallocs, d.failed_mallocs, d.frees), (2, 1, 1));
        assert!(d.freed.contains(&six.ptr));
        drop(d);
        let s = a.stats();
        assert_eq!((s.allocated, s.reserved, s.device_alloc_count), (8 * MIB, 8 * MIB, 2));
        assert_eq!(s.peak_reserved, 8 * MIB);
    }

    #[test]
    fn oom_error_reports_figures_and_allocator_recovers() {
        let (mut a, mock) = setup(10 * MIB);
        let keep = a.alloc(4 * MIB).unwrap();
        let cached = a.alloc(2 * MIB).unwrap();
        a.free(cached);

        let err = a.alloc(20 * MIB).unwrap_err();
        assert_eq!(err.requested, 20 * MIB);
        // Figures from when the device first refused: 2 MiB were cached and then freed.
        assert_eq!(err.stats.allocated, 4 * MIB);
        assert_eq!(err.stats.reserved, 6 * MIB);
        let msg = err.to_string();
        assert_eq!(
            msg,
            "out of device memory: tried to allocate 20.00 MiB; 4.00 MiB allocated (peak 6.00 MiB), \
             6.00 MiB reserved (peak 6.00 MiB), 2.00 MiB cached and freed before retrying"
        );
        assert_eq!(mock.dev().failed_mallocs, 2, "one try, one retry");

        // The cache was emptied; the allocator is consistent and still works.
        let s = a.stats();
        assert_eq!((s.allocated, s.reserved, s.alloc_count), (4 * MIB, 4 * MIB, 2));
        let b = a.alloc(6 * MIB).unwrap();
        assert_eq!(b.size, 6 * MIB);
        a.free(b);
        a.free(keep);
        a.empty_cache();
        assert_eq!(mock.dev().live_bytes, 0);

        // Nothing cached: no pointless retry.
        let before = mock.dev().failed_mallocs;
        assert!(a.alloc(11 * MIB).is_err());
        assert_eq!(mock.dev().failed_mallocs, before + 1);
    }

    #[test]
    fn oversized_request_is_oom_without_device_call() {
        let (mut a, mock) = setup(usize::MAX);
        let err = a.alloc(usize::MAX - 5).unwrap_err();
        assert_eq!(err.requested, usize::MAX - 5);
        let d = mock.dev();
        assert_eq!(d.failed_mallocs + d.mallocs, 0);
        drop(d);
        assert!(a.alloc(100).is_ok());
    }

    #[test]
    fn empty_cache_returns_every_cached_block_once() {
        let (mut a, mock) = setup(usize::MAX);
        let sizes = [1, 512, 513, 1000, 70 * KIB, MIB, MIB + 1, 3 * MIB, 8 * MIB, 8 * MIB, 40 * MIB];
        let blocks: Vec<Block> = sizes.iter().map(|&s| a.alloc(s).unwrap()).collect();
        let (kept, freed) = blocks.split_at(4);
        for &b in freed {
            a.free(b);
        }
        a.empty_cache();
        let s = a.stats();
        assert_eq!(s.reserved, s.allocated);
        assert_eq!(s.allocated, kept.iter().map(|b| b.size).sum::<usize>());
        {
            let d = mock.dev();
            assert_eq!(d.frees as usize, freed.len());
            assert!(freed.iter().all(|b| d.freed.contains(&b.ptr)));
            assert!(kept.iter().all(|b| d.live.contains_key(&b.ptr)));
            assert_eq!(d.live_bytes, s.reserved);
        }

        // Emptying twice does nothing more; a fresh alloc goes to the device.
        a.empty_cache();
        assert_eq!(mock.dev().frees as usize, freed.len());
        let c = a.alloc(8 * MIB).unwrap();
        assert!(!freed.iter().any(|b| b.ptr == c.ptr));

        for &b in kept {
            a.free(b);
        }
        a.free(c);
        a.empty_cache();
        let d = mock.dev();
        assert_eq!(d.live_bytes, 0);
        assert!(d.live.is_empty());
        assert_eq!(d.frees, d.mallocs, "every device pointer freed exactly once");
        assert_eq!(a.stats().reserved, 0);
    }

    #[test]
    fn drop_returns_cache_but_not_live_blocks() {
        let mock = Mock::new(usize::MAX);
        let mut a = CachingAllocator::new(mock.clone());
        let live = a.alloc(3 * MIB).unwrap();
        let cached = a.alloc(4 * KIB).unwrap();
        a.free(cached);
        drop(a);
        let d = mock.dev();
        assert!(d.freed.contains(&cached.ptr));
        assert!(d.live.contains_key(&live.ptr));
    }

    #[test]
    fn zero_bytes() {
        let (mut a, mock) = setup(0);
        let z = a.alloc(0).unwrap();
        assert_eq!(z, Block { ptr: 0, size: 0 });
        a.free(z);
        a.free(z);
        assert_eq!(a.stats(), MemoryStats::default());
        let d = mock.dev();
        assert_eq!(d.mallocs + d.failed_mallocs, 0);
        drop(d);
        assert!(a.alloc(1).is_err(), "a capacity-0 device still refuses real requests");
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_free_panics() {
        let (mut a, _mock) = setup(usize::MAX);
        let b = a.alloc(100).unwrap();
        a.free(b);
        a.free(b);
    }

    #[test]
    #[should_panic(expected = "handed out with size")]
    fn free_with_wrong_size_panics() {
        let (mut a, _mock) = setup(usize::MAX);
        let b = a.alloc(100).unwrap();
        a.free(Block { ptr: b.ptr, size: 2 * MIB });
    }

    #[test]
    fn byte_formatting() {
        assert_eq!(fmt_bytes(0), "0 bytes");
        assert_eq!(fmt_bytes(1023), "1023 bytes");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(6 * MIB), "6.00 MiB");
        assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
    }

    /// A long random-ish workload: the allocator's figures always agree with the device's, no
    /// two blocks handed out overlap, and the segments' pieces stay consistent.
    #[test]
    fn randomized_consistency() {
        let (mut a, mock) = setup(64 * MIB);
        let mut held: Vec<Block> = Vec::new();
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..5000 {
            let r = next();
            match r % 5 {
                0..=2 => {
                    let bytes =
                        if r % 3 == 0 { (next() % (12 * MIB as u64)) as usize } else { (next() % 4096) as usize };
                    if let Ok(b) = a.alloc(bytes) {
                        assert!(b.size >= bytes);
                        if bytes > 0 {
                            held.push(b);
                        }
                    }
                }
                3 if !held.is_empty() => {
                    let i = (next() % held.len() as u64) as usize;
                    a.free(held.swap_remove(i));
                }
                _ if r % 97 == 0 => {
                    a.empty_cache();
                }
                _ => {}
            }
            let s = a.stats();
            assert_eq!(s.allocated, held.iter().map(|b| b.size).sum::<usize>());
            assert_eq!(s.reserved, mock.dev().live_bytes);
            check_pieces(&a);
            let mut by_ptr: Vec<Block> = held.clone();
            by_ptr.sort_by_key(|b| b.ptr);
            assert!(by_ptr.windows(2).all(|w| w[0].ptr + w[0].size as u64 <= w[1].ptr), "two blocks handed out overlap");
            assert!(s.allocated <= s.reserved && s.peak_allocated >= s.allocated && s.peak_reserved >= s.reserved);
        }
        let ptrs: HashSet<u64> = held.iter().map(|b| b.ptr).collect();
        assert_eq!(ptrs.len(), held.len(), "no pointer handed out twice");
    }
}
