//! The CUDA twins of the CPU backend's functions: each builds a spec, gets its kernel from the
//! device cache (generating it on first use) and launches it on the device's stream. The
//! generators: `codegen` (eager maps, reductions, rows), `fused` (the compiler's kernels),
//! `foreach` (multi-tensor optimiser updates), `attention`, `gemv` (products of one row),
//! `custom` (users' kernels).

pub(crate) mod attention;
pub(crate) mod codegen;
pub(crate) mod copies;
pub(crate) mod custom;
pub(crate) mod foreach;
pub(crate) mod fused;
pub(crate) mod gemv;
pub(crate) mod maxpool;
pub(crate) mod tf32;
#[cfg(test)]
mod samples;

use crate::dtype::CType;
use codegen::{gen_map, gen_reduce, Class, GatherArgs, IntBmmArgs, MapSpec, ReduceArgs, ReduceLayout, ReduceSpec, ScatterAddArgs, MAX_DIMS, PARAM_BASE};
use crate::backend::cuda::{libs::blas, device, CudaDevice, CudaStorage, LaunchArgs, KernelKey};
use crate::backend::cpu::{with_dtype, CpuStorage, HostElem};
use crate::layout::{contiguous_strides, numel, Layout};
use crate::ops::matmul::Activation;
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::storage::BackendStorage;
use crate::profiler::{self, CopyKind};
use crate::{DType, Device, Error, Result, Tensor};
use cudarc::driver::result as dr;
use std::sync::Arc;

const THREADS: u32 = 256;

pub(crate) fn dev_of(t: &Tensor) -> Result<Arc<CudaDevice>> {
    match t.device() {
        Device::Cuda(n) => device(n),
        Device::Cpu => unreachable!("CUDA kernel on a CPU tensor"),
    }
}

/// Address of the tensor's first element.
pub(crate) fn data_ptr(t: &Tensor) -> Result<u64> {
    let g = t.storage().data.read_recursive();
    match &*g {
        BackendStorage::Cuda(s) => Ok(s.ptr() + (t.layout().offset * t.dtype().size_in_bytes()) as u64),
        BackendStorage::Cpu(_) => unreachable!("CUDA kernel on a CPU tensor"),
        BackendStorage::Traced(_) => unreachable!("kernels never see symbolic tensors: ops on them are recorded"),
    }
}

/// The address of what the op that wrote `t`'s storage kept beside it (`CudaStorage::aux`).
pub(crate) fn aux_ptr(t: &Tensor) -> Option<u64> {
    match &*t.storage().data.read_recursive() {
        BackendStorage::Cuda(s) => s.aux.as_ref().map(|a| a.ptr()),
        _ => None,
    }
}

/// The device bytes `[start, end)` of `t`'s storage (None off the GPU): what work reading or
/// writing any view of it touches.
pub(crate) fn storage_range(t: &Tensor) -> Option<(u64, u64)> {
    match &*t.storage().data.read_recursive() {
        BackendStorage::Cuda(s) => Some((s.ptr(), s.ptr() + (s.len * s.dtype.size_in_bytes()) as u64)),
        _ => None,
    }
}

/// The `settled` argument of a kernel that reads settled memory before its wait (`prelude.cu`):
/// 0 if not settled, 2 if it also lets the next kernel start at once, 1 if only after its wait.
pub(crate) fn settled_arg(settled: bool) -> i64 {
    match (settled, crate::switches::pdl_early()) {
        (false, _) => 0,
        (true, true) => 2,
        (true, false) => 1,
    }
}

/// Blocks for `work` items of one thread each: enough to cover it (as PyTorch's elementwise
/// kernels launch), capped where the grid-stride loops take over.
fn grid_for(work: usize, threads: u32) -> u32 {
    (work.div_ceil(threads as usize)).clamp(1, 1 << 24) as u32
}

/// Elements from which a map kernel is large enough for wider vectors per thread.
const LARGE_MAP: usize = 1 << 22;

/// Bytes per operand a thread of a large map kernel reads at a time: 32 (two 16-byte loads),
/// or `KILN_MAP_VECTOR_BYTES` (16 or 32, read once) for comparing.
fn map_vector_bytes() -> usize {
    crate::switches::map_vector_bytes().unwrap_or(32)
}

/// An operand of a map kernel: where it is and how it is laid out over the iteration shape.
struct Operand {
    ptr: u64,
    dtype: DType,
    strides: Vec<usize>,
}

/// Merges dims that every operand walks contiguously, and drops size-1 dims: fewer dims mean
/// less index arithmetic, and most broadcasts become plain contiguous or scalar operands.
fn coalesce(shape: &[usize], strides: &mut [Vec<usize>]) -> Vec<usize> {
    let mut dims: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
    let mut out_shape: Vec<usize> = dims.iter().map(|&d| shape[d]).collect();
    let mut out_strides: Vec<Vec<usize>> = strides.iter().map(|s| dims.iter().map(|&d| s[d]).collect()).collect();
    let mut i = out_shape.len();
    while i > 1 {
        i -= 1;
        let mergeable = out_strides.iter().all(|s| s[i - 1] == s[i] * out_shape[i]);
        if mergeable {
            out_shape[i - 1] *= out_shape[i];
            out_shape.remove(i);
            for s in out_strides.iter_mut() {
                s[i - 1] = s[i];
                s.remove(i);
            }
            dims.remove(i);
        }
    }
    for (s, o) in strides.iter_mut().zip(out_strides) {
        *s = o;
    }
    out_shape
}

fn classify(shape: &[usize], strides: &[usize]) -> Class {
    if strides.iter().all(|&s| s == 0) {
        Class::Scalar
    } else if strides == contiguous_strides(shape).as_slice() {
        Class::Contig
    } else {
        Class::Strided
    }
}

