//! User-defined differentiable functions (`torch.autograd.Function`).

use super::{is_grad_enabled, no_grad, BackwardFn, Node, Saved, SavedTensor};
use crate::{Result, Tensor};
use std::sync::Arc;

/// What a custom function keeps between forward and backward.
#[derive(Default)]
pub struct Ctx {
    saved: Vec<Tensor>,
}

impl Ctx {
    pub(crate) fn with_saved(saved: Vec<Tensor>) -> Ctx {
        Ctx { saved }
    }
    /// Keeps tensors for backward; modifying them in place before backward is an error there.
    pub fn save_for_backward(&mut self, ts: &[&Tensor]) {
        self.saved.extend(ts.iter().map(|t| (*t).clone()));
    }
    pub fn saved(&self) -> &[Tensor] {
        &self.saved
    }
}

/// A differentiable function with a hand-written backward.
pub trait Function: Send + Sync + 'static {
    /// Computes the output; runs without recording history.
    fn forward(&self, ctx: &mut Ctx, xs: &[&Tensor]) -> Result<Tensor>;
    /// One gradient (or `None`) per input of `forward`, given d(output).
    fn backward(&self, ctx: &Ctx, grad: &Tensor) -> Result<Vec<Option<Tensor>>>;
    /// The name the node shows (`<name>Backward`).
    fn name(&self) -> String {
        // `a::Wrap<b::Inner>` is `Wrap`: drop generic arguments before the path.
        let full = std::any::type_name::<Self>();
        let base = full.split('<').next().unwrap_or(full);
        base.rsplit("::").next().unwrap_or(base).to_string()
    }
    /// Runs forward and records the function for backward.
    fn apply(self, xs: &[&Tensor]) -> Result<Tensor>
    where
        Self: Sized,
    {
        apply(Box::new(self), xs)
    }
}

fn apply(f: Box<dyn Function>, xs: &[&Tensor]) -> Result<Tensor> {
    let mut ctx = Ctx::default();
    let out = no_grad(|| f.forward(&mut ctx, xs))?;
    // The output is a new tensor of this node, never an alias of an input's history.
    let out = out.detach();
    if !is_grad_enabled() || !out.dtype().is_float() || !xs.iter().any(|t| t.is_requires_grad()) {
        return Ok(out);
    }
    let saved = Saved {
        custom: ctx.saved.iter().enumerate().map(|(i, t)| SavedTensor::new(t, format!("saved tensor {i}"))).collect(),
        ..Default::default()
    };
    let node = Node::new(BackwardFn::Custom(f), xs, &vec![true; xs.len()], saved);
    out.set_grad_fn(Some(Arc::new(node)));
    Ok(out)
}
