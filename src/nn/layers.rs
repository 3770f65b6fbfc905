//! Layers with PyTorch's names, parameter names and default initialisations (seeded by
//! `manual_seed`).

use super::functional as F;
use super::{init, Module};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// `y = x W^T + b` (`nn.Linear`), W of shape [out, in]; PyTorch's init: W and b uniform in
/// ±1/sqrt(in) (kaiming_uniform with a = sqrt(5)).
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn new(in_features: usize, out_features: usize, dev: &Device) -> Result<Linear> {
        Linear::with_bias(in_features, out_features, true, dev)
    }
    pub fn with_bias(in_features: usize, out_features: usize, bias: bool, dev: &Device) -> Result<Linear> {
        if in_features == 0 {
            return Err(Error::arg("Linear", "in_features must be positive"));
        }
        let shape = [out_features, in_features];
        Ok(Linear {
            weight: init::kaiming_uniform(&shape, 5f64.sqrt(), dev)?.requires_grad(),
            bias: if bias { Some(init::bias_uniform(&shape, dev)?.requires_grad()) } else { None },
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        F::linear(x, &self.weight, self.bias.as_ref())
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        super::module::weight_and_bias(&self.weight, self.bias.as_ref())
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        super::module::visit_weight_and_bias(&mut self.weight, self.bias.as_mut(), f)
    }
}

macro_rules! activation {
    ($(#[$doc:meta])* $name:ident, $f:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name;
        impl Module for $name {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                let _site = crate::profiler::call_site();
                ($f)(x)
            }
        }
    };
}
activation!(ReLU, |x: &Tensor| x.relu());
activation!(
    /// GELU, exact (erf) form; `GELUTanh` is the tanh approximation.
    GELU,
    |x: &Tensor| x.gelu()
);
activation!(GELUTanh, |x: &Tensor| x.gelu_tanh());
activation!(SiLU, |x: &Tensor| x.silu());
activation!(Tanh, |x: &Tensor| x.tanh());
activation!(Sigmoid, |x: &Tensor| x.sigmoid());

/// Modules applied in order (`nn.Sequential`); children are named "0", "1", ...
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }
    /// Appends a module (builder form).
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, m: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(m));
        self
    }
    pub fn len(&self) -> usize {
        self.layers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let mut y = x.clone();
        for l in &self.layers {
            y = l.forward(&y)?;
        }
        Ok(y)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.layers.iter().enumerate().map(|(i, l)| (i.to_string(), l.as_ref() as &dyn Module)).collect()
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.layers.iter_mut().try_for_each(|l| l.visit_tensors_mut(f))
    }
}

/// Zeroes elements with probability `p` in training mode (`nn.Dropout`); identity in eval.
pub struct Dropout {
    pub p: f64,
    training: AtomicBool,
}

impl Dropout {
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::arg("Dropout", format!("probability must be in [0, 1], got {p}")));
        }
        Ok(Dropout { p, training: AtomicBool::new(true) })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        F::dropout(x, self.p, self.training.load(Ordering::Relaxed))
    }
    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
}

/// Layer normalisation over the trailing `normalized_shape` (`nn.LayerNorm`): weight ones,
/// bias zeros.
pub struct LayerNorm {
    pub normalized_shape: Vec<usize>,
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(normalized_shape: &[usize], eps: f64, dev: &Device) -> Result<LayerNorm> {
        Ok(LayerNorm {
            normalized_shape: normalized_shape.to_vec(),
            weight: Tensor::ones(normalized_shape, DType::F32, dev)?.requires_grad(),
            bias: Tensor::zeros(normalized_shape, DType::F32, dev)?.requires_grad(),
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        F::layer_norm(x, &self.normalized_shape, Some(&self.weight), Some(&self.bias), self.eps)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(&mut self.weight)?;
        f(&mut self.bias)
    }
}

/// A lookup table of `num` vectors of `dim` (`nn.Embedding`), initialised standard normal.
pub struct Embedding {
    pub weight: Tensor,
}

impl Embedding {
    pub fn new(num: usize, dim: usize, dev: &Device) -> Result<Embedding> {
        Ok(Embedding { weight: init::normal(&[num, dim], 1.0, dev)?.requires_grad() })
    }
}

impl Module for Embedding {
    /// Integer indices of any shape to vectors: the result has shape `indices.shape + [dim]`.
    fn forward(&self, indices: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let mut shape: Vec<i64> = indices.shape().iter().map(|&d| d as i64).collect();
        shape.push(self.weight.shape()[1] as i64);
        self.weight.index_select(0, &indices.reshape(&[-1])?)?.reshape(&shape)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone())]
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(&mut self.weight)
    }
}
