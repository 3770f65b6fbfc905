//! Optimisers with PyTorch's update rules (`torch.optim.SGD`, `Adam`, `AdamW`). Updates run
//! under `no_grad` as in-place ops on the parameters, so any tensor holding a parameter sees them.
//! On a CUDA device, outside compiled functions, one multi-tensor kernel updates all the
//! parameters (`foreach.rs`), with the same results as the per-tensor ops here.

mod foreach;
mod grad_scaler;
mod scheduler;
mod state;

pub use grad_scaler::GradScaler;
pub(crate) use grad_scaler::scaled_losses;
pub use scheduler::{CosineAnnealingLr, LinearWarmup, LrScheduler, StepLr};

use crate::{no_grad, Result, Tensor};
use state::{entry, hyper, Reader, StateDict};

pub trait Optimizer {
    /// One update from the parameters' current `.grad` (parameters without one are skipped).
    #[track_caller]
    fn step(&mut self) -> Result<()>;
    /// Clears every parameter's gradient (set to none, PyTorch's default).
    fn zero_grad(&mut self);
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
    /// The parameters this optimiser updates, in order.
    fn params(&self) -> &[Tensor];
    /// Per-parameter state (`state.<i>.<name>`, copies) and hyperparameters
    /// (`param_groups.0.<name>`), PyTorch's names; saves with `nn::safetensors::save`.
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;
    /// Restores what `state_dict` returned: hyperparameters and state; shapes must match the
    /// parameters and every key must be known, else nothing is changed.
    fn load_state_dict(&mut self, sd: &[(String, Tensor)]) -> Result<()>;
}