/// One output of a map kernel: where it goes and what it stores.
pub(crate) struct MapOut<'a> {
    pub ptr: u64,
    pub dtype: DType,
    pub result: CType,
    pub expr: &'a str,
    /// One value for every element (it reads only one-element operands): only element 0
    /// stores it, into a one-element buffer.
    pub once: bool,
}

/// How a map kernel walks its operands: with its code (name, body, expressions, dtypes), this
/// is all its source depends on.
pub(crate) struct MapWalk {
    out_class: Class,
    inputs: Vec<Class>,
    ndim: usize,
    vec: usize,
    idx64: bool,
}

impl MapWalk {
    fn is(&self, out_class: Class, inputs: &[Class], ndim: usize, vec: usize, idx64: bool) -> bool {
        self.out_class == out_class && self.inputs == inputs && self.ndim == ndim && self.vec == vec && self.idx64 == idx64
    }
}

/// A compiled kernel's loaded map functions by operand walk (its code never changes), with
/// where their arguments sit.
pub(crate) type MapLaunches = crate::backend::cuda::Loaded<(MapWalk, crate::backend::cuda::Kernel, codegen::MapWords)>;

/// Runs a map kernel over `inputs` (each already of the iteration shape `out_layout.shape`):
/// `body` then each output's expression, per element. Outputs are laid out by `out_layout`
/// (contiguous unless a single output is written in place). `memo`: where the caller keeps the
/// functions of a kernel whose code is always the same (a compiled program's fused kernel);
/// eager ops pass none.
#[allow(clippy::too_many_arguments)]
pub(crate) fn map_launch(dev: &Arc<CudaDevice>, name: &str, inputs: &[(&Tensor, CType)], outs: &[MapOut], out_layout: &Layout, body: &str, params: &[u64], memo: Option<&MapLaunches>) -> Result<()> {
    let shape = out_layout.shape.clone();
    let n = numel(&shape);
    if n == 0 {
        return Ok(());
    }
    let nout = outs.len();
    let mut ops: Vec<Operand> = outs.iter().map(|o| Operand { ptr: o.ptr, dtype: o.dtype, strides: out_layout.strides.clone() }).collect();
    for (t, _) in inputs {
        ops.push(Operand { ptr: data_ptr(t)?, dtype: t.dtype(), strides: t.strides().to_vec() });
    }
    let mut strides: Vec<Vec<usize>> = ops.iter().map(|o| o.strides.clone()).collect();
    let cshape = coalesce(&shape, &mut strides);
    let classes: Vec<Class> = strides.iter().map(|s| classify(&cshape, s)).collect();
    let out_class = if classes[0] == Class::Contig { Class::Contig } else { Class::Strided };
    let strided = out_class == Class::Strided || classes[nout..].contains(&Class::Strided);
    if strided && cshape.len() > MAX_DIMS {
        return Err(Error::arg("cuda kernel", format!("{} dims after merging; at most {MAX_DIMS} are supported", cshape.len())));
    }
    let max_off = strides.iter().map(|s| s.iter().zip(&cshape).map(|(st, d)| st * (d - 1)).sum::<usize>()).max().unwrap_or(0);
    let idx64 = n >= i32::MAX as usize || max_off >= i32::MAX as usize;
    // Vector loads when every operand that is walked is aligned and, if strided, has unit inner
    // stride with runs that are whole vectors (a broadcast bias row, a transposed block), or is
    // the same along its inner dim, a whole number of vectors long (a splat: batch norm's
    // per-channel scale over an image). Inner dims that take no 16-byte vector (14 x 14 bf16
    // values) take 8- or 4-byte ones.
    let inner = *cshape.last().unwrap_or(&1);
    let splat = |st: &[usize]| strided && st.last() == Some(&0) && st.iter().any(|&x| x != 0);
    let vec = {
        let walked: Vec<(&Operand, &Vec<usize>)> = ops.iter().zip(&strides).zip(&classes).filter(|(_, c)| **c != Class::Scalar).map(|(o, _)| o).collect();
        let widest = walked.iter().map(|(o, _)| o.dtype.size_in_bytes()).max().unwrap_or(1);
        let fits = |v: usize| {
            n >= v
                && walked.iter().all(|(o, st)| {
                    if splat(st) {
                        return inner.is_multiple_of(v);
                    }
                    let aligned = o.ptr % (v * o.dtype.size_in_bytes()) as u64 == 0;
                    let runs = !strided || (st.last() == Some(&1) && inner.is_multiple_of(v) && st[..st.len() - 1].iter().all(|&x| x % v == 0));
                    aligned && runs
                })
        };
        // Large maps take two 16-byte vectors per thread: half the threads, and index
        // arithmetic (a broadcast operand's offset) once per two vectors.
        let bytes = if n >= LARGE_MAP { map_vector_bytes() } else { 16 };
        [bytes / widest, 16 / widest, 8 / widest, 4 / widest].into_iter().map(|v| v.clamp(1, 32)).find(|&v| v > 1 && fits(v)).unwrap_or(1)
    };
    let classes: Vec<Class> = classes.iter().zip(&strides).map(|(&c, st)| if vec > 1 && c == Class::Strided && splat(st) { Class::Splat } else { c }).collect();
    let ndim = if strided { cshape.len() } else { 0 };
    let fill = |words: &codegen::MapWords| {
        let mut a = LaunchArgs::default();
        a.w[MapSpec::COUNT_WORD] = n as u64;
        for (k, o) in ops.iter().enumerate() {
            a.w[MapSpec::ptr_word(k)] = o.ptr;
        }
        if strided {
            for (d, &sz) in cshape.iter().enumerate() {
                a.w[words.sizes + d] = codegen::size_word(sz, idx64);
            }
            for (k, s) in strides.iter().enumerate() {
                if let Some(w) = words.strides[k] {
                    for (d, &st) in s.iter().enumerate() {
                        a.w[w + d] = st as u64;
                    }
                }
            }
        }
        for (k, &p) in params.iter().enumerate() {
            a.w[PARAM_BASE + k] = p;
        }
        a
    };
    // Vectors per thread, or without them MAP_ILP elements per thread.
    let grid = grid_for(if vec > 1 { n / vec } else { n.div_ceil(codegen::MAP_ILP) }, codegen::MAP_THREADS);
    if let Some(m) = memo {
        let found = m.0.lock().iter().find(|(w, _, _)| w.is(out_class, &classes[nout..], ndim, vec, idx64)).map(|(_, k, words)| (*k, fill(words)));
        if let Some((k, a)) = found {
            return dev.launch(k, (grid, 1, 1), (codegen::MAP_THREADS, 1, 1), &a);
        }
    }
    let spec = MapSpec {
        name: name.to_string(),
        inputs: inputs.iter().zip(&classes[nout..]).map(|((t, ct), c)| (t.dtype(), *ct, *c)).collect(),
        outs: outs.iter().map(|o| (o.dtype, o.result, o.expr.to_string(), o.once)).collect(),
        out_class,
        body: body.to_string(),
        ndim,
        vec,
        idx64,
    };
    let words = spec.words();
    if words.end > PARAM_BASE {
        return Err(Error::arg("cuda kernel", format!("{name}: {} operands over {} dims need more argument words than a launch holds", ops.len(), cshape.len())));
    }
    let a = fill(&words);
    let key = KernelKey::Map(spec.clone());
    let k = dev.kernel(key, || (spec.kernel_name(), gen_map(&spec)))?;
    // (A rehearsal's function is a placeholder: the real one is loaded on the first run.)
    if let Some(m) = memo.filter(|_| !k.is_rehearsed()) {
        m.0.lock().push((MapWalk { out_class, inputs: classes[nout..].to_vec(), ndim, vec, idx64 }, k, words));
    }
    dev.launch(k, (grid, 1, 1), (codegen::MAP_THREADS, 1, 1), &a)
}

