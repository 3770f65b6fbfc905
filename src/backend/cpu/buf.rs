//! `HostBuf`: the memory of a host tensor. Buffers kiln allocates start on a 64-byte boundary
//! (a cache line, and the width of an AVX-512 vector), as PyTorch's CPU allocator's do: the
//! system allocator puts large blocks 16 bytes past a page, so every full-width load of a row
//! would straddle two cache lines and the streaming stores of row kernels could not be used.
//! A `Vec` handed over by a caller is adopted as it is, without a copy.

use std::alloc::Layout;
use std::fmt;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Alignment of the buffers kiln allocates.
pub(crate) const ALIGN: usize = 64;

/// Bytes of every live `HostBuf` (kiln's own and adopted `Vec`s, cached ones too), and the most
/// of them, less the cache's, in use at once (`pool::memory_stats`).
pub(crate) static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
pub(crate) static PEAK_IN_USE: AtomicUsize = AtomicUsize::new(0);

/// Counts `bytes` more of live buffers.
fn count(bytes: usize) {
    LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed);
    note_in_use(super::pool::cached_bytes());
}

/// Raises the peak to what is in use now, with `cached` bytes of live buffers in the cache.
pub(crate) fn note_in_use(cached: usize) {
    PEAK_IN_USE.fetch_max(LIVE_BYTES.load(Ordering::Relaxed).saturating_sub(cached), Ordering::Relaxed);
}

/// A growable host buffer of `T`, like `Vec<T>`, that remembers the alignment it was allocated
/// with (so that it is freed with the same layout).
pub struct HostBuf<T> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
    /// The allocation's alignment: `ALIGN`, or `T`'s own for an adopted `Vec`.
    align: usize,
}

// SAFETY: a HostBuf owns its elements as a Vec does.
unsafe impl<T: Send> Send for HostBuf<T> {}
// SAFETY: shared access only reads, as for a Vec.
unsafe impl<T: Sync> Sync for HostBuf<T> {}

impl<T> HostBuf<T> {
    /// An empty buffer with room for `cap` elements, aligned to `ALIGN` bytes.
    pub(crate) fn with_capacity(cap: usize) -> HostBuf<T> {
        let align = ALIGN.max(std::mem::align_of::<T>());
        let bytes = cap.checked_mul(std::mem::size_of::<T>()).expect("host buffer size overflows usize");
        if bytes == 0 {
            return HostBuf { ptr: NonNull::dangling(), len: 0, cap, align };
        }
        let layout = Layout::from_size_align(bytes, align).expect("host buffer layout");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(p.cast::<T>()) else { std::alloc::handle_alloc_error(layout) };
        count(bytes);
        HostBuf { ptr, len: 0, cap, align }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// Whether kiln allocated it (on `ALIGN` bytes), rather than adopting a `Vec`.
    pub(crate) fn is_aligned_by_kiln(&self) -> bool {
        self.align == ALIGN.max(std::mem::align_of::<T>())
    }

    /// The slots after the elements, to be written before `set_len` counts them.
    pub(crate) fn spare_capacity_mut(&mut self) -> &mut [MaybeUninit<T>] {
        // SAFETY: the allocation holds `cap` slots; those past `len` are not initialised.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(self.len).cast::<MaybeUninit<T>>(), self.cap - self.len) }
    }

    /// # Safety
    /// The first `len` slots (at most the capacity) must hold initialised values.
    pub(crate) unsafe fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.cap);
        self.len = len;
    }

    /// Drops the elements, keeping the memory.
    pub(crate) fn clear(&mut self) {
        let elems: *mut [T] = &mut **self;
        self.len = 0;
        // SAFETY: the elements were initialised and are no longer counted.
        unsafe { std::ptr::drop_in_place(elems) };
    }

    /// The elements as a `Vec` (without a copy when the buffer was one).
    pub fn into_vec(self) -> Vec<T>
    where
        T: Clone,
    {
        if self.align == std::mem::align_of::<T>() {
            LIVE_BYTES.fetch_sub(self.cap * std::mem::size_of::<T>(), Ordering::Relaxed);
            let me = ManuallyDrop::new(self);
            // SAFETY: the memory came from a Vec<T> of this capacity (see `From<Vec<T>>`).
            return unsafe { Vec::from_raw_parts(me.ptr.as_ptr(), me.len, me.cap) };
        }
        self.to_vec()
    }
}