fn clear(params: &[Tensor]) {
    for p in params {
        p.clear_grad();
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
    /// Multi-tensor kernels on CUDA (see [`Sgd::foreach`]).
    pub foreach: bool,
    momentum_buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    pub fn new(params: Vec<Tensor>, lr: f64) -> Sgd {
        let n = params.len();
        Sgd { params, lr, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0, foreach: true, momentum_buffers: vec![None; n] }
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
    /// Whether `step` updates parameters on CUDA devices with multi-tensor kernels, a launch
    /// or a few for all of them (on by default, as PyTorch's `foreach` on CUDA), or with a few
    /// ops per parameter (`false`, PyTorch's `foreach=False`). The results are the same.
    /// CPU parameters and steps inside compiled functions always take the per-tensor ops.
    pub fn foreach(mut self, on: bool) -> Sgd {
        self.foreach = on;
        self
    }
    /// The momentum buffers (the optimiser's state), one per parameter.
    pub fn state(&self) -> &[Option<Tensor>] {
        &self.momentum_buffers
    }
}

/// An error naming `op` and `what` unless `v` is a number and `ok(v)`: NaN never passes.
fn check_hyper(op: &'static str, what: &str, v: f64, rule: &str, ok: impl Fn(f64) -> bool) -> Result<()> {
    if v.is_nan() || !ok(v) {
        return Err(crate::Error::arg(op, format!("invalid {what} {v}: it must be {rule}")));
    }
    Ok(())
}

impl Sgd {
    /// PyTorch's checks of SGD's settings (a `ValueError` there); `step` runs them first.
    pub fn validate(&self) -> Result<()> {
        check_hyper("sgd", "learning rate", self.lr, ">= 0", |v| v >= 0.0)?;
        check_hyper("sgd", "momentum", self.momentum, ">= 0", |v| v >= 0.0)?;
        check_hyper("sgd", "dampening", self.dampening, "finite", f64::is_finite)?;
        check_hyper("sgd", "weight_decay", self.weight_decay, ">= 0", |v| v >= 0.0)?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(crate::Error::arg("sgd", format!("Nesterov momentum requires a momentum and zero dampening (momentum {}, dampening {})", self.momentum, self.dampening)));
        }
        Ok(())
    }
}

impl AdamConfig {
    /// PyTorch's checks of Adam's and AdamW's settings; `step` runs them first.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_hyper(op, "learning rate", self.lr, ">= 0", |v| v >= 0.0)?;
        check_hyper(op, "epsilon value", self.eps, ">= 0", |v| v >= 0.0)?;
        check_hyper(op, "beta parameter at index 0", self.beta1, "in [0, 1)", |v| (0.0..1.0).contains(&v))?;
        check_hyper(op, "beta parameter at index 1", self.beta2, "in [0, 1)", |v| (0.0..1.0).contains(&v))?;
        check_hyper(op, "weight_decay value", self.weight_decay, ">= 0", |v| v >= 0.0)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _site = crate::profiler::call_site();
        self.validate()?;
        no_grad(|| {
            let done = foreach::sgd(self)?;
            for ((p, buf), done) in self.params.iter().zip(self.momentum_buffers.iter_mut()).zip(done) {
                if done {
                    continue;
                }
                let Some(mut g) = p.grad() else { continue };
                if self.weight_decay != 0.0 {
                    g = g.add(&p.mul_scalar(self.weight_decay)?)?;
                }
                if self.momentum != 0.0 {
                    let b = match buf.take() {
                        // A copy laid out as the parameter (`torch.clone` of a gradient laid
                        // out so). Asked of the parameter, not of `g`: inside a compiled step
                        // `g` is a traced value, whose tensor is contiguous.
                        None => g.copy_in(p.suggest_memory_format())?,
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
    fn params(&self) -> &[Tensor] {
        &self.params
    }
    fn state_dict(&self) -> Result<StateDict> {
        let mut sd = Vec::new();
        for (i, b) in self.momentum_buffers.iter().enumerate() {
            if let Some(b) = b {
                entry(&mut sd, i, "momentum_buffer", b)?;
            }
        }
        for (k, v) in [("lr", self.lr), ("momentum", self.momentum), ("dampening", self.dampening), ("nesterov", self.nesterov as u8 as f64), ("weight_decay", self.weight_decay)] {
            hyper(&mut sd, k, v)?;
        }
        Ok(sd)
    }
    fn load_state_dict(&mut self, sd: &[(String, Tensor)]) -> Result<()> {
        let mut r = Reader::new(sd, &self.params);
        let (lr, momentum, dampening, nesterov, wd) = (r.hyper("lr")?, r.hyper("momentum")?, r.hyper("dampening")?, r.hyper("nesterov")?, r.hyper("weight_decay")?);
        let bufs = (0..self.params.len()).map(|i| r.like_param(i, "momentum_buffer")).collect::<Result<Vec<_>>>()?;
        r.finish()?;
        (self.lr, self.momentum, self.dampening, self.nesterov, self.weight_decay) = (lr, momentum, dampening, nesterov != 0.0, wd);
        self.momentum_buffers = bufs;
        Ok(())
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

/// One parameter's Adam state: steps taken and the first and second moment estimates.
#[derive(Clone, Debug)]
pub struct AdamState {
    pub step: u64,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// The step count on the parameter's device, kept once a step ran inside a compiled
    /// function (as torch's `capturable`): a replayed step must read the current count, not
    /// the one it was traced with. When present it is the count.
    pub step_tensor: Option<Tensor>,
}

impl AdamState {
    /// The number of steps taken.
    pub fn steps(&self) -> Result<u64> {
        match &self.step_tensor {
            Some(t) => Ok(t.to_dtype(crate::DType::F64)?.to_device(&crate::Device::Cpu)?.item::<f64>()? as u64),
            None => Ok(self.step),
        }
    }
}

/// Adam (`decoupled` = false: weight decay added to the gradient) and AdamW (`decoupled`:
/// parameters shrink by lr * weight_decay before the update).
struct AdamCore {
    params: Vec<Tensor>,
    cfg: AdamConfig,
    decoupled: bool,
    foreach: bool,
    state: Vec<Option<AdamState>>,
}

impl AdamCore {
    fn new(params: Vec<Tensor>, cfg: AdamConfig, decoupled: bool) -> AdamCore {
        let n = params.len();
        AdamCore { params, cfg, decoupled, foreach: true, state: vec![None; n] }
    }

    #[track_caller]
    fn step(&mut self) -> Result<()> {
        let _site = crate::profiler::call_site();
        let c = self.cfg;
        c.validate(if self.decoupled { "adamw" } else { "adam" })?;
        no_grad(|| {
            let done = foreach::adam(self)?;
            for ((p, st), done) in self.params.iter().zip(self.state.iter_mut()).zip(done) {
                if done {
                    continue;
                }
                let Some(mut g) = p.grad() else { continue };
                if c.weight_decay != 0.0 {
                    if self.decoupled {
                        p.mul_scalar_(1.0 - c.lr * c.weight_decay)?;
                    } else {
                        g = g.add(&p.mul_scalar(c.weight_decay)?)?;
                    }
                }
                let s = match st {
                    Some(s) => s,
                    None => st.insert(AdamState { step: 0, exp_avg: p.zeros_like()?, exp_avg_sq: p.zeros_like()?, step_tensor: None }),
                };
                // As torch.optim.Adam: m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²;
                // p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
                let (m1, m2) = (&s.exp_avg, &s.exp_avg_sq);
                m1.mul_scalar_(c.beta1)?;
                m1.add_(&g.mul_scalar(1.0 - c.beta1)?)?;
                m2.mul_scalar_(c.beta2)?;
                m2.add_(&g.mul(&g)?.mul_scalar(1.0 - c.beta2)?)?;
                if crate::compile::tracing() || s.step_tensor.is_some() {
                    // The bias corrections from the device step count (F32, as torch's).
                    if s.step_tensor.is_none() {
                        s.step_tensor = Some(Tensor::scalar(s.step as f64, crate::DType::F32, &p.device())?);
                    }
                    let t = s.step_tensor.as_ref().expect("just set");
                    t.add_scalar_(1.0)?;
                    let pow = |beta: f64| Tensor::scalar(beta, crate::DType::F32, &p.device())?.pow(t);
                    let bc1 = pow(c.beta1)?.neg()?.add_scalar(1.0)?;
                    let bc2 = pow(c.beta2)?.neg()?.add_scalar(1.0)?;
                    let denom = m2.sqrt()?.div(&bc2.sqrt()?)?.add_scalar(c.eps)?;
                    p.sub_(&m1.div(&denom)?.mul(&bc1.reciprocal()?.mul_scalar(c.lr)?)?)?;
                } else {
                    s.step += 1;
                    let bc1 = 1.0 - c.beta1.powi(s.step as i32);
                    let bc2 = 1.0 - c.beta2.powi(s.step as i32);
                    let denom = m2.sqrt()?.div_scalar(bc2.sqrt())?.add_scalar(c.eps)?;
                    p.sub_(&m1.div(&denom)?.mul_scalar(c.lr / bc1)?)?;
                }
            }
            Ok(())
        })
    }

    fn state_dict(&self) -> Result<StateDict> {
        let mut sd = Vec::new();
        for (i, s) in self.state.iter().enumerate() {
            if let Some(s) = s {
                // PyTorch keeps the step as an F32 scalar tensor.
                sd.push((format!("state.{i}.step"), Tensor::scalar(s.steps()? as f64, crate::DType::F32, &crate::Device::Cpu)?));
                entry(&mut sd, i, "exp_avg", &s.exp_avg)?;
                entry(&mut sd, i, "exp_avg_sq", &s.exp_avg_sq)?;
            }
        }
        let c = self.cfg;
        sd.push(("param_groups.0.betas".into(), Tensor::from_vec(vec![c.beta1, c.beta2], &[2], &crate::Device::Cpu)?));
        for (k, v) in [("lr", c.lr), ("eps", c.eps), ("weight_decay", c.weight_decay)] {
            hyper(&mut sd, k, v)?;
        }
        Ok(sd)
    }

    fn load_state_dict(&mut self, sd: &[(String, Tensor)]) -> Result<()> {
        let op = "Optimizer::load_state_dict";
        let mut r = Reader::new(sd, &self.params);
        let (lr, eps, wd) = (r.hyper("lr")?, r.hyper("eps")?, r.hyper("weight_decay")?);
        let betas = r.find("param_groups.0.betas").ok_or_else(|| crate::Error::arg(op, "missing param_groups.0.betas"))?;
        if betas.shape() != [2] {
            return Err(crate::Error::shape(op, format!("param_groups.0.betas must have shape [2], got {:?}", betas.shape())));
        }
        let betas = betas.to_dtype(crate::DType::F64)?.to_vec::<f64>()?;
        let mut state = Vec::with_capacity(self.params.len());
        for i in 0..self.params.len() {
            let (step, m, v) = (r.step(i)?, r.like_param(i, "exp_avg")?, r.like_param(i, "exp_avg_sq")?);
            state.push(match (step, m, v) {
                (Some(step), Some(exp_avg), Some(exp_avg_sq)) => Some(AdamState { step, exp_avg, exp_avg_sq, step_tensor: None }),
                (None, None, None) => None,
                _ => return Err(crate::Error::arg(op, format!("state.{i} needs step, exp_avg and exp_avg_sq together"))),
            });
        }
        r.finish()?;
        self.cfg = AdamConfig { lr, beta1: betas[0], beta2: betas[1], eps, weight_decay: wd };
        self.state = state;
        Ok(())
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
            /// Whether `step` updates parameters on CUDA devices with multi-tensor kernels, a
            /// launch or a few for all of them (on by default, as PyTorch's `foreach` on CUDA),
            /// or with a few ops per parameter (`false`, PyTorch's `foreach=False`). The results
            /// are the same. CPU parameters and steps inside compiled functions always take the
            /// per-tensor ops.
            pub fn foreach(mut self, on: bool) -> $name {
                self.0.foreach = on;
                self
            }
            /// Each parameter's state (none before its first update).
            pub fn state(&self) -> &[Option<AdamState>] {
                &self.0.state
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
            fn params(&self) -> &[Tensor] {
                &self.0.params
            }
            fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
                self.0.state_dict()
            }
            fn load_state_dict(&mut self, sd: &[(String, Tensor)]) -> Result<()> {
                self.0.load_state_dict(sd)
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