/// One eager op's map kernel: `expr` into the buffer at `out_ptr`, laid out by `out_layout`.
#[allow(clippy::too_many_arguments)]
fn map_into(dev: &Arc<CudaDevice>, name: &str, inputs: &[(&Tensor, CType)], out_ptr: u64, out_dtype: DType, out_layout: &Layout, result: CType, expr: String, params: &[u64]) -> Result<()> {
    map_launch(dev, name, inputs, &[MapOut { ptr: out_ptr, dtype: out_dtype, result, expr: &expr, once: false }], out_layout, "", params, None)
}

/// `map_into` a fresh contiguous buffer.
// `map_into`'s arguments, less the destination.
#[allow(clippy::too_many_arguments)]
fn map_new(dev: &Arc<CudaDevice>, name: &str, inputs: &[(&Tensor, CType)], shape: &[usize], out: DType, result: CType, expr: String, params: &[u64]) -> Result<CudaStorage> {
    let s = CudaStorage::new(dev, out, numel(shape))?;
    map_into(dev, name, inputs, s.ptr(), out, &Layout::contiguous(shape), result, expr, params)?;
    Ok(s)
}

pub(crate) fn unary(op: UnaryOp, x: &Tensor, out: DType) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let t = op.compute_type(out);
    map_new(&dev, op.name(), &[(x, t)], x.shape(), out, t, op.cuda("v0", t), &[])
}

pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, compute: DType) -> Result<CudaStorage> {
    let dev = dev_of(a)?;
    let out = op.out_dtype(compute);
    let (t, result) = op.compute_types(compute);
    map_new(&dev, op.name(), &[(a, t), (b, t)], a.shape(), out, result, op.cuda("v0", "v1", t), &[])
}

pub(crate) fn where_(c: &Tensor, a: &Tensor, b: &Tensor, out: DType) -> Result<CudaStorage> {
    let dev = dev_of(a)?;
    let t = CType::of(out);
    map_new(&dev, "where", &[(c, CType::Bool), (a, t), (b, t)], a.shape(), out, t, "(v0 ? v1 : v2)".into(), &[])
}

/// `x * scale + shift` for F32 `scale` and `shift` broadcast to x's shape, computed in F32 and
/// stored in x's dtype in one pass (batch norm in evaluation).
pub(crate) fn scale_shift(x: &Tensor, scale: &Tensor, shift: &Tensor) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let t = CType::F32;
    map_new(&dev, "scale_shift", &[(x, t), (scale, t), (shift, t)], x.shape(), x.dtype(), t, "(v0 * v1 + v2)".into(), &[])
}

/// A contiguous copy of `x` converted to `dtype`.
pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let t = CType::of(x.dtype());
    let name = if dtype == x.dtype() { "copy" } else { "to" };
    map_new(&dev, name, &[(x, t)], x.shape(), dtype, t, "v0".into(), &[])
}

/// Writes `src` (of `dst`'s shape, any dtype) into `dst`'s strided elements.
pub(crate) fn write_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    let dev = dev_of(dst)?;
    if dst.is_contiguous() && src.is_contiguous() && dst.dtype() == src.dtype() {
        // A plain device-to-device copy: the copy engine's roofline, no kernel.
        let bytes = dst.numel() * dst.dtype().size_in_bytes();
        if let Some(stream) = dev.work().stream().filter(|_| bytes > 0) {
            let _rec = profiler::copy(&dev, &dev.stream, CopyKind::DeviceToDevice, bytes);
            // SAFETY: both ranges hold `bytes` and do not overlap (aliasing values were copied
            // first by the caller); ordered on the device's stream.
            unsafe { dr::memcpy_dtod_async(data_ptr(dst)?, data_ptr(src)?, bytes, stream.cu_stream()) }.map_err(|e| dev.err("copy", e))?;
        }
        return Ok(());
    }
    let t = CType::of(src.dtype());
    map_into(&dev, "copy", &[(src, t)], data_ptr(dst)?, dst.dtype(), dst.layout(), t, "v0".into(), &[])
}

