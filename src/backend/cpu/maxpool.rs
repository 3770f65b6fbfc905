//! Max pooling on the host (`ops::pool`): one pass over each `H x W` plane, planes in parallel.

use super::{to_vec_as, with_dtype, CpuStorage, HostElem};
use crate::dtype::Elem;
use crate::ops::pool::MaxPool2dArgs;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// The maximum of every window of `x` `[N, C, H, W]`, as `out` `[N, C, OH, OW]`.
pub(crate) fn max_pool2d(x: &Tensor, a: &MaxPool2dArgs, out: &[usize]) -> CpuStorage {
    let (hw, ohw) = ((x.shape()[2], x.shape()[3]), (out[2], out[3]));
    with_dtype!(x.dtype(), T => {
        let src = to_vec_as::<T>(x);
        let mut y = vec![T::default(); out.iter().product()];
        if ohw.0 * ohw.1 > 0 {
            y.par_chunks_mut(ohw.0 * ohw.1).zip(src.par_chunks(hw.0 * hw.1)).for_each(|(yp, xp)| {
                for oh in 0..ohw.0 {
                    for ow in 0..ohw.1 {
                        let at = a.window_max(hw, (oh, ow), |r, c| xp[r * hw.1 + c].to_f64());
                        yp[oh * ohw.1 + ow] = xp[at];
                    }
                }
            });
        }
        T::wrap(y)
    })
}

/// The gradient of `max_pool2d` for `x` from `dy` (the output's gradient): each window's
/// gradient added to its maximum's position, in window order, in F64, rounded once.
pub(crate) fn max_pool2d_backward(x: &Tensor, dy: &Tensor, a: &MaxPool2dArgs) -> CpuStorage {
    let (hw, ohw) = ((x.shape()[2], x.shape()[3]), (dy.shape()[2], dy.shape()[3]));
    let g = to_vec_as::<f64>(dy);
    let dx = with_dtype!(x.dtype(), T => {
        let src = to_vec_as::<T>(x);
        let mut dx = vec![0.0f64; x.numel()];
        if hw.0 * hw.1 > 0 && ohw.0 * ohw.1 > 0 {
            dx.par_chunks_mut(hw.0 * hw.1).zip(src.par_chunks(hw.0 * hw.1)).zip(g.par_chunks(ohw.0 * ohw.1)).for_each(|((dp, xp), gp)| {
                for oh in 0..ohw.0 {
                    for ow in 0..ohw.1 {
                        let at = a.window_max(hw, (oh, ow), |r, c| xp[r * hw.1 + c].to_f64());
                        dp[at] += gp[oh * ohw.1 + ow];
                    }
                }
            });
        }
        dx
    });
    match x.dtype() {
        DType::F64 => f64::wrap(dx),
        d => with_dtype!(d, T => T::wrap(dx.iter().map(|&v| T::from_f64(v)).collect::<Vec<_>>())),
    }
}
