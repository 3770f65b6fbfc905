//! The device runtime: one context and stream per device, the caching allocator (`alloc`),
//! run-time compilation and the kernel cache (`nvrtc`), launches, copies, events and CUDA
//! graphs (`graph`).

pub(crate) mod alloc;
pub(crate) mod graph;
pub(crate) mod nvrtc;

use crate::{DType, Device, Error, Result};
use alloc::MemoryStats;
use nvrtc::KernelSource;
use crate::backend::cuda::device::alloc::{Block, CachingAllocator, RawAlloc};
use cudarc::driver::{result as dr, sys as ds, CudaContext, CudaStream};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// The functions one compiled kernel has loaded, each with what selects it (a launch shape, an
/// operand walk): a call after the first finds its function here without generating,
/// formatting or hashing a kernel description (host time that an idle device waits for). A
/// clone starts empty.
pub(crate) struct Loaded<T>(pub(crate) parking_lot::Mutex<Vec<T>>);

impl<T> Default for Loaded<T> {
    fn default() -> Self {
        Loaded(parking_lot::Mutex::new(Vec::new()))
    }
}

impl<T> Clone for Loaded<T> {
    fn clone(&self) -> Self {
        Loaded::default()
    }
}

impl<T> std::fmt::Debug for Loaded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} loaded", self.0.lock().len())
    }
}

/// Where a thread's device work goes (`CudaDevice::work`).
pub(crate) enum Work<'a> {
    /// Onto this stream.
    On(&'a Arc<CudaStream>),
    /// Nowhere: a rehearsal runs the host side of a program once, collecting the kernels it
    /// would load (`tuning::rehearsal`), and leaves the device alone.
    Rehearsal,
}

impl<'a> Work<'a> {
    /// The stream, or `None` in a rehearsal.
    pub(crate) fn stream(self) -> Option<&'a Arc<CudaStream>> {
        match self {
            Work::On(s) => Some(s),
            Work::Rehearsal => None,
        }
    }
}

/// A loaded kernel, its name, and whether it starts by waiting for the grids before it (so it
/// may be launched before they end: `waits_for_previous`). CUfunction handles are plain
/// pointers valid for the context's lifetime; so is the name (leaked once per compiled kernel,
/// for the profiler).
#[derive(Clone, Copy)]
pub(crate) struct Kernel(ds::CUfunction, pub(crate) &'static str, bool);
impl Kernel {
    /// What a rehearsal hands out for a kernel it has only noted: never launched.
    pub(crate) const REHEARSED: Kernel = Kernel(std::ptr::null_mut(), "rehearsed", false);

    /// Whether this is a rehearsal's placeholder (the real kernel is loaded on the first run).
    pub(crate) fn is_rehearsed(&self) -> bool {
        self.0.is_null()
    }
}
/// Whether every kernel function `src` defines starts with `KILN_AFTER_PREVIOUS();` (the
/// prelude's wait for the grids before it) or `KILN_WAIT_UNLESS_SETTLED(` (the same wait, after
/// loads of memory no running grid writes): only such a kernel may be launched before those
/// grids end (`KILN_PDL`). A source using `__ldg` may not: the compiler takes its loads as
/// invariant and may move them above the wait, reading what the grid before is still writing.
pub(crate) fn waits_for_previous(src: &str) -> bool {
    let mut kernels = src.match_indices("__global__").peekable();
    kernels.peek().is_some()
        && !src.contains("__ldg(")
        && kernels.all(|(at, _)| {
            src[at..].find('{').is_some_and(|open| {
                let body = src[at + open + 1..].trim_start();
                body.starts_with("KILN_AFTER_PREVIOUS();") || body.starts_with("KILN_WAIT_UNLESS_SETTLED(")
            })
        })
}

// SAFETY: a CUfunction may be launched from any thread that binds its context.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

/// What a kernel takes as its one parameter, by value: plain `#[repr(C)]` data (addresses,
/// sizes, scalars) of at most 4 KiB, declared alike in Rust and in the kernel's CUDA C.
///
/// # Safety
/// The type must be `#[repr(C)]` plain data whose layout the kernels' declaration matches.
pub(crate) unsafe trait KernelArgs: Copy {}

/// The word block of the generated kernels whose argument count varies (maps, fused rows,
/// optimiser updates): each generator says where its words sit (e.g. `MapSpec::words`) and
/// fills them by the same description it emits the kernel from.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LaunchArgs {
    pub w: [u64; 64],
}
impl Default for LaunchArgs {
    fn default() -> Self {
        LaunchArgs { w: [0; 64] }
    }
}
// SAFETY: `#[repr(C)]` plain words, declared as `struct LaunchArgs { u64 w[64]; }` in prelude.cu.
unsafe impl KernelArgs for LaunchArgs {}

/// Declares a kernel family's argument struct once: the `#[repr(C)]` Rust struct the host fills
/// by name, and `C_DECL`, the same struct in CUDA C, which the family's sources include and its
/// kernels read by name. Every field is eight bytes (`u64`, `i64` or `f64`, or an array of
/// them), so the two layouts cannot differ by padding.
macro_rules! kernel_args {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $field:ident : $rty:ident $([$n:literal])?),* $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        pub(crate) struct $name {
            $($(#[$fdoc])* pub(crate) $field: kernel_args!(@ty $rty $($n)?)),*
        }
        impl $name {
            /// This struct in CUDA C.
            pub(crate) const C_DECL: &'static str = concat!("struct ", stringify!($name), " {", $(" ", kernel_args!(@c $rty), " ", stringify!($field), $("[", stringify!($n), "]",)? ";",)* " };\n");
        }
        // SAFETY: `#[repr(C)]`, eight-byte fields only, declared alike in `C_DECL`.
        unsafe impl $crate::backend::cuda::device::KernelArgs for $name {}
    };
    (@ty $t:ident) => { $t };
    (@ty $t:ident $n:literal) => { [$t; $n] };
    (@c u64) => { "unsigned long long" };
    (@c i64) => { "long long" };
    (@c f64) => { "double" };
}
pub(crate) use kernel_args;

