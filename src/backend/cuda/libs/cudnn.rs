//! Convolutions through cuDNN (loaded at run time, like every CUDA library here): the forward
//! product and the two gradients (backward data, backward filter) of the `Conv2d*` ops, on
//! NCHW tensors, or NHWC ones (channels-last, the layout of the tensor-core kernels). F32 uses
//! FMA math — no TF32 unless `allow_tf32` is on — and F16 / BF16 use tensor cores with F32
//! accumulation. Algorithms are cuDNN's heuristic choice, kept
//! per geometry on the device; each call's workspace comes from the caching allocator (from the
//! graph's pool while a CUDA graph is captured), and calls run on the thread's work stream.

use crate::backend::cuda::{kernels, CudaStorage};
use crate::ops::conv::{Conv2dArgs, ConvPass};
use crate::{DType, Error, MemoryFormat, Result, Tensor};
use cudarc::cudnn::{result as cr, sys as cs};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// The entry points used here, checked once: a library lacking one is reported, not called.
const SYMBOLS: [&str; 23] = [
    "cudnnGetVersion",
    "cudnnCreate",
    "cudnnSetStream",
    "cudnnCreateTensorDescriptor",
    "cudnnSetTensor4dDescriptor",
    "cudnnDestroyTensorDescriptor",
    "cudnnCreateFilterDescriptor",
    "cudnnSetFilter4dDescriptor",
    "cudnnDestroyFilterDescriptor",
    "cudnnCreateConvolutionDescriptor",
    "cudnnSetConvolution2dDescriptor",
    "cudnnSetConvolutionGroupCount",
    "cudnnSetConvolutionMathType",
    "cudnnDestroyConvolutionDescriptor",
    "cudnnGetConvolutionForwardAlgorithm_v7",
    "cudnnGetConvolutionForwardWorkspaceSize",
    "cudnnConvolutionForward",
    "cudnnGetConvolutionBackwardDataAlgorithm_v7",
    "cudnnGetConvolutionBackwardDataWorkspaceSize",
    "cudnnConvolutionBackwardData",
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
    "cudnnGetConvolutionBackwardFilterWorkspaceSize",
    "cudnnConvolutionBackwardFilter",
];

/// The loaded cuDNN's version (`cudnnGetVersion`, e.g. 91000 for 9.10.0), or why it cannot be
/// used. Probed once per process.
pub(crate) fn library() -> std::result::Result<usize, String> {
    static LIB: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cs::is_culib_present() } {
            return Err("the cuDNN library (libcudnn.so.9) could not be loaded: is its directory on LD_LIBRARY_PATH?".into());
        }
        // SAFETY: present (checked above), so this does not panic; symbols are only looked up.
        let lib = unsafe { cs::culib() };
        for name in SYMBOLS {
            // SAFETY: a lookup; the symbol is not called here.
            if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                return Err(format!("the loaded cuDNN library has no {name}"));
            }
        }
        let v = cr::get_version();
        if v < 90000 {
            return Err(format!("cuDNN {v} was loaded; kiln needs cuDNN 9"));
        }
        Ok(v)
    })
    .clone()
}

/// Whether a convolution of `dtype` on a CUDA device runs through cuDNN (F64 and machines
/// without a usable cuDNN use the im2col definition instead, said once on stderr).
pub(crate) fn usable(dtype: DType) -> bool {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return false;
    }
    match library() {
        Ok(_) => true,
        Err(why) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| crate::logging::warn(crate::logging::Topic::Kernels, &format!("conv2d runs as im2col + matmul on CUDA: {why}")));
            false
        }
    }
}

/// What picks an algorithm: the pass, dtype, math and geometry (the output follows from them).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    pass: ConvPass,
    dtype: DType,
    tf32: bool,
    /// Deterministic algorithms only (`set_cudnn_deterministic`).
    deterministic: bool,
    x: [usize; 4],
    w: [usize; 4],
    args: Conv2dArgs,
    format: MemoryFormat,
}

#[derive(Clone, Copy, Debug)]
enum Algo {
    Fwd(cs::cudnnConvolutionFwdAlgo_t),
    Data(cs::cudnnConvolutionBwdDataAlgo_t),
    Filter(cs::cudnnConvolutionBwdFilterAlgo_t),
}

/// An algorithm that ran for a geometry, with its math type and workspace size.
#[derive(Clone, Copy, Debug)]
struct Choice {
    algo: Algo,
    math: cs::cudnnMathType_t,
    workspace: usize,
}

