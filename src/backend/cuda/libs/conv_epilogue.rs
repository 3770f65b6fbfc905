//! Convolutions with their epilogue through cuDNN's graph API (`Op::Conv2dBiasAct`):
//! y = relu?(conv(x, w) + bias [+ z]), the bias per output channel in F32, z a residual of y's
//! shape, computed in F32 and rounded once into y (F16 / BF16), as one kernel of cuDNN's fused
//! convolution engines: an inference network's convolution, its folded batch norm, the residual
//! add and the ReLU read and write each activation once. The graph is the one PyTorch's
//! `cudnn_convolution_add_relu` builds (convolution, then pointwise add, add, ReLU forward).
//! Plans per geometry, built on first use and kept in the device's cuDNN state (as is the
//! absence of one: the caller then runs the convolution and its epilogue apart).

use crate::backend::cuda::kernels;
use crate::backend::cuda::libs::cudnn::{self, operand, session};
use crate::backend::cuda::libs::cudnn_graph::{execute, plans, ptr, tensor, Desc, Lives, Ops};
use crate::backend::cuda::CudaStorage;
use crate::ops::Conv2dArgs;
use crate::{DType, MemoryFormat, Result, Tensor};
use cudarc::cudnn::sys as cs;
use cs::{cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as T, cudnnBackendDescriptorType_t as DT};
use std::ffi::c_void;

/// The tensors' ids in a plan's variant pack.
const X: i64 = 1;
const W: i64 = 2;
const Y: i64 = 3;
const BIAS: i64 = 4;
const Z: i64 = 5;

/// What a plan depends on: the dtype, the input, weight and output dims, the convolution's
/// arguments, the operands' memory format, and which epilogue steps it has.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Key {
    dtype: DType,
    shapes: [[usize; 4]; 3],
    args: Conv2dArgs,
    format: MemoryFormat,
    residual: bool,
    relu: bool,
}

/// The strides of dense `[N, C, H, W]` dims in `format`'s order.
fn strides(d: [usize; 4], format: MemoryFormat) -> [usize; 4] {
    match format {
        MemoryFormat::ChannelsLast => [d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]],
        _ => [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1],
    }
}

/// The graph of `key`: the convolution into an F32 value, plus the bias, plus z, ReLU; the last
/// step writes y.
fn graph(key: &Key) -> std::result::Result<Ops, String> {
    use cs::cudnnPointwiseMode_t as M;
    let (dt, float) = (cudnn::data_type(key.dtype), cs::cudnnDataType_t::CUDNN_DATA_FLOAT);
    let [x, w, y] = key.shapes;
    let a = key.args;
    let pair = |p: (usize, usize)| [p.0 as i64, p.1 as i64];
    let conv = Desc::new(DT::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.set_type(A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, float)?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_CONV_MODE, T::CUDNN_TYPE_CONVOLUTION_MODE, &[cs::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION])?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, T::CUDNN_TYPE_INT64, &[2i64])?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, T::CUDNN_TYPE_INT64, &pair(a.dilation))?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, T::CUDNN_TYPE_INT64, &pair(a.stride))?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, T::CUDNN_TYPE_INT64, &pair(a.padding))?;
    conv.set(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, T::CUDNN_TYPE_INT64, &pair(a.padding))?;
    let conv = conv.finalize()?;
    let mut g = Ops::default();
    let (ys, f) = (strides(y, key.format), key.format);
    let xt = g.keep(tensor(X, dt, x, strides(x, f), Lives::Memory)?);
    let wt = g.keep(tensor(W, dt, w, strides(w, f), Lives::Memory)?);
    let out = g.keep(tensor(Y, dt, y, ys, Lives::Memory)?);
    let acc = g.virtual_tensor(float, y, ys)?;
    let tensors = [(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, xt), (A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, wt), (A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, acc)];
    g.push_op_then(DT::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, Some((A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, conv)), &tensors, |op| {
        op.set(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, T::CUDNN_TYPE_FLOAT, &[1f32])?;
        op.set(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, T::CUDNN_TYPE_FLOAT, &[0f32])
    })?;
    let o = y[1];
    let bias = g.keep(tensor(BIAS, float, [1, o, 1, 1], [o, 1, o, o], Lives::Memory)?);
    // Each step into a virtual F32 value, the last into y.
    let mut steps: Vec<(M, Option<usize>)> = vec![(M::CUDNN_POINTWISE_ADD, Some(bias))];
    if key.residual {
        let z = g.keep(tensor(Z, dt, y, ys, Lives::Memory)?);
        steps.push((M::CUDNN_POINTWISE_ADD, Some(z)));
    }
    if key.relu {
        steps.push((M::CUDNN_POINTWISE_RELU_FWD, None));
    }
    let mut value = acc;
    for (i, (mode, operand)) in steps.iter().enumerate() {
        let next = if i + 1 == steps.len() { out } else { g.virtual_tensor(float, y, ys)? };
        g.pointwise(*mode, value, *operand, next)?;
        value = next;
    }
    Ok(g)
}

/// Engine configurations timed per geometry (the heuristics' first ones that finalize; each
/// plan cuDNN finalizes may compile a kernel).
const TIMED: usize = 4;

