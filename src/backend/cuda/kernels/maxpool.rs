//! Max pooling on the GPU (`ops::pool`, `maxpool.cu`): the forward a thread per window; the
//! backward a pass per window (its maximum's position) and one per input position (the sum over
//! the windows that chose it). Channels-last, a thread takes up to 8 channels.
//! Inputs of any strides; outputs dense in NCHW order, or in NHWC order (channels-last) when
//! asked.

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

/// The maximum of every window of `x` `[N, C, H, W]`: a new `out` `[N, C, OH, OW]`, its
/// elements in NHWC order when `nhwc` (channels-last), else in NCHW order.
pub(crate) fn max_pool2d(x: &Tensor, a: &MaxPool2dArgs, out: &[usize], nhwc: bool) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let res = CudaStorage::new(&dev, x.dtype(), out.iter().product())?;
    launch(&dev, Pass::Max, x, None, a, out, res.ptr(), nhwc)?;
    Ok(res)
}

/// `max_pool2d`'s gradient for `x` from the output's gradient `dy`: a new buffer of x's shape.
/// Two passes: each window's maximum found again (its position kept as an int), then each
/// input position's sum over the windows that chose it; in NHWC order when `nhwc`.
pub(crate) fn max_pool2d_backward(x: &Tensor, dy: &Tensor, a: &MaxPool2dArgs, nhwc: bool) -> Result<CudaStorage> {
    let dev = dev_of(x)?;
    let at = CudaStorage::new(&dev, DType::I32, dy.numel())?;
    launch(&dev, Pass::Position, x, None, a, dy.shape(), at.ptr(), nhwc)?;
    let res = CudaStorage::new(&dev, x.dtype(), x.numel())?;
    launch(&dev, Pass::Backward(at.ptr()), x, Some(dy), a, dy.shape(), res.ptr(), nhwc)?;
    Ok(res)
}

/// What one launch computes.
#[derive(Clone, Copy, PartialEq)]
enum Pass {
    /// Each window's maximum.
    Max,
    /// Each window's maximum's position in its plane.
    Position,
    /// Each input position's gradient, from the positions at this address.
    Backward(u64),
}

#[allow(clippy::too_many_arguments)]
fn launch(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, pass: Pass, x: &Tensor, dy: Option<&Tensor>, a: &MaxPool2dArgs, windows: &[usize], out: u64, nhwc: bool) -> Result<()> {
    let dtype = x.dtype();
    let s = x.shape();
    // Channels-last threads take `vec` channels each.
    let vec = if nhwc { channels_per_thread(s[1]) } else { 1 };
    let n = if matches!(pass, Pass::Backward(_)) { x.numel() } else { windows.iter().product() } / vec;
    if n == 0 {
        return Ok(());
    }
    // 32-bit index arithmetic unless an index or an offset could pass 2^31.
    let reach = |t: &Tensor| t.shape().iter().zip(t.strides()).map(|(d, s)| d.saturating_sub(1) * s).sum::<usize>();
    let wide = [x.numel(), windows.iter().product(), reach(x), dy.map_or(0, reach)].iter().any(|&v| v >= i32::MAX as usize);
    let name = kernel_name(dtype, pass, wide, nhwc, vec);
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name.clone(), source(&name, dtype, pass, wide, nhwc, vec)))?;
    let strides = |t: &Tensor| -> [i64; 4] { std::array::from_fn(|d| t.strides()[d] as i64) };
    let i = |v: usize| v as i64;
    let args = MaxPoolArgs {
        x: match pass {
            Pass::Backward(at) => at,
            _ => data_ptr(x)?,
        },
        dy: dy.map(data_ptr).transpose()?.unwrap_or(0),
        out,
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
    dev.launch(kern, (blocks as u32, 1, 1), (THREADS as u32, 1, 1), &args)
}

/// Channels a thread of a channels-last pass takes: 8, 4 or 2 where they divide `c`.
fn channels_per_thread(c: usize) -> usize {
    [8, 4, 2].into_iter().find(|&v| c.is_multiple_of(v)).unwrap_or(1)
}

/// A kernel's name, which says all its source depends on.
fn kernel_name(dtype: DType, pass: Pass, wide: bool, nhwc: bool, vec: usize) -> String {
    let what = match pass {
        Pass::Max => "",
        Pass::Position => "_argmax",
        Pass::Backward(_) => "_backward",
    };
    let vec = if vec > 1 { format!("_c{vec}") } else { String::new() };
    format!("max_pool2d{what}_{}{}{vec}{}", dtype.torch_name(), if nhwc { "_nhwc" } else { "" }, if wide { "_i64" } else { "" })
}

fn source(name: &str, dtype: DType, pass: Pass, wide: bool, nhwc: bool, vec: usize) -> String {
    let acc = if dtype == DType::F64 { CType::F64 } else { CType::F32 };
    let mut c = format!("{PRELUDE}{}", MaxPoolArgs::C_DECL);
    let _ = writeln!(c, "#define NAME {name}\n#define IDX {}\n#define T {}\n#define ACC {}\n#define VEC {vec}", if wide { "long long" } else { "int" }, codegen::storage_type(dtype), acc.name());
    let _ = writeln!(c, "#define LD(e) ({})\n#define ST(e) ({})", codegen::load(dtype, acc, "(e)"), codegen::store(dtype, acc, "(e)"));
    c.push_str(match pass {
        Pass::Max => "#define MAXPOOL_FWD\n",
        Pass::Position => "#define MAXPOOL_ARG\n",
        Pass::Backward(_) => "#define MAXPOOL_BWD\n",
    });
    if nhwc {
        c.push_str("#define NHWC\n");
    }
    c.push_str(SOURCE);
    c
}

/// Sources of every pass, layout and index width, for the NVRTC check (`samples.rs`).
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    let mut v = vec![];
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        for pass in [Pass::Max, Pass::Position, Pass::Backward(0)] {
            for (wide, nhwc, vec) in [(false, false, 1), (false, true, 1), (false, true, 8), (true, false, 1), (true, true, 4)] {
                let name = kernel_name(dtype, pass, wide, nhwc, vec);
                v.push(super::samples::Sample::new((name.clone(), source(&name, dtype, pass, wide, nhwc, vec))));
            }
        }
    }
    v
}