/// What identifies a compiled kernel in the per-device cache.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) enum KernelKey {
    Map(crate::backend::cuda::kernels::codegen::MapSpec),
    Reduce(crate::backend::cuda::kernels::codegen::ReduceSpec),
    /// Kernels whose name already encodes every parameter of their source.
    Named(String),
    /// A custom op's kernel: its source, function name and the C types its macros stand for.
    Custom { source: Arc<str>, name: Arc<str>, types: (&'static str, &'static str) },
}

struct DriverAlloc {
    ctx: Arc<CudaContext>,
}
impl RawAlloc for DriverAlloc {
    fn malloc(&mut self, bytes: usize) -> std::result::Result<u64, ()> {
        self.ctx.bind_to_thread().map_err(|_| ())?;
        // SAFETY: the context is current; the result is checked.
        unsafe { dr::malloc_sync(bytes) }.map_err(|_| ())
    }
    fn free(&mut self, ptr: u64) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from malloc_sync and is no longer handed out; the stream was
        // synchronised by `empty_cache` before cached blocks are freed.
        let _ = unsafe { dr::free_sync(ptr) };
    }
}

pub(crate) struct CudaDevice {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Host-to-device copies of `to_device_async` run here, ordered against `stream` by events.
    copy_stream: Arc<CudaStream>,
    /// CUDA graphs are captured here, so that other threads' work on `stream` is never caught
    /// in a capture (replays run on `stream`).
    pub(crate) capture_stream: Arc<CudaStream>,
    /// What in-flight async copies read (host buffers), kept alive until their event completes.
    pending: Mutex<Vec<(cudarc::driver::CudaEvent, Box<dyn Send>)>>,
    alloc: Mutex<CachingAllocator<DriverAlloc>>,
    kernels: Mutex<HashMap<KernelKey, Kernel>>,
    /// Zeroed u32 counters for one-launch split reductions (each kernel resets what it used):
    /// the newest last, every older set kept too (queued kernels and captured graphs use them).
    counters: Mutex<Vec<(Block, usize)>>,
    /// Modules stay loaded for the context's lifetime (their functions are cached above).
    modules: Mutex<Vec<usize>>,
    pub(crate) blas: Mutex<Option<crate::backend::cuda::libs::blas::Handle>>,
    /// The cuDNN handle and the convolution algorithms chosen per geometry.
    pub(crate) cudnn: Mutex<Option<crate::backend::cuda::libs::cudnn::State>>,
    /// Held for the whole of a CUDA graph's capture: captures on one device take turns.
    pub(crate) capture_turn: Mutex<()>,
    /// While a CUDA graph is being captured: the blocks it allocates (they belong to the graph).
    pub(crate) capture: Mutex<Option<crate::backend::cuda::device::graph::CapturePool>>,
    /// Blocks owned by live graphs (base -> size): the graph still reads and writes them at each
    /// replay, so a tensor over a piece of one that is dropped does not give it back to the
    /// allocator.
    pub(crate) graph_blocks: Mutex<std::collections::BTreeMap<u64, usize>>,
    /// Per function (by its handle): the dynamic shared memory it may use, as last raised.
    shared_allowed: Mutex<HashMap<usize, u32>>,
    pub(crate) arch: String,
    /// Compute capability 9.0 or later: programmatic dependent launch (`KILN_PDL`) exists.
    pub(crate) hopper: bool,
    pub(crate) sm_count: usize,
    /// Shared memory per SM in bytes (0 where the driver does not say).
    pub(crate) shared_per_sm: usize,
    pub(crate) driver: i32,
    /// The product name ("NVIDIA H200").
    name: String,
    /// What a timed choice on this device depends on besides the problem: the product, its
    /// architecture, the driver and NVRTC versions (max-autotune's keys start with it).
    pub(crate) tune_ident: String,
}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
static ALLOW_TF32: AtomicBool = AtomicBool::new(false);
static CUDNN_DETERMINISTIC: AtomicBool = AtomicBool::new(false);

