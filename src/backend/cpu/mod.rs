//! The CPU backend: host storage and loops over strided data, parallel with rayon on large
//! tensors, with contiguous fast paths.

pub(crate) mod attention;
mod buf;
pub(crate) mod cgen;
pub(crate) mod foreach;
pub(crate) mod fused;
pub(crate) mod index;
pub(crate) mod jit;
pub(crate) mod matmul;
pub(crate) mod maxpool;
pub(crate) mod pointwise;
pub(crate) mod pool;
pub(crate) mod reduce;
mod spin;

use crate::dtype::Elem;
use crate::layout::Layout;
use crate::storage::BackendStorage;
use crate::{DType, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::mem::MaybeUninit;

pub use buf::HostBuf;

/// Below this many elements a loop runs on one thread: spawning costs more than it saves.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;
const CHUNK: usize = 1 << 14;

/// A host buffer of one dtype (64-byte aligned where kiln allocated it).
#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(HostBuf<f32>),
    F64(HostBuf<f64>),
    F16(HostBuf<f16>),
    BF16(HostBuf<bf16>),
    I64(HostBuf<i64>),
    I32(HostBuf<i32>),
    U8(HostBuf<u8>),
    Bool(HostBuf<bool>),
}

/// Runs `$body` with `$v` bound to the typed Vec of a `CpuStorage` (one arm per dtype).
macro_rules! with_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($v) => $body,
            CpuStorage::F64($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::I64($v) => $body,
            CpuStorage::I32($v) => $body,
            CpuStorage::U8($v) => $body,
            CpuStorage::Bool($v) => $body,
        }
    };
}
pub(crate) use with_storage;

/// Runs `$body` with the type alias `$t` set to the Rust type of a `DType`.
macro_rules! with_dtype {
    ($d:expr, $t:ident => $body:expr) => {
        match $d {
            DType::F32 => { type $t = f32; $body }
            DType::F64 => { type $t = f64; $body }
            DType::F16 => { type $t = half::f16; $body }
            DType::BF16 => { type $t = half::bf16; $body }
            DType::I64 => { type $t = i64; $body }
            DType::I32 => { type $t = i32; $body }
            DType::U8 => { type $t = u8; $body }
            DType::Bool => { type $t = bool; $body }
        }
    };
}
pub(crate) use with_dtype;

/// Typed access to a `CpuStorage`.
pub trait HostElem: Elem {
    fn wrap(v: impl Into<HostBuf<Self>>) -> CpuStorage;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}
macro_rules! host_elem {
    ($t:ty, $v:ident) => {
        impl HostElem for $t {
            fn wrap(v: impl Into<HostBuf<Self>>) -> CpuStorage {
                CpuStorage::$v(v.into())
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                if let CpuStorage::$v(v) = s { Some(v) } else { None }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                if let CpuStorage::$v(v) = s { Some(v) } else { None }
            }
        }
    };
}
host_elem!(f32, F32);
host_elem!(f64, F64);
host_elem!(f16, F16);
host_elem!(bf16, BF16);
host_elem!(i64, I64);
host_elem!(i32, I32);
host_elem!(u8, U8);
host_elem!(bool, Bool);

impl CpuStorage {
    /// Hands the buffer to the host caching allocator (`pool`).
    pub(crate) fn recycle(self) {
        with_storage!(self, v => pool::give(v))
    }

    pub(crate) fn dtype(&self) -> DType {
        with_storage!(self, v => elem_dtype(v))
    }
    pub(crate) fn len(&self) -> usize {
        with_storage!(self, v => v.len())
    }
    pub(crate) fn zeros(dtype: DType, n: usize) -> CpuStorage {
        with_dtype!(dtype, T => T::wrap(pool::zeros(n)))
    }
    /// A storage of `dtype` from values computed in `C` (converting unless they already match).
    pub(crate) fn from_vec_as<C: HostElem>(v: impl Into<HostBuf<C>>, dtype: DType) -> CpuStorage {
        let v = v.into();
        if C::DTYPE == dtype {
            return C::wrap(v);
        }
        with_dtype!(dtype, T => T::wrap(par_map_slice(&v, |x| x.cast::<T>())))
    }
}

fn elem_dtype<T: Elem>(_: &[T]) -> DType {
    T::DTYPE
}

/// `f` over a slice into a new Vec, in parallel when large.
pub(crate) fn par_map_slice<A: Elem, B: Elem>(a: &[A], f: impl Fn(A) -> B + Sync) -> HostBuf<B> {
    fill_new(a.len(), |start, out| {
        let end = start + out.len();
        for (o, &x) in out.iter_mut().zip(&a[start..end]) {
            o.write(f(x));
        }
    })
}

/// Host allocations from this size up are tried first, so that a size the machine cannot give
/// is `Error::OutOfMemory` instead of an abort (Rust's allocation failure handler).
const PROBE_BYTES: usize = 1 << 30;

