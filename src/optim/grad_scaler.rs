//! Loss scaling for F16 training (`torch.amp.GradScaler`): scales the loss so small F16
//! gradients survive, and skips steps whose gradients overflowed.

use super::Optimizer;
use crate::{no_grad, DType, Device, Error, Result, Tensor};

/// Dynamic loss scaling (`torch.amp.GradScaler`), PyTorch's defaults: scale 65536, doubled
/// after 2000 steps without overflow, halved on overflow. The check for inf/NaN reads one
/// value from the device per step.
#[derive(Clone, Debug)]
pub struct GradScaler {
    scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u64,
    growth_tracker: u64,
    /// Optimisers unscaled since the last `update`, by address, and whether each had an
    /// inf/NaN gradient (PyTorch also keeps this per optimiser).
    unscaled: Vec<(usize, bool)>,
    last_skipped: bool,
}

/// An optimiser's identity for the span of one step.
fn key<O: Optimizer + ?Sized>(opt: &O) -> usize {
    opt as *const O as *const u8 as usize
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

thread_local! {
    /// Losses this thread has scaled, traced ones included (`kiln::doctor` reads it).
    static SCALED_LOSSES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many losses this thread has scaled with a `GradScaler` so far.
pub(crate) fn scaled_losses() -> usize {
    SCALED_LOSSES.with(|n| n.get())
}

impl GradScaler {
    pub fn new() -> GradScaler {
        GradScaler::with_options(65536.0, 2.0, 0.5, 2000)
    }
    pub fn with_options(init_scale: f64, growth_factor: f64, backoff_factor: f64, growth_interval: u64) -> GradScaler {
        GradScaler { scale: init_scale, growth_factor, backoff_factor, growth_interval, growth_tracker: 0, unscaled: Vec::new(), last_skipped: false }
    }

    pub fn get_scale(&self) -> f64 {
        self.scale
    }

    /// `loss * scale`.
    #[track_caller]
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        SCALED_LOSSES.with(|n| n.set(n.get() + 1));
        loss.mul_scalar(self.scale)
    }

    /// Divides the optimiser's gradients by the scale in place and records whether any is
    /// inf/NaN (`unscale_`, for clipping before `step`). At most once per optimiser and step.
    #[track_caller]
    pub fn unscale_<O: Optimizer + ?Sized>(&mut self, opt: &O) -> Result<()> {
        let _site = crate::profiler::call_site();
        if self.unscaled.iter().any(|(k, _)| *k == key(opt)) {
            return Err(Error::arg("GradScaler::unscale_", "already called for this optimiser since the last update()"));
        }
        let inv = 1.0 / self.scale;
        let checks = no_grad(|| {
            let mut checks = Vec::new();
            for g in opt.params().iter().filter_map(|p| p.grad()) {
                g.mul_scalar_(inv)?;
                // x * 0 is 0 for finite x and NaN for inf/NaN: one sum per gradient.
                checks.push(g.mul_scalar(0.0)?.to_dtype(DType::F32)?.sum_all()?);
            }
            Ok::<_, Error>(checks)
        })?;
        let found = if checks.is_empty() { false } else { !crate::stack(&checks.iter().collect::<Vec<_>>(), 0)?.sum_all()?.item::<f32>()?.is_finite() };
        self.unscaled.push((key(opt), found));
        Ok(())
    }

    /// Unscales (unless `unscale_` already did) and runs `opt.step()` only if every gradient
    /// is finite.
    #[track_caller]
    pub fn step<O: Optimizer + ?Sized>(&mut self, opt: &mut O) -> Result<()> {
        let _site = crate::profiler::call_site();
        if !self.unscaled.iter().any(|(k, _)| *k == key(opt)) {
            self.unscale_(opt)?;
        }
        let found = self.unscaled.iter().any(|(k, f)| *k == key(opt) && *f);
        if !found {
            opt.step()?;
        }
        self.last_skipped = found;
        Ok(())
    }

    /// Whether the last `step` was skipped for a non-finite gradient.
    pub fn step_was_skipped(&self) -> bool {
        self.last_skipped
    }

    /// Adjusts the scale after a step: back off on overflow, grow after `growth_interval`
    /// clean steps.
    pub fn update(&mut self) -> Result<()> {
        if self.unscaled.is_empty() {
            return Err(Error::arg("GradScaler::update", "no inf checks were recorded: call step() (or unscale_) first"));
        }
        let found = self.unscaled.iter().any(|(_, f)| *f);
        if found {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
        self.unscaled.clear();
        Ok(())
    }

    /// PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker
    /// (F64 scalars).
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let s = |k: &str, v: f64| Ok((k.to_string(), Tensor::scalar(v, DType::F64, &Device::Cpu)?));
        vec![
            s("scale", self.scale),
            s("growth_factor", self.growth_factor),
            s("backoff_factor", self.backoff_factor),
            s("growth_interval", self.growth_interval as f64),
            s("_growth_tracker", self.growth_tracker as f64),
        ]
        .into_iter()
        .collect()
    }

    pub fn load_state_dict(&mut self, sd: &[(String, Tensor)]) -> Result<()> {
        let get = |k: &str| -> Result<f64> {
            let (_, t) = sd.iter().find(|(n, _)| n == k).ok_or_else(|| Error::arg("GradScaler::load_state_dict", format!("missing {k}")))?;
            if t.numel() != 1 {
                return Err(Error::shape("GradScaler::load_state_dict", format!("{k} must hold one value, got shape {:?}", t.shape())));
            }
            t.to_dtype(DType::F64)?.reshape(&[])?.item::<f64>()
        };
        let (scale, gf, bf, gi, gt) = (get("scale")?, get("growth_factor")?, get("backoff_factor")?, get("growth_interval")?, get("_growth_tracker")?);
        *self = GradScaler { scale, growth_factor: gf, backoff_factor: bf, growth_interval: gi as u64, growth_tracker: gt as u64, unscaled: Vec::new(), last_skipped: false };
        Ok(())
    }
}
