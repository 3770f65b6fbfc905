//! Custom ops' kernels (`kiln::CustomOp`): user CUDA C compiled by NVRTC through the same
//! per-device and on-disk caches as generated kernels, checked against the call's arguments,
//! and launched on the device's stream through `CudaDevice::launch_params` (so the profiler and
//! `launch_count` see them).

use crate::backend::cuda::kernels::{data_ptr, dev_of};
use crate::backend::cuda::{CudaDevice, CudaStorage, Kernel, KernelKey};
use crate::custom::{KernelArg, LaunchSpec};
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{DType, Error, Result, Tensor};
use std::sync::Arc;

/// A user kernel: its source and the name of its `extern "C" __global__` function.
pub(crate) struct UserKernel<'a> {
    pub op: &'static str,
    pub source: &'a Arc<str>,
    pub name: &'a Arc<str>,
}

/// The C type `scalar_t` / `out_t` stand for with elements of `d`.
fn c_type(op: &'static str, d: DType) -> Result<&'static str> {
    Ok(match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::I32 => "int",
        DType::I64 => "long long",
        DType::U8 => "unsigned char",
        _ => return Err(Error::dtype(op, d, "custom CUDA kernels take F32, F64, I32, I64 or U8 tensors")),
    })
}

/// A fresh contiguous (uninitialised) CUDA tensor on `like`'s device.
pub(crate) fn empty(like: &Tensor, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let dev = dev_of(like)?;
    let s = CudaStorage::new(&dev, dtype, shape.iter().product())?;
    Ok(Tensor::from_parts(Arc::new(Storage::cuda(s)), Layout::contiguous(shape), dtype, false))
}

/// Runs the kernel on contiguous `inputs` (all of one dtype), writing `out` (contiguous).
pub(crate) fn launch(k: &UserKernel, inputs: &[&Tensor], out: &Tensor, spec: &LaunchSpec) -> Result<()> {
    let dev = dev_of(out)?;
    let threads = spec.threads();
    if threads == 0 || threads > 1024 {
        return Err(Error::arg(k.op, format!("a block of {:?} threads: a block holds 1 to 1024 threads", spec.block)));
    }
    if spec.is_empty() {
        return Ok(());
    }
    let types = (c_type(k.op, inputs[0].dtype())?, c_type(k.op, out.dtype())?);
    let key = KernelKey::Custom { source: k.source.clone(), name: k.name.clone(), types };
    let options = [format!("-Dscalar_t={}", types.0), format!("-Dout_t={}", types.1)];
    let kern = dev.kernel_with(key, &options, || (k.name.to_string(), k.source.to_string())).map_err(|e| match e {
        Error::Cuda { op: "get function", .. } => Error::arg(
            k.op,
            format!("the CUDA source defines no kernel named `{}`; declare it `extern \"C\" __global__ void {}(...)` so that its name is not mangled", k.name, k.name),
        ),
        e => e,
    })?;
    let mut words: Vec<u64> = inputs.iter().map(|t| data_ptr(t)).collect::<Result<_>>()?;
    words.push(data_ptr(out)?);
    words.extend(spec.args.iter().map(|a| a.word()));
    check_params(&dev, kern, k, inputs.len(), &spec.args)?;
    dev.allow_shared(kern, spec.shared_mem)?;
    let mut params: Vec<*mut std::ffi::c_void> = words.iter_mut().map(|w| w as *mut u64 as *mut std::ffi::c_void).collect();
    // SAFETY: one word per parameter: pointers are 8 bytes, scalars sit in the low bytes of
    // their word (little-endian hosts), and `check_params` compared the sizes with the
    // kernel's where the driver reports them. The buffers belong to tensors the caller holds
    // and are reused only in stream order.
    unsafe { dev.launch_params(kern, spec.grid, spec.block, spec.shared_mem, &mut params) }
}

/// Compares the call's parameters (pointers, then scalars) with the kernel's, as the driver
/// reports them (CUDA 12.4 and later; older drivers skip the check).
fn check_params(dev: &CudaDevice, kern: Kernel, k: &UserKernel, n_inputs: usize, args: &[KernelArg]) -> Result<()> {
    let sizes = dev.param_sizes(kern);
    // Every call passes at least two parameters: no answer means the driver cannot tell.
    if sizes.is_empty() {
        return Ok(());
    }
    let mut want = vec![8; n_inputs + 1];
    want.extend(args.iter().map(|a| a.size()));
    if sizes == want {
        return Ok(());
    }
    let scalars: Vec<&str> = args.iter().map(|a| a.c_type()).collect();
    Err(Error::arg(
        k.op,
        format!(
            "kernel `{}` has {} parameters of {sizes:?} bytes, but the call passes {}: {n_inputs} input pointer(s), the output pointer, then the launch spec's arguments ({}); \
             the kernel must take (const scalar_t* in0, ..., out_t* out, launch arguments...)",
            k.name,
            sizes.len(),
            want.len(),
            if scalars.is_empty() { "none".to_string() } else { scalars.join(", ") }
        ),
    ))
}