/// A device's cuDNN handle and the algorithms chosen so far.
pub(crate) struct State {
    pub(crate) handle: cs::cudnnHandle_t,
    chosen: HashMap<Key, Choice>,
    /// Attention plans by geometry (None: cuDNN offered no engine for it).
    pub(crate) sdpa: HashMap<crate::backend::cuda::libs::sdpa::Key, Option<crate::backend::cuda::libs::cudnn_graph::Plan>>,
    /// Convolution-with-epilogue plans by geometry (None: no engine for it).
    pub(crate) conv_epilogue: HashMap<crate::backend::cuda::libs::conv_epilogue::Key, Option<crate::backend::cuda::libs::cudnn_graph::Plan>>,
}
// SAFETY: the handle is used under the device's mutex only.
unsafe impl Send for State {}

struct TensorDesc(cs::cudnnTensorDescriptor_t);
struct FilterDesc(cs::cudnnFilterDescriptor_t);
struct ConvDesc(cs::cudnnConvolutionDescriptor_t);
impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created by create_tensor_descriptor, destroyed once.
        let _ = unsafe { cr::destroy_tensor_descriptor(self.0) };
    }
}
impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: as above.
        let _ = unsafe { cr::destroy_filter_descriptor(self.0) };
    }
}
impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: as above.
        let _ = unsafe { cr::destroy_convolution_descriptor(self.0) };
    }
}

/// The descriptors of one convolution: input, weight, output and the convolution itself.
struct Descs {
    x: TensorDesc,
    w: FilterDesc,
    y: TensorDesc,
    conv: ConvDesc,
}

/// cuDNN's name for a tensor dtype (F16, BF16; F32 for the rest, which callers convert).
pub(crate) fn data_type(dtype: DType) -> cs::cudnnDataType_t {
    match dtype {
        DType::F16 => cs::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => cs::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        _ => cs::cudnnDataType_t::CUDNN_DATA_FLOAT,
    }
}

fn i32s(s: [usize; 4]) -> [i32; 4] {
    s.map(|d| d as i32)
}

impl Descs {
    /// Input, weight and output are all stored in `format`'s order (the weight as KRSC for
    /// channels-last); the dims are given as NCHW either way.
    fn new(dtype: DType, args: &Conv2dArgs, [x, w, y]: [[usize; 4]; 3], math: cs::cudnnMathType_t, format: MemoryFormat) -> std::result::Result<Descs, cr::CudnnError> {
        let dt = data_type(dtype);
        let nchw = match format {
            MemoryFormat::Contiguous => cs::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            MemoryFormat::ChannelsLast => cs::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        };
        // SAFETY: each descriptor is freshly created and owned by its guard; the sizes were
        // checked to fit in i32.
        unsafe {
            let xd = TensorDesc(cr::create_tensor_descriptor()?);
            cr::set_tensor4d_descriptor(xd.0, nchw, dt, i32s(x))?;
            let yd = TensorDesc(cr::create_tensor_descriptor()?);
            cr::set_tensor4d_descriptor(yd.0, nchw, dt, i32s(y))?;
            let wd = FilterDesc(cr::create_filter_descriptor()?);
            cr::set_filter4d_descriptor(wd.0, dt, nchw, i32s(w))?;
            let cd = ConvDesc(cr::create_convolution_descriptor()?);
            let (p, s, d) = (args.padding, args.stride, args.dilation);
            // F32 accumulation for every dtype (F16/BF16: cuDNN's "pseudo" half configurations).
            cr::set_convolution2d_descriptor(
                cd.0,
                p.0 as i32,
                p.1 as i32,
                s.0 as i32,
                s.1 as i32,
                d.0 as i32,
                d.1 as i32,
                cs::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                cs::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )?;
            cr::set_convolution_group_count(cd.0, args.groups as i32)?;
            cr::set_convolution_math_type(cd.0, math)?;
            Ok(Descs { x: xd, w: wd, y: yd, conv: cd })
        }
    }
}

/// The math type asked of the heuristics: FMA only for F32 unless TF32 is allowed, tensor cores
/// for F16/BF16 (accumulating in F32, as the descriptor says).
fn base_math(dtype: DType, tf32: bool) -> cs::cudnnMathType_t {
    use cs::cudnnMathType_t::*;
    match dtype {
        DType::F32 if !tf32 => CUDNN_FMA_MATH,
        DType::F32 => CUDNN_DEFAULT_MATH,
        _ => CUDNN_TENSOR_OP_MATH,
    }
}