fn driver_present() -> bool {
    // SAFETY: only probes whether the shared libraries can be loaded.
    unsafe { ds::is_culib_present() && cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether this process has opened device `n` (asking does not open it).
pub(crate) fn is_open(n: usize) -> bool {
    DEVICES.get().is_some_and(|m| m.lock().contains_key(&n))
}

/// Number of CUDA devices this process can use (0 without a driver).
pub fn device_count() -> usize {
    if !driver_present() || dr::init().is_err() {
        return 0;
    }
    CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

pub(crate) fn available(n: usize) -> bool {
    n < device_count()
}

fn cuda_err(op: &'static str, device: Device, e: impl std::fmt::Debug) -> Error {
    Error::Cuda { op, device, msg: format!("{e:?}") }
}

/// The device `n`, created on first use.
pub(crate) fn device(n: usize) -> Result<Arc<CudaDevice>> {
    let map = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(d) = map.lock().get(&n) {
        d.bind()?;
        return Ok(d.clone());
    }
    let dev = Device::Cuda(n);
    if !driver_present() {
        return Err(Error::DeviceUnavailable { op: "cuda", device: dev, msg: "no CUDA driver found (libcuda / libnvrtc could not be loaded)".into() });
    }
    let count = device_count();
    if n >= count {
        return Err(Error::DeviceUnavailable { op: "cuda", device: dev, msg: format!("this machine has {count} CUDA device(s)") });
    }
    let ctx = CudaContext::new(n).map_err(|e| cuda_err("context", dev, e))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| cuda_err("context", dev, e))?;
    let sm_count = ctx.attribute(ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| cuda_err("context", dev, e))? as usize;
    let shared_per_sm = ctx.attribute(ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR).map_or(0, |v| v.max(0) as usize);
    let mut driver = 0;
    // SAFETY: plain out-parameter.
    unsafe { ds::cuDriverGetVersion(&mut driver) };
    let name = ctx.name().map_err(|e| cuda_err("device name", dev, e))?;
    let stream = ctx.default_stream();
    let copy_stream = ctx.new_stream().map_err(|e| cuda_err("stream", dev, e))?;
    let capture_stream = ctx.new_stream().map_err(|e| cuda_err("stream", dev, e))?;
    let (nv_major, nv_minor) = crate::backend::cuda::device::nvrtc::nvrtc_version();
    let tune_ident = format!("{name}|sm_{major}{minor}|driver {driver}|nvrtc {nv_major}.{nv_minor}");
    let d = Arc::new(CudaDevice {
        copy_stream,
        capture_stream,
        pending: Mutex::new(Vec::new()),
        ordinal: n,
        alloc: Mutex::new(CachingAllocator::new(DriverAlloc { ctx: ctx.clone() })),
        ctx,
        stream,
        kernels: Mutex::new(HashMap::new()),
        counters: Mutex::new(Vec::new()),
        modules: Mutex::new(Vec::new()),
        blas: Mutex::new(None),
        cudnn: Mutex::new(None),
        capture_turn: Mutex::new(()),
        capture: Mutex::new(None),
        graph_blocks: Mutex::new(Default::default()),
        shared_allowed: Mutex::new(HashMap::new()),
        arch: format!("sm_{major}{minor}"),
        hopper: major >= 9,
        sm_count,
        shared_per_sm,
        driver,
        name,
        tune_ident,
    });
    map.lock().insert(n, d.clone());
    Ok(d)
}

impl CudaDevice {
    pub(crate) fn kiln_device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", self.kiln_device(), e))
    }

    pub(crate) fn err(&self, op: &'static str, e: impl std::fmt::Debug) -> Error {
        cuda_err(op, self.kiln_device(), e)
    }

    /// Where this thread's device work goes: nowhere in a rehearsal, onto the capture stream
    /// while this thread captures a graph on this device, else onto the device's stream. Every
    /// launch, copy and library call asks for it first.
    pub(crate) fn work(&self) -> Work<'_> {
        if crate::backend::cuda::tuning::rehearsal::active() {
            return Work::Rehearsal;
        }
        Work::On(if crate::backend::cuda::device::graph::capturing() == Some(self.ordinal) { &self.capture_stream } else { &self.stream })
    }

    /// A device buffer of `bytes`; out of memory is an error carrying the allocator's figures.
    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize) -> Result<Block> {
        if bytes == 0 || crate::backend::cuda::device::graph::capturing() != Some(self.ordinal) {
            return self.alloc_block(bytes);
        }
        // The step being captured writes whatever it is handed (so a later step given the
        // same memory waits for it).
        let b = match self.capture.lock().as_mut() {
            Some(pool) => match pool.take(bytes) {
                Some(b) => b,
                None => {
                    let b = self.alloc_block(bytes)?;
                    self.graph_blocks.lock().insert(b.ptr, b.size);
                    pool.adopt(b, bytes)
                }
            },
            None => self.alloc_block(bytes)?,
        };
        crate::backend::cuda::device::graph::note_alloc(b.ptr, b.size);
        Ok(b)
    }

    pub(crate) fn alloc_block(self: &Arc<Self>, bytes: usize) -> Result<Block> {
        let mut a = self.alloc.lock();
        let b = a.alloc(bytes).map_err(|oom| Error::OutOfMemory { device: self.kiln_device(), msg: oom.to_string() })?;
        crate::profiler::memory(self.ordinal, b.size as i64, || a.stats().allocated);
        Ok(b)
    }

    pub(crate) fn free(&self, block: Block) {
        let owned_by_graph = self.graph_blocks.lock().range(..=block.ptr).next_back().is_some_and(|(&base, &size)| block.ptr < base + size as u64);
        if owned_by_graph {
            // Inside a capture the block is free for the graph's later steps; after it, the
            // graph keeps it.
            if crate::backend::cuda::device::graph::capturing() == Some(self.ordinal) {
                if let Some(pool) = self.capture.lock().as_mut() {
                    pool.give_back(block);
                }
            }
            return;
        }
        self.release(block);
    }

    /// Returns a block to the caching allocator.
    pub(crate) fn release(&self, block: Block) {
        let mut a = self.alloc.lock();
        a.free(block);
        crate::profiler::memory(self.ordinal, -(block.size as i64), || a.stats().allocated);
    }

    /// At least `n` zeroed u32 counters, kept for the device's lifetime (shared by every
    /// column reduction: a captured graph keeps those in order).
    ///
    /// They never come from a capture's pool, and a larger set does not free the older one:
    /// graphs captured before may replay with it at any time.
    pub(crate) fn reduce_counters(self: &Arc<Self>, n: usize) -> Result<u64> {
        crate::backend::cuda::device::graph::note_shared_scratch();
        let mut c = self.counters.lock();
        if let Some(&(b, len)) = c.last() {
            if len >= n {
                return Ok(b.ptr);
            }
        }
        let len = n.max(1 << 14).next_power_of_two();
        let b = self.alloc_block(len * 4)?;
        // Zeroed for real before any kernel can use them (a capture in progress on this thread
        // must not take the memset into its graph): on the copy stream, waited for. Rare. The
        // copy stream first waits for work queued on the device's stream, which may still
        // write the block's last owner's data (the allocator reuses blocks in that order).
        self.bind()?;
        self.copy_stream.join(&self.stream).map_err(|e| self.err("stream wait", e))?;
        // SAFETY: a fresh block of len * 4 bytes.
        unsafe { dr::memset_d8_async(b.ptr, 0, len * 4, self.copy_stream.cu_stream()) }.map_err(|e| self.err("memset", e))?;
        self.copy_stream.synchronize().map_err(|e| self.err("synchronize", e))?;
        c.push((b, len));
        Ok(b.ptr)
    }

    /// The compiled kernel for `key`, generating (`gen` gives name and source) and compiling on
    /// first use.
    pub(crate) fn kernel(&self, key: KernelKey, gen: impl FnOnce() -> (String, String)) -> Result<Kernel> {
        self.kernel_with(key, &[], gen)
    }

    /// `kernel` compiled with extra NVRTC `options` (which `key` must determine).
    pub(crate) fn kernel_with(&self, key: KernelKey, options: &[String], gen: impl FnOnce() -> (String, String)) -> Result<Kernel> {
        if let Some(k) = self.kernels.lock().get(&key) {
            return Ok(*k);
        }
        // A kernel a rehearsal has already noted is not generated (or counted) again.
        let rehearsal = matches!(self.work(), Work::Rehearsal);
        if rehearsal && crate::backend::cuda::tuning::rehearsal::wanted(&key) {
            return Ok(Kernel::REHEARSED);
        }
        let (name, src) = gen();
        LOADS.with(|c| c.set(c.get() + 1));
        crate::logging::log(crate::logging::Topic::Kernels, || format!("{name} ({}):\n{src}", self.arch));
        if rehearsal {
            return crate::backend::cuda::tuning::rehearsal::want(self, key, name, src, options);
        }
        let ours = !matches!(key, KernelKey::Custom { .. });
        let started = std::time::Instant::now();
        let cubin = crate::backend::cuda::device::nvrtc::cubin(&src, options, ours, &self.arch, self.driver, self.kiln_device())?;
        let waits = ours && waits_for_previous(&src);
        self.install(key, name, cubin, started.elapsed(), waits)
    }

    /// Loads a kernel's cubin (`took`: how long finding or compiling it took) and keeps it
    /// under `key`; `waits`: `waits_for_previous` of its source.
    pub(crate) fn install(&self, key: KernelKey, name: String, (cubin, from): (Vec<u8>, KernelSource), took: std::time::Duration, waits: bool) -> Result<Kernel> {
        let started = std::time::Instant::now();
        self.bind()?;
        // SAFETY: `cubin` is a complete image for this device's architecture.
        let module = unsafe { dr::module::load_data(cubin.as_ptr() as *const _) }.map_err(|e| self.err("load module", e))?;
        crate::logging::log(crate::logging::Topic::Kernels, || {
            let how = match from {
                KernelSource::Compiled => "compiled by NVRTC",
                KernelSource::DiskCache => "read from the disk cache",
            };
            format!("{name}: {how} in {:.1} ms, loaded in {:.1} ms", took.as_secs_f64() * 1e3, started.elapsed().as_secs_f64() * 1e3)
        });
        let cname = std::ffi::CString::new(name.clone()).expect("kernel names have no NUL");
        // SAFETY: the module was just loaded and names this function.
        let f = unsafe { dr::module::get_function(module, cname) }.map_err(|e| self.err("get function", e))?;
        self.modules.lock().push(module as usize);
        let k = Kernel(f, Box::leak(name.into_boxed_str()), waits);
        self.kernels.lock().insert(key, k);
        Ok(k)
    }

    /// The sizes of `k`'s parameters as the driver reports them (CUDA 12.4 and later); empty
    /// where it cannot tell.
    pub(crate) fn param_sizes(&self, k: Kernel) -> Vec<usize> {
        let mut sizes = vec![];
        if self.driver < 12040 {
            return sizes;
        }
        loop {
            let (mut offset, mut size) = (0usize, 0usize);
            // SAFETY: plain out-parameters; an index past the last parameter is an error.
            if unsafe { ds::cuFuncGetParamInfo(k.0, sizes.len(), &mut offset, &mut size) }.result().is_err() {
                break;
            }
            sizes.push(size);
        }
        sizes
    }

    /// Launches `k` on the device's stream with the argument block `args`.
    pub(crate) fn launch<A: KernelArgs>(&self, k: Kernel, grid: (u32, u32, u32), block: (u32, u32, u32), args: &A) -> Result<()> {
        self.launch_shared(k, grid, block, 0, args)
    }

    /// `launch` with `shared` bytes of dynamic shared memory.
    pub(crate) fn launch_shared<A: KernelArgs>(&self, k: Kernel, grid: (u32, u32, u32), block: (u32, u32, u32), shared: u32, args: &A) -> Result<()> {
        const { assert!(std::mem::size_of::<A>() <= 4096, "a kernel parameter holds at most 4 KiB") };
        self.allow_shared(k, shared)?;
        let mut a = *args;
        let mut params = [&mut a as *mut A as *mut std::ffi::c_void];
        // SAFETY: every kernel takes exactly one argument struct by value (`KernelArgs`); the pointers inside
        // point to live device buffers kept alive by the tensors of the calling op, and buffers
        // are only reused in stream order.
        unsafe { self.launch_params(k, grid, block, shared, &mut params) }
    }

    /// Lets `k` use `bytes` of dynamic shared memory: above `SHARED_WITHOUT_OPT_IN` a kernel
    /// must opt in. The limit only rises: one function launched with less after more (a row
    /// kernel over shorter rows) keeps what a CUDA graph captured with the larger launch needs.
    pub(crate) fn allow_shared(&self, k: Kernel, bytes: u32) -> Result<()> {
        if bytes as usize <= SHARED_WITHOUT_OPT_IN || k.0.is_null() {
            return Ok(());
        }
        let mut allowed = self.shared_allowed.lock();
        let now = allowed.entry(k.0 as usize).or_insert(0);
        if *now >= bytes {
            return Ok(());
        }
        let attr = ds::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: a loaded function of this device's context.
        unsafe { ds::cuFuncSetAttribute(k.0, attr, bytes as i32) }.result().map_err(|e| self.err("shared memory size", e))?;
        *now = bytes;
        Ok(())
    }

    /// Launches `k` with `shared` bytes of dynamic shared memory and one pointer per kernel
    /// parameter; the profiler records it and `launch_count` counts it.
    ///
    /// # Safety
    /// `params` must match the kernel's parameters in number and size, and device pointers
    /// among them must stay valid until the kernel has run (stream order).
    pub(crate) unsafe fn launch_params(&self, k: Kernel, grid: (u32, u32, u32), block: (u32, u32, u32), shared: u32, params: &mut [*mut std::ffi::c_void]) -> Result<()> {
        let Work::On(stream) = self.work() else { return Ok(()) };
        let _rec = crate::profiler::kernel(self, k.1, grid, block);
        if k.2 && self.hopper && crate::switches::pdl() {
            // Programmatic dependent launch: the kernel's blocks may start while the grid
            // before it runs; its first instruction waits for that grid to end and its writes
            // to be visible (`KILN_AFTER_PREVIOUS`), so it reads nothing early. A captured
            // launch becomes a programmatic edge of the graph.
            // SAFETY: all-zero is a valid value of this plain C struct (its id and union).
            let mut attr: ds::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = ds::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = ds::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: shared,
                hStream: stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: the caller's contract; `config` and `attr` live across the call.
            unsafe { ds::cuLaunchKernelEx(&config, k.0, params.as_mut_ptr(), std::ptr::null_mut()) }.result().map_err(|e| self.err("launch", e))?;
        } else {
            // SAFETY: the caller's contract.
            unsafe { dr::launch_kernel(k.0, grid, block, shared, stream.cu_stream(), params) }.map_err(|e| self.err("launch", e))?;
        }
        LAUNCHES.with(|c| c.set(c.get() + 1));
        Ok(())
    }

    /// Waits for the device, then reports a bad index a kernel found since the last check.
    /// `what` and the caller's location are what sync debug mode and the profiler report.
    #[track_caller]
    pub(crate) fn synchronize(&self, what: &'static str) -> Result<()> {
        let _rec = crate::profiler::sync(what, self.kiln_device(), std::panic::Location::caller())?;
        self.bind()?;
        self.stream.synchronize().map_err(|e| self.err("synchronize", e))?;
        self.copy_stream.synchronize().map_err(|e| self.err("synchronize", e))?;
        // Not `clear`: another thread may have queued a copy since the waits above.
        self.pending.lock().retain(|(e, _)| !e.is_complete());
        let own = ERROR_WORDS.with(|w| w.borrow().0.get(&self.ordinal).map_or(Ok(()), |w| w.take()));
        // Then the words of the graphs this thread replayed since its last synchronisation.
        let replayed = REPLAYED.with(|r| {
            let mut r = r.borrow_mut();
            let mine = r.iter().filter(|(d, _)| *d == self.ordinal).map(|(_, w)| w.take()).collect::<Vec<_>>();
            r.retain(|(d, _)| *d != self.ordinal);
            mine
        });
        replayed.into_iter().fold(own, |first, r| first.and(r))
    }

    /// The device address where this thread's kernels report bad indices: each thread has its
    /// own, so an error reaches the thread that launched the op, at its next synchronisation.
    /// While the thread captures a CUDA graph, the graph's own word instead: an error in a
    /// replay reaches the thread that replayed it.
    pub(crate) fn error_word(&self) -> Result<u64> {
        if let Some(p) = crate::backend::cuda::device::graph::capture_error_word(self.ordinal) {
            return Ok(p);
        }
        ERROR_WORDS.with(|w| {
            let mut w = w.borrow_mut();
            if let Some(e) = w.0.get(&self.ordinal) {
                return Ok(e.dev_ptr);
            }
            let e = self.new_error_word()?;
            let p = e.dev_ptr;
            w.0.insert(self.ordinal, e);
            Ok(p)
        })
    }

    /// A cleared error word: a spare one no kernel can still write into (its last user's
    /// kernels have all run, and no thread still means to read it), else a new one.
    pub(crate) fn new_error_word(&self) -> Result<Arc<ErrorWord>> {
        let spare = {
            let mut spare = SPARE_WORDS.lock();
            let done = |(d, w, after): &(usize, Arc<ErrorWord>, Option<cudarc::driver::CudaEvent>)| {
                *d == self.ordinal && Arc::strong_count(w) == 1 && after.as_ref().is_some_and(|e| e.is_complete())
            };
            spare.iter().position(done).map(|i| spare.swap_remove(i).1)
        };
        match spare {
            Some(e) => {
                e.clear();
                Ok(e)
            }
            None => {
                self.bind()?;
                Ok(Arc::new(ErrorWord::new().map_err(|e| self.err("error word", e))?))
            }
        }
    }

    /// Gives an error word back for later reuse, once the work queued so far has run.
    pub(crate) fn retire_error_word(&self, w: Arc<ErrorWord>) {
        let after = self.stream.record_event(None).ok();
        SPARE_WORDS.lock().push((self.ordinal, w, after));
    }

    /// Copies `bytes` from host memory at `src` (pinned, and kept alive by `keep` until the copy
    /// is done) into `dst`, without waiting: the copy stream first waits for work already queued
    /// (which may still use `dst`'s recycled block), and later work waits for the copy.
    pub(crate) fn upload_async(&self, dst: u64, src: *const u8, bytes: usize, keep: Box<dyn Send>) -> Result<()> {
        self.bind()?;
        self.pending.lock().retain(|(e, _)| !e.is_complete());
        self.copy_stream.join(&self.stream).map_err(|e| self.err("stream wait", e))?;
        // SAFETY: `src` points to `bytes` of pinned host memory that `keep` keeps alive until the
        // event below completes; `dst` is a device block of at least `bytes`.
        let host = unsafe { std::slice::from_raw_parts(src, bytes) };
        let _rec = crate::profiler::copy(self, &self.copy_stream, crate::profiler::CopyKind::HostToDevice, bytes);
        unsafe { dr::memcpy_htod_async(dst, host, self.copy_stream.cu_stream()) }.map_err(|e| self.err("copy to device", e))?;
        let done = self.copy_stream.record_event(None).map_err(|e| self.err("event", e))?;
        self.stream.wait(&done).map_err(|e| self.err("stream wait", e))?;
        self.pending.lock().push((done, keep));
        Ok(())
    }
}