pub(crate) fn zero_fill(dev: &Arc<CudaDevice>, s: &CudaStorage) -> Result<()> {
    let bytes = s.len * s.dtype.size_in_bytes();
    let Some(stream) = dev.work().stream().filter(|_| bytes > 0) else { return Ok(()) };
    let _rec = profiler::memset(dev, bytes);
    // SAFETY: the block holds at least `bytes`; the memset is ordered on the device's stream.
    unsafe { dr::memset_d8_async(s.ptr(), 0, bytes, stream.cu_stream()) }.map_err(|e| dev.err("memset", e))
}

pub(crate) fn full(device: usize, shape: &[usize], value: f64, dtype: DType) -> Result<CudaStorage> {
    let dev = crate::backend::cuda::device(device)?;
    let s = CudaStorage::new(&dev, dtype, numel(shape))?;
    if value == 0.0 {
        zero_fill(&dev, &s)?;
    } else {
        fill_into(&dev, s.ptr(), dtype, &Layout::contiguous(shape), value)?;
    }
    Ok(s)
}

/// `value` written at every element of `layout` from `ptr` (one launch parameter, so every
/// value shares one kernel).
fn fill_into(dev: &Arc<CudaDevice>, ptr: u64, dtype: DType, layout: &Layout, value: f64) -> Result<()> {
    map_into(dev, "fill", &[], ptr, dtype, layout, CType::F64, "kparam_f(P(0))".into(), &[value.to_bits()])
}

/// The random distributions of `Tensor::rand`/`randn`/`randint`, drawn from the same Philox
/// stream as on the CPU (element i takes counter `first + i`).
pub(crate) enum Dist {
    /// Uniform in [0, 1) keeping `bits` random bits (24 for f32, 53 for f64, 11/8 for halves).
    Uniform { bits: u32 },
    Normal,
    Int { low: i64, span: u64 },
}

/// `shape` of `dtype` drawn from the global generator by `dist` (a rehearsal draws nothing).
pub(crate) fn random(device: usize, shape: &[usize], dtype: DType, dist: Dist) -> Result<CudaStorage> {
    let dev = crate::backend::cuda::device(device)?;
    let n: usize = shape.iter().product();
    let (seed, first) = if dev.work().stream().is_some() { crate::tensor::random::reserve(n as u64) } else { crate::tensor::random::peek() };
    let (expr, result, params) = match dist {
        Dist::Uniform { bits } => (format!("kuniform(P(0), P(1) + (u64)i, {bits})"), CType::F64, vec![seed, first]),
        Dist::Normal => ("knormal(P(0), P(1) + (u64)i)".to_string(), CType::F64, vec![seed, first]),
        Dist::Int { low, span } => ("((long long)P(2) + (long long)(kbits64(P(0), P(1) + (u64)i) % P(3)))".to_string(), CType::I64, vec![seed, first, low as u64, span]),
    };
    map_new(&dev, "random", &[], shape, dtype, result, expr, &params)
}

