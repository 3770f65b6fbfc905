//! Learning-rate schedules (`torch.optim.lr_scheduler`), in closed form: `step()` advances one
//! epoch (or iteration) and sets the optimiser's learning rate.

use super::Optimizer;

pub trait LrScheduler {
    /// The learning rate after `t` steps, from the base rate.
    fn lr_at(&self, t: u64) -> f64;
    #[doc(hidden)]
    fn counter(&mut self) -> &mut u64;
    /// Advances one step and applies the new rate to `opt`.
    fn step(&mut self, opt: &mut dyn Optimizer) {
        *self.counter() += 1;
        let t = *self.counter();
        opt.set_lr(self.lr_at(t));
    }
}

/// `lr = base * gamma^(t / step_size)` (integer division): `StepLR`.
pub struct StepLr {
    pub base: f64,
    pub step_size: u64,
    pub gamma: f64,
    t: u64,
}
impl StepLr {
    pub fn new(opt: &dyn Optimizer, step_size: u64, gamma: f64) -> StepLr {
        StepLr { base: opt.lr(), step_size: step_size.max(1), gamma, t: 0 }
    }
}
impl LrScheduler for StepLr {
    fn lr_at(&self, t: u64) -> f64 {
        self.base * self.gamma.powi((t / self.step_size) as i32)
    }
    fn counter(&mut self) -> &mut u64 {
        &mut self.t
    }
}

/// Cosine from `base` down to `eta_min` over `t_max` steps: `CosineAnnealingLR`.
pub struct CosineAnnealingLr {
    pub base: f64,
    pub t_max: u64,
    pub eta_min: f64,
    t: u64,
}
impl CosineAnnealingLr {
    pub fn new(opt: &dyn Optimizer, t_max: u64, eta_min: f64) -> CosineAnnealingLr {
        CosineAnnealingLr { base: opt.lr(), t_max: t_max.max(1), eta_min, t: 0 }
    }
}
impl LrScheduler for CosineAnnealingLr {
    fn lr_at(&self, t: u64) -> f64 {
        let x = std::f64::consts::PI * t as f64 / self.t_max as f64;
        self.eta_min + (self.base - self.eta_min) * (1.0 + x.cos()) / 2.0
    }
    fn counter(&mut self) -> &mut u64 {
        &mut self.t
    }
}

/// Linear warm-up: the rate goes from `start_factor * base` to `base` over `warmup` steps,
/// then stays (`LinearLR` with end factor 1). The optimiser starts at the warm-up's first rate.
pub struct LinearWarmup {
    pub base: f64,
    pub start_factor: f64,
    pub warmup: u64,
    t: u64,
}
impl LinearWarmup {
    pub fn new(opt: &mut dyn Optimizer, start_factor: f64, warmup: u64) -> LinearWarmup {
        let s = LinearWarmup { base: opt.lr(), start_factor, warmup: warmup.max(1), t: 0 };
        opt.set_lr(s.lr_at(0));
        s
    }
}
impl LrScheduler for LinearWarmup {
    fn lr_at(&self, t: u64) -> f64 {
        let f = self.start_factor + (1.0 - self.start_factor) * (t.min(self.warmup) as f64 / self.warmup as f64);
        self.base * f
    }
    fn counter(&mut self) -> &mut u64 {
        &mut self.t
    }
}
