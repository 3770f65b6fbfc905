//! Fused kernels on the CPU as native code: their C (`cgen`) compiled by the system's C
//! compiler into a shared library, loaded, and run over chunks of the kernel's space on the
//! rayon pool. Libraries are cached on disk beside the CUDA kernels (`<cache>/cpu/`), keyed by
//! the source, the compiler and the CPU. Where there is no compiler, a kernel has no C form or
//! its inputs have layouts the code does not walk, `fused::run` interprets the kernel instead.
//! `KILN_CPU_CODEGEN` chooses: `c` (always), `interpret` (never), unset: C for kernels of at
//! least `MIN_ELEMENTS` values (smaller ones are not worth a compile).

use super::cgen::{self, Walk};
use super::{pool, with_dtype, with_storage, CpuStorage, HostBuf};
use crate::kir::{FusedKernel, Space};
use crate::storage::BackendStorage;
use crate::{DType, Result, Tensor};
use parking_lot::Mutex;
use rayon::prelude::*;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Kernels smaller than this run in the interpreter unless C is forced.
pub(crate) const MIN_ELEMENTS: usize = 1 << 8;
/// Elements per task of a flat kernel (rows per task: about as many values).
const CHUNK: usize = 1 << 14;

/// Which engine runs the compiler's fused kernels on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuCodegen {
    /// C where a compiler is found, for kernels of at least 256 values (the default).
    Auto,
    /// C for every kernel it covers.
    C,
    /// The interpreter always.
    Interpret,
}

thread_local! {
    static CHOICE: std::cell::Cell<Option<CpuCodegen>> = const { std::cell::Cell::new(None) };
}

/// Sets the engine for fused CPU kernels run by this thread (None: `KILN_CPU_CODEGEN`, else
/// `Auto`); returns the previous setting.
pub fn set_cpu_codegen(c: Option<CpuCodegen>) -> Option<CpuCodegen> {
    CHOICE.with(|x| x.replace(c))
}

fn choice() -> CpuCodegen {
    CHOICE.with(|x| x.get()).unwrap_or_else(|| match crate::switches::cpu_codegen() {
        Some("c") => CpuCodegen::C,
        Some("interpret") => CpuCodegen::Interpret,
        _ => CpuCodegen::Auto,
    })
}

static COMPILED: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);
thread_local! {
    /// (native, interpreted) kernel runs by this thread (as the engine is chosen per thread).
    static RUNS: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// What ran the CPU's fused kernels: libraries built and loaded in this process, and the
/// kernel runs of the calling thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuCodegenCounts {
    /// Libraries built by the C compiler.
    pub compiled: u64,
    /// Libraries loaded from the disk cache.
    pub disk_hits: u64,
    /// Kernel runs as native code, by this thread.
    pub native_runs: u64,
    /// Kernel runs by the interpreter, by this thread.
    pub interpreted_runs: u64,
}

pub fn cpu_codegen_counts() -> CpuCodegenCounts {
    let (native_runs, interpreted_runs) = RUNS.with(|r| r.get());
    CpuCodegenCounts { compiled: COMPILED.load(Ordering::Relaxed), disk_hits: DISK_HITS.load(Ordering::Relaxed), native_runs, interpreted_runs }
}

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Why the last kernel that could not be built as native code was not (no compiler, a
/// compiler error), if one was not.
pub fn cpu_codegen_error() -> Option<String> {
    LAST_ERROR.lock().clone()
}

pub(crate) fn count_interpreted() {
    RUNS.with(|r| r.set((r.get().0, r.get().1 + 1)));
}

type FlatFn = unsafe extern "C" fn(i64, *const *const u8, *const i64, *const *mut u8, *mut u8) -> i32;
type RowsFn = unsafe extern "C" fn(i64, i64, i64, *const *const u8, *const i64, *const *mut u8, *mut u8) -> i32;

/// A loaded kernel (its library is kept loaded for the process), and the scratch bytes per
/// column a row kernel's task needs.
#[derive(Clone, Copy)]
struct Native {
    sym: usize,
    scratch_per_col: usize,
}

/// Per kernel: its loaded variants by input walks (None: it could not be built).
#[derive(Default)]
pub(crate) struct Memo {
    variants: Mutex<Vec<(Vec<Walk>, Option<Native>)>>,
}

/// The compiler command and what identifies it and this CPU in cache keys; None without one.
fn compiler() -> Option<&'static (String, String)> {
    static C: OnceLock<Option<(String, String)>> = OnceLock::new();
    C.get_or_init(|| {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let Some(out) = std::process::Command::new(&cc).arg("--version").output().ok().filter(|o| o.status.success()) else {
            // Said once, whatever KILN_LOG holds: every compiled CPU kernel is slower from here.
            crate::logging::warn(crate::logging::Topic::Kernels, &format!("no C compiler ({cc} --version failed; set CC): compiled CPU kernels run in the interpreter, with the same results"));
            return None;
        };
        let version = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string();
        let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(str::to_string)).unwrap_or_default();
        Some((cc, format!("{version}\n{cpu}")))
    })
    .as_ref()
}