/// Device memory of one tensor storage; returned to the device's cache when dropped.
pub(crate) struct CudaStorage {
    pub(crate) dev: Arc<CudaDevice>,
    pub(crate) block: Block,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    /// What the op that wrote this storage kept beside it for its backward, living and dying
    /// with it: an attention output's per-row log-sum-exp (F32 `[B, H, L]`), so that its
    /// backward need not recompute it.
    pub(crate) aux: Option<Box<CudaStorage>>,
}

impl CudaStorage {
    pub(crate) fn new(dev: &Arc<CudaDevice>, dtype: DType, len: usize) -> Result<CudaStorage> {
        let block = dev.alloc(len * dtype.size_in_bytes())?;
        Ok(CudaStorage { dev: dev.clone(), block, dtype, len, aux: None })
    }
    pub(crate) fn ptr(&self) -> u64 {
        self.block.ptr
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        self.dev.free(self.block);
    }
}

fn cuda_device(op: &'static str, which: &Device) -> Result<Arc<CudaDevice>> {
    match which {
        Device::Cuda(n) => device(*n),
        Device::Cpu => Err(Error::arg(op, "expected a CUDA device, got the CPU")),
    }
}

/// The device's product name ("NVIDIA H200").
pub fn device_name(device: &Device) -> Result<String> {
    Ok(cuda_device("device_name", device)?.name.clone())
}