/// Reduces `dims` of `x` into a contiguous buffer of `out` dtype (kept dims in order).
pub(crate) fn reduce(op: ReduceOp, x: &Tensor, dims: &[usize], out: DType) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let l = x.layout();
    let kept: Vec<usize> = (0..l.ndim()).filter(|d| !dims.contains(d)).collect();
    let m: usize = kept.iter().map(|&d| l.shape[d]).product();
    let k: usize = dims.iter().map(|&d| l.shape[d]).product();
    let res = CudaStorage::new(&dev, out, m)?;
    if m == 0 {
        return Ok(res);
    }
    if k == 0 {
        let s = full(dev.ordinal, &[m], op.identity::<f64>(), out)?;
        return Ok(s);
    }
    // A contiguous tensor is read in place when its kept dims or its reduced dims are one run:
    // kept dims last reduce as rows, first as columns, in the middle (batch norm's statistics
    // over N, H, W) as strided rows; reduced dims in the middle (pooling windows) as batches
    // of columns. Otherwise the reduced dims are moved last (a copy) and reduce as rows.
    let run = |ds: &[usize]| ds.windows(2).all(|w| w[1] == w[0] + 1);
    let size = |r: std::ops::Range<usize>| -> usize { l.shape[r].iter().product() };
    let n = l.ndim();
    let (input, layout, q) = match (x.is_contiguous(), kept.first(), dims.first()) {
        (true, Some(&a), _) if run(&kept) && size(0..a) == 1 => (x.clone(), ReduceLayout::Rows, None),
        (true, Some(&a), _) if run(&kept) && size(a + kept.len()..n) == 1 => (x.clone(), ReduceLayout::Cols, None),
        (true, Some(&a), _) if run(&kept) => (x.clone(), ReduceLayout::Rows, Some(size(a + kept.len()..n))),
        (true, Some(_), Some(&a)) if run(dims) => (x.clone(), ReduceLayout::Cols, Some(size(a + dims.len()..n))),
        _ => {
            let perm: Vec<usize> = kept.iter().chain(dims).copied().collect();
            let p = x.permute_usize(&perm)?;
            (if p.is_contiguous() { p } else { p.copy_contiguous()? }, ReduceLayout::Rows, None)
        }
    };
    let acc = op.acc_type(x.dtype());
    let arg = op.is_arg();
    let ptr = data_ptr(&input)?;
    // Columns are read `vec` at a time (16-byte loads for f32, at most 4 accumulators per
    // thread) when every row starts aligned.
    let vec = match layout {
        ReduceLayout::Cols => {
            let size = input.dtype().size_in_bytes();
            let v = (16 / size).min(4);
            if q.unwrap_or(m).is_multiple_of(v) && ptr % (v * size) as u64 == 0 { v } else { 1 }
        }
        // An arg reduction of a few long rows (greedy sampling's one row of logits), split in
        // chunks whose threads wait on their loads one after another: 16 bytes per load
        // instead of one element, where every row starts aligned.
        ReduceLayout::Rows => {
            let v = 16 / input.dtype().size_in_bytes();
            let few = arg && m < dev.sm_count && k >= 4096 && q.is_none();
            if few && (m == 1 || k.is_multiple_of(v)) && ptr % 16 == 0 { v } else { 1 }
        }
    };
    // Columns enough for a block on (nearly) every SM: blocks of 32 x 32 threads over 32 or 64
    // columns, each reading every row, with no split and no fold; 8192 x 8192 f32 then reads at
    // the H200's read rate (61.7 µs back to back, 65.7-66.2 as one call, against 64.3 and 68.5
    // for 32 x 8 threads in 8 chunks folded by the last block: tools/stream). At most 2 columns
    // per load: 4 would leave half the SMs without a block there.
    let tall = match layout {
        ReduceLayout::Cols if cols_chunks().is_none() && k >= 256 => [vec.min(2), 1].into_iter().find(|&v| 16 * m.div_ceil(32 * v) >= 15 * dev.sm_count),
        _ => None,
    };
    let (vec, ty) = match tall {
        Some(v) => (v, 32),
        None => (vec, if layout == ReduceLayout::Cols { 8 } else { 1 }),
    };
    let groups = m.div_ceil(32 * vec);
    let chunks = if tall.is_some() {
        1
    } else if arg {
        // A few long rows (greedy sampling's one row of logits): each row's chunks spread over
        // two blocks per SM, at least 2048 elements each, folded by the last (one launch).
        match layout {
            ReduceLayout::Rows if m < dev.sm_count && q.is_none() => ((dev.sm_count * 2) / m).clamp(1, (k / 2048).max(1)),
            _ => 1,
        }
    } else {
        match layout {
            ReduceLayout::Rows => ((dev.sm_count * 4) / m).clamp(1, (k / 2048).max(1)),
            // About four 256-thread blocks per SM, all running at once, each reading at least
            // 64 rows (measured on the H200 over 8192 x 8192: 2 per SM and 8 per SM are both
            // slower, by 20% and 7%; blocks of 32 x 16 or 32 x 32 threads, with 4 to 8 chunks,
            // were no faster than 32 x 8).
            ReduceLayout::Cols => cols_chunks().unwrap_or((dev.sm_count * 4) / groups).clamp(1, (k / 64).max(1)),
        }
    };
    let spec = |input: DType, out: DType, vec: usize, m: usize, k: usize, strided: bool| ReduceSpec { op, input, acc, out, layout, idx64: m * k >= i32::MAX as usize, vec, ty, strided };
    let (strided, q) = (q.is_some(), q.unwrap_or(1));
    if chunks == 1 {
        launch_reduce(&dev, &spec(input.dtype(), out, vec, m, k, strided), ptr, res.ptr(), [m, k, q], 1, (0, 0))?;
        return Ok(res);
    }
    if arg {
        // One launch: each chunk's index and value, folded by the last block of each row.
        let partial = CudaStorage::new(&dev, DType::U8, m * chunks * (8 + acc.dtype().size_in_bytes()))?;
        let counters = dev.reduce_counters(m)?;
        launch_reduce(&dev, &spec(input.dtype(), out, vec, m, k, strided), ptr, res.ptr(), [m, k, q], chunks, (partial.ptr(), counters))?;
        return Ok(res);
    }
    if layout == ReduceLayout::Cols {
        // One launch: partials per chunk, folded by the last block of each column group.
        let partial = CudaStorage::new(&dev, acc.dtype(), m * chunks)?;
        let counters = dev.reduce_counters(groups)?;
        launch_reduce(&dev, &spec(input.dtype(), out, vec, m, k, strided), ptr, res.ptr(), [m, k, q], chunks, (partial.ptr(), counters))?;
        return Ok(res);
    }
    // Two passes: partial results per chunk (in the acc type), then a reduction of those.
    let partial = CudaStorage::new(&dev, acc.dtype(), m * chunks)?;
    launch_reduce(&dev, &spec(input.dtype(), acc.dtype(), 1, m, k, strided), ptr, partial.ptr(), [m, k, q], chunks, (0, 0))?;
    launch_reduce(&dev, &spec(acc.dtype(), out, 1, m, chunks, false), partial.ptr(), res.ptr(), [m, chunks, 1], 1, (0, 0))?;
    Ok(res)
}

/// A tuning override of how many chunks a column reduction's rows are split into
/// (`KILN_COLS_CHUNKS`, read once).
fn cols_chunks() -> Option<usize> {
    crate::switches::cols_chunks()
}

#[allow(clippy::too_many_arguments)]
/// `split` = (partials buffer, counters) for a one-launch split column reduction.
/// `[m, k, q]`: kept and reduced sizes, and the inner size of a strided spec (1 otherwise).
fn launch_reduce(dev: &Arc<CudaDevice>, spec: &ReduceSpec, x: u64, y: u64, [m, k, q]: [usize; 3], chunks: usize, split: (u64, u64)) -> Result<()> {
    let key = KernelKey::Reduce(spec.clone());
    let kern = dev.kernel(key, || (spec.kernel_name(), gen_reduce(spec)))?;
    let a = ReduceArgs { x, out: y, m: m as i64, k: k as i64, chunks: chunks as i64, q: q as i64, part: split.0, count: split.1 };
    match spec.layout {
        ReduceLayout::Rows => {
            let per = k.div_ceil(chunks).div_ceil(spec.vec);
            // A few long rows of an arg reduction get whole blocks per chunk: 256 threads alone
            // would wait on hundreds of loads each.
            let most = if spec.op.is_arg() && m < dev.sm_count { 1024 } else { 256 };
            let threads = per.next_power_of_two().clamp(32, most) as u32;
            dev.launch(kern, (m.min(1 << 20) as u32, chunks as u32, 1), (threads, 1, 1), &a)
        }
        ReduceLayout::Cols => dev.launch(kern, (m.div_ceil(32 * spec.vec) as u32, chunks as u32, 1), (32, spec.ty as u32, 1), &a),
    }
}

