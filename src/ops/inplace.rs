//! In-place ops. Each computes its result out of place, then writes it into this tensor's
//! storage and bumps the version counter, so that backward can detect a saved tensor that
//! changed. With autograd recording, the tensor takes over the result's history.

use crate::ops::elementwise::Scalar;
use crate::{is_grad_enabled, Error, Result, Tensor};

impl Tensor {
    /// Writes `value` (already of this tensor's shape) into this tensor's elements.
    fn assign(&self, op: &'static str, value: &Tensor) -> Result<()> {
        let recording = is_grad_enabled() && (self.is_requires_grad() || value.is_requires_grad());
        if recording && self.is_leaf() && self.is_requires_grad() {
            return Err(Error::Autograd(format!(
                "{op}: a leaf tensor that requires grad (shape {:?}) is used in an in-place operation; \
                 wrap parameter updates in no_grad",
                self.shape()
            )));
        }
        if recording && self.is_view() {
            return Err(Error::Autograd(format!(
                "{op}: in-place operations on views (shape {:?}) are not recorded by autograd; use the out-of-place form",
                self.shape()
            )));
        }
        crate::backend::check_device(op, self.device())?;
        // A leaf value (`copy_` from a parameter) has no node for this tensor to take over: give
        // it one, or the gradient to the leaf would be lost.
        let value = if recording && value.is_leaf() && value.is_requires_grad() { value.copy_contiguous()? } else { value.clone() };
        let value = value.to_dtype(self.dtype())?;
        if value.device() != self.device() {
            return Err(Error::DeviceMismatch { op, a: self.device(), b: value.device() });
        }
        if crate::compile::trace::active() {
            crate::compile::trace::assign(self, &value)?;
        } else {
            crate::backend::write_into(self, &value)?;
        }
        self.storage().bump_version();
        if recording {
            self.set_grad_fn(value.grad_fn());
        }
        Ok(())
    }

    /// Runs `f` on this tensor and writes the result back. When autograd records, `f` sees a
    /// differentiable copy, so tensors its backward saves are not the ones overwritten here.
    fn update(&self, op: &'static str, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<()> {
        self.update_with(op, None, f)
    }

    /// `update` for an op with a tensor operand `other`: when only `other` requires grad, the
    /// op's backward may save this tensor too (`c.mul_(w)` saves `c` for `w`'s gradient).
    pub(crate) fn update_with(&self, op: &'static str, other: Option<&Tensor>, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<()> {
        let tracked = if self.is_requires_grad() { !self.is_leaf() } else { other.is_some_and(|o| o.is_requires_grad()) };
        let base = if is_grad_enabled() && tracked { self.copy_contiguous()? } else { self.clone() };
        let value = f(&base)?;
        let b = crate::layout::broadcast_shapes(op, self.shape(), value.shape())?;
        if b != self.shape() {
            return Err(Error::shape(op, format!("the result of shape {b:?} cannot be written into a tensor of shape {:?}", self.shape())));
        }
        if value.dtype() != self.dtype() && crate::dtype::promote_types(self.dtype(), value.dtype()) != self.dtype() {
            return Err(Error::dtype(op, value.dtype(), format!("the result type {:?} cannot be cast to the tensor's dtype {:?} in place", value.dtype(), self.dtype())));
        }
        self.assign(op, &value.broadcast_to(self.shape())?)
    }

    #[track_caller]
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update_with("add_", Some(other), |x| x.add(other))
    }
    #[track_caller]
    pub fn sub_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update_with("sub_", Some(other), |x| x.sub(other))
    }
    #[track_caller]
    pub fn mul_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update_with("mul_", Some(other), |x| x.mul(other))
    }
    #[track_caller]
    pub fn div_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update_with("div_", Some(other), |x| x.div(other))
    }
    #[track_caller]
    pub fn add_scalar_(&self, s: impl Into<Scalar>) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update("add_", |x| x.add_scalar(s))
    }
    #[track_caller]
    pub fn sub_scalar_(&self, s: impl Into<Scalar>) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update("sub_", |x| x.sub_scalar(s))
    }
    #[track_caller]
    pub fn mul_scalar_(&self, s: impl Into<Scalar>) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update("mul_", |x| x.mul_scalar(s))
    }
    #[track_caller]
    pub fn div_scalar_(&self, s: impl Into<Scalar>) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update("div_", |x| x.div_scalar(s))
    }
    #[track_caller]
    pub fn clamp_(&self, min: Option<f64>, max: Option<f64>) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.update("clamp_", |x| x.clamp(min, max))
    }
    /// Copies `src` (broadcast, converted to this dtype) into this tensor.
    #[track_caller]
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        let _site = crate::profiler::call_site();
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch { op: "copy_", a: self.device(), b: src.device() });
        }
        let b = crate::layout::broadcast_shapes("copy_", self.shape(), src.shape())?;
        if b != self.shape() {
            return Err(Error::shape("copy_", format!("source of shape {:?} does not broadcast to {:?}", src.shape(), self.shape())));
        }
        self.assign("copy_", &src.broadcast_to(self.shape())?)
    }
    #[track_caller]
    pub fn fill_(&self, value: f64) -> Result<()> {
        let _site = crate::profiler::call_site();
        let v = Tensor::full(self.shape(), value, self.dtype(), &self.device())?;
        self.assign("fill_", &v)
    }
    #[track_caller]
    pub fn zero_(&self) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.fill_(0.0)
    }
}