const FLAGS: [&str; 8] = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=gnu11"];

fn cache_dir() -> PathBuf {
    crate::backend::cuda::device::nvrtc::cache_dir().map(|d| d.join("cpu")).unwrap_or_else(|| std::env::temp_dir().join("kiln-cpu-kernels"))
}

/// Builds (or finds on disk) and loads the library of `src`, returning its `cgen::SYMBOL`.
/// `name` (the kernel's) is for the log.
fn build(src: &str, name: &str) -> std::result::Result<Native, String> {
    let (cc, ident) = compiler().ok_or("no C compiler (set CC)")?;
    let key = format!("{:016x}", crate::hash::fnv64(&[src.as_bytes(), ident.as_bytes(), FLAGS.join(" ").as_bytes()]));
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let lib_path = dir.join(format!("{key}.so"));
    if lib_path.exists() {
        DISK_HITS.fetch_add(1, Ordering::Relaxed);
    } else {
        // Written beside its final name and renamed there, so another process never loads a
        // library half written.
        let tmp = dir.join(format!("{key}.{}.{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], ""));
        let c_path = tmp.with_extension("c");
        std::fs::write(&c_path, src).map_err(|e| format!("{}: {e}", c_path.display()))?;
        let so_tmp = tmp.with_extension("so");
        let out = std::process::Command::new(cc).args(FLAGS).arg("-o").arg(&so_tmp).arg(&c_path).arg("-lm").output().map_err(|e| format!("{cc}: {e}"))?;
        // The source stays beside its library, for reading.
        let _ = std::fs::rename(&c_path, dir.join(format!("{key}.c")));
        if !out.status.success() {
            return Err(format!("{cc} failed: {}", String::from_utf8_lossy(&out.stderr).lines().take(5).collect::<Vec<_>>().join(" / ")));
        }
        std::fs::rename(&so_tmp, &lib_path).map_err(|e| format!("{}: {e}", lib_path.display()))?;
        COMPILED.fetch_add(1, Ordering::Relaxed);
        crate::logging::log(crate::logging::Topic::Kernels, || format!("{name}: compiled for the CPU by {cc} ({})", dir.join(format!("{key}.c")).display()));
    }
    // SAFETY: the library is one this module generated: no initialisers beyond the C runtime's.
    let lib = unsafe { libloading::Library::new(&lib_path) }.map_err(|e| format!("{}: {e}", lib_path.display()))?;
    // SAFETY: the symbol is the kernel function `cgen::source` exports.
    let sym = unsafe { lib.get::<unsafe extern "C" fn()>(cgen::SYMBOL.as_bytes()) }.map_err(|e| format!("{name}: {e}"))?;
    let native = Native { sym: *sym as usize, scratch_per_col: 0 };
    // Loaded for the rest of the process (kernels are kept by their memos).
    std::mem::forget(lib);
    Ok(native)
}

/// One input as the code reads it: its element address (at its layout's offset); for a flat
/// kernel, its walk along a run, its stride there and between runs (`outer`); for a row
/// kernel, its row stride.
struct Operand {
    ptr: usize,
    walk: Walk,
    stride: i64,
    outer: i64,
}

/// `t` seen as `view` (its element count), if its strides allow: the last dim is the run; a
/// flat view of one dim is one run split into chunks, of two, one run per row.
fn operand(t: &Tensor, base: usize, view: &[usize], row_kernel: bool, row_value: bool) -> Option<Operand> {
    let ptr = base + t.layout().offset * t.dtype().size_in_bytes();
    if t.numel() == 1 {
        return Some(Operand { ptr, walk: Walk::Broadcast, stride: 0, outer: 0 });
    }
    let strides = t.layout().view_strides(view)?;
    if row_kernel {
        // [rows, cols] with unit column stride, or [rows] (row values).
        let ok = row_value || view[1] == 1 || strides[1] == 1;
        let walk = if row_value { Walk::Strided } else { Walk::Contiguous };
        return ok.then_some(Operand { ptr, walk, stride: strides[0] as i64, outer: 0 });
    }
    let (inner, outer) = match strides.as_slice() {
        [s] => (*s, 0),
        [o, s] => (*s, *o),
        _ => return None,
    };
    let walk = match inner {
        1 => Walk::Contiguous,
        0 => Walk::Broadcast,
        _ => Walk::Strided,
    };
    Some(Operand { ptr, walk, stride: inner as i64, outer: outer as i64 })
}

/// A storage held while native code reads it, or (an output written in place) writes it.
enum Held<'a> {
    Read(parking_lot::RwLockReadGuard<'a, BackendStorage>),
    Write(parking_lot::RwLockWriteGuard<'a, BackendStorage>),
}

impl Held<'_> {
    /// The guard with the address of the storage's first element (None: not host memory).
    fn with_base(mut self) -> Option<(Self, usize)> {
        let base = match &mut self {
            Held::Read(g) => match &**g {
                BackendStorage::Cpu(s) => with_storage!(s, v => v.as_ptr() as usize),
                _ => return None,
            },
            Held::Write(g) => match &mut **g {
                BackendStorage::Cpu(s) => with_storage!(s, v => v.as_mut_ptr() as usize),
                _ => return None,
            },
        };
        Some((self, base))
    }
}

/// Runs `k` as native code, if it can: None means the interpreter should. `into[m]`, where
/// given, is the tensor a flat kernel's output m is written into in place (contiguous, of its
/// shape and dtype; inputs on its storage are read at the elements written, as the compiler's
/// in-place plan ensures): it is then that output.
pub(crate) fn run(k: &FusedKernel, shape: &[usize], inputs: &[Tensor], into: &[Option<Tensor>]) -> Option<Result<Vec<Tensor>>> {
    let (rows, cols) = match k.space {
        Space::Flat { numel } => (1, numel),
        Space::Rows { rows, cols } => (rows, cols),
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    };
    let size = rows * cols;
    match choice() {
        CpuCodegen::Interpret => return None,
        CpuCodegen::Auto if size < MIN_ELEMENTS => return None,
        _ => {}
    }
    if size == 0 || !cgen::supported(k) {
        return None;
    }
    let row_kernel = matches!(k.space, Space::Rows { .. });
    // In-place outputs: flat, contiguous, of the output's dtype and size, on the host, and read
    // by the kernel (if at all) at exactly the elements written.
    let into: Vec<Option<&Tensor>> = (0..k.outputs.len())
        .map(|m| {
            let t = into.get(m)?.as_ref()?;
            let ok = !row_kernel && !k.single[m] && t.device() == crate::Device::Cpu && t.is_contiguous() && t.dtype() == k.ops[k.outputs[m].0].dtype && t.numel() == size;
            let read_alike = inputs.iter().all(|i| !i.shares_storage_with(t) || i.layout() == t.layout());
            let once = (0..m).all(|j| into.get(j).and_then(|o| o.as_ref()).is_none_or(|o| !o.shares_storage_with(t)));
            (ok && read_alike && once).then_some(t)
        })
        .collect();
    // Storages stay readable (and alive) from their addresses being taken until the code has
    // run; those written in place are held for writing, once each. Each with its base address.
    let written: Vec<(&Tensor, Held, usize)> = into.iter().flatten().map(|t| Held::Write(t.storage().data.write()).with_base().map(|(h, b)| (*t, h, b))).collect::<Option<_>>()?;
    let base_written = |t: &Tensor| written.iter().find(|(w, ..)| w.shares_storage_with(t)).map(|&(_, _, b)| b);
    let mut held: Vec<Held> = Vec::with_capacity(inputs.len());
    let mut bases: Vec<usize> = Vec::with_capacity(inputs.len());
    for t in inputs {
        let base = match base_written(t) {
            Some(b) => b,
            None => {
                let (h, b) = Held::Read(t.storage().data.read_recursive()).with_base()?;
                held.push(h);
                b
            }
        };
        bases.push(base);
    }
    let in_place: Vec<Option<(&Tensor, usize)>> = into.iter().map(|t| t.and_then(|t| Some((t, base_written(t)? + t.storage_offset() * t.dtype().size_in_bytes())))).collect();
    // Row inputs as [rows, cols] or [rows]; flat inputs as one run where each one's strides
    // allow, else as runs along the kernel's last dim (a broadcast bias, a transpose).
    let view_all = |flat: &[usize]| -> Option<Vec<Operand>> {
        k.inputs.iter().zip(inputs).zip(&bases).map(|((inp, t), &base)| {
            let view: Vec<usize> = if !row_kernel { flat.to_vec() } else if inp.row { vec![rows] } else { vec![rows, cols] };
            operand(t, base, &view, row_kernel, inp.row)
        }).collect()
    };
    let last = shape.last().copied().unwrap_or(1).max(1);
    let (ops, runs) = match view_all(&[size]) {
        Some(ops) => (ops, None),
        None if !row_kernel && last >= 16 && last < size => (view_all(&[size / last, last])?, Some(last)),
        None => return None,
    };
    let walks: Vec<Walk> = ops.iter().map(|o| o.walk).collect();
    let native = {
        let memo = k.memo.backend::<Memo>()?;
        let mut variants = memo.variants.lock();
        match variants.iter().find(|(w, _)| *w == walks) {
            Some((_, n)) => (*n)?,
            None => {
                // Kernels of the same code (one per layer of a model) share one library.
                let built = build(&cgen::source(k, &walks), &k.name).map(|n| Native { scratch_per_col: cgen::scratch_per_col(k), ..n });
                if let Err(e) = &built {
                    crate::logging::log(crate::logging::Topic::Kernels, || format!("{}: interpreted on the CPU ({e})", k.name));
                    *LAST_ERROR.lock() = Some(format!("{}: {e}", k.name));
                }
                let built = built.ok();
                variants.push((walks.clone(), built));
                built?
            }
        }
    };
    let outs = launch(k, shape, rows, cols, &ops, runs, native, &in_place);
    drop((held, written));
    Some(outs)
}

/// Where output m is written by the native code (every element, before it is read): a fresh
/// buffer, or the tensor it is written into in place.
enum Out<'a> {
    Fresh { storage: CpuStorage, ptr: usize },
    Into { tensor: &'a Tensor, ptr: usize },
}

impl Out<'_> {
    fn ptr(&self) -> usize {
        match self {
            Out::Fresh { ptr, .. } | Out::Into { ptr, .. } => *ptr,
        }
    }
}

fn fresh(dtype: DType, n: usize) -> Out<'static> {
    with_dtype!(dtype, T => {
        let mut v: HostBuf<T> = pool::take(n);
        let ptr = v.as_mut_ptr() as usize;
        // SAFETY: the kernel writes all n elements before anyone reads them (`launch`), and
        // elements of these types have no invalid bit patterns the kernel could store
        // (bools are stored as 0 or 1).
        unsafe { v.set_len(n) };
        Out::Fresh { storage: <T as super::HostElem>::wrap(v), ptr }
    })
}

