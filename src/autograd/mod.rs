//! Define-by-run autograd: ops record `Node`s on their outputs; `backward` walks them in reverse
//! topological order. Gradient formulas live with the ops (ops::Op::backward) and are written
//! with ordinary tensor ops, so the compiler's ahead-of-time autodiff can reuse them.

mod engine;
mod function;
mod gradcheck;
mod mode;

pub use engine::{queue_callback, BackwardOptions};
pub(crate) use engine::backward_calls;
pub use function::{Ctx, Function};
pub use gradcheck::{gradcheck, GradcheckOptions};
pub use mode::{enable_grad, inference_mode, is_grad_enabled, no_grad};

use crate::ops::Op;
use crate::{DType, Error, Result, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;

/// A leaf's post-accumulate-grad hook.
pub(crate) type GradHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// Removes its hook when `remove` is called (dropping the handle keeps the hook, as in PyTorch).
pub struct HookHandle {
    pub(crate) tensor: Tensor,
    pub(crate) id: u64,
}

impl HookHandle {
    pub fn remove(self) {
        self.tensor.0.meta.lock().post_accumulate_hooks.retain(|(id, _)| *id != self.id);
    }
}

/// Where the gradient of one input of a node goes.
pub(crate) enum Edge {
    /// Into the node that produced the input.
    Node(Arc<Node>),
    /// Into the `.grad` of a leaf that requires grad.
    Leaf(Tensor),
}

/// What computes a node's input gradients.
pub(crate) enum BackwardFn {
    Op(Op),
    Custom(Box<dyn Function>),
}

/// A tensor kept for backward, with the storage version it had when saved.
pub(crate) struct SavedTensor {
    tensor: Tensor,
    version: u64,
    /// Which tensor this is, for the error when it was modified in place.
    what: String,
}

impl SavedTensor {
    pub(crate) fn new(t: &Tensor, what: String) -> Self {
        SavedTensor { tensor: t.detach(), version: t.version(), what }
    }
    fn unpack(&self, node: &str) -> Result<Tensor> {
        let now = self.tensor.version();
        if now != self.version {
            return Err(Error::Autograd(format!(
                "one of the variables needed for gradient computation has been modified by an inplace operation: \
                 {} of {node} (shape {:?}, {:?}) is at version {now}; expected version {} instead",
                self.what, self.tensor.shape(), self.tensor.dtype(), self.version
            )));
        }
        Ok(self.tensor.clone())
    }
}

pub(crate) struct Node {
    pub(crate) backward: BackwardFn,
    /// One per input of the forward call; `None` for inputs that need no gradient.
    pub(crate) edges: Vec<Option<Edge>>,
    /// Shapes and dtypes of the inputs, which the gradients must match.
    pub(crate) input_meta: Vec<(Vec<usize>, DType)>,
    /// Saved inputs (by position) and output; `None` inside once released after a backward.
    saved: Mutex<Option<Saved>>,
    has_saved: bool,
}

#[derive(Default)]
pub(crate) struct Saved {
    pub(crate) inputs: Vec<Option<SavedTensor>>,
    pub(crate) output: Option<SavedTensor>,
    /// Tensors a custom Function saved through its Ctx.
    pub(crate) custom: Vec<SavedTensor>,
}

impl Node {
    /// A node for `inputs`, with edges to those marked `differentiable` that need gradients.
    pub(crate) fn new(backward: BackwardFn, inputs: &[&Tensor], differentiable: &[bool], saved: Saved) -> Node {
        let has_saved = saved.output.is_some() || saved.inputs.iter().any(|s| s.is_some()) || !saved.custom.is_empty();
        Node {
            backward,
            edges: inputs.iter().zip(differentiable).map(|(t, &d)| if d { edge_of(t) } else { None }).collect(),
            input_meta: inputs.iter().map(|t| (t.shape().to_vec(), t.dtype())).collect(),
            saved: parking_lot::Mutex::new(Some(saved)),
            has_saved,
        }
    }

    pub(crate) fn name(&self) -> String {
        match &self.backward {
            BackwardFn::Op(op) => format!("{}Backward", camel(op.name())),
            BackwardFn::Custom(f) => format!("{}Backward", f.name()),
        }
    }

    /// The input gradients for output gradient `grad`.
    fn apply(&self, grad: &Tensor, retain: bool) -> Result<Vec<Option<Tensor>>> {
        let name = self.name();
        let mut slot = self.saved.lock();
        let Some(saved) = slot.as_ref() else {
            return Err(Error::Autograd(format!(
                "trying to backward through the graph a second time (at {name}): its saved tensors were freed \
                 after the first backward; pass retain_graph: true to the first backward if you need a second"
            )));
        };
        let want: Vec<bool> = self.edges.iter().map(|e| e.is_some()).collect();
        let grads = match &self.backward {
            BackwardFn::Op(op) => {
                let inputs = saved.inputs.iter().map(|s| s.as_ref().map(|s| s.unpack(&name)).transpose()).collect::<Result<Vec<_>>>()?;
                let output = saved.output.as_ref().map(|s| s.unpack(&name)).transpose()?;
                op.backward(&inputs, output.as_ref(), &self.input_meta, grad, &want)?
            }
            BackwardFn::Custom(f) => {
                let tensors = saved.custom.iter().map(|s| s.unpack(&name)).collect::<Result<Vec<_>>>()?;
                let ctx = Ctx::with_saved(tensors);
                let g = f.backward(&ctx, grad)?;
                if g.len() != self.edges.len() {
                    return Err(Error::Autograd(format!("{name}: backward returned {} gradients for {} inputs", g.len(), self.edges.len())));
                }
                g
            }
        };
        if !retain && self.has_saved {
            *slot = None;
        }
        Ok(grads)
    }
}

impl Drop for Node {
    /// Frees a chain of nodes iteratively: dropping the last reference to a node would otherwise
    /// drop the nodes behind it recursively, and a long graph (an unrolled loop) would overflow
    /// the stack.
    fn drop(&mut self) {
        fn take(edges: &mut Vec<Option<Edge>>, stack: &mut Vec<Arc<Node>>) {
            stack.extend(edges.drain(..).filter_map(|e| match e {
                Some(Edge::Node(n)) => Some(n),
                _ => None,
            }));
        }
        let mut stack = Vec::new();
        take(&mut self.edges, &mut stack);
        while let Some(n) = stack.pop() {
            // Only nodes nobody else holds are freed here, after their edges are taken out.
            if let Some(mut inner) = Arc::into_inner(n) {
                take(&mut inner.edges, &mut stack);
            }
        }
    }
}

/// `mul` → `Mul`, `index_select` → `IndexSelect`.
fn camel(s: &str) -> String {
    s.split('_').map(|w| {
        let mut c = w.chars();
        c.next().map(|f| f.to_uppercase().chain(c).collect::<String>()).unwrap_or_default()
    }).collect()
}

fn edge_of(t: &Tensor) -> Option<Edge> {
    if let Some(n) = t.grad_fn() {
        Some(Edge::Node(n))
    } else if t.is_requires_grad() {
        Some(Edge::Leaf(t.clone()))
    } else {
        None
    }
}

/// Records `op` on `out` when gradients are enabled and some input needs them.
pub(crate) fn record(op: Op, inputs: &[&Tensor], out: Tensor) -> Result<Tensor> {
    if !is_grad_enabled() || !out.dtype().is_float() || !inputs.iter().any(|t| t.is_requires_grad()) {
        return Ok(out);
    }
    if let Some(t) = inputs.iter().find(|t| t.has_stale_history()) {
        return Err(Error::Autograd(format!(
            "{}: an input (shape {:?}) is a view whose base was modified by an inplace operation after the view \
             was taken, so its history is stale; take the view again after the in-place operation",
            op.name(),
            t.shape()
        )));
    }
    let diff = op.differentiable_inputs(inputs.len());
    if !inputs.iter().zip(&diff).any(|(t, &d)| d && t.is_requires_grad()) {
        return Ok(out);
    }
    let (save_inputs, save_out) = op.saves(inputs.len());
    let saved = Saved {
        inputs: inputs.iter().zip(&save_inputs).enumerate()
            .map(|(i, (t, &s))| s.then(|| SavedTensor::new(t, format!("input {i}")))).collect(),
        output: save_out.then(|| SavedTensor::new(&out, "the output".into())),
        custom: vec![],
    };
    let node = Node::new(BackwardFn::Op(op), inputs, &diff, saved);
    out.set_grad_fn(Some(Arc::new(node)));
    Ok(out)
}