/// Waits for all work queued on `device` (`torch.cuda.synchronize`). On the CPU there is
/// nothing to wait for, but the call is still reported by sync debug mode and the profiler, so
/// code run on a CPU machine shows where it will wait on a GPU.
#[track_caller]
pub fn synchronize(device: &Device) -> Result<()> {
    match device {
        Device::Cpu => crate::profiler::sync("synchronize", *device, std::panic::Location::caller()).map(drop),
        Device::Cuda(n) => self::device(*n)?.synchronize("synchronize"),
    }
}

/// The caching allocator's figures for `device`.
pub fn memory_stats(device: &Device) -> Result<MemoryStats> {
    Ok(cuda_device("memory_stats", device)?.alloc.lock().stats())
}

/// Restarts peak tracking at the current figures.
pub fn reset_peak_memory_stats(device: &Device) -> Result<()> {
    cuda_device("reset_peak_memory_stats", device)?.alloc.lock().reset_peak_stats();
    Ok(())
}

/// Returns cached, unused blocks to the device (after the queued work that may use them).
#[track_caller]
pub fn empty_cache(device: &Device) -> Result<()> {
    let d = cuda_device("empty_cache", device)?;
    d.synchronize("empty_cache")?;
    d.alloc.lock().empty_cache();
    Ok(())
}