/// Runs the native code; output m is written into `into[m]` (the tensor, at its element
/// address) where given, else into a fresh buffer.
#[allow(clippy::too_many_arguments)]
fn launch(k: &FusedKernel, shape: &[usize], rows: usize, cols: usize, ops: &[Operand], runs: Option<usize>, native: Native, into: &[Option<(&Tensor, usize)>]) -> Result<Vec<Tensor>> {
    RUNS.with(|r| r.set((r.get().0 + 1, r.get().1)));
    let row_kernel = matches!(k.space, Space::Rows { .. });
    let outs: Vec<Out> = k
        .outputs
        .iter()
        .enumerate()
        .map(|(m, (o, _))| {
            let op = &k.ops[*o];
            let n = if k.single[m] { 1 } else if op.row { rows } else { rows * cols };
            match into.get(m).copied().flatten() {
                Some((tensor, ptr)) => Out::Into { tensor, ptr },
                None => fresh(op.dtype, n),
            }
        })
        .collect();
    let strides: Vec<i64> = ops.iter().map(|o| o.stride).collect();
    let sizes: Vec<usize> = k.inputs.iter().map(|i| i.dtype.size_in_bytes()).collect();
    let out_sizes: Vec<usize> = k.outputs.iter().map(|(o, _)| k.ops[*o].dtype.size_in_bytes()).collect();
    let scratch_per_col = native.scratch_per_col;
    if row_kernel {
        // SAFETY: `native` was built from a row kernel's source, whose signature this is.
        let f: RowsFn = unsafe { std::mem::transmute::<usize, RowsFn>(native.sym) };
        let per = (CHUNK / cols.max(1)).max(1);
        // Scratch (f64s: aligned for every value type the arrays hold) made once per worker's
        // share of the tasks, not once per task: zeroing it for every few rows cost as much as
        // a tenth of a softmax.
        (0..rows.div_ceil(per)).into_par_iter().for_each_init(|| vec![0f64; scratch_per_col * cols / 8], |scratch, b| {
            let (r0, r1) = (b * per, ((b + 1) * per).min(rows));
            let ins: Vec<*const u8> = ops.iter().map(|o| o.ptr as *const u8).collect();
            let outp: Vec<*mut u8> = outs.iter().map(|o| o.ptr() as *mut u8).collect();
            // SAFETY: each task writes rows r0..r1 of the outputs (disjoint), reads inputs
            // within their views, and its own scratch.
            unsafe { f(r0 as i64, r1 as i64, cols as i64, ins.as_ptr(), strides.as_ptr(), outp.as_ptr(), scratch.as_mut_ptr() as *mut u8) };
        });
    } else {
        // SAFETY: as above, for a flat kernel's source.
        let f: FlatFn = unsafe { std::mem::transmute::<usize, FlatFn>(native.sym) };
        let n = rows * cols;
        // Tasks of about CHUNK elements: ranges of one run, or whole runs of `len` elements.
        let (len, per_task) = match runs {
            None => (CHUNK.min(n), 1),
            Some(len) => (len, (CHUNK / len).max(1)),
        };
        let runs_total = n.div_ceil(len);
        (0..runs_total.div_ceil(per_task)).into_par_iter().for_each(|b| {
            let mut sink = [0u8; 16];
            let sink_ptr = sink.as_mut_ptr() as usize;
            for run in b * per_task..((b + 1) * per_task).min(runs_total) {
                let start = run * len;
                let here = len.min(n - start);
                // Element `start` of input j: along its one run, or at the start of run `run`.
                let at = |o: &Operand, sz: usize| match runs {
                    None => o.ptr + start * o.stride as usize * sz,
                    Some(_) => o.ptr + run * o.outer as usize * sz,
                };
                let ins: Vec<*const u8> = ops.iter().zip(&sizes).map(|(o, &sz)| at(o, sz) as *const u8).collect();
                // One-element outputs are written by the first run; the others write a sink.
                let outp: Vec<*mut u8> = outs
                    .iter()
                    .enumerate()
                    .map(|(m, o)| if k.single[m] { if start == 0 { o.ptr() } else { sink_ptr } } else { o.ptr() + start * out_sizes[m] } as *mut u8)
                    .collect();
                // SAFETY: each run writes its own range of each output (or the sink, which no
                // one reads) and reads inputs within their views.
                unsafe { f(here as i64, ins.as_ptr(), strides.as_ptr(), outp.as_ptr(), std::ptr::null_mut()) };
            }
        });
    }
    let mut res = vec![];
    for (m, o) in outs.into_iter().enumerate() {
        let op = &k.ops[k.outputs[m].0];
        let s: Vec<usize> = match k.space {
            Space::Flat { .. } if k.single[m] => vec![1],
            Space::Flat { .. } => shape.to_vec(),
            Space::Rows { rows, cols } => if op.row { vec![rows] } else { vec![rows, cols] },
            Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
        };
        res.push(match o {
            Out::Fresh { storage, .. } => Tensor::from_cpu(storage, &s),
            Out::Into { tensor, .. } => tensor.clone(),
        });
    }
    Ok(res)
}
