//! `Module`: forward plus named parameters and buffers with PyTorch's dotted names, train/eval,
//! and state dicts (in memory and as safetensors files).

use crate::{no_grad, Error, Result, Tensor};

pub trait Module: Send + Sync {
    /// `#[track_caller]`, so that the profiler can name the caller's line for the work it queues.
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// This module's own parameters (not its children's), by local name.
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![]
    }
    /// This module's own buffers (running statistics and the like), by local name.
    fn own_buffers(&self) -> Vec<(String, Tensor)> {
        vec![]
    }
    /// Submodules, by name (`"0"`, `"linear1"`, ...).
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![]
    }
    /// Sets this module's own training flag (modules that behave differently keep one).
    fn set_training(&self, _training: bool) {}

    /// Calls `f` on every parameter and buffer slot, this module's and its children's, so that
    /// `to_device` / `to_dtype` can replace them.
    fn visit_tensors_mut(&mut self, _f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        Ok(())
    }

    /// Moves every parameter and buffer to `device` (they stay leaves that require grad).
    fn to_device(&mut self, device: &crate::Device) -> Result<()> {
        self.visit_tensors_mut(&mut |t| replace(t, |x| x.to_device(device)))
    }

    /// Converts floating-point parameters and buffers to `dtype` (integer buffers stay).
    fn to_dtype(&mut self, dtype: crate::DType) -> Result<()> {
        self.visit_tensors_mut(&mut |t| if t.dtype().is_float() { replace(t, |x| x.to_dtype(dtype)) } else { Ok(()) })
    }

    /// Stores every 4-D floating-point parameter and buffer (convolution weights) in `format`
    /// (`module.to(memory_format=...)`); a channels-last network then computes channels-last
    /// when its input is.
    fn to_memory_format(&mut self, format: crate::MemoryFormat) -> Result<()> {
        self.visit_tensors_mut(&mut |t| if t.ndim() == 4 && t.dtype().is_float() { replace(t, |x| x.to_memory_format(format)) } else { Ok(()) })
    }

    /// Every parameter with its dotted path (`"0.weight"`), depth first, as PyTorch orders them.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = self.own_parameters();
        for (name, child) in self.children() {
            out.extend(child.named_parameters().into_iter().map(|(n, t)| (format!("{name}.{n}"), t)));
        }
        out
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = self.own_buffers();
        for (name, child) in self.children() {
            out.extend(child.named_buffers().into_iter().map(|(n, t)| (format!("{name}.{n}"), t)));
        }
        out
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }
    /// Training mode for this module and all below it.
    fn train(&self) {
        self.set_mode(true);
    }
    /// Evaluation mode (dropout off, running statistics used).
    fn eval(&self) {
        self.set_mode(false);
    }
    #[doc(hidden)]
    fn set_mode(&self, training: bool) {
        self.set_training(training);
        for (_, c) in self.children() {
            c.set_mode(training);
        }
    }

    /// Parameters and buffers by dotted name.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut sd = self.named_parameters();
        sd.extend(self.named_buffers());
        sd
    }

    /// Copies `sd` into this module's parameters and buffers. Names, shapes and dtypes must
    /// match exactly and each name may occur once; every mismatch is listed in one error and
    /// nothing is written then. Each value is first copied to its slot's device, so that a
    /// failed transfer (out of memory, say) also leaves the module as it was.
    fn load_state_dict(&self, sd: &[(String, Tensor)]) -> Result<()> {
        let mine = self.state_dict();
        let mut problems = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(sd.len());
        for (name, _) in sd {
            if !seen.insert(name.as_str()) {
                problems.push(format!("duplicate {name} in the state dict"));
            }
        }
        let mut pairs = Vec::with_capacity(mine.len());
        for (name, t) in &mine {
            match sd.iter().find(|(n, _)| n == name) {
                None => problems.push(format!("missing {name}")),
                Some((_, s)) if s.shape() != t.shape() => problems.push(format!("{name}: shape {:?} in the state dict, {:?} in the module", s.shape(), t.shape())),
                Some((_, s)) if s.dtype() != t.dtype() => problems.push(format!("{name}: dtype {:?} in the state dict, {:?} in the module", s.dtype(), t.dtype())),
                Some((_, s)) => pairs.push((t, s)),
            }
        }
        for (name, _) in sd {
            if !mine.iter().any(|(n, _)| n == name) {
                problems.push(format!("unexpected {name}"));
            }
        }
        if !problems.is_empty() {
            return Err(Error::arg("load_state_dict", problems.join("; ")));
        }
        no_grad(|| {
            // Every fallible step but the writes themselves happens before the first write. A
            // value that shares storage with a slot (this module's own tensors, reordered) is
            // copied first, so no write reads what an earlier one changed.
            let stage = |t: &Tensor, s: &Tensor| {
                let v = s.to_device(&t.device())?;
                if mine.iter().any(|(_, m)| m.shares_storage_with(&v)) { v.copy_contiguous() } else { Ok(v) }
            };
            let staged = pairs.iter().map(|(t, s)| Ok((*t, stage(t, s)?))).collect::<Result<Vec<_>>>()?;
            for (t, s) in &staged {
                t.copy_(s)?;
            }
            Ok(())
        })
    }

    /// Writes the state dict to a safetensors file, atomically (temporary file, then rename).
    /// Any path type is taken, so a trait object (whose methods cannot be generic) saves with
    /// `nn::safetensors::save(&m.state_dict(), path)` instead.
    fn save_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()>
    where
        Self: Sized,
    {
        crate::nn::safetensors::save(&self.state_dict(), path)
    }

    /// Loads a safetensors state dict written by kiln or exported from PyTorch. A file that fails
    /// to read or does not fit this module changes nothing. A trait object loads with
    /// `m.load_state_dict(&nn::safetensors::load(path, &Device::Cpu)?)`.
    fn load_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()>
    where
        Self: Sized,
    {
        load_file(self, path.as_ref())
    }
}

/// `load_safetensors`: a file that does not fit the module is an error naming the file too.
fn load_file(m: &dyn Module, path: &std::path::Path) -> Result<()> {
    let sd = crate::nn::safetensors::load(path, &crate::Device::Cpu)?;
    m.load_state_dict(&sd).map_err(|e| match e {
        Error::Arg { msg, .. } => Error::Arg { op: "load_safetensors", msg: format!("{} does not fit the module: {msg}", path.display()) },
        e => e,
    })
}

/// Replaces a parameter slot with `f(value)`, keeping it a leaf that requires grad if it was.
fn replace(t: &mut Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<()> {
    let grad = t.is_requires_grad();
    let new = no_grad(|| f(&t.detach()))?.detach();
    *t = if grad { new.requires_grad() } else { new };
    Ok(())
}

/// The own parameters of a layer with a weight and an optional bias (Linear, Conv2d).
pub(crate) fn weight_and_bias(weight: &Tensor, bias: Option<&Tensor>) -> Vec<(String, Tensor)> {
    let mut p = vec![("weight".to_string(), weight.clone())];
    if let Some(b) = bias {
        p.push(("bias".into(), b.clone()));
    }
    p
}

/// `visit_tensors_mut` for a layer with a weight and an optional bias.
pub(crate) fn visit_weight_and_bias(weight: &mut Tensor, bias: Option<&mut Tensor>, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
    f(weight)?;
    if let Some(b) = bias {
        f(b)?;
    }
    Ok(())
}
