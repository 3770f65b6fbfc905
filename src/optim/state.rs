//! Optimiser state dicts in PyTorch's layout, flattened to dotted names so they save as
//! safetensors like a model's: `state.<i>.<name>` per parameter (by position) and
//! `param_groups.0.<hyperparameter>` as F64 scalars.

use crate::{DType, Device, Error, Result, Tensor};

pub(crate) type StateDict = Vec<(String, Tensor)>;

const OP: &str = "Optimizer::load_state_dict";

pub(crate) fn hyper(sd: &mut StateDict, name: &str, v: f64) -> Result<()> {
    sd.push((format!("param_groups.0.{name}"), Tensor::scalar(v, DType::F64, &Device::Cpu)?));
    Ok(())
}

/// A copy of `t` in the state dict (so later steps do not change a saved dict).
pub(crate) fn entry(sd: &mut StateDict, i: usize, name: &str, t: &Tensor) -> Result<()> {
    sd.push((format!("state.{i}.{name}"), crate::no_grad(|| t.copy_contiguous())?));
    Ok(())
}

/// Reads a state dict back, checking that every key is known and every tensor fits.
pub(crate) struct Reader<'a> {
    sd: &'a [(String, Tensor)],
    params: &'a [Tensor],
    used: Vec<bool>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(sd: &'a [(String, Tensor)], params: &'a [Tensor]) -> Self {
        Reader { sd, params, used: vec![false; sd.len()] }
    }

    /// The tensor under `key`, marked as read.
    pub(crate) fn find(&mut self, key: &str) -> Option<&'a Tensor> {
        let i = self.sd.iter().position(|(n, _)| n == key)?;
        self.used[i] = true;
        Some(&self.sd[i].1)
    }

    pub(crate) fn hyper(&mut self, name: &str) -> Result<f64> {
        let key = format!("param_groups.0.{name}");
        let t = self.find(&key).ok_or_else(|| Error::arg(OP, format!("missing {key}")))?;
        if t.numel() != 1 {
            return Err(Error::shape(OP, format!("{key} must hold one value, got shape {:?}", t.shape())));
        }
        t.to_dtype(DType::F64)?.reshape(&[])?.item::<f64>()
    }

    /// `state.<i>.<name>` shaped like parameter `i`, on its device and in its dtype.
    pub(crate) fn like_param(&mut self, i: usize, name: &str) -> Result<Option<Tensor>> {
        let key = format!("state.{i}.{name}");
        let Some(t) = self.find(&key) else { return Ok(None) };
        let p = &self.params[i];
        if t.shape() != p.shape() {
            return Err(Error::shape(OP, format!("{key} has shape {:?}, parameter {i} has {:?}", t.shape(), p.shape())));
        }
        Ok(Some(crate::no_grad(|| t.to_dtype(p.dtype())?.to_device(&p.device())?.copy_contiguous())?))
    }

    /// `state.<i>.step` as a count.
    pub(crate) fn step(&mut self, i: usize) -> Result<Option<u64>> {
        let key = format!("state.{i}.step");
        let Some(t) = self.find(&key) else { return Ok(None) };
        if t.numel() != 1 {
            return Err(Error::shape(OP, format!("{key} must hold one value, got shape {:?}", t.shape())));
        }
        Ok(Some(t.to_dtype(DType::F64)?.reshape(&[])?.item::<f64>()? as u64))
    }

    /// Fails on keys nobody read (another optimiser's state, or more parameters than this one).
    pub(crate) fn finish(self) -> Result<()> {
        let extra: Vec<&str> = self.sd.iter().zip(&self.used).filter(|(_, u)| !**u).map(|((n, _), _)| n.as_str()).collect();
        if !extra.is_empty() {
            return Err(Error::arg(OP, format!("unexpected keys for this optimiser with {} parameters: {}", self.params.len(), extra.join(", "))));
        }
        Ok(())
    }
}