/// The math type a candidate runs with, or None to skip it: never a down-conversion of the
/// data, and for F32 without TF32 always FMA.
fn run_math(dtype: DType, tf32: bool, proposed: cs::cudnnMathType_t) -> Option<cs::cudnnMathType_t> {
    use cs::cudnnMathType_t::*;
    match proposed {
        CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION => None,
        CUDNN_TENSOR_OP_MATH if dtype == DType::F32 && !tf32 => None,
        _ if dtype == DType::F32 && !tf32 => Some(CUDNN_FMA_MATH),
        m => Some(m),
    }
}

/// cuDNN's candidates for `pass`, best first, with the math type each proposes.
///
/// # Safety
/// `h` and the descriptors must be live.
unsafe fn candidates(h: cs::cudnnHandle_t, pass: ConvPass, d: &Descs, deterministic: bool) -> std::result::Result<Vec<(Algo, cs::cudnnMathType_t)>, cr::CudnnError> {
    let mut n = 0i32;
    let ok = cs::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
    let kept = |status: cs::cudnnStatus_t, determinism: cs::cudnnDeterminism_t| status == ok && (!deterministic || determinism == cs::cudnnDeterminism_t::CUDNN_DETERMINISTIC);
    Ok(match pass {
        ConvPass::Forward => {
            // SAFETY: all-zero is a valid value of this plain C struct (every enum has a 0).
            let mut perf: [cs::cudnnConvolutionFwdAlgoPerf_t; 8] = std::mem::zeroed();
            cr::get_convolution_forward_algorithm(h, d.x.0, d.w.0, d.conv.0, d.y.0, perf.len() as i32, &mut n, perf.as_mut_ptr())?;
            perf[..(n.max(0) as usize).min(perf.len())].iter().filter(|p| kept(p.status, p.determinism)).map(|p| (Algo::Fwd(p.algo), p.mathType)).collect()
        }
        ConvPass::GradInput => {
            let mut perf: [cs::cudnnConvolutionBwdDataAlgoPerf_t; 8] = std::mem::zeroed();
            cr::get_convolution_backward_data_algorithm(h, d.w.0, d.y.0, d.conv.0, d.x.0, perf.len() as i32, &mut n, perf.as_mut_ptr())?;
            perf[..(n.max(0) as usize).min(perf.len())].iter().filter(|p| kept(p.status, p.determinism)).map(|p| (Algo::Data(p.algo), p.mathType)).collect()
        }
        ConvPass::GradWeight => {
            let mut perf: [cs::cudnnConvolutionBwdFilterAlgoPerf_t; 8] = std::mem::zeroed();
            cr::get_convolution_backward_filter_algorithm(h, d.x.0, d.y.0, d.conv.0, d.w.0, perf.len() as i32, &mut n, perf.as_mut_ptr())?;
            perf[..(n.max(0) as usize).min(perf.len())].iter().filter(|p| kept(p.status, p.determinism)).map(|p| (Algo::Filter(p.algo), p.mathType)).collect()
        }
    })
}

/// Workspace bytes `algo` needs (with the math type already set on the descriptor).
///
/// # Safety
/// `h` and the descriptors must be live.
unsafe fn workspace_size(h: cs::cudnnHandle_t, algo: Algo, d: &Descs) -> std::result::Result<usize, cr::CudnnError> {
    match algo {
        Algo::Fwd(a) => cr::get_convolution_forward_workspace_size(h, d.x.0, d.w.0, d.conv.0, d.y.0, a),
        Algo::Data(a) => cr::get_convolution_backward_data_workspace_size(h, d.w.0, d.y.0, d.conv.0, d.x.0, a),
        Algo::Filter(a) => cr::get_convolution_backward_filter_workspace_size(h, d.x.0, d.y.0, d.conv.0, d.w.0, a),
    }
}

/// The device pointers of one call: the two inputs and the output, in the pass's roles.
#[derive(Clone, Copy)]
struct Ptrs {
    a: u64,
    b: u64,
    out: u64,
}