/// Where a kernel reports a bad index for `op`: the device's error word and the op's code.
fn index_error_words(dev: &CudaDevice, op: &str) -> Result<(u64, u64)> {
    let code = crate::backend::cuda::INDEX_OPS.iter().position(|&o| o == op).expect("a known index op") as u64 + 1;
    Ok((dev.error_word()?, code))
}

/// `out[p] = x[... index[p] along dim ...]` over the index's shape (gather; index_select
/// passes a broadcast index).
pub(crate) fn gather_dim(op: &'static str, x: &Tensor, dim: usize, index: &Tensor) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let nd = index.ndim();
    if nd > 8 {
        return Err(Error::arg(op, "at most 8 dims on CUDA"));
    }
    let out = CudaStorage::new(&dev, x.dtype(), index.numel())?;
    if out.len == 0 {
        return Ok(out);
    }
    let (name, src) = codegen::gen_gather(x.dtype(), nd.max(1), dim);
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name, src))?;
    let (error_word, error_op) = index_error_words(&dev, op)?;
    let mut a = GatherArgs { n: out.len as i64, out: out.ptr(), x: data_ptr(x)?, idx: data_ptr(index)?, dim_size: x.shape()[dim] as i64, error_word, error_op, ..Default::default() };
    for d in 0..nd {
        a.sizes[d] = index.shape()[d] as i64;
        a.idx_strides[d] = index.strides()[d] as i64;
        a.x_strides[d] = x.strides()[d] as i64;
    }
    if nd == 0 {
        a.sizes[0] = 1;
    }
    dev.launch(kern, (grid_for(out.len, THREADS), 1, 1), (THREADS, 1, 1), &a)?;
    Ok(out)
}

pub(crate) fn index_select(x: &Tensor, dim: usize, index: &Tensor) -> Result<CudaStorage> {
    let mut shape = x.shape().to_vec();
    shape[dim] = index.numel();
    let mut ishape = vec![1; x.ndim()];
    ishape[dim] = index.numel();
    let idx = index.reshape_usize(&ishape)?.broadcast_to(&shape)?;
    // The other dims of x are read with x's strides by position: a broadcast index over the
    // output shape gives exactly index_select.
    gather_dim("index_select", x, dim, &idx)
}

pub(crate) fn scatter_add(base: &Tensor, dim: usize, index: &Tensor, src: &Tensor) -> Result<CudaStorage> {
    let t = match CType::of(base.dtype()) {
        CType::Bool => CType::I64,
        t => t,
    };
    let acc = cast(base, t.dtype())?;
    launch_scatter(acc.ptr(), base.shape(), dim, index, src, Some(t))?;
    if t.dtype() == base.dtype() {
        return Ok(acc);
    }
    let acc_t = Tensor::from_parts(Arc::new(crate::storage::Storage::cuda(acc)), Layout::contiguous(base.shape()), t.dtype(), false);
    cast(&acc_t, base.dtype())
}

/// A copy of `base` with `src`'s elements written where `index` says (`torch.scatter`).
pub(crate) fn scatter(base: &Tensor, dim: usize, index: &Tensor, src: &Tensor) -> Result<CudaStorage> {
    let out = cast(base, base.dtype())?;
    launch_scatter(out.ptr(), base.shape(), dim, index, src, None)?;
    Ok(out)
}

/// `scatter` written into `target` (contiguous) itself: only the indexed elements are stored.
pub(crate) fn scatter_into(target: &Tensor, dim: usize, index: &Tensor, src: &Tensor) -> Result<()> {
    launch_scatter(data_ptr(target)?, target.shape(), dim, index, src, None)
}

/// The scatter kernel over `index` into `acc` (contiguous, of `shape`): adding in compute type
/// `add` where given, else storing.
fn launch_scatter(acc: u64, shape: &[usize], dim: usize, index: &Tensor, src: &Tensor, add: Option<CType>) -> Result<()> {
    let dev = dev_of(src)?;
    let nd = index.ndim();
    if index.numel() == 0 {
        return Ok(());
    }
    let op = if add.is_some() { "scatter_add" } else { "scatter" };
    let (name, code) = codegen::gen_scatter(src.dtype(), nd.max(1), dim, add);
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name, code))?;
    let (error_word, error_op) = index_error_words(&dev, op)?;
    let mut a = ScatterAddArgs { n: index.numel() as i64, acc, src: data_ptr(src)?, idx: data_ptr(index)?, dim_size: shape[dim] as i64, error_word, error_op, ..Default::default() };
    let acc_strides = contiguous_strides(shape);
    for (d, &stride) in acc_strides.iter().enumerate().take(nd) {
        a.sizes[d] = index.shape()[d] as i64;
        a.idx_strides[d] = index.strides()[d] as i64;
        a.src_strides[d] = src.strides()[d] as i64;
        a.acc_strides[d] = stride as i64;
    }
    if nd == 0 {
        a.sizes[0] = 1;
    }
    dev.launch(kern, (grid_for(index.numel(), THREADS), 1, 1), (THREADS, 1, 1), &a)
}

/// Concatenation: each input is copied into its slice of the output.
pub(crate) fn cat(ts: &[&Tensor], dim: usize, out_shape: &[usize], dtype: DType) -> Result<CudaStorage> {
    let dev = dev_of(ts[0])?;
    let out = CudaStorage::new(&dev, dtype, numel(out_shape))?;
    let strides = contiguous_strides(out_shape);
    let mut at = 0;
    for t in ts {
        let l = Layout { shape: t.shape().to_vec(), strides: strides.clone(), offset: at * strides[dim] };
        let ptr = out.ptr() + (l.offset * dtype.size_in_bytes()) as u64;
        map_into(&dev, "copy", &[(t, CType::of(t.dtype()))], ptr, dtype, &Layout { offset: 0, ..l }, CType::of(t.dtype()), "v0".into(), &[])?;
        at += t.shape()[dim];
    }
    Ok(out)
}