/// relu?(conv(x, w) + bias [+ z]) as a new buffer dense in channels-last order (x's dtype, F16
/// or BF16; `bias` `[O]` in F32). `shapes` are the input, weight and output dims. The plan is
/// the fastest of the heuristics' first `TIMED` engine configurations, timed on these operands
/// the first time a geometry runs (as PyTorch's `cudnn.benchmark`; remembered on disk with
/// max-autotune's choices), the first of them where timing cannot run (a graph capture). None:
/// cuDNN has no plan for it, or the operands are not channels-last (cuDNN's fused engines are
/// NHWC ones), or a rehearsal meets a geometry not planned yet; nothing was queued.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(args: &Conv2dArgs, shapes: [[usize; 4]; 3], x: &Tensor, w: &Tensor, bias: &Tensor, z: Option<&Tensor>, relu: bool, format: MemoryFormat) -> Result<Option<CudaStorage>> {
    let dtype = x.dtype();
    if !matches!(dtype, DType::F16 | DType::BF16) || format != MemoryFormat::ChannelsLast || args.groups != 1 || bias.dtype() != DType::F32 || cudnn::library().is_err() {
        return Ok(None);
    }
    if shapes.iter().any(|s| s.contains(&0) || s.iter().product::<usize>() > i32::MAX as usize) {
        return Ok(None);
    }
    let dev = kernels::dev_of(x)?;
    let key = Key { dtype, shapes, args: *args, format, residual: z.is_some(), relu };
    let op = "conv2d_bias_act";
    session(&dev, op, |st| {
        let rehearsal = dev.work().stream().is_none();
        if rehearsal && !st.conv_epilogue.contains_key(&key) {
            return Ok(None);
        }
        let out = CudaStorage::new(&dev, dtype, shapes[2].iter().product())?;
        if rehearsal {
            return Ok(st.conv_epilogue[&key].is_some().then_some(out));
        }
        let (x, w) = (operand(x, format)?, operand(w, format)?);
        let z = z.map(|z| operand(z, format)).transpose()?;
        let bias = operand(bias, MemoryFormat::Contiguous)?;
        let mut ptrs: Vec<(i64, *mut c_void)> = vec![(X, ptr(kernels::data_ptr(&x)?)), (W, ptr(kernels::data_ptr(&w)?)), (Y, ptr(out.ptr())), (BIAS, ptr(kernels::data_ptr(&bias)?))];
        if let Some(z) = &z {
            ptrs.push((Z, ptr(kernels::data_ptr(z)?)));
        }
        if !st.conv_epilogue.contains_key(&key) {
            let chosen = choose(&dev, st.handle, &key, &ptrs);
            st.conv_epilogue.insert(key.clone(), chosen);
        }
        let Some(p) = st.conv_epilogue[&key].as_ref() else { return Ok(None) };
        let _rec = crate::profiler::cudnn(&dev, "conv2d_bias_act_fwd", dtype);
        execute(&dev, st.handle, p, &ptrs, op)?;
        Ok(Some(out))
    })
}

/// The plan for `key`: the remembered choice, else the fastest of the first `TIMED` that
/// finalize (run on `ptrs`, whose output each overwrites), else the first. Logged under
/// `KILN_LOG=kernels`.
fn choose(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, h: cs::cudnnHandle_t, key: &Key, ptrs: &[(i64, *mut c_void)]) -> Option<crate::backend::cuda::libs::cudnn_graph::Plan> {
    use crate::backend::cuda::tuning::autotune;
    let started = std::time::Instant::now();
    // (An index into the heuristics' order: valid for this cuDNN only.)
    let memo = format!("cudnn conv2d_bias_act {key:?}|{}|cudnn {}", dev.tune_ident, cudnn::library().unwrap_or(0));
    let remembered: Option<usize> = autotune::lookup(&memo).and_then(|v| v.parse().ok());
    let timing = remembered.is_none() && autotune::allowed(dev);
    let most = remembered.map_or(if timing { TIMED } else { 1 }, |i| i + 1);
    let mut plans = match graph(key).and_then(|g| plans(h, g, most)) {
        Ok(p) => p,
        Err(why) => {
            crate::logging::log(crate::logging::Topic::Kernels, || format!("cudnn convolution epilogue: no plan for {key:?} ({why})"));
            return None;
        }
    };
    let at = match remembered {
        Some(i) => i.min(plans.len() - 1),
        None if timing && plans.len() > 1 => {
            let timed: Vec<(String, usize, Option<f64>)> = plans.iter().enumerate().map(|(i, p)| (format!("engine configuration {i}"), i, autotune::time_ms(dev, || execute(dev, h, p, ptrs, "conv2d_bias_act")))).collect();
            match autotune::pick(&format!("cudnn conv2d_bias_act {key:?}"), &timed) {
                Some((i, _)) => {
                    autotune::store(&memo, &i.to_string());
                    i
                }
                None => 0,
            }
        }
        None => 0,
    };
    crate::logging::log(crate::logging::Topic::Kernels, || format!("cudnn convolution epilogue: plan {at} of {} for {key:?}, {:.1} ms", plans.len(), started.elapsed().as_secs_f64() * 1e3));
    Some(plans.swap_remove(at))
}