/// Queues `algo` on the handle's stream: out = pass(a, b), overwritten (beta = 0).
///
/// # Safety
/// `h` and the descriptors must be live; the pointers must be device buffers of the described
/// shapes and dtype, and `ws` one of `ws_bytes` (or null with 0), all alive in stream order.
unsafe fn execute(h: cs::cudnnHandle_t, algo: Algo, d: &Descs, p: Ptrs, ws: u64, ws_bytes: usize) -> std::result::Result<(), cr::CudnnError> {
    // Host scaling factors in the compute type (F32 for every dtype used here).
    let (one, zero) = (1.0f32, 0.0f32);
    let (alpha, beta) = (&one as *const f32 as *const c_void, &zero as *const f32 as *const c_void);
    let (a, b, out, ws) = (p.a as *const c_void, p.b as *const c_void, p.out as *mut c_void, ws as *mut c_void);
    match algo {
        Algo::Fwd(al) => cr::convolution_forward(h, alpha, d.x.0, a, d.w.0, b, d.conv.0, al, ws, ws_bytes, beta, d.y.0, out),
        Algo::Data(al) => cr::convolution_backward_data(h, alpha, d.w.0, b, d.y.0, a, d.conv.0, al, ws, ws_bytes, beta, d.x.0, out),
        Algo::Filter(al) => cr::convolution_backward_filter(h, alpha, d.x.0, a, d.y.0, b, d.conv.0, al, ws, ws_bytes, beta, d.w.0, out),
    }
}

/// An operand as cuDNN reads it: dense in `format`'s order, 16-byte aligned (a copy otherwise:
/// a fresh block, aligned by the allocator).
pub(crate) fn operand(t: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    if t.is_contiguous_for(format) && kernels::data_ptr(t)? % 16 == 0 {
        return Ok(t.clone());
    }
    crate::ops::dense_copy(t, format)
}

fn pass_name(pass: ConvPass) -> &'static str {
    match pass {
        ConvPass::Forward => "conv2d_fwd",
        ConvPass::GradInput => "conv2d_bwd_data",
        ConvPass::GradWeight => "conv2d_bwd_filter",
    }
}

/// One convolution product through cuDNN. `shapes` are the input `[N, C, H, W]`, weight
/// `[O, C / groups, KH, KW]` and output `[N, O, OH, OW]` of the forward convolution; `a`, `b`
/// are the op's operands in its order ((x, w), (dy, w) or (x, dy)). Returns the pass's result,
/// dense in `format`'s order (as are the operands cuDNN reads).
pub(crate) fn conv(pass: ConvPass, args: &Conv2dArgs, shapes: [[usize; 4]; 3], a: &Tensor, b: &Tensor, format: MemoryFormat) -> Result<CudaStorage> {
    let dev = kernels::dev_of(a)?;
    let dtype = a.dtype();
    let [x, w, y] = shapes;
    let out_shape = match pass {
        ConvPass::Forward => y,
        ConvPass::GradInput => x,
        ConvPass::GradWeight => w,
    };
    let out = CudaStorage::new(&dev, dtype, out_shape.iter().product())?;
    if out.len == 0 || dev.work().stream().is_none() {
        return Ok(out);
    }
    // A sum over nothing (no input channels, no batch, an empty image): zeros. cuDNN refuses
    // empty dims.
    if shapes.iter().any(|s| s.contains(&0)) {
        kernels::zero_fill(&dev, &out)?;
        return Ok(out);
    }
    let describe = || format!("input {x:?}, weight {w:?}, output {y:?}, {args:?}, {dtype:?}");
    let big = shapes.iter().find(|s| s.iter().product::<usize>() > i32::MAX as usize || args.padding.0.max(args.padding.1) > i32::MAX as usize);
    if big.is_some() {
        return Err(Error::arg("conv2d", format!("{}: cuDNN takes tensors of at most 2^31 - 1 elements; split the batch", describe())));
    }
    let (a, b) = (operand(a, format)?, operand(b, format)?);
    let ptrs = Ptrs { a: kernels::data_ptr(&a)?, b: kernels::data_ptr(&b)?, out: out.ptr() };
    let tf32 = crate::backend::cuda::allow_tf32();
    let key = Key { pass, dtype, tf32, deterministic: crate::backend::cuda::device::cudnn_deterministic(), x, w, args: *args, format };
    let fail = |call: &str, e: &dyn std::fmt::Debug| Error::Cuda { op: "conv2d", device: dev.kiln_device(), msg: format!("{call} failed ({e:?}) for {}", describe()) };

    session(&dev, "conv2d", |st| run_conv(&dev, st, pass, dtype, &key, &shapes, &ptrs, &fail, &describe))?;
    Ok(out)
}

