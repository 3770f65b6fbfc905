//! Max pooling's primitives: `Op::MaxPool2d` (each window's maximum) and `Op::MaxPool2dBackward`
//! (its gradient), one kernel each on every backend, as PyTorch's. A window holds the input
//! positions it covers (padding is never a candidate); its maximum is the first largest value,
//! or its last NaN; an input position's gradient is the sum, in F32 (F64 for F64) and in window
//! order, of the gradients of the windows whose maximum it is (F64 on the host), rounded once. The backward finds
//! each window's maximum again from the input instead of keeping indices from the forward: the
//! forward stores nothing beside its values, and inference and training run the same kernel.

use super::conv::out_len;
use crate::Result;

/// Options of 2-D max pooling, PyTorch's names; `MaxPool2dArgs::new(kernel, stride, padding)`
/// has no dilation and floor mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaxPool2dArgs {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    /// Rounds the output size up, so a last window may start in the padding's right half.
    pub ceil_mode: bool,
}

impl MaxPool2dArgs {
    pub fn new(kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> MaxPool2dArgs {
        MaxPool2dArgs { kernel, stride, padding, dilation: (1, 1), ceil_mode: false }
    }

    /// The windows (OH, OW) over an (H, W) plane.
    pub(crate) fn out_hw(&self, op: &'static str, h: usize, w: usize) -> Result<(usize, usize)> {
        let (k, s, p, d) = (self.kernel, self.stride, self.padding, self.dilation);
        Ok((out_len(op, h, k.0, s.0, p.0, d.0, self.ceil_mode)?, out_len(op, w, k.1, s.1, p.1, d.1, self.ceil_mode)?))
    }

    /// The flat position `y * w + x` of the maximum of window (oh, ow) in an `h` x `w` plane read
    /// through `at(y, x)` (PyTorch's rule: a larger value or a NaN takes over).
    pub(crate) fn window_max(&self, (h, w): (usize, usize), (oh, ow): (usize, usize), at: impl Fn(usize, usize) -> f64) -> usize {
        let (k, s, p, d) = (self.kernel, self.stride, self.padding, self.dilation);
        let (hs, ws) = ((oh * s.0) as isize - p.0 as isize, (ow * s.1) as isize - p.1 as isize);
        let mut best: Option<(usize, f64)> = None;
        for i in 0..k.0 {
            let y = hs + (i * d.0) as isize;
            if y < 0 || y >= h as isize {
                continue;
            }
            for j in 0..k.1 {
                let x = ws + (j * d.1) as isize;
                if x < 0 || x >= w as isize {
                    continue;
                }
                let v = at(y as usize, x as usize);
                if best.is_none_or(|(_, m)| v > m || v.is_nan()) {
                    best = Some((y as usize * w + x as usize, v));
                }
            }
        }
        // Padding at most half the kernel leaves every window an input position.
        best.expect("a window covers at least one input position").0
    }
}
