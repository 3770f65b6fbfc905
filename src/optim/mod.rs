//! Optimisers with PyTorch's update rules (`torch.optim.SGD`, `Adam`, `AdamW`). Updates run
//! under `no_grad` as in-place ops on the parameters, so any tensor holding a parameter sees them.

mod scheduler;

pub use scheduler::{CosineAnnealingLr, LinearWarmup, LrScheduler, StepLr};

use crate::{no_grad, Result, Tensor};

pub trait Optimizer {
    /// One update from the parameters' current `.grad` (parameters without one are skipped).
    fn step(&mut self) -> Result<()>;
    /// Clears every parameter's gradient (set to none, PyTorch's default).
    fn zero_grad(&mut self);
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
}

fn clear(params: &[Tensor]) {
    for p in params {
        p.set_grad(None);
    }
}

/// Stochastic gradient descent with momentum, dampening, Nesterov and weight decay.
pub struct Sgd {
    params: Vec<Tensor>,
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    momentum_buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    pub fn new(params: Vec<Tensor>, lr: f64) -> Sgd {
        let n = params.len();
        Sgd { params, lr, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0, momentum_buffers: vec![None; n] }
    }
    pub fn momentum(mut self, m: f64) -> Sgd {
        self.momentum = m;
        self
    }
    pub fn dampening(mut self, d: f64) -> Sgd {
        self.dampening = d;
        self
    }
    pub fn nesterov(mut self, on: bool) -> Sgd {
        self.nesterov = on;
        self
    }
    pub fn weight_decay(mut self, wd: f64) -> Sgd {
        self.weight_decay = wd;
        self
    }
    /// The momentum buffers (the optimiser's state), one per parameter.
    pub fn state(&self) -> &[Option<Tensor>] {
        &self.momentum_buffers
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        no_grad(|| {
            for (p, buf) in self.params.iter().zip(self.momentum_buffers.iter_mut()) {
                let Some(mut g) = p.grad() else { continue };
                if self.weight_decay != 0.0 {
                    g = g.add(&p.mul_scalar(self.weight_decay)?)?;
                }
                if self.momentum != 0.0 {
                    let b = match buf.take() {
                        None => g.copy_contiguous()?,
                        Some(b) => {
                            b.mul_scalar_(self.momentum)?;
                            b.add_(&g.mul_scalar(1.0 - self.dampening)?)?;
                            b
                        }
                    };
                    g = if self.nesterov { g.add(&b.mul_scalar(self.momentum)?)? } else { b.clone() };
                    *buf = Some(b);
                }
                p.sub_(&g.mul_scalar(self.lr)?)?;
            }
            Ok(())
        })
    }
    fn zero_grad(&mut self) {
        clear(&self.params);
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
}

/// Settings of [`Adam`] and [`AdamW`], PyTorch's defaults (AdamW's weight decay is 0.01).
#[derive(Clone, Copy, Debug)]
pub struct AdamConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// Adam (`decoupled` = false: weight decay added to the gradient) and AdamW (`decoupled`:
/// parameters shrink by lr * weight_decay before the update).
struct AdamCore {
    params: Vec<Tensor>,
    cfg: AdamConfig,
    decoupled: bool,
    step: u64,
    moments: Vec<Option<(Tensor, Tensor)>>,
}

impl AdamCore {
    fn new(params: Vec<Tensor>, cfg: AdamConfig, decoupled: bool) -> AdamCore {
        let n = params.len();
        AdamCore { params, cfg, decoupled, step: 0, moments: vec![None; n] }
    }

    fn step(&mut self) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        no_grad(|| {
            for (p, m) in self.params.iter().zip(self.moments.iter_mut()) {
                let Some(mut g) = p.grad() else { continue };
                if c.weight_decay != 0.0 {
                    if self.decoupled {
                        p.mul_scalar_(1.0 - c.lr * c.weight_decay)?;
                    } else {
                        g = g.add(&p.mul_scalar(c.weight_decay)?)?;
                    }
                }
                let (m1, m2) = match m.take() {
                    Some(s) => s,
                    None => (p.zeros_like()?, p.zeros_like()?),
                };
                // As torch.optim.Adam: m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²;
                // p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
                m1.mul_scalar_(c.beta1)?;
                m1.add_(&g.mul_scalar(1.0 - c.beta1)?)?;
                m2.mul_scalar_(c.beta2)?;
                m2.add_(&g.mul(&g)?.mul_scalar(1.0 - c.beta2)?)?;
                let denom = m2.sqrt()?.div_scalar(bc2.sqrt())?.add_scalar(c.eps)?;
                p.sub_(&m1.div(&denom)?.mul_scalar(c.lr / bc1)?)?;
                *m = Some((m1, m2));
            }
            Ok(())
        })
    }
}

macro_rules! adam {
    ($(#[$doc:meta])* $name:ident, $decoupled:expr, $default_wd:expr) => {
        $(#[$doc])*
        pub struct $name(AdamCore);
        impl $name {
            pub fn new(params: Vec<Tensor>, cfg: AdamConfig) -> $name {
                $name(AdamCore::new(params, cfg, $decoupled))
            }
            /// PyTorch's defaults with learning rate `lr`.
            pub fn with_lr(params: Vec<Tensor>, lr: f64) -> $name {
                $name::new(params, AdamConfig { lr, weight_decay: $default_wd, ..Default::default() })
            }
            /// Steps taken and the (first, second) moment estimates per parameter.
            pub fn state(&self) -> (u64, &[Option<(Tensor, Tensor)>]) {
                (self.0.step, &self.0.moments)
            }
        }
        impl Optimizer for $name {
            fn step(&mut self) -> Result<()> {
                self.0.step()
            }
            fn zero_grad(&mut self) {
                clear(&self.0.params);
            }
            fn lr(&self) -> f64 {
                self.0.cfg.lr
            }
            fn set_lr(&mut self, lr: f64) {
                self.0.cfg.lr = lr;
            }
        }
    };
}
adam!(
    /// `torch.optim.Adam`.
    Adam, false, 0.0
);
adam!(
    /// `torch.optim.AdamW` (decoupled weight decay; default 0.01 with `with_lr`).
    AdamW, true, 0.01
);