/// Constant padding: the input copied into the interior of a fresh buffer, and `value` written
/// only where the interior is not (a slab of each padded side; slabs of two dims may overlap,
/// which writes a corner twice): a padded product's operand is mostly interior.
pub(crate) fn pad(x: &Tensor, pads: &[(usize, usize)], value: f64, out_shape: &[usize]) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let dtype = x.dtype();
    let out = CudaStorage::new(&dev, dtype, numel(out_shape))?;
    if out.len == 0 {
        return Ok(out);
    }
    let strides = contiguous_strides(out_shape);
    let size = dtype.size_in_bytes() as u64;
    for (d, &(lo, hi)) in pads.iter().enumerate() {
        for (width, at) in [(lo, 0), (hi, lo + x.shape()[d])] {
            let mut shape = out_shape.to_vec();
            shape[d] = width;
            if numel(&shape) == 0 {
                continue;
            }
            let slab = Layout { shape, strides: strides.clone(), offset: 0 };
            let ptr = out.ptr() + (at * strides[d]) as u64 * size;
            fill_into(&dev, ptr, dtype, &slab, value)?;
        }
    }
    let offset: usize = pads.iter().zip(&strides).map(|(p, s)| p.0 * s).sum();
    let interior = Layout { shape: x.shape().to_vec(), strides, offset: 0 };
    let t = CType::of(dtype);
    map_into(&dev, "copy", &[(x, t)], out.ptr() + offset as u64 * size, dtype, &interior, t, "v0".into(), &[])?;
    Ok(out)
}

/// A library product in compiled code: `a` [B, M, K] @ `b` [B, K, N] as a [B, M, N] tensor,
/// with the bias epilogue when `bias` is set (see `blas::gemm`) and the algorithm timed when
/// `tune`; None when the epilogue cannot run here. `settled`: no kernel still running can be
/// writing `b` (a row's product then loads it early). `row`: the one-row kernel whose output `a`
/// is, not yet run: the product's kernel computes the row itself where it can, else the row
/// kernel runs first; either way it has run once this returns. `argmax`: instead of the
/// product, the index of its largest column as one I64 (a product of one row; `gemv`'s
/// kernels only, else None).
// The product's operands and its epilogue's parts, one each: a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, tune: bool, settled: bool, row: Option<&fused::PendingRow>, argmax: bool) -> Result<Option<Tensor>> {
    let dev = dev_of(a)?;
    let product_shape = [a.shape()[0], a.shape()[1], b.shape()[2]];
    let shape: &[usize] = if argmax { &[1] } else { &product_shape };
    // The bias packed once for both paths.
    let packed = packed_bias(bias, product_shape[2])?;
    if let Some(p) = row {
        if let (Some(packed), Some(r)) = (&packed, fused::row_prologue(p, gemv::THREADS)?) {
            if let Some(s) = gemv::product(&dev, a, b, dtype, epilogue(packed), settled, Some(&r), argmax)? {
                return Ok(Some(Tensor::from_backend(BackendStorage::Cuda(s), shape)));
            }
        }
        fused::run_pending_row(p)?;
    }
    let Some(packed) = packed else { return Ok(None) };
    let bias = epilogue(&packed);
    if let Some(s) = gemv::product(&dev, a, b, dtype, bias, settled, None, argmax)? {
        return Ok(Some(Tensor::from_backend(BackendStorage::Cuda(s), shape)));
    }
    if argmax {
        return Ok(None);
    }
    if let Some(s) = tf32::product(&dev, a, b, bias, settled)? {
        return Ok(Some(Tensor::from_backend(BackendStorage::Cuda(s), shape)));
    }
    Ok(blas::gemm(&dev, a, b, dtype, bias, tune)?.map(|s| Tensor::from_backend(BackendStorage::Cuda(s), shape)))
}

/// `gemm` of one row into `attend.out` with the cache attention `attend` in the same launch
/// (`gemv::product_attending`): the attention's output as `shape`, or None where that kernel does
/// not take them (nothing was queued, `row` has not run: the caller runs both as usual).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_attending(a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, settled: bool, row: Option<&fused::PendingRow>, attend: &gemv::Attend, shape: &[usize]) -> Result<Option<Tensor>> {
    let dev = dev_of(a)?;
    let Some(packed) = packed_bias(bias, b.shape()[2])? else { return Ok(None) };
    let prologue = match row {
        Some(p) => match fused::row_prologue(p, gemv::THREADS)? {
            Some(r) => Some(r),
            None => return Ok(None),
        },
        None => None,
    };
    Ok(gemv::product_attending(&dev, a, b, dtype, epilogue(&packed), settled, prologue.as_ref(), attend)?.map(|s| Tensor::from_backend(BackendStorage::Cuda(s), shape)))
}

/// A product's bias packed as the product kernels read it (`blas::bias_vector`), with its
/// activation: Some(None) without a bias, None where no epilogue runs it (no broadcast vector).
fn packed_bias(bias: Option<(&Tensor, Option<Activation>)>, n: usize) -> Result<Option<Option<PackedBias>>> {
    Ok(match bias {
        Some((t, act)) => blas::bias_vector(t, n)?.map(|v| Some((v, act))),
        None => Some(None),
    })
}

/// A bias vector as the product kernels read it, and the activation after it.
type PackedBias = (Tensor, Option<Activation>);

/// The epilogue a packed bias (`packed_bias`) gives the product kernels.
fn epilogue(packed: &Option<PackedBias>) -> Option<(&Tensor, Option<Activation>)> {
    packed.as_ref().map(|(v, act)| (v, *act))
}