thread_local! {
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static LOADS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Adds `n` kernels to this thread's launch count (a graph replay runs its captured kernels).
pub(crate) fn count_launches(n: u64) {
    LAUNCHES.with(|c| c.set(c.get() + n));
}

/// Kernels this thread needed that were not yet in the device's in-memory cache (generated,
/// then compiled or read from the disk cache). Per thread, like `launch_count`.
pub fn kernels_loaded() -> u64 {
    LOADS.with(|c| c.get())
}

/// Kernels this thread has launched so far, on any device (eager ops and compiled code alike);
/// memsets and copies are not kernels. Per thread, so concurrent work elsewhere does not count.
pub fn launch_count() -> u64 {
    LAUNCHES.with(|c| c.get())
}

/// Lets F32 matrix products and convolutions use TF32 tensor cores (PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32` in one);
/// off by default, so F32 products and convolutions are full precision.
pub fn set_allow_tf32(allow: bool) {
    ALLOW_TF32.store(allow, Ordering::Relaxed);
}
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

/// Restricts cuDNN's convolutions to algorithms that give the same bits on every run
/// (PyTorch's `torch.backends.cudnn.deterministic`), for the whole process; off by default,
/// when cuDNN may pick algorithms that add partial results with atomics, in whatever order they
/// land. Kiln's own kernels are deterministic except `scatter_add` (and what uses it:
/// `index_select`'s and `gather`'s gradients with repeated indices).
pub fn set_cudnn_deterministic(on: bool) {
    CUDNN_DETERMINISTIC.store(on, Ordering::Relaxed);
}
pub fn cudnn_deterministic() -> bool {
    CUDNN_DETERMINISTIC.load(Ordering::Relaxed)
}

/// The version of the cuDNN library convolutions run through (`cudnnGetVersion`, e.g. 91000
/// for 9.10.0), or why it cannot be used: then CUDA convolutions run as im2col + matmul.
pub fn cudnn_version() -> std::result::Result<usize, String> {
    crate::backend::cuda::libs::cudnn::library()
}

/// The directory generated kernels are cached in across processes.
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    crate::backend::cuda::device::nvrtc::cache_dir()
}