/// Checks that the host can allocate `bytes` (for a result of `op`) before a loop does: more
/// than the machine's memory and swap together is refused outright (where the kernel
/// overcommits, an allocation that large succeeds and the process is killed when it touches it),
/// the rest must be reservable.
pub(crate) fn ensure_host_memory(op: &'static str, bytes: usize) -> crate::Result<()> {
    if bytes < PROBE_BYTES {
        return Ok(());
    }
    let oom = |why: String| crate::Error::OutOfMemory {
        device: crate::Device::Cpu,
        msg: format!("{op}: the host cannot allocate {bytes} bytes ({:.1} GiB){why}", bytes as f64 / (1u64 << 30) as f64),
    };
    if let Some(total) = host_memory_bytes() {
        if bytes as u64 > total {
            return Err(oom(format!(": the machine has {:.1} GiB of memory and swap", total as f64 / (1u64 << 30) as f64)));
        }
    }
    let mut probe: Vec<u8> = Vec::new();
    if probe.try_reserve_exact(bytes).is_ok() {
        return Ok(());
    }
    // The cached buffers go back to the system before the request is refused.
    pool::empty_cache();
    probe.try_reserve_exact(bytes).map_err(|_| oom(String::new()))
}

/// Physical memory plus swap, where the system says (`/proc/meminfo`); read once.
fn host_memory_bytes() -> Option<u64> {
    static TOTAL: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *TOTAL.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let kib = |key: &str| info.lines().find_map(|l| l.strip_prefix(key)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok());
        Some((kib("MemTotal:")? + kib("SwapTotal:").unwrap_or(0)) * 1024)
    })
}

/// Runs `body` compiled for AVX2 and FMA where the CPU has them: the loops inlined into it (every
/// `fill_new` chunk, a fused kernel's folds), with the scalar functions they apply, then
/// vectorise 8 floats wide instead of the baseline's 4. Without FMA contraction the results are
/// the baseline's.
#[inline(always)]
pub(crate) fn wide<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has both features.
            return unsafe { avx2(body) };
        }
    }
    body()
}

/// A new Vec of `n` elements whose chunks `fill(start, chunk)` writes, in parallel when large
/// (each chunk under `wide`).
/// Every element must be written by `fill`.
pub(crate) fn fill_new<T: Send + Sync + 'static>(n: usize, fill: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync) -> HostBuf<T> {
    let mut v: HostBuf<T> = pool::take(n);
    {
        let spare = &mut v.spare_capacity_mut()[..n];
        if n >= PAR_THRESHOLD {
            spare.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| wide(|| fill(i * CHUNK, c)));
        } else {
            wide(|| fill(0, spare));
        }
    }
    // SAFETY: `fill` wrote every element of the first n slots.
    unsafe { v.set_len(n) };
    v
}

/// A tensor's elements as seen by a kernel computing in `C`.
pub(crate) enum Operand<'a, C> {
    /// Row-major elements of the tensor's shape.
    Slice(&'a [C]),
    /// Every element is this one value (a broadcast scalar).
    Scalar(C),
}

impl<C: Copy> Operand<'_, C> {
    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> C {
        match self {
            Operand::Slice(s) => s[i],
            Operand::Scalar(c) => *c,
        }
    }
}