/// Runs `f` with the device's cuDNN state (its handle created on first use), the handle bound
/// to the thread's work stream (the capture stream while a CUDA graph is captured here).
pub(crate) fn session<R>(dev: &Arc<crate::backend::cuda::CudaDevice>, op: &'static str, f: impl FnOnce(&mut State) -> Result<R>) -> Result<R> {
    let fail = |call: &str, e: &dyn std::fmt::Debug| Error::Cuda { op, device: dev.kiln_device(), msg: format!("{call} failed ({e:?})") };
    dev.bind()?;
    let mut guard = dev.cudnn.lock();
    if guard.is_none() {
        let handle = cr::create_handle().map_err(|e| fail("cudnnCreate", &e))?;
        *guard = Some(State { handle, chosen: HashMap::new(), sdpa: HashMap::new(), conv_epilogue: HashMap::new() });
    }
    let st = guard.as_mut().expect("created above");
    // (A rehearsal runs no library call: the handle keeps its stream.)
    if let Some(stream) = dev.work().stream() {
        // SAFETY: a live handle; the stream outlives it.
        unsafe { cr::set_stream(st.handle, stream.cu_stream() as cs::cudaStream_t) }.map_err(|e| fail("cudnnSetStream", &e))?;
    }
    f(st)
}

#[allow(clippy::too_many_arguments)]
fn run_conv(dev: &Arc<crate::backend::cuda::CudaDevice>, st: &mut State, pass: ConvPass, dtype: DType, key: &Key, shapes: &[[usize; 4]; 3], ptrs: &Ptrs, fail: &dyn Fn(&str, &dyn std::fmt::Debug) -> Error, describe: &dyn Fn() -> String) -> Result<()> {
    let (args, tf32, shapes, ptrs) = (&key.args, key.tf32, *shapes, *ptrs);
    let h = st.handle;
    let descs = Descs::new(dtype, args, shapes, base_math(dtype, tf32), key.format).map_err(|e| fail("creating descriptors", &e))?;

    // Runs one algorithm with a workspace from the caching allocator.
    let attempt = |c: Choice| -> Result<()> {
        // SAFETY: a live descriptor.
        unsafe { cr::set_convolution_math_type(descs.conv.0, c.math) }.map_err(|e| fail("cudnnSetConvolutionMathType", &e))?;
        let ws = if c.workspace > 0 { Some(dev.alloc(c.workspace)?) } else { None };
        let _rec = crate::profiler::cudnn(dev, pass_name(pass), dtype);
        // SAFETY: operands and output are live device buffers of the described shapes (kept
        // until this returns; later reuse of their blocks is in stream order), as is `ws`.
        let r = unsafe { execute(h, c.algo, &descs, ptrs, ws.map_or(0, |b| b.ptr), c.workspace) };
        if let Some(b) = ws {
            // Freed in stream order: the allocator hands it out again only to later work.
            dev.free(b);
        }
        r.map_err(|e| fail(&format!("{:?}", c.algo), &e))
    };

    if let Some(c) = st.chosen.get(key).copied() {
        return attempt(c);
    }
    // SAFETY: a live handle and descriptors.
    let cands = unsafe { candidates(h, pass, &descs, key.deterministic) }.map_err(|e| fail("the algorithm heuristics", &e))?;
    let mut last = None;
    for (algo, proposed) in cands {
        let Some(math) = run_math(dtype, tf32, proposed) else { continue };
        // SAFETY: a live descriptor; the math type must be set before the workspace query.
        if unsafe { cr::set_convolution_math_type(descs.conv.0, math) }.is_err() {
            continue;
        }
        // SAFETY: a live handle and descriptors.
        let workspace = match unsafe { workspace_size(h, algo, &descs) } {
            Ok(n) => n,
            Err(e) => {
                last = Some(fail(&format!("workspace size of {algo:?}"), &e));
                continue;
            }
        };
        let c = Choice { algo, math, workspace };
        // An algorithm whose workspace does not fit, or that refuses this geometry, gives way
        // to the next one.
        match attempt(c) {
            Ok(()) => {
                crate::logging::log(crate::logging::Topic::Kernels, || format!("cudnn {}: {c:?} for {}", pass_name(pass), describe()));
                st.chosen.insert(key.clone(), c);
                return Ok(());
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| fail("the algorithm heuristics", &"no algorithm proposed")))
}
