//! Automatic mixed precision (`torch.amp`): `autocast` runs matmul-like ops (matmul, linear,
//! conv2d, the attention products) in F16/BF16 and numerically sensitive ones (softmax,
//! log_softmax, layer_norm, losses, sum/mean) in F32, by PyTorch's policy; the gradient
//! scaler that keeps small F16 gradients alive is `optim::GradScaler`.
//!
//! The policy is applied at the public entry points of those ops. Autocast is per thread and
//! per device type, like PyTorch's; backward passes run with it suspended.

use crate::{DType, Device, Error, Result, Tensor};
use std::cell::Cell;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    cuda: bool,
    dtype: DType,
}

thread_local! {
    static AUTOCAST: Cell<Option<State>> = const { Cell::new(None) };
}

/// Restores the previous autocast state when dropped (also on early return or panic).
struct Restore(Option<State>);
impl Drop for Restore {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.0));
    }
}

fn set(state: Option<State>) -> Restore {
    Restore(AUTOCAST.with(|a| a.replace(state)))
}

/// Runs `f` with autocast to `dtype` (F16 or BF16) for tensors on `dev`'s device type.
/// On the CPU, F16/BF16 arithmetic runs through F32 and is rounded per op.
pub fn autocast<T>(dev: &Device, dtype: DType, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype("autocast", dtype, "autocast runs in F16 or BF16"));
    }
    let _restore = set(Some(State { cuda: dev.is_cuda(), dtype }));
    f()
}

/// Runs `f` with autocast off (`torch.autocast(enabled=False)`).
pub fn suspended<R>(f: impl FnOnce() -> R) -> R {
    let _restore = set(None);
    f()
}

/// The autocast dtype in force for tensors on `dev`, if any.
pub fn autocast_dtype(dev: &Device) -> Option<DType> {
    AUTOCAST.with(|a| a.get()).filter(|s| s.cuda == dev.is_cuda()).map(|s| s.dtype)
}

/// `t` in `dt` if autocast may cast it: F32, F16 and BF16 are eligible; F64 and integers are
/// left alone, as in PyTorch.
fn eligible_to(t: &Tensor, dt: DType) -> Result<Tensor> {
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => t.to_dtype(dt),
        _ => Ok(t.clone()),
    }
}

/// Lower-precision policy for binary products (matmul): both operands in the autocast dtype.
pub(crate) fn cast_pair(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    match autocast_dtype(&a.device()) {
        Some(dt) => Ok((eligible_to(a, dt)?, eligible_to(b, dt)?)),
        None => Ok((a.clone(), b.clone())),
    }
}

/// Lower-precision policy for layers (linear, conv): input, weight and bias in the autocast
/// dtype, so the result is too.
pub(crate) fn cast_low(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    match autocast_dtype(&x.device()) {
        Some(dt) => Ok((eligible_to(x, dt)?, eligible_to(w, dt)?, b.map(|b| eligible_to(b, dt)).transpose()?)),
        None => Ok((x.clone(), w.clone(), b.cloned())),
    }
}

/// F32 policy (softmax, norms, losses, reductions): F16/BF16 inputs are computed and returned
/// in F32 while autocast is on.
pub(crate) fn fp32(x: &Tensor) -> Result<Tensor> {
    match autocast_dtype(&x.device()) {
        Some(_) if matches!(x.dtype(), DType::F16 | DType::BF16) => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