impl<T: Clone> HostBuf<T> {
    pub(crate) fn extend_from_slice(&mut self, s: &[T]) {
        assert!(self.len + s.len() <= self.cap, "a host buffer never grows past the capacity it was made with");
        for (slot, x) in self.spare_capacity_mut().iter_mut().zip(s) {
            slot.write(x.clone());
        }
        self.len += s.len();
    }

    /// Appends copies of `x` up to `n` elements.
    pub(crate) fn resize(&mut self, n: usize, x: T) {
        assert!(n <= self.cap, "a host buffer never grows past the capacity it was made with");
        if n <= self.len {
            return;
        }
        let more = n - self.len;
        for slot in &mut self.spare_capacity_mut()[..more] {
            slot.write(x.clone());
        }
        self.len = n;
    }
}

impl<T> From<Vec<T>> for HostBuf<T> {
    /// Adopts the Vec's memory as it is.
    fn from(v: Vec<T>) -> HostBuf<T> {
        let mut v = ManuallyDrop::new(v);
        let (len, cap) = (v.len(), v.capacity());
        count(cap * std::mem::size_of::<T>());
        // SAFETY: a Vec's pointer is never null.
        let ptr = unsafe { NonNull::new_unchecked(v.as_mut_ptr()) };
        HostBuf { ptr, len, cap, align: std::mem::align_of::<T>() }
    }
}

impl<T> Default for HostBuf<T> {
    fn default() -> HostBuf<T> {
        Vec::new().into()
    }
}

impl<T> FromIterator<T> for HostBuf<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> HostBuf<T> {
        iter.into_iter().collect::<Vec<T>>().into()
    }
}

impl<T> Drop for HostBuf<T> {
    fn drop(&mut self) {
        self.clear();
        let bytes = self.cap * std::mem::size_of::<T>();
        if bytes == 0 {
            return;
        }
        LIVE_BYTES.fetch_sub(bytes, Ordering::Relaxed);
        // SAFETY: allocated with this size and alignment (by `with_capacity` or by a Vec).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast::<u8>(), Layout::from_size_align_unchecked(bytes, self.align)) };
    }
}

impl<T> Deref for HostBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the first `len` slots are initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: the first `len` slots are initialised, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> AsRef<[T]> for HostBuf<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<'a, T> IntoIterator for &'a HostBuf<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a, T> IntoIterator for &'a mut HostBuf<T> {
    type Item = &'a mut T;
    type IntoIter = std::slice::IterMut<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

impl<T: Clone> Clone for HostBuf<T> {
    fn clone(&self) -> HostBuf<T> {
        let mut b = HostBuf::with_capacity(self.len);
        b.extend_from_slice(self);
        b
    }
}

impl<T: fmt::Debug> fmt::Debug for HostBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq> PartialEq for HostBuf<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_buffers_are_aligned_and_adopted_vecs_keep_their_memory() {
        for n in [1usize, 3, 1000, 1 << 20] {
            let mut b: HostBuf<f32> = HostBuf::with_capacity(n);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "{n} floats");
            b.resize(n, 1.5);
            assert_eq!(b.len(), n);
            let c = b.clone();
            assert_eq!(c.as_ptr() as usize % ALIGN, 0);
            assert_eq!(b.into_vec(), vec![1.5; n]);
        }
        let v = vec![1u8, 2, 3];
        let p = v.as_ptr();
        let b = HostBuf::from(v);
        assert_eq!(b.as_ptr(), p);
        let v = b.into_vec();
        assert_eq!((v.as_ptr(), v.as_slice()), (p, &[1u8, 2, 3][..]));
        let empty: HostBuf<f64> = HostBuf::with_capacity(0);
        assert!(empty.is_empty());
    }
}