pub(crate) fn bmm(a: &Tensor, b: &Tensor, dtype: DType) -> Result<CudaStorage> {
    let dev = dev_of(a)?;
    if dtype.is_float() {
        if let Some(s) = gemv::product(&dev, a, b, dtype, None, false, None, false)? {
            return Ok(s);
        }
        return blas::bmm(&dev, a, b, dtype);
    }
    let (bs, m, k, n) = (a.shape()[0], a.shape()[1], a.shape()[2], b.shape()[2]);
    let out = CudaStorage::new(&dev, dtype, bs * m * n)?;
    if out.len == 0 {
        return Ok(out);
    }
    let (name, src) = codegen::gen_int_bmm(dtype);
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name, src))?;
    let strides = |t: &Tensor| -> [i64; 3] { std::array::from_fn(|j| t.strides()[j] as i64) };
    let w = IntBmmArgs { out: out.ptr(), a: data_ptr(a)?, b: data_ptr(b)?, batch: bs as i64, m: m as i64, n: n as i64, k: k as i64, a_strides: strides(a), b_strides: strides(b) };
    dev.launch(kern, (grid_for(out.len, THREADS), 1, 1), (THREADS, 1, 1), &w)?;
    Ok(out)
}

/// Host → device: a contiguous copy of the CPU tensor's elements.
pub(crate) fn upload(device: usize, x: &Tensor) -> Result<CudaStorage> {
    let dev = crate::backend::cuda::device(device)?;
    let out = CudaStorage::new(&dev, x.dtype(), x.numel())?;
    if out.len == 0 {
        return Ok(out);
    }
    with_dtype!(x.dtype(), T => {
        let host = crate::backend::cpu::to_vec_as::<T>(x);
        let _rec = profiler::copy(&dev, &dev.stream, CopyKind::HostToDevice, out.len * x.dtype().size_in_bytes());
        // SAFETY: `out` holds host.len() elements of T; the copy completes before returning.
        unsafe { dr::memcpy_htod_sync(out.ptr(), &host) }.map_err(|e| dev.err("copy to device", e))?;
    });
    Ok(out)
}

/// Host → device without waiting: from the tensor's own memory when it is pinned and
/// contiguous, else through a pinned staging copy.
pub(crate) fn upload_async(device: usize, x: &Tensor) -> Result<CudaStorage> {
    let dev = crate::backend::cuda::device(device)?;
    let out = CudaStorage::new(&dev, x.dtype(), x.numel())?;
    let bytes = x.numel() * x.dtype().size_in_bytes();
    if bytes == 0 {
        return Ok(out);
    }
    if x.is_pinned() && x.is_contiguous() {
        let src = crate::backend::cpu::host_ptr(x);
        dev.upload_async(out.ptr(), src, bytes, Box::new(x.clone()))?;
    } else {
        let stage = crate::backend::cuda::PinnedBuffer::new(&dev, bytes)?;
        with_dtype!(x.dtype(), T => {
            let host = crate::backend::cpu::to_vec_as::<T>(x);
            // SAFETY: `stage` holds `bytes` = host.len() * size_of::<T>() bytes.
            unsafe { std::ptr::copy_nonoverlapping(host.as_ptr().cast::<u8>(), stage.ptr, bytes) };
        });
        let src = stage.ptr as *const u8;
        dev.upload_async(out.ptr(), src, bytes, Box::new(stage))?;
    }
    Ok(out)
}

/// Device → host: the tensor's elements, row-major. Waits for the device (an explicit read,
/// reported at the caller's call site).
#[track_caller]
pub(crate) fn download(x: &Tensor) -> Result<CpuStorage> {
    let dev = dev_of(x)?;
    let c = if x.is_contiguous() { x.clone() } else { x.copy_contiguous()? };
    let ptr = data_ptr(&c)?;
    dev.synchronize("copy to host")?;
    Ok(with_dtype!(x.dtype(), T => {
        let mut host = vec![<T as Default>::default(); c.numel()];
        if !host.is_empty() {
            let _rec = profiler::copy(&dev, &dev.stream, CopyKind::DeviceToHost, c.numel() * x.dtype().size_in_bytes());
            // SAFETY: the device buffer holds numel elements of T from `ptr`; work that writes
            // it was synchronised above.
            unsafe { dr::memcpy_dtoh_sync(&mut host, ptr) }.map_err(|e| dev.err("copy to host", e))?;
        }
        T::wrap(host)
    }))
}


/// (threads, values per thread) of a row kernel (eager or compiled) for rows of `k` columns
/// read `vec` at a time: up to 16 values per thread before adding threads (fewer registers,
/// more warps in flight), at most 32 values and 1024 threads. `KILN_ROWS_THREADS` (read once)
/// picks another thread count within those limits, for tuning (max-autotune then keeps it).
pub(crate) fn row_shape(k: usize, vec: usize) -> (usize, usize) {
    let least = k.div_ceil(32).next_power_of_two().clamp(32, 1024);
    let threads = match rows_threads_forced() {
        Some(t) => t.next_power_of_two().clamp(least, 1024),
        None => k.div_ceil(16).next_power_of_two().clamp(32, 512),
    };
    (threads, row_vpt(k, threads, vec))
}

/// `KILN_ROWS_THREADS`, read once.
pub(crate) fn rows_threads_forced() -> Option<usize> {
    crate::switches::rows_threads()
}

/// Values per thread of a row kernel with `threads` threads over rows of `k`: a power of two,
/// at least `vec`, with threads × values covering the row.
pub(crate) fn row_vpt(k: usize, threads: usize, vec: usize) -> usize {
    k.div_ceil(threads).next_power_of_two().max(vec)
}

/// The thread counts max-autotune times for a row kernel over rows of `k` read `vec` at a
/// time: powers of two from the fewest that keep at most 32 values per thread up to one vector
/// per thread (at most 1024).
pub(crate) fn row_thread_candidates(k: usize, vec: usize) -> Vec<usize> {
    let least = k.div_ceil(32).next_power_of_two().clamp(32, 1024);
    let most = k.div_ceil(vec.max(1)).next_power_of_two().clamp(least, 1024);
    std::iter::successors(Some(least), |t| Some(t * 2)).take_while(|&t| t <= most).collect()
}