/// Three i64 words of mapped host memory that kernels set on an out-of-range index:
/// [which op (an `INDEX_OPS` position + 1), the index, the size]. Only the first error is kept.
/// Allocated once and kept for the process's lifetime (see `ThreadWords`).
pub(crate) struct ErrorWord {
    host: *mut i64,
    dev_ptr: u64,
}
// SAFETY: the words are only read after a synchronisation, and reset by the reader.
unsafe impl Send for ErrorWord {}
unsafe impl Sync for ErrorWord {}

/// A thread's error words, by device. When the thread ends they go to `SPARE_WORDS` for the
/// next thread, never back to the driver: freeing page-locked memory would wait for the whole
/// device, which breaks a capture another thread has in progress.
struct ThreadWords(HashMap<usize, Arc<ErrorWord>>);

impl Drop for ThreadWords {
    fn drop(&mut self) {
        // The thread's last kernels may still report into them: retired behind them.
        for (d, w) in self.0.drain() {
            match DEVICES.get().and_then(|m| m.lock().get(&d).cloned()) {
                Some(dev) => dev.retire_error_word(w),
                None => SPARE_WORDS.lock().push((d, w, None)),
            }
        }
    }
}

/// Error words of threads that ended and of graphs dropped, each with an event its last
/// kernels came before (None where it could not be recorded: never handed out again).
type SpareWord = (usize, Arc<ErrorWord>, Option<cudarc::driver::CudaEvent>);
static SPARE_WORDS: Mutex<Vec<SpareWord>> = Mutex::new(Vec::new());

