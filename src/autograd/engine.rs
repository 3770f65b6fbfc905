//! The backward pass: gradients flow from the root through recorded nodes into leaves' `.grad`.

use super::{no_grad, Edge, Node};
use crate::{Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Options of [`Tensor::backward_with`] (PyTorch's `gradient=` and `retain_graph=`).
#[derive(Clone, Default)]
pub struct BackwardOptions {
    /// d(root) to start from; required when the root is not a scalar.
    pub gradient: Option<Tensor>,
    /// Keep saved tensors so that the graph can be walked again.
    pub retain_graph: bool,
}

thread_local! {
    /// `backward` calls on this thread, traced ones included (`kiln::doctor` reads it).
    static BACKWARD_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many times this thread has called `backward` so far.
pub(crate) fn backward_calls() -> usize {
    BACKWARD_CALLS.with(|n| n.get())
}

impl Tensor {
    /// Gradients of this scalar with respect to every leaf that requires grad, added to `.grad`.
    #[track_caller]
    pub fn backward(&self) -> Result<()> {
        self.backward_with(BackwardOptions::default())
    }

    /// Backward ops keep the forward's dtypes: autocast is suspended while it runs.
    #[track_caller]
    pub fn backward_with(&self, opts: BackwardOptions) -> Result<()> {
        let _site = crate::profiler::call_site();
        BACKWARD_CALLS.with(|n| n.set(n.get() + 1));
        crate::compile::trace::note_backward();
        crate::amp::suspended(|| self.backward_inner(opts))
    }

    fn backward_inner(&self, opts: BackwardOptions) -> Result<()> {
        if !self.is_requires_grad() {
            return Err(Error::Autograd(format!(
                "backward on a tensor (shape {:?}) that does not require grad and has no grad_fn",
                self.shape()
            )));
        }
        let grad = match opts.gradient {
            Some(g) => {
                if g.shape() != self.shape() {
                    return Err(Error::shape("backward", format!("gradient of shape {:?} for a tensor of shape {:?}", g.shape(), self.shape())));
                }
                g.detach()
            }
            None => {
                if self.numel() != 1 {
                    return Err(Error::Autograd(format!(
                        "grad can be implicitly created only for scalar outputs; this tensor has shape {:?}: \
                         pass BackwardOptions {{ gradient: Some(..), .. }}",
                        self.shape()
                    )));
                }
                self.ones_like()?
            }
        };
        let ran = no_grad(|| run(self, grad, opts.retain_graph));
        // The callbacks queued during the pass run after it, even when it failed (they may own
        // work in flight); the first error wins.
        let queued = CALLBACKS.with(|c| std::mem::take(&mut *c.borrow_mut()));
        let mut result = ran;
        for cb in queued {
            let r = no_grad(cb);
            if result.is_ok() {
                result = r;
            }
        }
        result
    }
}

type Callback = Box<dyn FnOnce() -> Result<()>>;

thread_local! {
    static CALLBACKS: std::cell::RefCell<Vec<Callback>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` once the backward pass in progress on this thread has finished, before `backward`
/// returns (PyTorch's `queue_callback` on the execution engine): a hook that starts work during
/// the pass can wait for it here. Called outside a backward pass, `f` runs after the next one.
pub fn queue_callback(f: impl FnOnce() -> Result<()> + 'static) {
    CALLBACKS.with(|c| c.borrow_mut().push(Box::new(f)));
}

fn leaf_key(t: &Tensor) -> *const crate::tensor::TensorImpl {
    Arc::as_ptr(&t.0)
}

fn key(n: &Arc<Node>) -> *const Node {
    Arc::as_ptr(n)
}

fn run(root: &Tensor, grad: Tensor, retain: bool) -> Result<()> {
    let Some(root_node) = root.grad_fn() else {
        accumulate_leaf(root, grad)?;
        return run_hooks(root);
    };
    // How many edges point at each node: a node runs once all its consumers have. Leaves are
    // counted too, so that their hooks run once, after their last gradient has arrived.
    let mut pending: HashMap<*const Node, usize> = HashMap::new();
    let mut leaves: HashMap<*const crate::tensor::TensorImpl, (usize, bool)> = HashMap::new();
    let mut stack = vec![root_node.clone()];
    let mut seen = std::collections::HashSet::from([key(&root_node)]);
    while let Some(n) = stack.pop() {
        for e in n.edges.iter().flatten() {
            match e {
                Edge::Node(c) => {
                    *pending.entry(key(c)).or_default() += 1;
                    if seen.insert(key(c)) {
                        stack.push(c.clone());
                    }
                }
                Edge::Leaf(t) => leaves.entry(leaf_key(t)).or_default().0 += 1,
            }
        }
    }
    let mut grads: HashMap<*const Node, Tensor> = HashMap::from([(key(&root_node), grad)]);
    let mut ready = vec![root_node];
    while let Some(n) = ready.pop() {
        let input_grads = match grads.remove(&key(&n)) {
            Some(g) => n.apply(&g, retain)?,
            None => vec![None; n.edges.len()], // no gradient reached it: just release its consumers
        };
        for (i, (edge, g)) in n.edges.iter().zip(input_grads).enumerate() {
            let Some(edge) = edge else { continue };
            let g = g.map(|g| conform(&n, i, g)).transpose()?;
            match edge {
                Edge::Leaf(t) => {
                    let left = leaves.get_mut(&leaf_key(t)).expect("counted");
                    if let Some(g) = g {
                        accumulate_leaf(t, g)?;
                        left.1 = true;
                    }
                    left.0 -= 1;
                    if left.0 == 0 && left.1 {
                        run_hooks(t)?;
                    }
                }
                Edge::Node(c) => {
                    if let Some(g) = g {
                        let merged = match grads.remove(&key(c)) {
                            Some(prev) => prev.add(&g)?,
                            None => g,
                        };
                        grads.insert(key(c), merged);
                    }
                    let p = pending.get_mut(&key(c)).expect("counted");
                    *p -= 1;
                    if *p == 0 {
                        ready.push(c.clone());
                    }
                }
            }
        }
    }
    Ok(())
}

/// A leaf's post-accumulate-grad hooks, called outside its metadata lock (they may set `.grad`).
fn run_hooks(t: &Tensor) -> Result<()> {
    let hooks: Vec<_> = t.0.meta.lock().post_accumulate_hooks.iter().map(|(_, h)| h.clone()).collect();
    for h in hooks {
        h(t)?;
    }
    Ok(())
}

/// Checks a gradient against its input's shape and gives it the input's dtype.
fn conform(n: &Node, i: usize, g: Tensor) -> Result<Tensor> {
    let (shape, dtype) = &n.input_meta[i];
    if g.shape() != shape.as_slice() {
        return Err(Error::Autograd(format!(
            "{} returned a gradient of shape {:?} for input {i} of shape {shape:?}",
            n.name(),
            g.shape()
        )));
    }
    if g.dtype() != *dtype {
        return g.to_dtype(*dtype);
    }
    Ok(g)
}

fn accumulate_leaf(t: &Tensor, g: Tensor) -> Result<()> {
    let g = if g.dtype() != t.dtype() { g.to_dtype(t.dtype())? } else { g };
    // Read and replace `.grad` under the leaf's lock: backward passes on several threads may
    // accumulate into one leaf at once, and none of their updates may be lost. (The ops below
    // run without recording, so they never lock this leaf's metadata themselves.)
    let mut meta = t.0.meta.lock();
    let new = match &meta.grad {
        Some(prev) => prev.add(&g)?,
        None => own(g, t)?,
    };
    meta.grad = Some(new);
    Ok(())
}

/// A gradient to store in `leaf`'s `.grad`, laid out as the leaf (in its memory format, when
/// it is dense in it): the tensor itself when nothing else can see it, else a copy, so that
/// in-place updates of one `.grad` never change another.
fn own(g: Tensor, leaf: &Tensor) -> Result<Tensor> {
    let format = leaf.dense_format().unwrap_or(crate::MemoryFormat::Contiguous);
    if Arc::strong_count(&g.0) == 1 && Arc::strong_count(g.storage()) == 1 && g.is_contiguous_for(format) {
        return Ok(g.detach());
    }
    g.copy_in(format)
}

