//! Max pooling on the GPU (`ops::pool`, `maxpool.cu`): the forward a thread per window, the
//! backward a thread per input position; inputs of any strides, outputs contiguous.

use crate::backend::cuda::kernels::codegen::{self, PRELUDE};
use crate::backend::cuda::kernels::{data_ptr, dev_of};
use crate::backend::cuda::{kernel_args, CudaStorage, KernelKey};
use crate::dtype::CType;
use crate::ops::pool::MaxPool2dArgs;
use crate::{DType, Result, Tensor};
use std::fmt::Write;

const SOURCE: &str = include_str!("maxpool.cu");
const THREADS: usize = 256;

kernel_args! {
    /// What `maxpool.cu` reads: the input `x` (and the output's gradient `dy` for the backward)
    /// with their strides, `planes` = N * C planes of `h` x `w` under `oh` x `ow` windows.
    MaxPoolArgs {
        x: u64, dy: u64, out: u64,
        planes: i64, c: i64, h: i64, w: i64, oh: i64, ow: i64,
        kh: i64, kw: i64, sh: i64, sw: i64, ph: i64, pw: i64, dh: i64, dw: i64,
        xs: i64[4], gs: i64[4],
    }
}

/// The maximum of every window of `x` `[N, C, H, W]`: a new `out` `[N, C, OH, OW]`.
pub(crate) fn max_pool2d(x: &Tensor, a: &MaxPool2dArgs, out: &[usize]) -> Result<CudaStorage> {
    run(x, None, a, out)
}

/// `max_pool2d`'s gradient for `x` from the output's gradient `dy`: a new buffer of x's shape.
pub(crate) fn max_pool2d_backward(x: &Tensor, dy: &Tensor, a: &MaxPool2dArgs) -> Result<CudaStorage> {
    run(x, Some(dy), a, dy.shape())
}

fn run(x: &Tensor, dy: Option<&Tensor>, a: &MaxPool2dArgs, windows: &[usize]) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let dtype = x.dtype();
    let s = x.shape();
    let n = if dy.is_some() { x.numel() } else { windows.iter().product() };
    let res = CudaStorage::new(&dev, dtype, n)?;
    if n == 0 {
        return Ok(res);
    }
    let name = format!("max_pool2d{}_{}", if dy.is_some() { "_backward" } else { "" }, dtype.torch_name());
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name.clone(), source(&name, dtype, dy.is_none())))?;
    let strides = |t: &Tensor| -> [i64; 4] { std::array::from_fn(|d| t.strides()[d] as i64) };
    let i = |v: usize| v as i64;
    let args = MaxPoolArgs {
        x: data_ptr(x)?,
        dy: dy.map(data_ptr).transpose()?.unwrap_or(0),
        out: res.ptr(),
        planes: i(s[0] * s[1]),
        c: i(s[1]),
        h: i(s[2]),
        w: i(s[3]),
        oh: i(windows[2]),
        ow: i(windows[3]),
        kh: i(a.kernel.0),
        kw: i(a.kernel.1),
        sh: i(a.stride.0),
        sw: i(a.stride.1),
        ph: i(a.padding.0),
        pw: i(a.padding.1),
        dh: i(a.dilation.0),
        dw: i(a.dilation.1),
        xs: strides(x),
        gs: dy.map(strides).unwrap_or_default(),
    };
    let blocks = n.div_ceil(THREADS).min(1 << 30);
    dev.launch(kern, (blocks as u32, 1, 1), (THREADS as u32, 1, 1), &args)?;
    Ok(res)
}

fn source(name: &str, dtype: DType, forward: bool) -> String {
    let acc = if dtype == DType::F64 { CType::F64 } else { CType::F32 };
    let mut c = format!("{PRELUDE}{}", MaxPoolArgs::C_DECL);
    let _ = writeln!(c, "#define NAME {name}\n#define T {}\n#define ACC {}", codegen::storage_type(dtype), acc.name());
    let _ = writeln!(c, "#define LD(e) ({})\n#define ST(e) ({})", codegen::load(dtype, acc, "(e)"), codegen::store(dtype, acc, "(e)"));
    if forward {
        c.push_str("#define MAXPOOL_FWD\n");
    }
    c.push_str(SOURCE);
    c
}