/// Calls `f` with the tensor's elements in `C`: a borrowed slice when the tensor is contiguous
/// and already `C`, one value when it is a broadcast scalar, else a converted row-major copy.
pub(crate) fn with_operand<C: HostElem, R>(t: &Tensor, f: impl FnOnce(Operand<'_, C>) -> R) -> R {
    let guard = t.storage().data.read_recursive();
    let BackendStorage::Cpu(s) = &*guard else { unreachable!("CPU kernel on a CUDA tensor") };
    let layout = t.layout();
    if layout.numel() > 0 && layout.is_broadcast_scalar() {
        let v = with_storage!(s, v => v[layout.offset].cast::<C>());
        return f(Operand::Scalar(v));
    }
    if layout.is_contiguous() {
        if let Some(sl) = C::slice(s) {
            return f(Operand::Slice(&sl[layout.offset..layout.offset + layout.numel()]));
        }
    }
    let v: HostBuf<C> = with_storage!(s, v => gather(v, layout));
    drop(guard);
    f(Operand::Slice(&v))
}

/// The tensor's elements in row-major order, converted to `C`.
pub(crate) fn to_vec_as<C: HostElem>(t: &Tensor) -> HostBuf<C> {
    with_operand::<C, _>(t, |op| match op {
        Operand::Slice(s) => {
            let mut v = pool::take(s.len());
            v.extend_from_slice(s);
            v
        }
        Operand::Scalar(c) => {
            let mut v = pool::take(t.numel());
            v.resize(t.numel(), c);
            v
        }
    })
}

/// The tensor's elements in row-major order, converted to `C`, as a `Vec` (what
/// `Tensor::to_vec` hands out: one copy, not an aligned buffer copied again).
pub(crate) fn to_plain_vec_as<C: HostElem>(t: &Tensor) -> Vec<C> {
    with_operand::<C, _>(t, |op| match op {
        Operand::Slice(s) => s.to_vec(),
        Operand::Scalar(c) => vec![c; t.numel()],
    })
}

/// Row-major copy of the strided elements of `src` described by `layout`, converted to `C`.
pub(crate) fn gather<T: Elem, C: Elem>(src: &[T], layout: &Layout) -> HostBuf<C> {
    fill_new(layout.numel(), |start, out| {
        layout.for_each_run(start, start + out.len(), |pos, off, stride, len| {
            let o = &mut out[pos - start..pos - start + len];
            if stride == 1 {
                for (o, &x) in o.iter_mut().zip(&src[off..off + len]) {
                    o.write(x.cast::<C>());
                }
            } else {
                for (k, o) in o.iter_mut().enumerate() {
                    o.write(src[off + k * stride].cast::<C>());
                }
            }
        })
    })
}

/// A host buffer's elements as bytes (the element types are plain data without padding).
pub(crate) fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain old data of the element type, viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// [`bytes_of`], writable: the bytes written must be values of the element type (from a
/// tensor of the same dtype).
pub(crate) fn bytes_of_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; callers write only bytes of values of the same type.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Address of a CPU tensor's first element (for pinning and asynchronous copies).
pub(crate) fn host_ptr(t: &Tensor) -> *const u8 {
    let guard = t.storage().data.read_recursive();
    let BackendStorage::Cpu(s) = &*guard else { unreachable!("host_ptr of a CUDA tensor") };
    let base = with_storage!(s, v => v.as_ptr().cast::<u8>());
    // SAFETY: the offset is within the storage the layout describes.
    unsafe { base.add(t.layout().offset * t.dtype().size_in_bytes()) }
}

/// Copies `src` into `dst` element for element where both are contiguous, of one dtype and in
/// different storages (a `copy_` of a parameter, an optimiser's state): one pass, no
/// intermediate buffer, split across cores when large. False where that does not apply.
pub(crate) fn copy_contiguous_into(dst: &Tensor, src: &Tensor) -> bool {
    if !(dst.is_contiguous() && src.is_contiguous() && dst.dtype() == src.dtype() && dst.numel() == src.numel()) || dst.shares_storage_with(src) {
        return false;
    }
    let (n, (d0, s0)) = (dst.numel(), (dst.storage_offset(), src.storage_offset()));
    let read = src.storage().data.read_recursive();
    let mut write = dst.storage().data.write();
    let (BackendStorage::Cpu(s), BackendStorage::Cpu(d)) = (&*read, &mut *write) else { return false };
    fn go<T: Copy + Send + Sync>(d: &mut [T], s: &[T]) {
        if d.len() >= 16 * PAR_THRESHOLD {
            let chunk = d.len().div_ceil(rayon::current_num_threads());
            d.par_chunks_mut(chunk).zip(s.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
        } else {
            d.copy_from_slice(s);
        }
    }
    macro_rules! pair {
        ($($v:ident),*) => {
            match (d, s) {
                $((CpuStorage::$v(d), CpuStorage::$v(s)) => go(&mut d[d0..d0 + n], &s[s0..s0 + n]),)*
                _ => return false,
            }
        };
    }
    pair!(F32, F64, F16, BF16, I64, I32, U8, Bool);
    true
}

/// Hands `src`'s buffer to `dst` in place of copying it: `src` is a value no other tensor holds,
/// and both cover their whole (unpinned) host storages contiguously, with one dtype and shape.
/// `dst` keeps its storage (its views see the new values); its old buffer goes with `src`, back
/// to the host cache when `src` is dropped. False where that does not apply.
pub(crate) fn move_into(dst: &Tensor, src: &Tensor) -> bool {
    let whole = |t: &Tensor| {
        let st = t.storage();
        st.device == crate::Device::Cpu && !st.is_pinned() && t.is_contiguous() && t.storage_offset() == 0 && matches!(&*st.data.read_recursive(), BackendStorage::Cpu(s) if s.len() == t.numel())
    };
    if dst.dtype() != src.dtype() || dst.shape() != src.shape() || dst.shares_storage_with(src) || std::sync::Arc::strong_count(src.storage()) != 1 || !whole(dst) || !whole(src) {
        return false;
    }
    let (mut d, mut s) = (dst.storage().data.write(), src.storage().data.write());
    std::mem::swap(&mut *d, &mut *s);
    true
}

/// Writes row-major `src` (of the tensor's shape) into the tensor's strided elements, in place.
pub(crate) fn write_into(t: &Tensor, src: &CpuStorage) {
    let mut guard = t.storage().data.write();
    let BackendStorage::Cpu(dst) = &mut *guard else { unreachable!("CPU kernel on a CUDA tensor") };
    let layout = t.layout().clone();
    with_storage!(dst, d => {
        let d: &mut [_] = d;
        with_storage!(src, s => scatter_run(d, &layout, s))
    });
}

fn scatter_run<T: Elem, S: Elem>(dst: &mut [T], layout: &Layout, src: &[S]) {
    layout.for_each_run(0, layout.numel(), |pos, off, stride, len| {
        for k in 0..len {
            dst[off + k * stride] = src[pos + k].cast::<T>();
        }
    });
}


/// A contiguous copy of the tensor converted to `dtype`.
pub(crate) fn cast(x: &Tensor, dtype: DType) -> CpuStorage {
    with_dtype!(dtype, T => T::wrap(to_vec_as::<T>(x)))
}