thread_local! {
    static ERROR_WORDS: std::cell::RefCell<ThreadWords> = std::cell::RefCell::new(ThreadWords(HashMap::new()));
    /// The error words of the graphs this thread replayed since its last synchronisation, by
    /// device: read there beside its own.
    static REPLAYED: std::cell::RefCell<Vec<(usize, Arc<ErrorWord>)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Notes that this thread replayed a graph whose kernels report into `w`.
pub(crate) fn note_replayed_word(ordinal: usize, w: &Arc<ErrorWord>) {
    REPLAYED.with(|r| {
        let mut r = r.borrow_mut();
        if !r.iter().any(|(d, x)| *d == ordinal && Arc::ptr_eq(x, w)) {
            r.push((ordinal, w.clone()));
        }
    });
}

/// Shared memory a block may use without opting in: all of a kernel's static shared memory,
/// and dynamic shared memory below `CudaDevice::allow_shared`.
pub(crate) const SHARED_WITHOUT_OPT_IN: usize = 48 * 1024;

/// Ops whose kernels report bad indices, by code.
pub(crate) const INDEX_OPS: [&str; 4] = ["gather", "index_select", "scatter_add", "scatter"];

impl ErrorWord {
    fn new() -> std::result::Result<ErrorWord, ds::CUresult> {
        // SAFETY: a fresh mapped allocation (flag 2 = CU_MEMHOSTALLOC_DEVICEMAP), zeroed before use.
        unsafe {
            let host = dr::malloc_host(24, 2).map_err(|e| e.0)? as *mut i64;
            std::ptr::write_bytes(host, 0, 3);
            let mut dev_ptr = 0;
            ds::cuMemHostGetDevicePointer_v2(&mut dev_ptr, host as *mut _, 0).result().map_err(|e| e.0)?;
            Ok(ErrorWord { host, dev_ptr })
        }
    }
    /// Forgets an error its last user (an ended thread, a dropped graph) never read.
    fn clear(&self) {
        // SAFETY: three live words; volatile, as the device writes them behind the compiler's back.
        unsafe { (0..3).for_each(|i| std::ptr::write_volatile(self.host.add(i), 0)) }
    }
    fn take(&self) -> Result<()> {
        // SAFETY: the device finished writing (the caller synchronised); volatile, as the device
        // wrote behind the compiler's back.
        unsafe {
            let code = std::ptr::read_volatile(self.host);
            if code == 0 {
                return Ok(());
            }
            let (index, size) = (std::ptr::read_volatile(self.host.add(1)), std::ptr::read_volatile(self.host.add(2)));
            std::ptr::write_volatile(self.host, 0);
            let op = INDEX_OPS.get((code - 1) as usize).copied().unwrap_or("index");
            Err(Error::Index { op, index, size: size as usize })
        }
    }
}

/// Page-locked host memory (for staging asynchronous copies), freed on drop.
pub(crate) struct PinnedBuffer {
    pub(crate) ptr: *mut u8,
}
// SAFETY: plain host memory owned by this value.
unsafe impl Send for PinnedBuffer {}
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn new(dev: &CudaDevice, bytes: usize) -> Result<PinnedBuffer> {
        dev.bind()?;
        // SAFETY: a plain allocation; checked below.
        let ptr = unsafe { dr::malloc_host(bytes.max(1), 0) }.map_err(|e| dev.err("pinned host allocation", e))? as *mut u8;
        Ok(PinnedBuffer { ptr })
    }
}
impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host; no copy reads it any more (callers keep it alive
        // until their copy's event completed).
        let _ = unsafe { dr::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Page-locks `bytes` of existing host memory at `ptr` for fast asynchronous copies
/// (`pin_memory`); `unpin` undoes it.
pub(crate) fn pin(ptr: *const u8, bytes: usize) -> Result<()> {
    let dev = device(0)?;
    dev.bind()?;
    // SAFETY: `ptr..ptr+bytes` is a live allocation that stays put until `unpin`.
    // Flag 1 = CU_MEMHOSTREGISTER_PORTABLE: pinned for every context.
    unsafe { ds::cuMemHostRegister_v2(ptr as *mut _, bytes, 1) }.result().map_err(|e| dev.err("cuMemHostRegister", e))
}
pub(crate) fn unpin(ptr: *const u8) {
    // SAFETY: registered by `pin`.
    let _ = unsafe { ds::cuMemHostUnregister(ptr as *mut _) };
}

/// A point in a device's stream, for timing work on the device (`torch.cuda.Event`).
pub struct Event {
    event: cudarc::driver::CudaEvent,
    dev: Arc<CudaDevice>,
}

impl Event {
    /// Records an event after the work queued so far on `device`.
    pub fn record(device: &Device) -> Result<Event> {
        let dev = cuda_device("Event::record", device)?;
        let event = dev.ctx.new_event(Some(ds::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| dev.err("event", e))?;
        event.record(&dev.stream).map_err(|e| dev.err("event record", e))?;
        Ok(Event { event, dev })
    }
    /// Milliseconds of device time from `self` to `end`; waits for `end`.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        end.event.synchronize().map_err(|e| self.dev.err("event synchronize", e))?;
        Ok(self.event.elapsed_ms(&end.event).map_err(|e| self.dev.err("event elapsed", e))? as f64)
    }
    /// Median device time (ms) of `iters` calls of `f` after `warmup` untimed ones, each call
    /// between two events on `device` (the shared bench times 30 after 5). A call's result is
    /// dropped after its end event, so freeing it is not timed.
    pub fn median_ms<T>(device: &Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
        for _ in 0..warmup {
            f()?;
        }
        let mut ts = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            let s = Event::record(device)?;
            let out = f()?;
            let e = Event::record(device)?;
            ts.push(s.elapsed_ms(&e)?);
            drop(out);
        }
        ts.sort_by(|a, b| a.total_cmp(b));
        Ok(ts[ts.len() / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::waits_for_previous;
    use crate::backend::cuda::kernels::codegen;
    use crate::DType;

    #[test]
    fn only_kernels_that_all_start_by_waiting_may_start_early() {
        let k = |body: &str| format!("extern \"C\" __global__ void k(const LaunchArgs a) {{\n  {body}\n}}\n");
        assert!(waits_for_previous(&k("KILN_AFTER_PREVIOUS();\n  out[0] = 1;")));
        assert!(waits_for_previous(&k("KILN_WAIT_UNLESS_SETTLED(a.settled);\n  w = W[0];\n  KILN_WAIT_IF_SETTLED(a.settled);")));
        assert!(!waits_for_previous(&k("out[0] = 1;\n  KILN_AFTER_PREVIOUS();")), "a read before the wait");
        assert!(!waits_for_previous(&format!("{}{}", k("KILN_AFTER_PREVIOUS();"), k("out[0] = 1;"))), "one kernel of two does not wait");
        assert!(!waits_for_previous(&k("KILN_AFTER_PREVIOUS();\n  out[0] = __ldg(x);")), "an __ldg load may move above the wait");
        assert!(!waits_for_previous("// no kernel here: KILN_AFTER_PREVIOUS();"));
        // The generators' kernels wait (their launches may then start early under KILN_PDL).
        for (_, src) in [codegen::gen_gather(DType::BF16, 4, 2), codegen::gen_scatter(DType::BF16, 5, 3, None), codegen::gen_int_bmm(DType::I64)] {
            assert!(waits_for_previous(&src), "{src}");
        }
    }
}
